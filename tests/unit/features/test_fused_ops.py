"""training.fused_ops (ftcli.features.fused_ops) and training.compile=regions: which modules are swapped or compiled,
that the swap keeps every parameter, and that the swapped model computes what the eager one does.

liger-kernel's and fla's kernels are Triton (CUDA only). Here they are stood in for by plain torch versions
of what their functionals document (liger_rms_norm with offset and gemma casting, liger_swiglu, fla's
rms_norm_gated with a silu gate), so the CPU test checks the wiring: the offset, the eps, the argument
order, which modules are swapped. The kernels themselves are compared with transformers' modules at the 27B
width on the GPU (benchmarks/fused_ops_gpu.py, BENCHMARKS.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ftcli.config.errors import UserError
from ftcli.features.fused_ops import Kernels, check_fused_device, fuse_decoder_ops, fused_module_counts, load_kernels

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "ftcli" / "assets" / "tiny-qwen3_5.json"


def rms_norm(x, weight, eps, offset, casting_mode, in_place):
    assert (casting_mode, in_place) == ("gemma", False), "Qwen3.5 computes its norm in float32, out of place"
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.float())).to(x.dtype)


def gated_norm(x, gate, weight, bias, activation, eps):
    assert (bias, activation) == (None, "silu")
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float() * F.silu(gate.float())
    return y.to(x.dtype)


STAND_INS = Kernels(rms_norm=rms_norm, swiglu=lambda a, b: F.silu(a) * b, gated_norm=gated_norm)


def tiny_qwen(seed=0, **overrides):
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    raw = json.loads(TINY.read_text()) | overrides
    cfg = Qwen3_5TextConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # Qwen3.5 inits its norm weights to 0 (or 1): move them, so a wrong offset shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def fuse(model, ops=("rms_norm", "swiglu", "gated_norm")):
    from ftcli.model.build import decoder_layers, text_final_norm

    return fuse_decoder_ops(model, decoder_layers(model), ops, STAND_INS, final_norm=text_final_norm(model))


def loss_and_grads(model, ids):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_fused_model_computes_what_the_eager_model_does():
    """Same weights, same tokens: logits and every gradient of the fused model equal the eager model's
    (float32, to rounding), and the swap changed no parameter name or object."""
    eager, fused = tiny_qwen(), tiny_qwen()
    params_before = dict(fused.named_parameters())
    swapped = fuse(fused)
    assert dict(fused.named_parameters()).keys() == params_before.keys()
    assert all(p is params_before[n] for n, p in fused.named_parameters())
    assert list(fused.state_dict()) == list(eager.state_dict())
    ids = torch.randint(3, 1024, (2, 48), generator=torch.Generator().manual_seed(1))
    logits_e, grads_e = loss_and_grads(eager, ids)
    logits_f, grads_f = loss_and_grads(fused, ids)
    assert (logits_f - logits_e).abs().max().item() < 1e-5
    assert grads_f.keys() == grads_e.keys() and len(grads_e) == len(params_before)
    worst = max((grads_f[n] - grads_e[n]).abs().max().item() / (grads_e[n].abs().max().item() + 1e-12) for n in grads_e)
    assert worst < 1e-4
    # the tiny model: 3 gated-delta layers + 1 full-attention layer (q_norm and k_norm), and the final norm
    assert {op: len(names) for op, names in swapped.items()} == {"rms_norm": 2 * 4 + 2 + 1, "swiglu": 4,
                                                                 "gated_norm": 3}
    assert swapped["gated_norm"] == [f"model.layers.{i}.linear_attn.norm" for i in range(3)]
    assert swapped["rms_norm"][-1] == "model.norm" and "model.layers.3.self_attn.q_norm" in swapped["rms_norm"]
    assert fused_module_counts(fused) == {"rms_norm": 11, "swiglu": 4, "gated_norm": 3}


def test_a_wrong_offset_would_show():
    """The oracle is sharp: a norm fused without the (1 + w) offset gives other logits."""
    eager, fused = tiny_qwen(), tiny_qwen()
    wrong = Kernels(rms_norm=lambda x, w, eps, offset, mode, inplace: rms_norm(x, w, eps, 0.0, mode, inplace))
    from ftcli.model.build import decoder_layers

    fuse_decoder_ops(fused, decoder_layers(fused), ["rms_norm"], wrong)
    ids = torch.randint(3, 1024, (1, 32), generator=torch.Generator().manual_seed(2))
    assert (fused(input_ids=ids).logits - eager(input_ids=ids).logits).abs().max().item() > 1e-2


def test_fused_ops_refuse_models_without_those_modules_and_unknown_ops():
    from transformers import GptOssConfig, GptOssForCausalLM

    from ftcli.model.build import decoder_layers

    model = GptOssForCausalLM(GptOssConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                           num_local_experts=2, num_experts_per_tok=1))
    with pytest.raises(UserError) as err:
        fuse_decoder_ops(model, decoder_layers(model), ["rms_norm", "swiglu"], STAND_INS)
    assert str(err.value) == ("training.fused_ops: no module to fuse for rms_norm, swiglu in GptOssForCausalLM "
                              "(fused ops cover Qwen3_5RMSNorm, LlamaRMSNorm, Qwen3RMSNorm, Gemma3RMSNorm, Qwen3_5MLP, "
                              "LlamaMLP, Qwen3MLP); drop it from training.fused_ops")
    with pytest.raises(UserError, match=r"unknown op\(s\) layer_norm \(known: rms_norm, swiglu, gated_norm\)"):
        fuse_decoder_ops(tiny_qwen(), [], ["layer_norm"], STAND_INS)


def test_fused_ops_need_cuda_and_their_packages(monkeypatch):
    import sys
    import types

    with pytest.raises(UserError) as err:
        check_fused_device(torch.device("cpu"), ["rms_norm"])
    assert str(err.value) == ("training.fused_ops (rms_norm) runs Triton kernels: it needs a CUDA GPU (this process "
                              "is on cpu); set training.fused_ops=[] here")
    check_fused_device(torch.device("cpu"), [])  # nothing asked: nothing refused
    for name in ("liger_kernel", "liger_kernel.transformers", "liger_kernel.transformers.functional", "fla",
                 "fla.modules", "fla.modules.fused_norm_gate"):
        monkeypatch.setitem(sys.modules, name, None)  # not installed, wherever the test runs
    for op, package in (("swiglu", "liger-kernel"), ("gated_norm", "flash-linear-attention")):
        with pytest.raises(UserError, match=rf"^training.fused_ops={op} needs {package} \(GPU only"):
            load_kernels([op])

    class Broken(types.ModuleType):  # installed, but its import fails otherwise (a Triton / CUDA mismatch)
        def __getattr__(self, name):
            raise RuntimeError("Triton 3.1 is not supported")

    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", Broken("functional"))
    with pytest.raises(UserError) as err:
        load_kernels(["rms_norm"])
    assert str(err.value) == ("training.fused_ops=rms_norm: liger-kernel failed to import: RuntimeError: Triton 3.1 "
                              "is not supported")


def test_fused_ops_on_the_vlm_class_qwen_b300_trains():
    """Qwen3_5ForConditionalGeneration (layers under model.language_model): the text layers and the text
    model's final norm are swapped, the vision tower is not, and no parameter name changes."""
    from transformers import AutoModelForImageTextToText, Qwen3_5Config

    from ftcli.model.build import decoder_layers, text_final_norm

    raw = json.loads(TINY.read_text())
    text = {k: v for k, v in raw.items() if k not in ("model_type", "architectures")}
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=raw["hidden_size"],
                  num_position_embeddings=16, patch_size=4)
    model = AutoModelForImageTextToText.from_config(Qwen3_5Config(text_config=text, vision_config=vision))
    keys = list(model.state_dict())
    swapped = fuse_decoder_ops(model, decoder_layers(model), ["rms_norm", "swiglu", "gated_norm"], STAND_INS,
                               final_norm=text_final_norm(model))
    assert list(model.state_dict()) == keys
    assert swapped["rms_norm"][-1] == "model.language_model.norm" and len(swapped["rms_norm"]) == 11
    assert swapped["swiglu"][0] == "model.language_model.layers.0.mlp" and len(swapped["gated_norm"]) == 3
    assert not any(n.startswith("model.visual") for names in swapped.values() for n in names)
    assert fused_module_counts(model.model.visual) == {}


def test_fused_ops_recipe_rules_and_the_cli_line(tmp_path):
    from typer.testing import CliRunner

    from ftcli.cli import app
    from ftcli.config.recipe import load_recipe

    assert load_recipe("tiny-qwen-cpu", ["training.fused_ops=[rms_norm,swiglu]"]).training.fused_ops == ["rms_norm",
                                                                                                       "swiglu"]
    assert "fused_ops" not in load_recipe("tiny-qwen-cpu").model_dump()["training"]  # dumps stay as they were
    with pytest.raises(UserError, match=r"fused_ops"):
        load_recipe("tiny-qwen-cpu", ["training.fused_ops=[layer_norm]"])
    from ftcli import features

    with pytest.raises(UserError, match=r"training.fused_ops covers the modules of model_type qwen3_5, qwen3_5_text, "
                                        r"llama, qwen3, gemma3_text, gemma3; this recipe's model_type is gpt_oss: set "
                                        r"training.fused_ops=\[\]"):
        features.load_recipe("tiny-qwen-cpu", ["model.model_type=gpt_oss", "training.fused_ops=[rms_norm]"])
    with pytest.raises(UserError, match=r"training.fused_ops belongs to training.method=full \(this recipe's is lora\)"):
        load_recipe("tiny-gpt-oss-cpu", ["training.fused_ops=[rms_norm]"])  # LoRA: refused at load
    result = CliRunner().invoke(app, ["train", "--recipe", "tiny-qwen-cpu", "--set", "training.fused_ops=[swiglu]",
                                      "--set", f"output.dir={tmp_path / 'run'}"])
    assert result.exit_code == 2  # a UserError: one red line
    assert "Traceback" not in result.output
    assert ("training.fused_ops (swiglu) runs Triton kernels: it needs a CUDA GPU (this process is on cpu); set "
            "training.fused_ops=[] here") in " ".join(result.output.split())
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_compile_regions_are_the_parts_around_the_packed_kernels():
    from ftcli.features.compile import compile_regions

    model = tiny_qwen()
    layers = model.model.layers
    assert compile_regions(layers[0]) == ["linear_attn.norm", "mlp", "input_layernorm", "post_attention_layernorm"]
    assert compile_regions(layers[3]) == ["self_attn.q_norm", "self_attn.k_norm", "mlp", "input_layernorm",
                                          "post_attention_layernorm"]
    fuse(model, ["rms_norm", "gated_norm"])  # fused norms are Triton already: only the MLP is left
    assert compile_regions(layers[0]) == ["mlp"] and compile_regions(layers[3]) == ["mlp"]


def test_compile_regions_take_the_float8_linears_outside_the_mlp():
    """With fp8 on the 27B shapes (meta device): the MLP (its three float8 linears inside), the norms and
    the gated-delta / attention layers' float8 projections; a fused MLP leaves its float8 linears."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from ftcli.features.float8 import convert_to_fp8
    from ftcli.features.compile import compile_regions

    raw = json.loads((REPO / "benchmarks" / "configs" / "qwen3_8-27b-text.json").read_text())
    raw.update(num_hidden_layers=4, layer_types=raw["layer_types"][:4])
    cfg = Qwen3_5TextConfig(**{k: v for k, v in raw.items() if k not in ("model_type", "architectures")})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    from ftcli.model.build import decoder_layers, text_final_norm

    fuse_decoder_ops(model, decoder_layers(model), ["swiglu"], STAND_INS, final_norm=text_final_norm(model))
    convert_to_fp8(model, list(model.model.layers), cfg.hidden_size)
    assert compile_regions(model.model.layers[0]) == [
        "linear_attn.norm", "linear_attn.out_proj", "linear_attn.in_proj_qkv", "linear_attn.in_proj_z",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]
    assert compile_regions(model.model.layers[3]) == [
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
        "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
        "post_attention_layernorm"]


def test_shard_model_compiles_exactly_the_regions_and_raises_the_recompile_limit(monkeypatch):
    """compile=regions: `shard_model` compiles each layer's regions (and not the layer), and lifts dynamo's
    recompile limit to 64 (at 8 the H200 run sent regions past it back to eager); compile=true: whole layers."""
    import types

    import torch.distributed.fsdp as fsdp

    from ftcli.config.recipe import load_recipe
    from ftcli.features.compile import compile_regions
    from ftcli.model import parallelize

    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compiled.append(self))
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kw: module)
    world = types.SimpleNamespace(mesh=None)
    model = tiny_qwen()
    with torch._dynamo.config.patch(recompile_limit=8):  # dynamo's own patching: the old value comes back
        parallelize.shard_model(model, load_recipe("tiny-qwen-cpu", ["training.compile=regions"]).training, world)
        assert torch._dynamo.config.recompile_limit == 64
    names = {id(m): n for n, m in model.named_modules()}
    assert [names[id(m)] for m in compiled] == [f"model.layers.{i}.{r}" for i, layer in enumerate(model.model.layers)
                                                for r in compile_regions(layer)]
    assert len(compiled) == 3 * 4 + 5
    compiled.clear()
    whole = tiny_qwen()
    with torch._dynamo.config.patch(recompile_limit=8):
        parallelize.shard_model(whole, load_recipe("tiny-qwen-cpu", ["training.compile=true"]).training, world)
        assert compiled == list(whole.model.layers) and torch._dynamo.config.recompile_limit == 8
