"""
The optimizer step inside backward: each parameter is stepped as soon as its gradient is complete,
and the gradient is freed at once, so a full set of gradients never exists.

Once the optimizer states are 4-bit (1.06 B/param), the gradients are the largest state left
(2 B/param in BF16, 4 in FP32); stepping inside backward keeps at most the gradients that are
still being accumulated. The step is the optimizer's own: `optimizer.step()` is called from a
post-accumulate-grad hook while the parameter is the only one holding a gradient (every earlier
one was freed by its own hook, the later ones are not computed yet), so each parameter gets
exactly the update of the ordinary step -- AdamW4bit and torch's AdamW keep a step count per
parameter, and AdamW4bit's SR seeds depend on the parameter's position, not on which others step
with it.

What it cannot do, and what to do instead:
- gradient clipping by the global norm needs every gradient before the first step (clip per
  parameter, or train without clipping);
- gradient accumulation over micro-steps would step on each micro-step's partial gradient (use a
  larger batch per step);
- a CUDA-graph-captured step (`AdamW4bit(capturable=True)`) replays all parameters at once.
"""

import torch


def step_in_backward(optimizer, on_grad=None):
    """Make `loss.backward()` step every parameter of optimizer as its gradient completes, then
    free that gradient (p.grad = None). After this, call only `loss.backward()` per training step:
    no `optimizer.step()` or `zero_grad()`; learning-rate changes go into `param_groups` before
    the backward, as usual.

    optimizer: a torch.optim.Optimizer that skips parameters whose .grad is None and keeps its
        step count per parameter (torch's AdamW, adam4bit.AdamW4bit).
    on_grad: optional callable(p), called with each complete gradient before its step (e.g. to
        sum the squared gradient norm a log reports).
    Returns the hook handles (`h.remove()` each to go back to ordinary steps).
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

    def hook(p):
        if on_grad is not None:
            on_grad(p)
        optimizer.step()
        p.grad = None

    return [p.register_post_accumulate_grad_hook(hook) for p in params if p.requires_grad]
