"""Helpers shared by the test files: the repository's root, a launcher of gloo process groups, a
small GPT-2-like model for the PQT tests, train.py's command lines and log."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint

import gaussws as g
import train
from lowbit import runlock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository


# ---------------------------------------------------------------------------------------------
# gloo process groups on CPU, started as torchrun starts them

def rank_main(module, fn, tmp, rank, world):
    """Body of one rank started by launch_ranks: join the gloo group of `world` processes through a
    file store, run module.fn(rank, world, tmp) and write its result to tmp/fn.world.rank.pt
    (atomically)."""
    import importlib
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store-{fn}-{world}", rank=rank, world_size=world)
    args = torch.load(f"{tmp}/{fn}.{world}.args.pt") if os.path.exists(f"{tmp}/{fn}.{world}.args.pt") else ()
    res = getattr(importlib.import_module(module), fn)(rank, world, tmp, *args)
    torch.save(res, f"{tmp}/{fn}.{world}.{rank}.tmp")
    os.replace(f"{tmp}/{fn}.{world}.{rank}.tmp", f"{tmp}/{fn}.{world}.{rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


def launch_ranks(fn, tmp, world, *args, timeout=300):
    """Run fn(rank, world, tmp, *args), a module-level function of a module the repository's root
    imports (a test file), on `world` fresh processes (rank_main; RANK, WORLD_SIZE, LOCAL_RANK set as
    torchrun does) and return their results, rank by rank. A
    rank is judged by the result file it wrote, not by its exit status: gloo on CPU sometimes
    aborts (SIGABRT) in process-group teardown, after the results are written, and that is not a
    failure of what is tested. A rank that wrote nothing fails the test with its stderr. An
    earlier launch of fn on `world` ranks in tmp leaves nothing this one reads: its results, its
    arguments and its file store (a store file left by an aborted teardown hangs the next group)."""
    module, fn = fn.__module__, fn.__name__
    for stale in [f"store-{fn}-{world}", f"{fn}.{world}.args.pt"] + [f"{fn}.{world}.{r}.pt" for r in range(world)]:
        if os.path.exists(os.path.join(str(tmp), stale)):
            os.remove(os.path.join(str(tmp), stale))
    if args:
        torch.save(args, os.path.join(str(tmp), f"{fn}.{world}.args.pt"))
    code = f"from tests.helpers import rank_main; rank_main({module!r}, {fn!r}, {str(tmp)!r}, {{}}, {world})"
    procs = [subprocess.Popen([sys.executable, "-c", code.format(r)], cwd=ROOT,
                              env=dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1", RANK=str(r),
                                       LOCAL_RANK=str(r), WORLD_SIZE=str(world)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:       # a rank left waiting in a collective after the other one died
            if p.poll() is None:
                p.kill()
    results = []
    for r, (p, (_, err)) in enumerate(zip(procs, outs)):
        path = os.path.join(str(tmp), f"{fn}.{world}.{r}.pt")
        assert os.path.exists(path), f"{fn}: rank {r} of {world} exited with {p.returncode} before " \
                                     f"writing its result:\n{err[-4000:]}"
        results.append(torch.load(path, weights_only=False))
    return results


# ---------------------------------------------------------------------------------------------
# GaussWS: a small GPT-2-like (or Llama-like) model, float bits, gradients

class Block(nn.Module):
    def __init__(self, d=32, llama=False):
        super().__init__()
        self.attn, self.mlp = nn.Module(), nn.Module()
        if llama:
            self.attn.q, self.attn.k, self.attn.v = nn.Linear(d, d, False), nn.Linear(d, d // 2, False), nn.Linear(d, d // 2, False)
            self.mlp.gate = nn.Linear(d, 3 * d, False)
        else:
            self.attn.qkv = nn.Linear(d, 3 * d)
        self.attn.out = nn.Linear(d, d)
        self.mlp.up, self.mlp.down = nn.Linear(d, 3 * d), nn.Linear(3 * d, d)
        self.norm = nn.LayerNorm(d)
        self.llama = llama

    def forward(self, x):
        a = self.attn
        h = torch.cat([a.q(x), a.k(x), a.v(x)], -1) if self.llama else a.qkv(x)
        x = x + a.out(h[..., :x.shape[-1]])
        u = self.mlp.up(self.norm(x))
        if self.llama:
            u = F.silu(self.mlp.gate(x)) * u
        return x + self.mlp.down(F.gelu(u))


class Model(nn.Module):
    def __init__(self, llama=False, checkpointed=False, n_layer=2):
        super().__init__()
        self.wte = nn.Embedding(50, 32)
        self.blocks = nn.ModuleList([Block(llama=llama) for _ in range(n_layer)])
        self.lm_head = nn.Linear(32, 50, bias=False)
        self.checkpointed = checkpointed

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint.checkpoint(b, x, use_reentrant=False) if self.checkpointed else b(x)
        return self.lm_head(x)


def gpt2_like(checkpointed=False, n_layer=2):
    return Model(checkpointed=checkpointed, n_layer=n_layer)


def untouched(model):
    return not g.pqt_layers(model)


def float_bits(t):
    """The bit patterns of a float32 / bfloat16 tensor (torch.equal takes -0 for +0)."""
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def assert_same_grads(a, b, **tol):
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        if p.grad is None:               # e.g. the unused embedding
            assert q.grad is None, n
        else:
            assert torch.allclose(p.grad, q.grad, **tol), n


# ---------------------------------------------------------------------------------------------
# train.py: command lines on the corpus fixture, the run log, flag errors, a held lock

def base_args(corpus, out_dir, *extra):
    text, data_dir = corpus
    return ["--preset", "nano", "--dataset", text, "--data_dir", data_dir, "--tokenizer", "byte",
            "--batch_size", "4", "--eval_windows", "8", "--no-plot", "--out_dir", str(out_dir), *extra]


def nano_args(corpus, *extra):
    text, data_dir = corpus
    return ["--preset", "nano", "--dataset", text, "--data_dir", data_dir, "--tokenizer", "byte",
            "--batch_size", "4", "--eval_windows", "8", *extra]


def read_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def assert_one_line_flag_error(flags, words, capsys):
    """train.py with --preset nano and flags exits 2 with one 'train.py: error:' line holding words."""
    with pytest.raises(SystemExit) as e:
        train.main(["--preset", "nano", *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("train.py: error:")
    for w in words:
        assert w in err


def hold_lock_then(path, then, conn):
    lock = runlock.FileLock(path)
    lock.acquire()
    conn.send(os.getpid())      # a pipe's send is synchronous: sent before the kill below
    if then == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
