"""SIGTERM / SIGINT stop a run at the next step boundary with a checkpoint (ftcli.train.preempt, ftcli.train.launch).

End to end through the real launcher (`ftcli train` -> torchrun -> 2 workers): SIGTERM to the launcher,
as a platform sends it; SIGINT to the launcher's process group, as Ctrl-C in a terminal does (the
workers are in their own session and only get it forwarded). A SIGKILL of the launcher's process group
or of one rank stops the run too (the workers die with the launcher: issue #17; a second train is refused
while it runs, tests/e2e/test_run_lock.py). After each stop `--resume` continues, and at the end the run's
metrics.jsonl and weights are the uninterrupted run's exactly, each step logged once. All of it is one
run stopped in turn (one launch per stop, to keep the suite short). The LoRA path stops the same way
(tests/e2e/test_lora_train.py::test_sigterm_stops_with_a_trl_checkpoint_and_resume_continues_the_same_run).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _run_common import ftcli, metrics, subprocess_env, train_args

STEPS = 14  # 5 stops in turn, each at least a step after the last one
FULL = [f"training.max_steps={STEPS}", "training.log_every=1", "tracking.enabled=false"]


# ------------------------------------------------------------------------------------------ units
def test_stop_flag_records_the_first_signal_and_restores_the_handlers():
    from ftcli.train.preempt import StopFlag

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    flag = StopFlag().install()
    try:
        assert flag.signum == 0 and flag.agreed() == 0
        os.kill(os.getpid(), signal.SIGTERM)  # no exception, no exit: only recorded
        os.kill(os.getpid(), signal.SIGINT)  # a second signal while stopping changes nothing
        assert flag.signum == signal.SIGTERM == 15 and flag.agreed() == 15  # no process group: its own flag
    finally:
        flag.restore()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_exit_codes_and_the_one_line():
    from ftcli.train.preempt import Stopped, exit_code, resume_hint

    assert (exit_code(signal.SIGTERM), exit_code(signal.SIGINT)) == (143, 130)
    assert Stopped(7, signal.SIGINT, None).exit_code == 130
    assert resume_hint(7, "/r/recipe.yaml") == "stopped at step 7; resume with `ftcli train --recipe /r/recipe.yaml --resume`"
    assert resume_hint(None, "/r/recipe.yaml", checkpoints_enabled=False) == (
        "stopped before any checkpoint (training.checkpoint.enabled=false); "
        "start again with `ftcli train --recipe /r/recipe.yaml`")


def test_truncate_metrics_keeps_the_steps_up_to_the_checkpoint(tmp_path):
    from ftcli.train.metrics import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in range(1, 7)) + '{"step": 7, "lo')
    assert truncate_metrics(path, 4) == 3  # steps 5, 6 and the line a kill cut short
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]
    assert truncate_metrics(path, 4) == 0 and truncate_metrics(tmp_path / "missing.jsonl", 4) == 0
    assert not list(tmp_path.glob(".tmp_*"))


def test_interrupted_saves_are_removed_and_committed_ones_kept(tmp_path):
    from ftcli.train.checkpoint import checkpoint_step, rank_state_source, remove_interrupted_saves

    root = tmp_path / "checkpoints"
    for name in ("step_00000004", ".tmp_step_00000006", "step_00000008"):  # .tmp_: an older ftcli's save
        (root / name).mkdir(parents=True)
        (root / name / "__0_0.distcp").write_bytes(b"x")
    (root / "step_00000004" / "meta.json").write_text("{}")
    removed = remove_interrupted_saves(root)
    assert [p.name for p in removed] == [".tmp_step_00000006", "step_00000008"]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000004"]
    assert remove_interrupted_saves(tmp_path / "none") == []
    assert checkpoint_step(root / "step_00000004") == 4 and checkpoint_step(Path("x/checkpoint-12")) == 12
    # 2 ranks wrote it: on 1 rank rank 0 reads rank 0's state; on 3 ranks, rank 2 reads rank 0's
    assert [rank_state_source(2, r) for r in range(3)] == [0, 1, 0]


# -------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    return subprocess_env(tmp_path_factory.mktemp("ftcli-cache"))


def numbers(run_dir: Path) -> list[dict]:
    return [{k: m[k] for k in ("step", "loss", "grad_norm", "lr", "tokens_trained", "tokens_seen")}
            for m in metrics(run_dir)]


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line)["step"])
        except ValueError:
            pass
    return out


def start(args: list[str], cwd: Path, env: dict) -> subprocess.Popen:
    """`ftcli ...` as its own process group, like a job in a terminal."""
    return subprocess.Popen([sys.executable, "-m", "ftcli", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def signal_when(proc: subprocess.Popen, ready, send) -> tuple[str, str]:
    deadline = time.monotonic() + 180
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    send()
    return proc.communicate(timeout=180)


def stop_line(out: str, err: str, run_dir: Path) -> int:
    """The step of the one `stopped at step N; resume with ...` line; nothing else about the stop."""
    assert "Traceback" not in out + err and "SignalException" not in out + err, err[-3000:]
    lines = [line for line in (out + err).splitlines() if "stopped" in line]
    assert len(lines) == 1, lines
    step = int(lines[0].split("stopped at step ")[1].split(";")[0])
    assert lines[0] == f"stopped at step {step}; resume with `ftcli train --recipe {run_dir / 'recipe.yaml'} --resume`"
    return step


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, env):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    res = ftcli(train_args(tmp / "run", *FULL), tmp, env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return tmp / "run"


def workers_of(launcher: subprocess.Popen) -> list:
    """The torchrun ranks: the launcher runs torchrun's agent in its own process, the ranks are its children."""
    import psutil

    return [p for p in psutil.Process(launcher.pid).children() if alive(p)]


def alive(process) -> bool:
    import psutil

    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_rank1(launcher: subprocess.Popen) -> None:
    (rank1,) = [p for p in workers_of(launcher) if p.environ().get("RANK") == "1"]
    rank1.kill()


def test_every_way_a_run_stops_leaves_a_resumable_run_and_resume_reproduces_it(uninterrupted, tmp_path, env):
    """One run, stopped five ways in turn, each resumed from where it stopped (one launch per stop):
    SIGTERM to the launcher, SIGKILL to the launcher's process group (a second train is refused while it
    runs; its workers die with it, issue #17), Ctrl-C (SIGINT to the process group), SIGKILL of one rank;
    then a --resume to the end gives the uninterrupted run's metrics.jsonl, number for number, and weights."""
    from typer.testing import CliRunner

    from ftcli import cli
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    resume = ["train", "--recipe", str(run_dir / "recipe.yaml"), "--resume"]

    # 1. SIGTERM to the launcher once step 2 is logged
    proc = start(train_args(run_dir, *FULL), tmp_path, env)
    out, err = signal_when(proc, lambda: len(logged_steps(run_dir)) >= 2, lambda: os.kill(proc.pid, signal.SIGTERM))
    assert proc.returncode == 143, err[-3000:]
    first = stop_line(out, err, run_dir)
    assert 2 <= first < STEPS - 8
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step_{first:08d}"]  # the stop's checkpoint, committed
    assert logged_steps(run_dir) == list(range(1, first + 1))
    assert not (run_dir / "run.json").exists()

    # what a kill -9 during the next step and its save would leave: a logged step after the checkpoint,
    # a line cut short, a half-written checkpoint
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": first + 1, "loss": 0.0}) + '\n{"step": ')
    (ckpts / f"step_{first + 1:08d}").mkdir()  # shards at their final paths, no meta.json: not committed
    (ckpts / f"step_{first + 1:08d}" / "__0_0.distcp").write_bytes(b"partial")

    # 2. --resume; while it trains a second `ftcli train` on the run dir is refused; then SIGKILL to the
    # launcher's process group: every worker is gone within 5 s and nothing writes after
    proc = start(resume, tmp_path, env)
    deadline = time.monotonic() + 180
    while max(logged_steps(run_dir), default=0) < first + 2:  # past the planted step: this run's own line
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    refused = CliRunner().invoke(cli.app, [*resume, "latest"])
    assert refused.exit_code == 2 and " ".join(refused.output.split()) == (
        f"error: {run_dir} is in use by another `ftcli train` (pid {proc.pid}); wait for it to finish "
        "or stop it, then run again")
    workers = workers_of(proc)
    assert len(workers) == 2, workers
    assert proc.poll() is None, "the run ended before the kill; raise STEPS"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    t0 = time.monotonic()
    while any(alive(w) for w in workers):
        assert time.monotonic() - t0 < 5, "the workers outlived the launcher's SIGKILL by 5 s"
        time.sleep(0.1)
    proc.communicate(timeout=10)
    killed_at = max(logged_steps(run_dir))
    time.sleep(1.5)
    assert logged_steps(run_dir) == list(range(1, killed_at + 1))  # truncated at `first`, then each step once
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step_{first:08d}"]  # the planted partial save removed

    # 3. --resume, then Ctrl-C (SIGINT to the launcher's process group) once it trains past the killed run
    proc = start(resume, tmp_path, env)
    out, err = signal_when(proc, lambda: max(logged_steps(run_dir), default=0) > killed_at,
                           lambda: os.killpg(proc.pid, signal.SIGINT))
    assert proc.returncode == 130, err[-3000:]
    second = stop_line(out, err, run_dir)
    assert killed_at < second < STEPS - 2, (killed_at, second)
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step_{first:08d}", f"step_{second:08d}"]  # keep_last 2
    assert logged_steps(run_dir) == list(range(1, second + 1))

    # 4. --resume, then SIGKILL of rank 1: the launcher stops the run in one line, nothing is exported
    proc = start(resume, tmp_path, env)
    out, err = signal_when(proc, lambda: max(logged_steps(run_dir), default=0) > second, lambda: kill_rank1(proc))
    assert proc.returncode != 0 and "training stopped" in out + err, err[-3000:]
    assert not (run_dir / "final").exists() and not (run_dir / "run.json").exists()
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step_{first:08d}", f"step_{second:08d}"]

    # 5. --resume to the end: metrics.jsonl and the exported weights are the uninterrupted run's
    res = ftcli(resume, tmp_path, env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"resumed from {ckpts / f'step_{second:08d}'} at step {second}" in res.stdout
    assert numbers(run_dir) == numbers(uninterrupted)
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step_{second:08d}", f"step_{STEPS:08d}"]
    resumed, reference = load_file(run_dir / "final" / "model.safetensors"), \
        load_file(uninterrupted / "final" / "model.safetensors")
    assert resumed.keys() == reference.keys()
    assert max(float((resumed[k] - reference[k]).abs().max()) for k in resumed) <= 1e-6
