"""Eval under context parallelism (ftcli.train.evaluate.Evaluator.split_blocks): which part of a block each rank of a
CP group evaluates and who counts it. No launch: the loss is a stand-in that records its inputs."""

from __future__ import annotations

import numpy as np
import torch

from ftcli.data.packing import make_block
from ftcli.model.kernels.cp import CP_KWARG
from ftcli.train.evaluate import Evaluator


def a_block(tokens: int):
    ids, mask = np.arange(3, 3 + tokens, dtype=np.int32), np.ones(tokens, bool)
    return make_block(ids, mask, [tokens // 2, tokens - tokens // 2], tokens, pad_id=0)


def evaluator(cp_rank: int, balanced: bool = False) -> Evaluator:
    ev = Evaluator({}, rank=2 + cp_rank, world_size=4, device=torch.device("cpu"))
    ev.split_blocks(cp_rank, 2, None, balanced)
    return ev


def test_eval_blocks_split_into_slices_and_the_first_rank_counts_them():
    seen = []

    def loss_sum(inputs):
        seen.append((inputs["input_ids"].shape[1], inputs[CP_KWARG].chunks))
        return torch.tensor(2.5)

    block = a_block(256)
    assert evaluator(0).loss_terms(block, loss_sum) == (2.5, block.num_trained_tokens)
    assert evaluator(1).loss_terms(block, loss_sum) == (2.5, 0)  # the slice's loss; the block counted once
    assert evaluator(1, balanced=True).loss_terms(block, loss_sum) == (2.5, 0)
    assert seen == [(128, (0,)), (128, (1,)), (128, (1, 2))]


def test_an_eval_block_that_does_not_split_runs_whole_and_counts_once():
    def loss_sum(inputs):
        assert CP_KWARG not in inputs and inputs["input_ids"].shape[1] == 200
        return torch.tensor(4.0)

    block = a_block(200)  # not 2 slices of whole 64-token chunks
    assert evaluator(0).loss_terms(block, loss_sum) == (4.0, block.num_trained_tokens)
    assert evaluator(1).loss_terms(block, loss_sum) == (0.0, 0)
