"""How gaussws.py's sampling reaches its kernels: eager launches or torch.compile's (`kernel_launcher`), the
torch.library ops gaussws::pqn_sample / pqn_grad / next_seed that torch.compile traces, and the
per-call seed of a layer with the checks that keep activation checkpointing from reusing the
wrong one (§3.6 of paper A: one Philox stream per layer call).

Eager code runs the plain functions and the autograd.Function of gaussws.py (an op call costs a
dispatch per layer and step); under torch.compile the ops let Inductor launch the Triton kernels
from its own generated code. Nothing here computes R, w_hat or a gradient.

Activation checkpointing (torch.utils.checkpoint re-runs a forward inside the backward; the
recomputation reuses the layer's last seed, right for one call only). Not supported (wrong
gradients, not detected): torch.utils.checkpoint inside a compiled region (its recomputation draws
the next seed), and with use_reentrant=True a layer called once inside a checkpointed region and
again outside it before the backward. Not supported and detected (RuntimeError naming the layer,
in backward): a layer called more than once inside one checkpointed region, and two checkpointed
forwards before one backward. Each eager call tags its seed: with use_reentrant=False the backward
compares its call's tag with the tag of the seed the recomputation saved; with use_reentrant=True,
which recomputes each region once per backward, a second recomputation of a layer in one backward
raises.
"""
import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton
from torch.utils._python_dispatch import _get_current_dispatch_mode


def kernel_launcher(kernel):
    """The kernel itself in eager code (Triton's own launcher); wrap_triton(kernel) while
    torch.compile traces a triton_op (a dispatch mode is active), so Inductor records the kernel
    in its graph. wrap_triton in eager code would add a dispatch, costlier than the launch itself,
    to every launch."""
    return kernel if _get_current_dispatch_mode() is None else wrap_triton(kernel)


def register_sample_ops(sample_impl, grad_impl, setup_context, backward):
    """gaussws::pqn_sample (differentiable: `backward`, `setup_context`) and gaussws::pqn_grad as
    triton ops of gaussws.py's plain functions; returns the two ops."""
    sample = triton_op("gaussws::pqn_sample", mutates_args=())(sample_impl)
    grad = triton_op("gaussws::pqn_grad", mutates_args=())(grad_impl)
    sample.register_autograd(backward, setup_context=setup_context)
    return sample, grad


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
    regenerate R with t + 1."""
    if not state.is_cuda:
        seed = state.clone()
        state[1] += 1
        return seed
    seed = torch.empty_like(state)
    kernel_launcher(_next_seed_kernel)[(1,)](state, seed)
    return seed


_next_seed_op = triton_op("gaussws::next_seed", mutates_args=("state",))(_next_seed_impl)


def layer_seed(layer):
    """The seed [key, t] of a GaussWSLinear call (`GaussWSLinear._next_seed`): in eval mode the
    current state, unchanged; in a training forward the state before advancing t; inside a
    backward (torch.utils.checkpoint re-running the forward) the last call's seed again, tagged so
    the backward can check it is its own call's."""
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
        return torch.ops.gaussws.next_seed(layer.noise_state)
    seed = _next_seed_impl(layer.noise_state)   # eager: no op dispatch (see _PQNSample)
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
