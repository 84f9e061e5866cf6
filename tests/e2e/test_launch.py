"""`ftcli train`'s launcher (ftcli.train.launch): what it refuses before torchrun starts, and one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from _run_common import ftcli, recipe_file, subprocess_env, train_args


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    return subprocess_env(tmp_path_factory.mktemp("ftcli-cache"))


def test_full_training_without_packing_is_a_one_line_error(tmp_path):
    from ftcli import cli

    res = CliRunner().invoke(cli.app, train_args(tmp_path / "run", "data.packing.enabled=false"))
    assert res.exit_code == 2
    assert res.output.strip() == "error: training.method=full trains on packed blocks; set data.packing.enabled=true"
    assert not (tmp_path / "run").exists()



def test_gpu_recipe_on_cpu_gets_doctors_verdict_not_gpu_install_advice(tmp_path):
    from ftcli import cli

    res = CliRunner().invoke(cli.app, ["train", "--recipe", "qwen-b300", "--set", f"output.dir={tmp_path / 'run'}"])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1
    out = " ".join(res.output.split())
    assert out.startswith("error: recipe qwen-b300 cannot run here: qwen-b300 needs ~")
    assert out.endswith("it is a GPU_8xB300 recipe (8 GPUs): run it there (ftcli render-workload --recipe qwen-b300)")
    res = CliRunner().invoke(cli.app, train_args(tmp_path / "run", "training.loss.impl=liger"))
    assert res.exit_code == 2
    assert " ".join(res.output.split()) == (
        "error: recipe tiny-qwen-cpu asks for GPU kernels and this machine has no GPU: set "
        "training.loss.impl=chunked here, or run it on a GPU (ftcli render-workload --recipe tiny-qwen-cpu)")
    assert "pip install" not in res.output and not (tmp_path / "run").exists()


def test_resume_of_a_finished_run_says_so_without_launching(tmp_path, monkeypatch):
    from ftcli import cli
    from ftcli.artifacts.rundir import RunRecord, prepare_run_dir, write_run_record
    from ftcli.config.recipe import load_recipe

    run_dir = tmp_path / "run"
    prepare_run_dir(load_recipe("tiny-qwen-cpu", [f"output.dir={run_dir}"]))
    write_run_record(run_dir, RunRecord(method="full", steps=40, status="completed"))
    monkeypatch.setattr("torch.distributed.run.run", lambda *a: pytest.fail("torchrun started"))
    for args in (train_args(run_dir), ["train", "--recipe", str(run_dir / "recipe.yaml")]):
        res = CliRunner().invoke(cli.app, [*args, "--resume", "latest"])  # (bare --resume: main() adds latest)
        assert res.exit_code == 0, res.output
        assert " ".join(res.output.split()) == (f"{run_dir} already finished at step 40 (its run.json); nothing to "
                                                "resume (--force starts over)")
    changed = CliRunner().invoke(cli.app, [*train_args(run_dir, "training.max_steps=80"), "--resume", "latest"])
    assert "already finished" not in changed.output  # another recipe: --resume looks for its checkpoints
    assert "holds no checkpoint" in changed.output and changed.exit_code == 2


def test_config_override_that_builds_no_model_fails_before_the_run_dir_exists(tmp_path):
    from ftcli import cli

    res = CliRunner().invoke(cli.app, train_args(tmp_path / "run", "model.config_overrides={hidden_act: nope}"))
    assert res.exit_code == 2
    assert res.output.startswith("error: model config pkg://assets/tiny-qwen3_5.json with model.config_overrides "
                                 "{'hidden_act': 'nope'} does not build a model")
    assert len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()

def test_bad_data_path_is_one_line_from_the_launcher_and_from_bare_torchrun(tmp_path, env):
    """The launcher prepares the data before torchrun starts; under a torchrun started by hand, rank 0
    reports the error and the other ranks stop quietly instead of dying at a barrier with a traceback."""
    res = ftcli(train_args(tmp_path / "run", "data.path=/nonexistent.jsonl", "tracking.enabled=false"), tmp_path, env)
    assert res.returncode == 2 and res.stderr.strip() == "error: data.path '/nonexistent.jsonl' does not exist"

    recipe = recipe_file(tmp_path / "bad.yaml", "data.path=/nonexistent.jsonl", "tracking.enabled=false",
                         f"output.dir={tmp_path / 'bare'}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "ftcli", "train", "--recipe", str(recipe)]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode != 0
    worker_lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert worker_lines == ["error: data.path '/nonexistent.jsonl' does not exist"]
    assert "gloo" not in res.stderr and "[rank1]" not in res.stderr


def test_torchrun_without_shutdown_timeout_still_launches(monkeypatch, capsys):
    """torch 2.11's torchrun has no --shutdown_timeout and refuses a command line that has it (seen on the
    H200 image): the launcher passes it only where torchrun knows it, and says what the grace is otherwise."""
    import argparse

    import torch.distributed.run as torchrun_module

    from ftcli.train.launch import shutdown_grace_args
    from ftcli.train.preempt import STOP_GRACE_S

    assert shutdown_grace_args() == [f"--shutdown_timeout={STOP_GRACE_S}"]  # this torch (2.13) has it

    def old_parser():  # torchrun's parser without the option
        p = argparse.ArgumentParser()
        p.add_argument("--nproc_per_node")
        p.add_argument("training_script")
        return p

    monkeypatch.setattr(torchrun_module, "get_args_parser", old_parser)
    capsys.readouterr()
    assert shutdown_grace_args() == []
    assert capsys.readouterr().err == (
        f"note: torchrun of torch {torch.__version__} has no --shutdown_timeout: on SIGTERM the workers get its "
        f"30 s (not {STOP_GRACE_S} s) to write their stop checkpoint\n")


def test_train_run_in_process_returns_to_its_caller(tmp_path, env):
    """A worker started by torchrun ends with os._exit (ftcli.train.distributed.exit_worker); the same command run
    in-process by a caller that set up the rank variables itself (benchmarks/depth_gpu.py's profile) must
    return to it."""
    code = ("import sys; from ftcli.cli import app\n"
            "app(sys.argv[1:], standalone_mode=False)\n"
            "print('returned to the caller')\n")
    child_env = {k: v for k, v in env.items() if k != "TORCHELASTIC_RUN_ID"}
    child_env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="29517")
    args = train_args(tmp_path / "run", "training.max_steps=2", "training.cpu_processes=1", "tracking.enabled=false",
                      "training.checkpoint.enabled=false", "training.checkpoint.save_final_hf=false")
    res = subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, env=child_env, capture_output=True,
                         text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stdout.splitlines()[-1] == "returned to the caller"
