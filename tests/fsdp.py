"""
The FSDP2 runs that test_optim.py and test_pqt.py check, computed once per pytest worker by the
fsdp_runs fixture (conftest.py): a quadratic with one parameter per shape, stepped by AdamW4bit under
fully_shard on 2 gloo processes; its DCP checkpoints loaded on 1 and 2 ranks and without fully_shard;
two GaussWS layers in fully_shard units.
"""
import os
import warnings

import torch
import torch.nn as nn

import adam4bit as A
import gaussws as g


# shapes: whole-row blocks, even (40 rows) and uneven (33 rows) on 2 ranks; rows that split
# blocks (64 elements) and a 1-D tensor (the gathered step); an FP32-state vector
FSDP_SHAPES = [(40, 256), (33, 128), (96, 64), (4096,), (33,)]
FSDP_PRESETS = ("torchao", "zeeden")     # RTN presets, bit-identical for any world size (SR: test_optim.py)


class Quadratic(nn.Module):
    """sum_i c_i (p_i - x_i)², one parameter per shape (initial values from `seed`)."""

    def __init__(self, seed=0, shapes=FSDP_SHAPES):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(s, generator=g)) for s in shapes])

    def forward(self, xs):
        return sum((((p - x) ** 2) * (i + 1)).sum() for i, (p, x) in enumerate(zip(self.ps, xs)))


def quadratic_steps(model, opt, first, last):
    """Steps first..last-1 with targets drawn from the step number (the same on every rank)."""
    for s in range(first, last):
        g = torch.Generator().manual_seed(1000 + s)
        model([torch.randn(x.shape, generator=g) for x in model.ps]).backward()
        opt.step()
        opt.zero_grad()


def full_params(model):
    from torch.distributed.tensor import DTensor
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for p in model.parameters()]


def fsdp_quadratic(preset, seed=0, impl="torch", shapes=FSDP_SHAPES):
    from torch.distributed.fsdp import fully_shard
    model = fully_shard(Quadratic(seed, shapes))
    return model, A.AdamW4bit(model.parameters(), lr=1e-2, preset=preset, impl=impl)


def plain_quadratic(preset, steps, shapes=FSDP_SHAPES):
    model = Quadratic(shapes=shapes)
    opt = A.AdamW4bit(model.parameters(), lr=1e-2, preset=preset, impl="torch")
    quadratic_steps(model, opt, 0, steps)
    return model, opt


def fsdp_gaussws():
    """Two GaussWS layers, unsharded and in fully_shard units (each layer and the root): outputs
    and gradients of two training calls, the noise counters, and which tensors are sharded."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    torch.manual_seed(0)
    plain = nn.Sequential(g.GaussWSLinear(64, 96, seed=3), g.GaussWSLinear(96, 40, seed=4))
    sharded = nn.Sequential(g.GaussWSLinear(64, 96, seed=3), g.GaussWSLinear(96, 40, seed=4))
    sharded.load_state_dict(plain.state_dict())
    for layer in sharded:
        fully_shard(layer)
    fully_shard(sharded)
    res = {"sharded": [n for n, p in sharded.named_parameters() if isinstance(p, DTensor)],
           "buffers_plain": [n for n, b in sharded.named_buffers() if not isinstance(b, DTensor)]}
    late = nn.Sequential(nn.Linear(64, 96))
    fully_shard(late)
    try:   # apply_pqt after fully_shard: refused, naming the order
        g.apply_pqt(late, modules="*")
    except ValueError as e:
        res["apply_after_shard"] = str(e)
    for name, model in (("plain", plain), ("fsdp", sharded)):
        gen = torch.Generator().manual_seed(1)
        outs = []
        for _ in range(2):
            y = model(torch.randn(8, 64, generator=gen))
            y.square().sum().backward()
            outs.append(y.detach())
        res[name] = dict(out=outs, grads={n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                                          for n, p in model.named_parameters()},
                         noise_state=[b.clone() for n, b in model.named_buffers() if n.endswith("noise_state")])
    return res


def train_and_save(rank, world, tmp):
    # 3 steps, a DCP checkpoint, 2 more steps (the reference step on the local shards); one step of
    # the fused kernel (interpreter, ~10 s a step) on the local shards; GaussWS layers in
    # fully_shard units (fsdp_gaussws above)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    res = {"gaussws": fsdp_gaussws()}
    model, opt = fsdp_quadratic("torchao", impl="triton", shapes=FSDP_SHAPES[:2])   # the row-sharded ones
    quadratic_steps(model, opt, 0, 1)
    res["triton", 1] = full_params(model)
    for preset in FSDP_PRESETS:
        model, opt = fsdp_quadratic(preset)
        quadratic_steps(model, opt, 0, 3)
        res[preset, 3] = full_params(model)
        res[preset, "quantized"] = [opt.is_quantized(p) for p in model.parameters()]
        res[preset, "local"] = [{k: tuple(v.to_local().shape) for k, v in opt.state[p].items() if k != "step"}
                                for p in model.parameters()]
        res[preset, "nbytes"] = opt.state_nbytes()
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=os.path.join(tmp, f"dcp-{preset}"))
        quadratic_steps(model, opt, 3, 5)
        res[preset, 5] = full_params(model)
    return res


def dcp_load_and_continue(model, opt, path):
    """Load the DCP checkpoint at path into model and opt (fresh), then steps 3 and 4."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    steps = [float(opt.state[p]["step"]) for p in model.parameters()]
    quadratic_steps(model, opt, 3, 5)
    return steps, full_params(model)


def load_and_continue(rank, world, tmp, prefix="dcp"):
    # a fresh model (other initial values) and optimizer load a checkpoint, then 2 steps
    res = {}
    for preset in FSDP_PRESETS:
        model, opt = fsdp_quadratic(preset, seed=1)
        res[preset, "steps"], res[preset, 5] = dcp_load_and_continue(model, opt, os.path.join(tmp, f"{prefix}-{preset}"))
    return res


def unwrapped_dcp_round_trip(tmp):
    """In this process, without fully_shard: load each 2-rank checkpoint (dcp-PRESET) and step on;
    train 3 steps and save dcp-plain-PRESET, for 2 ranks to load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    res = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # DCP in one process without a process group: intended
        for preset in FSDP_PRESETS:
            model = Quadratic(seed=1)
            opt = A.AdamW4bit(model.parameters(), lr=1e-2, preset=preset, impl="torch")
            res[preset, "steps"], res[preset, 5] = dcp_load_and_continue(model, opt, os.path.join(tmp, f"dcp-{preset}"))
            model, opt = plain_quadratic(preset, 3)
            dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                     checkpoint_id=os.path.join(tmp, f"dcp-plain-{preset}"))
    return [res]
