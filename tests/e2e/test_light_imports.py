"""`ftcli --help`, a bad `train` and `render-workload` import no torch, transformers, datasets, MLflow, TRL or PEFT
(house style 8: heavy imports happen inside the commands that need them). Each case starts a fresh interpreter
(about 1.5 s), so they live here rather than in the fast tier."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
HEAVY = ("torch", "transformers", "datasets", "mlflow", "trl", "peft")


def _run(argv: list[str]) -> tuple[int, str, list[str]]:
    """Run the CLI in a fresh interpreter: its exit code, its stderr and the heavy modules it imported."""
    code = (
        "import json, sys\n"
        f"sys.argv = ['ftcli', *{argv!r}]\n"
        "from ftcli.cli import run\n"
        "try:\n    run()\n    code = 0\nexcept SystemExit as e:\n    code = e.code or 0\n"
        f"sys.stderr.write('\\nRESULT ' + json.dumps([code, [m for m in {HEAVY!r} if m in sys.modules]]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "\nRESULT " in proc.stderr, proc.stderr
    stderr, result = proc.stderr.rsplit("\nRESULT ", 1)
    code_, heavy = json.loads(result)
    return code_, stderr, heavy


def test_help_is_light():
    code, stderr, heavy = _run(["--help"])
    assert code == 0 and heavy == [], stderr


def test_train_with_bad_recipe_fails_fast_without_heavy_imports():
    code, stderr, heavy = _run(["train", "--recipe", "qwen-b30"])
    assert code == 2, stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert heavy == []


@pytest.mark.parametrize("argv", [["render-workload", "--recipe", "qwen-b300"],
                                  ["render-workload", "--recipe", "qwen-b300", "--launcher", "slurm"],
                                  ["render-workload", "--check", str(GOLDEN / "qwen-b300-1node.yaml")]])
def test_render_workload_imports_no_heavy_modules(argv):
    code, stderr, heavy = _run(argv)
    assert code == 0, stderr
    assert heavy == []
