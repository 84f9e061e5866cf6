"""`ftcli merge-lora` streams: one unit (a decoder layer or a root module) of base weights resident at a time,
shards written as they fill, and `--format mxfp4` re-quantizes the merged experts with ftcli.model.mxfp4's quantizer."""

from __future__ import annotations

import json

import pytest
import torch



def _tensors(folder):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def merges(lora_run, tmp_path_factory):  # noqa: F811
    from ftcli.artifacts.merge import merge_lora

    run, _ = lora_run
    root = tmp_path_factory.mktemp("stream")
    plain = merge_lora(run, output=root / "plain", dtype="bfloat16")
    quantized = merge_lora(run, output=root / "mxfp4", dtype="bfloat16", fmt="mxfp4")
    return plain, quantized


def test_one_unit_of_base_weights_resident_at_a_time(merges):
    plain, _ = merges
    report = json.loads((plain / "merge.json").read_text())
    tensors = _tensors(plain)
    layer0 = sum(t.numel() * t.element_size() for n, t in tensors.items() if n.startswith("model.layers.0."))
    embed = tensors["model.embed_tokens.weight"]
    largest = max(layer0, embed.numel() * embed.element_size())
    assert report["passed"] and report["format"] == "plain"
    assert report["max_resident_bytes"] == report["largest_unit_bytes"] == largest
    assert sum(t.numel() * t.element_size() for t in tensors.values()) > 2.5 * largest  # the model is more than that


def test_shards_are_written_as_they_fill_and_load_like_one_file(lora_run, merges, tmp_path, monkeypatch):  # noqa: F811
    from transformers import AutoModelForCausalLM

    from ftcli.artifacts import merge

    run, _ = lora_run
    monkeypatch.setattr(merge, "MAX_SHARD_SIZE", "200KB")
    out = merge.merge_lora(run, output=tmp_path / "sharded", dtype="bfloat16")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted({*index["weight_map"].values()})
    tag = files[0][len("model-"):-len("-00001.safetensors")]  # written at their final names, never renamed
    assert len(files) > 3 and files == [f"model-{tag}-{i:05d}.safetensors" for i in range(1, len(files) + 1)]
    assert json.loads((out / "merge.json").read_text())["largest_shard_bytes"] <= 200_000 + 2 * 128 * 4 * 128 * 2
    one, many = _tensors(merges[0]), _tensors(out)
    assert one.keys() == many.keys() and all(torch.equal(one[k], many[k]) for k in one)
    ids = torch.randint(0, 700, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(merges[0], dtype=torch.bfloat16)(input_ids=ids).logits
        b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)(input_ids=ids).logits
    assert torch.equal(a, b)


def test_mxfp4_merge_is_the_bf16_merge_requantized_bit_for_bit(merges):
    from ftcli.model import mxfp4

    plain, quantized = merges
    dense, packed = _tensors(plain), _tensors(quantized)
    experts = sorted(n for n in dense if mxfp4.expert_param_name(n))
    assert len(experts) == 4  # gate_up_proj and down_proj of 2 layers
    assert set(packed) == (set(dense) - set(experts)) | {f"{n}_{k}" for n in experts for k in ("blocks", "scales")}
    for name in set(dense) - set(experts):
        assert torch.equal(dense[name], packed[name]), name
    for name in experts:
        blocks, scales = mxfp4.quantize_mxfp4(dense[name])
        assert torch.equal(packed[f"{name}_blocks"], blocks) and torch.equal(packed[f"{name}_scales"], scales)
    config = json.loads((quantized / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "mxfp4",
                                             "modules_to_not_convert": mxfp4.MODULES_TO_NOT_CONVERT}
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())


def test_mxfp4_round_trip_error_is_the_e2m1_grid_error(merges):
    """Every re-quantized expert weight dequantizes to the e2m1 grid point (x its group's power-of-two scale)
    nearest to the bf16 merged value, clamped at +-6 x scale: the format's own error, nothing more."""
    from ftcli.model import mxfp4

    plain, quantized = merges
    dense, packed = _tensors(plain), _tensors(quantized)
    report = json.loads((quantized / "merge.json").read_text())
    sq_err = sq_w = max_err = 0.0
    grid = torch.tensor(mxfp4.E2M1_VALUES[:8])
    for name in (n for n in dense if mxfp4.expert_param_name(n)):
        w = dense[name].float()
        back = mxfp4.dequantize_mxfp4(packed[f"{name}_blocks"], packed[f"{name}_scales"], dtype=torch.float32)
        scale = torch.exp2(packed[f"{name}_scales"].float() - 127).repeat_interleave(32, -1).transpose(1, 2)
        nearest = (w.abs().unsqueeze(-1) / scale.unsqueeze(-1) - grid).abs().min(-1).values * scale
        err = (back - w).abs()
        assert torch.allclose(err, nearest, rtol=0, atol=1e-6 * float(w.abs().max())), name
        sq_err, sq_w = sq_err + err.square().sum().item(), sq_w + w.square().sum().item()
        max_err = max(max_err, err.max().item())
    print(f"MXFP4 round trip of the merged experts: relative RMS error {(sq_err / sq_w) ** 0.5:.4f}, "
          f"max abs error {max_err:.3g}")
    assert report["mxfp4"]["relative_rms_error"] == pytest.approx((sq_err / sq_w) ** 0.5, rel=1e-4)
    assert report["mxfp4"]["max_abs_error"] == pytest.approx(max_err, rel=1e-6)


def test_mxfp4_merge_loads_in_transformers_with_the_dequantized_experts(merges):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from ftcli.model import mxfp4

    _, quantized = merges
    model = AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.bfloat16,
                                                 quantization_config=Mxfp4Config(dequantize=True))
    packed = _tensors(quantized)
    got = model.model.layers[1].mlp.experts.down_proj
    want = mxfp4.dequantize_mxfp4(packed["model.layers.1.mlp.experts.down_proj_blocks"],
                                  packed["model.layers.1.mlp.experts.down_proj_scales"], dtype=torch.bfloat16)
    assert torch.equal(got, want)


def test_mxfp4_format_needs_a_gpt_oss_base_and_a_known_format(lora_run, tmp_path):  # noqa: F811
    from ftcli.config.errors import UserError
    from ftcli.artifacts.merge import merge_lora

    run, _ = lora_run
    with pytest.raises(UserError, match="--format gguf: use plain or mxfp4"):
        merge_lora(run, output=tmp_path / "x", fmt="gguf")
    assert not (tmp_path / "x").exists()
