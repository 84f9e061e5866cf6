"""One run directory, one writer: the launcher holds an exclusive lock on <run>/.ftcli.lock for the
whole run (a second `ftcli train` fails in one line naming its PID), and the torchrun workers die with
the launcher however it dies, so a --resume right after a SIGKILL never runs beside them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _run_common import metrics, subprocess_env, train_args

STEPS = 10
HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
print("locked", flush=True)
time.sleep(120)
"""


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    return subprocess_env(tmp_path_factory.mktemp("ftcli-cache"))


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


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_die_with_a_sigkilled_launcher_and_resume_does_not_interleave(tmp_path, env):
    """The scenario of issue #17: SIGKILL to the launcher's process group left the torchrun workers
    (in their own session) running; a --resume started then ran beside them (metrics.jsonl steps
    45, 50, 55, 50, 60, 55, 60). Now: a second train is refused while the first runs, every worker is
    gone within 5 s of the kill, nothing writes after, and the resumed run's steps continue the log."""
    run_dir = tmp_path / "run"
    args = train_args(run_dir, f"training.max_steps={STEPS}", "training.checkpoint.every_steps=2",
                      "training.log_every=1", "tracking.enabled=false", "training.cpu_processes=2")
    cmd = [sys.executable, "-m", "ftcli", *args]
    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    try:
        ckpt = run_dir / "checkpoints" / "step_00000002" / "meta.json"
        _wait_for(lambda: ckpt.is_file() or launcher.poll() is not None, 240, "the first checkpoint")
        assert launcher.poll() is None, launcher.stderr.read()[-3000:]

        second = subprocess.run([*cmd, "--resume", "latest"], cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=120)
        assert second.returncode == 2 and second.stderr.strip() == (
            f"error: {run_dir} is in use by another `ftcli train` (pid {launcher.pid}); wait for it to finish "
            "or stop it, then run again")
        workers = [p for p in _children(launcher.pid) if _alive(p)]
        assert len(workers) == 2, workers  # torchrun's agent runs in the launcher; the two ranks are its children
        assert launcher.poll() is None, "the run ended before the kill; raise STEPS"

        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        t0 = time.monotonic()
        _wait_for(lambda: not any(_alive(p) for p in workers), 5, "the workers to die")
        print(f"workers gone {time.monotonic() - t0:.2f} s after the launcher's SIGKILL")
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    logged = len(metrics(run_dir))
    time.sleep(1.5)
    assert len(metrics(run_dir)) == logged  # nobody writes any more

    resumed = subprocess.run([*cmd, "--resume", "latest"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    resumed_at = int((resumed.stdout + resumed.stderr).split("resumed from ")[1].split("step_")[1][:8])
    steps = [m["step"] for m in metrics(run_dir)]
    print(f"killed after {logged} logged steps, resumed at step {resumed_at}: metrics steps {steps}")
    descents = [i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]]
    assert len(descents) <= 1 and (not descents or (descents[0] == logged and steps[logged] == resumed_at + 1))
    assert steps[-1] == STEPS and sorted(set(steps)) == list(range(1, STEPS + 1))
    assert 2 <= resumed_at < STEPS


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
