"""`ftcli plan`: before a node-hour is spent, will the recipe fit, how long will it take, what will it cost.

For the recipe's own accelerator and the other known cards, per GPU:

    state        params + grads + AdamW moments (sharded by FSDP2; LoRA: the whole base on every GPU with
                 `training.sharding: ddp`, the base sharded with fsdp; auto picks ddp where it fits)
    activations  for the recipe's checkpointing mode and block length
    loss         the loss's transient (full logits, one chunk of the chunked loss, liger's chunk)
    other        the rest of the peak phase (the root unit's unsharded gradients, bf16 gradient copies)
    total        against 92% of the card (ftcli.estimate.memory.USABLE)

then fits / does not; the settings that would fit when it does not; how many layers could keep their
activations when it fits with room; and s/step, wall time and GPU-hours for the recipe's data from the
step times measured in ftcli/assets/measured.json ("no measurement" where there is none).

Pure data + arithmetic: no torch, no transformers (model shapes come from the shipped or local
config.json; token counts from the pack cache, the synthetic config, or a sample of a local source).
`fit_check` is what `render-workload` and `doctor` call.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ftcli.estimate import memory
from ftcli.config.errors import UserError
from ftcli.config.recipe import ACCELERATOR_RE, Recipe, resolve_path
from ftcli.families import FAMILIES

# Card memory (GB, as sold) and peak dense bf16 FLOP/s (the same datasheet figures as ftcli.train.metrics).
CARDS: dict[str, dict[str, float]] = {
    "H100": {"memory_gb": 80, "bf16_flops": 989e12},
    "H200": {"memory_gb": 141, "bf16_flops": 989e12},
    "B300": {"memory_gb": 288, "bf16_flops": 2250e12},
    "A10": {"memory_gb": 24, "bf16_flops": 125e12},
}
GPUS_PER_NODE = {"H100": 8, "H200": 8, "B300": 8, "A10": 1}
MEASURED_CARD = "H200"
# Token counts of hub datasets this machine cannot read offline, with where the figure comes from.
PUBLISHED_TOKENS = {
    ("HuggingFaceH4/ultrachat_200k", "train_sft"): (
        995 * 8 * 32768, "published example: 995 steps of 8 GPUs x one 32,768-token block (Qwen3.8 tokenizer)"),
}
SAMPLE_ROWS = 300
CHAT_TEMPLATE_TOKENS = 4  # per message: role header and end-of-turn markers (sampled counts only)


@dataclass(frozen=True)
class Suggestion:
    overrides: tuple[str, ...]  # --set items
    total_gib: float

    def text(self) -> str:
        return f"{' '.join('--set ' + o for o in self.overrides)} ({self.total_gib:.1f} GiB)"


@dataclass(frozen=True)
class StepTime:
    s_per_step: float | None
    source: str  # "measured: <point>", "scaled from <point>: <each scaling>", or "no measurement for ..."
    measured: bool = False  # this card, this depth, this setting
    command: str | None = None  # the command that measured the point (None: no measurement)


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

    def to_dict(self) -> dict[str, Any]:
        return {"accelerator": self.accelerator, "card": self.card, "gpus": self.gpus, "own": self.own,
                "sharding": self.sharding,
                "memory_gib": self.estimate.to_dict(), "usable_gib": round(self.usable_gib, 2), "fits": self.fits,
                "keep_layers": self.keep_layers, "fitting_settings": [list(s.overrides) for s in self.suggestions],
                "s_per_step": None if self.step.s_per_step is None else round(self.step.s_per_step, 4),
                "step_source": self.step.source, "step_measured": self.step.measured,
                "step_command": self.step.command, "why": self.why or None,
                "wall_hours": None if self.wall_hours is None else round(self.wall_hours, 3),
                "gpu_hours": None if self.gpu_hours is None else round(self.gpu_hours, 2)}


@dataclass(frozen=True)
class DataSize:
    tokens: int | None
    blocks: int | None
    source: str


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

    def to_dict(self) -> dict[str, Any]:
        s = self.setting
        return {"recipe": self.recipe, "method": self.method, "model": self.model, "params": self.params,
                "frozen_params": self.frozen_params,
                "setting": {"tokens_per_micro_batch": s.tokens, "master": s.master, "checkpointing": s.checkpointing,
                            "keep": s.keep, "loss": s.loss, "compute_bytes": s.compute_bytes,
                            "adapter_params": s.adapter_params, "sharding": s.sharding},
                "data": {"tokens": self.data.tokens, "blocks": self.data.blocks, "source": self.data.source},
                "steps": self.steps, "cards": [c.to_dict() for c in self.cards], "notes": list(self.notes)}


@dataclass(frozen=True)
class FitResult:
    """Does the recipe fit its own accelerator? (what render-workload enforces)."""

    fits: bool
    reason: str  # one line: what does not fit, and the nearest setting that does
    card: CardPlan | None  # None: the accelerator's card is not one ftcli has figures for


# -------------------------------------------------------------------------------------------- shape
def model_shape(recipe: Recipe) -> memory.ModelShape:
    """The model's shape from its config: random init reads model.config; a pretrained id reads the shipped
    shape (ftcli/assets/models), a local directory's config.json, or the Hugging Face cache."""
    m = recipe.model
    cfg: dict[str, Any] | None = None
    if m.init == "random":
        cfg = json.loads(Path(resolve_path(m.config)).read_text())
    elif m.id and memory.shipped_shape_path(m.id):
        cfg = json.loads(memory.shipped_shape_path(m.id).read_text())
    elif m.id and (Path(m.id).expanduser() / "config.json").is_file():
        cfg = json.loads((Path(m.id).expanduser() / "config.json").read_text())
    else:
        cfg = _hub_cached_config(m.id, m.revision)
    if cfg is None:
        raise UserError(f"plan needs {m.id}'s config.json: not shipped with ftcli, not a local directory and not in "
                        f"the Hugging Face cache (download it once: hf download {m.id} config.json)")
    cfg = {**cfg, **m.config_overrides}
    try:
        return memory.shape_from_config(cfg)
    except (KeyError, ValueError) as e:
        raise UserError(f"plan cannot size model {m.id or m.config}: {e}") from None


def _hub_cached_config(model_id: str | None, revision: str | None) -> dict[str, Any] | None:
    if not model_id:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    path = try_to_load_from_cache(model_id, "config.json", revision=revision)
    return json.loads(Path(path).read_text()) if isinstance(path, str) else None


def adapter_params(recipe: Recipe, shape: memory.ModelShape) -> int:
    """LoRA weights: r x (in + out) per wrapped linear of each layer, and per expert of a wrapped 3-D parameter."""
    if recipe.training.method != "lora":
        return 0
    lora, r = recipe.lora, recipe.lora.r
    wanted = None if lora.target_modules == "all-linear" else set(lora.target_modules)
    total = 0
    for kind in shape.layer_kinds:
        total += sum(r * (i + o) for k, name, i, o in shape.linear_shapes
                     if k in ("*", kind) and (wanted is None or name in wanted))
    per_layer_experts = sum(r * e * (i + o) for name, e, i, o in shape.expert_shapes if name in lora.target_parameters)
    return total + per_layer_experts * shape.layers


def lora_sharding(recipe: Recipe, shape: memory.ModelShape, card: str | None = None, world: int | None = None) -> str:
    """`training.sharding` resolved for LoRA on `card` (default: the recipe's own): "auto" is ddp where a whole
    base per GPU fits, else fsdp (also when neither fits: that is the one more GPUs or settings can fix); ddp
    on a card ftcli has no figures for."""
    chosen = recipe.training.sharding
    if chosen != "auto":
        return chosen
    if recipe.model.quantization == "mxfp4":  # a kept-MXFP4 base runs with DDP only (ftcli.model.mxfp4_lora)
        return "ddp"
    card = card or recipe.compute.accelerator_type.split("x", 1)[1]
    if card not in CARDS:
        return "ddp"
    fits, _ = _fits(shape, setting_of(recipe, shape, world, sharding="ddp"), CARDS[card]["memory_gb"])
    return "ddp" if fits else "fsdp"


def resolved_sharding(recipe: Recipe) -> tuple[str, str]:
    """(ddp | fsdp, why) for the LoRA trainer: the recipe's setting, or what `plan` says fits its accelerator."""
    if recipe.training.sharding != "auto":
        return recipe.training.sharding, "training.sharding"
    try:
        shape = model_shape(recipe)
    except UserError as e:
        return "ddp", f"training.sharding=auto, not sized ({e})"
    chosen = lora_sharding(recipe, shape)
    return chosen, (f"training.sharding=auto: a whole base per GPU {'fits' if chosen == 'ddp' else 'does not fit'} "
                    f"{recipe.compute.accelerator_type}")


def setting_of(recipe: Recipe, shape: memory.ModelShape, world: int | None = None, *, card: str | None = None,
               sharding: str | None = None) -> memory.Setting:
    t = recipe.training
    lora = t.method == "lora"
    if lora and sharding is None:
        sharding = lora_sharding(recipe, shape, card, world)
    dtype = recipe.model.dtype if lora else t.precision.param_dtype
    block = recipe.data.packing.block_len if recipe.data.packing.enabled else (recipe.data.max_length or 2048)
    return memory.Setting(
        method=t.method, tokens=block * t.per_device_batch, world=world or recipe.compute.num_accelerators,
        master="fp32" if t.precision.master_dtype == "float32" else "bf16",
        compute_bytes=4 if dtype == "float32" else 2, checkpointing=t.activation_checkpointing,
        keep=0 if lora else t.activation_checkpointing_keep,  # LoRA ignores it (lora_recipe.ignored_settings)
        loss="trl" if lora else t.loss.impl, chunk_tokens=t.loss.chunk_tokens,
        adapter_params=adapter_params(recipe, shape), sharding=sharding if lora else "fsdp",
        expert_quant="mxfp4" if lora and recipe.model.quantization == "mxfp4" else "none",
        speed=() if lora else speed_settings(t))


def speed_settings(t) -> tuple[str, ...]:
    """A full-SFT recipe's settings that change its step time but not its memory model, in the form of the
    step-time rows' `speed` field: fp8, compile=layers|regions, fused=<ops joined by +, sorted>."""
    out = ["fp8"] if t.precision.fp8 else []
    if t.compile:
        out.append(f"compile={'regions' if t.compile == 'regions' else 'layers'}")
    if t.fused_ops:
        out.append("fused=" + "+".join(sorted(t.fused_ops)))
    return tuple(out)


# ------------------------------------------------------------------------------------------ fitting
def _fits(shape, s: memory.Setting, card_gb: float) -> tuple[bool, memory.Estimate]:
    e = memory.estimate(shape, s)
    return e.total <= memory.usable_gib(card_gb), e


# Full SFT, one H200, 27B width, 2026-12-01 (BENCHMARKS.md, "Levers measured alone"): at 8k-token blocks the
# chunked loss's fixed cost per step is 0.160 s against liger's 0.286 (per layer the same); at 32k liger was 8%
# faster. So a suggested block of 8k or less comes with the chunked loss (16k not measured: left as it is).
CHUNKED_LOSS_UP_TO = 8192


def fitting_settings(shape: memory.ModelShape, s: memory.Setting, card: str, per_node: int,
                     length_key: str = "data.packing.block_len", batch: int = 1, lora_r: int = 1) -> list[Suggestion]:
    """Single changes that make `s` fit `card`, nearest first: checkpointing, fewer kept layers (the others then
    drop them all: they are speed, not need), the largest block (`length_key`,
    tokens per micro-batch / `batch`), bf16 master weights, a sharded LoRA base, more GPUs (not for DDP LoRA: it
    keeps a whole base per GPU); when none does, all of them together."""
    gb = CARDS[card]["memory_gb"]
    out: list[Suggestion] = []

    def attempt(overrides: tuple[str, ...], **changes) -> bool:
        ok, e = _fits(shape, replace(s, **changes), gb)
        if ok:
            out.append(Suggestion(overrides, e.total))
        return ok

    order = ["none", "selective", "full"] if s.method == "full" else ["none", "full"]  # LoRA: every layer or none
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
        # full SFT at short blocks: the chunked loss is faster than liger's (CHUNKED_LOSS_UP_TO)
        chunked = s.method == "full" and s.loss == "liger" and block <= CHUNKED_LOSS_UP_TO
        loss = (("training.loss.impl=chunked",), {"loss": "chunked"}) if chunked else ((), {})
        if attempt((*drop_keep, f"{length_key}={block // batch}", *loss[0]), tokens=block, **loss[1]):
            break
        block //= 2
    if s.method == "full" and s.master == "fp32":
        attempt((*drop_keep, "training.precision.master_dtype=bfloat16"), master="bf16")
    if s.method == "lora" and shape.expert_shapes and FAMILIES[shape.family].mxfp4_experts:
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
    if s.method == "lora" and s.sharding == "ddp" and s.expert_quant == "none":
        attempt(("training.sharding=fsdp",), sharding="fsdp")
    if s.method == "full" or s.sharding == "fsdp":
        for nodes in range(max(1, s.world // per_node) + 1, 65):
            if attempt((*drop_keep, f"compute.num_accelerators={nodes * per_node}"), world=nodes * per_node):
                break
    if not out:
        changes: dict[str, Any] = {"checkpointing": "full", "keep": 0}
        overrides = [*drop_keep, "training.activation_checkpointing=full"]
        if s.method == "full":
            changes["master"] = "bf16"
            overrides.append("training.precision.master_dtype=bfloat16")
        block = 1 << (per_batch.bit_length() - 1)
        while block >= 512 * batch and not attempt((*overrides, f"{length_key}={block // batch}"), tokens=block,
                                                   **changes):
            block //= 2
    return out


def no_fit_reason(shape: memory.ModelShape, s: memory.Setting, card: str) -> str:
    usable = memory.usable_gib(CARDS[card]["memory_gb"])
    if s.method == "lora" and s.sharding == "ddp":
        base = memory.estimate(shape, s).params
        if base > usable:
            return (f"the base alone is {base:.1f} GiB > {usable:.1f} usable: LoRA with training.sharding=ddp keeps a "
                    "whole base per GPU, so more GPUs do not help")
    return (f"no setting tried fits {usable:.1f} GiB (full checkpointing, bf16 master, blocks down to 512, up to 64 "
            "nodes)")


# ------------------------------------------------------------------------------------------- timing
def step_time(recipe: Recipe, shape: memory.ModelShape, s: memory.Setting, card: str,
              world: int | None = None) -> StepTime:
    """Seconds per optimizer step on one `card` from the measured step times: the same family, width, method,
    block and checkpointing, the rows of the newest sitting (`_series`: kernels are never mixed); the recipe's
    depth and kept layers by their per-layer fit (`layer_fit`) where those rows allow one, else one point scaled
    by the matmul work of the layers and the LM head; another card scaled by its peak bf16 FLOP/s. Per-GPU time
    is taken as independent of the GPU count (not measured).

    The source names the measured point (card, GPUs, block length, date; time and kernels where recorded; its
    commands in `command`) and every scaling applied to it: "measured: ...", "scaled from ...: ...", or "no
    measurement for ..."."""
    world = world or s.world
    rows = [r for r in memory.measured()["step_time"]
            if memory.shipped_shape(r["model"]).family == shape.family
            and memory.shipped_shape(r["model"]).hidden == shape.hidden and r["method"] == s.method
            and r["block_len"] == s.tokens and r["checkpointing"] == s.checkpointing]
    if not rows:
        return StepTime(None, f"no measurement for {shape.family} at hidden {shape.hidden}, {s.method}, "
                              f"{s.tokens} tokens, checkpointing {s.checkpointing}")
    same = [r for r in rows if r["loss"] == s.loss and (s.method == "lora" or r["master"] == s.master)
            and (s.method != "lora" or r.get("sharding", "ddp") == s.sharding)]  # LoRA rows before fsdp: ddp
    exact = [r for r in same if tuple(r.get("speed", ())) == s.speed]
    # no row of the recipe's speed settings: the same loss and master without any (never another speed
    # setting's rows: fp8 with eager casts is slower than bf16, fp8 with compiled regions far faster)
    plain = [r for r in same if not r.get("speed")]
    candidates = exact or plain or [r for r in rows if not r.get("speed")] or rows
    row = max(candidates, key=_when)  # the newest sitting; of equals, the first listed
    series = [r for r in candidates if _series(r) == _series(row) and r["model"] == row["model"]
              and _setting_text(s.method, r) == _setting_text(s.method, row)]
    keep = min(s.keep, shape.layers) if s.method == "full" else 0  # the recipe's kept layers
    # the rows at two or more depths give the per-layer fit (what a deeper step adds is its layers; the fixed
    # part is embeddings, LM head, loss, optimizer), and with rows that differ only in keep, a kept layer's cost;
    # else one point scaled by matmul work
    fit = layer_fit([(r["layers"], r.get("keep", 0), r["s_per_step"]) for r in series])
    at_depth = [r for r in series if r["layers"] == shape.layers]
    notes = []
    if fit and not any(r.get("keep", 0) == keep for r in at_depth) and (fit.kept_layer is not None or not at_depth):
        seconds = fit.seconds(shape.layers, keep) * recipe.training.grad_accum
        used = [r for r in series if r.get("keep", 0) == fit.depth_keep or r["layers"] == fit.keep_depth]
        depth_note = fit.text(shape.layers, keep)
        layers_text = f"{' and '.join(map(str, sorted({r['layers'] for r in used})))} layers"
        measured_keep = fit.depth_keep if fit.kept_layer is None else keep
    else:
        row = max(series, key=lambda r: (r["layers"] == shape.layers, r.get("keep", 0) == keep))
        used = [row]
        measured_shape = memory.shipped_shape(row["model"]).cut(row["layers"])
        head = shape.vocab * shape.hidden
        layer = sum(shape.layer_params) / shape.layers
        depth = (shape.layers * layer + head) / (measured_shape.layers * layer + head)
        seconds = row["s_per_step"] * depth * recipe.training.grad_accum
        depth_note = f"{row['layers']} -> {shape.layers} layers by matmul work" if row["layers"] != shape.layers else None
        layers_text = f"{row['layers']} layers"
        measured_keep = row.get("keep", 0)
    if card != row["card"]:
        seconds *= CARDS[row["card"]]["bf16_flops"] / CARDS[card]["bf16_flops"]
        notes.append(f"x peak bf16 FLOP/s {row['card']}/{card}")
    if not exact:
        notes.append(f"measured with {_setting_text(s.method, row)} (recipe: {_setting_text(s.method, vars(s))})")
    if depth_note:
        notes.append(depth_note)
    if s.method == "full" and measured_keep != keep:
        notes.append(f"measured with keep {measured_keep} (recipe: keep {s.keep}, not counted)")
    if recipe.training.grad_accum > 1:
        notes.append(f"x {recipe.training.grad_accum} micro-batches")
    measured = not notes
    gpus = f"{row['gpus']} GPU{'s' if row['gpus'] > 1 else ''}"
    point = f"{row['card']}, {gpus}, {row['model']} at {layers_text}, block {row['block_len']}, {row['date']}"
    if row.get("utc"):
        point += f" {row['utc']} UTC"
    if row.get("kernels"):
        point += f", kernels {row['kernels']}"
    if {r.get("kernels") for r in candidates} != {row.get("kernels")}:
        point += ", the newest of this setting's rows (rows with other kernels not mixed in)"
    if row["gpus"] != world:
        notes.append(f"per-GPU time of {gpus} taken for {world}"
                     + (" (the sharded base's all-gathers not counted)" if s.method == "lora" and s.sharding == "fsdp"
                        else ""))
    command = " && ".join(dict.fromkeys(r["command"] for r in used))
    if measured:
        return StepTime(seconds, "; ".join([f"measured: {point}", *notes]), True, command)
    return StepTime(seconds, f"scaled from {point}: {'; '.join(notes)}", False, command)


def _when(row: dict[str, Any]) -> tuple[str, str]:
    """When a row was measured: date, then time of day (a row without one: earlier that day)."""
    return row["date"], row.get("utc", "")


def _series(row: dict[str, Any]) -> tuple[str, ...]:
    """The rows measured together: one sitting (date, time) with the same kernels, or (no time) one command's."""
    if row.get("utc"):
        return row["date"], row["utc"], row.get("kernels") or ""
    return (row["command"],)


@dataclass(frozen=True)
class LayerFit:
    """s/step = fixed + recomputed x (layers - kept) + kept_layer x kept: `recomputed` is the slope of rows at one
    keep count (`depth_keep`) over two or more depths (`depths`); `kept_layer` comes from rows at one depth
    (`keep_depth`) that differ only in keep (`keeps`). Without those (kept_layer None) kept layers are not
    counted: s/step = fixed + recomputed x layers, as measured at `depth_keep`."""

    fixed: float
    recomputed: float  # s per layer that recomputes its forward in backward
    kept_layer: float | None  # s per layer that keeps its activations
    depths: tuple[int, ...]
    depth_keep: int
    keeps: tuple[int, ...] = ()
    keep_depth: int | None = None

    def seconds(self, layers: int, kept: int) -> float:
        if self.kept_layer is None:
            return self.fixed + self.recomputed * layers
        return self.fixed + self.recomputed * (layers - kept) + self.kept_layer * kept

    def text(self, layers: int, kept: int) -> str:
        depths = f"{' and '.join(map(str, self.depths))} -> {layers} layers by the per-layer fit"
        if self.kept_layer is None:
            return f"{depths} ({self.fixed:.3f} s + {self.recomputed:.4f} s x layers)"
        return (f"{depths}, {kept} of them kept ({self.fixed:.3f} s + {self.recomputed:.4f} s x {layers - kept} "
                f"recomputed + {self.kept_layer:.4f} s x {kept} kept layers; kept layers counted: a kept "
                f"layer's cost from the {self.keep_depth}-layer rows at keep {' and '.join(map(str, self.keeps))}, a "
                f"recomputed one's from the keep {self.depth_keep} rows)")


def layer_fit(points: list[tuple[int, int, float]]) -> LayerFit | None:
    """The per-layer fit of one sitting's (layers, kept layers, s/step) rows; None without two depths at one keep
    count. Rows at one depth that differ only in keep give a kept layer's cost: the recomputed slope plus the
    slope of s/step over keep there (negative: a kept layer skips its recompute)."""
    by_keep: dict[int, list[tuple[int, float]]] = {}
    by_depth: dict[int, list[tuple[int, float]]] = {}
    for layers, kept, seconds in points:
        by_keep.setdefault(kept, []).append((layers, seconds))
        by_depth.setdefault(layers, []).append((kept, seconds))
    depth_keep = next((k for k, pts in by_keep.items() if len({n for n, _ in pts}) >= 2), None)
    if depth_keep is None:
        return None
    recomputed, intercept = depth_fit(by_keep[depth_keep])
    depths = tuple(sorted({n for n, _ in by_keep[depth_keep]}))
    keep_depth = next((n for n, pts in by_depth.items() if len({k for k, _ in pts}) >= 2), None)
    if keep_depth is None:
        return LayerFit(intercept, recomputed, None, depths, depth_keep)
    per_kept, _ = depth_fit(by_depth[keep_depth])  # the same least squares, over keep at one depth
    kept_layer = recomputed + per_kept
    return LayerFit(intercept + (recomputed - kept_layer) * depth_keep, recomputed, kept_layer, depths, depth_keep,
                    tuple(sorted({k for k, _ in by_depth[keep_depth]})), keep_depth)


def depth_fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares s/step = intercept + slope x layers over (layers, s/step) of two or more depths."""
    mx = sum(n for n, _ in points) / len(points)
    my = sum(t for _, t in points) / len(points)
    slope = sum((n - mx) * (t - my) for n, t in points) / sum((n - mx) ** 2 for n, _ in points)
    return slope, my - slope * mx


def _setting_text(method: str, setting: dict[str, Any]) -> str:
    """The parts of a setting a step-time row may differ in (a measured row, or a memory.Setting's fields)."""
    if method == "lora":
        return f"{setting.get('sharding', 'ddp')}, loss {setting['loss']}"
    speed = tuple(setting.get("speed", ()))
    return f"master {setting['master']}, loss {setting['loss']}" + (f", {' '.join(speed)}" if speed else "")


def data_size(recipe: Recipe) -> DataSize:
    """Tokens and blocks of one epoch: the pack cache when present, the synthetic config, a sample of a local
    source, a published figure for a hub dataset; else unknown."""
    cached = _from_pack_cache(recipe)
    if cached:
        return cached
    d = recipe.data
    block = d.packing.block_len if d.packing.enabled else None
    if d.source == "synthetic":
        tokens = int(d.synthetic.num_examples * _clipped_lognormal_mean(d.synthetic.mean_tokens, d.synthetic.max_tokens))
        return DataSize(tokens, _blocks(tokens, block, d.synthetic.num_examples),
                        "computed: expected length of the synthetic log-normal x num_examples")
    if d.source == "local":
        return _sample_local(recipe)
    published = PUBLISHED_TOKENS.get((d.path, d.split))
    if published:
        return DataSize(published[0], _blocks(published[0], block, None), published[1])
    return DataSize(None, None, f"unknown: no pack cache for {d.path} here and hub data is not read by plan "
                                f"(`ftcli pack-preview --recipe {recipe.name}` builds the cache)")


def _blocks(tokens: int, block: int | None, examples: int | None) -> int | None:
    if block:
        return math.ceil(tokens / block)
    return examples


def _clipped_lognormal_mean(mean: float, cap: float, sigma: float = 1.0) -> float:
    """E[min(X, cap)], X log-normal with mean `mean` (ftcli.data.synthetic's lengths)."""
    mu = math.log(mean) - sigma**2 / 2
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    z = (math.log(cap) - mu) / sigma
    return math.exp(mu + sigma**2 / 2) * phi(z - sigma) + cap * (1 - phi(z))


def _from_pack_cache(recipe: Recipe) -> DataSize | None:
    from ftcli.data.cache import cache_root
    from ftcli.data.pipeline import recipe_cache_parts

    root = cache_root(recipe.data) / "packed"
    if not root.is_dir():
        return None
    try:
        want = recipe_cache_parts(recipe)
    except (UserError, OSError):
        return None
    want = json.loads(json.dumps(want, default=str))
    for meta_path in sorted(root.glob("*/meta.json")):
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            continue
        parts = meta.get("key_parts", {})
        if all(parts.get(k) == v for k, v in want.items()):
            return DataSize(int(meta["num_tokens"]), int(meta["num_blocks"]), f"pack cache {meta_path.parent}")
    return None


def _sample_local(recipe: Recipe) -> DataSize:
    """Tokens of the first SAMPLE_ROWS rows (rendered with the chat template and tokenized when the tokenizer is
    a local directory; else characters / 4 + CHAT_TEMPLATE_TOKENS per message), scaled to all rows."""
    from ftcli.data import sources

    d = recipe.data
    try:
        rows, total = sources.open_rows(d)
    except (UserError, OSError) as e:
        return DataSize(None, None, f"unknown: {e}")
    count, how = _local_counter(recipe)
    sampled = tokens = 0
    for _, row in rows:
        if sampled >= SAMPLE_ROWS:
            break
        sampled += 1
        if not isinstance(row, dict):
            continue
        if d.format == "messages":
            messages = row.get(d.messages_field) or []
        else:
            messages = [{"role": "user", "content": row.get("prompt", "")},
                        {"role": "assistant", "content": row.get("completion", "")}]
        try:
            n = count([m for m in messages if isinstance(m, dict)])
        except Exception:  # noqa: BLE001 - a row the template refuses is skipped (train counts it as invalid)
            continue
        tokens += min(n, d.max_length) if d.max_length else n
    if not sampled:
        return DataSize(0, 0, "the source has no rows")
    rows_total = total if total is not None and total >= sampled else sampled
    if d.max_examples:
        rows_total = min(rows_total, d.max_examples)
    est = round(tokens * rows_total / sampled)
    block = d.packing.block_len if d.packing.enabled else None
    return DataSize(est, _blocks(est, block, rows_total), f"estimate: first {sampled} of {rows_total} rows, {how}")


def _local_counter(recipe: Recipe):
    """A function messages -> token count, and how it counts."""
    folder = Path(resolve_path(recipe.model.tokenizer or recipe.model.id) or "")
    template_file = resolve_path(recipe.data.chat_template) if recipe.data.chat_template else None
    source = None
    if template_file and Path(template_file).is_file():
        source = Path(template_file).read_text()
    elif (folder / "chat_template.jinja").is_file():
        source = (folder / "chat_template.jinja").read_text()
    elif (folder / "tokenizer_config.json").is_file():
        source = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    if not (folder / "tokenizer.json").is_file() or not isinstance(source, str):
        return (lambda messages: sum(len(str(m.get("content", ""))) // 4 + CHAT_TEMPLATE_TOKENS for m in messages),
                f"characters / 4 + {CHAT_TEMPLATE_TOKENS} per message (no local tokenizer and template)")
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from tokenizers import Tokenizer

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    template = env.from_string(source)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return (lambda messages: len(tokenizer.encode(template.render(messages=messages, add_generation_prompt=False),
                                                  add_special_tokens=False).ids),
            "chat template rendered and tokenized")


# --------------------------------------------------------------------------------------------- plan
def parse_accelerator(accelerator: str) -> tuple[int, str]:
    m = ACCELERATOR_RE.fullmatch(accelerator)
    if not m:
        raise UserError(f"--accelerator {accelerator!r} is not GPU_<gpus per node>x<card> (e.g. GPU_8xH100)")
    card = accelerator.split("x", 1)[1]
    if card not in CARDS:
        raise UserError(f"--accelerator {accelerator}: unknown card {card!r}; known: {', '.join(CARDS)}")
    return int(m.group(1)), card


def default_accelerators(recipe: Recipe) -> list[str]:
    own = recipe.compute.accelerator_type
    world = recipe.compute.num_accelerators
    own_card = own.split("x", 1)[1]
    return [own] + [f"GPU_{min(per_node, world)}x{card}" for card, per_node in GPUS_PER_NODE.items() if card != own_card]


def card_plan(recipe: Recipe, shape: memory.ModelShape, accelerator: str, data: DataSize,
              steps: int | None) -> CardPlan:
    per_node, card = parse_accelerator(accelerator)
    world = max(per_node, math.ceil(recipe.compute.num_accelerators / per_node) * per_node)
    s = setting_of(recipe, shape, world, card=card)
    gb = CARDS[card]["memory_gb"]
    fits, e = _fits(shape, s, gb)
    keep = None
    if fits and s.checkpointing == "full" and s.method == "full":
        keep = memory.layers_to_keep(shape, s, gb)
    length_key = "data.packing.block_len" if recipe.data.packing.enabled else "data.max_length"
    suggestions = () if fits else tuple(fitting_settings(shape, s, card, per_node, length_key,
                                                         recipe.training.per_device_batch, recipe.lora.r))
    why = "" if fits or suggestions else no_fit_reason(shape, s, card)
    st = step_time(recipe, shape, s, card, world)
    run_steps = steps if world == recipe.compute.num_accelerators else _steps(recipe, data, world)
    wall = st.s_per_step * run_steps / 3600 if st.s_per_step is not None and run_steps is not None else None
    return CardPlan(accelerator=accelerator, card=card, gpus=world, own=accelerator == recipe.compute.accelerator_type,
                    estimate=e, usable_gib=memory.usable_gib(gb), fits=fits, keep_layers=keep,
                    suggestions=suggestions, why=why, step=st, wall_hours=wall,
                    gpu_hours=None if wall is None else wall * world, sharding=s.sharding)


def _steps(recipe: Recipe, data: DataSize, world: int) -> int | None:
    t = recipe.training
    if data.blocks is None:
        return t.max_steps
    steps = math.ceil(data.blocks * t.epochs / (world * t.per_device_batch * t.grad_accum))
    return min(steps, t.max_steps) if t.max_steps else steps


def make_plan(recipe: Recipe, accelerators: list[str] | None = None) -> Plan:
    shape = model_shape(recipe)
    data = data_size(recipe)
    steps = _steps(recipe, data, recipe.compute.num_accelerators)
    own = recipe.compute.accelerator_type
    names = default_accelerators(recipe)
    if accelerators:
        for a in accelerators:
            parse_accelerator(a)  # a typo is a one-line error
        names = [own] + [a for a in accelerators if a != own]
    notes = []
    if own.split("x", 1)[1] not in CARDS:
        names.remove(own)
        notes.append(f"no memory figures for the recipe's {own}: cards known: {', '.join(CARDS)}")
    cards = tuple(card_plan(recipe, shape, a, data, steps) for a in names)
    return Plan(recipe=recipe.name, method=recipe.training.method, model=recipe.model.id or str(recipe.model.config),
                params=shape.total_params, frozen_params=shape.frozen_params, setting=setting_of(recipe, shape),
                data=data, steps=steps, cards=cards, notes=tuple(notes))


def fit_check(recipe: Recipe) -> FitResult:
    """Whether the recipe fits its own accelerator; the reason and the nearest fitting setting when not."""
    try:
        parse_accelerator(recipe.compute.accelerator_type)
    except UserError:
        return FitResult(True, f"memory fit not checked: no figures for {recipe.compute.accelerator_type} "
                               f"(cards known: {', '.join(CARDS)})", None)
    try:
        shape = model_shape(recipe)
    except UserError as e:
        return FitResult(True, f"memory fit not checked: {e}", None)
    c = card_plan(recipe, shape, recipe.compute.accelerator_type, DataSize(None, None, "not needed"), None)
    if c.fits:
        return FitResult(True, f"fits {c.accelerator}: {c.estimate.total:.1f} of {c.usable_gib:.1f} GiB usable per GPU", c)
    nearest = c.suggestions[0].text() if c.suggestions else c.why
    return FitResult(False, f"{recipe.name} does not fit {c.accelerator}: {c.estimate.total:.1f} GiB per GPU > "
                            f"{c.usable_gib:.1f} usable of {CARDS[c.card]['memory_gb']:.0f} GB; nearest that fits: "
                            f"{nearest}", c)


def memory_on(recipe: Recipe, world: int) -> memory.Estimate:
    """Peak memory per process of the recipe on `world` GPUs (or CPU processes) of one machine."""
    shape = model_shape(recipe)
    return memory.estimate(shape, setting_of(recipe, shape, world))


# ------------------------------------------------------------------------------------------- render
def _hours(h: float | None) -> str:
    if h is None:
        return "-"
    return f"{h * 60:.0f} min" if h < 1 else f"{h:.1f} h"


def print_plan(plan: Plan) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console()
    s = plan.setting
    frozen = f" + {plan.frozen_params / 1e9:.2f}B frozen" if plan.frozen_params else ""
    master = (f", master {s.master}" if plan.method == "full" else
              f", adapter {s.adapter_params / 1e6:.2f}M params, base {'sharded (fsdp)' if s.sharding == 'fsdp' else 'whole per GPU (ddp)'}")
    console.print(f"[bold]{plan.recipe}[/]: {plan.method} of {plan.model} ({plan.params / 1e9:.3g}B params{frozen}); "
                  f"{s.tokens:,} tokens per micro-batch, checkpointing {s.checkpointing}"
                  f"{f' (keep {s.keep})' if s.keep else ''}{master}, loss {s.loss}", highlight=False, soft_wrap=True)
    tokens = f"{plan.data.tokens:,} tokens, {plan.data.blocks:,} blocks" if plan.data.tokens is not None else "?"
    console.print(f"data: {tokens} ({plan.data.source}); optimizer steps on the recipe's GPUs: "
                  f"{plan.steps if plan.steps is not None else '?'}", highlight=False, soft_wrap=True)
    own = plan.cards[0].accelerator if plan.cards and plan.cards[0].own else "none of the known cards"
    console.print(f"the recipe's accelerator: {own} (first row)", highlight=False)

    # 80 columns hold both tables with every header whole: no cell padding (the box's one-space column rule
    # separates), GPUs per node and nodes as columns, and the step times' provenance as numbered notes below
    tables = {"box": box.SIMPLE_HEAD, "padding": (0, 0), "show_edge": False, "title_justify": "left"}
    memory_table = Table(title="Memory per GPU, GiB (fits: total <= limit, 92% of the card; keep: layers that could "
                               "keep their activations)", **tables)
    for col in ("accelerator", "GPUs", "nodes", "params", "grads", "optim", "activ", "loss", "other", "total", "limit",
                "fits", "keep"):
        memory_table.add_column(col, justify="left" if col in ("accelerator", "fits") else "right", no_wrap=True)
    time_table = Table(title="Time (* estimate)", **tables)
    for col in ("accelerator", "s/step", "wall", "GPU-h", "from"):
        time_table.add_column(col, justify="left" if col in ("accelerator", "from") else "right", no_wrap=True)
    notes: list[str] = []  # [n] under the time table: where each step time came from, the commands that measured it

    def note(text: str) -> str:
        if text not in notes:
            notes.append(text)
        return f"[{notes.index(text) + 1}]"

    for c in plan.cards:
        e = c.estimate
        style = "bold" if c.own else None
        per_node = int(c.accelerator.removeprefix("GPU_").split("x", 1)[0])
        memory_table.add_row(c.accelerator, str(per_node), str(max(1, c.gpus // per_node)), *(_gib(v) for v in (
            e.params, e.grads, e.optimizer, e.activations, e.loss, e.other, e.total, c.usable_gib)),
            "[green]yes[/]" if c.fits else "[red]no[/]", "-" if c.keep_layers is None else str(c.keep_layers),
            style=style)
        step = "-" if c.step.s_per_step is None else f"{c.step.s_per_step:.2f}" + ("" if c.step.measured else "*")
        source = note(c.step.source) + (f" {note(f'measured by: {c.step.command}')}" if c.step.command else "")
        time_table.add_row(c.accelerator, step, _hours(c.wall_hours),
                           "-" if c.gpu_hours is None else f"{c.gpu_hours:.1f}", source, style=style)
    console.print(memory_table)
    for note in plan.notes:
        console.print(note, highlight=False, soft_wrap=True)
    if plan.method == "lora":
        console.print("LoRA base: " + ", ".join(f"{c.accelerator} {c.sharding}" for c in plan.cards)
                      + " (ddp: a whole base per GPU; fsdp: sharded over the GPUs)", highlight=False, soft_wrap=True)
    for c in plan.cards:
        if c.suggestions:
            console.print(f"{c.accelerator} fits with: {' | '.join(sug.text() for sug in c.suggestions)}",
                          highlight=False, soft_wrap=True)
        elif not c.fits:
            console.print(f"{c.accelerator} does not fit: {c.why}", highlight=False, soft_wrap=True)
    console.print(time_table)
    for number, text in enumerate(notes, 1):
        console.print(f"[{number}] {text}", style="dim" if text.startswith("measured by: ") else None,
                      highlight=False, markup=False)


def _gib(v: float) -> str:
    """A GiB figure in at most 5 characters (the memory table's columns are as wide as their headers)."""
    return f"{v:.1f}" if v < 999.95 else f"{v:.0f}"


def run_plan(recipe: Recipe, accelerators: list[str] | None = None, as_json: bool = False) -> None:
    plan = make_plan(recipe, accelerators)
    if as_json:
        print(json.dumps(plan.to_dict(), indent=1))
    else:
        print_plan(plan)

