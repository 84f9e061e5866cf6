"""LoRA training: a thin adapter from a recipe to TRL's SFTTrainer + PEFT.

`train(recipe, run_dir, resume)` runs inside torchrun (one process per GPU, gloo on CPU), started by
`ftcli.launch`. TRL/accelerate own the loop (DDP, gradient accumulation, clipping, the optimizer and
schedule, checkpoints, MLflow); ftcli supplies four things and nothing else:

1. the model, loaded like everywhere else in ftcli (`ftcli.modeling.load_model`: hub id + revision or
   a local path, MXFP4 dequantized, the packed attention from `ftcli.kernels` when "auto");
2. the data: the exact blocks `ftcli pack-preview` shows (`ftcli.data`), handed to TRL pre-tokenized
   (`skip_prepare_dataset`) with a collator that emits each block as one padding-free row, so TRL
   neither re-tokenizes nor re-packs;
3. the recipe -> SFTConfig mapping (`sft_config_kwargs`, pure, tested value by value);
4. token-level loss normalization for every model class (see `normalize_loss_by_tokens`).

What both trainers share comes from the modules below them: the step line (`ftcli.metrics.StepMetrics`),
the checkpoint timing and the resume rule (`ftcli.checkpoint`), the trained-token count (`ftcli.loss`),
run.json (`ftcli.rundir.RunRecord`). Outputs follow the run-dir contract: <run>/checkpoints/checkpoint-N
(resumable), <run>/final (adapter + tokenizer + chat template), <run>/run.json, and <run>/base for
random-init bases.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ftcli.errors import UserError
from ftcli.recipe import Recipe

# Vision towers of the VLM classes ftcli knows (kept out of LoRA unless lora.exclude_vision is false).
_VISION_MODULES = ("visual", "vision_tower", "vision_model", "multi_modal_projector")
TOKENS_FILE = "ftcli_tokens.json"  # in every checkpoint-N: the run's token counts, so a resume keeps counting


@functools.cache
def checkpointing_arg() -> str:
    """transformers 5.24 calls it `activation_checkpointing(_kwargs)` and keeps `gradient_checkpointing(_kwargs)`
    as a deprecated alias (with a FutureWarning); older 5.x releases may only know the old name. Use
    the name the installed TrainingArguments defines."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


# ------------------------------------------------------------------------------- recipe -> SFTConfig
def sft_config_kwargs(recipe: Recipe, run_dir: Path, sharding: str = "ddp") -> dict[str, Any]:
    """The SFTConfig for a LoRA recipe (transformers 5 / TRL 1.x names). Pure: no I/O, no torch state
    (only the installed TrainingArguments' field names decide the checkpointing keyword).

    transformers 5 has no `warmup_ratio`: `warmup_steps` < 1 is read as a fraction of the total steps,
    which is exactly the recipe's convention, so `schedule.warmup` passes through unchanged.

    `sharding` is `training.sharding` resolved (`ftcli.plan.resolved_sharding`): "fsdp" hands the model to
    accelerate's FSDP2 (`fsdp_config` version 2): every decoder layer (the model's `_no_split_modules`) one
    unit and the root the rest, parameters resharded after forward, so the frozen base lives sharded and is
    gathered one layer at a time; the LoRA weights shard with their layers. Activation checkpointing is
    then FSDP's own (per unit; the TrainingArguments flag would all-gather every layer a second time).
    """
    t = recipe.training
    opt, sched, ckpt, ac = t.optimizer, t.schedule, t.checkpoint, t.activation_checkpointing
    ac_kwargs = {"use_reentrant": False, **({"selective": True} if ac == "selective" else {})}
    fsdp = sharding == "fsdp"
    return dict(
        output_dir=str(Path(run_dir) / "checkpoints"), run_name=recipe.tracking.run_name or recipe.name,
        seed=t.seed, data_seed=t.seed,
        # schedule of steps
        num_train_epochs=t.epochs, max_steps=t.max_steps or -1,
        per_device_train_batch_size=t.per_device_batch, gradient_accumulation_steps=t.grad_accum,
        # optimizer
        optim="adamw_torch_fused" if opt.fused else "adamw_torch", learning_rate=opt.lr,
        adam_beta1=opt.betas[0], adam_beta2=opt.betas[1], adam_epsilon=opt.eps, weight_decay=opt.weight_decay,
        max_grad_norm=t.grad_clip or 0.0,  # 0 disables clipping
        lr_scheduler_type=sched.name,
        lr_scheduler_kwargs={"min_lr_rate": sched.min_lr_ratio} if sched.name == "cosine_with_min_lr" else {},
        warmup_steps=sched.warmup if sched.warmup < 1 else int(sched.warmup),
        # precision and memory
        bf16=recipe.model.dtype == "bfloat16", fp16=recipe.model.dtype == "float16",
        **{checkpointing_arg(): ac != "none" and not fsdp,
           f"{checkpointing_arg()}_kwargs": ac_kwargs if ac != "none" and not fsdp else None},
        torch_compile=t.compile,
        # DDP: every LoRA parameter gets a gradient on every step
        ddp_find_unused_parameters=False,
        # FSDP2 (training.sharding: fsdp): the base sharded; checkpoints are per-rank shards (DCP)
        **({"fsdp": True, "fsdp_config": {"version": 2, "reshard_after_forward": True,
                                          "activation_checkpointing": ac != "none",
                                          "cpu_ram_efficient_loading": True,  # rank 0 reads the base, then shards
                                          "state_dict_type": "SHARDED_STATE_DICT"}} if fsdp else {}),
        # loss: sum of token losses / trained tokens of the whole step, across accumulation and ranks
        average_tokens_across_devices=True, loss_type="nll",
        router_aux_loss_coef=0.0,  # (ref) the reference trained without the MoE load-balancing loss
        # data: ftcli tokenizes, masks and packs; TRL must not touch the rows
        dataset_kwargs={"skip_prepare_dataset": True}, packing=False, padding_free=False, max_length=None,
        remove_unused_columns=False, label_names=["labels"], dataloader_num_workers=0,
        # logging, checkpoints, tracking
        logging_steps=t.log_every, logging_first_step=True, disable_tqdm=False,
        save_strategy="steps" if ckpt.enabled and ckpt.every_steps else "no", save_steps=ckpt.every_steps or 500,
        save_total_limit=ckpt.keep_last,
        report_to="none",  # (ref: mlflow) ftcli's tracker logs every step line, synchronously, like the full path
    )


def lora_config(recipe: Recipe, model: torch.nn.Module):
    """PEFT LoraConfig: target modules, expert parameters, vision tower excluded on VLM classes."""
    from peft import LoraConfig

    lora = recipe.lora
    if lora.target_parameters and lora.dropout:
        raise UserError(
            f"lora.dropout={lora.dropout} cannot be used with lora.target_parameters (PEFT applies no dropout to "
            "3-D expert parameters); set --set lora.dropout=0 or drop lora.target_parameters"
        )
    names = {name for name, _ in model.named_parameters()}
    for target in lora.target_parameters:
        if not any(n == target or n.endswith("." + target) for n in names):
            raise UserError(f"lora.target_parameters: no parameter named '{target}' in {type(model).__name__}")
    exclude = None
    if lora.exclude_vision and recipe.model.model_class == "image_text_to_text":
        towers = set()
        for name, _ in model.named_modules():
            parts = name.split(".")
            hit = next((i for i, part in enumerate(parts) if part in _VISION_MODULES), None)
            if hit is not None:
                towers.add(".".join(parts[: hit + 1]))
        if towers:  # PEFT full-matches a string against module names: everything inside a tower
            exclude = r"(" + "|".join(t.replace(".", r"\.") for t in sorted(towers)) + r")(\..*)?"
    return LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias=lora.bias, target_modules=lora.target_modules,
        target_parameters=list(lora.target_parameters) or None, exclude_modules=exclude,
        revision=recipe.model.revision, task_type="CAUSAL_LM",
    )


# ---------------------------------------------------------------------------------------------- data
def training_rows(recipe: Recipe, tokenizer):
    """The rows TRL trains on: one per block of `ftcli.data.prepare_blocks`, exactly what
    `ftcli pack-preview --dump` writes, as a `datasets.Dataset` of (input_ids, labels, position_ids).

    Packing on: fixed-length packed blocks. Packing off (the reference): one example per row,
    truncated to `data.max_length` by the data path.
    """
    import datasets

    from ftcli.data import prepare_blocks

    packed = prepare_blocks(recipe, tokenizer)
    blocks = [packed[i] for i in range(len(packed))]
    if not blocks:
        raise UserError(f"data: no example with trained tokens in {recipe.data.path}")
    columns = {key: [getattr(b, key).astype(np.int64) for b in blocks] for key in ("input_ids", "labels", "position_ids")}
    return datasets.Dataset.from_dict(columns).with_format("numpy")


def collate_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Rows -> one padding-free row: the rows laid end to end as one block (`ftcli.data.make_block`, a
    segment wherever position_ids restart), given to the model as `ftcli.data.block_to_model_inputs`.

    One row is exactly its block again. With several rows (per_device_batch > 1) a row's first label is
    dropped when another row precedes it (it would be predicted across rows), as at every segment start:

        position_ids   0 1 2 3 0 1 | 0 1 2 0 1 2 3      <- two rows of the dataset
        cu_seq_lens    0       4   6     9         13   (int32; the same tensor for q and k)
        seq_idx        0 0 0 0 1 1   2 2 2 3 3 3 3      (int32)
        labels         . - x x - x   - x x - - x x      (- = -100; . = label[0], never used by the loss)
    """
    from ftcli.data import block_to_model_inputs, make_block
    from ftcli.loss import IGNORE_INDEX

    input_ids, labels, position_ids = (np.concatenate([np.asarray(r[key], dtype=np.int64) for r in rows])
                                       for key in ("input_ids", "labels", "position_ids"))
    if len(position_ids) == 0 or position_ids[0] != 0:
        raise ValueError("a packed row must start a segment (position_ids[0] == 0)")
    trained = labels != IGNORE_INDEX
    assert (labels[trained] == input_ids[trained]).all(), "a trained label is its own input token (ftcli.data)"
    starts = np.flatnonzero(position_ids == 0)
    block = make_block(input_ids, trained, np.diff(starts, append=len(input_ids)).tolist(), len(input_ids), pad_id=0)
    return block_to_model_inputs(block)


# ------------------------------------------------------------------------------------------- loss
def normalize_loss_by_tokens(trainer) -> None:
    """Make every optimizer step minimize (sum of token losses) / (trained tokens of the whole step).

    TRL computes the loss with its fused LM head as `-sum(log p) / num_items_in_batch`, where
    `num_items_in_batch` is the trained-token count of all micro-batches of the step, all-gathered over
    ranks (`average_tokens_across_devices`), and multiplies by the world size to undo DDP's gradient
    mean. Summed over accumulation and averaged by DDP, that is exactly the token mean of the step.

    transformers only counts `num_items_in_batch` when the model class "accepts loss kwargs"; classes
    that declare `accepts_loss_kwargs = False` (Qwen3_5ForConditionalGeneration) would get a mean per
    micro-batch, averaged over accumulation steps, so a short block weighs as much as a long one. The
    flag is about the model's own loss, which TRL's fused head never calls, so it is safe to set it
    for the trainer; the loss is then already scaled for accumulation.
    """
    trainer.model_accepts_loss_kwargs = True
    trainer.loss_is_scaled_for_ga = True


# -------------------------------------------------------------------------------------------- sharding
def fsdp_on_cpu_processes(trainer, args) -> None:
    """Let accelerate's FSDP2 run on CPU processes (gloo), as it runs on GPUs.

    accelerate only turns an FSDP plugin into `DistributedType.FSDP` for accelerator devices: in
    `AcceleratorState.__init__` the FSDP branch sits under MULTI_GPU/MULTI_XPU/..., and MULTI_CPU silently
    falls back to DDP (accelerate 1.15). FSDP2 itself (`fully_shard`) runs on gloo, so on CPU processes ftcli
    sets the two attributes that branch would have set, and the trainer's FSDP flag read from them; from
    there on the CPU run takes the GPU code path (accelerate's `fsdp2_prepare_model`, its FSDP checkpoint
    save/load). Not public API, hence this one place; a no-op on GPUs."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU:
        return
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    trainer.is_fsdp_enabled = True


def save_fsdp_adapter(trainer, out: Path) -> None:
    """The adapter of an FSDP2-sharded model, written once (rank 0) in PEFT format: the trainable parameters
    only, gathered whole on every rank (torch's `get_model_state_dict`; the frozen base is never gathered).
    Checkpoints are accelerate's SHARDED_STATE_DICT (per-rank DCP shards of the model and optimizer, which
    resume exactly); transformers' `save_model` writes nothing for them, hence this."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True,
                                                                         ignore_frozen_params=True))
    if trainer.args.process_index == 0:
        trainer.model.save_pretrained(str(out), state_dict=state)
        trainer.processing_class.save_pretrained(str(out))


# ---------------------------------------------------------------------------------------- callbacks
def _step_log_callback(recipe: Recipe, model, metrics_path: Path | None, tracker=None):
    """TRL's progress bar with ftcli's step line instead of a dict dump (`ftcli.metrics`: printed, appended
    to <run>/metrics.jsonl and logged to MLflow by rank 0), plus what TRL does not know about ftcli:

    * the run's trained and seen tokens, summed over ranks: a forward pre-hook counts what this rank
      feeds the model (`ftcli.loss.count_trained_tokens`; batches the data loader prefetches but never
      trains on are not counted), each step end all-reduces the step's two numbers; every checkpoint
      carries the totals (TOKENS_FILE), so a resumed run keeps counting from there;
    * `training.checkpoint.every_minutes` (`ftcli.checkpoint.CheckpointSchedule`, rank 0's clock decides
      for every rank); `every_steps` is TRL's own `save_steps`.
    """
    from transformers.trainer_callback import ProgressCallback

    from ftcli.checkpoint import CheckpointSchedule
    from ftcli.distributed import all_reduce, local_device, rank0_decides
    from ftcli.loss import count_trained_tokens
    from ftcli.metrics import StepMetrics, log_step

    device = local_device()  # where the model trains (an FSDP base is still on the CPU here)
    schedule = CheckpointSchedule.from_config(recipe.training.checkpoint)
    save_by_time = schedule.enabled and schedule.every_minutes is not None

    class StepLog(ProgressCallback):
        def __init__(self) -> None:
            super().__init__()
            self.trained = self.seen = 0
            self._pending = [0, 0]
            self.meter: StepMetrics | None = None
            model.register_forward_pre_hook(self._count, with_kwargs=True)

        def _count(self, module, args, kwargs):
            if module.training and kwargs.get("labels") is not None:
                self._pending[0] += count_trained_tokens(kwargs["labels"])
                self._pending[1] += kwargs["input_ids"].numel()

        def load(self, checkpoint: Path | None) -> None:
            path = Path(checkpoint or "") / TOKENS_FILE
            if checkpoint and path.is_file():
                saved = json.loads(path.read_text())
                self.trained, self.seen = saved["trained"], saved["seen"]

        def on_train_begin(self, args, state, control, **kwargs):
            if not args.disable_tqdm:
                super().on_train_begin(args, state, control, **kwargs)
            self.meter = StepMetrics(4 * active_params(model), device, args.world_size)  # LoRA: no weight grads
            self.step_start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if self.training_bar is not None:
                super().on_step_end(args, state, control, **kwargs)
            step = all_reduce(self._pending, device=device) if torch.distributed.is_initialized() else self._pending
            self.trained, self.seen, self._pending = self.trained + int(step[0]), self.seen + int(step[1]), [0, 0]
            now = time.perf_counter()
            self.meter.step_done(int(step[1]), now - self.step_start)
            self.step_start = now
            if save_by_time and rank0_decides(schedule.time_due(), device):
                control.should_save = True

        def on_save(self, args, state, control, **kwargs):
            schedule.mark_saved()
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if state.is_world_process_zero and ckpt.is_dir():
                (ckpt / TOKENS_FILE).write_text(json.dumps({"trained": self.trained, "seen": self.seen}))

        def on_train_end(self, args, state, control, **kwargs):
            if self.training_bar is not None:
                super().on_train_end(args, state, control, **kwargs)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs is None or "loss" not in logs:  # the end-of-training summary: printed by TRL as is
                return super().on_log(args, state, control, logs=logs, **kwargs)
            m = self.meter.line(step=state.global_step, loss=logs["loss"], grad_norm=logs.get("grad_norm") or 0.0,
                                lr=logs.get("learning_rate", 0.0), tokens_trained=self.trained, tokens_seen=self.seen)
            logs.update({k: v for k, v in m.items() if k not in ("step", "loss", "grad_norm", "lr", "mem_unit")
                         and v is not None})
            if state.is_world_process_zero:
                say = self.training_bar.write if self.training_bar is not None else functools.partial(print, flush=True)
                log_step(m, state.max_steps, say=say, metrics_path=metrics_path, tracker=tracker)

    return StepLog()


def _stop_callback(save: bool):
    """SIGTERM / SIGINT (`ftcli.preempt`): at the end of the step in progress, every rank agrees on the
    flag (one all-reduce MAX), saves checkpoint-N through TRL (`save`: checkpoints enabled) and stops;
    `train` then raises `Stopped`. `.signum`: the agreed signal (0: none)."""
    from transformers import TrainerCallback

    from ftcli.preempt import stop_flag

    class StopOnSignal(TrainerCallback):
        def __init__(self) -> None:
            self.flag, self.signum = stop_flag(), 0

        def on_step_end(self, args, state, control, **kwargs):
            self.signum = self.flag.agreed(args.device)
            if self.signum:
                control.should_save = control.should_save or save
                control.should_training_stop = True

    return StopOnSignal()


def active_params(model) -> int:
    """Non-embedding parameters one token goes through: MoE experts count top-k / num_experts."""
    from ftcli.modeling import count_params, text_config

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    _, non_embedding = count_params(base)
    cfg = text_config(base.config)
    experts, k = getattr(cfg, "num_local_experts", None), getattr(cfg, "num_experts_per_tok", None)
    if experts and k:
        expert_params = sum(p.numel() for n, p in base.named_parameters() if ".experts." in n and "lora_" not in n)
        non_embedding -= expert_params - expert_params * k // experts
    return non_embedding


# -------------------------------------------------------------------------------------------- model
def _attn_implementation(recipe: Recipe, device: torch.device) -> str | None:
    """ftcli's packed kernels for "auto" (they keep the segments of a block apart; refuse where they
    cannot); a named implementation is only allowed unpacked (the recipe schema enforces it), since e.g.
    gpt-oss eager would let the documents of a block attend to each other."""
    if recipe.model.attn_implementation != "auto":
        return recipe.model.attn_implementation
    from ftcli.kernels import check_packing_safe, enable_packed_kernels

    if not recipe.data.packing.enabled and check_packing_safe(recipe.model.model_type, device):
        return None  # unpacked rows need no packed kernels; transformers' default for this model
    name, _ = enable_packed_kernels(recipe.model.model_type, device)
    return name


def load_base(recipe: Recipe, run_dir: Path, device: torch.device, attn: str | None, *, resume: bool):
    """The base model on `device`. A random-init base is saved once to <run>/base (rank 0), so that
    resume, merge-lora and register rebuild the exact weights the adapter was trained on."""
    from ftcli.modeling import load_model

    base_dir = run_dir / "base"
    if recipe.model.init == "random" and resume and (base_dir / "config.json").exists():
        cfg = recipe.model.model_copy(update={"init": "pretrained", "id": str(base_dir), "quantization": "none"})
        return load_model(cfg, attn_implementation=attn, device=device)
    if recipe.model.init == "random":
        torch.manual_seed(recipe.training.seed)  # same weights on every rank (DDP also broadcasts rank 0's)
    return load_model(recipe.model, attn_implementation=attn, device=device)


# -------------------------------------------------------------------------------------------- train
def build_trainer(recipe: Recipe, model, tokenizer, rows, args, *, metrics_path: Path | None = None, tracker=None):
    """SFTTrainer over ftcli's rows with PEFT, token-normalized loss and ftcli's step line; returns
    (trainer, step log: its `.trained` / `.seen` are the run's tokens). Shared by `train` and
    benchmarks/lora_gpt_oss_gpu.py."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import SFTTrainer

    trainer = SFTTrainer(model=model, args=args, train_dataset=rows, data_collator=collate_rows,
                         processing_class=tokenizer, peft_config=lora_config(recipe, model))
    if args.fsdp:
        fsdp_on_cpu_processes(trainer, args)
    normalize_loss_by_tokens(trainer)
    trainer.remove_callback(ProgressCallback)  # (or PrinterCallback with disable_tqdm): StepLog prints instead
    trainer.remove_callback(PrinterCallback)
    step_log = _step_log_callback(recipe, trainer.model, metrics_path, tracker)
    trainer.callback_handler.callbacks.insert(0, step_log)
    return trainer, step_log


def train(recipe: Recipe, run_dir: Path, resume: str | None) -> None:
    """One LoRA run under torchrun; see the module docstring."""
    from trl import SFTConfig

    from ftcli import data
    from ftcli.checkpoint import checkpoint_step, resolve_resume
    from ftcli.plan import resolved_sharding
    from ftcli.distributed import local_device, rank0_first
    from ftcli.metrics import truncate_metrics
    from ftcli.preempt import Stopped
    from ftcli.rundir import FINAL, METRICS_FILE, new_run_record, write_run_record
    from ftcli.tracking import start_tracking

    run_dir = Path(run_dir)
    if recipe.training.method != "lora":
        raise UserError(f"train_lora got training.method={recipe.training.method}")
    checkpoint = resolve_resume(run_dir, resume, kind="trl")
    device = local_device()
    sharding, why = resolved_sharding(recipe)
    if sharding == "fsdp" and device.type == "cuda":  # as `accelerate launch`: from_pretrained reads the base on
        os.environ["ACCELERATE_USE_FSDP"] = "true"     # rank 0 only (CPU processes: every rank reads its small base)
    # also initializes torch.distributed (accelerate: NCCL on GPUs, gloo for CPU processes)
    args = SFTConfig(**sft_config_kwargs(recipe, run_dir, sharding), use_cpu=device.type == "cpu")
    if args.process_index == 0:
        for message in ignored_settings(recipe, sharding):
            print(f"warning: {message}", flush=True)

    # MLflow (rank 0): ftcli.tracking starts or attaches to the run (MLFLOW_RUN_ID, or this run dir's
    # tracking.json on resume) and logs the recipe; the step-line callback logs the metrics into it.
    tracker = start_tracking(recipe, run_dir=run_dir, rank=args.process_index, resume=checkpoint is not None)
    if checkpoint is not None and args.process_index == 0:
        truncate_metrics(run_dir / METRICS_FILE, checkpoint_step(checkpoint))  # those steps are trained again
    try:
        attn = _attn_implementation(recipe, device)
        tokenizer = rank0_first(lambda: data.load_tokenizer(recipe))
        rows = rank0_first(lambda: training_rows(recipe, tokenizer))  # rank 0 fills the cache, then the others

        # FSDP: the base stays on the CPU (rank 0's full copy, meta elsewhere) until accelerate shards it
        model = load_base(recipe, run_dir, device if sharding == "ddp" else None, attn, resume=checkpoint is not None)
        if recipe.model.init == "random" and checkpoint is None and args.process_index == 0:
            model.save_pretrained(run_dir / "base")
            tokenizer.save_pretrained(run_dir / "base")

        trainer, step_log = build_trainer(recipe, model, tokenizer, rows, args, metrics_path=run_dir / METRICS_FILE,
                                          tracker=tracker)
        if args.process_index == 0:
            trainable, total = trainer.model.get_nb_trainable_parameters()
            print(f"{recipe.name}: LoRA {trainable / 1e6:,.2f}M trainable of {total / 1e6:,.1f}M params, "
                  f"{len(rows)} rows ({'packed blocks' if recipe.data.packing.enabled else 'examples'}), "
                  f"{args.world_size} x {device.type}, base {sharding} ({why}), attention {attn or 'default'}, "
                  f"run dir {run_dir}", flush=True)

        step_log.load(checkpoint)
        stop = _stop_callback(recipe.training.checkpoint.enabled)
        trainer.add_callback(stop)
        trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
        if stop.signum and trainer.state.global_step < trainer.state.max_steps:
            step = trainer.state.global_step
            saved = Path(args.output_dir) / f"checkpoint-{step}"
            raise Stopped(step, stop.signum, str(saved) if saved.is_dir() else None)
        if sharding == "fsdp":
            save_fsdp_adapter(trainer, run_dir / FINAL)
        else:
            trainer.save_model(str(run_dir / FINAL))  # adapter + tokenizer + chat template (main process)

        if args.process_index == 0:
            losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
            record = new_run_record(
                recipe, method="lora", mlflow=tracker.info, base_path="base" if recipe.model.init == "random" else None,
                model_dir=FINAL, steps=trainer.state.global_step,
                tokens={"trained": step_log.trained, "seen": step_log.seen}, final_loss=losses[-1] if losses else None,
                throughput=step_log.meter.throughput(),  # of this invocation (a resumed run: after the checkpoint)
                status="completed",
            )
            tracker.log_artifact(write_run_record(run_dir, record))
            tracker.log_artifact(run_dir / "recipe.yaml")
            print(f"done: {trainer.state.global_step} steps, adapter in {run_dir / FINAL}", flush=True)
        tracker.finish()
    except BaseException as e:
        tracker.finish("KILLED" if isinstance(e, Stopped) else "FAILED")
        raise
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # run.json is written before any rank exits


def ignored_settings(recipe: Recipe, sharding: str = "ddp") -> list[str]:
    """Recipe settings the LoRA path has no use for (warned, not silently dropped)."""
    t, out = recipe.training, []
    if sharding == "fsdp" and t.activation_checkpointing == "selective":
        out.append("training.activation_checkpointing=selective runs as full with training.sharding=fsdp "
                   "(FSDP2 checkpoints whole units)")
    if t.loss.impl != "chunked":
        out.append(f"training.loss.impl={t.loss.impl} has no effect on LoRA: TRL's fused (chunked) LM head computes the loss")
    if t.activation_checkpointing_keep:
        out.append("training.activation_checkpointing_keep has no effect on LoRA: "
                   "the LoRA path checkpoints every layer or none")
    if t.precision.master_dtype != "float32" or t.precision.param_dtype != "bfloat16":
        out.append("training.precision has no effect on LoRA: adapters train in float32, the base stays model.dtype")
    return out
