"""One run directory, one writer: the launcher holds an exclusive lock on <run>/.ftcli.lock for the
whole run (a second `ftcli train` fails in one line naming its PID), and the torchrun workers die with
the launcher however it dies, so a --resume right after a SIGKILL never runs beside them. The end-to-end
case (a real run refuses a second train, its workers die within 5 s of the launcher's SIGKILL, the resume
logs each step once) is one stop of the run in tests/e2e/test_preemption.py, which stops one run five ways."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from _run_common import train_args

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
print("locked", flush=True)
time.sleep(120)
"""


def test_second_train_on_a_locked_run_dir_is_one_line_naming_the_holder(tmp_path):
    from ftcli import cli
    from ftcli.config.recipe import load_recipe
    from ftcli.artifacts.rundir import prepare_run_dir

    run_dir = tmp_path / "run"
    prepare_run_dir(load_recipe("tiny-qwen-cpu", [f"output.dir={run_dir}"]))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir / ".ftcli.lock")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
        for extra in ([], ["--resume", "latest"], ["--force"]):
            res = CliRunner().invoke(cli.app, [*train_args(run_dir, "tracking.enabled=false"), *extra])
            assert res.exit_code == 2
            assert " ".join(res.output.split()) == (
                f"error: {run_dir} is in use by another `ftcli train` (pid {holder.pid}); wait for it to finish "
                "or stop it, then run again")
        assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
    finally:
        holder.kill()
        holder.wait()


def test_a_start_that_fails_before_step_1_leaves_nothing_it_wrote(tmp_path):
    from ftcli.config.recipe import load_recipe
    from ftcli.artifacts.rundir import prepare_run_dir
    from ftcli.train.launch import run_dir_lock

    def failed_start(run_dir, *, step_logged=False):
        recipe = load_recipe("tiny-gpt-oss-cpu", [f"output.dir={run_dir}", "tracking.enabled=false"])
        with pytest.raises(RuntimeError, match="worker failed"):
            with run_dir_lock(recipe, resume=None, force=True):
                prepare_run_dir(recipe, force=True)  # marker + recipe.yaml, then what the workers write
                (run_dir / "tracking.json").write_text("{}\n")
                (run_dir / "base").mkdir()
                (run_dir / "base" / "config.json").write_text("{}\n")
                (run_dir / "checkpoints").mkdir()
                if step_logged:
                    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
                raise RuntimeError("worker failed")

    fresh = tmp_path / "fresh"
    failed_start(fresh)
    assert not fresh.exists()  # this start made the dir: it goes too
    kept = tmp_path / "kept"  # an earlier failed run's dir, with a note of the user's
    kept.mkdir()
    (kept / ".ftcli-run").write_text("{}\n")
    (kept / "notes.txt").write_text("mine\n")
    failed_start(kept)
    assert sorted(p.name for p in kept.iterdir()) == [".ftcli-run", "notes.txt"]
    ran = tmp_path / "ran"  # a step ran: the metrics and everything else stay (lock file included)
    failed_start(ran, step_logged=True)
    assert sorted(p.name for p in ran.iterdir()) == [".ftcli-run", ".ftcli.lock", "base", "checkpoints",
                                                     "metrics.jsonl", "recipe.yaml", "tracking.json"]
