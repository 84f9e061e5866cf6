"""ftcli: fine-tune LLMs from named recipes, all the way to a registered model."""

import logging

__version__ = "0.1.0"

# transformers imports torchao whenever it is installed (the `gpu` extra; ftcli's fp8 setting uses it). On
# import, torchao warns about C++ extensions it could not load (CPU builds of torch, a torch of another
# build) and torch's pytree about the enums torchao registers: noise on every command, about nothing ftcli
# uses (float8 training is torchao's Python and torch's own kernels). Errors still show.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
