"""Per-GPU memory model for full SFT of a Qwen3.5-family model with FSDP2 (ftcli's loop).

    python benchmarks/memory_model.py                 # the 64-layer 27B recipe on 8xH100 / 8xH200 / 8xB300
    python benchmarks/memory_model.py --check         # also predict the measured 4-layer H200 runs

Peak bytes per GPU = sharded state + unsharded working params + saved activations + one layer's
recompute/backward working set + the loss's logits. Counts are exact from the config (built on the
meta device); the two activation constants are per token and are fitted to the one-H200 measurements
in BENCHMARKS.md (4-layer 27B width), then reused for 64 layers:

    state      = P_total * (w + g + 2 * o) / world        w/g/o = master-weight, grad, AdamW-state bytes
                                                          (4/4/4 with fp32 master, 2/2/2 with bf16 master)
    params     = 2 layers' bf16 all-gathers (current + prefetched) + their fp32 reduce-scatter grads
               + the root unit (embeddings, lm_head, norm) unsharded in bf16 with its fp32 grads
    activations= L * T * h * 2 (full checkpointing keeps each layer's bf16 input)   [+ selective extra]
    working    = T * WORK_BYTES_PER_TOKEN                 (one layer recomputed + its backward)
    loss       = chunked: chunk * V * 12 ; full (reference): T * V * 12 (bf16 logits, fp32 upcast,
                 fp32 grad, bf16 grad)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GiB = 1024**3
CONFIG = Path(__file__).parent / "configs" / "qwen3_8-27b-text.json"
VISION_PARAMS = 0.46e9  # the VLM class also loads the vision tower (REFERENCE.md section 2)
CARDS = {"8xH100 (80 GB)": 80e9, "8xH200 (141 GB)": 141e9, "8xB300 (288 GB)": 288e9}
USABLE = 0.92  # allocator fragmentation and CUDA context: plan on ~92% of the card

# Fitted on the one-H200 4-layer runs (BENCHMARKS.md, "Memory model" section).
WORK_BYTES_PER_TOKEN = 160_000  # one layer's recompute + backward working set, bytes per token
SELECTIVE_EXTRA_PER_TOKEN_LAYER = 0  # extra saved bytes/token/layer with selective checkpointing


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
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    total = sum(p.numel() for p in model.parameters())
    return {
        "total": total,
        "layer_max": max(per_layer),
        "root": total - sum(per_layer),
        "hidden": config.hidden_size,
        "vocab": config.vocab_size,
        "layers": layers,
    }


def peak_bytes(pc: dict, *, tokens: int, world: int, master: str, loss: str, chunk: int = 4096,
               vision: float = 0.0) -> dict[str, float]:
    w = g = o = 4 if master == "fp32" else 2
    total = pc["total"] + vision
    parts = {
        "state": total * (w + g + 2 * o) / world,
        "params": 2 * pc["layer_max"] * (2 + 4) + pc["root"] * (2 + 4),
        "activations": pc["layers"] * tokens * pc["hidden"] * 2
        + pc["layers"] * tokens * SELECTIVE_EXTRA_PER_TOKEN_LAYER,
        "working": tokens * WORK_BYTES_PER_TOKEN,
        "loss": (chunk if loss == "chunked" else tokens) * pc["vocab"] * 12,
    }
    parts["total"] = sum(parts.values())
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="also predict the measured 4-layer runs")
    args = ap.parse_args()
    if args.check:
        small = param_counts(4)
        print("## 4-layer 27B width, one H200 (predicted; compare with the measured table)")
        print("| block | master | loss | predicted peak GiB |")
        print("|---|---|---|---|")
        for tokens in (8192, 16384, 32768):
            for master, loss in (("bf16", "full"), ("bf16", "chunked"), ("fp32", "chunked")):
                p = peak_bytes(small, tokens=tokens, world=1, master=master, loss=loss)
                print(f"| {tokens // 1024}k | {master} | {loss} | {p['total'] / GiB:.1f} |")
    full = param_counts(64)
    print(f"\n## 64-layer 27B (VLM class: {(full['total'] + VISION_PARAMS) / 1e9:.2f}B params), 32k blocks, 8 GPUs")
    print("| cluster | master | loss | state | params | activations | working | loss | total GiB | fits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for card, capacity in CARDS.items():
        for master in ("fp32", "bf16"):
            for loss in ("chunked", "full"):
                p = peak_bytes(full, tokens=32768, world=8, master=master, loss=loss, vision=VISION_PARAMS)
                cells = " | ".join(f"{p[k] / GiB:.1f}" for k in ("state", "params", "activations", "working", "loss"))
                fits = "yes" if p["total"] <= USABLE * capacity else "no"
                print(f"| {card} | {master} | {loss} | {cells} | {p['total'] / GiB:.1f} | {fits} |")


if __name__ == "__main__":
    main()
