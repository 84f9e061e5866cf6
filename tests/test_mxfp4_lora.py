"""LoRA over a kept-MXFP4 gpt-oss base (model.quantization=mxfp4, ftcli.model.mxfp4_lora): the autograd
function against dense algebra, the per-expert dequantizer against the checkpoint layout, and a PEFT LoRA
step over the kept base against the same step over transformers' dequantized base."""

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
    """dequantize_expert(e) is the transpose of ftcli.model.mxfp4's `[E, in, out]` parameter, bit for bit, in
    bf16 and fp32 (nibble order, scale bias and row = output feature all agree)."""
    from ftcli.model import mxfp4
    from ftcli.model.mxfp4_lora import dequantize_expert

    blocks, scales = _random_mxfp4(3, 24, 4)
    for dtype in (torch.bfloat16, torch.float32):
        param = mxfp4.dequantize_mxfp4(blocks, scales, dtype)  # [E, in=128, out=24]
        for e in range(3):
            assert torch.equal(dequantize_expert(blocks[e], scales[e], dtype).t(), param[e])


def _dense_reference(x, weight, lhs, rhs, s):
    return x @ weight + s * (x @ lhs) @ rhs


def test_matmul_forward_and_grads_equal_dense_unmerged_lora():
    """Mxfp4LoraMatmul == x·W + s·(x·A)·B with W the dequantized expert: output, input grad, A and B grads
    (float64: to 1e-12); the base gets no gradient; gradcheck passes on a tiny shape."""
    from ftcli.model.mxfp4_lora import Mxfp4LoraMatmul, dequantize_expert

    blocks, scales = _random_mxfp4(1, 16, 2, seed=1)  # one expert: in 64, out 16
    weight = dequantize_expert(blocks[0], scales[0], torch.float64).t()  # [in, out]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, dtype=torch.float64, generator=g, requires_grad=True)
    lhs = torch.randn(64, 4, dtype=torch.float64, generator=g, requires_grad=True)
    rhs = torch.randn(4, 16, dtype=torch.float64, generator=g, requires_grad=True)
    gy = torch.randn(5, 16, dtype=torch.float64, generator=g)
    y = Mxfp4LoraMatmul.apply(x, blocks[0], scales[0], lhs, rhs, 2.0)
    got = torch.autograd.grad(y, (x, lhs, rhs), gy)
    ref_y = _dense_reference(x, weight, lhs, rhs, 2.0)
    want = torch.autograd.grad(ref_y, (x, lhs, rhs), gy)
    torch.testing.assert_close(y, ref_y, rtol=0, atol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    tiny_blocks, tiny_scales = blocks[0, :4, :1], scales[0, :4, :1]  # in 32, out 4
    assert torch.autograd.gradcheck(lambda x, a, b: Mxfp4LoraMatmul.apply(x, tiny_blocks, tiny_scales, a, b, 2.0),
                                    (x[:2, :32].detach().requires_grad_(), lhs[:32, :2].detach().requires_grad_(),
                                     rhs[:2, :4].detach().requires_grad_()), fast_mode=True)
    no_lora = Mxfp4LoraMatmul.apply(x, blocks[0], scales[0], None, None, 0.0)
    (gx,) = torch.autograd.grad(no_lora, x, gy)
    torch.testing.assert_close(gx, gy @ weight.t(), rtol=0, atol=1e-12)


@pytest.fixture(scope="module")
def mxfp4_base(tmp_path_factory):
    from ftcli.model import mxfp4

    return mxfp4.save_mxfp4(tiny_model(seed=0, dtype=torch.bfloat16), tmp_path_factory.mktemp("kept") / "base")


def _peft_pair(base):
    """The same PEFT LoRA (attention + both expert parameters, B drawn non-zero) over the dequantized base
    and over the kept-MXFP4 base, in float32."""
    from peft import get_peft_model

    from ftcli.config.recipe import ModelConfig
    from ftcli.model.build import load_model
    from ftcli.model.mxfp4_lora import install_mxfp4_experts, kept_mxfp4_bytes
    from ftcli.train.lora.config import lora_config

    def build(quantization):
        model = load_model(ModelConfig(id=str(base), model_type="gpt_oss", dtype="float32", quantization=quantization))
        torch.manual_seed(0)
        return get_peft_model(model, lora_config(tiny_recipe(), model))

    dense, kept = build("mxfp4_dequantize"), build("mxfp4")
    assert install_mxfp4_experts(kept) == 2 and kept_mxfp4_bytes(kept) == 2 * 4 * (256 + 128) * 128 * 17 // 32
    torch.manual_seed(3)
    kept_params = dict(kept.named_parameters())
    for name, p in dense.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.05)
            kept_params[name].data.copy_(p.data)
    return dense, kept


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def test_lora_step_over_kept_mxfp4_equals_step_over_dequantized_base(mxfp4_base):
    """A LoRA step (loss, every LoRA gradient) over the kept-MXFP4 base equals the same step over transformers'
    dequantized base: float32, the only difference is the order of the unmerged vs PEFT's folded LoRA sums
    (loss to 1e-5 relative, gradients to 1e-4 of their largest entry). The kept base holds no expert weight
    and gets no gradient."""
    from ftcli.model.mxfp4_lora import is_placeholder

    dense, kept = _peft_pair(mxfp4_base)
    ids = torch.randint(20, 700, (2, 48), generator=torch.Generator().manual_seed(1))
    loss_dense, loss_kept = _loss(dense, ids), _loss(kept, ids)
    loss_dense.backward(), loss_kept.backward()
    print(f"loss dense {loss_dense.item():.6f} kept {loss_kept.item():.6f}")
    torch.testing.assert_close(loss_kept, loss_dense, rtol=1e-5, atol=0)
    kept_params = dict(kept.named_parameters())
    n_lora = n_expert_lora = 0
    for name, p in dense.named_parameters():
        if "lora_" not in name:
            continue
        other = kept_params[name].grad
        assert other is not None and p.grad.abs().max() > 0, name
        torch.testing.assert_close(other, p.grad, rtol=0, atol=1e-4 * p.grad.abs().max().item())
        n_lora += 1
        n_expert_lora += ".mlp.experts" in name
    assert n_expert_lora == 2 * 2 * 2  # 2 layers x (gate_up, down) x (A, B)
    assert n_lora > n_expert_lora
    frozen = [n for n, p in kept.named_parameters() if n.endswith(("experts.base_layer.base_layer.gate_up_proj",
                                                                   "experts.base_layer.base_layer.down_proj"))]
    assert len(frozen) == 4 and all(kept_params[n].grad is None and is_placeholder(kept_params[n])
                                    and kept_params[n].untyped_storage().nbytes() == 4 for n in frozen)


def test_adapter_from_kept_base_is_peft_adapter_and_merges(mxfp4_base, tmp_path):
    """The adapter saved over the kept base has PEFT's names and shapes (the same file a dequantized-base run
    saves), PEFT loads it over the dequantized base with the same logits, and merge-lora merges it."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from ftcli.artifacts.merge import merge
    from ftcli.config.recipe import ModelConfig, resolve_path
    from ftcli.model.build import load_model

    dense, kept = _peft_pair(mxfp4_base)
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


def test_lora_trainer_over_kept_mxfp4_logs_the_losses_of_the_dequantized_base(mxfp4_base, tmp_path):
    """ftcli's LoRA trainer (TRL SFTTrainer + PEFT, build_trainer) with model.quantization=mxfp4 routes the experts
    through the kept-MXFP4 forward and logs, step for step, the losses of model.quantization=mxfp4_dequantize
    (float32 on CPU: to 1e-5 relative)."""
    from trl import SFTConfig

    from ftcli.data import load_tokenizer
    from ftcli.model.build import load_model
    from ftcli.model.mxfp4_lora import Mxfp4LoraMatmul
    from ftcli.train.lora.trainer import build_trainer, sft_config_kwargs, training_rows

    losses, calls = {}, []
    forward = Mxfp4LoraMatmul.forward
    for quantization in ("mxfp4_dequantize", "mxfp4"):
        recipe = tiny_recipe("model.init=pretrained", f"model.id={mxfp4_base}", f"model.quantization={quantization}",
                             "training.max_steps=3", "training.log_every=1", "training.checkpoint.enabled=false",
                             "data.max_examples=60", f"data.cache_dir={tmp_path / 'cache'}", "tracking.enabled=false",
                             "eval=null", "data.max_length=256", "data.packing.block_len=256")  # short blocks: fast
        run_dir = tmp_path / quantization
        tokenizer = load_tokenizer(recipe)
        trainer, _ = build_trainer(recipe, load_model(recipe.model), tokenizer, training_rows(recipe, tokenizer),
                                   SFTConfig(**{**sft_config_kwargs(recipe, run_dir), "disable_tqdm": True},
                                             use_cpu=True), metrics_path=run_dir / "metrics.jsonl")
        Mxfp4LoraMatmul.forward = staticmethod(lambda *a: calls.append(1) or forward(*a))
        try:
            trainer.train()
        finally:
            Mxfp4LoraMatmul.forward = staticmethod(forward)
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        losses[quantization] = [json.loads(line)["loss"] for line in lines]
        if quantization == "mxfp4_dequantize":
            assert not calls  # the dequantized base never goes through the kept path
    assert calls and len(losses["mxfp4"]) == 3
    assert sft_config_kwargs(recipe, tmp_path)["ddp_broadcast_buffers"] is False  # the same blocks on every rank
    torch.testing.assert_close(torch.tensor(losses["mxfp4"]), torch.tensor(losses["mxfp4_dequantize"]),
                               rtol=1e-5, atol=0)
