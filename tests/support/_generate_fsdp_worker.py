"""torchrun entry for tests/e2e/test_generate.py: `generate.sample_greedy` on an FSDP2-sharded model.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/support/_generate_fsdp_worker.py MODEL_DIR OUT

Every rank loads the same tiny checkpoint, shards it the way the full-SFT trainer does (`fully_shard`
per decoder layer, then the root), and calls sample_greedy with synced_gpus=True on
  "same":   the same conversations on every rank (what the trainers should do), and
  "uneven": a different conversation and max_new_tokens per rank, so rank 0 finishes first and has
            to keep taking part in rank 1's forwards (without synced_gpus this would hang).
Each rank writes OUT/rank{r}.json with its completions.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(model_dir: str, out: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftcli.inference import sample_greedy
    from ftcli.model.build import decoder_layers

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    model.train()
    conversations = [[{"role": "user", "content": "What is 2 plus 4?"}], [{"role": "user", "content": "Hi"}]]
    same = sample_greedy(model, tokenizer, conversations, max_new_tokens=6, synced_gpus=True)
    uneven = sample_greedy(model, tokenizer, [conversations[rank]], max_new_tokens=3 + 5 * rank, synced_gpus=True)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"same": same, "uneven": uneven,
                                                          "training": model.training}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], sys.argv[2])
    from ftcli.train.distributed import exit_worker

    exit_worker(0)  # the files are written: skip the interpreter's teardown (gloo can abort there, see exit_worker)
