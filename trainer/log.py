"""train.py's record of a run: the start-up lines (say_setup), RunLog (log.jsonl, the checkpoint
calls, the progress bar and the summary), read_log, loss.png, and the SIGINT / SIGTERM handling
that stops at a step boundary. Writes log.jsonl and loss.png in --out_dir, and the checkpoints
through trainer/checkpoint.py (with --overwrite it first removes the old ones); rank 0 only, except
the collective DCP save."""

import json
import math
import os
import shlex
import shutil
import signal
import socket
import threading
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from model import PRESETS, describe
from trainer.checkpoint import (CKPT_FORMAT, atomic_write, checkpoints_in, ckpt_path, resume_path, run_config,
                                save_checkpoint, save_dcp_checkpoint)
from trainer.flags import tokens_per_step, what_trains
from trainer.memory import optimizer_state_bytes, peak_memory_mb
from trainer.metrics import bits_params
from trainer.util import RunError, say


def machine(device):
    """Where a run trained, for its summary: {"device", "torch", "triton"} (a comparison read back
    on another machine still says where its numbers come from)."""
    import triton
    name = torch.cuda.get_device_name(device) if str(device).startswith("cuda") else "cpu"
    return {"device": name, "torch": torch.__version__, "triton": triton.__version__}


class Interrupts:
    """SIGINT / SIGTERM during training. The first one asks for a checkpoint at the next step
    boundary: the handler only records the signal, and the loop asks requested() at each step
    boundary. Under DDP the flag is all-reduced (MAX, over gloo on the CPU: no device sync) so that
    every rank stops at the same step. A second signal, ECHO_S seconds or more after the first,
    exits at once with status 128 + its number (the last checkpoint is intact: checkpoints are
    replaced atomically); one sooner is taken for the same Ctrl-C passed on again (torchrun
    forwards it to workers that already got it).

    A Python handler runs only between bytecodes of the main thread, so a step stuck in one long
    op (a huge --block_size) would delay both: the signals are therefore also read from
    signal.set_wakeup_fd by a watcher thread, which the C-level handler wakes at once. restore()
    puts the previous handlers back. Handlers can only be set from the main thread; elsewhere
    nothing is caught."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    ECHO_S = 2.0

    def __init__(self, proc):
        self.proc, self.signum, self.old = proc, 0, {}
        self.group, self.first, self.wake = None, None, None
        if proc.ddp and dist.get_backend() != "gloo":  # every rank creates it, in the same order
            self.group = dist.new_group(backend="gloo")
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self.old[s] = signal.signal(s, self._handle)
            r, w = socket.socketpair()
            w.setblocking(False)
            self.old_fd = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
            self.wake = (r, w)
            threading.Thread(target=self._watch, args=(r,), daemon=True, name="train-signals").start()

    def _handle(self, signum, frame):
        pass   # only replaces the default action: the watcher, woken by the same signal, counts it

    def _seen(self, signum):
        now = time.monotonic()
        if self.first is None:
            self.first, self.signum = now, signum
            os.write(2, f"\n{signal.Signals(signum).name}: stopping at the next step boundary with a checkpoint "
                        f"(again to exit at once)\n".encode())
        elif now - self.first >= self.ECHO_S:
            os.write(2, f"\n{signal.Signals(signum).name} again: exiting now, without a new checkpoint (an earlier "
                        f"one in --out_dir is intact)\n".encode())
            os._exit(128 + signum)

    def _watch(self, r):
        while True:
            try:
                data = r.recv(64)
            except OSError:
                return
            if not data:   # restore() closed the pair
                return
            for signum in data:
                if signum in self.SIGNALS:
                    self._seen(signum)

    def requested(self):
        """The signal number if any rank received one (0: none); a collective call under DDP."""
        if not self.proc.ddp:
            return self.signum
        flag = torch.tensor([self.signum])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag)

    def restore(self):
        for s, handler in self.old.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        self.old = {}
        if self.wake is not None:
            signal.set_wakeup_fd(self.old_fd)
            for sock in self.wake:
                sock.close()
            self.wake = None


def resume_command(argv, proc, drop_stop=False):
    """The command line that continues this run: argv without --resume [PATH] / --overwrite (and
    with drop_stop, without --stop_after N), plus --resume (under torchrun, the torchrun launch)."""
    kept, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a == "--resume":
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("-")  # its PATH
        elif drop_stop and a == "--stop_after":
            skip = True
        elif not (a.startswith("--resume=") or a == "--overwrite" or (drop_stop and a.startswith("--stop_after="))):
            kept.append(a)
    launch = (f"torchrun --standalone --nproc_per_node {proc.world} train.py" if proc.ddp else "python train.py")
    return " ".join([launch, shlex.join(kept), "--resume"] if kept else [launch, "--resume"])


class RunLog:
    """OUT_DIR/log.jsonl, OUT_DIR/ckpt.pt and the progress bar of one run; only rank 0 writes.

    log.jsonl holds one record per step ({"type": "step", ...}), per eval ("eval"), a diverged
    step ("error") and a final "summary". A resumed run keeps the records up to its checkpoint
    (a crashed tail and the old summary are dropped), so the log always covers the whole run."""

    def __init__(self, args, proc, start_iter, best_val):
        self.args, self.proc, self.start_iter = args, proc, start_iter
        self.path = os.path.join(args.out_dir, "log.jsonl")
        self.ckpt_path = ckpt_path(args)
        self.file, kept = None, []
        if proc.master:
            os.makedirs(args.out_dir, exist_ok=True)
            if not args.resume or args.overwrite:  # no old checkpoint, of either kind, may resume the new log
                for p in checkpoints_in(args.out_dir):
                    shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
            if args.resume:
                # the run's records up to its checkpoint, from the log beside the checkpoint resumed
                # (this --out_dir's, or that of --resume PATH in another folder)
                source = os.path.join(os.path.dirname(os.path.abspath(resume_path(args))), "log.jsonl")
                kept = [r for r in read_log(source) if (r.get("type") == "step" and r["iter"] < start_iter)
                        or (r.get("type") == "eval" and r["iter"] <= start_iter)]
                # a kill during the rewrite leaves the old log whole
                atomic_write(self.path, lambda f: f.writelines(json.dumps(r) + "\n" for r in kept), "w")
            self.file = open(self.path, "a" if args.resume else "w")
        self.bar = tqdm(total=args.max_iters, initial=start_iter, disable=not proc.master, dynamic_ncols=True,
                        mininterval=0.5, desc="train")
        old = [r["val_loss"] for r in kept if r.get("type") == "eval"]  # a resumed run's earlier evals
        self.first_val, self.last_val = (old[0], old[-1]) if old else (None, None)
        self.n_evals = len(old)
        self.best_val = best_val
        self.pending, self.step_times, self.recent_losses = None, [], []
        self.last_ckpt = start_iter if args.resume else None
        self.t_ref = time.time()  # start of the step being timed
        self.t_start = time.time()

    def write(self, rec):
        if self.file:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()

    def step(self, it, lr, stats):
        """Log step `it`; stats: loss, grad norm[, mean b_t] on the device. On CUDA the numbers
        are copied to pinned memory without blocking and read after the next step is queued: a
        plain .item() would wait for everything queued so far and leave the GPU idle while the
        CPU prepares the next step."""
        if self.proc.device_type != "cuda":
            self.pending = (it, stats, None, lr)
            self.flush()
            return
        host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
        host.copy_(stats, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.flush()
        self.pending = (it, host, event, lr)

    def flush(self):
        """Read back the pending step's numbers (waits for the device) and log them. RunError when
        the loss or grad norm is not finite; the last checkpoint is left as it is."""
        if self.pending is None:
            return
        it, stats, event, lr = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()  # waits for this step's numbers only, not for the step queued after it
        vals = stats.tolist()
        loss, gnorm = vals[0], vals[1]
        now = time.time()
        dt, self.t_ref = now - self.t_ref, now
        if not (math.isfinite(loss) and math.isfinite(gnorm)):
            msg = (f"loss {loss} / grad norm {gnorm} at step {it}: training diverged, stopping. "
                   + (f"The last good checkpoint {self.ckpt_path} (step {self.last_ckpt}) is left intact."
                      if self.last_ckpt is not None else "No checkpoint was written yet."))
            self.write({"type": "error", "iter": it, "message": msg})
            raise RunError(msg)
        self.step_times.append(dt)
        self.recent_losses.append(loss)
        n = tokens_per_step(self.args)
        rec = {"type": "step", "iter": it, "loss": loss, "lr": lr, "grad_norm": gnorm,
               "tokens_per_s": n / dt, "dt_ms": dt * 1000, "peak_mem_mb": peak_memory_mb(self.proc.device_type)}
        if len(vals) > 2:
            rec["b_t_mean"] = vals[2]
        self.write(rec)
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{n / dt:,.0f}", lr=f"{lr:.2e}", refresh=False)

    def eval(self, it, val, bits=None):
        """Log validation loss `val` at step `it`, with the mean training loss since the last eval
        and, under PQT, the bitwidth statistics `bits`."""
        self.first_val = val if self.first_val is None else self.first_val
        self.last_val, self.best_val = val, min(self.best_val, val)
        self.n_evals += 1
        train_loss = float(np.mean(self.recent_losses)) if self.recent_losses else None
        self.recent_losses.clear()
        rec = {"type": "eval", "iter": it, "val_loss": val, "train_loss": train_loss,
               "time_s": time.time() - self.t_start}
        if bits is not None:
            rec["bits"] = bits
        self.write(rec)
        if self.proc.master:
            tl = f"{train_loss:.4f}" if train_loss is not None else "-"
            self.bar.write(f"step {it}: val loss {val:.4f}, train loss {tl}")

    def checkpoint(self, it, model, optimizer):
        """ckpt.pt for step `it` (next step to run), written atomically by rank 0; under --fsdp the
        DCP folder ckpt, written by every rank (save_dcp_checkpoint). RunError (one line, the
        reason) when it cannot be written (disk full, ...); the previous one is kept."""
        meta = {"format": CKPT_FORMAT, "iter_num": it, "best_val_loss": self.best_val,
                "config": run_config(self.args), "model_config": asdict(model.config),
                # the training data order is a pure function of (seed, rank, step, micro-step)
                "data_rng": {"scheme": "numpy default_rng([seed, step, global micro-batch])",
                             "seed": self.args.seed, "next_step": it}}
        rng = {"torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state() if self.proc.device_type == "cuda" else None}
        if self.proc.master or self.args.fsdp:
            try:
                if self.args.fsdp:
                    save_dcp_checkpoint(self.ckpt_path, meta, model, optimizer, rng, self.proc.master)
                else:
                    save_checkpoint(self.ckpt_path, dict(meta, model=model.state_dict(),
                                                         optimizer=optimizer.state_dict(), rng=rng))
            except (OSError, RuntimeError) as e:  # torch.save reports some write errors as RuntimeError
                reason = getattr(e, "strerror", None) or (str(e).splitlines() or [type(e).__name__])[0][:200]
                kept = (f"{self.ckpt_path} (step {self.last_ckpt}) is left intact" if self.last_ckpt is not None
                        else "no checkpoint was written")
                raise RunError(f"--out_dir {self.args.out_dir}: cannot write the checkpoint for step {it} "
                               f"({reason}); {kept}") from None
        self.last_ckpt = it

    def interrupted(self, signum, it, model, optimizer, group, resume_cmd):
        """Stop at step `it` after a signal: checkpoint (unless one is there), close the log, print
        the command that continues, exit with status 128 + signum (130 for SIGINT, 143 for SIGTERM)."""
        self.flush()
        if self.last_ckpt != it:
            self.checkpoint(it, model, optimizer)
        if self.proc.ddp:  # no rank exits before rank 0 has written the checkpoint
            dist.barrier(group=group)
        self.bar.close()
        if self.file:
            self.file.close()
        say(f"{signal.Signals(signum).name}: stopped at step {it} with a checkpoint in {self.ckpt_path}; "
            f"continue with: {resume_cmd}")
        raise SystemExit(128 + signum)

    def finish(self, it, model, optimizer, b_t_mean=None, go_on=None):
        """Log and print the summary of a run that stopped before step `it` (and, when it stopped
        at --stop_after, the command `go_on` that continues it); loss.png; returns the summary."""
        args, elapsed = self.args, time.time() - self.t_start
        warm = self.step_times[min(len(self.step_times) - 1, 5):] if self.step_times else []  # skip compile/warmup
        summary = {"type": "summary", "iters": it, "max_iters": args.max_iters, "start_iter": self.start_iter,
                   "tokens": (it - self.start_iter) * tokens_per_step(args), "time_s": elapsed,
                   "tokens_per_s": tokens_per_step(args) / float(np.median(warm)) if warm else None,
                   "first_val_loss": self.first_val, "final_val_loss": self.last_val,
                   "best_val_loss": self.best_val if math.isfinite(self.best_val) else None,
                   "peak_mem_mb": peak_memory_mb(self.proc.device_type),
                   "optimizer_state_mb": optimizer_state_bytes(optimizer) / 2**20,
                   "params": model.num_params(), "preset": args.preset, "method": args.method, "optim": args.optim,
                   **what_trains(args),
                   "world": self.proc.world, "checkpoint": self.ckpt_path if self.last_ckpt is not None else None,
                   "machine": machine(self.proc.device)}
        if b_t_mean is not None:
            summary["b_t_mean"] = b_t_mean
        self.write(summary)
        if not self.proc.master:
            return summary
        # first -> last over this log's evals (a resume into another --out_dir has only its own)
        val = ""
        if self.n_evals == 1:
            val = f"val loss {self.last_val:.4f}, "
        elif self.n_evals > 1:
            val = f"val loss {self.first_val:.4f} -> {self.last_val:.4f}, "
        say(f"done: {it - self.start_iter} steps" + (f" (resumed at step {self.start_iter})" if self.start_iter else "")
            + f" in {elapsed:.1f}s, "
            + (f"{summary['tokens_per_s']:,.0f} tokens/s (median), " if summary["tokens_per_s"] else "")
            + val
            + f"peak memory {summary['peak_mem_mb']:,.0f} MiB, optimizer state {summary['optimizer_state_mb']:.2f} MiB"
            + (" per process" if self.proc.world > 1 else "")
            + (f", mean b_t {b_t_mean:.3f}" if b_t_mean is not None else ""))
        say(f"checkpoint {self.ckpt_path}, log {self.path}")
        if go_on:
            say(f"stopped at --stop_after {it} of {args.max_iters} steps; continue with: {go_on}")
        if args.plot:
            say(plot_losses(self.path, os.path.join(args.out_dir, "loss.png")))
        self.file.close()
        return summary


def say_setup(args, proc, batches, model, replaced):
    """The start-up lines: what trains where (what_trains: a --method bf16 run on CPU trains float32
    weights without autocast), the data, the model, and PQT's layers (`replaced`: their names)."""
    meta, n_params, runs = batches.meta, model.num_params(), what_trains(args)
    weights, autocast = runs["weights_dtype"], runs["autocast_dtype"]
    pqt = f"PQT {runs['pqt']}" if runs["pqt"] else "no PQT" + (
        "" if autocast else " (--method bf16 names no dtype: --dtype bfloat16 for BF16 autocast)")
    say(f"device {proc.device} x{proc.world}: {weights} weights, "
        + (f"{autocast} autocast" if autocast else f"no autocast (math in {weights})")
        + f", {pqt}, compile {'on' if args.compile else 'off'}")
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


def read_log(path):
    """Records of a log.jsonl (list of dicts; [] when the file is missing). A last line that is not
    JSON (a kill mid-append) is skipped with a note; such a line elsewhere is a RunError naming the
    file and line."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        raw = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    lines = []
    for n, line in raw:
        try:
            lines.append((n, line.decode("utf-8")))
        except UnicodeDecodeError as e:   # a torn or foreign write: JSON text is UTF-8
            if n != raw[-1][0]:
                raise RunError(f"{path} line {n} is not UTF-8 text ({e.reason}); fix or delete that line") from None
            lines.append((n, "\ufffd"))   # the last line: skipped below, as a cut-off one is
    records = []
    for n, line in lines:
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            if n != lines[-1][0]:
                raise RunError(f"{path} line {n} is not a JSON record ({e.msg}); fix or delete that line") from None
            say(f"{path}: skipped its last line {n}, cut off mid-write ({e.msg})")
            continue
        if not (isinstance(r, dict) and isinstance(r.get("type"), str)
                and (r["type"] not in ("step", "eval") or isinstance(r.get("iter"), int))):
            raise RunError(f"{path} line {n} is not a record of this trainer (a JSON object with a \"type\", "
                           f"and an integer \"iter\" for steps and evals); fix or delete that line")
        records.append(r)
    return records


def plot_losses(log_path, png_path):
    """loss.png from log.jsonl (train loss per step, val loss per eval); returns a note string."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no loss.png (pip install matplotlib)"
    steps, evals = [], []
    for r in read_log(log_path):
        if r.get("type") == "step":
            steps.append((r["iter"], r["loss"]))
        elif r.get("type") == "eval":
            evals.append((r["iter"], r["val_loss"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    if steps:
        ax.plot(*zip(*steps), lw=0.6, alpha=0.6, label="train (per step)")
    if evals:
        ax.plot(*zip(*evals), "o-", label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return f"wrote {png_path}"
