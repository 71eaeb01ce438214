"""Tests for model.py, data.py and train.py (draft; merged into test_all.py by the lead).

Everything runs on CPU in-process on the `nano` presets (a few 10k parameters) and a corpus cut
from the Python standard library's own source, so the file needs no network and no GPU."""

import argparse
import gzip
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", "shared", "tiktoken_cache"))

import data as datamod  # noqa: E402
import train  # noqa: E402
from model import GPT, PRESETS, preset_config  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The nano models are launch-bound: one intra-op thread is as fast as two and does not
    collapse when another process holds the second core (OpenMP threads spin-waiting)."""
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


def base_args(corpus, out_dir, *extra):
    text, data_dir = corpus
    return ["--preset", "nano", "--dataset", text, "--data_dir", data_dir, "--tokenizer", "byte",
            "--batch_size", "4", "--eval_windows", "8", "--no-plot", "--out_dir", str(out_dir), *extra]


def read_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------- model

@pytest.mark.parametrize("preset", ["nano", "nano-llama"])
def test_model_parts_names_and_shapes(preset):
    cfg = preset_config(preset, vocab_size=256)
    model = GPT(cfg)
    block = model.blocks[0]
    expected = ["qkv", "out", "up", "down"] if preset == "nano" else ["q", "k", "v", "out", "gate", "up", "down"]
    assert cfg.parts == expected
    for part in expected:
        owner = block.attn if part in ("q", "k", "v", "qkv", "out") else block.mlp
        assert isinstance(getattr(owner, part), torch.nn.Linear)
    if preset == "nano-llama":  # GQA: k/v project to n_kv_head heads
        assert block.attn.k.out_features == cfg.n_kv_head * cfg.n_embd // cfg.n_head
        assert model.lm_head.weight is not model.wte.weight
    else:
        assert model.lm_head.weight is model.wte.weight
    logits, loss = model(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))
    assert logits.shape == (2, 16, 256)
    # at init the model is close to uniform over the vocabulary: loss ~ ln(256) = 5.545
    assert abs(loss.item() - math.log(256)) < 0.1


def test_paper_sizes():
    # SPEC "Sizes that match the papers": counted with the papers' vocabularies
    def count(name, vocab):
        with torch.device("meta"):
            return GPT(preset_config(name, vocab_size=vocab)).num_params()
    assert round(count("llama-134m", 32000) / 1e6) == 134
    assert round(count("gpt-162m", 50304) / 1e6) == 162
    assert round(count("gpt2-124m", 50304) / 1e6) == 124


def test_causal_rope_model():
    # the output at position t must not depend on tokens after t
    torch.manual_seed(0)
    model = GPT(preset_config("nano-llama", vocab_size=256)).eval()
    x = torch.randint(0, 256, (1, 20))
    x2 = x.clone()
    x2[0, 10:] = (x2[0, 10:] + 1) % 256
    a, _ = model(x, x)
    b, _ = model(x2, x2)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-5)
    assert not torch.allclose(a[0, 10:], b[0, 10:], atol=1e-3)


# ----------------------------------------------------------------------------- data

def test_prepare_byte_split_and_cache(tmp_path):
    text = "hello world\n" * 100 + "caf\u00e9 \u2603\n"
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    folder = datamod.prepare(str(tmp_path / "a.txt"), "byte", data_dir=str(tmp_path / "d"), verbose=False)
    meta = datamod.load_meta(folder)
    raw = text.encode("utf-8")
    n_val = int(len(raw) * 0.1)
    assert (meta["train_tokens"], meta["val_tokens"], meta["vocab_size"]) == (len(raw) - n_val, n_val, 256)
    train_ids = np.fromfile(os.path.join(folder, "train.bin"), dtype=np.uint16)
    val_ids = np.fromfile(os.path.join(folder, "val.bin"), dtype=np.uint16)
    assert bytes(np.concatenate([train_ids, val_ids]).astype(np.uint8)) == raw
    mtime = os.path.getmtime(os.path.join(folder, "meta.json"))
    assert datamod.prepare(str(tmp_path / "a.txt"), "byte", data_dir=str(tmp_path / "d"), verbose=False) == folder
    assert os.path.getmtime(os.path.join(folder, "meta.json")) == mtime  # prepared once


def test_prepare_folder_with_val_file_and_compression(tmp_path):
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "train_a.txt").write_text("alpha " * 50, encoding="utf-8")
    with gzip.open(src / "train_b.md.gz", "wt", encoding="utf-8") as f:
        f.write("beta " * 50)
    (src / "val.txt").write_text("gamma " * 20, encoding="utf-8")
    (src / "skip.bin").write_bytes(b"\x00\x01")
    folder = datamod.prepare(str(src), "byte", data_dir=str(tmp_path / "d"), verbose=False)
    meta = datamod.load_meta(folder)
    assert meta["train_tokens"] == len("alpha " * 50) + len("beta " * 50)
    assert meta["val_tokens"] == len("gamma " * 20)


def test_gpt2_chunked_encoding_matches_whole():
    tok = datamod.get_tokenizer("gpt2", verbose=False)
    if tok.name != "gpt2":
        pytest.skip("tiktoken gpt2 files not available offline (set TIKTOKEN_CACHE_DIR)")
    text = open(argparse.__file__, encoding="utf-8").read()
    pieces = datamod.split_chunks(text, size=2000)
    assert len(pieces) > 10 and "".join(pieces) == text
    ids = datamod.tokenize_docs([text], tok, procs=1)
    assert ids[-1] == tok.eot
    assert ids[:-1].tolist() == tok.enc.encode(text, allowed_special={"<|endoftext|>"})


def test_unknown_dataset_and_tokenizer():
    with pytest.raises(ValueError, match="--dataset"):
        datamod.check_dataset_arg("/no/such/path")
    with pytest.raises(ValueError, match="gpt2, byte"):
        datamod.get_tokenizer("bpe")


def test_batches_deterministic_and_fixed_val_windows(corpus, tmp_path):
    folder = datamod.prepare(corpus[0], "byte", data_dir=corpus[1], verbose=False)
    b = datamod.Batches(folder, block_size=16, seed=3)
    x1, y1 = b.train_batch(5, step=7, micro=1)
    x2, y2 = b.train_batch(5, step=7, micro=1)
    x3, _ = b.train_batch(5, step=7, micro=0)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and not torch.equal(x1, x3)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one
    # validation: the same windows whatever the batch size or the number of ranks
    ref = torch.cat([x for x, _ in b.val_batches(24, batch_size=24)])
    assert ref.shape == (24, 16)
    for bs in (1, 5, 7):
        assert torch.equal(torch.cat([x for x, _ in b.val_batches(24, batch_size=bs)]), ref)
    r0 = torch.cat([x for x, _ in b.val_batches(24, 4, rank=0, world=2)])
    r1 = torch.cat([x for x, _ in b.val_batches(24, 4, rank=1, world=2)])
    assert sorted(map(tuple, torch.cat([r0, r1]).tolist())) == sorted(map(tuple, ref.tolist()))
    starts = b.val_starts(24)
    assert starts[0] == 0 and starts[-1] == b.n["val"] - 17


# ----------------------------------------------------------------------------- schedule

def test_wsd_schedule_endpoints():
    lr, T = 1.0, 100  # 10 warmup steps, 80 constant, 10 cooldown steps
    f = lambda it: train.get_lr(it, T, lr, "wsd")  # noqa: E731
    assert f(0) == pytest.approx(0.1) and f(4) == pytest.approx(0.5) and f(9) == pytest.approx(1.0)
    assert all(f(it) == 1.0 for it in range(10, 91))      # constant, including the first cooldown step
    assert f(95) == pytest.approx(1 - math.sqrt(0.5))      # 1 - sqrt(u), u = 5/10
    assert f(99) == pytest.approx(1 - math.sqrt(0.9))
    assert f(100) == 0.0
    assert all(f(it) > f(it + 1) for it in range(90, 100))


def test_cosine_and_constant_schedules():
    T = 100
    assert train.get_lr(10, T, 1.0, "cosine") == pytest.approx(1.0)
    assert train.get_lr(55, T, 1.0, "cosine") == pytest.approx(0.1 + 0.9 * 0.5)   # halfway: mean of peak and floor
    assert train.get_lr(100, T, 1.0, "cosine") == pytest.approx(0.1)
    assert train.get_lr(5, T, 1.0, "constant") == pytest.approx(0.6)
    assert train.get_lr(99, T, 1.0, "constant") == 1.0


# ----------------------------------------------------------------------------- flags

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
])
def test_bad_flags_one_line_error(flags, words, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--preset", "nano", *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("train.py: error:")
    for w in words:
        assert w in err


def test_batch_larger_than_data(corpus, tmp_path):
    with pytest.raises(train.RunError, match="--batch_size"):
        train.main(base_args(corpus, tmp_path / "o", "--batch_size", "5000", "--max_iters", "2"))


# ----------------------------------------------------------------------------- training runs

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
    with pytest.raises(train.RunError, match=r"--lr 0\.003 \(checkpoint\) vs 0\.001"):
        train.main(args + ["--lr", "1e-3", "--resume"])
    bad = tmp_path / "broken.pt"
    raw = (tmp_path / "o" / "ckpt.pt").read_bytes()
    bad.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(train.RunError, match="corrupt or truncated"):
        train.main(args + ["--resume", str(bad)])
    with pytest.raises(train.RunError, match="no checkpoint"):
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
    with pytest.raises(train.RunError, match=r"step 7: training diverged.*step 5\) is left intact"):
        train.main(base_args(corpus, out, "--max_iters", "20", "--eval_interval", "5"))
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 5
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values() if v.is_floating_point())
    assert not (out / "ckpt.pt.tmp").exists()
    assert read_log(out)[-1]["type"] == "error"


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    train.save_checkpoint(path, {"format": train.CKPT_FORMAT, "x": torch.arange(5)})
    before = open(path, "rb").read()

    def crashing_save(obj, f):
        f.write(b"partial garbage")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crashing_save)
    with pytest.raises(OSError):
        train.save_checkpoint(path, {"format": train.CKPT_FORMAT, "x": torch.arange(9)})
    assert open(path, "rb").read() == before
    assert torch.equal(train.load_checkpoint(path)["x"], torch.arange(5))


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


def test_adam_mini_missing_or_runs(corpus, tmp_path):
    try:
        import adam_mini  # noqa: F401
    except ImportError:
        with pytest.raises(train.RunError, match="pip install adam-mini"):
            train.main(base_args(corpus, tmp_path / "o", "--optim", "adam-mini", "--max_iters", "2"))
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


def test_ddp_two_processes_match_one_process_with_accumulation(corpus, tmp_path):
    # torchrun with 2 CPU processes (gloo) and --grad_accum 2 reads the same micro-batches as one
    # process with --grad_accum 2, so the per-step losses agree up to float summation order
    common = base_args(corpus, tmp_path / "x", "--max_iters", "6", "--eval_interval", "6",
                       "--grad_accum", "2", "--seed", "1")
    one = tmp_path / "one"
    two = tmp_path / "two"
    train.main([a if a != str(tmp_path / "x") else str(one) for a in common])
    env = dict(os.environ, OMP_NUM_THREADS="1")  # two processes on two cores
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py"),
           *[a if a != str(tmp_path / "x") else str(two) for a in common]]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    l1 = [r["loss"] for r in read_log(one) if r["type"] == "step"]
    l2 = [r["loss"] for r in read_log(two) if r["type"] == "step"]
    assert len(l1) == len(l2) == 6
    assert np.allclose(l1, l2, rtol=0, atol=1e-4)
    v1 = [r["val_loss"] for r in read_log(one) if r["type"] == "eval"]
    v2 = [r["val_loss"] for r in read_log(two) if r["type"] == "eval"]
    assert np.allclose(v1, v2, atol=1e-4)
