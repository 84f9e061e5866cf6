"""Which backend runs each packed op on a machine: a pure decision over a `Machine` description.

`machine(device)` reads the machine (versions, importable kernels, CUDA capability, nvcc);
`decide_backends` picks one `Backend` per op; `check_packing_safe` lists what would make packed
training wrong there. Nothing here installs anything (that is `ftcli.model.kernels.install`).

Importing this module does not import torch: `machine("cpu")` and the decisions read versions and module
specs only (so `ftcli doctor --json` stays fast); `machine` on a CUDA device and `qwen35_missing_globals`
(the transformers module) import what they read.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

UNAVAILABLE = "unavailable"

# model_type -> family; the family decides which ops a packed block goes through.
MODEL_FAMILIES = {"qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "gpt_oss": "gpt_oss"}
FAMILY_OPS = {"qwen3_5": ("attention", "gated_delta_rule", "causal_conv1d"), "gpt_oss": ("attention",)}
QWEN35_MODULE = "transformers.models.qwen3_5.modeling_qwen3_5"
# the qwen3_5 module globals its linear-attention layer looks up at call time (replaced by `install`)
QWEN35_GLOBALS = {"gated_delta_rule": "torch_chunk_gated_delta_rule", "causal_conv1d": "causal_conv1d_fn"}

# Triton versions whose gated chunk backward is wrong on Hopper (fla #640): [3.4.0, 3.7.1)
_BAD_TRITON_ON_HOPPER = ((3, 4, 0), (3, 7, 1))


@dataclass(frozen=True)
class Backend:
    op: str  # attention | gated_delta_rule | causal_conv1d
    name: str  # e.g. torch_varlen, fla+tilelang, torch_segments, or UNAVAILABLE
    reason: str


@dataclass(frozen=True)
class Machine:
    """What the decision needs to know about the machine; `machine(device)` reads it."""

    device: str  # "cpu", "cuda:0"
    capability: tuple[int, int] | None = None  # CUDA compute capability
    versions: dict[str, str | None] = field(default_factory=dict)  # distribution -> version (None: absent)
    importable: frozenset[str] = frozenset()  # fla, tilelang, flash_attn, causal_conv1d
    torch_varlen: bool = False  # torch.nn.attention.varlen.varlen_attn exists
    flex: bool = False  # torch.nn.attention.flex_attention exists
    nvcc: bool = False  # tilelang JIT-compiles its kernels with nvcc
    fla_tilelang_env: str | None = None  # $FLA_TILELANG ("0" disables fla's tilelang backend)

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def hopper_bad_triton(self) -> bool:
        """Hopper GPU with a Triton whose gated chunk backward is wrong (fla #640): fla needs tilelang."""
        triton = _version_tuple(self.versions.get("triton"))
        return (self.capability or (0, 0))[0] == 9 and _BAD_TRITON_ON_HOPPER[0] <= triton < _BAD_TRITON_ON_HOPPER[1]

    @property
    def tilelang_usable(self) -> bool:
        return "tilelang" in self.importable and self.nvcc and self.fla_tilelang_env != "0"


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _has_module(name: str) -> bool:
    """Whether `name` can be imported. `find_spec` on a dotted name imports its parent packages (torch, for
    torch.nn.attention.varlen), so a submodule of a package not imported yet is looked up as a file instead."""
    top, _, rest = name.partition(".")
    try:
        if not rest or top in sys.modules:
            return importlib.util.find_spec(name) is not None
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root, *rest.split("."))
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return True
    return False


def _has_nvcc() -> bool:
    """Mirrors fla's check for a usable nvcc (CUDA_HOME, PATH, /usr/local/cuda)."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return True
    return shutil.which("nvcc") is not None


def machine(device: str | torch.device, packages: tuple[str, ...] = ()) -> Machine:
    """The machine as the decision sees it (and the versions of `packages` besides the kernels'); torch is
    imported only for a device other than the CPU."""
    capability = None
    if str(device) != "cpu":
        import torch

        device = torch.device(device)
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            device = torch.device("cuda", index)
            capability = tuple(torch.cuda.get_device_capability(device))
    dists = ("torch", "triton", "flash-linear-attention", "fla-core", "tilelang", "causal-conv1d", "flash-attn",
             *packages)
    return Machine(
        device=str(device),
        capability=capability,
        versions={name: _dist_version(name) for name in dists},
        importable=frozenset(m for m in ("fla", "tilelang", "flash_attn", "causal_conv1d") if _has_module(m)),
        torch_varlen=_has_module("torch.nn.attention.varlen"),
        flex=_has_module("torch.nn.attention.flex_attention"),
        nvcc=_has_nvcc(),
        fla_tilelang_env=os.environ.get("FLA_TILELANG"),
    )


def _version_tuple(version: str | None) -> tuple[int, ...]:
    parts = []
    for piece in (version or "0").split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts + [0] * (3 - len(parts)))


def decide_backends(
    model_type: str, device: str | torch.device | Machine, *, reference: bool = False
) -> list[Backend]:
    """The backend of every op a packed block of `model_type` goes through on `device` (no side effects).

    `device` is a device or an already read `Machine`. `reference=True` picks the exact torch references
    even on CUDA (for checks). An unknown model_type gets no backends: packing it is not supported.
    """
    m = device if isinstance(device, Machine) else machine(device)
    family = MODEL_FAMILIES.get(model_type)
    if family is None:
        return []
    fast = m.device_type == "cuda" and not reference
    slow_why = "reference requested" if reference else m.device_type.upper()
    if family == "gpt_oss":
        return [_gpt_oss_attention(m, fast, slow_why)]
    return [_qwen35_attention(m, fast, slow_why), _gated_delta(m, fast, slow_why), _conv(m, fast, slow_why)]


def _exact(op: str, name: str, what: str, why: str) -> Backend:
    return Backend(op, name, f"{why}: {what} (exact)")


def _gpt_oss_attention(m: Machine, fast: bool, slow_why: str) -> Backend:
    if fast and m.flex:
        return Backend("attention", "flex_sinks", "flex attention with a document + sliding-window block mask, "
                       "sinks applied through the log-sum-exp")
    return _exact("attention", "eager_segments", "eager attention per segment with sliding window and sinks",
                  "torch without flex attention" if fast else slow_why)


def _qwen35_attention(m: Machine, fast: bool, slow_why: str) -> Backend:
    if fast and "flash_attn" in m.importable:
        return Backend("attention", "flash_attn_varlen", f"flash-attn {m.versions.get('flash-attn')}")
    if fast and m.torch_varlen:
        return Backend("attention", "torch_varlen", f"no flash-attn: torch {m.versions.get('torch')} varlen_attn")
    return _exact("attention", "sdpa_segments", "sdpa per segment",
                  "no flash-attn and no torch varlen_attn" if fast else slow_why)


def _fla_name(m: Machine) -> str:
    return f"fla {m.versions.get('flash-linear-attention') or m.versions.get('fla-core')}"


def _gated_delta(m: Machine, fast: bool, slow_why: str) -> Backend:
    v = m.versions
    if not (fast and "fla" in m.importable):
        return _exact("gated_delta_rule", "torch_segments", "chunked torch rule per segment",
                      "no fla (pip install flash-linear-attention), slow" if fast else slow_why)
    if not m.hopper_bad_triton:
        return Backend("gated_delta_rule", "fla", _fla_name(m))
    if m.tilelang_usable:
        return Backend("gated_delta_rule", "fla+tilelang", f"Hopper + Triton {v.get('triton')}: fla's Triton "
                       f"backward is wrong there; its tilelang {v.get('tilelang')} kernels run instead")
    missing = ("tilelang is not installed" if "tilelang" not in m.importable
               else "FLA_TILELANG=0 disables tilelang" if m.fla_tilelang_env == "0"
               else "tilelang has no nvcc to compile with")
    return Backend("gated_delta_rule", UNAVAILABLE, f"{_fla_name(m)} on Hopper with Triton {v.get('triton')} "
                   f"computes wrong gated-delta gradients and {missing}: install tilelang (with a CUDA "
                   "toolkit's nvcc) or Triton >= 3.7.1")


def _conv(m: Machine, fast: bool, slow_why: str) -> Backend:
    if fast and "causal_conv1d" in m.importable:
        return Backend("causal_conv1d", "causal_conv1d",
                       f"causal-conv1d {m.versions.get('causal-conv1d')} with seq_idx")
    if fast and "fla" in m.importable:
        return Backend("causal_conv1d", "fla_conv_varlen", f"no causal-conv1d: {_fla_name(m)} Triton varlen conv")
    return _exact("causal_conv1d", "torch_segments", "torch conv per seq_idx segment",
                  "no causal-conv1d and no fla" if fast else slow_why)


def check_packing_safe(model_type: str, device: str | torch.device | Machine) -> list[str]:
    """Problems that would make packed training of `model_type` wrong (or impossible) on `device`: the
    backends' (`backend_problems`) and, for Qwen3.5, the transformers module's (imports it)."""
    problems = backend_problems(model_type, device)
    if MODEL_FAMILIES.get(model_type) == "qwen3_5":
        problems += [missing_global_problem(name) for name in qwen35_missing_globals()]
    return problems


def backend_problems(model_type: str, device: str | torch.device | Machine) -> list[str]:
    """The ops of `model_type` with no segment-aware backend on `device` (a pure decision, imports nothing)."""
    if model_type not in MODEL_FAMILIES:
        return [f"packed training is not supported for model_type {model_type!r} (ftcli keeps segments apart "
                f"for {', '.join(sorted(MODEL_FAMILIES))}); set data.packing.enabled: false"]
    return [f"{b.op}: {b.reason}" for b in decide_backends(model_type, device) if b.name == UNAVAILABLE]


def qwen35_missing_globals() -> list[str]:
    """The QWEN35_GLOBALS the installed transformers' qwen3_5 module lacks (imports it, and torch)."""
    module = importlib.import_module(QWEN35_MODULE)
    return [name for name in QWEN35_GLOBALS.values() if not callable(getattr(module, name, None))]


def missing_global_problem(name: str) -> str:
    return (f"this transformers has no {QWEN35_MODULE}.{name} to route packed blocks through; use transformers "
            "5.17-5.24")
