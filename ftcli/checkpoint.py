"""Resumable sharded checkpoints (torch.distributed.checkpoint) and the final Hugging Face export.

One checkpoint is one directory, committed by a rename:

    <run>/checkpoints/
      step_00000200/            committed: `latest_checkpoint` only ever returns one of these
        .metadata, __0_0.distcp, __1_0.distcp, ...   DCP: model + optimizer, each rank writes its shards
        rank_00000.pt, rank_00001.pt                   per-rank trainer state: data position, RNG, ...
        meta.json                                      step, world size, token counts (written last)
      .tmp_step_00000250/       a save in progress, or one a crash interrupted: never resumed from

Every rank writes into the .tmp dir; after a barrier rank 0 writes meta.json and renames the dir, so a
crash (kill -9 of any rank) at any point leaves either the old set of checkpoints or the new one. Then
rank 0 deletes all but the newest `keep_last`. The checkpoint dir must be on a filesystem every rank
sees (one node, or a shared filesystem across nodes).

Model and optimizer state go through `get_state_dict` / `set_state_dict`, so the sharded DTensors are
saved as shards and reloaded into the same sharding. The per-rank state (RNG) and the step
accounting belong to one run layout, so a checkpoint resumes with the world size that wrote it.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ftcli.errors import UserError

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve_resume(run_dir: Path, resume: str | None) -> Path | None:
    """`--resume` -> a committed checkpoint dir (None: start fresh)."""
    from ftcli.rundir import CHECKPOINTS

    if resume is None:
        return None
    path = latest_checkpoint(Path(run_dir) / CHECKPOINTS) if resume == "latest" else Path(resume)
    if path is None:
        raise UserError(f"--resume: no checkpoint in {Path(run_dir) / CHECKPOINTS}; train without --resume")
    if not (path / "meta.json").is_file():
        latest = latest_checkpoint(path)  # a run dir's checkpoints/ folder is accepted too
        if latest is None:
            raise UserError(f"--resume {path}: not a complete ftcli checkpoint (no meta.json)")
        path = latest
    return path


# -------------------------------------------------------------------------------------------- RNG
def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ----------------------------------------------------------------------------------------- save/load
def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank_state: dict[str, Any],
    meta: dict[str, Any],
    *,
    keep_last: int,
) -> Path:
    """Collective: every rank calls it. Returns the committed checkpoint dir."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank, world_size = dist.get_rank(), dist.get_world_size()
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f".tmp_{final.name}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed save of this same step
        tmp.mkdir(parents=True)
    dist.barrier()

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    torch.save(rank_state, tmp / f"rank_{rank:05d}.pt")
    dist.barrier()  # every rank's files are on disk

    if rank == 0:
        meta = {**meta, "step": step, "world_size": world_size, "saved_at": time.time()}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        if final.exists():  # re-saving a step (a resumed run): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Collective. Loads model + optimizer in place; returns (this rank's trainer state, meta)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if meta["world_size"] != world_size:
        raise UserError(
            f"checkpoint {path} was written by {meta['world_size']} processes and this run has {world_size}; "
            "resume with the same number (steps, schedule and RNG are per run layout)"
        )
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return torch.load(path / f"rank_{rank:05d}.pt", weights_only=False), meta


# ------------------------------------------------------------------------------------- final export
def save_hf_checkpoint(model: torch.nn.Module, build_empty, tokenizer, out_dir: Path, dtype: torch.dtype) -> None:
    """Collective. Gathers the full state dict to rank 0 (CPU) and writes a `from_pretrained` dir there:
    safetensors + config + generation config + tokenizer + chat template. `build_empty()` returns the
    same model class with parameters on the meta device (the gathered tensors are assigned into it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return
    export = build_empty()
    missing, unexpected = export.load_state_dict(full, strict=False, assign=True)
    assert not unexpected, f"unexpected keys in the gathered state dict: {unexpected[:5]}"
    assert not [k for k in missing if k in dict(export.named_parameters())], f"missing: {missing[:5]}"
    export.to(dtype)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".tmp_{out_dir.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    export.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
