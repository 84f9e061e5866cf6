"""Build or load the model a recipe names; shared by both trainers, merge-lora and benchmarks.

Three sources, one function:
- hub id + revision, or a local directory: `from_pretrained` (MXFP4 checkpoints dequantized to the
  recipe dtype with `Mxfp4Config(dequantize=True)`, pure torch, so it also runs on CPU);
- `init: random` + a config.json: random weights, on `device` (default CPU). The FSDP2 trainer does not
  come here for random init: it builds on the meta device, shards, and materializes only each rank's
  shard (ftcli.model.parallelize.build_model), so a 27B config never exists whole anywhere.

Weights load from safetensors only (`use_safetensors=True`): a pickled `pytorch_model.bin` is refused in one line,
never unpickled (transformers would unpickle it with torch.load(weights_only=True), an allowlist, but a pickle
from anywhere is still a parser of code-shaped data ftcli does not need), and a safetensors file whose header
lies about its tensors is one line naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ftcli.config.errors import UserError
from ftcli.config.recipe import ModelConfig, resolve_path

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def auto_class(model_class: str):
    import transformers

    return {
        "causal_lm": transformers.AutoModelForCausalLM,
        "image_text_to_text": transformers.AutoModelForImageTextToText,
    }[model_class]


def load_config(cfg: ModelConfig):
    """The transformers config: from the recipe's config.json (random init) or the pretrained source."""
    from transformers import AutoConfig

    if cfg.init == "random":
        path = Path(resolve_path(cfg.config))
        if not path.is_file():
            raise UserError(f"model.config: {cfg.config} not found")
        data: dict[str, Any] = json.loads(path.read_text())
        model_type = data.pop("model_type", cfg.model_type)
        config = AutoConfig.for_model(model_type, **data)
    else:
        from ftcli import hub

        offline = hub.offline_for(resolve_path(cfg.id))  # no Hub: the local HF cache only, no retries
        try:
            config = AutoConfig.from_pretrained(
                resolve_path(cfg.id), revision=cfg.revision, trust_remote_code=cfg.trust_remote_code,
                local_files_only=bool(offline),
            )
        except OSError as e:
            if offline:
                raise UserError(hub.no_connection(f"model.id {cfg.id!r}", offline)) from None
            raise UserError(f"model.id {cfg.id!r}: cannot load its config ({str(e).splitlines()[0]})") from None
    for key, value in cfg.config_overrides.items():
        _set_config_value(config, key, value)
    if config.model_type != cfg.model_type:
        raise UserError(f"model.model_type is {cfg.model_type!r} but the config says {config.model_type!r}")
    return config


def _set_config_value(config, key: str, value: Any) -> None:
    """`num_hidden_layers` applies to the text config of a VLM as well (the usual intent)."""
    targets = [config]
    text = getattr(config, "text_config", None)
    if text is not None and not hasattr(config, key):
        targets = [text]
    for target in targets:
        setattr(target, key, value)
    if key == "num_hidden_layers":  # keep layer_types consistent with the new depth
        for target in targets:
            types = getattr(target, "layer_types", None)
            if types:
                period = _layer_period(types)
                target.layer_types = [types[i % period] for i in range(value)]


def _layer_period(types: list[str]) -> int:
    for p in range(1, len(types) + 1):
        if all(types[i] == types[i % p] for i in range(len(types))):
            return p
    return len(types)


def load_model(
    cfg: ModelConfig,
    *,
    attn_implementation: str | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> nn.Module:
    """The recipe's model, on `device` (default: CPU)."""
    dtype = dtype or DTYPES[cfg.dtype]
    cls = auto_class(cfg.model_class)
    attn = attn_implementation or (None if cfg.attn_implementation == "auto" else cfg.attn_implementation)
    if cfg.init == "random":
        config = load_config(cfg)
        config.use_cache = False
        kwargs = {"dtype": dtype, "trust_remote_code": cfg.trust_remote_code}
        if attn:
            kwargs["attn_implementation"] = attn
        with torch.device(device or "cpu"):
            return cls.from_config(config, **kwargs)
    if cfg.quantization == "mxfp4":  # experts kept in MXFP4 (LoRA): ftcli.model.mxfp4_lora reads the shards
        from ftcli.model.mxfp4_lora import load_kept_mxfp4

        return load_kept_mxfp4(cls, local_snapshot(cfg), load_config(cfg), dtype=dtype, device=device or "cpu",
                               attn=attn)
    kwargs = {"revision": cfg.revision, "dtype": dtype, "trust_remote_code": cfg.trust_remote_code, "use_cache": False}
    if attn:
        kwargs["attn_implementation"] = attn
    if cfg.quantization == "mxfp4_dequantize":
        from transformers import Mxfp4Config

        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    if device is not None:
        kwargs["device_map"] = str(device)
    from safetensors import SafetensorError

    from ftcli import hub

    source = resolve_path(cfg.id)
    refuse_pickled_weights(source, f"model.id {cfg.id!r}")
    offline = hub.offline_for(source)
    try:
        return cls.from_pretrained(source, local_files_only=bool(offline), use_safetensors=True, **kwargs)
    except OSError as e:
        if offline:
            raise UserError(hub.no_connection(f"the weights of model.id {cfg.id!r}", offline)) from None
        raise UserError(f"model.id {cfg.id!r}: cannot load weights ({str(e).splitlines()[0]})") from None
    except SafetensorError as e:
        bad = damaged_safetensors(source) if Path(source).is_dir() else None
        why = f"{bad[0]} is not what its header says ({bad[1]})" if bad else str(e).splitlines()[0]
        raise UserError(f"model.id {cfg.id!r}: cannot load weights: {why}; export or download it again") from None


# what a dir's weights are, by kind: (its pickles, its safetensors); PEFT and transformers read a pickle only where no
# safetensors file of that kind is beside it
WEIGHT_FILES = {"model": ("pytorch_model*.bin", "*.safetensors"),
                "adapter": ("adapter_model*.bin", "adapter_model*.safetensors")}


def refuse_pickled_weights(source: str | Path, what: str, weights: str = "model") -> None:
    """A local model dir (weights="model": pytorch_model*.bin) or LoRA adapter dir (weights="adapter":
    adapter_model.bin) whose weights are only pickles, no safetensors: one UserError, before anything reads them.
    Every loader of a base or an adapter calls it (transformers and PEFT would unpickle them)."""
    path = Path(source)
    pickled, safe = WEIGHT_FILES[weights]
    if not path.is_dir() or any(path.glob(safe)):
        return
    pickles = sorted(p.name for p in path.glob(pickled))
    if pickles:
        raise UserError(f"{what}: {path / pickles[0]} is a pickle and there are no safetensors weights; ftcli never "
                        "unpickles a weights file (loading one can run code): convert it to safetensors where you "
                        "trust it (save_pretrained(..., safe_serialization=True)), then point at that")


def damaged_safetensors(model_dir: Path | str) -> tuple[str, str] | None:
    """(file name, safetensors' reason) of the first *.safetensors in `model_dir` whose header does not open
    (offsets past the end, a bad shape or dtype, a truncated header), or None. Reads headers only."""
    from safetensors import SafetensorError, safe_open

    for path in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            return path.name, str(e).splitlines()[0]
    return None


def local_snapshot(cfg: ModelConfig) -> Path:
    """A local directory, or the hub id's snapshot (downloaded, or from the cache when offline) of its safetensors."""
    source = resolve_path(cfg.id)
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download

    from ftcli import hub

    offline = hub.offline_for(source)
    try:
        return Path(snapshot_download(source, revision=cfg.revision, local_files_only=bool(offline),
                                      allow_patterns=["*.json", "model*.safetensors"]))
    except OSError as e:
        if offline:
            raise UserError(hub.no_connection(f"the weights of model.id {cfg.id!r}", offline)) from None
        raise UserError(f"model.id {cfg.id!r}: cannot load weights ({str(e).splitlines()[0]})") from None


def text_final_norm(model: nn.Module) -> nn.Module | None:
    """The text model's norm after its last decoder layer (`norm` beside `layers`), or None."""
    layers = decoder_layers(model)
    name = next(n for n, m in model.named_modules() if m is layers)
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    return getattr(parent, "norm", None)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks, for text classes (`model.model.layers`) and VLM classes
    (`model.model.language_model.layers`)."""
    inner = getattr(model, "model", model)
    for path in ("layers", "language_model.layers", "model.layers"):
        node = inner
        for part in path.split("."):
            node = getattr(node, part, None)
            if node is None:
                break
        if isinstance(node, nn.ModuleList):
            return node
    raise UserError(f"cannot find the decoder layers of {type(model).__name__}")


def text_config(config):
    return getattr(config, "text_config", None) or config


def count_params(model: nn.Module) -> tuple[int, int]:
    """(all parameters, non-embedding parameters: without input embeddings and the LM head)."""
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings()
    head_n = head.weight.numel() if head is not None and head.weight is not model.get_input_embeddings().weight else 0
    return total, total - emb - head_n


def build_empty_model(cfg, dtype: torch.dtype, attn_implementation: str | None = None) -> nn.Module:
    """The recipe's model with parameters on the meta device and real buffers (rotary inv_freq is a
    non-persistent buffer computed in __init__: it is in no checkpoint, so it must stay real)."""
    from accelerate import init_empty_weights

    config = load_config(cfg)
    config.use_cache = False
    if getattr(config, "text_config", None) is not None:
        config.text_config.use_cache = False
    kwargs = {"dtype": dtype, "trust_remote_code": cfg.trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with init_empty_weights(include_buffers=False):
        return auto_class(cfg.model_class).from_config(config, **kwargs)


def vision_tower(model: nn.Module) -> nn.Module | None:
    return getattr(getattr(model, "model", None), "visual", None)


def count_text_params(model: nn.Module) -> int:
    """Non-embedding parameters a text token goes through (the vision tower of a VLM class excluded)."""
    _, non_embedding = count_params(model)
    visual = vision_tower(model)
    return non_embedding - (sum(p.numel() for p in visual.parameters()) if visual is not None else 0)
