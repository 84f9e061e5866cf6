"""Resumable sharded checkpoints (torch.distributed.checkpoint) and the final Hugging Face export.

One checkpoint is one directory, written where it stays and committed by its small meta.json, written last:

    <run>/checkpoints/
      step_00000200/            committed (meta.json present): `latest_checkpoint` only ever returns one of these
        .metadata, __0_0.distcp, __1_0.distcp, ...   DCP: model + optimizer, each rank writes its shards
        rank_00000.json, rank_00000.safetensors, ...   per-rank trainer state: data position, RNG, ...
        meta.json                                      step, world size, token counts, each file's size
                                                       and CRC32 (written last; checked before a resume)
      step_00000250/            no meta.json: a save in progress, or one a crash interrupted: never listed,
                                never resumed from (an older ftcli's `.tmp_step_*` dirs are the same)

Every rank writes its shards at their final paths; after a barrier rank 0 writes meta.json (a temp file
renamed over it: the only large-file-free rename of the commit besides DCP's own `.metadata`), so a crash
(kill -9 of any rank) at any point leaves either the old set of checkpoints or the new one. No directory
is renamed: on a Unity Catalog Volume (`/Volumes/...`, a FUSE mount over object storage) a rename is a
server-side copy whose cost scales with the bytes moved, so renaming a 320 GB checkpoint dir would copy
320 GB; here a commit moves meta.json and `.metadata` only (`tests/unit/train/test_checkpoint.py` counts the bytes).
Under /Volumes, DCP writes through databricks-sdk-air's `UCVolumeWriter` when it is installed (each shard
staged on local disk and copied once, with retries; `dcp_storage`). Then rank 0 deletes all but the
newest `keep_last`, only after the new one is committed. The checkpoint dir must be on a filesystem every
rank sees (one node, or a shared filesystem across nodes).

Model and optimizer state go through `get_state_dict` / `set_state_dict`, so the sharded DTensors are
saved as shards; DCP reshards them on load, so a checkpoint written by N ranks resumes on M. The rest
is world-size-free too: the data position is the number of GLOBAL blocks consumed
(`ftcli.data.BlockStream.state_dict`), the scheduler and the step accounting are the same on every
rank. Only the RNG state is per rank: on M != N, rank r takes rank r's state when r < N, else rank 0's
(`rank_state_source`); the trainers draw no random numbers per step (no dropout), so this changes
nothing they compute. With the same global batch (ranks x grad_accum) the resumed run takes the same
blocks per optimizer step as the uninterrupted one.

A save that a SIGKILL interrupted leaves a `step_*` dir without meta.json: `remove_interrupted_saves`
(rank 0, at the next start) deletes those.

Loading never runs code from the checkpoint dir (a run dir may come from anywhere): ftcli's own state is
JSON plus a safetensors file (`write_rank_state` / `read_rank_state`; an older ftcli's rank_*.pt is read
with torch.load(weights_only=True)), DCP's pickled `.metadata` is unpickled first with an allowlist of
DCP's own record classes (`check_dcp_metadata`), and DCP's non-tensor items load through
torch.load(weights_only=True) (`SafeLoadPlanner`). A file that fails these is one UserError naming it.

The Hugging Face export (`save_hf_checkpoint`) follows the same rule: its files are written in `final/`
itself and ftcli_export.json, written first as "incomplete" and replaced last by the file list with sizes and
CRC32s, says whether it is whole (`export_state`; readers refuse an incomplete one).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner

from ftcli.config.errors import TrainingStopped, UserError
from ftcli.artifacts.publish import begin_export, publish_export, remove_export
from ftcli.artifacts.rundir import CHECKPOINTS, RECIPE_FILE, ran_a_step
from ftcli.config.safe_files import write_atomic, write_new
from ftcli.model.build import refuse_pickled_weights

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_TMP_STEP_DIR = re.compile(r"^\.tmp_step_(\d{8})$")  # an older ftcli's save in progress


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


def _last_trl_checkpoint(root: Path) -> Path | None:
    from transformers.trainer_utils import get_last_checkpoint

    last = get_last_checkpoint(str(root)) if Path(root).is_dir() else None
    return Path(last) if last else None


# kind -> (newest checkpoint under a folder, the file a complete checkpoint holds, message when none, when not one)
_RESUME_KINDS = {
    "dcp": (latest_checkpoint, "meta.json", "--resume: no checkpoint in {root}; train without --resume",
            "--resume {resume}: not a complete ftcli checkpoint (no meta.json)"),
    "trl": (_last_trl_checkpoint, "trainer_state.json",
            "--resume: no checkpoint-N in {root}; train without --resume to start fresh",
            "--resume {resume}: not a LoRA checkpoint (no trainer_state.json)"),
}


def resolve_resume(run_dir: Path, resume: str | None, kind: Literal["dcp", "trl"] = "dcp") -> Path | None:
    """`--resume` -> the checkpoint dir to resume from (None: start fresh). Both trainers call it.

    resume: None | "latest" (the newest under <run>/checkpoints) | a checkpoint dir | a folder of them
    (e.g. a run's checkpoints/: its newest). kind: "dcp" for the full path's step_XXXXXXXX dirs (this
    module), "trl" for the LoRA path's checkpoint-N dirs (transformers' Trainer). A path that is not a
    complete checkpoint of that kind is one UserError, and so is a "trl" checkpoint whose adapter is only a pickle
    (adapter_model.bin: transformers' resume would have PEFT unpickle it)."""
    if resume is None:
        return None
    newest, marker, none_found, not_one = _RESUME_KINDS[kind]
    if resume == "latest":
        root = Path(run_dir) / CHECKPOINTS
        path = newest(root)
        if path is None:
            raise UserError(none_found.format(root=root))
    else:
        path = Path(resume)
        if not (path / marker).is_file():
            path = newest(path) or path  # a run dir's checkpoints/ folder is accepted too
        if not (path / marker).is_file():
            raise UserError(not_one.format(resume=resume))
    if kind == "trl":
        refuse_pickled_weights(path, "--resume", "adapter")
    return path


class CheckpointSchedule:
    """When to save: every `every_steps` steps and/or every `every_minutes` minutes (both trainers).

    The clock is a single rank's (rank 0's): `time_due()` is only meaningful there, and the trainer hands
    rank 0's answer to every rank (`ftcli.train.distributed.rank0_decides`, or one all-reduce MAX with other
    numbers), so that all ranks save at the same step. `mark_saved()` restarts the clock."""

    def __init__(self, enabled: bool, every_steps: int | None, every_minutes: float | None, *,
                 clock: Callable[[], float] = time.monotonic):
        self.enabled, self.every_steps, self.every_minutes = enabled, every_steps, every_minutes
        self.clock = clock
        self.last_save = clock()

    @classmethod
    def from_config(cls, cfg, **kwargs) -> "CheckpointSchedule":
        """From the recipe's `training.checkpoint`."""
        return cls(cfg.enabled, cfg.every_steps, cfg.every_minutes, **kwargs)

    def time_due(self) -> bool:
        return self.every_minutes is not None and self.clock() - self.last_save >= 60 * self.every_minutes

    def due(self, step: int, time_due: bool) -> bool:
        """Save after `step`? `time_due`: rank 0's `time_due()`, shared by every rank."""
        return self.enabled and ((self.every_steps is not None and step % self.every_steps == 0) or bool(time_due))

    def mark_saved(self) -> None:
        self.last_save = self.clock()


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
    protect: list[Path] = (),
) -> Path:
    """Collective: every rank calls it. Returns the committed checkpoint dir. Rotation keeps the newest
    `keep_last` and every checkpoint in `protect` (the best eval's, training.checkpoint.keep_best)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank, world_size = dist.get_rank(), dist.get_world_size()
    root = Path(root)
    final = root / step_dir_name(step)
    if rank == 0:
        _unpublish_and_remove(final)  # a crashed save of this step, or a committed one from before a --resume
        final.mkdir(parents=True)
    dist.barrier()

    model_state, optim_state = get_state_dict(model, optimizer)
    problem = None
    try:
        dcp.save({"model": model_state, "optim": optim_state}, storage_writer=dcp_storage(final, "writer"))
        write_rank_state(final, rank, rank_state)
    except (OSError, CheckpointException) as e:
        problem = _save_problem(e, final, _state_bytes(model_state, optim_state))
        if problem is None:
            raise
    _raise_if_not_saved(root, step, final, _gathered(problem))  # a barrier: every rank's files are on disk
    sums = file_checksums(final, files_hashed_by(final, rank, world_size))  # each rank its own files
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(sums, gathered, dst=0)

    if rank == 0:
        try:
            files = {name: entry for part in gathered for name, entry in part.items()}
            meta = {**meta, "step": step, "world_size": world_size, "saved_at": time.time(),
                    CHECKSUMS: {"algorithm": "crc32", "chunk_bytes": CHUNK_BYTES, "files": dict(sorted(files.items()))}}
            write_atomic(final / "meta.json", json.dumps(meta, indent=2) + "\n")  # the commit
        except OSError as e:
            problem = e
        kept = {Path(p).resolve() for p in protect}
        for old in list_checkpoints(root)[:-keep_last] if problem is None else []:
            if old.resolve() not in kept:
                _unpublish_and_remove(old)
    _raise_if_not_saved(root, step, final, _broadcast(problem))  # a barrier: committed, or not on every rank
    return final


def _unpublish_and_remove(ckpt_dir: Path) -> None:
    """Remove a checkpoint dir, its meta.json first: a removal that stops half-way (a kill) leaves a dir that is
    never listed as committed (and the next start removes it). A link planted there is unlinked, never followed."""
    if ckpt_dir.is_symlink():
        ckpt_dir.unlink()
        return
    (ckpt_dir / "meta.json").unlink(missing_ok=True)
    shutil.rmtree(ckpt_dir, ignore_errors=True)


def dcp_storage(ckpt_dir: Path, role: Literal["writer", "reader"]):
    """DCP's storage writer or reader for `ckpt_dir`. Both writers write each shard at its final path and
    publish only the small `.metadata` by a rename: under /Volumes databricks-sdk-air's UCVolumeWriter when it
    is installed (the `databricks` extra: a shard is staged on local disk, then copied to the Volume once, with
    retries; UCVolumeReader reads through a local cache), else torch's FileSystemWriter / FileSystemReader (the
    same protocol, straight to the FUSE mount)."""
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    if str(ckpt_dir).startswith("/Volumes/"):
        try:
            from databricks.air.data import UCVolumeReader, UCVolumeWriter
        except ImportError:
            pass
        else:
            return (UCVolumeWriter if role == "writer" else UCVolumeReader)(ckpt_dir)
    return (FileSystemWriter if role == "writer" else FileSystemReader)(ckpt_dir)


# ------------------------------------------------------------------------------------ checksums
# meta.json's "checksums": {"algorithm": "crc32", "chunk_bytes": N, "files": {name: [size, [crc32 of each
# N-byte chunk]]}} of every other file of the checkpoint, taken right after the save (each rank hashes the
# files it wrote, while they are in its page cache, its chunks in threads: zlib releases the GIL; rank 0
# gathers them), and checked by the launcher before a resume (`verify_checkpoint`). CRC32 finds damage (a
# zeroed page, a truncated or swapped file), not tampering: whoever can rewrite a shard can rewrite meta.json.
CHECKSUMS = "checksums"
CHUNK_BYTES = 16 * 2**20
_OWNER = re.compile(r"^(?:__(\d+)_\d+\.distcp|rank_(\d+)\.\w+)$")  # DCP's shard files, ftcli's rank state


def files_hashed_by(ckpt_dir: Path, rank: int, world_size: int) -> list[str]:
    """The files of a checkpoint in progress that `rank` hashes: those it wrote (`__<rank>_*.distcp`,
    `rank_<rank>.*`); rank 0 also every other one (DCP's .metadata)."""
    names = []
    for p in sorted(Path(ckpt_dir).iterdir()):
        if not p.is_file() or p.name == "meta.json":
            continue
        match = _OWNER.match(p.name)
        owner = int(match.group(1) or match.group(2)) if match else 0
        if (owner if owner < world_size else 0) == rank:
            names.append(p.name)
    return names


def _chunk_crcs(path: Path, size: int, chunk_bytes: int, pool) -> list[int]:
    import zlib

    fd = os.open(path, os.O_RDONLY)
    try:
        return list(pool.map(lambda at: zlib.crc32(os.pread(fd, chunk_bytes, at)), range(0, size, chunk_bytes)))
    finally:
        os.close(fd)


def file_checksums(ckpt_dir: Path, names: list[str], *, chunk_bytes: int = CHUNK_BYTES,
                   threads: int = 8) -> dict[str, list]:
    """{name: [size, [crc32 per chunk]]} of the files `names` in `ckpt_dir`."""
    from concurrent.futures import ThreadPoolExecutor

    out = {}
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for name in names:
            size = (Path(ckpt_dir) / name).stat().st_size
            out[name] = [size, _chunk_crcs(Path(ckpt_dir) / name, size, chunk_bytes, pool)]
    return out


def checkpoint_problem(ckpt_dir: Path, recorded: dict, *, threads: int = 8) -> str | None:
    """The first file of `ckpt_dir` that is missing, has another size or other CRC32s than `recorded`
    (meta.json's "checksums"), as a phrase; None when all match. Sizes first (no reading), then the CRCs."""
    ckpt_dir, files = Path(ckpt_dir), recorded["files"]
    for name, (size, _) in files.items():
        path = ckpt_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the save wrote {size} (truncated or replaced since)"
    now = file_checksums(ckpt_dir, list(files), chunk_bytes=int(recorded.get("chunk_bytes", CHUNK_BYTES)),
                         threads=threads)
    bad = [name for name in files if now[name][1] != list(files[name][1])]
    return f"{bad[0]} does not match the checksum taken at save (damaged since)" if bad else None


def verify_checkpoint(path: Path, *, warn=None, kind: Literal["dcp", "trl"] = "dcp") -> None:
    """Before resuming from `path`: every file as the save wrote it, else one UserError naming the file and
    the newest earlier checkpoint that verifies. A checkpoint of an older ftcli (no checksums) loads with a
    warning through `warn` (default: stderr). kind: "dcp" (meta.json's checksums) or "trl" (a LoRA
    checkpoint-N's TRL_CHECKSUMS file, `record_trl_checksums`)."""
    import sys

    path = Path(path)
    recorded = _recorded_checksums(path, kind)
    if not isinstance(recorded, dict) or not isinstance(recorded.get("files"), dict):
        (warn or (lambda m: print(m, file=sys.stderr)))(
            f"warning: checkpoint {path} has no checksums (saved by an older ftcli); resuming from it unverified")
        return
    problem = checkpoint_problem(path, recorded)
    if problem is None:
        return
    step = checkpoint_step(path) if _STEP_DIR.match(path.name) or _TRL_DIR.match(path.name) else None
    earlier = [p for p in reversed(_committed(path.parent, kind)) if step is not None and checkpoint_step(p) < step]
    intact = next((p for p in earlier if _intact(p, kind)), None)
    then = (f"the previous intact checkpoint is {intact} (resume from it with --resume {intact})" if intact is not None
            else "no earlier checkpoint verifies; start again without --resume (--force)")
    raise UserError(f"checkpoint {path}: {problem}; {then}")


def _intact(path: Path, kind: Literal["dcp", "trl"] = "dcp") -> bool:
    try:
        recorded = _recorded_checksums(path, kind)
    except UserError:
        return False
    return isinstance(recorded, dict) and isinstance(recorded.get("files"), dict) and \
        checkpoint_problem(path, recorded) is None


# A LoRA checkpoint-N is transformers' Trainer's layout (adapter, optimizer, scheduler, RNG, trainer_state.json, and
# ftcli's token counts and evals); TRL_CHECKSUMS in it records every other file's size and CRC32s as meta.json's
# "checksums" does for the full path, written after the save by `record_trl_checksums` (the ranks hash the files
# in turns; rank 0 writes it) and checked by the launcher before a resume (`verify_checkpoint(kind="trl")`).
TRL_CHECKSUMS = "ftcli_checksums.json"
_TRL_DIR = re.compile(r"^checkpoint-(\d+)$")


def _committed(root: Path, kind: Literal["dcp", "trl"]) -> list[Path]:
    """The committed checkpoints of that kind under `root`, oldest first."""
    if kind == "dcp":
        return list_checkpoints(root)
    found = [p for p in Path(root).iterdir() if _TRL_DIR.match(p.name) and (p / "trainer_state.json").is_file()] \
        if Path(root).is_dir() else []
    return sorted(found, key=checkpoint_step)


def _recorded_checksums(path: Path, kind: Literal["dcp", "trl"]) -> dict | None:
    if kind == "dcp":
        return read_meta(path).get(CHECKSUMS)
    file = Path(path) / TRL_CHECKSUMS
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"checkpoint {path}: cannot read {TRL_CHECKSUMS} ({e})") from None


def checkpoint_files(ckpt_dir: Path) -> list[str]:
    """Every file under `ckpt_dir` (relative paths, sorted) but the checksum record itself."""
    root = Path(ckpt_dir)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and p.name != TRL_CHECKSUMS and not p.name.startswith(".tmp"))


def record_trl_checksums(ckpt_dir: Path) -> None:
    """Collective when torch.distributed is up (every rank calls it after TRL's save of `ckpt_dir`): the ranks
    hash every other file in turns, rank 0 writes TRL_CHECKSUMS. Alone: this process hashes them all."""
    ckpt_dir = Path(ckpt_dir)
    distributed = dist.is_available() and dist.is_initialized()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    names = [checkpoint_files(ckpt_dir) if rank == 0 else None]
    if distributed:
        dist.barrier()  # every rank's files of this save are written
        dist.broadcast_object_list(names, src=0)
    mine = file_checksums(ckpt_dir, names[0][rank::world_size])
    parts = [None] * world_size if rank == 0 else None
    if distributed:
        dist.gather_object(mine, parts, dst=0)
    else:
        parts = [mine]
    if rank == 0:
        files = {name: entry for part in parts for name, entry in part.items()}
        write_atomic(ckpt_dir / TRL_CHECKSUMS, json.dumps(
            {"algorithm": "crc32", "chunk_bytes": CHUNK_BYTES, "files": dict(sorted(files.items()))}) + "\n")


class CheckpointNotSaved(TrainingStopped):
    """A save that an OSError (disk full, quota, permissions) stopped on any rank; every rank raises it
    together, rank 0 reports it in one line."""


def _save_problem(e: BaseException, ckpt_dir: Path, rank_bytes: int) -> str | None:
    """The write error behind a failed save, as a phrase; None when it is not one (a bug: raised as it is).
    `e` is an OSError, or the CheckpointException in which DCP gathers every rank's failure (raised on every
    rank). A full disk reaches DCP's shard writes as torch.save's RuntimeError ("unexpected pos ...": the
    OSError it swallowed does not survive DCP's pickling), so a RuntimeError or SafetensorError with less
    space free there than this rank's shards (`rank_bytes`) take is reported as the full disk it is."""
    if isinstance(e, OSError):
        return _describe(e)
    failures = [exc for exc, _ in e.failures.values()] if isinstance(e, CheckpointException) else []
    found = next((exc for exc in failures if isinstance(exc, OSError)), None) or \
        next((exc for exc in failures if isinstance(exc, WRITE_ERRORS)), None)
    if found is None:
        return None
    problem = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", _write_problem(found))  # torch's C++ prefix
    free = _free_bytes(ckpt_dir)
    if not isinstance(found, OSError) and not _DISK_FULL.search(problem) and free is not None and free < rank_bytes:
        problem = (f"No space left on device: {free / 2**20:,.1f} MiB free in {ckpt_dir.parent}, this rank's "
                   f"shards take about {rank_bytes / 2**20:,.1f} MiB ({problem})")
    return problem


def _state_bytes(*states: dict) -> int:
    """The bytes of this rank's tensors (its local shards) in nested state dicts."""
    total = 0
    for state in states:
        for value in state.values():
            if isinstance(value, dict):
                total += _state_bytes(value)
            elif isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _describe(e: OSError) -> str:
    return f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "") + f" [errno {e.errno}]"


# What a failed write raises: an OSError (json, open), torch.save's RuntimeError, safetensors' SafetensorError;
# the words by which a full disk or quota shows in each (ENOSPC, EDQUOT)
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)
_DISK_FULL = re.compile(r"\[errno (28|122)\]|No space left|file write failed|StorageFull")


def _write_problem(e: BaseException) -> str:
    return _describe(e) if isinstance(e, OSError) else (str(e).strip() or type(e).__name__).splitlines()[0]


def _gathered(problem: str | None) -> str | None:
    """The first rank's problem, as every rank sees it (collective)."""
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p), None)


def _broadcast(problem: OSError | None) -> str | None:
    """Rank 0's problem, as every rank sees it (collective)."""
    shared = [_describe(problem) if problem is not None else None]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def _raise_if_not_saved(root: Path, step: int, partial: Path, problem: str | None) -> None:
    """CheckpointNotSaved on every rank when any rank's `problem` is set: which step, that the last
    committed checkpoint is intact (the half-written save is removed, it is never resumed from), and
    how to go on. Nothing when there is no problem."""
    if problem is None:
        return
    if dist.get_rank() == 0:
        _unpublish_and_remove(partial)  # gives back the space the partial save took
    raise _not_saved(step, problem, latest_checkpoint(root), root.parent / RECIPE_FILE)


def _not_saved(step: int, problem: str, last: Path | None, recipe: Path) -> CheckpointNotSaved:
    """The one line of a save that failed: the problem, the last intact checkpoint and how to go on."""
    fix = "free space" if _DISK_FULL.search(problem) else "fix that"
    if last is not None:
        then = (f"the last good checkpoint, step {checkpoint_step(last)} ({last}), is intact: {fix}, then resume "
                f"with `ftcli train --recipe {recipe} --resume`")
    elif ran_a_step(recipe.parent):  # its logged steps stay: a new start replaces them
        then = f"there is no earlier checkpoint: {fix}, then start again with `ftcli train --recipe {recipe} --force`"
    else:  # the launcher removes a start that left no step behind (ftcli.artifacts.rundir.remove_failed_start)
        then = f"there is no earlier checkpoint: {fix}, then run the same `ftcli train` again (this start is removed)"
    return CheckpointNotSaved(f"the checkpoint of step {step} could not be saved: {problem}; {then}")


def trl_save_failed(output_dir: Path, step: int, e: Exception, run_dir: Path,
                    resumed: Path | None = None) -> CheckpointNotSaved | None:
    """The LoRA path's one line for an error that stopped TRL's save of checkpoint-`step` (a full disk, a quota:
    an OSError from json, a RuntimeError from torch.save, a SafetensorError): that dir has no TRL_CHECKSUMS yet
    (they are recorded after the save), so it is the half-written one and is removed (it is never resumed from);
    the line names the error, the space free there and the last intact checkpoint. None when the error did not
    come from that save: checkpoint-`step` absent, complete with its checksums, or the one resumed from."""
    partial = Path(output_dir) / f"checkpoint-{step}"
    if not partial.is_dir() or (partial / TRL_CHECKSUMS).is_file() or \
            (resumed is not None and checkpoint_step(resumed) >= step):
        return None
    shutil.rmtree(partial, ignore_errors=True)  # gives back the space the partial save took
    last = next((p for p in reversed(_committed(Path(output_dir), "trl")) if _intact(p, "trl")), None)
    free = shutil.disk_usage(output_dir).free / 2**20
    return _not_saved(step, f"{_write_problem(e)} ({free:,.1f} MiB free there)", last, Path(run_dir) / RECIPE_FILE)


def rank_state_source(saved_world_size: int, rank: int) -> int:
    """Whose per-rank trainer state rank `rank` loads from a checkpoint of `saved_world_size` ranks: its
    own when it had one, else rank 0's (scheduler, data position and step accounting are equal on every
    rank; only the RNG differs, see the module doc)."""
    return rank if rank < saved_world_size else 0


def remove_interrupted_saves(root: Path) -> list[Path]:
    """Delete the saves a crash or a second kill interrupted under `root`: `step_*` dirs without meta.json (and an
    older ftcli's `.tmp_step_*` dirs); never resumed from. Rank 0, before the run's first save; returns what was
    removed."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and (
        _TMP_STEP_DIR.match(p.name) or (_STEP_DIR.match(p.name) and not (p / "meta.json").is_file())))
    for p in found:
        shutil.rmtree(p, ignore_errors=True)
    return found


def checkpoint_step(path: Path) -> int:
    """The step of a committed checkpoint dir: step_XXXXXXXX (full) or checkpoint-N (LoRA, TRL)."""
    name = Path(path).name
    match = _STEP_DIR.match(name) or re.match(r"^checkpoint-(\d+)$", name)
    if not match:
        raise ValueError(f"not a checkpoint dir: {path}")
    return int(match.group(1))


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Collective. Loads model + optimizer in place; returns (this rank's trainer state, meta)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    meta = read_meta(path)
    rank = rank_state_source(meta["world_size"], dist.get_rank())  # the rank state this rank resumes from
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    rank_state = read_rank_state(path, rank)
    check_dcp_metadata(path)
    try:
        dcp.load(state, storage_reader=dcp_storage(path, "reader"), planner=SafeLoadPlanner())
    except CheckpointException as e:  # DCP wraps what each rank raised; ours is one line
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, UserError)]
        if refused:
            raise UserError(f"checkpoint {path}: {refused[0]}") from None
        raise
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return rank_state, meta


# ----------------------------------------------------------------------- loading that runs no code
def _encode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The trainer state as JSON: tensors go to `tensors` (safetensors) and leave a reference; numpy
    arrays and tuples (the RNG states) are tagged so they come back as they were."""
    if isinstance(value, torch.Tensor):
        name = str(len(tensors))
        tensors[name] = value.detach().cpu().contiguous().clone()
        return {"__tensor__": name}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors) for v in value]
    if isinstance(value, dict):
        assert all(isinstance(k, str) and not k.startswith("__") for k in value), f"state keys: {list(value)[:5]}"
        return {k: _encode(v, tensors) for k, v in value.items()}
    assert value is None or isinstance(value, (bool, int, float, str)), f"cannot save {type(value).__name__}"
    return value


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return tensors[value["__tensor__"]]
    if "__ndarray__" in value:
        return np.asarray(value["__ndarray__"], dtype=np.dtype(value["dtype"]))
    if "__tuple__" in value:
        return tuple(_decode(v, tensors) for v in value["__tuple__"])
    return {k: _decode(v, tensors) for k, v in value.items()}


def write_rank_state(ckpt_dir: Path, rank: int, state: dict[str, Any]) -> None:
    """This rank's trainer state (scheduler, data position, RNG) as rank_XXXXX.json + .safetensors."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(state, tensors)
    save_file(tensors, str(Path(ckpt_dir) / f"rank_{rank:05d}.safetensors"))
    write_new(Path(ckpt_dir) / f"rank_{rank:05d}.json", json.dumps(encoded) + "\n")  # the commit is meta.json


def read_rank_state(ckpt_dir: Path, rank: int) -> dict[str, Any]:
    """What `write_rank_state` wrote; an older ftcli's rank_XXXXX.pt through torch.load(weights_only=True).
    Anything else (a pickle that would run code, a damaged file) is one UserError naming the file."""
    from safetensors.torch import load_file

    ckpt_dir = Path(ckpt_dir)
    path = ckpt_dir / f"rank_{rank:05d}.json"
    if path.is_file():
        try:
            encoded = json.loads(path.read_text(encoding="utf-8"))
            tensors = load_file(str(path.with_suffix(".safetensors")))
            return _decode(encoded, tensors)
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, SafetensorError) as e:
            raise UserError(f"checkpoint {ckpt_dir}: cannot read {path.name} and its .safetensors ({e}); "
                            "resume from another checkpoint") from None
    legacy = ckpt_dir / f"rank_{rank:05d}.pt"
    if not legacy.is_file():
        raise UserError(f"checkpoint {ckpt_dir} has no trainer state for rank {rank} ({path.name}); "
                        "resume from another checkpoint")
    try:  # an older ftcli pickled it; the numpy RNG state is the only non-torch type it holds
        with torch.serialization.safe_globals([np.ndarray, np.dtype, np.dtypes.UInt32DType,
                                               np._core.multiarray._reconstruct]):
            return torch.load(legacy, weights_only=True)
    except Exception as e:  # noqa: BLE001 - UnpicklingError, or whatever a damaged file raises
        raise UserError(f"checkpoint {ckpt_dir}: {legacy.name} holds more than tensors and plain data, so ftcli does "
                        f"not load it (loading could run code: {_first_line(e)})") from None


def read_meta(ckpt_dir: Path) -> dict[str, Any]:
    path = Path(ckpt_dir) / "meta.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"checkpoint {ckpt_dir}: cannot read meta.json ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("world_size"), int):
        raise UserError(f"checkpoint {ckpt_dir}: meta.json is not one ftcli wrote (no world_size)")
    return meta


def _first_line(e: BaseException) -> str:
    """The line that says why: torch.load's weights_only refusal names the global on a later line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
    found = [ln.split(" was not an allowed global")[0] for ln in lines if "Unsupported global" in ln]
    return found[0].removeprefix("WeightsUnpickler error: ") if found else lines[0]


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` allowing only the records DCP itself writes there (dataclasses and
    enums of torch.distributed.checkpoint, torch.Size, dtypes, layouts, paths); any other global, the
    way a crafted pickle runs code, raises before it is looked up, let alone called."""

    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")
    _NAMED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
              ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
              ("pathlib", "PureWindowsPath"), ("pathlib", "Path")}

    def find_class(self, module: str, name: str) -> Any:
        import dataclasses
        import enum

        if (module, name) in self._NAMED:
            return super().find_class(module, name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        elif module in self._MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def check_dcp_metadata(ckpt_dir: Path) -> None:
    """Every *.metadata file of a DCP checkpoint unpickles with `_DcpMetadataUnpickler`, or UserError.
    (DCP then reads the same file with pickle; a file swapped in between needs write access to the
    checkpoint while it is being resumed.)"""
    import io

    for path in sorted(Path(ckpt_dir).glob("*.metadata")) or [Path(ckpt_dir) / ".metadata"]:
        try:
            _DcpMetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        except Exception as e:  # noqa: BLE001 - UnpicklingError, EOFError, ... on a damaged or crafted file
            raise UserError(f"checkpoint {ckpt_dir}: {path.name} is not DCP metadata ftcli can load safely "
                            f"({_first_line(e)}); resume from another checkpoint") from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner, except that a non-tensor item (the optimizer's hyperparameters) must load
    with torch.load(weights_only=True) first: the default unpickles it with weights_only=False."""

    def load_bytes(self, read_item, value) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001 - UnpicklingError on a crafted item
            raise UserError(f"item {read_item.dest_index.fqn} holds more than plain data, so ftcli does "
                            f"not load it (loading could run code: {_first_line(e)})") from None
        value.seek(0)
        super().load_bytes(read_item, value)


def best_checkpoint(root: Path, step: int | None) -> Path | None:
    """The committed checkpoint of `step` under `root` (the best eval's), or None."""
    if step is None:
        return None
    path = Path(root) / step_dir_name(step)
    return path if (path / "meta.json").is_file() else None


def load_model_weights(path: Path, model: torch.nn.Module) -> None:
    """Collective. Only the model weights of a checkpoint, into the (sharded) model: the best eval's model
    before the final export (eval.export=best). The optimizer and trainer state are left alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"model": get_model_state_dict(model)}
    dcp.load(state, storage_reader=dcp_storage(path, "reader"))
    set_model_state_dict(model, state["model"])


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
    begin_export(out_dir)  # written in place, its record last (ftcli.artifacts.publish): no large file renamed
    try:
        export.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
    except WRITE_ERRORS as e:
        remove_export(out_dir)  # never left as if complete; gives the space back
        needed = sum(t.numel() * t.element_size() for t in export.state_dict().values())
        raise export_not_written("the Hugging Face export", out_dir, e, needed) from None
    publish_export(out_dir)


def export_not_written(what: str, out_dir: Path, e: BaseException, needed_bytes: int | None) -> UserError:
    """The one line for a model export (the full path's HF export, the LoRA path's adapter) that a write error
    (WRITE_ERRORS) stopped, once its partial files are removed: the path and the error, and for a full disk or
    quota the space the export needs and the space free there."""
    out_dir = Path(out_dir)
    problem = _write_problem(e)
    space = ""
    if _DISK_FULL.search(problem):
        where = next((p for p in (out_dir, *out_dir.parents) if p.exists()), Path("/"))
        need = f"about {needed_bytes / 2**20:,.1f} MiB" if needed_bytes else "more"
        space = f"; it needs {need}, {shutil.disk_usage(where).free / 2**20:,.1f} MiB are free there: free space"
    return UserError(f"{what} to {out_dir} could not be written: {problem}{space}; nothing half-written is "
                     "left in its place")
