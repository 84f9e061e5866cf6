"""Issue 30 part 2: fp8 (torchao float8, tensorwise vs rowwise) against bf16 on a model with pretrained-like
statistics, at the 27B width with 4 layers, on one GPU.

No pretrained weights are reachable, so the random init gets what pretrained LLMs are known for:
    - massive activations: CHANNELS hidden channels of the residual stream at ~SCALE x the rest (the
      embedding's columns, so every position carries them through all layers);
    - outlier norm weights: CHANNELS other hidden channels where the decoder norms' gain is SCALE x;
      the other gains drawn log-normal (sigma 0.3) around 1 instead of exactly 1;
    - heavy-tailed weights: every decoder linear redrawn from a Student t (3 degrees of freedom) with the
      init's standard deviation.

Three measurements:
    gemm   one forward of the plain model (with and without the statistics): for every linear that fp8
           would take (ftcli.features.float8.fp8_filter), the relative error ||y_fp8 - y_bf16|| / ||y_bf16||
           of its output on its real input, for each recipe (torchao Float8Linear on a copy of the linear);
    curve  `ftcli train`'s worker (ftcli.train.full.FullRun, qwen-b300's settings, benchmarks/levers_gpu.build)
           for --steps steps from the same init, the statistics applied after the build, on the same blocks:
           bf16, fp8 tensorwise, fp8 rowwise; loss and grad-norm curves and their differences;
    speed  s/step of the three at --speed-block tokens with qwen-b300's compile=regions.

    python3 benchmarks/fp8_outliers_gpu.py [--steps 100] [--block 4096] [--speed-block 32768]
    python3 benchmarks/fp8_outliers_gpu.py --tiny     # CPU logic check (tiny config, emulated float8)
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import common  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

RECIPES = {"bf16": ["training.precision.fp8=false"],
           "tensorwise": ["training.precision.fp8=true", "training.precision.fp8_recipe=tensorwise"],
           "rowwise": ["training.precision.fp8=true", "training.precision.fp8_recipe=rowwise"]}


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p


@torch.no_grad()
def make_pretrained_like(model: nn.Module, channels: int = 6, scale: float = 100.0, seed: int = 0) -> dict:
    """In place (see the module doc); the same result for the same init and seed. Returns what it did."""
    from ftcli.model.build import decoder_layers

    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.get_text_config().hidden_size
    picked = torch.randperm(hidden, generator=gen)[:2 * channels]
    massive, gains = picked[:channels].tolist(), picked[channels:].tolist()
    layers = decoder_layers(model)
    device = _local(embed_weight := model.get_input_embeddings().weight).device
    torch.manual_seed(seed)  # the t draws below run on the model's device: the same weights for every variant
    t = torch.distributions.StudentT(torch.tensor(3.0, device=device))
    for layer in layers:
        for module in layer.modules():
            if isinstance(module, nn.Linear):
                w = _local(module.weight)
                std = w.float().std()
                draw = t.sample(w.shape) / (3.0 ** 0.5)  # unit variance
                w.copy_((draw * std).to(w.dtype))
        for name in ("input_layernorm", "post_attention_layernorm"):
            norm = getattr(layer, name, None)
            if norm is None:
                continue
            w = _local(norm.weight)
            zero_centred = bool((w == 0).all())  # Qwen3.5's norms scale by (1 + weight), init 0
            gain = torch.exp(0.3 * torch.randn(w.shape, generator=gen))
            gain[gains] = scale
            gain = gain.to(w.device)
            w.copy_((gain - 1 if zero_centred else gain).to(w.dtype))
    embed = _local(embed_weight)
    embed[:, massive] *= scale
    return {"massive_channels": massive, "gain_channels": gains, "scale": scale}


def residual_ratio(model, inputs) -> float:
    """max |h| / median |h| of the residual stream after the first layer, on `inputs`."""
    from ftcli.model.build import decoder_layers

    seen = {}
    hook = decoder_layers(model)[0].register_forward_hook(lambda m, a, out: seen.setdefault(
        "h", (out[0] if isinstance(out, tuple) else out).detach()))
    with torch.no_grad():
        model(input_ids=inputs)
    hook.remove()
    h = seen["h"].float().abs()
    return float(h.amax() / h.median())


@torch.no_grad()
def gemm_errors(model, inputs, recipes=("tensorwise", "rowwise")) -> list[dict]:
    """Per fp8-eligible linear: relative error of each recipe's output against bf16 on the linear's real input."""
    from torchao.float8.float8_linear import Float8Linear

    from ftcli.features.float8 import fp8_config, fp8_filter
    from ftcli.model.build import decoder_layers

    names = {id(m): n for n, m in model.named_modules()}
    prefixes = tuple(names[id(layer)] + "." for layer in decoder_layers(model))
    keep = fp8_filter(model.config.get_text_config().hidden_size, prefixes)
    fp8 = {r: {} for r in recipes}
    rows, hooks = [], []

    def hook(module, args, out):
        x = args[0]
        ref = out.float()
        row = {"linear": names[id(module)].split("layers.", 1)[-1], "in_ratio": float(
            x.float().abs().amax() / x.float().abs().median().clamp_min(1e-12))}
        for r in recipes:
            if id(module) not in fp8[r]:
                fp8[r][id(module)] = Float8Linear.from_float(copy.deepcopy(module), config=fp8_config(r))
            y = fp8[r][id(module)](x).float()
            row[r] = float((y - ref).norm() / ref.norm())
        rows.append(row)
        fp8_r = [fp8[r].pop(id(module)) for r in recipes]  # free the copies
        del fp8_r

    for name, module in model.named_modules():
        if keep(module, name):
            hooks.append(module.register_forward_hook(hook))
    model(input_ids=inputs)
    for h in hooks:
        h.remove()
    return rows


def plain_model(args, device):
    """The plain (unsharded) model of the benchmark's config: random init, bf16 (float32 on the tiny CPU check)."""
    from reference_loop_gpu import write_depth_config

    from ftcli.config.recipe import ModelConfig
    from ftcli.model.build import load_model

    torch.manual_seed(0)
    config = write_depth_config(args.layers, args.tiny, Path(tempfile.mkdtemp(prefix="fp8-config-")))
    model = load_model(ModelConfig(init="random", config=str(config), tokenizer="unused", model_type="qwen3_5_text",
                                   dtype="float32" if args.tiny else "bfloat16"), device=device)
    return model.eval()


def gemm_part(args, device) -> dict:
    out = {}
    for label, pretrained in (("random init", False), ("pretrained-like", True)):
        model = plain_model(args, device)
        if pretrained:
            out["statistics"] = make_pretrained_like(model, args.channels, args.scale)
        gen = torch.Generator().manual_seed(1)
        vocab = model.config.get_text_config().vocab_size
        inputs = torch.randint(0, vocab, (1, args.gemm_tokens), generator=gen).to(device)
        ratio = residual_ratio(model, inputs)
        rows = gemm_errors(model, inputs)
        out[label] = {"residual_max_over_median": ratio, "rows": rows}
        print(f"\ngemm errors, {label} (residual max/median after layer 0: {ratio:.0f}):", flush=True)
        print("| linear | input max/median | tensorwise rel. err | rowwise rel. err |\n| --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['linear']} | {r['in_ratio']:.0f} | {r['tensorwise']:.4f} | {r['rowwise']:.4f} |")
        del model
        common.reset_peak(device)
    return out


def _grad_norms(run) -> list[float]:
    path = run.metrics_path
    if path is None or not Path(path).is_file():
        return []
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r["grad_norm"] for r in rows if "grad_norm" in r and "loss" in r]


def train_part(args, world, out_dir: Path, block: int, steps: int, extra: list[str], label: str,
               pretrained: bool = True) -> dict:
    import levers_gpu
    from reference_loop_gpu import bench_blocks

    blocks = bench_blocks(block, args.tiny, steps)
    result = {}
    for recipe, sets in RECIPES.items():
        name = f"{label}-{recipe}"
        levers_gpu.VARIANTS[name] = sets + extra
        try:
            run = levers_gpu.build(args, block, args.layers, name, out_dir, world)
            if pretrained:
                make_pretrained_like(run.model, args.channels, args.scale)
            times = [common.timed(lambda b=b: run.step([b], 1), device=world.device)[1][0] for b in blocks]
            losses = [loss for _, loss in run.result.losses]
            result[recipe] = {"losses": losses, "grad_norms": _grad_norms(run), "times": times,
                              "s_per_step": statistics.median(times[min(3, len(times) - 1):])}
            print(f"{label} {recipe}: {len(losses)} steps, median {result[recipe]['s_per_step']:.3f} s/step; losses "
                  f"every 10: {[round(x, 4) for x in losses[::10]]}", flush=True)
            del run
        except Exception as e:  # noqa: BLE001 - one recipe failing must not lose the others' numbers
            import traceback

            traceback.print_exc()
            result[recipe] = {"error": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"}
        common.reset_peak(world.device)
    return result


def compare(curves: dict, label: str) -> list[dict]:
    base = curves.get("bf16", {})
    rows = []
    for recipe in ("tensorwise", "rowwise"):
        c = curves.get(recipe, {})
        if "losses" not in c or "losses" not in base:
            rows.append({"recipe": recipe, "error": c.get("error") or base.get("error")})
            continue
        a, b = base["losses"], c["losses"]
        n = min(len(a), len(b))
        diffs = [y - x for x, y in zip(a[:n], b[:n])]
        tail = min(10, n)
        ga, gb = base["grad_norms"], c["grad_norms"]
        grel = [abs(y - x) / max(abs(x), 1e-12) for x, y in zip(ga, gb)]
        rows.append({"recipe": recipe, "steps": n, "max_abs_loss_diff": max(map(abs, diffs)),
                     "mean_loss_diff": statistics.mean(diffs), "last_mean_bf16": statistics.mean(a[n - tail:n]),
                     "last_mean": statistics.mean(b[n - tail:n]), "first": (a[0], b[0]),
                     "grad_norm_rel_diff_median": statistics.median(grel) if grel else None,
                     "grad_norm_rel_diff_max": max(grel) if grel else None,
                     "s_per_step": c["s_per_step"], "s_per_step_bf16": base["s_per_step"]})
    print(f"\n{label}: fp8 recipe vs bf16\n| recipe | steps | max abs loss diff | mean diff | last-10 mean (bf16 / fp8) | "
          "grad-norm rel. diff median / max | s/step (bf16 / fp8) |\n| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['recipe']} | error: {r['error']} |")
            continue
        g = (f"{r['grad_norm_rel_diff_median']:.4f} / {r['grad_norm_rel_diff_max']:.4f}"
             if r["grad_norm_rel_diff_median"] is not None else "-")
        print(f"| {r['recipe']} | {r['steps']} | {r['max_abs_loss_diff']:.4f} | {r['mean_loss_diff']:+.4f} | "
              f"{r['last_mean_bf16']:.4f} / {r['last_mean']:.4f} | {g} | {r['s_per_step_bf16']:.3f} / "
              f"{r['s_per_step']:.3f} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--block", type=int, default=4096)
    ap.add_argument("--speed-block", type=int, default=32768)
    ap.add_argument("--speed-steps", type=int, default=7)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--channels", type=int, default=6)
    ap.add_argument("--scale", type=float, default=100.0)
    ap.add_argument("--gemm-tokens", type=int, default=4096)
    ap.add_argument("--parts", default="gemm,curve,speed")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.tiny:
        args.steps, args.block, args.speed_block, args.speed_steps, args.gemm_tokens = 6, 512, 512, 4, 256
    from depth_gpu import _world

    world = _world()
    device = world.device
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="fp8-outliers-"))
    card = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{card}: torch {torch.__version__}, {args.layers} layers of the {'tiny' if args.tiny else '27B'} width; "
          f"{args.channels} massive residual channels and {args.channels} norm-gain channels at {args.scale:g}x, "
          f"Student-t(3) decoder weights", flush=True)
    report = {}
    parts = args.parts.split(",")
    if "gemm" in parts:
        report["gemm"] = gemm_part(args, device)
    if "curve" in parts:
        curves = train_part(args, world, out_dir, args.block, args.steps, ["training.compile=false"], "curve")
        report["curve"] = {"curves": curves, "compare": compare(curves, f"curve ({args.block}-token blocks, "
                                                                         f"{args.steps} steps, compile off)")}
    if "speed" in parts:
        speed = train_part(args, world, out_dir, args.speed_block, args.speed_steps, ["training.compile=regions"],
                           "speed")
        report["speed"] = {r: c.get("s_per_step", c.get("error")) for r, c in speed.items()}
        print(f"\nspeed ({args.speed_block}-token blocks, compile=regions, median s/step after 3): "
              + ", ".join(f"{r} {v:.3f}" if isinstance(v, float) else f"{r} {v}" for r, v in report["speed"].items()),
              flush=True)
    print("FP8OUTLIERS " + json.dumps(report))


if __name__ == "__main__":
    main()
