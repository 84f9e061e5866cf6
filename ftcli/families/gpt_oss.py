"""gpt-oss: MoE decoder (32/128 experts, top-4, MXFP4 experts on the hub), alternating sliding-window and full
attention with a learned sink per head; the harmony chat format."""

from __future__ import annotations

from typing import Any

from ftcli.families.base import SINK_ATTENTION, SINK_MOE, SINKS, ExpertLayout, Family, LayerShapes


def layer_shapes(cfg: dict[str, Any]) -> LayerShapes:
    h, inter, experts = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    attn = [("q_proj", h, heads * hd), ("k_proj", h, kv * hd), ("v_proj", h, kv * hd), ("o_proj", heads * hd, h)]
    router = h * experts + experts  # GptOssTopKRouter: a weight and a bias, not an nn.Linear (LoRA skips it)
    bias = sum(o for _, _, o in attn) if cfg.get("attention_bias", True) else 0
    expert_shapes = (("mlp.experts.gate_up_proj", experts, h, 2 * inter), ("mlp.experts.down_proj", experts, inter, h))
    expert_params = sum(e * (i * o + o) for _, e, i, o in expert_shapes)
    per_layer = sum(i * o for _, i, o in attn) + bias + router + heads + expert_params + 2 * h  # + sinks, norms
    return [("*", *x) for x in attn], expert_shapes, [per_layer] * cfg["num_hidden_layers"]


FAMILY = Family(
    name="gpt_oss",
    title="gpt-oss",
    model_types=("gpt_oss",),
    attention=SINKS,
    packed_ops=("attention",),
    kernel_module="transformers.models.gpt_oss.modeling_gpt_oss",  # its eager attention applies the sinks
    module_globals={},
    layer_shapes=layer_shapes,
    stored_layer_bytes=91.41,
    stored_layer_bytes_source="fit",
    vlm_text_types={},
    vlm_classes={"gpt_oss": None},
    fused_op_targets={},
    known_bad=(SINK_ATTENTION,),
    pins=(),
    setup_note=None,
    no_pins_note="Nothing else: {model_type} needs no extra kernels (its attention and the MXFP4 dequantization are "
                 "plain torch).",
    mxfp4_experts=True,
    per_expert_checkpoint={},
    chat_format="harmony",
    decoder=SINK_MOE,
    expert_layout=ExpertLayout(experts_class="GptOssExperts", weights="in_out", activation="clamped_swiglu", biases=True),
)
