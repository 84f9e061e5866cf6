"""Fixtures of the training room's unit tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture
def renames(monkeypatch) -> list[tuple[str, int]]:
    """(destination name, bytes moved) of every rename during the test (os.rename, os.replace, Path.rename: what
    a UC Volume's FUSE mount turns into a server-side copy of that many bytes); `.clear()` it where counting starts."""
    moved, rename, replace = [], os.rename, os.replace

    def size(path) -> int:
        path = Path(path)
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size

    def counted(real):
        def move(src, dst, *args, **kwargs):
            moved.append((Path(dst).name, size(src)))
            return real(src, dst, *args, **kwargs)
        return move

    monkeypatch.setattr(os, "rename", counted(rename))
    monkeypatch.setattr(os, "replace", counted(replace))
    return moved
