"""`ftcli pack-preview`: show the blocks training consumes, exactly.

It runs the one data path (`ftcli.data.prepare_blocks`, so it also fills the cache `train` reads) and
reads blocks through the same `BlockStream` a single-rank run uses (1 epoch, the recipe's seed):

* a view of the first blocks: every segment's extent and position ids, its text colored trained (green)
  vs masked (dim), the padding segment;
* a summary: blocks, fill, segments per block, trained-token share, skipped rows by reason (with the
  first row indices), truncated / split examples, pipeline tokens/s;
* `--json`: the summary only, as JSON on stdout; `--dump FILE`: every block's arrays, one JSON object
  per line, in stream order.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ftcli.recipe import Recipe

MAX_SHOWN_TOKENS = 2000  # per block in the rich view


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
    tokenizer = data.load_tokenizer(recipe)

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
    summary = summarize(recipe, packed, seconds)

    if dump is not None:
        with open(dump, "w") as f:
            for block in stream:
                f.write(json.dumps(block_to_json(block)) + "\n")
        stream = data.BlockStream(packed, rank=0, world_size=1, epochs=1.0, seed=recipe.training.seed)

    if as_json:
        print(json.dumps(summary, indent=1))
        return
    for n, block in enumerate(stream):
        if n >= blocks:
            break
        _show_block(out, tokenizer, block, n)
    _show_summary(out, summary)
    if dump is not None:
        err.print(f"wrote {summary['blocks']} blocks to {dump}")


# ------------------------------------------------------------------------------------------- summary
def summarize(recipe: Recipe, packed, seconds: float) -> dict[str, Any]:
    import numpy as np

    stats = packed.stats
    n = len(packed)
    segs = np.asarray([len(packed.segments(i)) for i in range(n)], dtype=np.int64)
    capacity = n * packed.block_len if packed.block_len else stats.tokens
    return {
        "recipe": recipe.name,
        "cache": str(packed.path),
        "from_cache": packed.from_cache,
        "strategy": recipe.data.packing.strategy if recipe.data.packing.enabled else "none",
        "block_len": packed.block_len,
        "blocks": n,
        "fill_pct": round(100.0 * stats.tokens / capacity, 2) if capacity else 0.0,
        "segments_per_block": {
            "mean": round(float(segs.mean()), 3) if n else 0.0,
            "min": int(segs.min()) if n else 0,
            "max": int(segs.max()) if n else 0,
        },
        "tokens": stats.tokens,
        "padding_tokens": stats.padding_tokens,
        "trained_tokens": int(packed.block_trained.sum()) if n else 0,
        "trained_pct": round(100.0 * int(packed.block_trained.sum()) / stats.tokens, 2) if stats.tokens else 0.0,
        "examples": {
            "read": stats.examples_read,
            "kept": stats.examples_kept,
            "skipped": stats.examples_skipped,
            "truncated": stats.truncated,
            "split": stats.split,
            "zero_trained": stats.zero_trained,
        },
        "skipped_by_reason": {
            reason: {"count": count, "first_rows": stats.first_skipped.get(reason, [])}
            for reason, count in sorted(stats.skipped.items())
        },
        "pipeline_seconds": round(stats.seconds, 3),
        "tokens_per_second": round(stats.tokens_per_second, 1),
        "preview_seconds": round(seconds, 3),
    }


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


def _show_summary(out: Console, s: dict[str, Any]) -> None:
    t = Table(title=f"pack-preview: {s['recipe']}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    seg = s["segments_per_block"]
    ex = s["examples"]
    t.add_row("blocks", f"{s['blocks']} x {s['block_len'] or 'variable'} tokens ({s['strategy']})")
    t.add_row("fill", f"{s['fill_pct']:.2f}% ({s['padding_tokens']} padding tokens)")
    t.add_row("segments per block", f"mean {seg['mean']:.2f}, min {seg['min']}, max {seg['max']}")
    t.add_row("trained tokens", f"{s['trained_tokens']} of {s['tokens']} ({s['trained_pct']:.2f}%)")
    t.add_row("examples", f"read {ex['read']}, kept {ex['kept']}, skipped {ex['skipped']}")
    t.add_row("truncated / split", f"{ex['truncated']} / {ex['split']}")
    for reason, r in s["skipped_by_reason"].items():
        t.add_row(f"  skipped: {reason}", f"{r['count']} (first rows {', '.join(map(str, r['first_rows']))})")
    cached = " (cached result; this run only read it)" if s["from_cache"] else ""
    t.add_row("pipeline", f"{s['pipeline_seconds']:.2f} s, {s['tokens_per_second']:,.0f} tokens/s{cached}")
    t.add_row("cache", s["cache"])
    out.print(t)


# --------------------------------------------------------------------------------------- block view
def _show_block(out: Console, tokenizer, block, n: int) -> None:
    cu = block.cu_seqlens.tolist()
    t = Table(
        title=f"block {n} (packed block #{block.index}): {len(cu) - 1} segments, "
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
            f"{k}{' (pad)' if is_pad else ''}", f"[{a}, {b})", str(b - a), f"{int(pos[0])}..{int(pos[-1])}",
            str(trained),
        )
    out.print(t)
    out.print(_block_text(tokenizer, block))
    out.print()


def _is_padding(block, a: int, b: int, tokenizer) -> bool:
    from ftcli.data.chat import pad_token_id

    return bool((block.input_ids[a:b] == pad_token_id(tokenizer)).all())


def _block_text(tokenizer, block) -> Text:
    text = Text()
    cu = block.cu_seqlens.tolist()
    shown = 0
    for k in range(len(cu) - 1):
        a, b = cu[k], cu[k + 1]
        text.append(f"⟦segment {k}⟧", style="bold cyan")
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
            text.append(piece, style="green" if trained[t - a] else "dim")
            shown += u - t
            t = u
    return text
