"""The eval split: which training rows are held out (`eval.holdout`), and the data specs of the eval data, one
per source, for the one data path (`prepare_blocks` encodes, masks, packs and caches them exactly like training
rows).

Held-out rows are picked by a hash of the row's content and `eval.holdout_seed`, never by position or
by rank: the same rows on every run, under any world size, before any weighting or shuffling (a row
that a weight repeats is held out in every copy; two identical rows land on the same side).

    u(row) = blake2b(seed, canonical JSON of the row) as a uniform [0, 1)
    holdout < 1 (a share):       the row is held out when u(row) < share
    holdout >= 1 (a row count):  per source, the `holdout` rows of smallest u and every copy of them
                                 (one extra pass over the rows read; use a share for very large data)

Training keeps the rows that are not held out, the eval split the rows that are; a row that cannot be
parsed stays with training (where it is counted as bad, once).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from typing import Any, Callable, Iterator

from ftcli.data.sources import InvalidRow
from ftcli.data.spec import DataSpec, Holdout, holdout_rule
from ftcli.config.errors import UserError

Rows = Callable[[], Iterator[tuple[int, Any]]]  # one pass over a source: (row index, row)


def row_unit(row: Any, seed: int) -> float:
    """A deterministic uniform [0, 1) from a row's content and a seed (the same on every machine)."""
    text = json.dumps(row, sort_keys=True, ensure_ascii=False, default=str)
    # surrogatepass: a row holding a lone surrogate gets a unit too (validation skips it later, counted)
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8, key=str(seed).encode()[:64] or b"0").digest()
    return int.from_bytes(digest, "big") / 2.0**64


def split_rows(rule: Holdout | None, rows: Rows) -> Rows:
    """`rows` (a source's passes) with only the rows `rule` keeps."""
    if rule is None:
        return rows
    if rule.share < 1:
        threshold = rule.share
    else:
        units = sorted(row_unit(r, rule.seed) for _, r in rows() if not isinstance(r, InvalidRow))
        count = int(rule.share)
        # the `count` smallest units and every copy of them: identical rows share a unit and a side, so data
        # whose rows repeat holds out at least `count` rows, never none
        threshold = units[count - 1] if count <= len(units) else 2.0

    def kept() -> Iterator[tuple[int, Any]]:
        for index, row in rows():
            unit = None if isinstance(row, InvalidRow) else row_unit(row, rule.seed)
            held = unit is not None and (unit <= threshold if rule.share >= 1 else unit < threshold)
            if held == (rule.keep == "eval"):
                yield index, row

    return kept


def eval_specs(train: DataSpec, ev) -> dict[str, DataSpec]:
    """source label -> the data spec of that source's eval rows, packed the eval way (`eval.strategy`,
    `eval.block_len`; default the training block length). `train` is the training data (`data_spec(recipe)`),
    `ev` the eval section. Empty without eval data."""
    from ftcli.config.recipe import PackingConfig, SourceConfig

    data = train.data
    if ev is None or not ev.has_data:
        return {}
    train_packing = data.packing
    packing = PackingConfig(
        enabled=ev.strategy != "none", block_len=ev.block_len or train_packing.block_len,
        strategy="split" if ev.strategy == "split" else "bfd", bfd_buffer=train_packing.bfd_buffer,
        overlong=train_packing.overlong,
    )
    out = {}
    pairs = train.pairs  # preference rows: the eval packs whole pairs too
    if ev.holdout is not None:
        held_out = replace(holdout_rule(ev), keep="eval")
        if any(s.source == "synthetic" for s in data.sources):
            raise UserError("eval.holdout cannot hold out synthetic rows; give eval.path or eval.sources instead")
        for src in data.sources:  # each held-out row once (weight 1), each source its own loss
            one = data.model_copy(update={"sources": [src.model_copy(update={"weight": 1.0})], "packing": packing})
            out[src.label] = DataSpec(train.name, one, held_out, pairs)
        return out
    given = ev.sources or [SourceConfig(source=ev.source, path=ev.path, revision=ev.revision, split=ev.split)]
    for src in given:
        one = data.model_copy(update={"sources": [src], "packing": packing, "max_examples": ev.max_examples})
        out[src.label] = DataSpec(train.name, one, pairs=pairs)
    return out


def eval_problem(ev, packed: dict) -> str | None:
    """Why the eval split `packed` (source label -> PackedDataset of `eval_specs`) cannot give a loss, with the
    way out, or None. Checked before launch (the launcher) and shown by pack-preview: a held-out share of a
    small dataset can be no row at all."""
    if not packed or sum(int(p.block_trained.sum()) for p in packed.values()):
        return None
    off = "or train without eval: --set eval.enabled=false"
    if ev.holdout is not None:
        rows = sum(p.stats.examples_read for p in packed.values())
        what = f"{ev.holdout:g} of the rows" if ev.holdout < 1 else f"{int(ev.holdout)} rows per source"
        return (f"the eval split is empty: eval.holdout={ev.holdout:g} ({what}) holds out {rows} row(s) with "
                f"no trained token; hold out a row count instead (--set eval.holdout=10), {off}")
    return f"the eval data ({', '.join(packed)}) has no trained token; check eval.path / eval.sources, {off}"


def check_eval(ev, packed: dict) -> dict:
    """`packed` when the eval split (of the eval section `ev`) has a trained token (or there is no eval data), else
    UserError."""
    problem = eval_problem(ev, packed)
    if problem:
        raise UserError(problem)
    return packed
