"""The `eval` section: a held-out loss on a share of the training rows or on separate data, when to run it, early
stopping, which model becomes <run>/final, and the sample prompts generated during training."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ftcli.config.sections.base import Section
from ftcli.config.sections.data import SourceConfig, SourceKind


class EarlyStopConfig(Section):
    patience: int = Field(3, ge=1, description="Evals in a row without an improvement before the run stops.")
    min_delta: float = Field(0.0, ge=0, description="An eval improves when it beats the best by more than this.")


class EvalConfig(Section):
    """A held-out loss: a share of the training rows (`holdout`) or separate data (`path` / `sources`),
    encoded, masked and packed by the training data path. Every source gets its own loss (ftcli.train.evaluate)."""

    enabled: bool = Field(True, description="false turns eval off (the section is kept for later runs); "
                          "`--set eval.enabled=false` on the command line.")
    holdout: float | None = Field(
        None, ge=0, description="Training rows held out for eval: a share (<1, e.g. 0.02) or a row count per "
        "source (>=1), picked by a hash of the row and holdout_seed; training never sees them. 0: none.")
    holdout_seed: int = 0
    source: SourceKind = "local"
    path: str | None = Field(None, description="Separate eval data (same forms as data.path).")
    revision: str | None = None
    split: str = "validation"
    sources: list[SourceConfig] | None = Field(None, description="Separate eval data as a list (data.sources form).")
    max_examples: int | None = Field(None, ge=1, description="Eval rows read (per source).")
    block_len: int | None = Field(None, ge=8, description="Eval block length; default data.packing.block_len.")
    strategy: Literal["bfd", "split", "none"] = Field(
        "bfd", description="bfd (default): no example is cut, so the loss does not depend on the block length; "
        "split: as training's split; none: one example per block.")
    every_steps: int | None = Field(None, ge=1)
    every_minutes: float | None = Field(None, gt=0)
    at_start: bool = Field(False, description="Also evaluate before the first step (step 0).")
    export: Literal["last", "best"] = Field("last", description="What becomes <run>/final: the last or the best model.")
    early_stop: EarlyStopConfig | None = None
    samples: list[str | list[dict[str, Any]]] = Field(
        default_factory=list, description="Prompts (a user message, or a conversation) generated greedily during "
        "training into <run>/samples.jsonl.")
    samples_every: int = Field(1, ge=1, description="Generate the samples every N evals (and at the end).")
    samples_every_steps: int | None = Field(None, ge=1, description="Generate the samples every N steps instead.")
    samples_max_new_tokens: int = Field(32, ge=1)

    @field_validator("holdout")
    @classmethod
    def _no_holdout(cls, v: float | None) -> float | None:
        return None if v == 0 else v  # hold out nothing: no eval data from the training rows

    @model_validator(mode="after")
    def _one_source(self) -> EvalConfig:
        given = [k for k in ("holdout", "path", "sources") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"eval: set one of holdout, path, sources (got {', '.join(given)})")
        if self.holdout is not None and self.holdout >= 1 and self.holdout != int(self.holdout):
            raise ValueError("eval.holdout: a share below 1 (0.02) or a whole row count (200)")
        if not self.has_data and (self.early_stop is not None or self.export == "best"):
            raise ValueError("eval.early_stop / eval.export=best need eval data (eval.holdout, eval.path or eval.sources)")
        return self

    @property
    def has_data(self) -> bool:
        return self.holdout is not None or self.path is not None or self.sources is not None

    def sample_conversations(self) -> list[list[dict[str, Any]]]:
        return [[{"role": "user", "content": s}] if isinstance(s, str) else s for s in self.samples]
