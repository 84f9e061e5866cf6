"""The `lora` section: the adapters' rank, scale, dropout and targets (read when training.method is lora)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from ftcli.config.sections.base import Section


class LoraConfig(Section):
    quiet_defaults: ClassVar[dict[str, Any]] = {"experts": "grouped"}
    r: int = Field(8, ge=1)
    alpha: int = Field(16, ge=1)
    dropout: float = Field(0.05, ge=0, lt=1)
    bias: Literal["none", "all", "lora_only"] = "none"
    target_modules: str | list[str] = "all-linear"
    target_parameters: list[str] = Field(default_factory=list, description="3-D params, e.g. MoE experts.")
    experts: Literal["grouped", "peft"] = Field(
        "grouped", description="LoRA on MoE expert parameters (gpt-oss, Qwen3-MoE): grouped (unmerged x·W + s·(x·A)·B over tokens "
        "grouped by expert, no base gradient: ftcli.model.moe_lora) or peft (PEFT's ParamWrapper, W + s·A·B "
        "folded every forward).")
    exclude_vision: bool = Field(True, description="Keep LoRA off the vision tower of VLM classes.")
