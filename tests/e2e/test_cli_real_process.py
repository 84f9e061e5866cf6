"""The CLI through a real process (`python -m ftcli`: a real stderr, rich's real console sized by COLUMNS): the
nastiest malformed recipes are one error line, and the `recipes list` and `doctor` tables read at 80 and 200 columns
(no cell cut, every header whole). Each call starts a fresh interpreter (about 1 s), so they live here; the same
errors in-process: tests/unit/test_cli_errors.py, the other tables: tests/unit/commands/test_tables.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _tables_common import WIDTHS, assert_whole

RECIPES_LIST = ("name", "method", "compute", "model")
DOCTOR = ("package", "version", "model_type", "op", "backend", "why", "check", "status", "detail")


def test_real_process_prints_no_traceback(recipe_corpus):
    """The corpus's nastiest files through `python -m ftcli` (a real stderr, rich's real console): one line, no
    traceback."""
    for case in ("binary-random", "latin-1-text", "alias-bomb-in-config-overrides", "deep-flow-list"):
        proc = subprocess.run(
            [sys.executable, "-m", "ftcli", "recipes", "show", str(recipe_corpus / f"{case}.yaml")],
            capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "80"},
        )
        assert proc.returncode == 2 and proc.stdout == "", (case, proc.stderr)
        assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("error: "), (case, proc.stderr)


def _ftcli(args: list[str], width: int) -> str:
    env = {**os.environ, "COLUMNS": str(width), "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, "-m", "ftcli", *args], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode in (0, 1), res.stderr  # doctor exits 1 where the recipe cannot run (this CPU machine)
    return res.stdout


@pytest.mark.parametrize("width", WIDTHS)
def test_recipes_list_headers_whole(width):
    assert_whole(_ftcli(["recipes", "list"], width), RECIPES_LIST, width)


def test_recipes_list_is_one_line_per_recipe_at_80_columns():
    """138 lines with words split mid-word before: now a row per recipe, every model id whole."""
    from ftcli.config.recipe import builtin_recipe_names, load_recipe

    lines = _ftcli(["recipes", "list"], 80).splitlines()
    names = builtin_recipe_names()
    assert len(lines) == len(names) + 3 and all(len(line) <= 80 for line in lines)  # header, rule, rows, the hint
    for name, line in zip(names, lines[2:]):
        r = load_recipe(name)
        assert line.split()[:2] == [name, r.training.method] and (r.model.id or r.model.model_type) in line


@pytest.mark.parametrize("width", WIDTHS)
def test_doctor_headers_whole(width):
    assert_whole(_ftcli(["doctor", "--recipe", "tiny-qwen-cpu"], width), DOCTOR, width)
