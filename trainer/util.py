"""What train.py's parts share: RunError (a run that cannot go on) and printing on rank 0 only.
Touches nothing but stdout."""

import os


class RunError(Exception):
    """A run that cannot go on: diverged loss, unreadable or mismatched checkpoint."""


def rank0():
    """True outside torchrun and on its rank 0 (torchrun sets RANK)."""
    return int(os.environ.get("RANK", 0)) == 0


def say(*a):
    """print on rank 0 only; flushed, so a piped log shows it at once."""
    if rank0():
        print(*a, flush=True)
