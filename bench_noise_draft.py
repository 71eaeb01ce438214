"""
Draft of `bench.py --only noise` (the lead merges it): GaussWS noise kernels on the GPU.

One run does, in order:
  1. correctness on the GPU: packed R from the kernel == PyTorch reference (bit for bit), w_hat
     and tile maxima == reference math given the same R (bit for bit, 3-step and fused), grad
     kernel vs reference, DiffQ within 1 BF16 ulp, chi-square of 67M GPU draws (eq. 10; bm vs
     round(N(0,1)/2));
  2. a small GPT-like model with GaussWSLinear under torch.compile + BF16 autocast, forward +
     backward, both memory modes, compared with eager;
  3. launch-config sweep of the kernels at 8192² (table);
  4. the throughput table at 768², 3072×768, 4096², 8192², 16384²: eager torch eq. 3, the same
     function under torch.compile, Box–Muller ("bm", Triton), ours (generate + apply, 3 kernels of
     §3.5 minus the matmul), ours fused, DiffQ, and the bandwidth floor = numel · (4 B FP32 read +
     2 B BF16 write + 0.5 B packed R write + 0.5 B read) / copy bandwidth measured here with a
     large device-to-device copy (bytes read + written).
Times are medians of triton.testing.do_bench (launch overhead included, what a training step
sees) and, in the *_g columns, of do_bench_cudagraph (GPU time only).

Run: PYTHONUNBUFFERED=1 python bench_noise_draft.py [--skip-check] [--skip-compile] [--skip-sweep]
"""
import argparse
import copy
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton

import gaussws as g

SHAPES = [(768, 768), (3072, 768), (4096, 4096), (8192, 8192), (16384, 16384)]
BF16 = torch.bfloat16


def chi2_sf(x, dof):
    """Survival function of the chi-square law for even dof (closed form)."""
    assert dof % 2 == 0
    h = x / 2
    return math.exp(-h) * sum(h ** i / math.factorial(i) for i in range(dof // 2))


def chi2(counts, probs):
    n = counts.sum().item()
    exp = torch.tensor(probs, dtype=torch.float64) * n
    return (((counts.double().cpu() - exp) ** 2) / exp).sum().item()


def torch_eq3(w, b_t):
    """Plain PyTorch eq. 3 with R = round(N(0,1)/2) (the paper's "torch" baseline)."""
    m, n = w.shape
    tm, tn = m // 32, n // 32
    wv = w.view(tm, 32, tn, 32)
    tmax = wv.abs().amax(dim=(1, 3), keepdim=True)
    scale = tmax * torch.exp2(1.0 - b_t).view(tm, 1, tn, 1)
    r = torch.round(torch.randn_like(wv) * 0.5)
    return (wv + r * scale).view(m, n).to(BF16)


def bench(fn, graph=False):
    try:
        if graph:
            return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    except Exception as e:  # keep the rest of the table
        print(f"  bench failed: {type(e).__name__}: {str(e)[:200]}")
        return float("nan")


def section(fn, *a):
    try:
        return fn(*a)
    except Exception:
        import traceback
        traceback.print_exc()
        print(f"!! section {fn.__name__} FAILED")


# ----------------------------------------------------------------------------------------------
def check_gpu():
    dev = "cuda"
    seed = torch.tensor([0x1234_5678_9ABC, 17], device=dev)
    for m, n in [(70, 45), (1, 1), (33, 100), (3072, 768), (4096, 4096)]:
        ref = g._generate_torch(m, n, seed, "gaussws")
        ker = g._generate_triton(m, n, seed, "gaussws")
        assert torch.equal(ref, ker), f"packed R differs at {m}x{n}"
        w = torch.randn(m, n, device=dev)
        bt = 3 + 5 * torch.rand(g.tile_grid(m, n), device=dev)
        pow2 = torch.exp2(1 - bt)
        wr, tr = g._apply_torch(w, ref, pow2, "gaussws", BF16)
        wk, tk = g._apply_triton(w, ker, pow2, seed, "gaussws", BF16, False)
        wf, tf = g._apply_triton(w, None, pow2, seed, "gaussws", BF16, True)
        assert torch.equal(wr, wk) and torch.equal(tr, tk), f"apply differs at {m}x{n}"
        assert torch.equal(wr, wf) and torch.equal(tr, tf), f"fused apply differs at {m}x{n}"
        gg = torch.randn(m, n, device=dev).to(BF16)
        dwr, dpr = g._grad_torch(gg, ref, tr, "gaussws", torch.float32)
        dwk, dpk = g._grad_triton(gg, ker, tr, seed, "gaussws", torch.float32, False)
        dwf, dpf = g._grad_triton(gg, None, tr, seed, "gaussws", torch.float32, True)
        bound = 1e-5 * (tr * 1024).max().item() + 1e-6
        assert torch.equal(dwr, dwk) and torch.equal(dwr, dwf)
        assert (dpr - dpk).abs().max().item() <= bound and (dpr - dpf).abs().max().item() <= bound
        qr = g._generate_torch(m, n, seed, "diffq")
        qk = g._generate_triton(m, n, seed, "diffq")
        assert torch.equal(qr, qk), "diffq noise differs"
        a, _ = g._apply_torch(w, qr, pow2, "diffq", BF16)
        b, _ = g._apply_triton(w, qk, pow2, seed, "diffq", BF16, False)
        # the GPU may fuse w + R·s into one FMA: differences of one fp32 rounding of R·s plus one
        # BF16 rounding of the result are allowed
        rs = g._broadcast_tiles(tr * pow2, m, n) * qr.float().abs()
        bound = a.float().abs() * 2.0 ** -7 + rs * 2.0 ** -23
        assert ((a.float() - b.float()).abs() <= bound).all(), "diffq apply off by more than the FMA bound"
        print(f"  {m}x{n}: diffq kernel == reference for {(a == b).float().mean().item():.4%} of elements")
    print("GPU bit-exactness: packed R, w_hat, tile max (3-step and fused) == reference; grads ok; diffq ok")

    m = n = 8192
    r = g.unpack_noise(g._generate_triton(m, n, seed, "gaussws"), n)
    counts = torch.bincount((r.flatten() + 2).long(), minlength=5)
    probs = [g.NOISE_PROBS[k] for k in range(-2, 3)]
    x = chi2(counts, probs)
    print(f"chi-square eq.10, {m * n} GPU draws: {x:.2f} (dof 4, p = {chi2_sf(x, 4):.3g}); "
          f"freqs {[round(c / (m * n), 6) for c in counts.tolist()]} vs {[round(p, 6) for p in probs]}")
    rb = g.unpack_noise(g._generate_triton(m, n, seed, "bm"), n).flatten().clamp(-3, 3)
    cb = torch.bincount((rb + 3).long(), minlength=7)
    phi = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))
    pb = [phi(-5)] + [phi(2 * k + 1) - phi(2 * k - 1) for k in range(-2, 3)] + [1 - phi(5)]
    xb = chi2(cb, pb)
    print(f"chi-square bm vs round(N/2), {m * n} draws: {xb:.2f} (dof 6, p = {chi2_sf(xb, 6):.3g})")


# ----------------------------------------------------------------------------------------------
class Attn(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, C // self.h).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attn(d, h)
        self.mlp = nn.Module()
        self.mlp.up, self.mlp.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp.down(F.gelu(self.mlp.up(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, V=1024, d=256, h=4, L=4):
        super().__init__()
        self.wte = nn.Embedding(V, d)
        self.blocks = nn.ModuleList([Block(d, h) for _ in range(L)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, V, bias=False)

    def forward(self, idx, tgt):
        x = self.wte(idx)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.lm_head(self.ln_f(x)).float().view(-1, 1024), tgt.view(-1))


def check_compile():
    for memory, fused in [("save", False), ("recompute", True)]:
        torch.manual_seed(0)
        eager = TinyGPT().cuda()
        names = g.apply_pqt(eager, parts="all", memory=memory, seed=1, fused=fused)
        model = copy.deepcopy(eager)
        cmodel = torch.compile(model)
        idx = torch.randint(0, 1024, (8, 128), device="cuda")
        tgt = torch.randint(0, 1024, (8, 128), device="cuda")
        t0 = time.time()
        for step in range(3):
            for mm in (eager, cmodel):
                mm.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=BF16):
                    loss = mm(idx, tgt)
                loss.backward()
                if mm is eager:
                    le = loss.item()
            lc = loss.item()
            ge = torch.cat([p.grad.flatten().float() for n, p in eager.named_parameters() if n.endswith("b_i")])
            gc = torch.cat([p.grad.flatten().float() for n, p in model.named_parameters() if n.endswith("b_i")])
            rel = ((ge - gc).norm() / ge.norm()).item()
            assert math.isfinite(lc) and abs(lc - le) < 1e-2 * abs(le), (lc, le)
            assert rel < 5e-2, rel
        st = model.blocks[0].attn.qkv.noise_state.tolist()
        print(f"compile+autocast {memory:9s} fused={fused}: {len(names)} layers, losses eager {le:.5f} "
              f"compiled {lc:.5f}, b_i grad rel diff {rel:.2e}, noise_state {st}, {time.time() - t0:.1f}s")


# ----------------------------------------------------------------------------------------------
def copy_bandwidth():
    x = torch.empty(2 ** 29, dtype=torch.float32, device="cuda")   # 2 GiB
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    del x, y
    return 2 * 2 ** 29 * 4 / (ms * 1e-3)   # bytes read + written per second


def make(m, n):
    w = torch.randn(m, n, device="cuda")
    bt = 3 + 5 * torch.rand(g.tile_grid(m, n), device="cuda")
    return w, bt, torch.exp2(1 - bt), torch.tensor([12345, 6], device="cuda")


def sweep():
    m = n = 8192
    w, bt, pow2, seed = make(m, n)
    rows = []
    for block in (512, 1024, 2048):
        for nw in (4, 8):
            rows.append(("gen", f"BLOCK={block} warps={nw}",
                         bench(lambda: g._generate_triton(m, n, seed, "gaussws", block, nw))))
    packed = g._generate_triton(m, n, seed, "gaussws")
    for bt_ in (1, 2, 4, 8):
        for nw in (4, 8):
            rows.append(("apply", f"BT={bt_} warps={nw}",
                         bench(lambda: g._apply_triton(w, packed, pow2, seed, "gaussws", BF16, False, bt_, nw))))
    for bt_ in (1, 2, 4):
        for nw in (4, 8):
            rows.append(("fused", f"BT={bt_} warps={nw}",
                         bench(lambda: g._apply_triton(w, None, pow2, seed, "gaussws", BF16, True, bt_, nw))))
    gg = torch.randn(m, n, device="cuda").to(BF16)
    tmax = g.tile_max(w)
    for bt_ in (2, 4):
        for nw in (4, 8):
            rows.append(("grad", f"BT={bt_} warps={nw}",
                         bench(lambda: g._grad_triton(gg, packed, tmax, seed, "gaussws", torch.float32, False, bt_, nw))))
            rows.append(("grad_fused", f"BT={bt_} warps={nw}",
                         bench(lambda: g._grad_triton(gg, None, tmax, seed, "gaussws", torch.float32, True, bt_, nw))))
    print("\nlaunch-config sweep at 8192x8192 (median ms):")
    best = {}
    for kind, cfg, ms in rows:
        print(f"  {kind:10s} {cfg:22s} {ms * 1e3:8.1f} us")
        if kind not in best or ms < best[kind][1]:
            best[kind] = (cfg, ms)
    print("best:", {k: (c, round(v * 1e3, 1)) for k, (c, v) in best.items()})
    parse = lambda s: {kv.split("=")[0]: int(kv.split("=")[1]) for kv in s.split()}
    gb, ab, fb, rb = (parse(best[k][0]) for k in ("gen", "apply", "fused", "grad"))
    cfg = dict(gen_block=gb["BLOCK"], gen_warps=gb["warps"], apply_bt=ab["BT"], apply_warps=ab["warps"],
               grad_bt=rb["BT"], grad_warps=rb["warps"])
    return cfg, (fb["BT"], fb["warps"])


def table(bw, fused_cfg):
    print(f"\ncopy bandwidth (read+write): {bw / 1e12:.3f} TB/s; floor = numel * 7 B / that")
    hdr = (f"{'shape':>12s} {'eager':>8s} {'compiled':>8s} {'bm':>8s} {'ours':>8s} {'fused':>8s} {'diffq':>8s} "
           f"{'floor':>8s} {'ours_g':>8s} {'fused_g':>8s} {'comp_g':>8s} {'bwd':>8s} {'bwd_f':>8s} "
           f"{'gen':>8s} {'apply':>8s} {'bm_g':>8s} {'eag/ours':>8s} {'eag/fused':>9s} {'comp/ours':>9s} {'comp/fus':>8s} {'floor%':>6s} {'floor%f':>7s}")
    print("times in microseconds (median); *_g = CUDA-graph replay (GPU time only)")
    print(hdr)
    out = []
    comp = torch.compile(torch_eq3, dynamic=False)
    fbt, fnw = fused_cfg
    for m, n in SHAPES:
        w, bt, pow2, seed = make(m, n)
        gg = torch.randn(m, n, device="cuda").to(BF16)
        tmax = g.tile_max(w)
        ours = lambda: g._apply_triton(w, g._generate_triton(m, n, seed, "gaussws"), pow2, seed, "gaussws", BF16, False)
        fused = lambda: g._apply_triton(w, None, pow2, seed, "gaussws", BF16, True, fbt, fnw)
        bm = lambda: g._apply_triton(w, g._generate_triton(m, n, seed, "bm"), pow2, seed, "gaussws", BF16, False)
        dq = lambda: g._apply_triton(w, g._generate_triton(m, n, seed, "diffq"), pow2, seed, "diffq", BF16, False)
        bwd = lambda: g._grad_triton(gg, g._generate_triton(m, n, seed, "gaussws"), tmax, seed, "gaussws", torch.float32, False)
        bwdf = lambda: g._grad_triton(gg, None, tmax, seed, "gaussws", torch.float32, True, fbt, fnw)
        packed = g._generate_triton(m, n, seed, "gaussws")
        comp(w, bt)  # compile outside the timing
        r = dict(shape=f"{m}x{n}", eager=bench(lambda: torch_eq3(w, bt)), compiled=bench(lambda: comp(w, bt)),
                 bm=bench(bm), ours=bench(ours), fused=bench(fused), diffq=bench(dq),
                 floor=m * n * 7 / bw * 1e3, ours_g=bench(ours, True), fused_g=bench(fused, True),
                 comp_g=bench(lambda: comp(w, bt), True), bwd=bench(bwd), bwd_f=bench(bwdf),
                 gen=bench(lambda: g._generate_triton(m, n, seed, "gaussws")), bm_g=bench(bm, True),
                 apply=bench(lambda: g._apply_triton(w, packed, pow2, seed, "gaussws", BF16, False)))
        out.append(r)
        us = lambda k: f"{r[k] * 1e3:8.1f}"
        print(f"{r['shape']:>12s} " + " ".join(us(k) for k in ("eager", "compiled", "bm", "ours", "fused", "diffq", "floor",
                                                             "ours_g", "fused_g", "comp_g", "bwd", "bwd_f", "gen", "apply", "bm_g"))
              + f" {r['eager'] / r['ours']:8.2f} {r['eager'] / r['fused']:9.2f} {r['compiled'] / r['ours']:9.2f}"
              + f" {r['compiled'] / r['fused']:8.2f} {100 * r['floor'] / r['ours']:6.1f}"
              + f" {100 * r['floor'] / r['fused']:7.1f}")
        del w, gg
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--skip-sweep", action="store_true")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    t0 = time.time()
    if not args.skip_check:
        section(check_gpu)
        print(f"[{time.time() - t0:.0f}s]")
    if not args.skip_compile:
        section(check_compile)
        print(f"[{time.time() - t0:.0f}s]")
    fused_cfg = (g.CONFIG["fused_bt"], g.CONFIG["fused_warps"])
    if not args.skip_sweep:
        res = section(sweep)
        if res:
            cfg, fused_cfg = res
            g.CONFIG.update(cfg, fused_bt=fused_cfg[0], fused_warps=fused_cfg[1])
        print("using CONFIG", g.CONFIG, "fused", fused_cfg, f"[{time.time() - t0:.0f}s]")
    rows = table(copy_bandwidth(), fused_cfg)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_noise.json"), "w") as f:
            json.dump(dict(config=g.CONFIG, fused=fused_cfg, rows=rows), f, indent=1)
    print(f"[{time.time() - t0:.0f}s total]")


if __name__ == "__main__":
    main()
