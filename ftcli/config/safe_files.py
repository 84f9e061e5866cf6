"""Writing inside a run dir (or the pack cache) without writing through links: every file ftcli writes there goes
through here.

A run dir may be shared, or come from someone else; a symlink planted in it (`.ftcli.lock -> ~/notes.txt`,
`metrics.jsonl -> /etc/...`) must never make ftcli truncate, append to or create the file it points at.

    open_append(path)      metrics.jsonl, samples.jsonl: O_APPEND | O_CREAT | O_NOFOLLOW, a regular file
                           with one link only, else a UserError naming it
    write_atomic(path, t)  recipe.yaml, run.json, tracking.json, meta.json ...: a fresh temp file
                           (O_CREAT | O_EXCL | O_NOFOLLOW) renamed over `path`; a `path` that is a link or
                           not a regular file is refused (a rename would replace the link, not follow it,
                           but a link there is not ours to replace)
    write_new(path, t)     a file of a dir that a marker written last commits (a checkpoint's rank_N.json):
                           created (O_CREAT | O_EXCL | O_NOFOLLOW) and written in place, no rename
    open_lock(path)        .ftcli.lock: created with O_EXCL, or an existing regular file opened without
                           following links; (fd, whether this call created it)
    refuse_unsafe(path)    the check alone: a link, or something that is not a regular file, or a file
                           with other hard links, is one UserError
    refuse_links(paths)    before anything is written, renamed or deleted: the first of `paths` (files or
                           directories ftcli will write) that is a symbolic link, or a file with other
                           hard links, is one UserError naming it
    remove_tree(path)      delete a file, a directory or a link without following a link: a link is
                           unlinked (its target stays), shutil.rmtree never follows the links inside
    replace_dir(tmp, dst)  a finished temp dir renamed over `dst` (a dir, or a link: removed, never followed)

The same rule for every dir ftcli writes in: a run dir, the pack cache, an output dir of merge-lora.

Pure file code: no torch, no MLflow.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path
from typing import TextIO

from ftcli.config.errors import UserError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _refusal(path: Path, st: os.stat_result | None) -> str | None:
    """Why ftcli will not write `path` (st: its lstat, None when it does not exist), or None."""
    if st is None:
        return None
    if stat.S_ISLNK(st.st_mode):
        return (f"{path} is a symbolic link (to {os.readlink(path)}); ftcli does not write through links in a "
                "run dir: remove it")
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file; ftcli only writes regular files in a run dir: remove it"
    if st.st_nlink > 1:
        return (f"{path} has {st.st_nlink - 1} other hard link(s); ftcli does not write a file shared with another "
                "path: remove it")
    return None


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # a parent that is a file: nothing there either
        return None


def refuse_unsafe(path: str | Path) -> None:
    """UserError when `path` exists and is a link, not a regular file, or hard-linked elsewhere."""
    path = Path(path)
    why = _refusal(path, _lstat(path))
    if why:
        raise UserError(why)


def refuse_links(paths, where: str = "a run dir", fix: str = "remove it") -> None:
    """UserError naming the first of `paths` that is a symbolic link (dangling or not), or a regular file
    with other hard links: ftcli writes, renames and deletes there, and would reach what the link names.
    Missing paths and real directories pass. Call it before anything is written."""
    for path in map(Path, paths):
        st = _lstat(path)
        if st is None:
            continue
        if stat.S_ISLNK(st.st_mode):
            raise UserError(f"{path} is a symbolic link (to {os.readlink(path)}); ftcli does not write, rename or "
                            f"delete through links in {where}: {fix}")
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            raise UserError(f"{path} has {st.st_nlink - 1} other hard link(s); ftcli does not write, delete or upload "
                            f"a file shared with another path in {where}: {fix}")


def entries(path: str | Path) -> list[Path]:
    """The entries of directory `path`, [] when it is missing, a link or not a directory (never listed through)."""
    st = _lstat(Path(path))
    if st is None or not stat.S_ISDIR(st.st_mode):
        return []
    return sorted(Path(path).iterdir())


def remove_tree(path: str | Path) -> None:
    """Delete `path` without following a link: a link or a file is unlinked (a link's target stays as it
    is), a directory goes with shutil.rmtree (which unlinks the links inside it, never their targets).
    A missing path is nothing to do."""
    path = Path(path)
    st = _lstat(path)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def replace_dir(tmp: str | Path, dst: str | Path) -> None:
    """Move the finished dir `tmp` to `dst`: what is at `dst` (an older dir, a link) is removed first without
    following a link, then `tmp` is renamed in. `tmp` itself must be a real directory (a link planted there
    meanwhile is refused, never moved into place)."""
    tmp, dst = Path(tmp), Path(dst)
    st = _lstat(tmp)
    if st is None or not stat.S_ISDIR(st.st_mode):
        refuse_links([tmp])
        raise UserError(f"{tmp} is not a directory; ftcli expected its own temp dir there")
    remove_tree(dst)
    os.replace(tmp, dst)


def _open_checked(path: Path, flags: int, mode: int = 0o644) -> int:
    """os.open with O_NOFOLLOW, then the same checks on what was opened (fstat: no race with a swap)."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | _CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a link at the last component
            refuse_unsafe(path)
        raise
    why = _refusal(path, os.fstat(fd))
    if why:
        os.close(fd)
        raise UserError(why)
    os.set_blocking(fd, True)
    return fd


def open_append(path: str | Path, encoding: str = "utf-8") -> TextIO:
    """`open(path, "a")` that refuses a link, a non-regular file or a hard-linked one (module doc)."""
    fd = _open_checked(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return os.fdopen(fd, "a", encoding=encoding)


def write_atomic(path: str | Path, text: str) -> None:
    """Replace `path` with `text` through a temp file beside it (never a half-written file)."""
    path = Path(path)
    refuse_unsafe(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if _lstat(tmp) is not None:  # left by a crash, or planted: unlink removes the entry, never its target
        tmp.unlink()
    fd = _open_checked(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write_new(path: str | Path, text: str) -> None:
    """Create `path` (it must not exist) and write `text` into it, without a rename: for a file whose dir is
    committed by a marker written after it, where a rename would only cost (a copy on a UC Volume)."""
    fd = _open_checked(Path(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def open_lock(path: str | Path) -> tuple[int, bool]:
    """(a read-write fd on the lock file, created): a new file (O_EXCL), or the regular one already there
    (a failed or finished start's), opened without following a link. Nothing is truncated here."""
    path = Path(path)
    refuse_unsafe(path)
    try:
        return _open_checked(path, os.O_RDWR | os.O_CREAT | os.O_EXCL), True
    except FileExistsError:
        return _open_checked(path, os.O_RDWR), False


# ------------------------------------------------------------------------------------ a command's --output
def check_output_path(output: Path, force: bool, example: str | None = None) -> None:
    """A command's output file (`generate -o`, `render-workload -o`, `recipes cp DEST`, `pack-preview --dump`)
    before anything runs: a file in an existing folder; an existing file or a symbolic link (dangling or not:
    ftcli did not write it) only with --force, which replaces the link (`open_output`), never its target.
    `example`: a file name to suggest when `output` is a folder."""
    if output.is_symlink():
        if not force:
            raise UserError(f"{output} is a symbolic link (to {os.readlink(output)}); pass --force to replace the "
                            "link (its target is left alone)")
        return
    if output.is_dir():
        raise UserError(f"{output} is a folder; give a file path{f', e.g. {output / example}' if example else ''}")
    parent = output.parent
    if parent.exists() and not parent.is_dir():
        raise UserError(f"cannot write {output}: {parent} is not a folder")
    if not parent.exists():
        raise UserError(f"cannot write {output}: {parent} does not exist; create it first (mkdir -p {parent})")
    if output.exists() and not force:
        raise UserError(f"{output} exists; pass --force to overwrite it")


def open_output(output: Path) -> TextIO:
    """`open(output, "w")` for a command's output file, checked before (an existing file or a link only with
    --force): a link there is replaced by the file, never written through. OSError as open's."""
    if output.is_symlink():
        output.unlink()
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW | _CLOEXEC, 0o644)
    return os.fdopen(fd, "w", encoding="utf-8")


def write_output(output: Path, text: str) -> None:
    """`text` into `output` (checked by check_output_path): a link there is replaced, never followed."""
    try:
        with open_output(output) as f:
            f.write(text)
    except OSError as e:
        raise UserError(f"cannot write {output}: {e.strerror or e}") from None
