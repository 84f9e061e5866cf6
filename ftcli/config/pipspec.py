"""What a recipe may hand to pip: requirements and local paths, never pip options.

    check_pip_spec("torch==2.9.1")                       -> kept (a PEP 508 requirement)
    check_pip_spec('numpy; python_version >= "3.10"')    -> kept (markers included)
    check_pip_spec("ftcli @ https://host/ftcli-0.1.whl") -> kept (a named direct reference)
    check_pip_spec("$CODE_SOURCE_PATH[gpu]")             -> kept (a local path, extras allowed)
    check_pip_spec("./dist/ftcli-0.1-py3-none-any.whl")  -> kept (a local path or wheel)
    check_pip_spec("--index-url=http://evil/simple")     -> ValueError (an option)
    check_pip_spec("-r/etc/shadow"), ("-egit+https://...") -> ValueError (options)
    check_pip_spec("https://host/x.whl")                 -> ValueError (write 'name @ url')

Each entry becomes one argv element of `pip install` in the workload (shell-quoted), so it cannot
inject a shell command; but pip reads an element starting with '-' as an option (another index, a
requirements file, an editable VCS checkout), so those are refused when the recipe is validated.
Plain rules: no pip, no network.
"""

from __future__ import annotations

import re

from packaging.requirements import InvalidRequirement, Requirement

# A local path: absolute, ./ or ../ relative, ~/, the code snapshot's variable; or a file named like
# an sdist or a wheel. One word (no whitespace), no URL scheme.
_PATH = re.compile(r"(/|\./|\.\./|~/|\$\{?CODE_SOURCE_PATH\}?(?=$|[/\[]))\S*|\S+\.(whl|tar\.gz|zip)")


def check_pip_spec(spec: str) -> str:
    """`spec` if it is a requirement specifier or a local path / wheel; else a one-line ValueError
    (the caller names the key and the value)."""
    if spec.lstrip().startswith("-"):
        raise ValueError("a pip option, not a requirement: list packages (name[extras]==version) or local paths / "
                         "wheels only (no index URL, requirements file or editable install)")
    try:
        Requirement(spec)
        return spec
    except InvalidRequirement:
        pass
    if "://" not in spec and _PATH.fullmatch(spec):
        return spec
    hint = "; write a URL as 'name @ url'" if "://" in spec else ""
    raise ValueError(f"neither a requirement (name[extras]<version>, 'name @ url') nor a local path or wheel{hint}")


# Environment variables that change what the job's `pip install` fetches or what its shell and Python load
# before ftcli runs: pip reads every PIP_<OPTION> as that option (PIP_INDEX_URL is --index-url), bash sources
# $BASH_ENV, the loader preloads $LD_PRELOAD, Python imports from $PYTHONPATH. A recipe sets none of them.
_LOADER_VARS = frozenset({"BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "LD_PRELOAD", "LD_AUDIT", "PYTHONPATH",
                          "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONINSPECT"})


_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_env_name(name: str) -> str:
    """`name` if it is a variable name, and not a pip option (PIP_*) nor a variable the shell, the loader or
    Python acts on at start."""
    if not _VAR_NAME.fullmatch(name):
        raise ValueError(f"{name[:40]!r} is not a valid environment variable name (letters, digits, '_'; "
                         "no leading digit)")
    if name.upper().startswith("PIP_"):
        raise ValueError(f"{name} is a pip option (pip reads PIP_<OPTION> as --<option>); the job's pip install "
                         "takes requirements only: list them in compute.dependencies")
    if name in _LOADER_VARS:
        raise ValueError(f"{name} makes the job's shell, loader or Python run other code before ftcli; "
                         "a recipe does not set it")
    return name
