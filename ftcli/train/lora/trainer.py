"""LoRA training: a thin adapter from a recipe to TRL's SFTTrainer + PEFT.

`train(recipe, run_dir, resume)` runs inside torchrun (one process per GPU, gloo on CPU), started by
`ftcli.train.launch`. TRL/accelerate own the loop (DDP, gradient accumulation, clipping, the optimizer and
schedule, checkpoints, MLflow); ftcli supplies four things and nothing else:

1. the model, loaded like everywhere else in ftcli (`ftcli.model.build.load_model`: hub id + revision or
   a local path, MXFP4 dequantized, the packed attention from `ftcli.model.kernels` when "auto");
2. the data: the exact blocks `ftcli pack-preview` shows (the objective's units, `ftcli.objectives`): TRL's
   dataset holds only block indices (`skip_prepare_dataset`) and a collator hands the model each block as one
   padding-free row, so TRL neither tokenizes, packs nor stores the tokens;
3. the recipe -> SFTConfig / LoraConfig mapping (`ftcli.train.lora.config`, pure, tested value by value);
4. the loss: ftcli's, the objective's summed loss over the step's global count, the full loop's algebra, for every
   model class (`use_objective_loss`, `normalize_loss_by_tokens`); train and eval report the same loss;

and, as TRL callbacks (`ftcli.train.lora.callbacks`), what TRL does not know: ftcli's step line and token counts,
time-based saves, stopping on a signal, and ftcli's own eval (`ftcli.train.evaluate`, the functions the full loop
calls; TRL's eval averages per-batch means, not normalized by the trained tokens across ranks), also with the
base sharded by FSDP2 (`training.sharding: fsdp`). Shared with the full path through the modules below: the
step line (`ftcli.train.metrics`), checkpoint timing and resume (`ftcli.train.checkpoint`), the trained-token count
(`ftcli.train.loss`), run.json (`ftcli.artifacts.rundir.RunRecord`). Outputs follow the run-dir contract:
<run>/checkpoints/checkpoint-N (resumable), <run>/final (adapter + tokenizer + chat template), <run>/best
(keep_best), <run>/run.json, and <run>/base for random-init bases.
"""

from __future__ import annotations

import os
import pickle
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ftcli import features
from ftcli.config.errors import UserError
from ftcli.objectives import method_of, objective_of
from ftcli.train.lora.callbacks import TOKENS_FILE  # noqa: F401 (a checkpoint's token counts, named here too)
from ftcli.train.lora.callbacks import Checksums, EvalCallback, ObjectiveLoss, StepLog, StopOnSignal, TimedSave
from ftcli.train.lora.callbacks import route_loss_through_forward, save_adapter
from ftcli.train.lora.config import checkpointing_arg, ignored_settings, lora_config, sft_config_kwargs  # noqa: F401
from ftcli.config.recipe import Recipe


# ---------------------------------------------------------------------------------------------- data
def training_blocks(recipe: Recipe, tokenizer, first=lambda f, then=None: f()):
    """The units TRL trains on: the recipe objective's packed blocks (`ftcli.objectives`: for SFT
    `ftcli.data.prepare_blocks`), exactly what `ftcli pack-preview --dump` writes. Packing on: fixed-length packed
    blocks; off (the published gpt-oss example): one example per block, truncated to `data.max_length`.
    `first`: ftcli.train.distributed.rank0_first under torchrun (rank 0 fills the cache, then the others open it)."""
    from ftcli.data import data_spec
    from ftcli.objectives import objective_of

    return require_units(recipe.data, objective_of(recipe.training).units(data_spec(recipe), tokenizer, first))


def require_units(data_cfg, units):
    """`units`, or a one-line UserError naming `data_cfg`'s sources (the recipe's data section) when they gave none."""
    if not len(units):
        raise UserError(f"data: no example with trained tokens in {', '.join(s.label for s in data_cfg.sources)}")
    return units


def block_rows(blocks):
    """The `datasets.Dataset` SFTTrainer asks for (it refuses any other dataset type): one row per block, holding
    only the block's index. TRL shuffles, shards and checkpoints the rows; `BlockCollator` turns them back into
    ftcli's blocks, so the tokens never go through dataset columns."""
    import datasets

    return datasets.Dataset.from_dict({"block": np.arange(len(blocks), dtype=np.int64)})


class BlockCollator:
    """TRL's rows (block indices, `block_rows`) -> the blocks of `blocks` as one padding-free model call
    (`collate_blocks`)."""

    def __init__(self, blocks):
        self.blocks = blocks

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        return collate_blocks([self.blocks[int(r["block"])] for r in rows])


def collate_blocks(blocks: list) -> dict[str, Any]:
    """Blocks -> one padding-free row, given to the model as `ftcli.data.block_to_model_inputs`. One block is
    exactly that block. With several (per_device_batch > 1) they are laid end to end as one block
    (`ftcli.data.make_block`, each block's segments kept), and a block's first label is dropped when another
    block precedes it (it would be predicted across blocks), as at every segment start:

        position_ids   0 1 2 3 0 1 | 0 1 2 0 1 2 3      <- two blocks
        cu_seq_lens    0       4   6     9         13   (int32; the same tensor for q and k)
        seq_idx        0 0 0 0 1 1   2 2 2 3 3 3 3      (int32)
        labels         . - x x - x   - x x - - x x      (- = -100; . = label[0], never used by the loss)
    """
    from ftcli.data import block_to_model_inputs, make_block
    from ftcli.train.loss import IGNORE_INDEX

    if len(blocks) == 1:
        return block_to_model_inputs(blocks[0])
    input_ids = np.concatenate([np.asarray(b.input_ids) for b in blocks])
    trained = np.concatenate([np.asarray(b.labels) != IGNORE_INDEX for b in blocks])
    seg_lens = [int(n) for b in blocks for n in np.diff(np.asarray(b.cu_seqlens))]
    roles = None if blocks[0].roles is None else np.concatenate([b.roles for b in blocks])  # preference pairs
    block = make_block(input_ids, trained, seg_lens, len(input_ids), pad_id=0, roles=roles)
    if blocks[0].reference_logps is not None:  # precomputed reference: one per segment, padding segments included
        block.reference_logps = np.concatenate([b.reference_logps for b in blocks])
    return block_to_model_inputs(block)


# ------------------------------------------------------------------------------- loss and sharding
def normalize_loss_by_tokens(trainer) -> None:
    """Make every optimizer step minimize (sum of token losses) / (trained tokens of the whole step).

    The loss (`use_objective_loss`) is `sum(token CE) / num_items_in_batch`, where `num_items_in_batch` is the
    trained-token count of all micro-batches of the step, all-gathered over ranks
    (`average_tokens_across_devices`), times the world size to undo DDP's gradient mean. Summed over
    accumulation and averaged by DDP, that is exactly the token mean of the step.

    transformers only counts `num_items_in_batch` when the model class "accepts loss kwargs"; classes
    that declare `accepts_loss_kwargs = False` (Qwen3_5ForConditionalGeneration) would get a mean per
    micro-batch, averaged over accumulation steps, so a short block weighs as much as a long one. The
    flag is about the model's own loss, which ftcli's loss never calls, so it is safe to set it
    for the trainer; the loss is then already scaled for accumulation.
    """
    trainer.model_accepts_loss_kwargs = True
    trainer.loss_is_scaled_for_ga = True


def use_objective_loss(trainer, objective, chunk_tokens: int, training=None) -> None:
    """One loss for the run, ftcli's, in training as in eval: the objective's summed loss of each micro-batch
    (`objective.loss_sum`; SFT: the summed token CE of `ftcli.train.loss`, the full loop's and the eval's) divided
    by the step's global count, the algebra the full loop writes out (`ftcli.objectives.sft.LOSS_ALGEBRA`):

        loss_{r,m} = S_{r,m} * W / N        N = `num_items_in_batch`: the trained tokens of every micro-batch of
                                            the step on every rank (transformers counts labels[..., 1:] != -100
                                            over the accumulation window and all-gathers it,
                                            `average_tokens_across_devices`): for SFT the sum of
                                            `objective.count(block)` (an objective that counts other units, pairs,
                                            gives the trainer its own count through `Trainer.get_batch_samples`)

    DDP and FSDP2 average the gradients over the W ranks, so the step's gradient is grad(sum S / N), and the
    logged loss (the micro-batches' losses summed, averaged over ranks) is sum S / N. This replaces TRL's own loss
    (its fused LM head's log-probs, an equal sum to fp32 rounding), which also logged entropy and token accuracy.
    A step with no trained token divides by 1 (loss 0), as TRL did. The loss is reached through the model's call
    (`route_loss_through_forward` now, before accelerate wraps the forward in its autocast; `attach_loss_sum` by the
    `ObjectiveLoss` callback once accelerate has prepared the model)."""
    route_loss_through_forward(trainer.model, objective)
    trainer.callback_handler.callbacks.insert(0, ObjectiveLoss(chunk_tokens, objective, training))

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        summed = model(**inputs, ftcli_loss_sum=True)
        count = num_items_in_batch if num_items_in_batch is not None else (inputs["labels"][..., 1:] != -100).sum()
        loss = summed / torch.as_tensor(count, device=summed.device).clamp(min=1)
        if trainer.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * trainer.accelerator.num_processes  # undo the ranks' gradient mean (W above)
        return (loss, None) if return_outputs else loss

    trainer.compute_loss = compute_loss
    if objective.unit == "pair":  # the step's count is its pairs, not its trained tokens
        count_pairs(trainer)


def count_pairs(trainer) -> None:
    """`num_items_in_batch` of a preference step: the pairs of its micro-batches (`pairs` of each collated block),
    summed over the ranks as transformers sums the token count (`average_tokens_across_devices`)."""
    count_tokens = trainer.get_batch_samples

    def get_batch_samples(epoch_iterator, num_batches, device):
        batches, _ = count_tokens(epoch_iterator, num_batches, device)
        pairs = torch.tensor(sum(int(b["pairs"].shape[0]) if "pairs" in b else 0 for b in batches), device=device)
        if trainer.args.average_tokens_across_devices and trainer.args.world_size > 1:
            pairs = trainer.accelerator.gather(pairs).sum()
        return batches, pairs

    trainer.get_batch_samples = get_batch_samples


def fsdp_on_cpu_processes(trainer, args) -> None:
    """Let accelerate's FSDP2 run on CPU processes (gloo), as it runs on GPUs.

    accelerate only turns an FSDP plugin into `DistributedType.FSDP` for accelerator devices: in
    `AcceleratorState.__init__` the FSDP branch sits under MULTI_GPU/MULTI_XPU/..., and MULTI_CPU silently
    falls back to DDP (accelerate 1.15). FSDP2 itself (`fully_shard`) runs on gloo, so on CPU processes ftcli
    sets the two attributes that branch would have set, and the trainer's FSDP flag read from them; from
    there on the CPU run takes the GPU code path (accelerate's `fsdp2_prepare_model`, its FSDP checkpoint
    save/load). Neither accelerate nor TRL has a public switch for this (`ACCELERATE_USE_FSDP` and
    `fsdp_plugin` are read in that same branch only), hence this one place; a no-op on GPUs."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU:
        return
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    if state.mixed_precision != "no":  # as that branch does
        state.fsdp_plugin.set_mixed_precision(state.mixed_precision)
    trainer.is_fsdp_enabled = True


def fp32_loss_and_reduce(trainer) -> None:
    """Under FSDP2, leave the model's outputs uncast and sum the adapter's gradients over ranks in float32.

    For bf16 mixed precision accelerate's FSDP2 plugin sets `MixedPrecisionPolicy(param_dtype=reduce_dtype=
    output_dtype=bf16)`. FSDP2 applies output_dtype to the output of every sharded unit, the root included, so
    TRL's float32 per-token log-probs came back as bf16 and the block's loss was summed in bf16 (8 bits: a 4k
    block's logged loss moved in steps of ~0.06, seen on an H200 as identical losses at 4 and 6 layers), and
    so was the eval loss; reduce_dtype summed the adapter's gradients over ranks in bf16, where DDP sums them
    in float32. ftcli keeps param_dtype (weights gathered and computed in bf16), sets output_dtype to None (no
    cast: every unit returns what it computed; a float32 cast would hand the decoder layers and the eval loss's
    LM-head matmul float32 activations next to bf16 weights) and reduce_dtype to float32."""
    from dataclasses import replace

    plugin = trainer.accelerator.state.fsdp_plugin
    policy = getattr(plugin, "mixed_precision_policy", None)
    if policy is None or policy.param_dtype is None:
        return
    plugin.mixed_precision_policy = replace(policy, reduce_dtype=torch.float32, output_dtype=None)


# -------------------------------------------------------------------------------------------- model
def _attn_implementation(recipe: Recipe, device: torch.device) -> str | None:
    """ftcli's packed kernels for "auto" (they keep the segments of a block apart; refuse where they
    cannot); a named implementation is only allowed unpacked (the recipe schema enforces it), since e.g.
    gpt-oss eager would let the documents of a block attend to each other."""
    if recipe.model.attn_implementation != "auto":
        return recipe.model.attn_implementation
    from ftcli.model.kernels import check_packing_safe, enable_packed_kernels

    if not recipe.data.packing.enabled and check_packing_safe(recipe.model.model_type, device):
        return None  # unpacked rows need no packed kernels; transformers' default for this model
    name, _ = enable_packed_kernels(recipe.model.model_type, device)
    return name


def load_base(recipe: Recipe, run_dir: Path, device: torch.device, attn: str | None, *, resume: bool):
    """The base model on `device`. A random-init base is saved once to <run>/base (rank 0), so that
    resume, merge-lora and register rebuild the exact weights the adapter was trained on."""
    from ftcli.model.build import load_model

    base_dir = run_dir / "base"
    if recipe.model.init == "random" and resume and (base_dir / "config.json").exists():
        cfg = recipe.model.model_copy(update={"init": "pretrained", "id": str(base_dir), "quantization": "none"})
        return load_model(cfg, attn_implementation=attn, device=device)
    if recipe.model.init == "random":
        torch.manual_seed(recipe.training.seed)  # same weights on every rank (DDP also broadcasts rank 0's)
        if device is None and (gpu := random_init_gpu(recipe)) is not None:
            model = load_model(recipe.model, attn_implementation=attn, device=gpu).to("cpu")
            torch.cuda.empty_cache()  # the drawn base's memory back for NCCL, and out of the step lines' peak
            torch.cuda.reset_peak_memory_stats(gpu)
            return model
    return load_model(recipe.model, attn_implementation=attn, device=device)


def read_stored_reference(recipe: Recipe, base, session, sharding: str, device: torch.device):
    """training.preference.reference=precomputed: the session's training and eval blocks with the reference's
    log-probs (ftcli.train.reference), read from their stores or computed now by `base`, which has no adapter yet (the
    reference of a LoRA run is its base), in the autocast training runs it in (sft_config_kwargs: bf16 or fp16 as
    model.dtype). Returns the training blocks. A base that only accelerate's FSDP2 makes whole is refused."""
    from ftcli.train.preference import attach_sequence_logps
    from ftcli.train.reference import use_stored_reference

    if sharding != "ddp":
        raise UserError(f"training.preference.reference=precomputed needs a whole base per process (training.sharding="
                        f"ddp; this run's is {sharding}): set training.preference.reference=model")
    attach_sequence_logps(base, recipe.training.loss.chunk_tokens)
    half = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(recipe.model.dtype)

    def logps(inputs: dict) -> torch.Tensor:
        with torch.autocast(device.type, dtype=half or torch.bfloat16, enabled=half is not None):
            return base.sequence_logps(**inputs)[0]

    use_stored_reference(session, recipe.model, recipe.training, logps, device)
    session.say(f"{objective_of(recipe.training).label} reference: the base's log-probs, precomputed (no adapter-off "
                "forward)")
    return session.units


def random_init_gpu(recipe: Recipe) -> torch.device | None:
    """Where FSDP's random-init base (kept on the CPU until accelerate shards it) is drawn: this process's GPU
    when the base takes under half its free memory, else None (the CPU). The CPU draws ~0.1B parameters/s
    (minutes for a 13B-parameter base); the GPU draws it in seconds, and the copy to the CPU takes seconds.
    The same seed draws different weights on the GPU and the CPU; <run>/base holds the ones trained on."""
    if not torch.cuda.is_available():
        return None
    from ftcli.train.distributed import local_device
    from ftcli.model.build import DTYPES
    from ftcli.estimate.shape import model_shape

    gpu = local_device()
    shape = model_shape(recipe.model)  # parameter counts from the config, as `ftcli plan` counts them
    need = (shape.total_params + shape.frozen_params) * DTYPES[recipe.model.dtype].itemsize
    free, _ = torch.cuda.mem_get_info(gpu)
    return gpu if need < free / 2 else None


# -------------------------------------------------------------------------------------------- train
def use_ftcli_schedule(trainer, schedule) -> None:
    """The full path's lr schedule (`ftcli.train.schedule.lr_factor`) instead of transformers' own, through
    the Trainer's documented override point `create_scheduler`: the same lr at every step for the same
    recipe (transformers' warmup starts at lr 0 and its cosine/linear decay ignore `min_lr_ratio`)."""
    from torch.optim.lr_scheduler import LambdaLR

    from ftcli.train.schedule import lr_factor

    def create_scheduler(num_training_steps: int, optimizer=None):
        if trainer.lr_scheduler is None:
            trainer.lr_scheduler = LambdaLR(optimizer or trainer.optimizer,
                                            lambda step: lr_factor(step, num_training_steps, schedule))
        return trainer.lr_scheduler

    trainer.create_scheduler = create_scheduler


def build_trainer(recipe: Recipe, model, tokenizer, blocks, args, *, metrics_path: Path | None = None, tracker=None,
                  evaluator=None, run_dir: Path | None = None):
    """SFTTrainer over ftcli's blocks (`training_blocks`) with PEFT, token-normalized loss and ftcli's callbacks (`ftcli.train.lora.callbacks`);
    returns (trainer, step log: `.trained` / `.seen` are the run's tokens, `.eval_callback` the eval's, None
    without recipe.eval). Shared by `train` and benchmarks/lora_gpt_oss_gpu.py."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import SFTTrainer

    from ftcli.estimate.fit import grouped_expert_lora

    with warnings.catch_warnings():  # TRL/PEFT read transformers' deprecated alias; nothing for a user to change
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        trainer = SFTTrainer(model=model, args=args, train_dataset=block_rows(blocks), data_collator=BlockCollator(blocks),
                             processing_class=tokenizer, peft_config=lora_config(recipe.lora, recipe.model, model))
    # PEFT's adapter on the experts, ftcli's unmerged grouped expert GEMMs
    if grouped_expert_lora(recipe.model, recipe.training, recipe.lora):
        from ftcli.model.moe_lora import install_grouped_experts

        grouped = install_grouped_experts(trainer.model)
        if grouped and args.process_index == 0:
            print(f"expert LoRA: grouped, unmerged ({grouped} experts modules, ftcli.model.moe_lora)", flush=True)
    # training.compile: each decoder layer, in place (names unchanged)
    features.prepare_lora(trainer.model, recipe.training)
    if args.process_index == 0:
        for line in features.describe(trainer.model, recipe.training):
            print(line, flush=True)
    if args.fsdp:
        fsdp_on_cpu_processes(trainer, args)
        fp32_loss_and_reduce(trainer)
    normalize_loss_by_tokens(trainer)
    use_objective_loss(trainer, objective_of(recipe.training), recipe.training.loss.chunk_tokens, recipe.training)
    use_ftcli_schedule(trainer, recipe.training.schedule)
    trainer.remove_callback(ProgressCallback)  # (or PrinterCallback with disable_tqdm): StepLog prints instead
    trainer.remove_callback(PrinterCallback)
    evals = None if recipe.eval is None else EvalCallback(recipe, evaluator, tokenizer, run_dir=run_dir,
                                                          metrics_path=metrics_path, tracker=tracker)
    step_log = StepLog(trainer.model, metrics_path=metrics_path, tracker=tracker, eval_callback=evals)
    # ahead of TRL's own (DefaultFlowCallback): step end counts the tokens, then saves by time, then evaluates
    trainer.callback_handler.callbacks[:0] = [cb for cb in (step_log, TimedSave(recipe.training.checkpoint), evals)
                                              if cb is not None]
    trainer.add_callback(Checksums())  # last: after every file of a save is written
    return trainer, step_log


def train(recipe: Recipe, run_dir: Path, resume: str | None) -> None:
    """One LoRA run under torchrun; see the module docstring."""
    from trl import SFTConfig

    from ftcli.train.checkpoint import checkpoint_step, resolve_resume, trl_save_failed
    from ftcli.train.distributed import local_device
    from ftcli.train.metrics import truncate_metrics
    from ftcli.estimate.fit import resolved_sharding
    from ftcli.train.session import RunSession
    from ftcli.artifacts.rundir import METRICS_FILE
    from ftcli.config.safe_files import refuse_links

    run_dir = Path(run_dir)
    if not method_of(recipe.training).writes_adapter:
        raise UserError(f"train_lora got training.method={recipe.training.method}")
    checkpoint = resolve_resume(run_dir, resume, kind="trl")
    device = local_device()
    sharding, why = resolved_sharding(recipe)
    if device.type == "cpu" and recipe.training.sharding == "auto":  # not the recipe's card that `auto` sized for
        why = "training.sharding=auto, on CPU processes"
    if sharding == "fsdp" and device.type == "cuda":  # as `accelerate launch`: from_pretrained reads the base on
        os.environ["ACCELERATE_USE_FSDP"] = "true"     # rank 0 only (CPU processes: every rank reads its small base)
    # also initializes torch.distributed (accelerate: NCCL on GPUs, gloo for CPU processes)
    run_name = recipe.tracking.run_name or recipe.name
    args = SFTConfig(**sft_config_kwargs(recipe.training, recipe.model, run_name, run_dir, sharding),
                     use_cpu=device.type == "cpu")
    if args.process_index == 0:
        for message in ignored_settings(recipe.training, sharding):
            print(f"warning: {message}", flush=True)

    # tracking, tokenizer, data, eval data and run.json: the run session every trainer shares (ftcli.train.session);
    # the step-line callback logs the metrics into its tracker
    say = (lambda line: print(line, flush=True)) if args.process_index == 0 else (lambda line: None)
    session = RunSession.start(recipe, run_dir, rank=args.process_index, world_size=args.world_size, device=device,
                               resume=checkpoint is not None, say=say)
    tracker = session.tracker
    if checkpoint is not None and args.process_index == 0:
        truncate_metrics(run_dir / METRICS_FILE, checkpoint_step(checkpoint))  # those steps are trained again
    step_log = None
    # an error or a stop: the progress bar gives the terminal back, the tracked run ends KILLED / FAILED
    with session.running(cleanup=lambda: step_log is not None and step_log.close()):
        attn = _attn_implementation(recipe, device)
        session.open_data()  # rank 0 fills the caches, then the others open them
        tokenizer, blocks, evaluator = session.tokenizer, require_units(recipe.data, session.units), session.evaluator

        # FSDP: the base stays on the CPU (rank 0's full copy, meta elsewhere) until accelerate shards it
        started = time.perf_counter()
        model = load_base(recipe, run_dir, device if sharding == "ddp" else None, attn, resume=checkpoint is not None)
        if recipe.model.init == "random" and checkpoint is None and args.process_index == 0:
            built = time.perf_counter() - started
            refuse_links([run_dir / "base"])  # the launcher checked; never written through a link
            model.save_pretrained(run_dir / "base")
            tokenizer.save_pretrained(run_dir / "base")
            print(f"random-init base: drawn in {built:.1f} s, saved to {run_dir / 'base'} in "
                  f"{time.perf_counter() - started - built:.1f} s", flush=True)

        pref = recipe.training.preference
        if pref is not None and pref.reference == "precomputed" and objective_of(recipe.training).reference_model:
            blocks = read_stored_reference(recipe, model, session, sharding, device)
        trainer, step_log = build_trainer(recipe, model, tokenizer, blocks, args, metrics_path=run_dir / METRICS_FILE,
                                          tracker=tracker, evaluator=evaluator, run_dir=run_dir)
        if args.process_index == 0:
            trainable, total = trainer.model.get_nb_trainable_parameters()
            print(f"{recipe.name}: LoRA {trainable / 1e6:,.2f}M trainable of {total / 1e6:,.1f}M params, "
                  f"{len(blocks)} blocks ({'packed' if recipe.data.packing.enabled else 'one example each'}), "
                  f"{args.world_size} x {device.type}, base {sharding} ({why}), attention {attn or 'default'}, "
                  f"run dir {run_dir}", flush=True)

        step_log.load(checkpoint)  # the token counts and the evals so far of a resumed run
        stop = StopOnSignal(session)  # SIGTERM / SIGINT: the session decides (ftcli.train.session)
        trainer.add_callback(stop)
        try:
            trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
        except pickle.UnpicklingError as e:  # transformers loads TRL checkpoints with weights_only=True
            reason = (str(e).strip() or type(e).__name__).splitlines()[0]
            raise UserError(f"checkpoint {checkpoint} holds more than tensors and plain data, so it is not loaded "
                            f"(loading could run code: {reason})") from None
        except Exception as e:  # a periodic checkpoint-N save that a full disk stopped: one line, no partial left
            not_saved = trl_save_failed(Path(args.output_dir), trainer.state.global_step, e, run_dir, checkpoint)
            if not_saved is None:
                raise
            raise not_saved from None
        if stop.signum and trainer.state.global_step < trainer.state.max_steps:
            step = trainer.state.global_step
            saved = Path(args.output_dir) / f"checkpoint-{step}"  # TRL saved it at the step end when the session asked
            session.stop(step, stop.signum, lambda save: saved if saved.is_dir() else None)
        finish(recipe, trainer, step_log, session=session, sharding=sharding)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # run.json is written before any rank exits
        # and leave together: a process that exits with the group (and FSDP2's checkpoint threads) still up
        # can abort in C++ teardown ("terminate called without an active exception", seen on gloo)
        torch.distributed.destroy_process_group()


def save_final_adapter(trainer, final: Path, sharding: str) -> None:
    """The adapter + tokenizer + chat template into `final`, written in place with its record last (main process;
    ftcli.artifacts.publish: no rename): a save that an OSError stops (a full disk) leaves no partial `final` and is
    one line (`export_not_written`)."""
    from ftcli.artifacts.publish import begin_export, publish_export, remove_export
    from ftcli.train.checkpoint import WRITE_ERRORS, export_not_written

    main = trainer.args.process_index == 0
    if main:
        begin_export(final)
    try:
        if sharding == "fsdp":  # transformers' save_model writes nothing for SHARDED_STATE_DICT: gathered here
            save_adapter(trainer.model, trainer.processing_class, final)
        else:
            trainer.save_model(str(final))  # main process
    except WRITE_ERRORS as e:
        if main:
            remove_export(final)
        needed = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
        raise export_not_written("the adapter", final, e, needed) from None
    if main:
        publish_export(final)


def finish(recipe: Recipe, trainer, step_log, *, session, sharding: str) -> None:
    """After the last step: the adapter in <run>/final, the best eval's where `eval.export` puts it (the session
    decides: ftcli.train.export), then the run's end (`RunSession.complete`: run.json, the last lines)."""
    from ftcli.artifacts.rundir import FINAL

    evals = step_log.eval_callback
    tracked = evals.evals if evals is not None else None
    best_step = tracked.best_step if tracked is not None and recipe.training.checkpoint.keep_best else None
    # the best adapter is already whole in best/ (EvalCallback.save_best): the session copies it where it goes
    best_model_dir = session.export_models(best_step, trainer.state.global_step,
                                           export_last=lambda out_dir: save_final_adapter(trainer, out_dir, sharding))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    session.complete(steps=trainer.state.global_step, tokens={"trained": step_log.trained, "seen": step_log.seen},
                     final_loss=losses[-1] if losses else None,
                     throughput=step_log.meter.throughput(),  # of this invocation (a resumed run: after the checkpoint)
                     evals=tracked, best_model_dir=best_model_dir,
                     stopped_early=evals.stop_reason if evals is not None else None, model_dir=FINAL,
                     base_path="base" if recipe.model.init == "random" else None)
