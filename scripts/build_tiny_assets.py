"""Build the tiny assets shipped in ftcli/assets (deterministic; rerun only to change them).

- `tiny_chat.jsonl`: multi-turn chats on tasks a tiny model can learn in two CPU minutes
  (capitals, reversing letter lists, counting, echoing, small sums), some with a system prompt.
- `tokenizer-qwen/`, `tokenizer-gpt-oss/`: one byte-level BPE (vocab 1024) trained on the chats as
  rendered by the real Qwen3.8 and gpt-oss chat templates shipped in TRL, saved with that template.
- `tiny-qwen3_5.json`, `tiny-gpt-oss.json`: tiny model configs (Qwen3.5 hybrid: linear + full
  attention layers; gpt-oss: sliding + full attention with sinks, 4 experts top-2).
- `tokenizer-llama3/`, `tokenizer-qwen3/`, `tokenizer-gemma3/`: a second byte-level BPE (vocab 1024), trained
  the same way on the chats as the Llama 3.1, Qwen3 and Gemma 3 templates shipped in TRL render them (built
  after, and independent of, the two above, so those stay byte-identical), each saved with its template,
  its family's special tokens and its end-of-turn token as eos (`<|eot_id|>`, `<|im_end|>`, `<end_of_turn>`).
- `tiny-llama3.json`, `tiny-qwen3.json`, `tiny-qwen3-moe.json`, `tiny-gemma3.json`: tiny configs of those
  families (Llama: llama3 RoPE scaling; Qwen3-MoE: 4 experts top-2; Gemma 3: 2 sliding + 1 global layer).

    python scripts/build_tiny_assets.py
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import trl
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ASSETS = Path(__file__).resolve().parents[1] / "ftcli" / "assets"
TEMPLATES = Path(trl.__file__).parent / "chat_templates"
VOCAB = 1024
# The gpt-oss template writes today's date into every system header ("Current date: ..."); the corpus is rendered
# with this one, so the BPE (and every shipped id) does not depend on the day the script runs.
CORPUS_DATE = "2026-12-01"

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "Canada": "Ottawa", "Egypt": "Cairo", "Peru": "Lima", "Kenya": "Nairobi", "Norway": "Oslo",
    "Greece": "Athens", "Chile": "Santiago", "Cuba": "Havana", "Poland": "Warsaw", "Austria": "Vienna",
    "Ireland": "Dublin", "Portugal": "Lisbon", "Sweden": "Stockholm", "Finland": "Helsinki", "India": "New Delhi",
}
WORDS = "apple river stone cloud green quiet light table happy music ocean tiger paper window garden".split()
SYSTEMS = ["You are a helpful assistant.", "Answer briefly.", "You are a careful tutor."]


def task(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(5)
    if kind == 0:
        country = rng.choice(list(CAPITALS))
        return f"What is the capital of {country}?", f"The capital of {country} is {CAPITALS[country]}."
    if kind == 1:
        letters = [rng.choice("abcdefgh") for _ in range(rng.randint(3, 7))]
        return f"Reverse the letters: {' '.join(letters)}", " ".join(reversed(letters))
    if kind == 2:
        n = rng.randint(2, 9)
        return f"Count from 1 to {n}.", " ".join(str(i) for i in range(1, n + 1))
    if kind == 3:
        words = rng.sample(WORDS, rng.randint(2, 4))
        return f"Repeat after me: {' '.join(words)}", f"{' '.join(words)}"
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."


def conversation(rng: random.Random) -> dict:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    for _ in range(rng.choice([1, 1, 2, 3])):
        user, assistant = task(rng)
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"messages": messages}


def train_bpe(corpus: list[str], specials: list[str]):
    """A byte-level BPE of VOCAB entries trained on `corpus`, the special tokens first."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(corpus, trainer)
    return bpe


def main() -> None:
    rng = random.Random(0)
    rows = [conversation(rng) for _ in range(3000)]
    ASSETS.mkdir(parents=True, exist_ok=True)
    with open(ASSETS / "tiny_chat.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")

    templates = {
        "tokenizer-qwen": (TEMPLATES / "qwen3_8.jinja").read_text(),
        "tokenizer-gpt-oss": (TEMPLATES / "gptoss.jinja").read_text(),
    }
    specials = [
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
        "<|startoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>",
        "<|constrain|>",
    ]
    # Train the BPE on the chats as both real templates render them, so template text is cheap too.
    corpus = []
    for name, template in templates.items():
        probe = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), chat_template=template)
        corpus += [re.sub(r"Current date: \d{4}-\d{2}-\d{2}", f"Current date: {CORPUS_DATE}",
                          probe.apply_chat_template(r["messages"], tokenize=False)) for r in rows[:600]]
    corpus += [m["content"] for r in rows for m in r["messages"]]

    bpe = train_bpe(corpus, specials)

    for name, template in templates.items():
        eos = "<|im_end|>" if "qwen" in name else "<|return|>"
        tok = PreTrainedTokenizerFast(
            tokenizer_object=bpe, chat_template=template, eos_token=eos, pad_token="<|endoftext|>",
            bos_token=None, unk_token=None, additional_special_tokens=specials,
        )
        tok.save_pretrained(ASSETS / name)

    ids = {t: bpe.token_to_id(t) for t in specials}
    qwen = {
        "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
        "vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "partial_rotary_factor": 0.25,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"], "bos_token_id": None,
    }
    gpt_oss = {
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
        "vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "attention_bias": True,
        "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "router_aux_loss_coef": 0.0,
        "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                            "rope_theta": 150000.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
        "eos_token_id": ids["<|return|>"], "pad_token_id": ids["<|endoftext|>"],
    }
    (ASSETS / "tiny-qwen3_5.json").write_text(json.dumps(qwen, indent=2) + "\n")
    (ASSETS / "tiny-gpt-oss.json").write_text(json.dumps(gpt_oss, indent=2) + "\n")
    build_dense_families(rows)
    print(f"wrote {len(rows)} chats, vocab {bpe.get_vocab_size()}, assets in {ASSETS}")


# name -> (TRL template, special tokens, eos = the template's end-of-turn token, bos (the template emits it), pad)
DENSE_TOKENIZERS = {
    "tokenizer-llama3": ("llama3_1", ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                      "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
                         "<|eot_id|>", "<|begin_of_text|>", "<|end_of_text|>"),
    "tokenizer-qwen3": ("qwen3", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
                        "<|im_end|>", None, "<|endoftext|>"),
    "tokenizer-gemma3": ("gemma3", ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
                         "<end_of_turn>", "<bos>", "<pad>"),
}


def build_dense_families(rows: list[dict]) -> None:
    specials = list(dict.fromkeys(t for _, toks, *_ in DENSE_TOKENIZERS.values() for t in toks))
    templates = {name: (TEMPLATES / f"{spec[0]}.jinja").read_text() for name, spec in DENSE_TOKENIZERS.items()}
    corpus = []
    for name, template in templates.items():
        _, _, _, bos, _ = DENSE_TOKENIZERS[name]
        probe = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), chat_template=template,
                                        bos_token=bos)
        # Gemma's template refuses nothing here: the chats alternate user/assistant after an optional system turn
        corpus += [probe.apply_chat_template(r["messages"], tokenize=False) for r in rows[:600]]
    corpus += [m["content"] for r in rows for m in r["messages"]]

    bpe = train_bpe(corpus, specials)
    for name, (_, own, eos, bos, pad) in DENSE_TOKENIZERS.items():
        tok = PreTrainedTokenizerFast(
            tokenizer_object=bpe, chat_template=templates[name], eos_token=eos, pad_token=pad,
            bos_token=bos, unk_token=None, additional_special_tokens=own,
        )
        tok.save_pretrained(ASSETS / name)

    ids = {t: bpe.token_to_id(t) for t in specials}
    small = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=352, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=False)
    configs = {
        "tiny-llama3.json": {
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], **small, "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 512},
            "bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": ids["<|eot_id|>"],
            "pad_token_id": ids["<|end_of_text|>"],
        },
        "tiny-qwen3.json": {
            "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **small, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"], "bos_token_id": None,
        },
        "tiny-qwen3-moe.json": {
            "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], **small, "num_hidden_layers": 2,
            "moe_intermediate_size": 96, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
            "router_aux_loss_coef": 0.0, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"], "bos_token_id": None,
        },
        "tiny-gemma3.json": {
            "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], **small, "tie_word_embeddings": True,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"], "sliding_window": 64,
            "query_pre_attn_scalar": 32, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
            "bos_token_id": ids["<bos>"], "eos_token_id": ids["<end_of_turn>"], "pad_token_id": ids["<pad>"],
        },
    }
    for file, cfg in configs.items():
        (ASSETS / file).write_text(json.dumps(cfg, indent=2) + "\n")


if __name__ == "__main__":
    main()
