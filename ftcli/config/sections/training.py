"""The `training` section: `FullTraining` (the FSDP2 loop) or `LoraTraining` (TRL + PEFT), picked by
`training.method`; what both read lives in `_Training` (the objective and its preference knobs, steps, optimizer,
schedule, loss, checkpoints). The dump order is the schema's (`training_keys`): a new key reaches <run>/recipe.yaml
and the rendered workload without being listed anywhere."""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from ftcli.config.sections.base import Section


class OptimizerConfig(Section):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(1e-5, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(0.0, ge=0)
    eps: float = Field(1e-8, gt=0)
    fused: bool = True


class ScheduleConfig(Section):
    name: Literal["constant", "cosine", "cosine_with_min_lr", "linear"] = "constant"
    warmup: float = Field(0.0, ge=0, description="<1: fraction of total steps; >=1: number of steps.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1)


class PrecisionConfig(Section):
    quiet_defaults: ClassVar[dict[str, Any]] = {"fp8": False, "fp8_recipe": "tensorwise"}
    param_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    reduce_dtype: Literal["bfloat16", "float32"] = "float32"
    master_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="bfloat16: what the published Databricks qwen-b300 example did (most small updates round away)."
    )
    fp8: bool = Field(
        False, description="Full SFT: the decoder layers' large linears run their GEMMs in float8 (torchao float8 "
        "training, dynamic tensorwise scales; needs torchao and a GPU of compute capability >= 8.9). The LM "
        "head, small projections and the master weights stay as they are (ftcli/features/float8.py)."
    )
    fp8_recipe: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise", description="torchao's float8 scaling with fp8: tensorwise (one scale per tensor, fastest) or "
        "rowwise (one scale per row: on an outlier model its gradient norms stay closer to bf16's, ~7% slower per step; BENCHMARKS.md 'fp8 on pretrained-like weights')."
    )


class CheckpointConfig(Section):
    quiet_defaults: ClassVar[dict[str, Any]] = {"keep_best": False}
    enabled: bool = True
    every_steps: int | None = Field(None, ge=1)
    every_minutes: float | None = Field(None, gt=0)
    keep_last: int = Field(2, ge=1)
    save_final_hf: bool = Field(True, description="Write a Hugging Face checkpoint at the end.")
    keep_best: bool = Field(
        False, description="Keep the checkpoint of the best eval loss beside the last keep_last (needs eval data)."
    )


class LossConfig(Section):
    impl: Literal["chunked", "chunked_fwd_grad", "full", "liger"] = Field(
        "chunked", description="chunked: never materializes full fp32 logits; chunked_fwd_grad: the same chunks with "
        "their gradients made in forward (no recompute: one LM-head GEMM less); full: full-vocabulary logits (the "
        "published examples' loss)."
    )
    chunk_tokens: int = Field(4096, ge=1)


PREFERENCE_OBJECTIVES = ("dpo", "ipo", "simpo", "orpo")  # ftcli/objectives/preference.py


# context-parallel slices are whole gated-delta chunks: ftcli.data.collate.FLA_CHUNK (that module imports torch)
CP_SLICE_MULTIPLE = 64


class PreferenceSection(Section):
    """The knobs of the preference objectives (ftcli/objectives/preference.py, ftcli/train/preference.py)."""

    beta: float = Field(0.1, gt=0, description="dpo/ipo: the KL strength (ipo: its regularization tau); simpo: "
                        "the reward scale.")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="dpo and simpo: the share of pairs assumed "
                                   "flipped (conservative DPO).")
    simpo_gamma: float = Field(0.5, ge=0, description="simpo: the target reward margin.")
    orpo_lambda: float = Field(0.1, gt=0, description="orpo: the weight of the odds-ratio term beside the SFT term.")
    reference: Literal["model", "precomputed"] = Field(
        "model", description="dpo/ipo: where the reference's log-probs come from. model: a frozen copy of the "
        "starting model beside the policy (method full) or the base with the adapter off (lora), one more forward "
        "per block; precomputed: one pass of the starting model (lora: the base, training.sharding=ddp) over the "
        "packed blocks before step 1, stored beside the pack cache (keyed by the blocks and the reference model), "
        "then no second model and no reference forward.")


class _Training(Section):
    """What both trainers read. `training` is `FullTraining | LoraTraining`, picked by `method`. A key of the other
    method's section is refused with one line naming the method it belongs to (`format_validation_error`), except
    at its default: dumps write every key of both (so recipe.yaml and rendered workloads stay as they were, and a
    dump loads again), and loading drops them there."""

    quiet_defaults: ClassVar[dict[str, Any]] = {"objective": "sft", "preference": None}
    other_method: ClassVar[str] = ""  # the method whose keys `other_keys` are
    other_keys: ClassVar[tuple[str, ...]] = ()

    # declared here first so that every dump starts with them (each method's class narrows `method` to its name)
    method: str = "full"
    objective: Literal["sft", "dpo", "ipo", "simpo", "orpo"] = Field(
        "sft", description="What is optimized (ftcli/objectives/): sft, next-token cross-entropy on the trained "
        "tokens; dpo, ipo (against a reference model), simpo, orpo (reference-free) on preference pairs "
        "(training.preference). Separate from training.method (full | lora: how the parameters train and what "
        "the run writes).")
    preference: PreferenceSection | None = Field(
        None, description="The preference objectives' knobs (set for dpo, ipo, simpo, orpo; absent for sft).")
    epochs: float = Field(1.0, gt=0, le=100_000)
    max_steps: int | None = Field(None, ge=1)
    grad_accum: int = Field(1, ge=1, description="Micro-batches (blocks) per optimizer step per rank.")
    per_device_batch: int = Field(1, ge=1)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    grad_clip: float | None = Field(1.0, gt=0, description="Max grad norm; null disables clipping.")
    activation_checkpointing: Literal["none", "full", "selective"] = "full"
    loss: LossConfig = Field(default_factory=LossConfig)
    seed: int = 0
    log_every: int = Field(1, ge=1)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    max_bad_steps: int = Field(3, ge=1, description="Consecutive non-finite steps before the run stops.")
    cpu_processes: int = Field(2, ge=1, description="torchrun processes on a machine without GPUs.")

    @classmethod
    def _other(cls) -> type[_Training]:
        return TRAINING_BY_METHOD[cls.other_method]

    @classmethod
    def other_method_problem(cls, path: str, key: str) -> str:
        """The line for `key`, one of the other method's keys, given in this method's section (at `path`)."""
        default = cls._other().model_fields[key].get_default(call_default_factory=True)
        # the --set value that leaves it at its default
        reset = "{}" if isinstance(default, BaseModel) else default if isinstance(default, str) else json.dumps(default)
        return (f"{path} belongs to training.method={cls.other_method} (this recipe's is "
                f"{cls.model_fields['method'].default}): leave it out (switching a recipe's method with --set: also "
                f"--set {path}={reset})")

    @model_validator(mode="after")
    def _preference_knobs(self) -> _Training:
        pairs = self.objective in PREFERENCE_OBJECTIVES
        if pairs and self.preference is None:
            self.preference = PreferenceSection()
        if not pairs and self.preference is not None:
            raise ValueError(f"training.preference applies to the preference objectives "
                             f"({', '.join(PREFERENCE_OBJECTIVES)}); training.objective is {self.objective}")
        if pairs and self.loss.impl != "chunked":
            raise ValueError(f"training.loss.impl={self.loss.impl} is SFT's token loss; the preference objectives' "
                             "log-probs are chunked (training.loss.chunk_tokens): leave training.loss.impl out")
        return self

    @model_validator(mode="before")
    @classmethod
    def _other_keys_at_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if k not in cls.other_keys or not cls._other().holds_default(k, v)}

    @classmethod
    def holds_default(cls, key: str, value: Any) -> bool:
        """Whether `value` given for this section's `key` is what leaving the key out gives."""
        default = cls.model_fields[key].get_default(call_default_factory=True)
        try:
            given = cls.model_validate({"method": cls.model_fields["method"].default, key: value})
        except ValidationError:
            return False
        return getattr(given, key) == default

    @model_serializer(mode="wrap")
    def _dump(self, handler, info):
        out = self._without_quiet_defaults(handler(self))
        other = self._other()
        for key in self.other_keys:
            default = other.model_fields[key].get_default(call_default_factory=True)
            out[key] = default.model_dump(mode=info.mode) if isinstance(default, BaseModel) else default
        out = other._without_quiet_defaults(out)
        return {k: out[k] for k in training_keys() if k in out}


class FullTraining(_Training):
    """Full-parameter SFT (ftcli.train.full: the FSDP2 loop)."""

    quiet_defaults: ClassVar[dict[str, Any]] = {**_Training.quiet_defaults, "fused_ops": [], "context_parallel": 1,
                                                "context_parallel_balance": False}
    other_method: ClassVar[str] = "lora"
    other_keys: ClassVar[tuple[str, ...]] = ("sharding",)
    method: Literal["full"] = "full"
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    activation_checkpointing_keep: int = Field(
        0, ge=0, description="With full checkpointing: keep the activations of this many decoder layers (the "
        "last ones) instead of recomputing them; spare memory for speed (benchmarks/memory_model.py says how "
        "many fit per card)."
    )
    compile: bool | Literal["regions"] = Field(
        False, description="true: torch.compile each decoder layer whole; regions: compile only the parts of each "
        "layer around its packed kernels (norms, the dense MLP, float8 linears), which a graph break in the "
        "gated-delta or attention kernel cannot push back to eager (ftcli/features/compile.py)."
    )
    fused_ops: list[Literal["rms_norm", "swiglu", "gated_norm"]] = Field(
        default_factory=list, description="Full SFT on CUDA: fused Triton kernels for Qwen3.5's decoder norms "
        "(rms_norm, liger-kernel), MLP activation (swiglu, liger-kernel) and gated-delta output norm "
        "(gated_norm, fla); same parameters and checkpoints (ftcli/features/fused_ops.py)."
    )
    context_parallel: int = Field(
        1, ge=1, description="Ranks that share each packed block, each training on a contiguous slice of "
        "block_len / N tokens (attention keys gathered, the gated-delta state and the conv halo passed across the "
        "slices: ftcli/model/kernels/cp.py); blocks per step = ranks / N x grad_accum. `ftcli plan` says which N "
        "fits a block length."
    )
    context_parallel_balance: bool = Field(
        False, description="With context_parallel N: cut each block into 2N chunks, rank r holding chunks r and "
        "2N-1-r (zigzag), so every rank does the same causal attention work; block_len must be a multiple of "
        "2N x 64 (benchmarks/cp_balance.py prints the per-rank FLOPs either way)."
    )

    @field_validator("method", mode="before")
    @classmethod
    def _known_method(cls, value: Any) -> Any:
        if value not in ("full", "lora"):
            raise ValueError("Input should be 'full' or 'lora'")
        return value

    @model_validator(mode="after")
    def _keep_needs_full(self) -> FullTraining:
        if self.activation_checkpointing_keep and self.activation_checkpointing != "full":
            raise ValueError("activation_checkpointing_keep applies to activation_checkpointing=full only")
        return self


class LoraTraining(_Training):
    """LoRA through TRL + PEFT (ftcli.train.lora.trainer): the base frozen in model.dtype, adapters in float32."""

    other_method: ClassVar[str] = "full"
    other_keys: ClassVar[tuple[str, ...]] = ("precision", "activation_checkpointing_keep", "fused_ops",
                                             "context_parallel", "context_parallel_balance")
    method: Literal["lora"] = "lora"
    compile: bool | Literal["regions"] = Field(
        False, description="true: torch.compile each decoder layer whole (LoRA linears, attention, router and "
        "experts in one graph); regions: only the LoRA linears, norms and MoE MLP of each layer "
        "(ftcli/features/compile.py)."
    )
    sharding: Literal["auto", "ddp", "fsdp"] = Field(
        "auto", description="LoRA: ddp keeps the whole frozen base on every GPU, fsdp shards it (FSDP2); auto: "
        "ddp where `ftcli plan` says it fits the recipe's accelerator, else fsdp. Full SFT always shards."
    )

    @field_validator("loss")
    @classmethod
    def _trl_loss(cls, value: LossConfig) -> LossConfig:
        if value.impl != "chunked":
            raise ValueError(f"impl={value.impl} belongs to training.method=full; LoRA's loss is the chunked one "
                             "(ftcli's, as the eval's): leave training.loss.impl out")
        return value


TRAINING_BY_METHOD: dict[str, type[_Training]] = {"full": FullTraining, "lora": LoraTraining}


def training_keys() -> tuple[str, ...]:
    """The keys of `training` in the order dumps write them (recipe.yaml, rendered workloads, `recipes show`): taken
    from the schema, so a new key is dumped without being listed anywhere: the keys both methods share in their
    declaration order (`_Training`'s), then each method's own keys (full's, then lora's)."""
    return tuple(dict.fromkeys(k for cls in TRAINING_BY_METHOD.values() for k in cls.model_fields))


def _training_method(value: Any) -> str:
    method = value.get("method", "full") if isinstance(value, dict) else getattr(value, "method", "full")
    return "lora" if method == "lora" else "full"  # an unknown method: FullTraining says which are known


TrainingConfig = Annotated[
    Annotated[FullTraining, Tag("full")] | Annotated[LoraTraining, Tag("lora")], Discriminator(_training_method)
]
