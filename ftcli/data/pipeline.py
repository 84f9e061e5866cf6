"""The one data path: rows -> validate -> render + mask -> (truncate) -> pack -> cache -> blocks.

    sources.open_rows -> validate.conversation -> chat.ChatEncoder.encode -> packing.pack_*
        -> cache.BlockWriter (once, atomic) -> cache.PackedDataset (memory-mapped) -> stream.BlockStream

`prepare` does the work (rank 0 before a barrier, or any command) and is a no-op when the cache already
has the result; `open_prepared` is what the other ranks call after the barrier; `prepare_blocks` is both
in one call. `iter_examples` is the same path without packing (LoRA reference mode). `pack-preview`
calls exactly these, so what it shows is what training consumes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from ftcli.data import sources
from ftcli.data.cache import DATA_FORMAT_VERSION, BlockWriter, PackedDataset, cache_key, cache_root
from ftcli.data.chat import ChatEncoder, describe, encode_prompt_completion_text, pad_token_id
from ftcli.data.packing import IGNORE_INDEX, pack_bfd, pack_none, pack_split
from ftcli.data.stats import DataStats
from ftcli.data.synthetic import synthetic_examples
from ftcli.data.validate import BadRow, conversation
from ftcli.errors import UserError

Progress = Callable[[int, "int | None"], None]  # progress(examples read, total if known)
PROGRESS_EVERY = 64
BUILDS = {"count": 0}  # how many times this process tokenized + packed (tests assert cache hits with it)


@dataclass
class Example:
    """One tokenized, masked example (unpacked). Labels are unshifted (HF): -100 where not trained."""

    index: int  # row index in the source
    input_ids: list[int]
    labels: list[int]

    def __getitem__(self, key: str):  # ex["input_ids"] works like a datasets row
        return getattr(self, key)

    @property
    def num_trained_tokens(self) -> int:
        return sum(1 for label in self.labels[1:] if label != IGNORE_INDEX)


def _strict_error(index: int, reason: str, detail: str = "") -> UserError:
    what = f"{reason}: {detail}" if detail else reason
    return UserError(f"data row {index}: {what} (data.strict is on; turn it off to skip and count bad rows)")


def encoded_examples(
    recipe, tokenizer, stats: DataStats, progress: Progress | None = None
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(row index, input_ids int32, loss mask bool) of every valid example, truncated to data.max_length.
    Bad rows are counted in `stats` under their reason (strict: the first one raises UserError)."""
    data = recipe.data

    def bad(index: int, reason: str, detail: str = "") -> None:
        if data.strict:
            raise _strict_error(index, reason, detail)
        stats.skip(index, reason, detail)

    if data.source == "synthetic":
        exclude = list(getattr(tokenizer, "added_tokens_decoder", {}) or [])
        total = data.synthetic.num_examples
        total = total if data.max_examples is None else min(total, data.max_examples)
        results = synthetic_examples(data.synthetic, len(tokenizer), exclude, data.max_examples)
    else:
        rows, total = sources.open_rows(data, data.max_examples)
        if data.format == "messages":
            ChatEncoder(tokenizer)  # fail now, with one line, if the tokenizer has no chat template
        results = _parallel_encode(rows, data, tokenizer) if data.num_workers else _serial_encode(rows, data, tokenizer)

    for index, *result in results:
        stats.examples_read += 1
        if progress is not None and stats.examples_read % PROGRESS_EVERY == 0:
            progress(stats.examples_read, total)
        if isinstance(result[0], BadRow):
            bad(index, result[0].reason, result[0].detail)
            continue
        ids, mask = result
        if data.max_length is not None and len(ids) > data.max_length:
            ids, mask = ids[: data.max_length], mask[: data.max_length]
            stats.truncated += 1
        if not mask.any():
            bad(index, "zero trained tokens", "no token of this example gets loss")
            continue
        yield index, ids, mask
    if progress is not None:
        progress(stats.examples_read, total)


class RowEncoder:
    """row -> (input_ids, loss mask), or (BadRow,) saying why not. The chat encoder is built on first use
    (plain-text prompt/completion rows never need a template)."""

    def __init__(self, data, tokenizer):
        self.fmt, self.field, self.train_on = data.format, data.messages_field, data.train_on
        self.tokenizer = tokenizer
        self._chat: ChatEncoder | None = None

    def __call__(self, row: Any) -> tuple:
        try:
            if isinstance(row, sources.InvalidRow):
                raise BadRow(row.reason, row.detail)
            conv = conversation(row, self.fmt, self.field)
            if conv.messages is None:
                return encode_prompt_completion_text(self.tokenizer, conv.prompt, conv.completion, self.train_on)
            if self._chat is None:
                self._chat = ChatEncoder(self.tokenizer)
            return self._chat.encode(conv.messages, self.train_on, conv.first_trained)
        except BadRow as e:
            return (e,)
        except UserError as e:
            return (BadRow("template error", str(e)),)
        except Exception as e:  # noqa: BLE001 - a template's raise_exception, odd field types, ...
            return (BadRow("template error", (str(e).strip() or type(e).__name__).splitlines()[0]),)


def _serial_encode(rows, data, tokenizer):
    encode = RowEncoder(data, tokenizer)
    for index, row in rows:
        yield (index, *encode(row))


# data.num_workers > 0: the same RowEncoder in worker processes ("spawn": safe after torch/CUDA init),
# rows sent in chunks, results back in row order, so the output is byte-identical to the serial path.
_WORKER: RowEncoder | None = None
CHUNK = 256


def _init_worker(data, tokenizer) -> None:
    import os

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    global _WORKER
    _WORKER = RowEncoder(data, tokenizer)


def _encode_chunk(chunk: list) -> list[tuple]:
    return [(index, *_WORKER(row)) for index, row in chunk]


def _chunks(rows, size: int):
    chunk = []
    for item in rows:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _parallel_encode(rows, data, tokenizer):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(data.num_workers, initializer=_init_worker, initargs=(data, tokenizer)) as pool:
        for chunk in pool.imap(_encode_chunk, _chunks(rows, CHUNK)):
            yield from chunk


def iter_examples(recipe, tokenizer, stats: DataStats | None = None) -> Iterator[Example]:
    """Tokenized, masked, validated, unpacked examples (input_ids and labels lists), in source order."""
    stats = DataStats() if stats is None else stats
    for index, ids, mask in encoded_examples(recipe, tokenizer, stats):
        labels = np.where(mask, ids, IGNORE_INDEX)
        yield Example(index=index, input_ids=ids.tolist(), labels=labels.tolist())


# -------------------------------------------------------------------------------------- the cache
def cache_parts(recipe, tokenizer) -> dict[str, Any]:
    """Everything that changes the packed bytes (the cache key is its hash)."""
    data = recipe.data
    packing = data.packing.model_dump() if data.packing.enabled else {"enabled": False}
    return {
        "format_version": DATA_FORMAT_VERSION,
        "source": sources.fingerprint(data),
        "format": data.format,
        "messages_field": data.messages_field,
        "train_on": data.train_on,
        "max_examples": data.max_examples,
        "max_length": data.max_length,
        "packing": packing,
        "tokenizer": describe(tokenizer),
        "vocab_size": len(tokenizer),
    }


def entry_path(recipe, tokenizer) -> Path:
    parts = cache_parts(recipe, tokenizer)
    return cache_root(recipe.data) / "packed" / cache_key(parts)


def prepare(recipe, tokenizer, progress: Progress | None = None) -> Path:
    """Tokenize, mask and pack the recipe's data into the cache, unless it is already there. Returns the
    entry's directory. Call it on rank 0 before a barrier; other ranks then call `open_prepared`."""
    parts = cache_parts(recipe, tokenizer)
    final = cache_root(recipe.data) / "packed" / cache_key(parts)
    if (final / "meta.json").exists():
        return final
    data = recipe.data
    stats = DataStats()
    start = time.perf_counter()
    BUILDS["count"] += 1
    examples = encoded_examples(recipe, tokenizer, stats, progress)
    packing = data.packing
    if not packing.enabled:
        blocks = pack_none(examples)
    elif packing.strategy == "split":
        blocks = pack_split(examples, packing.block_len, stats)
    else:
        blocks = pack_bfd(examples, packing.block_len, packing.bfd_buffer, packing.overlong, stats)
    writer = BlockWriter(final)
    max_len = 0
    try:
        for ids, mask, seg_lens in blocks:
            stats.trained_tokens += writer.add(ids, mask, seg_lens)
            stats.tokens += len(ids)
            stats.blocks += 1
            max_len = max(max_len, len(ids))
            if packing.enabled:
                stats.padding_tokens += packing.block_len - len(ids)
    except BaseException:
        writer.abort()
        raise
    stats.seconds = time.perf_counter() - start
    meta = {
        "format_version": DATA_FORMAT_VERSION,
        "key": final.name,
        "key_parts": parts,
        "block_len": packing.block_len if packing.enabled else None,
        "pad_id": pad_token_id(tokenizer),
        "max_example_len": max_len,
        "stats": stats.to_dict(),
    }
    return writer.commit(meta)


def open_prepared(recipe, tokenizer) -> PackedDataset:
    """The reader for ranks that did not prepare: the entry `prepare` wrote for this recipe + tokenizer."""
    path = entry_path(recipe, tokenizer)
    if not (path / "meta.json").exists():
        raise UserError(f"no prepared data at {path}; call prepare() on rank 0 first")
    return _open(recipe, path, from_cache=True)


def prepare_blocks(recipe, tokenizer, progress: Progress | None = None) -> PackedDataset:
    """Tokenize + mask + pack (or load from the cache) and return the memory-mapped PackedDataset."""
    before = BUILDS["count"]
    path = prepare(recipe, tokenizer, progress)
    return _open(recipe, path, from_cache=BUILDS["count"] == before)


def _open(recipe, path: Path, from_cache: bool) -> PackedDataset:
    packed = PackedDataset(path, from_cache=from_cache)
    if recipe.data.strict:  # a cache written by a lenient run still fails a strict one at its first bad row
        first = packed.stats.first_bad_row()
        if first is not None:
            raise _strict_error(*first)
    return packed
