"""Where rows come from: hub datasets (id + revision + split, streamed or not), local JSONL / Parquet /
CSV / Arrow files or directories (a Unity Catalog volume is a local path), `datasets.save_to_disk` dirs, or
Delta tables (`source: delta`, ftcli.data.delta: by path or Unity Catalog name, at a version).
`data` below is one source (`ftcli.config.recipe.SourceConfig`: the same keys as the single-source `data`).

Local files are read directly (json / pyarrow), not through `datasets`: each row arrives exactly as
written, so a malformed row is counted by the validator instead of failing the whole load, and nothing
is written to the HF cache. Rows are numbered 0, 1, ... across files in sorted path order; these are
the indices the pipeline reports. Text files are UTF-8: a byte-order mark is dropped, and a JSONL line
that is not valid UTF-8 is one bad row ("undecodable line"), never the whole file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from ftcli.config.errors import UserError
from ftcli.data import delta

BOM = b"\xef\xbb\xbf"
SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow")
# Compressed text files, read as `datasets` reads them (.jsonl.gz, .json.zst, .csv.bz2, ...): decompressed as a
# stream, never written out. zstandard is the package datasets uses for .zst.
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
COMPRESSIBLE = (".jsonl", ".json", ".csv")


def data_suffix(path: Path) -> str | None:
    """The data type of a file name (".jsonl" for x.jsonl and x.jsonl.gz), or None for other files."""
    if path.suffix in COMPRESSED:
        inner = Path(path.stem).suffix
        return inner if inner in COMPRESSIBLE else None
    return path.suffix if path.suffix in SUFFIXES else None


def _open_binary(f: Path):
    """The file's bytes, decompressed by its compression suffix."""
    if f.suffix == ".gz":
        import gzip

        return gzip.open(f, "rb")
    if f.suffix == ".bz2":
        import bz2

        return bz2.open(f, "rb")
    if f.suffix == ".xz":
        import lzma

        return lzma.open(f, "rb")
    if f.suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            raise UserError(f"{f}: reading .zst files needs the zstandard package (pip install zstandard)") from None
        import io

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(f, "rb"), closefd=True))
    return open(f, "rb")


class InvalidRow:
    """A row that could not even be parsed (bad JSON line)."""

    def __init__(self, reason: str, detail: str):
        self.reason, self.detail = reason, detail


def _local_path(data) -> Path:
    from ftcli.config.recipe import resolve_path

    path = Path(resolve_path(data.path)).expanduser()
    if not path.exists():
        tried = ""
        if not path.is_absolute():  # resolve_path found it in no recipe folder: say where it was looked for
            tried = (f" (tried {Path.cwd() / path}: a relative path is read from the working directory, or from "
                     "the recipe file's folder where it is there)")
        raise UserError(f"data.path {data.path!r} does not exist{tried}")
    if not (path.is_file() or path.is_dir()):  # a FIFO, a device, a socket: rows are read from files
        raise UserError(f"data.path {path} is not a regular file or a directory (a pipe or a device); write the "
                        "rows to a file and point data.path at it")
    return path


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / n).exists() for n in ("dataset_dict.json", "state.json"))


def local_files(data) -> list[Path]:
    path = _local_path(data)
    if path.is_file():
        if data_suffix(path) is None:
            raise UserError(f"data.path {path}: unsupported file type {''.join(path.suffixes[-2:])!r} (use "
                            f"{', '.join(SUFFIXES)}; .jsonl, .json and .csv also as {', '.join(COMPRESSED)})")
        return [path]
    if _is_saved_dataset(path):
        return sorted(p for p in path.rglob("*") if p.is_file())
    files = sorted(p for p in path.rglob("*")
                   if p.is_file() and data_suffix(p) is not None and not p.name.startswith("."))
    if not files:
        raise UserError(f"data.path {path}: no {', '.join(SUFFIXES)} files (or compressed .jsonl/.json/.csv) "
                        "in this directory")
    return files


def fingerprint(data) -> dict[str, Any]:
    """What identifies the rows without reading them (a cache-key part). A local file by its size, mtime and
    ctime: an edit that keeps the size and puts the mtime back (touch -d) still changes the ctime."""
    if data.source == "synthetic":
        return {"source": "synthetic", **data.synthetic.model_dump()}
    if data.source == "hub":
        return {"source": "hub", "path": data.path, "revision": data.revision, "split": data.split}
    if data.source == "delta":
        return delta.fingerprint(data)
    root = _local_path(data)
    files = []
    for f in local_files(data):
        st = f.stat()
        files.append([str(f.relative_to(root)) if f != root else f.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
    return {"source": "local", "path": str(root.resolve()), "split": data.split, "files": files}


def origin(data, holdout=None) -> dict[str, Any]:
    """Where a source's rows come from, as run.json and MLflow's dataset inputs record it: kind, path (a local
    file or dir made absolute; a hub id, a delta table's path or Unity Catalog name as given), revision (a hub commit, the delta version read; None: unpinned
    hub data, files), split, and a digest of `fingerprint` (what the pack cache key holds: the files' names,
    sizes and times, a table's version) and of `holdout` (ftcli.data.spec.Holdout: the training side and the eval
    side of eval.holdout are two datasets), so two runs that read the same rows have the same digest."""
    import hashlib

    key = fingerprint(data)
    hashed = {**key, "holdout": vars(holdout)} if holdout is not None else key
    revision = key.get("version", data.revision if data.source == "hub" else None)
    path = key["path"] if data.source == "local" else data.path  # a local path made absolute (pkg:// resolved)
    out = {"kind": data.source, "path": path if data.source != "synthetic" else None,
           "revision": None if revision is None else str(revision), "split": data.split,
           "digest": hashlib.sha256(json.dumps(hashed, sort_keys=True, default=str).encode()).hexdigest()[:16]}
    return {**out, "filter": key["filter"]} if key.get("filter") else out  # a delta source's rows: those it kept


def open_rows(data, limit: int | None = None) -> tuple[Iterator[tuple[int, Any]], int | None]:
    """(iterator of (row index, row), total rows if known cheaply)."""
    if data.source == "hub":
        rows, total = _hub_rows(data)
    elif data.source == "delta":
        rows, total = delta.delta_rows(data)
    else:
        path = _local_path(data)
        if _is_saved_dataset(path):
            rows, total = _saved_rows(path, data.split)
        else:
            files = local_files(data)
            rows, total = _file_rows(files), _count_or_none(files)
    if limit is not None:
        total = limit if total is None else min(total, limit)
        rows = _take(rows, limit)
    return rows, total


def sample_rows(data, limit: int, max_files: int = 64) -> list[list[Any]]:
    """The first `limit` readable rows of each file of a local folder (its first `max_files` files, each apart:
    a folder may hold files of different formats), else the first `limit` rows of the source."""
    if data.source == "local" and not _is_saved_dataset(_local_path(data)):
        files = local_files(data)
        if len(files) > 1:
            return [[row for _, row in _take(_file_rows([f]), limit) if not isinstance(row, InvalidRow)]
                    for f in files[:max_files]]
    rows, _ = open_rows(data, limit=limit)
    return [[row for _, row in rows if not isinstance(row, InvalidRow)]]


def _take(rows, limit):
    for index, row in rows:
        if index >= limit:
            return
        yield index, row


def _hub_rows(data):
    import datasets

    from ftcli import hub

    offline = hub.offline_for(data.path)
    if offline and not hub.offline_flag():  # datasets reads its cache only when told
        raise UserError(hub.no_connection(f"hub dataset {data.path!r}", offline)
                        + " (or set HF_HUB_OFFLINE=1 to read what the HF cache holds)")
    try:
        ds = datasets.load_dataset(data.path, revision=data.revision, split=data.split, streaming=data.streaming)
    except Exception as e:  # noqa: BLE001 - network / hub / split errors become one line
        first = (str(e).strip() or type(e).__name__).splitlines()[0]
        if offline:
            raise UserError(hub.no_connection(f"hub dataset {data.path!r} (split {data.split!r})", offline)) from None
        raise UserError(f"cannot load hub dataset {data.path!r} (split {data.split!r}): {first}") from None
    total = None if data.streaming else len(ds)
    return enumerate(ds), total


def _saved_rows(path: Path, split: str):
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise UserError(f"data.path {path}: no split {split!r} (has {', '.join(ds)})")
        ds = ds[split]
    return enumerate(ds), len(ds)


def _file_rows(files: list[Path]) -> Iterator[tuple[int, Any]]:
    index = 0
    for f in files:
        try:
            for row in _read_file(f):
                yield index, row
                index += 1
        except (OSError, UnicodeDecodeError, ValueError, EOFError) as e:  # pyarrow's: ValueErrors / OSErrors
            if isinstance(e, UserError):
                raise
            first = (str(e).strip() or type(e).__name__).splitlines()[0]
            raise UserError(f"cannot read {f}: {first}") from None


def _read_file(f: Path) -> Iterator[Any]:
    kind = data_suffix(f)
    if kind in (".jsonl", ".json"):
        with _open_binary(f) as fh:
            head = fh.read(4096).removeprefix(BOM).lstrip()
        with _open_binary(f) as fh:
            if head.startswith(b"["):  # a JSON array file: one document, read whole
                try:
                    rows = json.loads(fh.read().removeprefix(BOM).decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise UserError(f"{f}: not UTF-8 (byte {e.start}); a JSON array file is read whole") from None
                except json.JSONDecodeError as e:
                    raise UserError(f"{f}: not valid JSON ({e.msg} at line {e.lineno})") from None
                except RecursionError:
                    raise UserError(f"{f}: JSON nested deeper than Python's parser allows") from None
                yield from rows
                return
            for lineno, raw in enumerate(fh, 1):
                if lineno == 1:
                    raw = raw.removeprefix(BOM)
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield InvalidRow("undecodable line", f"{f.name} line {lineno}: not UTF-8 at byte {e.start}")
                    continue
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    row = InvalidRow("invalid JSON", f"{f.name} line {lineno}: {e.msg}")
                except RecursionError:  # e.g. 200,000 nested brackets: one bad row, not a crashed run
                    row = InvalidRow("invalid JSON", f"{f.name} line {lineno}: nested deeper than the parser allows")
                yield row
    elif kind == ".csv":
        import csv
        import io

        with io.TextIOWrapper(_open_binary(f), encoding="utf-8-sig", errors="replace", newline="") as fh:
            for row in csv.DictReader(fh):
                if any("\ufffd" in (v or "") for v in row.values()):
                    yield InvalidRow("undecodable line", f"{f.name}: a row that is not UTF-8")
                    continue
                yield row
    elif f.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(f).iter_batches(batch_size=1024):
            yield from batch.to_pylist()
    elif f.suffix == ".arrow":
        import pyarrow as pa

        try:
            reader = pa.ipc.open_stream(pa.memory_map(str(f)))
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(pa.memory_map(str(f)))
            for i in range(reader.num_record_batches):
                yield from reader.get_batch(i).to_pylist()
            return
        for batch in reader:
            yield from batch.to_pylist()


def _count_or_none(files: list[Path]) -> int | None:
    try:
        return _count(files)
    except (OSError, ValueError):  # an unreadable file is reported when it is read
        return None


def _count(files: list[Path]) -> int | None:
    """Row count for a progress bar, when it is cheap (JSONL line counts, Parquet metadata)."""
    total = 0
    for f in files:
        if f.suffix == ".parquet":
            import pyarrow.parquet as pq

            total += pq.ParquetFile(f).metadata.num_rows
        elif f.suffix == ".jsonl" and f.stat().st_size < (8 << 30):  # blank lines count: a bar estimate
            with open(f, "rb") as fh:
                total += sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 24), b""))
            if f.stat().st_size and not _ends_with_newline(f):
                total += 1
        else:
            return None
    return total


def _ends_with_newline(f: Path) -> bool:
    with open(f, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"
