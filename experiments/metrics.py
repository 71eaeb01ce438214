"""What the quality runs' numbers say: each run's gap to its experiment's baseline paired by seed,
the same-seed rerun spread, the verdict against the noise, bytes per parameter, where the runs
trained, and the Markdown tables of a result. Pure functions of the runs' numbers."""


def paired_gap(seeds, per, base):
    """Gap of a run's final val losses to the baseline's, paired by seed (same seed: same data
    order and initial weights): (mean, standard error or None with one pair, [(seed, gap)])."""
    pairs = [(s, r["final_val_loss"] - b["final_val_loss"]) for s, r, b in zip(seeds, per, base)
             if r and b and r["final_val_loss"] is not None and b["final_val_loss"] is not None
             and r["diverged_at"] is None and b["diverged_at"] is None]
    gaps = [g for _, g in pairs]
    if not gaps:
        return None, None, []
    mean = sum(gaps) / len(gaps)
    se = (sum((x - mean) ** 2 for x in gaps) / (len(gaps) - 1) / len(gaps)) ** 0.5 if len(gaps) > 1 else None
    return mean, se, pairs


def noise_floor(res):
    """The same-seed rerun spread: the largest |gap| of experiment "noise"'s reruns to their
    first run (the same flags and seed twice; GPU kernels that add in no fixed order part them
    from the first steps). None without such an experiment or before its runs finish."""
    gaps = [abs(g) for r in list(res.get("noise", {}).values())[1:] for _, g in r["gap_per_seed"]]
    return max(gaps) if gaps else None


# Student's t, two-sided 95 %, by degrees of freedom (n - 1 for n paired seeds)
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def verdict(gap, se, floor, n):
    """A gap to the baseline (mean of n seeds' paired gaps, standard error se) judged against the
    noise: "within noise" when |gap| is at most the larger of the 95 % t half-width t(n-1) se and
    the same-seed rerun spread `floor`, else "worse" or "better". None when neither bound is
    above 0: one seed and no rerun, or a spread of 0 (CPU runs repeat bit for bit, so a rerun
    measures nothing there)."""
    bound = max(T95.get(n - 1, 2.0) * se if se and n > 1 else 0.0, floor or 0.0)
    if gap is None or not bound:
        return None
    return "within noise" if abs(gap) <= bound else "worse" if gap > 0 else "better"


def bytes_per_param(run, extra):
    """Weights + optimizer states in bytes per parameter: 2 for BF16 parameters, else 4, plus the
    measured state (the summary's optimizer_state_mb over its parameter count)."""
    if not run or not run["params"] or run["optimizer_state_mb"] is None:
        return None
    weights = 2 if "bf16" in [b for a, b in zip(extra, extra[1:]) if a == "--param_dtype"] else 4
    return weights + run["optimizer_state_mb"] * 2 ** 20 / run["params"]



def trained_on(reads):
    """The result's gpu / torch / triton: the machine the runs trained on, from their summaries
    (not the machine that reads them back), and trained_on: each machine and its run count."""
    machines = [r["machine"] for r in reads if r]
    if not machines:
        return {}
    count = {}
    for m in machines:
        key = "not recorded" if not m else f"{m['device']}, torch {m['torch']}, triton {m['triton']}"
        count[key] = count.get(key, 0) + 1
    one = machines[0] if len(count) == 1 and machines[0] else None
    said = "not recorded in the runs' logs" if list(count) == ["not recorded"] else "several: see trained_on"
    return dict(gpu=one["device"].replace(" ", "-") if one else said, torch=one["torch"] if one else said,
                triton=one["triton"] if one else said, trained_on=count)


def quality_tables(out):
    """Markdown tables of a bench_quality result, one per experiment: each run's seeds, mean final
    val loss, gap to the experiment's first run paired by seed (+- standard error), weights +
    optimizer state per parameter, for "optim" the share of TorchAO's gap closed, and the verdict
    against the noise (verdict) where one is known; then experiment 5's casts per run."""
    floor = out.get("noise_floor")
    lines = [] if floor is None else [f"same-seed rerun spread: {floor:.4f}"
                                      + (" (the reruns repeat bit for bit: no bound from it)" if not floor else ""),
                                      "verdict: within noise when |gap| <= max(95 % t half-width of the paired "
                                      "gaps, the rerun spread)", ""]
    for exp, rows in out["experiments"].items():
        optim = exp == "optim"
        lines += [f"**{exp}**", "",
                  "| run | seeds | val loss | gap ± s.e. | B/param |" + (" TorchAO gap closed |" if optim else "")
                  + " verdict |",
                  "|---|---|---:|---:|---:|" + ("---:|" if optim else "") + "---|"]
        for i, (label, r) in enumerate(rows.items()):
            gap = "—" if r["gap_to_first"] is None or not i else f"{r['gap_to_first']:+.4f}" + (
                f" ± {r['gap_se']:.4f}" if r.get("gap_se") else "")
            mean = "pending" if not r["seeds"] else "diverged" if r["mean"] is None else f"{r['mean']:.4f}"
            bpp = "—" if r.get("bytes_per_param") is None else f"{r['bytes_per_param']:.2f}"
            share = r.get("share_of_torchao_gap_closed")
            lines.append(f"| {label} | {','.join(map(str, r['seeds'])) or '—'} | {mean} | {gap} | {bpp} |"
                         + (f" {'—' if share is None else f'{share:.0%}'} |" if optim else "")
                         + f" {r.get('verdict') or '—'} |")
        if optim and all(r.get("share_of_torchao_gap_closed") is None for r in rows.values()):
            lines.append("(TorchAO gap closed: — while the TorchAO preset is not behind 32-bit AdamW)")
        lines.append("")
    if out.get("cast"):   # experiment 5, one row per run and seed
        sweep = list(next(iter(out["cast"].values()))["sweep_delta"])
        lines += ["**experiment 5** (val loss change after each cast)", "",
                  "| run | mean b_t | Table C tiers | Δ tier cast | " + " | ".join(f"Δ {f}" for f in sweep) + " |",
                  "|---|---:|---|---:|" + "---:|" * len(sweep)]
        for label, c in out["cast"].items():
            bits = out.get("bitwidth", {}).get(label, {}).get("layers", {})
            n = sum(v["params"] for v in bits.values())
            b_t = f"{sum(v['mean'] * v['params'] for v in bits.values()) / n:.2f}" if n else "—"
            tiers = ", ".join(f"{t} {v:.0%}" for t, v in c["tier_share"].items() if v)
            lines.append(f"| {label} | {b_t} | {tiers} | {c['delta']:+.4f} | "
                         + " | ".join(f"{c['sweep_delta'][f]:+.4f}" for f in sweep) + " |")
        lines.append("")
    return "\n".join(lines)
