"""
The random bits of AdamW4bit's stochastic rounding (paper B, Def. 5; the BF16 SR write): the seed
scheme, written once, the Triton uniforms drawn from it, the reference's torch draws, and the
kernels' uniforms computed in PyTorch (kernel_uniforms, element_uniforms: the reference steps take
them with AdamW4bit(kernel_uniforms=True)). Touches no tensor of the optimizer.

Seed scheme: the bits of step t of the parameter with index i (its position in the optimizer,
from 1) depend only on (seed, t, i), so a resumed run draws the same bits:
  seed_of_step(seed, t) = (seed * SEED_MULT + t * STEP_MULT) mod SEED_MOD
  seed_of_index(i)      = i * INDEX_MULT mod SEED_MOD
  sr_seed(seed, t, i)   = (seed_of_step + seed_of_index) mod SEED_MOD
31 bits, so torch (manual_seed) and Triton (an int32 argument) both take it. The kernels add the
two terms themselves: the launch table holds seed_of_index per tensor and is the same each step.
A capturable step reads t on the device and adds t * STEP_MULT to seed_term(seed) there.

Within a tensor an element's bits depend only on its position in the whole tensor: the kernels'
Philox counter is that position (a launch table column holds a tensor's first element's), and the
references draw the whole tensor's torch.rand and keep their part. So an FSDP2 shard (a
ShardIndex, its parameter's seed index with the shard's place) draws the bits that the same
elements draw unsharded, and a run gives the same numbers on any world size, bit for bit.
"""
import torch
import triton
import triton.language as tl

from lowbit.philox import philox, philox_torch

SEED_MOD = 2 ** 31 - 1        # a prime: the terms below never cancel to a shared seed by accident
SEED_MULT = 1_000_003         # the run seed's multiplier
STEP_MULT = 65_537            # the step's
INDEX_MULT = 257              # the parameter index's
_SEED_MOD_TL = tl.constexpr(SEED_MOD)
_STEP_MULT_TL = tl.constexpr(STEP_MULT)


def seed_base(seed):
    """The step-free part of step_seed (a capturable step adds t * STEP_MULT on the device)."""
    return seed * SEED_MULT % SEED_MOD


def step_seed(seed, t):
    """The step's term of every tensor's SR seed at step t."""
    return (seed_base(seed) + t * STEP_MULT) % SEED_MOD


def index_seed(index):
    """The parameter's term of its SR seed (the kernels' launch tables hold it per tensor)."""
    return index * INDEX_MULT % SEED_MOD


def sr_seed_of(seed, t, index):
    """The SR seed of parameter `index` at step t (the reference steps' generator seed)."""
    return (step_seed(seed, t) + index_seed(index)) % SEED_MOD


class ShardIndex(int):
    """A parameter's seed index (its position in the optimizer, from 1) for an FSDP2 shard: the
    plain index, carrying the shard's place, `offset` (its first element's position in the whole
    tensor) and `numel` (the whole tensor's element count), so its SR bits are the whole tensor's
    at those positions."""

    def __new__(cls, index, offset, numel):
        self = super().__new__(cls, index)
        self.offset, self.numel = int(offset), int(numel)
        return self

    def __getnewargs__(self):     # copy and pickle: int's would pass the index alone
        return int(self), self.offset, self.numel


def shard_offset(index):
    """The first element's position in the whole tensor of a ShardIndex's shard; 0 for an int."""
    return index.offset if isinstance(index, ShardIndex) else 0


def shard_span(index):
    """(offset, whole numel) of a ShardIndex's shard, for span_uniforms; None for an int."""
    return (index.offset, index.numel) if isinstance(index, ShardIndex) else None


def span_uniforms(shape, generator, device, span=None):
    """The reference's SR uniforms (float32, `shape`) from torch.rand(generator=generator); with
    span = (offset, numel), for the part [offset, offset + prod(shape)) of a tensor of numel
    elements (an FSDP2 shard), the whole tensor's draws there. float32 whatever the default dtype:
    bfloat16 draws take ~1700 values and bias SR."""
    if span is None:
        return torch.rand(shape, dtype=torch.float32, device=device, generator=generator)
    offset, numel = span
    u = torch.rand(numel, dtype=torch.float32, device=device, generator=generator)
    return u[offset:offset + torch.Size(shape).numel()].view(shape)


def _positions(numel, device, span):
    # int64 positions in the whole tensor of a tensor's (or an FSDP2 shard's, span) elements
    offset = 0 if span is None else span[0]
    return torch.arange(offset, offset + numel, dtype=torch.int64, device=device)


def _u16(word, shift):
    # (k + 1/2) 2^-16 for the 16 bits of `word` (int64 holding a uint32) at `shift`: the kernels' fma
    return ((((word >> shift) & 0xFFFF).double() + 0.5) * 2.0 ** -16).float()


def kernel_uniforms(seed, numel, stream, tile_bytes, device=None, span=None):
    """The SR uniforms the 4-bit kernel draws (tile_uniforms through _pair_uniforms and
    sr_uniforms) for a tensor's `numel` elements, in plain PyTorch: float32 (numel,). seed: the
    tensor's sr_seed_of; stream: 0 for v, 1 for m, 2 for the BF16 write; tile_bytes: bytes of a
    kernel tile (NB * block_size / 2, tiles paired from the tensor's start); span as in
    span_uniforms. Element i takes Philox4x32-7 at counter ((b >> 6) 32 + (b & 31), stream) of byte
    b = i/2 (the upper tile of a pair reading at b - tile_bytes), word 2 upper + (i odd), half
    (b >> 5) & 1."""
    i = _positions(numel, device, span)
    byte = i >> 1
    upper = (byte // tile_bytes) & 1
    b = byte - upper * tile_bytes
    c = (b >> 6) * 32 + (b & 31)
    z = torch.zeros_like(c)
    words = torch.stack(philox_torch(c & 0xFFFFFFFF, c >> 32, z + stream, z, z + seed, z, rounds=7))
    word = words.gather(0, (2 * upper + (i & 1))[None])[0]
    return _u16(word, ((b >> 5) & 1) * 16)


def element_uniforms(seed, numel, stream, device=None, span=None):
    """The SR uniforms of the FP32-state kernel's BF16 write (sr_uniform), in plain PyTorch:
    float32 (numel,), element i from the high 16 bits of word 0 of Philox4x32-7 at counter (i,
    stream) under key `seed` (its sr_seed_of); span as in span_uniforms."""
    i = _positions(numel, device, span)
    z = torch.zeros_like(i)
    return _u16(philox_torch(i & 0xFFFFFFFF, i >> 32, z + stream, z, z + seed, z, rounds=7)[0], 16)


@triton.jit
def tl_step_seed(seed_term, t):
    # step_seed on the device, from seed_base(seed) and the step counter t (int64)
    return (seed_term + t * _STEP_MULT_TL) % _SEED_MOD_TL


@triton.jit
def tl_sr_seed(seed_of_step, seed_of_index):
    # sr_seed_of from its two terms (the step's argument and the launch table's column)
    return (seed_of_step + seed_of_index) % _SEED_MOD_TL


@triton.jit
def sr_uniforms(seed, byte, stream):
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
def _uniforms_at(seed, byte, stream, HALF: tl.constexpr):
    # sr_uniforms of one tile's bytes wherever the tile starts: the (even, odd element) uniforms
    # that byte `byte` of the whole tensor gets in an unsharded launch, where tiles of HALF bytes
    # pair from the tensor's start, tile 2k's byte x taking q0, q1 and tile 2k + 1's byte x + HALF
    # q2, q3 of the call at x. An FSDP2 shard whose first block is not at such a pair's start
    # pairs its tiles otherwise, so each tile makes its own call (twice sr_uniforms' Philox work).
    # HALF is a multiple of 64, so the byte keeps its place in the call (bits 0-5).
    upper = (byte // HALF) & 1
    q0, q1, q2, q3 = sr_uniforms(seed, byte - upper * HALF, stream)
    return tl.where(upper == 1, q2, q0), tl.where(upper == 1, q3, q1)


@triton.jit
def _pair_uniforms(seed, byte, stream, PAIRED: tl.constexpr, HALF: tl.constexpr):
    # sr_uniforms of tiles f and f + NB from the global byte index of tile f's bytes: one call
    # when tile f is the first of an unsharded launch's pair (PAIRED), else _uniforms_at per tile
    if PAIRED:
        u0, u1, u2, u3 = sr_uniforms(seed, byte, stream)
    else:
        u0, u1 = _uniforms_at(seed, byte, stream, HALF)
        u2, u3 = _uniforms_at(seed, byte + HALF, stream, HALF)
    return u0, u1, u2, u3


@triton.jit
def sr_uniform(seed, i, stream):
    # one uniform per element i (int64, the position in the whole tensor) for the FP32-state
    # kernel's SR write: 16 bits of one Philox4x32-7 call at counter (i, stream), u = (k + 1/2) 2^-16
    lo = i.to(tl.uint32)
    q0, _, _, _ = philox(lo, (i >> 32).to(tl.uint32), lo * 0 + stream, lo * 0, seed.to(tl.uint32),
                         seed.to(tl.uint32) * 0, 7)
    return tl.fma((q0 >> 16).to(tl.float32), 1.52587890625e-05, 7.62939453125e-06)


@triton.jit
def tile_uniforms(seed, u_m, u_v, u_p, f, off, pair, lim_f, lim_g, M_SR: tl.constexpr, V_SR: tl.constexpr,
                   P_SR: tl.constexpr, HAS_U: tl.constexpr, PAIRED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   NB: tl.constexpr):
    # The SR uniforms of the 4-bit kernel's two tiles f and g = f + NB, as even and odd halves:
    # (m, m, v, v, BF16 write, BF16 write) of tile f, then the same six of tile g; 0.0 for a rule
    # that rounds to nearest. Drawn at the bytes' positions in the whole tensor (off: the global
    # block of the tensor's block 0; an FSDP2 shard's, else 0), one Philox call per two bytes
    # serving both tiles when f + off starts a pair of tiles (PAIRED; _pair_uniforms; streams 0,
    # 1, 2 for v, m, the write). HAS_U, for tests only: the caller's uniforms, read from u_m, u_v,
    # u_p (rows < lim_f of tile f and < lim_g of tile g lie inside the tensor).
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
        byte = (f + off) * (BLOCK_SIZE // 2) + pair       # tile f's bytes in the whole tensor
        if V_SR:
            uv0, uv1, uv2, uv3 = _pair_uniforms(seed, byte, 0, PAIRED, NB * BLOCK_SIZE // 2)
        if M_SR:
            um0, um1, um2, um3 = _pair_uniforms(seed, byte, 1, PAIRED, NB * BLOCK_SIZE // 2)
        if P_SR:
            up0, up1, up2, up3 = _pair_uniforms(seed, byte, 2, PAIRED, NB * BLOCK_SIZE // 2)
    return um0, um1, uv0, uv1, up0, up1, um2, um3, uv2, uv3, up2, up3


@triton.jit
def _caller_uniforms(u, first, pair, lim, BLOCK_SIZE: tl.constexpr):
    # tests: the caller's float32 uniforms of the even and odd elements of the tile at block
    # `first` (rows < lim exist; zeros past them)
    ok = pair // (BLOCK_SIZE // 2) < lim
    return (tl.load(u + first * BLOCK_SIZE + 2 * pair, mask=ok, other=0.0),
            tl.load(u + first * BLOCK_SIZE + 2 * pair + 1, mask=ok, other=0.0))
