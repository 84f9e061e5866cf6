"""The precomputed reference (training.preference.reference=precomputed): the reference model's summed log-prob of
every segment of a packed preference entry, stored once beside the pack cache and read with the blocks.

    <cache root>/packed/<blocks key>/          the packed pairs (ftcli.data.cache)
    <cache root>/reference/<key>/              key = sha256 of {blocks: <blocks key>, reference: <identity>}
        meta.json                              format version, key parts, segment count, logps.bin's size and CRC32
        logps.bin                              float32 [segments]: the reference's sum over each segment's trained
                                               tokens, in the entry's segment order (`PackedDataset.segment_offsets`)

The identity names the reference model (ftcli.train.reference.reference_identity: its weights' files or hub
commit, or the random init's config and seed, dtype, attention): a store is never read for other blocks or another
model, because its key differs. An entry is trusted only after `store_problem` (as the pack cache's `entry_problem`):
meta.json readable, its key parts hashing to its name and naming these blocks, logps.bin of the recorded size and
CRC32. Written in a temp dir renamed into place: readers see a whole store or none. Pure data: numpy and files.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from ftcli.config.safe_files import refuse_links, remove_tree, replace_dir
from ftcli.data.cache import PackedDataset, file_crc32, read_meta

REFERENCE_FORMAT_VERSION = 1
LOGPS_FILE = "logps.bin"


def store_key(blocks_key: str, identity: dict[str, Any]) -> str:
    parts = {"format_version": REFERENCE_FORMAT_VERSION, "blocks": blocks_key, "reference": identity}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def store_path(packed: PackedDataset, identity: dict[str, Any]) -> Path:
    """Where the reference log-probs of `packed` by the model `identity` names live: beside its pack cache entry."""
    return packed.path.parent.parent / "reference" / store_key(packed.key, identity)


def num_segments(packed: PackedDataset) -> int:
    return int(packed.segment_offsets[-1]) if len(packed) else 0


def store_problem(path: Path, packed: PackedDataset, identity: dict[str, Any], *, checksums: bool = True) -> str | None:
    """Why the store at `path` cannot be used for `packed` and `identity`, or None."""
    meta, problem = read_meta(path, REFERENCE_FORMAT_VERSION, "reference")
    if meta is None:
        return problem
    if meta.get("blocks") != packed.key or meta.get("reference") != identity or \
            store_key(packed.key, identity) != path.name:
        return "it was written for other blocks or another reference model"
    recorded = meta.get("files", {}).get(LOGPS_FILE) if isinstance(meta.get("files"), dict) else None
    if not isinstance(recorded, list) or len(recorded) != 2 or meta.get("num_segments") != num_segments(packed):
        return "its meta.json records no size and checksum for these blocks' segments"
    f = path / LOGPS_FILE
    if not f.is_file() or f.is_symlink():
        return f"{LOGPS_FILE} is missing or not a regular file"
    if f.stat().st_size != recorded[0] or recorded[0] != 4 * num_segments(packed):
        return f"{LOGPS_FILE} has {f.stat().st_size} bytes, {recorded[0]} were written"
    if checksums and file_crc32(f) != recorded[1]:
        return f"{LOGPS_FILE} does not match the checksum taken when it was written (changed since)"
    return None


def write_store(path: Path, packed: PackedDataset, identity: dict[str, Any], logps: np.ndarray) -> Path:
    """Write `logps` (float32 [segments]) as the store at `path`: a temp dir renamed into place (a store in the way,
    one `store_problem` refused, is replaced)."""
    logps = np.ascontiguousarray(logps, dtype=np.float32)
    assert logps.shape == (num_segments(packed),), (logps.shape, num_segments(packed))
    refuse_links([path], where="the reference store", fix="remove it or set data.cache_dir elsewhere")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        logps.tofile(tmp / LOGPS_FILE)
        meta = {"format_version": REFERENCE_FORMAT_VERSION, "blocks": packed.key, "reference": identity,
                "num_segments": int(logps.size),
                "files": {LOGPS_FILE: [(tmp / LOGPS_FILE).stat().st_size, file_crc32(tmp / LOGPS_FILE)]}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True, default=str))
        replace_dir(tmp, path)
    except BaseException:
        remove_tree(tmp)
        raise
    return path


class ReferencedBlocks:
    """A PackedDataset whose blocks carry the stored reference log-probs (`Block.reference_logps`, float32 [S], 0 for
    the padding segment); everything else is the wrapped dataset's (len, key, stats, pad_block_len, ...)."""

    def __init__(self, packed: PackedDataset, path: Path):
        self.packed, self.path = packed, Path(path)
        n = num_segments(packed)
        self.logps = np.memmap(self.path / LOGPS_FILE, dtype=np.float32, mode="r", shape=(n,)) if n else \
            np.zeros(0, np.float32)

    def __len__(self) -> int:
        return len(self.packed)

    def __getattr__(self, name: str):
        return getattr(self.packed, name)

    def block(self, i: int):
        block = self.packed.block(i)
        start, end = (int(x) for x in self.packed.segment_offsets[i:i + 2])
        ref = np.zeros(len(block.cu_seqlens) - 1, dtype=np.float32)
        ref[:end - start] = self.logps[start:end]
        block.reference_logps = ref
        return block

    def __getitem__(self, i: int):
        return self.block(i)
