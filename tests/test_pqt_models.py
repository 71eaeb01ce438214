"""
Table C's casts to FP formats (cast_fp, cast_tiles, cast_to_tiers) and apply_pqt / remove_pqt on any
model: names, globs, heads, GPT-2's Conv1D, shared modules, plain checkpoints, Hugging Face Llama and
GPT-2 (those need transformers), what a first-time user meets.
"""
import argparse
import copy
import gc
import itertools
import math
import warnings

import pytest
import torch
import torch.nn as nn

import adam4bit as A
import gaussws as g
from lowbit.pqt.export import cast_fp, cast_tiles, cast_to_tiers
from model import GPT, preset_config

from tests.helpers import Model, gpt2_like, untouched


# ---------------------------------------------------------------------------------------------
# Table C: casting sampled weights to FP formats

def test_cast_fp_fp4_e2m1_grid_ties_and_saturation():
    # OCP FP4 E2M1 (no inf/NaN codes): 0, 0.5, 1, 1.5, 2, 3, 4, 6
    x = torch.tensor([0.5, 1.5, 3.0, 6.0, 0.1, 0.3, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 1e9,
                      float("inf"), -float("inf"), -2.9, -0.26, 0.0])
    want = [0.5, 1.5, 3.0, 6.0, 0.0, 0.5, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0,
            6.0, -6.0, -3.0, -0.5, 0.0]
    # ties: 0.25 -> 0 (code 0 even, not the subnormal 0.5), 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
    # 2.5 -> 2, 3.5 -> 4, 5 -> 4: the neighbour whose mantissa bit is 0
    assert cast_fp(x, 2, 1, inf_nan=False).tolist() == want
    assert math.isnan(cast_fp(torch.tensor([float("nan")]), 2, 1, inf_nan=False).item())


def test_cast_fp_e3m4_subnormals_and_saturation():
    # IEEE-style e3m4 (Table C's FP8 tier): bias 3, emin -2, emax 3 (exponent 7 = inf/NaN),
    # subnormal step 2^(-2-4) = 1/64, largest finite (2 - 1/16) * 8 = 15.5
    s = 1 / 64
    x = torch.tensor([s, s / 2, 3 * s / 2, 5 * s / 2, 0.4 * s, 0.25, 0.25 + s / 2, 15.5, 15.7, 100.0, -1e30])
    want = [s, 0.0, 2 * s, 2 * s, 0.0, 0.25, 0.25, 15.5, 15.5, 15.5, -15.5]
    # 0.25 + s/2: 0.25 is in binade [2^-2, 2^-1) with step 2^-6 = s, so s/2 is a tie -> 0.25 (even)
    assert cast_fp(x, 3, 4).tolist() == want


def test_cast_fp_matches_torch_float16_and_float8():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50_000, generator=gen) * torch.exp2(torch.randint(-30, 20, (50_000,), generator=gen).float())
    h = x.clamp(-65504, 65504)                       # IEEE half = e5m10 with inf/NaN codes
    assert torch.equal(cast_fp(h, 5, 10), h.half().float())
    y = x.clamp(-57344, 57344)                       # float8_e5m2: IEEE-style
    assert torch.equal(cast_fp(y, 5, 2), y.to(torch.float8_e5m2).float())
    z = x.clamp(-440, 440)                           # float8_e4m3fn: all exponents finite (below 448)
    assert torch.equal(cast_fp(z, 4, 3, inf_nan=False), z.to(torch.float8_e4m3fn).float())


def _grid(e, m, inf_nan):
    """All nonnegative values of the format, by code, in increasing order (code parity = mantissa LSB)."""
    bias = 2 ** (e - 1) - 1
    vals = []
    for E, M in itertools.product(range(2 ** e - (1 if inf_nan else 0)), range(2 ** m)):
        vals.append(M * 2.0 ** (1 - bias - m) if E == 0 else (1 + M / 2 ** m) * 2.0 ** (E - bias))
    return torch.tensor(vals, dtype=torch.float64)


@pytest.mark.parametrize("e,m,inf_nan", [(3, 4, True), (4, 7, True), (2, 1, False), (4, 3, True), (3, 2, False)])
def test_cast_fp_is_the_nearest_grid_point_ties_to_even(e, m, inf_nan):
    grid = _grid(e, m, inf_nan)
    assert torch.all(grid[1:] > grid[:-1])
    gen = torch.Generator().manual_seed(e * 100 + m)
    x = (torch.rand(4000, generator=gen, dtype=torch.float64) * 2 - 1) * grid[-1] * 1.2
    x = torch.cat([x, x / 64, x / 2 ** 12])
    q = cast_fp(x, e, m, inf_nan)
    dist = (x.abs()[:, None] - grid[None, :]).abs()
    assert torch.equal(q.abs(), grid[dist.argmin(1)])            # nearest (saturating beyond the top)
    assert torch.equal(torch.sign(q), torch.sign(x) * (q != 0))
    mid = (grid[1:] + grid[:-1]) / 2                              # exact ties: the even code wins
    even = torch.where(torch.arange(len(mid)) % 2 == 0, grid[:-1], grid[1:])
    assert torch.equal(cast_fp(mid, e, m, inf_nan), even)
    assert torch.equal(cast_fp(-mid, e, m, inf_nan), -even)
    assert torch.equal(cast_fp(grid, e, m, inf_nan), grid)  # grid points are fixed points


def test_cast_fp_rejects_bad_formats():
    with pytest.raises(ValueError, match=r"cast_fp: exp_bits=0 must be an int in \[1, 8\]"):
        cast_fp(torch.ones(2), 0, 3)
    with pytest.raises(ValueError, match=r"man_bits=2.5"):
        cast_fp(torch.ones(2), 3, 2.5)
    with pytest.raises(ValueError, match="inf_nan=False"):
        cast_fp(torch.ones(2), 1, 2)


def test_cast_tiles_scales_each_tile_by_its_absmax():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(70, 45, generator=gen) * torch.exp2(torch.randint(-8, 8, (70, 45), generator=gen).float())
    w[32:64, 32:45] = 0.0                                          # an all-zero (partial) tile
    q = cast_tiles(w, 3, 4)
    assert torch.equal(cast_tiles(q, 3, 4), q)               # idempotent: the tile scales stay
    assert torch.equal(q[32:64, 32:45], w[32:64, 32:45])
    for r, c in [(0, 0), (0, 1), (1, 0), (2, 1)]:                  # each tile on its own (edge tiles partial)
        t = w[32 * r:32 * r + 32, 32 * c:32 * c + 32]
        k = math.floor(math.log2(t.abs().max().item())) - 3      # absmax into e3m4's top binade [8, 16)
        assert torch.equal(q[32 * r:32 * r + 32, 32 * c:32 * c + 32], cast_fp(t / 2.0 ** k, 3, 4) * 2.0 ** k)
    w2 = w.clone()
    w2[0, 0] = 1e6                                                  # another tile's scale is untouched
    assert torch.equal(cast_tiles(w2, 3, 4)[32:], q[32:]) and torch.equal(cast_tiles(w2, 3, 4)[:, 32:], q[:, 32:])


def test_cast_to_tiers_uses_each_tiles_clamped_b_t():
    layer = g.GaussWSLinear(64, 64, bias=False, b_init=6.0, b_target=4.0)
    model = torch.nn.Sequential(layer).eval()
    w0 = layer.weight.detach().clone()
    # b_t = 4 + 2 b_i: tiles at 4 (FP8), 7 (FP12), 11 (FP16) and 30 (clamped to 24: kept)
    with torch.no_grad():
        layer.b_i.copy_(torch.tensor([[0.0, 1.5], [3.5, 13.0]]))
    share = cast_to_tiers(g.pqt_layers(model))
    assert share == {"FP8 e3m4": 0.25, "FP12 e4m7": 0.25, "FP16 e5m10": 0.25, ">FP16": 0.25}
    stats = g.bitwidth_stats(model)["all"]
    assert share["FP8 e3m4"] == stats["share_le5"]
    assert share["FP8 e3m4"] + share["FP12 e4m7"] == stats["share_le9"]
    w = layer.weight.detach()
    for (r, c), (e, m) in {(0, 0): (3, 4), (0, 1): (4, 7), (1, 0): (5, 10)}.items():
        sl = (slice(32 * r, 32 * r + 32), slice(32 * c, 32 * c + 32))
        assert torch.equal(w[sl], cast_tiles(w0[sl], e, m)) and not torch.equal(w[sl], w0[sl])
    assert torch.equal(w[32:, 32:], w0[32:, 32:])


# ---------------------------------------------------------------------------------------------
# any model: apply_pqt by name, GPT-2's Conv1D, remove_pqt, plain checkpoints; Hugging Face models

def test_apply_pqt_by_modules_glob_list_and_callable():
    assert g.apply_pqt(gpt2_like(), modules="blocks.*.mlp.*") == [
        "blocks.0.mlp.up", "blocks.0.mlp.down", "blocks.1.mlp.up", "blocks.1.mlp.down"]
    assert g.apply_pqt(gpt2_like(), modules=["blocks.0.attn.qkv", "*.down"]) == [
        "blocks.0.attn.qkv", "blocks.0.mlp.down", "blocks.1.mlp.down"]
    m = gpt2_like()
    asked = []
    names = g.apply_pqt(m, modules=lambda n, mod: asked.append(n) or mod.out_features == 96)
    assert names == ["blocks.0.attn.qkv", "blocks.0.mlp.up", "blocks.1.attn.qkv", "blocks.1.mlp.up"]
    assert "lm_head" not in asked and "wte" not in asked and len(asked) == 8   # linears only, no head
    seq = nn.Sequential(nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 8))
    assert g.apply_pqt(seq, modules="*") == ["0", "2"]
    assert all(type(seq[i]) is g.GaussWSLinear for i in (0, 2))
    shared = nn.Linear(40, 40)
    two = nn.Sequential(shared, nn.ReLU(), shared)      # one module at two places: one layer at both
    assert g.apply_pqt(two, modules="*") == ["0"] and two[0] is two[2] and two[0].weight is shared.weight
    m = gpt2_like()
    for kw, err, msg in ((dict(modules="nothing*"), ValueError,
                          r"modules='nothing\*'\) selects no nn.Linear .*the model's linears: 'blocks.0.attn.qkv', "),
                         (dict(modules="wte"), ValueError, "never embeddings or norms"),
                         (dict(modules=3), TypeError, "modules=3: allowed: a glob"),
                         (dict(modules=[]), TypeError, r"modules=\[\]"),
                         (dict(modules="*", parts="od"), ValueError, "not both"),
                         (dict(modules="lm_head"), ValueError, r"but the LM head 'lm_head' \(lm_head=True samples it\)")):
        with pytest.raises(err, match=msg):
            g.apply_pqt(m, **kw)
        assert untouched(m)
    assert g.apply_pqt(m, modules="lm_head", lm_head=True) == ["lm_head"]
    with pytest.raises(ValueError, match=r"already GaussWSLinear: 'lm_head'"):
        g.apply_pqt(m, modules="lm_head", lm_head=True)


class _TiedLM(nn.Module):
    """An embedding, a hidden linear, an output linear tied to the embedding (named `proj`, not
    lm_head) and an untied extra head reported by get_output_embeddings, as Hugging Face does."""
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.hidden = nn.Linear(32, 32)
        self.proj = nn.Linear(32, 64, bias=False)
        self.proj.weight = self.emb.weight
        self.head2 = nn.Linear(32, 64, bias=False)

    def get_output_embeddings(self):
        return self.head2


def test_apply_pqt_never_samples_a_tied_or_output_head_unless_asked():
    m = _TiedLM()
    assert g.apply_pqt(m, modules="*") == ["hidden"]
    assert type(m.proj) is nn.Linear and type(m.head2) is nn.Linear
    m = _TiedLM()
    assert g.apply_pqt(m, modules="*", lm_head=True) == ["hidden", "proj", "head2"]
    assert m.proj.weight is m.emb.weight            # still tied: the embedding reads w, the head w_hat


class Conv1D(nn.Module):
    """Hugging Face GPT-2's Conv1D as transformers defines it (nf outputs, nx inputs, weight
    (nx, nf), y = x @ weight + bias), here so the test runs without transformers."""
    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, self.nx), self.weight).view(*x.shape[:-1], self.nf)


def test_conv1d_is_sampled_as_its_transposed_linear_with_the_same_tiles():
    torch.manual_seed(31)
    m = nn.Sequential(Conv1D(70, 45))                 # 45 -> 70, weight (45, 70)
    w = m[0].weight
    x = torch.randn(3, 5, 45)
    m.eval()
    y_plain = m(x)
    assert g.apply_pqt(m, modules="*") == ["0"]
    conv = m[0]
    assert type(conv) is g.GaussWSConv1D and conv.weight is w and conv.b_i.shape == (3, 2)
    assert torch.equal(m(x), y_plain)                 # eval: the plain Conv1D product
    # training: exactly GaussWSLinear(45, 70) holding w.t(), with the same b_i and noise_state
    lin = g.GaussWSLinear(45, 70)
    with torch.no_grad():
        conv.b_i.uniform_(0.2, 1.0)
        lin.weight.copy_(w.t())
        lin.bias.copy_(conv.bias)
        lin.b_i.copy_(conv.b_i)
        lin.noise_state.copy_(conv.noise_state)
    m.train()
    y_conv, y_lin = m(x), lin(x)
    assert torch.equal(y_conv, y_lin) and not torch.equal(y_conv, y_plain)
    (y_conv * y_lin.detach()).sum().backward()
    (y_lin * y_conv.detach()).sum().backward()
    assert torch.equal(conv.weight.grad, lin.weight.grad.t()) and torch.equal(conv.b_i.grad, lin.b_i.grad)
    assert g.bitwidth_stats(m)["0"]["params"] == 45 * 70
    m.eval()
    y_pqt = m(x)
    back = copy.deepcopy(m)
    assert g.remove_pqt(back) == ["0"]
    assert type(back[0]) is Conv1D and torch.equal(back(x), y_pqt)
    # the Table C cast of each tile is the twin linear's, transposed; the Parameter stays
    w0 = w.detach().clone()
    cast_to_tiers(g.pqt_layers(nn.Sequential(lin)))
    g.remove_pqt(m, cast="tiers")
    assert type(m[0]) is Conv1D and m[0].weight is w and torch.equal(w, lin.weight.t())
    assert not torch.equal(w, w0)
    made = g.GaussWSConv1D(45, 70)                    # made directly: Conv1D's layout and init
    assert made.weight.shape == (45, 70) and made(x).shape == (3, 5, 70)
    assert 0.015 < made.weight.std().item() < 0.025 and torch.equal(made.bias, torch.zeros(70))


def _set_random_bitwidths(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in g.pqt_layers(model):
            layer.b_i.copy_(torch.rand(layer.b_i.shape, generator=gen) * 1.5 - 0.5)   # b_t in [3, 7]


def test_remove_pqt_gives_plain_layers_with_the_same_eval_outputs_and_casts():
    torch.manual_seed(32)
    plain = gpt2_like()
    keys = sorted(plain.state_dict())
    x = torch.randn(2, 5, 32)
    for cast in (None, "tiers", "e3m4", "e2m3"):
        m = gpt2_like()
        m.load_state_dict(plain.state_dict())
        g.apply_pqt(m, seed=4)
        _set_random_bitwidths(m)
        w0 = {n: l.weight.detach().clone() for n, l in g.pqt_layers(m)}
        params = {n: (l.weight, l.bias) for n, l in g.pqt_layers(m)}
        m.eval()
        if cast == "tiers":
            ref = gpt2_like()
            ref.load_state_dict(m.state_dict(), strict=False)
            g.apply_pqt(ref, seed=4)
            ref.load_state_dict(m.state_dict())
            cast_to_tiers(g.pqt_layers(ref))
            y_ref = ref.eval()(x)
        else:
            y_ref = m(x) if cast is None else None
        names = g.remove_pqt(m, cast=cast)
        assert names == list(w0) and not g.pqt_layers(m) and not m.training
        for n in names:
            layer = m.get_submodule(n)
            assert type(layer) is nn.Linear and (layer.weight, layer.bias) == params[n]
            if cast is None:
                assert torch.equal(layer.weight, w0[n])
            elif cast != "tiers":
                e, mb = int(cast[1]), int(cast[3])
                assert torch.equal(layer.weight, cast_tiles(w0[n], e, mb))
        if y_ref is not None:
            assert torch.equal(m(x), y_ref)
        assert sorted(m.state_dict()) == keys
        fresh = gpt2_like()
        fresh.load_state_dict(m.state_dict())          # strict: the state dict of the plain model
        assert torch.equal(fresh.eval()(x), m(x))
    m = gpt2_like()
    with pytest.raises(ValueError, match="has no GaussWSLinear layer"):
        g.remove_pqt(m)
    g.apply_pqt(m)
    for cast, msg in (("fp8", r"cast='fp8': allowed: None .*'e3m4'"), ("e9m2", r"cast='e9m2': cast_fp: exp_bits=9"),
                      (4, "cast=4: allowed")):
        with pytest.raises(ValueError, match=msg):
            g.remove_pqt(m, cast=cast)
    assert len(g.pqt_layers(m)) == 8 and m.training      # untouched by the refused calls
    with pytest.raises(ValueError, match="it is one: put it in a module"):
        g.remove_pqt(g.GaussWSLinear(8, 8))


def test_plain_checkpoint_loads_into_a_pqt_model_as_at_construction():
    torch.manual_seed(33)
    plain = gpt2_like()
    x = torch.randn(2, 5, 32)
    m = gpt2_like()
    g.apply_pqt(m, seed=8)
    fresh = {n: l.noise_state.clone() for n, l in g.pqt_layers(m)}
    m(x).sum().backward()                             # advance the call counters
    _set_random_bitwidths(m)
    assert not m.load_state_dict(plain.state_dict()).missing_keys      # strict=True
    for n, l in g.pqt_layers(m):
        assert torch.equal(l.b_i, torch.ones_like(l.b_i)) and torch.equal(l.noise_state, fresh[n])
        assert torch.equal(l.weight, plain.get_submodule(n).weight)
    assert torch.equal(m.eval()(x), plain.eval()(x))
    # a PQT checkpoint that lost only b_i is not a plain one: strict loading names the key
    sd = {k: v for k, v in m.state_dict().items() if k != "blocks.0.attn.qkv.b_i"}
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*blocks.0.attn.qkv.b_i"):
        m.load_state_dict(sd)


def _hf(kind, tie=False):
    """A tiny randomly initialised Hugging Face model built from a config (no download): byte
    vocabulary, 2 layers of width 64."""
    tf = pytest.importorskip("transformers", reason="Hugging Face tests need transformers "
                                                   "(pip install transformers accelerate)")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "llama":
        cfg = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=tie)
        return tf.LlamaForCausalLM(cfg)
    cfg = tf.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)   # no dropout RNG
    return tf.GPT2LMHeadModel(cfg)


def _text_rows(n, T=64):
    """n real-text rows of T bytes (argparse's source, present everywhere), in a fixed order."""
    data = torch.tensor(list(open(argparse.__file__, "rb").read()[:n * T]), dtype=torch.long)
    return data.view(n, T)


def test_hf_llama_and_gpt2_parts_conv1d_and_tied_heads():
    m = _hf("llama")
    names = g.apply_pqt(m, parts="all")
    per = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    assert names == [f"model.layers.{i}.{p}" for i in range(2) for p in per]
    assert type(m.lm_head) is nn.Linear and type(m.model.embed_tokens) is nn.Embedding
    assert g.apply_pqt(_hf("llama"), parts="od") == [f"model.layers.{i}.{p}" for i in range(2)
                                                     for p in ("self_attn.o_proj", "mlp.down_proj")]
    with pytest.raises(ValueError, match=r"no nn.Linear named qkv .*it has: q, k, v, out, gate, up, down"):
        g.apply_pqt(_hf("llama"), parts="qkv")
    tied = _hf("llama", tie=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert g.apply_pqt(tied, modules="*") == names      # the tied head is left out
    assert type(tied.lm_head) is nn.Linear
    gpt2 = _hf("gpt2")
    names = g.apply_pqt(gpt2, parts="all")
    per = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    assert names == [f"transformer.h.{i}.{p}" for i in range(2) for p in per]
    assert all(type(l) is g.GaussWSConv1D for _, l in g.pqt_layers(gpt2))
    assert gpt2.transformer.h[0].mlp.c_fc.b_i.shape == (8, 2)          # 64 -> 256: (256/32, 64/32)
    assert g.apply_pqt(_hf("gpt2"), parts="od") == [f"transformer.h.{i}.{p}" for i in range(2)
                                                    for p in ("attn.c_proj", "mlp.c_proj")]


def _hf_optimizer(m, lr=3e-3):
    """ZIP-SR 4-bit states, with the embeddings and the LM head in an FP32-state group."""
    head = [m.get_input_embeddings().weight, m.get_output_embeddings().weight]
    head = list({id(p): p for p in head}.values())
    rest = [p for p in m.parameters() if all(p is not h for h in head)]
    return A.AdamW4bit([dict(params=head, quantize=False), dict(params=rest)], lr=lr, preset="zipsr")


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hf_gaussws_zipsr_lowers_the_loss_on_real_text(kind):
    m = _hf(kind)
    g.apply_pqt(m, parts="all", seed=1)
    opt = _hf_optimizer(m)
    rows, gen = _text_rows(400), torch.Generator().manual_seed(0)
    losses = []
    for _ in range(30):
        x = rows[torch.randint(0, len(rows), (8,), generator=gen)]
        loss = m(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    # from ln(256) = 5.5 at random init; byte statistics alone give ~3 nats within 30 steps
    assert losses[0] > 5.0 and sum(losses[-5:]) / 5 < 0.7 * losses[0]
    w = m.model.layers[0].mlp.up_proj.weight if kind == "llama" else m.transformer.h[0].mlp.c_fc.weight
    assert opt.state[w]["exp_avg"].dtype == torch.uint8
    assert opt.state[m.get_input_embeddings().weight]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hf_state_dict_round_trip_and_remove_pqt(kind):
    plain_keys = sorted(_hf(kind).state_dict())
    m = _hf(kind)
    g.apply_pqt(m, seed=2)
    _set_random_bitwidths(m)
    x = _text_rows(4)
    m(input_ids=x, labels=x).loss.backward()         # the call counters move on
    sd = m.state_dict()
    m2 = _hf(kind)
    g.apply_pqt(m2, seed=99)                          # keys and counters come from the state dict
    m2.load_state_dict(sd)
    assert torch.equal(m(input_ids=x).logits, m2(input_ids=x).logits)      # training: same noise
    m.eval()
    y = m(input_ids=x).logits
    assert g.remove_pqt(m) == [n for n, _ in g.pqt_layers(m2)]
    assert torch.equal(m(input_ids=x).logits, y) and sorted(m.state_dict()) == plain_keys
    plain = _hf(kind)
    plain.load_state_dict(m.state_dict())             # strict: a plain Hugging Face state dict
    assert torch.equal(plain.eval()(input_ids=x).logits, y)
    back = _hf(kind)
    g.apply_pqt(back)
    back.load_state_dict(plain.state_dict())          # and a plain checkpoint loads into PQT
    assert torch.equal(back.eval()(input_ids=x).logits, y)


def test_hf_trainer_with_adamw4bit_an_lr_schedule_and_resume(tmp_path):
    tf = pytest.importorskip("transformers", reason="the Trainer test needs transformers and accelerate")
    rows = _text_rows(128)

    def trainer(quantize_head):
        m = _hf("llama")
        g.apply_pqt(m, seed=3)
        opt = _hf_optimizer(m, lr=1e-2)
        opt.param_groups[0]["quantize"] = quantize_head
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / 10)
        args = tf.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=8,
                                    logging_steps=1, report_to="none", use_cpu=True, save_steps=4,
                                    disable_tqdm=True, seed=0)
        return m, opt, tf.Trainer(model=m, args=args, train_dataset=[dict(input_ids=r, labels=r) for r in rows],
                                  optimizers=(opt, sched))
    m, opt, tr = trainer(quantize_head=False)
    tr.train()
    losses = [h["loss"] for h in tr.state.log_history if "loss" in h]
    assert len(losses) == 8 and losses[-1] < 0.8 * losses[0]
    assert getattr(tr.optimizer, "optimizer", tr.optimizer) is opt
    assert opt.param_groups[1]["lr"] == pytest.approx(1e-2 * (1 - 8 / 10))
    w = m.model.layers[1].self_attn.q_proj.weight
    assert opt.state[w]["step"] == 8 and opt.state[w]["exp_avg"].dtype == torch.uint8
    assert opt.state[m.lm_head.weight]["exp_avg"].dtype == torch.float32
    # resume from the step-4 checkpoint: the saved policy (FP32 head states) wins over the new
    # optimizer's, and the model (b_i, noise counters) and optimizer end bit for bit as above
    m2, opt2, tr2 = trainer(quantize_head=True)
    tr2.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert opt2.param_groups[0]["quantize"] is False
    for (n, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), n
    # or the Trainer builds it, with its own groups (no weight decay on norms and biases)
    m3 = _hf("llama")
    args = tf.TrainingArguments(output_dir=str(tmp_path / "cls"), per_device_train_batch_size=8, max_steps=2,
                                report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
                                learning_rate=1e-2, weight_decay=0.1)
    tr3 = tf.Trainer(model=m3, args=args, train_dataset=[dict(input_ids=r, labels=r) for r in rows],
                     optimizer_cls_and_kwargs=(A.AdamW4bit, dict(preset="zipsr")))
    tr3.train()
    opt3 = getattr(tr3.optimizer, "optimizer", tr3.optimizer)
    assert type(opt3) is A.AdamW4bit and [gr["weight_decay"] for gr in opt3.param_groups] == [0.1, 0.0]
    assert opt3.state[m3.model.layers[0].mlp.up_proj.weight]["exp_avg"].dtype == torch.uint8


# ---------------------------------------------------------------------------------------------
# any model, what a first-time user meets: bf16 models learn b_t, a second apply_pqt, Hugging Face
# names in parts, shared modules, heads, the modules filter's errors, an optimizer built too early

def test_b_i_is_float32_with_bf16_weights_so_small_steps_move_b_t_and_a_later_cast_warns():
    assert g.GaussWSLinear(40, 40, dtype=torch.bfloat16).b_i.dtype == torch.float32
    torch.manual_seed(33)
    m = nn.Sequential(nn.Linear(40, 40)).to(torch.bfloat16)
    g.apply_pqt(m, modules="*", impl="torch")
    layer = m[0]
    assert layer.weight.dtype == torch.bfloat16 and layer.b_i.dtype == layer.b_t.dtype == torch.float32
    x = torch.randn(4, 40, dtype=torch.bfloat16)
    opt = torch.optim.Adam([layer.b_i], lr=1e-3)    # a step of ~1e-3: below BF16's spacing at 1.0
    m(x).float().pow(2).sum().backward()
    assert (layer.b_i.grad != 0).all()
    opt.step()
    assert (layer.b_i != 1).all()
    m.to(torch.bfloat16)                           # a cast after apply_pqt: b_i BF16 again
    with pytest.warns(UserWarning, match=r"GaussWSLinear 0: b_i is torch.bfloat16.*keep b_i float32"):
        m(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")             # once per layer
        m(x)
        m.eval()(x)


def test_a_second_apply_pqt_gives_its_layers_keys_of_their_own():
    import random
    once = Model(llama=True)
    g.apply_pqt(once, parts="od")
    rng = random.Random(0)                         # a first call's keys are as they always were
    assert [l.noise_state[0].item() for _, l in g.pqt_layers(once)] == [
        g._splitmix64(rng.getrandbits(62)) & (2 ** 63 - 1) for _ in range(4)]
    twice = Model(llama=True)
    g.apply_pqt(twice, parts="od")
    g.apply_pqt(twice, parts="q,k")
    keys = {n: l.noise_state[0].item() for n, l in g.pqt_layers(twice)}
    assert len(keys) == 8 and len(set(keys.values())) == 8
    assert all(keys[n] == l.noise_state[0].item() for n, l in g.pqt_layers(once))


def test_parts_take_hugging_face_names_and_the_error_shows_them():
    def hf():
        return nn.ModuleDict({"attn": nn.ModuleDict({k: nn.Linear(32, 32) for k in ("q_proj", "k_proj", "o_proj")}),
                              "mlp": nn.ModuleDict({"c_fc": Conv1D(64, 32), "c_proj": Conv1D(32, 64)})})
    assert g.apply_pqt(hf(), parts="q_proj,o_proj") == g.apply_pqt(hf(), parts="q,out") == ["attn.q_proj", "attn.o_proj"]
    assert g.apply_pqt(hf(), parts="c_fc,mlp.c_proj") == ["mlp.c_fc", "mlp.c_proj"]
    assert g.apply_pqt(gpt2_like(), parts="c_attn") == ["blocks.0.attn.qkv", "blocks.1.attn.qkv"]
    m = hf()
    with pytest.raises(ValueError, match=r"unknown part\(s\) \['c_proj'\].*o_proj=out.*attn.c_proj=out, mlp.c_proj=down"):
        g.apply_pqt(m, parts="q_proj,c_proj")
    assert untouched(m)


def test_a_shared_module_selected_at_its_second_name_stays_one_layer_at_both():
    s = nn.Module()
    s.l1 = nn.Linear(32, 32)
    s.l2 = s.l1
    assert len(g.apply_pqt(s, modules="l2")) == 1
    assert type(s.l2) is g.GaussWSLinear and s.l1 is s.l2


def test_common_head_names_are_left_alone_and_lm_head_true_adds_the_head_to_parts():
    m = nn.ModuleDict({"up": nn.Linear(32, 64), "head": nn.Linear(64, 50), "output": nn.Linear(64, 50),
                       "embed_out": nn.Linear(64, 50)})
    assert g.apply_pqt(m, parts="all") == ["up"]
    assert all(type(m[k]) is nn.Linear for k in ("head", "output", "embed_out"))
    m = gpt2_like()
    names = g.apply_pqt(m, parts="all", lm_head=True)
    assert "lm_head" in names and len(names) == 9 and type(m.lm_head) is g.GaussWSLinear
    # module order (the head after the blocks), so the head takes no other layer's seed
    assert names == [n for n, mod in m.named_modules() if isinstance(mod, g.GaussWSLinear)]
    other = gpt2_like()
    g.apply_pqt(other, parts="all")
    assert all(torch.equal(dict(m.named_buffers())[k], v) for k, v in other.named_buffers() if k.endswith("noise_state"))
    m = gpt2_like()
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match=f"lm_head={bad!r} must be True or False"):
            g.apply_pqt(m, lm_head=bad)
    assert untouched(m)


class _MyLinear(nn.Linear):
    pass


def test_modules_filter_errors_name_the_module_the_value_and_the_glob():
    m = gpt2_like()
    with pytest.raises(TypeError, match=r"returned None \(NoneType\) for module 'blocks.0.attn.qkv'"):
        g.apply_pqt(m, modules=lambda n, mod: None)
    with pytest.raises(ValueError, match=r"raised KeyError on module 'blocks.0.attn.qkv'") as e:
        g.apply_pqt(m, modules=lambda n, mod: {}[n])
    assert isinstance(e.value.__cause__, KeyError)
    with pytest.raises(ValueError, match=r"'nope\.\*' matches no linear; the model's linears: 'blocks.0.attn.qkv'"):
        g.apply_pqt(m, modules=["blocks.0.*", "nope.*"])
    assert untouched(m)
    # what is there when nothing is found: linears without part names, nn.Linear subclasses
    seq = nn.Sequential(nn.Linear(8, 8), _MyLinear(8, 8))
    with pytest.raises(ValueError, match=r"the parts it has: none; linears without a part name: '0'; not replaced, "
                                         r"being nn.Linear subclasses.*: '1' \(_MyLinear\)"):
        g.apply_pqt(seq, parts="all")
    with pytest.raises(ValueError, match=r"the model's linears: none; not replaced.*'1' \(_MyLinear\)"):
        g.apply_pqt(nn.Sequential(nn.ReLU(), _MyLinear(8, 8)), modules="*")


def test_an_optimizer_built_before_apply_pqt_gets_a_warning_naming_the_layers():
    """It steps the weights but holds no b_i, so the bitwidths would never train: its second step
    (the first lets the loop's other optimizers show they hold the b_i) warns once, naming the
    layers (quoted: a layer may be named "0"); one built after does not."""
    x = torch.randint(0, 256, (2, 16))
    model = GPT(preset_config("nano", vocab_size=256))
    early = torch.optim.AdamW(model.parameters())
    g.apply_pqt(model)
    model(x, x)[1].backward()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        early.step()
        early.step()
    assert len(seen) == 1 and "built before apply_pqt" in str(seen[0].message)
    assert "'blocks.0.attn.qkv'" in str(seen[0].message)
    seq = nn.Sequential(nn.Linear(64, 64))
    g.apply_pqt(seq, modules="0")
    late = A.AdamW4bit(list(model.parameters()) + list(seq.parameters()))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        late.step()
    assert not seen
    with pytest.raises(ValueError, match=r"already GaussWSLinear: '0'"):
        g.apply_pqt(seq, modules="0")


def _train_steps(model, *opts, n=2):
    """n training steps of a nano GPT, each stepping every optimizer; the warnings they raised."""
    x = torch.randint(0, 256, (2, 16))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(n):
            model(x, x)[1].backward()
            for opt in opts:
                opt.step()
                opt.zero_grad()
    return [w for w in seen if "b_i" in str(w.message)]


def test_apply_pqt_again_after_remove_pqt_trains_a_second_phase():
    """Issue 46.1: apply_pqt -> remove_pqt -> apply_pqt on one model (a second training phase, a
    sweep over b_target) works; the optimizer of the first phase, which holds the weights but not
    the new b_i, is warned about in the second; one built after the second apply_pqt is not."""
    model = GPT(preset_config("nano", vocab_size=256))
    g.apply_pqt(model, b_target=4)
    first = torch.optim.AdamW(model.parameters())
    assert not _train_steps(model, first)
    g.remove_pqt(model, cast="tiers")
    names = g.apply_pqt(model, b_init=4, b_target=3)
    assert names and all(isinstance(m, g.GaussWSLinear) for _, m in g.pqt_layers(model))
    seen = _train_steps(model, first)
    assert len(seen) == 1 and "built before apply_pqt" in str(seen[0].message)
    assert "'blocks.0.attn.qkv'" in str(seen[0].message)
    second = torch.optim.AdamW(model.parameters())
    assert not _train_steps(model, second)
    g.remove_pqt(model)
    g.apply_pqt(model, modules="blocks.0.*")       # and a third time
    assert not _train_steps(model, torch.optim.AdamW(model.parameters()))


def test_no_warning_when_a_second_optimizer_steps_the_b_i():
    """Issue 52.7: the weights in an optimizer built before apply_pqt and the b_i in one built
    after (both step every iteration): the bitwidths train, so no warning; with the weights'
    optimizer alone, one."""
    model = GPT(preset_config("nano", vocab_size=256))
    weights = torch.optim.AdamW(model.parameters())
    g.apply_pqt(model)
    bits = torch.optim.SGD([m.b_i for _, m in g.pqt_layers(model)], lr=1e-2)
    assert not _train_steps(model, weights, bits, n=3)
    model = GPT(preset_config("nano", vocab_size=256))
    weights = torch.optim.AdamW(model.parameters())
    g.apply_pqt(model)
    assert len(_train_steps(model, weights, n=3)) == 1


def test_the_optimizer_check_goes_with_the_model():
    """apply_pqt's optimizer check is no process-wide hook that lives forever: its hook goes when
    the model is collected (and at remove_pqt)."""
    from torch.optim.optimizer import _global_optimizer_pre_hooks
    gc.collect()
    before = set(_global_optimizer_pre_hooks)
    model = nn.Sequential(nn.Linear(64, 64))
    g.apply_pqt(model, modules="0")
    added = set(_global_optimizer_pre_hooks) - before
    assert len(added) == 1
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    del model
    gc.collect()
    assert not added & set(_global_optimizer_pre_hooks)
    model = nn.Sequential(nn.Linear(64, 64))
    before = set(_global_optimizer_pre_hooks)
    g.apply_pqt(model, modules="0")
    added = set(_global_optimizer_pre_hooks) - before
    g.remove_pqt(model)
    assert len(added) == 1 and not added & set(_global_optimizer_pre_hooks)
