"""The `tracking` section: where MLflow records the run (tracking URI, experiment, run name, system metrics)."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

from ftcli.config.sections.base import Section, plain_text_problem


def _plain_text(v: str | None) -> str | None:
    problem = None if v is None else plain_text_problem(v)
    if problem:
        raise ValueError(problem)
    return v


class TrackingConfig(Section):
    enabled: bool = True
    tracking_uri: str | None = Field(None, description="Default: sqlite:///mlflow.db (or $MLFLOW_TRACKING_URI).")
    experiment: Annotated[str | None, AfterValidator(_plain_text)] = None
    run_name: Annotated[str | None, AfterValidator(_plain_text)] = None
    log_system_metrics: bool = True
