"""Decoding speed of `ftcli generate` on one GPU: a random-init gpt-oss-20b (bf16, the real shape)
through ftcli.inference, the code path of ftcli generate: `stream_reply` (one streamed prompt, what `ftcli generate
--prompt` and `ftcli chat` run) and `generate` (left-padded batches, what `--input FILE.jsonl` runs).

    python3 benchmarks/generate_gpu.py [--config benchmarks/gpt-oss-20b.json] [--new-tokens 256]
        [--batches 1,8,32] [--device cuda]

`--suite decode` (issue 30) measures ftcli.model.decode instead, on random weights: per model of --models, a
greedy check against transformers' generate (names ending in `check`), then for each --batches size the time to
the first token for --prompt-len-token prompts and the decoding rate, against the bandwidth limit (the bytes one
step reads / the card's copy bandwidth, measured in the same call):

    python3 benchmarks/generate_gpu.py --suite decode --batches 1,8,32 --new-tokens 256
    python3 benchmarks/generate_gpu.py --suite decode --device cpu --dtype float32 --prompt-len 20 \
        --new-tokens 6 --batches 1,2 --check-tokens 6 \
        --models tiny-check:ftcli/assets/tiny-qwen3_5.json:qwen3_5_text,g-check:ftcli/assets/tiny-gpt-oss.json:gpt_oss

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

import common
import torch

QWEN27B = "benchmarks/qwen27b-4layer.json"  # the 27B width; --layers 64 makes it the full Qwen3.5-27B text model


def copy_bandwidth(device) -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second (median of 10)."""
    x = torch.randn(2**30 // 2, device=device, dtype=torch.float32).to(torch.bfloat16)
    x = torch.cat([x, x])  # 2 GiB
    y = torch.empty_like(x)
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del x, y
    return 2 * 2**31 / sorted(times[2:])[len(times[2:]) // 2]


def bytes_per_step(model, batch: int) -> float:
    """Bytes one decoding step must read: every weight once (embedding: one row per sequence; gpt-oss: the experts
    the batch routes to, expected under uniform routing) plus each sequence's recurrent state (read + written)."""
    from ftcli.model import decode

    d = decode.Decoder(model, use_graphs=False)
    total = 0.0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if "embed_tokens" in name:
            size = batch * p.shape[-1] * p.element_size()
        elif ".experts." in name:
            cfg = d.config
            used = cfg.num_local_experts * (1 - (1 - cfg.num_experts_per_tok / cfg.num_local_experts) ** batch)
            size *= used / cfg.num_local_experts
        total += size
    for i, layer in enumerate(d.text.layers):
        if d.model_type in decode.QWEN3_5 and d.layer_types[i] == "linear_attention":
            m = layer.linear_attn
            total += batch * 2 * m.num_v_heads * m.head_k_dim * m.head_v_dim * 4
    return total


def build_random(config: str, model_type: str, layers: int | None, device: str, dtype: str = "bfloat16"):
    from ftcli.config.recipe import ModelConfig
    from ftcli.model.build import load_model

    torch.manual_seed(0)
    overrides = {"num_hidden_layers": layers} if layers else {}
    model = load_model(ModelConfig(init="random", config=config, tokenizer="unused", model_type=model_type,
                                   dtype=dtype, config_overrides=overrides), device=device)
    model.eval()
    model.config.use_cache = True
    return model


def decode_suite(args) -> None:
    """Issue 30: ftcli.model.decode against the bandwidth limit (and transformers' generate where cheap)."""
    from ftcli.model import decode

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    bw = copy_bandwidth(device) if cuda else float("nan")
    card = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{card}: copy bandwidth {bw / 1e12:.2f} TB/s (2 GiB device-to-device, read + write), torch "
          f"{torch.__version__}", flush=True)
    rows, checks = [], []
    gen = torch.Generator().manual_seed(0)

    vocab = [30000]

    def prompt(n):
        return torch.randint(10, vocab[0], (n,), generator=gen).tolist()

    def timed(fn):
        out, seconds = common.timed(fn, device=device)
        return out, seconds[0]

    models = [m.split(":") for m in args.models.split(",") if m]
    for spec in models:
        name, config, model_type, layers = spec[0], spec[1], spec[2], int(spec[3]) if len(spec) > 3 else None
        start = time.perf_counter()
        model = build_random(config, model_type, layers, args.device, args.dtype)
        params = sum(p.numel() for p in model.parameters())
        print(f"\n{name}: {params / 1e9:.2f}B params, built in {time.perf_counter() - start:.1f} s", flush=True)
        decoder = decode.Decoder(model)
        vocab[0] = min(30000, model.config.get_text_config().vocab_size)
        if name.endswith("check"):  # greedy ids against transformers' generate on the same weights
            # gpt-oss: transformers' default GPU experts (batched_mm) gather each routed expert's weights per
            # prompt token (127 GiB for a 1k prompt), so its reference runs a 64-token prompt
            p = prompt(args.prompt_len if model_type != "gpt_oss" else min(args.prompt_len, 64))
            new = args.check_tokens
            with torch.no_grad():
                ref, hf_s = timed(lambda: model.generate(torch.tensor([p], device=device), max_new_tokens=new,
                                                         do_sample=False, eos_token_id=None, pad_token_id=0,
                                                         attention_mask=torch.ones(1, len(p), dtype=torch.long,
                                                                                   device=device)))
            ref = ref[0, len(p):].tolist()
            fast, _ = timed(lambda: decoder.generate([p], new, []))
            fast, fast_s = timed(lambda: decoder.generate([p], new, []))
            eager = decode.Decoder(model, use_graphs=False).generate([p], new, [])
            agree = next((i for i, (a, b) in enumerate(zip(ref, fast[0])) if a != b), len(ref))
            checks.append({"model": name, "tokens": new, "identical": ref == fast[0], "first_difference": agree,
                           "graph_equals_eager": eager[0] == fast[0], "transformers_s": hf_s, "fast_s": fast_s})
            print(f"check {name}: transformers {new} tokens in {hf_s:.2f} s, fast {fast_s:.2f} s; identical "
                  f"{ref == fast[0]} (first difference at {agree}); graph == eager {eager[0] == fast[0]}", flush=True)
            if ref != fast[0]:
                print(f"  transformers {ref[:agree + 3]}\n  fast         {fast[0][:agree + 3]}", flush=True)
        for batch in [int(b) for b in args.batches.split(",")]:
            prompts = [prompt(args.prompt_len) for _ in range(batch)]
            decoder.generate(prompts, args.new_tokens, [])  # capture + kernels' first compile
            _, first_s = timed(lambda: decoder.generate(prompts, 1, []))
            out, total_s = timed(lambda: decoder.generate(prompts, args.new_tokens, []))
            new = sum(len(o) for o in out)
            step_s = (total_s - first_s) / (args.new_tokens - 1)
            limit = bw / bytes_per_step(model, batch) if cuda else float("nan")
            rows.append({"model": name, "batch": batch, "prompt": args.prompt_len, "new_tokens": new,
                         "first_token_s": first_s, "tokens_per_s": batch / step_s, "per_stream": 1 / step_s,
                         "limit_steps_per_s": limit, "of_limit": (1 / step_s) / limit})
            r = rows[-1]
            r["graphs"] = decoder.use_graphs
            print(f"{name} batch {batch} (graphs {decoder.use_graphs}): first token {first_s:.3f} s ({args.prompt_len}-token prompts), "
                  f"{r['tokens_per_s']:.1f} tokens/s ({r['per_stream']:.1f} per stream; bandwidth limit "
                  f"{limit:.1f} steps/s, {100 * r['of_limit']:.0f}%)", flush=True)
        if cuda:
            print(f"peak memory {common.peak_gib():.1f} GiB", flush=True)
        del model, decoder
        decode._DECODERS.clear()
        common.reset_peak(device)
    print("\n" + common.table(
        ["model", "batch", "prompt", "first token s", "tokens/s", "per stream", "limit (steps/s)", "of limit"],
        [[r["model"], r["batch"], r["prompt"], f"{r['first_token_s']:.3f}", f"{r['tokens_per_s']:.1f}",
          f"{r['per_stream']:.1f}", f"{r['limit_steps_per_s']:.1f}", f"{100 * r['of_limit']:.0f}%"] for r in rows],
        sep=" --- "))
    for c in checks:
        print(f"check {c['model']}: {c['tokens']} greedy tokens identical to transformers: {c['identical']} "
              f"(first difference {c['first_difference']}), graph == eager: {c['graph_equals_eager']}")
    print("DECODE " + json.dumps({"bandwidth": bw, "rows": rows, "checks": checks}))


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
    ap.add_argument("--suite", choices=["stream", "decode"], default="stream",
                    help="stream: ftcli generate's own path (below); decode: ftcli.model.decode vs the bandwidth limit")
    ap.add_argument("--models", default=f"qwen27b-4l-check:{QWEN27B}:qwen3_5_text:4,qwen27b:{QWEN27B}:qwen3_5_text:64,"
                    "gpt-oss-20b-check:benchmarks/gpt-oss-20b.json:gpt_oss",
                    help="decode suite: NAME:CONFIG:MODEL_TYPE[:LAYERS],...; a NAME ending in 'check' also compares "
                    "greedy ids with transformers' generate")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--check-tokens", type=int, default=32)
    args = ap.parse_args()
    if args.suite == "decode":
        decode_suite(args)
        return

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
        out, (seconds,) = common.timed(lambda: generate.generate(loaded, conversations, sampling, batch_size=batch),
                                       device=args.device)
        new = sum(len(c.token_ids) for c in out)
        rows.append({"mode": "generate (left-padded batch)", "batch": batch, "new_tokens": new, "s": seconds,
                     "tokens_per_s": new / seconds, "first_token_s": None})
    peak = common.peak_gib(args.device) if args.device.startswith("cuda") else float("nan")

    print("\n" + common.table(
        ["mode", "batch", "new tokens", "s", "tokens/s", "first token s"],
        [[r["mode"], r["batch"], r["new_tokens"], f"{r['s']:.2f}", f"{r['tokens_per_s']:.1f}",
          None if r["first_token_s"] is None else f"{r['first_token_s']:.3f}"] for r in rows], sep=" --- "))
    print(f"\npeak memory allocated: {peak:.1f} GiB")


if __name__ == "__main__":
    main()
