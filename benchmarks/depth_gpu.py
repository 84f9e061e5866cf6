"""Per-layer cost at depth: the published qwen-b300 loop vs `ftcli train` on the qwen-b300 recipe's settings.

Both run the 27B width (random init) on the same synthetic packed blocks at N decoder layers
([linear x3, full] pattern), one H200, and the per-layer slope and fixed part (intercept) of s/step are
fitted over the depths, then extrapolated to the real 64 layers (one GPU's compute per step; FSDP's
collectives across 8 GPUs are not in it). MFU counts every matmul (reference_loop_gpu.step_flops: decoder
linears, LM head on the trained tokens, causal attention per segment, gated-delta recurrent-form FLOPs,
conv) against the card's dense bf16 peak (ftcli.metrics), recomputation not counted.

    reference  benchmarks/reference_loop_gpu.py: the published loop (bf16 master, full-logit loss, full
               activation checkpointing), all depths in one process
    ftcli      `python -m ftcli train` on benchmarks/recipes/qwen27b-4layer-h200.yaml with the training
               settings of ftcli's built-in qwen-b300 recipe (read from it: activation checkpointing,
               loss impl, precision, optimizer, clipping, compile) plus model.config (N layers), the block
               length, max_steps and log_every=1; one run per depth (benchmarks/train_full_gpu.run_one)
    profile    torch.profiler over one `ftcli train` step (worker in this process, steps 4 of 5):
               kernel time by category, GPU idle time, host syncs

Each sub-run is a child process with its own timeout (--timeout); its rows go to --rows (JSON lines) and
its table to stdout as soon as it is measured; `--what fit` prints the combined tables from --rows.

H200, one block length per call (from the project root, .gpu carried, see DEVELOPERS.md):
    python benchmarks/depth_gpu.py --block-len 32768 --layers 4 8 --what reference ftcli profile fit
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

from reference_loop_gpu import (bench_blocks, data_overrides, depth_config, step_flops,  # noqa: E402
                                write_depth_config)
from train_full_gpu import RECIPE, TINY, run_one, summarize  # noqa: E402

PEAK_FALLBACK = 989e12  # H200 dense bf16 (ftcli.metrics); used when the device is not a known GPU (tiny mode)
TRAINING_KEYS = ("grad_accum", "optimizer", "schedule", "precision", "grad_clip", "activation_checkpointing",
                 "activation_checkpointing_keep", "compile", "loss")


def b300_settings(tiny: bool) -> list[str]:
    """`--set training.*` overrides that give the benchmark recipe the qwen-b300 recipe's training settings.
    Tiny (CPU): the keys train_full_gpu.TINY sets stay TINY's (fp32, chunked loss: liger is GPU only)."""
    import yaml

    from ftcli.recipe import load_recipe

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
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        code = 124
    print(f"=== exit {code} after {time.perf_counter() - start:.0f} s", flush=True)
    return code


def sub_args(args, *extra: str) -> list[str]:
    base = [sys.executable, str(Path(__file__).resolve()), "--block-len", str(args.block_len), "--rows",
            str(args.rows), "--out", str(args.out), "--warmup", str(args.warmup), "--ftcli-steps",
            str(args.ftcli_steps)]
    return base + (["--tiny"] if args.tiny else []) + list(extra)


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
            "training.log_every=1", f"output.dir={out / f'profile-b{args.block_len}-l{n}'}"]
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
    print(f"\nprofile of one ftcli train step: {n} layers, block {args.block_len}, qwen-b300 settings\n", flush=True)
    print(kernel_table(kernels, window, cpu_events), flush=True)


# ----------------------------------------------------------------------------------------------- fit
def fit(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares s/step = intercept + slope * layers; None with fewer than two depths."""
    if len({n for n, _ in points}) < 2:
        return None
    mx = statistics.mean(n for n, _ in points)
    my = statistics.mean(t for _, t in points)
    slope = sum((n - mx) * (t - my) for n, t in points) / sum((n - mx) ** 2 for n, _ in points)
    return slope, my - slope * mx


def peak() -> float:
    import torch

    from ftcli.metrics import peak_flops

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

    lines += ["", "| fit over the depths above | reference loop | ftcli (qwen-b300 settings) | reference / ftcli |",
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
                        choices=["reference", "ftcli", "profile", "fit"])
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timings")
    parser.add_argument("--ref-steps", type=int, default=4, help="timed reference steps (after --warmup)")
    parser.add_argument("--ftcli-steps", type=int, default=6, help="ftcli max_steps (median over steps > warmup)")
    parser.add_argument("--profile-layers", type=int, default=4)
    parser.add_argument("--timeout", type=float, nargs="+", default=[900.0],
                        help="seconds per sub-run: one value, or reference, ftcli (each depth), profile")
    parser.add_argument("--rows", type=Path, default=None, help="JSON-lines results (default <out>/rows.jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="run dirs (default: a temp dir)")
    parser.add_argument("--trace", type=Path, default=None, help="profile: also write the chrome trace here")
    parser.add_argument("--tiny", action="store_true", help="CPU logic check: tiny config, 512-token blocks")
    parser.add_argument("--ftcli-one", type=int, default=None, help=argparse.SUPPRESS)  # child: one ftcli depth
    parser.add_argument("--profile-one", action="store_true", help=argparse.SUPPRESS)  # child: the profile
    args = parser.parse_args()
    args.block_len = args.block_len or (512 if args.tiny else 32768)
    args.out = (args.out or Path(tempfile.mkdtemp(prefix="ftcli-depth-"))).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.rows = (args.rows or args.out / "rows.jsonl").resolve()
    timeouts = dict(zip(("reference", "ftcli", "profile"), (args.timeout * 3)[:3] if len(args.timeout) == 1
                        else args.timeout))

    if args.ftcli_one is not None:  # child
        row = ftcli_row(args, args.ftcli_one, args.out)
        with open(args.rows, "a") as f:
            f.write(json.dumps(row) + "\n")
        print("ROW " + json.dumps(row), flush=True)
        return 0 if row["exit"] == 0 else 1
    if args.profile_one:  # child
        profile_step(args, args.out)
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
    if "fit" in args.what:
        print(f"\n## depth fit{' (tiny CPU mode)' if args.tiny else ''}\n", flush=True)
        print(fit_tables(read_rows(args.rows), args.block_len, args.tiny), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
