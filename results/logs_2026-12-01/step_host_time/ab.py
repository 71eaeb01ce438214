import os, sys, torch
sys.path.insert(0, "."); sys.path.insert(0, os.path.dirname(__file__))
import bench, adam4bit as new, adam4bit_old as old
hp = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
for rnd in range(3):
    for pdt in (torch.float32, torch.bfloat16):
        for tag, mod in (("old", old), ("new", new)):
            ps = bench._make(bench.gpt2_shapes(), pdt, param_dtype=pdt)
            opt = mod.AdamW4bit(ps, preset="zipsr", **hp); opt.step(); torch.cuda.synchronize()
            ms = bench.median_ms(opt.step, warmup=10, rep=50); host = bench.host_ms(opt.step, rep=40)
            print(f"round {rnd} {str(pdt):15s} {tag}: step {ms:.3f} ms host {host:.3f} ms", flush=True)
            del opt, ps
