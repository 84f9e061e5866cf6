"""ftcli.artifacts.rundir: when `ftcli train` may write into a dir, and the run record both trainers write."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from _run_common import train_args


def test_output_dir_refused_unless_empty_own_resumed_or_forced(tmp_path):
    from ftcli import cli
    from ftcli.config.errors import UserError
    from ftcli.config.recipe import load_recipe
    from ftcli.artifacts.rundir import prepare_run_dir

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    res = CliRunner().invoke(cli.app, train_args(foreign))
    assert res.exit_code == 2 and "holds files that are not an ftcli run" in " ".join(res.output.split())
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]  # nothing written

    other = tmp_path / "other"
    prepare_run_dir(load_recipe("tiny-gpt-oss-cpu", [f"output.dir={other}"]))
    res = CliRunner().invoke(cli.app, train_args(other))
    assert res.exit_code == 2 and "a run of recipe 'tiny-gpt-oss-cpu'" in " ".join(res.output.split())

    own = tmp_path / "own"  # our own run with a checkpoint: --resume or --force, not a silent restart
    recipe = load_recipe("tiny-qwen-cpu", [f"output.dir={own}"])
    prepare_run_dir(recipe)
    (own / "checkpoints" / "step_00000003").mkdir(parents=True)
    (own / "checkpoints" / "step_00000003" / "meta.json").write_text("{}")
    res = CliRunner().invoke(cli.app, train_args(own))
    assert res.exit_code == 2 and "pass --resume to continue it, or --force" in " ".join(res.output.split())
    prepare_run_dir(recipe, resume="latest")  # allowed
    with pytest.raises(UserError, match="not an ftcli run"):  # --force never opens a foreign dir
        prepare_run_dir(load_recipe("tiny-qwen-cpu", [f"output.dir={foreign}"]), force=True)
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    prepare_run_dir(recipe, force=True)
    assert not (own / "checkpoints").exists()


def test_new_run_record_fills_the_common_part_and_reads_back(tmp_path):
    """Both trainers build run.json with new_run_record: version, method, recipe, base model from
    recipe.model, MLflow info; the trainer's own fields as given; written and read back unchanged."""
    from ftcli import __version__
    from ftcli.config.recipe import load_recipe
    from ftcli.artifacts.rundir import new_run_record, read_run_record, write_run_record

    recipe = load_recipe("tiny-gpt-oss-cpu")
    mlflow = {"tracking_uri": "sqlite:///x.db", "experiment_id": "1", "run_id": "abc"}
    record = new_run_record(recipe, method="lora", mlflow=mlflow, base_path="base", steps=7,
                            tokens={"trained": 11, "seen": 20}, final_loss=1.25,
                            throughput={"tokens_per_s": 100.0, "s_per_step": 0.5})
    assert record.ftcli_version == __version__ and record.method == "lora" and record.recipe == recipe.to_dict()
    m = recipe.model
    assert record.base_model.model_dump() == {
        "id": m.id, "revision": m.revision, "init": m.init, "config": m.config, "model_type": m.model_type,
        "model_class": m.model_class, "path": "base"}
    assert record.mlflow.run_id == "abc" and record.model_dir == "final" and record.status == "completed"
    assert (record.steps, record.tokens.trained, record.tokens.seen, record.final_loss) == (7, 11, 20, 1.25)

    path = write_run_record(tmp_path, record)
    assert read_run_record(tmp_path) == record
    saved = json.loads(path.read_text())
    assert saved["objective"] == "sft"  # run.json says what was optimized (ftcli.objectives)
    assert list(saved) == ["ftcli_version", "method", "objective", "recipe", "model_dir", "base_model", "mlflow", "steps", "tokens",
                           "final_loss", "throughput", "status", "data", "eval_data", "evals", "best_step",
                           "best_eval_loss", "best_checkpoint", "best_model_dir", "stopped_early", "recipe_digest",
                           "data_sources", "parent_run"]
    assert (saved["data"], saved["evals"], saved["best_step"], saved["best_model_dir"]) == (None, [], None, None)
    full = new_run_record(load_recipe("tiny-qwen-cpu"), method="full", mlflow=None, model_dir=None)
    assert full.base_model.path is None and full.mlflow is None and full.model_path(tmp_path) is None


def test_a_run_started_from_an_ftcli_run_names_it_as_its_parent(tmp_path):
    """model.id = an earlier run's final/ (what ftcli.train.launch.starting_model makes of its run dir) or best/: that
    run's dir, model, recipe, digest and MLflow run, from its run.json (`parent_run_of`); a plain model dir, a hub id
    or random init: none."""
    from ftcli.artifacts.resolve import parent_run_of
    from ftcli.artifacts.rundir import new_run_record, write_run_record
    from ftcli.config.recipe import load_recipe

    sft = tmp_path / "sft"
    (sft / "final").mkdir(parents=True)
    (sft / "best").mkdir()
    mlflow = {"tracking_uri": "sqlite:///x.db", "experiment_id": "3", "run_id": "abc123"}
    write_run_record(sft, new_run_record(load_recipe("tiny-llama3-cpu"), method="full", mlflow=mlflow,
                                         recipe_digest="d1g3st"))
    for model_dir in ("final", "best"):
        recipe = load_recipe("tiny-dpo-cpu", ["model.init=pretrained", f"model.id={sft / model_dir}"])
        parent = parent_run_of(recipe.model)
        assert parent.model_dump() == {
            "run_dir": str(sft.resolve()), "model_dir": model_dir, "recipe": "tiny-llama3-cpu", "recipe_digest": "d1g3st",
            "method": "full", "objective": "sft", "mlflow_run_id": "abc123", "mlflow_experiment_id": "3"}
        assert parent.tags()["ftcli.parent.run_id"] == "abc123"
    plain = tmp_path / "plain"
    plain.mkdir()
    for sets in (["model.init=pretrained", f"model.id={plain}"], ["model.init=pretrained", "model.id=org/model"], []):
        assert parent_run_of(load_recipe("tiny-dpo-cpu", sets).model) is None
