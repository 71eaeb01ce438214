"""Timing, bandwidth and power helpers, train.py as a subprocess, and the result-file writer shared
by bench.py's sections (benchmarks/) and the quality harness (experiments/); they touch the GPU
clock and results/, and run train.py, nothing else.
"""
import datetime
import json
import os
import statistics
import time

import torch
import triton
from trainer.log import read_log

# torchrun's environment for several GPUs of one host: NVLink multicast off (NCCL's NVLS and
# symmetric-memory paths are not available on every host)
NO_MULTICAST = dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")


def run_train_py(flags, out_dir, nproc=None):
    """Run train.py with `flags` into out_dir as a user would: `python train.py` (nproc None) or
    `torchrun --nproc_per_node nproc train.py`, multicast off. Returns its log records
    (trainer.log.read_log); RuntimeError with the end of its output when it fails."""
    import subprocess
    import sys
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
    launch = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
                                 if nproc else [])
    r = subprocess.run([*launch, os.path.join(here, "train.py"), *flags, "--out_dir", out_dir],
                       env=dict(os.environ, **NO_MULTICAST), capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"train.py in {out_dir} ({nproc or 1} process(es)) failed:\n"
                           f"{(r.stdout + r.stderr)[-3000:]}")
    return read_log(os.path.join(out_dir, "log.jsonl"))


# ---------------------------------------------------------------------------------------------
# timing, bandwidth and power

def median_ms(fn, warmup=25, rep=100, graph=False):
    """Median ms of fn (CUDA events); graph=True replays a CUDA graph (GPU time only)."""
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def host_ms(fn, rep=50):
    """Median CPU time (ms) of one fn() call started with the GPU idle: the host cost of launching
    it, which a step shorter than that cannot hide."""
    times = []
    for _ in range(rep):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return sorted(times)[rep // 2]


def copy_bandwidth(nbytes=4 << 30):
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x))
    del x, y
    return 2 * nbytes / (ms * 1e-3)


def power_during(fn, seconds=3.0, settle=1.0):
    """Run fn back to back for `seconds` while nvidia-smi samples this GPU every 100 ms; the
    samples of the first `settle` seconds are dropped (NVML's power reading averages over ~1 s).
    Returns dict(power_w=median board power in W, sm_mhz=median SM clock in MHz,
    power_cap_pct=% of samples in which the software power cap held the clocks down, NVML reason
    0x4), or None (with a printed reason) where nvidia-smi, the device's PCI address or the
    readings are not available. Why: a memory-bound optimizer step can run the GPU at its board
    power cap, so its time also depends on the energy each step spends, not only on bytes."""
    import shutil, subprocess, threading, time
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if shutil.which("nvidia-smi") is None or not hasattr(props, "pci_bus_id"):
        return None
    bus = f"{getattr(props, 'pci_domain_id', 0):08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    q = "power.draw,clocks.sm,clocks_throttle_reasons.active"
    mon = subprocess.Popen(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits", "-i", bus,
                            "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples = []                               # (arrival time, line)
    reader = threading.Thread(target=lambda: samples.extend((time.time(), ln) for ln in mon.stdout), daemon=True)
    reader.start()
    t_wait = time.time()
    while not samples and mon.poll() is None and time.time() - t_wait < 5:
        time.sleep(0.01)                       # nvidia-smi up (or failed) before the clock starts
    t0 = time.time()
    try:
        while time.time() - t0 < seconds:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
    finally:
        mon.terminate()
        try:
            mon.wait(timeout=5)
        except subprocess.TimeoutExpired:
            mon.kill()
            mon.wait()
        reader.join(timeout=5)
    err = mon.stderr.read()
    lines = [ln for t, ln in list(samples) if t >= t0 + settle]

    def num(x, base=None):     # a field may read "[N/A]" or "[Not Supported]"
        try:
            return float(x) if base is None else int(x, base)
        except ValueError:
            return None
    fields = [[x.strip() for x in line.split(",")] for line in lines]
    rows = [(num(f[0]), num(f[1]), num(f[2], 16)) for f in fields if len(f) == 3]
    w, mhz, why = ([r[i] for r in rows if r[i] is not None] for i in range(3))
    if not (w and mhz and why):
        print(f"(power/clock readings not available: {(err or ''.join(ln for _, ln in samples[:1])).strip()[:200]!r})")
        return None
    return dict(power_w=statistics.median(w), sm_mhz=statistics.median(mhz),
                power_cap_pct=100 * sum(r & 4 != 0 for r in why) / len(why))


# ---------------------------------------------------------------------------------------------
# result files

_SAVED = {}   # (folder, section) -> the file this run writes the section to (save)


def save(section, result, path=None):
    """Write a section's result as JSON: `path`, default results/<gpu>_<date>_<section>.json, or
    with _2, _3, ... before .json where an earlier run left that file (a result is never
    overwritten by another run; this run's later saves of the section update its own file)."""
    gpu = torch.cuda.get_device_name().replace(" ", "-") if torch.cuda.is_available() else "cpu"
    date = datetime.date.today().isoformat()
    if path is None:
        path = _SAVED.get((os.getcwd(), section))
    if path is None:
        path, n = f"results/{gpu}_{date}_{section}.json", 1
        while os.path.exists(path):
            n += 1
            path = f"results/{gpu}_{date}_{section}_{n}.json"
        _SAVED[(os.getcwd(), section)] = path
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:   # a result's own "command" (the full command line) wins
        json.dump({"gpu": gpu, "date": date, "torch": torch.__version__, "triton": triton.__version__,
                   "command": f"python bench.py --only {section}", **result}, f, indent=1)
    os.replace(path + ".tmp", path)      # atomic: a killed run leaves the previous file whole
    print("wrote", path)
