"""What a LoRA recipe becomes for TRL and PEFT: the SFTConfig keywords (`sft_config_kwargs`), the LoraConfig
(`lora_config`) and the recipe settings that run differently than written (`ignored_settings`, warned at start).

Pure mappings, tested value by value (tests/unit/train/lora/test_lora_config.py): no I/O and no torch state;
only the installed TrainingArguments' field names decide the checkpointing keyword. `ftcli.train.lora.trainer` hands them to TRL.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from ftcli.config.errors import UserError
from ftcli.config.recipe import LoraConfig as LoraSection
from ftcli.config.recipe import ModelConfig, TrainingConfig

# Vision towers of the VLM classes ftcli knows (kept out of LoRA unless lora.exclude_vision is false).
_VISION_MODULES = ("visual", "vision_tower", "vision_model", "multi_modal_projector")


@functools.cache
def checkpointing_arg() -> str:
    """transformers 5.24 calls it `activation_checkpointing(_kwargs)` and keeps `gradient_checkpointing(_kwargs)`
    as a deprecated alias (with a FutureWarning); older 5.x releases may only know the old name. Use
    the name the installed TrainingArguments defines."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def sft_config_kwargs(training: TrainingConfig, model_cfg: ModelConfig, run_name: str, run_dir: Path,
                      sharding: str = "ddp") -> dict[str, Any]:
    """The SFTConfig for a LoRA recipe's training and model sections (transformers 5 / TRL 1.x names); `run_name` is
    the MLflow run's (`tracking.run_name`, else the recipe's name). Pure: no I/O, no torch state (only the installed
    TrainingArguments' field names decide the checkpointing keyword).

    transformers 5 has no `warmup_ratio`: `warmup_steps` < 1 is read as a fraction of the total steps,
    which is exactly the recipe's convention, so `schedule.warmup` passes through unchanged.

    `sharding` is `training.sharding` resolved (`ftcli.estimate.fit.resolved_sharding`): "fsdp" hands the model to
    accelerate's FSDP2 (`fsdp_config` version 2): every decoder layer (the model's `_no_split_modules`) one
    unit and the root the rest, parameters resharded after forward, so the frozen base lives sharded and is
    gathered one layer at a time; the LoRA weights shard with their layers. Activation checkpointing is
    then FSDP's own (per unit; the TrainingArguments flag would all-gather every layer a second time).
    """
    t = training
    opt, sched, ckpt, ac = t.optimizer, t.schedule, t.checkpoint, t.activation_checkpointing
    ac_kwargs = {"use_reentrant": False, **({"selective": True} if ac == "selective" else {})}
    fsdp = sharding == "fsdp"
    return dict(
        output_dir=str(Path(run_dir) / "checkpoints"), run_name=run_name,
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
        bf16=model_cfg.dtype == "bfloat16", fp16=model_cfg.dtype == "float16",
        **{checkpointing_arg(): ac != "none" and not fsdp,
           f"{checkpointing_arg()}_kwargs": ac_kwargs if ac != "none" and not fsdp else None},
        torch_compile=False,  # training.compile: per decoder layer (ftcli.features.compile), not TRL's whole model
        # DDP: every LoRA parameter gets a gradient on every step
        ddp_find_unused_parameters=False,
        # a kept-MXFP4 base's blocks and scales are buffers, the same on every rank: not re-broadcast every step
        **({"ddp_broadcast_buffers": False} if model_cfg.quantization == "mxfp4" else {}),
        # FSDP2 (training.sharding: fsdp): the base sharded; checkpoints are per-rank shards (DCP)
        **({"fsdp": True, "fsdp_config": {"version": 2, "reshard_after_forward": True,
                                          "activation_checkpointing": ac != "none",
                                          "cpu_ram_efficient_loading": True,  # rank 0 reads the base, then shards
                                          "state_dict_type": "SHARDED_STATE_DICT"}} if fsdp else {}),
        # loss: sum of token losses / trained tokens of the whole step, across accumulation and ranks
        average_tokens_across_devices=True, loss_type="nll",
        router_aux_loss_coef=0.0,  # as the published gpt-oss-20b LoRA example: no MoE load-balancing loss
        # data: ftcli tokenizes, masks and packs; TRL must not touch the rows
        dataset_kwargs={"skip_prepare_dataset": True}, packing=False, padding_free=False, max_length=None,
        remove_unused_columns=False, label_names=["labels"], dataloader_num_workers=0,
        # logging, checkpoints, tracking
        logging_steps=t.log_every, logging_first_step=True,
        disable_tqdm=True,  # ftcli's progress bar and step line instead (lora.callbacks.StepLog)
        save_strategy="steps" if ckpt.enabled and ckpt.every_steps else "no", save_steps=ckpt.every_steps or 500,
        save_total_limit=ckpt.keep_last,
        report_to="none",  # (published: "mlflow") ftcli's tracker logs every step line, synchronously, like the full path
    )


def lora_config(lora: LoraSection, model_cfg: ModelConfig, model):
    """PEFT LoraConfig from the recipe's lora and model sections: target modules, expert parameters, vision tower
    excluded on VLM classes of `model`."""
    from peft import LoraConfig
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
    if lora.exclude_vision and model_cfg.model_class == "image_text_to_text":
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
        revision=model_cfg.revision, task_type="CAUSAL_LM",
    )


def ignored_settings(training: TrainingConfig, sharding: str = "ddp") -> list[str]:
    """Recipe settings that run differently than written on the LoRA path (warned at start). Full SFT's own keys
    never get here: a LoRA recipe that sets one is refused at load (ftcli.config.recipe.LoraTraining)."""
    t, out = training, []
    if sharding == "fsdp" and t.activation_checkpointing == "selective":
        out.append("training.activation_checkpointing=selective runs as full with training.sharding=fsdp "
                   "(FSDP2 checkpoints whole units)")
    return out
