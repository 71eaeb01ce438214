"""
AdamW on FP32 states, the step of the tensors too small to quantize (paper B's 32-bit baseline)
and of quantize=False groups: the plain-PyTorch reference, torch's fused AdamW for FP32
parameters, and a Triton kernel for BF16 / FP16 parameters (torch's fused kernel cannot write
those: its states would be 16-bit too). Touches the parameter, its FP32 exp_avg / exp_avg_sq and
its param_correction.
"""
import torch
import triton
import triton.language as tl

from lowbit.optim.launch import (DTYPE_KIND, TAB_CORRECTION, TAB_EXP_AVG, TAB_EXP_AVG_SQ, TAB_FIRST_PROGRAM,
                                 TAB_GRAD, TAB_N_BLOCKS, TAB_OFFSET, TAB_PARAM, TAB_SEED_OF_INDEX, TAB_U_P,
                                 TAB_WIDTH, device_scalars, prepare)
from lowbit.numerics import adam_denominator
from lowbit.optim.param_write import tl_join_master, param_bits16, write_step, read_param
from lowbit.optim.sr_bits import sr_seed_of, tl_sr_seed, sr_uniform, shard_offset, shard_span

FUSED_ADAMW_DEVICES = ("cuda",)   # where FP32-state FP32 parameters take torch's fused AdamW


def adamw_step_torch(param, grad, state, lr, b1, b2, eps, wd, t, rule="rtn", seed=0, u_p=None, span=None):
    """One AdamW step of one FP32-state tensor in plain PyTorch (paper B's 32-bit baseline; the
    tensors too small to quantize): eq. 2.1a-b with the moments stored as they are, the same
    float32 operations as adamw4bit_step_torch. The specification adamw_step_triton matches bit
    for bit given the same SR uniforms; torch.optim.AdamW's to rounding.

    param:  float32, bfloat16 or float16 tensor, updated in place (math in float32, written back
            by write_param with `rule`, or through the state's "param_correction", eq. MW).
    grad:   float32, bfloat16 or float16, param's shape.
    state:  dict with exp_avg, exp_avg_sq (float32, param's shape), updated in place.
    lr, b1, b2, eps, wd: AdamW's (floats); t: this step's number (>= 1).
    rule:   the BF16 write, "rtn"|"sr"; seed: seeds the generator of the SR uniforms, or u_p
            (float32, param's numel) replaces them (kernel tests); span: an FSDP2 shard's (offset,
            whole numel), whose uniforms are its whole tensor's there (sr_bits.span_uniforms).
    """
    m, v = state["exp_avg"], state["exp_avg_sq"]
    g = grad.float()
    # eq. 2.1a with FP32 storage
    m.mul_(b1).add_(g * (1 - b1))
    v.mul_(b2).add_(g * g * (1 - b2))
    # eq. 2.1b; eq. 3.1's r_t(v)
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    corr = state.get("param_correction")
    w = read_param(param, corr) * (1 - lr * wd) - (lr / bc1) * m / adam_denominator(v, bc2, eps)
    gen = None
    if rule == "sr" and param.dtype == torch.bfloat16 and corr is None and u_p is None:
        gen = torch.Generator(device=param.device).manual_seed(seed)
    write_step(param, w, corr, rule, u_p, gen, span)


def split_fp32(items):
    """The FP32-state items (param, state, t, seed index) of one group, split once for the step
    and its recorded plan: ({t: [(param, state)]} for torch's fused AdamW, FP32 parameters on a
    device in FUSED_ADAMW_DEVICES, one call per step value; [items] for adamw_step_torch)."""
    fused, by_t, loop = items and items[0][0].device.type in FUSED_ADAMW_DEVICES, {}, []
    for p, st, t, i in items:
        if fused and p.dtype == torch.float32:
            by_t.setdefault(t, []).append((p, st))
        else:
            loop.append((p, st, t, i))
    return by_t, loop


def fp32_loop(loop, k, hp, rule, seed):
    """adamw_step_torch on split_fp32's loop items (param, state, t, seed index) at step t + k,
    hp = (lr, b1, b2, eps, wd), rule = param_rounding, seed: the optimizer's."""
    for p, st, t, i in loop:
        adamw_step_torch(p, p.grad, st, *hp, t + k, rule, sr_seed_of(seed, t + k, i), span=shard_span(i))


def fused_fp32_args(its, lr=None):
    # the step-independent lists of fused_fp32_group for (param, state) pairs of FP32 parameters
    # of one device and step: the parameters and their moments shaped like them
    # (and whether a gradient needs a cast: a replayed plan keeps the gradients' dtypes);
    # capturable (lr: the device lr tensor): the states' device step counters and lr
    ps = [p for p, _ in its]
    return dict(ps=ps, ms=[st["exp_avg"].view_as(p) for p, st in its],
                vs=[st["exp_avg_sq"].view_as(p) for p, st in its],
                cast=any(p.grad.dtype != torch.float32 for p in ps),
                lr=lr, steps=[st["step"] for _, st in its] if lr is not None else None)


def fused_fp32_group(a, t, lr, b1, b2, eps, wd):
    # torch's fused AdamW on one fused_fp32_args group at step t
    ps = a["ps"]
    if a["lr"] is not None:        # capturable: t and lr from device memory
        steps, lr = a["steps"], a["lr"].float()
    else:
        steps = [torch.full((), float(t), dtype=torch.float32, device=ps[0].device)] * len(ps)
    grads = [p.grad.float() for p in ps] if a["cast"] else [p.grad for p in ps]
    torch._fused_adamw_(ps, grads, a["ms"], a["vs"], [], steps,
                        lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps,
                        amsgrad=False, maximize=False)


# ============================================================================================
# The FP32-state step in Triton: adamw_step_torch for many 16-bit-parameter tensors in one launch
#
# Each program steps
# ADAMW_BLOCK consecutive elements of one tensor, found through the same launch tables as the
# 4-bit kernel's (TAB_N_BLOCKS holds the element count, the scale columns are unused), and
# writes the parameter as the 4-bit kernel does (param_write.param_bits16: RTN, SR or eq. MW).

ADAMW_BLOCK = 1024       # elements per program


@triton.jit(do_not_specialize=["seed_of_step", "bias_rows"])
def adamw_fp32_kernel(program_tensor, launch_table,
                  seed_of_step, decay, step_size, b1, one_minus_b1, b2, one_minus_b2, inv_sqrt_bc2, eps,
                  step_ptr, lr_ptr, bias_table, bias_rows, DEV: tl.constexpr,
                  HAS_U: tl.constexpr, P_KIND: tl.constexpr, G_KIND: tl.constexpr,
                  P_SR: tl.constexpr, P_CORR: tl.constexpr, SHARDED: tl.constexpr, BLOCK: tl.constexpr):
    if DEV:
        seed_of_step, decay, step_size, inv_sqrt_bc2 = device_scalars(step_ptr, lr_ptr, bias_table,
                                                                       bias_rows, seed_of_step)
    pid = tl.program_id(0)
    row = launch_table + tl.load(program_tensor + pid) * TAB_WIDTH
    i = (pid - tl.load(row + TAB_FIRST_PROGRAM)) * BLOCK + tl.arange(0, BLOCK)    # int64
    mask = i < tl.load(row + TAB_N_BLOCKS)
    param = tl.load(row + TAB_PARAM).to(tl.pointer_type(tl.bfloat16 if P_KIND == 1 else tl.float16))
    grad = tl.load(row + TAB_GRAD).to(tl.pointer_type(
        tl.bfloat16 if G_KIND == 1 else tl.float16 if G_KIND == 2 else tl.float32))
    exp_avg = tl.load(row + TAB_EXP_AVG).to(tl.pointer_type(tl.float32))
    exp_avg_sq = tl.load(row + TAB_EXP_AVG_SQ).to(tl.pointer_type(tl.float32))
    corr = tl.load(row + TAB_CORRECTION).to(tl.pointer_type(tl.int8))
    w = tl.load(param + i, mask=mask, other=0).to(tl.float32)
    if P_CORR:       # eq. MW: w = x + e 2^(E-15)
        w = tl_join_master(w, tl.load(corr + i, mask=mask, other=0))
    g = tl.load(grad + i, mask=mask, other=0).to(tl.float32)
    # eq. 2.1a with FP32 storage
    m = tl.load(exp_avg + i, mask=mask, other=0.0) * b1 + g * one_minus_b1
    v = tl.load(exp_avg_sq + i, mask=mask, other=0.0) * b2 + g * g * one_minus_b2
    tl.store(exp_avg + i, m, mask=mask)
    tl.store(exp_avg_sq + i, v, mask=mask)
    # eq. 2.1b; eq. 3.1's r_t(v)
    w = w * decay - tl.div_rn(step_size * m, tl.sqrt_rn(v) * inv_sqrt_bc2 + eps)
    u = 0.0
    if P_SR:
        if HAS_U:    # tests: the caller's uniforms
            u = tl.load(tl.load(row + TAB_U_P).to(tl.pointer_type(tl.float32)) + i, mask=mask, other=0.0)
        else:        # stream 2, as the 4-bit kernel's BF16 write, at i's place in the whole tensor
            seed = tl_sr_seed(seed_of_step, tl.load(row + TAB_SEED_OF_INDEX))
            # an FSDP2 shard's first element's place; 0 at compile time in unsharded launches
            u = sr_uniform(seed, i + (tl.load(row + TAB_OFFSET) if SHARDED else 0), 2)
    h = param_bits16(w, u, corr + i, mask, P_KIND, P_SR, P_CORR)     # write_param
    tl.store(param.to(tl.pointer_type(tl.int16), bitcast=True) + i, h.to(tl.int16), mask=mask)


def adamw_step_triton(items, lr, b1, b2, eps, wd, t, rule, seed_of_step, cache, u=None):
    """adamw_step_torch for many tensors in one launch of adamw_fp32_kernel (eq. 2.1a-b with FP32
    moments), bit for bit given the same SR uniforms.

    items:  (param, state, index) triples of one device, parameter dtype (bfloat16 or float16,
            contiguous), gradient dtype (float32, bfloat16 or float16, contiguous) and step t;
            state as in adamw_step_torch (all with or all without a param_correction); index the
            parameter's position from 1 (its SR seed is sr_seed_of(seed, t, index)) or an FSDP2
            shard's sr_bits.ShardIndex (its SR bits are its whole tensor's there).
    rule:   the BF16 write, "rtn"|"sr"; seed_of_step: step_seed(seed, t).
    cache:  a dict kept per optimizer (program and launch tables of each set of tensors).
    u:      optional list of float32 uniform tensors u_p per item (the SR write's), replacing the
            kernel's Philox bits (tests).
    """
    adamw_prepare(items, rule, cache, u).run(lr, b1, b2, eps, wd, t, seed_of_step)


def adamw_prepare(items, rule, cache, u=None, own_table=False):
    """Everything of adamw_step_triton's launch that does not change between steps: a
    launch.Launch of adamw_fp32_kernel (launch.prepare; own_table as there)."""
    p0, p_corr = items[0][0], "param_correction" in items[0][1]
    bf16 = p0.dtype == torch.bfloat16
    return prepare(adamw_fp32_kernel, items, cache, 1, ADAMW_BLOCK, (), dict(
        HAS_U=u is not None, P_KIND=DTYPE_KIND[p0.dtype], G_KIND=DTYPE_KIND[p0.grad.dtype],
        P_SR=bf16 and not p_corr and rule == "sr", P_CORR=bf16 and p_corr,
        SHARDED=any(shard_offset(i) for _, _, i in items), BLOCK=ADAMW_BLOCK, num_warps=4),
        None if u is None else [(None, None, x) for x in u], own_table)
