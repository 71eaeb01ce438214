"""
Speed benchmarks on one GPU (two for ddp). Every figure is a median of triton.testing.do_bench
(CUDA events, launch overhead included) measured in the same run as its baselines, reported as
ratios. Each section prints one table and writes one JSON, results/<gpu>_<date>_<section>.json.

    python bench.py                 # optim, noise, memory, train
    python bench.py --only optim    # 4-bit AdamW step (paper B) vs torch AdamW, bandwidth floor
    python bench.py --only host     # CPU: the 4-bit step's Python work per call (no GPU needed)
    python bench.py --only noise    # GaussWS noise kernels (paper A, Figure 6)
    python bench.py --only memory   # bytes/param of the training state, measured vs arithmetic
    python bench.py --only train    # GPT-2-124M compiled: bf16 vs GaussWS vs plain-PyTorch eq. 3
    python bench.py --only train --table1 --compile   # + paper A Table 1 (llama-134m ... 70b-4l)
    python bench.py --only train --table1 --compile --no-gpt2 --models llama-1b   # one Table 1 row
    python bench.py --only train --table1 --compile blocks --no-gpt2   # Table 1, each block compiled
    python bench.py --only ddp --dataset D   # 2 GPUs (torchrun) vs 1 GPU, same global batch
    python bench.py --only fsdp              # train.py --fsdp under torchrun vs the plain path, same GPU, compiled
                                             # (GPT-2's tokenizer: tiktoken's files, or TIKTOKEN_CACHE_DIR offline)
    python bench.py --only fsdp --eager      # the same with train.py --no-compile
    python bench.py --only fsdp --train_args "--batch_size 32 --grad_accum 1"   # other train.py flags

The paper-reproduction runs and the figures live in experiments.py; these two run its code:

    python bench.py --only quality --dataset D --preset small   # = python experiments.py quality ...
    python bench.py --only plots                                # = python experiments.py plots

The kernels' correctness on the GPU (bit-identity with the reference, the noise law) is checked
by test_all.py's GPU-only tests: TRITON_INTERPRET=0 python -m pytest -q test_all.py -k gpu
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
import time

import torch
import triton

import adam4bit as A
import gaussws as g


# ---------------------------------------------------------------------------------------------
# timing, bandwidth and power

def median_ms(fn, warmup=25, rep=100, graph=False):
    """Median ms of fn (CUDA events); graph=True replays a CUDA graph (GPU time only)."""
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def host_ms(fn, rep=50):
    """Median CPU time (ms) of one fn() call started with the GPU idle: the host cost of launching
    it, which a step shorter than that cannot hide."""
    times = []
    for _ in range(rep):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return sorted(times)[rep // 2]


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
    readings are not available. Why: a memory-bound optimizer step can run the GPU at its board
    power cap, so its time also depends on the energy each step spends, not only on bytes."""
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
    import train as trainer
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
            state = trainer.optimizer_state_bytes(opt)
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
    tensors; the kernel launches and torch's fused AdamW are replaced by no-ops, and the FP32-state
    tensors take the CUDA branch of _adamw_fp32_steps (FP32 parameters: one fused call; 16-bit
    ones: one _adamw_kernel launch), so what is timed is the bookkeeping that the GPU step's host
    time is made of besides the launches."""
    os.environ["TRITON_INTERPRET"] = "1"
    kernels, fused, devices = (A._adamw4bit_kernel, A._adamw_kernel), torch._fused_adamw_, A._FUSED_ADAMW_DEVICES

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kw: None

    A._adamw4bit_kernel, A._adamw_kernel, torch._fused_adamw_ = NoLaunch(), NoLaunch(), lambda *args, **kw: None
    A._FUSED_ADAMW_DEVICES = devices + ("cpu",)
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
        (A._adamw4bit_kernel, A._adamw_kernel), torch._fused_adamw_, A._FUSED_ADAMW_DEVICES = kernels, fused, devices
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
    bt = 3 + 5 * torch.rand(g.tile_grid(m, n), device="cuda")
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
        ours = lambda: g._apply_triton(w, g._generate_triton(m, n, seed, "gaussws"), pow2, seed, "gaussws", BF16, False)
        fused = lambda: g._apply_triton(w, None, pow2, seed, "gaussws", BF16, True)
        bm = lambda: g._apply_triton(w, g._generate_triton(m, n, seed, "bm"), pow2, seed, "gaussws", BF16, False)
        dq = lambda: g._apply_triton(w, g._generate_triton(m, n, seed, "diffq"), pow2, seed, "diffq", BF16, False)
        bwd = lambda: g._grad_triton(gg, g._generate_triton(m, n, seed, "gaussws"), tmax, seed, "gaussws", torch.float32, False)
        bwdf = lambda: g._grad_triton(gg, None, tmax, seed, "gaussws", torch.float32, True)
        packed = g._generate_triton(m, n, seed, "gaussws")
        comp(w, bt)  # compile outside the timing
        r = dict(shape=f"{m}x{n}", eager=_time(lambda: torch_eq3(w, bt)), compiled=_time(lambda: comp(w, bt)),
                 bm=_time(bm), ours=_time(ours), fused=_time(fused), diffq=_time(dq),
                 floor=m * n * 7 / bw * 1e3, ours_g=_time(ours, True), fused_g=_time(fused, True),
                 comp_g=_time(lambda: comp(w, bt), True), bwd=_time(bwd), bwd_f=_time(bwdf),
                 gen=_time(lambda: g._generate_triton(m, n, seed, "gaussws")), bm_g=_time(bm, True),
                 apply=_time(lambda: g._apply_triton(w, packed, pow2, seed, "gaussws", BF16, False)),
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


# ---------------------------------------------------------------------------------------------
# train: paper A Table 1 (tokens/s and peak memory of BF16 / GaussWS / DiffQ), and memory

TABLE1 = [("llama-134m", 24), ("llama-1b", 8), ("llama-3b", 2), ("llama-70b-4l", 2)]  # x 2048 tokens


def _train_setup(preset, method, optim, batch, T, device, compile=True, memory="save", param_dtype="fp32",
                 master_weight_bits=None):
    """Model (preset, PQT method on [all]; parameters in param_dtype "fp32"|"bf16"), optimizer
    (train.py's) and one training step closure on random tokens (throughput does not depend on
    the data). compile: False, True (the whole model, as train.py) or "blocks" (each transformer
    block, the embeddings, final norm, LM head and loss eager)."""
    import train as trainer
    from model import GPT, preset_config
    torch.manual_seed(0)
    with device:        # initialise on the GPU: a CPU init of a 3B model takes longer than its benchmark
        model = GPT(preset_config(preset, block_size=T))
    if method != "bf16":
        g.apply_pqt(model, method=method, parts="all", memory=memory)
    if param_dtype == "bf16":
        trainer.params_to_bf16(model)
    args = argparse.Namespace(optim=optim, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                              weight_decay=0.1, bits_wd=0.0, seed=0, param_rounding="rtn",
                              master_weight_bits=master_weight_bits)
    opt = trainer.build_optimizer(args, model, device.type)
    fwd = torch.compile(model) if compile is True else model
    if compile == "blocks":  # regional compilation: Dynamo compiles Block.forward once, all blocks reuse it
        for block in model.blocks:
            block.compile()
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
                steps=20, T=2048, device="cuda", compile=False, rounds=1, on_row=None):
    """Paper A Table 1: step time (on CUDA: `steps` steps queued back to back, as train.py runs
    them; on CPU the median step) -> tokens/s and peak memory per (model, optimizer,
    method), overhead vs BF16 and its geometric mean over models (paper: 3.14 % GaussWS,
    22.34 % DiffQ with AdamW on an A100). Each (model, optimizer) runs its methods in `rounds`
    interleaved rounds (bf16, gaussws, ..., bf16, gaussws, ...), each model built again per round
    (compiled ones then come from the compile cache): the GPU's clock drifts between runs, so a
    row's overhead is the mean over rounds of 1 − (BF16 step time / its step time) in the same
    round. On CUDA the last round also profiles 3 steps: GPU ms and operations per step. Eager by
    default: compiling 24 models of up to 4B parameters takes longer than measuring them.
    on_row(rows): called after each (model, optimizer) (main saves the partial table, so a run
    stopped by a time limit keeps what it measured)."""
    device = torch.device(device)
    rows = []
    for preset, batch in cases:
        for optim in optims:
            ms, peak, gpu = {m: [] for m in methods}, {m: 0.0 for m in methods}, {m: (None, None) for m in methods}
            for rnd in range(rounds):
                for method in methods:
                    model, opt, step = _train_setup(preset, method, optim, batch, T, device, compile)
                    params = model.num_params()
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    for _ in range(3):                           # compile and warm up
                        step()
                    if device.type == "cuda":
                        ms[method].append(_queued_steps_ms(step, steps))
                        peak[method] = max(peak[method], torch.cuda.max_memory_allocated() / 2 ** 30)
                        if rnd == rounds - 1:    # kernel time apart from the step time: GPU or host?
                            gpu[method] = _gpu_profile(step)
                    else:
                        times = []
                        for _ in range(steps):
                            t = datetime.datetime.now()
                            step()
                            times.append((datetime.datetime.now() - t).total_seconds() * 1e3)
                        ms[method].append(sorted(times)[len(times) // 2])
                        peak[method] = float("nan")
                    print(f"{preset:14s} B={batch:<3d} {optim:6s} {method:8s} round {rnd}: {ms[method][-1]:9.2f} ms",
                          flush=True)
                    del model, opt, step
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            for method in methods:
                ov = [100 * (1 - b / m) for b, m in zip(ms[methods[0]], ms[method])]
                med = statistics.median(ms[method])
                rows.append(dict(model=preset, params=params, batch=batch, T=T, optim=optim, method=method,
                                 compiled=compile, step_ms=med, step_ms_rounds=ms[method],
                                 tokens_per_s=batch * T / (med * 1e-3), peak_GiB=peak[method],
                                 gpu_ms_per_step=gpu[method][0], gpu_ops_per_step=gpu[method][1],
                                 overhead_pct=statistics.mean(ov),
                                 overhead_pct_rounds=ov,
                                 command=f"python bench.py --only train  # {preset} {method} {optim}"))
                r = rows[-1]
                print(f"{preset:14s} B={batch:<3d} {optim:6s} {method:8s} {med:9.2f} ms {r['tokens_per_s']:12,.0f} "
                      f"tok/s {r['peak_GiB']:7.2f} GiB overhead {r['overhead_pct']:6.2f} % "
                      f"(rounds: {' / '.join(f'{o:+.2f}' for o in ov)})"
                      + (f", GPU {gpu[method][0]:.2f} ms in {gpu[method][1]:.0f} ops a step" if gpu[method][0] is not None else ""),
                      flush=True)
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


class TorchEq3Linear(torch.nn.Linear):
    """The plain-PyTorch GaussWS layer a user would write (the baseline of `bench_train_gpt2`):
    eq. 3 with R = round(N(0,1)/2) from torch.randn, the tile max as a reshape + amax, the scale
    broadcast by repeat_interleave, b_t = b_target + b_i·(b_init − b_target) learnable (eq. 11),
    autograd for eq. 4 (the tile max detached, as eq. 4 treats it). Needs m, n multiples of 32."""

    def __init__(self, lin, b_init=6.0, b_target=4.0):
        super().__init__(lin.in_features, lin.out_features, bias=lin.bias is not None,
                         device=lin.weight.device, dtype=lin.weight.dtype)
        self.weight, self.bias = lin.weight, lin.bias
        self.b_init, self.b_target = b_init, b_target
        self.b_i = torch.nn.Parameter(torch.ones(g.tile_grid(*lin.weight.shape), device=lin.weight.device))

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        w = self.weight
        m, n = w.shape
        tmax = w.detach().abs().view(m // 32, 32, n // 32, 32).amax(dim=(1, 3))
        b_t = (self.b_target + self.b_i * (self.b_init - self.b_target)).clamp(1, 24)
        scale = (tmax * torch.exp2(1 - b_t)).repeat_interleave(32, 0).repeat_interleave(32, 1)
        w_hat = w + torch.round(torch.randn_like(w) * 0.5) * scale
        return torch.nn.functional.linear(x, w_hat, self.bias)       # autocast casts w_hat to BF16


def torch_eq3_pqt(model):
    """Every block linear of `model` (the parts apply_pqt would take) -> TorchEq3Linear."""
    for block in model.blocks.modules():
        for name, child in list(block.named_children()):
            if name in g.ALL_PARTS and type(child) is torch.nn.Linear:
                setattr(block, name, TorchEq3Linear(child))


# name -> model surgery; each is timed against "bf16" (no surgery) in the same process
TRAIN_VARIANTS = {"bf16": lambda model: None,
                  "gaussws": lambda model: g.apply_pqt(model, parts="all"),
                  "torch eq.3": torch_eq3_pqt}


def _queued_steps_ms(step, n):
    """ms per step of n steps queued back to back, one wait at the end: how train.py runs (it reads
    a step's loss and grad norm only after the next step is queued), so the host prepares step k + 1
    while the GPU runs step k, and host time costs only where the host falls behind the GPU."""
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(n):
        step()
    t1.record()
    t1.synchronize()
    return t0.elapsed_time(t1) / n


def _device_ops(events):
    """The GPU operations (kernels, copies, memsets) among profiler events: not the ranges that
    record_function puts on the GPU timeline too (e.g. torch's "Optimizer.step#AdamW.step", which
    spans the optimizer's kernels and would count them twice)."""
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation]


def _gpu_profile(step, n=3):
    """torch.profiler over n steps: (GPU ms per step = summed kernel/memcpy/memset time, GPU
    operations per step)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    dev = _device_ops(prof.events())
    return sum(e.time_range.elapsed_us() for e in dev) / 1e3 / n, len(dev) / n


def bench_train_gpt2(variants=TRAIN_VARIANTS, modes=("default",), pairs=2, steps=30, batch=16, T=1024,
                     preset="gpt2-124m"):
    """GaussWS at the training level: GPT-2-124M, batch 16 × 1024, BF16 autocast, torch.compile
    (each mode of `modes`), fused AdamW, gradient clipping, one micro-step per optimizer step;
    every variant (model surgery of `variants`, "bf16" = none) is built and compiled once, then
    timed in `pairs` interleaved rounds in this one process, so the ratios to bf16 are not moved
    by the machine between runs. Step time: `steps` steps queued back to back (`_queued_steps_ms`,
    as train.py runs); "synced": the median of `steps` steps each waited for, where the GPU idles
    while the host starts the next step. Per variant also: host ms per step (the step() call
    started with the GPU idle, without waiting for it), and from torch.profiler the GPU time and
    GPU operations per step."""
    import train as trainer
    from model import GPT, preset_config
    device = torch.device("cuda")
    args = argparse.Namespace(optim="adamw", lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                              weight_decay=0.1, bits_wd=0.0, seed=0)
    x = torch.randint(0, 50304, (batch, T), device=device)
    y = torch.randint(0, 50304, (batch, T), device=device)
    runs = {}
    for mode in modes:
        for name, surgery in variants.items():
            torch.manual_seed(0)
            with device:
                model = GPT(preset_config(preset, block_size=T))
            surgery(model)
            opt = trainer.build_optimizer(args, model, "cuda")
            fwd = torch.compile(model, mode=mode)
            graphs = "reduce-overhead" in mode

            def step(model=model, opt=opt, fwd=fwd, graphs=graphs):
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    _, loss = fwd(x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            for _ in range(3):                                   # compile, record, warm up
                step()
            torch.cuda.synchronize()
            runs[(mode, name)] = dict(step=step, model=model, ms=[], synced=[], host=[])
            print(f"  built {name} ({mode})", flush=True)
    for _ in range(pairs):
        for key, r in runs.items():
            r["ms"].append(_queued_steps_ms(r["step"], steps))
            times, host = [], []
            for _ in range(steps):      # one step at a time: the host's time is exposed
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
                h = time.perf_counter()
                r["step"]()
                host.append((time.perf_counter() - h) * 1e3)
                t1.record()
                t1.synchronize()
                times.append(t0.elapsed_time(t1))
            r["synced"].append(statistics.median(times))
            r["host"].append(statistics.median(host))
    rows = []
    for (mode, name), r in runs.items():
        gpu_ms, ops = _gpu_profile(r["step"])
        base = runs[(mode, "bf16")]
        ov = [100 * (a / b - 1) for a, b in zip(r["ms"], base["ms"])]
        ov_synced = [100 * (a / b - 1) for a, b in zip(r["synced"], base["synced"])]
        rows.append(dict(model=preset, params=r["model"].num_params(), batch=batch, T=T, optim="adamw",
                         method=name, mode=mode, compiled=True, step_ms_pairs=r["ms"],
                         step_ms=statistics.median(r["ms"]), tokens_per_s=batch * T / statistics.median(r["ms"]) * 1e3,
                         tokens_per_s_pairs=[batch * T / m * 1e3 for m in r["ms"]],
                         overhead_pct=statistics.mean(ov), overhead_pct_pairs=ov,
                         synced_step_ms_pairs=r["synced"], synced_overhead_pct_pairs=ov_synced,
                         host_ms_per_step=statistics.median(r["host"]), gpu_ms_per_step=gpu_ms,
                         gpu_ops_per_step=ops,
                         command=f"python bench.py --only train  # {preset} {name} mode={mode}"))
    print(f"\n{preset}, batch {batch} x {T}, BF16 autocast, compiled, fused AdamW, 1 micro-step/step; "
          f"{pairs} interleaved rounds of {steps} steps queued back to back (then {steps} synced steps, median)")
    print(f"{'variant':22s} {'mode':16s} {'tokens/s per round':>26s} {'step time vs bf16':>18s} "
          f"{'synced step vs bf16':>20s} {'host ms':>8s} {'GPU ms':>8s} {'GPU ops':>8s}")
    for r in rows:
        tps = " / ".join(f"{t:,.0f}" for t in r["tokens_per_s_pairs"])
        ovs = " / ".join(f"{o:+.2f}" for o in r["overhead_pct_pairs"])
        ovs_synced = " / ".join(f"{o:+.2f}" for o in r["synced_overhead_pct_pairs"])
        print(f"{r['method']:22s} {r['mode']:16s} {tps:>26s} {ovs + ' %':>18s} {ovs_synced + ' %':>20s} "
              f"{r['host_ms_per_step']:8.2f} {r['gpu_ms_per_step']:8.2f} {r['gpu_ops_per_step']:8.0f}")
    for r in runs.values():
        del r["step"], r["model"]
    torch.cuda.empty_cache()
    return dict(rows=rows)


def bench_memory(preset="gpt2-124m", T=1024, batch=4, device="cuda"):
    """Bytes/param of the training state: weights, grads, optimizer states, and the BF16 copies of
    the block linears' weights saved for backward (w_hat for GaussWS/DiffQ with memory="save";
    under BF16 autocast plain training saves its cast weights just the same), measured on real
    tensors after a step, beside the arithmetic 4 + 4 + {8 | 1.0625 on eligible tensors, 8 on
    others} + 2 per block-linear param (0 for memory="recompute")."""
    import train as trainer
    device = torch.device(device)
    rows = []
    cases = [(method, memory, optim, "fp32", None) for method, memory in (
        ("bf16", "save"), ("gaussws", "save"), ("gaussws", "recompute"), ("diffq", "save"))
        for optim in ("adamw", "zipsr")]
    cases += [("bf16", "save", "zipsr", "bf16", None), ("bf16", "save", "zipsr", "bf16", 24)]
    for method, memory, optim, pdt, mwb in cases:
        model, opt, step = _train_setup(preset, method, optim, batch, T, device, compile=False,
                                        memory=memory, param_dtype=pdt, master_weight_bits=mwb)
        step(zero=False)                                   # grads stay for the count
        ps = list(model.parameters())
        n = sum(p.numel() for p in ps)
        # BF16 copies of the block linears' weights kept for backward: w_hat for GaussWS/DiffQ
        # in "save" mode, autocast's cast for BF16 (F.linear saves the transposed view)
        lins = [m for m in model.blocks.modules() if isinstance(m, torch.nn.Linear)]
        n_lin = sum(m.weight.numel() for m in lins)
        shapes = {s for m in lins for s in (tuple(m.weight.shape), tuple(m.weight.shape)[::-1])}
        saved = []
        param_storage = {p.untyped_storage().data_ptr() for p in ps}

        def pack(t):
            # (with BF16 parameters F.linear saves the weight itself: not a copy)
            if t.dtype == torch.bfloat16 and tuple(t.shape) in shapes and \
                    t.untyped_storage().data_ptr() not in param_storage:
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
        state = 8 * n if optim == "adamw" else 1.0625 * elig + 8 * (n - elig) + (n if mwb else 0)
        w = 2 if pdt == "bf16" else 4
        # with BF16 parameters autocast saves the weights themselves: no extra copy
        arith = dict(weights=w * n, grads=w * n, optimizer=state,
                     bf16_weights_saved=0 if (method != "bf16" and memory == "recompute") or pdt == "bf16"
                     else 2 * n_lin)
        rows.append(dict(method=method, memory=memory, optim=optim, param_dtype=pdt,
                         master_weight_bits=mwb, params=n,
                         measured_B_per_param={k: v / n for k, v in measured.items()},
                         arithmetic_B_per_param={k: v / n for k, v in arith.items()},
                         total_measured=sum(measured.values()) / n, total_arithmetic=sum(arith.values()) / n))
        r = rows[-1]
        print(f"{method:8s} {memory:9s} {optim:6s} {pdt}{'+mw24' if mwb else '':5s} measured {r['total_measured']:6.3f} B/param "
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
        r = subprocess.run([*launch, os.path.join(here, "train.py"), *train_args, "--out_dir", run_dir,
                            "--overwrite"], env=env, capture_output=True, text=True)
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


FSDP_WARMUP = 10   # bench_fsdp's step time: the median of the steps from this one on


def bench_fsdp(train_args, out_dir="out-fsdp", nproc=1, reps=3, warmup=FSDP_WARMUP, command=None):
    """train.py in one process and train.py --fsdp under torchrun with nproc processes, the same
    flags, interleaved `reps` times (plain, fsdp, plain, fsdp, ...: the GPU's clock drifts between
    runs). A run's step time is the median of its logged step times from step `warmup` on: the
    first steps hold torch.compile's work and the first launches of every Triton kernel
    (train.py's own tokens/s, also kept, skips 5 steps). With nproc = 1 the FSDP2 path must give
    the plain path's numbers: step losses, grad norms and final weights are compared (the DCP
    folder read back with dcp_to_torch_save), beside the plain-vs-plain and fsdp-vs-fsdp
    differences of the same repetitions (the GPU step is not deterministic run to run). Returns
    every run's losses and step time, the per-repetition step-time ratios, their median and mean."""
    import subprocess
    import sys
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    out = {"plain": [], "fsdp": []}
    for rep in range(reps):
        for kind in ("plain", "fsdp"):
            run_dir = os.path.join(out_dir, f"{kind}{rep}")
            launch = [sys.executable] if kind == "plain" else [
                sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
            extra = ["--fsdp"] if kind == "fsdp" else []
            t0 = time.time()
            r = subprocess.run([*launch, os.path.join(here, "train.py"), *train_args, *extra, "--out_dir", run_dir,
                                "--overwrite"], env=env, capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"{kind} run failed:\n{r.stderr[-3000:]}")
            with open(os.path.join(run_dir, "log.jsonl")) as f:
                recs = [json.loads(line) for line in f]
            steps = [x for x in recs if x["type"] == "step"]
            if len(steps) <= warmup:
                raise ValueError(f"{len(steps)} steps: need more than warmup={warmup} (raise --iters)")
            summary = [x for x in recs if x["type"] == "summary"][-1]
            out[kind].append(dict(step_loss=[x["loss"] for x in steps], grad_norm=[x["grad_norm"] for x in steps],
                                  val_loss=[x["val_loss"] for x in recs if x["type"] == "eval"],
                                  step_ms=statistics.median(x["dt_ms"] for x in steps[warmup:]),
                                  first_step_ms=steps[0]["dt_ms"], wall_s=time.time() - t0,
                                  tokens_per_s=summary["tokens_per_s"], peak_mem_mb=summary["peak_mem_mb"]))
            print(f"rep {rep} {kind:5s}: step {out[kind][-1]['step_ms']:.1f} ms (median of steps {warmup}+), "
                  f"step 0 {steps[0]['dt_ms'] / 1000:.1f} s, run {out[kind][-1]['wall_s']:.0f} s", flush=True)

    def weights(kind, rep):
        if kind == "plain":
            return torch.load(os.path.join(out_dir, f"plain{rep}", "ckpt.pt"), map_location="cpu",
                              weights_only=True)["model"]
        dcp_to_torch_save(os.path.join(out_dir, f"fsdp{rep}", "ckpt"), os.path.join(out_dir, f"fsdp{rep}.pt"))
        return torch.load(os.path.join(out_dir, f"fsdp{rep}.pt"), map_location="cpu", weights_only=False)["model"]

    def max_diff(a, b):
        return max(abs(x - y) for x, y in zip(a, b))

    def max_weight_diff(a, b):
        return max((a[k].double() - b[k].double()).abs().max().item() for k in a)

    plain, fsdp = weights("plain", 0), weights("fsdp", 0)
    a, b = out["plain"][0], out["fsdp"][0]
    res = dict(same_keys=sorted(plain) == sorted(fsdp),
               max_abs_weight_diff=max_weight_diff(plain, fsdp),
               max_abs_step_loss_diff=max_diff(a["step_loss"], b["step_loss"]),
               max_abs_grad_norm_diff=max_diff(a["grad_norm"], b["grad_norm"]),
               tokens_per_s={k: [r["tokens_per_s"] for r in v] for k, v in out.items()})
    if reps > 1:   # how far two plain runs drift apart: the scale for the plain-vs-fsdp differences
        res["max_abs_weight_diff_plain_plain"] = max_weight_diff(plain, weights("plain", 1))
    for key in ("step_loss", "grad_norm"):
        res[f"max_abs_{key}_diff_per_rep"] = {
            "plain_fsdp": [max_diff(p[key], f[key]) for p, f in zip(out["plain"], out["fsdp"])],
            "plain_plain": [max_diff(out["plain"][0][key], p[key]) for p in out["plain"][1:]],
            "fsdp_fsdp": [max_diff(out["fsdp"][0][key], f[key]) for f in out["fsdp"][1:]]}
    tp = res["tokens_per_s"]
    # the earlier measure, kept: mean tokens/s (train.py's, steps 5+) of the plain runs over the fsdp runs
    res["fsdp_step_time_vs_plain"] = (sum(tp["plain"]) / len(tp["plain"])) / (sum(tp["fsdp"]) / len(tp["fsdp"])) - 1
    ratios = [f["step_ms"] / p["step_ms"] - 1 for p, f in zip(out["plain"], out["fsdp"])]
    res.update(warmup_steps=warmup, step_time_ratio_per_rep=ratios, step_time_ratio_median=statistics.median(ratios),
               step_time_ratio_mean=sum(ratios) / len(ratios))
    d = res["max_abs_step_loss_diff_per_rep"]
    print(f"FSDP2 x{nproc} vs plain: weights max |d| {res['max_abs_weight_diff']:.3g}"
          + (f" (plain-plain {res['max_abs_weight_diff_plain_plain']:.3g})" if reps > 1 else "")
          + f"; step loss max |d| plain-fsdp {d['plain_fsdp']}, plain-plain {d['plain_plain']}, fsdp-fsdp "
          f"{d['fsdp_fsdp']}; grad norm max |d| (rep 0) {res['max_abs_grad_norm_diff']:.3g}")
    print(f"step ms plain {[round(r['step_ms'], 2) for r in out['plain']]}, fsdp "
          f"{[round(r['step_ms'], 2) for r in out['fsdp']]}: FSDP2 step time per repetition "
          + ", ".join(f"{100 * x:+.2f} %" for x in ratios)
          + f"; median {100 * res['step_time_ratio_median']:+.2f} %, mean {100 * res['step_time_ratio_mean']:+.2f} % "
          f"(mean tokens/s ratio {100 * res['fsdp_step_time_vs_plain']:+.2f} %)")
    return dict(command=command or f"python bench.py --only fsdp  # train.py {' '.join(train_args)}", nproc=nproc,
                reps=reps, train_args=train_args, plain=out["plain"], fsdp=out["fsdp"], **res)


# ---------------------------------------------------------------------------------------------
# result files and command line

def save(section, result, path=None):
    """Write a section's result as JSON: `path`, default results/<gpu>_<date>_<section>.json."""
    gpu = torch.cuda.get_device_name().replace(" ", "-") if torch.cuda.is_available() else "cpu"
    date = datetime.date.today().isoformat()
    path = path or f"results/{gpu}_{date}_{section}.json"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:   # a result's own "command" (the full command line) wins
        json.dump({"gpu": gpu, "date": date, "torch": torch.__version__, "triton": triton.__version__,
                   "command": f"python bench.py --only {section}", **result}, f, indent=1)
    os.replace(path + ".tmp", path)      # atomic: a killed run leaves the previous file whole
    print("wrote", path)


def build_parser():
    import train as trainer
    ap = trainer.OneLineParser(prog="bench.py", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["optim", "host", "noise", "train", "memory", "ddp", "fsdp", "quality",
                                       "plots"],
                    default=None, help="run one section (default: all but ddp and quality); quality and "
                                       "plots run experiments.py's code")
    ap.add_argument("--dataset", default="stdlib", help="--only ddp/fsdp/quality: train.py's --dataset")
    ap.add_argument("--iters", type=int, default=None,
                    help="--only ddp: training steps (default 300); --only fsdp: (default 40); --only quality: train.py --max_iters "
                         "instead of --tokens_per_param")
    ap.add_argument("--quick", action="store_true", help="skip the slow reference rows")
    ap.add_argument("--compile", nargs="?", const="model", choices=["model", "blocks"], default=None,
                    help="--only train --table1: torch.compile each model whole (slow to start: minutes for the "
                         "larger ones), or with 'blocks' each transformer block (compiled once per model, "
                         "reused by all its blocks)")
    ap.add_argument("--table1", action="store_true", help="--only train: also paper A Table 1 (llama-134m ... "
                                                          "70b-4l; eager unless --compile)")
    ap.add_argument("--modes", default="default", help="--only train: torch.compile modes of the GPT-2 comparison, "
                                                       "comma-separated, each of: default, reduce-overhead")
    ap.add_argument("--pairs", type=int, default=2, help="--only train: interleaved rounds of the GPT-2 comparison "
                                                         "and of each Table 1 model")
    ap.add_argument("--gpt2", default=True, action=argparse.BooleanOptionalAction,
                    help="--only train: the GPT-2 comparison (--no-gpt2 --table1: Table 1 alone)")
    ap.add_argument("--models", default=",".join(p for p, _ in TABLE1),
                    help="--only train --table1: Table 1 rows, comma-separated (each compiles twice or more: one "
                         "model per run fits a time limit)")
    ap.add_argument("--methods", default="bf16,gaussws,diffq", help="--only train --table1: PQT methods (bf16 first)")
    ap.add_argument("--optims", default="adamw,zipsr", help="--only train --table1: optimizers")
    ap.add_argument("--eager", action="store_true", help="--only fsdp: train.py --no-compile")
    ap.add_argument("--reps", type=int, default=3,
                    help="--only fsdp: interleaved repetitions (plain, fsdp, plain, fsdp, ...)")
    import experiments
    experiments.add_quality_args(ap.add_argument_group("--only quality (as experiments.py quality)"),
                                 skip=("--dataset", "--iters"))
    return ap


def check_args(ap, args):
    """One-line errors for values the sections would only trip over mid-run (the train section's
    flags only where it runs: elsewhere say_unread_flags names them)."""
    import train as trainer
    if args.only in (None, "train"):
        methods = args.methods.split(",")
        for name, vals, allowed in (("--methods", methods, ("bf16",) + g.METHODS),
                                    ("--optims", args.optims.split(","), trainer.OPTIMS),
                                    ("--modes", args.modes.split(","), trainer.COMPILE_MODES),
                                    ("--models", args.models.split(","), [p for p, _ in TABLE1])):
            if any(v not in allowed for v in vals) or len(set(vals)) != len(vals):
                ap.error(f"{name} {','.join(vals)}: allowed {', '.join(allowed)}, each once")
        if methods[0] != "bf16":
            ap.error(f"--methods {args.methods}: bf16 first (the others' baseline)")
        if args.pairs < 1:
            ap.error(f"--pairs {args.pairs}: need at least 1")
        if not args.gpt2 and not args.table1:
            ap.error("--no-gpt2 without --table1: nothing to run")
        if not args.table1 and (args.compile or args.models != ap.get_default("models")):
            ap.error(f"{'--compile' if args.compile else '--models'} without --table1: it picks how Table 1 runs "
                     "(add --table1)")
    if args.iters is not None and args.iters < 1:
        ap.error(f"--iters {args.iters}: need at least 1")
    if args.reps < 1:
        ap.error(f"--reps {args.reps}: need at least 1")
    try:
        shlex.split(args.train_args)
    except ValueError as e:
        ap.error(f"--train_args {args.train_args!r}: {e} (quote it as one shell word)")
    if args.only == "fsdp" and args.iters is not None and args.iters <= FSDP_WARMUP:
        ap.error(f"--iters {args.iters}: --only fsdp times the steps from {FSDP_WARMUP} on, so it needs more "
                 f"than {FSDP_WARMUP}")


# the sections that read each flag (--only unset: optim, noise, memory and train)
READ_BY = dict(quick=("optim",), dataset=("ddp", "fsdp", "quality"), iters=("ddp", "fsdp", "quality"),
               eager=("fsdp",), reps=("fsdp",), train_args=("fsdp", "quality"),
               **{k: ("train",) for k in ("modes", "pairs", "gpt2", "table1", "methods", "optims", "compile", "models")},
               **{k: ("quality",) for k in ("experiments", "jobs", "out_dir", "preset", "resume", "seeds",
                                            "tokens_per_param")})


def say_unread_flags(ap, args):
    """One line naming the flags set away from their default that the chosen sections do not
    read (as train.py does): the run goes on, but a flag meant for another section shows."""
    sections = {args.only} if args.only else {"optim", "noise", "memory", "train"}
    unread = [f"--{k}" for k, by in READ_BY.items() if getattr(args, k) != ap.get_default(k) and not sections & set(by)]
    if unread:
        print(f"note: not read by --only {args.only or '(default: optim, noise, memory, train)'}: "
              f"{', '.join(unread)}", flush=True)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    say_unread_flags(ap, args)
    if args.only == "host":   # CPU only: the step's Python work, the GPU launches stubbed out
        save("host", bench_host())
        return
    if args.only in ("quality", "plots"):
        import experiments
        if args.only == "plots":
            experiments.main(["plots"])
        else:   # --only quality is training runs: CPU works (slowly)
            experiments.run_quality(args, ap, "bench.py", "python bench.py " + shlex.join(argv))
        return
    if not torch.cuda.is_available():
        raise SystemExit(f"bench.py {'--only ' + args.only if args.only else '(all sections)'} needs a CUDA "
                         "GPU; --only host, quality and plots also run on CPU (the tests cover correctness on CPU)")
    if args.only in (None, "optim"):
        save("optim", bench_optim(args.quick))
    if args.only in (None, "noise"):
        save("noise", dict(rows=bench_noise()))
    if args.only in (None, "memory"):
        save("memory", bench_memory())
    if args.only in (None, "train"):
        # Table 1 alone or a subset of its rows is saved apart, so one model per run can fill the table
        models = args.models.split(",")
        compiled = {None: "", "model": "_compiled", "blocks": "_compiled_blocks"}[args.compile]
        section = "train" if args.gpt2 else "train_table1" + compiled + (
            "" if len(models) == len(TABLE1) else "_" + "_".join(models))
        res = bench_train_gpt2(modes=args.modes.split(","), pairs=args.pairs) if args.gpt2 else dict(rows=[])
        if args.gpt2:
            save(section, dict(res, partial=args.table1))
        if args.table1:
            t1 = bench_train(cases=[c for c in TABLE1 if c[0] in models], optims=tuple(args.optims.split(",")),
                             methods=tuple(args.methods.split(",")), rounds=args.pairs,
                             compile={None: False, "model": True, "blocks": "blocks"}[args.compile],
                             on_row=lambda rows: save(section, dict(res, rows=res["rows"] + rows, partial=True)))
            save(section, dict(res, rows=res["rows"] + t1["rows"], table1_geomean_overhead_pct=t1["geomean_overhead_pct"],
                               command="python bench.py " + shlex.join(argv)))
    if args.only == "ddp":
        if torch.cuda.device_count() < 2:
            raise SystemExit("--only ddp needs 2 GPUs")
        save("ddp", bench_ddp(["--preset", "gpt2-124m", "--dataset", args.dataset, "--batch_size", "16",
                               "--grad_accum", "2", "--max_iters", str(args.iters or 300), "--eval_interval", "50",
                               "--eval_windows", "64", "--no-plot"]))
    if args.only == "fsdp":   # GaussWS + ZIP-SR as users run train.py on CUDA: compiled (--eager: not), GPT-2's
        # tokenizer (gpt2, not auto: no silent fall-back to bytes; their 256-entry LM head leaves a host-bound step)
        flags = ["--preset", "gpt2-124m", "--dataset", args.dataset, "--tokenizer", "gpt2", "--method", "gaussws",
                 "--optim", "zipsr", "--batch_size", "16", "--grad_accum", "2", "--max_iters", str(args.iters or 40),
                 "--eval_interval", "1000", "--eval_windows", "16", "--no-plot"]
        flags += (["--no-compile"] if args.eager else []) + shlex.split(args.train_args)  # later flags win
        section = ("fsdp_eager" if args.eager else "fsdp") + (
            "_" + re.sub(r"[^A-Za-z0-9]+", "_", args.train_args).strip("_") if args.train_args else "")
        save(section, bench_fsdp(flags, reps=args.reps, command="python bench.py " + shlex.join(argv)))


if __name__ == "__main__":
    main()
