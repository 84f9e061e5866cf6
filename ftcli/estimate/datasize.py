"""Tokens and blocks of one epoch of a recipe's data, without tokenizing it all: the pack cache when present,
the synthetic config, a sample of a local source, a published figure for a hub dataset; else unknown."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ftcli.config.errors import UserError
from typing import TYPE_CHECKING

from ftcli.config.recipe import DataConfig, ModelConfig, resolve_path

if TYPE_CHECKING:
    from ftcli.data.spec import DataSpec

# Token counts of hub datasets this machine cannot read offline, with where the figure comes from.
PUBLISHED_TOKENS = {
    ("HuggingFaceH4/ultrachat_200k", "train_sft"): (
        995 * 8 * 32768, "published example: 995 steps of 8 GPUs x one 32,768-token block (Qwen3.8 tokenizer)"),
}
SAMPLE_ROWS = 300
CHAT_TEMPLATE_TOKENS = 4  # per message: role header and end-of-turn markers (sampled counts only)


@dataclass(frozen=True)
class DataSize:
    tokens: int | None
    blocks: int | None
    source: str



def data_size(spec: DataSpec, model: ModelConfig) -> DataSize:
    """Tokens and blocks of one epoch of the training data `spec` (`ftcli.data.data_spec(recipe)`; `model`, the
    model section, names the tokenizer): the pack cache when present; else, per source of `data.sources`, the
    synthetic config, a sample of a local source, a published figure for a hub dataset, or unknown, summed over
    a mix under each source's weight."""
    cached = _from_pack_cache(spec)
    if cached:
        return cached
    d = spec.data
    block = d.packing.block_len if d.packing.enabled else None
    sizes = [(src, _source_size(spec, model, src, block)) for src in d.source_list()]
    if len(sizes) == 1:
        return sizes[0][1]
    how = "; ".join(f"{src.label}: {size.source}" for src, size in sizes)
    if any(size.tokens is None for _, size in sizes):
        return DataSize(None, None, f"unknown: mix of {len(sizes)} sources ({how})")
    tokens = sum(round(size.tokens * src.weight) for src, size in sizes)
    examples = sum(round(size.blocks * src.weight) for src, size in sizes) if block is None else None
    return DataSize(tokens, _blocks(tokens, block, examples), f"mix of {len(sizes)} sources, x weight ({how})")


def _source_size(spec: DataSpec, model: ModelConfig, src, block: int | None) -> DataSize:
    """One source's tokens and blocks (as if it were the only one)."""
    if src.source == "synthetic":
        syn = src.synthetic
        tokens = int(syn.num_examples * _clipped_lognormal_mean(syn.mean_tokens, syn.max_tokens))
        return DataSize(tokens, _blocks(tokens, block, syn.num_examples),
                        "computed: expected length of the synthetic log-normal x num_examples")
    if src.source in ("local", "delta"):  # a Delta table is sampled like files (its row count is metadata)
        return _sample_local(spec.data, model, src)
    published = PUBLISHED_TOKENS.get((src.path, src.split))
    if published:
        return DataSize(published[0], _blocks(published[0], block, None), published[1])
    return DataSize(None, None, f"unknown: no pack cache for {src.path} here and hub data is not read by plan "
                                f"(`ftcli pack-preview --recipe {spec.name}` builds the cache)")


def _blocks(tokens: int, block: int | None, examples: int | None) -> int | None:
    if block:
        return math.ceil(tokens / block)
    return examples


def _clipped_lognormal_mean(mean: float, cap: float, sigma: float = 1.0) -> float:
    """E[min(X, cap)], X log-normal with mean `mean` (ftcli.data.synthetic's lengths)."""
    mu = math.log(mean) - sigma**2 / 2
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    z = (math.log(cap) - mu) / sigma
    return math.exp(mu + sigma**2 / 2) * phi(z - sigma) + cap * (1 - phi(z))


def _from_pack_cache(spec: DataSpec) -> DataSize | None:
    from ftcli.data.cache import cache_root
    from ftcli.data.pipeline import recipe_cache_parts

    root = cache_root(spec.data) / "packed"
    if not root.is_dir():
        return None
    try:
        want = recipe_cache_parts(spec)
    except (UserError, OSError):
        return None
    want = json.loads(json.dumps(want, default=str))
    for meta_path in sorted(root.glob("*/meta.json")):
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            continue
        parts = meta.get("key_parts", {})
        if all(parts.get(k) == v for k, v in want.items()):
            return DataSize(int(meta["num_tokens"]), int(meta["num_blocks"]), f"pack cache {meta_path.parent}")
    return None


def _sample_local(d: DataConfig, model: ModelConfig, src) -> DataSize:
    """Tokens of the first SAMPLE_ROWS rows of a local source (rendered with the chat template and tokenized when
    the tokenizer is a local directory; else characters / 4 + CHAT_TEMPLATE_TOKENS per message), scaled to all
    rows."""
    from ftcli.data import formats, sources
    from ftcli.data.chat import TemplateBoundExceeded

    try:
        src, _ = formats.resolve(src)  # format: auto -> the format of the first rows
        rows, total = sources.open_rows(src)
    except (UserError, OSError) as e:
        return DataSize(None, None, f"unknown: {e}")
    count, how = _local_counter(model, d)
    sampled = tokens = 0
    for _, row in rows:
        if sampled >= SAMPLE_ROWS:
            break
        sampled += 1
        messages = formats.messages_of(row, src.format, src.messages_field)  # any row format -> its turns
        if messages is None:
            continue
        try:
            n = count([m for m in messages if isinstance(m, dict)])
        except TemplateBoundExceeded:
            raise  # the template's fault: every row would take as long
        except Exception:  # noqa: BLE001 - a row the template refuses is skipped (train counts it as invalid)
            continue
        tokens += min(n, d.max_length) if d.max_length else n
    if not sampled:
        return DataSize(0, 0, "the source has no rows")
    rows_total = total if total is not None and total >= sampled else sampled
    for limit in (src.max_examples, d.max_examples):
        rows_total = min(rows_total, limit) if limit else rows_total
    est = round(tokens * rows_total / sampled)
    block = d.packing.block_len if d.packing.enabled else None
    return DataSize(est, _blocks(est, block, rows_total), f"estimate: first {sampled} of {rows_total} rows, {how}")


def _local_counter(model: ModelConfig, data: DataConfig):
    """A function messages -> token count, and how it counts (the model section's tokenizer, data.chat_template)."""
    folder = Path(resolve_path(model.tokenizer or model.id) or "")
    template_file = resolve_path(data.chat_template) if data.chat_template else None
    source, name = None, f"the chat template of {folder}"
    if template_file and Path(template_file).is_file():
        source, name = Path(template_file).read_text(), f"the chat template {template_file}"
    elif (folder / "chat_template.jinja").is_file():
        source = (folder / "chat_template.jinja").read_text()
    elif (folder / "tokenizer_config.json").is_file():
        source = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    if not (folder / "tokenizer.json").is_file() or not isinstance(source, str):
        return (lambda messages: sum(len(str(m.get("content", ""))) // 4 + CHAT_TEMPLATE_TOKENS for m in messages),
                f"characters / 4 + {CHAT_TEMPLATE_TOKENS} per message (no local tokenizer and template)")
    from tokenizers import Tokenizer

    from ftcli.data.chat import compile_template

    template = compile_template(source, name=name)  # the sandbox the data path renders with (pinned date), bounded
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return (lambda messages: len(tokenizer.encode(template.render(messages=messages, add_generation_prompt=False),
                                                  add_special_tokens=False).ids),
            "chat template rendered and tokenized")
