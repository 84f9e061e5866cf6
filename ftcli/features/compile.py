"""`training.compile`: torch.compile per decoder layer (`true`) or only the parts of each layer around its packed
kernels (`regions`), applied after activation checkpointing and before `fully_shard` (ftcli.model.parallelize).

Compiling a whole layer does not pay on Qwen3.5: the gated-delta and attention kernels are graph breaks, and
under activation checkpointing a break inside the checkpointed layer sends all of it back to eager. The parts
around them have no break: the norms, the dense MLP (its activation and, with fp8, its float8 casts fuse into
the GEMMs' neighbours) and the other float8 linears (their amax and scale-and-cast fuse). A module already
fused by `training.fused_ops` stays as it is (a float8 linear inside a fused MLP is still compiled); an MoE MLP
(experts) is left alone. The LoRA path compiles through TRL (`compile: true`) and ignores `regions`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftcli.features.base import Feature

if TYPE_CHECKING:
    from torch import nn

SETTING = "training.compile"
# one graph per region shape (8 float8 weight shapes in a Qwen3.5 layer pair, norms on contiguous and strided
# inputs, eval blocks): dynamo's default of 8 would send the rest to eager
REGION_RECOMPILE_LIMIT = 64


def compile_regions(layer: nn.Module) -> list[str]:
    """The parts of one decoder layer that `training.compile=regions` compiles, by name in the layer (module doc)."""
    from ftcli.features.float8 import is_float8_linear
    from ftcli.features.fused_ops import fused_modules

    fused = tuple(fused_modules().values())
    chosen: list[str] = []
    for name, m in layer.named_modules():
        if not name or any(name.startswith(c + ".") for c in chosen) or isinstance(m, fused):
            continue
        dense_mlp = name.rpartition(".")[2] == "mlp" and not hasattr(m, "experts")
        norm = type(m).__name__.endswith(("RMSNorm", "RMSNormGated", "LayerNorm"))
        if dense_mlp or norm or is_float8_linear(m):
            chosen.append(name)
    return chosen


def compile_layer(layer: nn.Module, recipe) -> None:
    """In place: parameter names (and so checkpoints) stay the same."""
    import torch

    if recipe.training.compile == "regions":
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, REGION_RECOMPILE_LIMIT)
        for name in compile_regions(layer):
            layer.get_submodule(name).compile()
    else:
        layer.compile()


def describe(model, recipe) -> str | None:
    from ftcli.model.build import decoder_layers

    if recipe.training.compile != "regions":
        return None
    return f"compiled regions: {len(compile_regions(decoder_layers(model)[0]))} in the first decoder layer"


FEATURE = Feature(
    name="compile", label="compile", setting=SETTING,
    applies=lambda r: r.training.method == "full" and bool(r.training.compile),
    speed_key=lambda t: f"compile={'regions' if t.compile == 'regions' else 'layers'}" if t.compile else None,
    per_layer=compile_layer, describe=describe,
)
