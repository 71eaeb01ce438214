"""experiments/: the quality harness (runs, resume from logs, verdicts, concurrent runs, signals),
the plots, the diagnostics (python -m experiments.tools)."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
import triton

import bench
import gaussws as g
import train
from benchmarks import training as bench_training
from experiments import quality as experiments, tools
from experiments.cast import load_run
from experiments.metrics import noise_floor, verdict
from experiments.plots import plot_results
from lowbit.pqt.export import CAST_SWEEP, cast_to_tiers
from trainer.log import read_log as read_run_log
from trainer.util import RunError

from tests.helpers import ROOT, base_args, nano_args


def test_bench_quality_compares_runs_with_shared_baseline(corpus, tmp_path):
    args = base_args(corpus, tmp_path / "unused", "--max_iters", "4", "--eval_interval", "2")
    args = args[:args.index("--out_dir")] + args[args.index("--out_dir") + 2:]
    exps = {"optim": [("bf16", "fp32"), ("bf16", "torchao"), ("bf16", "zipsr")],
            "pqt": [("bf16", "fp32"), ("gaussws", "fp32")]}
    res = experiments.bench_quality(args, seeds=(0, 1), out_dir=str(tmp_path), experiments=exps)["experiments"]
    runs = {d for d in os.listdir(tmp_path) if os.path.isdir(tmp_path / d)}
    assert runs == {f"{r}_s{s}" for r in ("bf16_fp32", "bf16_torchao", "bf16_zipsr", "gaussws_fp32")
                    for s in (0, 1)}                  # the shared bf16/fp32 run is trained once
    opt = res["optim"]
    assert opt["bf16/fp32"]["gap_to_first"] == 0.0
    assert opt["bf16/torchao"]["share_of_torchao_gap_closed"] == pytest.approx(0.0)
    for k, r in opt.items():
        assert len(r["final_val_loss"]) == 2 and r["mean"] == pytest.approx(sum(r["final_val_loss"]) / 2)
    assert res["pqt"]["bf16/fp32"]["mean"] == opt["bf16/fp32"]["mean"]
    assert opt["bf16/zipsr"]["optimizer_state_mb"] < opt["bf16/fp32"]["optimizer_state_mb"]


def test_quality_runs_seed_by_seed_and_resume_from_logs_without_checkpoints(corpus, tmp_path):
    """bench_quality spread over invocations (as over machines whose disks are gone): --max_runs
    trains seed 0 of every run first and leaves the rest pending; with resume=True a finished run
    is read back from its log.jsonl and cast.json after its checkpoint is deleted (not trained
    again), the pending ones train, an experiment keeps only its own seeds, a tagged run trains
    again in its own folder, and gaps are paired by seed with their standard error."""
    args = nano_args(corpus, "--max_iters", "4", "--eval_interval", "2", "--no-plot")
    exps = {"pqt": [("bf16", "adamw"), ("gaussws", "adamw")],
            "noise": dict(seeds=(0,), runs=[("bf16", "adamw"), ("bf16", "adamw", (), "rerun", "rerun")])}
    out = experiments.bench_quality(args, seeds=(0, 1), out_dir=str(tmp_path), experiments=exps, max_runs=2,
                                    resume=True)
    assert sorted(os.listdir(tmp_path / "bf16_adamw_s0")) and not os.path.exists(tmp_path / "bf16_adamw_s1")
    assert [os.path.basename(d) for d in out["pending_runs"]] == ["bf16_adamw_rerun_s0", "bf16_adamw_s1",
                                                                   "gaussws_adamw_s1"]
    assert out["experiments"]["pqt"]["gaussws/adamw"]["seeds"] == [0]
    assert out["experiments"]["noise"]["rerun"]["seeds"] == [] and out["experiments"]["noise"]["rerun"]["mean"] is None
    first = {k: v["row"] for k, v in ((k, json.load(open(tmp_path / d / "cast.json")))
                                      for k, d in (("b", "bf16_adamw_s0"), ("g", "gaussws_adamw_s0")))}
    assert first["g"]["tiers"] == "learned b_t" and first["b"]["tiers"].startswith("fixed")
    logs = {d: os.path.getmtime(tmp_path / d / "log.jsonl") for d in ("bf16_adamw_s0", "gaussws_adamw_s0")}
    for d in logs:
        os.remove(tmp_path / d / "ckpt.pt")
    out = experiments.bench_quality(args, seeds=(0, 1), out_dir=str(tmp_path), experiments=exps, resume=True)
    assert all(os.path.getmtime(tmp_path / d / "log.jsonl") == t for d, t in logs.items())   # not trained again
    assert out["pending_runs"] == [] and out["failed_runs"] == {}
    assert not os.path.exists(tmp_path / "bf16_adamw_rerun_s1") and os.path.exists(tmp_path / "bf16_adamw_rerun_s0")
    pqt, noise = out["experiments"]["pqt"], out["experiments"]["noise"]
    b, gw = pqt["bf16/adamw"], pqt["gaussws/adamw"]
    assert b["seeds"] == gw["seeds"] == [0, 1] and noise["rerun"]["seeds"] == [0]
    gaps = [x - y for x, y in zip(gw["final_val_loss"], b["final_val_loss"])]
    assert gw["gap_per_seed"] == list(zip((0, 1), gaps)) and gw["gap_to_first"] == pytest.approx(sum(gaps) / 2)
    assert gw["gap_se"] == pytest.approx(abs(gaps[0] - gaps[1]) / 2)     # std / sqrt(2) of two values
    assert noise["rerun"]["final_val_loss"] == [b["final_val_loss"][0]]  # CPU runs repeat bit for bit
    assert set(out["cast"]) == {"bf16/adamw s0", "gaussws/adamw s0", "bf16/adamw s1", "gaussws/adamw s1"}
    assert out["cast"]["gaussws/adamw s0"] == first["g"] and set(out["bitwidth"]) == {"gaussws/adamw s0",
                                                                                       "gaussws/adamw s1"}
    assert b["bytes_per_param"] == pytest.approx(4 + b["optimizer_state_mb"] * 2 ** 20 / read_run_log(
        tmp_path / "bf16_adamw_s0" / "log.jsonl")[-1]["params"])
    # a damaged cast.json is left out with a note, not a crash; --resume with other flags is refused
    (tmp_path / "gaussws_adamw_s1" / "cast.json").write_text('{"row": ')
    again = experiments.bench_quality(args, seeds=(0, 1), out_dir=str(tmp_path), experiments=exps, resume=True)
    assert "gaussws/adamw s1" not in again["cast"] and again["experiments"] == out["experiments"]
    with pytest.raises(RunError, match=r"gaussws_adamw_s0 was trained with other train.py flags "
                                             r"\(--max_iters 4 then, --max_iters 6 now\)"):
        experiments.bench_quality([*args, "--max_iters", "6"], seeds=(0,), out_dir=str(tmp_path),
                                  experiments={"pqt": exps["pqt"][1:]}, resume=True)
    assert out["noise_floor"] == 0.0 and noise["rerun"]["verdict"] is None and b["verdict"] is None
    table = experiments.quality_tables(out)
    assert f"| gaussws/adamw | 0,1 | {gw['mean']:.4f} | {gw['gap_to_first']:+.4f} ± {gw['gap_se']:.4f} |" in table
    assert "| rerun | 0 |" in table and table.count("**") == 6 and table.startswith("same-seed rerun spread: 0.0000")
    c, layers = out["cast"]["gaussws/adamw s0"], out["bitwidth"]["gaussws/adamw s0"]["layers"].values()
    b_t = sum(v["mean"] * v["params"] for v in layers) / sum(v["params"] for v in layers)
    assert (f"| gaussws/adamw s0 | {b_t:.2f} | " in table and f" | {c['delta']:+.4f} | "
            + " | ".join(f"{x:+.4f}" for x in c["sweep_delta"].values()) + " |" in table)   # experiment 5


def test_quality_verdict_weighs_a_gap_against_the_t_interval_and_the_rerun_spread():
    """A gap is "within noise" up to the larger of the 95 % t half-width of the paired gaps and the
    same-seed rerun spread, else "worse" or "better"; with no bound above 0 there is no verdict.
    The spread is the largest |gap| of experiment "noise"'s reruns to its first run."""
    v = verdict
    assert v(0.0079, 0.0041, 0.0058, 2) == "within noise"           # 12.71 s.e. with 2 seeds
    assert v(0.03, 0.004, 0.0058, 3) == "worse" and v(0.017, 0.004, 0.0058, 3) == "within noise"   # 4.30 s.e.
    assert v(0.022, None, 0.0058, 1) == "worse" and v(-0.01, 0.001, 0.0058, 3) == "better"
    assert v(0.01, None, None, 1) is None and v(None, 0.1, 0.1, 3) is None and v(0.5, None, 0.0, 1) is None
    assert v(0.0011, 0.001, None, 20) == "within noise" and v(0.0021, 0.001, None, 20) == "worse"   # ~2 s.e.
    rows = lambda *gaps: {"base": dict(gap_per_seed=[]), **{f"r{i}": dict(gap_per_seed=[(0, g)])  # noqa: E731
                                                             for i, g in enumerate(gaps)}}
    assert noise_floor({"noise": rows(-0.0058, 0.003)}) == 0.0058
    assert noise_floor({"pqt": rows(0.1)}) is None and noise_floor({"noise": rows()}) is None


def test_quality_keeps_finished_runs_checks_train_flags_first_and_reports_without_training(corpus, tmp_path,
                                                                                          capsys):
    """Run folders already in --out_dir stop a command without --resume or --overwrite (finished
    runs can be hours of GPU time); a flag train.py refuses stops the command, with train.py's
    message, before any folder's argv.json changes (so --resume still takes the folders); --max_runs
    0 into a folder that does not exist reports without training, and refuses a folder holding none
    of the runs; a report (--max_runs 0) reads runs trained on a corpus at another path and says
    where they trained; an experiment whose own seeds are not in --seeds is left out with a note."""
    text, data_dir = corpus
    out = tmp_path / "q"
    flags = f"--batch_size 4 --eval_windows 8 --eval_interval 2 --tokenizer byte --data_dir {data_dir}"
    base = ["quality", "--suite", "gpt2", "--preset", "nano", "--dataset", text, "--experiments", "noise",
            "--iters", "2", "--out_dir", str(out)]
    experiments.main([*base, "--seeds", "0", "--train_args", flags])
    argv_json = {d: (out / d / "argv.json").read_text() for d in ("bf16_adamw_s0", "bf16_adamw_rerun_s0")}
    for extra, said in (([], "already holds 2 of these runs (bf16_adamw_s0, bf16_adamw_rerun_s0): add --resume"),
                        (["--overwrite", "--train_args", flags + " --batchsize 8"],
                         "the runs' train.py flags: unrecognized arguments: --batchsize 8")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            experiments.main([*base, "--seeds", "0", *extra] + (["--train_args", flags] if not extra else []))
        assert e.value.code == 2 and said in capsys.readouterr().err, extra
    assert {d: (out / d / "argv.json").read_text() for d in argv_json} == argv_json
    capsys.readouterr()
    experiments.main([*base, "--seeds", "0", "--resume", "--train_args", flags])
    assert "done:" not in capsys.readouterr().out          # read back, not trained again
    # a report elsewhere (--max_runs 0): the corpus path is not compared, nor read, and is named
    report = [*base[:6], "/elsewhere/corpus", *base[7:-1], str(tmp_path / "moved"), "--seeds", "0", "--resume",
              "--max_runs", "0", "--train_args", flags]
    shutil.copytree(out, tmp_path / "moved")
    experiments.main(report)
    assert f"the saved runs were trained on --dataset {text} (--dataset /elsewhere/corpus is not read" in \
        capsys.readouterr().out
    made = json.load(open(tmp_path / "moved" / "quality.json"))   # where the runs trained, from their logs
    assert made["trained_on"] == {f"cpu, torch {torch.__version__}, triton {triton.__version__}": 2}
    assert (made["gpu"], made["torch"]) == ("cpu", torch.__version__)
    os.makedirs(tmp_path / "empty")                         # a report of a folder holding none: refused, unwritten
    with pytest.raises(SystemExit) as e:
        experiments.main([*report[:-8], str(tmp_path / "empty"), *report[-7:]])
    assert e.value.code == 2 and f"--max_runs 0 reports the runs --out_dir holds, and {tmp_path / 'empty'} holds " \
        "none of these (e.g. bf16_adamw_s0): extract the runs' archive there" in capsys.readouterr().err
    assert os.listdir(tmp_path / "empty") == []
    new = tmp_path / "new" / "q"
    experiments.main([*base[:-1], str(new), "--seeds", "1", "--max_runs", "0", "--train_args", flags])
    said = capsys.readouterr().out
    assert "[noise] left out: its runs are for seed(s) 0, not in --seeds" in said
    assert json.load(open(new / "quality.json"))["experiments"] == {}


def test_quality_in_process_run_stopped_by_a_signal_names_the_harness_resume(monkeypatch, capsys):
    """--jobs 1: a run that train.py stops at a checkpoint on Ctrl-C / SIGTERM (exit 130 / 143)
    ends the harness too, whose last line says to continue the whole comparison with --resume; a
    flag error's exit passes through without it."""
    from experiments import runs as quality_runs
    for code, said in ((143, True), (130, True), (2, False)):
        monkeypatch.setattr(train, "main", lambda argv, code=code: sys.exit(code))
        with pytest.raises(SystemExit) as e:
            quality_runs.train_inprocess(["--seed", "0"], "q/bf16_adamw_s0")
        assert e.value.code == code
        assert ("continue the whole comparison with the same command and --resume" in capsys.readouterr().out) == said


def test_quality_runner_concurrent_end_to_end(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    exps = {"pqt": [("bf16", "adamw"), ("gaussws", "adamw")],
            "zeropoint": [("bf16", "zipsr", (), "update-sr"),
                          ("bf16", "zipsr", ("--v_rounding", "state-rtn"), "state-rtn"),
                          ("bf16", "adamw", ("--lr", "1e30", "--warmup_frac", "0"), "diverges")]}
    args = nano_args(corpus, "--max_iters", "6", "--eval_interval", "3")
    out = experiments.bench_quality(args, seeds=(0,), out_dir=str(tmp_path), experiments=exps, jobs=2)
    assert out["failed_runs"] == {}
    dirs = {d for d in os.listdir(tmp_path) if os.path.isdir(tmp_path / d)}
    assert dirs == {"bf16_adamw_s0", "gaussws_adamw_s0", "bf16_zipsr_s0", "bf16_zipsr_v_rounding-state-rtn_s0",
                    "bf16_adamw_lr-1e30_warmup_frac-0_s0"}
    assert all(os.path.exists(tmp_path / d / "train.out") for d in dirs)   # ran as subprocesses
    res = out["experiments"]
    for exp, label in [("pqt", "bf16/adamw"), ("pqt", "gaussws/adamw"), ("zeropoint", "update-sr"),
                       ("zeropoint", "state-rtn")]:
        r = res[exp][label]
        assert math.isfinite(r["final_val_loss"][0]) and r["mean"] == r["final_val_loss"][0]
        assert math.isfinite(r["final_train_loss"][0]) and r["diverged_at"] == [None]
    dv = res["zeropoint"]["diverges"]                               # recorded, not raised
    assert isinstance(dv["diverged_at"][0], int) and dv["mean"] is None and dv["gap_to_first"] is None
    assert dv["final_val_loss"] == [None] and dv["final_train_loss"] == [None]
    assert res["zeropoint"]["state-rtn"]["flags"] == ["--v_rounding", "state-rtn"]

    # experiment 5: the reloaded plain-weight model reproduces train.py's own final val loss
    cast = out["cast"]
    assert set(cast) == {"bf16/adamw s0", "gaussws/adamw s0"}
    for label, exp_label in [("bf16/adamw s0", "bf16/adamw"), ("gaussws/adamw s0", "gaussws/adamw")]:
        c = cast[label]
        assert c["val_loss_before"] == res["pqt"][exp_label]["final_val_loss"][0]
        assert math.isfinite(c["val_loss_after"]) and sum(c["tier_share"].values()) == pytest.approx(1.0)
    ctrl = cast["bf16/adamw s0"]                                    # control: every tile at b_target 4 -> FP8
    assert ctrl["tiers"] == "fixed b_target 4" and ctrl["tier_share"]["FP8 e3m4"] == 1.0
    assert ctrl["val_loss_after"] != ctrl["val_loss_before"]         # the evaluated model was cast
    # the sweep casts the same layers to each format from the trained weights (restored after it):
    # its e3m4 row is the control's all-FP8 tier cast, the coarsest format costs the most
    for c in cast.values():
        assert list(c["sweep_delta"]) == [f"e{e}m{m}" for e, m in CAST_SWEEP]
    assert ctrl["sweep_delta"]["e3m4"] == ctrl["delta"]
    assert ctrl["sweep_delta"]["e3m1"] > abs(ctrl["sweep_delta"]["e3m4"])
    bits = out["bitwidth"]["gaussws/adamw s0"]
    share = cast["gaussws/adamw s0"]["tier_share"]
    assert share["FP8 e3m4"] == pytest.approx(bits["share_le5"])
    assert share["FP8 e3m4"] + share["FP12 e4m7"] == pytest.approx(bits["share_le9"])
    # Figure 5 data = what train.py logged for the same weights at its last eval
    logged = [r for r in read_run_log(tmp_path / "gaussws_adamw_s0" / "log.jsonl") if r["type"] == "eval"][-1]["bits"]
    assert list(bits["layers"]) == [k for k in logged if k != "all"] and len(bits["layers"]) == 8
    for k, v in bits["layers"].items():
        assert v["mean"] == pytest.approx(logged[k]["mean"], abs=1e-12) and v["min"] <= v["mean"] <= v["max"]

    # a cast model's tiles are on their formats' grids: casting again is lossless
    model, cfg, val = load_run(str(tmp_path / "gaussws_adamw_s0"))
    assert val() == cast["gaussws/adamw s0"]["val_loss_before"]
    cast_to_tiers(g.pqt_layers(model))
    once = val()
    assert once == cast["gaussws/adamw s0"]["val_loss_after"]
    cast_to_tiers(g.pqt_layers(model))
    assert val() == once

    # the JSON rows keep each seed's curves (so plots can be redrawn from results/ alone)
    logged = [json.loads(x) for x in open(tmp_path / "gaussws_adamw_s0" / "log.jsonl")]
    curve = res["pqt"]["gaussws/adamw"]["curves"][0]
    assert curve["seed"] == 0 and curve["val"] == [(x["iter"], x["val_loss"]) for x in logged if x["type"] == "eval"]
    assert curve["train"][0] == (0, [x["loss"] for x in logged if x["type"] == "step"][0])

    pytest.importorskip("matplotlib")
    for png in ("pqt.png", "zeropoint.png", "bitwidth.png", "cast.png"):
        assert os.path.getsize(tmp_path / png) > 0
    path = str(tmp_path / "GPU_2026-01-01_quality.json")
    with open(path, "w") as f:
        json.dump(dict(out, gpu="GPU", date="2026-01-01"), f)
    pngs = plot_results([path])
    assert sorted(os.path.basename(p) for p in pngs) == sorted(
        ["GPU_2026-01-01_quality.png", "GPU_2026-01-01_quality_bitwidth.png",
         "GPU_2026-01-01_quality_cast.png"]
        + [f"GPU_2026-01-01_quality_{e}.png" for e in res])
    assert all(open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_quality_main_on_cpu(corpus, tmp_path, monkeypatch, capsys):
    # python -m experiments quality runs on CPU; the JSON keeps the full command; --iters -> --max_iters
    text, data_dir = corpus
    monkeypatch.chdir(tmp_path)
    argv = ["quality", "--preset", "nano", "--dataset", text, "--experiments", "pqt", "--seeds", "3",
            "--iters", "2", "--train_args", f"--batch_size 4 --eval_windows 8 --tokenizer byte --data_dir {data_dir}"]
    experiments.main(argv)
    [path] = [os.path.join("results", f) for f in os.listdir("results") if f.endswith("_quality.json")]
    res = json.load(open(path))
    assert path.startswith(os.path.join("results", "cpu_"))
    assert res["command"].startswith("python -m experiments quality --preset nano") and "--iters 2" in res["command"]
    assert set(res["experiments"]) == {"pqt"} and res["seeds"] == [3]
    assert set(res["experiments"]["pqt"]) == {"bf16/adamw", "gaussws/adamw", "diffq/adamw", "gaussws/adamw bits_wd 0.5"}
    assert read_run_log(os.path.join("results", "quality_cpu_nano", "bf16_adamw_s3", "log.jsonl"))[-1]["iters"] == 2
    # --resume: finished runs are read back, not trained again (their logs stay as they are)
    log = os.path.join("results", "quality_cpu_nano", "gaussws_adamw_s3", "log.jsonl")
    before = open(log).read()
    capsys.readouterr()
    experiments.main([*argv, "--resume"])
    said = capsys.readouterr().out
    assert "[pqt] bf16/adamw" in said and "done:" not in said   # read from the 4 pqt runs' logs, none trained
    assert open(log).read() == before
    assert json.load(open(path))["experiments"] == res["experiments"]
    # an explicit --out_dir keeps the JSON there (results/ is left alone)
    kept = open(path).read()
    experiments.main([*argv, "--out_dir", "elsewhere"])
    assert json.load(open(os.path.join("elsewhere", "quality.json")))["seeds"] == [3]
    assert open(path).read() == kept
    for bad, said in ((["--experiments", "pqt,nope"], "--experiments"), (["--seeds", "0,x"], "--seeds"),
                      (["--seeds", "1,1"], "distinct"), (["--seeds", "-1"], ">= 0"), (["--jobs", "0"], "--jobs 0"),
                      (["--iters", "0"], "--iters 0"), (["--out_dir", " "], "--out_dir ' ': empty"),
                      (["--train_args", "--seed 4"], "use --seeds instead"),
                      (["--train_args=--max_iters=9"], "use --iters instead"),
                      (["--train_args", "--max_it 3"], "--max_it"),         # no abbreviation of --max_iters
                      (["--train_args", '--tokenizer "byte'], "--train_args")):   # unbalanced quote
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            experiments.main([*argv, *bad])
        assert e.value.code == 2 and said in capsys.readouterr().err, bad


def test_quality_bench_sigterm_ends_its_runs(corpus, tmp_path):
    """A time limit's SIGTERM to `python -m experiments quality --jobs 2` also ends its train.py runs."""
    import signal
    import time
    text, data_dir = corpus
    out = str(tmp_path / "q")
    cmd = [sys.executable, "-m", "experiments", "quality", "--preset", "nano", "--dataset", text,
           "--experiments", "pqt", "--seeds", "0", "--iters", "100000", "--jobs", "2", "--out_dir", out,
           "--train_args", f"--batch_size 4 --eval_windows 8 --tokenizer byte --data_dir {data_dir}"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    started = 0
    for line in p.stdout:
        started += "[quality] started" in line
        if started == 2:
            break
    time.sleep(2)

    def runs_alive():
        alive = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if out.encode() in f.read() and int(pid) != p.pid:
                        alive.append(pid)
            except OSError:
                pass
        return alive
    assert runs_alive()                       # the two train.py runs are going
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) != 0
    deadline = time.time() + 30
    while runs_alive() and time.time() < deadline:
        time.sleep(0.5)
    assert not runs_alive()


def test_plot_results_draws_every_h200_section(tmp_path, capsys):
    """python -m experiments plots: one PNG per committed GPU result JSON (optim, memory, noise, ddp)."""
    pytest.importorskip("matplotlib")
    import glob
    import shutil
    src = [p for p in glob.glob(os.path.join(ROOT, "results", "NVIDIA-H200_*.json"))
           if p.rsplit("_", 1)[-1] in ("optim.json", "memory.json", "noise.json", "ddp.json")]
    assert len(src) >= 4
    for p in src:
        shutil.copy(p, tmp_path)
    pngs = plot_results(sorted(str(tmp_path / os.path.basename(p)) for p in src))
    assert len(pngs) == len(src) and all(open(p, "rb").read(4) == b"\x89PNG" for p in pngs)
    # a name without a known section is skipped with a message, not silently
    shutil.copy(src[0], tmp_path / "mystery.json")
    assert plot_results([str(tmp_path / "mystery.json")]) == []
    assert "no plot for" in capsys.readouterr().out


def test_experiments_main_checks_quality_flags_and_plots(tmp_path, capsys):
    """python -m experiments quality names its own flags in errors; plots skips a file without a
    known section; bench.py (speed only) sends --only quality and --only plots to the harness."""
    for bad, said in ((["--seeds", "1,1"], "distinct"), (["--train_args", "--seed 4"], "use --seeds instead"),
                      (["--suite", "gpt2", "--experiments", "pqt,bits"], "unknown bits in --suite gpt2"),
                      (["--max_runs", "-1"], "--max_runs -1"),
                      (["--iters", "2", "--tokens_per_param", "1"], "give one run length"),
                      (["--resume", "--overwrite"], "not both")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            experiments.main(["quality", "--preset", "nano", *bad])
        assert e.value.code == 2 and said in capsys.readouterr().err, bad
    for section in ("quality", "plots"):
        with pytest.raises(SystemExit) as e:
            bench.main(["--only", section])
        assert e.value.code == 2 and f"run python -m experiments {section}" in capsys.readouterr().err
    pytest.importorskip("matplotlib")
    (tmp_path / "mystery.json").write_text("{}")
    experiments.main(["plots", str(tmp_path / "mystery.json")])
    assert "no plot for" in capsys.readouterr().out


def test_tools_parses_each_subcommand_and_finds_what_it_calls(capsys):
    """python -m experiments.tools: each subcommand's flags parse, bad values are one-line errors, the GPU ones say so
    on CPU, and the gaussws and bench_training functions they call exist (a rename shows here)."""
    ap = tools.build_parser()
    assert ap.parse_args(["kernels", "--short", "--shapes", "4096x4096,768x2048"]).shapes == [(4096, 4096), (768, 2048)]
    assert ap.parse_args(["kernels"]).shapes is None and ap.parse_args(["launches"]).command == "launches"
    assert ap.parse_args(["profile", "llama-1b"]).presets == ["llama-1b"]
    for bad, said in ((["kernels", "--shapes", "4096"], "MxN"), (["profile", "llama-9b"], "not a Table 1 preset"),
                      (["nosuch"], "invalid choice")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            tools.main(bad)
        assert e.value.code == 2 and said in capsys.readouterr().err, bad
    assert all(callable(getattr(g, n)) for n in tools.GAUSSWS_NAMES)
    assert all(callable(getattr(bench_training, n)) for n in ("train_setup", "queued_steps_ms", "device_ops"))
    if not torch.cuda.is_available():
        for cmd in ("kernels", "profile"):
            with pytest.raises(SystemExit, match=f"python -m experiments.tools {cmd} needs a CUDA GPU"):
                tools.main([cmd])
