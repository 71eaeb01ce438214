"""
Speed benchmarks on one GPU (two for ddp). Every figure is a median of triton.testing.do_bench
(CUDA events, launch overhead included) measured in the same run as its baselines, reported as
ratios. Each section prints one table and writes one JSON, results/<gpu>_<date>_<section>.json.

    python bench.py                 # optim, noise, memory, train
    python bench.py --only optim    # 4-bit AdamW step (paper B) vs torch AdamW, bandwidth floor
    python bench.py --only host     # CPU: the 4-bit step's Python work per call (no GPU needed)
    python bench.py --only in_backward   # CPU (--device cuda: GPU): the step inside backward vs the ordinary one
    python bench.py --only noise    # GaussWS noise kernels (paper A, Figure 6)
    python bench.py --only memory   # bytes/param of the training state, measured vs arithmetic
    python bench.py --only capacity # the largest 7B-width Llama one GPU trains, per setup
    python bench.py --only train    # GPT-2-124M compiled: bf16 vs GaussWS vs plain-PyTorch eq. 3
    python bench.py --only train --table1 --compile   # + paper A Table 1 (llama-134m ... 70b-4l)
    python bench.py --only train --table1 --compile --no-gpt2 --models llama-1b   # one Table 1 row
    python bench.py --only train --table1 --compile blocks --no-gpt2   # Table 1, each block compiled
    python bench.py --only ddp --dataset D   # 2 GPUs (torchrun) vs 1 GPU, same global batch
    python bench.py --only multigpu --dataset D   # 1 GPU vs DDP vs FSDP2 on all GPUs, + DCP resumed on 1
    python bench.py --only fsdp              # train.py --fsdp under torchrun vs the plain path, same GPU, compiled
                                             # (GPT-2's tokenizer: tiktoken's files, or TIKTOKEN_CACHE_DIR offline)
    python bench.py --only fsdp --eager      # the same with train.py --no-compile
    python bench.py --only fsdp --train_args "--batch_size 32 --grad_accum 1"   # other train.py flags

The sections live in benchmarks/: kernels.py (optim, host, noise), training.py (train, memory, ddp,
fsdp), capacity.py, multigpu.py, in_backward.py, and the timing helpers and the JSON writer in
util.py. bench.py measures speed only; the papers' quality runs and the figures are the
reproduction harness's:

    python -m experiments quality --dataset D --preset small    # the papers' loss comparisons
    python -m experiments plots                                 # a PNG beside every results/*.json

The kernels' correctness on the GPU (bit-identity with the reference, the noise law) is checked
by the GPU-only tests: TRITON_INTERPRET=0 python -m pytest -q test_all.py tests -k gpu
"""
import argparse
import re
import shlex
import sys

import torch

import gaussws as g
from benchmarks.in_backward import bench_in_backward
from benchmarks.kernels import bench_host, bench_noise, bench_optim
from benchmarks.multigpu import CASES as MULTIGPU_CASES, bench_multigpu
from benchmarks.training import FSDP_WARMUP, TABLE1, bench_ddp, bench_fsdp, bench_memory, bench_train, bench_train_gpt2
from benchmarks.util import save
from trainer.flags import COMPILE_MODES, METHODS, OPTIMS, OneLineParser


# ---------------------------------------------------------------------------------------------
# command line

def build_parser():
    ap = OneLineParser(prog="bench.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["optim", "host", "in_backward", "noise", "train", "memory", "capacity", "ddp",
                                       "multigpu", "fsdp"],
                    default=None, help="run one section (default: optim, noise, memory and train)")
    ap.add_argument("--dataset", default="stdlib", help="--only ddp/multigpu/fsdp: train.py's --dataset")
    ap.add_argument("--iters", type=int, default=None,
                    help="--only ddp: training steps (default 300); --only multigpu: (default 150); --only fsdp: "
                         "(default 40)")
    ap.add_argument("--quick", action="store_true", help="skip the slow reference rows")
    ap.add_argument("--n_layer", type=int, default=None,
                    help="--only capacity: train each setup at this many layers instead of searching the largest")
    ap.add_argument("--setups", default="",
                    help="--only capacity: only the setups whose name contains this text (e.g. 'in backward')")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="--only in_backward: where it runs (the other sections need CUDA)")
    ap.add_argument("--compile", nargs="?", const="model", choices=["model", "blocks"], default=None,
                    help="--only train --table1: torch.compile each model whole (slow to start: minutes for the "
                         "larger ones), or with 'blocks' each transformer block (compiled once per model, "
                         "reused by all its blocks)")
    ap.add_argument("--table1", action="store_true", help="--only train: also paper A Table 1 (llama-134m ... "
                                                          "70b-4l; eager unless --compile)")
    ap.add_argument("--modes", default="default", help="--only train: torch.compile modes of the GPT-2 comparison, "
                                                       "comma-separated, each of: default, reduce-overhead")
    ap.add_argument("--pairs", type=int, default=2, help="--only train: interleaved rounds of the GPT-2 comparison "
                                                         "and of each Table 1 model")
    ap.add_argument("--gpt2", default=True, action=argparse.BooleanOptionalAction,
                    help="--only train: the GPT-2 comparison (--no-gpt2 --table1: Table 1 alone)")
    ap.add_argument("--models", default=",".join(p for p, _ in TABLE1),
                    help="--only train --table1: Table 1 rows, comma-separated (each compiles twice or more: one "
                         "model per run fits a time limit)")
    ap.add_argument("--methods", default="bf16,gaussws,diffq", help="--only train --table1: PQT methods (bf16 first)")
    ap.add_argument("--optims", default="adamw,zipsr", help="--only train --table1: optimizers")
    ap.add_argument("--cases", default=",".join(f"{m}/{o}" for m, o in MULTIGPU_CASES),
                    help="--only multigpu: train.py --method/--optim pairs, comma-separated, in this order")
    ap.add_argument("--eager", action="store_true", help="--only fsdp: train.py --no-compile")
    ap.add_argument("--reps", type=int, default=3,
                    help="--only fsdp: interleaved repetitions (plain, fsdp, plain, fsdp, ...)")
    ap.add_argument("--train_args", default="",
                    help='--only multigpu/fsdp: extra train.py flags, e.g. "--batch_size 32 --grad_accum 1"; '
                         'a single flag needs the = form: --train_args=--no-compile')
    return ap


def multigpu_cases(ap, text):
    """--cases as (method, optim) pairs; one-line error naming what is allowed."""
    pairs = [tuple(x.split("/")) for x in text.split(",") if x]
    bad = [x for x in text.split(",") if len(x.split("/")) != 2 or x.split("/")[0] not in METHODS
           or x.split("/")[1] not in OPTIMS]
    if bad or not pairs or len(set(pairs)) != len(pairs):
        ap.error(f"--cases {text!r}: each a train.py method/optim pair, once (methods {', '.join(METHODS)}; "
                 f"optims {', '.join(OPTIMS)})")
    return pairs


def check_args(ap, args):
    """One-line errors for values the sections would only trip over mid-run (the train section's
    flags only where it runs: elsewhere say_unread_flags names them)."""
    if args.only in (None, "train"):
        methods = args.methods.split(",")
        for name, vals, allowed in (("--methods", methods, ("bf16",) + g.METHODS),
                                    ("--optims", args.optims.split(","), OPTIMS),
                                    ("--modes", args.modes.split(","), COMPILE_MODES),
                                    ("--models", args.models.split(","), [p for p, _ in TABLE1])):
            if any(v not in allowed for v in vals) or len(set(vals)) != len(vals):
                ap.error(f"{name} {','.join(vals)}: allowed {', '.join(allowed)}, each once")
        if methods[0] != "bf16":
            ap.error(f"--methods {args.methods}: bf16 first (the others' baseline)")
        if args.pairs < 1:
            ap.error(f"--pairs {args.pairs}: need at least 1")
        if not args.gpt2 and not args.table1:
            ap.error("--no-gpt2 without --table1: nothing to run")
        if not args.table1 and (args.compile or args.models != ap.get_default("models")):
            ap.error(f"{'--compile' if args.compile else '--models'} without --table1: it picks how Table 1 runs "
                     "(add --table1)")
    if args.iters is not None and args.iters < 1:
        ap.error(f"--iters {args.iters}: need at least 1")
    if args.n_layer is not None and args.n_layer < 1:
        ap.error(f"--n_layer {args.n_layer}: need at least 1")
    from benchmarks.capacity import SETUPS
    if not any(args.setups in name for name in SETUPS):
        ap.error(f"--setups {args.setups!r}: no setup's name contains it; setups: {'; '.join(SETUPS)}")
    if args.reps < 1:
        ap.error(f"--reps {args.reps}: need at least 1")
    try:
        shlex.split(args.train_args)
    except ValueError as e:
        ap.error(f"--train_args {args.train_args!r}: {e} (quote it as one shell word)")
    if args.only == "multigpu":
        multigpu_cases(ap, args.cases)
    if args.only == "fsdp" and args.iters is not None and args.iters <= FSDP_WARMUP:
        ap.error(f"--iters {args.iters}: --only fsdp times the steps from {FSDP_WARMUP} on, so it needs more "
                 f"than {FSDP_WARMUP}")


# the sections that read each flag (--only unset: optim, noise, memory and train)
READ_BY = dict(quick=("optim",), device=("in_backward",), n_layer=("capacity",), setups=("capacity",), dataset=("ddp", "multigpu", "fsdp"), iters=("ddp", "multigpu", "fsdp"),
               cases=("multigpu",), eager=("fsdp",), reps=("fsdp",), train_args=("multigpu", "fsdp"),
               **{k: ("train",) for k in ("modes", "pairs", "gpt2", "table1", "methods", "optims", "compile", "models")})


def say_unread_flags(ap, args):
    """One line naming the flags set away from their default that the chosen sections do not
    read (as train.py does): the run goes on, but a flag meant for another section shows."""
    sections = {args.only} if args.only else {"optim", "noise", "memory", "train"}
    unread = [f"--{k}" for k, by in READ_BY.items() if getattr(args, k) != ap.get_default(k) and not sections & set(by)]
    if unread:
        print(f"note: not read by --only {args.only or '(default: optim, noise, memory, train)'}: "
              f"{', '.join(unread)}", flush=True)


# sections that left bench.py (speed only) for the reproduction harness
MOVED = {"quality": "python -m experiments quality", "plots": "python -m experiments plots"}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    only = [b for a, b in zip(argv, argv[1:]) if a == "--only"] + [a[7:] for a in argv if a.startswith("--only=")]
    if only and only[-1] in MOVED:
        ap.error(f"--only {only[-1]}: bench.py measures speed only; run {MOVED[only[-1]]} (same flags otherwise)")
    args = ap.parse_args(argv)
    check_args(ap, args)
    say_unread_flags(ap, args)
    if args.only == "host":   # CPU only: the step's Python work, the GPU launches stubbed out
        save("host", bench_host())
        return
    if args.only == "in_backward":   # the host work of stepping each tensor from its gradient's hook
        if args.device == "cuda" and not torch.cuda.is_available():
            ap.error("--device cuda: no CUDA GPU here (--only in_backward runs on CPU by default)")
        save("in_backward", bench_in_backward(device=args.device))
        return
    if not torch.cuda.is_available():
        raise SystemExit(f"bench.py {'--only ' + args.only if args.only else '(all sections)'} needs a CUDA "
                         "GPU; --only host runs on CPU (the tests cover correctness on CPU, and `python -m "
                         "experiments quality` trains the papers' quality runs on CPU too)")
    if args.only in (None, "optim"):
        save("optim", bench_optim(args.quick))
    if args.only in (None, "noise"):
        save("noise", dict(rows=bench_noise()))
    if args.only in (None, "memory"):
        save("memory", bench_memory())
    if args.only in (None, "train"):
        # Table 1 alone or a subset of its rows is saved apart, so one model per run can fill the table
        models = args.models.split(",")
        compiled = {None: "", "model": "_compiled", "blocks": "_compiled_blocks"}[args.compile]
        section = "train" if args.gpt2 else "train_table1" + compiled + (
            "" if len(models) == len(TABLE1) else "_" + "_".join(models))
        res = bench_train_gpt2(modes=args.modes.split(","), pairs=args.pairs) if args.gpt2 else dict(rows=[])
        if args.gpt2:
            save(section, dict(res, partial=args.table1))
        if args.table1:
            t1 = bench_train(cases=[c for c in TABLE1 if c[0] in models], optims=tuple(args.optims.split(",")),
                             methods=tuple(args.methods.split(",")), rounds=args.pairs,
                             compile={None: False, "model": True, "blocks": "blocks"}[args.compile],
                             on_row=lambda rows: save(section, dict(res, rows=res["rows"] + rows, partial=True)))
            save(section, dict(res, rows=res["rows"] + t1["rows"], table1_geomean_overhead_pct=t1["geomean_overhead_pct"],
                               command="python bench.py " + shlex.join(argv)))
    if args.only == "capacity":
        from benchmarks.capacity import SETUPS, bench_capacity
        cmd = "python bench.py " + shlex.join(argv)
        setups = [name for name in SETUPS if args.setups in name]
        save("capacity", dict(bench_capacity(setups, n_layer=args.n_layer, on_row=lambda rows: save(
            "capacity", dict(rows=rows, partial=True, command=cmd))), command=cmd))
    if args.only == "ddp":
        if torch.cuda.device_count() < 2:
            raise SystemExit("--only ddp needs 2 GPUs")
        save("ddp", bench_ddp(["--preset", "gpt2-124m", "--dataset", args.dataset, "--batch_size", "16",
                               "--grad_accum", "2", "--max_iters", str(args.iters or 300), "--eval_interval", "50",
                               "--eval_windows", "64", "--no-plot"]))
    if args.only == "multigpu":
        n = torch.cuda.device_count()
        if n < 2:
            raise SystemExit(f"--only multigpu needs 2 or more GPUs of one host; this one has {n}")
        flags = ["--preset", "gpt2-124m", "--dataset", args.dataset, "--tokenizer", "gpt2", "--batch_size", "16",
                 "--max_iters", str(args.iters or 150), "--eval_interval", "25", "--eval_windows", "64",
                 *shlex.split(args.train_args)]
        save("multigpu", bench_multigpu(flags, nproc=n, cases=multigpu_cases(ap, args.cases),
                                        command="python bench.py " + shlex.join(argv)))
    if args.only == "fsdp":   # GaussWS + ZIP-SR as users run train.py on CUDA: compiled (--eager: not), GPT-2's
        # tokenizer (gpt2, not auto: no silent fall-back to bytes; their 256-entry LM head leaves a host-bound step)
        flags = ["--preset", "gpt2-124m", "--dataset", args.dataset, "--tokenizer", "gpt2", "--method", "gaussws",
                 "--optim", "zipsr", "--batch_size", "16", "--grad_accum", "2", "--max_iters", str(args.iters or 40),
                 "--eval_interval", "1000", "--eval_windows", "16", "--no-plot"]
        flags += (["--no-compile"] if args.eager else []) + shlex.split(args.train_args)  # later flags win
        section = ("fsdp_eager" if args.eager else "fsdp") + (
            "_" + re.sub(r"[^A-Za-z0-9]+", "_", args.train_args).strip("_") if args.train_args else "")
        save(section, bench_fsdp(flags, reps=args.reps, command="python bench.py " + shlex.join(argv)))


if __name__ == "__main__":
    main()
