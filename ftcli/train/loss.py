"""The training loss of the full path: summed token cross-entropy without full-vocabulary fp32 logits.

    count_trained_tokens(block)            the tokens one block contributes to the loss (the one count)
    token_loss_sum(hidden, weight, labels) sum of next-token CE over the trained tokens (training.loss.impl)
    ChunkedLinearCE                        chunked_fwd_grad's autograd function: the gradients made in forward
    attach_loss(model, impl, chunk)        model.loss_sum(input_ids, labels, **packing) for FSDP2

IGNORE_INDEX is defined once, by the data code that writes the labels (ftcli.data), and re-exported here.
"""

from __future__ import annotations

import types
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ftcli.data.packing import IGNORE_INDEX
from ftcli.features.loss import FUSED_LINEAR_CE

__all__ = ["IGNORE_INDEX", "attach_loss", "count_trained_tokens", "token_loss_sum"]


def count_trained_tokens(block_or_labels) -> int:
    """Trained tokens after the shift (labels[0] of a row is never a target).

    A packed block carries its own count (`Block.num_trained_tokens`, computed where it is built, and
    stored in the data cache); labels alone (numpy, a list, or a tensor [T] / [B, T]) are counted."""
    count = getattr(block_or_labels, "num_trained_tokens", None)
    if count is not None:
        return int(count)
    labels = block_or_labels
    if isinstance(labels, torch.Tensor):
        return int((labels[..., 1:] != IGNORE_INDEX).sum())
    return int(np.count_nonzero(np.asarray(labels)[..., 1:] != IGNORE_INDEX))


def _ce_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of rows of `hidden` against `targets`; logits in fp32, then freed."""
    logits = F.linear(hidden, weight).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def token_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, impl: str, chunk_tokens: int,
                   trained_positions: torch.Tensor | None = None):
    """Sum (not mean) of next-token cross-entropy over the trained tokens of one block, in fp32.

    hidden [1, T, H] (after the final norm), weight [V, H] (the LM head), labels [1, T] (or [1, T + 1]) unshifted
    (HF convention: position t predicts labels[t + 1]; -100 = no loss). `trained_positions` (int64 [N],
    ftcli.data.collate's, built on the host) are the positions whose target is trained; without them they
    are found on the device (`nonzero`: a host sync). A listed position whose target is -100 adds 0.
      chunked  only trained positions, `chunk_tokens` rows at a time, each chunk checkpointed: backward
               recomputes that chunk's logits, so memory is chunk x vocab, not T x vocab.
      chunked_fwd_grad  the same chunks, but each chunk's gradients (w.r.t. the hidden rows and the LM head) are
               made in forward (`ChunkedLinearCE`) and only scaled in backward: one LM-head GEMM per token less
               than chunked (no recompute), the same numbers to fp32 rounding. Without grad mode (eval) it is chunked.
      full     the published qwen-b300 loop's loss: logits for every position at once, upcast to fp32 (T x V x 4 bytes).
      a fused linear cross-entropy (ftcli.features.loss.FUSED_LINEAR_CE, GPU): the LM head and the CE in one kernel.
    """
    # labels may hold one more token than hidden: a context-parallel slice's, whose last position predicts the
    # next rank's first token (ftcli.data.collate.slice_model_inputs)
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:hidden.shape[-2] + 1].reshape(-1)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    if impl == "full":
        return _ce_sum(hidden, weight, targets)
    trained = (targets != IGNORE_INDEX).nonzero().squeeze(1) if trained_positions is None else trained_positions
    hidden, targets = hidden.index_select(0, trained), targets.index_select(0, trained)
    if hidden.shape[0] == 0:  # no trained token here: still a graph through every parameter, so this
        return _ce_sum(hidden, weight, targets)  # rank's backward joins FSDP's reduce-scatters (zero grads)
    if impl in FUSED_LINEAR_CE:
        return FUSED_LINEAR_CE[impl].load()(weight, hidden, targets).float()
    if impl == "chunked_fwd_grad" and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return ChunkedLinearCE.apply(hidden, weight, targets, chunk_tokens)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = start + chunk_tokens
        total = total + torch.utils.checkpoint.checkpoint(
            _ce_sum, hidden[start:end], weight, targets[start:end], use_reentrant=False
        )
    return total


class ChunkedLinearCE(torch.autograd.Function):
    """sum_i CE(hidden_i @ weight.T, targets_i) (-100 rows add 0), chunk by chunk, with its gradients made in forward.

    Per chunk of rows: logits in the compute dtype, log-softmax in fp32 (the chunked loss's numerics), then
    d(sum)/d(logits) = softmax - onehot(target) (0 on -100 rows), cast to the compute dtype as the chunked loss's
    backward casts it, and the two GEMMs of the LM head's backward: d hidden = d logits @ weight (kept [N, H]) and
    d weight += d logits.T @ hidden (one [V, H], accumulated by addmm). Only those two are kept for backward, not the
    logits. Backward multiplies them by the upstream gradient, the loop's W / N (ftcli.train.full's loss algebra),
    so the loss can be scaled (or summed with other terms) after it like any other. Once-only: backward consumes
    (scales in place and releases) the kept gradients; no double backward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int):
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = None
        for start in range(0, hidden.shape[0], chunk_tokens):
            rows, target = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]
            logits = F.linear(rows, weight)
            logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
            del logits
            trained = target != IGNORE_INDEX
            safe = torch.where(trained, target, 0).unsqueeze(1)
            total = total - torch.where(trained, logp.gather(1, safe).squeeze(1), 0.0).sum()
            grad_logits = logp.exp_()  # softmax, in place
            del logp
            grad_logits.scatter_add_(1, safe, -trained.to(grad_logits.dtype).unsqueeze(1))
            # -100 rows to 0 and the cast to the compute dtype in one pass over the chunk's [rows, V]
            grad_logits = torch.mul(grad_logits, trained.unsqueeze(1),
                                    out=torch.empty(grad_logits.shape, dtype=hidden.dtype, device=hidden.device))
            if need_hidden:
                grad_hidden[start:start + chunk_tokens] = grad_logits @ weight
            if need_weight:
                if grad_weight is None:
                    grad_weight = grad_logits.t() @ rows
                else:
                    grad_weight.addmm_(grad_logits.t(), rows)
            del grad_logits
        ctx.grads = [grad_hidden, grad_weight]
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = [None, None]  # released as they are handed on (the LM head's gradient is vocab x hidden)
        scale = grad_total.to(torch.float32)
        if grad_hidden is not None:
            grad_hidden.mul_(scale)
        if grad_weight is not None:
            grad_weight.mul_(scale)
        return grad_hidden, grad_weight, None, None


def attach_loss(model: nn.Module, impl: str, chunk_tokens: int, *, loss_fn: Callable = token_loss_sum) -> None:
    """Give the model `loss_sum(input_ids, labels, **packing)`: decoder -> final hidden states ->
    `loss_fn` (`token_loss_sum`; a test may pass a faulty one) with the LM head's weight and the block's
    `trained_positions` (None when the call has none). Registered with FSDP as a forward method, so the
    root's parameters (final norm; embeddings and LM head when they are the root's) are all-gathered around it
    like around `forward`. An LM head that is an FSDP unit of its own (ftcli.model.parallelize) computes the loss
    in its own forward method `head_loss`, so that its weight is gathered around it (and again for backward)."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    head = model.lm_head
    own_unit = isinstance(head, FSDPModule) and head is not model

    def head_loss(self, hidden, labels, trained_positions=None):
        return loss_fn(hidden, self.weight, labels, impl, chunk_tokens, trained_positions=trained_positions)

    def loss_sum(self, input_ids, labels, trained_positions=None, **inputs):
        hidden = self.model(input_ids=input_ids, use_cache=False, **inputs).last_hidden_state
        if own_unit:
            return self.lm_head.head_loss(hidden, labels, trained_positions)
        return loss_fn(hidden, self.lm_head.weight, labels, impl, chunk_tokens, trained_positions=trained_positions)

    if own_unit:
        head.head_loss = types.MethodType(head_loss, head)
        register_fsdp_forward_method(head, "head_loss")
    model.loss_sum = types.MethodType(loss_sum, model)
    register_fsdp_forward_method(model, "loss_sum")
