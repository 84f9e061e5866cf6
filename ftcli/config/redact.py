"""Redaction: what ftcli prints, logs or writes never carries a secret.

    mask_uri("https://user:token@host:5000/x")  -> "https://***@host:5000/x"  (also inside a message)
    mask_uri("https://host/x?token=abc&y=1")     -> "https://host/x?token=***&y=1"  (token-like parameters)
    split_credentials("https://user:tok@host/x") -> ("https://host/x", "user", "tok")
    mask_recipe_uris(recipe_dict)               -> a copy with the tracking URI's credentials masked
                                                   (what <run>/recipe.yaml and run.json hold)
    scrub_recipe(recipe_dict)                   -> that, and compute.secrets / compute.env_variables
                                                   values replaced by "***" (MLflow params)
    with masked_output(): ...                   -> what a library prints meanwhile (stdout, stderr, logging
                                                   that writes to them) goes out with URLs masked: MLflow's
                                                   `View run ... at: http://user:password@host/...` lines

Secret values have no place in a recipe at all: `compute.env_variables` refuses names that look secret
(`looks_secret`: *TOKEN*, *_KEY, *_SECRET*, *_PASS*, *_AUTH, *_CREDENTIALS, *PROXY* but NO_PROXY, ...) and
values that hold credentials (`holds_credentials`: a URL with user-info or a token-like query parameter);
they belong in `compute.secrets` as scope/key references. Credentials in the tracking URI (user-info,
`?token=...`) are masked wherever the recipe is written; the launcher hands the URI with it to the workers
as $MLFLOW_TRACKING_URI (ftcli.artifacts.tracking). Plain data code: no MLflow, no torch.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from collections.abc import Iterator
from urllib.parse import unquote, urlsplit, urlunsplit

SCRUBBED = "***"
_USERINFO = re.compile(r"(?<=://)[^/\s]*@")  # scheme://user:password@host: up to the host's last '@'
# Parts of an env variable name (split at '_', '-', '.') that mark a secret value: HF_TOKEN, WANDB_API_KEY,
# AWS_SECRET_ACCESS_KEY, PGPASSWORD. TOKENIZERS_PARALLELISM is not one (whole parts, or these endings).
_SECRET_PARTS = {"TOKEN", "TOKENS", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "PASS", "PWD", "KEY", "KEYS",
                 "APIKEY", "CREDENTIAL", "CREDENTIALS", "CREDS", "PAT", "PRIVATE", "AUTH", "AUTHORIZATION", "COOKIE"}
_SECRET_ENDINGS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "APIKEY", "CREDENTIAL", "CREDENTIALS", "AUTH")
_SECRET_PREFIXES = ("SECRET", "PASS")  # MY_SECRETVALUE, SMTP_PASSPHRASE
_NOT_SECRET = {"NO_PROXY"}  # a host list; a proxy URL (HTTPS_PROXY) may carry user:password
# Query parameters whose value is a credential (besides names that look_secret): SAS / presigned-URL signatures.
_SECRET_QUERY_PARTS = {"SIG", "SIGNATURE", "AUTH", "AUTHORIZATION", "APIKEY", "CODE"}
_QUERY_PARAM = re.compile(r"(?<=[?&;])([^=&;#\s]+)=([^&;#\s)'\"<>]*)")  # a value ends where a message's quote does


def mask_uri(text: str) -> str:
    """The user-info and the token-like query parameters of every URL in `text` masked: a URI, or a
    message that quotes one."""
    text = _USERINFO.sub(SCRUBBED + "@", text)
    if "?" not in text:
        return text
    return _QUERY_PARAM.sub(lambda m: f"{m[1]}={SCRUBBED}" if m[2] and _secret_param(m[1]) else m[0], text)


class MaskedStream(io.TextIOBase):
    """A text stream that passes what is written to `target` with every URL's credentials masked (`mask_uri`,
    per write: a library writes a line at a time)."""

    def __init__(self, target):
        super().__init__()
        self.target = target

    def write(self, text: str) -> int:
        self.target.write(mask_uri(text))
        return len(text)

    def flush(self) -> None:
        self.target.flush()

    def isatty(self) -> bool:
        return self.target.isatty()

    def fileno(self) -> int:
        return self.target.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.target, "encoding", "utf-8")


@contextlib.contextmanager
def masked_output(stdout=None) -> Iterator[None]:
    """Within the block, sys.stdout (or `stdout` in its place) and sys.stderr go through `MaskedStream`: what
    MLflow, alembic or urllib3 print or log there (handlers that look sys.stderr up when they write) never
    shows a password or token in a URL."""
    with contextlib.redirect_stdout(MaskedStream(stdout or sys.stdout)), \
            contextlib.redirect_stderr(MaskedStream(sys.stderr)):
        yield


def _secret_param(name: str) -> bool:
    parts = [p for p in re.split(r"[^A-Za-z0-9]+", name.upper()) if p]
    return looks_secret(name) or any(p in _SECRET_QUERY_PARTS for p in parts)


def has_masked_credentials(uri: str) -> bool:
    return f"://{SCRUBBED}@" in uri or any(m[2] == SCRUBBED for m in _QUERY_PARAM.finditer(uri))


def holds_credentials(value: str) -> bool:
    """Does a value carry a credential in clear: a URL with user-info or a token-like query parameter?"""
    return mask_uri(value) != value


def split_credentials(uri: str) -> tuple[str, str | None, str | None]:
    """(the URI without user-info and token-like query parameters, user, password); (uri, None, None)
    when it carries none."""
    parts = urlsplit(uri)
    query = "&".join(p for p in parts.query.split("&") if p and not _secret_param(p.partition("=")[0]))
    if "@" not in parts.netloc:
        return urlunsplit(parts._replace(query=query)) if query != parts.query else uri, None, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, sep, password = userinfo.partition(":")
    plain = urlunsplit((parts.scheme, host, parts.path, query, parts.fragment))
    return plain, unquote(user) or None, unquote(password) if sep else None


def looks_secret(name: str) -> bool:
    """Does an environment variable's name say its value is a secret?"""
    if name.upper() in _NOT_SECRET:
        return False
    parts = [p for p in re.split(r"[^A-Za-z0-9]+", name.upper()) if p]
    return "PROXY" in name.upper() or any(
        p in _SECRET_PARTS or p.endswith(_SECRET_ENDINGS) or p.startswith(_SECRET_PREFIXES) for p in parts)


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
