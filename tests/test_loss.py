"""ftcli.train.loss: the summed token loss (chunked = full), its edge cases, and the one trained-token count."""

from __future__ import annotations

import numpy as np
import pytest
import torch


def test_chunked_loss_equals_full_loss():
    """Value and gradients (hidden states and LM head) of the chunked loss equal the full-logit loss."""
    from ftcli.train.loss import token_loss_sum

    g = torch.Generator().manual_seed(0)
    T, H, V = 300, 32, 500
    hidden = torch.randn(1, T, H, generator=g) * 2
    weight = torch.randn(V, H, generator=g) * 0.3
    labels = torch.randint(0, V, (1, T), generator=g)
    labels[0, torch.rand(T, generator=g) < 0.4] = -100

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


def test_all_masked_block_loss_is_zero_with_zero_grads():
    """The published loop's 0/0 (NaN there): a block without trained tokens gives loss 0 and zero (not
    missing) grads."""
    from ftcli.train.loss import token_loss_sum

    h = torch.randn(1, 16, 8, requires_grad=True)
    w = torch.randn(40, 8, requires_grad=True)
    loss = token_loss_sum(h, w, torch.full((1, 16), -100), "chunked", 4)
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
