"""`ftcli register`: log a trained model to MLflow as a chat model and register a new version.

What is logged depends on what training wrote:

    full run    <run>/final: HF checkpoint      -> logged as is (its model files copied byte for byte;
                                                   anything else in final/ is listed and left here)
    LoRA run    <run>/final: adapter, + a base  -> "merged" (default when the base is local or
                                                   random-init): ftcli.artifacts.merge.merge_lora writes
                                                   <run>/merged, logged like a full checkpoint
                                                -> "adapter" (--adapter-only, default for a hub
                                                   base): the PEFT model; the base is referenced,
                                                   not copied (hub id + pinned revision, or the
                                                   local base dir)
    model dir   any HF checkpoint or adapter    -> the same, with no training run to attach to

The model (ftcli.artifacts.mlflow_model: chat signature, OpenAI-style chat completions when served) is logged
into the training run recorded in run.json, so the version, the recipe params and the training
metrics sit on one run; without one, a new run gets the (scrubbed) recipe params and run.json's
summary metrics. Everything else goes through one `MlflowClient(tracking_uri, registry_uri)`
(ftcli.artifacts.registry: the name and alias rules, the registry's check, the version).

Where: the tracking store is --tracking-uri, else the training run's (run.json), else
$MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db; the registry is --registry-uri, else
$MLFLOW_REGISTRY_URI, else the tracking store.

Order of work: every cheap check runs before anything is merged or uploaded.

    model name, alias name -> run dir / model files -> mode rules -> reach MLflow (5 s, no retries)
    -> alias free (or --force) -> [merge] -> probe -> log the model -> create the version -> set the alias

The probe: one greedy generation (ftcli.inference.sample_greedy) on the model to be logged, from the
recipe's first `eval.samples` prompt or a default one; a model that fails to load or ends its turn
before a single token stops the registration in one line. (An adapter over a hub base is not
probed: register never downloads base weights.) The logged input example is a real chat request
(ftcli.artifacts.mlflow_model): the first training row with a user turn, cut before its first assistant
reply; a fixed request, with a warning, when the data cannot be read here.

Unity Catalog (`--registry-uri databricks-uc`):
- the name is `catalog.schema.model` (ftcli.artifacts.registry), lowercased as UC stores it.
- a version needs a signature with inputs and outputs; checked after logging, before registering.
- an adapter over a hub base makes UC download the base weights at registration (MLflow persists
  them on the registering machine, then uploads the full model): only with an explicit
  `--adapter-only`; by default it is refused with a pointer to `--merged`. An adapter over a local
  base cannot go to UC at all (UC cannot read a local path): `--merged`.

Secrets: no environment variable is logged; recipe `compute.secrets` and `compute.env_variables`
values are "***" in logged params, and credentials in URIs are masked when printed (ftcli.config.redact).
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

from ftcli.artifacts import mlflow_model

from ftcli.artifacts import registry
from ftcli.config.errors import UserError
from ftcli.artifacts.resolve import BaseRef, ModelSettings, locate, resolve_base
from ftcli.artifacts.merge import default_output, is_newer_merge, merge_lora
from ftcli.config.redact import mask_uri, masked_output
from ftcli.artifacts.rundir import RunRecord, read_run_record
from ftcli.artifacts.tracking import (check_reachable, create_run, first_line, http_settings, mlflow_problem,
                                     quiet_library_logs, recipe_params, resolve_tracking_uri)

Mode = Literal["full", "merged", "adapter"]

PROBE_TIMEOUT_S = 5
_DISK_FULL = re.compile(r"disk is full|No space left|Errno 28\]|Disk quota exceeded")  # sqlite's words, the OS's
PROBE_PROMPT = "Hello! In one sentence, what can you do?"
PROBE_MAX_NEW_TOKENS = 16

err_console = Console(stderr=True)


def _warn(message: str) -> None:
    err_console.print(f"[yellow]warning:[/] {message}", highlight=False, soft_wrap=True)


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
    def settings(self) -> ModelSettings:
        return ModelSettings.of(self.recipe)

    @property
    def trust_remote_code(self) -> bool:
        return self.settings.trust_remote_code

    @property
    def dtype(self) -> str:
        return self.settings.dtype or "bfloat16"

    @property
    def model_class(self) -> str:
        recorded = self.run.base_model.model_class if self.run is not None else None
        return recorded or self.settings.model_class or "causal_lm"


def resolve_source(path: Path, recipe: dict | None = None, checkpoint: str = "last") -> Source:
    """A run dir (run.json), the model dir inside one (<run>/final), or a bare model dir
    (ftcli.artifacts.resolve.locate). checkpoint="best": a run dir's best eval model (run.json best_model_dir,
    training.checkpoint.keep_best)."""
    target = locate(path, checkpoint=checkpoint)
    if target.run is not None and target.run.status != "completed":
        _warn(f"run.json status is {target.run.status!r}, not 'completed'; registering what {target.model_dir} holds")
    source = Source(model_dir=target.model_dir, kind=target.kind, run_dir=target.run_dir, run=target.run,
                    recipe=recipe or (target.run.recipe if target.run is not None else None))
    _check_model_files(source)
    if source.kind == "adapter":
        source.base = resolve_base(source.model_dir, source.run_dir, source.run)
    return source


def _check_model_files(source: Source, warn: bool = True) -> list[str]:
    """Every file log_model and a chat endpoint need, reported at once; returns the files to upload
    (ftcli.artifacts.mlflow_model.select_model_files), listing the others on screen."""
    missing = mlflow_model.missing_files(source.model_dir, adapter=source.kind == "adapter")
    if missing:
        where = f" (run.json status: {source.run.status!r})" if source.run else ""
        raise UserError(f"{source.model_dir} is missing {', '.join(missing)}{where}; did training finish and save "
                        "the final model?")
    files = mlflow_model.select_model_files(source.model_dir, source.run_dir or source.model_dir)
    if files.skipped and warn and source.kind == "checkpoint":  # an adapter is saved by MLflow, not copied
        _warn(f"not uploaded from {source.model_dir} (not model files): {', '.join(files.skipped)}")
    return files.keep


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
    if merged or (base.local and not adapter_only):
        return "merged"
    if uc and base.local:  # --adapter-only
        raise UserError(f"Unity Catalog cannot reference the local base {base.path}; register merged weights with --merged")
    if uc and not adapter_only:
        raise UserError(f"an adapter over {base} makes Unity Catalog download the base weights at registration; "
                        "pass --merged (recommended), or --adapter-only to accept the download")
    if uc:
        _warn(f"Unity Catalog will download the base weights of {base} at registration (you asked: --adapter-only)")
    if not base.local and not base.revision:
        _warn(f"the base {base} has no pinned revision in run.json; MLflow records the hub's latest commit")
    return "adapter"


# ------------------------------------------------------------------------------------ the probe
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
    """One greedy reply (ftcli.inference.sample_greedy) from the model about to be logged: `model_dir`
    as a checkpoint, or as an adapter over the local `base`. A model that cannot load, generate or
    produce a single token before its end of turn is a UserError: registering it would serve
    errors or empty replies. One that does not fit in memory here is not probed (None, a warning):
    that says nothing about the model."""
    import torch

    from ftcli import inference
    from ftcli.artifacts.resolve import ModelSource

    where = f"{model_dir} (over {base})" if base is not None else str(model_dir)
    dtype = source.dtype if source.dtype in inference.DTYPES else "auto"
    target = ModelSource(
        model=str(base.path) if base is not None else str(model_dir), adapter=model_dir if base is not None else None,
        model_class=source.model_class, trust_remote_code=source.trust_remote_code,
    )
    try:
        loaded = inference.load(target, dtype=dtype, device="auto")
        [text] = inference.sample_greedy(loaded.model, loaded.tokenizer, [messages], max_new_tokens)
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


def _run_to_log_into(client, source: Source, name: str) -> tuple[object, bool]:
    """(run, attached): the training run from run.json if this tracking store has it; else a new run
    with the scrubbed recipe as params and run.json's summary metrics."""
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
    metrics = {} if record is None else {
        "final_loss": record.final_loss, "steps": record.steps,
        "tokens_trained": record.tokens.trained, "tokens_seen": record.tokens.seen,
        "tokens_per_s": record.throughput.tokens_per_s, "s_per_step": record.throughput.s_per_step,
    }
    run = create_run(
        client, (recipe.get("tracking") or {}).get("experiment") or recipe.get("name") or "ftcli-register",
        run_name=f"register-{name}"[:250], params=recipe_params(recipe),
        tags={"ftcli.command": "register", **({"ftcli.recipe_digest": record.recipe_digest}
                                               if record is not None and record.recipe_digest else {})},
        metrics={k: v for k, v in metrics.items() if isinstance(v, (int, float))},
    )
    return run, False


@contextlib.contextmanager
def _ends(client, run, attached: bool) -> Iterator[None]:
    """A run register made ends with the block: FINISHED, or FAILED if it raised. A training run is left as is."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):  # the store may be what failed (a full disk): the error is that one
            _remove_unfinished_models(client, run)
        if not attached:
            with contextlib.suppress(Exception):
                client.set_terminated(run.info.run_id, status="FAILED")
        raise
    if not attached:
        client.set_terminated(run.info.run_id)


def _remove_unfinished_models(client, run) -> None:
    """The models this register began to log into `run` and did not finish (not READY; a training run's earlier
    registers are READY and stay): their files in a local artifact store are removed (a full disk gets its
    space back; links are unlinked, never followed), then the model itself, where the store still takes it."""
    from urllib.parse import unquote, urlsplit

    from mlflow.entities import LoggedModelStatus

    from ftcli.config.safe_files import remove_tree

    models = client.search_logged_models([run.info.experiment_id], filter_string=f"source_run_id = '{run.info.run_id}'")
    for model in models:
        if model.status == LoggedModelStatus.READY:
            continue
        where = urlsplit(model.artifact_location or "")
        if where.scheme in ("", "file") and where.path:
            files = Path(unquote(where.path))
            remove_tree(files)
            with contextlib.suppress(OSError):
                files.parent.rmdir()  # models/<model id>/, when the artifacts were all it held
        with contextlib.suppress(Exception):
            client.delete_logged_model(model.model_id)


def merge_adapter(source: Source) -> Path:
    """The one call into merge-lora; reuses <run>/merged when it is newer than the adapter."""
    output = default_output(source.model_dir, source.run_dir)
    if is_newer_merge(output, source.model_dir, source.dtype):
        err_console.print(f"using the merged model in {output} (this adapter's, newer than it)", highlight=False)
        return output
    # base=None: merge-lora resolves it from the same run.json / adapter_config.json, revision included
    return Path(merge_lora(source.model_dir, base=None, output=output, dtype=source.dtype, recipe=source.recipe,
                           force=True))


def _model_to_log(source: Source, mode: Mode) -> tuple[Path, list[str]]:
    """The dir that is logged (the source's, or its merge; checked like a trained one) and its files
    to upload (resolve_source has listed the source's others)."""
    if mode != "merged":
        model_dir = source.model_dir
        files = _check_model_files(source, warn=False)
    else:
        with err_console.status("merging the adapter into its base"):
            model_dir = merge_adapter(source)
        files = _check_model_files(Source(model_dir=model_dir, kind="checkpoint", run_dir=source.run_dir))
    if mode != "adapter":
        mlflow_model.check_remote_code(model_dir, source.trust_remote_code)
    return model_dir, files


def log_and_register(
    source: Source, mode: Mode, *, name: str, alias: str | None, force: bool,
    tracking_uri: str, registry_uri: str, uc: bool,
) -> Result:
    """The MLflow half: nothing here runs before every check in run_register has passed."""
    t0 = time.time()
    from mlflow import MlflowClient

    check_reachable(tracking_uri, fix="start it or pass --tracking-uri", timeout_s=PROBE_TIMEOUT_S)
    with registry.sqlite_store_lock(tracking_uri, registry_uri):  # a new store's tables: one process at a time
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=registry_uri)
        client.search_experiments(max_results=1)
        registry.check_registry(client, registry_uri, PROBE_TIMEOUT_S)
    previous = registry.alias_version(client, name, alias) if alias else None
    if previous is not None and not force:
        raise UserError(f"alias '{alias}' of {name} already points at version {previous}; "
                        "pass --force to move it to the new version")

    model_dir, files = _model_to_log(source, mode)
    probe = _probe(model_dir, mode, source)
    input_example, why = mlflow_model.chat_request_from_data(source.recipe)
    if input_example is None:
        _warn(f"input example: a fixed chat request, not one from the training data ({why})")
        input_example = mlflow_model.FALLBACK_EXAMPLE
    run, attached = _run_to_log_into(client, source, name)
    base = source.base
    metadata = mlflow_model.model_metadata(mode, base)
    with _ends(client, run, attached):
        with err_console.status(f"logging the model to {mask_uri(tracking_uri)}"):
            info = mlflow_model.log_chat_model(
                model_dir, base=base if mode == "adapter" else None, run=run, tracking_uri=tracking_uri,
                metadata=metadata, dtype=source.dtype, model_class=source.model_class,
                trust_remote_code=source.trust_remote_code, input_example=input_example, files=files,
            )
        if uc:
            registry.require_uc_signature(info.signature)
        with err_console.status(f"registering {name} in {mask_uri(registry_uri)}"):
            tags = {k.replace("ftcli_", "ftcli.", 1): v for k, v in metadata.items()} | registry.lineage_tags(source.run)
            with mlflow_model.fluent_tracking_uri(tracking_uri):  # MLflow finds the logged model there
                version = str(registry.create_version(client, name, info, tags).version)
        if alias:
            with registry.sqlite_store_lock(registry_uri):
                registry.claim_alias(client, name, alias, version, expected=previous, force=force)
    client.set_tag(run.info.run_id, "ftcli.registered_model", f"{name}/{version}")
    return Result(
        name=name, version=version, model_uri=f"models:/{name}/{version}",
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
    registry_uri = registry_uri or os.environ.get("MLFLOW_REGISTRY_URI")
    uc = registry.is_uc_registry(registry_uri)
    name = registry.validate_model_name(name, registry_uri)
    if alias is not None:
        alias = registry.validate_alias(alias)
    elif force:
        _warn("--force has no effect without --alias")
    if checkpoint not in ("last", "best"):
        raise UserError(f"--checkpoint {checkpoint}: use last (the final model) or best (the best eval's)")
    source = resolve_source(Path(model_dir), recipe.to_dict() if hasattr(recipe, "to_dict") else recipe, checkpoint)
    mode = choose_mode(source, adapter_only=adapter_only, merged=merged, uc=uc)
    recorded = source.run.mlflow.tracking_uri if source.run is not None and source.run.mlflow else None
    tracking_uri = resolve_tracking_uri(tracking_uri, recorded=recorded)

    from mlflow.exceptions import MlflowException

    # A short retry budget for the work itself (MLflow's default retries for minutes); the probes
    # use none. A value the user exported wins.
    retries = os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    try:  # stdout carries the result only (--json): whatever MLflow prints goes to stderr, URLs masked
        with masked_output(stdout=sys.stderr), http_settings(max_retries=retries), quiet_library_logs():
            result = log_and_register(source, mode, name=name, alias=alias, force=force, tracking_uri=tracking_uri,
                                      registry_uri=registry_uri or tracking_uri, uc=uc)
    except MlflowException as e:  # the server, the registry or the store said no (permissions, quotas, UC rules)
        problem = mlflow_problem(e)
        full = (f" (free space for the store {mask_uri(tracking_uri)} and its artifacts, then register again)"
                if _DISK_FULL.search(problem) else "")
        raise UserError(f"MLflow: {problem}{full}") from None
    except OSError as e:  # MLflow copying the model into a local artifact store (a full disk, permissions)
        raise UserError(f"MLflow could not store the model: {e.strerror or e}"
                        + (f" ({e.filename})" if e.filename else "") + "; nothing was registered") from None
    _print(result, as_json)
    return result


def _print(result: Result, as_json: bool) -> None:
    if as_json:
        print(json.dumps(asdict(result)))
        return
    out = Console(soft_wrap=True)
    run = "training run" if result.attached_to_training_run else "new run"
    out.print(f"[bold green]registered[/] {result.name} version {result.version} "
              f"({result.mode}; {run} {result.run_id})", highlight=False)
    if result.alias:
        moved = f" (moved from version {result.previous_alias_version})" if result.previous_alias_version else ""
        out.print(f"  alias     {result.alias} -> version {result.version}{moved}", highlight=False)
    out.print(f"  uri       {result.model_uri}", highlight=False)
    if result.alias_uri:
        out.print(f"            {result.alias_uri}", highlight=False)
    out.print(f"  registry  {result.registry_uri}", highlight=False)
