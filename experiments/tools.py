"""
Diagnostics that print, beside bench.py's tables: where a GaussWS kernel's or a Table 1 row's time
goes and how many launches a GaussWS layer makes. They read the code and write nothing but stdout.

    python -m experiments.tools kernels        # GPU: GaussWS apply/grad kernels over launch configs
    python -m experiments.tools kernels --short --shapes 4096x4096,8192x8192
    python -m experiments.tools launches       # CPU: launches of one eager GaussWSLinear training call
    python -m experiments.tools profile llama-3b llama-1b  # GPU: a compiled Table 1 row's device time by kernel family

Each prints what it measured and how; results/README.md names the printouts kept in results/.
"""
import argparse
import collections
import os
import subprocess
import sys
import time

import torch

import gaussws as g
from lowbit.pqt.checks import seed_tensor
from lowbit.pqt.tiles import tile_grid
from lowbit.pqt.tl import launch_config

# the gaussws functions `kernels` times directly (the kernels alone, outside the autograd layer)
GAUSSWS_NAMES = ("apply_triton", "grad_triton", "launch_config", "seed_tensor", "tile_grid")


# ---------------------------------------------------------------------------------------------
# kernels: the fused GaussWS kernels over launch configurations

KERNEL_SHAPES = [(3200, 3200), (8640, 3200), (3200, 8640), (2048, 2048), (256, 2048), (5632, 2048), (2048, 5632),
                 (768, 768), (2048, 768), (768, 2048), (8192, 8192), (1024, 8192), (28672, 8192), (8192, 28672)]
KERNEL_CONFIGS = [(bt, w) for bt in (1, 2, 4, 8, 16) for w in (1, 2, 4, 8)]
SHORT_CONFIGS = [(1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (4, 2), (4, 4), (8, 4), (8, 8)]


def kernels(shapes, configs):
    """The fused apply kernel (b_t made from b_i in the kernel) and grad kernel (with the chain to
    b_i), as a compiled layer calls them, at each (m, n) of `shapes` and each (tiles per program BT,
    warps) of `configs`: µs per call (triton.testing.do_bench, launch included: launch-bound, ~6 µs,
    for small weights), % of the copy floor (6 bytes an element both ways, at the measured copy
    bandwidth), beside the BF16 path's casts of the same weight; a config whose outputs differ from
    the current config's is marked DIFF."""
    import triton
    from benchmarks.util import copy_bandwidth
    bw = copy_bandwidth()
    seed = seed_tensor(12345, "cuda")
    bf16 = torch.bfloat16

    def us(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; per config: apply/grad µs", flush=True)
    for m, n in shapes:
        w = torch.randn(m, n, device="cuda")
        tm, tn = tile_grid(m, n)
        b = torch.zeros(tm, tn, device="cuda")
        gg = torch.randn(m, n, device="cuda", dtype=bf16)
        floor = m * n * 6 / bw * 1e6

        def apply(bt=None, nw=None):
            return g.apply_triton(w, None, None, seed, "gaussws", bf16, True, bt, nw, bits=(b, 4.0, 2.0))

        def grad(live, tmax, bt=None, nw=None):
            return g.grad_triton(gg, None, tmax, seed, "gaussws", torch.float32, True, bt, nw,
                                  bits=(live, 2.0, torch.float32))
        cast_f, cast_b = us(lambda: w.to(bf16)), us(lambda: gg.float())
        ref_a = apply()
        tmax, live = ref_a[1], ref_a[2]
        ref_g = grad(live, tmax)
        cur_a, cur_g = launch_config("apply", 2, tm * tn), launch_config("grad", 2, tm * tn)
        res = {}
        for bt, nw in list(configs) + [k for k in dict.fromkeys((cur_a, cur_g)) if k not in configs]:
            try:
                same = all(torch.equal(x, y) for x, y in zip(apply(bt, nw) + grad(live, tmax, bt, nw), ref_a + ref_g))
                res[(bt, nw)] = (us(lambda: apply(bt, nw)), us(lambda: grad(live, tmax, bt, nw)), same)
            except Exception as e:   # a config the compiler refuses (registers, shared memory) is a row, not the end
                res[(bt, nw)] = (float("nan"), float("nan"), repr(e)[:60])
        ba = min(res, key=lambda k: res[k][0] if res[k][0] == res[k][0] else float("inf"))   # NaN: a failed config
        bg = min(res, key=lambda k: res[k][1] if res[k][1] == res[k][1] else float("inf"))
        pct = lambda t: 100 * floor / t
        print(f"\n{m}x{n} floor {floor:.1f} µs; casts fwd {cast_f:.1f} bwd {cast_b:.1f} µs ({pct(cast_f):.0f} / "
              f"{pct(cast_b):.0f} % of floor); current apply {cur_a} {res[cur_a][0]:.1f} µs ({pct(res[cur_a][0]):.0f} %), "
              f"grad {cur_g} {res[cur_g][1]:.1f} µs ({pct(res[cur_g][1]):.0f} %); best apply {ba} {res[ba][0]:.1f} "
              f"({pct(res[ba][0]):.0f} %), best grad {bg} {res[bg][1]:.1f} ({pct(res[bg][1]):.0f} %)", flush=True)
        print("  " + "  ".join(f"{k[0]}x{k[1]}w: {v[0]:.1f}/{v[1]:.1f}{'' if v[2] is True else ' DIFF ' + str(v[2])}"
                               for k, v in res.items()), flush=True)
        del w, gg
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# launches: what one GaussWSLinear training call launches, eager and compiled

# aten ops that launch nothing on a GPU (views, allocations)
NOT_LAUNCHES = {"detach", "view", "t", "expand", "select", "alias", "empty", "new_empty", "set_",
                "_unsafe_view", "permute", "unsqueeze", "squeeze", "slice", "as_strided", "getitem"}


def launches_eager():
    """GaussWSLinear(64, 96) under TRITON_INTERPRET=1 with impl="triton", forward + backward of the
    second call: Triton launches counted where the interpreter runs a kernel, aten ops by a
    TorchDispatchMode outside those runs (an aten op that is not a view or an allocation is one
    kernel on a GPU; on a CPU the seed counter is clone + add_, on a GPU one kernel)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction
    state = dict(inside=0, log=[])
    run = InterpretedFunction.run

    def counted(self, *a, **k):
        state["log"].append("triton " + self.fn.__name__)
        state["inside"] += 1
        try:
            return run(self, *a, **k)
        finally:
            state["inside"] -= 1
    InterpretedFunction.run = counted     # for the rest of this process: `launches` runs it in its own

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not state["inside"] and name not in NOT_LAUNCHES:
                state["log"].append("aten " + name)
            return func(*args, **(kwargs or {}))
    torch.manual_seed(0)
    for memory in ("save", "recompute"):
        layer = g.GaussWSLinear(64, 96, seed=3, impl="triton", memory=memory)
        x = torch.randn(8, 64)
        layer(x).sum().backward()                         # first call outside the count
        layer.zero_grad(set_to_none=True)
        for phase in ("forward", "backward"):
            state["log"] = []
            with Ops():
                if phase == "forward":
                    loss = layer(x).sum()
                else:
                    loss.backward()
            c = collections.Counter(state["log"])
            print(f"eager memory={memory} {phase}: {len(state['log'])} launches "
                  f"({sum(v for k, v in c.items() if k.startswith('triton'))} Triton): "
                  + ", ".join(f"{k} x{v}" if v > 1 else k for k, v in c.items()), flush=True)


def launches():
    """launches_eager in a process of its own under TRITON_INTERPRET=1 (it patches Triton's
    interpreter, which must be chosen before triton is imported)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        env = dict(os.environ, TRITON_INTERPRET="1")
        return subprocess.run([sys.executable, "-m", "experiments.tools", "launches"], env=env, check=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import triton
    print(f"torch {torch.__version__}, triton {triton.__version__}; GaussWSLinear(64, 96), bias, x (8, 64), "
          "loss = y.sum(); second call counted\n", flush=True)
    launches_eager()


# ---------------------------------------------------------------------------------------------
# profile: where a compiled Table 1 row's time goes

# (family, substring of the kernel name), first match wins
FAMILIES = [("optimizer", "multi_tensor"), ("gaussws apply", "_apply_kernel"), ("gaussws grad", "_grad_kernel"),
            ("gaussws other", "gaussws"), ("mm", "gemm"), ("mm", "nvjet"), ("mm", "cutlass"), ("mm", "sm90"),
            ("attention", "flash"), ("optimizer", "fused_adam"), ("inductor", "triton_"),
            ("copy", "copy"), ("copy", "memcpy"), ("copy", "memset")]


def family(name):
    n = name.lower()
    return next((f for f, key in FAMILIES if key in n), "other")


def profile(presets):
    """For each Table 1 preset, BF16 and GaussWS [all] with AdamW as bench.py's Table 1 builds them
    (each block compiled, the paper's batch): the queued step time (2 x 10 steps), the host time of
    one step started on an idle GPU (median of 5), and torch.profiler's device time per step over
    3 steps, summed by kernel family, with the 14 largest kernels."""
    from torch.profiler import ProfilerActivity
    from benchmarks import training as bt
    cases = dict(bt.TABLE1)
    for preset in presets:
        for method in ("bf16", "gaussws"):
            t0 = time.time()
            model, opt, step = bt.train_setup(preset, method, "adamw", cases[preset], 2048, torch.device("cuda"), "blocks")
            for _ in range(3):
                step()
            ms = [bt.queued_steps_ms(step, 10) for _ in range(2)]
            host = []
            for _ in range(5):
                torch.cuda.synchronize()
                t = time.perf_counter()
                step()
                host.append((time.perf_counter() - t) * 1e3)
                torch.cuda.synchronize()
            with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            fam, kern = {}, {}
            for e in bt.device_ops(prof.events()):      # kernels and copies, not record_function ranges
                us = e.time_range.elapsed_us() / 3
                fam[family(e.name)] = fam.get(family(e.name), 0.0) + us
                c = kern.setdefault(e.name[:90], [0.0, 0])
                c[0] += us
                c[1] += 1
            print(f"\n== {preset} B={cases[preset]} {method}: queued {' / '.join(f'{m:.2f}' for m in ms)} ms a step, "
                  f"host {sorted(host)[2]:.2f} ms (median of 5, idle GPU), device {sum(fam.values()) / 1e3:.2f} ms "
                  f"a step ({time.time() - t0:.0f} s)", flush=True)
            print("  families (ms a step): " + ", ".join(f"{k} {v / 1e3:.2f}" for k, v in sorted(fam.items(), key=lambda kv: -kv[1])))
            for name, (us, n) in sorted(kern.items(), key=lambda kv: -kv[1][0])[:14]:
                print(f"  {us / 1e3:8.3f} ms {n // 3:5d}x  {name}")
            sys.stdout.flush()
            del model, opt, step, prof
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# command line

def _shapes(text):
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma list of MxN, e.g. 4096x4096,8192x8192")
    return shapes


def build_parser():
    from benchmarks.training import TABLE1
    ap = argparse.ArgumentParser(prog="python -m experiments.tools", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="{kernels,launches,profile}")
    p = sub.add_parser("kernels", help="GPU: the fused GaussWS kernels over launch configurations")
    p.add_argument("--shapes", type=_shapes, default=None, help="MxN,... (default: the Table 1 models' weight shapes)")
    p.add_argument("--short", action="store_true", help="the configurations that won or came close in a full sweep")
    sub.add_parser("launches", help="CPU: launches of one eager GaussWSLinear training call")
    p = sub.add_parser("profile", help="GPU: a compiled Table 1 row's device time by kernel family")
    p.add_argument("presets", nargs="*", metavar="PRESET",
                   help=f"Table 1 presets, each of {', '.join(name for name, _ in TABLE1)} (default: llama-3b llama-70b-4l)")
    return ap


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "profile":
        from benchmarks.training import TABLE1
        bad = [p for p in args.presets if p not in dict(TABLE1)]
        if bad:
            ap.error(f"profile {' '.join(bad)}: not a Table 1 preset; allowed: {', '.join(dict(TABLE1))}")
    if args.command in ("kernels", "profile") and not torch.cuda.is_available():
        raise SystemExit(f"{ap.prog} {args.command} needs a CUDA GPU; {ap.prog} launches runs on CPU")
    if args.command == "kernels":
        shapes = args.shapes or [s for s in KERNEL_SHAPES if not args.short or s not in ((256, 2048), (768, 2048), (8192, 28672))]
        kernels(shapes, SHORT_CONFIGS if args.short else KERNEL_CONFIGS)
    elif args.command == "launches":
        launches()
    else:
        profile(args.presets or ["llama-3b", "llama-70b-4l"])


if __name__ == "__main__":
    main()
