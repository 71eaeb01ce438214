"""bench.py's sections: kernels (optim, host, noise), training (train, memory, ddp, fsdp), capacity,
multigpu, and the timing helpers (util)."""
