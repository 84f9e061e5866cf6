"""Launchers: one module per kind of cluster, each turning a recipe into the file that cluster runs.

    databricks   a Databricks AI Runtime workload YAML (`databricks air run -f`)    ftcli.launchers.databricks
    slurm        an sbatch script (`sbatch`)                                          ftcli.launchers.slurm

`compute.launcher` in the recipe picks one (`render-workload --launcher` overrides it); `base.Launcher` is what a
launcher provides, and what all of them share (preflight, install step, YAML writer) is in `ftcli.launchers.base`.
To add a launcher: a module with its `LAUNCHER = Launcher(...)`, its keys under `compute.<name>` in the schema
(`ftcli.config.recipe.ComputeConfig`), one line below.
"""

from __future__ import annotations

from ftcli.config.errors import UserError
from ftcli.launchers import databricks, slurm
from ftcli.launchers.base import Launcher

LAUNCHERS: dict[str, Launcher] = {launcher.name: launcher for launcher in (databricks.LAUNCHER, slurm.LAUNCHER)}


def launcher_named(name: str) -> Launcher:
    if name not in LAUNCHERS:
        raise UserError(f"unknown launcher {name!r}; known: {', '.join(LAUNCHERS)}")
    return LAUNCHERS[name]


def launcher_of_file(text: str) -> Launcher:
    """The launcher whose kind of file `text` is (a script for Slurm, YAML for AI Runtime)."""
    return next(launcher for launcher in LAUNCHERS.values() if launcher.owns(text))
