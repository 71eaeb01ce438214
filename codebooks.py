"""
4-bit codebooks for optimizer-state quantization (paper B, Appendix A.1).

A codebook is a sorted float32 tensor of *normalized* levels T in [-1, 1]; a block with scale s
decodes code k to s * T[k]. Each 4-bit codebook has 16 levels, or 15 where the format has only 15
distinct values (Dyn4-NZ, FP4 with +0 == -0).

    dyn4     unsigned dynamic-exponent map, zero-inclusive: 0, .00325, ..., .94375, 1
    dyn4_nz  Dyn4 without 0 (floor .00325 s)                 -- ZE-EDEN second moment
    sdyn4    signed dynamic-exponent map, min -.8875          -- TorchAO first moment
    lin4_nz  {1/16, ..., 16/16} (floor s/16)                  -- TorchAO second moment
    nf4      normal-quantile map (the NF4 data type's table)  -- ZIP-SR / ZE-EDEN first moment
    fp4      E2M1 as paper B lists it: {0, ±1/48, ±1/6, ±1/4, ±1/3, ±1/2, ±2/3, ±1}

The dynamic-exponent maps are built from their formula, not typed in.
"""
import torch


def dynamic_map(bits=4, signed=False):
    """Dynamic-exponent map of paper B, Appendix A.1, as a sorted float32 tensor.

    p_{F,j} = 0.1 + 0.9 j / 2^F,  r_{F,k} = (p_{F,k} + p_{F,k+1}) / 2,  k = 0 .. 2^F - 1.
    unsigned: {0, 1} ∪ ⋃_{E=0}^{bits-2} {10^-E r_{bits-E-1,k}}        (2^bits values)
    signed:   {0, 1} ∪ ⋃_{E=0}^{bits-2} {±10^-E r_{bits-E-2,k}}       (2^bits values)
    E is the number of leading decimal zeros (the "dynamic exponent"), F the bits left for the
    linear fraction. Computed in float64, then rounded once to float32.

    Raises ValueError if bits is not an int in [2, 8].
    """
    if not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an int in [2, 8], got {bits!r}")
    levels = {0.0, 1.0}
    for E in range(bits - 1):
        F = bits - E - (2 if signed else 1)
        for k in range(2 ** F):
            p0, p1 = 0.1 + 0.9 * k / 2 ** F, 0.1 + 0.9 * (k + 1) / 2 ** F
            r = 10.0 ** -E * (p0 + p1) / 2
            levels.add(r)
            if signed:
                levels.add(-r)
    return torch.tensor(sorted(levels), dtype=torch.float64).to(torch.float32)


# The exact float32 table of the NF4 data type (paper B, Appendix A.1).
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
       -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
       0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
       0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]


def _fp4_levels():
    # Paper B lists E2M1 with smallest magnitude 1/48 (bitsandbytes' own table has 1/192 there);
    # we follow the paper. +0 and -0 decode alike, so 15 distinct levels.
    mags = [1 / 48, 1 / 6, 1 / 4, 1 / 3, 1 / 2, 2 / 3, 1.0]
    return torch.tensor(sorted([0.0] + mags + [-m for m in mags]), dtype=torch.float64).float()


CODEBOOKS = {
    "dyn4": dynamic_map(4, signed=False),
    "dyn4_nz": dynamic_map(4, signed=False)[1:],
    "sdyn4": dynamic_map(4, signed=True),
    "lin4_nz": torch.arange(1, 17, dtype=torch.float64).div(16).float(),
    "nf4": torch.tensor(NF4, dtype=torch.float32),
    "fp4": _fp4_levels(),
}


def get_codebook(codebook):
    """Return the sorted float32 level tensor for a codebook name or a 1-D tensor of levels.

    Raises ValueError for an unknown name or a tensor that is not 1-D, sorted strictly
    ascending, within [-1, 1], with 2..16 levels; TypeError for other types.
    """
    if isinstance(codebook, str):
        if codebook not in CODEBOOKS:
            raise ValueError(f"codebook must be one of {sorted(CODEBOOKS)}, got {codebook!r}")
        return CODEBOOKS[codebook]
    if not isinstance(codebook, torch.Tensor):
        raise TypeError(f"codebook must be a name or a 1-D tensor, got {type(codebook).__name__}")
    t = codebook.detach().float().cpu()
    if t.dim() != 1 or not 2 <= t.numel() <= 16:
        raise ValueError(f"codebook tensor must be 1-D with 2..16 levels, got shape {tuple(t.shape)}")
    if not bool((t[1:] > t[:-1]).all()) or t.abs().max() > 1:
        raise ValueError(f"codebook levels must be strictly ascending within [-1, 1], got {t.tolist()}")
    return t

