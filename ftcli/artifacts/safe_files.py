"""Writing inside a run dir without writing through links: every file ftcli writes there goes through here.

A run dir may be shared, or come from someone else; a symlink planted in it (`.ftcli.lock -> ~/notes.txt`,
`metrics.jsonl -> /etc/...`) must never make ftcli truncate, append to or create the file it points at.

    open_append(path)      metrics.jsonl, samples.jsonl: O_APPEND | O_CREAT | O_NOFOLLOW, a regular file
                           with one link only, else a UserError naming it
    write_atomic(path, t)  recipe.yaml, run.json, tracking.json, meta.json ...: a fresh temp file
                           (O_CREAT | O_EXCL | O_NOFOLLOW) renamed over `path`; a `path` that is a link or
                           not a regular file is refused (a rename would replace the link, not follow it,
                           but a link there is not ours to replace)
    open_lock(path)        .ftcli.lock: created with O_EXCL, or an existing regular file opened without
                           following links; (fd, whether this call created it)
    refuse_unsafe(path)    the check alone: a link, or something that is not a regular file, or a file
                           with other hard links, is one UserError

Pure file code: no torch, no MLflow.
"""

from __future__ import annotations

import errno
import os
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
    except FileNotFoundError:
        return None


def refuse_unsafe(path: str | Path) -> None:
    """UserError when `path` exists and is a link, not a regular file, or hard-linked elsewhere."""
    path = Path(path)
    why = _refusal(path, _lstat(path))
    if why:
        raise UserError(why)


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
def check_output_path(output: Path, force: bool, example: str) -> None:
    """--output before anything runs: a file in an existing folder; an existing file or a symbolic link
    (dangling or not: ftcli did not write it) only with --force, which replaces the link, not its target."""
    if output.is_symlink():
        if not force:
            raise UserError(f"{output} is a symbolic link (to {os.readlink(output)}); pass --force to replace the "
                            "link with the output (its target is left alone)")
        return
    if output.is_dir():
        raise UserError(f"--output {output} is a folder; pass a file path, e.g. {output / example}")
    if not output.parent.is_dir():
        what = "is not a folder" if output.parent.exists() else "does not exist"
        raise UserError(f"--output {output}: the folder {output.parent} {what}; create it first")
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
        raise UserError(f"--output {output}: cannot write it ({e.strerror or e})") from None
