"""Paper A's experiment 5 on a finished quality run: its trained tiles cast to the FP formats of
Table C (and to every format of CAST_SWEEP), the validation loss before and after, and
Figure 5's learned bitwidths; written to the run's cast.json. The formats and the casts themselves
(FP_TIERS, CAST_SWEEP, cast_tiles, cast_to_tiers) live in lowbit/pqt/export.py."""
import contextlib
import json
import os

import torch

import data as datamod
import gaussws as g
from lowbit.pqt.export import CAST_SWEEP, cast_tiles, cast_to_tiers
from model import GPT, GPTConfig
from trainer.checkpoint import load_checkpoint
from trainer.metrics import evaluate


def load_run(run_dir, device="cpu"):
    """(model in eval mode on device, run config, val()) from run_dir/ckpt.pt of a train.py run;
    val() is the run's validation loss (trainer.metrics.evaluate on its windows, batch size,
    autocast dtype). In eval mode GaussWSLinear layers use their weights w as they are (no noise)."""
    ck = load_checkpoint(os.path.join(run_dir, "ckpt.pt"))
    c = ck["config"]
    model = GPT(GPTConfig(**ck["model_config"]))
    if c["method"] != "bf16":
        g.apply_pqt(model, method=c["method"], parts=c["parts"], b_init=c["b_init"], b_target=c["b_target"],
                    seed=c["seed"], memory=c["pqt_memory"])
    model.load_state_dict(ck["model"])
    device = torch.device(device)
    model.to(device).eval()
    folder = datamod.prepare(c["dataset"], c["tokenizer"], data_dir=c["data_dir"], max_tokens=c["max_tokens"],
                             verbose=False)
    batches = datamod.Batches(folder, c["block_size"], seed=c["seed"])
    ctx = (torch.autocast(device.type, dtype=torch.bfloat16) if c["dtype"] == "bfloat16"
           else contextlib.nullcontext())
    return model, c, lambda: evaluate(model, batches, c["eval_windows"], c["batch_size"], ctx, device)


def cast_run(d, label, device=None):
    """Experiment 5 and paper A Figure 5 on the finished run in folder d: val loss of the plain
    weights w before and after cast_to_tiers. GaussWS/DiffQ runs use each tile's learned
    b_t; a BF16 run is the control: its same layers (--parts) are cast at the fixed b_target tier
    (does PQT training make the model more tolerant than plain training?). The model's same layers
    are also cast to every format of CAST_SWEEP in turn (from the trained weights).
    Returns dict(row={val_loss_before, val_loss_after, delta, tier_share, tiers, sweep_delta:
    {"e3m4": val loss change, ...}}, bitwidth=Figure 5 statistics of the learned b_t (None for
    BF16), layers=gaussws.bitwidth_stats per layer, for plots.plot_bitwidth (None for BF16))."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, c, val = load_run(d, device)
    before = val()
    bits = stats = None
    if c["method"] == "bf16":
        g.apply_pqt(model, parts=c["parts"], b_init=c["b_target"], b_target=c["b_target"])
        model.eval()
        tiers = f"fixed b_target {c['b_target']:g}"
    else:
        stats = g.bitwidth_stats(model)
        bits = dict(method=c["method"], layers={k: v for k, v in stats.items() if k != "all"},
                    **{k: stats["all"][k] for k in ("mean", "std", "min", "max", "share_le5", "share_le9",
                                                  "share_le12")})
        tiers = "learned b_t"
    layers = [layer for _, layer in g.pqt_layers(model)]
    w0 = [layer.weight.detach().clone() for layer in layers]
    sweep = {}
    for e, mb in CAST_SWEEP:
        with torch.no_grad():
            for layer, w in zip(layers, w0):
                layer.weight.copy_(cast_tiles(w, e, mb))
        sweep[f"e{e}m{mb}"] = val() - before
    with torch.no_grad():
        for layer, w in zip(layers, w0):
            layer.weight.copy_(w)
    share = cast_to_tiers(g.pqt_layers(model))
    after = val()
    print(f"[cast] {label} ({tiers}): val loss {before:.4f} -> {after:.4f} ({after - before:+.4f}); "
          + ", ".join(f"{k} {v:.1%}" for k, v in share.items() if v)
          + "; every tile at " + ", ".join(f"{k} {v:+.4f}" for k, v in sweep.items()))
    return dict(row=dict(val_loss_before=before, val_loss_after=after, delta=after - before, tier_share=share,
                         tiers=tiers, sweep_delta=sweep), bitwidth=bits, layers=stats)


def save_cast(d, label, device=None):
    """cast_run on run folder d, written to d/cast.json (atomically): the run's experiment-5
    numbers outlive its checkpoint."""
    res = cast_run(d, label, device)
    tmp = os.path.join(d, "cast.json.tmp")
    with open(tmp, "w") as f:
        json.dump(res, f)
    os.replace(tmp, os.path.join(d, "cast.json"))
    return res
