"""The speed and memory levers of full SFT on the dense families (Llama 3, Qwen3, Gemma 3), on CPU:

- training.fused_ops swaps each family's RMSNorm (its own offset: w * norm for Llama / Qwen3, (1 + w) * norm for
  Gemma 3) and SiLU-gated MLP (Llama / Qwen3), and the fused model computes what the eager one does (liger's
  Triton kernels stood in for by torch versions of what its functionals document, as in tests/unit/features/test_fused_ops.py);
- training.compile=regions picks the norms and the dense MLP of their layers;
- the input embeddings and an untied LM head are FSDP units of their own (ftcli.model.parallelize), and the
  loss and every gradient are those of the model with them in the root.
The speed and the peak memory themselves are benchmarks/families_throughput_gpu.py's (BENCHMARKS.md)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from ftcli.features.fused_ops import Kernels, fuse_decoder_ops, fused_module_counts

ASSETS = Path(__file__).resolve().parents[3] / "ftcli" / "assets"


def liger_rms_norm(x, weight, eps, offset, casting_mode, in_place):
    """liger_rms_norm as documented: "gemma" computes everything in float32; "llama" casts the normalized x back
    to x's dtype before multiplying by (offset + w)."""
    assert not in_place
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if casting_mode == "gemma":
        return (normed * (offset + weight.float())).to(x.dtype)
    assert casting_mode == "llama"
    return (offset + weight) * normed.to(x.dtype)


STAND_INS = Kernels(rms_norm=liger_rms_norm, swiglu=lambda a, b: F.silu(a) * b)


def tiny(name: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads((ASSETS / f"tiny-{name}.json").read_text())
    raw = {k: v for k, v in raw.items() if not k.startswith("_") and k != "architectures"}
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # move the norm weights off their init (0 or 1), so a wrong offset shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def loss_and_grads(model, ids):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name, ops, counts", [
    ("llama3", ("rms_norm", "swiglu"), {"rms_norm": 2 * 3 + 1, "swiglu": 3}),
    ("qwen3", ("rms_norm", "swiglu"), {"rms_norm": 4 * 3 + 1, "swiglu": 3}),  # input, post-attention, q and k norms
    ("gemma3", ("rms_norm",), {"rms_norm": 6 * 3 + 1}),  # four per layer, q and k norms
])
def test_each_family_fuses_its_own_norm_and_mlp_and_computes_what_eager_does(name, ops, counts):
    from ftcli.model.build import decoder_layers, text_final_norm

    eager, fused = tiny(name), tiny(name)
    assert len(decoder_layers(fused)) == 3
    params = dict(fused.named_parameters())
    swapped = fuse_decoder_ops(fused, decoder_layers(fused), ops, STAND_INS, final_norm=text_final_norm(fused))
    assert {op: len(v) for op, v in swapped.items()} == counts and fused_module_counts(fused) == counts
    assert all(p is params[n] for n, p in fused.named_parameters()) and len(params) == len(dict(fused.named_parameters()))
    ids = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(1))
    logits_e, grads_e = loss_and_grads(eager, ids)
    logits_f, grads_f = loss_and_grads(fused, ids)
    assert (logits_f - logits_e).abs().max().item() < 1e-5
    assert grads_f.keys() == grads_e.keys()
    assert max((grads_f[n] - grads_e[n]).abs().max().item() / (grads_e[n].abs().max().item() + 1e-12)
               for n in grads_e) < 1e-4


@pytest.mark.parametrize("name, wrong_offset", [("llama3", 1.0), ("gemma3", 0.0)])
def test_the_other_familys_offset_would_show(name, wrong_offset):
    from ftcli.features import fused_ops
    from ftcli.model.build import decoder_layers

    eager, fused = tiny(name), tiny(name)
    cls = type(decoder_layers(fused)[0].input_layernorm).__name__
    offsets = dict(fused_ops.NORM_OFFSETS)
    assert offsets[cls] == 1.0 - wrong_offset
    fused_ops.NORM_OFFSETS[cls] = wrong_offset
    try:
        fuse_decoder_ops(fused, decoder_layers(fused), ["rms_norm"], STAND_INS)
    finally:
        fused_ops.NORM_OFFSETS.update(offsets)
    ids = torch.randint(3, 500, (1, 24), generator=torch.Generator().manual_seed(2))
    assert (fused(input_ids=ids).logits - eager(input_ids=ids).logits).abs().max().item() > 1e-2


def test_fused_ops_and_compile_regions_accept_the_dense_families_recipes():
    from ftcli import features
    from ftcli.features.compile import compile_regions
    from ftcli.model.build import decoder_layers

    for recipe in ("tiny-llama3-cpu", "tiny-qwen3-cpu", "tiny-gemma3-cpu"):
        assert features.load_recipe(recipe, ["training.fused_ops=[rms_norm]"]).training.fused_ops == ["rms_norm"]
    assert compile_regions(decoder_layers(tiny("llama3"))[0]) == ["mlp", "input_layernorm", "post_attention_layernorm"]
    assert compile_regions(decoder_layers(tiny("qwen3"))[0]) == [
        "self_attn.q_norm", "self_attn.k_norm", "mlp", "input_layernorm", "post_attention_layernorm"]


def shard_tiny_llama(split: bool, monkeypatch, keep_last: bool = True, impl: str = "chunked"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from ftcli.model import parallelize
    from ftcli.train.loss import attach_loss

    monkeypatch.setattr(parallelize, "SEPARATE_EMBEDDING_UNITS", split)
    monkeypatch.setattr(parallelize, "KEEP_LAST_UNITS_GATHERED", keep_last)
    model = tiny("llama3")
    recipe = SimpleNamespace(training=SimpleNamespace(
        activation_checkpointing="full", activation_checkpointing_keep=0, method="full", compile=False,
        fused_ops=[], precision=SimpleNamespace(param_dtype="float32", reduce_dtype="float32", fp8=False),
        loss=SimpleNamespace(impl="chunked")))
    monkeypatch.setattr(parallelize.features, "active", lambda training: [])
    world = SimpleNamespace(mesh=init_device_mesh("cpu", (1,)))
    parallelize.shard_model(model, recipe.training, world)
    attach_loss(model, impl, 16)
    units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    return model, units


def test_embeddings_and_lm_head_are_units_of_their_own_with_the_same_loss_and_gradients(one_rank, monkeypatch):
    ids = torch.randint(3, 500, (1, 48), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :10] = -100
    results = {}
    for split in (False, True):
        model, units = shard_tiny_llama(split, monkeypatch)
        loss = model.loss_sum(input_ids=ids, labels=labels)
        loss.backward()
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        results[split] = (units, float(loss.detach()), grads)
    layers = [f"model.layers.{i}" for i in range(3)]
    assert results[False][0] == ["", *layers]
    assert results[True][0] == ["", "model.embed_tokens", *layers, "lm_head"]
    assert results[True][1] == pytest.approx(results[False][1], rel=1e-6)
    split_grads, root_grads = results[True][2], results[False][2]
    assert split_grads.keys() == root_grads.keys() and len(root_grads) == len(dict(tiny("llama3").named_parameters()))
    for n in root_grads:
        torch.testing.assert_close(split_grads[n], root_grads[n], rtol=1e-5, atol=1e-7)
    assert root_grads["lm_head.weight"].abs().sum() > 0 and root_grads["model.embed_tokens.weight"].abs().sum() > 0


def test_last_units_stay_gathered_for_backward_and_the_fwd_grad_loss_gives_the_same_gradients(one_rank, monkeypatch):
    """After forward the last decoder layer and the LM head hold their gathered (plain tensor) weights, like the
    root, the other units their shards (DTensors); after backward every unit is sharded again. Loss and gradients are the same with
    them resharded, and with the chunked_fwd_grad loss computed in the LM head's own unit."""
    from torch.distributed.tensor import DTensor

    ids = torch.randint(3, 500, (1, 48), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[0, 30:] = -100
    results = {}
    for keep, impl in ((False, "chunked"), (True, "chunked"), (True, "chunked_fwd_grad")):
        model, _ = shard_tiny_llama(True, monkeypatch, keep_last=keep, impl=impl)
        loss = model.loss_sum(input_ids=ids, labels=labels)
        gathered = sorted(n for n, p in model.named_parameters() if not isinstance(p, DTensor))
        (loss * 0.25).backward()
        assert all(isinstance(p, DTensor) for p in model.parameters())
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        results[keep, impl] = (gathered, float(loss.detach()), grads)
    root = ["model.norm.weight"]  # FSDP2 never reshards the root after forward
    assert results[False, "chunked"][0] == root
    last = sorted(["lm_head.weight", *root, *(n for n, _ in tiny("llama3").named_parameters() if ".layers.2." in n)])
    assert results[True, "chunked"][0] == results[True, "chunked_fwd_grad"][0] == last
    ref = results[False, "chunked"]
    for key in ((True, "chunked"), (True, "chunked_fwd_grad")):
        assert results[key][1] == pytest.approx(ref[1], rel=1e-6)
        for n, want in ref[2].items():  # fp32 rounding (the fwd-grad loss sums its chunks in another order)
            assert float((results[key][2][n] - want).norm() / want.norm()) < 1e-6, (key, n)


def test_tied_embeddings_stay_in_the_root():
    from ftcli.model.parallelize import embedding_units

    assert embedding_units(tiny("gemma3")) == []  # Gemma ties its LM head to the embeddings: one parameter
    model = tiny("llama3")
    assert embedding_units(model) == [model.model.embed_tokens, model.lm_head]
