"""
The step inside backward against the ordinary step (`python bench.py --only in_backward`), on CPU,
or on a GPU with --device cuda.

A narrow, deep model.GPT (96 layers, n_embd 64: 579 parameter tensors) trains on one thread,
twice from the same weights: ordinary (backward, step(), zero_grad) and with
lowbit.step_in_backward (backward only, each tensor stepped from its gradient's hook). Rows:
AdamW4bit (preset zipsr, impl="torch", the LM head marked and past its SR switch), as issue 48
measured it, and torch's AdamW. The steps alternate between the two runs so both see the same
machine load; each is timed whole (forward, backward, step) and the medians are compared. The
arithmetic is the same both ways, so the ratio is the host work the step inside backward adds per
tensor. Both runs end with the same weights, bit for bit, or the section fails.

On a GPU (device="cuda") the same 579-tensor model and GPT-2-124M (148 tensors, 8 x 1024 tokens)
train under BF16 autocast, AdamW4bit with its kernels (impl "auto") and torch's fused AdamW; each
step is timed between synchronizations. There the step inside backward is one kernel launch per
tensor, the ordinary step one per batch of tensors. The weights are compared but not required to
match: CUDA's embedding backward sums with atomics, so two runs' gradients may differ in the last bit.
"""
import statistics
import time

import torch

from adam4bit import AdamW4bit
from lowbit import step_in_backward
from model import GPT, GPTConfig, preset_config

CONFIG = dict(n_layer=96, n_head=2, n_embd=64, vocab_size=256, block_size=64)
BATCH = (4, 64)
GPU_MODELS = {"96 layers x 64 (579 tensors)": (GPTConfig(**CONFIG), BATCH),
              "GPT-2-124M": (preset_config("gpt2-124m"), (8, 1024))}


def _adamw4bit(model):
    impl = "torch" if next(model.parameters()).device.type == "cpu" else "auto"
    opt = AdamW4bit(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, preset="zipsr", impl=impl)
    opt.mark_lm_head(model.lm_head.weight)
    opt.set_progress(0.95)          # the LM head's first moment takes SR (paper B, Sec. 4)
    return opt


OPTIMIZERS = {"AdamW4bit zipsr": _adamw4bit,
              "torch AdamW": lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)}


def _run(name, in_backward, config=None, device="cpu"):
    torch.manual_seed(0)
    model = GPT(config or GPTConfig(**CONFIG)).to(device)
    opt = OPTIMIZERS[name](model)
    if in_backward:
        step_in_backward(opt)
    return model, opt


def _train_step(model, opt, in_backward, x):
    with torch.autocast(x.device.type, torch.bfloat16, enabled=x.is_cuda):
        _, loss = model(x, x)
    loss.backward()
    if not in_backward:
        opt.step()
        opt.zero_grad(set_to_none=True)


def _compare(name, config, batch, device, steps, warmup):
    # one row: both runs from the same weights, the steps alternating, medians of the timed steps
    runs = {mode: _run(name, mode, config, device) for mode in (False, True)}
    gen = torch.Generator(device=device).manual_seed(1)
    times = {False: [], True: []}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for i in range(warmup + steps):
        x = torch.randint(0, config.vocab_size, batch, generator=gen, device=device)
        for mode in ((False, True) if i % 2 else (True, False)):
            sync()
            t0 = time.perf_counter()
            _train_step(*runs[mode], mode, x)
            sync()
            if i >= warmup:
                times[mode].append((time.perf_counter() - t0) * 1e3)
    params = [list(runs[mode][0].parameters()) for mode in (False, True)]
    same = all(torch.equal(a, b) for a, b in zip(*params))
    ordinary, inside = statistics.median(times[False]), statistics.median(times[True])
    return dict(optimizer=name, n_tensors=len(params[0]), ordinary_ms=ordinary, in_backward_ms=inside,
                ratio=inside / ordinary, same_weights=same)


def bench_in_backward(steps=12, warmup=2, names=tuple(OPTIMIZERS), device="cpu"):
    """Per optimizer (and on CUDA per model): ms per training step, ordinary vs inside backward,
    and their ratio (medians of `steps` alternating steps after `warmup`). On CPU an
    AssertionError if the weights differ."""
    if device == "cuda":
        rows = []
        print(f"{'model':30s} {'optimizer':18s} {'tensors':>7s} {'ordinary ms':>12s} {'in backward ms':>15s} "
              f"{'ratio':>6s} same weights")
        for label, (config, batch) in GPU_MODELS.items():
            for name in names:
                r = dict(_compare(name, config, batch, device, steps, warmup), model=label, batch=list(batch))
                rows.append(r)
                print(f"{label:30s} {name:18s} {r['n_tensors']:7d} {r['ordinary_ms']:12.2f} {r['in_backward_ms']:15.2f} "
                      f"{r['ratio']:6.2f} {r['same_weights']}", flush=True)
        return dict(command="python bench.py --only in_backward --device cuda",
                    config=dict(steps=steps, autocast="bf16"), rows=rows)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    print(f"{'optimizer':30s} {'tensors':>7s} {'ordinary ms':>12s} {'in backward ms':>15s} {'ratio':>6s}")
    try:
        for name in names:
            r = _compare(name, GPTConfig(**CONFIG), BATCH, "cpu", steps, warmup)
            assert r["same_weights"], f"{name}: the step inside backward gave other weights than the ordinary step"
            rows.append(r)
            print(f"{name:30s} {r['n_tensors']:7d} {r['ordinary_ms']:12.1f} {r['in_backward_ms']:15.1f} "
                  f"{r['ratio']:6.2f}", flush=True)
    finally:
        torch.set_num_threads(threads)
    print(f"(CPU, 1 thread, medians of {steps} steps, batch {BATCH[0]}x{BATCH[1]}; same weights bit for bit)")
    return dict(config=dict(CONFIG, batch=list(BATCH), steps=steps, threads=1), rows=rows)
