"""The grouped expert LoRA (ftcli.model.moe_lora) over a bf16 and a kept-MXFP4 gpt-oss base
(model.quantization=mxfp4, ftcli.model.mxfp4_lora): the autograd function against per-expert dense algebra,
the grouping against transformers' expert loop, the dequantizer against the checkpoint layout, and a PEFT LoRA
step (and ftcli's trainer) against PEFT's folded ParamWrapper over transformers' dequantized base."""

from __future__ import annotations

import json

import pytest
import torch

from _lora_common import tiny_model, tiny_recipe


def _random_mxfp4(experts: int, fan_out: int, groups: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, fan_out, groups, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 130, (experts, fan_out, groups), generator=g, dtype=torch.uint8)
    return blocks, scales


def test_per_expert_dequantize_equals_checkpoint_layout():
    """dequantize_expert(e) and dequantize_experts over a range are the transpose of ftcli.model.mxfp4's
    `[E, in, out]` parameter, bit for bit, in bf16 and fp32 (nibble order, scale bias and row = output feature)."""
    from ftcli.model import mxfp4
    from ftcli.model.mxfp4_lora import dequantize_expert, dequantize_experts

    blocks, scales = _random_mxfp4(3, 24, 4)
    for dtype in (torch.bfloat16, torch.float32):
        param = mxfp4.dequantize_mxfp4(blocks, scales, dtype)  # [E, in=128, out=24]
        for e in range(3):
            assert torch.equal(dequantize_expert(blocks[e], scales[e], dtype).t(), param[e])
        assert torch.equal(dequantize_experts(blocks[1:], scales[1:], dtype).transpose(-2, -1), param[1:])


def _per_expert_reference(x, weight, lhs, rhs, s, bounds):
    """Per expert e (rows bounds[e]..bounds[e+1]): x_e·W_e + s·(x_e·A_e)·B_e, dense, autograd's own gradients."""
    return torch.cat([x[lo:hi] @ weight[e] + s * (x[lo:hi] @ lhs[e]) @ rhs[e]
                      for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grouped_lora_matmul_equals_per_expert_unmerged_lora_and_saves_no_weight(dtype):
    """GroupedLoraMatmul == x_e·W_e + s·(x_e·A_e)·B_e per expert, with empty experts: output, input grad, A and B
    grads, for W from the dense parameter and from MXFP4 dequantized in chunks of 2 experts (float64: the exact
    loop, to 1e-12; float32: torch's grouped_mm on CPU, to 1e-5). Saved for backward: x, x·A, the factors and the
    offsets, nothing of W (a saved-tensors hook sees every tensor the function keeps)."""
    from ftcli.model import mxfp4_lora
    from ftcli.model.moe_lora import DenseExperts, GroupedLoraMatmul

    blocks, scales = _random_mxfp4(5, 16, 2, seed=1)  # 5 experts: in 64, out 16
    weight = mxfp4_lora.dequantize_experts(blocks, scales, dtype).transpose(-2, -1)  # [E, in, out]
    counts = [3, 0, 4, 0, 2]  # experts 1 and 3 get no token
    bounds = [0, *torch.tensor(counts).cumsum(0).tolist()]
    offs = torch.tensor(bounds[1:], dtype=torch.int32)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(bounds[-1], 64, dtype=dtype, generator=g, requires_grad=True)
    lhs = torch.randn(5, 64, 4, dtype=dtype, generator=g, requires_grad=True)
    rhs = torch.randn(5, 4, 16, dtype=dtype, generator=g, requires_grad=True)
    gy = torch.randn(bounds[-1], 16, dtype=dtype, generator=g)
    ref_y = _per_expert_reference(x, weight, lhs, rhs, 2.0, bounds)
    want = torch.autograd.grad(ref_y, (x, lhs, rhs), gy)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    kept = mxfp4_lora.Mxfp4Experts(blocks, scales, dtype)
    kept.chunk = 2  # three chunks: [0, 2), [2, 4), [4, 5)
    for source in (DenseExperts(weight), kept):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = GroupedLoraMatmul.apply(x, offs, bounds, source, lhs, rhs, 2.0)
        got = torch.autograd.grad(y, (x, lhs, rhs), gy)
        torch.testing.assert_close(y, ref_y, rtol=tol, atol=tol)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        assert sorted(tuple(t.shape) for t in saved) == sorted([(9, 64), (5,), (5, 64, 4), (5, 4, 16), (9, 4)])
    (gx,) = torch.autograd.grad(GroupedLoraMatmul.apply(x, offs, bounds, kept, None, None, 0.0), x, gy)
    torch.testing.assert_close(gx, torch.cat([gy[lo:hi] @ weight[e].t() for e, (lo, hi) in
                                              enumerate(zip(bounds[:-1], bounds[1:]))]), rtol=tol, atol=tol)


def test_grouped_experts_equal_transformers_expert_loop_with_empty_experts_and_ties():
    """`group_by_expert` sorts the (token, slot) pairs by expert, ties in token order, with empty experts
    counted as zero rows; `grouped_experts` (no adapter, float64) then equals transformers' GptOssExperts loop:
    output and the gradients of the hidden states and the routing weights to 1e-12."""
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from ftcli.model.moe_lora import DenseExperts, group_by_expert, grouped_experts

    router_indices = torch.tensor([[2, 0], [0, 2], [2, 5], [5, 0], [0, 2]])  # experts 1, 3, 4 empty; ties on 0, 2
    order, expert, offs, bounds = group_by_expert(router_indices, 6)
    assert expert.tolist() == [0, 0, 0, 0, 2, 2, 2, 2, 5, 5]
    assert order.tolist() == [1, 2, 7, 8, 0, 3, 4, 9, 5, 6]  # flat index token·k + slot, in token order per expert
    assert offs.tolist() == [4, 4, 8, 8, 8, 10] and bounds == [0, 4, 4, 8, 8, 8, 10]

    config = AutoConfig.for_model("gpt_oss", hidden_size=32, intermediate_size=16, num_local_experts=6,
                                  num_experts_per_tok=2)
    torch.manual_seed(0)
    experts = GptOssExperts(config).double()
    for p in experts.parameters():
        p.data.normal_(0, 0.3)
    hidden = torch.randn(5, 32, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(5, 2, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(5, 32, dtype=torch.float64)
    ref = experts(hidden, router_indices, weights)
    want = torch.autograd.grad(ref, (hidden, weights), gy)
    sources = {n: DenseExperts(getattr(experts, n)) for n in ("gate_up_proj", "down_proj")}
    got_y = grouped_experts(experts, sources, {n: (None, None, 0.0) for n in sources}, hidden, router_indices, weights)
    got = torch.autograd.grad(got_y, (hidden, weights), gy)
    torch.testing.assert_close(got_y, ref, rtol=0, atol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.fixture(scope="module")
def mxfp4_base(tmp_path_factory):
    from ftcli.model import mxfp4

    return mxfp4.save_mxfp4(tiny_model(seed=0, dtype=torch.bfloat16), tmp_path_factory.mktemp("kept") / "base")


def _peft_models(base, which=("peft", "grouped", "kept")):
    """The same PEFT LoRA (attention + both expert parameters, B drawn non-zero), float32, over the dequantized
    base through PEFT's folded ParamWrapper (`peft`) and through the grouped expert LoRA (`grouped`), and over the
    kept-MXFP4 base (`kept`, grouped)."""
    from peft import get_peft_model

    from ftcli.config.recipe import ModelConfig
    from ftcli.model.build import load_model
    from ftcli.model.moe_lora import install_grouped_experts
    from ftcli.model.mxfp4_lora import kept_mxfp4_bytes
    from ftcli.train.lora.config import lora_config

    models = {}
    for name in which:
        quantization = "mxfp4" if name == "kept" else "mxfp4_dequantize"
        model = load_model(ModelConfig(id=str(base), model_type="gpt_oss", dtype="float32", quantization=quantization))
        torch.manual_seed(0)
        models[name] = get_peft_model(model, lora_config(tiny_recipe().lora, tiny_recipe().model, model))
        if name != "peft":
            assert install_grouped_experts(models[name]) == 2
    if "kept" in models:
        assert kept_mxfp4_bytes(models["kept"]) == 2 * 4 * (256 + 128) * 128 * 17 // 32
    torch.manual_seed(3)
    first = next(iter(models.values()))
    for name, p in first.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.05)
            for other in models.values():
                dict(other.named_parameters())[name].data.copy_(p.data)
    return models


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def test_grouped_lora_step_equals_peft_folded_step_over_bf16_and_kept_mxfp4_bases(mxfp4_base):
    """A LoRA step (loss, every LoRA gradient) through the grouped expert LoRA equals PEFT's folded ParamWrapper
    step over the same dequantized base, and over the kept-MXFP4 base: float32, the only difference is the order
    of the unmerged vs folded LoRA sums (loss to 1e-5 relative, gradients to 1e-5 of their largest entry). The
    kept base holds no expert weight and gets no gradient; nor does the dense base's expert weight."""
    from ftcli.model.mxfp4_lora import is_placeholder

    models = _peft_models(mxfp4_base)
    ids = torch.randint(20, 700, (2, 48), generator=torch.Generator().manual_seed(1))
    losses = {}
    for name, model in models.items():
        losses[name] = _loss(model, ids)
        losses[name].backward()
    print({k: round(v.item(), 6) for k, v in losses.items()})
    params = {name: dict(model.named_parameters()) for name, model in models.items()}
    n_expert_lora = 0
    for name in ("grouped", "kept"):
        torch.testing.assert_close(losses[name], losses["peft"], rtol=1e-5, atol=0)
        for pname, p in params["peft"].items():
            if "lora_" not in pname:
                continue
            other = params[name][pname].grad
            assert other is not None and p.grad.abs().max() > 0, pname
            torch.testing.assert_close(other, p.grad, rtol=0, atol=1e-5 * p.grad.abs().max().item())
            n_expert_lora += ".mlp.experts" in pname
    assert n_expert_lora == 2 * 2 * 2 * 2  # 2 models x 2 layers x (gate_up, down) x (A, B)
    suffixes = ("experts.base_layer.base_layer.gate_up_proj", "experts.base_layer.base_layer.down_proj")
    for name in ("grouped", "kept"):
        frozen = [n for n in params[name] if n.endswith(suffixes)]
        assert len(frozen) == 4 and all(params[name][n].grad is None for n in frozen)
    assert all(is_placeholder(params["kept"][n]) and params["kept"][n].untyped_storage().nbytes() == 4
               for n in params["kept"] if n.endswith(suffixes))


def test_adapter_from_kept_base_is_peft_adapter_and_merges(mxfp4_base, tmp_path):
    """The adapter saved over the kept base has PEFT's names and shapes (the same file a dequantized-base run
    saves), PEFT loads it over the dequantized base with the same logits, and merge-lora merges it."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from ftcli.artifacts.merge import merge
    from ftcli.config.recipe import ModelConfig, resolve_path
    from ftcli.model.build import load_model

    models = _peft_models(mxfp4_base, ("peft", "kept"))
    dense, kept = models["peft"], models["kept"]
    kept.save_pretrained(tmp_path / "kept" / "final")
    dense.save_pretrained(tmp_path / "dense")
    ours, theirs = (load_file(str(d / "adapter_model.safetensors")) for d in (tmp_path / "kept" / "final",
                                                                              tmp_path / "dense"))
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)

    reloaded = PeftModel.from_pretrained(
        load_model(ModelConfig(id=str(mxfp4_base), model_type="gpt_oss", dtype="float32",
                               quantization="mxfp4_dequantize")), str(tmp_path / "kept" / "final"))
    ids = torch.randint(20, 700, (1, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(kept(input_ids=ids).logits, reloaded(input_ids=ids).logits, rtol=0, atol=1e-4)

    run = tmp_path / "kept"
    AutoTokenizer.from_pretrained(resolve_path("pkg://assets/tokenizer-gpt-oss")).save_pretrained(run / "final")
    (run / "run.json").write_text(json.dumps({
        "method": "lora", "model_dir": "final", "status": "completed",
        "base_model": {"id": str(mxfp4_base), "revision": None, "init": "pretrained", "model_type": "gpt_oss",
                       "model_class": "causal_lm"},
    }))
    _, report = merge(run, output=tmp_path / "merged", dtype="float32")
    assert report["passed"] and report["adapter_effect"] > 0.1


def test_kept_mxfp4_needs_lora_and_a_pretrained_base():
    from ftcli.config.recipe import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="model.quantization=mxfp4 keeps a pretrained MXFP4 base frozen for LoRA"):
        tiny_recipe("model.quantization=mxfp4")  # the tiny recipe draws a random base
    with pytest.raises(RecipeError, match="model.quantization=mxfp4 runs with training.sharding=ddp or auto"):
        load_recipe("gpt-oss-120b-1gpu", ["training.sharding=fsdp"])
    with pytest.raises(RecipeError, match="lora.experts=peft needs a bf16 base"):
        load_recipe("gpt-oss-120b-1gpu", ["lora.experts=peft"])


def _train_kept_and_dequantized(mxfp4_base, tmp_path, *sets: str) -> tuple[dict[str, list[dict]], int]:
    """ftcli's LoRA trainer (TRL SFTTrainer + PEFT, build_trainer) in this process, 3 steps on short blocks, over
    model.quantization=mxfp4_dequantize with lora.experts=peft, then over the kept base (mxfp4, grouped): each run's
    metrics.jsonl lines, and how often the grouped expert LoRA ran (never in the first run)."""
    from trl import SFTConfig

    from ftcli.data import load_tokenizer
    from ftcli.model.build import load_model
    from ftcli.model.moe_lora import GroupedLoraMatmul
    from ftcli.train.lora.trainer import build_trainer, sft_config_kwargs, training_blocks

    steps, calls = {}, []
    forward = GroupedLoraMatmul.forward
    for quantization, experts in (("mxfp4_dequantize", "peft"), ("mxfp4", "grouped")):
        recipe = tiny_recipe("model.init=pretrained", f"model.id={mxfp4_base}", f"model.quantization={quantization}",
                             f"lora.experts={experts}", "training.max_steps=3", "training.log_every=1",
                             "training.checkpoint.enabled=false", f"data.cache_dir={tmp_path / 'cache'}",
                             "tracking.enabled=false", "eval=null", "data.max_length=256",
                             "data.packing.block_len=256", *sets)  # short blocks: fast
        run_dir = tmp_path / quantization
        tokenizer = load_tokenizer(recipe.model, recipe.data)
        kwargs = sft_config_kwargs(recipe.training, recipe.model, recipe.name, run_dir)
        trainer, _ = build_trainer(recipe, load_model(recipe.model), tokenizer, training_blocks(recipe, tokenizer),
                                   SFTConfig(**{**kwargs, "disable_tqdm": True}, use_cpu=True),
                                   metrics_path=run_dir / "metrics.jsonl")
        GroupedLoraMatmul.forward = staticmethod(lambda *a: calls.append(1) or forward(*a))
        try:
            trainer.train()
        finally:
            GroupedLoraMatmul.forward = staticmethod(forward)
        steps[quantization] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        if experts == "peft":
            assert not calls  # lora.experts=peft never goes through the grouped path
    kwargs = sft_config_kwargs(recipe.training, recipe.model, recipe.name, tmp_path)
    assert kwargs["ddp_broadcast_buffers"] is False  # the same blocks on every rank
    return steps, len(calls)


def test_lora_trainer_over_kept_mxfp4_logs_the_losses_of_peft_over_the_dequantized_base(mxfp4_base, tmp_path):
    """ftcli's LoRA trainer with model.quantization=mxfp4 routes the experts through the grouped expert LoRA and logs,
    step for step, the losses of PEFT's folded ParamWrapper over model.quantization=mxfp4_dequantize with
    lora.experts=peft (float32 on CPU: to 1e-5 relative)."""
    steps, calls = _train_kept_and_dequantized(mxfp4_base, tmp_path, "data.max_examples=60")
    losses = {k: [m["loss"] for m in v] for k, v in steps.items()}
    assert calls and len(losses["mxfp4"]) == 3
    torch.testing.assert_close(torch.tensor(losses["mxfp4"]), torch.tensor(losses["mxfp4_dequantize"]),
                               rtol=1e-5, atol=0)


def test_dpo_over_kept_mxfp4_is_log_2_at_step_1_and_trains_as_over_the_dequantized_base(mxfp4_base, tmp_path):
    """training.objective=dpo on the kept-MXFP4 base (gpt-oss-120b's setting, experts kept at 4.25 bits and run
    through the grouped expert LoRA): the reference is the same base with the adapter off (PEFT's disable_adapter, no
    copy), so step 1 (a fresh adapter, B = 0) is log 2 with zero margins; the steps after it train, and every step's
    loss, log-probs and reward margin equal DPO over the dequantized base with PEFT's folded expert LoRA (float32: 1e-5
    relative, the margins 1e-5 absolute)."""
    import math

    steps, calls = _train_kept_and_dequantized(mxfp4_base, tmp_path, "training.objective=dpo", "data.format=preference",
                                               "data.path=pkg://assets/tiny_prefs.jsonl", "data.max_examples=40")
    kept, dequantized = steps["mxfp4"], steps["mxfp4_dequantize"]
    assert calls and [m["step"] for m in kept] == [m["step"] for m in dequantized] == [1, 2, 3]
    assert kept[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and kept[0]["rewards/margins"] == 0.0
    assert kept[-1]["rewards/margins"] != 0.0 and kept[-1]["loss"] != pytest.approx(math.log(2), abs=1e-4)
    # the margins (~0.05) are beta x differences of summed log-probs many times larger: compared absolutely
    for key, rtol, atol in (("loss", 1e-5, 0), ("logps/chosen", 1e-5, 0), ("logps/rejected", 1e-5, 0),
                            ("rewards/margins", 0, 1e-5)):
        torch.testing.assert_close(torch.tensor([m[key] for m in kept]), torch.tensor([m[key] for m in dequantized]),
                                   rtol=rtol, atol=atol)
