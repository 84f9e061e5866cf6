"""What a path on the command line names: the one resolver of `generate`, `chat`, `merge-lora` and `register`.

    PATH
      a run dir (run.json, read as a RunRecord)       -> its model: <run>/final (run.json model_dir), or with
                                                         checkpoint="best" <run>/best (best_model_dir)
        no run.json, but recipe.yaml or checkpoints/  -> refused in one line: not finished (or stopped early)
      <run>/final, <run>/best (a model dir the run.json names)
                                                      -> the same as its run, that model
      a dir with adapter_config.json                  -> a LoRA adapter (its base: `resolve_base`)
      a dir with config.json                          -> a Hugging Face checkpoint (merged dir, exported final/)

    -> `Target`: the model dir, whether it is a full checkpoint or an adapter, and its run (dir + RunRecord)
    -> `resolve_base(adapter, run_dir, run, base)`: the base of an adapter, as a `BaseRef`
    -> `ModelSettings.of(recipe)`: the typed model settings of the run's saved recipe (or --recipe)

Each command keeps its own rules on top (generate wants a completed run, merge-lora an adapter, register
warns on an unfinished run); what a path *is* is decided here only. Nothing is loaded: these are file checks. A model
or adapter dir whose only weights are a pickle (pytorch_model*.bin, adapter_model.bin) is refused in one line here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ftcli.artifacts.publish import export_problem
from ftcli.artifacts.rundir import (CHECKPOINTS, RECIPE_FILE, RUN_JSON, MlflowRecord, ParentRunRecord, RunRecord,
                                   read_run_record)
from ftcli.config.errors import UserError
from ftcli.objectives import method_of

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelSettings:
    """The model settings of a recipe as saved in run.json (a dict), or of a Recipe: typed, with defaults."""

    trust_remote_code: bool = False
    dtype: str | None = None
    model_class: str | None = None
    model_type: str | None = None

    @classmethod
    def of(cls, recipe) -> ModelSettings:
        """From a Recipe, a recipe dict (run.json's `recipe`), or None."""
        if recipe is None:
            return cls()
        model = (recipe if isinstance(recipe, dict) else recipe.to_dict()).get("model") or {}
        if not isinstance(model, dict):
            return cls()
        return cls(trust_remote_code=bool(model.get("trust_remote_code", False)), dtype=model.get("dtype"),
                   model_class=model.get("model_class"), model_type=model.get("model_type"))


@dataclass(frozen=True)
class BaseRef:
    """The base an adapter was trained on: a local dir, or a hub repo id at a revision."""

    path: Path | None = None
    id: str | None = None
    revision: str | None = None

    @property
    def local(self) -> bool:
        return self.path is not None

    @property
    def ref(self) -> str:
        """What from_pretrained takes: the dir, or the hub id."""
        return str(self.path) if self.path is not None else str(self.id)

    def __str__(self) -> str:
        return f"{self.id}@{self.revision}" if self.path is None and self.revision else self.ref


@dataclass(frozen=True)
class Target:
    """A model on disk, and the training run it came from (None for a bare model dir)."""

    model_dir: Path
    kind: Literal["checkpoint", "adapter"]
    run_dir: Path | None = None
    run: RunRecord | None = None

    @property
    def settings(self) -> ModelSettings:
        return ModelSettings.of(self.run.recipe if self.run is not None else None)


def run_dir_holding(path: Path) -> Path | None:
    """The training run `path` is (a dir with run.json) or sits in (`<run>/final`), else None."""
    return next((d for d in (path, path.parent) if (d / RUN_JSON).is_file()), None)


def parent_run_of(model_cfg) -> ParentRunRecord | None:
    """The ftcli run `model.id` names the model of (its dir's final/ or best/, as ftcli.train.launch.starting_model
    resolves it), as its run.json records it; None for any other model (a hub id, a plain directory, random init)."""
    from ftcli.config.recipe import resolve_path

    if model_cfg.init != "pretrained" or not model_cfg.id:
        return None
    path = Path(resolve_path(model_cfg.id)).expanduser()
    run_dir = run_dir_holding(path.resolve()) if path.is_dir() else None
    if run_dir is None:
        return None
    run = read_run_record(run_dir)
    model_dir = path.resolve().name if path.resolve() != run_dir else run.model_dir  # the run dir itself: its model
    mlflow = run.mlflow or MlflowRecord()
    return ParentRunRecord(run_dir=str(run_dir), model_dir=model_dir or ".", recipe=run.recipe.get("name"),
                           recipe_digest=run.recipe_digest, method=run.method, objective=run.objective,
                           mlflow_run_id=mlflow.run_id, mlflow_experiment_id=mlflow.experiment_id)


def locate(path: Path, *, checkpoint: Literal["last", "best"] = "last", completed: bool = False) -> Target:
    """PATH -> Target (see the module docstring). `completed`: refuse a run whose run.json status is not
    "completed" (its final model is written only at the end). A user mistake is one UserError."""
    path = Path(path).expanduser()
    if not path.is_dir():
        problem = "is not a directory" if path.exists() else "does not exist"
        raise UserError(f"{path} {problem}; pass a run dir (with run.json) or a model dir")
    path = path.resolve()
    run_dir = run_dir_holding(path)
    if run_dir is not None:
        run = read_run_record(run_dir)
        named = {p.resolve() for p in (run.model_path(run_dir), run.best_model_path(run_dir)) if p is not None}
        if path == run_dir or path in named:  # (a LoRA run's base/ is a plain model dir, not the run's model)
            if completed and run.status != "completed":
                raise UserError(f"{run_dir}: the run is {run.status!r}, not completed; its final model is written "
                                "when training ends")
            return _whole(_target_of_run(path, run_dir, run, checkpoint))
    if checkpoint == "best":
        raise UserError(f"--checkpoint best takes a run dir (with run.json); {path} is not one")
    if (path / RECIPE_FILE).is_file() or (path / CHECKPOINTS).is_dir():
        raise UserError(f"{path} is a run that has not finished (no run.json yet: it is still training, or it "
                        f"stopped early; `ftcli train --recipe {path / RECIPE_FILE} --resume` continues it)")
    if (path / "adapter_config.json").is_file():
        return _whole(Target(model_dir=path, kind="adapter"))
    if (path / "config.json").is_file():
        return _whole(Target(model_dir=path, kind="checkpoint"))
    raise UserError(f"{path} holds no model: expected run.json (a run dir), config.json (a model dir) or "
                    "adapter_config.json (a LoRA adapter)")


def _whole(target: Target) -> Target:
    """`target` when its model dir is a whole export (ftcli.artifacts.publish) and its weights are not only a pickle
    (adapter_model.bin, pytorch_model*.bin: PEFT or transformers would unpickle it here, a serving endpoint after
    register), else one UserError."""
    from ftcli.model.build import refuse_pickled_weights

    if target.kind == "adapter":
        refuse_pickled_weights(target.model_dir, "LoRA adapter", "adapter")
    else:
        refuse_pickled_weights(target.model_dir, "model", "model")
    problem = export_problem(target.model_dir)
    if problem is not None:
        raise UserError(f"{target.model_dir} is not a whole model export: {problem}; export it again (or resume "
                        "the run that writes it)")
    return target


def _target_of_run(path: Path, run_dir: Path, run: RunRecord, checkpoint: str) -> Target:
    """The model a training run wrote: `path` itself when it is a model dir inside the run, else run.json's."""
    if checkpoint == "best":
        if path != run_dir:
            raise UserError(f"--checkpoint best takes the run dir ({run_dir}), not a model dir inside it")
        if not run.best_model_dir:
            raise UserError(f"--checkpoint best: {run_dir} records no best eval model (train with eval data and "
                            "training.checkpoint.keep_best=true), or pass the run dir itself")
        path = run.best_model_path(run_dir)
    elif path == run_dir:
        path = run.model_path(run_dir)
        if path is None or not path.is_dir():
            where = "run.json names no model_dir" if path is None else f"{path} does not exist"
            raise UserError(f"{run_dir}: no model in this run ({where}; a full run exports final/ only with "
                            "training.checkpoint.save_final_hf: true)")
    if not path.is_dir():
        raise UserError(f"{path} is missing (run.json best_model_dir={run.best_model_dir!r}, status={run.status!r}); "
                        "did `ftcli train` finish?")
    if not path.resolve().is_relative_to(run_dir):
        raise UserError(f"{path} resolves to {path.resolve()}, outside the run dir {run_dir} (run.json "
                        f"model_dir={run.model_dir!r}); a run's model is read only from inside its run dir")
    kind = "adapter" if method_of(run.method).writes_adapter else "checkpoint"
    return Target(model_dir=path, kind=kind, run_dir=run_dir, run=run)


def read_adapter_config(adapter: Path) -> dict[str, Any]:
    """adapter_config.json as a dict: present, JSON, an object, and a LoRA adapter's."""
    path = adapter / "adapter_config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read it ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: not a JSON object; pass the adapter dir that training wrote")
    if data.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{path}: peft_type is {data['peft_type']!r}; merge-lora merges LoRA adapters only")
    return data


def resolve_base(adapter: Path, run_dir: Path | None, run: RunRecord | None, base: str | None = None) -> BaseRef:
    """The base of an adapter, for every command: `base` (--base), else run.json base_model (a saved path
    beats the hub id@revision), else adapter_config.json's base_model_name_or_path. A reference that names
    an existing dir is that dir, which must hold config.json."""
    from ftcli.config.recipe import resolve_path

    recorded = run.base_model if run is not None else None
    revision = None
    if base:
        ref = base
    elif recorded is not None and recorded.path:
        path = Path(recorded.path)
        path = path if path.is_absolute() else run_dir / path
        if not (path / "config.json").is_file():
            raise UserError(f"base model dir {path} (run.json base_model.path) is missing or has no config.json")
        return BaseRef(path=path)
    elif recorded is not None and recorded.init == "random":
        raise UserError(f"{run_dir}: the base was random-init and run.json has no base_model.path to rebuild it "
                        "from; pass its dir with `ftcli merge-lora --base DIR`")
    elif recorded is not None and recorded.id:
        ref, revision = recorded.id, recorded.revision
    else:
        adapter_config = read_adapter_config(adapter)
        ref = adapter_config.get("base_model_name_or_path")
        revision = (recorded.revision if recorded is not None else None) or adapter_config.get("revision")
        if not ref:
            raise UserError(f"{adapter}: the adapter does not say which base it belongs to; "
                            "pass it with `ftcli merge-lora --base ID_OR_DIR`")
    local = Path(resolve_path(ref, None if base else run_dir)).expanduser()  # --base: relative to the cwd
    if not local.is_dir():
        return BaseRef(id=ref, revision=revision)
    if not (local / "config.json").is_file():
        raise UserError(f"base model dir {local} has no config.json")
    return BaseRef(path=local.resolve())


@dataclass
class ModelSource:
    """What to load for inference: a checkpoint, or a base + a LoRA adapter applied unmerged."""

    model: str  # the checkpoint to load: a local dir or a hub id (for an adapter: its base)
    revision: str | None = None
    adapter: Path | None = None  # a LoRA adapter dir applied on top of `model`, unmerged
    run_dir: Path | None = None
    model_class: str | None = None  # "causal_lm" | "image_text_to_text"; None: from the config
    trust_remote_code: bool = False

    def describe(self) -> str:
        base = f"{self.model}@{self.revision}" if self.revision else self.model
        return f"{base} + adapter {self.adapter}" if self.adapter else base


def model_source(ref: str, revision: str | None = None) -> ModelSource:
    """RUN_OR_MODEL (a finished run dir, a model or adapter dir, or a hub id owner/name at `revision`) -> what
    `ftcli generate` / `chat` load: a full run's final model, a LoRA run's base + adapter (not merged)."""
    path = Path(ref).expanduser()
    if not path.exists():
        if HUB_ID.match(ref) and not ref.startswith((".", "~")):
            return ModelSource(model=ref, revision=revision)
        raise UserError(f"{ref}: no such run dir or model dir (and not a hub id of the form owner/name)")
    if not path.is_dir():
        raise UserError(f"{path} is a file; pass a run dir, a model dir or a hub id")
    target = locate(path, completed=True)
    run_dir, model_dir = target.run_dir, target.model_dir
    where = run_dir or model_dir
    model_class = target.run.base_model.model_class if target.run is not None else None
    trust = target.settings.trust_remote_code
    if target.kind == "checkpoint":
        if not (model_dir / "config.json").is_file():
            raise UserError(f"{where}: no model in this run ({model_dir} has no config.json)")
        return ModelSource(model=str(model_dir), run_dir=run_dir, model_class=model_class, trust_remote_code=trust)
    if not (model_dir / "adapter_config.json").is_file():
        raise UserError(f"{where}: no model in this LoRA run ({model_dir} has no adapter_config.json)")
    base = resolve_base(model_dir, run_dir, target.run)
    return ModelSource(model=base.ref, revision=base.revision, adapter=model_dir, run_dir=run_dir,
                       model_class=model_class, trust_remote_code=trust)
