"""
The step inside backward against the ordinary step (`python bench.py --only in_backward`), on CPU.

A narrow, deep model.GPT (96 layers, n_embd 64: 579 parameter tensors) trains on one thread,
twice from the same weights: ordinary (backward, step(), zero_grad) and with
lowbit.step_in_backward (backward only, each tensor stepped from its gradient's hook). Rows:
AdamW4bit (preset zipsr, impl="torch", the LM head marked and past its SR switch), as issue 48
measured it, and torch's AdamW. The steps alternate between the two runs so both see the same
machine load; each is timed whole (forward, backward, step) and the medians are compared. The
arithmetic is the same both ways, so the ratio is the host work the step inside backward adds per
tensor (on a GPU the arithmetic is shorter and that share larger; not measured here). Both runs
end with the same weights, bit for bit, or the section fails.
"""
import statistics
import time

import torch

from adam4bit import AdamW4bit
from lowbit import step_in_backward
from model import GPT, GPTConfig

CONFIG = dict(n_layer=96, n_head=2, n_embd=64, vocab_size=256, block_size=64)
BATCH = (4, 64)


def _adamw4bit(model):
    opt = AdamW4bit(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, preset="zipsr", impl="torch")
    opt.mark_lm_head(model.lm_head.weight)
    opt.set_progress(0.95)          # the LM head's first moment takes SR (paper B, Sec. 4)
    return opt


OPTIMIZERS = {"AdamW4bit zipsr (impl torch)": _adamw4bit,
              "torch AdamW": lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)}


def _run(name, in_backward):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    opt = OPTIMIZERS[name](model)
    if in_backward:
        step_in_backward(opt)
    return model, opt


def _train_step(model, opt, in_backward, x):
    _, loss = model(x, x)
    loss.backward()
    if not in_backward:
        opt.step()
        opt.zero_grad(set_to_none=True)


def bench_in_backward(steps=12, warmup=2, names=tuple(OPTIMIZERS)):
    """Per optimizer: ms per training step, ordinary vs inside backward, and their ratio (medians
    of `steps` alternating steps after `warmup`). AssertionError if the weights differ."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    print(f"{'optimizer':30s} {'tensors':>7s} {'ordinary ms':>12s} {'in backward ms':>15s} {'ratio':>6s}")
    try:
        for name in names:
            runs = {mode: _run(name, mode) for mode in (False, True)}
            gen = torch.Generator().manual_seed(1)
            times = {False: [], True: []}
            for i in range(warmup + steps):
                x = torch.randint(0, CONFIG["vocab_size"], BATCH, generator=gen)
                for mode in ((False, True) if i % 2 else (True, False)):
                    t0 = time.perf_counter()
                    _train_step(*runs[mode], mode, x)
                    if i >= warmup:
                        times[mode].append((time.perf_counter() - t0) * 1e3)
            params = [list(runs[mode][0].parameters()) for mode in (False, True)]
            same = all(torch.equal(a, b) for a, b in zip(*params))
            assert same, f"{name}: the step inside backward gave other weights than the ordinary step"
            ordinary, inside = statistics.median(times[False]), statistics.median(times[True])
            rows.append(dict(optimizer=name, n_tensors=len(params[0]), ordinary_ms=ordinary, in_backward_ms=inside,
                             ratio=inside / ordinary, same_weights=same))
            print(f"{name:30s} {len(params[0]):7d} {ordinary:12.1f} {inside:15.1f} {inside / ordinary:6.2f}",
                  flush=True)
    finally:
        torch.set_num_threads(threads)
    print(f"(CPU, 1 thread, medians of {steps} steps, batch {BATCH[0]}x{BATCH[1]}; same weights bit for bit)")
    return dict(config=dict(CONFIG, batch=list(BATCH), steps=steps, threads=1), rows=rows)
