"""
Benchmarks on one GPU. Every figure is a median of triton.testing.do_bench (CUDA events,
launch overhead included) measured in the same run as its baselines, reported as ratios.

    python bench.py                 # everything
    python bench.py --only optim    # 4-bit AdamW step (paper B) vs torch AdamW, bandwidth floor
    python bench.py --only noise    # GaussWS noise kernels (paper A, Figure 6)
    python bench.py --only memory   # bytes/param of the training state, measured vs arithmetic
    python bench.py --only train    # paper A Table 1: tokens/s, peak memory, overhead vs BF16
    python bench.py --only ddp --dataset D   # 2 GPUs (torchrun) vs 1 GPU, same global batch
    python bench.py --only quality --dataset D --preset small   # the papers' loss comparisons
    python bench.py --only quality --preset mini --dataset D --seeds 0,1,2,3 --tokens_per_param 20 \
        --jobs 20 --train_args "--tokenizer byte --batch_size 128"   # 20 concurrent train.py runs

Results are printed as a table and written to results/<gpu>_<date>_<section>.json.
"""
import argparse
import datetime
import json
import math
import os
import re
import shlex
import statistics
import sys

import torch
import triton

import adam4bit as A
import gaussws as g


def median_ms(fn, warmup=25, rep=100, graph=False):
    """Median ms of fn (CUDA events); graph=True replays a CUDA graph (GPU time only)."""
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def copy_bandwidth(nbytes=4 << 30):
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x))
    del x, y
    return 2 * nbytes / (ms * 1e-3)


def power_during(fn, seconds=3.0, settle=1.0):
    """Run fn back to back for `seconds` while nvidia-smi samples this GPU every 100 ms; the
    samples of the first `settle` seconds are dropped (NVML's power reading averages over ~1 s).
    Returns dict(power_w=median board power in W, sm_mhz=median SM clock in MHz,
    power_cap_pct=% of samples in which the software power cap held the clocks down, NVML reason
    0x4), or None (with a printed reason) where nvidia-smi, the device's PCI address or the
    readings are not available. Why: the memory-bound 4-bit optimizer steps run the H200 at its
    700 W cap, so their time also depends on the energy each step spends, not only on bytes."""
    import shutil, subprocess, threading, time
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if shutil.which("nvidia-smi") is None or not hasattr(props, "pci_bus_id"):
        return None
    bus = f"{getattr(props, 'pci_domain_id', 0):08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    q = "power.draw,clocks.sm,clocks_throttle_reasons.active"
    mon = subprocess.Popen(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits", "-i", bus,
                            "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples = []                               # (arrival time, line)
    reader = threading.Thread(target=lambda: samples.extend((time.time(), ln) for ln in mon.stdout), daemon=True)
    reader.start()
    t_wait = time.time()
    while not samples and mon.poll() is None and time.time() - t_wait < 5:
        time.sleep(0.01)                       # nvidia-smi up (or failed) before the clock starts
    t0 = time.time()
    try:
        while time.time() - t0 < seconds:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
    finally:
        mon.terminate()
        try:
            mon.wait(timeout=5)
        except subprocess.TimeoutExpired:
            mon.kill()
            mon.wait()
        reader.join(timeout=5)
    err = mon.stderr.read()
    lines = [ln for t, ln in list(samples) if t >= t0 + settle]

    def num(x, base=None):     # a field may read "[N/A]" or "[Not Supported]"
        try:
            return float(x) if base is None else int(x, base)
        except ValueError:
            return None
    fields = [[x.strip() for x in line.split(",")] for line in lines]
    rows = [(num(f[0]), num(f[1]), num(f[2], 16)) for f in fields if len(f) == 3]
    w, mhz, why = ([r[i] for r in rows if r[i] is not None] for i in range(3))
    if not (w and mhz and why):
        print(f"(power/clock readings not available: {(err or ''.join(ln for _, ln in samples[:1])).strip()[:200]!r})")
        return None
    return dict(power_w=statistics.median(w), sm_mhz=statistics.median(mhz),
                power_cap_pct=100 * sum(r & 4 != 0 for r in why) / len(why))


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
    import train as trainer
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
                pw = power_during(opt.step) if n > 2e8 else None   # a long case: enough samples
            except Exception as e:
                print(f"  {case} {name}: failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            state = trainer.optimizer_state_bytes(opt)
            if name == "torch AdamW fused":
                base = ms
            # bytes moved: param r+w (8), grad read, state r+w
            moved = n * (8 + (2 if gdt == torch.bfloat16 else 4)) + 2 * state
            rows.append(dict(case=case, optimizer=name, ms=ms, state_bytes_per_param=state / n,
                             vs_fused=(base / ms) if base else None,
                             floor_ms=moved / bw * 1e3, pct_of_floor=moved / bw * 1e3 / ms * 100, **(pw or {})))
            del opt, ps
            torch.cuda.empty_cache()
    print(f"\ncopy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    print(f"{'case':24s} {'optimizer':36s} {'ms':>8s} {'B/param':>8s} {'fused/x':>8s} {'floor ms':>9s} {'%floor':>7s}"
          f" {'W':>5s} {'SM MHz':>6s} {'cap%':>5s}")
    for r in rows:
        vs = f"{r['vs_fused']:.2f}x" if r["vs_fused"] else "-"
        pw = f" {r['power_w']:5.0f} {r['sm_mhz']:6.0f} {r['power_cap_pct']:5.0f}" if "power_w" in r else ""
        print(f"{r['case']:24s} {r['optimizer']:36s} {r['ms']:8.3f} {r['state_bytes_per_param']:8.4f} "
              f"{vs:>8s} {r['floor_ms']:9.3f} {r['pct_of_floor']:6.1f}%" + pw)
    print("(W, SM MHz: medians of nvidia-smi samples over 3 s of back-to-back steps after the timing, "
          "the first second dropped; "
          "cap%: share of samples with the software power cap lowering the clocks)")
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
                     for a, b in zip(cpu, gpu) if o_c.is_quantized(a) for k in o_c.state[a].keys() - {"step"})
        out[kw.get("v_rounding", kw["preset"])] = dict(params_bit_identical=same_p,
                                                       states_bit_identical=same_s, max_abs_diff=diff)
    sd = o_g.state_dict()
    o_c2 = A.AdamW4bit(cpu, impl="torch", lr=1e-2, preset="zipsr", v_rounding="update-rtn")
    o_c2.load_state_dict(sd)
    out["gpu_to_cpu_load_exact"] = all(
        o_c2.state[a]["step"] == o_g.state[b]["step"] and all(torch.equal(o_c2.state[a][k], o_g.state[b][k].cpu())
                                                            for k in o_g.state[b].keys() - {"step"})
        for a, b in zip(cpu, gpu))
    print("GPU correctness:", json.dumps(out, indent=1))
    return out


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


# ---------------------------------------------------------------------------------------------
# train: paper A Table 1 (tokens/s and peak memory of BF16 / GaussWS / DiffQ), and memory

TABLE1 = [("llama-134m", 24), ("llama-1b", 8), ("llama-3b", 2), ("llama-70b-4l", 2)]  # x 2048 tokens


def _train_setup(preset, method, optim, batch, T, device, compile=True, memory="save"):
    """Model (preset, PQT method on [all]), optimizer (train.py's) and one training step closure
    on random tokens (throughput does not depend on the data)."""
    import train as trainer
    from model import GPT, preset_config
    torch.manual_seed(0)
    with device:        # initialise on the GPU: a CPU init of a 3B model takes longer than its benchmark
        model = GPT(preset_config(preset, block_size=T))
    if method != "bf16":
        g.apply_pqt(model, method=method, parts="all", memory=memory)
    args = argparse.Namespace(optim=optim, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                              weight_decay=0.1, bits_wd=0.0, seed=0)
    opt = trainer.build_optimizer(args, model, device.type)
    fwd = torch.compile(model) if compile else model
    V = model.config.vocab_size
    x = torch.randint(0, V, (batch, T), device=device)
    y = torch.randint(0, V, (batch, T), device=device)

    def step(zero=True):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            _, loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if zero:
            opt.zero_grad(set_to_none=True)
        return loss
    return model, opt, step


def bench_train(cases=TABLE1, optims=("adamw", "zipsr"), methods=("bf16", "gaussws", "diffq"),
                steps=20, T=2048, device="cuda", compile=False, on_row=None):
    """Paper A Table 1: median step time -> tokens/s and peak memory per (model, optimizer,
    method), overhead vs BF16 and its geometric mean over models (paper: 3.14 % GaussWS,
    22.34 % DiffQ with AdamW on an A100). Eager by default: 24 torch.compile runs of models up to
    4B parameters take longer than one benchmark call; train.py's compiled throughput is
    measured with train.py itself (README). on_row(rows): called after each measured row (main
    saves the partial table, so a run stopped by a time limit keeps what it measured)."""
    device = torch.device(device)
    rows = []
    for preset, batch in cases:
        for optim in optims:
            base = None
            for method in methods:
                model, opt, step = _train_setup(preset, method, optim, batch, T, device, compile)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                for _ in range(3):                           # compile and warm up
                    step()
                times = []
                for _ in range(steps):
                    if device.type == "cuda":
                        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        t0.record()
                        step()
                        t1.record()
                        t1.synchronize()
                        times.append(t0.elapsed_time(t1))
                    else:
                        t = datetime.datetime.now()
                        step()
                        times.append((datetime.datetime.now() - t).total_seconds() * 1e3)
                ms = sorted(times)[len(times) // 2]
                tps = batch * T / (ms * 1e-3)
                base = tps if method == "bf16" else base
                peak = torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else float("nan")
                rows.append(dict(model=preset, params=model.num_params(), batch=batch, T=T, optim=optim,
                                 method=method, compiled=compile, step_ms=ms, tokens_per_s=tps, peak_GiB=peak,
                                 overhead_pct=(100 * (1 - tps / base)) if base else None,
                                 command=f"python bench.py --only train  # {preset} {method} {optim}"))
                r = rows[-1]
                print(f"{preset:14s} B={batch:<3d} {optim:6s} {method:8s} {ms:9.2f} ms {tps:12,.0f} tok/s "
                      f"{peak:7.2f} GiB overhead {r['overhead_pct'] if r['overhead_pct'] is not None else 0:6.2f} %",
                      flush=True)
                del model, opt, step
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if on_row:
                    on_row(rows)
    geo = {}
    for optim in optims:
        for method in methods[1:]:
            ov = [r["overhead_pct"] for r in rows if r["optim"] == optim and r["method"] == method]
            if ov:
                geo[f"{method}/{optim}"] = 100 * (1 - math.exp(sum(math.log(1 - o / 100) for o in ov) / len(ov)))
    print("geometric-mean overhead vs bf16:", {k: round(v, 2) for k, v in geo.items()})
    return dict(rows=rows, geomean_overhead_pct=geo)


def bench_memory(preset="gpt2-124m", T=1024, batch=4, device="cuda"):
    """Bytes/param of the training state: weights, grads, optimizer states, and the BF16 copies of
    the block linears' weights saved for backward (w_hat for GaussWS/DiffQ with memory="save";
    under BF16 autocast plain training saves its cast weights just the same), measured on real
    tensors after a step, beside the arithmetic 4 + 4 + {8 | 1.0625 on eligible tensors, 8 on
    others} + 2 per block-linear param (0 for memory="recompute")."""
    import train as trainer
    device = torch.device(device)
    rows = []
    for method, memory in (("bf16", "save"), ("gaussws", "save"), ("gaussws", "recompute"), ("diffq", "save")):
        for optim in ("adamw", "zipsr"):
            model, opt, step = _train_setup(preset, method, optim,
                                            batch, T, device, compile=False, memory=memory)
            step(zero=False)                                   # grads stay for the count
            ps = list(model.parameters())
            n = sum(p.numel() for p in ps)
            # BF16 copies of the block linears' weights kept for backward: w_hat for GaussWS/DiffQ
            # in "save" mode, autocast's cast for BF16 (F.linear saves the transposed view)
            lins = [m for m in model.blocks.modules() if isinstance(m, torch.nn.Linear)]
            n_lin = sum(m.weight.numel() for m in lins)
            shapes = {s for m in lins for s in (tuple(m.weight.shape), tuple(m.weight.shape)[::-1])}
            saved = []

            def pack(t):
                if t.dtype == torch.bfloat16 and tuple(t.shape) in shapes:
                    saved.append(t.numel() * t.element_size())
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=True):
                    model(torch.zeros(1, 8, dtype=torch.long, device=device),
                          torch.zeros(1, 8, dtype=torch.long, device=device))
            measured = dict(weights=sum(p.numel() * p.element_size() for p in ps),
                            grads=sum(p.grad.numel() * p.grad.element_size() for p in ps if p.grad is not None),
                            optimizer=trainer.optimizer_state_bytes(opt), bf16_weights_saved=sum(saved))
            elig = sum(p.numel() for p in ps if p.numel() >= A.MIN_QUANT_NUMEL and p.numel() % 128 == 0)
            state = 8 * n if optim == "adamw" else 1.0625 * elig + 8 * (n - elig)
            arith = dict(weights=4 * n, grads=4 * n, optimizer=state,
                         bf16_weights_saved=0 if method != "bf16" and memory == "recompute" else 2 * n_lin)
            rows.append(dict(method=method, memory=memory, optim=optim, params=n,
                             measured_B_per_param={k: v / n for k, v in measured.items()},
                             arithmetic_B_per_param={k: v / n for k, v in arith.items()},
                             total_measured=sum(measured.values()) / n, total_arithmetic=sum(arith.values()) / n))
            r = rows[-1]
            print(f"{method:8s} {memory:9s} {optim:6s} measured {r['total_measured']:6.3f} B/param "
                  f"(arithmetic {r['total_arithmetic']:6.3f}): " +
                  " ".join(f"{k} {v:.3f}" for k, v in r["measured_B_per_param"].items()), flush=True)
            del model, opt, step
    return dict(preset=preset, rows=rows)


# ---------------------------------------------------------------------------------------------
# ddp: an N-GPU torchrun run against a 1-GPU run with the same global batch

def bench_ddp(train_args, out_dir="out-ddp", nproc=2):
    """Run train.py once in one process and once under torchrun with nproc processes, the same
    flags (which should include --grad_accum divisible by nproc, so the global batch is equal).
    Micro-batches are seeded by (seed, step, global micro-batch index), so both runs read the
    same windows and their loss curves agree up to floating-point summation order.
    Returns per-step and per-eval losses of both runs, tokens/s and peak memory."""
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1")
    logs = {}
    for n in (1, nproc):
        run_dir = os.path.join(out_dir, f"{n}proc")
        launch = [sys.executable] if n == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                  "--standalone", "--nproc_per_node", str(n)]
        r = subprocess.run([*launch, os.path.join(here, "train.py"), *train_args, "--out_dir", run_dir],
                           env=env, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{n}-process run failed:\n{r.stderr[-3000:]}")
        with open(os.path.join(run_dir, "log.jsonl")) as f:
            logs[n] = [json.loads(line) for line in f]
    out = {}
    for n, recs in logs.items():
        summary = [x for x in recs if x["type"] == "summary"][-1]
        out[n] = dict(step_loss=[x["loss"] for x in recs if x["type"] == "step"],
                      val_loss=[x["val_loss"] for x in recs if x["type"] == "eval"],
                      tokens_per_s=summary.get("tokens_per_s"), peak_mem_mb=summary.get("peak_mem_mb"))
    d = [b - a for a, b in zip(out[1]["step_loss"], out[nproc]["step_loss"])]
    print(f"{len(d)} steps: step-loss difference {nproc} procs - 1 proc: max |d| {max(map(abs, d)):.2e}, "
          f"mean {sum(d) / len(d):+.2e}; val {out[1]['val_loss']} vs {out[nproc]['val_loss']}; "
          f"tokens/s {out[1]['tokens_per_s']} vs {out[nproc]['tokens_per_s']}")
    return dict(command=f"python bench.py --only ddp  # train.py {' '.join(train_args)}",
                one=out[1], many=out[nproc], nproc=nproc)


# ---------------------------------------------------------------------------------------------
# quality: the papers' comparisons at small scale, same data, seeds and steps for every run

# experiment -> runs. A run is (method, optim) or (method, optim, extra train.py flags, label);
# runs with the same (method, optim, flags) are trained once and shared between experiments.
QUALITY = {
    # paper A; the bits_wd 0.5 run pulls b_t down toward b_target harder than the default 0.1
    "pqt": [("bf16", "adamw"), ("gaussws", "adamw"), ("diffq", "adamw"),
            ("gaussws", "adamw", ("--bits_wd", "0.5"), "gaussws/adamw bits_wd 0.5")],
    "optim": [("bf16", "fp32"), ("bf16", "torchao"), ("bf16", "zeeden"), ("bf16", "zipsr")],  # paper B
    # paper B Figure 1: zero-inclusive Dyn4 second moment with state-space rounding vs Update-SR
    # (Dyn4 + Update-SR is ZIP-SR). The paper keeps m in FP32 there; AdamW4bit quantizes m (NF4,
    # the zipsr preset's) whenever v is quantized, so only the v rule differs between these runs.
    "zeropoint": [("bf16", "fp32"),
                  ("bf16", "zipsr", (), "Dyn4 Update-SR (zipsr)"),
                  ("bf16", "zipsr", ("--v_codebook", "dyn4", "--v_rounding", "state-rtn"), "Dyn4 State-RTN"),
                  ("bf16", "zipsr", ("--v_codebook", "dyn4", "--v_rounding", "state-sr"), "Dyn4 State-SR")],
    "combined": [("bf16", "adamw"), ("gaussws", "zipsr")],                         # A + B together
}


def _spec(run):
    """(method, optim, extra flags as a tuple of str, label) of a QUALITY run."""
    method, optim, *rest = run
    extra = tuple(rest[0]) if rest else ()
    label = rest[1] if len(rest) > 1 else f"{method}/{optim}" + "".join(f" {x}" for x in extra)
    return method, optim, extra, label


def _run_dir(out_dir, method, optim, extra, seed):
    tag = "".join(("_" if x.startswith("--") else "-") + re.sub(r"[^\w.-]", "_", x.lstrip("-")) for x in extra)
    return os.path.join(out_dir, f"{method}_{optim}{tag}_s{seed}")


def _visible_gpus():
    """CUDA device ids (as CUDA_VISIBLE_DEVICES strings) a subprocess may be pinned to; [] on CPU."""
    if not torch.cuda.is_available():
        return []
    vis = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    return (vis or [str(i) for i in range(torch.cuda.device_count())])[:torch.cuda.device_count()]


def _prepare_data(argv):
    """Check the flags and prepare the dataset once, as train.py would (so concurrent runs do not
    race to write the same data folder)."""
    import data as datamod
    import train as trainer
    p = trainer.build_parser()
    a = p.parse_args(argv)
    trainer.resolve_args(a, p, a.device != "cpu" and torch.cuda.is_available())
    datamod.prepare(a.dataset, a.tokenizer, data_dir=a.data_dir, max_tokens=a.max_tokens)


def _train_inprocess(argv, d):
    """One run in this process; a diverged run (train.py's RunError on a NaN/inf loss) is left in
    its log and reported, not raised."""
    import train as trainer
    try:
        trainer.main(argv)
    except trainer.RunError as e:
        if "diverged" not in str(e):
            raise
        print(f"[quality] {d}: {e}")


def _train_subprocesses(todo, jobs):
    """Run `python train.py ARGV` for each (argv, out_dir) of todo, `jobs` at a time; with more than
    one visible GPU each run gets the least-loaded one (CUDA_VISIBLE_DEVICES; round-robin when the
    runs take equal time). A run's output goes to out_dir/train.out. Returns {out_dir: message}
    for runs that failed other than by diverging (their train.py exited non-zero without an
    "error" record in log.jsonl)."""
    import signal
    import subprocess
    import threading
    import time
    import train as trainer
    here = os.path.dirname(os.path.abspath(__file__))
    gpus, queue, running, failed = _visible_gpus(), list(todo), [], {}
    # a time limit or scheduler sends SIGTERM: raise SystemExit so the finally below ends the runs
    main_thread = threading.current_thread() is threading.main_thread()
    old_handler = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)) if main_thread else None
    try:
        while queue or running:
            while queue and len(running) < jobs:
                argv, d = queue.pop(0)
                env = dict(os.environ, PYTHONUNBUFFERED="1")
                gpu = None
                if len(gpus) > 1:
                    load = {x: sum(r[2] == x for r in running) for x in gpus}
                    gpu = min(gpus, key=load.get)
                    env["CUDA_VISIBLE_DEVICES"] = gpu
                elif not gpus and "OMP_NUM_THREADS" not in env:   # CPU: share the cores
                    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
                os.makedirs(d, exist_ok=True)
                fh = open(os.path.join(d, "train.out"), "w")
                p = subprocess.Popen([sys.executable, os.path.join(here, "train.py"), *argv],
                                     stdout=fh, stderr=subprocess.STDOUT, env=env)
                running.append((p, d, gpu, fh, time.time()))
                print(f"[quality] started {d}" + (f" on GPU {gpu}" if gpu is not None else ""), flush=True)
            time.sleep(0.2)
            for r in [r for r in running if r[0].poll() is not None]:
                p, d, gpu, fh, t0 = r
                fh.close()
                running.remove(r)
                status = "done"
                if p.returncode:
                    if any(x.get("type") == "error" for x in trainer.read_log(os.path.join(d, "log.jsonl"))):
                        status = "diverged"
                    else:
                        with open(os.path.join(d, "train.out")) as f:
                            failed[d] = f"exit {p.returncode}: " + f.read()[-2000:]
                        status = f"FAILED (exit {p.returncode}, see {d}/train.out)"
                print(f"[quality] {status} {d} ({time.time() - t0:.0f} s)", flush=True)
    finally:   # interrupted (Ctrl-C, a time limit): do not leave runs behind
        for p, *_ in running:
            p.terminate()
        if main_thread:
            signal.signal(signal.SIGTERM, old_handler)
    return failed


def _read_run(d):
    """Numbers of a finished (or diverged) run from its log.jsonl."""
    import train as trainer
    recs = trainer.read_log(os.path.join(d, "log.jsonl"))
    s = next((r for r in reversed(recs) if r.get("type") == "summary"), None) or {}
    err = next((r for r in reversed(recs) if r.get("type") == "error"), None)
    pts = [(r["iter"], r["loss"]) for r in recs if r.get("type") == "step"]
    steps = [loss for _, loss in pts]
    tail = steps[-max(1, len(steps) // 10):]
    k = max(1, len(pts) // 50)          # moving average over 2 % of the steps (paper B Figure 1)
    smooth = [(pts[i][0], sum(win := steps[max(0, i - k + 1):i + 1]) / len(win))
              for i in range(0, len(pts), max(1, len(pts) // 200))]
    return dict(dir=d, log=os.path.join(d, "log.jsonl"), diverged_at=err["iter"] if err else None,
                val_curve=[(r["iter"], r["val_loss"]) for r in recs if r.get("type") == "eval"],
                train_curve=smooth,
                final_val_loss=s.get("final_val_loss"), optimizer_state_mb=s.get("optimizer_state_mb"),
                peak_mem_mb=s.get("peak_mem_mb"), tokens_per_s=s.get("tokens_per_s"),
                # mean training loss over the last 10 % of steps (None for a diverged run)
                final_train_loss=sum(tail) / len(tail) if steps and not err else None)


def bench_quality(train_args, seeds=(0, 1), out_dir="out-quality", experiments=QUALITY, jobs=1,
                  cast=True, command=None, resume=False):
    """Train every run of `experiments` for each seed with the same train.py flags (`train_args`:
    preset, dataset, steps, ...) and compare final val losses (mean over seeds).
    For "optim" also the gap to 32-bit AdamW and the share of TorchAO's gap each method closes
    (paper B: ZIP-SR / ZE-EDEN close up to 70 % of it at every size); for "zeropoint" (paper B
    Figure 1) the training-loss curves, where a diverged run (NaN/inf loss) is recorded with its
    step instead of stopping the bench. With an experiment "pqt" and cast=True also experiment 5 (bench_cast: val loss before
    and after casting tiles to their Table C formats) and the Figure 5 bitwidth chart.
    jobs=1 trains in this process; jobs>1 runs that many `python train.py` subprocesses at once,
    spread over the visible GPUs. Runs shared between experiments are trained once.
    resume=True passes train.py --resume to every run that has a checkpoint: finished runs are
    read back as they are, interrupted ones continue (train.py refuses a changed configuration),
    so the bench can be spread over several sessions.
    Writes loss-curve PNGs when matplotlib is installed.
    Returns {"command", "seeds", "experiments": {experiment: {label: {...}}}, "cast", "bitwidth",
    "failed_runs"}."""
    runs, todo = {}, []
    for run in dict.fromkeys(_spec(r)[:3] for rs in experiments.values() for r in rs):
        for seed in seeds:
            d = _run_dir(out_dir, *run, seed)
            argv = [*train_args, "--method", run[0], "--optim", run[1], *run[2], "--seed", str(seed),
                    "--out_dir", d, "--no-plot"]
            if resume and os.path.exists(os.path.join(d, "ckpt.pt")):
                argv.append("--resume")
            runs[(*run, seed)] = d
            todo.append((argv, d))
    failed = {}
    if jobs > 1:
        _prepare_data(todo[0][0])
        failed = _train_subprocesses(todo, jobs)
    else:
        for argv, d in todo:
            _train_inprocess(argv, d)
    runs = {k: _read_run(d) for k, d in runs.items()}
    res = {}
    for exp, rs in experiments.items():
        rows = {}
        for run in rs:
            method, optim, extra, label = _spec(run)
            per = [runs[(method, optim, extra, s)] for s in seeds]
            finals = [r["final_val_loss"] for r in per]
            ok = all(x is not None and math.isfinite(x) for x in finals)
            rows[label] = dict(
                method=method, optim=optim, flags=list(extra), final_val_loss=finals,
                mean=sum(finals) / len(finals) if ok else None,
                final_train_loss=[r["final_train_loss"] for r in per],
                diverged_at=[r["diverged_at"] for r in per],
                **{k: per[0][k] for k in ("optimizer_state_mb", "peak_mem_mb", "tokens_per_s")},
                curves=[dict(seed=sd, val=r["val_curve"], train=r["train_curve"]) for sd, r in zip(seeds, per)])
        base = rows[_spec(rs[0])[3]]["mean"]
        for r in rows.values():
            r["gap_to_first"] = r["mean"] - base if r["mean"] is not None and base is not None else None
        if exp == "optim" and "bf16/torchao" in rows:
            gap_ao = rows["bf16/torchao"]["gap_to_first"]
            for r in rows.values():   # undefined unless TorchAO is behind 32-bit AdamW
                r["share_of_torchao_gap_closed"] = (1 - r["gap_to_first"] / gap_ao
                                                    if gap_ao and gap_ao > 0 and r["gap_to_first"] is not None
                                                    else None)
        res[exp] = rows
        print(f"[{exp}] " + "; ".join(
            f"{k}: " + (f"{v['mean']:.4f} ({v['gap_to_first']:+.4f})" if v["gap_to_first"] is not None else
                        f"{v['mean']}" if v["mean"] is not None else
                        "diverged at step " + ", ".join(str(x) for x in v["diverged_at"]))
            for k, v in rows.items()))
        _plot_quality(exp, rows, os.path.join(out_dir, f"{exp}.png"), train_loss=exp == "zeropoint")
    out = dict(command=command or f"python bench.py --only quality  # train.py {' '.join(train_args)}",
               seeds=list(seeds), experiments=res)
    if cast and "pqt" in experiments:
        pqt = [(_spec(r), s) for r in experiments["pqt"] for s in seeds]
        done = [(f"{sp[3]} s{s}", runs[(*sp[:3], s)]["dir"]) for sp, s in pqt
                if runs[(*sp[:3], s)]["final_val_loss"] is not None]
        out["cast"], out["bitwidth"] = bench_cast(done, os.path.join(out_dir, "bitwidth.png"))
        _plot_cast(out["cast"], os.path.join(out_dir, "cast.png"))
    out["failed_runs"] = failed
    for d, msg in failed.items():
        print(f"[quality] run {d} FAILED: {msg[-500:]}")
    return out


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return None


def _finish(plt, fig, ax, png):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    print("wrote", png)


def _plot_quality(exp, rows, png, train_loss=False):
    """Curves of an experiment's runs from its result rows (label -> row with "curves").
    train_loss=True: the smoothed training loss of every seed (as in paper B Figure 1). Otherwise
    the val loss averaged over seeds per run, and beside it each run's gap to the first run (the
    baseline) at the same evals, where differences of 0.01 would be invisible on the loss scale."""
    plt = _pyplot()
    if plt is None:
        return
    if train_loss:
        fig, ax = plt.subplots(figsize=(7, 4))
        top = None
        for label, row in rows.items():
            for c in row.get("curves", []):
                pts = c["train"]
                if not pts:
                    continue
                if top is None:     # y range: the first run's curve after its first steps
                    top = max(p[1] for p in pts[len(pts) // 20:])
                    bottom = min(p[1] for p in pts)
                ax.plot(*zip(*pts), lw=1, label=f"{label} seed {c['seed']}")
        if top is not None and math.isfinite(top) and math.isfinite(bottom):
            ax.set_ylim(bottom - 0.05 * (top - bottom), top + 0.05 * (top - bottom))
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (smoothed)")
        ax.set_title(exp)
        _finish(plt, fig, ax, png)
        return

    def mean_curve(row):   # {step: mean val loss over the seeds that have it}
        by_step = {}
        for c in row.get("curves", []):
            for step, v in c["val"]:
                by_step.setdefault(step, []).append(v)
        return {k: sum(v) / len(v) for k, v in sorted(by_step.items())}
    curves = {label: mean_curve(row) for label, row in rows.items()}
    base = next(iter(curves.values()), {})
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for label, cv in curves.items():
        n = len(rows[label].get("curves", []))
        if cv:
            ax.plot(list(cv), list(cv.values()), lw=1, marker="o", ms=3, label=f"{label} ({n} seeds)")
        late = [k for k in cv if k in base and k >= 0.2 * max(base, default=0)]
        ax2.plot(late, [cv[k] - base[k] for k in late], lw=1, marker="o", ms=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("val loss (mean over seeds)")
    ax.set_title(exp)
    ax2.axhline(0, color="k", lw=0.8)
    ax2.set_xlabel("step")
    ax2.set_ylabel(f"val loss - {next(iter(rows), '')} (means)")
    ax2.set_title(f"{exp}: gap to the first run, from 20 % of the steps")
    ax2.grid(alpha=0.3)
    _finish(plt, fig, ax, png)


# ---- experiment 5: cast tiles to the FP formats of paper A Table C

# (largest b_t, name as gaussws.fp_tier gives it, exponent bits, mantissa bits): paper A §3.3,
# Prop. 4 and Table C; tiles above 12 bits keep their FP32 weights.
FP_TIERS = ((5, "FP8 e3m4", 3, 4), (9, "FP12 e4m7", 4, 7), (12, "FP16 e5m10", 5, 10))
# The same layers of every model cast to one format, mantissa 4 down to 1 bit: Prop. 3 gives
# w_hat a (b_t - 2)-bit mantissa, so b_target = 4 calls for e3m2 -- a coarser grid than the FP8
# tier, where a model trained without noise should lose more than one trained with it.
CAST_SWEEP = ((3, 4), (3, 3), (3, 2), (3, 1))


def _fp_limits(exp_bits, man_bits, inf_nan=True):
    """(emin, emax, largest finite) of a binary FP format with bias 2^(exp_bits-1) - 1."""
    bias = 2 ** (exp_bits - 1) - 1
    emax = 2 ** exp_bits - (2 if inf_nan else 1) - bias
    return 1 - bias, emax, (2 - 2.0 ** -man_bits) * 2.0 ** emax


def cast_fp(x, exp_bits, man_bits, inf_nan=True):
    """Round x (float tensor, any shape/device) to the nearest value of the binary floating-point
    format with `exp_bits` exponent and `man_bits` mantissa bits, ties to even, with subnormals;
    magnitudes beyond the largest finite value (and +-inf) saturate to it. The format has
    exponent bias 2^(exp_bits-1) - 1; inf_nan=True reserves the all-ones exponent for inf/NaN as
    IEEE 754 does (the Table C formats of paper A count "a range for NaN/Inf", Prop. 4:
    e5m10 = IEEE FP16, e3m4, e4m7), inf_nan=False uses it for finite values (OCP FP4 E2M1:
    0, 0.5, 1, 1.5, 2, 3, 4, 6). NaN stays NaN. Returns the values in x's dtype (exact for float32
    and float64 inputs; the rounding is done in float64).
    Raises ValueError unless exp_bits is an int in [1, 8] and man_bits an int in [0, 23]
    (exp_bits 1 needs inf_nan=False)."""
    for name, v, lo, hi in (("exp_bits", exp_bits, 1, 8), ("man_bits", man_bits, 0, 23)):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"cast_fp: {name}={v!r} must be an int in [{lo}, {hi}]")
    if exp_bits == 1 and inf_nan:
        raise ValueError("cast_fp: exp_bits=1 with inf_nan=True leaves no finite normal exponent; "
                         "use inf_nan=False")
    emin, _, top = _fp_limits(exp_bits, man_bits, inf_nan)
    a = x.detach().double().abs()
    _, ex = torch.frexp(a)                    # a = f * 2^ex, f in [0.5, 1): exponent = ex - 1
    step = torch.exp2((ex - 1).clamp(min=emin).double() - man_bits)   # grid spacing in a's binade
    q = (torch.round(a / step) * step).clamp(max=top)                 # torch.round: half to even
    return torch.where(torch.isnan(a), a, q).copysign(x.detach().double()).to(x.dtype)


def _tile_grid_of(t, m, n):
    """Broadcast a per-tile tensor (ceil(m/32), ceil(n/32)) to (m, n)."""
    return t.repeat_interleave(g.TILE, 0)[:m].repeat_interleave(g.TILE, 1)[:, :n]


def cast_tiles(w, exp_bits, man_bits):
    """Every 32x32 tile of w (m, n) cast to FP(exp_bits, man_bits) with its own power-of-two scale
    (MX-style shared exponent): the tile's absmax lands in the format's top binade, so the largest
    magnitude stays representable (to the format's precision; at most it saturates to the largest
    finite value) and the format's exponent range spans downward from it, as Prop. 4 counts it.
    All-zero tiles stay zero. Returns a new tensor of w's dtype."""
    m, n = w.shape
    tm, tn = g.tile_grid(m, n)
    pad = torch.zeros(tm * g.TILE, tn * g.TILE, dtype=torch.float64, device=w.device)
    pad[:m, :n] = w.detach().abs()
    amax = pad.view(tm, g.TILE, tn, g.TILE).amax(dim=(1, 3))
    _, ex = torch.frexp(amax)
    emax = _fp_limits(exp_bits, man_bits)[1]
    scale = _tile_grid_of(torch.where(amax > 0, torch.exp2((ex - 1 - emax).double()), 1.0), m, n)
    return (cast_fp(w.detach().double() / scale, exp_bits, man_bits) * scale).to(w.dtype)


@torch.no_grad()
def cast_to_tiers(model):
    """In place: the weight of every GaussWSLinear of `model` cast tile by tile to the paper A
    Table C format its bitwidth calls for (b_t of eq. 11 clamped to [B_MIN, B_MAX], as sampling
    uses it): b_t <= 5 -> FP8 e3m4, <= 9 -> FP12 e4m7, <= 12 -> FP16 e5m10, above: kept (FP32).
    Returns {format name: share of those layers' weight parameters}, ">FP16" for the kept ones."""
    counts = {name: 0 for _, name, _, _ in FP_TIERS} | {">FP16": 0}
    for _, layer in g.pqt_layers(model):
        w = layer.weight
        m, n = w.shape
        bt = _tile_grid_of(layer.b_t.detach().clamp(g.B_MIN, g.B_MAX), m, n)
        out, lo = w.detach().clone(), -math.inf
        for limit, name, e, mb in FP_TIERS:
            mask = (bt > lo) & (bt <= limit)
            if mask.any():
                out = torch.where(mask, cast_tiles(w, e, mb), out)
            counts[name] += int(mask.sum())
            lo = limit
        counts[">FP16"] += int((bt > lo).sum())
        w.copy_(out)
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()}


def load_run(run_dir, device="cpu"):
    """(model in eval mode on device, run config, val()) from run_dir/ckpt.pt of a train.py run;
    val() is the run's validation loss (train.evaluate on its windows, batch size, autocast dtype).
    In eval mode GaussWSLinear layers use their weights w as they are (no noise)."""
    import contextlib
    import data as datamod
    import train as trainer
    from model import GPT, GPTConfig
    ck = trainer.load_checkpoint(os.path.join(run_dir, "ckpt.pt"))
    c = ck["config"]
    model = GPT(GPTConfig(**ck["model_config"]))
    if c["method"] != "bf16":
        g.apply_pqt(model, method=c["method"], parts=c["parts"], b_init=c["b_init"], b_target=c["b_target"],
                    seed=c["seed"], memory=c["pqt_memory"])
    model.load_state_dict(ck["model"])
    device = torch.device(device)
    model.to(device).eval()
    folder = datamod.prepare(c["dataset"], c["tokenizer"], data_dir=c["data_dir"], max_tokens=c["max_tokens"],
                             verbose=False)
    batches = datamod.Batches(folder, c["block_size"], seed=c["seed"])
    ctx = (torch.autocast(device.type, dtype=torch.bfloat16) if c["dtype"] == "bfloat16"
           else contextlib.nullcontext())
    return model, c, lambda: trainer.evaluate(model, batches, c["eval_windows"], c["batch_size"], ctx, device)


def bench_cast(run_dirs, png=None, device=None):
    """Experiment 5 and paper A Figure 5 on finished runs [(label, run_dir)]: val loss of the
    plain weights w before and after cast_to_tiers. GaussWS/DiffQ runs use each tile's learned b_t;
    a BF16 run is the control: its same layers (--parts) are cast at the fixed b_target tier
    (does PQT training make the model more tolerant than plain training?). Each model's same
    layers are also cast to every format of CAST_SWEEP in turn (from the trained weights).
    Returns (cast rows {label: {val_loss_before, val_loss_after, delta, tier_share, tiers,
    sweep_delta: {"e3m4": val loss change, ...}}},
    bitwidth {label: Figure 5 statistics of the learned b_t, gaussws.bitwidth_stats}); the first
    GaussWS run's per-layer b_t is drawn to `png` (mean, +-std, min-max)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows, bits, drawn = {}, {}, False
    for label, d in run_dirs:
        model, c, val = load_run(d, device)
        before = val()
        if c["method"] == "bf16":
            g.apply_pqt(model, parts=c["parts"], b_init=c["b_target"], b_target=c["b_target"])
            model.eval()
            tiers = f"fixed b_target {c['b_target']:g}"
        else:
            stats = g.bitwidth_stats(model)
            bits[label] = dict(method=c["method"], layers={k: v for k, v in stats.items() if k != "all"},
                               **{k: stats["all"][k] for k in ("mean", "std", "min", "max", "share_le5",
                                                             "share_le9", "share_le12")})
            tiers = "learned b_t"
            if png and c["method"] == "gaussws" and not drawn:
                _plot_bitwidth(stats, png, f"{label}: learned b_t per layer (paper A Figure 5)")
                drawn = True
        layers = [layer for _, layer in g.pqt_layers(model)]
        w0 = [layer.weight.detach().clone() for layer in layers]
        sweep = {}
        for e, mb in CAST_SWEEP:
            with torch.no_grad():
                for layer, w in zip(layers, w0):
                    layer.weight.copy_(cast_tiles(w, e, mb))
            sweep[f"e{e}m{mb}"] = val() - before
        with torch.no_grad():
            for layer, w in zip(layers, w0):
                layer.weight.copy_(w)
        share = cast_to_tiers(model)
        after = val()
        rows[label] = dict(val_loss_before=before, val_loss_after=after, delta=after - before,
                           tier_share=share, tiers=tiers, sweep_delta=sweep)
        print(f"[cast] {label} ({tiers}): val loss {before:.4f} -> {after:.4f} ({after - before:+.4f}); "
              + ", ".join(f"{k} {v:.1%}" for k, v in share.items() if v)
              + "; every tile at " + ", ".join(f"{k} {v:+.4f}" for k, v in sweep.items()))
        del model
    return rows, bits


def _plot_bitwidth(stats, png, title):
    """Paper A Figure 5: per PQT layer (in model order) the mean learned b_t with +-std (thick)
    and min-max (thin) bars, and the Table C tier limits 5/9/12 bits."""
    plt = _pyplot()
    if plt is None:
        return
    names = [k for k in stats if k != "all"]
    x = range(len(names))
    mean = [stats[k]["mean"] for k in names]
    fig, ax = plt.subplots(figsize=(max(6, 0.25 * len(names)), 4))
    ax.errorbar(x, mean, yerr=[[m - stats[k]["min"] for m, k in zip(mean, names)],
                               [stats[k]["max"] - m for m, k in zip(mean, names)]],
                fmt="none", ecolor="gray", elinewidth=0.8, capsize=2, label="min-max")
    ax.errorbar(x, mean, yerr=[stats[k]["std"] for k in names], fmt="o", ms=3, elinewidth=2.5,
                label="mean +- std")
    for lim in (5, 9, 12):
        ax.axhline(lim, ls=":", lw=0.8, color="k")
    a = stats["all"]
    ax.set_title(title + f"\nparams at <=5 / <=9 / <=12 bits: {a['share_le5']:.1%} / {a['share_le9']:.1%} / "
                 f"{a['share_le12']:.1%}", fontsize=9)
    ax.set_xticks(list(x))
    ax.set_xticklabels([k.replace("blocks.", "") for k in names], rotation=90, fontsize=6)
    ax.set_ylabel("b_t (bits)")
    _finish(plt, fig, ax, png)


def _plot_cast(cast, png):
    """Experiment 5: val-loss change after casting every PQT tile to each CAST_SWEEP format, one
    line per run label (the mean over its seeds, labels "<run> s<seed>"), log scale."""
    plt = _pyplot()
    rows = {k: v for k, v in cast.items() if v.get("sweep_delta")}
    if plt is None or not rows:
        return
    by_run = {}
    for label, row in rows.items():
        by_run.setdefault(label.rsplit(" s", 1)[0], []).append(row["sweep_delta"])
    fig, ax = plt.subplots(figsize=(7, 4))
    for run, sweeps in by_run.items():
        fmts = list(sweeps[0])
        ax.plot(fmts, [max(sum(s[f] for s in sweeps) / len(sweeps), 1e-5) for f in fmts], marker="o",
                label=f"{run} ({len(sweeps)} seeds)")
    ax.set_yscale("log")
    ax.set_xlabel("format of every PQT tile (per-tile power-of-two scale)")
    ax.set_ylabel("val loss increase (mean over seeds; floor 1e-5)")
    ax.set_title("Experiment 5: cast after training")
    _finish(plt, fig, ax, png)


# ---------------------------------------------------------------------------------------------
# plots from the result JSON files (no GPU needed: `python bench.py --only plots`)

def _bars(ax, labels, values, title, unit):
    ax.barh(range(len(labels)), values, color="tab:blue")
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.3g}", va="center", fontsize=7)
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)


def plot_results(paths):
    """PNG next to each result JSON (results/<gpu>_<date>_<section>.json -> .png): optim (step
    time per optimizer, bandwidth floor), train (Table 1 overhead vs BF16), memory (bytes/param per training-state part), noise
    (eq. 3 forward time per shape), ddp (1 vs N GPU loss curves), quality (final val loss per run
    and seed, the curves when the JSON has them, and the Figure 5 bitwidth chart).
    Returns the PNG paths written."""
    plt = _pyplot()
    if plt is None:
        return []
    out = []
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        stem = path[:-5]
        section = os.path.basename(stem).rsplit("_", 1)[-1]   # <gpu>_<date>_<section>, or quality.json
        if section not in ("optim", "memory", "noise", "train", "ddp", "quality"):
            print(f"(no plot for {path}: the file name must end in _<section>.json, section one of "
                  "optim, memory, noise, train, ddp, quality)")
            continue
        title = f"{r.get('gpu', '')} {r.get('date', '')}: {r.get('command', '')}"[:110]
        fig = None
        if section == "optim":
            cases = list(dict.fromkeys(x["case"] for x in r["rows"]))
            fig, axs = plt.subplots(len(cases), 1, figsize=(8, 2.2 * len(cases)), squeeze=False)
            for ax, case in zip(axs[:, 0], cases):
                rows = [x for x in r["rows"] if x["case"] == case and "reference" not in x["optimizer"]]
                _bars(ax, [f"{x['optimizer']} ({x['state_bytes_per_param']:.2f} B/param)" for x in rows],
                      [x["ms"] for x in rows], case, "step time, ms")
                for x in rows:
                    ax.axvline(x["floor_ms"], ls=":", lw=0.8, color="k")
        elif section == "memory":
            fig, ax = plt.subplots(figsize=(8, 3.5))
            labels = [f"{x['method']} {x['memory']} {x['optim']}" for x in r["rows"]]
            left = [0.0] * len(labels)
            for part in r["rows"][0]["measured_B_per_param"]:
                v = [x["measured_B_per_param"][part] for x in r["rows"]]
                ax.barh(range(len(labels)), v, left=left, label=part)
                left = [a + b for a, b in zip(left, v)]
            ax.set_yticks(range(len(labels)))
            ax.set_yticklabels(labels, fontsize=7)
            ax.invert_yaxis()
            ax.set_xlabel(f"training-state bytes per parameter ({r['preset']})")
            ax.legend(fontsize=7)
        elif section == "noise":
            fig, ax = plt.subplots(figsize=(7, 4))
            shapes = [x["shape"] for x in r["rows"]]
            for k, name in (("eager", "eager torch"), ("compiled", "torch.compile"), ("bm", "Box-Muller"),
                            ("ours", "ours 3-step"), ("fused", "ours fused"), ("floor", "bandwidth floor")):
                ax.plot(shapes, [x[k] * 1e3 for x in r["rows"]], marker="o", label=name)
            ax.set_yscale("log")
            ax.set_ylabel("eq. 3 forward, us")
            ax.legend(fontsize=7)
        elif section == "train":
            fig, ax = plt.subplots(figsize=(8, 4.5))
            rows = [x for x in r["rows"] if x["method"] != "bf16"]
            _bars(ax, [f"{x['model']} {x['optim']} {x['method']}" for x in rows],
                  [x["overhead_pct"] for x in rows], "Table 1: tokens/s overhead vs BF16 (same model, optimizer)",
                  "overhead, %")
        elif section == "ddp":
            fig, ax = plt.subplots(figsize=(7, 4))
            ax.plot(r["one"]["step_loss"], lw=1, label="1 GPU (grad_accum 2)")
            ax.plot(r["many"]["step_loss"], lw=1, label=f"{r['nproc']} GPUs (DDP)")
            ax.set_xlabel("step")
            ax.set_ylabel("training loss")
            ax.legend(fontsize=7)
        elif section == "quality":
            exps = r["experiments"]
            fig, axs = plt.subplots(len(exps), 1, figsize=(8, 1.2 + 0.45 * sum(len(e) for e in exps.values())),
                                    squeeze=False)   # one experiment: still a list of axes
            for ax, (exp, rows) in zip(axs[:, 0], exps.items()):
                labels = list(rows)
                for i, lab in enumerate(labels):
                    vals = [v for v in rows[lab]["final_val_loss"] if v is not None]
                    ax.scatter(vals, [i] * len(vals), color="tab:blue", s=14)
                    if rows[lab]["mean"] is not None:
                        ax.scatter([rows[lab]["mean"]], [i], marker="|", s=200, color="k")
                ax.set_yticks(range(len(labels)))
                ax.set_yticklabels(labels, fontsize=7)
                ax.invert_yaxis()
                ax.set_title(f"{exp}: final val loss per seed (| = mean)", fontsize=9)
                ax.grid(axis="x", alpha=0.3)
                if exp == "zeropoint":
                    ax.set_xscale("log")
                if any(row.get("curves") for row in rows.values()):
                    _plot_quality(exp, rows, f"{stem}_{exp}.png", train_loss=exp == "zeropoint")
                    out.append(f"{stem}_{exp}.png")
            if any(v.get("sweep_delta") for v in (r.get("cast") or {}).values()):
                _plot_cast(r["cast"], f"{stem}_cast.png")
                out.append(f"{stem}_cast.png")
            for label, b in (r.get("bitwidth") or {}).items():
                if b["method"] == "gaussws":
                    stats = dict(b["layers"], all={k: b[k] for k in ("share_le5", "share_le9", "share_le12")})
                    _plot_bitwidth(stats, f"{stem}_bitwidth.png", f"{label}: learned b_t per layer (paper A Figure 5)")
                    out.append(f"{stem}_bitwidth.png")
                    break
        if fig is None:
            continue
        fig.suptitle(title, fontsize=7)
        fig.tight_layout()
        fig.savefig(stem + ".png", dpi=110)
        plt.close(fig)
        out.append(stem + ".png")
        print("wrote", stem + ".png")
    return out


def save(section, result, path=None):
    """Write a section's result as JSON: `path`, default results/<gpu>_<date>_<section>.json."""
    gpu = torch.cuda.get_device_name().replace(" ", "-") if torch.cuda.is_available() else "cpu"
    date = datetime.date.today().isoformat()
    path = path or f"results/{gpu}_{date}_{section}.json"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:   # a result's own "command" (the full command line) wins
        json.dump({"gpu": gpu, "date": date, "torch": torch.__version__, "triton": triton.__version__,
                   "command": f"python bench.py --only {section}", **result}, f, indent=1)
    print("wrote", path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["optim", "noise", "train", "memory", "ddp", "quality", "plots"],
                    default=None, help="run one section (default: all but ddp and quality)")
    ap.add_argument("--dataset", default="stdlib", help="--only ddp/quality: train.py's --dataset")
    ap.add_argument("--iters", type=int, default=None,
                    help="--only ddp: training steps (default 300); --only quality: train.py --max_iters "
                         "instead of --tokens_per_param")
    ap.add_argument("--preset", default="small", help="--only quality: model preset")
    ap.add_argument("--tokens_per_param", type=float, default=20, help="--only quality: run length")
    ap.add_argument("--experiments", default=",".join(QUALITY),
                    help=f"--only quality: comma list of {','.join(QUALITY)} (pqt adds the Table C cast "
                         "and the Figure 5 chart)")
    ap.add_argument("--seeds", default="0,1", help="--only quality: comma list of seeds")
    ap.add_argument("--jobs", type=int, default=1,
                    help="--only quality: concurrent train.py subprocesses (spread over visible GPUs); "
                         "1 = train in this process")
    ap.add_argument("--train_args", default="",
                    help='--only quality: extra train.py flags for every run, e.g. "--batch_size 32 --block_size 256"; '
                         'a single flag needs the = form: --train_args=--no-compile')
    ap.add_argument("--out_dir", default=None,
                    help="--only quality: run folders and plots; default results/quality_[cpu_]<preset>")
    ap.add_argument("--resume", action="store_true",
                    help="--only quality: runs with a checkpoint in --out_dir continue (finished ones are reused)")
    ap.add_argument("--quick", action="store_true", help="skip the slow reference rows")
    ap.add_argument("--compile", action="store_true", help="--only train: torch.compile each model (slow to start)")
    args = ap.parse_args()
    if args.only == "plots":
        import glob
        plot_results(sorted(glob.glob(os.path.join("results", "*.json"))))
        return
    if args.only == "quality":
        exps = [x for x in args.experiments.split(",") if x]
        bad = [x for x in exps if x not in QUALITY]
        if bad or not exps:
            ap.error(f"--experiments {args.experiments!r}: unknown {', '.join(bad) or '(empty)'}; "
                     f"allowed: comma list of {', '.join(QUALITY)}")
        try:
            seeds = [int(x) for x in args.seeds.split(",")]
        except ValueError:
            ap.error(f"--seeds {args.seeds!r}: must be a comma list of integers >= 0, e.g. 0,1")
        if min(seeds) < 0 or len(set(seeds)) != len(seeds):
            ap.error(f"--seeds {args.seeds!r}: must be distinct integers >= 0 (each seed is one run folder)")
        if args.jobs < 1:
            ap.error(f"--jobs {args.jobs}: must be an integer >= 1")
        if args.iters is not None and args.iters < 1:
            ap.error(f"--iters {args.iters}: must be an integer >= 1 (steps per run)")
        managed = {"--max_iters": "--iters", "--tokens_per_param": "--tokens_per_param", "--seed": "--seeds",
                   "--method": "--experiments", "--optim": "--experiments", "--out_dir": "--out_dir",
                   "--resume": "--resume", "--preset": "--preset", "--dataset": "--dataset"}
        try:
            train_tokens = shlex.split(args.train_args)
        except ValueError as e:
            ap.error(f"--train_args {args.train_args!r}: {e} (quote it as one shell word)")
        for tok in train_tokens:
            flag = tok.split("=")[0]
            if flag in managed:
                ap.error(f"--train_args {args.train_args!r}: {flag} is set per run by bench.py; "
                         f"use bench.py's {managed[flag]}")
    elif not torch.cuda.is_available():   # --only quality is training runs: CPU works (slowly)
        raise SystemExit(f"bench.py {'--only ' + args.only if args.only else '(all sections)'} needs a CUDA "
                         "GPU; --only quality and --only plots also run on CPU (the tests cover correctness on CPU)")
    if args.only in (None, "optim"):
        res = dict(check=check_optim_gpu(), **bench_optim(args.quick))
        save("optim", res)
    if args.only in (None, "noise"):
        check_noise_gpu()
        save("noise", dict(rows=bench_noise()))
    if args.only in (None, "memory"):
        save("memory", bench_memory())
    if args.only in (None, "train"):
        save("train", bench_train(compile=args.compile,
                                  on_row=lambda rows: save("train", dict(rows=rows, partial=True))))
    if args.only == "quality":
        length = ["--max_iters", str(args.iters)] if args.iters else ["--tokens_per_param", str(args.tokens_per_param)]
        out_dir = args.out_dir or f"results/quality_{'' if torch.cuda.is_available() else 'cpu_'}{args.preset}"
        res = bench_quality(["--preset", args.preset, "--dataset", args.dataset, *length, *shlex.split(args.train_args)],
                            seeds=seeds, out_dir=out_dir, experiments={k: QUALITY[k] for k in exps},
                            jobs=args.jobs, resume=args.resume,
                            command="python bench.py " + shlex.join(sys.argv[1:]))
        # an explicit --out_dir keeps its JSON there; the default goes to results/ by GPU and date
        save("quality", res, os.path.join(args.out_dir, "quality.json") if args.out_dir else None)
        if res["failed_runs"]:
            raise SystemExit(f"{len(res['failed_runs'])} quality run(s) failed: {', '.join(res['failed_runs'])}")
    if args.only == "ddp":
        if torch.cuda.device_count() < 2:
            raise SystemExit("--only ddp needs 2 GPUs")
        save("ddp", bench_ddp(["--preset", "gpt2-124m", "--dataset", args.dataset, "--batch_size", "16",
                               "--grad_accum", "2", "--max_iters", str(args.iters or 300), "--eval_interval", "50",
                               "--eval_windows", "64", "--no-plot"]))


if __name__ == "__main__":
    main()
