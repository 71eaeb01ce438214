"""Draft tests for the gaussws.py input-check / b_t-clamp fixes (the lead merges them into test_all.py).
Run: OMP_NUM_THREADS=1 TRITON_INTERPRET=1 python -m pytest -q test_fix_gaussws.py"""
import math
import os
import re

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gaussws as g
from model import GPT, preset_config


def _gpt(kind):
    torch.manual_seed(0)
    return GPT(preset_config("nano-llama" if kind == "llama" else "nano", vocab_size=64))


def _untouched(model):
    return not g.pqt_layers(model)


# ---------------------------------------------------------------------------------------------
# b_init / b_target (eq. 11)

def test_b_target_above_b_init_is_rejected_and_equal_is_fixed_bitwidth():
    with pytest.raises(ValueError, match=r"b_target=8 > b_init=4.*b_target <= b_init.*eq\. 11"):
        g.GaussWSLinear(64, 64, b_init=4, b_target=8)
    m = _gpt("gpt2")
    with pytest.raises(ValueError, match=r"b_target=6 > b_init=4"):
        g.apply_pqt(m, b_init=4, b_target=6)
    assert _untouched(m)
    for bad in (0.5, 25, float("nan"), float("inf"), True, "6"):
        with pytest.raises(ValueError, match="b_init="):
            g.GaussWSLinear(8, 8, b_init=bad, b_target=1)
    # b_init == b_target: b_t is b_target whatever b_i is, and b_i gets no gradient
    torch.manual_seed(1)
    layer = g.GaussWSLinear(45, 70, b_init=5, b_target=5)
    with torch.no_grad():
        layer.b_i.uniform_(-3, 3)
    assert torch.equal(layer.b_t, torch.full((3, 2), 5.0))
    layer(torch.randn(4, 45)).square().sum().backward()
    assert torch.equal(layer.b_i.grad, torch.zeros(3, 2)) and layer.weight.grad.abs().sum() > 0
    assert len(g.apply_pqt(_gpt("gpt2"), b_init=4, b_target=4)) == 8


# ---------------------------------------------------------------------------------------------
# parts

def _have(msg):
    return set(re.search(r"its blocks have: ([a-z, ]+)", msg).group(1).split(", "))


@pytest.mark.parametrize("kind,parts,missing,have", [
    ("llama", "qkv,out", "qkv", {"q", "k", "v", "out", "gate", "up", "down"}),
    ("gpt2", "q,out", "q", {"qkv", "out", "up", "down"}),
    ("gpt2", "gate,k,up", "gate, k", {"qkv", "out", "up", "down"})])
def test_apply_pqt_rejects_parts_the_model_lacks(kind, parts, missing, have):
    m = _gpt(kind)
    with pytest.raises(ValueError, match=f"no nn.Linear named {missing} inside") as e:
        g.apply_pqt(m, parts=parts)
    assert _have(str(e.value)) == have
    assert _untouched(m)                      # nothing replaced, not even the parts that exist


def test_apply_pqt_all_and_od_work_for_both_model_kinds():
    for kind, n_all in (("gpt2", 4), ("llama", 7)):
        m = _gpt(kind)
        names = g.apply_pqt(m, parts="all")
        assert len(names) == 2 * n_all == len(g.pqt_layers(m))
        assert "lm_head" not in " ".join(names)
        od = g.apply_pqt(_gpt(kind), parts="od")
        assert [n.rsplit(".", 1)[-1] for n in od] == ["out", "down", "out", "down"]
        with pytest.raises(ValueError, match=r"have: none \(already GaussWSLinear: "):
            g.apply_pqt(m, parts="all")       # applying twice names what is already replaced


# ---------------------------------------------------------------------------------------------
# empty weights, dtypes

def test_empty_weight_is_rejected_with_a_clear_error():
    with pytest.raises(ValueError, match="out_features=0 must be an int >= 1"):
        g.GaussWSLinear(64, 0)
    with pytest.raises(ValueError, match="in_features=0 must be an int >= 1"):
        g.GaussWSLinear(0, 64)
    with pytest.raises(ValueError, match=r"w has shape \(0, 64\): it must have at least one element"):
        g.gaussws_sample(torch.empty(0, 64), torch.empty(0, 2), 0)
    with pytest.raises(ValueError, match=r"w has shape \(5, 0\)"):
        g.apply_noise(torch.empty(5, 0), torch.empty(5, 0, dtype=torch.int32), torch.empty(1, 0))


def test_float64_is_rejected_at_construction():
    with pytest.raises(TypeError, match="float64; allowed: float32, bfloat16, float16"):
        g.GaussWSLinear(8, 8, dtype=torch.float64)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.raises(TypeError, match="float64"):
            g.GaussWSLinear(8, 8)
    finally:
        torch.set_default_dtype(old)
    m = _gpt("gpt2").double()
    with pytest.raises(TypeError, match=r"blocks\.0\.attn\.qkv\.weight has dtype torch\.float64"):
        g.apply_pqt(m)
    assert _untouched(m)
    for dt in (torch.bfloat16, torch.float16):  # the allowed low-precision dtypes still construct
        assert g.GaussWSLinear(8, 8, dtype=dt).weight.dtype == dt


# ---------------------------------------------------------------------------------------------
# b_t clamp to [B_MIN, B_MAX]

def test_bt_clamped_in_sampling_with_eq4_inside_and_zero_grad_outside():
    torch.manual_seed(2)
    m, n = 70, 45                                          # tile grid (3, 2)
    w = torch.randn(m, n)
    bt_raw = torch.tensor([[-1996.0, 0.5], [1.0, 5.0], [24.0, 30.0]])
    bt = bt_raw.clone().requires_grad_()
    G = torch.randn(m, n)
    seed = torch.tensor([123, 4])
    w_hat = g.gaussws_sample(w, bt, seed, out_dtype=torch.float32, impl="torch")
    assert torch.isfinite(w_hat).all()
    (w_hat * G).sum().backward()
    r = g.unpack_noise(g.generate_noise((m, n), seed), n).double()
    tmax = g._tile_max_torch(w).double()
    b_eff = bt_raw.double().clamp(1, 24)
    ref = w.double() + r * g._broadcast_tiles(tmax * torch.exp2(1 - b_eff), m, n)   # eq. 3, clamped b_t
    assert torch.allclose(w_hat.double(), ref, rtol=1e-6, atol=1e-6)
    tsum = F.pad(G.double() * r, (0, -n % 32, 0, -m % 32)).view(3, 32, 2, 32).sum(dim=(1, 3))
    eq4 = -math.log(2) * tmax * torch.exp2(1 - b_eff) * tsum
    inside = (bt_raw >= 1) & (bt_raw <= 24)                 # the range ends count as inside
    assert torch.allclose(bt.grad.double()[inside], eq4[inside], rtol=1e-4, atol=1e-6)
    assert (eq4[inside].abs() > 0).all() and torch.equal(bt.grad[~inside], torch.zeros(3))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_layer_with_runaway_b_i_stays_finite_and_equals_clamped(impl):
    torch.manual_seed(3)
    x = torch.randn(3, 45)
    out = {}
    for b_i in (-1000.0, -1.5, 10.0, 500.0):                # b_t = -1996, 1, 24, 1004
        layer = g.GaussWSLinear(45, 70, seed=9, impl=impl)  # same seed, same init weights
        torch.manual_seed(4)
        layer.reset_parameters()
        with torch.no_grad():
            layer.b_i.fill_(b_i)
        out[b_i] = layer(x)
        assert torch.isfinite(out[b_i]).all(), b_i
    assert torch.equal(out[-1000.0], out[-1.5]) and torch.equal(out[500.0], out[10.0])
    assert not torch.equal(out[-1.5], out[10.0])


def test_penalty_pulls_clamped_tiles_back_and_stats_report_effective_bits():
    layer = g.GaussWSLinear(64, 32, b_init=6, b_target=4)   # tiles (1, 2)
    with torch.no_grad():
        layer.b_i.copy_(torch.tensor([[-1000.0, 20.0]]))    # b_t = -1996, 44
    holder = nn.Module()
    holder.l = layer
    g.bitwidth_penalty(holder).backward()
    # d/d b_i of mean |b_t - 4| = sign(b_t - 4) · 2 / 2 tiles: descent moves both toward b_target
    assert torch.equal(layer.b_i.grad, torch.tensor([[-1.0, 1.0]]))
    s = g.bitwidth_stats(holder)
    assert s["l"]["min"] == 1.0 and s["l"]["max"] == 24.0 and s["all"]["mean"] == 12.5
    assert torch.equal(layer.b_t, torch.tensor([[-1996.0, 44.0]]))   # eq. 11 itself is not clamped


# ---------------------------------------------------------------------------------------------
# seeds: one rule, int (not bool) in [0, 2**63)

@pytest.mark.parametrize("seed,err,msg", [
    (-1, ValueError, r"seed=-1 must be an int in \[0, 2\*\*63\)"),
    (2 ** 63, ValueError, r"seed=9223372036854775808"),
    (2 ** 64, ValueError, r"seed=18446744073709551616"),
    ("abc", TypeError, r"seed must be an int.*got str 'abc'"),
    (1.5, TypeError, r"got float 1\.5"),
    (True, TypeError, r"got bool True")])
def test_seed_rule_is_the_same_everywhere(seed, err, msg):
    m = _gpt("gpt2")
    with pytest.raises(err, match=msg):
        g.apply_pqt(m, seed=seed)
    assert _untouched(m)
    with pytest.raises(err, match=msg):
        g.GaussWSLinear(8, 8, seed=seed)
    with pytest.raises(err, match=msg):
        g.gaussws_sample(torch.randn(8, 8), torch.full((1, 1), 4.0), seed)


def test_largest_seed_is_accepted_everywhere():
    s = 2 ** 63 - 1
    assert len(g.apply_pqt(_gpt("gpt2"), seed=s)) == 8
    assert g.GaussWSLinear(8, 8, seed=s).noise_state[0].item() >= 0
    assert g.gaussws_sample(torch.randn(8, 8), torch.full((1, 1), 4.0), s).shape == (8, 8)


# ---------------------------------------------------------------------------------------------
# bitwidth_stats / penalty / pqt_layers on models without PQT layers and on non-modules

def test_stats_without_pqt_layers_and_non_modules():
    m = _gpt("gpt2")
    with pytest.raises(ValueError, match="bitwidth_stats: model GPT has no GaussWSLinear layer"):
        g.bitwidth_stats(m)
    assert g.bitwidth_penalty(m).item() == 0.0 and g.pqt_layers(m) == []
    for fn in (g.bitwidth_stats, g.bitwidth_penalty, g.pqt_layers, g.apply_pqt):
        with pytest.raises(TypeError, match=f"{fn.__name__}: model must be a torch.nn.Module, got NoneType"):
            fn(None)
    g.apply_pqt(m, parts="od")
    assert set(g.bitwidth_stats(m)) == {"all"} | {n for n, _ in g.pqt_layers(m)}


# ---------------------------------------------------------------------------------------------
# references in the source

def test_gaussws_cites_the_paper_and_existing_benchmark():
    src = open(g.__file__, encoding="utf-8").read()
    assert "SPEC" not in src and "bench_noise_draft" not in src
    assert "python bench.py --only noise" in src
    bench = open(os.path.join(os.path.dirname(g.__file__), "bench.py"), encoding="utf-8").read()
    assert re.search(r'"--only", choices=\[[^\]]*"noise"', bench)
