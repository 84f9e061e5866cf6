"""Per-GPU peak memory of a training step: exact state from the model's shape, a fitted transient.

    peak = state + transient

    state       full SFT (FSDP2, sharded over W GPUs): P x (weights + grads + 2 AdamW moments) / W, at
                4+4+8 bytes per parameter with fp32 master weights and 2+2+4 with bf16 ones, plus the frozen
                vision tower's weights (sharded). LoRA (DDP): the whole base in the model dtype on every
                GPU, plus the adapter's fp32 weights, grads and moments. LoRA (FSDP2, `sharding: fsdp`): the
                base and the adapter's state sharded over W GPUs. Exact from the config.
    transient   what lives only during a step, the larger of two phases (neither depends on W: FSDP
                gathers whole units on every rank):

        activations  (the forward/backward phase)
                     checkpointed layer: its input, T x hidden in the compute dtype
                     stored layer:       K x T x hidden bytes (bf16; twice that in fp32), K fitted per family
                     full: every layer checkpointed but the last `keep`, plus the larger of the kept
                     layers and one layer being recomputed (the kept layers' backward runs first and frees
                     them before the first recompute);
                     selective: every other layer stored; none: every layer stored
                   + loss: full logits F x T x vocab (F fitted); the chunked loss keeps one fp32 chunk
                     (chunk_tokens x vocab x 4), a fused one its own (ftcli.features.loss)
                   + with bf16 master weights, the root's bf16 gradients next to their fp32 copy: 2 x P_root
        reduce       (the end of backward) the root unit's (embeddings, LM head) unsharded fp32 gradients
                     before their reduce-scatter: 4 x P_root (+ the bf16 copy with bf16 master weights)
        sharded LoRA the frozen base's gathered units next to the activations: the root unit (FSDP2 keeps
                     it unsharded from forward to backward) and two decoder layers (the one computing and
                     the one prefetched), in the model dtype; no base gradients exist, so no reduce phase

    context parallelism (`training.context_parallel: C`): each rank holds a slice of T / C tokens, so the
    activations and the loss are those of T / C tokens, plus the buffers the slices share (`cp_buffer_bytes`):
    the full-attention keys and values gathered over the group (2 x T x kv_dim), their per-segment copies at the
    query heads' width (2 x T x q_dim: torch's varlen_attn has no GQA), for every full-attention layer whose
    activations are stored and one more set for the gradient in backward; the gated-delta state exchange
    (C x heads x dk x (dk + dv) fp32 per layer, tens of MB) and the conv halo are left out. Modelled, not measured
    (benchmarks/cp_gpu.py measures a slice on one GPU).

    T = tokens per micro-batch (block_len x per_device_batch). K and F are fitted by least squares
    (`fit`) on the measured peaks in ftcli/assets/measured.json (one H200; BENCHMARKS.md); the fitted
    values are the constants below, and tests/unit/estimate/test_memory_model.py checks both the fit and every measured
    point (within 10%). The 64-layer figures are extrapolations: no 64-layer run was measured.

Pure Python, no torch: `ftcli plan` and `render-workload` stay fast. Parameter counts come from the
config by formula (tests compare them with transformers' models on the meta device).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

from ftcli.families import FAMILIES, find_family, model_types
from ftcli.families.base import layer_types
from ftcli.features.loss import FUSED_LINEAR_CE
from ftcli.objectives import Method, method_of, objective_of

GiB = 1024**3
USABLE = 0.92  # CUDA context, NCCL buffers, allocator fragmentation: plan on ~92% of the card

# Fitted on ftcli/assets/measured.json by `fit()` (bytes per token per hidden unit of one stored layer, in
# bf16; bytes per token per vocab entry of the full-logit loss). tests/unit/estimate/test_memory_model.py refits them.
# K lives in each family's record (ftcli.families); families without measurements borrow one (the record says which).
STORED_LAYER_BYTES = {name: f.stored_layer_bytes for name, f in FAMILIES.items() if f.stored_layer_bytes_source == "fit"}
FULL_LOGITS_BYTES = 9.744


# ------------------------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs from a config: sizes and exact parameter counts."""

    family: str  # its ftcli.families name
    hidden: int
    vocab: int
    layers: int
    root_params: int  # embeddings + LM head + final norm (FSDP's root unit)
    layer_params: tuple[int, ...]  # per decoder layer
    frozen_params: int = 0  # e.g. the VLM's vision tower (frozen in ftcli)
    layer_kinds: tuple[str, ...] = ()  # per decoder layer: its config layer type
    linear_shapes: tuple[tuple[str, str, int, int], ...] = ()  # (layer kind or "*", name, in, out) nn.Linear (LoRA)
    expert_shapes: tuple[tuple[str, int, int, int], ...] = ()  # (name, experts, in, out) of 3-D params

    @property
    def total_params(self) -> int:
        return self.root_params + sum(self.layer_params)

    def cut(self, layers: int) -> ModelShape:
        """The same width with `layers` decoder layers (the pattern repeated), as the benchmarks build it."""
        period = self.layer_params
        kinds = self.layer_kinds
        return replace(self, layers=layers, layer_params=tuple(period[i % len(period)] for i in range(layers)),
                       layer_kinds=tuple(kinds[i % len(kinds)] for i in range(layers)) if kinds else ())


def shape_from_config(cfg: dict[str, Any]) -> ModelShape:
    """A ModelShape from a transformers config dict (a family's text model, or its VLM: ftcli.families)."""
    model_type = cfg.get("model_type")
    frozen = 0
    found = find_family(model_type)
    if found is not None and model_type in found.vlm_text_types:  # the VLM: the text config inside, the vision tower frozen
        frozen = int(cfg.get("vision_params", 0))
        model_type = found.vlm_text_types[model_type]
        cfg = {**cfg["text_config"], "model_type": model_type}
    family = find_family(model_type)
    if family is None:
        raise ValueError(f"no memory model for model_type {model_type!r} (known: {', '.join(model_types())})")
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    root = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2) + h
    kinds = layer_types(cfg, "full_attention")
    linears, experts, layers = family.layer_shapes(cfg)
    return ModelShape(family=family.name, hidden=h, vocab=vocab, layers=cfg["num_hidden_layers"], root_params=root,
                      layer_params=tuple(layers), frozen_params=frozen, layer_kinds=tuple(kinds),
                      linear_shapes=tuple(linears), expert_shapes=tuple(experts))


def shipped_shape_path(model_id: str) -> Path | None:
    """ftcli/assets/models/<org>--<name>.json for the models the shipped recipes train."""
    path = Path(str(resources.files("ftcli") / "assets" / "models" / f"{model_id.replace('/', '--')}.json"))
    return path if path.is_file() else None


def shipped_shape(model_id: str) -> ModelShape:
    path = shipped_shape_path(model_id)
    assert path is not None, f"no shipped shape for {model_id}"
    return shape_from_config(json.loads(path.read_text()))


# ----------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Setting:
    """The recipe knobs that move memory (what `ftcli plan` varies to find a setting that fits)."""

    method: str = "full"  # full | lora
    objective: str = "sft"  # training.objective (ftcli.objectives): its memory terms (a frozen reference model)
    reference: str = "model"  # training.preference.reference: model (a frozen copy, full) | precomputed (none held)
    tokens: int = 32768  # per micro-batch: block_len x per_device_batch
    world: int = 8
    master: str = "fp32"  # fp32 | bf16 (full SFT)
    compute_bytes: int = 2  # param dtype (full) or model dtype (LoRA): 2 bf16, 4 fp32
    checkpointing: str = "full"  # full | selective | none
    keep: int = 0  # with full checkpointing: layers that keep their activations
    loss: str = "chunked"  # chunked | chunked_fwd_grad | liger | full (| trl for LoRA)
    chunk_tokens: int = 4096
    adapter_params: int = 0  # LoRA
    sharding: str = "ddp"  # LoRA: ddp (a whole base per GPU) | fsdp (the base sharded, FSDP2)
    expert_quant: str = "none"  # LoRA: none | mxfp4 (model.quantization=mxfp4: expert weights kept at 4.25 bits)
    # LoRA on the expert weights through PEFT's ParamWrapper (lora.experts=peft): every forward folds
    # W + s·A·B into a new expert-weight-sized tensor that autograd keeps for backward, one per stored layer
    merged_experts: bool = False
    cp: int = 1  # full SFT: context-parallel ranks sharing each block (training.context_parallel)
    # speed settings (fit.speed_settings: fp8, compile, fused ops; LoRA's compile): they pick the step-time rows; the
    # memory terms leave them out (every point measured with them peaked lower, so the estimate stays above)
    speed: tuple[str, ...] = ()

    @property
    def method_record(self) -> Method:
        """What the memory terms ask of the method (ftcli.objectives.METHODS): a trained base or an adapter, ..."""
        return method_of(self.method)


@dataclass(frozen=True)
class Estimate:
    """GiB per GPU. `other` is what the transient holds beyond activations and loss at its peak phase."""

    params: float
    grads: float
    optimizer: float
    activations: float
    loss: float
    other: float

    @property
    def state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.state + self.activations + self.loss + self.other

    def to_dict(self) -> dict[str, float]:
        return {**{k: round(v, 2) for k, v in asdict(self).items()}, "state": round(self.state, 2),
                "total": round(self.total, 2)}


def _stored_layers(shape: ModelShape, s: Setting) -> tuple[int, int]:
    """(layers whose activations are stored, layers held as a checkpointed input)."""
    n = shape.layers
    if s.checkpointing == "none":
        return n, 0
    if s.checkpointing == "selective":
        stored = n // 2
        return stored + 1, n - stored  # + the layer being recomputed
    keep = min(s.keep, n) if s.method_record.keeps_layers else 0  # LoRA: TRL checkpoints every layer or none
    if keep == n:
        return n, 0
    # the kept layers are the last ones: their backward runs first and frees their activations before the
    # first recompute, so the peak holds the kept layers or one recomputed layer, not both
    return max(keep, 1), n - keep


def loss_bytes(shape: ModelShape, s: Setting) -> float:
    if s.loss == "full":
        return FULL_LOGITS_BYTES * s.tokens * shape.vocab
    if s.loss in ("chunked", "chunked_fwd_grad"):  # one chunk's fp32 logits (the LM head's gradient: in `grads`)
        return 4.0 * min(s.chunk_tokens, s.tokens) * shape.vocab
    if s.loss in FUSED_LINEAR_CE:  # a fused linear cross-entropy picks its own chunk (ftcli.features.loss)
        return FUSED_LINEAR_CE[s.loss].transient_bytes(s.tokens, shape.vocab, shape.hidden)
    return 0.0  # TRL's LoRA loss: inside the fitted activations (its measurements are linear in T)


def attention_dims(shape: ModelShape) -> tuple[int, int]:
    """(query width, key width) of a full-attention layer: o_proj's input and k_proj's output; (0, 0) without."""
    q = max((i for _, name, i, _ in shape.linear_shapes if name == "o_proj"), default=0)
    kv = max((o for _, name, _, o in shape.linear_shapes if name == "k_proj"), default=0)
    return q, kv


def cp_buffer_bytes(shape: ModelShape, s: Setting) -> float:
    """What context parallelism adds per rank beyond the slice's own activations (the module doc)."""
    if s.cp == 1:
        return 0.0
    q_dim, kv_dim = attention_dims(shape)
    full_layers = sum(1 for kind in shape.layer_kinds if kind == "full_attention") or shape.layers
    stored, _ = _stored_layers(shape, s)
    live = max(1, -(-stored * full_layers // shape.layers))  # stored full-attention layers (at least the one computing)
    return (live + 1) * 2 * s.tokens * (kv_dim + q_dim) * s.compute_bytes


def estimate(shape: ModelShape, s: Setting, stored_layer_bytes: float | None = None) -> Estimate:
    """Peak GiB per GPU of `shape` trained with setting `s`."""
    if s.cp > 1:  # a slice of T / C tokens per rank, plus the buffers the slices share (module doc)
        local = estimate(shape, replace(s, tokens=s.tokens // s.cp, cp=1), stored_layer_bytes)
        return replace(local, other=local.other + cp_buffer_bytes(shape, s) / GiB)
    k = FAMILIES[shape.family].stored_layer_bytes if stored_layer_bytes is None else stored_layer_bytes
    u = s.tokens * shape.hidden
    stored, checkpointed = _stored_layers(shape, s)
    activations = stored * k * (s.compute_bytes / 2) * u + checkpointed * s.compute_bytes * u
    loss = loss_bytes(shape, s)
    if s.merged_experts:  # (LoRA only: fit.merged_experts)
        # without checkpointing every layer keeps its folded expert weights (an H200, 20b, 4k, no AC: 103.1 GiB
        # through PEFT's wrapper vs 67.2 through the grouped expert LoRA); with it, the recomputed layer's fold
        # did not raise the measured peaks (gpt-oss-120b at 4 and 6 layers, FSDP through PEFT's wrapper, full AC:
        # within 0.4%). The same term, not measured there, for Qwen3-MoE's experts through lora.experts=peft
        folded_layers = stored if s.checkpointing == "none" else stored - 1
        activations += folded_layers * expert_weight_params(shape) / shape.layers * s.compute_bytes
    if not s.method_record.trains_base:  # a frozen base in the compute dtype, a float32 adapter with AdamW
        base = (shape.total_params + shape.frozen_params) * s.compute_bytes
        a = s.adapter_params
        if s.expert_quant == "mxfp4":  # kept MXFP4 (DDP): experts at 4.25 bits, a chunk of experts dequantized
            base -= expert_weight_params(shape) * (s.compute_bytes - MXFP4_BITS_PER_PARAM / 8)
            return Estimate(params=(base + 4 * a) / GiB, grads=4 * a / GiB, optimizer=8 * a / GiB,
                            activations=activations / GiB, loss=loss / GiB,
                            other=DEQUANT_COPIES * dequant_chunk_params(shape, s.compute_bytes) * s.compute_bytes / GiB)
        if s.sharding == "fsdp":
            w = s.world
            gathered = (shape.root_params + 2 * max(shape.layer_params)) * s.compute_bytes
            return Estimate(params=(base + 4 * a) / w / GiB, grads=4 * a / w / GiB, optimizer=8 * a / w / GiB,
                            activations=activations / GiB, loss=loss / GiB, other=gathered / GiB)
        return Estimate(params=(base + 4 * a) / GiB, grads=4 * a / GiB, optimizer=8 * a / GiB,
                        activations=activations / GiB, loss=loss / GiB, other=0.0)
    master = 4 if s.master == "fp32" else 2
    p, w = shape.total_params, s.world
    # an objective with a frozen reference model (ftcli.objectives: `reference_model`) keeps it beside the trained
    # model, in the compute dtype, sharded like it (an adapter's reference is its base with the adapter off: nothing
    # more; a precomputed reference: none, its log-probs are read with the blocks); SFT has none. On the H200
    # (BENCHMARKS.md, DPO against TRL) the copy then held in fp32 masters took 11.8 GiB at the Llama-8B width with 8
    # layers; it is held in the compute dtype now (ftcli.train.reference.frozen_copy_training), what this counts
    reference = (p + shape.frozen_params) * s.compute_bytes \
        if objective_of(s.objective).reference_model and s.reference == "model" else 0
    bf16_grads = 2 * shape.root_params if s.master == "bf16" else 0
    reduce_phase = 4 * shape.root_params + bf16_grads
    step_phase = activations + loss + bf16_grads
    other = bf16_grads + max(0.0, reduce_phase - step_phase)
    return Estimate(params=(p * master + shape.frozen_params * s.compute_bytes + reference) / w / GiB,
                    grads=p * master / w / GiB,
                    optimizer=2 * p * master / w / GiB, activations=activations / GiB, loss=loss / GiB,
                    other=other / GiB)


# model.quantization=mxfp4 (ftcli.model.mxfp4_lora): the expert weights stay as e2m1 values (4 bits) with one
# 8-bit scale per 32; the grouped expert GEMMs (ftcli.model.moe_lora) dequantize a chunk of experts at a time,
# up to DEQUANT_CHUNK_BYTES of weights in the compute dtype (= ftcli.model.mxfp4_lora.DEQUANT_CHUNK_BYTES, a
# test keeps them equal). On CUDA one fused kernel writes the chunk once (DEQUANT_COPIES = 1); the eager decode
# (CPU) also holds its int32 index and the looked-up values, 3 copies. Measured on an H200, gpt-oss-120b, 36
# layers, 4k block, full AC, eager decode: 72.10 GiB peak, and this model with 3 copies gives 72.09.
MXFP4_BITS_PER_PARAM = 4.25
DEQUANT_CHUNK_BYTES = 512 << 20
DEQUANT_COPIES = 1


def expert_weight_params(shape: ModelShape) -> int:
    """Parameters of the 3-D expert weights (the MXFP4 part of a gpt-oss checkpoint), all layers; biases excluded."""
    return shape.layers * sum(e * i * o for _, e, i, o in shape.expert_shapes)


def dequant_chunk_params(shape: ModelShape, compute_bytes: int) -> int:
    """Parameters of the largest chunk of experts dequantized at once: per projection, as many whole experts as
    DEQUANT_CHUNK_BYTES holds (at least one, at most all of a layer's)."""
    return max((min(e, max(1, DEQUANT_CHUNK_BYTES // (i * o * compute_bytes))) * i * o
                for _, e, i, o in shape.expert_shapes), default=0)


def largest_expert_params(shape: ModelShape) -> int:
    return max((i * o for _, _, i, o in shape.expert_shapes), default=0)


def usable_gib(card_gb: float) -> float:
    return USABLE * card_gb * 1e9 / GiB


def layers_to_keep(shape: ModelShape, s: Setting, card_gb: float) -> int:
    """With full checkpointing, how many layers may keep their activations and still fit the card."""
    usable = usable_gib(card_gb)
    fits = [k for k in range(shape.layers + 1)
            if estimate(shape, Setting(**{**asdict(s), "checkpointing": "full", "keep": k})).total <= usable]
    return max(fits, default=0)


# ---------------------------------------------------------------------------------------------- fit
def measured() -> dict[str, list[dict[str, Any]]]:
    return json.loads((resources.files("ftcli") / "assets" / "measured.json").read_text())


def point_setting(point: dict[str, Any]) -> tuple[ModelShape, Setting]:
    """The shape and setting of one measured point (ftcli/assets/measured.json)."""
    shape = shipped_shape(point["model"]).cut(point["layers"])
    return shape, Setting(method=point["method"], tokens=point["block_len"], world=point["gpus"],
                          master=point["master"], checkpointing=point["checkpointing"], loss=point["loss"],
                          keep=point.get("keep", 0), adapter_params=point.get("adapter_params", 0),
                          sharding=point.get("sharding", "ddp"))


def fit(points: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Least-squares K per family (points whose peak is in the activation phase; not the sharded-LoRA points,
    whose peak is the base's shards and gathered units with one layer's activations: they check those terms),
    then F from the full-logit points. The estimate is linear in K and F within a phase, so each is a
    one-variable fit."""
    points = measured()["memory"] if points is None else points
    stored: dict[str, float] = {}
    for family in sorted({shipped_shape(p["model"]).family for p in points}):
        num = den = 0.0
        for p in points:
            shape, s = point_setting(p)
            if shape.family != family or p["loss"] == "full" or s.sharding == "fsdp":
                continue  # sharded LoRA points (the 120b shape) check the state and gathered units, not K
            at0, at1 = estimate(shape, s, 0.0), estimate(shape, s, 1.0)
            slope = at1.activations - at0.activations
            reduce_phase = (4 + (2 if s.master == "bf16" else 0)) * shape.root_params / GiB if s.method_record.trains_base else 0
            if p["peak_gib"] - at0.state <= 1.05 * reduce_phase:
                continue  # the reduce phase is the peak: says nothing about K
            fixed = at0.state + at0.activations + at0.loss + (2 * shape.root_params / GiB if s.master == "bf16"
                                                              and s.method_record.trains_base else 0)
            num += slope * (p["peak_gib"] - fixed)
            den += slope * slope
        stored[family] = num / den
    num = den = 0.0
    for p in points:
        if p["loss"] != "full":
            continue
        shape, s = point_setting(p)
        e = estimate(shape, s, stored[shape.family])
        slope = s.tokens * shape.vocab / GiB
        num += slope * (p["peak_gib"] - (e.total - e.loss))
        den += slope * slope
    return {"stored_layer_bytes": stored, "full_logits_bytes": num / den if den else None}
