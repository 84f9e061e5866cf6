"""What the data pipeline read, kept, skipped (and why), truncated and split: reported, never silent."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

FIRST_INDICES = 5  # row indices remembered per skip reason
POLICY_REASONS = ("longer than block",)  # skips a recipe asks for (not bad data; never fatal in strict mode)


@dataclass
class DataStats:
    examples_read: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    first_skipped: dict[str, list[int]] = field(default_factory=dict)  # reason -> first row indices
    first_detail: dict[str, str] = field(default_factory=dict)  # reason -> what was wrong with the first row
    truncated: int = 0  # kept examples cut to data.max_length, or to the block (bfd, overlong=truncate)
    split: int = 0  # examples cut across blocks (strategy=split)
    # Each example is counted once: one cut and then skipped for zero trained tokens is a skip only.
    trained_lost_truncation: int = 0  # trained tokens cut off by truncation (kept and skipped examples)
    trained_lost_overlong: int = 0  # trained tokens of examples dropped as longer than a block
    dropped_turns: dict[str, int] = field(default_factory=dict)  # turns (tool calls) dropped from kept rows
    rows_with_dropped_turns: int = 0
    special_tokens_in_text: int = 0  # special-token strings found in message text (data.special_tokens_in_text)
    rows_with_special_tokens: int = 0
    tokens: int = 0  # tokens of the kept examples, as packed
    trained_tokens: int = 0  # loss tokens in the blocks (labels[1:] != -100, summed over blocks)
    blocks: int = 0
    pairs: int = 0  # preference pairs in the blocks (0 for SFT data)
    blocks_without_trained: int = 0  # packed blocks dropped: no token of theirs gets loss (not in `blocks`)
    padding_tokens: int = 0
    seconds: float = 0.0  # tokenize + mask + pack wall time
    format: str = ""  # a source's row format (data.format; auto: the detected one, ftcli.data.formats)
    format_why: str = ""  # auto: why that format ("auto: 32 of the first 32 rows have ...")
    # Per source (label -> the same counts for its rows; tokens/trained_tokens counted per example, as the
    # loss sees an unsplit example: its first label unused). One entry for a single-source recipe.
    sources: dict[str, DataStats] = field(default_factory=dict)

    def source(self, label: str) -> DataStats:
        if label not in self.sources:
            self.sources[label] = DataStats()
        return self.sources[label]

    def skip(self, index: int, reason: str, detail: str = "") -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.first_detail.setdefault(reason, detail)
        first = self.first_skipped.setdefault(reason, [])
        if len(first) < FIRST_INDICES:
            first.append(index)

    def note(self, dropped: dict[str, int], special_tokens: int) -> None:
        """What was changed in a row that is kept: dropped turns, special-token strings in its text."""
        for reason, n in dropped.items():
            self.dropped_turns[reason] = self.dropped_turns.get(reason, 0) + n
        self.rows_with_dropped_turns += bool(dropped)
        self.special_tokens_in_text += special_tokens
        self.rows_with_special_tokens += bool(special_tokens)

    @property
    def trained_tokens_lost(self) -> int:
        return self.trained_lost_truncation + self.trained_lost_overlong

    @property
    def examples_skipped(self) -> int:
        return sum(self.skipped.values())

    @property
    def examples_kept(self) -> int:
        return self.examples_read - self.examples_skipped

    @property
    def zero_trained(self) -> int:
        return self.skipped.get("zero trained tokens", 0)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def first_bad_row(self) -> tuple[int, str, str] | None:
        """(row index, reason, detail) of the lowest row skipped for bad data (not for a recipe policy)."""
        bad = [(min(ix), r, self.first_detail.get(r, "")) for r, ix in self.first_skipped.items()
               if ix and r not in POLICY_REASONS]
        return min(bad) if bad else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["sources"] = {label: st.to_dict() for label, st in self.sources.items()}
        out.update(
            examples_kept=self.examples_kept,
            examples_skipped=self.examples_skipped,
            zero_trained=self.zero_trained,
            trained_tokens_lost=self.trained_tokens_lost,
            tokens_per_second=round(self.tokens_per_second, 1),
        )
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataStats:
        names = cls.__dataclass_fields__
        out = cls(**{k: v for k, v in d.items() if k in names and k != "sources"})
        out.sources = {label: cls.from_dict(st) for label, st in (d.get("sources") or {}).items()}
        return out
