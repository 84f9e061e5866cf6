"""`training.objective: sft` (the default): next-token cross-entropy on the trained tokens of each sequence.

One unit is one sequence (a chat rendered by the family's template, the assistant turns trained; or plain
text, every token trained), packed into fixed-length blocks as segments (ftcli.data.packing draws a block).
"""

from __future__ import annotations

from ftcli.objectives.base import Objective

# The loss algebra (ftcli.train.full writes it next to the loop; ftcli.train.lora's loss is the same):
LOSS_ALGEBRA = """\
One optimizer step covers W ranks x M micro-batches (blocks). The objective is the mean token loss over every
trained token of the step, wherever it sits:

    L = (1 / N) * sum_{r, m} S_{r,m}          S_{r,m} = summed token CE of block m on rank r   (loss_sum)
                                              N = sum_{r,m} n_{r,m}, n_{r,m} = its trained tokens  (count)

N is known before any backward (one all_reduce(SUM) of the counts). Each rank backpropagates l_{r,m} =
S_{r,m} * W / N per micro-batch; the gradient reduction averages over the W ranks, so grad = grad(L) for
any split of the same blocks over ranks and accumulation. A step with N = 0 is skipped on every rank."""


def units(spec, tokenizer, first):
    """The packed blocks of the training data `spec` (a ftcli.data.DataSpec; `ftcli.data.prepare_blocks`): rank 0
    tokenizes, masks and packs into the on-disk cache first (`first`), then every rank opens it; a source that keeps
    no row stops here."""
    from ftcli import data

    return first(lambda: data.check_sources(spec.data, data.prepare_blocks(spec, tokenizer)),
                 then=lambda: data.open_prepared(spec, tokenizer))


def count(block) -> int:
    """Trained tokens after the shift: the block carries its count (`Block.num_trained_tokens`)."""
    return int(block.num_trained_tokens)


def loss_sum(model, inputs: dict):
    """Summed next-token CE of one block's trained tokens (`model.loss_sum`, ftcli.train.loss.attach_loss)."""
    return model.loss_sum(**inputs)


OBJECTIVE = Objective(
    name="sft", label="SFT", row_forms=("messages", "sharegpt", "alpaca", "prompt_completion", "text"),
    unit="sequence", sequences_per_unit=1, reference_model=False, loss_algebra=LOSS_ALGEBRA, metrics=(),
    eval_metric="loss", units=units, count=count, loss_sum=loss_sum,
)
