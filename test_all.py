"""
All tests, one section per file in module order (codebooks, philox, adam4bit, gaussws, model /
data / train, bench, experiments, finetune_hf); within a section the papers' facts first, then kernel =
reference, then API and errors. They run on CPU, the Triton kernels under TRITON_INTERPRET=1:

    TRITON_INTERPRET=1 python3 -m pytest -q -n auto --dist loadgroup test_all.py

(-n: pytest-xdist's worker processes; the tests that share the FSDP2 runs form one group.)
The GPU-only tests (test_gpu_*) skip there and say why; on a GPU machine run them with
TRITON_INTERPRET=0 python3 -m pytest -q test_all.py -k gpu

Statistical tests state their confidence: a bound of z standard errors fails a correct
implementation with probability about 2*Phi(-z) (z = 5: 6e-7), and every random test is seeded.
"""
import argparse
import copy
import gzip
import io
import itertools
import json
import math
import multiprocessing
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
    # pytest -n: one Inductor cache per worker process, so no two processes write one entry
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"],
                                                         os.environ["PYTEST_XDIST_WORKER"])

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
import triton
import triton.language as tl

import adam4bit as A
import bench
from benchmarks import training as bench_training
from benchmarks import util as bench_util
import data as datamod
from experiments import quality as experiments
import gaussws as g
from lowbit import philox
from lowbit import runlock
from lowbit.optim import sr_bits
from experiments import tools
import train
from codebooks import CODEBOOKS, NF4, dynamic_map, get_codebook
from model import GPT, PRESETS, preset_config
from lowbit.optim.fp32 import ADAMW_BLOCK, adamw_step_triton
from lowbit.optim.lut import LUT_BUCKETS, bucket_lut
from lowbit.optim.metrics import nonzero_to_zero_fraction, radial_bias, relative_rms_error, update_relative_error
from lowbit.optim.param_write import correction_unit, join_master, read_param, round_to_bf16, split_master
from lowbit.optim.sr_bits import step_seed
from lowbit.optim.state import PACKED
from codebooks import midpoints
from lowbit.optim.fp32 import adamw_step_torch
from lowbit.optim.launch import capturable_bias_table
from lowbit.optim.sr_bits import sr_uniforms
from trainer.checkpoint import CKPT_FORMAT, RESUME_DEFAULTS, check_out_dir, check_resume_config, dcp_state, load_checkpoint, resume_path, save_checkpoint
from trainer.dist import Process, setup_distributed, shard_model
from trainer.flags import DEFAULT_LR, build_parser, resolve_args
from trainer.log import Interrupts
from trainer.log import read_log as read_run_log
from trainer.util import RunError


# markers of the GPU-only tests, which compare the compiled kernels with the reference on CUDA
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="GPU-only check needs a CUDA GPU: it compares the compiled Triton kernels with the reference "
           "(the CPU tests above run the same kernels under the Triton interpreter)")
needs_compiled = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1",
    reason="GPU-only check needs the compiled kernels: run it with TRITON_INTERPRET=0")


# =============================================================================================
# codebooks.py (paper B, Appendix A.1)

PAPER_LEVELS = {  # decimals as paper B Appendix A.1 prints them
    "dyn4": [0, .00325, .00775, .02125, .04375, .06625, .08875, .15625, .26875, .38125, .49375,
             .60625, .71875, .83125, .94375, 1],
    "sdyn4": [-.8875, -.6625, -.4375, -.2125, -.0775, -.0325, -.0055, 0, .0055, .0325, .0775,
              .2125, .4375, .6625, .8875, 1],
    "lin4_nz": [k / 16 for k in range(1, 17)],
    "fp4": sorted({0, 1 / 48, 1 / 6, 1 / 4, 1 / 3, 1 / 2, 2 / 3, 1} |
                  {-x for x in (1 / 48, 1 / 6, 1 / 4, 1 / 3, 1 / 2, 2 / 3, 1)}),
}


PAPER_LEVELS["dyn4_nz"] = PAPER_LEVELS["dyn4"][1:]


@pytest.mark.parametrize("name", sorted(PAPER_LEVELS))
def test_codebook_values_pinned(name):
    got = CODEBOOKS[name]
    want = torch.tensor(PAPER_LEVELS[name], dtype=torch.float64).float()
    assert got.dtype == torch.float32
    assert torch.equal(got, want), (name, got.tolist())


def test_codebook_counts_sorted_unique_and_extremes():
    counts = {"dyn4": 16, "dyn4_nz": 15, "sdyn4": 16, "lin4_nz": 16, "nf4": 16, "fp4": 15}
    for name, t in CODEBOOKS.items():
        assert t.numel() == counts[name], name
        assert bool((t[1:] > t[:-1]).all()), name          # sorted and unique
        assert t.abs().max().item() == 1.0, name
    assert CODEBOOKS["dyn4"][1].item() == pytest.approx(0.00325, abs=1e-9)   # Dyn4 floor
    assert CODEBOOKS["dyn4_nz"][0].item() == pytest.approx(0.00325, abs=1e-9)
    assert CODEBOOKS["sdyn4"][0].item() == pytest.approx(-0.8875, abs=6e-8)  # no -1 in SDyn4
    assert -1.0 not in CODEBOOKS["sdyn4"].tolist()


def test_nf4_is_the_exact_float32_table():
    assert CODEBOOKS["nf4"].tolist() == NF4  # every entry exactly representable in float32
    assert torch.equal(torch.tensor(NF4, dtype=torch.float64).float().double(),
                       torch.tensor(NF4, dtype=torch.float64))


def test_dynamic_map_formula_sizes_and_errors():
    for bits in (3, 4, 5):
        assert dynamic_map(bits).numel() == 2 ** bits
        assert dynamic_map(bits, signed=True).numel() == 2 ** bits
    with pytest.raises(ValueError, match="bits"):
        dynamic_map(9)
    with pytest.raises(ValueError, match="codebook must be one of"):
        get_codebook("dyn3")
    with pytest.raises(ValueError, match="ascending"):
        get_codebook(torch.tensor([0.5, 0.1]))


# =============================================================================================
# philox.py: Philox4x32 against Random123 known answers and Triton's tl.philox

def test_philox_known_answers():
    """Philox4x32-10 known-answer vectors of Random123 (Salmon et al. 2011)."""
    t = lambda v: torch.tensor([v], dtype=torch.int64)
    M = 0xFFFFFFFF
    cases = [((0, 0, 0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((M, M, M, M, M, M), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for inp, want in cases:
        assert [int(x) for x in philox.philox_torch(*map(t, inp))] == list(want)


def test_philox_matches_triton_randint4x():
    import triton
    import triton.language as tl

    @triton.jit
    def k(out_ptr, seed, BLOCK: tl.constexpr):
        off = tl.arange(0, BLOCK)
        a, b, c, d = tl.randint4x(seed, off)
        tl.store(out_ptr + off * 4 + 0, a.to(tl.int64) & 0xFFFFFFFF)
        tl.store(out_ptr + off * 4 + 1, b.to(tl.int64) & 0xFFFFFFFF)
        tl.store(out_ptr + off * 4 + 2, c.to(tl.int64) & 0xFFFFFFFF)
        tl.store(out_ptr + off * 4 + 3, d.to(tl.int64) & 0xFFFFFFFF)

    key = 0x0123_4567_89AB_CDEF
    out = torch.empty(64, 4, dtype=torch.int64, device=DEV)
    k[(1,)](out, key, BLOCK=64)
    ref = philox.philox_words_torch(torch.tensor([key, 0], device=DEV), torch.arange(64, device=DEV))
    assert torch.equal(out, torch.stack(ref, -1))


def test_kernel_philox_equals_triton_philox():
    """philox.philox (64-bit products) gives tl.philox's words, bit for bit."""
    @triton.jit
    def both(seed, out):
        i = tl.arange(0, 256).to(tl.uint32)
        c0 = i * 40503 + 12345
        c1 = i ^ 1234567
        k0 = seed.to(tl.uint32)
        a = philox.philox(c0, c1, c0 * 0 + 3, c0 * 0, k0, k0 * 0, 7)
        b = tl.philox(seed, c0, c1, c0 * 0 + 3, c0 * 0, n_rounds=7)
        for k in tl.static_range(4):
            tl.store(out + k * 256 + i, a[k].to(tl.int32, bitcast=True))
            tl.store(out + 1024 + k * 256 + i, b[k].to(tl.int32, bitcast=True))
    for seed in (0, 12345, 2 ** 31 - 2):
        out = torch.zeros(2048, dtype=torch.int32)
        both[(1,)](seed, out)
        assert torch.equal(out[:1024], out[1024:]) and out.unique().numel() > 1000


# =============================================================================================
# adam4bit.py (paper B)

# ---------------------------------------------------------------------------------------------
# the block quantizer (Def. 3, Appendix A.2): reference facts

def test_pack_unpack_roundtrip():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (4096,), generator=g)
    packed = A.pack_nibbles(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == 2048
    assert torch.equal(A.unpack_nibbles(packed), codes)
    assert packed[0].item() == codes[0].item() | (codes[1].item() << 4)   # low nibble first


@pytest.mark.parametrize("name", sorted(CODEBOOKS))
def test_rtn_is_nearest_level_in_state_space(name):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64 * 128, generator=g) * torch.rand(64, 1, generator=g).repeat(1, 128).view(-1)
    if CODEBOOKS[name][0] >= 0:
        x = x.abs()
    packed, s = A.quantize_blockwise(x, name, 128, "rtn", "state")
    q = A.dequantize_blockwise(packed, s, name, 128)
    levels = s[:, None, None] * CODEBOOKS[name][None, None, :]          # (nb, 1, K)
    xb = x.view(-1, 128, 1)
    best = (levels - xb).abs().min(-1).values.view(-1)
    assert torch.allclose((q - x).abs(), best, atol=1e-7, rtol=0)
    # scales are the guarded absmax
    assert torch.equal(s, x.view(-1, 128).abs().amax(1).clamp_min(1e-12))


def test_rtn_is_nearest_level_in_preconditioner_space():
    g = torch.Generator().manual_seed(2)
    v = torch.rand(32 * 128, generator=g) ** 6 * 1e-4
    bc2, eps = 0.3, 1e-6
    packed, s = A.quantize_blockwise(v, "dyn4", 128, "rtn", "update", bc2, eps)
    q = A.dequantize_blockwise(packed, s, "dyn4", 128)
    h = lambda z: A.preconditioner(z, bc2, eps)
    levels = s[:, None, None] * CODEBOOKS["dyn4"][None, None, :]
    best = (h(levels) - h(v.view(-1, 128, 1))).abs().min(-1).values.view(-1)
    assert torch.allclose((h(q) - h(v)).abs(), best, rtol=1e-5, atol=0)


@pytest.mark.parametrize("coord", ["state", "update"])
def test_sr_is_unbiased_in_its_own_coordinate(coord):
    # E[phi(Q(x))] = phi(x): per element, the mean of n draws lies within 5 standard errors,
    # where the std of phi(Q(x)) is at most half the gap (phi(a) - phi(b)).
    g = torch.Generator().manual_seed(3)
    levels = CODEBOOKS["dyn4"] * 1e-3
    x = torch.rand(64, generator=g) * 1e-3
    n, bc2, eps = 20000, 0.5, 1e-5
    phi = (lambda z: A.preconditioner(z, bc2, eps)) if coord == "update" else (lambda z: z)
    xs = x.repeat(n, 1)
    u = torch.rand(xs.shape, generator=g)
    codes = A.round_to_levels(xs, levels, "sr", coord, bc2, eps, u)
    mean = phi(levels[codes].double()).mean(0)
    lo = (torch.searchsorted(levels, x, right=True) - 1).clamp(0, 14)
    gap = (phi(levels[lo].double()) - phi(levels[lo + 1].double())).abs()
    assert ((mean - phi(x.double())).abs() <= 5 * gap / 2 / math.sqrt(n)).all()
    # and it only ever writes one of the two adjacent levels
    assert ((codes == lo) | (codes == lo + 1)).all()


@pytest.fixture
def default_dtype():
    """torch.set_default_dtype for the test to call; the default dtype is restored after it."""
    old = torch.get_default_dtype()
    try:
        yield torch.set_default_dtype
    finally:
        torch.set_default_dtype(old)


def test_sr_uniforms_are_float32_whatever_the_default_dtype(default_dtype):
    # Uniforms drawn in a bfloat16 default dtype take ~1700 values and bias SR (mean of x = 0.3 on
    # lin4_nz, between 0.25 and 0.3125: 10.9 standard errors low). Bound: 5 standard errors of the
    # mean of n two-level draws, gap sqrt(p (1 - p) / n). Each block's first element (1.0) sets s = 1.
    x = torch.full((1 << 16, 128), 0.3, dtype=torch.float32)
    x[:, 0] = 1.0

    def sr(dtype):
        default_dtype(dtype)
        return A.quantize_blockwise(x, "lin4_nz", 128, "sr", "state",
                                    generator=torch.Generator().manual_seed(8))
    packed, s = sr(torch.bfloat16)
    q = A.dequantize_blockwise(packed, s, "lin4_nz", 128).view(x.shape)[:, 1:].double()
    a, b, x0 = 0.25, 0.3125, x[0, 1].item()
    p = (b - x0) / (b - a)
    se = (b - a) * math.sqrt(p * (1 - p) / q.numel())
    assert abs(q.mean().item() - x0) <= 5 * se, (q.mean().item() - x0, se)
    # and the same bits under every default dtype
    want = sr(torch.float32)
    for dtype in (torch.bfloat16, torch.float64):
        got = sr(dtype)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), dtype


def test_saturation_outside_codebook_range():
    levels = CODEBOOKS["sdyn4"]
    x = torch.tensor([-5.0, -0.95, 1.0, 3.0])
    for rule in ("rtn", "sr"):
        codes = A.round_to_levels(x, levels, rule, "state", u=torch.rand(4))
        assert codes.tolist() == [0, 0, 15, 15]          # -0.95 saturates at -0.8875
    nz = CODEBOOKS["dyn4_nz"]
    assert A.round_to_levels(torch.tensor([0.0, 1e-9]), nz).tolist() == [0, 0]   # the floor


def test_eq1_update_sr_zero_write_frequency():
    # Paper B eq. (1): with levels {0, b}, Update-SR writes 0 with probability
    # eps (1 - sqrt(v/b)) / (sqrt(v/(1-b2^t)) + eps); State-SR with probability 1 - v/b.
    # Binomial bound: 5 standard errors of the frequency of n draws.
    g = torch.Generator().manual_seed(4)
    b, eps, n = 1e-6, 1e-3, 200_000
    levels = torch.tensor([0.0, b])
    for v, bc2 in ((0.25e-6, 1.0), (0.6e-6, 0.2), (0.05e-6, 0.05)):
        x = torch.full((n,), v)
        zeros = (A.round_to_levels(x, levels, "sr", "update", bc2, eps,
                                   torch.rand(n, generator=g)) == 0).float().mean().item()
        p0 = eps * (1 - math.sqrt(v / b)) / (math.sqrt(v / bc2) + eps)
        assert abs(zeros - p0) <= 5 * math.sqrt(p0 * (1 - p0) / n), (v, bc2, zeros, p0)
        zeros_state = (A.round_to_levels(x, levels, "sr", "state",
                                         u=torch.rand(n, generator=g)) == 0).float().mean().item()
        p0s = 1 - v / b
        assert abs(zeros_state - p0s) <= 5 * math.sqrt(p0s * (1 - p0s) / n)


def test_eq2_update_rtn_threshold():
    # Paper B eq. (2): Update-RTN writes 0 only below v_th = b eps² / (sqrt(b/(1-b2^t)) + 2 eps)².
    b, eps = 1e-6, 1e-3
    levels = torch.tensor([0.0, b])
    for bc2 in (1.0, 0.3, 0.05):
        v_th = b * eps ** 2 / (math.sqrt(b / bc2) + 2 * eps) ** 2
        below = torch.linspace(0, v_th * 0.999, 1000)
        above = torch.linspace(v_th * 1.001, b, 1000)
        assert (A.round_to_levels(below, levels, "rtn", "update", bc2, eps) == 0).all()
        assert (A.round_to_levels(above, levels, "rtn", "update", bc2, eps) == 1).all()


def test_prop2a_state_rtn_two_cycle_update_rtn_converges():
    # Paper B Prop. 2(a): Adam on mu w²/2, b1 = 0, no bias correction, codebook {0, b},
    # v~_0 = 0, a stepsize inside 2(sqrt(tau)+eps)/mu < eta < 2(sqrt(b/2)+eps)/mu.
    mu, b, eps, b2 = 1.0, 1e-4, 1e-8, 0.95
    tau = b * eps ** 2 / (math.sqrt(b) + 2 * eps) ** 2
    eta = 0.01
    assert 2 * (math.sqrt(tau) + eps) / mu < eta < 2 * (math.sqrt(b / 2) + eps) / mu
    c = math.sqrt(1 - b2)
    w0 = (eta * mu / 2 - eps) / (c * mu) * 1.01       # near the cycle amplitude w_eta
    levels = torch.tensor([0.0, b], dtype=torch.float64)
    traj = {}
    for coord in ("state", "update"):
        w, vq, ws = torch.tensor([w0], dtype=torch.float64), torch.zeros(1, dtype=torch.float64), []
        for _ in range(400):
            v = b2 * vq + (c * mu * w) ** 2
            w = w * (1 - eta * mu / (v.sqrt() + eps))
            vq = levels[A.round_to_levels(v, levels, "rtn", coord, 1.0, eps)]
            ws.append(w.item())
        traj[coord] = ws
    s = traj["state"][-4:]                                    # State-RTN: a nonzero two-cycle
    assert min(abs(x) for x in s) > 0.5 * w0
    assert s[0] * s[1] < 0 and s[1] * s[2] < 0                # sign alternates
    assert s[2] == pytest.approx(s[0], rel=1e-4) and s[3] == pytest.approx(s[1], rel=1e-4)
    assert abs(traj["update"][-1]) < 1e-12 * w0                # Update-RTN: converged to 0
    assert abs(traj["update"][40]) < 0.5 * abs(traj["update"][20])   # geometrically


def test_eden_calibration():
    g = torch.Generator().manual_seed(5)
    # a block whose small entries sit far below the Dyn4-NZ floor: the floor overestimates
    # them, <x, Q(x)> > ||x||², so c_tau < 1 and the stored scale drops below absmax.
    x = torch.rand(4, 128, generator=g) * 1e-3
    x[:, 0] = 1.0
    _, s_plain = A.quantize_blockwise(x, "dyn4_nz", 128, "rtn", "state")
    packed, s_eden = A.quantize_blockwise(x, "dyn4_nz", 128, "rtn", "state", eden=True)
    assert (s_eden < s_plain).all()
    # the calibration factor is exactly ||y||² / max(<y, T[code]>, tau) (float64 check)
    T = CODEBOOKS["dyn4_nz"].double()
    y = x.double() / s_plain.double()[:, None]
    q = T[A.unpack_nibbles(packed).view(4, 128)]
    c = (y * y).sum(1) / (y * q).sum(1).clamp_min(1e-12)
    assert torch.allclose(s_eden.double(), c * s_plain.double(), rtol=1e-5)
    # an all-zero block decodes to zero
    z = torch.zeros(256)
    packed, s = A.quantize_blockwise(z, "dyn4_nz", 128, "rtn", "state", eden=True)
    assert torch.equal(s, torch.zeros(2))
    assert torch.equal(A.dequantize_blockwise(packed, s, "dyn4_nz", 128), z)


def test_quantizer_bad_arguments():
    x = torch.randn(256)
    with pytest.raises(ValueError, match="block_size"):
        A.quantize_blockwise(x, "nf4", block_size=100)
    with pytest.raises(ValueError, match="multiple of block_size"):
        A.quantize_blockwise(torch.randn(200), "nf4")
    with pytest.raises(ValueError, match="rule"):
        A.quantize_blockwise(x, "nf4", rule="nearest")
    with pytest.raises(ValueError, match="nonnegative"):
        A.quantize_blockwise(x, "nf4", coord="update")


def test_quantizer_input_types():
    with pytest.raises(TypeError, match="floating-point"):
        A.quantize_blockwise(torch.arange(256), "nf4")
    with pytest.raises(ValueError, match="bias_correction2"):
        A.quantize_blockwise(torch.rand(256), "dyn4", coord="update", bias_correction2=0.0)
    with pytest.raises(ValueError, match="nonnegative"):
        A.quantize_blockwise(-torch.rand(256), "dyn4", coord="update")
    with pytest.raises(ValueError, match="one uniform per element"):
        A.quantize_blockwise(torch.randn(256), "nf4", rule="sr", u=torch.rand(10))
    with pytest.raises(TypeError, match="uint8"):
        A.dequantize_blockwise(torch.zeros(128), torch.ones(2), "nf4")


# ---------------------------------------------------------------------------------------------
# the optimizer (reference step): presets, state, resume, API and errors

def _mlp(seed=0, hidden=128):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 64))


def _train(model, opt, steps, seed=0, sched=None, skip=0):
    # skip: batches drawn and not used, so a resumed run continues the data stream of a first one
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(64, 64, generator=g) / 8
    for _ in range(skip):
        torch.randn(256, 64, generator=g)
    for _ in range(steps):
        X = torch.randn(256, 64, generator=g)
        opt.zero_grad()
        loss = ((model(X) - torch.tanh(X @ teacher)) ** 2).mean()
        loss.backward()
        opt.step()
        if sched:
            sched.step()
    return loss.item()


def test_fp32_preset_equals_torch_adamw():
    ref, ours = _mlp(), _mlp()
    groups = lambda m: [{"params": m[0].parameters()}, {"params": m[2].parameters(), "lr": 3e-3,
                                                        "weight_decay": 0.0}]
    o1 = torch.optim.AdamW(groups(ref), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    o2 = A.AdamW4bit(groups(ours), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                     preset="fp32")
    _train(ref, o1, 20)
    _train(ours, o2, 20)
    for a, b in zip(ref.parameters(), ours.parameters()):
        assert (a - b).abs().max().item() <= 1e-6


def test_every_4bit_preset_trains_close_to_fp32():
    # Margin: final loss within 30 % of FP32 AdamW's, and below 15 % of the starting loss.
    losses = {}
    for preset in ("fp32", "torchao", "zeeden", "zipsr"):
        m = _mlp()
        losses[preset] = _train(m, A.AdamW4bit(m.parameters(), lr=1e-2, preset=preset), 200)
    m = _mlp()
    start = _train(m, torch.optim.SGD(m.parameters(), lr=0.0), 1)
    for preset in ("torchao", "zeeden", "zipsr"):
        assert losses[preset] <= 1.3 * losses["fp32"], losses
        assert losses[preset] <= 0.15 * start, (losses, start)


def test_table3_rows_are_constructor_calls():
    m = _mlp()
    rows = [dict(preset="torchao"),
            dict(preset="torchao", v_codebook="dyn4_nz"),                     # Dyn4-NZ control
            dict(preset="torchao", v_codebook="dyn4_nz", m_codebook="nf4"),  # + NF4 m
            dict(preset="zeeden"), dict(preset="zipsr"),
            dict(preset="zipsr", v_rounding="state-rtn"),                    # Fig. 1 failure
            dict(preset="zipsr", v_rounding="state-sr"), dict(preset="zipsr", v_rounding="update-rtn")]
    for kw in rows:
        opt = A.AdamW4bit(m.parameters(), lr=1e-3, **kw)
        _train(m, opt, 2)
        assert opt.state_nbytes() > 0


def test_state_bytes_and_eligibility():
    big = torch.nn.Parameter(torch.randn(64, 128))        # 8192: quantized
    odd = torch.nn.Parameter(torch.randn(4096 + 64))      # not a multiple of 128: FP32
    small = torch.nn.Parameter(torch.randn(2048))         # < 4096: FP32
    for preset, per_param in (("zipsr", 1.0625), ("zeeden", 1.0625), ("torchao", 1.0625),
                              ("fp32", 8.0)):
        opt = A.AdamW4bit([big], preset=preset)
        big.grad = torch.randn_like(big)
        opt.step()
        assert opt.state_nbytes() / big.numel() == per_param
    opt = A.AdamW4bit([odd, small], preset="zipsr")
    for p in (odd, small):
        p.grad = torch.randn_like(p)
    opt.step()
    for p in (odd, small):
        assert not opt.is_quantized(p)
        assert opt.state[p]["exp_avg"].dtype == torch.float32
        assert opt.state[p]["exp_avg"].shape == p.shape
    st = A.AdamW4bit([big], preset="zipsr")
    big.grad = torch.randn_like(big)
    st.step()
    s = st.state[big]
    assert s["exp_avg"].dtype == torch.uint8 and s["exp_avg"].numel() == big.numel() // 2
    assert s["exp_avg_sq_scale"].dtype == torch.float32 and s["exp_avg_sq_scale"].numel() == 64


def test_first_step_matches_fp32_before_storage():
    # Update-before-storage: the first update uses the unquantized working moments, so step 1 of
    # every preset equals FP32 AdamW's step 1.
    p0 = torch.randn(64, 128)
    grad = torch.randn(64, 128)
    outs = {}
    for preset in ("fp32", "torchao", "zeeden", "zipsr"):
        p = torch.nn.Parameter(p0.clone())
        p.grad = grad.clone()
        A.AdamW4bit([p], lr=1e-2, preset=preset).step()
        outs[preset] = p.detach()
    for preset in ("torchao", "zeeden", "zipsr"):
        assert torch.allclose(outs[preset], outs["fp32"], rtol=0, atol=1e-7)


@pytest.mark.filterwarnings("ignore:invalid value encountered")   # the interpreter's NaN and Inf arithmetic
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_gradient_poisons_its_block_from_the_next_step(impl, bad):
    """AdamW4bit's documented behaviour: one NaN/Inf gradient element (element 130, block 1 of
    32) at step 1 makes only that parameter NaN at step 1, as in torch's AdamW; the block's scales
    become non-finite, so from step 2 on all 128 parameters of block 1 are NaN and the other
    blocks stay finite, while torch's AdamW keeps only element 130 NaN."""
    p0 = torch.randn(4096, generator=torch.Generator().manual_seed(16))
    gen = torch.Generator().manual_seed(17)
    grads = [torch.randn(4096, generator=gen) * 1e-2 for _ in range(3)]
    grads[0][130] = bad
    block1 = (torch.arange(4096) // 128) == 1
    element = torch.arange(4096) == 130
    for preset in ("torchao", "zeeden", "zipsr"):
        ref, ours = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
        o_ref = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        o = A.AdamW4bit([ours], lr=1e-2, preset=preset, impl=impl)
        for t, g in enumerate(grads, 1):
            ref.grad, ours.grad = g.clone(), g.clone()
            o_ref.step()
            o.step()
            assert torch.equal(torch.isnan(ref), element) and torch.isfinite(ref[~element]).all()
            poisoned = element if t == 1 else block1
            assert torch.equal(torch.isnan(ours), poisoned), (preset, t)
            assert torch.isfinite(ours[~poisoned]).all(), (preset, t)
            for k in ("exp_avg_scale", "exp_avg_sq_scale"):
                assert torch.equal(~torch.isfinite(o.state[ours][k]), torch.arange(32) == 1), (preset, t, k)


@pytest.mark.parametrize("preset", ["zipsr", "torchao", "zeeden"])
def test_state_dict_resume_is_bit_identical(preset):
    def make():
        m = _mlp()
        o = A.AdamW4bit(m.parameters(), lr=1e-2, preset=preset, seed=7)
        o.mark_lm_head(m[2].weight)
        return m, o
    m_ref, o_ref = make()
    for i in range(2):
        o_ref.set_progress(0.85 + 0.1 * i)
        _train(m_ref, o_ref, 5, seed=i)
    m1, o1 = make()
    o1.set_progress(0.85)
    _train(m1, o1, 5, seed=0)
    buf = io.BytesIO()
    torch.save({"model": m1.state_dict(), "opt": o1.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    m2 = _mlp(seed=123)
    o2 = A.AdamW4bit(m2.parameters(), lr=1e-2, preset=preset, seed=0)   # seed comes from ck
    m2.load_state_dict(ck["model"])
    o2.load_state_dict(ck["opt"])
    assert o2.m_rounding_for(m2[2].weight) == o1.m_rounding_for(m1[2].weight)
    o2.set_progress(0.95)
    _train(m2, o2, 5, seed=1)
    for a, b in zip(m_ref.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    for k in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"):
        assert torch.equal(o_ref.state[m_ref[0].weight][k], o2.state[m2[0].weight][k])


def test_state_dict_of_another_config_is_refused():
    m = _mlp()
    o = A.AdamW4bit(m.parameters(), preset="zipsr")
    _train(m, o, 1)
    sd = o.state_dict()
    with pytest.raises(ValueError, match="block_size"):
        A.AdamW4bit(m.parameters(), preset="zipsr", block_size=64).load_state_dict(sd)
    with pytest.raises(ValueError, match="preset"):
        A.AdamW4bit(m.parameters(), preset="zeeden").load_state_dict(sd)
    with pytest.raises(ValueError, match="not an AdamW4bit"):
        A.AdamW4bit(m.parameters()).load_state_dict(torch.optim.AdamW(m.parameters()).state_dict())


def test_reference_step_is_the_same_whatever_the_default_dtype(default_dtype):
    """torch.set_default_dtype(bfloat16 or float64) changes no bit of a step: the SR uniforms and
    the kernel's tables (built by the constructor) are float32 whatever the default."""
    def run(dtype):
        default_dtype(dtype)
        gen = torch.Generator().manual_seed(18)
        p = torch.nn.Parameter(torch.randn(64, 128, dtype=torch.float32, generator=gen))
        o = A.AdamW4bit([p], lr=1e-2, preset="zipsr", m_rounding="sr", seed=3)
        for _ in range(2):
            p.grad = torch.randn(64, 128, dtype=torch.float32, generator=gen)
            o.step()
        return p.detach(), o.state[p]
    want_p, want_st = run(torch.float32)
    for dtype in (torch.bfloat16, torch.float64):
        p, st = run(dtype)
        assert torch.equal(p, want_p), dtype
        for k in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"):
            assert torch.equal(st[k], want_st[k]), (dtype, k)


def test_bf16_params_keep_fp32_scales_after_load():
    p = torch.nn.Parameter(torch.randn(64, 128, dtype=torch.bfloat16))
    o = A.AdamW4bit([p], preset="zeeden")
    p.grad = torch.randn_like(p)
    o.step()
    sd = o.state_dict()
    o2 = A.AdamW4bit([p], preset="zeeden")
    o2.load_state_dict(sd)
    assert o2.state[p]["exp_avg_sq_scale"].dtype == torch.float32
    assert torch.equal(o2.state[p]["exp_avg_sq_scale"], o.state[p]["exp_avg_sq_scale"])


def test_lm_head_switches_to_sr_after_90_percent():
    m = _mlp()
    for preset, expect in (("zipsr", "sr"), ("zeeden", "sr"), ("torchao", "rtn")):
        o = A.AdamW4bit(m.parameters(), preset=preset)
        o.mark_lm_head(m[2].weight)
        o.set_progress(0.89)
        assert o.m_rounding_for(m[2].weight) == "rtn"
        o.set_progress(0.9)
        assert o.m_rounding_for(m[2].weight) == expect
        assert o.m_rounding_for(m[0].weight) == "rtn"         # other params unaffected
    for bad, said in ((1.5, r"must be in \[0, 1\].*got 1.5"), ("x", r"a number in \[0, 1\].*got 'x'"),
                      (None, "a number.*got None")):
        with pytest.raises(ValueError, match=r"^set_progress\(fraction\): " + said):
            o.set_progress(bad)
    with pytest.raises(ValueError, match="not a parameter"):
        o.mark_lm_head(torch.nn.Parameter(torch.zeros(3)))


def test_lm_head_sr_changes_only_the_head_first_moment_rounding():
    # With SR on, repeated steps from the same state and gradient but different seeds give
    # different head first-moment codes; other tensors are deterministic RTN.
    codes = []
    for seed in (0, 1):
        m = _mlp()
        o = A.AdamW4bit(m.parameters(), preset="zipsr", seed=seed)
        o.mark_lm_head(m[2].weight)
        o.set_progress(0.95)
        _train(m, o, 1)
        codes.append((o.state[m[2].weight]["exp_avg"].clone(), o.state[m[0].weight]["exp_avg"].clone()))
    assert not torch.equal(codes[0][0], codes[1][0])
    assert torch.equal(codes[0][1], codes[1][1])


def test_lr_tensor_scheduler_closure_no_grad_and_sparse():
    m = _mlp()
    o = A.AdamW4bit(m.parameters(), lr=torch.tensor(1e-2), preset="zipsr")
    sched = torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5 ** s)
    _train(m, o, 3, sched=sched)
    assert float(o.param_groups[0]["lr"]) == pytest.approx(1e-2 / 8)
    frozen = torch.nn.Parameter(torch.randn(64, 128))
    o = A.AdamW4bit(list(m.parameters()) + [frozen], preset="zipsr")
    before = frozen.detach().clone()
    X = torch.randn(8, 64)

    def closure():
        o.zero_grad()
        loss = m(X).square().mean()
        loss.backward()
        return loss
    loss = o.step(closure)
    assert torch.is_tensor(loss) and loss.item() > 0
    assert torch.equal(frozen, before) and len(o.state[frozen]) == 0
    emb = torch.nn.Embedding(10, 4, sparse=True)
    o = A.AdamW4bit(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        o.step()


def test_optimizer_bad_arguments():
    ps = [torch.nn.Parameter(torch.randn(4))]
    bad = [dict(lr=-1.0), dict(betas=(0.9, 1.0)), dict(eps=0.0), dict(weight_decay=-0.1),
           dict(preset="adam8"), dict(block_size=100), dict(impl="cuda"),
           dict(m_rounding="nearest"), dict(v_rounding="sr"), dict(v_codebook="nope"),
           dict(v_codebook="sdyn4"),                                      # update-sr needs >= 0
           dict(lm_head_sr_after=1.5)]
    for kw in bad:
        with pytest.raises(ValueError):
            A.AdamW4bit(ps, **kw)
    with pytest.raises(TypeError, match="lr"):
        A.AdamW4bit(ps, lr="1e-3")


@pytest.mark.parametrize("capturable", [False, True])
def test_hyperparameters_changed_after_construction_are_checked_at_step(capturable):
    """A group's lr, betas, eps or weight_decay set after construction (a scheduler, user code)
    gets the constructor's checks at the next step(): a ValueError naming the group, the
    hyperparameter and its value, before any tensor is written; a valid change steps as usual."""
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(64, 128))
    opt = A.AdamW4bit([p], lr=1e-3, capturable=capturable)
    p.grad = torch.randn_like(p)
    opt.step()
    for key, value, says in [("lr", float("nan"), "lr must be finite"), ("lr", -1.0, "lr must be finite"),
                             ("betas", (0.9, 1.5), "betas must be two numbers"), ("betas", 0.9, "betas"),
                             ("betas", (1.0, 0.999), "betas"), ("eps", 0.0, "eps must be finite"),
                             ("weight_decay", float("inf"), "weight_decay"),
                             ("lr", torch.tensor(float("nan")), "lr must be finite"),
                             ("lr", torch.tensor(-1.0), "lr must be finite"),
                             ("lr", torch.tensor([1e-3, 1e-3]), "lr tensor must have one element")]:
        good = opt.param_groups[0][key]
        opt.param_groups[0][key] = value
        before = p.detach().clone()
        with pytest.raises(ValueError, match=f"param group 0: {says}"):
            opt.step()
        assert torch.equal(p, before), key
        opt.param_groups[0][key] = good
    lr = opt.param_groups[0]["lr"] = torch.tensor(1e-3)     # a CPU tensor lr changed in place
    opt.step()
    lr.fill_(float("nan"))
    before = p.detach().clone()
    with pytest.raises(ValueError, match="param group 0: lr must be finite"):
        opt.step()
    assert torch.equal(p, before)
    opt.param_groups[0]["lr"] = 2e-3
    before = p.detach().clone()
    opt.step()
    assert not torch.equal(p, before) and p.isfinite().all()


def test_optimizer_checks_groups_params_and_state_shapes():
    p = torch.nn.Parameter(torch.randn(64, 128))
    for kw in (dict(lr=float("nan")), dict(lr=float("inf")), dict(eps=float("inf")),
               dict(weight_decay=float("nan")), dict(betas=0.9), dict(preset=["zipsr"]),
               dict(lm_head_sr_after="x"), dict(preset="fp32", eden=True)):
        with pytest.raises(ValueError):
            A.AdamW4bit([p], **kw)
    for kw in (dict(seed="abc"), dict(eden="yes"), dict(eps=None)):
        with pytest.raises(TypeError):
            A.AdamW4bit([p], **kw)
    for group in ({"weight_decay": -1.0}, {"lr": float("nan")}, {"betas": (2, 3)}, {"lr": -5.0}):
        with pytest.raises(ValueError, match="param group 0"):
            A.AdamW4bit([dict(params=[p], **group)])
    o = A.AdamW4bit([p])
    with pytest.raises(ValueError, match="param group 1: weight_decay"):
        o.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))], "weight_decay": -1.0})
    assert len(o.param_groups) == 1                       # the refused group is not kept
    with pytest.raises(TypeError, match="needs float32, bfloat16 or float16 parameters, got torch.int64"):
        A.AdamW4bit([torch.zeros(4, dtype=torch.int64)])
    p.grad = torch.randn_like(p)
    o.step()
    q = torch.nn.Parameter(torch.randn(32, 128))
    with pytest.raises(ValueError, match="does not fit"):
        A.AdamW4bit([q]).load_state_dict(o.state_dict())


def test_diagnostics():
    g = torch.Generator().manual_seed(6)
    m = torch.randn(4096, generator=g)
    assert radial_bias(m, m) == 0.0
    assert radial_bias(m, 0.9 * m) == pytest.approx(-0.1, abs=1e-6)
    assert relative_rms_error(m, 1.1 * m) == pytest.approx(0.1, abs=1e-6)
    q = m.clone()
    q[:1024] = 0
    assert nonzero_to_zero_fraction(m, q) == pytest.approx(0.25)
    assert update_relative_error(2 * m, m) == pytest.approx(1.0)
    # RTN on NF4 of a Gaussian block has a small error; the measured RMS error is that of NF4
    packed, s = A.quantize_blockwise(m, "nf4")
    err = relative_rms_error(m, A.dequantize_blockwise(packed, s, "nf4"))
    assert 0.03 < err < 0.15


def test_state_dict_round_trip_with_custom_codebook_tensors():
    """A custom (tensor) codebook survives state_dict/load_state_dict; another codebook is refused."""
    def make(cb):
        p = torch.nn.Parameter(torch.randn(64, 128, generator=torch.Generator().manual_seed(3)))
        p.grad = torch.randn(64, 128, generator=torch.Generator().manual_seed(4))
        return p, A.AdamW4bit([p], impl="torch", v_codebook=cb, v_rounding="state-rtn")
    cb = torch.linspace(0, 1, 16)
    p, opt = make(cb)
    opt.step()
    q, opt2 = make(cb.clone())
    opt2.load_state_dict(opt.state_dict())
    assert torch.equal(opt2.state[q]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
    _, opt3 = make(torch.linspace(0, 1, 16) ** 2)
    with pytest.raises(ValueError, match="another configuration"):
        opt3.load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="v_codebook"):
        A.AdamW4bit([p], v_codebook="nope")


# ---------------------------------------------------------------------------------------------
# per-group FP32 states (quantize=False) and torch.compile'd models

def _head_groups(m, quantize):
    """_mlp's first layer in a group with the given quantize flag, the rest in a default group."""
    return [dict(params=list(m[0].parameters()), quantize=quantize), dict(params=list(m[2].parameters()))]


def test_group_quantize_false_keeps_fp32_states_and_resume_keeps_the_policy():
    m_ref = _mlp()
    o_ref = A.AdamW4bit(_head_groups(m_ref, False), lr=1e-2, seed=3)
    _train(m_ref, o_ref, 4)
    # the group's tensors have FP32 states although 8192-element m[0].weight is eligible
    assert o_ref.state[m_ref[0].weight]["exp_avg"].dtype == torch.float32
    assert not o_ref.is_quantized(m_ref[0].weight) and o_ref.is_quantized(m_ref[2].weight)
    assert o_ref.state[m_ref[2].weight]["exp_avg"].dtype == torch.uint8
    nbytes = 8 * m_ref[0].weight.numel() + 1.0625 * m_ref[2].weight.numel() + 8 * (128 + 64)
    assert o_ref.state_nbytes() == nbytes
    # with quantize=False the group takes the FP32 AdamW step: the same as preset "fp32" for it
    m_fp = _mlp()
    o_fp = A.AdamW4bit([dict(params=list(m_fp[0].parameters())),
                        dict(params=list(m_fp[2].parameters()), lr=0.0, weight_decay=0.0)],
                       lr=1e-2, preset="fp32")
    m1 = _mlp()
    o1 = A.AdamW4bit([dict(params=list(m1[0].parameters()), quantize=False),
                      dict(params=list(m1[2].parameters()), lr=0.0, weight_decay=0.0)], lr=1e-2)
    _train(m_fp, o_fp, 4)
    _train(m1, o1, 4)
    assert torch.equal(m_fp[0].weight, m1[0].weight)
    # resume: an optimizer built without the option adopts the saved policy from the state dict
    m1 = _mlp()
    o1 = A.AdamW4bit(_head_groups(m1, False), lr=1e-2, seed=3)
    _train(m1, o1, 2)
    sd = o1.state_dict()
    assert [gr["quantize"] for gr in sd["param_groups"]] == [False, True]
    buf = io.BytesIO()
    torch.save({"model": m1.state_dict(), "opt": sd}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    m2 = _mlp(seed=9)
    m2.load_state_dict(ck["model"])
    o2 = A.AdamW4bit(_head_groups(m2, True), lr=1e-2)
    o2.load_state_dict(ck["opt"])
    assert o2.param_groups[0]["quantize"] is False and not o2.is_quantized(m2[0].weight)
    _train(m2, o2, 2, skip=2)                  # _train's data stream, continued from step 2
    for a, b in zip(m_ref.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_group_quantize_flag_is_checked():
    m = _mlp()
    with pytest.raises(TypeError, match=r"param group 0: quantize must be True .* got 'no'"):
        A.AdamW4bit([dict(params=m.parameters(), quantize="no")])
    o = A.AdamW4bit(_head_groups(m, True), lr=1e-2)
    _train(m, o, 1)
    o.param_groups[0]["quantize"] = False       # after the first step: the states are 4-bit
    with pytest.raises(ValueError, match=r"has 4-bit states but its param group now says quantize=False"):
        _train(m, o, 1)
    with pytest.raises(ValueError, match="not a parameter of this optimizer"):
        o.is_quantized(torch.zeros(3))


@pytest.mark.skipif(__import__("shutil").which("g++") is None and not torch.cuda.is_available(),
                    reason="Inductor on CPU needs a C++ compiler")
def test_compiled_model_trains_with_adamw4bit():
    """A torch.compile'd model's parameters are the module's own: AdamW4bit (4-bit states on the
    eligible tensors) trains it as it trains the eager model."""
    eager, comp = _mlp(), _mlp()
    cm = torch.compile(comp)
    o_e = A.AdamW4bit(eager.parameters(), lr=1e-2, impl="torch")
    o_c = A.AdamW4bit(cm.parameters(), lr=1e-2, impl="torch")
    start = _train(eager, torch.optim.SGD(eager.parameters(), lr=0.0), 1)
    loss_e, loss_c = _train(eager, o_e, 6), _train(cm, o_c, 6)
    assert loss_c < 0.8 * start and o_c.state[comp[0].weight]["exp_avg"].dtype == torch.uint8
    # compiled kernels round differently from eager ones (~1e-7 here): a 4-bit code may then
    # flip, which moves its weight by at most ~lr per step (the max bound), but the typical
    # weight stays within rounding of the eager run's (the median bound; the steps move 1e-2)
    assert abs(loss_c - loss_e) < 0.02 * start
    for a, b in zip(eager.parameters(), comp.parameters()):
        assert (a - b).abs().max().item() < 6 * 1e-2 and (a - b).abs().median().item() < 1e-5


# ---------------------------------------------------------------------------------------------
# the fused Triton step = the reference step (TRITON_INTERPRET=1 on CPU; GPU-only tests at the end)

# the kernel's programs take 16 x 128 elements: (4096,) fills 2, 33 x 128 and 40 x 128 fill 2 and
# leave a partial third (1 and 8 tiles); 100 elements stay FP32. Small, as the interpreter's time
# grows with the programs
KERNEL_SHAPES = [(4096,), (33, 128), (40, 128), (100,)]


def _twin_optimizers(**kw):
    torch.manual_seed(11)
    ref = [torch.nn.Parameter(torch.randn(*s)) for s in KERNEL_SHAPES]
    ker = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    return (ref, A.AdamW4bit(ref, lr=1e-2, impl="torch", **kw),
            ker, A.AdamW4bit(ker, lr=1e-2, impl="triton", **kw))


def _set_grads(ps_a, ps_b, g, dtype=torch.float32):
    for a, b in zip(ps_a, ps_b):
        a.grad_dtype = b.grad_dtype = None
        grad = (torch.randn(a.shape, generator=g) * 10 ** torch.empty(1).uniform_(-4, -1, generator=g)).to(dtype)
        a.grad, b.grad = grad.clone(), grad.clone()


def _assert_twins_equal(ref, o_ref, ker, o_ker, quantized_only=False):
    for a, b in zip(ref, ker):
        if quantized_only and not o_ref.is_quantized(a):
            continue
        assert torch.equal(a, b)
        assert o_ref.state[a]["step"] == o_ker.state[b]["step"]
        for k in o_ref.state[a].keys() - {"step"}:
            assert torch.equal(o_ref.state[a][k], o_ker.state[b][k]), k


@pytest.mark.parametrize("kw", [dict(preset="torchao"), dict(preset="zeeden"),
                                dict(preset="zipsr", v_rounding="update-rtn"),
                                # 2-level codebooks: no inner level, the bucket table is all 0
                                dict(preset="torchao", m_codebook=torch.tensor([-1.0, 1.0])),
                                dict(preset="zipsr", v_codebook=torch.tensor([0.0, 1.0]),
                                     v_rounding="update-rtn", lm_head_sr_after=None)],
                         ids=["torchao", "zeeden", "update-rtn", "m-2-levels", "v-2-levels"])
def test_kernel_rtn_bit_identical_to_reference_over_steps(kw):
    ref, o_ref, ker, o_ker = _twin_optimizers(**kw)
    g = torch.Generator().manual_seed(12)
    for step in range(4):      # the first step from zero states, then 3 from stored codes, both grad dtypes
        _set_grads(ref, ker, g, torch.bfloat16 if step % 2 else torch.float32)
        o_ref.step()
        o_ker.step()
    _assert_twins_equal(ref, o_ref, ker, o_ker)


@pytest.mark.parametrize("block_size", [8, 256])
def test_kernel_other_block_sizes_bit_identical(block_size):
    # NB = 128 // block_size blocks per program (8: 16 blocks), and one block over 2 programs' worth (256)
    ref, o_ref, ker, o_ker = _twin_optimizers(preset="zeeden", block_size=block_size)
    g = torch.Generator().manual_seed(15)
    for _ in range(3):
        _set_grads(ref, ker, g)
        o_ref.step()
        o_ker.step()
    _assert_twins_equal(ref, o_ref, ker, o_ker)


@pytest.mark.parametrize("kw", [dict(preset="zipsr"), dict(preset="zipsr", m_rounding="sr"),
                                dict(preset="zipsr", v_rounding="state-sr")],
                         ids=["zipsr", "m-sr", "state-sr"])
def test_kernel_sr_equals_reference_given_the_same_bits(kw):
    ref, o_ref, ker, o_ker = _twin_optimizers(**kw)
    g = torch.Generator().manual_seed(13)
    for _ in range(3):
        _set_grads(ref, ker, g)
        o_ref.step()
        o_ker.step()
        for a, b in zip(ref, ker):        # keep both on the same trajectory despite SR
            b.data.copy_(a.data)
            for k in o_ref.state[a].keys() - {"step"}:
                o_ker.state[b][k].copy_(o_ref.state[a][k])
    _set_grads(ref, ker, g)
    m_rule = o_ref.qcfg["m_rounding"]
    with torch.no_grad():   # the step functions expect step()'s no_grad
        items, us = [], []
        for i, (a, b) in enumerate(zip(ref, ker)):
            if not o_ref.is_quantized(a):
                continue
            u = (torch.rand(a.numel(), generator=g), torch.rand(a.numel(), generator=g))
            for o, p in ((o_ref, a), (o_ker, b)):
                o.state[p]["step"] += 1
            t = int(o_ref.state[a]["step"])
            A.adamw4bit_step_torch(a, a.grad, o_ref.state[a], 1e-2, 0.9, 0.95, 1e-8, 0.1, t, o_ref.qcfg, m_rule, 0,
                                   u=u)
            items.append((b, o_ker.state[b], 0))
            us.append(u)
        A.adamw4bit_step_triton(items, 1e-2, 0.9, 0.95, 1e-8, 0.1, t, o_ker.qcfg, m_rule, step_seed(o_ker.seed, t),
                                o_ker._kernel_tabs, o_ker._kernel_cache, u=us)
    _assert_twins_equal(ref, o_ref, ker, o_ker, quantized_only=True)


def test_kernel_codebook_too_dense_for_its_tables():
    # midpoints 0.25 apart: RTN tables fine; inner levels 0 and 0.001 share a bucket: SR is not
    dense = torch.tensor([-1.0, -0.5, 0.0, 0.001, 0.5, 1.0])
    p = torch.nn.Parameter(torch.randn(4096))
    A.AdamW4bit([p], impl="triton", preset="torchao", m_codebook=dense)
    with pytest.raises(ValueError, match=r"(?s)impl='triton': m_codebook tensor.*codebook levels are closer "
                                         r"than the kernel's level buckets .*use impl='torch'"):
        A.AdamW4bit([p], impl="triton", preset="zipsr", m_codebook=dense)   # LM-head SR
    o = A.AdamW4bit([p], impl="auto", preset="zipsr", m_codebook=dense)     # -> reference
    p.grad = torch.randn(4096)
    o.step()
    assert not o._use_triton(p, interp=True)


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")   # the interpreter's NaN -> int
@pytest.mark.parametrize("preset,kw", [("torchao", {}), ("zeeden", {}), ("zipsr", dict(v_rounding="update-rtn")),
                                       ("zipsr", {})])
def test_kernel_nan_gradient_matches_reference(preset, kw):
    """A NaN gradient element among small finite ones (and an all-NaN tensor): the block's scales
    become NaN as in the reference (a dropped NaN left s = 1e-12 and the bucket index far past
    its table), the other blocks are untouched by it; RTN presets equal the reference exactly
    (NaN compared as NaN) except the codes of NaN blocks, which decode to NaN whatever they are."""
    g = torch.full((4096,), 1e-5)
    g[130] = float("nan")                                  # block 1 of 32
    ps = [torch.nn.Parameter(torch.zeros(4096)), torch.nn.Parameter(torch.zeros(4096))]
    qs = [torch.nn.Parameter(x.detach().clone()) for x in ps]
    grads = [g, torch.full((4096,), float("nan"))]
    ok = A.AdamW4bit(ps, impl="triton", preset=preset, **kw)
    ref = A.AdamW4bit(qs, impl="torch", preset=preset, **kw)
    for a, b, gr in zip(ps, qs, grads):
        a.grad, b.grad = gr.clone(), gr.clone()
    ok.step()
    ref.step()
    st = ok.state[ps[0]]
    for key in ("exp_avg_scale", "exp_avg_sq_scale"):
        assert torch.isnan(st[key][1]) and torch.isfinite(st[key][torch.arange(32) != 1]).all()
    assert torch.isnan(ps[0][130]) and torch.isfinite(ps[0][torch.arange(4096) != 130]).all()
    if "sr" not in kw.get("v_rounding", A.PRESETS[preset]["v_rounding"]):
        for a, b in zip(ps, qs):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
            for key in ("exp_avg", "exp_avg_sq"):
                sc = ref.state[b][key + "_scale"]
                torch.testing.assert_close(ok.state[a][key + "_scale"], sc, rtol=0, atol=0, equal_nan=True)
                keep = torch.isfinite(sc).repeat_interleave(64)     # 64 code bytes per block
                assert torch.equal(ok.state[a][key][keep], ref.state[b][key][keep])


def test_kernel_sr_uniforms_are_16_bit_halves_of_philox():
    """sr_uniforms: byte b of a tile pair reads Philox4x32-7 (torch reference) at counter
    ((b >> 6) * 32 + (b & 31), stream), half (b >> 5) & 1 of each word, u = (k + 1/2) 2^-16 --
    so bytes b and b + 32 share one call and no two elements share bits; also for byte indices
    past 2^32 (the counter's high word)."""
    @triton.jit
    def k(out, seed, base, stream):
        byte = base + tl.arange(0, 4)[:, None] * 64 + tl.arange(0, 64)[None, :]
        us = sr_uniforms(seed, byte, stream)
        i = tl.arange(0, 4)[:, None] * 64 + tl.arange(0, 64)[None, :]
        for q in tl.static_range(4):
            tl.store(out + q * 256 + i, us[q])
    M = 0xFFFFFFFF
    for seed, base, stream in ((7, 0, 0), (2 ** 31 - 2, 3 * 2 ** 32 + 128, 1)):
        out = torch.zeros(4, 256)
        k[(1,)](out, seed, base, stream)
        b = base + torch.arange(256, dtype=torch.int64)
        c = (b >> 6) * 32 + (b & 31)
        z = torch.zeros_like(c)
        words = philox.philox_torch(c & M, c >> 32, z + stream, z, z + seed, z, rounds=7)
        h = ((b >> 5) & 1) * 16
        want = torch.stack([(((w >> h) & 0xFFFF).double() + 0.5) / 65536 for w in words]).float()
        assert torch.equal(out, want)
        assert out.unique().numel() > 1000                  # 1024 draws, (almost) all distinct


def test_kernel_sr_uniforms_of_a_tile_anywhere_equal_its_pairs():
    """_pair_uniforms without PAIRED (an FSDP2 shard whose first block does not start a pair of
    tiles) gives the bytes of tiles f and f + 1 the uniforms that the paired calls (one sr_uniforms
    for tiles 2k and 2k + 1) give them, for f even and odd, also past 2^32 bytes."""
    @triton.jit
    def k(out, seed, base, PAIRED: tl.constexpr):
        i = tl.arange(0, 64)
        us = sr_bits._pair_uniforms(seed, base + i, 1, PAIRED, 64)
        for q in tl.static_range(4):
            tl.store(out + q * 64 + i, us[q])

    def run(base, paired):
        out = torch.zeros(4, 64)
        k[(1,)](out, 11, base, paired)
        return out
    for base in (0, 64, 3 * 64, 2 ** 32 + 5 * 64):
        lo = base - base % 128                           # the pair holding tile `base`
        tiles = [u[rows] for u in (run(lo, True), run(lo + 128, True)) for rows in ([0, 1], [2, 3])]
        j = (base - lo) // 64
        assert torch.equal(run(base, False), torch.cat([tiles[j], tiles[j + 1]])), base


def test_kernel_philox_sr_is_unbiased():
    # With b1 = b2 = 0 the working moments are m = g and v = g² (bias correction 1 at t = 1), so
    # one step stores Q(g) and Q(g²). Each 128-element pattern is repeated R times; per element,
    # the mean over the R independent Philox draws of phi(Q(x)) lies within 5 standard errors
    # of phi(x) (std of phi(Q(x)) <= half the level gap): m SR in state space (NF4), v Update-SR.
    R, eps = 512, 1e-3
    gen = torch.Generator().manual_seed(14)
    pattern = torch.randn(128, generator=gen) * 1e-2
    pattern[0] = 0.05                                   # fixes each block's absmax
    p = torch.nn.Parameter(torch.zeros(R * 128))
    opt = A.AdamW4bit([p], lr=0.0, betas=(0.0, 0.0), eps=eps, preset="zipsr", m_rounding="sr",
                      impl="triton", seed=3)
    p.grad = pattern.repeat(R)
    opt.step()
    st = opt.state[p]
    for key, cb, x, phi in (("exp_avg", "nf4", pattern, lambda z: z),
                            ("exp_avg_sq", "dyn4", pattern ** 2, lambda z: A.preconditioner(z, 1.0, eps))):
        q = A.dequantize_blockwise(st[key], st[key + "_scale"], cb).view(R, 128)
        s = x.abs().max()
        assert torch.equal(st[key + "_scale"], s.repeat(R))
        levels = s * CODEBOOKS[cb]
        lo = (torch.searchsorted(levels, x, right=True) - 1).clamp(0, levels.numel() - 2)
        gap = (phi(levels[lo + 1].double()) - phi(levels[lo].double())).abs()
        mean = phi(q.double()).mean(0)
        assert ((mean - phi(x.double())).abs() <= 5 * gap / 2 / math.sqrt(R) + 1e-12).all(), key
        assert not (q == q[0]).all()                    # the draws really differ across blocks


def test_kernel_lm_head_sr_launch_and_resume():
    # The LM-head tensor goes through its own SR launch after 90 %; a triton run resumes exactly.
    def make():
        m = _mlp(hidden=64)    # 4096-element weights: the smallest with 4-bit states
        o = A.AdamW4bit(m.parameters(), lr=1e-2, preset="zipsr", impl="triton", seed=5)
        o.mark_lm_head(m[2].weight)
        o.set_progress(0.95)
        return m, o
    m_ref, o_ref = make()
    _train(m_ref, o_ref, 4)
    m1, o1 = make()
    _train(m1, o1, 2)
    sd = o1.state_dict()
    m2, o2 = make()
    m2.load_state_dict(m1.state_dict())
    o2.load_state_dict(sd)
    _train(m2, o2, 2, skip=2)                  # the same data stream, continued from step 2
    for a, b in zip(m_ref.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_impl_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    p = torch.nn.Parameter(torch.randn(64, 128))
    p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match="impl='triton' needs CUDA"):
        A.AdamW4bit([p], impl="triton").step()


def test_bucket_lut_equals_searchsorted():
    """The kernel's level search (bucket j = trunc(y * n/2 + n/2) in float32 -- exactly the
    kernel's fma, as y * n/2 is exact --, then count_j + (y >= bound_j) from entry j) equals
    torch.searchsorted(bounds, y, right=True) for every codebook's level midpoints (State-RTN)
    and inner levels (the other rules), at the table's own bucket count and at the largest, on
    adversarial y: each bound and each bucket edge +- 0..3 ulps, the ends of [-1, 1] and random y."""
    from codebooks import CODEBOOKS
    gen = torch.Generator().manual_seed(21)
    sizes = set()
    for name in CODEBOOKS:
        T = get_codebook(name)
        for bounds in (midpoints(T), T[1:-1]):
            for lut in (bucket_lut(bounds), bucket_lut(bounds, LUT_BUCKETS[-1])):
                n = lut.numel() - 1
                sizes.add(n)
                count = (lut & 0xFFFFFFFF).to(torch.int32)
                bound = (lut >> 32).to(torch.int32).view(torch.float32)
                edges = (-1 + 2 * torch.arange(n + 2, dtype=torch.float64) / n).float()
                y = torch.cat([bounds, edges, torch.tensor([-1.0, 0.0, 1.0]),
                               torch.rand(4000, generator=gen) * 2 - 1])
                for _ in range(3):
                    y = torch.cat([y, torch.nextafter(y, y + torch.inf), torch.nextafter(y, y - torch.inf)]).unique()
                y = y[y.abs() <= 1 + 2 ** -22]                 # |x (1/s)| <= 1 up to rounding
                j = (y * (n / 2) + n / 2).to(torch.int32).long()
                got = count[j].long() + (y >= bound[j]).long()
                assert torch.equal(got, torch.searchsorted(bounds, y, right=True)), (name, n)
    assert {32, 512, 1024} <= sizes                      # NF4 needs 32 buckets, Dyn4 512
    with pytest.raises(ValueError, match="closer than"):
        bucket_lut(torch.tensor([0.0, 0.5, 0.5005, 1.0]))
    with pytest.raises(ValueError, match="closer than"):   # too dense for 32 buckets, not 64
        bucket_lut(torch.tensor([-0.5, -0.45, 0.5]), 32)
    assert bucket_lut(torch.tensor([-0.5, -0.45, 0.5])).numel() == 65


def test_kernel_bf16_grads_at_odd_offsets():
    """BF16 gradient views that start at an odd 2-byte offset (as in a flat gradient buffer; the
    launch then reads element by element instead of 16-byte vectors) give the reference's
    result bit for bit."""
    ref, o_ref, ker, o_ker = _twin_optimizers(preset="zeeden")
    g = torch.Generator().manual_seed(22)
    for _ in range(2):
        n = sum(p.numel() for p in ref)
        flat = (torch.randn(n + 1, generator=g) * 1e-2).to(torch.bfloat16)
        off = 1
        for a, b in zip(ref, ker):
            a.grad_dtype = b.grad_dtype = None
            view = flat[off:off + a.numel()].view(a.shape)
            a.grad, b.grad = view.clone(), view
            off += a.numel()
        assert any(b.grad.data_ptr() % 4 for b in ker if o_ker.is_quantized(b))
        o_ref.step()
        o_ker.step()
    _assert_twins_equal(ref, o_ref, ker, o_ker)


@needs_compiled
@needs_cuda
def test_gpu_fused_adamw4bit_step_bit_identical_to_reference():
    """On CUDA the fused step gives the CPU reference's parameters and packed states bit for bit
    over 8 steps (random shapes, fp32 and bf16 grads) for the RTN presets and for ZIP-SR's m with
    v by Update-RTN; the FP32-state tensors agree to 1e-5; a GPU state_dict loads into a CPU
    optimizer exactly."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(4096,), (33, 384), (1000, 128 * 3), (77, 1024), (100,)]
    for kw in (dict(preset="torchao"), dict(preset="zeeden"),
               dict(preset="zipsr", v_rounding="update-rtn")):
        cpu = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
        o_c = A.AdamW4bit(cpu, impl="torch", lr=1e-2, **kw)
        o_g = A.AdamW4bit(gpu, impl="triton", lr=1e-2, **kw)
        for step in range(8):
            for a, b in zip(cpu, gpu):
                a.grad_dtype = b.grad_dtype = None
                gr = torch.randn(a.shape, generator=gen) * 10 ** (-1 - 3 * torch.rand(1, generator=gen).item())
                if step % 2:
                    gr = gr.bfloat16()
                a.grad, b.grad = gr.clone(), gr.cuda()
            o_c.step()
            o_g.step()
        quantized = [(a, b) for a, b in zip(cpu, gpu) if o_c.is_quantized(a)]
        assert len(quantized) == 4, kw
        for a, b in quantized:
            assert torch.equal(a, b.cpu()), (kw, tuple(a.shape))
            for k in o_c.state[a].keys() - {"step"}:
                assert torch.equal(o_c.state[a][k], o_g.state[b][k].cpu()), (kw, tuple(a.shape), k)
        assert max((a - b.cpu()).abs().max().item() for a, b in zip(cpu, gpu)) < 1e-5, kw
    o_c2 = A.AdamW4bit(cpu, impl="torch", lr=1e-2, preset="zipsr", v_rounding="update-rtn")
    o_c2.load_state_dict(o_g.state_dict())
    for a, b in zip(cpu, gpu):
        assert o_c2.state[a]["step"] == o_g.state[b]["step"]
        for k in o_g.state[b].keys() - {"step"}:
            assert torch.equal(o_c2.state[a][k], o_g.state[b][k].cpu()), (tuple(a.shape), k)


# ---------------------------------------------------------------------------------------------
# FSDP2 (fully_shard, DTensor parameters) and torch.distributed.checkpoint, 2 gloo processes on CPU

def _rank_main(fn, tmp, rank, world):
    """Body of one rank started by kernel_launcher: join the gloo group of `world` processes through a
    file store, run fn(rank, world, tmp) and write its result to tmp/fn.rank.pt (atomically)."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store-{fn}-{world}", rank=rank, world_size=world)
    args = torch.load(f"{tmp}/{fn}.{world}.args.pt") if os.path.exists(f"{tmp}/{fn}.{world}.args.pt") else ()
    res = globals()[fn](rank, world, tmp, *args)
    torch.save(res, f"{tmp}/{fn}.{world}.{rank}.tmp")
    os.replace(f"{tmp}/{fn}.{world}.{rank}.tmp", f"{tmp}/{fn}.{world}.{rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


def kernel_launcher(fn, tmp, world, *args, timeout=300):
    """Run fn(rank, world, tmp, *args) on `world` fresh processes (_rank_main; RANK, WORLD_SIZE,
    LOCAL_RANK set as torchrun does) and return their results, rank by rank. A
    rank is judged by the result file it wrote, not by its exit status: gloo on CPU sometimes
    aborts (SIGABRT) in process-group teardown, after the results are written, and that is not a
    failure of what is tested. A rank that wrote nothing fails the test with its stderr. An
    earlier launch of fn on `world` ranks in tmp leaves nothing this one reads: its results, its
    arguments and its file store (a store file left by an aborted teardown hangs the next group)."""
    for stale in [f"store-{fn}-{world}", f"{fn}.{world}.args.pt"] + [f"{fn}.{world}.{r}.pt" for r in range(world)]:
        if os.path.exists(os.path.join(str(tmp), stale)):
            os.remove(os.path.join(str(tmp), stale))
    if args:
        torch.save(args, os.path.join(str(tmp), f"{fn}.{world}.args.pt"))
    code = f"import test_all; test_all._rank_main({fn!r}, {str(tmp)!r}, {{}}, {world})"
    procs = [subprocess.Popen([sys.executable, "-c", code.format(r)], cwd=os.path.dirname(os.path.abspath(__file__)),
                              env=dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1", RANK=str(r),
                                       LOCAL_RANK=str(r), WORLD_SIZE=str(world)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:       # a rank left waiting in a collective after the other one died
            if p.poll() is None:
                p.kill()
    results = []
    for r, (p, (_, err)) in enumerate(zip(procs, outs)):
        path = os.path.join(str(tmp), f"{fn}.{world}.{r}.pt")
        assert os.path.exists(path), f"{fn}: rank {r} of {world} exited with {p.returncode} before " \
                                     f"writing its result:\n{err[-4000:]}"
        results.append(torch.load(path, weights_only=False))
    return results


# shapes: whole-row blocks, even (40 rows) and uneven (33 rows) on 2 ranks; rows that split
# blocks (64 elements) and a 1-D tensor (the gathered step); an FP32-state vector
_FSDP_SHAPES = [(40, 256), (33, 128), (96, 64), (4096,), (33,)]
_FSDP_PRESETS = ("torchao", "zeeden")     # RTN presets, bit-identical for any world size (SR: _SR_SHAPES below)


class _Quadratic(nn.Module):
    """sum_i c_i (p_i - x_i)², one parameter per shape (initial values from `seed`)."""

    def __init__(self, seed=0, shapes=_FSDP_SHAPES):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(s, generator=g)) for s in shapes])

    def forward(self, xs):
        return sum((((p - x) ** 2) * (i + 1)).sum() for i, (p, x) in enumerate(zip(self.ps, xs)))


def _quadratic_steps(model, opt, first, last):
    """Steps first..last-1 with targets drawn from the step number (the same on every rank)."""
    for s in range(first, last):
        g = torch.Generator().manual_seed(1000 + s)
        model([torch.randn(x.shape, generator=g) for x in model.ps]).backward()
        opt.step()
        opt.zero_grad()


def _full(model):
    from torch.distributed.tensor import DTensor
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for p in model.parameters()]


def _fsdp_quadratic(preset, seed=0, impl="torch", shapes=_FSDP_SHAPES):
    from torch.distributed.fsdp import fully_shard
    model = fully_shard(_Quadratic(seed, shapes))
    return model, A.AdamW4bit(model.parameters(), lr=1e-2, preset=preset, impl=impl)


def _fsdp_train_and_save(rank, world, tmp):
    # 3 steps, a DCP checkpoint, 2 more steps (the reference step on the local shards); one step of
    # the fused kernel (interpreter, ~10 s a step) on the local shards; GaussWS layers in
    # fully_shard units (_fsdp_gaussws, in the gaussws.py section)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    res = {"gaussws": _fsdp_gaussws()}
    model, opt = _fsdp_quadratic("torchao", impl="triton", shapes=_FSDP_SHAPES[:2])   # the row-sharded ones
    _quadratic_steps(model, opt, 0, 1)
    res["triton", 1] = _full(model)
    for preset in _FSDP_PRESETS:
        model, opt = _fsdp_quadratic(preset)
        _quadratic_steps(model, opt, 0, 3)
        res[preset, 3] = _full(model)
        res[preset, "quantized"] = [opt.is_quantized(p) for p in model.parameters()]
        res[preset, "local"] = [{k: tuple(v.to_local().shape) for k, v in opt.state[p].items() if k != "step"}
                                for p in model.parameters()]
        res[preset, "nbytes"] = opt.state_nbytes()
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=os.path.join(tmp, f"dcp-{preset}"))
        _quadratic_steps(model, opt, 3, 5)
        res[preset, 5] = _full(model)
    return res


def _dcp_load_and_continue(model, opt, path):
    """Load the DCP checkpoint at path into model and opt (fresh), then steps 3 and 4."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    steps = [opt.state[p]["step"] for p in model.parameters()]
    _quadratic_steps(model, opt, 3, 5)
    return steps, _full(model)


def _fsdp_load_and_continue(rank, world, tmp, prefix="dcp"):
    # a fresh model (other initial values) and optimizer load a checkpoint, then 2 steps
    res = {}
    for preset in _FSDP_PRESETS:
        model, opt = _fsdp_quadratic(preset, seed=1)
        res[preset, "steps"], res[preset, 5] = _dcp_load_and_continue(model, opt, os.path.join(tmp, f"{prefix}-{preset}"))
    return res


def _unwrapped_dcp_round_trip(tmp):
    """In this process, without fully_shard: load each 2-rank checkpoint (dcp-PRESET) and step on;
    train 3 steps and save dcp-plain-PRESET, for 2 ranks to load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    res = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # DCP in one process without a process group: intended
        for preset in _FSDP_PRESETS:
            model = _Quadratic(seed=1)
            opt = A.AdamW4bit(model.parameters(), lr=1e-2, preset=preset, impl="torch")
            res[preset, "steps"], res[preset, 5] = _dcp_load_and_continue(model, opt, os.path.join(tmp, f"dcp-{preset}"))
            model, opt = _plain_quadratic(preset, 3)
            dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                     checkpoint_id=os.path.join(tmp, f"dcp-plain-{preset}"))
    return [res]


def test_state_dict_gives_per_row_codes_and_loads_either_layout():
    """state_dict() gives the 4-bit codes and scales of a tensor whose rows are whole blocks per
    row, (rows, row_numel / 2) and (rows, row_numel / 128), as views of the step's flat tensors
    (FSDP2's layout); other tensors' flat. load_state_dict takes these and the flat layout of
    older checkpoints, and the next steps equal the uninterrupted run's bit for bit."""
    model, opt = _plain_quadratic("torchao", 3)
    sd = opt.state_dict()
    shapes = [tuple(sd["state"][i]["exp_avg"].shape) for i in range(4)]
    assert shapes == [(40, 128), (33, 64), (3072,), (2048,)] and sd["state"][0]["exp_avg_sq_scale"].shape == (40, 2)
    assert sd["state"][0]["exp_avg"].data_ptr() == opt.state[model.ps[0]]["exp_avg"].data_ptr()   # a view
    assert opt.state[model.ps[0]]["exp_avg"].shape == (40 * 128,)                              # left flat
    flat = {**sd, "state": {i: {k: v.flatten() if k in PACKED else v for k, v in st.items()}
                            for i, st in sd["state"].items()}}
    layouts = copy.deepcopy(sd), copy.deepcopy(flat)    # before the step changes the state in place
    _quadratic_steps(model, opt, 3, 5)
    for saved in layouts:
        again, opt2 = _plain_quadratic("torchao", 3)
        opt2.load_state_dict(saved)
        assert all(v.dim() == 1 for st in opt2.state.values() for k, v in st.items() if k in PACKED)
        _quadratic_steps(again, opt2, 3, 5)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """The 2-rank run with its checkpoints; the runs that load them on 1 and on 2 ranks and into
    an unwrapped model; 2 ranks loading the unwrapped model's checkpoint."""
    tmp = tmp_path_factory.mktemp("fsdp")
    saved = kernel_launcher("_fsdp_train_and_save", tmp, 2)
    one, two = kernel_launcher("_fsdp_load_and_continue", tmp, 1), kernel_launcher("_fsdp_load_and_continue", tmp, 2)
    unwrapped = _unwrapped_dcp_round_trip(tmp)
    return saved, one, two, unwrapped, kernel_launcher("_fsdp_load_and_continue", tmp, 2, "dcp-plain")


def _plain_quadratic(preset, steps, shapes=_FSDP_SHAPES):
    model = _Quadratic(shapes=shapes)
    opt = A.AdamW4bit(model.parameters(), lr=1e-2, preset=preset, impl="torch")
    _quadratic_steps(model, opt, 0, steps)
    return model, opt


@pytest.mark.xdist_group("fsdp_runs")   # one worker computes the module fixture once
@pytest.mark.parametrize("preset", _FSDP_PRESETS)
def test_fsdp_two_ranks_equal_one_rank_bit_for_bit(fsdp_runs, preset):
    """fully_shard on 2 ranks gives the unsharded reference's parameters bit for bit after 1
    step of the fused kernel on each local shard and after 3 and 5 steps of the reference step, for even, uneven and block-splitting shards;
    eligibility comes from the global tensor, so the same tensors get 4-bit states, and the row
    sharded ones hold only their own rows' codes and scales."""
    saved = fsdp_runs[0]
    model, _ = _plain_quadratic("torchao", 1, _FSDP_SHAPES[:2])
    for rank_res in saved:       # the fused kernel (interpreter) on the local shards, one step
        assert all(torch.equal(a.detach(), b) for a, b in zip(model.parameters(), rank_res["triton", 1]))
    for steps in (3, 5):
        model, opt = _plain_quadratic(preset, steps)
        for rank_res in saved:
            assert [opt.is_quantized(p) for p in model.parameters()] == rank_res[preset, "quantized"] \
                == [True, True, True, True, False]
            for a, b in zip(model.parameters(), rank_res[preset, steps]):
                assert torch.equal(a.detach(), b), (preset, steps, tuple(a.shape))
    for rank, rank_res in enumerate(saved):
        local = rank_res[preset, "local"]
        rows = (20, 17 - rank)          # torch.chunk: 40 -> 20 + 20, 33 -> 17 + 16
        assert local[0] == {"exp_avg": (rows[0], 128), "exp_avg_scale": (rows[0], 2),
                            "exp_avg_sq": (rows[0], 128), "exp_avg_sq_scale": (rows[0], 2)}
        assert local[1]["exp_avg"] == (rows[1], 64) and local[1]["exp_avg_sq_scale"] == (rows[1], 1)
        assert local[2]["exp_avg"] == (3072,) and local[3]["exp_avg_scale"] == (32,)   # gathered: whole
        assert local[4]["exp_avg"] == ((17, 16)[rank],)


@pytest.mark.xdist_group("fsdp_runs")   # one worker computes the module fixture once
@pytest.mark.parametrize("preset", _FSDP_PRESETS)
def test_fsdp_dcp_checkpoint_loads_on_one_and_two_ranks(fsdp_runs, preset):
    """A DCP checkpoint written on 2 ranks (get_optimizer_state_dict, dcp.save) loads with
    dcp.load / set_optimizer_state_dict into a fresh model on 1 rank, on 2 ranks and without
    fully_shard, and the unwrapped model's checkpoint loads on 2 ranks: the packed codes and scales
    reshard (state_dict gives a plain tensor's per row, as FSDP2 keeps them), and 2 more steps give
    the uninterrupted run's parameters bit for bit."""
    saved, one, two, unwrapped, from_unwrapped = fsdp_runs
    for res in one + two + unwrapped + from_unwrapped:
        assert res[preset, "steps"] == [3.0] * len(_FSDP_SHAPES)
        for a, b in zip(saved[0][preset, 5], res[preset, 5]):
            assert torch.equal(a, b), (preset, tuple(a.shape))


# the recorded step plan on DTensor parameters: row shards (the kernel), an FP32-state vector
# (the reference loop on CPU) and a 1-D tensor (the kernel; gathered on 2 ranks, so there only 1)
_REPLAY_SHAPES = [(32, 128), (33,), (4096,)]


def _fsdp_replay(rank, world, tmp):
    # 3 ZIP-SR steps of the fused kernel (interpreter), once with the recorded plan and once with
    # every step on the full path (the plan voided before each); the last step's gradients are kept
    # alive, so each step's gradients lie elsewhere and the replay must repoint the launch table
    shapes = _REPLAY_SHAPES if world == 1 else _REPLAY_SHAPES[:2]
    res = {}
    for replay in (True, False):
        model, opt = _fsdp_quadratic("zipsr", impl="triton", shapes=shapes)
        held, ptrs = None, []
        for s in range(3):
            if not replay:
                opt._plan_version += 1
            g = torch.Generator().manual_seed(1000 + s)
            model([torch.randn(x.shape, generator=g) for x in model.ps]).backward()
            ptrs.append([p.grad.to_local().data_ptr() for p in model.parameters()])
            opt.step()
            held = [p.grad for p in model.parameters()]
            opt.zero_grad()
        res[replay] = dict(params=_full(model), replays=opt._plan["k"] if opt._plan else None, ptrs=ptrs,
                           states=[{k: v.to_local().clone() for k, v in opt.state[p].items() if k != "step"}
                                   for p in model.parameters()],
                           grads_left=[lp.grad for _, lp in opt._local_views.values()])
    del held
    return res


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp_replayed_step_equals_full_step(tmp_path, world):
    """On DTensor parameters step() records its plan at the second step and replays it from the
    third (the local tensors are the same objects every step), with each step's gradients at new
    addresses: 3 ZIP-SR kernel steps equal 3 steps on the full path bit for bit, parameters and
    packed states, on 1 rank (the 1-D tensor stepped on its one shard, no all-gather) and on 2
    (row shards; the 1-D tensor, gathered there, would void the plan and is left out). After a
    step the optimizer holds no reference to FSDP2's gradients."""
    runs = kernel_launcher("_fsdp_replay", tmp_path, world)
    for res in runs:
        assert res[True]["replays"] == 1 and res[False]["replays"] == 0
        ptrs = res[True]["ptrs"]
        assert all(a != b for s in range(2) for a, b in zip(ptrs[s], ptrs[s + 1]))
        for a, b in zip(res[True]["params"], res[False]["params"]):
            assert torch.equal(a, b), tuple(a.shape)
        for a, b in zip(res[True]["states"], res[False]["states"]):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert len(res[True]["grads_left"]) == len(res[True]["params"])
        assert all(g is None for g in res[True]["grads_left"])


# SR under fully_shard: each element draws the bits of its place in the whole tensor. (33, 128),
# a block a row: on 2 ranks 17 + 16 rows (a shard at block 17, whose tile pairs are not the
# unsharded tensor's: the kernel's per-tile path), on 3 ranks 11 * 3 (blocks 11 and 22: both
# paths); FP32-state rows (33, 16), split alike, and a vector (45,), 23 + 22 and 15 * 3. The run is
# BF16 with the SR write, the first tensor the LM head past lm_head_sr_after: m, v and the write
# draw SR bits, one after the other (the FP32-state tensors through their kernel under "triton").
_SR_SHAPES = [(33, 128), (33, 16), (45,)]


class _Linear(_Quadratic):
    """sum_i (i + 1) <p_i, x_i>, x_i rounded to quarters: gradients of few significant bits, so
    FSDP2's mean of 3 ranks' equal gradients is exact (as of 2, for any gradient)."""

    def forward(self, xs):
        return sum((p * ((x * 4).round() / 4) * (i + 1)).sum() for i, (p, x) in enumerate(zip(self.ps, xs)))


def _sr_run(impl, shard):
    """2 ZIP-SR steps of _Linear(_SR_SHAPES) (BF16, fully_shard if `shard`; above): the whole
    parameters, states (flat) and each parameter's element offset on this rank."""
    from torch.distributed.tensor import DTensor
    model = _Linear(shapes=_SR_SHAPES).bfloat16()
    if shard:
        from torch.distributed.fsdp import fully_shard
        model = fully_shard(model)
    opt = A.AdamW4bit(model.parameters(), lr=1e-2, preset="zipsr", impl=impl, param_rounding="sr")
    opt.mark_lm_head(model.ps[0])
    opt.set_progress(0.95)
    _quadratic_steps(model, opt, 0, 2)
    full = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).reshape(-1)   # noqa: E731
    return dict(params=_full(model), offsets=[opt._shard_layouts.get(id(p), (0, 0))[1] for p in model.parameters()],
                states=[{k: full(v) for k, v in opt.state[p].items() if k != "step"} for p in model.parameters()])


def _fsdp_sr_runs(rank, world, tmp):
    return {impl: _sr_run(impl, True) for impl in ("torch", "triton")}


@pytest.fixture(scope="module")
def sr_unwrapped():
    return {impl: _sr_run(impl, False) for impl in ("torch", "triton")}


@pytest.mark.xdist_group("fsdp_sr")   # one worker computes the unwrapped runs once
@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp_sr_bits_equal_on_one_two_three_ranks(tmp_path, sr_unwrapped, world):
    """ZIP-SR's v (Update-SR), the LM head's m SR and the BF16 SR write draw the same bits under
    fully_shard on 1, 2 and 3 ranks as without it, for even and uneven shards, shards whose first
    block does not start a pair of kernel tiles, FP32-state rows and vectors: 2 steps give the
    unwrapped model's parameters and states bit for bit, reference and kernel."""
    rows = {1: ([33], [33], [45]), 2: ([17, 16], [17, 16], [23, 22]), 3: ([11] * 3, [11] * 3, [15] * 3)}[world]
    for rank, res in enumerate(kernel_launcher("_fsdp_sr_runs", tmp_path, world)):
        for impl, want in sr_unwrapped.items():
            got = res[impl]
            assert got["offsets"] == [sum(r[:rank]) * (s[1] if len(s) > 1 else 1) for r, s in zip(rows, _SR_SHAPES)]
            for a, b, shape in zip(want["params"], got["params"], _SR_SHAPES):
                assert torch.equal(a, b), (world, rank, impl, shape)
            for a, b, shape in zip(want["states"], got["states"], _SR_SHAPES):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (world, rank, impl, shape)


# ---------------------------------------------------------------------------------------------
# BF16 / FP16 parameters: the write (RTN, SR, eq. MW's 24-bit master weight), kernel = reference

def test_round_to_bf16_rtn_is_torchs_cast_and_sr_is_unbiased():
    """RTN equals torch's float32 -> bfloat16 cast bit for bit (ties, overflow, NaN stay NaN). SR
    rounds to one of the two adjacent BF16 values, and its mean over 4096 draws per element is
    the FP32 value within 5 standard errors of a two-point law (fails a correct SR with p ~ 6e-7
    per element; 64 elements)."""
    gen = torch.Generator().manual_seed(30)
    w = torch.randn(20000, generator=gen) * 10 ** torch.empty(20000).uniform_(-30, 30, generator=gen)
    ties = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.3895e38, 1e-40, 0.0, -0.0])
    w = torch.cat([w, ties])
    assert torch.equal(round_to_bf16(w).view(torch.int16), w.bfloat16().view(torch.int16))
    assert round_to_bf16(torch.tensor([float("nan")])).isnan().all()
    x = torch.randn(64, generator=gen).float() * 3
    bits = x.view(torch.int32)
    down = (bits & -65536).view(torch.float32)                 # the BF16 neighbour toward zero
    up = ((bits & -65536) + 65536).view(torch.float32)         # and away from zero
    r = round_to_bf16(x.expand(4096, 64), "sr", torch.rand(4096, 64, generator=gen)).float()
    assert ((r == down) | (r == up)).all()
    p = (x - down) / (up - down)                                # P(up) of an unbiased SR
    se = (up - down).abs() * (p * (1 - p) / 4096).sqrt()
    assert ((r.mean(0) - x).abs() <= 5 * se + 1e-9 * x.abs()).all()
    assert (r.std(0) > 0).all()
    with pytest.raises(ValueError, match="uniforms u"):
        round_to_bf16(x, "sr")
    with pytest.raises(ValueError, match="rule must be"):
        round_to_bf16(x, "stochastic")


def test_master_weight_split_join_is_16_significant_bits():
    """eq. MW: x = RTN_bf16(w), |e| <= 127, and x + e 2^(E-15) is w rounded to 1/256 of x's ulp
    (error <= 2^(E-16), up to 2^(E-15) where e is clamped), so below x's own error; exact for w
    with 16 significant bits (unless clamped)."""
    gen = torch.Generator().manual_seed(31)
    w = torch.randn(50000, generator=gen) * 10 ** torch.empty(50000).uniform_(-20, 20, generator=gen)
    x, e = split_master(w)
    assert x.dtype == torch.bfloat16 and e.dtype == torch.int8 and e.shape == w.shape
    assert torch.equal(x.view(torch.int16), w.bfloat16().view(torch.int16))
    back = join_master(x, e)
    unit, _ = correction_unit(x.float())
    clamped = e.abs() == 127      # |w - x| in (127.5, 128] units: error up to one unit
    assert ((back - w).abs() <= torch.where(clamped, unit, unit / 2) * (1 + 1e-6)).all()
    assert clamped.float().mean() < 0.02       # ~3/256: |e| = 127 itself, and the clamped 128
    assert (back - w).abs().max() < (x.float() - w).abs().max()
    w16 = (w.view(torch.int32) & -256).view(torch.float32)    # 16 significant bits
    x16, e16 = split_master(w16)
    # exact unless clamped, or x rounded up to the next power of two (its unit is then twice w's)
    exact = (e16.abs() < 127) & (torch.frexp(x16.float())[1] == torch.frexp(w16)[1])
    assert exact.float().mean() > 0.97
    assert torch.equal(join_master(x16, e16)[exact], w16[exact])


def _bf16_twins(dtype=torch.bfloat16, **kw):
    # a tensor over 2 programs with a partial last one, one of a single partial program, one FP32-state
    torch.manual_seed(32)
    ref = [torch.nn.Parameter(torch.randn(*s).to(dtype)) for s in [(4096 + 384,), (40, 128), (100,)]]
    ker = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    return (ref, A.AdamW4bit(ref, lr=1e-2, impl="torch", **kw),
            ker, A.AdamW4bit(ker, lr=1e-2, impl="triton", **kw))


@pytest.mark.parametrize("dtype,kw", [
    (torch.bfloat16, dict(preset="zeeden")), (torch.float16, dict(preset="zipsr", v_rounding="update-rtn")),
    (torch.bfloat16, dict(preset="torchao", master_weight_bits=24))],
    ids=["bf16-zeeden", "fp16-update-rtn", "bf16-master24"])
def test_kernel_16bit_params_bit_identical_to_reference(dtype, kw):
    """BF16/FP16 parameters (and gradients of their dtype) through the fused kernel give the
    reference's weights, packed states and param_correction bit for bit over 2 steps."""
    ref, o_ref, ker, o_ker = _bf16_twins(dtype, **kw)
    g = torch.Generator().manual_seed(33)
    for _ in range(2):
        _set_grads(ref, ker, g, dtype)
        o_ref.step()
        o_ker.step()
    _assert_twins_equal(ref, o_ref, ker, o_ker)
    assert all(p.dtype == dtype for p in ker)
    if kw.get("master_weight_bits"):
        st = o_ker.state[ker[0]]
        assert st["param_correction"].dtype == torch.int8 and st["param_correction"].abs().max() > 0


def test_kernel_bf16_sr_write_equals_reference_given_the_same_bits():
    """param_rounding='sr': given the same uniforms (u_m, u_v, u_p) the kernel writes the
    reference's BF16 weights and states bit for bit; with its own Philox bits, two steps from one
    state differ from RTN in some weights but every weight is one of the two BF16 neighbours."""
    ref, o_ref, ker, o_ker = _bf16_twins(preset="zipsr", param_rounding="sr")
    g = torch.Generator().manual_seed(34)
    _set_grads(ref, ker, g, torch.bfloat16)
    with torch.no_grad():
        items, us = [], []
        for a, b in zip(ref, ker):
            if not o_ref.is_quantized(a):
                continue
            for o, p in ((o_ref, a), (o_ker, b)):
                o._init_state(p)["step"] = 1.0
            u = tuple(torch.rand(a.numel(), generator=g) for _ in range(3))
            A.adamw4bit_step_torch(a, a.grad, o_ref.state[a], 1e-2, 0.9, 0.95, 1e-8, 0.1, 1, o_ref.qcfg, "rtn", 0, u=u)
            items.append((b, o_ker.state[b], 0))
            us.append(u)
        A.adamw4bit_step_triton(items, 1e-2, 0.9, 0.95, 1e-8, 0.1, 1, o_ker.qcfg, "rtn", 0,
                                o_ker._kernel_tabs, o_ker._kernel_cache, u=us)
    _assert_twins_equal(ref, o_ref, ker, o_ker, quantized_only=True)
    # Philox bits: SR differs from RTN, and stays within one BF16 ulp of it
    p = torch.nn.Parameter(torch.randn(8192, generator=g).bfloat16())
    q = torch.nn.Parameter(p.detach().clone())
    o_sr = A.AdamW4bit([p], lr=1e-3, impl="triton", preset="torchao", param_rounding="sr")
    o_rtn = A.AdamW4bit([q], lr=1e-3, impl="triton", preset="torchao")
    p.grad = torch.randn(8192, generator=g).bfloat16()
    q.grad = p.grad.clone()
    o_sr.step()
    o_rtn.step()
    d = (p.view(torch.int16).int() - q.view(torch.int16).int()).abs()
    assert d.max() == 1 and 0.05 < (d > 0).float().mean() < 0.95


@pytest.mark.parametrize("dtype,gdtype,rule,corr", [
    (torch.bfloat16, torch.float32, "rtn", False), (torch.bfloat16, torch.bfloat16, "sr", False),
    (torch.bfloat16, torch.bfloat16, "rtn", True), (torch.float16, torch.float32, "rtn", False)],
    ids=["bf16-fp32grad", "bf16-sr", "bf16-master24", "fp16"])
def test_fp32_state_kernel_equals_reference(dtype, gdtype, rule, corr):
    """adamw_fp32_kernel (FP32 moments, 16-bit parameters; three tensors, one of them over two
    programs with a partial last one) gives adamw_step_torch's weights, moments and
    param_correction bit for bit over 3 steps, given the same SR uniforms; with its own Philox
    bits the SR write is within one BF16 ulp of RTN and differs from it in some weights."""
    gen = torch.Generator().manual_seed(41)
    shapes = [(5,), (33, 40), (ADAMW_BLOCK + 300,)]
    init = [(torch.randn(s, generator=gen) * 0.1).to(dtype) for s in shapes]
    m0 = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
    v0 = [torch.rand(s, generator=gen) * 1e-5 for s in shapes]
    e0 = [torch.randint(-127, 128, s, dtype=torch.int8, generator=gen) for s in shapes]

    def twin():
        ps = [torch.nn.Parameter(w.clone()) for w in init]
        sts = [dict(exp_avg=m.clone(), exp_avg_sq=v.clone(), **(dict(param_correction=e.clone()) if corr else {}))
               for m, v, e in zip(m0, v0, e0)]
        return ps, sts

    (ref, rst), (ker, kst) = twin(), twin()
    for t in (1, 2, 3):
        us = [torch.rand(p.numel(), generator=gen) for p in ref]
        for a, b in zip(ref, ker):
            a.grad_dtype = b.grad_dtype = None
            a.grad = (torch.randn(a.shape, generator=gen) * 1e-2).to(gdtype)
            b.grad = a.grad.clone()
        with torch.no_grad():
            for a, st, u in zip(ref, rst, us):
                adamw_step_torch(a, a.grad, st, 1e-2, 0.9, 0.95, 1e-8, 0.1, t, rule, 0, u if rule == "sr" else None)
            adamw_step_triton([(b, st, j + 1) for j, (b, st) in enumerate(zip(ker, kst))], 1e-2, 0.9, 0.95,
                                1e-8, 0.1, t, rule, 5, {}, us if rule == "sr" else None)
        for a, b, sa, sb in zip(ref, ker, rst, kst):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), (t, tuple(a.shape))
            assert all(torch.equal(sa[k], sb[k]) for k in sa), (t, tuple(a.shape))
    if rule == "sr":
        (sr, sst), (rtn, rst) = twin(), twin()
        for a, b in zip(sr, rtn):
            a.grad = b.grad = torch.randn(a.shape, generator=gen).to(gdtype)
        with torch.no_grad():
            adamw_step_triton([(p, st, 1) for p, st in zip(sr, sst)], 1e-3, 0.9, 0.95, 1e-8, 0.1, 1, "sr", 5, {})
            adamw_step_triton([(p, st, 1) for p, st in zip(rtn, rst)], 1e-3, 0.9, 0.95, 1e-8, 0.1, 1, "rtn", 5, {})
        d = torch.cat([(a.view(torch.int16).int() - b.view(torch.int16).int()).abs().flatten() for a, b in zip(sr, rtn)])
        assert d.max() == 1 and 0.05 < (d > 0).float().mean() < 0.95


def test_bf16_master_weights_track_fp32_far_better_than_rtn():
    """Updates of ~lr = 1e-3 on weights ~4 (half a BF16 ulp: 0.0156) over 200 steps, against the
    FP32-parameter run (reference step): BF16 RTN loses every update (relative RMS error of the
    weight change ~1), SR is unbiased (mean error within 5 standard errors of its ~0.06-per-weight
    noise, 4096 weights) but noisy (< 0.5), and the 24-bit master weight (resolution 1.2e-4)
    tracks it within 0.06."""
    gen = torch.Generator().manual_seed(35)
    w0 = torch.randn(4096, generator=gen) + 4
    grads = [torch.randn(4096, generator=gen) * 0.1 + 1 for _ in range(200)]
    out = {}
    for name, dtype, kw in (("fp32", torch.float32, {}), ("rtn", torch.bfloat16, {}),
                            ("sr", torch.bfloat16, dict(param_rounding="sr")),
                            ("mw24", torch.bfloat16, dict(master_weight_bits=24))):
        p = torch.nn.Parameter(w0.clone().to(dtype))
        o = A.AdamW4bit([p], lr=1e-3, weight_decay=0.0, preset="torchao", impl="torch", **kw)
        for gr in grads:
            p.grad = gr.to(dtype)
            o.step()
        out[name] = read_param(p, o.state[p].get("param_correction")) - w0.to(dtype).float()
    err = {k: ((out[k] - out["fp32"]).norm() / out["fp32"].norm()).item() for k in ("rtn", "sr", "mw24")}
    assert err["rtn"] > 0.9 and err["sr"] < 0.5 and err["mw24"] < 0.06, err
    assert abs((out["sr"] - out["fp32"]).mean()) < 5 * 0.06 / 4096 ** 0.5


def test_bf16_options_state_dict_nbytes_and_errors():
    """master_weight_bits=24 adds 1 B/param (state_nbytes: 2.0625 on a 4-bit-state BF16 tensor),
    the correction survives state_dict round trips, and a checkpoint of another param_rounding /
    master_weight_bits is refused; bad values name the argument; FP16 with SR is a TypeError."""
    p = torch.nn.Parameter(torch.randn(8192).bfloat16())
    o = A.AdamW4bit([p], preset="zipsr", master_weight_bits=24, impl="torch")
    p.grad = torch.randn(8192).bfloat16()
    o.step()
    assert o.state_nbytes() == 8192 * (1 + 1.0625)
    q = torch.nn.Parameter(p.detach().clone())
    o2 = A.AdamW4bit([q], preset="zipsr", master_weight_bits=24, impl="torch")
    o2.load_state_dict(o.state_dict())
    assert torch.equal(o2.state[q]["param_correction"], o.state[p]["param_correction"])
    with pytest.raises(ValueError, match="master_weight_bits"):
        A.AdamW4bit([q], preset="zipsr", impl="torch").load_state_dict(o.state_dict())
    # a BF16 weight's residual is refused by an FP32 parameter; an FP32-parameter state starts a
    # BF16 parameter's residual at 0
    q32 = torch.nn.Parameter(p.detach().float())
    with pytest.raises(ValueError, match="param_correction .*torch.float32"):
        A.AdamW4bit([q32], preset="zipsr", master_weight_bits=24, impl="torch").load_state_dict(o.state_dict())
    o32 = A.AdamW4bit([q32], preset="zipsr", master_weight_bits=24, impl="torch")
    q32.grad = torch.randn(8192)
    o32.step()
    o3 = A.AdamW4bit([q], preset="zipsr", master_weight_bits=24, impl="torch")
    o3.load_state_dict(o32.state_dict())
    assert torch.equal(o3.state[q]["param_correction"], torch.zeros(8192, dtype=torch.int8))
    with pytest.raises(ValueError, match="master_weight_bits must be one of"):
        A.AdamW4bit([q], master_weight_bits=24.0)
    with pytest.raises(ValueError, match="param_rounding must be one of"):
        A.AdamW4bit([q], param_rounding="stochastic")
    with pytest.raises(ValueError, match="master_weight_bits must be one of"):
        A.AdamW4bit([q], master_weight_bits=16)
    with pytest.raises(ValueError, match="param_rounding='rtn'"):
        A.AdamW4bit([q], param_rounding="sr", master_weight_bits=24)
    with pytest.raises(TypeError, match="float16"):
        A.AdamW4bit([torch.nn.Parameter(torch.zeros(8, dtype=torch.float16))], param_rounding="sr")
    # FP32-state (small) BF16 tensors get the correction too, on the reference loop
    b = torch.nn.Parameter(torch.randn(100).bfloat16() + 4)
    ob = A.AdamW4bit([b], lr=1e-3, preset="zipsr", master_weight_bits=24, weight_decay=0.0)
    b0 = b.detach().float().clone()
    for _ in range(20):
        b.grad = torch.ones(100).bfloat16()
        ob.step()
    moved = read_param(b, ob.state[b]["param_correction"]) - b0
    assert torch.allclose(moved, torch.full((100,), -20e-3), rtol=0.1)   # RTN alone: 0 (< ulp/2)



@needs_compiled
@needs_cuda
def test_gpu_16bit_params_bit_identical_to_reference():
    """On CUDA the step with BF16 / FP16 parameters (RTN presets, the 24-bit master weight) gives
    the CPU reference's weights, states and param_correction bit for bit over 4 steps, the
    4-bit-state tensors (fused 4-bit kernel) and the FP32-state ones (adamw_fp32_kernel) alike; FP32
    parameters with FP32 states (torch's fused AdamW) are within 1e-5 relative; param_rounding='sr'
    keeps every weight within one BF16 ulp of the RTN write."""
    gen = torch.Generator().manual_seed(40)
    shapes = [(4096,), (33, 384), (1000, 128 * 3), (77, 1024), (100,), (33, 3)]
    for dtype, kw in ((torch.bfloat16, dict(preset="torchao")), (torch.bfloat16, dict(preset="zeeden")),
                      (torch.float16, dict(preset="zipsr", v_rounding="update-rtn")),
                      (torch.bfloat16, dict(preset="zeeden", master_weight_bits=24)),
                      (torch.bfloat16, dict(preset="fp32"))):
        cpu = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
        gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
        o_c = A.AdamW4bit(cpu, impl="torch", lr=1e-2, **kw)
        o_g = A.AdamW4bit(gpu, impl="triton", lr=1e-2, **kw)
        for _ in range(4):
            for a, b in zip(cpu, gpu):
                gr = (torch.randn(a.shape, generator=gen) * 1e-2).to(dtype)
                a.grad, b.grad = gr.clone(), gr.cuda()
            o_c.step()
            o_g.step()
        for a, b in zip(cpu, gpu):
            assert torch.equal(a, b.cpu()), (dtype, kw, tuple(a.shape))
            for k in o_c.state[a].keys() - {"step"}:
                assert torch.equal(o_c.state[a][k], o_g.state[b][k].cpu()), (dtype, kw, tuple(a.shape), k)
    # FP32 parameters with FP32 states: torch's fused AdamW, any shape
    cpu = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((33, 3), (100,), (64, 64))]
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    o_c, o_g = (A.AdamW4bit(ps, lr=1e-2, preset="fp32") for ps in (cpu, gpu))
    for _ in range(3):
        for a, b in zip(cpu, gpu):
            gr = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = gr.clone(), gr.cuda()
        o_c.step()
        o_g.step()
    for a, b in zip(cpu, gpu):   # one rounding of the lr 1e-2 update's size, or 1e-5 relative
        assert torch.allclose(a, b.cpu(), rtol=1e-5, atol=1e-8)
    p = torch.nn.Parameter(torch.randn(1 << 20, device="cuda").bfloat16())
    q = torch.nn.Parameter(p.detach().clone())
    o_sr = A.AdamW4bit([p], lr=1e-3, preset="torchao", param_rounding="sr")
    o_rtn = A.AdamW4bit([q], lr=1e-3, preset="torchao")
    p.grad = torch.randn(1 << 20, device="cuda").bfloat16()
    q.grad = p.grad.clone()
    o_sr.step()
    o_rtn.step()
    d = (p.view(torch.int16).int() - q.view(torch.int16).int()).abs()
    assert d.max() == 1 and 0.05 < (d > 0).float().mean() < 0.95

# ---------------------------------------------------------------------------------------------
# step()'s recorded plan: replayed while nothing it depends on changed, rebuilt otherwise

def test_step_plan_is_rebuilt_on_every_change_and_matches_an_uncached_step(monkeypatch):
    # X keeps its plan; Y drops it before each step (every step then takes the full path, as a
    # fresh optimizer's first step does). The FP32-state tensors take the fused-AdamW branch
    # (torch's fused AdamW runs on CPU too), whose flat BF16 copy the plan keeps views of.
    monkeypatch.setattr(A, "FUSED_ADAMW_DEVICES", ("cuda", "cpu"))
    gen = torch.Generator().manual_seed(0)
    shapes = [(32, 128), (4096,), (96,), (8, 8)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    xs, ys = ([torch.nn.Parameter(w.clone()) for w in init] for _ in range(2))
    extra = torch.randn(4096, generator=gen)
    kw = dict(lr=1e-2, preset="zipsr", impl="triton", param_rounding="sr")
    ox, oy = A.AdamW4bit(xs, **kw), A.AdamW4bit(ys, **kw)
    keep = []     # old gradients stay alive, so new ones get other addresses

    def step(none=(), replay=False):
        plan = ox._plan
        for j, (x, y) in enumerate(zip(ox._params(), oy._params())):
            g = torch.randn(x.shape, generator=gen).to(x.dtype)
            keep.append(x.grad)
            x.grad, y.grad = (None, None) if j in none else (g.clone(), g.clone())
        ox.step()
        oy._plan = None
        oy.step()
        assert (ox._plan is plan) == replay and ox._plan is not None
        for x, y in zip(ox._params(), oy._params()):
            assert torch.equal(x, y)
            sx, sy = ox.state[x], oy.state[y]
            assert sx.keys() == sy.keys() and sx["step"] == sy["step"]
            assert all(torch.equal(sx[k], sy[k]) for k in sx if k != "step")

    def replayed_with_same_grads():
        plan = ox._plan
        for x, y in zip(ox._params(), oy._params()):   # same addresses: only the steps move
            if x.grad is not None:
                x.grad.normal_(generator=gen)
                y.grad.copy_(x.grad)
        ox.step()
        oy._plan = None
        oy.step()
        assert ox._plan is plan      # replayed, not rebuilt
        for x, y in zip(ox._params(), oy._params()):
            assert torch.equal(x, y)

    step()
    step(replay=True)                # gradients re-allocated: the launch tables are repointed
    replayed_with_same_grads()
    step(none=(1, 2))                # a quantized and an FP32-state gradient become None
    step()
    sd = copy.deepcopy(ox.state_dict())
    ox.add_param_group(dict(params=[torch.nn.Parameter(extra.clone())]))
    oy.add_param_group(dict(params=[torch.nn.Parameter(extra.clone())]))
    step()
    for x, y in zip(ox._params()[::2], oy._params()[::2]):   # quantized, FP32-state and new ones
        x.data, y.data = x.data.bfloat16(), y.data.bfloat16()
    step()
    ox2, oy2 = (A.AdamW4bit([torch.nn.Parameter(w.clone()) for w in init], **kw) for _ in range(2))
    ox2.load_state_dict(sd)
    oy2.load_state_dict(sd)
    ox, oy = ox2, oy2
    step()
    replayed_with_same_grads()
    ox.load_state_dict(sd)           # the same optimizer: its states are replaced
    oy.load_state_dict(sd)
    step()


# ---------------------------------------------------------------------------------------------
# capturable=True: step counters and lr on the device, the step as a CUDA graph

def test_capturable_step_equals_host_step(monkeypatch):
    """capturable=True (kernels read t and lr from device memory, capturable_bias_table) gives the weights
    and states of capturable=False bit for bit over 4 steps with a changing lr, gradients that
    move and one that becomes None; its step counters are float32 tensors, and a state_dict goes
    both ways (the next steps still equal)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(50)
    shapes = [(4096,), (32, 128), (100,)]
    for dtype, kw in ((torch.bfloat16, dict(preset="zipsr", param_rounding="sr")), (torch.float32, dict(preset="zeeden"))):
        init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
        xs, ys = ([torch.nn.Parameter(w.clone()) for w in init] for _ in range(2))
        ox = A.AdamW4bit(xs, lr=1e-2, impl="triton", **kw)
        oy = A.AdamW4bit(ys, lr=1e-2, impl="triton", capturable=True, **kw)

        def step(i, none=()):
            for g in ox.param_groups + oy.param_groups:
                g["lr"] = 1e-2 / (i + 1)
            for j, (x, y) in enumerate(zip(xs, ys)):
                g = torch.randn(x.shape, generator=gen).to(dtype)
                x.grad, y.grad = (None, None) if j in none else (g, g.clone())
            ox.step()
            oy.step()
            for x, y in zip(xs, ys):
                assert torch.equal(x, y), (dtype, i, tuple(x.shape))
                assert all(torch.equal(ox.state[x][k], oy.state[y][k]) for k in ox.state[x] if k != "step")
                for o, q in ((ox, x), (oy, y)):
                    assert torch.is_tensor(o.state[q]["step"]) == o.capturable
                assert float(oy.state[y]["step"]) == float(ox.state[x]["step"])

        for i in range(3):
            step(i, none=(2,) if i == 1 else ())
        oy2 = A.AdamW4bit(ys, lr=1e-2, impl="triton", **kw)      # capturable state -> host steps
        oy2.load_state_dict(oy.state_dict())
        oy, ox2 = oy2, A.AdamW4bit(xs, lr=1e-2, impl="triton", capturable=True, **kw)
        ox2.load_state_dict(ox.state_dict())                      # host state -> capturable
        ox = ox2
        step(3)
    with pytest.raises(TypeError, match="capturable must be a bool"):
        A.AdamW4bit(xs, capturable=1)


def test_bias_table_rows_are_the_host_values_until_both_reach_one():
    """capturable_bias_table row t holds (1 - b1^t, 1/sqrt(1 - b2^t)) as the host computes them, row 0 the
    weight decay, and its last row is the first where both are exactly 1."""
    tab = capturable_bias_table(0.9, 0.95, 0.1)
    assert tab[0].tolist() == [0.1, 0.0] and tab[-1].tolist() == [1.0, 1.0]
    for t in (1, 2, 17, tab.shape[0] - 2):
        assert tab[t].tolist() == [1 - 0.9 ** t, 1 / math.sqrt(1 - 0.95 ** t)]
    assert tab[-2].tolist() != [1.0, 1.0] and 1 - 0.95 ** (tab.shape[0] - 1) == 1.0
    with pytest.raises(ValueError, match="too close to 1"):
        capturable_bias_table(0.9, 1 - 1e-9, 0.0)


def test_state_follows_parameter_casts_and_gradient_dtypes(monkeypatch):
    """A recorded step plan notices a gradient of another dtype at the old one's address; a
    parameter cast away from BF16 after steps with master_weight_bits=24 takes the 24-bit master
    weight as its value (both impls alike), one cast to BF16 gets a zero correction; a loaded
    non-contiguous state is made contiguous (the kernel equals the reference); float64
    parameters and integer gradients are refused, naming the dtype."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(52)
    p = torch.nn.Parameter(torch.randn(64, 64, generator=gen).bfloat16())
    p.grad_dtype = None
    o = A.AdamW4bit([p], impl="triton", preset="torchao")
    for _ in range(2):
        p.grad = torch.randn(64, 64, generator=gen).bfloat16()
        o.step()
    plan = o._plan
    p.grad = torch.randn(64, 64, generator=gen)   # FP32 now, maybe at the old gradient's address
    o.step()
    assert o._plan is not plan and torch.isfinite(p).all()
    for impl in ("torch", "triton"):
        q = torch.nn.Parameter(torch.randn(64, 64, generator=gen).bfloat16())
        o = A.AdamW4bit([q], impl=impl, preset="torchao", master_weight_bits=24, lr=1e-2)
        q.grad = torch.randn(64, 64, generator=gen).bfloat16()
        o.step()
        master = read_param(q, o.state[q]["param_correction"])
        q.data = q.data.float()
        o.param_groups[0]["lr"] = 0.0
        for _ in range(2):
            q.grad = torch.zeros(64, 64)
            o.step()
        assert torch.equal(q.detach(), master) and "param_correction" not in o.state[q], impl
        q.data = q.data.bfloat16()
        q.grad = torch.zeros(64, 64).bfloat16()
        o.step()
        assert o.state[q]["param_correction"].abs().sum() == 0
    ref, ker = (torch.nn.Parameter(torch.randn(32, 128, generator=gen).bfloat16()) for _ in range(2))
    ker.data.copy_(ref.data)
    sts = []
    for impl, w in (("torch", ref), ("triton", ker)):
        o = A.AdamW4bit([w], impl=impl, preset="torchao", master_weight_bits=24, lr=1e-2)
        src = A.AdamW4bit([torch.nn.Parameter(w.detach().t().contiguous().t())], impl="torch",
                          preset="torchao", master_weight_bits=24)
        src.param_groups[0]["params"][0].grad = torch.ones(128, 32).bfloat16().t()
        src.step()
        o.load_state_dict(src.state_dict())
        w.grad = torch.ones(32, 128).bfloat16()
        o.step()
        sts.append(o.state[w])
    assert torch.equal(ref, ker) and torch.equal(sts[0]["param_correction"], sts[1]["param_correction"])
    with pytest.raises(TypeError, match="float64"):
        A.AdamW4bit([torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))])
    s = torch.nn.Parameter(torch.zeros(4))
    o = A.AdamW4bit([s])
    s.grad_dtype = None
    s.grad = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(TypeError, match="gradient of parameter 1 .*int32"):
        o.step()


@needs_cuda
def test_gpu_capturable_step_as_cuda_graph():
    """On CUDA, capturable=True replays the step as its own CUDA graph (captured again when the
    gradients move) and equals capturable=False bit for bit with BF16 parameters (every tensor on
    our kernels) and on the 4-bit tensors with FP32 ones (the FP32-state ones: torch's fused AdamW
    with a float32 lr tensor, to 1e-6); a step captured by the caller (lr a CUDA tensor updated
    in place, gradients copied in place) replays to the same weights."""
    gen = torch.Generator(device="cuda").manual_seed(51)
    shapes = [(4096,), (256, 384), (100,), (33, 3)]
    for dtype in (torch.bfloat16, torch.float32):
        init = [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in shapes]
        ps = [[torch.nn.Parameter(w.clone()) for w in init] for _ in range(3)]
        lr_t = torch.tensor(1e-2, dtype=torch.float64, device="cuda")
        opts = [A.AdamW4bit(ps[0], lr=1e-2, preset="zipsr"), A.AdamW4bit(ps[1], lr=1e-2, preset="zipsr", capturable=True),
                A.AdamW4bit(ps[2], lr=lr_t, preset="zipsr", capturable=True)]
        graph = None
        for i in range(6):
            lr = 1e-2 / (i + 1)
            grads = [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in shapes]
            for o, group in zip(opts[:2], ps[:2]):
                o.param_groups[0]["lr"] = lr
                for p, g in zip(group, grads):
                    p.grad = g.clone() if i % 3 == 0 or p.grad is None else p.grad.copy_(g)
            lr_t.fill_(lr)
            for p, g in zip(ps[2], grads):
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
            opts[0].step()
            opts[1].step()
            if i == 0:
                opts[2].step()                       # recorded outside capture
            else:
                if graph is None:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        opts[2].step()
                graph.replay()
            for a, b, c in zip(*ps):
                if dtype == torch.bfloat16 or a.numel() >= 4096:
                    assert torch.equal(a, b) and torch.equal(a, c), (dtype, i, tuple(a.shape))
                else:
                    assert torch.allclose(a, b, rtol=1e-6, atol=1e-9) and torch.allclose(a, c, rtol=1e-6, atol=1e-9)
        assert opts[1]._plan["graph"] is not None
        assert float(opts[2].state[ps[2][0]]["step"]) == 6



@pytest.mark.parametrize("preset", ["zipsr", "torchao"])
def test_deepcopy_and_pickle_give_an_optimizer_with_the_same_next_steps(preset):
    """copy.deepcopy and torch.save/pickle (snapshots, EMA tooling, multiprocessing) keep the preset
    configuration, seed, impl, progress and LM-head mark: the copy's next steps are the original's
    bit for bit (ZIP-SR's SR bits depend on the seed, the LM head's m rounding on the mark)."""
    torch.manual_seed(0)
    model = GPT(preset_config("nano", vocab_size=256))
    opt = A.AdamW4bit(model.parameters(), lr=1e-3, preset=preset, seed=3, impl="triton")
    opt.mark_lm_head(model.lm_head.weight)
    opt.set_progress(0.95)

    def steps(m, o, n):
        gen = torch.Generator().manual_seed(5)
        for _ in range(n):
            x = torch.randint(0, 256, (2, 32), generator=gen)
            m(x, x)[1].backward()
            o.step()
            o.zero_grad()
        return [p.detach().clone() for p in m.parameters()]

    steps(model, opt, 1)
    copied = copy.deepcopy((model, opt))
    buf = io.BytesIO()
    torch.save((model, opt), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    want = steps(model, opt, 2)
    for m, o in (copied, loaded):
        assert (o.seed, o.impl, o.progress, o.qcfg) == (opt.seed, opt.impl, opt.progress, opt.qcfg)
        assert o.m_rounding_for(m.lm_head.weight) == opt.m_rounding_for(model.lm_head.weight)
        assert all(torch.equal(a, b) for a, b in zip(steps(m, o, 2), want))


@pytest.mark.parametrize("key, value", [("maximize", True), ("amsgrad", True), ("differentiable", True),
                                        ("decoupled_weight_decay", False)])
def test_group_keys_that_change_the_math_are_refused(key, value):
    """Groups taken from torch's optimizers carry these keys; AdamW4bit implements only AdamW's
    value of each, so another value is a one-line error naming the key (at construction, and
    when set later, before the step)."""
    p = torch.nn.Parameter(torch.zeros(4096))
    with pytest.raises(ValueError, match=rf"^param group 0: {key}={value} is not supported: AdamW4bit implements {key}="):
        A.AdamW4bit([dict(params=[p], weight_decay=0.1, **{key: value})])
    A.AdamW4bit(torch.optim.AdamW([p]).param_groups)        # torch AdamW's own values pass
    opt = A.AdamW4bit([p])
    opt.param_groups[0][key] = value
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=rf"{key}={value} is not supported"):
        opt.step()
    assert torch.equal(p, torch.zeros(4096))                  # nothing stepped


def test_another_optimizers_state_dict_is_refused_saying_what_it_holds():
    """Migrating from torch's AdamW (or TorchAO's / bitsandbytes' 4-bit and 8-bit ones): their state
    dicts cannot become 4-bit codes of ours; the error says what it got and what to do."""
    p = torch.nn.Parameter(torch.randn(64, 128))
    p.grad = torch.randn_like(p)
    theirs = torch.optim.AdamW([p])
    theirs.step()
    with pytest.raises(ValueError, match=r"another optimizer's \(its per-parameter states: step \(float32\), "
                                         r"exp_avg \(float32\), exp_avg_sq \(float32\)\): AdamW4bit loads only its "
                                         r"own state_dict\(\); to move from that optimizer, load the model's weights"):
        A.AdamW4bit([p]).load_state_dict(theirs.state_dict())


def test_adam_groups_without_weight_decay_are_accepted():
    """decoupled_weight_decay=False (torch's Adam) with weight_decay 0 is the same update."""
    p = torch.nn.Parameter(torch.zeros(4096))
    A.AdamW4bit(torch.optim.Adam([p]).param_groups)


# ---------------------------------------------------------------------------------------------
# step_in_backward.py and bench_capacity.py's layer-count search

@pytest.mark.parametrize("preset, pqt", [("torch", False), ("fp32", True), ("torchao", False), ("zipsr", True)])
def test_step_in_backward_gives_the_ordinary_steps_bit_for_bit(preset, pqt):
    """Each parameter stepped by its post-accumulate-grad hook (with activation checkpointing, so
    the hooks fire while later blocks are recomputed) equals the ordinary step after backward, for
    torch's AdamW, the RTN presets and ZIP-SR (its SR seeds key on the parameter's position), and
    no gradient is left after backward."""
    from lowbit import in_backward as sib
    def run(in_backward):
        torch.manual_seed(0)
        m = GPT(preset_config("nano-llama", vocab_size=256))
        if pqt:
            g.apply_pqt(m, method="gaussws", parts="all")
        m.checkpoint_blocks = in_backward
        opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) if preset == "torch"
               else A.AdamW4bit(m.parameters(), lr=1e-3, preset=preset, impl="triton"))
        if in_backward:
            sib.step_in_backward(opt)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randint(0, 256, (2, 32), generator=gen)
            m(x, x)[1].backward()
            if in_backward:
                assert all(p.grad is None for p in m.parameters())
            else:
                opt.step()
                opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in m.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def test_step_in_backward_refuses_what_it_cannot_do():
    from lowbit import in_backward as sib
    p = torch.nn.Parameter(torch.zeros(4096))
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got Linear"):
        sib.step_in_backward(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="capturable=True"):
        sib.step_in_backward(A.AdamW4bit([p], capturable=True))
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"already hold a gradient.*zero_grad"):
        sib.step_in_backward(torch.optim.AdamW([p]))


@pytest.mark.parametrize("limit", [0, 1, 2, 7, 40, 41, 150])
@pytest.mark.parametrize("guess", [1, 9, 60, 500])
def test_capacity_search_finds_the_largest_fitting_layer_count(limit, guess):
    from benchmarks import capacity as bench_capacity
    probed = []

    def fits(n):
        probed.append(n)
        return {"n": n} if n <= limit else None
    n, best = bench_capacity.search_largest(fits, guess)
    assert n == limit and best == ({"n": limit} if limit else None)
    assert len(probed) == len(set(probed)) and len(probed) <= 25


# =============================================================================================
# gaussws.py (paper A)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ODD_SHAPES = [(70, 45), (33, 100), (1, 1), (64, 96)]


def chi2_sf(x, dof):
    """Chi-square survival function for even dof (closed form)."""
    h = x / 2
    return math.exp(-h) * sum(h ** i / math.factorial(i) for i in range(dof // 2))


def chi2_stat(r, probs):
    """r: int tensor of values in probs' keys; probs: {value: probability}."""
    keys = sorted(probs)
    counts = torch.stack([(r == k).sum() for k in keys]).double().cpu()
    exp = torch.tensor([probs[k] for k in keys], dtype=torch.float64) * r.numel()
    assert counts.sum().item() == r.numel(), "values outside the support"
    return (((counts - exp) ** 2) / exp).sum().item()


def rounded_normal_probs():
    phi = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))
    p = {k: phi(2 * k + 1) - phi(2 * k - 1) for k in (-1, 0, 1)}
    p[2] = p[-2] = 1 - phi(3)   # |round(z/2)| >= 2 lumped into +-2
    return p


def eq3_float64(w, r, b_t):
    """Float64 autograd reference of eq. 3 with max_32 treated as a constant (eq. 4)."""
    m, n = w.shape
    tmax = g._tile_max_torch(w.detach()).double()
    scale = g.broadcast_tiles(tmax * torch.exp2(1 - b_t), m, n)
    return w + r.double() * scale


# ---------------------------------------------------------------------------------------------
# the noise law (eq. 10), Philox words, packing

def test_recipe_exhaustive_and_exact_law():
    """The word-parallel recipe equals the bit-by-bit recipe (noise_from_bits_reference) on all
    2^16 bit patterns, for every element slot j, and those patterns realise eq. 10 exactly."""
    bits = torch.arange(2 ** 16, dtype=torch.int64)
    lit = g.noise_from_bits_reference(bits)
    counts = torch.bincount(lit.long() + 2, minlength=5).tolist()
    assert counts == [round(g.NOISE_PROBS[k] * 2 ** 16) for k in range(-2, 3)] == [96, 9189, 46966, 9189, 96]
    assert abs(g.P1 - 0.140213) < 1e-6 and abs(g.P0 - 0.716644) < 1e-6 and abs(g.P2 - 0.0014648) < 1e-7
    # slot j of the packed word sees pattern (k + 7919·j) mod 2^16: every slot sees all patterns
    words = [torch.zeros_like(bits) for _ in range(4)]
    pats = []
    for j in range(8):
        pj = (bits + 7919 * j) % 2 ** 16
        pats.append(pj)
        nibs = (pj & 7) | (((pj >> 15) & 1) << 3), (pj >> 3) & 0xF, (pj >> 7) & 0xF, (pj >> 11) & 0xF
        for wd, nb in zip(words, nibs):
            wd |= nb << (4 * j)
    packed = g._recipe_torch(*words)
    for j in range(8):
        assert torch.equal(g.bits_of_element(*words, j), pats[j])
        nib = (packed >> (4 * j)) & 0xF
        assert torch.equal(((nib & 7) * (1 - 2 * (nib >> 3))).to(torch.int8), lit[pats[j]])


def test_kernel_chi_square_1m_draws():
    """>= 10^6 kernel draws against eq. 10 (chi-square, 4 dof, p > 1e-6); the same test rejects
    the exact rounded normal law, so it has power at this sample size."""
    m = n = 1024
    saved = dict(g.CONFIG)
    g.CONFIG["gen_block"] = 16384            # fewer interpreter programs; same kernel
    try:
        packed = g.generate_noise((m, n), torch.tensor([987654321, 3], device=DEV), impl="triton")
    finally:
        g.CONFIG.update(saved)
    r = g.unpack_noise(packed, n)
    x = chi2_stat(r, g.NOISE_PROBS)
    assert chi2_sf(x, 4) > 1e-6, x
    assert chi2_sf(chi2_stat(r, rounded_normal_probs()), 4) < 1e-12


def test_reference_chi_square_and_moments():
    r = g.unpack_noise(g.generate_noise((1024, 1024), 31337, impl="torch"), 1024).double()
    assert chi2_sf(chi2_stat(r, g.NOISE_PROBS), 4) > 1e-6
    var = 2 * g.P1 + 8 * g.P2
    se = math.sqrt(var / r.numel())
    assert abs(r.mean().item()) < 6 * se                  # unbiased PQN
    assert abs(r.var().item() - var) < 6 * math.sqrt((2 * g.P1 + 32 * g.P2 - var ** 2) / r.numel())


@pytest.mark.parametrize("method", ["gaussws", "diffq", "bm"])
def test_generate_kernel_equals_reference(method):
    seed = torch.tensor([0x5DEECE66D, 2 ** 33 + 5], device=DEV)   # counter > 32 bits
    for m, n in ODD_SHAPES + [(16, 256)]:
        a = g.generate_noise((m, n), seed, method=method, impl="torch")
        b = g.generate_noise((m, n), seed, method=method, impl="triton")
        assert a.dtype == b.dtype and a.shape == b.shape
        if method == "bm":   # transcendental functions may differ in the last bit across backends
            assert (a != b).float().mean().item() < 1e-3
        else:
            assert torch.equal(a, b), (method, m, n)


@triton.jit
def _diffq_offsets_probe(offs_ptr, mask_ptr, pid, M, N, N8, BLOCK: tl.constexpr):
    offs, mask = g._diffq_offsets(pid, M, N, N8, BLOCK)
    i = tl.arange(0, 8 * BLOCK)
    tl.store(offs_ptr + i, offs)
    tl.store(mask_ptr + i, mask.to(tl.int8))


@pytest.mark.parametrize("m,n", [(200_000_000, 9), (238_609_294, 9), (2 ** 31 - 1, 1), (34_000_000, 63)])
def test_diffq_store_offsets_past_the_int32_element_index(m, n):
    """The DiffQ kernel's store offsets (row * n + col, mask) are exact where the element index
    8 * word passes 2^31 (m * ceil(n/8) > 2^28 with n % 8 != 0, shapes the size guard accepts): the
    programs around that point and the last one, without allocating the (m, n) output."""
    block = g.CONFIG["gen_block"]
    n8 = -(-n // 8)
    edge = 2 ** 31 // (8 * block)
    last = -(-m * n8 // block) - 1
    i = np.arange(8 * block)
    assert edge < last
    for pid in sorted({edge - 1, edge, last}):
        offs = torch.empty(8 * block, dtype=torch.int64)
        mask = torch.empty(8 * block, dtype=torch.int8)
        _diffq_offsets_probe[(1,)](offs, mask, pid, m, n, n8, BLOCK=block)
        q = pid * block + i // 8                      # word index, exact in int64
        row, col = q // n8, (q % n8) * 8 + i % 8
        want = (row < m) & (col < n)
        assert np.array_equal(mask.numpy() == 1, want), pid
        got = offs.numpy()[want]
        assert np.array_equal(got, (row * n + col)[want]), pid
        assert got.min() >= 0 and got.max() < m * n, pid


def test_bm_and_diffq_laws():
    r = g.unpack_noise(g.generate_noise((512, 512), 7, method="bm", impl="torch"), 512).clamp(-2, 2)
    assert chi2_sf(chi2_stat(r, rounded_normal_probs()), 4) > 1e-6
    u = g.generate_noise((512, 512), 7, method="diffq", impl="torch")
    assert u.dtype == torch.bfloat16 and u.abs().max().item() <= 0.5
    uf = u.double()
    assert abs(uf.mean().item()) < 6 * math.sqrt(1 / 12 / u.numel())
    assert abs(uf.var().item() - 1 / 12) < 6 * math.sqrt(1 / 180 / u.numel())


def test_pack_roundtrip():
    torch.manual_seed(0)
    for m, n in ODD_SHAPES:
        r = torch.randint(-7, 8, (m, n), dtype=torch.int8)
        p = g.pack_noise(r)
        assert p.dtype == torch.int32 and p.shape == (m, -(-n // 8))
        assert torch.equal(g.unpack_noise(p, n), r)
        if n % 8 == 0:   # otherwise the last word also holds unused padding nibbles
            packed = g.generate_noise((m, n), 11)
            assert torch.equal(g.pack_noise(g.unpack_noise(packed, n)), packed)   # zero stored as +0
    # element j of a group in bits [4j, 4j+4), sign-magnitude
    r = torch.tensor([[1, -1, 2, -2, 0, 7, -7, 3]], dtype=torch.int8)
    want = sum(v << (4 * j) for j, v in enumerate([1, 9, 2, 10, 0, 7, 15, 3]))
    assert g.pack_noise(r).item() == want - 2 ** 32 * (want >= 2 ** 31)


def test_noise_correlation_across_layers_steps_and_neighbours():
    """|corr| < 6/sqrt(N) (6 standard errors of a zero correlation; N = 2^20) between two layers
    (keys from apply_pqt's seed generator), two steps of one layer, and horizontally adjacent
    elements (which share Philox words)."""
    m = n = 1024
    bound = 6 / math.sqrt(m * n)
    model = _gpt2_like()
    g.apply_pqt(model, seed=0)
    keys = [mod.noise_state[0].item() for _, mod in g.pqt_layers(model)]
    assert len(set(keys)) == len(keys)
    R = lambda key, t: g.unpack_noise(g.generate_noise((m, n), torch.tensor([key, t])), n).double().flatten()
    corr = lambda a, b: torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    a = R(keys[0], 5)
    assert abs(corr(a, R(keys[1], 5))) < bound
    assert abs(corr(a, R(keys[0], 6))) < bound
    a2 = a.view(m, n)
    assert abs(corr(a2[:, :-1].flatten(), a2[:, 1:].flatten())) < 6 / math.sqrt(m * (n - 1))
    assert abs(corr(a2[:-1].flatten(), a2[1:].flatten())) < 6 / math.sqrt((m - 1) * n)


# ---------------------------------------------------------------------------------------------
# eq. 3: apply kernel, tile maxima

@pytest.mark.parametrize("fused", [False, True])
def test_apply_kernel_bitexact(fused):
    torch.manual_seed(1)
    seed = torch.tensor([424242, 9], device=DEV)
    for m, n in ODD_SHAPES:
        for wdtype in (torch.float32, torch.bfloat16, torch.float16):
            w = torch.randn(m, n, device=DEV).to(wdtype)
            pow2 = torch.exp2(1 - (3 + 5 * torch.rand(g.tile_grid(m, n), device=DEV)))
            packed = g._generate_torch(m, n, seed, "gaussws")
            for out in (torch.bfloat16, torch.float32):
                ref = g._apply_torch(w, packed, pow2, "gaussws", out)
                ker = g.apply_triton(w, None if fused else packed, pow2, seed, "gaussws", out, fused)
                assert torch.equal(ref[0], ker[0]) and torch.equal(ref[1], ker[1]), (m, n, wdtype, out)
            assert torch.equal(g.tile_max(w, impl="triton"), g.tile_max(w, impl="torch"))


def test_diffq_apply_kernel():
    torch.manual_seed(2)
    for m, n in ODD_SHAPES:
        w = torch.randn(m, n, device=DEV)
        bt = 3 + 5 * torch.rand(g.tile_grid(m, n), device=DEV)
        noise = g.generate_noise((m, n), 5, method="diffq", device=DEV)
        a, ta = g.apply_noise(w, noise, bt, "diffq", impl="torch")
        b, tb = g.apply_noise(w, noise, bt, "diffq", impl="triton")
        assert torch.equal(ta, tb)
        # a GPU may fuse w + R·s into one FMA: then results differ by the rounding of R·s (fp32)
        # plus one BF16 rounding of the result
        rs = g.broadcast_tiles(ta * torch.exp2(1 - bt), m, n) * noise.float().abs()
        assert ((a.float() - b.float()).abs() <= a.float().abs() * 2 ** -7 + rs * 2 ** -23).all()


def test_tile_max_partial_edge_tiles():
    torch.manual_seed(3)
    w = torch.randn(70, 45)
    t = g.tile_max(w, impl="torch")
    assert t.shape == (3, 2)
    for i in range(3):
        for j in range(2):
            assert t[i, j] == w[32 * i:32 * i + 32, 32 * j:32 * j + 32].abs().max()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_transpose_tiles(impl):
    """Square tiles: the PQN of Wᵀ (same R transposed, b_tᵀ) is the transpose of W's."""
    torch.manual_seed(4)
    w = torch.randn(70, 45, device=DEV)
    bt = 3 + 5 * torch.rand(g.tile_grid(70, 45), device=DEV)
    r = g.unpack_noise(g.generate_noise((70, 45), 8, device=DEV), 45)
    a, ta = g.apply_noise(w, g.pack_noise(r), bt, impl=impl)
    b, tb = g.apply_noise(w.t(), g.pack_noise(r.t()), bt.t(), impl=impl)   # non-contiguous w is copied
    assert torch.equal(ta.t(), tb) and torch.equal(a.t(), b)
    assert torch.equal(g.tile_max(w.t(), impl=impl), g.tile_max(w, impl=impl).t())


def test_w_hat_minus_w_is_r_times_scale():
    torch.manual_seed(5)
    m, n = 70, 45
    w = torch.randn(m, n)
    bt = 3 + 5 * torch.rand(g.tile_grid(m, n))
    packed = g.generate_noise((m, n), 12)
    r = g.unpack_noise(packed, n).float()
    scale = g.broadcast_tiles(g.tile_max(w) * torch.exp2(1 - bt), m, n)
    exact = w + r * scale
    w32, _ = g.apply_noise(w, packed, bt, out_dtype=torch.float32)
    assert torch.equal(w32, exact)
    w16, _ = g.apply_noise(w, packed, bt)
    assert w16.dtype == torch.bfloat16 and torch.equal(w16, exact.to(torch.bfloat16))
    assert ((w16.float() - exact).abs() <= exact.abs() * 2 ** -8).all()   # half a bf16 ulp
    assert (r != 0).any() and (r == 0).any()


def test_max_pqn_at_bt4():
    """With b_t = 4 the largest PQN is 2 · tilemax · 2^-3, reached where |R| = 2."""
    torch.manual_seed(6)
    m = n = 256
    w = torch.zeros(m, n)
    tmax = torch.rand(8, 8) + 0.5
    w[::32, ::32] = tmax                        # one element per tile sets its max; others are 0
    packed = g.generate_noise((m, n), 99)
    r = g.unpack_noise(packed, n)
    w_hat, t = g.apply_noise(w, packed, torch.full((8, 8), 4.0), out_dtype=torch.float32)
    assert torch.equal(t, tmax)
    pqn = (w_hat - w) / g.broadcast_tiles(tmax, m, n)
    off = torch.ones(m, n, dtype=torch.bool)
    off[::32, ::32] = False
    assert torch.equal(pqn[off], r[off].float() * 0.125)
    assert pqn[off].abs().max().item() == 0.25 and (r[off].abs() == 2).any()
    assert pqn.abs().max().item() <= 0.25 + 1e-6     # the tile-max element itself is rounded


# ---------------------------------------------------------------------------------------------
# eq. 4: gradients, forward/backward consistency, seeds

@pytest.mark.parametrize("impl,method,fused", [
    ("torch", "gaussws", False), ("torch", "diffq", False),
    pytest.param("triton", "gaussws", False),
    pytest.param("triton", "gaussws", True),   # fused: GaussWS Triton only
    pytest.param("triton", "diffq", False)])
def test_grads_vs_float64_autograd(impl, method, fused):
    torch.manual_seed(7)
    for m, n in [(70, 45), (33, 100)]:
        w = torch.randn(m, n, device=DEV, requires_grad=True)
        bt = (3 + 5 * torch.rand(g.tile_grid(m, n), device=DEV)).requires_grad_()
        G = torch.randn(m, n, device=DEV)
        seed = torch.tensor([77, 1], device=DEV)
        w_hat = g.gaussws_sample(w, bt, seed, method=method, out_dtype=torch.float32, impl=impl, fused=fused)
        (w_hat * G).sum().backward()
        noise = g.generate_noise((m, n), seed, method=method, impl="torch")
        r = g.unpack_noise(noise, n) if method == "gaussws" else noise.float()
        w64 = w.detach().double().requires_grad_()
        bt64 = bt.detach().double().requires_grad_()
        ref = eq3_float64(w64, r, bt64)
        (ref * G.double()).sum().backward()
        assert torch.allclose(w_hat.double(), ref, rtol=1e-6, atol=1e-6)
        assert torch.equal(w.grad, G)                                   # dL/dw = dL/dw_hat
        assert torch.allclose(bt.grad.double(), bt64.grad, rtol=1e-4, atol=1e-5)
        # eq. 4 written out
        tmax = g._tile_max_torch(w.detach()).double()
        gr = F.pad(G.double() * r.double(), (0, -n % 32, 0, -m % 32))
        nt, mt = g.tile_grid(m, n)
        tsum = gr.view(nt, 32, mt, 32).sum(dim=(1, 3))
        eq4 = -math.log(2) * tmax * torch.exp2(1 - bt64.detach()) * tsum
        assert torch.allclose(bt.grad.double(), eq4, rtol=1e-4, atol=1e-5)


def test_bt_grad_finite_differences():
    """Gradcheck-style: central differences of L = sum((w_hat - w) · G) in b_t, odd shape."""
    torch.manual_seed(8)
    m, n = 70, 45
    w = torch.randn(m, n)
    G = torch.randn(m, n).double()
    bt = (3 + 3 * torch.rand(g.tile_grid(m, n))).requires_grad_()
    loss = lambda b: ((g.gaussws_sample(w, b, 5, out_dtype=torch.float32).double() - w.double()) * G).sum()
    loss(bt).backward()
    eps = 0.05
    for i, j in [(0, 0), (2, 1), (1, 0)]:
        d = torch.zeros_like(bt)
        d[i, j] = eps
        fd = (loss(bt.detach() + d) - loss(bt.detach() - d)).item() / (2 * eps)
        # per tile the loss is a·2^(-b): central differences are off by ~(ln2·eps)^2/6 = 2e-4 relative
        assert abs(fd - bt.grad[i, j].item()) <= 1e-3 * abs(fd) + 1e-4, (i, j, fd, bt.grad[i, j])


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("memory", ["save", "recompute"])
def test_backward_regenerates_identical_r(monkeypatch, impl, memory):
    """Every R generated for one call (forward, backward, recompute) is bit-identical."""
    seen = []
    for name in ("_generate_torch", "generate_triton"):
        orig = getattr(g, name)

        def spy(*a, _orig=orig, **k):
            out = _orig(*a, **k)
            seen.append(out.clone())
            return out
        monkeypatch.setattr(g, name, spy)
    layer = g.GaussWSLinear(45, 70, seed=3, memory=memory, impl=impl, fused=False).to(DEV)
    x = torch.randn(4, 45, device=DEV, requires_grad=True)
    layer(x).square().sum().backward()
    assert len(seen) == (2 if memory == "save" else 3)
    assert all(torch.equal(seen[0], s) for s in seen[1:])
    first = seen[0]
    seen.clear()
    layer(x).sum().backward()                                 # next call: a new R, again reused
    assert len(seen) == (2 if memory == "save" else 3) and not torch.equal(seen[0], first)
    assert all(torch.equal(seen[0], s) for s in seen[1:])


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_memory_modes_and_fused_agree(impl):
    torch.manual_seed(9)
    x = torch.randn(3, 5, 45, device=DEV)
    results = []
    for memory, fused in [("save", False), ("recompute", False), ("save", True), ("recompute", True)]:
        if fused and impl == "torch":
            continue
        torch.manual_seed(10)
        layer = g.GaussWSLinear(45, 70, seed=1, memory=memory, impl=impl, fused=fused).to(DEV)
        y = layer(x)
        y.square().sum().backward()
        results.append((y.detach(), layer.weight.grad, layer.bias.grad, layer.b_i.grad))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("memory", ["save", "recompute"])
def test_activation_checkpointing_reuses_seed(memory):
    """torch.utils.checkpoint re-runs the forward inside backward: same R, same grads, and the
    layer counter advances once per call."""
    torch.manual_seed(11)
    plain = _gpt2_like()
    ck = _gpt2_like(checkpointed=True)
    ck.load_state_dict(plain.state_dict())
    g.apply_pqt(plain, seed=4, memory=memory)
    g.apply_pqt(ck, seed=4, memory=memory)
    x = torch.randn(2, 7, 32)
    for _ in range(2):
        for mdl in (plain, ck):
            mdl.zero_grad()
            mdl(x).square().sum().backward()
        _assert_same_grads(plain, ck, rtol=1e-5, atol=1e-6)
    assert ck.blocks[0].attn.qkv.noise_state[1].item() == 2 == plain.blocks[0].attn.qkv.noise_state[1].item()


def _checkpoint_pattern(model, pattern, checkpointed, reentrant, x):
    """Loss of one of the checkpoint use patterns on _Model's block 0 and LM head."""
    run = ((lambda f, t: checkpoint.checkpoint(f, t, use_reentrant=reentrant)) if checkpointed
           else (lambda f, t: f(t)))
    b0 = model.blocks[0]
    if pattern == "twice_in_one_region":
        return model.lm_head(run(lambda t: b0(b0(t)), x)).square().sum()
    if pattern == "two_forwards_one_backward":
        return sum(model.lm_head(run(b0, t)).square().sum() for t in (x, 2 * x))
    if pattern == "nested":               # a checkpoint inside a checkpoint, each layer once
        return model.lm_head(run(lambda t: torch.tanh(run(b0, t)), x)).square().sum()
    return model.lm_head(run(b0, x)).square().sum()


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("memory", ["save", "recompute"])
@pytest.mark.parametrize("pattern", ["twice_in_one_region", "two_forwards_one_backward", "once", "nested"])
def test_checkpoint_recomputing_another_call_raises(pattern, memory, reentrant):
    """The recomputation reuses a layer's last seed: a layer called twice in one checkpointed
    region, or two checkpointed forwards before one backward, either gets the plain run's
    gradients or raises a RuntimeError naming the layer and what to do; once per region, also
    nested, must give the plain run's gradients (two steps)."""
    torch.manual_seed(17)
    plain, ck = _gpt2_like(), _gpt2_like()
    ck.load_state_dict(plain.state_dict())
    g.apply_pqt(plain, seed=4, memory=memory)
    g.apply_pqt(ck, seed=4, memory=memory)
    x = torch.randn(2, 7, 32, requires_grad=True)      # reentrant checkpoint needs an input with grad
    for _ in range(2):
        for mdl in (plain, ck):
            mdl.zero_grad()
        _checkpoint_pattern(plain, pattern, False, reentrant, x).backward()
        try:
            _checkpoint_pattern(ck, pattern, True, reentrant, x).backward()
        except RuntimeError as e:
            assert pattern not in ("once", "nested"), e
            assert re.match(r"GaussWSLinear blocks\.0\.(attn|mlp)\.\w+: torch\.utils\.checkpoint ", str(e)), e
            assert "call each GaussWSLinear once" in str(e)
            return
        _assert_same_grads(plain, ck, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# ∂L/∂b_i inside the grad kernel: autograd's bits, no autograd ops after the kernel

def _float_bits(t):
    """The bit patterns of a float32 / bfloat16 tensor (torch.equal takes -0 for +0)."""
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def _same_bits_but_zero_sign(a, b):
    """Where a and b are the same float bits, or both zero: on a GPU a tile whose sum_32(g ⊙ R)
    is a zero can give the grad kernel a zero of the other sign than the separate launch whose
    ∂L/∂2^(1−b_t) the reference is fed (seen on the H200: +0 against −0)."""
    return (_float_bits(a) == _float_bits(b)) | ((a == 0) & (b == 0))


@pytest.mark.parametrize("impl,fused", [("torch", False), ("triton", False), ("triton", True)])
def test_bits_grad_of_the_grad_kernel_is_autograds_bit_for_bit(impl, fused):
    """The grad kernel's (and its torch twin's) ∂L/∂b equals, bit for bit, autograd through
    2^(1 − clamp(b_t)) and eq. 11 applied to the same call's ∂L/∂2^(1−b_t): b = a layer's b_i
    (eq. 11 with b_init − b_target = 2, 2.2 (not a float32) and 0) or b = b_t itself, float32 and
    BF16, tiles inside, outside and at both ends of [B_MIN, B_MAX]. The sampling kernel makes b_t
    and the masked 2^(1−b_t) itself: b_t's clamp mask is `_pow2_live_torch`'s, and on a GPU its
    2^(1−b_t) is torch's bit for bit (libdevice's exp2f); under the interpreter within 1 ulp
    (numpy's exp2 against torch's CPU exp2: they differ in the last bit for ~6–15 % of inputs, by
    CPU; over all cases they must agree on most tiles). Where the two exp2 agree, ∂L/∂b is
    autograd's bit for bit (a zero's sign aside: `_same_bits_but_zero_sign`)."""
    torch.manual_seed(41)
    seed = torch.tensor([31337, 5], device=DEV)
    n_agree = n_tiles = 0
    for (m, n), (b_init, b_target), b_dtype in itertools.product(
            ODD_SHAPES, [(6.0, 4.0), (6.3, 4.1), (5.0, 5.0), (None, None)], [torch.float32, torch.bfloat16]):
        tm, tn = g.tile_grid(m, n)
        b = torch.randn(tm, tn, device=DEV) * 8 + (6.0 if b_init is None else 0.5)
        if b.numel() >= 3 and b_init != b_target:
            b.view(-1)[1] = -3.0 if b_init is None else -10.0            # a clamped tile
            if b_init != 6.3:                                            # the clamp's ends, exactly
                b.view(-1)[0], b.view(-1)[-1] = (1.0, 24.0) if b_init is None else (-1.5, 10.0)
        b = b.to(b_dtype)
        b_target_, b_scale = g._sample_bits(b_init, b_target)
        b_t, pow2 = g._tile_bits_torch(b, b_target_, b_scale)
        if b_init is not None:
            assert torch.equal(b_t, g._bitwidth(b, b_init, b_target))      # the layer's eq. 11, bit for bit
        w = torch.randn(m, n, device=DEV)
        packed = g._generate_torch(m, n, seed, "gaussws")
        gg = torch.randn(m, n, device=DEV).to(torch.bfloat16)
        bits = (None, b_scale, b_dtype)
        agree = torch.ones_like(b_t, dtype=torch.bool)       # where the kernel's exp2 is torch's
        if impl == "torch":
            _, tmax = g._apply_torch(w, packed, pow2, "gaussws", torch.bfloat16)
            live = g._pow2_live_torch(b_t, pow2)
            dw0, dpow2 = g._grad_torch(gg, packed, tmax, "gaussws", torch.float32)
            dw, db = g._grad_torch(gg, packed, tmax, "gaussws", torch.float32, (live,) + bits[1:])
        else:
            r = None if fused else packed
            w_hat, tmax, live = g.apply_triton(w, r, None, seed, "gaussws", torch.bfloat16, fused,
                                                bits=(b.contiguous(), b_target_, b_scale))
            ref = g._pow2_live_torch(b_t, pow2)
            assert torch.equal(live != 0, ref != 0)                        # the clamp mask, ends included
            ulps = (_float_bits(live) - _float_bits(ref)).abs()
            assert ulps.max() <= (0 if DEV == "cuda" else 1), ulps.max()
            agree = ulps == 0
            n_agree, n_tiles = n_agree + int(agree.sum()), n_tiles + agree.numel()
            # w_hat as the reference makes it from the kernel's own 2^(1−b_t)
            own = torch.where(live != 0, live, pow2)
            assert torch.equal(w_hat, g._apply_torch(w, packed, own, "gaussws", torch.bfloat16)[0])
            dw0, dpow2 = g.grad_triton(gg, r, tmax, seed, "gaussws", torch.float32, fused)
            dw, db = g.grad_triton(gg, r, tmax, seed, "gaussws", torch.float32, fused, bits=(live,) + bits[1:])
        leaf = b.clone().requires_grad_()
        g._pow2(leaf if b_init is None else g._bitwidth(leaf, b_init, b_target)).backward(dpow2)
        same = _same_bits_but_zero_sign(db, leaf.grad)
        assert db.dtype == b_dtype and same[agree].all(), (m, n, b_init, b_dtype, db[~same], leaf.grad[~same])
        assert _same_bits_but_zero_sign(db, g._bits_grad_torch(dpow2, live, b_scale, b_dtype)).all()
        assert torch.equal(dw, dw0) and torch.equal(dw, gg.float())
        clamped = (b_t < g.B_MIN) | (b_t > g.B_MAX)
        assert (db[clamped] == 0).all() and (live[clamped] == 0).all()
        if b.numel() >= 3 and b_init != b_target:
            assert clamped.any()
    assert impl == "torch" or n_agree > 0.6 * n_tiles, (n_agree, n_tiles)   # the bit-exact check covers most tiles


def test_kernels_compile_for_a_gpu_with_inductors_float64_scalars():
    """Inductor hands a Triton kernel's Python-float arguments over as float64 (a direct launch
    types them float32): the sampling and grad kernels must compile for a GPU both ways, with b_i
    and ∂L/∂b_i in float32 and BF16; the grad kernel rounds b_scale's float64 product to float32
    itself, and the sampling kernel adds eq. 11's terms with a rounded add (add.rn, no FMA).
    Compiled here for an sm_90 target (no GPU needed), in a process without the interpreter."""
    code = """
import sys, triton
import gaussws as g
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
for ft in ("fp32", "fp64"):
    for bd in ("fp32", "bf16"):
        sig = dict(g_ptr="*bf16", r_ptr="*bf16", tmax_ptr="*fp32", dw_ptr="*fp32", db_ptr="*" + bd,
                   seed_ptr="*i64", live_ptr="*fp32", b_scale=ft, M="i32", N="i32", N8="i32", TN="i32",
                   NOISE="constexpr", BT="constexpr", CHAIN="constexpr")
        src = ASTSource(fn=g._grad_kernel, signature=sig, constexprs=dict(NOISE=2, BT=1, CHAIN=True))
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        assert ("mul.f64" in ptx) == (ft == "fp64"), (ft, bd)
        sig = dict(w_ptr="*fp32", r_ptr="*fp32", pow2_ptr="*fp32", out_ptr="*bf16", tmax_ptr="*fp32",
                   seed_ptr="*i64", b_ptr="*" + bd, live_ptr="*fp32", b_target=ft, b_scale=ft, M="i32",
                   N="i32", N8="i32", TN="i32", NOISE="constexpr", BT="constexpr", BITS="constexpr",
                   B_LO="constexpr", B_HI="constexpr", INTERPRET="constexpr")
        src = ASTSource(fn=g._apply_kernel, signature=sig, constexprs=dict(NOISE=2, BT=1, BITS=True, B_LO=g.B_MIN,
                                                                             B_HI=g.B_MAX, INTERPRET=False))
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        assert "add.rn.f32" in ptx or "add.rn.ftz.f32" in ptx, (ft, bd)
        print(ft, bd, "compiled")
"""
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.abspath(__file__)), env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("compiled") == 4


@pytest.mark.parametrize("memory", ["save", "recompute"])
def test_eager_backward_runs_no_op_on_the_tile_grid_but_the_grad_kernel(memory):
    """An eager layer's backward gets ∂L/∂b_i from the grad kernel as it is: no aten op outside
    the kernel launches writes a tensor of the tile grid's shape but allocations (the autograd ops
    of 2^(1−b_t) and eq. 11 were 9 launches, and a zero-filled gradient of the tile maxima one
    more)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction
    torch.manual_seed(42)
    layer = g.GaussWSLinear(45, 70, seed=3, impl="triton", memory=memory)
    x = torch.randn(5, 45)
    loss = layer(x).square().sum()
    tiles, seen, inside = g.tile_grid(70, 45), [], [0]
    run = InterpretedFunction.run

    def launch(self, *a, **k):                  # the interpreter's own tensor copies do not count
        inside[0] += 1
        try:
            return run(self, *a, **k)
        finally:
            inside[0] -= 1

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not inside[0] and isinstance(out, torch.Tensor) and tuple(out.shape) == tiles:
                seen.append(func.overloadpacket.__name__)
            return out
    InterpretedFunction.run = launch
    try:
        with Ops():
            loss.backward()
    finally:
        InterpretedFunction.run = run
    # ∂L/∂b_i; "recompute" also the rebuilt sample's tile maxima and masked 2^(1−b_t)
    assert set(seen) <= {"empty", "detach"} and seen.count("empty") == (1 if memory == "save" else 3), seen
    assert layer.b_i.grad is not None and (layer.b_i.grad != 0).all()


# ---------------------------------------------------------------------------------------------
# the layer and apply_pqt

class _Block(nn.Module):
    def __init__(self, d=32, llama=False):
        super().__init__()
        self.attn, self.mlp = nn.Module(), nn.Module()
        if llama:
            self.attn.q, self.attn.k, self.attn.v = nn.Linear(d, d, False), nn.Linear(d, d // 2, False), nn.Linear(d, d // 2, False)
            self.mlp.gate = nn.Linear(d, 3 * d, False)
        else:
            self.attn.qkv = nn.Linear(d, 3 * d)
        self.attn.out = nn.Linear(d, d)
        self.mlp.up, self.mlp.down = nn.Linear(d, 3 * d), nn.Linear(3 * d, d)
        self.norm = nn.LayerNorm(d)
        self.llama = llama

    def forward(self, x):
        a = self.attn
        h = torch.cat([a.q(x), a.k(x), a.v(x)], -1) if self.llama else a.qkv(x)
        x = x + a.out(h[..., :x.shape[-1]])
        u = self.mlp.up(self.norm(x))
        if self.llama:
            u = F.silu(self.mlp.gate(x)) * u
        return x + self.mlp.down(F.gelu(u))


class _Model(nn.Module):
    def __init__(self, llama=False, checkpointed=False, n_layer=2):
        super().__init__()
        self.wte = nn.Embedding(50, 32)
        self.blocks = nn.ModuleList([_Block(llama=llama) for _ in range(n_layer)])
        self.lm_head = nn.Linear(32, 50, bias=False)
        self.checkpointed = checkpointed

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint.checkpoint(b, x, use_reentrant=False) if self.checkpointed else b(x)
        return self.lm_head(x)


def _assert_same_grads(a, b, **tol):
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        if p.grad is None:               # e.g. the unused embedding
            assert q.grad is None, n
        else:
            assert torch.allclose(p.grad, q.grad, **tol), n


def _gpt2_like(checkpointed=False, n_layer=2):
    return _Model(checkpointed=checkpointed, n_layer=n_layer)


def test_apply_pqt_parts_and_untouched_modules():
    m = _gpt2_like()
    w_qkv, head, wte = m.blocks[0].attn.qkv.weight, m.lm_head, m.wte
    names = g.apply_pqt(m, parts="all")
    assert names == [f"blocks.{i}.{p}" for i in range(2) for p in ("attn.qkv", "attn.out", "mlp.up", "mlp.down")]
    assert m.blocks[0].attn.qkv.weight is w_qkv and m.lm_head is head and m.wte is wte
    assert type(m.lm_head) is nn.Linear
    assert m.blocks[1].mlp.down.b_i.shape == (1, 3) and m.blocks[0].attn.qkv.b_i.shape == (3, 1)
    assert torch.all(m.blocks[0].attn.qkv.b_t == 6.0)
    assert g.apply_pqt(_gpt2_like(), parts="od") == ["blocks.0.attn.out", "blocks.0.mlp.down", "blocks.1.attn.out", "blocks.1.mlp.down"]
    assert g.apply_pqt(_gpt2_like(), parts="qkv, up") == ["blocks.0.attn.qkv", "blocks.0.mlp.up", "blocks.1.attn.qkv", "blocks.1.mlp.up"]
    ll = _Model(llama=True)
    names = g.apply_pqt(ll, parts="all", method="diffq", memory="recompute")
    assert len(names) == 14 and all(m.method == "diffq" and m.memory == "recompute" for _, m in g.pqt_layers(ll))
    assert g.apply_pqt(_Model(llama=True), parts="gate,k") == ["blocks.0.attn.k", "blocks.0.mlp.gate", "blocks.1.attn.k", "blocks.1.mlp.gate"]
    # same seed -> same layer keys; another seed -> other keys
    k = lambda s: [l.noise_state[0].item() for _, l in g.pqt_layers(_apply(s))]
    assert k(1) == k(1) and not set(k(1)) & set(k(2))


def _apply(seed):
    m = _gpt2_like()
    g.apply_pqt(m, seed=seed)
    return m


def test_layer_train_eval_and_counter():
    torch.manual_seed(12)
    lin = nn.Linear(45, 70)
    layer = g.GaussWSLinear(45, 70)
    layer.load_state_dict(lin.state_dict(), strict=False)
    x = torch.randn(6, 45)
    layer.eval()
    assert torch.equal(layer(x), lin(x)) and layer.noise_state[1].item() == 0
    layer.train()
    y1, y2 = layer(x), layer(x)
    assert layer.noise_state[1].item() == 2
    assert not torch.allclose(y1, y2) and not torch.allclose(y1, lin(x))
    layer.sample_in_eval = True
    layer.eval()
    assert torch.equal(layer(x), layer(x)) and layer.noise_state[1].item() == 2


def test_autocast_bf16_layer():
    torch.manual_seed(13)
    for memory in ("save", "recompute"):
        layer = g.GaussWSLinear(64, 96, memory=memory)
        x = torch.randn(4, 64, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        assert y.dtype == torch.bfloat16
        y.float().sum().backward()
        assert layer.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
        assert layer.b_i.grad is not None and layer.b_i.grad.abs().sum() > 0


def test_state_dict_round_trip_resumes_noise():
    torch.manual_seed(14)
    a = _gpt2_like()
    g.apply_pqt(a, seed=21)
    x = torch.randn(2, 3, 32)
    a(x)
    a(x)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    assert any(k.endswith("noise_state") for k in a.state_dict())
    cont = [a(x) for _ in range(2)]
    b = _gpt2_like()
    g.apply_pqt(b, seed=999)                  # different seed: state_dict must override it
    buf.seek(0)
    b.load_state_dict(torch.load(buf))
    resumed = [b(x) for _ in range(2)]
    assert all(torch.equal(p, q) for p, q in zip(cont, resumed))
    assert not torch.equal(cont[0], cont[1])


def test_layer_reset_parameters_after_meta_init():
    """A GaussWSLinear made on the meta device trains there as nn.Linear does (shapes only), and
    after to_empty and reset_parameters: b_i = 1 and noise_state = [key, 0] as at construction
    (also after training calls), weight and bias as nn.Linear's init (the same torch seed, the
    same values)."""
    torch.manual_seed(18)
    ref = g.GaussWSLinear(45, 70, seed=9)
    with torch.device("meta"):
        layer = g.GaussWSLinear(45, 70, seed=9)
        y = layer(torch.randn(3, 45))             # meta has no autocast to ask about
        y.sum().backward()
    assert y.shape == (3, 70) and y.is_meta and layer.b_i.grad.shape == (3, 2)
    layer.zero_grad(set_to_none=True)
    layer.to_empty(device="cpu")
    torch.manual_seed(18)
    layer.reset_parameters()
    for name, t in ref.state_dict().items():
        assert torch.equal(layer.state_dict()[name], t), name
    layer(torch.randn(3, 45)).sum().backward()
    with torch.no_grad():
        layer.b_i.mul_(0.5)
    layer.reset_parameters()
    assert torch.equal(layer.noise_state, ref.noise_state) and layer.noise_state[1].item() == 0
    assert torch.all(layer.b_i == 1)


def test_bitwidth_penalty_and_stats():
    m = _gpt2_like()
    g.apply_pqt(m, parts="od", b_init=6, b_target=4)
    layers = dict(g.pqt_layers(m))
    assert torch.allclose(g.bitwidth_penalty(m), torch.tensor(4 * 2.0))
    down = layers["blocks.0.mlp.down"]          # in 96, out 32 -> tiles (1, 3), all full
    with torch.no_grad():
        down.b_i.copy_(torch.tensor([[0.25, 1.5, 4.0]]))   # b_t = 4.5, 7, 12
    pen = g.bitwidth_penalty(m)
    assert torch.allclose(pen, torch.tensor(3 * 2.0 + (0.5 + 3 + 8) / 3))
    pen.backward()
    assert torch.allclose(down.b_i.grad, torch.full((1, 3), 2 / 3))
    st = g.bitwidth_stats(m)
    s = st["blocks.0.mlp.down"]
    assert s["min"] == 4.5 and s["max"] == 12 and abs(s["mean"] - 23.5 / 3) < 1e-12
    assert abs(s["share_le5"] - 1 / 3) < 1e-12 and abs(s["share_le9"] - 2 / 3) < 1e-12 and s["share_le12"] == 1
    assert s["tier"] == "FP16 e5m10" and st["blocks.0.attn.out"]["tier"] == "FP12 e4m7"
    assert st["all"]["params"] == 2 * 32 * 32 + 2 * 32 * 96
    # partial edge tiles count their real size
    layer = g.GaussWSLinear(45, 33)
    with torch.no_grad():
        layer.b_i.copy_(torch.tensor([[0.0, 1.0], [1.0, 1.0]]))   # b_t = 4 for the 32x32 tile only
    holder = nn.Module()
    holder.l = layer
    s = g.bitwidth_stats(holder)["l"]
    assert s["params"] == 33 * 45 and abs(s["share_le5"] - 1024 / (33 * 45)) < 1e-12
    assert abs(s["mean"] - (4 * 1024 + 6 * (33 * 45 - 1024)) / (33 * 45)) < 1e-12
    assert [g.fp_tier(b) for b in (4, 5, 5.5, 9, 12, 13)] == ["FP8 e3m4", "FP8 e3m4", "FP12 e4m7", "FP12 e4m7", "FP16 e5m10", ">FP16"]


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("shutil").which("g++") is None,
                    reason="Inductor on CPU needs a C++ compiler")
def test_compile_inductor_matches_eager():
    """torch.compile (Inductor) of a PQT model: forward and b_i grads equal eager's (the seed
    saved for backward must not alias the advancing counter)."""
    torch.manual_seed(15)
    eager = _gpt2_like(n_layer=1)     # its 4 PQT layers: Inductor's time grows with the layers
    comp = _gpt2_like(n_layer=1)
    comp.load_state_dict(eager.state_dict())
    g.apply_pqt(eager, seed=5)
    g.apply_pqt(comp, seed=5)
    cm = torch.compile(comp)
    x = torch.randn(2, 3, 32)
    for mdl in (eager, cm):
        mdl(x).square().sum().backward()
    _assert_same_grads(eager, comp, rtol=1e-4, atol=1e-5)
    assert comp.blocks[0].attn.qkv.noise_state[1].item() == 1


def test_eager_layer_skips_op_dispatch(monkeypatch):
    """Eager forward/backward of a PQT layer calls the kernels' Python functions directly, not the
    torch.library ops (their dispatch made an eager 3B step host-bound on the GPU); the result
    equals the op path's (w_hat and both grads)."""
    torch.manual_seed(16)
    w = torch.randn(70, 45, requires_grad=True)
    b = torch.full(g.tile_grid(70, 45), 5.0, requires_grad=True)
    seed = torch.tensor([123, 4])
    via_op = torch.ops.gaussws.pqn_sample(w, b, seed, "gaussws", torch.float32, "torch", False, *g._sample_bits())[0]
    via_op.square().sum().backward()
    grads = w.grad.clone(), b.grad.clone()
    w.grad = b.grad = None

    def refuse(*a, **k):
        raise AssertionError("op dispatch in eager mode")
    for name in ("pqn_sample", "pqn_grad", "next_seed"):
        monkeypatch.setattr(torch.ops.gaussws, name, refuse)
    eager = g.gaussws_sample(w, b, seed, out_dtype=torch.float32, impl="torch")
    eager.square().sum().backward()
    assert torch.equal(eager, via_op)
    assert torch.equal(w.grad, grads[0]) and torch.equal(b.grad, grads[1])
    layer = g.GaussWSLinear(45, 70, impl="torch")
    layer(torch.randn(3, 45)).sum().backward()
    assert layer.noise_state[1].item() == 1 and layer.b_i.grad is not None
    y = torch.func.vmap(layer)(torch.randn(2, 3, 45))   # functorch over the eager Function
    assert y.shape == (2, 3, 70) and layer.noise_state[1].item() == 2


# ---------------------------------------------------------------------------------------------
# bad input

def test_bad_inputs_raise_clear_errors(monkeypatch):
    w = torch.randn(70, 45)
    bt = torch.full((3, 2), 4.0)
    with pytest.raises(ValueError, match=r"b_t has shape \(2, 2\).*\(3, 2\)"):
        g.gaussws_sample(w, torch.full((2, 2), 4.0), 0)
    with pytest.raises(ValueError, match="2-D"):
        g.gaussws_sample(w[None], bt, 0)
    with pytest.raises(TypeError, match="dtype torch.int64"):
        g.gaussws_sample(w.long(), bt, 0)
    with pytest.raises(ValueError, match="method='bogus'"):
        g.gaussws_sample(w, bt, 0, method="bogus")
    for dt in (torch.int32, "bf16"):
        with pytest.raises(TypeError, match="out_dtype=.*allowed: torch.float32, torch.bfloat16"):
            g.gaussws_sample(w, bt, 0, out_dtype=dt)
    for x in (torch.randn(3, 45).double(), torch.ones(3, 45, dtype=torch.long)):
        with pytest.raises(TypeError, match=f"x has dtype {x.dtype}; allowed: float32, bfloat16, float16"):
            g.GaussWSLinear(45, 70, impl="torch")(x)
    with pytest.raises(ValueError, match="impl='cuda'"):
        g.gaussws_sample(w, bt, 0, impl="cuda")
    with pytest.raises(ValueError, match=r"seed=-1"):
        g.gaussws_sample(w, bt, -1)
    with pytest.raises(TypeError, match="seed must be"):
        g.gaussws_sample(w, bt, 1.5)
    with pytest.raises(ValueError, match="int64 of shape"):
        g.gaussws_sample(w, bt, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="memory='disk'"):
        g.GaussWSLinear(4, 4, memory="disk")
    with pytest.raises(ValueError, match="b_init"):
        g.GaussWSLinear(4, 4, b_init=-1)
    with pytest.raises(ValueError, match="noise has shape"):
        g.apply_noise(w, torch.zeros(70, 5, dtype=torch.int32), bt)
    with pytest.raises(ValueError, match=r"x has shape \(2, 44\); w \(70, 45\) needs \(\.\.\., 45\)"):
        g.pqt_linear(torch.randn(2, 44), w, bt, None, 0)
    with pytest.raises(ValueError, match=r"x has shape \(\)"):
        g.pqt_linear(torch.tensor(1.0), w, bt, None, 0)
    with pytest.raises(TypeError, match="bias must be a torch.Tensor or None, got float"):
        g.pqt_linear(torch.randn(2, 45), w, bt, 0.0, 0)
    with pytest.raises(TypeError, match="bias has dtype torch.int64"):
        g.pqt_linear(torch.randn(2, 45), w, bt, torch.zeros(70, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="bias is on meta and the weight on cpu"):
        g.pqt_linear(torch.randn(2, 45), w, bt, torch.zeros(70, device="meta"), 0)
    with pytest.raises(ValueError, match="x is on meta and the weight on cpu"):
        g.pqt_linear(torch.randn(2, 45, device="meta"), w, bt, None, 0)
    layer = g.GaussWSLinear(45, 70, impl="torch")
    for bad in (torch.randn(3, 44), torch.randn(3, 45).double(), torch.randn(3, 45, device="meta")):
        with pytest.raises((TypeError, ValueError)):
            layer(bad)
    assert layer.noise_state[1].item() == 0      # a failed call draws no noise
    with pytest.raises(ValueError, match=r"bias has shape \(69,\); w \(70, 45\) needs \(70,\)"):
        g.pqt_linear(torch.randn(2, 45), w, bt, torch.zeros(69), 0)
    with pytest.raises(TypeError, match="out_dtype=torch.float64"):
        g.apply_noise(w, g.generate_noise(w.shape, 0), bt, out_dtype=torch.float64)
    with pytest.raises(TypeError, match="noise must be a torch.Tensor"):
        g.apply_noise(w, [[1]], bt)
    for shape in ((2.5, 3), (True, 3), ("3", 4), (3,), (0, 4)):
        with pytest.raises(ValueError, match="shape must be \\(m, n\\), two ints >= 1"):
            g.generate_noise(shape, 0)
    with pytest.raises(ValueError, match=r"unknown part\(s\) \['attn'\]"):
        g.apply_pqt(_gpt2_like(), parts="qkv,attn")
    with pytest.raises(ValueError, match="no nn.Linear named"):
        g.apply_pqt(_gpt2_like(), parts="gate")
    with pytest.raises(ValueError, match="the parts it has: none; linears without a part name: '0'; select other layers by name with modules="):
        g.apply_pqt(nn.Sequential(nn.Linear(3, 3)))
    with pytest.raises(ValueError, match="the model is itself a linear layer \\(Linear\\).*nn.Sequential"):
        g.apply_pqt(nn.Linear(3, 3))
    for impl in ("torch", "triton"):   # the same checks before either implementation
        with pytest.raises(TypeError, match="noise has dtype torch.float32; method='gaussws' needs int32"):
            g.apply_noise(w, g.generate_noise(w.shape, 0).float(), bt, impl=impl)
        with pytest.raises(TypeError, match="noise has dtype torch.int64; method='gaussws' needs int32"):
            g.apply_noise(w, g.generate_noise(w.shape, 0).long(), bt, impl=impl)
        with pytest.raises(TypeError, match="noise has dtype torch.int32; method='diffq' needs floating"):
            g.apply_noise(w, torch.zeros(70, 45, dtype=torch.int32), bt, method="diffq", impl=impl)
    with pytest.raises(ValueError, match="noise is on meta and w on cpu"):
        g.apply_noise(w, g.generate_noise(w.shape, 0).to("meta"), bt)
    with pytest.raises(ValueError, match="b_t is on meta and the weight on cpu: they must be on the same device"):
        g.gaussws_sample(w, bt.to("meta"), 0)
    with pytest.raises(ValueError, match="seed tensor is on the meta device"):
        g.gaussws_sample(w, bt, torch.zeros(2, dtype=torch.int64, device="meta"))
    with pytest.raises(ValueError, match="impl='triton' needs CUDA tensors .*got device meta"):
        g.gaussws_sample(w.to("meta"), bt.to("meta"), 0, impl="triton")
    for call in (lambda: g.gaussws_sample(w, bt, 0, fused="yes"), lambda: g.GaussWSLinear(4, 4, fused=None),
                 lambda: g.apply_pqt(_gpt2_like(), fused="no"), lambda: g.pqt_linear(w[:1], w, bt, None, 0, fused=1)):
        with pytest.raises(TypeError, match="fused=.* must be True or False"):
            call()
    layer = g.GaussWSLinear(45, 70, impl="torch").double()    # cast after construction
    with warnings.catch_warnings():
        warnings.simplefilter("error")                        # not the BF16 b_i warning
        with pytest.raises(TypeError, match=r"GaussWSLinear \(45 -> 70\): its weight is torch.float64"):
            layer(torch.randn(2, 45).double())
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        g.gaussws_sample(w, bt, 0, impl="triton")


def test_triton_impl_under_torch_compile_on_cpu_names_the_fix():
    """impl="triton" on CPU runs eagerly through the interpreter; under torch.compile the error
    says to use impl="torch" (Dynamo wraps it, the message stays)."""
    m = nn.Sequential(nn.Linear(40, 64))
    g.apply_pqt(m, modules="*", impl="triton")
    with pytest.raises(Exception, match="impl='triton' under torch.compile needs CUDA tensors; use impl='torch' on CPU"):
        torch.compile(m, backend="eager")(torch.randn(8, 40))
    assert m(torch.randn(8, 40)).shape == (8, 64)    # eager: the interpreter


def test_nan_in_a_tile_makes_its_maximum_and_w_hat_nan_in_both_implementations():
    """torch's amax propagates a NaN; the kernels' tile maximum does too (a plain tl.max would skip
    it and leave the rest of the tile finite), so both give the same NaN tile."""
    w = torch.randn(64, 70)
    w[3, 40] = float("nan")
    bt = torch.full(g.tile_grid(64, 70), 5.0)
    for fused in (False, True):
        outs = [g.gaussws_sample(w, bt, 1, impl=impl, fused=fused, out_dtype=torch.float32) for impl in ("torch", "triton")]
        for out in outs:
            assert out[:32, 32:64].isnan().all() and not out[32:].isnan().any() and not out[:, :32].isnan().any()
        assert torch.equal(outs[0].nan_to_num(), outs[1].nan_to_num())
    tm = [g.tile_max(w, impl=impl) for impl in ("torch", "triton")]
    assert tm[0][0, 1].isnan() and tm[1][0, 1].isnan() and torch.equal(tm[0].nan_to_num(), tm[1].nan_to_num())


# ---------------------------------------------------------------------------------------------
# input checks: b_init / b_target (eq. 11), parts, weights, the b_t clamp, seeds, stats

def _gpt(kind):
    torch.manual_seed(0)
    return GPT(preset_config("nano-llama" if kind == "llama" else "nano", vocab_size=64))


def _untouched(model):
    return not g.pqt_layers(model)


def test_sample_without_autocast_takes_the_bias_and_apply_noise_no_autograd():
    """Outside autocast a BF16 x with FP32 weight and bias works in both memory modes and gives
    the same output (the bias is cast to w_hat's dtype, as autocast casts it); `apply_noise`
    makes no autograd graph."""
    torch.manual_seed(3)
    w, bias = torch.randn(33, 100, requires_grad=True), torch.randn(33, requires_grad=True)
    bt = torch.full(g.tile_grid(33, 100), 5.0, requires_grad=True)
    x = torch.randn(4, 100).bfloat16()
    ys = [g.pqt_linear(x, w, bt, bias, 3, memory=mem, impl="torch") for mem in ("save", "recompute")]
    assert ys[0].dtype == torch.bfloat16 and torch.equal(ys[0], ys[1])
    ys[0].float().sum().backward()
    assert bias.grad.dtype == torch.float32 and bias.grad.abs().sum() > 0
    w_hat, tmax = g.apply_noise(w, g.generate_noise(w.shape, 0), bt, impl="torch")
    assert not w_hat.requires_grad and not tmax.requires_grad


def test_b_target_above_b_init_is_rejected_and_equal_is_fixed_bitwidth():
    with pytest.raises(ValueError, match=r"b_target=8 > b_init=4.*b_target <= b_init.*eq\. 11"):
        g.GaussWSLinear(64, 64, b_init=4, b_target=8)
    m = _gpt("gpt2")
    with pytest.raises(ValueError, match=r"b_target=6 > b_init=4"):
        g.apply_pqt(m, b_init=4, b_target=6)
    assert _untouched(m)
    for bad in (0.5, 25, float("nan"), float("inf"), True, "6"):
        with pytest.raises(ValueError, match="b_init="):
            g.GaussWSLinear(8, 8, b_init=bad, b_target=1)
    # b_init == b_target: b_t is b_target whatever b_i is, and b_i gets no gradient
    torch.manual_seed(1)
    layer = g.GaussWSLinear(45, 70, b_init=5, b_target=5)
    with torch.no_grad():
        layer.b_i.uniform_(-3, 3)
    assert torch.equal(layer.b_t, torch.full((3, 2), 5.0))
    layer(torch.randn(4, 45)).square().sum().backward()
    assert torch.equal(layer.b_i.grad, torch.zeros(3, 2)) and layer.weight.grad.abs().sum() > 0
    assert len(g.apply_pqt(_gpt("gpt2"), b_init=4, b_target=4)) == 8


def _have(msg):
    return set(re.search(r"the parts it has: ([a-z, ]+)", msg).group(1).split(", "))


@pytest.mark.parametrize("kind,parts,missing,have", [
    ("llama", "qkv,out", "qkv", {"q", "k", "v", "out", "gate", "up", "down"}),
    ("gpt2", "q,out", "q", {"qkv", "out", "up", "down"}),
    ("gpt2", "gate,k,up", "gate, k", {"qkv", "out", "up", "down"})])
def test_apply_pqt_rejects_parts_the_model_lacks(kind, parts, missing, have):
    m = _gpt(kind)
    with pytest.raises(ValueError, match=f"no nn.Linear named {missing} inside") as e:
        g.apply_pqt(m, parts=parts)
    assert _have(str(e.value)) == have
    assert _untouched(m)                      # nothing replaced, not even the parts that exist


def test_apply_pqt_all_and_od_work_for_both_model_kinds():
    for kind, n_all in (("gpt2", 4), ("llama", 7)):
        m = _gpt(kind)
        names = g.apply_pqt(m, parts="all")
        assert len(names) == 2 * n_all == len(g.pqt_layers(m))
        assert "lm_head" not in " ".join(names)
        od = g.apply_pqt(_gpt(kind), parts="od")
        assert [n.rsplit(".", 1)[-1] for n in od] == ["out", "down", "out", "down"]
        with pytest.raises(ValueError, match=r"it has: none \(already GaussWSLinear: "):
            g.apply_pqt(m, parts="all")       # applying twice names what is already replaced


def test_empty_weight_is_rejected_with_a_clear_error():
    with pytest.raises(ValueError, match="out_features=0 must be an int >= 1"):
        g.GaussWSLinear(64, 0)
    with pytest.raises(ValueError, match="in_features=0 must be an int >= 1"):
        g.GaussWSLinear(0, 64)
    with pytest.raises(ValueError, match=r"w has shape \(0, 64\): it must have at least one element"):
        g.gaussws_sample(torch.empty(0, 64), torch.empty(0, 2), 0)
    with pytest.raises(ValueError, match=r"w has shape \(5, 0\)"):
        g.apply_noise(torch.empty(5, 0), torch.empty(5, 0, dtype=torch.int32), torch.empty(1, 0))


def test_float64_is_rejected_at_construction():
    with pytest.raises(TypeError, match="float64; allowed: float32, bfloat16, float16"):
        g.GaussWSLinear(8, 8, dtype=torch.float64)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.raises(TypeError, match="float64"):
            g.GaussWSLinear(8, 8)
    finally:
        torch.set_default_dtype(old)
    m = _gpt("gpt2").double()
    with pytest.raises(TypeError, match=r"blocks\.0\.attn\.qkv\.weight has dtype torch\.float64"):
        g.apply_pqt(m)
    assert _untouched(m)
    for dt in (torch.bfloat16, torch.float16):  # the allowed low-precision dtypes still construct
        assert g.GaussWSLinear(8, 8, dtype=dt).weight.dtype == dt


def test_bt_clamped_in_sampling_with_eq4_inside_and_zero_grad_outside():
    torch.manual_seed(2)
    m, n = 70, 45                                          # tile grid (3, 2)
    w = torch.randn(m, n)
    bt_raw = torch.tensor([[-1996.0, 0.5], [1.0, 5.0], [24.0, 30.0]])
    bt = bt_raw.clone().requires_grad_()
    G = torch.randn(m, n)
    seed = torch.tensor([123, 4])
    w_hat = g.gaussws_sample(w, bt, seed, out_dtype=torch.float32, impl="torch")
    assert torch.isfinite(w_hat).all()
    (w_hat * G).sum().backward()
    r = g.unpack_noise(g.generate_noise((m, n), seed), n).double()
    tmax = g._tile_max_torch(w).double()
    b_eff = bt_raw.double().clamp(1, 24)
    ref = w.double() + r * g.broadcast_tiles(tmax * torch.exp2(1 - b_eff), m, n)   # eq. 3, clamped b_t
    assert torch.allclose(w_hat.double(), ref, rtol=1e-6, atol=1e-6)
    tsum = F.pad(G.double() * r, (0, -n % 32, 0, -m % 32)).view(3, 32, 2, 32).sum(dim=(1, 3))
    eq4 = -math.log(2) * tmax * torch.exp2(1 - b_eff) * tsum
    inside = (bt_raw >= 1) & (bt_raw <= 24)                 # the range ends count as inside
    assert torch.allclose(bt.grad.double()[inside], eq4[inside], rtol=1e-4, atol=1e-6)
    assert (eq4[inside].abs() > 0).all() and torch.equal(bt.grad[~inside], torch.zeros(3))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_layer_with_runaway_b_i_stays_finite_and_equals_clamped(impl):
    torch.manual_seed(3)
    x = torch.randn(3, 45)
    out = {}
    for b_i in (-1000.0, -1.5, 10.0, 500.0):                # b_t = -1996, 1, 24, 1004
        layer = g.GaussWSLinear(45, 70, seed=9, impl=impl)  # same seed, same init weights
        torch.manual_seed(4)
        layer.reset_parameters()
        with torch.no_grad():
            layer.b_i.fill_(b_i)
        out[b_i] = layer(x)
        assert torch.isfinite(out[b_i]).all(), b_i
    assert torch.equal(out[-1000.0], out[-1.5]) and torch.equal(out[500.0], out[10.0])
    assert not torch.equal(out[-1.5], out[10.0])


def test_penalty_pulls_clamped_tiles_back_and_stats_report_effective_bits():
    layer = g.GaussWSLinear(64, 32, b_init=6, b_target=4)   # tiles (1, 2)
    with torch.no_grad():
        layer.b_i.copy_(torch.tensor([[-1000.0, 20.0]]))    # b_t = -1996, 44
    holder = nn.Module()
    holder.l = layer
    g.bitwidth_penalty(holder).backward()
    # d/d b_i of mean |b_t - 4| = sign(b_t - 4) · 2 / 2 tiles: descent moves both toward b_target
    assert torch.equal(layer.b_i.grad, torch.tensor([[-1.0, 1.0]]))
    s = g.bitwidth_stats(holder)
    assert s["l"]["min"] == 1.0 and s["l"]["max"] == 24.0 and s["all"]["mean"] == 12.5
    assert torch.equal(layer.b_t, torch.tensor([[-1996.0, 44.0]]))   # eq. 11 itself is not clamped


@pytest.mark.parametrize("seed,err,msg", [
    (-1, ValueError, r"seed=-1 must be an int in \[0, 2\*\*63\)"),
    (2 ** 63, ValueError, r"seed=9223372036854775808"),
    (2 ** 64, ValueError, r"seed=18446744073709551616"),
    ("abc", TypeError, r"seed must be an int.*got str 'abc'"),
    (1.5, TypeError, r"got float 1\.5"),
    (True, TypeError, r"got bool True")])
def test_seed_rule_is_the_same_everywhere(seed, err, msg):
    m = _gpt("gpt2")
    with pytest.raises(err, match=msg):
        g.apply_pqt(m, seed=seed)
    assert _untouched(m)
    with pytest.raises(err, match=msg):
        g.GaussWSLinear(8, 8, seed=seed)
    with pytest.raises(err, match=msg):
        g.gaussws_sample(torch.randn(8, 8), torch.full((1, 1), 4.0), seed)


def test_largest_seed_is_accepted_everywhere():
    s = 2 ** 63 - 1
    assert len(g.apply_pqt(_gpt("gpt2"), seed=s)) == 8
    assert g.GaussWSLinear(8, 8, seed=s).noise_state[0].item() >= 0
    assert g.gaussws_sample(torch.randn(8, 8), torch.full((1, 1), 4.0), s).shape == (8, 8)


def test_stats_without_pqt_layers_and_non_modules():
    m = _gpt("gpt2")
    with pytest.raises(ValueError, match="bitwidth_stats: model GPT has no GaussWSLinear layer"):
        g.bitwidth_stats(m)
    assert g.bitwidth_penalty(m).item() == 0.0 and g.pqt_layers(m) == []
    for fn in (g.bitwidth_stats, g.bitwidth_penalty, g.pqt_layers, g.apply_pqt):
        with pytest.raises(TypeError, match=f"{fn.__name__}: model must be a torch.nn.Module, got NoneType"):
            fn(None)
    g.apply_pqt(m, parts="od")
    assert set(g.bitwidth_stats(m)) == {"all"} | {n for n, _ in g.pqt_layers(m)}


# ---------------------------------------------------------------------------------------------
# Table C: casting sampled weights to FP formats

def test_cast_fp_fp4_e2m1_grid_ties_and_saturation():
    # OCP FP4 E2M1 (no inf/NaN codes): 0, 0.5, 1, 1.5, 2, 3, 4, 6
    x = torch.tensor([0.5, 1.5, 3.0, 6.0, 0.1, 0.3, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 1e9,
                      float("inf"), -float("inf"), -2.9, -0.26, 0.0])
    want = [0.5, 1.5, 3.0, 6.0, 0.0, 0.5, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0,
            6.0, -6.0, -3.0, -0.5, 0.0]
    # ties: 0.25 -> 0 (code 0 even, not the subnormal 0.5), 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
    # 2.5 -> 2, 3.5 -> 4, 5 -> 4: the neighbour whose mantissa bit is 0
    assert g.cast_fp(x, 2, 1, inf_nan=False).tolist() == want
    assert math.isnan(g.cast_fp(torch.tensor([float("nan")]), 2, 1, inf_nan=False).item())


def test_cast_fp_e3m4_subnormals_and_saturation():
    # IEEE-style e3m4 (Table C's FP8 tier): bias 3, emin -2, emax 3 (exponent 7 = inf/NaN),
    # subnormal step 2^(-2-4) = 1/64, largest finite (2 - 1/16) * 8 = 15.5
    s = 1 / 64
    x = torch.tensor([s, s / 2, 3 * s / 2, 5 * s / 2, 0.4 * s, 0.25, 0.25 + s / 2, 15.5, 15.7, 100.0, -1e30])
    want = [s, 0.0, 2 * s, 2 * s, 0.0, 0.25, 0.25, 15.5, 15.5, 15.5, -15.5]
    # 0.25 + s/2: 0.25 is in binade [2^-2, 2^-1) with step 2^-6 = s, so s/2 is a tie -> 0.25 (even)
    assert g.cast_fp(x, 3, 4).tolist() == want


def test_cast_fp_matches_torch_float16_and_float8():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50_000, generator=gen) * torch.exp2(torch.randint(-30, 20, (50_000,), generator=gen).float())
    h = x.clamp(-65504, 65504)                       # IEEE half = e5m10 with inf/NaN codes
    assert torch.equal(g.cast_fp(h, 5, 10), h.half().float())
    y = x.clamp(-57344, 57344)                       # float8_e5m2: IEEE-style
    assert torch.equal(g.cast_fp(y, 5, 2), y.to(torch.float8_e5m2).float())
    z = x.clamp(-440, 440)                           # float8_e4m3fn: all exponents finite (below 448)
    assert torch.equal(g.cast_fp(z, 4, 3, inf_nan=False), z.to(torch.float8_e4m3fn).float())


def _grid(e, m, inf_nan):
    """All nonnegative values of the format, by code, in increasing order (code parity = mantissa LSB)."""
    bias = 2 ** (e - 1) - 1
    vals = []
    for E, M in itertools.product(range(2 ** e - (1 if inf_nan else 0)), range(2 ** m)):
        vals.append(M * 2.0 ** (1 - bias - m) if E == 0 else (1 + M / 2 ** m) * 2.0 ** (E - bias))
    return torch.tensor(vals, dtype=torch.float64)


@pytest.mark.parametrize("e,m,inf_nan", [(3, 4, True), (4, 7, True), (2, 1, False), (4, 3, True), (3, 2, False)])
def test_cast_fp_is_the_nearest_grid_point_ties_to_even(e, m, inf_nan):
    grid = _grid(e, m, inf_nan)
    assert torch.all(grid[1:] > grid[:-1])
    gen = torch.Generator().manual_seed(e * 100 + m)
    x = (torch.rand(4000, generator=gen, dtype=torch.float64) * 2 - 1) * grid[-1] * 1.2
    x = torch.cat([x, x / 64, x / 2 ** 12])
    q = g.cast_fp(x, e, m, inf_nan)
    dist = (x.abs()[:, None] - grid[None, :]).abs()
    assert torch.equal(q.abs(), grid[dist.argmin(1)])            # nearest (saturating beyond the top)
    assert torch.equal(torch.sign(q), torch.sign(x) * (q != 0))
    mid = (grid[1:] + grid[:-1]) / 2                              # exact ties: the even code wins
    even = torch.where(torch.arange(len(mid)) % 2 == 0, grid[:-1], grid[1:])
    assert torch.equal(g.cast_fp(mid, e, m, inf_nan), even)
    assert torch.equal(g.cast_fp(-mid, e, m, inf_nan), -even)
    assert torch.equal(g.cast_fp(grid, e, m, inf_nan), grid)  # grid points are fixed points


def test_cast_fp_rejects_bad_formats():
    with pytest.raises(ValueError, match=r"cast_fp: exp_bits=0 must be an int in \[1, 8\]"):
        g.cast_fp(torch.ones(2), 0, 3)
    with pytest.raises(ValueError, match=r"man_bits=2.5"):
        g.cast_fp(torch.ones(2), 3, 2.5)
    with pytest.raises(ValueError, match="inf_nan=False"):
        g.cast_fp(torch.ones(2), 1, 2)


def test_cast_tiles_scales_each_tile_by_its_absmax():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(70, 45, generator=gen) * torch.exp2(torch.randint(-8, 8, (70, 45), generator=gen).float())
    w[32:64, 32:45] = 0.0                                          # an all-zero (partial) tile
    q = g.cast_tiles(w, 3, 4)
    assert torch.equal(g.cast_tiles(q, 3, 4), q)               # idempotent: the tile scales stay
    assert torch.equal(q[32:64, 32:45], w[32:64, 32:45])
    for r, c in [(0, 0), (0, 1), (1, 0), (2, 1)]:                  # each tile on its own (edge tiles partial)
        t = w[32 * r:32 * r + 32, 32 * c:32 * c + 32]
        k = math.floor(math.log2(t.abs().max().item())) - 3      # absmax into e3m4's top binade [8, 16)
        assert torch.equal(q[32 * r:32 * r + 32, 32 * c:32 * c + 32], g.cast_fp(t / 2.0 ** k, 3, 4) * 2.0 ** k)
    w2 = w.clone()
    w2[0, 0] = 1e6                                                  # another tile's scale is untouched
    assert torch.equal(g.cast_tiles(w2, 3, 4)[32:], q[32:]) and torch.equal(g.cast_tiles(w2, 3, 4)[:, 32:], q[:, 32:])


def test_cast_to_tiers_uses_each_tiles_clamped_b_t():
    layer = g.GaussWSLinear(64, 64, bias=False, b_init=6.0, b_target=4.0)
    model = torch.nn.Sequential(layer).eval()
    w0 = layer.weight.detach().clone()
    # b_t = 4 + 2 b_i: tiles at 4 (FP8), 7 (FP12), 11 (FP16) and 30 (clamped to 24: kept)
    with torch.no_grad():
        layer.b_i.copy_(torch.tensor([[0.0, 1.5], [3.5, 13.0]]))
    share = g.cast_to_tiers(model)
    assert share == {"FP8 e3m4": 0.25, "FP12 e4m7": 0.25, "FP16 e5m10": 0.25, ">FP16": 0.25}
    stats = g.bitwidth_stats(model)["all"]
    assert share["FP8 e3m4"] == stats["share_le5"]
    assert share["FP8 e3m4"] + share["FP12 e4m7"] == stats["share_le9"]
    w = layer.weight.detach()
    for (r, c), (e, m) in {(0, 0): (3, 4), (0, 1): (4, 7), (1, 0): (5, 10)}.items():
        sl = (slice(32 * r, 32 * r + 32), slice(32 * c, 32 * c + 32))
        assert torch.equal(w[sl], g.cast_tiles(w0[sl], e, m)) and not torch.equal(w[sl], w0[sl])
    assert torch.equal(w[32:, 32:], w0[32:, 32:])


# ---------------------------------------------------------------------------------------------
# any model: apply_pqt by name, GPT-2's Conv1D, remove_pqt, plain checkpoints; Hugging Face models

def test_apply_pqt_by_modules_glob_list_and_callable():
    assert g.apply_pqt(_gpt2_like(), modules="blocks.*.mlp.*") == [
        "blocks.0.mlp.up", "blocks.0.mlp.down", "blocks.1.mlp.up", "blocks.1.mlp.down"]
    assert g.apply_pqt(_gpt2_like(), modules=["blocks.0.attn.qkv", "*.down"]) == [
        "blocks.0.attn.qkv", "blocks.0.mlp.down", "blocks.1.mlp.down"]
    m = _gpt2_like()
    asked = []
    names = g.apply_pqt(m, modules=lambda n, mod: asked.append(n) or mod.out_features == 96)
    assert names == ["blocks.0.attn.qkv", "blocks.0.mlp.up", "blocks.1.attn.qkv", "blocks.1.mlp.up"]
    assert "lm_head" not in asked and "wte" not in asked and len(asked) == 8   # linears only, no head
    seq = nn.Sequential(nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 8))
    assert g.apply_pqt(seq, modules="*") == ["0", "2"]
    assert all(type(seq[i]) is g.GaussWSLinear for i in (0, 2))
    shared = nn.Linear(40, 40)
    two = nn.Sequential(shared, nn.ReLU(), shared)      # one module at two places: one layer at both
    assert g.apply_pqt(two, modules="*") == ["0"] and two[0] is two[2] and two[0].weight is shared.weight
    m = _gpt2_like()
    for kw, err, msg in ((dict(modules="nothing*"), ValueError,
                          r"modules='nothing\*'\) selects no nn.Linear .*the model's linears: 'blocks.0.attn.qkv', "),
                         (dict(modules="wte"), ValueError, "never embeddings or norms"),
                         (dict(modules=3), TypeError, "modules=3: allowed: a glob"),
                         (dict(modules=[]), TypeError, r"modules=\[\]"),
                         (dict(modules="*", parts="od"), ValueError, "not both"),
                         (dict(modules="lm_head"), ValueError, r"but the LM head 'lm_head' \(lm_head=True samples it\)")):
        with pytest.raises(err, match=msg):
            g.apply_pqt(m, **kw)
        assert _untouched(m)
    assert g.apply_pqt(m, modules="lm_head", lm_head=True) == ["lm_head"]
    with pytest.raises(ValueError, match=r"already GaussWSLinear: 'lm_head'"):
        g.apply_pqt(m, modules="lm_head", lm_head=True)


class _TiedLM(nn.Module):
    """An embedding, a hidden linear, an output linear tied to the embedding (named `proj`, not
    lm_head) and an untied extra head reported by get_output_embeddings, as Hugging Face does."""
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.hidden = nn.Linear(32, 32)
        self.proj = nn.Linear(32, 64, bias=False)
        self.proj.weight = self.emb.weight
        self.head2 = nn.Linear(32, 64, bias=False)

    def get_output_embeddings(self):
        return self.head2


def test_apply_pqt_never_samples_a_tied_or_output_head_unless_asked():
    m = _TiedLM()
    assert g.apply_pqt(m, modules="*") == ["hidden"]
    assert type(m.proj) is nn.Linear and type(m.head2) is nn.Linear
    m = _TiedLM()
    assert g.apply_pqt(m, modules="*", lm_head=True) == ["hidden", "proj", "head2"]
    assert m.proj.weight is m.emb.weight            # still tied: the embedding reads w, the head w_hat


class Conv1D(nn.Module):
    """Hugging Face GPT-2's Conv1D as transformers defines it (nf outputs, nx inputs, weight
    (nx, nf), y = x @ weight + bias), here so the test runs without transformers."""
    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, self.nx), self.weight).view(*x.shape[:-1], self.nf)


def test_conv1d_is_sampled_as_its_transposed_linear_with_the_same_tiles():
    torch.manual_seed(31)
    m = nn.Sequential(Conv1D(70, 45))                 # 45 -> 70, weight (45, 70)
    w = m[0].weight
    x = torch.randn(3, 5, 45)
    m.eval()
    y_plain = m(x)
    assert g.apply_pqt(m, modules="*") == ["0"]
    conv = m[0]
    assert type(conv) is g.GaussWSConv1D and conv.weight is w and conv.b_i.shape == (3, 2)
    assert torch.equal(m(x), y_plain)                 # eval: the plain Conv1D product
    # training: exactly GaussWSLinear(45, 70) holding w.t(), with the same b_i and noise_state
    lin = g.GaussWSLinear(45, 70)
    with torch.no_grad():
        conv.b_i.uniform_(0.2, 1.0)
        lin.weight.copy_(w.t())
        lin.bias.copy_(conv.bias)
        lin.b_i.copy_(conv.b_i)
        lin.noise_state.copy_(conv.noise_state)
    m.train()
    y_conv, y_lin = m(x), lin(x)
    assert torch.equal(y_conv, y_lin) and not torch.equal(y_conv, y_plain)
    (y_conv * y_lin.detach()).sum().backward()
    (y_lin * y_conv.detach()).sum().backward()
    assert torch.equal(conv.weight.grad, lin.weight.grad.t()) and torch.equal(conv.b_i.grad, lin.b_i.grad)
    assert g.bitwidth_stats(m)["0"]["params"] == 45 * 70
    m.eval()
    y_pqt = m(x)
    back = copy.deepcopy(m)
    assert g.remove_pqt(back) == ["0"]
    assert type(back[0]) is Conv1D and torch.equal(back(x), y_pqt)
    # the Table C cast of each tile is the twin linear's, transposed; the Parameter stays
    w0 = w.detach().clone()
    g.cast_to_tiers(nn.Sequential(lin))
    g.remove_pqt(m, cast="tiers")
    assert type(m[0]) is Conv1D and m[0].weight is w and torch.equal(w, lin.weight.t())
    assert not torch.equal(w, w0)
    made = g.GaussWSConv1D(45, 70)                    # made directly: Conv1D's layout and init
    assert made.weight.shape == (45, 70) and made(x).shape == (3, 5, 70)
    assert 0.015 < made.weight.std().item() < 0.025 and torch.equal(made.bias, torch.zeros(70))


def _set_random_bitwidths(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in g.pqt_layers(model):
            layer.b_i.copy_(torch.rand(layer.b_i.shape, generator=gen) * 1.5 - 0.5)   # b_t in [3, 7]


def test_remove_pqt_gives_plain_layers_with_the_same_eval_outputs_and_casts():
    torch.manual_seed(32)
    plain = _gpt2_like()
    keys = sorted(plain.state_dict())
    x = torch.randn(2, 5, 32)
    for cast in (None, "tiers", "e3m4", "e2m3"):
        m = _gpt2_like()
        m.load_state_dict(plain.state_dict())
        g.apply_pqt(m, seed=4)
        _set_random_bitwidths(m)
        w0 = {n: l.weight.detach().clone() for n, l in g.pqt_layers(m)}
        params = {n: (l.weight, l.bias) for n, l in g.pqt_layers(m)}
        m.eval()
        if cast == "tiers":
            ref = _gpt2_like()
            ref.load_state_dict(m.state_dict(), strict=False)
            g.apply_pqt(ref, seed=4)
            ref.load_state_dict(m.state_dict())
            g.cast_to_tiers(ref)
            y_ref = ref.eval()(x)
        else:
            y_ref = m(x) if cast is None else None
        names = g.remove_pqt(m, cast=cast)
        assert names == list(w0) and not g.pqt_layers(m) and not m.training
        for n in names:
            layer = m.get_submodule(n)
            assert type(layer) is nn.Linear and (layer.weight, layer.bias) == params[n]
            if cast is None:
                assert torch.equal(layer.weight, w0[n])
            elif cast != "tiers":
                e, mb = int(cast[1]), int(cast[3])
                assert torch.equal(layer.weight, g.cast_tiles(w0[n], e, mb))
        if y_ref is not None:
            assert torch.equal(m(x), y_ref)
        assert sorted(m.state_dict()) == keys
        fresh = _gpt2_like()
        fresh.load_state_dict(m.state_dict())          # strict: the state dict of the plain model
        assert torch.equal(fresh.eval()(x), m(x))
    m = _gpt2_like()
    with pytest.raises(ValueError, match="has no GaussWSLinear layer"):
        g.remove_pqt(m)
    g.apply_pqt(m)
    for cast, msg in (("fp8", r"cast='fp8': allowed: None .*'e3m4'"), ("e9m2", r"cast='e9m2': cast_fp: exp_bits=9"),
                      (4, "cast=4: allowed")):
        with pytest.raises(ValueError, match=msg):
            g.remove_pqt(m, cast=cast)
    assert len(g.pqt_layers(m)) == 8 and m.training      # untouched by the refused calls
    with pytest.raises(ValueError, match="it is one: put it in a module"):
        g.remove_pqt(g.GaussWSLinear(8, 8))


def test_plain_checkpoint_loads_into_a_pqt_model_as_at_construction():
    torch.manual_seed(33)
    plain = _gpt2_like()
    x = torch.randn(2, 5, 32)
    m = _gpt2_like()
    g.apply_pqt(m, seed=8)
    fresh = {n: l.noise_state.clone() for n, l in g.pqt_layers(m)}
    m(x).sum().backward()                             # advance the call counters
    _set_random_bitwidths(m)
    assert not m.load_state_dict(plain.state_dict()).missing_keys      # strict=True
    for n, l in g.pqt_layers(m):
        assert torch.equal(l.b_i, torch.ones_like(l.b_i)) and torch.equal(l.noise_state, fresh[n])
        assert torch.equal(l.weight, plain.get_submodule(n).weight)
    assert torch.equal(m.eval()(x), plain.eval()(x))
    # a PQT checkpoint that lost only b_i is not a plain one: strict loading names the key
    sd = {k: v for k, v in m.state_dict().items() if k != "blocks.0.attn.qkv.b_i"}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*blocks.0.attn.qkv.b_i"):
        m.load_state_dict(sd)


def _hf(kind, tie=False):
    """A tiny randomly initialised Hugging Face model built from a config (no download): byte
    vocabulary, 2 layers of width 64."""
    tf = pytest.importorskip("transformers", reason="Hugging Face tests need transformers "
                                                   "(pip install transformers accelerate)")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "llama":
        cfg = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=tie)
        return tf.LlamaForCausalLM(cfg)
    cfg = tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)   # no dropout RNG
    return tf.GPT2LMHeadModel(cfg)


def _text_rows(n, T=64):
    """n real-text rows of T bytes (argparse's source, present everywhere), in a fixed order."""
    data = torch.tensor(list(open(argparse.__file__, "rb").read()[:n * T]), dtype=torch.long)
    return data.view(n, T)


def test_hf_llama_and_gpt2_parts_conv1d_and_tied_heads():
    m = _hf("llama")
    names = g.apply_pqt(m, parts="all")
    per = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert names == [f"model.layers.{i}.{p}" for i in range(2) for p in per]
    assert type(m.lm_head) is nn.Linear and type(m.model.embed_tokens) is nn.Embedding
    assert g.apply_pqt(_hf("llama"), parts="od") == [f"model.layers.{i}.{p}" for i in range(2)
                                                     for p in ("self_attn.o_proj", "mlp.down_proj")]
    with pytest.raises(ValueError, match=r"no nn.Linear named qkv .*it has: q, k, v, out, gate, up, down"):
        g.apply_pqt(_hf("llama"), parts="qkv")
    tied = _hf("llama", tie=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert g.apply_pqt(tied, modules="*") == names      # the tied head is left out
    assert type(tied.lm_head) is nn.Linear
    gpt2 = _hf("gpt2")
    names = g.apply_pqt(gpt2, parts="all")
    per = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    assert names == [f"transformer.h.{i}.{p}" for i in range(2) for p in per]
    assert all(type(l) is g.GaussWSConv1D for _, l in g.pqt_layers(gpt2))
    assert gpt2.transformer.h[0].mlp.c_fc.b_i.shape == (8, 2)          # 64 -> 256: (256/32, 64/32)
    assert g.apply_pqt(_hf("gpt2"), parts="od") == [f"transformer.h.{i}.{p}" for i in range(2)
                                                    for p in ("attn.c_proj", "mlp.c_proj")]


def _hf_optimizer(m, lr=3e-3):
    """ZIP-SR 4-bit states, with the embeddings and the LM head in an FP32-state group."""
    head = [m.get_input_embeddings().weight, m.get_output_embeddings().weight]
    head = list({id(p): p for p in head}.values())
    rest = [p for p in m.parameters() if all(p is not h for h in head)]
    return A.AdamW4bit([dict(params=head, quantize=False), dict(params=rest)], lr=lr, preset="zipsr")


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hf_gaussws_zipsr_lowers_the_loss_on_real_text(kind):
    m = _hf(kind)
    g.apply_pqt(m, parts="all", seed=1)
    opt = _hf_optimizer(m)
    rows, gen = _text_rows(400), torch.Generator().manual_seed(0)
    losses = []
    for _ in range(30):
        x = rows[torch.randint(0, len(rows), (8,), generator=gen)]
        loss = m(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    # from ln(256) = 5.5 at random init; byte statistics alone give ~3 nats within 30 steps
    assert losses[0] > 5.0 and sum(losses[-5:]) / 5 < 0.7 * losses[0]
    w = m.model.layers[0].mlp.up_proj.weight if kind == "llama" else m.transformer.h[0].mlp.c_fc.weight
    assert opt.state[w]["exp_avg"].dtype == torch.uint8
    assert opt.state[m.get_input_embeddings().weight]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hf_state_dict_round_trip_and_remove_pqt(kind):
    plain_keys = sorted(_hf(kind).state_dict())
    m = _hf(kind)
    g.apply_pqt(m, seed=2)
    _set_random_bitwidths(m)
    x = _text_rows(4)
    m(input_ids=x, labels=x).loss.backward()         # the call counters move on
    sd = m.state_dict()
    m2 = _hf(kind)
    g.apply_pqt(m2, seed=99)                          # keys and counters come from the state dict
    m2.load_state_dict(sd)
    assert torch.equal(m(input_ids=x).logits, m2(input_ids=x).logits)      # training: same noise
    m.eval()
    y = m(input_ids=x).logits
    assert g.remove_pqt(m) == [n for n, _ in g.pqt_layers(m2)]
    assert torch.equal(m(input_ids=x).logits, y) and sorted(m.state_dict()) == plain_keys
    plain = _hf(kind)
    plain.load_state_dict(m.state_dict())             # strict: a plain Hugging Face state dict
    assert torch.equal(plain.eval()(input_ids=x).logits, y)
    back = _hf(kind)
    g.apply_pqt(back)
    back.load_state_dict(plain.state_dict())          # and a plain checkpoint loads into PQT
    assert torch.equal(back.eval()(input_ids=x).logits, y)


def test_hf_trainer_with_adamw4bit_an_lr_schedule_and_resume(tmp_path):
    tf = pytest.importorskip("transformers", reason="the Trainer test needs transformers and accelerate")
    rows = _text_rows(128)

    def trainer(quantize_head):
        m = _hf("llama")
        g.apply_pqt(m, seed=3)
        opt = _hf_optimizer(m, lr=1e-2)
        opt.param_groups[0]["quantize"] = quantize_head
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 10)
        args = tf.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=8,
                                    logging_steps=1, report_to="none", use_cpu=True, save_steps=4,
                                    disable_tqdm=True, seed=0)
        return m, opt, tf.Trainer(model=m, args=args, train_dataset=[dict(input_ids=r, labels=r) for r in rows],
                                  optimizers=(opt, sched))
    m, opt, tr = trainer(quantize_head=False)
    tr.train()
    losses = [h["loss"] for h in tr.state.log_history if "loss" in h]
    assert len(losses) == 8 and losses[-1] < 0.8 * losses[0]
    assert getattr(tr.optimizer, "optimizer", tr.optimizer) is opt
    assert opt.param_groups[1]["lr"] == pytest.approx(1e-2 * (1 - 8 / 10))
    w = m.model.layers[1].self_attn.q_proj.weight
    assert opt.state[w]["step"] == 8 and opt.state[w]["exp_avg"].dtype == torch.uint8
    assert opt.state[m.lm_head.weight]["exp_avg"].dtype == torch.float32
    # resume from the step-4 checkpoint: the saved policy (FP32 head states) wins over the new
    # optimizer's, and the model (b_i, noise counters) and optimizer end bit for bit as above
    m2, opt2, tr2 = trainer(quantize_head=True)
    tr2.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert opt2.param_groups[0]["quantize"] is False
    for (n, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), n
    # or the Trainer builds it, with its own groups (no weight decay on norms and biases)
    m3 = _hf("llama")
    args = tf.TrainingArguments(output_dir=str(tmp_path / "cls"), per_device_train_batch_size=8, max_steps=2,
                                report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
                                learning_rate=1e-2, weight_decay=0.1)
    tr3 = tf.Trainer(model=m3, args=args, train_dataset=[dict(input_ids=r, labels=r) for r in rows],
                     optimizer_cls_and_kwargs=(A.AdamW4bit, dict(preset="zipsr")))
    tr3.train()
    opt3 = getattr(tr3.optimizer, "optimizer", tr3.optimizer)
    assert type(opt3) is A.AdamW4bit and [gr["weight_decay"] for gr in opt3.param_groups] == [0.1, 0.0]
    assert opt3.state[m3.model.layers[0].mlp.up_proj.weight]["exp_avg"].dtype == torch.uint8


# any model, what a first-time user meets: bf16 models learn b_t, a second apply_pqt, Hugging Face
# names in parts, shared modules, heads, the modules filter's errors

def test_b_i_is_float32_with_bf16_weights_so_small_steps_move_b_t_and_a_later_cast_warns():
    assert g.GaussWSLinear(40, 40, dtype=torch.bfloat16).b_i.dtype == torch.float32
    torch.manual_seed(33)
    m = nn.Sequential(nn.Linear(40, 40)).to(torch.bfloat16)
    g.apply_pqt(m, modules="*", impl="torch")
    layer = m[0]
    assert layer.weight.dtype == torch.bfloat16 and layer.b_i.dtype == layer.b_t.dtype == torch.float32
    x = torch.randn(4, 40, dtype=torch.bfloat16)
    opt = torch.optim.Adam([layer.b_i], lr=1e-3)    # a step of ~1e-3: below BF16's spacing at 1.0
    m(x).float().pow(2).sum().backward()
    assert (layer.b_i.grad != 0).all()
    opt.step()
    assert (layer.b_i != 1).all()
    m.to(torch.bfloat16)                           # a cast after apply_pqt: b_i BF16 again
    with pytest.warns(UserWarning, match=r"GaussWSLinear 0: b_i is torch.bfloat16.*keep b_i float32"):
        m(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")             # once per layer
        m(x)
        m.eval()(x)


def test_a_second_apply_pqt_gives_its_layers_keys_of_their_own():
    import random
    once = _Model(llama=True)
    g.apply_pqt(once, parts="od")
    rng = random.Random(0)                         # a first call's keys are as they always were
    assert [l.noise_state[0].item() for _, l in g.pqt_layers(once)] == [
        g._splitmix64(rng.getrandbits(62)) & (2 ** 63 - 1) for _ in range(4)]
    twice = _Model(llama=True)
    g.apply_pqt(twice, parts="od")
    g.apply_pqt(twice, parts="q,k")
    keys = {n: l.noise_state[0].item() for n, l in g.pqt_layers(twice)}
    assert len(keys) == 8 and len(set(keys.values())) == 8
    assert all(keys[n] == l.noise_state[0].item() for n, l in g.pqt_layers(once))


def test_parts_take_hugging_face_names_and_the_error_shows_them():
    def hf():
        return nn.ModuleDict({"attn": nn.ModuleDict({k: nn.Linear(32, 32) for k in ("q_proj", "k_proj", "o_proj")}),
                              "mlp": nn.ModuleDict({"c_fc": Conv1D(64, 32), "c_proj": Conv1D(32, 64)})})
    assert g.apply_pqt(hf(), parts="q_proj,o_proj") == g.apply_pqt(hf(), parts="q,out") == ["attn.q_proj", "attn.o_proj"]
    assert g.apply_pqt(hf(), parts="c_fc,mlp.c_proj") == ["mlp.c_fc", "mlp.c_proj"]
    assert g.apply_pqt(_gpt2_like(), parts="c_attn") == ["blocks.0.attn.qkv", "blocks.1.attn.qkv"]
    m = hf()
    with pytest.raises(ValueError, match=r"unknown part\(s\) \['c_proj'\].*o_proj=out.*attn.c_proj=out, mlp.c_proj=down"):
        g.apply_pqt(m, parts="q_proj,c_proj")
    assert _untouched(m)


def test_a_shared_module_selected_at_its_second_name_stays_one_layer_at_both():
    s = nn.Module()
    s.l1 = nn.Linear(32, 32)
    s.l2 = s.l1
    assert len(g.apply_pqt(s, modules="l2")) == 1
    assert type(s.l2) is g.GaussWSLinear and s.l1 is s.l2


def test_common_head_names_are_left_alone_and_lm_head_true_adds_the_head_to_parts():
    m = nn.ModuleDict({"up": nn.Linear(32, 64), "head": nn.Linear(64, 50), "output": nn.Linear(64, 50),
                       "embed_out": nn.Linear(64, 50)})
    assert g.apply_pqt(m, parts="all") == ["up"]
    assert all(type(m[k]) is nn.Linear for k in ("head", "output", "embed_out"))
    m = _gpt2_like()
    names = g.apply_pqt(m, parts="all", lm_head=True)
    assert "lm_head" in names and len(names) == 9 and type(m.lm_head) is g.GaussWSLinear
    # module order (the head after the blocks), so the head takes no other layer's seed
    assert names == [n for n, mod in m.named_modules() if isinstance(mod, g.GaussWSLinear)]
    other = _gpt2_like()
    g.apply_pqt(other, parts="all")
    assert all(torch.equal(dict(m.named_buffers())[k], v) for k, v in other.named_buffers() if k.endswith("noise_state"))
    m = _gpt2_like()
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match=f"lm_head={bad!r} must be True or False"):
            g.apply_pqt(m, lm_head=bad)
    assert _untouched(m)


class _MyLinear(nn.Linear):
    pass


def test_modules_filter_errors_name_the_module_the_value_and_the_glob():
    m = _gpt2_like()
    with pytest.raises(TypeError, match=r"returned None \(NoneType\) for module 'blocks.0.attn.qkv'"):
        g.apply_pqt(m, modules=lambda n, mod: None)
    with pytest.raises(ValueError, match=r"raised KeyError on module 'blocks.0.attn.qkv'") as e:
        g.apply_pqt(m, modules=lambda n, mod: {}[n])
    assert isinstance(e.value.__cause__, KeyError)
    with pytest.raises(ValueError, match=r"'nope\.\*' matches no linear; the model's linears: 'blocks.0.attn.qkv'"):
        g.apply_pqt(m, modules=["blocks.0.*", "nope.*"])
    assert _untouched(m)
    # what is there when nothing is found: linears without part names, nn.Linear subclasses
    seq = nn.Sequential(nn.Linear(8, 8), _MyLinear(8, 8))
    with pytest.raises(ValueError, match=r"the parts it has: none; linears without a part name: '0'; not replaced, "
                                         r"being nn.Linear subclasses.*: '1' \(_MyLinear\)"):
        g.apply_pqt(seq, parts="all")
    with pytest.raises(ValueError, match=r"the model's linears: none; not replaced.*'1' \(_MyLinear\)"):
        g.apply_pqt(nn.Sequential(nn.ReLU(), _MyLinear(8, 8)), modules="*")


# ---------------------------------------------------------------------------------------------
# the public calls without host syncs; CUDA graphs

def test_int_seed_is_the_tensor_seed_and_device_seeds_are_cached():
    """seed=s and seed=tensor([s, 0]) give the same w_hat bits and the same gradients (CPU). A
    seed tensor for another device is made once (fills, no host-to-device copy; the meta device
    stands in for a GPU here) and reused, the cache stays bounded, the counter slot is 0."""
    torch.manual_seed(31)
    w = torch.randn(70, 45, requires_grad=True)
    bt = (3 + 5 * torch.rand(g.tile_grid(70, 45))).requires_grad_()
    out = []
    for seed in (2 ** 62 + 5, torch.tensor([2 ** 62 + 5, 0])):
        w.grad = bt.grad = None
        w_hat = g.gaussws_sample(w, bt, seed, out_dtype=torch.float32)
        w_hat.square().sum().backward()
        out.append((w_hat.detach(), w.grad.clone(), bt.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*out))
    assert torch.equal(g.seed_tensor(9, "cpu"), torch.tensor([9, 0]))
    a = g.seed_tensor(2 ** 63 - 1, "meta")
    assert a is g.seed_tensor(2 ** 63 - 1, "meta") and a.dtype == torch.int64 and a.shape == (2,)
    for s in range(g._SEED_CACHE_SIZE + 3):
        g.seed_tensor(s, "meta")
    assert len(g._SEED_CACHE) <= g._SEED_CACHE_SIZE
    assert (torch.device("meta"), 2 ** 63 - 1) not in g._SEED_CACHE    # the oldest went first


@needs_compiled
@needs_cuda
def test_gpu_public_calls_make_no_host_sync():
    """gaussws_sample, generate_noise, apply_noise (int seeds, new and repeated) and a
    GaussWSLinear forward + backward under torch.cuda.set_sync_debug_mode("error"): no blocking
    host-device transfer; the cached int seed gives the tensor seed's bits."""
    dev = "cuda"
    torch.manual_seed(32)
    w = torch.randn(96, 64, device=dev, requires_grad=True)
    bt = (3 + 5 * torch.rand(g.tile_grid(96, 64), device=dev)).requires_grad_()
    layer = g.GaussWSLinear(64, 96, seed=4).to(dev)
    x = torch.randn(8, 64, device=dev)
    ref = g.gaussws_sample(w, bt, torch.tensor([77, 0], device=dev)).detach()
    layer(x).sum().backward()                              # kernels compiled before the check
    g.apply_noise(w.detach(), g.generate_noise((96, 64), 3, device=dev), bt.detach())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for s in (77, 77, 78, 2 ** 63 - 1):
            w_hat = g.gaussws_sample(w, bt, s)
            w_hat.float().square().sum().backward()
            g.gaussws_sample(w, bt, s, fused=True)
            g.apply_noise(w.detach(), g.generate_noise((96, 64), s, device=dev), bt.detach())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(g.gaussws_sample(w, bt, 77).detach(), ref)
    assert layer.noise_state[1].item() == 2


@needs_compiled
@needs_cuda
def test_gpu_cuda_graph_capture_advances_the_counter():
    """A GaussWSLinear inside a captured CUDA graph (torch.cuda.graph around forward + backward):
    each replay advances the layer's counter on the device and samples the next w_hat, the same
    outputs and b_i grads as eager calls with the same counters."""
    dev = "cuda"
    torch.manual_seed(33)
    x = torch.randn(16, 64, device=dev)
    eager = g.GaussWSLinear(64, 96, seed=6).to(dev)
    want = []
    for _ in range(3):
        eager.b_i.grad = None
        y = eager(x)
        y.square().sum().backward()
        want.append((y.detach().clone(), eager.b_i.grad.clone()))
    layer = g.GaussWSLinear(64, 96, seed=6).to(dev)
    layer.load_state_dict(eager.state_dict())
    layer.noise_state[1] = 0
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):                            # warm-up call 0 outside the graph
        y = layer(x)
        y.square().sum().backward()
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(y, want[0][0]) and torch.equal(layer.b_i.grad, want[0][1])
    graph = torch.cuda.CUDAGraph()
    layer.b_i.grad.zero_()
    with torch.cuda.graph(graph):
        y = layer(x)
        y.square().sum().backward()
    for k in (1, 2):                                      # capture did not run: replays are calls 1, 2
        layer.b_i.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, want[k][0]) and torch.equal(layer.b_i.grad, want[k][1]), k
    assert layer.noise_state[1].item() == 3


@needs_compiled
@needs_cuda
def test_gpu_sampling_kernel_bits_equal_torch_eager_and_compiled():
    """On CUDA, eagerly and under torch.compile (where Inductor passes the scalars as float64), the
    sampling kernel's b_t has eq. 11's two float32 roundings (b_init − b_target = 2.2, not a
    float32: no FMA), so its clamp mask is torch's, and its 2^(1−b_t) is torch's exp2 bit for bit;
    w_hat and tile maxima are the torch reference's bit for bit; eager and compiled calls give the
    same bits (w_hat, masked 2^(1−b_t), ∂L/∂b_i); b_t across [B_MIN, B_MAX] and beyond."""
    dev, BF16 = "cuda", torch.bfloat16
    torch.manual_seed(35)
    m, n = 3072, 768
    tiles = g.tile_grid(m, n)
    w = torch.randn(m, n, device=dev)
    gg = torch.randn(m, n, device=dev).to(BF16)
    seed = torch.tensor([987654321, 3], device=dev)
    sample = lambda b, *bits: g._pqn_sample(w, b, seed, "gaussws", BF16, "triton", True, *bits)
    comp = torch.compile(sample)
    for bits in [(4.1, 2.2), (4.0, 2.0), (0.0, 1.0)]:
        b = (torch.rand(tiles, device=dev) * 30 - 4) if bits[0] == 0 else (torch.rand(tiles, device=dev) * 12 - 3)
        b_t, pow2 = g._tile_bits_torch(b, *bits)
        live = g._pow2_live_torch(b_t, pow2)
        outs = []
        for fn in (sample, comp):
            leaf = b.clone().requires_grad_()
            out = fn(leaf, *bits)
            out[0].backward(gg)
            outs.append((*out, leaf.grad))
        for x, y in zip(*outs):
            assert torch.equal(_float_bits(x), _float_bits(y)), bits        # eager = compiled
        w_hat, tmax, own, db = outs[0]
        assert torch.equal(_float_bits(own), _float_bits(live)), bits     # torch's b_t, clamp and exp2
        ref = g._apply_torch(w, g._generate_torch(m, n, seed, "gaussws"), pow2, "gaussws", BF16)
        assert torch.equal(w_hat, ref[0]) and torch.equal(tmax, ref[1]), bits
        dpow2 = g._grad_torch(gg, g._generate_torch(m, n, seed, "gaussws"), ref[1], "gaussws", torch.float32)[1]
        leaf = b.clone().requires_grad_()
        g._pow2(leaf if bits[0] == 0 else g._bitwidth(leaf, bits[0] + bits[1], bits[0])).backward(dpow2)
        torch.testing.assert_close(db, leaf.grad, rtol=1e-5, atol=1e-7)   # sum order: kernel vs torch


@needs_compiled
@needs_cuda
def test_gpu_layer_alone_under_reduce_overhead_trains():
    """One GaussWSLinear under torch.compile(mode="reduce-overhead") (CUDA graph trees), every
    gradient set to None before each step as an optimizer loop does: warm-up, recorded and replayed
    steps each equal an eager call with the same counter (compiled: ~1e-7 rounding apart), and the
    counter advances once per step. With only b_i.grad reset, the second step fails for a plain
    nn.Linear too (torch issue 169545): weight.grad is then the previous step's graph output, which
    the next run overwrites before backward accumulates into it."""
    dev = "cuda"
    torch.manual_seed(34)
    x = torch.randn(16, 64, device=dev)
    eager = g.GaussWSLinear(64, 96, seed=6).to(dev)
    layer = g.GaussWSLinear(64, 96, seed=6).to(dev)
    layer.load_state_dict(eager.state_dict())
    comp = torch.compile(lambda x: layer(x).square().sum(), mode="reduce-overhead")
    losses = []
    for k in range(4):
        eager.zero_grad(set_to_none=True)
        want = eager(x).square().sum()
        want.backward()
        layer.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        loss = comp(x)
        loss.backward()
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
        _assert_same_grads(eager, layer, rtol=1e-4, atol=1e-5)
        assert layer.noise_state[1].item() == k + 1
        losses.append(loss.item())
    assert len(set(losses)) == len(losses)        # a new w_hat at every step


# ---------------------------------------------------------------------------------------------
# GaussWSLinear inside fully_shard units (FSDP2), run by fsdp_runs on 2 gloo processes

def _fsdp_gaussws():
    """Two GaussWS layers, unsharded and in fully_shard units (each layer and the root): outputs
    and gradients of two training calls, the noise counters, and which tensors are sharded."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    torch.manual_seed(0)
    plain = nn.Sequential(g.GaussWSLinear(64, 96, seed=3), g.GaussWSLinear(96, 40, seed=4))
    sharded = nn.Sequential(g.GaussWSLinear(64, 96, seed=3), g.GaussWSLinear(96, 40, seed=4))
    sharded.load_state_dict(plain.state_dict())
    for layer in sharded:
        fully_shard(layer)
    fully_shard(sharded)
    res = {"sharded": [n for n, p in sharded.named_parameters() if isinstance(p, DTensor)],
           "buffers_plain": [n for n, b in sharded.named_buffers() if not isinstance(b, DTensor)]}
    late = nn.Sequential(nn.Linear(64, 96))
    fully_shard(late)
    try:   # apply_pqt after fully_shard: refused, naming the order
        g.apply_pqt(late, modules="*")
    except ValueError as e:
        res["apply_after_shard"] = str(e)
    for name, model in (("plain", plain), ("fsdp", sharded)):
        gen = torch.Generator().manual_seed(1)
        outs = []
        for _ in range(2):
            y = model(torch.randn(8, 64, generator=gen))
            y.square().sum().backward()
            outs.append(y.detach())
        res[name] = dict(out=outs, grads={n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                                          for n, p in model.named_parameters()},
                         noise_state=[b.clone() for n, b in model.named_buffers() if n.endswith("noise_state")])
    return res


@pytest.mark.xdist_group("fsdp_runs")   # one worker computes the module fixture once
def test_gaussws_inside_fully_shard_equals_unsharded(fsdp_runs):
    """GaussWSLinear in fully_shard units on 2 ranks: weight and b_i are sharded, the noise
    counters (buffers) are replicated and advance alike, and FSDP2's all-gather before forward
    gives each rank the whole weight and b_t, so R, w_hat, the output and the gradients of two
    training calls equal the unsharded layers' bit for bit on both ranks."""
    for res in fsdp_runs[0]:
        r = res["gaussws"]
        assert sorted(r["sharded"]) == sorted(f"{i}.{k}" for i in (0, 1) for k in ("weight", "bias", "b_i"))
        assert sorted(r["buffers_plain"]) == ["0.noise_state", "1.noise_state"]
        for a, b in zip(r["plain"]["out"], r["fsdp"]["out"]):
            assert torch.equal(a, b)
        assert r["plain"]["grads"].keys() == r["fsdp"]["grads"].keys()
        for k in r["plain"]["grads"]:
            assert torch.equal(r["plain"]["grads"][k], r["fsdp"]["grads"][k]), k
        assert all(torch.equal(a, b) for a, b in zip(r["plain"]["noise_state"], r["fsdp"]["noise_state"]))
        assert int(r["fsdp"]["noise_state"][0][1]) == 2      # two calls drew two seeds
        assert r["apply_after_shard"].startswith("apply_pqt: the model already went through fully_shard; call "
                                                 "apply_pqt first, then fully_shard")


# ---------------------------------------------------------------------------------------------
# GPU-only: the compiled kernels = the reference

@needs_compiled
@needs_cuda
@pytest.mark.parametrize("m,n", [(70, 45), (1, 1), (33, 100), (3072, 768), (4096, 4096)])
def test_gpu_noise_kernels_equal_reference(m, n):
    """On CUDA: packed R (eq. 10), w_hat and tile max of eq. 3 from the 3-step and the fused
    kernels equal the reference bit for bit; the eq. 4 weight grad too, the bit grad within 1e-5
    of the largest tile max * 1024; DiffQ's noise is equal and its w_hat within one FMA rounding."""
    BF16 = torch.bfloat16
    dev = "cuda"
    seed = torch.tensor([0x1234_5678_9ABC, 17], device=dev)
    ref = g._generate_torch(m, n, seed, "gaussws")
    ker = g.generate_triton(m, n, seed, "gaussws")
    assert torch.equal(ref, ker), f"packed R differs at {m}x{n}"
    w = torch.randn(m, n, device=dev)
    bt = 3 + 5 * torch.rand(g.tile_grid(m, n), device=dev)
    pow2 = torch.exp2(1 - bt)
    wr, tr = g._apply_torch(w, ref, pow2, "gaussws", BF16)
    wk, tk = g.apply_triton(w, ker, pow2, seed, "gaussws", BF16, False)
    wf, tf = g.apply_triton(w, None, pow2, seed, "gaussws", BF16, True)
    assert torch.equal(wr, wk) and torch.equal(tr, tk), f"apply differs at {m}x{n}"
    assert torch.equal(wr, wf) and torch.equal(tr, tf), f"fused apply differs at {m}x{n}"
    gg = torch.randn(m, n, device=dev).to(BF16)
    dwr, dpr = g._grad_torch(gg, ref, tr, "gaussws", torch.float32)
    dwk, dpk = g.grad_triton(gg, ker, tr, seed, "gaussws", torch.float32, False)
    dwf, dpf = g.grad_triton(gg, None, tr, seed, "gaussws", torch.float32, True)
    bound = 1e-5 * (tr * 1024).max().item() + 1e-6
    assert torch.equal(dwr, dwk) and torch.equal(dwr, dwf)
    assert (dpr - dpk).abs().max().item() <= bound and (dpr - dpf).abs().max().item() <= bound
    qr = g._generate_torch(m, n, seed, "diffq")
    qk = g.generate_triton(m, n, seed, "diffq")
    assert torch.equal(qr, qk), "diffq noise differs"
    a, _ = g._apply_torch(w, qr, pow2, "diffq", BF16)
    b, _ = g.apply_triton(w, qk, pow2, seed, "diffq", BF16, False)
    # the GPU may fuse w + R·s into one FMA: differences of one fp32 rounding of R·s plus one
    # BF16 rounding of the result are allowed
    rs = g.broadcast_tiles(tr * pow2, m, n) * qr.float().abs()
    bound = a.float().abs() * 2.0 ** -7 + rs * 2.0 ** -23
    assert ((a.float() - b.float()).abs() <= bound).all(), "diffq apply off by more than the FMA bound"


@needs_compiled
@needs_cuda
def test_gpu_noise_chi_square_67m_draws():
    """8192 x 8192 GPU draws of the eq. 10 kernel against eq. 10 (4 dof) and of the Box-Muller
    kernel against round(N(0,1)/2) with |R| >= 3 lumped (6 dof): p > 1e-6 each; the eq. 10 draws
    reject the rounded normal law (p < 1e-12), so the test has power."""
    seed = torch.tensor([0x1234_5678_9ABC, 17], device="cuda")
    m = n = 8192
    r = g.unpack_noise(g.generate_triton(m, n, seed, "gaussws"), n)
    x = chi2_stat(r, g.NOISE_PROBS)
    assert chi2_sf(x, 4) > 1e-6, x
    assert chi2_sf(chi2_stat(r, rounded_normal_probs()), 4) < 1e-12
    rb = g.unpack_noise(g.generate_triton(m, n, seed, "bm"), n).clamp(-3, 3)
    phi = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))
    probs = {k: phi(2 * k + 1) - phi(2 * k - 1) for k in range(-2, 3)}
    probs[-3], probs[3] = phi(-5), 1 - phi(5)
    xb = chi2_stat(rb, probs)
    assert chi2_sf(xb, 6) > 1e-6, xb


def test_an_optimizer_built_before_apply_pqt_gets_a_warning_naming_the_layers():
    """It steps the weights but holds no b_i, so the bitwidths would never train: its first step
    warns once, naming the layers (quoted: a layer may be named "0"); one built after does not."""
    x = torch.randint(0, 256, (2, 16))
    model = GPT(preset_config("nano", vocab_size=256))
    early = torch.optim.AdamW(model.parameters())
    g.apply_pqt(model)
    model(x, x)[1].backward()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        early.step()
        early.step()
    assert len(seen) == 1 and "built before apply_pqt" in str(seen[0].message)
    assert "'blocks.0.attn.qkv'" in str(seen[0].message)
    seq = nn.Sequential(nn.Linear(64, 64))
    g.apply_pqt(seq, modules="0")
    late = A.AdamW4bit(list(model.parameters()) + list(seq.parameters()))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        late.step()
    assert not seen
    with pytest.raises(ValueError, match=r"already GaussWSLinear: '0'"):
        g.apply_pqt(seq, modules="0")


# =============================================================================================
# model.py, data.py, train.py (CPU, in-process, nano presets and real text)

@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The nano models are launch-bound: one intra-op thread is as fast as two and does not
    collapse when another process holds the second core (OpenMP threads spin-waiting)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A ~100 kB real-text file (argparse's source) and a data folder for prepared datasets."""
    d = tmp_path_factory.mktemp("corpus")
    path = d / "corpus.txt"
    path.write_text(open(argparse.__file__, encoding="utf-8").read(), encoding="utf-8")
    return str(path), str(d / "data")


def base_args(corpus, out_dir, *extra):
    text, data_dir = corpus
    return ["--preset", "nano", "--dataset", text, "--data_dir", data_dir, "--tokenizer", "byte",
            "--batch_size", "4", "--eval_windows", "8", "--no-plot", "--out_dir", str(out_dir), *extra]


def read_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def nano_args(corpus, *extra):
    text, data_dir = corpus
    return ["--preset", "nano", "--dataset", text, "--data_dir", data_dir, "--tokenizer", "byte",
            "--batch_size", "4", "--eval_windows", "8", *extra]


# ---------------------------------------------------------------------------------------------
# model.py

@pytest.mark.parametrize("method", ["bf16", "gaussws", "diffq"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_activation_checkpointing_gives_the_same_gradients_bit_for_bit(preset, method):
    torch.manual_seed(0)
    plain = GPT(preset_config(preset, vocab_size=256, dropout=0.0))
    if method != "bf16":
        g.apply_pqt(plain, method=method, parts="all", seed=3)
    ck = copy.deepcopy(plain)
    ck.checkpoint_blocks = True
    x = torch.randint(0, 256, (2, 32))
    for _ in range(2):                                   # two steps: the noise counters advance alike
        for m in (plain, ck):
            m.zero_grad()
            m(x, x)[1].backward()
        for (n, a), b in zip(plain.named_parameters(), ck.parameters()):
            assert torch.equal(a.grad, b.grad), n
    assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), ck.buffers()))
    with torch.no_grad():                                # no recomputation outside training
        assert torch.equal(plain(x, x)[1], ck(x, x)[1])
    saved = {}
    for m in (plain, ck):                                # and ck keeps fewer activations for backward
        n = [0]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: n.__setitem__(0, n[0] + 1) or t, lambda t: t):
            m(x, x)
        saved[m is ck] = n[0]
    assert saved[True] < saved[False] / 2, saved


@pytest.mark.parametrize("preset", ["nano", "nano-llama"])
def test_model_parts_names_and_shapes(preset):
    cfg = preset_config(preset, vocab_size=256)
    model = GPT(cfg)
    block = model.blocks[0]
    expected = ["qkv", "out", "up", "down"] if preset == "nano" else ["q", "k", "v", "out", "gate", "up", "down"]
    assert cfg.parts == expected
    for part in expected:
        owner = block.attn if part in ("q", "k", "v", "qkv", "out") else block.mlp
        assert isinstance(getattr(owner, part), torch.nn.Linear)
    if preset == "nano-llama":  # GQA: k/v project to n_kv_head heads
        assert block.attn.k.out_features == cfg.n_kv_head * cfg.n_embd // cfg.n_head
        assert model.lm_head.weight is not model.wte.weight
    else:
        assert model.lm_head.weight is model.wte.weight
    logits, loss = model(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))
    assert logits.shape == (2, 16, 256)
    # at init the model is close to uniform over the vocabulary: loss ~ ln(256) = 5.545
    assert abs(loss.item() - math.log(256)) < 0.1


def test_paper_sizes():
    # the papers' model sizes (Llama2-134M, GPT-style 162M, GPT-2 124M), counted with their vocabularies
    def count(name, vocab):
        with torch.device("meta"):
            return GPT(preset_config(name, vocab_size=vocab)).num_params()
    assert round(count("llama-134m", 32000) / 1e6) == 134
    assert round(count("gpt-162m", 50304) / 1e6) == 162
    assert round(count("gpt2-124m", 50304) / 1e6) == 124


def test_causal_rope_model():
    # the output at position t must not depend on tokens after t
    torch.manual_seed(0)
    model = GPT(preset_config("nano-llama", vocab_size=256)).eval()
    x = torch.randint(0, 256, (1, 20))
    x2 = x.clone()
    x2[0, 10:] = (x2[0, 10:] + 1) % 256
    a, _ = model(x, x)
    b, _ = model(x2, x2)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-5)
    assert not torch.allclose(a[0, 10:], b[0, 10:], atol=1e-3)


@pytest.mark.parametrize("pqt", [False, True])
@pytest.mark.parametrize("preset", ["nano", "nano-llama"])
def test_meta_init_to_empty_load_state_dict_is_exact(preset, pqt):
    """GPT (and apply_pqt) on the meta device, to_empty, load_state_dict: bit for bit the normally
    built model (RoPE tables recomputed, the tied LM head tied again): the same logits, loss and
    gradients in training mode, where PQT draws its noise from the loaded counters."""
    cfg = preset_config(preset, vocab_size=256)
    torch.manual_seed(0)
    ref = GPT(cfg)
    if pqt:
        g.apply_pqt(ref, seed=3)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    ref(x, y)[1].backward()                      # counters past 0: they come from the state dict
    ref.zero_grad()
    with torch.device("meta"):
        meta = GPT(cfg)
        if pqt:
            g.apply_pqt(meta, seed=3)
    meta.to_empty(device="cpu")
    meta.load_state_dict(ref.state_dict())
    out = []
    for model in (ref, meta):
        logits, loss = model(x, y)
        loss.backward()
        out.append((logits, loss, {n: p.grad for n, p in model.named_parameters()}))
    (la, lossa, ga), (lb, lossb, gb) = out
    assert torch.isfinite(lossa) and torch.equal(lossa, lossb) and torch.equal(la, lb)
    assert ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga)


@pytest.mark.parametrize("preset", ["nano", "nano-llama"])
def test_reset_parameters_after_meta_init_is_construction(preset):
    """Without a state dict: meta init, to_empty, reset_parameters() gives GPT(cfg) of the same
    torch seed, parameters and buffers; init_buffers() alone restores the RoPE tables."""
    cfg = preset_config(preset, vocab_size=256)
    torch.manual_seed(1)
    ref = GPT(cfg)
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    model.reset_parameters()
    for (n, a), (_, b) in zip(itertools.chain(ref.named_parameters(), ref.named_buffers()),
                              itertools.chain(model.named_parameters(), model.named_buffers())):
        assert torch.equal(a, b), n
    for buf in model.buffers():
        buf.zero_()
    model.init_buffers()
    assert all(torch.equal(a, b) for a, b in zip(ref.buffers(), model.buffers()))


# ---------------------------------------------------------------------------------------------
# data.py

def test_prepare_byte_split_and_cache(tmp_path):
    text = "hello world\n" * 100 + "caf\u00e9 \u2603\n"
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    folder = datamod.prepare(str(tmp_path / "a.txt"), "byte", data_dir=str(tmp_path / "d"), verbose=False)
    meta = datamod.load_meta(folder)
    raw = text.encode("utf-8")
    n_val = int(len(raw) * 0.1)
    assert (meta["train_tokens"], meta["val_tokens"], meta["vocab_size"]) == (len(raw) - n_val, n_val, 256)
    train_ids = np.fromfile(os.path.join(folder, "train.bin"), dtype=np.uint16)
    val_ids = np.fromfile(os.path.join(folder, "val.bin"), dtype=np.uint16)
    assert bytes(np.concatenate([train_ids, val_ids]).astype(np.uint8)) == raw
    mtime = os.path.getmtime(os.path.join(folder, "meta.json"))
    assert datamod.prepare(str(tmp_path / "a.txt"), "byte", data_dir=str(tmp_path / "d"), verbose=False) == folder
    assert os.path.getmtime(os.path.join(folder, "meta.json")) == mtime  # prepared once


def test_prepare_folder_with_val_file_and_compression(tmp_path):
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "train_a.txt").write_text("alpha " * 50, encoding="utf-8")
    with gzip.open(src / "train_b.md.gz", "wt", encoding="utf-8") as f:
        f.write("beta " * 50)
    (src / "val.txt").write_text("gamma " * 20, encoding="utf-8")
    (src / "skip.bin").write_bytes(b"\x00\x01")
    folder = datamod.prepare(str(src), "byte", data_dir=str(tmp_path / "d"), verbose=False)
    meta = datamod.load_meta(folder)
    assert meta["train_tokens"] == len("alpha " * 50) + len("beta " * 50)
    assert meta["val_tokens"] == len("gamma " * 20)


def test_gpt2_chunked_encoding_matches_whole():
    tok = datamod.get_tokenizer("auto", verbose=False)
    if tok.name != "gpt2":
        pytest.skip("tiktoken gpt2 files not available offline (set TIKTOKEN_CACHE_DIR)")
    text = open(argparse.__file__, encoding="utf-8").read()
    pieces = datamod.split_chunks(text, size=2000)
    assert len(pieces) > 10 and "".join(pieces) == text
    ids = datamod.tokenize_docs([text], tok, procs=1)
    assert ids[-1] == tok.eot
    assert ids[:-1].tolist() == tok.enc.encode(text, allowed_special={"<|endoftext|>"})


def test_unknown_dataset_and_tokenizer():
    with pytest.raises(ValueError, match="--dataset"):
        datamod.check_dataset_arg("/no/such/path")
    with pytest.raises(ValueError, match="gpt2, byte"):
        datamod.get_tokenizer("bpe")


def test_batches_deterministic_and_fixed_val_windows(corpus, tmp_path):
    folder = datamod.prepare(corpus[0], "byte", data_dir=corpus[1], verbose=False)
    b = datamod.Batches(folder, block_size=16, seed=3)
    x1, y1 = b.train_batch(5, step=7, micro=1)
    x2, y2 = b.train_batch(5, step=7, micro=1)
    x3, _ = b.train_batch(5, step=7, micro=0)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and not torch.equal(x1, x3)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one
    # validation: the same windows whatever the batch size or the number of ranks
    ref = torch.cat([x for x, _ in b.val_batches(24, batch_size=24)])
    assert ref.shape == (24, 16)
    for bs in (1, 5, 7):
        assert torch.equal(torch.cat([x for x, _ in b.val_batches(24, batch_size=bs)]), ref)
    r0 = torch.cat([x for x, _ in b.val_batches(24, 4, rank=0, world=2)])
    r1 = torch.cat([x for x, _ in b.val_batches(24, 4, rank=1, world=2)])
    assert sorted(map(tuple, torch.cat([r0, r1]).tolist())) == sorted(map(tuple, ref.tolist()))
    starts = b.val_starts(24)
    assert starts[0] == 0 and starts[-1] == b.n["val"] - 17


def test_max_tokens_is_part_of_the_cache_identity(tmp_path):
    text = open(argparse.__file__, encoding="utf-8").read()
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    n = len(text.encode("utf-8"))
    n_train = n - int(n * 0.1)
    src, dd = str(tmp_path / "a.txt"), str(tmp_path / "d")
    capped = datamod.prepare(src, "byte", data_dir=dd, max_tokens=5000, verbose=False)
    full = datamod.prepare(src, "byte", data_dir=dd, verbose=False)   # a later run without the cap
    assert capped != full and capped.endswith("-max5000")
    assert datamod.load_meta(capped)["train_tokens"] == 5000 and datamod.load_meta(capped)["max_tokens"] == 5000
    assert datamod.load_meta(full)["train_tokens"] == n_train and datamod.load_meta(full)["max_tokens"] is None
    assert os.path.getsize(os.path.join(full, "train.bin")) == 2 * n_train   # uint16 tokens
    # a folder left by an older data.py under the uncapped name, holding capped data and no record
    # of the cap or the sources, is prepared again instead of being used
    meta = datamod.load_meta(full)
    np.fromfile(os.path.join(capped, "train.bin"), dtype=np.uint16).tofile(os.path.join(full, "train.bin"))
    old = {k: v for k, v in meta.items() if k not in ("max_tokens", "source_files")}
    with open(os.path.join(full, "meta.json"), "w") as f:
        json.dump(dict(old, train_tokens=5000), f)
    assert datamod.prepare(src, "byte", data_dir=dd, verbose=False) == full
    assert datamod.load_meta(full)["train_tokens"] == n_train
    assert os.path.getsize(os.path.join(full, "train.bin")) == 2 * n_train
    # a prepared folder given directly is used as it is, but not with another cap
    assert datamod.prepare(capped, "byte", max_tokens=5000, verbose=False) == capped
    with pytest.raises(ValueError, match="--max_tokens 4000.*cap 5000"):
        datamod.prepare(capped, "byte", max_tokens=4000, verbose=False)
    for bad in (0, -5, 2.5):
        with pytest.raises(ValueError, match="--max_tokens"):
            datamod.prepare(src, "byte", data_dir=dd, max_tokens=bad, verbose=False)


def _prepare_in_child(args, q):
    try:
        q.put(("ok", datamod.prepare(*args, verbose=False)))
    except Exception as e:  # reported to the parent, which asserts on it
        q.put(("error", repr(e)))


def test_concurrent_preparations_of_one_corpus_wait_for_each_other(tmp_path):
    # a sweep started together: every run asks for the same new corpus at once
    src, dd = tmp_path / "src", str(tmp_path / "d")
    src.mkdir()
    words = np.array(["alpha", "beta", "gamma", "delta", "\n"])
    text = " ".join(words[np.random.default_rng(0).integers(0, 5, 400_000)])
    (src / "a.txt").write_text(text, encoding="utf-8")
    out = os.path.join(dd, datamod.dataset_name(str(src), "byte"))
    os.makedirs(out)
    open(os.path.join(out, "train.bin.tmp12345"), "wb").write(b"\0" * 10)  # a preparation killed part-way
    busy = runlock.FileLock(out + ".lock")
    busy.acquire()              # a process preparing it right now
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_prepare_in_child, args=((str(src), "byte", dd), q)) for _ in range(3)]
    for p in procs:
        p.start()
    time.sleep(1.0)
    assert all(p.is_alive() for p in procs)          # all three wait for the holder ...
    assert not os.path.exists(os.path.join(out, "train.bin"))   # ... and write nothing meanwhile
    busy.release()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join()
    assert results == [("ok", out)] * 3
    meta = datamod.load_meta(out)
    assert meta["train_tokens"] + meta["val_tokens"] == len(text.encode())
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]   # no temporary file left


def test_batches_keep_reading_the_corpus_they_started_with(tmp_path):
    src, dd = tmp_path / "src", str(tmp_path / "d")
    src.mkdir()
    (src / "a.txt").write_text("alpha beta\n" * 400, encoding="utf-8")
    folder = datamod.prepare(str(src), "byte", data_dir=dd, verbose=False)
    b = datamod.Batches(folder, block_size=16, seed=0)
    x, _ = b.train_batch(4, step=0)
    (src / "a.txt").write_text("gamma delta epsilon\n" * 900, encoding="utf-8")   # edited: prepared again
    assert datamod.prepare(str(src), "byte", data_dir=dd, verbose=False) == folder
    assert datamod.load_meta(folder)["train_tokens"] > b.n["train"]
    assert torch.equal(b.train_batch(4, step=0)[0], x)       # the running reader is not switched mid-run
    assert not torch.equal(datamod.Batches(folder, 16, seed=0).train_batch(4, step=0)[0], x)


def _hold_lock_then(path, then, conn):
    lock = runlock.FileLock(path)
    lock.acquire()
    conn.send(os.getpid())      # a pipe's send is synchronous: sent before the kill below
    if then == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def test_runlock_names_a_live_holder_and_reports_a_killed_one(tmp_path):
    path = str(tmp_path / "x.lock")
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    live = ctx.Process(target=_hold_lock_then, args=(path, "sleep", child))
    live.start()
    assert parent.poll(60)
    pid = parent.recv()
    with pytest.raises(runlock.Locked, match=f"pid {pid} on "):
        runlock.FileLock(path).acquire(wait=False)
    live.kill()
    live.join()
    killed = ctx.Process(target=_hold_lock_then, args=(path, "kill", child))
    killed.start()
    assert parent.poll(60)
    pid = parent.recv()
    killed.join()
    lock = runlock.FileLock(path)
    stale = lock.acquire(wait=False)           # not a hang: the kernel released the killed holder's lock
    assert stale["pid"] == pid                 # and its note says who it was
    lock.release()
    assert not os.path.exists(path)            # a clean release removes the file
    assert runlock.FileLock(path).acquire(wait=False) is None   # and leaves no note


def test_edited_or_renamed_source_is_prepared_again(tmp_path, capsys):
    src, dd = tmp_path / "src", str(tmp_path / "d")
    src.mkdir()
    (src / "a.txt").write_text("alpha " * 100, encoding="utf-8")
    (src / "b.txt").write_text("beta " * 40, encoding="utf-8")
    folder = datamod.prepare(str(src), "byte", data_dir=dd, verbose=False)
    assert datamod.load_meta(folder)["train_tokens"] + datamod.load_meta(folder)["val_tokens"] == 800
    # edit: more text (and a newer mtime)
    with open(src / "a.txt", "a", encoding="utf-8") as f:
        f.write("gamma " * 10)
    st = os.stat(src / "a.txt")
    os.utime(src / "a.txt", (st.st_atime, st.st_mtime + 10))
    capsys.readouterr()
    assert datamod.prepare(str(src), "byte", data_dir=dd) == folder
    assert "source files changed" in capsys.readouterr().out
    meta = datamod.load_meta(folder)
    assert meta["train_tokens"] + meta["val_tokens"] == 860
    # rename (same bytes, same mtime): b.txt becomes the validation split
    os.rename(src / "b.txt", src / "val_b.txt")
    datamod.prepare(str(src), "byte", data_dir=dd, verbose=False)
    meta = datamod.load_meta(folder)
    assert (meta["train_tokens"], meta["val_tokens"]) == (660, 200)
    # unchanged sources: reused, not rewritten
    mtime = os.path.getmtime(os.path.join(folder, "meta.json"))
    datamod.prepare(str(src), "byte", data_dir=dd, verbose=False)
    assert os.path.getmtime(os.path.join(folder, "meta.json")) == mtime


def test_binary_or_non_utf8_file_is_refused(tmp_path):
    dd = str(tmp_path / "d")
    (tmp_path / "blob").write_bytes(b"MZ\x90\x00" + bytes(range(256)) * 40)
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1") * 100)
    with gzip.open(tmp_path / "packed.txt.gz", "wb") as f:
        f.write(b"text\x00\x00\x00binary" * 100)
    for name, why in (("blob", "NUL byte at offset 3"), ("latin1.txt", "invalid byte 0xe9 at offset 3"),
                      ("packed.txt.gz", "NUL byte at offset 4")):
        with pytest.raises(ValueError, match=f"{name}: not .*{why}"):
            datamod.prepare(str(tmp_path / name), "byte", data_dir=dd, verbose=False)
    # a multi-byte character cut by the 8 KB sniff boundary is still text; a bad byte after it is replaced
    ok = ("a" + "\u00e9" * 5000).encode("utf-8") + b"\xff tail\n"
    assert len(ok[:8192].decode("utf-8", errors="ignore").encode()) == 8191   # the cut is mid-character
    (tmp_path / "ok.txt").write_bytes(ok)
    folder = datamod.prepare(str(tmp_path / "ok.txt"), "byte", data_dir=dd, verbose=False)
    meta = datamod.load_meta(folder)
    assert meta["train_tokens"] + meta["val_tokens"] == len(ok) + 2   # U+FFFD is 3 bytes for 1


def test_explicit_gpt2_that_cannot_load_is_an_error_auto_falls_back(tmp_path, monkeypatch, capsys):
    # offline without the tokenizer files: an empty cache, the download fails, nothing loaded yet
    import tiktoken.load
    import tiktoken.registry

    def offline(*a, **k):
        raise ConnectionError("no network")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty_cache"))
    monkeypatch.setattr(tiktoken.load, "read_file", offline)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    (tmp_path / "a.txt").write_text("hello world\n" * 200, encoding="utf-8")
    with pytest.raises(RuntimeError) as e:
        datamod.prepare(str(tmp_path / "a.txt"), "gpt2", data_dir=str(tmp_path / "d"), verbose=False)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and msg.startswith("--tokenizer gpt2: cannot load")
    assert "ConnectionError: no network" in msg and "TIKTOKEN_CACHE_DIR" in msg and "--tokenizer byte" in msg
    with pytest.raises(RunError, match="^--tokenizer gpt2: cannot load"):
        train.main(["--preset", "nano", "--dataset", str(tmp_path / "a.txt"), "--data_dir", str(tmp_path / "d"),
                    "--tokenizer", "gpt2", "--no-plot", "--out_dir", str(tmp_path / "o")])
    assert not os.path.exists(tmp_path / "d")
    capsys.readouterr()
    assert datamod.get_tokenizer("auto").name == "byte"           # the default may fall back, and says so
    assert "falling back to the byte tokenizer" in capsys.readouterr().err
    p = build_parser()
    args = resolve_args(p.parse_args(["--preset", "nano"]), p, cuda=True)   # auto = gpt2 on CUDA
    assert args.tokenizer == "byte" and "falling back" in capsys.readouterr().err


def test_preparation_is_announced_before_it_starts(tmp_path, capsys, monkeypatch):
    (tmp_path / "a.txt").write_text("hello world\n" * 200, encoding="utf-8")
    printed_before_tokenizing = []
    tokenize = datamod.tokenize_docs

    def spy(*a, **k):
        printed_before_tokenizing.append(capsys.readouterr().out)
        return tokenize(*a, **k)
    monkeypatch.setattr(datamod, "tokenize_docs", spy)
    folder = datamod.prepare(str(tmp_path / "a.txt"), "byte", data_dir=str(tmp_path / "d"))
    assert f"[data] preparing {folder} from {tmp_path / 'a.txt'} (byte tokenizer" in printed_before_tokenizing[0]
    capsys.readouterr()
    assert datamod.prepare(str(tmp_path / "a.txt"), "byte", data_dir=str(tmp_path / "d")) == folder
    assert "preparing" not in capsys.readouterr().out               # a prepared dataset is reused quietly


# ---------------------------------------------------------------------------------------------
# train.py: schedule, flags, runs, resume, checkpoints

def test_wsd_schedule_endpoints():
    lr, T = 1.0, 100  # 10 warmup steps, 80 constant, 10 cooldown steps
    f = lambda it: train.get_lr(it, T, lr, "wsd")  # noqa: E731
    assert f(0) == pytest.approx(0.1) and f(4) == pytest.approx(0.5) and f(9) == pytest.approx(1.0)
    assert all(f(it) == 1.0 for it in range(10, 91))      # constant, including the first cooldown step
    assert f(95) == pytest.approx(1 - math.sqrt(0.5))      # 1 - sqrt(u), u = 5/10
    assert f(99) == pytest.approx(1 - math.sqrt(0.9))
    assert f(100) == 0.0
    assert all(f(it) > f(it + 1) for it in range(90, 100))


def test_cosine_and_constant_schedules():
    T = 100
    assert train.get_lr(10, T, 1.0, "cosine") == pytest.approx(1.0)
    assert train.get_lr(55, T, 1.0, "cosine") == pytest.approx(0.1 + 0.9 * 0.5)   # halfway: mean of peak and floor
    assert train.get_lr(100, T, 1.0, "cosine") == pytest.approx(0.1)
    assert train.get_lr(5, T, 1.0, "constant") == pytest.approx(0.6)
    assert train.get_lr(99, T, 1.0, "constant") == 1.0


def _assert_one_line_flag_error(flags, words, capsys):
    """train.py with --preset nano and flags exits 2 with one 'train.py: error:' line holding words."""
    with pytest.raises(SystemExit) as e:
        train.main(["--preset", "nano", *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("train.py: error:")
    for w in words:
        assert w in err


@pytest.mark.parametrize("flags, words", [
    (["--method", "int4"], ["--method", "bf16", "gaussws", "diffq"]),
    (["--optim", "sgd"], ["--optim", "adamw", "zipsr", "zeeden"]),
    (["--schedule", "linear"], ["--schedule", "wsd", "cosine"]),
    (["--parts", "qkv,gate"], ["--parts", "gate", "qkv,out,up,down"]),
    (["--preset", "nano-llama", "--parts", "qkv"], ["--parts", "q,k,v,out,gate,up,down"]),
    (["--b_init", "4", "--b_target", "6"], ["--b_target", "b_init"]),
    (["--dataset", "/no/such/corpus.txt"], ["--dataset", "stdlib"]),
    (["--preset", "gpt5"], ["--preset", "gpt2-124m", "llama-134m"]),
    (["--batch_size", "0"], ["--batch_size"]),
    (["--device", "tpu"], ["--device", "cpu"]),
    (["--no-compile", "--compile_mode", "reduce-overhead"], ["--compile_mode reduce-overhead", "add --compile"]),
])
def test_bad_flags_one_line_error(flags, words, capsys):
    _assert_one_line_flag_error(flags, words, capsys)


def test_batch_larger_than_data(corpus, tmp_path):
    with pytest.raises(RunError, match="--batch_size"):
        train.main(base_args(corpus, tmp_path / "o", "--batch_size", "5000", "--max_iters", "2"))


def test_block_size_beyond_the_data_is_an_error_and_compile_is_announced(corpus, tmp_path, capsys, monkeypatch):
    folder = datamod.prepare(corpus[0], "byte", data_dir=corpus[1], verbose=False)
    longest = datamod.load_meta(folder)["val_tokens"] - 1          # one window of the val split
    with pytest.raises(RunError, match=f"^--block_size 100000: .* use --block_size <= {longest} or more data$"):
        train.main(base_args(corpus, tmp_path / "o", "--block_size", "100000", "--max_iters", "2"))
    capsys.readouterr()
    monkeypatch.setattr(torch, "compile", lambda model, **k: model)  # the announcement, not the compile
    train.main(base_args(corpus, tmp_path / "c", "--compile", "--max_iters", "1"))
    assert "compiling the model (torch.compile, mode default): the first step takes ~1 min" in capsys.readouterr().out


def _tensors_equal(a, b):
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_tensors_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("method, optim", [("gaussws", "zipsr"), ("diffq", "adamw")])
def test_resume_is_bit_identical(corpus, tmp_path, method, optim):
    # N steps, stop, resume, N more == 2N uninterrupted: model (with GaussWS noise state and b_i),
    # optimizer (packed 4-bit states, SR seed), and every logged step loss
    args = base_args(corpus, tmp_path / "a", "--method", method, "--optim", optim, "--max_iters", "12",
                     "--eval_interval", "4")
    train.main(args)
    args_b = [a if a != str(tmp_path / "a") else str(tmp_path / "b") for a in args]
    train.main(args_b + ["--stop_after", "6"])
    assert torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)["iter_num"] == 6
    train.main(args_b + ["--resume"])
    ca = torch.load(tmp_path / "a" / "ckpt.pt", weights_only=True)
    cb = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)
    assert ca["iter_num"] == cb["iter_num"] == 12
    assert _tensors_equal(ca["model"], cb["model"])
    assert _tensors_equal(ca["optimizer"], cb["optimizer"])
    steps = lambda d: [(r["iter"], r["loss"]) for r in read_log(d) if r["type"] == "step"]  # noqa: E731
    assert steps(tmp_path / "a") == steps(tmp_path / "b") and len(steps(tmp_path / "a")) == 12


def test_resume_refuses_other_config_and_corrupt_file(corpus, tmp_path):
    args = base_args(corpus, tmp_path / "o", "--max_iters", "4", "--eval_interval", "2")
    train.main(args)
    with pytest.raises(RunError, match=r"--lr 0\.003 \(checkpoint\) vs 0\.001"):
        train.main(args + ["--lr", "1e-3", "--resume"])
    bad = tmp_path / "broken.pt"
    raw = (tmp_path / "o" / "ckpt.pt").read_bytes()
    bad.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(RunError, match="corrupt or truncated"):
        train.main(args + ["--resume", str(bad)])
    with pytest.raises(RunError, match="no checkpoint"):
        train.main(args + ["--resume", str(tmp_path / "missing.pt")])


def test_nan_stops_and_keeps_last_good_checkpoint(corpus, tmp_path, monkeypatch):
    calls = {"n": 0}
    orig = GPT.forward

    def forward(self, idx, targets=None):
        logits, loss = orig(self, idx, targets)
        if self.training:
            calls["n"] += 1
            if calls["n"] > 7:  # steps 0..6 are fine, step 7 diverges
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", forward)
    out = tmp_path / "o"
    with pytest.raises(RunError, match=r"step 7: training diverged.*step 5\) is left intact"):
        train.main(base_args(corpus, out, "--max_iters", "20", "--eval_interval", "5"))
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 5
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())
    assert not (out / "ckpt.pt.tmp").exists()
    assert read_log(out)[-1]["type"] == "error"


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, {"format": CKPT_FORMAT, "x": torch.arange(5)})
    before = open(path, "rb").read()

    def crashing_save(obj, f):
        f.write(b"partial garbage")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crashing_save)
    with pytest.raises(OSError):
        save_checkpoint(path, {"format": CKPT_FORMAT, "x": torch.arange(9)})
    assert open(path, "rb").read() == before
    assert torch.equal(load_checkpoint(path)["x"], torch.arange(5))


def test_lm_head_switch_signalled_at_90_percent(corpus, tmp_path, monkeypatch):
    from adam4bit import AdamW4bit
    seen, marked, models = [], [], []
    orig_build, orig_progress, orig_mark = train.build_optimizer, AdamW4bit.set_progress, AdamW4bit.mark_lm_head

    def build(args, model, device_type):
        models.append(model)
        return orig_build(args, model, device_type)

    def mark(self, p):
        marked.append(p)
        return orig_mark(self, p)

    def progress(self, f):
        orig_progress(self, f)
        seen.append((f, self.m_rounding_for(marked[0]), self.param_groups[0]["lr"]))

    monkeypatch.setattr(train, "build_optimizer", build)
    monkeypatch.setattr(AdamW4bit, "mark_lm_head", mark)
    monkeypatch.setattr(AdamW4bit, "set_progress", progress)
    train.main(base_args(corpus, tmp_path / "o", "--preset", "nano-llama", "--optim", "zeeden",
                         "--max_iters", "20", "--eval_interval", "10"))
    model = models[0]
    assert len(marked) == 1 and marked[0] is model.lm_head.weight and marked[0] is not model.wte.weight
    assert [f for f, _, _ in seen] == [i / 20 for i in range(20)]
    rules = [r for _, r, _ in seen]
    assert rules == ["rtn"] * 18 + ["sr"] * 2          # SR exactly for the last 10 % of the steps
    peak = seen[10][2]
    assert seen[18][2] == peak and seen[19][2] < peak   # ... which is the WSD cooldown


@pytest.mark.parametrize("method", ["bf16", "gaussws", "diffq"])
@pytest.mark.parametrize("optim", ["adamw", "fp32", "torchao", "zipsr", "zeeden"])
def test_smoke_every_method_and_optimizer(corpus, tmp_path, method, optim):
    out = tmp_path / "o"
    s = train.main(base_args(corpus, out, "--method", method, "--optim", optim, "--max_iters", "20",
                             "--eval_interval", "20"))
    log = read_log(out)
    steps = [r for r in log if r["type"] == "step"]
    evals = [r for r in log if r["type"] == "eval"]
    assert len(steps) == 20 and all(math.isfinite(r["loss"]) for r in steps)
    assert [e["iter"] for e in evals] == [0, 20]
    assert evals[1]["val_loss"] < evals[0]["val_loss"] - 0.3   # 20 steps at lr 3e-3 learn byte statistics
    assert s["final_val_loss"] == evals[1]["val_loss"]
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 20
    if method != "bf16":
        assert "b_t_mean" in steps[0] and "bits" in evals[1]
        assert 4.0 <= steps[-1]["b_t_mean"] <= 6.5


def test_adam_mini_missing_or_runs(corpus, tmp_path):
    try:
        import adam_mini  # noqa: F401
    except ImportError:
        with pytest.raises(RunError, match="pip install adam-mini"):
            train.main(base_args(corpus, tmp_path / "o", "--optim", "adam-mini", "--max_iters", "2"))
        return
    s = train.main(base_args(corpus, tmp_path / "o", "--optim", "adam-mini", "--max_iters", "20",
                             "--eval_interval", "20"))
    assert s["final_val_loss"] < s["first_val_loss"]


def test_bits_lambda_pulls_bitwidth_down(corpus, tmp_path):
    # the penalty lambda * sum_layers mean |b_t - b_target| has gradient toward b_target
    runs = {}
    for lam in ("0", "1.0"):
        s = train.main(base_args(corpus, tmp_path / lam, "--method", "gaussws", "--max_iters", "10",
                                 "--eval_windows", "0", "--bits_wd", "0", "--bits_lambda", lam))
        runs[lam] = s["b_t_mean"]
    assert runs["1.0"] < runs["0"] - 0.05


def test_ddp_two_processes_match_one_process_with_accumulation(corpus, tmp_path, monkeypatch):
    # torchrun with 2 CPU processes (gloo) and --grad_accum 2 reads the same micro-batches as one
    # process with --grad_accum 2, so the per-step losses agree up to float summation order
    # (bench.py --only ddp runs the same comparison on 2 GPUs)
    import bench
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two processes on two cores
    args = base_args(corpus, tmp_path / "unused", "--max_iters", "6", "--eval_interval", "6",
                     "--grad_accum", "2", "--seed", "1")
    res = bench.bench_ddp(args[:args.index("--out_dir")] + args[args.index("--out_dir") + 2:],
                          out_dir=str(tmp_path), nproc=2)
    l1, l2 = res["one"]["step_loss"], res["many"]["step_loss"]
    assert len(l1) == len(l2) == 6
    assert np.allclose(l1, l2, rtol=0, atol=1e-4)
    assert np.allclose(res["one"]["val_loss"], res["many"]["val_loss"], atol=1e-4)


def test_resume_with_another_max_tokens_is_refused(corpus, tmp_path):
    args = base_args(corpus, tmp_path / "o", "--max_iters", "2", "--eval_interval", "2")
    train.main(args + ["--max_tokens", "5000"])
    with pytest.raises(RunError, match=r"--max_tokens 5000 \(checkpoint\) vs None"):
        train.main(args + ["--resume"])


@pytest.mark.parametrize("flags, words", [
    (["--lr", "nan"], ["--lr nan", "> 0"]),
    (["--lr", "inf"], ["--lr inf"]),
    (["--lr", "0"], ["--lr 0"]),
    (["--beta1", "1.5"], ["--beta1 1.5", "[0, 1)"]),
    (["--beta2", "1"], ["--beta2 1", "[0, 1)"]),
    (["--beta2", "-0.1"], ["--beta2"]),
    (["--eps", "-1"], ["--eps -1"]),
    (["--eps", "0"], ["--eps 0"]),
    (["--eps", "inf"], ["--eps inf"]),
    (["--weight_decay", "-1"], ["--weight_decay -1", ">= 0"]),
    (["--weight_decay", "nan"], ["--weight_decay nan"]),
    (["--b_init", "30"], ["--b_init 30", "[1, 24]"]),
    (["--b_target", "-1"], ["--b_target -1"]),
    (["--b_init", "nan"], ["--b_init nan"]),
    (["--bits_wd", "-5"], ["--bits_wd -5"]),
    (["--bits_lambda", "-1"], ["--bits_lambda -1"]),
    (["--grad_clip", "-1"], ["--grad_clip -1", ">= 0"]),
    (["--min_lr_frac", "5"], ["--min_lr_frac 5", "[0, 1]"]),
    (["--warmup_frac", "-0.1"], ["--warmup_frac"]),
    (["--cooldown_frac", "1.5"], ["--cooldown_frac 1.5"]),
    (["--warmup_frac", "0.6", "--cooldown_frac", "0.5"], ["--warmup_frac 0.6", "--cooldown_frac 0.5"]),
    (["--tokens_per_param", "-1"], ["--tokens_per_param -1"]),
    (["--tokens_per_param", "20", "--max_iters", "100"], ["--tokens_per_param", "--max_iters"]),
    (["--max_iters", "10", "--stop_after", "11"], ["--stop_after 11", "--max_iters 10"]),
    (["--stop_after", "0"], ["--stop_after 0"]),
    (["--max_tokens", "0"], ["--max_tokens 0"]),
    (["--max_tokens", "-3"], ["--max_tokens -3"]),
    (["--eval_windows", "-1"], ["--eval_windows -1"]),
    (["--seed", "-1"], ["--seed -1"]),
])
def test_bad_flags_fail_before_data_or_model(flags, words, capsys, monkeypatch, tmp_path):
    def boom(*a, **k):
        raise AssertionError("data prepared or model built before the flags were checked")
    monkeypatch.setattr(datamod, "prepare", boom)
    monkeypatch.setattr(train, "GPT", boom)
    with pytest.raises(SystemExit) as e:
        train.main(["--preset", "nano", "--out_dir", str(tmp_path / "o"), *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("train.py: error:")
    for w in words:
        assert w in err
    assert not (tmp_path / "o").exists()


def test_flags_the_run_does_not_read_are_named_in_one_line(capsys):
    p = build_parser()
    for flags, said in ((["--method", "bf16", "--b_init", "8", "--parts", "qkv"],
                         "note: not used by this run: --parts qkv (with --method bf16), --b_init 8 (with --method bf16)"),
                        (["--schedule", "cosine", "--cooldown_frac", "0.2"],
                         "note: not used by this run: --cooldown_frac 0.2 (with --schedule cosine)"),
                        (["--method", "gaussws", "--b_init", "8", "--min_lr_frac", "0.2"],
                         "note: not used by this run: --min_lr_frac 0.2 (with --schedule wsd)"),
                        (["--method", "bf16", "--schedule", "cosine", "--min_lr_frac", "0.2"], "")):
        resolve_args(p.parse_args(["--preset", "nano", *flags]), p, cuda=False)
        assert capsys.readouterr().out.strip() == said, flags


def test_edge_flag_values_are_accepted():
    p = build_parser()
    args = p.parse_args(["--preset", "nano", "--beta1", "0", "--grad_clip", "0", "--warmup_frac", "0",
                         "--cooldown_frac", "1", "--min_lr_frac", "1", "--b_init", "24", "--b_target", "1",
                         "--bits_wd", "0", "--weight_decay", "0", "--eval_windows", "0",
                         "--max_iters", "7", "--stop_after", "7"])
    resolve_args(args, p, cuda=False)
    assert (args.max_iters, args.stop_after, args.eval_windows) == (7, 7, 0)
    args = p.parse_args(["--preset", "nano", "--tokens_per_param", "0.5"])
    resolve_args(args, p, cuda=False)
    assert args.max_iters is None        # set from the parameter count once the model exists
    for schedule in ("cosine", "constant"):  # --cooldown_frac is WSD's: not summed with the warmup there
        resolve_args(p.parse_args(["--preset", "nano", "--schedule", schedule, "--warmup_frac", "0.95"]), p,
                           cuda=False)
    args = p.parse_args(["--preset", "nano"])
    resolve_args(args, p, cuda=False)
    assert args.max_iters == 300 and args.eval_windows is None   # CPU default; windows capped later


def test_eval_windows_limited_by_the_val_split(tmp_path, capsys):
    text = open(argparse.__file__, encoding="utf-8").read()[:30000]
    (tmp_path / "small.txt").write_text(text, encoding="utf-8")
    common = ["--preset", "nano", "--dataset", str(tmp_path / "small.txt"), "--data_dir", str(tmp_path / "d"),
              "--tokenizer", "byte", "--batch_size", "4", "--no-plot", "--max_iters", "2"]
    n_val = int(len(text.encode("utf-8")) * 0.1)
    fit = (n_val - 1) // 64                       # non-overlapping windows of the nano block (64)
    assert fit < 64                               # so the CPU default of 64 does not fit
    with pytest.raises(RunError, match=f"--eval_windows {fit + 1}: .* at most {fit} .*<= {fit}"):
        train.main(common + ["--out_dir", str(tmp_path / "a"), "--eval_windows", str(fit + 1)])
    capsys.readouterr()
    s = train.main(common + ["--out_dir", str(tmp_path / "b")])   # auto: capped, with a message
    assert f"eval on {fit} windows" in capsys.readouterr().out
    assert s["final_val_loss"] is not None
    assert torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)["config"]["eval_windows"] == fit


def test_stop_after_beyond_tokens_per_param_steps(corpus, tmp_path):
    # max_iters from --tokens_per_param is only known once the model is built
    with pytest.raises(RunError, match=r"--stop_after 1000: must be <= max_iters \d+ \(from --tokens_per_param"):
        train.main(base_args(corpus, tmp_path / "o", "--tokens_per_param", "0.01", "--stop_after", "1000"))


def test_resume_covers_the_whole_run_and_a_finished_run_is_left_alone(corpus, tmp_path, capsys):
    out = tmp_path / "o"
    args = base_args(corpus, out, "--max_iters", "8", "--eval_interval", "4")
    train.main(args + ["--stop_after", "4"])
    assert (f"stopped at --stop_after 4 of 8 steps; continue with: python train.py {shlex.join(args)} --resume"
            in capsys.readouterr().out.splitlines())      # the command without --stop_after
    first = [r for r in read_log(out) if r["type"] == "eval"][0]
    assert first["iter"] == 0
    # asking again for the same --stop_after: nothing to do, the log stays
    before = (out / "log.jsonl").read_bytes()
    capsys.readouterr()
    train.main(args + ["--stop_after", "4", "--resume"])
    assert "already at --stop_after 4" in capsys.readouterr().out
    assert (out / "log.jsonl").read_bytes() == before
    # resumed into another --out_dir, the new log holds one eval: its value, no "X -> X"
    capsys.readouterr()
    other = train.main(base_args(corpus, tmp_path / "n", "--max_iters", "8", "--eval_interval", "4")
                       + ["--resume", str(out)])
    printed = capsys.readouterr().out
    v = other["final_val_loss"]
    assert f"val loss {v:.4f}, " in printed and f"{v:.4f} ->" not in printed
    # resume to the end: first -> last val loss spans the whole run, not just the resumed part
    s = train.main(args + ["--resume"])
    log = read_log(out)
    evals = [r for r in log if r["type"] == "eval"]
    assert [e["iter"] for e in evals] == [0, 4, 8]
    assert s["first_val_loss"] == first["val_loss"] and s["final_val_loss"] == evals[-1]["val_loss"]
    assert s["best_val_loss"] == min(e["val_loss"] for e in evals)
    assert [r["type"] for r in log].count("summary") == 1
    printed = capsys.readouterr().out
    assert f"val loss {first['val_loss']:.4f} -> {evals[-1]['val_loss']:.4f}" in printed
    # resuming the finished run: says so, returns the original summary, log.jsonl untouched
    before = (out / "log.jsonl").read_bytes()
    ckpt_before = (out / "ckpt.pt").read_bytes()
    again = train.main(args + ["--resume"])
    assert "is at step 8 of 8, the run is finished" in capsys.readouterr().out
    assert again == log[-1] and again["final_val_loss"] == evals[-1]["val_loss"]
    train.main(args + ["--max_iters", "6", "--resume"])
    assert "is at step 8, past --max_iters 6; nothing to do" in capsys.readouterr().out
    assert (out / "log.jsonl").read_bytes() == before and (out / "ckpt.pt").read_bytes() == ckpt_before


class _NotATensor:
    pass


def test_unreadable_checkpoint_is_one_clear_line(tmp_path):
    good = tmp_path / "good.pt"
    save_checkpoint(str(good), {"format": CKPT_FORMAT, "x": torch.arange(1000)})
    # (where the cut lands decides which error torch.load gives; each must come out as one line)
    raw = good.read_bytes()
    (tmp_path / "half.pt").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "empty.pt").write_bytes(b"")
    torch.save({"format": CKPT_FORMAT, "x": _NotATensor()}, tmp_path / "pickled.pt")
    for name, reason in (("half.pt", "?): "), ("empty.pt", "the file is empty"), ("pickled.pt", "_NotATensor")):
        path = str(tmp_path / name)
        with pytest.raises(RunError) as e:
            load_checkpoint(path)
        msg = str(e.value)
        assert len(msg.splitlines()) == 1 and path in msg and "corrupt or truncated" in msg and reason in msg
        assert "weights_only" not in msg and "Weights only load failed" not in msg
    (tmp_path / "log.jsonl").write_text('{"type": "eval"}\n')     # a run's log given for its checkpoint
    with pytest.raises(RunError, match=r"log.jsonl is not a checkpoint \(not a file torch.save writes\)"):
        load_checkpoint(str(tmp_path / "log.jsonl"))


def test_resume_of_a_finished_run_whose_summary_was_cut_writes_it(corpus, tmp_path):
    """A finished run whose log lost its summary line mid-write (or ends in bytes that are not
    UTF-8): --resume trains zero steps and writes the summary, with the final val loss of its last
    eval, instead of leaving the run without one."""
    out = tmp_path / "run"
    args = base_args(corpus, out, "--max_iters", "4", "--eval_interval", "2")
    done = train.main(args)
    raw = (out / "log.jsonl").read_bytes()
    (out / "log.jsonl").write_bytes(raw[:raw.rindex(b'{"type": "summary"') + 30] + b"\xff\xfe")
    assert not [r for r in read_run_log(str(out / "log.jsonl")) if r["type"] == "summary"]
    again = train.main(args + ["--resume"])
    log = read_run_log(str(out / "log.jsonl"))
    assert log[-1] == again and again["iters"] == 4 and again["final_val_loss"] == done["final_val_loss"]
    assert [r["type"] for r in log].count("summary") == 1


def test_a_data_dir_that_cannot_be_made_is_named(corpus, tmp_path):
    """--data_dir where no folder can be made: one line naming the flag, not a bare OSError."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(RunError, match=r"^--data_dir .*file/sub: cannot prepare the dataset there \("):
        train.main(base_args(corpus, tmp_path / "run", "--max_iters", "1", "--data_dir", str(blocker / "sub")))


def test_edited_checkpoint_that_loads_but_does_not_fit_is_one_line(corpus, tmp_path):
    """A checkpoint of this configuration edited by hand (a tensor reshaped, a key or the RNG state
    removed, another optimizer's state) stops --resume with one line naming the file."""
    out = tmp_path / "run"
    args = base_args(corpus, out, "--max_iters", "4", "--eval_interval", "2")
    train.main(args + ["--stop_after", "2"])
    path = out / "ckpt.pt"
    good = torch.load(path, weights_only=False)
    def edit_model(c):
        c["model"]["wte.weight"] = c["model"]["wte.weight"][:-1]
    def drop_rng(c):
        del c["rng"]
    def other_optimizer(c):
        c["optimizer"]["param_groups"] = c["optimizer"]["param_groups"] * 2
    for edit in (edit_model, drop_rng, other_optimizer):
        c = {**good, "model": dict(good["model"]), "optimizer": dict(good["optimizer"])}
        edit(c)
        torch.save(c, path)
        with pytest.raises(RunError) as e:
            train.main(args + ["--resume"])
        msg = str(e.value)
        assert len(msg.splitlines()) == 1 and str(path) in msg and "does not fit" in msg, (edit.__name__, msg)


def test_parts_with_spaces_read_as_apply_pqt_reads_them(corpus, tmp_path):
    parser = build_parser()
    args = parser.parse_args(base_args(corpus, tmp_path, "--method", "gaussws", "--parts", "qkv, out"))
    resolve_args(args, parser, cuda=False)
    assert args.parts == "qkv,out"


def test_binary_file_in_train_py_is_a_one_line_error(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\x00" * 5000)
    with pytest.raises(RunError, match="weights.bin: not a text file"):
        train.main(["--preset", "nano", "--dataset", str(tmp_path / "weights.bin"), "--data_dir",
                    str(tmp_path / "d"), "--tokenizer", "byte", "--no-plot", "--out_dir", str(tmp_path / "o")])


def test_validation_tail_is_announced_and_documented(tmp_path, capsys):
    src = tmp_path / "books"
    src.mkdir()
    (src / "a.txt").write_text("alpha beta\n" * 100, encoding="utf-8")
    folder = datamod.prepare(str(src), "byte", data_dir=str(tmp_path / "d"))
    out = capsys.readouterr().out
    assert "no validation file" in out and "last 10 %" in out and "(110)" in out
    assert datamod.load_meta(folder)["val_split"] == "last 10 %"
    (src / "val.txt").write_text("gamma\n" * 10, encoding="utf-8")
    datamod.prepare(str(src), "byte", data_dir=str(tmp_path / "d"))
    assert "no validation file" not in capsys.readouterr().out
    assert datamod.load_meta(folder)["val_split"] == "val* files"
    with pytest.raises(SystemExit):
        train.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "named val*, otherwise the last 10% of the tokens" in help_text


def _optimizer(argv):
    p = build_parser()
    a = resolve_args(p.parse_args(argv), p, False)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(64, 128))
    model.lm_head = torch.nn.Linear(128, 4096, bias=False)
    return train.build_optimizer(a, model, "cpu")


def test_v_flags_reach_adamw4bit():
    q = _optimizer(["--optim", "zipsr", "--v_rounding", "state-sr"]).qcfg
    assert (q["v_codebook"], q["v_rounding"], q["m_codebook"]) == ("dyn4", "state-sr", "nf4")
    q = _optimizer(["--optim", "torchao", "--v_codebook", "dyn4", "--v_rounding", "update-rtn"]).qcfg
    assert (q["v_codebook"], q["v_rounding"], q["m_codebook"]) == ("dyn4", "update-rtn", "sdyn4")
    assert _optimizer(["--optim", "zeeden"]).qcfg["v_codebook"] == "dyn4_nz"     # none given: the preset's


@pytest.mark.parametrize("argv,msg", [
    (["--optim", "zipsr", "--v_rounding", "bogus"], "argument --v_rounding: invalid choice: 'bogus'"),
    (["--optim", "zipsr", "--v_codebook", "dyn5"], "argument --v_codebook: invalid choice: 'dyn5'"),
    (["--optim", "adamw", "--v_rounding", "state-rtn"], "--v_rounding state-rtn: only for the 4-bit AdamW presets"),
    (["--optim", "adam-mini", "--v_codebook", "dyn4"], "not --optim adam-mini"),
    (["--optim", "zipsr", "--v_codebook", "nf4"], "--v_codebook nf4 with --optim zipsr: v_rounding='update-sr' "
                                                   "needs a nonnegative v_codebook"),
    (["--optim", "fp32", "--v_rounding", "state-rtn"], "(--optim torchao|zipsr|zeeden), not --optim fp32"),
])
def test_bad_v_flags_give_one_line_errors(argv, msg, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        train.main(["--preset", "nano", "--out_dir", str(tmp_path / "never"), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1
    assert not os.path.exists(tmp_path / "never")               # refused before data and model


def test_v_flags_are_in_the_run_config_for_resume(corpus, tmp_path, capsys):
    a = nano_args(corpus, "--optim", "zipsr", "--v_rounding", "state-rtn", "--max_iters", "2", "--no-plot",
                  "--out_dir", str(tmp_path))
    train.main(a)
    lr = DEFAULT_LR["nano"]
    assert f"optimizer zipsr --v_rounding state-rtn, lr {lr:g} (wsd), 2 steps of" in capsys.readouterr().out
    cfg = torch.load(tmp_path / "ckpt.pt", weights_only=True)["config"]
    assert (cfg["v_rounding"], cfg["v_codebook"]) == ("state-rtn", None)
    with pytest.raises(RunError, match=r"--v_rounding 'state-rtn' \(checkpoint\) vs 'state-sr' \(now\)"):
        train.main([x if x != "state-rtn" else "state-sr" for x in a] + ["--resume"])


def test_cpu_threads_chosen_and_an_explicit_choice_kept(corpus, tmp_path, monkeypatch, capsys):
    p, proc = build_parser(), Process(ddp=False, rank=0, world=1, device="cpu")

    def threads_after_setup(*flags, torch_default=4, caller=None):
        monkeypatch.setattr(train, "TORCH_THREADS", torch_default)   # as if imported on a 4-core machine
        torch.set_num_threads(caller or torch_default)
        train.setup_threads(p.parse_args(["--preset", "nano", *flags]), proc)
        return torch.get_num_threads(), capsys.readouterr().out
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    try:
        n, out = threads_after_setup()
        assert n == 3 and out.startswith("CPU threads: 3 (4 cores less one") and "--threads N" in out
        assert threads_after_setup("--threads", "2")[0] == 2
        assert threads_after_setup(caller=2)[0] == 2                   # torch.set_num_threads before main
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        n, out = threads_after_setup(torch_default=2)
        assert n == 2 and "(OMP_NUM_THREADS)" in out
    finally:
        torch.set_num_threads(1)
    train.main(base_args(corpus, tmp_path / "o", "--threads", "1", "--max_iters", "1"))
    assert "CPU threads: 1 (--threads)" in capsys.readouterr().out


def test_startup_line_says_which_tensors_get_4bit_states(corpus, tmp_path, capsys):
    train.main(base_args(corpus, tmp_path / "o", "--optim", "zipsr", "--max_iters", "1"))
    # nano: wte 256x32 and the MLP's up/down 128x32 (x2 layers) are >= 4096 and a multiple of 128;
    # qkv 96x32, out 32x32, wpe 64x32 and the norms stay FP32, the largest named first
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("4-bit states")] == [
        "4-bit states: 5 tensors (24.6k params); FP32 states: 10 tensors (10.4k params: blocks.0.attn.qkv.weight, "
        "blocks.1.attn.qkv.weight, wpe.weight, blocks.0.attn.out.weight, +6 more)"]
    m = nn.Linear(64, 66, bias=False)    # 4224 elements: >= 4096 but not a multiple of a 1024 block
    assert train.quantized_summary(m, A.AdamW4bit(m.parameters(), preset="zipsr", block_size=1024)) == (
        "4-bit states: 0 tensors (0 params); FP32 states: 1 tensors (4.2k params: weight)")


class _Killed(BaseException):
    """A kill at a chosen point: not an Exception, so nothing on the way catches it."""


def test_resume_rewrites_the_log_atomically(corpus, tmp_path, monkeypatch):
    # --resume rewrites log.jsonl (the records up to its checkpoint); a kill during the rewrite
    # (here: while the third record is written) leaves the old log whole
    out = tmp_path / "o"
    args = base_args(corpus, out, "--max_iters", "8", "--eval_interval", "4")
    train.main(args + ["--stop_after", "4"])
    before = (out / "log.jsonl").read_bytes()
    dumps = json.dumps

    def killed_at_step_2(obj, *a, **k):
        if isinstance(obj, dict) and obj.get("type") == "step" and obj.get("iter") == 2:
            raise _Killed
        return dumps(obj, *a, **k)

    monkeypatch.setattr(json, "dumps", killed_at_step_2)
    with pytest.raises(_Killed):
        train.main(args + ["--resume"])
    monkeypatch.undo()
    assert (out / "log.jsonl").read_bytes() == before
    assert not (out / "log.jsonl.tmp").exists()
    train.main(args + ["--resume"])
    assert [r["iter"] for r in read_log(out) if r["type"] == "step"] == list(range(8))


def test_torn_last_log_line_is_skipped_and_a_bad_middle_line_is_named(corpus, tmp_path, capsys):
    out = tmp_path / "o"
    args = base_args(corpus, out, "--max_iters", "8", "--eval_interval", "4")
    train.main(args + ["--stop_after", "4"])
    good = (out / "log.jsonl").read_text()
    (out / "log.jsonl").write_text(good + '{"type": "step", "iter": 4, "lo')   # a kill mid-append
    capsys.readouterr()
    train.main(args + ["--resume"])
    printed = [x for x in capsys.readouterr().out.splitlines() if "cut off" in x]
    assert printed == [f"{out / 'log.jsonl'}: skipped its last line {len(good.splitlines()) + 1}, cut off "
                       f"mid-write (Unterminated string starting at)"]
    assert [r["iter"] for r in read_log(out) if r["type"] == "step"] == list(range(8))
    lines = (out / "log.jsonl").read_text().splitlines()
    lines[2] = lines[2][:10]                                  # not the last line: an error
    (out / "log.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(RunError, match=r"log\.jsonl line 3 is not a JSON record \(.*\); fix or delete"):
        train.main(args + ["--resume"])
    for bad in ('{"type": "step"}', "[1, 2]", "3"):               # JSON, but not one of our records
        lines[2] = bad
        (out / "log.jsonl").write_text("\n".join(lines) + "\n")
        with pytest.raises(RunError, match=r"log\.jsonl line 3 is not a record of this trainer"):
            train.main(args + ["--resume"])


def test_unwritable_out_dir_and_full_disk_are_one_line_errors(corpus, tmp_path, monkeypatch):
    import errno

    def boom(*a, **k):
        raise AssertionError("data prepared before --out_dir was checked")

    (tmp_path / "a_file").write_text("x")
    bad = [(tmp_path / "a_file", "File exists"), (tmp_path / "a_file" / "o", "Not a directory")]
    if os.geteuid() != 0:   # root writes into read-only folders
        (tmp_path / "ro").mkdir(mode=0o555)
        bad.append((tmp_path / "ro", "Permission denied"))
    with monkeypatch.context() as m:
        m.setattr(datamod, "prepare", boom)
        for out, reason in bad:
            with pytest.raises(RunError) as e:
                train.main(base_args(corpus, out, "--max_iters", "2"))
            assert str(e.value) == f"--out_dir {out}: cannot write there ({reason})"
    # a full disk at the second checkpoint: the temp file goes, the first checkpoint stays
    out, save, calls = tmp_path / "full", torch.save, []

    def full_disk(obj, f):
        calls.append(1)
        if len(calls) == 1:
            return save(obj, f)
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(RunError) as e:
        train.main(base_args(corpus, out, "--max_iters", "4", "--eval_interval", "2"))
    assert str(e.value) == (f"--out_dir {out}: cannot write the checkpoint for step 4 (No space left on device); "
                            f"{out / 'ckpt.pt'} (step 2) is left intact")
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"]
    monkeypatch.undo()
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 2


def _run_until_first_step(argv, out, launch=(sys.executable,)):
    """Start `launch train.py argv` and return the Popen once log.jsonl holds a step record."""
    import time
    p = subprocess.Popen([*launch, train.__file__, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.time() + 300
    log = os.path.join(out, "log.jsonl")
    while not (os.path.exists(log) and '"type": "step"' in open(log).read()):
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.01)
    return p


@pytest.mark.parametrize("signame, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_interrupt_saves_a_checkpoint_and_resume_is_bit_identical(corpus, tmp_path, signame, code):
    import signal
    args = base_args(corpus, tmp_path / "a", "--max_iters", "40", "--eval_interval", "20")
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    train.main(args)                                                   # the uninterrupted run
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    out = tmp_path / "b"
    args_b = [a if a != str(tmp_path / "a") else str(out) for a in args]
    p = _run_until_first_step(args_b, out)
    p.send_signal(getattr(signal, signame))
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == code and "Traceback" not in stderr, stderr
    stopped = torch.load(out / "ckpt.pt", weights_only=True)["iter_num"]
    assert 1 <= stopped < 40
    assert [r["iter"] for r in read_log(out) if r["type"] == "step"] == list(range(stopped))
    cmd = f"python train.py {shlex.join(args_b)} --resume"
    assert f"{signame}: stopped at step {stopped} with a checkpoint in {out / 'ckpt.pt'}; continue with: {cmd}" \
        in stdout.splitlines()
    train.main(shlex.split(cmd)[2:])
    ca = torch.load(tmp_path / "a" / "ckpt.pt", weights_only=True)
    cb = torch.load(out / "ckpt.pt", weights_only=True)
    assert ca["iter_num"] == cb["iter_num"] == 40
    assert _tensors_equal(ca["model"], cb["model"]) and _tensors_equal(ca["optimizer"], cb["optimizer"])
    steps = lambda d: [(r["iter"], r["loss"]) for r in read_log(d) if r["type"] == "step"]  # noqa: E731
    assert steps(tmp_path / "a") == steps(out) and len(steps(out)) == 40


def test_ddp_interrupt_of_one_rank_stops_every_rank_at_one_step(corpus, tmp_path):
    # SIGTERM to rank 1 only: rank 0 (no signal) stops at the same step and writes the checkpoint
    import contextlib
    import signal
    out = tmp_path / "o"
    args = base_args(corpus, out, "--max_iters", "400", "--eval_interval", "200", "--grad_accum", "2")
    p = _run_until_first_step(args, out, (sys.executable, "-m", "torch.distributed.run", "--standalone",
                                          "--nproc_per_node", "2"))
    ranks = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
            if env.get(b"TORCHELASTIC_RUN_ID") and str(out).encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                ranks.append((int(env.get(b"RANK", b"-1")), int(pid)))
    rank1 = [pid for r, pid in ranks if r == 1]
    assert len(rank1) == 1, ranks
    os.kill(rank1[0], signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=300)
    stopped = torch.load(out / "ckpt.pt", weights_only=True)["iter_num"]
    assert 1 <= stopped < 400
    assert [r["iter"] for r in read_log(out) if r["type"] == "step"] == list(range(stopped))
    assert (f"SIGTERM: stopped at step {stopped} with a checkpoint in {out / 'ckpt.pt'}; continue with: "
            f"torchrun --standalone --nproc_per_node 2 train.py ") in stdout, (stdout, stderr)


def test_fresh_run_into_a_checkpoint_needs_resume_or_overwrite(corpus, tmp_path, capsys):
    out = tmp_path / "o"
    args = base_args(corpus, out, "--max_iters", "2", "--eval_interval", "2")
    train.main(args)
    before = (out / "ckpt.pt").read_bytes(), (out / "log.jsonl").read_bytes()
    with pytest.raises(RunError) as e:
        train.main(args + ["--seed", "1"])
    assert str(e.value) == (f"--out_dir {out} holds a plain checkpoint ({out / 'ckpt.pt'}): continue that run with "
                            f"--resume, or start over with --overwrite (removes it and replaces log.jsonl)")
    assert ((out / "ckpt.pt").read_bytes(), (out / "log.jsonl").read_bytes()) == before
    train.main(args + ["--seed", "1", "--overwrite"])
    assert torch.load(out / "ckpt.pt", weights_only=True)["config"]["seed"] == 1
    assert [r["type"] for r in read_log(out)].count("summary") == 1
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train.main(args + ["--overwrite", "--resume"])
    assert "--overwrite and --resume: give one of them" in capsys.readouterr().err


def test_wsd_schedule_recomputed_for_a_longer_run():
    # the continuity facts the --max_iters help and the module docstring state (T = 100 -> N)
    f = lambda it, n: train.get_lr(it, n, 1.0, "wsd")  # noqa: E731
    assert all(f(it, 100) == f(it, 200) == 1.0 for it in range(20, 90))   # stopped on both plateaus: no jump
    assert f(99, 100) == pytest.approx(1 - math.sqrt(1 - 1 / 10)) and f(100, 100) == 0.0   # finished, cooled down
    assert f(100, 200) == 1.0 and all(f(it, 200) == 1.0 for it in range(100, 181))      # back to the plateau
    assert all(f(it, 200) > f(it + 1, 200) for it in range(180, 200)) and f(200, 200) == 0.0   # new cooldown
    assert f(100, 112) == 1.0 and f(100, 110) < 1.0      # T on the new plateau iff T < N - round(0.1 N)
    assert f(100, 105) == pytest.approx(1 - math.sqrt(0.5))    # else the new cooldown's lr (D = 10, u = 5/10)
    assert f(100, 1004) == 1.0                                 # ... and the new warmup round(0.1 N) <= T
    assert f(100, 2000) == pytest.approx(101 / 200)            # else the new warmup's lr


def test_resume_with_larger_max_iters_trains_longer(corpus, tmp_path, capsys):
    out = tmp_path / "o"
    args = base_args(corpus, out, "--eval_interval", "10")
    train.main(args + ["--max_iters", "20"])
    capsys.readouterr()
    train.main(args + ["--max_iters", "20", "--resume"])
    assert "Raise --max_iters to train longer" in capsys.readouterr().out
    s = train.main(args + ["--max_iters", "30", "--resume"])
    log = read_log(out)
    steps = [r for r in log if r["type"] == "step"]
    assert [r["iter"] for r in steps] == list(range(30))
    lr = DEFAULT_LR["nano"]
    assert [r["lr"] for r in steps[20:]] == [train.get_lr(it, 30, lr) for it in range(20, 30)]
    assert steps[19]["lr"] < lr and steps[20]["lr"] == lr    # from the cooled-down lr back to the plateau
    assert [r["iter"] for r in log if r["type"] == "eval"] == [0, 10, 20, 30]
    assert s["iters"] == s["max_iters"] == 30 and [r["type"] for r in log].count("summary") == 1
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 30
    # --tokens_per_param may change as well; other flags still may not
    train.main(args + ["--tokens_per_param", "0.25", "--resume"])     # 0.25 x 34,976 params / 256 tokens: 35 steps
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 35
    with pytest.raises(RunError, match="--seed 0 \\(checkpoint\\) vs 1"):
        train.main(args + ["--max_iters", "400", "--seed", "1", "--resume"])



# ---------------------------------------------------------------------------------------------
# train.py: runs that meet (one --out_dir per run, resumes across folders, signals)

def test_a_second_run_into_a_folder_in_use_is_refused_and_a_killed_holder_is_reported(corpus, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    holder = ctx.Process(target=_hold_lock_then, args=(str(out / ".lock"), "sleep", child), daemon=True)
    holder.start()
    try:
        assert parent.poll(60)
        pid = parent.recv()
        with pytest.raises(RunError, match=rf"--out_dir {re.escape(str(out))} is in use by another run \(pid {pid} "):
            train.main(base_args(corpus, out, "--max_iters", "2"))
        assert not os.path.exists(out / "log.jsonl")      # the refused run wrote nothing there
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join()
    capsys.readouterr()
    train.main(base_args(corpus, out, "--max_iters", "2"))   # the kernel released the killed holder's lock
    said = capsys.readouterr().out
    assert f"the run that held it (pid {pid} " in said and "ended without releasing it" in said
    train.main(base_args(corpus, out, "--max_iters", "3", "--resume"))   # a clean exit leaves no note behind
    assert "ended without releasing it" not in capsys.readouterr().out
    assert not os.path.exists(out / ".lock")                               # nor the lock file


def test_resume_into_a_folder_holding_another_run_is_refused_unless_overwrite(corpus, tmp_path):
    run1, run2, run3 = tmp_path / "run1", tmp_path / "run2", tmp_path / "run3"
    train.main(base_args(corpus, run1, "--max_iters", "4", "--stop_after", "2"))
    train.main(base_args(corpus, run2, "--max_iters", "4", "--stop_after", "2", "--seed", "1"))
    before = open(run2 / "log.jsonl").read(), open(run2 / "ckpt.pt", "rb").read()
    with pytest.raises(RunError, match=r"holds another run's checkpoint .*--overwrite"):
        train.main(base_args(corpus, run2, "--max_iters", "4", "--resume", str(run1 / "ckpt.pt")))
    assert (open(run2 / "log.jsonl").read(), open(run2 / "ckpt.pt", "rb").read()) == before   # untouched
    # into a folder of its own: the continuation's log starts with the run's own records
    train.main(base_args(corpus, run3, "--max_iters", "4", "--resume", str(run1)))
    own = read_log(run3)
    assert [r["iter"] for r in own if r["type"] == "step"] == [0, 1, 2, 3]
    assert [r["loss"] for r in own if r["type"] == "step"][:2] == [r["loss"] for r in read_log(run1) if r["type"] == "step"]
    # --overwrite replaces run2 with run1's continuation: no seed-1 record is left in its log
    train.main(base_args(corpus, run2, "--max_iters", "4", "--resume", str(run1 / "ckpt.pt"), "--overwrite"))
    numbers = lambda log: [(r["type"], r.get("iter"), r.get("loss"), r.get("val_loss")) for r in log]  # noqa: E731
    assert numbers(read_log(run2)) == numbers(own)
    with pytest.raises(RunError, match="would remove the checkpoint it resumes"):
        train.main(base_args(corpus, run2, "--max_iters", "5", "--resume", str(run2 / "ckpt.pt"), "--overwrite"))


@pytest.mark.parametrize("optim", ["torchao", "zipsr"])
def test_activation_checkpointing_and_step_in_backward_train_the_same_run(corpus, tmp_path, optim):
    """train.py --activation_checkpointing and --step_in_backward (GaussWS, CPU eager): the same
    losses, gradient norms and final weights as the run without them, bit for bit."""
    flags = ["--method", "gaussws", "--optim", optim, "--grad_clip", "0", "--max_iters", "4", "--eval_interval", "2"]
    runs = {}
    for name, extra in (("plain", []), ("ckpt", ["--activation_checkpointing"]),
                        ("both", ["--activation_checkpointing", "--step_in_backward"])):
        train.main(base_args(corpus, tmp_path / name, *flags, *extra))
        log = read_log(tmp_path / name)
        runs[name] = ([(r["type"], r["iter"], r.get("loss"), r.get("val_loss")) for r in log if r["type"] != "summary"],
                      torch.load(tmp_path / name / "ckpt.pt", weights_only=False)["model"])
    for name in ("ckpt", "both"):
        assert runs[name][0] == runs["plain"][0]
        assert all(torch.equal(runs[name][1][k], v) for k, v in runs["plain"][1].items())
    norms = [[r["grad_norm"] for r in read_log(tmp_path / n) if r["type"] == "step"] for n in ("plain", "both")]
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)   # summed per parameter, in another order


@pytest.mark.parametrize("flags, words", [
    (["--step_in_backward"], ["--grad_clip 1", "add --grad_clip 0"]),
    (["--step_in_backward", "--grad_clip", "0", "--grad_accum", "2"], ["--grad_accum 2", "--grad_accum 1"]),
    (["--step_in_backward", "--grad_clip", "0", "--optim", "zipsr", "--capturable"], ["--capturable"]),
    (["--activation_checkpointing", "--compile", "--method", "gaussws"], ["--compile", "--no-compile"]),
])
def test_memory_flags_refuse_what_they_cannot_do(flags, words, capsys):
    _assert_one_line_flag_error(flags, words, capsys)


def test_a_block_size_whose_activations_cannot_fit_is_refused_and_byte_tokens_are_said(corpus, tmp_path, capsys,
                                                                                      monkeypatch):
    """--block_size 100000 on the tiny model (one attention op ran for > 10 minutes) needs ~29 GiB of
    activations: refused on a 16 GiB machine (with checkpointing it fits), and the preset's own
    context passes."""
    sizes = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 16 * 2 ** 30 // 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: sizes[name])
    cpu = argparse.Namespace(device_type="cpu")
    args = argparse.Namespace(batch_size=16, block_size=100000, activation_checkpointing=False, preset="tiny")
    with pytest.raises(RunError, match=r"^--block_size 100000 with --batch_size 16: one micro-batch's "
                                             r"activations need at least 29 GiB, more than this device's 16 GiB "
                                             r"\(the preset's context is 128\); lower --block_size or --batch_size$"):
        train.check_activations_fit(args, preset_config("tiny", vocab_size=256, block_size=100000), cpu)
    args.activation_checkpointing = True
    train.check_activations_fit(args, preset_config("tiny", vocab_size=256, block_size=100000), cpu)
    args.activation_checkpointing, args.block_size = False, 128
    train.check_activations_fit(args, preset_config("tiny", vocab_size=256), cpu)
    monkeypatch.undo()
    text, data_dir = corpus
    train.main(["--preset", "gpt2-124m", "--dataset", text, "--data_dir", data_dir, "--tokenizer", "byte",
                "--batch_size", "1", "--block_size", "32", "--max_iters", "1", "--eval_windows", "0", "--no-plot",
                "--out_dir", str(tmp_path / "g"), "--no-compile"])
    assert "with byte tokens: a 256-entry vocabulary, not the gpt2-124m of GPT-2's tokenizer" in capsys.readouterr().out


def test_a_second_signal_exits_at_once_while_a_step_runs(corpus, tmp_path):
    """A step stuck in one long op: the first SIGINT asks for a checkpoint at the step's end, a
    second one (after the echo window) ends the process at once with status 130; the first step's
    checkpoint is there and whole."""
    out = tmp_path / "o"
    flags = base_args(corpus, out, "--max_iters", "50", "--eval_interval", "1", "--eval_windows", "0",
                      "--threads", "1")
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    # steps 0 and 1 run (a checkpoint before steps 1 and 2), step 2's forward never ends
    code = ("import sys, time, train, model\n"
            "fwd = model.GPT.forward\n"
            "def slow(self, *a, **k):\n"
            "    if self.training and train_steps[0] > 1:\n"
            "        time.sleep(3600)\n"
            "    train_steps[0] += self.training\n"
            "    return fwd(self, *a, **k)\n"
            "train_steps = [0]\n"
            "model.GPT.forward = slow\n"
            f"train.main({flags!r})\n")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        def saved():   # ckpt.pt is replaced atomically: whatever is there loads
            return torch.load(out / "ckpt.pt", weights_only=False)["iter_num"] if os.path.exists(out / "ckpt.pt") else 0
        while saved() < 2 and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(1)
        p.send_signal(signal.SIGINT)
        time.sleep(Interrupts.ECHO_S + 0.5)
        assert p.poll() is None                       # the first signal waits for the step boundary
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=30)
    finally:
        p.kill()
    said = p.stdout.read()
    assert rc == 130, said
    assert "SIGINT again: exiting now" in said
    assert torch.load(out / "ckpt.pt", weights_only=False)["iter_num"] == 2


# ---------------------------------------------------------------------------------------------
# train.py --fsdp (2 gloo processes through kernel_launcher, as torchrun would start them)

def _fsdp_train_py(rank, world, tmp, argv):
    # train.main ends by destroying the process group; that is left to _rank_main, after the
    # result is written (a teardown abort must not hide a finished run, see kernel_launcher)
    import torch.distributed as dist
    destroy, dist.destroy_process_group = dist.destroy_process_group, lambda *a, **k: None
    try:
        return train.main(argv)
    finally:
        dist.destroy_process_group = destroy


def test_train_fsdp_resumes_on_another_world_size_and_matches_one_process(corpus, tmp_path):
    """--fsdp on 2 ranks stops at step 4 with a DCP folder (no .tmp or .old left), --resume
    continues it on 1 rank (DCP reshards model, packed 4-bit states and scales); every step's
    loss equals one plain process's with the same --grad_accum to float summation order (the 2
    ranks average their two micro-batches' gradients in another order). Without PQT: under DDP
    and FSDP2 each rank draws GaussWS noise once per step where one process draws it per
    micro-batch."""
    args = base_args(corpus, tmp_path / "f", "--max_iters", "6", "--eval_interval", "2", "--grad_accum", "2",
                     "--optim", "zeeden", "--seed", "1")
    kernel_launcher("_fsdp_train_py", tmp_path, 2, args + ["--fsdp", "--stop_after", "4"])
    assert sorted(os.listdir(tmp_path / "f")) == ["ckpt", "log.jsonl"]
    assert json.load(open(tmp_path / "f" / "ckpt" / "train.json"))["iter_num"] == 4
    summary = kernel_launcher("_fsdp_train_py", tmp_path, 1, args + ["--fsdp", "--resume"])[0]
    assert summary["start_iter"] == 4 and summary["iters"] == 6 and summary["world"] == 1
    plain = train.main(base_args(corpus, tmp_path / "p", *args[args.index("--max_iters"):]))
    steps = lambda d: [r["loss"] for r in read_log(d) if r["type"] == "step"]  # noqa: E731
    assert len(steps(tmp_path / "f")) == 6
    assert np.allclose(steps(tmp_path / "f"), steps(tmp_path / "p"), rtol=0, atol=1e-4)
    assert abs(summary["final_val_loss"] - plain["final_val_loss"]) < 1e-4


def test_bench_multigpu_runs_one_ddp_fsdp_and_a_dcp_resume_on_one(corpus, tmp_path, monkeypatch):
    """bench.py --only multigpu's runs on 2 gloo processes (torchrun, CPU): one process with
    --grad_accum 2, DDP and FSDP2 on 2 and the FSDP2 checkpoint continued on 1 agree at every eval
    up to summation order; FSDP2 holds less optimizer state per process than one process; the
    figure draws from the result."""
    from benchmarks import multigpu as bench_multigpu
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    text, data_dir = corpus
    flags = ["--preset", "nano", "--dataset", text, "--data_dir", data_dir, "--tokenizer", "byte", "--batch_size", "2",
             "--eval_windows", "4", "--eval_interval", "2", "--max_iters", "4", "--no-compile", "--device", "cpu"]
    r = bench_multigpu.bench_multigpu(flags, out_dir=str(tmp_path / "mg"), cases=(("bf16", "zipsr"),))
    row = r["cases"]["bf16/zipsr"]
    assert r["nproc"] == 2 and r["stop_after"] == 2
    assert [row[k]["world"] for k in ("one", "ddp", "fsdp", "fsdp_1")] == [1, 2, 2, 1]
    for k in ("ddp", "fsdp", "fsdp_1"):
        assert [i for i, _ in row[k]["val"]] == [0, 2, 4]
        assert np.allclose([v for _, v in row[k]["val"]], [v for _, v in row["one"]["val"]], rtol=0, atol=1e-4), k
    assert row["one"]["optimizer_state_mb"] == row["ddp"]["optimizer_state_mb"]
    assert row["fsdp"]["optimizer_state_mb"] < 0.7 * row["one"]["optimizer_state_mb"]
    assert row["state_ratio_fsdp"] == row["fsdp"]["optimizer_state_mb"] / row["one"]["optimizer_state_mb"]
    assert set(row["efficiency"]) == {"ddp", "fsdp"} and row["final_val"]["fsdp_1"] == row["fsdp_1"]["val"][-1][1]
    pytest.importorskip("matplotlib")
    path = str(tmp_path / "GPU_2026-01-01_multigpu.json")
    with open(path, "w") as f:
        json.dump(r, f)
    assert experiments.plot_results([path]) == [path[:-5] + ".png"]


def test_train_fsdp_one_rank_equals_plain_bit_for_bit(corpus, tmp_path):
    """--fsdp on one rank (parameters kept unsharded between the micro-steps, AdamW4bit's
    recorded plan replayed on the local tensors: FP32 states, so the CPU replays too) gives one
    plain process's step losses, grad norms and final weights bit for bit (GaussWS, --grad_accum 2)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    args = ["--max_iters", "4", "--eval_interval", "100", "--grad_accum", "2", "--method", "gaussws",
            "--optim", "fp32"]
    kernel_launcher("_fsdp_train_py", tmp_path, 1, base_args(corpus, tmp_path / "f", *args, "--fsdp"))
    train.main(base_args(corpus, tmp_path / "p", *args))
    steps = lambda d: [(r["loss"], r["grad_norm"]) for r in read_log(d) if r["type"] == "step"]  # noqa: E731
    assert len(steps(tmp_path / "f")) == 4 and steps(tmp_path / "f") == steps(tmp_path / "p")
    dcp_to_torch_save(str(tmp_path / "f" / "ckpt"), str(tmp_path / "f.pt"))
    sharded = torch.load(tmp_path / "f.pt", weights_only=False)["model"]
    plain = torch.load(tmp_path / "p" / "ckpt.pt", weights_only=True)["model"]
    assert sorted(sharded) == sorted(plain) and all(torch.equal(sharded[k], plain[k]) for k in plain)


def _aot_eager_compile(graphs):
    """torch.compile as train.py calls it, with the aot_eager backend (Dynamo's capture and
    AOTAutograd's joint forward/backward graph, run by eager kernels instead of Inductor's);
    each graph handed to the backend is appended to `graphs`."""
    from torch._dynamo.backends.debugging import aot_eager
    real = torch.compile

    def backend(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return aot_eager(gm, example_inputs)
    return lambda model, mode="default": real(model, backend=backend)


def _fsdp_train_py_compiled(rank, world, tmp, argv):
    graphs = []
    torch._dynamo.reset()
    torch.compile = _aot_eager_compile(graphs)   # a fresh process of kernel_launcher's: nothing to restore
    return _fsdp_train_py(rank, world, tmp, argv), graphs


def test_train_fsdp_compiled_one_rank_equals_plain_compiled_bit_for_bit(corpus, tmp_path, monkeypatch):
    """train.py --fsdp --compile on one rank: Dynamo leaves FSDP2's hooks outside the graph and
    captures the whole forward as one graph, the plain --compile run's (same node count, no
    recompile over 3 steps of 2 micro-steps), so step losses, grad norms and final weights equal
    the plain compiled run's bit for bit (GaussWS, ZIP-SR). Backend aot_eager, not Inductor: the
    FSDP2 interplay is Dynamo's and AOTAutograd's, and Inductor's C++ build of this model's
    kernels takes minutes on a CPU (with it the run also matched bit for bit, by hand). GaussWS on
    qkv only: each layer's noise adds to the traced graph and the trace time."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    args = ["--max_iters", "3", "--eval_interval", "100", "--eval_windows", "0", "--grad_accum", "2",
            "--method", "gaussws", "--parts", "qkv", "--optim", "zipsr", "--compile"]
    summary, fsdp_graphs = kernel_launcher("_fsdp_train_py_compiled", tmp_path, 1,
                                   base_args(corpus, tmp_path / "f", *args, "--fsdp"))[0]
    plain_graphs = []
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", _aot_eager_compile(plain_graphs))
    train.main(base_args(corpus, tmp_path / "p", *args))
    torch._dynamo.reset()
    assert summary["world"] == 1 and len(plain_graphs) == 1 and fsdp_graphs == plain_graphs
    steps = lambda d: [(r["loss"], r["grad_norm"], r["b_t_mean"])  # noqa: E731
                       for r in read_log(d) if r["type"] == "step"]
    assert len(steps(tmp_path / "f")) == 3 and steps(tmp_path / "f") == steps(tmp_path / "p")
    dcp_to_torch_save(str(tmp_path / "f" / "ckpt"), str(tmp_path / "f.pt"))
    sharded = torch.load(tmp_path / "f.pt", weights_only=False)["model"]
    plain = torch.load(tmp_path / "p" / "ckpt.pt", weights_only=True)["model"]
    assert sorted(sharded) == sorted(plain) and all(torch.equal(sharded[k], plain[k]) for k in plain)


def test_fsdp_checkpoint_folder_fallback_and_refusals(tmp_path):
    """A crash between save_dcp_checkpoint's two renames leaves ckpt.old and a complete ckpt.tmp
    (train.json, written last, in it): --resume takes the newer ckpt.tmp, and ckpt.old when
    ckpt.tmp is unfinished; a first save cut before its rename leaves a complete ckpt.tmp alone,
    which --resume takes and a fresh run names for resuming; a folder without train.json is
    refused in one line, and so is a --fsdp folder resumed without --fsdp."""
    args = argparse.Namespace(out_dir=str(tmp_path), fsdp=True, resume="auto", overwrite=False)
    os.makedirs(tmp_path / "ckpt.old")
    os.makedirs(tmp_path / "ckpt.tmp")
    assert resume_path(args) == str(tmp_path / "ckpt.old")
    (tmp_path / "ckpt.tmp" / "train.json").write_text("{}")
    assert resume_path(args) == str(tmp_path / "ckpt.tmp")
    os.rmdir(tmp_path / "ckpt.old")
    assert resume_path(args) == str(tmp_path / "ckpt.tmp")
    with pytest.raises(RunError, match=r"no checkpoint at .*ckpt \(.*ckpt.tmp is complete: --resume .*ckpt.tmp\)"):
        load_checkpoint(str(tmp_path / "ckpt"))    # an explicit --resume OUT/ckpt
    with pytest.raises(RunError, match=r"holds an FSDP2 checkpoint \(.*ckpt.tmp\): continue that run with "
                                             r"--resume, or start over"):
        check_out_dir(argparse.Namespace(**{**vars(args), "resume": None}), Process(False, 0, 1, "cpu"))
    shutil.rmtree(tmp_path / "ckpt.tmp")
    os.makedirs(tmp_path / "ckpt")
    assert resume_path(args) == str(tmp_path / "ckpt")
    with pytest.raises(RunError, match="not a complete train.py --fsdp checkpoint folder"):
        load_checkpoint(str(tmp_path / "ckpt"))
    with pytest.raises(RunError, match="resume it with --fsdp"):
        train.resume(argparse.Namespace(fsdp=False, resume=str(tmp_path / "ckpt")), {"dcp": "x"}, None, None, "cpu")


@pytest.mark.parametrize("flags, env, words", [
    (["--fsdp"], {}, ["--fsdp", "torchrun"]),
    (["--fsdp", "--optim", "adam-mini"], {"RANK": "0"}, ["--fsdp", "adam-mini", "zipsr"]),
    (["--fsdp", "--bits_lambda", "0.5"], {"RANK": "0"}, ["--fsdp", "--bits_lambda 0.5", "DDP"]),
    (["--fsdp", "--param_dtype", "bf16", "--method", "gaussws"], {"RANK": "0"}, ["--param_dtype bf16", "b_i", "DDP"]),
    (["--fsdp", "--param_dtype", "bf16", "--optim", "zipsr", "--master_weight_bits", "24"], {"RANK": "0"},
     ["--master_weight_bits 24", "DDP"]),
    (["--fsdp", "--compile", "--compile_mode", "reduce-overhead"], {"RANK": "0"},
     ["--compile_mode reduce-overhead", "CUDA graphs", "max-autotune-no-cudagraphs"]),
])
def test_fsdp_bad_flags_one_line_error(flags, env, words, capsys, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(train, "setup_distributed", lambda args: Process(False, 0, 1, "cpu"))
    _assert_one_line_flag_error(flags, words, capsys)


def test_bad_flag_under_torchrun_is_printed_by_rank_0_only(capsys, monkeypatch):
    """Every rank parses the same flags: rank 0 prints the one-line error, the others exit with the
    same status silently (torchrun would show it once per rank)."""
    for rank, printed in (("1", ""), ("0", "train.py: error: argument --lr: invalid float value: 'x'\n")):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["--lr", "x"])
        assert e.value.code == 2 and capsys.readouterr().err == printed


def test_stray_rank_without_torchrun_is_a_one_line_error(monkeypatch):
    """RANK left in the environment without torchrun's LOCAL_RANK / WORLD_SIZE: a one-line error
    naming them, not a KeyError."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit, match="RANK=0 is set but LOCAL_RANK and WORLD_SIZE not: start a distributed "
                                         "run with torchrun, or unset RANK"):
        setup_distributed(argparse.Namespace(device="cpu"))


def test_torchrun_with_more_ranks_than_gpus_is_a_one_line_error(monkeypatch):
    """LOCAL_RANK past the host's GPUs (torchrun --nproc_per_node 2 on one GPU): an error naming
    the rank, the GPU count and the two ways out, before CUDA's "invalid device ordinal"."""
    for k, v in dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit, match=r"LOCAL_RANK=1 but this host has 1 GPU\(s\): start torchrun with "
                                         r"--nproc_per_node at most 1, or add --device cpu"):
        setup_distributed(argparse.Namespace(device="auto"))


def _fsdp_mesh_on_a_gpu_host(rank, world, tmp):
    """shard_model on CPU ranks of a host whose accelerator is CUDA (torch._C._get_accelerator
    stubbed: fully_shard's default mesh follows it): the mesh types of the sharded parameters."""
    torch._C._get_accelerator = lambda: torch.device("cuda")
    model = GPT(preset_config("tiny", vocab_size=256))
    shard_model(model, world, "cpu")
    x = torch.randint(0, 256, (2, 16))
    model(x, x)[1].backward()
    return sorted({p.device_mesh.device_type for p in model.parameters()})


def test_fsdp_on_cpu_shards_on_a_cpu_mesh_on_a_gpu_host(tmp_path):
    """torchrun ... train.py --fsdp --device cpu on a GPU host: the ranks shard on a CPU mesh over
    their gloo group, not on fully_shard's default CUDA mesh (rank 1 of 2: cuda:1)."""
    assert kernel_launcher("_fsdp_mesh_on_a_gpu_host", tmp_path, 2) == [["cpu"], ["cpu"]]


def _as_fsdp_rank(monkeypatch, world=1):
    """train.main in this process as rank 0 of `world` under torchrun, without a process group."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(train, "setup_distributed", lambda args: Process(world > 1, 0, world, "cpu"))
    monkeypatch.setattr(train.dist, "destroy_process_group", lambda *a, **k: None)


def test_fresh_run_refuses_either_checkpoint_kind_and_overwrite_removes_both(corpus, tmp_path, monkeypatch):
    """Every checkpoint kind in --out_dir (ckpt.pt, the DCP folder ckpt, ckpt.old, ckpt.tmp) stops a
    fresh run of either kind in one line naming it and how to resume it; --overwrite removes them
    all, so the folder never holds both kinds."""
    out = tmp_path / "o"
    args = base_args(corpus, out, "--max_iters", "2", "--eval_interval", "2")
    for name in ("ckpt", "ckpt.old", "ckpt.tmp"):
        os.makedirs(out / name)
        with pytest.raises(RunError) as e:
            train.main(args)
        assert str(e.value).startswith(f"--out_dir {out} holds an FSDP2 checkpoint ({out / name}): continue that "
                                       f"run with torchrun --standalone --nproc_per_node N train.py <that run's "
                                       f"flags> --fsdp --resume (N dividing its --grad_accum)") \
            if name != "ckpt.tmp" else str(e.value).startswith(
            f"--out_dir {out} holds only {out / name}, an FSDP2 checkpoint whose writing did not finish (the run "
            f"stopped before its first checkpoint was complete): nothing to resume; start over with --overwrite")
        assert "\n" not in str(e.value) and not (out / "ckpt.pt").exists() and not (out / "log.jsonl").exists()
        if name == "ckpt.tmp":   # what --fsdp --resume then finds
            with pytest.raises(RunError, match=r"no checkpoint at .*ckpt \(only .*ckpt.tmp, whose writing "):
                load_checkpoint(str(out / "ckpt"))
        os.rmdir(out / name)
    for name in ("ckpt", "ckpt.old"):
        os.makedirs(out / name)
        (out / name / "train.json").write_text("{}")
    train.main(args + ["--overwrite"])
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"]
    _as_fsdp_rank(monkeypatch)   # the mirror: an --fsdp run into a folder holding ckpt.pt
    with pytest.raises(RunError) as e:
        train.main(args + ["--fsdp"])
    assert str(e.value).startswith(f"--out_dir {out} holds a plain checkpoint ({out / 'ckpt.pt'}): continue that "
                                   f"run with python train.py <that run's flags> --resume, without --fsdp")


def test_resume_names_the_other_checkpoint_kind_and_takes_an_out_dir(corpus, tmp_path, monkeypatch):
    """--resume finding only the other kind says which kind the folder holds and how to resume it,
    before any data or model; --resume OUT_DIR (a run's folder) resumes its ckpt.pt."""
    out = tmp_path / "o"
    args = base_args(corpus, out, "--eval_interval", "2")
    train.main(args + ["--max_iters", "2"])
    s = train.main(args + ["--max_iters", "3", "--resume", str(out)])
    assert s["start_iter"] == 2 and s["iters"] == 3
    fsdp_only = tmp_path / "f"
    os.makedirs(fsdp_only / "ckpt")
    for resume in (["--resume"], ["--resume", str(fsdp_only)], ["--resume", str(fsdp_only / "ckpt")]):
        with pytest.raises(RunError) as e:
            train.main(base_args(corpus, fsdp_only, *resume))
        given = "" if len(resume) == 1 else " " + re.escape(str(fsdp_only / "ckpt"))   # a given path stays
        assert re.fullmatch(f"--resume: {re.escape(str(fsdp_only))}.* an FSDP2 checkpoint.*not a plain one: resume "
                            f"it with torchrun --standalone --nproc_per_node N train.py <that run's flags> --fsdp "
                            f"--resume{given} \\(N dividing its --grad_accum\\)", str(e.value))
    _as_fsdp_rank(monkeypatch)
    for resume in (["--resume"], ["--resume", str(out / "ckpt.pt")]):
        with pytest.raises(RunError) as e:
            train.main(args + ["--fsdp", *resume])
        given = "" if len(resume) == 1 else " " + re.escape(str(out / "ckpt.pt"))
        assert re.fullmatch(f"--resume: {re.escape(str(out))}.* a plain checkpoint.*not an FSDP2 \\(--fsdp\\) one: "
                            f"resume it with python train.py <that run's flags> --resume{given}, without --fsdp .*",
                            str(e.value))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # DCP in this one process: intended
def test_corrupt_fsdp_checkpoint_folder_is_a_one_line_error(tmp_path):
    """A DCP folder with its .metadata or a .distcp file deleted, truncated or garbled is a RunError
    of one line naming the folder and the file, from load_checkpoint (before any model is built)
    or, for what the file checks cannot see, from the DCP load in resume."""
    import shutil

    import torch.distributed.checkpoint as dcp
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    folder = str(tmp_path / "ckpt")
    meta = {"format": CKPT_FORMAT, "iter_num": 1, "best_val_loss": 1.0, "config": {}}

    def write():
        shutil.rmtree(folder, ignore_errors=True)
        dcp.save(dcp_state(model, opt, {"torch": torch.get_rng_state()}), checkpoint_id=folder)
        open(os.path.join(folder, "train.json"), "w").write(json.dumps(meta))
        return os.path.join(folder, "__0_0.distcp")

    shard = write()
    args = argparse.Namespace(fsdp=True, resume=folder, max_iters=None)
    assert train.resume(args, load_checkpoint(folder), model, opt, "cpu") == (1, 1.0)
    size = os.path.getsize(shard)
    for damage, words in [(lambda: os.remove(os.path.join(folder, ".metadata")), ".metadata is missing"),
                          (lambda: open(os.path.join(folder, ".metadata"), "wb").write(b"x"), ".metadata: "),
                          (lambda: os.remove(shard), "__0_0.distcp is missing"),
                          (lambda: os.truncate(shard, size - 1), f"__0_0.distcp has {size - 1} bytes")]:
        shard = write()
        damage()
        with pytest.raises(RunError) as e:
            load_checkpoint(folder)
        assert str(e.value).startswith(f"--resume: checkpoint {folder} cannot be read (corrupt or truncated?): ")
        assert words in str(e.value) and "\n" not in str(e.value)
    shard = write()   # same size, wrong bytes: only the load itself sees it
    with open(shard, "r+b") as f:
        f.write(b"\0" * size)
    with pytest.raises(RunError) as e:
        train.resume(args, load_checkpoint(folder), model, opt, "cpu")
    assert str(e.value).startswith(f"--resume: checkpoint {folder} cannot be read") and "\n" not in str(e.value)


def test_grad_accum_not_divisible_by_the_processes(corpus, tmp_path, monkeypatch):
    _as_fsdp_rank(monkeypatch, world=2)
    with pytest.raises(RunError, match="^--grad_accum 3 must be divisible by the number of processes \\(2\\)$"):
        train.main(base_args(corpus, tmp_path / "o", "--grad_accum", "3"))
    seen = []                   # without --grad_accum: one micro-batch per process

    def stop(args, proc):
        seen.append(args.grad_accum)
        raise RunError("stop")
    monkeypatch.setattr(train, "setup_data", stop)
    with pytest.raises(RunError, match="^stop$"):
        train.main(base_args(corpus, tmp_path / "o"))
    assert seen == [2]


def test_resume_without_grad_accum_keeps_the_checkpoints_on_any_process_count():
    for given, saved, world, want in ((None, 2, 1, 2), (None, 2, 2, 2), (None, 4, 2, 4), (2, 4, 1, 2)):
        args = argparse.Namespace(grad_accum=given)
        train.set_grad_accum(args, world, {"config": {"grad_accum": saved}})
        assert args.grad_accum == want
    args = argparse.Namespace(grad_accum=None)
    train.set_grad_accum(args, 3)
    assert args.grad_accum == 3                 # a fresh run: one micro-batch per process
    for given, said in ((None, "--grad_accum 1 (the checkpoint's) must be divisible by the number of processes (2): "
                               "resume it on a number of processes that divides 1"),
                        (3, "--grad_accum 3 must be divisible by the number of processes (2)")):
        with pytest.raises(RunError) as e:
            train.set_grad_accum(argparse.Namespace(grad_accum=given), 2, {"config": {"grad_accum": 1}})
        assert str(e.value).startswith(said) and (given is None) == ("divides" in str(e.value)), str(e.value)


def test_resume_compares_only_the_flags_either_run_reads():
    """Two --method bf16 runs may differ in PQT flags, two cosine runs in --cooldown_frac; once
    either run reads a flag (another --method or --schedule), a difference refuses the resume."""
    saved = dict(RESUME_DEFAULTS, method="bf16", b_init=8.0, parts="qkv", schedule="cosine", cooldown_frac=0.2,
                 min_lr_frac=0.1, lr=1e-3)
    check_resume_config(saved, dict(saved, b_init=6.0, parts="all", cooldown_frac=0.1), "ckpt.pt")
    for change, named in ((dict(method="gaussws", b_init=6.0), ("--method", "--b_init")),
                          (dict(schedule="wsd", cooldown_frac=0.1), ("--schedule", "--cooldown_frac")),
                          (dict(min_lr_frac=0.2), ("--min_lr_frac",))):
        with pytest.raises(RunError) as e:
            check_resume_config(saved, dict(saved, **change), "ckpt.pt")
        assert all(f"{n} " in str(e.value) for n in named) and "--parts" not in str(e.value), str(e.value)


def test_train_bf16_params_with_master_weight_bits_resumes(corpus, tmp_path):
    """--param_dtype bf16 --master_weight_bits 24: the checkpoint holds BF16 weights and an int8
    param_correction per weight, a stopped-and-resumed run ends where the uninterrupted one does;
    the BF16-write flags without BF16 parameters, or together, are one-line errors."""
    for flags in (["--param_rounding", "sr"], ["--optim", "adamw", "--param_dtype", "bf16", "--master_weight_bits", "24"],
                  ["--optim", "zipsr", "--param_dtype", "bf16", "--param_rounding", "sr", "--master_weight_bits", "24"]):
        with pytest.raises(SystemExit):
            train.main(base_args(corpus, tmp_path / "x", *flags))
    args = base_args(corpus, tmp_path / "a", "--optim", "zipsr", "--param_dtype", "bf16", "--master_weight_bits", "24",
                     "--max_iters", "4", "--eval_interval", "2")
    train.main(args)
    args_b = [a if a != str(tmp_path / "a") else str(tmp_path / "b") for a in args]
    train.main(args_b + ["--stop_after", "2"])
    train.main(args_b + ["--resume"])
    ca = torch.load(tmp_path / "a" / "ckpt.pt", weights_only=True)
    cb = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)
    assert {t.dtype for t in ca["model"].values() if t.is_floating_point()} == {torch.bfloat16}
    corr = [st["param_correction"] for st in ca["optimizer"]["state"].values()]
    assert corr and all(c.dtype == torch.int8 for c in corr) and any(c.abs().max() > 0 for c in corr)
    assert _tensors_equal(ca["model"], cb["model"]) and _tensors_equal(ca["optimizer"], cb["optimizer"])

def test_train_capturable_equals_plain_run_and_resumes_across_it(corpus, tmp_path):
    """train.py --capturable (AdamW4bit(capturable=True): device step counters; a CUDA graph on a
    GPU) trains to the same checkpoint as without it, a run stopped without it resumes with it,
    and --capturable with --optim adamw is a one-line error."""
    with pytest.raises(SystemExit):
        train.main(base_args(corpus, tmp_path / "x", "--optim", "adamw", "--capturable"))
    args = base_args(corpus, tmp_path / "a", "--optim", "zipsr", "--max_iters", "4", "--eval_interval", "2")
    train.main(args)
    args_b = [a if a != str(tmp_path / "a") else str(tmp_path / "b") for a in args]
    train.main(args_b + ["--stop_after", "2"])
    train.main(args_b + ["--resume", "--capturable"])
    ca = torch.load(tmp_path / "a" / "ckpt.pt", weights_only=True)
    cb = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)
    steps = [st["step"] for st in cb["optimizer"]["state"].values()]
    assert steps and all(torch.is_tensor(t) and float(t) == 4 for t in steps)
    assert _tensors_equal(ca["model"], cb["model"])


# =============================================================================================
# bench.py: the sections that also run on CPU (no timing is asserted)

def test_bench_memory_matches_the_arithmetic():
    import bench
    res = bench.bench_memory(preset="nano", T=64, batch=2, device="cpu")
    assert len(res["rows"]) == 10
    for r in res["rows"]:
        assert r["measured_B_per_param"] == pytest.approx(r["arithmetic_B_per_param"], rel=1e-12), r
        w = 2.0 if r["param_dtype"] == "bf16" else 4.0
        assert r["measured_B_per_param"]["weights"] == w and r["measured_B_per_param"]["grads"] == w
    bf = [r["measured_B_per_param"]["optimizer"] for r in res["rows"] if r["param_dtype"] == "bf16"]
    assert bf[1] == pytest.approx(bf[0] + 1.0, rel=1e-12)     # master_weight_bits=24: +1 B/param
    by = {(r["method"], r["memory"], r["optim"]): r for r in res["rows"] if r["param_dtype"] == "fp32"}
    assert by[("bf16", "save", "adamw")]["measured_B_per_param"]["optimizer"] == 8.0
    assert by[("gaussws", "recompute", "zipsr")]["measured_B_per_param"]["bf16_weights_saved"] == 0.0
    assert by[("gaussws", "save", "zipsr")]["measured_B_per_param"]["bf16_weights_saved"] > 0.0


def test_bench_power_during_parses_nvidia_smi(tmp_path, monkeypatch, capsys):
    """power_during (optim table's W / SM MHz / cap% columns) against a fake nvidia-smi: it asks
    for this device's PCI address, drops the samples of the settle time, reads "[N/A]" fields as
    missing (not the whole sample), stops the sampler, and returns None with a message when
    nothing is readable."""
    import types
    kept = ["600.0, 1980, 0x0000000000000000", "[N/A], 1700, 0x0000000000000004",
            "700.0, 1600, 0x0000000000000004", "650.0, [N/A], [N/A]"]
    fake = tmp_path / "nvidia-smi"     # 3 samples at once (the settle time: dropped), 4 later
    fake.write_text("#!/bin/sh\necho \"$@\" > %s/args\nprintf '999.0, 100, 0x0\\n%%.0s' 1 2 3\n"
                    "sleep 1\nprintf '%%s\\n' %s\nexec sleep 30\n"
                    % (tmp_path, " ".join(f"'{x}'" for x in kept)))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x19, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = [0]
    r = bench_util.power_during(lambda: calls.__setitem__(0, calls[0] + 1), seconds=2.0, settle=0.5)
    assert r == dict(power_w=650.0, sm_mhz=1700.0, power_cap_pct=200 / 3), r
    assert calls[0] > 0 and "-i 00000000:19:00.0" in (tmp_path / "args").read_text()
    fake.write_text("#!/bin/sh\necho 'No devices were found' >&2\nexit 6\n")
    assert bench_util.power_during(lambda: None, seconds=0.05) is None
    assert "No devices were found" in capsys.readouterr().out


def test_bench_train_runs_every_method_on_cpu():
    import bench
    seen = []
    res = bench.bench_train(cases=[("nano", 2)], optims=("adamw",), steps=1, T=64, device="cpu",
                            compile=False, rounds=2, on_row=lambda rows: seen.append(len(rows)))
    assert [r["method"] for r in res["rows"]] == ["bf16", "gaussws", "diffq"]
    assert seen == [3]                         # the partial table after each (model, optimizer)
    assert res["rows"][0]["overhead_pct"] == 0.0
    for r in res["rows"]:                      # each round's overhead against that round's BF16 step
        assert len(r["step_ms_rounds"]) == 2 and r["step_ms"] == statistics.median(r["step_ms_rounds"])
        assert r["overhead_pct_rounds"] == [100 * (1 - b / m) for b, m in zip(
            res["rows"][0]["step_ms_rounds"], r["step_ms_rounds"])]
        assert r["overhead_pct"] == statistics.mean(r["overhead_pct_rounds"])
        assert r["gpu_ms_per_step"] is None and r["gpu_ops_per_step"] is None   # the profile is CUDA's
    assert all(r["tokens_per_s"] > 0 for r in res["rows"])
    assert set(res["geomean_overhead_pct"]) == {"gaussws/adamw", "diffq/adamw"}


# =============================================================================================
# experiments.py: quality runs, figures, the command line

def test_bench_quality_compares_runs_with_shared_baseline(corpus, tmp_path):
    args = base_args(corpus, tmp_path / "unused", "--max_iters", "4", "--eval_interval", "2")
    args = args[:args.index("--out_dir")] + args[args.index("--out_dir") + 2:]
    exps = {"optim": [("bf16", "fp32"), ("bf16", "torchao"), ("bf16", "zipsr")],
            "pqt": [("bf16", "fp32"), ("gaussws", "fp32")]}
    res = experiments.bench_quality(args, seeds=(0, 1), out_dir=str(tmp_path), experiments=exps)["experiments"]
    runs = {d for d in os.listdir(tmp_path) if os.path.isdir(tmp_path / d)}
    assert runs == {f"{r}_s{s}" for r in ("bf16_fp32", "bf16_torchao", "bf16_zipsr", "gaussws_fp32")
                    for s in (0, 1)}                  # the shared bf16/fp32 run is trained once
    opt = res["optim"]
    assert opt["bf16/fp32"]["gap_to_first"] == 0.0
    assert opt["bf16/torchao"]["share_of_torchao_gap_closed"] == pytest.approx(0.0)
    for k, r in opt.items():
        assert len(r["final_val_loss"]) == 2 and r["mean"] == pytest.approx(sum(r["final_val_loss"]) / 2)
    assert res["pqt"]["bf16/fp32"]["mean"] == opt["bf16/fp32"]["mean"]
    assert opt["bf16/zipsr"]["optimizer_state_mb"] < opt["bf16/fp32"]["optimizer_state_mb"]


def test_quality_runs_seed_by_seed_and_resume_from_logs_without_checkpoints(corpus, tmp_path):
    """bench_quality spread over invocations (as over machines whose disks are gone): --max_runs
    trains seed 0 of every run first and leaves the rest pending; with resume=True a finished run
    is read back from its log.jsonl and cast.json after its checkpoint is deleted (not trained
    again), the pending ones train, an experiment keeps only its own seeds, a tagged run trains
    again in its own folder, and gaps are paired by seed with their standard error."""
    args = nano_args(corpus, "--max_iters", "4", "--eval_interval", "2", "--no-plot")
    exps = {"pqt": [("bf16", "adamw"), ("gaussws", "adamw")],
            "noise": dict(seeds=(0,), runs=[("bf16", "adamw"), ("bf16", "adamw", (), "rerun", "rerun")])}
    out = experiments.bench_quality(args, seeds=(0, 1), out_dir=str(tmp_path), experiments=exps, max_runs=2,
                                    resume=True)
    assert sorted(os.listdir(tmp_path / "bf16_adamw_s0")) and not os.path.exists(tmp_path / "bf16_adamw_s1")
    assert [os.path.basename(d) for d in out["pending_runs"]] == ["bf16_adamw_rerun_s0", "bf16_adamw_s1",
                                                                   "gaussws_adamw_s1"]
    assert out["experiments"]["pqt"]["gaussws/adamw"]["seeds"] == [0]
    assert out["experiments"]["noise"]["rerun"]["seeds"] == [] and out["experiments"]["noise"]["rerun"]["mean"] is None
    first = {k: v["row"] for k, v in ((k, json.load(open(tmp_path / d / "cast.json")))
                                      for k, d in (("b", "bf16_adamw_s0"), ("g", "gaussws_adamw_s0")))}
    assert first["g"]["tiers"] == "learned b_t" and first["b"]["tiers"].startswith("fixed")
    logs = {d: os.path.getmtime(tmp_path / d / "log.jsonl") for d in ("bf16_adamw_s0", "gaussws_adamw_s0")}
    for d in logs:
        os.remove(tmp_path / d / "ckpt.pt")
    out = experiments.bench_quality(args, seeds=(0, 1), out_dir=str(tmp_path), experiments=exps, resume=True)
    assert all(os.path.getmtime(tmp_path / d / "log.jsonl") == t for d, t in logs.items())   # not trained again
    assert out["pending_runs"] == [] and out["failed_runs"] == {}
    assert not os.path.exists(tmp_path / "bf16_adamw_rerun_s1") and os.path.exists(tmp_path / "bf16_adamw_rerun_s0")
    pqt, noise = out["experiments"]["pqt"], out["experiments"]["noise"]
    b, gw = pqt["bf16/adamw"], pqt["gaussws/adamw"]
    assert b["seeds"] == gw["seeds"] == [0, 1] and noise["rerun"]["seeds"] == [0]
    gaps = [x - y for x, y in zip(gw["final_val_loss"], b["final_val_loss"])]
    assert gw["gap_per_seed"] == list(zip((0, 1), gaps)) and gw["gap_to_first"] == pytest.approx(sum(gaps) / 2)
    assert gw["gap_se"] == pytest.approx(abs(gaps[0] - gaps[1]) / 2)     # std / sqrt(2) of two values
    assert noise["rerun"]["final_val_loss"] == [b["final_val_loss"][0]]  # CPU runs repeat bit for bit
    assert set(out["cast"]) == {"bf16/adamw s0", "gaussws/adamw s0", "bf16/adamw s1", "gaussws/adamw s1"}
    assert out["cast"]["gaussws/adamw s0"] == first["g"] and set(out["bitwidth"]) == {"gaussws/adamw s0",
                                                                                       "gaussws/adamw s1"}
    assert b["bytes_per_param"] == pytest.approx(4 + b["optimizer_state_mb"] * 2 ** 20 / read_run_log(
        tmp_path / "bf16_adamw_s0" / "log.jsonl")[-1]["params"])
    # a damaged cast.json is left out with a note, not a crash; --resume with other flags is refused
    (tmp_path / "gaussws_adamw_s1" / "cast.json").write_text('{"row": ')
    again = experiments.bench_quality(args, seeds=(0, 1), out_dir=str(tmp_path), experiments=exps, resume=True)
    assert "gaussws/adamw s1" not in again["cast"] and again["experiments"] == out["experiments"]
    with pytest.raises(RunError, match=r"gaussws_adamw_s0 was trained with other train.py flags "
                                             r"\(--max_iters 4 then, --max_iters 6 now\)"):
        experiments.bench_quality([*args, "--max_iters", "6"], seeds=(0,), out_dir=str(tmp_path),
                                  experiments={"pqt": exps["pqt"][1:]}, resume=True)
    assert out["noise_floor"] == 0.0 and noise["rerun"]["verdict"] is None and b["verdict"] is None
    table = experiments.quality_tables(out)
    assert f"| gaussws/adamw | 0,1 | {gw['mean']:.4f} | {gw['gap_to_first']:+.4f} ± {gw['gap_se']:.4f} |" in table
    assert "| rerun | 0 |" in table and table.count("**") == 6 and table.startswith("same-seed rerun spread: 0.0000")
    c, layers = out["cast"]["gaussws/adamw s0"], out["bitwidth"]["gaussws/adamw s0"]["layers"].values()
    b_t = sum(v["mean"] * v["params"] for v in layers) / sum(v["params"] for v in layers)
    assert (f"| gaussws/adamw s0 | {b_t:.2f} | " in table and f" | {c['delta']:+.4f} | "
            + " | ".join(f"{x:+.4f}" for x in c["sweep_delta"].values()) + " |" in table)   # experiment 5


def test_quality_verdict_weighs_a_gap_against_the_t_interval_and_the_rerun_spread():
    """A gap is "within noise" up to the larger of the 95 % t half-width of the paired gaps and the
    same-seed rerun spread, else "worse" or "better"; with no bound above 0 there is no verdict.
    The spread is the largest |gap| of experiment "noise"'s reruns to its first run."""
    v = experiments._verdict
    assert v(0.0079, 0.0041, 0.0058, 2) == "within noise"           # 12.71 s.e. with 2 seeds
    assert v(0.03, 0.004, 0.0058, 3) == "worse" and v(0.017, 0.004, 0.0058, 3) == "within noise"   # 4.30 s.e.
    assert v(0.022, None, 0.0058, 1) == "worse" and v(-0.01, 0.001, 0.0058, 3) == "better"
    assert v(0.01, None, None, 1) is None and v(None, 0.1, 0.1, 3) is None and v(0.5, None, 0.0, 1) is None
    assert v(0.0011, 0.001, None, 20) == "within noise" and v(0.0021, 0.001, None, 20) == "worse"   # ~2 s.e.
    rows = lambda *gaps: {"base": dict(gap_per_seed=[]), **{f"r{i}": dict(gap_per_seed=[(0, g)])  # noqa: E731
                                                             for i, g in enumerate(gaps)}}
    assert experiments._noise_floor({"noise": rows(-0.0058, 0.003)}) == 0.0058
    assert experiments._noise_floor({"pqt": rows(0.1)}) is None and experiments._noise_floor({"noise": rows()}) is None


def test_quality_keeps_finished_runs_checks_train_flags_first_and_reports_without_training(corpus, tmp_path,
                                                                                          capsys):
    """Run folders already in --out_dir stop a command without --resume or --overwrite (finished
    runs can be hours of GPU time); a flag train.py refuses stops the command, with train.py's
    message, before any folder's argv.json changes (so --resume still takes the folders); --max_runs
    0 into a folder that does not exist reports without training, and refuses a folder holding none
    of the runs; a report (--max_runs 0) reads runs trained on a corpus at another path and says
    where they trained; an experiment whose own seeds are not in --seeds is left out with a note."""
    text, data_dir = corpus
    out = tmp_path / "q"
    flags = f"--batch_size 4 --eval_windows 8 --eval_interval 2 --tokenizer byte --data_dir {data_dir}"
    base = ["quality", "--suite", "gpt2", "--preset", "nano", "--dataset", text, "--experiments", "noise",
            "--iters", "2", "--out_dir", str(out)]
    experiments.main([*base, "--seeds", "0", "--train_args", flags])
    argv_json = {d: (out / d / "argv.json").read_text() for d in ("bf16_adamw_s0", "bf16_adamw_rerun_s0")}
    for extra, said in (([], "already holds 2 of these runs (bf16_adamw_s0, bf16_adamw_rerun_s0): add --resume"),
                        (["--overwrite", "--train_args", flags + " --batchsize 8"],
                         "the runs' train.py flags: unrecognized arguments: --batchsize 8")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            experiments.main([*base, "--seeds", "0", *extra] + (["--train_args", flags] if not extra else []))
        assert e.value.code == 2 and said in capsys.readouterr().err, extra
    assert {d: (out / d / "argv.json").read_text() for d in argv_json} == argv_json
    capsys.readouterr()
    experiments.main([*base, "--seeds", "0", "--resume", "--train_args", flags])
    assert "done:" not in capsys.readouterr().out          # read back, not trained again
    # a report elsewhere (--max_runs 0): the corpus path is not compared, nor read, and is named
    report = [*base[:6], "/elsewhere/corpus", *base[7:-1], str(tmp_path / "moved"), "--seeds", "0", "--resume",
              "--max_runs", "0", "--train_args", flags]
    shutil.copytree(out, tmp_path / "moved")
    experiments.main(report)
    assert f"the saved runs were trained on --dataset {text} (--dataset /elsewhere/corpus is not read" in \
        capsys.readouterr().out
    made = json.load(open(tmp_path / "moved" / "quality.json"))   # where the runs trained, from their logs
    assert made["trained_on"] == {f"cpu, torch {torch.__version__}, triton {triton.__version__}": 2}
    assert (made["gpu"], made["torch"]) == ("cpu", torch.__version__)
    os.makedirs(tmp_path / "empty")                         # a report of a folder holding none: refused, unwritten
    with pytest.raises(SystemExit) as e:
        experiments.main([*report[:-8], str(tmp_path / "empty"), *report[-7:]])
    assert e.value.code == 2 and f"--max_runs 0 reports the runs --out_dir holds, and {tmp_path / 'empty'} holds " \
        "none of these (e.g. bf16_adamw_s0): extract the runs' archive there" in capsys.readouterr().err
    assert os.listdir(tmp_path / "empty") == []
    new = tmp_path / "new" / "q"
    experiments.main([*base[:-1], str(new), "--seeds", "1", "--max_runs", "0", "--train_args", flags])
    said = capsys.readouterr().out
    assert "[noise] left out: its runs are for seed(s) 0, not in --seeds" in said
    assert json.load(open(new / "quality.json"))["experiments"] == {}


def test_quality_in_process_run_stopped_by_a_signal_names_the_harness_resume(monkeypatch, capsys):
    """--jobs 1: a run that train.py stops at a checkpoint on Ctrl-C / SIGTERM (exit 130 / 143)
    ends the harness too, whose last line says to continue the whole comparison with --resume; a
    flag error's exit passes through without it."""
    from experiments import runs as quality_runs
    for code, said in ((143, True), (130, True), (2, False)):
        monkeypatch.setattr(train, "main", lambda argv, code=code: sys.exit(code))
        with pytest.raises(SystemExit) as e:
            quality_runs.train_inprocess(["--seed", "0"], "q/bf16_adamw_s0")
        assert e.value.code == code
        assert ("continue the whole comparison with the same command and --resume" in capsys.readouterr().out) == said


def test_quality_runner_concurrent_end_to_end(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    exps = {"pqt": [("bf16", "adamw"), ("gaussws", "adamw")],
            "zeropoint": [("bf16", "zipsr", (), "update-sr"),
                          ("bf16", "zipsr", ("--v_rounding", "state-rtn"), "state-rtn"),
                          ("bf16", "adamw", ("--lr", "1e30", "--warmup_frac", "0"), "diverges")]}
    args = nano_args(corpus, "--max_iters", "6", "--eval_interval", "3")
    out = experiments.bench_quality(args, seeds=(0,), out_dir=str(tmp_path), experiments=exps, jobs=2)
    assert out["failed_runs"] == {}
    dirs = {d for d in os.listdir(tmp_path) if os.path.isdir(tmp_path / d)}
    assert dirs == {"bf16_adamw_s0", "gaussws_adamw_s0", "bf16_zipsr_s0", "bf16_zipsr_v_rounding-state-rtn_s0",
                    "bf16_adamw_lr-1e30_warmup_frac-0_s0"}
    assert all(os.path.exists(tmp_path / d / "train.out") for d in dirs)   # ran as subprocesses
    res = out["experiments"]
    for exp, label in [("pqt", "bf16/adamw"), ("pqt", "gaussws/adamw"), ("zeropoint", "update-sr"),
                       ("zeropoint", "state-rtn")]:
        r = res[exp][label]
        assert math.isfinite(r["final_val_loss"][0]) and r["mean"] == r["final_val_loss"][0]
        assert math.isfinite(r["final_train_loss"][0]) and r["diverged_at"] == [None]
    dv = res["zeropoint"]["diverges"]                               # recorded, not raised
    assert isinstance(dv["diverged_at"][0], int) and dv["mean"] is None and dv["gap_to_first"] is None
    assert dv["final_val_loss"] == [None] and dv["final_train_loss"] == [None]
    assert res["zeropoint"]["state-rtn"]["flags"] == ["--v_rounding", "state-rtn"]

    # experiment 5: the reloaded plain-weight model reproduces train.py's own final val loss
    cast = out["cast"]
    assert set(cast) == {"bf16/adamw s0", "gaussws/adamw s0"}
    for label, exp_label in [("bf16/adamw s0", "bf16/adamw"), ("gaussws/adamw s0", "gaussws/adamw")]:
        c = cast[label]
        assert c["val_loss_before"] == res["pqt"][exp_label]["final_val_loss"][0]
        assert math.isfinite(c["val_loss_after"]) and sum(c["tier_share"].values()) == pytest.approx(1.0)
    ctrl = cast["bf16/adamw s0"]                                    # control: every tile at b_target 4 -> FP8
    assert ctrl["tiers"] == "fixed b_target 4" and ctrl["tier_share"]["FP8 e3m4"] == 1.0
    assert ctrl["val_loss_after"] != ctrl["val_loss_before"]         # the evaluated model was cast
    # the sweep casts the same layers to each format from the trained weights (restored after it):
    # its e3m4 row is the control's all-FP8 tier cast, the coarsest format costs the most
    for c in cast.values():
        assert list(c["sweep_delta"]) == [f"e{e}m{m}" for e, m in g.CAST_SWEEP]
    assert ctrl["sweep_delta"]["e3m4"] == ctrl["delta"]
    assert ctrl["sweep_delta"]["e3m1"] > abs(ctrl["sweep_delta"]["e3m4"])
    bits = out["bitwidth"]["gaussws/adamw s0"]
    share = cast["gaussws/adamw s0"]["tier_share"]
    assert share["FP8 e3m4"] == pytest.approx(bits["share_le5"])
    assert share["FP8 e3m4"] + share["FP12 e4m7"] == pytest.approx(bits["share_le9"])
    # Figure 5 data = what train.py logged for the same weights at its last eval
    logged = [r for r in read_run_log(tmp_path / "gaussws_adamw_s0" / "log.jsonl") if r["type"] == "eval"][-1]["bits"]
    assert list(bits["layers"]) == [k for k in logged if k != "all"] and len(bits["layers"]) == 8
    for k, v in bits["layers"].items():
        assert v["mean"] == pytest.approx(logged[k]["mean"], abs=1e-12) and v["min"] <= v["mean"] <= v["max"]

    # a cast model's tiles are on their formats' grids: casting again is lossless
    model, cfg, val = experiments.load_run(str(tmp_path / "gaussws_adamw_s0"))
    assert val() == cast["gaussws/adamw s0"]["val_loss_before"]
    g.cast_to_tiers(model)
    once = val()
    assert once == cast["gaussws/adamw s0"]["val_loss_after"]
    g.cast_to_tiers(model)
    assert val() == once

    # the JSON rows keep each seed's curves (so plots can be redrawn from results/ alone)
    logged = [json.loads(x) for x in open(tmp_path / "gaussws_adamw_s0" / "log.jsonl")]
    curve = res["pqt"]["gaussws/adamw"]["curves"][0]
    assert curve["seed"] == 0 and curve["val"] == [(x["iter"], x["val_loss"]) for x in logged if x["type"] == "eval"]
    assert curve["train"][0] == (0, [x["loss"] for x in logged if x["type"] == "step"][0])

    pytest.importorskip("matplotlib")
    for png in ("pqt.png", "zeropoint.png", "bitwidth.png", "cast.png"):
        assert os.path.getsize(tmp_path / png) > 0
    path = str(tmp_path / "GPU_2026-01-01_quality.json")
    with open(path, "w") as f:
        json.dump(dict(out, gpu="GPU", date="2026-01-01"), f)
    pngs = experiments.plot_results([path])
    assert sorted(os.path.basename(p) for p in pngs) == sorted(
        ["GPU_2026-01-01_quality.png", "GPU_2026-01-01_quality_bitwidth.png",
         "GPU_2026-01-01_quality_cast.png"]
        + [f"GPU_2026-01-01_quality_{e}.png" for e in res])
    assert all(open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_plot_results_draws_every_h200_section(tmp_path, capsys):
    """experiments.py plots: one PNG per committed GPU result JSON (optim, memory, noise, ddp)."""
    pytest.importorskip("matplotlib")
    import glob
    import shutil
    src = [p for p in glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "NVIDIA-H200_*.json"))
           if p.rsplit("_", 1)[-1] in ("optim.json", "memory.json", "noise.json", "ddp.json")]
    assert len(src) >= 4
    for p in src:
        shutil.copy(p, tmp_path)
    pngs = experiments.plot_results(sorted(str(tmp_path / os.path.basename(p)) for p in src))
    assert len(pngs) == len(src) and all(open(p, "rb").read(4) == b"\x89PNG" for p in pngs)
    # a name without a known section is skipped with a message, not silently
    shutil.copy(src[0], tmp_path / "mystery.json")
    assert experiments.plot_results([str(tmp_path / "mystery.json")]) == []
    assert "no plot for" in capsys.readouterr().out


def test_bench_main_quality_on_cpu(corpus, tmp_path, monkeypatch, capsys):
    # --only quality runs on CPU; the JSON keeps the full command; --iters -> --max_iters
    text, data_dir = corpus
    monkeypatch.chdir(tmp_path)
    argv = ["--only", "quality", "--preset", "nano", "--dataset", text, "--experiments", "pqt", "--seeds", "3",
            "--iters", "2", "--train_args", f"--batch_size 4 --eval_windows 8 --tokenizer byte --data_dir {data_dir}"]
    monkeypatch.setattr(sys, "argv", ["bench.py", *argv])
    bench.main()
    [path] = [os.path.join("results", f) for f in os.listdir("results") if f.endswith("_quality.json")]
    res = json.load(open(path))
    assert path.startswith(os.path.join("results", "cpu_"))
    assert res["command"].startswith("python experiments.py quality --preset nano") and "--iters 2" in res["command"]
    assert set(res["experiments"]) == {"pqt"} and res["seeds"] == [3]
    assert set(res["experiments"]["pqt"]) == {"bf16/adamw", "gaussws/adamw", "diffq/adamw", "gaussws/adamw bits_wd 0.5"}
    assert read_run_log(os.path.join("results", "quality_cpu_nano", "bf16_adamw_s3", "log.jsonl"))[-1]["iters"] == 2
    # --resume: finished runs are read back, not trained again (their logs stay as they are)
    log = os.path.join("results", "quality_cpu_nano", "gaussws_adamw_s3", "log.jsonl")
    before = open(log).read()
    monkeypatch.setattr(sys, "argv", ["bench.py", *argv, "--resume"])
    capsys.readouterr()
    bench.main()
    said = capsys.readouterr().out
    assert "[pqt] bf16/adamw" in said and "done:" not in said   # read from the 4 pqt runs' logs, none trained
    assert open(log).read() == before
    assert json.load(open(path))["experiments"] == res["experiments"]
    # an explicit --out_dir keeps the JSON there (results/ is left alone)
    kept = open(path).read()
    monkeypatch.setattr(sys, "argv", ["bench.py", *argv, "--out_dir", "elsewhere"])
    bench.main()
    assert json.load(open(os.path.join("elsewhere", "quality.json")))["seeds"] == [3]
    assert open(path).read() == kept
    for bad, said in ((["--experiments", "pqt,nope"], "--experiments"), (["--seeds", "0,x"], "--seeds"),
                      (["--seeds", "1,1"], "distinct"), (["--seeds", "-1"], ">= 0"), (["--jobs", "0"], "--jobs 0"),
                      (["--iters", "0"], "--iters 0"), (["--out_dir", " "], "--out_dir ' ': empty"),
                      (["--train_args", "--seed 4"], "use bench.py's --seeds"),
                      (["--train_args=--max_iters=9"], "use bench.py's --iters"),
                      (["--train_args", "--max_it 3"], "--max_it"),         # no abbreviation of --max_iters
                      (["--train_args", '--tokenizer "byte'], "--train_args")):   # unbalanced quote
        monkeypatch.setattr(sys, "argv", ["bench.py", *argv, *bad])
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            bench.main()
        assert e.value.code == 2 and said in capsys.readouterr().err, bad
    for bad, said in ((["--only", "train", "--table1", "--methods", "gaussws"], "bf16 first"),
                      (["--only", "train", "--table1", "--methods", "bf16,foo"], "allowed bf16"),
                      (["--only", "train", "--table1", "--methods", "nosuch"], "allowed bf16, gaussws, diffq"),
                      (["--only", "train", "--optims", "zipsr,foo"], "--optims zipsr,foo"),
                      (["--only", "fsdp", "--reps", "0"], "--reps 0"),
                      (["--only", "train", "--table1", "--models", "llama-1b,llama-7b"], "--models llama-1b,llama-7b"),
                      (["--only", "train", "--no-gpt2"], "nothing to run"),
                      (["--only", "train", "--modes", "default,fast"], "allowed default, reduce-overhead"),
                      (["--only", "train", "--pairs", "0"], "--pairs 0"),
                      (["--only", "train", "--table1", "--optims", "zipsr,zipsr"], "each once"),
                      (["--only", "fsdp", "--iters", "10"], "more than 10"),   # before any GPU check
                      (["--only", "ddp", "--iters", "-5"], "--iters -5"),
                      (["--only", "train", "--compile", "blocks"], "--compile without --table1"),
                      (["--only", "train", "--models", "llama-1b"], "--models without --table1"),
                      (["--only", "train", "--table1", "--compile", "bogus"], "--compile")):
        monkeypatch.setattr(sys, "argv", ["bench.py", *bad])
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            bench.main()
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and said in err and len(err.splitlines()) == 1, (bad, err)
    if not torch.cuda.is_available():
        monkeypatch.setattr(sys, "argv", ["bench.py", "--only", "noise"])
        with pytest.raises(SystemExit, match="--only noise needs a CUDA GPU"):
            bench.main()


def test_bench_train_cuda_rows_interleave_rounds_and_profile_the_last(monkeypatch):
    """bench_train's CUDA branch with the GPU parts stubbed: each round measures every method once,
    in order, and only the last round is profiled."""
    import types
    order, profiled, times = [], [], iter([100.0, 101.0, 98.0, 100.0])   # bf16, gaussws, bf16, gaussws

    def setup(preset, method, optim, batch, T, device, compile):
        order.append(method)
        return types.SimpleNamespace(num_params=lambda: 7), None, lambda: None
    monkeypatch.setattr(bench_training, "train_setup", setup)
    monkeypatch.setattr(bench_training, "queued_steps_ms", lambda step, n: next(times))
    monkeypatch.setattr(bench_training, "_gpu_profile", lambda step: profiled.append(order[-1]) or (float(len(profiled)), 9.0))
    for name in ("reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 2 ** 30)
    res = bench.bench_train(cases=[("llama-1b", 8)], optims=("adamw",), methods=("bf16", "gaussws"), device="cuda",
                            rounds=2)
    assert order == ["bf16", "gaussws", "bf16", "gaussws"] and profiled == ["bf16", "gaussws"]
    base, ours = res["rows"]
    assert base["step_ms_rounds"] == [100.0, 98.0] and ours["step_ms_rounds"] == [101.0, 100.0]
    assert ours["overhead_pct_rounds"] == [100 * (1 - 100 / 101), 100 * (1 - 98 / 100)]
    assert (base["gpu_ms_per_step"], ours["gpu_ms_per_step"], ours["gpu_ops_per_step"]) == (1.0, 2.0, 9.0)
    assert ours["peak_GiB"] == 1.0


def test_bench_names_flags_the_chosen_sections_do_not_read(capsys):
    ap = bench.build_parser()
    for argv, note in ((["--only", "host", "--pairs", "3", "--quick"], "not read by --only host: --quick, --pairs"),
                       (["--eager", "--reps", "2"], "not read by --only (default: optim, noise, memory, train): --eager, --reps"),
                       (["--only", "fsdp", "--reps", "2", "--iters", "20", "--train_args", "--seed 1"], None),
                       (["--only", "quality", "--seeds", "2", "--pairs", "3"], "not read by --only quality: --pairs"),
                       (["--only", "noise", "--compile", "blocks", "--methods", "gaussws"],
                        "not read by --only noise: --methods, --compile")):
        args = ap.parse_args(argv)
        bench.check_args(ap, args)      # the train section's rules only where it runs
        bench.say_unread_flags(ap, args)
        out = capsys.readouterr().out
        assert (out == f"note: {note}\n") if note else out == "", (argv, out)
    assert set(bench.READ_BY) <= set(vars(ap.parse_args([])))


def test_bench_gpu_time_counts_kernels_not_ranges_on_the_gpu_timeline():
    """The profiled GPU ms of a Table 1 row sums the GPU's operations, not the record_function
    ranges shown on the GPU timeline (torch's optimizers put one around their kernels)."""
    from torch.autograd.profiler_util import FunctionEvent
    cuda = torch.autograd.DeviceType.CUDA
    ev = lambda name, t0, t1, **kw: FunctionEvent(0, name, 0, t0, t1, **kw)
    events = [ev("mm_kernel", 0, 5, device_type=cuda), ev("adamw_kernel", 5, 8, device_type=cuda),
              ev("Optimizer.step#AdamW.step", 5, 8, device_type=cuda, is_user_annotation=True),
              ev("aten::mm", 0, 1)]
    assert [e.name for e in bench_training.device_ops(events)] == ["mm_kernel", "adamw_kernel"]


def test_bench_table1_rows_alone(monkeypatch):
    """`--no-gpt2 --models` runs only the named Table 1 rows (in Table 1's order), without the GPT-2
    comparison, and saves them under a name of their own (a run per model fills the table)."""
    seen, saved = {}, []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "bench_train_gpt2", lambda **k: pytest.fail("the GPT-2 comparison ran"))
    monkeypatch.setattr(bench, "bench_train", lambda cases, **k: seen.update(cases=cases, **k) or dict(
        rows=[dict(model=c[0]) for c in cases], geomean_overhead_pct={}))
    monkeypatch.setattr(bench, "save", lambda section, result, path=None: saved.append((section, result)))
    bench.main(["--only", "train", "--table1", "--compile", "--no-gpt2", "--models", "llama-3b,llama-1b",
                "--methods", "bf16,gaussws", "--optims", "adamw"])
    assert seen["cases"] == [("llama-1b", 8), ("llama-3b", 2)] and seen["compile"] and seen["rounds"] == 2
    assert seen["methods"] == ("bf16", "gaussws") and seen["optims"] == ("adamw",)
    section, result = saved[-1]
    assert section == "train_table1_compiled_llama-3b_llama-1b" and [r["model"] for r in result["rows"]] == [
        "llama-1b", "llama-3b"]
    assert result["command"].endswith("--models llama-3b,llama-1b --methods bf16,gaussws --optims adamw")
    bench.main(["--only", "train", "--table1", "--compile", "blocks", "--no-gpt2", "--models", "llama-1b"])
    assert seen["compile"] == "blocks" and saved[-1][0] == "train_table1_compiled_blocks_llama-1b"


def test_bench_compile_blocks_compiles_each_block_and_nothing_else():
    """Table 1 with `--compile blocks`: every transformer block is compiled (one graph that all
    blocks share), the model around them runs eager."""
    model, _, _ = bench_training.train_setup("nano-llama", "gaussws", "zipsr", 2, 16, torch.device("cpu"), "blocks")
    assert all(b._compiled_call_impl is not None for b in model.blocks)
    assert all(m._compiled_call_impl is None for m in model.modules() if not isinstance(m, type(model.blocks[0]))
               and not any(m is s for b in model.blocks for s in b.modules()))


def test_quality_bench_sigterm_ends_its_runs(corpus, tmp_path):
    """A time limit's SIGTERM to `bench.py --only quality --jobs 2` also ends its train.py runs."""
    import signal
    import time
    text, data_dir = corpus
    out = str(tmp_path / "q")
    cmd = [sys.executable, bench.__file__, "--only", "quality", "--preset", "nano", "--dataset", text,
           "--experiments", "pqt", "--seeds", "0", "--iters", "100000", "--jobs", "2", "--out_dir", out,
           "--train_args", f"--batch_size 4 --eval_windows 8 --tokenizer byte --data_dir {data_dir}"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    started = 0
    for line in p.stdout:
        started += "[quality] started" in line
        if started == 2:
            break
    time.sleep(2)

    def runs_alive():
        alive = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if out.encode() in f.read() and int(pid) != p.pid:
                        alive.append(pid)
            except OSError:
                pass
        return alive
    assert runs_alive()                       # the two train.py runs are going
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) != 0
    deadline = time.time() + 30
    while runs_alive() and time.time() < deadline:
        time.sleep(0.5)
    assert not runs_alive()


def test_experiments_main_checks_quality_flags_and_plots(tmp_path, capsys):
    """experiments.py quality takes bench.py --only quality's flags and names its own in errors;
    experiments.py plots skips a file without a known section; bench.py --help lists both."""
    for bad, said in ((["--seeds", "1,1"], "distinct"), (["--train_args", "--seed 4"], "use experiments.py's --seeds"),
                      (["--suite", "gpt2", "--experiments", "pqt,bits"], "unknown bits in --suite gpt2"),
                      (["--max_runs", "-1"], "--max_runs -1"),
                      (["--iters", "2", "--tokens_per_param", "1"], "give one run length"),
                      (["--resume", "--overwrite"], "not both")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            experiments.main(["quality", "--preset", "nano", *bad])
        assert e.value.code == 2 and said in capsys.readouterr().err, bad
    assert "--tokens_per_param" in bench.build_parser().format_help()
    pytest.importorskip("matplotlib")
    (tmp_path / "mystery.json").write_text("{}")
    experiments.main(["plots", str(tmp_path / "mystery.json")])
    assert "no plot for" in capsys.readouterr().out


def test_tools_parses_each_subcommand_and_finds_what_it_calls(capsys):
    """tools.py: each subcommand's flags parse, bad values are one-line errors, the GPU ones say so
    on CPU, and the gaussws and bench_training functions they call exist (a rename shows here)."""
    ap = tools.build_parser()
    assert ap.parse_args(["kernels", "--short", "--shapes", "4096x4096,768x2048"]).shapes == [(4096, 4096), (768, 2048)]
    assert ap.parse_args(["kernels"]).shapes is None and ap.parse_args(["launches"]).command == "launches"
    assert ap.parse_args(["profile", "llama-1b"]).presets == ["llama-1b"]
    for bad, said in ((["kernels", "--shapes", "4096"], "MxN"), (["profile", "llama-9b"], "not a Table 1 preset"),
                      (["nosuch"], "invalid choice")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            tools.main(bad)
        assert e.value.code == 2 and said in capsys.readouterr().err, bad
    assert all(callable(getattr(g, n)) for n in tools.GAUSSWS_NAMES)
    assert all(callable(getattr(bench_training, n)) for n in ("train_setup", "queued_steps_ms", "device_ops"))
    if not torch.cuda.is_available():
        for cmd in ("kernels", "profile"):
            with pytest.raises(SystemExit, match=f"tools.py {cmd} needs a CUDA GPU"):
                tools.main([cmd])


# =============================================================================================
# finetune_hf.py: the Hugging Face example (needs transformers and accelerate)

def test_finetune_hf_example_writes_a_plain_model_that_loads_without_this_repo(tmp_path, monkeypatch, capsys):
    tf = pytest.importorskip("transformers", reason="finetune_hf.py needs transformers and accelerate")
    from examples import finetune_hf
    monkeypatch.setenv("OMP_NUM_THREADS", "1")        # main leaves the test's thread count alone
    text = tmp_path / "corpus.txt"
    text.write_text(open(argparse.__file__, encoding="utf-8").read()[:40000], encoding="utf-8")
    out = tmp_path / "plain"
    before, after = finetune_hf.main(["--text", str(text), "--max_steps", "3", "--batch_size", "2",
                                      "--block_size", "32", "--cast", "e3m4", "--out", str(out)])
    assert before < math.log(256) and math.isfinite(after)
    model = tf.AutoModelForCausalLM.from_pretrained(str(out))
    assert not [k for k in model.state_dict() if k.endswith(("b_i", "noise_state"))]
    assert not g.pqt_layers(model)
    # every sampled weight holds e3m4 values, tile by tile; the embedding is as trained
    w = model.model.layers[0].mlp.up_proj.weight.detach()
    assert torch.equal(g.cast_tiles(w, 3, 4), w)
    assert not torch.equal(g.cast_tiles(model.model.embed_tokens.weight.detach(), 3, 4),
                           model.model.embed_tokens.weight)
    for argv, msg in ((["--cast", "fp8"], "--cast 'fp8'"), (["--max_steps", "0"], "--max_steps 0"),
                      ([], "no such file")):
        with pytest.raises(SystemExit):
            finetune_hf.parse_args(["--text", str(text) if argv else "/no/such.txt", *argv])
        assert msg in capsys.readouterr().err


def test_finetune_hf_rejects_bad_inputs_in_one_line_before_training(tmp_path, capsys):
    from examples import finetune_hf
    text = tmp_path / "corpus.txt"
    text.write_text("some text\n" * 50, encoding="utf-8")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00abc")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "afile").write_text("x")
    for argv, msg in ((["--parts", "foo"], "--parts 'foo': unknown part(s) ['foo']"),
                      (["--b_init", "3", "--b_target", "4"], "--b_target 4.0 > b_init=3.0"),
                      (["--lr", "-1"], "--lr -1.0: must be a finite number > 0"),
                      (["--text", str(tmp_path / "bin.txt")], "is not UTF-8 text"),
                      (["--text", str(tmp_path / "empty.txt")], "is empty"),
                      (["--text", str(tmp_path)], "is a folder"),
                      (["--out", str(tmp_path / "afile")], "is a file"),
                      (["--model", "not a/model id!"], "neither a local folder nor a Hugging Face model id")):
        with pytest.raises(SystemExit):
            finetune_hf.parse_args(["--text", str(text), *argv])
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err, (argv, err)
    assert finetune_hf.parse_args(["--text", str(text), "--cast", "none", "--parts", "q_proj,o_proj"]).cast is None
    with pytest.raises(SystemExit):
        finetune_hf.parse_args(["--help"])
    assert "tokenizer when --model is given" in " ".join(capsys.readouterr().out.split())


# =============================================================================================
# README.md: its code runs as pasted, its commands in the order shown

ROOT = os.path.dirname(os.path.abspath(__file__))


def readme_blocks(lang):
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("i", range(3))
def test_readme_python_block_runs_as_pasted(i, tmp_path):
    blocks = readme_blocks("python")
    assert len(blocks) == 3                        # AdamW4bit loop, apply_pqt, Hugging Face
    if "transformers" in blocks[i]:
        pytest.importorskip("transformers", reason="the Hugging Face block needs transformers and accelerate")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")   # from another folder, as after pip install
    r = subprocess.run([sys.executable, "-c", blocks[i]], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def test_readme_train_commands_each_write_their_own_out_dir():
    # run in the order shown, a fresh run into a folder holding a checkpoint is refused; only --resume reuses one
    seen = set()
    for block in readme_blocks("bash"):
        for line in block.splitlines():
            for cmd in line.split("#")[0].split("&&"):
                argv = shlex.split(cmd)
                if "train.py" not in argv:
                    continue
                args = build_parser().parse_args(argv[argv.index("train.py") + 1:])
                if args.resume is None:
                    assert args.out_dir not in seen, f"README: {cmd.strip()!r} reuses --out_dir {args.out_dir}"
                    seen.add(args.out_dir)
                else:
                    assert args.out_dir in seen, f"README: {cmd.strip()!r} resumes a folder no command wrote"
    assert len(seen) >= 5


# =============================================================================================
# the repository's modules: no two import each other

def _local_imports(name):
    """Repository modules a module imports, anywhere in it (function-level imports too)."""
    import ast
    local = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}
    tree = ast.parse(open(os.path.join(ROOT, name + ".py")).read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & local


def test_no_two_modules_import_each_other():
    """Every import (at top level or inside a function) between the top-level .py files: a pair
    that imports each other is a circle a reader cannot follow from one file to the other."""
    mods = [f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")]
    imports = {name: _local_imports(name) - {name} for name in mods}
    pairs = sorted({tuple(sorted((a, b))) for a in imports for b in imports[a] if a in imports[b]})
    assert not pairs, "modules that import each other: " + ", ".join(f"{a}.py <-> {b}.py" for a, b in pairs)


# ----------------------------------------------------------------------------------------------
# packaging: pyproject.toml installs the library modules and everything they import


def _pyproject_modules():
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["py-modules"]


def test_pyproject_installs_every_module_the_library_modules_import():
    listed = set(_pyproject_modules())
    assert {"adam4bit", "gaussws", "codebooks", "philox"} <= listed
    missing = {(m, d) for m in listed for d in _local_imports(m) if d not in listed}
    # gaussws serves the names of the files built on it when asked for (its module __getattr__)
    missing |= {("gaussws", d) for d in set(g._SIBLING_OF.values()) if d not in listed}
    assert not missing, f"imported by an installed module but not in pyproject.toml's py-modules: {sorted(missing)}"
