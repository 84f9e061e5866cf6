"""Unknown keys, with the closest valid one: "; did you mean 'training.optimizer.lr'?". One helper for every schema
ftcli reads (recipes, `ftcli.config.recipe`, and AI Runtime workloads, `ftcli.launchers.databricks`): it walks the
pydantic schema along an error's location, through discriminated unions (`training`: full | lora) and lists."""

from __future__ import annotations

import difflib
import typing
from typing import Annotated, Any

from pydantic import BaseModel, Tag


def _sections_in(annotation: Any) -> list[type[BaseModel]]:
    """The schema sections a field holds: `X`, `X | None`, `list[X]` -> [X]."""
    args = getattr(annotation, "__args__", None)
    if args:
        return [t for a in args for t in _sections_in(a)]
    return [annotation] if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []


def _tagged_sections(annotation: Any) -> dict[str, type[BaseModel]]:
    """tag -> section of a discriminated union (`training`: full -> FullTraining, lora -> LoraTraining)."""
    out: dict[str, type[BaseModel]] = {}
    for member in typing.get_args(annotation):
        if typing.get_origin(member) is Annotated:
            inner, *meta = typing.get_args(member)
            out.update({m.tag: inner for m in meta if isinstance(m, Tag)})
        out.update(_tagged_sections(member))
    return out


def schema_walk(root: type[BaseModel], loc: tuple) -> tuple[tuple, type[BaseModel] | None]:
    """(`loc` without the tags pydantic puts in it after a discriminated union, the section it ends at: None
    where it is not one)."""
    model: type[BaseModel] | None = root
    clean: list = []
    tags: dict[str, type[BaseModel]] = {}
    for part in loc:
        if part in tags:
            model, tags = tags[part], {}
            continue
        clean.append(part)
        if isinstance(part, int) or model is None:  # an item of a list of sections
            continue
        field = model.model_fields.get(part)
        sections = _sections_in(field.annotation) if field else []
        tags = _tagged_sections(field.annotation) if field else {}
        model = sections[0] if sections else None
    return tuple(clean), model


def _nested_key(model: type[BaseModel], key: str, prefix: str = "") -> str | None:
    """`training.lr` -> `optimizer.lr`: the key exists one section further down."""
    for name, field in model.model_fields.items():
        for section in _sections_in(field.annotation):
            if key in section.model_fields:
                return f"{prefix}{name}.{key}"
            found = _nested_key(section, key, f"{prefix}{name}.")
            if found:
                return found
    return None


def did_you_mean(root: type[BaseModel], loc: tuple) -> str:
    """"; did you mean 'a.b'?" for the unknown key at `loc` under the schema `root`: the closest key of its
    section, else the same key one section further down; "" when there is neither."""
    where, owner = schema_walk(root, loc[:-1])
    if owner is None:
        return ""
    keys = [*owner.model_fields, *getattr(owner, "other_keys", ())]  # training: the other method's keys too
    close = difflib.get_close_matches(str(loc[-1]), keys, n=1, cutoff=0.5)
    found = _nested_key(owner, str(loc[-1])) or (close[0] if close else None)  # an exact key deeper beats a near one
    return f"; did you mean '{'.'.join([*map(str, where), found])}'?" if found else ""
