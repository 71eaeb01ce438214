"""
AdamW4bit (adam4bit.py, lowbit/optim/) beyond test_all.py's facts: the quantizer's argument checks,
presets, state_dict and resume, API and errors, per-group FP32 states, the fused step's NaN, SR and
LM-head paths, BF16 / FP16 parameters, the recorded step plan, capturable=True, FSDP2 and DCP (gloo
processes on CPU), the step in backward. Statistical tests bound the error at z = 5 standard errors
(a correct implementation fails with probability about 6e-7).
"""
import copy
import io
import math

import pytest
import torch
import torch.nn as nn
import triton
import triton.language as tl

import adam4bit as A
import gaussws as g
from codebooks import CODEBOOKS, get_codebook
from lowbit.numerics import midpoints
from lowbit.optim import fp32 as optim_fp32
from lowbit.optim import sr_bits
from lowbit.optim.args import use_triton
from lowbit.optim.launch import capturable_bias_table
from lowbit.optim.lut import LUT_BUCKETS, bucket_lut
from lowbit.optim.metrics import nonzero_to_zero_fraction, radial_bias, relative_rms_error, update_relative_error
from lowbit.optim.param_write import correction_unit, join_master, read_param, round_to_bf16, split_master
from lowbit.optim.state import PACKED
from model import GPT, preset_config

from test_all import assert_twins_equal, set_grads, twin_optimizers
from tests.fsdp import FSDP_PRESETS, FSDP_SHAPES, Quadratic, fsdp_quadratic, full_params, plain_quadratic, quadratic_steps
from tests.helpers import launch_ranks


# ---------------------------------------------------------------------------------------------
# the block quantizer: arguments, input types, the uniforms' dtype

def test_quantizer_bad_arguments():
    x = torch.randn(256)
    with pytest.raises(ValueError, match="block_size"):
        A.quantize_blockwise(x, "nf4", block_size=100)
    with pytest.raises(ValueError, match="multiple of block_size"):
        A.quantize_blockwise(torch.randn(200), "nf4")
    with pytest.raises(ValueError, match="rule"):
        A.quantize_blockwise(x, "nf4", rule="nearest")
    with pytest.raises(ValueError, match="nonnegative"):
        A.quantize_blockwise(x, "nf4", coord="update")


def test_quantizer_input_types():
    with pytest.raises(TypeError, match="floating-point"):
        A.quantize_blockwise(torch.arange(256), "nf4")
    with pytest.raises(ValueError, match="bias_correction2"):
        A.quantize_blockwise(torch.rand(256), "dyn4", coord="update", bias_correction2=0.0)
    with pytest.raises(ValueError, match="nonnegative"):
        A.quantize_blockwise(-torch.rand(256), "dyn4", coord="update")
    with pytest.raises(ValueError, match="one uniform per element"):
        A.quantize_blockwise(torch.randn(256), "nf4", rule="sr", u=torch.rand(10))
    with pytest.raises(TypeError, match="uint8"):
        A.dequantize_blockwise(torch.zeros(128), torch.ones(2), "nf4")


@pytest.fixture
def default_dtype():
    """torch.set_default_dtype for the test to call; the default dtype is restored after it."""
    old = torch.get_default_dtype()
    try:
        yield torch.set_default_dtype
    finally:
        torch.set_default_dtype(old)


def test_sr_uniforms_are_float32_whatever_the_default_dtype(default_dtype):
    # Uniforms drawn in a bfloat16 default dtype take ~1700 values and bias SR (mean of x = 0.3 on
    # lin4_nz, between 0.25 and 0.3125: 10.9 standard errors low). Bound: 5 standard errors of the
    # mean of n two-level draws, gap sqrt(p (1 - p) / n). Each block's first element (1.0) sets s = 1.
    x = torch.full((1 << 16, 128), 0.3, dtype=torch.float32)
    x[:, 0] = 1.0

    def sr(dtype):
        default_dtype(dtype)
        return A.quantize_blockwise(x, "lin4_nz", 128, "sr", "state",
                                    generator=torch.Generator().manual_seed(8))
    packed, s = sr(torch.bfloat16)
    q = A.dequantize_blockwise(packed, s, "lin4_nz", 128).view(x.shape)[:, 1:].double()
    a, b, x0 = 0.25, 0.3125, x[0, 1].item()
    p = (b - x0) / (b - a)
    se = (b - a) * math.sqrt(p * (1 - p) / q.numel())
    assert abs(q.mean().item() - x0) <= 5 * se, (q.mean().item() - x0, se)
    # and the same bits under every default dtype
    want = sr(torch.float32)
    for dtype in (torch.bfloat16, torch.float64):
        got = sr(dtype)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), dtype


# ---------------------------------------------------------------------------------------------
# the optimizer (reference step): presets, state, resume, API and errors

def _mlp(seed=0, hidden=128):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 64))


def _train(model, opt, steps, seed=0, sched=None, skip=0):
    # skip: batches drawn and not used, so a resumed run continues the data stream of a first one
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(64, 64, generator=g) / 8
    for _ in range(skip):
        torch.randn(256, 64, generator=g)
    for _ in range(steps):
        X = torch.randn(256, 64, generator=g)
        opt.zero_grad()
        loss = ((model(X) - torch.tanh(X @ teacher)) ** 2).mean()
        loss.backward()
        opt.step()
        if sched:
            sched.step()
    return loss.item()


def test_fp32_preset_equals_torch_adamw():
    ref, ours = _mlp(), _mlp()
    groups = lambda m: [{"params": m[0].parameters()}, {"params": m[2].parameters(), "lr": 3e-3,
                                                        "weight_decay": 0.0}]
    o1 = torch.optim.AdamW(groups(ref), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    o2 = A.AdamW4bit(groups(ours), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                     preset="fp32")
    _train(ref, o1, 20)
    _train(ours, o2, 20)
    for a, b in zip(ref.parameters(), ours.parameters()):
        assert (a - b).abs().max().item() <= 1e-6


def test_every_4bit_preset_trains_close_to_fp32():
    # Margin: final loss within 30 % of FP32 AdamW's, and below 15 % of the starting loss.
    losses = {}
    for preset in ("fp32", "torchao", "zeeden", "zipsr"):
        m = _mlp()
        losses[preset] = _train(m, A.AdamW4bit(m.parameters(), lr=1e-2, preset=preset), 200)
    m = _mlp()
    start = _train(m, torch.optim.SGD(m.parameters(), lr=0.0), 1)
    for preset in ("torchao", "zeeden", "zipsr"):
        assert losses[preset] <= 1.3 * losses["fp32"], losses
        assert losses[preset] <= 0.15 * start, (losses, start)


def test_table3_rows_are_constructor_calls():
    m = _mlp()
    rows = [dict(preset="torchao"),
            dict(preset="torchao", v_codebook="dyn4_nz"),                     # Dyn4-NZ control
            dict(preset="torchao", v_codebook="dyn4_nz", m_codebook="nf4"),  # + NF4 m
            dict(preset="zeeden"), dict(preset="zipsr"),
            dict(preset="zipsr", v_rounding="state-rtn"),                    # Fig. 1 failure
            dict(preset="zipsr", v_rounding="state-sr"), dict(preset="zipsr", v_rounding="update-rtn")]
    for kw in rows:
        opt = A.AdamW4bit(m.parameters(), lr=1e-3, **kw)
        _train(m, opt, 2)
        assert opt.state_nbytes() > 0


def test_state_bytes_and_eligibility():
    big = torch.nn.Parameter(torch.randn(64, 128))        # 8192: quantized
    odd = torch.nn.Parameter(torch.randn(4096 + 64))      # not a multiple of 128: FP32
    small = torch.nn.Parameter(torch.randn(2048))         # < 4096: FP32
    for preset, per_param in (("zipsr", 1.0625), ("zeeden", 1.0625), ("torchao", 1.0625),
                              ("fp32", 8.0)):
        opt = A.AdamW4bit([big], preset=preset)
        big.grad = torch.randn_like(big)
        opt.step()
        assert opt.state_nbytes() / big.numel() == per_param
    opt = A.AdamW4bit([odd, small], preset="zipsr")
    for p in (odd, small):
        p.grad = torch.randn_like(p)
    opt.step()
    for p in (odd, small):
        assert not opt.is_quantized(p)
        assert opt.state[p]["exp_avg"].dtype == torch.float32
        assert opt.state[p]["exp_avg"].shape == p.shape
    st = A.AdamW4bit([big], preset="zipsr")
    big.grad = torch.randn_like(big)
    st.step()
    s = st.state[big]
    assert s["exp_avg"].dtype == torch.uint8 and s["exp_avg"].numel() == big.numel() // 2
    assert s["exp_avg_sq_scale"].dtype == torch.float32 and s["exp_avg_sq_scale"].numel() == 64


@pytest.mark.filterwarnings("ignore:invalid value encountered")   # the interpreter's NaN and Inf arithmetic
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_gradient_poisons_its_block_from_the_next_step(impl, bad):
    """AdamW4bit's documented behaviour: one NaN/Inf gradient element (element 130, block 1 of
    32) at step 1 makes only that parameter NaN at step 1, as in torch's AdamW; the block's scales
    become non-finite, so from step 2 on all 128 parameters of block 1 are NaN and the other
    blocks stay finite, while torch's AdamW keeps only element 130 NaN."""
    p0 = torch.randn(4096, generator=torch.Generator().manual_seed(16))
    gen = torch.Generator().manual_seed(17)
    grads = [torch.randn(4096, generator=gen) * 1e-2 for _ in range(3)]
    grads[0][130] = bad
    block1 = (torch.arange(4096) // 128) == 1
    element = torch.arange(4096) == 130
    for preset in ("torchao", "zeeden", "zipsr"):
        ref, ours = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
        o_ref = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        o = A.AdamW4bit([ours], lr=1e-2, preset=preset, impl=impl)
        for t, g in enumerate(grads, 1):
            ref.grad, ours.grad = g.clone(), g.clone()
            o_ref.step()
            o.step()
            assert torch.equal(torch.isnan(ref), element) and torch.isfinite(ref[~element]).all()
            poisoned = element if t == 1 else block1
            assert torch.equal(torch.isnan(ours), poisoned), (preset, t)
            assert torch.isfinite(ours[~poisoned]).all(), (preset, t)
            for k in ("exp_avg_scale", "exp_avg_sq_scale"):
                assert torch.equal(~torch.isfinite(o.state[ours][k]), torch.arange(32) == 1), (preset, t, k)


@pytest.mark.parametrize("preset", ["zipsr", "torchao", "zeeden"])
def test_state_dict_resume_is_bit_identical(preset):
    def make():
        m = _mlp()
        o = A.AdamW4bit(m.parameters(), lr=1e-2, preset=preset, seed=7)
        o.mark_lm_head(m[2].weight)
        return m, o
    m_ref, o_ref = make()
    for i in range(2):
        o_ref.set_progress(0.85 + 0.1 * i)
        _train(m_ref, o_ref, 5, seed=i)
    m1, o1 = make()
    o1.set_progress(0.85)
    _train(m1, o1, 5, seed=0)
    buf = io.BytesIO()
    torch.save({"model": m1.state_dict(), "opt": o1.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    m2 = _mlp(seed=123)
    o2 = A.AdamW4bit(m2.parameters(), lr=1e-2, preset=preset, seed=0)   # seed comes from ck
    m2.load_state_dict(ck["model"])
    o2.load_state_dict(ck["opt"])
    assert o2.m_rounding_for(m2[2].weight) == o1.m_rounding_for(m1[2].weight)
    o2.set_progress(0.95)
    _train(m2, o2, 5, seed=1)
    for a, b in zip(m_ref.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    for k in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"):
        assert torch.equal(o_ref.state[m_ref[0].weight][k], o2.state[m2[0].weight][k])


def test_state_dict_of_another_config_is_refused():
    m = _mlp()
    o = A.AdamW4bit(m.parameters(), preset="zipsr")
    _train(m, o, 1)
    sd = o.state_dict()
    with pytest.raises(ValueError, match="block_size"):
        A.AdamW4bit(m.parameters(), preset="zipsr", block_size=64).load_state_dict(sd)
    with pytest.raises(ValueError, match="preset"):
        A.AdamW4bit(m.parameters(), preset="zeeden").load_state_dict(sd)
    with pytest.raises(ValueError, match="not an AdamW4bit"):
        A.AdamW4bit(m.parameters()).load_state_dict(torch.optim.AdamW(m.parameters()).state_dict())


def test_reference_step_is_the_same_whatever_the_default_dtype(default_dtype):
    """torch.set_default_dtype(bfloat16 or float64) changes no bit of a step: the SR uniforms and
    the kernel's tables (built by the constructor) are float32 whatever the default."""
    def run(dtype):
        default_dtype(dtype)
        gen = torch.Generator().manual_seed(18)
        p = torch.nn.Parameter(torch.randn(64, 128, dtype=torch.float32, generator=gen))
        o = A.AdamW4bit([p], lr=1e-2, preset="zipsr", m_rounding="sr", seed=3)
        for _ in range(2):
            p.grad = torch.randn(64, 128, dtype=torch.float32, generator=gen)
            o.step()
        return p.detach(), o.state[p]
    want_p, want_st = run(torch.float32)
    for dtype in (torch.bfloat16, torch.float64):
        p, st = run(dtype)
        assert torch.equal(p, want_p), dtype
        for k in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"):
            assert torch.equal(st[k], want_st[k]), (dtype, k)


def test_bf16_params_keep_fp32_scales_after_load():
    p = torch.nn.Parameter(torch.randn(64, 128, dtype=torch.bfloat16))
    o = A.AdamW4bit([p], preset="zeeden")
    p.grad = torch.randn_like(p)
    o.step()
    sd = o.state_dict()
    o2 = A.AdamW4bit([p], preset="zeeden")
    o2.load_state_dict(sd)
    assert o2.state[p]["exp_avg_sq_scale"].dtype == torch.float32
    assert torch.equal(o2.state[p]["exp_avg_sq_scale"], o.state[p]["exp_avg_sq_scale"])


def test_lm_head_switches_to_sr_after_90_percent():
    m = _mlp()
    for preset, expect in (("zipsr", "sr"), ("zeeden", "sr"), ("torchao", "rtn")):
        o = A.AdamW4bit(m.parameters(), preset=preset)
        o.mark_lm_head(m[2].weight)
        o.set_progress(0.89)
        assert o.m_rounding_for(m[2].weight) == "rtn"
        o.set_progress(0.9)
        assert o.m_rounding_for(m[2].weight) == expect
        assert o.m_rounding_for(m[0].weight) == "rtn"         # other params unaffected
    for bad, said in ((1.5, r"must be in \[0, 1\].*got 1.5"), ("x", r"a number in \[0, 1\].*got 'x'"),
                      (None, "a number.*got None")):
        with pytest.raises(ValueError, match=r"^set_progress\(fraction\): " + said):
            o.set_progress(bad)
    with pytest.raises(ValueError, match="not a parameter"):
        o.mark_lm_head(torch.nn.Parameter(torch.zeros(3)))


def test_lm_head_sr_changes_only_the_head_first_moment_rounding():
    # With SR on, repeated steps from the same state and gradient but different seeds give
    # different head first-moment codes; other tensors are deterministic RTN.
    codes = []
    for seed in (0, 1):
        m = _mlp()
        o = A.AdamW4bit(m.parameters(), preset="zipsr", seed=seed)
        o.mark_lm_head(m[2].weight)
        o.set_progress(0.95)
        _train(m, o, 1)
        codes.append((o.state[m[2].weight]["exp_avg"].clone(), o.state[m[0].weight]["exp_avg"].clone()))
    assert not torch.equal(codes[0][0], codes[1][0])
    assert torch.equal(codes[0][1], codes[1][1])


def test_lr_tensor_scheduler_closure_no_grad_and_sparse():
    m = _mlp()
    o = A.AdamW4bit(m.parameters(), lr=torch.tensor(1e-2), preset="zipsr")
    sched = torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5 ** s)
    _train(m, o, 3, sched=sched)
    assert float(o.param_groups[0]["lr"]) == pytest.approx(1e-2 / 8)
    frozen = torch.nn.Parameter(torch.randn(64, 128))
    o = A.AdamW4bit(list(m.parameters()) + [frozen], preset="zipsr")
    before = frozen.detach().clone()
    X = torch.randn(8, 64)

    def closure():
        o.zero_grad()
        loss = m(X).square().mean()
        loss.backward()
        return loss
    loss = o.step(closure)
    assert torch.is_tensor(loss) and loss.item() > 0
    assert torch.equal(frozen, before) and len(o.state[frozen]) == 0
    emb = torch.nn.Embedding(10, 4, sparse=True)
    o = A.AdamW4bit(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        o.step()


def test_optimizer_bad_arguments():
    ps = [torch.nn.Parameter(torch.randn(4))]
    bad = [dict(lr=-1.0), dict(betas=(0.9, 1.0)), dict(eps=0.0), dict(weight_decay=-0.1),
           dict(preset="adam8"), dict(block_size=100), dict(impl="cuda"),
           dict(m_rounding="nearest"), dict(v_rounding="sr"), dict(v_codebook="nope"),
           dict(v_codebook="sdyn4"),                                      # update-sr needs >= 0
           dict(lm_head_sr_after=1.5)]
    for kw in bad:
        with pytest.raises(ValueError):
            A.AdamW4bit(ps, **kw)
    with pytest.raises(TypeError, match="lr"):
        A.AdamW4bit(ps, lr="1e-3")


@pytest.mark.parametrize("capturable", [False, True])
def test_hyperparameters_changed_after_construction_are_checked_at_step(capturable):
    """A group's lr, betas, eps or weight_decay set after construction (a scheduler, user code)
    gets the constructor's checks at the next step(): a ValueError naming the group, the
    hyperparameter and its value, before any tensor is written; a valid change steps as usual."""
    torch.manual_seed(3)
    p = torch.nn.Parameter(torch.randn(64, 128))
    opt = A.AdamW4bit([p], lr=1e-3, capturable=capturable)
    p.grad = torch.randn_like(p)
    opt.step()
    for key, value, says in [("lr", float("nan"), "lr must be finite"), ("lr", -1.0, "lr must be finite"),
                             ("betas", (0.9, 1.5), "betas must be two numbers"), ("betas", 0.9, "betas"),
                             ("betas", (1.0, 0.999), "betas"), ("eps", 0.0, "eps must be finite"),
                             ("weight_decay", float("inf"), "weight_decay"),
                             ("lr", torch.tensor(float("nan")), "lr must be finite"),
                             ("lr", torch.tensor(-1.0), "lr must be finite"),
                             ("lr", torch.tensor([1e-3, 1e-3]), "lr tensor must have one element")]:
        good = opt.param_groups[0][key]
        opt.param_groups[0][key] = value
        before = p.detach().clone()
        with pytest.raises(ValueError, match=f"param group 0: {says}"):
            opt.step()
        assert torch.equal(p, before), key
        opt.param_groups[0][key] = good
    lr = opt.param_groups[0]["lr"] = torch.tensor(1e-3)     # a CPU tensor lr changed in place
    opt.step()
    lr.fill_(float("nan"))
    before = p.detach().clone()
    with pytest.raises(ValueError, match="param group 0: lr must be finite"):
        opt.step()
    assert torch.equal(p, before)
    opt.param_groups[0]["lr"] = 2e-3
    before = p.detach().clone()
    opt.step()
    assert not torch.equal(p, before) and p.isfinite().all()


def test_optimizer_checks_groups_params_and_state_shapes():
    p = torch.nn.Parameter(torch.randn(64, 128))
    for kw in (dict(lr=float("nan")), dict(lr=float("inf")), dict(eps=float("inf")),
               dict(weight_decay=float("nan")), dict(betas=0.9), dict(preset=["zipsr"]),
               dict(lm_head_sr_after="x"), dict(preset="fp32", eden=True)):
        with pytest.raises(ValueError):
            A.AdamW4bit([p], **kw)
    for kw in (dict(seed="abc"), dict(eden="yes"), dict(eps=None)):
        with pytest.raises(TypeError):
            A.AdamW4bit([p], **kw)
    for group in ({"weight_decay": -1.0}, {"lr": float("nan")}, {"betas": (2, 3)}, {"lr": -5.0}):
        with pytest.raises(ValueError, match="param group 0"):
            A.AdamW4bit([dict(params=[p], **group)])
    o = A.AdamW4bit([p])
    with pytest.raises(ValueError, match="param group 1: weight_decay"):
        o.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))], "weight_decay": -1.0})
    assert len(o.param_groups) == 1                       # the refused group is not kept
    with pytest.raises(TypeError, match="needs float32, bfloat16 or float16 parameters, got torch.int64"):
        A.AdamW4bit([torch.zeros(4, dtype=torch.int64)])
    p.grad = torch.randn_like(p)
    o.step()
    q = torch.nn.Parameter(torch.randn(32, 128))
    with pytest.raises(ValueError, match="does not fit"):
        A.AdamW4bit([q]).load_state_dict(o.state_dict())


def test_diagnostics():
    g = torch.Generator().manual_seed(6)
    m = torch.randn(4096, generator=g)
    assert radial_bias(m, m) == 0.0
    assert radial_bias(m, 0.9 * m) == pytest.approx(-0.1, abs=1e-6)
    assert relative_rms_error(m, 1.1 * m) == pytest.approx(0.1, abs=1e-6)
    q = m.clone()
    q[:1024] = 0
    assert nonzero_to_zero_fraction(m, q) == pytest.approx(0.25)
    assert update_relative_error(2 * m, m) == pytest.approx(1.0)
    # RTN on NF4 of a Gaussian block has a small error; the measured RMS error is that of NF4
    packed, s = A.quantize_blockwise(m, "nf4")
    err = relative_rms_error(m, A.dequantize_blockwise(packed, s, "nf4"))
    assert 0.03 < err < 0.15


def test_state_dict_round_trip_with_custom_codebook_tensors():
    """A custom (tensor) codebook survives state_dict/load_state_dict; another codebook is refused."""
    def make(cb):
        p = torch.nn.Parameter(torch.randn(64, 128, generator=torch.Generator().manual_seed(3)))
        p.grad = torch.randn(64, 128, generator=torch.Generator().manual_seed(4))
        return p, A.AdamW4bit([p], impl="torch", v_codebook=cb, v_rounding="state-rtn")
    cb = torch.linspace(0, 1, 16)
    p, opt = make(cb)
    opt.step()
    q, opt2 = make(cb.clone())
    opt2.load_state_dict(opt.state_dict())
    assert torch.equal(opt2.state[q]["exp_avg_sq"], opt.state[p]["exp_avg_sq"])
    _, opt3 = make(torch.linspace(0, 1, 16) ** 2)
    with pytest.raises(ValueError, match="another configuration"):
        opt3.load_state_dict(opt.state_dict())
    with pytest.raises(ValueError, match="v_codebook"):
        A.AdamW4bit([p], v_codebook="nope")


@pytest.mark.parametrize("preset", ["zipsr", "torchao"])
def test_deepcopy_and_pickle_give_an_optimizer_with_the_same_next_steps(preset):
    """copy.deepcopy and torch.save/pickle (snapshots, EMA tooling, multiprocessing) keep the preset
    configuration, seed, impl, progress and LM-head mark: the copy's next steps are the original's
    bit for bit (ZIP-SR's SR bits depend on the seed, the LM head's m rounding on the mark)."""
    torch.manual_seed(0)
    model = GPT(preset_config("nano", vocab_size=256))
    opt = A.AdamW4bit(model.parameters(), lr=1e-3, preset=preset, seed=3, impl="triton")
    opt.mark_lm_head(model.lm_head.weight)
    opt.set_progress(0.95)

    def steps(m, o, n):
        gen = torch.Generator().manual_seed(5)
        for _ in range(n):
            x = torch.randint(0, 256, (2, 32), generator=gen)
            m(x, x)[1].backward()
            o.step()
            o.zero_grad()
        return [p.detach().clone() for p in m.parameters()]

    steps(model, opt, 1)
    copied = copy.deepcopy((model, opt))
    buf = io.BytesIO()
    torch.save((model, opt), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    want = steps(model, opt, 2)
    for m, o in (copied, loaded):
        assert (o.seed, o.impl, o.progress, o.qcfg) == (opt.seed, opt.impl, opt.progress, opt.qcfg)
        assert o.m_rounding_for(m.lm_head.weight) == opt.m_rounding_for(model.lm_head.weight)
        assert all(torch.equal(a, b) for a, b in zip(steps(m, o, 2), want))


@pytest.mark.parametrize("key, value", [("amsgrad", True), ("differentiable", True), ("decoupled_weight_decay", False)])
def test_group_keys_that_change_the_math_are_refused(key, value):
    """Groups taken from torch's optimizers carry these keys; AdamW4bit implements only AdamW's
    value of each, so another value is a one-line error naming the key (at construction, and
    when set later, before the step)."""
    p = torch.nn.Parameter(torch.zeros(4096))
    with pytest.raises(ValueError, match=rf"^param group 0: {key}={value} is not supported: AdamW4bit implements {key}="):
        A.AdamW4bit([dict(params=[p], weight_decay=0.1, **{key: value})])
    A.AdamW4bit(torch.optim.AdamW([p]).param_groups)        # torch AdamW's own values pass
    opt = A.AdamW4bit([p])
    opt.param_groups[0][key] = value
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=rf"{key}={value} is not supported"):
        opt.step()
    assert torch.equal(p, torch.zeros(4096))                  # nothing stepped


def test_another_optimizers_state_dict_is_refused_saying_what_it_holds():
    """Migrating from torch's AdamW (or TorchAO's / bitsandbytes' 4-bit and 8-bit ones): their state
    dicts cannot become 4-bit codes of ours; the error says what it got and what to do."""
    p = torch.nn.Parameter(torch.randn(64, 128))
    p.grad = torch.randn_like(p)
    theirs = torch.optim.AdamW([p])
    theirs.step()
    with pytest.raises(ValueError, match=r"another optimizer's \(its per-parameter states: step \(float32\), "
                                         r"exp_avg \(float32\), exp_avg_sq \(float32\)\): AdamW4bit loads only its "
                                         r"own state_dict\(\); to move from that optimizer, load the model's weights"):
        A.AdamW4bit([p]).load_state_dict(theirs.state_dict())


def test_adam_groups_without_weight_decay_are_accepted():
    """decoupled_weight_decay=False (torch's Adam) with weight_decay 0 is the same update."""
    p = torch.nn.Parameter(torch.zeros(4096))
    A.AdamW4bit(torch.optim.Adam([p]).param_groups)


# ---------------------------------------------------------------------------------------------
# per-group FP32 states (quantize=False) and torch.compile'd models

def _head_groups(m, quantize):
    """_mlp's first layer in a group with the given quantize flag, the rest in a default group."""
    return [dict(params=list(m[0].parameters()), quantize=quantize), dict(params=list(m[2].parameters()))]


def test_group_quantize_false_keeps_fp32_states_and_resume_keeps_the_policy():
    m_ref = _mlp()
    o_ref = A.AdamW4bit(_head_groups(m_ref, False), lr=1e-2, seed=3)
    _train(m_ref, o_ref, 4)
    # the group's tensors have FP32 states although 8192-element m[0].weight is eligible
    assert o_ref.state[m_ref[0].weight]["exp_avg"].dtype == torch.float32
    assert not o_ref.is_quantized(m_ref[0].weight) and o_ref.is_quantized(m_ref[2].weight)
    assert o_ref.state[m_ref[2].weight]["exp_avg"].dtype == torch.uint8
    nbytes = 8 * m_ref[0].weight.numel() + 1.0625 * m_ref[2].weight.numel() + 8 * (128 + 64)
    assert o_ref.state_nbytes() == nbytes
    # with quantize=False the group takes the FP32 AdamW step: the same as preset "fp32" for it
    m_fp = _mlp()
    o_fp = A.AdamW4bit([dict(params=list(m_fp[0].parameters())),
                        dict(params=list(m_fp[2].parameters()), lr=0.0, weight_decay=0.0)],
                       lr=1e-2, preset="fp32")
    m1 = _mlp()
    o1 = A.AdamW4bit([dict(params=list(m1[0].parameters()), quantize=False),
                      dict(params=list(m1[2].parameters()), lr=0.0, weight_decay=0.0)], lr=1e-2)
    _train(m_fp, o_fp, 4)
    _train(m1, o1, 4)
    assert torch.equal(m_fp[0].weight, m1[0].weight)
    # resume: an optimizer built without the option adopts the saved policy from the state dict
    m1 = _mlp()
    o1 = A.AdamW4bit(_head_groups(m1, False), lr=1e-2, seed=3)
    _train(m1, o1, 2)
    sd = o1.state_dict()
    assert [gr["quantize"] for gr in sd["param_groups"]] == [False, True]
    buf = io.BytesIO()
    torch.save({"model": m1.state_dict(), "opt": sd}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    m2 = _mlp(seed=9)
    m2.load_state_dict(ck["model"])
    o2 = A.AdamW4bit(_head_groups(m2, True), lr=1e-2)
    o2.load_state_dict(ck["opt"])
    assert o2.param_groups[0]["quantize"] is False and not o2.is_quantized(m2[0].weight)
    _train(m2, o2, 2, skip=2)                  # _train's data stream, continued from step 2
    for a, b in zip(m_ref.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_group_quantize_flag_is_checked():
    m = _mlp()
    with pytest.raises(TypeError, match=r"param group 0: quantize must be True .* got 'no'"):
        A.AdamW4bit([dict(params=m.parameters(), quantize="no")])
    o = A.AdamW4bit(_head_groups(m, True), lr=1e-2)
    _train(m, o, 1)
    o.param_groups[0]["quantize"] = False       # after the first step: the states are 4-bit
    with pytest.raises(ValueError, match=r"has 4-bit states but its param group now says quantize=False"):
        _train(m, o, 1)
    with pytest.raises(ValueError, match="not a parameter of this optimizer"):
        o.is_quantized(torch.zeros(3))


@pytest.mark.skipif(__import__("shutil").which("g++") is None and not torch.cuda.is_available(),
                    reason="Inductor on CPU needs a C++ compiler")
def test_compiled_model_trains_with_adamw4bit():
    """A torch.compile'd model's parameters are the module's own: AdamW4bit (4-bit states on the
    eligible tensors) trains it as it trains the eager model."""
    eager, comp = _mlp(), _mlp()
    cm = torch.compile(comp)
    o_e = A.AdamW4bit(eager.parameters(), lr=1e-2, impl="torch")
    o_c = A.AdamW4bit(cm.parameters(), lr=1e-2, impl="torch")
    start = _train(eager, torch.optim.SGD(eager.parameters(), lr=0.0), 1)
    loss_e, loss_c = _train(eager, o_e, 6), _train(cm, o_c, 6)
    assert loss_c < 0.8 * start and o_c.state[comp[0].weight]["exp_avg"].dtype == torch.uint8
    # compiled kernels round differently from eager ones (~1e-7 here): a 4-bit code may then
    # flip, which moves its weight by at most ~lr per step (the max bound), but the typical
    # weight stays within rounding of the eager run's (the median bound; the steps move 1e-2)
    assert abs(loss_c - loss_e) < 0.02 * start
    for a, b in zip(eager.parameters(), comp.parameters()):
        assert (a - b).abs().max().item() < 6 * 1e-2 and (a - b).abs().median().item() < 1e-5


# ---------------------------------------------------------------------------------------------
# the fused Triton step beyond test_all.py's kernel = reference: other block sizes, gradients at odd
# offsets, codebooks too dense for its tables, NaN gradients, its own Philox SR bits, the LM head's SR
# launch, its level search

@pytest.mark.parametrize("block_size", [8, 256])
def test_kernel_other_block_sizes_bit_identical(block_size):
    # NB = 128 // block_size blocks per program (8: 16 blocks), and one block over 2 programs' worth (256)
    ref, o_ref, ker, o_ker = twin_optimizers(preset="zeeden", block_size=block_size)
    g = torch.Generator().manual_seed(15)
    for _ in range(3):
        set_grads(ref, ker, g)
        o_ref.step()
        o_ker.step()
    assert_twins_equal(ref, o_ref, ker, o_ker)


def test_kernel_bf16_grads_at_odd_offsets():
    """BF16 gradient views that start at an odd 2-byte offset (as in a flat gradient buffer; the
    launch then reads element by element instead of 16-byte vectors) give the reference's
    result bit for bit."""
    ref, o_ref, ker, o_ker = twin_optimizers(preset="zeeden")
    g = torch.Generator().manual_seed(22)
    for _ in range(2):
        n = sum(p.numel() for p in ref)
        flat = (torch.randn(n + 1, generator=g) * 1e-2).to(torch.bfloat16)
        off = 1
        for a, b in zip(ref, ker):
            a.grad_dtype = b.grad_dtype = None
            view = flat[off:off + a.numel()].view(a.shape)
            a.grad, b.grad = view.clone(), view
            off += a.numel()
        assert any(b.grad.data_ptr() % 4 for b in ker if o_ker.is_quantized(b))
        o_ref.step()
        o_ker.step()
    assert_twins_equal(ref, o_ref, ker, o_ker)


def test_kernel_codebook_too_dense_for_its_tables():
    # midpoints 0.25 apart: RTN tables fine; inner levels 0 and 0.001 share a bucket: SR is not
    dense = torch.tensor([-1.0, -0.5, 0.0, 0.001, 0.5, 1.0])
    p = torch.nn.Parameter(torch.randn(4096))
    A.AdamW4bit([p], impl="triton", preset="torchao", m_codebook=dense)
    with pytest.raises(ValueError, match=r"(?s)impl='triton': m_codebook tensor.*codebook levels are closer "
                                         r"than the kernel's level buckets .*use impl='torch'"):
        A.AdamW4bit([p], impl="triton", preset="zipsr", m_codebook=dense)   # LM-head SR
    o = A.AdamW4bit([p], impl="auto", preset="zipsr", m_codebook=dense)     # -> reference
    p.grad = torch.randn(4096)
    o.step()
    assert not use_triton(p, o.impl, True, o._kernel_tabs)


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")   # the interpreter's NaN -> int
@pytest.mark.parametrize("preset,kw", [("torchao", {}), ("zeeden", {}), ("zipsr", dict(v_rounding="update-rtn")),
                                       ("zipsr", {})])
def test_kernel_nan_gradient_matches_reference(preset, kw):
    """A NaN gradient element among small finite ones (and an all-NaN tensor): the block's scales
    become NaN as in the reference (a dropped NaN left s = 1e-12 and the bucket index far past
    its table), the other blocks are untouched by it; RTN presets equal the reference exactly
    (NaN compared as NaN) except the codes of NaN blocks, which decode to NaN whatever they are."""
    g = torch.full((4096,), 1e-5)
    g[130] = float("nan")                                  # block 1 of 32
    ps = [torch.nn.Parameter(torch.zeros(4096)), torch.nn.Parameter(torch.zeros(4096))]
    qs = [torch.nn.Parameter(x.detach().clone()) for x in ps]
    grads = [g, torch.full((4096,), float("nan"))]
    ok = A.AdamW4bit(ps, impl="triton", preset=preset, **kw)
    ref = A.AdamW4bit(qs, impl="torch", preset=preset, **kw)
    for a, b, gr in zip(ps, qs, grads):
        a.grad, b.grad = gr.clone(), gr.clone()
    ok.step()
    ref.step()
    st = ok.state[ps[0]]
    for key in ("exp_avg_scale", "exp_avg_sq_scale"):
        assert torch.isnan(st[key][1]) and torch.isfinite(st[key][torch.arange(32) != 1]).all()
    assert torch.isnan(ps[0][130]) and torch.isfinite(ps[0][torch.arange(4096) != 130]).all()
    if "sr" not in kw.get("v_rounding", A.PRESETS[preset]["v_rounding"]):
        for a, b in zip(ps, qs):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
            for key in ("exp_avg", "exp_avg_sq"):
                sc = ref.state[b][key + "_scale"]
                torch.testing.assert_close(ok.state[a][key + "_scale"], sc, rtol=0, atol=0, equal_nan=True)
                keep = torch.isfinite(sc).repeat_interleave(64)     # 64 code bytes per block
                assert torch.equal(ok.state[a][key][keep], ref.state[b][key][keep])


def test_kernel_philox_sr_is_unbiased():
    # With b1 = b2 = 0 the working moments are m = g and v = g² (bias correction 1 at t = 1), so
    # one step stores Q(g) and Q(g²). Each 128-element pattern is repeated R times; per element,
    # the mean over the R independent Philox draws of phi(Q(x)) lies within 5 standard errors
    # of phi(x) (std of phi(Q(x)) <= half the level gap): m SR in state space (NF4), v Update-SR.
    R, eps = 512, 1e-3
    gen = torch.Generator().manual_seed(14)
    pattern = torch.randn(128, generator=gen) * 1e-2
    pattern[0] = 0.05                                   # fixes each block's absmax
    p = torch.nn.Parameter(torch.zeros(R * 128))
    opt = A.AdamW4bit([p], lr=0.0, betas=(0.0, 0.0), eps=eps, preset="zipsr", m_rounding="sr",
                      impl="triton", seed=3)
    p.grad = pattern.repeat(R)
    opt.step()
    st = opt.state[p]
    for key, cb, x, phi in (("exp_avg", "nf4", pattern, lambda z: z),
                            ("exp_avg_sq", "dyn4", pattern ** 2, lambda z: A.preconditioner(z, 1.0, eps))):
        q = A.dequantize_blockwise(st[key], st[key + "_scale"], cb).view(R, 128)
        s = x.abs().max()
        assert torch.equal(st[key + "_scale"], s.repeat(R))
        levels = s * CODEBOOKS[cb]
        lo = (torch.searchsorted(levels, x, right=True) - 1).clamp(0, levels.numel() - 2)
        gap = (phi(levels[lo + 1].double()) - phi(levels[lo].double())).abs()
        mean = phi(q.double()).mean(0)
        assert ((mean - phi(x.double())).abs() <= 5 * gap / 2 / math.sqrt(R) + 1e-12).all(), key
        assert not (q == q[0]).all()                    # the draws really differ across blocks


def test_kernel_lm_head_sr_launch_and_resume():
    # The LM-head tensor goes through its own SR launch after 90 %; a triton run resumes exactly.
    def make():
        m = _mlp(hidden=64)    # 4096-element weights: the smallest with 4-bit states
        o = A.AdamW4bit(m.parameters(), lr=1e-2, preset="zipsr", impl="triton", seed=5)
        o.mark_lm_head(m[2].weight)
        o.set_progress(0.95)
        return m, o
    m_ref, o_ref = make()
    _train(m_ref, o_ref, 4)
    m1, o1 = make()
    _train(m1, o1, 2)
    sd = o1.state_dict()
    m2, o2 = make()
    m2.load_state_dict(m1.state_dict())
    o2.load_state_dict(sd)
    _train(m2, o2, 2, skip=2)                  # the same data stream, continued from step 2
    for a, b in zip(m_ref.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_impl_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    p = torch.nn.Parameter(torch.randn(64, 128))
    p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match="impl='triton' needs CUDA"):
        A.AdamW4bit([p], impl="triton").step()


def test_bucket_lut_equals_searchsorted():
    """The kernel's level search (bucket j = trunc(y * n/2 + n/2) in float32 -- exactly the
    kernel's fma, as y * n/2 is exact --, then count_j + (y >= bound_j) from entry j) equals
    torch.searchsorted(bounds, y, right=True) for every codebook's level midpoints (State-RTN)
    and inner levels (the other rules), at the table's own bucket count and at the largest, on
    adversarial y: each bound and each bucket edge +- 0..3 ulps, the ends of [-1, 1] and random y."""
    from codebooks import CODEBOOKS
    gen = torch.Generator().manual_seed(21)
    sizes = set()
    for name in CODEBOOKS:
        T = get_codebook(name)
        for bounds in (midpoints(T), T[1:-1]):
            for lut in (bucket_lut(bounds), bucket_lut(bounds, LUT_BUCKETS[-1])):
                n = lut.numel() - 1
                sizes.add(n)
                count = (lut & 0xFFFFFFFF).to(torch.int32)
                bound = (lut >> 32).to(torch.int32).view(torch.float32)
                edges = (-1 + 2 * torch.arange(n + 2, dtype=torch.float64) / n).float()
                y = torch.cat([bounds, edges, torch.tensor([-1.0, 0.0, 1.0]),
                               torch.rand(4000, generator=gen) * 2 - 1])
                for _ in range(3):
                    y = torch.cat([y, torch.nextafter(y, y + torch.inf), torch.nextafter(y, y - torch.inf)]).unique()
                y = y[y.abs() <= 1 + 2 ** -22]                 # |x (1/s)| <= 1 up to rounding
                j = (y * (n / 2) + n / 2).to(torch.int32).long()
                got = count[j].long() + (y >= bound[j]).long()
                assert torch.equal(got, torch.searchsorted(bounds, y, right=True)), (name, n)
    assert {32, 512, 1024} <= sizes                      # NF4 needs 32 buckets, Dyn4 512
    with pytest.raises(ValueError, match="closer than"):
        bucket_lut(torch.tensor([0.0, 0.5, 0.5005, 1.0]))
    with pytest.raises(ValueError, match="closer than"):   # too dense for 32 buckets, not 64
        bucket_lut(torch.tensor([-0.5, -0.45, 0.5]), 32)
    assert bucket_lut(torch.tensor([-0.5, -0.45, 0.5])).numel() == 65


# ---------------------------------------------------------------------------------------------
# BF16 / FP16 parameters: the write (RTN, SR, eq. MW's 24-bit master weight)

def test_round_to_bf16_rtn_is_torchs_cast_and_sr_is_unbiased():
    """RTN equals torch's float32 -> bfloat16 cast bit for bit (ties, overflow, NaN stay NaN). SR
    rounds to one of the two adjacent BF16 values, and its mean over 4096 draws per element is
    the FP32 value within 5 standard errors of a two-point law (fails a correct SR with p ~ 6e-7
    per element; 64 elements)."""
    gen = torch.Generator().manual_seed(30)
    w = torch.randn(20000, generator=gen) * 10 ** torch.empty(20000).uniform_(-30, 30, generator=gen)
    ties = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.3895e38, 1e-40, 0.0, -0.0])
    w = torch.cat([w, ties])
    assert torch.equal(round_to_bf16(w).view(torch.int16), w.bfloat16().view(torch.int16))
    assert round_to_bf16(torch.tensor([float("nan")])).isnan().all()
    x = torch.randn(64, generator=gen).float() * 3
    bits = x.view(torch.int32)
    down = (bits & -65536).view(torch.float32)                 # the BF16 neighbour toward zero
    up = ((bits & -65536) + 65536).view(torch.float32)         # and away from zero
    r = round_to_bf16(x.expand(4096, 64), "sr", torch.rand(4096, 64, generator=gen)).float()
    assert ((r == down) | (r == up)).all()
    p = (x - down) / (up - down)                                # P(up) of an unbiased SR
    se = (up - down).abs() * (p * (1 - p) / 4096).sqrt()
    assert ((r.mean(0) - x).abs() <= 5 * se + 1e-9 * x.abs()).all()
    assert (r.std(0) > 0).all()
    with pytest.raises(ValueError, match="uniforms u"):
        round_to_bf16(x, "sr")
    with pytest.raises(ValueError, match="rule must be"):
        round_to_bf16(x, "stochastic")


def test_master_weight_split_join_is_16_significant_bits():
    """eq. MW: x = RTN_bf16(w), |e| <= 127, and x + e 2^(E-15) is w rounded to 1/256 of x's ulp
    (error <= 2^(E-16), up to 2^(E-15) where e is clamped), so below x's own error; exact for w
    with 16 significant bits (unless clamped)."""
    gen = torch.Generator().manual_seed(31)
    w = torch.randn(50000, generator=gen) * 10 ** torch.empty(50000).uniform_(-20, 20, generator=gen)
    x, e = split_master(w)
    assert x.dtype == torch.bfloat16 and e.dtype == torch.int8 and e.shape == w.shape
    assert torch.equal(x.view(torch.int16), w.bfloat16().view(torch.int16))
    back = join_master(x, e)
    unit, _ = correction_unit(x.float())
    clamped = e.abs() == 127      # |w - x| in (127.5, 128] units: error up to one unit
    assert ((back - w).abs() <= torch.where(clamped, unit, unit / 2) * (1 + 1e-6)).all()
    assert clamped.float().mean() < 0.02       # ~3/256: |e| = 127 itself, and the clamped 128
    assert (back - w).abs().max() < (x.float() - w).abs().max()
    w16 = (w.view(torch.int32) & -256).view(torch.float32)    # 16 significant bits
    x16, e16 = split_master(w16)
    # exact unless clamped, or x rounded up to the next power of two (its unit is then twice w's)
    exact = (e16.abs() < 127) & (torch.frexp(x16.float())[1] == torch.frexp(w16)[1])
    assert exact.float().mean() > 0.97
    assert torch.equal(join_master(x16, e16)[exact], w16[exact])


def test_bf16_master_weights_track_fp32_far_better_than_rtn():
    """Updates of ~lr = 1e-3 on weights ~4 (half a BF16 ulp: 0.0156) over 200 steps, against the
    FP32-parameter run (reference step): BF16 RTN loses every update (relative RMS error of the
    weight change ~1), SR is unbiased (mean error within 5 standard errors of its ~0.06-per-weight
    noise, 4096 weights) but noisy (< 0.5), and the 24-bit master weight (resolution 1.2e-4)
    tracks it within 0.06."""
    gen = torch.Generator().manual_seed(35)
    w0 = torch.randn(4096, generator=gen) + 4
    grads = [torch.randn(4096, generator=gen) * 0.1 + 1 for _ in range(200)]
    out = {}
    for name, dtype, kw in (("fp32", torch.float32, {}), ("rtn", torch.bfloat16, {}),
                            ("sr", torch.bfloat16, dict(param_rounding="sr")),
                            ("mw24", torch.bfloat16, dict(master_weight_bits=24))):
        p = torch.nn.Parameter(w0.clone().to(dtype))
        o = A.AdamW4bit([p], lr=1e-3, weight_decay=0.0, preset="torchao", impl="torch", **kw)
        for gr in grads:
            p.grad = gr.to(dtype)
            o.step()
        out[name] = read_param(p, o.state[p].get("param_correction")) - w0.to(dtype).float()
    err = {k: ((out[k] - out["fp32"]).norm() / out["fp32"].norm()).item() for k in ("rtn", "sr", "mw24")}
    assert err["rtn"] > 0.9 and err["sr"] < 0.5 and err["mw24"] < 0.06, err
    assert abs((out["sr"] - out["fp32"]).mean()) < 5 * 0.06 / 4096 ** 0.5


def test_bf16_options_state_dict_nbytes_and_errors():
    """master_weight_bits=24 adds 1 B/param (state_nbytes: 2.0625 on a 4-bit-state BF16 tensor),
    the correction survives state_dict round trips, and a checkpoint of another param_rounding /
    master_weight_bits is refused; bad values name the argument; FP16 with SR is a TypeError."""
    p = torch.nn.Parameter(torch.randn(8192).bfloat16())
    o = A.AdamW4bit([p], preset="zipsr", master_weight_bits=24, impl="torch")
    p.grad = torch.randn(8192).bfloat16()
    o.step()
    assert o.state_nbytes() == 8192 * (1 + 1.0625)
    q = torch.nn.Parameter(p.detach().clone())
    o2 = A.AdamW4bit([q], preset="zipsr", master_weight_bits=24, impl="torch")
    o2.load_state_dict(o.state_dict())
    assert torch.equal(o2.state[q]["param_correction"], o.state[p]["param_correction"])
    with pytest.raises(ValueError, match="master_weight_bits"):
        A.AdamW4bit([q], preset="zipsr", impl="torch").load_state_dict(o.state_dict())
    # a BF16 weight's residual is refused by an FP32 parameter; an FP32-parameter state starts a
    # BF16 parameter's residual at 0
    q32 = torch.nn.Parameter(p.detach().float())
    with pytest.raises(ValueError, match="param_correction .*torch.float32"):
        A.AdamW4bit([q32], preset="zipsr", master_weight_bits=24, impl="torch").load_state_dict(o.state_dict())
    o32 = A.AdamW4bit([q32], preset="zipsr", master_weight_bits=24, impl="torch")
    q32.grad = torch.randn(8192)
    o32.step()
    o3 = A.AdamW4bit([q], preset="zipsr", master_weight_bits=24, impl="torch")
    o3.load_state_dict(o32.state_dict())
    assert torch.equal(o3.state[q]["param_correction"], torch.zeros(8192, dtype=torch.int8))
    with pytest.raises(ValueError, match="master_weight_bits must be one of"):
        A.AdamW4bit([q], master_weight_bits=24.0)
    with pytest.raises(ValueError, match="param_rounding must be one of"):
        A.AdamW4bit([q], param_rounding="stochastic")
    with pytest.raises(ValueError, match="master_weight_bits must be one of"):
        A.AdamW4bit([q], master_weight_bits=16)
    with pytest.raises(ValueError, match="param_rounding='rtn'"):
        A.AdamW4bit([q], param_rounding="sr", master_weight_bits=24)
    with pytest.raises(TypeError, match="float16"):
        A.AdamW4bit([torch.nn.Parameter(torch.zeros(8, dtype=torch.float16))], param_rounding="sr")
    # FP32-state (small) BF16 tensors get the correction too, on the reference loop
    b = torch.nn.Parameter(torch.randn(100).bfloat16() + 4)
    ob = A.AdamW4bit([b], lr=1e-3, preset="zipsr", master_weight_bits=24, weight_decay=0.0)
    b0 = b.detach().float().clone()
    for _ in range(20):
        b.grad = torch.ones(100).bfloat16()
        ob.step()
    moved = read_param(b, ob.state[b]["param_correction"]) - b0
    assert torch.allclose(moved, torch.full((100,), -20e-3), rtol=0.1)   # RTN alone: 0 (< ulp/2)


# ---------------------------------------------------------------------------------------------
# step()'s recorded plan: replayed while nothing it depends on changed, rebuilt otherwise

def test_step_plan_is_rebuilt_on_every_change_and_matches_an_uncached_step(monkeypatch):
    # X keeps its plan; Y drops it before each step (every step then takes the full path, as a
    # fresh optimizer's first step does). The FP32-state tensors take the fused-AdamW branch
    # (torch's fused AdamW runs on CPU too), whose flat BF16 copy the plan keeps views of.
    monkeypatch.setattr(optim_fp32, "FUSED_ADAMW_DEVICES", ("cuda", "cpu"))
    gen = torch.Generator().manual_seed(0)
    shapes = [(32, 128), (4096,), (96,), (8, 8)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    xs, ys = ([torch.nn.Parameter(w.clone()) for w in init] for _ in range(2))
    extra = torch.randn(4096, generator=gen)
    kw = dict(lr=1e-2, preset="zipsr", impl="triton", param_rounding="sr")
    ox, oy = A.AdamW4bit(xs, **kw), A.AdamW4bit(ys, **kw)
    keep = []     # old gradients stay alive, so new ones get other addresses

    def step(none=(), replay=False):
        plan = ox._plan.recorded
        for j, (x, y) in enumerate(zip(ox._params(), oy._params())):
            g = torch.randn(x.shape, generator=gen).to(x.dtype)
            keep.append(x.grad)
            x.grad, y.grad = (None, None) if j in none else (g.clone(), g.clone())
        ox.step()
        oy._plan.recorded = None
        oy.step()
        assert (ox._plan.recorded is plan) == replay and ox._plan.recorded is not None
        for x, y in zip(ox._params(), oy._params()):
            assert torch.equal(x, y)
            sx, sy = ox.state[x], oy.state[y]
            assert sx.keys() == sy.keys() and sx["step"] == sy["step"]
            assert all(torch.equal(sx[k], sy[k]) for k in sx if k != "step")

    def replayed_with_same_grads():
        plan = ox._plan.recorded
        for x, y in zip(ox._params(), oy._params()):   # same addresses: only the steps move
            if x.grad is not None:
                x.grad.normal_(generator=gen)
                y.grad.copy_(x.grad)
        ox.step()
        oy._plan.recorded = None
        oy.step()
        assert ox._plan.recorded is plan      # replayed, not rebuilt
        for x, y in zip(ox._params(), oy._params()):
            assert torch.equal(x, y)

    step()
    step(replay=True)                # gradients re-allocated: the launch tables are repointed
    replayed_with_same_grads()
    step(none=(1, 2))                # a quantized and an FP32-state gradient become None
    step()
    sd = copy.deepcopy(ox.state_dict())
    ox.add_param_group(dict(params=[torch.nn.Parameter(extra.clone())]))
    oy.add_param_group(dict(params=[torch.nn.Parameter(extra.clone())]))
    step()
    for x, y in zip(ox._params()[::2], oy._params()[::2]):   # quantized, FP32-state and new ones
        x.data, y.data = x.data.bfloat16(), y.data.bfloat16()
    step()
    ox2, oy2 = (A.AdamW4bit([torch.nn.Parameter(w.clone()) for w in init], **kw) for _ in range(2))
    ox2.load_state_dict(sd)
    oy2.load_state_dict(sd)
    ox, oy = ox2, oy2
    step()
    replayed_with_same_grads()
    ox.load_state_dict(sd)           # the same optimizer: its states are replaced
    oy.load_state_dict(sd)
    step()


# ---------------------------------------------------------------------------------------------
# capturable=True: step counters and lr on the device

def test_capturable_step_equals_host_step(monkeypatch):
    """capturable=True (kernels read t and lr from device memory, capturable_bias_table) gives the weights
    and states of capturable=False bit for bit over 4 steps with a changing lr, gradients that
    move and one that becomes None; its step counters are float32 tensors, and a state_dict goes
    both ways (the next steps still equal)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(50)
    shapes = [(4096,), (32, 128), (100,)]
    for dtype, kw in ((torch.bfloat16, dict(preset="zipsr", param_rounding="sr")), (torch.float32, dict(preset="zeeden"))):
        init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
        xs, ys = ([torch.nn.Parameter(w.clone()) for w in init] for _ in range(2))
        ox = A.AdamW4bit(xs, lr=1e-2, impl="triton", **kw)
        oy = A.AdamW4bit(ys, lr=1e-2, impl="triton", capturable=True, **kw)

        def step(i, none=()):
            for g in ox.param_groups + oy.param_groups:
                g["lr"] = 1e-2 / (i + 1)
            for j, (x, y) in enumerate(zip(xs, ys)):
                g = torch.randn(x.shape, generator=gen).to(dtype)
                x.grad, y.grad = (None, None) if j in none else (g, g.clone())
            ox.step()
            oy.step()
            for x, y in zip(xs, ys):
                assert torch.equal(x, y), (dtype, i, tuple(x.shape))
                assert all(torch.equal(ox.state[x][k], oy.state[y][k]) for k in ox.state[x] if k != "step")
                for o, q in ((ox, x), (oy, y)):   # torch's: on the CPU, with capturable=True on q's device
                    step = o.state[q]["step"]
                    assert step.dtype == torch.float32 and step.device == (q.device if o.capturable else torch.device("cpu"))
                assert float(oy.state[y]["step"]) == float(ox.state[x]["step"])

        for i in range(3):
            step(i, none=(2,) if i == 1 else ())
        oy2 = A.AdamW4bit(ys, lr=1e-2, impl="triton", **kw)      # capturable state -> host steps
        oy2.load_state_dict(oy.state_dict())
        oy, ox2 = oy2, A.AdamW4bit(xs, lr=1e-2, impl="triton", capturable=True, **kw)
        ox2.load_state_dict(ox.state_dict())                      # host state -> capturable
        ox = ox2
        step(3)
    with pytest.raises(TypeError, match="capturable must be a bool"):
        A.AdamW4bit(xs, capturable=1)


def test_bias_table_rows_are_the_host_values_until_both_reach_one():
    """capturable_bias_table row t holds (1 - b1^t, 1/sqrt(1 - b2^t)) as the host computes them, row 0 the
    weight decay, and its last row is the first where both are exactly 1."""
    tab = capturable_bias_table(0.9, 0.95, 0.1)
    assert tab[0].tolist() == [0.1, 0.0] and tab[-1].tolist() == [1.0, 1.0]
    for t in (1, 2, 17, tab.shape[0] - 2):
        assert tab[t].tolist() == [1 - 0.9 ** t, 1 / math.sqrt(1 - 0.95 ** t)]
    assert tab[-2].tolist() != [1.0, 1.0] and 1 - 0.95 ** (tab.shape[0] - 1) == 1.0
    with pytest.raises(ValueError, match="too close to 1"):
        capturable_bias_table(0.9, 1 - 1e-9, 0.0)


def test_state_follows_parameter_casts_and_gradient_dtypes(monkeypatch):
    """A recorded step plan notices a gradient of another dtype at the old one's address; a
    parameter cast away from BF16 after steps with master_weight_bits=24 takes the 24-bit master
    weight as its value (both impls alike), one cast to BF16 gets a zero correction; a loaded
    non-contiguous state is made contiguous (the kernel equals the reference); float64
    parameters and integer gradients are refused, naming the dtype."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(52)
    p = torch.nn.Parameter(torch.randn(64, 64, generator=gen).bfloat16())
    p.grad_dtype = None
    o = A.AdamW4bit([p], impl="triton", preset="torchao")
    for _ in range(2):
        p.grad = torch.randn(64, 64, generator=gen).bfloat16()
        o.step()
    plan = o._plan.recorded
    p.grad = torch.randn(64, 64, generator=gen)   # FP32 now, maybe at the old gradient's address
    o.step()
    assert o._plan.recorded is not plan and torch.isfinite(p).all()
    for impl in ("torch", "triton"):
        q = torch.nn.Parameter(torch.randn(64, 64, generator=gen).bfloat16())
        o = A.AdamW4bit([q], impl=impl, preset="torchao", master_weight_bits=24, lr=1e-2)
        q.grad = torch.randn(64, 64, generator=gen).bfloat16()
        o.step()
        master = read_param(q, o.state[q]["param_correction"])
        q.data = q.data.float()
        o.param_groups[0]["lr"] = 0.0
        for _ in range(2):
            q.grad = torch.zeros(64, 64)
            o.step()
        assert torch.equal(q.detach(), master) and "param_correction" not in o.state[q], impl
        q.data = q.data.bfloat16()
        q.grad = torch.zeros(64, 64).bfloat16()
        o.step()
        assert o.state[q]["param_correction"].abs().sum() == 0
    ref, ker = (torch.nn.Parameter(torch.randn(32, 128, generator=gen).bfloat16()) for _ in range(2))
    ker.data.copy_(ref.data)
    sts = []
    for impl, w in (("torch", ref), ("triton", ker)):
        o = A.AdamW4bit([w], impl=impl, preset="torchao", master_weight_bits=24, lr=1e-2)
        src = A.AdamW4bit([torch.nn.Parameter(w.detach().t().contiguous().t())], impl="torch",
                          preset="torchao", master_weight_bits=24)
        src.param_groups[0]["params"][0].grad = torch.ones(128, 32).bfloat16().t()
        src.step()
        o.load_state_dict(src.state_dict())
        w.grad = torch.ones(32, 128).bfloat16()
        o.step()
        sts.append(o.state[w])
    assert torch.equal(ref, ker) and torch.equal(sts[0]["param_correction"], sts[1]["param_correction"])
    with pytest.raises(TypeError, match="float64"):
        A.AdamW4bit([torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))])
    s = torch.nn.Parameter(torch.zeros(4))
    o = A.AdamW4bit([s])
    s.grad_dtype = None
    s.grad = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(TypeError, match="gradient of parameter 1 .*int32"):
        o.step()


# ---------------------------------------------------------------------------------------------
# FSDP2 (fully_shard, DTensor parameters) and torch.distributed.checkpoint, gloo processes on CPU
# (the shared 2-rank runs: tests/fsdp.py)

def test_state_dict_gives_per_row_codes_and_loads_either_layout():
    """state_dict() gives the 4-bit codes and scales of a tensor whose rows are whole blocks per
    row, (rows, row_numel / 2) and (rows, row_numel / 128), as views of the step's flat tensors
    (FSDP2's layout); other tensors' flat. load_state_dict takes these and the flat layout of
    older checkpoints, and the next steps equal the uninterrupted run's bit for bit."""
    model, opt = plain_quadratic("torchao", 3)
    sd = opt.state_dict()
    shapes = [tuple(sd["state"][i]["exp_avg"].shape) for i in range(4)]
    assert shapes == [(40, 128), (33, 64), (3072,), (2048,)] and sd["state"][0]["exp_avg_sq_scale"].shape == (40, 2)
    assert sd["state"][0]["exp_avg"].data_ptr() == opt.state[model.ps[0]]["exp_avg"].data_ptr()   # a view
    assert opt.state[model.ps[0]]["exp_avg"].shape == (40 * 128,)                              # left flat
    flat = {**sd, "state": {i: {k: v.flatten() if k in PACKED else v for k, v in st.items()}
                            for i, st in sd["state"].items()}}
    layouts = copy.deepcopy(sd), copy.deepcopy(flat)    # before the step changes the state in place
    quadratic_steps(model, opt, 3, 5)
    for saved in layouts:
        again, opt2 = plain_quadratic("torchao", 3)
        opt2.load_state_dict(saved)
        assert all(v.dim() == 1 for st in opt2.state.values() for k, v in st.items() if k in PACKED)
        quadratic_steps(again, opt2, 3, 5)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


@pytest.mark.xdist_group("fsdp_runs")   # one worker computes the module fixture once
@pytest.mark.parametrize("preset", FSDP_PRESETS)
def test_fsdp_two_ranks_equal_one_rank_bit_for_bit(fsdp_runs, preset):
    """fully_shard on 2 ranks gives the unsharded reference's parameters bit for bit after 1
    step of the fused kernel on each local shard and after 3 and 5 steps of the reference step, for even, uneven and block-splitting shards;
    eligibility comes from the global tensor, so the same tensors get 4-bit states, and the row
    sharded ones hold only their own rows' codes and scales."""
    saved = fsdp_runs[0]
    model, _ = plain_quadratic("torchao", 1, FSDP_SHAPES[:2])
    for rank_res in saved:       # the fused kernel (interpreter) on the local shards, one step
        assert all(torch.equal(a.detach(), b) for a, b in zip(model.parameters(), rank_res["triton", 1]))
    for steps in (3, 5):
        model, opt = plain_quadratic(preset, steps)
        for rank_res in saved:
            assert [opt.is_quantized(p) for p in model.parameters()] == rank_res[preset, "quantized"] \
                == [True, True, True, True, False]
            for a, b in zip(model.parameters(), rank_res[preset, steps]):
                assert torch.equal(a.detach(), b), (preset, steps, tuple(a.shape))
    for rank, rank_res in enumerate(saved):
        local = rank_res[preset, "local"]
        rows = (20, 17 - rank)          # torch.chunk: 40 -> 20 + 20, 33 -> 17 + 16
        assert local[0] == {"exp_avg": (rows[0], 128), "exp_avg_scale": (rows[0], 2),
                            "exp_avg_sq": (rows[0], 128), "exp_avg_sq_scale": (rows[0], 2)}
        assert local[1]["exp_avg"] == (rows[1], 64) and local[1]["exp_avg_sq_scale"] == (rows[1], 1)
        assert local[2]["exp_avg"] == (3072,) and local[3]["exp_avg_scale"] == (32,)   # gathered: whole
        assert local[4]["exp_avg"] == ((17, 16)[rank],)


@pytest.mark.xdist_group("fsdp_runs")   # one worker computes the module fixture once
@pytest.mark.parametrize("preset", FSDP_PRESETS)
def test_fsdp_dcp_checkpoint_loads_on_one_and_two_ranks(fsdp_runs, preset):
    """A DCP checkpoint written on 2 ranks (get_optimizer_state_dict, dcp.save) loads with
    dcp.load / set_optimizer_state_dict into a fresh model on 1 rank, on 2 ranks and without
    fully_shard, and the unwrapped model's checkpoint loads on 2 ranks: the packed codes and scales
    reshard (state_dict gives a plain tensor's per row, as FSDP2 keeps them), and 2 more steps give
    the uninterrupted run's parameters bit for bit."""
    saved, one, two, unwrapped, from_unwrapped = fsdp_runs
    for res in one + two + unwrapped + from_unwrapped:
        assert res[preset, "steps"] == [3.0] * len(FSDP_SHAPES)
        for a, b in zip(saved[0][preset, 5], res[preset, 5]):
            assert torch.equal(a, b), (preset, tuple(a.shape))


# the recorded step plan on DTensor parameters: row shards (the kernel), an FP32-state vector
# (the reference loop on CPU) and a 1-D tensor (the kernel; gathered on 2 ranks, so there only 1)
_REPLAY_SHAPES = [(32, 128), (33,), (4096,)]


def _fsdp_replay(rank, world, tmp):
    # 3 ZIP-SR steps of the fused kernel (interpreter), once with the recorded plan and once with
    # every step on the full path (the plan voided before each); the last step's gradients are kept
    # alive, so each step's gradients lie elsewhere and the replay must repoint the launch table
    shapes = _REPLAY_SHAPES if world == 1 else _REPLAY_SHAPES[:2]
    res = {}
    for replay in (True, False):
        model, opt = fsdp_quadratic("zipsr", impl="triton", shapes=shapes)
        held, ptrs = None, []
        for s in range(3):
            if not replay:
                opt._plan.invalidate()
            g = torch.Generator().manual_seed(1000 + s)
            model([torch.randn(x.shape, generator=g) for x in model.ps]).backward()
            ptrs.append([p.grad.to_local().data_ptr() for p in model.parameters()])
            opt.step()
            held = [p.grad for p in model.parameters()]
            opt.zero_grad()
        res[replay] = dict(params=full_params(model), replays=opt._plan.recorded["k"] if opt._plan.recorded else None, ptrs=ptrs,
                           states=[{k: v.to_local().clone() for k, v in opt.state[p].items() if k != "step"}
                                   for p in model.parameters()],
                           grads_left=[lp.grad for _, lp in opt._shards.views.values()])
    del held
    return res


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp_replayed_step_equals_full_step(tmp_path, world):
    """On DTensor parameters step() records its plan at the second step and replays it from the
    third (the local tensors are the same objects every step), with each step's gradients at new
    addresses: 3 ZIP-SR kernel steps equal 3 steps on the full path bit for bit, parameters and
    packed states, on 1 rank (the 1-D tensor stepped on its one shard, no all-gather) and on 2
    (row shards; the 1-D tensor, gathered there, would void the plan and is left out). After a
    step the optimizer holds no reference to FSDP2's gradients."""
    runs = launch_ranks(_fsdp_replay, tmp_path, world)
    for res in runs:
        assert res[True]["replays"] == 1 and res[False]["replays"] == 0
        ptrs = res[True]["ptrs"]
        assert all(a != b for s in range(2) for a, b in zip(ptrs[s], ptrs[s + 1]))
        for a, b in zip(res[True]["params"], res[False]["params"]):
            assert torch.equal(a, b), tuple(a.shape)
        for a, b in zip(res[True]["states"], res[False]["states"]):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert len(res[True]["grads_left"]) == len(res[True]["params"])
        assert all(g is None for g in res[True]["grads_left"])


def test_kernel_sr_uniforms_of_a_tile_anywhere_equal_its_pairs():
    """_pair_uniforms without PAIRED (an FSDP2 shard whose first block does not start a pair of
    tiles) gives the bytes of tiles f and f + 1 the uniforms that the paired calls (one sr_uniforms
    for tiles 2k and 2k + 1) give them, for f even and odd, also past 2^32 bytes."""
    @triton.jit
    def k(out, seed, base, PAIRED: tl.constexpr):
        i = tl.arange(0, 64)
        us = sr_bits._pair_uniforms(seed, base + i, 1, PAIRED, 64)
        for q in tl.static_range(4):
            tl.store(out + q * 64 + i, us[q])

    def run(base, paired):
        out = torch.zeros(4, 64)
        k[(1,)](out, 11, base, paired)
        return out
    for base in (0, 64, 3 * 64, 2 ** 32 + 5 * 64):
        lo = base - base % 128                           # the pair holding tile `base`
        tiles = [u[rows] for u in (run(lo, True), run(lo + 128, True)) for rows in ([0, 1], [2, 3])]
        j = (base - lo) // 64
        assert torch.equal(run(base, False), torch.cat([tiles[j], tiles[j + 1]])), base


# SR under fully_shard: each element draws the bits of its place in the whole tensor. (33, 128),
# a block a row: on 2 ranks 17 + 16 rows (a shard at block 17, whose tile pairs are not the
# unsharded tensor's: the kernel's per-tile path), on 3 ranks 11 * 3 (blocks 11 and 22: both
# paths); FP32-state rows (33, 16), split alike, and a vector (45,), 23 + 22 and 15 * 3. The run is
# BF16 with the SR write, the first tensor the LM head past lm_head_sr_after: m, v and the write
# draw SR bits, one after the other (the FP32-state tensors through their kernel under "triton").
_SR_SHAPES = [(33, 128), (33, 16), (45,)]


class _Linear(Quadratic):
    """sum_i (i + 1) <p_i, x_i>, x_i rounded to quarters: gradients of few significant bits, so
    FSDP2's mean of 3 ranks' equal gradients is exact (as of 2, for any gradient)."""

    def forward(self, xs):
        return sum((p * ((x * 4).round() / 4) * (i + 1)).sum() for i, (p, x) in enumerate(zip(self.ps, xs)))


def _sr_run(impl, shard):
    """2 ZIP-SR steps of _Linear(_SR_SHAPES) (BF16, fully_shard if `shard`; above): the whole
    parameters, states (flat) and each parameter's element offset on this rank."""
    from torch.distributed.tensor import DTensor
    model = _Linear(shapes=_SR_SHAPES).bfloat16()
    if shard:
        from torch.distributed.fsdp import fully_shard
        model = fully_shard(model)
    opt = A.AdamW4bit(model.parameters(), lr=1e-2, preset="zipsr", impl=impl, param_rounding="sr")
    opt.mark_lm_head(model.ps[0])
    opt.set_progress(0.95)
    quadratic_steps(model, opt, 0, 2)
    full = lambda t: (t.full_tensor() if isinstance(t, DTensor) else t).reshape(-1)   # noqa: E731
    return dict(params=full_params(model), offsets=[opt._shards.layouts.get(id(p), (0, 0))[1] for p in model.parameters()],
                states=[{k: full(v) for k, v in opt.state[p].items() if k != "step"} for p in model.parameters()])


def _fsdp_sr_runs(rank, world, tmp):
    return {impl: _sr_run(impl, True) for impl in ("torch", "triton")}


@pytest.fixture(scope="module")
def sr_unwrapped():
    return {impl: _sr_run(impl, False) for impl in ("torch", "triton")}


@pytest.mark.xdist_group("fsdp_sr")   # one worker computes the unwrapped runs once
@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp_sr_bits_equal_on_one_two_three_ranks(tmp_path, sr_unwrapped, world):
    """ZIP-SR's v (Update-SR), the LM head's m SR and the BF16 SR write draw the same bits under
    fully_shard on 1, 2 and 3 ranks as without it, for even and uneven shards, shards whose first
    block does not start a pair of kernel tiles, FP32-state rows and vectors: 2 steps give the
    unwrapped model's parameters and states bit for bit, reference and kernel."""
    rows = {1: ([33], [33], [45]), 2: ([17, 16], [17, 16], [23, 22]), 3: ([11] * 3, [11] * 3, [15] * 3)}[world]
    for rank, res in enumerate(launch_ranks(_fsdp_sr_runs, tmp_path, world)):
        for impl, want in sr_unwrapped.items():
            got = res[impl]
            assert got["offsets"] == [sum(r[:rank]) * (s[1] if len(s) > 1 else 1) for r, s in zip(rows, _SR_SHAPES)]
            for a, b, shape in zip(want["params"], got["params"], _SR_SHAPES):
                assert torch.equal(a, b), (world, rank, impl, shape)
            for a, b, shape in zip(want["states"], got["states"], _SR_SHAPES):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (world, rank, impl, shape)


# ---------------------------------------------------------------------------------------------
# lowbit/in_backward.py: the step in the backward pass

@pytest.mark.parametrize("preset, pqt", [("torch", False), ("fp32", True), ("torchao", False), ("zipsr", True)])
def test_step_in_backward_gives_the_ordinary_steps_bit_for_bit(preset, pqt):
    """Each parameter stepped by its post-accumulate-grad hook (with activation checkpointing, so
    the hooks fire while later blocks are recomputed) equals the ordinary step after backward, for
    torch's AdamW, the RTN presets and ZIP-SR (its SR seeds key on the parameter's position), and
    no gradient is left after backward."""
    from lowbit import in_backward as sib
    def run(in_backward):
        torch.manual_seed(0)
        m = GPT(preset_config("nano-llama", vocab_size=256))
        if pqt:
            g.apply_pqt(m, method="gaussws", parts="all")
        m.checkpoint_blocks = in_backward
        opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) if preset == "torch"
               else A.AdamW4bit(m.parameters(), lr=1e-3, preset=preset, impl="triton"))
        if in_backward:
            sib.step_in_backward(opt)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randint(0, 256, (2, 32), generator=gen)
            m(x, x)[1].backward()
            if in_backward:
                assert all(p.grad is None for p in m.parameters())
            else:
                opt.step()
                opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in m.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def test_step_in_backward_refuses_what_it_cannot_do():
    from lowbit import in_backward as sib
    p = torch.nn.Parameter(torch.zeros(4096))
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer, got Linear"):
        sib.step_in_backward(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="capturable=True"):
        sib.step_in_backward(A.AdamW4bit([p], capturable=True))
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"already hold a gradient.*zero_grad"):
        sib.step_in_backward(torch.optim.AdamW([p]))
