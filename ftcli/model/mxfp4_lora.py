"""LoRA over a gpt-oss base whose expert weights stay in MXFP4 (`model.quantization: mxfp4`).

The base is frozen, so nothing forces its experts (19.1B of gpt-oss-20b's 20.9B parameters, 4.25 bits each on
disk) to live in bf16. Here they stay as the checkpoint's uint8 blocks and scales (`ftcli.model.mxfp4` layout)
and are dequantized just in time, a group of experts at a time (`Mxfp4Experts`, DEQUANT_CHUNK_BYTES of bf16),
inside the grouped expert LoRA of `ftcli.model.moe_lora` (the same unmerged path as over a bf16 base):

    forward   y  = x · deq(W) + s · (x · A) · B          (the LoRA delta unmerged: W + BA never exists)
    backward  gx = gy · deq(W)ᵀ + s · (gy · Bᵀ) · Aᵀ     (deq(W) made again, not kept from the forward)
              gA = s · xᵀ · (gy · Bᵀ),   gB = s · (x · A)ᵀ · gy,   no gradient for the base

so the peak holds one group of experts' weights in the compute dtype next to the packed base. Attention,
embeddings, router, norms and expert biases load in the model dtype as usual.

PEFT stays in charge of the adapter: `lora.target_parameters` wraps `mlp.experts.gate_up_proj` / `down_proj` in
its ParamWrapper as for a bf16 base, so the adapter's names, shapes, init and scaling, its save and load, and
merge-lora are PEFT's. Two things differ:
- the experts module holds a placeholder for each expert weight: a zero-stride (expanded) bf16 scalar with the
  parameter's `[E, in, out]` shape, frozen, one element of storage; PEFT reads its shape, dtype and device, and
  the MXFP4 data sit beside it as buffers `{name}_blocks` `[E, out, G, 16]` and `{name}_scales` `[E, out, G]`;
- the outer ParamWrapper's `forward` is replaced (`ftcli.model.moe_lora.install_grouped_experts`), which reads
  W from the buffers through `Mxfp4Experts`.
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


def dequantize_experts(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Experts: blocks `[n, out, G, 16]`, scales `[n, out, G]` -> their weights as rows of output features,
    `[n, out, in]` in `dtype`, on the blocks' device (the transpose of the parameter's `[n, in, out]`; exact: an
    e2m1 value times a power of two is representable in bf16)."""
    return _decode(blocks, scales, _byte_table(dtype, blocks.device))


def _decode(blocks: torch.Tensor, scales: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    values = table[blocks.int()]  # [n, out, G, 16, 2]: element 2j, then 2j+1
    scale = torch.exp2(scales.to(torch.float32) - SCALE_BIAS).to(table.dtype)  # 2**(s - 127): exact in bf16, fp32
    values = values.view(*scales.shape, GROUP) * scale[..., None]
    return values.view(*blocks.shape[:2], -1)


@functools.cache
def _triton_present() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def fuses(t: torch.Tensor) -> bool:
    """Whether the elementwise steps around the expert GEMMs (the MXFP4 decode, ftcli.model.moe_lora's SwiGLU) run
    as torch.compile'd fused kernels for `t`: on CUDA with Triton (inductor's GPU backend); else eagerly, the same
    math."""
    return t.is_cuda and _triton_present()


@functools.cache
def _compiled_decode():
    """`_decode` as one fused kernel (torch.compile; shapes static: one graph per chunk shape): it reads the
    bytes and writes the weights once, where eager runs an int32 copy, a gather and a multiply over the whole
    chunk (on an H200, 20b width: ~60% of a kept-MXFP4 LoRA step). The same products, so the same bits."""
    return torch.compile(_decode, dynamic=False, fullgraph=True)


def dequantize_expert(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One expert: blocks `[out, G, 16]`, scales `[out, G]` -> `[out, in]` (`dequantize_experts` of one)."""
    return dequantize_experts(blocks[None], scales[None], dtype)[0]


# one group of experts dequantized at a time holds about DEQUANT_COPIES times this many bytes of its weights in
# the compute dtype (the byte lookup's int32 index, the looked-up values, their scaled product); the same
# figure is the memory model's (ftcli.estimate.memory.DEQUANT_CHUNK_BYTES)
DEQUANT_CHUNK_BYTES = 512 << 20


class Mxfp4Experts:
    """W of a kept-MXFP4 expert projection for `ftcli.model.moe_lora.GroupedLoraMatmul`: `weight(lo, hi)`
    dequantizes experts lo..hi-1 into a fresh `[hi-lo, in, out]` tensor (a transposed view of rows of output
    features), at most `chunk` experts (DEQUANT_CHUNK_BYTES of weights) at a time."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        self.blocks, self.scales, self.dtype = blocks, scales, dtype
        self.num_experts, self.out_features = blocks.shape[0], blocks.shape[1]
        per_expert = blocks[0].numel() * 2 * torch.finfo(dtype).bits // 8
        self.chunk = max(1, min(self.num_experts, DEQUANT_CHUNK_BYTES // per_expert))

    @classmethod
    def of(cls, experts: nn.Module, name: str) -> "Mxfp4Experts":
        return cls(getattr(experts, f"{name}_blocks"), getattr(experts, f"{name}_scales"), getattr(experts, name).dtype)

    def weight(self, lo: int, hi: int) -> torch.Tensor:
        decode = _compiled_decode() if fuses(self.blocks) else _decode
        return decode(self.blocks[lo:hi], self.scales[lo:hi], _byte_table(self.dtype, self.blocks.device)
                      ).transpose(-2, -1)


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


def rebuild_meta_buffers(model: nn.Module, device) -> None:
    """After a meta build and an `assign=True` load: rebuild the modules whose non-persistent buffers (rotary
    inv_freq) are still on meta from their config, on `device`; nothing may be left on meta."""
    for name, module in model.named_modules():
        if any(b.is_meta for b in module.buffers(recurse=False)) and hasattr(module, "config"):
            parent, _, child = name.rpartition(".")
            with torch.device(device):
                setattr(model.get_submodule(parent), child, type(module)(module.config))
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not leftover, f"still on meta: {leftover[:3]}"


def load_kept_mxfp4(cls, path: str | Path, config, *, dtype: torch.dtype, device, attn: str | None) -> nn.Module:
    """A gpt-oss MXFP4 checkpoint (a local directory) with its experts kept in MXFP4 and everything else in
    `dtype`, on `device`; tensor by tensor, so no expert ever exists in `dtype` whole."""
    from safetensors import safe_open

    path = Path(path)
    quant = getattr(config, "quantization_config", None) or {}
    quant_method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if quant_method != "mxfp4":
        raise UserError(f"model.quantization=mxfp4 keeps an MXFP4 checkpoint's experts; {path} is not one "
                        f"(quantization_config: {quant_method or 'none'}); use model.quantization=none")
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
    rebuild_meta_buffers(model, device)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model.requires_grad_(True)
    for module in model.modules():
        for name in EXPERT_PARAMS:
            if hasattr(module, f"{name}_blocks"):
                getattr(module, name).requires_grad_(False)
    return model.eval()


# ------------------------------------------------------------------------------------------ the model
def kept_mxfp4_bytes(model: nn.Module) -> int:
    """Bytes of the MXFP4 buffers (blocks + scales) the model holds."""
    return sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith(("_blocks", "_scales")))


def checkpoint_is_mxfp4(path: str | Path) -> bool:
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    quant = json.loads(config.read_text()).get("quantization_config") or {}
    return quant.get("quant_method") == "mxfp4"
