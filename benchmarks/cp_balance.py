"""Context parallelism's causal imbalance: the forward FLOPs of each rank of a CP group on one packed block, with
contiguous slices and with the balanced (zigzag) layout (training.context_parallel_balance), counted from the same
`CPSlice.pieces()` the attention kernels run over. CPU only, arithmetic, no model built.

    dense        2 x (non-embedding parameters + LM head) per token: the same on every rank (T / N tokens each)
    gated delta  Qwen3.5's linear-attention layers, per token and value head: 6 dk dv (state update and readout) +
                 2 x 64 (dk + dv) (the chunked kernel's in-chunk terms, chunk 64): the same on every rank
    attention    4 x query width per (query, key) pair a full-attention layer computes, pairs = the causal triangle
                 of each segment piece of the rank's queries against the keys of its segment before them

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

from ftcli.estimate import memory  # noqa: E402
from ftcli.model.kernels.cp import CPSlice  # noqa: E402

MODELS = {"Qwen3.8-27B": "Qwen/Qwen3.8-27B", "Llama-3.1-8B": "meta-llama/Llama-3.1-8B-Instruct"}
GDN_CHUNK = 64


def config_of(model_id: str) -> dict:
    cfg = json.loads(memory.shipped_shape_path(model_id).read_text())
    return cfg.get("text_config", cfg)


def causal_pairs(cp: CPSlice) -> int:
    """(query, key) pairs of this rank's queries: per piece, queries q0..q1-1 see keys s..q."""
    total = 0
    for s, q0, q1 in cp.pieces():
        a, b = q0 - s + 1, q1 - s
        total += (a + b) * (b - a + 1) // 2
    return total


def rank_flops(model_id: str, tokens: int, doc: int, n: int, balanced: bool) -> tuple[list[float], float]:
    """Forward FLOPs of each of the n ranks, and the attention share of the whole block's FLOPs."""
    cfg, shape = config_of(model_id), memory.shipped_shape(model_id)
    kinds = shape.layer_kinds or ("full_attention",) * shape.layers
    full = sum(1 for k in kinds if k == "full_attention")
    linear = len(kinds) - full
    q_dim, _ = memory.attention_dims(shape)
    dense_per_token = 2 * (sum(shape.layer_params) + shape.hidden * shape.vocab)
    if linear:
        dk, dv, heads = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_num_value_heads"]
        dense_per_token += linear * heads * (6 * dk * dv + 2 * GDN_CHUNK * (dk + dv))
    cu = sorted({*range(0, tokens, doc), tokens})
    out, attention = [], 0.0
    for r in range(n):
        attn = full * 4 * q_dim * causal_pairs(CPSlice.of(cu, r, n, None, balanced))
        attention += attn
        out.append(dense_per_token * tokens / n + attn)
    return out, attention / sum(out)


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
