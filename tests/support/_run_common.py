"""Shared by the tests that run `ftcli train` or torchrun in subprocesses (test_train_full, test_launch,
test_distributed, test_eval, test_resume_world_size): a clean environment, the command lines, and what a run
dir holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_full_worker.py")
FAST = ["training.log_every=1", "tracking.enabled=false"]
# The README's quickstart and test commands (test_docs pins them there; test_train_full runs the generate line)
QUICKSTART_TRAIN = ("python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints/cpu.txt -e . && "
                    "ftcli train --recipe tiny-qwen-cpu")
QUICKSTART_GENERATE = 'ftcli generate runs/tiny-qwen-cpu -p "What is 2 plus 4?" --greedy --max-new-tokens 32'
TESTS = 'python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints/cpu.txt -e ".[dev]" && pytest'


def subprocess_env(cache_dir: Path) -> dict[str, str]:
    """This environment without MLflow / torchrun variables, one thread per process, its own data cache."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    out.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", FTCLI_CACHE=str(cache_dir))
    return out


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """`subprocess_env` with one data cache per test module (a test module imports this fixture to use it)."""
    return subprocess_env(tmp_path_factory.mktemp("ftcli-cache"))


def ftcli(args: list[str], cwd: Path, env: dict, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftcli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def train_args(run_dir: Path, *sets: str) -> list[str]:
    args = ["train", "--recipe", "tiny-qwen-cpu", "--set", f"output.dir={run_dir}"]
    for s in sets:
        args += ["--set", s]
    return args


def torchrun(nproc: int, args: list[str], cwd: Path, env: dict, timeout: int = 240,
             worker: Path = WORKER) -> subprocess.CompletedProcess:
    """`worker` (by default tests/support/_full_worker.py) under torchrun (standalone, `nproc` processes)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(worker)]
    return subprocess.run([*cmd, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def output_tail(res: subprocess.CompletedProcess) -> str:
    """The end of a finished subprocess's stdout and stderr, for an assertion message."""
    return res.stdout[-3000:] + res.stderr[-3000:]


def recipe_file(path: Path, *sets: str) -> Path:
    from ftcli.config.recipe import dump_recipe, load_recipe

    path.write_text(dump_recipe(load_recipe("tiny-qwen-cpu", list(sets))))
    return path


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
