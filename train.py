"""
Train a GPT with optional pseudo-quantization training (GaussWS / DiffQ, paper A) and optional
4-bit AdamW states (ZIP-SR / ZE-EDEN / TorchAO-style, paper B).

    python train.py                                     # CPU-sized defaults on CPU, GPT-2 124M on CUDA
    python train.py --method gaussws --optim zipsr      # the papers' combination
    python train.py --preset nano --max_iters 30 --device cpu   # a smoke run in seconds
    python train.py --stop_after 100                    # stop with a checkpoint, then
    python train.py --resume                            # go on from OUT_DIR/ckpt.pt
    python train.py --resume --max_iters 600            # train a finished 300-step run longer
    torchrun --standalone --nproc_per_node 2 train.py --preset gpt2-124m   # several GPUs (DDP)
    torchrun --standalone --nproc_per_node 2 train.py --fsdp               # sharded (FSDP2)

Defaults marked 'auto' depend on the device: on CPU a tiny byte-level model for a few hundred
steps (minutes), on CUDA GPT-2 124M with the GPT-2 tokenizer, BF16 autocast and torch.compile.
Everything is written to --out_dir: ckpt.pt (atomic), log.jsonl (one JSON object per step and per
eval, plus a summary), loss.png (when matplotlib is installed). A fresh run refuses an --out_dir
that holds a checkpoint: continue it with --resume, or start over with --overwrite. Ctrl-C (SIGINT)
or SIGTERM stops at the next step boundary with a checkpoint and prints the command that
continues the run (exit status 130 / 143).

Training longer: --resume with a larger --max_iters (or --tokens_per_param) goes on from the
checkpoint under the schedule recomputed for the new length N; every other flag must match, except
those that leave the numbers alone (eval, compile, device, threads, out_dir: RESUME_FREE). Warmup
and cooldown are shares of N, so WSD's cooldown moves to the last round(cooldown_frac * N) steps.
A run stopped on the plateau (--stop_after) goes on at the peak lr without a jump. A finished WSD
run of T steps has cooled down (its last step used lr * (1 - sqrt(1 - 1/D)), D its cooldown
length); resumed with N it goes back up at step T from that lr to the plateau lr, stays there and
cools down again over the new last steps; this holds when T lies on the new plateau
(round(warmup_frac * N) <= T < N - round(cooldown_frac * N), with the default shares
about T / 0.9 < N <= 10 T); otherwise step T takes the new cooldown's (or warmup's) lr. Cosine is
recomputed likewise, and the 4-bit optimizers' LM-head switch to SR moves to 90 % of N.
"""

import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import adam4bit
import data as datamod
import gaussws
from codebooks import CODEBOOKS
from model import GPT, PRESETS, describe, preset_config

METHODS = ("bf16", "gaussws", "diffq")
OPTIMS = ("adamw", "fp32", "torchao", "zipsr", "zeeden", "adam-mini")
FOURBIT = ("fp32", "torchao", "zipsr", "zeeden")          # adam4bit.AdamW4bit presets
SCHEDULES = ("wsd", "cosine", "constant")
CKPT_FORMAT = "gaussws-adam4bit-train-v1"
# Peak learning rates: paper B Table 7 where it has the size, nanoGPT's 6e-4 for GPT-2 124M,
# and a larger rate for the CPU-sized models (few hundred steps).
DEFAULT_LR = {"nano": 3e-3, "nano-llama": 3e-3, "tiny": 2e-3, "small": 1e-3, "mini": 2e-3,
              "tiny-llama": 2e-3, "gpt2-124m": 6e-4, "gpt-162m": 1e-3, "gpt-405m": 6e-4,
              "gpt-834m": 6e-4, "llama-130m": 2e-3, "llama-134m": 2e-3, "llama-1b": 3e-4,
              "llama-3b": 1.5e-4, "llama-70b-4l": 1e-4}
# Run settings that may differ between a checkpoint and the run resuming it: they do not change
# what is trained, or (max_iters, tokens_per_param) they extend the run under a recomputed
# schedule; every other setting must match.
RESUME_FREE = {"resume", "stop_after", "out_dir", "compile", "compile_mode", "eval_interval", "eval_windows", "device",
               "data_dir", "plot", "overwrite", "max_iters", "tokens_per_param", "threads", "capturable"}
# flags added after checkpoints were written: their value when the checkpoint has none
RESUME_DEFAULTS = dict(param_dtype="fp32", param_rounding="rtn", master_weight_bits=None)


TORCH_THREADS = torch.get_num_threads()  # PyTorch's own choice at import: OMP_NUM_THREADS or the physical cores


class RunError(Exception):
    """A run that cannot go on: diverged loss, unreadable or mismatched checkpoint."""


def rank0():
    """True outside torchrun and on its rank 0 (torchrun sets RANK)."""
    return int(os.environ.get("RANK", 0)) == 0


def say(*a):
    """print on rank 0 only; flushed, so a piped log shows it at once."""
    if rank0():
        print(*a, flush=True)


# ----------------------------------------------------------------------------- flags

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")   # torch.compile's


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage dump) and exits with status 2; under
    torchrun only rank 0 prints it (every rank parses the same flags)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n" if rank0() else None)


def build_parser():
    # allow_abbrev=False: experiments.py sets some flags per run and refuses them in --train_args by
    # name, so an abbreviation (--max_it) must not slip through as the full flag
    p = OneLineParser(prog="train.py", description=__doc__.split("\n\n")[0].strip(),
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    g = p.add_argument_group("model and data")
    g.add_argument("--preset", default="auto", choices=("auto",) + tuple(PRESETS),
                   help="model shape; auto: tiny on CPU, gpt2-124m on CUDA")
    g.add_argument("--dataset", default="stdlib",
                   help="stdlib | shakespeare | openwebtext | fineweb-edu | c4 | a local UTF-8 text file or folder "
                        "| a prepared data folder (meta.json). Validation split: a folder's files named val*, "
                        "otherwise the last 10%% of the tokens")
    g.add_argument("--tokenizer", default="auto", choices=("auto", "gpt2", "byte"),
                   help="auto: gpt2 on CUDA (byte, with a message, when tiktoken cannot load its files), byte on "
                        "CPU (a 50k-vocab LM head and softmax dominate a CPU step); gpt2 given explicitly never falls back")
    g.add_argument("--data_dir", default=datamod.DATA_DIR, help="where prepared datasets live")
    g.add_argument("--max_tokens", type=int, default=None,
                   help="cap on training tokens when preparing a dataset (prepared as data/<name>-max<N>)")
    g.add_argument("--block_size", type=int, default=None, help="context length; default: the preset's")
    g = p.add_argument_group("pseudo-quantization training (paper A)")
    g.add_argument("--method", default="bf16", choices=METHODS, help="bf16 = no PQT")
    g.add_argument("--parts", default="all",
                   help="all | od | comma list of qkv,out,up,down (GPT) or q,k,v,out,gate,up,down (Llama)")
    g.add_argument("--b_init", type=float, default=6.0, help="initial bitwidth (paper A eq. 11)")
    g.add_argument("--b_target", type=float, default=4.0, help="target bitwidth (paper A eq. 11)")
    g.add_argument("--bits_wd", type=float, default=0.1, help="weight decay on b_i (pulls b_t to b_target)")
    g.add_argument("--bits_lambda", type=float, default=0.0, help="lambda of the bitwidth penalty in the loss")
    g.add_argument("--pqt_memory", default="save", choices=("save", "recompute"),
                   help="save w_hat for backward (+2 B/param) or recompute it")
    g = p.add_argument_group("optimizer and schedule")
    g.add_argument("--optim", default="adamw", choices=OPTIMS,
                   help="adamw = torch AdamW (fused on CUDA); fp32/torchao/zipsr/zeeden = adam4bit presets")
    g.add_argument("--v_codebook", default=None, choices=tuple(CODEBOOKS),
                   help="4-bit presets only: second-moment codebook instead of the preset's (e.g. dyn4 with "
                        "--v_rounding state-rtn: the zero-point failure of paper B Figure 1)")
    g.add_argument("--v_rounding", default=None, choices=adam4bit.V_ROUNDINGS,
                   help="4-bit presets only: second-moment rounding rule instead of the preset's (paper B App. A.2)")
    g.add_argument("--param_dtype", default="fp32", choices=("fp32", "bf16"),
                   help="dtype the model parameters are stored in (bf16: no FP32 master copy; b_i stay FP32)")
    g.add_argument("--param_rounding", default="rtn", choices=adam4bit.PARAM_ROUNDINGS,
                   help="AdamW4bit presets, --param_dtype bf16: how the new BF16 weight is written (sr: stochastic)")
    g.add_argument("--master_weight_bits", type=int, default=None, choices=(24,),
                   help="AdamW4bit presets, --param_dtype bf16: 24 keeps an int8 correction per weight (+1 B/param)")
    g.add_argument("--capturable", action="store_true",
                   help="AdamW4bit presets: the optimizer step replays as one CUDA graph (AdamW4bit(capturable=True))")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate; default per preset (paper B Table 7)")
    g.add_argument("--schedule", default="wsd", choices=SCHEDULES, help="WSD: warmup, constant, 1-sqrt(u) cooldown")
    g.add_argument("--warmup_frac", type=float, default=0.1, help="share of steps in linear warmup")
    g.add_argument("--cooldown_frac", type=float, default=0.1, help="WSD: share of steps in the cooldown")
    g.add_argument("--min_lr_frac", type=float, default=0.1, help="cosine: final lr as a share of the peak")
    g.add_argument("--weight_decay", type=float, default=0.1)
    g.add_argument("--beta1", type=float, default=0.9)
    g.add_argument("--beta2", type=float, default=0.95)
    g.add_argument("--eps", type=float, default=1e-8)
    g.add_argument("--grad_clip", type=float, default=1.0, help="global grad-norm clip; 0 = off")
    g = p.add_argument_group("batch and length")
    g.add_argument("--batch_size", type=int, default=16, help="sequences per micro-batch per GPU")
    g.add_argument("--grad_accum", type=int, default=None,
                   help="micro-batches per step summed over all processes (must divide by their count); "
                        "default: one per process, with --resume the checkpoint's")
    g.add_argument("--max_iters", type=int, default=None,
                   help="optimizer steps; auto: 300 on CPU, 5000 on CUDA. With --resume a larger value trains "
                        "longer under the schedule recomputed for it: WSD's cooldown moves to the new end, so "
                        "a finished WSD run goes back up from its cooled-down lr to the plateau lr and cools "
                        "down again (see the module docstring)")
    g.add_argument("--tokens_per_param", type=float, default=None,
                   help="set max_iters so that tokens = this x parameters (papers: 20); excludes --max_iters")
    g.add_argument("--stop_after", type=int, default=None,
                   help="stop (with a checkpoint) after this many steps, keeping the --max_iters schedule; "
                        "continue later with --resume")
    g = p.add_argument_group("evaluation, logging, system")
    g.add_argument("--eval_interval", type=int, default=None, help="steps between evals; auto: 50 CPU, 250 CUDA")
    g.add_argument("--eval_windows", "--eval_iters", type=int, default=None, dest="eval_windows",
                   help="fixed validation windows of block_size tokens, at most as many as fit in the val "
                        "split without overlap; 0 = no eval; auto: 64 CPU, 256 CUDA (capped to what fits)")
    g.add_argument("--compile", default=None, action=argparse.BooleanOptionalAction,
                   help="torch.compile the model; default: on for CUDA, off on CPU")
    g.add_argument("--compile_mode", default="default", choices=COMPILE_MODES,
                   help="torch.compile mode; reduce-overhead replays CUDA graphs (less CPU launch time)")
    g.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="autocast dtype; auto: bfloat16 on CUDA (FP32 master weights), float32 on CPU")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU runs: PyTorch's intra-op threads; default: OMP_NUM_THREADS when set, else the cores "
                        "less one (at least 1), so that a busy core does not stall every op")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard parameters, gradients and optimizer states over the ranks with FSDP2 "
                        "(fully_shard per block and the root; the root only with one rank) instead of DDP; checkpoints are "
                        "torch.distributed.checkpoint folders (OUT_DIR/ckpt), which resume on any number of ranks "
                        "dividing --grad_accum")
    g.add_argument("--out_dir", default="out",
                   help="checkpoint, log.jsonl and loss.png go here; Ctrl-C or SIGTERM saves a checkpoint "
                        "at the next step boundary")
    g.add_argument("--resume", nargs="?", const="auto", default=None,
                   help="continue from OUT_DIR/ckpt.pt (--fsdp: the folder OUT_DIR/ckpt), or from the given "
                        "checkpoint or out_dir (the run then writes "
                        "its checkpoints and log.jsonl to --out_dir, default out); --max_iters / "
                        "--tokens_per_param / --stop_after may change, and the flags that leave the numbers alone "
                        "(eval, compile, device, threads); every other flag must match")
    g.add_argument("--overwrite", action="store_true",
                   help="start a fresh run in an --out_dir that holds a checkpoint, replacing it and log.jsonl")
    g.add_argument("--plot", default=True, action=argparse.BooleanOptionalAction,
                   help="write loss.png at the end (needs matplotlib)")
    return p


def parse_args(argv=None):
    """(parser, args) from argv (None = sys.argv[1:]) with --device checked; resolve_args fills
    the device-dependent defaults once the device is known."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (args.device in ("auto", "cpu") or args.device.startswith("cuda")):
        parser.error(f"--device {args.device!r}: allowed: auto, cpu, cuda, cuda:N")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available here; allowed: auto, cpu")
    return parser, args


def check_range(parser, name, value, lo=-math.inf, hi=math.inf, lo_in=True, hi_in=True):
    """parser.error (one line, exit 2) unless value is None or finite and within lo..hi
    (bounds included unless lo_in/hi_in is False)."""
    if value is None:
        return
    if math.isfinite(value) and (value >= lo if lo_in else value > lo) and (value <= hi if hi_in else value < hi):
        return
    if hi == math.inf:
        allowed = f"{'>=' if lo_in else '>'} {lo:g}"
    else:
        allowed = f"in {'[' if lo_in else '('}{lo:g}, {hi:g}{']' if hi_in else ')'}"
    kind = "an integer" if isinstance(value, int) else "a finite number"
    parser.error(f"--{name} {value:g}: must be {kind} {allowed}")


def resolve_args(args, parser, cuda):
    """Fill 'auto' defaults for the device and check every flag and flag combination, before any
    data or model is built (parser.error, one line naming the flag, on a bad one). --eval_windows
    'auto' stays None here: it is capped to the validation split once the data is known."""
    if args.preset == "auto":
        args.preset = "gpt2-124m" if cuda else "tiny"
    if args.tokenizer == "auto" and not cuda:
        args.tokenizer = "byte"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if cuda else "float32"
    if args.compile is None:
        args.compile = cuda
    if args.lr is None:
        args.lr = DEFAULT_LR[args.preset]
    if args.eval_interval is None:
        args.eval_interval = 250 if cuda else 50
    if args.block_size is None:
        args.block_size = PRESETS[args.preset]["block_size"]
    if args.tokens_per_param is not None and args.max_iters is not None:
        parser.error(f"--tokens_per_param {args.tokens_per_param:g} and --max_iters {args.max_iters}: "
                     f"give one of them (tokens_per_param sets max_iters from the parameter count)")
    if args.tokens_per_param is None and args.max_iters is None:
        args.max_iters = 5000 if cuda else 300
    for name in ("batch_size", "grad_accum", "block_size", "eval_interval", "max_iters", "stop_after", "max_tokens",
                 "threads"):
        check_range(parser, name, getattr(args, name), lo=1)
    for name in ("eval_windows", "seed"):
        check_range(parser, name, getattr(args, name), lo=0)
    if args.max_iters is not None and args.stop_after is not None and args.stop_after > args.max_iters:
        parser.error(f"--stop_after {args.stop_after}: must be <= --max_iters {args.max_iters}")
    for name in ("lr", "eps", "tokens_per_param"):
        check_range(parser, name, getattr(args, name), lo=0, lo_in=False)
    for name in ("weight_decay", "bits_wd", "bits_lambda", "grad_clip"):  # grad_clip 0 = off
        check_range(parser, name, getattr(args, name), lo=0)
    for name in ("beta1", "beta2"):
        check_range(parser, name, getattr(args, name), lo=0, hi=1, hi_in=False)
    for name in ("warmup_frac", "cooldown_frac", "min_lr_frac"):
        check_range(parser, name, getattr(args, name), lo=0, hi=1)
    if not args.compile and args.compile_mode != "default":
        parser.error(f"--compile_mode {args.compile_mode} without compiling (--no-compile, or the CPU default): "
                     "add --compile or drop --compile_mode")
    if args.overwrite and args.resume:
        parser.error("--overwrite and --resume: give one of them (--overwrite starts over, --resume continues)")
    if args.schedule == "wsd" and args.warmup_frac + args.cooldown_frac > 1:
        parser.error(f"--warmup_frac {args.warmup_frac:g} + --cooldown_frac {args.cooldown_frac:g} > 1: "
                     f"warmup and cooldown must fit in the run")
    check_optimizer_flags(parser, args)
    check_fsdp_flags(parser, args)
    for name in ("b_init", "b_target"):  # GaussWSLinear's range
        check_range(parser, name, getattr(args, name), lo=gaussws.B_MIN, hi=gaussws.B_MAX)
    if args.b_target > args.b_init:
        parser.error(f"--b_target {args.b_target} > --b_init {args.b_init}: need b_target <= b_init (paper A eq. 11)")
    allowed = preset_config(args.preset).parts
    args.parts = ",".join(x.strip() for x in args.parts.split(","))   # "qkv, out" as apply_pqt reads it
    if args.parts not in ("all", "od"):
        bad = [x for x in args.parts.split(",") if x not in allowed]
        if bad or not args.parts:
            parser.error(f"--parts {args.parts!r}: unknown part(s) {', '.join(bad) or '(empty)'} for preset "
                         f"{args.preset}; allowed: all, od, or a comma list of {','.join(allowed)}")
    say_ignored_flags(args, parser)
    try:
        datamod.check_dataset_arg(args.dataset)
    except ValueError as e:
        parser.error(str(e))
    if args.tokenizer == "auto":  # gpt2 on CUDA when tiktoken can load it, else bytes (with a message)
        args.tokenizer = datamod.get_tokenizer("auto", verbose=rank0()).name
    return args


def optimizer_overrides(args):
    """AdamW4bit component overrides given on the command line ({} when none): v_codebook,
    v_rounding (None = the preset's, so they are not passed)."""
    return {k: getattr(args, k, None) for k in ("v_codebook", "v_rounding") if getattr(args, k, None) is not None}


def unread_flags(config):
    """{flag: the flag that makes it unread} for a run config (dict of flag values): the PQT flags
    with --method bf16, --cooldown_frac outside WSD, --min_lr_frac outside cosine."""
    unread = {}
    if config.get("method") == "bf16":
        unread.update(dict.fromkeys(("parts", "b_init", "b_target", "bits_wd", "bits_lambda", "pqt_memory"),
                                    "--method bf16"))
    schedule = config.get("schedule")
    if schedule != "wsd":
        unread["cooldown_frac"] = f"--schedule {schedule}"
    if schedule != "cosine":
        unread["min_lr_frac"] = f"--schedule {schedule}"
    return unread


def say_ignored_flags(args, parser):
    """One line naming the flags set away from their default that this run does not read
    (unread_flags): the run goes on, but a typo in --method or --schedule shows."""
    unread = []
    for name, why in unread_flags(vars(args)).items():
        value = getattr(args, name)
        if value != parser.get_default(name):
            unread.append(f"--{name} {value:g} (with {why})" if isinstance(value, float) else
                          f"--{name} {value} (with {why})")
    if unread:
        say(f"note: not used by this run: {', '.join(unread)}")


def check_fsdp_flags(parser, args):
    """parser.error (one line) for --fsdp outside torchrun or with what it does not support."""
    if not args.fsdp:
        return
    if int(os.environ.get("RANK", -1)) == -1:
        parser.error("--fsdp: needs torchrun (torchrun --standalone --nproc_per_node N train.py --fsdp ...; "
                     "N = 1 works)")
    if args.optim == "adam-mini":
        parser.error("--fsdp with --optim adam-mini: not supported; allowed: --optim " + "|".join(
            o for o in OPTIMS if o != "adam-mini"))
    if args.bits_lambda:
        parser.error(f"--fsdp with --bits_lambda {args.bits_lambda:g}: the bitwidth penalty is not supported "
                     f"under FSDP2 (b_i are sharded outside forward); use --bits_lambda 0 or DDP")
    if args.param_dtype == "bf16" and args.method != "bf16":
        parser.error(f"--fsdp --param_dtype bf16 with --method {args.method}: FSDP2 needs one dtype per "
                     "block, and the bitwidths b_i stay FP32; use --param_dtype fp32 or DDP")
    if args.master_weight_bits:
        parser.error(f"--fsdp with --master_weight_bits {args.master_weight_bits}: not supported under "
                     "FSDP2; use --param_rounding sr or DDP")
    if args.capturable:
        parser.error("--fsdp with --capturable: not supported under FSDP2; drop --capturable or use DDP")
    if args.compile and args.compile_mode in ("reduce-overhead", "max-autotune"):
        # CUDA graphs replay fixed parameter addresses; FSDP2 frees the gathered parameters after
        # each step's last backward and gathers them into new memory before the next forward
        parser.error(f"--fsdp with --compile_mode {args.compile_mode}: CUDA graphs are not supported under "
                     "FSDP2; use --compile_mode default or max-autotune-no-cudagraphs, or --no-compile")


def check_optimizer_flags(parser, args):
    """parser.error (one line) when --v_codebook/--v_rounding are given with an optimizer that is
    not an AdamW4bit preset, or form a combination AdamW4bit refuses (e.g. an update-space rule on
    a signed codebook, or a 4-bit v with the fp32 preset's FP32 m): the optimizer is built on a
    dummy parameter here, before any data or model."""
    bf16_write = [f for f, on in (("--param_rounding sr", args.param_rounding == "sr"),
                                  ("--master_weight_bits 24", args.master_weight_bits)) if on]
    if bf16_write and (args.param_dtype != "bf16" or args.optim not in FOURBIT):
        parser.error(f"{' '.join(bf16_write)}: only with --param_dtype bf16 and an AdamW4bit preset "
                     f"(--optim {'|'.join(FOURBIT)}), got --param_dtype {args.param_dtype} --optim {args.optim}")
    if args.capturable and args.optim not in FOURBIT:
        parser.error(f"--capturable: only with an AdamW4bit preset (--optim {'|'.join(FOURBIT)}), got --optim {args.optim}")
    if len(bf16_write) == 2:
        parser.error("--param_rounding sr with --master_weight_bits 24: the correction keeps the residual of "
                     "a round-to-nearest write; give one of them")
    over = optimizer_overrides(args)
    if not over:
        return
    flags = " ".join(f"--{k} {v}" for k, v in over.items())
    fourbit = [o for o in FOURBIT if o != "fp32"]
    if args.optim not in fourbit:
        parser.error(f"{flags}: only for the 4-bit AdamW presets (--optim {'|'.join(fourbit)}), "
                     f"not --optim {args.optim}")
    try:
        adam4bit.AdamW4bit([torch.nn.Parameter(torch.zeros(1))], preset=args.optim, **over)
    except (ValueError, TypeError) as e:
        parser.error(f"{flags} with --optim {args.optim}: {e}")


# ----------------------------------------------------------------------------- setup

@dataclass
class Process:
    """This process: one of `world` under torchrun (ddp), or the only one; and its device."""
    ddp: bool
    rank: int
    world: int
    device: str

    @property
    def device_type(self):
        return "cuda" if self.device.startswith("cuda") else "cpu"

    @property
    def master(self):
        return self.rank == 0


def setup_threads(args, proc):
    """Set PyTorch's intra-op CPU threads for a CPU run and say how many: --threads; else a count
    the user chose (OMP_NUM_THREADS, or torch.set_num_threads before main) is kept; else the cores
    less one, at least 1. Leaving a core free matters under load: OpenMP threads wait for each
    other at the end of every op, so one thread descheduled by another process stalls them all
    (measured both ways in results/README.md)."""
    if proc.device_type != "cpu":
        return
    n = torch.get_num_threads()
    if args.threads is not None:
        n, why = args.threads, "--threads"
    elif os.environ.get("OMP_NUM_THREADS"):
        why = "OMP_NUM_THREADS"
    elif n != TORCH_THREADS:
        why = "set before train.py ran"
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        n, why = max(1, min(cores, TORCH_THREADS) - 1), f"{cores} cores less one, so a busy core does not stall each op"
    torch.set_num_threads(n)
    say(f"CPU threads: {n} ({why}); change with --threads N or OMP_NUM_THREADS=N")


def setup_distributed(args):
    """Process for this run. Under torchrun (RANK set) joins the process group: NCCL on CUDA,
    gloo on CPU."""
    if int(os.environ.get("RANK", -1)) == -1:
        dev = args.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        return Process(ddp=False, rank=0, world=1, device=dev)
    missing = [k for k in ("LOCAL_RANK", "WORLD_SIZE") if k not in os.environ]
    if missing:   # RANK alone: left over in the shell, not torchrun's
        raise SystemExit(f"train.py: error: RANK={os.environ['RANK']} is set but {' and '.join(missing)} "
                         "not: start a distributed run with torchrun, or unset RANK")
    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    use_cuda = args.device != "cpu" and torch.cuda.is_available()
    if use_cuda:
        dev = f"cuda:{local_rank}"
        torch.cuda.set_device(dev)
    else:
        dev = "cpu"
    if not dist.is_initialized():   # (a caller may have joined the group already)
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return Process(ddp=True, rank=rank, world=world, device=dev)


def setup_data(args, proc):
    """datamod.Batches of --dataset (rank 0 prepares it, the others wait), checked to hold a
    micro-batch and the eval windows; fills --eval_windows 'auto'."""
    folder = None
    if proc.master:
        try:
            folder = datamod.prepare(args.dataset, args.tokenizer, data_dir=args.data_dir, max_tokens=args.max_tokens)
        except (RuntimeError, ValueError, OSError) as e:  # offline download, empty corpus, ...
            raise RunError(str(e)) from None
    if proc.ddp:
        obj = [folder]
        dist.broadcast_object_list(obj, src=0)
        folder = obj[0]
    batches = datamod.Batches(folder, args.block_size, seed=args.seed)
    n_train, n_val = batches.n["train"], batches.n["val"]
    if n_train < args.block_size + 1 or n_val < args.block_size + 1:
        raise RunError(f"--block_size {args.block_size}: {folder} has only {n_train} train / "
                       f"{n_val} val tokens; use --block_size <= {min(n_train, n_val) - 1} or more data")
    if args.batch_size * args.block_size > n_train:
        raise RunError(f"--batch_size {args.batch_size} x --block_size {args.block_size} = "
                       f"{args.batch_size * args.block_size} tokens per micro-batch is more than the "
                       f"{n_train} training tokens in {folder}; use a smaller --batch_size")
    fit = (n_val - 1) // args.block_size  # validation windows that do not overlap
    default = 256 if proc.device_type == "cuda" else 64
    if args.eval_windows is None:
        args.eval_windows = min(default, fit)
        if args.eval_windows < default:
            say(f"eval on {fit} windows: all that fit in the val split of {folder} without overlap")
    elif args.eval_windows > fit:
        raise RunError(f"--eval_windows {args.eval_windows}: the val split of {folder} holds at most {fit} "
                       f"non-overlapping windows of {args.block_size} tokens; use --eval_windows <= {fit}")
    return batches


def setup_model(args, proc, batches):
    """(model, replaced): the GPT of --preset on the device, with PQT (gaussws.apply_pqt) on the
    --parts layers unless --method bf16 (replaced: their names). Sets --max_iters from
    --tokens_per_param, which needs the parameter count."""
    vocab = batches.meta["vocab_size"]
    if vocab > 256:  # GPT-2's 50257 -> 50304: a multiple of 64 runs faster
        vocab = -(-vocab // 64) * 64
    cfg = preset_config(args.preset, vocab_size=vocab, block_size=args.block_size)
    model = GPT(cfg).to(proc.device)
    replaced = []
    if args.method != "bf16":
        replaced = gaussws.apply_pqt(model, method=args.method, parts=args.parts, b_init=args.b_init,
                                     b_target=args.b_target, seed=args.seed, memory=args.pqt_memory)
    if args.param_dtype == "bf16":
        params_to_bf16(model)
    if args.tokens_per_param is not None:
        args.max_iters = max(1, math.ceil(args.tokens_per_param * model.num_params() / tokens_per_step(args)))
        if args.stop_after is not None and args.stop_after > args.max_iters:
            raise RunError(f"--stop_after {args.stop_after}: must be <= max_iters {args.max_iters} "
                           f"(from --tokens_per_param {args.tokens_per_param:g})")
    return model, replaced


def params_to_bf16(model):
    """--param_dtype bf16: the weights themselves in BF16, in place; the PQT bitwidths b_i stay
    FP32 (their small steps would round away in BF16)."""
    for name, p in model.named_parameters():
        if not name.endswith("b_i"):
            p.data = p.data.to(torch.bfloat16)


def shard_model(model, world):
    """FSDP2: fully_shard each transformer block, then the root (embeddings, final norm, LM head),
    in place; with one rank only the root (one unit: per-block all-gathers would save no memory
    and cost a collective round per block and pass). Parameters become DTensors sharded on dim 0
    and are all-gathered around each unit's forward and backward, so GaussWS layers see the whole
    weight and b_i (their noise counters are buffers, replicated and advancing alike on every
    rank: R is the unsharded layer's). The master weights stay FP32 and autocast runs inside, as
    without FSDP2. train() then compiles the wrapped model as it does the plain one: Dynamo skips
    FSDP2's hooks (they run eagerly), so with one rank the root's hooks run around one graph of the
    whole forward, the plain path's; with more ranks the hooks around each block break the graph
    inside GPT.forward's loop, Dynamo runs that frame eagerly and compiles Block.forward (one
    graph for all blocks; embeddings, final norm, LM head and loss stay eager)."""
    from torch.distributed.fsdp import fully_shard
    if world > 1:
        for block in model.blocks:
            fully_shard(block)
    fully_shard(model)


def fsdp_micro_step(model, last, world):
    """Before each micro-step's forward under FSDP2: reduce-scatter gradients only on the last
    one. With one rank also keep the parameters unsharded until then: a shard is the whole
    tensor there, so resharding after a backward saves no memory and the next forward would
    gather (copy) every parameter again; with more ranks each unit reshards (FSDP2's memory).
    With one rank the root is the only unit (shard_model): no walk over the modules (~0.4 ms)."""
    model.set_requires_gradient_sync(last, recurse=world > 1)
    if world == 1:
        model.set_reshard_after_backward(last, recurse=False)


@torch.no_grad()
def clip_grad_norm_local(params, max_norm, world):
    """torch.nn.utils.clip_grad_norm_ for FSDP2 (DTensor) gradients, with the plain path's own
    operations on each rank's shards (get_total_norm, one foreach multiply): the
    squared norm is all-reduced over the ranks, not at all with one rank, so one rank gives the
    plain path's norm and clipping bit for bit. Returns the global norm (a 0-dim tensor)."""
    grads = [p.grad.to_local() for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    if world > 1:
        total = total.square()
        dist.all_reduce(total)
        total = total.sqrt()
    torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


@contextlib.contextmanager
def unsharded(model, fsdp):
    """Under FSDP2, the model's parameters all-gathered (plain tensors) inside the block."""
    units = [m for m in model.modules() if hasattr(m, "unshard") and hasattr(m, "reshard")] if fsdp else []
    for m in units:
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()


def tokens_per_step(args):
    return args.batch_size * args.block_size * args.grad_accum


def end_iter(args):
    """The step this run stops at: --stop_after when given, else --max_iters."""
    return min(args.max_iters, args.stop_after) if args.stop_after else args.max_iters


def say_setup(args, proc, batches, model, replaced):
    meta, n_params = batches.meta, model.num_params()
    say(f"device {proc.device} x{proc.world}, dtype {args.dtype}, params {args.param_dtype}, compile {args.compile}")
    say(f"data {batches.folder}: {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens"
        + (f" (capped at {meta['max_tokens']:,})" if meta.get("max_tokens") else "")
        + f", tokenizer {meta['tokenizer']} ({meta['source']})")
    note = ""
    if args.preset.startswith("llama"):
        note = " (the papers count Llama sizes with a 32000-token vocabulary; this vocabulary changes the count)"
    say(f"model {args.preset}: {describe(model.config)}; {n_params:,} parameters = {n_params / 1e6:.2f}M{note}")
    if replaced:
        say(f"PQT {args.method}[{args.parts}] on {len(replaced)} linear layers, "
            f"{sum(p.numel() for p in bits_params(model)):,} tiles (b_i), b_init {args.b_init}, b_target {args.b_target}")


def say_optimizer(args, model):
    overrides = "".join(f" --{k} {v}" for k, v in optimizer_overrides(args).items())
    n = tokens_per_step(args)
    say(f"optimizer {args.optim}{overrides}, lr {args.lr:g} ({args.schedule}), {args.max_iters} steps of "
        f"{n:,} tokens ({args.batch_size} x {args.block_size} x {args.grad_accum}), "
        f"{args.max_iters * n / max(model.num_params(), 1):.2f} tokens/param")


def _count(n):
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else str(n)


def quantized_summary(model, optimizer, show=4):
    """One line saying which parameters get 4-bit AdamW states (optimizer.is_quantized) and which
    stay FP32 (fewer than 4096 elements, or not a multiple of the quantization block), naming the
    `show` largest FP32 ones."""
    q, f = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (q if optimizer.is_quantized(p) else f).append((p.numel(), name))
    f.sort(key=lambda x: -x[0])
    names = ", ".join(n for _, n in f[:show]) + (f", +{len(f) - show} more" if len(f) > show else "")
    return (f"4-bit states: {len(q)} tensors ({_count(sum(n for n, _ in q))} params); FP32 states: {len(f)} "
            f"tensors ({_count(sum(n for n, _ in f))} params" + (f": {names})" if f else ")"))


def param_groups(model, weight_decay, bits_wd):
    """AdamW groups: matrices/embeddings with weight decay, vectors (norms, biases) without, and the
    PQT bitwidth parameters b_i in their own group with weight decay bits_wd (paper A eqs. 11-12:
    decay on b_i pulls b_t toward b_target)."""
    decay, no_decay, bits = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name.endswith("b_i"):
            bits.append(p)
        elif p.dim() >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
              {"params": bits, "weight_decay": bits_wd, "name": "b_i"}]
    return [g for g in groups if g["params"]]


def build_optimizer(args, model, device_type):
    """The optimizer named by --optim. 4-bit presets are told which parameter is the LM head (its
    first moment switches RTN -> SR for the last 10 % of training, paper B section 4); with tied
    embeddings that parameter is the token embedding. --v_codebook / --v_rounding, when given,
    replace the preset's second-moment codebook / rounding rule (checked by check_optimizer_flags)."""
    betas = (args.beta1, args.beta2)
    groups = param_groups(model, args.weight_decay, args.bits_wd)
    if args.optim == "adamw":
        return torch.optim.AdamW(groups, lr=args.lr, betas=betas, eps=args.eps, fused=device_type == "cuda")
    if args.optim in FOURBIT:
        opt = adam4bit.AdamW4bit(groups, lr=args.lr, betas=betas, eps=args.eps, weight_decay=args.weight_decay,
                                 preset=args.optim, seed=args.seed, param_rounding=getattr(args, "param_rounding", "rtn"),
                                 master_weight_bits=getattr(args, "master_weight_bits", None),
                                 capturable=getattr(args, "capturable", False),
                                 **optimizer_overrides(args))
        opt.mark_lm_head(model.lm_head.weight)
        return opt
    if args.optim == "adam-mini":
        try:
            from adam_mini import Adam_mini
        except ImportError:
            raise RunError("--optim adam-mini needs the adam-mini package (pip install adam-mini)") from None
        c = model.config
        opt = Adam_mini(named_parameters=model.named_parameters(), lr=args.lr, betas=betas, eps=args.eps,
                        weight_decay=args.weight_decay, dim=c.n_embd, n_heads=c.n_head, n_kv_heads=c.n_kv_head)
        # tell Adam-mini our layer names (its defaults follow HF/Llama naming)
        for attr, names in (("wqk_names", {"attn.q.weight", "attn.k.weight"}), ("wv_names", {"attn.v.weight"}),
                            ("embd_names", {"wte"}), ("output_names", {"lm_head"})):
            if isinstance(getattr(opt, attr, None), set):
                getattr(opt, attr).update(names)
        return opt
    raise ValueError(f"optim={args.optim!r}; allowed: {', '.join(OPTIMS)}")


def run_config(args):
    return {k: v for k, v in sorted(vars(args).items())}


def check_resume_config(saved, current, path):
    """RunError listing the flags whose values differ between the checkpoint and this run (not
    those that neither reads: unread_flags, e.g. --b_init of two --method bf16 runs)."""
    saved = {**RESUME_DEFAULTS, **saved}
    unread = set(unread_flags(saved)) & set(unread_flags(current))
    keys = sorted((set(saved) | set(current)) - RESUME_FREE - unread)
    diff = [f"--{k} {saved.get(k)!r} (checkpoint) vs {current.get(k)!r} (now)"
            for k in keys if saved.get(k) != current.get(k)]
    if diff:
        raise RunError(f"--resume: {path} was written by a different configuration: {'; '.join(diff)}. "
                       f"Use the same flags, or a new --out_dir to start over.")


def check_out_dir(args, proc):
    """RunError (one line) before any data or model: a fresh run would replace a checkpoint of either
    kind in --out_dir (without --overwrite), or --out_dir cannot be created or written (with the reason)."""
    found = checkpoints_in(args.out_dir)
    if not args.resume and not args.overwrite and found:
        if found == [os.path.join(args.out_dir, "ckpt.tmp")] and not dcp_complete(found[0]):
            raise RunError(f"--out_dir {args.out_dir} holds only {found[0]}, an FSDP2 checkpoint whose writing "
                           f"did not finish (the run stopped before its first checkpoint was complete): nothing to "
                           f"resume; start over with --overwrite (removes it and replaces log.jsonl)")
        kind, how = ckpt_kind(found[0])
        how = "--resume" if os.path.isdir(found[0]) == args.fsdp else how
        raise RunError(f"--out_dir {args.out_dir} holds {kind} ({found[0]}): continue that run with {how}, "
                       f"or start over with --overwrite (removes it and replaces log.jsonl)")
    if not proc.master:
        return
    try:
        os.makedirs(args.out_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=args.out_dir) as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise RunError(f"--out_dir {args.out_dir}: cannot write there ({e.strerror or e})") from None


def ckpt_path(args, folder=None):
    """OUT_DIR/ckpt.pt, or under --fsdp the DCP folder OUT_DIR/ckpt (in `folder` instead of OUT_DIR)."""
    return os.path.join(folder or args.out_dir, "ckpt" if getattr(args, "fsdp", False) else "ckpt.pt")


# what a run may leave in --out_dir: ckpt.pt (plain and DDP runs), the DCP folder ckpt (--fsdp) and
# save_dcp_checkpoint's ckpt.tmp / ckpt.old; a fresh run refuses any of them, --overwrite removes all
CKPT_NAMES = ("ckpt.pt", "ckpt", "ckpt.old", "ckpt.tmp")


def checkpoints_in(out_dir):
    """The paths of CKPT_NAMES present in out_dir (a list, in that order; [] when none)."""
    return [p for p in (os.path.join(out_dir, n) for n in CKPT_NAMES) if os.path.exists(p)]


def ckpt_kind(path, resume="--resume"):
    """(kind, how to resume it) of a checkpoint path: the two kinds are not interchangeable. The
    command has placeholders: the flags of the run that wrote it (resume checks them against the
    checkpoint) and N processes; `resume` is its --resume flag (with the path a run was given)."""
    if os.path.isdir(path):
        return "an FSDP2 checkpoint", ("torchrun --standalone --nproc_per_node N train.py <that run's flags> --fsdp "
                                       f"{resume} (N dividing its --grad_accum)")
    return "a plain checkpoint", f"python train.py <that run's flags> {resume}, without --fsdp (torchrun for DDP)"


def resume_path(args):
    """The checkpoint --resume loads: OUT_DIR's (ckpt.pt, or under --fsdp the DCP folder ckpt), or
    --resume PATH: a checkpoint, or a run's --out_dir (its checkpoint of this run's kind)."""
    folder = args.out_dir if args.resume == "auto" else args.resume
    if args.resume != "auto" and not (os.path.isdir(folder) and checkpoints_in(folder)):
        return args.resume
    path = ckpt_path(args, folder)
    if os.path.exists(path):
        return path
    # a DCP folder is replaced by two renames (save_dcp_checkpoint): a crash between them leaves the
    # new checkpoint complete as ckpt.tmp (train.json, written last, in it) and the previous one as
    # ckpt.old; a crash before them (a first save) a complete ckpt.tmp alone
    if dcp_complete(path + ".tmp"):
        return path + ".tmp"
    return path + ".old" if os.path.isdir(path + ".old") else path


def dcp_complete(path):
    """True if the DCP folder `path` was written to the end (save_dcp_checkpoint adds its
    train.json last)."""
    return os.path.isfile(os.path.join(path, "train.json"))


def check_resume_kind(args):
    """RunError (one line) before anything is loaded when --resume would load the other kind of
    checkpoint than this run writes (a DCP folder without --fsdp, a ckpt.pt with it), or finds
    none of its kind where one of the other kind lies."""
    path, this = resume_path(args), "an FSDP2 (--fsdp)" if args.fsdp else "a plain"
    given = lambda p: "--resume" if args.resume == "auto" else f"--resume {shlex.quote(p)}"   # noqa: E731
    if os.path.exists(path):
        if os.path.isdir(path) != args.fsdp:
            kind, how = ckpt_kind(path, given(path))
            raise RunError(f"--resume: {path} is {kind}, not {this} one: resume it with {how}")
        return
    folder = os.path.dirname(path)
    other = [p for p in checkpoints_in(folder) if os.path.isdir(p) != args.fsdp and not p.endswith(".tmp")]
    if other:
        kind, how = ckpt_kind(other[0], given(other[0]))
        raise RunError(f"--resume: {folder} holds {kind} ({other[0]}), not {this} one: resume it with {how}")


def resume_is_done(args, ckpt):
    """True (with a message) when the checkpoint is already at the step this run would stop at
    (checked once --max_iters is known). RunError when it was written with other flags."""
    check_resume_config(ckpt["config"], run_config(args), resume_path(args))
    if ckpt["iter_num"] < end_iter(args):
        return False
    finished = ckpt["iter_num"] >= args.max_iters
    if ckpt["iter_num"] == args.max_iters:
        state = f"at step {ckpt['iter_num']} of {args.max_iters}, the run is finished"
    elif finished:
        state = f"at step {ckpt['iter_num']}, past --max_iters {args.max_iters}"
    else:
        state = f"at step {ckpt['iter_num']}, already at --stop_after {args.stop_after}"
    say(f"--resume: {resume_path(args)} is {state}"
        + f"; nothing to do ({os.path.join(args.out_dir, 'log.jsonl')} is left as it is). "
        + ("Raise --max_iters to train longer, or use --overwrite or a new --out_dir to start over."
           if finished else "Raise or drop --stop_after to go on."))
    return True


def resume(args, ckpt, model, optimizer, device_type):
    """Load model, optimizer and RNG state from the checkpoint; (start_iter, best_val_loss). The
    data order needs no state: it is a pure function of (seed, step, micro-batch)."""
    if "dcp" in ckpt and not args.fsdp:
        raise RunError(f"--resume {resume_path(args)}: a --fsdp checkpoint folder; resume it with --fsdp")
    try:
        if "dcp" in ckpt:   # DCP reshards to this run's number of ranks
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
            state = dcp_state(model, optimizer, {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state()
                                                 if device_type == "cuda" else None})
            try:
                dcp.load(state, checkpoint_id=ckpt["dcp"])
            except (Exception, dcp.CheckpointException) as e:   # on every rank: DCP gathers the ranks' errors
                raise RunError(f"--resume: checkpoint {ckpt['dcp']} cannot be read (corrupt or truncated?): "
                               f"{one_line(e)}") from None
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, optimizer, state["optimizer"])
            ckpt = dict(ckpt, rng=state["rng"])
        else:
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if device_type == "cuda" and ckpt["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
    except (KeyError, RuntimeError, ValueError, TypeError) as e:   # a checkpoint edited by hand
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RunError(f"--resume {resume_path(args)}: the checkpoint does not fit this model and "
                       f"optimizer ({type(e).__name__}: {msg[:200]})") from None
    say(f"resumed from {resume_path(args)} at step {ckpt['iter_num']}")
    saved = ckpt["config"].get("max_iters")
    if saved is not None and saved != args.max_iters:
        say(f"--max_iters {args.max_iters} (the checkpoint's run had {saved}): the learning-rate schedule "
            f"is recomputed for {args.max_iters} steps")
    return ckpt["iter_num"], ckpt["best_val_loss"]


# ----------------------------------------------------------------------------- schedule

def get_lr(it, max_iters, lr, schedule="wsd", warmup_frac=0.1, cooldown_frac=0.1, min_lr_frac=0.1):
    """Learning rate for update `it` (0-based) of `max_iters`.

    All schedules warm up linearly over the first round(warmup_frac * max_iters) updates
    (lr * (it + 1) / W). Then
      wsd:      constant lr, and over the last D = round(cooldown_frac * max_iters) updates the
                multiplier 1 - sqrt(u), u = (it - (max_iters - D)) / D in [0, 1): the first cooldown
                update uses the peak, the value reaches 0 at it = max_iters (paper B App. B)
      cosine:   half-cosine from lr down to min_lr_frac * lr at it = max_iters
      constant: lr
    """
    W = max(1, round(warmup_frac * max_iters)) if warmup_frac > 0 else 0
    if it < W:
        return lr * (it + 1) / W
    if schedule == "constant":
        return lr
    if schedule == "cosine":
        ratio = min(1.0, (it - W) / max(1, max_iters - W))
        return lr * (min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * ratio)))
    if schedule == "wsd":
        D = round(cooldown_frac * max_iters)
        start = max_iters - D
        if it < start:
            return lr
        if it >= max_iters:
            return 0.0
        return lr * (1 - math.sqrt((it - start) / D))
    raise ValueError(f"schedule={schedule!r}; allowed: {', '.join(SCHEDULES)}")


# ----------------------------------------------------------------------------- training loop

class Interrupts:
    """SIGINT / SIGTERM during training: the handler only records the signal, and the loop asks
    requested() at each step boundary, so the checkpoint is taken between steps. Under DDP the
    flag is all-reduced (MAX, over gloo on the CPU: no device sync) so that every rank stops at the
    same step. Further signals change nothing (torchrun passes a Ctrl-C on to its workers, which
    already got it; kill -9 stops at once). restore() puts the previous handlers back. Handlers can
    only be set from the main thread; elsewhere nothing is caught."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, proc):
        self.proc, self.signum, self.old = proc, 0, {}
        self.group = None
        if proc.ddp and dist.get_backend() != "gloo":  # every rank creates it, in the same order
            self.group = dist.new_group(backend="gloo")
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self.old[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame):
        self.signum = self.signum or signum

    def requested(self):
        """The signal number if any rank received one (0: none); a collective call under DDP."""
        if not self.proc.ddp:
            return self.signum
        flag = torch.tensor([self.signum])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag)

    def restore(self):
        for s, handler in self.old.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        self.old = {}


def resume_command(argv, proc, drop_stop=False):
    """The command line that continues this run: argv without --resume [PATH] / --overwrite (and
    with drop_stop, without --stop_after N), plus --resume (under torchrun, the torchrun launch)."""
    kept, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a == "--resume":
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("-")  # its PATH
        elif drop_stop and a == "--stop_after":
            skip = True
        elif not (a.startswith("--resume=") or a == "--overwrite" or (drop_stop and a.startswith("--stop_after="))):
            kept.append(a)
    launch = (f"torchrun --standalone --nproc_per_node {proc.world} train.py" if proc.ddp else "python train.py")
    return " ".join([launch, shlex.join(kept), "--resume"] if kept else [launch, "--resume"])


def train(args, proc, model, optimizer, batches, start_iter=0, best_val=math.inf, argv=()):
    """Train `model` from step start_iter to the --max_iters schedule's end (or --stop_after),
    with an eval and a checkpoint every --eval_interval steps and at the end. Returns the summary
    (also the last record of log.jsonl). On SIGINT / SIGTERM: a checkpoint at the next step
    boundary, a line with the command that continues (argv: this run's flags), and
    SystemExit(128 + signal number), i.e. exit status 130 / 143."""
    raw_model = model  # for eval, clipping, the penalty and the checkpoint
    if args.compile:
        say(f"compiling the model (torch.compile, mode {args.compile_mode}): the first step takes ~1 min "
            f"(a few on a CPU)")
        model = torch.compile(model, mode=args.compile_mode)
    graphs = args.compile and "reduce-overhead" in args.compile_mode
    if proc.ddp and not args.fsdp:  # buffers (GaussWS seed state) advance identically on every rank: no broadcast
        model = DDP(model, device_ids=[torch.device(proc.device).index] if proc.device_type == "cuda" else None,
                    broadcast_buffers=False)
    pt_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    ctx = (torch.autocast(device_type=proc.device_type, dtype=pt_dtype) if pt_dtype != torch.float32
           else contextlib.nullcontext())
    bits = bits_params(raw_model)
    penalty = bool(args.bits_lambda) and bool(bits)
    accum = args.grad_accum // proc.world  # micro-batches per step on this rank
    stop = end_iter(args)
    log = RunLog(args, proc, start_iter, best_val)
    interrupts = Interrupts(proc)
    it = start_iter
    try:
        while True:
            # eval and checkpoint (not again at the step we resumed at: done before saving)
            at_end = it >= stop
            if (it % args.eval_interval == 0 or at_end) and not (args.resume and it == start_iter):
                log.flush()
                if args.eval_windows > 0:
                    val = evaluate(raw_model, batches, args.eval_windows, args.batch_size, ctx, proc.device,
                                   proc.rank, proc.world, proc.ddp, args.fsdp)
                    with unsharded(raw_model, args.fsdp):
                        log.eval(it, val, gaussws.bitwidth_stats(raw_model) if bits else None)
                if it > start_iter or at_end:
                    log.checkpoint(it, raw_model, optimizer)
                log.t_ref = time.time()  # eval and checkpoint time is not step time
            if at_end:
                break
            signum = interrupts.requested()
            if signum:  # Ctrl-C / SIGTERM since the last step: every rank stops here, with a checkpoint
                log.interrupted(signum, it, raw_model, optimizer, interrupts.group, resume_command(argv, proc))
            # one optimizer step
            lr = get_lr(it, args.max_iters, args.lr, args.schedule, args.warmup_frac,
                        args.cooldown_frac, args.min_lr_frac)
            for g in optimizer.param_groups:
                g["lr"] = lr
            if hasattr(optimizer, "set_progress"):  # AdamW4bit: LM-head m switches to SR near the end
                optimizer.set_progress(it / args.max_iters)
            loss_sum = torch.zeros((), device=proc.device)
            for micro in range(accum):
                x, y = batches.train_batch(args.batch_size, it, proc.rank * accum + micro)
                if proc.device_type == "cuda":
                    x = x.pin_memory().to(proc.device, non_blocking=True)
                    y = y.pin_memory().to(proc.device, non_blocking=True)
                if args.fsdp:
                    fsdp_micro_step(raw_model, micro == accum - 1, proc.world)
                elif proc.ddp:  # all-reduce gradients only on the last micro-step (set before forward)
                    model.require_backward_grad_sync = micro == accum - 1
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                with ctx:
                    _, loss = model(x, y)
                    total = (loss + args.bits_lambda * gaussws.bitwidth_penalty(raw_model)) if penalty else loss
                (total / accum).backward()
                loss_sum += loss.detach()
            if proc.ddp:
                dist.all_reduce(loss_sum)  # SUM (gloo has no AVG); divided by world below
            clip = args.grad_clip if args.grad_clip > 0 else float("inf")
            gnorm = (clip_grad_norm_local(raw_model.parameters(), clip, proc.world) if args.fsdp
                     else torch.nn.utils.clip_grad_norm_(raw_model.parameters(), clip))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            stats = [loss_sum / (accum * proc.world), gnorm.float()]
            if bits:
                stats.append(mean_bt(bits, args.b_init, args.b_target, proc.world))
            log.step(it, lr, torch.stack(stats))
            it += 1
            log.bar.update(1)
    finally:
        interrupts.restore()
        log.bar.close()
    bt = mean_bt(bits, args.b_init, args.b_target, proc.world)
    go_on = resume_command(argv, proc, drop_stop=True) if it < args.max_iters else None   # --stop_after
    return log.finish(it, raw_model, optimizer, bt.item() if bt is not None else None, go_on)


def bits_params(model):
    """The PQT bitwidth parameters b_i ([] without PQT)."""
    return [p for n, p in model.named_parameters() if n.endswith("b_i")]


def mean_bt(bits_params, b_init, b_target, world=1):
    """Mean tile bitwidth b_t over all PQT tiles (paper A eq. 11: b_t = b_target + b_i (b_init - b_target)),
    as a 0-dim tensor (no device sync). FSDP2 (DTensor b_i, `world` ranks): each rank's shards,
    summed over the ranks in one all-reduce (none with one rank)."""
    if not bits_params:
        return None
    with torch.no_grad():   # DTensor.to_local() costs ~40 us a call with autograd on, ~2 us without
        local = [p.to_local() if hasattr(p, "to_local") else p.detach() for p in bits_params]
    b_i = torch.cat([x.flatten() for x in local]).float()
    if world > 1 and hasattr(bits_params[0], "to_local"):
        total = torch.stack([b_i.sum(), torch.tensor(float(b_i.numel()), device=b_i.device)])
        dist.all_reduce(total)
        b_i = total[0] / total[1]
    else:
        b_i = b_i.mean()
    return b_target + b_i * (b_init - b_target)


@torch.no_grad()
def evaluate(model, batches, n_windows, batch_size, ctx, device, rank=0, world=1, ddp=False, fsdp=False):
    """Mean cross-entropy (nats/token) over the fixed validation windows, split across ranks.
    Uses the plain (uncompiled, unwrapped) model in eval mode. Under FSDP2 (fsdp) every forward
    all-gathers, so a rank with fewer batches runs extra forwards whose loss is not counted."""
    was_training = model.training
    model.eval()
    tot = torch.zeros(2, dtype=torch.float64, device=device)
    bar = tqdm(total=len(batches.val_starts(n_windows)[rank::world]), desc="eval", unit="window", leave=False,
               delay=2, disable=rank != 0)  # shown only when an eval takes more than 2 s
    for x, y in batches.val_batches(n_windows, batch_size, rank, world):
        x, y = x.to(device), y.to(device)
        with ctx:
            _, loss = model(x, y)
        tot[0] += loss.double() * y.numel()
        tot[1] += y.numel()
        bar.update(len(x))
    if fsdp:
        most = -(-len(batches.val_starts(n_windows)[0::world]) // batch_size)   # rank 0 has the most windows
        mine = -(-len(batches.val_starts(n_windows)[rank::world]) // batch_size)
        for _ in range(most - mine):
            with ctx:
                model(torch.zeros(1, batches.block_size, dtype=torch.long, device=device))
    bar.close()
    if ddp:
        dist.all_reduce(tot)
    model.train(was_training)
    return (tot[0] / tot[1]).item()


def peak_memory_mb(device_type):
    if device_type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    except Exception:
        return float("nan")


def optimizer_state_bytes(opt):
    """Bytes this process holds in optimizer state tensors (opt.state_nbytes() when the optimizer
    has it; under FSDP2 the local shards of DTensor states); the scalar step counters are not
    counted, as in AdamW4bit.state_nbytes()."""
    if hasattr(opt, "state_nbytes"):
        return int(opt.state_nbytes())
    local = [v.to_local() if hasattr(v, "to_local") else v for s in opt.state.values() for v in s.values()]
    return sum(v.numel() * v.element_size() for v in local if torch.is_tensor(v) and v.dim() > 0)


# ----------------------------------------------------------------------------- log.jsonl and ckpt.pt

class RunLog:
    """OUT_DIR/log.jsonl, OUT_DIR/ckpt.pt and the progress bar of one run; only rank 0 writes.

    log.jsonl holds one record per step ({"type": "step", ...}), per eval ("eval"), a diverged
    step ("error") and a final "summary". A resumed run keeps the records up to its checkpoint
    (a crashed tail and the old summary are dropped), so the log always covers the whole run."""

    def __init__(self, args, proc, start_iter, best_val):
        self.args, self.proc, self.start_iter = args, proc, start_iter
        self.path = os.path.join(args.out_dir, "log.jsonl")
        self.ckpt_path = ckpt_path(args)
        self.file, kept = None, []
        if proc.master:
            os.makedirs(args.out_dir, exist_ok=True)
            if args.resume:
                kept = [r for r in read_log(self.path) if (r.get("type") == "step" and r["iter"] < start_iter)
                        or (r.get("type") == "eval" and r["iter"] <= start_iter)]
                # a kill during the rewrite leaves the old log whole
                atomic_write(self.path, lambda f: f.writelines(json.dumps(r) + "\n" for r in kept), "w")
            else:  # --overwrite: no old checkpoint, of either kind, may resume the new log
                for p in checkpoints_in(args.out_dir):
                    shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
            self.file = open(self.path, "a" if args.resume else "w")
        self.bar = tqdm(total=args.max_iters, initial=start_iter, disable=not proc.master, dynamic_ncols=True,
                        mininterval=0.5, desc="train")
        old = [r["val_loss"] for r in kept if r.get("type") == "eval"]  # a resumed run's earlier evals
        self.first_val, self.last_val = (old[0], old[-1]) if old else (None, None)
        self.n_evals = len(old)
        self.best_val = best_val
        self.pending, self.step_times, self.recent_losses = None, [], []
        self.last_ckpt = start_iter if args.resume else None
        self.t_ref = time.time()  # start of the step being timed
        self.t_start = time.time()

    def write(self, rec):
        if self.file:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()

    def step(self, it, lr, stats):
        """Log step `it`; stats: loss, grad norm[, mean b_t] on the device. On CUDA the numbers
        are copied to pinned memory without blocking and read after the next step is queued: a
        plain .item() would wait for everything queued so far and leave the GPU idle while the
        CPU prepares the next step."""
        if self.proc.device_type != "cuda":
            self.pending = (it, stats, None, lr)
            self.flush()
            return
        host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
        host.copy_(stats, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.flush()
        self.pending = (it, host, event, lr)

    def flush(self):
        """Read back the pending step's numbers (waits for the device) and log them. RunError when
        the loss or grad norm is not finite; the last checkpoint is left as it is."""
        if self.pending is None:
            return
        it, stats, event, lr = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()  # waits for this step's numbers only, not for the step queued after it
        vals = stats.tolist()
        loss, gnorm = vals[0], vals[1]
        now = time.time()
        dt, self.t_ref = now - self.t_ref, now
        if not (math.isfinite(loss) and math.isfinite(gnorm)):
            msg = (f"loss {loss} / grad norm {gnorm} at step {it}: training diverged, stopping. "
                   + (f"The last good checkpoint {self.ckpt_path} (step {self.last_ckpt}) is left intact."
                      if self.last_ckpt is not None else "No checkpoint was written yet."))
            self.write({"type": "error", "iter": it, "message": msg})
            raise RunError(msg)
        self.step_times.append(dt)
        self.recent_losses.append(loss)
        n = tokens_per_step(self.args)
        rec = {"type": "step", "iter": it, "loss": loss, "lr": lr, "grad_norm": gnorm,
               "tokens_per_s": n / dt, "dt_ms": dt * 1000, "peak_mem_mb": peak_memory_mb(self.proc.device_type)}
        if len(vals) > 2:
            rec["b_t_mean"] = vals[2]
        self.write(rec)
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{n / dt:,.0f}", lr=f"{lr:.2e}", refresh=False)

    def eval(self, it, val, bits=None):
        """Log validation loss `val` at step `it`, with the mean training loss since the last eval
        and, under PQT, the bitwidth statistics `bits`."""
        self.first_val = val if self.first_val is None else self.first_val
        self.last_val, self.best_val = val, min(self.best_val, val)
        self.n_evals += 1
        train_loss = float(np.mean(self.recent_losses)) if self.recent_losses else None
        self.recent_losses.clear()
        rec = {"type": "eval", "iter": it, "val_loss": val, "train_loss": train_loss,
               "time_s": time.time() - self.t_start}
        if bits is not None:
            rec["bits"] = bits
        self.write(rec)
        if self.proc.master:
            tl = f"{train_loss:.4f}" if train_loss is not None else "-"
            self.bar.write(f"step {it}: val loss {val:.4f}, train loss {tl}")

    def checkpoint(self, it, model, optimizer):
        """ckpt.pt for step `it` (next step to run), written atomically by rank 0; under --fsdp the
        DCP folder ckpt, written by every rank (save_dcp_checkpoint). RunError (one line, the
        reason) when it cannot be written (disk full, ...); the previous one is kept."""
        meta = {"format": CKPT_FORMAT, "iter_num": it, "best_val_loss": self.best_val,
                "config": run_config(self.args), "model_config": asdict(model.config),
                # the training data order is a pure function of (seed, rank, step, micro-step)
                "data_rng": {"scheme": "numpy default_rng([seed, step, global micro-batch])",
                             "seed": self.args.seed, "next_step": it}}
        rng = {"torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state() if self.proc.device_type == "cuda" else None}
        if self.proc.master or self.args.fsdp:
            try:
                if self.args.fsdp:
                    save_dcp_checkpoint(self.ckpt_path, meta, model, optimizer, rng, self.proc.master)
                else:
                    save_checkpoint(self.ckpt_path, dict(meta, model=model.state_dict(),
                                                         optimizer=optimizer.state_dict(), rng=rng))
            except (OSError, RuntimeError) as e:  # torch.save reports some write errors as RuntimeError
                reason = getattr(e, "strerror", None) or (str(e).splitlines() or [type(e).__name__])[0][:200]
                kept = (f"{self.ckpt_path} (step {self.last_ckpt}) is left intact" if self.last_ckpt is not None
                        else "no checkpoint was written")
                raise RunError(f"--out_dir {self.args.out_dir}: cannot write the checkpoint for step {it} "
                               f"({reason}); {kept}") from None
        self.last_ckpt = it

    def interrupted(self, signum, it, model, optimizer, group, resume_cmd):
        """Stop at step `it` after a signal: checkpoint (unless one is there), close the log, print
        the command that continues, exit with status 128 + signum (130 for SIGINT, 143 for SIGTERM)."""
        self.flush()
        if self.last_ckpt != it:
            self.checkpoint(it, model, optimizer)
        if self.proc.ddp:  # no rank exits before rank 0 has written the checkpoint
            dist.barrier(group=group)
        self.bar.close()
        if self.file:
            self.file.close()
        say(f"{signal.Signals(signum).name}: stopped at step {it} with a checkpoint in {self.ckpt_path}; "
            f"continue with: {resume_cmd}")
        raise SystemExit(128 + signum)

    def finish(self, it, model, optimizer, b_t_mean=None, go_on=None):
        """Log and print the summary of a run that stopped before step `it` (and, when it stopped
        at --stop_after, the command `go_on` that continues it); loss.png; returns the summary."""
        args, elapsed = self.args, time.time() - self.t_start
        warm = self.step_times[min(len(self.step_times) - 1, 5):] if self.step_times else []  # skip compile/warmup
        summary = {"type": "summary", "iters": it, "max_iters": args.max_iters, "start_iter": self.start_iter,
                   "tokens": (it - self.start_iter) * tokens_per_step(args), "time_s": elapsed,
                   "tokens_per_s": tokens_per_step(args) / float(np.median(warm)) if warm else None,
                   "first_val_loss": self.first_val, "final_val_loss": self.last_val,
                   "best_val_loss": self.best_val if math.isfinite(self.best_val) else None,
                   "peak_mem_mb": peak_memory_mb(self.proc.device_type),
                   "optimizer_state_mb": optimizer_state_bytes(optimizer) / 2**20,
                   "params": model.num_params(), "preset": args.preset, "method": args.method, "optim": args.optim,
                   "world": self.proc.world, "checkpoint": self.ckpt_path if self.last_ckpt is not None else None}
        if b_t_mean is not None:
            summary["b_t_mean"] = b_t_mean
        self.write(summary)
        if not self.proc.master:
            return summary
        # first -> last over this log's evals (a resume into another --out_dir has only its own)
        val = ""
        if self.n_evals == 1:
            val = f"val loss {self.last_val:.4f}, "
        elif self.n_evals > 1:
            val = f"val loss {self.first_val:.4f} -> {self.last_val:.4f}, "
        say(f"done: {it - self.start_iter} steps" + (f" (resumed at step {self.start_iter})" if self.start_iter else "")
            + f" in {elapsed:.1f}s, "
            + (f"{summary['tokens_per_s']:,.0f} tokens/s (median), " if summary["tokens_per_s"] else "")
            + val
            + f"peak memory {summary['peak_mem_mb']:,.0f} MiB, optimizer state {summary['optimizer_state_mb']:.2f} MiB"
            + (" per process" if self.proc.world > 1 else "")
            + (f", mean b_t {b_t_mean:.3f}" if b_t_mean is not None else ""))
        say(f"checkpoint {self.ckpt_path}, log {self.path}")
        if go_on:
            say(f"stopped at --stop_after {it} of {args.max_iters} steps; continue with: {go_on}")
        if args.plot:
            say(plot_losses(self.path, os.path.join(args.out_dir, "loss.png")))
        self.file.close()
        return summary


def atomic_write(path, write, mode="wb"):
    """write(f) into path + '.tmp', fsync, then os.replace onto path: a crash mid-write leaves the
    previous file intact. On an error the temp file is removed and the error raised again."""
    tmp = path + ".tmp"
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def save_checkpoint(path, obj):
    """torch.save through atomic_write: a crash mid-write leaves the previous checkpoint intact."""
    atomic_write(path, lambda f: torch.save(obj, f))


def dcp_state(model, optimizer, rng):
    """The state dict of a DCP checkpoint: model and optimizer (torch.distributed.checkpoint's
    get_model/optimizer_state_dict: sharded DTensors, resharded on load) and the RNG states."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer),
            "rng": {k: v for k, v in rng.items() if v is not None}}


def save_dcp_checkpoint(path, meta, model, optimizer, rng, master):
    """Every rank: write the DCP folder `path` for step meta["iter_num"] atomically: dcp.save into
    path.tmp, rank 0 adds train.json (meta: step, config, ...), then replaces path by two renames
    (path -> path.old, path.tmp -> path; after a crash between them resume_path takes the complete
    path.tmp, else path.old) and removes path.old. A collective: every rank calls it at the same step."""
    import torch.distributed.checkpoint as dcp
    tmp, old = path + ".tmp", path + ".old"
    if master and os.path.exists(tmp):
        shutil.rmtree(tmp)
    dist.barrier()
    dcp.save(dcp_state(model, optimizer, rng), checkpoint_id=tmp)
    dist.barrier()
    if master:
        atomic_write(os.path.join(tmp, "train.json"), lambda f: f.write(json.dumps(meta)), "w")
        if os.path.exists(path):
            if os.path.exists(old):
                shutil.rmtree(old)
            os.replace(path, old)
        os.replace(tmp, path)
        if os.path.exists(old):
            shutil.rmtree(old)
    dist.barrier()


def load_dcp_meta(path):
    """train.json of the DCP folder `path` (the checkpoint minus model, optimizer and RNG, which
    resume() loads once they exist), with "dcp": path; RunError when it is missing or not ours."""
    try:
        with open(os.path.join(path, "train.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise RunError(f"--resume: {path} is not a complete train.py --fsdp checkpoint folder "
                       f"(train.json: {getattr(e, 'strerror', None) or e})") from None
    if not isinstance(meta, dict) or meta.get("format") != CKPT_FORMAT:
        raise RunError(f"--resume: {path} is not a train.py checkpoint (format {CKPT_FORMAT})")
    check_dcp_files(path)
    return dict(meta, dcp=path)


def one_line(e):
    """'Type: first line of the message' (at most 200 characters) of an exception; of a DCP
    CheckpointException, that of the first failed rank's exception, which it wraps."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (e, _) = min(failures.items())
        return f"rank {rank}: {one_line(e)}"
    msg = str(e)
    if "WeightsUnpickler error:" in msg:   # skip torch.load's advice on weights_only=False
        msg = msg.split("WeightsUnpickler error:")[1].strip()
    msg = (msg.strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {msg[:200]}"


def check_dcp_files(path):
    """RunError (one line, naming the folder and the file) unless the DCP folder's .metadata reads
    and every byte range it lists lies in a present .distcp file: a deleted or truncated file is
    reported before any model is built, on every rank alike."""
    from torch.distributed.checkpoint import FileSystemReader
    bad = f"--resume: checkpoint {path} cannot be read (corrupt or truncated?)"
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise RunError(f"{bad}: its .metadata is missing")
    try:
        storage = FileSystemReader(path).read_metadata().storage_data
    except Exception as e:
        raise RunError(f"{bad}: .metadata: {one_line(e)}") from None
    need = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(need.items()):
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            raise RunError(f"{bad}: {name} is missing")
        if os.path.getsize(f) < end:
            raise RunError(f"{bad}: {name} has {os.path.getsize(f)} bytes, its .metadata needs {end}")


def load_checkpoint(path):
    """Read a checkpoint written by save_checkpoint (or the train.json of a DCP folder); RunError
    with the reason when it is missing, unreadable (corrupt/truncated) or not one of ours."""
    if not os.path.exists(path):
        tmp = path + ".tmp"   # a DCP save cut before its final rename
        raise RunError(f"--resume: no checkpoint at {path}" + (
            f" ({tmp} is complete: --resume {shlex.quote(tmp)})" if dcp_complete(tmp) else
            f" (only {tmp}, whose writing did not finish: start over with --overwrite)" if os.path.isdir(tmp) else ""))
    if os.path.isdir(path):
        return load_dcp_meta(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        # one line: the reason, without PyTorch's advice on weights_only=False (never for a checkpoint
        # we did not write: unpickling runs code)
        msg = str(e)
        if "WeightsUnpickler error:" in msg:
            detail = msg.split("WeightsUnpickler error:")[1].split(". ")[0].strip()
            reason = f"it holds objects a weights-only load refuses: {detail}"
        elif os.path.getsize(path) == 0:
            reason = "the file is empty"
        else:
            reason = f"{type(e).__name__}: {(msg.splitlines() or [''])[0].split('. ')[0][:200]}"
        raise RunError(f"--resume: checkpoint {path} cannot be read (corrupt or truncated?): {reason}") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != CKPT_FORMAT:
        raise RunError(f"--resume: {path} is not a train.py checkpoint (format {CKPT_FORMAT})")
    return ckpt


def read_log(path):
    """Records of a log.jsonl (list of dicts; [] when the file is missing). A last line that is not
    JSON (a kill mid-append) is skipped with a note; such a line elsewhere is a RunError naming the
    file and line."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    records = []
    for n, line in lines:
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            if n != lines[-1][0]:
                raise RunError(f"{path} line {n} is not a JSON record ({e.msg}); fix or delete that line") from None
            say(f"{path}: skipped its last line {n}, cut off mid-write ({e.msg})")
            continue
        if not (isinstance(r, dict) and isinstance(r.get("type"), str)
                and (r["type"] not in ("step", "eval") or isinstance(r.get("iter"), int))):
            raise RunError(f"{path} line {n} is not a record of this trainer (a JSON object with a \"type\", "
                           f"and an integer \"iter\" for steps and evals); fix or delete that line")
        records.append(r)
    return records


def plot_losses(log_path, png_path):
    """loss.png from log.jsonl (train loss per step, val loss per eval); returns a note string."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no loss.png (pip install matplotlib)"
    steps, evals = [], []
    for r in read_log(log_path):
        if r.get("type") == "step":
            steps.append((r["iter"], r["loss"]))
        elif r.get("type") == "eval":
            evals.append((r["iter"], r["val_loss"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    if steps:
        ax.plot(*zip(*steps), lw=0.6, alpha=0.6, label="train (per step)")
    if evals:
        ax.plot(*zip(*evals), "o-", label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return f"wrote {png_path}"


# ----------------------------------------------------------------------------- main

def set_grad_accum(args, world, ckpt=None):
    """--grad_accum when not given: the checkpoint's when resuming (the global batch stays, on any
    number of processes it divides), else one micro-batch per process. RunError (one line) when it
    does not divide by the number of processes."""
    given = args.grad_accum is not None
    if not given:
        args.grad_accum = ckpt["config"]["grad_accum"] if ckpt is not None else world
    if args.grad_accum % world:
        ours = not given and ckpt is not None
        raise RunError(f"--grad_accum {args.grad_accum}" + (" (the checkpoint's)" if ours else "")
                       + f" must be divisible by the number of processes ({world})"
                       + (f": resume it on a number of processes that divides {args.grad_accum} (a run that "
                          "should move to more processes later starts with a larger --grad_accum)" if ours else ""))


def main(argv=None):
    """Parse argv (list of str; None = sys.argv[1:]) and train. Returns the summary dict.
    Bad flags raise SystemExit(2) with a one-line message; RunError for a diverged run or a bad
    checkpoint."""
    parser, args = parse_args(argv)
    proc = setup_distributed(args)
    resolve_args(args, parser, proc.device_type == "cuda")
    setup_threads(args, proc)
    try:
        torch.manual_seed(args.seed)
        if proc.device_type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        check_out_dir(args, proc)
        if args.resume:
            check_resume_kind(args)
        ckpt = load_checkpoint(resume_path(args)) if args.resume else None  # a bad file fails before data
        set_grad_accum(args, proc.world, ckpt)
        batches = setup_data(args, proc)
        model, replaced = setup_model(args, proc, batches)
        if ckpt is not None and resume_is_done(args, ckpt):  # keep the log and its summary as they are
            log = read_log(os.path.join(args.out_dir, "log.jsonl"))
            return next((r for r in reversed(log) if r.get("type") == "summary"), None)
        say_setup(args, proc, batches, model, replaced)
        if args.fsdp:
            shard_model(model, proc.world)
        optimizer = build_optimizer(args, model, proc.device_type)
        start_iter, best_val = 0, math.inf
        if ckpt is not None:
            start_iter, best_val = resume(args, ckpt, model, optimizer, proc.device_type)
            del ckpt
        say_optimizer(args, model)
        if args.optim in FOURBIT and args.optim != "fp32":
            say(quantized_summary(model, optimizer))
        return train(args, proc, model, optimizer, batches, start_iter, best_val,
                     argv=sys.argv[1:] if argv is None else argv)
    finally:
        if proc.ddp:
            dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except RunError as e:   # one write: under torchrun the ranks' lines do not run into each other
        sys.stderr.write(f"train.py: error{'' if rank0() else ' (rank ' + os.environ['RANK'] + ')'}: {e}\n")
        sys.exit(1)
