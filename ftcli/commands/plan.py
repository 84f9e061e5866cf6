"""`ftcli plan`: renders the plan of a recipe (ftcli.estimate.plan: memory per card, fit, the settings that would
fit, step time, wall time and GPU-hours) as tables, or as JSON with --json."""

from __future__ import annotations

import json
import re

from ftcli.config.accelerators import parse_accelerator
from ftcli.config.recipe import Recipe
from ftcli.estimate.plan import Plan, make_plan
from ftcli.objectives import method_of, objective_of


# ------------------------------------------------------------------------------------------- render
def _hours(h: float | None) -> str:
    if h is None:
        return "-"
    return f"{h * 60:.0f} min" if h < 1 else f"{h:.1f} h"


def print_plan(plan: Plan) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console()
    s = plan.setting
    frozen = f" + {plan.frozen_params / 1e9:.2f}B frozen" if plan.frozen_params else ""
    master = (f", master {s.master}" if method_of(plan.method).master_weights else
              f", adapter {s.adapter_params / 1e6:.2f}M params, base {'sharded (fsdp)' if s.sharding == 'fsdp' else 'whole per GPU (ddp)'}")
    console.print(f"[bold]{plan.recipe}[/]: {plan.method} of {plan.model} ({plan.params / 1e9:.3g}B params{frozen}); "
                  f"{s.tokens:,} tokens per micro-batch, checkpointing {s.checkpointing}"
                  f"{f' (keep {s.keep})' if s.keep else ''}{master}, loss {s.loss}"
                  f"{f', {s.tokens // s.cp:,} per rank over {s.cp} context-parallel ranks' if s.cp > 1 else ''}",
                  highlight=False)
    if objective_of(s.objective).reference_model:
        console.print(f"{objective_of(s.objective).label} reference: {reference_text(s)}", highlight=False)
    tokens = f"{plan.data.tokens:,} tokens, {plan.data.blocks:,} blocks" if plan.data.tokens is not None else "?"
    console.print(f"data: {tokens} ({plan.data.source}); optimizer steps on the recipe's GPUs: "
                  f"{plan.steps if plan.steps is not None else '?'}", highlight=False)
    own = plan.cards[0].accelerator if plan.cards and plan.cards[0].own else "none of the known cards"
    console.print(f"the recipe's accelerator: {own} (first row)", highlight=False)

    # 80 columns hold both tables with every header whole: no cell padding (the box's one-space column rule
    # separates), GPUs per node and nodes as columns, and the step times' provenance as numbered notes below
    tables = {"box": box.SIMPLE_HEAD, "padding": (0, 0), "show_edge": False, "title_justify": "left"}
    memory_table = Table(title="Memory per GPU, GiB (fits: total <= limit, 92% of the card; keep: layers that could "
                               "keep their activations)", **tables)
    for col in ("accelerator", "GPUs", "nodes", "params", "grads", "optim", "activ", "loss", "other", "total", "limit",
                "fits", "keep"):
        memory_table.add_column(col, justify="left" if col in ("accelerator", "fits") else "right", no_wrap=True)
    time_table = Table(title="Time (* estimate)", **tables)
    for col in ("accelerator", "s/step", "wall", "GPU-h", "from"):
        time_table.add_column(col, justify="left" if col in ("accelerator", "from") else "right", no_wrap=True)
    notes: list[str] = []  # [n] under the time table: where each step time came from, the commands that measured it

    def note(text: str) -> str:
        if text not in notes:
            notes.append(text)
        return f"[{notes.index(text) + 1}]"

    for c in plan.cards:
        e = c.estimate
        style = "bold" if c.own else None
        per_node = parse_accelerator(c.accelerator).gpus_per_node
        memory_table.add_row(c.accelerator, str(per_node), str(max(1, c.gpus // per_node)), *(_gib(v) for v in (
            e.params, e.grads, e.optimizer, e.activations, e.loss, e.other, e.total, c.usable_gib)),
            "[green]yes[/]" if c.fits else "[red]no[/]", "-" if c.keep_layers is None else str(c.keep_layers),
            style=style)
        step = "-" if c.step.s_per_step is None else f"{c.step.s_per_step:.2f}" + ("" if c.step.measured else "*")
        source = note(c.step.source) + (f" {note(_measured_by(c.step.command))}" if c.step.command else "")
        time_table.add_row(c.accelerator, step, _hours(c.wall_hours),
                           "-" if c.gpu_hours is None else f"{c.gpu_hours:.1f}", source, style=style)
    console.print(memory_table)
    for note in plan.notes:
        console.print(note, highlight=False)
    if method_of(plan.method).splits_blocks:
        fits = ", ".join(f"{c.accelerator} {c.cp_fits if c.cp_fits is not None else 'none'}" for c in plan.cards)
        console.print(f"context parallel, the fewest ranks per block that fit {s.tokens:,} tokens: {fits} (recipe: "
                      f"training.context_parallel={s.cp})", highlight=False)
    if plan.cp_balance is not None:
        console.print(plan.cp_balance.text(), highlight=False)
    if method_of(plan.method).picks_sharding:
        console.print("LoRA base: " + ", ".join(f"{c.accelerator} {c.sharding}" for c in plan.cards)
                      + " (ddp: a whole base per GPU; fsdp: sharded over the GPUs)", highlight=False)
    for c in plan.cards:  # one setting a line (a line of them all ran 300 characters)
        if c.suggestions:
            console.print(f"{c.accelerator} fits with one of:", highlight=False)
            for sug in c.suggestions:
                console.print(f"  {sug.text()}", highlight=False)
        elif not c.fits:
            console.print(f"{c.accelerator} does not fit: {c.why}", highlight=False)
    console.print(time_table)
    for number, text in enumerate(notes, 1):
        console.print(f"[{number}] {text}", style="dim" if text.startswith("measured by ") else None,
                      highlight=False, markup=False)


def reference_text(s) -> str:
    """How the plan counts an objective's reference (ftcli.estimate.memory, ftcli.estimate.steptime)."""
    if s.reference == "precomputed":
        return ("precomputed, no second model and no reference forward in the step (one forward pass over the blocks "
                "before step 1, not in s/step)")
    if method_of(s.method).master_weights:
        return "a frozen copy of the starting model, in params (sharded alike), and its forward per block in s/step"
    return "the base with the adapter off (no memory), and its forward per block in s/step"


def _measured_by(command: str) -> str:
    """A note naming the script that measured a step time; its whole command line is in `plan --json`
    (`command`) and BENCHMARKS.md, not on screen."""
    script = re.search(r"benchmarks/[\w./-]+\.(?:py|sh)", command)
    return f"measured by {script.group() if script else command.split()[0]} (the command: plan --json, BENCHMARKS.md)"


def _gib(v: float) -> str:
    """A GiB figure in at most 5 characters (the memory table's columns are as wide as their headers)."""
    return f"{v:.1f}" if v < 999.95 else f"{v:.0f}"


def run_plan(recipe: Recipe, accelerators: list[str] | None = None, as_json: bool = False) -> None:
    plan = make_plan(recipe, accelerators)
    if as_json:
        print(json.dumps(plan.to_dict(), indent=1))
    else:
        print_plan(plan)

