"""`ftcli doctor` on this CPU machine, and its checks against described machines (Hopper, fla on CPU)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from ftcli import kernels
from ftcli.doctor import FAIL, NA, OK, WARN, doctor_checks, run_doctor
from ftcli.recipe import load_recipe


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # one table row per line, nothing cut


def by_name(checks) -> dict:
    return {c.name: c for c in checks}


def hopper(triton: str, *, tilelang: bool) -> kernels.Machine:
    return kernels.Machine(
        device="cuda:0", capability=(9, 0), torch_varlen=True, flex=True, nvcc=True,
        importable=frozenset({"fla", "tilelang"} if tilelang else {"fla"}),
        versions={"torch": "2.11.0", "triton": triton, "flash-linear-attention": "0.6.0",
                  "tilelang": "0.1.15" if tilelang else None},
    )


def test_doctor_import_is_cheap():
    code = "import sys, ftcli.doctor; print(sorted(m for m in ('torch', 'transformers', 'rich') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_doctor_reports_versions_and_cpu_backends(capsys):
    assert run_doctor() == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "│" in line]
    cells = [[c.strip() for c in row.split("│")[1:-1]] for row in rows]
    assert ["transformers", importlib.metadata.version("transformers")] in cells
    assert ["flash-linear-attention", "-"] in cells and ["GPU", "none"] in cells
    backends = {(c[0], c[1]): c[2] for c in cells if len(c) == 4}
    assert backends == {
        ("qwen3_5", "attention"): "sdpa_segments",
        ("qwen3_5", "gated_delta_rule"): "torch_segments",
        ("qwen3_5", "causal_conv1d"): "torch_segments",
        ("gpt_oss", "attention"): "eager_segments",
    }
    statuses = {c[0]: c[1] for c in cells if len(c) == 3}
    assert statuses["packing keeps segments apart (qwen3_5)"] == OK
    assert statuses["packing keeps segments apart (gpt_oss)"] == OK
    assert statuses["Hopper + Triton 3.4-3.7.0 (fla gradients)"] == NA


def test_doctor_recipe_that_packs_correctly_here_exits_0(capsys):
    assert run_doctor(load_recipe("tiny-qwen-cpu")) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "recipe tiny-qwen-cpu can run correctly here"


def test_doctor_recipe_with_named_attention_unpacked_exits_0():
    # packed + a named attention is refused when the recipe loads (tests/test_recipe.py)
    assert run_doctor(load_recipe("tiny-gpt-oss-cpu", ["model.attn_implementation=eager",
                                                        "data.packing.enabled=false"])) == 0


def test_doctor_recipe_packing_an_unsupported_model_exits_1(capsys):
    assert run_doctor(load_recipe("tiny-qwen-cpu", ["model.model_type=llama"])) == 1
    assert "packed training is not supported for model_type 'llama'" in capsys.readouterr().out.splitlines()[-1]


def test_hopper_with_bad_triton_blocks_qwen_recipes_unless_tilelang():
    qwen, gpt = load_recipe("tiny-qwen-cpu"), load_recipe("tiny-gpt-oss-cpu")
    name = "Hopper + Triton 3.4-3.7.0 (fla gradients)"
    bad = by_name(doctor_checks(qwen, hopper("3.6.0", tilelang=False)))
    assert bad[name].status == FAIL and bad[name].blocks_recipe and "install tilelang" in bad[name].detail
    assert bad["packing keeps segments apart"].status == FAIL  # the gated-delta op has no usable backend
    assert by_name(doctor_checks(qwen, hopper("3.6.0", tilelang=True)))[name].status == OK
    assert by_name(doctor_checks(qwen, hopper("3.7.1", tilelang=False)))[name].status == NA
    assert not by_name(doctor_checks(gpt, hopper("3.6.0", tilelang=False)))[name].blocks_recipe  # no gated delta


def test_fla_on_a_cpu_machine_blocks_qwen_recipes():
    cpu_with_fla = kernels.Machine(device="cpu", importable=frozenset({"fla"}), versions={})
    check = by_name(doctor_checks(load_recipe("tiny-qwen-cpu"), cpu_with_fla))["fla on a CPU-only machine"]
    assert check.status == FAIL and check.blocks_recipe and "pip uninstall flash-linear-attention" in check.detail
    gpt = by_name(doctor_checks(load_recipe("tiny-gpt-oss-cpu"), cpu_with_fla))["fla on a CPU-only machine"]
    assert gpt.status == FAIL and not gpt.blocks_recipe


def test_vlm_lora_checks():
    cpu = kernels.machine("cpu")
    vlm_lora = ["training.method=lora", "training.grad_accum=4"]
    checks = by_name(doctor_checks(load_recipe("qwen-b300", vlm_lora), cpu))
    loss = checks["VLM loss across grad accumulation"]
    assert loss.status == OK and "accepts_loss_kwargs=False" in loss.detail
    assert "normalize_loss_by_tokens" in loss.detail
    assert checks["LoRA all-linear reaching a vision tower"].status == OK  # exclude_vision defaults to true
    vision = by_name(doctor_checks(load_recipe("qwen-b300", [*vlm_lora, "lora.exclude_vision=false"]), cpu))
    assert vision["LoRA all-linear reaching a vision tower"].status == WARN
    assert by_name(doctor_checks(load_recipe("qwen-b300"), cpu))["VLM loss across grad accumulation"].status == NA
