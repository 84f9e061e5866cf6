"""What a training step reports: the formatted step line, peak memory, and the peak FLOP/s MFU divides by.
Shared by both trainers (ftcli.train_full, ftcli.train_lora)."""

from __future__ import annotations

import resource
from typing import Any

import torch

# Peak dense bf16 tensor-core FLOP/s per GPU, for MFU. Datasheet numbers without sparsity; B200/B300
# ~2.25 PFLOP/s dense bf16 (HGX). Matched by substring of torch.cuda.get_device_name(), longest first.
PEAK_BF16_FLOPS = {
    "B300": 2250e12, "B200": 2250e12, "H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12,
    "A100": 312e12, "L40S": 362e12, "A10": 125e12, "L4": 121e12,
}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_FLOPS[key]
    return None


def peak_memory_gib(device: torch.device) -> tuple[float, float | None, str]:
    """(peak allocated, peak reserved by the caching allocator, unit); on CPU the process's max RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30, "GiB"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, None, "GiB rss"


def format_step(m: dict[str, Any], total_steps: int) -> str:
    mfu = f"{100 * m['mfu']:.1f}%" if m.get("mfu") is not None else "n/a"
    reserved = f" (reserved {m['peak_mem_reserved']:.2f})" if m.get("peak_mem_reserved") is not None else ""
    return (
        f"step {m['step']}/{total_steps} | loss {m['loss']:.4f} | gnorm {m['grad_norm']:.3f} | lr {m['lr']:.2e} | "
        f"{m['tokens_per_s']:,.0f} tok/s ({m['tokens_per_s_per_device']:,.0f}/dev) | MFU {mfu} | "
        f"mem {m['peak_mem']:.2f}{reserved} {m['mem_unit']} | {m['s_per_step']:.3f} s/step"
    )
