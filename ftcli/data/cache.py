"""The on-disk packed dataset: written once (atomically), then memory-mapped by every rank and command.

Layout of one entry, `<cache root>/packed/<key>/` (key = sha256 of everything that changes the bytes):

    meta.json          format version, key parts, block_len, pad id, counts, DataStats
    input_ids.bin      int32, the real tokens of all blocks end to end (padding is not stored)
    loss_mask.bin      uint8, 1 where the example trains the token
    seg_lens.bin       int32, the real segments of all blocks end to end
    block_tokens.bin   int64 [N+1] offsets of each block's tokens
    block_segs.bin     int64 [N+1] offsets of each block's segments
    block_trained.bin  int32 [N]   num_trained_tokens of each block (as the loss sees it)
    seg_roles.bin      int8, preference data only: the role of every real segment (0 chosen, 1 rejected)

Writers fill a private temp dir next to the entry and `rename` it into place: readers see a complete
entry or none, and when several ranks race, the first rename wins and the others discard their copy.
Readers `np.memmap` the files, so a 27B-scale dataset costs page cache, not process memory.

An entry is trusted only after it passed `entry_problem` (as a checkpoint is checked before a resume):
meta.json readable, its key and the hash of its key_parts both the entry's name (an entry copied under
another key, another tokenizer's, is not this one), and every .bin file of the size and CRC32 meta.json
records (`files`, taken at commit: truncated, garbled or shuffled ids are caught). `prepare` rebuilds an
entry that fails, with one line saying why; a dir left without meta.json is removed, never a wedge. Paths
in the cache are never written or removed through a link (ftcli.config.safe_files).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from ftcli.config.safe_files import refuse_links, remove_tree, replace_dir
from ftcli.data.packing import Block, make_block, num_trained
from ftcli.data.stats import DataStats

DATA_FORMAT_VERSION = 1
_ARRAYS = {
    "input_ids": np.int32,
    "loss_mask": np.uint8,
    "seg_lens": np.int32,
    "block_tokens": np.int64,
    "block_segs": np.int64,
    "block_trained": np.int32,
}


def default_cache_root() -> Path:
    """ftcli's cache on this machine: $FTCLI_CACHE, else ~/.cache/ftcli (packed data, compiled kernels)."""
    return Path(os.environ.get("FTCLI_CACHE") or "~/.cache/ftcli").expanduser()


def cache_root(data) -> Path:
    """data.cache_dir, else $FTCLI_CACHE, else ~/.cache/ftcli."""
    if not data.cache_dir:
        return default_cache_root()
    from ftcli.config.recipe import resolve_path

    return Path(resolve_path(data.cache_dir)).expanduser()


def cache_key(parts: dict[str, Any]) -> str:
    blob = json.dumps({"format_version": DATA_FORMAT_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def file_crc32(path: Path, chunk_bytes: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            crc = zlib.crc32(chunk, crc)
    return crc


def read_meta(path: Path, version: int, kind: str = "data") -> tuple[dict[str, Any], None] | tuple[None, str]:
    """(the meta.json of the entry at `path`, None), or (None, why it cannot be read as `kind` format `version`)."""
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, "it has no meta.json"
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"its meta.json is unreadable ({e})"
    if not isinstance(meta, dict) or meta.get("format_version") != version:
        return None, f"its meta.json is not {kind} format {version}"
    return meta, None


def entry_problem(path: Path, *, checksums: bool = True) -> str | None:
    """Why the cache entry at `path` cannot be trusted (module doc), or None. `checksums=False`: sizes only
    (the ranks that open what rank 0 has just checked)."""
    meta, problem = read_meta(path, DATA_FORMAT_VERSION)
    if meta is None:
        return problem
    parts = meta.get("key_parts")
    if meta.get("key") != path.name or not isinstance(parts, dict) or cache_key(parts) != path.name:
        return "it was written for other data or another tokenizer (its key_parts do not hash to its name)"
    files = meta.get("files")
    if not isinstance(files, dict) or sorted(files) != sorted(f"{n}.bin" for n in _ARRAYS):
        return "its meta.json records no sizes and checksums"
    for name, recorded in sorted(files.items()):
        f = path / name
        if not isinstance(recorded, list) or len(recorded) != 2:
            return f"meta.json's entry for {name} is malformed"
        try:
            st = os.lstat(f)
        except FileNotFoundError:
            return f"{name} is missing"
        if not f.is_file() or f.is_symlink():
            return f"{name} is not a regular file"
        if st.st_size != recorded[0]:
            return f"{name} has {st.st_size} bytes, {recorded[0]} were written"
        if checksums and file_crc32(f) != recorded[1]:
            return f"{name} does not match the checksum taken when it was written (changed since)"
    n, tokens = meta.get("num_blocks"), meta.get("num_tokens")
    if not isinstance(n, int) or not isinstance(tokens, int) or files["block_tokens.bin"][0] != 8 * (n + 1) or \
            files["block_trained.bin"][0] != 4 * n or files["input_ids.bin"][0] != 4 * tokens:
        return "its meta.json's block and token counts do not match its files"
    return None


class BlockWriter:
    """Streams packed blocks into a temp dir; `commit` renames it into place (`abort` removes it)."""

    def __init__(self, final: Path):
        self.final = final
        refuse_links([final], where="the pack cache", fix="remove it or set data.cache_dir elsewhere")
        final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir()
        self._files = {}
        try:
            for name in ("input_ids", "loss_mask", "seg_lens"):
                self._files[name] = open(self.tmp / f"{name}.bin", "wb")
        except BaseException:
            self.abort()
            raise
        self.block_tokens, self.block_segs, self.block_trained = [0], [0], []

    def add(self, ids: np.ndarray, mask: np.ndarray, seg_lens: list[int], roles: list[int] | None = None) -> int:
        self._files["input_ids"].write(np.ascontiguousarray(ids, dtype=np.int32).tobytes())
        self._files["loss_mask"].write(np.ascontiguousarray(mask, dtype=np.uint8).tobytes())
        self._files["seg_lens"].write(np.asarray(seg_lens, dtype=np.int32).tobytes())
        if roles is not None:
            assert len(roles) == len(seg_lens)
            if "seg_roles" not in self._files:
                assert len(self.block_trained) == 0, "every block of an entry has roles, or none"
                self._files["seg_roles"] = open(self.tmp / "seg_roles.bin", "wb")
            self._files["seg_roles"].write(np.asarray(roles, dtype=np.int8).tobytes())
        self.block_tokens.append(self.block_tokens[-1] + len(ids))
        self.block_segs.append(self.block_segs[-1] + len(seg_lens))
        trained = num_trained(np.asarray(mask, dtype=bool), list(seg_lens))
        self.block_trained.append(trained)
        return trained

    def commit(self, meta: dict[str, Any]) -> Path:
        """Close the files, record their sizes and CRC32s in meta.json, rename the entry into place. Any error:
        the temp dir is removed (`abort`) and the error raised."""
        try:
            self._close()
            for name, values in (
                ("block_tokens", self.block_tokens),
                ("block_segs", self.block_segs),
                ("block_trained", self.block_trained),
            ):
                np.asarray(values, dtype=_ARRAYS[name]).tofile(self.tmp / f"{name}.bin")
            files = {f"{n}.bin": [(self.tmp / f"{n}.bin").stat().st_size, file_crc32(self.tmp / f"{n}.bin")]
                     for n in _ARRAYS}
            meta = {**meta, "num_blocks": len(self.block_trained), "num_tokens": self.block_tokens[-1], "files": files}
            (self.tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True, default=str))
            self._rename()
        except BaseException:
            self.abort()
            raise
        return self.final

    def _rename(self) -> None:
        try:
            os.rename(self.tmp, self.final)
            return
        except OSError:
            if entry_problem(self.final, checksums=False) is None:
                remove_tree(self.tmp)  # another rank/process won the race: same bytes
                return
        replace_dir(self.tmp, self.final)  # a damaged entry (no meta.json, ...) in the way: never a wedge

    def _close(self) -> None:
        """Close every file, also when one close fails (a full disk fails at the flush): the first error raised."""
        problem = None
        for f in self._files.values():
            try:
                f.close()
            except OSError as e:
                problem = problem or e
        if problem is not None:
            raise problem

    def abort(self) -> None:
        """Remove the temp dir, whatever closing the files says (a full disk): nothing half-written is left."""
        try:
            self._close()
        except OSError:
            pass
        remove_tree(self.tmp)


class PackedDataset:
    """A packed dataset on disk: `len()`, `block(i)` (or `ds[i]`), `stats`, memory-mapped."""

    def __init__(self, path: Path, from_cache: bool = True):
        self.path = Path(path)
        self.meta = json.loads((self.path / "meta.json").read_text())
        if self.meta.get("format_version") != DATA_FORMAT_VERSION:
            raise ValueError(f"{self.path}: data format {self.meta.get('format_version')} != {DATA_FORMAT_VERSION}")
        self.key: str = self.meta["key"]
        self.block_len: int | None = self.meta["block_len"]  # None: packing disabled (variable-length blocks)
        self.pad_id: int = self.meta["pad_id"]
        self.stats = DataStats.from_dict(self.meta["stats"])
        self.from_cache = from_cache
        self._arrays = {name: self._map(name, dtype) for name, dtype in _ARRAYS.items()}
        roles = self.path / "seg_roles.bin"
        self._roles = self._map("seg_roles", np.int8) if roles.exists() else None

    @property
    def paired(self) -> bool:
        """Preference data: every block is whole pairs (`Block.roles`, `Block.pairs`)."""
        return self._roles is not None

    def _map(self, name: str, dtype) -> np.ndarray:
        f = self.path / f"{name}.bin"
        n = f.stat().st_size // np.dtype(dtype).itemsize
        return np.memmap(f, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype=dtype)

    def __len__(self) -> int:
        return int(self.meta["num_blocks"])

    @property
    def block_trained(self) -> np.ndarray:
        return self._arrays["block_trained"]

    def segments(self, i: int) -> np.ndarray:
        """Real segment lengths of block i (without the padding segment)."""
        s = self._arrays["block_segs"]
        return np.asarray(self._arrays["seg_lens"][s[i] : s[i + 1]])

    @property
    def segment_offsets(self) -> np.ndarray:
        """int64 [N+1]: where each block's real segments start in the entry's segment order (`segments`)."""
        return self._arrays["block_segs"]

    def num_tokens(self, i: int) -> int:
        t = self._arrays["block_tokens"]
        return int(t[i + 1] - t[i])

    @property
    def pad_block_len(self) -> int:
        """Length of rank-balancing padding blocks."""
        return self.block_len or max(1, self.meta.get("max_example_len", 1))

    def block(self, i: int) -> Block:
        if not 0 <= i < len(self):
            raise IndexError(f"block {i} of {len(self)}")
        t = self._arrays["block_tokens"]
        a, b = int(t[i]), int(t[i + 1])
        ids = np.array(self._arrays["input_ids"][a:b], dtype=np.int32)
        mask = np.array(self._arrays["loss_mask"][a:b], dtype=bool)
        roles = None
        if self._roles is not None:
            s = self._arrays["block_segs"]
            roles = np.array(self._roles[s[i] : s[i + 1]], dtype=np.int8)
        return make_block(ids, mask, list(self.segments(i)), self.block_len or (b - a), self.pad_id, index=i,
                          roles=roles)

    def __getitem__(self, i: int) -> Block:
        return self.block(i)
