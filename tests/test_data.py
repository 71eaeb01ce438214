"""data.py: preparing a corpus (splits, the cache, edited sources, concurrent preparations and their
lock, refused files), tokenizers, batches."""
import argparse
import gzip
import json
import multiprocessing
import os
import time

import numpy as np
import pytest
import torch

import data as datamod
import train
from lowbit import runlock
from trainer.flags import build_parser, resolve_args
from trainer.util import RunError

from tests.helpers import ROOT, hold_lock_then


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
    tok = datamod.get_tokenizer("auto", verbose=False)
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


def _prepare_in_child(args, q):
    try:
        q.put(("ok", datamod.prepare(*args, verbose=False)))
    except Exception as e:  # reported to the parent, which asserts on it
        q.put(("error", repr(e)))


def test_concurrent_preparations_of_one_corpus_wait_for_each_other(tmp_path):
    # a sweep started together: every run asks for the same new corpus at once
    src, dd = tmp_path / "src", str(tmp_path / "d")
    src.mkdir()
    words = np.array(["alpha", "beta", "gamma", "delta", "\n"])
    text = " ".join(words[np.random.default_rng(0).integers(0, 5, 400_000)])
    (src / "a.txt").write_text(text, encoding="utf-8")
    out = os.path.join(dd, datamod.dataset_name(str(src), "byte"))
    os.makedirs(out)
    open(os.path.join(out, "train.bin.tmp12345"), "wb").write(b"\0" * 10)  # a preparation killed part-way
    busy = runlock.FileLock(out + ".lock")
    busy.acquire()              # a process preparing it right now
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_prepare_in_child, args=((str(src), "byte", dd), q)) for _ in range(3)]
    for p in procs:
        p.start()
    time.sleep(1.0)
    assert all(p.is_alive() for p in procs)          # all three wait for the holder ...
    assert not os.path.exists(os.path.join(out, "train.bin"))   # ... and write nothing meanwhile
    busy.release()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join()
    assert results == [("ok", out)] * 3
    meta = datamod.load_meta(out)
    assert meta["train_tokens"] + meta["val_tokens"] == len(text.encode())
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]   # no temporary file left


def test_batches_keep_reading_the_corpus_they_started_with(tmp_path):
    src, dd = tmp_path / "src", str(tmp_path / "d")
    src.mkdir()
    (src / "a.txt").write_text("alpha beta\n" * 400, encoding="utf-8")
    folder = datamod.prepare(str(src), "byte", data_dir=dd, verbose=False)
    b = datamod.Batches(folder, block_size=16, seed=0)
    x, _ = b.train_batch(4, step=0)
    (src / "a.txt").write_text("gamma delta epsilon\n" * 900, encoding="utf-8")   # edited: prepared again
    assert datamod.prepare(str(src), "byte", data_dir=dd, verbose=False) == folder
    assert datamod.load_meta(folder)["train_tokens"] > b.n["train"]
    assert torch.equal(b.train_batch(4, step=0)[0], x)       # the running reader is not switched mid-run
    assert not torch.equal(datamod.Batches(folder, 16, seed=0).train_batch(4, step=0)[0], x)


def test_runlock_names_a_live_holder_and_reports_a_killed_one(tmp_path):
    path = str(tmp_path / "x.lock")
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    live = ctx.Process(target=hold_lock_then, args=(path, "sleep", child))
    live.start()
    assert parent.poll(60)
    pid = parent.recv()
    with pytest.raises(runlock.Locked, match=f"pid {pid} on "):
        runlock.FileLock(path).acquire(wait=False)
    live.kill()
    live.join()
    killed = ctx.Process(target=hold_lock_then, args=(path, "kill", child))
    killed.start()
    assert parent.poll(60)
    pid = parent.recv()
    killed.join()
    lock = runlock.FileLock(path)
    stale = lock.acquire(wait=False)           # not a hang: the kernel released the killed holder's lock
    assert stale["pid"] == pid                 # and its note says who it was
    lock.release()
    assert not os.path.exists(path)            # a clean release removes the file
    assert runlock.FileLock(path).acquire(wait=False) is None   # and leaves no note


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


def test_explicit_gpt2_that_cannot_load_is_an_error_auto_falls_back(tmp_path, monkeypatch, capsys):
    # offline without the tokenizer files: an empty cache, the download fails, nothing loaded yet
    import tiktoken.load
    import tiktoken.registry

    def offline(*a, **k):
        raise ConnectionError("no network")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty_cache"))
    monkeypatch.setattr(tiktoken.load, "read_file", offline)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    (tmp_path / "a.txt").write_text("hello world\n" * 200, encoding="utf-8")
    with pytest.raises(RuntimeError) as e:
        datamod.prepare(str(tmp_path / "a.txt"), "gpt2", data_dir=str(tmp_path / "d"), verbose=False)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and msg.startswith("--tokenizer gpt2: cannot load")
    assert "ConnectionError: no network" in msg and "TIKTOKEN_CACHE_DIR" in msg and "--tokenizer byte" in msg
    with pytest.raises(RunError, match="^--tokenizer gpt2: cannot load"):
        train.main(["--preset", "nano", "--dataset", str(tmp_path / "a.txt"), "--data_dir", str(tmp_path / "d"),
                    "--tokenizer", "gpt2", "--no-plot", "--out_dir", str(tmp_path / "o")])
    assert not os.path.exists(tmp_path / "d")
    capsys.readouterr()
    assert datamod.get_tokenizer("auto").name == "byte"           # the default may fall back, and says so
    assert "falling back to the byte tokenizer" in capsys.readouterr().err
    p = build_parser()
    args = resolve_args(p.parse_args(["--preset", "nano"]), p, cuda=True)   # auto = gpt2 on CUDA
    assert args.tokenizer == "byte" and "falling back" in capsys.readouterr().err


def test_preparation_is_announced_before_it_starts(tmp_path, capsys, monkeypatch):
    (tmp_path / "a.txt").write_text("hello world\n" * 200, encoding="utf-8")
    printed_before_tokenizing = []
    tokenize = datamod.tokenize_docs

    def spy(*a, **k):
        printed_before_tokenizing.append(capsys.readouterr().out)
        return tokenize(*a, **k)
    monkeypatch.setattr(datamod, "tokenize_docs", spy)
    folder = datamod.prepare(str(tmp_path / "a.txt"), "byte", data_dir=str(tmp_path / "d"))
    assert f"[data] preparing {folder} from {tmp_path / 'a.txt'} (byte tokenizer" in printed_before_tokenizing[0]
    capsys.readouterr()
    assert datamod.prepare(str(tmp_path / "a.txt"), "byte", data_dir=str(tmp_path / "d")) == folder
    assert "preparing" not in capsys.readouterr().out               # a prepared dataset is reused quietly


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
    assert "named val, valid or validation (val.txt, val_00.txt, ...), otherwise the last 10% of the tokens" \
        in help_text


def test_validation_files_are_named_val_not_any_val_prefix(tmp_path, capsys):
    """A folder's val.txt / val_1.txt / valid-2.txt are the validation split, and the run says
    which; values.py or validators.py are training text; a single file named val.txt is split
    like any file (its last 10 %)."""
    src = tmp_path / "code"
    src.mkdir()
    for name in ("a.txt", "values.py", "validators.py"):
        (src / name).write_text(f"{name} alpha beta\n" * 100, encoding="utf-8")
    folder = datamod.prepare(str(src), "byte", data_dir=str(tmp_path / "d"))
    assert "no validation file" in capsys.readouterr().out
    assert datamod.load_meta(folder)["val_split"] == "last 10 %"
    for name in ("val_1.txt", "valid-2.txt"):
        (src / name).write_text("gamma\n" * 10, encoding="utf-8")
    folder = datamod.prepare(str(src), "byte", data_dir=str(tmp_path / "d2"))
    out = capsys.readouterr().out
    assert "validation split: 2 file(s)" in out and "val_1.txt" in out and "valid-2.txt" in out
    assert datamod.load_meta(folder)["val_tokens"] == 2 * 60            # both files, 10 lines of 6 bytes each
    single = tmp_path / "val.txt"
    single.write_text("delta epsilon\n" * 100, encoding="utf-8")
    folder = datamod.prepare(str(single), "byte", data_dir=str(tmp_path / "d3"))
    assert datamod.load_meta(folder)["val_split"] == "last 10 %"


_SLOW_TOKENIZING = """
import sys, time
import numpy as np
import data
def slow(i):                     # a worker busy with its piece when Ctrl-C comes
    time.sleep(0.3)
    return np.zeros(1, dtype=np.uint32)
data._encode_piece = slow        # forked workers inherit it
print("ready", flush=True)
data.tokenize_docs(["x\\ny" * (9 << 20)], data.get_tokenizer("byte", verbose=False), procs=2)
"""


def test_ctrl_c_while_tokenizing_with_workers_exits():
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while a large corpus is
    tokenized by worker processes: the run exits within seconds with one line saying nothing was
    written. (Workers killed by it used to leave the parent waiting for their pieces for good.)"""
    import signal
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_TOKENIZING], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.5)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("still running 30 s after Ctrl-C")
    assert proc.returncode != 0
    assert "interrupted while tokenizing: nothing was written" in err, err[-500:]
