"""MXFP4: write a gpt-oss model in the on-disk format of openai/gpt-oss-*, and read it back.

gpt-oss ships its expert weights (19.1B of gpt-oss-20b's 20.9B parameters) in MXFP4: blocks of 32
values share one power-of-two scale, and each value is a 4-bit e2m1 float. transformers loads such a
checkpoint with `Mxfp4Config(dequantize=True)` (pure torch, so it runs on CPU). This module writes
that format, so tests and benchmarks can build a small (or real-shape, random) MXFP4 checkpoint
without hub access, and it holds an independent dequantizer to check transformers' loader against.

One expert parameter, as stored (the parameter is `[E, in, out]`; rows on disk are output features):

    param  gate_up_proj [E, in, out]  --transpose-->  [E, out, in]  --groups of 32 along in-->
    {name}_blocks  uint8 [E, out, in/32, 16]   byte j of a group: element 2j (low nibble), 2j+1 (high)
    {name}_scales  uint8 [E, out, in/32]       value = E2M1[nibble] * 2 ** (scale - 127)

Every other tensor (attention, router, embeddings, norms, expert biases) keeps its normal name and
the model's dtype. config.json gets `quantization_config = {"quant_method": "mxfp4",
"modules_to_not_convert": [...]}` like the published checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per shared scale
SCALE_BIAS = 127
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def quantize_mxfp4(param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[E, in, out]` expert parameter -> (blocks uint8 `[E, out, in/32, 16]`, scales uint8 `[E, out, in/32]`).

    Scale per group of 32: the largest power of two with `amax / 2**s <= 6` after rounding is what OCP MX
    uses, `s = floor(log2(amax)) - 2` (6 = 1.5 * 2**2 is the largest e2m1 value); each value then rounds
    to the nearest e2m1 number (ties to the smaller magnitude), clamped to +-6.
    """
    num_experts, fan_in, fan_out = param.shape
    if fan_in % GROUP:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of {GROUP}, got {fan_in}")
    if num_experts > 1:  # one expert at a time: the nearest-code search holds 8 fp32 copies of what it quantizes
        parts = [quantize_mxfp4(param[e : e + 1]) for e in range(num_experts)]
        return torch.cat([b for b, _ in parts]), torch.cat([s for _, s in parts])
    w = param.detach().to(torch.float32).transpose(1, 2).reshape(num_experts, fan_out, fan_in // GROUP, GROUP)
    amax = w.abs().amax(dim=-1, keepdim=True)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=torch.finfo(torch.float32).tiny))) - 2, 0.0)
    exp = exp.clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = w / torch.exp2(exp)
    magnitudes = torch.tensor(E2M1_VALUES[:8], device=w.device)
    # nearest magnitude: index of the smallest |scaled| - m over the 8 non-negative codes
    codes = (scaled.abs().clamp(max=6.0).unsqueeze(-1) - magnitudes).abs().argmin(dim=-1).to(torch.uint8)
    codes |= (scaled < 0).to(torch.uint8) << 3
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exp.squeeze(-1) + SCALE_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(blocks `[E, out, G, 16]`, scales `[E, out, G]`) -> parameter `[E, in=G*32, out]` in `dtype`."""
    if blocks.shape[0] > 1:  # one expert at a time: the lookup and scaling hold several fp32 copies of what they make
        num_experts, fan_out, groups = blocks.shape[:3]
        out = torch.empty(num_experts, groups * GROUP, fan_out, dtype=dtype)
        for e in range(num_experts):
            out[e] = dequantize_mxfp4(blocks[e : e + 1], scales[e : e + 1], dtype)[0]
        return out
    table = torch.tensor(E2M1_VALUES, dtype=dtype)
    lo, hi = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]
    values = torch.stack((lo, hi), dim=-1).flatten(-2)  # [E, out, G, 32], element 2j then 2j+1
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - SCALE_BIAS)
    num_experts, fan_out = blocks.shape[:2]
    return values.reshape(num_experts, fan_out, -1).transpose(1, 2).contiguous()


def expert_param_name(name: str) -> bool:
    """Whether the state-dict entry `name` is stored in MXFP4 by the gpt-oss checkpoints."""
    return ".mlp.experts." in name and name.rsplit(".", 1)[-1] in EXPERT_PARAMS


def mxfp4_tensors(name: str, tensor: torch.Tensor):
    """(name, tensor) in the on-disk layout: an expert weight as `_blocks`/`_scales`, anything else as is."""
    if expert_param_name(name):
        blocks, scales = quantize_mxfp4(tensor)
        return [(f"{name}_blocks", blocks), (f"{name}_scales", scales)]
    return [(name, tensor.detach().contiguous())]


def mxfp4_config(config: dict) -> dict:
    """config.json of an MXFP4 checkpoint: the published `quantization_config`."""
    return {**config, "quantization_config": {"quant_method": "mxfp4",
                                              "modules_to_not_convert": MODULES_TO_NOT_CONVERT}}


class ShardWriter:
    """Safetensors shards written as they fill (host memory: at most one shard of pending tensors), then
    named like save_pretrained's: model.safetensors, or model-0000i-of-0000n.safetensors + the index."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = 2 << 30, shard_name=None) -> None:
        """`shard_name(i)`: write shard i (1, 2, ...) under that final name and leave the index to the caller
        (no rename at `finish`: ftcli merge-lora's in-place output); unset: save_pretrained's names."""
        self.out, self.max_shard_bytes, self.shard_name = Path(out_dir), max_shard_bytes, shard_name
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[str, list[str]]] = []
        self.largest_shard_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        number = len(self.written) + 1
        fname = self.shard_name(number) if self.shard_name else f"model-{number:05d}.safetensors"
        try:
            save_file(self.pending, str(self.out / fname), metadata={"format": "pt"})
        except BaseException:
            (self.out / fname).unlink(missing_ok=True)  # a full disk: no partial shard left
            raise
        self.written.append((fname, list(self.pending)))
        self.largest_shard_bytes = max(self.largest_shard_bytes, self.pending_bytes)
        self.pending, self.pending_bytes = {}, 0

    def discard(self) -> None:
        """Remove the shards written so far (a merge whose check failed leaves nothing behind)."""
        for fname, _ in self.written:
            (self.out / fname).unlink(missing_ok=True)
        self.written, self.pending, self.pending_bytes = [], {}, 0

    def finish(self) -> dict[str, str]:
        """Flush, name the shards, write the index; returns the weight map (tensor name -> file)."""
        self._flush()
        if self.shard_name:
            return {n: fname for fname, names in self.written for n in names}
        weight_map = {}
        for i, (fname, names) in enumerate(self.written):
            final = f"model-{i + 1:05d}-of-{len(self.written):05d}.safetensors"
            (self.out / fname).rename(self.out / final)
            weight_map.update({n: final for n in names})
        if len(self.written) == 1:
            (self.out / weight_map[next(iter(weight_map))]).rename(self.out / "model.safetensors")
            return {n: "model.safetensors" for n in weight_map}
        total = sum((self.out / f).stat().st_size for f in set(weight_map.values()))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return weight_map


def mxfp4_state_dict(model: nn.Module):
    """Yield (name, tensor) in the on-disk layout: expert weights as `_blocks`/`_scales`, the rest as is."""
    for name, tensor in model.state_dict().items():
        yield from mxfp4_tensors(name, tensor)


def save_mxfp4(model: nn.Module, out_dir: str | Path, *, tokenizer=None, max_shard_bytes: int = 2 << 30) -> Path:
    """Write `model` (a GptOssForCausalLM) as an MXFP4 checkpoint loadable with `Mxfp4Config(dequantize=True)`.

    Tensors are quantized and written shard by shard, so host memory grows by at most one shard.
    """
    from ftcli.families import find_family

    model_type = getattr(model.config, "model_type", None)
    if not getattr(find_family(model_type), "mxfp4_experts", False):  # ftcli.families: gpt-oss
        raise ValueError(f"MXFP4 writer supports gpt-oss models, got {model_type!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out, max_shard_bytes)
    for name, tensor in mxfp4_state_dict(model):
        writer.add(name, tensor)
    writer.finish()
    model.config.save_pretrained(out)
    config_path = out / "config.json"
    config_path.write_text(json.dumps(mxfp4_config(json.loads(config_path.read_text())), indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
