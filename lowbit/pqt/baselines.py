"""The noise of paper A's baselines, torch reference then Triton kernel for each: DiffQ-style
R ~ U(−0.5, 0.5) in BF16 (method "diffq": 2 B/element of temporary noise) and Box–Muller
R = round(N(0,1)/2) packed like GaussWS's (method "bm", `generate_noise` only: the paper's kernel
baseline). Both draw their random bits from the Philox words of philox.py (same key and counter
layout); `generate_noise` and the apply/grad kernels of gaussws.py call them.
"""
import torch
import triton
import triton.language as tl

from lowbit.philox import philox_words, philox_words_torch
from lowbit.pqt.packing import pack_noise
from lowbit.pqt.tl import tl_cast, tl_interleave8


def gen_diffq_torch(m, n, seed):
    """16 random bits per element -> U(-0.5, 0.5), exact in fp32, then BF16."""
    n8 = -(-n // 8)
    idx = torch.arange(m * n8, device=seed.device, dtype=torch.int64)
    r = philox_words_torch(seed, idx)
    h = torch.stack([(r[i // 2] >> (16 * (i % 2))) & 0xFFFF for i in range(8)], -1)  # (words, 8)
    u = (h.to(torch.float32) + 0.5) * 2.0 ** -16 - 0.5
    return u.to(torch.bfloat16).view(m, n8 * 8)[:, :n].contiguous()


@triton.jit
def _u16(h):
    """16 random bits -> U(-0.5, 0.5), exact in float32, then BF16 (DiffQ noise)."""
    return tl_cast((h.to(tl.float32) + 0.5) * 0.0000152587890625 - 0.5, tl.bfloat16)   # 2^-16


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
def gen_diffq_kernel(out_ptr, seed_ptr, M, N, N8, BLOCK: tl.constexpr):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    r0, r1, r2, r3 = philox_words(seed_ptr, p)
    # element 8p + 2i + L takes the 16-bit half L of word r_i
    u = tl_interleave8(_u16(r0 & 0xFFFF), _u16(r0 >> 16), _u16(r1 & 0xFFFF), _u16(r1 >> 16),
                     _u16(r2 & 0xFFFF), _u16(r2 >> 16), _u16(r3 & 0xFFFF), _u16(r3 >> 16))
    offs, mask = _diffq_offsets(tl.program_id(0), M, N, N8, BLOCK)
    tl.store(out_ptr + offs, u, mask=mask)


def gen_bm_torch(m, n, seed):
    """Two Philox calls per packed word (counters 2p, 2p+1), Box–Muller, R = round(z/2)."""
    n8 = -(-n // 8)
    idx = torch.arange(m * n8, device=seed.device, dtype=torch.int64)
    zs = []
    for a in range(2):
        r = philox_words_torch(seed, 2 * idx + a)
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
def gen_bm_kernel(out_ptr, seed_ptr, n_words, BLOCK: tl.constexpr):
    p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    packed = p.to(tl.uint32) * 0
    for a in tl.static_range(2):
        r0, r1, r2, r3 = philox_words(seed_ptr, 2 * p + a)
        z0, z1 = _bm_pair(r0, r1)
        z2, z3 = _bm_pair(r2, r3)
        packed = packed | (_bm_nib(z0) << (16 * a)) | (_bm_nib(z1) << (16 * a + 4))
        packed = packed | (_bm_nib(z2) << (16 * a + 8)) | (_bm_nib(z3) << (16 * a + 12))
    tl.store(out_ptr + p, packed.to(tl.int32, bitcast=True), mask=p < n_words)
