"""TRL's preference trainers as the oracle of ftcli's preference step: DPOTrainer (sigmoid, ipo), CPOTrainer with
loss_type=simpo and cpo_alpha=0 (simpo), ORPOTrainer (orpo) of TRL 1.16, given the same token ids, on a copy of the
same model; loss, every parameter's gradient and the logged metrics must agree.

CPU, float32, the tiny llama of ftcli/assets; ftcli's side is tests/support/_preference_common.py's one-block step
(packed kernels, chunked `sequence_logps`). Here and not in the unit tier: each test builds a TRL trainer (TRL's
import alone is seconds per process).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from _preference_common import BETA, ROWS, encoded_pairs, ftcli_step, packed_block, tiny_model, tokenizer
from ftcli.model import kernels
from ftcli.train.preference import PreferenceConfig, PreferenceSums

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(autouse=True)
def _uninstall_after_each_test():
    yield
    kernels.disable_packed_kernels()


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
    ours = ftcli_step(policy, PreferenceConfig(loss, beta=BETA), blk, reference)

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
    ours = ftcli_step(model, cfg, blk)
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
    ours = ftcli_step(model, PreferenceConfig("orpo", orpo_lambda=0.25), blk)
    _assert_trl_batch_step(ours, model, ORPOTrainer, _args(tmp_path, ORPOConfig, beta=0.25), tok, pairs)
