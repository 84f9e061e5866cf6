"""`ftcli --help`, a bad `train` and `render-workload` import no torch, transformers, datasets, MLflow, TRL or PEFT
(house style 8: heavy imports happen inside the commands that need them), and the modules that light code reads
(the hardware probe, the memory model, the feature registry, the chat formats) import no torch. Each case starts a
fresh interpreter (about 1.5 s), so they live here rather than in the fast tier (beside their rooms' tests)."""

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


# ------------------------------------------------------------------------ light modules, imported alone
def test_torch_cuda_build_is_read_without_importing_torch():
    import torch

    code = "import json, sys; from ftcli import hardware; print(json.dumps([hardware.torch_cuda_build(), 'torch' in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [torch.version.cuda, False]


def test_memory_model_imports_no_torch():
    code = "import sys, ftcli.estimate.memory; print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_importing_the_registry_imports_no_torch():
    code = "import sys, ftcli.features, ftcli.commands.doctor; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_reading_the_cpu_machine_imports_no_torch_and_keeps_the_callers_packages():
    code = ("import sys; from ftcli import hardware; m = hardware.read('cpu', ('mlflow',)); "
            "print('torch' in sys.modules, m.device_type, 'mlflow' in m.versions, 'transformers' in m.versions)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "cpu", "True", "True"]


def test_chat_formats_are_pure_string_code():
    """ftcli.data (no torch) and ftcli.inference share the chat formats: importing them loads no torch, transformers
    or numpy."""
    probe = "import sys, ftcli.chat_formats; print(sorted({'torch', 'transformers', 'numpy'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
