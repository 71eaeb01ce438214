"""Figures drawn from result JSON files: the quality runs' curves, paper A Figure 5 and experiment 5,
one PNG per results/*.json section; reads JSON and writes PNGs (matplotlib, optional), nothing else.
"""
import json
import math
import os


# ---------------------------------------------------------------------------------------------
# figures: the quality runs' curves, Figure 5, experiment 5, and one PNG per result JSON

def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return None


def _finish(plt, fig, ax, png):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    print("wrote", png)


def plot_quality(exp, rows, png, train_loss=False, noise_floor=None):
    """Curves of an experiment's runs from its result rows (label -> row with "curves").
    train_loss=True: the smoothed training loss of every seed (as in paper B Figure 1). Otherwise
    the val loss averaged over seeds per run, and beside it each run's gap to the first run (the
    baseline) at the same evals, where differences of 0.01 would be invisible on the loss scale,
    with ± noise_floor (the same-seed rerun spread of the final losses) shaded when given."""
    plt = _pyplot()
    if plt is None:
        return
    if train_loss:
        fig, ax = plt.subplots(figsize=(7, 4))
        top = None
        for label, row in rows.items():
            for c in row.get("curves", []):
                pts = c["train"]
                if not pts:
                    continue
                if top is None:     # y range: the first run's curve after its first steps
                    top = max(p[1] for p in pts[len(pts) // 20:])
                    bottom = min(p[1] for p in pts)
                ax.plot(*zip(*pts), lw=1, label=f"{label} seed {c['seed']}")
        if top is not None and math.isfinite(top) and math.isfinite(bottom):
            ax.set_ylim(bottom - 0.05 * (top - bottom), top + 0.05 * (top - bottom))
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (smoothed)")
        ax.set_title(exp)
        _finish(plt, fig, ax, png)
        return

    def mean_curve(row):   # {step: mean val loss over the seeds that have it}
        by_step = {}
        for c in row.get("curves", []):
            for step, v in c["val"]:
                by_step.setdefault(step, []).append(v)
        return {k: sum(v) / len(v) for k, v in sorted(by_step.items())}
    curves = {label: mean_curve(row) for label, row in rows.items()}
    base = next(iter(curves.values()), {})
    fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4))
    for label, cv in curves.items():
        n = len(rows[label].get("curves", []))
        if cv:
            ax.plot(list(cv), list(cv.values()), lw=1, marker="o", ms=3, label=f"{label} ({n} seeds)")
        late = [k for k in cv if k in base and k >= 0.2 * max(base, default=0)]
        ax2.plot(late, [cv[k] - base[k] for k in late], lw=1, marker="o", ms=3, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("val loss (mean over seeds)")
    ax.set_title(exp)
    ax2.axhline(0, color="k", lw=0.8)
    if noise_floor:
        ax2.axhspan(-noise_floor, noise_floor, color="0.88", zorder=0, label="± same-seed rerun spread")
        ax2.legend(fontsize=7)
    ax2.set_xlabel("step")
    ax2.set_ylabel(f"val loss - {next(iter(rows), '')} (means)")
    ax2.set_title(f"{exp}: gap to the first run, from 20 % of the steps")
    ax2.grid(alpha=0.3)
    # each seed's final val loss per run (a seed's runs share data order and initial weights, so
    # the lines between a seed's points show the paired gaps the tables report)
    names = list(rows)
    for seed in sorted({s for row in rows.values() for s in row.get("seeds", [])}):
        pts = [(i, row["final_val_loss"][row["seeds"].index(seed)]) for i, row in enumerate(rows.values())
               if seed in row.get("seeds", []) and row["final_val_loss"][row["seeds"].index(seed)] is not None]
        if pts:
            ax3.plot(*zip(*pts), lw=0.6, marker="o", ms=4, label=f"seed {seed}")
    ax3.set_xticks(range(len(names)), [n if len(n) <= 26 else n[:25] + "…" for n in names], rotation=30,
                   ha="right", fontsize=7)
    ax3.set_ylabel("final val loss")
    ax3.set_title(f"{exp}: final val loss per seed")
    ax3.grid(alpha=0.3)
    ax3.legend(fontsize=7)
    _finish(plt, fig, ax, png)


def plot_bitwidth(stats, png, title):
    """Paper A Figure 5: per PQT layer (in model order) the mean learned b_t with +-std (thick)
    and min-max (thin) bars, and the Table C tier limits 5/9/12 bits."""
    plt = _pyplot()
    if plt is None:
        return
    names = [k for k in stats if k != "all"]
    x = range(len(names))
    mean = [stats[k]["mean"] for k in names]
    fig, ax = plt.subplots(figsize=(max(6, 0.25 * len(names)), 4))
    ax.errorbar(x, mean, yerr=[[m - stats[k]["min"] for m, k in zip(mean, names)],
                               [stats[k]["max"] - m for m, k in zip(mean, names)]],
                fmt="none", ecolor="gray", elinewidth=0.8, capsize=2, label="min-max")
    ax.errorbar(x, mean, yerr=[stats[k]["std"] for k in names], fmt="o", ms=3, elinewidth=2.5,
                label="mean +- std")
    for lim in (5, 9, 12):
        ax.axhline(lim, ls=":", lw=0.8, color="k")
    a = stats["all"]
    ax.set_title(title + f"\nparams at <=5 / <=9 / <=12 bits: {a['share_le5']:.1%} / {a['share_le9']:.1%} / "
                 f"{a['share_le12']:.1%}", fontsize=9)
    ax.set_xticks(list(x))
    ax.set_xticklabels([k.replace("blocks.", "") for k in names], rotation=90, fontsize=6)
    ax.set_ylabel("b_t (bits)")
    _finish(plt, fig, ax, png)


def plot_cast(cast, png):
    """Experiment 5: val-loss change after casting every PQT tile to each lowbit.pqt.export.CAST_SWEEP format, one
    line per run label (the mean over its seeds, labels "<run> s<seed>"), log scale."""
    plt = _pyplot()
    rows = {k: v for k, v in cast.items() if v.get("sweep_delta")}
    if plt is None or not rows:
        return
    by_run = {}
    for label, row in rows.items():
        by_run.setdefault(label.rsplit(" s", 1)[0], []).append(row["sweep_delta"])
    fig, ax = plt.subplots(figsize=(7, 4))
    for run, sweeps in by_run.items():
        fmts = list(sweeps[0])
        ax.plot(fmts, [max(sum(s[f] for s in sweeps) / len(sweeps), 1e-5) for f in fmts], marker="o",
                label=f"{run} ({len(sweeps)} seeds)")
    ax.set_yscale("log")
    ax.set_xlabel("format of every PQT tile (per-tile power-of-two scale)")
    ax.set_ylabel("val loss increase (mean over seeds; floor 1e-5)")
    ax.set_title("Experiment 5: cast after training")
    _finish(plt, fig, ax, png)


def _bars(ax, labels, values, title, unit):
    ax.barh(range(len(labels)), values, color="tab:blue")
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:.3g}", va="center", fontsize=7)
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)


def plot_results(paths):
    """PNG next to each result JSON (results/<gpu>_<date>_<section>.json -> .png): optim (step
    time per optimizer, bandwidth floor), train (Table 1 overhead vs BF16), memory (bytes/param
    per training-state part), noise (eq. 3 forward time per shape), ddp (1 vs N GPU loss curves),
    multigpu (per case: val loss of 1 GPU, DDP, FSDP2 and FSDP2 resumed on 1; tokens/s),
    quality (final val loss per run and seed; beside it <stem>_<experiment>.png, each
    experiment's curves when the JSON has them, <stem>_cast.png for experiment 5 and
    <stem>_bitwidth.png, the Figure 5 chart). Returns the PNG paths written."""
    plt = _pyplot()
    if plt is None:
        return []
    out = []
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        stem = path[:-5]
        section = os.path.basename(stem).rsplit("_", 1)[-1]   # <gpu>_<date>_<section>, or quality.json
        if section not in ("optim", "memory", "noise", "train", "ddp", "multigpu", "quality"):
            print(f"(no plot for {path}: the file name must end in _<section>.json, section one of "
                  "optim, memory, noise, train, ddp, multigpu, quality)")
            continue
        try:
            png = _plot_one(plt, r, section, path, stem)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            print(f"(no plot for {path}: not a {section} result as bench.py / python -m experiments quality write it: "
                  f"{type(e).__name__} {e})")
            plt.close("all")
            continue
        out += png
    return out


def _plot_one(plt, r, section, path, stem):
    """The figure(s) of one result JSON `r` (see plot_results); returns the PNG paths written."""
    out = []
    title = f"{r.get('gpu', '')} {r.get('date', '')}: {r.get('command', '')}"[:110]
    fig = None
    if section == "optim":
        cases = list(dict.fromkeys(x["case"] for x in r["rows"]))
        fig, axs = plt.subplots(len(cases), 1, figsize=(8, 2.2 * len(cases)), squeeze=False)
        for ax, case in zip(axs[:, 0], cases):
            rows = [x for x in r["rows"] if x["case"] == case and "reference" not in x["optimizer"]]
            _bars(ax, [f"{x['optimizer']} ({x['state_bytes_per_param']:.2f} B/param)" for x in rows],
                  [x["ms"] for x in rows], case, "step time, ms")
            # each row's own floor (its bytes moved / the copy bandwidth): a tick on its bar
            ax.plot([x["floor_ms"] for x in rows], range(len(rows)), "k|", ms=12,
                    label="a row's bandwidth floor: its bytes moved / copy bandwidth")
        fig.legend(*axs[0, 0].get_legend_handles_labels(), loc="upper right", fontsize=7)
    elif section == "memory":
        fig, ax = plt.subplots(figsize=(8, 3.5))
        labels = [f"{x['method']} {x['memory']} {x['optim']}" + (
            f" {x['param_dtype']} params" + (" + int8 correction" if x.get("master_weight_bits") else "")
            if x.get("param_dtype", "fp32") != "fp32" else "") for x in r["rows"]]
        left = [0.0] * len(labels)
        for part in r["rows"][0]["measured_B_per_param"]:
            v = [x["measured_B_per_param"][part] for x in r["rows"]]
            ax.barh(range(len(labels)), v, left=left, label=part)
            left = [a + b for a, b in zip(left, v)]
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(f"training-state bytes per parameter ({r['preset']})")
        ax.legend(fontsize=7)
    elif section == "noise":
        fig, ax = plt.subplots(figsize=(7, 4))
        shapes = [x["shape"] for x in r["rows"]]
        for k, name in (("eager", "eager torch"), ("compiled", "torch.compile"), ("bm", "Box-Muller"),
                        ("ours", "ours 3-step"), ("fused", "ours fused"), ("floor", "bandwidth floor")):
            ax.plot(shapes, [x[k] * 1e3 for x in r["rows"]], marker="o", label=name)
        ax.set_yscale("log")
        ax.set_ylabel("eq. 3 forward, us")
        ax.legend(fontsize=7)
    elif section == "train":
        fig, ax = plt.subplots(figsize=(8, 4.5))
        rows = [x for x in r["rows"] if x["method"] != "bf16"]
        _bars(ax, [f"{x['model']} {x['optim']} {x['method']}" for x in rows],
              [x["overhead_pct"] for x in rows], "Table 1: tokens/s overhead vs BF16 (same model, optimizer)",
              "overhead, %")
    elif section == "ddp":
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(r["one"]["step_loss"], lw=1, label="1 GPU (grad_accum 2)")
        ax.plot(r["many"]["step_loss"], lw=1, label=f"{r['nproc']} GPUs (DDP)")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.legend(fontsize=7)
    elif section == "multigpu":      # per case: val loss per eval of each run; tokens/s of each
        cases = r["cases"]
        fig, axs = plt.subplots(len(cases), 2, figsize=(11, 3 * len(cases)), squeeze=False)
        runs = {"one": "1 GPU", "ddp": f"DDP x{r['nproc']}", "fsdp": f"FSDP2 x{r['nproc']}",
                "fsdp_1": f"FSDP2 x{r['nproc']} checkpoint, resumed on 1 GPU"}
        for (ax, ax2), (case, row) in zip(axs, cases.items()):
            for k, label in runs.items():
                ax.plot(*zip(*row[k]["val"]), lw=1, marker="o", ms=3, label=label)
            ax.set_title(f"{case}: val loss", fontsize=9)
            ax.set_xlabel("step")
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
            tps = [row[k]["tokens_per_s"] or 0 for k in ("one", "ddp", "fsdp")]
            ax2.bar(range(3), tps, color=["tab:gray", "tab:blue", "tab:orange"])
            ax2.set_xticks(range(3), ["1 GPU"] + [f"{x} ({row['efficiency'][k]:.0%})" if row["efficiency"][k]
                                                  else x for k, x in (("ddp", runs["ddp"]), ("fsdp", runs["fsdp"]))])
            ax2.set_title(f"{case}: tokens/s (scaling efficiency)", fontsize=9)
            ax2.grid(axis="y", alpha=0.3)
    elif section == "quality":
        exps = r["experiments"]
        fig, axs = plt.subplots(len(exps), 1, figsize=(8, 1.2 + 0.45 * sum(len(e) for e in exps.values())),
                                squeeze=False)   # one experiment: still a list of axes
        for ax, (exp, rows) in zip(axs[:, 0], exps.items()):
            labels = list(rows)
            for i, lab in enumerate(labels):
                vals = [v for v in rows[lab]["final_val_loss"] if v is not None]
                ax.scatter(vals, [i] * len(vals), color="tab:blue", s=14)
                if rows[lab]["mean"] is not None:
                    ax.scatter([rows[lab]["mean"]], [i], marker="|", s=200, color="k")
            ax.set_yticks(range(len(labels)))
            ax.set_yticklabels(labels, fontsize=7)
            ax.invert_yaxis()
            ax.set_title(f"{exp}: final val loss per seed (| = mean)", fontsize=9)
            ax.grid(axis="x", alpha=0.3)
            if exp == "zeropoint":
                ax.set_xscale("log")
            if any(row.get("curves") for row in rows.values()):
                plot_quality(exp, rows, f"{stem}_{exp}.png", train_loss=exp == "zeropoint",
                             noise_floor=r.get("noise_floor"))
                out.append(f"{stem}_{exp}.png")
        if any(v.get("sweep_delta") for v in (r.get("cast") or {}).values()):
            plot_cast(r["cast"], f"{stem}_cast.png")
            out.append(f"{stem}_cast.png")
        for label, b in (r.get("bitwidth") or {}).items():
            if b["method"] == "gaussws":
                stats = dict(b["layers"], all={k: b[k] for k in ("share_le5", "share_le9", "share_le12")})
                plot_bitwidth(stats, f"{stem}_bitwidth.png", f"{label}: learned b_t per layer (paper A Figure 5)")
                out.append(f"{stem}_bitwidth.png")
                break
    if fig is None:
        return out
    fig.suptitle(title, fontsize=7)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=110)
    plt.close(fig)
    out.append(stem + ".png")
    print("wrote", stem + ".png")
    return out
