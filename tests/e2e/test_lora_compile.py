"""`training.compile` on the LoRA path (ftcli.features.compile.prepare_lora): the decoder layers compiled in place
train exactly as eager ones and save the same adapter."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open

from _lora_common import packed_row, tiny_recipe


def _train(tmp_path, compile_setting: str):
    """Two optimizer steps of the gpt-oss-h100 LoRA (all-linear, dropout 0.05, experts frozen) on the tiny gpt-oss;
    returns (losses, adapter state dict, the saved adapter's tensor names)."""
    from trl import SFTConfig
    from transformers import AutoTokenizer

    from ftcli.config.recipe import resolve_path
    from ftcli.features.compile import compile_regions
    from ftcli.model.build import decoder_layers, load_model
    from ftcli.train.lora.trainer import build_trainer, sft_config_kwargs

    recipe = tiny_recipe("lora.target_parameters=[]", "lora.dropout=0.05", f"training.compile={compile_setting}",
                         "tracking.enabled=false", "training.checkpoint.enabled=false", "training.max_steps=2",
                         "eval=null", "model.config_overrides.num_hidden_layers=1",
                         "model.config_overrides.layer_types=[sliding_attention]")  # one layer: fewer graphs to build
    rng = np.random.default_rng(0)
    rows = [packed_row(rng, [70, 58], 0.5) for _ in range(2)]  # the same segment and trained counts: no recompile
    kwargs = sft_config_kwargs(recipe.training, recipe.model, recipe.name, tmp_path)
    kwargs.update(disable_tqdm=True, use_cpu=True, logging_steps=1)
    torch.manual_seed(0)
    model = load_model(recipe.model, attn_implementation="ftcli_eager_segments")
    tok = AutoTokenizer.from_pretrained(resolve_path(recipe.model.tokenizer))
    torch.manual_seed(0)
    trainer, _ = build_trainer(recipe, model, tok, rows, SFTConfig(**kwargs))
    trainer.train()
    trainer.save_model(str(tmp_path / "adapter"))
    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "pt") as f:
        saved = sorted(f.keys())
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    adapter = {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if "lora_" in k}
    return losses, adapter, saved, compile_regions(decoder_layers(trainer.model)[0], lora=True)


@pytest.mark.parametrize("setting", ["true", "regions"])
def test_compiled_lora_layers_train_as_eager(tmp_path, monkeypatch, setting):
    """float32 on CPU: the losses of 2 steps within 1e-5 (relative) of eager, the adapter weights after them within
    1e-5, and the same parameter and saved-adapter names; the 0.05 dropout of gpt-oss-h100 is part of the check.

    The graphs are dynamo's and AOT autograd's (what ftcli's placement decides: where the layers break, what is
    traced, the backward) run by the `aot_eager` backend: inductor's first C++ build costs 40-50 s on 2 cores
    (with inductor and `fallback_random` this test passed too, 2026-12-02)."""
    from ftcli.model.kernels import install_backends, Backend

    compile_module, compiled = torch.nn.Module.compile, []

    def compile_aot_eager(self, **kw):
        compiled.append(type(self).__name__)
        compile_module(self, backend="aot_eager", **kw)

    monkeypatch.setattr(torch.nn.Module, "compile", compile_aot_eager)
    install_backends("gpt_oss", [Backend("attention", "eager_segments", "CPU")])
    eager_losses, eager_adapter, eager_saved, _ = _train(tmp_path / "eager", "false")
    torch._dynamo.reset()
    compiled_losses, compiled_adapter, compiled_saved, regions = _train(tmp_path / "compiled", setting)
    assert len(eager_losses) == 2
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-5)
    assert len(compiled) == (1 if setting == "true" else len(regions))  # the one layer, or its regions
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= (2 if setting == "true" else len(regions))
    assert compiled_saved == eager_saved
    assert sorted(compiled_adapter) == sorted(eager_adapter) and all("_orig_mod" not in k for k in compiled_adapter)
    assert max((compiled_adapter[k] - eager_adapter[k]).abs().max().item() for k in eager_adapter) <= 1e-5
    assert regions == ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp",
                       "input_layernorm", "post_attention_layernorm"]  # the MoE MLP: router + frozen grouped_mm experts


def test_flex_sinks_layer_compiles_without_a_break_when_masks_are_built_ahead(monkeypatch):
    """The CUDA gpt-oss attention (flex + sinks) inside a compiled PEFT layer: with the block masks built before the
    layers (`kernels.block_masks_ahead`) dynamo sees no graph break in a layer, and the logits equal eager's.
    Forward only, on CPU (flex attention has no CPU backward), `aot_eager` (inductor's CPU flex returns no LSE)."""
    from peft import get_peft_model

    from ftcli.model.build import decoder_layers, load_model
    from ftcli.model.kernels import Backend, block_masks_ahead, install_backends
    from ftcli.train.lora.trainer import collate_blocks, lora_config

    recipe = tiny_recipe("lora.target_parameters=[]", "lora.dropout=0.05")
    attn = install_backends("gpt_oss", [Backend("attention", "flex_sinks", "forward check on CPU")])
    torch.manual_seed(0)
    base = load_model(recipe.model, attn_implementation=attn)
    model = get_peft_model(base, lora_config(recipe.lora, recipe.model, base)).eval()
    rng = np.random.default_rng(1)
    batch = collate_blocks([packed_row(rng, [50, 30, 48], 0.5)])
    batch.pop("labels")
    with torch.no_grad():
        eager = model(**batch).logits
        assert block_masks_ahead(model) is not None
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        for layer in decoder_layers(model):
            layer.compile(backend="aot_eager")
        compiled = model(**batch).logits
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # sliding and full attention layers
    assert (compiled - eager).abs().max().item() <= 1e-5
