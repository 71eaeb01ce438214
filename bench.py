"""
Benchmarks on one GPU. Every figure is a median of triton.testing.do_bench (CUDA events,
launch overhead included) measured in the same run as its baselines, reported as ratios.

    python bench.py                 # everything
    python bench.py --only optim    # 4-bit AdamW step (paper B) vs torch AdamW, bandwidth floor
    python bench.py --only noise    # GaussWS noise kernels (paper A, Figure 6)

Results are printed as a table and written to results/<gpu>_<date>_<section>.json.
"""
import argparse
import datetime
import json
import math
import os

import torch
import triton

import adam4bit as A
import gaussws as g


def median_ms(fn, warmup=25, rep=100):
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def copy_bandwidth(nbytes=4 << 30):
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x))
    del x, y
    return 2 * nbytes / (ms * 1e-3)


def gpt2_shapes():
    """The 75 parameter tensors of nanoGPT's GPT-2 124M (bias=False, tied LM head)."""
    d, L = 768, 12
    shapes = [(50304, d), (1024, d)]
    for _ in range(L):
        shapes += [(d,), (3 * d, d), (d, d), (d,), (4 * d, d), (d, 4 * d)]
    return shapes + [(d,)]


def _make(shapes, grad_dtype=torch.float32, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g) * 0.02) for s in shapes]
    for p in ps:
        p.grad_dtype = None
        p.grad = (torch.randn(p.shape, device="cuda", generator=g) * 1e-3).to(grad_dtype)
    return ps


def _optimizers():
    """name -> constructor(params). Optional third-party baselines only when importable."""
    hp = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opts = {
        "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, fused=True, **hp),
        "torch AdamW foreach": lambda ps: torch.optim.AdamW(ps, foreach=True, **hp),
        "ours zipsr": lambda ps: A.AdamW4bit(ps, preset="zipsr", **hp),
        "ours zeeden": lambda ps: A.AdamW4bit(ps, preset="zeeden", **hp),
        "ours torchao-preset": lambda ps: A.AdamW4bit(ps, preset="torchao", **hp),
        "ours fp32-preset": lambda ps: A.AdamW4bit(ps, preset="fp32", **hp),
        "ours zipsr impl=torch (reference)": lambda ps: A.AdamW4bit(ps, preset="zipsr", impl="torch", **hp),
    }
    try:
        from torchao.optim import AdamW4bit as AO4
        opts["TorchAO AdamW4bit"] = lambda ps: AO4(ps, **hp)
    except Exception as e:  # optional
        print(f"(TorchAO not importable: {type(e).__name__}; row skipped)")
    try:
        import bitsandbytes as bnb
        opts["bitsandbytes AdamW8bit"] = lambda ps: bnb.optim.AdamW8bit(ps, **hp)
    except Exception as e:  # optional
        print(f"(bitsandbytes not importable: {type(e).__name__}; row skipped)")
    return opts


def bench_optim(quick=False):
    """Optimizer step time on GPT-2-124M shapes and on one flat 1B tensor (paper B storage)."""
    bw = copy_bandwidth()
    rows = []
    cases = [("gpt2-124m (75 tensors)", gpt2_shapes(), torch.float32),
             ("gpt2-124m, bf16 grads", gpt2_shapes(), torch.bfloat16),
             ("flat 1B", [(1 << 30,)], torch.float32)]
    for case, shapes, gdt in cases:
        n = sum(math.prod(s) for s in shapes)
        base = None
        for name, make in _optimizers().items():
            if "reference" in name and (quick or n > 2e8):
                continue
            if gdt == torch.bfloat16 and not name.startswith("ours z"):
                continue
            ps = _make(shapes, gdt)
            try:
                opt = make(ps)
                opt.step()
                torch.cuda.synchronize()
                ms = median_ms(opt.step, warmup=5 if "reference" in name else 25,
                               rep=20 if "reference" in name else 100)
            except Exception as e:
                print(f"  {case} {name}: failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            state = sum(t.numel() * t.element_size() for st in opt.state.values()
                        for k, t in st.items() if torch.is_tensor(t) and t.dim() > 0)
            if name == "torch AdamW fused":
                base = ms
            # bytes moved: param r+w (8), grad read, state r+w
            moved = n * (8 + (2 if gdt == torch.bfloat16 else 4)) + 2 * state
            rows.append(dict(case=case, optimizer=name, ms=ms, state_bytes_per_param=state / n,
                             vs_fused=(base / ms) if base else None,
                             floor_ms=moved / bw * 1e3, pct_of_floor=moved / bw * 1e3 / ms * 100))
            del opt, ps
            torch.cuda.empty_cache()
    print(f"\ncopy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    print(f"{'case':24s} {'optimizer':36s} {'ms':>8s} {'B/param':>8s} {'fused/x':>8s} {'floor ms':>9s} {'%floor':>7s}")
    for r in rows:
        vs = f"{r['vs_fused']:.2f}x" if r["vs_fused"] else "-"
        print(f"{r['case']:24s} {r['optimizer']:36s} {r['ms']:8.3f} {r['state_bytes_per_param']:8.4f} "
              f"{vs:>8s} {r['floor_ms']:9.3f} {r['pct_of_floor']:6.1f}%")
    return dict(copy_bandwidth_TBps=bw / 1e12, rows=rows)


def check_optim_gpu():
    """GPU correctness of the fused step: RTN presets bit-identical to the CPU reference over
    several steps (random shapes, fp32/bf16 grads), SR given the same bits, GPU->CPU state load."""
    out = {}
    g = torch.Generator().manual_seed(0)
    shapes = [(4096,), (33, 384), (1000, 128 * 3), (77, 1024), (100,)]
    for kw in (dict(preset="torchao"), dict(preset="zeeden"),
               dict(preset="zipsr", v_rounding="update-rtn")):
        cpu = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
        gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
        o_c = A.AdamW4bit(cpu, impl="torch", lr=1e-2, **kw)
        o_g = A.AdamW4bit(gpu, impl="triton", lr=1e-2, **kw)
        for step in range(8):
            for a, b in zip(cpu, gpu):
                a.grad_dtype = b.grad_dtype = None
                gr = torch.randn(a.shape, generator=g) * 10 ** (-1 - 3 * torch.rand(1, generator=g).item())
                if step % 2:
                    gr = gr.bfloat16()
                a.grad, b.grad = gr.clone(), gr.cuda()
            o_c.step()
            o_g.step()
        same_p = all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu) if o_c.is_quantized(a))
        diff = max((a - b.cpu()).abs().max().item() for a, b in zip(cpu, gpu))
        same_s = all(torch.equal(o_c.state[a][k], o_g.state[b][k].cpu())
                     for a, b in zip(cpu, gpu) if o_c.is_quantized(a) for k in o_c.state[a])
        out[kw.get("v_rounding", kw["preset"])] = dict(params_bit_identical=same_p,
                                                       states_bit_identical=same_s, max_abs_diff=diff)
    sd = o_g.state_dict()
    o_c2 = A.AdamW4bit(cpu, impl="torch", lr=1e-2, preset="zipsr", v_rounding="update-rtn")
    o_c2.load_state_dict(sd)
    out["gpu_to_cpu_load_exact"] = all(torch.equal(o_c2.state[a][k], o_g.state[b][k].cpu())
                                       for a, b in zip(cpu, gpu) for k in o_g.state[b])
    print("GPU correctness:", json.dumps(out, indent=1))
    return out


# ---------------------------------------------------------------------------------------------
# noise: GaussWS kernels (paper A, Sec. 3.5, Figure 6)

SHAPES = [(768, 768), (3072, 768), (4096, 4096), (8192, 8192), (16384, 16384)]
BF16 = torch.bfloat16


def _time(fn, graph=False):
    """Median ms; graph=True replays a CUDA graph (GPU time only, no launch overhead)."""
    try:
        if graph:
            return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    except Exception as e:  # keep the rest of the table
        print(f"  timing failed: {type(e).__name__}: {str(e)[:200]}")
        return float("nan")


def torch_eq3(w, b_t):
    """Plain PyTorch eq. 3 with R = round(N(0,1)/2) (the paper's "torch" baseline)."""
    m, n = w.shape
    tm, tn = m // 32, n // 32
    wv = w.view(tm, 32, tn, 32)
    tmax = wv.abs().amax(dim=(1, 3), keepdim=True)
    scale = tmax * torch.exp2(1.0 - b_t).view(tm, 1, tn, 1)
    r = torch.round(torch.randn_like(wv) * 0.5)
    return (wv + r * scale).view(m, n).to(BF16)



def chi2_sf(x, dof):
    """Survival function of the chi-square law for even dof (closed form)."""
    assert dof % 2 == 0
    h = x / 2
    return math.exp(-h) * sum(h ** i / math.factorial(i) for i in range(dof // 2))


def chi2(counts, probs):
    n = counts.sum().item()
    exp = torch.tensor(probs, dtype=torch.float64) * n
    return (((counts.double().cpu() - exp) ** 2) / exp).sum().item()


def check_noise_gpu():
    """GaussWS kernels on the GPU: packed R, w_hat, tile max, grads == reference; chi-square."""
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



def _noise_inputs(m, n):
    w = torch.randn(m, n, device="cuda")
    bt = 3 + 5 * torch.rand(g.tile_grid(m, n), device="cuda")
    return w, bt, torch.exp2(1 - bt), torch.tensor([12345, 6], device="cuda")


def bench_noise():
    """Paper A Figure 6: eq. 3 forward (generate + apply) at several shapes, vs torch and bm."""
    bw = copy_bandwidth()
    fused_cfg = (g.CONFIG["fused_bt"], g.CONFIG["fused_warps"])
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
        w, bt, pow2, seed = _noise_inputs(m, n)
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
        r = dict(shape=f"{m}x{n}", eager=_time(lambda: torch_eq3(w, bt)), compiled=_time(lambda: comp(w, bt)),
                 bm=_time(bm), ours=_time(ours), fused=_time(fused), diffq=_time(dq),
                 floor=m * n * 7 / bw * 1e3, ours_g=_time(ours, True), fused_g=_time(fused, True),
                 comp_g=_time(lambda: comp(w, bt), True), bwd=_time(bwd), bwd_f=_time(bwdf),
                 gen=_time(lambda: g._generate_triton(m, n, seed, "gaussws")), bm_g=_time(bm, True),
                 apply=_time(lambda: g._apply_triton(w, packed, pow2, seed, "gaussws", BF16, False)))
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


def save(section, result):
    os.makedirs("results", exist_ok=True)
    gpu = torch.cuda.get_device_name().replace(" ", "-")
    date = datetime.date.today().isoformat()
    path = f"results/{gpu}_{date}_{section}.json"
    with open(path, "w") as f:
        json.dump(dict(gpu=gpu, date=date, torch=torch.__version__, triton=triton.__version__,
                       command=f"python bench.py --only {section}", **result), f, indent=1)
    print("wrote", path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["optim", "noise"], default=None,
                    help="run one section (default: all)")
    ap.add_argument("--quick", action="store_true", help="skip the slow reference rows")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.py needs a CUDA GPU (the tests cover correctness on CPU)")
    if args.only in (None, "optim"):
        res = dict(check=check_optim_gpu(), **bench_optim(args.quick))
        save("optim", res)
    if args.only in (None, "noise"):
        check_noise_gpu()
        save("noise", dict(rows=bench_noise()))


if __name__ == "__main__":
    main()
