"""Launch configurations of the fused GaussWS kernels at training shapes (run from the repository root
on a GPU): `python results/logs_2026-12-02/gaussws_config/sweep.py`.

For each weight shape, the µs per call of the fused apply kernel (w float32 -> w_hat BF16, tile maxima,
masked 2^(1-b_t)) and of the fused grad kernel (∂L/∂w_hat BF16 -> ∂L/∂w float32, ∂L/∂b_i), for every
(BT, num_warps), beside the BF16 casts they replace (w.to(bf16), g.float()). Each timing replays a CUDA
graph of calls on enough distinct copies of the inputs (>= 256 MB) that nothing is served from L2, as in
a training step, and divides by the number of copies. Prints a table and the best configuration per
shape; writes sweep.json next to itself or to $OUT. SHAPES="4096x4096,8192x8192" picks shapes."""
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.getcwd())
import gaussws as g  # noqa: E402

SHAPES = [(2304, 768), (768, 768), (3072, 768), (768, 3072),            # GPT-2-124M
          (2048, 768), (768, 2048),                                      # llama-134m's MLP
          (2048, 2048), (5632, 2048), (2048, 5632),                      # llama-1b
          (4096, 4096), (8192, 8192)]
if os.environ.get("SHAPES"):
    SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ["SHAPES"].split(",")]
BTS, WARPS = (1, 2, 4, 8), (1, 2, 4, 8)


def timed(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def main():
    rows = []
    for m, n in SHAPES:
        k = max(2, -(-(256 << 20) // (m * n * 4)))
        tm, tn = g.tile_grid(m, n)
        ws = [torch.randn(m, n, device="cuda") for _ in range(k)]
        gs = [torch.randn(m, n, device="cuda").to(torch.bfloat16) for _ in range(k)]
        bt = (3 + 5 * torch.rand(tm, tn, device="cuda")).contiguous()
        pow2 = torch.exp2(1 - bt)
        seed = torch.tensor([12345, 6], device="cuda")
        tmax, live = g.tile_max(ws[0]), g._pow2_live_torch(bt, pow2)
        cast_w = timed(lambda: [w.to(torch.bfloat16) for w in ws]) * 1e3 / k
        cast_g = timed(lambda: [x.float() for x in gs]) * 1e3 / k
        row = dict(shape=f"{m}x{n}", tiles=tm * tn, cast_w_us=cast_w, cast_g_us=cast_g, apply={}, grad={})
        for b in BTS:
            for nw in WARPS:
                key = f"{b},{nw}"
                row["apply"][key] = timed(lambda: [g._apply_triton(w, None, None, seed, "gaussws", torch.bfloat16,
                                                                   True, b, nw, bits=(bt, 0.0, 1.0))
                                                   for w in ws]) * 1e3 / k
                row["grad"][key] = timed(lambda: [g._grad_triton(x, None, tmax, seed, "gaussws", torch.float32, True,
                                                                 b, nw, bits=(live, 2.0, torch.float32))
                                                  for x in gs]) * 1e3 / k
        cur = "4,4"   # the fused kernels' configuration before the small_* entries of CONFIG
        ba, bg = min(row["apply"], key=row["apply"].get), min(row["grad"], key=row["grad"].get)
        row.update(current=cur, best_apply=ba, best_grad=bg)
        gb = m * n * 6 / 1e3   # bytes per kernel (4 + 2) in kB -> GB/s = kB / µs
        print(f"{row['shape']:>10s} tiles {tm * tn:6d} copies {k:4d} | casts w {cast_w:7.1f} g {cast_g:7.1f} µs | "
              f"apply cur {row['apply'][cur]:7.1f} best {row['apply'][ba]:7.1f} ({ba}) | "
              f"grad cur {row['grad'][cur]:7.1f} best {row['grad'][bg]:7.1f} ({bg}) | "
              f"best apply {gb / row['apply'][ba]:.0f} GB/s", flush=True)
        print("    apply " + " ".join(f"{kk}:{v:.1f}" for kk, v in row["apply"].items()))
        print("    grad  " + " ".join(f"{kk}:{v:.1f}" for kk, v in row["grad"].items()))
        rows.append(row)
        del ws, gs
        torch.cuda.empty_cache()
    out = os.environ.get("OUT", os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(out, os.environ.get("SWEEP_JSON", "sweep.json")), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
