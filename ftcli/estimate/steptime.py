"""Seconds per optimizer step from the step times measured in ftcli/assets/measured.json: the rows of the
recipe's setting, a per-layer fit over their depths, scaled to another depth or card where it must be (and
saying so); "no measurement" where there is none."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ftcli.config.recipe import TrainingConfig
from ftcli.estimate import memory
from ftcli.estimate.fit import CARDS
from ftcli.objectives import Method, objective_of


@dataclass(frozen=True)
class StepTime:
    s_per_step: float | None
    source: str  # "measured: <point>", "scaled from <point>: <each scaling>", or "no measurement for ..."
    measured: bool = False  # this card, this depth, this setting
    command: str | None = None  # the command that measured the point (None: no measurement)



def step_time(training: TrainingConfig, shape: memory.ModelShape, s: memory.Setting, card: str,
              world: int | None = None) -> StepTime:
    """Seconds per optimizer step on one `card` from the measured step times: the same family, width, method,
    block and checkpointing, the rows of the newest sitting (`_series`: kernels are never mixed); the recipe's
    depth and kept layers by their per-layer fit (`layer_fit`) where those rows allow one, else one point scaled
    by the matmul work of the layers and the LM head; another card scaled by its peak bf16 FLOP/s. Per-GPU time
    is taken as independent of the GPU count (not measured).

    The source names the measured point (card, GPUs, block length, date; time and kernels where recorded; its
    commands in `command`) and every scaling applied to it: "measured: ...", "scaled from ...: ...", or "no
    measurement for ..."."""
    world = world or s.world
    if s.cp > 1:
        return StepTime(None, f"no measurement with context parallelism ({s.cp} ranks per block)")
    rows = [r for r in memory.measured()["step_time"]
            if memory.shipped_shape(r["model"]).family == shape.family
            and memory.shipped_shape(r["model"]).hidden == shape.hidden and r["method"] == s.method
            and r["block_len"] == s.tokens and r["checkpointing"] == s.checkpointing]
    if not rows:
        return StepTime(None, f"no measurement for {shape.family} at hidden {shape.hidden}, {s.method}, "
                              f"{s.tokens} tokens, checkpointing {s.checkpointing}")
    method = s.method_record
    same = [r for r in rows if r["loss"] == s.loss and (not method.master_weights or r["master"] == s.master)
            and (not method.picks_sharding or r.get("sharding", "ddp") == s.sharding)]  # LoRA rows before fsdp: ddp
    exact = [r for r in same if tuple(r.get("speed", ())) == s.speed]
    # no row of the recipe's speed settings: the same loss and master without any (never another speed
    # setting's rows: fp8 with eager casts is slower than bf16, fp8 with compiled regions far faster)
    plain = [r for r in same if not r.get("speed")]
    candidates = exact or plain or [r for r in rows if not r.get("speed")] or rows
    row = max(candidates, key=_when)  # the newest sitting; of equals, the first listed
    series = [r for r in candidates if _series(r) == _series(row) and r["model"] == row["model"]
              and _setting_text(method, r) == _setting_text(method, row)]
    keep = min(s.keep, shape.layers) if method.keeps_layers else 0  # the recipe's kept layers
    # the rows at two or more depths give the per-layer fit (what a deeper step adds is its layers; the fixed
    # part is embeddings, LM head, loss, optimizer), and with rows that differ only in keep, a kept layer's cost;
    # else one point scaled by matmul work
    fit = layer_fit([(r["layers"], r.get("keep", 0), r["s_per_step"]) for r in series])
    at_depth = [r for r in series if r["layers"] == shape.layers]
    notes = []
    if fit and not any(r.get("keep", 0) == keep for r in at_depth) and (fit.kept_layer is not None or not at_depth):
        seconds = fit.seconds(shape.layers, keep) * training.grad_accum
        used = [r for r in series if r.get("keep", 0) == fit.depth_keep or r["layers"] == fit.keep_depth]
        depth_note = fit.text(shape.layers, keep)
        layers_text = f"{' and '.join(map(str, sorted({r['layers'] for r in used})))} layers"
        measured_keep = fit.depth_keep if fit.kept_layer is None else keep
    else:
        row = max(series, key=lambda r: (r["layers"] == shape.layers, r.get("keep", 0) == keep))
        used = [row]
        measured_shape = memory.shipped_shape(row["model"]).cut(row["layers"])
        head = shape.vocab * shape.hidden
        layer = sum(shape.layer_params) / shape.layers
        depth = (shape.layers * layer + head) / (measured_shape.layers * layer + head)
        seconds = row["s_per_step"] * depth * training.grad_accum
        depth_note = f"{row['layers']} -> {shape.layers} layers by matmul work" if row["layers"] != shape.layers else None
        layers_text = f"{row['layers']} layers"
        measured_keep = row.get("keep", 0)
    if card != row["card"]:
        seconds *= CARDS[row["card"]]["bf16_flops"] / CARDS[card]["bf16_flops"]
        notes.append(f"x peak bf16 FLOP/s {row['card']}/{card}")
    if not exact:
        notes.append(f"measured with {_setting_text(method, row)} (recipe: {_setting_text(method, vars(s))})")
    if depth_note:
        notes.append(depth_note)
    if method.keeps_layers and measured_keep != keep:
        notes.append(f"measured with keep {measured_keep} (recipe: keep {s.keep}, not counted)")
    if objective_of(s.objective).reference_model and s.reference == "model":
        # the measured rows are SFT's: one more forward per block for the reference's log-probs (a frozen copy, or the
        # base with the adapter off), of the step's forward + backward (2 forwards) + recomputation (full checkpointing)
        forwards = 4 if s.checkpointing == "full" else 3
        seconds *= 1 + 1 / forwards
        notes.append(f"x {1 + 1 / forwards:.2f} for the reference's forward (1 of {forwards} forward-sized passes; "
                     "not measured)")
    if training.grad_accum > 1:
        notes.append(f"x {training.grad_accum} micro-batches")
    measured = not notes
    gpus = f"{row['gpus']} GPU{'s' if row['gpus'] > 1 else ''}"
    point = f"{row['card']}, {gpus}, {row['model']} at {layers_text}, block {row['block_len']}, {row['date']}"
    if row.get("utc"):
        point += f" {row['utc']} UTC"
    if row.get("kernels"):
        point += f", kernels {row['kernels']}"
    if {r.get("kernels") for r in candidates} != {row.get("kernels")}:
        point += ", the newest of this setting's rows (rows with other kernels not mixed in)"
    if row["gpus"] != world:
        notes.append(f"per-GPU time of {gpus} taken for {world}"
                     + (" (the sharded base's all-gathers not counted)" if method.picks_sharding and s.sharding == "fsdp"
                        else ""))
    command = " && ".join(dict.fromkeys(r["command"] for r in used))
    if measured:
        return StepTime(seconds, "; ".join([f"measured: {point}", *notes]), True, command)
    return StepTime(seconds, f"scaled from {point}: {'; '.join(notes)}", False, command)


def _when(row: dict[str, Any]) -> tuple[str, str]:
    """When a row was measured: date, then time of day (a row without one: earlier that day)."""
    return row["date"], row.get("utc", "")


def _series(row: dict[str, Any]) -> tuple[str, ...]:
    """The rows measured together: one sitting (date, time) with the same kernels, or (no time) one command's."""
    if row.get("utc"):
        return row["date"], row["utc"], row.get("kernels") or ""
    return (row["command"],)


@dataclass(frozen=True)
class LayerFit:
    """s/step = fixed + recomputed x (layers - kept) + kept_layer x kept: `recomputed` is the slope of rows at one
    keep count (`depth_keep`) over two or more depths (`depths`); `kept_layer` comes from rows at one depth
    (`keep_depth`) that differ only in keep (`keeps`). Without those (kept_layer None) kept layers are not
    counted: s/step = fixed + recomputed x layers, as measured at `depth_keep`."""

    fixed: float
    recomputed: float  # s per layer that recomputes its forward in backward
    kept_layer: float | None  # s per layer that keeps its activations
    depths: tuple[int, ...]
    depth_keep: int
    keeps: tuple[int, ...] = ()
    keep_depth: int | None = None

    def seconds(self, layers: int, kept: int) -> float:
        if self.kept_layer is None:
            return self.fixed + self.recomputed * layers
        return self.fixed + self.recomputed * (layers - kept) + self.kept_layer * kept

    def text(self, layers: int, kept: int) -> str:
        depths = f"{' and '.join(map(str, self.depths))} -> {layers} layers by the per-layer fit"
        if self.kept_layer is None:
            return f"{depths} ({self.fixed:.3f} s + {self.recomputed:.4f} s x layers)"
        return (f"{depths}, {kept} of them kept ({self.fixed:.3f} s + {self.recomputed:.4f} s x {layers - kept} "
                f"recomputed + {self.kept_layer:.4f} s x {kept} kept layers; kept layers counted: a kept "
                f"layer's cost from the {self.keep_depth}-layer rows at keep {' and '.join(map(str, self.keeps))}, a "
                f"recomputed one's from the keep {self.depth_keep} rows)")


def layer_fit(points: list[tuple[int, int, float]]) -> LayerFit | None:
    """The per-layer fit of one sitting's (layers, kept layers, s/step) rows; None without two depths at one keep
    count. Rows at one depth that differ only in keep give a kept layer's cost: the recomputed slope plus the
    slope of s/step over keep there (negative: a kept layer skips its recompute)."""
    by_keep: dict[int, list[tuple[int, float]]] = {}
    by_depth: dict[int, list[tuple[int, float]]] = {}
    for layers, kept, seconds in points:
        by_keep.setdefault(kept, []).append((layers, seconds))
        by_depth.setdefault(layers, []).append((kept, seconds))
    depth_keep = next((k for k, pts in by_keep.items() if len({n for n, _ in pts}) >= 2), None)
    if depth_keep is None:
        return None
    recomputed, intercept = depth_fit(by_keep[depth_keep])
    depths = tuple(sorted({n for n, _ in by_keep[depth_keep]}))
    keep_depth = next((n for n, pts in by_depth.items() if len({k for k, _ in pts}) >= 2), None)
    if keep_depth is None:
        return LayerFit(intercept, recomputed, None, depths, depth_keep)
    per_kept, _ = depth_fit(by_depth[keep_depth])  # the same least squares, over keep at one depth
    kept_layer = recomputed + per_kept
    return LayerFit(intercept + (recomputed - kept_layer) * depth_keep, recomputed, kept_layer, depths, depth_keep,
                    tuple(sorted({k for k, _ in by_depth[keep_depth]})), keep_depth)


def depth_fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares s/step = intercept + slope x layers over (layers, s/step) of two or more depths."""
    mx = sum(n for n, _ in points) / len(points)
    my = sum(t for _, t in points) / len(points)
    slope = sum((n - mx) * (t - my) for n, t in points) / sum((n - mx) ** 2 for n, _ in points)
    return slope, my - slope * mx


def _setting_text(method: Method, setting: dict[str, Any]) -> str:
    """The parts of a setting a step-time row may differ in (a measured row, or a memory.Setting's fields)."""
    if method.picks_sharding:
        return f"{setting.get('sharding', 'ddp')}, loss {setting['loss']}"
    speed = tuple(setting.get("speed", ()))
    return f"master {setting['master']}, loss {setting['loss']}" + (f", {' '.join(speed)}" if speed else "")
