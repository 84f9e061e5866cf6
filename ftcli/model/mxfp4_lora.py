"""LoRA over a gpt-oss base whose expert weights stay in MXFP4 (`model.quantization: mxfp4`).

The base is frozen, so nothing forces its experts (19.1B of gpt-oss-20b's 20.9B parameters, 4.25 bits each on
disk) to live in bf16. Here they stay as the checkpoint's uint8 blocks and scales (`ftcli.model.mxfp4` layout)
and are dequantized just in time, one expert at a time, inside `Mxfp4LoraMatmul`:

    forward   y  = x · deq(W) + s · (x · A) · B          (the LoRA delta unmerged: W + BA never exists)
    backward  gx = gy · deq(W)ᵀ + s · (gy · Bᵀ) · Aᵀ     (deq(W) made again, not kept from the forward)
              gA = s · xᵀ · (gy · Bᵀ),   gB = s · (x · A)ᵀ · gy,   no gradient for the base

so the peak holds one expert's weight in the compute dtype next to the packed base. Attention, embeddings,
router, norms and expert biases load in the model dtype as usual.

PEFT stays in charge of the adapter: `lora.target_parameters` wraps `mlp.experts.gate_up_proj` / `down_proj` in
its ParamWrapper as for a bf16 base, so the adapter's names, shapes, init and scaling, its save and load, and
merge-lora are PEFT's. Two things differ:
- the experts module holds a placeholder for each expert weight: a zero-stride (expanded) bf16 scalar with the
  parameter's `[E, in, out]` shape, frozen, one element of storage; PEFT reads its shape, dtype and device, and
  the MXFP4 data sit beside it as buffers `{name}_blocks` `[E, out, G, 16]` and `{name}_scales` `[E, out, G]`;
- the outer ParamWrapper's `forward` is replaced (`install_mxfp4_experts`) by gpt-oss's expert loop with
  `Mxfp4LoraMatmul` per projection, taking the factors from PEFT's public `get_delta_factors` (the exact
  layout PEFT folds into the weight: delta[e] = scaling · lhs[e] @ rhs[e], `[in, r] @ [r, out]`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from torch import nn

from ftcli.config.errors import UserError
from ftcli.model.mxfp4 import E2M1_VALUES, EXPERT_PARAMS, GROUP, SCALE_BIAS


# ------------------------------------------------------------------------------------------ dequantize
@functools.cache
def _byte_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`[256, 2]`: the two e2m1 values of every byte (low nibble first), so one lookup decodes a block."""
    table = torch.tensor(E2M1_VALUES, dtype=dtype)
    codes = torch.arange(256)
    return torch.stack((table[codes & 0x0F], table[codes >> 4]), dim=-1).to(device)


def dequantize_expert(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One expert: blocks `[out, G, 16]`, scales `[out, G]` -> its weight as rows of output features, `[out, in]`
    in `dtype`, on the blocks' device (the transpose of the parameter's `[in, out]`; exact: an e2m1 value times
    a power of two is representable in bf16)."""
    values = _byte_table(dtype, blocks.device)[blocks.int()]  # [out, G, 16, 2]: element 2j, then 2j+1
    scale = torch.exp2(scales.to(torch.float32) - SCALE_BIAS).to(dtype)  # 2**(s - 127): exact in bf16 and fp32
    values = values.reshape(*scales.shape, GROUP) * scale[..., None]
    return values.reshape(blocks.shape[0], -1)


class Mxfp4LoraMatmul(torch.autograd.Function):
    """`x [T, in] -> [T, out]` through one MXFP4 expert plus its unmerged LoRA (`lhs [in, r]`, `rhs [r, out]`,
    both None for no adapter); see the module docstring for the algebra."""

    @staticmethod
    def forward(ctx, x, blocks, scales, lhs, rhs, scaling: float):
        weight = dequantize_expert(blocks, scales, x.dtype)  # [out, in], freed when forward returns
        y = x @ weight.t()
        xa = None
        if lhs is not None:
            xa = x @ lhs
            y = y + scaling * (xa @ rhs)
        ctx.save_for_backward(x, blocks, scales, lhs, rhs, xa)
        ctx.scaling = scaling
        return y

    @staticmethod
    def backward(ctx, gy):
        x, blocks, scales, lhs, rhs, xa = ctx.saved_tensors
        s = ctx.scaling
        gx = g_lhs = g_rhs = None
        gy_b = gy @ rhs.t() if lhs is not None else None  # [T, r]
        if ctx.needs_input_grad[0]:
            gx = gy @ dequantize_expert(blocks, scales, gy.dtype)
            if gy_b is not None:
                gx = gx + s * (gy_b @ lhs.t())
        if ctx.needs_input_grad[3]:
            g_lhs = s * (x.t() @ gy_b)
        if ctx.needs_input_grad[4]:
            g_rhs = s * (xa.t() @ gy)
        return gx, None, None, g_lhs, g_rhs, None


# ------------------------------------------------------------------------------ the experts module
def placeholder(shape: tuple[int, ...], dtype: torch.dtype, device) -> nn.Parameter:
    """A frozen parameter of `shape` backed by one element (zero strides): what PEFT reads of a kept-MXFP4
    expert weight (shape, dtype, device). Reading its values gives zeros; nothing in this path does."""
    return nn.Parameter(torch.zeros((), dtype=dtype, device=device).expand(*shape), requires_grad=False)


def is_placeholder(param: torch.Tensor) -> bool:
    """Whether `param` is a `placeholder` (every stride zero: one element of storage behind the whole shape)."""
    return param.dim() > 0 and all(stride == 0 for stride in param.stride())


def keep_experts_mxfp4(experts: nn.Module, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device) -> None:
    """Make `experts` (a GptOssExperts) hold its expert weights as MXFP4: `tensors` maps `{name}_blocks` /
    `{name}_scales` to the checkpoint's uint8 tensors for each of gate_up_proj, down_proj."""
    for name in EXPERT_PARAMS:
        blocks, scales = tensors[f"{name}_blocks"].to(device), tensors[f"{name}_scales"].to(device)
        num_experts, fan_out, groups = scales.shape
        setattr(experts, name, placeholder((num_experts, groups * GROUP, fan_out), dtype, device))
        experts.register_buffer(f"{name}_blocks", blocks)
        experts.register_buffer(f"{name}_scales", scales)


def load_kept_mxfp4(cls, path: str | Path, config, *, dtype: torch.dtype, device, attn: str | None) -> nn.Module:
    """A gpt-oss MXFP4 checkpoint (a local directory) with its experts kept in MXFP4 and everything else in
    `dtype`, on `device`; tensor by tensor, so no expert ever exists in `dtype` whole."""
    from safetensors import safe_open

    path = Path(path)
    quant = getattr(config, "quantization_config", None) or {}
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if method != "mxfp4":
        raise UserError(f"model.quantization=mxfp4 keeps an MXFP4 checkpoint's experts; {path} is not one "
                        f"(quantization_config: {method or 'none'}); use model.quantization=none")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"model.quantization=mxfp4 reads local safetensors; none in {path}")
    config = config.__class__.from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    config.use_cache = False
    kwargs = {"dtype": dtype, **({"attn_implementation": attn} if attn else {})}
    with torch.device("meta"):
        model = cls.from_config(config, **kwargs)
    state, experts_tensors = {}, {}
    for file in files:
        with safe_open(str(file), "pt", device=str(device)) as f:
            for key in f.keys():
                stem, _, field = key.rpartition("_")
                if field in ("blocks", "scales") and stem.rsplit(".", 1)[-1] in EXPERT_PARAMS:
                    module_name, _, param = stem.rpartition(".")
                    experts_tensors.setdefault(module_name, {})[f"{param}_{field}"] = f.get_tensor(key)
                else:
                    t = f.get_tensor(key)
                    state[key] = t.to(dtype) if t.is_floating_point() else t
    for module_name, tensors in experts_tensors.items():
        keep_experts_mxfp4(model.get_submodule(module_name), tensors, dtype, device)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    kept = {f"{m}.{p}{suffix}" for m in experts_tensors for p in EXPERT_PARAMS for suffix in ("", "_blocks", "_scales")}
    missing = [m for m in missing if m not in kept]
    if missing or unexpected:
        raise UserError(f"{path}: checkpoint does not match its config (missing {missing[:3]}, "
                        f"unexpected {unexpected[:3]})")
    for name, module in model.named_modules():  # non-persistent buffers (rotary inv_freq) are still on meta
        if any(b.is_meta for b in module.buffers(recurse=False)) and hasattr(module, "config"):
            parent, _, child = name.rpartition(".")
            with torch.device(device):
                setattr(model.get_submodule(parent), child, type(module)(module.config))
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not leftover, f"still on meta after loading: {leftover[:3]}"
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model.requires_grad_(True)
    for module in model.modules():
        for name in EXPERT_PARAMS:
            if hasattr(module, f"{name}_blocks"):
                getattr(module, name).requires_grad_(False)
    return model.eval()


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
        raise UserError("model.quantization=mxfp4 trains one unmerged LoRA adapter at a time")
    return wrapper.get_delta_factors(adapters[0])


def _swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU over interleaved gate/up columns (GptOssExperts' gate, as transformers 5.x has it)."""
    gate, up = gate_up[..., ::2].clamp(max=limit), gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def mxfp4_experts_forward(wrapper, hidden_states, router_indices=None, routing_weights=None):
    """GptOssExperts.forward (transformers 5.x: loop over the experts hit, gate/up interleaved, clamped SwiGLU,
    routing-weighted index_add) with each projection through `Mxfp4LoraMatmul`."""
    wrappers, experts = _wrapped(wrapper)
    gu_lhs, gu_rhs, gu_s = _factors(wrappers, "gate_up_proj")
    dn_lhs, dn_rhs, dn_s = _factors(wrappers, "down_proj")
    dtype = experts.gate_up_proj.dtype
    next_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(router_indices, num_classes=experts.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        e = expert_idx[0]
        top_k_pos, token_idx = torch.where(expert_mask[e])
        x = hidden_states[token_idx].to(dtype)
        gate_up = Mxfp4LoraMatmul.apply(x, experts.gate_up_proj_blocks[e], experts.gate_up_proj_scales[e],
                                        None if gu_lhs is None else gu_lhs[e], None if gu_rhs is None else gu_rhs[e],
                                        gu_s) + experts.gate_up_proj_bias[e]
        gated = _swiglu(gate_up, experts.alpha, experts.limit)
        out = Mxfp4LoraMatmul.apply(gated, experts.down_proj_blocks[e], experts.down_proj_scales[e],
                                    None if dn_lhs is None else dn_lhs[e], None if dn_rhs is None else dn_rhs[e],
                                    dn_s) + experts.down_proj_bias[e]
        weighted = out * routing_weights[token_idx, top_k_pos, None]
        next_states.index_add_(0, token_idx, weighted.to(hidden_states.dtype))
    return next_states


def install_mxfp4_experts(model: nn.Module) -> int:
    """Route every kept-MXFP4 experts module of a PEFT model through `mxfp4_experts_forward`; returns how many.
    The outermost module at each experts path gets the forward (a ParamWrapper, or the experts module itself
    when lora.target_parameters leaves the experts out)."""
    count = 0
    for name, module in model.named_modules():
        if name.endswith(".mlp.experts"):
            _, experts = _wrapped(module)
            if hasattr(experts, "gate_up_proj_blocks"):
                module.forward = functools.partial(mxfp4_experts_forward, module)
                count += 1
    return count


def kept_mxfp4_bytes(model: nn.Module) -> int:
    """Bytes of the MXFP4 buffers (blocks + scales) the model holds."""
    return sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith(("_blocks", "_scales")))


def checkpoint_is_mxfp4(path: str | Path) -> bool:
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    quant = json.loads(config.read_text()).get("quantization_config") or {}
    return quant.get("quant_method") == "mxfp4"
