"""The grouped expert LoRA (ftcli.model.moe_lora) over Qwen3-MoE's experts (`[E, out, in]`, gate | up halves, silu,
no biases: its family's ExpertLayout): the experts against transformers' Qwen3MoeExperts, and a PEFT LoRA step
against PEFT's folded ParamWrapper, float32 on CPU (torch's grouped_mm)."""

from __future__ import annotations

import pytest
import torch


def test_every_declared_expert_layout_is_one_moe_lora_computes():
    """The families declaring an ExpertLayout are the MoE ones (gpt-oss, Qwen3-MoE), each naming a gate
    ftcli.model.moe_lora has and a weight orientation it reads."""
    from ftcli.families import FAMILIES
    from ftcli.model.moe_lora import GATES

    layouts = {name: f.expert_layout for name, f in FAMILIES.items() if f.expert_layout is not None}
    assert {n: (x.experts_class, x.weights, x.activation, x.biases) for n, x in layouts.items()} == {
        "gpt_oss": ("GptOssExperts", "in_out", "clamped_swiglu", True),
        "qwen3_moe": ("Qwen3MoeExperts", "out_in", "silu", False)}
    assert all(x.activation in GATES for x in layouts.values())


def test_grouped_experts_equal_transformers_qwen3_moe_experts_with_empty_experts():
    """`grouped_experts` (no adapter, float32) over Qwen3MoeExperts' own parameters (their transposed views)
    equals the module's forward: output and the gradients of the hidden states and the routing weights to 1e-5,
    with experts 1, 3 and 4 routed no token."""
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from ftcli.families import FAMILIES
    from ftcli.model.moe_lora import expert_sources, grouped_experts, layout_of

    config = AutoConfig.for_model("qwen3_moe", hidden_size=32, moe_intermediate_size=16, num_experts=6,
                                  num_experts_per_tok=2)
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config)
    for p in experts.parameters():
        p.data.normal_(0, 0.3)
    assert layout_of(experts) is FAMILIES["qwen3_moe"].expert_layout and layout_of(experts).weights == "out_in"
    router_indices = torch.tensor([[2, 0], [0, 2], [2, 5], [5, 0], [0, 2], [5, 2], [0, 5]])
    hidden = torch.randn(7, 32, requires_grad=True)
    weights = torch.rand(7, 2, requires_grad=True)
    gy = torch.randn(7, 32)
    ref = experts(hidden, router_indices, weights)
    want = torch.autograd.grad(ref, (hidden, weights), gy)
    sources = expert_sources(experts)
    assert sources["gate_up_proj"].param.shape == (6, 32, 32) and sources["down_proj"].param.shape == (6, 16, 32)
    got_y = grouped_experts(experts, sources, {n: (None, None, 0.0) for n in sources}, hidden, router_indices, weights)
    got = torch.autograd.grad(got_y, (hidden, weights), gy)
    torch.testing.assert_close(got_y, ref, rtol=0, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def _lora_models():
    """The tiny-qwen3-moe-cpu model with the same PEFT LoRA (attention + both expert parameters, B drawn
    non-zero), float32, through PEFT's folded ParamWrapper (`peft`) and through the grouped expert LoRA."""
    from peft import get_peft_model

    from ftcli.config.recipe import load_recipe
    from ftcli.model.build import load_model
    from ftcli.model.moe_lora import install_grouped_experts
    from ftcli.train.lora.config import lora_config

    recipe = load_recipe("tiny-qwen3-moe-cpu", [])
    models = {}
    for name in ("peft", "grouped"):
        torch.manual_seed(0)
        model = load_model(recipe.model)
        torch.manual_seed(0)
        models[name] = get_peft_model(model, lora_config(recipe.lora, recipe.model, model))
        if name == "grouped":
            assert install_grouped_experts(models[name]) == 2
    torch.manual_seed(3)
    for name, p in models["peft"].named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.05)
            dict(models["grouped"].named_parameters())[name].data.copy_(p.data)
    return models


def _route_around_expert_3(module, args, output):
    """A router hook: every slot routed to expert 3 goes to another expert than the token's other slot (top-2 of 4)."""
    logits, scores, indices = output
    indices = torch.where(indices == 3, (indices.flip(-1) + 1) % 3, indices)
    return logits, scores, indices


def test_grouped_lora_step_equals_peft_folded_step_for_qwen3_moe_with_an_empty_expert():
    """A LoRA step (loss, every LoRA gradient) through the grouped expert LoRA equals PEFT's folded ParamWrapper
    over the same tiny Qwen3-MoE, float32 (loss to 1e-5 relative, gradients to 1e-5 of their largest entry), with
    expert 3 routed no token: its A and B get exactly zero gradient on both paths, the base experts none."""
    models = _lora_models()
    ids = torch.randint(20, 1000, (2, 48), generator=torch.Generator().manual_seed(1))
    losses = {}
    for name, model in models.items():
        for layer in model.base_model.model.model.layers:
            layer.mlp.gate.register_forward_hook(_route_around_expert_3)
        losses[name] = model(input_ids=ids, labels=ids).loss
        losses[name].backward()
    torch.testing.assert_close(losses["grouped"], losses["peft"], rtol=1e-5, atol=0)
    params = {name: dict(model.named_parameters()) for name, model in models.items()}
    n_expert_lora = 0
    for pname, p in params["peft"].items():
        if "lora_" not in pname:
            continue
        grad = params["grouped"][pname].grad
        assert grad is not None and p.grad.abs().max() > 0, pname
        torch.testing.assert_close(grad, p.grad, rtol=0, atol=1e-5 * p.grad.abs().max().item())
        if ".mlp.experts" in pname:
            n_expert_lora += 1
            # PEFT's expert factors: A [E·r, in] (expert-major rows), B [out, r·E] (expert-minor columns)
            for g in (grad, p.grad):
                per_expert = g.view(4, -1, g.shape[-1]) if "lora_A" in pname else g.view(g.shape[0], -1, 4)
                empty = per_expert[3] if "lora_A" in pname else per_expert[..., 3]
                assert torch.count_nonzero(empty) == 0, pname
    assert n_expert_lora == 2 * 2 * 2  # 2 layers x (gate_up, down) x (A, B)
    frozen = [n for n in params["grouped"] if n.endswith(("base_layer.gate_up_proj", "base_layer.down_proj"))]
    assert len(frozen) == 4 and all(params["grouped"][n].grad is None for n in frozen)


def test_grouped_expert_lora_refuses_a_gate_it_does_not_compute():
    """A Qwen3-MoE whose hidden_act is not silu: install_grouped_experts stops with a one-line UserError naming
    lora.experts=peft, instead of computing a silu gate."""
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from ftcli.config.errors import UserError
    from ftcli.config.recipe import load_recipe
    from ftcli.model.moe_lora import install_grouped_experts
    from ftcli.train.lora.config import lora_config

    config = AutoConfig.for_model("qwen3_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                  num_experts=4, num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=16, vocab_size=64, hidden_act="gelu")
    model = AutoModelForCausalLM.from_config(config)
    recipe = load_recipe("tiny-qwen3-moe-cpu", [])
    peft_model = get_peft_model(model, lora_config(recipe.lora, recipe.model, model))
    with pytest.raises(UserError, match="lora.experts=peft"):
        install_grouped_experts(peft_model)
