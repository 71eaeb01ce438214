"""
The recorded launch plan of AdamW4bit.step(): a step records what it launched (per group: torch's
fused-AdamW lists, the FP32-state reference loop, the kernels' prepared launches), and later steps
replay it with no Python per tensor beyond a signature check, while nothing it depends on changed
(PlanKey); gradients at new addresses only repoint the launch tables. capturable=True: the step
counters and lr live on the device, the replay runs inside the caller's CUDA graph capture or as
the plan's own CUDA graph. Functions of the optimizer (`opt`); they touch opt._plan,
opt._device_bufs and the tensors the plan names.

Capture rules (capturable=True): under torch.cuda.graph capture, step() repeats the last step()
taken outside capture, so that step must have been taken with the gradients the graph will use
(same addresses: zero_grad(set_to_none=False)), and lr must be a 0-d CUDA tensor updated in place
(lr.fill_(value)); anything else is a RuntimeError saying which (outside capture a float lr is
copied to the device each step). Outside a capture, on CUDA, a
replay runs as one CUDA graph (host time ~0.1 ms per step), captured again when the gradients
move. The bias corrections are a float64 table per (betas, weight_decay), capturable_bias_table, rebuilt
with the plan when they change: a momentum schedule (OneCycleLR's cycle_momentum) rebuilds it
every step and is slow here, though still correct.
"""
import os
from typing import NamedTuple

import torch

from lowbit.optim.fp32 import fp32_loop, fused_fp32_args, fused_fp32_group, split_fp32
from lowbit.optim.launch import capturable_bias_table, triton_regrad
from lowbit.optim.args import group_hparams
from lowbit.optim.state import DTensor, drop_local_grads, local_params
from lowbit.optim.sr_bits import step_seed, seed_base


class PlanKey(NamedTuple):
    """What a recorded plan depends on, beyond the hyperparameters and the seed that replay reads
    each step and the gradients' addresses (compared apart, with layout_key when one moved)."""
    version: int            # opt._plan_version: states created or loaded, groups added, LM head marked
    state_id: int           # id(opt.state)
    interp: bool            # TRITON_INTERPRET=1
    impl: str
    lm_head_sr: bool        # the LM head's first moment takes SR
    quantize: tuple         # each group's quantize flag
    group_sizes: tuple      # parameters per group
    param_ids: tuple        # the parameters (their local tensors for FSDP2)
    param_ptrs: tuple       # and their storage; a dtype changes only with a new storage
    grad_kinds: tuple       # each gradient's (dtype, contiguous), or None
    capture: tuple          # capturable: what its launches keep (betas, eps, wd, the lr tensor)


def layout_key(params, grads):
    # what a recorded step plan assumes of each parameter and gradient beyond their addresses
    return tuple([None if g is None else (p.dtype, p.is_contiguous(), g.dtype,
                                          g.layout is torch.strided and g.is_contiguous())
                  for p, g in zip(params, grads)])


def plan_key(opt, interp, params, grads):
    # The PlanKey of this step (a new gradient may take the old one's address: its dtype and
    # contiguity are in the key). None: no plan (DTensor parameters: before step() has their
    # local aliases, or gathered).
    ids = tuple(map(id, params))
    plan = opt._plan   # the same objects as the plan's: no DTensor (isinstance is slow on tensors)
    if (plan is None or plan["key"].param_ids != ids) and DTensor is not None and \
            any(isinstance(p, DTensor) for p in params):
        return None
    after = opt.qcfg["lm_head_sr_after"]
    groups = opt.param_groups
    return PlanKey(opt._plan_version, id(opt.state), interp, opt.impl, after is not None and opt.progress >= after,
                   tuple([g["quantize"] for g in groups]), tuple(map(len, [g["params"] for g in groups])),
                   ids, tuple([p.data_ptr() for p in params]),
                   tuple([None if g is None else (g.dtype, g.layout is torch.strided and g.is_contiguous())
                          for g in grads]),
                   tuple([(g["betas"], g["eps"], g["weight_decay"], id(g["lr"]) if torch.is_tensor(g["lr"]) else None)
                          for g in groups]) if opt.capturable else None)


def replay_or_new_plan(opt, capturing):
    """Replay opt's recorded plan if nothing it depends on changed and return None; else a new
    empty plan (a dict) for the step to record into. Raises RuntimeError under CUDA graph capture
    when there is nothing to repeat."""
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    params = opt._params()
    grads = [p.grad for p in params]
    views = opt._local_views
    if views:   # FSDP2: the plan runs on the local tensors
        params, grads = local_params(params, grads, views)
    gptrs = tuple([0 if g is None or g.layout is not torch.strided else g.data_ptr() for g in grads])
    key = plan_key(opt, interp, params, grads)
    plan = opt._plan
    if plan is not None and plan["key"] == key and (
            gptrs == plan["grads"] or plan["layout"] == layout_key(params, grads)):
        replay(opt, plan, grads, gptrs, capturing)
        drop_local_grads(views)
        return None
    if capturing:
        raise RuntimeError("AdamW4bit(capturable=True): step() under CUDA graph capture repeats the "
                           "last step() taken outside capture, and this one differs from it (parameters, "
                           "gradients, param groups or states changed, or there was none): take one "
                           "step() outside capture first, with the gradients the graph will use")
    return dict(key=key, layout=layout_key(params, grads), states=[], groups=[], k=0, grads=gptrs)


def finish_plan(opt, plan):
    """Keep a fully recorded plan for the next steps (capturable: with its step counters and
    whether it can run as a CUDA graph)."""
    if opt.capturable:
        plan["steps"] = [st["step"] for st in plan["states"]]
        plan["graphable"] = all(g["device"] is None or (g["device"].type == "cuda" and not g["loop"])
                                for g in plan["groups"])
    opt._plan = plan


def run_group(opt, plan, gi, group, hp, fp32, launches, fused_devices):
    """One param group's FP32-state steps and kernel launches at this step, recorded in `plan` as
    launch_plan repeats them. hp: (lr, b1, b2, eps, wd); fp32: (param, state, t, seed index)
    items; launches: (t, prepared launch, its (param, state, index) items, the launch function);
    fused_devices: where FP32 parameters take torch's fused AdamW."""
    device = next((p.device for p in group["params"] if p.grad is not None), None)
    by_t, loop = split_fp32(fp32, fused_devices)
    fp32_loop(loop, 0, hp, opt.qcfg["param_rounding"], opt.seed)
    lr = device_lr(opt, gi, group, device) if opt.capturable and by_t else None
    fused = [(t, fused_fp32_args(its, lr)) for t, its in by_t.items()]
    for t, a in fused:        # the host's t and lr at this step, as without a plan
        fused_fp32_group(dict(a, lr=None), t, *hp)
    gplan = dict(group=group, index=gi, device=device, fused=fused, loop=loop, launches=[])
    plan["groups"].append(gplan)
    for t, launch, items, run in launches:
        if opt.capturable:
            launch["dev"] = device_args(opt, gi, group, items[0][1], device)
        run(launch, *hp, t, step_seed(opt.seed, t))
        gplan["launches"].append((t, launch, [p for p, _, _ in items], run))


def replay(opt, plan, grads, gptrs, capturing=False):
    # the recorded step, k steps later: the same tensors, groups and launches, each group's
    # step t + k; the hyperparameters (lr, betas, eps, weight_decay), param_rounding and seed
    # are read now; gptrs: the gradients' addresses (the launch tables are repointed if moved).
    # capturable: the step counters and lr live on the device; the launches run inside the
    # caller's CUDA graph capture, or as this plan's own CUDA graph (captured again when the
    # gradients moved: torch's fused AdamW keeps their addresses)
    plan["k"] = k = plan["k"] + 1
    moved = gptrs != plan["grads"]
    plan["grads"] = gptrs
    if moved:
        for gplan in plan["groups"]:
            for _, launch, ps, _ in gplan["launches"]:
                gs = [p.grad for p in ps]
                if tuple(g.data_ptr() for g in gs) != launch["grads"]:
                    if capturing:
                        raise RuntimeError(
                            "AdamW4bit(capturable=True): the gradients are at other addresses than "
                            "at the last step() outside CUDA graph capture; keep them in place "
                            "(zero_grad(set_to_none=False)) or take a step() with them first")
                    triton_regrad(launch, gs)
    if not opt.capturable:
        for st in plan["states"]:
            st["step"] += 1
        launch_plan(opt, plan, k)
        return
    for gplan in plan["groups"]:       # lr into the device buffers the launches read
        if gplan["device"] is not None:
            device_lr(opt, gplan["index"], gplan["group"], gplan["device"], capturing)
    if capturing or not plan["graphable"]:
        if capturing and not plan["graphable"]:
            raise RuntimeError("AdamW4bit(capturable=True): a parameter takes the reference step "
                               "(non-contiguous, or not on CUDA), which cannot run in a CUDA graph")
        launch_plan(opt, plan, k)
        return
    graph = plan.get("graph")
    if graph is None or moved:
        plan["graph"] = graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch_plan(opt, plan, k)
    graph.replay()


def launch_plan(opt, plan, k):
    # a recorded plan's launches at step t + k (capturable: the step counters first)
    if opt.capturable:
        torch._foreach_add_(plan["steps"], 1.0)
    rule = opt.qcfg["param_rounding"]
    for gplan in plan["groups"]:
        group = gplan["group"]
        # capturable launches read lr on the device (and the loop, eager only, reads it here)
        hp = group_hparams(group) if not opt.capturable or gplan["loop"] else \
            (0.0, *group["betas"], group["eps"], group["weight_decay"])
        for t, a in gplan["fused"]:
            fused_fp32_group(a, t + k, *hp)
        fp32_loop(gplan["loop"], k, hp, rule, opt.seed)
        for t, launch, _, run in gplan["launches"]:
            run(launch, *hp, t + k, step_seed(opt.seed, t + k))


def device_lr(opt, index, group, device, capturing=False):
    # capturable: the 0-d tensor on `device` the kernels read lr from: the group's own lr if it
    # is one, else a float64 buffer of this optimizer filled with it (not under capture: a
    # graph would keep the value)
    lr = group["lr"]
    if torch.is_tensor(lr) and lr.device == device and lr.numel() == 1:
        return lr
    if capturing:
        raise RuntimeError(f"AdamW4bit(capturable=True): param_groups[{index}]['lr'] is {lr!r}; under "
                           f"CUDA graph capture it must be a 0-d tensor on {device} that you update "
                           "in place (lr.fill_(value)), or the graph would keep this value")
    buf = opt._device_bufs.get(("lr", index, device))
    if buf is None:
        buf = opt._device_bufs[("lr", index, device)] = torch.zeros((), dtype=torch.float64, device=device)
    buf.fill_(float(lr))
    return buf


def device_args(opt, index, group, state, device):
    # a capturable launch's device arguments (launch_scalars): the step counter of its
    # tensors (one t per launch), lr, the bias-correction table of the group's betas and wd
    b1, b2 = group["betas"]
    key = ("bias", b1, b2, group["weight_decay"], device)
    bias = opt._device_bufs.get(key)
    if bias is None:   # betas or wd changed (e.g. OneCycleLR's cycle_momentum): a new table
        for k in [k for k in opt._device_bufs if k[0] == "bias"][:-3]:
            del opt._device_bufs[k]           # keep the last few, not one per step
        bias = opt._device_bufs[key] = capturable_bias_table(b1, b2, group["weight_decay"]).to(device)
    return dict(step=state["step"], lr=device_lr(opt, index, group, device), bias=bias,
                rows=bias.shape[0], seed_term=seed_base(opt.seed))
