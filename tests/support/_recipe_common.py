"""Shared by the tests that edit a recipe as plain data before loading it (test_workload, test_cli_errors)."""

from __future__ import annotations

DELETE = object()  # the value of `set_key` that removes the key


def set_key(data: dict, dotted: str, value) -> dict:
    """`data` with the `dotted` key (`a.b.c`, parents made as needed) set to `value`, or removed for DELETE."""
    *parents, last = dotted.split(".")
    node = data
    for p in parents:
        node = node.setdefault(p, {})
    if value is DELETE:
        node.pop(last)
    else:
        node[last] = value
    return data
