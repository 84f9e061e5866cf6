"""A source that keeps no row (or under 1% of its rows) is refused before anything launches, in one line
with the rows read, the top skip reasons and the likely fix (ftcli.data.checks)."""

from __future__ import annotations

import pytest
from _data_common import recipe, tokenizer, write_jsonl

from ftcli.config.errors import TrainingStopped, UserError
from ftcli.data import check_sources, prepare_blocks
from ftcli.data.checks import quick_check, source_problems
from ftcli.data.spec import data_spec

MESSAGES = {"messages": [{"role": "user", "content": "What is 7 plus 6?"}, {"role": "assistant", "content": "13"}]}
SHAREGPT = {"conversations": [{"from": "human", "value": "What is 7 plus 6?"}, {"from": "gpt", "value": "13"}]}


def test_sharegpt_rows_read_as_messages_are_refused_with_the_fix(tmp_path):
    path = write_jsonl(tmp_path / "sg.jsonl", [SHAREGPT] * 198)
    r = recipe(tmp_path, data__path=path, data__format="messages")
    want = (f"data source '{path}' keeps 0 of the 198 rows read (messages missing 198, row 0: no 'messages' field "
            "(fields: conversations)) [format messages]; looks like ShareGPT: set data.format=sharegpt")
    with pytest.raises(UserError) as quick:
        quick_check(data_spec(r))
    with pytest.raises(UserError) as full:
        check_sources(r.data, prepare_blocks(r, tokenizer("qwen")))
    assert str(quick.value) == str(full.value) == want


def test_under_auto_there_is_nothing_to_set_and_unknown_rows_say_so(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "q", "answer": "a"}] * 5)
    r = recipe(tmp_path, data__path=path, data__format="auto")
    with pytest.raises(UserError) as e:
        quick_check(data_spec(r))
    assert str(e.value) == (
        f"data source '{path}' keeps 0 of the 5 rows read (messages missing 5, row 0: no 'messages' field (fields: "
        "question, answer)) [format messages]; no row matches a known format (messages, sharegpt, alpaca, "
        "prompt_completion, text); see docs/data.md")
    quick_check(data_spec(recipe(tmp_path, data__path=write_jsonl(tmp_path / "sg.jsonl", [SHAREGPT] * 5),
                                  data__format="auto")))


def test_a_source_keeping_under_one_percent_is_refused_after_tokenizing(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [MESSAGES] + [{"messages": []}] * 199)
    r = recipe(tmp_path, data__path=path)
    quick_check(data_spec(r))  # one row is valid: the rows alone do not decide it
    with pytest.raises(UserError, match=r"keeps 1 of the 200 rows read \(no messages 199, row 1\) \[format messages\]$"):
        check_sources(r.data, prepare_blocks(r, tokenizer("qwen")))


def test_a_dead_source_in_a_mix_is_refused_unless_allowed(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [MESSAGES] * 4)
    dead = write_jsonl(tmp_path / "dead.jsonl", [SHAREGPT] * 4)
    sources = (f"[{{source: local, path: {good}, format: messages}}, "
               f"{{source: local, path: {dead}, name: dead, format: messages}}]")
    r = recipe(tmp_path, data__sources=sources)
    with pytest.raises(UserError, match=r"^data source 'dead' keeps 0 of the 4 rows read .*; looks like ShareGPT: set "
                                        r"data\.sources\[1\]\.format=sharegpt; data\.allow_empty_sources=true"):
        quick_check(data_spec(r))
    allowed = recipe(tmp_path, data__sources=sources, data__allow_empty_sources="true")
    quick_check(data_spec(allowed))
    packed = check_sources(allowed.data, prepare_blocks(allowed, tokenizer("qwen")))
    assert packed.stats.examples_kept == 4
    assert [p.split(" (")[0] for p in source_problems(allowed.data, packed.stats)] == [
        "data source 'dead' keeps 0 of the 4 rows read"]


def test_eval_data_without_trained_tokens_stops_every_rank_and_only_rank_0_reports(tmp_path):
    """TrainingStopped: the workers' other ranks exit quietly (ftcli.train.launch._worker), so it prints once."""
    from ftcli.train.evaluate import prepare_eval

    train = write_jsonl(tmp_path / "train.jsonl", [MESSAGES] * 4)
    bad = write_jsonl(tmp_path / "eval.jsonl", [{"messages": []}] * 3)
    from ftcli.config.recipe import load_recipe

    r = load_recipe("tiny-qwen-cpu", [f"data.cache_dir={tmp_path / 'cache'}", f"data.path={train}",
                                      f"eval={{path: {bad}, source: local, split: train}}"])
    with pytest.raises(TrainingStopped) as e:
        prepare_eval(data_spec(r), r.eval, tokenizer("qwen"))
    assert str(e.value) == (f"the eval data ({bad}) has no trained token; check eval.path / eval.sources, or train "
                            "without eval: --set eval.enabled=false")


def test_a_zero_row_train_stops_before_launch_and_writes_nothing(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import ftcli.model.checks
    from ftcli.cli import app

    def no_model_check(recipe):
        raise AssertionError("the model check (torch) ran: the data was not refused first")

    monkeypatch.setattr(ftcli.model.checks, "check_model_config", no_model_check)
    path = write_jsonl(tmp_path / "sg.jsonl", [SHAREGPT] * 198)
    run_dir = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "--recipe", "tiny-qwen-cpu", "--set", f"data.path={path}",
                                      "--set", f"output.dir={run_dir}", "--set", f"data.cache_dir={tmp_path / 'c'}"])
    assert result.exit_code == 2, result.output
    assert "keeps 0 of the 198 rows read" in result.output and "set data.format=sharegpt" in result.output
    assert not run_dir.exists() and not (tmp_path / "c").exists()


def test_under_a_bare_torchrun_the_refusal_prints_once(tmp_path):
    """torchrun started by hand (a Databricks workload): rank 0 refuses the source, rank 1 stops quietly."""
    import subprocess
    import sys

    from _run_common import recipe_file, subprocess_env

    path = write_jsonl(tmp_path / "sg.jsonl", [SHAREGPT] * 50)
    r = recipe_file(tmp_path / "r.yaml", f"data.path={path}", "tracking.enabled=false", f"output.dir={tmp_path / 'run'}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "ftcli", "train", "--recipe", str(r)]
    res = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(tmp_path / "cache"), capture_output=True, text=True,
                         timeout=240)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode != 0 and len(errors) == 1, res.stderr[-3000:]
    assert errors[0].startswith(f"error: data source '{path}' keeps 0 of the 50 rows read (messages missing 50")
    assert "looks like ShareGPT: set data.format=sharegpt" in errors[0]
    assert "[rank1]" not in res.stderr and "gloo" not in res.stderr  # (the traceback left is torchrun's agent's)


# 120 Alpaca rows, 6 distinct ones 20 times each (a small dataset whose rows repeat): no row hashes under 0.02
SMALL = [{"instruction": f"Add {a} and {a + 1}.", "input": "", "output": str(2 * a + 1)} for a in range(6)] * 20


def test_an_empty_eval_split_is_refused_before_launch_with_the_way_out(tmp_path, monkeypatch):
    """eval.holdout=0.02 of a small dataset holds out nothing: `train` refuses it before torchrun starts (nothing
    written) and `pack-preview` warns, in one line naming both ways out, and both ways out work."""
    from typer.testing import CliRunner

    from ftcli.cli import app

    path = write_jsonl(tmp_path / "small.jsonl", SMALL)
    want = ("the eval split is empty: eval.holdout=0.02 (0.02 of the rows) holds out 0 row(s) with no trained "
            "token; hold out a row count instead (--set eval.holdout=10), or train without eval: --set "
            "eval.enabled=false")
    run_dir, sets = tmp_path / "run", ["--set", f"data.path={path}", "--set", "data.format=auto",
                                       "--set", f"data.cache_dir={tmp_path / 'c'}"]
    res = CliRunner().invoke(app, ["train", "--recipe", "tiny-qwen-cpu", *sets, "--set", f"output.dir={run_dir}"])
    assert res.exit_code == 2 and " ".join(res.output.split()).endswith(f"error: {want}"), res.output
    assert not run_dir.exists()
    res = CliRunner().invoke(app, ["pack-preview", "--recipe", "tiny-qwen-cpu", *sets, "--json"])
    assert res.exit_code == 0 and f"warning: {want}" in " ".join(res.stderr.split())
    assert sum(s["examples"]["read"] for s in __import__("json").loads(res.stdout)["eval"].values()) == 0
    for way_out in ("eval.enabled=false", "eval.holdout=0", "eval.holdout=10"):
        res = CliRunner().invoke(app, ["pack-preview", "--recipe", "tiny-qwen-cpu", *sets, "--set", way_out, "--json"])
        assert res.exit_code == 0 and "warning" not in res.stderr, (way_out, res.stderr)
        held = [s["examples"]["read"] for s in __import__("json").loads(res.stdout).get("eval", {}).values()]
        assert held == ([20] if way_out == "eval.holdout=10" else []), way_out  # 10 rows: every copy of them


def test_a_holdout_row_count_holds_out_every_copy_of_its_rows(tmp_path):
    """eval.holdout=N holds out the N rows of smallest hash and every copy of them: on rows that repeat it
    holds out at least N rows (it held out none when the N-th and N+1-th rows were copies), the same rows
    never on both sides."""
    from ftcli.data import iter_examples
    from ftcli.data.evalsplit import eval_specs

    path = write_jsonl(tmp_path / "small.jsonl", SMALL)
    for count, held in ((5, 20), (20, 20), (21, 40), (200, 120)):
        r = recipe(tmp_path, data__path=path, data__format="alpaca", eval=f"{{holdout: {count}}}")
        (ev,) = eval_specs(data_spec(r), r.eval).values()
        train_ix = [ex.index for ex in iter_examples(r, tokenizer("qwen"))]
        eval_ix = [ex.index for ex in iter_examples(ev, tokenizer("qwen"))]
        assert len(eval_ix) == held and sorted(train_ix + eval_ix) == list(range(120)), count
        assert not {str(SMALL[i]) for i in train_ix} & {str(SMALL[i]) for i in eval_ix}


def test_a_missing_relative_data_path_says_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        quick_check(data_spec(recipe(tmp_path, data__path="chats/nope.jsonl")))
    assert str(e.value) == (f"data.path 'chats/nope.jsonl' does not exist (tried {tmp_path / 'chats' / 'nope.jsonl'}: "
                            "a relative path is read from the working directory, or from the recipe file's folder "
                            "where it is there)")
