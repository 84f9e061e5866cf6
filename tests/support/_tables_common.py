"""What a table must look like at a width (tests/unit/commands/test_tables.py, tests/e2e/test_cli_real_process.py)."""

from __future__ import annotations

WIDTHS = (80, 200)  # a pipe or a narrow terminal, and a wide one


def assert_whole(output: str, headers: tuple[str, ...], width: int) -> None:
    """No cell cut (rich cuts with "…") and every header's words present."""
    assert "…" not in output, next(line for line in output.splitlines() if "…" in line)
    words = set(output.split())
    missing = [h for h in headers if not set(h.split()) <= words]
    assert not missing, (width, missing)
