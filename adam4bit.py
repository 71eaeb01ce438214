"""
AdamW with 4-bit optimizer states (paper B): ZIP-SR and ZE-EDEN, the TorchAO-style baseline and
plain FP32 AdamW in one torch.optim.Optimizer, `AdamW4bit`.

The file reads top to bottom: the math (below), the block quantizer, the reference step in plain
PyTorch, the optimizer class, then the fused Triton kernel that does the same step, its helpers,
its tables and its wrapper. The reference step and the kernel use the same names and mark the
same lines with the tags below ("eq. 2.1a" etc.: the paper section or definition they come from).

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

Presets (paper B, Table 2), the `preset` argument of AdamW4bit:
  "fp32"     plain AdamW, FP32 states
  "torchao"  m: SDyn4 State-RTN                v: Lin4-NZ State-RTN
  "zeeden"   m: NF4 RTN (LM head SR at 90 %)    v: Dyn4-NZ State-RTN + EDEN
  "zipsr"    m: NF4 RTN (LM head SR at 90 %)    v: Dyn4 Update-SR
Each component can be overridden (m_codebook, m_rounding, v_codebook, v_rounding, eden,
lm_head_sr_after), one row of paper B Table 3 per call.

Parameters may be FP32 (the master weights), or BF16 / FP16 (the math runs in FP32 and the new
weight w_t is written back in the parameter's dtype). The BF16 write, `param_rounding`:
  "rtn"   round to nearest even (what a cast does);
  "sr"    stochastic rounding: with u ~ U[0, 1) and k = floor(u 2^16), add k to the FP32 bit
          pattern of w_t and keep its top 16 bits (round away from zero with probability equal
          to the dropped fraction of a BF16 ulp: E[bf16(w_t)] = w_t);
and `master_weight_bits=24` keeps one int8 correction e per BF16 weight x, so that the master
weight has 16 significant bits (8 exponent + 16 = 24 bits with x):
  [MW]    w = x + e 2^(E-15),  E = max(exponent of x, -111),  e in [-127, 127];
          written as x = RTN_bf16(w_t), e = clamp(round_half_even((w_t - x) 2^(15-E)), -127, 127)
(2^(E-15) is 1/256 of x's BF16 ulp and |w_t - x| <= ulp/2, so the master weight is w_t within
half a unit, or within one unit for the 1/256 of residuals clamped from +-128 to +-127;
x + e 2^(E-15) is exact in FP32). The step reads w = x + e 2^(E-15) instead of x.

impl="torch" runs the reference step (adamw4bit_step_torch), impl="triton" the fused kernel
(adamw4bit_step_triton; CUDA, or CPU with TRITON_INTERPRET=1), impl="auto" the kernel on CUDA
tensors and the reference otherwise. Both give the same bits given the same SR uniforms.
"""
import math
import os

import torch
import triton
import triton.language as tl

from codebooks import get_codebook
from philox import philox

try:                       # FSDP2 parameters are DTensors; builds without torch.distributed have none
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:
    DTensor = None

# ============================================================================================
# The block quantizer (reference): Def. 3, Appendix A.2, eq. 3.2

ROUNDINGS = ("rtn", "sr")
COORDS = ("state", "update")


def sqrt_rn(x):
    """Correctly rounded sqrt of a float tensor, same shape and dtype (torch's vectorized CPU
    sqrt may be off by one ulp); the float64 detour rounds correctly, so the reference and the
    kernel's tl.sqrt_rn agree bit for bit."""
    return x.double().sqrt().to(x.dtype)


def _f32(x):
    return torch.tensor(x, dtype=torch.float32).item()


def _denominator(v, bias_correction2, eps, sqrt_v=None):
    # eq. 3.1: r_t(v) = sqrt(v) / sqrt(1 - b2^t) + eps, the AdamW denominator, and h_t = 1 / r_t;
    # written with the float32 reciprocal of sqrt(bc2) (a multiply, not a division). The 4-bit
    # step and the quantizer's preconditioner coordinate share this one expression, so the
    # kernel computes r_t(v~) once for both.
    sqrt_v = sqrt_rn(v) if sqrt_v is None else sqrt_v
    return sqrt_v * _f32(1 / math.sqrt(bias_correction2)) + eps


def preconditioner(v, bias_correction2, eps):
    """h_t(v) = 1 / (sqrt(v / (1 - b2^t)) + eps) (paper B, Sec. 3.1; eq. 3.1 here), elementwise.

    v: float32 tensor (>= 0), any shape; bias_correction2 = 1 - b2^t; returns float32 like v."""
    return 1.0 / _denominator(v, bias_correction2, eps)


def round_to_levels(x, levels, rule="rtn", coord="state", bias_correction2=1.0, eps=1e-8, u=None,
                    r_x=None, r_scale=None):
    """Round each x to one of its two adjacent levels (paper B, Appendix A.2; eq. A.2 here);
    return int64 codes (level indices) shaped like x.

    x:      float tensor (..., n), in the units of `levels` (quantize_blockwise passes y = x (1/s)).
    levels: 1-D float tensor (K,) sorted ascending, K >= 2, same dtype as x.
    rule:   "rtn" or "sr" (Def. 5); coord: "state" (phi(v) = v) or "update"
            (phi = h_t, nonnegative levels only).
    u:      uniforms in [0, 1) shaped like x, required for rule="sr".
    r_x, r_scale: update coordinate only. r_x = r_t of the unnormalized value (default r_t(x)),
            and a level's r_t is r_scale * sqrt(level) + eps (default r_scale = 1/sqrt(bc2));
            quantize_blockwise passes r_scale = sqrt(s)/sqrt(bc2) per block, so r_t(s T[k]) needs
            one table read of sqrt(T[k]), a multiply and an add.
    State-RTN is the nearest level, with y >= (a + b) / 2 (float midpoint) rounding up; the
    others compare p = num/den as in the module docstring. Values outside [levels[0], levels[-1]]
    saturate. Arguments are not checked here (quantize_blockwise checks them).
    """
    K = levels.numel()
    if rule == "rtn" and coord == "state":
        return torch.searchsorted(_midpoints(levels), x.contiguous(), right=True)   # #{midpoints <= x}
    lo = torch.searchsorted(levels[1:K - 1], x.contiguous(), right=True)  # max{k <= K-2: level <= x}
    a, b = levels[lo], levels[lo + 1]
    # p = (phi(b) - phi(x)) / (phi(b) - phi(a)) = num / den, den > 0 inside the cell; decided
    # without a division: RTN takes a iff 2 num > den, SR iff u den < num. For phi = h = 1/r:
    # p = (1/rb - 1/rx) / (1/rb - 1/ra) = (rb - rx) ra / ((rb - ra) rx).
    if coord == "update":
        if r_scale is None:
            r_scale = _f32(1 / math.sqrt(bias_correction2))
        ra = r_scale * sqrt_rn(a) + eps
        rb = r_scale * sqrt_rn(b) + eps
        rx = _denominator(x, bias_correction2, eps) if r_x is None else r_x
        num, den = (rb - rx) * ra, (rb - ra) * rx
    else:
        num, den = b - x, b - a
    take_a = 2 * num > den if rule == "rtn" else u * den < num
    return torch.where(take_a, lo, lo + 1)


def _midpoints(levels):
    """Float midpoints (a + b) / 2 of adjacent levels: State-RTN's boundaries (reference and kernel)."""
    return (levels[:-1] + levels[1:]) / 2


def pack_nibbles(codes):
    """(N,) integer codes in [0, 16) -> (N/2,) uint8; element 2i in the low nibble, 2i+1 high
    (Def. 3: two codes per byte). N must be even."""
    c = codes.to(torch.uint8).view(-1, 2)
    return c[:, 0] | (c[:, 1] << 4)


def unpack_nibbles(packed):
    """(N/2,) uint8 -> (N,) int64 codes; inverse of pack_nibbles."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(-1).long()


def _check_block_size(block_size):
    if not isinstance(block_size, int) or block_size < 2 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 2, got {block_size!r}")


def _check_quant_args(x, block_size, rule, coord, T, bias_correction2=1.0):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a real floating-point tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not 0 < bias_correction2 <= 1:
        raise ValueError(f"bias_correction2 = 1 - b2^t must be in (0, 1], got {bias_correction2}")
    _check_block_size(block_size)
    if x.numel() % block_size:
        raise ValueError(f"x.numel()={x.numel()} must be a multiple of block_size={block_size}")
    if rule not in ROUNDINGS:
        raise ValueError(f"rule must be one of {ROUNDINGS}, got {rule!r}")
    if coord not in COORDS:
        raise ValueError(f"coord must be one of {COORDS}, got {coord!r}")
    if coord == "update" and T[0] < 0:
        raise ValueError("coord='update' (preconditioner space) needs a nonnegative codebook, "
                         f"got min level {T[0].item()}")


def quantize_blockwise(x, codebook, block_size=128, rule="rtn", coord="state",
                       bias_correction2=1.0, eps=1e-8, eden=False, u=None, generator=None):
    """Block-quantize a tensor to packed 4-bit codes and FP32 scales (paper B, Def. 3, App. A.2;
    eq. D3, A.2 and, with eden=True, 3.2 here).

    x:        float tensor, any shape, numel a multiple of block_size; read as flat float32.
    codebook: name in codebooks.CODEBOOKS or a 1-D level tensor (normalized, sorted).
    rule/coord: "rtn"|"sr" and "state"|"update"; coord="update" rounds in h_t space with
              bias_correction2 = 1 - b2^t of the step being stored, and eps of AdamW.
    eden:     EDEN calibration (paper B, Sec. 3.2): stored scale = c_tau * s with
              c_tau = ||y||² / max(<y, T[code]>, tau), y = x (1/s), tau = 1e-12 (the normalized form,
              sums in float64); an all-zero block gets c_tau = 0 and decodes to zero.
    u:        optional float32 uniforms in [0, 1) shaped like x for rule="sr" (else drawn with
              torch.rand(generator=generator) in float32, whatever torch's default dtype).
    Returns (packed uint8 (numel/2,), scales float32 (numel/block_size,)).
    Raises TypeError for a non-float x; ValueError on a bad block_size, rule, coord, codebook,
    bias_correction2 or u, a non-divisible numel, or negative x with coord="update".
    """
    T = get_codebook(codebook).to(x.device)
    _check_quant_args(x, block_size, rule, coord, T, bias_correction2)
    xb = x.detach().reshape(-1, block_size).float()
    if coord == "update" and bool((xb < 0).any()):
        raise ValueError("coord='update' rounds second moments: x must be nonnegative")
    s = xb.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)       # eq. D3
    y = xb * (1 / s)                 # normalized to [-1, 1]: one reciprocal per block
    if rule == "sr" and u is None:
        # float32 whatever the default dtype: bfloat16 draws take ~1700 values and bias SR
        u = torch.rand(xb.shape, dtype=torch.float32, device=xb.device, generator=generator)
    if rule == "sr":
        if u.numel() != xb.numel():
            raise ValueError(f"u must have one uniform per element of x ({xb.numel()}), got {u.numel()}")
        u = u.reshape(xb.shape)
    r_x = r_scale = None
    if coord == "update":
        r_x = _denominator(xb, bias_correction2, eps)
        r_scale = sqrt_rn(s) * _f32(1 / math.sqrt(bias_correction2))
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
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError(f"packed must be a uint8 tensor, got {getattr(packed, 'dtype', type(packed).__name__)}")
    _check_block_size(block_size)
    T = get_codebook(codebook).to(packed.device)
    if packed.numel() * 2 != scales.numel() * block_size:
        raise ValueError(f"packed ({packed.numel()} bytes) and scales ({scales.numel()}) do not "
                         f"describe the same tensor with block_size={block_size}")
    codes = unpack_nibbles(packed.reshape(-1))
    return (scales[:, None] * T[codes].view(-1, block_size)).view(-1)


# quantization-error diagnostics (paper B, Sec. 4 and Appendix C)

def radial_bias(m, m_q):
    """Radial bias b_rad = <Q(m) - m, m> / ||m||² (paper B, Sec. 4); negative = inward.
    m, m_q: float tensors of one shape (a moment and its decoded quantization). Returns a float."""
    m, m_q = m.double().flatten(), m_q.double().flatten()
    return ((m_q - m) @ m / (m @ m)).item()


def relative_rms_error(x, x_q):
    """Relative RMS quantization error ||Q(x) - x|| / ||x|| (paper B, Appendix C.4).
    x, x_q: float tensors of one shape. Returns a float."""
    x, x_q = x.double().flatten(), x_q.double().flatten()
    return ((x_q - x).norm() / x.norm()).item()


def nonzero_to_zero_fraction(x, x_q):
    """Fraction of nonzero entries of x written as zero by Q (paper B, Appendix C.4).
    x, x_q: tensors of one shape. Returns a float in [0, 1] (0 if x has no nonzero entry)."""
    nz = x != 0
    return ((x_q == 0) & nz).sum().item() / max(nz.sum().item(), 1)


def update_relative_error(u_q, u_32):
    """One-step relative update error ||u_4bit - u_32|| / ||u_32|| (paper B, Appendix C.3).
    u_q, u_32: float tensors of one shape (4-bit and FP32 updates). Returns a float."""
    return relative_rms_error(u_32, u_q)


# ============================================================================================
# The parameter write (reference): BF16 RTN / SR and the 24-bit master weight, eq. MW

PARAM_ROUNDINGS = ("rtn", "sr")
MASTER_WEIGHT_BITS = (None, 24)


def _bf16_bits_rtn(bits):
    # round-to-nearest-even of float32 bit patterns (int32) to BF16, the result's bits in the top
    # half: add 0x7FFF plus the lowest kept bit, clear the low half (a NaN is kept as it is)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return torch.where((bits & 0x7FFFFFFF) > 0x7F800000, bits & -65536 | 0x400000, r)


def round_to_bf16(w, rule="rtn", u=None):
    """Round float32 w to bfloat16 (module docstring: "rtn" = round to nearest even, "sr" =
    stochastic rounding from uniforms u, k = floor(u 2^16) added to the dropped 16 bits).

    w: float32 tensor, any shape; u: float32 uniforms in [0, 1) shaped like w (rule="sr").
    Returns a bfloat16 tensor shaped like w (NaN stays NaN). SR is unbiased: E[result] = w for
    finite w below the largest BF16 value. Raises ValueError on an unknown rule or missing u."""
    if rule not in PARAM_ROUNDINGS:
        raise ValueError(f"rule must be one of {PARAM_ROUNDINGS}, got {rule!r}")
    bits = w.float().contiguous().view(torch.int32)
    if rule == "rtn":
        out = _bf16_bits_rtn(bits)
    else:
        if u is None or u.shape != w.shape:
            raise ValueError(f"rule='sr' needs uniforms u shaped like w {tuple(w.shape)}, got "
                             f"{None if u is None else tuple(u.shape)}")
        k = (u.float() * 65536).to(torch.int32)          # floor: u >= 0
        out = torch.where(w != w, _bf16_bits_rtn(bits), (bits + k) & -65536)
    return (out >> 16).to(torch.int16).view(torch.bfloat16)


def _correction_unit(x):
    # eq. MW: 2^(E-15) and 2^(15-E) for BF16 values x (as float32), from x's exponent field,
    # raised to 16 (E >= -111) so that both are normal float32 numbers
    e = ((x.float().view(torch.int32) >> 23) & 0xFF).clamp(min=16)
    return ((e - 15) << 23).view(torch.float32), ((269 - e) << 23).view(torch.float32)


def split_master(w):
    """The 24-bit master weight of eq. MW from float32 w: (x, e) with x = RTN_bf16(w) (bfloat16,
    w's shape) and e = clamp(round_half_even((w - x) 2^(15-E)), -127, 127) (int8, w's shape);
    e = 0 where w is NaN or infinite."""
    x = round_to_bf16(w)
    xf = x.float()
    _, inv_unit = _correction_unit(xf)
    y = (w.float() - xf) * inv_unit                  # exact: a power-of-two multiple
    y = torch.where(y == y, y, torch.zeros_like(y))
    return x, torch.round(y).clamp(-127, 127).to(torch.int8)


def join_master(x, e):
    """Inverse of split_master: float32 w = x + e 2^(E-15) (eq. MW), exact; x bfloat16, e int8
    of one shape."""
    xf = x.float()
    unit, _ = _correction_unit(xf)
    return xf + e.float() * unit


def write_param(param, w, rule="rtn", correction=None, u=None):
    """Write float32 w (param's numel) into param in place: FP32 as is, FP16 rounded to nearest,
    BF16 by `rule` (round_to_bf16), or, with `correction` (int8 like param), as the 24-bit
    master weight of eq. MW (x into param, e into correction; RTN)."""
    w = w.reshape(param.shape)
    if param.dtype != torch.bfloat16:
        param.copy_(w)
    elif correction is not None:
        x, e = split_master(w)
        param.copy_(x)
        correction.copy_(e.view_as(correction))
    else:
        param.copy_(round_to_bf16(w, rule, None if u is None else u.view(w.shape)))


def read_param(param, correction=None):
    """The float32 weight the step starts from: param, or join_master(param, correction)."""
    if correction is None:
        return param.detach().float()
    return join_master(param.detach(), correction.view_as(param))


# ============================================================================================
# The reference step (plain PyTorch): eq. 2.1a-b, then Def. 3 / App. A.2 / eq. 3.2 storage

def adamw4bit_step_torch(param, grad, state, lr, b1, b2, eps, wd, t, cfg, m_rounding, seed, u=None):
    """One AdamW step of one 4-bit-state tensor in plain PyTorch (paper B, Sec. 2.1: eq. 2.1a-b,
    storage by Def. 3 / App. A.2, EDEN eq. 3.2): the specification adamw4bit_step_triton matches
    bit for bit. Runs under torch.no_grad() (AdamW4bit.step's).

    param:  float32, bfloat16 or float16 tensor, updated in place (math in float32, written back
            by write_param); numel a multiple of cfg["block_size"]. grad: float32, bfloat16 or
            float16, param's shape.
    state:  dict holding exp_avg, exp_avg_sq (packed codes, uint8 (numel/2,)) and exp_avg_scale,
            exp_avg_sq_scale (float32 (numel/block_size,)); replaced by the stored new moments.
            With a "param_correction" entry (int8, param's shape; BF16 param) the weight is the
            24-bit master weight of eq. MW, read and written through it.
    lr, b1, b2, eps, wd: AdamW's (floats); t: this step's number (>= 1, bias corrections).
    cfg:    the configuration (AdamW4bit.qcfg: m_codebook, v_codebook, v_rounding, eden,
            block_size, param_rounding). m_rounding: "rtn"|"sr", the first moment's rule this step.
    seed:   seeds the generator of the SR uniforms (m's first, then v's, then the BF16 write's);
            u: optional tuple of float32 tensors (u_m, u_v[, u_p]), numel each, replacing them
            (kernel tests).
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
    w = w * decay - step_size * m / _denominator(v, bc2, eps)       # eq. 3.1: r_t(v~)
    # eq. D3 + A.2: store both moments; v in its coordinate (eq. 3.1 for Update-*) and with
    # EDEN (eq. 3.2)
    gen = torch.Generator(device=param.device).manual_seed(seed)
    u_m, u_v, u_p = (tuple(u) + (None,))[:3] if u is not None else (None, None, None)
    v_coord, v_rule = cfg["v_rounding"].split("-")
    state["exp_avg"], state["exp_avg_scale"] = quantize_blockwise(
        m, cfg["m_codebook"], B, m_rounding, "state", u=u_m, generator=gen)
    state["exp_avg_sq"], state["exp_avg_sq_scale"] = quantize_blockwise(
        v, cfg["v_codebook"], B, v_rule, v_coord, bc2, eps, cfg["eden"], u=u_v, generator=gen)
    _write_step(param, w, corr, cfg.get("param_rounding", "rtn"), u_p, gen)


def _write_step(param, w, corr, rule, u_p, gen):
    # the step's parameter write (write_param); the BF16 SR uniforms come after m's and v's
    if rule == "sr" and param.dtype == torch.bfloat16 and corr is None and u_p is None:
        u_p = torch.rand(w.shape, dtype=torch.float32, device=w.device, generator=gen)
    write_param(param, w, rule, corr, u_p)


# SR seeds: the bits of step t depend only on (seed, t, parameter index)

_SEED_MOD = 2 ** 31 - 1


def _seed_of_step(seed, t):
    return (seed * 1_000_003 + t * 65_537) % _SEED_MOD


def _seed_of_index(index):
    # the parameter's term of _sr_seed (the kernel's launch table holds it per tensor)
    return index * 257 % _SEED_MOD


_BIAS_ROWS_MAX = 1 << 22


def _bias_table(b1, b2, wd):
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
        if t >= _BIAS_ROWS_MAX:
            raise ValueError(f"capturable=True: betas {(b1, b2)} are too close to 1 for its bias-correction "
                             f"table (1 - beta^t reaches 1 after more than {_BIAS_ROWS_MAX} steps)")


def _sr_seed(seed, t, index):
    # Independent SR bits per (seed, step, parameter); 31 bits so both torch and Triton take
    # it. The kernel adds the two terms itself (its launch table is then the same each step).
    return (_seed_of_step(seed, t) + _seed_of_index(index)) % _SEED_MOD


_FUSED_ADAMW_DEVICES = ("cuda",)   # where _adamw_fp32_steps calls torch's fused AdamW


def adamw_step_torch(param, grad, state, lr, b1, b2, eps, wd, t, rule="rtn", seed=0, u_p=None):
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
            (float32, param's numel) replaces them (kernel tests).
    """
    m, v = state["exp_avg"], state["exp_avg_sq"]
    g = grad.float()
    # eq. 2.1a with FP32 storage
    m.mul_(b1).add_(g * (1 - b1))
    v.mul_(b2).add_(g * g * (1 - b2))
    # eq. 2.1b; eq. 3.1's r_t(v)
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    corr = state.get("param_correction")
    w = read_param(param, corr) * (1 - lr * wd) - (lr / bc1) * m / _denominator(v, bc2, eps)
    gen = None
    if rule == "sr" and param.dtype == torch.bfloat16 and corr is None and u_p is None:
        gen = torch.Generator(device=param.device).manual_seed(seed)
    _write_step(param, w, corr, rule, u_p, gen)


def _adamw_fp32_steps(items, lr, b1, b2, eps, wd, rule="rtn", seeds=None):
    """AdamW on FP32 states for (param, state, t) items: FP32 parameters on CUDA through torch's
    fused AdamW kernel (one launch per step value), the rest through adamw_step_torch (rule:
    param_rounding; seeds: each item's SR seed). AdamW4bit.step sends 16-bit parameters to the
    kernel (adamw_step_triton) where it applies."""
    fused, by_t = items and items[0][0].device.type in _FUSED_ADAMW_DEVICES, {}
    for i, (p, st, t) in enumerate(items):
        if fused and p.dtype == torch.float32:
            by_t.setdefault(t, []).append((p, st))
        else:
            adamw_step_torch(p, p.grad, st, lr, b1, b2, eps, wd, t, rule, seeds[i] if seeds else 0)
    for t, its in by_t.items():
        _fused_fp32_group(_fused_fp32_args(its), t, lr, b1, b2, eps, wd)


def _fused_fp32_args(its, lr=None):
    # the step-independent lists of _fused_fp32_group for (param, state) pairs of FP32 parameters
    # of one device and step: the parameters and their moments shaped like them
    # (and whether a gradient needs a cast: a replayed plan keeps the gradients' dtypes);
    # capturable (lr: the device lr tensor): the states' device step counters and lr
    ps = [p for p, _ in its]
    return dict(ps=ps, ms=[st["exp_avg"].view_as(p) for p, st in its],
                vs=[st["exp_avg_sq"].view_as(p) for p, st in its],
                cast=any(p.grad.dtype != torch.float32 for p in ps),
                lr=lr, steps=[st["step"] for _, st in its] if lr is not None else None)


def _fused_fp32_group(a, t, lr, b1, b2, eps, wd):
    # torch's fused AdamW on one _fused_fp32_args group at step t
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
# these tensors keep the memory of an unsharded optimizer. SR bits: each local shard draws its own
# stream (its seed index moves with its global block offset), the same bits as the unsharded run
# only on the shard at offset 0, so SR runs agree with 1 rank in distribution, not bit for bit.
# With one rank the shard is the whole tensor: nothing is gathered. A parameter stepped on its
# local tensor (all but the gathered ones) keeps one alias of it, the same object every step, so
# step() records and replays its plan as for plain tensors: each step only points the aliases'
# .grad at the gradients' local tensors (_local_params), which FSDP2 allocates anew each step.

_SHARD_SEED_STRIDE = 4099      # seed-index step per block of global offset (a prime, so shards
                               # of one tensor and other parameters' indices rarely meet)


def _is_dtensor(x):
    return DTensor is not None and isinstance(x, DTensor)


def _block_rows(p, block_size):
    """True if p's rows are whole blocks: >= 2 dims and numel / size(0) a multiple of block_size."""
    return p.dim() >= 2 and p.shape[0] > 0 and (p.numel() // p.shape[0]) % block_size == 0


def _rows_of_blocks(p, block_size):
    """True if every shard of DTensor p is whole rows of whole blocks: _block_rows, and all
    placements Shard(0) or Replicate."""
    return _block_rows(p, block_size) and all(pl.is_replicate() or pl.is_shard(0) for pl in p.placements)


_PACKED = ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")


def _per_row(p, st, block_size):
    """A plain tensor p's 4-bit states (st) as state_dict() gives them when p's rows are whole
    blocks: (rows, row_numel / 2) codes and (rows, row_numel / block_size) scales, views of the
    flat tensors the step uses. FSDP2 keeps these states in that layout (sharded by rows), so a
    checkpoint has one layout and DCP moves it between unwrapped and fully_shard models."""
    if _is_dtensor(p) or "exp_avg_scale" not in st or st["exp_avg"].dim() != 1 or not _block_rows(p, block_size):
        return st
    return dict(st, **{k: st[k].view(p.shape[0], -1) for k in _PACKED})


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
    """(gathered, seed-index offset, (local shape, global offset)) of DTensor p: fixed for a
    parameter, so AdamW4bit caches it (the offset computation costs ~50 us)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    box = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    gathered = quantized and not _rows_of_blocks(p, block_size) and p.device_mesh.size() > 1
    first_block = box[1][0] * (p.numel() // max(p.shape[0], 1)) // block_size if quantized else 0
    return gathered, 0 if gathered else first_block * _SHARD_SEED_STRIDE, box


def _local_step_view(p, st, quantized, layout, views):
    """What the step works on for a DTensor parameter p (module comment above), given its
    _shard_layout: (param, state, gathered). param: a plain tensor aliasing p's local shard,
    with .grad the local gradient, kept in `views` (id(p) -> (p's local tensor, alias)) and
    reused while p keeps its local tensor; or, gathered, the all-gathered tensor (a collective:
    every rank calls it in the same order). state: plain tensors aliasing st's local states,
    flat for the quantized ones (the step's layout). The caller copies replaced states and a
    gathered param's shard back with _write_back."""
    gathered = layout[0]
    if gathered:
        lp = p.full_tensor()
        lp.grad = p.grad.full_tensor()
    else:
        view = views.get(id(p))
        if view is None or view[0] is not p._local_tensor:
            view = views[id(p)] = (p._local_tensor, p.to_local().detach())   # the step writes p's shard
        lp = view[1]
        lp.grad = p.grad.to_local()
    local = {k: (v.to_local().view(-1) if quantized else v.to_local()) if torch.is_tensor(v) else v
             for k, v in st.items()}
    return lp, local, gathered


def _write_back(p, st, lp, local, gathered, box):
    """After the step on _local_step_view's (lp, local): copy the states that the step replaced
    (the reference step stores new tensors) into st's local tensors, and a gathered param's own
    shard (box: its local shape and global offset) into p."""
    for k, v in local.items():
        dst = st[k].to_local().view(-1) if torch.is_tensor(v) else None
        if dst is not None and v.data_ptr() != dst.data_ptr():
            dst.copy_(v.reshape(-1))
    if gathered:
        shape, offset = box
        p.to_local().copy_(lp[tuple(slice(o, o + n) for o, n in zip(offset, shape))])


def _local_params(params, grads, views):
    """FSDP2: the parameters and gradients that step()'s plan key and replay see. Every DTensor
    parameter with a local alias in `views` (_local_step_view) becomes its local tensor and its
    gradient the gradient's local tensor, which also becomes the alias's .grad (a recorded plan
    reads the gradients there); the gathered ones stay DTensors, and _plan_key gives them no
    plan. DTensor._local_tensor, not to_local(): ~0.1 us instead of ~1 us a call."""
    params, grads = list(params), list(grads)
    for i, p in enumerate(params):
        view = views.get(id(p))
        if view is not None:
            g = grads[i]
            params[i] = p._local_tensor
            grads[i] = view[1].grad = None if g is None else g._local_tensor
    return params, grads


def _drop_local_grads(views):
    # after a step: no reference to FSDP2's gradients outlives zero_grad (their memory is reused)
    for _, lp in views.values():
        lp.grad = None


# ============================================================================================
# The optimizer

# Paper B, Table 2. m is always rounded in state space; v's rounding names "coord-rule".
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
V_ROUNDINGS = ("state-rtn", "state-sr", "update-rtn", "update-sr")
IMPLS = ("auto", "torch", "triton")
MIN_QUANT_NUMEL = 4096  # paper B eligibility: numel >= 4096 and numel % block_size == 0


def _layout_key(params, grads):
    # what a recorded step plan assumes of each parameter and gradient beyond their addresses
    return tuple([None if g is None else (p.dtype, p.is_contiguous(), g.dtype,
                                          g.layout is torch.strided and g.is_contiguous())
                  for p, g in zip(params, grads)])


def _group_hparams(group):
    # (lr, b1, b2, eps, wd) of a param group for this step; lr may be a 0-d tensor (schedulers)
    lr = group["lr"]
    return (float(lr.item()) if torch.is_tensor(lr) else float(lr), *group["betas"], group["eps"],
            group["weight_decay"])


def _check_hparams(h, where):
    """ValueError/TypeError naming the hyperparameter, its value and the allowed range."""
    lr, betas, eps, wd = h["lr"], h["betas"], h["eps"], h["weight_decay"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{where}lr tensor must have one element, got shape {tuple(lr.shape)}")
        lr = lr.item()
    for name, v in (("lr", lr), ("eps", eps), ("weight_decay", wd)):
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise TypeError(f"{where}{name} must be a number, got {v!r}")
    if not (0 <= lr < math.inf):
        raise ValueError(f"{where}lr must be finite and >= 0, got {lr}")
    if not (0 < eps < math.inf):
        raise ValueError(f"{where}eps must be finite and > 0, got {eps}")
    if not (0 <= wd < math.inf):
        raise ValueError(f"{where}weight_decay must be finite and >= 0, got {wd}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2
            and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"{where}betas must be two numbers in [0, 1), got {betas!r}")


def _lr_on_device(lr):
    """A one-element lr tensor off the CPU: reading its value would wait for the device."""
    return torch.is_tensor(lr) and lr.device.type != "cpu" and lr.numel() == 1


def _hparams_key(group):
    """What `_check_hparams` looks at in a group, comparable without waiting for the device: a
    CPU lr tensor by its value (also changed in place), a device one by its identity."""
    lr, betas = group["lr"], group["betas"]
    if torch.is_tensor(lr):
        lr = (id(lr), None if _lr_on_device(lr) or lr.numel() != 1 else lr.item())
    return lr, tuple(betas) if isinstance(betas, (tuple, list)) else betas, group["eps"], group["weight_decay"]


def _quantizer_config(preset, block_size, m_codebook, m_rounding, v_codebook, v_rounding, eden,
                      lm_head_sr_after):
    """The preset's components with the given overrides (None keeps the preset's; for
    lm_head_sr_after the marker "preset" does), checked: AdamW4bit.qcfg."""
    if eden is not None and not isinstance(eden, bool):
        raise TypeError(f"eden must be True, False or None (the preset's), got {eden!r}")
    cfg = dict(PRESETS[preset])
    for k, v in dict(m_codebook=m_codebook, m_rounding=m_rounding, v_codebook=v_codebook,
                     v_rounding=v_rounding, eden=eden).items():
        if v is not None:
            cfg[k] = v
    if lm_head_sr_after != "preset":
        cfg["lm_head_sr_after"] = lm_head_sr_after
    quantized = cfg["m_codebook"] is not None
    if quantized or any(x is not None for x in (m_codebook, v_codebook, m_rounding, v_rounding)):
        for k in ("m_codebook", "v_codebook"):
            if cfg[k] is None:
                raise ValueError(f"{k} must be set when the other moment is quantized "
                                 f"(preset {preset!r})")
            try:
                get_codebook(cfg[k])  # validates the name / levels
            except (ValueError, TypeError) as e:
                raise type(e)(f"{k}: {e}") from None
        if cfg["m_rounding"] not in ROUNDINGS:
            raise ValueError(f"m_rounding must be one of {ROUNDINGS}, got {cfg['m_rounding']!r}")
        if cfg["v_rounding"] not in V_ROUNDINGS:
            raise ValueError(f"v_rounding must be one of {V_ROUNDINGS}, got {cfg['v_rounding']!r}")
        if cfg["v_rounding"].startswith("update") and get_codebook(cfg["v_codebook"])[0] < 0:
            raise ValueError(f"v_rounding={cfg['v_rounding']!r} needs a nonnegative v_codebook, "
                             f"got {cfg['v_codebook']!r}")
    if not quantized and cfg["eden"]:
        raise ValueError("eden=True needs quantized moments; preset 'fp32' keeps FP32 states")
    sr_after = cfg["lm_head_sr_after"]
    if sr_after is not None and not (isinstance(sr_after, (int, float)) and 0.0 <= sr_after <= 1.0):
        raise ValueError(f"lm_head_sr_after must be None or a number in [0, 1], got {sr_after!r}")
    cfg.update(preset=preset, block_size=block_size)
    return cfg


class AdamW4bit(torch.optim.Optimizer):
    """AdamW with block-quantized 4-bit moments (paper B, Sec. 2.1, Def. 3, Table 2).

    params:       iterable of tensors or param-group dicts (per-group lr, betas, eps,
                  weight_decay, quantize). Parameters are FP32 master weights, or BF16 / FP16
                  weights: the math runs in FP32 and the result is written back (param_rounding).
                  A group with quantize=False keeps FP32 states for all its tensors (e.g.
                  embeddings and the LM head, as bitsandbytes' GlobalOptimManager does); the
                  option is saved in state_dict(), so a resumed run keeps the policy.
    lr:           float or 0-d tensor (works with torch.optim.lr_scheduler).
    betas, eps, weight_decay: AdamW's; weight decay is decoupled: w <- (1 - lr wd) w.
    preset:       "fp32" (plain AdamW, FP32 states), "torchao" (SDyn4 State-RTN m, Lin4-NZ
                  State-RTN v), "zeeden" (NF4 RTN m, Dyn4-NZ State-RTN v + EDEN), "zipsr"
                  (NF4 RTN m, Dyn4 Update-SR v) -- paper B Table 2.
    Component overrides (each row of paper B Table 3 is one call), None keeps the preset's:
      m_codebook, v_codebook: codebook names (codebooks.CODEBOOKS);
      m_rounding: "rtn"|"sr"; v_rounding: "state-rtn"|"state-sr"|"update-rtn"|"update-sr";
      eden: EDEN calibration of v blocks (Sec. 3.2);
      lm_head_sr_after: progress fraction after which the parameters passed to mark_lm_head()
        store their first moment with SR instead of RTN (0.9 for zipsr/zeeden; None = never).
    block_size:   elements per scale block (power of two, default 128). A moment is quantized
                  iff numel >= 4096 and numel % block_size == 0 and its group does not set
                  quantize=False; others keep FP32 states.
    impl:         "torch" (reference), "triton" (fused kernel, CUDA or TRITON_INTERPRET=1), or
                  "auto" (triton on CUDA tensors, torch otherwise). A custom codebook whose levels
                  (or level midpoints) are closer than the kernel's buckets (~0.004) runs on the
                  reference under "auto" and is a ValueError under "triton".
    seed:         seeds the SR random bits; bits of step t depend only on (seed, t, parameter
                  index), so a resumed run draws the same bits.
    param_rounding: how BF16 parameters are written (module docstring): "rtn" (round to nearest
                  even, a cast) or "sr" (stochastic rounding, unbiased; TorchAO's
                  bf16_stochastic_round). FP32 parameters are written exactly, FP16 ones RTN.
    master_weight_bits: None, or 24 (FlashOptim's name): each BF16 parameter gets an int8
                  state "param_correction", the rounding residual of eq. MW, so the weights the
                  step updates have 16 significant bits, not 8 (+1 B/param). RTN writes only.
                  A parameter cast to FP32/FP16 later (model.to) takes its 24-bit master weight
                  at its next step(); one cast to BF16 gets a zero correction there.
    capturable:   False, or True (as torch's optimizers' flag): the step counters are float32
                  tensors on the parameters' device and the kernels read t and lr from device
                  memory (the same float64 arithmetic as the host, _bias_table), so step() can
                  run inside a torch.cuda.graph capture: lr must then be a 0-d CUDA tensor you
                  update in place (lr.fill_(value)) and the gradients must stay where they were
                  at the last step() outside capture (else RuntimeError, saying which). Outside
                  a capture, on CUDA, step() replays its own launches as one CUDA graph (host
                  time ~0.1 ms per step; captured again when the gradients move). A float lr is
                  copied to the device each step. Not with FSDP2 (DTensor) parameters. betas
                  up to ~0.99999 (a float64 table of bias corrections per (betas, weight_decay),
                  rebuilt with the step's plan when they change, so a momentum schedule such as
                  OneCycleLR's is slow here). Same
                  results as False (bit for bit on the kernels; torch's fused AdamW of FP32-state
                  FP32 tensors takes lr as float32).

    State per quantized parameter: exp_avg / exp_avg_sq as packed uint8 (numel/2,) and
    exp_avg_scale / exp_avg_sq_scale as float32 (numel/block_size,); FP32 tensors otherwise;
    with master_weight_bits=24 also param_correction (int8, the parameter's shape; BF16 ones).
    FSDP2 (fully_shard) parameters: eligibility from the global tensor, each rank steps its
    shard, states are DTensors that DCP reshards (see "FSDP2 (DTensor) parameters" above).
    state["step"] is a Python float (as in torch.optim before 1.12): no tensor op per parameter
    and step; with capturable=True a float32 tensor (either kind loads into the other).
    A NaN or Inf gradient element poisons its whole block of block_size elements, where
    torch.optim.AdamW poisons only that element. At its step t only that parameter becomes NaN
    (the update uses the unquantized moments, like torch's AdamW), but the block's absmax, and so
    its stored scales, become NaN (a NaN gradient) or Inf (an Inf one; v's scale NaN with EDEN):
    from step t + 1 every moment of the block decodes to NaN or Inf and all block_size parameters
    of the block are NaN, for good; the other blocks stay finite. The reference and the kernel
    behave alike. Keeping it to the element would need a NaN-aware block max (an extra
    instruction per element in the kernel's inner loop) and a block scale other than the
    authors' absmax. With either optimizer a non-finite gradient needs the caller's check:
    train.py stops on a non-finite loss or gradient norm.
    Raises ValueError/TypeError for bad hyperparameters (also in param groups), unknown names,
    non-float parameters and mismatched state dicts; RuntimeError (as torch's AdamW) for sparse
    gradients.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 preset="zipsr", block_size=128, impl="auto", seed=0, *, m_codebook=None,
                 m_rounding=None, v_codebook=None, v_rounding=None, eden=None,
                 lm_head_sr_after="preset", param_rounding="rtn", master_weight_bits=None,
                 capturable=False):
        _check_hparams(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), "")
        if not isinstance(capturable, bool):
            raise TypeError(f"capturable must be a bool, got {capturable!r}")
        if not isinstance(param_rounding, str) or param_rounding not in PARAM_ROUNDINGS:
            raise ValueError(f"param_rounding must be one of {PARAM_ROUNDINGS}, got {param_rounding!r}")
        if master_weight_bits not in MASTER_WEIGHT_BITS or not isinstance(master_weight_bits, (int, type(None))) \
                or isinstance(master_weight_bits, bool):
            raise ValueError(f"master_weight_bits must be one of {MASTER_WEIGHT_BITS}, got "
                             f"{master_weight_bits!r}")
        if master_weight_bits == 24 and param_rounding == "sr":
            raise ValueError("master_weight_bits=24 keeps the rounding residual of a round-to-"
                             "nearest write: use param_rounding='rtn' with it, not 'sr'")
        if not isinstance(preset, str) or preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
        _check_block_size(block_size)
        if not isinstance(impl, str) or impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise TypeError(f"seed must be a nonnegative int, got {seed!r}")
        self.qcfg = cfg = _quantizer_config(preset, block_size, m_codebook, m_rounding, v_codebook,
                                            v_rounding, eden, lm_head_sr_after)
        cfg.update(param_rounding=param_rounding, master_weight_bits=master_weight_bits)
        self.impl = impl
        # the kernel's lookup tables (CPU; copied to each device at its first step). Their buckets
        # need levels >= ~0.004 apart (_bucket_lut); None: impl="torch", FP32 states, or a codebook
        # too dense for them under impl="auto" (the reference path)
        self._kernel_tabs = None
        if cfg["m_codebook"] is not None and impl != "torch":
            try:
                self._kernel_tabs = _kernel_tables(cfg)
            except ValueError as e:
                if impl == "triton":
                    raise ValueError(f"impl='triton': {e}; use impl='torch' for this codebook") from None
        self._kernel_cache = {}    # adamw4bit_step_triton's device tables and launch tables
        self._plan, self._plan_version = None, 0   # step()'s recorded plan and what voids it
        self._shard_layouts = {}   # id(DTensor parameter) -> _shard_layout
        self._local_views = {}     # id(DTensor parameter) -> (its local tensor, the step's alias)
        self.capturable = capturable
        self._device_bufs = {}     # capturable: lr buffers per group, _bias_table per (betas, wd)
        self.seed = int(seed)
        self.progress = 0.0
        self._lm_head = set()
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, quantize=True)
        self._checked = {}         # group index -> _hparams_key at its last check
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        """torch's add_param_group, then checks the group's hyperparameters (every group, also
        those given to the constructor) and that its parameters are float32, bfloat16 or float16
        (the step's math is float32: float64 would silently lose precision). A group that fails
        a check is not kept."""
        super().add_param_group(param_group)
        self._plan_version += 1
        try:
            self._check_new_group(self.param_groups[-1])
        except (TypeError, ValueError):
            self.param_groups.pop()
            self._checked.pop(len(self.param_groups), None)
            raise

    def _check_new_group(self, group):
        """add_param_group's checks of the group just appended."""
        self._check_group(len(self.param_groups) - 1, group)
        if not isinstance(group["quantize"], bool):
            raise TypeError(f"param group {len(self.param_groups) - 1}: quantize must be True (4-bit "
                            f"states where eligible) or False (FP32 states), got {group['quantize']!r}")
        for p in group["params"]:
            if p.dtype not in KERNEL_DTYPES:
                raise TypeError(f"AdamW4bit needs float32, bfloat16 or float16 parameters, got {p.dtype} "
                                f"of shape {tuple(p.shape)}")
            if p.dtype == torch.float16 and (self.qcfg["param_rounding"] == "sr"
                                             or self.qcfg["master_weight_bits"]):
                what = "param_rounding='sr'" if self.qcfg["param_rounding"] == "sr" else "master_weight_bits=24"
                raise TypeError(f"{what} is for bfloat16 parameters (float16 ones are written round-to-"
                                f"nearest); got float16 of shape {tuple(p.shape)}")

    # ---- trainer hooks ----------------------------------------------------------------------
    def mark_lm_head(self, param):
        """Mark `param` (a tensor in this optimizer) as the LM head: its first moment switches
        from RTN to SR once progress >= lm_head_sr_after (paper B, Sec. 4). ValueError if absent."""
        if not any(param is p for g in self.param_groups for p in g["params"]):
            raise ValueError("mark_lm_head: the tensor is not a parameter of this optimizer")
        self._lm_head.add(id(param))
        self._plan_version += 1

    def set_progress(self, fraction):
        """Tell the optimizer the training progress, a float in [0, 1] (step / total_steps);
        ValueError outside."""
        fraction = float(fraction)
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"progress fraction must be in [0, 1], got {fraction}")
        self.progress = fraction

    def m_rounding_for(self, param):
        """The first-moment rounding ("rtn"|"sr") that the next step uses for `param`."""
        after = self.qcfg["lm_head_sr_after"]
        if id(param) in self._lm_head and after is not None and self.progress >= after:
            return "sr"
        return self.qcfg["m_rounding"]

    # ---- state --------------------------------------------------------------------------------
    def _eligible(self, p):
        B = self.qcfg["block_size"]
        return (self.qcfg["m_codebook"] is not None and p.numel() >= MIN_QUANT_NUMEL
                and p.numel() % B == 0)

    def is_quantized(self, p, group=None):
        """True if p's moments are stored in 4 bits: a quantized preset, an eligible size, and p's
        param group (`group`, else looked up) does not set quantize=False. ValueError when p already
        has states of the other kind (the group's quantize flag was changed after its first step)."""
        if group is None:
            group = next((g for g in self.param_groups if any(p is q for q in g["params"])), None)
            if group is None:
                raise ValueError(f"is_quantized: the tensor of shape {tuple(p.shape)} is not a "
                                 "parameter of this optimizer")
        q = group.get("quantize", True) and self._eligible(p)   # older state dicts: no flag
        st = self.state.get(p)
        if st and "exp_avg" in st and (st["exp_avg"].dtype == torch.uint8) != q:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} has {'FP32' if q else '4-bit'} "
                             f"states but its param group now says quantize={group.get('quantize', True)}; "
                             "set quantize per group before the first step (or load a state dict)")
        return q

    def _init_state(self, p, group=None):
        st = self.state[p]
        if self.capturable and _is_dtensor(p):
            raise ValueError("capturable=True does not support FSDP2 (DTensor) parameters; use "
                             "capturable=False with fully_shard")
        # a Python number: no tensor op per parameter and step; capturable: a float32 tensor on
        # p's device, advanced by the step itself (one _foreach_add_ for all)
        st["step"] = torch.zeros((), dtype=torch.float32, device=p.device) if self.capturable else 0.0
        q = self.is_quantized(p, group)
        if q and _is_dtensor(p):   # FSDP2: see _local_step_view
            B, rows = self.qcfg["block_size"], p.shape[0]
            sharded = _rows_of_blocks(p, B)
            shapes = ((rows, p.numel() // rows // 2), (rows, p.numel() // rows // B)) if sharded else \
                ((p.numel() // 2,), (p.numel() // B,))
            for k in ("exp_avg", "exp_avg_sq"):
                for key, shape, dt in ((k, shapes[0], torch.uint8), (k + "_scale", shapes[1], torch.float32)):
                    st[key] = _local_state(p, shape, p.to_local().shape[0], dt, not sharded)
        elif q:
            n, B = p.numel(), self.qcfg["block_size"]
            for k in ("exp_avg", "exp_avg_sq"):
                # scale 0 decodes every code to 0: the zero initial moments of AdamW
                st[k] = torch.zeros(n // 2, dtype=torch.uint8, device=p.device)
                st[k + "_scale"] = torch.zeros(n // B, dtype=torch.float32, device=p.device)
        else:
            st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        if self.qcfg["master_weight_bits"] and p.dtype == torch.bfloat16:
            if _is_dtensor(p):   # the gathered step would pair a full weight with a shard's bytes
                raise ValueError("master_weight_bits=24 does not support FSDP2 (DTensor) parameters; "
                                 "use master_weight_bits=None (param_rounding='sr' works) or DDP")
            # eq. MW with e = 0: the master weight starts as the BF16 weight
            st["param_correction"] = torch.zeros_like(p, dtype=torch.int8)
        return st

    def _fit_state(self, p, st):
        # a state as the step's code paths expect it after the parameter changed dtype (model.to)
        # or the state was loaded: a BF16 weight's eq. MW correction folded into a parameter cast
        # to another dtype (the 24-bit master weight becomes its value), a zero one added where
        # master_weight_bits=24 meets a new BF16 parameter, and contiguous tensors (the kernels
        # index them flat)
        corr = st.get("param_correction")
        if corr is not None and p.dtype != torch.bfloat16:
            write_param(p.data, join_master(p.detach().bfloat16(), corr.view_as(p)))
            del st["param_correction"]
        elif corr is None and p.dtype == torch.bfloat16 and self.qcfg["master_weight_bits"]:
            st["param_correction"] = torch.zeros_like(p, dtype=torch.int8, memory_format=torch.contiguous_format)
        for k, v in st.items():
            if torch.is_tensor(v) and not v.is_contiguous():
                st[k] = v.contiguous()

    def state_nbytes(self):
        """Persistent optimizer-state bytes: codes, scales, FP32 moments and param_correction
        (the scalar step counters are not counted). 1.0625 B/param on quantized tensors, 8 on
        FP32 ones, + 1 with master_weight_bits=24 on BF16 ones. For FSDP2 (DTensor) states: the
        bytes this rank holds."""
        local = lambda t: t.to_local() if _is_dtensor(t) else t   # noqa: E731
        return sum(local(t).numel() * t.element_size() for st in self.state.values()
                   for k, t in st.items() if k != "step" and torch.is_tensor(t))

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self):
        """torch's state dict (param groups with their quantize flags) plus the quantizer
        configuration, seed, progress and LM-head marks. The 4-bit codes and scales of a tensor
        whose rows are whole blocks come per row (_per_row: FSDP2's layout, views, no copy)."""
        sd = super().state_dict()
        for i, p in enumerate(self._params()):   # torch numbers the parameters in group order
            if i in sd["state"]:
                sd["state"][i] = _per_row(p, sd["state"][i], self.qcfg["block_size"])
        sd["adam4bit"] = {k: self.qcfg[k] for k in sorted(self.qcfg)}
        sd["adam4bit_extra"] = dict(seed=self.seed, progress=self.progress, lm_head=[
            i for i, p in enumerate(self._params()) if id(p) in self._lm_head])
        # torch.distributed.checkpoint's get_/set_optimizer_state_dict keep only "state" and
        # "param_groups": every saved group carries both entries too, for load_state_dict
        for g in sd["param_groups"]:
            g["adam4bit"] = dict(config=sd["adam4bit"], extra=sd["adam4bit_extra"])
        return sd

    def load_state_dict(self, state_dict):
        """Load a state_dict() of an AdamW4bit with the same preset, components and block_size;
        packed codes and scales are restored exactly (and moved to each parameter's device).
        Also takes the {"state", "param_groups"} dict of set_optimizer_state_dict
        (torch.distributed.checkpoint): the configuration then comes from the groups.
        Raises ValueError for a state dict of another configuration or of another optimizer."""
        groups = state_dict.get("param_groups", [])
        if "adam4bit" not in state_dict and groups and "adam4bit" in groups[0]:
            state_dict = dict(state_dict, adam4bit=groups[0]["adam4bit"]["config"],
                              adam4bit_extra=groups[0]["adam4bit"]["extra"])
        if "adam4bit" not in state_dict:
            raise ValueError("not an AdamW4bit state dict (no 'adam4bit' entry); refusing to load")
        saved = dict(dict(param_rounding="rtn", master_weight_bits=None), **state_dict["adam4bit"])
        mine = {k: self.qcfg[k] for k in sorted(self.qcfg)}
        def same(a, b):   # codebooks may be tensors (custom levels)
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
            return a == b
        diff = {k: (saved.get(k), mine[k]) for k in mine if not same(saved.get(k), mine[k])}
        if diff:
            raise ValueError("optimizer state was written with another configuration "
                             f"(saved, current): {diff}")
        params = self._params()
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        saved_q = [g.get("quantize", True) for g in state_dict["param_groups"] for _ in g["params"]]
        for pid, p, q in zip(saved_ids, params, saved_q):
            st = state_dict["state"].get(pid, {})
            quantized = q and self._eligible(p)     # the saved group's policy, which load adopts
            if "exp_avg" in st and st["exp_avg"].numel() != (p.numel() // 2 if quantized else p.numel()):
                raise ValueError(f"optimizer state of parameter {pid} ({st['exp_avg'].numel()} exp_avg "
                                 f"entries) does not fit the parameter of shape {tuple(p.shape)}")
            if "param_correction" in st and p.dtype != torch.bfloat16:
                # eq. MW's residual belongs to a BF16 weight; added to another one it would move it
                raise ValueError(f"optimizer state of parameter {pid} holds a param_correction (saved "
                                 f"with BF16 parameters) but the parameter is {p.dtype}; load it into "
                                 "BF16 parameters, or drop the 'param_correction' entries first")
        self._plan_version += 1
        super().load_state_dict({"state": state_dict["state"], "param_groups": [
            {k: v for k, v in g.items() if k != "adam4bit"} for g in groups]})
        # torch casts every state tensor to the parameter's dtype (uint8 codes too): put back the
        # saved tensors with their own dtypes, on the parameter's device.
        for pid, p in zip(saved_ids, params):
            st = state_dict["state"].get(pid, {})
            for k, t in st.items():
                if k != "step" and torch.is_tensor(t):
                    if k in _PACKED and "exp_avg_scale" in st and not _is_dtensor(p):
                        t = t.reshape(-1)   # per-row codes and scales (_per_row): the step's flat layout
                    self.state[p][k] = t.detach().to(device=p.device).clone()
            if "step" in self.state[p]:
                self.state[p]["step"] = float(self.state[p]["step"])   # older checkpoints: a tensor
            if self.qcfg["master_weight_bits"] and p.dtype == torch.bfloat16 and self.state[p] \
                    and "param_correction" not in self.state[p]:
                # saved with FP32 parameters: eq. MW with e = 0, the master weight is the BF16 weight
                self.state[p]["param_correction"] = torch.zeros_like(p, dtype=torch.int8)
        extra = state_dict.get("adam4bit_extra", {})
        self.seed = int(extra.get("seed", self.seed))
        self.progress = float(extra.get("progress", self.progress))
        self._lm_head |= {id(params[i]) for i in extra.get("lm_head", [])}

    # ---- step ---------------------------------------------------------------------------------
    def _check_group(self, gi, group, lr_value=True):
        """The hyperparameter checks of group gi (`_check_hparams`; with capturable=True, betas whose
        bias corrections reach 1 within the table's rows). lr_value=False skips the value of a
        one-element lr tensor on the GPU (reading it waits for the GPU); its shape and a CPU
        tensor's value are checked."""
        where = f"param group {gi}: "
        _check_hparams(dict(group, lr=0.0) if not lr_value and _lr_on_device(group["lr"]) else group, where)
        if self.capturable and any(0 < b < 1 and -54 * math.log(2) / math.log(b) >= _BIAS_ROWS_MAX
                                   for b in group["betas"]):
            raise ValueError(f"{where}capturable=True needs betas whose bias corrections reach 1 within "
                             f"{_BIAS_ROWS_MAX} steps (beta < ~0.99999), got {tuple(group['betas'])}; use "
                             "capturable=False")
        self._checked[gi] = _hparams_key(group)

    def _check_changed_groups(self):
        """Checks again each group whose lr, betas, eps or weight_decay changed since its last check
        (a scheduler, user code, load_state_dict): a bad value is a clear error before the step, not
        a NaN weight or a math error inside it. One tuple comparison per group and step."""
        for gi, group in enumerate(self.param_groups):
            if self._checked.get(gi) != _hparams_key(group):
                self._check_group(gi, group, lr_value=False)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over all parameters with a gradient (update-before-storage).

        Quantized tensors go through the fused Triton kernel (adamw4bit_step_triton: one launch
        per group of tensors sharing step, gradient dtype and first-moment rule) or the reference
        (adamw4bit_step_torch); FP32-state tensors through _adamw_kernel (16-bit parameters) or
        torch's fused AdamW (FP32 ones) on CUDA, adamw_step_torch elsewhere. Returns the
        closure's loss (None without a closure). capturable=True: see the class docstring.
        A step records its plan (groups, launch tables, the fused-AdamW lists) and
        later steps replay it, with no Python per tensor beyond a signature check, while the
        parameters, which have gradients, their dtypes, the states (replaced by load_state_dict)
        and the groups are unchanged; gradients at new addresses only repoint the launch tables.
        FSDP2 (DTensor) parameters replay it on their local tensors (_local_params), except
        those gathered for the step (more than one rank); the reference path never does.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_changed_groups()
        interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
        capturing = self.capturable and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        params = self._params()
        grads = [p.grad for p in params]
        views = self._local_views
        if views:   # FSDP2: the plan runs on the local tensors
            params, grads = _local_params(params, grads, views)
        gptrs = tuple([0 if g is None or g.layout is not torch.strided else g.data_ptr() for g in grads])
        key = self._plan_key(interp, params, grads)
        plan = self._plan
        if plan is not None and plan["key"] == key and (
                gptrs == plan["grads"] or plan["layout"] == _layout_key(params, grads)):
            self._replay(plan, grads, gptrs, capturing)
            _drop_local_grads(views)
            return loss
        if capturing:
            raise RuntimeError("AdamW4bit(capturable=True): step() under CUDA graph capture repeats the "
                               "last step() taken outside capture, and this one differs from it (parameters, "
                               "gradients, param groups or states changed, or there was none): take one "
                               "step() outside capture first, with the gradients the graph will use")
        # the step below also records what a step with the same key repeats (self._plan)
        self._plan = None
        plan = dict(key=key, layout=_layout_key(params, grads), states=[], groups=[], k=0, grads=gptrs)
        cacheable = key is not None
        index, writeback = 0, []
        for gi, group in enumerate(self.param_groups):
            hp = _group_hparams(group)
            fp32, seeds, sidxs, quant, small = [], [], [], {}, {}
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"AdamW4bit does not support sparse gradients (parameter {index}, "
                                       f"shape {tuple(p.shape)}); "
                                       "use dense gradients (e.g. nn.Embedding(sparse=False))")
                st = self.state[p] if self.state[p] else self._init_state(p, group)
                if self.capturable != torch.is_tensor(st["step"]):   # a state loaded from the other kind
                    st["step"] = torch.tensor(float(st["step"]), device=p.device) if self.capturable \
                        else float(st["step"])
                if p.dtype not in KERNEL_DTYPES:      # e.g. model.double() after construction
                    raise TypeError(f"AdamW4bit: parameter {index} (shape {tuple(p.shape)}) is {p.dtype}; "
                                    "allowed: float32, bfloat16, float16")
                if p.grad.dtype not in KERNEL_DTYPES:
                    raise TypeError(f"AdamW4bit: the gradient of parameter {index} (shape {tuple(p.shape)}) "
                                    f"is {p.grad.dtype}; allowed: float32, bfloat16, float16")
                if not _is_dtensor(p):
                    self._fit_state(p, st)
                st["step"] += 1
                plan["states"].append(st)
                t = int(st["step"])
                quantized, m_rule, sidx = self.is_quantized(p, group), self.m_rounding_for(p), index
                if _is_dtensor(p):   # FSDP2: step this rank's shard (or the gathered tensor)
                    layout = self._shard_layouts.get(id(p))
                    if layout is None:
                        layout = self._shard_layouts[id(p)] = _shard_layout(p, quantized, self.qcfg["block_size"])
                    dp, dst, sidx = p, st, index + layout[1]
                    p, st, gathered = _local_step_view(p, st, quantized, layout, self._local_views)
                    cacheable = cacheable and not gathered   # a gathered tensor is new each step
                    writeback.append((dp, dst, p, st, gathered, layout[2]))
                    if p.numel() == 0:   # fewer rows than ranks: nothing here
                        continue
                if not quantized:
                    if self._use_adamw_kernel(p, interp):   # 16-bit parameters, FP32 states
                        small.setdefault((t, p.dtype, p.grad.dtype, "param_correction" in st),
                                         []).append((p, st, sidx))
                    else:
                        fp32.append((p, st, t))
                        seeds.append(_sr_seed(self.seed, t, sidx))
                        sidxs.append(sidx)
                    continue
                if self._use_triton(p, interp):
                    quant.setdefault((t, p.dtype, p.grad.dtype, m_rule), []).append((p, st, sidx))
                else:
                    cacheable = False
                    adamw4bit_step_torch(p, p.grad, st, *hp, t, self.qcfg, m_rule,
                                         _sr_seed(self.seed, t, sidx))
            rule = self.qcfg["param_rounding"]
            _adamw_fp32_steps(fp32, *hp, rule, seeds)
            device = next((p.device for p in group["params"] if p.grad is not None), None)
            gplan = dict(group=group, index=gi, device=device, fused=[], loop=[], launches=[])
            plan["groups"].append(gplan)
            fused, by_t = fp32 and fp32[0][0].device.type in _FUSED_ADAMW_DEVICES, {}
            for (p, st, t), i in zip(fp32, sidxs):      # what _adamw_fp32_steps did, to repeat
                if fused and p.dtype == torch.float32:
                    by_t.setdefault(t, []).append((p, st))
                else:
                    gplan["loop"].append((p, st, t, i))
            gplan["fused"] = [(t, _fused_fp32_args(its, self._device_lr(gi, group, device) if self.capturable
                                                   else None)) for t, its in by_t.items()]
            for (t, _, _, m_rule), items in quant.items():
                launch = _triton_prepare(items, self.qcfg, m_rule, self._kernel_tabs, self._kernel_cache,
                                         own_table=cacheable)
                if self.capturable:
                    launch["dev"] = self._device_args(gi, group, items[0][1], device)
                _triton_launch(launch, *hp, t, _seed_of_step(self.seed, t))
                gplan["launches"].append((t, launch, [p for p, _, _ in items], _triton_launch))
            for (t, *_), items in small.items():
                launch = _adamw_prepare(items, rule, self._kernel_cache, own_table=cacheable)
                if self.capturable:
                    launch["dev"] = self._device_args(gi, group, items[0][1], device)
                _adamw_launch(launch, *hp, t, _seed_of_step(self.seed, t))
                gplan["launches"].append((t, launch, [p for p, _, _ in items], _adamw_launch))
        for args in writeback:
            _write_back(*args)
        _drop_local_grads(self._local_views)
        if cacheable:
            if self.capturable:
                plan["steps"] = [st["step"] for st in plan["states"]]
                plan["graphable"] = all(g["device"] is None or (g["device"].type == "cuda" and not g["loop"])
                                        for g in plan["groups"])
            self._plan = plan
        return loss

    def _plan_key(self, interp, params, grads):
        # What the recorded plan of a step depends on, beyond the hyperparameters and the seed that
        # _replay reads each step, and the gradients' addresses (step() compares them, and the
        # whole _layout_key when one moved): the parameter set and storage, the gradients' dtypes
        # and contiguity (a new gradient may take the old one's address), the LM head's
        # first-moment rule, and _plan_version (states created or loaded, groups added, LM head
        # marked). A parameter's dtype changes only with a new storage (p.data = ...).
        # None: no plan (DTensor parameters: before step() has their local aliases, or gathered).
        ids = tuple(map(id, params))
        plan = self._plan   # the same objects as the plan's: no DTensor (isinstance is slow on tensors)
        if (plan is None or plan["key"][7] != ids) and DTensor is not None and \
                any(isinstance(p, DTensor) for p in params):
            return None
        after = self.qcfg["lm_head_sr_after"]
        groups = self.param_groups
        return (self._plan_version, id(self.state), interp, self.impl,
                after is not None and self.progress >= after,
                tuple([g["quantize"] for g in groups]), tuple(map(len, [g["params"] for g in groups])),
                ids, tuple([p.data_ptr() for p in params]),
                tuple([None if g is None else (g.dtype, g.layout is torch.strided and g.is_contiguous())
                       for g in grads]),
                # capturable: what its launches keep (a CUDA graph, the bias tables, the lr tensor)
                tuple([(g["betas"], g["eps"], g["weight_decay"], id(g["lr"]) if torch.is_tensor(g["lr"]) else None)
                       for g in groups]) if self.capturable else None)

    def _replay(self, plan, grads, gptrs, capturing=False):
        # the recorded step, k steps later: the same tensors, groups and launches, each group's
        # step t + k; the hyperparameters (lr, betas, eps, weight_decay), param_rounding and seed
        # are read now; gptrs: the gradients' addresses (the launch tables are repointed if moved).
        # capturable: the step counters and lr live on the device; the launches run inside the
        # caller's CUDA graph capture, or as this plan's own CUDA graph (captured again when the
        # gradients moved: torch's fused AdamW keeps their addresses)
        plan["k"] = k = plan["k"] + 1
        moved = gptrs != plan["grads"]
        plan["grads"] = gptrs
        if moved:
            for gplan in plan["groups"]:
                for _, launch, ps, _ in gplan["launches"]:
                    gs = [p.grad for p in ps]
                    if tuple(g.data_ptr() for g in gs) != launch["grads"]:
                        if capturing:
                            raise RuntimeError(
                                "AdamW4bit(capturable=True): the gradients are at other addresses than "
                                "at the last step() outside CUDA graph capture; keep them in place "
                                "(zero_grad(set_to_none=False)) or take a step() with them first")
                        _triton_regrad(launch, gs)
        if not self.capturable:
            for st in plan["states"]:
                st["step"] += 1
            self._launch_plan(plan, k)
            return
        for gplan in plan["groups"]:       # lr into the device buffers the launches read
            if gplan["device"] is not None:
                self._device_lr(gplan["index"], gplan["group"], gplan["device"], capturing)
        if capturing or not plan["graphable"]:
            if capturing and not plan["graphable"]:
                raise RuntimeError("AdamW4bit(capturable=True): a parameter takes the reference step "
                                   "(non-contiguous, or not on CUDA), which cannot run in a CUDA graph")
            self._launch_plan(plan, k)
            return
        graph = plan.get("graph")
        if graph is None or moved:
            plan["graph"] = graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._launch_plan(plan, k)
        graph.replay()

    def _launch_plan(self, plan, k):
        # a recorded plan's launches at step t + k (capturable: the step counters first)
        if self.capturable:
            torch._foreach_add_(plan["steps"], 1.0)
        rule = self.qcfg["param_rounding"]
        for gplan in plan["groups"]:
            group = gplan["group"]
            # capturable launches read lr on the device (and the loop, eager only, reads it here)
            hp = _group_hparams(group) if not self.capturable or gplan["loop"] else \
                (0.0, *group["betas"], group["eps"], group["weight_decay"])
            for t, a in gplan["fused"]:
                _fused_fp32_group(a, t + k, *hp)
            if gplan["loop"]:
                loop = gplan["loop"]
                _adamw_fp32_steps([(p, st, t + k) for p, st, t, _ in loop], *hp, rule,
                                  [_sr_seed(self.seed, t + k, i) for _, _, t, i in loop])
            for t, launch, _, run in gplan["launches"]:
                run(launch, *hp, t + k, _seed_of_step(self.seed, t + k))

    def _device_lr(self, index, group, device, capturing=False):
        # capturable: the 0-d tensor on `device` the kernels read lr from: the group's own lr if it
        # is one, else a float64 buffer of this optimizer filled with it (not under capture: a
        # graph would keep the value)
        lr = group["lr"]
        if torch.is_tensor(lr) and lr.device == device and lr.numel() == 1:
            return lr
        if capturing:
            raise RuntimeError(f"AdamW4bit(capturable=True): param_groups[{index}]['lr'] is {lr!r}; under "
                               f"CUDA graph capture it must be a 0-d tensor on {device} that you update "
                               "in place (lr.fill_(value)), or the graph would keep this value")
        buf = self._device_bufs.get(("lr", index, device))
        if buf is None:
            buf = self._device_bufs[("lr", index, device)] = torch.zeros((), dtype=torch.float64, device=device)
        buf.fill_(float(lr))
        return buf

    def _device_args(self, index, group, state, device):
        # a capturable launch's device arguments (_launch_scalars): the step counter of its
        # tensors (one t per launch), lr, the bias-correction table of the group's betas and wd
        b1, b2 = group["betas"]
        key = ("bias", b1, b2, group["weight_decay"], device)
        bias = self._device_bufs.get(key)
        if bias is None:   # betas or wd changed (e.g. OneCycleLR's cycle_momentum): a new table
            for k in [k for k in self._device_bufs if k[0] == "bias"][:-3]:
                del self._device_bufs[k]           # keep the last few, not one per step
            bias = self._device_bufs[key] = _bias_table(b1, b2, group["weight_decay"]).to(device)
        return dict(step=state["step"], lr=self._device_lr(index, group, device), bias=bias,
                    rows=bias.shape[0], seed_term=self.seed * 1_000_003 % _SEED_MOD)

    def _use_adamw_kernel(self, p, interp):
        # adamw_step_triton for an FP32-state tensor: 16-bit parameters (FP32 ones take torch's
        # fused AdamW), contiguous, on CUDA (or CPU with TRITON_INTERPRET=1 and impl="triton")
        return p.dtype in (torch.bfloat16, torch.float16) and p.grad.dtype in KERNEL_DTYPES and \
            p.is_contiguous() and p.grad.is_contiguous() and self.impl != "torch" and \
            (p.is_cuda or (interp and self.impl == "triton"))

    def _use_triton(self, p, interp):
        if self._kernel_tabs is None:
            return False
        ok = (p.is_cuda or interp) and p.dtype in KERNEL_DTYPES and p.is_contiguous() and \
            p.grad.dtype in KERNEL_DTYPES and p.grad.is_contiguous()
        if self.impl == "triton" and not ok:
            raise ValueError("impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), "
                             "contiguous float32/bfloat16/float16 parameters and gradients; got a "
                             f"{'' if p.is_contiguous() else 'non-contiguous '}{p.device} {p.dtype} "
                             f"parameter of shape {tuple(p.shape)} with a "
                             f"{'' if p.grad.is_contiguous() else 'non-contiguous '}{p.grad.dtype} gradient "
                             "(use .contiguous() parameters or impl='auto')")
        return ok and (p.is_cuda or self.impl == "triton")


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
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)    # param and grad dtypes
_DTYPE_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
KERNEL_TILES = 16       # tiles per Triton program (setup amortized; 2 tiles share a Philox call)
# registers per thread, RTN-only steps / steps that draw SR bits or sum for EDEN: 64 keeps 32
# one-warp programs per SM; the SR and EDEN steps, with more live values, do better with 72
# (28 programs per SM)
KERNEL_MAXNREG = (64, 72)
_INTERP = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
_SEED_MOD_TL = tl.constexpr(_SEED_MOD)


@triton.jit(do_not_specialize=["seed_of_step", "bias_rows"])
def _adamw4bit_kernel(
        # launch tables: program -> tensor (int32), one row per tensor (int64, TAB_* columns)
        program_tensor, launch_table,
        # codebook tables (_kernel_tables): decode byte -> (T[lo], T[hi]); T_v for EDEN; level
        # search (bucket tables and half their bucket counts); adjacent levels k -> (a, b)
        m_decode, v_decode, v_codebook, m_lut, v_lut, m_hn, v_hn, m_adjacent, v_adjacent,
        # hyper-parameters of this step (eq. 2.1a-b, 3.1): seed_of_step + the table's index term
        # is the tensor's SR seed (_sr_seed); decay = 1 - lr wd; step_size = lr / bc1
        seed_of_step, decay, step_size, b1, one_minus_b1, b2, one_minus_b2, inv_sqrt_bc2, eps,
        # capturable steps (DEV): t and lr read from device memory, see _device_scalars
        step_ptr, lr_ptr, bias_table, bias_rows, DEV: tl.constexpr,
        # the configuration: rounding rules (eq. A.2), EDEN (eq. 3.2), input types and layout
        M_SR: tl.constexpr, V_SR: tl.constexpr, V_UPDATE: tl.constexpr, EDEN: tl.constexpr,
        HAS_U: tl.constexpr, ALIGNED: tl.constexpr,
        # parameter and gradient dtypes (_DTYPE_KIND: 0 FP32, 1 BF16, 2 FP16) and the BF16 write:
        # SR (P_SR) or eq. MW's 24-bit master weight (P_CORR)
        P_KIND: tl.constexpr, G_KIND: tl.constexpr, P_SR: tl.constexpr, P_CORR: tl.constexpr,
        # tiling: BLOCK_SIZE elements per scale block, NB blocks per tile, TILES tiles per program
        BLOCK_SIZE: tl.constexpr, NB: tl.constexpr, TILES: tl.constexpr):
    # A program does TILES tiles of NB consecutive blocks of one tensor, two tiles per loop
    # iteration; its row of the launch table gives the tensor's pointers.
    if DEV:
        seed_of_step, decay, step_size, inv_sqrt_bc2 = _device_scalars(step_ptr, lr_ptr, bias_table,
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
    seed = (seed_of_step + tl.load(row + TAB_SEED_OF_INDEX)) % _SEED_MOD_TL     # _sr_seed
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
        um0 = 0.0
        um1 = 0.0
        uv0 = 0.0
        uv1 = 0.0
        um2 = 0.0
        um3 = 0.0
        uv2 = 0.0
        uv3 = 0.0
        up0 = 0.0
        up1 = 0.0
        up2 = 0.0
        up3 = 0.0
        if HAS_U:    # tests: the caller's uniforms
            ok = pair // (BLOCK_SIZE // 2) < n_blocks - f        # rows inside the tensor
            um0 = tl.load(u_m + f * BLOCK_SIZE + 2 * pair, mask=ok, other=0.0)
            um1 = tl.load(u_m + f * BLOCK_SIZE + 2 * pair + 1, mask=ok, other=0.0)
            uv0 = tl.load(u_v + f * BLOCK_SIZE + 2 * pair, mask=ok, other=0.0)
            uv1 = tl.load(u_v + f * BLOCK_SIZE + 2 * pair + 1, mask=ok, other=0.0)
            ok = pair // (BLOCK_SIZE // 2) < last - f - NB
            um2 = tl.load(u_m + (f + NB) * BLOCK_SIZE + 2 * pair, mask=ok, other=0.0)
            um3 = tl.load(u_m + (f + NB) * BLOCK_SIZE + 2 * pair + 1, mask=ok, other=0.0)
            uv2 = tl.load(u_v + (f + NB) * BLOCK_SIZE + 2 * pair, mask=ok, other=0.0)
            uv3 = tl.load(u_v + (f + NB) * BLOCK_SIZE + 2 * pair + 1, mask=ok, other=0.0)
            if P_SR:
                up2 = tl.load(u_p + (f + NB) * BLOCK_SIZE + 2 * pair, mask=ok, other=0.0)
                up3 = tl.load(u_p + (f + NB) * BLOCK_SIZE + 2 * pair + 1, mask=ok, other=0.0)
                ok = pair // (BLOCK_SIZE // 2) < n_blocks - f
                up0 = tl.load(u_p + f * BLOCK_SIZE + 2 * pair, mask=ok, other=0.0)
                up1 = tl.load(u_p + f * BLOCK_SIZE + 2 * pair + 1, mask=ok, other=0.0)
        else:        # one Philox call per two bytes serves both tiles (_uniforms)
            if V_SR:
                uv0, uv1, uv2, uv3 = _uniforms(seed, f * (BLOCK_SIZE // 2) + pair, 0)
            if M_SR:
                um0, um1, um2, um3 = _uniforms(seed, f * (BLOCK_SIZE // 2) + pair, 1)
            if P_SR:
                up0, up1, up2, up3 = _uniforms(seed, f * (BLOCK_SIZE // 2) + pair, 2)
        _step_tile(a0, a1, a2, a3, a4, a5, a6, a7, um0, um1, uv0, uv1, up0, up1,
                   param, corr, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, f, n_blocks,
                   m_decode, v_decode, v_codebook, m_lut, v_lut, m_hn, v_hn, m_adjacent, v_adjacent,
                   decay, step_size, one_minus_b1, one_minus_b2, inv_sqrt_bc2, eps,
                   NB > 1, M_SR, V_SR, V_UPDATE, EDEN, P_KIND, P_SR, P_CORR, ALIGNED, BLOCK_SIZE, NB)
        a0, a1, a2, a3, a4, a5, a6, a7 = _load_tile(param, grad, corr, exp_avg, exp_avg_scale,
                                                    exp_avg_sq, exp_avg_sq_scale, f + 2 * NB, last,
                                                    b1, b2, True, P_KIND, G_KIND, P_CORR, ALIGNED,
                                                    BLOCK_SIZE, NB)
        _step_tile(b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], um2, um3, uv2, uv3, up2, up3,
                   param, corr, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, f + NB, last,
                   m_decode, v_decode, v_codebook, m_lut, v_lut, m_hn, v_hn, m_adjacent, v_adjacent,
                   decay, step_size, one_minus_b1, one_minus_b2, inv_sqrt_bc2, eps,
                   True, M_SR, V_SR, V_UPDATE, EDEN, P_KIND, P_SR, P_CORR, ALIGNED, BLOCK_SIZE, NB)


# ---- the kernel's helpers --------------------------------------------------------------------

@triton.jit
def _device_scalars(step_ptr, lr_ptr, bias_table, bias_rows, seed_term):
    # A capturable step's scalars from device memory, with the host's float64 arithmetic (see
    # _launch_scalars): t (the float32 step counter), lr (float32 or float64), and from
    # _bias_table row min(t, rows - 1) bc1 = 1 - b1^t and 1 / sqrt(bc2), its row 0 holding wd;
    # seed_term = seed * 1000003 mod (2^31 - 1), _seed_of_step's step-free part.
    t = tl.load(step_ptr).to(tl.int64)
    lr = tl.load(lr_ptr).to(tl.float64)
    row = bias_table + 2 * tl.minimum(t, bias_rows - 1)
    decay = (1.0 - lr * tl.load(bias_table)).to(tl.float32)
    step_size = (lr / tl.load(row)).to(tl.float32)      # float64 division: IEEE-rounded
    inv_sqrt_bc2 = tl.load(row + 1).to(tl.float32)
    return (seed_term + t * 65537) % _SEED_MOD_TL, decay, step_size, inv_sqrt_bc2


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
    m_byte = _ld(exp_avg + first * (BLOCK_SIZE // 2) + pair, mask).to(tl.int32)
    v_byte = _ld(exp_avg_sq + first * (BLOCK_SIZE // 2) + pair, mask).to(tl.int32)
    b1s = (_ld(exp_avg_scale + first + rows, rmask) * b1)[:, None]
    b2s = (_ld(exp_avg_sq_scale + first + rows, rmask) * b2)[:, None]
    if ALIGNED:      # an element pair is one aligned 64-bit (FP32) or 32-bit (BF16/FP16) word
        w0, w1 = _load_pair(param, first * (BLOCK_SIZE // 2) + pair, mask, P_KIND)
        g0, g1 = _load_pair(grad, first * (BLOCK_SIZE // 2) + pair, mask, G_KIND)
    else:
        w0 = _ld(param + first * BLOCK_SIZE + 2 * pair, mask).to(tl.float32)
        w1 = _ld(param + first * BLOCK_SIZE + 2 * pair + 1, mask).to(tl.float32)
        g0 = _ld(grad + first * BLOCK_SIZE + 2 * pair, mask).to(tl.float32)
        g1 = _ld(grad + first * BLOCK_SIZE + 2 * pair + 1, mask).to(tl.float32)
    if P_CORR:       # eq. MW: w = x + e 2^(E-15)
        w0 = _join_master(w0, _ld(corr + first * BLOCK_SIZE + 2 * pair, mask))
        w1 = _join_master(w1, _ld(corr + first * BLOCK_SIZE + 2 * pair + 1, mask))
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
    t0, t1 = _unpair(tl.load(m_decode + m_byte))              # T[code] of both nibbles
    m0 = t0 * b1s + g0 * one_minus_b1
    m1 = t1 * b1s + g1 * one_minus_b1
    t0, t1 = _unpair(tl.load(v_decode + v_byte))
    v0 = t0 * b2s + g0 * g0 * one_minus_b2
    v1 = t1 * b2s + g1 * g1 * one_minus_b2

    # eq. 2.1b, the AdamW update with the working moments (update-before-storage)
    r0 = tl.sqrt_rn(v0) * inv_sqrt_bc2 + eps                  # eq. 3.1: r_t(v~), reused by Update-*
    r1 = tl.sqrt_rn(v1) * inv_sqrt_bc2 + eps
    w0 = w0 * decay - tl.div_rn(step_size * m0, r0)
    w1 = w1 * decay - tl.div_rn(step_size * m1, r1)
    if P_KIND == 0:
        if ALIGNED:
            tl.store(param.to(tl.pointer_type(tl.int64), bitcast=True) + first * (BLOCK_SIZE // 2)
                     + pair, _join_bits(w0, w1), mask=mask)
        else:
            tl.store(param + first * BLOCK_SIZE + 2 * pair, w0, mask=mask)
            tl.store(param + first * BLOCK_SIZE + 2 * pair + 1, w1, mask=mask)
    else:            # write_param: the 16-bit patterns h0, h1 (low halves of int32)
        if P_KIND == 2:
            h0 = w0.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            h1 = w1.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        else:
            x0 = _bf16_bits(w0, up0, P_SR)
            x1 = _bf16_bits(w1, up1, P_SR)
            if P_CORR:
                tl.store(corr + first * BLOCK_SIZE + 2 * pair, _split_master(w0, x0), mask=mask)
                tl.store(corr + first * BLOCK_SIZE + 2 * pair + 1, _split_master(w1, x1), mask=mask)
            h0 = (x0 >> 16) & 0xFFFF
            h1 = (x1 >> 16) & 0xFFFF
        if ALIGNED:
            tl.store(param.to(tl.pointer_type(tl.int32), bitcast=True) + first * (BLOCK_SIZE // 2)
                     + pair, h0 | (h1 << 16), mask=mask)
        else:
            p16 = param.to(tl.pointer_type(tl.int16), bitcast=True) + first * BLOCK_SIZE + 2 * pair
            tl.store(p16, h0.to(tl.int16), mask=mask)
            tl.store(p16 + 1, h1.to(tl.int16), mask=mask)

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
def _load_pair(ptr, pair, mask, KIND: tl.constexpr):
    # elements 2 pair, 2 pair + 1 as float32 from one aligned word (little-endian: the even
    # element in the low half); BF16 and FP16 -> FP32 are exact
    if KIND == 0:
        lo, hi = _unpair(_ld(ptr.to(tl.pointer_type(tl.int64), bitcast=True) + pair, mask))
    else:
        word = _ld(ptr.to(tl.pointer_type(tl.int32), bitcast=True) + pair, mask)
        if KIND == 1:
            lo = (word << 16).to(tl.float32, bitcast=True)
            hi = (word & -65536).to(tl.float32, bitcast=True)
        else:
            lo = word.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (word >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _bf16_bits(w, u, SR: tl.constexpr):
    # round_to_bf16 on float32 w: the BF16 result's bits in the top half of an int32
    bits = w.to(tl.int32, bitcast=True)
    rtn = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    if SR:
        rtn = tl.where(nan, rtn, (bits + (u * 65536.0).to(tl.int32)) & -65536)
    return tl.where(nan, (bits & -65536) | 0x400000, rtn)


@triton.jit
def _join_master(x, e):
    # join_master: x + e 2^(E-15) (eq. MW), exact in float32
    eb = tl.maximum((x.to(tl.int32, bitcast=True) >> 23) & 0xFF, 16)
    return x + e.to(tl.float32) * ((eb - 15) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _split_master(w, xbits):
    # split_master's e (int8) for w and its RTN BF16 bits xbits; round half to even by adding and
    # subtracting 1.5 2^23 (|y| <= 128 here, or +-inf)
    eb = tl.maximum((xbits >> 23) & 0xFF, 16)
    y = (w - xbits.to(tl.float32, bitcast=True)) * ((269 - eb) << 23).to(tl.float32, bitcast=True)
    y = tl.where(y == y, y, 0.0)
    y = (y + 12582912.0) - 12582912.0
    return tl.minimum(tl.maximum(y, -127.0), 127.0).to(tl.int32).to(tl.int8)


@triton.jit
def _quantize(y, lut, hn, adjacent, u, rx, r_scale, eps, SR: tl.constexpr, UPDATE: tl.constexpr):
    # eq. A.2: round_to_levels(y, T, ...) with the same float32 operations. _bucket_lut (2 hn
    # buckets) gives the count of boundaries <= y: the code itself for State-RTN, else the lower
    # level's index k. y is in [-1, 1] or NaN (the whole block then, see _step_tile): the GPU
    # converts NaN to bucket 0, the interpreter to INT_MIN, so there (only) the index is clamped.
    j = tl.fma(y, hn, hn).to(tl.int32)
    if _INTERP:
        j = tl.maximum(j, 0)
    count, bound = _unpair(tl.load(lut + j))
    k = count.to(tl.int32, bitcast=True) + (y >= bound).to(tl.int32)
    if not SR and not UPDATE:
        return k
    a, b = _unpair(tl.load(adjacent + k))
    if UPDATE:                       # a, b are sqrt(T[k]), sqrt(T[k+1])
        ra = r_scale * a + eps
        rb = r_scale * b + eps
        num = (rb - rx) * ra
        den = (rb - ra) * rx
    else:
        num = b - y
        den = b - a
    if SR:
        take_a = u * den < num
    else:
        take_a = 2 * num > den
    return tl.where(take_a, k, k + 1)


@triton.jit
def _absmax(x0, x1):
    # max |x| per row over both halves, as an integer max of the bit patterns (same order for
    # floats >= 0): one warp-wide REDUX instruction instead of five shuffle rounds
    m = tl.maximum(tl.abs(x0).to(tl.int32, bitcast=True), tl.abs(x1).to(tl.int32, bitcast=True))
    return tl.max(m, axis=1).to(tl.float32, bitcast=True)


@triton.jit
def _uniforms(seed, byte, stream):
    # SR uniforms for two consecutive tiles: Philox4x32 with 7 rounds (Random123's
    # crush-resistant minimum; default 10) at counter (byte index in the first tile with bit 5
    # removed, stream). A thread holds bytes b and b + 32 of a tile row, so the compiler computes
    # the call once for both; its 4 words give 16 bits to each of the 8 elements (even and odd
    # element of both bytes, both tiles): u = (k + 1/2) 2^-16, rounding probabilities within
    # 2^-17 of exact, for half the Philox work of 32-bit draws.
    h = ((byte >> 5) & 1).to(tl.uint32) * 16
    c = (byte >> 6) * 32 + (byte & 31)
    lo = c.to(tl.uint32)
    k0 = seed.to(tl.uint32)
    q0, q1, q2, q3 = philox(lo, (c >> 32).to(tl.uint32), lo * 0 + stream, lo * 0, k0, k0 * 0, 7)
    s = 1.52587890625e-05   # 2^-16
    return (tl.fma(((q0 >> h) & 0xFFFF).to(tl.float32), s, 0.5 * s),
            tl.fma(((q1 >> h) & 0xFFFF).to(tl.float32), s, 0.5 * s),
            tl.fma(((q2 >> h) & 0xFFFF).to(tl.float32), s, 0.5 * s),
            tl.fma(((q3 >> h) & 0xFFFF).to(tl.float32), s, 0.5 * s))


@triton.jit
def _ld(ptr, mask):
    # tl.load, masked (zeros outside) only when a mask is given
    if mask is None:
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=mask, other=0)
    return x


@triton.jit
def _unpair(e):
    # inverse of _pair_bits: int64 -> (low float32, high float32)
    return e.to(tl.int32).to(tl.float32, bitcast=True), (e >> 32).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _join_bits(lo, hi):
    # _pair_bits in the kernel: two float32 -> one int64 (one 64-bit store)
    return lo.to(tl.uint32, bitcast=True).to(tl.int64) | (hi.to(tl.uint32, bitcast=True).to(tl.int64) << 32)


# ---- the codebook tables ---------------------------------------------------------------------

LUT_BUCKETS = (32, 64, 128, 256, 512, 1024)   # bucket counts of the level search over [-1, 1]


def _pair_bits(lo, hi):
    """float32 tensors lo, hi -> int64 holding lo's bits in the low word and hi's in the high
    word: the kernel reads both with one 64-bit gather."""
    return (lo.view(torch.int32).long() & 0xFFFFFFFF) | (hi.view(torch.int32).long() << 32)


def _bucket_lut(bounds, n=None, margin=2.0 ** -12):
    """The kernel's replacement for torch.searchsorted(bounds, y, right=True), y in [-1, 1].

    Bucket j (0 <= j <= n) holds y with (y + 1) n/2 in [j, j+1). Its entry packs (_pair_bits)
    c_j = the count of bounds <= e_j - margin (surely <= every y of the bucket, e_j = -1 + 2j/n)
    and bounds[c_j], the next bound (2.0 past the last). At most one bound lies in
    [e_j - margin, e_j+1 + margin), so the count of bounds <= y is c_j + (y >= bounds[c_j]): one
    64-bit read and one comparison. The margin (2^-12) covers the float32 error of the bucket
    index (~1e-7). bounds: sorted float32 (k,). n=None: the fewest buckets in LUT_BUCKETS that
    work (NF4: 32, Dyn4: 512): a smaller table spreads a warp's 32 reads over fewer cache lines.
    Returns int64 (n + 1,) (at most 8 KB).
    Raises ValueError if two bounds share a bucket (closer than ~2/n; the paper codebooks'
    levels and level midpoints are >= 0.0039 apart) or a bound lies outside [-1, 1]."""
    if n is None:
        for n in LUT_BUCKETS[:-1]:
            try:
                return _bucket_lut(bounds, n, margin)
            except ValueError:
                pass
        n = LUT_BUCKETS[-1]
    e = -1 + 2 * torch.arange(n + 2, dtype=torch.float64) / n
    b = bounds.double()[None, :]
    count = (b <= e[:-1, None] - margin).sum(1)
    inside = (b > e[:-1, None] - margin) & (b < e[1:, None] + margin)
    if bounds.numel() and (inside.sum(1).max() > 1 or bounds.abs().max() > 1):
        raise ValueError(f"codebook levels are closer than the kernel's level buckets (2/{n} plus "
                         f"margins) or outside [-1, 1]: boundaries {bounds.tolist()}")
    nxt = torch.cat([bounds, torch.tensor([2.0], dtype=torch.float32)])
    return _pair_bits(count.to(torch.int32), nxt[count])


def _kernel_tables(cfg):
    """The kernel's lookup tables (CPU tensors) for an optimizer configuration:
    m_decode/v_decode: byte -> (T[low nibble], T[high nibble]) as _pair_bits, int64 (256,);
    v_codebook: T_v (EDEN reads T[code]);
    m_lut_rtn/m_lut_sr/v_lut: _bucket_lut of the level midpoints (State-RTN: the code is the
    count of midpoints <= y) or of the inner levels (the others: the lower level's index k);
    m_adjacent/v_adjacent: k -> (T[k], T[k+1]) as _pair_bits, or (sqrt T[k], sqrt T[k+1]) for
    the update coordinate (one 64-bit gather).
    Raises ValueError, naming the moment's codebook, if its levels are too dense for _bucket_lut."""
    T_m, T_v = (get_codebook(cfg[k]) for k in ("m_codebook", "v_codebook"))
    codes = torch.arange(256)

    def dec(T):   # codes >= K are never written; they decode to the top level
        T = torch.cat([T, T[-1:].expand(16 - T.numel())])
        return _pair_bits(T[codes & 15], T[codes >> 4])

    Tp = sqrt_rn(T_v) if cfg["v_rounding"].startswith("update") else T_v
    t = dict(m_decode=dec(T_m), v_decode=dec(T_v), v_codebook=T_v,
             m_adjacent=_pair_bits(T_m[:-1], T_m[1:]), v_adjacent=_pair_bits(Tp[:-1], Tp[1:]))
    def lut(moment, bounds):   # a too-dense codebook's error names it
        try:
            return _bucket_lut(bounds)
        except ValueError as e:
            raise ValueError(f"{moment}_codebook {cfg[moment + '_codebook']!r}: {e}") from None

    t["m_lut_rtn"] = lut("m", _midpoints(T_m))
    if cfg["m_rounding"] == "sr" or cfg["lm_head_sr_after"] is not None:
        t["m_lut_sr"] = lut("m", T_m[1:-1])
    t["v_lut"] = lut("v", _midpoints(T_v) if cfg["v_rounding"] == "state-rtn" else T_v[1:-1])
    return t


# ---- the launch tables -----------------------------------------------------------------------

# One int64 row of TAB_WIDTH columns per tensor, written by _launch_table and read by the kernel:
TAB_FIRST_PROGRAM = tl.constexpr(0)      # the tensor's first program (_program_table)
TAB_N_BLOCKS = tl.constexpr(1)           # its number of scale blocks, numel / block_size
TAB_PARAM = tl.constexpr(2)              # data pointers: param (float32), grad (float32/bfloat16),
TAB_GRAD = tl.constexpr(3)               # the state's exp_avg, exp_avg_sq (packed codes, uint8)
TAB_EXP_AVG = tl.constexpr(4)            # and exp_avg_scale, exp_avg_sq_scale (float32)
TAB_EXP_AVG_SCALE = tl.constexpr(5)
TAB_EXP_AVG_SQ = tl.constexpr(6)
TAB_EXP_AVG_SQ_SCALE = tl.constexpr(7)
TAB_SEED_OF_INDEX = tl.constexpr(8)      # the parameter's term of its SR seed (_seed_of_index)
TAB_U_M = tl.constexpr(9)                # the caller's uniforms u_m, u_v (float32; 0 without)
TAB_U_V = tl.constexpr(10)
TAB_U_P = tl.constexpr(11)               # and u_p of the BF16 SR write
TAB_CORRECTION = tl.constexpr(12)        # param_correction (int8, eq. MW; 0 without)
TAB_WIDTH = tl.constexpr(13)


def _program_table(units, per_program, device):
    """Program -> tensor index as int32 (programs,) on `device`, and each tensor's first program
    (a list): a tensor of `units` blocks (or elements) gets cdiv(units, per_program) programs."""
    counts = torch.tensor([triton.cdiv(n, per_program) for n in units])
    return (torch.repeat_interleave(torch.arange(len(units), dtype=torch.int32), counts).to(device),
            (torch.cumsum(counts, 0) - counts).tolist())


def _launch_table(ptrs, first_programs, block_size, device):
    """The launch table, int64 (tensors, TAB_WIDTH) on `device`, from adamw4bit_step_triton's
    per-tensor tuples (param, grad, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale data
    pointers, parameter index, numel, param_correction pointer or 0[, u_m, u_v, u_p pointers])."""
    rows = []
    for first, (param, grad, exp_avg, exp_avg_scale, exp_avg_sq, exp_avg_sq_scale, index, numel,
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
        row[TAB_SEED_OF_INDEX] = _seed_of_index(index)
        row[TAB_U_M], row[TAB_U_V], row[TAB_U_P] = (tuple(u) + (0, 0, 0))[:3]
        row[TAB_CORRECTION] = correction
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64).to(device)


def _cached_tables(cache, dev, program_key, units, per_program, launch_key, ptrs, block_size, own_table):
    """The program table (_program_table(units, per_program, dev)), the launch table
    (_launch_table(ptrs, ..., block_size, dev)) and the compile options of a launch of either
    kernel. The tables are cached in `cache` (the optimizer's dict, under "programs" and
    "launch") because building them is a host loop over the tensors and a host-to-device copy:
    with the same tensor sizes (program_key) and data pointers (launch_key) a step reuses them.
    More than 64 launch tables mean parameters or states were reallocated: the old ones are
    dropped. own_table: a launch table of its own, not shared with the cache (the step's cached
    plan rewrites its gradient column in place, _triton_regrad)."""
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


# ---- the wrapper -----------------------------------------------------------------------------

def adamw4bit_step_triton(items, lr, b1, b2, eps, wd, t, cfg, m_rounding, seed_of_step, tables, cache,
                          u=None):
    """adamw4bit_step_torch for many tensors in one launch of _adamw4bit_kernel (paper B, eq.
    2.1a-b, Def. 3 / App. A.2 storage, EDEN eq. 3.2), bit for bit given the same SR uniforms.

    items:  (param, state, index) triples of one device, parameter dtype, gradient dtype and
            step t: param a contiguous float32/bfloat16/float16 tensor with a contiguous grad of
            one of these dtypes, numel a multiple of cfg["block_size"]; state as in
            adamw4bit_step_torch (written in place, with its param_correction if any); index the
            parameter's position from 1 (its SR seed is _sr_seed(seed, t, index)).
    lr, b1, b2, eps, wd, t, cfg, m_rounding: as in adamw4bit_step_torch.
    seed_of_step: _seed_of_step(seed, t), the step's term of every tensor's SR seed.
    tables: _kernel_tables(cfg) (CPU); cache: a dict kept per optimizer, filled here with the
            tables on each device and the program and launch tables of each set of tensors.
    u:      optional list of (u_m, u_v, u_p) float32 uniform tensors per item, replacing the
            kernel's Philox bits (tests).
    """
    _triton_launch(_triton_prepare(items, cfg, m_rounding, tables, cache, u), lr, b1, b2, eps, wd, t,
                   seed_of_step)


def _triton_prepare(items, cfg, m_rounding, tables, cache, u=None, own_table=False):
    """Everything of adamw4bit_step_triton's launch that does not change between steps: the
    grid's program table, the launch table, the lookup tables and the compile-time flags (a
    dict for _triton_launch). own_table: a launch table of its own, not shared with the cache
    (the step's cached plan rewrites its gradient column in place, _triton_regrad)."""
    B = cfg["block_size"]
    dev = items[0][0].device
    dev_tables = cache.setdefault("tables", {})
    tabs = dev_tables.get(dev)
    if tabs is None:
        tabs = dev_tables[dev] = {k: x.to(dev) for k, x in tables.items()}
    nb = max(1, KERNEL_ELEMS // B)                 # scale blocks per tile
    numels = tuple(p.numel() for p, _, _ in items)
    ptrs = tuple((p.data_ptr(), p.grad.data_ptr(), *(st[k].data_ptr() for k in (
        "exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale")), i, p.numel(),
        st["param_correction"].data_ptr() if "param_correction" in st else 0)
        for p, st, i in items)
    if u is not None:
        ptrs = tuple(r + tuple(x.data_ptr() for x in us) for r, us in zip(ptrs, u))
    progs, tab, extra = _cached_tables(     # the rows' first programs depend on B, nb, KERNEL_TILES too
        cache, dev, (dev, B, KERNEL_TILES, numels), [n // B for n in numels], nb * KERNEL_TILES,
        (B, nb, KERNEL_TILES, ptrs), ptrs, B, own_table)
    # reading an element pair as one word needs p and grad 8- (FP32) or 4-byte (BF16, FP16)
    # aligned: true for whole tensors, maybe not for views into a flat buffer; otherwise the
    # launch reads element by element
    p0 = items[0][0]
    p_align, g_align = 2 * p0.element_size(), 2 * p0.grad.element_size()
    p_aligned = all(r[0] % p_align == 0 for r in ptrs)
    bf16 = p0.dtype == torch.bfloat16
    p_corr = bf16 and "param_correction" in items[0][1]
    v_coord, v_rule = cfg["v_rounding"].split("-")
    if KERNEL_MAXNREG and extra:
        extra["maxnreg"] = KERNEL_MAXNREG["sr" in (m_rounding, v_rule) or bool(cfg["eden"])
                                          or cfg.get("param_rounding") == "sr"]
    m_lut, v_lut = tabs[f"m_lut_{m_rounding}"], tabs["v_lut"]
    return dict(
        dev=None, grid=(progs[0].numel(),), progs=progs[0], tab=tab, tabs=tabs, m_lut=m_lut, v_lut=v_lut,
        grads=tuple(r[1] for r in ptrs), g_align=g_align, p_aligned=p_aligned,
        flags=dict(M_SR=m_rounding == "sr", V_SR=v_rule == "sr", V_UPDATE=v_coord == "update",
                   EDEN=bool(cfg["eden"]), HAS_U=u is not None,
                   P_KIND=_DTYPE_KIND[p0.dtype], G_KIND=_DTYPE_KIND[p0.grad.dtype],
                   P_SR=bf16 and not p_corr and cfg.get("param_rounding", "rtn") == "sr", P_CORR=p_corr,
                   ALIGNED=p_aligned and all(r[1] % g_align == 0 for r in ptrs),
                   BLOCK_SIZE=B, NB=nb, TILES=KERNEL_TILES, num_warps=1, **extra))


def _triton_regrad(launch, grads):
    """Point a _triton_prepare or _adamw_prepare (own_table=True) launch at new gradient tensors
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


def _launch_scalars(launch, lr, b1, b2, wd, t, seed_of_step):
    """The per-step arguments of both kernels: (seed_of_step, decay, step_size, 1/sqrt(bc2)) of
    eq. 2.1b at step t from the host, then the device ones (step counter, lr, _bias_table,
    its rows, the DEV flag). A launch with launch["dev"] (capturable=True) passes no host
    scalars: the kernel reads t and lr from device memory (_device_scalars), the same float64
    arithmetic."""
    dev = launch["dev"]
    if dev is None:
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        tab = launch["tab"]        # unused pointers
        return (seed_of_step, 1 - lr * wd, lr / bc1, 1 / math.sqrt(bc2)), (tab, tab, tab, 1, False)
    return (dev["seed_term"], 0.0, 0.0, 0.0), (dev["step"], dev["lr"], dev["bias"], dev["rows"], True)


def _triton_launch(launch, lr, b1, b2, eps, wd, t, seed_of_step):
    """Launch _adamw4bit_kernel for a _triton_prepare plan with step t's scalars."""
    (seed_of_step, decay, step_size, inv_sqrt_bc2), dev = _launch_scalars(launch, lr, b1, b2, wd, t, seed_of_step)
    tabs, m_lut, v_lut = launch["tabs"], launch["m_lut"], launch["v_lut"]
    _adamw4bit_kernel[launch["grid"]](
        launch["progs"], launch["tab"],
        tabs["m_decode"], tabs["v_decode"], tabs["v_codebook"], m_lut, v_lut,
        (m_lut.numel() - 1) / 2, (v_lut.numel() - 1) / 2, tabs["m_adjacent"], tabs["v_adjacent"],
        seed_of_step, decay, step_size, b1, 1 - b1, b2, 1 - b2, inv_sqrt_bc2, eps, *dev,
        **launch["flags"])


# ============================================================================================
# The FP32-state step in Triton: adamw_step_torch for many 16-bit-parameter tensors in one launch
#
# The tensors too small to quantize (and quantize=False groups) keep FP32 moments. With FP32
# parameters they take torch's fused AdamW; with BF16 / FP16 parameters that kernel cannot write
# the parameter (its states would be 16-bit too), so this one does: each program steps
# ADAMW_BLOCK consecutive elements of one tensor, found through the same launch tables as the
# 4-bit kernel's (TAB_N_BLOCKS holds the element count, the scale columns are unused), and
# writes the parameter as _step_tile does (RTN, SR or eq. MW).

ADAMW_BLOCK = 1024       # elements per program


@triton.jit(do_not_specialize=["seed_of_step", "bias_rows"])
def _adamw_kernel(program_tensor, launch_table,
                  seed_of_step, decay, step_size, b1, one_minus_b1, b2, one_minus_b2, inv_sqrt_bc2, eps,
                  step_ptr, lr_ptr, bias_table, bias_rows, DEV: tl.constexpr,
                  HAS_U: tl.constexpr, P_KIND: tl.constexpr, G_KIND: tl.constexpr,
                  P_SR: tl.constexpr, P_CORR: tl.constexpr, BLOCK: tl.constexpr):
    if DEV:
        seed_of_step, decay, step_size, inv_sqrt_bc2 = _device_scalars(step_ptr, lr_ptr, bias_table,
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
        w = _join_master(w, tl.load(corr + i, mask=mask, other=0))
    g = tl.load(grad + i, mask=mask, other=0).to(tl.float32)
    # eq. 2.1a with FP32 storage
    m = tl.load(exp_avg + i, mask=mask, other=0.0) * b1 + g * one_minus_b1
    v = tl.load(exp_avg_sq + i, mask=mask, other=0.0) * b2 + g * g * one_minus_b2
    tl.store(exp_avg + i, m, mask=mask)
    tl.store(exp_avg_sq + i, v, mask=mask)
    # eq. 2.1b; eq. 3.1's r_t(v)
    w = w * decay - tl.div_rn(step_size * m, tl.sqrt_rn(v) * inv_sqrt_bc2 + eps)
    if P_KIND == 2:
        tl.store(param + i, w.to(tl.float16), mask=mask)
    else:
        u = 0.0
        if P_SR:
            if HAS_U:    # tests: the caller's uniforms
                u = tl.load(tl.load(row + TAB_U_P).to(tl.pointer_type(tl.float32)) + i, mask=mask, other=0.0)
            else:        # 16 bits of one Philox call per element: u = (k + 1/2) 2^-16
                seed = ((seed_of_step + tl.load(row + TAB_SEED_OF_INDEX)) % _SEED_MOD_TL).to(tl.uint32)
                lo = i.to(tl.uint32)
                q0, _, _, _ = philox(lo, (i >> 32).to(tl.uint32), lo * 0 + 2, lo * 0, seed, seed * 0, 7)
                u = tl.fma((q0 >> 16).to(tl.float32), 1.52587890625e-05, 7.62939453125e-06)
        x = _bf16_bits(w, u, P_SR)
        if P_CORR:
            tl.store(corr + i, _split_master(w, x), mask=mask)
        tl.store(param.to(tl.pointer_type(tl.int16), bitcast=True) + i, (x >> 16).to(tl.int16), mask=mask)


def adamw_step_triton(items, lr, b1, b2, eps, wd, t, rule, seed_of_step, cache, u=None):
    """adamw_step_torch for many tensors in one launch of _adamw_kernel (eq. 2.1a-b with FP32
    moments), bit for bit given the same SR uniforms.

    items:  (param, state, index) triples of one device, parameter dtype (bfloat16 or float16,
            contiguous), gradient dtype (float32, bfloat16 or float16, contiguous) and step t;
            state as in adamw_step_torch (all with or all without a param_correction); index the
            parameter's position from 1 (its SR seed is _sr_seed(seed, t, index)).
    rule:   the BF16 write, "rtn"|"sr"; seed_of_step: _seed_of_step(seed, t).
    cache:  a dict kept per optimizer (program and launch tables of each set of tensors).
    u:      optional list of float32 uniform tensors u_p per item (the SR write's), replacing the
            kernel's Philox bits (tests).
    """
    _adamw_launch(_adamw_prepare(items, rule, cache, u), lr, b1, b2, eps, wd, t, seed_of_step)


def _adamw_prepare(items, rule, cache, u=None, own_table=False):
    """Everything of adamw_step_triton's launch that does not change between steps (a dict for
    _adamw_launch; own_table: as in _triton_prepare)."""
    dev = items[0][0].device
    numels = tuple(p.numel() for p, _, _ in items)
    ptrs = tuple((p.data_ptr(), p.grad.data_ptr(), st["exp_avg"].data_ptr(), 0, st["exp_avg_sq"].data_ptr(),
                  0, i, p.numel(), st["param_correction"].data_ptr() if "param_correction" in st else 0)
                 + ((0, 0, u[j].data_ptr()) if u is not None else ())
                 for j, (p, st, i) in enumerate(items))
    progs, tab, extra = _cached_tables(cache, dev, (dev, "adamw", numels), numels, ADAMW_BLOCK,
                                       ("adamw", ptrs), ptrs, 1, own_table)
    p0 = items[0][0]
    bf16, p_corr = p0.dtype == torch.bfloat16, "param_correction" in items[0][1]
    return dict(dev=None, grid=(progs[0].numel(),), progs=progs[0], tab=tab, grads=tuple(r[1] for r in ptrs),
                flags=dict(HAS_U=u is not None, P_KIND=_DTYPE_KIND[p0.dtype], G_KIND=_DTYPE_KIND[p0.grad.dtype],
                           P_SR=bf16 and not p_corr and rule == "sr", P_CORR=bf16 and p_corr,
                           BLOCK=ADAMW_BLOCK, num_warps=4, **extra))


def _adamw_launch(launch, lr, b1, b2, eps, wd, t, seed_of_step):
    """Launch _adamw_kernel for an _adamw_prepare plan with step t's scalars."""
    (seed_of_step, decay, step_size, inv_sqrt_bc2), dev = _launch_scalars(launch, lr, b1, b2, wd, t, seed_of_step)
    _adamw_kernel[launch["grid"]](launch["progs"], launch["tab"], seed_of_step, decay, step_size,
                                  b1, 1 - b1, b2, 1 - b2, inv_sqrt_bc2, eps, *dev, **launch["flags"])
