"""The model families (ftcli/families/): the registry, each family's shape from its config against transformers,
the real recipes of the new families (plan on their own accelerator, a valid workload, doctor knows the kernels),
and one short end-to-end run each for full SFT (Gemma 3, sliding windows) and LoRA on experts (Qwen3-MoE)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from _run_common import FAST, env, ftcli  # noqa: F401 - env is a fixture
from ftcli.config.errors import UserError
from ftcli.config.recipe import load_recipe, resolve_path
from ftcli.estimate import memory
from ftcli.families import FAMILIES, family_of

REAL = {"llama3-8b-h100": "meta-llama/Llama-3.1-8B-Instruct", "llama3-70b-lora-h100": "meta-llama/Llama-3.3-70B-Instruct",
        "qwen3-30b-a3b-lora-h100": "Qwen/Qwen3-30B-A3B", "gemma3-12b-h100": "google/gemma-3-12b-it"}
TINY = ["tiny-llama3.json", "tiny-qwen3.json", "tiny-qwen3-moe.json", "tiny-gemma3.json"]


def test_unknown_model_type_is_a_one_line_user_error():
    with pytest.raises(UserError) as e:
        family_of("mistral")
    assert "\n" not in str(e.value) and str(e.value).startswith("ftcli has no model family for model_type 'mistral'")
    assert family_of("qwen3_5_text") is family_of("qwen3_5") is FAMILIES["qwen3_5"]
    assert family_of("gemma3") is family_of("gemma3_text") is FAMILIES["gemma3"]


def _meta_param_count(cfg: dict) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("asset", TINY)
def test_tiny_family_param_counts_equal_transformers(asset):
    cfg = json.loads(Path(resolve_path(f"pkg://assets/{asset}")).read_text())
    assert memory.shape_from_config(cfg).total_params == _meta_param_count(cfg)


@pytest.mark.parametrize("model_id,total", [("meta-llama/Llama-3.1-8B-Instruct", 8_030_261_248),
                                            ("meta-llama/Llama-3.3-70B-Instruct", 70_553_706_496),
                                            ("Qwen/Qwen3-30B-A3B", 30_532_122_624),
                                            ("google/gemma-3-12b-it", 11_766_034_176)])
def test_shipped_hub_configs_give_the_published_sizes(model_id, total):
    """The shipped configs' parameter counts: the published totals, and transformers' own at 2 layers."""
    cfg = json.loads(memory.shipped_shape_path(model_id).read_text())
    assert memory.shape_from_config(cfg).total_params == total
    text = {**cfg["text_config"]} if "text_config" in cfg else cfg
    assert memory.shape_from_config({**text, "num_hidden_layers": 2}).total_params == \
        _meta_param_count({**text, "num_hidden_layers": 2})


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_recipes_fit_their_accelerator_and_render_a_valid_workload(name):
    from ftcli.commands import plan
    from ftcli.launchers import databricks as workload
    from ftcli.features.fused_ops import LIGER_KIND, LIGER_PIN

    recipe = load_recipe(name)
    assert recipe.model.id == REAL[name] and memory.shipped_shape_path(recipe.model.id) is not None
    own = plan.make_plan(recipe).cards[0]
    assert own.own and own.accelerator == recipe.compute.accelerator_type == "GPU_8xH100" and own.fits
    rendered = yaml.safe_load(workload.render_workload(recipe))
    assert workload.validate_workload(rendered) == []
    assert rendered["parameters"]["model"]["model_type"] == recipe.model.model_type
    # dense attention is torch's varlen_attn: no extra wheels; the full-SFT recipes fuse their norms (liger)
    fused = [(LIGER_PIN, f"{LIGER_KIND} fused RMSNorm / SwiGLU (training.fused_ops)")]
    assert workload.gpu_requirements(recipe) == (fused if recipe.training.method == "full" else [])


@pytest.mark.parametrize("name", sorted(REAL))
def test_doctor_knows_the_kernels_of_every_family_recipe(name):
    """On an 8xH100 with torch's varlen_attn the packed attention of every new family has its backend, and no
    known-bad rule of another family applies."""
    from ftcli.commands.doctor import Transformers, doctor_report
    from ftcli.hardware import Machine
    from ftcli.model.compat import NA

    m = Machine(device="cuda:0", capability=(9, 0), torch_varlen=True, flex=True,
                versions={"transformers": "5.24.0", "torch": "2.11.0", "liger-kernel": "0.8.5"},  # the workload's pins
                gpus=(("NVIDIA H100 80GB HBM3", 85_031_714_816),) * 8)
    report = doctor_report(load_recipe(name), m, tf=Transformers(installed="5.24.0"))
    assert [(b[1], b[2]) for b in report.backends] == [("attention", "torch_varlen")]
    assert report.kernels_correct, report.kernels_detail
    checks = {c.name: c.status for c in report.checks}
    assert checks["gpt-oss packed attention keeps the sinks"] == NA
    assert checks["fla on a GPU machine (Qwen3.5 gated delta)"] == NA


# ------------------------------------------------------------------------------------------ end to end
def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_gemma3_full_sft_trains_end_to_end_and_reloads(tmp_path, env):  # noqa: F811
    """Gemma 3 (2 sliding-window layers + 1 global, packed blocks) through the FSDP2 loop on 2 CPU processes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = tmp_path / "run"
    args = ["train", "--recipe", "tiny-gemma3-cpu", "--set", f"output.dir={run_dir}", "--set", "training.max_steps=8",
            "--set", "data.max_examples=400", "--set", "eval.every_steps=8"]
    res = ftcli([*args, *(x for s in FAST for x in ("--set", s))], tmp_path, env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "packed kernels: attention=sdpa_segments" in res.stdout
    losses = [m["loss"] for m in _metrics(run_dir)]
    assert len(losses) == 8 and 6.0 < losses[0] < 7.5 and losses[-1] < losses[0] - 1.5, losses  # ~ln(1024) at init
    final = run_dir / "final"
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(final)
    assert type(model).__name__ == "Gemma3ForCausalLM" and tok.eos_token == "<end_of_turn>"
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 7 plus 6?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_qwen3_moe_lora_trains_the_experts_end_to_end_and_merge_folds_them(tmp_path, env):  # noqa: F811
    """LoRA on Qwen3-MoE's attention and its 3-D experts (PEFT target_parameters, computed unmerged by the grouped
    expert LoRA, as gpt-oss's are) through TRL, from a saved base (transformers writes its experts one linear each,
    as the hub checkpoints are); merge-lora reads them fused, folds the adapter and writes them back in the base's
    layout."""
    import torch
    from peft import PeftModel
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads(Path(resolve_path("pkg://assets/tiny-qwen3-moe.json")).read_text())
    torch.manual_seed(0)
    base_dir = tmp_path / "base"
    AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg)).save_pretrained(base_dir)
    AutoTokenizer.from_pretrained(resolve_path("pkg://assets/tokenizer-qwen3")).save_pretrained(base_dir)
    run_dir = tmp_path / "run"
    args = ["train", "--recipe", "tiny-qwen3-moe-cpu", "--set", f"output.dir={run_dir}", "--set", "training.max_steps=8",
            "--set", "data.max_examples=400", "--set", "eval.every_steps=8", "--set", "model.init=pretrained",
            "--set", f"model.id={base_dir}", "--set", "model.config=null"]
    res = ftcli([*args, *(x for s in FAST for x in ("--set", s))], tmp_path, env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "expert LoRA: grouped, unmerged (2 experts modules" in res.stdout  # lora.experts' default, not PEFT's fold
    losses = [m["loss"] for m in _metrics(run_dir)]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.5, losses
    adapter = load_file(str(run_dir / "final" / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0"
    # experts: gate_up_proj [E=4, in=128, out=192] -> A [r*E, 128], B [192, r*E]; down_proj [4, 96 -> 128]
    assert adapter[f"{prefix}.mlp.experts.base_layer.lora_A.weight"].shape == (64, 128)
    assert adapter[f"{prefix}.mlp.experts.base_layer.lora_B.weight"].shape == (192, 64)
    assert adapter[f"{prefix}.mlp.experts.lora_A.weight"].shape == (64, 96)
    for module in ("self_attn.q_proj", "self_attn.o_proj", "mlp.experts", "mlp.experts.base_layer"):
        assert adapter[f"{prefix}.{module}.lora_B.weight"].abs().max() > 1e-4, module  # starts at 0: trained
    assert not any(".mlp.gate." in k for k in adapter)  # the router stays frozen
    config = json.loads((run_dir / "final" / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]

    merged_dir = tmp_path / "merged"
    res = ftcli(["merge-lora", str(run_dir / "final"), "-o", str(merged_dir), "--dtype", "float32"], tmp_path, env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    merged_keys = json.loads((merged_dir / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(base_dir / "model.safetensors"), "pt") as g:
        assert sorted(merged_keys) == sorted(g.keys())  # the base's per-expert layout
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in merged_keys
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                        run_dir / "final").eval()
    ids = torch.randint(0, 600, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        folded, reference = merged(ids).logits, adapted(ids).logits
        with adapted.disable_adapter():
            before = adapted(ids).logits
    assert (reference - before).abs().max().item() > 1e-2  # the adapter moves the logits ...
    assert (folded - reference).abs().max().item() < 1e-4  # ... and the merged weights give the same


def test_lora_mfu_counts_qwen3_moe_experts_at_top_k():
    """The LoRA path's MFU counts the experts a token goes through (top-k of num_experts): Qwen3-MoE names them
    num_experts where gpt-oss says num_local_experts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ftcli.model.build import count_params
    from ftcli.train.lora.callbacks import active_params

    cfg = json.loads(Path(resolve_path("pkg://assets/tiny-qwen3-moe.json")).read_text())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == 2 * 4 * (128 * 192 + 96 * 128)  # layers x experts x (gate_up + down)
    assert active_params(model) == count_params(model)[1] - experts // 2  # top-2 of 4


@pytest.mark.parametrize("model_type,asset", [("qwen3_5_text", "tokenizer-qwen"), ("gpt_oss", "tokenizer-gpt-oss"),
                                              ("llama", "tokenizer-llama3"), ("qwen3", "tokenizer-qwen3"),
                                              ("qwen3_moe", "tokenizer-qwen3"), ("gemma3_text", "tokenizer-gemma3")])
def test_family_chat_facts_match_its_shipped_template(model_type, asset):
    """A family's chat format is the one ftcli detects in its template (and the one the masks parse it by), the
    format's end-of-turn token is the tokenizer's eos and the first stop token of generation, and `system_role`
    says whether the template renders a system turn of its own."""
    from transformers import AutoTokenizer

    from ftcli.chat_formats import detect, format_named
    from ftcli.data.chat import ChatEncoder
    from ftcli.inference import stop_token_ids

    family = family_of(model_type)
    fmt = format_named(family.chat_format)
    tok = AutoTokenizer.from_pretrained(resolve_path(f"pkg://assets/{asset}"))
    assert detect(tok.chat_template) is fmt and ChatEncoder(tok).grammar is fmt.grammar
    assert tok.eos_token == fmt.end_of_turn
    assert stop_token_ids(tok) == [tok.convert_tokens_to_ids(t) for t in (fmt.end_of_turn, *fmt.stop_tokens)]
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                   tokenize=False)
    own_turn = {"chatml": "<|im_start|>system\n", "harmony": "<|start|>developer",
                "llama3": "<|start_header_id|>system<|end_header_id|>", "gemma": "<start_of_turn>system"}
    assert (own_turn[fmt.name] in text) == fmt.system_role
    assert "Be brief." in text  # Gemma: folded into the first user turn by the template itself


def test_an_unregistered_chat_format_name_is_refused_with_one_line():
    from ftcli.chat_formats import format_named

    with pytest.raises(UserError) as e:
        format_named("phi4")
    assert str(e.value) == ("ftcli has no chat format 'phi4' (known: chatml, gemma, harmony, llama3); add a module "
                            "under ftcli/chat_formats/ and a line in CHAT_FORMATS")
