"""Which backend runs each packed op on a machine: a pure decision over a `Machine` description.

`decide_backends` picks one `Backend` per op on a `ftcli.hardware.Machine` (versions, importable kernels,
CUDA capability, nvcc); `check_packing_safe` lists what would make packed
training wrong there. Nothing here installs anything (that is `ftcli.model.kernels.install`).

Importing this module does not import torch: the decisions read a Machine only (so `ftcli doctor --json`
stays fast); `hardware.read` on a CUDA device and `qwen35_missing_globals` (the transformers module) import
what they read.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ftcli.families import BY_MODEL_TYPE, FAMILIES, find_family
from ftcli.families.base import DENSE, SINKS
from ftcli import hardware
from ftcli.hardware import Machine

if TYPE_CHECKING:
    import torch

UNAVAILABLE = "unavailable"

# model_type -> family name; the family (ftcli.families) decides which ops a packed block goes through.
MODEL_FAMILIES = {model_type: f.name for model_type, f in BY_MODEL_TYPE.items()}
FAMILY_OPS = {name: f.packed_ops for name, f in FAMILIES.items()}
# the one family whose layers look module globals up at call time (Qwen3.5's linear attention; `install`
# replaces them): its modeling module and op -> global name
_GLOBALS_FAMILY = next(f for f in FAMILIES.values() if f.module_globals)
QWEN35_MODULE = _GLOBALS_FAMILY.kernel_module
QWEN35_GLOBALS = dict(_GLOBALS_FAMILY.module_globals)
# the modeling module whose eager attention applies learned sinks (gpt-oss's): the sinks kernels' stock path
SINKS_MODULE = next(f.kernel_module for f in FAMILIES.values() if f.attention == SINKS)


@dataclass(frozen=True)
class Backend:
    op: str  # attention | gated_delta_rule | causal_conv1d
    name: str  # e.g. torch_varlen, fla+tilelang, torch_segments, or UNAVAILABLE
    reason: str


def decide_backends(
    model_type: str, device: str | torch.device | Machine, *, reference: bool = False
) -> list[Backend]:
    """The backend of every op a packed block of `model_type` goes through on `device` (no side effects).

    `device` is a device or an already read `Machine`. `reference=True` picks the exact torch references
    even on CUDA (for checks). An unknown model_type gets no backends: packing it is not supported.
    """
    m = device if isinstance(device, Machine) else hardware.read(device)
    family = find_family(model_type)
    if family is None:
        return []
    fast = m.device_type == "cuda" and not reference
    slow_why = "reference requested" if reference else m.device_type.upper()
    return [_ATTENTION[family.attention](m, fast, slow_why)] + [
        _OPS[op](m, fast, slow_why) for op in family.packed_ops if op != "attention"]


def attention_backend(kind: str, device: str | torch.device | Machine) -> Backend:
    """The packed attention backend of an attention kind (ftcli.families: dense | sinks) on `device`."""
    m = device if isinstance(device, Machine) else hardware.read(device)
    fast = m.device_type == "cuda"
    return _ATTENTION[kind](m, fast, m.device_type.upper())


def _exact(op: str, name: str, what: str, why: str) -> Backend:
    return Backend(op, name, f"{why}: {what} (exact)")


def _sinks_attention(m: Machine, fast: bool, slow_why: str) -> Backend:
    if fast and m.flex:
        return Backend("attention", "flex_sinks", "flex attention with a document + sliding-window block mask, "
                       "sinks applied through the log-sum-exp")
    return _exact("attention", "eager_segments", "eager attention per segment with sliding window and sinks",
                  "torch without flex attention" if fast else slow_why)


def _dense_attention(m: Machine, fast: bool, slow_why: str) -> Backend:
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


_ATTENTION = {DENSE: _dense_attention, SINKS: _sinks_attention}  # per ftcli.families attention kind
_OPS = {"gated_delta_rule": _gated_delta, "causal_conv1d": _conv}


def check_packing_safe(model_type: str, device: str | torch.device | Machine) -> list[str]:
    """Problems that would make packed training of `model_type` wrong (or impossible) on `device`: the
    backends' (`backend_problems`) and, for Qwen3.5, the transformers module's (imports it)."""
    problems = backend_problems(model_type, device)
    if model_type in BY_MODEL_TYPE and BY_MODEL_TYPE[model_type].module_globals:
        problems += [missing_global_problem(name) for name in qwen35_missing_globals()]
    return problems


def backend_problems(model_type: str, device: str | torch.device | Machine) -> list[str]:
    """The ops of `model_type` with no segment-aware backend on `device` (a pure decision, imports nothing)."""
    if model_type not in MODEL_FAMILIES:
        return [f"packed training is not supported for model_type {model_type!r} (ftcli keeps segments apart "
                f"for {', '.join(sorted(MODEL_FAMILIES))}); set data.packing.enabled: false"]
    return [f"{b.op}: {b.reason}" for b in decide_backends(model_type, device) if b.name == UNAVAILABLE]


def qwen35_missing_globals() -> list[str]:
    """The QWEN35_GLOBALS the installed transformers' Qwen3.5 module lacks (imports it, and torch)."""
    module = importlib.import_module(QWEN35_MODULE)
    return [name for name in QWEN35_GLOBALS.values() if not callable(getattr(module, name, None))]


def missing_global_problem(name: str) -> str:
    return (f"this transformers has no {QWEN35_MODULE}.{name} to route packed blocks through; use transformers "
            "5.17-5.24")
