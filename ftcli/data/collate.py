"""Block -> the packed model call's kwargs (the only torch in ftcli.data).

    model(**block_to_model_inputs(block))  ==  model(input_ids, labels, position_ids, seq_idx,
                                                      cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k)

input_ids / labels / position_ids are int64 [1, T]; seq_idx int32 [1, T]; cu_seq_lens_q/k the same
int32 [S + 1] tensor; max_length_q/k python ints. Labels stay unshifted (the model shifts).
"""

from __future__ import annotations

import numpy as np
import torch

from ftcli.data.packing import Block


def block_to_model_inputs(block: Block, device="cpu") -> dict:
    def long(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(a, dtype=np.int64)).unsqueeze(0).to(device)

    cu = torch.from_numpy(np.asarray(block.cu_seqlens, dtype=np.int32)).to(device)
    return {
        "input_ids": long(block.input_ids),
        "labels": long(block.labels),
        "position_ids": long(block.position_ids),
        "seq_idx": torch.from_numpy(np.asarray(block.seq_idx, dtype=np.int32)).unsqueeze(0).to(device),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": int(block.max_seqlen),
        "max_length_k": int(block.max_seqlen),
    }
