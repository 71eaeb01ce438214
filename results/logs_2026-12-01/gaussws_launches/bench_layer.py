"""One compiled GaussWS GPT-2-124M training step on a GPU, gaussws.py before (commit 06b5c7d, the op
namespace renamed gaussws_old) and after ∂L/∂b_i moved into the grad kernel, beside bf16, in one
process: (1) the gradients of one step, eager and compiled, old = new bit for bit; (2) step time,
`ROUNDS` interleaved rounds of `STEPS` steps queued back to back (as train.py runs); (3) per
variant from torch.profiler over 3 steps: GPU ms, GPU operations per step, and the kernels whose
count or time differ between old and new. Setup as `python bench.py --only train`: batch 16 x
1024 random tokens, BF16 autocast, torch.compile (default mode), fused AdamW, clipping at 1.0.
Run from the folder holding it, with gaussws.py (new) and gaussws_old.py beside it or with the
repository's git history at hand; model.py and bench.py come from the first folder up holding them:
    python bench_layer.py > bench_layer.txt
DRY=1 runs the same code on the CPU with the nano preset, 2 x 64 tokens and 2 steps (a check that
it runs; its numbers mean nothing)."""
import collections, importlib, os, statistics, subprocess, sys, tempfile, time
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = HERE                                  # the repository root: the first folder up with model.py
while not os.path.exists(os.path.join(ROOT, "model.py")) and os.path.dirname(ROOT) != ROOT:
    ROOT = os.path.dirname(ROOT)
sys.path[:0] = [HERE, ROOT]
OLD = "06b5c7d"
DRY = os.environ.get("DRY") == "1"
ROUNDS, STEPS, B, T, PRESET = (1, 2, 2, 64, "nano") if DRY else (3, 30, 16, 1024, "gpt2-124m")


def load_old():
    if not os.path.exists(os.path.join(HERE, "gaussws_old.py")):
        src = subprocess.check_output(["git", "-C", ROOT, "show", f"{OLD}:gaussws.py"], text=True)
        src = src.replace("gaussws::", "gaussws_old::").replace("torch.ops.gaussws.", "torch.ops.gaussws_old.")
        d = tempfile.mkdtemp()
        open(os.path.join(d, "gaussws_old.py"), "w").write(src)
        sys.path.insert(0, d)
    return importlib.import_module("gaussws_old")


import gaussws as new                       # noqa: E402  (the copy beside this file comes first)
old = load_old()
from model import GPT, preset_config       # noqa: E402
import bench                                # noqa: E402  (the step timing of bench.py --only train)
dev = torch.device("cpu" if DRY else "cuda")
print(f"gaussws from {new.__file__}, old from {old.__file__}; torch {torch.__version__}, "
      f"{'CPU (DRY)' if DRY else torch.cuda.get_device_name()}", flush=True)


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()
x = torch.randint(0, 50304, (B, T), device=dev)
y = torch.randint(0, 50304, (B, T), device=dev)


def build(mod, compile=True):
    torch.manual_seed(0)
    with dev:
        model = GPT(preset_config(PRESET, block_size=T))
    if mod is not None:
        mod.apply_pqt(model, parts="all")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not n.endswith("b_i")]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2 and not n.endswith("b_i")]
    bits = [p for n, p in model.named_parameters() if n.endswith("b_i")]
    groups = [dict(params=decay, weight_decay=0.1), dict(params=rest, weight_decay=0.0)]
    if bits:
        groups.append(dict(params=bits, weight_decay=0.0))
    opt = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
    fwd = torch.compile(model) if compile else model

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            _, loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, step


def grads_of_one_step(mod, compile):
    model, _ = build(mod, compile)
    fwd = torch.compile(model) if compile else model
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        _, loss = fwd(x, y)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def same_bits(a, b):
    ints = {4: torch.int32, 2: torch.int16}
    return a.dtype == b.dtype and torch.equal(a.view(ints[a.element_size()]), b.view(ints[b.element_size()]))


for compile in (False, True):
    ga, gb = grads_of_one_step(old, compile), grads_of_one_step(new, compile)
    diff = [n for n in ga if not same_bits(ga[n], gb[n])]
    nb = sum(n.endswith("b_i") for n in ga)
    print(f"(1) {'compiled' if compile else 'eager'}: {len(ga)} gradients ({nb} of b_i), old = new bit for bit: "
          f"{'yes' if not diff else 'NO: ' + ', '.join(diff[:6])}", flush=True)
    del ga, gb
    torch._dynamo.reset()

runs = {}
for name, mod in (("bf16", None), ("gaussws old", old), ("gaussws new", new)):
    model, step = build(mod)
    for _ in range(3):                         # compile, warm up
        step()
    sync()
    runs[name] = dict(step=step, model=model, ms=[])
    print(f"  built {name}", flush=True)


def queued_ms(step, n):
    if not DRY:
        return bench._queued_steps_ms(step, n)   # CUDA events around n steps queued back to back
    t = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t) * 1e3 / n


for _ in range(ROUNDS):
    for r in runs.values():
        r["ms"].append(queued_ms(r["step"], STEPS))
base = runs["bf16"]["ms"]
print(f"\n(2) {PRESET}, batch {B} x {T}, compiled, {ROUNDS} interleaved rounds of {STEPS} queued steps")
print(f"{'variant':14s} {'ms per step, per round':>32s} {'vs bf16, per round':>30s} {'median vs bf16':>15s}")
for name, r in runs.items():
    ov = [100 * (a / b - 1) for a, b in zip(r["ms"], base)]
    print(f"{name:14s} {' / '.join(f'{m:.3f}' for m in r['ms']):>32s} "
          f"{' / '.join(f'{o:+.2f}' for o in ov) + ' %':>30s} {statistics.median(ov):+14.2f} %")
o, nw = runs["gaussws old"]["ms"], runs["gaussws new"]["ms"]
print(f"new vs old per round: {' / '.join(f'{1e3 * (b - a):+.0f} us' for a, b in zip(o, nw))}")


def profile(step, n=3):
    from torch.profiler import ProfilerActivity, profile as prof_
    sync()
    acts = [ProfilerActivity.CPU] + ([] if DRY else [ProfilerActivity.CUDA])
    with prof_(activities=acts) as prof:
        for _ in range(n):
            step()
        sync()
    kind = torch.autograd.DeviceType.CPU if DRY else torch.autograd.DeviceType.CUDA   # DRY: CPU ops
    ev = [e for e in prof.events() if e.device_type == kind]
    per = collections.defaultdict(lambda: [0, 0.0])
    for e in ev:
        per[e.name][0] += 1
        per[e.name][1] += e.time_range.elapsed_us()
    return sum(v[1] for v in per.values()) / 1e3 / n, len(ev) / n, {k: (c / n, us / n) for k, (c, us) in per.items()}


prof = {name: profile(r["step"]) for name, r in runs.items()}
print("\n(3) torch.profiler, 3 steps: GPU ms and GPU operations per step")
for name, (ms, ops, _) in prof.items():
    print(f"{name:14s} GPU {ms:8.2f} ms   {ops:6.0f} ops")
ko, kn = prof["gaussws old"][2], prof["gaussws new"][2]
print("kernels whose count per step differs, or ours (apply, grad, counter), old -> new: count, us per step")
for k in sorted(set(ko) | set(kn)):
    a, b = ko.get(k, (0, 0.0)), kn.get(k, (0, 0.0))
    if a[0] != b[0] or any(s in k for s in ("_apply_kernel", "_grad_kernel", "_next_seed_kernel")):
        print(f"  {k[:90]:90s} {a[0]:5.0f} -> {b[0]:5.0f}   {a[1]:8.1f} -> {b[1]:8.1f} us")
