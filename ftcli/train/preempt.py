"""Preemption: SIGTERM and SIGINT stop a training run at the next step boundary, with a checkpoint.

    launcher (ftcli.train.launch)       torchrun's agent forwards the signal it gets (SIGTERM from the platform,
                                  SIGINT from Ctrl-C: the workers are in their own session and see no
                                  terminal) to every worker, then waits up to STOP_GRACE_S for them
    worker (both trainers)        `StopFlag` records the signal and returns (no exception mid-step); at
                                  each step boundary one all-reduce MAX of the flag makes every rank stop
                                  at the same step, even when only one rank was signalled; the trainer
                                  saves a checkpoint of that step and raises `Stopped`
    exit                          the launcher prints one line, `stopped at step N; resume with ...`
                                  (N: the newest committed checkpoint, i.e. where --resume continues),
                                  and exits with EXIT_CODES[signal]: 143 for SIGTERM, 130 for SIGINT

A signal that arrives while the run is already stopping is ignored: the save in progress finishes (a
platform follows SIGTERM with SIGKILL after its grace period; a save killed that way leaves a
`step_*` dir without meta.json, which the next start removes: `ftcli.train.checkpoint.remove_interrupted_saves`).
"""

from __future__ import annotations

import signal
from typing import Callable

EXIT_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}  # 128 + signal number, the shell's convention
STOP_SIGNALS = tuple(EXIT_CODES)
STOP_GRACE_S = 900  # how long the launcher waits for the workers' stop checkpoint before SIGKILL


def exit_code(signum: int) -> int:
    return EXIT_CODES.get(signal.Signals(signum), 128 + int(signum))


class Stopped(Exception):
    """Raised by a trainer on every rank after the stop checkpoint (or when none could be taken)."""

    def __init__(self, step: int, signum: int, checkpoint: str | None):
        self.step, self.signum, self.checkpoint = step, signum, checkpoint
        super().__init__(f"stopped at step {step} by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)


class StopFlag:
    """SIGTERM / SIGINT handlers that only record the first signal (`signum`, 0 while none came).

    `install()` replaces the handlers (main thread only); `restore()` puts the previous ones back."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Callable | int | None] = {}

    def install(self) -> "StopFlag":
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if not self.signum:
            self.signum = int(signum)

    def agreed(self, device="cpu") -> int:
        """Collective when a process group is up: the signal if ANY rank got one (the largest signal
        number when several did), so that every rank stops at the same step; 0 otherwise."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return self.signum
        from ftcli.train.distributed import all_reduce

        (signum,) = all_reduce([self.signum], dist.ReduceOp.MAX, device)
        return int(signum)


def resume_hint(step: int | None, recipe_path: str, *, checkpoints_enabled: bool = True) -> str:
    """The one line a stopped run ends with. `step`: the newest committed checkpoint's (None: none)."""
    if step is None:
        why = "" if checkpoints_enabled else " (training.checkpoint.enabled=false)"
        return f"stopped before any checkpoint{why}; start again with `ftcli train --recipe {recipe_path}`"
    return f"stopped at step {step}; resume with `ftcli train --recipe {recipe_path} --resume`"


_FLAG: StopFlag | None = None


def stop_flag() -> StopFlag:
    """This process's StopFlag, installed on first use (the worker does it first thing; the trainers
    ask for it again). Main thread only."""
    global _FLAG
    if _FLAG is None:
        _FLAG = StopFlag().install()
    return _FLAG
