"""ftcli.model.build loads weights from safetensors only: a pickled pytorch_model.bin is refused in one line and
never unpickled, and a safetensors file whose header lies is one line naming it (generate, train and plan's
model loads all go through `load_model`). A LoRA adapter whose weights are only a pickled adapter_model.bin is refused
the same way before PEFT could read it, wherever an adapter is loaded: the resolver (generate, chat, merge-lora,
register), register's logging (and its local base) and a LoRA --resume. register never uploads a pickle: a full model
dir whose only weights are pytorch_model*.bin is refused by the resolver, and a pickle beside safetensors stays here."""

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
    dst.mkdir(parents=True)
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


RAN: list[str] = []  # what a Payload's unpickling ran: stays empty


class Payload:
    """Unpickling it runs code (its reduce calls a function that records it)."""

    def __reduce__(self):
        return (RAN.append, ("unpickled",))


@pytest.fixture
def no_unpickling(monkeypatch):
    """torch.load and pickle.load fail the test when asked to read anything; nothing a Payload runs is recorded."""
    def refuse(*args, **kwargs):
        raise AssertionError("a weights pickle was read")

    RAN.clear()
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    yield
    assert RAN == []


def _pickle_at(path: Path, state: dict) -> None:
    with open(path, "wb") as f:
        pickle.dump({"state": state, "payload": Payload()}, f)


def _refusal(what: str, pickled: Path) -> str:
    return (f"{what}: {pickled} is a pickle and there are no safetensors weights; ftcli never unpickles a weights "
            "file (loading one can run code): convert it to safetensors where you trust it (save_pretrained(..., "
            "safe_serialization=True)), then point at that")


def test_a_pickled_pytorch_model_bin_is_refused_and_never_unpickled(model_dir, tmp_path, no_unpickling):
    from safetensors.torch import load_file

    from ftcli.model.build import load_model

    pickled = _copy(model_dir, tmp_path / "pickled")
    state = load_file(str(pickled / "model.safetensors"))
    (pickled / "model.safetensors").unlink()
    _pickle_at(pickled / "pytorch_model.bin", state)
    with pytest.raises(UserError) as err:
        load_model(_cfg(pickled))
    assert str(err.value) == _refusal(f"model.id '{pickled}'", pickled / "pytorch_model.bin")


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory):
    """A LoRA adapter of the tiny model, saved as safetensors."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    out = tmp_path_factory.mktemp("adapter") / "a"
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(out, safe_serialization=True)
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(model_dir)}))
    return out


def _pickled_adapter(adapter_dir: Path, dst: Path) -> Path:
    from safetensors.torch import load_file

    pickled = _copy(adapter_dir, dst)
    state = load_file(str(pickled / "adapter_model.safetensors"))
    (pickled / "adapter_model.safetensors").unlink()
    _pickle_at(pickled / "adapter_model.bin", state)
    return pickled


def test_a_pickled_adapter_is_refused_by_the_resolver_of_every_command(adapter_dir, tmp_path, no_unpickling):
    """generate and chat (model_source), merge-lora and register (locate): one line, before the base loads."""
    from ftcli.artifacts.merge import merge_lora
    from ftcli.artifacts.resolve import locate, model_source

    assert locate(adapter_dir).kind == "adapter"  # the safetensors adapter resolves
    pickled = _pickled_adapter(adapter_dir, tmp_path / "pickled")
    expected = _refusal("LoRA adapter", pickled / "adapter_model.bin")
    for resolve in (locate, lambda p: model_source(str(p)), lambda p: merge_lora(p, output=tmp_path / "merged")):
        with pytest.raises(UserError) as err:
            resolve(pickled)
        assert str(err.value) == expected
    assert not (tmp_path / "merged").exists()


def test_register_logging_refuses_a_pickled_adapter_and_a_pickled_local_base(model_dir, adapter_dir, tmp_path,
                                                                               no_unpickling):
    """MLflow logging builds the PEFT model itself (`_adapter_model`): the adapter and a local base are checked
    there too, before transformers or PEFT reads either."""
    from safetensors.torch import load_file

    from ftcli.artifacts.mlflow_model import _adapter_model
    from ftcli.artifacts.resolve import BaseRef

    pickled = _pickled_adapter(adapter_dir, tmp_path / "pickled")
    with pytest.raises(UserError) as err:
        _adapter_model(pickled, BaseRef(path=model_dir), dtype="float32", model_class="causal_lm",
                       trust_remote_code=False)
    assert str(err.value) == _refusal("LoRA adapter", pickled / "adapter_model.bin")

    base = _copy(model_dir, tmp_path / "base")
    state = load_file(str(base / "model.safetensors"))
    (base / "model.safetensors").unlink()
    _pickle_at(base / "pytorch_model.bin", state)
    with pytest.raises(UserError) as err:
        _adapter_model(adapter_dir, BaseRef(path=base), dtype="float32", model_class="causal_lm",
                       trust_remote_code=False)
    assert str(err.value) == _refusal(f"the base {base}", base / "pytorch_model.bin")


def test_a_lora_resume_from_a_checkpoint_with_a_pickled_adapter_is_refused(adapter_dir, tmp_path, no_unpickling):
    from ftcli.train.checkpoint import resolve_resume

    run = tmp_path / "run"
    checkpoint = _pickled_adapter(adapter_dir, run / "checkpoints" / "checkpoint-3")
    (checkpoint / "trainer_state.json").write_text("{}")
    for resume in ("latest", str(checkpoint), str(run / "checkpoints")):
        with pytest.raises(UserError) as err:
            resolve_resume(run, resume, kind="trl")
        assert str(err.value) == _refusal("--resume", checkpoint / "adapter_model.bin")
    (checkpoint / "adapter_model.bin").unlink()
    (checkpoint / "adapter_model.safetensors").write_bytes((adapter_dir / "adapter_model.safetensors").read_bytes())
    assert resolve_resume(run, "latest", kind="trl") == checkpoint


def test_register_refuses_a_full_model_dir_whose_only_weights_are_a_pickle(model_dir, tmp_path, no_unpickling):
    """`ftcli register` of a full model dir with only pytorch_model.bin: one line, before MLflow (a serving endpoint
    would unpickle it); beside safetensors, the pickle is not among the files register uploads."""
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from ftcli.artifacts.mlflow_model import missing_files, select_model_files
    from ftcli.cli import app

    pickled = _copy(model_dir, tmp_path / "pickled")
    state = load_file(str(pickled / "model.safetensors"))
    (pickled / "model.safetensors").unlink()
    _pickle_at(pickled / "pytorch_model.bin", state)
    (pickled / "tokenizer.json").write_text("{}")
    (pickled / "chat_template.jinja").write_text("{{ messages }}")
    store = tmp_path / "mlruns"
    res = CliRunner().invoke(app, ["register", str(pickled), "--name", "m", "--tracking-uri", f"file:{store}"])
    assert res.exit_code == 2
    assert res.stderr.strip() == "error: " + _refusal("model", pickled / "pytorch_model.bin")
    assert not store.exists()  # refused before MLflow was reached
    assert missing_files(pickled, adapter=False) == ["model weights (*.safetensors)"]

    (pickled / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
    (pickled / "pytorch_model.bin.index.json").write_text("{}")
    (pickled / "adapter_model.bin").write_bytes(b"")
    assert missing_files(pickled, adapter=False) == []
    files = select_model_files(pickled, pickled)
    assert files.keep == ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
                          "tokenizer.json"]
    assert files.skipped == ["adapter_model.bin", "pytorch_model.bin", "pytorch_model.bin.index.json"]
