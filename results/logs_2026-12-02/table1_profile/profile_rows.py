"""Where a compiled (per block) Table 1 row's GaussWS overhead goes: for each model of argv[1:]
(default llama-3b and llama-70b-4l at the paper's batch), BF16 and GaussWS [all] with AdamW as
bench.bench_train builds them (bench._train_setup, compile="blocks"): the queued step time, the
host time of one step started on an idle GPU, and torch.profiler's device time per step summed by
kernel family, with the largest kernels. Prints only. (profile_rows.txt came from a first version
that also counted torch's multi_tensor_apply_kernel as "gaussws apply" and the optimizer's
record_function range as device time; its per-kernel lines are unaffected.)"""
import os, sys, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import torch
from torch.profiler import ProfilerActivity, profile
import bench

FAMILIES = [("optimizer", "multi_tensor"), ("gaussws apply", "_apply_kernel"), ("gaussws grad", "_grad_kernel"),
            ("gaussws other", "gaussws"),
            ("mm", "gemm"), ("mm", "nvjet"), ("mm", "cutlass"), ("mm", "sm90"), ("attention", "flash"),
            ("optimizer", "fused_adam"), ("inductor", "triton_"),
            ("copy", "copy"), ("copy", "memcpy"), ("copy", "memset")]


def family(name):
    n = name.lower()
    return next((f for f, key in FAMILIES if key in n), "other")


cases = dict(bench.TABLE1)
for preset in sys.argv[1:] or ["llama-3b", "llama-70b-4l"]:
    for method in ("bf16", "gaussws"):
        t0 = time.time()
        model, opt, step = bench._train_setup(preset, method, "adamw", cases[preset], 2048, torch.device("cuda"), "blocks")
        for _ in range(3):
            step()
        ms = [bench._queued_steps_ms(step, 10) for _ in range(2)]
        host = []
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            step()
            host.append((time.perf_counter() - t) * 1e3)
            torch.cuda.synchronize()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        fam, kern = {}, {}
        for e in bench._device_ops(prof.events()):      # kernels and copies, not the optimizer's range
            us = e.time_range.elapsed_us() / 3
            f = family(e.name)
            fam[f] = fam.get(f, 0.0) + us
            c = kern.setdefault(e.name[:90], [0.0, 0])
            c[0] += us
            c[1] += 1
        print(f"\n== {preset} B={cases[preset]} {method}: queued {' / '.join(f'{m:.2f}' for m in ms)} ms a step, "
              f"host {sorted(host)[2]:.2f} ms (median of 5, idle GPU), device {sum(fam.values()) / 1e3:.2f} ms a step "
              f"({time.time() - t0:.0f} s)", flush=True)
        print("  families (ms a step): " + ", ".join(f"{k} {v / 1e3:.2f}" for k, v in sorted(fam.items(), key=lambda kv: -kv[1])))
        for name, (us, n) in sorted(kern.items(), key=lambda kv: -kv[1][0])[:14]:
            print(f"  {us / 1e3:8.3f} ms {n // 3:5d}x  {name}")
        sys.stdout.flush()
        del model, opt, step, prof
        torch.cuda.empty_cache()
