"""Context parallelism's causal imbalance: the forward FLOPs of each rank of a CP group on one packed block, with
contiguous slices and with the balanced (zigzag) layout (training.context_parallel_balance), by
ftcli.estimate.cpbalance (the arithmetic `ftcli plan` says: dense, gated-delta and attention FLOPs per rank, the
attention pairs counted over the pieces `CPSlice.pieces()` gives the attention kernels). CPU only, no model built.

Per rank: the sum; `max / mean` is the slowest rank against a perfect split (what the step waits for, compute only:
no communication, no recomputation). Blocks: one document filling the block (the worst case: long-context data) and
documents of 8,192 tokens packed (short documents leave little triangle to balance).

    python benchmarks/cp_balance.py                          # Qwen3.8-27B and Llama-3.1-8B, 32k and 128k, CP 2 4 8
    python benchmarks/cp_balance.py --tokens 65536 --cp 8 --doc 16384
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import common

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ftcli.estimate import cpbalance, memory  # noqa: E402

MODELS = {"Qwen3.8-27B": "Qwen/Qwen3.8-27B", "Llama-3.1-8B": "meta-llama/Llama-3.1-8B-Instruct"}


def rank_flops(model_id: str, tokens: int, doc: int, n: int, balanced: bool) -> tuple[list[float], float]:
    """Forward FLOPs of each of the n ranks, and the attention share of the whole block's FLOPs."""
    cfg = json.loads(memory.shipped_shape_path(model_id).read_text())
    cfg = cfg.get("text_config", cfg)
    linear = (cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_num_value_heads"]) \
        if "linear_key_head_dim" in cfg else None
    return cpbalance.rank_flops(memory.shipped_shape(model_id), tokens, n, balanced, doc, linear)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--doc", type=int, nargs="+", default=[0, 8192], help="document length; 0: one fills the block")
    args = ap.parse_args()
    print(common.header())
    rows = []
    for label, model_id in MODELS.items():
        for tokens in args.tokens:
            for doc in args.doc:
                for n in args.cp:
                    (contiguous, share), (balanced, _) = (rank_flops(model_id, tokens, doc or tokens, n, b)
                                                          for b in (False, True))
                    mean = sum(contiguous) / n
                    rows.append([label, f"{tokens:,}", f"{doc:,}" if doc else "1 per block", str(n),
                                 f"{share:.0%}", f"{min(contiguous) / 1e12:,.0f} .. {max(contiguous) / 1e12:,.0f}",
                                 f"{max(contiguous) / mean:.3f}",
                                 f"{min(balanced) / 1e12:,.0f} .. {max(balanced) / 1e12:,.0f}",
                                 f"{max(balanced) / mean:.3f}"])
    print(common.table(["model", "block", "documents", "CP", "attention share", "contiguous TFLOP per rank",
                        "contiguous max/mean", "balanced TFLOP per rank", "balanced max/mean"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
