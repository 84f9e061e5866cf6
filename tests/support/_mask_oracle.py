"""The structural mask oracle of tests/unit/data/test_data_masks.py (its docstring says how it works), shared with
the tests that check other row forms against it (tests/unit/data/test_preference_data.py): the tokenizers each
template is checked with, and `oracle(name, tok, ids)`, the tokens the assistant generates, found from the token ids
alone (no code shared with ftcli.data.chat)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from _data_common import ASSETS, merging_tokenizer, template

EXTRA_TOKENS = {
    "llama3": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"],
    "gemma3": ["<start_of_turn>", "<end_of_turn>"],
}
FAMILY = {"qwen3_8": "chatml", "qwen2_5": "chatml", "qwen3_5_think": "chatml", "qwen3": "chatml",
          "gptoss": "harmony", "llama3": "llama3", "gemma3": "gemma",
          # a vocabulary that merges whitespace runs: tokens straddle template boundaries (`<think>\n|\n`)
          "qwen3_8@merging": "chatml", "llama3@merging": "llama3",
          # the families' own shipped tiny tokenizers (ftcli/assets/tokenizer-<family>: their template, their specials)
          "llama3@tiny": "llama3", "qwen3@tiny": "chatml", "gemma3@tiny": "gemma"}

@lru_cache(maxsize=None)
def _tokenizer(name: str):
    from transformers import AutoTokenizer

    if name.endswith("@tiny"):
        return AutoTokenizer.from_pretrained(str(ASSETS / f"tokenizer-{name.split('@')[0]}"))
    if name.endswith("@merging"):
        tok = merging_tokenizer()
        tok.chat_template = template(name.split("@")[0])
        return tok
    base = "gpt-oss" if name == "gptoss" else "qwen"
    tok = AutoTokenizer.from_pretrained(str(ASSETS / f"tokenizer-{base}"))
    tok.add_special_tokens({"bos_token": "<|startoftext|>"})
    if name in EXTRA_TOKENS:
        tok.add_special_tokens({"additional_special_tokens": EXTRA_TOKENS[name]})
    if name not in ("qwen3_8", "gptoss"):  # the shipped templates are the tokenizers' own
        tok.chat_template = template(name)
    return tok


# ------------------------------------------------------------------------------------------ oracle
def _skip(tok, ids, k: int, text: str) -> int:
    """Past the tokens that start inside `text`, which the stream spells from token k on; k itself if
    the stream does not start with `text`."""
    if not tok.decode(ids[k : k + len(text) + 1]).startswith(text):
        return k
    j = k
    while j < len(ids) and len(tok.decode(ids[k:j])) < len(text):
        j += 1
    return j


def _prefill(tok) -> str:
    """What the generation prompt adds after the assistant header (Qwen3's `<think>\\n`)."""
    user = [{"role": "user", "content": "x"}]
    with_prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    head = with_prompt[len(tok.apply_chat_template(user, tokenize=False)) :]
    for header in ("<|im_start|>assistant\n", "<start_of_turn>model\n",
                   "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|start|>assistant"):
        if head.startswith(header):
            return head[len(header) :]
    raise AssertionError(f"unknown generation prompt {head!r}")


def _header_oracle(tok, ids, start_tok, role_end, assistant_role, prefill):
    """ChatML / Llama-3 / Gemma: (mask, roles seen)."""
    tid = tok.convert_tokens_to_ids
    heads = [k for k, t in enumerate(ids) if t == tid(start_tok)]
    mask = np.zeros(len(ids), dtype=bool)
    for j, h in enumerate(heads):
        nxt = heads[j + 1] if j + 1 < len(heads) else len(ids)
        k = h + 1
        while k < nxt and role_end not in tok.decode(ids[h + 1 : k + 1]):
            k += 1
        role = tok.decode(ids[h + 1 : k + 1]).split(role_end)[0]
        if role != assistant_role:
            continue
        body = _skip(tok, ids, h + 1, role + role_end)
        body = _skip(tok, ids, body, prefill) if prefill else body
        mask[body:nxt] = True
    return mask


def _harmony_oracle(tok, ids):
    tid = tok.convert_tokens_to_ids
    start, end, call, ret, message = (tid(t) for t in ("<|start|>", "<|end|>", "<|call|>", "<|return|>", "<|message|>"))
    mask = np.zeros(len(ids), dtype=bool)
    k, prev_open = 0, False
    while k < len(ids):
        if ids[k] != start:
            k += 1
            continue
        m = ids.index(message, k)
        t = next(j for j in range(m, len(ids)) if ids[j] in (end, call, ret))
        head = tok.decode(ids[k + 1 : m])
        role = head.split("<|channel|>")[0].split(" ")[0]
        channel = head.split("<|channel|>")[1].split(" ")[0] if "<|channel|>" in head else ""
        if role == "assistant":
            a = k if prev_open else _skip(tok, ids, k + 1, "assistant")
            b = t if (ids[t] == end and channel == "final") else t + 1
            mask[a:b] = True
            prev_open = ids[t] == end and channel != "final"
        else:
            prev_open = False
        k = t + 1
    return mask


def oracle(name: str, tok, ids: list[int]) -> np.ndarray:
    family = FAMILY[name]
    name = name.split("@")[0]
    if family == "harmony":
        return _harmony_oracle(tok, ids)
    prefill = _prefill(tok)
    if family == "chatml":
        return _header_oracle(tok, ids, "<|im_start|>", "\n", "assistant", prefill)
    if family == "llama3":
        return _header_oracle(tok, ids, "<|start_header_id|>", "<|end_header_id|>\n\n", "assistant", prefill)
    return _header_oracle(tok, ids, "<start_of_turn>", "\n", "model", prefill)
