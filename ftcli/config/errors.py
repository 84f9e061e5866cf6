"""The one exception type for mistakes a user can make (bad recipe, bad data, missing package,
refusing to overwrite). The CLI prints its message as one line and exits 2; anything else is a bug."""


class UserError(Exception):
    """A user-fixable problem; `str(err)` is one line that says what to do."""


class TrainingStopped(UserError):
    """A stop every rank of a training job decides together (same numbers on all ranks): only rank 0
    reports it, the other ranks exit quietly with the same code."""
