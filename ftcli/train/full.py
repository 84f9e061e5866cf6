"""Full-parameter fine-tuning with FSDP2: one loop, read top to bottom.

`train(recipe, run_dir, resume)` runs in every torchrun worker (ftcli.train.launch starts them):

    1. distributed   one process per GPU (NCCL), or recipe.training.cpu_processes on CPU (gloo)
    2. data          rank 0 tokenizes and packs (cached on disk), then every rank streams its blocks
    3. model         built on the meta device, `fully_shard` per decoder layer then the root, then
                     only this rank's shard is materialized: random init or pretrained weights
                     (ftcli.model.parallelize)
    4. optimizer     AdamW over the sharded fp32 master weights; warmup + schedule
    5. resume        model, optimizer, scheduler, data position and RNG from a DCP checkpoint
    6. loop          count trained tokens -> all-reduce -> forward/backward every micro-batch with
                     the loss divided by the GLOBAL count -> grad norm, clip -> step (or skip) -> log
                     -> checkpoint
    7. finish        last checkpoint, Hugging Face export to <run>/final (the last or the best model), run.json

Eval (`recipe.eval`, ftcli.train.evaluate): the held-out loss every eval.every_steps / every_minutes, at step 0
if asked and at the last step, in the step line; the best eval's checkpoint kept (keep_best), early
stopping, and greedy samples (every rank generates: each decoding step is a sharded forward).

Precision: the sharded parameters are the master weights, in `precision.master_dtype` (float32 by
default). FSDP2's MixedPrecisionPolicy all-gathers them in `param_dtype` (bf16) for compute and
reduce-scatters gradients in `reduce_dtype` (fp32); AdamW then updates the fp32 shards, so an update
of 1e-5 on a weight of 0.02 is kept. `master_dtype: bfloat16` is the published qwen-b300 example's setup (weights loaded
in bf16): an update smaller than half a bf16 ulp of its weight rounds away (see
tests/e2e/test_train_full.py::test_bf16_master_loses_small_updates for the measured fraction).

Model construction (meta build, the training features, activation checkpointing, compile, `fully_shard`,
random init or pretrained weights) is ftcli.model.parallelize; the loss never materializes full-vocabulary
fp32 logits unless `loss.impl: full` asks for the published examples' behaviour (`ftcli.train.loss.token_loss_sum`).
"""

from __future__ import annotations

import gc
import math
import time
import traceback
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch import nn

from ftcli import data

from ftcli.model import kernels
from ftcli.model.kernels.cp import slice_of_block
from ftcli.train.checkpoint import (CheckpointSchedule, best_checkpoint, load_checkpoint,
                              remove_interrupted_saves, resolve_resume, rng_state, save_checkpoint,
                              save_hf_checkpoint, set_rng_state, step_dir_name)
from ftcli.train.distributed import World, all_reduce, init_distributed, reshard_all
from ftcli.train.export import best_from_checkpoint
from ftcli.config.errors import TrainingStopped, UserError
from ftcli.train.evaluate import EvalResult, EvalTracker, evaluate_now, publish_eval, sample_now, samples_due
from ftcli import features
from ftcli.objectives import OBJECTIVES, objective_of
from ftcli.train.loss import IGNORE_INDEX, attach_loss, count_trained_tokens, token_loss_sum
from ftcli.train.preference import attach_preference_loss, preference_config, reduced_means
from ftcli.train.reference import frozen_copy_training, use_stored_reference
from ftcli.train.metrics import StepMetrics, log_step, truncate_metrics
from ftcli.model.build import DTYPES, build_empty_model, count_text_params
from ftcli.model.parallelize import build_model
from ftcli.train.schedule import lr_factor
from ftcli.artifacts.rundir import CHECKPOINTS, FINAL, METRICS_FILE
from ftcli.train.session import RunSession

# ================================================================================ loss algebra
# One optimizer step covers W ranks x M micro-batches (blocks). The objective is the mean token loss
# over every trained token of the step, wherever it sits:
#
#     L = (1 / N) * sum_{r, m} S_{r,m}          S_{r,m} = summed token CE of block m on rank r
#                                               N = global_valid_tokens = sum_{r,m} n_{r,m}
#
# N is known before any backward: every rank counts its trained tokens n_{r,m} from the labels and
# one all_reduce(SUM) adds them up. Each rank then backpropagates, per micro-batch,
#
#     l_{r,m} = S_{r,m} * W / N
#
# Gradients of the micro-batches add up in the sharded .grad (FSDP2 reduce-scatters after every
# backward and accumulates), and the reduce-scatter AVERAGES over the W ranks, i.e. divides by W:
#
#     grad = (1/W) * sum_r sum_m grad(S_{r,m}) * W / N = grad(L)
#
# so 1 rank x 4 micro-batches, 2 ranks x 2 and one 4-block batch give the same gradient, however
# unevenly the trained tokens are spread. Averaging per-block means instead would weight a block
# with 3 trained tokens like one with 3,000, and an all-masked block would give 0/0 = NaN. A step
# with N = 0 (every block masked: padding at the end of the data) is skipped on every rank. The preference
# objectives are the same algebra with pairs for tokens: N = the step's pairs, S = summed pair losses
# (ftcli.objectives.preference, ftcli.train.preference).
#
# Context parallelism (training.context_parallel = C) changes only what a "block of rank r" is: the C ranks
# of a CP group hold C disjoint slices of the same block, so S_{r,m} is a slice's summed CE (a slice's last
# position predicts the next slice's first token) and the slices' S add up to the block's; the block's n is
# counted once, by the group's first rank, so the same sums over all W ranks give the same N and grad(L). A
# preference block's pair losses need whole sequences: every rank of the group sums its part of each segment's
# log-probs, the group adds them up (differentiably), and each rank returns S / C (ftcli.train.preference).
# W stays the number of ranks FSDP averages over (all of them); the data-parallel groups (W / C) read different
# blocks.
def forward_backward(model: nn.Module, micro_batches: list[dict], global_valid_tokens: int, world_size: int,
                     loss_sum_of: Callable = OBJECTIVES["sft"].loss_sum):
    """Backward of every micro-batch with the loss scaled as above; returns this rank's summed loss. `loss_sum_of`:
    the objective's summed loss of one micro-batch (ftcli.objectives; S above), its count being N's terms."""
    summed_loss = torch.zeros((), dtype=torch.float64)
    for inputs in micro_batches:
        loss_sum = loss_sum_of(model, inputs)
        (loss_sum * (world_size / global_valid_tokens)).backward()
        summed_loss += loss_sum.detach().double().cpu()
    return float(summed_loss)


# ====================================================================================== optimizer
def build_optimizer(model: nn.Module, recipe, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on norms, biases, or 1-D gates like A_log)."""
    ocfg = recipe.training.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": ocfg.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=ocfg.lr, betas=tuple(ocfg.betas), eps=ocfg.eps,
        fused=True if ocfg.fused and device.type == "cuda" else None,
    )


def grad_norm_and_clip(model: nn.Module, max_norm: float | None) -> float:
    """Global L2 norm of the sharded gradients (same value on every rank); clips when max_norm is set
    and the norm is finite."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    norm = float(total)
    if max_norm is not None and math.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_([p for p in model.parameters() if p.grad is not None], max_norm, total)
    return norm


# ================================================================================== micro-batches
def _padding_inputs(like: dict | None, device: torch.device) -> dict:
    """A micro-batch with no trained token: lets a rank that ran out of blocks still join the FSDP
    collectives of a step. It contributes 0 to the summed loss and 0 to the token count."""
    if like is not None:
        out = dict(like)
        out["labels"] = torch.full_like(like["labels"], IGNORE_INDEX)
        if "pairs" in out:  # a preference block: no pair either
            out["pairs"] = like["pairs"][:0]
        return out
    n = 8
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    return {
        "input_ids": torch.zeros(1, n, dtype=torch.long, device=device),
        "labels": torch.full((1, n), IGNORE_INDEX, dtype=torch.long, device=device),
        "position_ids": torch.arange(n, device=device).unsqueeze(0),
        "seq_idx": torch.zeros(1, n, dtype=torch.int32, device=device),
        "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": n, "max_length_k": n,
    }


# ======================================================================================== exports
def export_hf(model: nn.Module, model_cfg, tokenizer) -> Callable[[Path], None]:
    """Collective: `export(out_dir)` writes `model` as it is now, a Hugging Face dir in recipe.model's dtype
    (ftcli.train.checkpoint.save_hf_checkpoint: in place, its record last). `model_cfg`: recipe.model."""
    dtype = DTYPES[model_cfg.dtype]

    def export(out_dir: Path) -> None:
        save_hf_checkpoint(model, lambda: build_empty_model(model_cfg, dtype), tokenizer, out_dir, dtype)

    return export


@dataclass
class TrainResult:
    steps: int = 0  # data steps (windows of grad_accum blocks per rank), skipped ones included
    optimizer_steps: int = 0
    skipped_empty: int = 0
    skipped_nonfinite: int = 0
    tokens_trained: int = 0
    tokens_seen: int = 0
    final_loss: float | None = None
    losses: list[tuple[int, float]] = field(default_factory=list)
    checkpoint: str | None = None


# ========================================================================================= train
def train(recipe, run_dir: Path, resume: str | None, *, loss_fn: Callable = token_loss_sum,
          blocks: Callable[[data.BlockStream], Iterable[data.Block]] | None = None) -> TrainResult:
    """The entry point in every torchrun worker: set up torch.distributed, train, always tear it down.

    The seams tests inject faults through: `loss_fn` replaces `token_loss_sum` (same signature), and
    `blocks(stream)` turns this rank's BlockStream into the blocks the loop reads (default: the stream)."""
    world = init_distributed(getattr(recipe.training, "context_parallel", 1))
    try:
        run = FullRun(recipe, Path(run_dir), resume, world, loss_fn=loss_fn)
        return run.train(blocks(run.stream) if blocks is not None else None)
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)  # let the model go (below) while the exception propagates
        raise
    finally:
        # FSDP state holds collective work objects in reference cycles; free them while the process group
        # and the interpreter are alive (freed at exit instead, gloo can abort the process).
        gc.collect()
        dist.destroy_process_group()


class FullRun:
    """One run on this rank, in the order it happens (the numbers of the module docstring):

        run = FullRun(recipe, run_dir, resume, world)    1-5  tracking, data, model, optimizer, resume
        run.train()                                      6    for each step's blocks:
            run.step(blocks, num_micro_batches)                 count -> all-reduce -> forward/backward
                                                                -> clip -> step or skip -> log
            run.maybe_checkpoint(save_by_time)
        run.finish()                                     7    last checkpoint, HF export, run.json

    The run session (ftcli.train.session) owns what every trainer's run has: tracking, data, eval data, a stop at a
    step boundary after SIGTERM / SIGINT (with `stop_checkpoint`), which model final/ and best/ get (with
    `export_hf`), run.json.

    The attributes are the run's state; `result` is what `train` returns (and what a checkpoint keeps)."""

    def __init__(self, recipe, run_dir: Path, resume: str | None, world: World, *,
                 loss_fn: Callable = token_loss_sum):
        self.recipe, self.run_dir, self.world = recipe, run_dir, world
        tcfg = self.tcfg = recipe.training
        self.objective = objective_of(tcfg)  # what the steps minimize: its count and summed loss (ftcli.objectives)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.console = Console(highlight=False, soft_wrap=True)

        # ---- 1. setup ----------------------------------------------------------------------------
        say = self.say = self.console.print if world.is_main else (lambda *a, **k: None)
        torch.manual_seed(tcfg.seed)
        if tcfg.per_device_batch != 1:
            say(f"warning: training.per_device_batch={tcfg.per_device_batch} has no effect here (one packed "
                "block per micro-batch); use training.grad_accum")
        # tracking, tokenizer, data, eval data and run.json: the run session every trainer shares
        self.session = RunSession.start(recipe, run_dir, rank=world.rank, world_size=world.world_size,
                                        device=world.device, resume=resume is not None, say=say)
        self.tracker = self.session.tracker

        # every error from here on (no packed block, a model that does not build, a checkpoint that does not load)
        # ends the tracked run FAILED, as one in the steps does
        with self.session.running():
            self.prepare(resume, loss_fn)

    def prepare(self, resume: str | None, loss_fn: Callable) -> None:
        """Steps 2-5: data, model, optimizer and schedule, resume; the run's first line."""
        recipe, run_dir, world, tcfg, say = self.recipe, self.run_dir, self.world, self.tcfg, self.say
        # ---- 2. data: rank 0 tokenizes + packs into the on-disk cache first, then every rank reads it
        self.prepare_data()
        # ---- 3. model: meta -> shard -> materialize this rank's shard
        trainable, non_embedding = self.prepare_model(loss_fn)

        # ---- 4. optimizer + schedule -------------------------------------------------------------
        self.optimizer = build_optimizer(self.model, recipe, world.device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, self.total_steps, tcfg.schedule))

        # ---- 5. resume ---------------------------------------------------------------------------
        self.result = TrainResult()
        if world.is_main:
            remove_interrupted_saves(run_dir / CHECKPOINTS)
        start = resolve_resume(run_dir, resume, kind="dcp")
        if start is not None:
            self.restore(start)
            say(f"resumed from {start} at step {self.result.steps}")
        self.save_schedule = CheckpointSchedule.from_config(tcfg.checkpoint)
        self.last_save_step = self.result.steps
        self.bad_in_a_row = 0  # consecutive steps with a non-finite loss or grad norm
        self.last_inputs: dict | None = None  # this rank's last micro-batch (the shape of its padding)

        say(f"{recipe.name}: {trainable / 1e6:,.1f}M trainable params ({non_embedding / 1e6:,.1f}M non-embedding), "
            f"{world.world_size} x {world.device.type}, {self.total_steps} steps of {tcfg.grad_accum} "
            f"block{'s' if tcfg.grad_accum != 1 else ''} per "
            f"{'rank' if world.cp_size == 1 else f'group of {world.cp_size} context-parallel ranks'}, "
            f"run dir {run_dir}")
        self.metrics_path = run_dir / METRICS_FILE if world.is_main else None
        self.progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("eta"), TimeRemainingColumn(), console=self.console,
                                 disable=not world.is_main)
        self.task = self.progress.add_task("train", total=self.total_steps, completed=self.result.steps)

    def prepare_data(self) -> None:
        """Tokenizer, packed blocks (rank 0 builds the cache, then every rank opens it), this rank's stream,
        the data summary, the eval data and schedule, and the number of optimizer steps."""
        recipe, world, tcfg = self.recipe, self.world, self.tcfg
        self.session.open_data()  # tokenizer, the objective's units, summary, eval data; announced
        self.tokenizer, self.data_summary, self.evaluator = self.session.tokenizer, self.session.summary, \
            self.session.evaluator
        if world.cp_size > 1:  # eval blocks in slices too: the memory of a training block is the memory of eval's
            self.evaluator.split_blocks(world.cp_rank, world.cp_size, world.cp_group, tcfg.context_parallel_balance)
        # one stream per data-parallel group: the ranks of a CP group read the same blocks, each its slice
        self.stream = data.BlockStream(self.session.units, world.dp_rank, world.dp_size, epochs=tcfg.epochs,
                                       seed=tcfg.seed)
        self.eval_cfg = recipe.eval
        self.evals = EvalTracker(recipe.eval) if recipe.eval is not None else None
        self.eval_schedule = CheckpointSchedule(bool(self.evaluator), recipe.eval.every_steps, recipe.eval.every_minutes) \
            if recipe.eval is not None else CheckpointSchedule(False, None, None)
        self.stop_reason: str | None = None  # set by early stopping
        self.new_best = False  # the last eval was the best so far (keep_best saves a checkpoint)
        self.last_sample_step: int | None = None
        windows = math.ceil(len(self.stream) / tcfg.grad_accum)
        self.total_steps = min(windows, tcfg.max_steps) if tcfg.max_steps else windows
        if self.total_steps == 0:
            raise TrainingStopped("the data gave no packed block; check data.path / data.max_examples")

    def prepare_model(self, loss_fn: Callable) -> tuple[int, int]:
        """The packed kernels, the sharded model with its loss, the features' lines and the step meter; returns the
        trainable and non-embedding parameter counts."""
        recipe, world, tcfg, say = self.recipe, self.world, self.tcfg, self.say
        attn = None
        if recipe.model.attn_implementation == "auto":
            attn, backends = kernels.enable_packed_kernels(recipe.model.model_type, world.device,
                                                           context_parallel=world.cp_size > 1)
            say("packed kernels: " + "; ".join(f"{b.op}={b.name}" for b in backends))
        self.model = build_model(recipe.model, recipe.training, world, attn)
        if tcfg.preference is not None:  # preference pairs: the pair loss (and its reference) instead of token CE
            reference, stored = None, self.objective.reference_model and tcfg.preference.reference == "precomputed"
            if self.objective.reference_model and not stored:  # the starting model again, sharded alike, frozen
                held = frozen_copy_training(recipe.model, recipe.training)
                reference = build_model(recipe.model, held, world, attn).requires_grad_(False).eval()
                say(f"{self.objective.label} reference: a frozen copy of the starting model, sharded like the policy, "
                    f"in {held.precision.master_dtype}")
            attach_preference_loss(self.model, preference_config(tcfg), tcfg.loss.chunk_tokens, reference)
            if stored:  # the policy is still the starting model (a resume restores it later): it is the reference
                self.read_stored_reference()
            elif tcfg.preference.reference == "precomputed":
                say(f"warning: training.preference.reference=precomputed has no effect: {self.objective.label} has "
                    "no reference model")
        else:
            attach_loss(self.model, tcfg.loss.impl, tcfg.loss.chunk_tokens, loss_fn=loss_fn)
        for line in features.describe(self.model, recipe.training):  # what each training feature did, one line each
            say(line)
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        non_embedding = count_text_params(self.model)
        # MFU convention: 6 x non-embedding params per token processed (attention scores and recomputation
        # are not counted: model FLOPs, not hardware FLOPs)
        self.meter = StepMetrics(6 * non_embedding, world.device, world.world_size)
        return trainable, non_embedding

    def read_stored_reference(self) -> None:
        """training.preference.reference=precomputed: the training and eval blocks with the reference's log-probs
        (ftcli.train.reference: read from their stores, or computed now by the model, still the starting one)."""
        world, tcfg = self.world, self.tcfg
        if world.cp_size > 1:
            raise UserError("training.preference.reference=precomputed runs each block whole on one rank: with "
                            f"training.context_parallel={world.cp_size} set training.preference.reference=model")

        def logps(inputs: dict) -> torch.Tensor:
            return self.model.sequence_logps(**inputs)[0]

        self.model.eval()
        use_stored_reference(self.session, self.recipe.model, tcfg, logps, world.device)
        self.model.train()
        # every FSDP unit sharded again before the optimizer is built from model.parameters(): a unit left gathered
        # (the root, after this eval-mode pass) has its unsharded tensors set as the module's parameters (FSDP2's
        # to_unsharded), and a 2-rank run's step 2 then differed from the live reference's (tests/e2e)
        reshard_all(self.model)
        self.stream = data.BlockStream(self.session.units, world.dp_rank, world.dp_size, epochs=tcfg.epochs,
                                       seed=tcfg.seed)
        self.say(f"{self.objective.label} reference: the starting model's log-probs, precomputed (no second model)")

    # ---- 6. the loop -------------------------------------------------------------------------------
    def train(self, batches: Iterable[data.Block] | None = None) -> TrainResult:
        """Steps until the schedule or the data ends, then `finish`. `batches`: the blocks this rank reads
        (default: its BlockStream)."""
        batches = iter(self.stream if batches is None else batches)
        self.meter.start_window()  # the first step line's window starts here, not at the model build
        self.save_schedule.mark_saved()  # so do the clocks of time-based saves and evals
        self.eval_schedule.mark_saved()
        with self.session.running(cleanup=self.progress.stop):  # an error or a stop: the run ends KILLED / FAILED
            self.progress.start()
            if self.evaluator and self.eval_cfg.at_start and self.result.steps == 0:
                self.log_eval(self.evaluate())
                self.new_best = False  # nothing to keep: the weights of step 0 are the init
            while self.result.steps < self.total_steps:
                if signum := self.session.stop_signal():  # SIGTERM / SIGINT on any rank: checkpoint, `Stopped`
                    self.session.stop(self.result.steps, signum, self.stop_checkpoint)
                step_start = time.perf_counter()
                # 6a. this rank's blocks for the step; all ranks agree on the number of micro-batches
                blocks = list(islice(batches, self.tcfg.grad_accum))
                time_due = int(self.world.is_main and self.save_schedule.time_due())  # rank 0's clock decides
                eval_time_due = int(self.world.is_main and self.eval_schedule.time_due())
                num_micro_batches, save_by_time, eval_by_time = all_reduce(
                    [len(blocks), time_due, eval_time_due], dist.ReduceOp.MAX, self.world.device)
                if num_micro_batches == 0:
                    break  # every rank is out of data
                if self.step(blocks, int(num_micro_batches), started=step_start, eval_by_time=bool(eval_by_time)):
                    self.maybe_checkpoint(bool(save_by_time))
                if self.stop_reason:
                    self.say(f"[yellow]{self.stop_reason}[/]")
                    break
            return self.finish()

    def step(self, blocks: list[data.Block], num_micro_batches: int, *, started: float | None = None,
             eval_by_time: bool = False) -> bool:
        """One step over this rank's `blocks`, padded to `num_micro_batches` (the most any rank has).
        True when the optimizer stepped; False when the step was skipped (no trained token on any rank,
        or a non-finite loss or grad norm). Raises TrainingStopped after max_bad_steps bad steps in a row."""
        started = time.perf_counter() if started is None else started
        world, tcfg, result, say = self.world, self.tcfg, self.result, self.say
        micro_batches = [self.model_inputs(b) for b in blocks]
        if micro_batches:
            self.last_inputs = micro_batches[-1]
        while len(micro_batches) < num_micro_batches:  # this rank ran out first
            micro_batches.append(_padding_inputs(self.last_inputs, world.device))

        # 6b. count the objective's units (N of the loss algebra: SFT's trained tokens, or pairs) and the trained
        # tokens, all ranks together, before any backward (the loss algebra above)
        counted = blocks if world.cp_rank == 0 else []  # the ranks of a CP group share each block: the first counts it
        num_valid_tokens = sum(count_trained_tokens(b) for b in counted)
        num_units = sum(self.objective.count(b) for b in counted)
        num_seen_tokens = sum(int(np.asarray(b.input_ids).size) for b in counted)
        global_valid_tokens, global_units, global_seen_tokens = map(
            int, all_reduce([num_valid_tokens, num_units, num_seen_tokens], dist.ReduceOp.SUM, world.device))
        result.steps += 1
        result.tokens_seen += global_seen_tokens
        if global_units == 0:
            result.skipped_empty += 1
            say(f"step {result.steps}: no trained token on any rank; skipped")
            self.progress.advance(self.task)
            return False

        # 6c. forward + backward, grad norm, then step or skip
        lr = self.scheduler.get_last_lr()[0]
        summed_loss = forward_backward(self.model, micro_batches, global_units, world.world_size,
                                       self.objective.loss_sum)
        (global_loss_sum,) = all_reduce([summed_loss], dist.ReduceOp.SUM, world.device)
        loss = global_loss_sum / global_units
        objective_metrics = self.objective_metrics()
        grad_norm = grad_norm_and_clip(self.model, tcfg.grad_clip)
        loss_is_finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if loss_is_finite:
            self.optimizer.step()
            self.scheduler.step()
            self.bad_in_a_row = 0
            result.optimizer_steps += 1
            result.tokens_trained += global_valid_tokens
            result.final_loss = loss
            result.losses.append((result.steps, loss))
        else:
            self.bad_in_a_row += 1
            result.skipped_nonfinite += 1
            say(f"[yellow]step {result.steps}: non-finite loss ({loss}) or grad norm ({grad_norm}); skipped, "
                f"no optimizer step ({self.bad_in_a_row}/{tcfg.max_bad_steps} in a row)[/]")
            self.tracker.log_metrics({"skipped_nonfinite": result.skipped_nonfinite}, step=result.steps)
        self.optimizer.zero_grad(set_to_none=True)
        if self.bad_in_a_row >= tcfg.max_bad_steps:
            latest = result.checkpoint or "none was saved"
            raise TrainingStopped(
                f"stopped at step {result.steps}: {self.bad_in_a_row} consecutive steps had a non-finite loss or "
                f"gradient norm (training.max_bad_steps={tcfg.max_bad_steps}); no update was applied from them. "
                f"Last good checkpoint: {latest}"
            )

        # 6d. eval (when due), then log
        self.meter.step_done(global_seen_tokens, time.perf_counter() - started)
        self.progress.advance(self.task)
        last = result.steps == self.total_steps
        evaluated = None
        if loss_is_finite and self.eval_schedule.due(result.steps, eval_by_time) or (self.evaluator and last):
            evaluated = self.evaluate()
        if loss_is_finite and (result.steps % tcfg.log_every == 0 or last or evaluated):
            m = self.meter.line(step=result.steps, loss=loss, grad_norm=grad_norm, lr=lr,
                                tokens_trained=result.tokens_trained, tokens_seen=result.tokens_seen)
            m.update(objective_metrics)
            if evaluated is not None:
                m.update(evaluated.metrics())
            if world.is_main:
                log_step(m, self.total_steps, say=say, metrics_path=self.metrics_path, tracker=self.tracker)
        if samples_due(self.eval_cfg, result.steps, len(self.evals.history) if self.evals else 0,
                       evaluated is not None, last):
            self.sample()
        return loss_is_finite

    def model_inputs(self, block: data.Block) -> dict:
        """The model call's kwargs for `block`: whole, or this rank's slice of it with the slice's place in the
        block (`kernels.cp.CPSlice`) for the ops that look across the slice boundaries."""
        world = self.world
        if world.cp_size == 1:
            return data.block_to_model_inputs(block, world.device)
        return slice_of_block(block, world.cp_rank, world.cp_size, world.cp_group, world.device,
                              balanced=self.tcfg.context_parallel_balance)

    def objective_metrics(self) -> dict[str, float]:
        """Collective: the step's objective metrics over every rank (preference: TRL's rewards/* and logps/*, means
        over the step's pairs); {} for SFT."""
        return reduced_means(self.model, self.world.device)

    # ---- eval -------------------------------------------------------------------------------------
    def evaluate(self) -> EvalResult:
        """Collective: the held-out loss now (ftcli.train.evaluate), recorded; early stopping decides here."""
        result, self.new_best = evaluate_now(self.evaluator, self.evals, self.model, self.result.steps,
                                             say=self.say if self.world.is_main else None)
        self.eval_schedule.mark_saved()
        self.stop_reason = self.evals.stop_reason()
        return result

    def log_eval(self, result: EvalResult) -> None:
        """An eval outside a step line (step 0): printed, in metrics.jsonl and MLflow."""
        if self.world.is_main:
            publish_eval(result, say=self.say, metrics_path=self.metrics_path, tracker=self.tracker)

    def sample(self) -> None:
        """Collective: greedy completions of eval.samples; every rank takes part in each sharded forward."""
        sample_now(self.model, self.tokenizer, self.eval_cfg, self.result.steps, run_dir=self.run_dir,
                   is_main=self.world.is_main, tracker=self.tracker)
        self.last_sample_step = self.result.steps

    def maybe_checkpoint(self, save_by_time: bool) -> Path | None:
        """6e. Save if the schedule says so (`save_by_time`: rank 0's clock, shared), but never in the
        middle of a run of bad steps (the last good checkpoint must survive) nor at the last step
        (`finish` saves that one). Collective: every rank calls it with the same arguments."""
        steps = self.result.steps
        keep_best = self.tcfg.checkpoint.keep_best and getattr(self, "new_best", False)
        self.new_best = False
        if not ((self.save_schedule.due(steps, save_by_time) or keep_best) and self.bad_in_a_row == 0
                and steps < self.total_steps and not self.stop_reason):
            return None
        path = self.save()
        self.say(f"checkpoint: {path}")
        return path

    def stop_checkpoint(self, save: bool) -> str | None:
        """Collective, when the session stops the run (ftcli.train.session.RunSession.stop): the newest checkpoint,
        after a checkpoint of this step when `save` and the step has none yet."""
        if save and self.last_save_step != self.result.steps:
            self.say(f"checkpoint: {self.save()}")
        return self.result.checkpoint

    def restore(self, path: Path) -> None:
        """Model, optimizer, scheduler, data position, RNG and the step accounting that `save` wrote; the
        checkpoint may come from another world size (ftcli.train.checkpoint). metrics.jsonl loses the steps
        logged after the checkpoint: they are trained again."""
        rank_state, meta = load_checkpoint(path, self.model, self.optimizer)
        blocks_per_step = self.world.dp_size * self.tcfg.grad_accum
        if meta.get("blocks_per_step", blocks_per_step) != blocks_per_step:
            self.say(f"[yellow]warning: {path} was trained with {meta['blocks_per_step']} blocks per optimizer step "
                     f"({meta['world_size']} ranks), this run takes {blocks_per_step} ({self.world.dp_size} data-"
                     "parallel groups x training.grad_accum): the steps after it differ from the uninterrupted run's[/]")
        if self.world.is_main:
            truncate_metrics(self.run_dir / METRICS_FILE, meta["result"]["steps"])
        self.scheduler.load_state_dict(rank_state["scheduler"])
        self.stream.load_state_dict(rank_state["data"])
        set_rng_state(rank_state["rng"])
        for key in ("steps", "optimizer_steps", "skipped_empty", "skipped_nonfinite", "tokens_trained", "tokens_seen"):
            setattr(self.result, key, meta["result"][key])
        self.result.final_loss = meta["result"]["final_loss"]
        self.result.checkpoint = str(path)
        if self.evals is not None:
            self.evals.load_state_dict(meta.get("evals"))

    def save(self) -> Path:
        """Collective: a DCP checkpoint of this step (ftcli.train.checkpoint)."""
        rank_state = {"scheduler": self.scheduler.state_dict(), "data": self.stream.state_dict(), "rng": rng_state()}
        meta = {"result": {k: v for k, v in vars(self.result).items() if k not in ("losses", "checkpoint")},
                "blocks_per_step": self.world.dp_size * self.tcfg.grad_accum}
        if self.evals is not None:
            meta["evals"] = self.evals.state_dict()
        path = save_checkpoint(self.run_dir / CHECKPOINTS, self.result.steps, self.model, self.optimizer, rank_state,
                               meta, keep_last=self.tcfg.checkpoint.keep_last, protect=self.protected())
        self.result.checkpoint = str(path)
        self.last_save_step = self.result.steps
        self.save_schedule.mark_saved()
        return path

    def protected(self) -> list[Path]:
        """Checkpoints rotation must keep: the best eval's (training.checkpoint.keep_best)."""
        best = self.evals.best_step if self.evals is not None and self.tcfg.checkpoint.keep_best else None
        return [self.run_dir / CHECKPOINTS / step_dir_name(best)] if best is not None else []

    # ---- 7. finish: last checkpoint, Hugging Face export, run.json --------------------------------
    def finish(self) -> TrainResult:
        recipe, tcfg, result, world = self.recipe, self.tcfg, self.result, self.world
        self.progress.stop()
        if self.evaluator and (not self.evals.history or self.evals.history[-1]["step"] != result.steps):
            self.log_eval(self.evaluate())  # the data ended before the schedule did: the end's eval
        if self.eval_cfg is not None and self.eval_cfg.samples and self.last_sample_step != result.steps:
            self.sample()  # the end's samples (an early stop, or the data ended first)
        if tcfg.checkpoint.enabled and self.last_save_step != result.steps:
            self.say(f"checkpoint: {self.save()}")
        best_step = self.evals.best_step if self.evals is not None else None
        best = best_checkpoint(self.run_dir / CHECKPOINTS, best_step) if tcfg.checkpoint.keep_best else None
        best_model_dir = None
        if tcfg.checkpoint.save_final_hf:  # final/ (and best/): the session decides which model goes where
            export = export_hf(self.model, recipe.model, self.tokenizer)
            best_model_dir = self.session.export_models(
                best_step if best is not None else None, result.steps, export_last=export,
                export_best=best_from_checkpoint(best, self.model, export))
        self.session.complete(steps=result.steps, tokens={"trained": result.tokens_trained, "seen": result.tokens_seen},
                              final_loss=result.final_loss, throughput=self.meter.throughput(), evals=self.evals,
                              best_model_dir=best_model_dir, stopped_early=self.stop_reason,
                              model_dir=FINAL if tcfg.checkpoint.save_final_hf else None,
                              best_checkpoint=str(best) if best is not None else None)
        dist.barrier()  # leave together: a rank that tears down its process group early aborts the others
        return result
