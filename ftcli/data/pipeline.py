"""The one data path: rows -> validate -> render + mask -> (truncate) -> pack -> cache -> blocks.

    for each source of data.source_list() (data.sources: one, or a mix), under its weight (`weighted`):
        formats.resolve (auto: the format of the first rows)
        sources.open_rows -> formats.conversation (any format -> messages) -> chat.ChatEncoder.encode
    -> truncate (data.max_length; bfd: the block) -> packing.pack_*
    -> cache.BlockWriter (once, atomic) -> cache.PackedDataset (memory-mapped) -> stream.BlockStream

Every row is counted once in `DataStats` (and in its source's entry): kept, perhaps truncated, or
skipped under one reason; turns dropped from kept rows and special-token strings in text are noted;
trained tokens cut off by truncation or an overlong drop are summed. `ftcli.data.summary` turns those
counts into the summary pack-preview shows and train prints.

Every entry point takes a `DataSpec` (ftcli.data.spec: the data section and the holdout side; the eval
split's come from `ftcli.data.evalsplit.eval_specs`) or a recipe, which stands for its training data.
`prepare` does the work (rank 0 before a barrier, or any command) and is a no-op when the cache already
has the result; `open_prepared` is what the other ranks call after the barrier; `prepare_blocks` is both
in one call. `iter_examples` is the same path without packing (unpacked, as the published gpt-oss
example trains). `pack-preview` calls exactly these, so what it shows is what training consumes.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from ftcli.data import formats, preference, sources
from ftcli.config.safe_files import refuse_links, remove_tree
from ftcli.data.cache import DATA_FORMAT_VERSION, BlockWriter, PackedDataset, cache_key, cache_root, entry_problem
from ftcli.data.evalsplit import split_rows
from ftcli.data.chat import ChatEncoder, TemplateBoundExceeded, describe, encode_prompt_completion_text, pad_token_id
from ftcli.data.packing import IGNORE_INDEX, num_trained, pack_bfd, pack_none, pack_pairs, pack_split
from ftcli.data.spec import data_spec
from ftcli.data.stats import POLICY_REASONS, DataStats
from ftcli.data.synthetic import synthetic_examples
from ftcli.data.validate import CALL_NOT_RENDERED, BadRow, as_bad_row, chat_turns
from ftcli.config.errors import UserError

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


def _strict_error(index: int, reason: str, detail: str = "", source: str | None = None) -> UserError:
    what = f"{reason}: {detail}" if detail else reason
    where = f"data row {index}" + (f" of source {source!r}" if source else "")
    return UserError(f"{where}: {what} (data.strict is on; turn it off to skip and count bad rows)")


# ------------------------------------------------------------------------------------------ mixing
def _unit(seed: int, *keys: int) -> float:
    """A deterministic uniform [0, 1) from integers (splitmix64): the same on every machine and rank."""
    x = seed & 0xFFFFFFFFFFFFFFFF
    for k in keys:
        x = (x ^ (k & 0xFFFFFFFFFFFFFFFF)) + 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x / 2.0**64


def weighted(passes: Callable[[], Iterator[tuple[int, Any]]], weight: float, seed: int, source: int):
    """A source's rows under its weight: ceil(weight) passes over the rows; pass p keeps every row while
    p + 1 <= weight and a seeded fraction (weight - p) of them in the last pass. 2 = every row twice
    (epochs-style), 0.5 = a seeded half, 1.5 = once plus a seeded half. Deterministic: the same rows in
    the same order on every run, so the packed blocks (and a resumed run's stream) are reproducible."""
    p = 0
    while p < weight:
        fraction = weight - p
        for index, row in passes():
            if fraction >= 1 or _unit(seed, source, p, index) < fraction:
                yield index, row
        p += 1


def _source_total(total: int | None, weight: float) -> int | None:
    return None if total is None else int(round(total * weight))


def _limit(data, src) -> int | None:
    """Rows read from a source: its own max_examples and data.max_examples (per source in a mix)."""
    limits = [x for x in (src.max_examples, data.max_examples) if x is not None]
    return min(limits) if limits else None


# ------------------------------------------------------------------------------------------ encode
def encoded_examples(
    spec, tokenizer, stats: DataStats, progress: Progress | None = None
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(row index, input_ids int32, loss mask bool) of every valid example of every source, in source
    order, each source under its weight; truncated to data.max_length (and, for bfd, to the block or
    dropped per `packing.overlong`). Every row is counted once in `stats` and its source's row: kept
    (perhaps truncated) or skipped under one reason (strict: the first bad row raises UserError)."""
    spec = data_spec(spec)
    data = spec.data
    resolved = [formats.resolve(s) for s in data.source_list()]  # format: auto -> the format of the first rows
    sources_ = [src for src, _ in resolved]
    for src, found in resolved:
        stats.source(src.label).format = src.format if src.source != "synthetic" else "synthetic"
        stats.source(src.label).format_why = found.why if found else ""
    multi = not data.one_source  # a mix (or one source given as data.sources): errors name the source
    limit = data.max_length
    packing = data.packing
    block_cut = packing.enabled and packing.strategy == "bfd"
    if any(s.source != "synthetic" and s.format in formats.TEMPLATED for s in sources_):
        ChatEncoder(tokenizer)  # fail now, with one line, if the tokenizer has no chat template
    streams, totals = [], []
    holdout = spec.holdout  # eval.holdout: training leaves those rows out, the eval split keeps only them
    for k, src in enumerate(sources_):
        results, total = _source_results(data, src, k, tokenizer, holdout, sources_)
        streams.append(results)
        totals.append(_source_total(total, src.weight))
    grand_total = None if None in totals else sum(totals)

    for k, (src, results) in enumerate(zip(sources_, streams)):
        counts = (stats, stats.source(src.label))  # the whole data set and this source's row

        def bad(index: int, reason: str, detail: str = "") -> None:
            if data.strict:
                raise _strict_error(index, reason, detail, src.label if multi else None)
            for st in counts:
                st.skip(index, reason, detail)

        for index, *result in results:
            for st in counts:
                st.examples_read += 1
            if progress is not None and stats.examples_read % PROGRESS_EVERY == 0:
                progress(stats.examples_read, grand_total)
            if isinstance(result[0], BadRow):
                bad(index, result[0].reason, result[0].detail)
                continue
            ids, mask, dropped, special = result
            if block_cut and len(ids) > packing.block_len and packing.overlong == "drop":
                for st in counts:
                    st.trained_lost_overlong += int(mask.sum())
                    st.skip(index, "longer than block", f"{len(ids)} tokens > block_len {packing.block_len}")
                continue
            cut = min(x for x in (limit, packing.block_len if block_cut else None, len(ids)) if x is not None)
            was_cut, lost = cut < len(ids), int(mask[cut:].sum())
            ids, mask = ids[:cut], mask[:cut]
            for st in counts:
                st.trained_lost_truncation += lost
            if not mask.any():  # counted once: as skipped, not also as truncated
                bad(index, "zero trained tokens", "no token of this example gets loss")
                continue
            for st in counts:
                st.truncated += was_cut
                st.note(dropped, special)
            counts[1].tokens += len(ids)  # per source, as examples (the totals are counted in the blocks)
            counts[1].trained_tokens += int(mask[1:].sum())
            yield index, ids, mask
    if progress is not None:
        progress(stats.examples_read, grand_total)


def _resolve_pairs(src):
    """A preference source with `format: auto` (or `preference`) replaced by the form of its first rows."""
    if src.source == "synthetic":
        raise UserError("a preference objective needs preference rows (chosen/rejected); synthetic data has none")
    if src.format in preference.FORMS:
        return src, f"data.format {src.format}"
    if src.format not in ("auto", "preference"):
        raise UserError(f"data.format {src.format!r} is an SFT format; a preference objective reads "
                        f"{', '.join(preference.FORMS)} rows (or auto)")
    rows, _ = sources.open_rows(src, limit=formats.DETECT_ROWS)
    form, why = preference.detect(row for _, row in rows if not isinstance(row, sources.InvalidRow))
    if form is None:
        raise UserError(f"data source {src.label!r}: {why}; a preference objective needs "
                        "{prompt, chosen, rejected} rows or chosen/rejected conversations")
    return src, why + " (each row read in its own form)"


def encoded_pairs(spec, tokenizer, stats: DataStats, progress: Progress | None = None) -> Iterator[tuple]:
    """(row index, chosen ids, chosen mask, rejected ids, rejected mask) of every valid preference pair of
    every source, in source order under its weight: the pair counterpart of `encoded_examples`. Each side is
    cut to data.max_length (keep_start, as TRL); with packing on, a pair longer than the block is dropped
    (`packing.overlong: drop`) or cut to it (`truncate`: `preference.fit_pair`); a side left with no trained
    token skips the pair. Every row is counted once in `stats`: kept (perhaps truncated) or skipped."""
    spec = data_spec(spec)
    data = spec.data
    resolved = [_resolve_pairs(s) for s in data.source_list()]
    sources_ = [src for src, _ in resolved]
    for src, why in resolved:
        stats.source(src.label).format, stats.source(src.label).format_why = "preference", why
    multi = not data.one_source
    packing = data.packing
    block = packing.block_len if packing.enabled else None
    for k, src in enumerate(sources_):
        results, _ = _source_results(data, src, k, tokenizer, spec.holdout, sources_, preference.PairEncoder)
        counts = (stats, stats.source(src.label))

        def bad(index: int, reason: str, detail: str = "") -> None:
            if data.strict and reason not in POLICY_REASONS:
                raise _strict_error(index, reason, detail, src.label if multi else None)
            for st in counts:
                st.skip(index, reason, detail)

        for index, result in results:
            for st in counts:
                st.examples_read += 1
            if progress is not None and stats.examples_read % PROGRESS_EVERY == 0:
                progress(stats.examples_read, None)
            if isinstance(result, BadRow):
                bad(index, result.reason, result.detail)
                continue
            sides = [(result.chosen_ids, result.chosen_mask), (result.rejected_ids, result.rejected_mask)]
            full = [len(ids) for ids, _ in sides]
            keep = [min(n, data.max_length or n) for n in full]
            if block is not None and sum(keep) > block:
                if packing.overlong == "drop":
                    for st in counts:
                        st.trained_lost_overlong += sum(int(m.sum()) for _, m in sides)
                    bad(index, "longer than block", f"pair of {full[0]} + {full[1]} tokens > block_len {block}")
                    continue
                keep = list(preference.fit_pair(keep[0], keep[1], block))
            lost = sum(int(m[n:].sum()) for (_, m), n in zip(sides, keep))
            sides = [(ids[:n], m[:n]) for (ids, m), n in zip(sides, keep)]
            for st in counts:
                st.trained_lost_truncation += lost
            if not all(m[1:].any() for _, m in sides):  # counted once: as skipped, not also as truncated
                bad(index, "zero trained tokens", "a side of this pair keeps no trained token")
                continue
            for st in counts:
                st.truncated += keep != full
                st.note(result.dropped, result.special_tokens)
            counts[1].tokens += sum(len(ids) for ids, _ in sides)
            counts[1].trained_tokens += sum(int(m[1:].sum()) for _, m in sides)
            yield index, sides[0][0], sides[0][1], sides[1][0], sides[1][1]
    if progress is not None:
        progress(stats.examples_read, None)


def _source_results(data, src, k: int, tokenizer, holdout=None, sources_=None, encoder=None):
    """One source's (row index, *encoded) stream under its weight, and its row count if known. `encoder`:
    the row encoder class (RowEncoder; preference.PairEncoder for pairs)."""
    limit = _limit(data, src)
    if src.source == "synthetic":
        exclude = list(getattr(tokenizer, "added_tokens_decoder", {}) or [])
        total = src.synthetic.num_examples if limit is None else min(src.synthetic.num_examples, limit)

        def passes():
            for index, ids, mask in synthetic_examples(src.synthetic, len(tokenizer), exclude, limit):
                yield index, (ids, mask, {}, 0)

        return ((i, *r) for i, r in weighted(passes, src.weight, data.mix_seed, k)), total
    _, total = sources.open_rows(src, limit)

    def passes():
        return sources.open_rows(src, limit)[0]

    rows = weighted(split_rows(holdout, passes), src.weight, data.mix_seed, k)
    encode = _parallel_encode if data.num_workers else _serial_encode
    return encode(((k, i, row) for i, row in rows), data, tokenizer, sources_, encoder or RowEncoder), total


# A row's size bound (data.max_row_chars), checked before it is tokenized: a tokenizer holds several
# bytes per character of a row at once, so one 100 MB row can take gigabytes, and a row of many blocks
# of prompt only packs into blocks with nothing to train on. The default allows 64 characters per
# token of the block length: ~16 blocks of ordinary text (~4 characters a token).
ROW_CHARS_PER_BLOCK_TOKEN = 64
TOO_LONG = "row too long"


def row_char_limit(data) -> int:
    """data.max_row_chars, else ROW_CHARS_PER_BLOCK_TOKEN x the block length (data.max_length when
    packing is off and it is set)."""
    if data.max_row_chars is not None:
        return data.max_row_chars
    tokens = data.max_length if (not data.packing.enabled and data.max_length) else data.packing.block_len
    return ROW_CHARS_PER_BLOCK_TOKEN * tokens


def row_chars(conv) -> int:
    """The characters of a valid row's text: every string in its messages but the roles (contents,
    reasoning, tool calls), prompt, completion and tool schemas."""
    def chars(value: Any) -> int:
        if isinstance(value, str):
            return len(value)
        if isinstance(value, dict):
            return sum(chars(v) for k, v in value.items() if k != "role")
        if isinstance(value, (list, tuple)):
            return sum(chars(v) for v in value)
        return 0

    return chars([conv.messages, conv.prompt, conv.completion, conv.tools])


class RowEncoder:
    """(source number, row) -> (input_ids, loss mask, dropped turns, special-token strings), or (BadRow,)
    saying why not. The chat encoder is built on first use. Plain-text prompt/completion rows are
    rendered as a user turn + an assistant turn, the format `generate`/`chat` ask in; only a tokenizer
    without a chat template trains them as plain text (prompt + completion + eos). `sources`:
    data.source_list() with `format: auto` resolved (`formats.resolve`). A row over data.max_row_chars is
    a BadRow before anything tokenizes it."""

    def __init__(self, data, tokenizer, sources_=None):
        self.sources = sources_ if sources_ is not None else data.source_list()
        self.train_on, self.special = data.train_on, data.special_tokens_in_text
        self.tokenizer = tokenizer
        self.max_row_chars = row_char_limit(data)
        self._chat: ChatEncoder | None = None

    def __call__(self, k: int, row: Any) -> tuple:
        src = self.sources[k]
        try:
            if isinstance(row, sources.InvalidRow):
                raise BadRow(row.reason, row.detail)
            conv = formats.conversation(row, src.format, src.messages_field, src.tools_field)
            if row_chars(conv) > self.max_row_chars:
                raise BadRow(TOO_LONG, f"{row_chars(conv):,} characters > data.max_row_chars {self.max_row_chars:,}")
            if conv.messages is None:
                # plain text: a `text` row (continued pretraining: no template), or no template to ask in
                if conv.plain or not getattr(self.tokenizer, "chat_template", None):
                    ids, mask = encode_prompt_completion_text(self.tokenizer, conv.prompt, conv.completion, self.train_on)
                    return ids, mask, {}, 0
                conv = chat_turns(conv)
            if self._chat is None:
                self._chat = ChatEncoder(self.tokenizer, special_tokens_in_text=self.special)
            info: dict = {}
            ids, mask = self._chat.encode(conv.messages, self.train_on, conv.first_trained, conv.tools, info)
            dropped = dict(conv.dropped)
            if info["tool_calls_not_rendered"]:
                dropped[CALL_NOT_RENDERED] = info["tool_calls_not_rendered"]
            return ids, mask, dropped, info["special_tokens_in_text"]
        except TemplateBoundExceeded:
            raise  # the template's fault: every row would take as long
        except Exception as e:  # noqa: BLE001 - a template's raise_exception, odd field types, ...
            return (as_bad_row(e),)


def _serial_encode(rows, data, tokenizer, sources_=None, encoder=None):
    encode = (encoder or RowEncoder)(data, tokenizer, sources_)
    for k, index, row in rows:
        yield (index, *encode(k, row))


# data.num_workers > 0: the same RowEncoder in worker processes ("spawn": safe after torch/CUDA init),
# rows sent in chunks, results back in row order, so the output is byte-identical to the serial path.
_WORKER: RowEncoder | None = None
CHUNK = 256


def _init_worker(data, tokenizer, sources_=None, encoder=None) -> None:
    import os

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    global _WORKER
    _WORKER = (encoder or RowEncoder)(data, tokenizer, sources_)


def _encode_chunk(chunk: list) -> list[tuple]:
    return [(index, *_WORKER(k, row)) for k, index, row in chunk]


def _chunks(rows, size: int):
    chunk = []
    for item in rows:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _parallel_encode(rows, data, tokenizer, sources_=None, encoder=None):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    initargs = (data, tokenizer, sources_, encoder)
    with ctx.Pool(data.num_workers, initializer=_init_worker, initargs=initargs) as pool:
        for chunk in pool.imap(_encode_chunk, _chunks(rows, CHUNK)):
            yield from chunk


def iter_examples(spec, tokenizer, stats: DataStats | None = None) -> Iterator[Example]:
    """Tokenized, masked, validated, unpacked examples (input_ids and labels lists), in source order."""
    stats = DataStats() if stats is None else stats
    for index, ids, mask in encoded_examples(spec, tokenizer, stats):
        labels = np.where(mask, ids, IGNORE_INDEX)
        yield Example(index=index, input_ids=ids.tolist(), labels=labels.tolist())


# -------------------------------------------------------------------------------------- the cache
# The modules whose code decides a cache entry (its blocks and its counts): their source text is part of
# the cache key, so any change to the masking (or validation, truncation, packing, counting) code
# invalidates entries written before it, even where a change forgets to bump ENCODER_VERSION.
ENCODER_MODULES = ("chat.py", "validate.py", "sources.py", "delta.py", "synthetic.py", "packing.py", "pipeline.py",
                   "stats.py", "evalsplit.py", "formats.py", "spec.py", "preference.py")


def encoder_fingerprint() -> dict[str, Any]:
    import hashlib

    from ftcli.data import chat

    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for name in ENCODER_MODULES:
        h.update(name.encode() + b"\0" + (root / name).read_bytes())
    return {"version": chat.ENCODER_VERSION, "code_sha256": h.hexdigest()}


def recipe_cache_parts(spec) -> dict[str, Any]:
    """The data spec's share of the cache key: everything but the tokenizer (`ftcli plan` matches a cache entry's
    meta.json key_parts against it without loading a tokenizer)."""
    spec = data_spec(spec)
    data = spec.data
    packing = data.packing.model_dump() if data.packing.enabled else {"enabled": False}
    return {
        "format_version": DATA_FORMAT_VERSION,
        "encoder": encoder_fingerprint(),
        "sources": [
            {
                "rows": sources.fingerprint(src),
                "format": src.format,
                "messages_field": src.messages_field,
                "tools_field": src.tools_field,
                "max_examples": _limit(data, src),
                "weight": src.weight,
                "label": src.label,
            }
            for src in data.source_list()
        ],
        "mix_seed": data.mix_seed,
        "train_on": data.train_on,
        "special_tokens_in_text": data.special_tokens_in_text,
        "max_length": data.max_length,
        "max_row_chars": row_char_limit(data),
        "packing": packing,
        **({"holdout": vars(spec.holdout)} if spec.holdout else {}),
        **({"units": "pairs"} if spec.pairs else {}),
    }


def cache_parts(spec, tokenizer) -> dict[str, Any]:
    """Everything that changes the packed bytes (the cache key is its hash)."""
    return {**recipe_cache_parts(spec), "tokenizer": describe(tokenizer), "vocab_size": len(tokenizer)}


def entry_path(spec, tokenizer) -> Path:
    parts = cache_parts(spec, tokenizer)
    return cache_root(data_spec(spec).data) / "packed" / cache_key(parts)


def prepare(spec, tokenizer, progress: Progress | None = None) -> Path:
    """Tokenize, mask and pack the spec's data into the cache, unless it is already there. Returns the
    entry's directory. Call it on rank 0 before a barrier; other ranks then call `open_prepared`."""
    spec = data_spec(spec)
    parts = cache_parts(spec, tokenizer)
    final = cache_root(spec.data) / "packed" / cache_key(parts)
    refuse_links([final], where="the pack cache", fix="remove it or set data.cache_dir elsewhere")
    if os.path.lexists(final):
        problem = entry_problem(final)
        if problem is None:
            return final
        print(f"note: the pack cache entry {final} is not used: {problem}; rebuilding it", file=sys.stderr)
        remove_tree(final)
    data = spec.data
    stats = DataStats()
    start = time.perf_counter()
    BUILDS["count"] += 1
    packing = data.packing
    if spec.pairs:
        blocks = pack_pairs(encoded_pairs(spec, tokenizer, stats, progress),
                            packing.block_len if packing.enabled else None, packing.bfd_buffer)
    else:
        blocks = _pack_examples(encoded_examples(spec, tokenizer, stats, progress), packing, stats)
    try:
        writer = BlockWriter(final)
    except OSError as e:
        raise _cache_not_written(final, e) from None
    max_len = 0
    try:
        for ids, mask, seg_lens, *roles in blocks:
            if not num_trained(mask, seg_lens):  # e.g. the middle of a long prompt (split): nothing to step on
                stats.blocks_without_trained += 1
                continue
            stats.trained_tokens += writer.add(ids, mask, seg_lens, *roles)
            stats.tokens += len(ids)
            stats.blocks += 1
            stats.pairs += len(roles[0]) // 2 if roles else 0
            max_len = max(max_len, len(ids))
            if packing.enabled:
                stats.padding_tokens += packing.block_len - len(ids)
    except BaseException as e:
        writer.abort()
        if isinstance(e, OSError):
            raise _cache_not_written(final, e) from None
        raise
    if spec.pairs and not stats.pairs:
        writer.abort()
        raise UserError(f"no usable preference pair in the data ({stats.examples_read} rows read"
                        + "".join(f"; {n} {r}" for r, n in sorted(stats.skipped.items(), key=lambda x: -x[1]))
                        + ")")
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
    try:
        return writer.commit(meta)
    except OSError as e:
        raise _cache_not_written(final, e) from None


def _cache_not_written(final: Path, e: OSError) -> UserError:
    """The one line of a cache write an OSError stopped (a full disk, a quota), once its temp dir is removed."""
    import shutil

    where = next((p for p in (final.parent, *final.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(where).free / 2**20
    return UserError(f"the pack cache entry {final} could not be written: {e.strerror or e} ({free:,.1f} MiB free "
                     "there); nothing half-written is left: free space or set data.cache_dir elsewhere")


def _pack_examples(examples, packing, stats: DataStats):
    if not packing.enabled:
        return pack_none(examples)
    if packing.strategy == "split":
        return pack_split(examples, packing.block_len, stats)
    return pack_bfd(examples, packing.block_len, packing.bfd_buffer, packing.overlong, stats)


def open_prepared(spec, tokenizer) -> PackedDataset:
    """The reader for ranks that did not prepare: the entry `prepare` wrote for this spec + tokenizer."""
    path = entry_path(spec, tokenizer)
    if not os.path.lexists(path):
        raise UserError(f"no prepared data at {path}; call prepare() on rank 0 first")
    problem = entry_problem(path, checksums=False)  # rank 0 has just checked the checksums
    if problem is not None:
        raise UserError(f"the pack cache entry {path} is not usable: {problem}; run again (it is rebuilt)")
    return _open(spec, path, from_cache=True)


def prepare_blocks(spec, tokenizer, progress: Progress | None = None) -> PackedDataset:
    """Tokenize + mask + pack (or load from the cache) and return the memory-mapped PackedDataset."""
    before = BUILDS["count"]
    path = prepare(spec, tokenizer, progress)
    return _open(spec, path, from_cache=BUILDS["count"] == before)


def _open(spec, path: Path, from_cache: bool) -> PackedDataset:
    packed = PackedDataset(path, from_cache=from_cache)
    if data_spec(spec).data.strict:  # a cache written by a lenient run still fails a strict one at its first bad row
        first = packed.stats.first_bad_row()
        if first is not None:
            raise _strict_error(*first)
    return packed
