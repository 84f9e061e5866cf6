"""Packed-sequence kernels: per machine, which implementation keeps the segments of a packed block apart.

A packed block is a batch of one row holding several examples end to end. Every layer must keep them
apart, and each op learns the boundaries from its own piece of metadata:

    tokens        | a0 a1 a2 a3 a4 | b0 b1 | c0 | p0 p1 p2 |     p = padding (its own segment, no loss)
    position_ids  |  0  1  2  3  4 |  0  1 |  0 |  0  1  2 |     restart at 0 in every segment
    cu_seqlens    0                5       7    8          11    int32, S+1 boundaries
    seq_idx       |  0  0  0  0  0 |  1  1 |  2 |  3  3  3 |     int32, segment of every token

    full attention: block-diagonal causal        gated-delta rule: the recurrent state restarts
    mask from cu_seqlens (else position_ids)     at every cu_seqlens boundary
            a a a a a b b c p p p                   S <- 0 | a0 .. a4 | S <- 0 | b0 b1 | S <- 0 | c0 ...
        a0  x
        a1  x x                                  causal conv (width W=4): y[t] sums x[t-j], j < W,
        a4  x x x x x                            only where seq_idx[t-j] == seq_idx[t]
        b0            x                              b1 = w3*b1 + w2*b0   (a3, a4 masked out)
        b1            x x                        A segment shorter than W (c0) sees only itself.
        c0                x
        p0                  x                    gpt-oss also has a sliding window (q - k < W) and a
        p2                  x x x                learned sink per head in the softmax denominator.

Backends, chosen per machine by `decide_backends` (a pure decision) and installed by
`enable_packed_kernels`:

    op                 CUDA                                             CPU (exact references)
    attention          flash-attn varlen, else torch varlen_attn        sdpa per segment
                       (sliding windows, Gemma 3: window_size);         (and window, per segment);
                       gpt-oss: flex attention + sinks                  gpt-oss: eager + sinks per segment
    gated_delta_rule   fla (its tilelang kernels on Hopper + Triton     transformers' chunked torch rule,
                       3.4-3.7.0, else refused: wrong gradients)        run once per segment
    causal_conv1d      causal-conv1d, else fla's Triton varlen conv     torch conv per seq_idx segment

The package, one concern a module (imports run downwards):

    choose.py    `decide_backends` (on a `ftcli.hardware.Machine`), `check_packing_safe` (no side effects, no torch)
    ops.py       the nine kernels, module-level functions in the table `KERNELS[op][backend]`
    cp.py        context parallelism: the same ops over one rank's slice of a block, across the slice boundaries
                 (`across_slices` wraps the installed kernels when `enable_packed_kernels(context_parallel=True)`)
    install.py   `enable_packed_kernels` / `install_backends` / `disable_packed_kernels`: puts them in place;
                 `block_masks_ahead`: flex attention's block masks built before the layers (for compiled layers)

Without any packing metadata every op computes exactly what transformers computes for one sequence.
An op that is handed the other op's metadata but not its own refuses (ValueError) instead of mixing
segments: a block with `cu_seq_lens_q` but no `seq_idx` (or the reverse) is a collator bug.
"""

from ftcli.model.kernels.choose import (
    FAMILY_OPS,
    MODEL_FAMILIES,
    QWEN35_MODULE,
    UNAVAILABLE,
    Backend,
    Machine,
    attention_backend,
    backend_problems,
    check_packing_safe,
    decide_backends,
    missing_global_problem,
    qwen35_missing_globals,
)

# install.py and ops.py import torch: they load on first use, so the decision (`ftcli doctor`) stays torch-free
_LAZY = {"ATTN_IMPLEMENTATIONS": "install", "block_masks_ahead": "install", "disable_packed_kernels": "install",
         "enable_packed_kernels": "install", "install_backends": "install", "KERNELS": "ops",
         "causal_conv1d_reference": "ops"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"ftcli.model.kernels.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ATTN_IMPLEMENTATIONS", "FAMILY_OPS", "KERNELS", "MODEL_FAMILIES", "QWEN35_MODULE", "UNAVAILABLE", "Backend",
    "Machine", "attention_backend", "backend_problems", "block_masks_ahead", "causal_conv1d_reference",
    "check_packing_safe", "decide_backends",
    "disable_packed_kernels", "enable_packed_kernels", "install_backends", "missing_global_problem",
    "qwen35_missing_globals",
]
