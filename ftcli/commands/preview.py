"""`ftcli pack-preview`: show the blocks training consumes, exactly.

It runs the one data path (`ftcli.data.prepare_blocks`, so it also fills the cache `train` reads) and
reads blocks through the same `BlockStream` a single-rank run uses (1 epoch, the recipe's seed):

* a view of the first blocks: every segment's extent and position ids, its text colored trained (green)
  vs masked (dim), the padding segment;
* a summary (`ftcli.data.summary.DataSummary`, the one `train` prints): blocks, fill, segments per
  block, trained-token share, skipped rows by reason (with the first row indices), truncated / split
  examples, trained tokens lost to truncation, dropped turns, special-token strings in text, per-source
  rows / tokens / trained tokens (a table when the recipe mixes sources), pipeline tokens/s;
* the eval split (`recipe.eval`: held-out rows or separate data, packed the eval way) beside the
  training split: rows, tokens, trained tokens and blocks of each (`--json`: under "eval", per source);
* `--json`: the summary only, as JSON on stdout; `--dump FILE`: every block's arrays, one JSON object
  per line, in stream order.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ftcli.config.safe_files import open_output
from ftcli.config.recipe import Recipe

MAX_SHOWN_TOKENS = 2000  # per block in the rich view
TRAINED_OPEN, TRAINED_CLOSE = "«", "»"  # around trained text where there is no colour (a pipe, a log)


def _preview_recipe(recipe: Recipe, examples: int | None, strict: bool) -> Recipe:
    data = recipe.data.model_copy()
    if strict:
        data.strict = True
    if examples is not None:
        data.max_examples = examples if data.max_examples is None else min(examples, data.max_examples)
    return recipe.model_copy(update={"data": data})


def run_preview(
    recipe: Recipe, *, blocks: int, examples: int | None, as_json: bool, dump: Path | None, strict: bool
) -> None:
    from ftcli import data

    recipe = _preview_recipe(recipe, examples, strict)
    err = Console(stderr=True)
    out = Console()
    tokenizer = data.load_tokenizer(recipe.model, recipe.data)

    start = time.perf_counter()
    with Progress(
        TextColumn("tokenize + pack"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=err, transient=True, disable=not err.is_terminal,
    ) as bar:
        task = bar.add_task("examples", total=None)

        def progress(done: int, total: int | None) -> None:
            bar.update(task, completed=done, total=total)

        packed = data.prepare_blocks(recipe, tokenizer, progress=progress)
    seconds = time.perf_counter() - start

    stream = data.BlockStream(packed, rank=0, world_size=1, epochs=1.0, seed=recipe.training.seed)
    from ftcli.data.summary import data_summary

    table = data_summary(recipe, packed)
    from ftcli.data.evalsplit import eval_specs
    from ftcli.data.spec import data_spec

    specs = eval_specs(data_spec(recipe), recipe.eval)
    eval_packed = {label: data.prepare_blocks(r, tokenizer) for label, r in specs.items()}
    evals = {label: data_summary(specs[label], p) for label, p in eval_packed.items()}
    summary = {**table.to_dict(), "preview_seconds": round(seconds, 3)}
    if evals:
        summary["eval"] = {label: s.to_dict() for label, s in evals.items()}

    if dump is not None:
        with open_output(dump) as f:
            for block in stream:
                f.write(json.dumps(block_to_json(block)) + "\n")
        stream = data.BlockStream(packed, rank=0, world_size=1, epochs=1.0, seed=recipe.training.seed)

    from ftcli.data.checks import source_problems, source_warnings
    from ftcli.data.evalsplit import eval_problem

    problems = source_problems(recipe.data, packed.stats)  # what `train` refuses (data.allow_empty_sources)
    problems += source_warnings(recipe.data, packed.stats)  # and warns about: most rows skipped for a missing field
    problems += [p for p in [eval_problem(recipe.eval, eval_packed)] if p]  # and an empty eval split
    if as_json:
        _warn(err, problems)
        print(json.dumps(summary, indent=1))
        return
    for n, block in enumerate(stream):
        if n >= blocks:
            break
        _show_block(out, tokenizer, block, n)
    _show_summary(out, table)
    if evals:
        out.print(_splits_table(table, evals))
    _warn(err, problems)
    if dump is not None:
        err.print(f"wrote {summary['blocks']} blocks to {dump}")


def _warn(err: Console, problems: list[str]) -> None:
    for problem in problems:
        err.print(f"warning: {problem}", highlight=False, markup=False, soft_wrap=True)


# ------------------------------------------------------------------------------------------- summary
def block_to_json(block) -> dict[str, Any]:
    return {
        "index": block.index,
        "input_ids": block.input_ids.tolist(),
        "labels": block.labels.tolist(),
        "position_ids": block.position_ids.tolist(),
        "seq_idx": block.seq_idx.tolist(),
        "cu_seqlens": block.cu_seqlens.tolist(),
        "max_seqlen": block.max_seqlen,
        "num_trained_tokens": block.num_trained_tokens,
    }


def _show_summary(out: Console, summary) -> None:
    t = Table(title=f"pack-preview: {summary.recipe}", show_header=False, title_justify="left")
    t.add_column(style="bold", overflow="fold")
    t.add_column(overflow="fold")  # fold, never cut (a source label): tests/unit/commands/test_tables.py
    for label, value in summary.rows():
        if label != "cache":  # below the table, where it does not fold
            t.add_row(label, value)
    out.print(t)
    # the cache path on a line of its own, never broken (soft_wrap): a narrow terminal wraps it for the eye, and
    # a copy takes it whole
    out.print("cache (the packed blocks train reads):", highlight=False)
    out.print(summary.cache, soft_wrap=True, highlight=False, markup=False)
    if len(summary.sources) > 1:
        out.print(_sources_table(summary))


# the many-column tables: no cell padding (the box's one-space rule separates), so 80 columns hold every header
COMPACT = {"box": box.SIMPLE_HEAD, "padding": (0, 0), "show_edge": False, "title_justify": "left"}


def _splits_table(train, evals: dict) -> Table:
    """The training split and each eval source's split, side by side."""
    t = Table(title="splits", **COMPACT)
    for col in ("split", "rows", "tokens", "trained tokens", "blocks", "packing"):
        t.add_column(col, justify="left" if col in ("split", "packing") else "right", overflow="fold")
    from ftcli.data.summary import short_labels

    short = short_labels(evals)
    named = [(f"eval {short[label]}" if len(evals) > 1 else "eval", s) for label, s in evals.items()]
    for name, s in [("train", train), *named]:
        t.add_row(name, str(s.examples["kept"]), str(s.tokens), str(s.trained_tokens), str(s.blocks),
                  f"{s.strategy} {s.block_len or ''}".strip())
    return t


def _sources_table(summary) -> Table:
    from ftcli.data.summary import short_labels

    short = short_labels(summary.sources)
    t = Table(title="sources", **COMPACT)
    for col in ("source", "format", "rows", "kept", "skipped", "tokens", "trained tokens", "trained lost",
                "skipped by reason"):
        t.add_column(col, justify="left" if col in ("source", "format", "skipped by reason") else "right",
                     overflow="fold")
    for label, s in summary.sources.items():
        reasons = ", ".join(f"{r} {n}" for r, n in s.skipped_by_reason.items())
        t.add_row(short[label], s.format, str(s.rows_read), str(s.kept), str(s.skipped), str(s.tokens), str(s.trained_tokens),
                  str(s.trained_tokens_lost), reasons)
    return t


# --------------------------------------------------------------------------------------- block view
def _show_block(out: Console, tokenizer, block, n: int) -> None:
    cu = block.cu_seqlens.tolist()
    t = Table(
        title=f"block {n} in training order (packed block #{block.index} in the cache): {len(cu) - 1} segments, "
        f"{block.num_trained_tokens} trained tokens, max segment {block.max_seqlen}",
        title_justify="left",
    )
    for col in ("segment", "tokens", "length", "position_ids", "trained"):
        t.add_column(col, justify="right" if col != "position_ids" else "left")
    for k in range(len(cu) - 1):
        a, b = cu[k], cu[k + 1]
        pos = block.position_ids[a:b]
        trained = int((block.labels[max(a, 1) : b] != -100).sum())
        is_pad = k == len(cu) - 2 and trained == 0 and _is_padding(block, a, b, tokenizer)
        t.add_row(
            f"{k}{' (pad)' if is_pad else _side(block, k)}", f"[{a}, {b})", str(b - a),
            f"{int(pos[0])}..{int(pos[-1])}", str(trained),
        )
    out.print(t)
    plain = out.color_system is None  # a pipe or a log: colour is lost, so trained text is marked «like this»
    if plain:
        out.print(f"trained tokens are marked {TRAINED_OPEN}...{TRAINED_CLOSE}", highlight=False)
    out.print(_block_text(tokenizer, block, plain=plain), soft_wrap=plain)  # plain: the text as it is, unwrapped
    out.print()


def _side(block, k: int) -> str:
    """A preference block's segment k as ' (pair p chosen)' / ' (pair p rejected)'; '' for SFT blocks."""
    if block.roles is None or block.roles[k] < 0:
        return ""
    return f" (pair {k // 2} {'chosen' if block.roles[k] == 0 else 'rejected'})"


def _is_padding(block, a: int, b: int, tokenizer) -> bool:
    from ftcli.data.chat import pad_token_id

    return bool((block.input_ids[a:b] == pad_token_id(tokenizer)).all())


def _block_text(tokenizer, block, plain: bool = False) -> Text:
    """The block's text: trained tokens green, the rest dim; `plain` also brackets trained runs in
    TRAINED_OPEN ... TRAINED_CLOSE, for output without colour."""
    text = Text()
    cu = block.cu_seqlens.tolist()
    shown = 0
    for k in range(len(cu) - 1):
        a, b = cu[k], cu[k + 1]
        text.append(f"⟦segment {k}{_side(block, k)}⟧", style="bold cyan")
        if k == len(cu) - 2 and (block.labels[a:b] == -100).all() and _is_padding(block, a, b, tokenizer):
            text.append(f"[padding x {b - a}]", style="dim italic")
            continue
        trained = block.labels[a:b] != -100
        if a == 0:
            trained = trained.copy()
            trained[0] = False  # label[0] is never used by the loss
        t = a
        while t < b:
            if shown >= MAX_SHOWN_TOKENS:
                text.append(f" … ({int(block.cu_seqlens[-1]) - t} more tokens)", style="italic")
                return text
            u = t + 1
            while u < b and trained[u - a] == trained[t - a]:
                u += 1
            u = min(u, t + MAX_SHOWN_TOKENS - shown)
            piece = tokenizer.decode(block.input_ids[t:u].tolist(), skip_special_tokens=False)
            if plain and trained[t - a]:
                piece = f"{TRAINED_OPEN}{piece}{TRAINED_CLOSE}"
            text.append(piece, style="green" if trained[t - a] else "dim")
            shown += u - t
            t = u
    return text
