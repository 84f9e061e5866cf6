"""Paths inside a recipe: `pkg://assets/...` names a file shipped with ftcli (tiny configs, the tiny tokenizer and
dataset) and stays symbolic in the validated recipe (a recipe rendered into a workload still points at the
installed package there); plain relative paths are made absolute against the recipe file's folder at load time.
Code that opens one calls `resolve_path`."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


PKG_PREFIX = "pkg://"


def resolve_path(value: str | None, base: Path | None = None) -> str | None:
    """`pkg://assets/x` -> the installed file; relative paths -> against `base` (the recipe's folder)."""
    if value is None:
        return None
    if value.startswith(PKG_PREFIX):
        return str(resources.files("ftcli").joinpath(value[len(PKG_PREFIX) :]))
    try:
        path = Path(value).expanduser()
        if base is not None and not path.is_absolute() and (base / path).exists():
            return str((base / path).resolve())
    except (OSError, ValueError, RuntimeError):  # NUL bytes, over-long names, `~nosuchuser`: left as given
        pass
    return value
