"""Nothing is deleted or overwritten before every check has passed, and --force only removes what ftcli
wrote: in a run dir it can prove is its own (`train`), or in an earlier merge output (`merge-lora -o`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _run_common import train_args

BAD_TOKENIZER = "model.tokenizer=/nonexistent/tokenizer"


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under root (ftcli's lock file left out) -> its bytes (None for a dir)."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes())
            for p in sorted(root.rglob("*")) if p.name != ".ftcli.lock"}


def _plant_run_outputs(run_dir: Path) -> None:
    """What an earlier run left: a checkpoint, a final model, run.json, metrics."""
    ckpt = run_dir / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text('{"step": 2, "world_size": 1}')
    (run_dir / "final").mkdir()
    (run_dir / "final" / "model.safetensors").write_bytes(b"weights")
    (run_dir / "run.json").write_text('{"method": "full"}')
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')


def _train(run_dir: Path, *args: str, sets=()):
    from ftcli import cli

    res = CliRunner().invoke(cli.app, [*train_args(run_dir, "tracking.enabled=false", *sets), *args])
    return res.exit_code, " ".join(res.output.split())


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a bad tokenizer path fails at once


def test_force_into_a_foreign_dir_deletes_nothing_and_is_not_suggested(tmp_path):
    """The scenario of issue #17: `train --force` into a dir that is no ftcli run (here one holding
    checkpoints/, final/, run.json, metrics.jsonl of its own) with a bad tokenizer path."""
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    _plant_run_outputs(foreign)
    (foreign / "notes.txt").write_text("mine")
    before = snapshot(foreign)
    for extra in ((), ("--force",)):
        code, out = _train(foreign, *extra, sets=[BAD_TOKENIZER])
        assert code == 2 and out.startswith(f"error: output dir {foreign} holds files that are not an ftcli run "
                                            "(checkpoints, final, metrics.jsonl, ...)")
        assert "--force" not in out
        assert snapshot(foreign) == before and not (foreign / ".ftcli.lock").exists()


def test_a_recipe_file_of_the_same_name_is_no_proof_of_a_run(tmp_path):
    """People keep their recipe.yaml in a folder: that alone does not make the folder an ftcli run."""
    mine = tmp_path / "experiment"
    mine.mkdir()
    (mine / "recipe.yaml").write_text("name: tiny-qwen-cpu\n")
    (mine / "final").mkdir()
    (mine / "final" / "weights.bin").write_bytes(b"precious")
    before = snapshot(mine)
    code, out = _train(mine, "--force")
    assert code == 2 and "holds files that are not an ftcli run (final, recipe.yaml)" in out
    assert snapshot(mine) == before


def test_force_in_own_run_checks_everything_before_deleting(tmp_path):
    """Our own run dir, --force, a bad tokenizer: the tokenizer fails and the earlier run's outputs,
    recipe.yaml included, are all still there. With good inputs --force removes the run's outputs
    and nothing else (a user's notes, a foreign file inside checkpoints/)."""
    from ftcli.config.recipe import load_recipe
    from ftcli.artifacts.rundir import prepare_run_dir

    run_dir = tmp_path / "run"
    recipe = load_recipe("tiny-qwen-cpu", [f"output.dir={run_dir}", "training.max_steps=7"])
    prepare_run_dir(recipe)
    _plant_run_outputs(run_dir)
    (run_dir / "notes.txt").write_text("mine")
    (run_dir / "checkpoints" / "README").write_text("mine too")
    before = snapshot(run_dir)

    code, out = _train(run_dir, "--force", sets=[BAD_TOKENIZER])
    assert code == 2 and out == "error: cannot load tokenizer '/nonexistent/tokenizer': " + out.split(": ", 2)[2]
    assert snapshot(run_dir) == before

    code, out = _train(run_dir)  # and without --force: refused, with the way out
    assert code == 2 and "already holds a run of 'tiny-qwen-cpu'; pass --resume to continue it, or --force" in out

    prepare_run_dir(recipe, force=True)
    assert sorted(snapshot(run_dir)) == [".ftcli-run", "checkpoints", "checkpoints/README", "notes.txt", "recipe.yaml"]
    assert (run_dir / "notes.txt").read_text() == "mine"


def test_failed_start_in_a_new_dir_leaves_nothing(tmp_path):
    run_dir = tmp_path / "new"
    code, out = _train(run_dir, sets=[BAD_TOKENIZER])
    assert code == 2 and out.startswith("error: cannot load tokenizer")
    assert not run_dir.exists()
    run_dir.mkdir()  # an empty dir (or one holding only ftcli's lock file) counts as empty
    (run_dir / ".ftcli.lock").write_text("123\n")
    code, out = _train(run_dir, sets=[BAD_TOKENIZER])
    assert code == 2 and out.startswith("error: cannot load tokenizer")
    assert sorted(p.name for p in run_dir.iterdir()) == [".ftcli.lock"]


def test_a_run_of_another_recipe_is_replaced_only_with_force(tmp_path):
    from ftcli.config.recipe import load_recipe
    from ftcli.artifacts.rundir import prepare_run_dir

    run_dir = tmp_path / "run"
    prepare_run_dir(load_recipe("tiny-gpt-oss-cpu", [f"output.dir={run_dir}"]))
    _plant_run_outputs(run_dir)
    code, out = _train(run_dir)
    assert code == 2 and out == (f"error: output dir {run_dir} holds a run of recipe 'tiny-gpt-oss-cpu'; set output.dir "
                                 "to another dir, or pass --force to replace that run (deletes its checkpoints, "
                                 "final model and metrics)")
    code, out = _train(run_dir, "--resume", "latest")
    assert code == 2 and "is a run of recipe 'tiny-gpt-oss-cpu', not 'tiny-qwen-cpu'" in out
    prepare_run_dir(load_recipe("tiny-qwen-cpu", [f"output.dir={run_dir}"]), force=True)
    assert sorted(snapshot(run_dir)) == [".ftcli-run", "recipe.yaml"]


# -------------------------------------------------------------------------------------- merge-lora -o
def _merge(*args: str):
    from ftcli.cli import app

    res = CliRunner().invoke(app, ["merge-lora", *map(str, args)])
    return res.exit_code, " ".join(res.output.split())


def test_merge_output_never_the_adapter_its_run_the_base_or_a_parent(lora_run, tmp_path):  # noqa: F811
    """The scenario of issue #17: `-o` = the run's parent with --force deleted the adapter with it."""
    run, base = lora_run
    before_run, before_base = snapshot(run), snapshot(base)
    cases = {
        run.parent: f"would overwrite its run dir ({run})",
        run: f"would overwrite its run dir ({run})",
        run / "final": f"would overwrite the adapter ({run / 'final'})",
        run / "final" / "sub": f"is inside the adapter ({run / 'final'})",
        base: f"would overwrite the base model ({base})",
        base / "merged": f"is inside the base model ({base})",
        Path("/"): f"would overwrite its run dir ({run})",
    }
    for out, why in cases.items():
        code, msg = _merge(run, "-o", out, "--dtype", "float32", "--force")
        assert code == 2 and msg == f"error: --output {out.resolve()} {why}; pick another dir", msg
    assert snapshot(run) == before_run and snapshot(base) == before_base


def test_merge_force_validates_everything_before_replacing(lora_run, tmp_path):  # noqa: F811
    """An earlier merge in -o survives a bad --dtype, a bad --base and an adapter that does not fit."""
    run, _ = lora_run
    out = tmp_path / "merged"
    code, msg = _merge(run, "-o", out, "--dtype", "float32")
    assert code == 0, msg
    before = snapshot(out)
    code, msg = _merge(run, "-o", out, "--dtype", "int8", "--force")
    assert code == 2 and msg == "error: --dtype int8: use bfloat16, float16 or float32"
    code, msg = _merge(run, "-o", out, "--base", tmp_path / "nowhere", "--force")
    assert code == 2 and "cannot load its config" in msg
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]  # and no temporary dir left beside it
    (tmp_path / "file").write_text("x")
    code, msg = _merge(run, "-o", tmp_path / "file", "--force")
    assert code == 2 and msg == f"error: --output {tmp_path / 'file'} is a file; pick a directory"
