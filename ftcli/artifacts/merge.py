"""Fold a LoRA adapter into its base and write a plain Hugging Face checkpoint (`ftcli merge-lora`, and
`ftcli register` of a LoRA run).

    ADAPTER_DIR (a run dir with run.json, or an adapter dir)
      -> base: --base, else run.json base_model (path beats hub id@revision), else the adapter's
         base_model_name_or_path; its safetensors files are read tensor by tensor, MXFP4 experts
         dequantized (ftcli.model.mxfp4)
      -> the model's skeleton on the meta device + the adapter (PEFT); a base of another model_type, without
         a module the adapter adapts, or with other shapes is refused in one line (ftcli's own checks)
      -> three streamed forwards of a probe, one unit (decoder layer / root module) of base weights
         resident at a time: base, base+adapter, and the merge (each unit merged by PEFT as it loads)
      -> check: every adapted weight now equals W + dW (to one rounding), and the logits agree
         (MoE routing pinned, see RoutingReplay); otherwise the shards written so far are removed
      -> shards written as they fill (--format plain: every weight in --dtype; mxfp4: the experts
         re-quantized by ftcli.model.mxfp4, bit for bit its quantizer) + config + tokenizer + merge.json (the
         check's numbers and the files written), in place (below). `-o` is checked before anything loads:
         never the adapter, its run, the base or a folder holding them, never a dir with files merge-lora did
         not write or a link; an earlier merge is replaced only with --force, once the new one has passed

Written in place, no large file renamed (on a Unity Catalog Volume a rename is a server-side copy of the
file): the output is published like a trained model's export (ftcli.artifacts.publish: `ftcli_export.json`
says incomplete while it changes, and lists every file's size last; `locate` refuses anything else). The
shards go straight to their final names, `model-<tag>-00001.safetensors` with a random tag and always an
index, so a new merge's shards never collide with an earlier merge's. An earlier whole merge in `-o` stays
published, untouched, while the new one streams and is checked: a failure, Ctrl-C, SIGTERM or a kill there
leaves it as it was (only a kill leaves the new shards beside it, named in `.merge-lora.pending.json`; the
next merge into `-o` removes them). Once the check passed, the earlier merge is unpublished and removed,
and the new small files and the record are written: a failure from there on leaves no model, a kill a dir
every reader refuses. The cost: for a while, both merges on disk (as with a temporary copy).

Memory: the whole model never exists. Resident at once: one unit's base weights, PEFT's delta for it
(fp32, the size of the adapted weight: for the experts of a gpt-oss layer, twice the unit's bf16 size),
one pending output shard (MAX_SHARD_SIZE), the adapter, the imports. Measured by
benchmarks/merge_peak_rss.py (peak RSS of the merge-lora process, ru_maxrss, minus that of a process that
only imports the same modules), gpt-oss-20b's shape cut to 3 layers (3.63B params, 6.76 GiB in bf16,
MXFP4 base, largest base shard 1.99 GiB, largest unit 1.53 GiB): 8.21 GiB, 4.1x the largest shard and
1.21 bf16 copies of a model that small. None of it grows with depth (the pending shard is capped), so a
deeper model of that width should stay near that figure (not measured beyond 3 layers). On the
1.24B-param "mid" gpt-oss: 2.54 GiB, where the load-everything merge it replaced took 3.44 GiB.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import secrets
import shutil
import socket
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftcli.config.errors import UserError
from ftcli.families import find_family
from ftcli.objectives import method_of
from ftcli.artifacts.resolve import BaseRef, ModelSettings, locate, read_adapter_config, resolve_base, run_dir_holding
from ftcli.artifacts.rundir import RunRecord, read_run_record
from ftcli.artifacts.publish import (EXPORT_RECORD, begin_export, export_problem, publish_export, remove_export,
                                     unpublish_export)
from ftcli.config.safe_files import entries, refuse_links, remove_tree, write_atomic
from ftcli.artifacts.tracking import first_line

PROBE_TOKENS = 48
MAX_SHARD_SIZE = "2GB"
MERGE_REPORT = "merge.json"  # the check's numbers, and the files this merge wrote (what --force may replace)
PENDING = ".merge-lora.pending.json"  # a merge writing into the dir: its pid, its shards' tag, then all its files
SHARD_NAME = re.compile(r"model-([0-9a-f]{8})-\d{5}\.safetensors")  # a merge's shards: model-<tag>-00001...
DISK_FULL = re.compile(r"No space left|Disk quota|[Ee]rrno 28\b|[Ee]rrno 122\b|os error 28|os error 122")
# The logits check: max |merged - (base+adapter)| over the probe, relative to max(1, max |logits|),
# with MoE routing pinned (RoutingReplay). float32 merges agree up to summation order. In bf16/fp16
# every merged weight is rounded once (W + dW -> 8 or 11 mantissa bits); measured on an 8-layer
# gpt-oss of width 1024 in bf16: 0.039 at a logit scale of 3.3 (~3 ulps), so 8 ulps is the bound.
TOLERANCE = {"float32": 1e-4, "bfloat16": 8 * 2**-8, "float16": 8 * 2**-11}
FORMATS = ("plain", "mxfp4")  # plain: every weight in --dtype; mxfp4: expert weights re-quantized (gpt-oss)


def merge_lora(adapter_dir: Path, *, base: str | None = None, output: Path | None = None, dtype: str = "bfloat16",
               recipe=None, force: bool = False, fmt: str = "plain") -> Path:
    """Merge, verify and save; returns the output dir (what `ftcli register` calls)."""
    return merge(adapter_dir, base=base, output=output, dtype=dtype, recipe=recipe, force=force, fmt=fmt)[0]


def merge(adapter_dir: Path, *, base: str | None = None, output: Path | None = None, dtype: str = "bfloat16",
          recipe=None, force: bool = False, fmt: str = "plain") -> tuple[Path, dict[str, Any]]:
    """Merge, verify and save; returns the output dir and the check's report (merge.json)."""
    return _merge(adapter_dir, base=base, output=output, dtype=dtype, recipe=recipe, force=force, fmt=fmt)


# ------------------------------------------------------------------------------------- resolution
def resolve_adapter(adapter_dir: Path) -> tuple[Path, Path | None, RunRecord | None]:
    """(adapter dir, run dir or None, run.json or None) for a LoRA run dir, <run>/final, or a bare adapter."""
    path = Path(adapter_dir).expanduser()
    if not path.is_dir():
        raise UserError(f"{path} is not a directory; pass a LoRA run dir (with run.json) or an adapter dir")
    run_dir = run_dir_holding(path.resolve())
    if run_dir is not None:
        run = read_run_record(run_dir)
        if not method_of(run.method).writes_adapter:
            raise UserError(f"{run_dir} is a '{run.method}' run, not a LoRA run; there is nothing to merge")
    target = locate(path)
    if target.kind != "adapter" or not (target.model_dir / "adapter_config.json").is_file():
        raise UserError(f"{target.model_dir} has no adapter_config.json; pass a LoRA run dir or the adapter dir it wrote")
    return target.model_dir, target.run_dir, target.run


def _model_config(base: str, revision: str | None, dtype: str, run: RunRecord | None, recipe):
    """An ftcli ModelConfig for the base, with the MXFP4 flag read from the base's own config."""
    from transformers import AutoConfig

    from ftcli.config.recipe import ModelConfig

    if dtype not in TOLERANCE:
        raise UserError(f"--dtype {dtype}: use bfloat16, float16 or float32")
    settings = ModelSettings.of(recipe)
    trust = settings.trust_remote_code
    from ftcli import hub

    offline = hub.offline_for(base)  # no Hub: the local HF cache only, no retries
    try:
        config = AutoConfig.from_pretrained(base, revision=revision, trust_remote_code=trust,
                                            local_files_only=bool(offline))
    except (OSError, ValueError) as e:
        if offline:
            raise UserError(hub.no_connection(f"base {base!r}", offline)) from None
        raise UserError(f"base {base!r}: cannot load its config ({first_line(e)}); pass --base ID_OR_DIR") from None
    recorded = run.base_model if run is not None else None
    expected = (recorded and recorded.model_type) or settings.model_type
    if expected and config.model_type != expected and getattr(config.get_text_config(), "model_type", None) != expected:
        raise UserError(f"base {base!r} is a '{config.model_type}' model but the adapter was trained on '{expected}'; "
                        "pass the right --base")
    model_class = (recorded and recorded.model_class) or settings.model_class
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


def default_output(adapter: Path, run_dir: Path | None) -> Path:
    """Where a merge goes without -o: <run>/merged, or `<adapter>-merged` beside a bare adapter."""
    return run_dir / "merged" if run_dir else adapter.with_name(adapter.name + "-merged")


def is_newer_merge(out: Path, adapter: Path, dtype: str, fmt: str = "plain") -> bool:
    """Does `out` hold a merge of this adapter (merge.json names it), in this dtype and format, written after
    the adapter's weights (one `ftcli register` may reuse)? <run>/final and <run>/best share <run>/merged."""
    done = out / "config.json"
    try:
        report = json.loads((out / MERGE_REPORT).read_text())
    except (OSError, ValueError):
        return False
    same = (isinstance(report, dict) and Path(str(report.get("adapter"))).resolve() == adapter.resolve()
            and report.get("dtype") == dtype and report.get("format", "plain") == fmt)
    return same and done.is_file() and any(out.glob("*.safetensors")) and export_problem(out) is None and all(
        done.stat().st_mtime >= p.stat().st_mtime for p in adapter.glob("adapter_model.*") if p.is_file())


def _output_dir(output: Path | None, adapter: Path, run_dir: Path | None, base: BaseRef, force: bool) -> Path:
    """Where the merged model goes, checked before anything is loaded; deletes nothing. Refused: the
    adapter, its run dir, the base, any folder holding one of them, a folder inside the adapter or
    the base, and a non-empty dir that is not an earlier merge-lora output (merge.json lists the files
    it wrote; with --force such an output is replaced, by `_InPlace.publish`, once the new merge passed)."""
    out = (Path(output) if output else default_output(adapter, run_dir)).expanduser().resolve()
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
    """Refuse, in one line, an output holding a link, files merge-lora did not write, a merge still running
    into it, or (without --force) an earlier merge. A killed merge's leftovers are merge-lora's: its pending
    record (PENDING) names them."""
    names = [p.name for p in entries(out)]
    if not names:
        return
    refuse_links([out / name for name in names], where="a merge-lora output", fix="remove it or pass another --output")
    pending = _pending(out)
    if pending is not None and pending.get("host", socket.gethostname()) != socket.gethostname():
        raise UserError(f"{out}: a merge-lora on {pending['host']} (pid {pending['pid']}) is writing there, or was "
                        f"killed; once it is gone, remove {out / PENDING} and {out}/model-{pending['tag']}-*.safetensors "
                        "(or pass another --output)")
    if pending is not None and pending["pid"] != os.getpid() and _running(pending["pid"]):
        raise UserError(f"{out}: another merge-lora (pid {pending['pid']}) is writing there; wait for it to end, "
                        "or pass another --output")
    ours = (_merged_files(out) or set()) | _pending_files(out, pending) | {EXPORT_RECORD, PENDING}
    foreign = [name for name in names if name not in ours]
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise UserError(f"{out} holds files merge-lora did not write ({shown}); merge-lora never deletes those: "
                        "pass another --output")
    if (out / MERGE_REPORT).is_file() and not force:
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


def _pending(out: Path) -> dict[str, Any] | None:
    """The pending record of a merge into `out` (running, or killed), or None."""
    try:
        record = json.loads((out / PENDING).read_text())
    except (OSError, ValueError):
        return None
    ok = (isinstance(record, dict) and isinstance(record.get("pid"), int) and isinstance(record.get("tag"), str)
          and isinstance(record.get("host", ""), str)
          and all(isinstance(f, str) and "/" not in f for f in record.get("files", [])))
    return record if ok else None


def _pending_files(out: Path, pending: dict[str, Any] | None) -> set[str]:
    """What the merge of `pending` has written or may have: its shards, and the files it listed before
    writing them."""
    if pending is None:
        return set()
    shards = {p.name for p in entries(out) if (m := SHARD_NAME.fullmatch(p.name)) and m[1] == pending["tag"]}
    return shards | set(pending.get("files", []))


def _whole_merge(out: Path) -> bool:
    """`out` holds an earlier merge that is complete (its export record, or for one without it, merge.json's
    list of files, all present)."""
    files = _merged_files(out)
    return (files is not None and export_problem(out) is None
            and all((out / f).is_file() for f in files - {EXPORT_RECORD}))


class _InPlace:
    """The output dir while a merge writes into it (see the module docstring, "Written in place").

        begin    no whole earlier merge: the dir is emptied of merge-lora's leftovers, its record says
                 incomplete (ftcli.artifacts.publish); a whole earlier merge stays untouched and published.
                 The pending record (pid, the shards' tag) is written.
        shards   model-<tag>-00001.safetensors ... at their final names, beside the earlier merge's files
        publish  (the check passed) the record says incomplete, the pending record lists every file of the
                 new merge, the earlier merge's files go, the small files are written, then the record lists
                 every file's size
        abort    an error, Ctrl-C, SIGTERM: the new merge's files go; an earlier merge that was not yet being
                 replaced stays as it was, published; otherwise the record goes last (a kill while aborting
                 leaves a dir every reader refuses)
    """

    def __init__(self, out: Path) -> None:
        self.out, self.tag = out, ""
        self.created = not out.exists()
        self.fresh = self.replacing = False

    def begin(self) -> None:
        out = self.out
        out.mkdir(parents=True, exist_ok=True)
        pending = _pending(out)  # a killed merge's (_check_replaceable: not a running one)
        self.fresh = not _whole_merge(out)
        if self.fresh:
            begin_export(out)  # what is left here is merge-lora's (checked): removed, the record says incomplete
        elif pending is not None:
            for name in sorted(_pending_files(out, pending) - _merged_files(out)):
                remove_tree(out / name)
        taken = {p.name for p in entries(out)}
        self.tag = next(t for t in iter(lambda: secrets.token_hex(4), None)
                        if not any(name.startswith(f"model-{t}-") for name in taken))
        write_atomic(out / PENDING, json.dumps(self._pending()) + "\n")

    def _pending(self) -> dict[str, Any]:
        """The pending record: a pid means something only on its host (a Volume is shared between machines)."""
        return {"host": socket.gethostname(), "pid": os.getpid(), "tag": self.tag}

    def shard_name(self, number: int) -> str:
        return f"model-{self.tag}-{number:05d}.safetensors"

    def publish(self, small: dict[str, bytes], shards: list[str], report: dict[str, Any], force: bool) -> None:
        out = self.out
        _check_replaceable(out, force)  # again: the dir may have changed while merging
        report["files"] = sorted([*small, *shards, MERGE_REPORT])
        if not self.fresh:
            unpublish_export(out)  # the earlier merge is unpublished before its first file goes
        write_atomic(out / PENDING, json.dumps({**self._pending(), "files": report["files"]}) + "\n")
        self.replacing = True
        if not self.fresh:
            for name in sorted((_merged_files(out) or set()) - {MERGE_REPORT, EXPORT_RECORD, PENDING}, key=str):
                remove_tree(out / name)
            (out / MERGE_REPORT).unlink(missing_ok=True)  # the earlier merge's list goes last
        small = {**small, MERGE_REPORT: (json.dumps(report, indent=2) + "\n").encode()}
        for name, data in small.items():
            with open(out / name, "xb") as f:  # O_CREAT | O_EXCL: never through a link
                f.write(data)
        for path in entries(out):  # safetensors writes its files 0600: the merged model follows the umask
            if path.is_file():
                path.chmod(0o666 & ~_umask())
        (out / PENDING).unlink()
        publish_export(out)

    def abort(self) -> None:
        out = self.out
        if not self.tag and not self.fresh:
            return  # begin never ran
        if self.fresh or self.replacing:
            remove_export(out, keep_dir=not self.created)  # the record last: a kill midway leaves a refused dir
            return
        for name in _pending_files(out, {"tag": self.tag}):  # the new shards; the earlier merge stays published
            remove_tree(out / name)
        (out / PENDING).unlink(missing_ok=True)


def _not_written(out: Path, e: BaseException, needed_bytes: int, kept: bool) -> UserError:
    """The one line for a merge that a write error (a full disk, a quota) stopped, once its files are removed."""
    problem = first_line(e)
    space = ""
    if DISK_FULL.search(problem):
        where = next((p for p in (out, *out.parents) if p.exists()), Path("/"))
        space = (f"; it needs about {needed_bytes / 2**20:,.1f} MiB, {shutil.disk_usage(where).free / 2**20:,.1f} MiB "
                 "are free there: free space")
    earlier = " (the earlier merge there is intact)" if kept else ""
    return UserError(f"merge-lora could not write the merged model to {out}: {problem}{space}; nothing half-written "
                     f"is left{earlier}")


# ------------------------------------------------------------------------------------------ merge
def _merge(adapter_dir: Path, *, base, output, dtype, recipe, force, fmt: str = "plain") -> tuple[Path, dict[str, Any]]:
    from safetensors import SafetensorError

    if fmt not in FORMATS:
        raise UserError(f"--format {fmt}: use {' or '.join(FORMATS)}")
    adapter, run_dir, run = resolve_adapter(adapter_dir)
    read_adapter_config(adapter)  # readable and LoRA's, and the weights are there, before anything loads
    if not (adapter / "adapter_model.safetensors").is_file():  # (only a pickled adapter_model.bin: refused by locate)
        raise UserError(f"{adapter} has no adapter_model.safetensors; pass the adapter dir that training wrote")
    resolved = resolve_base(adapter, run_dir, run, base)
    base_ref = resolved.ref
    out = _output_dir(output, adapter, run_dir, resolved, force)  # refuse before any loading
    cfg = _model_config(base_ref, resolved.revision, dtype, run, recipe)
    if fmt == "mxfp4" and not getattr(find_family(cfg.model_type), "mxfp4_experts", False):  # ftcli.families: gpt-oss
        raise UserError(f"--format mxfp4 writes gpt-oss expert weights; base {base_ref!r} is a '{cfg.model_type}' model")

    remove_stale_temps(out)  # an older ftcli's `.<out>.<pid>.<random>.tmp`
    merging = _Merging.prepare(cfg, resolved, adapter, dtype, fmt)  # the adapter checked against the base
    place = _InPlace(out)
    try:
        with _sigterm_ends_with_cleanup():  # SIGTERM: the except below still removes what this merge wrote
            place.begin()
            report, weight_map = merging.run(out, place.shard_name)
            report.update(adapter=str(adapter), base=base_ref, dtype=dtype, format=fmt)
            small = merging.small_files(out, weight_map, adapter if _has_tokenizer(adapter) else base_ref)
            place.publish(small, sorted(set(weight_map.values())), report, force)
    except (OSError, SafetensorError) as e:  # a full disk, a quota: one line, nothing half-written left
        kept = not place.fresh and not place.replacing
        place.abort()
        raise _not_written(out, e, merging.model_bytes, kept) from None
    except BaseException:
        place.abort()
        raise
    return out, report


@contextlib.contextmanager
def _sigterm_ends_with_cleanup() -> Iterator[None]:
    """SIGTERM (a job stopped, `kill`) raises SystemExit(143) in the block, so the merge's temp dir is removed as
    on any error; the old handler is back afterwards. Only in the main thread (where signals are delivered)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def remove_stale_temps(out: Path) -> list[Path]:
    """Remove the temp dirs of earlier merges into `out` whose process is gone (`.<out>.<pid>.<random>.tmp`:
    killed with SIGKILL, or on a machine that went down); a running merge's stays. Returns what was removed."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(\d+)\.[^/]+\.tmp")
    removed = []
    for path in entries(out.parent):
        match = pattern.fullmatch(path.name)
        if match and path.is_dir() and not path.is_symlink() and not _running(int(match[1])):
            remove_tree(path)
            removed.append(path)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# -------------------------------------------------------------------------------------- streaming
#
# The merge never holds the whole model. Its skeleton lives on the meta device (no storage; the rotary
# buffers on the CPU), the adapter is loaded whole (small), and one unit at a time -- a decoder layer,
# or one of the root modules (embeddings, final norm, LM head) -- is materialized from the base's
# safetensors files by a forward pre-hook and dropped back to meta by the forward post-hook:
#
#     probe -> embed -> layer 0 -> layer 1 -> ... -> norm -> lm_head -> logits
#              ^load/drop ^load/drop                           (one unit resident at a time)
#
# Three streamed forwards of the probe: the base (adapter disabled), base+adapter (MoE routing
# recorded), and the merge itself: the pre-hook loads the unit and merges its LoRA layers (PEFT's
# `merge`, as merge_and_unload would), the forward runs on the merged weights (routing replayed), and
# the post-hook checks them (W + dW) and hands them to the shard writer before dropping them. Host
# memory: the largest unit + one pending output shard + the adapter + what the imports take.
@dataclass
class _Merging:
    """A merge ready to stream: the base's reader, base+adapter on meta (the adapter checked against the base),
    its units, and what it writes (see above)."""

    reader: CheckpointReader
    model: Any
    config: Any
    units: list
    dtype: str
    fmt: str
    per_expert: dict
    model_bytes: int  # the base weights in --dtype (what a plain merge writes, about)

    @classmethod
    def prepare(cls, cfg, resolved: BaseRef, adapter: Path, dtype: str, fmt: str) -> "_Merging":
        import torch

        family = find_family(cfg.model_type)
        per_expert = family.per_expert_checkpoint if family else {}  # Qwen3-MoE: experts stored one linear each
        reader = CheckpointReader(_base_folder(resolved), getattr(torch, dtype), per_expert)
        model, config = _meta_peft_model(cfg, adapter, resolved.ref)
        units = _units(model)
        sizes = [sum(t.numel() * t.element_size() for n, t in m.state_dict().items() if "lora_" not in n)
                 for _, m in units]
        return cls(reader, model, config, units, dtype, fmt, per_expert, sum(sizes))

    def run(self, out: Path, shard_name) -> tuple[dict[str, Any], dict[str, str]]:
        """The three forwards, the merged shards written into `out` as `shard_name(i)`: (the check's report,
        the weight map)."""
        writer = _MergedShards(out, self.fmt, self.per_expert, shard_name)
        vocab = self.config.get_text_config().vocab_size
        try:
            report, passes = _three_forwards(self.model, self.units, self.reader, self.dtype, writer.add, vocab)
        except UserError:
            writer.discard()
            raise
        report.update(format=self.fmt, max_resident_bytes=max(p.max_resident_bytes for p in passes),
                      largest_unit_bytes=max(sum(t.numel() * t.element_size() for n, t in m.state_dict().items()
                                                 if "lora_" not in n) for _, m in self.units))
        if not report["passed"]:
            writer.discard()
            raise UserError(f"merge check failed: merged logits differ from base+adapter by up to "
                            f"{report['max_abs_diff']:.3g} on {report['tokens_over_tolerance']} of "
                            f"{report['probe_tokens']} probe tokens (tolerance {report['tolerance']:.3g}); nothing "
                            "was written")
        written, weight_map = writer.finish()
        report.update(written)
        return report, weight_map

    def small_files(self, out: Path, weight_map: dict[str, str], tokenizer_src) -> dict[str, bytes]:
        """The merged model's files besides its shards (config, index, generation config, tokenizer), in memory:
        everything that can fail is done before an earlier merge is touched."""
        import tempfile

        from transformers import AutoTokenizer

        from ftcli.model import mxfp4

        config = self.config.to_dict()
        config.pop("quantization_config", None)  # the dequantized weights, unless re-quantized below
        config["dtype"] = self.dtype
        if self.fmt == "mxfp4":
            config = mxfp4.mxfp4_config(config)
        index = {"metadata": {"total_size": sum((out / f).stat().st_size for f in set(weight_map.values()))}, "weight_map": weight_map}
        files = {"config.json": json.dumps(config, indent=2, sort_keys=True) + "\n",
                 "model.safetensors.index.json": json.dumps(index, indent=2) + "\n"}
        small = {name: text.encode() for name, text in files.items()}
        if (self.reader.folder / "generation_config.json").is_file():
            small["generation_config.json"] = (self.reader.folder / "generation_config.json").read_bytes()
        with tempfile.TemporaryDirectory() as tmp:
            try:
                AutoTokenizer.from_pretrained(str(tokenizer_src)).save_pretrained(tmp)
            except OSError:
                pass  # a base without tokenizer files: the merged model is still complete
            small.update({p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()})
        return small


def _three_forwards(model, units, reader: CheckpointReader, dtype: str, write, vocab_size: int):
    """The streamed probe forwards (base, base+adapter, merge; see above): the logits check's numbers, and the
    three passes (what each held resident)."""
    import torch

    probe = _probe_batch(vocab_size)
    routing = RoutingReplay(model)
    passes = [StreamedUnits(units, reader, dtype), StreamedUnits(units, reader, dtype),
              StreamedUnits(units, reader, dtype, merge=True, write=write)]
    with torch.no_grad():
        with passes[0], model.disable_adapter():
            base_logits = model(input_ids=probe).logits.float()
        with passes[1], routing.record():
            adapted = model(input_ids=probe).logits.float()
        with passes[2], routing.replay():
            merged = model(input_ids=probe).logits.float()
    routing.remove()
    return {**_compare_logits(merged, adapted, base_logits, dtype), "routing_ties": routing.flips}, passes


class _MergedShards:
    """The merged tensors into safetensors shards as they come (--format mxfp4: gpt-oss experts re-quantized,
    with the quantization's error measured)."""

    def __init__(self, out: Path, fmt: str, per_expert: dict[str, tuple[str, ...]] | None = None,
                 shard_name=None) -> None:
        from ftcli.model import mxfp4

        self.writer, self.fmt = mxfp4.ShardWriter(out, _shard_bytes(MAX_SHARD_SIZE), shard_name), fmt
        self.per_expert = per_expert or {}  # fused expert parameters written back in the base's per-expert layout
        self.max_abs_error = self.sq_error = self.sq_weight = 0.0

    def add(self, name: str, tensor) -> None:
        import torch

        from ftcli.model import mxfp4

        fused = next((k for k in self.per_expert if name.endswith(k)), None)
        if fused is not None:
            for e, per in enumerate(_per_expert_names(name, fused, self.per_expert[fused], tensor.shape[0])):
                for piece, part in zip(per, tensor[e].chunk(len(per), dim=0)):  # back to the base's layout
                    self.writer.add(piece, part.contiguous())
            return
        if self.fmt != "mxfp4":
            self.writer.add(name, tensor)
            return
        for disk_name, disk_tensor in mxfp4.mxfp4_tensors(name, tensor):
            self.writer.add(disk_name, disk_tensor)
        if mxfp4.expert_param_name(name):
            err = mxfp4.dequantize_mxfp4(*mxfp4.quantize_mxfp4(tensor), dtype=torch.float32) - tensor.float()
            self.max_abs_error = max(self.max_abs_error, err.abs().max().item())
            self.sq_error += err.square().sum().item()
            self.sq_weight += tensor.float().square().sum().item()

    def discard(self) -> None:
        self.writer.discard()

    def finish(self) -> tuple[dict[str, Any], dict[str, str]]:
        """The last shard written: (what the report records of the shards, the weight map)."""
        weight_map = self.writer.finish()
        report: dict[str, Any] = {"largest_shard_bytes": self.writer.largest_shard_bytes}
        if self.fmt == "mxfp4":
            report["mxfp4"] = {"max_abs_error": self.max_abs_error,
                               "relative_rms_error": (self.sq_error / max(self.sq_weight, 1e-30)) ** 0.5}
        return report, weight_map


def _shard_bytes(size: str) -> int:
    units = {"GB": 10**9, "MB": 10**6, "KB": 10**3}
    return int(float(size[:-2]) * units[size[-2:]]) if size[-2:] in units else int(size)


def _base_folder(resolved: BaseRef) -> Path:
    """The base's files on this machine: its dir, or the hub snapshot (config, safetensors; downloaded once)."""
    if resolved.local:
        return resolved.path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(resolved.id, revision=resolved.revision,
                                      allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]))
    except Exception as e:  # noqa: BLE001 - hub errors come in many classes; each is a one-line user problem
        raise UserError(f"base {resolved}: cannot download it ({first_line(e)})") from None


class CheckpointReader:
    """The base's tensors by the model's state-dict names, one at a time, from its safetensors files (one file
    or a sharded index); MXFP4 expert weights (`{name}_blocks` + `{name}_scales`) dequantized by
    `ftcli.model.mxfp4.dequantize_mxfp4` (checked against transformers' loader in
    tests/unit/model/test_lora_mxfp4.py)."""

    def __init__(self, folder: Path, dtype, per_expert: dict[str, tuple[str, ...]] | None = None) -> None:
        self.folder, self.dtype = Path(folder), dtype
        self.per_expert = per_expert or {}  # ftcli.families: fused expert parameter -> its per-expert linears
        self._handles: dict[Path, Any] = {}  # each file opened once: its header parsed once, not per tensor
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            self.files = {k: self.folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        elif (self.folder / "model.safetensors").is_file():
            single = self.folder / "model.safetensors"
            self.files = {k: single for k in self._open(single).keys()}
        else:
            raise UserError(f"base {self.folder} has no model.safetensors(.index.json); merge-lora reads safetensors")

    def _open(self, path: Path):
        """The open safetensors file `path` (opened on first use); a file safetensors cannot read (a header that
        lies about its offsets, a truncated file) is one UserError naming it."""
        if path not in self._handles:
            from safetensors import safe_open

            try:
                self._handles[path] = safe_open(str(path), "pt")
            except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: a damaged or foreign file
                raise UserError(f"base file {path}: safetensors cannot read it ({first_line(e)})") from None
        return self._handles[path]

    def _raw(self, name: str):
        path = self.files[name]
        try:
            return self._open(path).get_tensor(name)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - a header entry whose offsets or dtype do not match the data
            raise UserError(f"base file {path}: cannot read tensor {name} ({first_line(e)})") from None

    def get(self, name: str):
        from ftcli.model.mxfp4 import dequantize_mxfp4

        if name in self.files:
            return self._raw(name).to(self.dtype)
        if f"{name}_blocks" in self.files:
            return dequantize_mxfp4(self._raw(f"{name}_blocks"), self._raw(f"{name}_scales"), dtype=self.dtype)
        fused = next((k for k in self.per_expert if name.endswith(k)), None)
        if fused is not None:  # [E, sum of the linears' outputs, in]: each expert's linears concatenated, stacked
            import torch

            experts = 0
            while all(n in self.files for n in _per_expert_names(name, fused, self.per_expert[fused], experts + 1)[-1]):
                experts += 1
            if experts:
                names = _per_expert_names(name, fused, self.per_expert[fused], experts)
                return torch.stack([torch.cat([self._raw(n) for n in per]) for per in names]).to(self.dtype)
        raise UserError(f"base {self.folder}: no tensor {name} in its safetensors files")


def _per_expert_names(name: str, fused: str, linears: tuple[str, ...], experts: int) -> list[list[str]]:
    """Per expert, the checkpoint names of the linears behind the fused parameter `name`:
    `...mlp.experts.gate_up_proj` <- `...mlp.experts.{e}.gate_proj.weight`, `...mlp.experts.{e}.up_proj.weight`."""
    prefix = name[: len(name) - len(fused.rpartition(".")[2])]  # "...mlp.experts."
    return [[f"{prefix}{e}.{linear}.weight" for linear in linears] for e in range(experts)]


def _meta_peft_model(cfg, adapter: Path, base_ref: str):
    """base+adapter with every base weight on the meta device and the adapter's weights loaded (float32, as
    PEFT keeps adapters of a bf16 base). Before PEFT builds anything, the adapter is checked against the
    base: its config is LoRA's, every tensor adapts a module the base has, and (once PEFT has made the
    LoRA layers, still empty) every tensor has the shape of its slot; each misfit is one line."""
    import torch
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from peft import LoraConfig, get_peft_model, load_peft_weights

    from ftcli.model.build import DTYPES, auto_class, load_config

    config = load_config(cfg)
    config.use_cache = False
    with init_empty_weights(include_buffers=False):
        base = auto_class(cfg.model_class).from_config(config, dtype=DTYPES[cfg.dtype],
                                                        trust_remote_code=cfg.trust_remote_code)
    base.eval()
    try:
        lora = LoraConfig.from_peft_type(**read_adapter_config(adapter))
    except (TypeError, ValueError) as e:  # a value LoraConfig refuses (e.g. r: 0)
        raise UserError(f"{adapter / 'adapter_config.json'}: not a LoRA config PEFT can use ({first_line(e)})") from None
    try:
        saved = load_peft_weights(str(adapter), device="cpu")
    except Exception as e:  # noqa: BLE001 - a truncated safetensors file
        raise UserError(f"{adapter}: cannot read the adapter weights ({first_line(e)})") from None
    modules = {name for name, _ in base.named_modules()}
    _check_fit(adapter, base_ref, [k for k in saved if _adapted_module(k) not in modules], {})
    _check_ranks(adapter, lora, saved)  # PEFT makes some LoRA layers on the CPU: an absurd r would allocate them
    # as PeftModel.from_pretrained would (inference mode, eval), minus the load: its weights go in below
    lora.base_model_name_or_path, lora.inference_mode = None, True  # the base is `base`, wherever it came from
    try:
        with warnings.catch_warnings():  # "target_modules ... no module was matched": said below, in one line
            warnings.simplefilter("ignore", RuntimeWarning)
            model = get_peft_model(base, lora, low_cpu_mem_usage=True).eval()  # the LoRA layers, on meta
    except ValueError as e:  # PEFT: no target module found at all
        raise UserError(f"the adapter in {adapter} does not fit base {base_ref!r}: {first_line(e)}") from None
    slots = {name.replace(".default", ""): (name, p) for name, p in model.named_parameters() if "lora_" in name}
    _check_fit(adapter, base_ref, [k for k in saved if k not in slots], {  # in the model's order
        k: (list(saved[k].shape), list(p.shape)) for k, (_, p) in slots.items() if k in saved and saved[k].shape != p.shape},
        empty=[k for k in slots if k not in saved], unselected=True)
    for key, tensor in saved.items():
        set_module_tensor_to_device(model, slots[key][0], "cpu", value=tensor.to(torch.float32))
    return model, config


def _adapted_module(key: str) -> str:
    """An adapter tensor's name -> the base module it adapts: 'base_model.model.model.layers.0.self_attn.q_proj
    .lora_A.weight' -> 'model.layers.0.self_attn.q_proj' (and 'mlp.experts.base_layer.lora_A.weight', the second
    of two parameters adapted on one module, -> 'mlp.experts')."""
    return plain_name(key.split(".lora_")[0])


def _check_ranks(adapter: Path, lora, saved: dict) -> None:
    """adapter_config.json's ranks (r, rank_pattern) against its weights, before PEFT allocates anything: a
    LoRA weight is [r, in] or [out, r], so no rank can exceed the largest dimension of any of them."""
    largest = max((max(t.shape, default=0) for t in saved.values()), default=0)
    ranks = {"r": lora.r, **{f"rank_pattern[{k!r}]": v for k, v in (lora.rank_pattern or {}).items()}}
    for key, rank in ranks.items():
        if not isinstance(rank, int) or rank > largest:
            raise UserError(f"{adapter / 'adapter_config.json'}: {key} is {rank}, but no weight of the adapter has a "
                            f"dimension that large (the largest is {largest}); the config does not belong to these "
                            "weights")


def _check_fit(adapter: Path, base_ref: str, unplaced: list[str], shapes: dict[str, tuple[list, list]],
               empty: list[str] = (), unselected: bool = False) -> None:
    """One line for the first misfit: adapter tensors with no place in the base (or, once PEFT has made the
    LoRA layers, `unselected`: none that target_modules / target_parameters select), LoRA slots of the base
    the adapter has no weights for (e.g. a deeper base whose extra layers its target_modules also match), or
    a tensor of another shape."""
    problem = None
    if unplaced and unselected:
        problem = (f"{len(unplaced)} adapter tensors adapt modules that its adapter_config.json target_modules / "
                   f"target_parameters do not select (e.g. {sorted(unplaced)[0]})")
    elif unplaced:
        problem = f"{len(unplaced)} adapter tensors have no place in it (e.g. {sorted(unplaced)[0]})"
    elif empty:
        problem = (f"the adapter has no weights for {len(empty)} of its LoRA tensors on this base (e.g. "
                   f"{empty[0].removeprefix('base_model.model.')})")
    elif shapes:
        key, (have, want) = next(iter(shapes.items()))
        problem = f"{key.removeprefix('base_model.model.')} is {have} in the adapter but {want} on this base"
    if problem:
        raise UserError(f"the adapter in {adapter} does not fit base {base_ref!r}: {problem}")


def plain_name(peft_name: str) -> str:
    """A PEFT model's state-dict name -> the merged (plain) model's name."""
    return peft_name.removeprefix("base_model.model.").replace(".base_layer", "")


def _units(model) -> list[tuple[str, Any]]:
    """(prefix, module) of what is resident at once: each decoder layer, and each other module that holds
    base weights of its own (embeddings, final norm, LM head)."""
    from ftcli.model.build import decoder_layers

    layers = decoder_layers(model.get_base_model())
    names = {id(m): n for n, m in model.named_modules()}
    units = [(names[id(layer)], layer) for layer in layers]
    inside = tuple(prefix + "." for prefix, _ in units)
    for name, module in model.named_modules():
        own = [n for n, _ in module.named_parameters(recurse=False) if "lora_" not in name + n]
        if own and not (name + ".").startswith(inside):
            units.append((name, module))
    return units


class StreamedUnits:
    """While active: each unit's base weights are read (`reader`) in its forward pre-hook and dropped back to
    meta in its post-hook. With `merge`, the unit's LoRA layers are merged right after loading, and the
    post-hook checks each adapted weight against W + dW and passes every merged tensor to `write`."""

    def __init__(self, units, reader: CheckpointReader, dtype: str, *, merge: bool = False, write=None) -> None:
        self.units, self.reader, self.dtype, self.merge, self.write = units, reader, dtype, merge, write
        self.handles: list = []
        self.expected: dict[str, tuple] = {}
        self.resident_bytes = self.max_resident_bytes = 0

    def __enter__(self):
        for prefix, module in self.units:
            self.handles.append(module.register_forward_pre_hook(functools.partial(self._load, prefix)))
            self.handles.append(module.register_forward_hook(functools.partial(self._drop, prefix)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()

    def _base_tensors(self, prefix: str, module):
        """(name in the module, plain name) of the unit's base weights and persistent buffers."""
        for name, _ in module.state_dict().items():
            if "lora_" not in name:
                yield name, plain_name(f"{prefix}.{name}")

    def _load(self, prefix: str, module, args) -> None:
        from accelerate.utils import set_module_tensor_to_device

        for name, plain in self._base_tensors(prefix, module):
            value = self.reader.get(plain)
            set_module_tensor_to_device(module, name, "cpu", value=value)
            self.resident_bytes += value.numel() * value.element_size()
        self.max_resident_bytes = max(self.max_resident_bytes, self.resident_bytes)
        if self.merge:
            self.expected = _expected_merged_slices(module, prefix)
            for sub in _lora_layers(module):
                sub.merge(adapter_names=["default"])

    def _drop(self, prefix: str, module, args, output) -> None:
        from accelerate.utils import set_module_tensor_to_device

        if self.merge:
            state = {plain: module.state_dict()[name] for name, plain in self._base_tensors(prefix, module)}
            _check_merged_weights(state, self.expected, self.dtype)
            for plain, tensor in state.items():
                self.write(plain, tensor.detach())
        for name, _ in self._base_tensors(prefix, module):
            tensor = module.state_dict()[name]
            self.resident_bytes -= tensor.numel() * tensor.element_size()
            set_module_tensor_to_device(module, name, "meta")


def _is_lora(module) -> bool:
    from peft.tuners.lora.layer import LoraLayer

    return isinstance(module, LoraLayer) and "default" in module.lora_A


def _lora_layers(module) -> list:
    return [m for m in module.modules() if _is_lora(m)]


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


def _expected_merged_slices(unit, prefix: str) -> dict[str, tuple]:
    """For every adapted weight of a unit, its first row of (base weight, low-rank delta) taken before the
    merge, keyed by the weight's plain name (exactness check of the merge itself)."""
    from peft.tuners.lora.layer import ParamWrapper

    expected = {}
    for name, module in unit.named_modules():
        if not _is_lora(module):
            continue
        target = plain_name(f"{prefix}.{name}" if name else prefix)
        if isinstance(module, ParamWrapper):
            target, weight = f"{target}.{module.parameter_name}", module.get_param()
        else:
            target, weight = f"{target}.weight", module.get_base_layer().weight
        delta = module.get_delta_weight("default")
        expected[target] = (weight[:1].detach().float().clone(), delta[:1].detach().float().clone())
    return expected


def _check_merged_weights(state: dict, expected: dict[str, tuple], dtype: str) -> None:
    import torch

    eps = torch.finfo(getattr(torch, dtype)).eps
    for name, (w0, delta) in expected.items():
        if name not in state:
            raise UserError(f"merge check failed: {name} is missing after the merge; nothing was written")
        got = state[name][:1].float()
        bound = 2 * eps * (w0.abs() + delta.abs()) + 1e-30
        if not bool(((got - (w0 + delta)).abs() <= bound).all()):
            raise UserError(f"merge check failed: {name} did not receive its LoRA delta; nothing was written")


def _has_tokenizer(d: Path) -> bool:
    return any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def _probe_batch(vocab_size: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (2, PROBE_TOKENS // 2), generator=g)

