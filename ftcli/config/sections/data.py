"""The `data` section: the datasets read (`data.sources`, each a `SourceConfig`; the single-source keys of `data`
are the shorthand for one entry), how rows are read and encoded, and how they are packed (`data.packing`)."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, model_serializer, model_validator

from ftcli.config.rowfilter import RowFilter
from ftcli.config.sections.base import Section


class PackingConfig(Section):
    enabled: bool = True
    block_len: int = Field(32768, ge=8, description="Tokens per packed block.")
    strategy: Literal["split", "bfd"] = Field(
        "split", description="split: cut at the block edge (the published Databricks examples); bfd: best-fit decreasing, no splits."
    )
    bfd_buffer: int = Field(1024, ge=1, description="Examples buffered per best-fit-decreasing round.")
    overlong: Literal["truncate", "drop"] = Field("truncate", description="bfd: example longer than a block.")


class SyntheticData(Section):
    """Random token conversations with a realistic length spread (benchmarks)."""

    num_examples: int = Field(20000, ge=1)
    mean_tokens: int = Field(1200, ge=2)
    max_tokens: int = Field(16384, ge=2)
    prompt_fraction: float = Field(0.3, ge=0.0, le=1.0)
    seed: int = 0


SourceKind = Literal["hub", "local", "synthetic", "delta"]  # delta: ftcli.data.delta


def _revision_text(value: Any) -> Any:
    """YAML reads `revision: 12` as an int and an unquoted timestamp as a datetime: both kept as text."""
    import datetime

    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value.isoformat() if isinstance(value, (datetime.datetime, datetime.date)) else value


Revision = Annotated[str | None, BeforeValidator(_revision_text)]  # a hub commit; a delta version or timestamp
SpecialTokensInText = Literal["keep", "escape", "error"]
# ftcli.data.formats; `preference`: chosen/rejected rows in any form ftcli.data.preference reads (auto detects it too)
DataFormat = Literal["auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text", "preference"]


class SourceConfig(Section):
    """One dataset of a mix (`data.sources`). Fields left unset take the value of the same key in `data`."""

    name: str | None = Field(None, description="Label in pack-preview and run.json; default: the path.")
    source: SourceKind = "hub"
    path: str | None = Field(
        None, description="Hub dataset id, or a local file/dir (JSONL, Parquet, CSV, Arrow; a UC volume is a path); "
        "delta: a table path or a Unity Catalog name catalog.schema.table."
    )
    revision: Revision = Field(None, description="hub: a commit; delta: a table version (12) or an ISO-8601 "
                               "timestamp (2026-12-01T00:00:00Z).")
    split: str = "train"
    streaming: bool = False
    columns: list[str] | None = Field(None, description="delta: read only these columns (default: all).")
    filter: RowFilter = Field(None, description="delta: read only the rows where [[column, op, value], ...] holds "
                              "(ftcli.config.rowfilter).")
    format: DataFormat | None = None
    messages_field: str | None = None
    tools_field: str | None = None
    max_examples: int | None = Field(None, ge=1, description="Rows read from this source (before weighting).")
    synthetic: SyntheticData = Field(default_factory=SyntheticData)
    weight: float = Field(
        1.0, gt=0, description="Times each row is used: 2 = every row twice (epochs-style), 0.5 = a seeded half, "
        "1.5 = every row once plus a seeded half again (data.mix_seed)."
    )

    @model_validator(mode="after")
    def _path(self) -> SourceConfig:
        if self.source != "synthetic" and not self.path:
            raise ValueError(f"a data.sources entry with source={self.source} needs a path")
        _check_delta_keys(self)
        return self

    @property
    def label(self) -> str:
        return self.name or (self.path if self.source != "synthetic" else "synthetic")


def parse_delta_revision(revision: str | int | None):
    """A delta source's `revision` (ftcli.data.delta): a table version (an integer >= 0, as int) or an ISO-8601
    timestamp with its time zone (as datetime); None: the newest version. Else ValueError."""
    from datetime import datetime

    if revision is None:
        return None
    text = str(revision).strip()
    if text.isdigit():
        return int(text)
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"revision {revision!r} of a delta source: a table version (12) or an ISO-8601 timestamp "
                         "(2026-12-01T00:00:00Z)") from None
    if when.tzinfo is None:
        raise ValueError(f"revision {revision!r} of a delta source: give the timestamp's time zone (...Z or +00:00)")
    return when


def _check_delta_keys(src) -> None:
    """A delta source's revision is a version or a timestamp; `columns` and `filter` belong to delta sources only."""
    if src.source == "delta":
        parse_delta_revision(src.revision)
    elif src.columns is not None or src.filter is not None:
        key, what = ("columns", "columns") if src.columns is not None else ("filter", "row filter")
        raise ValueError(f"{key} is for source=delta (a Delta table's {what}), not source={src.source}")


class DataConfig(Section):
    quiet_defaults: ClassVar[dict[str, Any]] = {"tools_field": "tools", "special_tokens_in_text": "keep",
                                                "sources": None, "mix_seed": 0, "allow_empty_sources": False,
                                                "max_row_chars": None, "columns": None}
    source: SourceKind = "hub"
    path: str | None = Field(None, description="Hub dataset id, or a local file/dir (JSONL, Parquet, CSV, Arrow); "
                             "delta: a table path or a Unity Catalog name catalog.schema.table.")
    revision: Revision = Field(None, description="hub: a commit; delta: a table version or an ISO-8601 timestamp.")
    split: str = "train"
    streaming: bool = False
    columns: list[str] | None = Field(None, description="delta: read only these columns (default: all).")
    filter: RowFilter = Field(None, description="delta: read only the rows where [[column, op, value], ...] holds "
                              "(ftcli.config.rowfilter).")
    format: DataFormat = Field(
        "auto", description="Row format: auto (detected from the first rows), messages, sharegpt, alpaca, "
        "prompt_completion, text (ftcli.data.formats)."
    )
    messages_field: str = "messages"
    tools_field: str | None = Field(
        "tools", description="Row field with function schemas, passed to the template as tools=."
    )
    sources: list[SourceConfig] | None = Field(
        None, description="The datasets read, each with its own fields and weight (a mix); source/path/revision/split/"
        "streaming/synthetic above are the shorthand for one entry (give one form, not both)."
    )
    mix_seed: int = Field(0, description="Seed of the fractional part of data.sources weights.")
    chat_template: str | None = Field(None, description="Jinja file overriding the tokenizer's template.")
    train_on: Literal["assistant", "all", "last"] = Field("assistant", description="Which turns get loss.")
    strict: bool = Field(False, description="Stop at the first bad row instead of skipping and counting it.")
    allow_empty_sources: bool = Field(
        False, description="Train although a source keeps no row (or under 1% of its rows); default: refused before launch."
    )
    # keep (default): a special-token string a user typed (`<|im_end|>`) is tokenized as the characters it
    # is, never as the control token: the text reaches the model unchanged and cannot end a turn or fake
    # a role. escape: a zero-width space after its first character (the text changes, visibly to a
    # decoder). error: the row is skipped and counted (strict: stops). Counted in every mode. (With a
    # tokenizer ftcli cannot cut at its added tokens, e.g. a SentencePiece one, keep tokenizes as escape.)
    special_tokens_in_text: SpecialTokensInText = Field(
        "keep", description="keep: tokenize as plain text; escape: break with a zero-width space; error: skip the row."
    )
    max_examples: int | None = Field(None, ge=1, description="Rows read (per source with data.sources).")
    max_length: int | None = Field(None, ge=2, description="Truncate each example to this many tokens (counted as truncated).")
    max_row_chars: int | None = Field(
        None, ge=1, description="Skip (and count) rows with more characters, before tokenizing; default 64 x the "
        "block length (data.max_length when packing is off and it is set).")
    packing: PackingConfig = Field(default_factory=PackingConfig)
    synthetic: SyntheticData = Field(default_factory=SyntheticData)
    num_workers: int = Field(0, ge=0)
    cache_dir: str | None = Field(None, description="Tokenize/pack cache; default ~/.cache/ftcli or $FTCLI_CACHE.")

    # The one-source shorthand: these keys describe the single entry of `sources` (`shorthand_source`).
    SHORTHAND: ClassVar[tuple[str, ...]] = ("source", "path", "revision", "split", "streaming", "columns", "filter",
                                            "synthetic")

    @model_validator(mode="wrap")
    @classmethod
    def _normal_form(cls, data: Any, handler) -> DataConfig:
        """`sources` is the one form every reader sees: the shorthand becomes its single entry; a shorthand key
        that differs from its default next to `sources` is refused (the two forms would disagree)."""
        out = handler(data)  # every key checked where it is written
        if out.sources is None:
            if out.source != "synthetic" and not out.path:
                raise ValueError(f"data.source={out.source} needs data.path")
            return out.model_copy(update={"sources": [out.shorthand_source()]})
        if out.one_source:  # the shorthand already in its normal form (an assignment validates the section again)
            return out
        given = [k for k in cls.SHORTHAND if getattr(out, k) != cls.model_fields[k].get_default(call_default_factory=True)
                 and not (k == "source" and out.path is None and out.source != "synthetic")]  # a kind alone names no data
        if given:
            # what drops the shorthand (a kind alone, without a path, is none)
            defaults = {k: cls.model_fields[k].default for k in given
                        if k != "synthetic" and (k != "source" or out.source == "synthetic")}
            unset = " ".join(f"--set data.{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in defaults.items())
            raise ValueError(f"data.sources and {', '.join('data.' + k for k in given)} are both set; those keys are "
                             "the shorthand for a single data.sources entry: keep one form"
                             + (f" ({unset} drops the shorthand)" if unset else ""))
        if not out.sources:
            raise ValueError("data.sources is empty; list at least one source (or use data.path)")
        labels = [s.label for s in out.sources]
        if len(set(labels)) != len(labels):
            raise ValueError("data.sources: two sources have the same name/path; give them distinct names")
        return out

    def shorthand_source(self) -> SourceConfig:
        """The `sources` entry the one-source keys describe."""
        return SourceConfig(source=self.source, path=self.path, revision=self.revision, split=self.split,
                            streaming=self.streaming, columns=self.columns, filter=self.filter, synthetic=self.synthetic)

    @property
    def one_source(self) -> bool:
        """Whether `sources` is what the one-source shorthand describes (dumps then write the shorthand, as given)."""
        described = self.source == "synthetic" or bool(self.path)
        return described and self.sources == [self.shorthand_source()]

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        out = handler(self)
        if self.one_source:
            out["sources"] = None
        return self._without_quiet_defaults(out)

    def source_list(self) -> list[SourceConfig]:
        """The sources to read (`data.sources`, the shorthand's single entry included), with unset per-source fields
        filled from `data`."""
        return [
            s.model_copy(update={
                "format": s.format or self.format,
                "messages_field": s.messages_field or self.messages_field,
                "tools_field": s.tools_field if s.tools_field is not None else self.tools_field,
            })
            for s in self.sources or [self.shorthand_source()]
        ]
