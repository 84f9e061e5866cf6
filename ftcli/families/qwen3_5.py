"""Qwen3.5 (Qwen3.6-3.8 ship the same architecture): hybrid decoder of gated-delta linear-attention layers and
gated full-attention layers, dense MLP. The hub checkpoints are the VLM (`qwen3_5`, a frozen vision tower
around a `qwen3_5_text` model)."""

from __future__ import annotations

from typing import Any

from ftcli.families.base import (
    BLACKWELL_GATED_DELTA,
    DENSE,
    FLA_ON_GPU,
    HYBRID,
    TRANSFORMERS_PACKING_ARGS,
    Family,
    LayerShapes,
    Pin,
    layer_types,
)


def layer_shapes(cfg: dict[str, Any]) -> LayerShapes:
    kinds = layer_types(cfg, "full_attention")
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg.get("head_dim") or h // cfg["num_attention_heads"]
    gate = 2 if cfg.get("attn_output_gate", True) else 1
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, width = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    mlp = [("gate_proj", h, inter), ("up_proj", h, inter), ("down_proj", inter, h)]
    full = [("q_proj", h, heads * hd * gate), ("k_proj", h, kv * hd), ("v_proj", h, kv * hd), ("o_proj", heads * hd, h)]
    conv_dim = 2 * nk * dk + nv * dv
    linear = [("in_proj_qkv", h, conv_dim), ("in_proj_z", h, nv * dv), ("in_proj_b", h, nv), ("in_proj_a", h, nv),
              ("out_proj", nv * dv, h)]
    counts = []
    for kind in kinds:
        mats = (full if kind == "full_attention" else linear) + mlp
        extra = 2 * hd if kind == "full_attention" else conv_dim * width + dv + 2 * nv  # norms / conv, dt_bias, A_log
        counts.append(sum(i * o for _, i, o in mats) + extra + 2 * h)
    tagged = [("linear_attention", *x) for x in linear] + [("full_attention", *x) for x in full] + [("*", *x) for x in mlp]
    return tagged, (), counts


FAMILY = Family(
    name="qwen3_5",
    title="Qwen3.5",
    model_types=("qwen3_5", "qwen3_5_text"),  # the VLM and the dense text model
    attention=DENSE,
    packed_ops=("attention", "gated_delta_rule", "causal_conv1d"),
    kernel_module="transformers.models.qwen3_5.modeling_qwen3_5",
    module_globals={"gated_delta_rule": "torch_chunk_gated_delta_rule", "causal_conv1d": "causal_conv1d_fn"},
    layer_shapes=layer_shapes,
    stored_layer_bytes=66.12,
    stored_layer_bytes_source="fit",
    vlm_text_types={"qwen3_5": "qwen3_5_text"},
    vlm_classes={"qwen3_5": ("Qwen3_5ForConditionalGeneration", False), "qwen3_5_text": None},
    fused_op_targets={"rms_norm": "Qwen3_5RMSNorm", "swiglu": "Qwen3_5MLP", "gated_norm": "Qwen3_5RMSNormGated"},
    known_bad=(TRANSFORMERS_PACKING_ARGS, BLACKWELL_GATED_DELTA, FLA_ON_GPU),
    pins=(
        Pin("flash-linear-attention==0.6.0",
            "pure Python + Triton: gated-delta kernels that honour cu_seqlens, and a Triton varlen causal "
            "conv that takes seq_idx in place of causal-conv1d (a CUDA source build of many minutes)"),
        Pin("tilelang==0.1.15",
            "a wheel; on Hopper fla 0.6.0 refuses the Triton gated-delta backward with Triton < 3.7.1 "
            "(wrong gradients) and uses tilelang kernels instead", hopper_only=True),
    ),
    setup_note="No flash-attn or causal-conv1d builds: packed attention uses torch's varlen_attn.",
    no_pins_note="",
    mxfp4_experts=False,
    per_expert_checkpoint={},
    chat_format="chatml",
    decoder=HYBRID,
    rms_norm_offset=1.0,
)
