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


if __name__ == "__main__":
    main()
