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

Llama 3 and Qwen3 (LlamaRMSNorm / Qwen3RMSNorm with q/k norms, LlamaMLP / Qwen3MLP) and Gemma 3 (Gemma3RMSNorm;
its GeGLU MLP has no fused op here) get the same two liger kernels: each family names its classes and its norm's
offset (ftcli.families: fused_op_targets, rms_norm_offset).

`fuse_decoder_ops` swaps those modules for small modules (ftcli.features.fused_modules), in place, on the meta-built model and
before sharding. They hold the SAME parameter objects under the same names (`input_layernorm.weight`,
`mlp.gate_proj.weight`, ...), so checkpoints, resume, the Hugging Face export and FSDP2's sharding are what
they are without fusion; the MLP's linears stay child modules, so float8 linears (`ftcli.features.float8`, converted
first) keep their float8 GEMMs inside a fused MLP.

Only modules of exactly these classes are swapped (the vision tower's norms are other classes); a model with
none of them gets a one-line error instead of a silent no-op. The kernels are Triton: CUDA only. The
numbers (each fused op against the eager module at the 27B width, and the training losses with and without
fusion) are `benchmarks/fused_ops_gpu.py` and `benchmarks/levers_gpu.py`, BENCHMARKS.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from typing import TYPE_CHECKING

from ftcli.config.errors import UserError
from ftcli.families import FAMILIES
from ftcli.objectives import method_of
from ftcli.features.base import Feature, Found, Requirement

if TYPE_CHECKING:
    from torch import nn

SETTING = "training.fused_ops"
FUSED_OPS = ("rms_norm", "swiglu", "gated_norm")
# op -> the transformers classes it replaces, each family's (matched by exact class name: a subclass may compute
# otherwise), and the (offset + w) of each RMSNorm class (Family.rms_norm_offset)
TARGETS = {op: tuple(f.fused_op_targets[op] for f in FAMILIES.values() if op in f.fused_op_targets) for op in FUSED_OPS}
NORM_OFFSETS = {f.fused_op_targets["rms_norm"]: f.rms_norm_offset for f in FAMILIES.values() if "rms_norm" in f.fused_op_targets}
NORM_CASTING = {f.fused_op_targets["rms_norm"]: f.rms_norm_casting for f in FAMILIES.values() if "rms_norm" in f.fused_op_targets}
# op -> the package whose kernel it runs (doctor checks them torch-free)
PACKAGES = {"rms_norm": "liger-kernel", "swiglu": "liger-kernel", "gated_norm": "flash-linear-attention"}
PACKAGE_ALSO_IN = {"flash-linear-attention": "fla-core"}  # fla's kernels ship in fla-core too (its wrapper)
LIGER_PIN, LIGER_KIND = "liger-kernel==0.8.5", "pure Python + Triton"  # the workload's pin (ftcli.features.loss too)


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


def fused_modules() -> dict[str, type]:
    """op -> the module class that runs its fused kernel (ftcli.features.fused_modules: torch)."""
    from ftcli.features.fused_modules import FUSED_MODULES

    return FUSED_MODULES


def _swappable(module: nn.Module, op: str) -> bool:
    if type(module).__name__ not in TARGETS[op]:
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
                cls = type(child).__name__
                extra = (NORM_OFFSETS[cls], NORM_CASTING[cls]) if op == "rms_norm" else ()
                setattr(parent, attr, fused_modules()[op](child, getattr(kernels, op), *extra))
                swapped[op].append(names[id(child)])
    missing = [op for op, found in swapped.items() if not found]
    if missing:
        raise UserError(f"training.fused_ops: no module to fuse for {', '.join(missing)} in "
                        f"{type(model).__name__} (fused ops cover "
                        f"{', '.join(c for op in missing for c in TARGETS[op])}); drop it from training.fused_ops")
    return swapped


def fused_module_counts(model: nn.Module) -> dict[str, int]:
    """op -> how many modules of `model` run its fused kernel."""
    counts = {op: sum(isinstance(m, cls) for m in model.modules()) for op, cls in fused_modules().items()}
    return {op: n for op, n in counts.items() if n}


# ------------------------------------------------------------------------------------------- the record
def _on(training) -> bool:
    return method_of(training).runs_features and bool(training.fused_ops)  # LoRA ignores them (warned)


def validate(model, data, training) -> list[str]:
    from ftcli.families import fused_op_model_types  # the families whose modules name fused-op targets

    types = fused_op_model_types()
    if _on(training) and model.model_type not in types:
        return [f"{SETTING} covers the modules of model_type {', '.join(types)}; "
                f"this recipe's model_type is {model.model_type}: set {SETTING}=[]"]
    return []


def check(training, m) -> Found:
    """Torch-free: each op's package on machine `m` (a ftcli.hardware.Machine)."""
    problems, found = [], []
    for package in dict.fromkeys(PACKAGES[op] for op in training.fused_ops):
        have = m.versions.get(package) or m.versions.get(PACKAGE_ALSO_IN.get(package, ""))
        if not have:
            problems.append(f"{SETTING} needs {package}: pip install {package}")
        found.append(f"{package} {have}")
    return Found(tuple(problems), tuple(found))


def requirements(training) -> list[Requirement]:
    # the gated norm's fla is the Qwen3.5 family's own requirement (the workload installs it for every Qwen3.5)
    if _on(training) and {"rms_norm", "swiglu"} & set(training.fused_ops):
        return [Requirement(LIGER_PIN, f"fused RMSNorm / SwiGLU ({SETTING})", LIGER_KIND)]
    return []


def preflight(training, device) -> None:
    check_fused_device(device, training.fused_ops)
    load_kernels(training.fused_ops)


def convert(model, training, device) -> None:
    """The same parameter objects under the same names: sharding and checkpoints unchanged."""
    from ftcli.model.build import decoder_layers, text_final_norm

    ops = training.fused_ops
    check_fused_device(device, ops)
    fuse_decoder_ops(model, decoder_layers(model), ops, load_kernels(ops), final_norm=text_final_norm(model))


FEATURE = Feature(
    name="fused_ops", label="fused ops", setting=SETTING, applies=_on, validate=validate,
    requirements=requirements, packages=tuple(dict.fromkeys(PACKAGES.values())), check=check,
    speed_key=lambda t: "fused=" + "+".join(sorted(t.fused_ops)) if t.fused_ops else None,
    preflight=preflight, convert=convert,
    describe=lambda model, training: "fused ops (Triton): " + ", ".join(
        f"{op} x{n}" for op, n in fused_module_counts(model).items()),
)
