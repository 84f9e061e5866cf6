"""The memory model (ftcli.estimate.memory) on the 64-layer Qwen3.8-27B recipe, 8 GPUs per node, and its calibration.

    python benchmarks/memory_model.py            # the 64-layer table: 32k / 16k / 8k blocks on 8xH100 / 8xH200 / 8xB300
    python benchmarks/memory_model.py --check    # every measured H200 point (ftcli/assets/measured.json) vs the model

The model itself (state exact from the config, a transient fitted on the one-H200 measurements) lives in
ftcli/estimate/memory.py, where `ftcli plan` and `render-workload` use it; this script only prints it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also under runpy (tests/unit/estimate/test_memory_model.py)

import common  # noqa: E402
from ftcli.estimate import memory  # noqa: E402

CARDS = {"8xH100 (80 GB)": 80, "8xH200 (141 GB)": 141, "8xB300 (288 GB)": 288}
ROWS = [(32768, m, ac, "liger") for m in ("fp32", "bf16") for ac in ("full", "selective", "none")]
ROWS += [(16384, m, "full", "liger") for m in ("fp32", "bf16")] + [(8192, m, "full", "liger") for m in ("fp32", "bf16")]
ROWS += [(32768, "bf16", "full", "full")]  # the published qwen-b300 loop (full-logit loss)


def check() -> list[tuple[dict, float]]:
    """(measured point, predicted GiB) for every memory point."""
    out = []
    for p in memory.measured()["memory"]:
        shape, s = memory.point_setting(p)
        out.append((p, memory.estimate(shape, s).total))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="print the calibration points against the model")
    args = ap.parse_args()
    shape = memory.shipped_shape("Qwen/Qwen3.8-27B")
    fitted = memory.fit()
    print(f"fitted: stored layer {fitted['stored_layer_bytes']} bytes per token x hidden; full logits "
          f"{fitted['full_logits_bytes']:.3f} bytes per token x vocab")
    if args.check:
        columns = ["model", "layers", "method", "block", "master", "checkpointing", "loss", "measured GiB", "model GiB",
                   "error"]
        print("\n" + common.table(columns, [
            [p["model"], p["layers"], p["method"], p["block_len"], p["master"], p["checkpointing"], p["loss"],
             f"{p['peak_gib']:.1f}", f"{pred:.1f}", f"{100 * (pred / p['peak_gib'] - 1):+.1f}%"] for p, pred in check()]))
    print(f"\n64-layer Qwen3.8-27B: {shape.total_params / 1e9:.2f}B text params + {shape.frozen_params / 1e9:.2f}B frozen "
          f"vision; 8 GPUs; GiB per GPU; 'fits' = total <= {memory.USABLE:.0%} of the card\n")
    rows = []
    for tokens, master, ac, loss in ROWS:
        e = memory.estimate(shape, memory.Setting(tokens=tokens, world=8, master=master, checkpointing=ac, loss=loss))
        fits = ["yes" if e.total <= memory.usable_gib(gb) else "no" for gb in CARDS.values()]
        rows.append([f"{tokens // 1024}k", master, ac, loss, f"{e.state:.1f}", f"{e.total - e.state:.1f}",
                     f"{e.total:.1f}", *fits])
    print(common.table(["block", "master", "checkpointing", "loss", "state", "transient", "total", *CARDS], rows))
    print("\nFull checkpointing, 32k blocks: layers that can keep their activations "
          "(training.activation_checkpointing_keep) and still fit\n")
    settings = {master: memory.Setting(tokens=32768, world=8, master=master, loss="liger") for master in ("fp32", "bf16")}
    keep = [[master] + [memory.layers_to_keep(shape, s, gb) for gb in CARDS.values()] for master, s in settings.items()]
    print(common.table(["master", *CARDS], keep))


if __name__ == "__main__":
    main()
