"""MXFP4 writer: the on-disk format of openai/gpt-oss-*, read back by transformers' dequantizing loader."""

from __future__ import annotations

import json

import pytest
import torch

from _lora_common import tiny_model


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    from ftcli.model import mxfp4

    model = tiny_model(seed=0, dtype=torch.bfloat16)
    out = mxfp4.save_mxfp4(model, tmp_path_factory.mktemp("mxfp4") / "tiny-gpt-oss-mxfp4")
    return out, model


def test_layout_matches_gpt_oss_checkpoints(mxfp4_dir):
    from safetensors import safe_open

    path, model = mxfp4_dir
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
    }
    params = dict(model.named_parameters())
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for layer in range(model.config.num_hidden_layers):
            for proj in ("gate_up_proj", "down_proj"):
                name = f"model.layers.{layer}.mlp.experts.{proj}"
                experts, fan_in, fan_out = params[name].shape
                blocks, scales = f.get_tensor(f"{name}_blocks"), f.get_tensor(f"{name}_scales")
                assert blocks.dtype == scales.dtype == torch.uint8
                assert tuple(blocks.shape) == (experts, fan_out, fan_in // 32, 16)  # rows = output features
                assert tuple(scales.shape) == (experts, fan_out, fan_in // 32)
                assert name not in keys
                assert f.get_tensor(f"{name}_bias").dtype == torch.bfloat16  # biases keep their names
        assert "model.layers.0.self_attn.q_proj.weight" in keys


def test_transformers_dequantizes_exactly_like_ftcli(mxfp4_dir):
    """Mxfp4Config(dequantize=True) on CPU gives bit for bit what ftcli's own dequantizer gives, and
    every tensor that is not an expert weight comes back unchanged."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from ftcli.model import mxfp4

    path, model = mxfp4_dir
    loaded = AutoModelForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True),
                                                  dtype=torch.bfloat16)
    on_disk = load_file(str(path / "model.safetensors"))
    original = dict(model.named_parameters())
    n_experts = 0
    for name, param in loaded.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            ours = mxfp4.dequantize_mxfp4(on_disk[f"{name}_blocks"], on_disk[f"{name}_scales"], torch.bfloat16)
            assert torch.equal(param, ours), name
            # MXFP4 error bound: half a step of the e2m1 grid at the group's scale (<= 1 * 2**scale)
            err = (param.float() - original[name].float()).abs().max().item()
            assert err <= original[name].float().abs().max().item() / 4, (name, err)
            n_experts += 1
        else:
            assert torch.equal(param, original[name]), name
    assert n_experts == 2 * model.config.num_hidden_layers


def test_quantize_is_exact_on_representable_values():
    """Values already on the MXFP4 grid survive quantize -> dequantize bit for bit (nibble order, sign,
    scale bias and the transpose all round-trip)."""
    from ftcli.model import mxfp4

    g = torch.Generator().manual_seed(0)
    experts, fan_out, groups = 3, 8, 4
    codes = torch.randint(0, 16, (experts, fan_out, groups, 32), generator=g, dtype=torch.uint8)
    codes[codes == 8] = 0  # -0 reads back as +0
    codes[..., 0] = 7  # every group holds a +-6, so its scale is the one the writer picks
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = torch.randint(110, 140, (experts, fan_out, groups), generator=g, dtype=torch.uint8)
    values = mxfp4.dequantize_mxfp4(blocks, scales, torch.float32)
    assert values.shape == (experts, groups * 32, fan_out)
    assert values[0, 0, 0].item() == 6.0 * 2.0 ** (scales[0, 0, 0].item() - 127)
    assert values[0, 1, 0].item() == mxfp4.E2M1_VALUES[codes[0, 0, 0, 1].item()] * 2.0 ** (scales[0, 0, 0].item() - 127)
    blocks2, scales2 = mxfp4.quantize_mxfp4(values)
    assert torch.equal(blocks2, blocks) and torch.equal(scales2, scales)
