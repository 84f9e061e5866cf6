"""ftcli.data: the one data path both trainers and `pack-preview` use.

    load_tokenizer(model, data)              the model section's tokenizer (+ data.chat_template override)
    DataSpec / data_spec(recipe)             what the data path reads (a recipe stands for its training data)
    prepare_blocks(spec, tokenizer)          tokenize + mask + pack, or load from the cache -> PackedDataset
    prepare(...) / open_prepared(...)        the same split for distributed runs: rank 0, barrier, others
    BlockStream(packed, rank, world_size)    each rank's equal, disjoint, resumable share of the blocks
    block_to_model_inputs(block)             Block -> the packed model-call kwargs (torch; ftcli.data.collate)
    slice_model_inputs(block, rank, size)    one rank's slice of them (context parallelism)
    iter_examples(recipe, tokenizer)         unpacked examples (as the published gpt-oss example trains)
    data_summary(recipe, packed)             the data summary (pack-preview, train log, run.json, MLflow)
    check_sources(data, packed)              refuse a source that keeps no row (ftcli.data.checks)

Pure data code: no torch.distributed, MLflow or CLI imports anywhere in this package.
"""

from ftcli.data.cache import PackedDataset
from ftcli.data.chat import ChatEncoder, load_tokenizer, reference_encode
from ftcli.data.checks import check_sources
from ftcli.data.packing import IGNORE_INDEX, Block, make_block, padding_block
from ftcli.data.pipeline import Example, iter_examples, open_prepared, prepare, prepare_blocks
from ftcli.data.spec import DataSpec, data_spec
from ftcli.data.stats import DataStats
from ftcli.data.stream import BlockStream
from ftcli.data.summary import DataSummary, data_summary


def block_to_model_inputs(block, device="cpu"):
    """See ftcli.data.collate (imported lazily: torch is only needed by the trainers)."""
    from ftcli.data.collate import block_to_model_inputs as impl

    return impl(block, device)


def slice_model_inputs(block, rank: int, size: int, device="cpu"):
    """See ftcli.data.collate (imported lazily: torch is only needed by the trainers)."""
    from ftcli.data.collate import slice_model_inputs as impl

    return impl(block, rank, size, device)


__all__ = [
    "IGNORE_INDEX",
    "Block",
    "BlockStream",
    "ChatEncoder",
    "DataSpec",
    "DataStats",
    "DataSummary",
    "Example",
    "PackedDataset",
    "block_to_model_inputs",
    "check_sources",
    "data_spec",
    "data_summary",
    "iter_examples",
    "load_tokenizer",
    "make_block",
    "open_prepared",
    "padding_block",
    "prepare",
    "prepare_blocks",
    "reference_encode",
    "slice_model_inputs",
]
