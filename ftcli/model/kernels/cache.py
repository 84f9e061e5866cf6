"""Compiled GPU kernels that outlive the process: each compiler's cache under ftcli's cache dir.

A GPU process of `generate`, `chat` or `train` compiles Triton kernels (fla's gated-delta and conv kernels,
the fused ops', torch.compile's) and autotunes them; a fresh H200 took 51.9 s to the first token of a 2-layer
model (issue 46). The compilers keep what they built in a cache dir, and a later process that finds it there
skips the work. `persistent_caches` points each at `<ftcli cache>/kernels/<name>` (`$FTCLI_CACHE`, else
~/.cache/ftcli) unless the user set it, and keeps fla's autotune results (`FLA_CACHE_RESULTS=1`), so the
cost is paid once per machine (per cache dir: point `FTCLI_CACHE` at a shared volume to share it). The CUDA
graph of a decoding step (`ftcli.model.decode`) is captured once per process; it cannot be kept.
"""

from __future__ import annotations

import os
from pathlib import Path

# (environment variable, folder under <ftcli cache>/kernels, what it keeps)
CACHES = (
    ("TRITON_CACHE_DIR", "triton", "Triton kernels (fla, fused ops, torch.compile) and their autotune results"),
    ("TORCHINDUCTOR_CACHE_DIR", "inductor", "torch.compile's compiled graphs"),
    ("TILELANG_CACHE_DIR", "tilelang", "tilelang kernels (fla on Hopper)"),
)
KEEP_AUTOTUNE = ("FLA_CACHE_RESULTS", "1")  # fla's Triton autotuners keep their results in Triton's cache


def persistent_caches(env: dict | None = None) -> tuple[Path, bool]:
    """Set each compiler's cache dir in `env` (default os.environ, which torchrun's workers inherit) to
    <ftcli cache>/kernels/<name> where the user has not set it; (that root, whether it held kernels already)."""
    from ftcli.data.cache import default_cache_root

    env = os.environ if env is None else env
    root = default_cache_root() / "kernels"
    warm = root.is_dir() and any(p.is_file() for p in root.rglob("*"))
    for var, folder, _ in CACHES:
        env.setdefault(var, str(root / folder))
    env.setdefault(*KEEP_AUTOTUNE)
    return root, warm


def compile_notice(root: Path, warm: bool) -> str:
    """The line a GPU process prints before its first kernels run: what is compiled, where it is kept, and
    that it is paid once."""
    if warm:
        return (f"GPU kernels: reusing the compiled kernels and autotune results in {root} (the CUDA graph of a "
                "decoding step is still captured once per process)")
    return (f"GPU kernels: the first run on this machine compiles and autotunes the Triton kernels (fla's "
            f"gated-delta and conv kernels; torch.compile's graphs) into {root}: paid once, later runs reuse "
            "them (FTCLI_CACHE moves it)")
