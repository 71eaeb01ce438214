"""
The quality harness's run folders (experiments/quality.py's machinery): train.py runs in this process or
as concurrent subprocesses spread over the visible GPUs, and what a folder says afterwards (is it
finished, was it trained with these flags, its log's curves and its experiment-5 cast), so a
comparison can stop anywhere and continue from what the folders hold (--resume).
"""
import json
import math
import os
import sys

import torch
from trainer.flags import build_parser, resolve_args
from trainer.log import read_log
from trainer.util import RunError


def _visible_gpus():
    """CUDA device ids (as CUDA_VISIBLE_DEVICES strings) a subprocess may be pinned to; [] on CPU."""
    if not torch.cuda.is_available():
        return []
    vis = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    return (vis or [str(i) for i in range(torch.cuda.device_count())])[:torch.cuda.device_count()]


def prepare_data(argv, prepare=True):
    """Check the flags and (prepare=True) prepare the dataset once, as train.py would (so
    concurrent runs do not race to write the same data folder). A flag train.py refuses is a
    RunError naming it."""
    import data as datamod
    p = build_parser()

    def error(message):   # train.py's parser's message, without train.py's usage line
        raise RunError(f"the runs' train.py flags: {message} (see python train.py --help)")
    p.error = error
    a = p.parse_args(argv)
    resolve_args(a, p, a.device != "cpu" and torch.cuda.is_available())
    if prepare:
        datamod.prepare(a.dataset, a.tokenizer, data_dir=a.data_dir, max_tokens=a.max_tokens)


def train_inprocess(argv, d):
    """One run in this process; a diverged run (train.py's RunError on a NaN/inf loss) is left in
    its log and reported, not raised."""
    import train
    try:
        train.main(argv)
    except RunError as e:
        if "diverged" not in str(e):
            raise
        print(f"[quality] {d}: {e}")
    except SystemExit as e:
        if e.code in (130, 143):   # Ctrl-C / SIGTERM: train.py's line continues this run alone
            print("[quality] stopped at a checkpoint; continue the whole comparison with the same command and "
                  "--resume", flush=True)
        raise


def _die_with_parent():
    # in a train.py child before it runs (Linux): SIGTERM when the harness dies, even by kill -9,
    # so no run goes on unwatched (it stops at a checkpoint, and --resume continues it)
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _last_lines(path, start, n=8):
    """The last n lines that a train.py child wrote to path from byte `start` on, without its
    progress bars."""
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read().decode("utf-8", "replace")
    lines = [x for x in text.replace("\r", "\n").splitlines() if x.strip() and "it/s" not in x]
    return "\n".join(lines[-n:])


def train_subprocesses(todo, jobs):
    """Run `python train.py ARGV` for each (argv, out_dir) of todo, `jobs` at a time; with more than
    one visible GPU each run gets the least-loaded one (CUDA_VISIBLE_DEVICES; round-robin when the
    runs take equal time). A run's output goes to out_dir/train.out. Returns {out_dir: message}
    for runs that failed other than by diverging (their train.py exited non-zero without an
    "error" record in log.jsonl)."""
    import signal
    import subprocess
    import threading
    import time
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
    gpus, queue, running, failed = _visible_gpus(), list(todo), [], {}
    # a time limit or scheduler sends SIGTERM: raise SystemExit so the finally below ends the runs
    main_thread = threading.current_thread() is threading.main_thread()
    old_handler = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)) if main_thread else None
    try:
        while queue or running:
            while queue and len(running) < jobs:
                argv, d = queue.pop(0)
                env = dict(os.environ, PYTHONUNBUFFERED="1")
                gpu = None
                if len(gpus) > 1:
                    load = {x: sum(r[2] == x for r in running) for x in gpus}
                    gpu = min(gpus, key=load.get)
                    env["CUDA_VISIBLE_DEVICES"] = gpu
                elif not gpus and "OMP_NUM_THREADS" not in env:   # CPU: share the cores
                    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
                os.makedirs(d, exist_ok=True)
                fh = open(os.path.join(d, "train.out"), "a")   # a resumed run's earlier parts stay
                start = fh.tell()
                p = subprocess.Popen([sys.executable, os.path.join(here, "train.py"), *argv],
                                     stdout=fh, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
                running.append((p, d, gpu, fh, time.time(), start))
                print(f"[quality] started {d}" + (f" on GPU {gpu}" if gpu is not None else ""), flush=True)
            time.sleep(0.2)
            for r in [r for r in running if r[0].poll() is not None]:
                p, d, gpu, fh, t0, start = r
                fh.close()
                running.remove(r)
                status = "done"
                if p.returncode:
                    if any(x.get("type") == "error" for x in read_log(os.path.join(d, "log.jsonl"))):
                        status = "diverged"
                    else:
                        how = (f"killed by {signal.Signals(-p.returncode).name}" if p.returncode < 0
                               else f"exit {p.returncode}")
                        failed[d] = f"{how}: " + _last_lines(os.path.join(d, "train.out"), start)
                        status = f"FAILED ({how}, see {d}/train.out)"
                print(f"[quality] {status} {d} ({time.time() - t0:.0f} s)", flush=True)
    finally:   # interrupted (Ctrl-C, a time limit): do not leave runs behind
        for p, *_ in running:
            p.terminate()
        if running:
            print(f"[quality] stopped with {len(running)} run(s) going: they stop at a checkpoint; continue "
                  f"with the same command and --resume", flush=True)
        if main_thread:
            signal.signal(signal.SIGTERM, old_handler)
    return failed


def log_records(d):
    """The records of run folder d's log.jsonl ([] before the run wrote one)."""
    return read_log(os.path.join(d, "log.jsonl"))


def trained(d, recs=None):
    """True if run folder d holds a finished run (a summary at its last step) or a diverged one
    (an "error" record): its numbers are in its log.jsonl. recs: that log's records, if read."""
    recs = log_records(d) if recs is None else recs
    return any(r.get("type") == "error" or (r.get("type") == "summary" and isinstance(r.get("iters"), int)
                                            and r["iters"] >= r.get("max_iters", math.inf)) for r in recs)


def _read_cast(d):
    """The run's cast.json (save_cast), or None when it is missing or damaged (with a note)."""
    path = os.path.join(d, "cast.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            cast = json.load(f)
        if isinstance(cast, dict) and isinstance(cast.get("row"), dict) and "bitwidth" in cast:
            return cast
    except (OSError, ValueError):
        pass
    print(f"[quality] {path} is damaged: left out (delete it and --resume makes it again while the run's "
          f"ckpt.pt is there)")
    return None


def same_run(d, argv, any_dataset=False):
    """RunError unless run folder d was trained with train.py flags `argv` (its argv.json, written
    when the harness starts it; --out_dir, --resume and --overwrite aside): --resume must not mix a
    finished run of other flags into a comparison. any_dataset=True (a report that reads the
    folders and trains nothing) leaves --dataset out: the same corpus may lie elsewhere here.
    Returns the run's --dataset (None without argv.json)."""
    path = os.path.join(d, "argv.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        old, new = _flags(json.load(f)), _flags(argv)
    diff = [k for k in dict.fromkeys([*old, *new])
            if old.get(k) != new.get(k) and not (any_dataset and k == "--dataset")]
    if diff:
        def said(flags):
            return " ".join(f"{k} {flags[k]}".strip() for k in diff if k in flags) or "not given"
        raise RunError(f"--resume: {d} was trained with other train.py flags ({said(old)} then, "
                               f"{said(new)} now); use its flags, or another --out_dir for these")
    return old.get("--dataset")


def flag_value(argv, flag):
    """The value of `flag` in a train.py argv (the last one given), or None."""
    return _flags(argv).get(flag)


def _flags(argv):
    # {flag: value} of a train.py argv, the last of a repeated flag as argparse takes it, without
    # --out_dir, --resume and --overwrite: what makes two runs the same run
    flags, last = {}, None
    for a in argv:
        if a.startswith("--"):
            last, value = (a.split("=", 1) + [""])[:2]
            flags[last] = value
        elif last is not None:
            flags[last] = (flags[last] + " " + a).strip()
    return {k: v for k, v in flags.items() if k not in ("--out_dir", "--resume", "--overwrite")}


def read_run(d, recs):
    """Numbers of a finished (or diverged) run from its log.jsonl's records `recs` (log_records),
    and its experiment-5 result (cast.json, written by save_cast) when it has one."""
    s = next((r for r in reversed(recs) if r.get("type") == "summary"), None) or {}
    err = next((r for r in reversed(recs) if r.get("type") == "error"), None)
    pts = [(r["iter"], r["loss"]) for r in recs if r.get("type") == "step"]
    steps = [loss for _, loss in pts]
    tail = steps[-max(1, len(steps) // 10):]
    k = max(1, len(pts) // 50)          # moving average over 2 % of the steps (paper B Figure 1)
    smooth = [(pts[i][0], sum(win := steps[max(0, i - k + 1):i + 1]) / len(win))
              for i in range(0, len(pts), max(1, len(pts) // 200))]
    cast = _read_cast(d)
    return dict(dir=d, log=os.path.join(d, "log.jsonl"), diverged_at=err["iter"] if err else None,
                val_curve=[(r["iter"], r["val_loss"]) for r in recs if r.get("type") == "eval"],
                train_curve=smooth, params=s.get("params"),
                final_val_loss=s.get("final_val_loss"), optimizer_state_mb=s.get("optimizer_state_mb"),
                peak_mem_mb=s.get("peak_mem_mb"), tokens_per_s=s.get("tokens_per_s"), machine=s.get("machine"),
                # mean training loss over the last 10 % of steps (None for a diverged run)
                final_train_loss=sum(tail) / len(tail) if steps and not err else None, cast=cast)
