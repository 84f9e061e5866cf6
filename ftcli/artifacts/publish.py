"""A model dir published in place: its files written where they stay, one small record last.

    final/                    (or best/, an adapter dir)
      ftcli_export.json       {"complete": false} first; replaced last (a small temp file renamed over it) by
                              {"complete": true, "files": {name: size}}
      config.json, model-00001-of-00002.safetensors, ...   written in place, never renamed

No large file is renamed: on a Unity Catalog Volume (`/Volumes/...`, a FUSE mount over object storage) a
rename is a server-side copy whose cost scales with the bytes moved, so the old way (write `.tmp_final/`,
rename it to `final/`) copied the whole model once more. An earlier export at the same path loses its
record first, then its files: a kill at any point leaves a dir whose record says incomplete, which every
reader refuses (`export_problem`), never a mix that looks whole. A dir without the record (an older ftcli,
a model from elsewhere) is read as before. A whole export is published at another path by copying
(`copy_export`: LoRA's best adapter becoming the final one), never by renaming its dir.

Pure file code: no torch, no MLflow.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ftcli.config.errors import UserError
from ftcli.config.safe_files import entries, refuse_links, remove_tree, write_atomic

EXPORT_RECORD = "ftcli_export.json"


def begin_export(out_dir: Path) -> None:
    """Before the first file of an export is written: `out_dir` exists, holds only a record that says
    incomplete (an earlier export there is unpublished, then removed; a link planted there is unlinked, never
    written through)."""
    out_dir = Path(out_dir)
    if out_dir.is_symlink():
        out_dir.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    unpublish_export(out_dir)  # before anything goes
    _remove_all_but_record(out_dir)


def unpublish_export(out_dir: Path) -> None:
    """The record says incomplete: from now on every reader refuses the dir (an export about to change)."""
    write_atomic(Path(out_dir) / EXPORT_RECORD, json.dumps({"complete": False}) + "\n")


def publish_export(out_dir: Path) -> None:
    """The export's last write: the record with every file's size (relative paths), marked complete."""
    out_dir = Path(out_dir)
    files = {p.relative_to(out_dir).as_posix(): p.stat().st_size for p in sorted(out_dir.rglob("*"))
             if p.is_file() and p.name != EXPORT_RECORD and not p.name.startswith(f".{EXPORT_RECORD}")}
    write_atomic(out_dir / EXPORT_RECORD, json.dumps({"complete": True, "files": files}, indent=1) + "\n")


def copy_export(src: Path, out_dir: Path) -> None:
    """`src`, a whole export, published again at `out_dir` by the same protocol: `out_dir` unpublished first, the
    files `src`'s record lists (every file of a dir without one) copied in place, the record last. Checked before
    anything at `out_dir` goes: `src` is whole (`export_problem`) and no file to copy is a link. A copy moves the
    bytes once, as a rename on a Volume does, but a kill midway leaves `out_dir` unpublished, never half of one;
    a write error removes what was copied (`remove_export`) and propagates."""
    src, out_dir = Path(src), Path(out_dir)
    refuse_links([src], where="an export", fix="export it again")
    if (problem := export_problem(src)) is not None:
        raise UserError(f"{src} is not a whole export, so it is not copied to {out_dir}: {problem}")
    record = src / EXPORT_RECORD
    names = sorted(json.loads(record.read_text(encoding="utf-8"))["files"]) if record.is_file() else \
        [p.relative_to(src).as_posix() for p in sorted(src.rglob("*")) if p.is_file() or p.is_symlink()]
    refuse_links([*(src / name for name in names)], where="an export", fix="export it again")
    begin_export(out_dir)
    try:
        for name in names:
            (out_dir / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / name, out_dir / name)
    except OSError:
        remove_export(out_dir)  # a full disk: nothing half-copied left as if whole; `src` untouched
        raise
    publish_export(out_dir)


def remove_export(out_dir: Path, *, keep_dir: bool = False) -> None:
    """An export that failed (its record says incomplete since `begin_export`): every other file first, the record
    last, so a kill or an error midway leaves a dir every reader refuses, never files without a record (read as an
    older ftcli's whole export); then the dir itself unless `keep_dir`. A cleanup that fails stops quietly (the
    error that made it is the one to report)."""
    out_dir = Path(out_dir)
    if out_dir.is_symlink():
        out_dir.unlink()
        return
    try:
        _remove_all_but_record(out_dir)
        (out_dir / EXPORT_RECORD).unlink(missing_ok=True)
        if not keep_dir and out_dir.is_dir():
            out_dir.rmdir()
    except OSError:
        pass


def _remove_all_but_record(out_dir: Path) -> None:
    for entry in entries(out_dir):
        if entry.name != EXPORT_RECORD:
            remove_tree(entry)


def export_problem(model_dir: Path) -> str | None:
    """Why `model_dir` is not a whole export, as a phrase, or None: its record says incomplete (a save in
    progress, or one a crash stopped), or a file it lists is missing or has another size. A dir without the
    record is not checked."""
    path = Path(model_dir) / EXPORT_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"its {EXPORT_RECORD} cannot be read ({e})"
    if not isinstance(record, dict) or record.get("complete") is not True or not isinstance(record.get("files"), dict):
        return f"its {EXPORT_RECORD} says the export is incomplete (a save in progress, or one a crash stopped)"
    for name, size in record["files"].items():
        file = Path(model_dir) / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, the export wrote {size}"
    return None
