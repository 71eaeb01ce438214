"""Speed of whole training steps: paper A Table 1 and the GPT-2 comparison, bytes/param of the
training state, DDP and FSDP2 runs of train.py; each section a function that prints its table
and returns it (bench.py writes the JSON).
"""
import datetime
import math
import os
import statistics
import time

import torch

import adam4bit as A
import gaussws as g
from lowbit.pqt.surgery import ALL_PARTS
from lowbit.pqt.tiles import tile_grid
from benchmarks.util import run_train_py
from model import GPT, preset_config
from trainer.flags import build_parser
from trainer.memory import optimizer_state_bytes, params_to_bf16
from trainer.optim import build_optimizer


# ---------------------------------------------------------------------------------------------
# train: paper A Table 1 (tokens/s and peak memory of BF16 / GaussWS / DiffQ), and memory

TABLE1 = [("llama-134m", 24), ("llama-1b", 8), ("llama-3b", 2), ("llama-70b-4l", 2)]  # x 2048 tokens


def train_setup(preset, method, optim, batch, T, device, compile=True, memory="save", param_dtype="fp32",
                 master_weight_bits=None):
    """Model (preset, PQT method on [all]; parameters in param_dtype "fp32"|"bf16"), optimizer
    (train.py's) and one training step closure on random tokens (throughput does not depend on
    the data). compile: False, True (the whole model, as train.py) or "blocks" (each transformer
    block, the embeddings, final norm, LM head and loss eager)."""
    torch.manual_seed(0)
    with device:        # initialise on the GPU: a CPU init of a 3B model takes longer than its benchmark
        model = GPT(preset_config(preset, block_size=T))
    if method != "bf16":
        g.apply_pqt(model, method=method, parts="all", memory=memory)
    if param_dtype == "bf16":
        params_to_bf16(model)
    args = build_parser().parse_args([])   # every train.py flag at its default, then ours
    vars(args).update(optim=optim, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, bits_wd=0.0,
                      seed=0, param_rounding="rtn", master_weight_bits=master_weight_bits)
    opt = build_optimizer(args, model, device.type)
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
                    model, opt, step = train_setup(preset, method, optim, batch, T, device, compile)
                    params = model.num_params()
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    for _ in range(3):                           # compile and warm up
                        step()
                    if device.type == "cuda":
                        ms[method].append(queued_steps_ms(step, steps))
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
        self.b_i = torch.nn.Parameter(torch.ones(tile_grid(*lin.weight.shape), device=lin.weight.device))

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
            if name in ALL_PARTS and type(child) is torch.nn.Linear:
                setattr(block, name, TorchEq3Linear(child))


# name -> model surgery; each is timed against "bf16" (no surgery) in the same process
TRAIN_VARIANTS = {"bf16": lambda model: None,
                  "gaussws": lambda model: g.apply_pqt(model, parts="all"),
                  "torch eq.3": torch_eq3_pqt}


def queued_steps_ms(step, n):
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


def device_ops(events):
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
    dev = device_ops(prof.events())
    return sum(e.time_range.elapsed_us() for e in dev) / 1e3 / n, len(dev) / n


def bench_train_gpt2(variants=TRAIN_VARIANTS, modes=("default",), pairs=2, steps=30, batch=16, T=1024,
                     preset="gpt2-124m"):
    """GaussWS at the training level: GPT-2-124M, batch 16 × 1024, BF16 autocast, torch.compile
    (each mode of `modes`), fused AdamW, gradient clipping, one micro-step per optimizer step;
    every variant (model surgery of `variants`, "bf16" = none) is built and compiled once, then
    timed in `pairs` interleaved rounds in this one process, so the ratios to bf16 are not moved
    by the machine between runs. Step time: `steps` steps queued back to back (`queued_steps_ms`,
    as train.py runs); "synced": the median of `steps` steps each waited for, where the GPU idles
    while the host starts the next step. Per variant also: host ms per step (the step() call
    started with the GPU idle, without waiting for it), and from torch.profiler the GPU time and
    GPU operations per step."""
    device = torch.device("cuda")
    args = build_parser().parse_args([])   # every train.py flag at its default, then ours
    vars(args).update(optim="adamw", lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, bits_wd=0.0, seed=0)
    x = torch.randint(0, 50304, (batch, T), device=device)
    y = torch.randint(0, 50304, (batch, T), device=device)
    runs = {}
    for mode in modes:
        for name, surgery in variants.items():
            torch.manual_seed(0)
            with device:
                model = GPT(preset_config(preset, block_size=T))
            surgery(model)
            opt = build_optimizer(args, model, "cuda")
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
            r["ms"].append(queued_steps_ms(r["step"], steps))
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
    device = torch.device(device)
    rows = []
    cases = [(method, memory, optim, "fp32", None) for method, memory in (
        ("bf16", "save"), ("gaussws", "save"), ("gaussws", "recompute"), ("diffq", "save"))
        for optim in ("adamw", "zipsr")]
    cases += [("bf16", "save", "zipsr", "bf16", None), ("bf16", "save", "zipsr", "bf16", 24)]
    for method, memory, optim, pdt, mwb in cases:
        model, opt, step = train_setup(preset, method, optim, batch, T, device, compile=False,
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
                        optimizer=optimizer_state_bytes(opt), bf16_weights_saved=sum(saved))
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
    logs = {n: run_train_py([*train_args, "--overwrite"], os.path.join(out_dir, f"{n}proc"), n if n > 1 else None)
            for n in (1, nproc)}
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
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = {"plain": [], "fsdp": []}
    for rep in range(reps):
        for kind in ("plain", "fsdp"):
            t0 = time.time()
            recs = run_train_py([*train_args, *(["--fsdp"] if kind == "fsdp" else []), "--overwrite"],
                                os.path.join(out_dir, f"{kind}{rep}"), nproc if kind == "fsdp" else None)
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
