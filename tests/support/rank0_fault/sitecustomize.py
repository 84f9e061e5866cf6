"""A failure only rank 0 of a torchrun worker meets, for tests/e2e/test_worker_failures.py: with this folder first on
PYTHONPATH and FTCLI_TEST_RANK0_FAULT=<file name> in the environment, rank 0's first open of a file of that name
raises a UserError (one line, as a user-caused failure reads), from an audit hook (sys.addaudithook) installed at
interpreter start. The launcher (no RANK) and the other ranks never meet it, so it stays inside the workers
whatever the launcher learns to check beforehand; nothing of ftcli is patched."""

import os
import sys

_NAME = os.environ.get("FTCLI_TEST_RANK0_FAULT")
if _NAME and os.environ.get("RANK") == "0" and "TORCHELASTIC_RUN_ID" in os.environ:
    from ftcli.config.errors import UserError

    _raised = []

    def _fail_open(event, args):
        if event == "open" and not _raised and isinstance(args[0], str) and os.path.basename(args[0]) == _NAME:
            _raised.append(args[0])
            raise UserError(f"{args[0]}: cannot be opened (the rank-0 fault tests/support/rank0_fault plants)")

    sys.addaudithook(_fail_open)
