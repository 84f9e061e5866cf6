"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): the Qwen3 attention block and a sparse MoE MLP (128 experts, top-8, no
shared expert) stored as 3-D expert parameters; LoRA reaches the experts through PEFT's target_parameters
(mlp.experts.gate_up_proj, mlp.experts.down_proj), as for gpt-oss, computed unmerged and grouped by expert
(ftcli.model.moe_lora, `expert_layout`). The Qwen3 chat template."""

from __future__ import annotations

from typing import Any

from ftcli.families import qwen3
from ftcli.families.base import DENSE, ExpertLayout, Family, LayerShapes, attention_linears


def layer_shapes(cfg: dict[str, Any]) -> LayerShapes:
    # transformers 5.25 writes the expert count as num_local_experts; earlier releases (and the hub configs) num_experts
    h, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    experts = cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError("ftcli sizes Qwen3-MoE models whose every layer is sparse (mlp_only_layers=[], "
                         "decoder_sparse_step=1), as every released one is")
    attn = attention_linears(cfg)
    router = h * experts  # Qwen3MoeTopKRouter: a weight, not an nn.Linear (LoRA all-linear skips it)
    expert_shapes = (("mlp.experts.gate_up_proj", experts, h, 2 * inter), ("mlp.experts.down_proj", experts, inter, h))
    expert_params = sum(e * i * o for _, e, i, o in expert_shapes)
    bias = sum(o for _, _, o in attn) if cfg.get("attention_bias") else 0
    per_layer = sum(i * o for _, i, o in attn) + bias + router + expert_params + 2 * h + 2 * hd  # + norms, qk norms
    return [("*", *x) for x in attn], expert_shapes, [per_layer] * cfg["num_hidden_layers"]


FAMILY = Family(
    name="qwen3_moe",
    title="Qwen3-MoE",
    model_types=("qwen3_moe",),
    attention=DENSE,
    packed_ops=("attention",),
    kernel_module=None,
    module_globals={},
    layer_shapes=layer_shapes,
    stored_layer_bytes=91.41,  # not measured: gpt-oss's fitted K (the other MoE)
    stored_layer_bytes_source="gpt_oss",
    vlm_text_types={},
    vlm_classes={"qwen3_moe": None},
    fused_op_targets={},
    known_bad=(),
    pins=(),
    setup_note=None,
    no_pins_note="Nothing else: {model_type} needs no extra kernels (packed attention is torch's varlen_attn; the "
                 "experts run transformers' own loop).",
    mxfp4_experts=False,
    per_expert_checkpoint={"mlp.experts.gate_up_proj": ("gate_proj", "up_proj"), "mlp.experts.down_proj": ("down_proj",)},
    chat_format=qwen3.FAMILY.chat_format,
    # Qwen3MoeExperts: gate_up_proj [E, 2·moe_intermediate, hidden] (gate rows, then up), down_proj [E, hidden,
    # moe_intermediate], each applied as F.linear(x, W[e]); act_fn(gate)·up with config.hidden_act (silu); no biases
    expert_layout=ExpertLayout(experts_class="Qwen3MoeExperts", weights="out_in", activation="silu", biases=False),
)
