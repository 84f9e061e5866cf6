"""Tokenize + mask + pack throughput on one core: ftcli vs the published loop's method vs TRL, side by side.

    nice -n 10 taskset -c 1 python benchmarks/data_pipeline.py [--conversations 20000] [--block-len 4096]

Data: generated multi-turn conversations (1-8 assistant turns, mean about 2.9; half with a system
prompt; log-normal turn lengths: short prompts, long-tailed answers), rendered with the real Qwen3.8 chat
template and the shipped tiny tokenizer (ftcli/assets/tokenizer-qwen). All methods start from the same
in-memory rows and end with packed blocks in memory:

* ftcli            ChatEncoder.encode (skeleton per conversation shape + one render + one tokenization)
                   -> pack_split (the published loop's packing)
* reference        the published qwen-b300 loop's method (two apply_chat_template(tokenize=True) calls per assistant
                   turn, token-count differences) -> the same pack_split
* reference-core   the published loop's per-turn renders done with ftcli's fast primitives (compiled
                   template, one backend encode per render): the algorithmic cost alone, no HF overhead
* trl              SFTTrainer._prepare_dataset (TRL 1.16): assistant_only_loss with the qwen3_8_training
                   twin's {% generation %} masks, build labels, pack_dataset(bfd)
* ftcli-e2e        ftcli.data.prepare from a JSONL file: read, validate, tokenize, pack, write the cache

Times are CPU seconds of this process (`time.process_time`), so other load on a shared machine does not
count. Each method reports tokens/s over the tokens it produced (the same conversations; TRL's count differs by
nothing but its own masking, tokens are identical).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
PER_CONV: dict[str, list] = {"ftcli": [], "reference": []}  # (conversation, tokens, cpu seconds) of encode
WORDS = (
    "the capital of Kenya is Nairobi count from one to nine river quiet light window garden apple stone cloud "
    "green table happy music ocean tiger paper Sweden Italy Rome Stockholm Paris France what plus repeat after "
    "me reverse letters a b c d e f g h 1 2 3 4 5 6 7 8 9 10 11 12 13 , . ? !"
).split()


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)

    def text(median_words: float, sigma: float) -> str:
        k = max(1, min(4000, int(rng.lognormvariate(math.log(median_words), sigma))))
        return " ".join(rng.choice(WORDS) for _ in range(k))

    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": text(12, 0.5)}] if rng.random() < 0.5 else []
        for _ in range(min(8, 1 + int(rng.expovariate(1 / 2.5)))):
            messages.append({"role": "user", "content": text(25, 0.9)})
            messages.append({"role": "assistant", "content": text(110, 0.9)})
        out.append(messages)
    return out


def run_ftcli(tok, convs, block_len):
    import numpy as np

    from ftcli.data.chat import ChatEncoder
    from ftcli.data.packing import pack_split
    from ftcli.data.stats import DataStats

    enc = ChatEncoder(tok)

    def examples():
        for i, m in enumerate(convs):
            t = time.process_time()
            ids, mask = enc.encode(m)
            PER_CONV["ftcli"].append((m, len(ids), time.process_time() - t))
            yield i, ids, mask

    blocks = list(pack_split(examples(), block_len, DataStats()))
    tokens = sum(len(b[0]) for b in blocks)
    trained = int(sum(np.count_nonzero(b[1]) for b in blocks))
    return tokens, trained, f"{len(enc._skeletons)} shapes, {enc.calls['fallback']} re-rendered"


def run_reference(tok, convs, block_len):
    import numpy as np

    from ftcli.data.chat import reference_encode
    from ftcli.data.packing import pack_split
    from ftcli.data.stats import DataStats

    def examples():
        for i, m in enumerate(convs):
            t = time.process_time()
            ids, mask = reference_encode(tok, m)
            PER_CONV["reference"].append((m, len(ids), time.process_time() - t))
            yield i, ids, mask

    blocks = list(pack_split(examples(), block_len, DataStats()))
    return sum(len(b[0]) for b in blocks), int(sum(np.count_nonzero(b[1]) for b in blocks)), ""


def run_reference_core(tok, convs, block_len):
    import numpy as np

    from ftcli.data.chat import ChatEncoder, normalize_messages
    from ftcli.data.packing import pack_split
    from ftcli.data.stats import DataStats

    enc = ChatEncoder(tok)
    backend = tok.backend_tokenizer

    def n_tokens(msgs, gen=False):
        return len(backend.encode(enc.render(msgs, gen), add_special_tokens=False).ids)

    def examples():
        for i, m in enumerate(convs):
            m = normalize_messages(m)
            ids = np.asarray(backend.encode(enc.render(m), add_special_tokens=False).ids, dtype=np.int32)
            mask = np.zeros(len(ids), bool)
            for t, x in enumerate(m):
                if x["role"] == "assistant":
                    mask[n_tokens(m[:t], True) : n_tokens(m[: t + 1])] = True
            yield i, ids, mask

    blocks = list(pack_split(examples(), block_len, DataStats()))
    return sum(len(b[0]) for b in blocks), int(sum(np.count_nonzero(b[1]) for b in blocks)), ""


def run_trl(tok, convs, block_len):
    import datasets
    import trl
    from trl import SFTConfig, SFTTrainer

    datasets.disable_progress_bars()
    twin = (Path(trl.__file__).parent / "chat_templates" / "qwen3_8_training.jinja").read_text()
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(
            output_dir=out, assistant_only_loss=True, packing=True, packing_strategy="bfd", max_length=block_len,
            dataset_num_proc=None, report_to=[], bf16=False, use_cpu=True,
        )
        # SFTTrainer's own preparation, without building a model: the method only reads these attributes.
        stub = type("Stub", (), {"_tokenizer": tok, "chat_template": twin, "completion_only_loss": False})()
        ds = datasets.Dataset.from_list([{"messages": m} for m in convs])
        start = time.process_time()
        packed = SFTTrainer._prepare_dataset(stub, ds, tok, args, True, None, "train")
        seconds = time.process_time() - start
    lengths = packed["seq_lengths"]
    tokens = sum(sum(x) for x in lengths)
    trained = sum(sum(1 for v in row if v != -100) for row in packed["labels"])
    return tokens, trained, f"{len(packed)} bfd rows", seconds


def run_e2e(tok, convs, block_len):
    from ftcli.data import prepare_blocks
    from ftcli.config.recipe import load_recipe

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chats.jsonl"
        with open(path, "w") as f:
            for m in convs:
                f.write(json.dumps({"messages": m}) + "\n")
        recipe = load_recipe(
            "tiny-qwen-cpu",
            [f"data.path={path}", f"data.cache_dir={tmp}/cache", f"data.packing.block_len={block_len}"],
        )
        start = time.process_time()
        packed = prepare_blocks(recipe, tok)
        seconds = time.process_time() - start
        return packed.stats.tokens, int(packed.block_trained.sum()), f"{len(packed)} blocks on disk", seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=20000)
    ap.add_argument("--block-len", type=int, default=4096)
    ap.add_argument("--methods", default="ftcli,reference,reference-core,trl,ftcli-e2e",
                    help="comma-separated (module doc); reference, reference-core: the published loop's method")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ROOT / "ftcli" / "assets" / "tokenizer-qwen"))
    convs = conversations(args.conversations)
    warm = conversations(50, seed=1)  # one-time costs (template compile, tokenizer thread pools) outside the timing
    from ftcli.data.chat import ChatEncoder, reference_encode

    for m in warm:
        ChatEncoder(tok).encode(m) if m is warm[0] else reference_encode(tok, m)
    turns = sum(sum(m["role"] == "assistant" for m in c) for c in convs)
    print(f"{len(convs)} conversations, {turns / len(convs):.2f} assistant turns each, block_len {args.block_len}")
    runners = {
        "ftcli": run_ftcli, "reference": run_reference, "reference-core": run_reference_core,
        "trl": run_trl, "ftcli-e2e": run_e2e,
    }
    results = []
    for name in args.methods.split(","):
        start = time.process_time()
        out = runners[name](tok, convs, args.block_len)
        seconds = out[3] if len(out) > 3 else time.process_time() - start
        tokens, trained, note = out[:3]
        results.append({"method": name, "seconds": round(seconds, 2), "tokens": tokens, "trained_tokens": trained,
                        "tokens_per_s": round(tokens / seconds), "note": note})
        print(f"{name:15s} {seconds:8.2f} s  {tokens:>11,d} tokens  {tokens / seconds:>11,.0f} tok/s  "
              f"trained {trained:,d}  {note}", flush=True)
    base = {r["method"]: r["tokens_per_s"] for r in results}
    if "ftcli" in base and "reference" in base:
        print(f"ftcli / published loop: {base['ftcli'] / base['reference']:.1f}x")
        for lo, hi in ((1, 1), (2, 3), (4, 8)):
            rates = {}
            for name in ("ftcli", "reference"):
                rows = [(n, t) for m, n, t in PER_CONV[name] if lo <= sum(x["role"] == "assistant" for x in m) <= hi]
                rates[name] = sum(n for n, _ in rows) / sum(t for _, t in rows)
            print(f"  {lo}-{hi} turns ({len(rows)} conversations): tokenize+mask ftcli {rates['ftcli']:,.0f} tok/s, "
                  f"published loop {rates['reference']:,.0f} tok/s, {rates['ftcli'] / rates['reference']:.1f}x")
            per_s = {f"{k}_tokens_per_s": round(v) for k, v in rates.items()}
            results.append({"turns": f"{lo}-{hi}", "conversations": len(rows), **per_s})
    meta = {"date": str(date.today()), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "conversations": len(convs), "block_len": args.block_len}
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
