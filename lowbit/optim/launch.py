"""
The launch tables of AdamW4bit's two Triton kernels (the 4-bit step and the FP32-state step) and
their per-step scalars: which program steps which tensor, one int64 row of pointers per tensor
with named columns (TAB_*), their cache, a prepared launch (Launch), and the capturable step's
device-side scalars (t and lr read from device memory, the bias corrections from a float64
table). Touches only the tables it builds; the kernels read them.
"""
import math
import os

import torch
import triton
import triton.language as tl

from lowbit.optim.sr_bits import index_seed, shard_offset, tl_step_seed

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)    # param and grad dtypes
DTYPE_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}   # the kernels' P_KIND, G_KIND

# One int64 row of TAB_WIDTH columns per tensor, written by _launch_table and read by the kernel:
TAB_FIRST_PROGRAM = tl.constexpr(0)      # the tensor's first program (_program_table)
TAB_N_BLOCKS = tl.constexpr(1)           # its number of scale blocks, numel / block_size
TAB_PARAM = tl.constexpr(2)              # data pointers: param (float32), grad (float32/bfloat16),
TAB_GRAD = tl.constexpr(3)               # the state's exp_avg, exp_avg_sq (packed codes, uint8)
TAB_EXP_AVG = tl.constexpr(4)            # and exp_avg_scale, exp_avg_sq_scale (float32)
TAB_EXP_AVG_SCALE = tl.constexpr(5)
TAB_EXP_AVG_SQ = tl.constexpr(6)
TAB_EXP_AVG_SQ_SCALE = tl.constexpr(7)
TAB_SEED_OF_INDEX = tl.constexpr(8)      # the parameter's term of its SR seed (index_seed)
TAB_U_M = tl.constexpr(9)                # the caller's uniforms u_m, u_v (float32; 0 without)
TAB_U_V = tl.constexpr(10)
TAB_U_P = tl.constexpr(11)               # and u_p of the BF16 SR write
TAB_CORRECTION = tl.constexpr(12)        # param_correction (int8, eq. MW; 0 without)
TAB_OFFSET = tl.constexpr(13)            # the tensor's first element's position in the whole
TAB_WIDTH = tl.constexpr(14)             # tensor (an FSDP2 shard's, sr_bits.ShardIndex; else 0)


def _program_table(units, per_program, device):
    """Program -> tensor index as int32 (programs,) on `device`, and each tensor's first program
    (a list): a tensor of `units` blocks (or elements) gets cdiv(units, per_program) programs."""
    counts = torch.tensor([triton.cdiv(n, per_program) for n in units])
    return (torch.repeat_interleave(torch.arange(len(units), dtype=torch.int32), counts).to(device),
            (torch.cumsum(counts, 0) - counts).tolist())


def _launch_table(ptrs, first_programs, block_size, device):
    """The launch table, int64 (tensors, TAB_WIDTH) on `device`, from prepare's per-tensor tuples
    (param, grad, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale data pointers (0 for the
    FP32 states' missing scales), parameter index, numel, offset (sr_bits.shard_offset),
    param_correction pointer or 0[, u_m, u_v, u_p pointers])."""
    rows = []
    for first, (param, grad, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, index, numel, offset,
                correction, *u) in zip(first_programs, ptrs):
        row = [0] * TAB_WIDTH.value
        row[TAB_FIRST_PROGRAM] = first
        row[TAB_N_BLOCKS] = numel // block_size
        row[TAB_PARAM] = param
        row[TAB_GRAD] = grad
        row[TAB_EXP_AVG] = exp_avg
        row[TAB_EXP_AVG_SCALE] = exp_avg_scale
        row[TAB_EXP_AVG_SQ] = exp_avg_sq
        row[TAB_EXP_AVG_SQ_SCALE] = exp_avg_sq_scale
        row[TAB_SEED_OF_INDEX] = index_seed(index)
        row[TAB_U_M], row[TAB_U_V], row[TAB_U_P] = (tuple(u) + (0, 0, 0))[:3]
        row[TAB_CORRECTION] = correction
        row[TAB_OFFSET] = offset
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64).to(device)


def prepare(kernel, items, cache, block_size, per_program, tables, flags, u=None, own_table=False,
            maxnreg=None):
    """A Launch of either kernel for `items`, (param, state, index) triples of one device: the
    program table (_program_table: per tensor numel / block_size units, per_program of them a
    program), the launch table (_launch_table: each item's pointers; u: optional, per item a
    tuple of the caller's uniform tensors (u_m, u_v, u_p), None for a missing one), the kernel's
    lookup `tables` and compile-time `flags`, with ALIGNED, where the flags have it, set to
    whether every param and grad can be read as element pairs, one word a pair (8-byte aligned
    for FP32, 4-byte for BF16 and FP16: true for whole tensors, maybe not for views into a flat
    buffer; otherwise the kernel reads element by element). maxnreg: the compiled kernel's
    register limit. The tables are cached in `cache` (the optimizer's dict, under "programs" and
    "launch") because building them is a host loop over the tensors and a host-to-device copy:
    with the same tensor sizes and data pointers a step reuses them. More than 64 launch tables
    mean parameters or states were reallocated: the old ones are dropped. own_table: a launch
    table of its own, not shared with the cache (a recorded plan rewrites its gradient column in
    place, Launch.regrad)."""
    p0, dev = items[0][0], items[0][0].device
    ptr = lambda t: 0 if t is None else t.data_ptr()   # noqa: E731
    ptrs = tuple((p.data_ptr(), p.grad.data_ptr(), *(ptr(st.get(k)) for k in (
        "exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale")), i, p.numel(), shard_offset(i),
        ptr(st.get("param_correction"))) + (() if u is None else tuple(map(ptr, u[j])))
        for j, (p, st, i) in enumerate(items))
    numels = tuple(p.numel() for p, _, _ in items)
    programs, launches = (cache.setdefault(k, {}) for k in ("programs", "launch"))
    progs = programs.get((dev, block_size, per_program, numels))
    if progs is None:
        progs = programs[(dev, block_size, per_program, numels)] = _program_table(
            [n // block_size for n in numels], per_program, dev)
    tab = launches.get((block_size, per_program, ptrs))
    if tab is None:
        if len(launches) > 64:                     # parameters or states were reallocated
            launches.clear()
        tab = launches[(block_size, per_program, ptrs)] = _launch_table(ptrs, progs[1], block_size, dev)
    if own_table:
        tab = tab.clone()                          # a device copy: no host transfer
    # compiled (not TRITON_INTERPRET=1): no FMA contraction, so products round as in the torch
    # references, bit for bit; the interpreter has no such option (interpreted: no options)
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        flags = dict(flags, enable_fp_fusion=False, **({} if maxnreg is None else dict(maxnreg=maxnreg)))
    p_align, g_align = 2 * p0.element_size(), 2 * p0.grad.element_size()
    p_aligned = all(r[0] % p_align == 0 for r in ptrs)
    if "ALIGNED" in flags:
        flags = dict(flags, ALIGNED=p_aligned and all(r[1] % g_align == 0 for r in ptrs))
    return Launch(kernel, progs[0], tab, ptrs, tables, flags, p_aligned, g_align)


class Launch:
    """One prepared launch of either kernel (prepare, for adam4bit's _triton_prepare and
    fp32.adamw_prepare): everything that does not change between steps. run() launches it with
    a step's hyperparameters; a recorded step plan keeps it and repoints it at moved gradients
    (regrad)."""

    def __init__(self, kernel, progs, tab, ptrs, tables, flags, p_aligned=True, g_align=1):
        self.kernel, self.grid, self.progs, self.tab = kernel, (progs.numel(),), progs, tab
        self.tables = tables        # the kernel's arguments between the launch table and the scalars
        self.flags = flags          # its compile-time flags and options
        self.grads = tuple(r[1] for r in ptrs)     # the gradients' addresses in the launch table
        self.p_aligned, self.g_align = p_aligned, g_align   # the 4-bit kernel's ALIGNED flag, see regrad
        self.dev = None             # capturable: the tensors of the device scalars (plan.StepPlan)

    def run(self, lr, b1, b2, eps, wd, t, seed_of_step):
        """Launch with step t's scalars: seed_of_step, decay = 1 - lr wd, step_size = lr / bc1 and
        1/sqrt(bc2) of eq. 2.1b, bc = 1 - b^t, from the host; with self.dev (capturable=True) the
        kernel reads t and lr from device memory instead (device_scalars), the same float64
        arithmetic."""
        if self.dev is None:
            bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
            scalars = (seed_of_step, 1 - lr * wd, lr / bc1, 1 / math.sqrt(bc2))
            dev = (self.tab, self.tab, self.tab, 1, False)    # unused pointers
        else:
            d = self.dev
            scalars = (d["seed_term"], 0.0, 0.0, 0.0)
            dev = (d["step"], d["lr"], d["bias"], d["rows"], True)
        seed_of_step, decay, step_size, inv_sqrt_bc2 = scalars
        self.kernel[self.grid](self.progs, self.tab, *self.tables, seed_of_step, decay, step_size,
                               b1, 1 - b1, b2, 1 - b2, inv_sqrt_bc2, eps, *dev, **self.flags)

    def regrad(self, grads):
        """Point the launch at new gradient tensors (same dtypes and sizes, e.g. after
        zero_grad(set_to_none=True) when the allocator gave other addresses): one host-to-device
        copy of the gradient column, from pinned memory, no host sync. The table must be the
        launch's own (own_table=True)."""
        ptrs = tuple(g.data_ptr() for g in grads)
        if len(ptrs) == 1:     # step_param's launches: the address as a kernel argument, no copy
            self.tab[:, TAB_GRAD.value].fill_(ptrs[0])
        else:
            col = torch.tensor(ptrs, dtype=torch.int64)
            self.tab[:, TAB_GRAD.value].copy_(col.pin_memory() if self.tab.is_cuda else col, non_blocking=True)
        self.grads = ptrs
        if "ALIGNED" in self.flags:
            self.flags["ALIGNED"] = self.p_aligned and all(g % self.g_align == 0 for g in ptrs)


BIAS_ROWS_MAX = 1 << 22


def capturable_bias_table(b1, b2, wd):
    """The capturable step's table (float64 (rows, 2), CPU): row 0 = (wd, 0); row t = (bc1,
    1/sqrt(bc2)) of eq. 2.1b, bc = 1 - b^t, computed as the host step computes them; the last
    row is (1, 1), where both have become exactly 1 in float64 and stay so (the kernel reads row
    min(t, rows - 1)). Raises ValueError if betas this close to 1 need more than 2^22 rows."""
    rows, t = [(float(wd), 0.0)], 1
    while True:
        rows.append((1 - b1 ** t, 1 / math.sqrt(1 - b2 ** t)))
        if rows[-1] == (1.0, 1.0):
            return torch.tensor(rows, dtype=torch.float64)
        t += 1
        if t >= BIAS_ROWS_MAX:
            raise ValueError(f"capturable=True: betas {(b1, b2)} are too close to 1 for its bias-correction "
                             f"table (1 - beta^t reaches 1 after more than {BIAS_ROWS_MAX} steps)")


@triton.jit
def device_scalars(step_ptr, lr_ptr, bias_table, bias_rows, seed_term):
    # A capturable step's scalars from device memory, with the host's float64 arithmetic (see
    # Launch.run): t (the float32 step counter), lr (float32 or float64), and from
    # capturable_bias_table row min(t, rows - 1) bc1 = 1 - b1^t and 1 / sqrt(bc2), its row 0 holding wd;
    # seed_term = sr_bits.seed_base(seed), step_seed's step-free part.
    t = tl.load(step_ptr).to(tl.int64)
    lr = tl.load(lr_ptr).to(tl.float64)
    row = bias_table + 2 * tl.minimum(t, bias_rows - 1)
    decay = (1.0 - lr * tl.load(bias_table)).to(tl.float32)
    step_size = (lr / tl.load(row)).to(tl.float32)      # float64 division: IEEE-rounded
    inv_sqrt_bc2 = tl.load(row + 1).to(tl.float32)
    return tl_step_seed(seed_term, t), decay, step_size, inv_sqrt_bc2
