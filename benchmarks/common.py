"""What the benchmark harnesses share: the staging line, same-call timing, peak memory and BENCHMARKS.md tables.

A harness runs as `python benchmarks/<name>.py`, so its own folder is on sys.path and `import common` finds
this module. torch is imported inside the functions: the table printer and the header work without it.

    print(common.header())      # Command: `python benchmarks/x.py --a 1`; NVIDIA H200, 2026-12-05 06:10 UTC
    print(common.staging_line("torch", "fla"))  # staged: torch 2.9.1 (cuda 12.8) | fla missing (No module ...)
    common.reset_peak(device)
    out, seconds = common.timed(step, warmup=1, repeats=5, device=device)   # seconds: one wall time per call
    print(common.table(["variant", "s/step", "peak GiB"], [["ftcli", f"{median:.3f}", common.peak_gib(device)]]))
"""

from __future__ import annotations

import gc
import importlib
import sys
import time
from datetime import datetime, timezone

GiB = 2**30


def _is_cuda(device) -> bool:
    import torch

    return torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()


def sync(device=None) -> None:
    """Wait for the work queued on the GPU (nothing on CPU), so that a wall-clock reading covers it.
    device None: the current CUDA device when there is one."""
    import torch

    if _is_cuda(device):
        torch.cuda.synchronize(device)


def timed(fn, warmup: int = 0, repeats: int = 1, device=None) -> tuple[object, list[float]]:
    """Call fn() `warmup` times untimed (compiles, autotuning, allocator growth), then `repeats` times, each
    call between two syncs: (what the last call returned, the wall seconds of each timed call)."""
    for _ in range(warmup):
        fn()
    out, seconds = None, []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        seconds.append(time.perf_counter() - start)
    return out, seconds


def reset_peak(device=None) -> float:
    """Collect garbage, give cached CUDA blocks back and restart the allocator's peak counter; the GiB still
    allocated (the floor of the next peak; 0.0 on CPU)."""
    import torch

    gc.collect()
    if not _is_cuda(device):
        return 0.0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device) / GiB


def peak_gib(device=None) -> float | None:
    """The CUDA allocator's peak GiB since the last reset_peak (torch.cuda.max_memory_allocated); None on CPU."""
    import torch

    return torch.cuda.max_memory_allocated(device) / GiB if _is_cuda(device) else None


def staging_line(*packages: str) -> str:
    """One line saying which of the staged packages import here and at which version (torch with its CUDA),
    so a device log shows at its top whether the wheels staged for the call were the ones used."""
    parts = []
    for name in packages:
        try:
            module = importlib.import_module(name)
        except Exception as e:  # a missing wheel, or one whose compiled part does not load on this machine
            parts.append(f"{name} missing ({str(e).splitlines()[0][:80] if str(e) else type(e).__name__})")
            continue
        version = getattr(module, "__version__", "?")
        if name == "torch":
            version += f" (cuda {module.version.cuda})" if module.version.cuda else " (cpu)"
        parts.append(f"{name} {version}")
    return "staged: " + " | ".join(parts)


def card(device=None) -> str:
    """The accelerator's name, or "cpu"."""
    import torch

    return torch.cuda.get_device_name(device) if _is_cuda(device) else "cpu"


def header(argv: list[str] | None = None, device=None) -> str:
    """The line above a BENCHMARKS.md table: the command that printed it, the card and the date."""
    argv = sys.argv if argv is None else argv
    command = " ".join(["python", "benchmarks/" + argv[0].rsplit("/", 1)[-1], *argv[1:]])
    return f"Command: `{command}`; {card(device)}, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"


def table(columns: list[str], rows: list[list], sep: str = "---") -> str:
    """A markdown table as BENCHMARKS.md writes them: `| a | b |`, `|---|---|`, then one line per row (cells
    through str(); None prints as "-"). sep: "---", "---:" (right-aligned) or "--- " style per column, or a list."""
    seps = sep if isinstance(sep, list) else [sep] * len(columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(seps) + "|"]
    lines += ["| " + " | ".join("-" if c is None else str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
