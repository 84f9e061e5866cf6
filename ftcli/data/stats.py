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
    truncated: int = 0  # examples cut to data.max_length, or to the block (bfd, overlong=truncate)
    split: int = 0  # examples cut across blocks (strategy=split)
    tokens: int = 0  # tokens of the kept examples, as packed
    trained_tokens: int = 0  # loss tokens in the blocks (labels[1:] != -100, summed over blocks)
    blocks: int = 0
    padding_tokens: int = 0
    seconds: float = 0.0  # tokenize + mask + pack wall time

    def skip(self, index: int, reason: str, detail: str = "") -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.first_detail.setdefault(reason, detail)
        first = self.first_skipped.setdefault(reason, [])
        if len(first) < FIRST_INDICES:
            first.append(index)

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
        out.update(
            examples_kept=self.examples_kept,
            examples_skipped=self.examples_skipped,
            zero_trained=self.zero_trained,
            tokens_per_second=round(self.tokens_per_second, 1),
        )
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataStats:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})
