"""The run directory: what a training run writes, and when `ftcli train` may write there.

    <run>/                        recipe.output_dir, made absolute (default runs/<recipe name>)
      .ftcli-run                  marker: ftcli made this dir (the proof --force needs)
      .ftcli.lock                 held (flock) by the launcher while a run writes here (ftcli.train.launch)
      recipe.yaml                 the resolved recipe, tracking-URI credentials masked; the workers load it
      run.json                    summary written at the end (contracts: read by merge-lora, register)
      tracking.json               the MLflow run this dir logs to (so --resume continues it)
      metrics.jsonl               one JSON object per logged step (rank 0): what benchmarks and tests read
      checkpoints/step_XXXXXXXX/  resumable sharded checkpoints (ftcli.train.checkpoint)
      final/                      the Hugging Face checkpoint
      best/                       the best eval's model (keep_best, eval.export=last; the LoRA path: its adapter)
      samples.jsonl               greedy completions of eval.samples during training (rank 0)

The rule (nothing is deleted or overwritten before it has passed): ftcli writes `.ftcli-run` into every
run dir it makes; that marker (or, for dirs of an older ftcli, a recipe.yaml beside a run.json or a
committed checkpoint) proves a directory is an ftcli run. Training writes into a new or empty dir, or
into an ftcli run of the same recipe; any other non-empty dir is refused, with or without --force. In
our own directory a fresh start (no --resume) that would mix with an earlier run's checkpoints, final
model or metrics needs --force, which then removes only what a run writes (checkpoints/step_*, final,
run.json, metrics.jsonl, tracking.json); --force also replaces an ftcli run of another recipe that way.
`check_run_dir` applies the rule and writes nothing; `prepare_run_dir` applies it again and only then
clears and writes, so the launcher runs every other check (tokenizer, data) in between.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ftcli.config.safe_files import entries, refuse_links, remove_tree
from ftcli.config.safe_files import write_atomic  # noqa: F401 - the run dir's one writer of whole files
from ftcli.config.errors import UserError

RECIPE_FILE = "recipe.yaml"
RUN_JSON = "run.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
FINAL = "final"
BEST = "best"  # the best eval's model beside final/ (training.checkpoint.keep_best with eval.export=last)
SAMPLES_FILE = "samples.jsonl"
OWNER_FILE = ".ftcli-run"  # written when ftcli makes a run dir: proof the dir is ours
LOCK_FILE = ".ftcli.lock"  # ftcli.train.launch's one-writer lock; never counts as content
_RUN_OUTPUTS = (FINAL, BEST, RUN_JSON, METRICS_FILE, SAMPLES_FILE, "tracking.json")  # plus checkpoints/ (see _clear_outputs)
_CHECKPOINT_NAME = re.compile(r"^(\.tmp_)?step_\d{8}$")
# every name a run writes, renames or deletes in its dir (besides the lock file, opened with O_NOFOLLOW), the
# temp names of the exports included: none may be a link (`check_run_dir`, ftcli.config.safe_files.refuse_links)
_WRITTEN = (OWNER_FILE, RECIPE_FILE, "tracking.json", METRICS_FILE, SAMPLES_FILE, RUN_JSON, CHECKPOINTS, FINAL, BEST,
            "base", f".tmp_{FINAL}", f".tmp_{BEST}", f".old_{FINAL}", ".tmp_base")


def written_paths(run_dir: Path) -> list[Path]:
    """The paths a run writes, renames or deletes in `run_dir`: its files and dirs, and each entry of
    checkpoints/ (step_*, .tmp_step_*, TRL's checkpoint-N)."""
    run_dir = Path(run_dir)
    return [run_dir / name for name in _WRITTEN] + entries(run_dir / CHECKPOINTS)


def run_dir_of(output_dir: Path) -> Path:
    """A recipe's `output_dir` (output.dir with its name filled in), made absolute."""
    return Path(output_dir).expanduser().resolve()


def saved_recipe_name(run_dir: Path) -> str | None:
    path = Path(run_dir) / RECIPE_FILE
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, OSError, UnicodeDecodeError):
        return None
    return data.get("name") if isinstance(data, dict) else None


def written_by_ftcli(run_dir: Path) -> bool:
    """Can we prove ftcli made this dir? Its marker; for an older ftcli's run, recipe.yaml beside a
    run.json that names an ftcli version or beside a committed checkpoint. A recipe.yaml alone is not
    proof: people keep their own recipe files in a directory."""
    run_dir = Path(run_dir)
    if (run_dir / OWNER_FILE).is_file():
        return True
    if saved_recipe_name(run_dir) is None:
        return False
    try:
        if json.loads((run_dir / RUN_JSON).read_text()).get("ftcli_version"):
            return True
    except (OSError, ValueError, AttributeError):
        pass
    return any((p / "meta.json").is_file() for p in _checkpoint_entries(run_dir))


def is_own_run(run_dir: Path, name: str) -> bool:
    """ftcli wrote `run_dir`, for the recipe called `name`."""
    return written_by_ftcli(run_dir) and saved_recipe_name(run_dir) == name


def _contents(run_dir: Path) -> list[str]:
    """What the dir holds, ftcli's lock file left out (a failed start may leave just that) when it is a
    regular file: a link or anything else planted under that name is content like any other."""
    if not run_dir.is_dir():
        return []
    return sorted(p.name for p in run_dir.iterdir()
                  if p.name != LOCK_FILE or p.is_symlink() or not p.is_file())


def _checkpoint_entries(run_dir: Path) -> list[Path]:
    return [p for p in entries(Path(run_dir) / CHECKPOINTS) if _CHECKPOINT_NAME.match(p.name)]


def _has_outputs(run_dir: Path) -> bool:
    return bool(_checkpoint_entries(run_dir)) or any((run_dir / n).exists() for n in (FINAL, RUN_JSON, METRICS_FILE))


def _clear_outputs(run_dir: Path) -> None:
    """--force in an ftcli run dir: remove what a run writes, nothing else (a user's notes stay)."""
    refuse_links(written_paths(run_dir))  # check_run_dir did; a link planted since is not followed either
    for path in _checkpoint_entries(run_dir):
        remove_tree(path)
    ckpts = run_dir / CHECKPOINTS
    if ckpts.is_dir() and not ckpts.is_symlink() and not any(ckpts.iterdir()):
        ckpts.rmdir()
    for name in _RUN_OUTPUTS:
        remove_tree(run_dir / name)


# what a start writes before its first step (the LoRA path saves a random-init base to base/)
_START_WRITES = (OWNER_FILE, LOCK_FILE, RECIPE_FILE, "tracking.json", METRICS_FILE, SAMPLES_FILE, CHECKPOINTS, "base")


def ran_a_step(run_dir: Path) -> bool:
    """Whether a run in this dir got past its start: a run.json, a logged metrics line or a checkpoint
    (either trainer's: `step_N` or TRL's `checkpoint-N`; a `.tmp_` save cut short does not count)."""
    run_dir = Path(run_dir)
    ckpts = run_dir / CHECKPOINTS
    if (run_dir / RUN_JSON).exists() or (ckpts.is_dir() and any(not p.name.startswith(".tmp") for p in ckpts.iterdir())):
        return True
    try:
        return bool((run_dir / METRICS_FILE).read_text().strip())
    except (OSError, UnicodeDecodeError):
        return False


def remove_failed_start(run_dir: Path, before: set[str] | None) -> list[str]:
    """A start that failed before its first step: remove what it wrote, the lock file included, and the
    dir when this start made it (`before`: the names the dir held before the start; None: it did not
    exist). Only names ftcli writes that were not there before go; a user's file stays, and so does all
    of it once a step has run (`ran_a_step`: resumable, worth reading). Returns the names removed."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir() or ran_a_step(run_dir):
        return []
    removed = []
    for name in _START_WRITES:
        target = run_dir / name
        if name in (before or set()) or not (target.exists() or target.is_symlink()):
            continue
        remove_tree(target)
        removed.append(name)
    if before is None and not any(run_dir.iterdir()):
        run_dir.rmdir()
    return removed


def recipe_differences(run_dir: Path, recipe) -> list[str]:
    """Dotted keys whose value differs from the run's saved recipe.yaml (output.dir ignored)."""
    from ftcli.artifacts.tracking import flatten

    path = Path(run_dir) / RECIPE_FILE
    if not path.is_file():
        return []
    old = flatten(yaml.safe_load(path.read_text()) or {})
    new = flatten(saved_recipe(recipe))
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and k != "output.dir")


def saved_recipe(recipe) -> dict[str, Any]:
    """The recipe as <run>/recipe.yaml (and run.json) holds it: credentials in the tracking URI masked
    (ftcli.config.redact.mask_recipe_uris; the launcher hands them to the workers in the environment),
    compute.env_variables by name only (their values are the job's, `render-workload` reads the recipe)."""
    from ftcli.config.redact import mask_env_values, mask_recipe_uris

    return mask_env_values(mask_recipe_uris(recipe.to_dict()))


def recipe_digest(recipe) -> str:
    """sha256 (16 hex digits) of the resolved recipe as run.json stores it, output.dir left out: one recipe run
    into two dirs has one digest (MLflow's run and model version tags carry it)."""
    import hashlib

    resolved = saved_recipe(recipe)
    resolved.get("output", {}).pop("dir", None)
    return hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_run_dir(name: str, output_dir: Path, *, force: bool = False, resume: str | None = None) -> Path:
    """The refusal rule (module doc) for the run of the recipe called `name` in its `output_dir`. Writes nothing;
    returns the run dir."""
    run_dir = run_dir_of(output_dir)
    link = dangling_link_in(output_dir)
    if link is not None:
        raise UserError(f"output dir {output_dir}: {link} is a symlink to {os.readlink(link)}, which does not "
                        "exist; ftcli does not create directories through it: set output.dir elsewhere")
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"output dir {run_dir} is a file; set output.dir to a directory")
    contents = _contents(run_dir)
    if contents and not written_by_ftcli(run_dir):
        shown = ", ".join(contents[:3]) + (", ..." if len(contents) > 3 else "")
        raise UserError(f"output dir {run_dir} holds files that are not an ftcli run ({shown}); ftcli never "
                        "deletes or writes there: set output.dir to a new or empty dir")
    refuse_links(written_paths(run_dir))  # before anything is written, renamed or deleted there
    other = (saved_recipe_name(run_dir) or name) if contents else name
    if other != name:
        if resume is not None:
            raise UserError(f"--resume: {run_dir} is a run of recipe '{other}', not '{name}'")
        if not force:
            raise UserError(f"output dir {run_dir} holds a run of recipe '{other}'; set output.dir to another dir, "
                            "or pass --force to replace that run (deletes its checkpoints, final model and metrics)")
    elif resume is None and contents and _has_outputs(run_dir) and not force:
        resumable = any((p / "meta.json").is_file() for p in _checkpoint_entries(run_dir))
        how = "pass --resume to continue it, or --force to start over" if resumable else "pass --force to start over"
        raise UserError(f"{run_dir} already holds a run of '{name}'; {how} "
                        "(deletes its checkpoints, final model and metrics)")
    if resume == "latest" and not (contents and (run_dir / CHECKPOINTS).is_dir()):  # the trainer picks the one
        raise UserError(f"--resume: {run_dir} holds no checkpoint of '{name}'; train without --resume")
    if resume not in (None, "latest") and not Path(resume).is_dir():
        raise UserError(f"--resume {resume}: no such checkpoint dir")
    return run_dir


def prepare_run_dir(recipe, *, force: bool = False, resume: str | None = None) -> Path:
    """`check_run_dir`, then (a fresh start with --force) clear the earlier run's outputs, and write the
    marker and <run>/recipe.yaml (output.dir made absolute). Returns the dir."""
    run_dir = check_run_dir(recipe.name, recipe.output_dir, force=force, resume=resume)
    if resume is None and _contents(run_dir) and _has_outputs(run_dir):  # passed the rule: --force was given
        _clear_outputs(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / OWNER_FILE).is_file():
        from ftcli import __version__

        write_atomic(run_dir / OWNER_FILE, json.dumps({"ftcli_version": __version__, "recipe": recipe.name}) + "\n")
    resolved = saved_recipe(recipe)
    resolved["output"]["dir"] = str(run_dir)
    write_atomic(run_dir / RECIPE_FILE, yaml.safe_dump(resolved, sort_keys=False))
    return run_dir


def dangling_link_in(path: Path) -> Path | None:
    """The first component of `path` (as given, made absolute) that is a symlink to nothing: creating the
    run dir through it would create directories wherever it points."""
    path = Path(os.path.abspath(Path(path).expanduser()))
    return next((p for p in [*reversed(path.parents), path] if p.is_symlink() and not p.exists()), None)


def make_dirs(path: Path) -> list[Path]:
    """`mkdir -p path`; returns the directories this call created, outermost first (`remove_dirs` undoes it)."""
    path = Path(path)
    missing = [p for p in [*reversed(path.parents), path] if not p.exists() and not p.is_symlink()]
    path.mkdir(parents=True, exist_ok=True)
    return missing


def remove_dirs(created: list[Path]) -> None:
    """Remove what `make_dirs` created, innermost first, as long as each is still an empty directory."""
    for p in reversed(created):
        try:
            if p.is_dir() and not p.is_symlink():
                p.rmdir()
        except OSError:  # something else was written there meanwhile: leave it
            return


class _Record(BaseModel):
    model_config = ConfigDict(extra="allow")  # a newer ftcli may add fields; an older reader keeps them


class BaseModelRecord(_Record):
    """The base the run trained from: enough to load it again (merge-lora, register, generate)."""

    id: str | None = None
    revision: str | None = None
    init: str = "pretrained"
    config: str | None = None
    model_type: str | None = None
    model_class: str | None = None
    path: str | None = None  # relative to the run dir: a random-init base saved beside the run (LoRA)


class MlflowRecord(_Record):
    tracking_uri: str | None = None
    experiment_id: str | None = None
    run_id: str | None = None


class TokenCounts(_Record):
    trained: int = 0  # tokens with a label (what the loss is averaged over)
    seen: int = 0  # tokens fed to the model, padding excluded


class Throughput(_Record):
    """Of this invocation: a resumed run counts the part after its checkpoint."""

    tokens_per_s: float | None = None
    s_per_step: float | None = None


class DataSourceRecord(_Record):
    """One data source a run read: run.json's `data_sources`, the run's MLflow dataset inputs
    (`MlflowTracking.log_lineage`) and, through `register`, its model version's tags."""

    label: str
    context: Literal["training", "eval"] = "training"
    kind: str  # hub, local, delta, synthetic (recipe data.source)
    path: str | None = None  # hub id, file or dir, table path or Unity Catalog name
    revision: str | None = None  # hub commit, Delta table version read; None: unpinned hub data, files
    split: str | None = None
    digest: str | None = None  # of what identifies the rows (ftcli.data.sources.origin)
    filter: str | None = None  # a Delta table's row filter (ftcli.config.rowfilter.describe_filter)
    rows_read: int = 0
    rows_kept: int = 0

    def describe(self) -> str:
        """One line: `delta main.sft.chats@12 where lang = "en" (train) rows 1000 read, 990 kept, digest 0123...`."""
        at = f"@{self.revision}" if self.revision else ""
        where = f" where {self.filter}" if self.filter else ""
        return (f"{self.kind} {self.path or self.label}{at}{where} ({self.split}) rows {self.rows_read} read, "
                f"{self.rows_kept} kept, digest {self.digest}")


class ParentRunRecord(_Record):
    """The ftcli run whose model this run started from (model.id = that run's dir, final/ or best/: a DPO run's SFT
    run), as its run.json says: run.json's `parent_run`, the MLflow run's and (`register`) the model version's
    `ftcli.parent.*` tags (`tags`)."""

    run_dir: str  # absolute
    model_dir: str  # the model this run started from, relative to run_dir (final, best)
    recipe: str | None = None  # its recipe's name
    recipe_digest: str | None = None
    method: str | None = None
    objective: str | None = None
    mlflow_run_id: str | None = None  # None: it ran without tracking
    mlflow_experiment_id: str | None = None

    def tags(self) -> dict[str, str]:
        """The lineage tags of a child (its MLflow run, its registered model version), the empty ones left out."""
        tags = {"ftcli.parent.run_dir": self.run_dir, "ftcli.parent.model_dir": self.model_dir,
                "ftcli.parent.recipe": self.recipe, "ftcli.parent.recipe_digest": self.recipe_digest,
                "ftcli.parent.objective": self.objective, "ftcli.parent.run_id": self.mlflow_run_id,
                "ftcli.parent.experiment_id": self.mlflow_experiment_id}
        return {k: v for k, v in tags.items() if v}


class RunRecord(_Record):
    """run.json: the one typed record of a training run. Both trainers write it; merge-lora, register and
    generate read it (through `read_run_record`), never as a raw dict."""

    ftcli_version: str | None = None
    method: Literal["full", "lora"]  # how it trained (ftcli.objectives.METHODS: method_of(run.method) says the rest)
    objective: str = "sft"  # what it optimized (ftcli.objectives.OBJECTIVES); run.json of older runs: SFT
    recipe: dict[str, Any] = Field(default_factory=dict)  # the resolved recipe, secrets masked
    model_dir: str | None = FINAL  # relative to the run dir; None when no final model was exported
    base_model: BaseModelRecord = Field(default_factory=BaseModelRecord)
    mlflow: MlflowRecord | None = None
    steps: int = 0
    tokens: TokenCounts = Field(default_factory=TokenCounts)
    final_loss: float | None = None
    throughput: Throughput = Field(default_factory=Throughput)
    status: str = "completed"
    data: dict[str, Any] | None = None  # the training data's summary (ftcli.data.DataSummary.to_dict())
    eval_data: dict[str, dict[str, Any]] | None = None  # each eval source's data summary
    evals: list[dict[str, Any]] = Field(default_factory=list)  # every eval: step, loss, ppl, tokens, sources
    best_step: int | None = None  # the step of the best eval loss
    best_eval_loss: float | None = None
    best_checkpoint: str | None = None  # its checkpoint, kept by training.checkpoint.keep_best
    best_model_dir: str | None = None  # relative to the run dir: the best eval's model (final or best)
    stopped_early: str | None = None  # why eval.early_stop ended the run
    recipe_digest: str | None = None  # `recipe_digest`: the same recipe (wherever its output dir) has the same
    data_sources: list[DataSourceRecord] = Field(default_factory=list)  # what the run read (training, then eval)
    parent_run: ParentRunRecord | None = None  # the ftcli run whose model this run started from (an SFT run)

    def best_model_path(self, run_dir: Path) -> Path | None:
        return Path(run_dir) / self.best_model_dir if self.best_model_dir else None

    def model_path(self, run_dir: Path) -> Path | None:
        return Path(run_dir) / self.model_dir if self.model_dir else None


def read_run_record(run_dir: Path) -> RunRecord:
    """<run_dir>/run.json as a RunRecord; a missing or malformed file is one UserError naming the path."""
    path = Path(run_dir) / RUN_JSON
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path} does not exist; pass a run dir written by `ftcli train`") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot read run.json ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: run.json is not a JSON object")
    try:
        return RunRecord.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "run.json"
        raise UserError(f"{path}: {where}: {first['msg']}") from None


def write_run_record(run_dir: Path, record: RunRecord) -> Path:
    path = Path(run_dir) / RUN_JSON
    write_atomic(path, record.model_dump_json(indent=2, exclude_none=False) + "\n")
    return path


def new_run_record(recipe, *, method: Literal["full", "lora"], mlflow: dict | None, base_path: str | None = None,
                   **fields: Any) -> RunRecord:
    """The part of run.json both trainers fill the same way (ftcli version, method, the resolved recipe,
    the base model from recipe.model, the MLflow run), plus the trainer's own `fields` (steps, tokens,
    final_loss, throughput, model_dir, status). `base_path`: a base saved beside the run (LoRA random init)."""
    from ftcli import __version__

    m = recipe.model
    base = BaseModelRecord(id=m.id, revision=m.revision, init=m.init, config=m.config, model_type=m.model_type,
                           model_class=m.model_class, path=base_path)
    return RunRecord(ftcli_version=__version__, method=method, objective=recipe.training.objective,
                     recipe=saved_recipe(recipe), base_model=base,
                     mlflow=mlflow, **fields)

