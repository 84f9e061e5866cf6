"""Can this machine reach the Hugging Face Hub? Asked once per process, before the first load of a hub id
(a tokenizer, a model config or weights, a hub dataset), so that an offline machine fails in a second with
what to do instead of ~40 s of huggingface_hub's retries:

    HF_HUB_OFFLINE set                 -> offline (huggingface_hub's own switch)
    else one TCP connect to the Hub    -> HF_ENDPOINT's host (default huggingface.co:443), or the HTTPS proxy's
       (PROBE_TIMEOUT_S)                  when one is set; refused, unresolvable or silent -> offline

Offline, a hub id is loaded from the local HF cache only (`local_files_only=True`: what an earlier download
left there still works) and otherwise fails in one line: `no connection to the Hub (...)`, and how to point
the recipe at a local copy. A local path (a directory, a UC volume, `pkg://`) never probes.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 2.0
DEFAULT_ENDPOINT = "https://huggingface.co"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # what huggingface_hub accepts as a repo id


def is_hub_id(name: str | None) -> bool:
    """`name` would be looked up on the Hub: it has a repo id's shape and is no existing local path."""
    return bool(name) and bool(_REPO_ID.match(str(name))) and not Path(str(name)).expanduser().exists()


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def offline_flag() -> bool:
    """HF_HUB_OFFLINE is set (the HF libraries then read their local cache only)."""
    return _truthy(os.environ.get("HF_HUB_OFFLINE"))


@functools.lru_cache(maxsize=1)
def unreachable() -> str | None:
    """None when the Hub answers; else why not. Probed once per process (`unreachable.cache_clear()` asks
    again)."""
    if offline_flag():
        return "HF_HUB_OFFLINE is set"
    endpoint = os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT
    target = urlparse(endpoint)
    names = ("HTTPS_PROXY", "https_proxy") if target.scheme == "https" else ("HTTP_PROXY", "http_proxy")
    proxy = next((os.environ[n] for n in names if os.environ.get(n)), None)
    via = urlparse(proxy) if proxy else target
    host, port = via.hostname, via.port or (443 if via.scheme == "https" else 80)
    what = f"proxy {via.hostname}:{port}" if proxy else endpoint
    if not host:
        return f"{what} names no host"
    answer: list[str | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
            answer.append(None)
        except OSError as e:
            answer.append(f"{what} not reachable: {e.strerror or type(e).__name__}")

    thread = threading.Thread(target=probe, name="ftcli-hub-probe", daemon=True)  # DNS has no timeout of its own
    thread.start()
    thread.join(PROBE_TIMEOUT_S + 0.5)
    return answer[0] if answer else f"{what} did not answer within {PROBE_TIMEOUT_S:g} s"


def offline_for(name: str | None) -> str | None:
    """Why `name` cannot be fetched from the Hub now (so load it from the local HF cache only), or None: it is
    a local path, or the Hub answers."""
    return unreachable() if is_hub_id(name) else None


def no_connection(what: str, why: str) -> str:
    """The one-line error for a hub load that the local HF cache could not serve offline."""
    return (f"no connection to the Hub ({why}) and {what} is not in the local HF cache; point "
            "model.id/tokenizer/data.path at a local copy or UC volume")
