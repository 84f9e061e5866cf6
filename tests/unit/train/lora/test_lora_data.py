"""The LoRA path's collator: blocks laid end to end stay apart. That TRL's data loader hands exactly the blocks
`ftcli pack-preview --dump` writes to the model: tests/e2e/test_lora_trl_build.py (it builds an SFTTrainer)."""

from __future__ import annotations

import torch


def test_blocks_laid_end_to_end_never_predict_across_blocks():
    import numpy as np

    from ftcli.data import make_block
    from ftcli.train.lora.trainer import collate_blocks

    a = make_block(np.array([5, 6, 7, 8]), np.array([True, False, True, True]), [4], 4, pad_id=0)
    b = make_block(np.array([9, 10, 11]), np.array([True, True, True]), [3], 3, pad_id=0)
    out = collate_blocks([a, b])
    assert out["labels"].tolist() == [[5, -100, 7, 8, -100, 10, 11]]
    assert out["cu_seq_lens_q"].tolist() == [0, 4, 7] and out["cu_seq_lens_q"].dtype == torch.int32
    assert out["seq_idx"].tolist() == [[0, 0, 0, 0, 1, 1, 1]] and out["max_length_q"] == 4
