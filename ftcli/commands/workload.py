"""`ftcli render-workload`: render the file a cluster runs for a recipe, or check one (glue over ftcli.launchers).

The launcher is the recipe's `compute.launcher` unless `--launcher` names another; `--check` picks the launcher
from the file (an sbatch script starts with `#!`, an AI Runtime workload is YAML).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ftcli.config.errors import UserError
from ftcli.config.recipe import Recipe, read_text_file
from ftcli.launchers import launcher_named, launcher_of_file


@dataclass(frozen=True)
class Rendered:
    text: str
    warnings: list[str]
    submit: str  # "sbatch {path}"
    what: str  # "sbatch script"


def render(recipe: Recipe, *, fit_check: bool = True) -> Rendered:
    launcher = launcher_named(recipe.compute.launcher)
    text = launcher.render(recipe, fit_check=fit_check)
    return Rendered(text, launcher.warnings(recipe, fit_check=fit_check), launcher.submit, launcher.what)


def check_file(path: Path) -> tuple[str, list[str]]:
    """(what kind of file it is, one line per problem: empty when valid)."""
    try:
        text = read_text_file(Path(path), "workload")
    except UserError as e:
        return "workload", [str(e)]
    launcher = launcher_of_file(text)
    return launcher.what, launcher.check(text)
