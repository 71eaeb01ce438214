"""
The launch tables of AdamW4bit's two Triton kernels (the 4-bit step and the FP32-state step) and
their per-step scalars: which program steps which tensor, one int64 row of pointers per tensor
with named columns (TAB_*), their cache, and the capturable step's device-side scalars (t and lr
read from device memory, the bias corrections from a float64 table). Touches only the tables it
builds; the kernels read them.
"""
import math
import os

import torch
import triton
import triton.language as tl

from lowbit.optim.sr_bits import index_seed, tl_step_seed

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
    """The launch table, int64 (tensors, TAB_WIDTH) on `device`, from adamw4bit_step_triton's
    per-tensor tuples (param, grad, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale data
    pointers, parameter index, numel, offset (sr_bits.shard_offset), param_correction pointer or
    0[, u_m, u_v, u_p pointers])."""
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


def cached_tables(cache, dev, program_key, units, per_program, launch_key, ptrs, block_size, own_table):
    """The program table (_program_table(units, per_program, dev)), the launch table
    (_launch_table(ptrs, ..., block_size, dev)) and the compile options of a launch of either
    kernel. The tables are cached in `cache` (the optimizer's dict, under "programs" and
    "launch") because building them is a host loop over the tensors and a host-to-device copy:
    with the same tensor sizes (program_key) and data pointers (launch_key) a step reuses them.
    More than 64 launch tables mean parameters or states were reallocated: the old ones are
    dropped. own_table: a launch table of its own, not shared with the cache (the step's cached
    plan rewrites its gradient column in place, triton_regrad)."""
    programs, launches = (cache.setdefault(k, {}) for k in ("programs", "launch"))
    progs = programs.get(program_key)
    if progs is None:
        progs = programs[program_key] = _program_table(units, per_program, dev)
    tab = launches.get(launch_key)
    if tab is None:
        if len(launches) > 64:                     # parameters or states were reallocated
            launches.clear()
        tab = launches[launch_key] = _launch_table(ptrs, progs[1], block_size, dev)
    if own_table:
        tab = tab.clone()                          # a device copy: no host transfer
    # compiled (not TRITON_INTERPRET=1): no FMA contraction, so products round as in the torch
    # references, bit for bit; the interpreter has no such option (empty options: interpreted)
    extra = {} if os.environ.get("TRITON_INTERPRET", "0") == "1" else {"enable_fp_fusion": False}
    return progs, tab, extra


def triton_regrad(launch, grads):
    """Point a _triton_prepare or adamw_prepare (own_table=True) launch at new gradient tensors
    (same dtypes and sizes, e.g. after zero_grad(set_to_none=True) when the allocator gave other
    addresses): one host-to-device copy of the gradient column, from pinned memory, no host sync."""
    ptrs = tuple(g.data_ptr() for g in grads)
    col = torch.tensor(ptrs, dtype=torch.int64)
    tab = launch["tab"]
    if tab.is_cuda:
        col = col.pin_memory()
    tab[:, TAB_GRAD.value].copy_(col, non_blocking=True)
    launch["grads"] = ptrs
    if "ALIGNED" in launch["flags"]:
        launch["flags"]["ALIGNED"] = launch["p_aligned"] and all(g % launch["g_align"] == 0 for g in ptrs)


def launch_scalars(launch, lr, b1, b2, wd, t, seed_of_step):
    """The per-step arguments of both kernels: (seed_of_step, decay, step_size, 1/sqrt(bc2)) of
    eq. 2.1b at step t from the host, then the device ones (step counter, lr, capturable_bias_table,
    its rows, the DEV flag). A launch with launch["dev"] (capturable=True) passes no host
    scalars: the kernel reads t and lr from device memory (device_scalars), the same float64
    arithmetic."""
    dev = launch["dev"]
    if dev is None:
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        tab = launch["tab"]        # unused pointers
        return (seed_of_step, 1 - lr * wd, lr / bc1, 1 / math.sqrt(bc2)), (tab, tab, tab, 1, False)
    return (dev["seed_term"], 0.0, 0.0, 0.0), (dev["step"], dev["lr"], dev["bias"], dev["rows"], True)


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
    # launch_scalars): t (the float32 step counter), lr (float32 or float64), and from
    # capturable_bias_table row min(t, rows - 1) bc1 = 1 - b1^t and 1 / sqrt(bc2), its row 0 holding wd;
    # seed_term = sr_bits.seed_base(seed), step_seed's step-free part.
    t = tl.load(step_ptr).to(tl.int64)
    lr = tl.load(lr_ptr).to(tl.float64)
    row = bias_table + 2 * tl.minimum(t, bias_rows - 1)
    decay = (1.0 - lr * tl.load(bias_table)).to(tl.float32)
    step_size = (lr / tl.load(row)).to(tl.float32)      # float64 division: IEEE-rounded
    inv_sqrt_bc2 = tl.load(row + 1).to(tl.float32)
    return tl_step_seed(seed_term, t), decay, step_size, inv_sqrt_bc2
