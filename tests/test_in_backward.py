"""
The step inside backward (lowbit/in_backward.py) and AdamW4bit.step_param, the per-parameter step
it calls: the same numbers as the ordinary step for every preset, parameter dtype, FP32-state
tensor and the LM head's SR switch; each parameter stepped alone; parameters unfrozen and groups
added after step_in_backward was called; other torch optimizers; going back to ordinary steps.
"""
import random

import pytest
import torch
import torch.nn as nn

import adam4bit as A
from lowbit import step_in_backward

# quantized (4-bit states: the first two) and FP32-state tensors: small, not whole blocks, a
# quantize=False group
SHAPES = [(64, 64), (32, 128), (64,), (100, 41), (16, 256)]


def _groups(ps):
    return [{"params": ps[:3]},
            {"params": ps[3:4], "weight_decay": 0.0},
            {"params": ps[4:], "quantize": False, "lr": 3e-3}]


def _twins(dtype, kw):
    g = torch.Generator().manual_seed(0)
    ps = [nn.Parameter((torch.randn(s, generator=g) * 0.1).to(dtype)) for s in SHAPES]
    qs = [nn.Parameter(p.detach().clone()) for p in ps]
    opts = [A.AdamW4bit(_groups(x), lr=1e-2, **kw) for x in (ps, qs)]
    for x, o in zip((ps, qs), opts):
        o.mark_lm_head(x[1])
    return ps, qs, opts


def _assert_same(ps, qs, o, o2):
    for a, b in zip(ps, qs):
        assert torch.equal(a, b)
        sa, sb = o.state[a], o2.state[b]
        assert sa.keys() == sb.keys() and sa["step"] == sb["step"]
        assert all(torch.equal(sa[k], sb[k]) for k in sa if k != "step")


CASES = [(params, preset, "torch") for params in ("fp32", "bf16-sr", "bf16-master24")
         for preset in ("fp32", "torchao", "zipsr", "zeeden")]
# the kernels under the interpreter take seconds a tensor: each flag of theirs once
CASES += [("fp32", "torchao", "triton"), ("bf16-sr", "zipsr", "triton"), ("bf16-master24", "zeeden", "triton"),
          ("bf16-sr", "fp32", "triton")]


@pytest.mark.parametrize("params, preset, impl", CASES)
def test_step_param_gives_the_ordinary_step_bit_for_bit(params, preset, impl):
    """step_param on each parameter, in any order, equals step(): parameters, codes, scales,
    FP32 states, step counts (a quantized parameter skips a step: its own count and SR seeds stay
    its own), the BF16 SR write and eq. MW's correction (4-bit and FP32 states), and the LM head's
    m switching to SR at 90 %."""
    dtype, kw = {"fp32": (torch.float32, {}), "bf16-sr": (torch.bfloat16, dict(param_rounding="sr")),
                 "bf16-master24": (torch.bfloat16, dict(master_weight_bits=24))}[params]
    ps, qs, (o, o2) = _twins(dtype, dict(kw, preset=preset, impl=impl))
    g, order = torch.Generator().manual_seed(1), random.Random(2)
    for step, progress in enumerate([0.5, 0.85, 0.95]):
        for a, b in zip(ps, qs):
            a.grad = b.grad = None if step == 1 and a is ps[0] else \
                (torch.randn(a.shape, generator=g) * 1e-2).to(a.dtype)
        for x in (o, o2):
            x.set_progress(progress)
        o.step()
        for b in order.sample(qs, len(qs)):
            o2.step_param(b)
        _assert_same(ps, qs, o, o2)
    assert o2.m_rounding_for(qs[1]) == ("sr" if preset in ("zipsr", "zeeden") else o2.qcfg["m_rounding"])


def test_step_param_refuses_what_it_cannot_do():
    p = nn.Parameter(torch.randn(64, 64))
    opt = A.AdamW4bit([p], impl="torch")
    opt.step_param(p)                      # no gradient: nothing happens
    assert not opt.state[p]
    q = nn.Parameter(torch.ones(3))
    q.grad = torch.ones_like(q)
    with pytest.raises(ValueError, match=r"tensor of shape \(3,\) is not a parameter of this optimizer"):
        opt.step_param(q)
    p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="capturable=True"):
        A.AdamW4bit([p], capturable=True).step_param(p)


# ---------------------------------------------------------------------------------------------
# step_in_backward on a model

OPTIMIZERS = {   # fp32: FP32 states on CPU, whose step() records a plan and replays it
    "torch-adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "zipsr": lambda ps: A.AdamW4bit(ps, lr=1e-2, preset="zipsr", impl="torch"),
    "fp32": lambda ps: A.AdamW4bit(ps, lr=1e-2, preset="fp32", impl="torch"),
}


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64),
                         nn.Tanh(), nn.Linear(64, 64))


def _train(make, in_backward, late=None, steps=4, remove_at=None):
    """Weights after `steps` steps of the MLP; late: which parameters join after the first step
    ("first"/"last" layer unfrozen, or "group": the first layer unfrozen and added with
    add_param_group);
    remove_at: step from which the hooks are removed (ordinary steps again)."""
    m = _mlp()
    ps = list(m.parameters())
    joining = {"first": ps[:2], "last": ps[-2:], "group": ps[:2], None: []}[late]
    for p in joining:
        p.requires_grad_(False)
    opt = make([p for p in ps if late != "group" or all(p is not q for q in joining)])
    handles = step_in_backward(opt) if in_backward else []
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        if i == 1:
            for p in joining:
                p.requires_grad_(True)
            if late == "group":
                opt.add_param_group({"params": joining, "lr": 5e-3})
        if i == remove_at:
            for h in handles:
                h.remove()
            handles = []
        x = torch.randn(8, 64, generator=g)
        m(x).square().mean().backward()
        if handles:
            assert all(p.grad is None for p in ps)
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in ps]


@pytest.mark.parametrize("late", ["first", "last", "group"])
@pytest.mark.parametrize("optim", list(OPTIMIZERS))
def test_parameters_joining_later_step_as_in_the_ordinary_step(optim, late):
    """A layer unfrozen (requires_grad set) or added with add_param_group after step_in_backward
    was called is stepped once per backward with its own gradient, freed: the ordinary step's
    weights bit for bit (stepped by every hook with a gradient never freed, it ended ~0.06 away)."""
    want = _train(OPTIMIZERS[optim], False, late)
    got = _train(OPTIMIZERS[optim], True, late)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


@pytest.mark.parametrize("optim", list(OPTIMIZERS))
def test_going_back_to_ordinary_steps(optim):
    """Ordinary steps, then steps inside backward, then ordinary ones again (the hooks removed,
    those of a group added meanwhile too): the ordinary run's weights (AdamW4bit's recorded step
    plan is not replayed with the step counts it had)."""
    make = OPTIMIZERS[optim]

    def run(in_backward):
        m = _mlp()
        ps = list(m.parameters())
        opt, handles = make(ps[2:]), []
        g = torch.Generator().manual_seed(1)
        for i in range(7):
            if i == 2 and in_backward:
                handles = step_in_backward(opt)
            if i == 3:
                opt.add_param_group({"params": ps[:2]})
            if i == 5:
                for h in handles:
                    h.remove()
                handles = []
            x = torch.randn(8, 64, generator=g)
            m(x).square().mean().backward()
            if not handles:
                opt.step()
                opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in ps]
    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def test_each_hook_steps_its_parameter_alone():
    """The host work of a hook does not grow with the model: AdamW4bit's hooks never call step()
    (which walks every parameter), and torch's AdamW's step() sees one parameter per hook."""
    m = _mlp()
    opt = A.AdamW4bit(m.parameters(), lr=1e-2, impl="torch")
    step_in_backward(opt)
    opt.step = lambda *a, **k: pytest.fail("step() called inside backward")
    m(torch.randn(8, 64)).square().mean().backward()
    assert all(opt.state[p]["step"] == 1 for p in m.parameters())

    m = _mlp()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(sum(len(g["params"]) for g in o.param_groups)))
    step_in_backward(opt)
    m(torch.randn(8, 64)).square().mean().backward()
    assert seen == [1] * len(list(m.parameters()))
    assert len(opt.param_groups[0]["params"]) == len(list(m.parameters()))


@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.1),
                                  lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),
                                  lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
                                  lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False)],
                         ids=["sgd-momentum", "adam", "rmsprop", "adamw-for-loop"])
def test_other_torch_optimizers_step_in_backward_as_after_it(make):
    """torch's optimizers that keep their state per parameter, with two param groups and a layer
    unfrozen later: the ordinary step's weights bit for bit."""
    def split(ps):
        return [{"params": ps[:4]}, {"params": ps[4:], "lr": 2e-3}]
    want = _train(lambda ps: make(split(ps)), False, "first")
    got = _train(lambda ps: make(split(ps)), True, "first")
    assert all(torch.equal(a, b) for a, b in zip(want, got))
