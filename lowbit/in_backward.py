"""
The optimizer step inside backward: each parameter is stepped as soon as its gradient is complete,
and the gradient is freed at once, so a full set of gradients never exists.

Once the optimizer states are 4-bit (1.06 B/param), the gradients are the largest state left
(2 B/param in BF16, 4 in FP32); stepping inside backward keeps at most the gradients that are
still being accumulated. A post-accumulate-grad hook steps its parameter alone, with the
optimizer's own step: `optimizer.step_param(p)` where the optimizer has one (AdamW4bit: host work
that does not grow with the number of parameters), else `optimizer.step()` with param_groups
narrowed for the call to p's group holding p alone (torch's optimizers walk only that). So each
parameter gets exactly the update of the ordinary step: AdamW4bit and torch's AdamW keep a step
count per parameter, and AdamW4bit's SR seeds depend on the parameter's position, not on which
others step with it.

Parameters that join later are stepped too: every parameter of the optimizer is hooked at the
call, frozen ones as well (progressive unfreezing: the hook fires once requires_grad is set), and
at the end of each backward the parameters of groups added since (add_param_group) are hooked and,
holding a complete gradient already, stepped then.

What it cannot do, and what to do instead:
- gradient clipping by the global norm needs every gradient before the first step (clip per
  parameter, or train without clipping);
- gradient accumulation over micro-steps would step on each micro-step's partial gradient (use a
  larger batch per step);
- a CUDA-graph-captured step (`AdamW4bit(capturable=True)`) replays all parameters at once;
- optimizers whose step reads more than the parameter's own gradient and state (a global norm,
  LBFGS's closure) do not step as they would after backward.
- optimizer.step() is not called: AdamW4bit's step hooks (register_step_pre_hook /
  register_step_post_hook) do not run (torch's optimizers run theirs once per parameter), and an
  LR scheduler warns that its step() came before optimizer.step(); the schedule itself works (set
  lr before each backward, as train.py does).
A group added later is noticed at the end of a backward in which some hooked parameter received a
gradient.
"""
import threading

import torch
from torch.autograd import Variable


def step_in_backward(optimizer, on_grad=None):
    """Make `loss.backward()` step every parameter of optimizer as its gradient completes, then
    free that gradient (p.grad = None). After this, call only `loss.backward()` per training step:
    no `optimizer.step()` or `zero_grad()`; learning-rate changes go into `param_groups` before
    the backward, as usual; parameters may be unfrozen and groups added later (module docstring).

    optimizer: a torch.optim.Optimizer that skips parameters whose .grad is None and keeps its
        state per parameter (torch's AdamW, adam4bit.AdamW4bit).
    on_grad: optional callable(p), called with each complete gradient before its step (e.g. to
        sum the squared gradient norm a log reports).
    Returns the list of hook handles, which grows as parameters join (`h.remove()` each to go
    back to ordinary steps).
    Raises TypeError for anything but a torch.optim.Optimizer; ValueError for a capturable AdamW4bit,
    or a parameter that already holds a gradient (its step would then include other gradients).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"step_in_backward: optimizer must be a torch.optim.Optimizer, "
                        f"got {type(optimizer).__name__}")
    if getattr(optimizer, "capturable", False):
        raise ValueError("step_in_backward: optimizer has capturable=True; its captured step updates "
                         "every parameter at once -- use capturable=False")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    held = [i for i, p in enumerate(params) if p.grad is not None]
    if held:
        raise ValueError(f"step_in_backward: {len(held)} parameter(s) (first: index {held[0]}) already "
                         f"hold a gradient; call optimizer.zero_grad(set_to_none=True) first")
    step_one = getattr(optimizer, "step_param", None) or _StepAlone(optimizer)
    lock = threading.Lock()     # CUDA backward runs hooks in one thread per device
    handles, hooked, task = [], set(), [None]

    def step(p):
        with lock:
            if on_grad is not None:
                on_grad(p)
            step_one(p)
        p.grad = None

    def hook(p):
        step(p)
        t = torch._C._current_graph_task_id()
        if t != task[0]:        # this backward's first hook: look for new parameters at its end
            task[0] = t
            Variable._execution_engine.queue_callback(join_new)

    def join_new():
        # parameters of groups added since the last look: hooked from now on, and stepped now if
        # this backward gave them their (complete) gradient
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in hooked:
                    watch(p)
                    if p.grad is not None:
                        step(p)

    def watch(p):
        hooked.add(id(p))
        if not p.is_leaf or not (p.is_floating_point() or p.is_complex()):   # no gradient of its own
            return
        frozen = not p.requires_grad
        if frozen:               # hooked frozen, so that it steps once it is unfrozen
            p.requires_grad_(True)
        try:
            handles.append(p.register_post_accumulate_grad_hook(hook))
        finally:
            if frozen:
                p.requires_grad_(False)

    for p in params:
        watch(p)
    return handles


class _StepAlone:
    """optimizer.step() for one parameter p alone: param_groups narrowed for the call to p's group
    holding p (the group itself, so what the step writes into it stays), as if no other parameter
    had a gradient. p's group is looked up in a map rebuilt when the groups change."""

    def __init__(self, optimizer):
        self.optimizer, self.key, self.group_of = optimizer, None, {}

    def __call__(self, p):
        opt = self.optimizer
        key = tuple((id(g), len(g["params"])) for g in opt.param_groups)
        if key != self.key:
            self.key, self.group_of = key, {id(q): g for g in opt.param_groups for q in g["params"]}
        group = self.group_of[id(p)]
        groups, params = opt.param_groups, group["params"]
        opt.param_groups, group["params"] = [group], [p]
        try:
            opt.step()
        finally:
            opt.param_groups, group["params"] = groups, params
