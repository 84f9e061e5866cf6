"""Full-SFT throughput at the Llama-3.1-8B width, layers cut: ftcli's FSDP2 loop against TRL's SFTTrainer (with and
without liger kernels) and torchtune's full fine-tune, side by side, from the same start.

The same start on every side:
  - weights: one random init (transformers' own, seed 0, at the deepest depth asked) written once as bf16
    safetensors (one file per decoder layer + one for the rest); a depth-N directory holds links to the first N
    layer files, so every side at every depth loads the same values (into float32 masters, or bf16 for torchtune);
  - data: ftcli's own stream of packed 8,192-token blocks (synthetic examples, bfd packing, its shuffle), the first
    `--steps` blocks, in that order, handed to every side as they are: TRL as pre-packed rows (input_ids, labels,
    seq_lengths; skip_prepare_dataset, padding_free, sequential sampler), torchtune as packed samples (tokens,
    labels, input_pos, seq_lens; its padded_collate_packed builds the flex-attention block mask);
  - optimizer: AdamW lr 1e-5 constant, betas (0.9, 0.95), no weight decay, clip 1.0, one block per step, the loss
    the mean over the block's trained tokens (prompt tokens and segment starts masked, the same labels).
Numerics: ftcli bf16 compute with float32 master weights (FSDP2 MixedPrecisionPolicy); TRL a float32 model under
bf16 autocast (norms and the residual stream in float32, matmuls bf16); torchtune's single-device recipe trains
in pure bf16 (weights, gradients and AdamW states: its `dtype: bf16`; it has no float32-master option). So the
first step's loss (same weights, same block) must agree on every side to bf16 rounding, and later steps drift
by numerics only. Full activation checkpointing everywhere.

Tokens/s: block tokens / step time (every block is 8,192 tokens), median over the steps after --warmup; peak
GiB: torch.cuda.max_memory_allocated during the run (reset before each). Per-layer cost and the fixed part come
from a least-squares line of s/step over the depths; the 32-layer figure is that line at 32.

H200 (one call, every part with its own time check):
  source .gpu/activate.sh && (extract .gpu-ao, .tt) && python benchmarks/families_throughput_gpu.py
CPU logic check (tiny Llama, 512-token blocks, 2 layers):  python benchmarks/families_throughput_gpu.py --tiny
  (torchtune: --torchtune-path DIR puts a torchtune 0.6.1 + torchao 0.10 + omegaconf site first on its
  subprocess' path; torchtune 0.6.1 does not import with torchao 0.18, ftcli's fp8 pin.)
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "benchmarks" / "recipes" / "llama8b-cut-h200.yaml"
TINY = ["model.config=pkg://assets/tiny-llama3.json", "data.packing.block_len=512", "data.synthetic.num_examples=300",
        "data.synthetic.mean_tokens=120", "data.synthetic.max_tokens=500", "training.optimizer.fused=false"]
LR, BETAS, CLIP = 1e-5, (0.9, 0.95), 1.0
START = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - START:6.1f}s]", *a, flush=True)


def base_sets(tiny: bool, steps: int) -> list[str]:
    return [*(TINY if tiny else []), f"training.max_steps={steps}"]


def load(sets: list[str]):
    from ftcli import features

    return features.load_recipe(str(RECIPE), sets)


# ------------------------------------------------------------------------------------------- the same start
def ftcli_blocks(tiny: bool, steps: int, work: Path):
    """The first `steps` blocks of ftcli's own stream (the blocks its trainer reads on one rank)."""
    from ftcli import data

    recipe = load(base_sets(tiny, steps) + [f"output.dir={work / 'data-run'}"])
    tokenizer = data.load_tokenizer(recipe)
    packed = data.prepare_blocks(recipe, tokenizer)
    stream = data.BlockStream(packed, 0, 1, epochs=recipe.training.epochs, seed=recipe.training.seed)
    blocks = list(islice(stream, steps))
    assert len(blocks) == steps, f"only {len(blocks)} blocks"
    return recipe, blocks


def model_config(recipe) -> dict:
    from ftcli.config.recipe import resolve_path

    cfg = json.loads(Path(resolve_path(recipe.model.config, base=RECIPE.parent)).read_text())
    return {k: v for k, v in cfg.items() if not k.startswith("_")}


def write_init(cfg: dict, depths: list[int], work: Path, device: str) -> dict[int, Path]:
    """One random init at max(depths) layers, bf16 safetensors (a file per layer + the rest); a directory per depth."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    deepest = max(depths)
    raw = dict(cfg, num_hidden_layers=deepest)
    config = AutoConfig.for_model(raw.pop("model_type"), **{k: v for k, v in raw.items() if k != "architectures"})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    shards = work / "init-shards"
    shards.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in model.state_dict().items():
        parts = name.split(".")
        group = f"layer-{int(parts[2]):03d}" if name.startswith("model.layers.") else "rest"
        files.setdefault(group, {})[name] = p.detach().to(torch.bfloat16).cpu().contiguous()
    for group, tensors in files.items():
        save_file(tensors, str(shards / f"{group}.safetensors"), metadata={"format": "pt"})
    del model, files
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    dirs = {}
    for n in depths:
        d = work / f"init-{n}"
        d.mkdir(exist_ok=True)
        names = ["rest"] + [f"layer-{i:03d}" for i in range(n)]
        weight_map = {}
        for g in names:
            link = d / f"{g}.safetensors"
            if not link.exists():
                link.symlink_to(shards / f"{g}.safetensors")
            from safetensors import safe_open

            with safe_open(str(link), "pt") as f:
                weight_map.update({k: link.name for k in f.keys()})
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        (d / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=n, torch_dtype="bfloat16",
                                                       architectures=["LlamaForCausalLM"])))
        dirs[n] = d
    return dirs


def save_blocks(blocks, path: Path) -> None:
    np.savez(path, input_ids=np.stack([b.input_ids for b in blocks]), labels=np.stack([b.labels for b in blocks]),
             position_ids=np.stack([b.position_ids for b in blocks]),
             seq_lens=np.array([json.dumps(np.diff(b.cu_seqlens).tolist()) for b in blocks]))


def steady(times: list[float], tokens: int, warmup: int) -> float | None:
    """Median tokens/s over the steps after `warmup` (times: wall clock at the end of each step, step 0 = start)."""
    dts = [b - a for a, b in zip(times, times[1:])][warmup:]
    return tokens / statistics.median(dts) if dts else None


def cuda_reset():
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**30
    return 0.0


def cuda_peak():
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


# ------------------------------------------------------------------------------------------------- ftcli
def peak_report(snapshot: dict, top: int = 8) -> list[str]:
    """From a CUDA memory snapshot: the live blocks >= 64 MiB at the moment of the most allocated memory in the
    recorded window, each with the innermost ftcli / torch frames of its allocation."""
    trace = snapshot["device_traces"][0]
    live, total, best, best_live = {}, 0, -1, {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
        elif e["action"] in ("free_completed",) and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
        if total > best:
            best, best_live = total, dict(live)
    out = [f"recorded window: {best / 2**30:.2f} GiB allocated at its peak beyond the window's start"]
    big = sorted(best_live.values(), key=lambda e: -e["size"])
    for e in big[:top]:
        frames = [f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in e.get("frames", [])
                  if "python" not in f["filename"] or "site-packages" in f["filename"] or "ftcli" in f["filename"]]
        frames = [f for f in frames if not f.startswith(("<", "threading"))][:5]
        out.append(f"  {e['size'] / 2**30:6.2f} GiB  {' <- '.join(frames)}")
    return out


def run_ftcli(label: str, layers: int, init: Path, blocks, work: Path, tiny: bool, warmup: int, extra: list[str],
              *, root_layout: bool = False, snapshot_step: int | None = None) -> dict:
    """ftcli's trainer in this process (one rank; `ftcli train` launches the same function in a torchrun worker)."""
    import torch

    from ftcli.model import parallelize
    from ftcli.train.full import train

    run_dir = work / f"ftcli-{label}-{layers}"
    sets = base_sets(tiny, len(blocks)) + ["model.init=pretrained", f"model.id={init}", "model.config=null",
                                          f"output.dir={run_dir}", *extra]
    recipe = load(sets)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(29400 + int(time.time() * 10) % 500))
    if tiny:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if not torch.cuda.is_available():
        snapshot_step = None  # CUDA memory snapshots only
    report: list[str] = []

    def feed(_stream):
        for i, b in enumerate(blocks):
            if snapshot_step is not None and i == snapshot_step - 1:
                torch.cuda.memory._record_memory_history(max_entries=400000, stacks="python")
            if snapshot_step is not None and i == snapshot_step:  # the step after: one slow step, the median keeps
                snap = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                report.extend(peak_report(snap))
                with gzip.open(work / f"snapshot-{label}-{layers}.pickle.gz", "wb") as f:
                    pickle.dump(snap, f)
            yield b

    import torch.distributed as dist

    if dist.is_initialized():  # left by TRL's accelerate in this process
        dist.destroy_process_group()
    before = parallelize.SEPARATE_EMBEDDING_UNITS
    parallelize.SEPARATE_EMBEDDING_UNITS = not root_layout
    base = cuda_reset()
    try:
        result = train(recipe, run_dir, None, blocks=feed)
    finally:
        parallelize.SEPARATE_EMBEDDING_UNITS = before
    peak = cuda_peak()
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    dts = [m["s_per_step"] for m in metrics][warmup:]
    block_len = len(blocks[0].input_ids)
    shutil.rmtree(run_dir, ignore_errors=True)
    return dict(impl=f"ftcli {label}".strip(), layers=layers, tokens_per_s=block_len / statistics.median(dts),
                s_per_step=statistics.median(dts), peak=peak, base=base,
                losses=[m["loss"] for m in metrics], steps=result.steps, notes=report)


# --------------------------------------------------------------------------------------------------- TRL
def run_trl(layers: int, init: Path, blocks, tiny: bool, warmup: int, liger: bool) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from ftcli.config.recipe import resolve_path

    device = "cpu" if tiny else "cuda"
    base = cuda_reset()
    model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32, attn_implementation="sdpa",
                                                 device_map=device)
    rows = [{"input_ids": b.input_ids.astype(int).tolist(), "labels": b.labels.astype(int).tolist(),
             "seq_lengths": np.diff(b.cu_seqlens).astype(int).tolist()} for b in blocks]
    times: list[float] = []
    losses: list[float] = []
    norms: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            times.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])
                norms.append(logs.get("grad_norm"))

    sft = SFTConfig(output_dir=tempfile.mkdtemp(prefix="trl-"), max_steps=len(blocks), per_device_train_batch_size=1,
                    gradient_accumulation_steps=1, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                    adam_beta1=BETAS[0], adam_beta2=BETAS[1], weight_decay=0.0, max_grad_norm=CLIP, bf16=not tiny,
                    gradient_checkpointing=True, logging_steps=1, save_strategy="no", report_to=[],
                    packing=False, padding_free=True, max_length=None, dataset_kwargs={"skip_prepare_dataset": True},
                    train_sampling_strategy="sequential", dataloader_num_workers=0, use_cpu=tiny, seed=0,
                    optim="adamw_torch_fused" if not tiny else "adamw_torch", use_liger_kernel=liger,
                    remove_unused_columns=False)
    tokenizer = AutoTokenizer.from_pretrained(resolve_path("pkg://assets/tokenizer-llama3"))
    trainer = SFTTrainer(model=model, args=sft, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                         callbacks=[Clock()])
    trainer.train()
    peak = cuda_peak()
    block_len = len(blocks[0].input_ids)
    rate = steady(times, block_len, warmup)
    del trainer, model
    return dict(impl="TRL + liger" if liger else "TRL", layers=layers, tokens_per_s=rate, s_per_step=block_len / rate,
                peak=peak, base=base, losses=losses, steps=len(losses),
                notes=[f"grad norms: {' '.join(f'{x:.3g}' for x in norms if x is not None)}"])


# ---------------------------------------------------------------------------------------------- torchtune
class TTTokenizer:
    """What torchtune's recipe asks of a tokenizer when the data comes tokenized: its pad id."""

    def __init__(self, pad_id: int = 0):
        self.pad_id = pad_id


def tt_dataset(tokenizer, path: str, packed: bool = True, **_):
    """The blocks as torchtune packed samples (PackedDataset's keys)."""
    import torch

    z = np.load(path)
    return [{"tokens": torch.from_numpy(z["input_ids"][i].astype(np.int64)),
             "labels": torch.from_numpy(z["labels"][i].astype(np.int64)),
             "input_pos": torch.from_numpy(z["position_ids"][i].astype(np.int64)),
             "seq_lens": torch.tensor(json.loads(str(z["seq_lens"][i])), dtype=torch.int64)}
            for i in range(len(z["input_ids"]))]


class TTLogger:
    """torchtune metric logger: the loss and wall clock of every step."""

    records: list[tuple[float, dict]] = []

    def __init__(self, **_):
        TTLogger.records = [(time.perf_counter(), {})]

    def log_config(self, cfg):
        pass

    def log_dict(self, payload, step):
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        TTLogger.records.append((time.perf_counter(), {k: float(v) for k, v in payload.items()}))

    def log(self, *a, **k):
        pass

    def close(self):
        pass


def torchtune_worker(args) -> int:
    """In a subprocess (torchtune's own torchao): torchtune's full_finetune_single_device recipe at each depth."""
    import torch
    from omegaconf import OmegaConf

    sys.path.insert(0, str(Path(__file__).parent))
    import families_throughput_gpu as this  # the copy torchtune's config.instantiate imports the components from
    import importlib.util

    import torchtune  # its recipes ship beside it in the wheel, as scripts (their folder refuses a package import)

    script = Path(torchtune.__file__).parents[1] / "recipes" / "full_finetune_single_device.py"
    spec = importlib.util.spec_from_file_location("tt_full_finetune_single_device", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    FullFinetuneRecipeSingleDevice = module.FullFinetuneRecipeSingleDevice

    cfg_model = json.loads(Path(args.tt_config).read_text())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for layers in args.layers:
        init = Path(args.tt_init) / f"init-{layers}"
        out = Path(tempfile.mkdtemp(prefix=f"tt-{layers}-"))
        files = sorted(p.name for p in init.glob("*.safetensors"))
        hd = cfg_model.get("head_dim") or cfg_model["hidden_size"] // cfg_model["num_attention_heads"]
        assert hd * cfg_model["num_attention_heads"] == cfg_model["hidden_size"]
        cfg = OmegaConf.create({
            "output_dir": str(out), "device": device, "dtype": "bf16", "seed": 0, "shuffle": False, "batch_size": 1,
            "model": {"_component_": "torchtune.models.llama3_1.llama3_1", "vocab_size": cfg_model["vocab_size"],
                      "num_layers": layers, "num_heads": cfg_model["num_attention_heads"],
                      "num_kv_heads": cfg_model["num_key_value_heads"], "embed_dim": cfg_model["hidden_size"],
                      "max_seq_len": cfg_model["max_position_embeddings"],
                      "intermediate_dim": cfg_model["intermediate_size"], "attn_dropout": 0.0,
                      "norm_eps": cfg_model["rms_norm_eps"],
                      "rope_base": (cfg_model.get("rope_parameters") or cfg_model)["rope_theta"],
                      "scale_factor": (cfg_model.get("rope_scaling") or cfg_model.get("rope_parameters"))["factor"]},
            "tokenizer": {"_component_": "families_throughput_gpu.TTTokenizer"},
            "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer", "checkpoint_dir": str(init),
                             "checkpoint_files": files, "model_type": "LLAMA3", "output_dir": str(out / "ckpt"),
                             "recipe_checkpoint": None},
            "resume_from_checkpoint": False,
            "dataset": {"_component_": "families_throughput_gpu.tt_dataset", "path": args.tt_blocks, "packed": True},
            "epochs": 1, "max_steps_per_epoch": args.steps, "gradient_accumulation_steps": 1,
            "optimizer_in_bwd": False, "clip_grad_norm": CLIP, "compile": False,
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": LR, "betas": list(BETAS), "weight_decay": 0.0,
                          "fused": device == "cuda"},
            "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
            "enable_activation_checkpointing": True, "enable_activation_offloading": False,
            "metric_logger": {"_component_": "families_throughput_gpu.TTLogger"},
            "log_every_n_steps": 1, "log_peak_memory_stats": False, "profiler": {"enabled": False},
        })
        row = dict(impl="torchtune", layers=layers, tokens_per_s=None, s_per_step=None, peak=None, base=None,
                   losses=[], steps=0, notes=[])
        try:
            row["base"] = cuda_reset()
            recipe = FullFinetuneRecipeSingleDevice(cfg=cfg)
            recipe.setup(cfg=cfg)
            recipe.save_checkpoint = lambda epoch: None  # the benchmark writes no model
            recipe.train()
            recs = this.TTLogger.records
            block_len = int(np.load(args.tt_blocks)["input_ids"].shape[1])
            rate = steady([t for t, _ in recs], block_len, args.warmup)
            row.update(tokens_per_s=rate, s_per_step=block_len / rate, peak=cuda_peak(),
                       losses=[r["loss"] for _, r in recs[1:]], steps=len(recs) - 1,
                       notes=["grad norms: " + " ".join(format(r.get("grad_norm", float("nan")), ".3g")
                                                        for _, r in recs[1:])])
            del recipe
        except Exception as e:  # noqa: BLE001 - report the failure in the table
            row["exit"] = f"{type(e).__name__}: {e}"[:300]
        print("ROW", json.dumps(row), flush=True)
        shutil.rmtree(out, ignore_errors=True)
    return 0


def run_torchtune(layers: list[int], dirs: dict, blocks_path: Path, cfg: dict, work: Path, steps: int, warmup: int,
                  site: str | None, timeout: float) -> list[dict]:
    cfg_path = work / "tt-config.json"
    cfg_path.write_text(json.dumps(cfg))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, str(Path(__file__).parent), env.get("PYTHONPATH")]))
    env.pop("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", None)
    cmd = [sys.executable, __file__, "--torchtune-worker", "--layers", *map(str, layers), "--steps", str(steps),
           "--warmup", str(warmup), "--tt-init", str(work), "--tt-blocks", str(blocks_path), "--tt-config",
           str(cfg_path)]
    try:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rows = [json.loads(x[4:]) for x in out.splitlines() if x.startswith("ROW ")]
        return rows + [dict(impl="torchtune", layers=n, exit=f"timeout {timeout:.0f}s") for n in layers
                       if n not in {r["layers"] for r in rows}]
    rows = [json.loads(x[4:]) for x in res.stdout.splitlines() if x.startswith("ROW ")]
    if res.returncode != 0 or not rows:
        tail = (res.stderr or res.stdout)[-1500:]
        log("torchtune failed:\n" + tail)
        return rows or [dict(impl="torchtune", layers=n, exit=f"rc {res.returncode}: {tail[-200:]}") for n in layers]
    return rows


# ---------------------------------------------------------------------------------------------------- main
def fit_line(points: list[tuple[int, float]]):
    if len(points) < 2:
        return None
    xs, ys = np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)
    slope, intercept = np.polyfit(xs, ys, 1)
    return float(slope), float(intercept)


def fmt(x, spec=",.0f"):
    return format(x, spec) if isinstance(x, (int, float)) and x is not None else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 12])
    parser.add_argument("--peer-layers", type=int, nargs="+", default=[4, 8], help="depths for TRL+liger, torchtune")
    parser.add_argument("--lever-layers", type=int, default=8)
    parser.add_argument("--parts", nargs="+", default=["ftcli", "root", "bf16master", "trl", "torchtune", "fused",
                                                       "regions", "fp8", "trl_liger"],
                        help="what runs, in this order (TRL + liger always last)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip parts that would start after this")
    parser.add_argument("--torchtune-path", default=None)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--work", default=None)
    parser.add_argument("--torchtune-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tt-init", help=argparse.SUPPRESS)
    parser.add_argument("--tt-blocks", help=argparse.SUPPRESS)
    parser.add_argument("--tt-config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torchtune_worker:
        return torchtune_worker(args)
    if args.tiny:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        args.layers, args.peer_layers, args.lever_layers = [2], [2], 2
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(args.work or tempfile.mkdtemp(prefix="ftcli-fam-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    warmup = 1 if args.tiny else args.warmup
    recipe, blocks = ftcli_blocks(args.tiny, args.steps, work)
    cfg = model_config(recipe)
    depths = sorted(set(args.layers) | set(args.peer_layers) | {args.lever_layers})
    dirs = write_init(cfg, depths, work, device)
    blocks_path = work / "blocks.npz"
    save_blocks(blocks, blocks_path)
    trained = [int(b.num_trained_tokens) for b in blocks]
    log(f"{len(blocks)} blocks of {len(blocks[0].input_ids)} tokens, trained tokens per block {trained}; init at "
        f"{max(depths)} layers written to {work}")

    rows: list[dict] = []

    def part(name: str, fn, est: float):
        left = args.budget_s - (time.perf_counter() - START)
        if left < est:
            log(f"skip {name}: {left:.0f}s left of the budget, ~{est:.0f}s needed")
            rows.append(dict(impl=name, layers=None, exit="skipped (time)"))
            return
        log(f"start {name}")
        try:
            got = fn()
        except Exception as e:  # noqa: BLE001 - one failed part still prints the others
            import traceback

            traceback.print_exc()
            got = [dict(impl=name, layers=None, exit=f"{type(e).__name__}: {e}"[:300])]
        for r in got if isinstance(got, list) else [got]:
            rows.append(r)
            print("ROW", json.dumps(r), flush=True)

    est = 8 if args.tiny else 1
    levers = {"regions": ("compile=regions", ["training.compile=regions"], 35),
              "fused": ("fused_ops", ["training.fused_ops=[rms_norm,swiglu]"], 15),
              "fp8": ("fp8+regions", ["training.precision.fp8=true", "training.compile=regions"], 40),
              "bf16master": ("bf16-master", ["training.precision.master_dtype=bfloat16"], 15)}
    plan = []  # in the order of --parts; TRL + liger last: liger patches transformers' classes in this process
    for kind in sorted(args.parts, key=lambda k: k == "trl_liger"):
        if kind == "ftcli":
            plan += [(f"ftcli {n}", lambda n=n: run_ftcli("", n, dirs[n], blocks, work, args.tiny, warmup, []),
                      15 * est + n) for n in sorted(args.layers)]
        elif kind == "trl":
            plan += [(f"TRL {n}", lambda n=n: run_trl(n, dirs[n], blocks, args.tiny, warmup, False), 12 * est + n)
                     for n in sorted(args.layers)]
        elif kind == "trl_liger":
            plan += [(f"TRL+liger {n}", lambda n=n: run_trl(n, dirs[n], blocks, args.tiny, warmup, True), 12 * est + n)
                     for n in sorted(args.peer_layers)]
        elif kind == "root":
            n = min(args.layers)
            plan.append((f"ftcli root-layout {n}", lambda n=n: run_ftcli(
                "root-layout", n, dirs[n], blocks, work, args.tiny, warmup, [], root_layout=True, snapshot_step=3),
                15 * est + n))
        elif kind == "torchtune":
            plan.append(("torchtune", lambda: run_torchtune(args.peer_layers, dirs, blocks_path, cfg, work, args.steps,
                                                            warmup, args.torchtune_path,
                                                            max(30.0, args.budget_s - (time.perf_counter() - START))),
                         40 * est))
        elif kind in levers and not args.tiny:
            label, sets, cost = levers[kind]
            n = args.lever_layers
            plan.append((f"ftcli {label} {n}", lambda n=n, label=label, sets=sets: run_ftcli(
                label, n, dirs[n], blocks, work, args.tiny, warmup, sets), cost))
    for name, fn, e in plan:
        part(name, fn, e)

    # ---- the tables
    print(f"\nLlama-3.1-8B width{' (tiny CPU mode)' if args.tiny else ''}, {len(blocks[0].input_ids)}-token blocks, "
          f"full activation checkpointing, {len(blocks)} steps, medians over steps > {warmup}\n")
    ref = {r["layers"]: r for r in rows if r.get("impl") == "ftcli" and r.get("tokens_per_s")}
    trl = {r["layers"]: r for r in rows if r.get("impl") == "TRL" and r.get("tokens_per_s")}
    tt = {r["layers"]: r for r in rows if r.get("impl") == "torchtune" and r.get("tokens_per_s")}
    print("| impl | layers | tokens/s | s/step | ftcli vs it | peak GiB | step-1 loss | loss step 1..N | exit |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("layers") is None:
            print(f"| {r['impl']} | - | - | - | - | - | - | - | {r.get('exit')} |")
            continue
        vs = "-"
        if r.get("tokens_per_s") and r["layers"] in ref and not r["impl"].startswith("ftcli"):
            vs = f"{ref[r['layers']]['tokens_per_s'] / r['tokens_per_s']:.2f}x"
        losses = r.get("losses") or []
        print(f"| {r['impl']} | {r['layers']} | {fmt(r.get('tokens_per_s'))} | {fmt(r.get('s_per_step'), '.3f')} | "
              f"{vs} | {fmt(r.get('peak'), '.1f')} | {fmt(losses[0] if losses else None, '.4f')} | "
              f"{' '.join(f'{x:.3f}' for x in losses)} | {r.get('exit', 0)} |")
    print("\nPer layer and fixed part (least squares of s/step over the depths), extrapolated to 32 layers:\n")
    print("| impl | depths | s per layer | fixed s | s/step at 32 | tokens/s at 32 | ftcli vs it at 32 |")
    print("|---|---|---|---|---|---|---|")
    lines = {}
    for impl in ("ftcli", "TRL", "TRL + liger", "torchtune"):
        pts = [(r["layers"], r["s_per_step"]) for r in rows if r.get("impl") == impl and r.get("s_per_step")]
        line = fit_line(pts)
        if line:
            lines[impl] = line
    block_len = len(blocks[0].input_ids)
    for impl, (slope, icpt) in lines.items():
        at32 = slope * 32 + icpt
        vs = f"{at32 / (lines['ftcli'][0] * 32 + lines['ftcli'][1]):.2f}x" if "ftcli" in lines and impl != "ftcli" else "-"
        depths_ = sorted(r["layers"] for r in rows if r.get("impl") == impl and r.get("s_per_step"))
        print(f"| {impl} | {depths_} | {slope:.4f} | {icpt:.3f} | {at32:.3f} | {block_len / at32:,.0f} | {vs} |")
    print("\nLosses against ftcli's at the same depth (max |difference| over the steps; step 1 alone):\n")
    for r in rows:
        if r.get("losses") and r.get("layers") in ref and r is not ref[r["layers"]]:
            a, b = r["losses"], ref[r["layers"]]["losses"]
            k = min(len(a), len(b))
            print(f"  {r['impl']} {r['layers']} layers: max |d| {max(abs(x - y) for x, y in zip(a[:k], b[:k])):.4f}, "
                  f"step 1 |d| {abs(a[0] - b[0]):.4f}")
    for r in rows:
        for note in r.get("notes") or []:
            print(f"  note {r['impl']} {r.get('layers')}: {note}")
    print(f"\ntotal {time.perf_counter() - START:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
