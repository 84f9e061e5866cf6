"""Preference tuning (DPO, sigmoid loss) on one GPU: ftcli's packed pairs against TRL's DPOTrainer as its users run
it, same pairs and same init, in one process. Prints one table row per (case, side).

Cases (random init at the real widths, layers cut):
    llama4, llama8     Llama-3.1-8B width, full DPO, 4 / 8 layers (benchmarks/configs/llama3-8b.json)
    qwen4, qwen8       Qwen3.8-27B width (text), full DPO, 4 / 8 layers, qwen-b300's settings on ftcli's side (fp8
                       GEMMs, regional compile, fp32 masters; benchmarks/configs/qwen3_8-27b-text.json)
    gptoss             gpt-oss-20b width, 4 layers, LoRA r=16 on the attention projections (benchmarks/gpt-oss-20b.json).
                       ftcli's side is its packed-pair loss on the PEFT model with the adapter off as the reference
                       (ftcli.train.preference.attach_preference_loss, what `ftcli train` attaches for method lora) in
                       this script's plain loop, not under TRL's Trainer as `ftcli train` runs it (its per-step
                       overhead is not in this row).

The same start on both sides:
  - weights: one random init (transformers' own, seed 0) written once as bf16 safetensors; ftcli's FSDP2 model (one
    rank, fp32 masters, bf16 compute) and TRL's model both load it;
  - pairs: PAIRS random token-id pairs with UltraFeedback-like lengths (prompt 40-600 tokens, each completion 20-700),
    the same ids on both sides: ftcli packs them whole into BLOCK-token blocks (ftcli.data.packing.pack_pairs, bfd);
    TRL gets them pre-tokenized (prompt_ids / chosen_ids / rejected_ids, the form its collator pads) in the same
    order, `--trl-batch` pairs per step (default: the mean pairs per ftcli block, so both take about the same
    trained tokens per step);
  - loss: sigmoid, beta 0.1, AdamW lr 1e-6 constant, clip 1.0, full activation checkpointing on both sides.
TRL as its users run it: bf16=True (autocast over fp32 weights), gradient_checkpointing=True, padding (its
`padding_free` is switched off in 1.16), the reference a copy of the model (full) or the adapter off (LoRA), and
with --trl-precompute its `precompute_ref_log_probs=True` (the reference pass timed separately, then added).
With --ftcli-precompute, ftcli's side also runs with training.preference.reference=precomputed (full cases): one
model (no frozen copy), its log-probs per segment computed once before the steps (that pass's seconds logged), then
steps without a reference forward; its step-1 loss must stay log 2 and its logps/chosen equal the live side's.

On CUDA the last ftcli step runs under torch's sync debug mode and prints a `syncs:` line: how many calls in its
forward + backward waited for the device, and where (the loss is written to wait nowhere).

Figures: trained tokens/s = completion tokens the loss trains / step time (median over the steps after --warmup);
input tokens/s counts every token the model runs (TRL: padding included); peak GiB = torch.cuda.max_memory_allocated
(reset per side); step-1 loss = each side's loss on ftcli's first block's pairs with the initial weights
(forward only, before any update: log 2 on both sides, policy == reference) and the mean chosen log-prob of those
pairs (TRL's logps/chosen), with their relative difference: the check that both sides score the same tokens the
same way. A side that runs out of memory prints OOM.

H200 (one call; each case builds its init once):
    python benchmarks/preference_gpu.py --cases llama4 llama8 qwen4 qwen8 gptoss --steps 8 --warmup 3
    python benchmarks/preference_gpu.py --cases llama8 qwen8 --ftcli-precompute --steps 8 --warmup 3   (live vs stored)
CPU logic check (tiny models of ftcli/assets, 512-token blocks, float32, GPU-only settings dropped):
    python benchmarks/preference_gpu.py --tiny --cases llama4 qwen4 gptoss --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "ftcli" / "assets"
CASES = {  # name: (config, layers, model_type, method, tokenizer)
    "llama4": (ROOT / "benchmarks/configs/llama3-8b.json", 4, "llama", "full", "tokenizer-llama3"),
    "llama8": (ROOT / "benchmarks/configs/llama3-8b.json", 8, "llama", "full", "tokenizer-llama3"),
    "qwen4": (ROOT / "benchmarks/configs/qwen3_8-27b-text.json", 4, "qwen3_5_text", "full", "tokenizer-qwen"),
    "qwen8": (ROOT / "benchmarks/configs/qwen3_8-27b-text.json", 8, "qwen3_5_text", "full", "tokenizer-qwen"),
    "gptoss": (ROOT / "benchmarks/gpt-oss-20b.json", 4, "gpt_oss", "lora", "tokenizer-gpt-oss"),
}
TINY = {"llama": ASSETS / "tiny-llama3.json", "qwen3_5_text": ASSETS / "tiny-qwen3_5.json",
        "gpt_oss": ASSETS / "tiny-gpt-oss.json"}
QWEN_B300 = ["training.precision.fp8=true", "training.compile=regions"]  # qwen-b300's speed settings
BETA, LR, CLIP = 0.1, 1e-6, 1.0
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
START = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - START:6.1f}s]", *a, flush=True)


# ----------------------------------------------------------------------------------------- same start
def random_pairs(n: int, vocab: int, seed: int, tiny: bool) -> list[tuple]:
    """(index, chosen ids, chosen mask, rejected ids, rejected mask): a shared prompt, then each completion; every
    completion token trained (the mask a chat template's assistant turn gives, in spirit)."""
    rng = np.random.default_rng(seed)
    scale = 0.1 if tiny else 1.0
    out = []
    for i in range(n):
        prompt = rng.integers(10, vocab - 10, int(rng.integers(40, 600) * scale) + 2).astype(np.int32)
        sides = []
        for _ in range(2):
            c = rng.integers(10, vocab - 10, int(rng.integers(20, 700) * scale) + 2).astype(np.int32)
            sides += [np.concatenate([prompt, c]), np.r_[np.zeros(len(prompt), bool), np.ones(len(c), bool)]]
        out.append((i, *sides))
    return out


def write_init(config_path: Path, layers: int, out: Path, device: str) -> dict:
    """One random init (seed 0) of the config cut to `layers`, saved as bf16 safetensors; returns the config dict."""
    from transformers import AutoConfig, AutoModelForCausalLM

    data = json.loads(config_path.read_text())
    data["num_hidden_layers"] = layers
    if data.get("layer_types"):
        period = data["layer_types"]
        data["layer_types"] = [period[i % len(period)] for i in range(layers)]
    data.pop("architectures", None)
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    gc.collect()
    return config.to_dict()


# ------------------------------------------------------------------------------------------ ftcli side
def ftcli_blocks(pairs, block_len: int, pad_id: int):
    from ftcli.data.packing import make_block, pack_pairs

    blocks = []
    for ids, mask, segs, roles in pack_pairs(pairs, block_len, len(pairs)):
        blk = make_block(ids, mask, segs, block_len, pad_id, roles=roles)
        rows, pos = [], 0
        for c, r in zip(segs[0::2], segs[1::2]):
            rows.append(next(p[0] for p in pairs if len(p[1]) == c and len(p[3]) == r
                             and np.array_equal(p[1], ids[pos:pos + c])))
            pos += c + r
        blocks.append({"block": blk, "pair_rows": rows})
    return blocks


def ftcli_recipe(case: str, init_dir: Path, tiny: bool, block_len: int):
    from ftcli.config.recipe import load_recipe

    _, _, model_type, method, tokenizer = CASES[case]
    sets = ["model.init=pretrained", f"model.id={init_dir}", f"model.model_type={model_type}",
            f"model.tokenizer=pkg://assets/{tokenizer}", "model.model_class=causal_lm",
            f"data.packing.block_len={block_len}", "training.activation_checkpointing=full",
            f"training.optimizer.lr={LR}", "training.optimizer.weight_decay=0.0", f"training.grad_clip={CLIP}",
            f"training.preference.beta={BETA}", "eval=null", "training.checkpoint.enabled=false"]
    if tiny:
        sets += ["model.dtype=float32", "training.precision.param_dtype=float32", "training.optimizer.fused=false"]
    else:
        sets += ["model.dtype=bfloat16", "training.precision.param_dtype=bfloat16", "training.optimizer.fused=true"]
        sets += QWEN_B300 if case.startswith("qwen") else []
    return load_recipe("tiny-dpo-cpu", sets)


def precompute_reference(model, blocks, device) -> tuple[list, float]:
    """training.preference.reference=precomputed as `ftcli train` runs it (ftcli.train.full.read_stored_reference):
    the starting model's per-segment log-probs of every block, in eval mode, then every FSDP unit sharded again;
    returns the blocks carrying them (copies) and the pass's seconds (once per dataset, not per step)."""
    import dataclasses

    from torch.distributed.fsdp import FSDPModule

    from ftcli.data.collate import block_to_model_inputs

    _sync(device)
    t0 = time.perf_counter()
    model.eval()
    out = []
    with torch.no_grad():
        for b in blocks:
            inputs = block_to_model_inputs(b["block"], device)
            inputs.pop("pairs")
            logps = model.sequence_logps(**inputs)[0].float().cpu().numpy()
            out.append({**b, "block": dataclasses.replace(b["block"], reference_logps=logps)})
    model.train()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    _sync(device)
    return out, time.perf_counter() - t0


def run_ftcli(case, init_dir, blocks, steps, warmup, tiny, block_len, world, precompute=False) -> dict:
    from ftcli.data.collate import block_to_model_inputs
    from ftcli.model import kernels
    from ftcli.model.parallelize import build_model
    from ftcli.train.full import build_optimizer, grad_norm_and_clip
    from ftcli.train.preference import attach_preference_loss, preference_config
    from ftcli.train.reference import frozen_copy_training

    recipe = ftcli_recipe(case, init_dir, tiny, block_len)
    device = world.device
    attn, _ = kernels.enable_packed_kernels(recipe.model.model_type, device)
    cfg = preference_config(recipe.training)
    method = CASES[case][3]
    if method == "full":
        model = build_model(recipe.model, recipe.training, world, attn)
        held = frozen_copy_training(recipe.model, recipe.training)  # as `ftcli train` holds it: compute dtype
        reference = None if precompute else build_model(recipe.model, held, world, attn).requires_grad_(False).eval()
        attach_preference_loss(model, cfg, recipe.training.loss.chunk_tokens, reference)
        if precompute:  # no second model: the blocks carry the starting model's log-probs
            blocks, reference_pass_s = precompute_reference(model, blocks, device)
            log(f"{case}: reference pass over {len(blocks)} blocks {reference_pass_s:.2f} s")
        optimizer = build_optimizer(model, recipe, device)
        trained = model
    else:  # LoRA on a bf16 base, the reference the adapter off
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(init_dir, dtype=recipe.model.dtype and getattr(
            torch, recipe.model.dtype), attn_implementation=attn).to(device)
        base.gradient_checkpointing_enable({"use_reentrant": False})
        trained = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS))
        model = trained.get_base_model()
        attach_preference_loss(model, cfg, recipe.training.loss.chunk_tokens, adapter_off=trained.disable_adapter)
        optimizer = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], lr=LR, betas=(0.9, 0.95))
    first = blocks[0]["block"]
    with torch.no_grad():
        inputs = block_to_model_inputs(first, device)
        loss1 = float(model.loss_sum(**inputs)) / len(first.pairs)
    logp1 = model.preference_sums.means()["logps/chosen"]
    model.preference_sums = type(model.preference_sums)()
    times, trained_tokens, seen = [], [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for k in range(steps):
        blk = blocks[k % len(blocks)]["block"]
        _sync(device)
        t0 = time.perf_counter()
        inputs = block_to_model_inputs(blk, device)
        if k == steps - 1 and device.type == "cuda":  # the last step also counts where it waits for the device
            where = count_syncs(lambda: (model.loss_sum(**inputs) / len(blk.pairs)).backward())
            print(f"syncs: {case} {'precomputed' if precompute else 'live'}: {len(where)} synchronizing calls in one "
                  f"forward + backward {dict(collections.Counter(where))}", flush=True)
        else:
            (model.loss_sum(**inputs) / len(blk.pairs)).backward()
        grad_norm_and_clip(trained, CLIP) if method == "full" else torch.nn.utils.clip_grad_norm_(
            [p for p in trained.parameters() if p.requires_grad], CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
        trained_tokens.append(blk.num_trained_tokens)
        seen.append(len(blk.input_ids))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    kernels.disable_packed_kernels()
    return _figures("ftcli precomputed" if precompute else "ftcli", times, trained_tokens, seen, warmup, peak, loss1,
                    logp1)


# ------------------------------------------------------------------------------------------- TRL side
def run_trl(case, init_dir, pairs, blocks, steps, warmup, tiny, batch, precompute, tmp: Path, device) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    method = CASES[case][3]
    tok = AutoTokenizer.from_pretrained(str(ASSETS / CASES[case][4]))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32 if method == "full" else (
        torch.float32 if tiny else torch.bfloat16))
    peft_config = None
    if method == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS)
    order = [i for b in blocks for i in b["pair_rows"]]  # ftcli's pairs, in ftcli's step order
    rows = [_trl_row(pairs[i]) for i in order][: steps * batch]  # the rows the steps train, once
    args = DPOConfig(output_dir=str(tmp / "trl"), report_to=[], bf16=not tiny, use_cpu=device.type != "cuda",
                     per_device_train_batch_size=batch, gradient_accumulation_steps=1, learning_rate=LR,
                     lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=CLIP, weight_decay=0.0,
                     adam_beta1=0.9, adam_beta2=0.95, beta=BETA, loss_type=["sigmoid"], max_length=None,
                     gradient_checkpointing=True, max_steps=steps, logging_steps=1, save_strategy="no",
                     precompute_ref_log_probs=precompute, dataloader_drop_last=False, seed=0,
                     train_sampling_strategy="sequential")  # ftcli's pair order, so each step's pairs are known
    trainer = DPOTrainer(model=model, args=args, processing_class=tok, peft_config=peft_config,
                         train_dataset=Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}]))
    trainer.train_dataset = Dataset.from_list(rows)  # the same token ids as ftcli's (TRL would re-tokenize text)
    precompute_s = 0.0
    if precompute:  # TRL's own precompute pass (its __init__ ran it over the placeholder row): over these rows, timed
        _sync(device)
        t0 = time.perf_counter()
        trainer.train_dataset = trainer._precompute_ref_logps(trainer.train_dataset, "train", batch)
        _sync(device)
        precompute_s = time.perf_counter() - t0
    first = [_trl_row(pairs[i]) for i in blocks[0]["pair_rows"]]
    with torch.no_grad():
        batch1 = {k: v.to(trainer.model.device) for k, v in trainer.data_collator(first).items()}
        if precompute:  # the reference log-probs the precompute pass would store, for this first batch
            ref_c, ref_r = trainer.compute_ref_log_probs(trainer.model, batch1)
            batch1["ref_chosen_logps"], batch1["ref_rejected_logps"] = ref_c, ref_r
        trainer.model.eval()
        loss1 = float(trainer.compute_loss(trainer.model, batch1))
        logp1 = trainer._metrics["eval"]["logps/chosen"][-1]  # TRL's logged mean over the batch's pairs
        trainer.model.train()

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_step_begin(self, args, state, control, **kw):
            _sync(device)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            _sync(device)
            self.times.append(time.perf_counter() - self.t0)

    timer = Timer()
    trainer.add_callback(timer)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    trained_tokens, seen = [], []
    for k in range(len(timer.times)):
        chunk = rows[(k * batch) % len(rows):][:batch]
        trained_tokens.append(sum(len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in chunk))
        longest = max(len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in chunk)
        seen.append(2 * len(chunk) * longest)  # the padded [2B, L] batch TRL runs
    if precompute:  # the reference pass over every row, spread over the steps that train them
        timer.times = [t + precompute_s / len(timer.times) for t in timer.times]
    name = "TRL" + (" precompute" if precompute else "")
    del trainer, model
    return _figures(name, timer.times, trained_tokens, seen, warmup, peak, loss1, logp1)


def _trl_row(p) -> dict:
    _, c_ids, c_mask, r_ids, r_mask = p
    n = int(np.argmax(c_mask))  # the prompt's length: every completion token is trained
    return {"prompt_ids": c_ids[:n].tolist(), "chosen_ids": c_ids[n:].tolist(), "rejected_ids": r_ids[n:].tolist()}


# --------------------------------------------------------------------------------------------- common
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def count_syncs(fn) -> list[str]:
    """Run fn() with torch's CUDA sync debug mode warning; the file:line of each call that waited for the device."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message).lower()]


def _figures(side, times, trained, seen, warmup, peak, loss1, logp1) -> dict:
    keep = slice(warmup, None) if len(times) > warmup else slice(None)
    s = statistics.median(times[keep])
    return {"side": side, "s_step": s, "trained_tok_s": statistics.mean(trained[keep]) / s,
            "input_tok_s": statistics.mean(seen[keep]) / s, "peak_gib": peak, "loss1": loss1, "logp1": logp1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["llama4", "llama8", "qwen4", "qwen8", "gptoss"], choices=CASES)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=None, help="pairs generated (default: enough for --steps blocks)")
    ap.add_argument("--block-len", type=int, default=None, help="ftcli's block (default 8192; --tiny 512)")
    ap.add_argument("--trl-batch", type=int, default=None, help="TRL pairs per step (default: ftcli's mean)")
    ap.add_argument("--trl-precompute", action="store_true", help="also TRL with precompute_ref_log_probs (full)")
    ap.add_argument("--ftcli-precompute", action="store_true", help="also ftcli with training.preference.reference="
                    "precomputed (full): one model, the reference pass timed once (logged), not per step")
    ap.add_argument("--tiny", action="store_true", help="CPU logic check on the tiny models")
    a = ap.parse_args()

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    from ftcli.train.distributed import init_distributed

    world = init_distributed()
    block_len = a.block_len or (512 if a.tiny else 8192)
    rows = []
    for case in a.cases:
        config_path, layers, model_type, method, tokenizer = CASES[case]
        if a.tiny:
            config_path, layers = TINY[model_type], 2
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            config = write_init(config_path, layers, tmp / "init", "cuda" if world.device.type == "cuda" else "cpu")
            vocab = config["vocab_size"]
            n = a.pairs or max(64, a.steps * block_len // (1500 if not a.tiny else 150) * 2)
            pairs = random_pairs(n, vocab, seed=0, tiny=a.tiny)
            pairs = [p for p in pairs if len(p[1]) + len(p[3]) <= block_len]
            blocks = ftcli_blocks(pairs, block_len, pad_id=0)[: max(a.steps, 1)]
            batch = a.trl_batch or max(1, round(statistics.mean(len(b["pair_rows"]) for b in blocks)))
            log(f"{case}: {layers} layers, {len(pairs)} pairs, {len(blocks)} blocks of {block_len}, TRL batch {batch}")
            sides = [("ftcli", lambda: run_ftcli(case, tmp / "init", blocks, a.steps, a.warmup, a.tiny, block_len,
                                                 world))]
            sides.append(("TRL", lambda: run_trl(case, tmp / "init", pairs, blocks, a.steps, a.warmup, a.tiny, batch,
                                                 False, tmp, world.device)))
            if a.ftcli_precompute and method == "full":
                sides.append(("ftcli precomputed", lambda: run_ftcli(case, tmp / "init", blocks, a.steps, a.warmup,
                                                                     a.tiny, block_len, world, precompute=True)))
            if a.trl_precompute and method == "full":
                sides.append(("TRL precompute", lambda: run_trl(case, tmp / "init", pairs, blocks, a.steps, a.warmup,
                                                                a.tiny, batch, True, tmp, world.device)))
            results = {}
            for name, run in sides:
                try:
                    results[name] = run()
                except torch.OutOfMemoryError:
                    results[name] = {"side": name, "oom": True}
                gc.collect()
                if world.device.type == "cuda":
                    torch.cuda.empty_cache()
                log(case, results[name])
            base = results["ftcli"]
            for name, r in results.items():
                rows.append((case, layers, r, base))
    print()
    print("| case | layers | side | s/step | trained tok/s | input tok/s | peak GiB | step-1 loss | loss diff | "
          "step-1 logps/chosen | rel diff | ftcli speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case, layers, r, base in rows:
        if r.get("oom"):
            print(f"| {case} | {layers} | {r['side']} | OOM | | | | | | | | |")
            continue
        ok = not base.get("oom")
        speed = base["trained_tok_s"] / r["trained_tok_s"] if ok else float("nan")
        diff = r["loss1"] - base["loss1"] if ok else float("nan")
        rel = (r["logp1"] - base["logp1"]) / abs(base["logp1"]) if ok else float("nan")
        print(f"| {case} | {layers} | {r['side']} | {r['s_step']:.3f} | {r['trained_tok_s']:,.0f} | "
              f"{r['input_tok_s']:,.0f} | {r['peak_gib']:.1f} | {r['loss1']:.6f} | {diff:+.2e} | {r['logp1']:.3f} | "
              f"{rel:+.2e} | {speed:.2f}x |")
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
