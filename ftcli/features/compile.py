"""`training.compile`: torch.compile per decoder layer (`true`) or only the parts of each layer around its packed
kernels (`regions`). Full SFT: applied after activation checkpointing and before `fully_shard`
(ftcli.model.parallelize). LoRA: applied to the PEFT-wrapped model before TRL / accelerate wrap it
(`prepare_lora`, called by ftcli.train.lora.trainer.build_trainer), in place, so parameter and adapter names stay.

Compiling a whole layer does not pay on Qwen3.5: the gated-delta and attention kernels are graph breaks, and
under activation checkpointing a break inside the checkpointed layer sends all of it back to eager. The parts
around them have no break: the norms, the dense MLP (its activation and, with fp8, its float8 casts fuse into
the GEMMs' neighbours) and the other float8 linears (their amax and scale-and-cast fuse). A module already
fused by `training.fused_ops` stays as it is (a float8 linear inside a fused MLP is still compiled); an MoE MLP
(experts) is left alone in full SFT.

gpt-oss under LoRA (transformers 5.24 + PEFT, `torch._dynamo.explain` per layer): the only breaks are in the packed
attention. Flex attention with sinks (CUDA) broke on `cu.tolist()` where its block mask is looked up; with the
masks built once per forward before the layers (`ftcli.model.kernels.block_masks_ahead`, installed here) a layer
is one graph, flex attention inside it, PEFT's LoRA linears and dropout, the norms, the router and transformers'
grouped_mm experts included. The CPU reference (eager attention per segment) stays a break. `regions` under LoRA
adds the LoRA-wrapped linears and the MoE MLP (router and frozen grouped experts; only its router when the
experts carry an adapter or run transformers' per-expert loop, whose `nonzero` is a break) to full SFT's parts.
The 24 (or 36) layers share their graphs: dynamo keys them by code and guards, not by module, so a gpt-oss layer
compiles once per attention kind (sliding / full), plus once more when the number of segments changes (then
dynamic); `REGION_RECOMPILE_LIMIT` leaves room for eval's no-grad variants. TRL's whole-model `torch_compile` is
not used: it compiles the LM head and loss with the layers and breaks at the same places.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftcli.objectives import method_of
from ftcli.features.base import Feature

if TYPE_CHECKING:
    from torch import nn

SETTING = "training.compile"
# one graph per region shape (8 float8 weight shapes in a Qwen3.5 layer pair, norms on contiguous and strided
# inputs, eval blocks): dynamo's default of 8 would send the rest to eager
REGION_RECOMPILE_LIMIT = 64


def compile_regions(layer: nn.Module, lora: bool = False) -> list[str]:
    """The parts of one decoder layer that `training.compile=regions` compiles, by name in the layer (module doc);
    `lora`: also the LoRA-wrapped linears and the MoE MLP (or its router)."""
    from ftcli.features.float8 import is_float8_linear
    from ftcli.features.fused_ops import fused_modules

    fused = tuple(fused_modules().values())
    chosen: list[str] = []
    for name, m in layer.named_modules():
        if not name or any(name.startswith(c + ".") for c in chosen) or isinstance(m, fused):
            continue
        parent, _, last = name.rpartition(".")
        moe = last == "mlp" and hasattr(m, "experts")
        dense_mlp = last == "mlp" and not moe
        norm = type(m).__name__.endswith(("RMSNorm", "RMSNormGated", "LayerNorm"))
        # an MoE MLP's router: any child but its experts (reached only when the MLP itself was not chosen)
        router = parent.endswith("mlp") and last != "experts" and hasattr(layer.get_submodule(parent), "experts")
        lora_part = lora and (hasattr(m, "lora_A") or (moe and _experts_compile(m.experts)) or router)
        if dense_mlp or norm or is_float8_linear(m) or lora_part:
            chosen.append(name)
    return chosen


def _experts_compile(experts: nn.Module) -> bool:
    """Frozen experts that run transformers' grouped (or batched) GEMMs, which trace whole; the per-expert loop
    (`nonzero`) and an expert adapter (PEFT's wrapper, ftcli.model.moe_lora) are left to eager."""
    # transformers' experts read the implementation from their config at call time, as here
    implementation = getattr(getattr(experts, "config", None), "_experts_implementation", None)
    return implementation in ("grouped_mm", "batched_mm") and not any(p.requires_grad for p in experts.parameters())


def compile_layer(layer: nn.Module, training) -> None:
    """In place: parameter names (and so checkpoints) stay the same."""
    import torch

    if training.compile == "regions":
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, REGION_RECOMPILE_LIMIT)
        for name in compile_regions(layer, lora=not method_of(training).trains_base):
            layer.get_submodule(name).compile()
    else:
        layer.compile()


def prepare_lora(model: nn.Module, training) -> None:
    """The LoRA path: every decoder layer of the PEFT-wrapped `model` compiled in place (`compile_layer`), and the
    packed attention's block masks built ahead of the layers (module doc)."""
    import torch

    from ftcli.model.build import decoder_layers
    from ftcli.model.kernels import block_masks_ahead

    # a whole gpt-oss layer: sliding / full attention x a first layer whose input needs no gradient x the segment
    # count and trained-token count going dynamic, and eval's no-grad variants: past dynamo's default of 8
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, REGION_RECOMPILE_LIMIT)
    if training.compile is True:  # the attention compiles with its layer
        block_masks_ahead(model)
    model.register_forward_pre_hook(_packing_metadata_dynamic, with_kwargs=True)
    for layer in decoder_layers(model):
        compile_layer(layer, training)


def _packing_metadata_dynamic(module, args, kwargs) -> None:
    """The packing metadata of a block (cu_seq_lens, trained_positions, fla's chunk indices) changes length with
    every block: compiled with a dynamic first dimension from the first step, instead of once static and once more
    dynamic. (The token tensors' first dimension is the batch of 1, which dynamo keeps static.)"""
    import torch

    for value in kwargs.values():
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            torch._dynamo.maybe_mark_dynamic(value, 0)


def describe(model, training) -> str | None:
    from ftcli.model.build import decoder_layers

    layers, lora = decoder_layers(model), not method_of(training).trains_base
    if training.compile != "regions":
        return f"compiled: {len(layers)} decoder layers, each whole" if lora else None
    return f"compiled regions: {len(compile_regions(layers[0], lora=lora))} in the first decoder layer"


FEATURE = Feature(
    name="compile", label="compile", setting=SETTING,
    applies=lambda t: bool(t.compile),
    speed_key=lambda t: f"compile={'regions' if t.compile == 'regions' else 'layers'}" if t.compile else None,
    per_layer=compile_layer, prepare_lora=prepare_lora, describe=describe,
)
