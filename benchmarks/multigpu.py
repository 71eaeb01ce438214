"""
One GPU against DDP and FSDP2 on N GPUs of one host, the same global batch, through train.py as
users run it (`python bench.py --only multigpu`): tokens/s and the scaling efficiency, peak memory
and optimizer-state bytes per GPU, the validation loss at each eval, and a DCP checkpoint written
by FSDP2 on N GPUs and resumed on one.

For each case (method, optim) of train.py, with --grad_accum N so that one process does N
micro-batches per step where N processes do one each:
    one      python train.py ...                                  1 GPU
    ddp      torchrun --nproc_per_node N train.py ...             DDP
    fsdp     torchrun --nproc_per_node N train.py --fsdp ...      FSDP2, stopped at --stop_after
             (its DCP checkpoint), then resumed on N GPUs to the end
    fsdp_1   torchrun --nproc_per_node 1 train.py --fsdp --resume <fsdp's checkpoint>: the same
             checkpoint continued on one GPU
Micro-batches are drawn by (seed, step, global micro-batch index), and AdamW4bit's SR bits by
each element's place in the whole tensor, so all four agree up to the order of floating-point
reductions. train.py's tokens/s counts the global batch, so the efficiency is tokens/s(N) /
(N tokens/s(1)); a resumed run's tokens/s is that of its own steps.
"""
import os

from benchmarks.util import run_train_py

CASES = (("bf16", "adamw"), ("gaussws", "zipsr"), ("bf16", "zipsr"), ("gaussws", "adamw"))


def _numbers(recs):
    """What a run's log says: the last summary's tokens/s, peak memory and optimizer state (both
    per process), its evals and step losses."""
    s = [r for r in recs if r["type"] == "summary"][-1]
    return dict(tokens_per_s=s["tokens_per_s"], peak_mem_mb=s["peak_mem_mb"],
                optimizer_state_mb=s["optimizer_state_mb"], world=s["world"],
                val=[(r["iter"], r["val_loss"]) for r in recs if r["type"] == "eval"],
                step_loss=[r["loss"] for r in recs if r["type"] == "step"])


def bench_multigpu(train_args, out_dir="out-multigpu", nproc=2, cases=CASES, stop_after=None, command=None):
    """The runs of the module docstring for each case of `cases` ((method, optim) pairs), with
    train.py flags `train_args` (which set --max_iters; stop_after, default two thirds of it, is
    where the FSDP2 run writes the checkpoint fsdp_1 continues). Returns {"nproc",
    "command", "cases": {"method/optim": {"one", "ddp", "fsdp", "fsdp_1": _numbers(...),
    "efficiency": {"ddp", "fsdp"}, "state_ratio_fsdp": FSDP2's optimizer state per GPU over one
    GPU's, "final_val": {run: last val loss}}}}."""
    iters = int(train_args[train_args.index("--max_iters") + 1])
    stop = stop_after or max(1, 2 * iters // 3)
    res = {}
    for method, optim in cases:
        name = f"{method}/{optim}"
        d = os.path.join(out_dir, f"{method}_{optim}")
        flags = [*train_args, "--method", method, "--optim", optim, "--grad_accum", str(nproc), "--no-plot"]
        runs = dict(one=run_train_py(flags + ["--overwrite"], os.path.join(d, "one")),
                    ddp=run_train_py(flags + ["--overwrite"], os.path.join(d, "ddp"), nproc))
        fsdp_dir = os.path.join(d, "fsdp")
        run_train_py(flags + ["--fsdp", "--stop_after", str(stop), "--overwrite"], fsdp_dir, nproc)
        runs["fsdp_1"] = run_train_py(flags + ["--fsdp", "--resume", fsdp_dir, "--overwrite"],
                                      os.path.join(d, "fsdp_1"), 1)
        runs["fsdp"] = run_train_py(flags + ["--fsdp", "--resume"], fsdp_dir, nproc)
        row = {k: _numbers(v) for k, v in runs.items()}
        one = row["one"]["tokens_per_s"]
        row["efficiency"] = {k: row[k]["tokens_per_s"] / (nproc * one) if one and row[k]["tokens_per_s"] else None
                             for k in ("ddp", "fsdp")}
        row["state_ratio_fsdp"] = row["fsdp"]["optimizer_state_mb"] / row["one"]["optimizer_state_mb"]
        row["final_val"] = {k: row[k]["val"][-1][1] for k in ("one", "ddp", "fsdp", "fsdp_1")}
        res[name] = row
        print(f"{name}: tokens/s 1 GPU {one:,.0f}, DDP x{nproc} {row['ddp']['tokens_per_s']:,.0f} "
              f"({row['efficiency']['ddp']:.0%}), FSDP2 x{nproc} {row['fsdp']['tokens_per_s']:,.0f} "
              f"({row['efficiency']['fsdp']:.0%}); optimizer state per GPU FSDP2 / 1 GPU "
              f"{row['state_ratio_fsdp']:.2f}; peak MiB 1 {row['one']['peak_mem_mb']:,.0f}, DDP "
              f"{row['ddp']['peak_mem_mb']:,.0f}, FSDP2 {row['fsdp']['peak_mem_mb']:,.0f}; final val "
              + ", ".join(f"{k} {v:.4f}" for k, v in row["final_val"].items()), flush=True)
    return dict(nproc=nproc, stop_after=stop, train_args=list(train_args), cases=res,
                command=command or f"python bench.py --only multigpu  # train.py {' '.join(train_args)}")
