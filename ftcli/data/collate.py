"""Block -> the packed model call's kwargs (the only torch in ftcli.data).

    model(**block_to_model_inputs(block))  ==  model(input_ids, labels, position_ids, seq_idx,
                                                      cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k,
                                                      fla_cu_seqlens, fla_chunk_indices, trained_positions)

input_ids / labels / position_ids are int64 [1, T]; seq_idx int32 [1, T]; cu_seq_lens_q/k the same
int32 [S + 1] tensor; max_length_q/k python ints. Labels stay unshifted (the model shifts).

Everything a kernel or the loss would otherwise derive from the block on the device (a host sync each
time: the output size depends on the data) is built here once, on the host, and handed to every layer:

    block           | a0 a1 a2 a3 a4 | b0 b1 | c0 |          (3 segments, T = 8; chunks of 4 for the picture)
    cu_seq_lens_q   0                5       7    8        int32 [S + 1]: varlen attention / flash-attn
    fla_cu_seqlens  0                5       7    8        int64 [S + 1]: fla's gated-delta rule and conv
    fla_chunk_indices [[0, 0], [0, 1], [1, 0], [2, 0]]     int64 [NT, 2]: (segment, chunk within it) of every
                     a0..a3   a4      b0 b1   c0           FLA_CHUNK-token chunk, the layout fla's varlen
                                                           kernels take (`chunk_indices`); segment a has 2
    labels          .  -  x  x  x    -  x    -             (- = -100; position t predicts labels[t + 1])
    trained_positions [1, 2, 3, 5]                         int64 [N]: the t whose target labels[t + 1] is
                                                           trained (N = Block.num_trained_tokens)
    pairs, num_segments                                    preference blocks only: Block.pairs (int64 [P, 2],
                                                           each pair's chosen and rejected segment), S

The fla_* tensors and trained_positions pass through transformers' model call as keyword arguments to
every decoder layer (ftcli.model.kernels reads them) and to `ftcli.train.loss` (attach_loss pops trained_positions);
a kernel that does not get them derives the same values itself. The same tensor objects reach every
layer, its activation-checkpointing recompute and its backward, so fla's identity-keyed caches hit too.
"""

from __future__ import annotations

import numpy as np
import torch

from ftcli.data.packing import IGNORE_INDEX, Block

FLA_CHUNK = 64  # fla's chunk size (tokens) of the gated-delta rule and the conv; fla_chunk_indices is for it


def fla_chunk_indices(cu_seqlens: np.ndarray, chunk: int = FLA_CHUNK) -> np.ndarray:
    """int64 [NT, 2]: (segment, chunk index within the segment) of every `chunk`-token chunk, segments in
    order (what fla's `prepare_chunk_indices` computes on the device)."""
    lens = np.diff(np.asarray(cu_seqlens, dtype=np.int64))
    counts = -(-lens // chunk)
    segment = np.repeat(np.arange(len(lens), dtype=np.int64), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    return np.stack([segment, np.arange(len(segment), dtype=np.int64) - first], axis=1)


def trained_positions(labels: np.ndarray) -> np.ndarray:
    """int64 [N]: the positions t whose next-token target labels[t + 1] is trained."""
    return np.flatnonzero(np.asarray(labels)[1:] != IGNORE_INDEX).astype(np.int64)


def block_to_model_inputs(block: Block, device="cpu") -> dict:
    def tensor(a: np.ndarray, dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)).to(device)

    cu = tensor(block.cu_seqlens, np.int32)
    pairs = {} if block.roles is None else {  # preference blocks: which segments are each pair's two sides
        "pairs": tensor(block.pairs, np.int64), "num_segments": len(block.cu_seqlens) - 1}
    if block.reference_logps is not None:  # precomputed reference (ftcli.data.reference): no reference forward
        pairs["reference_logps"] = tensor(block.reference_logps, np.float32)
    return {**pairs,
        "input_ids": tensor(block.input_ids, np.int64).unsqueeze(0),
        "labels": tensor(block.labels, np.int64).unsqueeze(0),
        "position_ids": tensor(block.position_ids, np.int64).unsqueeze(0),
        "seq_idx": tensor(block.seq_idx, np.int32).unsqueeze(0),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": int(block.max_seqlen),
        "max_length_k": int(block.max_seqlen),
        "fla_cu_seqlens": tensor(block.cu_seqlens, np.int64),
        "fla_chunk_indices": tensor(fla_chunk_indices(block.cu_seqlens), np.int64),
        "trained_positions": tensor(trained_positions(block.labels), np.int64),
    }


def cp_chunks(rank: int, size: int, balanced: bool) -> tuple[int, ...]:
    """The chunks of a block that context-parallel rank `rank` of `size` holds, in its local order: chunk `rank` of
    `size` (contiguous), or chunks `rank` and 2 size - 1 - rank of 2 size (balanced: torchtitan's and
    ring-flash-attn's zigzag; every rank holds one early and one late chunk, so each does the same causal work)."""
    return (rank, 2 * size - 1 - rank) if balanced else (rank,)


def slice_model_inputs(block: Block, rank: int, size: int, device="cpu", balanced: bool = False) -> dict:
    """This rank's slice of a block split into `size` contiguous slices (context parallelism): the model call's
    kwargs for tokens [start, end) = [rank * T/size, (rank + 1) * T/size) (the ops that look across the boundary,
    ftcli.model.kernels.cp, get the block's layout beside them). Two ranks, T = 12, one segment crossing the boundary:

        block        | a0 a1 a2 a3 a4 a5 | a6 a7 b0 b1 b2 b3 |
        rank         |        0          |        1          |
        position_ids |  0  1  2  3  4  5 |  6  7  0  1  2  3 |   sliced: per segment, across the boundary
        seq_idx      |  0  0  0  0  0  0 |  0  0  1  1  1  1 |   the block's segment numbers
        cu_seq_lens  0                   6    (rank 0)            the slice's own pieces of segments
                                         0     2           6      (rank 1: a6 a7 | b0 .. b3)
        labels       |  .  x  x  x  x  x    x |                   rank 0: T/N + 1 labels, the last being rank 1's
                                                                  first (position 5 predicts a6); the last rank
                                                                  pads one -100

    `balanced` (training.context_parallel_balance): the block is cut into 2 x size chunks and the rank holds two of
    them (`cp_chunks`), one after the other: | c0 c3 | on rank 0 and | c1 c2 | on rank 1 of 2; each chunk's last
    position predicts the token after the chunk, so labels[1:] are the local positions' targets wherever they lie,
    and cu_seq_lens also cuts between the two chunks.

    The block's `trained_positions` are re-derived for the slice, and the fla_* tensors left out (fla derives them
    from the slice's cu_seqlens). A preference block's `pairs` and `num_segments` stay the block's (seq_idx holds the
    block's segment numbers): each rank sums the log-probs of its part of every segment, and the CP group adds
    them up (ftcli.train.preference). The loss (ftcli.train.loss.token_loss_sum) takes T/N + 1 labels for T/N
    positions."""
    total = len(block.input_ids)
    chunks = cp_chunks(rank, size, balanced)
    num_chunks = size * len(chunks)
    if total % num_chunks:
        raise ValueError(f"a block of {total} tokens does not split into {num_chunks} equal chunks")
    n = total // num_chunks
    spans = [(c * n, (c + 1) * n) for c in chunks]
    block_cu = np.asarray(block.cu_seqlens, dtype=np.int64)
    following = np.concatenate([block.labels, np.full(1, IGNORE_INDEX, dtype=block.labels.dtype)])  # labels[T] = -100
    labels = np.concatenate([block.labels[spans[0][0]:spans[0][0] + 1], *(following[a + 1:b + 1] for a, b in spans)])
    cu = np.unique(np.concatenate([np.clip(block_cu, a, b) - a + k * n for k, (a, b) in enumerate(spans)]))

    def take(a: np.ndarray) -> np.ndarray:
        return np.concatenate([a[s:e] for s, e in spans])

    def tensor(a: np.ndarray, dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)).to(device)

    local_cu = tensor(cu, np.int32)
    pairs = {} if block.roles is None else {  # preference blocks: the block's pairs, in its segment numbers
        "pairs": tensor(block.pairs, np.int64), "num_segments": len(block.cu_seqlens) - 1}
    return {**pairs,
        "input_ids": tensor(take(block.input_ids), np.int64).unsqueeze(0),
        "labels": tensor(labels, np.int64).unsqueeze(0),
        "position_ids": tensor(take(block.position_ids), np.int64).unsqueeze(0),
        "seq_idx": tensor(take(block.seq_idx), np.int32).unsqueeze(0),
        "cu_seq_lens_q": local_cu,
        "cu_seq_lens_k": local_cu,
        "max_length_q": int(np.diff(cu).max()),
        "max_length_k": int(np.diff(cu).max()),
        "trained_positions": tensor(trained_positions(labels), np.int64),
    }
