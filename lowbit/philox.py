"""
Philox4x32 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): the
counter-based random number generator both papers' kernels draw from.

    for each round:  (c0, c1, c2, c3) <- (hi(M1·c2) ^ c1 ^ k0,  lo(M1·c2),
                                          hi(M0·c0) ^ c3 ^ k1,  lo(M0·c0))
                     (k0, k1)         <- (k0 + W0, k1 + W1)            (all mod 2^32)

A counter (c0..c3) and a key (k0, k1) give four independent uint32 words, so any element's bits
can be recomputed from its index alone: GaussWS regenerates R in backward (paper A §3.6) and the
4-bit step draws its stochastic-rounding uniforms (paper B Sec. 3.2) without storing either.
Ten rounds is the standard (Triton's tl.randint4x); seven is Random123's smallest crush-resistant
count, which the 4-bit step uses.

`philox_torch` is the plain-PyTorch reference (int64 tensors holding uint32 values), `philox` the
Triton function with the same arguments; tests check both against Random123's known answers and
against tl.philox.
"""
import torch
import triton
import triton.language as tl

M0, M1 = 0xD2511F53, 0xCD9E8D57     # round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85     # Weyl key increments
_M32 = 0xFFFFFFFF


def _mulhilo(a, mult):
    """(hi, lo) 32-bit halves of a·mult for uint32 a (int64 tensor) without int64 overflow."""
    mh, ml = mult >> 16, mult & 0xFFFF
    lo_p, hi_p = a * ml, a * mh                     # both < 2^48
    t = lo_p + ((hi_p & 0xFFFF) << 16)              # < 2^49
    return ((hi_p >> 16) + (t >> 32)) & _M32, t & _M32


def philox_torch(c0, c1, c2, c3, k0, k1, rounds=10):
    """Philox4x32-`rounds` in plain PyTorch. c0..c3, k0, k1: int64 tensors (broadcastable) holding
    uint32 values. Returns the four output words as int64 tensors in [0, 2^32)."""
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(c0, M0)
        hi1, lo1 = _mulhilo(c2, M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + W0) & _M32, (k1 + W1) & _M32
    return c0, c1, c2, c3


@triton.jit
def philox(c0, c1, c2, c3, k0, k1, n_rounds: tl.constexpr):
    """Philox4x32-`n_rounds` on uint32 blocks: the Triton twin of `philox_torch`. Each 32×32-bit
    product is one 64-bit multiply (a single IMAD.WIDE gives both halves)."""
    for _ in tl.static_range(n_rounds):
        pb = c2.to(tl.uint64) * 0xCD9E8D57      # M1
        pa = c0.to(tl.uint64) * 0xD2511F53      # M0
        c0 = (pb >> 32).to(tl.uint32) ^ c1 ^ k0
        c2 = (pa >> 32).to(tl.uint32) ^ c3 ^ k1
        c1 = pb.to(tl.uint32)
        c3 = pa.to(tl.uint32)
        k0 += 0x9E3779B9                        # W0
        k1 += 0xBB67AE85                        # W1
    return c0, c1, c2, c3


# ----------------------------------------------------------------------------------------------
# the words of one (key, counter) seed pair for a run of element counters (GaussWS's layout)

def philox_words_torch(seed, idx):
    """4 random uint32 words (int64 tensors) for counters idx (int64) under seed = [key, counter]
    (an int64 tensor of 2): key -> (k0, k1), (idx, counter) -> (c0, c1, c2, c3), 32 bits each.
    GaussWS's R (paper A eq. 10, one word per 8 elements) and its baselines' noise use this layout."""
    key, ctr = seed[0], seed[1]
    z = torch.zeros_like(idx)
    return philox_torch(idx & _M32, (idx >> 32) & _M32, z + (ctr & _M32), z + ((ctr >> 32) & _M32),
                        key & _M32, (key >> 32) & _M32)


@triton.jit
def philox_words(seed_ptr, p):
    """4 uint32 words for int32 counters p (word index) under seed = [key, counter] at seed_ptr:
    the Triton twin of `philox_words_torch` (Philox4x32-10)."""
    key = tl.load(seed_ptr)
    ctr = tl.load(seed_ptr + 1)
    k0 = (key & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = p.to(tl.uint32)
    z = c0 * 0
    c2 = z + (ctr & 0xFFFFFFFF).to(tl.uint32)
    c3 = z + ((ctr >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return philox(c0, z, c2, c3, k0, k1, 10)
