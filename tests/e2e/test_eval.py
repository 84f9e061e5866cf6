"""Held-out evaluation (ftcli.train.evaluate, ftcli.data.evalsplit) in the FSDP2 loop, on the tiny Qwen3.5 hybrid.

The invariants: the held-out rows are disjoint from training and chosen by content (stable across runs,
row order and world sizes); the eval loss is the same for 1 and 2 ranks, for two eval block lengths and
for packed vs one example per block; a run with eval trains exactly like one without; keep_best keeps the
best eval's checkpoint through rotation and eval.export=best makes it the final model; early stopping
stops with a final checkpoint and says why; samples.jsonl holds exactly what sample_greedy gives on the
saved model of that step; run.json's data summary is pack-preview's. Two `ftcli train` runs (2 processes,
8 steps, lr 0.03 so that the eval loss turns up at step 4) are shared by the tests through fixtures.
"""

from __future__ import annotations

import json

import pytest
import torch

from _run_common import REPO, env, ftcli, metrics, output_tail, torchrun, train_args  # noqa: F401 (env: a fixture)

SOURCE = "pkg://assets/tiny_chat.jsonl"
COMMON = ["training.max_steps=8", "training.optimizer.lr=0.03", "data.max_examples=600", "training.log_every=1"]
PROMPTS = '["What is 2 plus 3?", [{"role": "user", "content": "Name a color."}]]'
# separate eval rows (the first 40 of the file; training reads the same 600 rows either way), every step
EVAL = ["eval.holdout=null", "eval.path=" + SOURCE, "eval.max_examples=40", "eval.every_steps=1", "eval.at_start=true",
        "eval.early_stop={patience: 1, min_delta: 0.0}", "eval.export=best", f"eval.samples={PROMPTS}",
        "eval.samples_max_new_tokens=8", "training.checkpoint.keep_best=true", "training.checkpoint.every_steps=1",
        "training.checkpoint.keep_last=1"]


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, env):
    cwd = tmp_path_factory.mktemp("plain")
    res = ftcli(train_args(cwd / "run", *COMMON, "eval=null", "tracking.enabled=false", "training.checkpoint.enabled=false"),
                cwd, env)
    assert res.returncode == 0, output_tail(res)
    return cwd / "run"


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory, env):
    cwd = tmp_path_factory.mktemp("eval")
    res = ftcli(train_args(cwd / "run", *COMMON, *EVAL), cwd, env)
    assert res.returncode == 0, output_tail(res)
    return {"cwd": cwd, "run_dir": cwd / "run", "stdout": res.stdout}


# ------------------------------------------------------------------------------------- the split
def _indices(recipe, tokenizer) -> list[int]:
    from ftcli.data import iter_examples

    return [ex.index for ex in iter_examples(recipe, tokenizer)]


def test_holdout_disjoint_from_training_and_stable(tmp_path):
    """Share and row-count holdouts: train + eval rows partition the rows read, the same on every call, and
    the held-out rows are chosen by content (the file's rows reversed: the same rows held out)."""
    from ftcli.data import load_tokenizer
    from ftcli.data.evalsplit import eval_specs
    from ftcli.data.spec import data_spec
    from ftcli.config.recipe import load_recipe, resolve_path

    rows = open(resolve_path(SOURCE)).read().splitlines()[:300]
    forward, backward = tmp_path / "f.jsonl", tmp_path / "b.jsonl"
    forward.write_text("\n".join(rows) + "\n")
    backward.write_text("\n".join(reversed(rows)) + "\n")
    qwen = load_recipe("tiny-qwen-cpu")
    tokenizer = load_tokenizer(qwen.model, qwen.data)
    for holdout, expected in (("0.1", None), ("25", 25)):
        held = {}
        for path in (forward, backward):
            recipe = load_recipe("tiny-qwen-cpu", [f"data.path={path}", f"eval.holdout={holdout}", "eval.holdout_seed=7"])
            (ev,) = eval_specs(data_spec(recipe), recipe.eval).values()
            train_ix, eval_ix = _indices(recipe, tokenizer), _indices(ev, tokenizer)
            assert sorted(train_ix + eval_ix) == list(range(300))  # disjoint, and nothing lost
            assert eval_ix == _indices(ev, tokenizer)  # stable
            held[path.name] = sorted(rows[i] if path == forward else rows[299 - i] for i in eval_ix)
        assert held["f.jsonl"] == held["b.jsonl"]  # by content, not by position
        n = len(held["f.jsonl"])
        assert (n == expected) if expected else (15 <= n <= 45), n


def test_holdout_and_eval_keys_validated():
    from ftcli.config.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="set one of holdout, path, sources"):
        load_recipe("tiny-qwen-cpu", ["eval.holdout=0.1", f"eval.path={SOURCE}"])
    with pytest.raises(RecipeError, match="keep_best needs eval data"):
        load_recipe("tiny-qwen-cpu", ["eval=null", "training.checkpoint.keep_best=true"])
    with pytest.raises(RecipeError, match="export=best needs training.checkpoint.keep_best"):
        load_recipe("tiny-qwen-cpu", ["eval.holdout=0.1", "eval.export=best"])
    with pytest.raises(RecipeError, match="whole row count"):
        load_recipe("tiny-qwen-cpu", ["eval.holdout=2.5"])


# --------------------------------------------------------------------------------- the invariants
@pytest.fixture(scope="module")
def worker_evals(tmp_path_factory, env, plain_run):
    out = tmp_path_factory.mktemp("evals")
    for n in (1, 2):
        res = torchrun(n, [str(out), str(out / "cache"), str(plain_run / "final")], out, env,
                       worker=REPO / "tests" / "support" / "_eval_worker.py")
        assert res.returncode == 0, output_tail(res)
    return {n: json.loads((out / f"evals_{n}.json").read_text()) for n in (1, 2)}


def test_eval_loss_same_for_1_and_2_ranks_block_lengths_and_packing(worker_evals):
    """The trained model's eval loss over the same 40 held-out rows, to 1e-6 (fp32 CPU)."""
    ref = worker_evals[1]["bfd_1024"]
    assert 2.5 < ref["loss"] < 4.0 and ref["tokens"] > 500, ref  # a trained model, not a uniform one
    for n in (1, 2):
        for name, r in worker_evals[n].items():
            assert r["loss"] == pytest.approx(ref["loss"], rel=1e-6, abs=0), (n, name, r, ref)
            assert r["tokens"] == ref["tokens"] and r["rng_untouched"] and r["training_mode"], (n, name, r)
    blocks = {name: r["blocks"] for name, r in worker_evals[1].items()}
    assert blocks["one_per_block"] == 40 and blocks["bfd_2048"] < blocks["bfd_1024"] < 40, blocks


# ---------------------------------------------------------------------------------- the runs
def test_run_with_eval_trains_exactly_like_one_without(plain_run, eval_run):
    plain = metrics(plain_run)
    with_eval = [m for m in metrics(eval_run["run_dir"]) if "loss" in m]
    assert len(with_eval) == 4  # early stop after step 4 (below)
    for a, b in zip(plain, with_eval):
        assert (a["step"], a["loss"], a["grad_norm"], a["tokens_trained"]) == \
            (b["step"], b["loss"], b["grad_norm"], b["tokens_trained"])


def test_eval_results_in_step_line_metrics_mlflow_and_run_json(eval_run):
    from mlflow.tracking import MlflowClient

    run_dir = eval_run["run_dir"]
    lines = metrics(run_dir)
    assert lines[0]["step"] == 0 and "loss" not in lines[0] and lines[0]["eval_tokens"] > 0  # eval.at_start
    evals = [(m["step"], m["eval_loss"]) for m in lines]
    assert [s for s, _ in evals] == [0, 1, 2, 3, 4]
    assert evals[0][1] > 6.5 and evals[3][1] < 4.0 and evals[4][1] > evals[3][1], evals  # falls, then turns up
    assert all(m["eval_ppl"] == pytest.approx(2.718281828459045 ** m["eval_loss"]) for m in lines)
    assert f"| eval {evals[3][1]:.4f} (ppl" in eval_run["stdout"]
    record = json.loads((run_dir / "run.json").read_text())
    assert [(e["step"], e["loss"]) for e in record["evals"]] == evals
    assert record["best_step"] == 3 and record["best_eval_loss"] == evals[3][1]
    client = MlflowClient(record["mlflow"]["tracking_uri"])
    history = client.get_metric_history(record["mlflow"]["run_id"], "eval_loss")
    history = sorted((h.step, h.value) for h in history)
    assert [h[0] for h in history] == [e[0] for e in evals]
    assert [h[1] for h in history] == pytest.approx([e[1] for e in evals], rel=1e-12)
    (blocks,) = client.get_metric_history(record["mlflow"]["run_id"], "data/blocks")
    assert (blocks.step, blocks.value) == (0, record["data"]["blocks"])
    (eval_split,) = record["eval_data"].values()
    assert eval_split["examples"]["kept"] == 40 and eval_split["trained_tokens"] == lines[0]["eval_tokens"]
    tables = {a.path for a in client.list_artifacts(record["mlflow"]["run_id"], "samples")}
    assert tables == {f"samples/step_{s:08d}.json" for s in (1, 2, 3, 4)}, tables


def test_early_stop_keep_best_and_export_best(eval_run):
    """patience 1: the first eval that does not improve (step 4) stops the run, with a final checkpoint;
    keep_last=1 rotates every other checkpoint away but the best (step 3); final/ holds step 3's weights."""
    run_dir = eval_run["run_dir"]
    record = json.loads((run_dir / "run.json").read_text())
    assert record["steps"] == 4 and record["status"] == "completed"
    assert record["stopped_early"].startswith("early stop: the eval loss did not improve")
    assert "early stop" in eval_run["stdout"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]
    assert record["best_model_dir"] == "final" and record["best_checkpoint"].endswith("step_00000003")
    best = weights_from_dcp(run_dir / "checkpoints" / "step_00000003")
    final = _safetensors(run_dir / "final")
    assert all(torch.equal(best[k], final[k]) for k in final) and best.keys() >= final.keys()
    final_dir = run_dir / "final"
    assert f"best eval: step 3, eval loss {record['best_eval_loss']:.4f}, model in {final_dir}" in eval_run["stdout"]
    assert f"done: 4 steps, final loss {record['final_loss']:.4f}, model in {final_dir}" in eval_run["stdout"]


def test_samples_equal_sample_greedy_on_the_saved_model(eval_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftcli.inference import sample_greedy
    from ftcli.config.recipe import load_recipe

    run_dir = eval_run["run_dir"]
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 2, 2, 3, 3, 4, 4]
    conversations = load_recipe(str(run_dir / "recipe.yaml")).eval.sample_conversations()
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    model = AutoModelForCausalLM.from_pretrained(run_dir / "final", dtype=torch.float32)  # step 3's weights
    for step in (3, 4):
        if step == 4:
            model.load_state_dict(weights_from_dcp(run_dir / "checkpoints" / "step_00000004"))
        expected = sample_greedy(model, tokenizer, conversations, max_new_tokens=8)
        assert [r["completion"] for r in rows if r["step"] == step] == expected, step
    assert rows[0]["prompt"] == json.dumps(conversations[0])


def test_run_json_data_equals_pack_preview_summary(eval_run, env):
    run_dir = eval_run["run_dir"]
    res = ftcli(["pack-preview", "--recipe", str(run_dir / "recipe.yaml"), "--json"], eval_run["cwd"], env)
    assert res.returncode == 0, res.stderr[-2000:]
    preview = json.loads(res.stdout)
    record = json.loads((run_dir / "run.json").read_text())
    drop = ("from_cache", "pipeline_seconds", "tokens_per_second", "preview_seconds", "eval")
    assert {k: v for k, v in record["data"].items() if k not in drop} == \
        {k: v for k, v in preview.items() if k not in drop}
    assert "data trained tokens: " in eval_run["stdout"]


# ----------------------------------------------------------------------------------------- helpers
def _safetensors(model_dir):
    from safetensors.torch import load_file

    return load_file(model_dir / "model.safetensors")


def weights_from_dcp(ckpt) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    from ftcli.model.build import load_model
    from ftcli.config.recipe import load_recipe

    model = load_model(load_recipe("tiny-qwen-cpu").model, dtype=torch.float32)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    return state["model"]


# ------------------------------------------------------------------------------------ per source
def test_per_source_eval_losses_equal_a_plain_per_example_forward(tmp_path):
    """Two sources, 12 rows held out of each: every source's eval loss (packed, bfd) equals the token-weighted
    mean CE of a plain Hugging Face forward of its examples one at a time, and the overall loss is the
    token-weighted mean of the two."""
    import torch.nn.functional as F

    from ftcli.model import kernels
    from ftcli.data import iter_examples, load_tokenizer
    from ftcli.data.evalsplit import eval_specs
    from ftcli.data.spec import data_spec
    from ftcli.train.evaluate import Evaluator, prepare_eval
    from ftcli.train.loss import attach_loss
    from ftcli.model.build import load_model
    from ftcli.config.recipe import load_recipe, resolve_path

    rows = open(resolve_path(SOURCE)).read().splitlines()
    (tmp_path / "a.jsonl").write_text("\n".join(rows[:150]) + "\n")
    (tmp_path / "b.jsonl").write_text("\n".join(rows[150:300]) + "\n")
    sources = f'[{{name: a, source: local, path: {tmp_path / "a.jsonl"}}}, {{name: b, source: local, path: {tmp_path / "b.jsonl"}}}]'
    recipe = load_recipe("tiny-qwen-cpu", ["data.path=null", f"data.sources={sources}", "eval.holdout=12", f"data.cache_dir={tmp_path / 'c'}"])
    tokenizer = load_tokenizer(recipe.model, recipe.data)
    torch.manual_seed(0)
    attn, _ = kernels.enable_packed_kernels(recipe.model.model_type, torch.device("cpu"))
    model = load_model(recipe.model, dtype=torch.float32, attn_implementation=attn)
    attach_loss(model, "chunked", 64)
    result = Evaluator(prepare_eval(data_spec(recipe), recipe.eval, tokenizer), 0, 1, torch.device("cpu")).run(
        model, lambda inputs: model.loss_sum(**inputs), step=5)
    assert list(result.sources) == ["a", "b"]

    plain = load_model(recipe.model.model_copy(), dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.eval()
    for label, ev in eval_specs(data_spec(recipe), recipe.eval).items():
        summed, count = 0.0, 0
        for ex in iter_examples(ev, tokenizer):
            with torch.no_grad():
                logits = plain(torch.tensor([ex.input_ids])).logits[0, :-1].double()
            labels = torch.tensor(ex.labels[1:])
            summed += float(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
            count += int((labels != -100).sum())
        assert result.sources[label]["tokens"] == count
        assert result.sources[label]["loss"] == pytest.approx(summed / count, rel=1e-6, abs=0), label
    a, b = result.sources["a"], result.sources["b"]
    assert result.tokens == a["tokens"] + b["tokens"]
    assert result.loss == pytest.approx((a["loss"] * a["tokens"] + b["loss"] * b["tokens"]) / result.tokens, rel=1e-12)
    metrics_ = result.metrics()
    assert set(metrics_) == {"eval_loss", "eval_ppl", "eval_tokens", "eval_loss/a", "eval_loss/b"}
    assert "eval step 5 | eval loss" in result.line() and " | a " in result.line()


def test_register_takes_the_best_checkpoint(eval_run, tmp_path):
    from ftcli.commands import register as reg
    from ftcli.config.errors import UserError

    run_dir = eval_run["run_dir"]
    assert reg.resolve_source(run_dir, checkpoint="best").model_dir == run_dir / "final"  # export=best
    assert reg.resolve_source(run_dir).model_dir == run_dir / "final"
    with pytest.raises(UserError, match="takes the run dir"):
        reg.resolve_source(run_dir / "final", checkpoint="best")
    with pytest.raises(UserError, match="use last .* or best"):
        reg.run_register(run_dir, name="m", checkpoint="newest")
