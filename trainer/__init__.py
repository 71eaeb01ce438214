"""train.py's parts: flags, checkpoints, the run log and signals, processes (DDP / FSDP2, threads),
the optimizer and its schedule, memory, the loop's metrics, shared errors."""
