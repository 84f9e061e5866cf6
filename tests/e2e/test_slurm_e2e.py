"""The Slurm launcher end to end on a real single-node Slurm (scripts/slurm_local.sh: munged, slurmctld, slurmd).

`sbatch` of the rendered script for tiny-qwen-cpu (2 CPU processes on one node); `scancel --signal=TERM` once step
3 is logged: the workers stop with a checkpoint, the batch script requeues the job, the requeued job resumes with
--resume and finishes; its metrics.jsonl equals an uninterrupted `ftcli train` of the same recipe number for
number. Runs where slurm-wlm and munge are installed and the test runs as root (slurmd starts jobs as their
user); ~2 minutes on 2 idle cores (the uninterrupted run ~35 s, the Slurm job ~60 s plus 10 s before a requeued
job may start).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from _run_common import REPO, ftcli, metrics, subprocess_env, train_args

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "scontrol", "squeue")
# Deselected from the default run (pyproject's `-m 'not slurm'`): scripts/slurm_e2e.sh installs Slurm where it is
# missing and runs this module (`pytest -m slurm`); .ci/run calls it after the suite.
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(
    any(shutil.which(t) is None for t in TOOLS) or os.geteuid() != 0,
    reason="needs slurm-wlm and munge (apt-get install -y slurm-wlm munge) and root: scripts/slurm_e2e.sh")]

STEPS = 12
SETS = [f"training.max_steps={STEPS}", "training.log_every=1", "tracking.enabled=false"]


def _free_port_pair() -> int:
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two free neighbouring ports")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> dict[str, str]:
    state = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "FTCLI_SLURM_DIR": str(state), "FTCLI_SLURM_PORT": str(_free_port_pair())}
    script = str(REPO / "scripts" / "slurm_local.sh")
    res = subprocess.run([script, "start"], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip() == f"export SLURM_CONF={state}/slurm.conf"
    yield {"SLURM_CONF": f"{state}/slurm.conf"}
    subprocess.run([script, "stop"], env=env, timeout=60)


def _job(job_id: str, env: dict) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _wait(what: str, ready, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_sbatch_trains_stops_with_a_checkpoint_requeues_and_resumes_exactly(cluster, tmp_path):
    env = {**subprocess_env(tmp_path / "cache"), **cluster}
    baseline = tmp_path / "baseline"
    res = ftcli(train_args(baseline, *SETS), tmp_path, env)
    assert res.returncode == 0, res.stderr[-3000:]

    run_dir = tmp_path / "run"
    script = tmp_path / "job.sbatch"
    res = ftcli(["render-workload", "--recipe", "tiny-qwen-cpu", "--launcher", "slurm", "-o", str(script),
                 "--set", "compute.slurm.devices=cpu", "--set", "compute.slurm.install=false",
                 "--set", f"output.dir={run_dir}", *(a for s in SETS for a in ("--set", s))], tmp_path, env)
    assert res.returncode == 0, res.stderr
    assert ftcli(["render-workload", "--check", str(script)], tmp_path, env).returncode == 0
    log = tmp_path / "job.out"
    # sbatch passes this environment on (PATH with the venv's torchrun, PYTHONPATH, FTCLI_CACHE, OMP_NUM_THREADS)
    submitted = subprocess.run(["sbatch", "--parsable", "-o", str(log), str(script)], env=env, cwd=tmp_path,
                               capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    try:
        _wait("step 3", lambda: _steps(run_dir) >= 3)
        subprocess.run(["scancel", "--signal=TERM", job_id], env=env, check=True, timeout=60)
        _wait("the requeue", lambda: _job(job_id, env).get("Restarts") == "1")
        _wait("the job's end", lambda: _job(job_id, env).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"))
    finally:
        subprocess.run(["scancel", job_id], env=env, timeout=60)
    out = log.read_text()
    assert _job(job_id, env)["JobState"] == "COMPLETED", out[-3000:]
    stopped = [line for line in out.splitlines() if line.startswith("ftcli: stopped")]
    assert stopped == [f"ftcli: stopped with a checkpoint; requeueing job {job_id} (it resumes with --resume)"]
    (resumed,) = [line for line in out.splitlines() if line.startswith("resumed from ")]
    step = int(resumed.rsplit(" ", 1)[1])
    assert 3 <= step < STEPS and resumed == f"resumed from {run_dir}/checkpoints/step_{step:08d} at step {step}"
    assert f"done: {STEPS} steps" in out
    keys = ("step", "loss", "grad_norm", "lr", "tokens_trained", "tokens_seen")
    assert [[m[k] for k in keys] for m in metrics(run_dir)] == [[m[k] for k in keys] for m in metrics(baseline)]
    assert json.loads((run_dir / "run.json").read_text())["status"] == "completed"
