"""ftcli.hardware: one description of this machine and one table of cards, low in the house."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ftcli import hardware


def test_one_card_table_serves_the_plan_and_the_mfu():
    from ftcli.estimate import fit as plan

    assert list(plan.CARDS) == ["H100", "H200", "B300", "A10"]  # the cards plan sizes runs for, in its order
    assert plan.CARDS["B300"] == {"memory_gb": 288, "bf16_flops": 2250e12}
    assert plan.GPUS_PER_NODE == {"H100": 8, "H200": 8, "B300": 8, "A10": 1}
    # MFU matches the longest card name inside the device name
    assert hardware.card_of("NVIDIA H100 PCIe").bf16_flops == 756e12
    assert hardware.card_of("NVIDIA H100 80GB HBM3").bf16_flops == 989e12
    assert hardware.card_of("NVIDIA A10G").name == "A10" and hardware.card_of("NVIDIA L4").bf16_flops == 121e12
    assert hardware.card_of("AMD Instinct MI300X") is None


def test_accelerator_types_are_the_vendors():
    """ftcli's AI Runtime accelerator types are databricks-sdk-air's `AcceleratorType`, name for name, with the same
    GPUs per node; each names a card ftcli plans for, and ftcli's accelerator parser reads the same card and count. This
    fails when the vendor adds a type ftcli does not know."""
    from ftcli.config.accelerators import AI_RUNTIME_TYPES, parse_accelerator

    compute = pytest.importorskip("databricks.air.compute")  # the `databricks` and `dev` extras install it
    vendor = {t.value: t.gpus_per_node for t in compute.AcceleratorType}
    ours = {name: parse_accelerator(name).gpus_per_node for name in AI_RUNTIME_TYPES}
    assert ours == vendor, f"the vendor's accelerator types differ: theirs {vendor}, ftcli's {ours}"
    for name in AI_RUNTIME_TYPES:
        card = parse_accelerator(name).card  # ftcli's one parser of accelerator strings
        assert hardware.CARDS[card].memory_gb  # a card ftcli plans for
        assert card.lower() in compute.AcceleratorType(name).gpu_type.value  # a10, h100_80gb, b300


def test_hardware_imports_only_config():
    tree = ast.parse(Path(hardware.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in imported if m.startswith("ftcli")} <= {m for m in imported if m.startswith("ftcli.config")}


def test_machine_facts_are_plain_data():
    hopper = hardware.Machine(device="cuda:0", capability=(9, 0), versions={"triton": "3.6.0"},
                              importable=frozenset({"fla", "tilelang"}), nvcc=True)
    assert hopper.hopper_bad_triton and hopper.tilelang_usable and hopper.fla_importable and not hopper.blackwell
    assert not hardware.Machine(device="cuda:0", capability=(9, 0), versions={"triton": "3.7.1"}).hopper_bad_triton
    assert hardware.Machine(capability=(10, 0)).blackwell and hardware.Machine().device_type == "cpu"
