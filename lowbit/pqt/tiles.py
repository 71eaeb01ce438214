"""The 32×32 tile grid of paper A's eq. 3: its shape, the broadcast of per-tile values, and the
block indexing the Triton kernels share. Pure geometry: no sampling, no state.

A weight (m, n) has ceil(m/32) × ceil(n/32) tiles anchored at (0, 0); edge tiles are partial when m
or n is not a multiple of 32. The Triton kernels of gaussws.py (apply, grad, tile max) each run one
program per 32 rows × BT tiles (`tile_programs`) and index their block with `tile_block`.
"""
import triton
import triton.language as tl

TILE = 32  # b_l of eq. 3: square tile side (MX-style block of §2.1; 32×32 units in §3.6)


def tile_grid(m, n):
    """Shape of the 32×32 tile grid of an (m, n) matrix: (ceil(m/32), ceil(n/32))."""
    return (-(-m // TILE), -(-n // TILE))


def broadcast_tiles(t, m, n):
    return t.repeat_interleave(TILE, 0).repeat_interleave(TILE, 1)[:m, :n]


def tile_programs(tm, tn, bt):
    """The 1-D launch grid of the tile kernels: one program per 32 rows × bt tiles."""
    return (tm * triton.cdiv(tn, bt),)


@triton.jit
def tile_block(M, N, TN, BT: tl.constexpr):
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
