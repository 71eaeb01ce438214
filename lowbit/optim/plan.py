"""
The recorded launch plan of AdamW4bit.step(): a step records what it launched (per group: torch's
fused-AdamW lists, the FP32-state reference loop, the kernels' prepared launches), and later steps
replay it with no Python per tensor beyond a signature check, while nothing it depends on changed
(PlanKey); gradients at new addresses only repoint the launch tables. capturable=True: the step
counters and lr live on the device, the replay runs inside the caller's CUDA graph capture or as
the plan's own CUDA graph. A StepPlan holds the recorded step, what voids it and the device
buffers; it sees the optimizer only through its arguments and touches the tensors it names.

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
from itertools import chain
from operator import is_
from typing import NamedTuple

import torch

from lowbit.optim.fp32 import fp32_loop, fused_fp32_args, fused_fp32_group, split_fp32
from lowbit.optim.launch import capturable_bias_table
from lowbit.optim.state import DTensor
from lowbit.optim.sr_bits import seed_base, shard_offset, step_seed


def hparams(group, lr=True):
    """(lr, b1, b2, eps, wd) of a param group for this step as Python floats; each may be a real
    number of any type (a LambdaLR may write NumPy scalars) or a one-element tensor (schedulers'
    lr, torch's tensor betas). lr=False: 0.0 for lr (a capturable launch reads it on the device)."""
    return tuple([float(x.item()) if torch.is_tensor(x) else float(x)
                  for x in (group["lr"] if lr else 0.0, *group["betas"], group["eps"], group["weight_decay"])])


class PlanKey(NamedTuple):
    """What a recorded plan depends on, beyond the hyperparameters and the seed that replay reads
    each step and the gradients' addresses (compared apart, with layout_key when one moved)."""
    version: int            # StepPlan.invalidate(): states created or loaded, groups added, LM head marked
    config: tuple           # the optimizer's: id(state), impl, whether the LM head's first moment takes SR
    interp: bool            # TRITON_INTERPRET=1
    group_ids: tuple        # the param group dicts (a replaced dict is read anew)
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


class StepPlan:
    """AdamW4bit.step()'s recorded plan (module docstring), what voids it (its version) and the
    capturable step's device buffers (lr per group, capturable_bias_table per betas and wd).

    A step calls replay_or_record; when it returns a new record (nothing to replay) the step runs
    each param group through run_group, which records it, and keeps the record with keep()."""

    def __init__(self, capturable):
        self.capturable = capturable
        self.version = 0          # bumped by invalidate()
        self.recorded = None      # the kept record (a dict), replayed while its key holds
        self.device_bufs = {}     # ("lr", group index, device) / ("bias", b1, b2, wd, device) -> tensor

    def invalidate(self):
        """Void the recorded plan: states were created or loaded, a group added, the LM head marked."""
        self.version += 1

    def replay_or_record(self, groups, config, params, grads, seed, rule, capturing, state):
        """Replay the recorded step if nothing it depends on changed (PlanKey) and return None;
        else drop it and return a new empty record (a dict) for the step to run and record.
        groups: the optimizer's param groups; config: its (id(state), impl, LM-head SR) tuple;
        params, grads: every parameter and its gradient (FSDP2 ones as local tensors); seed,
        rule: the SR seed and param_rounding; state: the optimizer's state (parameter -> dict).
        Raises RuntimeError under CUDA graph capture when there is nothing to repeat."""
        interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
        gptrs = tuple([0 if g is None or g.layout is not torch.strided else g.data_ptr() for g in grads])
        key = self._key(groups, config, interp, params, grads)
        plan = self.recorded
        if plan is not None and plan["key"] == key and self._counters_kept(plan) and self._states_kept(plan, state) and (
                gptrs == plan["grads"] or plan["layout"] == layout_key(params, grads)):
            self._replay(plan, grads, gptrs, seed, rule, capturing)
            return None
        if capturing:
            raise RuntimeError("AdamW4bit(capturable=True): step() under CUDA graph capture repeats the "
                               "last step() taken outside capture, and this one differs from it (parameters, "
                               "gradients, param groups or states changed, or there was none): take one "
                               "step() outside capture first, with the gradients the graph will use")
        self.recorded = None
        return dict(key=key, layout=layout_key(params, grads), states=[], owners=[], groups=[], k=0, grads=gptrs)

    def _key(self, groups, config, interp, params, grads):
        # The PlanKey of this step (a new gradient may take the old one's address: its dtype and
        # contiguity are in the key). None: no plan (DTensor parameters: before step() has their
        # local aliases, or gathered).
        ids = tuple(map(id, params))
        plan = self.recorded   # the same objects as the plan's: no DTensor (isinstance is slow on tensors)
        if (plan is None or plan["key"].param_ids != ids) and DTensor is not None and \
                any(isinstance(p, DTensor) for p in params):
            return None
        return PlanKey(self.version, config, interp, tuple(map(id, groups)),
                       tuple([g["quantize"] for g in groups]), tuple(map(len, [g["params"] for g in groups])),
                       ids, tuple([p.data_ptr() for p in params]),
                       tuple([None if g is None else (g.dtype, g.layout is torch.strided and g.is_contiguous())
                              for g in grads]),
                       tuple([(g["betas"], g["eps"], g["weight_decay"], id(g["lr"]) if torch.is_tensor(g["lr"])
                               else None) for g in groups]) if self.capturable else None)

    def run_group(self, record, gi, group, hp, states, fp32, launches, seed, rule, owners=()):
        """One param group's FP32-state steps and kernel launches at this step, recorded in
        `record` as _launch_all repeats them. hp: (lr, b1, b2, eps, wd); states: the group's
        states stepped (their counters advance on replay); fp32: (param, state, t, seed index)
        items; launches: (t, launch.Launch, its (param, state, index) items); seed, rule: the
        SR seed and param_rounding; owners: the parameters the states belong to (state's keys)."""
        record["states"] += states
        record["owners"] += owners
        device = next((p.device for p in group["params"] if p.grad is not None), None)
        by_t, loop = split_fp32(fp32)
        fp32_loop(loop, 0, hp, rule, seed)
        lr = self._device_lr(gi, group, device) if self.capturable and by_t else None
        fused = [(t, fused_fp32_args(its, lr)) for t, its in by_t.items()]
        for t, a in fused:        # the host's t and lr at this step, as without a plan
            fused_fp32_group(dict(a, lr=None), t, *hp)
        gplan = dict(group=group, index=gi, device=device, fused=fused, loop=loop, launches=[])
        record["groups"].append(gplan)
        for t, launch, items in launches:
            if self.capturable:
                launch.dev = self._device_args(gi, group, items[0][1], device, seed)
            launch.run(*hp, t, step_seed(seed, t))
            gplan["launches"].append((t, launch, [p for p, _, _ in items]))

    def keep(self, record):
        """Keep a fully recorded step for the next ones (capturable: with its step counters and
        whether it can run as a CUDA graph)."""
        if self.capturable:
            record["steps"] = [st["step"] for st in record["states"]]
            record["graphable"] = all(g["device"] is None or (g["device"].type == "cuda" and not g["loop"])
                                      for g in record["groups"])
        else:    # the step counters (0-d CPU tensors) become views of one tensor, which a replay advances
            record["counter"] = torch.stack([st["step"] for st in record["states"]]) if record["states"] else \
                torch.zeros(0)
            for i, st in enumerate(record["states"]):
                st["step"] = record["counter"][i]
            record["expect"] = record["counter"].clone()
        record["state_values"] = list(chain.from_iterable(map(dict.values, record["states"])))
        self.recorded = record

    def _counters_kept(self, plan):
        # Whether the step counters hold the values the plan left there: its t would be stale after
        # a state dict loaded in place (DCP's dcp.load into optimizer.state_dict()); a counter
        # replaced is a state tensor replaced (_states_kept). A capturable step reads t on the device.
        return self.capturable or torch.equal(plan["counter"], plan["expect"])

    @staticmethod
    def _states_kept(plan, state):
        # Whether the optimizer still holds the states the plan steps, with the same tensors: a state
        # dict replaced or dropped (opt.state.clear(), opt.state[p] = {...}) or a state tensor
        # replaced (st["exp_avg"] = t.to(...)) voids the plan, which would step the old ones
        now = list(chain.from_iterable(map(dict.values, plan["states"])))
        return len(now) == len(plan["state_values"]) and all(map(is_, now, plan["state_values"])) and \
            all(map(is_, map(state.get, plan["owners"]), plan["states"]))

    def _replay(self, plan, grads, gptrs, seed, rule, capturing):
        # the recorded step, k steps later: the same tensors, groups and launches, each group's
        # step t + k; the hyperparameters (lr, betas, eps, weight_decay) are read now; gptrs: the
        # gradients' addresses (the launch tables are repointed if moved). capturable: the step
        # counters and lr live on the device; the launches run inside the caller's CUDA graph
        # capture, or as this plan's own CUDA graph (captured again when the gradients moved:
        # torch's fused AdamW keeps their addresses)
        plan["k"] = k = plan["k"] + 1
        moved = gptrs != plan["grads"]
        plan["grads"] = gptrs
        if moved:
            for gplan in plan["groups"]:
                for _, launch, ps in gplan["launches"]:
                    gs = [p.grad for p in ps]
                    if tuple(g.data_ptr() for g in gs) != launch.grads:
                        if capturing:
                            raise RuntimeError(
                                "AdamW4bit(capturable=True): the gradients are at other addresses than "
                                "at the last step() outside CUDA graph capture; keep them in place "
                                "(zero_grad(set_to_none=False)) or take a step() with them first")
                        launch.regrad(gs)
        if not self.capturable:
            plan["counter"] += 1          # every state's step counter (keep)
            plan["expect"] += 1
            self._launch_all(plan, k, seed, rule)
            return
        for gplan in plan["groups"]:       # lr into the device buffers the launches read
            if gplan["device"] is not None:
                self._device_lr(gplan["index"], gplan["group"], gplan["device"], capturing)
        if capturing or not plan["graphable"]:
            if capturing and not plan["graphable"]:
                raise RuntimeError("AdamW4bit(capturable=True): a parameter takes the reference step "
                                   "(non-contiguous, or not on CUDA), which cannot run in a CUDA graph")
            self._launch_all(plan, k, seed, rule)
            return
        graph = plan.get("graph")
        if graph is None or moved:
            plan["graph"] = graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._launch_all(plan, k, seed, rule)
        graph.replay()

    def _launch_all(self, plan, k, seed, rule):
        # a recorded plan's launches at step t + k (capturable: the step counters first)
        if self.capturable:
            torch._foreach_add_(plan["steps"], 1.0)
        for gplan in plan["groups"]:
            group = gplan["group"]
            # capturable launches read lr on the device (and the loop, eager only, reads it here)
            hp = hparams(group, lr=not self.capturable or bool(gplan["loop"]))
            for t, a in gplan["fused"]:
                fused_fp32_group(a, t + k, *hp)
            fp32_loop(gplan["loop"], k, hp, rule, seed)
            for t, launch, _ in gplan["launches"]:
                launch.run(*hp, t + k, step_seed(seed, t + k))

    def _device_lr(self, index, group, device, capturing=False):
        # capturable: the 0-d tensor on `device` the kernels read lr from: the group's own lr if it
        # is one, else a float64 buffer filled with it (not under capture: a graph would keep the
        # value)
        lr = group["lr"]
        if torch.is_tensor(lr) and lr.device == device and lr.numel() == 1:
            return lr
        if capturing:
            raise RuntimeError(f"AdamW4bit(capturable=True): param_groups[{index}]['lr'] is {lr!r}; under "
                               f"CUDA graph capture it must be a 0-d tensor on {device} that you update "
                               "in place (lr.fill_(value)), or the graph would keep this value")
        buf = self.device_bufs.get(("lr", index, device))
        if buf is None:
            buf = self.device_bufs[("lr", index, device)] = torch.zeros((), dtype=torch.float64, device=device)
        buf.fill_(float(lr))
        return buf

    def _device_args(self, index, group, state, device, seed):
        # a capturable launch's device arguments (Launch.run): the step counter of its tensors
        # (one t per launch), lr, the bias-correction table of the group's betas and wd
        _, b1, b2, _, wd = hparams(group, lr=False)
        key = ("bias", b1, b2, wd, device)
        bias = self.device_bufs.get(key)
        if bias is None:   # betas or wd changed (e.g. OneCycleLR's cycle_momentum): a new table
            for k in [k for k in self.device_bufs if k[0] == "bias"][:-3]:
                del self.device_bufs[k]           # keep the last few, not one per step
            bias = self.device_bufs[key] = capturable_bias_table(b1, b2, wd).to(device)
        return dict(step=state["step"], lr=self._device_lr(index, group, device), bias=bias,
                    rows=bias.shape[0], seed_term=seed_base(seed))


class ParamPlan:
    """AdamW4bit.step_param's bookkeeping, O(1) per call: each parameter's place (group index and
    index from 1, its SR seed index) from a map rebuilt only when the groups change, and each
    parameter's prepared launch, kept while what it assumes holds and repointed when only the
    gradient moved (the step inside backward gets a new gradient every step)."""

    def __init__(self):
        self.layout, self.places, self.launches = None, {}, {}

    def place(self, groups, p):
        """(group index, index from 1) of p; ValueError for a tensor in no group."""
        layout = tuple((id(g), len(g["params"])) for g in groups)
        if self.layout != layout:
            flat = [(gi, j) for gi, g in enumerate(groups) for j in range(len(g["params"]))]
            self.layout = layout
            self.places = {id(groups[gi]["params"][j]): (gi, j, i + 1) for i, (gi, j) in enumerate(flat)}
        gi, j, index = self.places.get(id(p), (0, -1, 0))
        if j < 0 or groups[gi]["params"][j] is not p:
            raise ValueError(f"step_param: the tensor of shape {tuple(p.shape)} is not a parameter of this "
                             "optimizer")
        return gi, index

    def launch(self, kind, p, st, sidx, build):
        """p's launch.Launch for kind (its path and m's rule), built by build() when new or when a
        tensor it reads moved, else repointed at p.grad."""
        key = (kind, p.data_ptr(), p.dtype, p.grad.dtype, int(sidx), shard_offset(sidx),
               tuple(v.data_ptr() for v in st.values() if torch.is_tensor(v)))
        kept = self.launches.get(id(p))
        if kept is None or kept[0] != key:
            kept = self.launches[id(p)] = (key, build())
        elif kept[1].grads[0] != p.grad.data_ptr():
            kept[1].regrad([p.grad])
        return kept[1]
