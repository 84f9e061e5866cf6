"""`ftcli register`: log a trained model to MLflow as a chat model and register a new version.

What is logged depends on what training wrote:

    full run    <run>/final: HF checkpoint      -> logged as is (files copied byte for byte)
    LoRA run    <run>/final: adapter, + a base  -> "merged" (default when the base is local or
                                                   random-init): ftcli.merge.merge_lora writes
                                                   <run>/merged, logged like a full checkpoint
                                                -> "adapter" (--adapter-only, default for a hub
                                                   base): the PEFT model; the base is referenced,
                                                   not copied (hub id + pinned revision, or the
                                                   local base dir)
    model dir   any HF checkpoint or adapter    -> the same, with no training run to attach to

The model (ftcli.mlflow_model: chat signature, OpenAI-style chat completions when served) is logged
into the training run recorded in run.json, so the version, the recipe params and the training
metrics sit on one run; without one, a new run gets the (scrubbed) recipe params and run.json's
summary metrics. Everything else goes through one `MlflowClient(tracking_uri, registry_uri)`.

Where: the tracking store is --tracking-uri, else the training run's (run.json), else
$MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db; the registry is --registry-uri, else
$MLFLOW_REGISTRY_URI, else the tracking store.

Order of work: every cheap check runs before anything is merged or uploaded.

    model name, alias name -> run dir / model files -> mode rules -> reach MLflow (5 s, no retries)
    -> alias free (or --force) -> [merge] -> probe -> log the model -> create the version -> set the alias

The probe: one greedy generation (ftcli.generate.sample_greedy) on the model to be logged, from the
recipe's first `eval.samples` prompt or a default one; a model that fails to load or ends its turn
before a single token stops the registration in one line. (An adapter over a hub base is not
probed: register never downloads base weights.) The logged input example is a real chat request:
the first training row with a user turn, cut before its first assistant reply; a fixed request,
with a warning, when the data cannot be read here.

Unity Catalog (`--registry-uri databricks-uc`):
- the name is `catalog.schema.model`; each part follows UC's object-name rules (at most 255
  characters; no period, space, '/', ASCII control character or DEL). UC stores names lowercase,
  so ftcli lowercases the name.
- a version needs a signature with inputs and outputs; checked after logging, before registering.
- an adapter over a hub base makes UC download the base weights at registration (MLflow persists
  them on the registering machine, then uploads the full model): only with an explicit
  `--adapter-only`; by default it is refused with a pointer to `--merged`. An adapter over a local
  base cannot go to UC at all (UC cannot read a local path): `--merged`.

Secrets: no environment variable is logged; recipe `compute.secrets` and `compute.env_variables`
values are "***" in logged params, and credentials in URIs are masked when printed (ftcli.redact).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Literal

from rich.console import Console

from ftcli import __version__, mlflow_model
from ftcli.errors import UserError
from ftcli.merge import BaseRef, recipe_model, resolve_base
from ftcli.redact import mask_uri, scrub_recipe
from ftcli.rundir import RUN_JSON, RunRecord, read_run_record
from ftcli.tracking import check_reachable, first_line, flatten, resolve_tracking_uri

Mode = Literal["full", "merged", "adapter"]

UC_REGISTRY = "databricks-uc"
UC_MAX_NAME_LEN = 255
_UC_BAD_CHARS = re.compile(r"[.\s/\x00-\x1f\x7f]")
_ALIAS_RE = re.compile(r"^[\w-]+$")
_ALIAS_VERSION_RE = re.compile(r"^[vV]\d+$")
PROBE_TIMEOUT_S = 5

err_console = Console(stderr=True)


# ------------------------------------------------------------------------------------ name rules
def is_uc_registry(registry_uri: str | None) -> bool:
    return bool(registry_uri) and registry_uri.split(":", 1)[0].lower() == UC_REGISTRY


def validate_uc_name(name: str) -> str:
    """`catalog.schema.model` under Unity Catalog's object-name rules; returns it lowercased."""
    parts = name.split(".")
    if len(parts) != 3:
        raise UserError(
            f"Unity Catalog model name {name!r} must be catalog.schema.model (three parts), e.g. main.default.my_model"
        )
    for label, part in zip(("catalog", "schema", "model"), parts):
        if not part:
            raise UserError(f"Unity Catalog model name {name!r}: the {label} part is empty")
        if len(part) > UC_MAX_NAME_LEN:
            raise UserError(f"Unity Catalog model name {name!r}: the {label} part is longer than 255 characters")
        bad = _UC_BAD_CHARS.search(part)
        if bad:
            raise UserError(
                f"Unity Catalog model name {name!r}: the {label} part contains {bad.group()!r}; "
                "use letters, digits, '_' or '-' (no spaces, '/' or control characters)"
            )
    return name.lower()


def validate_local_name(name: str) -> str:
    """MLflow's own registry: any non-empty name without '/' or ':' (they break models:/ URIs)."""
    if not name or not name.strip():
        raise UserError("--name is empty")
    if name != name.strip():
        raise UserError(f"model name {name!r} has leading or trailing spaces")
    for ch in "/:":
        if ch in name:
            raise UserError(f"model name {name!r} contains {ch!r}, which MLflow model names cannot contain")
    return name


def validate_model_name(name: str, registry_uri: str | None) -> str:
    return validate_uc_name(name) if is_uc_registry(registry_uri) else validate_local_name(name)


def validate_alias(alias: str) -> str:
    """MLflow's alias rules: letters, digits, '_' and '-'; not 'latest'; not a version like 'v3'."""
    if not _ALIAS_RE.fullmatch(alias) or len(alias) > 255:
        raise UserError(f"alias {alias!r}: use 1-255 letters, digits, '_' or '-'")
    if alias.lower() == "latest":
        raise UserError("alias 'latest' is reserved by MLflow; pick another, e.g. champion")
    if _ALIAS_VERSION_RE.fullmatch(alias):
        raise UserError(f"alias {alias!r} looks like a version reference, which MLflow reserves; pick another")
    return alias


def require_uc_signature(signature) -> None:
    """Unity Catalog refuses a version whose signature lacks inputs or outputs."""
    if signature is None or signature.inputs is None:
        raise UserError("Unity Catalog needs a model signature with inputs and outputs; this model has none")
    if signature.outputs is None:
        raise UserError("Unity Catalog needs a model signature with outputs; this model's signature has inputs only")


# ----------------------------------------------------------------------------------- the source
@dataclass
class Source:
    """What `ftcli register` was pointed at, resolved."""

    model_dir: Path  # the HF checkpoint or the adapter
    kind: Literal["checkpoint", "adapter"]
    run_dir: Path | None = None
    run: RunRecord | None = None  # run.json
    recipe: dict | None = None  # the recipe dict (--recipe, else run.json's)
    base: BaseRef | None = None  # adapters only

    @property
    def trust_remote_code(self) -> bool:
        return bool(recipe_model(self.recipe).get("trust_remote_code", False))

    @property
    def dtype(self) -> str:
        return recipe_model(self.recipe).get("dtype") or "bfloat16"

    @property
    def model_class(self) -> str:
        recorded = self.run.base_model.model_class if self.run is not None else None
        return recorded or recipe_model(self.recipe).get("model_class") or "causal_lm"


def resolve_source(path: Path, recipe: dict | None = None, checkpoint: str = "last") -> Source:
    """A run dir (run.json), the model dir inside one (<run>/final), or a bare model dir. checkpoint="best":
    a run dir's best eval model (run.json best_model_dir, training.checkpoint.keep_best)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise UserError(f"{path} does not exist; pass a run dir (with run.json) or a model dir")
    if not path.is_dir():
        raise UserError(f"{path} is not a directory; pass a run dir (with run.json) or a model dir")
    path = path.resolve()
    run_dir = next((d for d in (path, path.parent) if (d / RUN_JSON).is_file()), None)  # parent: `register x/final`
    if run_dir is None:
        kind = _model_kind(path)
        if kind is None:
            raise UserError(
                f"{path} has no run.json (not a run dir) and no config.json or adapter_config.json "
                "(not a model dir); pass the run dir that `ftcli train` wrote"
            )
        source = Source(model_dir=path, kind=kind, recipe=recipe)
    else:
        run = read_run_record(run_dir)
        if checkpoint == "best":
            if path != run_dir or not run.best_model_dir:
                raise UserError(
                    f"--checkpoint best: {run_dir} records no best eval model (train with eval data and "
                    "training.checkpoint.keep_best=true), or pass the run dir itself" if path == run_dir else
                    f"--checkpoint best takes the run dir ({run_dir}), not a model dir inside it")
            path = run.best_model_path(run_dir)
        elif path == run_dir and not run.model_dir:
            raise UserError(
                f"{run_dir} has no final model (run.json model_dir is null: training.checkpoint.save_final_hf "
                "was false); retrain with it on, or register a model dir"
            )
        model_dir = path if path != run_dir else run.model_path(run_dir)
        if not model_dir.is_dir():
            raise UserError(
                f"{model_dir} is missing (run.json model_dir={run.model_dir!r}, status={run.status!r}); "
                "did `ftcli train` finish?"
            )
        kind = "adapter" if run.method == "lora" else "checkpoint"
        source = Source(model_dir=model_dir, kind=kind, run_dir=run_dir, run=run, recipe=recipe or run.recipe)
        if run.status != "completed":
            _warn(f"run.json status is {run.status!r}, not 'completed'; registering what {model_dir} holds")
    _check_model_files(source)
    if source.kind == "adapter":
        source.base = resolve_base(source.model_dir, source.run_dir, source.run)
    return source


def _model_kind(d: Path) -> Literal["checkpoint", "adapter"] | None:
    if (d / "adapter_config.json").is_file():
        return "adapter"
    if (d / "config.json").is_file():
        return "checkpoint"
    return None


def _check_model_files(source: Source) -> None:
    """Every file log_model and a chat endpoint need, reported at once."""
    missing = mlflow_model.missing_files(source.model_dir, adapter=source.kind == "adapter")
    if missing:
        where = f" (run.json status: {source.run.status!r})" if source.run else ""
        raise UserError(f"{source.model_dir} is missing {', '.join(missing)}{where}; did training finish and save "
                        "the final model?")


# ---------------------------------------------------------------------------------------- modes
def choose_mode(source: Source, *, adapter_only: bool, merged: bool, uc: bool) -> Mode:
    """What to log. Raises for combinations that cannot work or that UC would turn expensive."""
    if source.kind == "checkpoint":
        if adapter_only:
            raise UserError(f"--adapter-only needs a LoRA adapter; {source.model_dir} is a full checkpoint")
        if merged:
            _warn(f"--merged has no effect: {source.model_dir} already holds full weights")
        return "full"
    base = source.base
    if merged:
        return "merged"
    if adapter_only:
        if uc and base.local:
            raise UserError(
                f"Unity Catalog cannot reference the local base {base.path}; register merged weights with --merged"
            )
        if uc:
            _warn(f"Unity Catalog will download the base weights of {base} at registration (you asked: --adapter-only)")
        return "adapter"
    if base.local:
        return "merged"
    if uc:
        raise UserError(
            f"an adapter over {base} makes Unity Catalog download the base weights at registration; "
            "pass --merged (recommended), or --adapter-only to accept the download"
        )
    return "adapter"


# ------------------------------------------------------------------------ probe and input example
PROBE_PROMPT = "Hello! In one sentence, what can you do?"
PROBE_MAX_NEW_TOKENS = 16
FALLBACK_EXAMPLE = {"messages": [{"role": "user", "content": "Hello! What can you do?"}]}
EXAMPLE_SCAN_ROWS = 1000  # rows read to find one with a user turn before giving up


def probe_conversation(recipe: dict | None) -> list[dict]:
    """What the probe asks: the recipe's first `eval.samples` entry (a prompt string or a list of
    messages), else PROBE_PROMPT as one user turn."""
    samples = ((recipe or {}).get("eval") or {}).get("samples")
    first = samples[0] if isinstance(samples, list) and samples else None
    if isinstance(first, dict) and isinstance(first.get("messages"), list):
        first = first["messages"]
    if isinstance(first, str) and first.strip():
        return [{"role": "user", "content": first}]
    if isinstance(first, list) and first and all(isinstance(m, dict) for m in first):
        return first
    return [{"role": "user", "content": PROBE_PROMPT}]


def probe_generation(model_dir: Path, base: BaseRef | None, source: Source, messages: list[dict],
                     max_new_tokens: int = PROBE_MAX_NEW_TOKENS) -> str | None:
    """One greedy reply (ftcli.generate.sample_greedy) from the model about to be logged: `model_dir`
    as a checkpoint, or as an adapter over the local `base`. A model that cannot load, generate or
    produce a single token before its end of turn is a UserError: registering it would serve
    errors or empty replies. One that does not fit in memory here is not probed (None, a warning):
    that says nothing about the model."""
    import torch

    from ftcli import generate

    where = f"{model_dir} (over {base})" if base is not None else str(model_dir)
    dtype = source.dtype if source.dtype in generate.DTYPES else "auto"
    target = generate.ModelSource(
        model=str(base.path) if base is not None else str(model_dir), adapter=model_dir if base is not None else None,
        model_class=source.model_class, trust_remote_code=source.trust_remote_code,
    )
    try:
        loaded = generate.load(target, dtype=dtype, device="auto")
        [text] = generate.sample_greedy(loaded.model, loaded.tokenizer, [messages], max_new_tokens)
    except UserError as e:
        raise UserError(f"probe generation on {where} failed: {e}") from None
    except (MemoryError, torch.OutOfMemoryError) as e:
        _warn(f"no probe generation: {where} does not fit in memory here ({type(e).__name__})")
        return None
    except Exception as e:  # noqa: BLE001 - whatever breaks here would break serving too
        raise UserError(f"probe generation on {where} failed ({type(e).__name__}: {first_line(e)}); "
                        "the model files are broken or do not match its config") from None
    if not text:
        raise UserError(f"probe generation on {where}: the model produced no token before its end of turn "
                        f"(prompt {messages[-1].get('content')!r}); it would serve empty replies")
    return text


def _probe(model_dir: Path, mode: Mode, source: Source) -> str | None:
    """The probe of what `mode` logs; None (with a warning) for an adapter over a hub base, whose
    weights register never downloads."""
    base = source.base if mode == "adapter" else None
    if base is not None and not base.local:
        _warn(f"no probe generation: the adapter's base {base} is on the hub and register does not download it")
        return None
    messages = probe_conversation(source.recipe)
    with err_console.status("probe generation"):
        text = probe_generation(model_dir, base, source, messages)
    if text is not None:
        err_console.print(f"probe: {messages[-1].get('content')!r} -> {text!r}", highlight=False, soft_wrap=True)
    return text


def chat_request_from_data(recipe: dict | None) -> tuple[dict | None, str | None]:
    """(request, None): the first training row with a user turn, as an llm/v1/chat request
    `{"messages": [...]}` of the turns before its first assistant reply (role and content); or
    (None, why) when the recipe's data cannot be read here (offline hub data, a moved file, a
    synthetic source) or holds no such row. Hub data is read as a stream (the first rows only),
    or from the HF cache when HF_HUB_OFFLINE is set."""
    from ftcli.data import sources
    from ftcli.data.validate import BadRow, conversation
    from ftcli.recipe import DataConfig

    if not recipe or not recipe.get("data"):
        return None, "no training recipe to read the data from"
    try:
        data = DataConfig.model_validate(recipe["data"])
    except ValueError as e:
        return None, f"the recipe's data section does not validate ({first_line(e)})"
    problems = []
    for src in data.source_list():
        if src.source == "synthetic":
            problems.append("synthetic data has no chat turns")
            continue
        if src.source == "hub" and not src.streaming and not _hf_offline():
            src = src.model_copy(update={"streaming": True})
        try:
            rows, _ = sources.open_rows(src, limit=EXAMPLE_SCAN_ROWS)
            for _, row in rows:
                try:
                    messages = conversation(row, src.format, src.messages_field, src.tools_field).messages
                except BadRow:
                    continue
                prompt = []
                for m in messages or []:
                    if m["role"] == "assistant":
                        break
                    prompt.append({"role": m["role"], "content": m.get("content") or ""})
                if any(m["role"] == "user" for m in prompt):
                    return {"messages": prompt}, None
        except Exception as e:  # noqa: BLE001 - unreadable data never blocks registering
            problems.append(f"cannot read {src.label} ({first_line(e)})")
            continue
        problems.append(f"no row with a user turn in the first {EXAMPLE_SCAN_ROWS} rows of {src.label}")
    return None, "; ".join(problems)


def _hf_offline() -> bool:
    import datasets

    return bool(datasets.config.HF_HUB_OFFLINE)


def _input_example(source: Source) -> dict:
    example, why = chat_request_from_data(source.recipe)
    if example is None:
        _warn(f"input example: a fixed chat request, not one from the training data ({why})")
        return FALLBACK_EXAMPLE
    return example


# ---------------------------------------------------------------------------------------- MLflow
@dataclass
class Result:
    name: str
    version: str
    model_uri: str
    alias: str | None
    alias_uri: str | None
    previous_alias_version: str | None
    mode: str
    source: str
    base_model: str | None
    run_id: str
    experiment_id: str
    attached_to_training_run: bool
    tracking_uri: str
    registry_uri: str
    seconds: float
    probe_reply: str | None = None  # the probe generation (None: not probed)


def _warn(message: str) -> None:
    err_console.print(f"[yellow]warning:[/] {message}", highlight=False, soft_wrap=True)


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """These environment variables set for the block; afterwards each has its old value, or none."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _tracking_uri(source: Source, tracking_uri: str | None) -> str:
    """--tracking-uri, else the training run's (run.json), else $MLFLOW_TRACKING_URI, else ./mlflow.db."""
    recorded = source.run.mlflow.tracking_uri if source.run is not None and source.run.mlflow else None
    if not tracking_uri and recorded and recorded.startswith("sqlite:///"):
        if not Path(recorded[len("sqlite:///") :]).is_file():
            raise UserError(f"the training run's MLflow store {recorded} (run.json) is missing; pass --tracking-uri")
    return resolve_tracking_uri(tracking_uri or recorded)


def _check_registry(client, registry_uri: str) -> None:
    """The registry answers one call with no retries, or this fails in seconds with the URI, before
    anything is merged or uploaded (a wrong URI, missing credentials)."""
    from mlflow.exceptions import MlflowException

    fix = "check --registry-uri and your credentials"
    check_reachable(registry_uri, fix=fix, timeout_s=PROBE_TIMEOUT_S, what="model registry")
    with _env(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT=str(PROBE_TIMEOUT_S)):
        try:
            client.search_registered_models(max_results=1)
        except Exception as e:  # noqa: BLE001 - whatever the store raises, this registry cannot be used
            denied = isinstance(e, MlflowException) and e.error_code in ("UNAUTHENTICATED", "PERMISSION_DENIED")
            reason = "not authorized" if denied else first_line(e)
            raise UserError(f"cannot use the model registry at {mask_uri(registry_uri)} ({reason}); {fix}") from None


def current_alias_version(client, name: str, alias: str) -> str | None:
    """The version `alias` points at now, or None (no such model or alias)."""
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException as e:
        if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def _run_to_log_into(client, source: Source, name: str) -> tuple[object, bool]:
    """(run, attached): the training run from run.json if this tracking store has it; else a new run
    with the scrubbed recipe as params and run.json's summary metrics."""
    from mlflow.entities import Metric, Param
    from mlflow.exceptions import MlflowException

    record = source.run
    run_id = record.mlflow.run_id if record is not None and record.mlflow else None
    if run_id:
        try:
            run = client.get_run(run_id)
        except MlflowException:
            _warn(f"training run {run_id} (run.json) is not in this tracking store; logging into a new run")
        else:
            if run.info.lifecycle_stage != "deleted":
                return run, True
            _warn(f"training run {run_id} is deleted; logging into a new run")
    recipe = source.recipe or {}
    tracking = recipe.get("tracking") or {}
    exp_name = tracking.get("experiment") or recipe.get("name") or "ftcli-register"
    exp = client.get_experiment_by_name(exp_name)
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(exp_name)
    run = client.create_run(exp_id, run_name=f"register-{name}"[:250], tags={"ftcli.command": "register"})
    metrics = {} if record is None else {
        "final_loss": record.final_loss, "steps": record.steps,
        "tokens_trained": record.tokens.trained, "tokens_seen": record.tokens.seen,
        "tokens_per_s": record.throughput.tokens_per_s, "s_per_step": record.throughput.s_per_step,
    }
    now = int(time.time() * 1000)
    client.log_batch(
        run.info.run_id,
        metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items() if isinstance(v, (int, float))],
        params=[Param(k, v) for k, v in flatten(scrub_recipe(recipe)).items()],  # as the trainers log them
    )
    return run, False


def merge_adapter(source: Source) -> Path:
    """The one call into merge-lora; reuses <run>/merged when it is newer than the adapter."""
    from ftcli.merge import merge_lora

    model_dir = source.model_dir
    output = source.run_dir / "merged" if source.run_dir else model_dir.with_name(model_dir.name + "-merged")
    adapter_files = [p for p in source.model_dir.glob("adapter_model.*") if p.is_file()]
    done = output / "config.json"
    if done.is_file() and any(output.glob("*.safetensors")) and all(
        done.stat().st_mtime >= p.stat().st_mtime for p in adapter_files
    ):
        err_console.print(f"using the merged model in {output} (newer than the adapter)", highlight=False)
        return output
    # base=None: merge-lora resolves it from the same run.json / adapter_config.json, revision included
    return Path(merge_lora(model_dir, base=None, output=output, dtype=source.dtype, recipe=source.recipe, force=True))


def _register_version(client, name: str, info, tags: dict[str, str]):
    """A new version of `name` (created on first use) from the logged model, ready when this returns."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
            raise
    return client.create_model_version(name, source=info.model_uri, tags=tags, model_id=info.model_id)


def log_and_register(
    source: Source, mode: Mode, *, name: str, alias: str | None, force: bool,
    tracking_uri: str, registry_uri: str, uc: bool,
) -> Result:
    """The MLflow half: nothing here runs before every check in run_register has passed."""
    t0 = time.time()
    from mlflow import MlflowClient

    check_reachable(tracking_uri, fix="start it or pass --tracking-uri", timeout_s=PROBE_TIMEOUT_S)
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=registry_uri)
    _check_registry(client, registry_uri)

    previous = current_alias_version(client, name, alias) if alias else None
    if previous is not None and not force:
        raise UserError(
            f"alias '{alias}' of {name} already points at version {previous}; "
            "pass --force to move it to the new version"
        )

    model_dir = source.model_dir
    if mode == "merged":
        with err_console.status("merging the adapter into its base"):
            model_dir = merge_adapter(source)
        _check_model_files(Source(model_dir=model_dir, kind="checkpoint"))
    if mode in ("full", "merged"):
        mlflow_model.check_remote_code(model_dir, source.trust_remote_code)
    probe = _probe(model_dir, mode, source)
    input_example = _input_example(source)

    run, attached = _run_to_log_into(client, source, name)

    base = source.base
    metadata = {"ftcli_version": __version__, "ftcli_mode": mode}
    if base is not None:
        metadata["ftcli_base_model"] = str(base.path or base.id)
        if base.revision:
            metadata["ftcli_base_revision"] = base.revision
    try:
        with err_console.status(f"logging the model to {mask_uri(tracking_uri)}"):
            info = mlflow_model.log_chat_model(
                model_dir, base=base if mode == "adapter" else None, run=run, tracking_uri=tracking_uri,
                metadata=metadata, dtype=source.dtype, model_class=source.model_class,
                trust_remote_code=source.trust_remote_code, input_example=input_example,
            )
        if uc:
            require_uc_signature(info.signature)
        with err_console.status(f"registering {name} in {mask_uri(registry_uri)}"):
            tags = {k.replace("ftcli_", "ftcli.", 1): v for k, v in metadata.items()}
            version = _register_version(client, name, info, tags)
        if alias:
            client.set_registered_model_alias(name, alias, version.version)
    except BaseException:
        if not attached:
            client.set_terminated(run.info.run_id, status="FAILED")
        raise
    if not attached:
        client.set_terminated(run.info.run_id)
    client.set_tag(run.info.run_id, "ftcli.registered_model", f"{name}/{version.version}")
    return Result(
        name=name, version=str(version.version), model_uri=f"models:/{name}/{version.version}",
        alias=alias, alias_uri=f"models:/{name}@{alias}" if alias else None,
        previous_alias_version=previous, mode=mode, source=str(model_dir),
        base_model=str(base) if base is not None else None,
        run_id=run.info.run_id, experiment_id=run.info.experiment_id, attached_to_training_run=attached,
        tracking_uri=mask_uri(tracking_uri), registry_uri=mask_uri(registry_uri), seconds=round(time.time() - t0, 1),
        probe_reply=probe,
    )


# ---------------------------------------------------------------------------------------- entry
def run_register(
    model_dir: Path, *, name: str, registry_uri: str | None = None, tracking_uri: str | None = None,
    alias: str | None = None, adapter_only: bool = False, merged: bool = False, as_json: bool = False,
    recipe=None, force: bool = False, checkpoint: str = "last",
) -> Result:
    """`ftcli register`: see the module docstring. Prints a summary (or JSON) and returns it."""
    if adapter_only and merged:
        raise UserError("--adapter-only and --merged exclude each other")
    registry = registry_uri or os.environ.get("MLFLOW_REGISTRY_URI")
    uc = is_uc_registry(registry)
    name = validate_model_name(name, registry)
    if alias is not None:
        alias = validate_alias(alias)
    elif force:
        _warn("--force has no effect without --alias")
    recipe_dict = recipe.to_dict() if recipe is not None and hasattr(recipe, "to_dict") else recipe
    if checkpoint not in ("last", "best"):
        raise UserError(f"--checkpoint {checkpoint}: use last (the final model) or best (the best eval's)")
    source = resolve_source(Path(model_dir), recipe_dict, checkpoint)
    mode = choose_mode(source, adapter_only=adapter_only, merged=merged, uc=uc)
    if mode == "adapter" and not source.base.local and not source.base.revision:
        _warn(f"the base {source.base} has no pinned revision in run.json; MLflow records the hub's latest commit")
    tracking = _tracking_uri(source, tracking_uri)

    from mlflow.exceptions import MlflowException

    # A short retry budget for the work itself (MLflow's default retries for minutes); the probes
    # use none. A value the user exported wins.
    retries = os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    try:  # stdout carries the result only (--json): whatever MLflow prints goes to stderr
        with contextlib.redirect_stdout(sys.stderr), _env(MLFLOW_HTTP_REQUEST_MAX_RETRIES=retries):
            result = log_and_register(
                source, mode, name=name, alias=alias, force=force,
                tracking_uri=tracking, registry_uri=registry or tracking, uc=uc,
            )
    except MlflowException as e:  # the server or registry said no (permissions, quotas, UC rules)
        raise UserError(f"MLflow: {first_line(e)}") from None
    _print(result, as_json)
    return result


def _print(result: Result, as_json: bool) -> None:
    if as_json:
        print(json.dumps(asdict(result)))
        return
    out = Console(soft_wrap=True)
    run = "training run" if result.attached_to_training_run else "new run"
    out.print(
        f"[bold green]registered[/] {result.name} version {result.version} "
        f"({result.mode}; {run} {result.run_id})", highlight=False,
    )
    if result.alias:
        moved = f" (moved from version {result.previous_alias_version})" if result.previous_alias_version else ""
        out.print(f"  alias     {result.alias} -> version {result.version}{moved}", highlight=False)
    out.print(f"  uri       {result.model_uri}", highlight=False)
    if result.alias_uri:
        out.print(f"            {result.alias_uri}", highlight=False)
    out.print(f"  registry  {result.registry_uri}", highlight=False)
