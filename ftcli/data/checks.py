"""Is there anything to train on? A source that keeps no row (or under `MIN_KEPT_FRACTION` of the rows
read) is refused in one line, before any worker starts: the rows read, the top skip reasons with a row
number, and the likely fix (a ShareGPT-shaped row under `data.format: messages` says "looks like ShareGPT:
set data.format=sharegpt"). `data.allow_empty_sources: true` turns the refusal into a warning.

    quick_check(data_spec(recipe))                         # launcher, first: rows only, before torch loads
    packed = check_sources(recipe.data, prepare_blocks(spec, tokenizer))   # launcher preflight, trainers

Pure data code: no torch.distributed, MLflow or CLI imports.
"""

from __future__ import annotations

from ftcli.config.errors import UserError
from ftcli.config.rowfilter import describe_filter
from ftcli.data import formats, preference, sources
from ftcli.data.spec import DataSpec
from ftcli.data.stats import DataStats
from ftcli.data.validate import BadRow

MIN_KEPT_FRACTION = 0.01  # a source keeping fewer of the rows it read is almost surely read wrong
TOP_REASONS = 2
QUICK_ROWS = 1000  # rows `quick_check` reads per source


def _reasons(st: DataStats) -> str:
    top = sorted(st.skipped.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_REASONS]
    out = []
    for reason, n in top:
        first = st.first_skipped.get(reason) or []
        detail = st.first_detail.get(reason, "")
        where = f", row {first[0]}" + (f": {detail}" if detail else "") if first else ""
        out.append(f"{reason} {n}{where}")
    return "; ".join(out)


def _hint(src, key: str) -> str:
    """The likely fix for a source whose rows were read in the wrong format ('' when none is known)."""
    try:
        rows, _ = sources.open_rows(src, limit=formats.DETECT_ROWS)
        found = formats.detect((r for _, r in rows if not isinstance(r, sources.InvalidRow)), src.messages_field)
    except UserError:
        return ""
    if not found.matched:
        return (f"no row matches a known format ({', '.join(formats.FORMATS[1:])}); see docs/data.md")
    fix = []
    if src.format not in ("auto", found.format):
        fix.append(f"{key}.format={found.format}")
    if found.format == "messages" and found.messages_field != src.messages_field and src.format != "auto":
        fix.append(f"{key}.messages_field={found.messages_field}")
    return f"looks like {formats.NAMES[found.format]}: set {' '.join(fix)}" if fix else ""


def _problem(data, k: int, src, st: DataStats) -> str | None:
    kept, read = st.examples_kept, st.examples_read
    if src.source == "synthetic" or (kept and kept >= MIN_KEPT_FRACTION * read):
        return None
    key = "data" if data.one_source else f"data.sources[{k}]"
    reasons = _reasons(st)
    line = (f"data source {src.label!r} keeps {kept} of the {read} rows read"
            + (f" ({reasons})" if reasons else "") + (f" [format {st.format}]" if st.format else ""))
    if not read and getattr(src, "filter", None):  # a delta source's row filter that selects nothing
        return line + f"; its filter ({describe_filter(src.filter)}) matches no row of the table: fix {key}.filter"
    hint = _hint(src, key)
    return line + (f"; {hint}" if hint else "")


def source_problems(data, stats: DataStats) -> list[str]:
    """One line per source of `data` (the data section) that keeps no row, or under MIN_KEPT_FRACTION of the rows
    it read."""
    found = [_problem(data, k, src, stats.sources[src.label])
             for k, src in enumerate(data.source_list()) if src.label in stats.sources]
    return [p for p in found if p]


def _missing(st: DataStats) -> int:
    return sum(n for reason, n in st.skipped.items() if reason.endswith(" missing"))


def _look_like(src) -> str:
    """What the first QUICK_ROWS rows of a source look like, by format ('' when one format or none)."""
    try:
        found = [formats.detect(rows, src.messages_field, QUICK_ROWS) for rows in sources.sample_rows(src, QUICK_ROWS)]
    except UserError:
        return ""
    seen: dict[str, int] = {}
    for f in found:
        for fmt, n in f.seen:
            seen[fmt] = seen.get(fmt, 0) + n
    return formats.shapes(seen.items()) if len(seen) > 1 else ""


def source_warnings(data, stats: DataStats) -> list[str]:
    """One line per source that keeps rows but skips most of those it read for a missing field: rows of
    another format than the source's (a mixed file, a folder of files in different formats), with the
    formats its rows are in and the fix."""
    out = []
    for k, src in enumerate(data.source_list()):
        st = stats.sources.get(src.label)
        if st is None or src.source == "synthetic" or _source_problem_shown(data, src, st):
            continue
        missing = _missing(st)
        if 2 * missing <= st.examples_read:
            continue
        key = "data" if data.one_source else f"data.sources[{k}]"
        looks = _look_like(src)
        fix = (f"; its rows are {looks}: set {key}.format=auto to read each row in its own format"
               if looks and src.format != "auto" else "")
        out.append(f"data source {src.label!r} skips {missing} of the {st.examples_read} rows read for a missing "
                   f"field ({_reasons(st)}) [format {st.format}]{fix}")
    return out


def _source_problem_shown(data, src, st: DataStats) -> bool:
    """The source is refused (or warned about) by `source_problems` already."""
    return not (st.examples_kept and st.examples_kept >= MIN_KEPT_FRACTION * st.examples_read)


def _refuse(data, problems: list[str]) -> None:
    if problems and not data.allow_empty_sources:
        more = f" (and {len(problems) - 1} more source(s))" if len(problems) > 1 else ""
        # training without it is a way out only where other sources are left to train on
        others = len(data.source_list()) > len(problems)
        raise UserError(f"{problems[0]}{more}" + ("; data.allow_empty_sources=true trains without it" if others else ""))


def quick_check(spec: DataSpec) -> None:
    """The refusal of `check_sources` from the rows alone (no tokenizer, no torch: a second or two): a source
    none of whose first QUICK_ROWS rows is a valid conversation in its format (a pair, for `spec.pairs`)."""
    data, pairs = spec.data, spec.pairs
    problems = []
    for k, src in enumerate(data.source_list()):
        if src.source == "synthetic":
            continue
        resolved, _ = (src, None) if pairs else formats.resolve(src)
        st = DataStats(format=resolved.format)
        rows, _ = sources.open_rows(src, limit=QUICK_ROWS)
        for index, row in rows:
            st.examples_read += 1
            try:
                if isinstance(row, sources.InvalidRow):
                    raise BadRow(row.reason, row.detail)
                if pairs:  # preference rows: a pair in any form ftcli.data.preference reads
                    preference.pair(row, "auto", resolved.tools_field)
                else:
                    formats.conversation(row, resolved.format, resolved.messages_field, resolved.tools_field)
            except BadRow as e:
                st.skip(index, e.reason, e.detail)
        if st.examples_kept == 0:
            problems.append(_problem(data, k, src, st))
    _refuse(data, problems)


def check_sources(data, packed):
    """`packed` (a PackedDataset) when every source keeps rows, else UserError naming the first one that
    does not (data.allow_empty_sources: returned as is; `source_problems` gives the warnings)."""
    _refuse(data, source_problems(data, packed.stats))
    return packed
