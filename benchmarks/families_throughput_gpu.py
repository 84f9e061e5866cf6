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

The parts (KEY@LAYERS; VARIANTS below says what each ftcli variant sets): ftcli as llama3-8b-h100 ships it
(`shipped`: fused_ops), `plain`, each lever alone on top of shipped (`fwd_grad`: loss.impl=chunked_fwd_grad;
`reshard_last`: the last layer and the LM head resharded after forward as before; `liger_loss`, `full_loss`),
`fused_regions`, `best` (fused_ops + chunked_fwd_grad + compile=regions) and `fp8` (best + fp8, measured alone),
against TRL, torchtune and TRL + liger. One process runs the eager ftcli parts, then TRL; torchtune runs in a
subprocess (its own torchao), the compiled ftcli parts in one more (~10 s to start: after a compiled run, later
ftcli runs of the same process failed in the chunked loss's recompute), TRL + liger last (it patches transformers'
classes). --parts always run; --optional ones join by priority while the estimates fit --budget-s, and every part
is skipped at run time when what is left would not cover it and the required parts after it. shipped@4, best@4
and TRL@4 profile their second-to-last step (torch.profiler: kernel time by category, and the time no kernel ran);
With --snapshot, shipped@4 takes a CUDA memory snapshot of step 3 (its peak's largest live blocks in the notes).

H200 (one call, ~450 s estimated with every optional part):
  source .gpu/activate.sh && (extract .gpu-ao, tt.tar.xz) && \
    python benchmarks/families_throughput_gpu.py --torchtune-path /tmp/tt/site-ao:/tmp/tt/site --budget-s 480
CPU logic check (tiny Llama at 2 and 3 layers for 4 and 8, 512-token blocks, GPU-only settings dropped):
  python benchmarks/families_throughput_gpu.py --tiny
  (torchtune: --torchtune-path DIR puts a torchtune 0.6.1 + torchao 0.10 + omegaconf site first on its
  subprocess' path; torchtune 0.6.1 does not import with torchao 0.18, ftcli's fp8 pin. On the CPU dev machine its
  imports also need sentencepiece and tiktoken: `pip install --target /tmp/tt-extra sentencepiece tiktoken` and add
  /tmp/tt-extra to --torchtune-path. The CPU profile stands top-level aten ops in for kernels: a logic check only.)
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

import common
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
    tokenizer = data.load_tokenizer(recipe.model, recipe.data)
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


# ------------------------------------------------------------------------------------------------ profile
# Kernel categories, first match wins (lower-case fragments of kernel names; on CPU of aten op names)
KERNEL_CATEGORIES = (
    ("comm", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "flex")),
    ("loss", ("cross_entropy", "crossentropy", "log_softmax", "softmax", "nll_loss", "logsumexp")),
    ("GEMM", ("gemm", "cutlass", "cublas", "nvjet", "xmma", "matmul", "splitk", "scaled_mm", "aten::mm", "aten::addmm",
              "aten::bmm", "aten::linear")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("reduce-norm", ("rms", "norm", "reduce", "triton_red", "triton_per", "aten::sum", "aten::mean")),
    ("copy", ("copy", "memcpy", "memset", "cat", "index", "gather", "scatter", "fill", "embedding", "split", "clone",
              "transpose", "aten::to")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "silu", "swiglu", "mul", "add", "triton_poi", "rope",
                     "exp", "aten::")),
)


def kernel_category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in KERNEL_CATEGORIES if any(k in low for k in keys)), "other")


def kernel_table(events, wall_s: float) -> dict:
    """Kernel time by category over one profiled step, the GPU's busy time (the union of the kernels' spans) and
    the step's wall time; wall - busy is the time no kernel ran (host-bound: launches, syncs, Python). On CPU (the
    --tiny check) the top-level aten ops stand in for kernels."""
    from torch.autograd import DeviceType

    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    source = "CUDA kernels"
    if not kernels:
        kernels = [e for e in events if e.cpu_parent is None and e.name.startswith("aten::")]
        source = "top-level CPU ops (no CUDA)"
    by_cat: dict[str, float] = {}
    by_name: dict[str, float] = {}
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    for e in kernels:
        us = e.time_range.end - e.time_range.start
        cat = kernel_category(e.name)
        by_cat[cat] = by_cat.get(cat, 0.0) + us
        by_name[f"{cat}: {e.name}"] = by_name.get(f"{cat}: {e.name}", 0.0) + us
    busy, end = 0.0, None
    for a, b in spans:
        if end is None or a > end:
            busy, end = busy + (b - a), b
        elif b > end:
            busy, end = busy + (b - end), b
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
    return dict(source=source, kernels=len(kernels), wall_ms=wall_s * 1e3, busy_ms=busy / 1e3,
                categories={c: us / 1e3 for c, us in sorted(by_cat.items(), key=lambda kv: -kv[1])},
                top=[(n[:90], us / 1e3) for n, us in top])


class StepProfiler:
    """torch.profiler over step `step` (0-based) of a run: started when that step starts, stopped when the next one
    starts (the loops sync at the end of every step); `result` is its kernel_table (or the error)."""

    def __init__(self, step: int | None):
        self.step, self.prof, self.result, self.t0 = step, None, None, 0.0

    def at_step_start(self, i: int) -> None:
        if self.step is None or self.result is not None:
            return
        import torch

        try:
            if i == self.step and self.prof is None:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                    torch.cuda.synchronize()
                self.prof = torch.profiler.profile(activities=acts)
                self.prof.start()
                self.t0 = time.perf_counter()
            elif i == self.step + 1 and self.prof is not None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                wall = time.perf_counter() - self.t0
                self.prof.stop()
                self.result = kernel_table(self.prof.events(), wall)
                self.prof = None
        except Exception as e:  # noqa: BLE001 - a profiler failure must not lose the run's timing
            self.result, self.prof = {"error": f"{type(e).__name__}: {e}"[:200]}, None


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
              *, root_layout: bool = False, keep_last: bool = True, snapshot_step: int | None = None,
              profile_step: int | None = None) -> dict:
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
    profiler = StepProfiler(profile_step)

    def feed(_stream):
        for i, b in enumerate(blocks):
            profiler.at_step_start(i)
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
    before = parallelize.SEPARATE_EMBEDDING_UNITS, parallelize.KEEP_LAST_UNITS_GATHERED
    parallelize.SEPARATE_EMBEDDING_UNITS, parallelize.KEEP_LAST_UNITS_GATHERED = not root_layout, keep_last
    base = common.reset_peak()
    try:
        result = train(recipe, run_dir, None, blocks=feed)
    finally:
        parallelize.SEPARATE_EMBEDDING_UNITS, parallelize.KEEP_LAST_UNITS_GATHERED = before
        if snapshot_step is not None:  # a run that failed mid-way must not leave the recording on for the next ones
            torch.cuda.memory._record_memory_history(enabled=None)
    peak = common.peak_gib()
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    dts = [m["s_per_step"] for m in metrics][warmup:]
    block_len = len(blocks[0].input_ids)
    shutil.rmtree(run_dir, ignore_errors=True)
    return dict(impl=f"ftcli {label}".strip(), layers=layers, tokens_per_s=block_len / statistics.median(dts),
                s_per_step=statistics.median(dts), peak=peak, base=base,
                losses=[m["loss"] for m in metrics], steps=result.steps, notes=report, profile=profiler.result)


# --------------------------------------------------------------------------------------------------- TRL
def run_trl(layers: int, init: Path, blocks, tiny: bool, warmup: int, liger: bool,
            profile_step: int | None = None) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from ftcli.config.recipe import resolve_path

    device = "cpu" if tiny else "cuda"
    base = common.reset_peak()
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

    profiler = StepProfiler(profile_step)

    class Profile(TrainerCallback):  # after Clock: the step's end is synchronized before the profiler stops
        def on_step_begin(self, args, state, control, **kw):
            profiler.at_step_start(state.global_step)

        def on_step_end(self, args, state, control, **kw):
            profiler.at_step_start(state.global_step)  # global_step is the next step's index here

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
                         callbacks=[Clock(), Profile()])
    trainer.train()
    peak = common.peak_gib()
    block_len = len(blocks[0].input_ids)
    rate = steady(times, block_len, warmup)
    del trainer, model
    return dict(impl="TRL + liger" if liger else "TRL", layers=layers, tokens_per_s=rate, s_per_step=block_len / rate,
                peak=peak, base=base, losses=losses, steps=len(losses),
                notes=[f"grad norms: {' '.join(f'{x:.3g}' for x in norms if x is not None)}"], profile=profiler.result)


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
            row["base"] = common.reset_peak()
            recipe = FullFinetuneRecipeSingleDevice(cfg=cfg)
            recipe.setup(cfg=cfg)
            recipe.save_checkpoint = lambda epoch: None  # the benchmark writes no model
            recipe.train()
            recs = this.TTLogger.records
            block_len = int(np.load(args.tt_blocks)["input_ids"].shape[1])
            rate = steady([t for t, _ in recs], block_len, args.warmup)
            row.update(tokens_per_s=rate, s_per_step=block_len / rate, peak=common.peak_gib(),
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


# ------------------------------------------------------------------------------------------------- parts
SHIPPED = ["training.fused_ops=[rms_norm,swiglu]"]  # ftcli/recipes/llama3-8b-h100.yaml's
FWD_GRAD = ["training.loss.impl=chunked_fwd_grad"]
REGIONS = ["training.compile=regions"]
GPU_ONLY = ("training.fused_ops", "training.compile", "training.precision.fp8", "training.loss.impl=liger")
# key: (recipe settings, run_ftcli flags, compiled, what it is). Compiled variants run in one subprocess of their
# own, after the eager ftcli runs of this process.
VARIANTS = {
    "shipped": (SHIPPED, {}, False, "as llama3-8b-h100 ships it: fused_ops rms_norm + swiglu, chunked loss"),
    "plain": ([], {}, False, "no fused ops"),
    "fwd_grad": (SHIPPED + FWD_GRAD, {}, False, "shipped + loss.impl=chunked_fwd_grad (no LM-head recompute)"),
    "reshard_last": (SHIPPED, {"keep_last": False}, False,
                     "shipped, last layer + LM head resharded after forward (the layout before this change)"),
    "liger_loss": (SHIPPED + ["training.loss.impl=liger"], {}, False, "shipped + loss.impl=liger"),
    "full_loss": (SHIPPED + ["training.loss.impl=full"], {}, False, "shipped + loss.impl=full (T x V fp32 logits)"),
    "root": (SHIPPED, {"root_layout": True, "snapshot_step": 3}, False, "shipped, embeddings + LM head in the root"),
    "bf16master": (SHIPPED + ["training.precision.master_dtype=bfloat16"], {}, False, "shipped, bf16 masters"),
    "fused_regions": (SHIPPED + REGIONS, {}, True, "shipped + compile=regions"),
    "best": (SHIPPED + FWD_GRAD + REGIONS, {}, True, "fused_ops + chunked_fwd_grad + compile=regions (bf16)"),
    "fp8": (SHIPPED + FWD_GRAD + REGIONS + ["training.precision.fp8=true"], {}, True, "best + fp8 (alone: not bf16)"),
}
PEERS = ("trl", "torchtune", "trl_liger")
# what runs by default, at these depths; the first list always (unless the budget is gone), the second in this order
# of priority while the plan's estimates fit the budget
REQUIRED = ["shipped@4", "shipped@8", "fwd_grad@4", "fwd_grad@8", "trl@4", "trl@8", "torchtune@4", "torchtune@8",
            "best@4", "best@8", "trl_liger@4", "trl_liger@8"]
OPTIONAL = ["fused_regions@8", "fp8@8", "plain@4", "reshard_last@4", "liger_loss@4", "plain@8", "full_loss@4",
            "fused_regions@4", "fp8@4"]
PROFILED = {"shipped@4", "best@4", "trl@4"}  # a kernel-time table of their second-to-last step
SNAPSHOT = {"shipped@4": 3}  # with --snapshot: a CUDA memory snapshot of step 3 (its peak's live blocks in the notes)
# Off by default: on the H200 (torch 2.11) the chunked loss's checkpoint recompute failed with "SystemError:
# cross_entropy_loss returned NULL" while the memory history recorded Python stacks, and in every later chunked run
# of the process (the recording stayed on); `ftcli train` with the same loss ran (families_train_gpu.py)
SNAPSHOT_ON = False
GROUPS = ("eager", "trl", "torchtune", "compiled", "trl_liger")  # the order they run in


def parse_part(token: str) -> tuple[str, int]:
    key, _, n = token.partition("@")
    assert key in VARIANTS or key in PEERS, f"unknown part {key!r}: one of {[*VARIANTS, *PEERS]}"
    return key, int(n)


def group_of(key: str) -> str:
    return key if key in PEERS else ("compiled" if VARIANTS[key][2] else "eager")


def estimate_s(key: str, n: int, tiny: bool) -> float:
    """Seconds a part takes on one H200, load and 10 steps (2026-12-02's call 2 ran four 8-layer parts, one of them
    compile=regions, with the init in ~95 s; torchtune ~40 s per depth), + ~5 s for a profile or a memory snapshot."""
    if tiny:
        return 40.0 if key == "torchtune" else 12.0
    extra = 5.0 if f"{key}@{n}" in PROFILED | set(SNAPSHOT) else 0.0
    if key == "torchtune":
        return 40.0
    if key in ("trl", "trl_liger"):
        return 10 + 1.0 * n + extra
    return 10 + 1.0 * n + (3 + 0.5 * n if VARIANTS[key][2] else 0) + (3 if key == "fp8" else 0) + extra


WORKER_START_S = 12.0  # the compiled parts' subprocess: imports, CUDA init, the blocks read from the cache


def variant_sets(key: str, tiny: bool) -> tuple[list[str], dict]:
    sets, flags, _, _ = VARIANTS[key]
    if tiny:  # CPU: no Triton kernels, no compile, no fp8; the logic (and chunked_fwd_grad, keep_last) still runs
        sets = [x for x in sets if not x.startswith(GPU_ONLY)]
    return sets, dict(flags)


TINY_DEPTHS = {4: 2, 8: 3}  # --tiny: the tiny model at 2 and 3 layers stands in for 4 and 8


def as_tiny(token: str) -> str:
    key, _, n = token.partition("@")
    return f"{key}@{TINY_DEPTHS.get(int(n), int(n))}"


def profile_step(token: str, tiny: bool, steps: int) -> int | None:
    """The second-to-last step for the PROFILED parts (the last one asks for no next block, which stops it)."""
    return steps - 2 if token in {as_tiny(t) if tiny else t for t in PROFILED} else None


def run_variant(key: str, n: int, dirs: dict, blocks, work: Path, tiny: bool, warmup: int) -> dict:
    sets, flags = variant_sets(key, tiny)
    token = f"{key}@{n}"
    snapshot = {as_tiny(t) if tiny else t: v for t, v in SNAPSHOT.items()}.get(token) if SNAPSHOT_ON else None
    row = run_ftcli(key, n, dirs[n], blocks, work, tiny, warmup, sets, snapshot_step=snapshot,
                    profile_step=profile_step(token, tiny, len(blocks)), **flags)
    row["setting"] = " ".join(x.removeprefix("training.") for x in sets) or "-"
    return row


def ftcli_worker(args) -> int:
    """In a subprocess: the compiled ftcli variants (`--worker-parts`), each skipped when it would end after
    `--budget-s` seconds of this process; one ROW line each."""
    work = Path(args.work)
    _, blocks = ftcli_blocks(args.tiny, args.steps, work)
    log(f"compiled-parts worker ready (startup {time.perf_counter() - START:.1f}s)")
    dirs = {n: work / f"init-{n}" for n in range(1, 200) if (work / f"init-{n}").exists()}
    warmup = 1 if args.tiny else args.warmup
    for i, token in enumerate(args.worker_parts):
        key, n = parse_part(token)
        left = args.budget_s - (time.perf_counter() - START)
        reserve = 0.0 if token in args.worker_required else sum(
            estimate_s(*parse_part(t), args.tiny) for t in args.worker_parts[i + 1:] if t in args.worker_required)
        if left < estimate_s(key, n, args.tiny) + reserve:
            row = dict(impl=f"ftcli {key}", layers=n, exit=f"skipped (time: {left:.0f}s left in the worker)")
        else:
            log(f"start ftcli {key} {n} (worker)")
            try:
                row = run_variant(key, n, dirs, blocks, work, args.tiny, warmup)
            except Exception as e:  # noqa: BLE001 - one failed part still reports the others
                import traceback

                traceback.print_exc()
                row = dict(impl=f"ftcli {key}", layers=n, exit=f"{type(e).__name__}: {e}"[:300])
        print("ROW", json.dumps(row), flush=True)
    return 0


def run_worker(tokens: list[str], required: list[str], work: Path, args, timeout: float) -> list[dict]:
    cmd = [sys.executable, __file__, "--ftcli-worker", "--work", str(work), "--steps", str(args.steps), "--warmup",
           str(args.warmup), "--budget-s", str(timeout - 5), "--worker-parts", *tokens, "--worker-required",
           *required, *(["--tiny"] if args.tiny else [])]
    started = time.perf_counter()
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        out, err, rc = res.stdout, res.stderr, res.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err, rc = f"timeout {timeout:.0f}s", None
    for line in out.splitlines():
        if line.startswith(("[", "done:", "packed kernels", "compile", "fp8", "float8")):  # its log, not the data lines
            print("  worker|", line, flush=True)
    rows = [json.loads(x[4:]) for x in out.splitlines() if x.startswith("ROW ")]
    if rc != 0 or len(rows) < len(tokens):
        log(f"compiled-parts worker rc {rc}:\n" + (err or "")[-2500:])
    log(f"compiled-parts worker: {time.perf_counter() - started:.0f}s for {len(tokens)} parts")
    done = {(r["impl"], r["layers"]) for r in rows}
    return rows + [dict(impl=f"ftcli {parse_part(t)[0]}", layers=parse_part(t)[1], exit=f"worker rc {rc}")
                   for t in tokens if (f"ftcli {parse_part(t)[0]}", parse_part(t)[1]) not in done]


# ---------------------------------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=REQUIRED,
                        help="KEY@LAYERS that run whatever the plan says (KEY: a variant of VARIANTS or trl, "
                             "torchtune, trl_liger); they run in groups: eager ftcli, TRL, torchtune (subprocess), "
                             "compiled ftcli (one subprocess), TRL + liger (last: liger patches transformers' classes)")
    parser.add_argument("--optional", nargs="*", default=OPTIONAL,
                        help="KEY@LAYERS added in this order of priority while the estimates fit --budget-s")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=500.0, help="the script's whole time; skip what would not fit")
    parser.add_argument("--torchtune-path", default=None)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--snapshot", action="store_true", help="the CUDA memory snapshot of SNAPSHOT's parts")
    parser.add_argument("--work", default=None)
    parser.add_argument("--torchtune-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ftcli-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-parts", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--worker-required", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, nargs="+", help=argparse.SUPPRESS)  # the torchtune worker's
    parser.add_argument("--tt-init", help=argparse.SUPPRESS)
    parser.add_argument("--tt-blocks", help=argparse.SUPPRESS)
    parser.add_argument("--tt-config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global SNAPSHOT_ON
    SNAPSHOT_ON = args.snapshot
    if args.torchtune_worker:
        return torchtune_worker(args)
    if args.tiny:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if args.ftcli_worker:
            return ftcli_worker(args)
        args.parts, args.optional = [as_tiny(t) for t in args.parts], [as_tiny(t) for t in args.optional]
    if args.ftcli_worker:
        return ftcli_worker(args)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(args.work or tempfile.mkdtemp(prefix="ftcli-fam-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    warmup = 1 if args.tiny else args.warmup
    recipe, blocks = ftcli_blocks(args.tiny, args.steps, work)
    cfg = model_config(recipe)
    required = [parse_part(t) for t in args.parts]
    optional = [parse_part(t) for t in args.optional if parse_part(t) not in required]

    # ---- the plan: every required part, then optional ones by priority while the estimates fit
    def cost(parts) -> float:
        total = sum(estimate_s(k, n, args.tiny) for k, n in parts)
        return total + (WORKER_START_S if any(group_of(k) == "compiled" for k, _ in parts) else 0)

    chosen = list(required)
    init_s = 10.0 if args.tiny else 20.0
    for part_ in optional:
        if init_s + cost(chosen + [part_]) <= args.budget_s - (time.perf_counter() - START):
            chosen.append(part_)
    left_out = [p_ for p_ in optional if p_ not in chosen]
    log(f"plan (~{init_s + cost(chosen):.0f}s estimated of {args.budget_s:.0f}s): "
        + " ".join(f"{k}@{n}" for k, n in chosen) + (f"; left out by the budget: "
        + " ".join(f"{k}@{n}" for k, n in left_out) if left_out else ""))
    depths = sorted({n for _, n in chosen})
    dirs = write_init(cfg, depths, work, device)
    blocks_path = work / "blocks.npz"
    save_blocks(blocks, blocks_path)
    trained = [int(b.num_trained_tokens) for b in blocks]
    log(f"{len(blocks)} blocks of {len(blocks[0].input_ids)} tokens, trained tokens per block {trained}; init at "
        f"{max(depths)} layers written to {work}")

    rows: list[dict] = []
    by_group = {g: [(k, n) for k, n in chosen if group_of(k) == g] for g in GROUPS}
    for g in by_group:
        by_group[g].sort(key=lambda kn: (kn not in required, kn[1]))  # required first, shallow first

    def reserve_after(group: str) -> float:
        """What the required parts of the later groups need."""
        later = GROUPS[GROUPS.index(group) + 1:]
        return cost([kn for g in later for kn in by_group[g] if kn in required])

    def emit(got):
        for r in got if isinstance(got, list) else [got]:
            rows.append(r)
            print("ROW", json.dumps(r), flush=True)

    def fits(kn, group: str) -> bool:
        left = args.budget_s - (time.perf_counter() - START)
        need = estimate_s(*kn, args.tiny) + (0 if kn in required else reserve_after(group))
        if left < need:
            log(f"skip {kn[0]}@{kn[1]}: {left:.0f}s left, ~{need:.0f}s needed")
            emit(dict(impl=kn[0], layers=kn[1], exit="skipped (time)"))
            return False
        return True

    def guarded(name: str, fn):
        log(f"start {name}")
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - one failed part still prints the others
            import traceback

            traceback.print_exc()
            return dict(impl=name, layers=None, exit=f"{type(e).__name__}: {e}"[:300])

    for group in GROUPS:
        parts = by_group[group]
        if not parts:
            continue
        if group == "torchtune":
            layers = [n for kn in parts if fits(kn, group) for n in [kn[1]]]
            if layers:
                left = args.budget_s - (time.perf_counter() - START) - reserve_after(group)
                emit(guarded("torchtune", lambda: run_torchtune(layers, dirs, blocks_path, cfg, work, args.steps, warmup,
                                                               args.torchtune_path, max(30.0, left))))
        elif group == "compiled":
            left = args.budget_s - (time.perf_counter() - START) - reserve_after(group)
            # compile=regions with the chunked loss first: after a compiled run, a chunked-loss recompute in the same
            # process failed before (VARIANTS' comment); the others use chunked_fwd_grad (no recompute)
            parts.sort(key=lambda kn: kn[0] != "fused_regions")
            tokens = [f"{k}@{n}" for k, n in parts]
            needed = [f"{k}@{n}" for k, n in parts if (k, n) in required]
            emit(guarded("compiled worker", lambda: run_worker(tokens, needed, work, args, max(30.0, left))))
        else:
            for kn in parts:
                if not fits(kn, group):
                    continue
                key, n = kn
                if group == "eager":
                    emit(guarded(f"ftcli {key} {n}", lambda: run_variant(key, n, dirs, blocks, work, args.tiny, warmup)))
                else:
                    emit(guarded(f"{key} {n}", lambda: run_trl(
                        n, dirs[n], blocks, args.tiny, warmup, key == "trl_liger",
                        profile_step=profile_step(f"{key}@{n}", args.tiny, len(blocks)))))
    print_tables(rows, blocks, warmup, args.tiny)
    print(f"\ntotal {time.perf_counter() - START:.0f}s")
    return 0


PEER_IMPL = {"TRL": "TRL", "TRL + liger": "TRL+liger", "torchtune": "torchtune"}


def print_tables(rows: list[dict], blocks, warmup: int, tiny: bool) -> None:
    block_len = len(blocks[0].input_ids)
    print(f"\nLlama-3.1-8B width{' (tiny CPU mode: GPU-only settings dropped)' if tiny else ''}, {block_len}-token "
          f"blocks, full activation checkpointing, {len(blocks)} steps, medians over steps > {warmup}\n")
    ok = [r for r in rows if r.get("layers") is not None and r.get("tokens_per_s")]
    peers = {(r["impl"], r["layers"]): r for r in ok if r["impl"] in PEER_IMPL}
    shipped = {r["layers"]: r for r in ok if r["impl"] == "ftcli shipped"}
    print("| impl | layers | tokens/s | s/step | peak GiB | step-1 loss | loss step 1..N | exit |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        losses = r.get("losses") or []
        print(f"| {r['impl']} | {r.get('layers') if r.get('layers') is not None else '-'} | "
              f"{fmt(r.get('tokens_per_s'))} | {fmt(r.get('s_per_step'), '.3f')} | {fmt(r.get('peak'), '.1f')} | "
              f"{fmt(losses[0] if losses else None, '.4f')} | {' '.join(f'{x:.3f}' for x in losses)} | "
              f"{' '.join(str(r.get('exit', 0)).split())[:160]} |")
    print("\nftcli variants against the peers at the same depth (same call): tokens/s ratios, peak GiB - TRL's, "
          "max |loss difference| over the steps:\n")
    print("| ftcli | layers | vs shipped | vs TRL | vs TRL+liger | vs torchtune | peak - TRL | |d loss| TRL | "
          "|d loss| shipped | setting |")
    print("|---|---|---|---|---|---|---|---|---|---|")

    def ratio(a, b):
        return f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x" if a and b else "-"

    def dloss(a, b):
        if not (a and b and a.get("losses") and b.get("losses")):
            return "-"
        k = min(len(a["losses"]), len(b["losses"]))
        return f"{max(abs(x - y) for x, y in zip(a['losses'][:k], b['losses'][:k])):.4f}"

    for r in ok:
        if not r["impl"].startswith("ftcli"):
            continue
        n = r["layers"]
        trl = peers.get(("TRL", n))
        peak = f"{r['peak'] - trl['peak']:+.1f}" if trl and r.get("peak") is not None and trl.get("peak") else "-"
        print(f"| {r['impl'].removeprefix('ftcli ')} | {n} | {ratio(r, shipped.get(n))} | {ratio(r, trl)} | "
              f"{ratio(r, peers.get(('TRL + liger', n)))} | {ratio(r, peers.get(('torchtune', n)))} | {peak} | "
              f"{dloss(r, trl)} | {dloss(r, shipped.get(n))} | {r.get('setting', '-')} |")
    print("\nPer layer and fixed part (least squares of s/step over the depths), extrapolated to 32 layers:\n")
    print("| impl | depths | s per layer | fixed s | s/step at 32 | tokens/s at 32 |")
    print("|---|---|---|---|---|---|")
    for impl in dict.fromkeys(r["impl"] for r in ok):
        pts = [(r["layers"], r["s_per_step"]) for r in ok if r["impl"] == impl]
        line = fit_line(pts)
        if line:
            slope, icpt = line
            at32 = slope * 32 + icpt
            print(f"| {impl} | {sorted(n for n, _ in pts)} | {slope:.4f} | {icpt:.3f} | {at32:.3f} | "
                  f"{block_len / at32:,.0f} |")
    profiled = [r for r in ok if r.get("profile")]
    if profiled:
        print("\nKernel time by category over one profiled step (ms; kernels on all streams, so they can add up to "
              "more than busy; 'no kernel' = wall - the union of kernel spans = host-bound time):\n")
        cats = list(dict.fromkeys(c for r in profiled for c in (r["profile"].get("categories") or {})))
        print("| category | " + " | ".join(f"{r['impl']} {r['layers']}" for r in profiled) + " |")
        print("|---|" + "---|" * len(profiled))
        for c in cats:
            print(f"| {c} | " + " | ".join(fmt((r["profile"].get("categories") or {}).get(c), ".1f")
                                           for r in profiled) + " |")
        for label, key in (("busy (union)", "busy_ms"), ("wall", "wall_ms")):
            print(f"| {label} | " + " | ".join(fmt(r["profile"].get(key), ".1f") for r in profiled) + " |")
        print("| no kernel | " + " | ".join(
            fmt(r["profile"]["wall_ms"] - r["profile"]["busy_ms"], ".1f") if "wall_ms" in r["profile"] else "-"
            for r in profiled) + " |")
        for r in profiled:
            prof = r["profile"]
            print(f"\n  top kernels, {r['impl']} {r['layers']} ({prof.get('source')}, {prof.get('kernels')} kernels"
                  f"{', ' + prof['error'] if 'error' in prof else ''}):")
            for name, ms in prof.get("top") or []:
                print(f"    {ms:8.2f} ms  {name}")
    for r in rows:
        for note in r.get("notes") or []:
            print(f"  note {r['impl']} {r.get('layers')}: {note}")


if __name__ == "__main__":
    sys.exit(main())
