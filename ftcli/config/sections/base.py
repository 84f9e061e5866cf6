"""What every recipe section shares: `Section`, the base class whose rules hold in every section (unknown keys fail,
every float is finite, `true`/`false` is no number, keys added later stay out of dumps at their default), and the
rule for names that reach MLflow, a registry or a terminal (`plain_text_problem`)."""

from __future__ import annotations

import types
import typing
import unicodedata
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_serializer


def _members(annotation: Any) -> list:
    """The alternatives a field accepts: `int | None` -> [int, NoneType]; `Annotated[X, ...]` -> [X]."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _members(a)]
    return [annotation]


def _bool_for_number(annotation: Any, value: Any) -> bool:
    """True where YAML `true`/`false` stands in a number's place (pydantic would read it as 1/0)."""
    members = _members(annotation)
    if isinstance(value, bool):
        kinds = {type(v) for m in members if typing.get_origin(m) is Literal for v in typing.get_args(m)}
        kinds |= {m for m in members if typing.get_origin(m) is not Literal}
        return bool(kinds & {int, float}) and not kinds & {bool, Any}
    if isinstance(value, list):  # tuple[float, float], list[int]: look at the items
        for m in members:
            origin, args = typing.get_origin(m), typing.get_args(m)
            if origin is tuple and any(_bool_for_number(t, v) for t, v in zip(args, value)):
                return True
            if origin is list and args and any(_bool_for_number(args[0], v) for v in value):
                return True
    return False


class Section(BaseModel):
    """Rules for every section: unknown keys fail, every float is finite, `true`/`false` is no number."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
    # keys a dump leaves out while they hold these values: settings added later, so that dumps (recipe.yaml,
    # rendered workloads) of recipes that do not use them stay byte-identical
    quiet_defaults: ClassVar[dict[str, Any]] = {}

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        return self._without_quiet_defaults(handler(self))

    @classmethod
    def _without_quiet_defaults(cls, out: dict[str, Any]) -> dict[str, Any]:
        for key, default in cls.quiet_defaults.items():
            if key in out and out[key] == default:
                del out[key]
        return out

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if _bool_for_number(cls.model_fields[info.field_name].annotation, value):
            raise ValueError("expected a number, not true/false")
        return value


def plain_text_problem(value: str) -> str | None:
    """What is wrong with a name that ends up in MLflow, a registry or a terminal (None: nothing):
    it must not be blank or hold control characters (newlines, escapes, bidi overrides)."""
    if not value.strip():
        return "must not be empty"
    bad = next((c for c in value if unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp")), None)
    return None if bad is None else f"contains the control character {bad!r}; use printable characters only"
