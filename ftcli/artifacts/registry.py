"""The MLflow model registry, through one explicit `MlflowClient`: its name and alias rules (MLflow's own
registry and Unity Catalog), the fail-fast check that it answers, the alias lookup and a new version.

Unity Catalog (`--registry-uri databricks-uc`): a name is `catalog.schema.model`, each part under UC's
object-name rules (at most 255 characters; no period, space, '/', ASCII control character or DEL),
stored lowercase; a version needs a signature with inputs and outputs.
"""

from __future__ import annotations

import re

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
    (`ftcli.data.training.0`: `delta main.sft.chats@12 (train) rows 1000 read, 990 kept, digest ...`). With the
    version's run (its MLflow dataset inputs), the registry answers which data, which recipe, which base."""
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
