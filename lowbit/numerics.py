"""
Float32 arithmetic shared by the torch references and the Triton kernels of both papers: the
float32 value of a Python number, the correctly rounded square root, the AdamW denominator of
eq. 3.1 (paper B), the midpoints of a codebook's levels (paper B's round-to-nearest boundaries),
and round-to-nearest-even of float32 to bfloat16 on bit patterns, written once
for torch (`bf16_rne_bits`) and once for Triton (`tl_bf16_rne_bits`). Pure functions: no state,
no device, no import from the rest of the repository.

Why on bits: a torch cast and the GPU's cvt.rn round to nearest even, but Triton's interpreter
truncates; integer ops give the same bits on every backend, so a reference and a kernel can be
compared bit for bit on CPU.
"""
import math

import torch
import triton
import triton.language as tl


def f32(x):
    """The float32 value of the Python number x, as a Python float (what a float32 kernel
    argument becomes)."""
    return torch.tensor(x, dtype=torch.float32).item()


def sqrt_rn(x):
    """Correctly rounded sqrt of a float tensor, same shape and dtype (torch's vectorized CPU
    sqrt may be off by one ulp); the float64 detour rounds correctly, so the reference and the
    kernel's tl.sqrt_rn agree bit for bit."""
    return x.double().sqrt().to(x.dtype)


def adam_denominator(v, bias_correction2, eps, sqrt_v=None):
    # paper B eq. 3.1: r_t(v) = sqrt(v) / sqrt(1 - b2^t) + eps, the AdamW denominator, and
    # h_t = 1 / r_t; written with the float32 reciprocal of sqrt(bc2) (a multiply, not a
    # division). The 4-bit step, the FP32-state step and the quantizer's preconditioner
    # coordinate share this one expression, so the kernel computes r_t(v~) once for all.
    sqrt_v = sqrt_rn(v) if sqrt_v is None else sqrt_v
    return sqrt_v * f32(1 / math.sqrt(bias_correction2)) + eps


def midpoints(levels):
    """Float midpoints (a + b) / 2 of adjacent levels, (K - 1,) for levels (K,): the boundaries
    of round-to-nearest in state space (paper B, App. A.2), for the reference and the kernel."""
    return (levels[:-1] + levels[1:]) / 2


# BF16 round-to-nearest-even of float32 bit patterns (int32): add 0x7FFF plus the lowest kept bit
# and clear the low half (-65536 = 0xFFFF0000); the result's bits are in the top half. A NaN
# (|bits| > 0x7F800000, Inf's pattern) stays a quiet NaN of its sign: the addition could carry it
# into Inf.

def bf16_rne_bits(bits):
    """Round-to-nearest-even of float32 bit patterns `bits` (int32 tensor) to BF16: int32 tensor
    of bits' shape, the BF16 bits in the top half and zeros below (NaN kept, quieted)."""
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return torch.where((bits & 0x7FFFFFFF) > 0x7F800000, bits & -65536 | 0x400000, r)


@triton.jit
def tl_bf16_rne_bits(bits):
    # bf16_rne_bits in Triton, the same integer operations
    return tl_bf16_round_bits(bits, 0x7FFF + ((bits >> 16) & 1))


@triton.jit
def tl_bf16_round_bits(bits, add):
    # float32 bits -> BF16 bits (top half): add `add` to the dropped low half and clear it (RTN:
    # tl_bf16_rne_bits; SR: a random 16-bit add), NaN kept and quieted
    r = (bits + add) & -65536
    return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, (bits & -65536) | 0x400000, r)
