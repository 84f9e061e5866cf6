"""training.precision.fp8 (ftcli.features.float8): which linears get float8 GEMMs on the shipped 27B shape, and the
recipe rules. The end-to-end run (losses vs the fp32 run, checkpoint names) is in test_train_full.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ftcli.config.errors import UserError

REPO = Path(__file__).resolve().parents[3]


def test_fp8_takes_the_27b_layers_big_linears_only():
    """Qwen3.8-27B's shapes (4 of its 64 layers, meta device): every decoder linear but the gated-delta
    layers' 5120 -> 48 head projections; the LM head (5120 -> 248320) stays bf16."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from ftcli.features.float8 import convert_to_fp8, fp8_linears

    raw = json.loads((REPO / "benchmarks" / "configs" / "qwen3_8-27b-text.json").read_text())
    raw.update(num_hidden_layers=4, layer_types=raw["layer_types"][:4])
    cfg = Qwen3_5TextConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    chosen = convert_to_fp8(model, list(model.model.layers), cfg.hidden_size)
    assert chosen == fp8_linears(model)
    by_layer = {i: sorted(n.split(".", 3)[3] for n in chosen if n.startswith(f"model.layers.{i}.")) for i in range(4)}
    gated_delta = ["linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj",
                   "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj"]
    assert by_layer[0] == by_layer[1] == by_layer[2] == gated_delta
    assert by_layer[3] == ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj",
                           "self_attn.q_proj", "self_attn.v_proj"]
    assert type(model.lm_head) is torch.nn.Linear and type(model.model.layers[0].linear_attn.in_proj_a) is torch.nn.Linear
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(cfg)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]


def test_fp8_is_full_sfts_and_a_lora_recipe_that_sets_it_is_refused():
    """fp8 is full SFT's: a LoRA recipe that sets it (qwen-b300 switched to LoRA, say) is a one-line error naming
    the method it belongs to (tests/unit/train/lora/test_lora_config.py has the other full-SFT keys)."""
    from ftcli.config.recipe import load_recipe

    with pytest.raises(UserError, match=r"^invalid recipe 'tiny-gpt-oss-cpu': training.precision belongs to "
                                        r"training.method=full \(this recipe's is lora\): leave it out"):
        load_recipe("tiny-gpt-oss-cpu", ["training.precision.fp8=true"])
    with pytest.raises(UserError, match=r"training.precision belongs to training.method=full"):
        load_recipe("qwen-b300", ["training.method=lora"])
    assert load_recipe("tiny-qwen-cpu", ["training.precision.fp8=true"]).training.precision.fp8 is True
    from ftcli import features

    with pytest.raises(UserError, match=r"training.precision.fp8 needs packed blocks whose tokens per micro-batch "
                                        r"\(block_len x per_device_batch = 1000\) are a multiple of 16"):
        features.load_recipe("tiny-qwen-cpu", ["training.precision.fp8=true", "data.packing.block_len=1000"])


def test_fp8_refuses_a_gpu_older_than_ada(monkeypatch):
    from ftcli.features.float8 import check_fp8_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UserError) as err:
        check_fp8_device(torch.device("cuda", 0))
    assert str(err.value) == ("training.precision.fp8 needs a GPU of compute capability >= 8.9 (Ada, Hopper, "
                              "Blackwell); this one is NVIDIA A100-SXM4-80GB (8.0)")
    check_fp8_device(torch.device("cpu"))  # emulated on CPU: allowed (tests)


def test_fp8_recipe_picks_torchaos_scaling_granularity():
    """training.precision.fp8_recipe: tensorwise (the default) is torchao's default config, rowwise its rowwise
    recipe (axiswise scales on every operand); anything else is refused by the schema in one line."""
    from torchao.float8.config import ScalingGranularity

    from ftcli.config.recipe import load_recipe
    from ftcli.features.float8 import fp8_config

    assert load_recipe("tiny-qwen-cpu").training.precision.fp8_recipe == "tensorwise"
    rowwise = load_recipe("tiny-qwen-cpu", ["training.precision.fp8=true", "training.precision.fp8_recipe=rowwise"])
    assert rowwise.training.precision.fp8_recipe == "rowwise"
    granularity = lambda c: {c.cast_config_input.scaling_granularity, c.cast_config_weight.scaling_granularity,  # noqa: E731
                             c.cast_config_grad_output.scaling_granularity}
    assert granularity(fp8_config("tensorwise")) == {ScalingGranularity.TENSORWISE}
    assert granularity(fp8_config("rowwise")) == {ScalingGranularity.AXISWISE}
    with pytest.raises(Exception, match="fp8_recipe"):
        load_recipe("tiny-qwen-cpu", ["training.precision.fp8_recipe=blockwise"])
