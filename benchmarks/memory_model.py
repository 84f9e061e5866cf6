"""Per-GPU peak memory of full SFT with ftcli's FSDP2 loop, calibrated on one H200, extrapolated to the
64-layer Qwen3.8-27B recipe on 8 GPUs.

    python benchmarks/memory_model.py            # 64 layers, 32k (and 8k/16k) blocks, 8xH100 / 8xH200 / 8xB300
    python benchmarks/memory_model.py --check    # the calibration points and the cross-checks

The model splits a GPU's peak (torch.cuda.max_memory_allocated) into two parts:

    peak = state + transient

    state      sharded master weights, gradients and AdamW moments: P_trainable * (w + g + 2*o) / world
               (w/g/o bytes: 4/4/4 with fp32 master weights, 2/2/2 with bf16 master weights) plus the frozen
               vision tower of the VLM class (its weights only, sharded). Exact from the config.
    transient  everything that lives only during a step: the root unit (embeddings, LM head) gathered in
               bf16, the saved activations, one layer's recompute + backward, the loss's logits, the root's
               unsharded gradients before their reduce-scatter. It does not depend on the world size
               (FSDP gathers whole units on every rank), so it is MEASURED on the 4-layer, 1-GPU benchmark
               (same hidden size, vocab and layer mix as the 64-layer model) and grown by what each extra
               layer keeps:

                   full checkpointing   T * hidden * 2 bytes per layer (its bf16 input; exact)
                   selective            half the layers keep everything: A(T) per stored layer
                   none                 A(T) per layer

    A(T), one stored layer's activations, comes from the same measurements: (none - full) / 4 layers +
    the checkpointed input, i.e. 10.3 GiB at 32k (an upper bound: the selective runs imply 8.4).

Checks (--check): the selective runs predicted from the full-checkpointing ones, and the reference loop's
REFERENCE.md facts (8xH100 fits 8k blocks, not 16k) predicted from its one-H200 anchors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GiB = 1024**3
CONFIG = Path(__file__).parent / "configs" / "qwen3_8-27b-text.json"
VISION_PARAMS = 0.46e9  # the VLM class loads a vision tower too (REFERENCE.md section 2); frozen in ftcli
CARDS = {"8xH100 (80 GB)": 80e9, "8xH200 (141 GB)": 141e9, "8xB300 (288 GB)": 288e9}
USABLE = 0.92  # CUDA context, NCCL buffers, allocator fragmentation: plan on ~92% of the card
HIDDEN = 5120

# Measured on one H200 (BENCHMARKS.md "Full SFT"), 4 layers at 27B width, allocated peak in GiB.
# key: (block tokens, master dtype, activation checkpointing, loss impl) -> peak GiB
MEASURED_4L = {
    (32768, "fp32", "full", "chunked"): 74.1,
    (32768, "fp32", "selective", "chunked"): 90.3,
    (32768, "fp32", "none", "chunked"): 114.1,
    (32768, "fp32", "none", "liger"): 107.8,
    (32768, "bf16", "full", "chunked"): 49.3,
    (32768, "bf16", "selective", "chunked"): 67.5,
    (16384, "fp32", "full", "chunked"): 70.1,
    (8192, "fp32", "full", "chunked"): 70.1,
    (32768, "bf16", "full", "full"): 121.3,  # the reference loop (full-logit loss)
}
# REFERENCE.md section 6: the reference loop's one-H200 peaks at 8k and 16k (GiB).
REFERENCE_ANCHORS_4L = {(8192, "bf16", "full", "full"): 54.7, (16384, "bf16", "full", "full"): 82.0}


def param_counts(layers: int) -> dict[str, float]:
    """Exact parameter counts of the text model from its config (meta device, no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    data = json.loads(CONFIG.read_text())
    model_type = data.pop("model_type")
    period = data["layer_types"]
    data["layer_types"] = [period[i % len(period)] for i in range(layers)]
    data["num_hidden_layers"] = layers
    config = AutoConfig.for_model(model_type, **data)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {"total": sum(p.numel() for p in model.parameters()), "layers": layers, "hidden": config.hidden_size}


def state_bytes(params: float, world: int, master: str, frozen: float = 0.0) -> float:
    per = 16 if master == "fp32" else 8
    weight = 4 if master == "fp32" else 2
    return (params * per + frozen * weight) / world


def stored_layer_gib(tokens: int) -> float:
    """A(T): one layer's saved activations without checkpointing, from the 32k runs, linear in T."""
    none, full = MEASURED_4L[(32768, "fp32", "none", "chunked")], MEASURED_4L[(32768, "fp32", "full", "chunked")]
    at_32k = (none - full) / 4 + 32768 * HIDDEN * 2 / GiB
    return at_32k * tokens / 32768


def transient_4l(tokens: int, master: str, ac: str, loss: str, p4: dict) -> float:
    key = (tokens, master, ac, loss)
    table = {**MEASURED_4L, **REFERENCE_ANCHORS_4L}
    if key in table:
        return table[key] - state_bytes(p4["total"], 1, master) / GiB
    if ac != "full":  # from the full-checkpointing measurement: stored layers instead of inputs
        base = transient_4l(tokens, master, "full", loss, p4)
        stored = 2 if ac == "selective" else 4
        return base + stored * (stored_layer_gib(tokens) - tokens * HIDDEN * 2 / GiB)
    if master == "bf16" and (tokens, "fp32", ac, loss) in MEASURED_4L:  # bf16 keeps a bf16 + fp32 grad copy
        shift = MEASURED_4L[(32768, "bf16", "full", "chunked")] - state_bytes(p4["total"], 1, "bf16") / GiB
        shift -= MEASURED_4L[(32768, "fp32", "full", "chunked")] - state_bytes(p4["total"], 1, "fp32") / GiB
        return transient_4l(tokens, "fp32", ac, loss, p4) + shift
    raise KeyError(f"no measurement to calibrate {key}")


def predict(layers_p: dict, p4: dict, *, tokens: int, world: int, master: str, ac: str, loss: str) -> dict:
    extra_layers = layers_p["layers"] - 4
    per_layer = {"full": tokens * HIDDEN * 2 / GiB, "selective": 0.5 * (stored_layer_gib(tokens) + tokens * HIDDEN * 2 / GiB),
                 "none": stored_layer_gib(tokens)}[ac]
    state = state_bytes(layers_p["total"], world, master, VISION_PARAMS) / GiB
    transient = transient_4l(tokens, master, ac, loss, p4) + extra_layers * per_layer
    return {"state": state, "transient": transient, "total": state + transient}


def layers_to_keep(layers_p: dict, p4: dict, *, tokens: int, master: str, capacity: float, world: int = 8) -> int:
    """With full checkpointing, how many layers may keep their activations (training.activation_checkpointing_keep)
    and still fit the card: each kept layer stores A(T) instead of its bf16 input."""
    base = predict(layers_p, p4, tokens=tokens, world=world, master=master, ac="full", loss="chunked")["total"]
    spare = USABLE * capacity / GiB - base
    per_layer = stored_layer_gib(tokens) - tokens * HIDDEN * 2 / GiB
    return max(0, min(layers_p["layers"], int(spare // per_layer))) if spare > 0 else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="print the calibration and the cross-checks")
    args = ap.parse_args()
    p4, p64 = param_counts(4), param_counts(64)
    if args.check:
        print(f"4-layer model: {p4['total'] / 1e9:.3f}B params; A(32k) = {stored_layer_gib(32768):.1f} GiB per stored layer")
        print("\n| check | predicted GiB | measured GiB |\n|---|---|---|")
        for master in ("fp32", "bf16"):
            base = MEASURED_4L[(32768, master, "full", "chunked")]
            pred = base + 2 * (stored_layer_gib(32768) - 32768 * HIDDEN * 2 / GiB)
            print(f"| 4 layers, 32k, {master} master, selective (from full) | {pred:.1f} | "
                  f"{MEASURED_4L[(32768, master, 'selective', 'chunked')]:.1f} |")
        for tokens in (8192, 16384):
            r = predict(p64, p4, tokens=tokens, world=8, master="bf16", ac="full", loss="full")
            fits = "fits" if r["total"] <= USABLE * 80e9 / GiB else "does not fit"
            print(f"| reference loop, 64 layers, 8xH100, {tokens // 1024}k: {fits} (REFERENCE.md: 8k fits, "
                  f"16k does not) | {r['total']:.1f} | - |")
    print(f"\n64-layer Qwen3.8-27B: {p64['total'] / 1e9:.2f}B text params + {VISION_PARAMS / 1e9:.2f}B frozen vision; "
          f"8 GPUs; GiB per GPU; 'fits' = total <= {USABLE:.0%} of the card\n")
    print("| block | master | checkpointing | loss | state | transient | total | 8xH100 (80 GB) | 8xH200 (141 GB) | 8xB300 (288 GB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = [(32768, m, ac, "chunked") for m in ("fp32", "bf16") for ac in ("full", "selective", "none")]
    rows += [(16384, m, "full", "chunked") for m in ("fp32", "bf16")] + [(8192, m, "full", "chunked") for m in ("fp32", "bf16")]
    rows += [(32768, "bf16", "full", "full")]
    for tokens, master, ac, loss in rows:
        r = predict(p64, p4, tokens=tokens, world=8, master=master, ac=ac, loss=loss)
        fits = ["yes" if r["total"] <= USABLE * cap / GiB else "no" for cap in CARDS.values()]
        print(f"| {tokens // 1024}k | {master} | {ac} | {loss} | {r['state']:.1f} | {r['transient']:.1f} | "
              f"{r['total']:.1f} | {' | '.join(fits)} |")
    print("\nFull checkpointing, 32k blocks: layers that can keep their activations "
          "(training.activation_checkpointing_keep) and still fit\n")
    print("| master | " + " | ".join(CARDS) + " |\n|---|" + "---|" * len(CARDS))
    for master in ("fp32", "bf16"):
        keep = [layers_to_keep(p64, p4, tokens=32768, master=master, capacity=cap) for cap in CARDS.values()]
        print(f"| {master} | " + " | ".join(map(str, keep)) + " |")


if __name__ == "__main__":
    main()
