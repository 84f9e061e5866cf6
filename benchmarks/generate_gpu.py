"""Decoding speed of `ftcli generate` on one GPU: a random-init gpt-oss-20b (bf16, the real shape)
through ftcli.commands.generate's own code path: `stream_reply` (one streamed prompt, what `ftcli generate
--prompt` and `ftcli chat` run) and `generate` (left-padded batches, what `--input FILE.jsonl` runs).

    python3 benchmarks/generate_gpu.py [--config benchmarks/gpt-oss-20b.json] [--new-tokens 256]
        [--batches 1,8,32] [--device cuda]

The prompt is the published example's demo (system `reasoning language: German`, user
`¿Cuál es el capital de Australia?`, temperature 0.6); batches take the first user turns of the shipped
tiny_chat.jsonl. Random weights rarely hit a stop token, so nearly every reply runs to --new-tokens;
the counts printed are the tokens actually generated. The tokenizer is the shipped tiny gpt-oss one
(same template and special tokens; ids past its 1024 entries decode to nothing), which changes nothing
in the model's work.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    from transformers import AutoTokenizer

    from ftcli import inference as generate
    from ftcli.model.build import load_model
    from ftcli.config.recipe import ModelConfig, resolve_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="benchmarks/gpt-oss-20b.json")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    torch.manual_seed(0)
    start = time.perf_counter()
    model = load_model(ModelConfig(init="random", config=args.config, tokenizer="unused", model_type="gpt_oss",
                                   dtype=args.dtype), device=args.device)
    model.eval()
    model.config.use_cache = True
    build_s = time.perf_counter() - start
    tok = AutoTokenizer.from_pretrained(resolve_path("pkg://assets/tokenizer-gpt-oss"))
    loaded = generate.LoadedModel(model=model, tokenizer=tok, stop_ids=generate.stop_token_ids(tok, model),
                                  source=generate.ModelSource(model=f"random init {args.config}"))
    params = sum(p.numel() for p in model.parameters())
    card = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"{card}: {params / 1e9:.2f}B params in {args.dtype}, built in {build_s:.1f} s, "
          f"torch {torch.__version__}", flush=True)

    demo = generate.conversation("¿Cuál es el capital de Australia?", generate.system_prompt(None, "German"))
    sampling = generate.Sampling(max_new_tokens=args.new_tokens, temperature=0.6, seed=0)
    generate.stream_reply(loaded, demo, generate.Sampling(max_new_tokens=8, greedy=True), write=lambda _: None)
    rows = []
    for _ in range(2):
        _, stats = generate.stream_reply(loaded, demo, sampling, write=lambda _: None)
        rows.append({"mode": "stream_reply (1 prompt)", "batch": 1, "new_tokens": stats.new_tokens,
                     "s": stats.seconds, "tokens_per_s": stats.tokens_per_s, "first_token_s": stats.first_token_s})

    with open(resolve_path("pkg://assets/tiny_chat.jsonl")) as f:
        firsts = [json.loads(line)["messages"] for line in f]
    firsts = [[m for m in conv if m["role"] == "system"][:1] + [next(m for m in conv if m["role"] == "user")]
              for conv in firsts]
    for batch in (int(b) for b in args.batches.split(",") if b):
        conversations = firsts[:batch]
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = generate.generate(loaded, conversations, sampling, batch_size=batch)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        new = sum(len(c.token_ids) for c in out)
        rows.append({"mode": "generate (left-padded batch)", "batch": batch, "new_tokens": new, "s": seconds,
                     "tokens_per_s": new / seconds, "first_token_s": None})
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else float("nan")

    print(f"\n| mode | batch | new tokens | s | tokens/s | first token s |\n| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        first = f"{r['first_token_s']:.3f}" if r["first_token_s"] is not None else "-"
        print(f"| {r['mode']} | {r['batch']} | {r['new_tokens']} | {r['s']:.2f} | {r['tokens_per_s']:.1f} | {first} |")
    print(f"\npeak memory allocated: {peak:.1f} GiB")


if __name__ == "__main__":
    main()
