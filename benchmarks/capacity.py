"""
The largest model one GPU trains, per training setup (`python bench.py --only capacity`).

A Llama of 7B width (d = 4096, SwiGLU 11008, 32 heads with 8 key/value heads, GPT-2's 50304-token
vocabulary, untied) with its layer count searched: a probe builds the model on the GPU, turns
activation checkpointing on (model.checkpoint_blocks) and trains three optimizer steps on one
sequence of 2048 random tokens under BF16 autocast; the largest layer count whose probe does not
run out of memory is the setup's capacity. The search starts at the layer count the setup's bytes
per parameter predict and bisects from there (a probe costs a few seconds; the section runs in
minutes).

Per setup the result holds the largest layer count and its parameter count, peak memory, the
training state's bytes per parameter (weights + gradients + optimizer state, measured on the
tensors after the third backward, beside the arithmetic) and tokens/s at that size. Then one
fixed model that only the 4-bit setups fit is trained by each of them, to show the step time they
pay for it.

What limits each setup: its weights, gradients and optimizer state grow with the layer count
(16 B/param for torch AdamW with FP32 master weights down to ~3 B/param for BF16 weights with
4-bit states and the step inside backward); the activations of one block at a time (checkpointing
keeps only each block's input) and the vocabulary's logits are the rest.
"""

import gc
import time

import torch

from model import GPT, GPTConfig
from trainer.memory import optimizer_state_bytes

WIDTH_7B = dict(n_embd=4096, n_head=32, n_kv_head=8, ffn_hidden=11008, vocab_size=50304, pos="rope",
                mlp="swiglu", norm="rmsnorm", tie_embeddings=False, split_qkv=True)
T = 2048

# setup name -> (parameter dtype, optimizer, GaussWS on the block linears, step inside backward,
# bytes/param of weights + gradients + optimizer state by arithmetic: for TorchAO FP32 weights and
# grads + its 4-bit states (block 128, FP32 scales), for FlashOptim BF16 weights and grads + its
# 8-bit moments and 8-bit weight correction)
SETUPS = {
    "torch AdamW, FP32 master weights": ("fp32", "torch", False, False, 4 + 4 + 8),
    "torch AdamW, BF16 params": ("bf16", "torch", False, False, 2 + 2 + 4),
    "TorchAO AdamW4bit (FP32 params)": ("fp32", "torchao", False, False, 4 + 4 + 1.0625),
    "FlashOptim FlashAdamW (BF16 + 24-bit master)": ("bf16", "flashoptim", False, False, 2 + 2 + 2 + 1),
    "ours ZIP-SR, FP32 params": ("fp32", "zipsr", False, False, 4 + 4 + 1.0625),
    "ours ZIP-SR, BF16 params + master_weight_bits=24": ("bf16", "zipsr-mw24", False, False, 2 + 2 + 2.0625),
    "ours ZIP-SR, BF16 params": ("bf16", "zipsr", False, False, 2 + 2 + 1.0625),
    "ours GaussWS + ZIP-SR, FP32 params": ("fp32", "zipsr", True, False, 4 + 4 + 1.0625),
    "ours GaussWS + ZIP-SR, BF16 params + master_weight_bits=24": ("bf16", "zipsr-mw24", True, False, 2 + 2 + 2.0625),
    "ours GaussWS + ZIP-SR, BF16 params": ("bf16", "zipsr", True, False, 2 + 2 + 1.0625),
    "ours ZIP-SR, BF16 params, step in backward": ("bf16", "zipsr", False, True, 2 + 1.0625),
}
FOURBIT = ("torchao", "zipsr", "zipsr-mw24")


def make_optimizer(kind, params):
    """The optimizer of a setup, or None when its package is not importable (printed)."""
    hp = dict(lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    import adam4bit
    if kind == "torch":
        return torch.optim.AdamW(params, fused=True, **hp)
    if kind == "zipsr":
        return adam4bit.AdamW4bit(params, preset="zipsr", **hp)
    if kind == "zipsr-mw24":
        return adam4bit.AdamW4bit(params, preset="zipsr", master_weight_bits=24, **hp)
    try:
        if kind == "torchao":
            from torchao.optim import AdamW4bit
            return AdamW4bit(params, **hp)
        if kind == "flashoptim":
            from flashoptim import FlashAdamW
            return FlashAdamW(params, **hp)
    except ImportError as e:
        print(f"({kind} not importable: {e}; setup skipped)")
        return None
    raise ValueError(f"optimizer kind={kind!r}; allowed: torch, zipsr, zipsr-mw24, torchao, flashoptim")


def probe(setup, n_layer, steps=3, device="cuda"):
    """Train the 7B-width model with n_layer blocks for `steps` steps under setup (a SETUPS key).
    Returns a dict (params, peak_GiB, measured and arithmetic B/param, tokens_per_s) or None
    when the GPU ran out of memory; everything the probe allocated is freed either way. The
    optimizer's package must be importable (largest() checks before probing)."""
    import gaussws
    from lowbit import step_in_backward
    dtype, kind, pqt, in_backward, arith = SETUPS[setup]
    model = opt = handles = None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        torch.manual_seed(0)
        # build in the parameters' dtype: an FP32 build of a BF16 setup's model would not fit
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16 if dtype == "bf16" else torch.float32)
        try:
            with torch.device(device):
                model = GPT(GPTConfig(block_size=T, n_layer=n_layer, **WIDTH_7B))
                if pqt:
                    gaussws.apply_pqt(model, method="gaussws", parts="all")  # b_i stay FP32
        finally:
            torch.set_default_dtype(default)
        model.checkpoint_blocks = True
        opt = make_optimizer(kind, list(model.parameters()))
        if in_backward:
            handles = step_in_backward(opt)
        x = torch.randint(0, WIDTH_7B["vocab_size"], (1, T), device=device)
        times, state = [], None
        for i in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(x, x)
            loss.backward()
            if i == steps - 1:     # the training state as it stands before the last step
                ps = list(model.parameters())
                state = dict(weights=sum(p.numel() * p.element_size() for p in ps),
                             grads=sum(p.grad.numel() * p.grad.element_size() for p in ps if p.grad is not None))
            if not in_backward:
                opt.step()
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        state["optimizer"] = optimizer_state_bytes(opt)
        n = sum(p.numel() for p in model.parameters())
        return dict(n_layer=n_layer, params=n, peak_GiB=torch.cuda.max_memory_allocated() / 2 ** 30,
                    measured_B_per_param={k: v / n for k, v in state.items()},
                    total_measured=sum(state.values()) / n, total_arithmetic=arith,
                    step_s=min(times[1:]), tokens_per_s=T / min(times[1:]))
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        for h in handles or ():
            h.remove()
        del model, opt, handles
        gc.collect()
        torch.cuda.empty_cache()


def search_largest(fits, guess):
    """The largest n >= 1 with fits(n) not None, for fits false above some n: from `guess` up by
    50 % steps until one fails (or down by bisection from it), then bisection. Returns
    (n, fits(n)), or (0, None) when even 1 does not fit; None from fits means "does not fit"."""
    lo, hi, best = 0, None, None           # lo fits (0: none yet), hi does not (None: none yet)
    n = max(1, guess)
    while hi is None or hi - lo > 1:
        r = fits(n)
        if r is None:
            hi = n
        else:
            lo, best = n, r
        n = (lo + hi) // 2 if hi is not None else max(lo + 1, int(lo * 1.5))
        if hi == 1:
            break
    return lo, best


def largest(setup, device="cuda"):
    """The largest layer count whose probe fits, with its probe (None: the setup was skipped).
    The search starts where the setup's bytes/param put the whole GPU's memory."""
    arith = SETUPS[setup][4]
    total = torch.cuda.get_device_properties(device).total_memory
    d, f = WIDTH_7B["n_embd"], WIDTH_7B["ffn_hidden"]
    kv = WIDTH_7B["n_kv_head"] * (d // WIDTH_7B["n_head"])
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * f
    dtype = torch.bfloat16 if SETUPS[setup][0] == "bf16" else torch.float32
    if make_optimizer(SETUPS[setup][1], [torch.nn.Parameter(torch.zeros(256, device=device, dtype=dtype))]) is None:
        return None

    def fits(n):
        r = probe(setup, n, device=device)
        print(f"  {setup}: {n} layers -> " + ("out of memory" if r is None else f"{r['peak_GiB']:.1f} GiB"), flush=True)
        return r

    return search_largest(fits, int(0.9 * total / (per_layer * arith)))[1]


def bench_capacity(setups=tuple(SETUPS), device="cuda", on_row=None, n_layer=None):
    """Largest layer count per setup, then one fixed model that only the 4-bit setups fit trained
    by each of them (5 steps). Returns the JSON-ready dict; on_row(rows) after each setup.
    n_layer: instead, each setup trains that many layers (5 steps; None where it runs out of memory)."""
    if n_layer is not None:
        rows = {}
        for s in setups:
            rows[s] = r = probe(s, n_layer, steps=5, device=device)
            print(f"{s:60s} {n_layer:4d} layers " + ("out of memory" if r is None else
                  f"{r['params'] / 1e9:6.2f}B params peak {r['peak_GiB']:6.1f} GiB {r['tokens_per_s']:7.0f} tok/s"),
                  flush=True)
            if on_row is not None:
                on_row(rows)
        return dict(width=WIDTH_7B, tokens=T, batch=1, activation_checkpointing=True,
                    fixed_model=dict(n_layer=n_layer, rows=rows))
    rows = {}
    for s in setups:
        r = largest(s, device)
        if r is None:
            continue
        rows[s] = r
        if on_row is not None:
            on_row(rows)
        print(f"{s:60s} {r['n_layer']:4d} layers {r['params'] / 1e9:6.2f}B params peak {r['peak_GiB']:6.1f} GiB "
              f"state {r['total_measured']:.3f} B/param (arith {r['total_arithmetic']}) "
              f"{r['tokens_per_s']:7.0f} tok/s", flush=True)
    others = [r["n_layer"] for s, r in rows.items() if SETUPS[s][1] not in FOURBIT]
    fourbit = [s for s in rows if SETUPS[s][1] in FOURBIT]
    fixed = {}
    if others and fourbit:
        n = max(others) + 1
        for s in fourbit:
            if rows[s]["n_layer"] >= n:
                fixed[s] = probe(s, n, steps=5, device=device)
    return dict(width=WIDTH_7B, tokens=T, batch=1, activation_checkpointing=True, rows=rows,
                fixed_model=dict(n_layer=max(others) + 1 if others else None, rows=fixed))
