"""What every launcher shares: the record a launcher is, the preflight, the install step, the YAML writer.

A launcher (one module in this room, registered in `ftcli.launchers.LAUNCHERS`) turns a validated recipe into
a file a cluster runs, and checks such a file:

    Launcher.render(recipe, fit_check)   -> the file's text, validated by the launcher's own check before it
                                            is returned (a rendered file is valid by construction)
    Launcher.warnings(recipe, fit_check) -> what renders fine but would likely go wrong on the cluster
    Launcher.check(text)                 -> one line per problem of a file (empty: valid)
    Launcher.owns(text)                  -> whether a file is this launcher's kind (`render-workload --check`)

From the recipe a launcher reads `compute` (the card and GPUs: `compute.accelerator`, the env variables,
the dependencies, ftcli's pip spec, its own keys) and the resolved recipe as a whole, which the job trains
from. Before rendering, every launcher runs `preflight`: the recipe must fit its cards (ftcli.estimate.plan),
carry no credentials in clear, and its kernel pins come from the families and the training features
(`gpu_requirements`). Every recipe value that reaches a shell goes through `shlex.quote`.

This room imports no torch, transformers, datasets or mlflow.
"""

from __future__ import annotations

import re
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from ftcli.config.errors import UserError
from ftcli.config.recipe import Recipe, YamlDumper
from ftcli.config.redact import mask_uri
from ftcli.families import find_family

_HOPPER = {"H100", "H200", "H800", "H20", "GH200"}
CODE_SOURCE_VARS = ("${CODE_SOURCE_PATH}", "$CODE_SOURCE_PATH")


@dataclass(frozen=True)
class Launcher:
    name: str  # the value of compute.launcher
    what: str  # the kind of file, for messages: "AI Runtime workload", "sbatch script"
    render: Callable[..., str]  # (recipe, *, fit_check=True) -> text
    warnings: Callable[..., list[str]]  # (recipe, *, fit_check=True) -> lines
    check: Callable[[str], list[str]]  # (text of a file) -> problems
    owns: Callable[[str], bool]  # (text of a file) -> is it this launcher's kind
    submit: str  # how to submit a written file: "sbatch {path}"


# ------------------------------------------------------------------------------------------- preflight
def preflight(recipe: Recipe, *, fit_check: bool) -> None:
    """What no launcher renders: credentials in the tracking URI (the file would hold them in clear) and,
    with `fit_check`, a recipe whose plan (ftcli.estimate.plan) does not fit its accelerator."""
    uri = recipe.tracking.tracking_uri
    if uri and mask_uri(uri) != uri:
        where = ("the password in compute.secrets (MLFLOW_TRACKING_PASSWORD: scope/key, and MLFLOW_TRACKING_USERNAME "
                 "in compute.env_variables)" if "@" in mask_uri(uri).split("?")[0] else
                 "the token in compute.secrets (MLFLOW_TRACKING_TOKEN: scope/key)")
        if recipe.compute.launcher != "databricks":
            where = "the credentials in the job's environment (MLFLOW_TRACKING_USERNAME / _PASSWORD / _TOKEN)"
        raise UserError(
            f"tracking.tracking_uri {mask_uri(uri)} carries credentials, which the workload file would hold in "
            f"clear; use the URI without them and put {where}"
        )
    if fit_check:
        from ftcli.estimate.plan import fit_check as plan_fit_check

        fit = plan_fit_check(recipe)
        if not fit.fits:
            raise UserError(f"{fit.reason}; --no-fit-check renders it anyway")


def fit_warnings(recipe: Recipe, *, fit_check: bool) -> list[str]:
    """The plan's line when the fit could not be checked (a card ftcli has no figures for)."""
    if not fit_check:
        return []
    from ftcli.estimate.plan import fit_check as plan_fit_check

    fit = plan_fit_check(recipe)
    return [fit.reason] if fit.card is None else []


# ------------------------------------------------------------------------------------------ install step
DELTALAKE = "deltalake==1.6.6"  # the `databricks` extra's reader of `source: delta` (ftcli.data.delta)


def data_requirements(recipe: Recipe) -> list[tuple[str, str]]:
    """(pip requirement, why) for the readers of the recipe's data (training and eval) beyond ftcli's own."""
    ev = recipe.eval
    kinds = {s.source for s in recipe.data.source_list()}
    if ev is not None:
        kinds |= {ev.source} if ev.path else set()
        kinds |= {s.source for s in ev.sources or []}
    return [(DELTALAKE, "data.source=delta reads the Delta table with delta-rs")] if "delta" in kinds else []


def gpu_requirements(recipe: Recipe) -> list[tuple[str, str]]:
    """(pip requirement, why) for what this recipe needs beyond ftcli's own dependencies: the pins of its family,
    of its training features and of its data readers (`data_requirements`). Setup is paid at the start of every
    run, so only wheels."""
    card = recipe.compute.accelerator.card
    family = find_family(recipe.model.model_type)  # a model ftcli has no family for trains unpacked, with no pins
    reqs = [(pin.requirement, pin.why) for pin in (family.pins if family else ())
            if not pin.hopper_only or card.upper() in _HOPPER]
    from ftcli import features

    reqs += features.requirements(recipe.training)  # the training features' pins (ftcli.features)
    return reqs + data_requirements(recipe)


def shell_spec(spec: str, source_dir: str = '"$ftcli_src"') -> tuple[str, bool]:
    """The quoted shell word for ftcli's pip spec; True when it installs from the code snapshot
    ($CODE_SOURCE_PATH, written as `source_dir`); whatever follows the variable (`[gpu]`) stays quoted."""
    for var in CODE_SOURCE_VARS:
        rest = spec[len(var):]
        if spec.startswith(var) and (not rest or rest[0] in "[/"):
            return source_dir + (shlex.quote(rest) if rest else ""), True
    return shlex.quote(spec), False


def pip_install_line(recipe: Recipe, source_dir: str = '"$ftcli_src"') -> str:
    """`pip install` of ftcli (compute.ftcli_spec), the kernel pins and compute.dependencies, one call."""
    spec, _ = shell_spec(recipe.compute.ftcli_spec, source_dir)
    requirements = [spec] + [shlex.quote(r) for r, _ in gpu_requirements(recipe)]
    requirements += [shlex.quote(d) for d in recipe.compute.dependencies]
    return "pip install --progress-bar off " + " ".join(requirements)


def setup_comment(recipe: Recipe, intro: str, ftcli_note: str) -> list[str]:
    """Why the install step installs what it does, one `# - ` line per requirement after `intro`."""
    lines = comment(intro)
    lines += comment(f"ftcli ({recipe.compute.ftcli_spec}) with its pure-Python requirements; {ftcli_note}", "- ")
    pins = gpu_requirements(recipe)
    for req, why in pins:
        lines += comment(f"{req}: {why}.", indent="- ")
    family = find_family(recipe.model.model_type)
    if family and family.setup_note:
        lines += comment(family.setup_note, "- ")
    elif not pins:
        note = family.no_pins_note if family else "Nothing else: {model_type} needs no extra kernels."
        lines += comment(note.format(model_type=recipe.model.model_type), indent="- ")
    if recipe.compute.dependencies:
        lines += comment("The recipe's compute.dependencies, resolved with the above in one pip call.", "- ")
    return lines


def checkout_warnings(recipe: Recipe, here: Path, submit: str) -> list[str]:
    """A job that installs ftcli from the directory it is submitted from (compute.ftcli_spec=$CODE_SOURCE_PATH)
    finds no ftcli to install when that directory is not an ftcli checkout."""
    if not shell_spec(recipe.compute.ftcli_spec)[1] or is_ftcli_checkout(here):
        return []
    return [f"{here} is not an ftcli checkout, but the job installs ftcli from the directory it is submitted from "
            f"(compute.ftcli_spec=$CODE_SOURCE_PATH): run `{submit}` from the ftcli checkout, or set "
            "compute.ftcli_spec to a pip spec (e.g. 'ftcli @ git+https://...')"]


def is_ftcli_checkout(path: Path) -> bool:
    import tomllib

    try:
        with open(path / "pyproject.toml", "rb") as f:
            return tomllib.load(f).get("project", {}).get("name") == "ftcli"
    except (OSError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------- writing
# Strings a YAML 1.2 core-schema reader takes for something else. PyYAML's own resolver (YAML 1.1) already
# makes the dumper quote what 1.1 reads as bool, int, float, null or timestamp; these are the rest: 1e3 and
# 12345e67 (1.2 floats without a dot), 0o17 (a 1.2 octal), and y / n (1.1 booleans PyYAML does not resolve).
_YAML12_NOT_STR = re.compile(
    r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)"
    r"|0o[0-7]+|0x[0-9a-fA-F]+|[-+]?[0-9]+|null|Null|NULL|~|true|True|TRUE|false|False|FALSE|[yYnN]|"
)


class Dumper(YamlDumper):
    """Block style for multi-line strings; quotes every string a YAML 1.1 or 1.2 resolver reads as another type."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    if "\n" in value:
        style = "|"
    elif _YAML12_NOT_STR.fullmatch(value):
        style = "'"
    else:
        style = None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


Dumper.add_representer(str, _str)


def dump_yaml(mapping: dict[str, Any]) -> str:
    return yaml.dump(mapping, Dumper=Dumper, sort_keys=False, width=4096, allow_unicode=True)


def comment(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(
        text, 108, initial_indent=f"# {indent}", subsequent_indent="#   ",
        break_on_hyphens=False, break_long_words=False,
    )
