"""
AdamW4bit as a drop-in torch.optim.AdamW: the contract that torch's optimizer tests
(test/test_optim.py with the AdamW inputs of common_optimizers.py), TorchAO's
test/test_low_bit_optim.py and bitsandbytes' tests/test_optim.py check of an AdamW, where it applies
to a 4-bit one. Each test names the upstream test it follows. The constructor (torch's defaults and
keywords, maximize), hyperparameter types (NumPy scalars, tensors), state dicts (older ones, float
step counters, weights_only loads, two loads of one dict, DCP on 1 process and on 2 FSDP2 ranks),
hooks, the kernel bit for bit against the reference drawing its SR uniforms, and bad inputs.
"""
import collections
import copy
import inspect
import io
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

import adam4bit as A
from tests.fsdp import FSDP_SHAPES, Quadratic, full_params, quadratic_steps
from tests.helpers import launch_ranks


def _mlp(seed=0, dtype=torch.float32):
    # two 8192-element weights (4-bit states) and two biases (FP32 states)
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(dtype)


def _steps(model, opt, n, seed=0, sched=None):
    """n steps on a fixed regression task, batches drawn from `seed` (the same for equal seeds)."""
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(n):
        x = torch.randn(32, 64, generator=g).to(dtype)
        opt.zero_grad()
        ((model(x) - x.sin()) ** 2).float().mean().backward()
        opt.step()
        if sched is not None:
            sched.step()


def _clone(model):
    return copy.deepcopy(model)


def assert_same(a, b, where="state_dict"):
    """Two state dicts are the same: equal keys, tensors of equal dtype, shape and values."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, set(a) ^ set(b))
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def assert_params_equal(m1, m2):
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(a, b), n


# ---------------------------------------------------------------------------------------------
# the constructor: torch.optim.AdamW's defaults and keywords

def test_defaults_are_torch_adamws():
    """lr, betas, eps and weight_decay default to torch.optim.AdamW's (TorchAO's AdamW4bit and
    bitsandbytes' take the same), so AdamW4bit(params, preset="fp32") steps as AdamW(params)
    (torch's test_optim.py 'default' input; TorchAO's test_optim_smoke builds with the defaults)."""
    ours, theirs = inspect.signature(A.AdamW4bit).parameters, inspect.signature(torch.optim.AdamW).parameters
    for k in ("lr", "betas", "eps", "weight_decay"):
        assert ours[k].default == theirs[k].default, k
    # every key of torch's AdamW groups is in ours, at torch's default (code reads group["amsgrad"])
    w = nn.Parameter(torch.zeros(4))
    torch_group, our_group = torch.optim.AdamW([w]).param_groups[0], A.AdamW4bit([w]).param_groups[0]
    assert all(our_group[k] == v for k, v in torch_group.items() if k != "params"), set(torch_group) - set(our_group)
    ref, m = _mlp(), _mlp()
    _steps(ref, torch.optim.AdamW(ref.parameters()), 10)
    _steps(m, A.AdamW4bit(m.parameters(), preset="fp32"), 10)
    for a, b in zip(ref.parameters(), m.parameters()):
        assert (a - b).abs().max().item() <= 1e-6


# every keyword of torch.optim.AdamW with its default value (and the other "off" value torch takes)
TORCH_DEFAULT_KEYWORDS = [dict(amsgrad=False), dict(maximize=False), dict(foreach=None), dict(foreach=False),
                          dict(capturable=False), dict(differentiable=False), dict(fused=None), dict(fused=False)]


def test_every_torch_adamw_keyword_is_accepted_at_its_default():
    """Code written for torch.optim.AdamW passes its keywords at their defaults: each is accepted
    and changes nothing (torch's OptimizerInfo AdamW inputs spell them out)."""
    names = [k for k in inspect.signature(torch.optim.AdamW).parameters if k != "params"]
    assert set(names) <= set(inspect.signature(A.AdamW4bit).parameters), names
    assert {k for kw in TORCH_DEFAULT_KEYWORDS for k in kw} >= set(names) - {"lr", "betas", "eps", "weight_decay"}
    want = _mlp()
    _steps(want, A.AdamW4bit(want.parameters(), lr=1e-2), 2)
    for kw in TORCH_DEFAULT_KEYWORDS + [{k: inspect.signature(torch.optim.AdamW).parameters[k].default
                                         for k in names}]:
        m = _mlp()
        _steps(m, A.AdamW4bit(m.parameters(), **dict(kw, lr=1e-2)), 2)
        assert_params_equal(m, want)


@pytest.mark.parametrize("key, value", [("amsgrad", True), ("differentiable", True), ("foreach", True),
                                        ("fused", True), ("amsgrad", "no"), ("maximize", 1), ("foreach", 0)])
def test_torch_keywords_at_other_values_are_one_line_errors(key, value):
    """A value AdamW4bit does not implement is refused in one line naming the keyword and its
    value (as bitsandbytes' test_lamb8bit_rejects_amsgrad expects of its 8-bit optimizers)."""
    p = nn.Parameter(torch.randn(64, 128))
    with pytest.raises((ValueError, TypeError)) as e:
        A.AdamW4bit([p], **{key: value})
    msg = str(e.value)
    assert "\n" not in msg and f"{key}={value!r}" in msg, msg


def test_maximize_equals_torch_adamw_maximize():
    """maximize=True (torch's 'maximize' input, weight_decay 0.1) steps along the gradient: the
    fp32 preset gives torch.optim.AdamW(maximize=True)'s weights, and the loss goes up (torch's
    test_forloop_goes_right_direction)."""
    ref, m = _mlp(), _mlp()
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, maximize=True)
    o = A.AdamW4bit(m.parameters(), lr=1e-3, weight_decay=0.1, maximize=True, preset="fp32")
    _steps(ref, o_ref, 10)
    _steps(m, o, 10)
    for a, b in zip(ref.parameters(), m.parameters()):
        assert (a - b).abs().max().item() <= 1e-6
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))
    loss = lambda model: ((model(x) - x.sin()) ** 2).mean().item()   # noqa: E731
    before = loss(m)
    _steps(m, o, 5, seed=3)
    assert loss(m) > before
    assert o.param_groups[0]["maximize"] is True and o.state_dict()["param_groups"][0]["maximize"] is True


@pytest.mark.parametrize("impl, dtype", [("torch", torch.float32), ("triton", torch.float32), ("triton", torch.bfloat16)])
def test_maximize_is_the_step_of_the_negated_gradient(impl, dtype):
    """maximize=True is AdamW on -g bit for bit, on the reference and on the kernels (4-bit and
    FP32 states, FP32 and BF16 parameters), per param group as in torch; the gradients are left as
    they were."""
    shapes = [(4096,), (40, 128), (100,)]
    gen = torch.Generator().manual_seed(5)
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    up, down = ([nn.Parameter(w.clone()) for w in init] for _ in range(2))
    o_up = A.AdamW4bit([dict(params=up[:2], maximize=True), dict(params=up[2:], maximize=True)], lr=1e-2, impl=impl)
    o_down = A.AdamW4bit(down, lr=1e-2, impl=impl)
    for _ in range(3):
        grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
        for p, q, g in zip(up, down, grads):
            p.grad, q.grad = g.clone(), -g
        o_up.step()
        o_down.step()
        assert all(torch.equal(p.grad, g) for p, g in zip(up, grads))
        for p, q in zip(up, down):
            assert torch.equal(p, q)
            assert_same(o_up.state[p], o_down.state[q])


# ---------------------------------------------------------------------------------------------
# hyperparameter types: NumPy scalars, 0-d tensors

def test_numpy_scalars_and_tensors_are_hyperparameters():
    """lr, betas, eps and weight_decay may be any real number (NumPy scalars too) or 0-d tensor,
    in the constructor and in param groups (torch's 'Tensor lr' and 'Tensor lr, Tensor betas'
    inputs; betas on the CPU): the steps are those of the same values as Python floats."""
    f32 = np.float32
    kinds = [dict(lr=f32(1e-2), betas=(f32(0.9), f32(0.99)), eps=f32(1e-8), weight_decay=f32(0.05)),
             dict(lr=torch.tensor(1e-2), betas=(torch.tensor(0.9), torch.tensor(0.99)), eps=torch.tensor(1e-8),
                  weight_decay=torch.tensor(0.05)),
             dict(lr=np.float64(1e-2), betas=(np.float64(0.9), 0.99), eps=1e-8, weight_decay=np.int64(0)),
             # 0-d arrays and sequences other than tuples (a config library's list type), as torch takes
             dict(lr=np.array(1e-2), betas=np.array([0.9, 0.99]), eps=1e-8, weight_decay=np.array(0.05)),
             dict(lr=1e-2, betas=collections.UserList([0.9, 0.99]), eps=1e-8, weight_decay=0.05)]
    for preset in ("zipsr", "fp32"):         # fp32: FP32-state steps, recorded and replayed
        for kw in kinds:
            plain = {k: (tuple(float(b) for b in v) if k == "betas" else float(v)) for k, v in kw.items()}
            want, m, mg = _mlp(), _mlp(), _mlp()
            _steps(want, A.AdamW4bit(want.parameters(), preset=preset, **plain), 3)
            _steps(m, A.AdamW4bit(m.parameters(), preset=preset, **kw), 3)
            _steps(mg, A.AdamW4bit([dict(params=mg.parameters(), **kw)], preset=preset), 3)
            assert_params_equal(m, want)
            assert_params_equal(mg, want)


def test_lambda_lr_returning_numpy_scalars_trains():
    """A LambdaLR whose lambda returns np.float32 writes NumPy lrs into the groups; training goes
    on, as with the same lrs given as Python floats."""
    m, want = _mlp(), _mlp()
    o = A.AdamW4bit(m.parameters(), lr=1e-2)
    o_want = A.AdamW4bit(want.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(o, lambda i: np.float32(0.5) ** i)
    lrs = []
    for i in range(4):
        lrs.append(o.param_groups[0]["lr"])
        _steps(m, o, 1, seed=i, sched=sched)
        o_want.param_groups[0]["lr"] = float(lrs[-1])
        _steps(want, o_want, 1, seed=i)
    assert all(isinstance(lr, np.floating) for lr in lrs[1:])
    assert_params_equal(m, want)


@pytest.mark.parametrize("kw, error, says", [
    (dict(lr=True), TypeError, "lr must be a number"),
    (dict(lr=np.float32("nan")), ValueError, "lr must be finite and >= 0"),
    (dict(lr=np.float32(-1e-3)), ValueError, "lr must be finite and >= 0"),
    (dict(lr=torch.tensor(-1.0)), ValueError, "lr must be finite and >= 0"),
    (dict(lr=torch.tensor([1e-3, 1e-3])), ValueError, "lr tensor must have one element"),
    (dict(eps=np.float64(0.0)), ValueError, "eps must be finite and > 0"),
    (dict(eps=torch.tensor(float("inf"))), ValueError, "eps must be finite and > 0"),
    (dict(weight_decay=np.float32(-0.1)), ValueError, "weight_decay must be finite and >= 0"),
    (dict(weight_decay=False), TypeError, "weight_decay must be a number"),
    (dict(betas=(torch.tensor(1.0), torch.tensor(0.9))), ValueError, "betas must be two numbers in [0, 1)"),
    (dict(betas=(True, 0.9)), ValueError, "betas must be two numbers in [0, 1)"),
    (dict(betas=(np.float32(0.9), np.float32("nan"))), ValueError, "betas must be two numbers in [0, 1)"),
    (dict(betas=(0.9, "0.99")), ValueError, "betas must be two numbers in [0, 1)"),
])
def test_bad_hyperparameters_keep_their_messages(kw, error, says):
    """Bools, NaN, negative values and non-numbers are refused as before, whatever their type
    (torch's optim_error_inputs_func_adamw: invalid lr, betas, weight_decay)."""
    p = nn.Parameter(torch.randn(64, 128))
    with pytest.raises(error, match=r"^" + says.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        A.AdamW4bit([p], **kw)
    with pytest.raises(error, match=r"^param group 0: " + says.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        A.AdamW4bit([dict(params=[p], **kw)])


def test_bad_params_are_torchs_errors():
    """torch's error inputs for every optimizer (get_error_inputs_for_all_optims): a tensor in
    place of an iterable, a parameter twice in a group (a warning), one parameter in two groups,
    no parameters."""
    p, q = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))
    with pytest.raises(TypeError, match="params argument given to the optimizer should be an iterable"):
        A.AdamW4bit(p)
    with pytest.warns(UserWarning, match="a parameter group with duplicate parameters"):
        A.AdamW4bit([p, p])
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        A.AdamW4bit([dict(params=[p]), dict(params=[p, q])])
    with pytest.raises(ValueError, match="optimizer got an empty parameter list"):
        A.AdamW4bit([])


# ---------------------------------------------------------------------------------------------
# state dicts: determinism, older dicts, float steps, weights_only, DCP

@pytest.mark.parametrize("preset, dtype", [("zipsr", torch.float32), ("zeeden", torch.float32), ("fp32", torch.float32),
                                           ("zipsr", torch.bfloat16)])
def test_state_dict_deterministic(preset, dtype):
    """torch's test_state_dict_deterministic and bitsandbytes' test_ademamix_state_dict_no_nan:
    a fresh optimizer on equal (not identical) parameters that loads a deepcopy of the state dict
    continues bit for bit, the loaded states have the saved dtypes, shapes and values, and after
    more steps both state dicts are equal; the step counters are 0-d float32 CPU tensors, as
    torch's AdamW keeps them."""
    m = _mlp(dtype=dtype)
    o = A.AdamW4bit(m.parameters(), lr=1e-2, preset=preset, seed=3)
    _steps(m, o, 3)
    m2 = _clone(m)
    o2 = A.AdamW4bit(m2.parameters(), lr=1e-2, preset=preset)
    o2.load_state_dict(copy.deepcopy(o.state_dict()))
    for p, q in zip(m.parameters(), m2.parameters()):
        assert_same(o.state[p], o2.state[q])
        step = o2.state[q]["step"]
        assert torch.is_tensor(step) and step.dtype == torch.float32 and step.dim() == 0 and step.device.type == "cpu"
        assert float(step) == 3
    for i in range(4):
        _steps(m, o, 1, seed=10 + i)
        _steps(m2, o2, 1, seed=10 + i)
        assert_params_equal(m, m2)
    assert_same(o.state_dict(), o2.state_dict())


def _older(sd, drop):
    # a state dict of an earlier version: the group keys in `drop` and tensor step counters unknown
    old = copy.deepcopy(sd)
    for g in old["param_groups"]:
        for k in drop:
            g.pop(k, None)
        g.pop("adam4bit", None)
    for st in old["state"].values():
        st["step"] = float(st["step"])
    return old


def test_older_state_dict_without_newer_group_keys_loads_and_steps():
    """torch's test_can_load_older_state_dict: a state dict saved before a param-group key existed
    ("quantize", "maximize": any key of the defaults beside AdamW's four) loads, its groups take
    the defaults, and training continues bit for bit; so does one with Python-float step counters
    (torch's test_load_nontensor_step), which load as tensors."""
    m = _mlp()
    o = A.AdamW4bit(m.parameters(), lr=1e-2, seed=4)
    _steps(m, o, 3)
    newer = sorted(set(o.defaults) - {"lr", "betas", "eps", "weight_decay"})
    assert "quantize" in newer
    for drop in ([], newer):
        m2 = _clone(m)
        o2 = A.AdamW4bit(m2.parameters(), lr=1e-2)
        o2.load_state_dict(_older(o.state_dict(), drop))
        assert all(g[k] == o.defaults[k] for g in o2.param_groups for k in newer)
        assert all(torch.is_tensor(st["step"]) and float(st["step"]) == 3 for st in o2.state.values())
        m_ref = _clone(m)
        o_ref = A.AdamW4bit(m_ref.parameters(), lr=1e-2)
        o_ref.load_state_dict(copy.deepcopy(o.state_dict()))
        _steps(m2, o2, 2, seed=7)
        _steps(m_ref, o_ref, 2, seed=7)
        assert_params_equal(m2, m_ref)


@pytest.mark.parametrize("preset", ["zipsr", "fp32"])
def test_save_load_weights_only_round_trip(preset):
    """torch's test_save_load_equality_with_weights_only and TorchAO's test_optim_smoke: torch.save
    then torch.load(weights_only=True, map_location="cpu") gives the same state dict, which a fresh
    optimizer loads and continues from bit for bit."""
    m = _mlp()
    o = A.AdamW4bit(m.parameters(), lr=1e-2, preset=preset)
    _steps(m, o, 3)
    buf = io.BytesIO()
    torch.save(o.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True, map_location="cpu")
    assert_same(loaded, o.state_dict())
    m2 = _clone(m)
    o2 = A.AdamW4bit(m2.parameters(), lr=1e-2, preset=preset)
    o2.load_state_dict(loaded)
    _steps(m, o, 2, seed=1)
    _steps(m2, o2, 2, seed=1)
    assert_params_equal(m, m2)


@pytest.mark.parametrize("preset", ["zipsr", "fp32"])
@pytest.mark.parametrize("then_load", [False, True], ids=["in-place", "load_state_dict"])
def test_dcp_round_trip_continues_bit_for_bit(tmp_path, preset, then_load):
    """TorchAO's _test_fsdp2 checkpoint part, on one process without a process group: dcp.save of
    optimizer.state_dict(); a fresh optimizer takes one step with zero gradients (its states
    exist), dcp.load fills its state_dict() in place (then, or not, load_state_dict of it): the
    step counters are 5 again, not 1, and training continues bit for bit as the uninterrupted run
    (fp32: the FP32-state steps are recorded and replayed, and a counter changed in place voids
    the recorded plan)."""
    import torch.distributed.checkpoint as dcp
    m = _mlp()
    o = A.AdamW4bit(m.parameters(), lr=1e-2, preset=preset, seed=5)
    _steps(m, o, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # DCP in one process without a process group: intended
        dcp.save({"model": m.state_dict(), "optim": o.state_dict()}, checkpoint_id=str(tmp_path))
        m2 = _mlp(seed=1)
        o2 = A.AdamW4bit(m2.parameters(), lr=1e-2, preset=preset, seed=5)    # the same arguments
        for _ in range(2):                   # twice: the second step replays a recorded plan
            for p in m2.parameters():
                p.grad = torch.zeros_like(p)
            o2.step()
        sd = {"model": m2.state_dict(), "optim": o2.state_dict()}
        dcp.load(sd, checkpoint_id=str(tmp_path))
    if then_load:
        o2.load_state_dict(sd["optim"])
    assert [float(o2.state[p]["step"]) for p in m2.parameters()] == [5.0] * 4
    assert_params_equal(m2, m)
    _steps(m, o, 3, seed=2)
    _steps(m2, o2, 3, seed=2)
    assert_params_equal(m2, m)


def _fsdp_dcp_in_place(rank, world, tmp):
    # 2 ranks: 3 ZIP-SR steps under fully_shard, dcp.save of model.state_dict() and
    # optimizer.state_dict() (TorchAO's flow, not get_optimizer_state_dict), 2 more steps; a fresh
    # model and optimizer take one zero-gradient step, dcp.load fills both state dicts in place,
    # then the same 2 steps
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard
    res, path = {}, f"{tmp}/dcp-in-place"
    model = fully_shard(Quadratic(0))
    opt = A.AdamW4bit(model.parameters(), lr=1e-2, preset="zipsr", seed=6)
    quadratic_steps(model, opt, 0, 3)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    quadratic_steps(model, opt, 3, 5)
    res["want"] = full_params(model)
    model2 = fully_shard(Quadratic(1))
    opt2 = A.AdamW4bit(model2.parameters(), lr=1e-2, preset="zipsr", seed=6)
    for p in model2.parameters():
        p.grad = torch.zeros_like(p)
    opt2.step()
    opt2.zero_grad()
    dcp.load({"model": model2.state_dict(), "optim": opt2.state_dict()}, checkpoint_id=path)
    res["steps"] = [float(opt2.state[p]["step"]) for p in model2.parameters()]
    quadratic_steps(model2, opt2, 3, 5)
    res["got"] = full_params(model2)
    return res


def test_fsdp_dcp_in_place_round_trip_on_two_ranks(tmp_path):
    """TorchAO's _test_fsdp2 on 2 gloo ranks: dcp.save(optimizer.state_dict()) under fully_shard
    and dcp.load into a fresh optimizer's state_dict() in place restore the step counters (3) with
    the sharded codes and scales, and the next 2 steps equal the uninterrupted run's bit for bit."""
    for res in launch_ranks(_fsdp_dcp_in_place, tmp_path, 2):
        assert res["steps"] == [3.0] * len(FSDP_SHAPES)
        for a, b in zip(res["want"], res["got"]):
            assert torch.equal(a, b), tuple(a.shape)


def test_named_parameters_and_their_state_dict():
    """torch's test_can_load_from_to_named_state_dict: an optimizer built from named_parameters()
    keeps param_names in its state dict, which an unnamed one loads (and the other way round), and
    both step on."""
    m = _mlp()
    named = A.AdamW4bit(m.named_parameters(), lr=1e-2)
    _steps(m, named, 2)
    assert named.state_dict()["param_groups"][0]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    m2 = _clone(m)
    plain = A.AdamW4bit(m2.parameters(), lr=1e-2)
    plain.load_state_dict(copy.deepcopy(named.state_dict()))
    _steps(m, named, 2, seed=1)
    _steps(m2, plain, 2, seed=1)
    assert_params_equal(m, m2)
    named2 = A.AdamW4bit(_clone(m).named_parameters(), lr=1e-2)
    named2.load_state_dict(plain.state_dict())
    assert named2.state_dict()["param_groups"][0]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]


# ---------------------------------------------------------------------------------------------
# hooks

def test_step_pre_and_post_hooks():
    """torch's test_step_pre_hook, test_step_post_hook and test_step_all_hooks: the optimizer's own
    and the global step hooks run around every step(), in torch's order, until removed."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    m = _mlp()
    o, sgd = A.AdamW4bit(m.parameters(), lr=1e-3), torch.optim.SGD(m.parameters(), lr=0.0)
    data = []
    handles = [register_optimizer_step_pre_hook(lambda *a: data.append(0)),
               register_optimizer_step_post_hook(lambda *a: data.append(5))]
    for opt in (o, sgd):
        handles += [opt.register_step_pre_hook(lambda *a: data.append(1)),
                    opt.register_step_post_hook(lambda *a: data.append(2))]
    try:
        _steps(m, o, 1)
        assert data == [0, 1, 2, 5]
        sgd.step()
        _steps(m, o, 1)
        assert data == [0, 1, 2, 5] * 3
    finally:
        for h in handles:
            h.remove()
    _steps(m, o, 1)
    assert data == [0, 1, 2, 5] * 3


def test_state_dict_hooks():
    """torch's test_state_dict_pre_hook, test_state_dict_post_hook and test_state_dict_pre_post_hook:
    a pre hook's entry in optimizer.state reaches the state dict, and a post hook sees the state
    dict as state_dict() returns it (AdamW4bit's configuration included) and may change it."""
    p = nn.Parameter(torch.randn(64, 128))
    o = A.AdamW4bit([p], lr=1e-3)
    seen = {}

    def pre(opt):
        opt.state["test"] = 1

    def post(opt, sd):
        seen.update(keys=set(sd), group_keys=set(sd["param_groups"][0]))
        sd["ran_pre_hook"] = sd["state"].pop("test", None) == 1
        return sd
    o.register_state_dict_pre_hook(pre)
    assert o.state_dict()["state"]["test"] == 1
    o.register_state_dict_post_hook(post)
    sd = o.state_dict()
    assert sd["ran_pre_hook"] and "test" not in sd["state"]
    assert {"adam4bit", "adam4bit_extra"} <= seen["keys"] and "adam4bit" in seen["group_keys"]


def test_load_state_dict_hooks():
    """torch's test_load_state_dict_pre_hook_and_prepend, test_load_state_dict_post_hook and
    test_load_state_dict_pre_post_hook: pre hooks get the state dict as passed (AdamW4bit's
    configuration included), in order (prepend=True first), and what they change or return is
    loaded; post hooks see the loaded optimizer, its 4-bit codes as uint8."""
    p = nn.Parameter(torch.randn(64, 128))
    o = A.AdamW4bit([p], lr=1e-3)
    p.grad = torch.randn_like(p)
    o.step()
    sd = o.state_dict()
    seen = []

    def pre1(opt, state_dict):
        seen.append("adam4bit" in state_dict and "adam4bit" in state_dict["param_groups"][0])
        state_dict["param_groups"][0]["lr"] = 0.002

    def pre2(opt, state_dict):
        mine = copy.deepcopy(state_dict)
        mine["param_groups"][0]["lr"] = 0.003
        return mine

    def post(opt):
        seen.append((opt.param_groups[0]["lr"], opt.state[p]["exp_avg"].dtype, opt.state[p]["exp_avg_scale"].dtype))
    o.register_load_state_dict_pre_hook(pre1)
    o.load_state_dict(sd)
    assert o.param_groups[0]["lr"] == 0.002 and seen == [True]
    o.register_load_state_dict_pre_hook(pre2, prepend=True)
    o.load_state_dict(sd)
    assert o.param_groups[0]["lr"] == 0.002            # pre2 first, then pre1 on its dict
    o2 = A.AdamW4bit([p], lr=1e-3)
    o2.register_load_state_dict_pre_hook(pre2)
    o2.register_load_state_dict_post_hook(post)
    o2.load_state_dict(sd)
    assert seen[-1] == (0.003, torch.uint8, torch.float32)
    assert torch.equal(o2.state[p]["exp_avg"], o.state[p]["exp_avg"])


# ---------------------------------------------------------------------------------------------
# what torch's tests ask of every optimizer

def test_steps_without_or_with_zero_gradients_change_nothing():
    """torch's test_step_is_noop_when_params_have_no_grad and test_step_is_noop_for_zero_grads
    (weight_decay 0): no gradient, no change; zero gradients, zero moments, no change (4-bit states
    too: a zero block stores zero)."""
    for preset in ("zipsr", "zeeden", "torchao", "fp32"):
        ps = [nn.Parameter(torch.randn(64, 128)), nn.Parameter(torch.randn(5, 1))]
        before = [p.detach().clone() for p in ps]
        o = A.AdamW4bit(ps, lr=1e-5, weight_decay=0.0, preset=preset)
        assert o.step(lambda: torch.tensor([1.0])) == torch.tensor([1.0])
        for p in ps:
            p.grad = torch.zeros_like(p)
        o.step()
        o.step()
        assert all(torch.equal(p, b) for p, b in zip(ps, before)), preset


def test_printing_deepcopy_and_non_empty_state():
    """torch's test_optimizer_can_be_printed, test_deepcopy_copies_all_public_attrs and
    test_non_empty_state."""
    m = _mlp()
    o = A.AdamW4bit(m.parameters(), lr=1e-3, kernel_uniforms=True, maximize=False)
    assert "AdamW4bit" in repr(o)
    _steps(m, o, 2)
    public = lambda obj: {k for k in obj.__dict__ if not k.startswith("_")}   # noqa: E731
    assert public(o) == public(copy.deepcopy(o))
    assert copy.deepcopy(o).kernel_uniforms is True
    assert all(len(st) > 0 for st in o.state.values())


# ---------------------------------------------------------------------------------------------
# states and groups replaced by the user: the recorded step must not keep stepping the old ones
# (torch's AdamW reads opt.state and param_groups anew each step)

REPLAY_CASES = [("fp32", "torch"), ("zipsr", "triton")]   # FP32-state steps; the kernel (interpreted)


@pytest.mark.parametrize("preset, impl", REPLAY_CASES)
def test_state_tensors_and_dicts_replaced_are_the_ones_stepped(preset, impl):
    """A state tensor replaced (st[k] = v.clone(), as a helper moving states between devices does)
    or a parameter's state dict replaced by a copy: the next steps update the new tensors and the
    weights equal an untouched optimizer's, bit for bit (the recorded plan stepped the old ones)."""
    runs = []
    for touch in (None, "tensors", "dict"):
        m = _mlp()
        o = A.AdamW4bit(m.parameters(), lr=1e-2, preset=preset, impl=impl)
        _steps(m, o, 2)
        if touch == "tensors":
            for st in o.state.values():
                for k in [k for k in st if k != "step"]:
                    st[k] = st[k].clone()
        elif touch == "dict":
            for p in list(o.state):
                o.state[p] = {k: v.clone() for k, v in o.state[p].items()}
        _steps(m, o, 2, seed=1)
        runs.append((m, o))
    (want, o_want), *others = runs
    for m, o in others:
        assert_params_equal(m, want)
        assert_same(o.state_dict(), o_want.state_dict())
        assert all(float(st["step"]) == 4 for st in o.state.values())


@pytest.mark.parametrize("preset, impl", REPLAY_CASES)
def test_state_cleared_restarts_the_moments(preset, impl):
    """opt.state.clear() (or del opt.state[p]) restarts the moments, as with torch's AdamW: the
    weights equal a fresh optimizer's from there on, and state_dict() holds the new states."""
    m, fresh = _mlp(), None
    o = A.AdamW4bit(m.parameters(), lr=1e-2, preset=preset, impl=impl)
    _steps(m, o, 2)
    fresh = _clone(m)
    o.state.clear()
    _steps(m, o, 2, seed=1)
    _steps(fresh, A.AdamW4bit(fresh.parameters(), lr=1e-2, preset=preset, impl=impl), 2, seed=1)
    assert_params_equal(m, fresh)
    assert len(o.state_dict()["state"]) == len(list(m.parameters()))
    first = next(iter(m.parameters()))
    del o.state[first]
    _steps(m, o, 1, seed=2)
    assert float(o.state[first]["step"]) == 1 and float(o.state[next(iter(m.parameters()))]["step"]) == 1


@pytest.mark.parametrize("preset, impl", REPLAY_CASES)
def test_param_group_dict_replaced_is_read(preset, impl):
    """A param group replaced by a new dict (opt.param_groups[0] = {**group, "lr": 0.0}) is the one
    the next step reads: with lr 0 and weight decay the weights do not move, as with torch's."""
    m = _mlp()
    o = A.AdamW4bit(m.parameters(), lr=1e-2, preset=preset, impl=impl)
    _steps(m, o, 2)
    before = [p.detach().clone() for p in m.parameters()]
    o.param_groups[0] = {**o.param_groups[0], "lr": 0.0}
    _steps(m, o, 1, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


# ---------------------------------------------------------------------------------------------
# the kernel against the reference drawing the kernel's SR uniforms

@pytest.mark.parametrize("preset, dtype, kw", [("zipsr", torch.float32, {}), ("zeeden", torch.float32, {}),
                                               ("zipsr", torch.bfloat16, dict(param_rounding="sr"))],
                         ids=["zipsr", "zeeden", "zipsr-bf16-sr-write"])
def test_kernel_equals_reference_drawing_its_uniforms(preset, dtype, kw):
    """impl="triton" (TRITON_INTERPRET=1) and impl="torch" with kernel_uniforms=True give the same
    weights and states bit for bit over several steps on the SR presets: v's Update-SR (ZIP-SR),
    the LM head's first moment after 90 % (both), the BF16 SR write of 4-bit and FP32-state
    tensors. With the reference's own torch.rand uniforms the two differ from the first step."""
    shapes = [(4096,), (33, 128), (100,)]      # 2 kernel programs, 2 and a partial one, FP32 states
    gen = torch.Generator().manual_seed(21)
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    runs = {}
    for name, extra in (("triton", dict(impl="triton")), ("reference", dict(impl="torch", kernel_uniforms=True)),
                        ("torch.rand", dict(impl="torch"))):
        ps = [nn.Parameter(w.clone()) for w in init]
        o = A.AdamW4bit(ps, lr=1e-2, preset=preset, seed=9, **kw, **extra)
        o.mark_lm_head(ps[1])
        o.set_progress(0.95)
        g = torch.Generator().manual_seed(22)
        for step in range(1 if name == "torch.rand" else 3):
            for p in ps:
                p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(dtype)
            o.step()
            if step == 0:
                first = [(p.detach().clone(), copy.deepcopy(o.state[p])) for p in ps]
        runs[name] = ps, o, first
    (kp, ko, _), (rp, ro, ref_first), (_, _, rand_first) = runs["triton"], runs["reference"], runs["torch.rand"]
    for a, b in zip(kp, rp):
        assert torch.equal(a, b), tuple(a.shape)
        assert_same(ko.state[a], ro.state[b])
    # torch.rand's uniforms: other codes (or BF16 weights) than the kernel's after step 1
    assert any(not torch.equal(w, w2) or any(not torch.equal(st[k], st2[k]) for k in st)
               for (w, st), (w2, st2) in zip(ref_first, rand_first))
