"""
Sample text from a train.py run (nanoGPT's sample.py); optionally cast its weights to FP formats
first (paper A's experiment 5 on one checkpoint) and export the model as a plain state dict.

    python examples/sample.py --out_dir out                              # 10 samples from out/ckpt.pt
    python examples/sample.py --out_dir out --start "def main(" --num_samples 3 --max_new_tokens 200
    python examples/sample.py --out_dir out --start FILE:prompt.txt --temperature 0.7 --top_k 50 --seed 1
    python examples/sample.py --ckpt out-fsdp/ckpt                       # a --fsdp run's DCP folder
    python examples/sample.py --out_dir out-pqt --cast tiers             # val loss before/after, then samples
    python examples/sample.py --out_dir out-pqt --cast e3m4 --export out-pqt/e3m4.pt

Any train.py run loads: every --method (GaussWS and DiffQ layers add no noise in eval mode: they
use their weights w), --optim, --param_dtype, preset, a ckpt.pt or a --fsdp run's DCP folder, and
the run's tokenizer (bytes, or GPT-2's: offline it needs TIKTOKEN_CACHE_DIR). --cast tiers casts
each 32x32 weight tile to the Table C format of its learned bitwidth b_t, --cast e3m4 (e2m3, ...)
every tile to that format, and prints the validation loss before and after (what experiment 5 of
`python -m experiments quality` gets for the checkpoint: the same load_run), the mean b_t and the
Table C tier shares; a run without PQT is experiment 5's control (its --parts layers cast at the
b_target tier, or to the format). --export PATH writes {"model": state dict, "model_config"}, which
loads into model.GPT(GPTConfig(**model_config)): no b_i, no noise counters.
"""
import argparse
import contextlib
import math
import os
import re
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # from a clone: the repository root
import data as datamod  # noqa: E402
import gaussws  # noqa: E402
from lowbit.pqt.export import FP_TIERS  # noqa: E402
from lowbit.pqt.surgery import format_of  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from trainer.checkpoint import atomic_write, checkpoints_in, load_checkpoint, resume_path  # noqa: E402
from trainer.flags import OneLineParser  # noqa: E402
from trainer.util import RunError  # noqa: E402


def at_least(lo):
    """argparse type: an integer >= lo."""
    def parse(s):
        if not re.fullmatch(r"\s*[+-]?\d+\s*", s) or int(s) < lo:
            raise argparse.ArgumentTypeError(f"{s!r}: must be an integer >= {lo}")
        return int(s)
    return parse


def temperature(s):
    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not 0 < v < math.inf:
        raise argparse.ArgumentTypeError(f"{s!r}: must be a number > 0 (1 samples the model's distribution, "
                                         "lower is greedier)")
    return v


def cast_format(s):
    try:
        format_of(s)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{s!r}: allowed: tiers (each tile to the Table C format of its b_t) or an FP format eXmY, X = 2..8 "
            "exponent bits, Y = 0..23 mantissa bits (e3m4, e2m3, e4m7, ...)") from None
    return s


def parse_args(argv=None):
    ap = OneLineParser(prog="sample.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--out_dir", help="a train.py run's --out_dir: its checkpoint, found as --resume finds it "
                                         "(default out)")
    where.add_argument("--ckpt", help="a checkpoint: a ckpt.pt, or a --fsdp run's DCP folder (ckpt)")
    ap.add_argument("--start", default="\n", help="the prompt, or FILE:path to read it from a file (default a newline)")
    ap.add_argument("--num_samples", type=at_least(1), default=10, help="samples to draw (default 10)")
    ap.add_argument("--max_new_tokens", type=at_least(1), default=500, help="tokens per sample (default 500)")
    ap.add_argument("--temperature", type=temperature, default=0.8, help="divides the logits (default 0.8)")
    ap.add_argument("--top_k", type=at_least(1), default=200, help="keep the k likeliest tokens (default 200)")
    ap.add_argument("--seed", type=at_least(0), default=1337, help="the same seed gives the same text on CPU")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default cuda when there is one)")
    ap.add_argument("--cast", type=cast_format, default=None,
                    help="cast the weights first: tiers, or an FP format such as e3m4, e2m3")
    ap.add_argument("--export", default=None, metavar="PATH",
                    help="write the model (cast with --cast) as a plain state dict with its model_config")
    args = ap.parse_args(argv)
    if args.start.startswith("FILE:"):
        try:
            with open(args.start[5:], encoding="utf-8") as f:
                args.start = f.read()
        except (OSError, UnicodeDecodeError) as e:
            ap.error(f"--start {args.start}: cannot read it as UTF-8 text ({getattr(e, 'strerror', None) or e})")
    if not args.start:
        ap.error("--start '': an empty prompt; give some text (the default is a newline)")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        ap.error(f"--device {args.device!r}: not a device; allowed: cpu, cuda, cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device here; use --device cpu")
    if args.export and os.path.isdir(args.export):
        ap.error(f"--export {args.export}: a folder; give a file path such as {os.path.join(args.export, 'model.pt')}")
    return ap, args


def find_checkpoint(ap, args):
    """(flag, value, checkpoint path): --ckpt as given (a run folder: its checkpoint), else the one
    train.py --resume would continue in --out_dir (ckpt.pt, or the --fsdp DCP folder ckpt)."""
    flag, given = ("--ckpt", args.ckpt) if args.ckpt else ("--out_dir", args.out_dir or "out")
    if not os.path.exists(given):
        ap.error(f"{flag} {given}: no such {'file or folder' if args.ckpt else 'folder'}")
    if os.path.isdir(given) and checkpoints_in(given):     # a run's folder (a DCP folder holds none of these)
        fsdp = not os.path.exists(os.path.join(given, "ckpt.pt"))
        return flag, given, resume_path(argparse.Namespace(out_dir=given, resume="auto", fsdp=fsdp))
    if args.ckpt:
        return flag, given, given
    ap.error(f"--out_dir {given}: " + ("a file; give it as --ckpt" if os.path.isfile(given) else
             "holds no checkpoint (ckpt.pt, or a --fsdp run's folder ckpt); train into it first: "
             f"python train.py --out_dir {given}"))


def build_model(ck):
    """The run's GPT (model_config), with its PQT layers (apply_pqt with the run's flags) unless
    --method bf16, loaded from the checkpoint (a DCP folder: resharded into whole tensors), in
    eval mode on the CPU. Built on the meta device: no init of weights that are loaded anyway."""
    c = ck["config"]
    with torch.device("meta"):
        model = GPT(GPTConfig(**ck["model_config"]))
        if c["method"] != "bf16":
            gaussws.apply_pqt(model, method=c["method"], parts=c["parts"], b_init=c["b_init"],
                              b_target=c["b_target"], seed=c["seed"], memory=c["pqt_memory"])
    model.to_empty(device="cpu")
    state = ck.get("model")
    if state is None:
        import torch.distributed.checkpoint as dcp
        state = model.state_dict()
        with warnings.catch_warnings():   # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": state}, checkpoint_id=ck["dcp"])
    model.load_state_dict(state)
    return model.eval()


def load_run_of(ck, path, device):
    """experiments.cast.load_run (model, config, val()) for this checkpoint: the quality
    harness's own model and validation loss. load_run reads RUN_DIR/ckpt.pt: a checkpoint by
    another name or a DCP folder is handed to it as one in a temporary folder."""
    from experiments.cast import load_run
    c = ck["config"]
    try:   # load_run prepares it too (then from the cache): a corpus missing here is one line
        datamod.prepare(c["dataset"], c["tokenizer"], data_dir=c["data_dir"], max_tokens=c["max_tokens"], verbose=False)
    except (OSError, RuntimeError, ValueError) as e:
        raise SystemExit(f"sample.py: error: --cast needs the validation split of the run's --dataset "
                         f"{c['dataset']}: {e}") from None
    if "dcp" not in ck and os.path.basename(path) == "ckpt.pt":
        return load_run(os.path.dirname(path) or ".", device)
    with tempfile.TemporaryDirectory() as tmp:
        keep = {k: ck[k] for k in ("format", "config", "model_config")}
        torch.save(dict(keep, model=build_model(ck).state_dict()), os.path.join(tmp, "ckpt.pt"))
        return load_run(tmp, device)


def cast(model, c, val, fmt):
    """Experiment 5 on the loaded run (as experiments.cast.cast_run computes it): val loss
    before, remove_pqt(model, cast=fmt), val loss after; a run without PQT gets the control's
    layers (--parts at b_t = b_target). Prints and returns the numbers."""
    before = val()
    if c["method"] == "bf16":
        gaussws.apply_pqt(model, parts=c["parts"], b_init=c["b_target"], b_target=c["b_target"])
        model.eval()
    stats = gaussws.bitwidth_stats(model)["all"]
    gaussws.remove_pqt(model, cast=fmt)
    after = val()
    upto = [0.0] + [stats[f"share_le{limit}"] for limit, *_ in FP_TIERS] + [1.0]   # b_t <= each tier's limit
    tiers = dict(zip([name for _, name, *_ in FP_TIERS] + [">FP16"], [b - a for a, b in zip(upto, upto[1:])]))
    how = "learned" if c["method"] != "bf16" else f"fixed (no PQT: experiment 5's control, --parts {c['parts']})"
    print(f"--cast {fmt}: val loss {before:.4f} -> {after:.4f} ({after - before:+.4f}) on the run's "
          f"{c['eval_windows']} validation windows")
    print(f"b_t {how}: mean {stats['mean']:.3f}; Table C tiers: "
          + ", ".join(f"{k} {v:.1%}" for k, v in tiers.items() if v > 0))
    return dict(val_loss_before=before, val_loss_after=after, delta=after - before, b_t_mean=stats["mean"],
                tier_share=tiers)


def main(argv=None):
    """Parse argv, load, cast (--cast), export (--export), sample. Returns dict(path, cast: the
    --cast numbers or None, samples: the texts, model: the model sampled from). Bad input:
    SystemExit with one line."""
    ap, args = parse_args(argv)
    flag, given, path = find_checkpoint(ap, args)
    try:
        ck = load_checkpoint(path)
    except RunError as e:     # its messages name train.py's --resume: here the flag is ours
        ap.error(f"{flag} {given}: {re.sub(r'^--resume:? ', '', str(e))}")
    c, device = ck["config"], torch.device(args.device)
    try:
        tok = datamod.get_tokenizer(c.get("tokenizer", "byte" if ck["model_config"]["vocab_size"] == 256 else "gpt2"),
                                    verbose=False)
    except RuntimeError:        # GPT-2's offline without TIKTOKEN_CACHE_DIR
        raise SystemExit(f"sample.py: error: {path} was trained with the GPT-2 tokenizer and tiktoken cannot "
                         f"load its gpt2 files here; set TIKTOKEN_CACHE_DIR to a folder holding them") from None
    print(f"{path}: step {ck['iter_num']} of {c['preset']} {c['method']}"
          + (f"[{c['parts']}]" if c["method"] != "bf16" else "")
          + f" + {c['optim']}, {c.get('param_dtype', 'fp32')} params, {tok.name} tokens")
    numbers = None
    if args.cast and not c.get("eval_windows"):
        ap.error(f"--cast: the run was trained with --eval_windows {c.get('eval_windows')}, so it has no "
                 f"validation windows to measure the cast on")
    if args.cast:
        model, _, val = load_run_of(ck, path, device)
        numbers = cast(model, c, val, args.cast)
    else:
        model = build_model(ck).to(device)
    if args.export:
        if gaussws.pqt_layers(model):
            gaussws.remove_pqt(model)
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        os.makedirs(os.path.dirname(os.path.abspath(args.export)), exist_ok=True)
        atomic_write(args.export, lambda f: torch.save(dict(model=state, model_config=ck["model_config"],
                                                            cast=args.cast, iter_num=ck["iter_num"]), f))
        print(f"exported to {args.export}: model.GPT(GPTConfig(**d['model_config'])).load_state_dict(d['model'])")
    ids = [int(i) for i in tok.encode(args.start)]
    block = model.config.block_size
    if len(ids) > block:     # what generate sees anyway: the model's context is its block size
        print(f"the prompt has {len(ids)} tokens: cropped to the last {block} (the model's block size)")
        ids = ids[-block:]
    x = torch.tensor([ids], dtype=torch.long, device=device)
    bf16 = c["dtype"] == "bfloat16" and device.type == "cuda"     # as the run computed; FP32 on a CPU (nanoGPT)
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    torch.manual_seed(args.seed)
    samples = []
    with torch.no_grad(), ctx:
        for _ in range(args.num_samples):
            y = model.generate(x, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k)
            # ids past the tokenizer's vocabulary are the padding rows (GPT-2: 50257 -> 50304): no text
            samples.append(tok.decode([i for i in y[0].tolist() if i < tok.vocab_size]))
            print(samples[-1])
            print("---------------")
    return dict(path=path, cast=numbers, samples=samples, model=model)


if __name__ == "__main__":
    main()
