"""Synthetic data: random-token conversations that go straight to (input_ids, loss mask), no template.

For benchmarks and smoke tests at any scale. Lengths are long-tailed like real chat data (log-normal
around `mean_tokens`, median about 0.6x the mean, clipped to [2, max_tokens]); each example has 1-4
turns, each turn a masked prompt (`prompt_fraction` of its tokens) followed by a trained response of
at least one token. Everything is drawn from one `numpy` generator seeded by `seed`, so the same
config gives the same examples on every machine and every rank. Special/added token ids never occur.
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np

SIGMA = 1.0  # log-normal shape: about 1 in 20 examples is over 3x the mean


def synthetic_examples(
    cfg, vocab_size: int, exclude_ids=(), limit: int | None = None
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(index, input_ids int32, loss mask bool) for cfg.num_examples (or `limit`) examples."""
    rng = np.random.default_rng(cfg.seed)
    allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int32), np.asarray(list(exclude_ids), dtype=np.int32))
    if len(allowed) == 0:
        allowed = np.arange(vocab_size, dtype=np.int32)
    mu = math.log(cfg.mean_tokens) - SIGMA**2 / 2
    n = cfg.num_examples if limit is None else min(cfg.num_examples, limit)
    for index in range(n):
        length = int(np.clip(round(rng.lognormal(mu, SIGMA)), 2, cfg.max_tokens))
        turns = int(min(rng.integers(1, 5), length // 2))
        cuts = np.sort(rng.choice(np.arange(1, length), size=turns - 1, replace=False)) if turns > 1 else []
        bounds = [0, *map(int, cuts), length]
        mask = np.zeros(length, dtype=bool)
        for a, b in zip(bounds[:-1], bounds[1:]):
            prompt = min(int(round((b - a) * cfg.prompt_fraction)), b - a - 1)
            mask[a + prompt : b] = True
        ids = allowed[rng.integers(0, len(allowed), size=length)]
        yield index, ids, mask
