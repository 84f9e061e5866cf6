"""Peak host memory of `ftcli merge-lora` against the size of the model it merges.

Builds a random gpt-oss (tiny, or --size mid: ~1.2B params), writes it as an MXFP4 checkpoint (the
format of openai/gpt-oss-*), attaches a random LoRA adapter (attention + expert parameters), then runs
`ftcli merge-lora --dtype bfloat16` in a fresh process and reads that process's peak RSS (ru_maxrss).
A second fresh process that only imports what merge-lora imports gives the fixed cost (torch,
transformers, peft); the difference is what the merge itself needed, reported in units of one bf16
copy of the model. The models are built in a child process too: this parent imports no torch, so the
children's peak RSS is theirs alone (a fork copies the parent's resident pages into the child's count).

    python benchmarks/merge_peak_rss.py              # tiny (the number is dominated by imports)
    python benchmarks/merge_peak_rss.py --size mid   # ~2.4 GB of bf16 weights, ~3 GB of disk
    python benchmarks/merge_peak_rss.py --size 20b --layers 3   # gpt-oss-20b's shape cut to 3 layers (7.2 GB bf16)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import common  # noqa: E402

MID = dict(hidden_size=1024, intermediate_size=1024, num_hidden_layers=8, num_local_experts=32,
           num_experts_per_tok=4, num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=201088,
           layer_types=["sliding_attention", "full_attention"] * 4)


def child_peak_rss(cmd: list[str]) -> int:
    """Peak RSS (bytes) of one child process running `cmd` (its own rusage, from wait4)."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            log.seek(0)
            raise SystemExit(log.read().decode()[-4000:])
    return usage.ru_maxrss * 1024


def make(size: str, out: Path, layers: int) -> None:
    """(child) a random gpt-oss written as MXFP4 to out/base, a random LoRA adapter to out/adapter."""
    import torch
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ftcli.model import mxfp4
    from ftcli.config.recipe import load_recipe, resolve_path
    from ftcli.train.lora.trainer import lora_config

    cfg = json.loads(Path(resolve_path("pkg://assets/tiny-gpt-oss.json")).read_text())
    cfg.pop("model_type")
    if size == "mid":
        cfg.update(MID)
    if size == "20b":  # the shipped gpt-oss-20b shape, cut to `layers`
        full = json.loads(Path(resolve_path("pkg://assets/models/openai--gpt-oss-20b.json")).read_text())
        cfg.update({k: v for k, v in full.items() if k not in ("_comment", "model_type")})
        cfg.update(num_hidden_layers=layers, layer_types=full["layer_types"][:layers], eos_token_id=10, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt_oss", **cfg), dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    (out / "n_params").write_text(str(sum(p.numel() for p in model.parameters())))
    tok = AutoTokenizer.from_pretrained(resolve_path("pkg://assets/tokenizer-gpt-oss"))
    mxfp4.save_mxfp4(model, out / "base", tokenizer=tok)
    recipe = load_recipe("tiny-gpt-oss-cpu")
    peft_model = get_peft_model(model, lora_config(recipe.lora, recipe.model, model))
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.01)
    peft_model.save_pretrained(out / "adapter")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=["tiny", "mid", "20b"], default="tiny")
    p.add_argument("--layers", type=int, default=3, help="decoder layers of --size 20b")
    p.add_argument("--make", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.make:
        return make(args.size, args.make, args.layers)

    with tempfile.TemporaryDirectory(prefix="ftcli-merge-rss-") as tmp:
        tmp = Path(tmp)
        subprocess.run([sys.executable, __file__, "--size", args.size, "--layers", str(args.layers), "--make", str(tmp)],
                       check=True, capture_output=True)
        n_params = int((tmp / "n_params").read_text())
        imports = [sys.executable, "-c", "import torch, transformers, peft, safetensors, ftcli.artifacts.merge, ftcli.model.build"]
        merge = [sys.executable, "-m", "ftcli", "merge-lora", str(tmp / "adapter"), "--base", str(tmp / "base"),
                 "--output", str(tmp / "merged"), "--dtype", "bfloat16"]
        baseline = child_peak_rss(imports)
        peak = child_peak_rss(merge)
        model_bytes = 2 * n_params
        disk = sum(f.stat().st_size for f in (tmp / "merged").glob("*.safetensors"))
        base_shard = max(f.stat().st_size for f in (tmp / "base").glob("*.safetensors"))
        report = json.loads((tmp / "merged" / "merge.json").read_text())
    gib = 2**30
    name = f"gpt-oss {args.size}" + (f" ({args.layers} layers)" if args.size == "20b" else "")
    print(common.table(["model", "params", "bf16 size", "import-only RSS", "merge-lora peak RSS", "merge - imports",
                        "in model copies"],
                       [[name, f"{n_params / 1e6:,.1f}M", f"{model_bytes / gib:.2f} GiB", f"{baseline / gib:.2f} GiB",
                         f"{peak / gib:.2f} GiB", f"{(peak - baseline) / gib:.2f} GiB",
                         f"{(peak - baseline) / model_bytes:.2f}"]], sep=["---"] + ["---:"] * 6))
    shard = max(base_shard, report["largest_shard_bytes"])
    print(f"\nlargest shard (base {base_shard / gib:.2f} GiB, merged {report['largest_shard_bytes'] / gib:.2f} GiB): "
          f"merge - imports = {(peak - baseline) / shard:.2f} x the largest shard; the largest unit (a layer or a "
          f"root module) is {report['largest_unit_bytes'] / gib:.2f} GiB of bf16 weights")
    print(f"\nmerged safetensors on disk: {disk / gib:.2f} GiB; merge check: max |merged - (base+adapter)| = "
          f"{report['max_abs_diff']:.3g} over {report['probe_tokens']} tokens, tolerance {report['tolerance']:.3g}, "
          f"{report['routing_ties']} near-tie routing choices replayed")


if __name__ == "__main__":
    main()
