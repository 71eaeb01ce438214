# AdamW4bit ZIP-SR step on one flat 1B-element tensor: FP32 vs BF16 parameters (grads of the
# parameter's dtype), capturable False/True, 3 interleaved rounds; torch fused AdamW for scale
import sys, torch
sys.path.insert(0, ".")
import bench, adam4bit as A
hp = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
n = 1 << 30
for rnd in range(3):
    for pdt in (torch.float32, torch.bfloat16):
        for cap in (False, True):
            p = torch.nn.Parameter((torch.randn(n, device="cuda") * 0.02).to(pdt))
            p.grad = (torch.randn(n, device="cuda") * 1e-3).to(pdt)
            opt = A.AdamW4bit([p], preset="zipsr", capturable=cap, **hp)
            for _ in range(3):
                opt.step()
            print(f"round {rnd} {str(pdt)[6:]:9s} capturable={cap!s:5s}: {bench.median_ms(opt.step, warmup=5, rep=40):.3f} ms", flush=True)
            del opt, p
            torch.cuda.empty_cache()
