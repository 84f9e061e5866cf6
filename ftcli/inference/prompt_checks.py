"""What a prompt must be before it reaches the tokenizer and the model (`ftcli generate`, `ftcli chat`).

    text_problem("caf\udce9")                  -> "not UTF-8 text (byte 0xE9 at character 4)"
    context_of(model, run_dir)                 -> (4096, "max_position_embeddings") | (1024, "...block_len") | None
    check_prompt_length(tokenizer, msgs, ctx)  -> UserError when the contents alone hold `ctx` tokens or more
    check_rendered_length(n, ctx)              -> UserError when the rendered prompt leaves no room for a reply

A lone surrogate (a JSON "\\ud800", or a byte that is not UTF-8 read with errors="surrogateescape")
is not text: the tokenizer refuses it with a TypeError. A prompt longer than the model's context
would be tokenized whole and then run through attention at a length the model was never built for
(a 1M-character line: minutes and gigabytes before an allocator error). So the contents are counted
CHUNK_CHARS characters at a time and the count stops as soon as it reaches the context: the cost is
bounded by the context, not by the prompt. (Chunk edges can split a word: the count is within one
token per chunk of the whole text's.)
"""

from __future__ import annotations

from pathlib import Path

from ftcli.config.errors import UserError

CHUNK_CHARS = 1 << 14


def text_problem(text: str) -> str | None:
    """Why `text` is not UTF-8 text (a lone surrogate), else None."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = f"byte 0x{code - 0xDC00:02X}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
        return f"not UTF-8 text ({what} at character {e.start + 1})"


def messages_problem(messages: list[dict]) -> str | None:
    """The first message whose content is not UTF-8 text, as a reason, else None."""
    for i, m in enumerate(messages):
        problem = text_problem(m.get("content") or "")
        if problem:
            return f"message {i} is {problem}"
    return None


def context_of(model, run_dir: Path | None = None) -> tuple[int, str] | None:
    """(tokens, where from): the model config's max_position_embeddings (or its text_config's), else
    the training recipe's data.packing.block_len (a run dir's run.json); None when neither is known."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        value = getattr(cfg, "max_position_embeddings", None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, "max_position_embeddings"
    if run_dir is not None:
        from ftcli.artifacts.rundir import read_run_record

        try:
            block_len = ((read_run_record(run_dir).recipe.get("data") or {}).get("packing") or {}).get("block_len")
        except (UserError, AttributeError):
            block_len = None
        if isinstance(block_len, int) and block_len > 0:
            return block_len, "the run's data.packing.block_len"
    return None


def count_tokens(tokenizer, messages: list[dict], limit: int) -> tuple[int, int]:
    """(tokens, characters read): the messages' contents tokenized CHUNK_CHARS characters at a time,
    stopping once `limit` tokens are counted."""
    tokens = read = 0
    for m in messages:
        content = m.get("content") or ""
        for start in range(0, len(content), CHUNK_CHARS):
            chunk = content[start : start + CHUNK_CHARS]
            tokens += len(tokenizer(chunk, add_special_tokens=False)["input_ids"])
            read += len(chunk)
            if tokens >= limit:
                return tokens, read
    return tokens, read


def check_prompt_length(tokenizer, messages: list[dict], context: tuple[int, str] | None, fix: str = "shorten it") -> None:
    """UserError when the contents of `messages` alone reach the context (counted cheaply, see the
    module docstring); nothing when the context is unknown."""
    if context is None or tokenizer is None:
        return
    size, where = context
    tokens, read = count_tokens(tokenizer, messages, size)
    if tokens >= size:
        chars = sum(len(m.get("content") or "") for m in messages)
        counted = f"{tokens:,} tokens" + (f" in its first {read:,} of {chars:,} characters" if read < chars else "")
        raise UserError(f"the prompt is longer than the model's context of {size:,} tokens ({where}): {counted}; {fix}")


def check_rendered_length(num_tokens: int, context: tuple[int, str] | None, fix: str = "shorten it") -> None:
    """UserError when a rendered prompt of `num_tokens` leaves no position for a reply."""
    if context is not None and num_tokens >= context[0]:
        raise UserError(f"the prompt is {num_tokens:,} tokens with its chat template, the model's context is "
                        f"{context[0]:,} ({context[1]}); {fix}")
