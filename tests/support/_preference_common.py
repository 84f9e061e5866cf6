"""The preference tests' shared pieces (tests/unit/objectives/test_preference_loss.py, whose log-probs and losses
they check, and tests/e2e/test_preference_trl_oracle.py, which holds TRL's trainers against the same step): the tiny
models and tokenizers of ftcli/assets, the rows, the packed block, ftcli's packed and stock transformers' separate
log-probs, ftcli's one-block step."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from ftcli.data.collate import block_to_model_inputs
from ftcli.data.packing import make_block, pack_pairs
from ftcli.data.preference import PairEncoder, pair
from ftcli.model import kernels
from ftcli.train.preference import PreferenceConfig, SideLogps, pair_loss_sum, sequence_logps

ASSETS = Path(__file__).resolve().parents[2] / "ftcli" / "assets"
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


def packed_logps(model, model_type, blk, chunk=CHUNK, host_positions=False):
    """Per-segment (sums, counts) of a packed block; `host_positions`: with the collated trained_positions (what
    the loop passes) instead of finding them on the device."""
    attn, _ = kernels.enable_packed_kernels(model_type, "cpu")
    model.set_attn_implementation(attn)
    inputs = block_to_model_inputs(blk)
    labels, seq_idx = inputs.pop("labels"), inputs["seq_idx"]
    positions = inputs.pop("trained_positions")
    hidden = model.model(**inputs, use_cache=False).last_hidden_state
    return sequence_logps(hidden, model.lm_head.weight, labels, seq_idx, len(blk.cu_seqlens) - 1, chunk,
                          positions if host_positions else None)


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


BETA = 0.3


def ftcli_step(model, cfg: PreferenceConfig, blk, reference=None):
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
