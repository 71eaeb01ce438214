"""Triton plumbing of gaussws.py's kernels: the NOISE codes that tell the apply and grad kernels
where R comes from, their launch configuration (CONFIG, `launch_config`), and small jit helpers
(lane interleave, a NaN-propagating max, float32 add and exp2 rounded as torch rounds them). No
paper math here: the kernels themselves are gaussws.py's.
"""
import os

import triton
import triton.language as tl

from lowbit.numerics import tl_bf16_rne_bits
from triton.language.extra import libdevice

# the noise R as the apply and grad kernels get it (`_noise_block`'s NOISE)
NOISE_PACKED = tl.constexpr(0)   # packed GaussWS R read from memory (kernel 1 made it)
NOISE_DENSE = tl.constexpr(1)    # dense BF16 DiffQ R read from memory
NOISE_FUSED = tl.constexpr(2)    # packed GaussWS R drawn from Philox in the kernel itself

# launch configuration of the kernels (block sizes, warps). gen_*, apply_* and grad_* (the unfused
# kernels) from `python bench.py --only noise` at 4096²–16384²; the fused apply and grad (R drawn
# in the kernel, what GaussWSLinear runs) from a sweep over (BT tiles per program, warps) at the
# Table 1 models' weight shapes (results/README.md, section 7): the apply is fastest with one
# tile and one warp per program at every size, the grad with (4, 4), or one tile per program
# on weights of at most small_grad[0] tiles
CONFIG = dict(gen_block=1024, gen_warps=4, apply_bt=2, apply_warps=4, grad_bt=4, grad_warps=4,
              fused_apply=(1, 1), fused_grad=(4, 4), small_grad=(4096, 1, 1))

TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"   # kernels run by Triton's CPU interpreter


def noise_mode(method, fused):
    """The NOISE code of `_noise_block` for a method and the fused flag, as a plain int (the
    kernels' constexpr argument)."""
    return (NOISE_DENSE if method == "diffq" else (NOISE_FUSED if fused else NOISE_PACKED)).value


def launch_config(kernel, mode, tiles):
    """(BT, num_warps) of the apply or grad kernel (kernel "apply" | "grad") for a weight of
    `tiles` tiles, from CONFIG."""
    if mode != NOISE_FUSED:
        return CONFIG[kernel + "_bt"], CONFIG[kernel + "_warps"]
    if kernel == "grad" and tiles <= CONFIG["small_grad"][0]:
        return CONFIG["small_grad"][1:]
    return CONFIG["fused_" + kernel]


@triton.jit
def tl_interleave8(v0, v1, v2, v3, v4, v5, v6, v7):
    """[..., k] x 8 -> [..., 8k + j] = v_j[..., k] (tl.interleave appends the lowest index bit)."""
    x0 = tl.interleave(v0, v4)
    x1 = tl.interleave(v2, v6)
    x2 = tl.interleave(v1, v5)
    x3 = tl.interleave(v3, v7)
    return tl.interleave(tl.interleave(x0, x1), tl.interleave(x2, x3))


@triton.jit
def tl_max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def tl_add_rn(a, b, INTERPRET: tl.constexpr):
    """a + b in float32, rounded on its own: never fused with the product before it into an FMA,
    which the GPU compiler does to a plain `+` (the interpreter does not fuse)."""
    if INTERPRET:
        return a + b
    return libdevice.add_rn(a, b)


@triton.jit
def tl_exp2(x, INTERPRET: tl.constexpr):
    """2^x in float32 as torch computes it on CUDA: libdevice's exp2f, the CUDA math library's and
    what Inductor emits for torch.exp2 (on sm_90 the same ex2.approx instruction as tl.exp2; the H200
    test compares it with torch's bit for bit). The interpreter has no libdevice: numpy's exp2
    there, which differs from torch's CPU exp2 in the last bit at times."""
    if INTERPRET:
        return tl.exp2(x)
    return libdevice.exp2(x)


@triton.jit
def tl_cast(x, dtype: tl.constexpr):
    """float32 -> dtype with round-to-nearest-even. BF16 is rounded on the bits
    (numerics.tl_bf16_rne_bits: the GPU's cvt.rn gives the same bits; Triton's interpreter would
    truncate), and every NaN becomes 0x7FC0, as torch's cast makes it (the references cast with torch)."""
    if dtype == tl.bfloat16:
        b = (tl_bf16_rne_bits(x.to(tl.int32, bitcast=True)) >> 16) & 0xFFFF
        b = tl.where(x != x, 0x7FC0, b)
        return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif dtype == tl.float32:
        return x
    else:
        return x.to(dtype)
