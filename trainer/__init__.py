"""train.py's parts: flags, checkpoints, the run log and signals, distributed setup, shared errors."""
