"""Qwen3 dense (Qwen3-0.6B ... 32B): GQA decoder with a per-head RMSNorm on queries and keys, SwiGLU MLP; the
Qwen3 ChatML template with <think> blocks (dropped from earlier turns)."""

from __future__ import annotations

from typing import Any

from ftcli.families.base import DENSE, Family, LayerShapes, dense_layer_shapes


def layer_shapes(cfg: dict[str, Any]) -> LayerShapes:
    return dense_layer_shapes(cfg, norms=2, qk_norm=True)


FAMILY = Family(
    name="qwen3",
    title="Qwen3",
    model_types=("qwen3",),
    attention=DENSE,
    packed_ops=("attention",),
    kernel_module=None,
    module_globals={},
    layer_shapes=layer_shapes,
    stored_layer_bytes=66.12,  # not measured: Qwen3.5's fitted K
    stored_layer_bytes_source="qwen3_5",
    vlm_text_types={},
    vlm_classes={"qwen3": None},
    fused_op_targets={"rms_norm": "Qwen3RMSNorm", "swiglu": "Qwen3MLP"},
    known_bad=(),
    pins=(),
    setup_note=None,
    no_pins_note="Nothing else: {model_type} needs no extra kernels (packed attention is torch's varlen_attn).",
    mxfp4_experts=False,
    per_expert_checkpoint={},
    chat_format="chatml",
)
