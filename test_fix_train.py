"""
Draft tests (to merge into test_all.py, trainer section) for the fixes in data.py / train.py:
the prepared-data cache identity (--max_tokens, edited sources), flag checks before any data or
model is built, resume of a finished run and whole-run val loss, one-line checkpoint errors,
refusal of binary files and the announced 10 % validation tail. CPU, nano presets, seconds.
"""
import argparse
import gzip
import json
import os

os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                         "..", "shared", "tiktoken_cache"))

import numpy as np
import pytest
import torch

import data as datamod
import train


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


def base_args(corpus, out_dir, *extra):
    text, data_dir = corpus
    return ["--preset", "nano", "--dataset", text, "--data_dir", data_dir, "--tokenizer", "byte",
            "--batch_size", "4", "--eval_windows", "8", "--no-plot", "--out_dir", str(out_dir), *extra]


def read_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------- data cache identity

def test_max_tokens_is_part_of_the_cache_identity(tmp_path):
    text = open(argparse.__file__, encoding="utf-8").read()
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    n = len(text.encode("utf-8"))
    n_train = n - int(n * 0.1)
    src, dd = str(tmp_path / "a.txt"), str(tmp_path / "d")
    capped = datamod.prepare(src, "byte", data_dir=dd, max_tokens=5000, verbose=False)
    full = datamod.prepare(src, "byte", data_dir=dd, verbose=False)   # a later run without the cap
    assert capped != full and capped.endswith("-max5000")
    assert datamod.load_meta(capped)["train_tokens"] == 5000 and datamod.load_meta(capped)["max_tokens"] == 5000
    assert datamod.load_meta(full)["train_tokens"] == n_train and datamod.load_meta(full)["max_tokens"] is None
    assert os.path.getsize(os.path.join(full, "train.bin")) == 2 * n_train   # uint16 tokens
    # a folder left by an older data.py under the uncapped name, holding capped data and no record
    # of the cap or the sources, is prepared again instead of being used
    meta = datamod.load_meta(full)
    np.fromfile(os.path.join(capped, "train.bin"), dtype=np.uint16).tofile(os.path.join(full, "train.bin"))
    old = {k: v for k, v in meta.items() if k not in ("max_tokens", "source_files")}
    with open(os.path.join(full, "meta.json"), "w") as f:
        json.dump(dict(old, train_tokens=5000), f)
    assert datamod.prepare(src, "byte", data_dir=dd, verbose=False) == full
    assert datamod.load_meta(full)["train_tokens"] == n_train
    assert os.path.getsize(os.path.join(full, "train.bin")) == 2 * n_train
    # a prepared folder given directly is used as it is, but not with another cap
    assert datamod.prepare(capped, "byte", max_tokens=5000, verbose=False) == capped
    with pytest.raises(ValueError, match="--max_tokens 4000.*cap 5000"):
        datamod.prepare(capped, "byte", max_tokens=4000, verbose=False)
    for bad in (0, -5, 2.5):
        with pytest.raises(ValueError, match="--max_tokens"):
            datamod.prepare(src, "byte", data_dir=dd, max_tokens=bad, verbose=False)


def test_edited_or_renamed_source_is_prepared_again(tmp_path, capsys):
    src, dd = tmp_path / "src", str(tmp_path / "d")
    src.mkdir()
    (src / "a.txt").write_text("alpha " * 100, encoding="utf-8")
    (src / "b.txt").write_text("beta " * 40, encoding="utf-8")
    folder = datamod.prepare(str(src), "byte", data_dir=dd, verbose=False)
    assert datamod.load_meta(folder)["train_tokens"] + datamod.load_meta(folder)["val_tokens"] == 800
    # edit: more text (and a newer mtime)
    with open(src / "a.txt", "a", encoding="utf-8") as f:
        f.write("gamma " * 10)
    st = os.stat(src / "a.txt")
    os.utime(src / "a.txt", (st.st_atime, st.st_mtime + 10))
    capsys.readouterr()
    assert datamod.prepare(str(src), "byte", data_dir=dd) == folder
    assert "source files changed" in capsys.readouterr().out
    meta = datamod.load_meta(folder)
    assert meta["train_tokens"] + meta["val_tokens"] == 860
    # rename (same bytes, same mtime): b.txt becomes the validation split
    os.rename(src / "b.txt", src / "val_b.txt")
    datamod.prepare(str(src), "byte", data_dir=dd, verbose=False)
    meta = datamod.load_meta(folder)
    assert (meta["train_tokens"], meta["val_tokens"]) == (660, 200)
    # unchanged sources: reused, not rewritten
    mtime = os.path.getmtime(os.path.join(folder, "meta.json"))
    datamod.prepare(str(src), "byte", data_dir=dd, verbose=False)
    assert os.path.getmtime(os.path.join(folder, "meta.json")) == mtime


def test_resume_with_another_max_tokens_is_refused(corpus, tmp_path):
    args = base_args(corpus, tmp_path / "o", "--max_iters", "2", "--eval_interval", "2")
    train.main(args + ["--max_tokens", "5000"])
    with pytest.raises(train.RunError, match=r"--max_tokens 5000 \(checkpoint\) vs None"):
        train.main(args + ["--resume"])


# ----------------------------------------------------------------------------- flags

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
    (["--b_init", "30"], ["--b_init 30", "(0, 24)"]),
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


def test_edge_flag_values_are_accepted():
    p = train.build_parser()
    args = p.parse_args(["--preset", "nano", "--beta1", "0", "--grad_clip", "0", "--warmup_frac", "0",
                         "--cooldown_frac", "1", "--min_lr_frac", "1", "--b_init", "23.5", "--b_target", "0.5",
                         "--bits_wd", "0", "--weight_decay", "0", "--eval_windows", "0",
                         "--max_iters", "7", "--stop_after", "7"])
    train.resolve_args(args, p, cuda=False)
    assert (args.max_iters, args.stop_after, args.eval_windows) == (7, 7, 0)
    args = p.parse_args(["--preset", "nano", "--tokens_per_param", "0.5"])
    train.resolve_args(args, p, cuda=False)
    assert args.max_iters is None        # set from the parameter count once the model exists
    args = p.parse_args(["--preset", "nano"])
    train.resolve_args(args, p, cuda=False)
    assert args.max_iters == 300 and args.eval_windows is None   # CPU default; windows capped later


def test_eval_windows_limited_by_the_val_split(tmp_path, capsys):
    text = open(argparse.__file__, encoding="utf-8").read()[:30000]
    (tmp_path / "small.txt").write_text(text, encoding="utf-8")
    common = ["--preset", "nano", "--dataset", str(tmp_path / "small.txt"), "--data_dir", str(tmp_path / "d"),
              "--tokenizer", "byte", "--batch_size", "4", "--no-plot", "--max_iters", "2"]
    n_val = int(len(text.encode("utf-8")) * 0.1)
    fit = (n_val - 1) // 64                       # non-overlapping windows of the nano block (64)
    assert fit < 64                               # so the CPU default of 64 does not fit
    with pytest.raises(train.RunError, match=f"--eval_windows {fit + 1}: .* at most {fit} .*<= {fit}"):
        train.main(common + ["--out_dir", str(tmp_path / "a"), "--eval_windows", str(fit + 1)])
    capsys.readouterr()
    s = train.main(common + ["--out_dir", str(tmp_path / "b")])   # auto: capped, with a message
    assert f"eval on {fit} windows" in capsys.readouterr().out
    assert s["final_val_loss"] is not None
    assert torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)["config"]["eval_windows"] == fit


def test_stop_after_beyond_tokens_per_param_steps(corpus, tmp_path):
    # max_iters from --tokens_per_param is only known once the model is built
    with pytest.raises(train.RunError, match=r"--stop_after 1000: must be <= max_iters \d+ \(from --tokens_per_param"):
        train.main(base_args(corpus, tmp_path / "o", "--tokens_per_param", "0.01", "--stop_after", "1000"))


# ----------------------------------------------------------------------------- resume

def test_resume_covers_the_whole_run_and_a_finished_run_is_left_alone(corpus, tmp_path, capsys):
    out = tmp_path / "o"
    args = base_args(corpus, out, "--max_iters", "8", "--eval_interval", "4")
    train.main(args + ["--stop_after", "4"])
    first = [r for r in read_log(out) if r["type"] == "eval"][0]
    assert first["iter"] == 0
    # asking again for the same --stop_after: nothing to do, the log stays
    before = (out / "log.jsonl").read_bytes()
    capsys.readouterr()
    train.main(args + ["--stop_after", "4", "--resume"])
    assert "already at --stop_after 4" in capsys.readouterr().out
    assert (out / "log.jsonl").read_bytes() == before
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
    assert "the run is finished" in capsys.readouterr().out
    assert again == log[-1] and again["final_val_loss"] == evals[-1]["val_loss"]
    assert (out / "log.jsonl").read_bytes() == before and (out / "ckpt.pt").read_bytes() == ckpt_before


class _NotATensor:
    pass


def test_unreadable_checkpoint_is_one_clear_line(tmp_path):
    good = tmp_path / "good.pt"
    train.save_checkpoint(str(good), {"format": train.CKPT_FORMAT, "x": torch.arange(1000)})
    # (where the cut lands decides which error torch.load gives; each must come out as one line)
    raw = good.read_bytes()
    (tmp_path / "half.pt").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "empty.pt").write_bytes(b"")
    torch.save({"format": train.CKPT_FORMAT, "x": _NotATensor()}, tmp_path / "pickled.pt")
    for name, reason in (("half.pt", "?): "), ("empty.pt", "the file is empty"), ("pickled.pt", "_NotATensor")):
        path = str(tmp_path / name)
        with pytest.raises(train.RunError) as e:
            train.load_checkpoint(path)
        msg = str(e.value)
        assert len(msg.splitlines()) == 1 and path in msg and "corrupt or truncated" in msg and reason in msg
        assert "weights_only" not in msg and "Weights only load failed" not in msg


# ----------------------------------------------------------------------------- text sources

def test_binary_or_non_utf8_file_is_refused(tmp_path):
    dd = str(tmp_path / "d")
    (tmp_path / "blob").write_bytes(b"MZ\x90\x00" + bytes(range(256)) * 40)
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1") * 100)
    with gzip.open(tmp_path / "packed.txt.gz", "wb") as f:
        f.write(b"text\x00\x00\x00binary" * 100)
    for name, why in (("blob", "NUL byte at offset 3"), ("latin1.txt", "invalid byte 0xe9 at offset 3"),
                      ("packed.txt.gz", "NUL byte at offset 4")):
        with pytest.raises(ValueError, match=f"{name}: not .*{why}"):
            datamod.prepare(str(tmp_path / name), "byte", data_dir=dd, verbose=False)
    # a multi-byte character cut by the 8 KB sniff boundary is still text; a bad byte after it is replaced
    ok = ("a" + "\u00e9" * 5000).encode("utf-8") + b"\xff tail\n"
    assert len(ok[:8192].decode("utf-8", errors="ignore").encode()) == 8191   # the cut is mid-character
    (tmp_path / "ok.txt").write_bytes(ok)
    folder = datamod.prepare(str(tmp_path / "ok.txt"), "byte", data_dir=dd, verbose=False)
    meta = datamod.load_meta(folder)
    assert meta["train_tokens"] + meta["val_tokens"] == len(ok) + 2   # U+FFFD is 3 bytes for 1


def test_binary_file_in_train_py_is_a_one_line_error(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\x00" * 5000)
    with pytest.raises(train.RunError, match="weights.bin: not a text file"):
        train.main(["--preset", "nano", "--dataset", str(tmp_path / "weights.bin"), "--data_dir",
                    str(tmp_path / "d"), "--tokenizer", "byte", "--no-plot", "--out_dir", str(tmp_path / "o")])


def test_validation_tail_is_announced_and_documented(tmp_path, capsys):
    src = tmp_path / "books"
    src.mkdir()
    (src / "a.txt").write_text("alpha beta\n" * 100, encoding="utf-8")
    folder = datamod.prepare(str(src), "byte", data_dir=str(tmp_path / "d"))
    out = capsys.readouterr().out
    assert "no validation file" in out and "last 10 %" in out and "(110)" in out
    assert datamod.load_meta(folder)["val_split"] == "last 10 %"
    (src / "val.txt").write_text("gamma\n" * 10, encoding="utf-8")
    datamod.prepare(str(src), "byte", data_dir=str(tmp_path / "d"))
    assert "no validation file" not in capsys.readouterr().out
    assert datamod.load_meta(folder)["val_split"] == "val* files"
    with pytest.raises(SystemExit):
        train.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "named val*, otherwise the last 10% of the tokens" in help_text
