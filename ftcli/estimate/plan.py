"""The plan of a recipe: before a node-hour is spent, will it fit, how long will it take, what will it cost.

For the recipe's own accelerator and the other known cards, per GPU:

    state        params + grads + AdamW moments (sharded by FSDP2; LoRA: the whole base on every GPU with
                 `training.sharding: ddp`, the base sharded with fsdp; auto picks ddp where it fits)
    activations  for the recipe's checkpointing mode and block length
    loss         the loss's transient (full logits, one chunk of the chunked or of a fused loss)
    other        the rest of the peak phase (the root unit's unsharded gradients, bf16 gradient copies)
    total        against 92% of the card (ftcli.estimate.memory.USABLE)

then fits / does not; the settings that would fit when it does not (ftcli.estimate.fit); how many layers could
keep their activations when it fits with room; and s/step, wall time and GPU-hours for the recipe's data
(ftcli.estimate.datasize) from the step times measured in ftcli/assets/measured.json (ftcli.estimate.steptime;
"no measurement" where there is none); for full SFT, the fewest context-parallel ranks per block
(`training.context_parallel`) with which the recipe's block length fits each card, and with context parallelism the
slowest rank's share of the causal attention, contiguous and balanced (ftcli.estimate.cpbalance).

Pure data + arithmetic: no torch, no model code (model shapes come from the shipped or local config.json; token
counts from the pack cache, the synthetic config, or a sample of a local source). `ftcli.commands.plan` renders
`make_plan`; `fit_check` is what `render-workload` and `doctor` call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ftcli.config.errors import UserError
from ftcli.config.accelerators import accelerator_name
from ftcli.config.accelerators import parse_accelerator as parse_name
from ftcli.config.recipe import ComputeConfig, Recipe, TrainingConfig
from ftcli.estimate import memory
from ftcli.estimate.cpbalance import CPBalance, cp_balance
from ftcli.estimate.datasize import DataSize, data_size
from ftcli.estimate.fit import (CARDS, GPUS_PER_NODE, Suggestion, fits_card, fitting_settings, no_fit_reason,
                                setting_of, smallest_cp_that_fits)
from ftcli.estimate.shape import model_shape
from ftcli.estimate.steptime import StepTime, step_time


@dataclass(frozen=True)
class CardPlan:
    accelerator: str  # GPU_8xH100
    card: str
    gpus: int
    own: bool  # the recipe's compute.accelerator_type
    estimate: memory.Estimate
    usable_gib: float
    fits: bool
    keep_layers: int | None  # with full checkpointing and room: layers that could keep activations
    suggestions: tuple[Suggestion, ...]
    why: str  # when it does not fit and no setting tried does
    step: StepTime
    wall_hours: float | None
    gpu_hours: float | None
    sharding: str = "fsdp"  # LoRA: ddp (a whole base per GPU) | fsdp; full SFT: always fsdp
    cp_fits: int | None = 1  # full SFT: the fewest context-parallel ranks per block that fit (None: none does)

    def to_dict(self) -> dict[str, Any]:
        return {"accelerator": self.accelerator, "card": self.card, "gpus": self.gpus, "own": self.own,
                "sharding": self.sharding,
                "memory_gib": self.estimate.to_dict(), "usable_gib": round(self.usable_gib, 2), "fits": self.fits,
                "keep_layers": self.keep_layers, "context_parallel_fits": self.cp_fits, "fitting_settings": [list(s.overrides) for s in self.suggestions],
                "s_per_step": None if self.step.s_per_step is None else round(self.step.s_per_step, 4),
                "step_source": self.step.source, "step_measured": self.step.measured,
                "step_command": self.step.command, "why": self.why or None,
                "wall_hours": None if self.wall_hours is None else round(self.wall_hours, 3),
                "gpu_hours": None if self.gpu_hours is None else round(self.gpu_hours, 2)}



@dataclass(frozen=True)
class Plan:
    recipe: str
    method: str
    model: str
    params: int
    frozen_params: int
    setting: memory.Setting
    data: DataSize
    steps: int | None
    cards: tuple[CardPlan, ...] = field(default_factory=tuple)
    notes: tuple[str, ...] = ()
    cp_balance: CPBalance | None = None  # training.context_parallel > 1: each rank's causal attention work

    def to_dict(self) -> dict[str, Any]:
        s = self.setting
        return {"recipe": self.recipe, "method": self.method, "model": self.model, "params": self.params,
                "frozen_params": self.frozen_params,
                "setting": {"tokens_per_micro_batch": s.tokens, "master": s.master, "checkpointing": s.checkpointing,
                            "keep": s.keep, "loss": s.loss, "compute_bytes": s.compute_bytes,
                            "adapter_params": s.adapter_params, "sharding": s.sharding, "context_parallel": s.cp,
                            "objective": s.objective, "reference": s.reference},
                "data": {"tokens": self.data.tokens, "blocks": self.data.blocks, "source": self.data.source},
                "steps": self.steps, "cards": [c.to_dict() for c in self.cards], "notes": list(self.notes),
                "context_parallel_balance": None if self.cp_balance is None else self.cp_balance.to_dict()}


@dataclass(frozen=True)
class FitResult:
    """Does the recipe fit its own accelerator? (what render-workload enforces)."""

    fits: bool
    reason: str  # one line: what does not fit, and the nearest setting that does
    card: CardPlan | None  # None: the accelerator's card is not one ftcli has figures for



def parse_accelerator(accelerator: str) -> tuple[int, str]:
    try:
        parsed = parse_name(accelerator)
    except ValueError:
        raise UserError(f"--accelerator {accelerator!r} is not GPU_<gpus per node>x<card> (e.g. GPU_8xH100)") from None
    if parsed.card not in CARDS:
        raise UserError(f"--accelerator {accelerator}: unknown card {parsed.card!r}; known: {', '.join(CARDS)}")
    return parsed.gpus_per_node, parsed.card


def default_accelerators(compute: ComputeConfig) -> list[str]:
    """The compute section's own accelerator, then each other card ftcli has figures for with as many GPUs."""
    own = compute.accelerator_type
    world = compute.num_accelerators
    own_card = compute.accelerator.card
    return [own] + [accelerator_name(min(per_node, world), card) for card, per_node in GPUS_PER_NODE.items()
                    if card != own_card]


def card_plan(recipe: Recipe, shape: memory.ModelShape, accelerator: str, data: DataSize,
              steps: int | None) -> CardPlan:
    per_node, card = parse_accelerator(accelerator)
    world = max(per_node, math.ceil(recipe.compute.num_accelerators / per_node) * per_node)
    s = setting_of(recipe, shape, world, card=card)
    gb = CARDS[card]["memory_gb"]
    fits, e = fits_card(shape, s, gb)
    keep = None
    if fits and s.checkpointing == "full" and s.method_record.keeps_layers:
        keep = memory.layers_to_keep(shape, s, gb)
    length_key = "data.packing.block_len" if recipe.data.packing.enabled else "data.max_length"
    suggestions = () if fits else tuple(fitting_settings(shape, s, card, per_node, length_key,
                                                         recipe.training.per_device_batch, recipe.lora.r))
    why = "" if fits or suggestions else no_fit_reason(shape, s, card)
    st = step_time(recipe.training, shape, s, card, world)
    run_steps = steps if world == recipe.compute.num_accelerators else _steps(recipe.training, data, world)
    wall = st.s_per_step * run_steps / 3600 if st.s_per_step is not None and run_steps is not None else None
    return CardPlan(accelerator=accelerator, card=card, gpus=world, own=accelerator == recipe.compute.accelerator_type,
                    estimate=e, usable_gib=memory.usable_gib(gb), fits=fits, keep_layers=keep,
                    suggestions=suggestions, why=why, step=st, wall_hours=wall,
                    gpu_hours=None if wall is None else wall * world, sharding=s.sharding,
                    cp_fits=smallest_cp_that_fits(shape, s, gb))


def _steps(t: TrainingConfig, data: DataSize, world: int) -> int | None:
    if data.blocks is None:
        return t.max_steps
    # the ranks of a CP group share each block (fewer GPUs than a group, as a CPU recipe's compute section: one group)
    data_parallel = max(1, world // getattr(t, "context_parallel", 1))
    steps = math.ceil(data.blocks * t.epochs / (data_parallel * t.per_device_batch * t.grad_accum))
    return min(steps, t.max_steps) if t.max_steps else steps


def make_plan(recipe: Recipe, accelerators: list[str] | None = None) -> Plan:
    from ftcli.data.spec import data_spec

    shape = model_shape(recipe.model)
    data = data_size(data_spec(recipe), recipe.model)
    steps = _steps(recipe.training, data, recipe.compute.num_accelerators)
    own = recipe.compute.accelerator_type
    names = default_accelerators(recipe.compute)
    if accelerators:
        for a in accelerators:
            parse_accelerator(a)  # a typo is a one-line error
        names = [own] + [a for a in accelerators if a != own]
    notes = []
    if recipe.compute.accelerator.card not in CARDS:
        names.remove(own)
        notes.append(f"no memory figures for the recipe's {own}: cards known: {', '.join(CARDS)}")
    cards = tuple(card_plan(recipe, shape, a, data, steps) for a in names)
    t = recipe.training
    cp = getattr(t, "context_parallel", 1)
    balance = cp_balance(recipe.data.packing.block_len, cp, t.context_parallel_balance) if cp > 1 else None
    return Plan(recipe=recipe.name, method=recipe.training.method, model=recipe.model.id or str(recipe.model.config),
                params=shape.total_params, frozen_params=shape.frozen_params, setting=setting_of(recipe, shape),
                data=data, steps=steps, cards=cards, notes=tuple(notes), cp_balance=balance)


def fit_check(recipe: Recipe) -> FitResult:
    """Whether the recipe fits its own accelerator; the reason and the nearest fitting setting when not."""
    try:
        parse_accelerator(recipe.compute.accelerator_type)
    except UserError:
        return FitResult(True, f"memory fit not checked: no figures for {recipe.compute.accelerator_type} "
                               f"(cards known: {', '.join(CARDS)})", None)
    try:
        shape = model_shape(recipe.model)
    except UserError as e:
        return FitResult(True, f"memory fit not checked: {e}", None)
    c = card_plan(recipe, shape, recipe.compute.accelerator_type, DataSize(None, None, "not needed"), None)
    if c.fits:
        return FitResult(True, f"fits {c.accelerator}: {c.estimate.total:.1f} of {c.usable_gib:.1f} GiB usable per GPU", c)
    nearest = c.suggestions[0].text() if c.suggestions else c.why
    return FitResult(False, f"{recipe.name} does not fit {c.accelerator}: {c.estimate.total:.1f} GiB per GPU > "
                            f"{c.usable_gib:.1f} usable of {CARDS[c.card]['memory_gb']:.0f} GB; nearest that fits: "
                            f"{nearest}", c)
