"""Gemma 3 (1B text-only; 4B, 12B, 27B as VLMs around a `gemma3_text` model): GQA with a per-head q/k RMSNorm,
five sliding-window layers (window 512-1024) per global layer, a GeGLU MLP, four RMSNorms per layer, tied
embeddings, no attention or final soft-capping in Gemma 3 (Gemma 2 had both). Packed blocks keep the sliding
window inside each segment. Its template has no system role: a system message is folded into the first user
turn by the template itself, and roles must alternate user/model (the template raises otherwise)."""

from __future__ import annotations

from typing import Any

from ftcli.families.base import DENSE, Family, LayerShapes, dense_layer_shapes


def layer_shapes(cfg: dict[str, Any]) -> LayerShapes:
    return dense_layer_shapes(cfg, norms=4, qk_norm=True)


FAMILY = Family(
    name="gemma3",
    title="Gemma 3",
    model_types=("gemma3_text", "gemma3"),  # the text model and the VLM (4B-27B hub checkpoints)
    attention=DENSE,
    packed_ops=("attention",),
    kernel_module=None,
    module_globals={},
    layer_shapes=layer_shapes,
    stored_layer_bytes=66.12,  # not measured: Qwen3.5's fitted K
    stored_layer_bytes_source="qwen3_5",
    vlm_text_types={"gemma3": "gemma3_text"},
    vlm_classes={"gemma3": ("Gemma3ForConditionalGeneration", True), "gemma3_text": None},
    fused_op_targets={"rms_norm": "Gemma3RMSNorm"},  # its MLP is GeGLU (gelu_pytorch_tanh): no swiglu
    known_bad=(),
    pins=(),
    setup_note=None,
    no_pins_note="Nothing else: {model_type} needs no extra kernels (packed attention, sliding windows included, "
                 "is torch's varlen_attn).",
    mxfp4_experts=False,
    per_expert_checkpoint={},
    chat_format="gemma",
    notes=("the assistant role is written 'model'", "text is trimmed by the template"),
    rms_norm_offset=1.0,
)
