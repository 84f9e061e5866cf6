"""`training.method`: how the parameters train and what a run writes, one `Method` record each
(ftcli.objectives.base says what each field is for and who asks it).

    full   every weight trains in ftcli's FSDP2 loop (ftcli.train.full); <run>/final is a Hugging Face model
    lora   a PEFT adapter over a frozen base, through TRL (ftcli.train.lora); <run>/final is the adapter

They sit next to the objectives rather than in a room of their own: the two are the two axes of one question
(what a run trains, and how), the same consumers ask both, and two records do not make a room.
"""

from __future__ import annotations

from ftcli.objectives.base import Method

FULL = Method(
    name="full", label="full", writes_adapter=False, trains_base=True, checkpoint_kind="dcp", needs_packing=True,
    checkpointing=("none", "selective", "full"), keeps_layers=True, picks_sharding=False, runs_features=True,
    master_weights=True,
)
LORA = Method(
    name="lora", label="LoRA", writes_adapter=True, trains_base=False, checkpoint_kind="trl", needs_packing=False,
    checkpointing=("none", "full"),  # TRL checkpoints every decoder layer or none
    keeps_layers=False, picks_sharding=True, runs_features=False, master_weights=False,
)

METHODS = {m.name: m for m in (FULL, LORA)}
