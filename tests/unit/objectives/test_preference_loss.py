"""Preference log-probs and losses: packed == separate on every family, chunked == full-logits gradients, method
lora's reference, global normalization over split blocks.

CPU, float32, the tiny models of ftcli/assets (the pieces: tests/support/_preference_common.py). Packed: ftcli's
pairs (ftcli.data.preference) packed into one block with a padding segment, the packed kernels installed,
`sequence_logps` (chunked, no full logits). Separate: stock transformers on each side alone, log-softmax over the
full logits. TRL's trainers as the oracle of the losses: tests/e2e/test_preference_trl_oracle.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from _preference_common import (BETA, CHUNK, FAMILIES, LOGP_RTOL, encoded_pairs, ftcli_step, packed_block,
                                packed_logps, separate_logps, tiny_model, tokenizer)
from ftcli.data.collate import block_to_model_inputs
from ftcli.model import kernels
from ftcli.train.preference import PreferenceConfig, PreferenceSums, SideLogps, attach_preference_loss, pair_loss_sum

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(autouse=True)
def _uninstall_after_each_test():
    yield
    kernels.disable_packed_kernels()


# ------------------------------------------------------------------------------- packed == separate
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_packed_pair_logps_equal_separate(model_type):
    config, tok_name, stock = FAMILIES[model_type]
    tok = tokenizer(tok_name)
    model = tiny_model(model_type)
    blk = packed_block(tok, encoded_pairs(tok))
    assert blk.pairs.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]] and blk.roles[-1] == -1
    with torch.no_grad():
        sums, counts = packed_logps(model, model_type, blk)
        want, want_counts = separate_logps(model, stock, blk)
        host_sums, host_counts = packed_logps(model, model_type, blk, host_positions=True)
    assert torch.equal(host_sums, sums) and torch.equal(host_counts, counts)  # the loop's host-found positions
    assert counts[:-1].tolist() == want_counts and counts[-1] == 0  # padding trains nothing
    assert want.abs().min() > 5.0  # log-probs of a size where a leak between segments would show
    assert ((sums[:-1] - want).abs() / want.abs()).max().item() <= LOGP_RTOL, (sums[:-1] - want).tolist()


def test_sequence_logps_gradient_equals_full_logits():
    """The chunked, checkpointed per-sequence log-prob has the gradient of the full-logits computation."""
    tok = tokenizer("tokenizer-llama3")
    model = tiny_model("llama")
    blk = packed_block(tok, encoded_pairs(tok))
    weights = torch.linspace(-1.0, 1.0, len(blk.cu_seqlens) - 1)

    def grads(chunk):
        model.zero_grad()
        sums, _ = packed_logps(model, "llama", blk, chunk)
        (sums * weights).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    chunked, whole = grads(CHUNK), grads(10_000)
    assert chunked.keys() == whole.keys() and len(whole) > 10
    for name, g in whole.items():
        assert (chunked[name] - g).abs().max().item() <= 1e-5 * max(1.0, g.abs().max().item()), name


# ---------------------------------------------------------------------------- method lora's reference
@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_lora_reference_is_the_base_with_the_adapter_off(model_type):
    """Method lora's reference (no copy): the PEFT model with its adapter disabled gives the base model's log-probs,
    and the adapter is on again after; the DPO loss equals the one computed against a separate base model. Qwen3-MoE:
    expert LoRA through ftcli's grouped expert GEMMs (lora.experts=grouped), which honour the switch too."""
    from peft import get_peft_model

    from ftcli.config.recipe import load_recipe
    from ftcli.model.moe_lora import install_grouped_experts
    from ftcli.train.lora.config import lora_config

    tok = tokenizer(FAMILIES[model_type][1])
    blk = packed_block(tok, encoded_pairs(tok))
    base = tiny_model(model_type)
    separate_base = copy.deepcopy(base)
    recipe = load_recipe("tiny-qwen3-moe-cpu" if model_type == "qwen3_moe" else "tiny-llama3-cpu",
                         ["training.method=lora", "training.precision={}"])
    peft = get_peft_model(base, lora_config(recipe.lora, recipe.model, base))
    if model_type == "qwen3_moe":
        assert install_grouped_experts(peft) == 2
        assert any("experts" in n for n, _ in peft.named_parameters() if "lora_" in n)
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.05)
    policy = peft.get_base_model()
    cfg = PreferenceConfig("sigmoid", beta=BETA)
    attach_preference_loss(policy, cfg, CHUNK, adapter_off=peft.disable_adapter)
    attn, _ = kernels.enable_packed_kernels(model_type, "cpu")
    policy.set_attn_implementation(attn)
    separate_base.set_attn_implementation(attn)
    inputs = block_to_model_inputs(blk)
    with torch.no_grad():
        got = float(policy.loss_sum(**inputs))
        pairs = inputs["pairs"]
        mine = SideLogps.of_block(*packed_logps(policy, model_type, blk), pairs)
        ref = SideLogps.of_block(*packed_logps(separate_base, model_type, blk), pairs)
        want, _ = pair_loss_sum(cfg, mine, ref)
    assert (mine.chosen - ref.chosen).abs().max() > 1e-3  # the adapter moves the log-probs: the check has teeth
    assert abs(got - float(want)) <= 1e-5 and policy.preference_sums.pairs == 4


# ------------------------------------------------------------------------------ global normalization
@pytest.mark.parametrize("loss", ["sigmoid", "orpo"])
def test_loss_same_for_one_block_and_split_blocks(loss):
    """Pairs split over micro-batches (or ranks) scaled by the global pair count give the one-block loss and
    gradient, however unevenly the pairs are spread (1 pair and 3 pairs)."""
    tok = tokenizer("tokenizer-llama3")
    pairs = encoded_pairs(tok)
    model, reference = tiny_model("llama"), tiny_model("llama", seed=1)
    cfg = PreferenceConfig(loss, beta=BETA, orpo_lambda=0.5)
    whole = ftcli_step(model, cfg, packed_block(tok, pairs), reference)
    blocks = [packed_block(tok, pairs[:1]), packed_block(tok, pairs[1:])]
    global_pairs = sum(len(b.pairs) for b in blocks)
    model.zero_grad()
    total = PreferenceSums()
    for blk in blocks:  # two micro-batches of one rank (two ranks: W = 2 here and FSDP's 1/W average)
        p = torch.from_numpy(blk.pairs)
        policy = SideLogps.of_block(*packed_logps(model, "llama", blk), p)
        with torch.no_grad():
            ref = SideLogps.of_block(*packed_logps(reference, "llama", blk), p)
        loss_sum, sums = pair_loss_sum(cfg, policy, ref)
        (loss_sum / global_pairs).backward()
        total.add(sums)
    assert total.pairs == global_pairs == 4
    assert abs(total.loss / total.pairs - whole[0]) <= 1e-6
    for name, g in whole[2].items():
        assert (model.get_parameter(name).grad - g).abs().max().item() <= 1e-6, name
