"""
The lookup tables of AdamW4bit's fused kernel, built once per optimizer from its codebooks (CPU
tensors; on_device copies them to each device): decode, level search and adjacent levels, each
entry two float32 values packed in one int64 so that the kernel reads both with one gather.
Touches nothing but the codebooks it is given.
"""
import torch
import triton
import triton.language as tl

from lowbit.numerics import midpoints, sqrt_rn

LUT_BUCKETS = (32, 64, 128, 256, 512, 1024)   # bucket counts of the level search over [-1, 1]


def pair_bits(lo, hi):
    """float32 tensors lo, hi -> int64 holding lo's bits in the low word and hi's in the high
    word: the kernel reads both with one 64-bit gather."""
    return (lo.view(torch.int32).long() & 0xFFFFFFFF) | (hi.view(torch.int32).long() << 32)


@triton.jit
def unpair(e):
    # inverse of pair_bits: int64 -> (low float32, high float32)
    return e.to(tl.int32).to(tl.float32, bitcast=True), (e >> 32).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def join_bits(lo, hi):
    # pair_bits in the kernel: two float32 -> one int64 (one 64-bit store)
    return lo.to(tl.uint32, bitcast=True).to(tl.int64) | (hi.to(tl.uint32, bitcast=True).to(tl.int64) << 32)


def bucket_lut(bounds, n=None, margin=2.0 ** -12):
    """The kernel's replacement for torch.searchsorted(bounds, y, right=True), y in [-1, 1].

    Bucket j (0 <= j <= n) holds y with (y + 1) n/2 in [j, j+1). Its entry packs (pair_bits)
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
                return bucket_lut(bounds, n, margin)
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
    return pair_bits(count.to(torch.int32), nxt[count])


def build_kernel_tables(T_m, T_v, cfg):
    """The kernel's lookup tables (CPU tensors) for an optimizer configuration cfg (AdamW4bit.qcfg:
    its rounding rules and codebook names) and its codebooks' levels T_m, T_v:
    m_decode/v_decode: byte -> (T[low nibble], T[high nibble]) as pair_bits, int64 (256,);
    v_codebook: T_v (EDEN reads T[code]);
    m_lut_rtn/m_lut_sr/v_lut: bucket_lut of the level midpoints (State-RTN: the code is the
    count of midpoints <= y) or of the inner levels (the others: the lower level's index k);
    m_adjacent/v_adjacent: k -> (T[k], T[k+1]) as pair_bits, or (sqrt T[k], sqrt T[k+1]) for
    the update coordinate (one 64-bit gather).
    Raises ValueError, naming the moment's codebook, if its levels are too dense for bucket_lut."""
    codes = torch.arange(256)

    def dec(T):   # codes >= K are never written; they decode to the top level
        T = torch.cat([T, T[-1:].expand(16 - T.numel())])
        return pair_bits(T[codes & 15], T[codes >> 4])

    Tp = sqrt_rn(T_v) if cfg["v_rounding"].startswith("update") else T_v
    t = dict(m_decode=dec(T_m), v_decode=dec(T_v), v_codebook=T_v,
             m_adjacent=pair_bits(T_m[:-1], T_m[1:]), v_adjacent=pair_bits(Tp[:-1], Tp[1:]))
    def lut(moment, bounds):   # a too-dense codebook's error names it
        try:
            return bucket_lut(bounds)
        except ValueError as e:
            raise ValueError(f"{moment}_codebook {cfg[moment + '_codebook']!r}: {e}") from None

    t["m_lut_rtn"] = lut("m", midpoints(T_m))
    if cfg["m_rounding"] == "sr" or cfg["lm_head_sr_after"] is not None:
        t["m_lut_sr"] = lut("m", T_m[1:-1])
    t["v_lut"] = lut("v", midpoints(T_v) if cfg["v_rounding"] == "state-rtn" else T_v[1:-1])
    return t


def kernel_tables(impl, cfg, get_codebook):
    """build_kernel_tables for an AdamW4bit of this impl and configuration: None for impl="torch"
    or FP32 states, and under impl="auto" for a codebook too dense for the buckets (levels < ~0.004
    apart: the reference runs); under impl="triton" that is a ValueError naming the codebook."""
    if cfg["m_codebook"] is None or impl == "torch":
        return None
    try:
        return build_kernel_tables(get_codebook(cfg["m_codebook"]), get_codebook(cfg["v_codebook"]), cfg)
    except ValueError as e:
        if impl == "triton":
            raise ValueError(f"impl='triton': {e}; use impl='torch' for this codebook") from None
        return None


def on_device(tables, device, cache):
    """build_kernel_tables' tables on `device`, copied at their first use there and kept in
    `cache` (the optimizer's dict, under "tables")."""
    on = cache.setdefault("tables", {})
    if device not in on:
        on[device] = {k: x.to(device) for k, x in tables.items()}
    return on[device]
