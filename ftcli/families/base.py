"""The model families ftcli trains: one `Family` record per family, held in a plain dict registry.

A family is every fact about a kind of model that more than one module asks about: which transformers
model types belong to it, which ops a packed block goes through and how their backends are picked
(ftcli.model.kernels), its shape from a config (ftcli.estimate.memory), the modules training.fused_ops
swaps (ftcli.features.fused_ops), the known-bad rules that apply to it (ftcli.model.compat), the pip pins
its workload installs (ftcli.launchers.base), and the name of its chat format (ftcli.chat_formats holds
the format's facts). Consumers ask `family_of(model_type)` and never name a model type themselves
(tests/unit/test_architecture.py checks it).

Adding a family: one module here (its `Family`), one line in ftcli/families/__init__.py, its assets
(tiny config + tokenizer from scripts/build_tiny_assets.py, the hub config under assets/models/) and a recipe.

Pure Python, no torch: `ftcli plan`, `doctor` and `render-workload` import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


# Known-bad rules (ftcli.model.compat implements them; a family lists the ones that apply to it)
TRANSFORMERS_PACKING_ARGS = "transformers_packing_args"  # transformers 5.2-5.8.1 drops cu_seq_lens / seq_idx
BLACKWELL_GATED_DELTA = "blackwell_gated_delta"  # fla#913: NaN gated-delta gradients on Blackwell
FLA_ON_GPU = "fla_on_gpu"  # no fla on a GPU: the gated-delta rule runs the slow torch path
SINK_ATTENTION = "sink_attention"  # packed attention must apply the learned sinks

# Packed attention kinds (ftcli.model.kernels.choose picks a backend per kind)
DENSE = "dense"  # causal attention per segment: flash-attn varlen / torch varlen_attn / sdpa per segment
HYBRID, SINK_MOE = "hybrid", "sink_moe"  # Family.decoder
SINKS = "sinks"  # sliding window + learned sinks per head: flex attention / eager per segment

# (layer kind or "*", name, in, out) of each nn.Linear, (name, experts, in, out) of each 3-D expert
# parameter, and the parameter count of every decoder layer
LayerShapes = tuple[list[tuple[str, str, int, int]], tuple[tuple[str, int, int, int], ...], list[int]]


@dataclass(frozen=True)
class Pin:
    """A pip requirement the family's workload installs, and why (`gpu_requirements`)."""

    requirement: str
    why: str
    hopper_only: bool = False  # only on Hopper cards (H100, H200, ...)


@dataclass(frozen=True)
class ExpertLayout:
    """How a family's 3-D expert parameters compute, for the grouped expert LoRA (ftcli.model.moe_lora picks its
    forward by the experts module's class): gpt-oss `[E, in, out]` + biases, gate/up interleaved, clamped SwiGLU;
    Qwen3-MoE `[E, out, in]` (`F.linear(x, W[e])`), gate | up halves, act(gate)·up, no biases."""

    experts_class: str  # the transformers experts module's class name ("GptOssExperts")
    weights: str  # "in_out": W[e] is [in, out] (x @ W[e]); "out_in": [out, in] (x @ W[e].T)
    activation: str  # "clamped_swiglu": interleaved gate/up, (up + 1)·gate·σ(α·gate), clamped at `limit`;
    #                  "silu": gate then up (halves), silu(gate)·up
    biases: bool  # a `{name}_bias` [E, out] per projection


@dataclass(frozen=True)
class Family:
    name: str  # registry key; ModelShape.family, doctor's per-family rows
    title: str  # as people write it, for messages: "Qwen3.5", "gpt-oss"
    model_types: tuple[str, ...]  # transformers model_type values; the first is the family's own model type
    # --- packed training (ftcli.model.kernels)
    attention: str  # DENSE | SINKS
    packed_ops: tuple[str, ...]  # every op a packed block goes through: attention, gated_delta_rule, causal_conv1d
    kernel_module: str | None  # the transformers modeling module the packed kernels patch (`module_globals`) or call
    module_globals: dict[str, str]  # op -> the module global its layer looks up at call time (replaced by install)
    # --- shape from a config (ftcli.estimate.memory)
    layer_shapes: Callable[[dict[str, Any]], LayerShapes]
    stored_layer_bytes: float  # K: bytes per token per hidden unit of one stored layer in bf16 (fitted or borrowed)
    stored_layer_bytes_source: str  # where K comes from: "fit" (measured.json) or the family it is borrowed from
    vlm_text_types: dict[str, str]  # VLM model_type -> the model_type of the text config inside it
    # model_type -> (image-text-to-text class, its accepts_loss_kwargs) or None, as transformers 5.17-5.24 has it
    vlm_classes: dict[str, tuple[str, bool] | None]
    # --- training.fused_ops (ftcli.features.fused_ops): op -> the transformers class it replaces
    fused_op_targets: dict[str, str]
    # --- known-bad version rules that apply (ftcli.model.compat)
    known_bad: tuple[str, ...]
    # --- the launchers' pip pins (ftcli.launchers.base) and what the setup comment says when there are none
    pins: tuple[Pin, ...]
    setup_note: str | None  # always in the workload's setup comment
    no_pins_note: str  # in the setup comment when nothing at all is installed beyond ftcli ({model_type} filled in)
    # --- checkpoint format
    mxfp4_experts: bool  # the hub checkpoint stores its experts in MXFP4 (merge-lora can write them back)
    # fused 3-D expert parameter (suffix) -> the per-expert linears its checkpoint stores instead, in the order they
    # are concatenated (dim 1), e.g. Qwen3-MoE: mlp.experts.gate_up_proj <- experts.{e}.gate_proj, .up_proj
    per_expert_checkpoint: dict[str, tuple[str, ...]]
    # --- chat format: its name in ftcli.chat_formats.CHAT_FORMATS (chatml | harmony | llama3 | gemma), which holds
    # every chat fact (grammar, end of turn, reasoning, tool calls, stop tokens, system role)
    chat_format: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    # which static-state decoder of ftcli.model.decode generates for it on a GPU: HYBRID (gated-delta + full
    # attention layers) or SINK_MOE (sliding window + sinks, routed experts); None: transformers' generate
    decoder: str | None = None
    # training.fused_ops' rms_norm: its RMSNorm multiplies by (offset + w): 1.0 for zero-centred weights computed in
    # float32 throughout (Qwen3.5, Gemma 3: liger's "gemma" casting), 0.0 for w * norm(x) cast back first (Llama, Qwen3:
    # liger's "llama" casting)
    rms_norm_offset: float = 0.0
    # its experts module's layout when lora.experts=grouped computes their LoRA (ftcli.model.moe_lora); None: PEFT's
    expert_layout: ExpertLayout | None = None

    @property
    def model_type(self) -> str:
        return self.model_types[0]

    @property
    def rms_norm_casting(self) -> str:
        """The casting mode of the family's fused RMSNorm kernel (the comment on `rms_norm_offset`)."""
        return "gemma" if self.rms_norm_offset else "llama"

    def uses(self, op: str) -> bool:
        return op in self.packed_ops

    def has_rule(self, rule: str) -> bool:
        return rule in self.known_bad


def layer_types(cfg: dict[str, Any], default: str) -> list[str]:
    """The config's layer type of every decoder layer (`layer_types`, repeated; `default` when absent)."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [default]
    return [types[i % len(types)] for i in range(n)]


def registry_by_model_type(families: dict[str, Family]) -> dict[str, Family]:
    by_type: dict[str, Family] = {}
    for family in families.values():
        for model_type in family.model_types:
            assert model_type not in by_type, f"{model_type} is in two families"
            by_type[model_type] = family
    return by_type


# ------------------------------------------------------------------------------- shared shape pieces
def attention_linears(cfg: dict[str, Any]) -> list[tuple[str, int, int]]:
    """q/k/v/o of a standard GQA attention block: (name, in, out)."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    return [("q_proj", h, heads * hd), ("k_proj", h, kv * hd), ("v_proj", h, kv * hd), ("o_proj", heads * hd, h)]


def dense_layer_shapes(cfg: dict[str, Any], *, norms: int, qk_norm: bool) -> LayerShapes:
    """A decoder layer of GQA attention and a gated MLP (gate/up/down): Llama, Qwen3, Gemma 3. `norms`: RMSNorms
    of hidden size per layer; `qk_norm`: a per-head RMSNorm on queries and keys (head_dim each)."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    attn = attention_linears(cfg)
    mlp = [("gate_proj", h, inter), ("up_proj", h, inter), ("down_proj", inter, h)]
    bias = sum(o for _, _, o in attn) if cfg.get("attention_bias") else 0
    bias += sum(o for _, _, o in mlp) if cfg.get("mlp_bias") else 0
    per_layer = sum(i * o for _, i, o in attn + mlp) + bias + norms * h + (2 * hd if qk_norm else 0)
    return [("*", *x) for x in attn + mlp], (), [per_layer] * cfg["num_hidden_layers"]
