"""train.py's command line: the parser, the device-dependent defaults and every check of a flag or
a flag combination (a one-line parser.error before any data or model is built: optional packages
included), the notes on flags that cost or do less than their name says, and the numbers derived
from flags alone. Reads flags; builds nothing."""

import argparse
import importlib.util
import math
import os

import torch

import adam4bit
import data as datamod
from lowbit.pqt.checks import B_MAX, B_MIN
from codebooks import CODEBOOKS, get_codebook
from model import PRESETS, preset_config
from trainer.util import rank0, say
from lowbit.optim.args import V_ROUNDINGS, quantizer_config
from lowbit.optim.param_write import PARAM_ROUNDINGS

METHODS = ("bf16", "gaussws", "diffq")
OPTIMS = ("adamw", "fp32", "torchao", "zipsr", "zeeden", "adam-mini")
ADAMW4BIT_PRESETS = ("fp32", "torchao", "zipsr", "zeeden")      # adam4bit.AdamW4bit's presets (adam4bit.PRESETS)
# of those, the ones that keep 4-bit states (fp32 keeps FP32 states: AdamW4bit's plain AdamW)
FOURBIT_PRESETS = tuple(p for p in ADAMW4BIT_PRESETS if adam4bit.PRESETS[p]["m_codebook"] is not None)
# optional packages a flag needs: (flag, value) -> (module, pip package)
PACKAGES = {("optim", "adam-mini"): ("adam_mini", "adam-mini")}
SCHEDULES = ("wsd", "cosine", "constant")
# Peak learning rates: paper B Table 7 where it has the size, nanoGPT's 6e-4 for GPT-2 124M,
# and a larger rate for the CPU-sized models (few hundred steps).
DEFAULT_LR = {"nano": 3e-3, "nano-llama": 3e-3, "tiny": 2e-3, "small": 1e-3, "mini": 2e-3,
              "tiny-llama": 2e-3, "gpt2-124m": 6e-4, "gpt-162m": 1e-3, "gpt-405m": 6e-4,
              "gpt-834m": 6e-4, "llama-130m": 2e-3, "llama-134m": 2e-3, "llama-1b": 3e-4,
              "llama-3b": 1.5e-4, "llama-70b-4l": 1e-4}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")   # torch.compile's

# the first paragraph of train.py's docstring: --help's description
DESCRIPTION = ("Train a GPT with optional pseudo-quantization training (GaussWS / DiffQ, paper A) and optional\n"
               "4-bit AdamW states (ZIP-SR / ZE-EDEN / TorchAO-style, paper B).")


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage dump) and exits with status 2; under
    torchrun only rank 0 prints it (every rank parses the same flags)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n" if rank0() else None)


def build_parser():
    # allow_abbrev=False: the quality harness (experiments/quality.py) sets some flags per run and refuses them in --train_args by
    # name, so an abbreviation (--max_it) must not slip through as the full flag
    p = OneLineParser(prog="train.py", description=DESCRIPTION,
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    g = p.add_argument_group("model and data")
    g.add_argument("--preset", default="auto", choices=("auto",) + tuple(PRESETS),
                   help="model shape; auto: tiny on CPU, gpt2-124m on CUDA")
    g.add_argument("--dataset", default="stdlib",
                   help="stdlib | shakespeare | openwebtext | fineweb-edu | c4 | a local UTF-8 text file or folder "
                        "| a prepared data folder (meta.json). Validation split: a folder's files named val, valid or "
                        "validation (val.txt, val_00.txt, ...), otherwise the last 10%% of the tokens")
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
    g.add_argument("--v_rounding", default=None, choices=V_ROUNDINGS,
                   help="4-bit presets only: second-moment rounding rule instead of the preset's (paper B App. A.2)")
    g.add_argument("--param_dtype", default="fp32", choices=("fp32", "bf16"),
                   help="dtype the model parameters are stored in (bf16: no FP32 master copy; b_i stay FP32)")
    g.add_argument("--param_rounding", default="rtn", choices=PARAM_ROUNDINGS,
                   help="AdamW4bit presets, --param_dtype bf16: how the new BF16 weight is written (sr: stochastic)")
    g.add_argument("--master_weight_bits", type=int, default=None, choices=(24,),
                   help="AdamW4bit presets, --param_dtype bf16: 24 keeps an int8 correction per weight (+1 B/param)")
    g.add_argument("--capturable", action="store_true",
                   help="AdamW4bit presets: the optimizer step replays as one CUDA graph (AdamW4bit(capturable=True)); "
                        "CUDA only: on CPU it changes nothing (said at start-up)")
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
    g.add_argument("--activation_checkpointing", action="store_true",
                   help="keep only each transformer block's input and recompute the block in backward "
                        "(torch.utils.checkpoint, non-reentrant): activations of one block at a time")
    g.add_argument("--step_in_backward", action="store_true",
                   help="step each parameter as soon as its gradient is complete and free the gradient "
                        "(lowbit.step_in_backward): no full set of gradients; needs --grad_clip 0, one micro-step "
                        "per step, one process")
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
                   help="torch.compile the model; default: on for CUDA, off on CPU (there the first step compiles "
                        "for minutes)")
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
                   help="checkpoint, log.jsonl and loss.png go here; one run at a time (a second run into it "
                        "is refused while the first lives); Ctrl-C or SIGTERM saves a checkpoint at the next step "
                        "boundary, a second one exits at once")
    g.add_argument("--resume", nargs="?", const="auto", default=None,
                   help="continue from OUT_DIR/ckpt.pt (--fsdp: the folder OUT_DIR/ckpt), or from the given "
                        "checkpoint or out_dir (the run then writes "
                        "its checkpoints and log.jsonl to --out_dir, default out); --max_iters / "
                        "--tokens_per_param / --stop_after may change, and the flags that leave the numbers alone "
                        "(eval, compile, device, threads); every other flag must match")
    g.add_argument("--overwrite", action="store_true",
                   help="start a fresh run in an --out_dir that holds a checkpoint, replacing it and log.jsonl "
                        "(with --resume PATH from another folder: continue that run here, replacing them)")
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
    if args.overwrite and args.resume == "auto":
        parser.error("--overwrite and --resume: give one of them (--overwrite starts over, --resume continues)")
    if args.schedule == "wsd" and args.warmup_frac + args.cooldown_frac > 1:
        parser.error(f"--warmup_frac {args.warmup_frac:g} + --cooldown_frac {args.cooldown_frac:g} > 1: "
                     f"warmup and cooldown must fit in the run")
    check_optimizer_flags(parser, args)
    check_fsdp_flags(parser, args)
    check_memory_flags(parser, args)
    for name in ("b_init", "b_target"):  # GaussWSLinear's range
        check_range(parser, name, getattr(args, name), lo=B_MIN, hi=B_MAX)
    if args.b_target > args.b_init:
        parser.error(f"--b_target {args.b_target} > --b_init {args.b_init}: need b_target <= b_init (paper A eq. 11)")
    allowed = preset_config(args.preset).parts
    args.parts = ",".join(x.strip() for x in args.parts.split(","))   # "qkv, out" as apply_pqt reads it
    if args.parts not in ("all", "od"):
        bad = [x for x in args.parts.split(",") if x not in allowed]
        if bad or not args.parts:
            parser.error(f"--parts {args.parts!r}: unknown part(s) {', '.join(bad) or '(empty)'} for preset "
                         f"{args.preset}; allowed: all, od, or a comma list of {','.join(allowed)}")
    check_packages(parser, args)
    say_ignored_flags(args, parser)
    say_device_notes(args, cuda)
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
    return {k: v for k, v in (("v_codebook", args.v_codebook), ("v_rounding", args.v_rounding)) if v is not None}


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


def check_packages(parser, args):
    """parser.error (one line) when a flag needs an optional package that is not installed
    (PACKAGES), before any data or model is built."""
    for (name, value), (module, package) in PACKAGES.items():
        if getattr(args, name) == value and importlib.util.find_spec(module) is None:
            parser.error(f"--{name} {value} needs the {package} package, which is not installed: "
                         f"pip install {package}")


def say_device_notes(args, cuda):
    """One line per flag that costs or does less on this device than its name suggests: on CPU
    --capturable changes nothing (it captures the optimizer step as a CUDA graph), and --compile
    spends minutes compiling inside the first step (more with PQT), during which one Ctrl-C waits."""
    if cuda:
        return
    if args.capturable:
        say("note: --capturable changes nothing on CPU (it replays the optimizer step as a CUDA graph); "
            "the step runs as without it")
    if args.compile:
        say("note: --compile on CPU: the first step compiles for minutes" + (" (longer with PQT)"
            if args.method != "bf16" else "") + "; a Ctrl-C meanwhile stops with a checkpoint only after that "
            "step, a second one (2 s or more later) stops at once")


def what_trains(args):
    """What the run trains, whatever the flags are named: the weights' dtype, the autocast dtype
    (None: no autocast, the math in the weights' dtype), and the PQT method on its parts (None:
    no PQT; --method bf16 names no dtype). The start-up line and the log's summary say it."""
    return {"weights_dtype": "bfloat16" if args.param_dtype == "bf16" else "float32",
            "autocast_dtype": None if args.dtype == "float32" else args.dtype,
            "pqt": None if args.method == "bf16" else f"{args.method}[{args.parts}]"}


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


def check_memory_flags(parser, args):
    """parser.error (one line) for --step_in_backward with what needs every gradient at once."""
    if args.step_in_backward:
        refusals = [   # (what is set, why it cannot be, in the order a user meets them)
            (args.grad_clip > 0, f"--grad_clip {args.grad_clip:g}: clipping by the global norm needs every "
                                 f"gradient before the first step; add --grad_clip 0"),
            ((args.grad_accum or 1) > 1, f"--grad_accum {args.grad_accum}: each micro-step would step on a "
                                         f"partial gradient; use --grad_accum 1 and a larger --batch_size"),
            (int(os.environ.get("WORLD_SIZE", 1)) > 1, f"{os.environ.get('WORLD_SIZE', 1)} processes (torchrun): the "
                                                       "gradients are all-reduced after backward, after the step; "
                                                       "run one process"),
            (args.capturable, "--capturable: the captured step updates every parameter at once")]
        why = next((why for bad, why in refusals if bad), None)
        if why:
            parser.error(f"--step_in_backward with {why}")


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
    a signed codebook): AdamW4bit's check of its components runs here, before any data or model,
    without building an optimizer."""
    bf16_write = [f for f, on in (("--param_rounding sr", args.param_rounding == "sr"),
                                  ("--master_weight_bits 24", args.master_weight_bits)) if on]
    if bf16_write and (args.param_dtype != "bf16" or args.optim not in ADAMW4BIT_PRESETS):
        parser.error(f"{' '.join(bf16_write)}: only with --param_dtype bf16 and an AdamW4bit preset "
                     f"(--optim {'|'.join(ADAMW4BIT_PRESETS)}), got --param_dtype {args.param_dtype} "
                     f"--optim {args.optim}")
    if args.capturable and args.optim not in ADAMW4BIT_PRESETS:
        parser.error(f"--capturable: only with an AdamW4bit preset (--optim {'|'.join(ADAMW4BIT_PRESETS)}), "
                     f"got --optim {args.optim}")
    if len(bf16_write) == 2:
        parser.error("--param_rounding sr with --master_weight_bits 24: the correction keeps the residual of "
                     "a round-to-nearest write; give one of them")
    over = optimizer_overrides(args)
    if not over:
        return
    flags = " ".join(f"--{k} {v}" for k, v in over.items())
    if args.optim not in FOURBIT_PRESETS:
        parser.error(f"{flags}: only for the 4-bit AdamW presets (--optim {'|'.join(FOURBIT_PRESETS)}), "
                     f"not --optim {args.optim}")
    try:   # AdamW4bit's own check of its components (the preset's with these replaced)
        quantizer_config(adam4bit.PRESETS, get_codebook, args.optim, block_size=128, m_codebook=None,
                         m_rounding=None, v_codebook=over.get("v_codebook"), v_rounding=over.get("v_rounding"),
                         eden=None, lm_head_sr_after="preset")   # block_size: AdamW4bit's default, train.py's
    except (ValueError, TypeError) as e:
        parser.error(f"{flags} with --optim {args.optim}: {e}")


def tokens_per_step(args):
    return args.batch_size * args.block_size * args.grad_accum


def end_iter(args):
    """The step this run stops at: --stop_after when given, else --max_iters."""
    return min(args.max_iters, args.stop_after) if args.stop_after else args.max_iters
