"""train.py's processes: DDP / FSDP2 setup (torchrun, the process group) and the FSDP2 helpers the
loop calls (sharding, gradient sync per micro-step, clipping of sharded gradients, gathering for
eval). Touches the process group and the model's sharding, never the files in --out_dir."""

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


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
