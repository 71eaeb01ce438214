"""
AdamW4bit's states: creation, the layouts of state_dict() and load_state_dict(), and FSDP2
(DTensor) parameters, whose step runs on each rank's local shard (LocalShards). Functions of the
states and parameters they are given, never the step's arithmetic.
"""
import contextlib

import torch

from lowbit.optim.launch import KERNEL_DTYPES
from lowbit.optim.param_write import join_master, write_param
from lowbit.optim.sr_bits import ShardIndex

try:                       # FSDP2 parameters are DTensors; builds without torch.distributed have none
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:
    DTensor = None

# ============================================================================================
# FSDP2 (DTensor) parameters: the step runs on each rank's local shard
#
# fully_shard makes every parameter a DTensor sharded on dim 0 (Shard(0); HSDP adds Replicate
# mesh dims): a rank holds a contiguous range of rows. Eligibility for 4-bit states is decided on
# the global tensor (DTensor.numel() is the global count), so a tensor's state precision never
# depends on the number of ranks. When a row holds whole blocks (numel / size(0) a multiple of
# block_size) every shard is whole blocks at the same global positions for any world size, even
# and uneven shards alike: the states are DTensors of shape (rows, row_numel / 2) codes and
# (rows, row_numel / block_size) scales, sharded like the parameter, and each rank steps its own
# rows. Otherwise (1-D tensors, rows that split blocks, other placements) the shard boundaries may
# cut a block, so the tensor takes a gathered step: every rank all-gathers param and grad, steps
# the whole tensor with replicated states (the same bits on every rank) and keeps its own shard;
# these tensors keep the memory of an unsharded optimizer. SR bits: a local shard keeps its
# parameter's seed index and each element draws the bits of its position in the whole tensor
# (sr_bits.ShardIndex carries the shard's first element's), so SR runs equal 1 rank and the
# unwrapped model bit for bit, as RTN runs do (exact for Shard(0), fully_shard's placement: a
# shard is then a contiguous range of the whole tensor). With one rank the shard is the whole
# tensor: nothing is gathered. A parameter stepped on its local tensor (all but the gathered ones)
# keeps one alias of it, the same object every step, so step() records and replays its plan as for
# plain tensors: each step only points the aliases' .grad at the gradients' local tensors
# (LocalShards.local_params), which FSDP2 allocates anew each step.


def is_dtensor(x):
    return DTensor is not None and isinstance(x, DTensor)


def _block_rows(p, block_size):
    """True if p's rows are whole blocks: >= 2 dims and numel / size(0) a multiple of block_size."""
    return p.dim() >= 2 and p.shape[0] > 0 and (p.numel() // p.shape[0]) % block_size == 0


def _rows_of_blocks(p, block_size):
    """True if every shard of DTensor p is whole rows of whole blocks: _block_rows, and all
    placements Shard(0) or Replicate."""
    return _block_rows(p, block_size) and all(pl.is_replicate() or pl.is_shard(0) for pl in p.placements)


PACKED = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")


def _per_row(p, st, block_size):
    """A plain tensor p's 4-bit states (st) as state_dict() gives them when p's rows are whole
    blocks: (rows, row_numel / 2) codes and (rows, row_numel / block_size) scales, views of the
    flat tensors the step uses. FSDP2 keeps these states in that layout (sharded by rows), so a
    checkpoint has one layout and DCP moves it between unwrapped and fully_shard models."""
    if is_dtensor(p) or "exp_avg_scale" not in st or st["exp_avg"].dim() != 1 or not _block_rows(p, block_size):
        return st
    return dict(st, **{k: st[k].view(p.shape[0], -1) for k in PACKED})


def _local_state(p, shape, local_rows, dtype, replicated):
    """A zero DTensor state of global `shape`: sharded like p by rows (local_rows of them here),
    or replicated on p's mesh (the gathered step's states)."""
    if replicated:
        local = torch.zeros(shape, dtype=dtype, device=p.device)
        return DTensor.from_local(local, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)
    local = torch.zeros((local_rows, *shape[1:]), dtype=dtype, device=p.device)
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _shard_layout(p, quantized, block_size):
    """(gathered, element offset, (local shape, global offset)) of DTensor p: the element offset
    is the step's tensor's first element's position in the whole tensor (0 for a gathered one)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    box = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    gathered = quantized and not _rows_of_blocks(p, block_size) and p.device_mesh.size() > 1
    offset = 0 if gathered or p.dim() == 0 else box[1][0] * (p.numel() // max(p.shape[0], 1))
    return gathered, offset, box


class LocalShards:
    """FSDP2: each DTensor parameter's shard layout (_shard_layout, fixed for a parameter: the
    offset computation costs ~50 us) and the plain tensor aliasing its local shard that the step
    works on, kept while the parameter keeps its local tensor (module comment above)."""

    def __init__(self):
        self.layouts = {}    # id(DTensor parameter) -> _shard_layout
        self.views = {}      # id(DTensor parameter) -> (its local tensor, the step's alias)

    def step_view(self, p, st, quantized, index, block_size, writeback):
        """What the step works on for DTensor parameter p: (param, state, seed index, gathered).
        param: the alias of p's local shard, with .grad the local gradient; or, gathered, the
        all-gathered tensor (a collective: every rank calls it in the same order). state: plain
        tensors aliasing st's local states, flat for the quantized ones (the step's layout). The
        seed index is a sr_bits.ShardIndex (p's `index` with the stepped tensor's place in p).
        The copy back after the step is appended to `writeback` (arguments of write_back)."""
        layout = self.layouts.get(id(p))
        if layout is None:
            layout = self.layouts[id(p)] = _shard_layout(p, quantized, block_size)
        gathered = layout[0]
        if gathered:
            lp = p.full_tensor()
            lp.grad = p.grad.full_tensor()
        else:
            view = self.views.get(id(p))
            if view is None or view[0] is not p._local_tensor:
                view = self.views[id(p)] = (p._local_tensor, p.to_local().detach())   # the step writes p's shard
            lp = view[1]
            lp.grad = p.grad.to_local()
        local = {k: (v.to_local().view(-1) if quantized else v.to_local()) if is_dtensor(v) else v
                 for k, v in st.items()}
        writeback.append((p, st, lp, local, gathered, layout[2]))
        return lp, local, ShardIndex(index, layout[1], p.numel()), gathered

    def local_params(self, params, grads):
        """The parameters and gradients that step()'s plan key and replay see: every DTensor
        parameter with a local alias becomes its local tensor and its gradient the gradient's
        local tensor, which also becomes the alias's .grad (a recorded plan reads the gradients
        there); the gathered ones stay DTensors, and plan.StepPlan gives them no plan.
        DTensor._local_tensor, not to_local(): ~0.1 us instead of ~1 us a call."""
        if not self.views:
            return params, grads
        params, grads = list(params), list(grads)
        for i, p in enumerate(params):
            view = self.views.get(id(p))
            if view is not None:
                g = grads[i]
                params[i] = p._local_tensor
                grads[i] = view[1].grad = None if g is None else g._local_tensor
        return params, grads

    def drop_grads(self):
        """After a step: no reference to FSDP2's gradients outlives zero_grad (their memory is reused)."""
        for _, lp in self.views.values():
            lp.grad = None


def write_back(p, st, lp, local, gathered, box):
    """After the step on LocalShards.step_view's (lp, local): copy the states that the step
    replaced (the reference step stores new tensors) into st's local tensors, and a gathered
    param's own shard (box: its local shape and global offset) into p."""
    for k, v in local.items():
        dst = st[k].to_local().view(-1) if is_dtensor(st[k]) else None
        if dst is not None and v.data_ptr() != dst.data_ptr():
            dst.copy_(v.reshape(-1))
    if gathered:
        shape, offset = box
        p.to_local().copy_(lp[tuple(slice(o, o + n) for o, n in zip(offset, shape))])


# ============================================================================================
# Creating, fitting, saving and loading states

def new_state(p, quantized, block_size, capturable, master_weight_bits):
    """The zero states of p at its first step (a dict): the step counter, the moments (4-bit if
    `quantized`: packed codes and scales, FSDP2 ones sharded like p; else FP32 like p) and, with
    master_weight_bits=24 on a BF16 p, eq. MW's correction. ValueError for what FSDP2 (DTensor)
    parameters do not support (capturable=True, master_weight_bits=24)."""
    st = {}
    if capturable and is_dtensor(p):
        raise ValueError("capturable=True does not support FSDP2 (DTensor) parameters; use "
                         "capturable=False with fully_shard")
    st["step"] = new_step(0.0, p, capturable)
    if quantized and is_dtensor(p):   # FSDP2: see LocalShards
        B, rows = block_size, p.shape[0]
        sharded = _rows_of_blocks(p, B)
        shapes = ((rows, p.numel() // rows // 2), (rows, p.numel() // rows // B)) if sharded else \
            ((p.numel() // 2,), (p.numel() // B,))
        for k in ("exp_avg", "exp_avg_sq"):
            for key, shape, dt in ((k, shapes[0], torch.uint8), (k + "_scale", shapes[1], torch.float32)):
                st[key] = _local_state(p, shape, p.to_local().shape[0], dt, not sharded)
    elif quantized:
        n, B = p.numel(), block_size
        for k in ("exp_avg", "exp_avg_sq"):
            # scale 0 decodes every code to 0: the zero initial moments of AdamW
            st[k] = torch.zeros(n // 2, dtype=torch.uint8, device=p.device)
            st[k + "_scale"] = torch.zeros(n // B, dtype=torch.float32, device=p.device)
    else:
        st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
    if master_weight_bits and p.dtype == torch.bfloat16:
        if is_dtensor(p):   # the gathered step would pair a full weight with a shard's bytes
            raise ValueError("master_weight_bits=24 does not support FSDP2 (DTensor) parameters; "
                             "use master_weight_bits=None (param_rounding='sr' works) or DDP")
        # eq. MW with e = 0: the master weight starts as the BF16 weight
        st["param_correction"] = torch.zeros_like(p, dtype=torch.int8)
    return st


def new_step(value, p, capturable):
    """A step counter as torch's AdamW keeps it: a 0-d float32 tensor on the CPU, or on p's device
    with capturable=True (the kernels read it there). A tensor, so that DCP loads it in place."""
    return torch.tensor(float(value), dtype=torch.float32, device=p.device if capturable else "cpu")


def check_grad(p, index):
    """RuntimeError for a sparse gradient of p (parameter number `index`), as torch's AdamW."""
    if p.grad.is_sparse:
        raise RuntimeError(f"AdamW4bit does not support sparse gradients (parameter {index}, "
                           f"shape {tuple(p.shape)}); "
                           "use dense gradients (e.g. nn.Embedding(sparse=False))")


def fit_state(p, st, index, capturable, master_weight_bits):
    """State st of parameter p (number `index` from 1) as this step's code paths expect it: its
    step counter of the optimizer's kind (a state loaded from the other kind is converted); for a
    plain p, a BF16 weight's eq. MW correction folded into a parameter cast to another dtype
    (model.to: the 24-bit master weight becomes its value), a zero one added where
    master_weight_bits=24 meets a new BF16 parameter, and contiguous tensors (the kernels index
    them flat). TypeError for a parameter or gradient dtype outside KERNEL_DTYPES (e.g.
    model.double() after construction)."""
    step = st["step"]
    if not torch.is_tensor(step) or step.dtype != torch.float32 or step.device != (p.device if capturable else
                                                                                   torch.device("cpu")):
        st["step"] = new_step(step, p, capturable)   # a state loaded from the other kind, or older
    if p.dtype not in KERNEL_DTYPES:
        raise TypeError(f"AdamW4bit: parameter {index} (shape {tuple(p.shape)}) is {p.dtype}; "
                        "allowed: float32, bfloat16, float16")
    if p.grad.dtype not in KERNEL_DTYPES:
        raise TypeError(f"AdamW4bit: the gradient of parameter {index} (shape {tuple(p.shape)}) "
                        f"is {p.grad.dtype}; allowed: float32, bfloat16, float16")
    if is_dtensor(p):
        return
    corr = st.get("param_correction")
    if corr is not None and p.dtype != torch.bfloat16:
        write_param(p.data, join_master(p.detach().bfloat16(), corr.view_as(p)))
        del st["param_correction"]
    elif corr is None and p.dtype == torch.bfloat16 and master_weight_bits:
        st["param_correction"] = torch.zeros_like(p, dtype=torch.int8, memory_format=torch.contiguous_format)
    for k, v in st.items():
        if torch.is_tensor(v) and not v.is_contiguous():
            st[k] = v.contiguous()


def check_kind(p, st, quantized, group):
    """ValueError when p's states `st` are of the other kind than its group now asks for (the
    group's quantize flag changed after p's first step); else `quantized`."""
    if st and "exp_avg" in st and (st["exp_avg"].dtype == torch.uint8) != quantized:
        raise ValueError(f"a parameter of shape {tuple(p.shape)} has {'FP32' if quantized else '4-bit'} states "
                         f"but its param group now says quantize={group.get('quantize', True)}; set quantize per "
                         "group before the first step (or load a state dict)")
    return quantized


def group_of(groups, p, caller):
    """The param group holding p; ValueError naming `caller` when none does."""
    group = next((g for g in groups if any(p is q for q in g["params"])), None)
    if group is None:
        raise ValueError(f"{caller}: the tensor of shape {tuple(p.shape)} is not a parameter of this optimizer")
    return group


def maximized_grads(groups):
    """The gradients of the maximize=True groups' parameters (local tensors, each once)."""
    grads, seen = [], set()
    for group in groups:
        for p in group["params"] if group.get("maximize") else ():
            g = p.grad
            if g is not None and id(g) not in seen:
                seen.add(id(g))
                grads.append(g.to_local() if is_dtensor(g) else g)
    return grads


@contextlib.contextmanager
def negated(grads):
    """maximize=True (torch's flag): the step of -grad. The gradients are negated in place around
    the step (no copy; the kernels, the reference and a recorded plan all read them) and restored
    after it, exactly (negation is exact)."""
    if grads:
        torch._foreach_neg_(grads)
    try:
        yield
    finally:
        if grads:
            torch._foreach_neg_(grads)


@contextlib.contextmanager
def without(obj, *names):
    """obj's dict attributes `names` (torch's state_dict hook registries) empty inside the block:
    AdamW4bit runs its hooks itself, on its own state dict, around torch's method."""
    kept = [getattr(obj, n) for n in names]
    for n in names:
        setattr(obj, n, {})
    try:
        yield kept
    finally:
        for n, v in zip(names, kept):
            setattr(obj, n, v)


def state_nbytes(states):
    """The bytes of every state tensor but the step counters (a DTensor's local part)."""
    local = lambda t: t.to_local() if is_dtensor(t) else t   # noqa: E731
    return sum(local(t).numel() * t.element_size() for st in states
               for k, t in st.items() if k != "step" and torch.is_tensor(t))


def with_config(sd, params, qcfg, extra):
    """torch's state dict `sd` of the optimizer as AdamW4bit.state_dict gives it: the 4-bit codes
    and scales of a tensor whose rows are whole blocks per row (_per_row: FSDP2's layout, views,
    no copy), the quantizer configuration qcfg and `extra` (seed, progress, LM-head positions);
    every param group carries both too (torch.distributed.checkpoint keeps only "state" and
    "param_groups"), for load_state_dict. params: the optimizer's, in torch's numbering."""
    for i, p in enumerate(params):
        if i in sd["state"]:
            sd["state"][i] = _per_row(p, sd["state"][i], qcfg["block_size"])
    sd["adam4bit"] = {k: qcfg[k] for k in sorted(qcfg)}
    sd["adam4bit_extra"] = extra
    for g in sd["param_groups"]:
        g["adam4bit"] = dict(config=sd["adam4bit"], extra=sd["adam4bit_extra"])
    return sd


def _describe_states(state_dict):
    # what another optimizer's per-parameter states hold, for the refusal: e.g. torch's AdamW
    # (exp_avg float32), TorchAO's AdamW4bit (a tensor subclass), bitsandbytes' (state1 uint8)
    states = state_dict.get("state", {})
    first = next(iter(states.values()), None) if isinstance(states, dict) else None
    if not isinstance(first, dict):
        return ""
    kinds = [f"{k} ({type(v).__name__ if type(v) is not torch.Tensor else str(v.dtype).replace('torch.', '')})"
             if torch.is_tensor(v) else k for k, v in first.items()]
    return f" (its per-parameter states: {', '.join(kinds)})"


def check_loadable(state_dict, qcfg, params, eligible):
    """A state_dict() of an AdamW4bit with configuration qcfg (the same preset, components and
    block_size) whose states fit `params` (eligible: whether each may be quantized), returned as
    (the dict with its configuration entries, the part torch's Optimizer.load_state_dict takes).
    Also takes the {"state", "param_groups"} dict of set_optimizer_state_dict
    (torch.distributed.checkpoint): the configuration then comes from the groups. Raises
    ValueError for a state dict of another configuration or of another optimizer."""
    groups = state_dict.get("param_groups", [])
    if "adam4bit" not in state_dict and groups and "adam4bit" in groups[0]:
        state_dict = dict(state_dict, adam4bit=groups[0]["adam4bit"]["config"],
                          adam4bit_extra=groups[0]["adam4bit"]["extra"])
    if "adam4bit" not in state_dict:
        raise ValueError("not an AdamW4bit state dict (no 'adam4bit' entry) but another optimizer's"
                         + _describe_states(state_dict) + ": AdamW4bit loads only its own state_dict(); to "
                         "move from that optimizer, load the model's weights and start AdamW4bit fresh")
    saved = dict(dict(param_rounding="rtn", master_weight_bits=None), **state_dict["adam4bit"])
    mine = {k: qcfg[k] for k in sorted(qcfg)}
    def same(a, b):   # codebooks may be tensors (custom levels)
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
        return a == b
    diff = {k: (saved.get(k), mine[k]) for k in mine if not same(saved.get(k), mine[k])}
    if diff:
        raise ValueError("optimizer state was written with another configuration "
                         f"(saved, current): {diff}")
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    saved_q = [g.get("quantize", True) for g in state_dict["param_groups"] for _ in g["params"]]
    for pid, p, q, ok in zip(saved_ids, params, saved_q, eligible):
        st = state_dict["state"].get(pid, {})
        quantized = q and ok     # the saved group's policy, which load adopts
        if "exp_avg" in st and st["exp_avg"].numel() != (p.numel() // 2 if quantized else p.numel()):
            raise ValueError(f"optimizer state of parameter {pid} ({st['exp_avg'].numel()} exp_avg "
                             f"entries) does not fit the parameter of shape {tuple(p.shape)}")
        if "param_correction" in st and p.dtype != torch.bfloat16:
            # eq. MW's residual belongs to a BF16 weight; added to another one it would move it
            raise ValueError(f"optimizer state of parameter {pid} holds a param_correction (saved "
                             f"with BF16 parameters) but the parameter is {p.dtype}; load it into "
                             "BF16 parameters, or drop the 'param_correction' entries first")
    return state_dict, {"state": state_dict["state"], "param_groups": [
        {k: v for k, v in g.items() if k != "adam4bit"} for g in groups]}


def restore_states(state_dict, params, states, master_weight_bits):
    """After torch's load_state_dict, which casts every state tensor to its parameter's dtype
    (uint8 codes too): put back the saved tensors of state_dict with their own dtypes, on each
    parameter's device, into `states` (the optimizer's)."""
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    for pid, p in zip(saved_ids, params):
        st = state_dict["state"].get(pid, {})
        for k, t in st.items():
            if k != "step" and torch.is_tensor(t):
                if k in PACKED and "exp_avg_scale" in st and not is_dtensor(p):
                    t = t.reshape(-1)   # per-row codes and scales (_per_row): the step's flat layout
                states[p][k] = t.detach().to(device=p.device).clone()
        if "step" in states[p]:   # a copy (torch's load keeps the saved tensor); older checkpoints: a float
            states[p]["step"] = new_step(states[p]["step"], p, False)
        if master_weight_bits and p.dtype == torch.bfloat16 and states[p] and "param_correction" not in states[p]:
            # saved with FP32 parameters: eq. MW with e = 0, the master weight is the BF16 weight
            states[p]["param_correction"] = torch.zeros_like(p, dtype=torch.int8)
