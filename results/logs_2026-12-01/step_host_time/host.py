# GPT-2-124M shapes: step ms and host ms of step(), FP32 and BF16 parameters, 3 interleaved rounds
import sys, statistics, torch
sys.path.insert(0, ".")
import bench
rows = {}
for rnd in range(2):
    for pdt, table in ((torch.float32, bench._optimizers()), (torch.bfloat16, bench._bf16_param_optimizers())):
        for name, make in table.items():
            if any(k in name.lower() for k in ("reference", "foreach", "flash", "zeeden", "torchao")):
                continue
            ps = bench._make(bench.gpt2_shapes(), pdt, param_dtype=pdt)
            opt = make(ps); opt.step(); torch.cuda.synchronize()
            ms = bench.median_ms(opt.step, warmup=10, rep=60)
            host = bench.host_ms(opt.step, rep=40)
            rows.setdefault((str(pdt), name), []).append((ms, host))
            del opt, ps
print(f"{'params':16s} {'optimizer':40s} {'step ms (2 rounds)':>26s} {'host ms (2 rounds)':>26s}")
for (pdt, name), v in rows.items():
    print(f"{pdt:16s} {name:40s} " + " ".join(f"{a:8.3f}" for a, _ in v) + "   " + " ".join(f"{b:8.3f}" for _, b in v))
