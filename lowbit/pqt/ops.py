"""How gaussws.py's sampling reaches its kernels: eager launches or torch.compile's (`kernel_launcher`), the
torch.library ops gaussws::pqn_sample / pqn_grad / next_seed that torch.compile traces with their
eager autograd.Function twins (`register_sample_ops`, also the "recompute" memory mode's linear),
and the per-call seed of a layer with the checks that keep activation checkpointing from reusing
the wrong one (§3.6 of paper A: one Philox stream per layer call).

Eager code runs gaussws.py's plain functions through an autograd.Function (an op call costs a
dispatch per layer and step); under torch.compile the ops let Inductor launch the Triton kernels
from its own generated code. Nothing here computes R, w_hat or a gradient.

Activation checkpointing (torch.utils.checkpoint re-runs a forward inside the backward). Compiled
(the checkpoint inside the compiled function, as a compiled model.GPT with checkpoint_blocks): a
call's seed is saved for backward, never recomputed (`layer_seed`), so the gradients are those of
the run without checkpointing, bit for bit, however often a region calls a layer. Eager: the
recomputation reuses the layer's last seed, right for one call only. Not supported (wrong
gradients, not detected): with use_reentrant=True a layer called once inside a checkpointed region
and again outside it before the backward; an eager checkpoint around a function compiled on its
own (`block.compile()`): its recomputation re-runs the compiled forward, which draws the next seed.
Not supported and detected (RuntimeError naming the layer, in backward): in eager code, a layer
called more than once inside one checkpointed region, and two checkpointed forwards before one
backward. Each eager call tags its seed: with use_reentrant=False the backward compares its call's
tag with the tag of the seed the recomputation saved; with use_reentrant=True, which recomputes
each region once per backward, a second recomputation of a layer in one backward raises.
"""
import logging
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts


def kernel_launcher(kernel):
    """The kernel itself in eager code (Triton's own launcher); wrap_triton(kernel) while
    torch.compile traces a triton_op (a dispatch mode is active), so Inductor records the kernel
    in its graph. wrap_triton in eager code would add a dispatch, costlier than the launch itself,
    to every launch."""
    return kernel if _get_current_dispatch_mode() is None else wrap_triton(kernel)


# ----------------------------------------------------------------------------------------------
# the differentiable sample of gaussws.py (eq. 3 forward, eq. 4 backward) from its plain functions

def register_sample_ops(sample_impl, grad_impl):
    """gaussws::pqn_sample (differentiable) and gaussws::pqn_grad as triton ops of gaussws.py's
    plain functions, and their eager twin. sample_impl(w, b, seed, method, out_dtype, impl, fused,
    b_target, b_scale) -> (w_hat, tile maxima, live) is eq. 3, differentiable in w and b;
    grad_impl(g_w_hat, tmax, seed, live, method, w_dtype, b_dtype, impl, fused, b_scale) -> (∂L/∂w,
    ∂L/∂b) is eq. 4. Returns (sample, recompute_linear): sample(*args) is the differentiable call,
    the op under torch.compile (Inductor launches its Triton kernels from its own generated code)
    and an autograd.Function in eager code; recompute_linear(x, w, b, seed, bias, method, impl,
    fused, b_target, b_scale) is F.linear(x, w_hat, bias) keeping no w_hat for backward."""

    def ops():
        """(sample, grad) without autograd: the ops under torch.compile, the plain functions in
        eager code (no dispatch cost)."""
        if torch.compiler.is_compiling():
            return torch.ops.gaussws.pqn_sample, torch.ops.gaussws.pqn_grad
        return sample_impl, grad_impl

    def save(ctx, inputs, output):
        w, b, seed, method, out_dtype, impl, fused, b_target, b_scale = inputs
        ctx.mark_non_differentiable(output[1], output[2])
        ctx.set_materialize_grads(False)   # no zero-filled gradients for them: a launch each in eager code
        # tile maxima + seed (R is regenerated, not stored), 2^(1-b_t) and the clamp mask for ∂L/∂b
        ctx.save_for_backward(output[1], seed, output[2])
        ctx.args = (method, w.dtype, b.dtype, impl, fused, b_scale)
        ctx.call = call_of(seed)

    def grad(ctx, g_w_hat, g_tmax, g_live):
        # the op's and PQNSample's backward: the grad op where is_compiling() is true (torch 2.13 while
        # AOTAutograd traces a compiled backward), else the plain function, whose launches go through
        # wrap_triton under a tracing mode (kernel_launcher): right either way, whatever is_compiling() says there
        tmax, seed, live = ctx.saved_tensors
        check_recomputed_call(ctx.call, seed)
        if g_w_hat is None:                  # grads are not materialized: w_hat had none
            return (None,) * 9
        dw, db = ops()[1](g_w_hat, tmax, seed, live, *ctx.args)
        return dw, db, None, None, None, None, None, None, None

    sample_op = triton_op("gaussws::pqn_sample", mutates_args=())(sample_impl)
    triton_op("gaussws::pqn_grad", mutates_args=())(grad_impl)
    sample_op.register_autograd(grad, setup_context=save)

    class PQNSample(torch.autograd.Function):
        """Eager twin of gaussws::pqn_sample: the same functions, the same backward. In eager mode a
        torch.library op call costs far more host time (dispatch, autograd wrapper) than this
        autograd.Function, and a model makes one such call per layer and step, enough to make a large
        model's eager step host-bound. torch.compile traces the op instead."""

        generate_vmap_rule = True   # torch.func.vmap over a layer worked through the op; keep it working

        forward = staticmethod(sample_impl)
        setup_context = staticmethod(save)   # separate from forward: functorch needs it
        backward = staticmethod(grad)

    def sample(*args):
        if torch.compiler.is_compiling():
            return torch.ops.gaussws.pqn_sample(*args)
        return PQNSample.apply(*args)

    class RecomputeLinear(torch.autograd.Function):
        """y = F.linear(x, w_hat, bias) that keeps no w_hat for backward: it is rebuilt from
        (w, b, seed) there (gaussws's "recompute" memory mode)."""

        @staticmethod
        def forward(ctx, x, w, b, seed, bias, method, impl, fused, b_target, b_scale):
            w_hat, tmax, live = ops()[0](w, b, seed, method, x.dtype, impl, fused, b_target, b_scale)
            ctx.save_for_backward(x, w, b, seed, tmax, live)
            ctx.args = (method, impl, fused, b_target, b_scale, bias is not None)
            ctx.call = call_of(seed)
            return F.linear(x, w_hat, bias)

        @staticmethod
        def backward(ctx, gy):
            x, w, b, seed, tmax, live = ctx.saved_tensors
            check_recomputed_call(ctx.call, seed)
            method, impl, fused, b_target, b_scale, has_bias = ctx.args
            resample, regrad = ops()
            w_hat = resample(w, b, seed, method, x.dtype, impl, fused, b_target, b_scale)[0]
            gy2 = gy.reshape(-1, gy.shape[-1]).to(x.dtype)
            gx = (gy2 @ w_hat).view(x.shape)
            g_w_hat = gy2.t() @ x.reshape(-1, x.shape[-1])
            dw, db = regrad(g_w_hat, tmax, seed, live, method, w.dtype, b.dtype, impl, fused, b_scale)
            gb = gy2.sum(0) if has_bias else None
            return gx, dw, db, None, gb, None, None, None, None, None

    return sample, RecomputeLinear.apply


# ----------------------------------------------------------------------------------------------
# a layer's seed per call: [key, call counter], the counter advanced once per training call

@triton.jit
def _next_seed_kernel(state_ptr, out_ptr):
    t = tl.load(state_ptr + 1)
    tl.store(out_ptr, tl.load(state_ptr))
    tl.store(out_ptr + 1, t)
    tl.store(state_ptr + 1, t + 1)


def _next_seed_impl(state: torch.Tensor) -> torch.Tensor:
    """Returns a copy of state = [key, t] and advances t in place, in one op (one kernel on
    CUDA). One op on purpose: with `state.clone(); state[1] += 1` as separate ops in the model,
    Inductor may let the saved seed alias the buffer it then mutates, and the backward would
    regenerate R with t + 1. The copy is a new tensor on CPU too, not a clone: Inductor drops a
    clone as a no-op, and a region recomputed in backward would then read the advanced buffer."""
    if not state.is_cuda:
        seed = torch.stack((state[0], state[1]))
        state[1] += 1
        return seed
    seed = torch.empty_like(state)
    kernel_launcher(_next_seed_kernel)[(1,)](state, seed)
    return seed


_next_seed_op = triton_op("gaussws::next_seed", mutates_args=("state",))(_next_seed_impl)


def _seed_saved():
    """Selective-checkpoint contexts that save every value of their region for backward: the
    context_fn of a compiled call's seed (`layer_seed`)."""
    return create_selective_checkpoint_contexts(lambda ctx, op, *args, **kwargs: CheckpointPolicy.MUST_SAVE)


class _SeedRegionWarning(logging.Filter):
    """torch.compile warns (once) that a region with a checkpoint context_fn should hold no in-place
    op; the seed's region holds one on purpose, the counter's advance, saved whole: drop the warning
    when the region is the seed's, keep it for any other."""

    def filter(self, record):
        f = sys._getframe(1)
        while f is not None and f.f_code.co_name != "tag_activation_checkpoint_impl":
            f = f.f_back
        return f is None or f.f_locals.get("context_fn") is not _seed_saved


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_SeedRegionWarning())


def layer_seed(layer):
    """The seed [key, t] of a GaussWSLinear call (`GaussWSLinear._next_seed`): in eval mode the
    current state, unchanged; in a training forward the state before advancing t; inside a
    backward (torch.utils.checkpoint re-running the forward) the last call's seed again, tagged so
    the backward can check it is its own call's. Compiled, a training call's seed is saved for
    backward, so a checkpointed region's recomputation never draws one."""
    if not layer.training:
        return layer.noise_state.clone()
    if _in_backward_pass():      # activation recomputation of the last call: same seed
        if _in_reentrant_recomputation():
            # it recomputes each region once per backward: a second recomputation of the
            # layer in one backward is of another call (use_reentrant=False: the backward
            # checks the seed's tag instead; there nested regions recompute a call twice)
            replay = (torch._C._current_graph_task_id(), layer._last_call)
            if replay == layer._replayed:
                raise RuntimeError(_recompute_error(layer._name, "recomputes the layer a second "
                                                    "time in one backward"))
            layer._replayed = replay
        seed = layer.noise_state.clone()
        seed[1:].sub_(1)                     # a scalar kernel argument: no host-to-device copy
        seed._gaussws_call = layer._last_call   # backward checks it is its call's
        return seed
    if torch.compiler.is_compiling():
        if torch.is_grad_enabled():
            # saved for backward, never recomputed: torch.compile's recomputation of a checkpointed
            # region runs in the backward graph, where the counter holds what the forward wrote
            # back (t + 1); inside the block's region this nested policy wins (the innermost
            # region tags the ops last)
            return torch.utils.checkpoint.checkpoint(torch.ops.gaussws.next_seed, layer.noise_state,
                                                     use_reentrant=False, context_fn=_seed_saved)
        return torch.ops.gaussws.next_seed(layer.noise_state)
    seed = _next_seed_impl(layer.noise_state)   # eager: no op dispatch (see PQNSample)
    seed._gaussws_call = layer._last_call = (layer._name, layer._calls)
    layer._calls += 1
    return seed



def call_of(seed):
    """The (layer name, call number) an eager GaussWSLinear forward tagged its seed tensor with;
    None for other seeds (plain tensors, traced ones under torch.compile)."""
    return getattr(seed, "_gaussws_call", None)


def check_recomputed_call(call, seed):
    """Backward of a layer call: the seed it regenerates R from must be that call's. Under
    torch.utils.checkpoint (use_reentrant=False) the saved seed is the one the recomputation drew,
    the layer's last seed (see `GaussWSLinear._next_seed`); it is another call's when the layer ran
    more than once in the checkpointed region, or again (in any region) before this backward. The
    gradients would then be wrong: raise instead."""
    got = getattr(seed, "_gaussws_call", call)      # a seed without a tag (e.g. save_on_cpu) passes
    if call is not None and got is not call:
        raise RuntimeError(_recompute_error(call[0], f"recomputed its call {call[1]} with the seed of "
                                                     f"its call {got[1]}"))


def _recompute_error(name, what):
    return (f"GaussWSLinear {name}: torch.utils.checkpoint {what} (the recomputation reuses the "
            "layer's last seed), so the gradients would be wrong. Inside a checkpointed region call "
            "each GaussWSLinear once, and run backward before the layer's next forward (one "
            "checkpointed forward per backward); or leave the layer out of the checkpointed region.")


def _in_reentrant_recomputation():
    """True inside the recomputation of torch.utils.checkpoint(use_reentrant=True), which runs in
    the backward of its CheckpointFunction."""
    node = getattr(torch._C, "_current_autograd_node", lambda: None)()
    return type(node).__name__ == "CheckpointFunctionBackward"


def _in_backward_pass():
    """True while the autograd engine runs a backward (where torch.utils.checkpoint re-runs
    forwards); never true under torch.compile tracing."""
    if torch.compiler.is_compiling():
        return False
    f = getattr(torch._C, "_current_graph_task_id", None)
    return f is not None and f() != -1


def compute_dtype(x):
    """The dtype w_hat is made in: the autocast dtype where autocast is on (BF16 in training), else x's."""
    dev = x.device.type
    if dev != "meta" and torch.is_autocast_enabled(dev):   # meta has no autocast (asking raises)
        return torch.get_autocast_dtype(dev)
    return x.dtype
