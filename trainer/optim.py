"""train.py's optimizer side: the AdamW parameter groups, the optimizer --optim names, the
learning-rate schedule, and the start-up lines about them. Builds optimizers; reads no file."""

import math

import torch

import adam4bit
from trainer.flags import ADAMW4BIT_PRESETS, FOURBIT_PRESETS, OPTIMS, SCHEDULES, optimizer_overrides, tokens_per_step
from trainer.util import RunError, say


def param_groups(model, weight_decay, bits_wd):
    """AdamW groups: matrices/embeddings with weight decay, vectors (norms, biases) without, and the
    PQT bitwidth parameters b_i in their own group with weight decay bits_wd (paper A eqs. 11-12:
    decay on b_i pulls b_t toward b_target)."""
    decay, no_decay, bits = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name.endswith("b_i"):
            bits.append(p)
        elif p.dim() >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
              {"params": bits, "weight_decay": bits_wd, "name": "b_i"}]
    return [g for g in groups if g["params"]]


def build_optimizer(args, model, device_type):
    """The optimizer named by --optim. AdamW4bit presets are told which parameter is the LM head
    (its first moment switches RTN -> SR for the last 10 % of training, paper B section 4); with
    tied embeddings that parameter is the token embedding. --v_codebook / --v_rounding, when given,
    replace the preset's second-moment codebook / rounding rule (checked with the flags).
    `args` is a complete train.py Namespace (code that sets a few flags by hand starts from
    trainer.flags.build_parser().parse_args([]), as benchmarks/training.py does)."""
    betas = (args.beta1, args.beta2)
    groups = param_groups(model, args.weight_decay, args.bits_wd)
    if args.optim == "adamw":
        return torch.optim.AdamW(groups, lr=args.lr, betas=betas, eps=args.eps, fused=device_type == "cuda")
    if args.optim in ADAMW4BIT_PRESETS:
        opt = adam4bit.AdamW4bit(groups, lr=args.lr, betas=betas, eps=args.eps, weight_decay=args.weight_decay,
                                 preset=args.optim, seed=args.seed, param_rounding=args.param_rounding,
                                 master_weight_bits=args.master_weight_bits, capturable=args.capturable,
                                 **optimizer_overrides(args))
        opt.mark_lm_head(model.lm_head.weight)
        return opt
    if args.optim == "adam-mini":
        try:
            from adam_mini import Adam_mini
        except ImportError:   # (the flags' check refuses it first where the package is missing)
            raise RunError("--optim adam-mini needs the adam-mini package (pip install adam-mini)") from None
        c = model.config
        opt = Adam_mini(named_parameters=model.named_parameters(), lr=args.lr, betas=betas, eps=args.eps,
                        weight_decay=args.weight_decay, dim=c.n_embd, n_heads=c.n_head, n_kv_heads=c.n_kv_head)
        # tell Adam-mini our layer names (its defaults follow HF/Llama naming)
        for attr, names in (("wqk_names", {"attn.q.weight", "attn.k.weight"}), ("wv_names", {"attn.v.weight"}),
                            ("embd_names", {"wte"}), ("output_names", {"lm_head"})):
            if isinstance(getattr(opt, attr, None), set):
                getattr(opt, attr).update(names)
        return opt
    raise ValueError(f"optim={args.optim!r}; allowed: {', '.join(OPTIMS)}")


def get_lr(it, max_iters, lr, schedule="wsd", warmup_frac=0.1, cooldown_frac=0.1, min_lr_frac=0.1):
    """Learning rate for update `it` (0-based) of `max_iters`.

    All schedules warm up linearly over the first round(warmup_frac * max_iters) updates
    (lr * (it + 1) / W). Then
      wsd:      constant lr, and over the last D = round(cooldown_frac * max_iters) updates the
                multiplier 1 - sqrt(u), u = (it - (max_iters - D)) / D in [0, 1): the first cooldown
                update uses the peak, the value reaches 0 at it = max_iters (paper B App. B)
      cosine:   half-cosine from lr down to min_lr_frac * lr at it = max_iters
      constant: lr
    """
    W = max(1, round(warmup_frac * max_iters)) if warmup_frac > 0 else 0
    if it < W:
        return lr * (it + 1) / W
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        ratio = min(1.0, (it - W) / max(1, max_iters - W))
        return lr * (min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * ratio)))
    if schedule == "wsd":
        D = round(cooldown_frac * max_iters)
        start = max_iters - D
        if it < start:
            return lr
        if it >= max_iters:
            return 0.0
        return lr * (1 - math.sqrt((it - start) / D))
    raise ValueError(f"schedule={schedule!r}; allowed: {', '.join(SCHEDULES)}")


def _count(n):
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else str(n)


def quantized_summary(model, optimizer, show=4):
    """One line saying which parameters get 4-bit AdamW states (optimizer.is_quantized) and which
    stay FP32 (fewer than 4096 elements, or not a multiple of the quantization block), naming the
    `show` largest FP32 ones."""
    q, f = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (q if optimizer.is_quantized(p) else f).append((p.numel(), name))
    f.sort(key=lambda x: -x[0])
    names = ", ".join(n for _, n in f[:show]) + (f", +{len(f) - show} more" if len(f) > show else "")
    return (f"4-bit states: {len(q)} tensors ({_count(sum(n for n, _ in q))} params); FP32 states: {len(f)} "
            f"tensors ({_count(sum(n for n, _ in f))} params" + (f": {names})" if f else ")"))


def say_optimizer(args, model, optimizer):
    """The optimizer's start-up line (flags, schedule, tokens), and for a preset with 4-bit states
    which tensors get them (quantized_summary)."""
    overrides = "".join(f" --{k} {v}" for k, v in optimizer_overrides(args).items())
    n = tokens_per_step(args)
    say(f"optimizer {args.optim}{overrides}, lr {args.lr:g} ({args.schedule}), {args.max_iters} steps of "
        f"{n:,} tokens ({args.batch_size} x {args.block_size} x {args.grad_accum}), "
        f"{args.max_iters * n / max(model.num_params(), 1):.2f} tokens/param")
    if args.optim in FOURBIT_PRESETS:
        say(quantized_summary(model, optimizer))
