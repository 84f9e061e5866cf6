"""`ftcli train`: prepare the run dir, start torchrun, and in each worker hand over to the trainer.

    ftcli train --recipe R            (no RANK in the environment: the launcher)
      -> the run dir's lock (one writer), after the refusal rule   run_dir_lock, ftcli.artifacts.rundir.check_run_dir
      -> tokenizer, data tokenized + packed into the on-disk cache (errors are one line here)
      -> only then: an earlier run's outputs cleared (--force), <run>/recipe.yaml   ftcli.artifacts.rundir.prepare_run_dir
      -> torchrun --nproc_per_node=<GPUs | training.cpu_processes> -m ftcli train --recipe <run>/recipe.yaml
           (inside torchrun, RANK is set: the worker; it dies with the launcher, _die_with_launcher)
           -> the method's trainer (TRAINERS): full: ftcli.train.full.train(recipe, run_dir, resume)
                                                lora: ftcli.train.lora.trainer.train(recipe, run_dir, resume)

The launcher runs torchrun's agent in this process (`torch.distributed.run.run`), the same code the
`torchrun` command runs, so a failed worker ends in one line and an exit code rather than the agent's
traceback. Multi-node: on Databricks AI Runtime (NUM_NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT set)
the launcher passes them on; anywhere else, run `torchrun --nnodes ... -m ftcli train --recipe R` on
every node yourself: the workers read everything from the environment and the recipe.

SIGTERM / SIGINT (Ctrl-C) to the launcher: torchrun's agent forwards it to every worker and waits up to
`ftcli.train.preempt.STOP_GRACE_S`; the workers stop at the next step boundary with a checkpoint, and the
launcher prints one line, `stopped at step N; resume with ftcli train --recipe <run>/recipe.yaml --resume`,
and exits 143 (SIGTERM) or 130 (SIGINT). The same when the platform signals the workers themselves.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ftcli.config.errors import TrainingStopped, UserError
from ftcli.objectives import method_of
from ftcli.train.preempt import EXIT_CODES, STOP_GRACE_S, STOP_SIGNALS, Stopped, exit_code, resume_hint, stop_flag
from ftcli.artifacts.rundir import (CHECKPOINTS, LOCK_FILE, RECIPE_FILE, RUN_JSON, check_run_dir, is_own_run, prepare_run_dir,
                          read_run_record, recipe_differences, remove_failed_start, run_dir_of, make_dirs, remove_dirs)
from ftcli.artifacts.tracking import export_credentials
from ftcli.config.safe_files import entries, open_lock, refuse_unsafe

LAUNCHER_PID = "FTCLI_LAUNCHER_PID"


def _train_full(recipe, run_dir: Path, resume: str | None) -> None:
    from ftcli.train.full import train

    train(recipe, run_dir, resume)


def _train_lora(recipe, run_dir: Path, resume: str | None) -> None:
    from ftcli.train.lora.trainer import train

    train(recipe, run_dir, resume)


# Each method's trainer, by training.method (imported when called: each brings its own stack, TRL or FSDP2's loop)
TRAINERS = {"full": _train_full, "lora": _train_lora}


def _inside_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_train(recipe, *, resume: str | None, force: bool) -> None:
    if method_of(recipe.training).needs_packing and not recipe.data.packing.enabled:
        raise UserError(f"training.method={recipe.training.method} trains on packed blocks; set "
                        "data.packing.enabled=true")
    if _inside_torchrun():
        _worker(recipe, resume=resume, force=force)
    elif resume == "latest" and (step := finished_at(recipe)) is not None:
        print(f"{run_dir_of(recipe.output_dir)} already finished at step {step} (its run.json); nothing to resume "
              "(--force starts over)", file=sys.stderr)
    else:
        with run_dir_lock(recipe, resume=resume, force=force):
            _launch(recipe, resume=resume, force=force)


def finished_at(recipe) -> int | None:
    """The step a completed run of this very recipe (its run.json, the same recipe.yaml) finished at;
    None when there is none, so `--resume` goes on to the checkpoints."""
    run_dir = run_dir_of(recipe.output_dir)
    if (not (run_dir / RUN_JSON).is_file() or not is_own_run(run_dir, recipe.name)
            or recipe_differences(run_dir, recipe)):
        return None
    try:
        record = read_run_record(run_dir)
    except UserError:
        return None
    return record.steps if record.status == "completed" else None


# ------------------------------------------------------------------------------------------ launcher
def shutdown_grace_args() -> list[str]:
    """torchrun's grace between forwarding a stop signal and SIGKILL: the workers' stop checkpoint
    (ftcli.train.preempt) may take minutes at 27B, torchrun's default is 30 s. torch 2.13's torchrun takes
    `--shutdown_timeout`, 2.11's does not (it refuses the whole command line): there the 30 s stay, said on
    stderr, since a stop checkpoint may be cut short."""
    from torch.distributed.run import get_args_parser

    _, unknown = get_args_parser().parse_known_args([f"--shutdown_timeout={STOP_GRACE_S}", "worker.py"])
    if not unknown:
        return [f"--shutdown_timeout={STOP_GRACE_S}"]
    import torch

    print(f"note: torchrun of torch {torch.__version__} has no --shutdown_timeout: on SIGTERM the workers get its "
          f"30 s (not {STOP_GRACE_S} s) to write their stop checkpoint", file=sys.stderr)
    return []


def _processes_per_node(recipe) -> tuple[int, str]:
    import torch

    if os.environ.get("LOCAL_WORLD_SIZE"):
        return int(os.environ["LOCAL_WORLD_SIZE"]), "GPU"
    if torch.cuda.is_available():
        return torch.cuda.device_count(), "GPU"
    return recipe.training.cpu_processes, "CPU process"


def check_context_parallel(recipe) -> None:
    """One UserError, before the run dir is touched, when the launch's ranks do not split into whole
    context-parallel groups (`training.context_parallel` consecutive ranks share each block)."""
    cp = getattr(recipe.training, "context_parallel", 1)
    nproc, unit = _processes_per_node(recipe)
    ranks = nproc * int(os.environ.get("NUM_NODES", "1"))
    if ranks % cp:
        raise UserError(f"training.context_parallel={cp} does not divide the {ranks} ranks of this launch ({nproc} "
                        f"{unit}(s) per node); use a divisor of {ranks}")


def starting_model(recipe):
    """`model.id` naming an earlier ftcli run (its dir, or its final/ or best/): the model that run wrote, so a
    preference run starts from an SFT run (`ftcli.artifacts.resolve.locate`; its run.json says where it came from).
    A LoRA run's adapter is refused in one line: merge it into its base first. Anything else stays as it is."""
    from ftcli.artifacts.resolve import locate, run_dir_holding
    from ftcli.config.recipe import resolve_path

    ref = recipe.model.id
    path = Path(resolve_path(ref)).expanduser() if ref and recipe.model.init == "pretrained" else None
    if path is None or not path.is_dir() or run_dir_holding(path.resolve()) is None:
        return recipe
    target = locate(path, completed=True)
    if target.kind == "adapter":
        raise UserError(f"model.id {ref} is a LoRA run's adapter; merge it into its base first (`ftcli merge-lora "
                        f"{ref}`) and set model.id to the merged model")
    return recipe.model_copy(update={"model": recipe.model.model_copy(update={"id": str(target.model_dir)})})


def _launch(recipe, *, resume: str | None, force: bool) -> None:
    recipe = starting_model(recipe)  # model.id = an earlier run: the model it wrote
    run_dir = run_dir_of(recipe.output_dir)
    if resume not in (None, "latest"):
        resume = str(Path(resume).resolve())
    if resume is not None:  # before anything is written: recipe.yaml stays the run's
        check_resume(recipe, run_dir, resume, world_size=_processes_per_node(recipe)[0] * int(os.environ.get("NUM_NODES", "1")))
    from ftcli.data.checks import quick_check
    from ftcli.data.spec import data_spec
    from ftcli.model.checks import check_model_config

    refuse_gpu_recipe_on_cpu(recipe)  # doctor's verdict first: a GPU recipe's data is not read here
    quick_check(data_spec(recipe))  # a source whose rows are all unreadable in its format: refused before torch
    # a config that builds no model fails here, before the run dir is touched
    check_model_config(recipe.model, recipe.data.packing)
    try:
        _preflight(recipe)  # before anything in the run dir is cleared or written
    except KeyboardInterrupt:
        print("interrupted before training started; nothing to resume", file=sys.stderr)
        raise SystemExit(exit_code(signal.SIGINT)) from None
    check_context_parallel(recipe)
    run_dir = prepare_run_dir(recipe, force=force, resume=resume)
    export_credentials(recipe.tracking)  # recipe.yaml holds the tracking URI masked
    nproc, unit = _processes_per_node(recipe)
    if unit == "CPU process":
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    else:  # the workers' compiled kernels and autotune results, kept for the next run (ftcli.model.kernels.cache)
        from ftcli.model.kernels.cache import compile_notice, persistent_caches

        print(compile_notice(*persistent_caches()), file=sys.stderr)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("PYTHONSAFEPATH", "1")  # `-m ftcli` must not pick up a folder named ftcli in the cwd
    os.environ["FTCLI_LAUNCHED"] = "1"
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the workers die with this process (_die_with_launcher)

    torchrun_args = [f"--nproc_per_node={nproc}", *shutdown_grace_args()]
    num_nodes = int(os.environ.get("NUM_NODES", "1"))
    if num_nodes > 1:
        torchrun_args += [
            f"--nnodes={num_nodes}", f"--node_rank={os.environ['NODE_RANK']}",
            f"--master_addr={os.environ['MASTER_ADDR']}", f"--master_port={os.environ['MASTER_PORT']}",
        ]
    else:
        torchrun_args += ["--standalone"]
    worker = ["-m", "ftcli", "train", "--recipe", str(run_dir / RECIPE_FILE)]
    if resume is not None:
        worker += ["--resume", resume]
    units = {"CPU process": "CPU processes", "GPU": "GPUs"}[unit] if nproc != 1 else unit
    print(f"ftcli train: {recipe.name} ({recipe.training.method}) on {num_nodes} x {nproc} {units}, "
          f"run dir {run_dir}", file=sys.stderr)

    import logging

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # the failure or the stop is reported below; every elastic module's logger has its own level (LOGLEVEL)
    for name in ["torch.distributed.elastic", *logging.Logger.manager.loggerDict]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    started = time.time()
    try:
        run(parse_args([*torchrun_args, *worker]))
    except SignalException as e:  # the launcher was signalled; the agent forwarded it and waited
        _stopped(recipe.training, run_dir, int(e.sigval), started)
    except ChildFailedError as e:
        from ftcli.train.failures import Failure, recorded_message, stop_signal, summary

        failures = [Failure(rank, f.exitcode, recorded_message(f.error_file_data))
                    for rank, f in e.failures.items()]  # global ranks; a message where a worker wrote its error file
        signum = stop_signal(failures, _STOP_EXIT_CODES)
        if signum is not None:  # the workers were signalled directly (not through the launcher)
            _stopped(recipe.training, run_dir, signum, started)
        ckpts = run_dir / CHECKPOINTS
        committed = any(not p.name.startswith((".tmp", "tmp-")) for p in entries(ckpts))  # not a save cut short
        hint = " (--resume continues from the last checkpoint)" if committed else ""
        raise UserError(summary(failures, _STOP_EXIT_CODES, hint)) from None


# a worker's exit code after a stop: its own (ftcli.train.preempt.EXIT_CODES) or killed by the signal (-signum)
_STOP_EXIT_CODES = {code: int(sig) for sig, code in EXIT_CODES.items()} | {-int(sig): int(sig) for sig in STOP_SIGNALS}


def _completed_since(run_dir: Path, started: float) -> bool:
    """Did this launch's workers finish the run (a signal during the final export is too late to stop it)?"""
    path = run_dir / RUN_JSON
    try:
        return path.stat().st_mtime >= started and read_run_record(run_dir).status == "completed"
    except (OSError, UserError):
        return False


def _stopped(training, run_dir: Path, signum: int, started: float) -> None:
    """After a SIGTERM / SIGINT: one line naming the step --resume continues from, and the exit code
    (none when the run had completed: it returns)."""
    from ftcli.train.checkpoint import checkpoint_step, resolve_resume

    if _completed_since(run_dir, started):
        return

    try:
        newest = resolve_resume(run_dir, "latest", kind=method_of(training).checkpoint_kind)
    except UserError:  # none saved yet
        newest = None
    step = checkpoint_step(newest) if newest is not None else None
    print(resume_hint(step, str(run_dir / RECIPE_FILE), checkpoints_enabled=training.checkpoint.enabled),
          file=sys.stderr)
    raise SystemExit(exit_code(signum))


def check_resume(recipe, run_dir: Path, resume: str | None, *, world_size: int) -> None:
    """A resume continues the run it names: the recipe may change only what `ftcli.train.resume` applies,
    compared with the recipe of the run that wrote the checkpoint (this run's, or another run's when
    `--resume` names its checkpoint), the global batch stays the checkpoint's (full path: `world_size` ranks
    x grad_accum), and the checkpoint must be the one that was saved (`verify_checkpoint`: sizes and CRC32s,
    both paths). One UserError otherwise; writes nothing."""
    if resume is None:
        return
    from ftcli.train.checkpoint import read_meta, resolve_resume, verify_checkpoint
    from ftcli.train.resume import check_global_batch, check_resume_recipe

    kind = method_of(recipe.training).checkpoint_kind
    checkpoint = resolve_resume(run_dir, resume, kind=kind)
    meta = read_meta(checkpoint) if kind == "dcp" else {}
    # blocks per optimizer step: one per data-parallel group (a context-parallel group shares its block) x grad_accum
    groups = world_size // getattr(recipe.training, "context_parallel", 1)
    same_batch = meta.get("blocks_per_step") == groups * recipe.training.grad_accum
    warn = lambda line: print(line, file=sys.stderr)  # noqa: E731
    written_by = checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINTS else None
    if kind == "dcp":
        check_global_batch(checkpoint, meta, recipe.training.grad_accum, groups)
    if is_own_run(run_dir, recipe.name):
        check_resume_recipe(run_dir, recipe, warn=warn, same_global_batch=same_batch)
    if written_by is not None and written_by.resolve() != run_dir.resolve():
        if (written_by / RECIPE_FILE).is_file():
            check_resume_recipe(written_by, recipe, warn=warn, same_global_batch=same_batch)
        else:
            warn(f"warning: {written_by} holds no {RECIPE_FILE}; the recipe is not compared with the checkpoint's")
    verify_checkpoint(checkpoint, kind=kind)


def _preflight(recipe) -> None:
    """What every worker would fail on in the same way, checked once here: one line, no torchrun noise."""
    from ftcli import data, features

    if any(f.preflight for f in features.active(recipe.training)):  # their packages and devices (LoRA: none, warned)
        import torch

        features.preflight(recipe.training, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    tokenizer = data.load_tokenizer(recipe.model, recipe.data)  # hub id / revision / path and chat template
    packed = data.prepare_blocks(recipe, tokenizer)  # tokenize + pack into the on-disk cache, which the workers open
    _say_data(recipe, packed)
    from ftcli.data.evalsplit import check_eval, eval_specs

    specs = eval_specs(data.data_spec(recipe), recipe.eval)
    check_eval(recipe.eval, {label: data.prepare_blocks(spec, tokenizer) for label, spec in specs.items()})


def _say_data(recipe, packed) -> None:
    """Each source's format (auto: which and why), then refuse a source that keeps no row (one line: the rows
    read, the top skip reasons, the likely fix) or, with data.allow_empty_sources, warn about it."""
    from ftcli.data.checks import check_sources, source_problems, source_warnings

    for label, st in packed.stats.sources.items():
        if st.format_why:
            print(f"data {label}: format {st.format} ({st.format_why})", file=sys.stderr)
    check_sources(recipe.data, packed)
    for problem in source_problems(recipe.data, packed.stats):
        print(f"warning: {problem} (data.allow_empty_sources is on)", file=sys.stderr)
    for problem in source_warnings(recipe.data, packed.stats):
        print(f"warning: {problem}", file=sys.stderr)


def refuse_gpu_recipe_on_cpu(recipe) -> None:
    """On a machine without a GPU: a recipe that does not fit gets doctor's verdict (where to run it), and
    GPU-only settings say to turn them off here, never to install GPU packages on a CPU machine."""
    from ftcli import features, hardware
    from ftcli.estimate import fit

    if hardware.gpu_probe()[0]:  # a GPU driver answers (nvidia-smi, torch-free): torch decides later
        return

    fits, detail = fit.fit_here(recipe, hardware.read("cpu"))
    if not fits:
        raise UserError(f"recipe {recipe.name} cannot run here: {detail}")
    off = [f.off_without_gpu for f in features.active(recipe.training)
           if f.off_without_gpu]  # fused ops: their preflight
    if off:
        raise UserError(f"recipe {recipe.name} asks for GPU kernels and this machine has no GPU: set "
                        f"{', '.join(off)} here, or run it on a GPU (ftcli render-workload --recipe {recipe.name})")


# -------------------------------------------------------------------------------------------- worker
def _worker(recipe, *, resume: str | None, force: bool) -> None:
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ  # not a caller running the command in-process
    if under_torchrun:
        _die_with_launcher()
    run_dir = run_dir_of(recipe.output_dir)
    rank = int(os.environ["RANK"])
    if os.environ.get("FTCLI_LAUNCHED") != "1" and rank == 0:
        # torchrun started by hand: the launcher's checks
        check_run_dir(recipe.name, recipe.output_dir, force=force, resume=resume)
        check_resume(recipe, run_dir, resume, world_size=int(os.environ["WORLD_SIZE"]))
        prepare_run_dir(recipe, force=force, resume=resume)
    stop_flag()  # before the trainer's imports: a SIGTERM / SIGINT from now on stops at a step boundary
    import torch

    from ftcli.model.fallbacks import quiet_library_output

    quiet_library_output(recipe.model.model_type, "cuda" if torch.cuda.is_available() else "cpu",
                         say=(lambda line: print(line, file=sys.stderr, flush=True)) if rank == 0 else None)
    train = TRAINERS[recipe.training.method]
    try:
        train(recipe, run_dir, resume)
    except Stopped as e:
        if rank == 0 and os.environ.get("FTCLI_LAUNCHED") != "1":  # started by hand: no launcher to say it
            print(resume_hint(e.step if e.checkpoint else None, str(run_dir / RECIPE_FILE)), file=sys.stderr)
        raise SystemExit(e.exit_code) from None
    except TrainingStopped:
        if rank != 0:
            raise SystemExit(2) from None  # rank 0 reports it; every rank decided the same
        raise
    except Exception as e:
        if not under_torchrun:
            raise
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        from ftcli.train.failures import PEER_LOST_EXIT, peer_lost

        get_error_handler().record_exception(e)  # torchrun's error file: the launcher tells causes from consequences
        if not peer_lost(e):
            raise  # printed as always: a UserError as one line, anything else with its traceback
        from ftcli.train.distributed import exit_worker

        exit_worker(PEER_LOST_EXIT)  # another rank went away first and printed why: print nothing
    if under_torchrun:
        from ftcli.train.distributed import exit_worker

        exit_worker(0)  # run.json, checkpoints and MLflow are closed: leave without the interpreter's teardown



# ----------------------------------------------------------------------------- one run dir, one writer
@contextlib.contextmanager
def run_dir_lock(recipe, *, resume: str | None, force: bool) -> Iterator[Path]:
    """The launcher holds an exclusive lock on <run>/.ftcli.lock (fcntl.flock) for the whole run, so a
    second `ftcli train` on the same dir fails in one line naming the holder's PID. The kernel drops
    the lock when the launcher dies, however it dies; the workers die with it (`_die_with_launcher`),
    so nothing writes into a dir that is unlocked. Order: a held lock is reported first, then the
    refusal rule (check_run_dir, which writes nothing), and only then are the run dir (and its missing
    parents: a failed start removes what it created) and the lock file created. The lock file is never
    a link and never someone else's file (`ftcli.config.safe_files.open_lock`: O_NOFOLLOW, a regular
    file holding a PID or nothing, or one created here). On a multi-node job only node 0's launcher locks
    (the run dir is shared); a filesystem without flock (some network mounts) gets a warning, not a refusal."""
    import fcntl

    run_dir = run_dir_of(recipe.output_dir)
    path = run_dir / LOCK_FILE
    refuse_unsafe(path)  # a link planted as the lock file: never followed, never truncated
    if path.is_file():
        _refuse_if_locked(path)
    check_run_dir(recipe.name, recipe.output_dir, force=force, resume=resume)
    if os.environ.get("NODE_RANK", "0") != "0":
        yield run_dir
        return
    before = {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else None  # what a failed start keeps
    created = make_dirs(run_dir)  # after the checks; a start that fails removes them again (below)
    try:
        fd, new_lock = open_lock(path)  # O_NOFOLLOW; not inherited by the workers
        if not new_lock and not re.fullmatch(rb"\d*\n?", os.pread(fd, 64, 0)):
            os.close(fd)
            raise UserError(f"{path} is not an ftcli lock file (it holds other text); ftcli does not overwrite it: "
                            "remove it or set output.dir elsewhere")
    except BaseException:
        remove_dirs(created)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        _refuse_if_locked(path)  # lost a race to another launcher: name it
        raise
    except OSError as e:
        print(f"warning: cannot lock {path} ({e.strerror}); make sure no other `ftcli train` writes to {run_dir}",
              file=sys.stderr)
        os.close(fd)
        yield run_dir
        return
    os.ftruncate(fd, 0)  # our own file: created here, or an earlier start's (it held a PID or nothing)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    try:
        yield run_dir
    except BaseException:
        remove_failed_start(run_dir, before)  # failed before step 1: leave nothing of this start
        raise
    finally:
        if created and (not run_dir.is_dir() or [p.name for p in run_dir.iterdir()] == [LOCK_FILE]):
            if path.is_file() and not path.is_symlink():  # a start that failed: leave no dir
                path.unlink()
            remove_dirs(created)
        os.close(fd)


def _refuse_if_locked(path: Path) -> None:
    """UserError naming the PID in the lock file when another process holds the lock; writes nothing."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
        raise UserError(f"{path.parent} is in use by another `ftcli train` (pid {holder}); wait for it to finish "
                        "or stop it, then run again") from None
    except OSError:
        pass  # no flock on this filesystem: run_dir_lock warns
    finally:
        os.close(fd)


def _die_with_launcher() -> None:
    """A worker ends when its parent does, SIGKILL included. torchrun starts workers in their own
    session, so a signal to the launcher's process group does not reach them; a worker outliving its
    launcher would keep writing into a run dir whose lock is gone (a --resume started then would
    interleave with it). The parent is the launcher (`ftcli train`, which runs torchrun's agent in
    its process), or torchrun's agent when torchrun was started by hand (a Databricks workload). On
    Linux the kernel sends SIGKILL on the parent's death (prctl PR_SET_PDEATHSIG); elsewhere a
    watchdog thread polls the parent's PID. A launcher that is already gone ends the worker at once."""
    parent = int(os.environ.get(LAUNCHER_PID) or os.getppid())
    armed = False
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        armed = ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) == 0
    if os.getppid() != parent:
        os._exit(1)
    if not armed:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, name="ftcli-parent-watchdog", daemon=True).start()
