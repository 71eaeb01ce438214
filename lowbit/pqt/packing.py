"""Packing of the noise R: sign-magnitude, 4 bits per element, 8 elements per int32 word (element j
of a group in bits [4j, 4j+4)), as the eq. 10 recipe of gaussws.py leaves it. Plain PyTorch, no
kernels; the kernels unpack in registers (`_noise_block` in gaussws.py). `bits_of_element` says
which Philox bits an element's recipe reads.
"""
import torch
import torch.nn.functional as F


def to_int32(v):
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
    return to_int32((nib.view(m, -1, 8) << shifts).sum(-1))


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


def bits_of_element(r0, r1, r2, r3, j):
    """The 16 bits b0..b15 (as one integer, b_i at bit i) that element j of a packed word uses,
    gathered from the 4 Philox words as gaussws's `_recipe_torch` reads them (for tests)."""
    nib = lambda r: (r >> (4 * j)) & 0xF
    a, b, c, d = nib(r0), nib(r1), nib(r2), nib(r3)
    return (a & 7) | (b << 3) | (c << 7) | (d << 11) | (((a >> 3) & 1) << 15)
