"""GaussWS at the training level, one process on the GPU: (a) one GaussWSLinear under
torch.compile(mode="reduce-overhead") with only b_i.grad reset per step; (b) GPT-2-124M compiled,
bf16 vs GaussWS [all]: graph count and breaks, step time per-step synced and queued back to back,
host ms per phase (each step started with the GPU idle), torch.profiler summaries and GPU gaps.
From the repository root:
    PYTHONPATH=. OUT=dir python results/logs_2026-12-01/gaussws_train_level/train_diagnosis.py a b 2> err.txt
TORCH_LOGS output (cudagraphs, recompiles, graph breaks, the GaussWS compile's output code) goes to err.txt."""
import os, sys, time, statistics, argparse, logging, traceback, gzip, io
import torch
import gaussws as g
import train as trainer
from model import GPT, preset_config

OUT = os.environ.get("OUT", ".")
os.makedirs(OUT, exist_ok=True)
cuda = torch.cuda.is_available()
dev = torch.device("cuda" if cuda else "cpu")
PRESET, B, T = ("gpt2-124m", 16, 1024) if cuda else ("nano", 2, 64)
STEPS = 20 if cuda else 2
rep = open(f"{OUT}/diag.txt", "w")
def P(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True); rep.write(s + "\n"); rep.flush()

def sync():
    if cuda: torch.cuda.synchronize()

# ---------------------------------------------------------------- part A: one layer, reduce-overhead
def part_a():
    if not cuda:
        return
    P("== A: one GaussWSLinear under torch.compile(mode='reduce-overhead')")
    torch._logging.set_logs(cudagraphs=True, perf_hints=True, recompiles=True, graph_breaks=True)
    x = torch.randn(16, 64, device=dev)
    def run(name, make, k_steps=5, mark=True):
        torch._dynamo.reset()
        layer = g.GaussWSLinear(64, 96, seed=6).to(dev)
        fn = make(layer)
        try:
            for k in range(k_steps):
                if mark:
                    torch.compiler.cudagraph_mark_step_begin()
                layer.b_i.grad = None
                loss = fn(x)
                loss.backward()
                P(f"  {name}: step {k} ok, counter {layer.noise_state[1].item()}")
        except Exception as e:
            P(f"  {name}: step {k} FAILED: {type(e).__name__}: {str(e)[:600]}")
    run("lambda loss inside", lambda l: torch.compile(lambda x: l(x).square().sum(), mode="reduce-overhead"))
    run("module compiled, loss outside", lambda l: (lambda c: (lambda x: c(x).square().sum()))(torch.compile(l, mode="reduce-overhead")))
    class Wrap(torch.nn.Module):
        def __init__(s, l): super().__init__(); s.l = l
        def forward(s, x): return s.l(x).square().sum()
    run("module wrapper, loss inside", lambda l: torch.compile(Wrap(l), mode="reduce-overhead"))
    run("lambda, eager fn no cudagraph (default mode)", lambda l: torch.compile(lambda x: l(x).square().sum()))
    torch._logging.set_logs()

# ---------------------------------------------------------------- part B: GPT-2 compiled
def build(name):
    torch.manual_seed(0)
    with dev:
        model = GPT(preset_config(PRESET, block_size=T, **({} if cuda else dict(vocab_size=64))))
    if name == "gaussws":
        g.apply_pqt(model, parts="all")
    args = argparse.Namespace(optim="adamw", lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                              weight_decay=0.1, bits_wd=0.0, seed=0)
    opt = trainer.build_optimizer(args, model, dev.type)
    fwd = torch.compile(model)
    V = model.config.vocab_size
    x = torch.randint(0, V, (B, T), device=dev); y = torch.randint(0, V, (B, T), device=dev)
    ph = {"fwd": [], "bwd": [], "clip": [], "opt": []}
    def step(record=False):
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            _, loss = fwd(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t3 = time.perf_counter()
        opt.step(); opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        if record:
            for k, a, b in (("fwd", t0, t1), ("bwd", t1, t2), ("clip", t2, t3), ("opt", t3, t4)):
                ph[k].append((b - a) * 1e3)
    return model, step, ph

def time_steps(step, synced):
    if not cuda:
        t = time.perf_counter(); [step() for _ in range(STEPS)]; return (time.perf_counter() - t) * 1e3 / STEPS
    if synced:
        ts = []
        for _ in range(STEPS):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); step(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
        return statistics.median(ts)
    sync()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(STEPS):
        step()
    b.record(); b.synchronize()
    return a.elapsed_time(b) / STEPS

def profile_summary(name, step):
    from torch.profiler import ProfilerActivity, profile
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(3):
            step()
        sync()
    P(f"-- profile {name}: top CPU self time (3 steps)")
    P(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    if cuda:
        P(f"-- profile {name}: top CUDA time (3 steps)")
        P(prof.key_averages().table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70))
        ev = sorted([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA],
                    key=lambda e: e.time_range.start)
        busy = sum(e.time_range.elapsed_us() for e in ev)
        span = ev[-1].time_range.end - ev[0].time_range.start
        gaps = sorted(((ev[i + 1].time_range.start - ev[i].time_range.end, ev[i].name[:60], ev[i + 1].name[:60])
                       for i in range(len(ev) - 1)), reverse=True)
        P(f"   GPU kernels {len(ev) / 3:.0f}/step, busy {busy / 3e3:.2f} ms/step, span {span / 3e3:.2f} ms/step, "
          f"idle {(span - busy) / 3e3:.2f} ms/step; gaps > 20us: {sum(gp for gp, *_ in gaps if gp > 20) / 3e3:.2f} ms/step")
        for gp, a, b in gaps[:12]:
            P(f"   gap {gp:8.1f} us after {a} before {b}")
        prof.export_chrome_trace(f"{OUT}/trace_{name}.json")
        with open(f"{OUT}/trace_{name}.json", "rb") as f, gzip.open(f"{OUT}/trace_{name}.json.gz", "wb") as o:
            o.write(f.read())

def part_b():
    P(f"== B: {PRESET} batch {B}x{T} compiled default mode")
    runs = {}
    for name in ("bf16", "gaussws"):
        t = time.perf_counter()
        torch._logging.set_logs(graph_breaks=True, recompiles=True, perf_hints=True,
                                output_code=(name == "gaussws"))
        model, step, ph = build(name)
        for _ in range(3):
            step()
        sync()
        torch._logging.set_logs()
        from torch._dynamo.utils import counters
        P(f"  {name}: dynamo stats {dict(counters['stats'])} graph_break {dict(counters['graph_break'])}")
        counters.clear()
        P(f"  built {name} in {time.perf_counter() - t:.1f} s")
        runs[name] = (model, step, ph)
    res = {k: {"synced": [], "b2b": []} for k in runs}
    for rnd in range(2):
        for name, (model, step, ph) in runs.items():
            res[name]["synced"].append(time_steps(step, True))
            res[name]["b2b"].append(time_steps(step, False))
    for name, (model, step, ph) in runs.items():
        for _ in range(STEPS):
            sync(); step(record=True)
        sync()
    for name in runs:
        ph = runs[name][2]
        s, bb = res[name]["synced"], res[name]["b2b"]
        ov = lambda k: " / ".join(f"{100 * (a / c - 1):+.2f}" for a, c in zip(res[name][k], res["bf16"][k]))
        P(f"  {name:8s} per-step-synced ms {' / '.join(f'{v:.2f}' for v in s)} ({ov('synced')} %)  "
          f"back-to-back ms {' / '.join(f'{v:.2f}' for v in bb)} ({ov('b2b')} %)  host ms (GPU idle at start) "
          + " ".join(f"{k} {statistics.median(v):.2f}" for k, v in ph.items()))
    for name, (model, step, ph) in runs.items():
        profile_summary(name, step)

if __name__ == "__main__":
    which = sys.argv[1:] or ["a", "b"]
    for w in which:
        try:
            {"a": part_a, "b": part_b}[w]()
        except Exception:
            P(traceback.format_exc())
    rep.close()
