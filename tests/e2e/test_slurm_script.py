"""The Slurm launcher's sbatch script run with stand-ins for srun / torchrun / scontrol / pip: its shell logic
(rendezvous, requeue on a stop, resume, no shell injection). Each test starts bash and the stand-ins (about 2 s), so
they live here rather than in the fast tier beside the render and check tests (tests/unit/launchers/test_slurm.py);
the real Slurm run is tests/e2e/test_slurm_e2e.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ftcli.config.recipe import load_recipe
from ftcli.launchers import slurm

BASH = shutil.which("bash")


def _recipe(name: str, *sets: str):
    return load_recipe(name, ["compute.launcher=slurm", *sets])


# ------------------------------------------------------------------------------ the script's shell logic
def _fake_bin(tmp_path: Path) -> Path:
    """srun (runs the task), torchrun (records argv, env and the recipe file; exits $FAKE_TORCHRUN_EXIT),
    scontrol (hostnames, requeue) and pip, each recording its argv NUL-separated in $FAKE_LOG."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "srun": 'printf "%s\\0" "$@" > "$FAKE_LOG/srun.args"\nwhile [ "$1" != bash ]; do shift; done\nexec "$@"\n',
        "torchrun": ('[ "$1" = --help ] && { echo "${FAKE_TORCHRUN_HELP:-}"; exit 0; }\n'
                     'printf "%s\\0" "$@" > "$FAKE_LOG/torchrun.args"\nenv -0 > "$FAKE_LOG/torchrun.env"\n'
                     'prev=; for a in "$@"; do [ "$prev" = --recipe ] && cp "$a" "$FAKE_LOG/recipe.yaml"; prev=$a; done\n'
                     '[ -n "${FAKE_TERM_TASK:-}" ] && kill -TERM "$PPID"\n'
                     '[ -n "${FAKE_TORCHRUN_WAIT:-}" ] && { trap "exit 143" TERM; touch "$FAKE_LOG/training"; '
                     'sleep 30 & wait $!; }\n'
                     'exit "${FAKE_TORCHRUN_EXIT:-0}"\n'),
        "scontrol": ('printf "%s\\0" "$@" >> "$FAKE_LOG/scontrol.args"\n'
                     '[ "$1" = show ] && printf "node-a\\nnode-b\\n"\nexit 0\n'),
        "pip": 'printf "%s\\0" "$@" > "$FAKE_LOG/pip.args"\n',
    }
    for tool, body in scripts.items():
        (bin_dir / tool).write_text("#!/bin/bash\n" + body)
        (bin_dir / tool).chmod(0o755)
    return bin_dir


def _run_script(text: str, tmp_path: Path, signal_all_after: Path | None = None,
                **env: str) -> tuple[int, dict[str, list[str]], Path]:
    log = tmp_path / "log"
    log.mkdir(exist_ok=True)
    submit = tmp_path / "checkout"
    submit.mkdir(exist_ok=True)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    run_env = {"PATH": f"{_fake_bin(tmp_path)}:{os.environ['PATH']}", "HOME": str(tmp_path), "TMPDIR": str(tmp_path),
               "FAKE_LOG": str(log), "SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node-[a-b]",
               "SLURM_SUBMIT_DIR": str(submit), **env}
    proc = subprocess.Popen([BASH, str(script)], env=run_env, cwd=submit, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    if signal_all_after is not None:  # as Slurm signals a job: every process of it, shells and sleeps included
        deadline = time.monotonic() + 30
        while not signal_all_after.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGTERM)
    returncode = proc.wait(timeout=60)
    args = {p.stem: p.read_text().split("\0")[:-1] for p in log.glob("*.args")}
    return returncode, args, log


@pytest.mark.skipif(BASH is None, reason="needs bash")
def test_one_task_per_node_runs_torchrun_with_a_c10d_rendezvous_on_the_first_node(tmp_path):
    recipe = _recipe("qwen-b300", "compute.num_accelerators=16", "compute.slurm.rendezvous_port=29400",
                     f"output.dir={tmp_path / 'run'}")
    rc, args, log = _run_script(slurm.render(recipe), tmp_path)
    assert rc == 0
    assert args["srun"][:3] == ["--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    work = Path(args["torchrun"][-1]).parent
    assert args["torchrun"] == [
        "--nnodes=2", "--nproc_per_node=8", "--rdzv_id=77", "--rdzv_backend=c10d", "--rdzv_endpoint=node-a:29400",
        "-m", "ftcli", "train", "--recipe", str(work / "recipe.yaml")]  # no --resume on a first start
    assert work.parent == tmp_path and not work.exists()  # a private temp dir, removed after the run
    assert load_recipe(str(log / "recipe.yaml")) == recipe  # the job trains from the resolved recipe
    assert args["pip"] == ["install", "--progress-bar", "off", str(tmp_path / "checkout"),
                           "flash-linear-attention==0.6.0", "liger-kernel==0.8.5", "torchao==0.18.0"]
    assert "scontrol" in args and "requeue" not in args["scontrol"]
    # a torchrun that has --shutdown_timeout (torch 2.13) waits for the stop checkpoint as ftcli's launcher does
    (tmp_path / "again").mkdir()
    _, args, _ = _run_script(slurm.render(recipe), tmp_path / "again", FAKE_TORCHRUN_HELP="  --shutdown_timeout N")
    assert args["torchrun"][:3] == ["--nnodes=2", "--nproc_per_node=8", "--shutdown_timeout=900"]


@pytest.mark.skipif(BASH is None, reason="needs bash")
@pytest.mark.parametrize("restarts,checkpoint,task_exit,term,resumed,requeued", [
    ("0", False, 143, "", False, True),  # the workers stopped with a checkpoint (exit 143): requeue
    ("0", False, 1, "1", False, True),  # the task got Slurm's SIGTERM, torchrun failed on it: requeue
    ("0", False, 0, "1", False, False),  # a SIGTERM as the run finished: done, no requeue
    ("1", True, 0, "", True, False),  # the requeued job resumes and finishes
    ("1", False, 0, "", False, False),  # requeued before any checkpoint: starts again
    ("0", False, 1, "", False, False),  # a failure is not requeued
])
def test_a_stop_requeues_and_a_requeued_job_resumes(tmp_path, restarts, checkpoint, task_exit, term, resumed,
                                                     requeued):
    run_dir = tmp_path / "run"
    if checkpoint:
        (run_dir / "checkpoints" / "step_00000005").mkdir(parents=True)
    text = slurm.render(_recipe("tiny-qwen-cpu", "compute.slurm.devices=cpu", "compute.slurm.install=false",
                                f"output.dir={run_dir}"))
    rc, args, _ = _run_script(text, tmp_path, SLURM_RESTART_COUNT=restarts, FAKE_TORCHRUN_EXIT=str(task_exit),
                              FAKE_TERM_TASK=term)
    assert rc == (143 if term and task_exit else task_exit)
    assert ("--resume" in args["torchrun"]) == resumed
    assert (["requeue", "77"] == args["scontrol"][-2:]) == requeued
    assert "pip" not in args  # compute.slurm.install: false


@pytest.mark.skipif(BASH is None, reason="needs bash")
def test_a_sigterm_to_every_process_of_the_job_ends_in_a_requeue(tmp_path):
    """Slurm signals every process of the job (proctrack linuxproc / cgroup): the batch shell, the task's shell and
    its poll's `sleep`, torchrun. The shells keep waiting, torchrun's 143 comes through, the job requeues."""
    text = slurm.render(_recipe("tiny-qwen-cpu", "compute.slurm.devices=cpu", "compute.slurm.install=false",
                                f"output.dir={tmp_path / 'run'}"))
    rc, args, _ = _run_script(text, tmp_path, signal_all_after=tmp_path / "log" / "training", FAKE_TORCHRUN_WAIT="1")
    assert rc == 143 and args["scontrol"][-2:] == ["requeue", "77"]


INJECT = ";touch${{IFS}}{canary};#"


@pytest.mark.skipif(BASH is None, reason="needs bash")
def test_recipe_values_cannot_inject_shell_commands(tmp_path):
    """tests/unit/launchers/test_workload.py's injection case, against the sbatch script: the same hostile dependency, pip spec,
    env value and description reach pip and torchrun's environment as the very strings, and run nothing."""
    canary = tmp_path / "pwned"
    evil_dep = f'numpy; sys_platform != "$(touch {canary})" or os_name == "`touch {canary}`;"'
    evil_spec = "$CODE_SOURCE_PATH[gpu]" + INJECT.format(canary=canary)
    evil_env = f"$(touch {canary}) `touch {canary}` ' \" ; rm -rf / \nFTCLI_RECIPE_END\n"
    recipe = _recipe("qwen-b300", f"compute.dependencies={json.dumps([evil_dep])}",
                     f"compute.ftcli_spec={json.dumps(evil_spec)}", f"compute.env_variables.EVIL={json.dumps(evil_env)}",
                     f"description={json.dumps(evil_env)}", f"output.dir={tmp_path / 'run'}")
    text = slurm.render(recipe, fit_check=False)
    assert slurm.check_script(text) == []
    rc, args, log = _run_script(text, tmp_path)
    assert rc == 0 and not canary.exists()
    assert args["pip"][3:] == [str(tmp_path / "checkout") + "[gpu]" + INJECT.format(canary=canary),
                               "flash-linear-attention==0.6.0", "liger-kernel==0.8.5", "torchao==0.18.0", evil_dep]
    env = dict(item.split("=", 1) for item in (log / "torchrun.env").read_text().split("\0") if "=" in item)
    assert env["EVIL"] == evil_env
    assert load_recipe(str(log / "recipe.yaml")).description == evil_env


@pytest.mark.skipif(BASH is None, reason="needs bash")
def test_non_snapshot_ftcli_spec_is_one_quoted_argument(tmp_path):
    recipe = _recipe("gpt-oss-h100", 'compute.ftcli_spec=ftcli==0.1.0; python_version >= "3.10"',
                     f"output.dir={tmp_path / 'run'}")
    _, args, _ = _run_script(slurm.render(recipe), tmp_path)
    assert args["pip"] == ["install", "--progress-bar", "off", 'ftcli==0.1.0; python_version >= "3.10"']
