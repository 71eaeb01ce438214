# AdamW4bit.step on GPT-2-124M shapes: capturable=False vs capturable=True (its own CUDA graph),
# interleaved rounds in one process: step ms (CUDA events) and host ms (CPU time of one step()
# started with the GPU idle)
import os, sys, time, statistics, torch
sys.path.insert(0, ".")
import bench, adam4bit as A
hp = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
cases = [("fp32", torch.float32, {}), ("bf16 rtn", torch.bfloat16, {}),
         ("bf16 sr", torch.bfloat16, dict(param_rounding="sr")),
         ("bf16 mw24", torch.bfloat16, dict(master_weight_bits=24))]
def host(step, rep=100):
    ts = []
    for _ in range(rep):
        torch.cuda.synchronize()
        t0 = time.perf_counter(); step(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3
for rnd in range(3):
    for name, pdt, kw in cases:
        for cap in (False, True):
            ps = bench._make(bench.gpt2_shapes(), pdt, param_dtype=pdt)
            opt = A.AdamW4bit(ps, preset="zipsr", capturable=cap, **hp, **kw)
            for _ in range(3):
                opt.step()
            torch.cuda.synchronize()
            ms = bench.median_ms(opt.step, warmup=10, rep=100); h = host(opt.step)
            print(f"round {rnd} {name:10s} capturable={cap!s:5s}: step {ms:.3f} ms  host {h:.3f} ms", flush=True)
            del opt, ps
    for pdt in (torch.float32, torch.bfloat16):
        ps = bench._make(bench.gpt2_shapes(), pdt, param_dtype=pdt)
        opt = torch.optim.AdamW(ps, fused=True, **hp); opt.step(); torch.cuda.synchronize()
        print(f"round {rnd} torch fused {str(pdt)[6:]}: step {bench.median_ms(opt.step, warmup=10, rep=100):.3f} ms  host {host(opt.step):.3f} ms", flush=True)
        del opt, ps
