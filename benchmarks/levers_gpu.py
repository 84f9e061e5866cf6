"""Issue-18 levers, each measured alone against ftcli's qwen-b300 settings, in one process on one GPU.

A part is BLOCK:LAYERS:VARIANT. Each part builds `ftcli train`'s worker (ftcli.train.full.FullRun, world
size 1, random init from the recipe's seed) on benchmarks/recipes/qwen27b-4layer-h200.yaml with the
training settings of the built-in qwen-b300 recipe (benchmarks/depth_gpu.b300_settings), N layers of the
27B width ([linear x3, full]), and the variant's overrides; it steps the same synthetic packed blocks
(--steps, one block a step) and reports the median s/step after --warmup, tokens/s, MFU (every matmul,
benchmarks/reference_loop_gpu.step_flops, recompute not counted), peak memory and the losses. With two or
more depths of a variant the per-layer slope and fixed part are fitted and extrapolated to 64 layers, next
to the base variant's and the published loop's (its fit measured on this card on 2026-12-01 with
benchmarks/depth_gpu.py, BENCHMARKS.md; passed in with --published BLOCK:SLOPE:INTERCEPT).

--curve BLOCK:LAYERS:STEPS:VARIANT,VARIANT trains each variant for STEPS steps from the same init on the
same blocks and prints both loss curves and their differences (the "same losses" rule for a lever).

Variants (--set overrides on top of the qwen-b300 settings):
    base        nothing
    fp8         training.precision.fp8=true (ftcli.features.float8: torchao float8 GEMMs in the decoder linears)
    fp8c        fp8 + training.compile=true (regional compile per decoder layer: fuses float8's casts)
    keep2       training.activation_checkpointing_keep=2 (the last 2 layers keep their activations)
    chunked     training.loss.impl=chunked (instead of liger's fused linear cross-entropy)
    fp8chunked  fp8 + chunked
    fused       training.fused_ops=[rms_norm,swiglu,gated_norm] (liger's RMSNorm and SwiGLU, fla's gated norm)
    rms_norm, swiglu, gated_norm   one fused op alone
    regions     training.compile=regions (compile the norms, MLP and float8 linears of each layer)
A part's variant may join several with '+': 32768:4:keep2+fused, 32768:4:keep2+fp8+regions.

H200 (from the project root, .gpu carried, see DEVELOPERS.md):
    python benchmarks/levers_gpu.py --parts 32768:4:base 32768:4:fp8 32768:8:base 32768:8:fp8 \
        --curve 8192:4:50:base,fp8 --published 32768:0.2747:0.632 8192:0.0604:0.169
CPU logic check (tiny config, 512-token blocks): python benchmarks/levers_gpu.py --tiny
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import common  # noqa: E402
from depth_gpu import _train_steps, _world, b300_settings, fit, peak  # noqa: E402
from reference_loop_gpu import bench_blocks, data_overrides, depth_config, step_flops, write_depth_config  # noqa: E402
from train_full_gpu import RECIPE, TINY  # noqa: E402

FP8 = ["training.precision.fp8=true"]
CHUNKED = ["training.loss.impl=chunked"]
VARIANTS = {"base": [], "fp8": FP8, "fp8c": [*FP8, "training.compile=true"],
            "keep2": ["training.activation_checkpointing_keep=2"], "keep0": ["training.activation_checkpointing_keep=0"], "chunked": CHUNKED, "fp8chunked": [*FP8, *CHUNKED],
            "lr4": ["training.optimizer.lr=1e-4"], "fused": ["training.fused_ops=[rms_norm,swiglu,gated_norm]"], "regions": ["training.compile=regions"],
            **{op: [f"training.fused_ops=[{op}]"] for op in ("rms_norm", "swiglu", "gated_norm")}}


def variant_sets(variant: str) -> list[str]:
    """A variant, or several joined by '+' (keep2+fused): their --set overrides in order."""
    return [s for name in variant.split("+") for s in VARIANTS[name]]
DEPTH = 64


def build(args, block_len: int, layers: int, variant: str, out: Path, world):
    from ftcli.config.recipe import load_recipe
    from ftcli.train.full import FullRun

    config = write_depth_config(layers, args.tiny, out / "configs")
    sets = [*(TINY if args.tiny else []), *b300_settings(args.tiny), f"model.config={config}",
            *data_overrides(block_len, args.tiny), "training.log_every=1", "training.max_steps=100000",
            *variant_sets(variant), f"output.dir={out / f'{variant}-b{block_len}-l{layers}'}"]
    recipe = load_recipe(RECIPE, sets)
    return FullRun(recipe, recipe.output_dir, None, world)


def measure(args, part: str, out: Path, world, blocks_by_len: dict) -> dict:
    block_s, layers_s, variant = part.split(":")
    block_len, layers = int(block_s), int(layers_s)
    blocks = blocks_by_len.setdefault(block_len, bench_blocks(block_len, args.tiny, args.steps))[:args.steps]
    device = world.device
    start = time.perf_counter()
    run = build(args, block_len, layers, variant, out, world)
    built = time.perf_counter() - start
    row = _train_steps(run, blocks, args.warmup, device)
    del run
    row["peak_mem_gib"] = common.peak_gib(device)
    common.reset_peak(device)
    flops = step_flops(depth_config(layers, args.tiny), blocks[args.warmup:])
    tokens = statistics.mean(len(b.input_ids) for b in blocks[args.warmup:])
    row.update(part=part, block=block_len, layers=layers, variant=variant, build_s=round(built, 1),
               tokens_per_s=tokens / row["s_per_step"], mfu=flops["total"] / row["s_per_step"] / peak())
    return row


def row_line(r: dict) -> str:
    mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "-"
    return (f"| {r['variant']} | {r['block']} | {r['layers']} | {r['s_per_step']:.3f} | {r['tokens_per_s']:,.0f} | "
            f"{100 * r['mfu']:.1f}% | {mem} | {r['syncs_per_step']} | {r['losses']} |")


HEADER = ("| variant | block | layers | s/step | tokens/s | MFU | peak GiB | host syncs/step | losses |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---|")


def fit_table(rows: list[dict], published: dict[int, tuple[float, float]], tiny: bool) -> str:
    lines = ["| block | variant | per layer, s | fixed part, s | 64 layers, s/step | tokens/s at 64 | MFU at 64 "
             "| vs base at 64 | vs published loop at 64 | per layer vs published |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    p = peak()
    for block in sorted({r["block"] for r in rows}):
        flops64 = step_flops(depth_config(DEPTH, tiny), bench_blocks(block, tiny, 6)[2:])["total"]
        fits = {}
        for variant in dict.fromkeys(r["variant"] for r in rows if r["block"] == block):
            f = fit([(r["layers"], r["s_per_step"]) for r in rows if r["block"] == block and r["variant"] == variant])
            if f:
                fits[variant] = (f[0], f[1], f[1] + DEPTH * f[0])
        pub = published.get(block)
        pub64 = pub[1] + DEPTH * pub[0] if pub else None
        for variant, (slope, intercept, t64) in fits.items():
            vs_base = f"{fits['base'][2] / t64:.2f}x" if "base" in fits else "-"
            vs_pub = f"{pub64 / t64:.2f}x" if pub else "-"
            per_layer = f"{pub[0] / slope:.2f}x" if pub else "-"
            lines.append(f"| {block} | {variant} | {slope:.4f} | {intercept:.3f} | {t64:.2f} | {block / t64:,.0f} | "
                         f"{100 * flops64 / t64 / p:.1f}% | {vs_base} | {vs_pub} | {per_layer} |")
        if pub:
            lines.append(f"| {block} | published loop (BENCHMARKS.md) | {pub[0]:.4f} | {pub[1]:.3f} | {pub64:.2f} | "
                         f"{block / pub64:,.0f} | {100 * flops64 / pub64 / p:.1f}% | - | 1.00x | 1.00x |")
    return "\n".join(lines)


def curve(args, spec: str, out: Path, world) -> None:
    block_s, layers_s, steps_s, variants = spec.split(":")
    block_len, layers, steps = int(block_s), int(layers_s), int(steps_s)
    blocks = bench_blocks(block_len, args.tiny, steps)
    curves = {}
    for variant in variants.split(","):
        run = build(args, block_len, layers, variant, out / "curve", world)
        times = [common.timed(lambda b=block: run.step([b], 1), device=world.device)[1][0] for block in blocks]
        curves[variant] = [loss for _, loss in run.result.losses[:steps]]
        print(f"curve {variant}: {steps} steps, median {statistics.median(times[2:]):.3f} s/step; losses every 5: "
              f"{[round(x, 4) for x in curves[variant][::5]]}", flush=True)
        del run
        common.reset_peak(world.device)
    names = list(curves)
    for other in names[1:]:
        a, b = curves[names[0]], curves[other]
        diffs = [y - x for x, y in zip(a, b)]
        tail = min(10, len(a))
        print(f"\ncurve {other} - {names[0]} ({block_len} block, {layers} layers, {steps} steps): max |diff| "
              f"{max(map(abs, diffs)):.4f}, mean diff {statistics.mean(diffs):+.4f}, last-{tail} mean "
              f"{statistics.mean(a[-tail:]):.4f} vs {statistics.mean(b[-tail:]):.4f}; first {a[0]:.4f} vs {b[0]:.4f}",
              flush=True)
    print("CURVE " + json.dumps({"spec": spec, "curves": curves}), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="*", default=None,
                        help="BLOCK:LAYERS:VARIANT, or curve:BLOCK:LAYERS:STEPS:VARIANTS, in the order given")
    parser.add_argument("--curve", nargs="*", default=[], help="BLOCK:LAYERS:STEPS:VARIANT,VARIANT")
    parser.add_argument("--published", nargs="*", default=[], help="BLOCK:SLOPE:INTERCEPT of the published loop")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget", type=float, default=1e9, help="seconds: parts after this are skipped")
    parser.add_argument("--min-left", type=float, default=45, help="skip a part with fewer seconds left")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tiny", action="store_true", help="CPU logic check: tiny config, 512-token blocks")
    args = parser.parse_args()
    start = time.perf_counter()
    if args.parts is None:
        args.parts = (["512:2:base", "512:2:fp8", "512:4:base", "512:4:fp8", "512:2:chunked", "512:4:chunked"]
                      if args.tiny else ["32768:4:base", "32768:8:base"])
        if args.tiny and not args.curve:
            args.curve = ["512:2:6:base,fp8"]
    published = {int(b): (float(s), float(i)) for b, s, i in (p.split(":") for p in args.published)}
    out = (args.out or Path(tempfile.mkdtemp(prefix="ftcli-levers-"))).resolve()
    world = _world()
    print(f"levers: {len(args.parts)} parts, {len(args.curve)} curves; --set "
          f"{' '.join(b300_settings(args.tiny))}", flush=True)
    rows, blocks = [], {}
    items = [("curve", p.removeprefix("curve:")) if p.startswith("curve:") else ("part", p) for p in args.parts]
    for item in items + [("curve", c) for c in args.curve]:
        left = args.budget - (time.perf_counter() - start)
        if left < args.min_left:
            print(f"### {item[1]}: skipped, {left:.0f} s left", flush=True)
            continue
        print(f"### {item[0]} {item[1]} at {time.perf_counter() - start:.0f} s", flush=True)
        try:
            if item[0] == "curve":
                curve(args, item[1], out, world)
                continue
            r = measure(args, item[1], out, world, blocks)
        except Exception as e:  # noqa: BLE001 - a lever that fails is a result: say why, go on
            print(f"### {item[1]}: failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
            common.reset_peak(world.device)
            continue
        rows.append(r)
        print(f"{HEADER}\n{row_line(r)}\nstep times {r['times']}; build {r['build_s']} s; syncs "
              f"{r['syncs_by_line']}", flush=True)
        print("ROW " + json.dumps(r), flush=True)
    print(f"\n## levers ({'tiny CPU check' if args.tiny else 'GPU'})\n\n{HEADER}", flush=True)
    print("\n".join(row_line(r) for r in rows), flush=True)
    print("\n" + fit_table(rows, published, args.tiny), flush=True)
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
