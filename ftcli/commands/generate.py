"""`ftcli generate`: load what a fine-tune produced and turn conversations into completions.

    RUN_OR_MODEL -> ftcli.artifacts.resolve.model_source (a finished run dir: a full run's final model, a LoRA
                    run's base + adapter unmerged; a model or adapter dir; a hub id owner/name at --revision)
    -> ftcli.inference: load, render with the model's own chat template, generate, split reasoning/answer
    --prompt: one reply streamed to stdout (tokens/s at the end); --input FILE.jsonl: left-padded batches,
    one JSON line per conversation (to stdout or --output)

Multi-turn chat (`ftcli chat`) is ftcli.commands.chat, over `ftcli.inference.stream_reply`.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftcli.artifacts.resolve import model_source
from ftcli.config.safe_files import check_output_path, write_output
from ftcli.config.errors import UserError
from ftcli.inference import (
    LoadedModel,
    Sampling,
    check_reasoning_effort,
    conversation,
    generate,
    load,
    render_prompt,
    reply_fields,
    stream_reply,
    system_prompt,
    template_kwargs,
)
from ftcli.inference.prompt_checks import check_prompt_length, check_rendered_length, context_of, messages_problem, text_problem

INPUT_MAX_BYTES = 2**30  # --input is read whole


# -------------------------------------------------------------------------------- prompt files
@dataclass
class PromptRow:
    line: int
    messages: list[dict]  # the turns to answer, normalized as training reads them (what the template renders)
    reference: str | None = None  # a trailing assistant turn of the row: the answer to compare with
    echo: list[dict] | None = None  # the row's own messages as written (the output row repeats them), else None


def read_prompt_file(path: Path) -> tuple[list[PromptRow], list[tuple[int, str]]]:
    """A JSONL file of conversations -> (rows, bad rows as (line number, reason)). A row is any row
    `ftcli train` reads (`ftcli.data.formats.row_messages`: messages, ShareGPT, Alpaca, prompt/completion;
    a trailing assistant turn becomes `reference`) or {"prompt": "...", "system": "..."}; blank lines are
    skipped."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):  # /dev/zero, a FIFO: read to the end, it never ends
            raise UserError(f"--input {path}: not a regular file (a device or a pipe); write the rows to a .jsonl file")
        if st.st_size > INPUT_MAX_BYTES:
            raise UserError(f"--input {path}: {st.st_size / 2**30:,.1f} GiB, over the {INPUT_MAX_BYTES / 2**30:.0f} GiB "
                            "generate reads; split it into smaller files")
        # JSON Lines end at "\n" only: a row may hold U+2028 or NEL inside a string (splitlines would cut it there)
        lines = [line.removesuffix("\r") for line in Path(path).read_text(encoding="utf-8").split("\n")]
    except FileNotFoundError:
        raise UserError(f"--input {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--input {path}: cannot read it ({e})") from None
    rows, bad = [], []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            rows.append(_prompt_row(number, json.loads(text)))
        except json.JSONDecodeError:
            bad.append((number, "not valid JSON"))
        except ValueError as e:
            bad.append((number, str(e)))
    return rows, bad


def _prompt_row(number: int, row: Any) -> PromptRow:
    from ftcli.data.formats import row_messages
    from ftcli.data.validate import BadRow

    if not isinstance(row, dict):
        raise ValueError(f"a {type(row).__name__}, not an object")
    if isinstance(row.get("prompt"), str) and "completion" not in row:
        if not row["prompt"].strip():
            raise ValueError("'prompt' is empty")
        system = row.get("system")
        if system is not None and not isinstance(system, str):
            raise ValueError("'system' is not a string")
        problem = text_problem(row["prompt"]) or text_problem(system or "")
        if problem:
            raise ValueError(f"'prompt' or 'system' is {problem}")
        return PromptRow(number, conversation(row["prompt"], system))
    try:
        messages = row_messages(row)
    except BadRow as e:
        raise ValueError(f"{e.reason} ({e.detail})" if e.detail else e.reason) from None
    problem = messages_problem(messages)
    if problem:
        raise ValueError(problem)
    own = row.get("messages") if isinstance(row.get("messages"), list) else None
    reference = None
    if messages[-1]["role"] == "assistant":
        last, messages = messages[-1], messages[:-1]
        reference = last.get("content") if isinstance(last.get("content"), str) and not last.get("tool_calls") else None
        own = own[:-1] if own else own
    if not messages or messages[-1]["role"] not in ("user", "tool"):
        raise ValueError("no user turn to answer")
    return PromptRow(number, messages, reference, own if own and len(own) == len(messages) else None)


def _bad_rows_summary(path: Path, bad: list[tuple[int, str]], total: int, shown: int = 5) -> str:
    listed = "; ".join(f"line {n}: {why}" for n, why in bad[:shown])
    more = f"; and {len(bad) - shown} more" if len(bad) > shown else ""
    return f"{path}: {len(bad)} of {total} rows skipped ({listed}{more})"


# ---------------------------------------------------------------------------------- the command
def run_generate(ref: str, *, prompt: str | None, system: str | None, input_path: Path | None,
                 output: Path | None, force: bool, sampling: Sampling, reasoning_effort: str | None,
                 reasoning_language: str | None, dtype: str, device: str, revision: str | None,
                 batch_size: int, as_json: bool) -> None:
    """`ftcli generate`: one streamed prompt, or a JSONL file of conversations -> a JSONL file."""
    from rich.console import Console

    err = Console(stderr=True, highlight=False, soft_wrap=True)
    if (prompt is None) == (input_path is None):
        raise UserError("pass either --prompt TEXT or --input FILE.jsonl")
    if input_path is not None and (system or reasoning_language):
        raise UserError("--system/--reasoning-language apply to --prompt; put system messages into the --input rows")
    if output is not None and input_path is None:
        raise UserError("--output goes with --input FILE.jsonl")
    if output is not None:
        check_output_path(output, force, "completions.jsonl")
    if prompt is not None and text_problem(prompt):  # e.g. bytes of the command line that are not UTF-8
        raise UserError(f"--prompt is {text_problem(prompt)}")
    if batch_size < 1:
        raise UserError("--batch-size must be at least 1")
    rows, bad = read_prompt_file(input_path) if input_path is not None else ([], [])
    if input_path is not None and not rows:
        raise UserError(_bad_rows_summary(input_path, bad, len(bad)) if bad else f"{input_path}: no rows")
    source = model_source(ref, revision)
    kwargs = template_kwargs(reasoning_effort)
    with err.status(f"loading {source.describe()}"):
        loaded = load(source, dtype=dtype, device=device)
    check_reasoning_effort(loaded.tokenizer, reasoning_effort, source.describe())
    context = context_of(loaded.model, loaded.source.run_dir)
    if input_path is None:
        messages = conversation(prompt, system_prompt(system, reasoning_language))
        check_prompt_length(loaded.tokenizer, messages, context)
        check_rendered_length(len(render_prompt(loaded.tokenizer, messages, kwargs)), context)
        _single(loaded, messages, sampling, kwargs, as_json=as_json, err=err)
        return
    total = len(rows) + len(bad)
    rows, refused = _renderable(loaded.tokenizer, rows, kwargs, context)
    if not rows:  # e.g. a --reasoning-effort the template does not know: the same error for every row
        raise UserError(refused[0][1])
    bad = sorted(bad + refused)
    completions = _batched(loaded, rows, sampling, kwargs, batch_size, err)
    lines = [json.dumps({"line": r.line, "messages": r.echo or r.messages,
                         **reply_fields(loaded.tokenizer, r.messages, c, kwargs, like=r.echo),
                         **({"reference": r.reference} if r.reference is not None else {}),
                         "finish_reason": c.finish_reason, "new_tokens": len(c.token_ids)}, ensure_ascii=False)
             for r, c in zip(rows, completions)]
    text = "".join(line + "\n" for line in lines)
    if output is None:
        print(text, end="")
    else:
        write_output(output, text)
        err.print(f"wrote {len(lines)} completions to {output}")
    if bad:
        raise UserError(_bad_rows_summary(input_path, bad, total))


def _renderable(tokenizer, rows: list[PromptRow], kwargs: dict,
                context: tuple[int, str] | None = None) -> tuple[list[PromptRow], list[tuple[int, str]]]:
    """The rows the chat template renders within the model's context, and (line, reason) for the others."""
    good, refused = [], []
    for row in rows:
        try:
            check_prompt_length(tokenizer, row.messages, context)
            check_rendered_length(len(render_prompt(tokenizer, row.messages, kwargs)), context)
            good.append(row)
        except UserError as e:
            refused.append((row.line, str(e)))
    return good, refused


def _single(loaded: LoadedModel, messages: list[dict], sampling: Sampling, kwargs: dict, *, as_json: bool, err):
    import sys

    if as_json:
        completion, stats = stream_reply(loaded, messages, sampling, write=lambda _: None, template_kwargs=kwargs)
        print(json.dumps({**completion.to_dict(), "tokens_per_s": stats.tokens_per_s}, ensure_ascii=False))
        return

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    _, stats = stream_reply(loaded, messages, sampling, write=write, template_kwargs=kwargs)
    sys.stdout.write("\n")
    err.print(f"[dim]{stats.line()}[/]")


def _batched(loaded: LoadedModel, rows: list[PromptRow], sampling: Sampling, kwargs: dict, batch_size: int, err):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=False) as bar:
        task = bar.add_task("generate", total=len(rows))
        start = time.perf_counter()
        completions = generate(loaded, [r.messages for r in rows], sampling, template_kwargs=kwargs,
                               batch_size=batch_size, progress=lambda n: bar.advance(task, n))
    seconds = time.perf_counter() - start
    new = sum(len(c.token_ids) for c in completions)
    err.print(f"[dim]{len(rows)} conversations, {new} new tokens in {seconds:.2f} s "
              f"({new / seconds if seconds > 0 else 0:.1f} tokens/s)[/]")
    return completions
