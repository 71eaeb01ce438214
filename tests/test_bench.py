"""bench.py and benchmarks/ on CPU (no timing is asserted): the memory arithmetic, the training
table's rows, nvidia-smi parsing, the flags, the capacity search, the multi-GPU runs on gloo
processes."""
import json
import os
import statistics
import sys

import numpy as np
import pytest
import torch

import bench
from benchmarks import training as bench_training, util as bench_util
from experiments.plots import plot_results


def test_bench_memory_matches_the_arithmetic():
    res = bench_training.bench_memory(preset="nano", T=64, batch=2, device="cpu")
    assert len(res["rows"]) == 10
    for r in res["rows"]:
        assert r["measured_B_per_param"] == pytest.approx(r["arithmetic_B_per_param"], rel=1e-12), r
        w = 2.0 if r["param_dtype"] == "bf16" else 4.0
        assert r["measured_B_per_param"]["weights"] == w and r["measured_B_per_param"]["grads"] == w
    bf = [r["measured_B_per_param"]["optimizer"] for r in res["rows"] if r["param_dtype"] == "bf16"]
    assert bf[1] == pytest.approx(bf[0] + 1.0, rel=1e-12)     # master_weight_bits=24: +1 B/param
    by = {(r["method"], r["memory"], r["optim"]): r for r in res["rows"] if r["param_dtype"] == "fp32"}
    assert by[("bf16", "save", "adamw")]["measured_B_per_param"]["optimizer"] == 8.0
    assert by[("gaussws", "recompute", "zipsr")]["measured_B_per_param"]["bf16_weights_saved"] == 0.0
    assert by[("gaussws", "save", "zipsr")]["measured_B_per_param"]["bf16_weights_saved"] > 0.0


def test_bench_power_during_parses_nvidia_smi(tmp_path, monkeypatch, capsys):
    """power_during (optim table's W / SM MHz / cap% columns) against a fake nvidia-smi: it asks
    for this device's PCI address, drops the samples of the settle time, reads "[N/A]" fields as
    missing (not the whole sample), stops the sampler, and returns None with a message when
    nothing is readable."""
    import types
    kept = ["600.0, 1980, 0x0000000000000000", "[N/A], 1700, 0x0000000000000004",
            "700.0, 1600, 0x0000000000000004", "650.0, [N/A], [N/A]"]
    fake = tmp_path / "nvidia-smi"     # 3 samples at once (the settle time: dropped), 4 later
    fake.write_text("#!/bin/sh\necho \"$@\" > %s/args\nprintf '999.0, 100, 0x0\\n%%.0s' 1 2 3\n"
                    "sleep 1\nprintf '%%s\\n' %s\nexec sleep 30\n"
                    % (tmp_path, " ".join(f"'{x}'" for x in kept)))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x19, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = [0]
    r = bench_util.power_during(lambda: calls.__setitem__(0, calls[0] + 1), seconds=2.0, settle=0.5)
    assert r == dict(power_w=650.0, sm_mhz=1700.0, power_cap_pct=200 / 3), r
    assert calls[0] > 0 and "-i 00000000:19:00.0" in (tmp_path / "args").read_text()
    fake.write_text("#!/bin/sh\necho 'No devices were found' >&2\nexit 6\n")
    assert bench_util.power_during(lambda: None, seconds=0.05) is None
    assert "No devices were found" in capsys.readouterr().out


def test_bench_train_runs_every_method_on_cpu():
    seen = []
    res = bench_training.bench_train(cases=[("nano", 2)], optims=("adamw",), steps=1, T=64, device="cpu",
                                     compile=False, rounds=2, on_row=lambda rows: seen.append(len(rows)))
    assert [r["method"] for r in res["rows"]] == ["bf16", "gaussws", "diffq"]
    assert seen == [3]                         # the partial table after each (model, optimizer)
    assert res["rows"][0]["overhead_pct"] == 0.0
    for r in res["rows"]:                      # each round's overhead against that round's BF16 step
        assert len(r["step_ms_rounds"]) == 2 and r["step_ms"] == statistics.median(r["step_ms_rounds"])
        assert r["overhead_pct_rounds"] == [100 * (1 - b / m) for b, m in zip(
            res["rows"][0]["step_ms_rounds"], r["step_ms_rounds"])]
        assert r["overhead_pct"] == statistics.mean(r["overhead_pct_rounds"])
        assert r["gpu_ms_per_step"] is None and r["gpu_ops_per_step"] is None   # the profile is CUDA's
    assert all(r["tokens_per_s"] > 0 for r in res["rows"])
    assert set(res["geomean_overhead_pct"]) == {"gaussws/adamw", "diffq/adamw"}


def test_bench_train_cuda_rows_interleave_rounds_and_profile_the_last(monkeypatch):
    """bench_train's CUDA branch with the GPU parts stubbed: each round measures every method once,
    in order, and only the last round is profiled."""
    import types
    order, profiled, times = [], [], iter([100.0, 101.0, 98.0, 100.0])   # bf16, gaussws, bf16, gaussws

    def setup(preset, method, optim, batch, T, device, compile):
        order.append(method)
        return types.SimpleNamespace(num_params=lambda: 7), None, lambda: None
    monkeypatch.setattr(bench_training, "train_setup", setup)
    monkeypatch.setattr(bench_training, "queued_steps_ms", lambda step, n: next(times))
    monkeypatch.setattr(bench_training, "_gpu_profile", lambda step: profiled.append(order[-1]) or (float(len(profiled)), 9.0))
    for name in ("reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 2 ** 30)
    res = bench_training.bench_train(cases=[("llama-1b", 8)], optims=("adamw",), methods=("bf16", "gaussws"), device="cuda",
                                     rounds=2)
    assert order == ["bf16", "gaussws", "bf16", "gaussws"] and profiled == ["bf16", "gaussws"]
    base, ours = res["rows"]
    assert base["step_ms_rounds"] == [100.0, 98.0] and ours["step_ms_rounds"] == [101.0, 100.0]
    assert ours["overhead_pct_rounds"] == [100 * (1 - 100 / 101), 100 * (1 - 98 / 100)]
    assert (base["gpu_ms_per_step"], ours["gpu_ms_per_step"], ours["gpu_ops_per_step"]) == (1.0, 2.0, 9.0)
    assert ours["peak_GiB"] == 1.0


def test_bench_gpu_time_counts_kernels_not_ranges_on_the_gpu_timeline():
    """The profiled GPU ms of a Table 1 row sums the GPU's operations, not the record_function
    ranges shown on the GPU timeline (torch's optimizers put one around their kernels)."""
    from torch.autograd.profiler_util import FunctionEvent
    cuda = torch.autograd.DeviceType.CUDA
    ev = lambda name, t0, t1, **kw: FunctionEvent(0, name, 0, t0, t1, **kw)
    events = [ev("mm_kernel", 0, 5, device_type=cuda), ev("adamw_kernel", 5, 8, device_type=cuda),
              ev("Optimizer.step#AdamW.step", 5, 8, device_type=cuda, is_user_annotation=True),
              ev("aten::mm", 0, 1)]
    assert [e.name for e in bench_training.device_ops(events)] == ["mm_kernel", "adamw_kernel"]


def test_bench_table1_rows_alone(monkeypatch):
    """`--no-gpt2 --models` runs only the named Table 1 rows (in Table 1's order), without the GPT-2
    comparison, and saves them under a name of their own (a run per model fills the table)."""
    seen, saved = {}, []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "bench_train_gpt2", lambda **k: pytest.fail("the GPT-2 comparison ran"))
    monkeypatch.setattr(bench, "bench_train", lambda cases, **k: seen.update(cases=cases, **k) or dict(
        rows=[dict(model=c[0]) for c in cases], geomean_overhead_pct={}))
    monkeypatch.setattr(bench, "save", lambda section, result, path=None: saved.append((section, result)))
    bench.main(["--only", "train", "--table1", "--compile", "--no-gpt2", "--models", "llama-3b,llama-1b",
                "--methods", "bf16,gaussws", "--optims", "adamw"])
    assert seen["cases"] == [("llama-1b", 8), ("llama-3b", 2)] and seen["compile"] and seen["rounds"] == 2
    assert seen["methods"] == ("bf16", "gaussws") and seen["optims"] == ("adamw",)
    section, result = saved[-1]
    assert section == "train_table1_compiled_llama-3b_llama-1b" and [r["model"] for r in result["rows"]] == [
        "llama-1b", "llama-3b"]
    assert result["command"].endswith("--models llama-3b,llama-1b --methods bf16,gaussws --optims adamw")
    bench.main(["--only", "train", "--table1", "--compile", "blocks", "--no-gpt2", "--models", "llama-1b"])
    assert seen["compile"] == "blocks" and saved[-1][0] == "train_table1_compiled_blocks_llama-1b"


def test_bench_compile_blocks_compiles_each_block_and_nothing_else():
    """Table 1 with `--compile blocks`: every transformer block is compiled (one graph that all
    blocks share), the model around them runs eager."""
    model, _, _ = bench_training.train_setup("nano-llama", "gaussws", "zipsr", 2, 16, torch.device("cpu"), "blocks")
    assert all(b._compiled_call_impl is not None for b in model.blocks)
    assert all(m._compiled_call_impl is None for m in model.modules() if not isinstance(m, type(model.blocks[0]))
               and not any(m is s for b in model.blocks for s in b.modules()))


def test_in_backward_section_runs_on_cpu(monkeypatch, tmp_path, capsys):
    """bench.py --only in_backward on CPU (2 layers here instead of 96): one table row and one JSON
    row per optimizer, with the same weights both ways."""
    from benchmarks import in_backward
    monkeypatch.setitem(in_backward.CONFIG, "n_layer", 2)
    monkeypatch.chdir(tmp_path)
    bench.main(["--only", "in_backward"])
    (path,) = (tmp_path / "results").glob("cpu_*_in_backward.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["optimizer"] for r in rows] == list(in_backward.OPTIMIZERS)
    assert all(r["same_weights"] and r["n_tensors"] == 2 * 6 + 3 and r["ratio"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert all(name in out for name in in_backward.OPTIMIZERS) and "in backward ms" in out


def test_bench_names_flags_the_chosen_sections_do_not_read(capsys):
    ap = bench.build_parser()
    for argv, note in ((["--only", "host", "--pairs", "3", "--quick"], "not read by --only host: --quick, --pairs"),
                       (["--eager", "--reps", "2"], "not read by --only (default: optim, noise, memory, train): --eager, --reps"),
                       (["--only", "fsdp", "--reps", "2", "--iters", "20", "--train_args", "--seed 1"], None),
                       (["--only", "ddp", "--iters", "20", "--pairs", "3"], "not read by --only ddp: --pairs"),
                       (["--only", "noise", "--compile", "blocks", "--methods", "gaussws"],
                        "not read by --only noise: --methods, --compile")):
        args = ap.parse_args(argv)
        bench.check_args(ap, args)      # the train section's rules only where it runs
        bench.say_unread_flags(ap, args)
        out = capsys.readouterr().out
        assert (out == f"note: {note}\n") if note else out == "", (argv, out)
    assert set(bench.READ_BY) <= set(vars(ap.parse_args([])))


def test_bench_main_refuses_bad_flags_in_one_line(monkeypatch, capsys):
    # each before any GPU check; --only quality / plots name the harness that took them over
    for bad, said in ((["--only", "train", "--table1", "--methods", "gaussws"], "bf16 first"),
                      (["--only", "train", "--table1", "--methods", "bf16,foo"], "allowed bf16"),
                      (["--only", "train", "--table1", "--methods", "nosuch"], "allowed bf16, gaussws, diffq"),
                      (["--only", "train", "--optims", "zipsr,foo"], "--optims zipsr,foo"),
                      (["--only", "fsdp", "--reps", "0"], "--reps 0"),
                      (["--only", "train", "--table1", "--models", "llama-1b,llama-7b"], "--models llama-1b,llama-7b"),
                      (["--only", "train", "--no-gpt2"], "nothing to run"),
                      (["--only", "train", "--modes", "default,fast"], "allowed default, reduce-overhead"),
                      (["--only", "train", "--pairs", "0"], "--pairs 0"),
                      (["--only", "train", "--table1", "--optims", "zipsr,zipsr"], "each once"),
                      (["--only", "fsdp", "--iters", "10"], "more than 10"),   # before any GPU check
                      (["--only", "ddp", "--iters", "-5"], "--iters -5"),
                      (["--only", "train", "--compile", "blocks"], "--compile without --table1"),
                      (["--only", "train", "--models", "llama-1b"], "--models without --table1"),
                      (["--only", "train", "--table1", "--compile", "bogus"], "--compile"),
                      (["--only", "quality", "--preset", "nano"], "run python -m experiments quality"),
                      (["--only=plots"], "run python -m experiments plots")):
        monkeypatch.setattr(sys, "argv", ["bench.py", *bad])
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            bench.main()
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and said in err and len(err.splitlines()) == 1, (bad, err)
    if not torch.cuda.is_available():
        monkeypatch.setattr(sys, "argv", ["bench.py", "--only", "noise"])
        with pytest.raises(SystemExit, match="--only noise needs a CUDA GPU"):
            bench.main()


@pytest.mark.parametrize("limit", [0, 1, 2, 7, 40, 41, 150])
@pytest.mark.parametrize("guess", [1, 9, 60, 500])
def test_capacity_search_finds_the_largest_fitting_layer_count(limit, guess):
    from benchmarks import capacity as bench_capacity
    probed = []

    def fits(n):
        probed.append(n)
        return {"n": n} if n <= limit else None
    n, best = bench_capacity.search_largest(fits, guess)
    assert n == limit and best == ({"n": limit} if limit else None)
    assert len(probed) == len(set(probed)) and len(probed) <= 25


def test_bench_multigpu_runs_one_ddp_fsdp_and_a_dcp_resume_on_one(corpus, tmp_path, monkeypatch):
    """bench.py --only multigpu's runs on 2 gloo processes (torchrun, CPU): one process with
    --grad_accum 2, DDP and FSDP2 on 2 and the FSDP2 checkpoint continued on 1 agree at every eval
    up to summation order; FSDP2 holds less optimizer state per process than one process; the
    figure draws from the result."""
    from benchmarks import multigpu as bench_multigpu
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    text, data_dir = corpus
    flags = ["--preset", "nano", "--dataset", text, "--data_dir", data_dir, "--tokenizer", "byte", "--batch_size", "2",
             "--eval_windows", "4", "--eval_interval", "2", "--max_iters", "4", "--no-compile", "--device", "cpu"]
    r = bench_multigpu.bench_multigpu(flags, out_dir=str(tmp_path / "mg"), cases=(("bf16", "zipsr"),))
    row = r["cases"]["bf16/zipsr"]
    assert r["nproc"] == 2 and r["stop_after"] == 2
    assert [row[k]["world"] for k in ("one", "ddp", "fsdp", "fsdp_1")] == [1, 2, 2, 1]
    for k in ("ddp", "fsdp", "fsdp_1"):
        assert [i for i, _ in row[k]["val"]] == [0, 2, 4]
        assert np.allclose([v for _, v in row[k]["val"]], [v for _, v in row["one"]["val"]], rtol=0, atol=1e-4), k
    assert row["one"]["optimizer_state_mb"] == row["ddp"]["optimizer_state_mb"]
    assert row["fsdp"]["optimizer_state_mb"] < 0.7 * row["one"]["optimizer_state_mb"]
    assert row["state_ratio_fsdp"] == row["fsdp"]["optimizer_state_mb"] / row["one"]["optimizer_state_mb"]
    assert set(row["efficiency"]) == {"ddp", "fsdp"} and row["final_val"]["fsdp_1"] == row["fsdp_1"]["val"][-1][1]
    pytest.importorskip("matplotlib")
    path = str(tmp_path / "GPU_2026-01-01_multigpu.json")
    with open(path, "w") as f:
        json.dump(r, f)
    assert plot_results([path]) == [path[:-5] + ".png"]


def test_a_result_file_is_never_overwritten_by_another_run(monkeypatch, tmp_path):
    """save(): a run's repeated saves of a section update its own file (partial rows); a later run
    on the same day writes <section>_2.json beside it, leaving the earlier (maybe committed) file."""
    from benchmarks import util
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(util, "_SAVED", {})
    util.save("x", dict(rows=[1], partial=True))
    util.save("x", dict(rows=[1, 2]))
    monkeypatch.setattr(util, "_SAVED", {})      # another run
    util.save("x", dict(rows=[3]))
    first, second = sorted((tmp_path / "results").glob("*_x*.json"), key=lambda p: len(p.name))
    assert second.name == first.name.replace("_x.json", "_x_2.json")
    assert json.loads(first.read_text())["rows"] == [1, 2] and json.loads(second.read_text())["rows"] == [3]
