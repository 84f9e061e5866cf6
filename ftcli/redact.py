"""Redaction: what ftcli prints or logs never carries a secret.

    mask_uri("https://user:token@host:5000/x")  -> "https://***@host:5000/x"  (also inside a message)
    scrub_recipe(recipe_dict)                   -> a copy with compute.secrets / compute.env_variables
                                                   values replaced by "***" and the tracking URI masked

Used by tracking (params of a training run), register (params of a new run, printed URIs) and the run
directory (run.json's recipe). Plain data code: no MLflow, no torch.
"""

from __future__ import annotations

import json
import re

SCRUBBED = "***"
_USERINFO = re.compile(r"(?<=://)[^/\s]*@")  # scheme://user:password@host: up to the host's last '@'


def mask_uri(text: str) -> str:
    """The user-info of every URL in `text` masked: a URI, or a message that quotes one."""
    return _USERINFO.sub(SCRUBBED + "@", text)


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
