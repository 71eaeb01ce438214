"""
Gaussian weight sampling (GaussWS) for pseudo-quantization training (PQT): paper A (Ahn & Yoo 2025,
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
         Sampling uses clamp(b_t, B_MIN, B_MAX) = [1, 24] (why: see B_MIN).
eq. 12   Optional loss term λ · Σ_layers mean_tiles |b_t − b_target| (`bitwidth_penalty`).
Table C  The smallest floating-point format that holds a tile (§3.3, Prop. 3–4): b_t ≤ 5 →
         FP8 e3m4, ≤ 9 → FP12 e4m7, ≤ 12 → FP16 e5m10 (`fp_tier`, `cast_to_tiers`).

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
grad kernels draw R from Philox themselves, the same R bit for bit, so no packed R goes through
memory.

Every kernel has a plain-PyTorch twin here (`impl="torch"`), placed right before it, with the same
math and the same names: Philox runs on int64 tensors, so the reference gives the same bits, the
same packed R and the same w_hat (bit-exact for GaussWS, where R·scale is exact) as the kernels.
`impl="auto"` picks Triton for CUDA tensors and the reference for CPU tensors; `impl="triton"` on
CPU tensors needs TRITON_INTERPRET=1 (that is how the tests run the kernels).

Seeds (§3.6): user seed → seed generator (`random.Random(seed)` in `apply_pqt`) → one key per
layer → the layer's counter-based PRNG (Philox keyed by the layer key) whose stream number is the
layer's call counter t. Both live in the int64 buffer `noise_state = [key, t]`, so
`model.state_dict()` checkpoints them and a resumed run continues the same noise sequence. The
counter advances at every training-mode forward; backward reuses the seed of its forward (saved
in the autograd context), and activation recomputation (torch.utils.checkpoint, which re-runs the
forward inside backward) reuses the previous seed instead of advancing. Under torch.compile the
seed is a graph tensor, so any recomputation the compiler does uses it too. Not supported (wrong
gradients, not detected): torch.utils.checkpoint inside a compiled region (its recomputation
draws the next seed), and with use_reentrant=True a layer called once inside a checkpointed
region and again outside it before the backward. Not supported and detected (RuntimeError naming
the layer, in backward): a layer called more than once inside one checkpointed region, and two
checkpointed forwards before one backward; the recomputation reuses the layer's last seed, right
for one call only.
Each eager call tags its seed: with use_reentrant=False the backward compares its call's tag with
the tag of the seed the recomputation saved; with use_reentrant=True, which recomputes each
region once per backward, a second recomputation of a layer in one backward raises.

Memory modes: "save" (paper: autograd keeps w_hat in BF16 for ∂L/∂x, +2 B/param) and "recompute"
(w_hat rebuilt in backward from (w, b_t, seed): no extra persistent bytes, one more
generate+apply per backward).

Baselines: DiffQ-style PQT (method="diffq"): same eq. 3 with R ~ U(−0.5, 0.5) stored in BF16
(2 B/element of temporary noise), and Box–Muller (method="bm", `generate_noise` only): R =
round(N(0,1)/2) from Philox + Box–Muller, packed like ours (the paper's "bm" kernel baseline).

Layout: argument checks → Triton helpers → eq. 10 (R) → eq. 3 (apply) → eq. 4 (backward) →
the differentiable sample (`gaussws_sample`, `pqt_linear`) → seeds (§3.6) → bitwidths
(eq. 11–12) → `GaussWSLinear` → `apply_pqt` → Figure 5 statistics and Table C tiers → Table C
casting. Each kernel sits right after its torch twin, followed by its wrapper.
"""
import fnmatch
import math
import numbers
import os
import random
import re
import struct
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import triton
import triton.language as tl
from triton.language.extra import libdevice
from torch.library import triton_op, wrap_triton
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch._subclasses.fake_tensor import is_fake

from philox import philox, philox_torch

TILE = 32  # b_l of eq. 3: square tile side (MX-style block of §2.1; 32×32 units in §3.6)

# eq. 10: exact law of R for method "gaussws"
P2 = 0.75 * 2.0 ** -9                         # P(R=+2) = P(R=-2)
P1 = 0.75 ** 2 * 2.0 ** -2 * (1.0 - 2 * P2)   # P(R=+1) = P(R=-1)
P0 = 1.0 - 2 * P1 - 2 * P2
NOISE_PROBS = {-2: P2, -1: P1, 0: P0, 1: P1, 2: P2}

METHODS = ("gaussws", "diffq")
GEN_METHODS = ("gaussws", "diffq", "bm")
IMPLS = ("auto", "torch", "triton")
MEMORY_MODES = ("save", "recompute")
GPT2_PARTS = ("qkv", "out", "up", "down")
LLAMA_PARTS = ("q", "k", "v", "out", "gate", "up", "down")
ALL_PARTS = tuple(dict.fromkeys(GPT2_PARTS + LLAMA_PARTS))
W_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # weight dtypes the kernels read

# launch configuration of the kernels (block sizes, warps). gen_*, apply_* and grad_* (the unfused
# kernels) from `python bench.py --only noise` at 4096²–16384²; the fused apply and grad (R drawn
# in the kernel, what GaussWSLinear runs) from a sweep over (BT tiles per program, warps) at the
# Table 1 models' weight shapes (results/README.md, section 7): the apply is fastest with one
# tile and one warp per program at every size, the grad with (4, 4), or one tile per program
# on weights of at most small_grad[0] tiles
CONFIG = dict(gen_block=1024, gen_warps=4, apply_bt=2, apply_warps=4, grad_bt=4, grad_warps=4,
              fused_apply=(1, 1), fused_grad=(4, 4), small_grad=(4096, 1, 1))

_M32 = 0xFFFFFFFF
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"   # kernels run by Triton's CPU interpreter


# ----------------------------------------------------------------------------------------------
# argument checks

def tile_grid(m, n):
    """Shape of the 32×32 tile grid of an (m, n) matrix: (ceil(m/32), ceil(n/32))."""
    return (-(-m // TILE), -(-n // TILE))


def _check_choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed: {', '.join(map(repr, allowed))}")


def _check_dtype(dtype, name):
    if dtype not in W_DTYPES:
        raise TypeError(f"{name} has dtype {dtype}; allowed: float32, bfloat16, float16")


def _check_weight(w, name="w"):
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"{name} must be 2-D (out_features, in_features), got shape {tuple(w.shape)}")
    if w.numel() == 0:
        raise ValueError(f"{name} has shape {tuple(w.shape)}: it must have at least one element")
    _check_dtype(w.dtype, name)
    if w.numel() >= 2 ** 31:
        raise ValueError(f"{name} has {w.numel()} elements; at most 2**31 - 1 are supported")


def _check_out_dtype(out_dtype):
    if out_dtype not in W_DTYPES:
        raise TypeError(f"out_dtype={out_dtype!r}; allowed: torch.float32, torch.bfloat16, torch.float16")


def _check_tiles(t, w, name):
    want = tile_grid(*w.shape)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {want}, got {type(t).__name__}")
    if tuple(t.shape) != want:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; for a weight of shape {tuple(w.shape)} "
                         f"it must be the 32x32 tile grid {want}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype {t.dtype}")
    if t.device != w.device:
        raise ValueError(f"{name} is on {t.device} and the weight on {w.device}: they must be on the same device")


def _check_fused(fused, fn=""):
    if not isinstance(fused, bool):
        raise TypeError(f"{fn + ': ' if fn else ''}fused={fused!r} must be True or False")


def _check_seed(seed, also=""):
    """The one seed rule of every API: an int (not bool) in [0, 2**63) (an int64 Philox key)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int in [0, 2**63){also}, got {type(seed).__name__} {seed!r}")
    if not 0 <= seed < 2 ** 63:
        raise ValueError(f"seed={seed} must be an int in [0, 2**63)")
    return seed


_SEED_CACHE = {}        # (device, seed) -> int64 tensor [seed, 0] on that device
_SEED_CACHE_SIZE = 256


def _seed_tensor(seed, device):
    """int seed s -> int64 tensor [s, 0] (key s, call counter 0); an int64 tensor [key, counter]
    passes through (moved to `device`). On a GPU the int's tensor is made by two fill kernels (the
    value travels as a kernel argument) and cached: torch.tensor([s, 0], device=...) would be a
    blocking host-to-device copy at every call. Not cached while a CUDA graph is being captured
    (the tensor would live in the graph's memory pool)."""
    if not isinstance(seed, torch.Tensor):
        _check_seed(seed, also=" or an int64 tensor [key, counter]")
        device = torch.device(device)
        if device.type == "cpu" or torch.compiler.is_compiling():   # compiled: a graph constant
            return torch.tensor([seed, 0], dtype=torch.int64, device=device)
        t = _SEED_CACHE.get((device, seed))
        if t is None:
            t = torch.zeros(2, dtype=torch.int64, device=device)
            t[:1].fill_(seed)
            capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            if not capturing:
                if len(_SEED_CACHE) >= _SEED_CACHE_SIZE:
                    _SEED_CACHE.pop(next(iter(_SEED_CACHE)))        # the oldest entry
                _SEED_CACHE[(device, seed)] = t
        return t
    if seed.dtype != torch.int64 or tuple(seed.shape) != (2,):
        raise ValueError(f"seed tensor must be int64 of shape (2,) = [key, counter], "
                         f"got dtype {seed.dtype} shape {tuple(seed.shape)}")
    if seed.is_meta and torch.device(device).type != "meta":
        raise ValueError(f"seed tensor is on the meta device (no values) and the weight on {device}; "
                         "pass an int or a real int64 tensor [key, counter]")
    return seed.to(device)


def _resolve_impl(impl, t):
    _check_choice("impl", impl, IMPLS)
    if impl == "auto":
        return "triton" if t.is_cuda else "torch"
    if impl == "triton" and t.device.type not in ("cuda", "cpu"):   # meta: Triton reads the data
        raise ValueError(f"impl='triton' needs CUDA tensors (or CPU ones under TRITON_INTERPRET=1), got "
                         f"device {t.device.type}; use impl='torch' or 'auto'")
    if impl == "triton" and not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("impl='triton' on CPU tensors needs the Triton interpreter "
                           "(set TRITON_INTERPRET=1 before importing triton); use impl='torch' on CPU")
    return impl


def _check_module(model, fn):
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: model must be a torch.nn.Module, got {type(model).__name__}")


# ----------------------------------------------------------------------------------------------
# Triton helpers shared by the kernels

def _launch(kernel):
    """The kernel itself in eager code (Triton's own launcher); wrap_triton(kernel) while
    torch.compile traces a triton_op (a dispatch mode is active), so Inductor records the kernel
    in its graph. wrap_triton in eager code would add a dispatch, costlier than the launch itself,
    to every launch."""
    return kernel if _get_current_dispatch_mode() is None else wrap_triton(kernel)


@triton.jit
def _cast(x, dtype: tl.constexpr):
    """float32 -> dtype with round-to-nearest-even. BF16 is rounded with integer ops (the GPU's
    cvt.rn gives the same bits; Triton's interpreter would truncate), NaN stays NaN."""
    if dtype == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        b = tl.where(x != x, 0x7FC0, b)
        return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif dtype == tl.float32:
        return x
    else:
        return x.to(dtype)


@triton.jit
def _interleave8(v0, v1, v2, v3, v4, v5, v6, v7):
    """[..., k] x 8 -> [..., 8k + j] = v_j[..., k] (tl.interleave appends the lowest index bit)."""
    x0 = tl.interleave(v0, v4)
    x1 = tl.interleave(v2, v6)
    x2 = tl.interleave(v1, v5)
    x3 = tl.interleave(v3, v7)
    return tl.interleave(tl.interleave(x0, x1), tl.interleave(x2, x3))


# ==============================================================================================
# eq. 10: the noise R (§3.4; step (1) of §3.5)
# ----------------------------------------------------------------------------------------------
# Philox4x32-10 words of packed word p: counter (p, call counter), key = the layer key

def _philox_words_torch(seed, idx):
    """4 random uint32 words (int64 tensors) for counters idx (int64) under seed=[key, counter]."""
    key, ctr = seed[0], seed[1]
    z = torch.zeros_like(idx)
    return philox_torch(idx & _M32, (idx >> 32) & _M32, z + (ctr & _M32), z + ((ctr >> 32) & _M32),
                        key & _M32, (key >> 32) & _M32)


@triton.jit
def _philox_words(seed_ptr, p):
    """4 uint32 words for int32 counters p (word index) under seed = [key, counter] at seed_ptr:
    the Triton twin of `_philox_words_torch`."""
    key = tl.load(seed_ptr)
    ctr = tl.load(seed_ptr + 1)
    k0 = (key & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = p.to(tl.uint32)
    z = c0 * 0
    c2 = z + (ctr & 0xFFFFFFFF).to(tl.uint32)
    c3 = z + ((ctr >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return philox(c0, z, c2, c3, k0, k1, 10)


# ----------------------------------------------------------------------------------------------
# the eq. 10 recipe on 4 Philox words: 8 elements at once, the result already packed

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
    r0, r1, r2, r3 = _philox_words(seed_ptr, p)
    return _recipe(r0, r1, r2, r3)


def bits_of_element(r0, r1, r2, r3, j):
    """The 16 bits b0..b15 (as one integer, b_i at bit i) that element j of a packed word uses,
    gathered from the 4 Philox words as `_recipe_torch` reads them (for tests)."""
    nib = lambda r: (r >> (4 * j)) & 0xF
    a, b, c, d = nib(r0), nib(r1), nib(r2), nib(r3)
    return (a & 7) | (b << 3) | (c << 7) | (d << 11) | (((a >> 3) & 1) << 15)


def noise_from_bits_reference(bits16):
    """R of eq. 10 from one 16-bit integer per element, bit by bit (sign = b0; |R| = 2 iff
    (b1|b2)&b3&..&b10; else 1 iff (b11|b12)&(b13|b14)&b15): the readable per-bit version of
    `_recipe_torch`, used by tests. bits16: int tensor, values in [0, 2^16)."""
    b = [(bits16 >> i) & 1 for i in range(16)]
    is2 = (b[1] | b[2]) & b[3] & b[4] & b[5] & b[6] & b[7] & b[8] & b[9] & b[10]
    is1 = (b[11] | b[12]) & (b[13] | b[14]) & b[15]
    mag = torch.where(is2 == 1, 2, torch.where(is1 == 1, 1, 0))
    return torch.where(b[0] == 1, -mag, mag).to(torch.int8)


# ----------------------------------------------------------------------------------------------
# packing: sign-magnitude, 4 bits per element, 8 elements per int32

def _to_int32(v):
    """int64 tensor with uint32 values -> int32 with the same bits."""
    return torch.where(v >= 2 ** 31, v - 2 ** 32, v).to(torch.int32)


def pack_noise(r):
    """Pack R (int tensor (m, n), values in [-7, 7]) sign-magnitude, 4 bits/element, 8 elements
    per int32 word, element j of a group in bits [4j, 4j+4). Returns int32 (m, ceil(n/8)).
    Raises ValueError unless r is 2-D."""
    if r.dim() != 2:
        raise ValueError(f"r must be 2-D, got shape {tuple(r.shape)}")
    m, n = r.shape
    r = F.pad(r.to(torch.int64), (0, -n % 8))
    nib = r.abs().clamp_max(7) | ((r < 0).to(torch.int64) << 3)
    shifts = 4 * torch.arange(8, device=r.device)
    return _to_int32((nib.view(m, -1, 8) << shifts).sum(-1))


def unpack_noise(packed, n):
    """Inverse of `pack_noise`: int32 (m, ceil(n/8)) -> int8 R of shape (m, n). Raises ValueError
    unless packed is a 2-D int32 tensor with ceil(n/8) words per row."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"packed must be a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}")
    if packed.shape[1] != -(-n // 8):
        raise ValueError(f"packed has {packed.shape[1]} words per row; n={n} needs {-(-n // 8)}")
    shifts = 4 * torch.arange(8, device=packed.device)
    nib = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF
    r = (nib & 7) * (1 - 2 * (nib >> 3))
    return r.reshape(packed.shape[0], -1)[:, :n].to(torch.int8)


# ----------------------------------------------------------------------------------------------
# generation, one method at a time: torch reference, then Triton kernel

def _gen_gaussws_torch(m, n, seed):
    n8 = -(-n // 8)
    idx = torch.arange(m * n8, device=seed.device, dtype=torch.int64)
    return _to_int32(_recipe_torch(*_philox_words_torch(seed, idx))).view(m, n8)


@triton.jit
def _gen_gaussws_kernel(out_ptr, seed_ptr, n_words, BLOCK: tl.constexpr):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    packed = _packed_words(seed_ptr, p)
    tl.store(out_ptr + p, packed.to(tl.int32, bitcast=True), mask=p < n_words)


def _gen_diffq_torch(m, n, seed):
    """16 random bits per element -> U(-0.5, 0.5), exact in fp32, then BF16."""
    n8 = -(-n // 8)
    idx = torch.arange(m * n8, device=seed.device, dtype=torch.int64)
    r = _philox_words_torch(seed, idx)
    h = torch.stack([(r[i // 2] >> (16 * (i % 2))) & 0xFFFF for i in range(8)], -1)  # (words, 8)
    u = (h.to(torch.float32) + 0.5) * 2.0 ** -16 - 0.5
    return u.to(torch.bfloat16).view(m, n8 * 8)[:, :n].contiguous()


@triton.jit
def _u16(h):
    """16 random bits -> U(-0.5, 0.5), exact in float32, then BF16 (DiffQ noise)."""
    return _cast((h.to(tl.float32) + 0.5) * 0.0000152587890625 - 0.5, tl.bfloat16)   # 2^-16


@triton.jit
def _diffq_offsets(pid, M, N, N8, BLOCK: tl.constexpr):
    """Offsets row * N + col into the (M, N) output, and their mask, of the 8 * BLOCK elements of
    program pid: element j of packed word q (row q // N8 of the padded (M, 8 * N8) grid). Computed
    from the word index q < M * N8 <= M * N < 2^31, so int32 does not overflow; the element index
    8q + j would for M * N8 > 2^28 (e.g. (200M, 9))."""
    i = tl.arange(0, 8 * BLOCK)
    q = pid * BLOCK + i // 8
    row = q // N8
    col = (q % N8) * 8 + i % 8
    return row * N + col, (row < M) & (col < N)


@triton.jit
def _gen_diffq_kernel(out_ptr, seed_ptr, M, N, N8, BLOCK: tl.constexpr):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    r0, r1, r2, r3 = _philox_words(seed_ptr, p)
    # element 8p + 2i + L takes the 16-bit half L of word r_i
    u = _interleave8(_u16(r0 & 0xFFFF), _u16(r0 >> 16), _u16(r1 & 0xFFFF), _u16(r1 >> 16),
                     _u16(r2 & 0xFFFF), _u16(r2 >> 16), _u16(r3 & 0xFFFF), _u16(r3 >> 16))
    offs, mask = _diffq_offsets(tl.program_id(0), M, N, N8, BLOCK)
    tl.store(out_ptr + offs, u, mask=mask)


def _gen_bm_torch(m, n, seed):
    """Two Philox calls per packed word (counters 2p, 2p+1), Box–Muller, R = round(z/2)."""
    n8 = -(-n // 8)
    idx = torch.arange(m * n8, device=seed.device, dtype=torch.int64)
    zs = []
    for a in range(2):
        r = _philox_words_torch(seed, 2 * idx + a)
        for j in range(2):
            u1 = (r[2 * j].to(torch.float32) + 1.0) * 2.0 ** -32
            u2 = r[2 * j + 1].to(torch.float32) * 2.0 ** -32
            rad = torch.sqrt(-2.0 * torch.log(u1))
            zs += [rad * torch.cos(6.283185307179586 * u2), rad * torch.sin(6.283185307179586 * u2)]
    z = torch.stack(zs, -1)                                            # (words, 8)
    rr = torch.floor(z * 0.5 + 0.5).clamp(-7, 7).to(torch.int64)
    return pack_noise(rr.view(m, n8 * 8))


@triton.jit
def _bm_pair(ra, rb):
    u1 = (ra.to(tl.float32) + 1.0) * 2.3283064365386963e-10     # (0, 1]
    u2 = rb.to(tl.float32) * 2.3283064365386963e-10
    rad = tl.sqrt(-2.0 * tl.log(u1))
    th = 6.283185307179586 * u2
    return rad * tl.cos(th), rad * tl.sin(th)


@triton.jit
def _bm_nib(z):
    r = tl.minimum(tl.maximum(tl.floor(z * 0.5 + 0.5), -7.0), 7.0).to(tl.int32)
    return (tl.abs(r) | tl.where(r < 0, 8, 0)).to(tl.uint32)


@triton.jit
def _gen_bm_kernel(out_ptr, seed_ptr, n_words, BLOCK: tl.constexpr):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    packed = p.to(tl.uint32) * 0
    for a in tl.static_range(2):
        r0, r1, r2, r3 = _philox_words(seed_ptr, 2 * p + a)
        z0, z1 = _bm_pair(r0, r1)
        z2, z3 = _bm_pair(r2, r3)
        packed = packed | (_bm_nib(z0) << (16 * a)) | (_bm_nib(z1) << (16 * a + 4))
        packed = packed | (_bm_nib(z2) << (16 * a + 8)) | (_bm_nib(z3) << (16 * a + 12))
    tl.store(out_ptr + p, packed.to(tl.int32, bitcast=True), mask=p < n_words)


# ----------------------------------------------------------------------------------------------
# wrappers

def _generate_torch(m, n, seed, method):
    """R for an (m, n) weight in plain PyTorch: packed int32 (m, ceil(n/8)) for "gaussws" and
    "bm", BF16 (m, n) for "diffq"."""
    if method == "gaussws":
        return _gen_gaussws_torch(m, n, seed)
    if method == "diffq":
        return _gen_diffq_torch(m, n, seed)
    return _gen_bm_torch(m, n, seed)


def _generate_triton(m, n, seed, method, block=None, num_warps=None):
    n8 = -(-n // 8)
    n_words = m * n8
    block = block or CONFIG["gen_block"]
    num_warps = num_warps or CONFIG["gen_warps"]
    grid = (triton.cdiv(n_words, block),)
    if method == "diffq":
        out = torch.empty(m, n, dtype=torch.bfloat16, device=seed.device)
        _launch(_gen_diffq_kernel)[grid](out, seed, m, n, n8, BLOCK=block, num_warps=num_warps)
        return out
    out = torch.empty(m, n8, dtype=torch.int32, device=seed.device)
    kernel = _gen_gaussws_kernel if method == "gaussws" else _gen_bm_kernel
    _launch(kernel)[grid](out, seed, n_words, BLOCK=block, num_warps=num_warps)
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
    _check_choice("method", method, GEN_METHODS)
    if (not isinstance(shape, (tuple, list, torch.Size)) or len(shape) != 2
            or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1 for v in shape)):
        raise ValueError(f"shape must be (m, n), two ints >= 1, got {shape!r}")
    m, n = int(shape[0]), int(shape[1])
    if m * n >= 2 ** 31:
        raise ValueError(f"shape {shape} has {m * n} elements; at most 2**31 - 1 are supported")
    dev = device if device is not None else (seed.device if isinstance(seed, torch.Tensor) else "cpu")
    seed = _seed_tensor(seed, dev)
    if _resolve_impl(impl, seed) == "triton":
        return _generate_triton(m, n, seed, method)
    return _generate_torch(m, n, seed, method)


# ----------------------------------------------------------------------------------------------
# R as the eq. 3 / eq. 4 code reads it: float32 values, unpacked (torch, then Triton)

def _noise_values_torch(noise, method, n):
    return unpack_noise(noise, n).float() if method == "gaussws" else noise.float()


@triton.jit
def _noise_block(r_ptr, seed_ptr, row, col, ti, mask, M, N, N8, NOISE: tl.constexpr):
    """R as float32 for a (32, BT, 32) block. NOISE: 0 = packed GaussWS R read from memory,
    1 = dense BF16 DiffQ R read from memory, 2 = packed GaussWS R generated here (fused)."""
    if NOISE == 1:
        r = tl.load(r_ptr + row * N + col, mask=mask, other=0.0).to(tl.float32)
    else:
        q = ti[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]    # word column, (1, BT, 4)
        if NOISE == 0:
            w = tl.load(r_ptr + row * N8 + q, mask=(row < M) & (q < N8), other=0)
        else:
            w = _packed_words(seed_ptr, row * N8 + q)
        nib = _interleave8(w & 0xF, (w >> 4) & 0xF, (w >> 8) & 0xF, (w >> 12) & 0xF,
                           (w >> 16) & 0xF, (w >> 20) & 0xF, (w >> 24) & 0xF, (w >> 28) & 0xF)
        mag = (nib & 7).to(tl.float32)
        r = tl.where((nib & 8) != 0, -mag, mag)
    return r


def _noise_mode(method, fused):
    """The NOISE code of `_noise_block` for a method and the fused flag."""
    return 1 if method == "diffq" else (2 if fused else 0)


def _f32(x):
    """A Python float rounded to float32, as torch rounds the scalar operand of a float32 tensor
    op (eq. 11's b_init − b_target in the grad kernel is one, e.g. 2.2)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _launch_config(kernel, mode, tiles):
    """(BT, num_warps) of the apply or grad kernel (kernel "apply" | "grad") for a weight of
    `tiles` tiles, from CONFIG."""
    if mode != 2:
        return CONFIG[kernel + "_bt"], CONFIG[kernel + "_warps"]
    if kernel == "grad" and tiles <= CONFIG["small_grad"][0]:
        return CONFIG["small_grad"][1:]
    return CONFIG["fused_" + kernel]


# ==============================================================================================
# eq. 3: w_hat = w + R ⊙ broadcast_32(max_32(|w|) · 2^(1 − b_t))  (step (2) of §3.5)

def _pow2(b_t):
    """2^(1 − clamp(b_t, B_MIN, B_MAX)) in float32, contiguous (the PQN scale of eq. 3). Autograd:
    d/d b_t = −ln2 · 2^(1−b_t) inside the range (eq. 4), 0 outside."""
    return torch.exp2(1.0 - b_t.float().clamp(B_MIN, B_MAX)).contiguous()


# ----------------------------------------------------------------------------------------------
# max_32(|w|) and broadcast_32: torch, then Triton

def _tile_max_torch(w):
    m, n = w.shape
    tm, tn = tile_grid(m, n)
    a = F.pad(w.float().abs(), (0, tn * TILE - n, 0, tm * TILE - m))  # |w| >= 0: zero pad is neutral
    return a.view(tm, TILE, tn, TILE).amax(dim=(1, 3))


def _broadcast_tiles(t, m, n):
    return t.repeat_interleave(TILE, 0).repeat_interleave(TILE, 1)[:m, :n]


def _tile_programs(tm, tn, bt):
    """The 1-D launch grid of the tile kernels: one program per 32 rows × bt tiles."""
    return (tm * triton.cdiv(tn, bt),)


@triton.jit
def _tile_block(M, N, TN, BT: tl.constexpr):
    """Indices of one program's block: 32 rows x BT tiles of 32 columns, as (32, BT, 32) so that
    axes 0 and 2 are the inside of a tile; ti (BT,) tile columns, tidx their flat indices in the
    (ceil(M/32), TN) tile grid; mask covers partial edge tiles. Programs go along the rows of
    tiles first, so the programs running at once read and write whole rows of the matrix (DRAM
    pages) instead of a narrow column strip of every row."""
    nb = tl.cdiv(TN, BT)
    tr = tl.program_id(0) // nb
    ti = (tl.program_id(0) % nb) * BT + tl.arange(0, BT)
    row = tr * 32 + tl.arange(0, 32)[:, None, None]
    col = ti[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    return ti, tr * TN + ti, row, col, (row < M) & (col < N)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _tile_absmax(w):
    """max_32(|w|) of a (32, BT, 32) block: (BT,) (masked-out elements loaded as 0 are neutral).
    A NaN in a tile makes its maximum NaN, as torch's amax (tl.max would skip it)."""
    return tl.reduce(tl.reduce(tl.abs(w), 2, _max_nan), 0, _max_nan)


@triton.jit
def _tilemax_kernel(w_ptr, out_ptr, M, N, TN, BT: tl.constexpr):
    ti, tidx, row, col, mask = _tile_block(M, N, TN, BT)
    w = tl.load(w_ptr + row * N + col, mask=mask, other=0.0).to(tl.float32)
    tmax = _tile_absmax(w)
    tl.store(out_ptr + tidx, tmax, mask=ti < TN)


def tile_max(w, impl="auto"):
    """max_32(|w|) of eq. 3 for w (m, n) float32/bfloat16/float16: float32 tensor of the tile grid
    shape (ceil(m/32), ceil(n/32)); edge tiles are partial (the max over the elements that exist).
    Raises TypeError / ValueError on a bad w or impl."""
    _check_weight(w)
    w = w.contiguous()
    if _resolve_impl(impl, w) == "torch":
        return _tile_max_torch(w)
    m, n = w.shape
    tm, tn = tile_grid(m, n)
    out = torch.empty(tm, tn, dtype=torch.float32, device=w.device)
    bt = CONFIG["apply_bt"]
    _tilemax_kernel[_tile_programs(tm, tn, bt)](w, out, m, n, tn, BT=bt, num_warps=CONFIG["apply_warps"])
    return out


# ----------------------------------------------------------------------------------------------
# the apply: torch, then Triton, then the wrappers

def _apply_torch(w, noise, pow2, method, out_dtype):
    """eq. 3 in plain PyTorch: (w_hat in out_dtype, tile maxima float32)."""
    m, n = w.shape
    tmax = _tile_max_torch(w)
    scale = _broadcast_tiles(tmax * pow2.float(), m, n)
    w_hat = (w.float() + _noise_values_torch(noise, method, n) * scale).to(out_dtype)
    return w_hat, tmax


def _tile_bits_torch(b, b_target, b_scale):
    """(b_t, 2^(1−clamp(b_t))) float32 of eq. 11 and eq. 3 from b: b_t = b_target + b·b_scale
    (a layer: b = b_i, b_scale = b_init − b_target; the public calls: b = b_t, (0, 1))."""
    b_t = _scaled_bits(b, b_target, b_scale)
    return b_t, _pow2(b_t)


def _pow2_live_torch(b_t, pow2):
    """What the backward needs of b_t: 2^(1−b_t) where B_MIN <= b_t <= B_MAX (clamp passes the
    gradient there, ends included), 0 where it is clamped (no gradient; 2^(1−b_t) >= 2^-23 is never
    0 inside the range, so `!= 0` is the clamp's mask again). The sampling kernel writes it so a
    compiled backward reads it from memory: were it b_t and 2^(1−b_t) themselves, Inductor would
    recompute them from b_i in a kernel of its own before the grad kernel (cheap pointwise ops)."""
    return torch.where((b_t >= B_MIN) & (b_t <= B_MAX), pow2, 0.0)


@triton.jit
def _add_rn(a, b, INTERPRET: tl.constexpr):
    """a + b in float32, rounded on its own: never fused with the product before it into an FMA,
    which the GPU compiler does to a plain `+` (the interpreter does not fuse)."""
    if INTERPRET:
        return a + b
    return libdevice.add_rn(a, b)


@triton.jit
def _exp2(x, INTERPRET: tl.constexpr):
    """2^x in float32 as torch computes it on CUDA: libdevice's exp2f, the CUDA math library's and
    what Inductor emits for torch.exp2 (on sm_90 the same ex2.approx instruction as tl.exp2; the H200
    test compares it with torch's bit for bit). The interpreter has no libdevice: numpy's exp2
    there, which differs from torch's CPU exp2 in the last bit at times."""
    if INTERPRET:
        return tl.exp2(x)
    return libdevice.exp2(x)


@triton.jit
def _apply_kernel(w_ptr, r_ptr, pow2_ptr, out_ptr, tmax_ptr, seed_ptr, b_ptr, live_ptr, b_target, b_scale,
                  M, N, N8, TN, NOISE: tl.constexpr, BT: tl.constexpr, BITS: tl.constexpr,
                  B_LO: tl.constexpr, B_HI: tl.constexpr, INTERPRET: tl.constexpr):
    """eq. 3 in Triton, one program = 32 rows × BT tiles: w_hat = w + R·tilemax·2^(1-b_t). With
    BITS, 2^(1-b_t) is not read but made from b here (`_tile_bits_torch`), and written masked by
    the clamp range of b_t (`_pow2_live_torch`) for the backward: no launch of its own per call."""
    ti, tidx, row, col, mask = _tile_block(M, N, TN, BT)
    w = tl.load(w_ptr + row * N + col, mask=mask, other=0.0).to(tl.float32)
    tmax = _tile_absmax(w)                                             # (BT,), edge tiles masked
    tmask = ti < TN
    if BITS:
        b = tl.load(b_ptr + tidx, mask=tmask, other=0.0).to(tl.float32)
        # eq. 11 as torch rounds it: the product to float32 (exact in float64, then rounded once),
        # then the sum, rounded again. The scalars come in as float32 or (from Inductor) float64
        p = (b.to(tl.float64) * b_scale).to(tl.float32)
        b_t = _add_rn(p, (tl.zeros_like(p) + b_target).to(tl.float32), INTERPRET)
        pow2 = _exp2(1.0 - tl.where(b_t < B_LO, B_LO, tl.where(b_t > B_HI, B_HI, b_t)), INTERPRET)   # torch's clamp, NaN kept
        tl.store(live_ptr + tidx, tl.where((b_t >= B_LO) & (b_t <= B_HI), pow2, 0.0), mask=tmask)
    else:
        pow2 = tl.load(pow2_ptr + tidx, mask=tmask, other=0.0)
    r = _noise_block(r_ptr, seed_ptr, row, col, ti, mask, M, N, N8, NOISE)
    w_hat = w + r * (tmax * pow2)[None, :, None]
    tl.store(out_ptr + row * N + col, _cast(w_hat, out_ptr.dtype.element_ty), mask=mask)
    tl.store(tmax_ptr + tidx, tmax, mask=tmask)


def _apply_triton(w, noise, pow2, seed, method, out_dtype, fused, bt=None, num_warps=None, bits=None):
    """The kernel's (w_hat, tile maxima) from 2^(1-b_t) (pow2, float32 tiles); or, with
    bits = (b, b_target, b_scale) (b contiguous tiles, pow2 None), from b as `_tile_bits_torch`
    makes it, and `_pow2_live_torch`'s tiles as a third output."""
    m, n = w.shape
    tm, tn = tile_grid(m, n)
    mode = _noise_mode(method, fused)
    cfg = _launch_config("apply", mode, tm * tn)
    bt, num_warps = bt or cfg[0], num_warps or cfg[1]
    w_hat = torch.empty(m, n, dtype=out_dtype, device=w.device)
    tmax = torch.empty(tm, tn, dtype=torch.float32, device=w.device)
    live = torch.empty(tm, tn, dtype=torch.float32, device=w.device) if bits is not None else tmax
    b, b_target, b_scale = bits if bits is not None else (tmax, 0.0, 1.0)
    b_target, b_scale = _f32(b_target), _f32(b_scale)   # torch's float32 scalars, also in the interpreter
    r = w if mode == 2 else noise   # unused pointer in fused mode
    _launch(_apply_kernel)[_tile_programs(tm, tn, bt)](w, r, tmax if pow2 is None else pow2, w_hat, tmax, seed,
                                             b, live, b_target, b_scale, m, n, -(-n // 8), tn,
                                             NOISE=mode, BT=bt, BITS=bits is not None, B_LO=B_MIN,
                                             B_HI=B_MAX, INTERPRET=_INTERPRET, num_warps=num_warps)
    return (w_hat, tmax) if bits is None else (w_hat, tmax, live)


def apply_noise(w, noise, b_t, method="gaussws", out_dtype=torch.bfloat16, impl="auto"):
    """Step (2) of §3.5, eq. 3 without autograd: returns (w_hat (m, n) in out_dtype, tile maxima
    float32 (ceil(m/32), ceil(n/32))).

    w: (m, n) float32/bfloat16/float16 (non-contiguous is copied); noise: from `generate_noise`
    with the same method (int32 (m, ceil(n/8)) for "gaussws", BF16 (m, n) for "diffq"); b_t:
    tile-grid tensor of bitwidths (clamped to [B_MIN, B_MAX]).
    Raises TypeError / ValueError on a bad w, b_t, noise (type, dtype, shape, device), out_dtype,
    method or impl."""
    _check_choice("method", method, METHODS)
    _check_weight(w)
    _check_tiles(b_t, w, "b_t")
    w = w.contiguous()
    m, n = w.shape
    want = (m, -(-n // 8)) if method == "gaussws" else (m, n)
    if not isinstance(noise, torch.Tensor):
        raise TypeError(f"noise must be a torch.Tensor from generate_noise, got {type(noise).__name__}")
    if tuple(noise.shape) != want:
        raise ValueError(f"noise has shape {tuple(noise.shape)}; method={method!r} and w {tuple(w.shape)} need {want}")
    if not (noise.dtype == torch.int32 if method == "gaussws" else noise.is_floating_point()):
        need = "int32 (packed, from generate_noise)" if method == "gaussws" else "floating (BF16 from generate_noise)"
        raise TypeError(f"noise has dtype {noise.dtype}; method={method!r} needs {need}")
    if noise.device != w.device:
        raise ValueError(f"noise is on {noise.device} and w on {w.device}: they must be on the same device")
    _check_out_dtype(out_dtype)
    with torch.no_grad():
        pow2 = _pow2(b_t)
        if _resolve_impl(impl, w) == "torch":
            return _apply_torch(w, noise, pow2, method, out_dtype)
        return _apply_triton(w, noise.contiguous(), pow2, None, method, out_dtype, False)


# ==============================================================================================
# eq. 4: backward. ∂L/∂w = ∂L/∂w_hat; the kernels give ∂L/∂(2^(1−b_t)) = tilemax · sum_32(g ⊙ R)
# and, in the same program, follow it through 2^(1 − clamp(b_t)) and eq. 11 down to the tensor b
# the caller differentiates (a layer's b_i; b_t itself for the public calls):
#
#     ∂L/∂b = where(B_MIN <= b_t <= B_MAX, −((∂L/∂2^(1−b_t) · 2^(1−b_t)) · ln2), 0) · b_scale
#
# b_scale = b_init − b_target for b_i (eq. 11), 1 for b_t; the mask and 2^(1−b_t) come in as one
# tile tensor (`_pow2_live_torch`). These are the float32 operations, in the order, that autograd
# runs through `_pow2` and `_bitwidth` (exp2: (grad · result) · ln2; rsub: negate; clamp: the
# mask, ends included; mul: · b_scale), so the bits are autograd's; being products only, no FMA
# can change them. It saves the launches of those autograd ops (compiled: one Inductor kernel).

LN2 = math.log(2)


def _bits_grad_torch(dpow2, live, b_scale, b_dtype):
    """∂L/∂b from ∂L/∂2^(1−b_t) and `_pow2_live_torch` (float32 tiles): the formula above in
    autograd's order, cast to b's dtype (autograd's backward of b.float())."""
    d = torch.where(live != 0, -((dpow2 * live) * LN2), 0.0)
    return (d * b_scale).to(b_dtype)


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
    with CHAIN ∂L/∂b from it (the formula above, `_bits_grad_torch`), cast to b's dtype."""
    ti, tidx, row, col, mask = _tile_block(M, N, TN, BT)
    g = tl.load(g_ptr + row * N + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(dw_ptr + row * N + col, _cast(g, dw_ptr.dtype.element_ty), mask=mask)
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
    tl.store(db_ptr + tidx, _cast(d, db_ptr.dtype.element_ty), mask=tmask)


def _grad_triton(g, noise, tmax, seed, method, w_dtype, fused, bt=None, num_warps=None, bits=None):
    """The kernel's (∂L/∂w, ∂L/∂(2^(1−b_t))), or (∂L/∂w, ∂L/∂b) with bits = (live, b_scale,
    b_dtype) (live: `_pow2_live_torch`'s contiguous float32 tiles), as `_grad_torch`."""
    m, n = g.shape
    tm, tn = tmax.shape
    mode = _noise_mode(method, fused)
    cfg = _launch_config("grad", mode, tm * tn)
    bt, num_warps = bt or cfg[0], num_warps or cfg[1]
    live, b_scale, b_dtype = bits if bits is not None else (tmax, 1.0, torch.float32)
    dw = torch.empty(m, n, dtype=w_dtype, device=g.device)
    db = torch.empty(tm, tn, dtype=b_dtype, device=g.device)
    r = g if mode == 2 else noise
    _launch(_grad_kernel)[_tile_programs(tm, tn, bt)](g, r, tmax, dw, db, seed, live, _f32(b_scale),
                                            m, n, -(-n // 8), tn, NOISE=mode, BT=bt,
                                            CHAIN=bits is not None, num_warps=num_warps)
    return dw, db


# ==============================================================================================
# the differentiable sample: eq. 3 forward, eq. 4 backward, as torch.library triton ops. Eager
# calls run them as plain functions; under torch.compile Inductor sees the Triton kernels inside
# and launches them from its own generated code (a plain custom op would cost a Python dispatch
# and a Triton launch per layer and call)

def _regenerate(m, n, seed, method, impl, fused):
    """R for a call, from its seed (forward and backward alike): the torch reference, packed R
    from kernel 1, or None where the fused GaussWS kernel draws R itself."""
    if impl == "torch":
        return _generate_torch(m, n, seed, method)
    return None if (fused and method == "gaussws") else _generate_triton(m, n, seed, method)


def _pqn_sample_impl(w: torch.Tensor, b: torch.Tensor, seed: torch.Tensor, method: str, out_dtype: torch.dtype,
                     impl: str, fused: bool, b_target: float,
                     b_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w_hat, tile maxima, `_pow2_live_torch`) of a call (eq. 3), b_t = b_target + b·b_scale
    (`_tile_bits_torch`; the kernel computes it itself). b (contiguous tiles) is also the tensor
    ∂L/∂b goes to (`_pqn_setup_context`)."""
    if impl == "triton" and not w.is_cuda and is_fake(w):
        # torch.compile traces the op (FakeTensors): Inductor compiles Triton kernels for CUDA only
        raise RuntimeError("impl='triton' under torch.compile needs CUDA tensors; use impl='torch' on CPU")
    noise = _regenerate(*w.shape, seed, method, impl, fused)
    if impl == "torch":
        b_t, pow2 = _tile_bits_torch(b, b_target, b_scale)
        return *_apply_torch(w, noise, pow2, method, out_dtype), _pow2_live_torch(b_t, pow2)
    return _apply_triton(w, noise, None, seed, method, out_dtype, fused, bits=(b, b_target, b_scale))


def _pqn_grad_impl(g: torch.Tensor, tmax: torch.Tensor, seed: torch.Tensor, live: torch.Tensor,
                   method: str, w_dtype: torch.dtype, b_dtype: torch.dtype, impl: str, fused: bool,
                   b_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(∂L/∂w, ∂L/∂b) of a call (eq. 4)."""
    g = g.contiguous()
    noise = _regenerate(*g.shape, seed, method, impl, fused)
    bits = (live, b_scale, b_dtype)
    if impl == "torch":
        return _grad_torch(g, noise, tmax, method, w_dtype, bits)
    return _grad_triton(g, noise, tmax, seed, method, w_dtype, fused, bits=bits)


_pqn_sample_op = triton_op("gaussws::pqn_sample", mutates_args=())(_pqn_sample_impl)
_pqn_grad_op = triton_op("gaussws::pqn_grad", mutates_args=())(_pqn_grad_impl)


def _pqn_setup_context(ctx, inputs, output):
    w, b, seed, method, out_dtype, impl, fused, b_target, b_scale = inputs
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)   # no zero-filled gradients for them: a launch each in eager code
    # tile maxima + seed (R is regenerated, not stored), 2^(1-b_t) and the clamp mask for ∂L/∂b
    ctx.save_for_backward(output[1], seed, output[2])
    ctx.args = (method, w.dtype, b.dtype, impl, fused, b_scale)
    ctx.call = _call_of(seed)


def _pqn_backward(ctx, g_w_hat, g_tmax, g_live):
    # the op's and _PQNSample's backward: the grad op where is_compiling() is true (as in torch
    # 2.13 while AOTAutograd traces a compiled backward), else the plain function, whose launches
    # go through wrap_triton under a tracing mode (_launch); so a compiled backward is right
    # either way, also with torch versions where is_compiling() is false there
    tmax, seed, live = ctx.saved_tensors
    _check_recomputed_call(ctx.call, seed)
    if g_w_hat is None:                  # grads are not materialized: w_hat had none
        return (None,) * 9
    dw, db = _pqn_ops()[1](g_w_hat, tmax, seed, live, *ctx.args)
    return dw, db, None, None, None, None, None, None, None


_pqn_sample_op.register_autograd(_pqn_backward, setup_context=_pqn_setup_context)


class _PQNSample(torch.autograd.Function):
    """Eager twin of gaussws::pqn_sample: the same functions, the same backward. In eager mode a
    torch.library op call costs far more host time (dispatch, autograd wrapper) than this
    autograd.Function, and a model makes one such call per layer and step, enough to make a large
    model's eager step host-bound. torch.compile traces the op instead (_pqn_sample)."""

    generate_vmap_rule = True   # torch.func.vmap over a layer worked through the op; keep it working

    forward = staticmethod(_pqn_sample_impl)
    setup_context = staticmethod(_pqn_setup_context)   # separate from forward: functorch needs it
    backward = staticmethod(_pqn_backward)


def _pqn_sample(*args):
    """(w_hat, tile max, live) of eq. 3 from (w, b, seed, method, out_dtype, impl, fused, b_target,
    b_scale), differentiable in w and b: the torch.library op under torch.compile (Inductor
    launches its kernels), the autograd.Function in eager code."""
    if torch.compiler.is_compiling():
        return torch.ops.gaussws.pqn_sample(*args)
    return _PQNSample.apply(*args)


def _pqn_ops():
    """(sample, grad) without autograd, for _RecomputeLinear: the ops under torch.compile, the
    plain functions in eager code (no dispatch cost)."""
    if torch.compiler.is_compiling():
        return torch.ops.gaussws.pqn_sample, torch.ops.gaussws.pqn_grad
    return _pqn_sample_impl, _pqn_grad_impl


def _check_sample_args(w, b_t, method, impl, fused, name="b_t"):
    _check_choice("method", method, METHODS)
    _check_fused(fused)
    _check_weight(w)
    _check_tiles(b_t, w, name)
    return _resolve_impl(impl, w)


def _sample_bits(b_init=None, b_target=None):
    """(b_target, b_scale) of the sample op's b_t = b_target + b·b_scale: (0, 1) where b is b_t
    itself (b_init None: the public calls), eq. 11 where b is a layer's b_i."""
    return (0.0, 1.0) if b_init is None else (float(b_target), float(b_init - b_target))


def gaussws_sample(w, b_t, seed, method="gaussws", out_dtype=torch.bfloat16, impl="auto", fused=False):
    """Differentiable w_hat = w + R ⊙ broadcast_32(max_32(|w|)·2^(1−b_t)) (eq. 3) with the
    gradients of eq. 4 (∂L/∂w = ∂L/∂w_hat; ∂L/∂b_t = −ln2·max_32|w|·2^(1−b_t)·sum_32(∂L/∂w_hat ⊙ R),
    R regenerated from `seed` in backward).

    w: (m, n), m, n >= 1, float32 (bf16/fp16 accepted); b_t: (ceil(m/32), ceil(n/32)) float,
    used as clamp(b_t, B_MIN, B_MAX) = [1, 24] bits (∂L/∂b_t = 0 where clamped); seed: int in
    [0, 2**63) or int64 tensor [key, counter]; returns w_hat (m, n) in out_dtype (paper: BF16).
    fused=True generates R inside the apply/grad kernels (GaussWS only; same R, same result).
    A NaN in w makes its whole tile NaN (its tile maximum is NaN, as torch's amax); a NaN b_t
    makes its tile NaN, with ∂L/∂b_t = 0 there (values are not checked: that would wait for the
    GPU). impl "torch" and "triton" give the same bits on CUDA; on CPU 2^(1−b_t) of a fractional
    b_t can differ in its last bit between numpy's exp2 (the interpreter) and torch's CPU exp2
    (whose vectorized and scalar paths differ too), and so w_hat by 1 ulp in such a tile.
    Raises TypeError (w dtype, out_dtype, seed type, fused not a bool) / ValueError (shapes, w and
    b_t on different devices, empty w, seed range, a seed tensor's dtype or shape, method, impl)."""
    impl = _check_sample_args(w, b_t, method, impl, fused)
    seed = _seed_tensor(seed, w.device)
    _check_out_dtype(out_dtype)
    # ∂L/∂b_t = 0 where b_t is clamped
    return _pqn_sample(w.contiguous(), b_t.contiguous(), seed, method, out_dtype, impl, fused, *_sample_bits())[0]


class _RecomputeLinear(torch.autograd.Function):
    """y = F.linear(x, w_hat, bias) that keeps no w_hat for backward: it is rebuilt from
    (w, b, seed) there ("recompute" memory mode). b_target, b_scale: `_sample_bits`."""

    @staticmethod
    def forward(ctx, x, w, b, seed, bias, method, impl, fused, b_target, b_scale):
        w_hat, tmax, live = _pqn_ops()[0](w, b, seed, method, x.dtype, impl, fused, b_target, b_scale)
        ctx.save_for_backward(x, w, b, seed, tmax, live)
        ctx.args = (method, impl, fused, b_target, b_scale, bias is not None)
        ctx.call = _call_of(seed)
        return F.linear(x, w_hat, bias)

    @staticmethod
    def backward(ctx, gy):
        x, w, b, seed, tmax, live = ctx.saved_tensors
        _check_recomputed_call(ctx.call, seed)
        method, impl, fused, b_target, b_scale, has_bias = ctx.args
        sample, grad = _pqn_ops()
        w_hat = sample(w, b, seed, method, x.dtype, impl, fused, b_target, b_scale)[0]
        gy2 = gy.reshape(-1, gy.shape[-1]).to(x.dtype)
        gx = (gy2 @ w_hat).view(x.shape)
        g_w_hat = gy2.t() @ x.reshape(-1, x.shape[-1])
        dw, db = grad(g_w_hat, tmax, seed, live, method, w.dtype, b.dtype, impl, fused, b_scale)
        gb = gy2.sum(0) if has_bias else None
        return gx, dw, db, None, gb, None, None, None, None, None


def _compute_dtype(x):
    dev = x.device.type
    if dev != "meta" and torch.is_autocast_enabled(dev):   # meta has no autocast (asking raises)
        return torch.get_autocast_dtype(dev)
    return x.dtype


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


def _check_input(x, w, bias):
    """x (..., n) and bias (m,) or None for a weight w (m, n): floating tensors on w's device."""
    for name, t in (("x", x), ("bias", bias)):
        if name == "bias" and t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor{' or None' if name == 'bias' else ''}, "
                            f"got {type(t).__name__}")
        _check_dtype(t.dtype, name)
        if t.device != w.device:
            raise ValueError(f"{name} is on {t.device} and the weight on {w.device}: they must be on the same device")
    if x.dim() == 0 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x has shape {tuple(x.shape)}; w {tuple(w.shape)} needs (..., {w.shape[1]})")
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; w {tuple(w.shape)} needs ({w.shape[0]},)")


def _pqt_linear(x, w, b, b_init, b_target, bias, seed, method, memory, impl, fused):
    """`pqt_linear` with b_t from b as `_sample_bits` makes it: b = b_t (b_init None) or a
    layer's b_i (eq. 11), whose gradient then comes from the grad kernel as it is. seed may also
    be a function that draws it (a layer's `_next_seed`), called once everything is checked: a
    failed call draws no noise."""
    _check_choice("memory", memory, MEMORY_MODES)
    impl = _check_sample_args(w, b, method, impl, fused, "b_t" if b_init is None else "b_i")
    _check_input(x, w, bias)
    seed = _seed_tensor(seed() if callable(seed) else seed, w.device)
    cd = _compute_dtype(x)
    b, bits = b.contiguous(), _sample_bits(b_init, b_target)
    # the bias in w_hat's dtype, as autocast casts it (outside autocast x may be BF16, the bias FP32)
    bias = bias.to(cd) if bias is not None else None
    if memory == "save":
        return F.linear(x, _pqn_sample(w.contiguous(), b, seed, method, cd, impl, fused, *bits)[0], bias)
    xb = x.to(cd)
    with torch.autocast(x.device.type, enabled=False):
        return _RecomputeLinear.apply(xb, w.contiguous(), b, seed, bias, method, impl, fused, *bits)


# ==============================================================================================
# seeds (§3.6): a layer's key and call counter; the counter advances once per training call

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
    _launch(_next_seed_kernel)[(1,)](state, seed)
    return seed


_next_seed_op = triton_op("gaussws::next_seed", mutates_args=("state",))(_next_seed_impl)


def _splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def _call_of(seed):
    """The (layer name, call number) an eager GaussWSLinear forward tagged its seed tensor with;
    None for other seeds (plain tensors, traced ones under torch.compile)."""
    return getattr(seed, "_gaussws_call", None)


def _check_recomputed_call(call, seed):
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


# ==============================================================================================
# bitwidths (eq. 11–12)

# Safe range of b_t. Sampling uses clamp(b_t, B_MIN, B_MAX); eq. 11 is exact inside the range and
# b_init, b_target must lie in it. Below 1 bit the PQN step max_32|w|·2^(1−b_t) exceeds the tile
# max (the noise swamps the weight), and far below it 2^(1−b_t) overflows to inf and 0·inf gives
# NaN. Above 24 bits the step is below one float32 ulp of the tile max, far past any format of
# Table C (FP16 e5m10 holds b_t <= 12) and of BF16 (§3.3: b_t < 9): more bits change nothing.
# A clamped tile gets no ∂L/∂b_t (clamp's gradient is 0 outside the range, 1 inside and at the
# ends), so the loss cannot push it further out; weight decay on b_i and `bitwidth_penalty`
# (which see the unclamped eq. 11 value) still pull it back toward b_target, inside the range.
B_MIN, B_MAX = 1.0, 24.0


def _check_bits(b_init, b_target):
    """b_init, b_target: numbers (not bool) in [B_MIN, B_MAX] with b_target <= b_init (eq. 11:
    b_t starts at b_init, b_i = 1, and weight decay on b_i moves it to b_target). Equal values are
    allowed: b_t = b_target for every b_i (fixed-bitwidth PQT, b_i gets zero gradient)."""
    for name, v in (("b_init", b_init), ("b_target", b_target)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not B_MIN <= v <= B_MAX:
            raise ValueError(f"{name}={v!r} must be a number of bits in [{B_MIN:g}, {B_MAX:g}]")
    if b_target > b_init:
        raise ValueError(f"b_target={b_target!r} > b_init={b_init!r}: need b_target <= b_init (eq. 11: "
                         "b_t = b_target + b_i·(b_init − b_target) starts at b_init, decays to b_target)")


def _bitwidth(b_i, b_init, b_target):
    """eq. 11: b_t = b_target + b_i·(b_init − b_target), float32, not clamped."""
    return _scaled_bits(b_i, b_target, b_init - b_target)


def _scaled_bits(b, b_target, b_scale):
    """eq. 11 with b_scale = b_init − b_target given: b_target + b·b_scale, float32 (b_scale 1,
    b_target 0: the public calls' b_t itself)."""
    return b_target + b.float() * b_scale


def bitwidth_penalty(model):
    """Σ_layers mean_tiles |b_t − b_target| (the λ term of eq. 12; the trainer multiplies by λ),
    on the unclamped eq. 11 b_t so it also pulls tiles that left [B_MIN, B_MAX] back toward
    b_target. Scalar float32 tensor, differentiable w.r.t. every b_i; 0 (an empty sum) when the
    model has no PQT layer. TypeError if model is not an nn.Module."""
    _check_module(model, "bitwidth_penalty")
    terms = [(m.b_t - m.b_target).abs().mean() for _, m in pqt_layers(model)]
    if not terms:
        p = next(model.parameters(), None)
        return torch.zeros((), device=p.device if p is not None else "cpu")
    return torch.stack(terms).sum()


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
    apply_pqt fixes it). Buffer `noise_state` int64 [key, call
    counter] (checkpointed by state_dict). The counter advances by one at every training-mode
    forward (not at the re-run of a forward by activation checkpointing, which reuses the last
    seed: a layer called twice in one checkpointed region, or checkpointed again before the
    backward, raises RuntimeError in that backward); eval mode uses w itself (no noise) unless
    `sample_in_eval` is set, in which case it samples with the current state without advancing
    it. `reset_parameters()` initialises weight, bias, b_i and noise_state as at construction.

    Under FSDP2 (fully_shard) weight, bias and b_i are sharded between forwards and all-gathered
    around this layer's forward and backward, so the layer samples from the whole weight and
    b_t; noise_state, a buffer, is not sharded: every rank holds it and advances it alike. R,
    w_hat and the gradients are the unsharded layer's bit for bit (test_all.py checks it on 2
    ranks); no code here depends on the sharding. FSDP2 wants one dtype for all parameters of a
    group, and b_i is float32: shard BF16 training as FP32 parameters with
    MixedPrecisionPolicy(param_dtype=torch.bfloat16), not as a BF16 model.
    """

    def __init__(self, in_features, out_features, bias=True, method="gaussws", b_init=6.0,
                 b_target=4.0, seed=0, memory="save", impl="auto", fused=True, device=None, dtype=None):
        _check_choice("method", method, METHODS)
        _check_choice("memory", memory, MEMORY_MODES)
        _check_choice("impl", impl, IMPLS)
        _check_fused(fused, "GaussWSLinear")
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1 (an empty weight has no tiles to sample)")
        _check_dtype(dtype if dtype is not None else torch.get_default_dtype(), "GaussWSLinear weight")
        _check_bits(b_init, b_target)
        _check_seed(seed)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.method, self.memory, self.impl, self.fused = method, memory, impl, fused
        self.b_init, self.b_target = float(b_init), float(b_target)
        self.sample_in_eval = False
        self.b_i = nn.Parameter(torch.ones(tile_grid(out_features, in_features), device=device,
                                           dtype=torch.float32))   # float32 always: see above
        self._key = _splitmix64(seed) & (2 ** 63 - 1)
        self.register_buffer("noise_state", torch.tensor([self._key, 0], dtype=torch.int64, device=device))
        self._name = f"({in_features} -> {out_features})"   # apply_pqt sets the module name
        self._calls = 0            # eager training calls, to tag their seeds (_check_recomputed_call)
        self._last_call = self._replayed = None
        self._warned_b_i = False

    def reset_parameters(self):
        """Initialise as at construction: weight and bias as nn.Linear does, b_i = 1 and
        noise_state = [key, 0] (call counter 0, key from the constructor's seed). The way to fill a
        layer made on the meta device after `to_empty`."""
        super().reset_parameters()
        if "b_i" in self._parameters:          # nn.Linear.__init__ calls this before b_i exists
            with torch.no_grad():
                self.b_i.fill_(1.0)
                self.noise_state.copy_(torch.tensor([self._key, 0], dtype=torch.int64))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # A plain checkpoint (weight, bias, no b_i and no noise_state: the model before apply_pqt)
        # loads too, also with strict=True: b_i and noise_state start as at construction (b_i = 1,
        # call counter 0), so fine-tuning from it is a fresh PQT run from those weights.
        plain = prefix + "weight" in state_dict and not any(prefix + k in state_dict
                                                             for k in ("b_i", "noise_state"))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if plain:
            with torch.no_grad():
                self.b_i.fill_(1.0)
                self.noise_state.copy_(torch.tensor([self._key, 0], dtype=torch.int64))
            for k in ("b_i", "noise_state"):
                if prefix + k in missing_keys:
                    missing_keys.remove(prefix + k)

    @property
    def b_t(self):
        """Tile bitwidths, exactly eq. 11 (not clamped; sampling clamps to [B_MIN, B_MAX]),
        float32, differentiable w.r.t. b_i."""
        return _bitwidth(self.b_i, self.b_init, self.b_target)

    def _next_seed(self):
        if not self.training:
            return self.noise_state.clone()
        if _in_backward_pass():      # activation recomputation of the last call: same seed
            if _in_reentrant_recomputation():
                # it recomputes each region once per backward: a second recomputation of the
                # layer in one backward is of another call (use_reentrant=False: the backward
                # checks the seed's tag instead; there nested regions recompute a call twice)
                replay = (torch._C._current_graph_task_id(), self._last_call)
                if replay == self._replayed:
                    raise RuntimeError(_recompute_error(self._name, "recomputes the layer a second "
                                                        "time in one backward"))
                self._replayed = replay
            seed = self.noise_state.clone()
            seed[1:].sub_(1)                     # a scalar kernel argument: no host-to-device copy
            seed._gaussws_call = self._last_call   # backward checks it is its call's
            return seed
        if torch.compiler.is_compiling():
            return torch.ops.gaussws.next_seed(self.noise_state)
        seed = _next_seed_impl(self.noise_state)   # eager: no op dispatch (see _PQNSample)
        seed._gaussws_call = self._last_call = (self._name, self._calls)
        self._calls += 1
        return seed

    def _check_dtypes(self, w):
        if w.dtype not in W_DTYPES:
            raise TypeError(f"GaussWSLinear {self._name}: its weight is {w.dtype} (the model was cast after "
                            "apply_pqt or construction?); allowed: float32, bfloat16, float16")
        if self.b_i.dtype in (torch.bfloat16, torch.float16) and not self._warned_b_i:
            self._warned_b_i = True
            warnings.warn(f"GaussWSLinear {self._name}: b_i is {self.b_i.dtype} (the model was cast "
                          "after apply_pqt); optimizer steps of ~1e-3 round away near 1.0 in it, so "
                          "b_t will not learn: keep b_i float32 (cast the model before apply_pqt, or "
                          "set layer.b_i.data = layer.b_i.data.float())", stacklevel=3)

    def linear_weight(self):
        """The (out, in) weight that eq. 3 samples (GaussWSConv1D: a view of its (in, out) one)."""
        return self.weight

    def forward(self, x):
        w = self.linear_weight()
        if not (self.training or self.sample_in_eval):
            return F.linear(x, w, self.bias)
        self._check_dtypes(w)
        # b_i itself goes in (not b_t = eq. 11 of it): the grad kernel returns ∂L/∂b_i; the seed is
        # drawn after the argument checks (a failed call does not advance the counter)
        return _pqt_linear(x, w, self.b_i, self.b_init, self.b_target, self.bias, self._next_seed,
                           self.method, self.memory, self.impl, self.fused)

    def extra_repr(self):
        return (super().extra_repr() + f", method={self.method}, b_init={self.b_init}, "
                f"b_target={self.b_target}, memory={self.memory}")


class GaussWSConv1D(GaussWSLinear):
    """GaussWSLinear in the layout of Hugging Face's GPT-2 `Conv1D` (y = x @ weight + bias, weight
    of shape (in, out), the transpose of nn.Linear's): `apply_pqt` puts it in place of a Conv1D.

    It keeps Conv1D's weight Parameter as it is, so the state dict keeps Conv1D's keys and shapes
    (a Hugging Face checkpoint loads into it and `remove_pqt` gives the Conv1D back), and samples
    weight.t(), the (out, in) weight of the equivalent nn.Linear, with that linear's 32x32 tiles:
    b_i has shape (ceil(out/32), ceil(in/32)) as in GaussWSLinear(in, out). Square tiles anchored
    at (0, 0) are the same tiles in both layouts, so every tile holds the same weights; only the
    order in which R is drawn over them differs. Arguments and errors as GaussWSLinear; made
    directly, its weight is initialised as Conv1D does (N(0, 0.02²), bias 0).
    """

    def __init__(self, in_features, out_features, *args, **kwargs):
        super().__init__(in_features, out_features, *args, **kwargs)
        self.weight = nn.Parameter(self.weight.new_empty(in_features, out_features))
        self.reset_parameters()

    def reset_parameters(self):
        """As GaussWSLinear's (b_i = 1, noise_state = [key, 0]), with Conv1D's weight and bias."""
        super().reset_parameters()
        with torch.no_grad():
            nn.init.normal_(self.weight, std=0.02)
            if self.bias is not None:
                self.bias.zero_()

    def linear_weight(self):
        return self.weight.t()    # the (out, in) view; pqt_linear copies it to a contiguous w

    def extra_repr(self):
        return super().extra_repr() + ", Conv1D layout (weight is (in, out))"


# ==============================================================================================
# apply_pqt: where PQT is applied ("method[part]" of paper A's experiments)

# Hugging Face names of the papers' parts: Llama-style models (Llama, Mistral, Qwen, ...) and GPT-2
# (Conv1D layers; c_proj is the attention's out projection or the MLP's down projection)
HF_PARTS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "out", "gate_proj": "gate",
            "up_proj": "up", "down_proj": "down", "c_attn": "qkv", "c_fc": "up",
            "attn.c_proj": "out", "mlp.c_proj": "down"}


def _parse_parts(parts):
    """-> list of part names; "all" -> ALL_PARTS (every part this model kind has), "od" -> out, down;
    a Hugging Face name (HF_PARTS) stands for its part."""
    if not isinstance(parts, str):
        raise TypeError(f"parts must be a string, got {type(parts).__name__}")
    if parts == "all":
        return list(ALL_PARTS)
    if parts == "od":
        return ["out", "down"]
    given = [p.strip() for p in parts.split(",") if p.strip()]
    bad = [p for p in given if p not in ALL_PARTS and p not in HF_PARTS]
    if not given or bad:
        aliases = ", ".join(f"{k}={v}" for k, v in HF_PARTS.items())
        raise ValueError(f"parts={parts!r}: unknown part(s) {bad or [parts]}; allowed: 'all', 'od' "
                         f"or a comma list of {', '.join(ALL_PARTS)} or their Hugging Face names "
                         f"({aliases})")
    return list(dict.fromkeys(HF_PARTS.get(p, p) for p in given))


def _part_of(name):
    """The paper's part name of a module called `name` (its own name here, its Hugging Face name
    mapped by HF_PARTS), else None."""
    path = name.split(".")
    if path[-1] in ALL_PARTS:
        return path[-1]
    return HF_PARTS.get(path[-1]) or HF_PARTS.get(".".join(path[-2:]))


def _is_conv1d(m):
    # Hugging Face's transformers.pytorch_utils.Conv1D, recognised without importing transformers
    return (type(m).__name__ == "Conv1D" and hasattr(m, "nf") and hasattr(m, "nx")
            and isinstance(getattr(m, "weight", None), nn.Parameter)
            and tuple(m.weight.shape) == (m.nx, m.nf))


def _linears(model):
    """(name, parent, attribute, module) of every nn.Linear (exactly: subclasses may not call their
    own forward, e.g. nn.MultiheadAttention's out_proj) and Conv1D in `model`, each place a module
    sits (a module shared by two parents is listed under both names), in module order (depth
    first, as named_modules lists them)."""
    found = []
    for name, child in model.named_modules(remove_duplicate=False):
        if name and (type(child) is nn.Linear or _is_conv1d(child)):
            pname, _, cname = name.rpartition(".")
            found.append((name, model.get_submodule(pname) if pname else model, cname, child))
    return found


# last names of a module that apply_pqt takes for an LM head: nanoGPT / Hugging Face, minGPT-style
# `head`, Meta's Llama `output`, GPT-NeoX `embed_out`
HEAD_NAMES = ("lm_head", "head", "output", "embed_out")


def _lm_head_ids(model):
    """ids of the modules apply_pqt treats as the LM head: a linear whose weight is an nn.Embedding's
    weight (tied, e.g. Hugging Face tie_word_embeddings), the module of Hugging Face's
    get_output_embeddings(), and any linear whose last name is in HEAD_NAMES."""
    emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    ids = {id(child) for name, _, _, child in _linears(model)
           if id(child.weight) in emb or name.rsplit(".", 1)[-1] in HEAD_NAMES}
    out = getattr(model, "get_output_embeddings", None)
    head = out() if callable(out) else None
    if isinstance(head, nn.Module):
        ids.add(id(head))
    return ids


def _module_filter(modules):
    """modules (a glob, a list of globs, or a callable (name, module) -> bool) -> (the callable,
    the globs or None). The callable's errors name the module it was asked about."""
    if callable(modules):
        def keep(name, module):
            try:
                r = modules(name, module)
            except Exception as err:
                raise ValueError(f"apply_pqt: modules={modules!r} raised {type(err).__name__} on "
                                 f"module {name!r}: {err}") from err
            if not isinstance(r, bool):
                raise TypeError(f"apply_pqt: modules={modules!r} returned {r!r} "
                                f"({type(r).__name__}) for module {name!r}; it must return True or False")
            return r
        return keep, None
    globs = [modules] if isinstance(modules, str) else modules
    if not (isinstance(globs, (list, tuple)) and globs and all(isinstance(p, str) and p for p in globs)):
        raise TypeError(f"modules={modules!r}: allowed: a glob on module names (e.g. "
                        "'model.layers.*.mlp.*'), a non-empty list of globs, or a callable "
                        "(name, module) -> bool")
    return (lambda name, _: any(fnmatch.fnmatchcase(name, p) for p in globs)), list(globs)


def _few(names, k=8):
    return ", ".join(names[:k]) + (f", ... ({len(names)} in all)" if len(names) > k else "") or "none"


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
    the first's. Returns the names of the replaced
    modules ("blocks.0.attn.qkv", "model.layers.0.self_attn.q_proj", ...), in module order.
    Everything is checked before the model is touched. Raises TypeError (model not an nn.Module,
    seed, modules, lm_head or fused type, a callable's non-bool answer, float64 layers) or
    ValueError (bad arguments; the model itself a linear layer; both parts and modules; a
    named part the model has no linear for: the message lists the parts present; a filter that
    selects no layer, or a glob of a list that matches none: the message lists the model's linears
    and the nn.Linear subclasses it leaves alone)."""
    _check_module(model, "apply_pqt")
    if isinstance(model, nn.Linear) or _is_conv1d(model):
        raise ValueError(f"apply_pqt: the model is itself a linear layer ({type(model).__name__}); apply_pqt "
                         "replaces the layers inside a model: wrap it (nn.Sequential(layer)) or build a GaussWSLinear")
    sharded = [n or "the model" for n, m in model.named_modules()
               if any(c.__name__ == "FSDPModule" for c in type(m).__mro__)]
    if sharded:   # fully_shard made their parameters DTensors and their classes FSDP subclasses
        raise ValueError(f"apply_pqt: {_few(sharded)} already went through fully_shard; call apply_pqt "
                         "first, then fully_shard (FSDP2 then gathers w and b_i for each layer's forward)")
    _check_choice("method", method, METHODS)
    _check_choice("memory", memory, MEMORY_MODES)
    _check_choice("impl", impl, IMPLS)
    _check_fused(fused, "apply_pqt")
    _check_bits(b_init, b_target)
    _check_seed(seed)
    if parts is not None and modules is not None:
        raise ValueError(f"apply_pqt: give parts={parts!r} or modules={modules!r}, not both")
    if not isinstance(lm_head, bool):
        raise TypeError(f"apply_pqt: lm_head={lm_head!r} must be True or False")
    heads = _lm_head_ids(model)
    cands = [c for c in _linears(model) if lm_head or id(c[3]) not in heads]
    done = [n for n, _ in pqt_layers(model)]
    already = f" (already GaussWSLinear: {_few(done)})" if done else ""
    # nn.Linear subclasses are not replaced (their forward may not be nn.Linear's): say so when
    # they are all a filter could have found
    subs = [f"{n} ({type(m).__name__})" for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and type(m) is not nn.Linear and not isinstance(m, GaussWSLinear)]
    subs = (f"; not replaced, being nn.Linear subclasses whose forward may differ: {_few(subs)}"
            if subs else "")
    if modules is None:
        parts = "all" if parts is None else parts
        wanted = _parse_parts(parts)
        have = list(dict.fromkeys(p for p in map(_part_of, (c[0] for c in cands)) if p))
        missing = [p for p in wanted if p not in have] if parts != "all" else ([] if have else wanted)
        if missing:
            other = [c[0] for c in cands if not _part_of(c[0])]
            raise ValueError(f"apply_pqt(parts={parts!r}): no nn.Linear named {', '.join(missing)} "
                             f"inside the model; the parts it has: {', '.join(have) or 'none'}{already}"
                             + (f"; linears without a part name: {_few(other)}" if other else "") + subs
                             + ("" if have else "; select other layers by name with modules="))
        # lm_head=True adds the LM head, which has no part name, to the parts
        found = [c for c in cands if _part_of(c[0]) in wanted or (lm_head and id(c[3]) in heads)]
    else:
        keep, globs = _module_filter(modules)
        found = [c for c in cands if keep(c[0], c[3])]

        def head_note():      # only for an error: the filter is asked about the head only then
            skipped = [n for n, _, _, m in _linears(model) if id(m) in heads and not lm_head and keep(n, m)]
            return f" but the LM head {_few(skipped)} (lm_head=True samples it)" if skipped else ""
        if not found:
            raise ValueError(f"apply_pqt(modules={modules!r}) selects no nn.Linear (only nn.Linear and "
                             "Conv1D layers are sampled, never embeddings or norms)" + head_note()
                             + f"; the model's linears: {_few([c[0] for c in cands])}{already}{subs}")
        unmatched = [p for p in globs or () if not any(fnmatch.fnmatchcase(c[0], p) for c in cands)]
        if unmatched:
            raise ValueError(f"apply_pqt(modules={modules!r}): {', '.join(map(repr, unmatched))} "
                             f"matches no linear{head_note()}; the model's linears: "
                             f"{_few([c[0] for c in cands])}{already}{subs}")
        # a module selected at one of its places is replaced at all of them (one layer, shared)
        chosen = {id(c[3]) for c in found}
        found = [c for c in cands if id(c[3]) in chosen]
    for name, _, _, child in found:
        _check_dtype(child.weight.dtype, f"{name}.weight")
    rng = random.Random(seed)
    # keys continue after the GaussWS layers already in the model (an earlier apply_pqt): a second
    # call must not give its layers the keys of the first call's
    for _ in {id(m) for _, m in pqt_layers(model)}:
        rng.getrandbits(62)
    new, replaced = {}, []
    for name, parent, cname, child in found:
        if id(child) not in new:
            conv = _is_conv1d(child)
            n_in, n_out = (child.nx, child.nf) if conv else (child.in_features, child.out_features)
            layer = (GaussWSConv1D if conv else GaussWSLinear)(
                n_in, n_out, bias=child.bias is not None, method=method, b_init=b_init,
                b_target=b_target, seed=rng.getrandbits(62), memory=memory, impl=impl, fused=fused,
                device=child.weight.device, dtype=child.weight.dtype)
            layer.weight = child.weight
            if child.bias is not None:
                layer.bias = child.bias
            layer.train(child.training)
            layer._name, layer.plain_type = name, type(child)
            new[id(child)] = layer
            replaced.append(name)
        setattr(parent, cname, new[id(child)])
    return replaced


def _format_of(cast):
    """remove_pqt's cast -> None, "tiers" or (exp_bits, man_bits); ValueError otherwise."""
    if cast is None or cast == "tiers":
        return cast
    m = re.fullmatch(r"e(\d)m(\d+)", cast) if isinstance(cast, str) else None
    if m is None:
        raise ValueError(f"cast={cast!r}: allowed: None (weights as they are), 'tiers' (each tile "
                         "to its Table C format) or an FP format 'e<exponent bits>m<mantissa bits>' "
                         "such as 'e3m4' or 'e2m3'")
    fmt = int(m.group(1)), int(m.group(2))
    try:
        cast_fp(torch.zeros(1), *fmt)      # the formats cast_fp (and so cast_tiles) takes
    except ValueError as e:
        raise ValueError(f"cast={cast!r}: {e}") from None
    return fmt


def _hf_conv1d():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        raise ImportError("remove_pqt: turning a GaussWSConv1D back into a Conv1D needs Hugging Face "
                          "transformers (pip install transformers)") from None
    return Conv1D


@torch.no_grad()
def remove_pqt(model, cast=None):
    """Undo apply_pqt in place: every GaussWSLinear becomes a plain nn.Linear (a GaussWSConv1D the
    Conv1D it replaced) holding the same weight and bias Parameters, without b_i and noise_state,
    so the model and its state dict are used without this library (TorchAO's QAT "convert").
    cast: None keeps the trained weights w; "tiers" first casts every tile of w to the Table C
    format of its bitwidth (`cast_to_tiers`); "eXmY" (e.g. "e3m4", "e2m3", as the CAST_SWEEP of
    the cast sweep) casts every tile to that FP format with its own power-of-two scale
    (`cast_tiles`). The weights keep their dtype (float32 holds every cast value exactly). The model
    keeps its train/eval mode; an optimizer made before still holds the removed b_i.
    From a PQT checkpoint: build the model, apply_pqt with the same arguments, load_state_dict,
    then remove_pqt; to export and keep training, call it on copy.deepcopy(model). Returns the
    names of the layers replaced, in module order.
    Raises TypeError (model not an nn.Module), ValueError (cast not one of those; a model
    without GaussWSLinear layers)."""
    _check_module(model, "remove_pqt")
    fmt = _format_of(cast)
    layers = pqt_layers(model)
    if not layers or isinstance(model, GaussWSLinear):
        raise ValueError(f"remove_pqt: model {type(model).__name__} has no GaussWSLinear layer"
                         + (" inside it (it is one: put it in a module)" if layers else ""))
    if fmt == "tiers":
        cast_to_tiers(model)
    elif fmt is not None:
        for _, layer in layers:
            w = layer.linear_weight()
            w.copy_(cast_tiles(w, *fmt))
    plain, removed = {}, []
    for pname, parent in list(model.named_modules()):
        for cname, child in list(parent._modules.items()):
            if not isinstance(child, GaussWSLinear):
                continue
            if id(child) not in plain:
                cls = getattr(child, "plain_type", None) or (_hf_conv1d() if isinstance(child, GaussWSConv1D)
                                                             else nn.Linear)
                with torch.device("meta"):       # no weights allocated: the layer's own go in
                    p = (cls(child.out_features, child.in_features) if isinstance(child, GaussWSConv1D)
                         else cls(child.in_features, child.out_features, bias=child.bias is not None))
                p.weight = child.weight
                p.bias = child.bias
                p.train(child.training)
                plain[id(child)] = p
                removed.append(f"{pname}.{cname}" if pname else cname)
            setattr(parent, cname, plain[id(child)])
    return removed


def pqt_layers(model):
    """(name, GaussWSLinear) pairs of a model (an nn.Module, else TypeError), in module order."""
    _check_module(model, "pqt_layers")
    return [(n, m) for n, m in model.named_modules() if isinstance(m, GaussWSLinear)]


# ==============================================================================================
# Figure 5 statistics and the Table C tiers (§3.3, Prop. 3–4)

# (largest b_t, format name, exponent bits, mantissa bits) of each Table C tier, narrowest first;
# the only place the b_t -> format thresholds are written. Tiles above the last limit are wider
# than FP16 (">FP16").
FP_TIERS = ((5, "FP8 e3m4", 3, 4), (9, "FP12 e4m7", 4, 7), (12, "FP16 e5m10", 5, 10))


def fp_tier(b_t):
    """Smallest floating-point format of Table C (Prop. 4) that holds a bitwidth b_t (a number):
    the first tier of FP_TIERS whose limit is >= b_t (b_t ≤ 5 → "FP8 e3m4", ≤ 9 → "FP12 e4m7",
    ≤ 12 → "FP16 e5m10"), else ">FP16"."""
    for limit, name, _, _ in FP_TIERS:
        if b_t <= limit:
            return name
    return ">FP16"


def _tile_counts(m, n):
    tm, tn = tile_grid(m, n)
    rows = torch.full((tm,), TILE, dtype=torch.float64)
    cols = torch.full((tn,), TILE, dtype=torch.float64)
    rows[-1], cols[-1] = m - TILE * (tm - 1), n - TILE * (tn - 1)
    return rows[:, None] * cols[None, :]          # parameters per tile (edge tiles are partial)


def _stats(bt, cnt):
    tot = cnt.sum()
    mean = (bt * cnt).sum() / tot
    std = ((bt - mean) ** 2 * cnt).sum().div(tot).sqrt()
    out = dict(mean=mean.item(), std=std.item(), min=bt.min().item(), max=bt.max().item(),
               params=int(tot.item()))
    for lim, _, _, _ in FP_TIERS:
        out[f"share_le{lim}"] = (cnt[bt <= lim].sum() / tot).item()
    out["tier"] = fp_tier(out["max"])
    return out


def bitwidth_stats(model):
    """Figure 5 statistics of the bitwidths the layers sample with: b_t of eq. 11 clamped to
    [B_MIN, B_MAX] (as in the forward), parameter-weighted (edge tiles count their real size).

    Returns {layer name: {mean, std, min, max, params, share_le5, share_le9, share_le12, tier}}
    plus the key "all" aggregating every PQT layer; `tier` is the Table C format for the max
    (`fp_tier`), the share_le keys are the FP_TIERS limits.
    Raises TypeError if model is not an nn.Module and ValueError if it has no GaussWSLinear layer
    (statistics of no tiles are undefined; train.py only calls it after apply_pqt replaced some)."""
    _check_module(model, "bitwidth_stats")
    layers = pqt_layers(model)
    if not layers:
        raise ValueError(f"bitwidth_stats: model {type(model).__name__} has no GaussWSLinear layer "
                         "(call apply_pqt first)")
    out, bts, cnts = {}, [], []
    for name, m in layers:
        bt = m.b_t.detach().clamp(B_MIN, B_MAX).double().cpu()
        cnt = _tile_counts(m.out_features, m.in_features)
        out[name] = _stats(bt, cnt)
        bts.append(bt.flatten())
        cnts.append(cnt.flatten())
    out["all"] = _stats(torch.cat(bts), torch.cat(cnts))
    return out


# ==============================================================================================
# Table C: casting sampled weights to FP formats (§3.3, Prop. 3–4)

# The same layers of every model cast to one format, mantissa 4 down to 1 bit: Prop. 3 gives
# w_hat a (b_t - 2)-bit mantissa, so b_target = 4 calls for e3m2 -- a coarser grid than the FP8
# tier, where a model trained without noise should lose more than one trained with it.
CAST_SWEEP = ((3, 4), (3, 3), (3, 2), (3, 1))


def _fp_limits(exp_bits, man_bits, inf_nan=True):
    """(emin, emax, largest finite) of a binary FP format with bias 2^(exp_bits-1) - 1."""
    bias = 2 ** (exp_bits - 1) - 1
    emax = 2 ** exp_bits - (2 if inf_nan else 1) - bias
    return 1 - bias, emax, (2 - 2.0 ** -man_bits) * 2.0 ** emax


def cast_fp(x, exp_bits, man_bits, inf_nan=True):
    """Round x (float tensor, any shape/device) to the nearest value of the binary floating-point
    format with `exp_bits` exponent and `man_bits` mantissa bits, ties to even, with subnormals;
    magnitudes beyond the largest finite value (and +-inf) saturate to it. The format has
    exponent bias 2^(exp_bits-1) - 1; inf_nan=True reserves the all-ones exponent for inf/NaN as
    IEEE 754 does (the Table C formats count "a range for NaN/Inf", Prop. 4: e5m10 = IEEE FP16,
    e3m4, e4m7), inf_nan=False uses it for finite values (OCP FP4 E2M1: 0, 0.5, 1, 1.5, 2, 3, 4,
    6). NaN stays NaN. Returns the values in x's dtype (exact for float32 and float64 inputs; the
    rounding is done in float64).
    Raises ValueError unless exp_bits is an int in [1, 8] and man_bits an int in [0, 23]
    (exp_bits 1 needs inf_nan=False)."""
    for name, v, lo, hi in (("exp_bits", exp_bits, 1, 8), ("man_bits", man_bits, 0, 23)):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"cast_fp: {name}={v!r} must be an int in [{lo}, {hi}]")
    if exp_bits == 1 and inf_nan:
        raise ValueError("cast_fp: exp_bits=1 with inf_nan=True leaves no finite normal exponent; "
                         "use inf_nan=False")
    emin, _, top = _fp_limits(exp_bits, man_bits, inf_nan)
    a = x.detach().double().abs()
    _, ex = torch.frexp(a)                    # a = f * 2^ex, f in [0.5, 1): exponent = ex - 1
    step = torch.exp2((ex - 1).clamp(min=emin).double() - man_bits)   # grid spacing in a's binade
    q = (torch.round(a / step) * step).clamp(max=top)                 # torch.round: half to even
    return torch.where(torch.isnan(a), a, q).copysign(x.detach().double()).to(x.dtype)


def _tile_grid_of(t, m, n):
    """Broadcast a per-tile tensor (ceil(m/32), ceil(n/32)) to (m, n) (broadcast_32 of eq. 3)."""
    return _broadcast_tiles(t, m, n)


def cast_tiles(w, exp_bits, man_bits):
    """Every 32x32 tile of w (m, n) cast to FP(exp_bits, man_bits) with its own power-of-two scale
    (MX-style shared exponent): the tile's absmax lands in the format's top binade, so the largest
    magnitude stays representable (to the format's precision; at most it saturates to the largest
    finite value) and the format's exponent range spans downward from it, as Prop. 4 counts it.
    All-zero tiles stay zero. Returns a new tensor of w's dtype. Raises ValueError on a format
    `cast_fp` rejects."""
    m, n = w.shape
    tm, tn = tile_grid(m, n)
    pad = torch.zeros(tm * TILE, tn * TILE, dtype=torch.float64, device=w.device)
    pad[:m, :n] = w.detach().abs()
    amax = pad.view(tm, TILE, tn, TILE).amax(dim=(1, 3))
    _, ex = torch.frexp(amax)
    emax = _fp_limits(exp_bits, man_bits)[1]
    scale = _tile_grid_of(torch.where(amax > 0, torch.exp2((ex - 1 - emax).double()), 1.0), m, n)
    return (cast_fp(w.detach().double() / scale, exp_bits, man_bits) * scale).to(w.dtype)


@torch.no_grad()
def cast_to_tiers(model):
    """In place: the weight of every GaussWSLinear of `model` cast tile by tile to the Table C
    format its bitwidth calls for (b_t of eq. 11 clamped to [B_MIN, B_MAX], as sampling uses it),
    by the tier rule of `fp_tier` (FP_TIERS: first tier whose limit is >= b_t); tiles above the
    last limit keep their weights (">FP16").
    Returns {format name: share of those layers' weight parameters}, ">FP16" for the kept ones.
    Raises TypeError if model is not an nn.Module (and ZeroDivisionError if it has no
    GaussWSLinear layer: there is no share of no parameters)."""
    counts = {name: 0 for _, name, _, _ in FP_TIERS} | {">FP16": 0}
    for _, layer in pqt_layers(model):
        w = layer.linear_weight()
        m, n = w.shape
        bt = _tile_grid_of(layer.b_t.detach().clamp(B_MIN, B_MAX), m, n)
        out, lo = w.detach().clone(), -math.inf
        for limit, name, e, mb in FP_TIERS:       # fp_tier's rule: tier k holds lo < b_t <= limit
            mask = (bt > lo) & (bt <= limit)
            if mask.any():
                out = torch.where(mask, cast_tiles(w, e, mb), out)
            counts[name] += int(mask.sum())
            lo = limit
        counts[">FP16"] += int((bt > lo).sum())
        w.copy_(out)
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()}
