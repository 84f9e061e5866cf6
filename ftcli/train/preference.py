"""Preference losses on packed pairs: per-sequence log-probs without full logits, and DPO / IPO / SimPO / ORPO.

    sequence_logps(hidden, weight, labels, seq_idx, num_segments, chunk)  summed log-prob and token count
                                                          of every segment of a packed block (the pair sides)
    PreferenceConfig                                      the loss and its knobs (training.preference)
    pair_losses(cfg, policy, reference)                   per-pair loss and rewards, TRL's formulas
    pair_loss_sum(cfg, policy, reference), PreferenceSums what one micro-batch adds to the step (sums, not means)
    attach_preference_loss(model, cfg, chunk, reference)  model.loss_sum(**block inputs) for FSDP2, like attach_loss
    preference_config(training)                           the recipe's training section -> PreferenceConfig

A block holds whole pairs (ftcli.data.packing.pack_pairs): `Block.pairs` [P, 2] names the chosen and the rejected
segment of each. Because each segment is document-isolated (positions, cu_seqlens and seq_idx restart), the
log-prob of a side in the block equals the log-prob of that side run alone (tests/unit/objectives/test_preference_loss.py).

================================================================================ loss algebra
Per pair i with completion log-probs (sums over the trained tokens of the side) c_i, r_i, token counts
n_c, n_r, and the reference's rc_i, rr_i (DPO and IPO only):

    sigmoid (DPO)   z_i = beta * ((c_i - rc_i) - (r_i - rr_i))
                    l_i = -(1 - eps) * logsigmoid(z_i) - eps * logsigmoid(-z_i)       eps = label_smoothing
    ipo             h_i = (c_i - rc_i) / n_c - (r_i - rr_i) / n_r                     per-token means
                    l_i = (h_i - 1 / (2 * beta))^2
    simpo           z_i = beta * (c_i / n_c - r_i / n_r) - gamma                      no reference
                    l_i = -(1 - eps) * logsigmoid(z_i) - eps * logsigmoid(-z_i)
    orpo            o_i = (m_c - m_r) - (log(1 - exp(m_c)) - log(1 - exp(m_r)))       m = c / n_c, r / n_r
                    l_i = -m_c - lambda * logsigmoid(o_i)                             no reference
                    (-m_c: the chosen side's mean token NLL, the ORPO paper's per-example SFT term; TRL's
                    ORPOTrainer averages the NLL over the batch's chosen tokens instead, the same number when
                    the chosen sides are equally long)

The step's loss is the mean of l_i over its pairs on every rank and micro-batch: each block adds S = sum of its
l_i (`pair_loss_sum`), scaled by W / P with P the step's global pair count, as SFT scales by its global token count
(ftcli.objectives.preference.LOSS_ALGEBRA; tests: split blocks == one block, ranks x accumulation == 1 rank).
Rewards (metrics) are beta * (logp - ref) for DPO/IPO, beta * mean logp for SimPO and lambda * mean logp for
ORPO, as TRL's trainers log them; logps/* are sums for DPO/IPO and per-token means for SimPO/ORPO, as TRL's.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ftcli.data.packing import IGNORE_INDEX
from ftcli.model.kernels.cp import CP_KWARG, sum_over_group
from ftcli.objectives.preference import METRICS

LOSSES = ("sigmoid", "ipo", "simpo", "orpo")
NEEDS_REFERENCE = ("sigmoid", "ipo")


@dataclass(frozen=True)
class PreferenceConfig:
    loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    orpo_lambda: float = 0.1

    @property
    def needs_reference(self) -> bool:
        return self.loss in NEEDS_REFERENCE


# ------------------------------------------------------------------------------ per-sequence log-probs
def _token_logps(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) of each row: the chunk's logits in fp32, then freed (recomputed in backward)."""
    logits = F.linear(hidden, weight).float()
    return logits.log_softmax(-1).gather(1, targets.unsqueeze(1)).squeeze(1)


def sequence_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, seq_idx: torch.Tensor,
                   num_segments: int, chunk_tokens: int, trained_positions: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the trained tokens' log-probs, their count) per segment, fp32 [S] each.

    hidden [1, T, H] after the final norm, weight [V, H] the LM head, labels [1, T] unshifted (position t
    predicts labels[t + 1]; a context-parallel slice's are T + 1), seq_idx [1, T] the segment of every token. Only the trained positions go through the
    LM head, `chunk_tokens` rows at a time, each chunk checkpointed: memory is chunk x vocab, never T x vocab.
    `trained_positions` (int64 [N], ftcli.data.collate: the t whose target is trained, found on the host) spares the
    device-to-host sync of finding them here; nothing in this function waits for the device."""
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    # a target's segment is its position's (a segment's first token is never a target: make_block masks it), which
    # also holds for a context-parallel slice's last position (its target is the next slice's first token)
    segment = seq_idx.to(torch.int64).reshape(-1)
    trained = (targets != IGNORE_INDEX).nonzero().squeeze(1) if trained_positions is None else trained_positions
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, trained)
    targets, segment = targets.index_select(0, trained), segment.index_select(0, trained)
    parts = []
    for start in range(0, rows.shape[0], chunk_tokens):
        end = start + chunk_tokens
        parts.append(torch.utils.checkpoint.checkpoint(
            _token_logps, rows[start:end], weight, targets[start:end], use_reentrant=False))
    if not parts:  # no trained token: still a graph through every parameter, so FSDP's reduce-scatters run
        parts.append(_token_logps(rows, weight, targets))
    token_logps = torch.cat(parts)
    sums = token_logps.new_zeros(num_segments).index_add(0, segment, token_logps)
    # index_add, not bincount: bincount's output size waits for the device
    counts = token_logps.new_zeros(num_segments).index_add(0, segment, torch.ones_like(token_logps))
    return sums, counts


def attach_sequence_logps(model: nn.Module, chunk_tokens: int) -> None:
    """Give the model `sequence_logps(input_ids, labels, seq_idx, num_segments, **packing)` -> (sums, counts) [S],
    registered with FSDP as a forward method so the root's parameters are gathered around it (a frozen reference
    model gets it too). An LM head that is an FSDP unit of its own computes them in its own forward method, so its
    weight is gathered around it, as ftcli.train.loss.attach_loss does for the SFT loss."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    head = model.lm_head
    own_unit = isinstance(head, FSDPModule) and head is not model

    def head_logps(self, hidden, labels, seq_idx, num_segments, trained_positions=None):
        return sequence_logps(hidden, self.weight, labels, seq_idx, num_segments, chunk_tokens, trained_positions)

    def call(self, input_ids, labels, seq_idx, num_segments, trained_positions=None, pairs=None, **inputs):
        hidden = self.model(input_ids=input_ids, seq_idx=seq_idx, use_cache=False, **inputs).last_hidden_state
        if own_unit:
            return self.lm_head.head_logps(hidden, labels, seq_idx, num_segments, trained_positions)
        return sequence_logps(hidden, self.lm_head.weight, labels, seq_idx, num_segments, chunk_tokens,
                              trained_positions)

    if own_unit:
        head.head_logps = types.MethodType(head_logps, head)
        register_fsdp_forward_method(head, "head_logps")
    model.sequence_logps = types.MethodType(call, model)
    if isinstance(model, FSDPModule):
        register_fsdp_forward_method(model, "sequence_logps")


def attach_preference_loss(model: nn.Module, cfg: PreferenceConfig, chunk_tokens: int,
                           reference: nn.Module | None = None, adapter_off: Callable | None = None) -> None:
    """Give the model (a CausalLM) `loss_sum(**block inputs)` -> S, the summed pair loss of one preference block (what
    ftcli.train.loss.attach_loss gives for SFT, so the loop and the eval call it alike), adding the block's metric
    sums to `model.preference_sums` (the loop reads and resets them per step). The reference's log-probs come from
    `reference` (a frozen model sharded like the policy: method full), else from the same model inside
    `adapter_off()` (PEFT's `disable_adapter` of the model's PeftModel: the base with the adapter off, no copy: method
    lora), or, for blocks that carry them (`reference_logps` [S], training.preference.reference=precomputed:
    ftcli.train.reference), from the store; reference-free losses ask for none."""
    attach_sequence_logps(model, chunk_tokens)
    if reference is not None:
        attach_sequence_logps(reference, chunk_tokens)
    model.preference_sums = PreferenceSums()

    def reference_logps(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        assert reference is not None or adapter_off is not None, f"{cfg.loss}: no reference model and none stored"
        with torch.no_grad():
            if reference is not None:
                return reference.sequence_logps(**inputs)
            with adapter_off():
                return model.sequence_logps(**inputs)

    def loss_sum(self, **inputs):
        if "pairs" not in inputs:  # a rank-balancing padding block: no pair, still every collective
            cu = inputs["cu_seq_lens_q"]
            inputs = {**inputs, "pairs": cu.new_zeros((0, 2), dtype=torch.int64), "num_segments": cu.numel() - 1}
            if reference is None and adapter_off is None:  # the reference is stored: nothing to look up
                inputs["reference_logps"] = torch.zeros(cu.numel() - 1, device=cu.device)
        stored = inputs.pop("reference_logps", None)  # precomputed (ftcli.train.reference): no reference forward
        pairs, cp = inputs["pairs"], inputs.get(CP_KWARG)
        sums, counts = over_slices(self.sequence_logps(**inputs), cp)
        policy = SideLogps.of_block(sums, counts, pairs)
        ref = None
        if cfg.needs_reference:
            ref_sums = over_slices(reference_logps(inputs), cp) if stored is None else (stored, counts)
            ref = SideLogps.of_block(*ref_sums, pairs)
        summed, sums = pair_loss_sum(cfg, policy, ref)
        if cp is None:
            self.preference_sums.add(sums)
            return summed
        if cp.rank == 0:  # every rank of the CP group holds the block's pair losses: the first counts them
            self.preference_sums.add(sums)
        return summed / cp.size  # the group's returns add up to S; each rank's gradient is its slice's share

    model.loss_sum = types.MethodType(loss_sum, model)


def over_slices(logps: tuple[torch.Tensor, torch.Tensor], cp) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's per-segment (sums, counts) as they are, or (context parallelism: `cp` a kernels.cp.CPSlice) this
    rank's parts of them added up over the CP group, differentiably: every rank then holds the whole block's."""
    if cp is None:
        return logps
    sums, counts = logps
    return sum_over_group(torch.stack([sums, counts.to(sums.dtype)]), cp).unbind(0)


def preference_config(training) -> PreferenceConfig:
    """The recipe's `training` section -> the loss and its knobs."""
    p = training.preference
    loss = {"dpo": "sigmoid"}.get(training.objective, training.objective)
    return PreferenceConfig(loss=loss, beta=p.beta, label_smoothing=p.label_smoothing, simpo_gamma=p.simpo_gamma,
                            orpo_lambda=p.orpo_lambda)


# ------------------------------------------------------------------------------------------ the losses
@dataclass
class SideLogps:
    """Per pair: the chosen and rejected sides' summed log-probs and trained-token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    @classmethod
    def of_block(cls, sums: torch.Tensor, counts: torch.Tensor, pairs: torch.Tensor) -> SideLogps:
        """The pairs' sides out of a block's per-segment sums (`pairs` [P, 2]: chosen, rejected segment)."""
        c, r = pairs[:, 0], pairs[:, 1]
        return cls(sums[c], sums[r], counts[c], counts[r])


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable (the two-branch form)."""
    return torch.where(x > -0.693, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _smoothed(z: torch.Tensor, eps: float) -> torch.Tensor:
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


def pair_losses(cfg: PreferenceConfig, policy: SideLogps, reference: SideLogps | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair loss [P] (the formulas of the module docstring) and the per-pair metric values (detached)."""
    mean_c = policy.chosen / policy.chosen_tokens.clamp(min=1)
    mean_r = policy.rejected / policy.rejected_tokens.clamp(min=1)
    if cfg.loss in NEEDS_REFERENCE:
        assert reference is not None, f"{cfg.loss} needs the reference's log-probs"
        ratio_c, ratio_r = policy.chosen - reference.chosen, policy.rejected - reference.rejected
        if cfg.loss == "sigmoid":
            losses = _smoothed(cfg.beta * (ratio_c - ratio_r), cfg.label_smoothing)
        else:
            h = ratio_c / policy.chosen_tokens.clamp(min=1) - ratio_r / policy.rejected_tokens.clamp(min=1)
            losses = (h - 1 / (2 * cfg.beta)) ** 2
        reward_c, reward_r = cfg.beta * ratio_c, cfg.beta * ratio_r
        logp_c, logp_r = policy.chosen, policy.rejected
    elif cfg.loss == "simpo":
        losses = _smoothed(cfg.beta * (mean_c - mean_r) - cfg.simpo_gamma, cfg.label_smoothing)
        reward_c, reward_r, logp_c, logp_r = cfg.beta * mean_c, cfg.beta * mean_r, mean_c, mean_r
    elif cfg.loss == "orpo":
        log_odds = (mean_c - mean_r) - (_log1mexp(mean_c) - _log1mexp(mean_r))
        losses = -mean_c - cfg.orpo_lambda * F.logsigmoid(log_odds)
        reward_c, reward_r, logp_c, logp_r = cfg.orpo_lambda * mean_c, cfg.orpo_lambda * mean_r, mean_c, mean_r
    else:
        raise ValueError(f"preference loss {cfg.loss!r}; expected one of {', '.join(LOSSES)}")
    reward_c, reward_r = reward_c.detach(), reward_r.detach()
    metrics = {
        "rewards/chosen": reward_c, "rewards/rejected": reward_r, "rewards/margins": reward_c - reward_r,
        "rewards/accuracies": (reward_c > reward_r).float(), "logps/chosen": logp_c.detach(),
        "logps/rejected": logp_r.detach(),
    }
    return losses, metrics


@dataclass
class PreferenceSums:
    """What micro-batches add to a step: the pairs' summed loss, their count, and the summed metrics (divide by
    `pairs` to log). The loss and metrics stay on the device (detached tensors, added there) until `means()` or
    `values()` reads them, once per logged line: a step adds them without waiting for the device."""

    loss: torch.Tensor | float = 0.0
    pairs: int = 0
    metrics: dict[str, torch.Tensor | float] = field(default_factory=lambda: dict.fromkeys(METRICS, 0.0))

    def add(self, other: PreferenceSums) -> None:
        self.loss = self.loss + other.loss
        self.pairs += other.pairs
        for k, v in other.metrics.items():
            self.metrics[k] = self.metrics[k] + v

    def values(self) -> list[float]:
        """[loss, *metrics] as Python numbers (one device-to-host copy)."""
        parts = [self.loss, *self.metrics.values()]
        tensors = [p for p in parts if isinstance(p, torch.Tensor)]
        if not tensors:
            return [float(p) for p in parts]
        ref = tensors[0]
        return torch.stack([torch.as_tensor(p, dtype=torch.float32, device=ref.device).reshape(())
                            for p in parts]).tolist()

    def means(self) -> dict[str, float]:
        return {k: v / max(self.pairs, 1) for k, v in zip(self.metrics, self.values()[1:])}

    def take(self) -> PreferenceSums:
        """A copy of the sums so far, and start over (in place: the model's loss keeps adding to this object)."""
        out = PreferenceSums(self.loss, self.pairs, dict(self.metrics))
        self.loss, self.pairs, self.metrics = 0.0, 0, dict.fromkeys(METRICS, 0.0)
        return out


def reduced_means(model: nn.Module, device, prefix: str = "") -> dict[str, float]:
    """Collective: TRL's metrics over every rank's pairs since the last call (the model's `preference_sums`, taken),
    as means per pair; {} for a model without a preference loss (SFT)."""
    sums = getattr(model, "preference_sums", None)
    if sums is None:
        return {}
    taken = sums.take()
    values = [taken.pairs, *taken.values()[1:]]
    if torch.distributed.is_initialized():
        from ftcli.train.distributed import all_reduce

        values = all_reduce(values, device=device)
    return {prefix + k: v / max(values[0], 1) for k, v in zip(taken.metrics, values[1:])}


def pair_loss_sum(cfg: PreferenceConfig, policy: SideLogps, reference: SideLogps | None
                  ) -> tuple[torch.Tensor, PreferenceSums]:
    """S: the summed loss of a micro-batch's pairs (the step scales it by W / P, module docstring), and its sums."""
    losses, metrics = pair_losses(cfg, policy, reference)
    summed = losses.sum()
    sums = PreferenceSums(loss=summed.detach(), pairs=losses.numel(),
                          metrics={k: v.sum() for k, v in metrics.items()})
    return summed, sums
