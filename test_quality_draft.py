"""Draft tests for bench.py's quality section (zero-point runs, Table C casting, Figure 5 data,
concurrent runs) and train.py's --v_codebook / --v_rounding. The lead merges them into test_all.py.
CPU only, nano preset, a few steps; no timing is asserted."""
import argparse
import itertools
import json
import math
import os
import sys

import pytest
import torch

import bench
import gaussws as g
import train as trainer


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A ~100 kB real-text file (argparse's source) and a data folder for prepared datasets."""
    d = tmp_path_factory.mktemp("corpus")
    path = d / "corpus.txt"
    path.write_text(open(argparse.__file__, encoding="utf-8").read(), encoding="utf-8")
    return str(path), str(d / "data")


def nano_args(corpus, *extra):
    text, data_dir = corpus
    return ["--preset", "nano", "--dataset", text, "--data_dir", data_dir, "--tokenizer", "byte",
            "--batch_size", "4", "--eval_windows", "8", *extra]


# ---------------------------------------------------------------------------------------------
# cast_fp: hand-checkable values, independent references, brute force

def test_cast_fp_fp4_e2m1_grid_ties_and_saturation():
    # OCP FP4 E2M1 (no inf/NaN codes): 0, 0.5, 1, 1.5, 2, 3, 4, 6
    x = torch.tensor([0.5, 1.5, 3.0, 6.0, 0.1, 0.3, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 1e9,
                      float("inf"), -float("inf"), -2.9, -0.26, 0.0])
    want = [0.5, 1.5, 3.0, 6.0, 0.0, 0.5, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0,
            6.0, -6.0, -3.0, -0.5, 0.0]
    # ties: 0.25 -> 0 (code 0 even, not the subnormal 0.5), 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
    # 2.5 -> 2, 3.5 -> 4, 5 -> 4: the neighbour whose mantissa bit is 0
    assert bench.cast_fp(x, 2, 1, inf_nan=False).tolist() == want
    assert math.isnan(bench.cast_fp(torch.tensor([float("nan")]), 2, 1, inf_nan=False).item())


def test_cast_fp_e3m4_subnormals_and_saturation():
    # IEEE-style e3m4 (Table C's FP8 tier): bias 3, emin -2, emax 3 (exponent 7 = inf/NaN),
    # subnormal step 2^(-2-4) = 1/64, largest finite (2 - 1/16) * 8 = 15.5
    s = 1 / 64
    x = torch.tensor([s, s / 2, 3 * s / 2, 5 * s / 2, 0.4 * s, 0.25, 0.25 + s / 2, 15.5, 15.7, 100.0, -1e30])
    want = [s, 0.0, 2 * s, 2 * s, 0.0, 0.25, 0.25, 15.5, 15.5, 15.5, -15.5]
    # 0.25 + s/2: 0.25 is in binade [2^-2, 2^-1) with step 2^-6 = s, so s/2 is a tie -> 0.25 (even)
    assert bench.cast_fp(x, 3, 4).tolist() == want


def test_cast_fp_matches_torch_float16_and_float8():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50_000, generator=gen) * torch.exp2(torch.randint(-30, 20, (50_000,), generator=gen).float())
    h = x.clamp(-65504, 65504)                       # IEEE half = e5m10 with inf/NaN codes
    assert torch.equal(bench.cast_fp(h, 5, 10), h.half().float())
    y = x.clamp(-57344, 57344)                       # float8_e5m2: IEEE-style
    assert torch.equal(bench.cast_fp(y, 5, 2), y.to(torch.float8_e5m2).float())
    z = x.clamp(-440, 440)                           # float8_e4m3fn: all exponents finite (below 448)
    assert torch.equal(bench.cast_fp(z, 4, 3, inf_nan=False), z.to(torch.float8_e4m3fn).float())


def _grid(e, m, inf_nan):
    """All nonnegative values of the format, by code, in increasing order (code parity = mantissa LSB)."""
    bias = 2 ** (e - 1) - 1
    vals = []
    for E, M in itertools.product(range(2 ** e - (1 if inf_nan else 0)), range(2 ** m)):
        vals.append(M * 2.0 ** (1 - bias - m) if E == 0 else (1 + M / 2 ** m) * 2.0 ** (E - bias))
    return torch.tensor(vals, dtype=torch.float64)


@pytest.mark.parametrize("e,m,inf_nan", [(3, 4, True), (4, 7, True), (2, 1, False), (4, 3, True), (3, 2, False)])
def test_cast_fp_is_the_nearest_grid_point_ties_to_even(e, m, inf_nan):
    grid = _grid(e, m, inf_nan)
    assert torch.all(grid[1:] > grid[:-1])
    gen = torch.Generator().manual_seed(e * 100 + m)
    x = (torch.rand(4000, generator=gen, dtype=torch.float64) * 2 - 1) * grid[-1] * 1.2
    x = torch.cat([x, x / 64, x / 2 ** 12])
    q = bench.cast_fp(x, e, m, inf_nan)
    dist = (x.abs()[:, None] - grid[None, :]).abs()
    assert torch.equal(q.abs(), grid[dist.argmin(1)])            # nearest (saturating beyond the top)
    assert torch.equal(torch.sign(q), torch.sign(x) * (q != 0))
    mid = (grid[1:] + grid[:-1]) / 2                              # exact ties: the even code wins
    even = torch.where(torch.arange(len(mid)) % 2 == 0, grid[:-1], grid[1:])
    assert torch.equal(bench.cast_fp(mid, e, m, inf_nan), even)
    assert torch.equal(bench.cast_fp(-mid, e, m, inf_nan), -even)
    assert torch.equal(bench.cast_fp(grid, e, m, inf_nan), grid)  # grid points are fixed points


def test_cast_fp_rejects_bad_formats():
    with pytest.raises(ValueError, match=r"cast_fp: exp_bits=0 must be an int in \[1, 8\]"):
        bench.cast_fp(torch.ones(2), 0, 3)
    with pytest.raises(ValueError, match=r"man_bits=2.5"):
        bench.cast_fp(torch.ones(2), 3, 2.5)
    with pytest.raises(ValueError, match="inf_nan=False"):
        bench.cast_fp(torch.ones(2), 1, 2)


# ---------------------------------------------------------------------------------------------
# tiles and Table C tiers

def test_cast_tiles_scales_each_tile_by_its_absmax():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(70, 45, generator=gen) * torch.exp2(torch.randint(-8, 8, (70, 45), generator=gen).float())
    w[32:64, 32:45] = 0.0                                          # an all-zero (partial) tile
    q = bench.cast_tiles(w, 3, 4)
    assert torch.equal(bench.cast_tiles(q, 3, 4), q)               # idempotent: the tile scales stay
    assert torch.equal(q[32:64, 32:45], w[32:64, 32:45])
    for r, c in [(0, 0), (0, 1), (1, 0), (2, 1)]:                  # each tile on its own (edge tiles partial)
        t = w[32 * r:32 * r + 32, 32 * c:32 * c + 32]
        k = math.floor(math.log2(t.abs().max().item())) - 3      # absmax into e3m4's top binade [8, 16)
        assert torch.equal(q[32 * r:32 * r + 32, 32 * c:32 * c + 32], bench.cast_fp(t / 2.0 ** k, 3, 4) * 2.0 ** k)
    w2 = w.clone()
    w2[0, 0] = 1e6                                                  # another tile's scale is untouched
    assert torch.equal(bench.cast_tiles(w2, 3, 4)[32:], q[32:]) and torch.equal(bench.cast_tiles(w2, 3, 4)[:, 32:], q[:, 32:])


def test_cast_to_tiers_uses_each_tiles_clamped_b_t():
    layer = g.GaussWSLinear(64, 64, bias=False, b_init=6.0, b_target=4.0)
    model = torch.nn.Sequential(layer).eval()
    w0 = layer.weight.detach().clone()
    # b_t = 4 + 2 b_i: tiles at 4 (FP8), 7 (FP12), 11 (FP16) and 30 (clamped to 24: kept)
    with torch.no_grad():
        layer.b_i.copy_(torch.tensor([[0.0, 1.5], [3.5, 13.0]]))
    share = bench.cast_to_tiers(model)
    assert share == {"FP8 e3m4": 0.25, "FP12 e4m7": 0.25, "FP16 e5m10": 0.25, ">FP16": 0.25}
    stats = g.bitwidth_stats(model)["all"]
    assert share["FP8 e3m4"] == stats["share_le5"]
    assert share["FP8 e3m4"] + share["FP12 e4m7"] == stats["share_le9"]
    w = layer.weight.detach()
    for (r, c), (e, m) in {(0, 0): (3, 4), (0, 1): (4, 7), (1, 0): (5, 10)}.items():
        sl = (slice(32 * r, 32 * r + 32), slice(32 * c, 32 * c + 32))
        assert torch.equal(w[sl], bench.cast_tiles(w0[sl], e, m)) and not torch.equal(w[sl], w0[sl])
    assert torch.equal(w[32:, 32:], w0[32:, 32:])


# ---------------------------------------------------------------------------------------------
# train.py --v_codebook / --v_rounding

def _optimizer(argv):
    p = trainer.build_parser()
    a = trainer.resolve_args(p.parse_args(argv), p, False)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(64, 128))
    model.lm_head = torch.nn.Linear(128, 4096, bias=False)
    return trainer.build_optimizer(a, model, "cpu")


def test_v_flags_reach_adamw4bit():
    q = _optimizer(["--optim", "zipsr", "--v_rounding", "state-sr"]).qcfg
    assert (q["v_codebook"], q["v_rounding"], q["m_codebook"]) == ("dyn4", "state-sr", "nf4")
    q = _optimizer(["--optim", "torchao", "--v_codebook", "dyn4", "--v_rounding", "update-rtn"]).qcfg
    assert (q["v_codebook"], q["v_rounding"], q["m_codebook"]) == ("dyn4", "update-rtn", "sdyn4")
    assert _optimizer(["--optim", "zeeden"]).qcfg["v_codebook"] == "dyn4_nz"     # none given: the preset's


@pytest.mark.parametrize("argv,msg", [
    (["--optim", "zipsr", "--v_rounding", "bogus"], "argument --v_rounding: invalid choice: 'bogus'"),
    (["--optim", "zipsr", "--v_codebook", "dyn5"], "argument --v_codebook: invalid choice: 'dyn5'"),
    (["--optim", "adamw", "--v_rounding", "state-rtn"], "--v_rounding state-rtn: only for the 4-bit AdamW presets"),
    (["--optim", "adam-mini", "--v_codebook", "dyn4"], "not --optim adam-mini"),
    (["--optim", "zipsr", "--v_codebook", "nf4"], "--v_codebook nf4 with --optim zipsr: v_rounding='update-sr' "
                                                   "needs a nonnegative v_codebook"),
    (["--optim", "fp32", "--v_rounding", "state-rtn"], "m_codebook must be set"),
])
def test_bad_v_flags_give_one_line_errors(argv, msg, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        trainer.main(["--preset", "nano", "--out_dir", str(tmp_path / "never"), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1
    assert not os.path.exists(tmp_path / "never")               # refused before data and model


def test_v_flags_are_in_the_run_config_for_resume(corpus, tmp_path):
    a = nano_args(corpus, "--optim", "zipsr", "--v_rounding", "state-rtn", "--max_iters", "2", "--no-plot",
                  "--out_dir", str(tmp_path))
    trainer.main(a)
    cfg = torch.load(tmp_path / "ckpt.pt", weights_only=True)["config"]
    assert (cfg["v_rounding"], cfg["v_codebook"]) == ("state-rtn", None)
    with pytest.raises(trainer.RunError, match=r"--v_rounding 'state-rtn' \(checkpoint\) vs 'state-sr' \(now\)"):
        trainer.main([x if x != "state-rtn" else "state-sr" for x in a] + ["--resume"])


# ---------------------------------------------------------------------------------------------
# the quality runner end to end: 2 experiments, 2 concurrent subprocesses

def test_quality_runner_concurrent_end_to_end(corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    exps = {"pqt": [("bf16", "adamw"), ("gaussws", "adamw")],
            "zeropoint": [("bf16", "zipsr", (), "update-sr"),
                          ("bf16", "zipsr", ("--v_rounding", "state-rtn"), "state-rtn"),
                          ("bf16", "adamw", ("--lr", "1e30", "--warmup_frac", "0"), "diverges")]}
    args = nano_args(corpus, "--max_iters", "6", "--eval_interval", "3")
    out = bench.bench_quality(args, seeds=(0,), out_dir=str(tmp_path), experiments=exps, jobs=2)
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
    bits = out["bitwidth"]["gaussws/adamw s0"]
    share = cast["gaussws/adamw s0"]["tier_share"]
    assert share["FP8 e3m4"] == pytest.approx(bits["share_le5"])
    assert share["FP8 e3m4"] + share["FP12 e4m7"] == pytest.approx(bits["share_le9"])
    # Figure 5 data = what train.py logged for the same weights at its last eval
    logged = [r for r in trainer.read_log(tmp_path / "gaussws_adamw_s0" / "log.jsonl") if r["type"] == "eval"][-1]["bits"]
    assert list(bits["layers"]) == [k for k in logged if k != "all"] and len(bits["layers"]) == 8
    for k, v in bits["layers"].items():
        assert v["mean"] == pytest.approx(logged[k]["mean"], abs=1e-12) and v["min"] <= v["mean"] <= v["max"]

    # a cast model's tiles are on their formats' grids: casting again is lossless
    model, cfg, val = bench.load_run(str(tmp_path / "gaussws_adamw_s0"))
    assert val() == cast["gaussws/adamw s0"]["val_loss_before"]
    bench.cast_to_tiers(model)
    once = val()
    assert once == cast["gaussws/adamw s0"]["val_loss_after"]
    bench.cast_to_tiers(model)
    assert val() == once

    pytest.importorskip("matplotlib")
    for png in ("pqt.png", "zeropoint.png", "bitwidth.png"):
        assert os.path.getsize(tmp_path / png) > 0


def test_bench_main_quality_on_cpu(corpus, tmp_path, monkeypatch, capsys):
    # --only quality runs on CPU; the JSON keeps the full command; --iters -> --max_iters
    text, data_dir = corpus
    monkeypatch.chdir(tmp_path)
    argv = ["--only", "quality", "--preset", "nano", "--dataset", text, "--experiments", "pqt", "--seeds", "3",
            "--iters", "2", "--train_args", f"--batch_size 4 --eval_windows 8 --tokenizer byte --data_dir {data_dir}"]
    monkeypatch.setattr(sys, "argv", ["bench.py", *argv])
    bench.main()
    [path] = [os.path.join("results", f) for f in os.listdir("results") if f.endswith("_quality.json")]
    res = json.load(open(path))
    assert path.startswith(os.path.join("results", "cpu_"))
    assert res["command"].startswith("python bench.py --only quality --preset nano") and "--iters 2" in res["command"]
    assert set(res["experiments"]) == {"pqt"} and res["seeds"] == [3]
    assert set(res["experiments"]["pqt"]) == {"bf16/adamw", "gaussws/adamw", "diffq/adamw"}
    assert trainer.read_log(os.path.join("results", "quality_cpu_nano", "bf16_adamw_s3", "log.jsonl"))[-1]["iters"] == 2
    # --resume: finished runs are read back, not trained again (their logs stay as they are)
    log = os.path.join("results", "quality_cpu_nano", "gaussws_adamw_s3", "log.jsonl")
    before = open(log).read()
    monkeypatch.setattr(sys, "argv", ["bench.py", *argv, "--resume"])
    capsys.readouterr()
    bench.main()
    assert capsys.readouterr().out.count("the run is finished; nothing to do") == 3
    assert open(log).read() == before
    assert json.load(open(path))["experiments"] == res["experiments"]
    for bad in (["--experiments", "pqt,nope"], ["--seeds", "0,x"], ["--jobs", "0"]):
        monkeypatch.setattr(sys, "argv", ["bench.py", *argv, *bad])
        with pytest.raises(SystemExit) as e:
            bench.main()
        assert e.value.code == 2
    if not torch.cuda.is_available():
        monkeypatch.setattr(sys, "argv", ["bench.py", "--only", "noise"])
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bench.main()
