"""Per-layer cost at depth: the published qwen-b300 loop vs `ftcli train` on the qwen-b300 recipe's settings.

Both run the 27B width (random init) on the same synthetic packed blocks at N decoder layers
([linear x3, full] pattern), one H200, and the per-layer slope and fixed part (intercept) of s/step are
fitted over the depths, then extrapolated to the real 64 layers (one GPU's compute per step; FSDP's
collectives across 8 GPUs are not in it). MFU counts every matmul (reference_loop_gpu.step_flops: decoder
linears, LM head on the trained tokens, causal attention per segment, gated-delta recurrent-form FLOPs,
conv) against the card's dense bf16 peak (ftcli.train.metrics), recomputation not counted.

    reference  benchmarks/reference_loop_gpu.py: the published loop (bf16 master, full-logit loss, full
               activation checkpointing), all depths in one process
    ftcli      `python -m ftcli train` on benchmarks/recipes/qwen27b-4layer-h200.yaml with the training
               settings of ftcli's built-in qwen-b300 recipe (read from it: activation checkpointing,
               loss impl, precision, optimizer, clipping, compile) plus model.config (N layers), the block
               length, max_steps and log_every=1; one run per depth (benchmarks/train_full_gpu.run_one)
    profile    torch.profiler over one `ftcli train` step (worker in this process, steps 4 of 5):
               kernel time by category, GPU idle time, host syncs
    lever      the per-block tensors (ftcli.data.collate: fla_cu_seqlens, fla_chunk_indices,
               trained_positions) measured alone: `ftcli train`'s worker (FullRun, world size 1, the
               qwen-b300 settings at --inproc-layers) steps the same blocks twice from the same init, with
               them and with them stripped from the model call (the kernels and the loss then derive them
               on the device, as before); s/step, losses and host syncs per step
               (torch.cuda.set_sync_debug_mode, by source line) of both
    eval       forward-only pass (model.eval(), no grad, summed token CE through ftcli.train.loss's loss_sum,
               the recipe's loss impl and chunked) over the same blocks, next to the training step

Each sub-run is a child process with its own timeout (--timeout); its rows go to --rows (JSON lines) and
its table to stdout as soon as it is measured; `--what fit` prints the combined tables from --rows.

H200, one block length per call (from the project root, .gpu carried, see DEVELOPERS.md):
    python benchmarks/depth_gpu.py --block-len 32768 --layers 4 8 --what reference ftcli profile fit
    python benchmarks/depth_gpu.py --block-len 32768 --what lever eval    (one child: after, eval, before)
CPU logic check (tiny config, 512-token blocks, the same code path):
    python benchmarks/depth_gpu.py --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(HERE))

import common  # noqa: E402
from reference_loop_gpu import (bench_blocks, data_overrides, depth_config, step_flops,  # noqa: E402
                                write_depth_config)
from train_full_gpu import RECIPE, TINY, run_one, summarize  # noqa: E402

PEAK_FALLBACK = 989e12  # H200 dense bf16 (ftcli.train.metrics); used when the device is not a known GPU (tiny mode)
TRAINING_KEYS = ("grad_accum", "optimizer", "schedule", "precision", "grad_clip", "activation_checkpointing",
                 "activation_checkpointing_keep", "compile", "loss")


def b300_settings(tiny: bool) -> list[str]:
    """`--set training.*` overrides that give the benchmark recipe the qwen-b300 recipe's training settings.
    Tiny (CPU): the keys train_full_gpu.TINY sets stay TINY's (fp32, chunked loss: liger is GPU only)."""
    import yaml

    from ftcli.config.recipe import load_recipe

    training = load_recipe("qwen-b300").training.model_dump(mode="json")
    sets = []

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            sets.append(f"{prefix}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}")

    for key in TRAINING_KEYS:
        walk(f"training.{key}", training[key])
    if tiny:
        tiny_keys = {s.partition("=")[0] for s in TINY}
        sets = [s for s in sets if s.partition("=")[0] not in tiny_keys]
    return sets


# ------------------------------------------------------------------------------------------ sub-runs
def run_reference(args, out: Path) -> bool:
    cmd = [sys.executable, str(HERE / "reference_loop_gpu.py"), "--layers", *map(str, args.layers),
           "--block-len", str(args.block_len), "--steps", str(args.ref_steps), "--warmup", str(args.warmup),
           "--json-out", str(args.rows)]
    return child(cmd + (["--tiny"] if args.tiny else []), args.timeout) != 0


def ftcli_row(args, n_layers: int, out: Path) -> dict:
    """One `ftcli train` run at n_layers (in a child process: see main)."""
    config = write_depth_config(n_layers, args.tiny, out / "configs")
    sets = [*b300_settings(args.tiny), f"model.config={config}", f"data.packing.block_len={args.block_len}",
            f"training.max_steps={args.ftcli_steps}", "training.log_every=1"]
    raw = run_one(1, "ftcli", sets, out / f"b{args.block_len}-l{n_layers}", args.tiny)
    losses = [round(m["loss"], 4) for m in raw["_steps"]]
    row = summarize(raw, args.warmup)
    blocks = bench_blocks(args.block_len, args.tiny, args.ftcli_steps)
    timed = [b for i, b in enumerate(blocks, start=1) if i > args.warmup]
    return {"loop": "ftcli", "layers": n_layers, "block": args.block_len, "exit": row["exit"],
            "s_per_step": row.get("s_per_step"), "tokens_per_s": row.get("tokens_per_s_per_device"),
            "peak_mem_gib": row.get("peak_mem"), "peak_reserved_gib": row.get("peak_reserved"), "losses": losses,
            "flops": step_flops(depth_config(n_layers, args.tiny), timed), "settings": sets}


def child(cmd: list[str], timeout: float) -> int:
    """Run cmd in its own process group; on timeout SIGTERM the group (torchrun's agent then stops its
    workers, which run in sessions of their own), then SIGKILL what is left of the group."""
    print(f"\n=== {' '.join(cmd)} (timeout {timeout:.0f} s)", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"=== timed out after {timeout:.0f} s: stopping it", flush=True)
        stop(proc)
        code = 124
    except BaseException:  # SIGTERM from an outer `timeout` (main turns it into SystemExit), Ctrl-C
        print("=== stopped from outside: stopping the child too", flush=True)
        stop(proc)
        raise
    print(f"=== exit {code} after {time.perf_counter() - start:.0f} s", flush=True)
    return code


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def sub_args(args, *extra: str) -> list[str]:
    base = [sys.executable, str(Path(__file__).resolve()), "--block-len", str(args.block_len), "--rows",
            str(args.rows), "--out", str(args.out), "--warmup", str(args.warmup), "--ftcli-steps",
            str(args.ftcli_steps)]
    return (base + (["--tiny"] if args.tiny else []) + (["--extra-set", *args.extra_set] if args.extra_set else [])
            + list(extra))


# ------------------------------------------------------------------------------------------- profile
CATEGORIES = (  # first match wins: copies first (FSDP's chunk_cat is no fla kernel, a cast is an elementwise kernel)
    ("NCCL", ("nccl",)),
    ("casts/copies", ("copy", "memcpy", "memset", "chunk_cat", "split_with_sizes", "catarray", "fill",
                      "aten::to", "aten::cat", "clone", "contiguous")),
    ("attention", ("flash", "fmha", "attention", "varlen")),
    ("conv", ("causal_conv", "conv1d", "convolution")),
    ("fla", ("chunk", "gated_delta", "delta_rule", "solve_tril", "recompute_w_u", "l2norm", "cumsum", "kkt",
             "wy_", "dplr", "_tl", "tilelang", "main_kernel", "merge_16x16")),
    ("GEMM", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "matmul", "aten::mm", "aten::bmm",
              "aten::linear")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("elementwise", ("elementwise", "reduce", "softmax", "norm", "triton", "liger", "cross_entropy", "silu",
                     "sigmoid", "aten::")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def kernel_table(kernels: list[tuple[str, float, float]], window: tuple[float, float], cpu_events: dict) -> str:
    """kernels: (name, start_us, duration_us); window: the profiled step (start_us, end_us)."""
    w0, w1 = window
    inside = [(n, s, d) for n, s, d in kernels if w0 <= s < w1]
    by_cat: dict[str, float] = {}
    top: dict[str, float] = {}
    for n, _, d in inside:
        by_cat[category(n)] = by_cat.get(category(n), 0.0) + d
        top[n] = top.get(n, 0.0) + d
    busy, cur_s, cur_e = 0.0, None, None  # union of kernel intervals, clipped to the window
    for _, s, d in sorted(inside, key=lambda k: k[1]):
        e = min(s + d, w1)
        if cur_e is None or s > cur_e:
            busy += (cur_e - cur_s) if cur_e is not None else 0.0
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += (cur_e - cur_s) if cur_e is not None else 0.0
    wall, total = w1 - w0, sum(by_cat.values())
    lines = [f"profiled step: {wall / 1e3:.1f} ms wall, {len(inside)} kernels, kernel time {total / 1e3:.1f} ms, "
             f"GPU busy {busy / 1e3:.1f} ms, GPU idle {(wall - busy) / 1e3:.1f} ms ({100 * (wall - busy) / wall:.1f}%)",
             "", "| category | ms | % of kernel time |", "|---|---:|---:|"]
    for cat, _ in [*CATEGORIES, ("other", ())]:
        if cat in by_cat:
            lines.append(f"| {cat} | {by_cat[cat] / 1e3:.1f} | {100 * by_cat[cat] / total:.1f}% |")
    lines.append(f"| GPU idle (wall - busy) | {(wall - busy) / 1e3:.1f} | - |")
    lines += ["", "| top kernels | category | ms | calls |", "|---|---|---:|---:|"]
    calls: dict[str, int] = {}
    for n, _, _ in inside:
        calls[n] = calls.get(n, 0) + 1
    for n, d in sorted(top.items(), key=lambda kv: -kv[1])[:20]:
        lines.append(f"| {n[:90]} | {category(n)} | {d / 1e3:.1f} | {calls[n]} |")
    lines += ["", "| host-side call (syncs and their causes) | calls | CPU ms |", "|---|---:|---:|"]
    for n, (c, t) in sorted(cpu_events.items()):
        lines.append(f"| {n} | {c} | {t / 1e3:.1f} |")
    return "\n".join(lines)


SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
               "aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::repeat_interleave")


def trace_summary(trace: dict, cuda: bool):
    """From a chrome trace of one profiled step: kernels (name, start_us, dur_us), the step's window, and
    counts / CPU time of the host calls in SYNC_EVENTS. Without CUDA (logic check) the top-level aten ops
    stand in for kernels."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    step = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep")][-1]
    window = (float(step["ts"]), float(step["ts"]) + float(step["dur"]))
    if cuda:
        kernels = [(e["name"], float(e["ts"]), float(e["dur"])) for e in events
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    else:
        kernels, end = [], -1.0
        for e in sorted((e for e in events if e.get("cat") == "cpu_op" and e["name"].startswith("aten::")),
                        key=lambda e: float(e["ts"])):
            if float(e["ts"]) >= end:
                kernels.append((e["name"], float(e["ts"]), float(e["dur"])))
                end = float(e["ts"]) + float(e["dur"])
    cpu_events: dict[str, tuple[int, float]] = {}
    for e in events:
        if e.get("name") in SYNC_EVENTS and window[0] <= float(e["ts"]) < window[1]:
            c, t = cpu_events.get(e["name"], (0, 0.0))
            cpu_events[e["name"]] = (c + 1, t + float(e["dur"]))
    return kernels, window, cpu_events


def profile_step(args, out: Path) -> None:
    """One `ftcli train` worker in this process (world size 1, the worker path of `ftcli train`), with
    torch.profiler stepped by a global optimizer-step hook: steps 1-2 wait, 3 warm-up, 4 recorded."""
    import socket

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from ftcli.cli import app

    n = args.profile_layers
    config = write_depth_config(n, args.tiny, out / "configs")
    sets = [*(TINY if args.tiny else []), "training.cpu_processes=1", *b300_settings(args.tiny),
            f"model.config={config}", *data_overrides(args.block_len, args.tiny), "training.max_steps=5",
            "training.log_every=1", f"output.dir={out / f'profile-b{args.block_len}-l{n}'}", *args.extra_set]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    cuda = torch.cuda.is_available() and not args.tiny
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    prof = torch.profiler.profile(activities=activities,
                                  schedule=torch.profiler.schedule(wait=2, warmup=1, active=1, repeat=1))
    hook = register_optimizer_step_post_hook(lambda *_: prof.step())
    prof.start()
    try:
        argv = ["train", "--recipe", str(RECIPE), "--force"] + [x for s in sets for x in ("--set", s)]
        print("=== profile: ftcli " + " ".join(argv), flush=True)
        app(argv, standalone_mode=False)
    finally:
        hook.remove()
        prof.stop()
    trace = args.trace or out / "profile-trace.json"
    prof.export_chrome_trace(str(trace))
    kernels, window, cpu_events = trace_summary(json.loads(Path(trace).read_text()), cuda)
    extra = f" + {' '.join(args.extra_set)}" if args.extra_set else ""
    print(f"\nprofile of one ftcli train step: {n} layers, block {args.block_len}, qwen-b300 settings{extra}\n", flush=True)
    print(kernel_table(kernels, window, cpu_events), flush=True)


# ----------------------------------------------------------------------------- in-process: lever, eval
PER_BLOCK_KEYS = ("fla_cu_seqlens", "fla_chunk_indices", "trained_positions")  # ftcli.data.collate's


def _world():
    import socket

    from ftcli.train.distributed import init_distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    return init_distributed()


def count_syncs(fn, device) -> tuple[int, dict[str, int]]:
    """Host syncs while fn() runs (torch.cuda.set_sync_debug_mode warns at each one), total and by the
    Python line that caused it; (0, {}) off CUDA."""
    import warnings

    import torch

    if device.type != "cuda":
        fn()
        return 0, {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.set_sync_debug_mode(0)  # the synchronize below is the measurement's, not the step's
            common.sync(device)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    by_line: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            where = f"{Path(w.filename).parent.name}/{Path(w.filename).name}:{w.lineno}"
            by_line[where] = by_line.get(where, 0) + 1
    return sum(by_line.values()), by_line


def _train_steps(run, blocks, warmup: int, device) -> dict:
    """FullRun.step over `blocks`, one block a step; the median s/step of the steps after `warmup` (each
    between two device syncs), the losses, and the host syncs of one more step on the first block."""
    times = [common.timed(lambda b=block: run.step([b], 1), device=device)[1][0] for block in blocks]
    n_syncs, by_line = count_syncs(lambda: run.step([blocks[-1]], 1), device)
    losses = [round(loss, 4) for _, loss in run.result.losses[:len(blocks)]]
    return {"s_per_step": statistics.median(times[warmup:]), "times": [round(t, 4) for t in times],
            "losses": losses, "syncs_per_step": n_syncs, "syncs_by_line": by_line}


def _eval_passes(run, blocks, warmup: int, device, impls: list[str], chunk_tokens: int) -> list[dict]:
    """model.eval() + no_grad: loss_sum over every block with each loss impl; median s/pass after `warmup`."""
    import torch

    from ftcli import data
    from ftcli.train.loss import attach_loss

    rows = []
    run.model.eval()
    for impl in impls:
        attach_loss(run.model, impl, chunk_tokens)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times, ce = [], []
        with torch.no_grad():
            for block in blocks:
                def eval_pass(b=block):  # the block's copy to the device is timed, as the training step's is
                    return run.model.loss_sum(**data.block_to_model_inputs(b, device))

                summed, (seconds,) = common.timed(eval_pass, device=device)
                times.append(seconds)
                ce.append(float(summed) / max(block.num_trained_tokens, 1))
        n_syncs, _ = count_syncs(lambda: run.model.loss_sum(**data.block_to_model_inputs(blocks[-1], device)), device) \
            if device.type == "cuda" else (0, {})
        peak_gib = common.peak_gib(device)
        rows.append({"impl": impl, "s_per_pass": statistics.median(times[warmup:]), "peak_mem_gib": peak_gib,
                     "mean_ce": [round(x, 4) for x in ce], "syncs_per_pass": n_syncs})
    run.model.train()
    attach_loss(run.model, run.tcfg.loss.impl, chunk_tokens)
    return rows


def _fmt_syncs(by_line: dict[str, int]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(by_line.items(), key=lambda kv: -kv[1])) or "-"


def inproc(args, out: Path) -> None:
    """The lever and eval parts in one process (module doc): after -> eval -> before, as asked in --what."""
    import gc

    import torch

    from ftcli import data
    from ftcli.config.recipe import load_recipe
    from ftcli.train.full import FullRun

    n = args.inproc_layers
    config = write_depth_config(n, args.tiny, out / "configs")
    sets = [*(TINY if args.tiny else []), *b300_settings(args.tiny), f"model.config={config}",
            *data_overrides(args.block_len, args.tiny), "training.log_every=1", "training.max_steps=1000"]
    world = _world()
    device = world.device
    steps = args.inproc_steps
    blocks = bench_blocks(args.block_len, args.tiny, steps)
    tokens = statistics.mean(len(b.input_ids) for b in blocks[args.warmup:])
    flops = step_flops(depth_config(n, args.tiny), blocks[args.warmup:])
    p = peak()
    parts = [part for part in ("after", "eval", "before") if ("lever" if part != "eval" else "eval") in args.what]
    if "eval" in parts and "after" not in parts:
        parts.insert(0, "after")  # eval runs next to the training step of the same model
    print(f"=== in-process ({', '.join(parts)}): {n} layers, block {args.block_len}, {steps} steps, "
          f"medians over steps > {args.warmup}; --set {' '.join(sets)}", flush=True)
    original = data.block_to_model_inputs
    trained: dict[str, dict] = {}
    run = None
    for part in parts:
        if part in ("after", "before"):
            if run is not None:
                del run
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if part == "before":  # the model call without the per-block tensors: kernels and loss derive them
                data.block_to_model_inputs = lambda *a, **k: {key: v for key, v in original(*a, **k).items()
                                                              if key not in PER_BLOCK_KEYS}
            recipe = load_recipe(RECIPE, [*sets, f"output.dir={out / f'inproc-{part}-b{args.block_len}-l{n}'}"])
            run = FullRun(recipe, recipe.output_dir, None, world)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            row = _train_steps(run, blocks, args.warmup, device)
            data.block_to_model_inputs = original
            if device.type == "cuda":
                row["peak_mem_gib"] = common.peak_gib(device)
            trained[part] = row
            label = {"after": "with the per-block tensors", "before": "without them (derived on the device)"}[part]
            mem = f"{row['peak_mem_gib']:.1f}" if row.get("peak_mem_gib") is not None else "-"
            print(f"\n| ftcli train step, {n} layers, block {args.block_len} | s/step | tokens/s | MFU | peak GiB "
                  f"| host syncs per step | losses |\n|---|---:|---:|---:|---:|---:|---|\n"
                  f"| {label} | {row['s_per_step']:.3f} | {tokens / row['s_per_step']:,.0f} | "
                  f"{100 * flops['total'] / row['s_per_step'] / p:.1f}% | {mem} | {row['syncs_per_step']} | "
                  f"{row['losses']} |\nsyncs by line: {_fmt_syncs(row['syncs_by_line'])}\nstep times: {row['times']}",
                  flush=True)
            print("INPROC " + json.dumps({"part": part, "layers": n, "block": args.block_len, **row}), flush=True)
        else:
            impls = list(dict.fromkeys([run.tcfg.loss.impl, "chunked"]))
            rows = _eval_passes(run, blocks, args.warmup, device, impls, run.tcfg.loss.chunk_tokens)
            step_s = trained["after"]["s_per_step"]
            lines = [f"\n| {n} layers, block {args.block_len} | s | tokens/s | vs the training step | peak GiB | "
                     "host syncs | mean CE per block |", "|---|---:|---:|---:|---:|---:|---|",
                     f"| training step ({run.tcfg.loss.impl} loss, qwen-b300 settings) | {step_s:.3f} | "
                     f"{tokens / step_s:,.0f} | 1.00x | - | {trained['after']['syncs_per_step']} | - |"]
            for r in rows:
                mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
                lines.append(f"| eval forward, no grad ({r['impl']} loss) | {r['s_per_pass']:.3f} | "
                             f"{tokens / r['s_per_pass']:,.0f} | {r['s_per_pass'] / step_s:.2f}x | {mem} | "
                             f"{r['syncs_per_pass']} | {r['mean_ce']} |")
            print("\n".join(lines), flush=True)
            print("EVAL " + json.dumps({"layers": n, "block": args.block_len, "train_s": step_s, "rows": rows}),
                  flush=True)
    if {"after", "before"} <= trained.keys():
        a, b = trained["after"], trained["before"]
        same = len(a["losses"]) == len(b["losses"]) and all(abs(x - y) < 5e-4 for x, y in zip(a["losses"], b["losses"]))
        print(f"\nlever: {b['s_per_step']:.3f} -> {a['s_per_step']:.3f} s/step "
              f"({b['s_per_step'] / a['s_per_step']:.3f}x), host syncs per step {b['syncs_per_step']} -> "
              f"{a['syncs_per_step']}; losses equal to 3 decimals over {len(a['losses'])} steps: {same}", flush=True)
    import torch.distributed as dist

    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- fit
def fit(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares s/step = intercept + slope * layers (ftcli.estimate.steptime.depth_fit, what `plan` extrapolates
    with); None with fewer than two depths."""
    from ftcli.estimate.steptime import depth_fit

    return depth_fit(points) if len({n for n, _ in points}) >= 2 else None


def peak() -> float:
    import torch

    from ftcli.train.metrics import peak_flops

    return (peak_flops(torch.device("cuda", 0)) if torch.cuda.is_available() else None) or PEAK_FALLBACK


def fit_tables(rows: list[dict], block_len: int, tiny: bool, depth: int = 64) -> str:
    p = peak()
    rows = [r for r in rows if r["block"] == block_len and r.get("s_per_step")]
    lines = [f"block {block_len}; MFU against {p / 1e12:.0f} TFLOP/s dense bf16, every matmul counted",
             "", "| loop | layers | s/step | tokens/s | MFU | peak GiB (reserved) | losses |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r["loop"] != "reference", r["layers"])):
        mfu = r["flops"]["total"] / r["s_per_step"] / p
        mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "-"
        mem += f" ({r['peak_reserved_gib']:.1f})" if r.get("peak_reserved_gib") is not None else ""
        lines.append(f"| {r['loop']} | {r['layers']} | {r['s_per_step']:.3f} | {r['tokens_per_s']:,.0f} | "
                     f"{100 * mfu:.1f}% | {mem} | {r['losses']} |")
    fits = {}
    for loop in ("reference", "ftcli"):
        pts = [(r["layers"], r["s_per_step"]) for r in rows if r["loop"] == loop]
        fits[loop] = fit(pts)
    if not any(fits.values()):
        return "\n".join(lines + ["", "(fewer than two depths for each loop: no fit)"])
    blocks = bench_blocks(block_len, tiny, 6)[2:]  # the blocks both loops time by default
    flops64 = step_flops(depth_config(depth, tiny), blocks)
    cols = {}  # loop -> (slope, intercept, extrapolated s/step), or None (fewer than two depths)
    for loop, f in fits.items():
        cols[loop] = (f[0], f[1], f[1] + depth * f[0]) if f else None

    def cells(fmt, i):
        return [fmt(cols[loop][i]) if cols[loop] else "not measured" for loop in ("reference", "ftcli")]

    def ratio(i):
        return f"{cols['reference'][i] / cols['ftcli'][i]:.2f}x" if all(cols.values()) else "-"

    lines += ["", "| fit over the depths above | published loop | ftcli (qwen-b300 settings) | published / ftcli |",
              "|---|---:|---:|---:|",
              "| per added layer (slope), s | {} | {} | {} |".format(*cells(lambda v: f"{v:.4f}", 0), ratio(0)),
              "| fixed part of a step (intercept), s | {} | {} | - |".format(*cells(lambda v: f"{v:.3f}", 1)),
              f"| {depth} layers extrapolated, s/step | " + " | ".join(cells(lambda v: f"{v:.2f}", 2)) + f" | {ratio(2)} |",
              f"| {depth} layers, tokens/s | " + " | ".join(cells(lambda v: f"{block_len / v:,.0f}", 2)) + " | - |",
              f"| {depth} layers, MFU | " + " | ".join(cells(lambda v: f"{100 * flops64['total'] / v / p:.1f}%", 2))
              + " | - |",
              "", f"model FLOPs per {depth}-layer step (x3 fwd, TFLOP): " + ", ".join(
                  f"{k} {flops64[k] / 1e12:.3g}" for k in ("linear", "lm_head", "attention", "gated_delta", "conv"))
              + f"; total {flops64['total'] / 1e12:.4g} over {flops64['tokens']:,.0f} tokens "
              f"({flops64['trained_tokens']:,.0f} trained)"]
    return "\n".join(lines)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# ---------------------------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-len", type=int, default=None, help="default 32768 (tiny 512)")
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--what", nargs="+", default=["reference", "ftcli", "profile", "fit"],
                        choices=["reference", "ftcli", "profile", "fit", "lever", "eval"],
                        help="parts to run (module doc); reference: the published loop (reference_loop_gpu.py)")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timings")
    parser.add_argument("--ref-steps", type=int, default=4, help="timed steps of the published loop (after --warmup)")
    parser.add_argument("--ftcli-steps", type=int, default=6, help="ftcli max_steps (median over steps > warmup)")
    parser.add_argument("--profile-layers", type=int, default=4)
    parser.add_argument("--inproc-layers", type=int, default=4, help="lever / eval: decoder layers")
    parser.add_argument("--inproc-steps", type=int, default=8, help="lever / eval: steps (blocks) per part")
    parser.add_argument("--timeout", type=float, nargs="+", default=[900.0],
                        help="seconds per sub-run: one value, or reference (the published loop), ftcli (each "
                             "depth), profile, lever/eval")
    parser.add_argument("--rows", type=Path, default=None, help="JSON-lines results (default <out>/rows.jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="run dirs (default: a temp dir)")
    parser.add_argument("--trace", type=Path, default=None, help="profile: also write the chrome trace here")
    parser.add_argument("--tiny", action="store_true", help="CPU logic check: tiny config, 512-token blocks")
    parser.add_argument("--extra-set", nargs="*", default=[], help="profile: more --set overrides (e.g. a lever)")
    parser.add_argument("--ftcli-one", type=int, default=None, help=argparse.SUPPRESS)  # child: one ftcli depth
    parser.add_argument("--profile-one", action="store_true", help=argparse.SUPPRESS)  # child: the profile
    parser.add_argument("--inproc-one", action="store_true", help=argparse.SUPPRESS)  # child: lever / eval
    args = parser.parse_args()
    args.block_len = args.block_len or (512 if args.tiny else 32768)
    args.out = (args.out or Path(tempfile.mkdtemp(prefix="ftcli-depth-"))).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.rows = (args.rows or args.out / "rows.jsonl").resolve()
    timeouts = dict(zip(("reference", "ftcli", "profile", "inproc"), (args.timeout * 4)[:4]
                        if len(args.timeout) == 1 else args.timeout))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # an outer `timeout`: `child` stops its group

    if args.ftcli_one is not None:  # child
        row = ftcli_row(args, args.ftcli_one, args.out)
        with open(args.rows, "a") as f:
            f.write(json.dumps(row) + "\n")
        print("ROW " + json.dumps(row), flush=True)
        return 0 if row["exit"] == 0 else 1
    if args.profile_one:  # child
        profile_step(args, args.out)
        return 0
    if args.inproc_one:  # child
        inproc(args, args.out)
        return 0

    failed = 0
    if "reference" in args.what:
        args.timeout = timeouts["reference"]
        failed += run_reference(args, args.out)
        print(fit_tables(read_rows(args.rows), args.block_len, args.tiny), flush=True)
    if "ftcli" in args.what:
        for n in args.layers:
            failed += child(sub_args(args, "--ftcli-one", str(n)), timeouts["ftcli"]) != 0
            print(fit_tables(read_rows(args.rows), args.block_len, args.tiny), flush=True)
    if "profile" in args.what:
        extra = ["--profile-one", "--profile-layers", str(args.profile_layers)]
        failed += child(sub_args(args, *extra, *(["--trace", str(args.trace)] if args.trace else [])),
                        timeouts["profile"]) != 0
    if {"lever", "eval"} & set(args.what):
        extra = ["--inproc-one", "--inproc-layers", str(args.inproc_layers), "--inproc-steps", str(args.inproc_steps),
                 "--what", *[w for w in args.what if w in ("lever", "eval")]]
        failed += child(sub_args(args, *extra), timeouts.get("inproc", timeouts["ftcli"])) != 0
    if "fit" in args.what:
        print(f"\n## depth fit{' (tiny CPU mode)' if args.tiny else ''}\n", flush=True)
        print(fit_tables(read_rows(args.rows), args.block_len, args.tiny), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
