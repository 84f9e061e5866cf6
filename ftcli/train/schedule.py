"""The learning-rate schedule both trainers step through: one function, so a recipe's lr at every step is
the same on the full path (FSDP2, a LambdaLR over `lr_factor`) and the LoRA path (TRL; `lora.trainer`
hands the Trainer this schedule instead of transformers' own, whose warmup starts at 0 and whose cosine
and linear decay ignore `min_lr_ratio`)."""

from __future__ import annotations

import math


def lr_factor(step: int, total_steps: int, schedule) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based). Linear warmup to 1 over the warmup
    steps, then: constant; cosine / cosine_with_min_lr (to min_lr_ratio); linear (to min_lr_ratio)."""
    warmup = int(schedule.warmup) if schedule.warmup >= 1 else int(round(schedule.warmup * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    if schedule.name == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule.name.startswith("cosine") else 1 - progress
    return schedule.min_lr_ratio + (1 - schedule.min_lr_ratio) * shape
