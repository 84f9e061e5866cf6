"""Redaction: what ftcli prints or logs never carries a secret.

    mask_uri("https://user:token@host:5000/x")  -> "https://***@host:5000/x"
    scrub_recipe(recipe_dict)                   -> a copy with compute.secrets / compute.env_variables
                                                   values replaced by "***" and the tracking URI masked

Used by tracking (params of a training run), register (params of a new run, printed URIs) and the run
directory (run.json's recipe). Plain data code: no MLflow, no torch.
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit, urlunsplit

SCRUBBED = "***"


def mask_uri(uri: str) -> str:
    """http://user:token@host -> http://***@host (for printing and logging)."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return uri
    if parts.username or parts.password:
        host = parts.hostname or ""
        netloc = f"{SCRUBBED}@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return uri


def scrub_recipe(recipe: dict | None) -> dict:
    """A copy of the recipe dict with secret values and env values replaced by '***'."""
    out = json.loads(json.dumps(recipe or {}))
    compute = out.get("compute")
    if isinstance(compute, dict):
        for key in ("secrets", "env_variables"):
            if isinstance(compute.get(key), dict):
                compute[key] = {k: SCRUBBED for k in compute[key]}
    tracking = out.get("tracking")
    if isinstance(tracking, dict) and isinstance(tracking.get("tracking_uri"), str):
        tracking["tracking_uri"] = mask_uri(tracking["tracking_uri"])
    return out
