"""
AdamW with 4-bit optimizer states (paper B): ZIP-SR and ZE-EDEN, the TorchAO-style baseline and
plain FP32 AdamW in one torch.optim.Optimizer, `AdamW4bit`.

Top to bottom: the math (below), the block quantizer, the reference step in plain PyTorch, the
presets, the optimizer, then the fused Triton kernel doing the same step (the same bits given the
same SR uniforms). Reference and kernel tag the same lines ("eq. 2.1a": the paper's section).

AdamW with update-before-storage (paper B, Sec. 2.1): the step decodes the stored moments Q(.),
forms the working moments, updates the parameter with them (unquantized), then stores them:
  [2.1a]  m~_t = b1 Q(m~_{t-1}) + (1-b1) g_t,        v~_t = b2 Q(v~_{t-1}) + (1-b2) g_t²
  [2.1b]  w_t = (1 - lr wd) w_{t-1} - (lr / bc1) m~_t / r_t(v~_t),   bc1 = 1 - b1^t, bc2 = 1 - b2^t
  [3.1]   r_t(v) = sqrt(v) / sqrt(bc2) + eps,        h_t(v) = 1 / r_t(v), the preconditioner

Block quantizer (Def. 3): flatten, cut into blocks of B = block_size (128) consecutive elements;
per block
  [D3]    s = max(max_i |x_i|, 1e-12) in FP32, levels C = s T of a normalized codebook T in [-1, 1],
          one 4-bit code (level index) per element, two per byte.
Per moment 0.5 + 4/128 = 0.53125 B/param, both 1.0625 B/param instead of FP32 AdamW's 8. A block
is rounded normalized, y = x (1/s) (one float32 reciprocal per block), against T itself, so the
kernel's tables are the same for every block.

Rounding (Appendix A.2): a rounding coordinate phi picks between the adjacent levels a < b around x,
  [A.2]   p = (phi(b) - phi(x)) / (phi(b) - phi(a)), the probability of writing a.
RTN writes a iff p > 1/2 (a tie writes b; in state space: iff x < (a + b)/2 in float32);
SR (Def. 5) writes a iff u < p, u ~ U[0, 1). State-RTN/SR round in phi(v) = v, Update-RTN/SR in
phi = h_t (eq. 3.1; nonnegative codebooks only), where p = (r_b - r_x) r_a / ((r_b - r_a) r_x).
Inputs outside [min C, max C] saturate: p > 1 or p < 0 does it without a branch.

ZIP-SR (Sec. 3.1) keeps zero in the v codebook (Dyn4) and rounds v with Update-SR. ZE-EDEN
(Sec. 3.2) drops zero (Dyn4-NZ) and calibrates each v block's scale (EDEN):
  [3.2]   stored scale = c s,  c = ||y||² / max(<y, T[code]>, 1e-12),  y = x (1/s)
(c_tau = ||x||² / max(<x, Q(x)>, tau s²), tau = 1e-12, in normalized form; an all-zero block gets
c = 0 and decodes to zero). Both store m in NF4 with RTN; the LM head's m switches to SR for the
last 10 % of training (Sec. 4).

Presets (paper B, Table 2; PRESETS below): "fp32" (plain AdamW), "torchao" (m SDyn4 State-RTN, v
Lin4-NZ State-RTN), "zeeden", "zipsr". Each component can be overridden, one row of Table 3 a call.

Parameters may be FP32 (the master weights), or BF16 / FP16: the math runs in FP32 and the new
weight w_t is written back in the parameter's dtype by param_write.py (BF16: round to nearest
even or stochastic rounding, `param_rounding`; or the 24-bit master weight of eq. MW,
`master_weight_bits=24`, an int8 correction per weight that the step reads back).

Non-finite gradients: a NaN or Inf gradient element poisons its whole block (torch's AdamW only
that element): the block's absmax, so its scale, becomes NaN or Inf, and from the next step all
block_size parameters of the block are NaN (reference and kernel alike, as the authors' absmax).
train.py stops on a non-finite loss or gradient norm.

The machinery lives in lowbit/optim/: the launch plan (plan.py), launch and lookup tables
(launch.py, lut.py), states and FSDP2 (state.py), argument checks (args.py), the 16-bit parameter
write (param_write.py), the SR bits (sr_bits.py), the FP32-state step (fp32.py).
"""
import math
import os

import torch
import triton
import triton.language as tl

from codebooks import get_codebook
from lowbit.numerics import adam_denominator, f32, midpoints, sqrt_rn
from lowbit.optim import args as optim_args
from lowbit.optim import state as optim_state
from lowbit.optim.fp32 import adamw_prepare, adamw_step_torch
from lowbit.optim.launch import (DTYPE_KIND, TAB_CORRECTION, TAB_EXP_AVG, TAB_EXP_AVG_SCALE, TAB_EXP_AVG_SQ,
                                 TAB_EXP_AVG_SQ_SCALE, TAB_FIRST_PROGRAM, TAB_GRAD, TAB_N_BLOCKS, TAB_OFFSET,
                                 TAB_PARAM, TAB_SEED_OF_INDEX, TAB_U_M, TAB_U_P, TAB_U_V, TAB_WIDTH, device_scalars,
                                 prepare)
from lowbit.optim.lut import kernel_tables, on_device, unpair
from lowbit.optim.param_write import (read_param, tl_join_master, tl_load_pairs, tl_masked_load, tl_store_pairs,
                                      write_step)
from lowbit.optim.plan import ParamPlan, StepPlan, hparams
from lowbit.optim.sr_bits import (element_uniforms, kernel_uniforms, shard_offset, shard_span, span_uniforms,
                                  sr_seed_of, tile_uniforms, tl_sr_seed)


# ============================================================================================
# The block quantizer (reference): Def. 3, Appendix A.2, eq. 3.2

def preconditioner(v, bias_correction2, eps):
    """h_t(v) = 1 / (sqrt(v / (1 - b2^t)) + eps) (paper B, Sec. 3.1; eq. 3.1 here), elementwise.

    v: float32 tensor (>= 0), any shape; bias_correction2 = 1 - b2^t; returns float32 like v."""
    return 1.0 / adam_denominator(v, bias_correction2, eps)


def round_to_levels(x, levels, rule="rtn", coord="state", bias_correction2=1.0, eps=1e-8, u=None,
                    r_x=None, r_scale=None):
    """Round each x to one of its two adjacent levels (paper B, Appendix A.2; eq. A.2 here);
    return int64 codes (level indices) shaped like x.

    x:      float tensor (..., n), in the units of `levels` (quantize_blockwise passes y = x (1/s)).
    levels: 1-D float tensor (K,) sorted ascending, K >= 2, same dtype as x.
    rule:   "rtn" or "sr" (Def. 5); coord: "state" (phi(v) = v) or "update" (phi = h_t, levels >= 0).
    u:      uniforms in [0, 1) shaped like x, required for rule="sr".
    r_x, r_scale: update coordinate only: r_t of the unnormalized value (default r_t(x)), and a
            level's r_t is r_scale * sqrt(level) + eps (default 1/sqrt(bc2); quantize_blockwise
            passes sqrt(s)/sqrt(bc2) per block, so r_t(s T[k]) is one table read and an fma).
    State-RTN is the nearest level (y >= (a + b) / 2 rounds up); the others compare p = num/den as
    in the module docstring. Values outside the levels saturate. Not checked here (quantize_blockwise).
    """
    K = levels.numel()
    if rule == "rtn" and coord == "state":
        return torch.searchsorted(midpoints(levels), x.contiguous(), right=True)   # #{midpoints <= x}
    lo = torch.searchsorted(levels[1:K - 1], x.contiguous(), right=True)  # max{k <= K-2: level <= x}
    a, b = levels[lo], levels[lo + 1]
    # p = (phi(b) - phi(x)) / (phi(b) - phi(a)) = num / den, den > 0 inside the cell; decided
    # without a division: RTN takes a iff 2 num > den, SR iff u den < num. For phi = h = 1/r:
    # p = (1/rb - 1/rx) / (1/rb - 1/ra) = (rb - rx) ra / ((rb - ra) rx).
    if coord == "update":
        if r_scale is None:
            r_scale = f32(1 / math.sqrt(bias_correction2))
        ra = r_scale * sqrt_rn(a) + eps
        rb = r_scale * sqrt_rn(b) + eps
        rx = adam_denominator(x, bias_correction2, eps) if r_x is None else r_x
        num, den = (rb - rx) * ra, (rb - ra) * rx
    else:
        num, den = b - x, b - a
    take_a = 2 * num > den if rule == "rtn" else u * den < num
    return torch.where(take_a, lo, lo + 1)


def pack_nibbles(codes):
    """(N,) integer codes in [0, 16) -> (N/2,) uint8; element 2i in the low nibble, 2i+1 high
    (Def. 3: two codes per byte). N must be even."""
    c = codes.to(torch.uint8).view(-1, 2)
    return c[:, 0] | (c[:, 1] << 4)


def unpack_nibbles(packed):
    """(N/2,) uint8 -> (N,) int64 codes; inverse of pack_nibbles."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(-1).long()


def quantize_blockwise(x, codebook, block_size=128, rule="rtn", coord="state",
                       bias_correction2=1.0, eps=1e-8, eden=False, u=None, generator=None, span=None):
    """Block-quantize a tensor to packed 4-bit codes and FP32 scales (paper B, Def. 3, App. A.2;
    eq. D3, A.2 and, with eden=True, 3.2 here).

    x:        float tensor, any shape, numel a multiple of block_size; read as flat float32.
    codebook: name in codebooks.CODEBOOKS or a 1-D level tensor (normalized, sorted).
    rule/coord: "rtn"|"sr" and "state"|"update"; coord="update" rounds in h_t space with
              bias_correction2 = 1 - b2^t of the step being stored, and eps of AdamW.
    eden:     EDEN calibration (paper B, Sec. 3.2): stored scale = c_tau * s with
              c_tau = ||y||² / max(<y, T[code]>, tau), y = x (1/s), tau = 1e-12 (the normalized form,
              sums in float64); an all-zero block gets c_tau = 0 and decodes to zero.
    u:        optional float32 uniforms in [0, 1) shaped like x for rule="sr" (else drawn from
              `generator`, sr_bits.span_uniforms; span: x's (offset, numel) in a whole tensor).
    Returns (packed uint8 (numel/2,), scales float32 (numel/block_size,)).
    Raises TypeError for a non-float x; ValueError on a bad block_size, rule, coord, codebook,
    bias_correction2 or u, a non-divisible numel, or negative x with coord="update".
    """
    T = get_codebook(codebook).to(x.device)
    optim_args.check_quant_args(x, block_size, rule, coord, T, bias_correction2)
    xb = x.detach().reshape(-1, block_size).float()
    if coord == "update" and bool((xb < 0).any()):
        raise ValueError("coord='update' rounds second moments: x must be nonnegative")
    s = xb.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)       # eq. D3
    y = xb * (1 / s)                 # normalized to [-1, 1]: one reciprocal per block
    if rule == "sr" and u is None:
        u = span_uniforms(xb.shape, generator, xb.device, span)
    if rule == "sr":
        if u.numel() != xb.numel():
            raise ValueError(f"u must have one uniform per element of x ({xb.numel()}), got {u.numel()}")
        u = u.reshape(xb.shape)
    r_x = r_scale = None
    if coord == "update":
        r_x = adam_denominator(xb, bias_correction2, eps)
        r_scale = sqrt_rn(s) * f32(1 / math.sqrt(bias_correction2))
    codes = round_to_levels(y, T, rule, coord, bias_correction2, eps, u, r_x, r_scale)   # eq. A.2
    s = s.view(-1)
    if eden:                                                      # eq. 3.2
        q = T[codes]
        # float64 sums: the Triton kernel reduces in another order, and in float64 both round to
        # the same float32 c (the products y*y, y*q are float32 in both).
        c = (y * y).double().sum(1) / (y * q).double().sum(1).clamp(min=1e-12)
        s = c.float() * s
    return pack_nibbles(codes.view(-1)), s


def dequantize_blockwise(packed, scales, codebook, block_size=128):
    """Decode packed 4-bit codes (paper B, Def. 3): x[i] = scales[i // block_size] * T[code[i]].

    packed: uint8 (N/2,); scales: float32 (N/block_size,); codebook as in quantize_blockwise.
    Returns flat float32 (N,). Raises TypeError if packed is not uint8, ValueError on a bad
    block_size or codebook, or sizes that do not describe one tensor.
    """
    optim_args.check_dequant_args(packed, scales, block_size)
    T = get_codebook(codebook).to(packed.device)
    codes = unpack_nibbles(packed.reshape(-1))
    return (scales[:, None] * T[codes].view(-1, block_size)).view(-1)


# ============================================================================================
# The reference step (plain PyTorch): eq. 2.1a-b, then Def. 3 / App. A.2 / eq. 3.2 storage

def adamw4bit_step_torch(param, grad, state, lr, b1, b2, eps, wd, t, cfg, m_rounding, seed, u=None, span=None,
                         kernel_bits=False):
    """One AdamW step of one 4-bit-state tensor in plain PyTorch (paper B, Sec. 2.1: eq. 2.1a-b,
    storage by Def. 3 / App. A.2, EDEN eq. 3.2): the specification adamw4bit_step_triton matches
    bit for bit. Runs under torch.no_grad() (AdamW4bit.step's).

    param:  float32, bfloat16 or float16, updated in place (math in float32); numel a multiple of
            cfg["block_size"]. grad: float32, bfloat16 or float16, param's shape.
    state:  dict holding exp_avg, exp_avg_sq (packed codes, uint8 (numel/2,)) and exp_avg_scale,
            exp_avg_sq_scale (float32 (numel/block_size,)); replaced by the stored new moments.
            With a "param_correction" entry (int8, param's shape; BF16 param) the weight is the
            24-bit master weight of eq. MW, read and written through it.
    lr, b1, b2, eps, wd: AdamW's (floats); t: this step's number (>= 1, bias corrections).
    cfg:    AdamW4bit.qcfg (codebooks, v_rounding, eden, block_size, param_rounding);
            m_rounding: "rtn"|"sr", the first moment's rule this step.
    seed:   seeds the generator of the SR uniforms (m's first, then v's, then the BF16 write's);
            u: optional tuple of float32 tensors (u_m, u_v[, u_p]), numel each, replacing them
            (kernel tests); span: an FSDP2 shard's (offset, whole numel), sr_bits.span_uniforms.
    kernel_bits: draw the uniforms adamw4bit_kernel draws from `seed` (sr_bits.kernel_uniforms)
            instead of torch.rand, so the step equals the kernel's bit for bit with SR too.
    Raises ValueError (from quantize_blockwise) on sizes or uniforms that do not fit.
    """
    B = cfg["block_size"]
    g = grad.reshape(-1).float()
    # eq. 2.1a, the working moments from the decoded states: b1 Q(m) is decoded as
    # T[code] (b1 s), the beta joining the per-block scale (one multiply per block)
    b1s, b2s = state["exp_avg_scale"] * b1, state["exp_avg_sq_scale"] * b2
    m = dequantize_blockwise(state["exp_avg"], b1s, cfg["m_codebook"], B) + g * (1 - b1)
    v = dequantize_blockwise(state["exp_avg_sq"], b2s, cfg["v_codebook"], B) + g * g * (1 - b2)
    # eq. 2.1b, the AdamW update with the working moments (update-before-storage)
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    decay, step_size = 1 - lr * wd, lr / bc1
    corr = state.get("param_correction")
    w = read_param(param, corr).reshape(-1)                          # eq. MW with a correction
    w = w * decay - step_size * m / adam_denominator(v, bc2, eps)       # eq. 3.1: r_t(v~)
    # eq. D3 + A.2: store both moments; v in its coordinate (eq. 3.1 for Update-*) and with
    # EDEN (eq. 3.2)
    gen = torch.Generator(device=param.device).manual_seed(seed)
    u_m, u_v, u_p = (tuple(u) + (None,))[:3] if u is not None else (None, None, None)
    v_coord, v_rule = cfg["v_rounding"].split("-")
    if kernel_bits and u is None:    # the kernel's streams: 1 m, 0 v, 2 the BF16 write
        p_sr = param.dtype == torch.bfloat16 and corr is None and cfg.get("param_rounding") == "sr"
        tile = max(1, KERNEL_ELEMS // B) * B // 2
        u_m, u_v, u_p = (kernel_uniforms(seed, param.numel(), stream, tile, param.device, span) if sr else None
                         for stream, sr in ((1, m_rounding == "sr"), (0, v_rule == "sr"), (2, p_sr)))
    state["exp_avg"], state["exp_avg_scale"] = quantize_blockwise(
        m, cfg["m_codebook"], B, m_rounding, "state", u=u_m, generator=gen, span=span)
    state["exp_avg_sq"], state["exp_avg_sq_scale"] = quantize_blockwise(
        v, cfg["v_codebook"], B, v_rule, v_coord, bc2, eps, cfg["eden"], u=u_v, generator=gen, span=span)
    write_step(param, w, corr, cfg.get("param_rounding", "rtn"), u_p, gen, span)


# ============================================================================================
# The presets (paper B, Table 2): m is always rounded in state space; v's rounding names
# "coord-rule"; zeeden and zipsr switch the LM head's m to SR for the last 10 % (Sec. 4)
PRESETS = {
    "fp32":    dict(m_codebook=None, m_rounding=None, v_codebook=None, v_rounding=None,
                    eden=False, lm_head_sr_after=None),
    "torchao": dict(m_codebook="sdyn4", m_rounding="rtn", v_codebook="lin4_nz",
                    v_rounding="state-rtn", eden=False, lm_head_sr_after=None),
    "zeeden":  dict(m_codebook="nf4", m_rounding="rtn", v_codebook="dyn4_nz",
                    v_rounding="state-rtn", eden=True, lm_head_sr_after=0.9),
    "zipsr":   dict(m_codebook="nf4", m_rounding="rtn", v_codebook="dyn4",
                    v_rounding="update-sr", eden=False, lm_head_sr_after=0.9),
}
MIN_QUANT_NUMEL = 4096  # paper B eligibility: numel >= 4096 and numel % block_size == 0


# ============================================================================================
# The optimizer

class AdamW4bit(torch.optim.Optimizer):
    """AdamW with block-quantized 4-bit moments (paper B, Sec. 2.1, Def. 3, Table 2).

    params:       iterable of FP32, BF16 or FP16 tensors or param-group dicts (per-group lr, betas,
                  eps, weight_decay, maximize, quantize). quantize=False keeps FP32 states for the
                  group (e.g. embeddings, as bitsandbytes' GlobalOptimManager); state_dict() saves it.
    lr, betas, eps, weight_decay: AdamW's, with torch.optim.AdamW's defaults (1e-3, (0.9, 0.999),
                  1e-8, 0.01); paper B trains with betas=(0.9, 0.95), weight_decay=0.1 (Appendix B),
                  which train.py and the examples pass. Real numbers (NumPy scalars too) or
                  one-element tensors; weight decay is decoupled: w <- (1 - lr wd) w.
    preset:       "fp32", "torchao", "zeeden" or "zipsr" (module docstring; paper B Table 2).
    Component overrides (each row of paper B Table 3 is one call), None keeps the preset's:
      m_codebook, v_codebook: codebook names (codebooks.CODEBOOKS);
      m_rounding: "rtn"|"sr"; v_rounding: "state-rtn"|"state-sr"|"update-rtn"|"update-sr";
      eden: EDEN calibration of v blocks (Sec. 3.2);
      lm_head_sr_after: progress fraction after which the parameters passed to mark_lm_head()
        store their first moment with SR instead of RTN (0.9 for zipsr/zeeden; None = never).
    block_size:   elements per scale block (power of two, default 128). A moment is quantized
                  iff numel >= 4096 and numel % block_size == 0 and its group does not set
                  quantize=False; others keep FP32 states (lowbit/optim/fp32.py).
    impl:         "torch" (reference), "triton" (fused kernel, CUDA or TRITON_INTERPRET=1), or
                  "auto" (triton on CUDA tensors, torch otherwise; lut.kernel_tables).
    seed:         seeds the SR bits: those of step t depend only on (seed, t, parameter index,
                  element position), so they are the same after a resume and on any world size.
    param_rounding: how BF16 parameters are written (param_write.py): "rtn" (round to nearest
                  even) or "sr" (stochastic rounding, unbiased). FP16 ones are written RTN.
    master_weight_bits: None, or 24 (FlashOptim's name): each BF16 parameter gets an int8
                  state "param_correction", the rounding residual of eq. MW, so the weights the
                  step updates have 16 significant bits, not 8 (+1 B/param). RTN writes only.
    capturable:   as torch's flag: step counters and lr on the device, so step() can run inside a
                  torch.cuda.graph capture (plan.py says what a capture needs); not with FSDP2
                  parameters. Same results (torch's fused AdamW of FP32-state FP32 tensors takes
                  lr as float32).
    kernel_uniforms: True: the reference step draws the kernel's SR uniforms (sr_bits.kernel_uniforms)
                  instead of torch.rand, so impl="torch" equals impl="triton" bit for bit with SR
                  too (RTN presets are equal either way). Slower: for checking the kernel.
    amsgrad, maximize, foreach, fused, differentiable: torch.optim.AdamW's, accepted at its defaults
                  (False, False, None, None, False); maximize=True steps -grad, as torch's; any
                  other value is a one-line ValueError naming it.

    State per quantized parameter: exp_avg / exp_avg_sq as packed uint8 (numel/2,) and
    exp_avg_scale / exp_avg_sq_scale as float32 (numel/block_size,); FP32 tensors otherwise;
    with master_weight_bits=24 also param_correction (int8, the parameter's shape; BF16 ones).
    state["step"]: a 0-d float32 tensor, as torch's (DCP loads it in place). FSDP2 parameters:
    lowbit/optim/state.py. NaN and Inf gradients: module docstring. Raises ValueError/TypeError
    for bad hyperparameters (also in param groups), unknown names, non-float parameters and
    mismatched state dicts; RuntimeError (as torch's AdamW) for sparse gradients.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 preset="zipsr", block_size=128, impl="auto", seed=0, *, m_codebook=None,
                 m_rounding=None, v_codebook=None, v_rounding=None, eden=None,
                 lm_head_sr_after="preset", param_rounding="rtn", master_weight_bits=None,
                 capturable=False, kernel_uniforms=False, amsgrad=False, maximize=False, foreach=None,
                 fused=None, differentiable=False):
        optim_args.check_init_args(PRESETS, lr, betas, eps, weight_decay, preset, block_size, impl, seed,
                                   param_rounding, master_weight_bits, capturable, kernel_uniforms,
                                   dict(amsgrad=amsgrad, maximize=maximize, foreach=foreach, fused=fused,
                                        differentiable=differentiable))
        self.qcfg = cfg = optim_args.quantizer_config(PRESETS, get_codebook, preset, block_size, m_codebook,
                                                      m_rounding, v_codebook, v_rounding, eden, lm_head_sr_after)
        cfg.update(param_rounding=param_rounding, master_weight_bits=master_weight_bits)
        self.impl, self.capturable, self.seed, self.progress = impl, capturable, int(seed), 0.0
        self.kernel_uniforms = kernel_uniforms
        # the kernel's lookup tables (CPU; copied to each device at its first step); None runs the reference
        self._kernel_tabs = kernel_tables(impl, cfg, get_codebook)
        self._lm_head = set()      # id() of the parameters mark_lm_head() marked
        self._new_caches()
        # torch's AdamW group keys too, at the values this step implements (code reading
        # group["amsgrad"] etc. finds them; optim_args checks a group's values each step)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      quantize=True, maximize=maximize, amsgrad=False, foreach=foreach,
                                      fused=fused, capturable=capturable, differentiable=False,
                                      decoupled_weight_decay=True))

    def _new_caches(self):
        # what the next steps rebuild when missing (a new optimizer, a copy, a loaded state dict)
        self._kernel_cache = {}    # the kernels' device tables and launch tables (launch.prepare)
        self._plan = StepPlan(self.capturable)    # step()'s recorded plan and what voids it
        self._shards = optim_state.LocalShards()  # FSDP2 parameters' shard layouts and local views
        self._checked = {}         # group index -> optim_args.hparams_key at its last check
        self._param_plan = ParamPlan()   # step_param's places and launches

    def add_param_group(self, param_group):
        """torch's add_param_group, then the group's checks (optim_args.check_new_group: its
        hyperparameters, float32/bfloat16/float16 parameters). A group that fails one is not kept."""
        super().add_param_group(param_group)
        self._plan.invalidate()
        gi, cfg = len(self.param_groups) - 1, self.qcfg
        try:
            self._checked[gi] = optim_args.check_new_group(gi, self.param_groups[-1], self.capturable,
                                                           cfg["param_rounding"], cfg["master_weight_bits"])
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    # ---- trainer hooks ----------------------------------------------------------------------
    def mark_lm_head(self, param):
        """Mark `param` (a tensor in this optimizer) as the LM head: its first moment switches
        from RTN to SR once progress >= lm_head_sr_after (paper B, Sec. 4). ValueError if absent."""
        if not any(param is p for g in self.param_groups for p in g["params"]):
            raise ValueError("mark_lm_head: the tensor is not a parameter of this optimizer")
        self._lm_head.add(id(param))
        self._plan.invalidate()

    def set_progress(self, fraction):
        """Tell the optimizer the training progress, a float in [0, 1] (step / total_steps);
        ValueError outside."""
        self.progress = optim_args.check_progress(fraction)

    def m_rounding_for(self, param):
        """The first-moment rounding ("rtn"|"sr") that the next step uses for `param`."""
        if id(param) in self._lm_head and self._lm_head_sr():
            return "sr"
        return self.qcfg["m_rounding"]

    def _lm_head_sr(self):
        after = self.qcfg["lm_head_sr_after"]
        return after is not None and self.progress >= after

    # ---- state --------------------------------------------------------------------------------
    def _eligible(self, p):
        n = p.numel()
        return self.qcfg["m_codebook"] is not None and n >= MIN_QUANT_NUMEL and n % self.qcfg["block_size"] == 0

    def is_quantized(self, p, group=None):
        """True if p's moments are stored in 4 bits: a quantized preset, an eligible size, and p's
        param group (`group`, else looked up) does not set quantize=False. ValueError when p already
        has states of the other kind (the group's quantize flag was changed after its first step)."""
        group = group or optim_state.group_of(self.param_groups, p, "is_quantized")
        return optim_state.check_kind(p, self.state.get(p), group.get("quantize", True) and self._eligible(p), group)

    def _init_state(self, p, group=None):    # p's zero states at its first step
        st = self.state[p]
        st.update(optim_state.new_state(p, self.is_quantized(p, group), self.qcfg["block_size"],
                                        self.capturable, self.qcfg["master_weight_bits"]))
        return st

    def state_nbytes(self):
        """Persistent state bytes (this rank's for FSDP2): 1.0625 B/param quantized, 8 FP32, + 1
        with master_weight_bits=24 on BF16 ones; the step counters are not counted."""
        return optim_state.state_nbytes(self.state.values())

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def __getstate__(self):
        # copy.deepcopy and pickle: torch's entries, what the next steps depend on, the LM-head
        # marks as parameter positions (a copy's parameters are other tensors); no caches
        heads = [i for i, p in enumerate(self._params()) if id(p) in self._lm_head]
        return dict(super().__getstate__(), qcfg=self.qcfg, impl=self.impl, capturable=self.capturable,
                    seed=self.seed, progress=self.progress, _kernel_tabs=self._kernel_tabs,
                    kernel_uniforms=self.kernel_uniforms, lm_head_positions=heads)

    def __setstate__(self, state):   # also torch's load_state_dict, with its two entries only
        state = dict(state)
        heads = state.pop("lm_head_positions", [])
        super().__setstate__(state)
        self.__dict__.setdefault("kernel_uniforms", False)
        # a group saved before one of its keys existed (quantize, maximize, ...) takes the
        # default, as torch's optimizers fill theirs
        for group in self.param_groups:
            for k, v in self.defaults.items():
                group.setdefault(k, v)
        self._new_caches()
        params = self._params()
        self._lm_head = {id(params[i]) for i in heads}

    def state_dict(self):
        """torch's state dict plus the quantizer configuration, seed, progress and LM-head marks;
        codes and scales per row where rows are whole blocks (FSDP2's layout, views). The
        register_state_dict_post_hook hooks get this dict, as torch's get theirs."""
        params = self._params()
        with optim_state.without(self, "_optimizer_state_dict_post_hooks") as (post,):
            sd = super().state_dict()
        extra = dict(seed=self.seed, progress=self.progress,
                     lm_head=[i for i, p in enumerate(params) if id(p) in self._lm_head])
        sd = optim_state.with_config(sd, params, self.qcfg, extra)
        for hook in post.values():
            result = hook(self, sd)
            sd = sd if result is None else result
        return sd

    def load_state_dict(self, state_dict):
        """Load a state_dict() of an AdamW4bit with the same configuration, codes and scales
        exactly, on each parameter's device; also set_optimizer_state_dict's {"state",
        "param_groups"} (DCP). ValueError for another configuration or optimizer. As torch's, the
        register_load_state_dict_pre_hook hooks get the state dict as given (and may change or
        replace it), the post hooks the loaded optimizer."""
        state_dict, params = state_dict.copy(), self._params()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            state_dict = state_dict if result is None else result
        state_dict, torch_part = optim_state.check_loadable(state_dict, self.qcfg, params,
                                                            [self._eligible(p) for p in params])
        self._plan.invalidate()
        with optim_state.without(self, "_optimizer_load_state_dict_pre_hooks",
                                 "_optimizer_load_state_dict_post_hooks") as (_, post):
            super().load_state_dict(torch_part)
        optim_state.restore_states(state_dict, params, self.state, self.qcfg["master_weight_bits"])
        extra = state_dict.get("adam4bit_extra", {})
        self.seed, self.progress = int(extra.get("seed", self.seed)), float(extra.get("progress", self.progress))
        self._lm_head |= {id(params[i]) for i in extra.get("lm_head", [])}
        for hook in post.values():
            hook(self)

    # ---- step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over all parameters with a gradient (update-before-storage): quantized
        tensors through adamw4bit_kernel (one launch per batch of tensors sharing step, dtypes and
        m's rule) or the reference (adamw4bit_step_torch), FP32-state ones through
        lowbit/optim/fp32.py. The plan is recorded and replayed (plan.StepPlan). Returns the
        closure's loss (None without a closure)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            self._recheck(gi, group)
        capturing = self.capturable and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        owners = self._params()
        with optim_state.negated(optim_state.maximized_grads(self.param_groups)):   # maximize=True
            params, grads = self._shards.local_params(owners, [p.grad for p in owners])
            record = self._plan.replay_or_record(self.param_groups, (id(self.state), self.impl, self._lm_head_sr()),
                                                 params, grads, self.seed, self.qcfg["param_rounding"], capturing,
                                                 self.state)
            if record is not None and self._build_and_run(record):   # nothing replayed: run and record
                self._plan.keep(record)
        self._shards.drop_grads()
        return loss

    def _recheck(self, gi, group):
        # group gi's changed lr, betas, eps or weight decay checked again (optim_args.check_group)
        if self._checked.get(gi) != optim_args.hparams_key(group):
            self._checked[gi] = optim_args.check_group(gi, group, self.capturable, lr_value=False)

    def _build_and_run(self, record):
        # Every parameter with a gradient, group by group (_run_group). Returns whether a later
        # step may replay the record (not with reference 4-bit steps or gathered FSDP2 tensors).
        interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
        index, writeback, cacheable = 0, [], record["key"] is not None
        for gi, group in enumerate(self.param_groups):
            members = [(p, index + j) for j, p in enumerate(group["params"], 1) if p.grad is not None]
            index += len(group["params"])
            cacheable = self._run_group(record, gi, group, members, writeback, interp, cacheable, self._prepare)
        for args in writeback:
            optim_state.write_back(*args)
        return cacheable

    def _run_group(self, record, gi, group, members, writeback, interp, cacheable, prepare):
        # members: (parameter with a gradient, its index from 1) of group gi. Each one's state for
        # this step, then its path (kernel or reference, 4-bit or FP32 states): the reference
        # 4-bit step runs at once, the rest through StepPlan.run_group, which records it in
        # `record`, the kernels in one launch per (path, t, dtypes, m's rule or correction) from
        # prepare(path, m_rule, items, own_table). Returns cacheable, False once a step ran outside
        # the plan or a tensor was gathered (a gathered tensor is new each step).
        hp, states, fp32, batches = hparams(group), [], [], {}
        for p, index in members:
            owner = p
            st, path, (p, st_p, t, sidx, m_rule), gathered = self._param_path(p, group, index, writeback, interp)
            states.append((owner, st))
            cacheable = cacheable and not gathered
            if path in ("small", "kernel"):
                kind = m_rule if path == "kernel" else "param_correction" in st_p
                batches.setdefault((path, t, p.dtype, p.grad.dtype, kind), []).append((p, st_p, sidx))
            elif self._step_now(path, p, st_p, t, sidx, m_rule, hp):
                cacheable = False     # not in the plan: a later step cannot replay it
            elif path == "fp32":
                fp32.append((p, st_p, t, sidx))
        launches = [(t, prepare(path, kind, items, cacheable), items) for (path, t, _, _, kind), items in batches.items()]
        self._plan.run_group(record, gi, group, hp, [st for _, st in states], fp32, launches, self.seed,
                             self.qcfg["param_rounding"], [p for p, _ in states])
        return cacheable

    def _prepare(self, path, m_rule, items, own_table):
        # the launch of a batch of tensors: adamw4bit_kernel ("kernel") or adamw_fp32_kernel ("small")
        if path == "kernel":
            return _triton_prepare(items, self.qcfg, m_rule, self._kernel_tabs, self._kernel_cache, own_table=own_table)
        return adamw_prepare(items, self.qcfg["param_rounding"], self._kernel_cache, own_table=own_table)

    def _param_path(self, p, group, index, writeback, interp):
        # Parameter number `index` (from 1: its SR seed index) of `group`, with a gradient, at this
        # step: its state (created at its first step, fitted to p, its counter advanced) and where
        # it steps. Returns (state, path, (tensor, its state, t, seed index, m's rule), gathered);
        # path "small" (FP32 states, 16-bit parameter: adamw_fp32_kernel), "fp32" (FP32 states:
        # fp32.py's loop or torch's fused AdamW), "kernel" (adamw4bit_kernel), "reference"
        # (adamw4bit_step_torch) or None (an FSDP2 shard with no rows here). An FSDP2 parameter
        # steps as its shard or gathered tensor (LocalShards.step_view: the copy back goes to
        # writeback), plain ones as themselves.
        cfg = self.qcfg
        optim_state.check_grad(p, index)
        st = self.state[p] if self.state[p] else self._init_state(p, group)
        optim_state.fit_state(p, st, index, self.capturable, cfg["master_weight_bits"])
        st["step"] += 1
        t, sidx, st_p, gathered, empty = int(st["step"]), index, st, False, False
        quantized, m_rule = self.is_quantized(p, group), self.m_rounding_for(p)
        if optim_state.is_dtensor(p):   # FSDP2: step this rank's shard (or the gathered tensor)
            p, st_p, sidx, gathered = self._shards.step_view(p, st, quantized, index, cfg["block_size"], writeback)
            empty = p.numel() == 0      # fewer rows than ranks: nothing here
        if empty:
            path = None
        elif not quantized:
            path = "small" if optim_args.use_adamw_kernel(p, self.impl, interp) else "fp32"
        else:
            path = "kernel" if optim_args.use_triton(p, self.impl, interp, self._kernel_tabs) else "reference"
        return st, path, (p, st_p, t, sidx, m_rule), gathered

    def _step_now(self, path, p, st, t, sidx, m_rule, hp):
        # The steps that run at once, outside the recorded plan: the reference 4-bit step, and
        # with kernel_uniforms an SR write of a BF16 parameter with FP32 states (adamw_fp32_kernel's
        # uniforms). Returns whether p's step ran here.
        seed, span = sr_seed_of(self.seed, t, sidx), shard_span(sidx)
        if path == "reference":
            adamw4bit_step_torch(p, p.grad, st, *hp, t, self.qcfg, m_rule, seed, span=span,
                                 kernel_bits=self.kernel_uniforms)
        elif path == "fp32" and self.kernel_uniforms and p.dtype == torch.bfloat16 and \
                self.qcfg["param_rounding"] == "sr" and "param_correction" not in st:
            adamw_step_torch(p, p.grad, st, *hp, t, "sr", seed, element_uniforms(seed, p.numel(), 2, p.device, span),
                             span)
        else:
            return False
        return True

    @torch.no_grad()
    def step_param(self, p):
        """Step one parameter as the next step() would, bit for bit: its group's hyperparameters,
        its own step count and SR seed, the LM head's first-moment rule. The host work does not
        grow with the number of parameters (lowbit.step_in_backward calls it from each
        gradient's hook). Does nothing while p.grad is None. ValueError for a tensor that is not
        a parameter of this optimizer, or with capturable=True (its step runs for all at once)."""
        if p.grad is None:
            return
        if self.capturable:
            raise ValueError("step_param: capturable=True steps every parameter at once in step(); "
                             "use capturable=False")
        gi, index = self._param_plan.place(self.param_groups, p)
        group, writeback = self.param_groups[gi], []
        self._recheck(gi, group)
        self._plan.invalidate()     # the step counters move outside the recorded plan
        interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
        one = dict(group, params=[p])    # the ordinary step's code for a group of this one tensor
        with optim_state.negated(optim_state.maximized_grads([one])):   # maximize=True
            self._run_group(dict(states=[], owners=[], groups=[]), gi, one, [(p, index)], writeback, interp, False,
                            lambda path, kind, items, _: self._param_plan.launch(
                                (path, kind), *items[0], lambda: self._prepare(path, kind, items, True)))
        for args in writeback:
            optim_state.write_back(*args)
            args[2].grad = None    # FSDP2: no reference to its gradient outlives the step


# ============================================================================================
# The fused Triton step: the reference step above, for many tensors in one launch and one
# pass over param, grad and both packed moments
#
# The step does few instructions per element and keeps many bytes in flight. The quantizer works
# on y = x (1/s) against small tables (decode: one 64-bit read per byte; level search: one 64-bit
# bucket read and one compare; adjacent levels: one 64-bit read), and the tables are small, so a
# warp's 32 reads touch few cache lines. A tile is held as two halves, the even and the odd
# elements, so that nothing moves between threads (tl.join/tl.split compile into shuffles). A
# program loops over KERNEL_TILES tiles with the next tile's loads issued before the current
# tile's arithmetic (more bytes in flight without more warps).

KERNEL_ELEMS = 128      # elements per tile (one warp)
KERNEL_TILES = 16       # tiles per Triton program (setup amortized; 2 tiles share a Philox call)
# registers per thread, RTN-only steps / steps that draw SR bits or sum for EDEN: 64 keeps 32
# one-warp programs per SM; the SR and EDEN steps, with more live values, do better with 72
# (28 programs per SM)
KERNEL_MAXNREG = (64, 72)
_INTERP = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit(do_not_specialize=["seed_of_step", "bias_rows"])
def adamw4bit_kernel(
        # launch tables: program -> tensor (int32), one row per tensor (int64, TAB_* columns)
        program_tensor, launch_table,
        # codebook tables (build_kernel_tables): decode byte -> (T[lo], T[hi]); T_v for EDEN; level
        # search (bucket tables and half their bucket counts); adjacent levels k -> (a, b)
        m_decode, v_decode, v_codebook, m_lut, v_lut, m_hn, v_hn, m_adjacent, v_adjacent,
        # hyper-parameters of this step (eq. 2.1a-b, 3.1): seed_of_step + the table's index term
        # is the tensor's SR seed (sr_seed_of); decay = 1 - lr wd; step_size = lr / bc1
        seed_of_step, decay, step_size, b1, one_minus_b1, b2, one_minus_b2, inv_sqrt_bc2, eps,
        # capturable steps (DEV): t and lr read from device memory, see device_scalars
        step_ptr, lr_ptr, bias_table, bias_rows, DEV: tl.constexpr,
        # the configuration: rounding rules (eq. A.2), EDEN (eq. 3.2), input types and layout
        M_SR: tl.constexpr, V_SR: tl.constexpr, V_UPDATE: tl.constexpr, EDEN: tl.constexpr,
        HAS_U: tl.constexpr, ALIGNED: tl.constexpr, SHARDED: tl.constexpr, PAIRED: tl.constexpr,
        # parameter and gradient dtypes (DTYPE_KIND: 0 FP32, 1 BF16, 2 FP16) and the BF16 write:
        # SR (P_SR) or eq. MW's 24-bit master weight (P_CORR)
        P_KIND: tl.constexpr, G_KIND: tl.constexpr, P_SR: tl.constexpr, P_CORR: tl.constexpr,
        # tiling: BLOCK_SIZE elements per scale block, NB blocks per tile, TILES tiles per program
        BLOCK_SIZE: tl.constexpr, NB: tl.constexpr, TILES: tl.constexpr):
    # A program does TILES tiles of NB consecutive blocks of one tensor, two tiles per loop
    # iteration; its row of the launch table gives the tensor's pointers.
    tl.static_assert(TILES % 2 == 0)    # tile pairs start at even tiles, as the SR bits' (_pair_uniforms)
    if DEV:
        seed_of_step, decay, step_size, inv_sqrt_bc2 = device_scalars(step_ptr, lr_ptr, bias_table,
                                                                       bias_rows, seed_of_step)
    pid = tl.program_id(0)
    row = launch_table + tl.load(program_tensor + pid) * TAB_WIDTH
    n_blocks = tl.load(row + TAB_N_BLOCKS)
    first = (pid - tl.load(row + TAB_FIRST_PROGRAM)) * (NB * TILES)      # first block of this program
    param = tl.load(row + TAB_PARAM).to(tl.pointer_type(
        tl.bfloat16 if P_KIND == 1 else tl.float16 if P_KIND == 2 else tl.float32))
    grad = tl.load(row + TAB_GRAD).to(tl.pointer_type(
        tl.bfloat16 if G_KIND == 1 else tl.float16 if G_KIND == 2 else tl.float32))
    corr = tl.load(row + TAB_CORRECTION).to(tl.pointer_type(tl.int8))
    exp_avg = tl.load(row + TAB_EXP_AVG).to(tl.pointer_type(tl.uint8))
    exp_avg_scale = tl.load(row + TAB_EXP_AVG_SCALE).to(tl.pointer_type(tl.float32))
    exp_avg_sq = tl.load(row + TAB_EXP_AVG_SQ).to(tl.pointer_type(tl.uint8))
    exp_avg_sq_scale = tl.load(row + TAB_EXP_AVG_SQ_SCALE).to(tl.pointer_type(tl.float32))
    seed = tl_sr_seed(seed_of_step, tl.load(row + TAB_SEED_OF_INDEX))     # sr_seed_of
    # global block of block 0: an FSDP2 shard's; 0 at compile time in unsharded launches
    off = tl.load(row + TAB_OFFSET) // BLOCK_SIZE if SHARDED else 0
    u_m = tl.load(row + TAB_U_M).to(tl.pointer_type(tl.float32))
    u_v = tl.load(row + TAB_U_V).to(tl.pointer_type(tl.float32))
    u_p = tl.load(row + TAB_U_P).to(tl.pointer_type(tl.float32))
    # A tile is held as two (NB, BLOCK_SIZE/2) halves, the even and the odd elements: they are the
    # low and high nibbles of one byte, so decode and packing need no data exchange between threads.
    pair = tl.arange(0, NB)[:, None] * (BLOCK_SIZE // 2) + tl.arange(0, BLOCK_SIZE // 2)[None, :]
    last = tl.minimum(first + NB * TILES, n_blocks)
    a0, a1, a2, a3, a4, a5, a6, a7 = _load_tile(param, grad, corr, exp_avg, exp_avg_scale, exp_avg_sq,
                                                exp_avg_sq_scale, first, n_blocks, b1, b2, NB > 1,
                                                P_KIND, G_KIND, P_CORR, ALIGNED, BLOCK_SIZE, NB)
    for f in tl.range(first, last, 2 * NB, num_stages=1):
        # rotated: tile f's inputs were loaded in the previous iteration, tile f + NB's loads are
        # in flight during tile f's arithmetic and tile f + 2 NB's during tile f + NB's (more
        # bytes in flight without more warps). Tiles past the program's end are masked.
        b = _load_tile(param, grad, corr, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, f + NB,
                       last, b1, b2, True, P_KIND, G_KIND, P_CORR, ALIGNED, BLOCK_SIZE, NB)
        # SR uniforms of both tiles (tests: HAS_U, the caller's, from the launch table's u_m, u_v, u_p)
        u = tile_uniforms(seed, u_m, u_v, u_p, f, off, pair, n_blocks - f, last - f - NB, M_SR, V_SR,
                           P_SR, HAS_U, PAIRED, BLOCK_SIZE, NB)
        _step_tile(a0, a1, a2, a3, a4, a5, a6, a7, u[0], u[1], u[2], u[3], u[4], u[5],
                   param, corr, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, f, n_blocks,
                   m_decode, v_decode, v_codebook, m_lut, v_lut, m_hn, v_hn, m_adjacent, v_adjacent,
                   decay, step_size, one_minus_b1, one_minus_b2, inv_sqrt_bc2, eps,
                   NB > 1, M_SR, V_SR, V_UPDATE, EDEN, P_KIND, P_SR, P_CORR, ALIGNED, BLOCK_SIZE, NB)
        a0, a1, a2, a3, a4, a5, a6, a7 = _load_tile(param, grad, corr, exp_avg, exp_avg_scale,
                                                    exp_avg_sq, exp_avg_sq_scale, f + 2 * NB, last,
                                                    b1, b2, True, P_KIND, G_KIND, P_CORR, ALIGNED,
                                                    BLOCK_SIZE, NB)
        _step_tile(b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], u[6], u[7], u[8], u[9], u[10], u[11],
                   param, corr, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, f + NB, last,
                   m_decode, v_decode, v_codebook, m_lut, v_lut, m_hn, v_hn, m_adjacent, v_adjacent,
                   decay, step_size, one_minus_b1, one_minus_b2, inv_sqrt_bc2, eps,
                   True, M_SR, V_SR, V_UPDATE, EDEN, P_KIND, P_SR, P_CORR, ALIGNED, BLOCK_SIZE, NB)


# ---- the kernel's helpers --------------------------------------------------------------------

@triton.jit
def _load_tile(param, grad, corr, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, first, lim,
               b1, b2, MASK: tl.constexpr, P_KIND: tl.constexpr, G_KIND: tl.constexpr,
               P_CORR: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_SIZE: tl.constexpr, NB: tl.constexpr):
    # inputs of blocks first .. first+NB-1 (int64 block index, int32 offsets): both code bytes
    # (int32), scales times b1 / b2 (NB, 1), and param (with P_CORR: eq. MW's master weight) and
    # grad as even/odd halves (float32).
    # MASK: only rows < lim exist (without masks when every tile is one whole block: cheaper)
    rows = tl.arange(0, NB)
    pair = rows[:, None] * (BLOCK_SIZE // 2) + tl.arange(0, BLOCK_SIZE // 2)[None, :]   # byte index
    rmask = rows < lim - first if MASK else None
    mask = rmask[:, None] if MASK else None
    m_byte = tl_masked_load(exp_avg + first * (BLOCK_SIZE // 2) + pair, mask).to(tl.int32)
    v_byte = tl_masked_load(exp_avg_sq + first * (BLOCK_SIZE // 2) + pair, mask).to(tl.int32)
    b1s = (tl_masked_load(exp_avg_scale + first + rows, rmask) * b1)[:, None]
    b2s = (tl_masked_load(exp_avg_sq_scale + first + rows, rmask) * b2)[:, None]
    # ALIGNED: an element pair is one aligned 64-bit (FP32) or 32-bit (BF16/FP16) word
    w0, w1 = tl_load_pairs(param + first * BLOCK_SIZE, pair, mask, P_KIND, ALIGNED)
    g0, g1 = tl_load_pairs(grad + first * BLOCK_SIZE, pair, mask, G_KIND, ALIGNED)
    if P_CORR:       # eq. MW: w = x + e 2^(E-15)
        w0 = tl_join_master(w0, tl_masked_load(corr + first * BLOCK_SIZE + 2 * pair, mask))
        w1 = tl_join_master(w1, tl_masked_load(corr + first * BLOCK_SIZE + 2 * pair + 1, mask))
    return m_byte, v_byte, b1s, b2s, w0, w1, g0, g1


@triton.jit
def _step_tile(m_byte, v_byte, b1s, b2s, w0, w1, g0, g1, um0, um1, uv0, uv1, up0, up1,
               param, corr, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, first, lim,
               m_decode, v_decode, v_codebook, m_lut, v_lut, m_hn, v_hn, m_adjacent, v_adjacent,
               decay, step_size, one_minus_b1, one_minus_b2, inv_sqrt_bc2, eps,
               MASK: tl.constexpr, M_SR: tl.constexpr, V_SR: tl.constexpr, V_UPDATE: tl.constexpr,
               EDEN: tl.constexpr, P_KIND: tl.constexpr, P_SR: tl.constexpr, P_CORR: tl.constexpr,
               ALIGNED: tl.constexpr, BLOCK_SIZE: tl.constexpr, NB: tl.constexpr):
    # the step of one tile (adamw4bit_step_torch line by line) from _load_tile's inputs and the
    # SR uniforms of both halves (m, v and the BF16 write)
    rows = tl.arange(0, NB)
    pair = rows[:, None] * (BLOCK_SIZE // 2) + tl.arange(0, BLOCK_SIZE // 2)[None, :]
    rmask = rows < lim - first if MASK else None
    mask = rmask[:, None] if MASK else None
    exp_avg += first * (BLOCK_SIZE // 2)
    exp_avg_sq += first * (BLOCK_SIZE // 2)
    exp_avg_scale += first
    exp_avg_sq_scale += first

    # eq. 2.1a, the working moments: m~ = T[code] (b1 s) + (1-b1) g, v~ likewise with g²
    t0, t1 = unpair(tl.load(m_decode + m_byte))              # T[code] of both nibbles
    m0 = t0 * b1s + g0 * one_minus_b1
    m1 = t1 * b1s + g1 * one_minus_b1
    t0, t1 = unpair(tl.load(v_decode + v_byte))
    v0 = t0 * b2s + g0 * g0 * one_minus_b2
    v1 = t1 * b2s + g1 * g1 * one_minus_b2

    # eq. 2.1b, the AdamW update with the working moments (update-before-storage)
    r0 = tl.sqrt_rn(v0) * inv_sqrt_bc2 + eps                  # eq. 3.1: r_t(v~), reused by Update-*
    r1 = tl.sqrt_rn(v1) * inv_sqrt_bc2 + eps
    w0 = w0 * decay - tl.div_rn(step_size * m0, r0)
    w1 = w1 * decay - tl.div_rn(step_size * m1, r1)
    tl_store_pairs(param + first * BLOCK_SIZE, corr + first * BLOCK_SIZE, pair, w0, w1, up0, up1, mask,
                   P_KIND, P_SR, P_CORR, ALIGNED)            # write_param

    # eq. D3 + A.2: store both moments, s = max(absmax, 1e-12), y = x (1/s). A NaN in the block
    # makes s NaN, as in the reference (tl.maximum would otherwise drop it and leave y huge), so
    # every y is NaN and the bucket index stays inside its table.
    s = tl.maximum(_absmax(m0, m1), 1e-12, propagate_nan=tl.PropagateNan.ALL)
    inv = tl.div_rn(1.0, s)[:, None]
    c0 = _quantize(m0 * inv, m_lut, m_hn, m_adjacent, um0, r0, 0.0, eps, M_SR, False)
    c1 = _quantize(m1 * inv, m_lut, m_hn, m_adjacent, um1, r1, 0.0, eps, M_SR, False)
    tl.store(exp_avg + pair, (c0 | (c1 << 4)).to(tl.uint8), mask=mask)
    tl.store(exp_avg_scale + rows, s, mask=rmask)
    s = tl.maximum(_absmax(v0, v1), 1e-12, propagate_nan=tl.PropagateNan.ALL)
    inv = tl.div_rn(1.0, s)[:, None]
    y0 = v0 * inv
    y1 = v1 * inv
    r_scale = (tl.sqrt_rn(s) * inv_sqrt_bc2)[:, None]
    c0 = _quantize(y0, v_lut, v_hn, v_adjacent, uv0, r0, r_scale, eps, V_SR, V_UPDATE)
    c1 = _quantize(y1, v_lut, v_hn, v_adjacent, uv1, r1, r_scale, eps, V_SR, V_UPDATE)
    if EDEN:         # eq. 3.2: c = sum y² / max(sum y T[code], 1e-12), float64 sums
        q0 = tl.load(v_codebook + c0)
        q1 = tl.load(v_codebook + c1)
        yy = tl.sum((y0 * y0).to(tl.float64), axis=1) + tl.sum((y1 * y1).to(tl.float64), axis=1)
        yq = tl.sum((y0 * q0).to(tl.float64), axis=1) + tl.sum((y1 * q1).to(tl.float64), axis=1)
        s = (yy / tl.maximum(yq, 1e-12)).to(tl.float32) * s
    tl.store(exp_avg_sq + pair, (c0 | (c1 << 4)).to(tl.uint8), mask=mask)
    tl.store(exp_avg_sq_scale + rows, s, mask=rmask)


@triton.jit
def _quantize(y, lut, hn, adjacent, u, rx, r_scale, eps, SR: tl.constexpr, UPDATE: tl.constexpr):
    # eq. A.2: round_to_levels(y, T, ...) with the same float32 operations. bucket_lut (2 hn
    # buckets) gives the count of boundaries <= y: the code itself for State-RTN, else the lower
    # level's index k. y is in [-1, 1] or NaN (the whole block then, see _step_tile): the GPU
    # converts NaN to bucket 0, the interpreter to INT_MIN, so there (only) the index is clamped.
    j = tl.fma(y, hn, hn).to(tl.int32)
    if _INTERP:
        j = tl.maximum(j, 0)
    count, bound = unpair(tl.load(lut + j))
    k = count.to(tl.int32, bitcast=True) + (y >= bound).to(tl.int32)
    if not SR and not UPDATE:
        return k
    a, b = unpair(tl.load(adjacent + k))
    if UPDATE:                       # a, b are sqrt(T[k]), sqrt(T[k+1])
        ra = r_scale * a + eps
        rb = r_scale * b + eps
        num = (rb - rx) * ra
        den = (rb - ra) * rx
    else:
        num = b - y
        den = b - a
    take_a = u * den < num if SR else 2 * num > den
    return tl.where(take_a, k, k + 1)


@triton.jit
def _absmax(x0, x1):
    # max |x| per row over both halves, as an integer max of the bit patterns (same order for
    # floats >= 0): one warp-wide REDUX instruction instead of five shuffle rounds
    m = tl.maximum(tl.abs(x0).to(tl.int32, bitcast=True), tl.abs(x1).to(tl.int32, bitcast=True))
    return tl.max(m, axis=1).to(tl.float32, bitcast=True)


# ---- the wrapper -----------------------------------------------------------------------------

def adamw4bit_step_triton(items, lr, b1, b2, eps, wd, t, cfg, m_rounding, seed_of_step, tables, cache,
                          u=None):
    """adamw4bit_step_torch for many tensors in one launch of adamw4bit_kernel (paper B, eq.
    2.1a-b, Def. 3 / App. A.2 storage, EDEN eq. 3.2), bit for bit given the same SR uniforms.

    items:  (param, state, index) triples of one device, parameter dtype, gradient dtype and
            step t: contiguous float32/bfloat16/float16 param and grad, numel a multiple of
            cfg["block_size"]; state as in adamw4bit_step_torch (written in place); index the
            parameter's position from 1 (SR seed sr_seed_of(seed, t, index)) or a ShardIndex.
    lr, b1, b2, eps, wd, t, cfg, m_rounding: as in adamw4bit_step_torch; seed_of_step:
            step_seed(seed, t). tables: build_kernel_tables(...) (CPU); cache: a dict kept per
            optimizer (the tables on each device, the program and launch tables).
    u:      optional list of (u_m, u_v, u_p) float32 uniforms per item, replacing Philox (tests).
    """
    _triton_prepare(items, cfg, m_rounding, tables, cache, u).run(lr, b1, b2, eps, wd, t, seed_of_step)


def _triton_prepare(items, cfg, m_rounding, tables, cache, u=None, own_table=False):
    """Everything of adamw4bit_step_triton's launch that does not change between steps, a
    launch.Launch (launch.prepare: the grid's program table and the launch table, cached in
    `cache`, own_table as there): the lookup tables on the tensors' device and the compile-time
    flags."""
    B, p0 = cfg["block_size"], items[0][0]
    tabs = on_device(tables, p0.device, cache)
    nb = max(1, KERNEL_ELEMS // B)                 # scale blocks per tile
    offsets = [shard_offset(i) for _, _, i in items]
    bf16 = p0.dtype == torch.bfloat16
    p_corr = bf16 and "param_correction" in items[0][1]
    v_coord, v_rule = cfg["v_rounding"].split("-")
    sr = "sr" in (m_rounding, v_rule) or bool(cfg["eden"]) or cfg.get("param_rounding") == "sr"
    m_lut, v_lut = tabs[f"m_lut_{m_rounding}"], tabs["v_lut"]
    return prepare(adamw4bit_kernel, items, cache, B, nb * KERNEL_TILES, (
        tabs["m_decode"], tabs["v_decode"], tabs["v_codebook"], m_lut, v_lut, (m_lut.numel() - 1) / 2,
        (v_lut.numel() - 1) / 2, tabs["m_adjacent"], tabs["v_adjacent"]), dict(
        M_SR=m_rounding == "sr", V_SR=v_rule == "sr", V_UPDATE=v_coord == "update", EDEN=bool(cfg["eden"]),
        HAS_U=u is not None, SHARDED=any(offsets), PAIRED=all(o // B % (2 * nb) == 0 for o in offsets),
        P_KIND=DTYPE_KIND[p0.dtype], G_KIND=DTYPE_KIND[p0.grad.dtype],
        P_SR=bf16 and not p_corr and cfg.get("param_rounding", "rtn") == "sr", P_CORR=p_corr, ALIGNED=True,
        BLOCK_SIZE=B, NB=nb, TILES=KERNEL_TILES, num_warps=1), u, own_table,
        KERNEL_MAXNREG[sr] if KERNEL_MAXNREG else None)
