"""Fused norm and SwiGLU kernels in the decoder layers (`training.fused_ops`, full SFT, CUDA).

Qwen3.5's layers run their norms and their MLP activation as chains of small elementwise kernels in eager
PyTorch; each link reads and writes the whole activation (32k tokens x 5120 or 17408 features), in the
forward, in the recompute and again in the backward:

    op           Qwen3.5 module (transformers)   eager                                      fused kernel
    rms_norm     Qwen3_5RMSNorm                  float32 copy, square, mean, rsqrt, two     liger-kernel's RMSNorm
                 (x / rms(x) * (1 + w))          multiplies, cast back                      (offset 1, gemma casting)
    swiglu       Qwen3_5MLP                      silu(gate), then * up                      liger-kernel's SiLU-mul
                 (down(silu(gate(x)) * up(x)))
    gated_norm   Qwen3_5RMSNormGated             float32 copies of x and gate, norm, w *,   fla's rms_norm_gated
                 (w * norm(x) * silu(gate))      silu, multiply, cast back

`fuse_decoder_ops` swaps those modules for the small modules below, in place, on the meta-built model and
before sharding. They hold the SAME parameter objects under the same names (`input_layernorm.weight`,
`mlp.gate_proj.weight`, ...), so checkpoints, resume, the Hugging Face export and FSDP2's sharding are what
they are without fusion; the MLP's linears stay child modules, so float8 (`ftcli.features.float8`) still swaps them.

Only modules of exactly these classes are swapped (the vision tower's norms are other classes); a model with
none of them gets a one-line error instead of a silent no-op. The kernels are Triton: CUDA only. The
numbers (each fused op against the eager module at the 27B width, and the training losses with and without
fusion) are `benchmarks/fused_ops_gpu.py` and `benchmarks/levers_gpu.py`, BENCHMARKS.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from ftcli.config.errors import UserError
from ftcli.config.recipe import FUSED_OP_PACKAGES
from ftcli.families import FAMILIES

FUSED_OPS = ("rms_norm", "swiglu", "gated_norm")
# op -> the transformers class it replaces (matched by exact class name: a subclass may compute otherwise)
TARGETS = {op: cls for f in FAMILIES.values() for op, cls in f.fused_op_targets.items()}  # ftcli.families: Qwen3.5's
PACKAGES = FUSED_OP_PACKAGES


@dataclass(frozen=True)
class Kernels:
    """The fused functions, with the signatures of the libraries' public functionals:

    rms_norm(x, weight, eps, offset, casting_mode, in_place)     liger_kernel.transformers.functional.liger_rms_norm
    swiglu(gate, up)                                              liger_kernel.transformers.functional.liger_swiglu
    gated_norm(x, gate, weight, bias, activation, eps=eps)        fla.modules.fused_norm_gate.rms_norm_gated
    """

    rms_norm: Callable | None = None
    swiglu: Callable | None = None
    gated_norm: Callable | None = None


def load_kernels(ops: Iterable[str]) -> Kernels:
    """The libraries' kernels for `ops`, or a one-line UserError naming the missing package."""
    found = {}
    for op in ops:
        try:
            if op == "rms_norm":
                from liger_kernel.transformers.functional import liger_rms_norm as fn
            elif op == "swiglu":
                from liger_kernel.transformers.functional import liger_swiglu as fn
            else:
                from fla.modules.fused_norm_gate import rms_norm_gated as fn
        except ImportError as e:
            raise UserError(f"training.fused_ops={op} needs {PACKAGES[op]} (GPU only: pip install 'ftcli[gpu]'): "
                            f"{e}") from None
        except Exception as e:  # noqa: BLE001 - a package that is there but fails to import (Triton, CUDA)
            raise UserError(f"training.fused_ops={op}: {PACKAGES[op]} failed to import: {type(e).__name__}: "
                            f"{e}") from None
        found[op] = fn
    return Kernels(**found)


def check_fused_device(device, ops: Iterable[str]) -> None:
    ops = list(ops)
    if ops and device.type != "cuda":
        raise UserError(f"training.fused_ops ({', '.join(ops)}) runs Triton kernels: it needs a CUDA GPU (this "
                        f"process is on {device.type}); set training.fused_ops=[] here")


class _FusedNorm(nn.Module):
    """A norm's own weight (the same Parameter, so the same name and shard) and eps, and its fused kernel."""

    def __init__(self, norm: nn.Module, kernel: Callable, eps: float):
        super().__init__()
        self.weight = norm.weight
        self.eps = eps
        self._kernel = kernel

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, fused"


class FusedZeroCenteredRMSNorm(_FusedNorm):
    """Qwen3_5RMSNorm through liger's RMSNorm: y = (x / rms(x) * (1 + w)) in float32, cast to x's dtype."""

    def __init__(self, norm: nn.Module, kernel: Callable):
        super().__init__(norm, kernel, norm.eps)

    def forward(self, x):
        return self._kernel(x, self.weight, self.eps, 1.0, "gemma", False)


class FusedSwiGLUMLP(nn.Module):
    """Qwen3_5MLP with silu(gate) * up in one kernel; the three linears are the original modules."""

    def __init__(self, mlp: nn.Module, kernel: Callable):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self._kernel = kernel

    def forward(self, x):
        return self.down_proj(self._kernel(self.gate_proj(x), self.up_proj(x)))


class FusedGatedRMSNorm(_FusedNorm):
    """Qwen3_5RMSNormGated through fla's rms_norm_gated: y = w * norm(x) * silu(gate)."""

    def __init__(self, norm: nn.Module, kernel: Callable):
        super().__init__(norm, kernel, norm.variance_epsilon)

    def forward(self, x, gate):
        return self._kernel(x, gate, self.weight, None, "silu", eps=self.eps)


FUSED_MODULES = {"rms_norm": FusedZeroCenteredRMSNorm, "swiglu": FusedSwiGLUMLP, "gated_norm": FusedGatedRMSNorm}


def _swappable(module: nn.Module, op: str) -> bool:
    if type(module).__name__ != TARGETS[op]:
        return False
    if op == "swiglu":  # only what liger's kernel computes: silu, and no bias
        act = getattr(getattr(module, "config", None), "hidden_act", None)
        return act in ("silu", "swish") and all(getattr(module, n).bias is None for n in ("gate_proj", "up_proj", "down_proj"))
    if op == "gated_norm":
        return getattr(module, "activation", "silu") in ("silu", "swish")
    return True


def fuse_decoder_ops(model: nn.Module, layers: Iterable[nn.Module], ops: Iterable[str], kernels: Kernels,
                     final_norm: nn.Module | None = None) -> dict[str, list[str]]:
    """Swap the eager modules of `ops` inside `layers` (and `final_norm`, the text model's last norm, for
    rms_norm) for their fused modules, in place; returns op -> the swapped modules' names in `model`.
    A UserError when an op finds nothing to swap."""
    ops = list(dict.fromkeys(ops))
    unknown = [op for op in ops if op not in FUSED_OPS]
    if unknown:
        raise UserError(f"training.fused_ops: unknown op(s) {', '.join(unknown)} (known: {', '.join(FUSED_OPS)})")
    names = {id(m): n for n, m in model.named_modules()}
    # (parent, attribute, module): every module under the layers, and the final norm under its parent
    slots = [(parent, attr, child) for layer in layers for parent in layer.modules()
             for attr, child in parent.named_children()]
    if final_norm is not None:
        parent_name, _, attr = names[id(final_norm)].rpartition(".")
        slots.append((model.get_submodule(parent_name), attr, final_norm))
    swapped: dict[str, list[str]] = {op: [] for op in ops}
    for parent, attr, child in slots:
        for op in ops:
            if _swappable(child, op):
                setattr(parent, attr, FUSED_MODULES[op](child, getattr(kernels, op)))
                swapped[op].append(names[id(child)])
    missing = [op for op, found in swapped.items() if not found]
    if missing:
        raise UserError(f"training.fused_ops: no module to fuse for {', '.join(missing)} in "
                        f"{type(model).__name__} (fused ops cover Qwen3.5's "
                        f"{', '.join(TARGETS[op] for op in missing)}); drop it from training.fused_ops")
    return swapped


def fused_module_counts(model: nn.Module) -> dict[str, int]:
    """op -> how many modules of `model` run its fused kernel."""
    counts = {op: sum(isinstance(m, cls) for m in model.modules()) for op, cls in FUSED_MODULES.items()}
    return {op: n for op, n in counts.items() if n}
