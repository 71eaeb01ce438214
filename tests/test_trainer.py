"""
train.py and trainer/, in-process on the nano presets and real text (argparse's source): the
schedule, the flags, runs of every method and optimizer, checkpoints and resume (checkpoints written
by the previous code included), the run log, runs that meet, signals, DDP and --fsdp on gloo
processes, the checkpoint folders of --fsdp.
"""
import argparse
import json
import math
import multiprocessing
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn as nn

import adam4bit as A
import data as datamod
import train
import trainer.dist
from benchmarks import training as bench_training
from model import GPT, preset_config
from trainer.checkpoint import CKPT_FORMAT, RESUME_DEFAULTS, check_out_dir, check_resume_config, dcp_state, load_checkpoint, resume_path, save_checkpoint
from trainer.dist import Process, set_grad_accum, setup_distributed, shard_model
from trainer.flags import DEFAULT_LR, build_parser, resolve_args
from trainer.log import Interrupts, read_log as read_run_log
from trainer.memory import check_activations_fit
from trainer.optim import get_lr, quantized_summary
from trainer.util import RunError

from tests.helpers import ROOT, assert_one_line_flag_error, base_args, hold_lock_then, launch_ranks, nano_args, read_log


# ---------------------------------------------------------------------------------------------
# the schedule and the flags

def test_wsd_schedule_endpoints():
    lr, T = 1.0, 100  # 10 warmup steps, 80 constant, 10 cooldown steps
    f = lambda it: get_lr(it, T, lr, "wsd")  # noqa: E731
    assert f(0) == pytest.approx(0.1) and f(4) == pytest.approx(0.5) and f(9) == pytest.approx(1.0)
    assert all(f(it) == 1.0 for it in range(10, 91))      # constant, including the first cooldown step
    assert f(95) == pytest.approx(1 - math.sqrt(0.5))      # 1 - sqrt(u), u = 5/10
    assert f(99) == pytest.approx(1 - math.sqrt(0.9))
    assert f(100) == 0.0
    assert all(f(it) > f(it + 1) for it in range(90, 100))


def test_cosine_and_constant_schedules():
    T = 100
    assert get_lr(10, T, 1.0, "cosine") == pytest.approx(1.0)
    assert get_lr(55, T, 1.0, "cosine") == pytest.approx(0.1 + 0.9 * 0.5)   # halfway: mean of peak and floor
    assert get_lr(100, T, 1.0, "cosine") == pytest.approx(0.1)
    assert get_lr(5, T, 1.0, "constant") == pytest.approx(0.6)
    assert get_lr(99, T, 1.0, "constant") == 1.0


def test_wsd_schedule_recomputed_for_a_longer_run():
    # the continuity facts the --max_iters help and the module docstring state (T = 100 -> N)
    f = lambda it, n: get_lr(it, n, 1.0, "wsd")  # noqa: E731
    assert all(f(it, 100) == f(it, 200) == 1.0 for it in range(20, 90))   # stopped on both plateaus: no jump
    assert f(99, 100) == pytest.approx(1 - math.sqrt(1 - 1 / 10)) and f(100, 100) == 0.0   # finished, cooled down
    assert f(100, 200) == 1.0 and all(f(it, 200) == 1.0 for it in range(100, 181))      # back to the plateau
    assert all(f(it, 200) > f(it + 1, 200) for it in range(180, 200)) and f(200, 200) == 0.0   # new cooldown
    assert f(100, 112) == 1.0 and f(100, 110) < 1.0      # T on the new plateau iff T < N - round(0.1 N)
    assert f(100, 105) == pytest.approx(1 - math.sqrt(0.5))    # else the new cooldown's lr (D = 10, u = 5/10)
    assert f(100, 1004) == 1.0                                 # ... and the new warmup round(0.1 N) <= T
    assert f(100, 2000) == pytest.approx(101 / 200)            # else the new warmup's lr


@pytest.mark.parametrize("flags, words", [
    (["--method", "int4"], ["--method", "bf16", "gaussws", "diffq"]),
    (["--optim", "sgd"], ["--optim", "adamw", "zipsr", "zeeden"]),
    (["--schedule", "linear"], ["--schedule", "wsd", "cosine"]),
    (["--parts", "qkv,gate"], ["--parts", "gate", "qkv,out,up,down"]),
    (["--preset", "nano-llama", "--parts", "qkv"], ["--parts", "q,k,v,out,gate,up,down"]),
    (["--b_init", "4", "--b_target", "6"], ["--b_target", "b_init"]),
    (["--dataset", "/no/such/corpus.txt"], ["--dataset", "stdlib"]),
    (["--preset", "gpt5"], ["--preset", "gpt2-124m", "llama-134m"]),
    (["--batch_size", "0"], ["--batch_size"]),
    (["--device", "tpu"], ["--device", "cpu"]),
    (["--no-compile", "--compile_mode", "reduce-overhead"], ["--compile_mode reduce-overhead", "add --compile"]),
])
def test_bad_flags_one_line_error(flags, words, capsys):
    assert_one_line_flag_error(flags, words, capsys)


@pytest.mark.parametrize("flags, words", [
    (["--lr", "nan"], ["--lr nan", "> 0"]),
    (["--lr", "inf"], ["--lr inf"]),
    (["--lr", "0"], ["--lr 0"]),
    (["--beta1", "1.5"], ["--beta1 1.5", "[0, 1)"]),
    (["--beta2", "1"], ["--beta2 1", "[0, 1)"]),
    (["--beta2", "-0.1"], ["--beta2"]),
    (["--eps", "-1"], ["--eps -1"]),
    (["--eps", "0"], ["--eps 0"]),
    (["--eps", "inf"], ["--eps inf"]),
    (["--weight_decay", "-1"], ["--weight_decay -1", ">= 0"]),
    (["--weight_decay", "nan"], ["--weight_decay nan"]),
    (["--b_init", "30"], ["--b_init 30", "[1, 24]"]),
    (["--b_target", "-1"], ["--b_target -1"]),
    (["--b_init", "nan"], ["--b_init nan"]),
    (["--bits_wd", "-5"], ["--bits_wd -5"]),
    (["--bits_lambda", "-1"], ["--bits_lambda -1"]),
    (["--grad_clip", "-1"], ["--grad_clip -1", ">= 0"]),
    (["--min_lr_frac", "5"], ["--min_lr_frac 5", "[0, 1]"]),
    (["--warmup_frac", "-0.1"], ["--warmup_frac"]),
    (["--cooldown_frac", "1.5"], ["--cooldown_frac 1.5"]),
    (["--warmup_frac", "0.6", "--cooldown_frac", "0.5"], ["--warmup_frac 0.6", "--cooldown_frac 0.5"]),
    (["--tokens_per_param", "-1"], ["--tokens_per_param -1"]),
    (["--tokens_per_param", "20", "--max_iters", "100"], ["--tokens_per_param", "--max_iters"]),
    (["--max_iters", "10", "--stop_after", "11"], ["--stop_after 11", "--max_iters 10"]),
    (["--stop_after", "0"], ["--stop_after 0"]),
    (["--max_tokens", "0"], ["--max_tokens 0"]),
    (["--max_tokens", "-3"], ["--max_tokens -3"]),
    (["--eval_windows", "-1"], ["--eval_windows -1"]),
    (["--seed", "-1"], ["--seed -1"]),
])
def test_bad_flags_fail_before_data_or_model(flags, words, capsys, monkeypatch, tmp_path):
    def boom(*a, **k):
        raise AssertionError("data prepared or model built before the flags were checked")
    monkeypatch.setattr(datamod, "prepare", boom)
    monkeypatch.setattr(train, "GPT", boom)
    with pytest.raises(SystemExit) as e:
        train.main(["--preset", "nano", "--out_dir", str(tmp_path / "o"), *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("train.py: error:")
    for w in words:
        assert w in err
    assert not (tmp_path / "o").exists()


def test_flags_the_run_does_not_read_are_named_in_one_line(capsys):
    p = build_parser()
    for flags, said in ((["--method", "bf16", "--b_init", "8", "--parts", "qkv"],
                         "note: not used by this run: --parts qkv (with --method bf16), --b_init 8 (with --method bf16)"),
                        (["--schedule", "cosine", "--cooldown_frac", "0.2"],
                         "note: not used by this run: --cooldown_frac 0.2 (with --schedule cosine)"),
                        (["--method", "gaussws", "--b_init", "8", "--min_lr_frac", "0.2"],
                         "note: not used by this run: --min_lr_frac 0.2 (with --schedule wsd)"),
                        (["--method", "bf16", "--schedule", "cosine", "--min_lr_frac", "0.2"], "")):
        resolve_args(p.parse_args(["--preset", "nano", *flags]), p, cuda=False)
        assert capsys.readouterr().out.strip() == said, flags


def test_edge_flag_values_are_accepted():
    p = build_parser()
    args = p.parse_args(["--preset", "nano", "--beta1", "0", "--grad_clip", "0", "--warmup_frac", "0",
                         "--cooldown_frac", "1", "--min_lr_frac", "1", "--b_init", "24", "--b_target", "1",
                         "--bits_wd", "0", "--weight_decay", "0", "--eval_windows", "0",
                         "--max_iters", "7", "--stop_after", "7"])
    resolve_args(args, p, cuda=False)
    assert (args.max_iters, args.stop_after, args.eval_windows) == (7, 7, 0)
    args = p.parse_args(["--preset", "nano", "--tokens_per_param", "0.5"])
    resolve_args(args, p, cuda=False)
    assert args.max_iters is None        # set from the parameter count once the model exists
    for schedule in ("cosine", "constant"):  # --cooldown_frac is WSD's: not summed with the warmup there
        resolve_args(p.parse_args(["--preset", "nano", "--schedule", schedule, "--warmup_frac", "0.95"]), p,
                           cuda=False)
    args = p.parse_args(["--preset", "nano"])
    resolve_args(args, p, cuda=False)
    assert args.max_iters == 300 and args.eval_windows is None   # CPU default; windows capped later


def test_parts_with_spaces_read_as_apply_pqt_reads_them(corpus, tmp_path):
    parser = build_parser()
    args = parser.parse_args(base_args(corpus, tmp_path, "--method", "gaussws", "--parts", "qkv, out"))
    resolve_args(args, parser, cuda=False)
    assert args.parts == "qkv,out"


def _optimizer(argv):
    p = build_parser()
    a = resolve_args(p.parse_args(argv), p, False)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(64, 128))
    model.lm_head = torch.nn.Linear(128, 4096, bias=False)
    return train.build_optimizer(a, model, "cpu")


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
    (["--optim", "fp32", "--v_rounding", "state-rtn"], "(--optim torchao|zipsr|zeeden), not --optim fp32"),
])
def test_bad_v_flags_give_one_line_errors(argv, msg, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        train.main(["--preset", "nano", "--out_dir", str(tmp_path / "never"), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1
    assert not os.path.exists(tmp_path / "never")               # refused before data and model


@pytest.mark.parametrize("flags, words", [
    (["--step_in_backward"], ["--grad_clip 1", "add --grad_clip 0"]),
    (["--step_in_backward", "--grad_clip", "0", "--grad_accum", "2"], ["--grad_accum 2", "--grad_accum 1"]),
    (["--step_in_backward", "--grad_clip", "0", "--optim", "zipsr", "--capturable"], ["--capturable"]),
])
def test_memory_flags_refuse_what_they_cannot_do(flags, words, capsys):
    assert_one_line_flag_error(flags, words, capsys)


def test_step_in_backward_under_torchrun_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert_one_line_flag_error(["--step_in_backward", "--grad_clip", "0"],
                               ["--step_in_backward with 2 processes (torchrun)", "run one process"], capsys)


def test_cpu_threads_chosen_and_an_explicit_choice_kept(corpus, tmp_path, monkeypatch, capsys):
    p, proc = build_parser(), Process(ddp=False, rank=0, world=1, device="cpu")

    def threads_after_setup(*flags, torch_default=4, caller=None):
        monkeypatch.setattr(trainer.dist, "TORCH_THREADS", torch_default)   # as if imported on a 4-core machine
        torch.set_num_threads(caller or torch_default)
        trainer.dist.setup_threads(p.parse_args(["--preset", "nano", *flags]), proc)
        return torch.get_num_threads(), capsys.readouterr().out
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    try:
        n, out = threads_after_setup()
        assert n == 3 and out.startswith("CPU threads: 3 (4 cores less one") and "--threads N" in out
        assert threads_after_setup("--threads", "2")[0] == 2
        assert threads_after_setup(caller=2)[0] == 2                   # torch.set_num_threads before main
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        n, out = threads_after_setup(torch_default=2)
        assert n == 2 and "(OMP_NUM_THREADS)" in out
    finally:
        torch.set_num_threads(1)
    train.main(base_args(corpus, tmp_path / "o", "--threads", "1", "--max_iters", "1"))
    assert "CPU threads: 1 (--threads)" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# runs: every method and optimizer, the data and model they meet

def test_batch_larger_than_data(corpus, tmp_path):
    with pytest.raises(RunError, match="--batch_size"):
        train.main(base_args(corpus, tmp_path / "o", "--batch_size", "5000", "--max_iters", "2"))


def test_block_size_beyond_the_data_is_an_error_and_compile_is_announced(corpus, tmp_path, capsys, monkeypatch):
    folder = datamod.prepare(corpus[0], "byte", data_dir=corpus[1], verbose=False)
    longest = datamod.load_meta(folder)["val_tokens"] - 1          # one window of the val split
    with pytest.raises(RunError, match=f"^--block_size 100000: .* use --block_size <= {longest} or more data$"):
        train.main(base_args(corpus, tmp_path / "o", "--block_size", "100000", "--max_iters", "2"))
    capsys.readouterr()
    monkeypatch.setattr(torch, "compile", lambda model, **k: model)  # the announcement, not the compile
    train.main(base_args(corpus, tmp_path / "c", "--compile", "--max_iters", "1"))
    assert "compiling the model (torch.compile, mode default): the first step takes ~1 min" in capsys.readouterr().out


@pytest.mark.parametrize("method", ["bf16", "gaussws", "diffq"])
@pytest.mark.parametrize("optim", ["adamw", "fp32", "torchao", "zipsr", "zeeden"])
def test_smoke_every_method_and_optimizer(corpus, tmp_path, method, optim):
    out = tmp_path / "o"
    s = train.main(base_args(corpus, out, "--method", method, "--optim", optim, "--max_iters", "20",
                             "--eval_interval", "20"))
    log = read_log(out)
    steps = [r for r in log if r["type"] == "step"]
    evals = [r for r in log if r["type"] == "eval"]
    assert len(steps) == 20 and all(math.isfinite(r["loss"]) for r in steps)
    assert [e["iter"] for e in evals] == [0, 20]
    assert evals[1]["val_loss"] < evals[0]["val_loss"] - 0.3   # 20 steps at lr 3e-3 learn byte statistics
    assert s["final_val_loss"] == evals[1]["val_loss"]
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 20
    if method != "bf16":
        assert "b_t_mean" in steps[0] and "bits" in evals[1]
        assert 4.0 <= steps[-1]["b_t_mean"] <= 6.5


def test_adam_mini_missing_or_runs(corpus, tmp_path, capsys):
    try:
        import adam_mini  # noqa: F401
    except ImportError:   # refused with the flags, before any data is prepared or model built
        flags = base_args((corpus[0], str(tmp_path / "data")), tmp_path / "o", "--optim", "adam-mini", "--max_iters", "2")
        with pytest.raises(SystemExit) as e:
            train.main(flags)
        assert e.value.code == 2 and "pip install adam-mini" in capsys.readouterr().err
        assert not os.path.exists(tmp_path / "data")
        return
    s = train.main(base_args(corpus, tmp_path / "o", "--optim", "adam-mini", "--max_iters", "20",
                             "--eval_interval", "20"))
    assert s["final_val_loss"] < s["first_val_loss"]


def test_bits_lambda_pulls_bitwidth_down(corpus, tmp_path):
    # the penalty lambda * sum_layers mean |b_t - b_target| has gradient toward b_target
    runs = {}
    for lam in ("0", "1.0"):
        s = train.main(base_args(corpus, tmp_path / lam, "--method", "gaussws", "--max_iters", "10",
                                 "--eval_windows", "0", "--bits_wd", "0", "--bits_lambda", lam))
        runs[lam] = s["b_t_mean"]
    assert runs["1.0"] < runs["0"] - 0.05


def test_lm_head_switch_signalled_at_90_percent(corpus, tmp_path, monkeypatch):
    from adam4bit import AdamW4bit
    seen, marked, models = [], [], []
    orig_build, orig_progress, orig_mark = train.build_optimizer, AdamW4bit.set_progress, AdamW4bit.mark_lm_head

    def build(args, model, device_type):
        models.append(model)
        return orig_build(args, model, device_type)

    def mark(self, p):
        marked.append(p)
        return orig_mark(self, p)

    def progress(self, f):
        orig_progress(self, f)
        seen.append((f, self.m_rounding_for(marked[0]), self.param_groups[0]["lr"]))

    monkeypatch.setattr(train, "build_optimizer", build)
    monkeypatch.setattr(AdamW4bit, "mark_lm_head", mark)
    monkeypatch.setattr(AdamW4bit, "set_progress", progress)
    train.main(base_args(corpus, tmp_path / "o", "--preset", "nano-llama", "--optim", "zeeden",
                         "--max_iters", "20", "--eval_interval", "10"))
    model = models[0]
    assert len(marked) == 1 and marked[0] is model.lm_head.weight and marked[0] is not model.wte.weight
    assert [f for f, _, _ in seen] == [i / 20 for i in range(20)]
    rules = [r for _, r, _ in seen]
    assert rules == ["rtn"] * 18 + ["sr"] * 2          # SR exactly for the last 10 % of the steps
    peak = seen[10][2]
    assert seen[18][2] == peak and seen[19][2] < peak   # ... which is the WSD cooldown


def test_eval_windows_limited_by_the_val_split(tmp_path, capsys):
    text = open(argparse.__file__, encoding="utf-8").read()[:30000]
    (tmp_path / "small.txt").write_text(text, encoding="utf-8")
    common = ["--preset", "nano", "--dataset", str(tmp_path / "small.txt"), "--data_dir", str(tmp_path / "d"),
              "--tokenizer", "byte", "--batch_size", "4", "--no-plot", "--max_iters", "2"]
    n_val = int(len(text.encode("utf-8")) * 0.1)
    fit = (n_val - 1) // 64                       # non-overlapping windows of the nano block (64)
    assert fit < 64                               # so the CPU default of 64 does not fit
    with pytest.raises(RunError, match=f"--eval_windows {fit + 1}: .* at most {fit} .*<= {fit}"):
        train.main(common + ["--out_dir", str(tmp_path / "a"), "--eval_windows", str(fit + 1)])
    capsys.readouterr()
    s = train.main(common + ["--out_dir", str(tmp_path / "b")])   # auto: capped, with a message
    assert f"eval on {fit} windows" in capsys.readouterr().out
    assert s["final_val_loss"] is not None
    assert torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)["config"]["eval_windows"] == fit


def test_stop_after_beyond_tokens_per_param_steps(corpus, tmp_path):
    # max_iters from --tokens_per_param is only known once the model is built
    with pytest.raises(RunError, match=r"--stop_after 1000: must be <= max_iters \d+ \(from --tokens_per_param"):
        train.main(base_args(corpus, tmp_path / "o", "--tokens_per_param", "0.01", "--stop_after", "1000"))


def test_a_data_dir_that_cannot_be_made_is_named(corpus, tmp_path):
    """--data_dir where no folder can be made: one line naming the flag, not a bare OSError."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(RunError, match=r"^--data_dir .*file/sub: cannot prepare the dataset there \("):
        train.main(base_args(corpus, tmp_path / "run", "--max_iters", "1", "--data_dir", str(blocker / "sub")))


def test_binary_file_in_train_py_is_a_one_line_error(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\x00" * 5000)
    with pytest.raises(RunError, match="weights.bin: not a text file"):
        train.main(["--preset", "nano", "--dataset", str(tmp_path / "weights.bin"), "--data_dir",
                    str(tmp_path / "d"), "--tokenizer", "byte", "--no-plot", "--out_dir", str(tmp_path / "o")])


def test_startup_line_says_which_tensors_get_4bit_states(corpus, tmp_path, capsys):
    train.main(base_args(corpus, tmp_path / "o", "--optim", "zipsr", "--max_iters", "1"))
    # nano: wte 256x32 and the MLP's up/down 128x32 (x2 layers) are >= 4096 and a multiple of 128;
    # qkv 96x32, out 32x32, wpe 64x32 and the norms stay FP32, the largest named first
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("4-bit states")] == [
        "4-bit states: 5 tensors (24.6k params); FP32 states: 10 tensors (10.4k params: blocks.0.attn.qkv.weight, "
        "blocks.1.attn.qkv.weight, wpe.weight, blocks.0.attn.out.weight, +6 more)"]
    m = nn.Linear(64, 66, bias=False)    # 4224 elements: >= 4096 but not a multiple of a 1024 block
    assert quantized_summary(m, A.AdamW4bit(m.parameters(), preset="zipsr", block_size=1024)) == (
        "4-bit states: 0 tensors (0 params); FP32 states: 1 tensors (4.2k params: weight)")


def test_a_block_size_whose_activations_cannot_fit_is_refused_and_byte_tokens_are_said(corpus, tmp_path, capsys,
                                                                                      monkeypatch):
    """--block_size 100000 on the tiny model (one attention op ran for > 10 minutes) needs ~29 GiB of
    activations: refused on a 16 GiB machine (with checkpointing it fits), and the preset's own
    context passes."""
    sizes = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 16 * 2 ** 30 // 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: sizes[name])
    cpu = argparse.Namespace(device_type="cpu")
    args = argparse.Namespace(batch_size=16, block_size=100000, activation_checkpointing=False, preset="tiny")
    with pytest.raises(RunError, match=r"^--block_size 100000 with --batch_size 16: one micro-batch's "
                                             r"activations need at least 29 GiB, more than this device's 16 GiB "
                                             r"\(the preset's context is 128\); lower --block_size or --batch_size$"):
        check_activations_fit(args, preset_config("tiny", vocab_size=256, block_size=100000), cpu)
    args.activation_checkpointing = True
    check_activations_fit(args, preset_config("tiny", vocab_size=256, block_size=100000), cpu)
    args.activation_checkpointing, args.block_size = False, 128
    check_activations_fit(args, preset_config("tiny", vocab_size=256), cpu)
    monkeypatch.undo()
    text, data_dir = corpus
    train.main(["--preset", "gpt2-124m", "--dataset", text, "--data_dir", data_dir, "--tokenizer", "byte",
                "--batch_size", "1", "--block_size", "32", "--max_iters", "1", "--eval_windows", "0", "--no-plot",
                "--out_dir", str(tmp_path / "g"), "--no-compile"])
    assert "with byte tokens: a 256-entry vocabulary, not the gpt2-124m of GPT-2's tokenizer" in capsys.readouterr().out


@pytest.mark.parametrize("optim", ["torchao", "zipsr"])
def test_activation_checkpointing_and_step_in_backward_train_the_same_run(corpus, tmp_path, optim):
    """train.py --activation_checkpointing and --step_in_backward (GaussWS, CPU eager): the same
    losses, gradient norms and final weights as the run without them, bit for bit."""
    flags = ["--method", "gaussws", "--optim", optim, "--grad_clip", "0", "--max_iters", "4", "--eval_interval", "2"]
    runs = {}
    for name, extra in (("plain", []), ("ckpt", ["--activation_checkpointing"]),
                        ("both", ["--activation_checkpointing", "--step_in_backward"])):
        train.main(base_args(corpus, tmp_path / name, *flags, *extra))
        log = read_log(tmp_path / name)
        runs[name] = ([(r["type"], r["iter"], r.get("loss"), r.get("val_loss")) for r in log if r["type"] != "summary"],
                      torch.load(tmp_path / name / "ckpt.pt", weights_only=False)["model"])
    for name in ("ckpt", "both"):
        assert runs[name][0] == runs["plain"][0]
        assert all(torch.equal(runs[name][1][k], v) for k, v in runs["plain"][1].items())
    norms = [[r["grad_norm"] for r in read_log(tmp_path / n) if r["type"] == "step"] for n in ("plain", "both")]
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)   # summed per parameter, in another order


def test_train_bf16_params_with_master_weight_bits_resumes(corpus, tmp_path):
    """--param_dtype bf16 --master_weight_bits 24: the checkpoint holds BF16 weights and an int8
    param_correction per weight, a stopped-and-resumed run ends where the uninterrupted one does;
    the BF16-write flags without BF16 parameters, or together, are one-line errors."""
    for flags in (["--param_rounding", "sr"], ["--optim", "adamw", "--param_dtype", "bf16", "--master_weight_bits", "24"],
                  ["--optim", "zipsr", "--param_dtype", "bf16", "--param_rounding", "sr", "--master_weight_bits", "24"]):
        with pytest.raises(SystemExit):
            train.main(base_args(corpus, tmp_path / "x", *flags))
    args = base_args(corpus, tmp_path / "a", "--optim", "zipsr", "--param_dtype", "bf16", "--master_weight_bits", "24",
                     "--max_iters", "4", "--eval_interval", "2")
    train.main(args)
    args_b = [a if a != str(tmp_path / "a") else str(tmp_path / "b") for a in args]
    train.main(args_b + ["--stop_after", "2"])
    train.main(args_b + ["--resume"])
    ca = torch.load(tmp_path / "a" / "ckpt.pt", weights_only=True)
    cb = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)
    assert {t.dtype for t in ca["model"].values() if t.is_floating_point()} == {torch.bfloat16}
    corr = [st["param_correction"] for st in ca["optimizer"]["state"].values()]
    assert corr and all(c.dtype == torch.int8 for c in corr) and any(c.abs().max() > 0 for c in corr)
    assert _tensors_equal(ca["model"], cb["model"]) and _tensors_equal(ca["optimizer"], cb["optimizer"])


def test_train_capturable_equals_plain_run_and_resumes_across_it(corpus, tmp_path):
    """train.py --capturable (AdamW4bit(capturable=True): device step counters; a CUDA graph on a
    GPU) trains to the same checkpoint as without it, a run stopped without it resumes with it,
    and --capturable with --optim adamw is a one-line error."""
    with pytest.raises(SystemExit):
        train.main(base_args(corpus, tmp_path / "x", "--optim", "adamw", "--capturable"))
    args = base_args(corpus, tmp_path / "a", "--optim", "zipsr", "--max_iters", "4", "--eval_interval", "2")
    train.main(args)
    args_b = [a if a != str(tmp_path / "a") else str(tmp_path / "b") for a in args]
    train.main(args_b + ["--stop_after", "2"])
    train.main(args_b + ["--resume", "--capturable"])
    ca = torch.load(tmp_path / "a" / "ckpt.pt", weights_only=True)
    cb = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)
    steps = [st["step"] for st in cb["optimizer"]["state"].values()]
    assert steps and all(torch.is_tensor(t) and float(t) == 4 for t in steps)
    assert _tensors_equal(ca["model"], cb["model"])


# ---------------------------------------------------------------------------------------------
# checkpoints and resume

def _tensors_equal(a, b):
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_tensors_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("method, optim", [("gaussws", "zipsr"), ("diffq", "adamw")])
def test_resume_is_bit_identical(corpus, tmp_path, method, optim):
    # N steps, stop, resume, N more == 2N uninterrupted: model (with GaussWS noise state and b_i),
    # optimizer (packed 4-bit states, SR seed), and every logged step loss
    args = base_args(corpus, tmp_path / "a", "--method", method, "--optim", optim, "--max_iters", "12",
                     "--eval_interval", "4")
    train.main(args)
    args_b = [a if a != str(tmp_path / "a") else str(tmp_path / "b") for a in args]
    train.main(args_b + ["--stop_after", "6"])
    assert torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)["iter_num"] == 6
    train.main(args_b + ["--resume"])
    ca = torch.load(tmp_path / "a" / "ckpt.pt", weights_only=True)
    cb = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)
    assert ca["iter_num"] == cb["iter_num"] == 12
    assert _tensors_equal(ca["model"], cb["model"])
    assert _tensors_equal(ca["optimizer"], cb["optimizer"])
    steps = lambda d: [(r["iter"], r["loss"]) for r in read_log(d) if r["type"] == "step"]  # noqa: E731
    assert steps(tmp_path / "a") == steps(tmp_path / "b") and len(steps(tmp_path / "a")) == 12


def test_resume_refuses_other_config_and_corrupt_file(corpus, tmp_path):
    args = base_args(corpus, tmp_path / "o", "--max_iters", "4", "--eval_interval", "2")
    train.main(args)
    with pytest.raises(RunError, match=r"--lr 0\.003 \(checkpoint\) vs 0\.001"):
        train.main(args + ["--lr", "1e-3", "--resume"])
    bad = tmp_path / "broken.pt"
    raw = (tmp_path / "o" / "ckpt.pt").read_bytes()
    bad.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(RunError, match="corrupt or truncated"):
        train.main(args + ["--resume", str(bad)])
    with pytest.raises(RunError, match="no checkpoint"):
        train.main(args + ["--resume", str(tmp_path / "missing.pt")])


def test_nan_stops_and_keeps_last_good_checkpoint(corpus, tmp_path, monkeypatch):
    calls = {"n": 0}
    orig = GPT.forward

    def forward(self, idx, targets=None):
        logits, loss = orig(self, idx, targets)
        if self.training:
            calls["n"] += 1
            if calls["n"] > 7:  # steps 0..6 are fine, step 7 diverges
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", forward)
    out = tmp_path / "o"
    with pytest.raises(RunError, match=r"step 7: training diverged.*step 5\) is left intact"):
        train.main(base_args(corpus, out, "--max_iters", "20", "--eval_interval", "5"))
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 5
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())
    assert not (out / "ckpt.pt.tmp").exists()
    assert read_log(out)[-1]["type"] == "error"


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, {"format": CKPT_FORMAT, "x": torch.arange(5)})
    before = open(path, "rb").read()

    def crashing_save(obj, f):
        f.write(b"partial garbage")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crashing_save)
    with pytest.raises(OSError):
        save_checkpoint(path, {"format": CKPT_FORMAT, "x": torch.arange(9)})
    assert open(path, "rb").read() == before
    assert torch.equal(load_checkpoint(path)["x"], torch.arange(5))


def test_resume_with_another_max_tokens_is_refused(corpus, tmp_path):
    args = base_args(corpus, tmp_path / "o", "--max_iters", "2", "--eval_interval", "2")
    train.main(args + ["--max_tokens", "5000"])
    with pytest.raises(RunError, match=r"--max_tokens 5000 \(checkpoint\) vs None"):
        train.main(args + ["--resume"])


def test_resume_covers_the_whole_run_and_a_finished_run_is_left_alone(corpus, tmp_path, capsys):
    out = tmp_path / "o"
    args = base_args(corpus, out, "--max_iters", "8", "--eval_interval", "4")
    train.main(args + ["--stop_after", "4"])
    assert (f"stopped at --stop_after 4 of 8 steps; continue with: python train.py {shlex.join(args)} --resume"
            in capsys.readouterr().out.splitlines())      # the command without --stop_after
    first = [r for r in read_log(out) if r["type"] == "eval"][0]
    assert first["iter"] == 0
    # asking again for the same --stop_after: nothing to do, the log stays
    before = (out / "log.jsonl").read_bytes()
    capsys.readouterr()
    train.main(args + ["--stop_after", "4", "--resume"])
    assert "already at --stop_after 4" in capsys.readouterr().out
    assert (out / "log.jsonl").read_bytes() == before
    # resumed into another --out_dir, the new log holds one eval: its value, no "X -> X"
    capsys.readouterr()
    other = train.main(base_args(corpus, tmp_path / "n", "--max_iters", "8", "--eval_interval", "4")
                       + ["--resume", str(out)])
    printed = capsys.readouterr().out
    v = other["final_val_loss"]
    assert f"val loss {v:.4f}, " in printed and f"{v:.4f} ->" not in printed
    # resume to the end: first -> last val loss spans the whole run, not just the resumed part
    s = train.main(args + ["--resume"])
    log = read_log(out)
    evals = [r for r in log if r["type"] == "eval"]
    assert [e["iter"] for e in evals] == [0, 4, 8]
    assert s["first_val_loss"] == first["val_loss"] and s["final_val_loss"] == evals[-1]["val_loss"]
    assert s["best_val_loss"] == min(e["val_loss"] for e in evals)
    assert [r["type"] for r in log].count("summary") == 1
    printed = capsys.readouterr().out
    assert f"val loss {first['val_loss']:.4f} -> {evals[-1]['val_loss']:.4f}" in printed
    # resuming the finished run: says so, returns the original summary, log.jsonl untouched
    before = (out / "log.jsonl").read_bytes()
    ckpt_before = (out / "ckpt.pt").read_bytes()
    again = train.main(args + ["--resume"])
    assert "is at step 8 of 8, the run is finished" in capsys.readouterr().out
    assert again == log[-1] and again["final_val_loss"] == evals[-1]["val_loss"]
    train.main(args + ["--max_iters", "6", "--resume"])
    assert "is at step 8, past --max_iters 6; nothing to do" in capsys.readouterr().out
    assert (out / "log.jsonl").read_bytes() == before and (out / "ckpt.pt").read_bytes() == ckpt_before


class _NotATensor:
    pass


def test_unreadable_checkpoint_is_one_clear_line(tmp_path):
    good = tmp_path / "good.pt"
    save_checkpoint(str(good), {"format": CKPT_FORMAT, "x": torch.arange(1000)})
    # (where the cut lands decides which error torch.load gives; each must come out as one line)
    raw = good.read_bytes()
    (tmp_path / "half.pt").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "empty.pt").write_bytes(b"")
    torch.save({"format": CKPT_FORMAT, "x": _NotATensor()}, tmp_path / "pickled.pt")
    for name, reason in (("half.pt", "?): "), ("empty.pt", "the file is empty"), ("pickled.pt", "_NotATensor")):
        path = str(tmp_path / name)
        with pytest.raises(RunError) as e:
            load_checkpoint(path)
        msg = str(e.value)
        assert len(msg.splitlines()) == 1 and path in msg and "corrupt or truncated" in msg and reason in msg
        assert "weights_only" not in msg and "Weights only load failed" not in msg
    (tmp_path / "log.jsonl").write_text('{"type": "eval"}\n')     # a run's log given for its checkpoint
    with pytest.raises(RunError, match=r"log.jsonl is not a checkpoint \(not a file torch.save writes\)"):
        load_checkpoint(str(tmp_path / "log.jsonl"))


def test_resume_of_a_finished_run_whose_summary_was_cut_writes_it(corpus, tmp_path):
    """A finished run whose log lost its summary line mid-write (or ends in bytes that are not
    UTF-8): --resume trains zero steps and writes the summary, with the final val loss of its last
    eval, instead of leaving the run without one."""
    out = tmp_path / "run"
    args = base_args(corpus, out, "--max_iters", "4", "--eval_interval", "2")
    done = train.main(args)
    raw = (out / "log.jsonl").read_bytes()
    (out / "log.jsonl").write_bytes(raw[:raw.rindex(b'{"type": "summary"') + 30] + b"\xff\xfe")
    assert not [r for r in read_run_log(str(out / "log.jsonl")) if r["type"] == "summary"]
    again = train.main(args + ["--resume"])
    log = read_run_log(str(out / "log.jsonl"))
    assert log[-1] == again and again["iters"] == 4 and again["final_val_loss"] == done["final_val_loss"]
    assert [r["type"] for r in log].count("summary") == 1


def test_edited_checkpoint_that_loads_but_does_not_fit_is_one_line(corpus, tmp_path):
    """A checkpoint of this configuration edited by hand (a tensor reshaped, a key or the RNG state
    removed, another optimizer's state) stops --resume with one line naming the file."""
    out = tmp_path / "run"
    args = base_args(corpus, out, "--max_iters", "4", "--eval_interval", "2")
    train.main(args + ["--stop_after", "2"])
    path = out / "ckpt.pt"
    good = torch.load(path, weights_only=False)
    def edit_model(c):
        c["model"]["wte.weight"] = c["model"]["wte.weight"][:-1]
    def drop_rng(c):
        del c["rng"]
    def other_optimizer(c):
        c["optimizer"]["param_groups"] = c["optimizer"]["param_groups"] * 2
    for edit in (edit_model, drop_rng, other_optimizer):
        c = {**good, "model": dict(good["model"]), "optimizer": dict(good["optimizer"])}
        edit(c)
        torch.save(c, path)
        with pytest.raises(RunError) as e:
            train.main(args + ["--resume"])
        msg = str(e.value)
        assert len(msg.splitlines()) == 1 and str(path) in msg and "does not fit" in msg, (edit.__name__, msg)


def test_v_flags_are_in_the_run_config_for_resume(corpus, tmp_path, capsys):
    a = nano_args(corpus, "--optim", "zipsr", "--v_rounding", "state-rtn", "--max_iters", "2", "--no-plot",
                  "--out_dir", str(tmp_path))
    train.main(a)
    lr = DEFAULT_LR["nano"]
    assert f"optimizer zipsr --v_rounding state-rtn, lr {lr:g} (wsd), 2 steps of" in capsys.readouterr().out
    cfg = torch.load(tmp_path / "ckpt.pt", weights_only=True)["config"]
    assert (cfg["v_rounding"], cfg["v_codebook"]) == ("state-rtn", None)
    with pytest.raises(RunError, match=r"--v_rounding 'state-rtn' \(checkpoint\) vs 'state-sr' \(now\)"):
        train.main([x if x != "state-rtn" else "state-sr" for x in a] + ["--resume"])


def test_fresh_run_into_a_checkpoint_needs_resume_or_overwrite(corpus, tmp_path, capsys):
    out = tmp_path / "o"
    args = base_args(corpus, out, "--max_iters", "2", "--eval_interval", "2")
    train.main(args)
    before = (out / "ckpt.pt").read_bytes(), (out / "log.jsonl").read_bytes()
    with pytest.raises(RunError) as e:
        train.main(args + ["--seed", "1"])
    assert str(e.value) == (f"--out_dir {out} holds a plain checkpoint ({out / 'ckpt.pt'}): continue that run with "
                            f"--resume, or start over with --overwrite (removes it and replaces log.jsonl)")
    assert ((out / "ckpt.pt").read_bytes(), (out / "log.jsonl").read_bytes()) == before
    train.main(args + ["--seed", "1", "--overwrite"])
    assert torch.load(out / "ckpt.pt", weights_only=True)["config"]["seed"] == 1
    assert [r["type"] for r in read_log(out)].count("summary") == 1
    capsys.readouterr()
    with pytest.raises(SystemExit):
        train.main(args + ["--overwrite", "--resume"])
    assert "--overwrite and --resume: give one of them" in capsys.readouterr().err


def test_resume_with_larger_max_iters_trains_longer(corpus, tmp_path, capsys):
    out = tmp_path / "o"
    args = base_args(corpus, out, "--eval_interval", "10")
    train.main(args + ["--max_iters", "20"])
    capsys.readouterr()
    train.main(args + ["--max_iters", "20", "--resume"])
    assert "Raise --max_iters to train longer" in capsys.readouterr().out
    s = train.main(args + ["--max_iters", "30", "--resume"])
    log = read_log(out)
    steps = [r for r in log if r["type"] == "step"]
    assert [r["iter"] for r in steps] == list(range(30))
    lr = DEFAULT_LR["nano"]
    assert [r["lr"] for r in steps[20:]] == [get_lr(it, 30, lr) for it in range(20, 30)]
    assert steps[19]["lr"] < lr and steps[20]["lr"] == lr    # from the cooled-down lr back to the plateau
    assert [r["iter"] for r in log if r["type"] == "eval"] == [0, 10, 20, 30]
    assert s["iters"] == s["max_iters"] == 30 and [r["type"] for r in log].count("summary") == 1
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 30
    # --tokens_per_param may change as well; other flags still may not
    train.main(args + ["--tokens_per_param", "0.25", "--resume"])     # 0.25 x 34,976 params / 256 tokens: 35 steps
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 35
    with pytest.raises(RunError, match="--seed 0 \\(checkpoint\\) vs 1"):
        train.main(args + ["--max_iters", "400", "--seed", "1", "--resume"])


def test_resume_compares_only_the_flags_either_run_reads():
    """Two --method bf16 runs may differ in PQT flags, two cosine runs in --cooldown_frac; once
    either run reads a flag (another --method or --schedule), a difference refuses the resume."""
    saved = dict(RESUME_DEFAULTS, method="bf16", b_init=8.0, parts="qkv", schedule="cosine", cooldown_frac=0.2,
                 min_lr_frac=0.1, lr=1e-3)
    check_resume_config(saved, dict(saved, b_init=6.0, parts="all", cooldown_frac=0.1), "ckpt.pt")
    for change, named in ((dict(method="gaussws", b_init=6.0), ("--method", "--b_init")),
                          (dict(schedule="wsd", cooldown_frac=0.1), ("--schedule", "--cooldown_frac")),
                          (dict(min_lr_frac=0.2), ("--min_lr_frac",))):
        with pytest.raises(RunError) as e:
            check_resume_config(saved, dict(saved, **change), "ckpt.pt")
        assert all(f"{n} " in str(e.value) for n in named) and "--parts" not in str(e.value), str(e.value)


FIXTURES = os.path.join(ROOT, "tests", "fixtures")


@pytest.mark.parametrize("name, flags", [("nano_gauss", ["--method", "gaussws", "--optim", "zipsr"]),
                                         ("nano_diffq", ["--method", "diffq", "--optim", "zeeden", "--param_dtype", "bf16"])])
def test_a_checkpoint_of_the_previous_code_resumes_to_its_log_bit_for_bit(tmp_path, name, flags):
    """tests/fixtures/NAME_at4 is what the previous code left of `python train.py --preset nano FLAGS
    --out_dir D --max_iters 6 --stop_after 4 --eval_interval 2 --no-plot` (ckpt.pt at step 4, log.jsonl),
    NAME_resumed.jsonl the log of its `... --max_iters 6 --eval_interval 2 --no-plot --resume`. This
    code resumes a copy with the same flags to the same log: every step's loss, lr, grad norm and b_t
    mean, every eval's losses and bitwidth statistics, the summary's numbers, bit for bit (timings,
    memory and paths aside; fields added since are not compared). The numbers are those of the torch
    that wrote them, on CPU, with the default corpus (this Python's standard library): elsewhere the
    test skips."""
    want = [json.loads(line) for line in open(os.path.join(FIXTURES, f"{name}_resumed.jsonl"))]
    machine = want[-1]["machine"]
    if torch.cuda.is_available() or machine["torch"] != torch.__version__ or sys.version_info[:2] != (3, 11):
        pytest.skip(f"the recorded numbers are those of torch {machine['torch']} on CPU with Python 3.11's "
                    f"standard library as corpus")
    out = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, f"{name}_at4"), out)
    train.main(["--preset", "nano", *flags, "--out_dir", str(out), "--max_iters", "6", "--eval_interval", "2",
                "--no-plot", "--resume"])
    volatile = {"time_s", "tokens_per_s", "dt_ms", "peak_mem_mb", "checkpoint", "machine"}
    numbers = lambda log: [{k: v for k, v in r.items() if k not in volatile} for r in log]  # noqa: E731
    got = read_log(out)
    assert [(r["type"], r.get("iter")) for r in got] == [(r["type"], r.get("iter")) for r in want]
    assert [r["type"] for r in got].count("step") == 6 and got[-1]["start_iter"] == 4
    for a, b in zip(got, numbers(want)):          # the records may hold fields added since
        assert {k: a.get(k) for k in b} == b, (a, b)


# ---------------------------------------------------------------------------------------------
# the run log

class _Killed(BaseException):
    """A kill at a chosen point: not an Exception, so nothing on the way catches it."""


def test_resume_rewrites_the_log_atomically(corpus, tmp_path, monkeypatch):
    # --resume rewrites log.jsonl (the records up to its checkpoint); a kill during the rewrite
    # (here: while the third record is written) leaves the old log whole
    out = tmp_path / "o"
    args = base_args(corpus, out, "--max_iters", "8", "--eval_interval", "4")
    train.main(args + ["--stop_after", "4"])
    before = (out / "log.jsonl").read_bytes()
    dumps = json.dumps

    def killed_at_step_2(obj, *a, **k):
        if isinstance(obj, dict) and obj.get("type") == "step" and obj.get("iter") == 2:
            raise _Killed
        return dumps(obj, *a, **k)

    monkeypatch.setattr(json, "dumps", killed_at_step_2)
    with pytest.raises(_Killed):
        train.main(args + ["--resume"])
    monkeypatch.undo()
    assert (out / "log.jsonl").read_bytes() == before
    assert not (out / "log.jsonl.tmp").exists()
    train.main(args + ["--resume"])
    assert [r["iter"] for r in read_log(out) if r["type"] == "step"] == list(range(8))


def test_torn_last_log_line_is_skipped_and_a_bad_middle_line_is_named(corpus, tmp_path, capsys):
    out = tmp_path / "o"
    args = base_args(corpus, out, "--max_iters", "8", "--eval_interval", "4")
    train.main(args + ["--stop_after", "4"])
    good = (out / "log.jsonl").read_text()
    (out / "log.jsonl").write_text(good + '{"type": "step", "iter": 4, "lo')   # a kill mid-append
    capsys.readouterr()
    train.main(args + ["--resume"])
    printed = [x for x in capsys.readouterr().out.splitlines() if "cut off" in x]
    assert printed == [f"{out / 'log.jsonl'}: skipped its last line {len(good.splitlines()) + 1}, cut off "
                       f"mid-write (Unterminated string starting at)"]
    assert [r["iter"] for r in read_log(out) if r["type"] == "step"] == list(range(8))
    lines = (out / "log.jsonl").read_text().splitlines()
    lines[2] = lines[2][:10]                                  # not the last line: an error
    (out / "log.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(RunError, match=r"log\.jsonl line 3 is not a JSON record \(.*\); fix or delete"):
        train.main(args + ["--resume"])
    for bad in ('{"type": "step"}', "[1, 2]", "3"):               # JSON, but not one of our records
        lines[2] = bad
        (out / "log.jsonl").write_text("\n".join(lines) + "\n")
        with pytest.raises(RunError, match=r"log\.jsonl line 3 is not a record of this trainer"):
            train.main(args + ["--resume"])


def test_unwritable_out_dir_and_full_disk_are_one_line_errors(corpus, tmp_path, monkeypatch):
    import errno

    def boom(*a, **k):
        raise AssertionError("data prepared before --out_dir was checked")

    (tmp_path / "a_file").write_text("x")
    bad = [(tmp_path / "a_file" / "o", "Not a directory")]
    if os.geteuid() != 0:   # root writes into read-only folders
        (tmp_path / "ro").mkdir(mode=0o555)
        bad.append((tmp_path / "ro", "Permission denied"))
    with monkeypatch.context() as m:
        m.setattr(datamod, "prepare", boom)
        for out, reason in bad:
            with pytest.raises(RunError) as e:
                train.main(base_args(corpus, out, "--max_iters", "2"))
            assert str(e.value) == f"--out_dir {out}: cannot write there ({reason})"
        with pytest.raises(RunError, match="is a file, not a folder"):
            train.main(base_args(corpus, tmp_path / "a_file", "--max_iters", "2"))
    # a full disk at the second checkpoint: the temp file goes, the first checkpoint stays
    out, save, calls = tmp_path / "full", torch.save, []

    def full_disk(obj, f):
        calls.append(1)
        if len(calls) == 1:
            return save(obj, f)
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(RunError) as e:
        train.main(base_args(corpus, out, "--max_iters", "4", "--eval_interval", "2"))
    assert str(e.value) == (f"--out_dir {out}: cannot write the checkpoint for step 4 (No space left on device); "
                            f"{out / 'ckpt.pt'} (step 2) is left intact")
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"]
    monkeypatch.undo()
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 2


# ---------------------------------------------------------------------------------------------
# runs that meet (one --out_dir per run, resumes across folders) and signals

def test_a_second_run_into_a_folder_in_use_is_refused_and_a_killed_holder_is_reported(corpus, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    holder = ctx.Process(target=hold_lock_then, args=(str(out / ".lock"), "sleep", child), daemon=True)
    holder.start()
    try:
        assert parent.poll(60)
        pid = parent.recv()
        with pytest.raises(RunError, match=rf"--out_dir {re.escape(str(out))} is in use by another run \(pid {pid} "):
            train.main(base_args(corpus, out, "--max_iters", "2"))
        assert not os.path.exists(out / "log.jsonl")      # the refused run wrote nothing there
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join()
    capsys.readouterr()
    train.main(base_args(corpus, out, "--max_iters", "2"))   # the kernel released the killed holder's lock
    said = capsys.readouterr().out
    assert f"the run that held it (pid {pid} " in said and "ended without releasing it" in said
    train.main(base_args(corpus, out, "--max_iters", "3", "--resume"))   # a clean exit leaves no note behind
    assert "ended without releasing it" not in capsys.readouterr().out
    assert not os.path.exists(out / ".lock")                               # nor the lock file


def test_resume_into_a_folder_holding_another_run_is_refused_unless_overwrite(corpus, tmp_path):
    run1, run2, run3 = tmp_path / "run1", tmp_path / "run2", tmp_path / "run3"
    train.main(base_args(corpus, run1, "--max_iters", "4", "--stop_after", "2"))
    train.main(base_args(corpus, run2, "--max_iters", "4", "--stop_after", "2", "--seed", "1"))
    before = open(run2 / "log.jsonl").read(), open(run2 / "ckpt.pt", "rb").read()
    with pytest.raises(RunError, match=r"holds another run's checkpoint .*--overwrite"):
        train.main(base_args(corpus, run2, "--max_iters", "4", "--resume", str(run1 / "ckpt.pt")))
    assert (open(run2 / "log.jsonl").read(), open(run2 / "ckpt.pt", "rb").read()) == before   # untouched
    # into a folder of its own: the continuation's log starts with the run's own records
    train.main(base_args(corpus, run3, "--max_iters", "4", "--resume", str(run1)))
    own = read_log(run3)
    assert [r["iter"] for r in own if r["type"] == "step"] == [0, 1, 2, 3]
    assert [r["loss"] for r in own if r["type"] == "step"][:2] == [r["loss"] for r in read_log(run1) if r["type"] == "step"]
    # --overwrite replaces run2 with run1's continuation: no seed-1 record is left in its log
    train.main(base_args(corpus, run2, "--max_iters", "4", "--resume", str(run1 / "ckpt.pt"), "--overwrite"))
    numbers = lambda log: [(r["type"], r.get("iter"), r.get("loss"), r.get("val_loss")) for r in log]  # noqa: E731
    assert numbers(read_log(run2)) == numbers(own)
    with pytest.raises(RunError, match="would remove the checkpoint it resumes"):
        train.main(base_args(corpus, run2, "--max_iters", "5", "--resume", str(run2 / "ckpt.pt"), "--overwrite"))


def run_until_first_step(argv, out, launch=(sys.executable,)):
    """Start `launch train.py argv` and return the Popen once log.jsonl holds a step record."""
    import time
    p = subprocess.Popen([*launch, train.__file__, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.time() + 300
    log = os.path.join(out, "log.jsonl")
    while not (os.path.exists(log) and '"type": "step"' in open(log).read()):
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.01)
    return p


@pytest.mark.parametrize("signame, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_interrupt_saves_a_checkpoint_and_resume_is_bit_identical(corpus, tmp_path, signame, code):
    import signal
    args = base_args(corpus, tmp_path / "a", "--max_iters", "40", "--eval_interval", "20")
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    train.main(args)                                                   # the uninterrupted run
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    out = tmp_path / "b"
    args_b = [a if a != str(tmp_path / "a") else str(out) for a in args]
    p = run_until_first_step(args_b, out)
    p.send_signal(getattr(signal, signame))
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == code and "Traceback" not in stderr, stderr
    stopped = torch.load(out / "ckpt.pt", weights_only=True)["iter_num"]
    assert 1 <= stopped < 40
    assert [r["iter"] for r in read_log(out) if r["type"] == "step"] == list(range(stopped))
    cmd = f"python train.py {shlex.join(args_b)} --resume"
    assert f"{signame}: stopped at step {stopped} with a checkpoint in {out / 'ckpt.pt'}; continue with: {cmd}" \
        in stdout.splitlines()
    train.main(shlex.split(cmd)[2:])
    ca = torch.load(tmp_path / "a" / "ckpt.pt", weights_only=True)
    cb = torch.load(out / "ckpt.pt", weights_only=True)
    assert ca["iter_num"] == cb["iter_num"] == 40
    assert _tensors_equal(ca["model"], cb["model"]) and _tensors_equal(ca["optimizer"], cb["optimizer"])
    steps = lambda d: [(r["iter"], r["loss"]) for r in read_log(d) if r["type"] == "step"]  # noqa: E731
    assert steps(tmp_path / "a") == steps(out) and len(steps(out)) == 40


def test_ddp_interrupt_of_one_rank_stops_every_rank_at_one_step(corpus, tmp_path):
    # SIGTERM to rank 1 only: rank 0 (no signal) stops at the same step and writes the checkpoint
    import contextlib
    import signal
    out = tmp_path / "o"
    args = base_args(corpus, out, "--max_iters", "400", "--eval_interval", "200", "--grad_accum", "2")
    p = run_until_first_step(args, out, (sys.executable, "-m", "torch.distributed.run", "--standalone",
                                         "--nproc_per_node", "2"))
    ranks = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
            if env.get(b"TORCHELASTIC_RUN_ID") and str(out).encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                ranks.append((int(env.get(b"RANK", b"-1")), int(pid)))
    rank1 = [pid for r, pid in ranks if r == 1]
    assert len(rank1) == 1, ranks
    os.kill(rank1[0], signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=300)
    stopped = torch.load(out / "ckpt.pt", weights_only=True)["iter_num"]
    assert 1 <= stopped < 400
    assert [r["iter"] for r in read_log(out) if r["type"] == "step"] == list(range(stopped))
    assert (f"SIGTERM: stopped at step {stopped} with a checkpoint in {out / 'ckpt.pt'}; continue with: "
            f"torchrun --standalone --nproc_per_node 2 train.py ") in stdout, (stdout, stderr)


def test_a_second_signal_exits_at_once_while_a_step_runs(corpus, tmp_path):
    """A step stuck in one long op: the first SIGINT asks for a checkpoint at the step's end, a
    second one (after the echo window) ends the process at once with status 130; the first step's
    checkpoint is there and whole."""
    out = tmp_path / "o"
    flags = base_args(corpus, out, "--max_iters", "50", "--eval_interval", "1", "--eval_windows", "0",
                      "--threads", "1")
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    # steps 0 and 1 run (a checkpoint before steps 1 and 2), step 2's forward never ends
    code = ("import sys, time, train, model\n"
            "fwd = model.GPT.forward\n"
            "def slow(self, *a, **k):\n"
            "    if self.training and train_steps[0] > 1:\n"
            "        time.sleep(3600)\n"
            "    train_steps[0] += self.training\n"
            "    return fwd(self, *a, **k)\n"
            "train_steps = [0]\n"
            "model.GPT.forward = slow\n"
            f"train.main({flags!r})\n")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        def saved():   # ckpt.pt is replaced atomically: whatever is there loads
            return torch.load(out / "ckpt.pt", weights_only=False)["iter_num"] if os.path.exists(out / "ckpt.pt") else 0
        while saved() < 2 and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(1)
        p.send_signal(signal.SIGINT)
        time.sleep(Interrupts.ECHO_S + 0.5)
        assert p.poll() is None                       # the first signal waits for the step boundary
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=30)
    finally:
        p.kill()
    said = p.stdout.read()
    assert rc == 130, said
    assert "SIGINT again: exiting now" in said
    assert torch.load(out / "ckpt.pt", weights_only=False)["iter_num"] == 2


# ---------------------------------------------------------------------------------------------
# DDP (torchrun, gloo on CPU)

def test_ddp_two_processes_match_one_process_with_accumulation(corpus, tmp_path, monkeypatch):
    # torchrun with 2 CPU processes (gloo) and --grad_accum 2 reads the same micro-batches as one
    # process with --grad_accum 2, so the per-step losses agree up to float summation order
    # (bench.py --only ddp runs the same comparison on 2 GPUs)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two processes on two cores
    args = base_args(corpus, tmp_path / "unused", "--max_iters", "6", "--eval_interval", "6",
                     "--grad_accum", "2", "--seed", "1")
    res = bench_training.bench_ddp(args[:args.index("--out_dir")] + args[args.index("--out_dir") + 2:],
                                   out_dir=str(tmp_path), nproc=2)
    l1, l2 = res["one"]["step_loss"], res["many"]["step_loss"]
    assert len(l1) == len(l2) == 6
    assert np.allclose(l1, l2, rtol=0, atol=1e-4)
    assert np.allclose(res["one"]["val_loss"], res["many"]["val_loss"], atol=1e-4)


def test_grad_accum_not_divisible_by_the_processes(corpus, tmp_path, monkeypatch):
    _as_fsdp_rank(monkeypatch, world=2)
    with pytest.raises(RunError, match="^--grad_accum 3 must be divisible by the number of processes \\(2\\)$"):
        train.main(base_args(corpus, tmp_path / "o", "--grad_accum", "3"))
    seen = []                   # without --grad_accum: one micro-batch per process

    def stop(args, proc):
        seen.append(args.grad_accum)
        raise RunError("stop")
    monkeypatch.setattr(train, "setup_data", stop)
    with pytest.raises(RunError, match="^stop$"):
        train.main(base_args(corpus, tmp_path / "o"))
    assert seen == [2]


def test_resume_without_grad_accum_keeps_the_checkpoints_on_any_process_count():
    for given, saved, world, want in ((None, 2, 1, 2), (None, 2, 2, 2), (None, 4, 2, 4), (2, 4, 1, 2)):
        args = argparse.Namespace(grad_accum=given)
        set_grad_accum(args, world, {"config": {"grad_accum": saved}})
        assert args.grad_accum == want
    args = argparse.Namespace(grad_accum=None)
    set_grad_accum(args, 3)
    assert args.grad_accum == 3                 # a fresh run: one micro-batch per process
    for given, said in ((None, "--grad_accum 1 (the checkpoint's) must be divisible by the number of processes (2): "
                               "resume it on a number of processes that divides 1"),
                        (3, "--grad_accum 3 must be divisible by the number of processes (2)")):
        with pytest.raises(RunError) as e:
            set_grad_accum(argparse.Namespace(grad_accum=given), 2, {"config": {"grad_accum": 1}})
        assert str(e.value).startswith(said) and (given is None) == ("divides" in str(e.value)), str(e.value)


def test_bad_flag_under_torchrun_is_printed_by_rank_0_only(capsys, monkeypatch):
    """Every rank parses the same flags: rank 0 prints the one-line error, the others exit with the
    same status silently (torchrun would show it once per rank)."""
    for rank, printed in (("1", ""), ("0", "train.py: error: argument --lr: invalid float value: 'x'\n")):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["--lr", "x"])
        assert e.value.code == 2 and capsys.readouterr().err == printed


def test_stray_rank_without_torchrun_is_a_one_line_error(monkeypatch):
    """RANK left in the environment without torchrun's LOCAL_RANK / WORLD_SIZE: a one-line error
    naming them, not a KeyError."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit, match="RANK=0 is set but LOCAL_RANK and WORLD_SIZE not: start a distributed "
                                         "run with torchrun, or unset RANK"):
        setup_distributed(argparse.Namespace(device="cpu"))


def test_torchrun_with_more_ranks_than_gpus_is_a_one_line_error(monkeypatch):
    """LOCAL_RANK past the host's GPUs (torchrun --nproc_per_node 2 on one GPU): an error naming
    the rank, the GPU count and the two ways out, before CUDA's "invalid device ordinal"."""
    for k, v in dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit, match=r"LOCAL_RANK=1 but this host has 1 GPU\(s\): start torchrun with "
                                         r"--nproc_per_node at most 1, or add --device cpu"):
        setup_distributed(argparse.Namespace(device="auto"))


# ---------------------------------------------------------------------------------------------
# train.py --fsdp (gloo processes through launch_ranks, as torchrun would start them)

def _fsdp_train_py(rank, world, tmp, argv):
    # train.main ends by destroying the process group; that is left to rank_main, after the
    # result is written (a teardown abort must not hide a finished run, see launch_ranks)
    import torch.distributed as dist
    destroy, dist.destroy_process_group = dist.destroy_process_group, lambda *a, **k: None
    try:
        return train.main(argv)
    finally:
        dist.destroy_process_group = destroy


def test_train_fsdp_resumes_on_another_world_size_and_matches_one_process(corpus, tmp_path):
    """--fsdp on 2 ranks stops at step 4 with a DCP folder (no .tmp or .old left), --resume
    continues it on 1 rank (DCP reshards model, packed 4-bit states and scales); every step's
    loss equals one plain process's with the same --grad_accum to float summation order (the 2
    ranks average their two micro-batches' gradients in another order). Without PQT: under DDP
    and FSDP2 each rank draws GaussWS noise once per step where one process draws it per
    micro-batch."""
    args = base_args(corpus, tmp_path / "f", "--max_iters", "6", "--eval_interval", "2", "--grad_accum", "2",
                     "--optim", "zeeden", "--seed", "1")
    launch_ranks(_fsdp_train_py, tmp_path, 2, args + ["--fsdp", "--stop_after", "4"])
    assert sorted(os.listdir(tmp_path / "f")) == ["ckpt", "log.jsonl"]
    assert json.load(open(tmp_path / "f" / "ckpt" / "train.json"))["iter_num"] == 4
    summary = launch_ranks(_fsdp_train_py, tmp_path, 1, args + ["--fsdp", "--resume"])[0]
    assert summary["start_iter"] == 4 and summary["iters"] == 6 and summary["world"] == 1
    plain = train.main(base_args(corpus, tmp_path / "p", *args[args.index("--max_iters"):]))
    steps = lambda d: [r["loss"] for r in read_log(d) if r["type"] == "step"]  # noqa: E731
    assert len(steps(tmp_path / "f")) == 6
    assert np.allclose(steps(tmp_path / "f"), steps(tmp_path / "p"), rtol=0, atol=1e-4)
    assert abs(summary["final_val_loss"] - plain["final_val_loss"]) < 1e-4


def test_train_fsdp_one_rank_equals_plain_bit_for_bit(corpus, tmp_path):
    """--fsdp on one rank (parameters kept unsharded between the micro-steps, AdamW4bit's
    recorded plan replayed on the local tensors: FP32 states, so the CPU replays too) gives one
    plain process's step losses, grad norms and final weights bit for bit (GaussWS, --grad_accum 2)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    args = ["--max_iters", "4", "--eval_interval", "100", "--grad_accum", "2", "--method", "gaussws",
            "--optim", "fp32"]
    launch_ranks(_fsdp_train_py, tmp_path, 1, base_args(corpus, tmp_path / "f", *args, "--fsdp"))
    train.main(base_args(corpus, tmp_path / "p", *args))
    steps = lambda d: [(r["loss"], r["grad_norm"]) for r in read_log(d) if r["type"] == "step"]  # noqa: E731
    assert len(steps(tmp_path / "f")) == 4 and steps(tmp_path / "f") == steps(tmp_path / "p")
    dcp_to_torch_save(str(tmp_path / "f" / "ckpt"), str(tmp_path / "f.pt"))
    sharded = torch.load(tmp_path / "f.pt", weights_only=False)["model"]
    plain = torch.load(tmp_path / "p" / "ckpt.pt", weights_only=True)["model"]
    assert sorted(sharded) == sorted(plain) and all(torch.equal(sharded[k], plain[k]) for k in plain)


def _aot_eager_compile(graphs):
    """torch.compile as train.py calls it, with the aot_eager backend (Dynamo's capture and
    AOTAutograd's joint forward/backward graph, run by eager kernels instead of Inductor's);
    each graph handed to the backend is appended to `graphs`."""
    from torch._dynamo.backends.debugging import aot_eager
    real = torch.compile

    def backend(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return aot_eager(gm, example_inputs)
    return lambda model, mode="default": real(model, backend=backend)


def _fsdp_train_py_compiled(rank, world, tmp, argv):
    graphs = []
    torch._dynamo.reset()
    torch.compile = _aot_eager_compile(graphs)   # a fresh process of launch_ranks's: nothing to restore
    return _fsdp_train_py(rank, world, tmp, argv), graphs


def test_train_fsdp_compiled_one_rank_equals_plain_compiled_bit_for_bit(corpus, tmp_path, monkeypatch):
    """train.py --fsdp --compile on one rank: Dynamo leaves FSDP2's hooks outside the graph and
    captures the whole forward as one graph, the plain --compile run's (same node count, no
    recompile over 3 steps of 2 micro-steps), so step losses, grad norms and final weights equal
    the plain compiled run's bit for bit (GaussWS, ZIP-SR). Backend aot_eager, not Inductor: the
    FSDP2 interplay is Dynamo's and AOTAutograd's, and Inductor's C++ build of this model's
    kernels takes minutes on a CPU (with it the run also matched bit for bit, by hand). GaussWS on
    qkv only: each layer's noise adds to the traced graph and the trace time."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    args = ["--max_iters", "3", "--eval_interval", "100", "--eval_windows", "0", "--grad_accum", "2",
            "--method", "gaussws", "--parts", "qkv", "--optim", "zipsr", "--compile"]
    summary, fsdp_graphs = launch_ranks(_fsdp_train_py_compiled, tmp_path, 1,
                                   base_args(corpus, tmp_path / "f", *args, "--fsdp"))[0]
    plain_graphs = []
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", _aot_eager_compile(plain_graphs))
    train.main(base_args(corpus, tmp_path / "p", *args))
    torch._dynamo.reset()
    assert summary["world"] == 1 and len(plain_graphs) == 1 and fsdp_graphs == plain_graphs
    steps = lambda d: [(r["loss"], r["grad_norm"], r["b_t_mean"])  # noqa: E731
                       for r in read_log(d) if r["type"] == "step"]
    assert len(steps(tmp_path / "f")) == 3 and steps(tmp_path / "f") == steps(tmp_path / "p")
    dcp_to_torch_save(str(tmp_path / "f" / "ckpt"), str(tmp_path / "f.pt"))
    sharded = torch.load(tmp_path / "f.pt", weights_only=False)["model"]
    plain = torch.load(tmp_path / "p" / "ckpt.pt", weights_only=True)["model"]
    assert sorted(sharded) == sorted(plain) and all(torch.equal(sharded[k], plain[k]) for k in plain)


@pytest.mark.parametrize("flags, env, words", [
    (["--fsdp"], {}, ["--fsdp", "torchrun"]),
    (["--fsdp", "--optim", "adam-mini"], {"RANK": "0"}, ["--fsdp", "adam-mini", "zipsr"]),
    (["--fsdp", "--bits_lambda", "0.5"], {"RANK": "0"}, ["--fsdp", "--bits_lambda 0.5", "DDP"]),
    (["--fsdp", "--param_dtype", "bf16", "--method", "gaussws"], {"RANK": "0"}, ["--param_dtype bf16", "b_i", "DDP"]),
    (["--fsdp", "--param_dtype", "bf16", "--optim", "zipsr", "--master_weight_bits", "24"], {"RANK": "0"},
     ["--master_weight_bits 24", "DDP"]),
    (["--fsdp", "--compile", "--compile_mode", "reduce-overhead"], {"RANK": "0"},
     ["--compile_mode reduce-overhead", "CUDA graphs", "max-autotune-no-cudagraphs"]),
])
def test_fsdp_bad_flags_one_line_error(flags, env, words, capsys, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(train, "setup_distributed", lambda args: Process(False, 0, 1, "cpu"))
    assert_one_line_flag_error(flags, words, capsys)


def _fsdp_mesh_on_a_gpu_host(rank, world, tmp):
    """shard_model on CPU ranks of a host whose accelerator is CUDA (torch._C._get_accelerator
    stubbed: fully_shard's default mesh follows it): the mesh types of the sharded parameters."""
    torch._C._get_accelerator = lambda: torch.device("cuda")
    model = GPT(preset_config("tiny", vocab_size=256))
    shard_model(model, world, "cpu")
    x = torch.randint(0, 256, (2, 16))
    model(x, x)[1].backward()
    return sorted({p.device_mesh.device_type for p in model.parameters()})


def test_fsdp_on_cpu_shards_on_a_cpu_mesh_on_a_gpu_host(tmp_path):
    """torchrun ... train.py --fsdp --device cpu on a GPU host: the ranks shard on a CPU mesh over
    their gloo group, not on fully_shard's default CUDA mesh (rank 1 of 2: cuda:1)."""
    assert launch_ranks(_fsdp_mesh_on_a_gpu_host, tmp_path, 2) == [["cpu"], ["cpu"]]


# ---------------------------------------------------------------------------------------------
# checkpoints of either kind (ckpt.pt, the DCP folder ckpt)

def test_fsdp_checkpoint_folder_fallback_and_refusals(tmp_path):
    """A crash between save_dcp_checkpoint's two renames leaves ckpt.old and a complete ckpt.tmp
    (train.json, written last, in it): --resume takes the newer ckpt.tmp, and ckpt.old when
    ckpt.tmp is unfinished; a first save cut before its rename leaves a complete ckpt.tmp alone,
    which --resume takes and a fresh run names for resuming; a folder without train.json is
    refused in one line, and so is a --fsdp folder resumed without --fsdp."""
    args = argparse.Namespace(out_dir=str(tmp_path), fsdp=True, resume="auto", overwrite=False)
    os.makedirs(tmp_path / "ckpt.old")
    os.makedirs(tmp_path / "ckpt.tmp")
    assert resume_path(args) == str(tmp_path / "ckpt.old")
    (tmp_path / "ckpt.tmp" / "train.json").write_text("{}")
    assert resume_path(args) == str(tmp_path / "ckpt.tmp")
    os.rmdir(tmp_path / "ckpt.old")
    assert resume_path(args) == str(tmp_path / "ckpt.tmp")
    with pytest.raises(RunError, match=r"no checkpoint at .*ckpt \(.*ckpt.tmp is complete: --resume .*ckpt.tmp\)"):
        load_checkpoint(str(tmp_path / "ckpt"))    # an explicit --resume OUT/ckpt
    with pytest.raises(RunError, match=r"holds an FSDP2 checkpoint \(.*ckpt.tmp\): continue that run with "
                                             r"--resume, or start over"):
        check_out_dir(argparse.Namespace(**{**vars(args), "resume": None}), Process(False, 0, 1, "cpu"))
    shutil.rmtree(tmp_path / "ckpt.tmp")
    os.makedirs(tmp_path / "ckpt")
    assert resume_path(args) == str(tmp_path / "ckpt")
    with pytest.raises(RunError, match="not a complete train.py --fsdp checkpoint folder"):
        load_checkpoint(str(tmp_path / "ckpt"))
    with pytest.raises(RunError, match="resume it with --fsdp"):
        train.resume(argparse.Namespace(fsdp=False, resume=str(tmp_path / "ckpt")), {"dcp": "x"}, None, None, "cpu")


def _as_fsdp_rank(monkeypatch, world=1):
    """train.main in this process as rank 0 of `world` under torchrun, without a process group."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(train, "setup_distributed", lambda args: Process(world > 1, 0, world, "cpu"))
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda *a, **k: None)


def test_fresh_run_refuses_either_checkpoint_kind_and_overwrite_removes_both(corpus, tmp_path, monkeypatch):
    """Every checkpoint kind in --out_dir (ckpt.pt, the DCP folder ckpt, ckpt.old, ckpt.tmp) stops a
    fresh run of either kind in one line naming it and how to resume it; --overwrite removes them
    all, so the folder never holds both kinds."""
    out = tmp_path / "o"
    args = base_args(corpus, out, "--max_iters", "2", "--eval_interval", "2")
    for name in ("ckpt", "ckpt.old", "ckpt.tmp"):
        os.makedirs(out / name)
        with pytest.raises(RunError) as e:
            train.main(args)
        assert str(e.value).startswith(f"--out_dir {out} holds an FSDP2 checkpoint ({out / name}): continue that "
                                       f"run with torchrun --standalone --nproc_per_node N train.py <that run's "
                                       f"flags> --fsdp --resume (N dividing its --grad_accum)") \
            if name != "ckpt.tmp" else str(e.value).startswith(
            f"--out_dir {out} holds only {out / name}, an FSDP2 checkpoint whose writing did not finish (the run "
            f"stopped before its first checkpoint was complete): nothing to resume; start over with --overwrite")
        assert "\n" not in str(e.value) and not (out / "ckpt.pt").exists() and not (out / "log.jsonl").exists()
        if name == "ckpt.tmp":   # what --fsdp --resume then finds
            with pytest.raises(RunError, match=r"no checkpoint at .*ckpt \(only .*ckpt.tmp, whose writing "):
                load_checkpoint(str(out / "ckpt"))
        os.rmdir(out / name)
    for name in ("ckpt", "ckpt.old"):
        os.makedirs(out / name)
        (out / name / "train.json").write_text("{}")
    train.main(args + ["--overwrite"])
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"]
    _as_fsdp_rank(monkeypatch)   # the mirror: an --fsdp run into a folder holding ckpt.pt
    with pytest.raises(RunError) as e:
        train.main(args + ["--fsdp"])
    assert str(e.value).startswith(f"--out_dir {out} holds a plain checkpoint ({out / 'ckpt.pt'}): continue that "
                                   f"run with python train.py <that run's flags> --resume, without --fsdp")


def test_resume_names_the_other_checkpoint_kind_and_takes_an_out_dir(corpus, tmp_path, monkeypatch):
    """--resume finding only the other kind says which kind the folder holds and how to resume it,
    before any data or model; --resume OUT_DIR (a run's folder) resumes its ckpt.pt."""
    out = tmp_path / "o"
    args = base_args(corpus, out, "--eval_interval", "2")
    train.main(args + ["--max_iters", "2"])
    s = train.main(args + ["--max_iters", "3", "--resume", str(out)])
    assert s["start_iter"] == 2 and s["iters"] == 3
    fsdp_only = tmp_path / "f"
    os.makedirs(fsdp_only / "ckpt")
    for resume in (["--resume"], ["--resume", str(fsdp_only)], ["--resume", str(fsdp_only / "ckpt")]):
        with pytest.raises(RunError) as e:
            train.main(base_args(corpus, fsdp_only, *resume))
        given = "" if len(resume) == 1 else " " + re.escape(str(fsdp_only / "ckpt"))   # a given path stays
        assert re.fullmatch(f"--resume: {re.escape(str(fsdp_only))}.* an FSDP2 checkpoint.*not a plain one: resume "
                            f"it with torchrun --standalone --nproc_per_node N train.py <that run's flags> --fsdp "
                            f"--resume{given} \\(N dividing its --grad_accum\\)", str(e.value))
    _as_fsdp_rank(monkeypatch)
    for resume in (["--resume"], ["--resume", str(out / "ckpt.pt")]):
        with pytest.raises(RunError) as e:
            train.main(args + ["--fsdp", *resume])
        given = "" if len(resume) == 1 else " " + re.escape(str(out / "ckpt.pt"))
        assert re.fullmatch(f"--resume: {re.escape(str(out))}.* a plain checkpoint.*not an FSDP2 \\(--fsdp\\) one: "
                            f"resume it with python train.py <that run's flags> --resume{given}, without --fsdp .*",
                            str(e.value))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # DCP in this one process: intended
def test_corrupt_fsdp_checkpoint_folder_is_a_one_line_error(tmp_path):
    """A DCP folder with its .metadata or a .distcp file deleted, truncated or garbled is a RunError
    of one line naming the folder and the file, from load_checkpoint (before any model is built)
    or, for what the file checks cannot see, from the DCP load in resume."""
    import shutil

    import torch.distributed.checkpoint as dcp
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    folder = str(tmp_path / "ckpt")
    meta = {"format": CKPT_FORMAT, "iter_num": 1, "best_val_loss": 1.0, "config": {}}

    def write():
        shutil.rmtree(folder, ignore_errors=True)
        dcp.save(dcp_state(model, opt, {"torch": torch.get_rng_state()}), checkpoint_id=folder)
        open(os.path.join(folder, "train.json"), "w").write(json.dumps(meta))
        return os.path.join(folder, "__0_0.distcp")

    shard = write()
    args = argparse.Namespace(fsdp=True, resume=folder, max_iters=None)
    assert train.resume(args, load_checkpoint(folder), model, opt, "cpu") == (1, 1.0)
    size = os.path.getsize(shard)
    for damage, words in [(lambda: os.remove(os.path.join(folder, ".metadata")), ".metadata is missing"),
                          (lambda: open(os.path.join(folder, ".metadata"), "wb").write(b"x"), ".metadata: "),
                          (lambda: os.remove(shard), "__0_0.distcp is missing"),
                          (lambda: os.truncate(shard, size - 1), f"__0_0.distcp has {size - 1} bytes")]:
        shard = write()
        damage()
        with pytest.raises(RunError) as e:
            load_checkpoint(folder)
        assert str(e.value).startswith(f"--resume: checkpoint {folder} cannot be read (corrupt or truncated?): ")
        assert words in str(e.value) and "\n" not in str(e.value)
    shard = write()   # same size, wrong bytes: only the load itself sees it
    with open(shard, "r+b") as f:
        f.write(b"\0" * size)
    with pytest.raises(RunError) as e:
        train.resume(args, load_checkpoint(folder), model, opt, "cpu")
    assert str(e.value).startswith(f"--resume: checkpoint {folder} cannot be read") and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# a new user's first runs: what the set-up installs, what the start-up lines say (issue 46)

def test_requirements_install_what_the_readme_set_up_promises():
    """README's set-up is `pip install -r requirements.txt`, after which a run writes loss.png: the
    packages train.py's default run imports, and matplotlib, are requirements, not comments."""
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        names = [re.split(r"[<>=~!\s\[]", line.split("#")[0].strip())[0] for line in f]
    assert {"torch", "triton", "numpy", "tqdm", "tiktoken", "matplotlib"} <= set(names)


def test_capturable_on_cpu_says_it_changes_nothing(capsys):
    p = build_parser()
    resolve_args(p.parse_args(["--optim", "zipsr", "--capturable"]), p, False)
    assert "note: --capturable changes nothing on CPU" in capsys.readouterr().out
    resolve_args(p.parse_args(["--optim", "zipsr", "--capturable", "--tokenizer", "byte"]), p, True)   # CUDA
    assert "--capturable" not in capsys.readouterr().out


def test_compile_on_cpu_says_what_it_costs_and_a_second_ctrl_c_stops_it(corpus, tmp_path, capsys):
    """--compile on CPU says at start-up that the first step compiles for minutes and how to stop
    at once; during a cold compile the first SIGINT waits for the step, the second ends the run."""
    p = build_parser()
    resolve_args(p.parse_args(["--compile", "--method", "gaussws"]), p, False)
    said = capsys.readouterr().out
    assert "note: --compile on CPU: the first step compiles for minutes (longer with PQT)" in said
    assert "a second one (2 s or more later) stops at once" in said
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))  # cold
    flags = base_args(corpus, tmp_path / "o", "--compile", "--method", "gaussws", "--max_iters", "5", "--threads", "1")
    run = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *flags], cwd=str(tmp_path), env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in run.stdout:   # the eval before step 0 is done: the loop runs, step 0 compiles
            if "step 0: val loss" in line:
                break
        time.sleep(0.5)
        run.send_signal(signal.SIGINT)
        time.sleep(Interrupts.ECHO_S + 0.5)
        assert run.poll() is None                     # the first signal waits for step 0, still compiling
        run.send_signal(signal.SIGINT)
        rc = run.wait(timeout=30)
    finally:
        run.kill()
    said = run.stdout.read()
    assert rc == 130 and "SIGINT again: exiting now" in said, said
    assert not os.path.exists(tmp_path / "o" / "ckpt.pt")


def test_startup_line_and_summary_name_what_trains(corpus, tmp_path, capsys):
    """--method bf16 names no dtype: on CPU the run trains float32 weights without autocast, and
    the start-up line and the log's summary say so (weights_dtype, autocast_dtype, pqt)."""
    s = train.main(base_args(corpus, tmp_path / "o", "--max_iters", "1"))
    assert (s["method"], s["weights_dtype"], s["autocast_dtype"], s["pqt"]) == ("bf16", "float32", None, None)
    assert read_log(tmp_path / "o")[-1] == s
    assert ("device cpu x1: float32 weights, no autocast (math in float32), no PQT (--method bf16 names no "
            "dtype: --dtype bfloat16 for BF16 autocast), compile off") in capsys.readouterr().out
    s = train.main(base_args(corpus, tmp_path / "p", "--max_iters", "1", "--method", "diffq", "--dtype", "bfloat16",
                             "--param_dtype", "bf16"))
    assert (s["weights_dtype"], s["autocast_dtype"], s["pqt"]) == ("bfloat16", "bfloat16", "diffq[all]")
    assert "device cpu x1: bfloat16 weights, bfloat16 autocast, PQT diffq[all], compile off" in capsys.readouterr().out


def test_resume_without_max_iters_keeps_the_run_s_length(corpus, tmp_path, capsys):
    """--resume without --max_iters (or --tokens_per_param) trains to the checkpoint's run's end,
    with its schedule: the same log as the uninterrupted run (it went on to the device's default
    length with a recomputed schedule); a --stop_after beyond that end is a one-line error."""
    out, whole = tmp_path / "o", tmp_path / "w"
    train.main(base_args(corpus, out, "--max_iters", "8", "--eval_interval", "4", "--stop_after", "4"))
    with pytest.raises(RunError, match="--stop_after 10: must be <= --max_iters 8 \\(the checkpoint's run\\)"):
        train.main(base_args(corpus, out, "--eval_interval", "4", "--stop_after", "10", "--resume"))
    s = train.main(base_args(corpus, out, "--eval_interval", "4", "--resume"))
    want = train.main(base_args(corpus, whole, "--max_iters", "8", "--eval_interval", "4"))
    assert s["iters"] == s["max_iters"] == 8 and s["final_val_loss"] == want["final_val_loss"]
    steps = lambda d: [(r["iter"], r["loss"], r["lr"]) for r in read_log(d) if r["type"] == "step"]  # noqa: E731
    assert steps(out) == steps(whole)
