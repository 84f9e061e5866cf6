"""Known-bad combinations, the tested matrix and "can it run here", each on faked versions and machines."""

from __future__ import annotations

from pathlib import Path

import pytest

from ftcli.estimate import fit
from ftcli.model import compat
from ftcli import hardware
from ftcli.hardware import Machine
from ftcli.model.compat import FAIL, NA, OK, WARN
from ftcli.config.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[3]
H100 = ("NVIDIA H100 80GB HBM3", 85_031_714_816)
H200 = ("NVIDIA H200", 150_109_880_320)
B300 = ("NVIDIA B300 SXM6 AC", 287_000_000_000)
GOOD = {"torch": "2.11.0+cu130", "triton": "3.6.0", "transformers": "5.24.0", "trl": "1.16.0", "peft": "0.21.2",
        "flash-linear-attention": "0.6.0", "tilelang": "0.1.15", "liger-kernel": "0.8.5"}


def gpu(card=H200, n=8, capability=(9, 0), fla=True, flex=True, **versions) -> Machine:
    return Machine(device="cuda:0", versions={**GOOD, **versions}, gpus=(card,) * n, capability=capability,
                   ram_bytes=2 * 10**12, importable=frozenset({"fla"} if fla else ()), flex=flex)


LOCK = compat.read_constraints(ROOT / "constraints" / "cpu.txt")  # dev/CI's lock: the CPU matrix


def cpu(ram_gib=24) -> Machine:
    """A CPU machine with the locked torch and transformers."""
    return Machine(versions={"torch": f"{LOCK['torch']}+cpu", "transformers": LOCK["transformers"]},
                   ram_bytes=ram_gib * 2**30)


def check(recipe, here, name_start) -> compat.Problem:
    sections = (recipe.model, recipe.data.packing) if recipe is not None else (None, None)
    found = [p for p in compat.known_bad(*sections, here) if p.name.startswith(name_start)]
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize("version, status", [("5.1.9", OK), ("5.2.0", FAIL), ("5.5.3", FAIL), ("5.8.1", FAIL),
                                             ("5.8.2", OK), ("5.24.0", OK)])
def test_transformers_that_drop_qwen_packing_arguments(version, status):
    p = check(load_recipe("tiny-qwen-cpu"), gpu(transformers=version), "transformers 5.2.0-5.8.1")
    assert p.status == status and p.blocks_recipe == (status == FAIL)
    if status == FAIL:
        assert "drops cu_seq_lens / seq_idx" in p.detail
    unpacked = load_recipe("tiny-qwen-cpu", ["data.packing.enabled=false", "model.attn_implementation=sdpa"])
    assert check(unpacked, gpu(transformers=version), "transformers 5.2.0-5.8.1").status == NA
    assert check(load_recipe("tiny-gpt-oss-cpu"), gpu(transformers=version), "transformers 5.2.0").status == NA


@pytest.mark.parametrize("fla, triton, status", [("0.5.0", "3.6.0", FAIL), ("0.5.1", "3.7.1", FAIL),
                                                 ("0.6.0", "3.7.0", FAIL), ("0.6.0", "3.7.1", WARN)])
def test_blackwell_gated_delta_nan_gradients(fla, triton, status):
    here = gpu(B300, capability=(10, 3), **{"flash-linear-attention": fla, "triton": triton})
    p = check(load_recipe("qwen-b300"), here, "Blackwell gated-delta")
    assert p.status == status and p.blocks_recipe == (status == FAIL)
    assert "fla-org/flash-linear-attention#913" in p.detail
    hopper = gpu(H200, **{"flash-linear-attention": fla, "triton": triton})
    assert check(load_recipe("qwen-b300"), hopper, "Blackwell gated-delta").status == NA
    assert check(load_recipe("gpt-oss-h100"), here, "Blackwell gated-delta").status == NA


def test_fla_missing_on_a_gpu_machine_for_qwen():
    p = check(load_recipe("qwen-b300"), gpu(fla=False), "fla on a GPU machine")
    assert p.status == WARN and not p.blocks_recipe and "many times slower" in p.detail
    assert check(load_recipe("qwen-b300"), gpu(fla=True), "fla on a GPU machine").status == OK
    assert check(load_recipe("qwen-b300"), cpu(), "fla on a GPU machine").status == NA
    assert check(load_recipe("gpt-oss-h100"), gpu(fla=False), "fla on a GPU machine").status == NA


@pytest.mark.parametrize("attention, status", [("flex_sinks", OK), ("eager_segments", OK), ("sdpa_segments", FAIL),
                                               ("flash_attn_varlen", FAIL), (None, FAIL)])
def test_gpt_oss_packed_needs_an_attention_path_with_sinks(attention, status, monkeypatch):
    monkeypatch.setattr(compat, "sink_model_attention", lambda here: attention)  # what kernels would pick
    p = check(load_recipe("gpt-oss-h100"), gpu(), "gpt-oss packed attention")
    assert p.status == status and p.blocks_recipe == (status == FAIL)
    assert check(load_recipe("qwen-b300"), gpu(), "gpt-oss packed attention").status == NA


def test_the_sink_attention_follows_the_machines_attention_capabilities():
    """flex attention on CUDA applies the sinks through the log-sum-exp; without it, and on CPU, eager attention
    per segment does: both keep gpt-oss the model it is."""
    assert compat.sink_model_attention(gpu(flex=True)) == "flex_sinks"
    assert compat.sink_model_attention(gpu(flex=False)) == "eager_segments"
    assert compat.sink_model_attention(cpu()) == "eager_segments"
    assert check(load_recipe("gpt-oss-h100"), gpu(flex=False), "gpt-oss packed attention").status == OK


def test_versions_outside_the_tested_matrix():
    directory = ROOT / "constraints"
    assert compat.read_constraints(directory / "gpu-h100.txt") == compat.read_constraints(directory / "gpu-h200.txt")
    assert compat.matrix_check(gpu(), directory).status == OK  # torch 2.11.0+cu130 = 2.11.0, peft 0.21.2 = 0.21.*
    off = compat.matrix_check(gpu(H100, transformers="5.20.0", triton="3.7.1"), directory)
    assert off.status == WARN
    assert off.detail == ("outside constraints/gpu-h100.txt: triton 3.7.1 (tested 3.6.*), "
                          "transformers 5.20.0 (tested 5.24.0); the checks still apply, but these releases are untested: pin "
                          "them with pip install -c constraints/gpu-h100.txt")
    assert compat.matrix_check(gpu(B300), directory).detail.startswith("no tested matrix for NVIDIA B300")
    assert compat.matrix_check(cpu(), directory).detail == f"within constraints/cpu.txt ({len(LOCK)} pins)"
    built = compat.matrix_check(gpu(**{"flash-attn": "2.8.3.post2", "causal-conv1d": "1.7.0"}), directory)
    assert built.status == OK and built.detail == "within constraints/gpu-h200.txt (10 pins)"
    older = compat.matrix_check(gpu(**{"flash-attn": "2.7.4.post1", "causal-conv1d": "1.5.2"}), directory)
    assert older.detail == ("outside constraints/gpu-h200.txt: causal-conv1d 1.5.2 (tested 1.7.0), "
                            "flash-attn 2.7.4.post1 (tested 2.8.3.post2); the checks still apply, but these releases "
                            "are untested: pin them with pip install -c constraints/gpu-h200.txt")
    bad_cpu = Machine(versions={"torch": "2.12.1"})
    assert compat.matrix_check(bad_cpu, directory).detail == (
        f"outside constraints/cpu.txt: torch 2.12.1 (tested {LOCK['torch']}); the checks still apply, but these "
        "releases are untested: pin them with pip install -c constraints/cpu.txt")


def test_a_cpu_machine_cannot_run_the_gpu_recipes_but_runs_the_tiny_ones():
    [why] = fit.can_run_here(load_recipe("qwen-b300"), cpu())
    assert why.startswith("qwen-b300 needs ~") and "it has 24 GiB; it is a GPU_8xB300 recipe (8 GPUs)" in why
    assert fit.can_run_here(load_recipe("gpt-oss-h100"), cpu())
    assert fit.can_run_here(load_recipe("tiny-qwen-cpu"), cpu()) == []
    assert fit.can_run_here(load_recipe("tiny-gpt-oss-cpu"), cpu()) == []


def test_gpu_memory_here_against_the_plan():
    qwen = load_recipe("qwen-b300", ["training.activation_checkpointing_keep=0"])  # 81.5 GiB per GPU (ftcli plan)
    [why] = fit.can_run_here(qwen, gpu(H100))
    assert why == ("qwen-b300 needs 81.5 GiB per GPU on 8 GPU(s); this NVIDIA H100 80GB HBM3 has 72.9 usable of "
                   "79 GiB (the recipe is for GPU_8xB300)")
    assert fit.can_run_here(qwen, gpu(H200)) == []  # another card, but it fits
    [one] = fit.can_run_here(qwen, gpu(H200, n=1))  # one GPU holds the whole sharded state
    assert one.startswith("qwen-b300 needs 432.9") and "on 1 GPU(s)" in one
    assert fit.can_run_here(load_recipe("gpt-oss-h100"), gpu(H100)) == []
    notes = compat.gpu_notes(qwen.model, qwen.training, qwen.compute, gpu(H200))
    assert notes[0].status == WARN and notes[0].detail == "8 x NVIDIA H200 here, recipe: 8 x B300"
    assert compat.gpu_notes(qwen.model, qwen.training, qwen.compute, gpu(B300, capability=(10, 3)))[0].status == OK


# ------------------------------------------------------------------------- this machine, without torch
def _fake_nvidia_smi(tmp_path, monkeypatch, output: str | None, code: int = 0):
    """PATH holds only a fake nvidia-smi printing `output` (None: no nvidia-smi at all); no driver files."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    if output is not None:
        script = bin_dir / "nvidia-smi"
        script.write_text(f"#!/bin/sh\n[ \"$1 $2\" = '--query-gpu=name,memory.total --format=csv,noheader,nounits' ] "
                          f"|| exit 9\nprintf '{output}'\nexit {code}\n")
        script.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(hardware, "GPU_DRIVER_SIGNS", (tmp_path / "proc-driver-nvidia-gpus", tmp_path / "kfd"))


def test_gpus_come_from_nvidia_smi(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, monkeypatch, "NVIDIA H200, 143771\\nNVIDIA H200, 143771\\n")
    assert hardware.nvidia_smi_gpus() == (("NVIDIA H200", 143771 * 2**20),) * 2
    assert hardware.gpu_probe() == (True, "nvidia-smi: 2 x NVIDIA H200")


def test_no_nvidia_smi_means_no_gpu_unless_a_driver_is_loaded(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, monkeypatch, None)
    assert hardware.nvidia_smi_gpus() is None
    assert hardware.gpu_probe() == (False, "no nvidia-smi (no NVIDIA driver): no GPU")
    (tmp_path / "kfd").touch()
    assert hardware.gpu_probe() == (True, f"{tmp_path / 'kfd'} exists but nvidia-smi lists no GPU")


def test_nvidia_smi_listing_nothing_or_failing(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, monkeypatch, "")
    assert hardware.nvidia_smi_gpus() == () and hardware.gpu_probe() == (False, "nvidia-smi lists no GPU")
    monkeypatch.undo()
    _fake_nvidia_smi(tmp_path / "failing", monkeypatch, "No devices were found\\n", code=6)
    assert hardware.nvidia_smi_gpus() is None


def test_the_tested_matrix_names_the_file_that_pins_a_version():
    directory = ROOT / "constraints"
    assert compat.tested_in("transformers", "5.24.0", directory) == "constraints/gpu-h200.txt"  # not gpu-h100's -c
    assert compat.tested_in("transformers", "5.23.0", directory) is None
    assert compat.tested_in("transformers", None, directory) is None
    assert compat.tested_in("torch", "2.13.0+cpu", directory) == "constraints/cpu.txt"
