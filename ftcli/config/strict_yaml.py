"""One reader for every YAML file ftcli is handed (recipes, `--set` values, workloads to check), and one writer.

What YAML allows but ftcli refuses (`parse_yaml`): duplicate keys, aliases (`*name`; anchors alone are harmless),
nesting deeper than 64 levels, files that are not UTF-8 text or are over 8 MiB (`read_text_file`). Every failure is
one line that names the line or the file. `YamlDumper` writes what `parse_yaml` reads back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ftcli.config.errors import UserError


MAX_YAML_BYTES = 8 * 2**20
MAX_YAML_DEPTH = 64


class YamlError(UserError):
    """What is wrong with a YAML text, in one line that names the line."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader minus what a recipe never needs and YAML makes dangerous: duplicate keys (the later
    one silently replaced a whole section), aliases (a 1.5 KB alias bomb expands to billions of nodes,
    which validation and `recipes show` then walk) and nesting deeper than MAX_YAML_DEPTH (PyYAML
    composes recursively: 5,000 levels end in a RecursionError)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, f"YAML aliases (*{event.anchor}) are not supported; write the value out", event.start_mark
            )
        if self._depth >= MAX_YAML_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", event.start_mark
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first is not key_node:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first set at line {first.start_mark.line + 1})",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep)


def parse_yaml(text: str) -> Any:
    """Parse one YAML document with `_StrictLoader`; every failure is a one-line `YamlError`."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" line {mark.line + 1}" if mark else ""
        raise YamlError(f"not valid YAML{where}: {e.problem or e.context}") from None
    except yaml.reader.ReaderError as e:  # `character` is a code point (or a byte for bytes input)
        raise YamlError(
            f"not valid YAML: control character #x{e.character:04x} at offset {e.position} (a binary file?)"
        ) from None
    except yaml.YAMLError as e:
        raise YamlError(f"not valid YAML: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def read_text_file(path: Path, what: str) -> str:
    """The UTF-8 text of `path`; a missing, unreadable, binary or oversized file is one line naming it."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_YAML_BYTES + 1)
    except OSError as e:
        raise UserError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > MAX_YAML_BYTES:
        raise UserError(f"{what} {path} is larger than {MAX_YAML_BYTES // 2**20} MiB; is it the right file?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{what} {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); is it a binary file?"
        ) from None


class YamlDumper(yaml.SafeDumper):
    """Writes a value out wherever it appears: no `&anchor`/`*alias`, which `parse_yaml` refuses."""

    def ignore_aliases(self, data: Any) -> bool:
        return True
