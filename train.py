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

This file is the setup and the loop; the flags, their defaults and checks are trainer/flags.py,
the optimizer and the schedule trainer/optim.py, checkpoints trainer/checkpoint.py, log.jsonl and
the start-up lines trainer/log.py, DDP / FSDP2 and threads trainer/dist.py.
"""

import contextlib
import math
import os
import sys
import time

import torch
import torch.distributed as dist

import data as datamod
import gaussws
from model import GPT, preset_config
from lowbit import step_in_backward
from trainer.checkpoint import (check_out_dir, check_resume_kind, check_resume_target, load_checkpoint,
                                load_state, lock_out_dir, resume_is_done, resume_path)
from trainer.dist import (clip_grad_norm_local, fsdp_micro_step, set_grad_accum, setup_distributed, setup_threads,
                          shard_model, unsharded, wrap_ddp)
from trainer.flags import end_iter, parse_args, resolve_args, tokens_per_step
from trainer.log import Interrupts, RunLog, read_log, resume_command, say_setup
from trainer.memory import check_activations_fit, params_to_bf16
from trainer.metrics import bits_params, evaluate, mean_bt
from trainer.optim import build_optimizer, get_lr, say_optimizer
from trainer.util import RunError, rank0, say


# ----------------------------------------------------------------------------- setup

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


def setup_optimizer(args, proc, model):
    """The optimizer of --optim (trainer/optim.py: its parameter groups, the AdamW4bit presets'
    LM head); under --fsdp the model is sharded first (FSDP2), so the states shard with it."""
    if args.fsdp:
        shard_model(model, proc.world, proc.device_type)
    return build_optimizer(args, model, proc.device_type)


def keep_run_length(args, ckpt, argv):
    """--resume without --max_iters or --tokens_per_param trains to the checkpoint's run's end (the
    device's default length would recompute its schedule). RunError when --stop_after is beyond it."""
    saved = ckpt["config"].get("max_iters")
    if saved is None or any(a.split("=")[0] in ("--max_iters", "--tokens_per_param") for a in argv):
        return
    args.max_iters, args.tokens_per_param = saved, None
    if args.stop_after is not None and args.stop_after > saved:
        raise RunError(f"--stop_after {args.stop_after}: must be <= --max_iters {saved} (the checkpoint's run)")


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
    if proc.ddp and not args.fsdp:
        model = wrap_ddp(model, proc)
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
            keep_run_length(args, ckpt, sys.argv[1:] if argv is None else argv)
        set_grad_accum(args, proc.world, ckpt)
        try:
            batches = setup_data(args, proc)
        except KeyboardInterrupt:   # Ctrl-C while a corpus is read or tokenized: one line, not a traceback
            raise RunError("interrupted while preparing the data: nothing was written (it is prepared again "
                           "next time)") from None
        model, replaced = setup_model(args, proc, batches)
        ended = ckpt is not None and ckpt["iter_num"] >= end_iter(args)   # only then is the log read here
        summary = next((r for r in reversed(read_log(os.path.join(args.out_dir, "log.jsonl")))
                        if r.get("type") == "summary"), None) if ended else None
        if ckpt is not None and resume_is_done(args, ckpt, summary is not None):   # the log kept as it is
            return summary
        say_setup(args, proc, batches, model, replaced)
        optimizer = setup_optimizer(args, proc, model)
        start_iter, best_val = 0, math.inf
        if ckpt is not None:
            start_iter, best_val = resume(args, ckpt, model, optimizer, proc.device_type)
            del ckpt
        say_optimizer(args, model, optimizer)
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
