"""The TRL callbacks of the LoRA path: what TRL does not know about ftcli, one concern each
(`ftcli.train.lora.trainer.build_trainer` installs them at the front of TRL's list, in this order).

    StepLog        ftcli's step line instead of TRL's dict dump (`ftcli.train.metrics`: printed, appended to
                   <run>/metrics.jsonl and logged to MLflow by rank 0), and the run's trained and seen tokens
    TimedSave      training.checkpoint.every_minutes (`every_steps` is TRL's own `save_steps`)
    EvalCallback   recipe.eval through `ftcli.train.evaluate`, the functions the full loop calls: the eval loss in
                   the step line, the best adapter in <run>/best, early stopping, greedy samples
    StopOnSignal   SIGTERM / SIGINT (the run session's `stop_signal`): checkpoint and stop at the end of the step
    Checksums      after every save (last of all): each file's size and CRC32s in the checkpoint-N
                   (`ftcli.train.checkpoint.record_trl_checksums`), checked before a resume

Every checkpoint-N carries what TRL's own checkpoint lacks: the token counts (TOKENS_FILE) and the evals so
far (EVALS_FILE), which `load` reads back on resume. With the base sharded by FSDP2 (training.sharding=fsdp)
the model is accelerate's FSDP root: the eval loss and the samples are forwards through it on every rank
(`ftcli.train.evaluate`), and the best adapter is gathered whole before rank 0 writes it (`save_adapter`).
"""

from __future__ import annotations

import json
import time
import types
from pathlib import Path

import torch
from transformers import TrainerCallback

from ftcli.train.checkpoint import CheckpointSchedule, record_trl_checksums
from ftcli.train.distributed import all_reduce, local_device, rank0_decides, reshard_all
from ftcli.train.evaluate import EvalTracker, evaluate_now, publish_eval, sample_now, samples_due
from ftcli.artifacts.publish import begin_export, publish_export
from ftcli.train.preference import reduced_means
from ftcli.artifacts.rundir import BEST
from ftcli.config.safe_files import write_atomic

TOKENS_FILE = "ftcli_tokens.json"  # in every checkpoint-N: the run's token counts, so a resume keeps counting
EVALS_FILE = "ftcli_evals.json"  # in every checkpoint-N: the evals so far (best step, early stopping)


def _say(line: str) -> None:
    print(line, flush=True)


def _checkpoint_dir(args, state) -> Path | None:
    """Rank 0 after TRL's save: the checkpoint-N it has just written (None elsewhere)."""
    ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
    return ckpt if state.is_world_process_zero and ckpt.is_dir() else None


def _read_json(checkpoint: Path | None, name: str):
    path = Path(checkpoint or "") / name
    return json.loads(path.read_text()) if checkpoint and path.is_file() else None


def active_params(model) -> int:
    """Non-embedding parameters one token goes through: MoE experts count top-k / num_experts."""
    from ftcli.model.build import count_params, text_config

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    _, non_embedding = count_params(base)
    cfg = text_config(base.config)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)  # gpt-oss | Qwen3-MoE
    k = getattr(cfg, "num_experts_per_tok", None)
    if experts and k:
        expert_params = sum(p.numel() for n, p in base.named_parameters() if ".experts." in n and "lora_" not in n)
        non_embedding -= expert_params - expert_params * k // experts
    return non_embedding


def save_adapter(model, tokenizer, out: Path) -> None:
    """The adapter (+ tokenizer and chat template) in PEFT format, written once by rank 0. An FSDP2-sharded model
    first gathers its trainable parameters whole on every rank (torch's `get_model_state_dict`, collective; the
    frozen base is never gathered): every rank calls this then. Otherwise only rank 0 needs to."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    state = None
    if isinstance(model, FSDPModule):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, ignore_frozen_params=True))
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        model.save_pretrained(str(out), state_dict=state)
        tokenizer.save_pretrained(str(out))


def attach_loss_sum(model, chunk_tokens: int, objective=None, training=None) -> None:
    """The objective's summed loss on the PEFT model (`ftcli.objectives`; SFT: the base's summed token CE,
    `ftcli.train.loss.attach_loss`, the LoRA layers included), the one loss of a LoRA run, reached two ways:

        model.loss_sum(**inputs)                 eval (ftcli.train.evaluate), as the full loop's model has it:
                                                 registered as an FSDP forward method, so that a root sharded by
                                                 accelerate's FSDP2 gathers its own parameters around it
        model(**inputs, ftcli_loss_sum=True)     training (`ftcli.train.lora.trainer.use_objective_loss`): through
                                                 the model's call (`route_loss_through_forward`, installed before
                                                 accelerate prepares the model, so that its autocast wraps it), so
                                                 that DDP's forward (its gradient hooks and no_sync) and FSDP2's
                                                 forward hooks run as for TRL's own loss

    accelerate makes the LM head an FSDP unit of its own, whose weight the loss reads without calling its forward:
    gathered around the call (`FSDPModule.unshard` / `reshard`). Attaching again is a no-op. A preference objective
    (`training.preference` set) gets the pair loss instead (ftcli.train.preference.attach_preference_loss), its
    reference the same model with the adapter off (PEFT's `disable_adapter`, no copy)."""
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    from ftcli.objectives import OBJECTIVES
    from ftcli.train.loss import attach_loss

    if getattr(model, "_ftcli_loss_inner", None) is not None:
        return
    objective = objective or OBJECTIVES["sft"]
    base = model.get_base_model()
    if training is not None and training.preference is not None:
        from ftcli.train.preference import attach_preference_loss, preference_config

        attach_preference_loss(base, preference_config(training), chunk_tokens, adapter_off=model.disable_adapter)
    else:
        attach_loss(base, "chunked", chunk_tokens)
    head = base.lm_head if isinstance(base.lm_head, FSDPModule) else None

    def gathered(**inputs):
        if head is None:
            return base.loss_sum(**inputs)
        head.unshard()
        try:
            return base.loss_sum(**inputs)
        finally:
            head.reshard()

    inner = types.SimpleNamespace(loss_sum=gathered)  # what the objective's loss_sum calls (not an FSDP method)

    def loss_sum(self, **inputs):
        return objective.loss_sum(inner, inputs)

    model._ftcli_loss_inner = inner  # what the routed forward calls
    model.loss_sum = types.MethodType(loss_sum, model)
    register_fsdp_forward_method(model, "loss_sum")


def route_loss_through_forward(model, objective) -> None:
    """`model(**inputs, ftcli_loss_sum=True)` -> the objective's summed loss (`attach_loss_sum` gives it, after
    accelerate has prepared the model); any other call is the model's own forward. Installed before accelerate
    prepares the model, which wraps `forward` in its mixed-precision autocast: the loss then runs in the same
    autocast as TRL's own did (outside it, DDP would apply the float32 adapters to bf16 activations in float32)."""
    plain_forward = model.forward

    def forward(self, *args, ftcli_loss_sum: bool = False, **kwargs):
        if ftcli_loss_sum:
            return objective.loss_sum(self._ftcli_loss_inner, kwargs)
        return plain_forward(*args, **kwargs)

    model.forward = types.MethodType(forward, model)


class ObjectiveLoss(TrainerCallback):
    """Attaches the objective's loss (`attach_loss_sum`) to the prepared model before the first step (after
    accelerate has sharded it: its LM head may then be a unit of its own)."""

    def __init__(self, chunk_tokens: int, objective, training=None) -> None:
        self.chunk_tokens, self.objective, self.training = chunk_tokens, objective, training

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        attach_loss_sum(model, self.chunk_tokens, self.objective, self.training)


class StepLog(TrainerCallback):
    """The full path's progress bar and step line (rank 0; `ftcli.train.metrics.step_progress`, `log_step`) in place
    of TRL's tqdm bar and dict dumps, and the run's trained and seen tokens summed over ranks: a
    forward pre-hook counts what this rank feeds the model (`ftcli.train.loss.count_trained_tokens`; batches the
    data loader prefetches but never trains on are not counted), each step end all-reduces the step's two
    numbers; `.trained` / `.seen` are the totals, carried by every checkpoint. `eval_callback`: the EvalCallback
    whose eval of a step goes into that step's line."""

    def __init__(self, model, *, metrics_path: Path | None = None, tracker=None,
                 eval_callback: EvalCallback | None = None):
        super().__init__()
        self.model, self.metrics_path, self.tracker, self.eval_callback = model, metrics_path, tracker, eval_callback
        self.device = local_device()  # where the model trains (an FSDP base is still on the CPU here)
        self.trained = self.seen = 0
        self._pending = [0, 0]
        self.meter = None
        self.progress = self.task = None
        model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        if module.training and kwargs.get("labels") is not None:
            from ftcli.train.loss import count_trained_tokens

            self._pending[0] += count_trained_tokens(kwargs["labels"])
            self._pending[1] += kwargs["input_ids"].numel()

    def load(self, checkpoint: Path | None) -> None:
        """A resumed run's state from its checkpoint-N: the token counts, and the evals so far."""
        saved = _read_json(checkpoint, TOKENS_FILE)
        if saved:
            self.trained, self.seen = saved["trained"], saved["seen"]
        if self.eval_callback is not None:
            self.eval_callback.load(checkpoint)

    def on_train_begin(self, args, state, control, **kwargs):
        from ftcli.train.metrics import StepMetrics, step_progress

        self.meter = StepMetrics(4 * active_params(self.model), self.device, args.world_size)  # LoRA: no weight grads
        if state.is_world_process_zero:
            self.progress, self.task = step_progress(state.max_steps, state.global_step)
            self.progress.start()
        self.step_start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.update(self.task, completed=state.global_step)
        step = all_reduce(self._pending, device=self.device) if torch.distributed.is_initialized() else self._pending
        self.trained, self.seen, self._pending = self.trained + int(step[0]), self.seen + int(step[1]), [0, 0]
        now = time.perf_counter()
        self.meter.step_done(int(step[1]), now - self.step_start)
        self.step_start = now

    def on_save(self, args, state, control, **kwargs):
        if (ckpt := _checkpoint_dir(args, state)) is not None:
            write_atomic(ckpt / TOKENS_FILE, json.dumps({"trained": self.trained, "seen": self.seen}))

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        """Stop the progress bar (the end of training, or an error: the terminal gets its cursor back)."""
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        from ftcli.train.metrics import log_step

        if logs is None or "loss" not in logs:  # TRL's end-of-training dict: ftcli's own `done:` line says it
            return
        m = self.meter.line(step=state.global_step, loss=logs["loss"], grad_norm=logs.get("grad_norm") or 0.0,
                            lr=logs.get("learning_rate", 0.0), tokens_trained=self.trained, tokens_seen=self.seen)
        m.update(reduced_means(self.model, self.device))  # preference: TRL's metrics since the last line
        if self.eval_callback is not None:
            m.update(self.eval_callback.take_metrics(state.global_step))
        logs.update({k: v for k, v in m.items() if k not in ("step", "loss", "grad_norm", "lr", "mem_unit")
                     and v is not None})
        if state.is_world_process_zero:
            say = self.progress.console.print if self.progress is not None else _say
            log_step(m, state.max_steps, say=say, metrics_path=self.metrics_path, tracker=self.tracker)


class TimedSave(TrainerCallback):
    """training.checkpoint.every_minutes (`ftcli.train.checkpoint.CheckpointSchedule`): TRL saves at the end of the
    step where rank 0's clock says so, every rank at the same step (`ftcli.train.distributed.rank0_decides`)."""

    def __init__(self, checkpoint_cfg):
        self.schedule = CheckpointSchedule.from_config(checkpoint_cfg)
        self.by_time = self.schedule.enabled and self.schedule.every_minutes is not None
        self.device = local_device()

    def on_step_end(self, args, state, control, **kwargs):
        if self.by_time and rank0_decides(self.schedule.time_due(), self.device):
            control.should_save = True

    def on_save(self, args, state, control, **kwargs):
        self.schedule.mark_saved()


class EvalCallback(TrainerCallback):
    """recipe.eval (`ftcli.train.evaluate`): at step 0 if asked, every eval.every_steps / every_minutes and at the last
    step, its numbers in that step's line (TRL is told to log it); the best adapter kept in <run>/best
    (keep_best), early stopping (TRL is told to stop, with a final checkpoint), greedy samples. Every rank
    evaluates its share and generates (collective under FSDP2); rank 0 prints and writes."""

    def __init__(self, recipe, evaluator, tokenizer, *, run_dir: Path | None = None,
                 metrics_path: Path | None = None, tracker=None):
        self.cfg, self.evaluator, self.tokenizer = recipe.eval, evaluator, tokenizer
        self.run_dir, self.metrics_path, self.tracker = run_dir, metrics_path, tracker
        self.keep_best, self.save_on_stop = recipe.training.checkpoint.keep_best, recipe.training.checkpoint.enabled
        self.chunk_tokens, self.training = recipe.training.loss.chunk_tokens, recipe.training
        self.has_eval = evaluator is not None and bool(evaluator)
        self.schedule = CheckpointSchedule(self.has_eval, self.cfg.every_steps, self.cfg.every_minutes)
        self.evals = EvalTracker(self.cfg)
        self.device = local_device()
        self.model, self.is_main = None, True
        self.pending = None  # the eval of this step, for its step line
        self.stop_reason: str | None = None

    def load(self, checkpoint: Path | None) -> None:
        self.evals.load_state_dict(_read_json(checkpoint, EVALS_FILE))

    def take_metrics(self, step: int) -> dict:
        """The metrics of this step's eval for its step line ({} without one); the eval is then consumed."""
        pending, self.pending = self.pending, None
        return pending.metrics() if pending is not None and pending.step == step else {}

    def evaluate(self, step: int):
        result, new_best = evaluate_now(self.evaluator, self.evals, self.model, step,
                                        say=_say if self.is_main else None)
        self.schedule.mark_saved()
        if new_best and self.keep_best:
            self.save_best()
        self.stop_reason = self.evals.stop_reason()
        reshard_all(self.model)
        return result

    def save_best(self) -> None:
        """The adapter of the best eval so far into <run>/best (rank 0; in place, its record last:
        ftcli.artifacts.publish)."""
        best = self.run_dir / BEST
        if self.is_main:
            begin_export(best)
        save_adapter(self.model, self.tokenizer, best)
        if self.is_main:
            publish_export(best)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.model, self.is_main = model, args.process_index == 0  # the prepared model: FSDP's root when sharded
        if not self.has_eval:
            return
        # (or ObjectiveLoss did: the same loss, the pair loss for a preference objective)
        attach_loss_sum(model, self.chunk_tokens, self.evaluator.objective, self.training)
        if self.cfg.at_start and state.global_step == 0:
            result = self.evaluate(0)
            if self.is_main:
                publish_eval(result, say=_say, metrics_path=self.metrics_path, tracker=self.tracker)

    def on_step_end(self, args, state, control, **kwargs):
        step, last = state.global_step, state.global_step >= state.max_steps
        by_time = self.schedule.every_minutes is not None and rank0_decides(self.schedule.time_due(), self.device)
        evaluated = self.has_eval and (self.schedule.due(step, by_time) or last)
        if evaluated:
            self.pending = self.evaluate(step)
            control.should_log = True  # this step's line carries the eval
            if self.stop_reason:
                control.should_training_stop = True
                control.should_save = self.save_on_stop  # stop with a final checkpoint
                if self.is_main:
                    _say(self.stop_reason)
        if samples_due(self.cfg, step, len(self.evals.history), evaluated, last or bool(self.stop_reason)):
            sample_now(self.model, self.tokenizer, self.cfg, step, run_dir=self.run_dir, is_main=self.is_main,
                       tracker=self.tracker)
            reshard_all(self.model)

    def on_save(self, args, state, control, **kwargs):
        if (ckpt := _checkpoint_dir(args, state)) is not None:
            write_atomic(ckpt / EVALS_FILE, json.dumps(self.evals.state_dict()))


class StopOnSignal(TrainerCallback):
    """SIGTERM / SIGINT, as the run session decides (`ftcli.train.session.RunSession.stop_signal`): at the end of the
    step in progress every rank agrees on the flag, TRL saves checkpoint-N (`checkpoint_on_stop`) and stops; `train`
    then hands the stop to the session (`RunSession.stop`). `.signum`: the agreed signal (0: none)."""

    def __init__(self, session) -> None:
        self.session, self.signum = session, 0

    def on_step_end(self, args, state, control, **kwargs):
        self.signum = self.session.stop_signal(args.device)
        if self.signum:
            control.should_save = control.should_save or self.session.checkpoint_on_stop
            control.should_training_stop = True


class Checksums(TrainerCallback):
    """After TRL's save of checkpoint-N and ftcli's own files in it (installed after the other callbacks), every
    rank takes part in recording each file's size and CRC32s there (`record_trl_checksums`, collective)."""

    def on_save(self, args, state, control, **kwargs):
        record_trl_checksums(Path(args.output_dir) / f"checkpoint-{state.global_step}")
