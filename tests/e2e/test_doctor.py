"""`ftcli doctor` on this CPU machine, and its checks against described machines (Hopper, fla on CPU)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from ftcli import hardware

from ftcli.model import compat, kernels
from ftcli.commands.doctor import FAIL, NA, OK, WARN, Check, doctor_checks, run_doctor
from ftcli.config.recipe import load_recipe

RECIPES = ("qwen-b300", "gpt-oss-h100", "gpt-oss-120b-h100", "tiny-qwen-cpu", "tiny-gpt-oss-cpu")


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
                  "tilelang": "0.1.15" if tilelang else None, "torchao": "0.18.0", "liger-kernel": "0.8.5"},
    )


def test_doctor_import_is_cheap():
    code = "import sys, ftcli.commands.doctor; print(sorted(m for m in ('torch', 'transformers', 'rich') if m in sys.modules))"
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
        ("llama", "attention"): "sdpa_segments",
        ("qwen3", "attention"): "sdpa_segments",
        ("qwen3_moe", "attention"): "sdpa_segments",
        ("gemma3_text", "attention"): "sdpa_segments",
    }
    statuses = {c[0]: c[1] for c in cells if len(c) == 3}
    for family in ("qwen3_5", "gpt_oss", "llama", "qwen3", "qwen3_moe", "gemma3"):
        assert statuses[f"packing keeps segments apart ({family})"] == OK
    assert statuses["Hopper + Triton 3.4-3.7.0 (fla gradients)"] == NA


def test_doctor_recipe_that_packs_correctly_here_exits_0(capsys):
    assert run_doctor(load_recipe("tiny-qwen-cpu")) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "recipe tiny-qwen-cpu can run correctly here"


def test_doctor_recipe_with_named_attention_unpacked_exits_0():
    # packed + a named attention is refused when the recipe loads (tests/unit/config/test_recipe.py)
    assert run_doctor(load_recipe("tiny-gpt-oss-cpu", ["model.attn_implementation=eager",
                                                        "data.packing.enabled=false"])) == 0


def test_doctor_recipe_packing_an_unsupported_model_exits_1(capsys):
    assert run_doctor(load_recipe("tiny-qwen-cpu", ["model.model_type=mistral"])) == 1
    assert "packed training is not supported for model_type 'mistral'" in capsys.readouterr().out.splitlines()[-1]


def test_hopper_with_bad_triton_blocks_qwen_recipes_unless_tilelang():
    qwen, gpt = load_recipe("tiny-qwen-cpu"), load_recipe("tiny-gpt-oss-cpu")
    name = "Hopper + Triton 3.4-3.7.0 (fla gradients)"
    bad = by_name(doctor_checks(qwen, hopper("3.6.0", tilelang=False)))
    assert bad[name].status == FAIL and bad[name].blocks_recipe and "install tilelang" in bad[name].detail
    assert bad["packing keeps segments apart"].status == FAIL  # the gated-delta op has no usable backend
    assert by_name(doctor_checks(qwen, hopper("3.6.0", tilelang=True)))[name].status == OK
    assert by_name(doctor_checks(qwen, hopper("3.7.1", tilelang=False)))[name].status == NA
    assert not by_name(doctor_checks(gpt, hopper("3.6.0", tilelang=False)))[name].blocks_recipe  # no gated delta


def test_expert_lora_kernels_warn_where_grouped_mm_or_triton_is_missing():
    """MoE expert LoRA (tiny-gpt-oss-cpu and tiny-qwen3-moe-cpu train the experts, qwen3-30b-a3b-lora-h100 over an
    FSDP-sharded base; gpt-oss-120b-1gpu keeps them in MXFP4): OK with torch 2.10+ on capability 9.0 and Triton; a warning, never a block, without grouped_mm or
    Triton; n/a for a recipe that trains no experts (gpt-oss-h100) or through PEFT's wrapper."""
    from dataclasses import replace

    name = "MoE expert LoRA kernels"
    good = hopper("3.6.0", tilelang=True)
    for recipe in (load_recipe("tiny-gpt-oss-cpu"), load_recipe("gpt-oss-120b-1gpu"), load_recipe("tiny-qwen3-moe-cpu"),
                   load_recipe("qwen3-30b-a3b-lora-h100")):
        assert by_name(doctor_checks(recipe, good))[name].status == OK
    old_torch = by_name(doctor_checks(load_recipe("gpt-oss-120b-1gpu"),
                                      replace(good, versions={**good.versions, "torch": "2.9.1"})))[name]
    assert old_torch.status == WARN and not old_torch.blocks_recipe and "no bf16 grouped_mm" in old_torch.detail
    no_triton = by_name(doctor_checks(load_recipe("tiny-gpt-oss-cpu"),
                                      replace(good, versions={**good.versions, "triton": None})))[name]
    assert no_triton.status == WARN and "run eagerly" in no_triton.detail
    for recipe in (load_recipe("gpt-oss-h100"), load_recipe("tiny-gpt-oss-cpu", ["lora.experts=peft"])):
        assert by_name(doctor_checks(recipe, good))[name].status == NA


def test_fla_on_a_cpu_machine_blocks_qwen_recipes():
    cpu_with_fla = kernels.Machine(device="cpu", importable=frozenset({"fla"}), versions={})
    check = by_name(doctor_checks(load_recipe("tiny-qwen-cpu"), cpu_with_fla))["fla on a CPU-only machine"]
    assert check.status == FAIL and check.blocks_recipe and "pip uninstall flash-linear-attention" in check.detail
    gpt = by_name(doctor_checks(load_recipe("tiny-gpt-oss-cpu"), cpu_with_fla))["fla on a CPU-only machine"]
    assert gpt.status == FAIL and not gpt.blocks_recipe


# qwen-b300 trained with LoRA: its full-SFT-only settings (fp8, kept layers, regional compile, liger) set back
QWEN_B300_AS_LORA = ["training.method=lora", "training.precision={}", "training.activation_checkpointing_keep=0",
                     "training.compile=false", "training.loss={}"]


def test_vlm_lora_checks():
    cpu = hardware.read("cpu")
    vlm_lora = [*QWEN_B300_AS_LORA, "training.grad_accum=4"]
    checks = by_name(doctor_checks(load_recipe("qwen-b300", vlm_lora), cpu))
    loss = checks["VLM loss across grad accumulation"]
    assert loss.status == OK and "accepts_loss_kwargs=False" in loss.detail
    assert "normalize_loss_by_tokens" in loss.detail
    assert checks["LoRA all-linear reaching a vision tower"].status == OK  # exclude_vision defaults to true
    vision = by_name(doctor_checks(load_recipe("qwen-b300", [*vlm_lora, "lora.exclude_vision=false"]), cpu))
    assert vision["LoRA all-linear reaching a vision tower"].status == WARN
    assert by_name(doctor_checks(load_recipe("qwen-b300"), cpu))["VLM loss across grad accumulation"].status == NA


# ------------------------------------------------------------------------------------- can it run here
KEEP0 = ["training.activation_checkpointing_keep=0"]


LOCK = compat.read_constraints(compat.constraints_dir() / "cpu.txt")  # dev/CI's lock: the CPU matrix


def cpu_here(ram_gib=24):
    """This CPU machine with the locked torch and transformers."""
    versions = {"torch": f"{LOCK['torch']}+cpu", "transformers": LOCK["transformers"]}
    return kernels.Machine(versions=versions, ram_bytes=ram_gib * 2**30)


def test_a_cpu_machine_cannot_run_qwen_b300_but_kernels_are_correct():
    from ftcli.commands.doctor import doctor_report

    report = doctor_report(load_recipe("qwen-b300"), cpu_here())
    assert report.kernels_correct and not report.fits and report.exit_code == 1
    assert report.verdict.startswith("recipe qwen-b300 cannot run here: qwen-b300 needs ~724 GiB of RAM on this CPU "
                                     "machine (2 processes), it has 24 GiB; it is a GPU_8xB300 recipe")
    names = [c.name for c in report.checks]
    assert "transformers 5.2.0-5.8.1 (Qwen3.5 packing arguments)" in names and "versions vs the tested matrix" in names


def test_the_tiny_recipes_run_on_a_cpu_machine():
    from ftcli.commands.doctor import doctor_report

    for name in ("tiny-qwen-cpu", "tiny-gpt-oss-cpu"):
        report = doctor_report(load_recipe(name), cpu_here())
        assert report.kernels_correct and report.fits and report.exit_code == 0
        assert report.verdict == f"recipe {name} can run correctly here"


def test_kernels_and_fit_are_judged_separately_on_a_gpu():
    from dataclasses import replace

    from ftcli.commands.doctor import doctor_report

    def h100(triton: str, *, tilelang: bool, transformers: str = "5.24.0") -> kernels.Machine:
        m = hopper(triton, tilelang=tilelang)
        return replace(m, versions={**m.versions, "transformers": transformers},
                       gpus=(("NVIDIA H100 80GB HBM3", 85_031_714_816),) * 8)

    # the recipe without its 14 kept layers (81.5 GiB per GPU): the mechanism, not the recipe's speed setting
    report = doctor_report(load_recipe("qwen-b300", KEEP0), h100("3.6.0", tilelang=True))
    assert report.kernels_correct and not report.fits
    assert report.fits_detail.startswith("qwen-b300 needs 81.5 GiB per GPU on 8 GPU(s); this NVIDIA H100")
    at_8k = [*KEEP0, "data.packing.block_len=8192"]
    broken = doctor_report(load_recipe("qwen-b300", at_8k), h100("3.6.0", tilelang=False))
    assert not broken.kernels_correct and broken.fits and broken.exit_code == 1
    assert broken.verdict.startswith("recipe qwen-b300 cannot run correctly here: ")
    leaky = doctor_report(load_recipe("qwen-b300", at_8k), h100("3.6.0", tilelang=True, transformers="5.6.0"))
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


def test_doctor_text_says_kernels_and_fit_separately_and_why_once(capsys):
    assert run_doctor(load_recipe("qwen-b300")) == 1
    out = capsys.readouterr().out
    tail = " ".join(out[out.index("kernels correct here"):].split())
    assert tail.startswith("kernels correct here: yes (every packed op has a correct backend")
    assert " fits here: no recipe qwen-b300 cannot run here: qwen-b300 needs ~" in tail
    assert tail.count("needs ~") == 1  # the reason is said once, by the verdict



# ------------------------------------------------------------------------------ fast, and honest about it
# A transformers release in the tested matrix (constraints/gpu-h200.txt), and one outside it: the tests fake the
# installed version (package metadata) instead of depending on what pip installed that day.
IN_MATRIX, OUTSIDE = "5.24.0", "9.0.0"
_FAKE_VERSION = """
import importlib.metadata as m, sys
real = m.version
m.version = lambda dist: {fake!r} if dist == "transformers" else real(dist)
sys.argv = ["ftcli", *{args!r}]
from ftcli.cli import run
run()
"""


@pytest.fixture
def transformers_version(monkeypatch):
    """Call with a version: package metadata says that transformers release is installed."""
    real = importlib.metadata.version

    def fake(installed: str) -> None:
        monkeypatch.setattr(importlib.metadata, "version",
                            lambda dist: installed if dist == "transformers" else real(dist))
    return fake


def _imported_by(args: list[str], transformers: str = IN_MATRIX) -> tuple[int, str, set[str]]:
    """Run `ftcli ARGS` under `python -X importtime` with `transformers` as the installed release's version: exit code,
    stdout, and every module it imported."""
    code = _FAKE_VERSION.format(fake=transformers, args=args)
    run = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "300"})
    modules = {line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    assert "ftcli.cli" in modules  # the parse saw the imports
    return run.returncode, run.stdout, modules


@pytest.mark.skipif(hardware.gpu_probe()[0], reason="a GPU driver is here: doctor rightly asks torch about the GPUs")
@pytest.mark.parametrize("args, code", [(["doctor", "--json"], 0), (["doctor", "--json", "-r", "qwen-b300"], 1),
                                        *[(["doctor", "--json", "-r", r], 0) for r in ("tiny-qwen-cpu", "tiny-gpt-oss-cpu")],
                                        *[(["doctor", "--json", "-r", r], 1) for r in ("gpt-oss-h100", "gpt-oss-120b-h100")],
                                        *[(["plan", "--json", "-r", r], 0) for r in RECIPES]])
def test_json_paths_import_neither_torch_nor_transformers(args, code):
    returncode, out, modules = _imported_by(args)
    assert returncode == code and json.loads(out)
    # plan samples the tiny recipes' local data through data/chat's template sandbox (transformers' chat template
    # utilities): no torch, no model code
    samples = args[0] == "plan" and args[-1].startswith("tiny-")
    assert not ({"torch", "transformers.modeling_utils"} if samples else {"torch", "transformers"}) & modules


@pytest.mark.skipif(hardware.gpu_probe()[0], reason="a GPU driver is here: doctor rightly asks torch about the GPUs")
def test_a_transformers_outside_the_matrix_is_imported_and_said_so():
    """A newer transformers than the tested matrix: doctor imports it for the checks that read it (the recorded facts
    are only known to hold for tested releases), says why in one line (text and JSON), and exits as before."""
    returncode, out, modules = _imported_by(["doctor", "--json", "-r", "tiny-qwen-cpu"], transformers=OUTSIDE)
    data = json.loads(out)
    assert returncode == 0 and data["verdict"] == "recipe tiny-qwen-cpu can run correctly here"
    assert "transformers.models.auto.configuration_auto" in modules and data["version_based_because"] is None
    assert data["transformers_imported_because"] == (
        f"transformers {OUTSIDE} is outside the tested matrix (constraints/*.txt): the checks that read it imported "
        "it (torch too, a few seconds) instead of trusting facts recorded for tested releases")
    assert not any(c["version_based"] for c in data["checks"])
    matrix = next(c for c in data["checks"] if c["name"] == "versions vs the tested matrix")
    assert matrix["status"] == WARN and matrix["detail"] == (
        f"outside constraints/cpu.txt: transformers {OUTSIDE} (tested {LOCK['transformers']}); the checks still apply, but these "
        "releases are untested: pin them with pip install -c constraints/cpu.txt")


def test_doctor_text_says_when_transformers_is_outside_the_matrix(capsys, transformers_version):
    transformers_version(OUTSIDE)
    assert run_doctor() == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith(f"transformers {OUTSIDE} is outside the tested matrix (constraints/*.txt): the checks")
    assert not any(line.startswith("version-based, nothing imported") for line in lines)


@pytest.mark.skipif(hardware.gpu_probe()[0], reason="a GPU driver is here")
def test_doctor_json_says_which_checks_were_version_based():
    returncode, out, _ = _imported_by(["doctor", "--json"])
    data = json.loads(out)
    assert returncode == 0 and data["deep"] is False and data["gpu"] == "none"
    assert data["gpu_source"].endswith("; torch not imported")
    assert data["version_based_because"] == (
        f"transformers {IN_MATRIX} is in the tested matrix "
        "(constraints/gpu-h200.txt): its recorded facts are used, ftcli doctor --deep imports it")
    assert data["transformers_imported_because"] is None
    assert [c["name"] for c in data["checks"] if c["version_based"]] == [
        "packing keeps segments apart (qwen3_5)", "VLM loss across grad accumulation"]
    import torch  # read from torch/version.py there, without importing torch

    assert data["torch_cuda"] == torch.version.cuda


def test_deep_imports_and_finds_what_was_recorded():
    """The recorded transformers facts are what importing the installed (tested) transformers says."""
    from ftcli.commands.doctor import RECORDED_TRANSFORMERS, Transformers

    imported = Transformers(deep=True)
    assert not imported.version_based
    if Transformers().version_based:  # the installed release is in the matrix: what is recorded must hold for it
        assert imported.qwen35_missing_globals() == list(RECORDED_TRANSFORMERS["qwen35_missing_globals"]) == []
        assert {t: imported.vlm_class(t) for t in RECORDED_TRANSFORMERS["vlm_classes"]} == \
            RECORDED_TRANSFORMERS["vlm_classes"]
    else:  # outside the matrix nothing recorded is used: every answer comes from the import
        assert Transformers().basis.startswith(f"transformers {imported.version} is outside the tested matrix")
    from ftcli.train.lora.trainer import normalize_loss_by_tokens  # the VLM check's "ftcli's LoRA path divides" holds

    assert callable(normalize_loss_by_tokens)


def test_deep_report_equals_the_version_based_one_but_for_the_flags(transformers_version):
    from ftcli.commands.doctor import doctor_report, read_machine

    transformers_version(IN_MATRIX)
    for name in (None, "qwen-b300", "tiny-qwen-cpu"):
        recipe = load_recipe(name) if name else None
        fast, deep = read_machine(), read_machine(deep=True)
        a = doctor_report(recipe, fast).to_dict()
        b = doctor_report(recipe, deep, deep=True).to_dict()
        assert b["deep"] and not any(c["version_based"] for c in b["checks"]) and b["version_based_because"] is None
        for report in (a, b):
            for key in ("deep", "version_based_because", "transformers_imported_because", "gpu_source", "versions"):
                report.pop(key)
            for c in report["checks"]:
                c.pop("version_based")
        assert a == b


def test_a_transformers_outside_the_matrix_is_imported():
    from ftcli.commands.doctor import Transformers

    untested = Transformers(installed="5.23.0")
    assert not untested.version_based and untested.tested_in is None
    checks = by_name(doctor_checks(None, hardware.read("cpu"), untested))
    assert checks["packing keeps segments apart (qwen3_5)"] == Check(
        "packing keeps segments apart (qwen3_5)", OK, "every op has a segment-aware backend")
    assert not checks["VLM loss across grad accumulation"].version_based


def test_checks_run_in_order_one_function_each():
    from ftcli.commands.doctor import CHECKS, Transformers

    assert [c.__name__ for c in CHECKS] == ["check_fla_on_cpu", "check_hopper_triton", "check_packing",
                                           "check_vlm_loss", "check_lora_vision", "check_speed_settings",
                                           "check_expert_lora_kernels"]
    assert [c.name for c in doctor_checks(None, kernels.Machine(device="cpu"), Transformers(installed="5.24.0"))] == [
        "fla on a CPU-only machine", "Hopper + Triton 3.4-3.7.0 (fla gradients)",
        "packing keeps segments apart (qwen3_5)", "packing keeps segments apart (gpt_oss)",
        "packing keeps segments apart (llama)", "packing keeps segments apart (qwen3)",
        "packing keeps segments apart (qwen3_moe)", "packing keeps segments apart (gemma3)",
        "VLM loss across grad accumulation", "LoRA all-linear reaching a vision tower", "fp8 and fused ops",
        "MoE expert LoRA kernels"]


def test_report_json_exact():
    from ftcli.commands.doctor import Transformers, doctor_report

    versions = {"torch": "2.13.0+cpu", "transformers": "5.24.0"}
    from dataclasses import replace

    here = cpu_here()
    report = doctor_report(load_recipe("tiny-qwen-cpu"), replace(here, gpu_source="no nvidia-smi: no GPU"),
                           versions, tf=Transformers(installed="5.24.0"))

    def check(name, status, detail, blocks=False, version_based=False):
        return {"name": name, "status": status, "detail": detail, "blocks_recipe": blocks,
                "version_based": version_based}

    assert report.to_dict() == {
        "versions": versions, "torch_cuda": None, "gpu": "none", "gpu_source": "no nvidia-smi: no GPU", "deep": False,
        "backends": [
            {"model_type": "qwen3_5_text", "op": "attention", "backend": "sdpa_segments",
             "why": "CPU: sdpa per segment (exact)"},
            {"model_type": "qwen3_5_text", "op": "gated_delta_rule", "backend": "torch_segments",
             "why": "CPU: chunked torch rule per segment (exact)"},
            {"model_type": "qwen3_5_text", "op": "causal_conv1d", "backend": "torch_segments",
             "why": "CPU: torch conv per seq_idx segment (exact)"}],
        "checks": [
            check("fla on a CPU-only machine", NA, "fla not installed"),
            check("Hopper + Triton 3.4-3.7.0 (fla gradients)", NA, "capability -, Triton -"),
            check("packing keeps segments apart", OK, "every op has a segment-aware backend", True, True),
            check("VLM loss across grad accumulation", NA, "not a LoRA run of a VLM class"),
            check("LoRA all-linear reaching a vision tower", NA, "not a LoRA run of a VLM class"),
            check("fp8 and fused ops", NA, "the recipe uses neither training.precision.fp8 nor training.fused_ops"),
            check("MoE expert LoRA kernels", NA, "no MoE expert LoRA through lora.experts=grouped in this recipe"),
            check("transformers 5.2.0-5.8.1 (Qwen3.5 packing arguments)", OK, f"transformers {LOCK['transformers']}"),
            check("Blackwell gated-delta NaN gradients (fla-org/flash-linear-attention#913)", NA, "capability -"),
            check("fla on a GPU machine (Qwen3.5 gated delta)", NA, "no GPU"),
            check("gpt-oss packed attention keeps the sinks", NA, "no packed gpt-oss blocks in this recipe"),
            check("versions vs the tested matrix", OK, f"within constraints/cpu.txt ({len(LOCK)} pins)"),
            check("GPUs vs compute.accelerator_type", NA, "no GPU: 2 CPU processes instead of GPU_1xA10")],
        "version_based_because": "transformers 5.24.0 is in the tested matrix (constraints/gpu-h200.txt): its "
                                 "recorded facts are used, ftcli doctor --deep imports it",
        "transformers_imported_because": None,
        "recipe": "tiny-qwen-cpu", "kernels_correct_here": True,
        "kernels_detail": "every packed op has a correct backend and no known-bad combination applies",
        "fits_here": True, "fits_detail": "~0.2 GiB of 22.1 GiB RAM usable (2 CPU processes)", "exit_code": 0,
        "verdict": "recipe tiny-qwen-cpu can run correctly here"}


def test_doctor_text_names_the_version_based_checks(capsys, transformers_version):
    transformers_version(IN_MATRIX)
    assert run_doctor() == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == ("version-based, nothing imported: packing keeps segments apart (qwen3_5); VLM loss across "
                         f"grad accumulation (transformers {IN_MATRIX} is in the "
                         "tested matrix (constraints/gpu-h200.txt): its recorded facts are used, ftcli doctor --deep "
                         "imports it)")


def test_fp8_and_fused_ops_are_checked_where_they_run():
    """qwen-b300 ships fp8: on a GPU it needs torchao and capability >= 8.9 (FAIL, blocking, with the fix);
    fused ops need their packages; on a CPU-only machine (planning) it is not judged."""
    from ftcli.commands.doctor import Transformers, check_speed_settings

    tf = Transformers(installed="5.24.0")
    h200 = hopper("3.6.0", tilelang=True)
    [ok] = check_speed_settings(load_recipe("qwen-b300"), h200, tf)
    assert (ok.status, ok.detail) == (OK, "fp8: torchao 0.18.0 on capability 9.0")
    a100 = kernels.Machine(device="cuda:0", capability=(8, 0), versions={"liger-kernel": "0.8.5"})
    [bad] = check_speed_settings(load_recipe("qwen-b300", ["training.fused_ops=[swiglu,gated_norm]"]), a100, tf)
    assert bad.status == FAIL and bad.blocks_recipe
    assert bad.detail == ("training.precision.fp8 needs compute capability >= 8.9, this GPU is 8.0: set "
                          "training.precision.fp8=false; training.precision.fp8 needs torchao: pip install torchao; "
                          "training.fused_ops needs flash-linear-attention: pip install flash-linear-attention")
    [cpu] = check_speed_settings(load_recipe("qwen-b300"), kernels.Machine(device="cpu"), tf)
    assert (cpu.status, cpu.detail) == (NA, "no GPU here (both run on the training machine's GPUs)")
    [lora] = check_speed_settings(load_recipe("qwen-b300", QWEN_B300_AS_LORA), h200, tf)
    assert lora.status == NA
    assert not doctor_report_blocks(load_recipe("qwen-b300", ["training.precision.fp8=false"]), a100)


def doctor_report_blocks(recipe, m) -> bool:
    from ftcli.commands.doctor import Transformers

    return any(c.blocks_recipe and c.status == FAIL for c in doctor_checks(recipe, m, Transformers(installed="5.24.0"))
               if c.name == "fp8 and fused ops")
