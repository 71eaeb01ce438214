r"""
Paper reproduction: the quality runs (both papers' loss comparisons, same data, seeds and steps
for every run; small models, or each claim's runs at GPT-2-124M), paper A's experiment 5
(cast.py: trained tiles cast to the Table C formats, Figure 5's learned bitwidths), and the
`plots` command (plots.py draws the figures from the result JSON files). The run folders'
machinery is runs.py, the numbers' reading (gaps, verdicts, tables) metrics.py. Runs on CPU or
GPU; speed is measured by bench.py.

    python -m experiments quality --dataset D --preset small   # the papers' loss comparisons
    python -m experiments quality --preset mini --dataset D --seeds 0,1,2,3 --tokens_per_param 20 \
        --jobs 20 --train_args "--tokenizer byte --batch_size 128"   # 20 concurrent train.py runs
    python -m experiments quality --suite gpt2 --preset gpt2-124m --dataset D --iters 2880 --seeds 0,1,2 \
        --jobs 3 --resume --max_runs 11 --out_dir out-q124 --train_args "--tokenizer gpt2 --eval_interval 240"
        # results/quality.md section 16; --resume continues from what out-q124 holds; --max_runs 0:
        # only the tables, JSON and figures, e.g. from results/quality_gpt2/runs.tar.xz extracted there
    python -m experiments plots                        # a PNG beside every results/*.json
    python -m experiments plots results/X_optim.json   # the named files only

A quality run writes its run folders and loss-curve PNGs to --out_dir and its result to
results/<gpu>_<date>_quality.json (with --out_dir: <out_dir>/quality.json).
"""
import argparse
import glob
import json
import math
import os
import re
import shlex
import sys

import torch

from benchmarks.util import save
from experiments import runs as quality_runs
from experiments.cast import save_cast
from experiments.metrics import bytes_per_param, noise_floor, paired_gap, quality_tables, trained_on, verdict
from experiments.plots import plot_bitwidth, plot_cast, plot_quality, plot_results
from trainer.util import RunError

# ---------------------------------------------------------------------------------------------
# quality: the papers' comparisons at small scale, same data, seeds and steps for every run

# experiment -> runs. A run is (method, optim) or (method, optim, extra train.py flags, label);
# runs with the same (method, optim, flags) are trained once and shared between experiments.
QUALITY = {
    # paper A; the bits_wd 0.5 run pulls b_t down toward b_target harder than the default 0.1
    "pqt": [("bf16", "adamw"), ("gaussws", "adamw"), ("diffq", "adamw"),
            ("gaussws", "adamw", ("--bits_wd", "0.5"), "gaussws/adamw bits_wd 0.5")],
    "optim": [("bf16", "fp32"), ("bf16", "torchao"), ("bf16", "zeeden"), ("bf16", "zipsr")],  # paper B
    # paper B Figure 1: zero-inclusive Dyn4 second moment with state-space rounding vs Update-SR
    # (Dyn4 + Update-SR is ZIP-SR). The paper keeps m in FP32 there; AdamW4bit quantizes m (NF4,
    # the zipsr preset's) whenever v is quantized, so only the v rule differs between these runs.
    "zeropoint": [("bf16", "fp32"),
                  ("bf16", "zipsr", (), "Dyn4 Update-SR (zipsr)"),
                  ("bf16", "zipsr", ("--v_codebook", "dyn4", "--v_rounding", "state-rtn"), "Dyn4 State-RTN"),
                  ("bf16", "zipsr", ("--v_codebook", "dyn4", "--v_rounding", "state-sr"), "Dyn4 State-SR")],
    "combined": [("bf16", "adamw"), ("gaussws", "zipsr")],                         # A + B together
    # BF16 parameters (no FP32 master copy) with ZIP-SR: how the new weight is written
    "bf16params": [("bf16", "zipsr", (), "FP32 params (master)"),
                   ("bf16", "zipsr", ("--param_dtype", "bf16"), "BF16 params, RTN write"),
                   ("bf16", "zipsr", ("--param_dtype", "bf16", "--param_rounding", "sr"), "BF16 params, SR write"),
                   ("bf16", "zipsr", ("--param_dtype", "bf16", "--master_weight_bits", "24"),
                    "BF16 params + int8 correction (24-bit master)")],
}


# GPT-2-124M on real text (results/quality.md, "GPT-2-124M"): each claim's runs and no more. The
# BF16 + torch AdamW run is every comparison's baseline: torch's fused AdamW is also what
# AdamW4bit's "fp32" preset steps FP32 tensors with, so it is paper B's 32-bit AdamW too. An
# experiment may name its own seeds (a subset of --seeds); a run with a tag (5th item) is trained
# again in its own folder with the same flags: "noise" is the same-seed rerun spread.
_BASE = ("bf16", "adamw", (), "BF16 + 32-bit AdamW")
QUALITY_GPT2 = {
    "pqt": [_BASE, ("gaussws", "adamw", (), "GaussWS [all] + AdamW"),                          # paper A
            ("diffq", "adamw", (), "DiffQ + AdamW")],
    "optim": [_BASE, ("bf16", "torchao", (), "TorchAO preset"), ("bf16", "zeeden", (), "ZE-EDEN"),  # paper B
              ("bf16", "zipsr", (), "ZIP-SR")],
    "smallest": [_BASE,
                 ("gaussws", "zipsr", ("--param_dtype", "bf16", "--master_weight_bits", "24"),
                  "GaussWS + ZIP-SR, BF16 params + 24-bit master"),
                 ("gaussws", "zipsr", ("--param_dtype", "bf16"), "GaussWS + ZIP-SR, BF16 params")],
    "zeropoint": dict(seeds=(0,), runs=[_BASE] + QUALITY["zeropoint"][1:]),
    "noise": dict(seeds=(0,), runs=[_BASE, ("bf16", "adamw", (), "BF16 + 32-bit AdamW, rerun", "rerun")]),
}
SUITES = {"small": QUALITY, "gpt2": QUALITY_GPT2}


def _spec(run):
    """(method, optim, extra flags as a tuple of str, label, tag) of a QUALITY run."""
    method, optim, *rest = run
    extra = tuple(rest[0]) if rest else ()
    label = rest[1] if len(rest) > 1 else f"{method}/{optim}" + "".join(f" {x}" for x in extra)
    return method, optim, extra, label, rest[2] if len(rest) > 2 else ""


def _experiment(definition, seeds):
    """(runs, seeds) of an experiment: a list of runs, or dict(runs=..., seeds=...) whose own
    seeds are kept where --seeds has them."""
    if isinstance(definition, dict):
        return definition["runs"], [s for s in seeds if s in definition["seeds"]]
    return definition, list(seeds)


def _run_dir(out_dir, method, optim, extra, tag, seed):
    flags = "".join(("_" if x.startswith("--") else "-") + re.sub(r"[^\w.-]", "_", x.lstrip("-")) for x in extra)
    return os.path.join(out_dir, f"{method}_{optim}{flags}{'_' + tag if tag else ''}_s{seed}")


def bench_quality(train_args, seeds=(0, 1), out_dir="out-quality", experiments=QUALITY, jobs=1,
                  cast=True, command=None, resume=False, max_runs=None, overwrite=False):
    """Train every run of `experiments` for each seed with the same train.py flags (`train_args`:
    preset, dataset, steps, ...) and compare final val losses (mean over seeds; the gap to the
    first run of the experiment paired by seed, with its standard error).
    For "optim" also the share of TorchAO's gap to 32-bit AdamW each method closes (paper B:
    ZIP-SR / ZE-EDEN close up to 70 % of it at every size); for "zeropoint" (paper B Figure 1) the
    training-loss curves, where a diverged run (NaN/inf loss) is recorded with its step instead of
    stopping the others. With an experiment "pqt" and cast=True also experiment 5 on each of its
    runs (save_cast: val loss before and after casting tiles to their Table C formats, written to
    the run's cast.json) and the Figure 5 bitwidth chart.
    experiments: {name: [run, ...] or dict(runs=[...], seeds=(...))} (QUALITY, QUALITY_GPT2).
    Runs go seed by seed (every run of seed 0 first), so a partial set still compares methods.
    jobs=1 trains in this process; jobs>1 runs that many `python train.py` subprocesses at once,
    spread over the visible GPUs. Runs shared between experiments are trained once.
    resume=True keeps what out_dir holds: a finished run is read from its log.jsonl and cast.json
    (its checkpoint may be gone), an interrupted one continues from its checkpoint (train.py
    refuses a changed configuration), so a comparison can be spread over many invocations and
    machines. max_runs: train at most this many runs now; the others stay pending (None in
    their rows' seeds); 0 is a report of what out_dir holds: the dataset is neither prepared nor
    compared with the runs' (their corpus may lie elsewhere here; it is named), and an out_dir
    holding none of the runs is a RunError. The result's gpu / torch / triton are where the runs
    trained (their log summaries), with trained_on counting runs per machine. Without resume, run
    folders already in out_dir are a RunError unless overwrite=True (they are then trained again).
    The train.py flags are checked (and the dataset prepared) before any run folder is written: a
    bad flag is a RunError naming it.
    An experiment whose own seeds are not among `seeds` is left out with a note.
    Writes loss-curve PNGs when matplotlib is installed.
    Returns {"command", "seeds", "experiments": {experiment: {label: {...}}}, "cast", "bitwidth",
    "failed_runs", "pending_runs"}."""
    runs = {}      # (method, optim, extra, tag, seed) -> run folder, seed by seed
    for seed in seeds:
        for exp, definition in experiments.items():
            rs, exp_seeds = _experiment(definition, seeds)
            for run in rs:
                method, optim, extra, _, tag = _spec(run)
                if seed in exp_seeds:
                    runs.setdefault((method, optim, extra, tag, seed),
                                    _run_dir(out_dir, method, optim, extra, tag, seed))
    casts = {runs[(*_spec(r)[:3], _spec(r)[4], s)]: f"{_spec(r)[3]} s{s}"
             for s in seeds for r in (experiments.get("pqt", []) if cast else [])}

    def run_argv(method, optim, extra, tag, seed):
        return [*train_args, "--method", method, "--optim", optim, *extra, "--seed", str(seed),
                "--out_dir", runs[(method, optim, extra, tag, seed)], "--no-plot"]

    report = max_runs == 0   # train nothing: read the run folders as they are
    if runs and not report:   # a flag train.py refuses stops here, before any run folder is read or written
        quality_runs.prepare_data(run_argv(*next(iter(runs))), prepare=False)
    held = [d for d in runs.values()
            if any(os.path.exists(os.path.join(d, f)) for f in ("log.jsonl", "ckpt.pt", "ckpt"))]
    if held and not (resume or overwrite):
        raise RunError(
            f"{out_dir} already holds {len(held)} of these runs ({', '.join(map(os.path.basename, held[:3]))}"
            f"{', ...' if len(held) > 3 else ''}): add --resume to keep and continue them, or --overwrite to "
            "train them again")
    if report and runs and not held:   # (a mistyped --out_dir must not overwrite a report with an empty one)
        raise RunError(f"--max_runs 0 reports the runs --out_dir holds, and {out_dir} holds none of these "
                       f"(e.g. {os.path.basename(next(iter(runs.values())))}): extract the runs' archive there, "
                       "or leave out --max_runs 0 to train them")
    if resume and runs and not held:
        print(f"[quality] --resume: {out_dir} holds none of these runs yet; they start from the beginning")
    os.makedirs(out_dir, exist_ok=True)
    logs = {d: quality_runs.log_records(d) for d in runs.values()}   # each log read once, and again if trained
    todo, corpora = [], set()
    for key, d in runs.items():
        argv = run_argv(*key)
        done = resume and quality_runs.trained(d, logs[d])
        if done or (resume and os.path.exists(os.path.join(d, "ckpt.pt"))):
            corpora.add(quality_runs.same_run(d, argv, any_dataset=report))
        if done or (max_runs is not None and len(todo) >= max_runs):
            continue
        if os.path.exists(os.path.join(d, "ckpt.pt")):        # continue it, or train it again
            argv.append("--resume" if resume else "--overwrite")
        elif os.path.exists(os.path.join(d, "log.jsonl")):    # stopped before its first checkpoint
            argv.append("--overwrite")
        todo.append((argv, d))
    given = quality_runs.flag_value(train_args, "--dataset")
    if corpora - {None, given}:
        print(f"[quality] the saved runs were trained on --dataset {', '.join(sorted(corpora - {None}))} "
              f"(--dataset {given} is not read: --max_runs 0)")
    if todo:
        quality_runs.prepare_data(todo[0][0])
    for argv, d in todo:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "argv.json.tmp"), "w") as f:   # what --resume compares (same_run)
            json.dump(argv, f)
        os.replace(os.path.join(d, "argv.json.tmp"), os.path.join(d, "argv.json"))
    failed = {}
    if todo and jobs > 1:
        failed = quality_runs.train_subprocesses(todo, jobs)
    else:
        for argv, d in todo:
            quality_runs.train_inprocess(argv, d)
    logs.update({d: quality_runs.log_records(d) for _, d in todo})
    trained = {d: quality_runs.trained(d, logs[d]) for d in runs.values()}
    for d, label in casts.items():   # experiment 5 while the checkpoints are here
        if trained[d] and os.path.exists(os.path.join(d, "ckpt.pt")) and \
                not (resume and os.path.exists(os.path.join(d, "cast.json"))):
            save_cast(d, label)
    read = {d: quality_runs.read_run(d, logs[d]) if trained[d] else None for d in runs.values()}
    res = {}
    for exp, definition in experiments.items():
        rs, exp_seeds = _experiment(definition, seeds)
        if not exp_seeds:
            print(f"[{exp}] left out: its runs are for seed(s) {', '.join(map(str, definition['seeds']))}, "
                  "not in --seeds")
            continue
        rows, base = {}, None
        for run in rs:
            method, optim, extra, label, tag = _spec(run)
            per = [read[runs[(method, optim, extra, tag, s)]] for s in exp_seeds]
            done = [(s, r) for s, r in zip(exp_seeds, per) if r]
            finals = [r["final_val_loss"] for _, r in done]
            ok = bool(finals) and all(x is not None and math.isfinite(x) for x in finals)
            base = per if base is None else base
            gap, gap_se, gaps = paired_gap(exp_seeds, per, base)
            first = done[0][1] if done else None
            rows[label] = dict(
                method=method, optim=optim, flags=list(extra), seeds=[s for s, _ in done], final_val_loss=finals,
                mean=sum(finals) / len(finals) if ok else None,
                gap_to_first=gap, gap_se=gap_se, gap_per_seed=gaps,
                final_train_loss=[r["final_train_loss"] for _, r in done],
                diverged_at=[r["diverged_at"] for _, r in done],
                bytes_per_param=bytes_per_param(first, extra),
                **{k: first[k] if first else None for k in ("optimizer_state_mb", "peak_mem_mb", "tokens_per_s")},
                curves=[dict(seed=s, val=r["val_curve"], train=r["train_curve"]) for s, r in done])
        if exp == "optim":
            gap_ao = next((r["gap_to_first"] for r in rows.values() if r["optim"] == "torchao" and not r["flags"]),
                          None)
            for r in rows.values():   # undefined unless TorchAO is behind 32-bit AdamW
                r["share_of_torchao_gap_closed"] = (1 - r["gap_to_first"] / gap_ao
                                                    if gap_ao and gap_ao > 0 and r["gap_to_first"] is not None
                                                    else None)
        res[exp] = rows
    floor = noise_floor(res)
    for exp, rows in res.items():
        for i, r in enumerate(rows.values()):
            r["verdict"] = (verdict(r["gap_to_first"], r["gap_se"], floor, len(r["gap_per_seed"]))
                            if i and exp != "noise" else None)
        print(f"[{exp}] " + "; ".join(
            f"{k}: " + (f"{v['mean']:.4f} ({v['gap_to_first']:+.4f}"
                        + (f" ± {v['gap_se']:.4f}" if v["gap_se"] is not None else "")
                        + f", {len(v['seeds'])} seed{'s' * (len(v['seeds']) != 1)})"
                        if v["gap_to_first"] is not None else
                        f"{v['mean']}" if v["mean"] is not None else
                        "pending" if not v["seeds"] else
                        "diverged at step " + ", ".join(str(x) for x in v["diverged_at"]))
            for k, v in rows.items()))
        plot_quality(exp, rows, os.path.join(out_dir, f"{exp}.png"), train_loss=exp == "zeropoint",
                     noise_floor=floor)
    out = dict(command=command or f"python -m experiments quality  # train.py {' '.join(train_args)}",
               seeds=list(seeds), noise_floor=floor, experiments=res, **trained_on(read.values()))
    if casts:
        found = [(label, read[d]["cast"]) for d, label in casts.items() if read[d] and read[d]["cast"]]
        out["cast"] = {label: c["row"] for label, c in found}
        out["bitwidth"] = {label: c["bitwidth"] for label, c in found if c.get("bitwidth")}
        drawn = next(((label, c) for label, c in found
                      if c.get("layers") and c["bitwidth"]["method"] == "gaussws"), None)
        if drawn:
            plot_bitwidth(drawn[1]["layers"], os.path.join(out_dir, "bitwidth.png"),
                          f"{drawn[0]}: learned b_t per layer (paper A Figure 5)")
        plot_cast(out["cast"], os.path.join(out_dir, "cast.png"))
    pending = [d for d in runs.values() if not trained[d] and d not in failed]
    out["failed_runs"], out["pending_runs"] = failed, pending
    for d, msg in failed.items():
        print(f"[quality] run {d} FAILED: {msg[-500:]}")
    if pending:
        print(f"[quality] {len(pending)} run(s) not finished; continue with the same command and --resume"
              + (", without --max_runs 0" if max_runs == 0 else ""))
    return out


# ---------------------------------------------------------------------------------------------
# command line

def add_quality_args(ap):
    """The `quality` command's flags, added to the parser ap."""
    ap.add_argument("--dataset", default="stdlib", help="train.py's --dataset (default stdlib)")
    ap.add_argument("--iters", type=int, default=None, help="train.py --max_iters instead of --tokens_per_param")
    ap.add_argument("--preset", default="small", help="train.py's --preset (default small; gpt2-124m for --suite gpt2)")
    ap.add_argument("--tokens_per_param", type=float, default=None,
                    help="run length in training tokens per parameter (default 20; not with --iters)")
    ap.add_argument("--suite", default="small", choices=tuple(SUITES),
                    help="the experiments' runs: small (default; QUALITY: small models, extra variants) or "
                         "gpt2 (QUALITY_GPT2: each claim's runs at GPT-2-124M, with a same-seed rerun of "
                         "seed 0 whose spread the tables' verdicts use)")
    ap.add_argument("--experiments", default=None,
                    help="comma list of the suite's experiments, default all: "
                         + "; ".join(f"{k} {','.join(v)}" for k, v in SUITES.items())
                         + " (pqt adds the Table C cast and the Figure 5 chart)")
    ap.add_argument("--seeds", default="0,1", help="comma list of seeds (default 0,1); each run's gap to the baseline "
                                                   "is paired by seed, and a verdict says whether it is within noise: "
                                                   "|gap| <= max(95 %% t half-width, the rerun spread)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="concurrent train.py subprocesses (spread over visible GPUs); 1 = train in this process")
    ap.add_argument("--train_args", default="",
                    help='extra train.py flags for every run, e.g. "--batch_size 32 --block_size 256"; '
                         'a single flag needs the = form: --train_args=--no-compile')
    ap.add_argument("--out_dir", default=None, help="run folders and plots; default results/quality_[cpu_]<preset>")
    ap.add_argument("--resume", action="store_true",
                    help="keep what --out_dir holds: finished runs are read from their logs, "
                         "interrupted ones continue from their checkpoints; a run folder trained with "
                         "other train.py flags (any, --iters and --eval_interval too) is refused")
    ap.add_argument("--overwrite", action="store_true",
                    help="train again the runs --out_dir already holds (without it or --resume, "
                         "such folders stop the command)")
    ap.add_argument("--max_runs", type=int, default=None,
                    help="train at most this many runs now (seed 0 of every run first); "
                         "the rest later with --resume; 0 trains nothing and reports what --out_dir "
                         "holds (--dataset is then not read)")


def run_quality(args, ap, command):
    """Check the `quality` flags of args (errors through ap.error, the quality command's parser),
    run bench_quality and save its JSON (its "command": `command`); exits non-zero when a run
    failed. Returns the result."""
    suite = SUITES[args.suite]
    exps = list(suite) if args.experiments is None else [x for x in args.experiments.split(",") if x]
    bad = [x for x in exps if x not in suite]
    if bad or not exps:
        ap.error(f"--experiments {args.experiments!r}: unknown {', '.join(bad) or '(empty)'} in --suite "
                 f"{args.suite}; allowed: comma list of {', '.join(suite)}")
    if args.max_runs is not None and args.max_runs < 0:
        ap.error(f"--max_runs {args.max_runs}: must be an integer >= 0 (0 trains nothing and reports what is saved)")
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds {args.seeds!r}: must be a comma list of integers >= 0, e.g. 0,1")
    if min(seeds) < 0 or len(set(seeds)) != len(seeds):
        ap.error(f"--seeds {args.seeds!r}: must be distinct integers >= 0 (each seed is one run folder)")
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: must be an integer >= 1")
    if args.out_dir is not None and not args.out_dir.strip():
        ap.error(f"--out_dir {args.out_dir!r}: empty; give a folder, or leave the flag out for the default")
    if args.out_dir is not None and os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        ap.error(f"--out_dir {args.out_dir}: a file, not a folder; give a folder for the run folders")
    if args.iters is not None and args.iters < 1:
        ap.error(f"--iters {args.iters}: must be an integer >= 1 (steps per run)")
    if args.iters is not None and args.tokens_per_param is not None:
        ap.error(f"--iters {args.iters} and --tokens_per_param {args.tokens_per_param:g}: give one run length")
    if args.resume and args.overwrite:
        ap.error("--resume and --overwrite: keep the runs --out_dir holds, or train them again, not both")
    managed = {"--max_iters": "--iters", "--tokens_per_param": "--tokens_per_param", "--seed": "--seeds",
               "--method": "--experiments", "--optim": "--experiments", "--out_dir": "--out_dir",
               "--resume": "--resume", "--preset": "--preset", "--dataset": "--dataset",
               "--stop_after": "--max_runs (whole runs) or a time limit, then --resume"}
    try:
        train_tokens = shlex.split(args.train_args)
    except ValueError as e:
        ap.error(f"--train_args {args.train_args!r}: {e} (quote it as one shell word)")
    for tok in train_tokens:
        flag = tok.split("=")[0]
        if flag in managed:
            ap.error(f"--train_args {args.train_args!r}: {flag} is set per run by the harness; "
                     f"use {managed[flag]} instead")
    length = (["--max_iters", str(args.iters)] if args.iters
              else ["--tokens_per_param", f"{args.tokens_per_param or 20:g}"])
    out_dir = args.out_dir or f"results/quality_{'' if torch.cuda.is_available() else 'cpu_'}{args.preset}"
    try:
        res = bench_quality(["--preset", args.preset, "--dataset", args.dataset, *length, *train_tokens],
                            seeds=seeds, out_dir=out_dir, experiments={k: suite[k] for k in exps},
                            jobs=args.jobs, resume=args.resume, command=command, max_runs=args.max_runs,
                            overwrite=args.overwrite)
    except RunError as e:   # a run's flags or files (train.py's own errors, a changed --resume)
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    # an explicit --out_dir keeps its JSON there; the default goes to results/ by GPU and date
    save("quality", res, os.path.join(args.out_dir, "quality.json") if args.out_dir else None)
    print(quality_tables(res))
    if res["failed_runs"]:
        raise SystemExit(f"{len(res['failed_runs'])} quality run(s) failed: {', '.join(res['failed_runs'])}")
    return res


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m experiments", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="{quality,plots}")
    q = sub.add_parser("quality", help="train the QUALITY experiments and compare their losses")
    add_quality_args(q)
    q.set_defaults(parser=q)     # its errors show the quality usage line
    p = sub.add_parser("plots", help="a PNG beside each result JSON")
    p.add_argument("paths", nargs="*", help="result JSON files (default: results/*.json)")
    return ap


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.command == "plots":
        for path in args.paths:
            try:
                with open(path) as f:
                    ok = isinstance(json.load(f), dict)
            except (OSError, ValueError) as e:
                ap.error(f"plots {path}: not a readable result JSON ({type(e).__name__}: {str(e)[:100]})")
            if not ok:
                ap.error(f"plots {path}: not a result JSON (a JSON object written by bench.py or the harness)")
        plot_results(args.paths or sorted(glob.glob(os.path.join("results", "*.json"))))
    else:
        run_quality(args, args.parser, "python -m experiments " + shlex.join(argv))


if __name__ == "__main__":
    main()

