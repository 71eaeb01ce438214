"""
Tokenizers, one-time dataset preparation into data/<name>/{train,val}.bin, and batch sampling.

A prepared dataset is a folder with
    train.bin, val.bin   flat token ids, uint16 (uint32 when the vocabulary needs more than 16 bits)
    meta.json            tokenizer, vocab_size, dtype, token counts, source, and what identifies the
                         preparation: max_tokens and the source files' count/bytes/newest mtime/names
                         (written last: its presence marks a finished preparation)
The folder name carries the tokenizer and the cap (data/<name>[-byte][-max<N>]); a cached folder
whose meta.json disagrees with the request (other cap, edited source files) is prepared again.
Sources (--dataset):
    stdlib       the Python standard library's own .py files (real text on every machine, no download)
    <path>       a local text file or folder (.txt .md .py, optionally .xz/.gz compressed); in a
                 folder, files whose name starts with "val" form the validation split, otherwise
                 (and for a single file) the last 10 % of the tokens do; a folder that already
                 holds a prepared dataset (meta.json) is used as it is. Binary files are refused.
    shakespeare  tiny-shakespeare, downloaded once
    openwebtext, fineweb-edu, c4   streamed through HF `datasets` (needs the package and internet),
                 capped at --max_tokens
Batches are random windows read from a np.memmap (no memory growth on long runs); validation uses
a fixed, evenly spaced set of windows so val loss does not depend on batch size, rank or run.
"""

import codecs
import gzip
import json
import lzma
import os
import re
import signal
import sys
import sysconfig
import hashlib
import urllib.request

import numpy as np
import torch

from lowbit.runlock import FileLock, describe

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
TEXT_EXT = (".txt", ".md", ".py")
REMOTE = ("openwebtext", "fineweb-edu", "c4")
KNOWN = ("stdlib", "shakespeare") + REMOTE
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
EOT_TEXT = "<|endoftext|>"


# ----------------------------------------------------------------------------- tokenizers

class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, no special tokens, works everywhere."""
    name = "byte"
    vocab_size = 256
    eot = None

    def encode(self, text):
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.uint32)

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]

    def decode(self, ids):
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """tiktoken's "gpt2" BPE (50257 tokens, <|endoftext|> = 50256). A literal "<|endoftext|>" in
    the text (a corpus's document separator) is encoded as the special token."""
    name = "gpt2"

    def __init__(self):
        import tiktoken
        self.enc = tiktoken.get_encoding("gpt2")
        self.vocab_size = self.enc.n_vocab
        self.eot = self.enc.eot_token

    def encode(self, text):
        return self.enc.encode(text, allowed_special={EOT_TEXT})

    def encode_batch(self, texts):
        return self.enc.encode_batch(texts, allowed_special={EOT_TEXT}, num_threads=1)

    def decode(self, ids):
        return self.enc.decode([int(i) for i in ids])


def get_tokenizer(name="gpt2", verbose=True):
    """Tokenizer by name: "gpt2" (tiktoken), "byte", or "auto": gpt2 when tiktoken can load its
    files, else the byte tokenizer (saying why when verbose). Raises RuntimeError when "gpt2" was
    asked for and cannot be loaded (offline without a cache), ValueError for other names."""
    if name == "byte":
        return ByteTokenizer()
    if name not in ("gpt2", "auto"):
        raise ValueError(f"tokenizer={name!r}; allowed: gpt2, byte, auto")
    try:
        return GPT2Tokenizer()
    except Exception as e:  # ImportError, or a download error when offline
        reason = f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
        if name == "gpt2":  # an explicit choice is not replaced behind the user's back
            raise RuntimeError(f"--tokenizer gpt2: cannot load tiktoken's gpt2 files ({reason}); set "
                               f"TIKTOKEN_CACHE_DIR to a folder holding them, or use --tokenizer byte") from None
        if verbose:
            print(f"[data] could not load tiktoken 'gpt2' ({reason}); "
                  f"falling back to the byte tokenizer (vocab 256). Set TIKTOKEN_CACHE_DIR to a folder "
                  f"holding the gpt2 files, or pass --tokenizer byte to silence this.", file=sys.stderr)
        return ByteTokenizer()


# ----------------------------------------------------------------------------- reading text

def read_text(path):
    """Text (str) of a UTF-8 file, optionally .xz or .gz compressed; CRLF and CR become LF.
    Raises ValueError naming the file when it is not text: a NUL byte or invalid UTF-8 in its first
    8 KB (what a binary file shows at once). Bad bytes further on are replaced, as in a
    mostly-clean scraped corpus."""
    opener = lzma.open if path.endswith(".xz") else gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (lzma.LZMAError, EOFError, gzip.BadGzipFile) as e:
        raise ValueError(f"{path}: cannot decompress ({type(e).__name__}: {e})") from None
    head = raw[:8192]
    if b"\0" in head:
        raise ValueError(f"{path}: not a text file (NUL byte at offset {head.index(0)}); "
                         f"--dataset needs UTF-8 text (.txt .md .py, optionally .xz/.gz)")
    try:  # final=False: a character cut at the 8 KB boundary is fine
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (invalid byte 0x{head[e.start]:02x} at offset {e.start}); "
                         f"--dataset needs UTF-8 text (.txt .md .py, optionally .xz/.gz)") from None
    return raw.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")


def read_texts(files):
    """[read_text(f) for f in files], with a progress bar when reading takes more than 2 s."""
    from tqdm import tqdm
    return [read_text(f) for f in tqdm(files, desc="reading", unit="file", delay=2, disable=len(files) < 2)]


def is_text_file(path):
    p = path[:-3] if path.endswith((".xz", ".gz")) else path
    return p.endswith(TEXT_EXT)


def list_files(root, skip_dirs=()):
    """Sorted text files under root (a file or a folder), skipping folders named in skip_dirs."""
    if os.path.isfile(root):
        return [root]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in skip_dirs and not x.startswith("."))
        out += [os.path.join(d, f) for f in sorted(files) if is_text_file(f)]
    return out


def source_signature(root, files):
    """What identifies the source files in meta.json: count, total bytes, newest mtime and a hash
    of their names relative to root, so an edited, added, removed or renamed file is noticed."""
    st = [os.stat(f) for f in files]
    names = "\n".join(os.path.relpath(f, root) for f in files)
    return {"files": len(files), "bytes": sum(s.st_size for s in st),
            "mtime": max((s.st_mtime for s in st), default=0.0),
            "names_sha1": hashlib.sha1(names.encode()).hexdigest()[:12]}


def stdlib_files():
    """The standard library's .py sources without tests, idlelib and site-packages (~11 MB)."""
    root = sysconfig.get_paths()["stdlib"]
    return root, list_files(root, skip_dirs={"site-packages", "dist-packages", "__pycache__", "test",
                                             "tests", "idlelib", "turtledemo"})


# ----------------------------------------------------------------------------- preparation

def dataset_name(dataset, tokenizer_name, max_tokens=None):
    """Folder name under data/ for a dataset spec, tokenizer and token cap: byte data gets a
    '-byte' suffix, capped data '-max<N>' (so a capped preparation is never taken for a full one)."""
    if dataset in KNOWN:
        base = dataset
    else:
        path = os.path.abspath(dataset)
        stem = os.path.basename(path.rstrip("/")).split(".")[0] or "text"
        base = f"{stem}-{hashlib.sha1(path.encode()).hexdigest()[:6]}"
    name = base if tokenizer_name == "gpt2" else f"{base}-{tokenizer_name}"
    return name if max_tokens is None else f"{name}-max{max_tokens}"


def check_dataset_arg(dataset):
    """Raise ValueError if dataset is neither a known name nor an existing path."""
    if dataset in KNOWN or os.path.exists(dataset):
        return
    raise ValueError(f"--dataset {dataset!r}: not a known dataset ({', '.join(KNOWN)}) "
                     f"and no such file or folder")


_worker_tok = _worker_texts = None   # a tokenizing worker's tokenizer and texts (_init_worker)


def is_val_file(path):
    """Whether a folder's file belongs to the validation split: its name is val, valid or
    validation, alone or followed by '.', '_' or '-' (val.txt, val_00.jsonl, valid-2.txt; not
    values.py or validators.py)."""
    return re.match(r"(val|valid|validation)([._-]|$)", os.path.basename(path).lower()) is not None


def _init_worker(tok_name, texts):
    global _worker_tok, _worker_texts
    # Ctrl-C reaches the whole process group: a worker it killed would lose its piece and leave the
    # parent waiting for it for good, so the workers ignore it and the parent stops the pool
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_tok, _worker_texts = get_tokenizer(tok_name, verbose=False), texts


def _encode_piece(i):
    # piece i of the texts the worker got at its start: the task queue carries an index, not
    # megabytes of text, so stopping the pool never waits on a full task pipe
    return np.asarray(_worker_tok.encode(_worker_texts[i]), dtype=np.uint32)


def split_chunks(text, size=1 << 20):
    """Cut text into ~size-character pieces at a newline followed by a non-space character, where
    GPT-2's pre-tokenizer splits anyway, so encoding the pieces equals encoding the whole text."""
    out, start = [], 0
    while len(text) - start > size:
        cut = text.find("\n", start + size)
        while cut != -1 and cut + 1 < len(text) and text[cut + 1].isspace():
            cut = text.find("\n", cut + 1)
        if cut == -1:
            break
        out.append(text[start:cut + 1])
        start = cut + 1
    out.append(text[start:])
    return out


def tokenize_docs(docs, tok, desc="tokenizing", procs=None):
    """Token ids (np.uint32) of the documents, each followed by the end-of-text token when the
    tokenizer has one (and the document does not already end with a separator).
    docs: iterable of str. Shows a tqdm bar (characters); uses several processes on large inputs."""
    from tqdm import tqdm
    docs = list(docs)
    total = sum(len(d) for d in docs)
    eot = np.asarray([tok.eot], dtype=np.uint32) if tok.eot is not None else None
    pieces = []   # (text, is_last_piece_of_doc, needs_eot)
    for d in docs:
        parts = split_chunks(d)
        needs = eot is not None and not d.rstrip().endswith(EOT_TEXT)
        pieces += [(p, i == len(parts) - 1, needs) for i, p in enumerate(parts)]
    procs = procs or min(os.cpu_count() or 1, 8)
    out = []
    bar = tqdm(total=total, unit="char", unit_scale=True, desc=desc, disable=total < (1 << 20))
    if procs > 1 and total > (8 << 20):
        import multiprocessing as mp
        try:
            with mp.get_context("fork" if sys.platform != "win32" else "spawn").Pool(
                    procs, initializer=_init_worker, initargs=(tok.name, [p[0] for p in pieces])) as pool:
                for (text, last, needs), ids in zip(pieces, pool.imap(_encode_piece, range(len(pieces)))):
                    out.append(ids)
                    if last and needs:
                        out.append(eot)
                    bar.update(len(text))
        except KeyboardInterrupt:      # the pool is terminated on leaving the with block
            bar.close()
            raise SystemExit(f"interrupted while {desc}: nothing was written (it is prepared again next time)")
    else:
        for text, last, needs in pieces:
            out.append(np.asarray(tok.encode(text), dtype=np.uint32))
            if last and needs:
                out.append(eot)
            bar.update(len(text))
    bar.close()
    return np.concatenate(out) if out else np.zeros(0, dtype=np.uint32)


def _remote_docs(dataset, max_tokens, tok):
    """(train_docs, val_docs) streamed from the HF hub; every 100th document goes to val."""
    try:
        import datasets
    except ImportError:
        raise RuntimeError(f"--dataset {dataset} needs the `datasets` package (pip install datasets) and "
                           f"internet access; offline, use --dataset stdlib or a local file/folder "
                           f"(e.g. a folder of .txt files)") from None
    spec = {"openwebtext": ("Skylion007/openwebtext", None),
            "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT"),
            "c4": ("allenai/c4", "en")}[dataset]
    from tqdm import tqdm
    try:
        ds = datasets.load_dataset(spec[0], spec[1], split="train", streaming=True)
        train, val, n_chars = [], [], 0
        budget = max_tokens * 4  # ~4 characters per GPT-2 token on English web text
        bar = tqdm(total=budget, unit="char", unit_scale=True, desc=f"downloading {dataset}")
        for i, ex in enumerate(ds):
            (val if i % 100 == 99 else train).append(ex["text"])
            n_chars += len(ex["text"])
            bar.update(len(ex["text"]))
            if n_chars >= budget:
                break
        bar.close()
    except Exception as e:
        raise RuntimeError(f"could not stream --dataset {dataset} from the HF hub ({type(e).__name__}: "
                           f"{str(e)[:200]}). Offline? Use --dataset stdlib or a local file/folder "
                           f"(e.g. a folder of .txt files).") from None
    return train, val


def _download_shakespeare():
    try:
        with urllib.request.urlopen(SHAKESPEARE_URL, timeout=30) as r:
            return r.read().decode("utf-8")
    except Exception as e:
        raise RuntimeError(f"could not download tiny-shakespeare from {SHAKESPEARE_URL} ({type(e).__name__}: "
                           f"{e}). Offline? Use a local copy, e.g. --dataset path/to/input.txt, "
                           f"or --dataset stdlib.") from None


def _split_tail(ids, frac=0.1):
    """Split a token stream: the last `frac` of tokens is validation."""
    n_val = max(1, int(len(ids) * frac))
    return ids[:-n_val], ids[-n_val:]


def prepare(dataset="stdlib", tokenizer="gpt2", data_dir=None, max_tokens=None, verbose=True):
    """Prepare a dataset once and return its folder (data_dir/<name>, see dataset_name).

    dataset: "stdlib", "shakespeare", "openwebtext", "fineweb-edu", "c4", or a local file/folder.
    tokenizer: "gpt2", "byte" or "auto" (gpt2, or byte when tiktoken cannot load its files; an
    explicit "gpt2" that cannot load is a RuntimeError).
    max_tokens: cap on training tokens, a positive int (remote datasets default to 100M; local
    inputs are not capped unless given). A finished folder (meta.json present) whose meta.json
    matches the request (tokenizer, cap, source files' count/bytes/mtime/names) is reused; one that
    does not is prepared again, with a message. A given prepared folder is used as it is.
    Raises ValueError for an unknown name, a missing path, a bad max_tokens, a binary source file or
    a prepared folder with another cap; RuntimeError when a download fails or a split is empty."""
    check_dataset_arg(dataset)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0):
        raise ValueError(f"--max_tokens {max_tokens!r}: must be a positive integer (omit it for no cap)")
    if os.path.isfile(os.path.join(dataset, "meta.json")):   # an already prepared folder
        meta = load_meta(dataset)
        if max_tokens is not None and meta.get("max_tokens") != max_tokens:
            raise ValueError(f"--max_tokens {max_tokens}: {dataset} is a prepared folder (cap "
                             f"{meta.get('max_tokens')}) used as it is; drop --max_tokens or prepare from the source")
        if tokenizer not in (meta["tokenizer"], "auto") and verbose:
            print(f"[data] {dataset} was prepared with the {meta['tokenizer']} tokenizer; using it as it is")
        return dataset
    tok = get_tokenizer(tokenizer, verbose=verbose)
    if dataset in REMOTE:
        max_tokens = max_tokens or 100_000_000
    files = None
    if dataset == "stdlib":
        root, files = stdlib_files()
    elif dataset not in KNOWN:
        root, files = dataset, list_files(dataset, skip_dirs={"__pycache__"})
        if not files:
            raise ValueError(f"--dataset {dataset!r}: no {'/'.join(TEXT_EXT)} files (optionally .xz/.gz) found")
    want = {"tokenizer": tok.name, "max_tokens": max_tokens,
            "source_files": source_signature(root, files) if files else None}
    out = os.path.join(data_dir or DATA_DIR, dataset_name(dataset, tok.name, max_tokens))
    # One process prepares a folder at a time (a sweep started together asks for the same corpus):
    # the others wait here, then find it prepared. The lock sits beside the folder, not in it.
    os.makedirs(os.path.dirname(out), exist_ok=True)
    lock = FileLock(out + ".lock")
    lock.acquire(wait=True, on_wait=lambda holder: verbose and print(
        f"[data] waiting for {describe(holder)} to finish preparing {out}", flush=True))
    try:
        return _prepare_locked(dataset, tok, out, want, files, root if files else None, max_tokens, verbose)
    finally:
        lock.release()


def _prepare_locked(dataset, tok, out, want, files, root, max_tokens, verbose):
    """prepare() once the folder's lock is held: reuse a matching folder or (re)write it."""
    if os.path.exists(os.path.join(out, "meta.json")):
        meta = load_meta(out)
        diff = [k for k in want if meta.get(k) != want[k]]
        if not diff:
            return out
        if verbose:
            why = "; ".join(f"{k} {meta.get(k)!r}, now {want[k]!r}" if k != "source_files"
                            else "its source files changed" if meta.get(k) else "it records no source files"
                            for k in diff)
            print(f"[data] {out} does not match this request ({why}): preparing it again")
        os.remove(os.path.join(out, "meta.json"))  # unfinished until the new meta.json is written
    if os.path.isdir(out):  # what a preparation killed part-way left (the lock is ours: no one writes now)
        for name in os.listdir(out):
            if ".tmp" in name:
                os.remove(os.path.join(out, name))
    if verbose:
        print(f"[data] preparing {out} from {dataset} ({tok.name} tokenizer; done once, reused by later runs)",
              flush=True)
    if dataset == "stdlib":
        train_docs, val_docs, source = read_texts(files), [], f"python stdlib {root} ({len(files)} files)"
    elif dataset == "shakespeare":
        train_docs, val_docs, source = [_download_shakespeare()], [], SHAKESPEARE_URL
    elif dataset in REMOTE:
        train_docs, val_docs = _remote_docs(dataset, max_tokens, tok)
        source = f"HF datasets {dataset} (streamed, ~{max_tokens} tokens)"
    else:
        is_val = [os.path.isdir(dataset) and is_val_file(f) for f in files]
        train_docs = read_texts([f for f, v in zip(files, is_val) if not v])
        val_docs = read_texts([f for f, v in zip(files, is_val) if v])
        if verbose and val_docs:
            names = [os.path.relpath(f, dataset) for f, v in zip(files, is_val) if v]
            print(f"[data] validation split: {len(names)} file(s) named val / valid / validation: "
                  f"{', '.join(names[:5])}{' ...' if len(names) > 5 else ''}")
        source = f"{os.path.abspath(dataset)} ({len(files)} files)"
    train = tokenize_docs(train_docs, tok, desc=f"tokenizing {dataset} ({tok.name})")
    val = tokenize_docs(val_docs, tok, desc="tokenizing val") if val_docs else None
    if val is None:
        train, val = _split_tail(train)
        if verbose:
            print(f"[data] {dataset} has no validation file (val.*, val_*, valid* in a folder): the last "
                  f"10 % of its tokens ({len(val):,}) are the validation split")
    if max_tokens and len(train) > max_tokens:
        train = train[:max_tokens]
    if len(train) < 2 or len(val) < 2:
        raise RuntimeError(f"--dataset {dataset!r} gives too little text ({len(train)} train / {len(val)} val tokens)")
    dtype = np.uint16 if tok.vocab_size <= 65536 else np.uint32
    os.makedirs(out, exist_ok=True)
    for split, ids in (("train", train), ("val", val)):
        # a name of this process's own, published whole by os.replace: a run reading the old
        # file keeps its open copy, a run starting now sees either file complete
        tmp = os.path.join(out, f"{split}.bin.tmp{os.getpid()}")
        ids.astype(dtype).tofile(tmp)
        os.replace(tmp, os.path.join(out, f"{split}.bin"))
    meta = {"tokenizer": tok.name, "vocab_size": tok.vocab_size, "dtype": np.dtype(dtype).name,
            "train_tokens": int(len(train)), "val_tokens": int(len(val)), "source": source,
            "dataset": dataset, "val_split": "val* files" if val_docs else "last 10 %", **want}
    tmp = os.path.join(out, f"meta.json.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(out, "meta.json"))
    if verbose:
        print(f"[data] prepared {out}: {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens ({tok.name})")
    return out


def load_meta(folder):
    """meta.json of a prepared dataset folder (dict). Raises FileNotFoundError when missing."""
    path = os.path.join(folder, "meta.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: the dataset in {folder} is not prepared")
    with open(path) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- batches

class Batches:
    """Random training windows and fixed validation windows of a prepared dataset.

    Training micro-batch `micro` of step `step` comes from its own RNG seeded by (seed, step, micro),
    so the data order is a pure function of those numbers: resuming at step N reads exactly what an
    uninterrupted run reads. Under DDP, micro is the global micro-batch index (rank * per-rank
    micro-steps + local index): every rank reads different windows, and a run on k GPUs reads the
    same windows as one GPU with k times the gradient accumulation.
    x, y: int64 (batch_size, block_size), y = x shifted by one token.
    """

    def __init__(self, folder, block_size, seed=0):
        self.folder, self.block_size, self.seed = folder, block_size, seed
        self.meta = load_meta(folder)
        self.dtype = np.dtype(self.meta["dtype"])
        # the files stay open: a corpus prepared again meanwhile (os.replace) leaves this run reading
        # the tokens it started with, never a mix of old and new
        self.files = {s: open(os.path.join(folder, f"{s}.bin"), "rb") for s in ("train", "val")}
        self.n = {s: os.fstat(f.fileno()).st_size // self.dtype.itemsize for s, f in self.files.items()}

    def _memmap(self, split):
        # a fresh memmap per batch: numpy keeps pages of a long-lived memmap referenced (nanoGPT note)
        return np.memmap(self.files[split], dtype=self.dtype, mode="r")

    def _windows(self, split, starts):
        data = self._memmap(split)
        T = self.block_size
        buf = np.stack([data[s:s + T + 1] for s in starts]).astype(np.int64)
        return torch.from_numpy(buf[:, :-1].copy()), torch.from_numpy(buf[:, 1:].copy())

    def train_batch(self, batch_size, step, micro=0):
        """(x, y) for optimizer step `step`, global micro-batch `micro` (CPU tensors)."""
        rng = np.random.default_rng([self.seed, step, micro])
        starts = rng.integers(0, self.n["train"] - self.block_size - 1, size=batch_size, endpoint=True)
        return self._windows("train", starts)

    def val_starts(self, n_windows):
        """Start offsets of the fixed validation windows: n_windows evenly spaced over val.bin."""
        hi = self.n["val"] - self.block_size - 1
        return np.linspace(0, hi, n_windows).round().astype(np.int64)

    def val_batches(self, n_windows, batch_size, rank=0, world=1):
        """Yield (x, y) over this rank's share of the fixed validation windows."""
        starts = self.val_starts(n_windows)[rank::world]
        for i in range(0, len(starts), batch_size):
            yield self._windows("val", starts[i:i + batch_size])
