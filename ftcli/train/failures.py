"""How a failed training job is reported: the first real failure once, then one summary line.

When one rank fails, its peers fail next at their next collective ("Connection closed by peer" from gloo,
an aborted NCCL communicator): those are consequences, and their 50-150 line tracebacks would bury the
cause. So:

    worker (ftcli.train.launch._worker)   an exception that says a peer went away (`peer_lost`) is recorded
                                          in torchrun's error file (torch.distributed.elastic's ErrorHandler,
                                          the file @record writes) and the worker exits PEER_LOST_EXIT
                                          quietly; any other error prints as it always did (a UserError as
                                          one line, a bug as its traceback)
    worker, a TrainingStopped             every rank raised the same one together (a save that could not be
      (launched by ftcli train)           written, a non-finite loss): each records it and exits
                                          DECIDED_STOP_EXIT quietly, and the launcher prints that line alone
                                          (`decided_stop`): no worker races another to print it
    launcher                              `summary` of the exit codes: the rank that failed first for its
                                          own reason, the ranks that stopped with it, or, when every rank
                                          only lost its peers, the first recorded message; a stop signal
                                          (some ranks 143/-15, the others lost their peers) is a stop

Pure code: no torch import (the launcher hands in the failures' exit codes and messages).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

PEER_LOST_EXIT = 3
DECIDED_STOP_EXIT = 4  # every rank stopped on the same TrainingStopped; its line is in the error file
_PEER_LOST_MARKERS = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing",
                      "Broken pipe", "communicator was aborted", "NCCL communicator", "Socket Timeout")


def peer_lost(exc: BaseException) -> bool:
    """Does this exception say another rank went away (the consequence of a failure elsewhere)?"""
    names = {t.__name__ for t in type(exc).__mro__}
    text = str(exc)
    return bool(names & {"DistNetworkError", "DistBackendError"}) or any(m in text for m in _PEER_LOST_MARKERS)


@dataclass
class Failure:
    rank: int
    exitcode: int
    message: str = ""  # the error the worker recorded in torchrun's error file, if it did

    @property
    def lost_peers(self) -> bool:
        return self.exitcode == PEER_LOST_EXIT

    @property
    def own_error(self) -> bool:
        """The worker recorded an error of its own (it may have been killed in its teardown afterwards)."""
        return bool(self.message) and not self.lost_peers


def recorded_message(error_file_data: dict) -> str:
    """The message a worker wrote with ErrorHandler.record_exception ({"message": {"message": ...}}), or ""
    (torchrun fills in a placeholder of its own when there is no error file)."""
    message = error_file_data.get("message") if isinstance(error_file_data, dict) else None
    return str(message.get("message") or "") if isinstance(message, dict) else ""


def decided_stop(failures: list[Failure]) -> str | None:
    """The line of a TrainingStopped the ranks raised together (the first such rank's recorded message, without
    the exception's name that torchrun's error file puts first), or None when the job did not end that way."""
    decided = sorted((f for f in failures if f.exitcode == DECIDED_STOP_EXIT and f.message), key=lambda f: f.rank)
    if not decided or any(f.own_error and f.exitcode != DECIDED_STOP_EXIT for f in failures):
        return None
    name, _, line = decided[0].message.partition(": ")
    return line if name.isidentifier() and line else decided[0].message


def _killed_by(code: int) -> str | None:
    try:
        return signal.Signals(-code).name if code < 0 else None
    except ValueError:
        return f"signal {-code}"


def stop_signal(failures: list[Failure], stop_codes: dict[int, int]) -> int | None:
    """The stop signal when the job ended because of one (every rank stopped by it, or lost its peers after
    one was stopped), else None. `stop_codes`: exit code -> signal number."""
    if any(f.own_error for f in failures):
        return None
    signals = {stop_codes[f.exitcode] for f in failures if f.exitcode in stop_codes}
    rest = [f for f in failures if f.exitcode not in stop_codes]
    if len(signals) == 1 and all(f.lost_peers for f in rest):
        return signals.pop()
    return None


def summary(failures: list[Failure], stop_codes: dict[int, int], hint: str = "") -> str:
    """The one line a failed job ends with (after the first failing rank's own error, which it printed)."""
    failures = sorted(failures, key=lambda f: (not f.own_error, f.rank))
    own = [f for f in failures if f.own_error or (not f.lost_peers and f.exitcode not in stop_codes)]
    first = own[0] if own else None
    if first is None:
        recorded = next((f for f in failures if f.message), None)
        why = f": {recorded.message.strip().splitlines()[0][:300]}" if recorded is not None else ""
        ranks = ", ".join(str(f.rank) for f in sorted(failures, key=lambda f: f.rank))
        return f"training stopped: rank(s) {ranks} lost the connection to the other ranks{why}{hint}"
    killed = None if first.own_error else _killed_by(first.exitcode)
    what = (f"rank {first.rank} was killed by {killed} (it printed nothing: out of memory, or killed from outside?)"
            if killed else f"rank {first.rank} failed (its error is printed above)")
    others = sorted(f.rank for f in failures if f is not first)
    with_it = f"; rank(s) {', '.join(map(str, others))} stopped with it" if others else ""
    return f"training stopped: {what}{with_it}{hint}"
