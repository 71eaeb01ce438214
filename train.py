"""
Train a GPT with optional pseudo-quantization training (GaussWS / DiffQ, paper A) and optional
4-bit AdamW states (ZIP-SR / ZE-EDEN / TorchAO-style, paper B).

    python train.py                                     # CPU-sized defaults on CPU, GPT-2 124M on CUDA
    python train.py --method gaussws --optim zipsr      # the papers' combination
    python train.py --preset nano --max_iters 30 --device cpu   # a smoke run in seconds
    python train.py --stop_after 100                    # stop with a checkpoint, then
    python train.py --resume                            # go on from OUT_DIR/ckpt.pt
    python train.py --resume --max_iters 600            # train a finished 300-step run longer
    torchrun --standalone --nproc_per_node 2 train.py --preset gpt2-124m   # several GPUs (DDP)
    torchrun --standalone --nproc_per_node 2 train.py --fsdp               # sharded (FSDP2)

Defaults marked 'auto' depend on the device: on CPU a tiny byte-level model for a few hundred
steps (minutes), on CUDA GPT-2 124M with the GPT-2 tokenizer, BF16 autocast and torch.compile.
Everything is written to --out_dir: ckpt.pt (atomic), log.jsonl (one JSON object per step and per
eval, plus a summary), loss.png (when matplotlib is installed). A fresh run refuses an --out_dir
that holds a checkpoint: continue it with --resume, or start over with --overwrite. Ctrl-C (SIGINT)
or SIGTERM stops at the next step boundary with a checkpoint and prints the command that
continues the run (exit status 130 / 143).

Training longer: --resume with a larger --max_iters (or --tokens_per_param) goes on from the
checkpoint under the schedule recomputed for the new length N; every other flag must match, except
those that leave the numbers alone (eval, compile, device, threads, out_dir: RESUME_FREE). Warmup
and cooldown are shares of N, so WSD's cooldown moves to the last round(cooldown_frac * N) steps.
A run stopped on the plateau (--stop_after) goes on at the peak lr without a jump. A finished WSD
run of T steps has cooled down (its last step used lr * (1 - sqrt(1 - 1/D)), D its cooldown
length); resumed with N it goes back up at step T from that lr to the plateau lr, stays there and
cools down again over the new last steps; this holds when T lies on the new plateau
(round(warmup_frac * N) <= T < N - round(cooldown_frac * N), with the default shares
about T / 0.9 < N <= 10 T); otherwise step T takes the new cooldown's (or warmup's) lr. Cosine is
recomputed likewise, and the 4-bit optimizers' LM-head switch to SR moves to 90 % of N.
"""

import contextlib
import inspect
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import adam4bit
import data as datamod
import gaussws
from model import GPT, PRESETS, describe, preset_config
from lowbit import step_in_backward
from trainer.checkpoint import (check_out_dir, check_resume_kind, check_resume_target, load_checkpoint,
                                load_state, lock_out_dir, resume_is_done, resume_path)
from trainer.dist import clip_grad_norm_local, fsdp_micro_step, setup_distributed, shard_model, unsharded
from trainer.flags import (FOURBIT, OPTIMS, SCHEDULES, end_iter, optimizer_overrides, parse_args,
                           resolve_args, tokens_per_step)
from trainer.log import Interrupts, RunLog, read_log, resume_command
from trainer.util import RunError, rank0, say

TORCH_THREADS = torch.get_num_threads()  # PyTorch's own choice at import: OMP_NUM_THREADS or the physical cores


# ----------------------------------------------------------------------------- setup

def setup_threads(args, proc):
    """Set PyTorch's intra-op CPU threads for a CPU run and say how many: --threads; else a count
    the user chose (OMP_NUM_THREADS, or torch.set_num_threads before main) is kept; else the cores
    less one, at least 1. Leaving a core free matters under load: OpenMP threads wait for each
    other at the end of every op, so one thread descheduled by another process stalls them all
    (measured both ways in results/README.md)."""
    if proc.device_type != "cpu":
        return
    n = torch.get_num_threads()
    if args.threads is not None:
        n, why = args.threads, "--threads"
    elif os.environ.get("OMP_NUM_THREADS"):
        why = "OMP_NUM_THREADS"
    elif n != TORCH_THREADS:
        why = "set before train.py ran"
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        n, why = max(1, min(cores, TORCH_THREADS) - 1), f"{cores} cores less one, so a busy core does not stall each op"
    torch.set_num_threads(n)
    say(f"CPU threads: {n} ({why}); change with --threads N or OMP_NUM_THREADS=N")


def setup_data(args, proc):
    """datamod.Batches of --dataset (rank 0 prepares it, the others wait), checked to hold a
    micro-batch and the eval windows; fills --eval_windows 'auto'."""
    folder = None
    if proc.master:
        try:
            folder = datamod.prepare(args.dataset, args.tokenizer, data_dir=args.data_dir, max_tokens=args.max_tokens)
        except OSError as e:   # a folder that cannot be made or written, a source that cannot be read
            where, home = os.path.abspath(str(e.filename or "?")), os.path.abspath(args.data_dir)
            if where.startswith(home) or home.startswith(where):
                raise RunError(f"--data_dir {args.data_dir}: cannot prepare the dataset there ({e.strerror}: "
                               f"{e.filename}); give a folder you can write") from None
            raise RunError(f"--dataset {args.dataset}: {e.strerror}: {e.filename}") from None
        except (RuntimeError, ValueError) as e:  # offline download, empty corpus, ...
            raise RunError(str(e)) from None
    if proc.ddp:
        obj = [folder]
        dist.broadcast_object_list(obj, src=0)
        folder = obj[0]
    batches = datamod.Batches(folder, args.block_size, seed=args.seed)
    n_train, n_val = batches.n["train"], batches.n["val"]
    if n_train < args.block_size + 1 or n_val < args.block_size + 1:
        raise RunError(f"--block_size {args.block_size}: {folder} has only {n_train} train / "
                       f"{n_val} val tokens; use --block_size <= {min(n_train, n_val) - 1} or more data")
    if args.batch_size * args.block_size > n_train:
        raise RunError(f"--batch_size {args.batch_size} x --block_size {args.block_size} = "
                       f"{args.batch_size * args.block_size} tokens per micro-batch is more than the "
                       f"{n_train} training tokens in {folder}; use a smaller --batch_size")
    fit = (n_val - 1) // args.block_size  # validation windows that do not overlap
    default = 256 if proc.device_type == "cuda" else 64
    if args.eval_windows is None:
        args.eval_windows = min(default, fit)
        if args.eval_windows < default:
            say(f"eval on {fit} windows: all that fit in the val split of {folder} without overlap")
    elif args.eval_windows > fit:
        raise RunError(f"--eval_windows {args.eval_windows}: the val split of {folder} holds at most {fit} "
                       f"non-overlapping windows of {args.block_size} tokens; use --eval_windows <= {fit}")
    return batches


def setup_model(args, proc, batches):
    """(model, replaced): the GPT of --preset on the device, with PQT (gaussws.apply_pqt) on the
    --parts layers unless --method bf16 (replaced: their names). Sets --max_iters from
    --tokens_per_param, which needs the parameter count."""
    vocab = batches.meta["vocab_size"]
    if vocab > 256:  # GPT-2's 50257 -> 50304: a multiple of 64 runs faster
        vocab = -(-vocab // 64) * 64
    cfg = preset_config(args.preset, vocab_size=vocab, block_size=args.block_size)
    check_activations_fit(args, cfg, proc)
    model = GPT(cfg).to(proc.device)
    replaced = []
    if args.method != "bf16":
        replaced = gaussws.apply_pqt(model, method=args.method, parts=args.parts, b_init=args.b_init,
                                     b_target=args.b_target, seed=args.seed, memory=args.pqt_memory)
    if args.param_dtype == "bf16":
        params_to_bf16(model)
    model.checkpoint_blocks = args.activation_checkpointing
    if args.tokens_per_param is not None:
        args.max_iters = max(1, math.ceil(args.tokens_per_param * model.num_params() / tokens_per_step(args)))
        if args.stop_after is not None and args.stop_after > args.max_iters:
            raise RunError(f"--stop_after {args.stop_after}: must be <= max_iters {args.max_iters} "
                           f"(from --tokens_per_param {args.tokens_per_param:g})")
    return model, replaced


def check_activations_fit(args, cfg, proc):
    """RunError (one line) before the model is built when one micro-batch's activations cannot fit
    the device's memory: a --block_size far beyond the preset's context would otherwise run out
    of memory, or on a CPU swap for hours, inside the first step. The estimate is a floor: ~34
    bytes per token and width per block (Korthikanti et al. 2022, attention's memory linear in
    the length as with flash attention; ~2 per block and one block's 34 with
    --activation_checkpointing) plus the float32 logits and their gradient."""
    B, T, d = args.batch_size, args.block_size, cfg.n_embd
    per_block = 2 * cfg.n_layer + 34 if args.activation_checkpointing else 34 * cfg.n_layer
    need = B * T * d * per_block + 8 * B * T * cfg.vocab_size
    if proc.device_type == "cuda":
        have = torch.cuda.get_device_properties(proc.device).total_memory
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    if have and need > have:
        raise RunError(f"--block_size {T} with --batch_size {B}: one micro-batch's activations need at least "
                       f"{need / 2**30:.0f} GiB, more than this device's {have / 2**30:.0f} GiB (the preset's context "
                       f"is {PRESETS[args.preset]['block_size']}); lower --block_size or --batch_size")


def params_to_bf16(model):
    """--param_dtype bf16: the weights themselves in BF16, in place; the PQT bitwidths b_i stay
    FP32 (their small steps would round away in BF16)."""
    for name, p in model.named_parameters():
        if not name.endswith("b_i"):
            p.data = p.data.to(torch.bfloat16)


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
    """The optimizer named by --optim. 4-bit presets are told which parameter is the LM head (its
    first moment switches RTN -> SR for the last 10 % of training, paper B section 4); with tied
    embeddings that parameter is the token embedding. --v_codebook / --v_rounding, when given,
    replace the preset's second-moment codebook / rounding rule (checked by check_optimizer_flags).
    `args` is a complete train.py Namespace (code that sets a few flags by hand starts from
    build_parser().parse_args([]), as bench_training.py does)."""
    betas = (args.beta1, args.beta2)
    groups = param_groups(model, args.weight_decay, args.bits_wd)
    if args.optim == "adamw":
        return torch.optim.AdamW(groups, lr=args.lr, betas=betas, eps=args.eps, fused=device_type == "cuda")
    if args.optim in FOURBIT:
        opt = adam4bit.AdamW4bit(groups, lr=args.lr, betas=betas, eps=args.eps, weight_decay=args.weight_decay,
                                 preset=args.optim, seed=args.seed, param_rounding=args.param_rounding,
                                 master_weight_bits=args.master_weight_bits, capturable=args.capturable,
                                 **optimizer_overrides(args))
        opt.mark_lm_head(model.lm_head.weight)
        return opt
    if args.optim == "adam-mini":
        try:
            from adam_mini import Adam_mini
        except ImportError:
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


def resume(args, ckpt, model, optimizer, device_type):
    """Load model, optimizer and RNG state from the checkpoint; (start_iter, best_val_loss). The
    data order needs no state: it is a pure function of (seed, step, micro-batch)."""
    path = resume_path(args)
    if "dcp" in ckpt and not args.fsdp:
        raise RunError(f"--resume {path}: a --fsdp checkpoint folder; resume it with --fsdp")
    load_state(ckpt, model, optimizer, device_type, path)
    say(f"resumed from {path} at step {ckpt['iter_num']}")
    saved = ckpt["config"].get("max_iters")
    if saved is not None and saved != args.max_iters:
        say(f"--max_iters {args.max_iters} (the checkpoint's run had {saved}): the learning-rate schedule "
            f"is recomputed for {args.max_iters} steps")
    return ckpt["iter_num"], ckpt["best_val_loss"]


def set_grad_accum(args, world, ckpt=None):
    """--grad_accum when not given: the checkpoint's when resuming (the global batch stays, on any
    number of processes it divides), else one micro-batch per process. RunError (one line) when it
    does not divide by the number of processes."""
    given = args.grad_accum is not None
    if not given:
        args.grad_accum = ckpt["config"]["grad_accum"] if ckpt is not None else world
    if args.grad_accum % world:
        ours = not given and ckpt is not None
        raise RunError(f"--grad_accum {args.grad_accum}" + (" (the checkpoint's)" if ours else "")
                       + f" must be divisible by the number of processes ({world})"
                       + (f": resume it on a number of processes that divides {args.grad_accum} (a run that "
                          "should move to more processes later starts with a larger --grad_accum)" if ours else ""))


# ----------------------------------------------------------------------------- schedule

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


# ----------------------------------------------------------------------------- training loop

def train(args, proc, model, optimizer, batches, start_iter=0, best_val=math.inf, argv=()):
    """Train `model` from step start_iter to the --max_iters schedule's end (or --stop_after),
    with an eval and a checkpoint every --eval_interval steps and at the end. Returns the summary
    (also the last record of log.jsonl). On SIGINT / SIGTERM: a checkpoint at the next step
    boundary, a line with the command that continues (argv: this run's flags), and
    SystemExit(128 + signal number), i.e. exit status 130 / 143."""
    raw_model = model  # for eval, clipping, the penalty and the checkpoint
    if args.compile:
        say(f"compiling the model (torch.compile, mode {args.compile_mode}): the first step takes ~1 min "
            f"(a few on a CPU)")
        model = torch.compile(model, mode=args.compile_mode)
    graphs = args.compile and "reduce-overhead" in args.compile_mode
    if proc.ddp and not args.fsdp:  # buffers (GaussWS seed state) advance identically on every rank: no broadcast
        no_sync = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters \
            else "broadcast_buffers"     # (torch >= 2.13 renamed it and warns on the old name)
        model = DDP(model, device_ids=[torch.device(proc.device).index] if proc.device_type == "cuda" else None,
                    **{no_sync: False})
    pt_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    ctx = (torch.autocast(device_type=proc.device_type, dtype=pt_dtype) if pt_dtype != torch.float32
           else contextlib.nullcontext())
    bits = bits_params(raw_model)
    penalty = bool(args.bits_lambda) and bool(bits)
    accum = args.grad_accum // proc.world  # micro-batches per step on this rank
    if args.step_in_backward:   # each parameter steps in its gradient's hook; the squares sum for the log
        if accum > 1:
            raise RunError(f"--step_in_backward with --grad_accum {args.grad_accum} (the checkpoint's): each "
                           f"micro-step would step on a partial gradient; resume with --grad_accum 1")
        sq = torch.zeros((), device=proc.device)
        step_in_backward(optimizer, on_grad=lambda p: sq.add_(p.grad.detach().float().square().sum()))
    stop = end_iter(args)
    log = RunLog(args, proc, start_iter, best_val)
    interrupts = Interrupts(proc)
    it = start_iter
    try:
        while True:
            # eval and checkpoint (not again at the step we resumed at: done before saving)
            at_end = it >= stop
            if (it % args.eval_interval == 0 or at_end) and not (args.resume and it == start_iter):
                log.flush()
                if args.eval_windows > 0:
                    val = evaluate(raw_model, batches, args.eval_windows, args.batch_size, ctx, proc.device,
                                   proc.rank, proc.world, proc.ddp, args.fsdp)
                    with unsharded(raw_model, args.fsdp):
                        log.eval(it, val, gaussws.bitwidth_stats(raw_model) if bits else None)
                if it > start_iter or at_end:
                    log.checkpoint(it, raw_model, optimizer)
                log.t_ref = time.time()  # eval and checkpoint time is not step time
            if at_end:
                break
            signum = interrupts.requested()
            if signum:  # Ctrl-C / SIGTERM since the last step: every rank stops here, with a checkpoint
                log.interrupted(signum, it, raw_model, optimizer, interrupts.group, resume_command(argv, proc))
            # one optimizer step
            lr = get_lr(it, args.max_iters, args.lr, args.schedule, args.warmup_frac,
                        args.cooldown_frac, args.min_lr_frac)
            for g in optimizer.param_groups:
                g["lr"] = lr
            if hasattr(optimizer, "set_progress"):  # AdamW4bit: LM-head m switches to SR near the end
                optimizer.set_progress(it / args.max_iters)
            loss_sum = torch.zeros((), device=proc.device)
            for micro in range(accum):
                x, y = batches.train_batch(args.batch_size, it, proc.rank * accum + micro)
                if proc.device_type == "cuda":
                    x = x.pin_memory().to(proc.device, non_blocking=True)
                    y = y.pin_memory().to(proc.device, non_blocking=True)
                if args.fsdp:
                    fsdp_micro_step(raw_model, micro == accum - 1, proc.world)
                elif proc.ddp:  # all-reduce gradients only on the last micro-step (set before forward)
                    model.require_backward_grad_sync = micro == accum - 1
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                with ctx:
                    _, loss = model(x, y)
                    total = (loss + args.bits_lambda * gaussws.bitwidth_penalty(raw_model)) if penalty else loss
                (total / accum).backward()
                loss_sum += loss.detach()
            if proc.ddp:
                dist.all_reduce(loss_sum)  # SUM (gloo has no AVG); divided by world below
            clip = args.grad_clip if args.grad_clip > 0 else float("inf")
            if args.step_in_backward:     # stepped already, in backward
                gnorm = sq.sqrt()
                sq.zero_()
            else:
                gnorm = (clip_grad_norm_local(raw_model.parameters(), clip, proc.world) if args.fsdp
                         else torch.nn.utils.clip_grad_norm_(raw_model.parameters(), clip))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            stats = [loss_sum / (accum * proc.world), gnorm.float()]
            if bits:
                stats.append(mean_bt(bits, args.b_init, args.b_target, proc.world))
            log.step(it, lr, torch.stack(stats))
            it += 1
            log.bar.update(1)
    finally:
        interrupts.restore()
        log.bar.close()
    bt = mean_bt(bits, args.b_init, args.b_target, proc.world)
    go_on = resume_command(argv, proc, drop_stop=True) if it < args.max_iters else None   # --stop_after
    return log.finish(it, raw_model, optimizer, bt.item() if bt is not None else None, go_on)


def bits_params(model):
    """The PQT bitwidth parameters b_i ([] without PQT)."""
    return [p for n, p in model.named_parameters() if n.endswith("b_i")]


def mean_bt(bits_params, b_init, b_target, world=1):
    """Mean tile bitwidth b_t over all PQT tiles (paper A eq. 11: b_t = b_target + b_i (b_init - b_target)),
    as a 0-dim tensor (no device sync). FSDP2 (DTensor b_i, `world` ranks): each rank's shards,
    summed over the ranks in one all-reduce (none with one rank)."""
    if not bits_params:
        return None
    with torch.no_grad():   # DTensor.to_local() costs ~40 us a call with autograd on, ~2 us without
        local = [p.to_local() if hasattr(p, "to_local") else p.detach() for p in bits_params]
    b_i = torch.cat([x.flatten() for x in local]).float()
    if world > 1 and hasattr(bits_params[0], "to_local"):
        total = torch.stack([b_i.sum(), torch.tensor(float(b_i.numel()), device=b_i.device)])
        dist.all_reduce(total)
        b_i = total[0] / total[1]
    else:
        b_i = b_i.mean()
    return b_target + b_i * (b_init - b_target)


@torch.no_grad()
def evaluate(model, batches, n_windows, batch_size, ctx, device, rank=0, world=1, ddp=False, fsdp=False):
    """Mean cross-entropy (nats/token) over the fixed validation windows, split across ranks.
    Uses the plain (uncompiled, unwrapped) model in eval mode. Under FSDP2 (fsdp) every forward
    all-gathers, so a rank with fewer batches runs extra forwards whose loss is not counted."""
    was_training = model.training
    model.eval()
    tot = torch.zeros(2, dtype=torch.float64, device=device)
    bar = tqdm(total=len(batches.val_starts(n_windows)[rank::world]), desc="eval", unit="window", leave=False,
               delay=2, disable=rank != 0)  # shown only when an eval takes more than 2 s
    for x, y in batches.val_batches(n_windows, batch_size, rank, world):
        x, y = x.to(device), y.to(device)
        with ctx:
            _, loss = model(x, y)
        tot[0] += loss.double() * y.numel()
        tot[1] += y.numel()
        bar.update(len(x))
    if fsdp:
        most = -(-len(batches.val_starts(n_windows)[0::world]) // batch_size)   # rank 0 has the most windows
        mine = -(-len(batches.val_starts(n_windows)[rank::world]) // batch_size)
        for _ in range(most - mine):
            with ctx:
                model(torch.zeros(1, batches.block_size, dtype=torch.long, device=device))
    bar.close()
    if ddp:
        dist.all_reduce(tot)
    model.train(was_training)
    return (tot[0] / tot[1]).item()


# ----------------------------------------------------------------------------- messages

def say_setup(args, proc, batches, model, replaced):
    meta, n_params = batches.meta, model.num_params()
    say(f"device {proc.device} x{proc.world}, dtype {args.dtype}, params {args.param_dtype}, compile {args.compile}")
    say(f"data {batches.folder}: {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens"
        + (f" (capped at {meta['max_tokens']:,})" if meta.get("max_tokens") else "")
        + f", tokenizer {meta['tokenizer']} ({meta['source']})")
    note = ""
    if args.preset.startswith("llama"):
        note = " (the papers count Llama sizes with a 32000-token vocabulary; this vocabulary changes the count)"
    if meta["tokenizer"] == "byte" and PRESETS[args.preset].get("block_size", 0) >= 1024:
        note += (f" (with byte tokens: a 256-entry vocabulary, not the {args.preset} of GPT-2's tokenizer; "
                 f"--tokenizer gpt2 for that)")
    say(f"model {args.preset}: {describe(model.config)}; {n_params:,} parameters = {n_params / 1e6:.2f}M{note}")
    if replaced:
        say(f"PQT {args.method}[{args.parts}] on {len(replaced)} linear layers, "
            f"{sum(p.numel() for p in bits_params(model)):,} tiles (b_i), b_init {args.b_init}, b_target {args.b_target}")


def say_optimizer(args, model):
    overrides = "".join(f" --{k} {v}" for k, v in optimizer_overrides(args).items())
    n = tokens_per_step(args)
    say(f"optimizer {args.optim}{overrides}, lr {args.lr:g} ({args.schedule}), {args.max_iters} steps of "
        f"{n:,} tokens ({args.batch_size} x {args.block_size} x {args.grad_accum}), "
        f"{args.max_iters * n / max(model.num_params(), 1):.2f} tokens/param")


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


# ----------------------------------------------------------------------------- main

def main(argv=None):
    """Parse argv (list of str; None = sys.argv[1:]) and train. Returns the summary dict.
    Bad flags raise SystemExit(2) with a one-line message; RunError for a diverged run or a bad
    checkpoint."""
    parser, args = parse_args(argv)
    proc = setup_distributed(args)
    resolve_args(args, parser, proc.device_type == "cuda")
    setup_threads(args, proc)
    lock = None
    try:
        lock = lock_out_dir(args, proc)   # this run owns --out_dir until it ends, however it ends
        torch.manual_seed(args.seed)
        if proc.device_type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        check_out_dir(args, proc)
        if args.resume:
            check_resume_kind(args)
        ckpt = load_checkpoint(resume_path(args)) if args.resume else None  # a bad file fails before data
        if ckpt is not None:
            check_resume_target(args)
        set_grad_accum(args, proc.world, ckpt)
        batches = setup_data(args, proc)
        model, replaced = setup_model(args, proc, batches)
        ended = ckpt is not None and ckpt["iter_num"] >= end_iter(args)   # only then is the log read here
        summary = next((r for r in reversed(read_log(os.path.join(args.out_dir, "log.jsonl")))
                        if r.get("type") == "summary"), None) if ended else None
        if ckpt is not None and resume_is_done(args, ckpt, summary is not None):   # the log kept as it is
            return summary
        say_setup(args, proc, batches, model, replaced)
        if args.fsdp:
            shard_model(model, proc.world, proc.device_type)
        optimizer = build_optimizer(args, model, proc.device_type)
        start_iter, best_val = 0, math.inf
        if ckpt is not None:
            start_iter, best_val = resume(args, ckpt, model, optimizer, proc.device_type)
            del ckpt
        say_optimizer(args, model)
        if args.optim in FOURBIT and args.optim != "fp32":
            say(quantized_summary(model, optimizer))
        return train(args, proc, model, optimizer, batches, start_iter, best_val,
                     argv=sys.argv[1:] if argv is None else argv)
    finally:
        if lock is not None:
            lock.release()
        if proc.ddp:
            dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except RunError as e:   # one write: under torchrun the ranks' lines do not run into each other
        sys.stderr.write(f"train.py: error{'' if rank0() else ' (rank ' + os.environ['RANK'] + ')'}: {e}\n")
        sys.exit(1)
