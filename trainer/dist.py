"""train.py's processes: DDP / FSDP2 setup (torchrun, the process group), a CPU run's threads, the
micro-batches per process, and the DDP / FSDP2 helpers the loop calls (wrapping, sharding, gradient
sync per micro-step, clipping of sharded gradients, gathering for eval). Touches the process group,
the thread count and the model's sharding, never the files in --out_dir."""

import contextlib
import inspect
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainer.util import RunError, say

TORCH_THREADS = torch.get_num_threads()  # PyTorch's own choice at import: OMP_NUM_THREADS or the physical cores


@dataclass
class Process:
    """This process: one of `world` under torchrun (ddp), or the only one; and its device."""
    ddp: bool
    rank: int
    world: int
    device: str

    @property
    def device_type(self):
        return "cuda" if self.device.startswith("cuda") else "cpu"

    @property
    def master(self):
        return self.rank == 0


def setup_distributed(args):
    """Process for this run. Under torchrun (RANK set) joins the process group: NCCL on CUDA,
    gloo on CPU."""
    if int(os.environ.get("RANK", -1)) == -1:
        dev = args.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        return Process(ddp=False, rank=0, world=1, device=dev)
    missing = [k for k in ("LOCAL_RANK", "WORLD_SIZE") if k not in os.environ]
    if missing:   # RANK alone: left over in the shell, not torchrun's
        raise SystemExit(f"train.py: error: RANK={os.environ['RANK']} is set but {' and '.join(missing)} "
                         "not: start a distributed run with torchrun, or unset RANK")
    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    use_cuda = args.device != "cpu" and torch.cuda.is_available()
    if use_cuda:
        if local_rank >= torch.cuda.device_count():   # else CUDA's "invalid device ordinal" on one rank
            raise SystemExit(f"train.py: error: LOCAL_RANK={local_rank} but this host has "
                             f"{torch.cuda.device_count()} GPU(s): start torchrun with --nproc_per_node at most "
                             f"{torch.cuda.device_count()}, or add --device cpu for gloo on CPU")
        dev = f"cuda:{local_rank}"
        torch.cuda.set_device(dev)
    else:
        dev = "cpu"
    if not dist.is_initialized():   # (a caller may have joined the group already)
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return Process(ddp=True, rank=rank, world=world, device=dev)


def setup_threads(args, proc):
    """Set PyTorch's intra-op CPU threads for a CPU run and say how many: --threads; else a count
    the user chose (OMP_NUM_THREADS, or torch.set_num_threads before main) is kept; else the cores
    less one, at least 1. Leaving a core free matters under load: OpenMP threads wait for each
    other at the end of every op, so one thread descheduled by another process stalls them all
    (measured both ways in results/README.md)."""
    if proc.device_type != "cpu":
        return
    n = torch.get_num_threads()
    if args.threads is not None:
        n, why = args.threads, "--threads"
    elif os.environ.get("OMP_NUM_THREADS"):
        why = "OMP_NUM_THREADS"
    elif n != TORCH_THREADS:
        why = "set before train.py ran"
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        n, why = max(1, min(cores, TORCH_THREADS) - 1), f"{cores} cores less one, so a busy core does not stall each op"
    torch.set_num_threads(n)
    say(f"CPU threads: {n} ({why}); change with --threads N or OMP_NUM_THREADS=N")


def set_grad_accum(args, world, ckpt=None):
    """--grad_accum when not given: the checkpoint's when resuming (the global batch stays, on any
    number of processes it divides), else one micro-batch per process. RunError (one line) when it
    does not divide by the number of processes."""
    given = args.grad_accum is not None
    if not given:
        args.grad_accum = ckpt["config"]["grad_accum"] if ckpt is not None else world
    if args.grad_accum % world:
        ours = not given and ckpt is not None
        raise RunError(f"--grad_accum {args.grad_accum}" + (" (the checkpoint's)" if ours else "")
                       + f" must be divisible by the number of processes ({world})"
                       + (f": resume it on a number of processes that divides {args.grad_accum} (a run that "
                          "should move to more processes later starts with a larger --grad_accum)" if ours else ""))


def wrap_ddp(model, proc):
    """DDP around `model`, without buffer broadcasts: the buffers (GaussWS seed state) advance
    identically on every rank."""
    no_sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters \
        else "broadcast_buffers"     # (torch >= 2.13 renamed it and warns on the old name)
    return DDP(model, device_ids=[torch.device(proc.device).index] if proc.device_type == "cuda" else None,
               **{no_sync: False})


def shard_model(model, world, device_type):
    """FSDP2: fully_shard each transformer block, then the root (embeddings, final norm, LM head), in
    place, on a mesh of `world` ranks of device_type ("cuda" or "cpu"); with one rank only the
    root (one unit: per-block all-gathers would save no memory and cost a collective round per
    block and pass). Parameters become DTensors sharded on dim 0 and are all-gathered around
    each unit's forward and backward, so GaussWS layers see the whole weight and b_i (their
    noise counters are buffers, replicated and advancing alike on every rank: R is the unsharded
    layer's). The master weights stay FP32 and autocast runs inside, as without FSDP2. train()
    then compiles the wrapped model as it does the plain one: Dynamo skips FSDP2's hooks (they
    run eagerly), so with one rank the root's hooks run around one graph of the whole forward,
    the plain path's; with more ranks the hooks around each block break the graph inside
    GPT.forward's loop, Dynamo runs that frame eagerly and compiles Block.forward (one graph for
    all blocks; embeddings, final norm, LM head and loss stay eager)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    # the run's own mesh: fully_shard's default is the host's accelerator, so a gloo run on CPU
    # (--device cpu) on a GPU host would put its ranks on cuda:0, cuda:1, ...
    mesh = init_device_mesh(device_type, (world,))
    if world > 1:
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def fsdp_micro_step(model, last, world):
    """Before each micro-step's forward under FSDP2: reduce-scatter gradients only on the last
    one. With one rank also keep the parameters unsharded until then: a shard is the whole
    tensor there, so resharding after a backward saves no memory and the next forward would
    gather (copy) every parameter again; with more ranks each unit reshards (FSDP2's memory).
    With one rank the root is the only unit (shard_model): no walk over the modules (~0.4 ms)."""
    model.set_requires_gradient_sync(last, recurse=world > 1)
    if world == 1:
        model.set_reshard_after_backward(last, recurse=False)


@torch.no_grad()
def clip_grad_norm_local(params, max_norm, world):
    """torch.nn.utils.clip_grad_norm_ for FSDP2 (DTensor) gradients, with the plain path's own
    operations on each rank's shards (get_total_norm, one foreach multiply): the
    squared norm is all-reduced over the ranks, not at all with one rank, so one rank gives the
    plain path's norm and clipping bit for bit. Returns the global norm (a 0-dim tensor)."""
    grads = [p.grad.to_local() for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    if world > 1:
        total = total.square()
        dist.all_reduce(total)
        total = total.sqrt()
    torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


@contextlib.contextmanager
def unsharded(model, fsdp):
    """Under FSDP2, the model's parameters all-gathered (plain tensors) inside the block."""
    units = [m for m in model.modules() if hasattr(m, "unshard") and hasattr(m, "reshard")] if fsdp else []
    for m in units:
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()
