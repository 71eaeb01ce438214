"""What a run holds in memory: BF16 parameters (--param_dtype bf16), the check that one
micro-batch's activations fit the device before the model is built, and the measures the log
reports (peak memory, optimizer-state bytes). Reads the device's memory size; writes nothing."""

import os

import torch

from model import PRESETS
from trainer.util import RunError


def params_to_bf16(model):
    """--param_dtype bf16: the weights themselves in BF16, in place; the PQT bitwidths b_i stay
    FP32 (their small steps would round away in BF16)."""
    for name, p in model.named_parameters():
        if not name.endswith("b_i"):
            p.data = p.data.to(torch.bfloat16)


def check_activations_fit(args, cfg, proc):
    """RunError (one line) before the model is built when one micro-batch's activations cannot fit
    the device's memory: a --block_size far beyond the preset's context would otherwise run out
    of memory, or on a CPU swap for hours, inside the first step. The estimate is a floor: ~34
    bytes per token and width per block (Korthikanti et al. 2022, attention's memory linear in
    the length as with flash attention; ~2 per block and one block's 34 with
    --activation_checkpointing) plus the float32 logits and their gradient."""
    B, T, d = args.batch_size, args.block_size, cfg.n_embd
    per_block = 2 * cfg.n_layer + 34 if args.activation_checkpointing else 34 * cfg.n_layer
    need = B * T * d * per_block + 8 * B * T * cfg.vocab_size
    if proc.device_type == "cuda":
        have = torch.cuda.get_device_properties(proc.device).total_memory
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    if have and need > have:
        raise RunError(f"--block_size {T} with --batch_size {B}: one micro-batch's activations need at least "
                       f"{need / 2**30:.0f} GiB, more than this device's {have / 2**30:.0f} GiB (the preset's context "
                       f"is {PRESETS[args.preset]['block_size']}); lower --block_size or --batch_size")


def peak_memory_mb(device_type):
    if device_type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    except Exception:
        return float("nan")


def optimizer_state_bytes(opt):
    """Bytes this process holds in optimizer state tensors (opt.state_nbytes() when the optimizer
    has it; under FSDP2 the local shards of DTensor states; a tensor subclass such as TorchAO's
    4-bit state by its inner tensors); the scalar step counters are not counted, as in
    AdamW4bit.state_nbytes()."""
    if hasattr(opt, "state_nbytes"):
        return int(opt.state_nbytes())

    def nbytes(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        if hasattr(t, "__tensor_flatten__"):
            return sum(nbytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
        return t.numel() * t.element_size()
    return sum(nbytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
