"""No Hub: detected once (HF_HUB_OFFLINE, or one TCP probe, here to a closed local port), then hub ids load
from the local HF cache only and otherwise fail in one line with what to do, without the retries."""

from __future__ import annotations

import socket

import pytest

from ftcli import hub
from ftcli.config.errors import UserError

ADVICE = "point model.id/tokenizer/data.path at a local copy or UC volume"


@pytest.fixture
def closed_port(monkeypatch, tmp_path):
    """HF_ENDPOINT at a local port nothing listens on (never a real host), an empty HF cache, a fresh probe."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hub.unreachable.cache_clear()
    yield port
    hub.unreachable.cache_clear()


def _recipe(*sets):
    from ftcli.config.recipe import load_recipe

    return load_recipe("tiny-qwen-cpu", list(sets))


def _sections(*sets):
    """The model and data sections `load_tokenizer` takes."""
    recipe = _recipe(*sets)
    return recipe.model, recipe.data


def test_a_closed_port_is_no_hub_and_is_probed_once(closed_port, monkeypatch):
    calls = []
    real = socket.create_connection
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: calls.append(a) or real(*a, **k))
    why = f"http://127.0.0.1:{closed_port} not reachable: Connection refused"
    assert hub.unreachable() == why and hub.offline_for("someorg/some-model") == why
    assert calls == [(("127.0.0.1", closed_port),)]  # asked once per process


def test_tokenizer_from_an_unreachable_hub_is_one_line(closed_port):
    from ftcli.data import load_tokenizer

    with pytest.raises(UserError) as e:
        load_tokenizer(*_sections("model.tokenizer=someorg/not-cached"))
    assert str(e.value) == (f"no connection to the Hub (http://127.0.0.1:{closed_port} not reachable: Connection "
                            f"refused) and tokenizer 'someorg/not-cached' is not in the local HF cache; {ADVICE}")


def test_hf_hub_offline_needs_no_probe(closed_port, monkeypatch):
    from ftcli.model.build import load_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: pytest.fail("probed although HF_HUB_OFFLINE"))
    cfg = _recipe("model.init=pretrained", "model.id=someorg/not-cached").model
    with pytest.raises(UserError, match=r"^no connection to the Hub \(HF_HUB_OFFLINE is set\) and model\.id "
                                        r"'someorg/not-cached' is not in the local HF cache; point"):
        load_config(cfg)


def test_hub_dataset_without_hub_is_one_line_before_datasets_tries(closed_port):
    from ftcli.data import sources

    src = _recipe("data.source=hub", "data.path=someorg/some-data").data
    with pytest.raises(UserError, match=r"^no connection to the Hub \(.*Connection refused\) and hub dataset "
                                        r"'someorg/some-data' is not in the local HF cache; .* \(or set HF_HUB_OFFLINE=1 "
                                        r"to read what the HF cache holds\)$"):
        sources.open_rows(src)


def test_local_paths_never_probe(closed_port, monkeypatch):
    from ftcli.data import load_tokenizer

    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: pytest.fail("a local path probed the Hub"))
    assert load_tokenizer(*_sections()).eos_token == "<|im_end|>"  # pkg://assets/tokenizer-qwen
    assert not hub.is_hub_id("/nonexistent/tokenizer") and hub.is_hub_id("openai/gpt-oss-20b")
