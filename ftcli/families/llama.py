"""Llama 3.x (3.1, 3.2, 3.3): dense GQA decoder, SwiGLU MLP, RoPE with llama3 frequency scaling; the Llama 3.1
chat template (header markers, `<|eot_id|>` ends every turn, a dated system header, tools in the user turn)."""

from __future__ import annotations

from typing import Any

from ftcli.families.base import DENSE, Family, LayerShapes, dense_layer_shapes


def layer_shapes(cfg: dict[str, Any]) -> LayerShapes:
    return dense_layer_shapes(cfg, norms=2, qk_norm=False)


FAMILY = Family(
    name="llama",
    title="Llama 3",
    model_types=("llama",),
    attention=DENSE,
    packed_ops=("attention",),
    kernel_module=None,
    module_globals={},
    layer_shapes=layer_shapes,
    stored_layer_bytes=66.12,  # not measured: Qwen3.5's fitted K (a dense layer stores no more than its hybrid mix)
    stored_layer_bytes_source="qwen3_5",
    vlm_text_types={},
    vlm_classes={"llama": None},
    fused_op_targets={"rms_norm": "LlamaRMSNorm", "swiglu": "LlamaMLP"},
    known_bad=(),
    pins=(),
    setup_note=None,
    no_pins_note="Nothing else: {model_type} needs no extra kernels (packed attention is torch's varlen_attn).",
    mxfp4_experts=False,
    per_expert_checkpoint={},
    chat_format="llama3",
    notes=("the template renders a system header with 'Cutting Knowledge Date' and 'Today Date' on every "
           "conversation, also without a system message",),
)
