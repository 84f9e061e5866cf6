"""The `output` section: the run directory (`Recipe.output_dir` fills in the recipe name)."""

from __future__ import annotations

from pydantic import Field

from ftcli.config.sections.base import Section


class OutputConfig(Section):
    dir: str = Field("runs/{name}", description="Run directory; {name} is the recipe name.")
