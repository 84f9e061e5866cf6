"""Float8 GEMMs for full SFT (`training.precision.fp8`), through torchao's float8 training.

Which linears: only those inside the decoder layers whose in and out features are both multiples of 16
(what the float8 GEMM needs) and at least hidden_size / 8 (a projection to a few heads, such as Qwen3.5's
gated-delta `in_proj_a`/`in_proj_b`, has too little work to repay the casts). The LM head, the
embeddings, the vision tower and every norm stay in the compute dtype: the LM head feeds the loss, and
its error would land on every token's logits.

How: dynamic tensorwise scales (torchao's default recipe), input and weight in e4m3, the output
gradient in e5m2; the module swap keeps parameter names, so checkpoints, resume and the Hugging Face
export are the same as without fp8. It runs on the meta-built model before `fully_shard`, so FSDP2
shards the same parameters (the all-gather stays in param_dtype). The master weights and the
optimizer are untouched.

Where: a CUDA GPU of compute capability >= 8.9 (Ada, Hopper, Blackwell) for speed; on CPU (tests only)
torchao's emulation (`emulate=True`: the same float8 values and scales, multiplied in float32), since torch's
own CPU `_scaled_mm` is a reference loop on some CPUs (0.4 s for a 1024 x 64 x 128 product, over a minute per
step of the tiny recipe).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftcli.config.errors import UserError
from ftcli.objectives import method_of
from ftcli.features.base import Feature, Found, Requirement

if TYPE_CHECKING:
    from torch import nn

MIN_CAPABILITY = (8, 9)  # float8 GEMMs need Ada, Hopper or Blackwell
SETTING = "training.precision.fp8"
PACKAGE = "torchao"
PIN = "torchao==0.18.0"
NEEDS_TORCHAO = f"{SETTING} needs torchao"  # the one place that says it (the errors, doctor and the workload)


def fp8_filter(hidden_size: int, layer_prefixes: tuple[str, ...]):
    """torchao's module_filter_fn: True for the linears that get float8 GEMMs (the module doc)."""
    from torch import nn

    min_features = max(16, hidden_size // 8)

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or not fqn.startswith(layer_prefixes):
            return False
        dims = (module.in_features, module.out_features)
        return all(d % 16 == 0 and d >= min_features for d in dims)

    return keep


def check_fp8_device(device) -> None:
    """One-line error where float8 GEMMs cannot run (a CUDA card older than compute capability 8.9)."""
    import torch

    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise UserError(f"{SETTING} needs a GPU of compute capability >= 8.9 (Ada, Hopper, "
                        f"Blackwell); this one is {torch.cuda.get_device_name(device)} ({'.'.join(map(str, capability))})")


def fp8_config(recipe: str = "tensorwise"):
    """torchao's Float8LinearConfig for `training.precision.fp8_recipe`: tensorwise is torchao's default config
    (dynamic per-tensor scales); rowwise is its "rowwise" recipe (per-row scales for the input, weight and
    output gradient, power-of-2 scales)."""
    from torchao.float8 import Float8LinearConfig

    if recipe not in FP8_RECIPES:
        raise UserError(f"training.precision.fp8_recipe: {recipe!r}; use {' or '.join(FP8_RECIPES)}")
    return Float8LinearConfig() if recipe == "tensorwise" else Float8LinearConfig.from_recipe_name(recipe)


FP8_RECIPES = ("tensorwise", "rowwise")


def convert_to_fp8(model: nn.Module, layers: list[nn.Module], hidden_size: int, recipe: str = "tensorwise",
                   emulate: bool = False) -> list[str]:
    """Swap the chosen linears of `layers` (modules of `model`) for torchao Float8Linear (scaling `recipe`;
    `emulate`: torchao's float32 emulation of the GEMMs, for CPU), in place; returns their names."""
    import dataclasses

    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as e:
        raise UserError(f"{NEEDS_TORCHAO} (pip install 'ftcli[gpu]'): {e}") from None
    names = {id(m): n for n, m in model.named_modules()}
    prefixes = tuple(names[id(layer)] + "." for layer in layers)
    keep = fp8_filter(hidden_size, prefixes)
    chosen = [n for n, m in model.named_modules() if keep(m, n)]
    # the weight-gradient GEMM's inner dimension is the tokens per micro-batch: the recipe makes it a multiple
    # of 16 (Recipe._fp8_tokens), so no operand is padded (a copy per GEMM)
    config = dataclasses.replace(fp8_config(recipe), emulate=emulate)
    convert_to_float8_training(model, config=config, module_filter_fn=keep)
    return chosen


def fp8_linears(model: nn.Module) -> list[str]:
    """Names of the modules that run float8 GEMMs (none without torchao)."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return []
    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]


def is_float8_linear(module: nn.Module) -> bool:
    """A torchao Float8Linear (False without torchao)."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return False
    return isinstance(module, Float8Linear)


# ------------------------------------------------------------------------------------------- the record
def _on(training) -> bool:
    return method_of(training).runs_features and training.precision.fp8


def validate(model, data, training) -> list[str]:
    """The float8 GEMM needs inner dimensions that are multiples of 16; in the weight-gradient GEMM that is
    the tokens per micro-batch (padding them would copy every float8 operand of every step)."""
    tokens = data.packing.block_len * training.per_device_batch
    if _on(training) and (not data.packing.enabled or tokens % 16):  # LoRA ignores fp8 (warned)
        return [f"{SETTING} needs packed blocks whose tokens per micro-batch (block_len x "
                f"per_device_batch = {tokens}) are a multiple of 16"]
    return []


def check(training, m) -> Found:
    """Torch-free: the capability and torchao of machine `m` (a ftcli.hardware.Machine)."""
    problems = []
    cap = ".".join(map(str, m.capability or (0, 0)))
    if (m.capability or (0, 0)) < MIN_CAPABILITY:
        problems.append(f"{SETTING} needs compute capability >= {'.'.join(map(str, MIN_CAPABILITY))}, this GPU is "
                        f"{cap}: set {SETTING}=false")
    if not m.versions.get(PACKAGE):
        problems.append(f"{NEEDS_TORCHAO}: pip install {PACKAGE}")
    return Found(tuple(problems), (f"fp8: {PACKAGE} {m.versions.get(PACKAGE)} on capability {cap}",))


def convert(model, training, device) -> None:
    """Before sharding: FSDP2 then shards the swapped modules' same parameters."""
    from ftcli.model.build import decoder_layers

    check_fp8_device(device)
    convert_to_fp8(model, decoder_layers(model), model.config.get_text_config().hidden_size,
                   training.precision.fp8_recipe, emulate=device.type == "cpu")


def describe(model, training) -> str:
    from ftcli.model.build import decoder_layers

    return (f"fp8 GEMMs (torchao float8, {training.precision.fp8_recipe}): {len(fp8_linears(model))} linears of "
            f"{len(decoder_layers(model))} decoder layers; the LM head, embeddings and small projections stay in "
            f"{training.precision.param_dtype}")


FEATURE = Feature(
    name="float8", label="fp8", setting=SETTING, applies=_on, validate=validate,
    requirements=lambda t: [Requirement(PIN, f"float8 training ({SETTING}), its Python part; the float8 GEMMs "
                                             "are torch's own")] if _on(t) else [],
    packages=(PACKAGE,), check=check,
    # the measured rows' key: "fp8" is tensorwise (every row so far), another recipe is its own key
    speed_key=lambda t: (("fp8" if t.precision.fp8_recipe == "tensorwise" else f"fp8={t.precision.fp8_recipe}")
                         if t.precision.fp8 else None),
    convert=convert, describe=describe,
)
