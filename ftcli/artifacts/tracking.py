"""Experiment tracking: MLflow from rank 0, nothing anywhere else. Shared by both trainers.

    tracker = start_tracking(recipe, run_dir=run_dir, rank=rank, resume=resume is not None)
    tracker.log_metrics({"loss": 2.1, "lr": 1e-5}, step=10)
    tracker.log_artifact(run_dir / "run.json")
    tracker.finish()                  # or finish("FAILED")
    tracker.info                      # {"tracking_uri", "experiment_id", "run_id"} for run.json, or None

Where the run goes:
- $MLFLOW_RUN_ID set (Databricks AI Runtime gives every job one): log into that run.
- resuming a run dir that was tracked before: log into the same MLflow run (`<run>/tracking.json`), so
  the metrics continue on one chart.
- otherwise a new run in experiment `tracking.experiment` (default: the recipe name).
The store is `tracking.tracking_uri`, else $MLFLOW_TRACKING_URI, else `sqlite:///<cwd>/mlflow.db`
(an absolute path, so every process of the job writes the same file). Params are the resolved recipe,
flattened, with secret and env values replaced by "***" (ftcli.config.redact.scrub_recipe).

Failure policy (chosen): a tracking server that cannot be reached when the run starts is a
`UserError` naming the URI, before any compute is spent (a run you believe is tracked but is not is
the worse surprise). Once training runs, a failed logging call prints one warning and turns tracking
off for the rest of the run: hours of training are worth more than the metrics (metrics.jsonl has them).

Every call is bounded, so a server that accepts connections and then never answers cannot hold a run:
MLflow's own per-request timeout and retries are lowered (REQUEST_TIMEOUT_S, REQUEST_RETRIES, unless
$MLFLOW_HTTP_REQUEST_TIMEOUT / $MLFLOW_HTTP_REQUEST_MAX_RETRIES are set), and each call as a whole gets a
budget (START_BUDGET_S for the probe + run start + params, CALL_BUDGET_S per logging call; `bounded`). A
server answering 5xx is unreachable, like one that refuses the connection. SIGTERM / SIGINT during a call
end the call at once (the trainer's stop flag still records the signal): at the start, tracking is then
skipped with a warning and the run stops at its first step boundary as usual.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit, urlunsplit

from ftcli.config.safe_files import write_atomic
from ftcli.config.errors import UserError
from ftcli.config.redact import has_masked_credentials, mask_uri, scrub_recipe, split_credentials  # no secret reaches MLflow

TRACKING_FILE = "tracking.json"
PROBE_TIMEOUT_S = 10
START_BUDGET_S = 60
CALL_BUDGET_S = 30
REQUEST_TIMEOUT_S = 10
REQUEST_RETRIES = 2


class TrackingTimeout(BaseException):
    """Raised inside a tracking call by `bounded`: its budget is spent, or a stop signal came. A
    BaseException, so that no `except Exception` (MLflow's retry and wrapping code) swallows it."""

    def __init__(self, why: str, signum: int = 0):
        super().__init__(why)
        self.why, self.signum = why, signum


@contextlib.contextmanager
def bounded(budget_s: float) -> Iterator[None]:
    """The block runs for at most `budget_s` (SIGALRM), and a SIGTERM / SIGINT ends it at once; both raise
    TrackingTimeout inside it. The stop handler that was installed (the trainer's StopFlag) still gets the
    signal first; a default SIGTERM action is carried out after the block. Outside the main thread
    (where signals cannot be handled) only MLflow's request timeouts bound it."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return
    stops = (signal.SIGTERM, signal.SIGINT)

    def on_alarm(signum, frame):
        raise TrackingTimeout(f"no answer within {budget_s:g} s")

    def on_stop(signum, frame):
        handler = previous[signum]
        if callable(handler):
            handler(signum, frame)  # records it (StopFlag), or raises KeyboardInterrupt (default SIGINT)
        raise TrackingTimeout(f"{signal.Signals(signum).name} received", int(signum))

    previous = {sig: signal.signal(sig, on_stop) for sig in stops}
    old_alarm = signal.signal(signal.SIGALRM, on_alarm)
    pending, started = 0, time.monotonic()
    outer, _ = signal.setitimer(signal.ITIMER_REAL, budget_s)  # an outer alarm (pytest-timeout) waits for ours
    try:
        yield
    except TrackingTimeout as e:
        pending = e.signum if e.signum and not callable(previous[e.signum]) else 0
        raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_alarm)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 1e-3))
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if pending:
            signal.raise_signal(pending)  # a SIGTERM with no handler: its default action, as without us


def resolve_tracking_uri(uri: str | None = None, *, recorded: str | None = None) -> str:
    """`uri` (the recipe's tracking.tracking_uri, register's --tracking-uri), else `recorded` (the
    training run's store, run.json: a sqlite file there must still exist), else $MLFLOW_TRACKING_URI,
    else sqlite:///<abs cwd>/mlflow.db. A URI whose credentials were masked (`https://***@host`, as
    <run>/recipe.yaml and run.json hold it) stands for $MLFLOW_TRACKING_URI when that is the same URI
    with them (what the launcher hands its workers, `export_credentials`); otherwise it is used
    without them, and MLflow reads MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD."""
    if not uri and recorded and recorded.startswith("sqlite:///") and not Path(recorded[len("sqlite:///"):]).is_file():
        raise UserError(f"the training run's MLflow store {recorded} (run.json) is missing; pass --tracking-uri")
    env = os.environ.get("MLFLOW_TRACKING_URI")
    uri = uri or recorded or env or f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"
    if not has_masked_credentials(uri):
        return uri
    return env if env and mask_uri(env) == uri else split_credentials(uri)[0]


def export_credentials(tracking) -> None:
    """The launcher: the workers read recipe.yaml, where the tracking URI's credentials are masked, so
    the URI with them goes to the workers as $MLFLOW_TRACKING_URI (inherited through torchrun; MLflow's
    own variable, and the one `resolve_tracking_uri` puts in place of the masked URI). `tracking`: the recipe's
    tracking section."""
    uri = tracking.tracking_uri
    if uri and mask_uri(uri) != uri and not has_masked_credentials(uri):
        os.environ["MLFLOW_TRACKING_URI"] = uri


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (MLflow's can run to pages), or its type's name,
    with any credentials in the URLs it quotes masked."""
    return mask_uri((str(exc).strip().splitlines() or [type(exc).__name__])[0])


# Lines of an MLflow error that say where it came from, not what went wrong (SQLAlchemy's wrapper text)
_NOT_THE_PROBLEM = ("(raised as a result of", "(Background on this error", "[SQL:", "[parameters:")


def mlflow_problem(exc: BaseException) -> str:
    """What went wrong in an MLflow error, in one line: its first line that is not SQLAlchemy's wrapper text (a
    full sqlite store says "(raised as a result of Query-invoked autoflush ..." first, the reason two lines
    later), credentials masked."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    found = next((ln for ln in lines if not ln.startswith(_NOT_THE_PROBLEM)), None)
    return mask_uri(found) if found else first_line(exc)


@contextlib.contextmanager
def quiet_library_logs(names: tuple[str, ...] = ("mlflow", "alembic", "sqlalchemy")) -> Iterator[None]:
    """MLflow's (and its store's) own log records dropped for the block: a failed call logs its exception, with
    pages of traceback, once per layer it passes (1,173 lines for a register on a full disk), and a new store
    logs its migrations. The caller says what happened in its own line."""
    import logging

    loggers = [logging.getLogger(name) for name in names] + [  # and those below them with a level of their own
        logger for key, logger in list(logging.Logger.manager.loggerDict.items())
        if isinstance(logger, logging.Logger) and key.split(".")[0] in names and key not in names and logger.level]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def check_reachable(uri: str, *, fix: str, timeout_s: float = PROBE_TIMEOUT_S, what="MLflow tracking server") -> None:
    """An http(s) MLflow server must answer one quick GET /health, so a wrong URI fails in seconds
    (not after MLflow's retries) with a UserError naming the masked URI, why, and `fix`. Other stores
    (sqlite, databricks) are left to the first real call."""
    if not uri.startswith(("http://", "https://")):
        return
    parts = urlsplit(uri)  # /health needs no credentials, and urllib would take user:password@ for the host
    health = urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path.rstrip("/") + "/health", "", ""))
    proxy = proxy_for(health)  # as MLflow's requests will: through $HTTP(S)_PROXY unless $NO_PROXY says not
    proxies = {parts.scheme: os.environ[proxy[0]]} if proxy else {}
    try:
        urllib.request.build_opener(urllib.request.ProxyHandler(proxies)).open(health, timeout=timeout_s).close()
    except urllib.error.HTTPError as e:
        if e.code < 500:
            return  # it answered: reachable (auth or routing is MLflow's to report)
        via = f", through the proxy {proxy[1]} (${proxy[0]})" if proxy else ""
        raise UserError(f"cannot reach the {what} at {mask_uri(uri)} (it answers HTTP {e.code}{via}); {fix}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)  # URLError wraps the socket's error
        if isinstance(reason, ConnectionRefusedError):
            why = "connection refused"
        elif isinstance(reason, TimeoutError):
            why = f"no answer within {timeout_s:g} s"
        elif isinstance(reason, socket.gaierror):
            why = "unknown host"
        else:
            why = str(reason)
        if proxy:  # the connection that failed was the one to the proxy: the server itself was never asked
            raise UserError(f"cannot reach the proxy {proxy[1]} (${proxy[0]}) that the {what} at {mask_uri(uri)} is "
                            f"reached through ({why}); fix the proxy setting, or add the server's host to $NO_PROXY"
                            ) from None
        raise UserError(f"cannot reach the {what} at {mask_uri(uri)} ({why}); {fix}") from None


def proxy_for(url: str) -> tuple[str, str] | None:
    """(the environment variable, the masked proxy URL) that urllib and requests send `url` through: $https_proxy /
    $HTTPS_PROXY (or $http_proxy / $HTTP_PROXY, $all_proxy) for its scheme, unless $no_proxy / $NO_PROXY names its
    host; None when it goes direct."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    names = [f"{key}_proxy" for key in (parts.scheme, "all")]
    var = next((v for name in names for v in (name, name.upper()) if os.environ.get(v) == proxy), None)
    return (var, mask_uri(proxy)) if var else None  # (a proxy from the system's settings, not the environment)


@contextlib.contextmanager
def http_settings(max_retries: str, timeout_s: float | None = None) -> Iterator[None]:
    """MLflow's HTTP retries (and request timeout) for the block, through its own environment variables;
    afterwards each has its old value, or none."""
    values = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": max_retries}
    if timeout_s is not None:
        values["MLFLOW_HTTP_REQUEST_TIMEOUT"] = f"{timeout_s:g}"
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


def recipe_params(recipe: dict | None) -> dict[str, str]:
    """The MLflow params of a run: the recipe dict flattened, secrets and env values "***", URIs masked."""
    return flatten(scrub_recipe(recipe))


def create_run(client, experiment: str, *, run_name: str, tags: dict[str, str], params: dict[str, str],
               metrics: dict[str, float]):
    """A new run in `experiment` (created on first use) through `client`, with params and step-0 metrics."""
    from mlflow.entities import Metric, Param

    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(experiment)
    run = client.create_run(exp_id, run_name=run_name, tags=tags)
    now = int(time.time() * 1000)
    client.log_batch(run.info.run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
                     params=[Param(k, v) for k, v in params.items()])
    return run


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """{"training": {"optimizer": {"lr": 1e-5}}} -> {"training.optimizer.lr": "1e-05"} (MLflow params)."""
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, tuple, dict)) else str(value)
    return out


def dataset_of(src):
    """An MLflow dataset (name, digest, source) for a DataSourceRecord, with the source type MLflow has for its
    kind: a Delta table (path or Unity Catalog name, and version), a Hugging Face dataset (id, split, revision), a
    local file or dir, or code (synthetic rows)."""
    import warnings

    from mlflow.data.meta_dataset import MetaDataset

    if src.kind == "delta":
        from mlflow.data.delta_dataset_source import DeltaDatasetSource

        uc_name = src.path is not None and "/" not in src.path and src.path.count(".") == 2
        version = int(src.revision) if src.revision is not None else None
        source = DeltaDatasetSource(delta_table_name=src.path, delta_table_version=version) if uc_name else \
            DeltaDatasetSource(path=src.path, delta_table_version=version)
    elif src.kind == "hub":
        from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

        source = HuggingFaceDatasetSource(src.path, split=src.split, revision=src.revision)
    elif src.kind == "local":
        from mlflow.data.dataset_source_registry import resolve_dataset_source

        with warnings.catch_warnings():  # "can be interpreted in multiple ways": both readings are the local one
            warnings.simplefilter("ignore")
            source = resolve_dataset_source(src.path)
    else:
        from mlflow.data.code_dataset_source import CodeDatasetSource

        source = CodeDatasetSource({"ftcli.kind": src.kind})
    return MetaDataset(source, name=src.label, digest=src.digest)


class NoTracking:
    """Tracking turned off, or a rank other than 0: every call does nothing."""

    info: dict[str, str] | None = None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: str | Path) -> None:
        pass

    def log_table(self, rows: list[dict[str, Any]], artifact_file: str) -> None:
        pass

    def log_lineage(self, sources: list, recipe_digest: str, parent=None) -> None:
        pass

    def finish(self, status: str = "FINISHED") -> None:
        pass


class MlflowTracking(NoTracking):
    """An active MLflow run; logging errors warn once and switch tracking off (see the module doc)."""

    def __init__(self, mlflow, run, tracking_uri: str):
        self._mlflow = mlflow
        self._live = True
        self._finished = False
        # A process that ends without `finish` (an error before the training loop's own handler, a
        # SystemExit) would have its run closed FINISHED by MLflow's atexit hook; this one runs first
        # (atexit is last in, first out) and closes it FAILED.
        atexit.register(self._fail_if_unfinished)
        # what run.json and tracking.json record: the URI with its credentials masked
        self.info = {"tracking_uri": mask_uri(tracking_uri), "experiment_id": run.info.experiment_id,
                     "run_id": run.info.run_id}

    def _call(self, fn, *args, **kwargs) -> None:
        if not self._live:
            return
        try:
            with bounded(CALL_BUDGET_S):
                fn(*args, **kwargs)
        except (Exception, TrackingTimeout) as e:  # noqa: BLE001 - any tracking failure must not stop training
            self._live = False
            why = e.why if isinstance(e, TrackingTimeout) else first_line(e)
            print(f"warning: MLflow logging to {self.info['tracking_uri']} failed ({why}); "
                  "tracking is off for the rest of this run (metrics.jsonl keeps the metrics)", file=sys.stderr)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._call(self._mlflow.log_metrics, {k: float(v) for k, v in metrics.items()}, step=step)

    def log_artifact(self, path: str | Path) -> None:
        self._call(self._mlflow.log_artifact, str(path))

    def log_table(self, rows: list[dict[str, Any]], artifact_file: str) -> None:
        """Rows of equal keys as an MLflow table artifact (e.g. the training samples)."""
        columns = {k: [r[k] for r in rows] for k in (rows[0] if rows else {})}
        self._call(self._mlflow.log_table, data=columns, artifact_file=artifact_file)

    def log_lineage(self, sources: list, recipe_digest: str, parent=None) -> None:
        """Each data source (ftcli.artifacts.rundir.DataSourceRecord) as an MLflow dataset input of this run, in
        its context (training, eval), tagged with its split, revision, row filter and rows read and kept; the recipe
        digest as the run's tag `ftcli.recipe_digest`; the run this one started from (`parent`, a ParentRunRecord: a
        DPO run's SFT run) as `ftcli.parent.*` tags. The MLflow UI lists the sources under the run's "Datasets used"."""
        def log() -> None:
            self._mlflow.set_tags({"ftcli.recipe_digest": recipe_digest, **(parent.tags() if parent else {})})
            for src in sources:
                tags = {"ftcli.split": str(src.split), "ftcli.rows_read": str(src.rows_read),
                        "ftcli.rows_kept": str(src.rows_kept), "ftcli.kind": src.kind}
                if src.revision is not None:
                    tags["ftcli.revision"] = src.revision
                if src.filter is not None:
                    tags["ftcli.filter"] = src.filter
                try:
                    self._mlflow.log_input(dataset_of(src), context=src.context, tags=tags)
                except Exception as e:  # noqa: BLE001 - one source MLflow cannot describe: the rest is logged
                    print(f"warning: MLflow dataset input for {src.label} not logged ({first_line(e)}); run.json "
                          "records it", file=sys.stderr)

        self._call(log)

    def finish(self, status: str = "FINISHED") -> None:
        """End the run: FINISHED, FAILED (an error) or KILLED (stopped by SIGTERM / SIGINT)."""
        if self._finished:
            return
        self._finished = True
        atexit.unregister(self._fail_if_unfinished)
        self._call(self._mlflow.end_run, status=status)

    def _fail_if_unfinished(self) -> None:
        if not self._finished:
            self.finish("FAILED")


def start_tracking(recipe, *, run_dir: Path | None = None, rank: int = 0, resume: bool = False) -> NoTracking:
    """Start (or attach to) the MLflow run on rank 0 and log the resolved recipe as params."""
    if rank != 0 or not recipe.tracking.enabled:
        return NoTracking()
    uri = resolve_tracking_uri(recipe.tracking.tracking_uri)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(REQUEST_TIMEOUT_S))  # MLflow's: connect + read
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(REQUEST_RETRIES))
    import mlflow  # noqa: F401 - imported outside the budget: an import cut short would stay half-done
    import mlflow.entities  # noqa: F401

    try:
        with bounded(START_BUDGET_S):
            return _start(recipe, uri, run_dir=run_dir, resume=resume)
    except TrackingTimeout as e:
        if e.signum:
            print(f"warning: MLflow tracking not started ({e.why}); the run stops at its first step boundary",
                  file=sys.stderr)
            return NoTracking()
        raise UserError(f"cannot start an MLflow run at {mask_uri(uri)}: {e.why}; "
                        "set tracking.enabled=false to train without tracking") from None


def _start(recipe, uri: str, *, run_dir: Path | None, resume: bool) -> NoTracking:
    fix = "start it, fix tracking.tracking_uri / $MLFLOW_TRACKING_URI, or set tracking.enabled=false"
    check_reachable(uri, fix=fix)
    import logging

    import mlflow

    logging.getLogger("mlflow").setLevel(logging.WARNING)  # its INFO lines would bury the step lines
    mlflow.set_tracking_uri(uri)
    if mask_uri(uri) != uri:  # MLflow prints the run's link, credentials and all, when the run ends
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    run_id = os.environ.get("MLFLOW_RUN_ID")
    saved = Path(run_dir) / TRACKING_FILE if run_dir is not None else None
    if not run_id and resume and saved is not None and saved.is_file():
        previous = json.loads(saved.read_text())
        if previous.get("tracking_uri") in (uri, mask_uri(uri)):
            run_id = previous.get("run_id")
    try:
        if run_id:
            run = mlflow.start_run(run_id=run_id, log_system_metrics=recipe.tracking.log_system_metrics)
        else:
            experiment = mlflow.set_experiment(recipe.tracking.experiment or recipe.name)
            run = mlflow.start_run(
                experiment_id=experiment.experiment_id,
                run_name=recipe.tracking.run_name,
                log_system_metrics=recipe.tracking.log_system_metrics,
            )
    except Exception as e:  # noqa: BLE001 - MLflow raises many types; the user needs one line
        raise UserError(f"cannot start an MLflow run at {mask_uri(uri)}: {first_line(e)}; "
                        "set tracking.enabled=false to train without tracking") from None
    tracker = MlflowTracking(mlflow, run, uri)
    try:
        mlflow.log_params(recipe_params(recipe.to_dict()))
    except Exception as e:  # noqa: BLE001 - e.g. a resumed run whose recipe changed: params are immutable
        print(f"warning: MLflow kept the params it had for this run ({first_line(e)})", file=sys.stderr)
    if run_dir is not None:
        tracker._call(mlflow.set_tag, "ftcli.run_dir", str(Path(run_dir).resolve()))
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        write_atomic(saved, json.dumps(tracker.info, indent=2) + "\n")
    return tracker
