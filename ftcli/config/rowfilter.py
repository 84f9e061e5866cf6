"""A delta source's row filter (`filter:`, read by ftcli.data.delta), in deltalake's tuple form.

    filter: [[lang, "=", en], [score, ">=", 3]]                  a conjunction: lang = 'en' AND score >= 3
    filter: [[[lang, "=", en]], [[lang, in, [de, fr]], [score, ">", 4]]]
                                                                 disjunctive normal form: an OR of ANDs
    ops: =  (or ==)  !=  <  <=  >  >=  in  "not in"     (quote "=": YAML reads a bare = as a special tag)

A value is a string, number, boolean, date or datetime; `in` / `not in` take a non-empty list of them. Kept in
its normal form (a list of conjunctions), so the pack cache key and the recorded lineage see one spelling.
Whether each column exists, and has a type the value can be compared with, is the table's question
(ftcli.data.delta checks it before anything is read).
"""

from __future__ import annotations

import json
from datetime import date, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, StrictBool, StrictFloat, StrictInt, StrictStr

FilterOp = Literal["=", "!=", "<", "<=", ">", ">=", "in", "not in"]
Scalar = StrictBool | StrictInt | StrictFloat | StrictStr | datetime | date
Condition = tuple[StrictStr, FilterOp, Scalar | list[Scalar]]
LIST_OPS = ("in", "not in")


def _normal_form(value: Any) -> Any:
    """A conjunction (a list of [column, op, value]) -> [that conjunction]; `==` -> `=`."""
    if not isinstance(value, (list, tuple)) or not value:
        return value
    first = value[0]
    dnf = isinstance(first, (list, tuple)) and bool(first) and isinstance(first[0], (list, tuple))
    groups = value if dnf else [value]
    return [[[c[0], "=", *c[2:]] if isinstance(c, (list, tuple)) and len(c) == 3 and c[1] == "==" else c
             for c in group] if isinstance(group, (list, tuple)) else group for group in groups]


def _check(groups: list[list[tuple]] | None) -> list[list[tuple]] | None:
    if groups is None:
        return None
    if not groups or not all(groups):
        raise ValueError("give at least one [column, op, value] condition in each group, or leave it unset")
    for column, op, value in (c for group in groups for c in group):
        if op in LIST_OPS and (not isinstance(value, list) or not value):
            raise ValueError(f"[{column}, {op}, {value!r}]: '{op}' takes a non-empty list of values")
        if op not in LIST_OPS and isinstance(value, list):
            raise ValueError(f"[{column}, {op}, {value!r}]: '{op}' takes one value (a list goes with in / not in)")
    return groups


RowFilter = Annotated[list[list[Condition]] | None, BeforeValidator(_normal_form), AfterValidator(_check)]


def describe_filter(groups: list[list[tuple]] | None) -> str | None:
    """One line, as the run records it: `lang = "en" AND score >= 3`, groups joined by OR."""
    if not groups:
        return None

    def text(value) -> str:
        if isinstance(value, list):
            return "(" + ", ".join(text(v) for v in value) + ")"
        return json.dumps(value.isoformat() if isinstance(value, (date, datetime)) else value)

    parts = [" AND ".join(f"{column} {op} {text(value)}" for column, op, value in group) for group in groups]
    return parts[0] if len(parts) == 1 else " OR ".join(f"({p})" for p in parts)
