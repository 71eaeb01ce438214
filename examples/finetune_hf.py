"""
Fine-tune a Hugging Face causal LM on a text file with GaussWS PQT (paper A) and ZIP-SR 4-bit AdamW
states (paper B) through the Hugging Face Trainer, then hand back a plain model (remove_pqt) that
loads with `from_pretrained` and no code of this repository.

    python examples/finetune_hf.py --text corpus.txt                  # tiny Llama from a config, bytes; CPU, ~1 min
    python examples/finetune_hf.py --model HuggingFaceTB/SmolLM2-135M --text corpus.txt --max_steps 2000 \
        --block_size 512 --lr 3e-4 --cast tiers --out smollm-pqt           # a real model, on a GPU

Needs `pip install transformers accelerate` (optional for the rest of the repository). The steps:
apply_pqt samples the Llama-style projections (q/k/v/o, gate/up/down); the embeddings and the LM
head keep FP32 optimizer states (a param group with quantize=False), everything else gets 4-bit
states; weight decay on b_i pulls each tile's bitwidth from --b_init toward --b_target (eq. 11).
At the end the validation loss is measured with the trained weights, and again after the weights
are cast to --cast (each tile to its Table C format, or one FP format such as e3m4).
"""
import argparse
import math
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # from a clone: the repository root
import gaussws  # noqa: E402
from lowbit.pqt.checks import METHODS, check_bits  # noqa: E402
from lowbit.pqt.surgery import format_of, parse_parts  # noqa: E402
from adam4bit import AdamW4bit, PRESETS  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--text", required=True, help="a UTF-8 text file to fine-tune on (the last 5 %% is validation)")
    p.add_argument("--model", default=None,
                   help="Hugging Face model name or local path; default: a tiny Llama built from a config, byte tokens")
    p.add_argument("--out", default=None,
                   help="folder for the plain model (save_pretrained), with --model's tokenizer when --model is given")
    p.add_argument("--method", default="gaussws", choices=METHODS, help="PQT method of apply_pqt")
    p.add_argument("--parts", default="all",
                   help="'all', 'od' or a list such as 'q,k,v,out' or 'q_proj,o_proj' (gaussws.apply_pqt)")
    p.add_argument("--b_init", type=float, default=6.0, help="bits b_t starts at (paper A eq. 11)")
    p.add_argument("--b_target", type=float, default=4.0, help="bits weight decay pulls b_t to (eq. 11)")
    p.add_argument("--bits_wd", type=float, default=0.1, help="weight decay on b_i")
    p.add_argument("--optim", default="zipsr", choices=sorted(PRESETS), help="AdamW4bit preset")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--weight_decay", type=float, default=0.1, help="AdamW weight decay of the weights")
    p.add_argument("--max_steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--batch_size", type=int, default=8, help="windows per step")
    p.add_argument("--block_size", type=int, default=128, help="tokens per training window")
    p.add_argument("--cast", default="tiers",
                   help="'none' (remove_pqt's cast=None: weights as trained), 'tiers' or an FP format such as e3m4")
    p.add_argument("--seed", type=int, default=0, help="model init, data order and GaussWS noise")
    args = p.parse_args(argv)
    # every input is checked here, before a model is loaded or trained: one line, no traceback
    if os.path.isdir(args.text):
        p.error(f"--text {args.text!r} is a folder: give one UTF-8 text file")
    if not os.path.isfile(args.text):
        p.error(f"--text {args.text!r}: no such file")
    try:
        with open(args.text, encoding="utf-8") as f:
            if not f.read(1):
                p.error(f"--text {args.text!r} is empty")
            f.read()
    except UnicodeDecodeError as e:
        p.error(f"--text {args.text!r} is not UTF-8 text ({e.reason} at byte {e.start})")
    if args.out is not None and os.path.exists(args.out) and not os.path.isdir(args.out):
        p.error(f"--out {args.out!r} is a file: give a folder (new or existing)")
    if args.model is not None and not os.path.isdir(args.model) and not re.fullmatch(
            r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?", args.model):
        p.error(f"--model {args.model!r}: neither a local folder nor a Hugging Face model id (name or owner/name)")
    for name in ("max_steps", "batch_size", "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)}: must be >= 1")
    for name in ("lr", "weight_decay", "bits_wd"):
        v = getattr(args, name)
        if not (math.isfinite(v) and (v > 0 if name == "lr" else v >= 0)):
            p.error(f"--{name} {v}: must be a finite number {'> 0' if name == 'lr' else '>= 0'}")
    try:                 # the checks apply_pqt and remove_pqt make, before the model is loaded
        parse_parts(args.parts)
        check_bits(args.b_init, args.b_target)
        args.cast = None if args.cast == "none" else args.cast
        format_of(args.cast)
    except ValueError as e:
        p.error(f"--{str(e).replace('=', ' ', 1)}")
    return args


def load_model(args, tf):
    """(model, tokenizer or None): the --model checkpoint, or a tiny Llama from a config (random
    weights, 256 byte tokens) when --model is not given."""
    if args.model is not None:
        try:
            tok = tf.AutoTokenizer.from_pretrained(args.model)
            return tf.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32), tok
        except OSError as e:        # not on the hub, offline, no such folder content: one line
            raise SystemExit(f"--model {args.model!r}: {str(e).strip().splitlines()[0]}") from None
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.block_size)
    return tf.LlamaForCausalLM(cfg), None


def windows(args, tok):
    """(train, val): lists of {"input_ids", "labels"} windows of block_size tokens of --text; the
    model shifts the labels itself."""
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    ids = tok(text)["input_ids"] if tok is not None else list(text.encode("utf-8"))
    ids = torch.tensor(ids, dtype=torch.long)
    n = len(ids) // args.block_size
    if n < 2:
        raise SystemExit(f"--text {args.text!r}: {len(ids)} tokens, fewer than two windows of "
                         f"--block_size {args.block_size}")
    rows = [dict(input_ids=r, labels=r) for r in ids[:n * args.block_size].view(n, args.block_size)]
    n_val = max(1, n // 20)
    return rows[:-n_val], rows[-n_val:]


def optimizer(args, model):
    """AdamW4bit groups: the embeddings and LM head with FP32 states, b_i with bits_wd, the rest
    4-bit (only tensors of >= 4096 elements and a multiple of 128 are quantized)."""
    heads = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    fp32, bits, rest = [], [], []
    for name, p in model.named_parameters():
        (fp32 if id(p) in heads else bits if name.endswith("b_i") else rest).append(p)
    groups = [dict(params=fp32, quantize=False), dict(params=bits, weight_decay=args.bits_wd),
              dict(params=rest)]
    return AdamW4bit([g for g in groups if g["params"]], lr=args.lr, betas=(0.9, 0.95),
                     weight_decay=args.weight_decay, preset=args.optim, seed=args.seed)   # paper B's betas


def main(argv=None):
    args = parse_args(argv)
    try:
        import transformers as tf
    except ImportError:
        raise SystemExit("finetune_hf.py needs Hugging Face transformers: pip install transformers accelerate")
    tf.set_seed(args.seed)
    if not torch.cuda.is_available() and not os.environ.get("OMP_NUM_THREADS"):
        # the cores less one: OpenMP threads wait for each other at the end of every op, so one
        # thread descheduled by another busy process stalls them all (train.py does the same)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))
    model, tok = load_model(args, tf)
    train, val = windows(args, tok)
    replaced = gaussws.apply_pqt(model, method=args.method, parts=args.parts, b_init=args.b_init,
                                 b_target=args.b_target, seed=args.seed)
    print(f"PQT on {len(replaced)} layers ({replaced[0]}, ...); {len(train)} train / {len(val)} val windows")
    opt = optimizer(args, model)
    warmup = max(1, args.max_steps // 10)

    def lr_factor(step):   # linear warmup over 10 % of the steps, then cosine down to 10 %
        return min(1.0, (step + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * min(1.0, step / args.max_steps)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    cuda = torch.cuda.is_available()
    targs = tf.TrainingArguments(output_dir=args.out or "out-finetune-hf", max_steps=args.max_steps,
                                 per_device_train_batch_size=args.batch_size,
                                 logging_steps=max(1, args.max_steps // 10), save_strategy="no",
                                 report_to="none", seed=args.seed, disable_tqdm=True, bf16=cuda, use_cpu=not cuda)
    trainer = tf.Trainer(model=model, args=targs, train_dataset=train, eval_dataset=val,
                         optimizers=(opt, sched))
    t0 = time.time()
    trainer.train()
    before = trainer.evaluate()["eval_loss"]
    stats = gaussws.bitwidth_stats(model)["all"]
    print(f"trained {args.max_steps} steps in {time.time() - t0:.0f} s; val loss {before:.4f}; "
          f"b_t mean {stats['mean']:.2f} (min {stats['min']:.2f}, max {stats['max']:.2f}), "
          f"optimizer states {opt.state_nbytes() / 2 ** 20:.2f} MiB")
    gaussws.remove_pqt(model, cast=args.cast)
    after = trainer.evaluate()["eval_loss"]
    print(f"plain model, weights cast to {args.cast or 'nothing'}: val loss {after:.4f} ({after - before:+.4f})")
    if args.out:
        model.save_pretrained(args.out)
        if tok is not None:
            tok.save_pretrained(args.out)
        print(f"wrote {args.out} (load it with transformers' AutoModelForCausalLM.from_pretrained)")
    return before, after


if __name__ == "__main__":
    main()
