"""The MLflow model registry, through one explicit `MlflowClient`: its name and alias rules (MLflow's own
registry and Unity Catalog), the fail-fast check that it answers, the alias lookup and a new version.

Unity Catalog (`--registry-uri databricks-uc`): a name is `catalog.schema.model`, each part under UC's
object-name rules (at most 255 characters; no period, space, '/', ASCII control character or DEL),
stored lowercase; a version needs a signature with inputs and outputs.

Concurrent registers: MLflow has no compare-and-set for an alias, so `claim_alias` re-reads the alias right
before it sets it (still where it was when this register started, else a clash is reported unless --force)
and once after (another register that set it at the same time is reported, not silently outlived). On a
local sqlite store both happen under an exclusive lock on the store's directory (`sqlite_store_lock`), which
also serializes the first use of a new store (MLflow creates its tables then; two processes doing it at
once die in alembic).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

from ftcli.config.errors import UserError
from ftcli.config.redact import mask_uri
from ftcli.artifacts.tracking import check_reachable, first_line, http_settings

UC_REGISTRY = "databricks-uc"
UC_MAX_NAME_LEN = 255
_UC_BAD_CHARS = re.compile(r"[.\s/\x00-\x1f\x7f]")
_ALIAS_RE = re.compile(r"^[\w-]+$")
_ALIAS_VERSION_RE = re.compile(r"^[vV]\d+$")
_NOT_FOUND = ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND", "INVALID_PARAMETER_VALUE")
_EXISTS = ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS")
_DENIED = ("UNAUTHENTICATED", "PERMISSION_DENIED")


# ------------------------------------------------------------------------------------ name rules
def is_uc_registry(registry_uri: str | None) -> bool:
    return bool(registry_uri) and registry_uri.split(":", 1)[0].lower() == UC_REGISTRY


def validate_uc_name(name: str) -> str:
    """`catalog.schema.model` under Unity Catalog's object-name rules; returns it lowercased."""
    parts = name.split(".")
    if len(parts) != 3:
        raise UserError(
            f"Unity Catalog model name {name!r} must be catalog.schema.model (three parts), e.g. main.default.my_model"
        )
    for label, part in zip(("catalog", "schema", "model"), parts):
        if not part:
            raise UserError(f"Unity Catalog model name {name!r}: the {label} part is empty")
        if len(part) > UC_MAX_NAME_LEN:
            raise UserError(f"Unity Catalog model name {name!r}: the {label} part is longer than 255 characters")
        bad = _UC_BAD_CHARS.search(part)
        if bad:
            raise UserError(
                f"Unity Catalog model name {name!r}: the {label} part contains {bad.group()!r}; "
                "use letters, digits, '_' or '-' (no spaces, '/' or control characters)"
            )
    return name.lower()


def validate_local_name(name: str) -> str:
    """MLflow's own registry: any non-empty name without '/' or ':' (they break models:/ URIs)."""
    if not name or not name.strip():
        raise UserError("--name is empty")
    if name != name.strip():
        raise UserError(f"model name {name!r} has leading or trailing spaces")
    for ch in "/:":
        if ch in name:
            raise UserError(f"model name {name!r} contains {ch!r}, which MLflow model names cannot contain")
    return name


def validate_model_name(name: str, registry_uri: str | None) -> str:
    return validate_uc_name(name) if is_uc_registry(registry_uri) else validate_local_name(name)


def validate_alias(alias: str) -> str:
    """MLflow's alias rules: letters, digits, '_' and '-'; not 'latest'; not a version like 'v3'."""
    if not _ALIAS_RE.fullmatch(alias) or len(alias) > 255:
        raise UserError(f"alias {alias!r}: use 1-255 letters, digits, '_' or '-'")
    if alias.lower() == "latest":
        raise UserError("alias 'latest' is reserved by MLflow; pick another, e.g. champion")
    if _ALIAS_VERSION_RE.fullmatch(alias):
        raise UserError(f"alias {alias!r} looks like a version reference, which MLflow reserves; pick another")
    return alias


def require_uc_signature(signature) -> None:
    """Unity Catalog refuses a version whose signature lacks inputs or outputs."""
    if signature is None or signature.inputs is None:
        raise UserError("Unity Catalog needs a model signature with inputs and outputs; this model has none")
    if signature.outputs is None:
        raise UserError("Unity Catalog needs a model signature with outputs; this model's signature has inputs only")


# ---------------------------------------------------------------------------------- the registry
def check_registry(client, registry_uri: str, timeout_s: float) -> None:
    """The registry answers one call with no retries, or this fails in seconds with the URI, before
    anything is merged or uploaded (a wrong URI, missing credentials)."""
    from mlflow.exceptions import MlflowException

    fix = "check --registry-uri and your credentials"
    check_reachable(registry_uri, fix=fix, timeout_s=timeout_s, what="model registry")
    with http_settings(max_retries="0", timeout_s=timeout_s):
        try:
            client.search_registered_models(max_results=1)
        except Exception as e:  # noqa: BLE001 - whatever the store raises, this registry cannot be used
            denied = isinstance(e, MlflowException) and e.error_code in _DENIED
            reason = "not authorized" if denied else first_line(e)
            raise UserError(f"cannot use the model registry at {mask_uri(registry_uri)} ({reason}); {fix}") from None


@contextlib.contextmanager
def sqlite_store_lock(*uris: str | None) -> Iterator[None]:
    """An exclusive flock on the directory of each local sqlite store among `uris` (one process at a time
    creates or claims there); nothing for other stores."""
    import fcntl

    dirs = sorted({Path(u[len("sqlite:///"):]).resolve().parent for u in uris if u and u.startswith("sqlite:///")})
    fds = []
    try:
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            fds.append(fd)
            with contextlib.suppress(OSError):  # no flock on this filesystem: as before, unserialized
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        for fd in fds:
            os.close(fd)


def claim_alias(client, name: str, alias: str, version: str, *, expected: str | None, force: bool) -> None:
    """Point `alias` at `version`: refused (UserError) when another register moved it since this one found it
    at `expected` (unless `force`), and reported when, read back, it points at another version (another
    register set it at the same moment). Hold `sqlite_store_lock` around it for a local store."""
    now = alias_version(client, name, alias)
    if now != expected and not force:
        raise UserError(f"alias '{alias}' of {name} was set to version {now} by another register while this one ran; "
                        f"version {version} is registered without the alias: pass --force to move it to {version}")
    client.set_registered_model_alias(name, alias, version)
    after = alias_version(client, name, alias)
    if after != version:
        raise UserError(f"alias '{alias}' of {name} points at version {after}: another register set it at the same "
                        f"time; version {version} is registered without the alias")


def alias_version(client, name: str, alias: str) -> str | None:
    """The version `alias` points at now, or None (no such model or alias)."""
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException as e:
        if e.error_code in _NOT_FOUND:
            return None
        raise


MAX_TAG_VALUE = 1000  # characters: within what a Unity Catalog tag value and an OSS registry tag hold
MAX_SOURCE_TAGS = 20


def lineage_tags(run) -> dict[str, str]:
    """A model version's lineage tags from the training run's record (RunRecord; None: no run, none): the recipe
    (name, digest), the base it trained from, and each data source it read, one tag per source
    (`ftcli.data.training.0`: `delta main.sft.chats@12 (train) rows 1000 read, 990 kept, digest ...`), and the run
    it started from (`ftcli.parent.*`: a DPO run's SFT run). With the version's run (its MLflow dataset inputs), the
    registry answers which data, which recipe, which base, which parent run."""
    if run is None:
        return {}
    tags = {"ftcli.recipe": str(run.recipe.get("name", "")), "ftcli.method": run.method}
    if run.recipe_digest:
        tags["ftcli.recipe_digest"] = run.recipe_digest
    base = run.base_model
    tags["ftcli.base"] = (f"{base.id}@{base.revision}" if base.id and base.revision else base.id) or \
        (f"{base.init} init from {base.config}" if base.config else f"{base.init} init ({base.model_type})")
    counts: dict[str, int] = {}
    for src in run.data_sources:
        n = counts.get(src.context, 0)
        counts[src.context] = n + 1
        if n < MAX_SOURCE_TAGS:
            tags[f"ftcli.data.{src.context}.{n}"] = src.describe()[:MAX_TAG_VALUE]
    tags.update({f"ftcli.data.{context}.count": str(n) for context, n in counts.items()})
    if run.parent_run is not None:  # the run this one started from (a DPO run's SFT run)
        tags.update({k: v[:MAX_TAG_VALUE] for k, v in run.parent_run.tags().items()})
    return {k: v for k, v in tags.items() if v}


def create_version(client, name: str, info, tags: dict[str, str]):
    """A new version of `name` (created on first use) from the logged model `info`."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code not in _EXISTS:
            raise
    return client.create_model_version(name, source=info.model_uri, tags=tags, model_id=info.model_id)
