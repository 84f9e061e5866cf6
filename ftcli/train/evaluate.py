"""Held-out evaluation for both trainers: an exact eval loss, when to run it, the best eval, early stopping,
and the greedy samples generated during training.

The eval loss is held to the training loss's standard: the summed token cross-entropy over EVERY trained
eval token, divided by the global count of those tokens, across all ranks,

    eval_loss = sum_{r, b} S_{r,b} / sum_{r, b} n_{r,b}      S = summed CE of block b on rank r, n = its
                                                             trained tokens (labels[1:] != -100)

so it does not move with the world size, the eval block length or the packing (an average of per-batch
means would: transformers#39241). The eval rows are encoded, masked, packed and cached by the training
data path (`ftcli.data.evalsplit`), one packed set per source, so each source gets its own loss and the
overall one is their token-weighted sum. Eval packs with best-fit decreasing by default: no example is
cut at a block edge, so no token loses its context (a split would make the loss depend on block_len).

A pass runs under `torch.no_grad()`, in `model.eval()` (dropout off; the model's train mode is restored),
inside `torch.random.fork_rng`: the training RNG stream is untouched, so a run with eval trains exactly
like one without. Every rank evaluates its equal share of each source's blocks (`BlockStream`, padded
with all-masked blocks), so FSDP2's collectives line up; one all-reduce adds the sums and counts.

    packed = prepare_eval(data_spec(recipe), recipe.eval, tokenizer)   rank 0 first (the data cache)
    evaluator = Evaluator(packed, rank, world_size, device)
    result = evaluator.run(model, loss_sum, step)                 loss_sum(inputs) -> summed CE (a tensor)
    tracker = EvalTracker(recipe.eval)                            best step, early stopping

Between training steps both trainers call the same functions (train_full's FSDP2 loop, train_lora's callbacks):
`evaluate_now` (the eval through `model.loss_sum`, recorded), `publish_eval` (an eval outside a step line),
`sample_now` (every rank generates, rank 0 writes) and `best_model_location` (where the best model ends up).
A sharded model (FSDP2) gathers its parameters for `model.loss_sum` and `model.generate` because both are
registered as FSDP forward methods (`torch.distributed.fsdp.register_fsdp_forward_method`): every rank takes
part in every forward, so every rank calls these functions.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ftcli.objectives import OBJECTIVES
from ftcli import data
from ftcli.data.evalsplit import eval_problem, eval_specs
from ftcli.config.errors import TrainingStopped, UserError
from ftcli.artifacts.rundir import BEST, FINAL, SAMPLES_FILE
from ftcli.config.safe_files import open_append


def prepare_eval(train: data.DataSpec, ev, tokenizer,
                 first: Callable = lambda f, then=None: f()) -> dict[str, data.PackedDataset]:
    """source label -> the packed eval blocks of that source (empty without eval data), for the training data
    `train` (`ftcli.data.data_spec(recipe)`) and the eval section `ev`. `first` is
    `ftcli.train.distributed.rank0_first` under torchrun (rank 0 fills the cache, the others read it)."""
    out = {}
    for label, r in eval_specs(train, ev).items():
        out[label] = first(lambda r=r: data.prepare_blocks(r, tokenizer), then=lambda r=r: data.open_prepared(r, tokenizer))
    problem = eval_problem(ev, out)  # the launcher refused it before start: a worker started by hand
    if problem:
        raise TrainingStopped(problem)  # every rank
    return out


def eval_summaries(train: data.DataSpec, ev, packed: dict[str, data.PackedDataset]) -> dict[str, data.DataSummary]:
    """The data summary of each source's eval split (pack-preview, the train log), for the training data `train`
    and the eval section `ev`."""
    specs = eval_specs(train, ev)
    return {label: data.data_summary(specs[label], p) for label, p in packed.items()}


def metric_key(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\- ]", "_", label)[-100:]


@dataclass
class EvalResult:
    step: int
    loss: float | None  # None: no trained eval token
    tokens: int
    sources: dict[str, dict[str, float | int | None]] = field(default_factory=dict)  # label -> {loss, tokens}
    unit: str = "tokens"  # what `tokens` counts: the objective's loss count (pairs for preference objectives)
    extra: dict[str, float] = field(default_factory=dict)  # the objective's eval metrics (eval_rewards/accuracies)

    @property
    def ppl(self) -> float | None:
        return math.exp(min(self.loss, 700.0)) if self.loss is not None else None

    def metrics(self) -> dict[str, float]:
        """eval_loss, eval_ppl, eval_tokens, and eval_loss/<source> when there are several sources."""
        out = {"eval_loss": self.loss, "eval_ppl": self.ppl, "eval_tokens": self.tokens}
        if len(self.sources) > 1:
            out.update({f"eval_loss/{metric_key(k)}": v["loss"] for k, v in self.sources.items()})
        out.update(self.extra)
        return {k: v for k, v in out.items() if v is not None}

    def line(self) -> str:
        per = ""
        if len(self.sources) > 1:
            per = " | " + ", ".join(f"{k} {v['loss']:.4f}" for k, v in self.sources.items() if v["loss"] is not None)
        loss = f"{self.loss:.4f} (ppl {self.ppl:.2f})" if self.loss is not None else "n/a"
        extra = "".join(f" | {k} {v:.4f}" for k, v in self.extra.items())
        return f"eval step {self.step} | eval loss {loss} | {self.tokens} {self.unit}{extra}{per}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ppl": self.ppl}


class Evaluator:
    """This rank's share of every source's eval blocks; `run` is collective (every rank calls it)."""

    def __init__(self, packed: dict[str, data.PackedDataset], rank: int, world_size: int, device: torch.device,
                 objective=None):
        self.packed, self.rank, self.world_size, self.device = packed, rank, world_size, device
        # what is evaluated: the objective's summed loss over its count, as in training (ftcli.objectives)
        self.objective = objective if objective is not None else OBJECTIVES["sft"]
        self.cp_rank, self.cp_size, self.cp_group, self.cp_balanced = 0, 1, None, False  # `split_blocks`

    def split_blocks(self, cp_rank: int, cp_size: int, cp_group, balanced: bool = False) -> None:
        """Context parallelism (training.context_parallel): the `cp_size` consecutive ranks of a group evaluate each
        block together, each its slice (as in training: ftcli.model.kernels.cp), the group's first rank counting
        the block. A block that does not split into slices of whole gated-delta chunks (eval.block_len, or
        eval.strategy: none) runs whole on every rank of the group, the first one counting its loss."""
        self.cp_rank, self.cp_size, self.cp_group, self.cp_balanced = cp_rank, cp_size, cp_group, balanced

    def __bool__(self) -> bool:
        return bool(self.packed)

    def blocks(self, label: str):
        """This rank's share of a source's blocks: one stream per data-parallel group (a CP group reads the same)."""
        return data.BlockStream(self.packed[label], self.rank // self.cp_size, self.world_size // self.cp_size,
                                epochs=1.0, shuffle=False)

    def loss_terms(self, block, loss_sum: Callable[[dict], torch.Tensor]) -> tuple[float, int]:
        """This rank's share of a block's (summed loss, count): all of it, or its slice's (context parallelism)."""
        from ftcli.data.collate import FLA_CHUNK
        from ftcli.model.kernels.cp import slice_of_block

        first = self.cp_rank == 0
        if self.cp_size == 1:
            return float(loss_sum(data.block_to_model_inputs(block, self.device)).double()), self.objective.count(block)
        chunks = self.cp_size * (2 if self.cp_balanced else 1)
        if len(block.input_ids) % (chunks * FLA_CHUNK):  # whole on every rank of the group: the first one counts it
            summed = float(loss_sum(data.block_to_model_inputs(block, self.device)).double())
            return (summed, self.objective.count(block)) if first else (0.0, 0)
        inputs = slice_of_block(block, self.cp_rank, self.cp_size, self.cp_group, self.device, self.cp_balanced)
        return float(loss_sum(inputs).double()), self.objective.count(block) if first else 0

    def run(self, model: torch.nn.Module, loss_sum: Callable[[dict], torch.Tensor], step: int) -> EvalResult:
        """The eval loss of `model` (module doc). `loss_sum(inputs)`: the summed token CE of one block's
        model inputs (`model.loss_sum(**inputs)` under FSDP2), over the objective's count (trained tokens, or pairs)."""
        sums, counts = [], []
        devices = [self.device] if self.device.type == "cuda" else []
        was_training = model.training
        model.eval()
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                for label in self.packed:
                    summed, trained = 0.0, 0
                    for block in self.blocks(label):
                        block_sum, block_count = self.loss_terms(block, loss_sum)
                        summed += block_sum
                        trained += block_count
                    sums.append(summed)
                    counts.append(trained)
        finally:
            model.train(was_training)
        if torch.distributed.is_initialized():
            from ftcli.train.distributed import all_reduce

            reduced = all_reduce(sums + counts, device=self.device)
            sums, counts = reduced[:len(sums)], [int(c) for c in reduced[len(sums):]]
        sources = {label: {"loss": s / n if n else None, "tokens": n}
                   for label, s, n in zip(self.packed, sums, counts)}
        total = sum(counts)
        return EvalResult(step=step, loss=sum(sums) / total if total else None, tokens=total, sources=sources)


class EvalTracker:
    """Every eval of the run, the best one, and the early-stopping rule (`eval.early_stop`): stop when
    `patience` evals in a row did not beat the best by more than `min_delta`."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.history: list[dict[str, Any]] = []
        self.best_step: int | None = None
        self.best_loss: float | None = None
        self.bad_evals = 0

    def add(self, result: EvalResult) -> bool:
        """Record an eval; True when it is the new best."""
        self.history.append(result.to_dict())
        if result.loss is None:
            return False
        min_delta = self.cfg.early_stop.min_delta if self.cfg.early_stop else 0.0
        if self.best_loss is None or result.loss < self.best_loss - min_delta:
            self.best_step, self.best_loss, self.bad_evals = result.step, result.loss, 0
            return True
        self.bad_evals += 1
        return False

    def stop_reason(self) -> str | None:
        es = self.cfg.early_stop
        if es is None or self.bad_evals < es.patience:
            return None
        return (f"early stop: the eval loss did not improve on {self.best_loss:.4f} (step {self.best_step}) by more "
                f"than {es.min_delta:g} in {self.bad_evals} evals in a row (eval.early_stop.patience={es.patience})")

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "best_step": self.best_step, "best_loss": self.best_loss,
                "bad_evals": self.bad_evals}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:
            self.history, self.best_step = list(state["history"]), state["best_step"]
            self.best_loss, self.bad_evals = state["best_loss"], state["bad_evals"]


# ------------------------------------------------------------------------------------------ samples
def samples_due(cfg, step: int, evals_done: int, evaluated: bool, last: bool) -> bool:
    """Generate the eval samples now? Every `samples_every` evals, every `samples_every_steps` steps,
    and at the end."""
    if cfg is None or not cfg.samples:
        return False
    if last:
        return True
    by_steps = cfg.samples_every_steps is not None and step % cfg.samples_every_steps == 0
    return by_steps or (evaluated and evals_done % cfg.samples_every == 0)


def generate_samples(model, tokenizer, cfg, *, synced_gpus: bool = False) -> list[str]:
    """Greedy completions of the recipe's eval.samples (`ftcli.inference.sample_greedy`; under FSDP2
    every rank calls it with synced_gpus=True)."""
    from ftcli.inference import sample_greedy

    devices = [next(model.parameters()).device] if next(model.parameters()).is_cuda else []
    with torch.random.fork_rng(devices=devices):  # greedy draws nothing; the training RNG stays untouched anyway
        return sample_greedy(model, tokenizer, cfg.sample_conversations(), cfg.samples_max_new_tokens,
                             synced_gpus=synced_gpus)


def write_samples(run_dir: Path, step: int, cfg, completions: list[str], tracker=None) -> None:
    """Rank 0: one row per prompt in <run>/samples.jsonl, and the same rows as an MLflow table."""
    rows = [{"step": step, "prompt": json.dumps(conv, ensure_ascii=False), "completion": text}
            for conv, text in zip(cfg.sample_conversations(), completions)]
    with open_append(Path(run_dir) / SAMPLES_FILE) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    if tracker is not None:
        tracker.log_table(rows, f"samples/step_{step:08d}.json")


# ------------------------------------------------------------------------------ between training steps
def evaluate_now(evaluator: Evaluator, evals: EvalTracker, model: torch.nn.Module, step: int, *,
                 say: Callable[[str], None] | None = None) -> tuple[EvalResult, bool]:
    """Collective: the eval loss of `model` now, through `model.loss_sum` (`ftcli.train.loss.attach_loss`), recorded
    in `evals` (best step, early stopping: `evals.stop_reason()`). Returns (result, whether it is the new best).
    `say` (rank 0; None on the others) prints the per-source losses of an eval with several sources."""
    sums = getattr(model, "preference_sums", None)  # preference objectives: TRL's metrics over the eval pairs
    pending = sums.take() if sums is not None else None  # a training step's sums not logged yet wait meanwhile
    result = evaluator.run(model, lambda inputs: evaluator.objective.loss_sum(model, inputs), step)
    if sums is not None:
        from ftcli.train.preference import reduced_means

        evaluated = reduced_means(model, evaluator.device, prefix="eval_")
        sums.add(pending)
        result.unit = "pairs"
        result.extra = {k: v for k, v in evaluated.items() if k in ("eval_rewards/accuracies", "eval_rewards/margins")}
    new_best = evals.add(result)
    if say is not None and len(result.sources) > 1:
        say(result.line())
    return result, new_best


def publish_eval(result: EvalResult, *, say: Callable[[str], None], metrics_path: Path | None = None,
                 tracker=None) -> None:
    """Rank 0: an eval outside a step line (step 0, the end's): printed, appended to metrics.jsonl, tracked."""
    say(result.line())
    if metrics_path is not None:
        with open_append(metrics_path) as f:
            f.write(json.dumps({"step": result.step, **result.metrics()}) + "\n")
    if tracker is not None:
        tracker.log_metrics(result.metrics(), step=result.step)


def sample_now(model, tokenizer, cfg, step: int, *, run_dir: Path, is_main: bool, tracker=None) -> None:
    """Collective: the greedy completions of `cfg.samples`, generated by every rank (synced_gpus: under FSDP2
    each decoding step is a sharded forward all ranks take part in); rank 0 writes them (`write_samples`)."""
    completions = generate_samples(model, tokenizer, cfg, synced_gpus=True)
    if is_main:
        write_samples(run_dir, step, cfg, completions, tracker)


def best_model_location(best_step: int, last_step: int, export: str) -> str:
    """Where the best eval's model ends up, relative to the run dir: final/ when it is the last model or
    `eval.export` is "best" (it replaces the last one), else best/ beside the last model in final/."""
    return FINAL if best_step == last_step or export == "best" else BEST
