"""ftcli.model.build loads weights from safetensors only: a pickled pytorch_model.bin is refused in one line and
never unpickled, and a safetensors file whose header lies is one line naming it (generate, train and plan's
model loads all go through `load_model`)."""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import pytest
import torch

from ftcli.config.errors import UserError

ASSETS = Path(__file__).resolve().parents[3] / "ftcli" / "assets"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads((ASSETS / "tiny-llama3.json").read_text()))
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("model") / "m"
    AutoModelForCausalLM.from_config(config).save_pretrained(out, safe_serialization=True)
    return out


def _cfg(path: Path):
    from ftcli.config.recipe import ModelConfig

    return ModelConfig(id=str(path), model_type="llama", model_class="causal_lm", dtype="float32")


def _rewrite_header(src: Path, dst: Path, edit) -> None:
    blob = src.read_bytes()
    size = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + size])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    dst.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + size:])


def _copy(model_dir: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in model_dir.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_the_saved_model_loads(model_dir):
    from ftcli.model.build import load_model

    model = load_model(_cfg(model_dir))
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.parametrize("lie", ["offset past the end", "header longer than the file"])
def test_a_safetensors_header_that_lies_is_one_line_naming_the_file(model_dir, tmp_path, lie):
    from ftcli.model.build import load_model

    bad = _copy(model_dir, tmp_path / "bad")
    if lie == "offset past the end":
        def edit(header):
            name = next(k for k in header if k != "__metadata__")
            header[name]["data_offsets"][1] += 10**9
        _rewrite_header(model_dir / "model.safetensors", bad / "model.safetensors", edit)
    else:
        blob = (model_dir / "model.safetensors").read_bytes()
        (bad / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + blob[8:])
    with pytest.raises(UserError) as err:
        load_model(_cfg(bad))
    message = str(err.value)
    assert message.startswith(f"model.id '{bad}': cannot load weights: model.safetensors is not what its header says (")
    assert message.endswith("); export or download it again") and "\n" not in message


def test_a_pickled_pytorch_model_bin_is_refused_and_never_unpickled(model_dir, tmp_path, monkeypatch):
    """The pickle would run code when unpickled (its reduce calls a function that records it): it never runs, and
    neither torch.load nor pickle is asked to read it."""
    from safetensors.torch import load_file

    from ftcli.model.build import load_model

    ran = []

    class Payload:
        def __reduce__(self):
            return (ran.append, ("unpickled",))

    pickled = _copy(model_dir, tmp_path / "pickled")
    state = load_file(str(pickled / "model.safetensors"))
    (pickled / "model.safetensors").unlink()
    with open(pickled / "pytorch_model.bin", "wb") as f:
        pickle.dump({"state": state, "payload": Payload()}, f)

    def no_unpickling(*args, **kwargs):
        raise AssertionError("a weights pickle was read")

    monkeypatch.setattr(torch, "load", no_unpickling)
    monkeypatch.setattr(pickle, "load", no_unpickling)
    with pytest.raises(UserError) as err:
        load_model(_cfg(pickled))
    assert str(err.value) == (
        f"model.id '{pickled}': {pickled / 'pytorch_model.bin'} is a pickle and there are no safetensors weights; "
        "ftcli never unpickles a weights file (loading one can run code): convert it to safetensors where you trust "
        "it (save_pretrained(..., safe_serialization=True)), then point at that")
    assert ran == []
