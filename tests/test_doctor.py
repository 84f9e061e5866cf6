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


# ------------------------------------------------------------------------------------- can it run here
def cpu_here(ram_gib=24):
    from ftcli.compat import Here

    return Here(versions={"torch": "2.13.0+cpu", "transformers": "5.24.0"}, ram_bytes=ram_gib * 2**30,
                gpt_oss_attention="eager_segments")


def test_a_cpu_machine_cannot_run_qwen_b300_but_kernels_are_correct():
    from ftcli.doctor import doctor_report

    report = doctor_report(load_recipe("qwen-b300"), kernels.Machine(device="cpu"), cpu_here())
    assert report.kernels_correct and not report.fits and report.exit_code == 1
    assert report.verdict.startswith("recipe qwen-b300 cannot run here: qwen-b300 needs ~465 GiB of RAM on this CPU "
                                     "machine (2 processes), it has 24 GiB; it is a GPU_8xB300 recipe")
    names = [c.name for c in report.checks]
    assert "transformers 5.2.0-5.8.1 (Qwen3.5 packing arguments)" in names and "versions vs the tested matrix" in names


def test_the_tiny_recipes_run_on_a_cpu_machine():
    from ftcli.doctor import doctor_report

    for name in ("tiny-qwen-cpu", "tiny-gpt-oss-cpu"):
        report = doctor_report(load_recipe(name), kernels.Machine(device="cpu"), cpu_here())
        assert report.kernels_correct and report.fits and report.exit_code == 0
        assert report.verdict == f"recipe {name} can run correctly here"


def test_kernels_and_fit_are_judged_separately_on_a_gpu():
    from ftcli.compat import Here
    from ftcli.doctor import doctor_report

    h100 = Here(versions={"transformers": "5.24.0", "triton": "3.6.0", "flash-linear-attention": "0.6.0"},
                gpus=(("NVIDIA H100 80GB HBM3", 85_031_714_816),) * 8, capability=(9, 0), fla_importable=True,
                gpt_oss_attention="flex_sinks")
    report = doctor_report(load_recipe("qwen-b300"), hopper("3.6.0", tilelang=True), h100)
    assert report.kernels_correct and not report.fits
    assert report.fits_detail.startswith("qwen-b300 needs 81.7 GiB per GPU on 8 GPU(s); this NVIDIA H100")
    broken = doctor_report(load_recipe("qwen-b300", ["data.packing.block_len=8192"]), hopper("3.6.0", tilelang=False),
                           h100)
    assert not broken.kernels_correct and broken.fits and broken.exit_code == 1
    assert broken.verdict.startswith("recipe qwen-b300 cannot run correctly here: ")
    old = Here(**{**h100.__dict__, "versions": {**h100.versions, "transformers": "5.6.0"}})
    leaky = doctor_report(load_recipe("qwen-b300", ["data.packing.block_len=8192"]), hopper("3.6.0", tilelang=True),
                          old)
    assert not leaky.kernels_correct and "drops cu_seq_lens / seq_idx" in leaky.kernels_detail


def test_doctor_json_and_exit_code(capsys):
    import json

    assert run_doctor(load_recipe("qwen-b300"), as_json=True) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["recipe"] == "qwen-b300" and data["kernels_correct_here"] is True and data["fits_here"] is False
    assert data["exit_code"] == 1 and data["verdict"].startswith("recipe qwen-b300 cannot run here")
    assert {"model_type": "qwen3_5", "op": "gated_delta_rule", "backend": "torch_segments"}.items() <= \
        data["backends"][1].items()
    assert run_doctor(load_recipe("tiny-qwen-cpu"), as_json=True) == 0
    assert json.loads(capsys.readouterr().out)["fits_here"] is True


def test_doctor_text_says_kernels_and_fit_separately(capsys):
    assert run_doctor(load_recipe("qwen-b300")) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-3].startswith("kernels correct here: yes")
    assert lines[-2].startswith("fits here: no (qwen-b300 needs ~")
    assert lines[-1].startswith("recipe qwen-b300 cannot run here: ")
