"""Redaction: what ftcli prints, logs or writes never carries a secret.

    mask_uri("https://user:token@host:5000/x")  -> "https://***@host:5000/x"  (also inside a message)
    split_credentials("https://user:tok@host/x") -> ("https://host/x", "user", "tok")
    mask_recipe_uris(recipe_dict)               -> a copy with the tracking URI's credentials masked
                                                   (what <run>/recipe.yaml and run.json hold)
    scrub_recipe(recipe_dict)                   -> that, and compute.secrets / compute.env_variables
                                                   values replaced by "***" (MLflow params)

Secret values have no place in a recipe at all: `compute.env_variables` refuses names that look secret
(`looks_secret`; they belong in `compute.secrets` as scope/key references), and a password in the
tracking URI is masked wherever the recipe is written; the launcher hands the URI with it to the workers
as $MLFLOW_TRACKING_URI (ftcli.artifacts.tracking). Plain data code: no MLflow, no torch.
"""

from __future__ import annotations

import json
import re
from urllib.parse import unquote, urlsplit, urlunsplit

SCRUBBED = "***"
_USERINFO = re.compile(r"(?<=://)[^/\s]*@")  # scheme://user:password@host: up to the host's last '@'
# Parts of an env variable name (split at '_', '-', '.') that mark a secret value: HF_TOKEN, WANDB_API_KEY,
# AWS_SECRET_ACCESS_KEY, PGPASSWORD. TOKENIZERS_PARALLELISM is not one (whole parts, or these endings).
_SECRET_PARTS = {"TOKEN", "TOKENS", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "PASS", "PWD", "KEY", "KEYS",
                 "APIKEY", "CREDENTIAL", "CREDENTIALS", "CREDS", "PAT", "PRIVATE"}
_SECRET_ENDINGS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "APIKEY", "CREDENTIAL", "CREDENTIALS")


def mask_uri(text: str) -> str:
    """The user-info of every URL in `text` masked: a URI, or a message that quotes one."""
    return _USERINFO.sub(SCRUBBED + "@", text)


def has_masked_credentials(uri: str) -> bool:
    return f"://{SCRUBBED}@" in uri


def split_credentials(uri: str) -> tuple[str, str | None, str | None]:
    """(the URI without user-info, user, password); (uri, None, None) when it carries none."""
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return uri, None, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, sep, password = userinfo.partition(":")
    plain = urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    return plain, unquote(user) or None, unquote(password) if sep else None


def looks_secret(name: str) -> bool:
    """Does an environment variable's name say its value is a secret?"""
    parts = [p for p in re.split(r"[^A-Za-z0-9]+", name.upper()) if p]
    return any(p in _SECRET_PARTS or p.endswith(_SECRET_ENDINGS) for p in parts)


def mask_recipe_uris(recipe: dict | None) -> dict:
    """A copy of the recipe dict with the credentials in tracking.tracking_uri masked."""
    out = json.loads(json.dumps(recipe or {}))
    tracking = out.get("tracking")
    if isinstance(tracking, dict) and isinstance(tracking.get("tracking_uri"), str):
        tracking["tracking_uri"] = mask_uri(tracking["tracking_uri"])
    return out


def mask_env_values(recipe: dict | None) -> dict:
    """A copy with the values of compute.env_variables replaced by '***' (names kept): what a run dir and
    MLflow keep of them, since ftcli cannot know which innocently named variable holds a secret."""
    out = json.loads(json.dumps(recipe or {}))
    compute = out.get("compute")
    if isinstance(compute, dict) and isinstance(compute.get("env_variables"), dict):
        compute["env_variables"] = {k: SCRUBBED for k in compute["env_variables"]}
    return out


def scrub_recipe(recipe: dict | None) -> dict:
    """A copy of the recipe dict with secret values and env values replaced by '***', URIs masked."""
    out = mask_recipe_uris(recipe)
    compute = out.get("compute")
    if isinstance(compute, dict):
        for key in ("secrets", "env_variables"):
            if isinstance(compute.get(key), dict):
                compute[key] = {k: SCRUBBED for k in compute[key]}
    return out
