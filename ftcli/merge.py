"""`ftcli merge-lora`: fold a LoRA adapter into its base and write a plain Hugging Face checkpoint.

    ADAPTER_DIR (a run dir with run.json, or an adapter dir)
      -> base: --base, else run.json base_model (path beats hub id@revision), else the adapter's
         base_model_name_or_path; MXFP4 bases are dequantized (Mxfp4Config(dequantize=True))
      -> load the base once, in --dtype, and attach the adapter (PEFT); a base of another
         model_type or with other shapes is refused in one line
      -> probe logits of base+adapter  ->  merge_and_unload (in place)  ->  probe logits again
      -> check: every adapted weight now equals W + dW (to one rounding), and the logits agree
         (MoE routing pinned, see RoutingReplay); otherwise nothing is written
      -> save_pretrained(max_shard_size) + tokenizer + chat template + merge.json (the check's numbers and
         the files written), into a temporary sibling that then takes the output's place. `-o` is
         checked before anything loads: never the adapter, its run, the base or a folder holding them,
         never a dir with files merge-lora did not write; an earlier merge is replaced only with --force

Memory: the base is the only full copy that ever exists. The adapter is attached to it,
`merge_and_unload` adds each low-rank delta into its weight in place, both probes run on that same
object, and save_pretrained writes shard by shard. What comes on top is transient. Measured by benchmarks/merge_peak_rss.py on a 1.24B-param
gpt-oss (8 layers) loaded from MXFP4, 2.31 GiB in bf16: peak RSS 3.83 GiB, 0.39 GiB of it imports, so
1.49 bf16 copies; by phase: loading +0.44 GiB transient (dequantization), probes + merge +1.0 GiB
transient (expert deltas, the bf16 LoRA forward's W + dW), saving +0.3 GiB whatever the shard size.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftcli.errors import UserError
from ftcli.rundir import FINAL, RUN_JSON, RunRecord, read_run_record

PROBE_TOKENS = 48
MAX_SHARD_SIZE = "2GB"
MERGE_REPORT = "merge.json"  # the check's numbers, and the files this merge wrote (what --force may replace)
# The logits check: max |merged - (base+adapter)| over the probe, relative to max(1, max |logits|),
# with MoE routing pinned (RoutingReplay). float32 merges agree up to summation order. In bf16/fp16
# every merged weight is rounded once (W + dW -> 8 or 11 mantissa bits); measured on an 8-layer
# gpt-oss of width 1024 in bf16: 0.039 at a logit scale of 3.3 (~3 ulps), so 8 ulps is the bound.
TOLERANCE = {"float32": 1e-4, "bfloat16": 8 * 2**-8, "float16": 8 * 2**-11}


def run_merge(adapter_dir: Path, *, base: str | None, output: Path | None, dtype: str, recipe, force: bool) -> None:
    """The CLI command: merge, verify, save, and print one summary line."""
    from rich.console import Console

    out, report = _merge(adapter_dir, base=base, output=output, dtype=dtype, recipe=recipe, force=force)
    Console(stderr=True).print(
        f"merged {report['adapter']} into {report['base']} -> {out}  "
        f"(check: max |merged - (base+adapter)| = {report['max_abs_diff']:.3g} over {report['probe_tokens']} probe "
        f"tokens with MoE routing pinned ({report['routing_ties']} near-tie choices replayed), tolerance "
        f"{report['tolerance']:.3g}; the adapter itself moves logits by up to {report['adapter_effect']:.3g})",
        highlight=False, soft_wrap=True,
    )


def merge_lora(adapter_dir: Path, *, base: str | None = None, output: Path | None = None, dtype: str = "bfloat16",
               recipe=None, force: bool = False) -> Path:
    """Merge, verify and save; returns the output dir (what `ftcli register` calls)."""
    return _merge(adapter_dir, base=base, output=output, dtype=dtype, recipe=recipe, force=force)[0]


# ------------------------------------------------------------------------------------- resolution
@dataclass(frozen=True)
class BaseRef:
    """The base an adapter was trained on: a local dir, or a hub repo id at a revision."""

    path: Path | None = None
    id: str | None = None
    revision: str | None = None

    @property
    def local(self) -> bool:
        return self.path is not None

    @property
    def ref(self) -> str:
        """What from_pretrained takes: the dir, or the hub id."""
        return str(self.path) if self.path is not None else str(self.id)

    def __str__(self) -> str:
        return f"{self.id}@{self.revision}" if self.path is None and self.revision else self.ref


def resolve_adapter(adapter_dir: Path) -> tuple[Path, Path | None, RunRecord | None]:
    """(adapter dir, run dir or None, run.json or None) for a run dir, <run>/final, or a bare adapter."""
    path = Path(adapter_dir).expanduser()
    if not path.is_dir():
        raise UserError(f"{path} is not a directory; pass a LoRA run dir (with run.json) or an adapter dir")
    path = path.resolve()
    run_dir = path if (path / RUN_JSON).is_file() else path.parent if (path.parent / RUN_JSON).is_file() else None
    run = None
    if run_dir is not None:
        run = read_run_record(run_dir)
        if run.method != "lora":
            raise UserError(f"{run_dir} is a '{run.method}' run, not a LoRA run; there is nothing to merge")
        if path == run_dir:
            path = run_dir / (run.model_dir or FINAL)
    if not (path / "adapter_config.json").is_file():
        raise UserError(f"{path} has no adapter_config.json; pass a LoRA run dir or the adapter dir it wrote")
    return path, run_dir, run


def resolve_base(adapter: Path, run_dir: Path | None, run: RunRecord | None, base: str | None = None) -> BaseRef:
    """The one base resolution of merge-lora and register: `base` (--base), else run.json base_model
    (a saved path beats the hub id@revision), else adapter_config.json's base_model_name_or_path. A
    reference that names an existing dir is that dir, which must hold config.json."""
    from ftcli.recipe import resolve_path

    recorded = run.base_model if run is not None else None
    revision = None
    if base:
        ref = base
    elif recorded is not None and recorded.path:
        path = Path(recorded.path)
        path = path if path.is_absolute() else run_dir / path
        if not (path / "config.json").is_file():
            raise UserError(f"base model dir {path} (run.json base_model.path) is missing or has no config.json")
        return BaseRef(path=path)
    elif recorded is not None and recorded.init == "random":
        raise UserError(f"{run_dir}: the base was random-init and run.json has no base_model.path to rebuild it "
                        "from; pass its dir with `ftcli merge-lora --base DIR`")
    elif recorded is not None and recorded.id:
        ref, revision = recorded.id, recorded.revision
    else:
        try:
            adapter_config = json.loads((adapter / "adapter_config.json").read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{adapter / 'adapter_config.json'}: cannot read it ({e})") from None
        ref = adapter_config.get("base_model_name_or_path")
        revision = (recorded.revision if recorded is not None else None) or adapter_config.get("revision")
        if not ref:
            raise UserError(f"{adapter}: the adapter does not say which base it belongs to; "
                            "pass it with `ftcli merge-lora --base ID_OR_DIR`")
    local = Path(resolve_path(ref, None if base else run_dir)).expanduser()  # --base: relative to the cwd
    if not local.is_dir():
        return BaseRef(id=ref, revision=revision)
    if not (local / "config.json").is_file():
        raise UserError(f"base model dir {local} has no config.json")
    return BaseRef(path=local.resolve())


def recipe_model(recipe) -> dict:
    """The recipe's `model` section as a dict (a Recipe, its dict, or None)."""
    if recipe is None:
        return {}
    data = recipe if isinstance(recipe, dict) else recipe.to_dict()
    return data.get("model") or {}


def _model_config(base: str, revision: str | None, dtype: str, run: RunRecord | None, recipe):
    """An ftcli ModelConfig for the base, with the MXFP4 flag read from the base's own config."""
    from transformers import AutoConfig

    from ftcli.recipe import ModelConfig

    if dtype not in TOLERANCE:
        raise UserError(f"--dtype {dtype}: use bfloat16, float16 or float32")
    trust = bool(recipe_model(recipe).get("trust_remote_code", False))
    try:
        config = AutoConfig.from_pretrained(base, revision=revision, trust_remote_code=trust)
    except (OSError, ValueError) as e:
        raise UserError(f"base {base!r}: cannot load its config ({str(e).splitlines()[0]}); pass --base ID_OR_DIR") from None
    recorded = run.base_model if run is not None else None
    expected = (recorded and recorded.model_type) or recipe_model(recipe).get("model_type")
    if expected and config.model_type != expected and getattr(config.get_text_config(), "model_type", None) != expected:
        raise UserError(f"base {base!r} is a '{config.model_type}' model but the adapter was trained on '{expected}'; "
                        "pass the right --base")
    model_class = (recorded and recorded.model_class) or recipe_model(recipe).get("model_class")
    if not model_class:
        archs = getattr(config, "architectures", None) or []
        model_class = "image_text_to_text" if any("ConditionalGeneration" in a for a in archs) else "causal_lm"
    quant = getattr(config, "quantization_config", None) or {}
    quant_method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if quant_method not in (None, "mxfp4"):
        raise UserError(f"base {base!r} is quantized with {quant_method}; merge into an unquantized or MXFP4 base")
    return ModelConfig(id=base, revision=revision, model_type=config.model_type, model_class=model_class, dtype=dtype,
                       quantization="mxfp4_dequantize" if quant_method == "mxfp4" else "none",
                       trust_remote_code=trust)


def _output_dir(output: Path | None, adapter: Path, run_dir: Path | None, base: BaseRef, force: bool) -> Path:
    """Where the merged model goes, checked before anything is loaded; deletes nothing. Refused: the
    adapter, its run dir, the base, any folder holding one of them, a folder inside the adapter or
    the base, and a non-empty dir that is not an earlier merge-lora output (merge.json lists the files
    it wrote; with --force such an output is replaced, by `_save_merged`, once the new merge passed)."""
    out = Path(output) if output else (run_dir / "merged" if run_dir else adapter.with_name(adapter.name + "-merged"))
    out = out.expanduser().resolve()
    for what, path in (("its run dir", run_dir), ("the adapter", adapter), ("the base model", base.path)):
        if path is None:
            continue
        path = Path(path).resolve()
        if out == path or out in path.parents:
            raise UserError(f"--output {out} would overwrite {what} ({path}); pick another dir")
        if path in out.parents and what != "its run dir":  # <run>/merged is the default
            raise UserError(f"--output {out} is inside {what} ({path}); pick another dir")
    if out.exists() and not out.is_dir():
        raise UserError(f"--output {out} is a file; pick a directory")
    _check_replaceable(out, force)
    return out


def _check_replaceable(out: Path, force: bool) -> None:
    contents = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not contents:
        return
    foreign = [name for name in contents if name not in (_merged_files(out) or ())]
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise UserError(f"{out} holds files merge-lora did not write ({shown}); merge-lora never deletes those: "
                        "pass another --output")
    if not force:
        raise UserError(f"{out} holds an earlier merge; pass --force to replace it, or --output DIR")


def _merged_files(out: Path) -> set[str] | None:
    """The files an earlier merge wrote into `out` (its merge.json says), or None when it is not one."""
    try:
        files = json.loads((out / MERGE_REPORT).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(files, list) or not all(isinstance(f, str) and "/" not in f for f in files):
        return None
    return {*files, MERGE_REPORT}


def _save_merged(model, tokenizer_src, report: dict[str, Any], out: Path, force: bool) -> None:
    """Write into a fresh temporary sibling, list the files in merge.json, then put it in place of `out`
    (an earlier merge there is removed file by file, only after the new one is complete)."""
    import tempfile

    from transformers import AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        model.save_pretrained(tmp, max_shard_size=MAX_SHARD_SIZE)
        try:
            AutoTokenizer.from_pretrained(str(tokenizer_src)).save_pretrained(tmp)
        except OSError:
            pass  # a base without tokenizer files: the merged model is still complete
        report["files"] = sorted(p.name for p in tmp.iterdir()) + [MERGE_REPORT]
        (tmp / MERGE_REPORT).write_text(json.dumps(report, indent=2) + "\n")
        if out.is_dir():
            _check_replaceable(out, force)  # again: the dir may have changed while merging
            for name in _merged_files(out) or ():
                target = out / name
                if target.is_file() or target.is_symlink():
                    target.unlink()
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ------------------------------------------------------------------------------------------ merge
def _merge(adapter_dir: Path, *, base, output, dtype, recipe, force) -> tuple[Path, dict[str, Any]]:
    import torch
    from peft import PeftModel

    from ftcli.modeling import load_model

    adapter, run_dir, run = resolve_adapter(adapter_dir)
    resolved = resolve_base(adapter, run_dir, run, base)
    base_ref = resolved.ref
    out = _output_dir(output, adapter, run_dir, resolved, force)  # refuse before any loading
    cfg = _model_config(base_ref, resolved.revision, dtype, run, recipe)

    model = load_model(cfg)
    model.eval()
    try:
        model = PeftModel.from_pretrained(model, str(adapter))
    except (RuntimeError, ValueError, KeyError) as e:
        raise UserError(f"the adapter in {adapter} does not fit base {base_ref!r}: {_first_problem(e)}") from None
    _check_all_adapter_weights_loaded(model, adapter, base_ref)

    probe = _probe_batch(model.config.get_text_config().vocab_size)
    routing = RoutingReplay(model)
    with torch.no_grad():
        with model.disable_adapter():
            base_logits = model(input_ids=probe).logits.float()
        with routing.record():
            adapted = model(input_ids=probe).logits.float()
        expected = _expected_merged_slices(model)
        model = model.merge_and_unload()
        with routing.replay():
            merged = model(input_ids=probe).logits.float()
        _check_merged_weights(model, expected, dtype)
    routing.remove()
    report = _compare_logits(merged, adapted, base_logits, dtype)
    report.update(adapter=str(adapter), base=base_ref, routing_ties=routing.flips)
    if not report["passed"]:
        raise UserError(f"merge check failed: merged logits differ from base+adapter by up to {report['max_abs_diff']:.3g} "
                        f"on {report['tokens_over_tolerance']} of {report['probe_tokens']} probe tokens "
                        f"(tolerance {report['tolerance']:.3g}); nothing was written")

    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config  # the weights are dequantized now
    model.hf_quantizer = None
    _save_merged(model, adapter if _has_tokenizer(adapter) else base_ref, report, out, force)
    return out, report


class RoutingReplay:
    """MoE routers (modules that return top-k expert indices, e.g. GptOssTopKRouter) record their
    choices on the base+adapter probe and replay them on the merged one. In bf16 the merged weights
    are rounded, and a token whose router sits on a near tie can then pick another expert: a real but
    discontinuous change that would swamp the comparison (seen on random-weight models: median logit
    differences of 0.2 at a logit scale of 3). With the routing pinned the check measures what the
    merge did to the weights; `flips` counts the (token, layer) choices that differed."""

    def __init__(self, model) -> None:
        self.routers = [m for m in model.modules() if type(m).__name__.endswith("Router") and hasattr(m, "top_k")]
        self.saved: dict[int, list] = {}
        self.mode, self.flips = None, 0
        self.handles = [m.register_forward_hook(self._hook) for m in self.routers]

    def _hook(self, module, args, output):
        if self.mode == "record":
            self.saved.setdefault(id(module), []).append(output)
        elif self.mode == "replay":
            recorded = self.saved[id(module)].pop(0)
            self.flips += int((recorded[-1].sort(-1).values != output[-1].sort(-1).values).any(-1).sum())
            return recorded
        return None

    @contextlib.contextmanager
    def record(self):
        self.mode = "record"
        yield
        self.mode = None

    @contextlib.contextmanager
    def replay(self):
        self.mode = "replay"
        yield
        self.mode = None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _compare_logits(merged, adapted, base_logits, dtype: str) -> dict[str, Any]:
    scale = max(1.0, adapted.abs().max().item())
    per_token = (merged - adapted).abs().amax(-1).flatten()
    tolerance = TOLERANCE[dtype] * scale
    over = int((per_token > tolerance).sum())
    return {"max_abs_diff": per_token.max().item(), "median_token_diff": per_token.median().item(),
            "tolerance": tolerance, "tokens_over_tolerance": over,
            "adapter_effect": (adapted - base_logits).abs().max().item(), "probe_tokens": per_token.numel(),
            "passed": over == 0}


def _expected_merged_slices(peft_model) -> dict[str, tuple]:
    """For every adapted weight, a few rows of (base weight, low-rank delta) taken before the merge,
    keyed by the weight's name in the merged model (exactness check of the merge itself)."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    expected = {}
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer) or "default" not in module.lora_A:
            continue
        target = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if isinstance(module, ParamWrapper):
            target, weight = f"{target}.{module.parameter_name}", module.get_param()
        else:
            target, weight = f"{target}.weight", module.get_base_layer().weight
        delta = module.get_delta_weight("default")
        expected[target] = (weight[:1].detach().float().clone(), delta[:1].detach().float().clone())
    return expected


def _check_merged_weights(model, expected: dict[str, tuple], dtype: str) -> None:
    import torch

    params = dict(model.named_parameters())
    eps = torch.finfo(getattr(torch, dtype)).eps
    for name, (w0, delta) in expected.items():
        if name not in params:
            raise UserError(f"merge check failed: {name} is missing after merge_and_unload; nothing was written")
        got = params[name][:1].float()
        bound = 2 * eps * (w0.abs() + delta.abs()) + 1e-30
        if not bool(((got - (w0 + delta)).abs() <= bound).all()):
            raise UserError(f"merge check failed: {name} did not receive its LoRA delta; nothing was written")


def _has_tokenizer(d: Path) -> bool:
    return any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def _probe_batch(vocab_size: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (2, PROBE_TOKENS // 2), generator=g)


def _first_problem(e: Exception) -> str:
    import re

    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in lines:
        m = re.match(r"size mismatch for (\S+): copying a param with shape torch.Size\((\[.*?\])\) from checkpoint, "
                     r"the shape in current model is torch.Size\((\[.*?\])\)", ln)
        if m:
            name = m.group(1).removeprefix("base_model.model.").replace(".default", "")
            return f"{name} is {m.group(2)} in the adapter but {m.group(3)} on this base"
    return lines[0] if lines else type(e).__name__


def _check_all_adapter_weights_loaded(model, adapter: Path, base_ref: str) -> None:
    """PEFT only warns about adapter tensors that found no place in the base; that is a wrong base."""
    from safetensors import safe_open

    path = adapter / "adapter_model.safetensors"
    if not path.is_file():
        return
    with safe_open(str(path), "pt") as f:
        saved = set(f.keys())
    loaded = {name.replace(".default", "") for name, _ in model.named_parameters() if "lora_" in name}
    missing = sorted(saved - loaded)
    if missing:
        raise UserError(f"the adapter in {adapter} does not fit base {base_ref!r}: {len(missing)} adapter tensors "
                        f"have no place in it (e.g. {missing[0]})")
