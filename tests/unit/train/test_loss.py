"""ftcli.train.loss: the summed token loss (chunked = full = chunked_fwd_grad), its edge cases, and the one
trained-token count."""

from __future__ import annotations

import numpy as np
import pytest
import torch

T, H, V = 300, 32, 500  # positions, hidden, vocab


def lm_head_case(seed: int):
    """hidden [1, T, H], an LM head [V, H] and labels [1, T] with ~40% of them -100."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, T, H, generator=g) * 2
    weight = torch.randn(V, H, generator=g) * 0.3
    labels = torch.randint(0, V, (1, T), generator=g)
    labels[0, torch.rand(T, generator=g) < 0.4] = -100
    return hidden, weight, labels


def test_chunked_loss_equals_full_loss():
    """Value and gradients (hidden states and LM head) of the chunked loss equal the full-logit loss."""
    from ftcli.train.loss import token_loss_sum

    hidden, weight, labels = lm_head_case(0)

    def run(impl, chunk):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = token_loss_sum(h, w, labels, impl, chunk)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    logits = hidden[0, :-1] @ weight.T
    ref = torch.nn.functional.cross_entropy(logits, labels[0, 1:], ignore_index=-100, reduction="sum")
    full = run("full", 0)
    assert torch.allclose(full[0], ref, rtol=1e-6)
    for chunk in (7, 64, 1000):
        chunked = run("chunked", chunk)
        assert torch.allclose(chunked[0], full[0], rtol=1e-5, atol=0), chunk
        for got, want in zip(chunked[1:], full[1:]):  # hidden grad, LM head grad
            assert float((got - want).norm() / want.norm()) < 1e-6, chunk


def test_fwd_grad_loss_equals_chunked_loss_under_the_loops_scaling():
    """chunked_fwd_grad (gradients made in forward) = chunked: the summed loss and, after the loop's
    `(loss_sum * W / N).backward()`, the hidden-state and LM-head gradients, to fp32 rounding; -100 targets
    (in the labels, and a listed trained position whose target is -100) add 0; chunks of 1 row to all rows.
    It runs 3 LM-head GEMMs where chunked runs 4 (the recompute), and without grad mode only the forward one."""
    from torch.utils.flop_counter import FlopCounterMode

    from ftcli.train.loss import token_loss_sum

    hidden, weight, labels = lm_head_case(1)
    listed = (labels[0, 1:] != -100).nonzero().squeeze(1)
    listed = torch.cat([listed, torch.tensor([int((labels[0, 1:] == -100).nonzero()[0])])])  # a -100 target listed
    world_size, global_tokens = 2, 1234  # the loop's scale W / N (N: every rank's trained tokens)

    def run(impl, chunk, positions):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with FlopCounterMode(display=False) as flops:
            loss = token_loss_sum(h, w, labels, impl, chunk, trained_positions=positions)
            (loss * (world_size / global_tokens)).backward()
        return loss.detach(), h.grad, w.grad, flops.get_total_flops()

    for positions in (None, listed):
        head_gemm = 2 * (listed.numel() - (positions is None)) * V * H  # rows x vocab x hidden
        for chunk in (1, 7, 64, 1000):
            want, got = run("chunked", chunk, positions), run("chunked_fwd_grad", chunk, positions)
            torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
            for a, b in zip(got[1:3], want[1:3]):
                assert float((a - b).norm() / b.norm()) < 1e-6, chunk
            if chunk == 1000:  # one chunk (the flop counter does not count the in-place addmm_ of later ones)
                assert (want[3], got[3]) == (4 * head_gemm, 3 * head_gemm)
    with torch.no_grad(), FlopCounterMode(display=False) as flops:
        value = token_loss_sum(hidden.requires_grad_(), weight, labels, "chunked_fwd_grad", 64)
    assert float(value) == pytest.approx(float(want[0]), rel=1e-6)
    assert flops.get_total_flops() == 2 * (listed.numel() - 1) * V * H


def test_all_masked_block_loss_is_zero_with_zero_grads():
    """The published loop's 0/0 (NaN there): a block without trained tokens gives loss 0 and zero (not
    missing) grads."""
    from ftcli.train.loss import token_loss_sum

    for impl in ("chunked", "chunked_fwd_grad"):
        h = torch.randn(1, 16, 8, requires_grad=True)
        w = torch.randn(40, 8, requires_grad=True)
        loss = token_loss_sum(h, w, torch.full((1, 16), -100), impl, 4)
        loss.backward()
        assert loss.item() == 0 and torch.count_nonzero(w.grad) == 0 and h.grad is not None


def test_liger_without_liger_kernel_is_a_one_line_error():
    from ftcli.config.errors import UserError
    from ftcli.features.loss import liger_loss
    from ftcli.train.loss import token_loss_sum

    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        with pytest.raises(UserError, match="loss.impl=liger needs liger-kernel .* or set training.loss.impl=chunked"):
            token_loss_sum(torch.randn(1, 4, 8), torch.randn(16, 8), torch.ones(1, 4, dtype=torch.long), "liger", 0)
        with pytest.raises(UserError, match="liger-kernel"):  # also at startup, before any compute
            liger_loss()
    else:
        pytest.skip("liger-kernel is installed here")


def test_trained_tokens_counted_one_way():
    """A block's own num_trained_tokens, its labels as numpy, as a [1, T] tensor: the same count, the
    tokens the loss averages over (labels[1:] != IGNORE_INDEX). A [B, T] batch counts each row shifted."""
    from ftcli import data
    from ftcli.train.loss import IGNORE_INDEX, count_trained_tokens

    assert IGNORE_INDEX == data.IGNORE_INDEX == -100
    ids = np.arange(5, 17, dtype=np.int32)
    mask = np.array([0, 1, 1, 1, 0, 1, 1, 0, 0, 1, 1, 1], dtype=bool)
    block = data.make_block(ids, mask, [4, 3, 5], 16, pad_id=0)
    # segment starts (0, 4, 7) are never targets: 3 + 2 + 3 trained tokens
    assert block.num_trained_tokens == 8
    assert count_trained_tokens(block) == 8
    assert count_trained_tokens(block.labels) == 8
    assert count_trained_tokens(torch.from_numpy(block.labels.astype(np.int64))[None]) == 8
    assert count_trained_tokens(data.padding_block(16, 0)) == 0
    rows = torch.tensor([[5, 6, -100, 7], [8, -100, 9, 10]])
    assert count_trained_tokens(rows) == 2 + 2  # row 0: 6, 7; row 1: 9, 10 (each row's first label unused)
