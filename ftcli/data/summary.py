"""The data summary: one object, shown by `pack-preview`, printed by `train`, stored in run.json and MLflow.

    summary = data_summary(recipe, packed)      # after prepare_blocks / open_prepared
    summary.lines()                             # the printed table, one "label: value" line per row
    summary.to_dict()                           # JSON for run.json (`pack-preview --json` prints the same)
    summary.metrics()                           # flat numbers for MLflow (data/...)

Every count comes from `DataStats` (written once, when the blocks were packed) and the packed blocks
themselves; nothing is recounted differently in two places.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ftcli.data import sources
from ftcli.data.spec import data_spec
from ftcli.data.stats import DataStats


@dataclass
class SourceSummary:
    rows_read: int
    kept: int
    skipped: int
    skipped_by_reason: dict[str, int]
    truncated: int
    tokens: int  # of the kept examples (per example, before packing)
    trained_tokens: int
    trained_tokens_lost: int  # to truncation and overlong drops
    dropped_turns: dict[str, int]
    special_tokens_in_text: int
    format: str = ""  # the row format read (auto: the detected one)
    format_why: str = ""  # auto: why
    origin: dict[str, Any] | None = None  # where the rows come from (ftcli.data.sources.origin): kind, path, revision,
    # split, digest; what run.json's data_sources and MLflow's dataset inputs record


@dataclass
class DataSummary:
    recipe: str
    cache: str
    from_cache: bool
    strategy: str
    block_len: int | None
    blocks: int
    fill_pct: float
    segments_per_block: dict[str, float]
    tokens: int
    padding_tokens: int
    trained_tokens: int  # what the loss averages over: labels[1:] != -100 summed over the blocks
    trained_pct: float
    examples: dict[str, int]
    skipped_by_reason: dict[str, dict[str, Any]]
    trained_tokens_lost: dict[str, int]  # truncation, overlong
    dropped_turns: dict[str, int]
    special_tokens_in_text: dict[str, Any]
    sources: dict[str, SourceSummary] = field(default_factory=dict)
    pipeline_seconds: float = 0.0
    tokens_per_second: float = 0.0
    blocks_without_trained: int = 0  # packed, then dropped: no token of theirs gets loss

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) rows of the summary table (`pack-preview` and the train log)."""
        seg, ex, lost = self.segments_per_block, self.examples, self.trained_tokens_lost
        out = [
            ("blocks", f"{self.blocks} x {self.block_len or 'variable'} tokens ({self.strategy})"),
            ("fill", f"{self.fill_pct:.2f}% ({self.padding_tokens} padding tokens)"),
            ("segments per block", f"mean {seg['mean']:.2f}, min {seg['min']}, max {seg['max']}"),
            ("trained tokens", f"{self.trained_tokens} of {self.tokens} ({self.trained_pct:.2f}%)"),
            ("examples", f"read {ex['read']}, kept {ex['kept']}, skipped {ex['skipped']}"),
            ("truncated / split", f"{ex['truncated']} / {ex['split']}"),
            ("trained tokens lost", f"{lost['truncation']} to truncation, {lost['overlong']} to overlong drops"),
        ]
        if len(self.sources) == 1:
            s = next(iter(self.sources.values()))
            out.append(("format", f"{s.format} ({s.format_why})" if s.format_why else s.format))
        if self.blocks_without_trained:
            out.append(("  dropped blocks", f"{self.blocks_without_trained} with no trained token (not in blocks)"))
        for reason, r in self.skipped_by_reason.items():
            out.append((f"  skipped: {reason}", f"{r['count']} (first rows {', '.join(map(str, r['first_rows']))})"))
        for reason, n in self.dropped_turns.items():
            out.append((f"  dropped: {reason}", f"{n} (the rest of each row is kept)"))
        sp = self.special_tokens_in_text
        if sp["strings"]:
            where = f"{sp['strings']} in {sp['rows']} rows (data.special_tokens_in_text={sp['mode']})"
            out.append(("special tokens in text", where))
        if len(self.sources) > 1:
            short = short_labels(self.sources)
            for label, s in self.sources.items():
                out.append((
                    f"  source {short[label]}",
                    f"format {s.format}{f' ({s.format_why})' if s.format_why else ''}, rows {s.rows_read}, "
                    f"kept {s.kept}, skipped {s.skipped}, tokens {s.tokens}, "
                    f"trained {s.trained_tokens}, lost {s.trained_tokens_lost}",
                ))
        cached = " (cached result; this run only read it)" if self.from_cache else ""
        out.append(("pipeline", f"{self.pipeline_seconds:.2f} s, {self.tokens_per_second:,.0f} tokens/s{cached}"))
        out.append(("cache", self.cache))
        return out

    def lines(self) -> list[str]:
        return [f"{label}: {value}" for label, value in self.rows()]

    def metrics(self) -> dict[str, float]:
        """Flat numbers for MLflow: data/<name>, and data/source/<label>/<name> for each source."""
        out = {
            "data/blocks": self.blocks, "data/tokens": self.tokens, "data/trained_tokens": self.trained_tokens,
            "data/padding_tokens": self.padding_tokens, "data/fill_pct": self.fill_pct,
            "data/examples_read": self.examples["read"], "data/examples_kept": self.examples["kept"],
            "data/examples_skipped": self.examples["skipped"], "data/examples_truncated": self.examples["truncated"],
            "data/trained_tokens_lost": sum(self.trained_tokens_lost.values()),
            "data/special_tokens_in_text": self.special_tokens_in_text["strings"],
            "data/blocks_without_trained": self.blocks_without_trained,
        }
        for label, s in self.sources.items():
            key = re.sub(r"[^A-Za-z0-9_.\- ]", "_", label)[-100:]
            for name in ("rows_read", "kept", "skipped", "tokens", "trained_tokens", "trained_tokens_lost"):
                out[f"data/source/{key}/{name}"] = getattr(s, name)
        return {k: float(v) for k, v in out.items()}


def short_labels(labels) -> dict[str, str]:
    """Each source label -> the shortest trailing part of its path that no other label ends with
    (`/tmp/new/a.jsonl` -> `a.jsonl`; `/x/a/data.jsonl`, `/y/b/data.jsonl` -> `a/data.jsonl`, `b/data.jsonl`),
    so tables name sources by what tells them apart, not by a common prefix cut at the column width. A
    `data.sources` name has no `/` and stays as it is."""
    labels = list(labels)
    parts = {label: [p for p in re.split(r"/+", label.split("://", 1)[-1]) if p] or [label] for label in labels}
    out = {}
    for label in labels:
        for n in range(1, len(parts[label]) + 1):
            tail = parts[label][-n:]
            if not any(other != label and parts[other][-n:] == tail for other in labels):
                break
        out[label] = "/".join(tail)
    return out


def _source_summary(st: DataStats, origin: dict[str, Any] | None) -> SourceSummary:
    return SourceSummary(origin=origin,
        rows_read=st.examples_read, kept=st.examples_kept, skipped=st.examples_skipped,
        skipped_by_reason=dict(sorted(st.skipped.items())), truncated=st.truncated, tokens=st.tokens,
        trained_tokens=st.trained_tokens, trained_tokens_lost=st.trained_tokens_lost,
        dropped_turns=dict(st.dropped_turns), special_tokens_in_text=st.special_tokens_in_text,
        format=st.format, format_why=st.format_why,
    )


def data_summary(spec, packed) -> DataSummary:
    """The summary of a prepared dataset (`PackedDataset`) for this data spec (or a recipe's training data)."""
    spec = data_spec(spec)
    stats = packed.stats
    n = len(packed)
    segs = np.asarray([len(packed.segments(i)) for i in range(n)], dtype=np.int64)
    capacity = n * packed.block_len if packed.block_len else stats.tokens
    trained = int(packed.block_trained.sum()) if n else 0
    data = spec.data
    origins = {src.label: sources.origin(src, spec.holdout) for src in data.source_list()}
    return DataSummary(
        recipe=spec.name,
        cache=str(packed.path),
        from_cache=packed.from_cache,
        strategy=data.packing.strategy if data.packing.enabled else "none",
        block_len=packed.block_len,
        blocks=n,
        fill_pct=round(100.0 * stats.tokens / capacity, 2) if capacity else 0.0,
        segments_per_block={
            "mean": round(float(segs.mean()), 3) if n else 0.0,
            "min": int(segs.min()) if n else 0,
            "max": int(segs.max()) if n else 0,
        },
        tokens=stats.tokens,
        padding_tokens=stats.padding_tokens,
        trained_tokens=trained,
        trained_pct=round(100.0 * trained / stats.tokens, 2) if stats.tokens else 0.0,
        examples={
            "read": stats.examples_read,
            "kept": stats.examples_kept,
            "skipped": stats.examples_skipped,
            "truncated": stats.truncated,
            "split": stats.split,
            "zero_trained": stats.zero_trained,
        },
        skipped_by_reason={
            reason: {"count": count, "first_rows": stats.first_skipped.get(reason, [])}
            for reason, count in sorted(stats.skipped.items())
        },
        trained_tokens_lost={"truncation": stats.trained_lost_truncation, "overlong": stats.trained_lost_overlong},
        dropped_turns=dict(sorted(stats.dropped_turns.items())),
        special_tokens_in_text={
            "strings": stats.special_tokens_in_text, "rows": stats.rows_with_special_tokens,
            "mode": data.special_tokens_in_text,
        },
        sources={label: _source_summary(st, origins.get(label)) for label, st in stats.sources.items()},
        pipeline_seconds=round(stats.seconds, 3),
        tokens_per_second=round(stats.tokens_per_second, 1),
        blocks_without_trained=stats.blocks_without_trained,
    )
