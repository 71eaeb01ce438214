"""
GaussWS (gaussws.py, lowbit/pqt/) beyond test_all.py's facts: packing and independence of the noise
(|corr| below 6 standard errors: a correct generator fails with probability about 2e-9), tiles,
backward and the seeds under the memory modes and activation checkpointing, ∂L/∂b_i inside the grad
kernel, GaussWSLinear and apply_pqt on a small model, torch.compile, bad input and argument checks,
GaussWSLinear under FSDP2.
"""
import io
import itertools
import math
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
import triton
import triton.language as tl

import gaussws as g
import train
from lowbit.pqt.baselines import _diffq_offsets
from lowbit.pqt.checks import B_MAX, B_MIN, _SEED_CACHE, _SEED_CACHE_SIZE, seed_tensor
from lowbit.pqt.export import fp_tier
from lowbit.pqt.packing import pack_noise, unpack_noise
from lowbit.pqt.tiles import broadcast_tiles, tile_grid
from lowbit.pqt.tl import CONFIG
from model import GPT, preset_config

from test_all import DEV, ODD_SHAPES
from tests.helpers import ROOT, Model, assert_same_grads, base_args, float_bits, gpt2_like, read_log, untouched


# ---------------------------------------------------------------------------------------------
# the noise: packing, independence across layers, steps and neighbours, the DiffQ kernel's offsets

def test_pack_roundtrip():
    torch.manual_seed(0)
    for m, n in ODD_SHAPES:
        r = torch.randint(-7, 8, (m, n), dtype=torch.int8)
        p = pack_noise(r)
        assert p.dtype == torch.int32 and p.shape == (m, -(-n // 8))
        assert torch.equal(unpack_noise(p, n), r)
        if n % 8 == 0:   # otherwise the last word also holds unused padding nibbles
            packed = g.generate_noise((m, n), 11)
            assert torch.equal(pack_noise(unpack_noise(packed, n)), packed)   # zero stored as +0
    # element j of a group in bits [4j, 4j+4), sign-magnitude
    r = torch.tensor([[1, -1, 2, -2, 0, 7, -7, 3]], dtype=torch.int8)
    want = sum(v << (4 * j) for j, v in enumerate([1, 9, 2, 10, 0, 7, 15, 3]))
    assert pack_noise(r).item() == want - 2 ** 32 * (want >= 2 ** 31)


def test_noise_correlation_across_layers_steps_and_neighbours():
    """|corr| < 6/sqrt(N) (6 standard errors of a zero correlation; N = 2^20) between two layers
    (keys from apply_pqt's seed generator), two steps of one layer, and horizontally adjacent
    elements (which share Philox words)."""
    m = n = 1024
    bound = 6 / math.sqrt(m * n)
    model = gpt2_like()
    g.apply_pqt(model, seed=0)
    keys = [mod.noise_state[0].item() for _, mod in g.pqt_layers(model)]
    assert len(set(keys)) == len(keys)
    R = lambda key, t: unpack_noise(g.generate_noise((m, n), torch.tensor([key, t])), n).double().flatten()
    corr = lambda a, b: torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    a = R(keys[0], 5)
    assert abs(corr(a, R(keys[1], 5))) < bound
    assert abs(corr(a, R(keys[0], 6))) < bound
    a2 = a.view(m, n)
    assert abs(corr(a2[:, :-1].flatten(), a2[:, 1:].flatten())) < 6 / math.sqrt(m * (n - 1))
    assert abs(corr(a2[:-1].flatten(), a2[1:].flatten())) < 6 / math.sqrt((m - 1) * n)


@triton.jit
def _diffq_offsets_probe(offs_ptr, mask_ptr, pid, M, N, N8, BLOCK: tl.constexpr):
    offs, mask = _diffq_offsets(pid, M, N, N8, BLOCK)
    i = tl.arange(0, 8 * BLOCK)
    tl.store(offs_ptr + i, offs)
    tl.store(mask_ptr + i, mask.to(tl.int8))


@pytest.mark.parametrize("m,n", [(200_000_000, 9), (238_609_294, 9), (2 ** 31 - 1, 1), (34_000_000, 63)])
def test_diffq_store_offsets_past_the_int32_element_index(m, n):
    """The DiffQ kernel's store offsets (row * n + col, mask) are exact where the element index
    8 * word passes 2^31 (m * ceil(n/8) > 2^28 with n % 8 != 0, shapes the size guard accepts): the
    programs around that point and the last one, without allocating the (m, n) output."""
    block = CONFIG["gen_block"]
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


# ---------------------------------------------------------------------------------------------
# eq. 3: tiles

@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_transpose_tiles(impl):
    """Square tiles: the PQN of Wᵀ (same R transposed, b_tᵀ) is the transpose of W's."""
    torch.manual_seed(4)
    w = torch.randn(70, 45, device=DEV)
    bt = 3 + 5 * torch.rand(tile_grid(70, 45), device=DEV)
    r = unpack_noise(g.generate_noise((70, 45), 8, device=DEV), 45)
    a, ta = g.apply_noise(w, pack_noise(r), bt, impl=impl)
    b, tb = g.apply_noise(w.t(), pack_noise(r.t()), bt.t(), impl=impl)   # non-contiguous w is copied
    assert torch.equal(ta.t(), tb) and torch.equal(a.t(), b)
    assert torch.equal(g.tile_max(w.t(), impl=impl), g.tile_max(w, impl=impl).t())


def test_nan_in_a_tile_makes_its_maximum_and_w_hat_nan_in_both_implementations():
    """torch's amax propagates a NaN; the kernels' tile maximum does too (a plain tl.max would skip
    it and leave the rest of the tile finite), so both give the same NaN tile."""
    w = torch.randn(64, 70)
    w[3, 40] = float("nan")
    bt = torch.full(tile_grid(64, 70), 5.0)
    for fused in (False, True):
        outs = [g.gaussws_sample(w, bt, 1, impl=impl, fused=fused, out_dtype=torch.float32) for impl in ("torch", "triton")]
        for out in outs:
            assert out[:32, 32:64].isnan().all() and not out[32:].isnan().any() and not out[:, :32].isnan().any()
        assert torch.equal(outs[0].nan_to_num(), outs[1].nan_to_num())
    tm = [g.tile_max(w, impl=impl) for impl in ("torch", "triton")]
    assert tm[0][0, 1].isnan() and tm[1][0, 1].isnan() and torch.equal(tm[0].nan_to_num(), tm[1].nan_to_num())


# ---------------------------------------------------------------------------------------------
# eq. 4 and the seeds: backward, memory modes, activation checkpointing

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
    plain = gpt2_like()
    ck = gpt2_like(checkpointed=True)
    ck.load_state_dict(plain.state_dict())
    g.apply_pqt(plain, seed=4, memory=memory)
    g.apply_pqt(ck, seed=4, memory=memory)
    x = torch.randn(2, 7, 32)
    for _ in range(2):
        for mdl in (plain, ck):
            mdl.zero_grad()
            mdl(x).square().sum().backward()
        assert_same_grads(plain, ck, rtol=1e-5, atol=1e-6)
    assert ck.blocks[0].attn.qkv.noise_state[1].item() == 2 == plain.blocks[0].attn.qkv.noise_state[1].item()


def _checkpoint_pattern(model, pattern, checkpointed, reentrant, x):
    """Loss of one of the checkpoint use patterns on Model's block 0 and LM head."""
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
    plain, ck = gpt2_like(), gpt2_like()
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
        assert_same_grads(plain, ck, rtol=1e-5, atol=1e-6)


def _gpt_steps(method, memory, checkpointed, compiled, steps=2):
    """Weight and b_i gradients and noise counters after each of `steps` SGD steps of the 2-layer
    model.GPT under PQT (impl "torch"), its blocks checkpointed or not, compiled (aot_eager) or not."""
    torch.manual_seed(0)
    model = GPT(preset_config("nano", vocab_size=64, block_size=16))
    g.apply_pqt(model, method=method, memory=memory, seed=3, impl="torch")
    model.checkpoint_blocks = checkpointed
    run = torch.compile(model, backend="aot_eager") if compiled else model
    batches = torch.randint(0, 64, (steps, 2, 2, 16), generator=torch.Generator().manual_seed(1))
    seen = []
    for idx, targets in batches:
        model.zero_grad()
        run(idx, targets)[1].backward()
        seen.append({n: p.grad.clone() for n, p in model.named_parameters()}
                    | {n: b.clone() for n, b in model.named_buffers() if n.endswith("noise_state")})
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return seen


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
@pytest.mark.parametrize("method,memory", [("gaussws", "save"), ("diffq", "recompute")])
def test_checkpointed_blocks_train_as_plain_ones_bit_for_bit_also_compiled(method, memory, compiled):
    """torch.utils.checkpoint around each block, eager or inside the compiled model: every weight
    and b_i gradient and every noise counter equals the plain model's, bit for bit, for two steps
    (compiled, the recomputation would otherwise read the counter its forward already advanced)."""
    plain, ck = (_gpt_steps(method, memory, c, compiled) for c in (False, True))
    for step, (a, b) in enumerate(zip(plain, ck)):
        assert any(k.endswith("b_i") for k in a) and sum(k.endswith("noise_state") for k in a) == 8
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (step, k)
    assert plain[-1]["blocks.1.mlp.down.noise_state"][1].item() == 2


@pytest.mark.parametrize("pattern", ["twice_in_one_region", "two_forwards_one_backward"])
def test_compiled_checkpoint_gives_the_plain_gradients_where_eager_code_raises(pattern):
    """Compiled, a call's seed is saved for backward: the patterns eager code refuses (a layer
    twice in one checkpointed region, two checkpointed forwards before one backward) give the
    plain run's gradients and counters, bit for bit, two steps."""
    torch.manual_seed(17)
    plain, ck = gpt2_like(), gpt2_like()
    ck.load_state_dict(plain.state_dict())
    g.apply_pqt(plain, seed=4, impl="torch")
    g.apply_pqt(ck, seed=4, impl="torch")
    compiled = torch.compile(lambda t: _checkpoint_pattern(ck, pattern, True, False, t), backend="aot_eager")
    x = torch.randn(2, 7, 32)
    for _ in range(2):
        for mdl in (plain, ck):
            mdl.zero_grad()
        _checkpoint_pattern(plain, pattern, False, False, x).backward()
        compiled(x).backward()
        for (n, p), q in zip(plain.named_parameters(), ck.parameters()):
            assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), n
        assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), ck.buffers()))
    assert ck.blocks[0].attn.qkv.noise_state[1].item() == 4


def test_train_py_compiles_checkpointed_gaussws_blocks_as_the_plain_run(corpus, tmp_path, monkeypatch):
    """train.py --activation_checkpointing --compile --method gaussws runs and logs the losses of
    the plain eager run, bit for bit (torch.compile's aot_eager backend: Inductor on CPU takes
    minutes)."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compile_(model, backend="aot_eager"))
    logs = []
    for flags in (["--no-compile"], ["--compile", "--activation_checkpointing"]):
        out = tmp_path / flags[-1].strip("-")
        train.main(base_args(corpus, out, "--method", "gaussws", "--max_iters", "2", "--eval_interval", "2", *flags))
        logs.append([(r["type"], r.get("loss"), r.get("val_loss"), r.get("bits")) for r in read_log(out)
                     if r["type"] in ("step", "eval")])
    assert len(logs[0]) == 4 and logs[0] == logs[1]


# ---------------------------------------------------------------------------------------------
# ∂L/∂b_i inside the grad kernel: autograd's bits, no autograd ops after the kernel

def _same_bits_but_zero_sign(a, b):
    """Where a and b are the same float bits, or both zero: on a GPU a tile whose sum_32(g ⊙ R)
    is a zero can give the grad kernel a zero of the other sign than the separate launch whose
    ∂L/∂2^(1−b_t) the reference is fed (seen on the H200: +0 against −0)."""
    return (float_bits(a) == float_bits(b)) | ((a == 0) & (b == 0))


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
        tm, tn = tile_grid(m, n)
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
            ulps = (float_bits(live) - float_bits(ref)).abs()
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
        clamped = (b_t < B_MIN) | (b_t > B_MAX)
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
from lowbit.pqt.checks import B_MAX, B_MIN
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
        src = ASTSource(fn=g._apply_kernel, signature=sig, constexprs=dict(NOISE=2, BT=1, BITS=True, B_LO=B_MIN,
                                                                             B_HI=B_MAX, INTERPRET=False))
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        assert "add.rn.f32" in ptx or "add.rn.ftz.f32" in ptx, (ft, bd)
        print(ft, bd, "compiled")
"""
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
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
    tiles, seen, inside = tile_grid(70, 45), [], [0]
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

def test_apply_pqt_parts_and_untouched_modules():
    m = gpt2_like()
    w_qkv, head, wte = m.blocks[0].attn.qkv.weight, m.lm_head, m.wte
    names = g.apply_pqt(m, parts="all")
    assert names == [f"blocks.{i}.{p}" for i in range(2) for p in ("attn.qkv", "attn.out", "mlp.up", "mlp.down")]
    assert m.blocks[0].attn.qkv.weight is w_qkv and m.lm_head is head and m.wte is wte
    assert type(m.lm_head) is nn.Linear
    assert m.blocks[1].mlp.down.b_i.shape == (1, 3) and m.blocks[0].attn.qkv.b_i.shape == (3, 1)
    assert torch.all(m.blocks[0].attn.qkv.b_t == 6.0)
    assert g.apply_pqt(gpt2_like(), parts="od") == ["blocks.0.attn.out", "blocks.0.mlp.down", "blocks.1.attn.out", "blocks.1.mlp.down"]
    assert g.apply_pqt(gpt2_like(), parts="qkv, up") == ["blocks.0.attn.qkv", "blocks.0.mlp.up", "blocks.1.attn.qkv", "blocks.1.mlp.up"]
    ll = Model(llama=True)
    names = g.apply_pqt(ll, parts="all", method="diffq", memory="recompute")
    assert len(names) == 14 and all(m.method == "diffq" and m.memory == "recompute" for _, m in g.pqt_layers(ll))
    assert g.apply_pqt(Model(llama=True), parts="gate,k") == ["blocks.0.attn.k", "blocks.0.mlp.gate", "blocks.1.attn.k", "blocks.1.mlp.gate"]
    # same seed -> same layer keys; another seed -> other keys
    k = lambda s: [l.noise_state[0].item() for _, l in g.pqt_layers(_apply(s))]
    assert k(1) == k(1) and not set(k(1)) & set(k(2))


def _apply(seed):
    m = gpt2_like()
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
    a = gpt2_like()
    g.apply_pqt(a, seed=21)
    x = torch.randn(2, 3, 32)
    a(x)
    a(x)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    assert any(k.endswith("noise_state") for k in a.state_dict())
    cont = [a(x) for _ in range(2)]
    b = gpt2_like()
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
    m = gpt2_like()
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
    assert [fp_tier(b) for b in (4, 5, 5.5, 9, 12, 13)] == ["FP8 e3m4", "FP8 e3m4", "FP12 e4m7", "FP12 e4m7", "FP16 e5m10", ">FP16"]


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("shutil").which("g++") is None,
                    reason="Inductor on CPU needs a C++ compiler")
def test_compile_inductor_matches_eager():
    """torch.compile (Inductor) of a PQT model: forward and b_i grads equal eager's (the seed
    saved for backward must not alias the advancing counter)."""
    torch.manual_seed(15)
    eager = gpt2_like(n_layer=1)     # its 4 PQT layers: Inductor's time grows with the layers
    comp = gpt2_like(n_layer=1)
    comp.load_state_dict(eager.state_dict())
    g.apply_pqt(eager, seed=5)
    g.apply_pqt(comp, seed=5)
    cm = torch.compile(comp)
    x = torch.randn(2, 3, 32)
    for mdl in (eager, cm):
        mdl(x).square().sum().backward()
    assert_same_grads(eager, comp, rtol=1e-4, atol=1e-5)
    assert comp.blocks[0].attn.qkv.noise_state[1].item() == 1


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("shutil").which("g++") is None,
                    reason="Inductor on CPU needs a C++ compiler")
def test_compile_inductor_checkpointed_layer_matches_eager():
    """A PQT layer under torch.utils.checkpoint inside a function Inductor compiles: its gradients
    equal eager's for two steps. The recomputation must take the seed the forward saved, not read
    the counter again (Inductor drops a clone of the counter as a no-op: the seed is no clone)."""
    torch.manual_seed(15)
    eager = g.GaussWSLinear(45, 70, seed=2, impl="torch").to(DEV)
    comp = g.GaussWSLinear(45, 70, seed=2, impl="torch").to(DEV)
    comp.load_state_dict(eager.state_dict())
    step = torch.compile(lambda t: checkpoint.checkpoint(comp, t, use_reentrant=False).square().sum())
    x = torch.randn(4, 45, device=DEV)
    for _ in range(2):
        for layer in (eager, comp):
            layer.zero_grad()
        eager(x).square().sum().backward()
        step(x).backward()
        assert_same_grads(eager, comp, rtol=1e-4, atol=1e-5)
    assert comp.noise_state[1].item() == 2


def test_eager_layer_skips_op_dispatch(monkeypatch):
    """Eager forward/backward of a PQT layer calls the kernels' Python functions directly, not the
    torch.library ops (their dispatch made an eager 3B step host-bound on the GPU); the result
    equals the op path's (w_hat and both grads)."""
    torch.manual_seed(16)
    w = torch.randn(70, 45, requires_grad=True)
    b = torch.full(tile_grid(70, 45), 5.0, requires_grad=True)
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
        g.apply_pqt(gpt2_like(), parts="qkv,attn")
    with pytest.raises(ValueError, match="no nn.Linear named"):
        g.apply_pqt(gpt2_like(), parts="gate")
    with pytest.raises(ValueError, match="the parts it has: none; linears without a part name: '0'; select other layers by name with modules="):
        g.apply_pqt(nn.Sequential(nn.Linear(3, 3)))
    with pytest.raises(ValueError, match="the model is itself a linear layer \\(Linear\\).*nn.Sequential"):
        g.apply_pqt(nn.Linear(3, 3))
    assert g.apply_pqt(nn.Sequential(nn.Linear(3, 3)), modules="*") == ["0"]   # the message's advice works
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
                 lambda: g.apply_pqt(gpt2_like(), fused="no"), lambda: g.pqt_linear(w[:1], w, bt, None, 0, fused=1)):
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


# ---------------------------------------------------------------------------------------------
# input checks: b_init / b_target (eq. 11), parts, weights, the b_t clamp, seeds, stats

def _gpt(kind):
    torch.manual_seed(0)
    return GPT(preset_config("nano-llama" if kind == "llama" else "nano", vocab_size=64))


def test_sample_without_autocast_takes_the_bias_and_apply_noise_no_autograd():
    """Outside autocast a BF16 x with FP32 weight and bias works in both memory modes and gives
    the same output (the bias is cast to w_hat's dtype, as autocast casts it); `apply_noise`
    makes no autograd graph."""
    torch.manual_seed(3)
    w, bias = torch.randn(33, 100, requires_grad=True), torch.randn(33, requires_grad=True)
    bt = torch.full(tile_grid(33, 100), 5.0, requires_grad=True)
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
    assert untouched(m)
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
    assert untouched(m)                      # nothing replaced, not even the parts that exist


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
    assert untouched(m)
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
    r = unpack_noise(g.generate_noise((m, n), seed), n).double()
    tmax = g._tile_max_torch(w).double()
    b_eff = bt_raw.double().clamp(1, 24)
    ref = w.double() + r * broadcast_tiles(tmax * torch.exp2(1 - b_eff), m, n)   # eq. 3, clamped b_t
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
    assert untouched(m)
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
# seeds: an int seed is the tensor seed, device seeds are cached

def test_int_seed_is_the_tensor_seed_and_device_seeds_are_cached():
    """seed=s and seed=tensor([s, 0]) give the same w_hat bits and the same gradients (CPU). A
    seed tensor for another device is made once (fills, no host-to-device copy; the meta device
    stands in for a GPU here) and reused, the cache stays bounded, the counter slot is 0."""
    torch.manual_seed(31)
    w = torch.randn(70, 45, requires_grad=True)
    bt = (3 + 5 * torch.rand(tile_grid(70, 45))).requires_grad_()
    out = []
    for seed in (2 ** 62 + 5, torch.tensor([2 ** 62 + 5, 0])):
        w.grad = bt.grad = None
        w_hat = g.gaussws_sample(w, bt, seed, out_dtype=torch.float32)
        w_hat.square().sum().backward()
        out.append((w_hat.detach(), w.grad.clone(), bt.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*out))
    assert torch.equal(seed_tensor(9, "cpu"), torch.tensor([9, 0]))
    a = seed_tensor(2 ** 63 - 1, "meta")
    assert a is seed_tensor(2 ** 63 - 1, "meta") and a.dtype == torch.int64 and a.shape == (2,)
    for s in range(_SEED_CACHE_SIZE + 3):
        seed_tensor(s, "meta")
    assert len(_SEED_CACHE) <= _SEED_CACHE_SIZE
    assert (torch.device("meta"), 2 ** 63 - 1) not in _SEED_CACHE    # the oldest went first


# ---------------------------------------------------------------------------------------------
# GaussWSLinear inside fully_shard units (FSDP2), run by the fsdp_runs fixture on 2 gloo processes

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
