"""The slowest context-parallel rank's causal attention, contiguous and balanced (ftcli.estimate.cpbalance), against
hand arithmetic: a rank's queries q0..q1-1 of a segment starting at s see q - s + 1 keys each, so a rank holding
queries a..b of one document computes (a + 1) + ... + (b + 1) pairs of the block's T (T + 1) / 2."""

from __future__ import annotations

import json

import pytest

from ftcli.estimate.cpbalance import cp_balance, rank_attention_pairs, rank_pieces


def test_pairs_per_rank_equal_hand_arithmetic():
    # T = 8, N = 2, one document: contiguous rank 0 holds q 0..3 (1+2+3+4), rank 1 q 4..7 (5+6+7+8) of 36 pairs;
    # balanced (chunks of 2): rank 0 holds chunks 0 and 3 (1+2 + 7+8), rank 1 chunks 1 and 2 (3+4 + 5+6)
    assert rank_attention_pairs(8, 2, balanced=False) == [10, 26]
    assert rank_attention_pairs(8, 2, balanced=True) == [18, 18]
    # two documents of 4: contiguous, each rank one whole document (1+2+3+4); balanced, rank 0 holds q 0,1 of the
    # first (1+2) and q 6,7 of the second (3+4), rank 1 q 2,3 of the first (3+4) and q 4,5 of the second (1+2)
    assert rank_attention_pairs(8, 2, balanced=False, doc=4) == [10, 10]
    assert rank_attention_pairs(8, 2, balanced=True, doc=4) == [10, 10]
    # T = 1024, N = 4, contiguous: the last rank's queries 768..1023 see 769..1024 keys
    assert max(rank_attention_pairs(1024, 4, balanced=False)) == (769 + 1024) * 256 // 2 == 229504
    assert sum(rank_attention_pairs(1024, 4, balanced=True)) == 1024 * 1025 // 2


@pytest.mark.parametrize("cu,size", [((0, 8), 2), ((0, 3, 8, 11, 16), 2), ((0, 5, 6, 20, 24), 4), ((0, 16), 4)])
@pytest.mark.parametrize("balanced", [False, True])
def test_pieces_are_the_ones_the_attention_kernels_run_over(cu, size, balanced):
    from ftcli.model.kernels.cp import CPSlice

    for rank in range(size):
        assert rank_pieces(cu, rank, size, balanced) == CPSlice.of(cu, rank, size, None, balanced).pieces()


def test_plan_says_the_slowest_ranks_share_with_and_without_balancing(capsys):
    from ftcli.commands.plan import run_plan
    from ftcli.config.recipe import load_recipe
    from ftcli.estimate.plan import make_plan

    recipe = load_recipe("tiny-llama3-cpu", ["training.context_parallel=4", "data.packing.block_len=1024"])
    balance = make_plan(recipe).cp_balance
    # contiguous: 229504 of 1024 x 1025 / 2 = 524800 pairs on the last rank; balanced: an even quarter
    assert (balance.tokens, balance.cp, balance.balanced) == (1024, 4, False)
    assert balance.contiguous_share == 229504 / 524800 and balance.balanced_share == 0.25
    assert balance.text() == ("context-parallel balance, 4 ranks on a 1,024-token block one document fills: the "
                              "slowest rank computes 43.7% of the causal attention with contiguous slices, 25.0% "
                              "balanced (an even share: 25.0%); the recipe's balance: off: "
                              "training.context_parallel_balance=true balances it")
    # 2 ranks, balanced: the last half's queries 513..1024 keys = (513 + 1024) x 512 / 2 = 393472 of 524800
    run_plan(load_recipe("tiny-llama3-cpu", ["training.context_parallel=2", "training.context_parallel_balance=true",
                                             "data.packing.block_len=1024"]), as_json=True)
    said = json.loads(capsys.readouterr().out)["context_parallel_balance"]
    assert said == {"tokens": 1024, "context_parallel": 2, "balanced": True,
                    "slowest_rank_attention_share": {"contiguous": round(393472 / 524800, 6), "balanced": 0.5}}
    assert make_plan(load_recipe("tiny-llama3-cpu")).cp_balance is None  # no context parallelism: nothing to say
