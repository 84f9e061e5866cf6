"""What a training step reports: the step metrics (`StepMetrics`: window, tokens/s, MFU, memory), the
formatted step line, and where it goes (`log_step`). Shared by both trainers (ftcli.train.full,
ftcli.train.lora.trainer)."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ftcli import hardware

def peak_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of `device`'s card, for MFU (ftcli.hardware.CARDS); None off CUDA or unknown."""
    if device.type != "cuda":
        return None
    card = hardware.card_of(torch.cuda.get_device_name(device))
    return card.bf16_flops if card is not None else None


def peak_memory_gib(device: torch.device) -> tuple[float, float | None, str]:
    """(peak allocated, peak reserved by the caching allocator, unit); on CPU the process's max RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30, "GiB"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, None, "GiB rss"


def format_step(m: dict[str, Any], total_steps: int) -> str:
    mfu = f"{100 * m['mfu']:.1f}%" if m.get("mfu") is not None else "n/a"
    reserved = f" (reserved {m['peak_mem_reserved']:.2f})" if m.get("peak_mem_reserved") is not None else ""
    evaluated = f" | eval {m['eval_loss']:.4f} (ppl {m['eval_ppl']:.2f})" if m.get("eval_loss") is not None else ""
    if m.get("rewards/accuracies") is not None:  # preference objectives (TRL's names; all of them in metrics.jsonl)
        evaluated = (f" | acc {m['rewards/accuracies']:.2f} margin {m['rewards/margins']:.3f}"
                     + (f" | eval {m['eval_loss']:.4f} acc {m['eval_rewards/accuracies']:.2f}"
                        if m.get("eval_loss") is not None else ""))
    return (
        f"step {m['step']}/{total_steps} | loss {m['loss']:.4f} | gnorm {m['grad_norm']:.3f} | lr {m['lr']:.2e} | "
        f"{m['tokens_per_s']:,.0f} tok/s ({m['tokens_per_s_per_device']:,.0f}/dev) | MFU {mfu} | "
        f"mem {m['peak_mem']:.2f}{reserved} {m['mem_unit']} | {m['s_per_step']:.3f} s/step{evaluated}"
    )


class StepMetrics:
    """The step line's numbers, for both trainers: a window of steps (since the last step line) and the
    run's timed totals (for run.json's throughput).

        meter = StepMetrics(flops_per_token, device, world_size)
        every step:      meter.step_done(global_seen_tokens, step_seconds)
        every log step:  m = meter.line(step=..., loss=..., grad_norm=..., lr=..., tokens_trained=..., tokens_seen=...)
                         log_step(m, total_steps, say=..., metrics_path=..., tracker=...)
        at the end:      meter.throughput()  -> {"tokens_per_s", "s_per_step"}

    Tokens are summed over ranks (tokens_per_s is the job's, tokens_per_s_per_device divides by the world
    size). MFU = flops_per_token x tokens/s per device / the device's peak (None where the peak is
    unknown, e.g. on CPU). A window's time is wall-clock from its start to `line()`, so time a step spends
    outside `step_done` (skipped steps, checkpoints) counts too. The first `untimed_steps` steps of a
    process pay for warm-up (compilation, allocator) and are left out of `throughput()`.
    """

    def __init__(self, flops_per_token: float, device: torch.device, world_size: int, *, untimed_steps: int = 1,
                 clock: Callable[[], float] = time.perf_counter):
        self.flops_per_token = flops_per_token
        self.clock = clock
        self.peak = peak_flops(device)
        self.device = device
        self.world_size = world_size
        self.untimed_steps = untimed_steps
        self.steps_done = 0
        self.timed_tokens, self.timed_seconds, self.timed_steps = 0.0, 0.0, 0
        self.start_window()

    def start_window(self) -> None:
        self.window_tokens, self.window_steps, self.window_start = 0.0, 0, self.clock()

    def step_done(self, tokens_seen: float, seconds: float) -> None:
        """One step: `tokens_seen` fed to the model by all ranks together, in `seconds`."""
        self.steps_done += 1
        self.window_tokens += tokens_seen
        self.window_steps += 1
        if self.steps_done > self.untimed_steps:
            self.timed_tokens += tokens_seen
            self.timed_seconds += seconds
            self.timed_steps += 1

    def line(self, *, step: int, loss: float, grad_norm: float, lr: float, tokens_trained: int,
             tokens_seen: int) -> dict[str, Any]:
        """The metrics dict of the window that ends now (what `format_step` prints and metrics.jsonl holds);
        starts the next window."""
        seconds = self.clock() - self.window_start
        tokens_per_s = self.window_tokens / seconds
        per_device = tokens_per_s / self.world_size
        mem, reserved, unit = peak_memory_gib(self.device)
        m = {
            "step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
            "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": per_device,
            "mfu": self.flops_per_token * per_device / self.peak if self.peak else None,
            "peak_mem": mem, "peak_mem_reserved": reserved, "mem_unit": unit,
            "s_per_step": seconds / max(self.window_steps, 1),
            "tokens_trained": tokens_trained, "tokens_seen": tokens_seen,
        }
        self.start_window()
        return m

    def throughput(self) -> dict[str, float | None]:
        """Of the timed steps of this process: run.json's `throughput` (rundir.Throughput)."""
        return {
            "tokens_per_s": self.timed_tokens / self.timed_seconds if self.timed_seconds else None,
            "s_per_step": self.timed_seconds / self.timed_steps if self.timed_steps else None,
        }


def numeric_metrics(m: dict[str, Any]) -> dict[str, float]:
    """What goes to the tracker: the numbers of a step line, without the step itself."""
    return {k: v for k, v in m.items() if isinstance(v, (int, float)) and k != "step"}


def log_step(m: dict[str, Any], total_steps: int, *, say=print, metrics_path: Path | None = None, tracker=None) -> None:
    """Publish one step line (rank 0): printed through `say`, appended to <run>/metrics.jsonl, logged to
    the tracker at `m["step"]`."""
    say(format_step(m, total_steps))
    if metrics_path is not None:
        from ftcli.config.safe_files import open_append

        with open_append(metrics_path) as f:
            f.write(json.dumps(m) + "\n")
    if tracker is not None:
        tracker.log_metrics(numeric_metrics(m), step=m["step"])


def truncate_metrics(path: Path, step: int) -> int:
    """Resuming at checkpoint `step`: drop the lines of <run>/metrics.jsonl after it (those steps are
    trained again and logged again), and a last line a kill cut short. Rank 0, before the first step.
    Returns the number of lines dropped; the file is replaced atomically."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            logged = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            dropped += 1
            continue
        if logged <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        from ftcli.config.safe_files import write_atomic

        write_atomic(path, "".join(f"{line}\n" for line in kept))
    return dropped


def step_progress(total_steps: int, completed: int = 0):
    """The training progress bar (rank 0), and its task: steps done of the total, elapsed, eta. Lines printed
    through `progress.console` go above it; without a terminal (a log) it draws nothing until it stops."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("eta"), TimeRemainingColumn(), console=Console(highlight=False, soft_wrap=True))
    return progress, progress.add_task("train", total=total_steps, completed=completed)
