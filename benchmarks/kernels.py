"""Speed of the kernels alone: the 4-bit AdamW step (paper B) and the GaussWS noise (paper A);
each section a function that prints its table and returns it (bench.py writes the JSON).
"""
import math
import os
import statistics
import time

import torch

import adam4bit as A
import gaussws as g
from lowbit.optim import fp32 as F
from lowbit.pqt.tiles import tile_grid

from benchmarks.util import copy_bandwidth, host_ms, median_ms, power_during


# ---------------------------------------------------------------------------------------------
# optim: the 4-bit AdamW step (paper B) against torch's AdamW and the copy-bandwidth floor

def gpt2_shapes():
    """The 75 parameter tensors of nanoGPT's GPT-2 124M (bias=False, tied LM head)."""
    d, L = 768, 12
    shapes = [(50304, d), (1024, d)]
    for _ in range(L):
        shapes += [(d,), (3 * d, d), (d, d), (d,), (4 * d, d), (d, 4 * d)]
    return shapes + [(d,)]


def _make(shapes, grad_dtype=torch.float32, seed=0, param_dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ps = [torch.nn.Parameter((torch.randn(s, device="cuda", generator=g) * 0.02).to(param_dtype)) for s in shapes]
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
        "ours zipsr, capturable=True (a CUDA graph)": lambda ps: A.AdamW4bit(ps, preset="zipsr", capturable=True, **hp),
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


def _bf16_param_optimizers():
    """name -> constructor(params) for BF16 parameters (no FP32 master copy): torch's fused AdamW
    (BF16 states), ours with each write of the new weight, FlashOptim's FlashAdamW when importable
    (int8 moments; master_weight_bits=24: its 8-bit weight correction, None: without)."""
    hp = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opts = {
        "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, fused=True, **hp),
        "ours zipsr (RTN write)": lambda ps: A.AdamW4bit(ps, preset="zipsr", **hp),
        "ours zipsr (RTN write), capturable=True": lambda ps: A.AdamW4bit(ps, preset="zipsr", capturable=True, **hp),
        "ours zipsr, param_rounding=sr": lambda ps: A.AdamW4bit(ps, preset="zipsr", param_rounding="sr", **hp),
        "ours zipsr, master_weight_bits=24": lambda ps: A.AdamW4bit(ps, preset="zipsr", master_weight_bits=24, **hp),
    }
    try:
        from flashoptim import FlashAdamW
        opts["FlashOptim FlashAdamW (24-bit master)"] = lambda ps: FlashAdamW(ps, **hp)
        opts["FlashOptim FlashAdamW, master_weight_bits=None"] = lambda ps: FlashAdamW(ps, master_weight_bits=None, **hp)
    except Exception as e:  # optional
        print(f"(FlashOptim not importable: {type(e).__name__}: {str(e)[:120]}; rows skipped)")
    return opts


def bench_optim(quick=False):
    """Optimizer step time on GPT-2-124M shapes and on one flat 1B tensor (paper B storage)."""
    from trainer.memory import optimizer_state_bytes
    bw = copy_bandwidth()
    rows = []
    f32, bf16 = torch.float32, torch.bfloat16
    cases = [("gpt2-124m (75 tensors)", gpt2_shapes(), f32, f32),
             ("gpt2-124m, bf16 grads", gpt2_shapes(), bf16, f32),
             ("gpt2-124m, bf16 params", gpt2_shapes(), bf16, bf16),
             ("flat 1B", [(1 << 30,)], f32, f32),
             ("flat 1B, bf16 params", [(1 << 30,)], bf16, bf16)]
    for case, shapes, gdt, pdt in cases:
        n = sum(math.prod(s) for s in shapes)
        base = None
        for name, make in (_bf16_param_optimizers() if pdt == bf16 else _optimizers()).items():
            if "reference" in name and (quick or n > 2e8):
                continue
            if gdt == torch.bfloat16 and pdt == f32 and not name.startswith("ours z"):
                continue
            ps = _make(shapes, gdt, param_dtype=pdt)
            try:
                opt = make(ps)
                opt.step()
                torch.cuda.synchronize()
                ms = median_ms(opt.step, warmup=5 if "reference" in name else 25,
                               rep=20 if "reference" in name else 100)
                pw = power_during(opt.step) if n > 2e8 else None   # a long case: enough samples
                host = host_ms(opt.step) if n < 2e8 else None
            except Exception as e:
                print(f"  {case} {name}: failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            state = optimizer_state_bytes(opt)
            if name == "torch AdamW fused":
                base = ms
            # bytes moved: param r+w, grad read, state r+w
            moved = n * (2 * pdt.itemsize + gdt.itemsize) + 2 * state
            rows.append(dict(case=case, optimizer=name, ms=ms, state_bytes_per_param=state / n,
                             vs_fused=(base / ms) if base else None,
                             floor_ms=moved / bw * 1e3, pct_of_floor=moved / bw * 1e3 / ms * 100,
                             host_ms=host, **(pw or {})))
            del opt, ps
            torch.cuda.empty_cache()
    print(f"\ncopy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    print(f"{'case':24s} {'optimizer':46s} {'ms':>8s} {'B/param':>8s} {'fused/x':>8s} {'floor ms':>9s} {'%floor':>7s}"
          f" {'host ms':>8s} {'W':>5s} {'SM MHz':>6s} {'cap%':>5s}")
    for r in rows:
        vs = f"{r['vs_fused']:.2f}x" if r["vs_fused"] else "-"
        pw = f" {r['power_w']:5.0f} {r['sm_mhz']:6.0f} {r['power_cap_pct']:5.0f}" if "power_w" in r else ""
        print(f"{r['case']:24s} {r['optimizer']:46s} {r['ms']:8.3f} {r['state_bytes_per_param']:8.4f} "
              f"{vs:>8s} {r['floor_ms']:9.3f} {r['pct_of_floor']:6.1f}%"
              f" {r['host_ms'] if r['host_ms'] is not None else float('nan'):8.3f}" + pw)
    print("(W, SM MHz: medians of nvidia-smi samples over 3 s of back-to-back steps after the timing, "
          "the first second dropped; "
          "cap%: share of samples with the software power cap lowering the clocks; "
          "host ms: CPU time of one step() call started with the GPU idle, median)")
    return dict(copy_bandwidth_TBps=bw / 1e12, rows=rows)


def bench_host(rep=200):
    """The step's Python work per call on CPU, no GPU needed (a proxy for "host ms" above): AdamW4bit
    on GPT-2-124M shapes with TRITON_INTERPRET=1 and impl="triton" takes the kernel path for CPU
    tensors; the kernel launches and torch's fused AdamW are replaced by no-ops where they are
    defined (adam4bit.adamw4bit_kernel, lowbit.optim.fp32.adamw_fp32_kernel), and the FP32-state
    tensors take the CUDA branch (lowbit.optim.fp32.FUSED_ADAMW_DEVICES; FP32 parameters: one fused
    call; 16-bit ones: one adamw_fp32_kernel launch), so what is timed is the bookkeeping that the
    GPU step's host time is made of besides the launches."""
    os.environ["TRITON_INTERPRET"] = "1"
    kernels, fused, devices = (A.adamw4bit_kernel, F.adamw_fp32_kernel), torch._fused_adamw_, F.FUSED_ADAMW_DEVICES

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kw: None

    A.adamw4bit_kernel, F.adamw_fp32_kernel, torch._fused_adamw_ = NoLaunch(), NoLaunch(), lambda *args, **kw: None
    F.FUSED_ADAMW_DEVICES = devices + ("cpu",)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)     # the small tensors' CPU arithmetic without thread-pool wake-ups
    hp = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, preset="zipsr", impl="triton")
    cases = [("fp32 params", torch.float32, {}), ("bf16 params, RTN write", torch.bfloat16, {}),
             ("bf16 params, SR write", torch.bfloat16, dict(param_rounding="sr")),
             ("bf16 params, 24-bit master", torch.bfloat16, dict(master_weight_bits=24))]
    rows = []
    try:
        for case, pdt, kw in cases:
            g = torch.Generator().manual_seed(0)
            ps = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(pdt)) for s in gpt2_shapes()]
            for p in ps:
                p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(pdt)
            opt = A.AdamW4bit(ps, **hp, **kw)
            for _ in range(5):
                opt.step()
            times = []
            for _ in range(rep):
                t0 = time.perf_counter()
                opt.step()
                times.append((time.perf_counter() - t0) * 1e3)
            rows.append(dict(case=case, host_ms=statistics.median(times)))
            print(f"{case:28s} {rows[-1]['host_ms']:8.3f} ms per step() (median of {rep}, CPU proxy)")
    finally:
        (A.adamw4bit_kernel, F.adamw_fp32_kernel), torch._fused_adamw_, F.FUSED_ADAMW_DEVICES = kernels, fused, devices
        torch.set_num_threads(threads)
    return dict(rows=rows)


# ---------------------------------------------------------------------------------------------
# noise: GaussWS kernels (paper A, Sec. 3.5, Figure 6)

SHAPES = [(768, 768), (3072, 768), (4096, 4096), (8192, 8192), (16384, 16384)]
BF16 = torch.bfloat16


def _time(fn, graph=False):
    """median_ms for the noise table: a failed timing becomes NaN and the table goes on."""
    try:
        return median_ms(fn, warmup=10, rep=50, graph=graph)
    except Exception as e:  # keep the rest of the table
        print(f"  timing failed: {type(e).__name__}: {str(e)[:200]}")
        return float("nan")


def torch_eq3(w, b_t):
    """Plain PyTorch eq. 3 with R = round(N(0,1)/2) (the paper's "torch" baseline): deliberately
    the naive version a user would write, timed eager and under torch.compile as the baseline of
    the noise table. Not a reference for the kernels (gaussws._apply_torch is)."""
    m, n = w.shape
    tm, tn = m // 32, n // 32
    wv = w.view(tm, 32, tn, 32)
    tmax = wv.abs().amax(dim=(1, 3), keepdim=True)
    scale = tmax * torch.exp2(1.0 - b_t).view(tm, 1, tn, 1)
    r = torch.round(torch.randn_like(wv) * 0.5)
    return (wv + r * scale).view(m, n).to(BF16)


def _noise_inputs(m, n):
    w = torch.randn(m, n, device="cuda")
    bt = 3 + 5 * torch.rand(tile_grid(m, n), device="cuda")
    return w, bt, torch.exp2(1 - bt), torch.tensor([12345, 6], device="cuda")


def bench_noise():
    """Paper A Figure 6: eq. 3 forward (generate + apply) at several shapes, vs torch and bm."""
    bw = copy_bandwidth()
    print(f"\ncopy bandwidth (read+write): {bw / 1e12:.3f} TB/s; floor = numel * 7 B / that")
    hdr = (f"{'shape':>12s} {'eager':>8s} {'compiled':>8s} {'bm':>8s} {'ours':>8s} {'fused':>8s} {'diffq':>8s} "
           f"{'floor':>8s} {'ours_g':>8s} {'fused_g':>8s} {'comp_g':>8s} {'bwd':>8s} {'bwd_f':>8s} "
           f"{'gen':>8s} {'apply':>8s} {'bm_g':>8s} {'eag/ours':>8s} {'eag/fused':>9s} {'comp/ours':>9s} {'comp/fus':>8s} {'floor%':>6s} {'floor%f':>7s} {'api':>8s} {'api_f':>8s} {'gen_api':>8s} {'appl_api':>8s}")
    print("times in microseconds (median); *_g = CUDA-graph replay (GPU time only); api = gaussws_sample(w, b_t, "
          "seed=int) (3 kernels), api_f = the same with fused=True, gen_api / appl_api = generate_noise / "
          "apply_noise: the public calls, argument checks and 2^(1-b_t) included")
    print(hdr)
    out = []
    comp = torch.compile(torch_eq3, dynamic=False)
    for m, n in SHAPES:
        w, bt, pow2, seed = _noise_inputs(m, n)
        gg = torch.randn(m, n, device="cuda").to(BF16)
        tmax = g.tile_max(w)
        ours = lambda: g.apply_triton(w, g.generate_triton(m, n, seed, "gaussws"), pow2, seed, "gaussws", BF16, False)
        fused = lambda: g.apply_triton(w, None, pow2, seed, "gaussws", BF16, True)
        bm = lambda: g.apply_triton(w, g.generate_triton(m, n, seed, "bm"), pow2, seed, "gaussws", BF16, False)
        dq = lambda: g.apply_triton(w, g.generate_triton(m, n, seed, "diffq"), pow2, seed, "diffq", BF16, False)
        bwd = lambda: g.grad_triton(gg, g.generate_triton(m, n, seed, "gaussws"), tmax, seed, "gaussws", torch.float32, False)
        bwdf = lambda: g.grad_triton(gg, None, tmax, seed, "gaussws", torch.float32, True)
        packed = g.generate_triton(m, n, seed, "gaussws")
        comp(w, bt)  # compile outside the timing
        r = dict(shape=f"{m}x{n}", eager=_time(lambda: torch_eq3(w, bt)), compiled=_time(lambda: comp(w, bt)),
                 bm=_time(bm), ours=_time(ours), fused=_time(fused), diffq=_time(dq),
                 floor=m * n * 7 / bw * 1e3, ours_g=_time(ours, True), fused_g=_time(fused, True),
                 comp_g=_time(lambda: comp(w, bt), True), bwd=_time(bwd), bwd_f=_time(bwdf),
                 gen=_time(lambda: g.generate_triton(m, n, seed, "gaussws")), bm_g=_time(bm, True),
                 apply=_time(lambda: g.apply_triton(w, packed, pow2, seed, "gaussws", BF16, False)),
                 # the public calls: argument checks, 2^(1-b_t) from b_t, the int seed's cached tensor
                 api=_time(lambda: g.gaussws_sample(w, bt, 12345)),
                 api_f=_time(lambda: g.gaussws_sample(w, bt, 12345, fused=True)),
                 gen_api=_time(lambda: g.generate_noise((m, n), 12345, device="cuda")),
                 apply_api=_time(lambda: g.apply_noise(w, packed, bt)))
        out.append(r)
        us = lambda k: f"{r[k] * 1e3:8.1f}"
        print(f"{r['shape']:>12s} " + " ".join(us(k) for k in ("eager", "compiled", "bm", "ours", "fused", "diffq", "floor",
                                                             "ours_g", "fused_g", "comp_g", "bwd", "bwd_f", "gen", "apply", "bm_g"))
              + f" {r['eager'] / r['ours']:8.2f} {r['eager'] / r['fused']:9.2f} {r['compiled'] / r['ours']:9.2f}"
              + f" {r['compiled'] / r['fused']:8.2f} {100 * r['floor'] / r['ours']:6.1f}"
              + f" {100 * r['floor'] / r['fused']:7.1f} " + " ".join(us(k) for k in ("api", "api_f", "gen_api", "apply_api")))
        del w, gg
        torch.cuda.empty_cache()
    return out
