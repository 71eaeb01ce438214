"""The fused GaussWS kernels as a compiled layer calls them (apply with b_t made from b_i in the
kernel, grad with the chain to b_i), at the Table 1 models' weight shapes, over launch configs
(tiles per program BT, warps): microseconds per call, % of the copy floor (6 bytes an element
both ways), beside the BF16 path's casts of the same weight (w.to(bf16); the bf16 gradient to
float32). Prints only. Unlike ../gaussws_config/sweep.py (CUDA-graph replays over copies of the
inputs, for GPT-2's small weights), each call is timed by triton.testing.do_bench on the same
inputs, launch included: right for the large weights, launch-bound (~6 us) for the small ones.
SWEEP=short: fewer shapes and configurations."""
import itertools, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
import torch, triton
import gaussws as g

BW = 4.25e12   # measured copy bandwidth, bytes/s
SHAPES = [(3200, 3200), (8640, 3200), (3200, 8640), (2048, 2048), (256, 2048), (5632, 2048), (2048, 5632),
          (768, 768), (2048, 768), (768, 2048), (8192, 8192), (1024, 8192), (28672, 8192), (8192, 28672)]
CONFIGS = [(bt, w) for bt in (1, 2, 4, 8, 16) for w in (1, 2, 4, 8)]
if os.environ.get("SWEEP") == "short":   # the second sweep: the configs that won or came close in the first
    SHAPES = [s for s in SHAPES if s not in ((256, 2048), (768, 2048), (8192, 28672))]
    CONFIGS = [(1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (4, 2), (4, 4), (8, 4), (8, 8)]
seed = g._seed_tensor(12345, "cuda")
bf16 = torch.bfloat16


def t(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3


best = {}
for m, n in SHAPES:
    w = torch.randn(m, n, device="cuda")
    tm, tn = g.tile_grid(m, n)
    b = torch.zeros(tm, tn, device="cuda")
    gg = torch.randn(m, n, device="cuda", dtype=bf16)
    floor = m * n * 6 / BW * 1e6
    cast_f, cast_b = t(lambda: w.to(bf16)), t(lambda: gg.float())
    ref_a = g._apply_triton(w, None, None, seed, "gaussws", bf16, True, bits=(b, 4.0, 2.0))
    tmax, live = ref_a[1], ref_a[2]
    ref_g = g._grad_triton(gg, None, tmax, seed, "gaussws", torch.float32, True, bits=(live, 2.0, torch.float32))
    cur_a = g._launch_config("apply", 2, tm * tn)
    cur_g = g._launch_config("grad", 2, tm * tn)
    res = {}
    for bt, nw in CONFIGS:
        try:
            a = g._apply_triton(w, None, None, seed, "gaussws", bf16, True, bt, nw, bits=(b, 4.0, 2.0))
            d = g._grad_triton(gg, None, tmax, seed, "gaussws", torch.float32, True, bt, nw, bits=(live, 2.0, torch.float32))
            same = all(torch.equal(x, y) for x, y in zip(a + d, ref_a + ref_g))
            ta = t(lambda: g._apply_triton(w, None, None, seed, "gaussws", bf16, True, bt, nw, bits=(b, 4.0, 2.0)))
            tg = t(lambda: g._grad_triton(gg, None, tmax, seed, "gaussws", torch.float32, True, bt, nw,
                                          bits=(live, 2.0, torch.float32)))
            res[(bt, nw)] = (ta, tg, same)
        except Exception as e:
            res[(bt, nw)] = (float("nan"), float("nan"), repr(e)[:60])
    ba = min(res, key=lambda k: res[k][0])
    bg = min(res, key=lambda k: res[k][1])
    print(f"\n{m}x{n} floor {floor:.1f} us; casts fwd {cast_f:.1f} bwd {cast_b:.1f} us ({100 * floor / cast_f:.0f} / "
          f"{100 * floor / cast_b:.0f} % of floor); current apply {cur_a} {res[cur_a][0]:.1f} us "
          f"({100 * floor / res[cur_a][0]:.0f} %), grad {cur_g} {res[cur_g][1]:.1f} us ({100 * floor / res[cur_g][1]:.0f} %); "
          f"best apply {ba} {res[ba][0]:.1f} ({100 * floor / res[ba][0]:.0f} %), best grad {bg} {res[bg][1]:.1f} "
          f"({100 * floor / res[bg][1]:.0f} %)", flush=True)
    print("  " + "  ".join(f"{k[0]}x{k[1]}w: {v[0]:.1f}/{v[1]:.1f}{'' if v[2] is True else ' DIFF ' + str(v[2])}"
                           for k, v in res.items()), flush=True)
    del w, gg
    torch.cuda.empty_cache()
