"""Memory against a card: the recipe's `memory.Setting` (LoRA's `training.sharding` resolved), whether it fits,
the single changes that would make it fit, and why nothing does. What `ftcli plan`, `doctor` and the LoRA
trainer's sharding decision share (ftcli.estimate.plan puts them together per card)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ftcli import hardware
from ftcli.config.errors import UserError
from ftcli.config.recipe import LoraConfig, LoraTraining, ModelConfig, Recipe, TrainingConfig
from ftcli.estimate import memory
from ftcli.families import FAMILIES, find_family
from ftcli.estimate.shape import InvalidModelConfig, adapter_params, model_shape
from ftcli.features.loss import FUSED_LINEAR_CE
from ftcli.objectives import method_of

# The cards plan sizes runs for: memory (GB, as sold) and peak dense bf16 FLOP/s (ftcli.hardware.CARDS)
CARDS: dict[str, dict[str, float]] = {c.name: {"memory_gb": c.memory_gb, "bf16_flops": c.bf16_flops}
                                      for c in hardware.CARDS.values() if c.memory_gb}
GPUS_PER_NODE = {c.name: c.gpus_per_node for c in hardware.CARDS.values() if c.memory_gb}
MEASURED_CARD = "H200"


@dataclass(frozen=True)
class Suggestion:
    overrides: tuple[str, ...]  # --set items
    total_gib: float

    def text(self) -> str:
        return f"{' '.join('--set ' + o for o in self.overrides)} ({self.total_gib:.1f} GiB)"


def lora_sharding(recipe: Recipe, shape: memory.ModelShape, card: str | None = None, world: int | None = None) -> str:
    """`training.sharding` resolved for LoRA on `card` (default: the recipe's own): "auto" is ddp where a whole
    base per GPU fits, else fsdp (also when neither fits: that is the one more GPUs or settings can fix); ddp
    on a card ftcli has no figures for."""
    chosen = recipe.training.sharding
    if chosen != "auto":
        return chosen
    if recipe.model.quantization == "mxfp4":  # a kept-MXFP4 base runs with DDP only (ftcli.model.mxfp4_lora)
        return "ddp"
    card = card or recipe.compute.accelerator.card
    if card not in CARDS:
        return "ddp"
    fits, _ = fits_card(shape, setting_of(recipe, shape, world, sharding="ddp"), CARDS[card]["memory_gb"])
    return "ddp" if fits else "fsdp"


def resolved_sharding(recipe: Recipe) -> tuple[str, str]:
    """(ddp | fsdp, why) for the LoRA trainer: the recipe's setting, or what `plan` says fits its accelerator."""
    if recipe.training.sharding != "auto":
        return recipe.training.sharding, "training.sharding"
    try:
        shape = model_shape(recipe.model)
    except UserError as e:
        return "ddp", f"training.sharding=auto, not sized ({e})"
    chosen = lora_sharding(recipe, shape)
    return chosen, (f"training.sharding=auto: a whole base per GPU {'fits' if chosen == 'ddp' else 'does not fit'} "
                    f"{recipe.compute.accelerator_type}")


def setting_of(recipe: Recipe, shape: memory.ModelShape, world: int | None = None, *, card: str | None = None,
               sharding: str | None = None) -> memory.Setting:
    t = recipe.training
    block = recipe.data.packing.block_len if recipe.data.packing.enabled else (recipe.data.max_length or 2048)
    common = dict(method=t.method, objective=t.objective,
                  reference=t.preference.reference if t.preference is not None else "model",
                  tokens=block * t.per_device_batch,
                  world=world or recipe.compute.num_accelerators,
                  checkpointing=t.activation_checkpointing, chunk_tokens=t.loss.chunk_tokens,
                  adapter_params=adapter_params(t, recipe.lora, shape))
    # LoRA: adapters in float32 over a base in model.dtype; every layer checkpointed or none. Its loss term: the
    # measured points' ("trl": TRL's fused head, inside the fitted activations); LoRA trains with ftcli's chunked loss
    # since issue 40 (one chunk's fp32 logits), not measured on a GPU yet
    if isinstance(t, LoraTraining):
        sharding = sharding or lora_sharding(recipe, shape, card, world)
        return memory.Setting(**common, master="fp32", compute_bytes=4 if recipe.model.dtype == "float32" else 2,
                              keep=0, loss="trl", sharding=sharding,
                              expert_quant="mxfp4" if recipe.model.quantization == "mxfp4" else "none",
                              merged_experts=merged_experts(recipe.model, t, recipe.lora), speed=speed_settings(t))
    return memory.Setting(**common, master="fp32" if t.precision.master_dtype == "float32" else "bf16",
                          compute_bytes=4 if t.precision.param_dtype == "float32" else 2,
                          keep=t.activation_checkpointing_keep, loss=t.loss.impl, sharding="fsdp",
                          speed=speed_settings(t), cp=t.context_parallel)


def cp_degrees(s: memory.Setting) -> list[int]:
    """The context-parallel degrees a full-SFT setting can take: powers of two that divide its GPUs and split its
    block into slices of whole gated-delta chunks (ftcli.config.recipe.CP_SLICE_MULTIPLE)."""
    from ftcli.config.recipe import CP_SLICE_MULTIPLE

    if not method_of(s.method).splits_blocks:
        return [1]
    out, n = [], 1
    while n <= s.world and s.world % n == 0 and s.tokens % (n * CP_SLICE_MULTIPLE) == 0:
        out.append(n)
        n *= 2
    return out


def smallest_cp_that_fits(shape: memory.ModelShape, s: memory.Setting, card_gb: float) -> int | None:
    """The fewest context-parallel ranks per block with which `s` fits the card, no layer keeping its activations
    (kept layers are speed, not need); None: no degree does; LoRA: 1."""
    return next((n for n in cp_degrees(s) if fits_card(shape, replace(s, cp=n, keep=0), card_gb)[0]), None)


def grouped_expert_lora(model: ModelConfig, training: TrainingConfig, lora: LoraConfig) -> bool:
    """Whether a LoRA recipe's experts go through ftcli.model.moe_lora (unmerged, grouped by expert; the LoRA
    trainer installs it where this says so): its family declares its experts' layout (gpt-oss, Qwen3-MoE), and
    the base is kept in MXFP4, or lora.target_parameters trains the experts with lora.experts=grouped. Over a
    base whole per rank (ddp) and one sharded by FSDP2 alike (inside a sharded unit's forward and backward
    FSDP2 hands the module its gathered weights: tests/e2e/test_lora_fsdp.py)."""
    if method_of(training).trains_base or getattr(find_family(model.model_type), "expert_layout", None) is None:
        return False
    if model.quantization == "mxfp4":
        return True
    return lora.experts == "grouped" and bool(lora.target_parameters)


def merged_experts(model: ModelConfig, training: TrainingConfig, lora: LoraConfig) -> bool:
    """Whether PEFT's ParamWrapper folds the expert LoRA into the weight: the experts are trained and not through
    the grouped expert LoRA (`grouped_expert_lora`)."""
    return (bool(lora.target_parameters) and model.quantization != "mxfp4"
            and not grouped_expert_lora(model, training, lora))


def speed_settings(training: TrainingConfig) -> tuple[str, ...]:
    """A training section's settings that change its step time but not its memory model, in the form of the
    step-time rows' `speed` field: each training feature's speed key (ftcli.features), in the registry's order."""
    from ftcli import features

    return features.speed_keys(training)


def fits_card(shape, s: memory.Setting, card_gb: float) -> tuple[bool, memory.Estimate]:
    e = memory.estimate(shape, s)
    return e.total <= memory.usable_gib(card_gb), e


def fitting_settings(shape: memory.ModelShape, s: memory.Setting, card: str, per_node: int,
                     length_key: str = "data.packing.block_len", batch: int = 1, lora_r: int = 1) -> list[Suggestion]:
    """Single changes that make `s` fit `card`, nearest first: checkpointing, fewer kept layers (the others then
    drop them all: they are speed, not need), the largest block (`length_key`,
    tokens per micro-batch / `batch`), bf16 master weights, a sharded LoRA base, more GPUs (not for DDP LoRA: it
    keeps a whole base per GPU); when none does, all of them together."""
    gb = CARDS[card]["memory_gb"]
    out: list[Suggestion] = []

    def attempt(overrides: tuple[str, ...], **changes) -> bool:
        ok, e = fits_card(shape, replace(s, **changes), gb)
        if ok:
            out.append(Suggestion(overrides, e.total))
        return ok

    method = s.method_record
    order = list(method.checkpointing)  # LoRA: every layer or none
    for mode in order[order.index(s.checkpointing) + 1:]:
        if attempt((f"training.activation_checkpointing={mode}",), checkpointing=mode, keep=0):
            break
    drop_keep: tuple[str, ...] = ()
    if s.keep and s.checkpointing == "full":  # kept layers are speed, not need: fewer first, then none
        fewer = memory.layers_to_keep(shape, replace(s, keep=0), gb)
        attempt((f"training.activation_checkpointing_keep={fewer}",), keep=fewer)
        s, drop_keep = replace(s, keep=0), ("training.activation_checkpointing_keep=0",)
    per_batch = s.tokens  # tokens per micro-batch = block_len x per_device_batch
    block = 1 << (per_batch.bit_length() - 1)
    if block == per_batch:
        block //= 2
    while block >= 512 * batch:
        # full SFT at short blocks: the chunked loss is faster than a fused one (features.loss.FUSED_LINEAR_CE)
        fused = FUSED_LINEAR_CE.get(s.loss) if method.runs_features else None
        chunked = fused is not None and block <= fused.chunked_faster_up_to
        loss = (("training.loss.impl=chunked",), {"loss": "chunked"}) if chunked else ((), {})
        if attempt((*drop_keep, f"{length_key}={block // batch}", *loss[0]), tokens=block, **loss[1]):
            break
        block //= 2
    if method.master_weights and s.master == "fp32":
        attempt((*drop_keep, "training.precision.master_dtype=bfloat16"), master="bf16")
    if not method.trains_base and shape.expert_shapes and FAMILIES[shape.family].mxfp4_experts:
        # the frozen experts kept at 4.25 bits (ftcli.model.mxfp4_lora); then the adapter's state (linear in
        # lora.r, 16 bytes per parameter) is what is left to cut: a smaller rank next to the kept base
        sharding = ("training.sharding=ddp",) if s.sharding == "fsdp" else ()  # a kept-MXFP4 base runs with DDP
        kept = () if s.expert_quant == "mxfp4" else ("model.quantization=mxfp4", *sharding)
        rank = lora_r
        while rank >= 1:
            changes = dict(expert_quant="mxfp4", sharding="ddp", adapter_params=s.adapter_params * rank // lora_r)
            if (kept or rank < lora_r) and attempt((*kept, *([f"lora.r={rank}"] if rank < lora_r else [])),
                                                   **changes):
                break
            rank //= 2
    if method.picks_sharding and s.sharding == "ddp" and s.expert_quant == "none":
        attempt(("training.sharding=fsdp",), sharding="fsdp")
    if not method.picks_sharding or s.sharding == "fsdp":  # a sharded model: more GPUs hold less each
        for nodes in range(max(1, s.world // per_node) + 1, 65):
            if attempt((*drop_keep, f"compute.num_accelerators={nodes * per_node}"), world=nodes * per_node):
                break
    if not out:
        changes: dict[str, Any] = {"checkpointing": "full", "keep": 0}
        overrides = [*drop_keep, "training.activation_checkpointing=full"]
        if method.master_weights:
            changes["master"] = "bf16"
            overrides.append("training.precision.master_dtype=bfloat16")
        block = 1 << (per_batch.bit_length() - 1)
        while block >= 512 * batch and not attempt((*overrides, f"{length_key}={block // batch}"), tokens=block,
                                                   **changes):
            block //= 2
    return out


def no_fit_reason(shape: memory.ModelShape, s: memory.Setting, card: str) -> str:
    usable = memory.usable_gib(CARDS[card]["memory_gb"])
    if s.method_record.picks_sharding and s.sharding == "ddp":
        base = memory.estimate(shape, s).params
        if base > usable:
            return (f"the base alone is {base:.1f} GiB > {usable:.1f} usable: LoRA with training.sharding=ddp keeps a "
                    "whole base per GPU, so more GPUs do not help")
    return (f"no setting tried fits {usable:.1f} GiB (full checkpointing, bf16 master, blocks down to 512, up to 64 "
            "nodes)")



def memory_on(recipe: Recipe, world: int) -> memory.Estimate:
    """Peak memory per process of the recipe on `world` GPUs (or CPU processes) of one machine."""
    shape = model_shape(recipe.model)
    return memory.estimate(shape, setting_of(recipe, shape, world))


# ----------------------------------------------------------------------------------------- this machine
def fit_here(recipe, here) -> tuple[bool, str]:
    """Whether the plan's memory per GPU (or, without GPUs, per CPU process) fits machine `here` (a
    ftcli.hardware.Machine: `ftcli doctor` and the launcher on a machine without a GPU ask), and the figures."""
    compute = recipe.compute
    wanted_card = compute.accelerator.card
    world = len(here.gpus) or recipe.training.cpu_processes
    try:
        per_rank = memory_on(recipe, world).total
    except InvalidModelConfig as e:
        return False, str(e)  # builds no model: refused here as by plan and train
    except UserError as e:
        return True, f"not checked: {e}"
    if not here.gpus:
        need, have = world * per_rank, 0.92 * here.ram_bytes / 2**30
        if need > have:
            return False, (f"{recipe.name} needs ~{need:.0f} GiB of RAM on this CPU machine ({world} processes), it "
                           f"has {here.ram_bytes / 2**30:.0f} GiB; it is a {compute.accelerator_type} recipe "
                           f"({compute.num_accelerators} GPUs): run it there (ftcli render-workload --recipe "
                           f"{recipe.name})")
        return True, f"~{need:.1f} GiB of {have:.1f} GiB RAM usable ({world} CPU processes)"
    name, total = here.gpus[0]
    usable = 0.92 * total / 2**30
    if per_rank > usable:
        kind = "" if wanted_card in name else f" (the recipe is for {compute.accelerator_type})"
        return False, (f"{recipe.name} needs {per_rank:.1f} GiB per GPU on {world} GPU(s); this {name} has "
                       f"{usable:.1f} usable of {total / 2**30:.0f} GiB{kind}")
    return True, f"{per_rank:.1f} GiB per GPU of {usable:.1f} usable on {world} x {name}"


def can_run_here(recipe, here) -> list[str]:
    """Why `recipe` cannot run on this machine (empty: it can): the plan's memory per GPU on the GPUs that are
    here (the launcher uses them all), or per CPU process against the RAM on a machine without GPUs."""
    ok, detail = fit_here(recipe, here)
    return [] if ok else [detail]
