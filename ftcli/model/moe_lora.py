"""LoRA on MoE experts (gpt-oss, Qwen3-MoE), unmerged and grouped: one path for a bf16 base and for a kept-MXFP4 base.

PEFT's ParamWrapper trains `lora.target_parameters` (the 3-D expert weights `[E, in, out]`) by folding
`W + s·A·B` into a new weight on every forward and backpropagating through that merged weight: every layer
builds an expert-weight-sized bf16 tensor, and its backward an expert-weight-sized gradient that is then
projected onto A and B. Here the delta stays unmerged and the base gets no gradient at all:

    tokens of a layer, grouped by expert (one stable sort of the T·k (token, expert) pairs per layer):
        x_g  [S = T·k, in]   rows of expert 0 | rows of expert 1 | ... (offs: the cumulative counts)
    forward    y_g  = x_g · W_e + s · (x_g · A_e) · B_e                 one grouped GEMM per term
    backward   gx_g = gy_g · W_eᵀ + s · (gy_g · B_eᵀ) · A_eᵀ
               gA_e = s · x_gᵀ · (gy_g · B_eᵀ),   gB_e = s · (x_g · A_e)ᵀ · gy_g,   nothing for W

`GroupedLoraMatmul` holds that algebra; W comes from an `ExpertWeights` source, asked for a range of experts
at a time, in forward and again in backward: the bf16 parameter itself (`DenseExperts`, a view), or the
kept MXFP4 blocks dequantized just in time into a transient bf16 buffer (`ftcli.model.mxfp4_lora.Mxfp4Experts`,
a bounded group of experts at a time). Nothing of W is saved for backward, so activation checkpointing's
recompute and the backward dequantize again instead of holding a bf16 copy.

The grouped GEMMs are `torch.nn.functional.grouped_mm` (public since torch 2.10; what transformers 5.x's
"grouped_mm" experts implementation calls; bf16 on CUDA sm80+, float32/bf16 on CPU); elsewhere (float64,
float32 on CUDA, older torch) an exact loop over the experts' row ranges.

The adapter stays PEFT's: PEFT wraps the expert parameters as usual (names, shapes, init, scaling, save,
load, merge-lora), and `install_grouped_experts` replaces the outer wrapper's forward with
`grouped_experts_forward`, which takes the factors from PEFT's public `get_delta_factors` (the exact layout
PEFT folds: delta[e] = scaling · lhs[e] @ rhs[e], `[in, r] @ [r, out]`). `lora.experts: peft` keeps PEFT's
folded forward (bf16 base only).

Over a base sharded by FSDP2 (`training.sharding: fsdp`) nothing changes: the experts module sits inside a
decoder layer, an FSDP2 unit, whose pre-forward hook has gathered the layer's weights, base and adapter, as plain
tensors before `grouped_experts_forward` reads them (a DTensor never reaches it); after forward the unit reshards
(frees the gathered storage) and its pre-backward hook gathers it again into the same tensor objects before
`GroupedLoraMatmul.backward` asks `source` for W, and FSDP2's activation checkpointing (whole units) recomputes
the forward after that gather. The factors' gradients flow into the gathered LoRA parameters, which FSDP2
reduce-scatters like any other (tests/e2e/test_lora_fsdp.py: losses, gradients and adapters against PEFT's folded path
under FSDP2 and the grouped path on one rank; a kept-MXFP4 base is DDP only, the recipe schema refuses FSDP).

Which experts modules go this way, and how each computes, is its family's `ExpertLayout` (ftcli.families):
the weight orientation (gpt-oss `[E, in, out]`; Qwen3-MoE `[E, out, in]`, passed as its transposed view and
PEFT's factors swapped and transposed), the gate over the gate_up projection (`GATES`: gpt-oss's interleaved
clamped SwiGLU, Qwen3-MoE's gate | up halves through silu) and whether there are biases.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ftcli.config.errors import UserError
from ftcli.families import FAMILIES
from ftcli.families.base import ExpertLayout
from ftcli.model.mxfp4 import EXPERT_PARAMS
from ftcli.model.mxfp4_lora import Mxfp4Experts, fuses


# --------------------------------------------------------------------------------------- grouped GEMMs
def _use_grouped_mm(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not hasattr(torch.nn.functional, "grouped_mm") or a.dtype != b.dtype:
        return False
    if a.device.type == "cuda":
        return a.dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device) >= (8, 0)
    return a.device.type == "cpu" and a.dtype in (torch.float32, torch.bfloat16)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, bounds: list[int] | None) -> torch.Tensor:
    """`a [S, K]` (rows grouped: group e is rows bounds[e]..bounds[e+1]) times `b [G, K, N]` -> `[S, N]`.
    `offs` is `bounds[1:]` as an int32 tensor on a's device (what grouped_mm takes); `bounds` (python ints,
    a host copy) may be None where grouped_mm takes these operands."""
    if bounds is None or _use_grouped_mm(a, b):
        return torch.nn.functional.grouped_mm(a, b, offs=offs)
    out = a.new_zeros(a.shape[0], b.shape[-1])
    for e in range(b.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = a[lo:hi] @ b[e]
    return out


def grouped_outer(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, bounds: list[int] | None) -> torch.Tensor:
    """Per group e: `a[rows_e]ᵀ @ b[rows_e]` for `a [S, K]`, `b [S, N]` -> `[G, K, N]` (zero for an empty group)."""
    if bounds is None or _use_grouped_mm(a, b):
        out = torch.nn.functional.grouped_mm(a.t(), b, offs=offs)
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        return torch.where((counts > 0)[:, None, None], out, 0.0)  # an empty group's block is not written on CUDA
    out = a.new_zeros(len(bounds) - 1, a.shape[1], b.shape[1])
    for e in range(len(bounds) - 1):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[e] = a[lo:hi].t() @ b[lo:hi]
    return out


# ------------------------------------------------------------------------------------ weight sources
class DenseExperts:
    """W of a bf16 (or float32) base: the `[E, in, out]` parameter itself, sliced (a view, no copy)."""

    def __init__(self, param: torch.Tensor) -> None:
        self.param, self.num_experts, self.chunk = param, param.shape[0], param.shape[0]
        self.dtype, self.out_features = param.dtype, param.shape[-1]

    def weight(self, lo: int, hi: int) -> torch.Tensor:
        return self.param[lo:hi].detach()


def expert_chunks(num_experts: int, chunk: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + chunk, num_experts)) for lo in range(0, num_experts, chunk)]


class GroupedLoraMatmul(torch.autograd.Function):
    """`x_g [S, in]` (rows grouped by expert, `offs` the cumulative counts on the device, `bounds` the same on
    the host with a leading 0, or None where neither chunks nor the loop need them)
    -> `[S, out]` through every expert's W from `source` plus the unmerged LoRA (`lhs [E, in, r]`,
    `rhs [E, r, out]`, or both None). W is asked from `source` a chunk of experts at a time, in forward and
    again in backward; saved for backward: x_g, x_g·A and the factors, never W."""

    @staticmethod
    def forward(ctx, x, offs, bounds, source, lhs, rhs, scaling: float):
        # [hi-lo, in, out] per chunk of experts: for MXFP4 a transient, freed with the chunk
        y = _chunked(x, offs, bounds, source, lambda lo, hi: source.weight(lo, hi), source.out_features)
        xa = None
        if lhs is not None:
            xa = grouped_mm(x, lhs, offs, bounds)
            y = y + scaling * grouped_mm(xa, rhs, offs, bounds)
        ctx.save_for_backward(x, offs, lhs, rhs, xa)
        ctx.bounds, ctx.source, ctx.scaling = bounds, source, scaling
        return y

    @staticmethod
    def backward(ctx, gy):
        x, offs, lhs, rhs, xa = ctx.saved_tensors
        bounds, source, s = ctx.bounds, ctx.source, ctx.scaling
        gy = gy.contiguous()
        gx = g_lhs = g_rhs = None
        gy_b = grouped_mm(gy, rhs.transpose(-2, -1), offs, bounds) if lhs is not None else None  # [S, r]
        if ctx.needs_input_grad[0]:
            gx = _chunked(gy, offs, bounds, source, lambda lo, hi: source.weight(lo, hi).transpose(-2, -1), x.shape[1])
            if gy_b is not None:
                gx = gx + s * grouped_mm(gy_b, lhs.transpose(-2, -1), offs, bounds)
        if lhs is not None and ctx.needs_input_grad[4]:
            g_lhs = s * grouped_outer(x, gy_b, offs, bounds)
        if lhs is not None and ctx.needs_input_grad[5]:
            g_rhs = s * grouped_outer(xa, gy, offs, bounds)
        return gx, None, None, None, g_lhs, g_rhs, None


def _chunked(a: torch.Tensor, offs, bounds: list[int], source, weight, out_features: int) -> torch.Tensor:
    """`a`'s grouped rows times `weight(lo, hi)` (`[hi-lo, K, N]`), one chunk of `source.chunk` experts at a time."""
    chunks = expert_chunks(source.num_experts, source.chunk)
    if len(chunks) == 1:
        return grouped_mm(a, weight(0, source.num_experts), offs, bounds)
    assert bounds is not None, "chunks of experts need the row bounds on the host"
    out = a.new_empty(a.shape[0], out_features)
    for lo, hi in chunks:
        r0, r1 = bounds[lo], bounds[hi]
        if r1 > r0:
            local_offs = offs[lo:hi] - r0 if lo else offs[lo:hi]
            out[r0:r1] = grouped_mm(a[r0:r1], weight(lo, hi), local_offs, [b - r0 for b in bounds[lo : hi + 1]])
    return out


# ---------------------------------------------------------------------------------------- routing
def group_by_expert(router_indices: torch.Tensor, num_experts: int, host_bounds: bool = True):
    """`router_indices [T, k]` -> (order [S]: the (token, slot) pairs flattened as token·k + slot, sorted by
    expert, ties in token order; expert [S] of each sorted pair; offs int32 [E]: cumulative counts; bounds:
    the same as python ints with a leading 0, or None without `host_bounds`). One stable sort and one
    bincount per layer, and with `host_bounds` one copy to the host (a sync)."""
    flat = router_indices.reshape(-1)
    expert, order = torch.sort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    bounds = [0, *offs.tolist()] if host_bounds else None
    return order, expert, offs, bounds


def _swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU over interleaved gate/up columns (GptOssExperts' gate, as transformers 5.x has it)."""
    gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _silu_gated(gate_up: torch.Tensor) -> torch.Tensor:
    """Qwen3-MoE's gated MLP over gate | up halves (Qwen3MoeExperts: act_fn(gate) * up, act_fn silu)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# ExpertLayout.activation (ftcli.families) -> the gate over the gate_up projection, and its arguments from the module
GATES = {"clamped_swiglu": (_swiglu, lambda experts: (experts.alpha, experts.limit)),
         "silu": (_silu_gated, lambda experts: ())}


@functools.cache
def _compiled(gate):
    """`gate` fused (torch.compile, forward and backward): eager runs ~7 elementwise kernels forward and ~12
    backward over the `[T·k, 2·intermediate]` activations of every layer."""
    return torch.compile(gate, dynamic=None)


def layout_of(experts: nn.Module) -> ExpertLayout | None:
    """The family's declared layout of this experts module (by its class, through ftcli.families), or None."""
    layouts = {f.expert_layout.experts_class: f.expert_layout for f in FAMILIES.values() if f.expert_layout}
    return layouts.get(type(experts).__name__)


def grouped_experts(experts: nn.Module, sources: dict, factors: dict, hidden_states, router_indices,
                    routing_weights, layout: ExpertLayout | None = None) -> torch.Tensor:
    """The experts module's forward (its family's `layout`: weight orientation, gate, biases; routing-weighted sum
    over the k slots) with each projection through `GroupedLoraMatmul`: `sources[name]` gives W as `[E, in, out]`,
    `factors[name]` is PEFT's (lhs, rhs, scaling), the delta `lhs @ rhs` in the parameter's own layout."""
    layout = layout or layout_of(experts)
    num_tokens, hidden = hidden_states.shape
    top_k = router_indices.shape[-1]
    dtype = sources["gate_up_proj"].dtype
    probe = hidden_states.new_empty(0, dtype=dtype)
    host_bounds = not _use_grouped_mm(probe, probe) or any(s.chunk < s.num_experts for s in sources.values())
    order, expert, offs, bounds = group_by_expert(router_indices, experts.num_experts, host_bounds)

    def project(x, name):
        lhs, rhs, scaling = factors[name]
        if lhs is not None:
            if layout.weights == "out_in":  # delta[e] [out, in] = lhs·rhs; x·deltaᵀ = (x·rhsᵀ)·lhsᵀ
                lhs, rhs = rhs.transpose(-2, -1), lhs.transpose(-2, -1)
            lhs, rhs = lhs.to(dtype).contiguous(), rhs.to(dtype).contiguous()  # grouped_mm: row- or column-major
        y = GroupedLoraMatmul.apply(x, offs, bounds, sources[name], lhs, rhs, scaling)
        return y + getattr(experts, f"{name}_bias")[expert].to(dtype) if layout.biases else y

    x = hidden_states.to(dtype)[order // top_k]  # [S, hidden], grouped by expert
    gate, gate_args = GATES[layout.activation]
    gated = (_compiled(gate) if fuses(x) else gate)(project(x, "gate_up_proj"), *gate_args(experts))
    out = project(gated, "down_proj") * routing_weights.reshape(-1)[order, None].to(dtype)
    unsorted = torch.empty_like(order)
    unsorted[order] = torch.arange(order.numel(), device=order.device)
    # the k slots of each token summed (accumulated in float32 for bf16), as transformers' grouped_mm path does
    return out[unsorted].view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


# ------------------------------------------------------------------------------- with PEFT's adapter
def _wrapped(wrapper) -> tuple[dict[str, nn.Module], nn.Module]:
    """The ParamWrappers nested on one experts module, by parameter name, and the experts module under them."""
    from peft.tuners.lora.layer import ParamWrapper

    wrappers, layer = {}, wrapper
    while isinstance(layer, ParamWrapper):
        wrappers[layer.parameter_name] = layer
        layer = layer.base_layer
    return wrappers, layer


def _factors(wrappers: dict[str, nn.Module], name: str):
    wrapper = wrappers.get(name)
    if wrapper is None or wrapper.disable_adapters:
        return None, None, 0.0
    adapters = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
    if not adapters:
        return None, None, 0.0
    if len(adapters) > 1 or wrapper.merged:
        raise UserError("the grouped expert LoRA (lora.experts=grouped) trains one unmerged adapter at a time; "
                        "use --set lora.experts=peft")
    return wrapper.get_delta_factors(adapters[0])


def expert_sources(experts: nn.Module, layout: ExpertLayout | None = None) -> dict:
    """W of each expert projection as `[E, in, out]`: kept MXFP4 (`{name}_blocks` buffers) or the dense parameter
    (for an `out_in` layout its transposed view, no copy)."""
    layout = layout or layout_of(experts)

    def dense(param):
        return DenseExperts(param.transpose(-2, -1) if layout.weights == "out_in" else param)

    return {name: Mxfp4Experts.of(experts, name) if hasattr(experts, f"{name}_blocks")
            else dense(getattr(experts, name)) for name in EXPERT_PARAMS}


# A compiled decoder layer (training.compile) calls it as it is: its expert bounds are read on the host (a graph
# break) and torch's grouped_mm has no float32 trace.
@torch.compiler.disable
def grouped_experts_forward(wrapper, layout: ExpertLayout, hidden_states, router_indices=None, routing_weights=None):
    """The forward `install_grouped_experts` gives the outer module at an experts path."""
    wrappers, experts = _wrapped(wrapper)
    factors = {name: _factors(wrappers, name) for name in EXPERT_PARAMS}
    return grouped_experts(experts, expert_sources(experts, layout), factors, hidden_states, router_indices,
                           routing_weights, layout)


def _check_gate(experts: nn.Module, layout: ExpertLayout) -> None:
    from transformers.activations import SiLUActivation

    if layout.activation == "silu" and not isinstance(getattr(experts, "act_fn", None), (nn.SiLU, SiLUActivation)):
        raise UserError(f"the grouped expert LoRA computes {layout.experts_class} with a silu gate, this model's "
                        f"hidden_act is {type(getattr(experts, 'act_fn', None)).__name__}; use --set lora.experts=peft")


def install_grouped_experts(model: nn.Module) -> int:
    """Route every experts module of a PEFT model whose family declares an `ExpertLayout` (gpt-oss, Qwen3-MoE)
    through `grouped_experts_forward`; returns how many. The outermost module at each experts path gets the
    forward (a ParamWrapper, or the experts module itself when lora.target_parameters leaves the experts out)."""
    count = 0
    for name, module in model.named_modules():
        if name.endswith(".mlp.experts"):
            _, experts = _wrapped(module)
            layout = layout_of(experts)
            if layout is not None:
                _check_gate(experts, layout)
                module.forward = functools.partial(grouped_experts_forward, module, layout)
                count += 1
    return count
