"""
The random bits of AdamW4bit's stochastic rounding (paper B, Def. 5; the BF16 SR write): the seed
scheme, written once, and the Triton uniforms drawn from it. Touches no tensor of the optimizer.

Seed scheme: the bits of step t of the parameter with index i (its position in the optimizer,
from 1) depend only on (seed, t, i), so a resumed run draws the same bits:
  seed_of_step(seed, t) = (seed * SEED_MULT + t * STEP_MULT) mod SEED_MOD
  seed_of_index(i)      = i * INDEX_MULT mod SEED_MOD
  sr_seed(seed, t, i)   = (seed_of_step + seed_of_index) mod SEED_MOD
31 bits, so torch (manual_seed) and Triton (an int32 argument) both take it. The kernels add the
two terms themselves: the launch table holds seed_of_index per tensor and is the same each step.
A capturable step reads t on the device and adds t * STEP_MULT to seed_term(seed) there. An FSDP2
shard moves its index term by SHARD_SEED_STRIDE per block of global offset.
"""
import triton
import triton.language as tl

from philox import philox

SEED_MOD = 2 ** 31 - 1        # a prime: the terms below never cancel to a shared seed by accident
SEED_MULT = 1_000_003         # the run seed's multiplier
STEP_MULT = 65_537            # the step's
INDEX_MULT = 257              # the parameter index's
SHARD_SEED_STRIDE = 4099      # seed-index step per block of global offset (a prime, so shards of
                              # one tensor and other parameters' indices rarely meet)
_SEED_MOD = SEED_MOD
_SEED_MOD_TL = tl.constexpr(SEED_MOD)
_STEP_MULT_TL = tl.constexpr(STEP_MULT)


def _seed_term(seed):
    """The step-free part of _seed_of_step (a capturable step adds t * STEP_MULT on the device)."""
    return seed * SEED_MULT % SEED_MOD


def _seed_of_step(seed, t):
    """The step's term of every tensor's SR seed at step t."""
    return (_seed_term(seed) + t * STEP_MULT) % SEED_MOD


def _seed_of_index(index):
    """The parameter's term of its SR seed (the kernels' launch tables hold it per tensor)."""
    return index * INDEX_MULT % SEED_MOD


def _sr_seed(seed, t, index):
    """The SR seed of parameter `index` at step t (the reference steps' generator seed)."""
    return (_seed_of_step(seed, t) + _seed_of_index(index)) % SEED_MOD


@triton.jit
def _tl_seed_of_step(seed_term, t):
    # _seed_of_step on the device, from _seed_term(seed) and the step counter t (int64)
    return (seed_term + t * _STEP_MULT_TL) % _SEED_MOD_TL


@triton.jit
def _tl_sr_seed(seed_of_step, seed_of_index):
    # _sr_seed from its two terms (the step's argument and the launch table's column)
    return (seed_of_step + seed_of_index) % _SEED_MOD_TL


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
def _uniform(seed, i, stream):
    # one uniform per element i (int64) for the FP32-state kernel's SR write: 16 bits of one
    # Philox4x32-7 call at counter (i, stream), u = (k + 1/2) 2^-16
    lo = i.to(tl.uint32)
    q0, _, _, _ = philox(lo, (i >> 32).to(tl.uint32), lo * 0 + stream, lo * 0, seed.to(tl.uint32),
                         seed.to(tl.uint32) * 0, 7)
    return tl.fma((q0 >> 16).to(tl.float32), 1.52587890625e-05, 7.62939453125e-06)


@triton.jit
def _tile_uniforms(seed, u_m, u_v, u_p, f, pair, lim_f, lim_g, M_SR: tl.constexpr, V_SR: tl.constexpr,
                   P_SR: tl.constexpr, HAS_U: tl.constexpr, BLOCK_SIZE: tl.constexpr, NB: tl.constexpr):
    # The SR uniforms of the 4-bit kernel's two tiles f and g = f + NB, as even and odd halves:
    # (m, m, v, v, BF16 write, BF16 write) of tile f, then the same six of tile g; 0.0 for a rule
    # that rounds to nearest. One Philox call per two bytes serves both tiles (_uniforms; streams
    # 0, 1, 2 for v, m, the write). HAS_U, for tests only: the caller's uniforms, read from u_m,
    # u_v, u_p (rows < lim_f of tile f and < lim_g of tile g lie inside the tensor).
    um0, um1, uv0, uv1, up0, up1 = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    um2, um3, uv2, uv3, up2, up3 = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    if HAS_U:
        um0, um1 = _caller_uniforms(u_m, f, pair, lim_f, BLOCK_SIZE)
        uv0, uv1 = _caller_uniforms(u_v, f, pair, lim_f, BLOCK_SIZE)
        um2, um3 = _caller_uniforms(u_m, f + NB, pair, lim_g, BLOCK_SIZE)
        uv2, uv3 = _caller_uniforms(u_v, f + NB, pair, lim_g, BLOCK_SIZE)
        if P_SR:
            up0, up1 = _caller_uniforms(u_p, f, pair, lim_f, BLOCK_SIZE)
            up2, up3 = _caller_uniforms(u_p, f + NB, pair, lim_g, BLOCK_SIZE)
    else:
        if V_SR:
            uv0, uv1, uv2, uv3 = _uniforms(seed, f * (BLOCK_SIZE // 2) + pair, 0)
        if M_SR:
            um0, um1, um2, um3 = _uniforms(seed, f * (BLOCK_SIZE // 2) + pair, 1)
        if P_SR:
            up0, up1, up2, up3 = _uniforms(seed, f * (BLOCK_SIZE // 2) + pair, 2)
    return um0, um1, uv0, uv1, up0, up1, um2, um3, uv2, uv3, up2, up3


@triton.jit
def _caller_uniforms(u, first, pair, lim, BLOCK_SIZE: tl.constexpr):
    # tests: the caller's float32 uniforms of the even and odd elements of the tile at block
    # `first` (rows < lim exist; zeros past them)
    ok = pair // (BLOCK_SIZE // 2) < lim
    return (tl.load(u + first * BLOCK_SIZE + 2 * pair, mask=ok, other=0.0),
            tl.load(u + first * BLOCK_SIZE + 2 * pair + 1, mask=ok, other=0.0))
