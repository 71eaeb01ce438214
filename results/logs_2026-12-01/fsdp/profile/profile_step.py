"""Where a train.py step's time goes, plain vs --fsdp: per-phase host time of every step, the time
the host waits for the device (RunLog.flush), a torch.profiler window of 3 steps (CPU and device
tables), and every synchronizing CUDA call (torch.cuda.set_sync_debug_mode) with its stack.
Run from the repository root: TAG=name OUT=dir python results/logs_2026-12-01/fsdp/profile/profile_step.py
<train.py flags> (or under torchrun with --fsdp). Writes OUT/TAG_prof.txt and OUT/TAG_phases.json;
"sync warnings" counts every Python warning seen (their first lines are in the JSON)."""
import os, sys, time, json, warnings, traceback, collections
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", ".."))
import torch
import train, adam4bit as A

OUT, TAG = os.environ.get("OUT", "."), os.environ.get("TAG", "run")
P0, P1 = int(os.environ.get("PROF_FROM", "10")), int(os.environ.get("PROF_TO", "13"))
phase = collections.defaultdict(list)
marks = []
syncs = collections.Counter()


def timed(name, fn):
    def f(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            phase[name].append(time.perf_counter() - t0)
    return f


A.AdamW4bit.step = timed("optimizer.step", A.AdamW4bit.step)
train.clip_grad_norm_local = timed("clip", train.clip_grad_norm_local)
torch.nn.utils.clip_grad_norm_ = timed("clip", torch.nn.utils.clip_grad_norm_)
torch.optim.Optimizer.zero_grad = timed("zero_grad", torch.optim.Optimizer.zero_grad)
train.RunLog.flush = timed("flush(wait)", train.RunLog.flush)
prof = None
orig_step = train.RunLog.step


def log_step(self, it, lr, stats):
    global prof
    marks.append((it, time.perf_counter()))
    r = orig_step(self, it, lr, stats)
    if it + 1 == P0 and torch.cuda.is_available():
        torch.cuda.synchronize()
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
        prof.__enter__()
    if it + 1 == P1 and prof is not None:
        torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        with open(f"{OUT}/{TAG}_prof.txt", "w") as f:
            ka = prof.key_averages()
            f.write(ka.table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=70))
            f.write("\n\n")
            f.write(ka.table(sort_by="cpu_time_total", row_limit=45, max_name_column_width=70))
            f.write("\n\n")
            f.write(ka.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70))
            dev = sum(e.self_device_time_total for e in ka)
            f.write(f"\nself device time total over {P1 - P0} steps: {dev / 1e3:.1f} ms\n")
            try:
                f.write(gaps(prof))
            except Exception as e:   # the tables above are kept either way
                f.write(f"gap analysis failed: {e!r}")
    if it + 1 == P1 and torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("warn")
    if it + 1 == P1 + 2 and torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode(0)
    return r


train.RunLog.step = log_step


def gaps(prof, top=25):
    """Where the device idles in the window: the union of kernel/memcpy intervals (not the device
    side of record_function ranges, which span idle time too), the idle time between them, and the
    largest gaps with the host ranges (record_function / FSDP / python-level ops) that were running
    when each gap began. Added on 2026-12-02; the 2026-12-01 outputs do not have it."""
    evs = prof.events()
    dev = sorted((e.time_range.start, e.time_range.end) for e in evs
                 if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
                 and not getattr(e, "is_user_annotation", False))
    host = [e for e in evs if e.device_type == torch.autograd.DeviceType.CPU]
    busy, idle, cur, out = 0.0, [], None, []
    for s, e in dev:
        if cur is None:
            cur = [s, e]
        elif s > cur[1]:
            busy += cur[1] - cur[0]
            idle.append((s - cur[1], cur[1], s))
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    busy += cur[1] - cur[0]
    span = max(e for _, e in dev) - dev[0][0]
    out.append(f"\ndevice span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms, idle {(span - busy) / 1e3:.2f} ms "
               f"in {len(idle)} gaps ({sum(1 for g in idle if g[0] > 20)} over 20 us, "
               f"{sum(g[0] for g in idle if g[0] > 20) / 1e3:.2f} ms in them); kernels+copies {len(dev)}\n")
    for g, a, b in sorted(idle, reverse=True)[:top]:
        names = sorted({e.name for e in host if e.time_range.start <= a <= e.time_range.end
                        and not e.name.startswith(("aten::", "cuda", "triton"))}, key=len)[:6]
        out.append(f"gap {g / 1e3:7.3f} ms at +{(a - dev[0][0]) / 1e3:8.2f} ms  host: {names}\n")
    return "".join(out)


def showwarning(message, category, filename, lineno, file=None, line=None):
    stack = "".join(traceback.format_stack(limit=14)[:-2])
    syncs[f"{message}\n{stack}"] += 1


warnings.showwarning = showwarning
warnings.simplefilter("always")
summary = train.main(sys.argv[1:])
if int(os.environ.get("RANK", "0")) == 0:
    steps = [b - a for (_, a), (_, b) in zip(marks, marks[1:])]
    rep = {"tag": TAG, "step_wall_ms": [round(1e3 * s, 2) for s in steps],
           "median_step_ms": 1e3 * sorted(steps[3:])[len(steps[3:]) // 2] if len(steps) > 4 else None,
           "phase_median_ms": {k: round(1e3 * sorted(v[3:] or v)[len(v[3:] or v) // 2], 3) for k, v in phase.items()},
           "phase_calls": {k: len(v) for k, v in phase.items()},
           "syncs": [(n, s) for s, n in syncs.most_common(12)],
           "tokens_per_s": summary.get("tokens_per_s") if summary else None}
    with open(f"{OUT}/{TAG}_phases.json", "w") as f:
        json.dump(rep, f, indent=1)
    print(json.dumps({k: v for k, v in rep.items() if k != "syncs"}))
    print("sync warnings:", sum(syncs.values()))
