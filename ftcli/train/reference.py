"""A preference objective's reference: the frozen copy's build (`frozen_copy_training`) and, for
training.preference.reference=precomputed, the reference's per-segment log-probs, computed once before step 1 by
the starting model itself, stored beside the pack cache (ftcli.data.reference), then read with every block, so that
a full DPO/IPO run holds one model and runs one forward per block (not a frozen copy and its forward).

    identity = reference_identity(model, training, device)  what names the reference model (the store's key part)
    sets = precomputed_reference({"train": units, **eval sets}, identity, logps_fn, rank=.., world_size=.., ...)
                                                        each set: its store checked (rank 0: sizes and CRC32), else
                                                        computed (`segment_logps`, sharded like training) and
                                                        written; returned as ftcli.data.reference.ReferencedBlocks

The pass runs the same model, shapes and kernels as the live reference would on each block, so the stored numbers
are the ones a live reference gives (tests/e2e/test_preference_train.py: step losses and metrics equal)."""

from __future__ import annotations

import hashlib
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ftcli.data.cache import PackedDataset
from ftcli.data.packing import padding_block
from ftcli.data.reference import ReferencedBlocks, num_segments, store_path, store_problem, write_store
from ftcli.train.distributed import all_reduce


def frozen_copy_training(model_cfg, training):
    """The training section a frozen copy of the starting model (training.preference.reference=model, method full)
    is built with: its weights held in the compute dtype (precision.param_dtype), not in fp32 masters. FSDP casts
    every weight to that dtype for each forward anyway, so the forward is the same and the copy holds half the
    memory. A random init keeps the master dtype (its draws in another dtype need not round to the policy's)."""
    p = training.precision
    if model_cfg.init != "pretrained" or p.master_dtype == p.param_dtype:
        return training
    return training.model_copy(update={"precision": p.model_copy(update={"master_dtype": p.param_dtype})})


def reference_identity(model_cfg, training, device_type: str) -> dict[str, Any]:
    """What names the reference model, the starting model as it computes: its weights (a local directory's or the hub
    snapshot's files by name, size and mtime: the snapshot's path holds its commit), or for model.init=random the
    config's bytes, overrides, training.seed and the device type that drew it (a GPU draws other weights than the CPU
    from one seed); with the dtype, quantization, attention, the method and its
    precision section (full: training.precision)."""
    from ftcli.config.recipe import resolve_path
    from ftcli.objectives import method_of

    m, t = model_cfg, training
    common = {"model_type": m.model_type, "model_class": m.model_class, "dtype": m.dtype,
              "quantization": m.quantization, "attn_implementation": m.attn_implementation, "method": t.method,
              "precision": t.precision.model_dump() if method_of(t.method).master_weights else None}
    if m.init == "random":
        config = Path(resolve_path(m.config)).read_bytes()
        return {**common, "init": "random", "config_sha256": hashlib.sha256(config).hexdigest(),
                "config_overrides": m.config_overrides, "seed": t.seed, "device_type": device_type}
    from ftcli.model.build import local_snapshot

    root = local_snapshot(m).resolve()
    files = []
    for f in sorted(root.rglob("*")):
        if f.is_file() and (f.suffix in (".json", ".safetensors", ".bin")):
            st = f.stat()  # a hub snapshot's files are links to its blobs: stat follows them
            files.append([str(f.relative_to(root)), st.st_size, st.st_mtime_ns])
    return {**common, "init": "pretrained", "path": str(root), "revision": m.revision, "files": files}


def segment_logps(logps_fn: Callable[[dict], torch.Tensor], packed: PackedDataset, rank: int, world_size: int,
                  device) -> np.ndarray:
    """Collective: float32 [segments] of `packed`, every rank running `logps_fn(inputs)` (per-segment summed
    log-probs [S] of one block's model inputs) on blocks rank, rank + W, ... (a padding block where a rank runs out:
    every rank makes the same number of forwards, as FSDP's gathers need), then summed over ranks (each segment is
    one rank's, the others add exact zeros)."""
    from ftcli import data

    out = torch.zeros(num_segments(packed), dtype=torch.float32, device=device)
    offsets = packed.segment_offsets
    for r in range(math.ceil(len(packed) / world_size)):
        i = r * world_size + rank
        block = packed.block(i) if i < len(packed) else padding_block(packed.pad_block_len, packed.pad_id)
        inputs = data.block_to_model_inputs(block, device)
        inputs["num_segments"] = len(block.cu_seqlens) - 1
        inputs.pop("pairs", None)
        with torch.no_grad():
            sums = logps_fn(inputs).float()
        if i < len(packed):
            start, end = int(offsets[i]), int(offsets[i + 1])
            out[start:end] = sums[:end - start]
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(out)
    return out.cpu().numpy()


def precomputed_reference(sets: dict[str, PackedDataset], identity: dict[str, Any],
                          logps_fn: Callable[[dict], torch.Tensor], *, rank: int, world_size: int, device,
                          say: Callable[[str], Any] = print) -> dict[str, ReferencedBlocks]:
    """Collective: each packed set with its stored reference log-probs, computed first where no usable store is
    (module doc). A store that fails its check is rebuilt with one line saying why."""
    dist = torch.distributed.is_initialized()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    out = {}
    for label, packed in sets.items():
        path = store_path(packed, identity)
        # rank 0 checks the checksums; each node's first rank that its disk has the store (a node-local cache)
        problem = store_problem(path, packed, identity, checksums=rank == 0) if rank == 0 or local_rank == 0 else None
        if problem is not None and os.path.lexists(path) and rank == 0:
            say(f"note: the reference store {path} is not used: {problem}; rebuilding it")
        build = problem is not None
        if dist:  # any rank without a usable store: every rank computes (the pass is collective)
            build = bool(all_reduce([float(build)], torch.distributed.ReduceOp.MAX, device)[0])
        if build:
            started = time.perf_counter()
            logps = segment_logps(logps_fn, packed, rank, world_size, device)
            if rank == 0 or (local_rank == 0 and store_problem(path, packed, identity, checksums=False) is not None):
                write_store(path, packed, identity, logps)
            say(f"reference log-probs ({label}): {len(packed)} blocks, {num_segments(packed)} sequences in "
                f"{time.perf_counter() - started:.1f} s, stored in {path}")
        else:
            say(f"reference log-probs ({label}): read from {path}")
        if dist:
            torch.distributed.barrier()
        out[label] = ReferencedBlocks(packed, path)
    return out


def use_stored_reference(session, model_cfg, training, logps_fn: Callable[[dict], torch.Tensor], device) -> None:
    """Collective, both trainers: the session's training and eval blocks replaced by the same blocks with their
    reference log-probs (`precomputed_reference`: read from their stores, or computed now with `logps_fn`, the
    reference's forward)."""
    identity = reference_identity(model_cfg, training, device.type)
    sets = precomputed_reference({"train": session.units, **session.evaluator.packed}, identity, logps_fn,
                                 rank=session.rank, world_size=session.world_size, device=device, say=session.say)
    session.units = sets.pop("train")
    session.evaluator.packed = sets
