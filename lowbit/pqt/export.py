"""What a trained PQT model's bitwidths say and how its weights are cast (paper A §3.3, Prop. 3–4,
Figure 5, Table C): the bitwidth statistics, the Table C tiers and the casts of weight tiles to FP
formats. Reads the GaussWSLinear layers handed in (their b_t and weights: `gaussws.pqt_layers`);
`cast_to_tiers` writes the weights.
"""
import math

import torch

from lowbit.pqt.checks import B_MAX, B_MIN
from lowbit.pqt.tiles import TILE, broadcast_tiles, tile_grid


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


def layer_bitwidth_stats(layers):
    """Figure 5 statistics of the bitwidths the layers sample with (`gaussws.bitwidth_stats`):
    b_t of eq. 11 clamped to [B_MIN, B_MAX] (as in the forward), parameter-weighted (edge tiles
    count their real size). layers: (name, GaussWSLinear) pairs, at least one.

    Returns {layer name: {mean, std, min, max, params, share_le5, share_le9, share_le12, tier}}
    plus the key "all" aggregating every layer; `tier` is the Table C format for the max
    (`fp_tier`), the share_le keys are the FP_TIERS limits."""
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
    return broadcast_tiles(t, m, n)


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
def cast_to_tiers(layers):
    """In place: the weight of every layer cast tile by tile to the Table C format its bitwidth
    calls for (b_t of eq. 11 clamped to [B_MIN, B_MAX], as sampling uses it), by the tier rule of
    `fp_tier` (FP_TIERS: first tier whose limit is >= b_t); tiles above the last limit keep their
    weights (">FP16"). layers: (name, GaussWSLinear) pairs, as `gaussws.pqt_layers(model)` lists
    a model's (`cast_to_tiers(pqt_layers(model))`).
    Returns {format name: share of those layers' weight parameters}, ">FP16" for the kept ones.
    Raises ZeroDivisionError on no layers: there is no share of no parameters."""
    counts = {name: 0 for _, name, _, _ in FP_TIERS} | {">FP16": 0}
    for _, layer in layers:
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
