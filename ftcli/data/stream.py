"""BlockStream: each rank's share of the packed blocks, equal in length on every rank, resumable.

One deterministic global sequence, dealt round-robin:

    global sequence   g = 0 1 2 3 4 5 6 7 8 9 10          (epochs x N blocks; per epoch a seeded
                                                         permutation of the N packed blocks)
    world_size 4      round 0: g0 g1 g2 g3
                      round 1: g4 g5 g6 g7
                      round 2: g8 g9 g10 PAD             (PAD: all labels -100, num_trained_tokens 0)
    rank 1 yields     g1 g5 g9

Every rank yields ceil(total / world_size) blocks, so all ranks take the same number of steps and stop
together; no block is dropped or repeated (the last round is completed with padding blocks, whose loss
the trainer's global token count makes contribute nothing). The ranks' union is the single-rank
sequence.

State is the number of global blocks consumed (rounds done x world_size), the same on every rank and
free of the world size (`world_size` in it is only a record). Resuming continues at the exact next
block, also under a different world size: the remaining blocks are dealt round-robin to the new ranks,
from global position `consumed` on (so a checkpoint of N ranks resumes on M with no block repeated or
skipped; with the same ranks x grad_accum every optimizer step gets the same blocks as before).
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from ftcli.data.cache import PackedDataset
from ftcli.data.packing import Block, padding_block
from ftcli.config.errors import UserError

STATE_VERSION = 1


class BlockStream:
    def __init__(
        self,
        packed: PackedDataset,
        rank: int,
        world_size: int,
        epochs: float = 1.0,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        self.packed, self.rank, self.world_size = packed, rank, world_size
        self.epochs, self.seed, self.shuffle = float(epochs), int(seed), bool(shuffle)
        self.num_blocks = len(packed)
        self.total = int(math.floor(self.epochs * self.num_blocks + 1e-9))  # global blocks over the run
        self._start = 0  # global blocks consumed before this stream's round 0 (after a resume)
        self._round = 0  # rounds this stream has yielded
        self._perm_epoch, self._perm = -1, None

    # -- the global sequence
    def global_block(self, g: int) -> int:
        """Packed-block index at global position g."""
        epoch, j = divmod(g, self.num_blocks)
        if not self.shuffle:
            return j
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_blocks)
            self._perm_epoch = epoch
        return int(self._perm[j])

    def __len__(self) -> int:
        """Blocks per rank over a fresh run: identical on every rank."""
        return math.ceil(self.total / self.world_size)

    @property
    def remaining(self) -> int:
        return math.ceil((self.total - self._start) / self.world_size) - self._round

    def __iter__(self) -> Iterator[Block]:
        while self.remaining > 0:
            g = self._start + self._round * self.world_size + self.rank
            self._round += 1  # before yielding: a state_dict taken now points at the next block
            if g < self.total:
                yield self.packed.block(self.global_block(g))
            else:
                yield padding_block(self.packed.pad_block_len, self.packed.pad_id)

    # -- resume
    def state_dict(self) -> dict:
        consumed = min(self.total, self._start + self._round * self.world_size)
        return {
            "version": STATE_VERSION,
            "data_key": self.packed.key,
            "num_blocks": self.num_blocks,
            "epochs": self.epochs,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "world_size": self.world_size,
            "consumed": consumed,
        }

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for k in ("data_key", "num_blocks", "epochs", "seed", "shuffle"):
            if state.get(k) != mine[k]:
                raise UserError(
                    f"cannot resume the data stream: {k} was {state.get(k)!r} in the checkpoint, now {mine[k]!r} "
                    "(the data, packing or schedule changed since the checkpoint)"
                )
        consumed = state.get("consumed")
        if not isinstance(consumed, int) or not 0 <= consumed <= self.total:
            raise UserError(f"cannot resume the data stream: {consumed!r} blocks consumed in the checkpoint, "
                            f"the run has {self.total}")
        self._start, self._round = consumed, 0
