"""Shared fixtures for tests/test_data_*.py: tokenizers, real templates, seeded conversations."""

from __future__ import annotations

import json
import random
from functools import lru_cache
from pathlib import Path

import numpy as np

ASSETS = Path(__file__).resolve().parents[2] / "ftcli" / "assets"
WORDS = "the capital of Kenya is Nairobi count from one to nine river quiet light 7 plus 6 13 ok , . ?".split()


@lru_cache(maxsize=None)
def template(name: str) -> str:
    """TRL's shipped chat template `name`, read from TRL's package dir without importing TRL (seconds per process)."""
    import importlib.util

    (trl_dir,) = importlib.util.find_spec("trl").submodule_search_locations
    return (Path(trl_dir) / "chat_templates" / f"{name}.jinja").read_text()


@lru_cache(maxsize=None)
def tokenizer(name: str = "qwen"):
    """The shipped tiny tokenizers (`qwen`, `gpt-oss`), with a bos token so Llama-3 templates render."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ASSETS / f"tokenizer-{name}"))
    tok.add_special_tokens({"bos_token": "<|startoftext|>"})
    return tok


@lru_cache(maxsize=None)
def merging_tokenizer():
    """A byte-level BPE with an NFC normalizer (like Qwen's) that merges whitespace runs ("\\n\\n" is one
    token), so token boundaries and template boundaries disagree the way they do in real vocabularies."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|startoftext|>",
        "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    ]
    rng = random.Random(0)
    corpus = [
        " ".join(rng.choice(WORDS) for _ in range(20)) + rng.choice(["\n", "\n\n", "\n\n\n", " \n", ".\n\n", ": "])
        for _ in range(1500)
    ]
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()  # like Qwen's
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token="<|startoftext|>",
        additional_special_tokens=specials,
    )


def _text(rng: random.Random, edgy: bool) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 10)))
    if edgy:
        r = rng.random()
        if r < 0.1:
            text = " " + text  # leading space: templates that trim change it
        elif r < 0.2:
            text = text + "\n"
        elif r < 0.25:
            text = text + "\n\n" + text
    return text


def conversations(n: int, seed: int = 0, reasoning: bool = True, edgy: bool = True) -> list[list[dict]]:
    """Multi-turn conversations, half with a system prompt, some with reasoning and edge whitespace."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": _text(rng, edgy)})
        for _ in range(rng.randint(1, 4)):
            messages.append({"role": "user", "content": _text(rng, edgy)})
            reply = {"role": "assistant", "content": _text(rng, edgy)}
            if reasoning and rng.random() < 0.2:
                reply["reasoning_content"] = _text(rng, edgy)
            messages.append(reply)
        out.append(messages)
    return out


def runs(tok, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """Decoded text of each maximal run of masked-in tokens."""
    idx = np.nonzero(mask)[0]
    if not len(idx):
        return []
    return [tok.decode(ids[r].tolist()) for r in np.split(idx, np.nonzero(np.diff(idx) > 1)[0] + 1)]


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row))
            f.write("\n")
    return path


def recipe(tmp_path: Path, name: str = "tiny-qwen-cpu", **overrides):
    """A built-in recipe with its cache in tmp_path and `data.x.y=value` overrides; every row trains (no
    eval holdout: these tests count the rows of the data path)."""
    from ftcli.config.recipe import load_recipe

    sets = ["eval=null", f"data.cache_dir={tmp_path / 'cache'}"] + [f"{k.replace('__', '.')}={v}" for k, v in overrides.items()]
    if "data__sources" in overrides:  # a mix instead of the recipe's one source (its shorthand keys dropped)
        sets.insert(2, "data.path=null")
    return load_recipe(name, sets)


# Turns for hand-written rows; BAD_ROWS: one row of each kind the reader skips, good rows between (index: why)
U = {"role": "user", "content": "What is 7 plus 6?"}
A = {"role": "assistant", "content": "13"}
S = {"role": "system", "content": "Be brief."}

BAD_ROWS = [
    {"messages": [U, A]},  # 0 ok
    '{"messages": [',  # 1 invalid JSON
    {"conversation": [U, A]},  # 2 messages missing
    {"messages": "hello"},  # 3 not a list
    {"messages": [U, {"role": "robot", "content": "beep"}]},  # 4 unknown role
    {"messages": [U, {"role": "assistant", "content": 13}]},  # 5 content not a string
    {"messages": [U, {"role": "assistant", "content": "  "}]},  # 6 empty turn dropped: no assistant turn
    {"messages": [S, U]},  # 7 no assistant turn
    {"messages": [U, A, U]},  # 8 ok: the trailing user turn is dropped (counted)
    {"messages": [U, S, A]},  # 9 system not first
    {"messages": [S, U, A, U, A]},  # 10 ok
    {"messages": []},  # 11 no messages
    {"messages": [U, {"role": "robot", "content": "x"}]},  # 12 unknown role
]
