"""Log a Hugging Face checkpoint or a LoRA adapter to MLflow as a chat model (`ftcli register`'s logging).

    log_chat_model(model_dir, base=None, run=..., ...)     a full checkpoint: its model files copied as is
    log_chat_model(adapter_dir, base=BaseRef, run=..., ...) a LoRA adapter: PEFT model, base referenced

Both go through MLflow's transformers flavor with `task="llm/v1/chat"` (`Model.log(flavor=
mlflow.transformers)`, the call `mlflow.transformers.log_model` makes, see `_log`), so the model
carries a chat signature (inputs and outputs), an input example (a chat request from the training
data) and serves OpenAI-style chat completions. It is the one fluent MLflow call ftcli makes (it
takes no client); `_active_run` scopes it to the given run and store.

An adapter over a local base is logged with `base_model_path` (adapter + tokenizer + a path to the
base), so it loads only where that path exists (this machine, a shared disk): MLflow's other route
for it saves the PEFT-wrapped base (`base_layer`/`lora_*` keys) as the base weights, which load
back as a silently broken model. An adapter over a hub base is logged over a base built without
weights; MLflow saves the adapter and the base's id and revision.

Two workarounds for the installed MLflow (3.17, tested up to transformers 5.17) live in
`_mlflow_compat`, each applied only while logging and only when needed:
- the installed transformers (5.24) lists pipeline classes lazily (a dotted string), which
  MLflow's local-checkpoint path reads as a class; the string is resolved to the class.
- for an adapter over a hub base, MLflow records the hub's *latest* commit of the base; ftcli pins
  the revision the run trained on (run.json base_model.revision).
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ftcli import __version__
from ftcli.config.errors import UserError
from ftcli.artifacts.resolve import BaseRef
from ftcli.config.safe_files import refuse_links
from ftcli.artifacts.tracking import first_line


def log_chat_model(model_dir: Path, *, base: BaseRef | None, run, tracking_uri: str, metadata: dict, dtype: str,
                   model_class: str = "causal_lm", trust_remote_code: bool = False,
                   input_example: dict | None = None, files: list[str] | None = None):
    """Log `model_dir` into `run`: with base=None a full HF checkpoint (`files` copied as is, by
    default select_model_files' choice; `dtype` the fallback when config.json names none); else a
    LoRA adapter over `base`, which is referenced (a local dir, or a hub id at its pinned revision),
    never copied. `input_example`: an llm/v1/chat request ({"messages": [...]}) saved with the model."""
    if base is None:
        files = select_model_files(model_dir, model_dir).keep if files is None else files
        with _staged(Path(model_dir), files) as stage:
            return _log(str(stage), _checkpoint_dtype(model_dir, dtype), run=run, tracking_uri=tracking_uri,
                        metadata=metadata, adapter=False, input_example=input_example)
    from transformers import AutoTokenizer

    model = _adapter_model(model_dir, base, dtype=dtype, model_class=model_class, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    if not base.local:
        tokenizer.name_or_path = base.id  # referenced with the base (MLflow saves no components here)
    info = _log({"model": model, "tokenizer": tokenizer}, model.dtype, run=run, tracking_uri=tracking_uri,
                metadata=metadata, adapter=True, pinned_revision=None if base.local else base.revision,
                input_example=input_example,
                **({"base_model_path": str(base.path)} if base.local else {}))
    assert "model_binary" not in info.flavors.get("transformers", {}), "adapter mode must not save base weights"
    return info


def model_metadata(mode: str, base: BaseRef | None) -> dict[str, str]:
    """What the logged model's MLmodel metadata records about ftcli's work (also the version's tags)."""
    metadata = {"ftcli_version": __version__, "ftcli_mode": mode}
    if base is not None:
        metadata["ftcli_base_model"] = str(base.path or base.id)
        if base.revision:
            metadata["ftcli_base_revision"] = base.revision
    return metadata


# ------------------------------------------------------------------------------- input example
FALLBACK_EXAMPLE = {"messages": [{"role": "user", "content": "Hello! What can you do?"}]}
EXAMPLE_SCAN_ROWS = 1000  # rows read to find one with a user turn before giving up


def chat_request_from_data(recipe: dict | None) -> tuple[dict | None, str | None]:
    """(request, None): the first training row with a user turn, as an llm/v1/chat request
    `{"messages": [...]}` of the turns before its first assistant reply (role and content); or
    (None, why) when the recipe's data cannot be read here (offline hub data, a moved file, a
    synthetic source) or holds no such row. Hub data is read as a stream (the first rows only),
    or from the HF cache when HF_HUB_OFFLINE is set."""
    from ftcli.config.recipe import DataConfig

    if not recipe or not recipe.get("data"):
        return None, "no training recipe to read the data from"
    try:
        data = DataConfig.model_validate(recipe["data"])
    except ValueError as e:
        return None, f"the recipe's data section does not validate ({first_line(e)})"
    from ftcli.data.pipeline import row_char_limit

    problems = []
    for src in data.source_list():
        if src.source == "synthetic":
            problems.append("synthetic data has no chat turns")
            continue
        try:
            request = _first_chat_request(src, row_char_limit(data))
        except Exception as e:  # noqa: BLE001 - unreadable data never blocks registering
            problems.append(f"cannot read {src.label} ({first_line(e)})")
            continue
        if request is not None:
            return request, None
        problems.append(f"no row with a user turn in the first {EXAMPLE_SCAN_ROWS} rows of {src.label}")
    return None, "; ".join(problems)


def _first_chat_request(src, max_row_chars: int) -> dict | None:
    """The turns before the first assistant reply of `src`'s first row that has a user turn (and no
    more than `max_row_chars` characters, as training reads rows: data.max_row_chars)."""
    from ftcli.data import sources
    from ftcli.data.formats import conversation
    from ftcli.data.pipeline import row_chars
    from ftcli.data.validate import BadRow

    if src.source == "hub" and not src.streaming and not _hf_offline():
        src = src.model_copy(update={"streaming": True})
    rows, _ = sources.open_rows(src, limit=EXAMPLE_SCAN_ROWS)
    for _, row in rows:
        try:
            conv = conversation(row, src.format, src.messages_field, src.tools_field)
        except BadRow:
            continue
        if row_chars(conv) > max_row_chars:
            continue
        messages = conv.messages
        prompt = []
        for m in messages or []:
            if m["role"] == "assistant":
                break
            prompt.append({"role": m["role"], "content": m.get("content") or ""})
        if any(m["role"] == "user" for m in prompt):
            return {"messages": prompt}
    return None


def _hf_offline() -> bool:
    import datasets

    return bool(datasets.config.HF_HUB_OFFLINE)


# ------------------------------------------------------------------------------ what is uploaded
# The files a model needs, by name: MLflow copies a checkpoint dir as a whole, so register hands it
# a dir holding only these (anything else in final/ - notes, keys, logs - stays on this machine). Weights are
# safetensors only: a pickle (pytorch_model*.bin, adapter_model.bin) would be unpickled by whatever serves the model,
# so it never leaves (a dir whose only weights are pickles is refused by the resolver: refuse_pickled_weights).
MODEL_FILE_PATTERNS = (
    "config.json", "generation_config.json",  # the model
    "*.safetensors", "*.safetensors.index.json",  # weights
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",  # the tokenizer
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "*.tiktoken",
    "chat_template.jinja", "chat_template.json", "additional_chat_templates/*.jinja",  # chat templates
    "preprocessor_config.json", "processor_config.json",  # a vision-language model's processor
    "adapter_config.json", "adapter_model.safetensors",  # a LoRA adapter
    "merge.json",  # ftcli's own metadata (merge-lora's report)
)


@dataclass
class ModelFiles:
    """What `select_model_files` found in a model dir: names relative to it."""

    keep: list[str]
    skipped: list[str]


def select_model_files(model_dir: Path, root: Path) -> ModelFiles:
    """The files of `model_dir` that a model needs (MODEL_FILE_PATTERNS; `*.py` too when config.json
    names custom code in `auto_map`), and the rest, skipped. A needed file that is a link resolving
    outside `root` (the run dir, or the model dir itself) is a UserError: what leaves this machine is
    what the run dir holds, not what a link in it points at."""
    model_dir, root = Path(model_dir), Path(root).resolve()
    patterns = MODEL_FILE_PATTERNS + (("*.py",) if _has_custom_code(model_dir) else ())
    keep, skipped = [], []
    for path in _entries(model_dir):
        name = path.relative_to(model_dir).as_posix()
        if not (path.is_file() and any(fnmatch.fnmatchcase(name, p) for p in patterns)):
            skipped.append(name + ("/" if path.is_dir() else ""))
            continue
        target = path.resolve()
        if not target.is_relative_to(root):
            raise UserError(f"{path} links outside {root} (to {target}); register uploads only files inside "
                            "the run dir: copy the file in (cp -L) or remove the link")
        refuse_links([target], where="what register uploads", fix="replace it with a copy (cp, not ln)")
        keep.append(name)
    return ModelFiles(keep=keep, skipped=skipped)


def _entries(model_dir: Path) -> Iterator[Path]:
    """The entries of `model_dir`, and of its additional_chat_templates/ (the one subdir a model has)."""
    for path in sorted(model_dir.iterdir()):
        if path.name == "additional_chat_templates" and path.is_dir() and not path.is_symlink():
            yield from sorted(path.iterdir())
        else:
            yield path


def _has_custom_code(model_dir: Path) -> bool:
    try:
        return bool(json.loads((model_dir / "config.json").read_text()).get("auto_map"))
    except (OSError, ValueError, AttributeError):
        return False


@contextlib.contextmanager
def _staged(model_dir: Path, files: list[str]) -> Iterator[Path]:
    """A temporary dir named like `model_dir` holding links to `files` only; MLflow copies what
    the links point at (shutil.copytree follows them), so nothing else of `model_dir` is read."""
    with tempfile.TemporaryDirectory(prefix="ftcli-register-") as tmp:
        stage = Path(tmp) / model_dir.name
        for name in files:
            (stage / name).parent.mkdir(parents=True, exist_ok=True)
            (stage / name).symlink_to((model_dir / name).resolve())
        yield stage


# ------------------------------------------------------------------------------------- checks
def missing_files(model_dir: Path, *, adapter: bool) -> list[str]:
    """What log_chat_model and a chat endpoint need that `model_dir` lacks: the weights (or the
    adapter), the tokenizer and its chat template."""
    d = model_dir
    missing = []
    if adapter:
        if not (d / "adapter_config.json").is_file():
            missing.append("adapter_config.json")
        if not (d / "adapter_model.safetensors").is_file():
            missing.append("adapter_model.safetensors")
    else:
        if not (d / "config.json").is_file():
            missing.append("config.json")
        if not any(d.glob("*.safetensors")):
            missing.append("model weights (*.safetensors)")
    if not any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        missing.append("tokenizer (tokenizer.json)")
    elif not _has_chat_template(d):
        missing.append("chat template (chat_template.jinja)")
    return missing


def _has_chat_template(d: Path) -> bool:
    if (d / "chat_template.jinja").is_file() or (d / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((d / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def check_remote_code(model_dir: Path, trust_remote_code: bool) -> None:
    """Refuse a checkpoint whose class is not in transformers unless the recipe trusts remote code
    (MLflow would load it with trust_remote_code=True)."""
    import transformers

    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{model_dir / 'config.json'}: cannot read it ({e})") from None
    archs = config.get("architectures") or []
    if not archs:
        raise UserError(f"{model_dir / 'config.json'} has no 'architectures'; MLflow needs the model class")
    custom = bool(config.get("auto_map")) or not hasattr(transformers, archs[0])
    if custom and not trust_remote_code:
        raise UserError(
            f"{model_dir} needs custom model code ({archs[0]}); loading it runs that code, so register it "
            "only with a recipe that sets model.trust_remote_code: true"
        )


def _log(transformers_model, torch_dtype, *, run, tracking_uri: str, metadata: dict, adapter: bool,
         pinned_revision: str | None = None, input_example: dict | None = None, **extra):
    """mlflow.transformers.log_model's own call, `Model.log(flavor=mlflow.transformers, ...)`, made
    here to turn off MLflow's serving check of the input example. For a model object (an adapter)
    that check loads the logged model a second time and generates a full-length reply (a minute on
    the tiny CPU model; for an adapter over a hub base it downloads the base's weights); for a
    checkpoint dir MLflow skips it itself. Register's probe generation has run on the model already."""
    import mlflow
    from mlflow.models import Model

    with _active_run(tracking_uri, run), _mlflow_compat(pinned_revision), _quiet_card_lookup():
        return Model.log(
            artifact_path=None, flavor=mlflow.transformers, transformers_model=transformers_model, torch_dtype=torch_dtype,
            name="model", task="llm/v1/chat", run_id=run.info.run_id,
            metadata=dict(metadata),  # a copy: MLflow adds to it
            input_example=input_example,
            validate_serving_input=False,
            pip_requirements=_pip_requirements(adapter), **extra,
        )


@contextlib.contextmanager
def fluent_tracking_uri(tracking_uri: str) -> Iterator[None]:
    """MLflow's fluent (global) tracking URI is `tracking_uri` for the block, the old one afterwards (set_tracking_uri
    exports it as $MLFLOW_TRACKING_URI, so that variable's old value is the old URI). Model.log opens the store
    there, and so does the registry's create_model_version to find a logged model (a client of its own)."""
    import mlflow

    previous_uri = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(tracking_uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous_uri)


@contextlib.contextmanager
def _active_run(tracking_uri: str, run) -> Iterator[None]:
    """`run` as MLflow's active run at `tracking_uri`, for the block. log_model takes no client:
    Model.log opens the store at the fluent tracking URI and files the LoggedModel under the active
    run's experiment (with none active: the default experiment, not the run's). So the block sets the
    fluent URI and resumes the run with mlflow.start_run(run_id=...). Afterwards the fluent URI is
    the old one (mlflow.set_tracking_uri exports the URI it sets as $MLFLOW_TRACKING_URI, so that
    variable's old value is the old URI), $MLFLOW_RUN_ID (end_run clears it) is back, and the run
    has its own status and end time again (resuming marks it RUNNING, ending it FINISHED or FAILED)."""
    import mlflow
    from mlflow import MlflowClient

    run_id_env = os.environ.get("MLFLOW_RUN_ID")
    with fluent_tracking_uri(tracking_uri):
        try:
            with mlflow.start_run(run_id=run.info.run_id, log_system_metrics=False):
                yield
        finally:
            MlflowClient(tracking_uri).set_terminated(run.info.run_id, run.info.status, run.info.end_time)
        if run_id_env is not None:
            os.environ["MLFLOW_RUN_ID"] = run_id_env


# MLflow's warnings when the model has no Hub repo to read a card or a license from (a local run's model):
# nothing for the user to do; register lists what it logged.
NO_HUB_CARD = ("The model card could not be retrieved from the hub", "Unable to find license information")


class _DropNoHubCard(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(NO_HUB_CARD)


@contextlib.contextmanager
def _quiet_card_lookup() -> Iterator[None]:
    """MLflow's model-card and license warnings dropped on its own logger (its public logging), for the block."""
    logger, drop = logging.getLogger("mlflow.transformers"), _DropNoHubCard()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


@contextlib.contextmanager
def _mlflow_compat(pinned_revision: str | None = None) -> Iterator[None]:
    """The two MLflow workarounds described in the module docstring, active only inside the block."""
    import mlflow.transformers.flavor_config as flavor_config
    import transformers.pipelines as pipelines

    original_check_task = pipelines.check_task
    original_commit = flavor_config.get_latest_commit_for_repo

    def check_task(task):
        name, meta, options = original_check_task(task)
        impl = meta.get("impl")
        if isinstance(impl, str):  # "transformers.pipelines.text_generation.TextGenerationPipeline"
            module, _, cls = impl.rpartition(".")
            meta = {**meta, "impl": getattr(importlib.import_module(module), cls)}
        return name, meta, options

    pipelines.check_task = check_task
    if pinned_revision:
        flavor_config.get_latest_commit_for_repo = lambda repo: pinned_revision
    try:
        yield
    finally:
        pipelines.check_task = original_check_task
        flavor_config.get_latest_commit_for_repo = original_commit


def _pip_requirements(adapter: bool) -> list[str]:
    """Pinned to what is installed here (local tags like +cpu dropped: a GPU server has its own)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    reqs = []
    for pkg in ("transformers", "torch", "accelerate", "safetensors") + (("peft",) if adapter else ()):
        try:
            reqs.append(f"{pkg}=={Version(version(pkg)).base_version}")
        except PackageNotFoundError:
            continue
    return reqs


def _checkpoint_dtype(model_dir: Path, fallback: str):
    import torch

    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    text_cfg = config.get("text_config") or {}
    name = config.get("dtype") or config.get("torch_dtype") or text_cfg.get("dtype") or text_cfg.get("torch_dtype")
    dtype = getattr(torch, str(name or fallback), None)
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, fallback)


def _adapter_model(adapter_dir: Path, base: BaseRef, *, dtype: str, model_class: str, trust_remote_code: bool):
    """The PEFT model MLflow logs. A hub base is built without its weights: MLflow saves only the
    adapter and a reference to the base (checked after logging)."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig

    from ftcli.model.build import DTYPES, auto_class, refuse_pickled_weights

    refuse_pickled_weights(adapter_dir, "LoRA adapter", "adapter")  # before the base loads: PEFT would unpickle it
    torch_dtype = DTYPES.get(dtype, torch.bfloat16)
    cls = auto_class(model_class)
    if base.local:
        refuse_pickled_weights(base.path, f"the base {base}")
        model = cls.from_pretrained(str(base.path), dtype=torch_dtype, trust_remote_code=trust_remote_code,
                                    use_safetensors=True)
    else:
        try:
            config = AutoConfig.from_pretrained(base.id, revision=base.revision, trust_remote_code=trust_remote_code)
        except OSError as e:
            raise UserError(
                f"cannot load the config of the base {base} ({first_line(e)}); it must be on the hub or in the HF cache"
            ) from None
        if getattr(config, "quantization_config", None) is not None:
            del config.quantization_config  # no weights are loaded, so nothing to dequantize
        with torch.device("meta"):
            model = cls.from_config(config, dtype=torch_dtype, trust_remote_code=trust_remote_code)
        model.to_empty(device="cpu")  # allocated, never written or saved
        model.config.name_or_path = model.name_or_path = base.id  # MLflow references the base by this
    return PeftModel.from_pretrained(model, str(adapter_dir))
