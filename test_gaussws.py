"""Tests for gaussws.py (paper A). Kernels run on CPU tensors under TRITON_INTERPRET=1:

    cd /work/main && TRITON_INTERPRET=1 python -m pytest -q test_gaussws.py

Statistical tests state their bounds; a bound at p = 1e-6 (chi-square) or 6 standard errors
(correlations) fails a correct implementation with probability < 1e-6 per test, and the draws
are seeded, so the outcome is deterministic.
"""
import io
import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint

import gaussws as g

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                       reason="Triton kernels need TRITON_INTERPRET=1 on CPU")
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
    scale = g._broadcast_tiles(tmax * torch.exp2(1 - b_t), m, n)
    return w + r.double() * scale


# ---------------------------------------------------------------------------------------------
# the noise law (eq. 10), Philox, packing

def test_recipe_exhaustive_and_exact_law():
    """The word-parallel recipe equals SPEC's per-element recipe on all 2^16 bit patterns, for
    every element slot j, and those patterns realise eq. 10 exactly."""
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


def test_philox_known_answers():
    """Philox4x32-10 known-answer vectors of Random123 (Salmon et al. 2011)."""
    t = lambda v: torch.tensor([v], dtype=torch.int64)
    M = 0xFFFFFFFF
    cases = [((0, 0, 0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((M, M, M, M, M, M), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for inp, want in cases:
        assert [int(x) for x in g._philox_torch(*map(t, inp))] == list(want)


@needs_interpreter
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
    ref = g._philox_words_torch(torch.tensor([key, 0], device=DEV), torch.arange(64, device=DEV))
    assert torch.equal(out, torch.stack(ref, -1))


@needs_interpreter
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


@needs_interpreter
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

@needs_interpreter
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
                ker = g._apply_triton(w, None if fused else packed, pow2, seed, "gaussws", out, fused)
                assert torch.equal(ref[0], ker[0]) and torch.equal(ref[1], ker[1]), (m, n, wdtype, out)
            assert torch.equal(g.tile_max(w, impl="triton"), g.tile_max(w, impl="torch"))


@needs_interpreter
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
        rs = g._broadcast_tiles(ta * torch.exp2(1 - bt), m, n) * noise.float().abs()
        assert ((a.float() - b.float()).abs() <= a.float().abs() * 2 ** -7 + rs * 2 ** -23).all()


def test_tile_max_partial_edge_tiles():
    torch.manual_seed(3)
    w = torch.randn(70, 45)
    t = g.tile_max(w, impl="torch")
    assert t.shape == (3, 2)
    for i in range(3):
        for j in range(2):
            assert t[i, j] == w[32 * i:32 * i + 32, 32 * j:32 * j + 32].abs().max()


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_interpreter)])
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
    scale = g._broadcast_tiles(g.tile_max(w) * torch.exp2(1 - bt), m, n)
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
    pqn = (w_hat - w) / g._broadcast_tiles(tmax, m, n)
    off = torch.ones(m, n, dtype=torch.bool)
    off[::32, ::32] = False
    assert torch.equal(pqn[off], r[off].float() * 0.125)
    assert pqn[off].abs().max().item() == 0.25 and (r[off].abs() == 2).any()
    assert pqn.abs().max().item() <= 0.25 + 1e-6     # the tile-max element itself is rounded


# ---------------------------------------------------------------------------------------------
# eq. 4: gradients, forward/backward consistency

@pytest.mark.parametrize("impl,method,fused", [
    ("torch", "gaussws", False), ("torch", "diffq", False),
    pytest.param("triton", "gaussws", False, marks=needs_interpreter),
    pytest.param("triton", "gaussws", True, marks=needs_interpreter),   # fused: GaussWS Triton only
    pytest.param("triton", "diffq", False, marks=needs_interpreter)])
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


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("memory", ["save", "recompute"])
def test_backward_regenerates_identical_r(monkeypatch, impl, memory):
    """Every R generated for one call (forward, backward, recompute) is bit-identical."""
    seen = []
    for name in ("_generate_torch", "_generate_triton"):
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


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_interpreter)])
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


# ---------------------------------------------------------------------------------------------
# module API

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
    def __init__(self, llama=False, checkpointed=False):
        super().__init__()
        self.wte = nn.Embedding(50, 32)
        self.blocks = nn.ModuleList([_Block(llama=llama) for _ in range(2)])
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


def _gpt2_like(checkpointed=False):
    return _Model(checkpointed=checkpointed)


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
    eager = _gpt2_like()
    comp = _gpt2_like()
    comp.load_state_dict(eager.state_dict())
    g.apply_pqt(eager, seed=5)
    g.apply_pqt(comp, seed=5)
    cm = torch.compile(comp)
    x = torch.randn(2, 3, 32)
    for mdl in (eager, cm):
        mdl(x).square().sum().backward()
    _assert_same_grads(eager, comp, rtol=1e-4, atol=1e-5)
    assert comp.blocks[0].attn.qkv.noise_state[1].item() == 1


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
    with pytest.raises(ValueError, match="x has 44 features"):
        g.pqt_linear(torch.randn(2, 44), w, bt, None, 0)
    with pytest.raises(ValueError, match=r"unknown part\(s\) \['attn'\]"):
        g.apply_pqt(_gpt2_like(), parts="qkv,attn")
    with pytest.raises(ValueError, match="no nn.Linear named"):
        g.apply_pqt(_gpt2_like(), parts="gate")
    with pytest.raises(ValueError, match="no nn.Module attribute 'blocks'"):
        g.apply_pqt(nn.Sequential(nn.Linear(3, 3)))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        g.gaussws_sample(w, bt, 0, impl="triton")
