"""
The compiled Triton kernels on a CUDA GPU = the CPU reference (bit for bit where a test says so).
Each test skips without a GPU (or under TRITON_INTERPRET=1) and says why; on a GPU machine:

    TRITON_INTERPRET=0 python3 -m pytest -q tests/test_gpu.py

The chi-square tests fail a correct kernel with probability below 1e-6.
"""
import math
import os

import pytest
import torch

import adam4bit as A
import gaussws as g
from lowbit.pqt.packing import unpack_noise
from lowbit.pqt.tiles import broadcast_tiles, tile_grid

from test_all import chi2_sf, chi2_stat, rounded_normal_probs
from tests.helpers import assert_same_grads, float_bits


# markers of the GPU-only tests, which compare the compiled kernels with the reference on CUDA
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="GPU-only check needs a CUDA GPU: it compares the compiled Triton kernels with the reference "
           "(test_all.py runs the same kernels under the Triton interpreter on CPU)")
needs_compiled = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1",
    reason="GPU-only check needs the compiled kernels: run it with TRITON_INTERPRET=0")


# ---------------------------------------------------------------------------------------------
# adam4bit.py's kernels

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


def _twin_steps(o_c, o_g, cpu, gpu, gen, dtype, steps):
    # `steps` steps of a CPU and a CUDA optimizer on the same gradients (randn * 1e-2, in dtype)
    for _ in range(steps):
        for a, b in zip(cpu, gpu):
            gr = (torch.randn(a.shape, generator=gen) * 1e-2).to(dtype)
            a.grad, b.grad = gr.clone(), gr.cuda()
        o_c.step()
        o_g.step()


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
        _twin_steps(o_c, o_g, cpu, gpu, gen, dtype, 4)
        for a, b in zip(cpu, gpu):
            assert torch.equal(a, b.cpu()), (dtype, kw, tuple(a.shape))
            for k in o_c.state[a].keys() - {"step"}:
                assert torch.equal(o_c.state[a][k], o_g.state[b][k].cpu()), (dtype, kw, tuple(a.shape), k)
    # FP32 parameters with FP32 states: torch's fused AdamW, any shape
    # (paper B's betas: torch's fused CUDA AdamW forms 1 - b2^t in float32, which for b2 = 0.999 is
    # alone 1.3e-5 off at t = 1, so the 1e-5 bound below holds for b2 = 0.95, not torch's default)
    cpu = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((33, 3), (100,), (64, 64))]
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    o_c, o_g = (A.AdamW4bit(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, preset="fp32") for ps in (cpu, gpu))
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


@needs_compiled
@needs_cuda
@pytest.mark.parametrize("preset, dtype, kw", [("zipsr", torch.float32, {}), ("zeeden", torch.float32, {}),
                                               ("torchao", torch.bfloat16, dict(master_weight_bits=24)),
                                               ("zipsr", torch.bfloat16, dict(param_rounding="sr"))],
                         ids=["zipsr", "zeeden", "torchao-bf16-master24", "zipsr-bf16-sr-write"])
def test_gpu_kernel_equals_reference_drawing_its_uniforms(preset, dtype, kw):
    """On CUDA the compiled kernels and the CPU reference drawing the kernels' SR uniforms
    (impl="torch", kernel_uniforms=True) give the same weights and states bit for bit over 3 steps,
    the SR presets too (ZIP-SR's Update-SR v, the LM head's m after 90 %, the BF16 SR write): the
    4-bit tensors and the FP32-state 16-bit ones (adamw_fp32_kernel); FP32-state FP32 tensors take
    torch's fused AdamW on CUDA (1e-5 relative, test_gpu_16bit_params_bit_identical_to_reference)."""
    gen = torch.Generator().manual_seed(41)
    shapes = [(4096,), (33, 384), (1000, 128 * 3), (100,)]
    cpu = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    hp = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, preset=preset, seed=5)
    o_c = A.AdamW4bit(cpu, impl="torch", kernel_uniforms=True, **hp, **kw)
    o_g = A.AdamW4bit(gpu, impl="triton", **hp, **kw)
    for o, ps in ((o_c, cpu), (o_g, gpu)):
        o.mark_lm_head(ps[1])
        o.set_progress(0.95)
    _twin_steps(o_c, o_g, cpu, gpu, gen, dtype, 3)
    for a, b in zip(cpu, gpu):
        if dtype == torch.float32 and not o_c.is_quantized(a):   # torch's fused AdamW on CUDA: see above
            assert torch.allclose(a, b.cpu(), rtol=1e-5, atol=1e-7)
            continue
        assert torch.equal(a, b.cpu()), (preset, tuple(a.shape))
        for k in o_c.state[a].keys() - {"step"}:
            assert torch.equal(o_c.state[a][k], o_g.state[b][k].cpu()), (preset, tuple(a.shape), k)


@needs_compiled
@needs_cuda
@pytest.mark.parametrize("preset, dtype, kw", [("zipsr", torch.float32, {}),
                                               ("zeeden", torch.bfloat16, dict(master_weight_bits=24)),
                                               ("zipsr", torch.bfloat16, dict(param_rounding="sr"))],
                         ids=["zipsr", "zeeden-bf16-master24", "zipsr-bf16-sr-write"])
def test_gpu_step_param_and_step_in_backward_equal_the_ordinary_step(preset, dtype, kw):
    """On CUDA step_param (one kernel launch per tensor, kept per parameter) gives step()'s weights
    and states bit for bit, 4-bit and FP32-state tensors and the LM head's SR switch alike; a
    model trained with lowbit.step_in_backward ends where the ordinary step does."""
    from lowbit import step_in_backward
    from model import GPT, GPTConfig
    gen = torch.Generator().manual_seed(42)
    shapes = [(4096,), (33, 384), (100,), (64, 64)]
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype).cuda()) for s in shapes]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    o, o2 = (A.AdamW4bit(x, lr=1e-2, preset=preset, seed=3, **kw) for x in (ps, qs))
    for opt, x in ((o, ps), (o2, qs)):
        opt.mark_lm_head(x[1])
    for progress in (0.5, 0.95, 0.97):
        for a, b in zip(ps, qs):
            a.grad = (torch.randn(a.shape, generator=gen) * 1e-2).to(dtype).cuda()
            b.grad = a.grad.clone()
        o.set_progress(progress)
        o2.set_progress(progress)
        o.step()
        for b in reversed(qs):
            o2.step_param(b)
    for a, b in zip(ps, qs):
        assert torch.equal(a, b)
        assert all(torch.equal(o.state[a][k], o2.state[b][k]) for k in o.state[a])
    runs = []
    for in_backward in (False, True):
        torch.manual_seed(0)
        m = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=128, vocab_size=256, block_size=64)).cuda().to(dtype)
        opt = A.AdamW4bit(m.parameters(), lr=1e-3, preset=preset, seed=3, **kw)
        handles = step_in_backward(opt) if in_backward else ()
        gen = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(3):
            x = torch.randint(0, 256, (4, 64), device="cuda", generator=gen)
            m(x, x)[1].backward()
            if not in_backward:
                opt.step()
                opt.zero_grad(set_to_none=True)
        for h in handles:
            h.remove()
        runs.append(list(m.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


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
        assert opts[1]._plan.recorded["graph"] is not None
        assert float(opts[2].state[ps[2][0]]["step"]) == 6


# ---------------------------------------------------------------------------------------------
# gaussws.py's kernels

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
    bt = 3 + 5 * torch.rand(tile_grid(m, n), device=dev)
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
    rs = broadcast_tiles(tr * pow2, m, n) * qr.float().abs()
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
    r = unpack_noise(g.generate_triton(m, n, seed, "gaussws"), n)
    x = chi2_stat(r, g.NOISE_PROBS)
    assert chi2_sf(x, 4) > 1e-6, x
    assert chi2_sf(chi2_stat(r, rounded_normal_probs()), 4) < 1e-12
    rb = unpack_noise(g.generate_triton(m, n, seed, "bm"), n).clamp(-3, 3)
    phi = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))
    probs = {k: phi(2 * k + 1) - phi(2 * k - 1) for k in range(-2, 3)}
    probs[-3], probs[3] = phi(-5), 1 - phi(5)
    xb = chi2_stat(rb, probs)
    assert chi2_sf(xb, 6) > 1e-6, xb


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
    tiles = tile_grid(m, n)
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
            assert torch.equal(float_bits(x), float_bits(y)), bits        # eager = compiled
        w_hat, tmax, own, db = outs[0]
        assert torch.equal(float_bits(own), float_bits(live)), bits     # torch's b_t, clamp and exp2
        ref = g._apply_torch(w, g._generate_torch(m, n, seed, "gaussws"), pow2, "gaussws", BF16)
        assert torch.equal(w_hat, ref[0]) and torch.equal(tmax, ref[1]), bits
        dpow2 = g._grad_torch(gg, g._generate_torch(m, n, seed, "gaussws"), ref[1], "gaussws", torch.float32)[1]
        leaf = b.clone().requires_grad_()
        g._pow2(leaf if bits[0] == 0 else g._bitwidth(leaf, bits[0] + bits[1], bits[0])).backward(dpow2)
        torch.testing.assert_close(db, leaf.grad, rtol=1e-5, atol=1e-7)   # sum order: kernel vs torch


@needs_compiled
@needs_cuda
def test_gpu_public_calls_make_no_host_sync():
    """gaussws_sample, generate_noise, apply_noise (int seeds, new and repeated) and a
    GaussWSLinear forward + backward under torch.cuda.set_sync_debug_mode("error"): no blocking
    host-device transfer; the cached int seed gives the tensor seed's bits."""
    dev = "cuda"
    torch.manual_seed(32)
    w = torch.randn(96, 64, device=dev, requires_grad=True)
    bt = (3 + 5 * torch.rand(tile_grid(96, 64), device=dev)).requires_grad_()
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
        assert_same_grads(eager, layer, rtol=1e-4, atol=1e-5)
        assert layer.noise_state[1].item() == k + 1
        losses.append(loss.item())
    assert len(set(losses)) == len(losses)        # a new w_hat at every step
