"""torch.distributed for both trainers: the process group, one-number collectives, rank 0 first.

Below the trainers and the launcher (both import it; it imports neither). torchrun sets RANK /
WORLD_SIZE / LOCAL_RANK / MASTER_ADDR, so a worker needs nothing else, on one node or many.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ftcli.config.errors import TrainingStopped, UserError


@dataclass
class World:
    """This process's place: `mesh` is the 1-D mesh of every rank (FSDP2 shards over it). With context
    parallelism the ranks also form a (dp_shard, cp) grid, torchtitan's layout: `cp_size` consecutive ranks share
    each block (`cp_group`, this rank's slice `cp_rank`), and the dp_size = world_size / cp_size groups read
    different blocks. FSDP over the flattened (dp_shard, cp) ranks is FSDP over `mesh`."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: Any
    cp_size: int = 1
    cp_group: Any = None  # the ProcessGroup of this rank's CP group (None without context parallelism)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp_size

    @property
    def dp_rank(self) -> int:
        """Which data-parallel group this rank is in: the blocks it reads."""
        return self.rank // self.cp_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.cp_size


def local_device() -> torch.device:
    """This process's device: GPU number LOCAL_RANK, or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(context_parallel: int = 1) -> World:
    """The process group (NCCL for GPUs with gloo beside it for CPU tensors; gloo on CPU), a 1-D mesh, and the
    context-parallel groups of `context_parallel` consecutive ranks (World's doc)."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # Generous: rank 0 may tokenize and pack a whole dataset while the others wait at a barrier.
    timeout = timedelta(minutes=60)
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("cuda:nccl,cpu:gloo", device_id=device, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    mesh = init_device_mesh(device.type, (world_size,))
    if world_size % context_parallel:
        raise UserError(f"training.context_parallel={context_parallel} does not divide the {world_size} ranks")
    cp_group = dist.new_subgroups(group_size=context_parallel)[0] if context_parallel > 1 else None
    return World(rank, world_size, local_rank, device, mesh, context_parallel, cp_group)


def all_reduce(values: list[float], op=dist.ReduceOp.SUM, device: torch.device | str = "cpu") -> list[float]:
    """A few python numbers reduced over every rank in one collective (float64: exact for token counts).
    `device`: where the backend reduces, i.e. the rank's GPU under NCCL (a CPU tensor needs gloo)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def rank0_decides(flag: bool, device: torch.device | str = "cpu") -> bool:
    """Rank 0's `flag` on every rank (e.g. "rank 0's clock says save now"), so that all ranks act at the
    same step. Without a process group (one plain process) it is `flag`. `device` as for `all_reduce`."""
    if not dist.is_initialized():
        return bool(flag)
    t = torch.tensor([float(flag)], device=device)
    dist.broadcast(t, src=0)
    return bool(t.item())


def rank0_first(first, then=None):
    """Run `first()` on global rank 0 (it downloads, or fills the on-disk data cache), then on local rank 0
    of every other node (a node-local disk gets its own cache, a shared one is a cache hit), then `then()`
    (default: `first`) on all remaining ranks. If global rank 0 fails with a UserError, every rank stops
    with it and only rank 0 reports it, instead of the others dying at a barrier with a traceback."""
    rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
    result, error = None, None
    if rank == 0:
        try:
            result = first()
        except UserError as e:
            error = e
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    failed = torch.tensor([error is not None], dtype=torch.int32, device=device)
    dist.broadcast(failed, src=0)
    if failed.item():
        raise TrainingStopped(str(error) if error is not None else "rank 0 failed")
    if rank != 0 and local_rank == 0:
        result = first()
    dist.barrier()
    if local_rank != 0:
        result = (then or first)()
    return result


def exit_worker(code: int = 0) -> None:
    """End a finished worker process at once (stdio flushed, the process group already left). Seen on CPU
    (torch 2.13, gloo): a worker that has done all its work sometimes aborts in C++ teardown at interpreter exit
    ("terminate called without an active exception"), which torchrun then reports as a failed rank. Skipping
    the interpreter's teardown avoids it; everything the run writes is closed before this is called."""
    import sys

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def reshard_all(model) -> None:
    """Free what FSDP2 left gathered after forwards outside backward (the root's parameters after an eval-mode
    pass, the LM head's after generation): every unit sharded again (`FSDPModule.reshard`, a no-op on a sharded
    one)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
