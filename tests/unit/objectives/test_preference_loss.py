"""Preference log-probs and losses: packed == separate on every family, and TRL's trainers as the oracle.

CPU, float32, the tiny models of ftcli/assets. Packed: ftcli's pairs (ftcli.data.preference) packed into one block
with a padding segment, the packed kernels installed, `sequence_logps` (chunked, no full logits). Separate: stock
transformers on each side alone, log-softmax over the full logits. The oracle: TRL 1.16's DPOTrainer (sigmoid,
ipo), CPOTrainer with loss_type=simpo and cpo_alpha=0 (simpo), ORPOTrainer (orpo), given the same token ids, on a
copy of the same model; loss and every parameter's gradient must agree.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch

from ftcli.data.collate import block_to_model_inputs
from ftcli.data.packing import make_block, pack_pairs
from ftcli.data.preference import PairEncoder, pair
from ftcli.model import kernels
from ftcli.train.preference import (
    PreferenceConfig,
    PreferenceSums,
    SideLogps,
    attach_preference_loss,
    pair_loss_sum,
    sequence_logps,
)

pytestmark = pytest.mark.filterwarnings("ignore")

ASSETS = Path(__file__).resolve().parents[3] / "ftcli" / "assets"
FAMILIES = {  # model type: (config, tokenizer, stock attention of the separate run)
    "llama": ("tiny-llama3.json", "tokenizer-llama3", "sdpa"),
    "qwen3": ("tiny-qwen3.json", "tokenizer-qwen3", "sdpa"),
    "qwen3_moe": ("tiny-qwen3-moe.json", "tokenizer-qwen3", "sdpa"),
    "gemma3_text": ("tiny-gemma3.json", "tokenizer-gemma3", "sdpa"),
    "gpt_oss": ("tiny-gpt-oss.json", "tokenizer-gpt-oss", "eager"),
    "qwen3_5_text": ("tiny-qwen3_5.json", "tokenizer-qwen", "sdpa"),
}
LOGP_RTOL = 1e-5  # of a summed log-prob (~ -30 to -80 here: float32 rounding of the sum is ~1e-5 absolute)
CHUNK = 7  # tokens per LM-head chunk: several chunks per block, one crossing a segment edge


@pytest.fixture(autouse=True)
def _uninstall_after_each_test():
    yield
    kernels.disable_packed_kernels()


@lru_cache(maxsize=None)
def tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ASSETS / name))


def tiny_model(model_type: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    data = json.loads((ASSETS / FAMILIES[model_type][0]).read_text())
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if model_type == "qwen3_5_text":  # gated-delta state that lives across a segment, so a leak would show
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "A_log"):
                    module.A_log.uniform_(-4.0, -2.0)
    return model.eval()


ROWS = [  # one of each form ftcli reads; the oracle pairs are the first three
    {"prompt": [{"role": "user", "content": "What is 7 plus 6?"}],
     "chosen": [{"role": "assistant", "content": "7 plus 6 is 13."}],
     "rejected": [{"role": "assistant", "content": "7 plus 6 is 15."}]},
    {"prompt": "Count from 1 to 4.", "chosen": "1 2 3 4", "rejected": "1 2 4"},
    {"chosen": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Capital of Peru?"},
                {"role": "assistant", "content": "The capital of Peru is Lima."}],
     "rejected": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Capital of Peru?"},
                  {"role": "assistant", "content": "Rome."}]},
    {"chosen": "\n\nHuman: Repeat after me: green light\n\nAssistant: green light",
     "rejected": "\n\nHuman: Repeat after me: green light\n\nAssistant: light"},
]


def encoded_pairs(tok, rows=ROWS) -> list[tuple]:
    from types import SimpleNamespace

    data = SimpleNamespace(train_on="assistant", special_tokens_in_text="keep", source_list=lambda: [])
    enc = PairEncoder(data, tok, [])
    out = []
    for i, row in enumerate(rows):
        p = enc.encode(pair(row))
        out.append((i, p.chosen_ids, p.chosen_mask, p.rejected_ids, p.rejected_mask))
    return out


def packed_block(tok, pairs, padding: int = 5):
    ids, mask, segs, roles = next(pack_pairs(pairs, None, 1)) if len(pairs) == 1 else _one_block(pairs)
    return make_block(ids, mask, segs, len(ids) + padding, tok.pad_token_id or 0, roles=roles)


def _one_block(pairs):
    total = sum(len(p[1]) + len(p[3]) for p in pairs)
    (block,) = list(pack_pairs(pairs, total, len(pairs)))
    return block


def packed_logps(model, model_type, blk, chunk=CHUNK):
    attn, _ = kernels.enable_packed_kernels(model_type, "cpu")
    model.set_attn_implementation(attn)
    inputs = block_to_model_inputs(blk)
    labels, seq_idx = inputs.pop("labels"), inputs["seq_idx"]
    inputs.pop("trained_positions")
    hidden = model.model(**inputs, use_cache=False).last_hidden_state
    return sequence_logps(hidden, model.lm_head.weight, labels, seq_idx, len(blk.cu_seqlens) - 1, chunk)


def separate_logps(model, stock, blk):
    """Each real segment alone through stock transformers: (summed log-prob, count) from the full logits."""
    kernels.disable_packed_kernels()
    model.set_attn_implementation(stock)
    sums, counts = [], []
    for s in range(len(blk.cu_seqlens) - 2):  # the last segment is padding
        a, b = int(blk.cu_seqlens[s]), int(blk.cu_seqlens[s + 1])
        ids = torch.from_numpy(blk.input_ids[a:b].astype(np.int64))[None]
        labels = torch.from_numpy(blk.labels[a:b].astype(np.int64))[None]
        logp = model(input_ids=ids, use_cache=False).logits.float().log_softmax(-1)[0, :-1]
        target = labels[0, 1:]
        keep = target != -100
        sums.append(logp[keep].gather(1, target[keep][:, None]).sum())
        counts.append(int(keep.sum()))
    return torch.stack(sums), counts


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


# ------------------------------------------------------------------------------------- TRL oracle
BETA = 0.3


def _ftcli_step(model, cfg: PreferenceConfig, blk, reference=None):
    """ftcli's step-1 loss and gradients on one block of pairs (one rank, one micro-batch)."""
    pairs = torch.from_numpy(blk.pairs)
    model.zero_grad()
    policy = SideLogps.of_block(*packed_logps(model, "llama", blk), pairs)
    ref = None
    if reference is not None:
        with torch.no_grad():
            ref = SideLogps.of_block(*packed_logps(reference, "llama", blk), pairs)
    loss_sum, sums = pair_loss_sum(cfg, policy, ref)
    loss = loss_sum / len(pairs)
    loss.backward()
    return float(loss), sums, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _sides(pairs):
    """TRL's split of each side: prompt = the tokens before the first trained one, completion = through the
    last trained one (ftcli's masks train one contiguous completion span on these rows)."""
    out = []
    for _, c_ids, c_mask, r_ids, r_mask in pairs:
        sides = []
        for ids, mask in ((c_ids, c_mask), (r_ids, r_mask)):
            trained = np.flatnonzero(mask)
            assert (np.diff(trained) == 1).all()
            sides.append((ids[: trained[0]].tolist(), ids[trained[0]: trained[-1] + 1].tolist()))
        assert sides[0][0] == sides[1][0]  # the same prompt tokens on both sides
        out.append({"prompt_ids": sides[0][0], "chosen_ids": sides[0][1], "rejected_ids": sides[1][1]})
    return out


def _trl_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(ftcli, trl_loss, trl_grads):
    loss, _, grads = ftcli
    assert abs(loss - trl_loss) <= 1e-5, (loss, trl_loss)
    assert grads.keys() == trl_grads.keys() and len(grads) > 10
    for name, g in trl_grads.items():
        assert (grads[name] - g).abs().max().item() <= 1e-5, name


def _assert_metrics(sums: PreferenceSums, logged: dict):
    """TRL's logged metrics, by TRL's names: ftcli's step sums over the pairs, divided by the pair count."""
    means = sums.means()
    assert set(means) == {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                          "logps/chosen", "logps/rejected"}
    for key, value in means.items():
        assert abs(value - logged[key]) <= 1e-5, key


def _args(tmp_path, config_cls, **kwargs):
    return config_cls(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, per_device_train_batch_size=8,
                      **kwargs)


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_dpo_step_equals_trl_dpo_trainer(loss, tmp_path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    tok = tokenizer("tokenizer-llama3")
    pairs = encoded_pairs(tok, ROWS[:3])
    blk = packed_block(tok, pairs)
    policy, reference = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    with torch.no_grad():  # a reference that differs from the policy, so the log-ratios are not all 0
        for p in reference.parameters():
            p.add_(0.02 * torch.randn_like(p))
    ours = _ftcli_step(policy, PreferenceConfig(loss, beta=BETA), blk, reference)

    trl_policy = copy.deepcopy(policy).train()
    trl_policy.set_attn_implementation("sdpa")
    reference.set_attn_implementation("sdpa")
    kernels.disable_packed_kernels()
    examples = _sides(pairs)
    trainer = DPOTrainer(model=trl_policy, ref_model=copy.deepcopy(reference), processing_class=tok,
                         args=_args(tmp_path, DPOConfig, loss_type=[loss], beta=BETA, max_length=None),
                         train_dataset=Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}]))
    batch = trainer.data_collator(examples)
    trl_policy.zero_grad()
    trl_loss = trainer.compute_loss(trl_policy, batch)
    trl_loss.backward()
    _assert_same(ours, float(trl_loss), _trl_grads(trl_policy))
    _assert_metrics(ours[1], {k: v[-1] for k, v in trainer._metrics["train"].items()})


def _cpo_batch(pairs):
    """CPO/ORPO batches: per side input ids, attention mask, labels (-100 over the prompt)."""
    from torch.nn.utils.rnn import pad_sequence

    batch = {}
    for side in ("chosen", "rejected"):
        ids, labels = [], []
        for ex in _sides(pairs):
            seq = ex["prompt_ids"] + ex[f"{side}_ids"]
            ids.append(torch.tensor(seq))
            labels.append(torch.tensor([-100] * len(ex["prompt_ids"]) + ex[f"{side}_ids"]))
        batch[f"{side}_input_ids"] = pad_sequence(ids, batch_first=True, padding_value=0)
        batch[f"{side}_attention_mask"] = pad_sequence([torch.ones(len(x), dtype=torch.long) for x in ids],
                                                       batch_first=True)
        batch[f"{side}_labels"] = pad_sequence(labels, batch_first=True, padding_value=-100)
    return batch


def _assert_trl_batch_step(ours, model, trainer_cls, args, tok, pairs):
    """TRL's CPO/ORPO trainer's loss, gradients and metrics on the same pairs, on a copy of the model (its
    trainers tokenize their own dataset: a one-row dummy; the batch is ftcli's token ids)."""
    from datasets import Dataset

    trl_model = copy.deepcopy(model).train()
    trl_model.set_attn_implementation("sdpa")
    kernels.disable_packed_kernels()
    trainer = trainer_cls(model=trl_model, args=args, processing_class=tok,
                          train_dataset=Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}]))
    trl_model.zero_grad()
    loss, metrics = trainer.get_batch_loss_metrics(trl_model, _cpo_batch(pairs))
    loss.backward()
    _assert_same(ours, float(loss), _trl_grads(trl_model))
    _assert_metrics(ours[1], metrics)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_simpo_step_equals_trl_cpo_trainer(smoothing, tmp_path):
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    tok = tokenizer("tokenizer-llama3")
    pairs = encoded_pairs(tok, ROWS[:3])
    blk = packed_block(tok, pairs)
    model = tiny_model("llama")
    cfg = PreferenceConfig("simpo", beta=2.0, simpo_gamma=0.7, label_smoothing=smoothing)
    ours = _ftcli_step(model, cfg, blk)
    args = _args(tmp_path, CPOConfig, loss_type="simpo", cpo_alpha=0.0, beta=2.0, simpo_gamma=0.7,
                 label_smoothing=smoothing)
    _assert_trl_batch_step(ours, model, CPOTrainer, args, tok, pairs)


def test_orpo_step_equals_trl_orpo_trainer(tmp_path):
    """TRL's ORPO NLL is over every token of the chosen sequences, prompt included, averaged over the batch's tokens;
    ftcli's is each chosen completion's mean token NLL (the paper's per-example SFT term), averaged over pairs. With
    a one-token prompt (label 0 is never a target) and equally long chosen completions the two are the same number,
    so the oracle holds exactly there; the odds-ratio term is the same on any pair."""
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    tok = tokenizer("tokenizer-llama3")
    rng = np.random.default_rng(0)
    pairs = []
    for i in range(3):  # one prompt token, chosen of 6 tokens, rejected of 8, 6, 4; every completion token trained
        prompt = rng.integers(10, 1000, 1).astype(np.int32)
        c, r = (rng.integers(10, 1000, n).astype(np.int32) for n in (6, 8 - 2 * i))
        pairs.append((i, np.concatenate([prompt, c]), np.r_[False, np.ones(len(c), bool)],
                      np.concatenate([prompt, r]), np.r_[False, np.ones(len(r), bool)]))
    blk = packed_block(tok, pairs)
    model = tiny_model("llama")
    ours = _ftcli_step(model, PreferenceConfig("orpo", orpo_lambda=0.25), blk)
    _assert_trl_batch_step(ours, model, ORPOTrainer, _args(tmp_path, ORPOConfig, beta=0.25), tok, pairs)


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
    whole = _ftcli_step(model, cfg, packed_block(tok, pairs), reference)
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
