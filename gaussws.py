"""Gaussian weight sampling (GaussWS) for pseudo-quantization training (PQT): paper A (Ahn & Yoo 2025,
arXiv:2505.11170). Equation, section, proposition and table numbers below are the paper's.

The math
--------
eq. 3    A linear layer samples its weight at every training call, in square 32×32 tiles
         (b_l = 32, §3.6; edge tiles are partial when m or n is not a multiple of 32):

             w_hat = w + R ⊙ broadcast_32( max_32(|w|) · 2^(1 − b_t) )

eq. 4    Gradients, treating ∂max/∂w ≈ 0 (R in backward must be the forward's, bit for bit):

             ∂L/∂w = ∂L/∂w_hat,    ∂L/∂b_t = −ln2 · max_32(|w|) · 2^(1−b_t) · sum_32(∂L/∂w_hat ⊙ R)

eq. 10   R ≈ round(N(0,1)/2) in {−2..2}, built from random bits with AND and OR only (§3.4):
         P(±2) = 3/4·2^−9, P(±1) = (3/4)²·2^−2·(1 − P(|R|=2)), P(0) = the rest. §3.4 gives the
         law and the AND/OR rules, not a bit assignment; ours takes 16 bits b0..b15 per element:
         sign = b0; |R| = 2 iff (b1|b2)&b3&..&b10; else |R| = 1 iff (b11|b12)&(b13|b14)&b15.
eq. 11   b_t = b_target + b_i·(b_init − b_target): one learnable b_i per tile, initialised to 1
         (§3.6); weight decay on b_i pulls b_t from b_init down to b_target (b_target <= b_init).
         Sampling uses clamp(b_t, B_MIN, B_MAX) = [1, 24] (why: lowbit/pqt/checks.py).
eq. 12   Optional loss term λ · Σ_layers mean_tiles |b_t − b_target| (`bitwidth_penalty`).
Table C  The smallest floating-point format that holds a tile (§3.3, Prop. 3–4): b_t ≤ 5 →
         FP8 e3m4, ≤ 9 → FP12 e4m7, ≤ 12 → FP16 e5m10 (lowbit/pqt/export.py: `cast_to_tiers`).

The kernels (§3.5)
------------------
The paper runs three separate steps; `fused=False` does exactly that:
  (1) `generate_noise`: Philox4x32-10 (key = layer key, counter = (word index, call counter))
      gives 4×32 random bits per packed word, 16 per element. Element j takes its 16 bits from
      nibble j of the 4 words, so whole-word AND/OR/shift ops evaluate the eq. 10 recipe for all
      8 elements at once and leave R packed: sign-magnitude, 4 bits per element, 8 per int32
      (element j of a group in bits [4j, 4j+4)), shape (m, ceil(n/8)).
  (2) `apply_noise`: one Triton program per 32-row × (BT·32)-column block reads w (any float
      dtype), computes the tile maxima in registers (partial edge tiles are masked), unpacks R,
      adds R·tilemax·2^(1−b_t) and writes w_hat (BF16 by default) and the tile maxima (kept for
      backward). In a layer's call it makes b_t (eq. 11) and 2^(1−b_t) from b_i itself, with
      torch's float32 roundings: no launch of its own on the tile grid.
  (3) The matmul: plain `F.linear(x, w_hat, bias)`.
The backward regenerates R from the forward's seed (counter-based Philox gives the same bits) and
one kernel writes ∂L/∂w and ∂L/∂b_i (tilemax · sum_32(∂L/∂w_hat ⊙ R) taken through eq. 11).
`fused=True` (the default of `GaussWSLinear` and `apply_pqt`) leaves out step (1): the apply and
grad kernels draw R from Philox themselves, the same R bit for bit, no packed R in memory.

Every kernel has a plain-PyTorch twin (`impl="torch"`) with the same math and names just before it:
eq. 10, eq. 3 and eq. 4 each read reference, kernel, wrapper. Philox runs on int64 tensors, so the
reference gives the same bits, packed R and w_hat (bit-exact for GaussWS, where R·scale is exact)
as the kernels. `impl="auto"` picks Triton for CUDA tensors and the reference for CPU tensors;
`impl="triton"` on CPU tensors needs TRITON_INTERPRET=1 (that is how the tests run the kernels).

Seeds (§3.6): user seed → seed generator (`random.Random(seed)` in `apply_pqt`) → one key per
layer → the layer's counter-based PRNG (Philox keyed by the layer key) whose stream number is the
layer's call counter t. Both live in the int64 buffer `noise_state = [key, t]`, so
`model.state_dict()` checkpoints them and a resumed run continues the same noise sequence. The
counter advances at every training-mode forward; backward reuses the seed of its forward (saved
in the autograd context), and activation recomputation (torch.utils.checkpoint, which re-runs the
forward inside backward) reuses the previous seed instead of advancing. Under torch.compile the
seed is saved for backward, never recomputed, also in a checkpointed region of the compiled model.
What activation checkpointing may and may not do with a layer: lowbit/pqt/ops.py.

Memory modes: "save" (paper: autograd keeps w_hat in BF16 for ∂L/∂x, +2 B/param) and "recompute"
(w_hat rebuilt in backward from (w, b_t, seed): no extra bytes, one more generate+apply).

Baselines (lowbit/pqt/baselines.py): DiffQ-style PQT (method="diffq"): eq. 3 with R ~ U(−0.5, 0.5)
in BF16; Box–Muller (method="bm", `generate_noise` only): R = round(N(0,1)/2), packed like ours.

This file holds the paper (references, kernels, the differentiable sample, the layers, apply_pqt,
remove_pqt); lowbit/pqt/ its machinery: tiles.py (the 32×32 grid), packing.py (4-bit R), tl.py
(NOISE codes, launch configuration, jit helpers), checks.py (argument checks, [B_MIN, B_MAX]),
ops.py (torch.library ops, per-call seeds), baselines.py (DiffQ, Box–Muller), surgery.py (what
apply_pqt and remove_pqt do to a model) and export.py (Figure 5 statistics, Table C casts).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake

from lowbit.numerics import f32
from lowbit.philox import philox_words, philox_words_torch
from lowbit.pqt import baselines as pqt_baselines
from lowbit.pqt.checks import (B_MAX, B_MIN, GEN_METHODS, MEMORY_MODES, METHODS, check_bits, check_choice, check_input,
                               check_layer_args, check_layer_dtypes, check_module, check_noise, check_out_dtype,
                               check_sample_args, check_seed, check_shape, check_tiles, check_weight, resolve_impl,
                               seed_tensor)
from lowbit.pqt.export import layer_bitwidth_stats
from lowbit.pqt.ops import compute_dtype, kernel_launcher, layer_seed, register_sample_ops
from lowbit.pqt.packing import to_int32, unpack_noise
from lowbit.pqt.surgery import Conv1DLayout, replace_linears, restore_linears
from lowbit.pqt.tiles import TILE, broadcast_tiles, tile_block, tile_grid, tile_programs
from lowbit.pqt.tl import (CONFIG, NOISE_DENSE, NOISE_FUSED, NOISE_PACKED, TRITON_INTERPRETED, launch_config, noise_mode,
                           tl_add_rn, tl_cast, tl_exp2, tl_interleave8, tl_max_nan)

# eq. 10: exact law of R for method "gaussws"
P2 = 0.75 * 2.0 ** -9                         # P(R=+2) = P(R=-2)
P1 = 0.75 ** 2 * 2.0 ** -2 * (1.0 - 2 * P2)   # P(R=+1) = P(R=-1)
P0 = 1.0 - 2 * P1 - 2 * P2
NOISE_PROBS = {-2: P2, -1: P1, 0: P0, 1: P1, 2: P2}


# ==============================================================================================
# eq. 10: the noise R (§3.4; step (1) of §3.5): the recipe bit by bit, on 8 elements at once (torch,
# then Triton on the Philox4x32-10 words of packed word p: counter (p, call counter), key = layer key)

def noise_from_bits_reference(bits16):
    """R of eq. 10 from one 16-bit integer per element, bit by bit (sign = b0; |R| = 2 iff
    (b1|b2)&b3&..&b10; else 1 iff (b11|b12)&(b13|b14)&b15): the readable per-bit version of
    `_recipe_torch`, used by tests. bits16: int tensor, values in [0, 2^16)."""
    b = [(bits16 >> i) & 1 for i in range(16)]
    is2 = (b[1] | b[2]) & b[3] & b[4] & b[5] & b[6] & b[7] & b[8] & b[9] & b[10]
    is1 = (b[11] | b[12]) & (b[13] | b[14]) & b[15]
    mag = torch.where(is2 == 1, 2, torch.where(is1 == 1, 1, 0))
    return torch.where(b[0] == 1, -mag, mag).to(torch.int8)


def _recipe_torch(r0, r1, r2, r3):
    """Our eq. 10 recipe for 8 elements at once (SWAR over nibble lanes). Element j of a packed word
    takes its 16 random bits from nibble j (bits 4j..4j+3) of the 4 Philox words:
        sign = r0[4j]; is2 = (r0[4j+1] | r0[4j+2]) & AND(r1[4j..4j+3], r2[4j..4j+3]);
        is1 = (r3[4j] | r3[4j+1]) & (r3[4j+2] | r3[4j+3]) & r0[4j+3].
    The result is already the packed word: nibble j = sign<<3 | |R| (zero stored as +0)."""
    lane = 0x11111111
    o12 = (r0 >> 1) | (r0 >> 2)                     # bit 4j: b1|b2            P = 3/4
    t = r1 & r2
    t = t & (t >> 2)
    t = t & (t >> 1)                                # bit 4j: AND of 8 bits    P = 2^-8
    is2 = o12 & t & lane
    p = r3 | (r3 >> 1)
    is1 = p & (p >> 2) & (r0 >> 3) & lane           # (b11|b12)&(b13|b14)&b15  P = 9/32
    sign = r0 & (is1 | is2)
    return (sign << 3) | (is2 << 1) | (is1 & (is2 ^ lane))


@triton.jit
def _recipe(r0, r1, r2, r3):
    """Our eq. 10 recipe on uint32 words: the Triton twin of `_recipe_torch` (same ops, same
    names), the only Triton copy; every kernel that makes GaussWS R calls it via `_packed_words`."""
    LANE: tl.constexpr = 0x11111111
    o12 = (r0 >> 1) | (r0 >> 2)
    t = r1 & r2
    t = t & (t >> 2)
    t = t & (t >> 1)
    is2 = o12 & t & LANE
    p = r3 | (r3 >> 1)
    is1 = p & (p >> 2) & (r0 >> 3) & LANE
    sign = r0 & (is1 | is2)
    return (sign << 3) | (is2 << 1) | (is1 & (is2 ^ LANE))


@triton.jit
def _packed_words(seed_ptr, p):
    """Packed GaussWS R for word indices p: Philox, then the recipe."""
    r0, r1, r2, r3 = philox_words(seed_ptr, p)
    return _recipe(r0, r1, r2, r3)


def _gen_gaussws_torch(m, n, seed):
    n8 = -(-n // 8)
    idx = torch.arange(m * n8, device=seed.device, dtype=torch.int64)
    return to_int32(_recipe_torch(*philox_words_torch(seed, idx))).view(m, n8)


@triton.jit
def _gen_gaussws_kernel(out_ptr, seed_ptr, n_words, BLOCK: tl.constexpr):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    packed = _packed_words(seed_ptr, p)
    tl.store(out_ptr + p, packed.to(tl.int32, bitcast=True), mask=p < n_words)


def _generate_torch(m, n, seed, method):
    """R for an (m, n) weight in plain PyTorch: packed int32 (m, ceil(n/8)) for "gaussws" and
    "bm", BF16 (m, n) for "diffq"."""
    if method == "gaussws":
        return _gen_gaussws_torch(m, n, seed)
    if method == "diffq":
        return pqt_baselines.gen_diffq_torch(m, n, seed)
    return pqt_baselines.gen_bm_torch(m, n, seed)


def generate_triton(m, n, seed, method, block=None, num_warps=None):
    n8 = -(-n // 8)
    n_words = m * n8
    block = block or CONFIG["gen_block"]
    num_warps = num_warps or CONFIG["gen_warps"]
    grid = (triton.cdiv(n_words, block),)
    if method == "diffq":
        out = torch.empty(m, n, dtype=torch.bfloat16, device=seed.device)
        kernel_launcher(pqt_baselines.gen_diffq_kernel)[grid](out, seed, m, n, n8, BLOCK=block, num_warps=num_warps)
        return out
    out = torch.empty(m, n8, dtype=torch.int32, device=seed.device)
    kernel = _gen_gaussws_kernel if method == "gaussws" else pqt_baselines.gen_bm_kernel
    kernel_launcher(kernel)[grid](out, seed, n_words, BLOCK=block, num_warps=num_warps)
    return out


def generate_noise(shape, seed, method="gaussws", impl="auto", device=None):
    """Step (1) of §3.5: noise R for a weight of `shape` = (m, n).

    seed: int (key, counter 0) or int64 tensor [key, counter]. method: "gaussws" (eq. 10, packed
    int32 (m, ceil(n/8)), 4 bits/element), "bm" (round(N(0,1)/2) by Box–Muller, same packing,
    benchmark baseline) or "diffq" (U(-0.5, 0.5) as BF16 (m, n)). The same seed gives the same
    R for impl "torch" and "triton" (bit-exact for "gaussws" and "diffq"; "bm" uses
    transcendental functions whose last bits differ across backends). device: where R is made
    (default: the seed tensor's device, else CPU).
    Raises ValueError/TypeError on a bad shape, seed, method or impl."""
    check_choice("method", method, GEN_METHODS)
    m, n = check_shape(shape)
    dev = device if device is not None else (seed.device if isinstance(seed, torch.Tensor) else "cpu")
    seed = seed_tensor(seed, dev)
    if resolve_impl(impl, seed) == "triton":
        return generate_triton(m, n, seed, method)
    return _generate_torch(m, n, seed, method)


# ==============================================================================================
# eq. 3: w_hat = w + R ⊙ broadcast_32(max_32(|w|) · 2^(1 − b_t))  (step (2) of §3.5): 2^(1−b_t),
# max_32(|w|), R as float32 values, then the apply

def _pow2(b_t):
    """2^(1 − clamp(b_t, B_MIN, B_MAX)) in float32, contiguous (the PQN scale of eq. 3). Autograd:
    d/d b_t = −ln2 · 2^(1−b_t) inside the range (eq. 4), 0 outside."""
    return torch.exp2(1.0 - b_t.float().clamp(B_MIN, B_MAX)).contiguous()


def _tile_max_torch(w):
    m, n = w.shape
    tm, tn = tile_grid(m, n)
    a = F.pad(w.float().abs(), (0, tn * TILE - n, 0, tm * TILE - m))  # |w| >= 0: zero pad is neutral
    return a.view(tm, TILE, tn, TILE).amax(dim=(1, 3))


@triton.jit
def _tile_absmax(w):
    """max_32(|w|) of a (32, BT, 32) block: (BT,) (masked-out elements loaded as 0 are neutral).
    A NaN in a tile makes its maximum NaN, as torch's amax (tl.max would skip it)."""
    return tl.reduce(tl.reduce(tl.abs(w), 2, tl_max_nan), 0, tl_max_nan)


@triton.jit
def _tilemax_kernel(w_ptr, out_ptr, M, N, TN, BT: tl.constexpr):
    ti, tidx, row, col, mask = tile_block(M, N, TN, BT)
    w = tl.load(w_ptr + row * N + col, mask=mask, other=0.0).to(tl.float32)
    tmax = _tile_absmax(w)
    tl.store(out_ptr + tidx, tmax, mask=ti < TN)


def tile_max(w, impl="auto"):
    """max_32(|w|) of eq. 3 for w (m, n) float32/bfloat16/float16: float32 tensor of the tile grid
    shape (ceil(m/32), ceil(n/32)); edge tiles are partial (the max over the elements that exist).
    Raises TypeError / ValueError on a bad w or impl."""
    check_weight(w)
    w = w.contiguous()
    if resolve_impl(impl, w) == "torch":
        return _tile_max_torch(w)
    m, n = w.shape
    tm, tn = tile_grid(m, n)
    out = torch.empty(tm, tn, dtype=torch.float32, device=w.device)
    bt = CONFIG["apply_bt"]
    _tilemax_kernel[tile_programs(tm, tn, bt)](w, out, m, n, tn, BT=bt, num_warps=CONFIG["apply_warps"])
    return out


def _noise_values_torch(noise, method, n):
    return unpack_noise(noise, n).float() if method == "gaussws" else noise.float()


@triton.jit
def _noise_block(r_ptr, seed_ptr, row, col, ti, mask, M, N, N8, NOISE: tl.constexpr):
    """R as float32 for a (32, BT, 32) block, as `_noise_values_torch`; NOISE: NOISE_PACKED,
    NOISE_DENSE or NOISE_FUSED (R drawn here)."""
    if NOISE == NOISE_DENSE:
        r = tl.load(r_ptr + row * N + col, mask=mask, other=0.0).to(tl.float32)
    else:
        q = ti[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]    # word column, (1, BT, 4)
        if NOISE == NOISE_PACKED:
            w = tl.load(r_ptr + row * N8 + q, mask=(row < M) & (q < N8), other=0)
        else:
            w = _packed_words(seed_ptr, row * N8 + q)
        nib = tl_interleave8(w & 0xF, (w >> 4) & 0xF, (w >> 8) & 0xF, (w >> 12) & 0xF,
                           (w >> 16) & 0xF, (w >> 20) & 0xF, (w >> 24) & 0xF, (w >> 28) & 0xF)
        mag = (nib & 7).to(tl.float32)
        r = tl.where((nib & 8) != 0, -mag, mag)
    return r


def _apply_torch(w, noise, pow2, method, out_dtype):
    """eq. 3 in plain PyTorch: (w_hat in out_dtype, tile maxima float32)."""
    m, n = w.shape
    tmax = _tile_max_torch(w)
    scale = broadcast_tiles(tmax * pow2.float(), m, n)
    w_hat = (w.float() + _noise_values_torch(noise, method, n) * scale).to(out_dtype)
    return w_hat, tmax


@triton.jit
def _apply_kernel(w_ptr, r_ptr, pow2_ptr, out_ptr, tmax_ptr, seed_ptr, b_ptr, live_ptr, b_target, b_scale,
                  M, N, N8, TN, NOISE: tl.constexpr, BT: tl.constexpr, BITS: tl.constexpr,
                  B_LO: tl.constexpr, B_HI: tl.constexpr, INTERPRET: tl.constexpr):
    """eq. 3 in Triton, one program = 32 rows × BT tiles: w_hat = w + R·tilemax·2^(1-b_t). With
    BITS, 2^(1-b_t) is not read but made from b here (`_tile_bits_torch`), and written masked by
    the clamp range of b_t (`_pow2_live_torch`) for the backward: no launch of its own per call."""
    ti, tidx, row, col, mask = tile_block(M, N, TN, BT)
    w = tl.load(w_ptr + row * N + col, mask=mask, other=0.0).to(tl.float32)
    tmax = _tile_absmax(w)                                             # (BT,), edge tiles masked
    tmask = ti < TN
    if BITS:
        b = tl.load(b_ptr + tidx, mask=tmask, other=0.0).to(tl.float32)
        # eq. 11 as torch rounds it: the product to float32 (exact in float64, then rounded once),
        # then the sum, rounded again. The scalars come in as float32 or (from Inductor) float64
        p = (b.to(tl.float64) * b_scale).to(tl.float32)
        b_t = tl_add_rn(p, (tl.zeros_like(p) + b_target).to(tl.float32), INTERPRET)
        pow2 = tl_exp2(1.0 - tl.where(b_t < B_LO, B_LO, tl.where(b_t > B_HI, B_HI, b_t)), INTERPRET)   # torch's clamp, NaN kept
        tl.store(live_ptr + tidx, tl.where((b_t >= B_LO) & (b_t <= B_HI), pow2, 0.0), mask=tmask)
    else:
        pow2 = tl.load(pow2_ptr + tidx, mask=tmask, other=0.0)
    r = _noise_block(r_ptr, seed_ptr, row, col, ti, mask, M, N, N8, NOISE)
    w_hat = w + r * (tmax * pow2)[None, :, None]
    tl.store(out_ptr + row * N + col, tl_cast(w_hat, out_ptr.dtype.element_ty), mask=mask)
    tl.store(tmax_ptr + tidx, tmax, mask=tmask)


def apply_triton(w, noise, pow2, seed, method, out_dtype, fused, bt=None, num_warps=None, bits=None):
    """The kernel's (w_hat, tile maxima) from 2^(1-b_t) (pow2, float32 tiles); or, with
    bits = (b, b_target, b_scale) (b contiguous tiles, pow2 None), from b as `_tile_bits_torch`
    makes it, and `_pow2_live_torch`'s tiles as a third output."""
    m, n = w.shape
    tm, tn = tile_grid(m, n)
    mode = noise_mode(method, fused)
    cfg = launch_config("apply", mode, tm * tn)
    bt, num_warps = bt or cfg[0], num_warps or cfg[1]
    w_hat = torch.empty(m, n, dtype=out_dtype, device=w.device)
    tmax = torch.empty(tm, tn, dtype=torch.float32, device=w.device)
    live = torch.empty(tm, tn, dtype=torch.float32, device=w.device) if bits is not None else tmax
    b, b_target, b_scale = bits if bits is not None else (tmax, 0.0, 1.0)
    b_target, b_scale = f32(b_target), f32(b_scale)   # torch's float32 scalars, also in the interpreter
    r = w if mode == NOISE_FUSED else noise   # unused pointer in fused mode
    kernel_launcher(_apply_kernel)[tile_programs(tm, tn, bt)](w, r, tmax if pow2 is None else pow2, w_hat, tmax, seed,
                                             b, live, b_target, b_scale, m, n, -(-n // 8), tn,
                                             NOISE=mode, BT=bt, BITS=bits is not None, B_LO=B_MIN,
                                             B_HI=B_MAX, INTERPRET=TRITON_INTERPRETED, num_warps=num_warps)
    return (w_hat, tmax) if bits is None else (w_hat, tmax, live)


def apply_noise(w, noise, b_t, method="gaussws", out_dtype=torch.bfloat16, impl="auto"):
    """Step (2) of §3.5, eq. 3 without autograd: returns (w_hat (m, n) in out_dtype, tile maxima
    float32 (ceil(m/32), ceil(n/32))).

    w: (m, n) float32/bfloat16/float16 (non-contiguous is copied); noise: from `generate_noise`
    with the same method (int32 (m, ceil(n/8)) for "gaussws", BF16 (m, n) for "diffq"); b_t:
    tile-grid tensor of bitwidths (clamped to [B_MIN, B_MAX]).
    Raises TypeError / ValueError on a bad w, b_t, noise (type, dtype, shape, device), out_dtype,
    method or impl."""
    check_choice("method", method, METHODS)
    check_weight(w)
    check_tiles(b_t, w, "b_t")
    w = w.contiguous()
    check_noise(noise, w, method)
    check_out_dtype(out_dtype)
    with torch.no_grad():
        pow2 = _pow2(b_t)
        if resolve_impl(impl, w) == "torch":
            return _apply_torch(w, noise, pow2, method, out_dtype)
        return apply_triton(w, noise.contiguous(), pow2, None, method, out_dtype, False)


# ==============================================================================================
# eq. 4: ∂L/∂w = ∂L/∂w_hat, ∂L/∂(2^(1−b_t)) = max_32(|w|) · sum_32(∂L/∂w_hat ⊙ R)

def _grad_torch(g, noise, tmax, method, w_dtype, bits=None):
    """eq. 4 in plain PyTorch: (∂L/∂w in w_dtype, ∂L/∂(2^(1−b_t)) float32 tiles); with
    bits = (live, b_scale, b_dtype) the second is ∂L/∂b (`_bits_grad_torch`)."""
    m, n = g.shape
    tm, tn = tmax.shape
    gr = F.pad(g.float() * _noise_values_torch(noise, method, n), (0, tn * TILE - n, 0, tm * TILE - m))
    dpow2 = tmax * gr.view(tm, TILE, tn, TILE).sum(dim=(1, 3))
    return g.to(w_dtype, copy=True), dpow2 if bits is None else _bits_grad_torch(dpow2, *bits)


@triton.jit
def _grad_kernel(g_ptr, r_ptr, tmax_ptr, dw_ptr, db_ptr, seed_ptr, live_ptr, b_scale,
                 M, N, N8, TN, NOISE: tl.constexpr, BT: tl.constexpr, CHAIN: tl.constexpr):
    """eq. 4 in Triton: dw = g (cast to w's dtype); d(2^(1-b_t)) = tilemax · sum_32(g ⊙ R), and
    with CHAIN ∂L/∂b from it (the bitwidths section's formula, `_bits_grad_torch`), in b's dtype."""
    ti, tidx, row, col, mask = tile_block(M, N, TN, BT)
    g = tl.load(g_ptr + row * N + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(dw_ptr + row * N + col, tl_cast(g, dw_ptr.dtype.element_ty), mask=mask)
    r = _noise_block(r_ptr, seed_ptr, row, col, ti, mask, M, N, N8, NOISE)
    s = tl.sum(tl.sum(g * r, axis=2), axis=0)
    tmask = ti < TN
    tmax = tl.load(tmax_ptr + tidx, mask=tmask, other=0.0)
    d = tmax * s
    if CHAIN:
        live = tl.load(live_ptr + tidx, mask=tmask, other=0.0)
        # b_scale is a float32 value; Inductor passes it as float64: the float64 product of two
        # float32 values is exact, so rounding it once gives the float32 product either way
        d = (tl.where(live != 0, -((d * live) * 0.6931471805599453), 0.0) * b_scale).to(tl.float32)
    tl.store(db_ptr + tidx, tl_cast(d, db_ptr.dtype.element_ty), mask=tmask)


def grad_triton(g, noise, tmax, seed, method, w_dtype, fused, bt=None, num_warps=None, bits=None):
    """The kernel's (∂L/∂w, ∂L/∂(2^(1−b_t))), or (∂L/∂w, ∂L/∂b) with bits = (live, b_scale,
    b_dtype) (live: `_pow2_live_torch`'s contiguous float32 tiles), as `_grad_torch`."""
    m, n = g.shape
    tm, tn = tmax.shape
    mode = noise_mode(method, fused)
    cfg = launch_config("grad", mode, tm * tn)
    bt, num_warps = bt or cfg[0], num_warps or cfg[1]
    live, b_scale, b_dtype = bits if bits is not None else (tmax, 1.0, torch.float32)
    dw = torch.empty(m, n, dtype=w_dtype, device=g.device)
    db = torch.empty(tm, tn, dtype=b_dtype, device=g.device)
    r = g if mode == NOISE_FUSED else noise
    kernel_launcher(_grad_kernel)[tile_programs(tm, tn, bt)](g, r, tmax, dw, db, seed, live, f32(b_scale),
                                            m, n, -(-n // 8), tn, NOISE=mode, BT=bt,
                                            CHAIN=bits is not None, num_warps=num_warps)
    return dw, db


# ==============================================================================================
# the differentiable sample: eq. 3 forward, eq. 4 backward. Eager calls run the plain functions
# (an autograd.Function); under torch.compile the torch.library triton ops of lowbit/pqt/ops.py,
# whose Triton kernels Inductor launches from its own generated code

def _regenerate(m, n, seed, method, impl, fused):
    """R for a call, from its seed (forward and backward alike): the torch reference, packed R
    from kernel 1, or None where the fused GaussWS kernel draws R itself."""
    if impl == "torch":
        return _generate_torch(m, n, seed, method)
    return None if (fused and method == "gaussws") else generate_triton(m, n, seed, method)


def _pqn_sample_impl(w: torch.Tensor, b: torch.Tensor, seed: torch.Tensor, method: str, out_dtype: torch.dtype,
                     impl: str, fused: bool, b_target: float,
                     b_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w_hat, tile maxima, `_pow2_live_torch`) of a call (eq. 3), b_t = b_target + b·b_scale
    (`_tile_bits_torch`; the kernel computes it itself). b (contiguous tiles) is also the tensor
    ∂L/∂b goes to."""
    if impl == "triton" and not w.is_cuda and is_fake(w):
        # torch.compile traces the op (FakeTensors): Inductor compiles Triton kernels for CUDA only
        raise RuntimeError("impl='triton' under torch.compile needs CUDA tensors; use impl='torch' on CPU")
    noise = _regenerate(*w.shape, seed, method, impl, fused)
    if impl == "torch":
        b_t, pow2 = _tile_bits_torch(b, b_target, b_scale)
        return *_apply_torch(w, noise, pow2, method, out_dtype), _pow2_live_torch(b_t, pow2)
    return apply_triton(w, noise, None, seed, method, out_dtype, fused, bits=(b, b_target, b_scale))


def _pqn_grad_impl(g: torch.Tensor, tmax: torch.Tensor, seed: torch.Tensor, live: torch.Tensor,
                   method: str, w_dtype: torch.dtype, b_dtype: torch.dtype, impl: str, fused: bool,
                   b_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(∂L/∂w, ∂L/∂b) of a call (eq. 4)."""
    g = g.contiguous()
    noise = _regenerate(*g.shape, seed, method, impl, fused)
    bits = (live, b_scale, b_dtype)
    if impl == "torch":
        return _grad_torch(g, noise, tmax, method, w_dtype, bits)
    return grad_triton(g, noise, tmax, seed, method, w_dtype, fused, bits=bits)


# _pqn_sample(w, b, seed, method, out_dtype, impl, fused, b_target, b_scale) -> (w_hat, tile max,
# live), differentiable in w and b; _recompute_linear: F.linear(x, w_hat, bias), w_hat rebuilt in backward
_pqn_sample, _recompute_linear = register_sample_ops(_pqn_sample_impl, _pqn_grad_impl)


def gaussws_sample(w, b_t, seed, method="gaussws", out_dtype=torch.bfloat16, impl="auto", fused=False):
    """Differentiable w_hat = w + R ⊙ broadcast_32(max_32(|w|)·2^(1−b_t)) (eq. 3) with the
    gradients of eq. 4 (∂L/∂w = ∂L/∂w_hat; ∂L/∂b_t = −ln2·max_32|w|·2^(1−b_t)·sum_32(∂L/∂w_hat ⊙ R),
    R regenerated from `seed` in backward).

    w: (m, n), m, n >= 1, float32 (bf16/fp16 accepted); b_t: (ceil(m/32), ceil(n/32)) float,
    used as clamp(b_t, B_MIN, B_MAX) = [1, 24] bits (∂L/∂b_t = 0 where clamped); seed: int in
    [0, 2**63) or int64 tensor [key, counter]; returns w_hat (m, n) in out_dtype: BF16 unless
    given, also for an FP32 w (the paper's w_hat; out_dtype=torch.float32 for FP32).
    fused=True generates R inside the apply/grad kernels (GaussWS only; same R, same result).
    A NaN in w makes its whole tile NaN (its tile maximum is NaN, as torch's amax); a NaN b_t
    makes its tile NaN, with ∂L/∂b_t = 0 there (values are not checked: that would wait for the
    GPU). impl "torch" and "triton" give the same bits on CUDA; on CPU numpy's exp2 (the
    interpreter) and torch's may differ in the last bit of 2^(1−b_t), so w_hat by 1 ulp there.
    Raises TypeError (w dtype, out_dtype, seed type, fused not a bool) / ValueError (shapes, w and
    b_t on different devices, empty w, seed range, a seed tensor's dtype or shape, method, impl)."""
    impl = check_sample_args(w, b_t, method, impl, fused)
    seed = seed_tensor(seed, w.device)
    check_out_dtype(out_dtype)
    return _pqn_sample(w.contiguous(), b_t.contiguous(), seed, method, out_dtype, impl, fused, *_sample_bits())[0]


def pqt_linear(x, w, b_t, bias, seed, method="gaussws", memory="save", impl="auto", fused=False):
    """Linear layer with a sampled weight: F.linear(x, w_hat, bias), w_hat from eq. 3, gradients
    of eq. 4.

    x: (..., n), float32/bfloat16/float16; w: (m, n); b_t: tile grid of w (clamped to [B_MIN, B_MAX]
    as in `gaussws_sample`); bias: (m,) or None; seed as in `gaussws_sample`. w_hat is made in the
    compute dtype (the autocast dtype when autocast is on — BF16 in training — else x.dtype).
    memory="save": autograd keeps w_hat (paper, +2 B/param); "recompute": rebuilt in backward.
    Returns y (..., m).
    Raises TypeError (x or w dtype, seed type, fused not a bool) / ValueError (shapes, bias shape,
    w and b_t on different devices, memory, method, impl, seed)."""
    return _pqt_linear(x, w, b_t, None, None, bias, seed, method, memory, impl, fused)


def _pqt_linear(x, w, b, b_init, b_target, bias, seed, method, memory, impl, fused):
    """`pqt_linear` with b_t from b as `_sample_bits` makes it: b = b_t (b_init None) or a
    layer's b_i (eq. 11), whose gradient then comes from the grad kernel as it is. seed may also
    be a function that draws it (a layer's `_next_seed`), called once everything is checked: a
    failed call draws no noise."""
    check_choice("memory", memory, MEMORY_MODES)
    impl = check_sample_args(w, b, method, impl, fused, "b_t" if b_init is None else "b_i")
    check_input(x, w, bias)
    seed = seed_tensor(seed() if callable(seed) else seed, w.device)
    cd = compute_dtype(x)
    b, bits = b.contiguous(), _sample_bits(b_init, b_target)
    # the bias in w_hat's dtype, as autocast casts it (outside autocast x may be BF16, the bias FP32)
    bias = bias.to(cd) if bias is not None else None
    if memory == "save":
        return F.linear(x, _pqn_sample(w.contiguous(), b, seed, method, cd, impl, fused, *bits)[0], bias)
    xb = x.to(cd)
    with torch.autocast(x.device.type, enabled=False):
        return _recompute_linear(xb, w.contiguous(), b, seed, bias, method, impl, fused, *bits)


# ==============================================================================================
# seeds (§3.6): a layer's Philox key from its seed; its per-call seed [key, t] is `layer_seed`
# (lowbit/pqt/ops.py: one op, safe under activation checkpointing and torch.compile)

def _splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


# ==============================================================================================
# bitwidths: eq. 11 inside a call, b_t from the tensor b the caller differentiates (a layer's b_i;
# b_t itself for the public calls), and ∂L/∂b back through 2^(1 − clamp(b_t)) and eq. 11:
#
#     ∂L/∂b = where(B_MIN <= b_t <= B_MAX, −((∂L/∂2^(1−b_t) · 2^(1−b_t)) · ln2), 0) · b_scale
#
# b_scale = b_init − b_target for b_i (eq. 11), 1 for b_t; the mask and 2^(1−b_t) come in as one
# tile tensor (`_pow2_live_torch`). These are the float32 operations, in the order, that autograd
# runs through `_pow2` and `_bitwidth` (exp2: (grad · result) · ln2; rsub: negate; clamp: the
# mask, ends included; mul: · b_scale), so the bits are autograd's; being products only, no FMA
# can change them. It saves the launches of those autograd ops (compiled: one Inductor kernel).

LN2 = math.log(2)


def _bitwidth(b_i, b_init, b_target, b_scale=None):
    """eq. 11: b_t = b_target + b_i·(b_init − b_target), float32, not clamped. The one place it is
    computed in torch (`_apply_kernel` is its Triton twin). b_scale: b_init − b_target as the sample
    op carries it (`_sample_bits`; b_init then unused), so that b_i·b_scale rounds as here; with
    b_scale 1 and b_target 0 (the public calls) b_t is b_i itself."""
    return b_target + b_i.float() * (b_init - b_target if b_scale is None else b_scale)


def _sample_bits(b_init=None, b_target=None):
    """(b_target, b_scale) of the sample op's b_t = b_target + b·b_scale: (0, 1) where b is b_t
    itself (b_init None: the public calls), eq. 11 where b is a layer's b_i."""
    return (0.0, 1.0) if b_init is None else (float(b_target), float(b_init - b_target))


def _tile_bits_torch(b, b_target, b_scale):
    """(b_t, 2^(1−clamp(b_t))) float32 of eq. 11 and eq. 3 from b: b_t = b_target + b·b_scale
    (a layer: b = b_i, b_scale = b_init − b_target; the public calls: b = b_t, (0, 1))."""
    b_t = _bitwidth(b, None, b_target, b_scale)
    return b_t, _pow2(b_t)


def _pow2_live_torch(b_t, pow2):
    """What the backward needs of b_t: 2^(1−b_t) where B_MIN <= b_t <= B_MAX (clamp passes the
    gradient there, ends included), 0 where it is clamped (no gradient; 2^(1−b_t) >= 2^-23 is never
    0 inside the range, so `!= 0` is the clamp's mask again). The sampling kernel writes it so a
    compiled backward reads it from memory: were it b_t and 2^(1−b_t) themselves, Inductor would
    recompute them from b_i in a kernel of its own before the grad kernel (cheap pointwise ops)."""
    return torch.where((b_t >= B_MIN) & (b_t <= B_MAX), pow2, 0.0)


def _bits_grad_torch(dpow2, live, b_scale, b_dtype):
    """∂L/∂b from ∂L/∂2^(1−b_t) and `_pow2_live_torch` (float32 tiles): the formula above in
    autograd's order, cast to b's dtype (autograd's backward of b.float())."""
    d = torch.where(live != 0, -((dpow2 * live) * LN2), 0.0)
    return (d * b_scale).to(b_dtype)


def bitwidth_penalty(model):
    """Σ_layers mean_tiles |b_t − b_target| (the λ term of eq. 12; the trainer multiplies by λ),
    on the unclamped eq. 11 b_t so it also pulls tiles that left [B_MIN, B_MAX] back toward
    b_target. Scalar float32 tensor, differentiable w.r.t. every b_i; 0 (an empty sum) when the
    model has no PQT layer. TypeError if model is not an nn.Module."""
    check_module(model, "bitwidth_penalty")
    terms = [(m.b_t - m.b_target).abs().mean() for _, m in pqt_layers(model)]
    if not terms:
        p = next(model.parameters(), None)
        return torch.zeros((), device=p.device if p is not None else "cpu")
    return torch.stack(terms).sum()


def bitwidth_stats(model):
    """Figure 5 statistics of the bitwidths the layers sample with: b_t of eq. 11 clamped to
    [B_MIN, B_MAX] (as in the forward), parameter-weighted (edge tiles count their real size).
    Returns {layer name: {mean, std, min, max, params, share_le5, share_le9, share_le12, tier}}
    plus the key "all" aggregating every PQT layer; `tier` is the Table C format for the max
    (lowbit.pqt.export.fp_tier), the share_le keys are the FP_TIERS limits.
    Raises TypeError if model is not an nn.Module and ValueError if it has no GaussWSLinear layer
    (statistics of no tiles are undefined; train.py only calls it after apply_pqt replaced some)."""
    check_module(model, "bitwidth_stats")
    layers = pqt_layers(model)
    if not layers:
        raise ValueError(f"bitwidth_stats: model {type(model).__name__} has no GaussWSLinear layer "
                         "(call apply_pqt first)")
    return layer_bitwidth_stats(layers)


# ==============================================================================================
# the layer

class GaussWSLinear(nn.Linear):
    """Drop-in nn.Linear whose weight is sampled by eq. 3 in training mode (paper A).

    Args: in_features, out_features (ints >= 1), bias as nn.Linear; method "gaussws" (R of
    eq. 10) or "diffq" (R ~ U(-0.5, 0.5) in BF16); b_init, b_target (eq. 11; defaults 6 and 4;
    numbers in [B_MIN, B_MAX] = [1, 24] with b_target <= b_init, equal = fixed bitwidth); seed:
    int in [0, 2**63), this layer's seed (its Philox key is splitmix64(seed)); memory "save"
    (paper: w_hat kept in BF16 for backward) or "recompute" (w_hat rebuilt in backward); impl
    "auto"|"torch"|"triton"; fused: generate R inside the apply/grad kernels (GaussWS, Triton;
    default: faster, see `python bench.py --only noise`; same R and same w_hat bits); fused=False
    is the paper's 3-kernel design (§3.5); dtype: float32 (default), bfloat16 or float16.
    Raises ValueError / TypeError (float64 or other dtypes, seed type, fused not a bool) at
    construction; at the first training forward, TypeError naming the layer if the weight was cast
    to another dtype since (model.double()), and RuntimeError for impl "triton" on CPU tensors
    without TRITON_INTERPRET=1 (the layer may be moved to a GPU before that).

    Parameters: weight (out, in) and bias as nn.Linear, `b_i` (ceil(out/32), ceil(in/32)) init 1
    (put weight decay on it to pull b_t to b_target), float32 whatever the weight dtype: b_i
    starts at 1.0, where BF16's spacing is 2^-7 (FP16's 2^-10), so the ~1e-3 optimizer steps of a
    BF16 b_i round away and b_t never learns; b_t is computed in float32. A later cast of the
    model (`model.to(torch.bfloat16)`) also casts b_i: the first training forward then warns,
    naming the layer (`layer.b_i.data = layer.b_i.data.float()` or cast the model before
    apply_pqt fixes it). Buffer `noise_state` int64 [key, call counter] (checkpointed by
    state_dict). The counter advances by one at every training-mode forward (not at the re-run of
    a forward by activation checkpointing: compiled, the seed is saved for backward; in eager code
    the re-run reuses the last seed, and a layer called twice in one checkpointed region, or
    checkpointed again before the backward, raises RuntimeError in that backward); eval mode uses
    w itself (no noise) unless `sample_in_eval` is set, in which case it samples with the current
    state without advancing it. `reset_parameters()` initialises weight, bias, b_i and noise_state
    as at construction.

    Under FSDP2 (fully_shard) weight, bias and b_i are all-gathered around each forward and
    backward, so R, w_hat and the gradients are the unsharded layer's bit for bit; noise_state, a
    buffer, is on every rank and advances alike. b_i is float32 and FSDP2 wants one dtype per
    group: shard BF16 training as FP32 parameters with MixedPrecisionPolicy(param_dtype=bfloat16).
    """

    def __init__(self, in_features, out_features, bias=True, method="gaussws", b_init=6.0,
                 b_target=4.0, seed=0, memory="save", impl="auto", fused=True, device=None, dtype=None):
        check_layer_args(in_features, out_features, method, memory, impl, fused, dtype)
        check_bits(b_init, b_target)
        check_seed(seed)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.method, self.memory, self.impl, self.fused = method, memory, impl, fused
        self.b_init, self.b_target = float(b_init), float(b_target)
        self.sample_in_eval = False
        self.b_i = nn.Parameter(torch.ones(tile_grid(out_features, in_features), device=device,
                                           dtype=torch.float32))   # float32 always: see above
        self._key = _splitmix64(seed) & (2 ** 63 - 1)
        self.register_buffer("noise_state", torch.tensor([self._key, 0], dtype=torch.int64, device=device))
        self._name = f"({in_features} -> {out_features})"   # apply_pqt sets the module name
        self._calls = 0            # eager training calls, to tag their seeds (check_recomputed_call)
        self._last_call = self._replayed = None
        self._warned_b_i = False

    def reset_parameters(self):
        """Initialise as at construction: weight and bias as nn.Linear does, b_i = 1, noise_state =
        [key, 0] (key from the constructor's seed); fills a meta-device layer after `to_empty`."""
        super().reset_parameters()
        if "b_i" in self._parameters:          # nn.Linear.__init__ calls this before b_i exists
            with torch.no_grad():
                self._reset_pqt_state()

    def _reset_pqt_state(self):
        self.b_i.fill_(1.0)
        self.noise_state.copy_(torch.tensor([self._key, 0], dtype=torch.int64))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # A plain checkpoint (no b_i, no noise_state: the model before apply_pqt) loads too, also
        # strictly: b_i and noise_state start as at construction (a fresh PQT run from its weights)
        plain = prefix + "weight" in state_dict and not any(prefix + k in state_dict
                                                             for k in ("b_i", "noise_state"))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if plain:
            with torch.no_grad():
                self._reset_pqt_state()
            for k in ("b_i", "noise_state"):
                if prefix + k in missing_keys:
                    missing_keys.remove(prefix + k)

    @property
    def b_t(self):
        """Tile bitwidths, exactly eq. 11 (not clamped; sampling clamps to [B_MIN, B_MAX]),
        float32, differentiable w.r.t. b_i."""
        return _bitwidth(self.b_i, self.b_init, self.b_target)

    def _next_seed(self):
        return layer_seed(self)    # this call's seed [key, t]; advances t in a training forward

    def linear_weight(self):
        """The (out, in) weight that eq. 3 samples (GaussWSConv1D: a view of its (in, out) one)."""
        return self.weight

    def forward(self, x):
        w = self.linear_weight()
        if not (self.training or self.sample_in_eval):
            return F.linear(x, w, self.bias)
        check_layer_dtypes(self, w)
        # b_i itself goes in (not b_t = eq. 11 of it): the grad kernel returns ∂L/∂b_i; the seed is
        # drawn after the argument checks (a failed call does not advance the counter)
        return _pqt_linear(x, w, self.b_i, self.b_init, self.b_target, self.bias, self._next_seed,
                           self.method, self.memory, self.impl, self.fused)

    def extra_repr(self):
        return (super().extra_repr() + f", method={self.method}, b_init={self.b_init}, "
                f"b_target={self.b_target}, memory={self.memory}")


class GaussWSConv1D(Conv1DLayout, GaussWSLinear):
    """GaussWSLinear in Hugging Face GPT-2's `Conv1D` layout (weight (in, out), sampled as its
    transpose with the same tiles: `Conv1DLayout`), for apply_pqt to put in place of a Conv1D."""


def pqt_layers(model):
    """(name, GaussWSLinear) pairs of a model (an nn.Module, else TypeError), in module order."""
    check_module(model, "pqt_layers")
    return [(n, m) for n, m in model.named_modules() if isinstance(m, GaussWSLinear)]


# ==============================================================================================
# apply_pqt / remove_pqt: a model's linear layers to GaussWS layers and back (lowbit/pqt/surgery.py)

def apply_pqt(model, method="gaussws", parts=None, b_init=6, b_target=4, seed=0, memory="save",
              impl="auto", fused=True, *, modules=None, lm_head=False):
    """Replace linear layers of any nn.Module by GaussWSLinear (same weight and bias Parameters,
    device, dtype and train/eval mode), in place; the torchao.quantize_ / QAT "prepare" step.

    Which layers, by `parts` (the papers' "method[part]"; default "all") or by `modules`:
      parts: "all" (every part the model has), "od" (out + down) or a comma list of
        qkv,out,up,down (GPT-2) / q,k,v,out,gate,up,down (Llama). A layer's part is its own name
        (this repository's GPT) or its Hugging Face name (HF_PARTS): q_proj, k_proj, v_proj,
        o_proj, gate_proj, up_proj, down_proj (Llama-style) and c_attn, attn.c_proj, c_fc,
        mlp.c_proj (GPT-2); the list may use these names too (parts="q_proj,o_proj"). Every part
        named in a list (and both of "od") must exist.
      modules: for any other model, a glob on the full module name (fnmatch: * also matches
        dots; e.g. "model.layers.*.mlp.*"), a list of globs (each must match a linear), or a
        callable (name, module) -> bool (True or False, else TypeError; an exception it raises
        comes back as a ValueError naming the module); it is asked about every nn.Linear (and
        Conv1D) of the model.
    Only nn.Linear (exactly, not subclasses) and Hugging Face's GPT-2 Conv1D are replaced, the
    latter by GaussWSConv1D (Conv1D's (in, out) weight, sampled with the equivalent nn.Linear's
    tiles). Embeddings and norms are never sampled; the LM head (a linear whose weight is an
    embedding's, i.e. tied; Hugging Face's get_output_embeddings(); a linear whose last name is
    one of HEAD_NAMES: lm_head, head, output, embed_out) only with lm_head=True (a bool), which
    adds it to `parts` or lets `modules` select it. A module at two places of the model, selected
    at either, becomes one layer at both. b_i is float32 whatever the weight dtype (see
    GaussWSLinear). b_init, b_target, seed, memory, impl, fused as in GaussWSLinear; layer seeds
    come from random.Random(seed) in module order (§3.6 seed generator), continuing after the
    GaussWSLinear layers the model already has, so a second call gives its layers other keys than
    the first's; after remove_pqt it starts a new phase. Build the optimizer after apply_pqt: the
    new b_i are parameters it must hold (an optimizer that steps a layer's weight while no
    optimizer steps its b_i gets a warning at its second step, when the other optimizers of the
    loop had a step to show theirs). Returns the names of the replaced modules
    ("blocks.0.attn.qkv", "model.layers.0.self_attn.q_proj", ...), in module order. Everything is
    checked before the model is touched. Raises TypeError (model not an nn.Module, seed, modules,
    lm_head or fused type, a callable's non-bool answer, float64 layers) or ValueError (bad
    arguments; the model itself a linear layer; both parts and modules; a named part the model has
    no linear for: the message lists the parts present; a filter that selects no layer, or a glob
    of a list that matches none: the message lists the model's linears and the nn.Linear
    subclasses it leaves alone)."""
    return replace_linears(model, (GaussWSLinear, GaussWSConv1D), method, parts, b_init, b_target, seed, memory,
                           impl, fused, modules, lm_head)


def remove_pqt(model, cast=None):
    """Undo apply_pqt in place: every GaussWSLinear becomes a plain nn.Linear (a GaussWSConv1D the
    Conv1D it replaced) holding the same weight and bias Parameters, without b_i and noise_state,
    so the model and its state dict are used without this library (TorchAO's QAT "convert").
    cast: None keeps the trained weights w; "tiers" first casts every tile of w to the Table C
    format of its bitwidth (lowbit.pqt.export.cast_to_tiers); "eXmY" (e.g. "e3m4", "e2m3", as
    export.CAST_SWEEP) casts every tile to that FP format with its own power-of-two scale
    (export.cast_tiles). The weights keep their dtype (float32 holds every cast value exactly).
    The model keeps its train/eval mode; an optimizer made before still holds the removed b_i.
    From a PQT checkpoint: build the model, apply_pqt with the same arguments, load_state_dict,
    then remove_pqt; to export and keep training, call it on copy.deepcopy(model). Returns the
    names of the layers replaced, in module order.
    Raises TypeError (model not an nn.Module), ValueError (cast not one of those; a model
    without GaussWSLinear layers)."""
    return restore_linears(model, cast, GaussWSLinear)
