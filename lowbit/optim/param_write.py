"""
The 16-bit parameter write of AdamW4bit (paper B's parameters in BF16 / FP16), one copy for the
torch references and one for both Triton kernels: BF16 round-to-nearest-even or stochastic
rounding, and the 24-bit master weight of eq. MW (an int8 correction per BF16 weight); and the
4-bit kernel's reads and writes of element pairs (even and odd elements, one word each where
aligned). Touches the parameter and its "param_correction" state only.

  "rtn"   round to nearest even (what a cast does);
  "sr"    stochastic rounding: with u ~ U[0, 1) and k = floor(u 2^16), add k to the FP32 bit
          pattern of w_t and keep its top 16 bits (round away from zero with probability equal
          to the dropped fraction of a BF16 ulp: E[bf16(w_t)] = w_t);
  [MW]    w = x + e 2^(E-15),  E = max(exponent of x, -111),  e in [-127, 127];
          written as x = RTN_bf16(w_t), e = clamp(round_half_even((w_t - x) 2^(15-E)), -127, 127)
(2^(E-15) is 1/256 of x's BF16 ulp and |w_t - x| <= ulp/2, so the master weight is w_t within
half a unit, or within one unit for the 1/256 of residuals clamped from +-128 to +-127;
x + e 2^(E-15) is exact in FP32). The step reads w = x + e 2^(E-15) instead of x.
"""
import torch
import triton
import triton.language as tl

from lowbit.numerics import bf16_rne_bits, tl_bf16_rne_bits, tl_bf16_round_bits
from lowbit.optim.lut import join_bits, unpair
from lowbit.optim.sr_bits import span_uniforms

PARAM_ROUNDINGS = ("rtn", "sr")
MASTER_WEIGHT_BITS = (None, 24)


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
        out = bf16_rne_bits(bits)
    else:
        if u is None or u.shape != w.shape:
            raise ValueError(f"rule='sr' needs uniforms u shaped like w {tuple(w.shape)}, got "
                             f"{None if u is None else tuple(u.shape)}")
        k = (u.float() * 65536).to(torch.int32)          # floor: u >= 0
        out = torch.where(w != w, bf16_rne_bits(bits), (bits + k) & -65536)
    return (out >> 16).to(torch.int16).view(torch.bfloat16)


def correction_unit(x):
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
    _, inv_unit = correction_unit(xf)
    y = (w.float() - xf) * inv_unit                  # exact: a power-of-two multiple
    y = torch.where(y == y, y, torch.zeros_like(y))
    return x, torch.round(y).clamp(-127, 127).to(torch.int8)


def join_master(x, e):
    """Inverse of split_master: float32 w = x + e 2^(E-15) (eq. MW), exact; x bfloat16, e int8
    of one shape."""
    xf = x.float()
    unit, _ = correction_unit(xf)
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


def write_step(param, w, corr, rule, u_p, gen, span=None):
    # the step's parameter write (write_param); the BF16 SR uniforms come after m's and v's (span:
    # an FSDP2 shard's place in its whole tensor, sr_bits.span_uniforms)
    if rule == "sr" and param.dtype == torch.bfloat16 and corr is None and u_p is None:
        u_p = span_uniforms(w.shape, gen, w.device, span)
    write_param(param, w, rule, corr, u_p)


# ---- the same in Triton, for both kernels ------------------------------------------------------

@triton.jit
def _bf16_bits(w, u, SR: tl.constexpr):
    # round_to_bf16 on float32 w: the BF16 result's bits in the top half of an int32
    bits = w.to(tl.int32, bitcast=True)
    if SR:
        return tl_bf16_round_bits(bits, (u * 65536.0).to(tl.int32))
    return tl_bf16_rne_bits(bits)


@triton.jit
def tl_join_master(x, e):
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
def param_bits16(w, u, corr, mask, P_KIND: tl.constexpr, P_SR: tl.constexpr, P_CORR: tl.constexpr):
    # write_param for a 16-bit parameter (P_KIND 1: BF16, 2: FP16): the new weight's 16-bit
    # pattern in the low half of an int32, the caller stores it; with P_CORR (BF16, eq. MW) e is
    # stored here at the pointers `corr`. u: the SR uniforms (P_SR).
    if P_KIND == 2:
        h = w.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    else:
        x = _bf16_bits(w, u, P_SR)
        if P_CORR:
            tl.store(corr, _split_master(w, x), mask=mask)
        h = (x >> 16) & 0xFFFF
    return h


@triton.jit
def tl_masked_load(ptr, mask):
    # tl.load, masked (zeros outside) only when a mask is given
    if mask is None:
        x = tl.load(ptr)
    else:
        x = tl.load(ptr, mask=mask, other=0)
    return x


@triton.jit
def tl_load_pairs(ptr, pair, mask, KIND: tl.constexpr, ALIGNED: tl.constexpr):
    # elements 2 pair and 2 pair + 1 of a float32 / BF16 / FP16 tensor (KIND: launch.DTYPE_KIND)
    # as float32 (BF16 and FP16 -> FP32 are exact): ALIGNED, from one 64- or 32-bit word per pair
    # (little-endian: the even element in the low half), else element by element
    if not ALIGNED:
        lo = tl_masked_load(ptr + 2 * pair, mask).to(tl.float32)
        hi = tl_masked_load(ptr + 2 * pair + 1, mask).to(tl.float32)
    elif KIND == 0:
        lo, hi = unpair(tl_masked_load(ptr.to(tl.pointer_type(tl.int64), bitcast=True) + pair, mask))
    else:
        word = tl_masked_load(ptr.to(tl.pointer_type(tl.int32), bitcast=True) + pair, mask)
        if KIND == 1:
            lo = (word << 16).to(tl.float32, bitcast=True)
            hi = (word & -65536).to(tl.float32, bitcast=True)
        else:
            lo = word.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (word >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def tl_store_pairs(param, corr, pair, w0, w1, u0, u1, mask, P_KIND: tl.constexpr, P_SR: tl.constexpr,
                   P_CORR: tl.constexpr, ALIGNED: tl.constexpr):
    # write_param of the new weights w0, w1 (float32) at elements 2 pair and 2 pair + 1: FP32 as
    # they are, 16-bit ones through param_bits16 (u0, u1: the SR uniforms; corr: eq. MW's
    # corrections); ALIGNED, one word per pair, else element by element
    if P_KIND == 0:
        if ALIGNED:
            tl.store(param.to(tl.pointer_type(tl.int64), bitcast=True) + pair, join_bits(w0, w1), mask=mask)
        else:
            tl.store(param + 2 * pair, w0, mask=mask)
            tl.store(param + 2 * pair + 1, w1, mask=mask)
    else:
        h0 = param_bits16(w0, u0, corr + 2 * pair, mask, P_KIND, P_SR, P_CORR)
        h1 = param_bits16(w1, u1, corr + 2 * pair + 1, mask, P_KIND, P_SR, P_CORR)
        if ALIGNED:
            tl.store(param.to(tl.pointer_type(tl.int32), bitcast=True) + pair, h0 | (h1 << 16), mask=mask)
        else:
            p16 = param.to(tl.pointer_type(tl.int16), bitcast=True) + 2 * pair
            tl.store(p16, h0.to(tl.int16), mask=mask)
            tl.store(p16 + 1, h1.to(tl.int16), mask=mask)
