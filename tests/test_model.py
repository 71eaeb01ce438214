"""model.py: both model kinds' parts and shapes, the papers' sizes, causality, activation
checkpointing, meta-device init."""
import copy
import itertools
import math

import pytest
import torch

import gaussws as g
from model import GPT, preset_config


@pytest.mark.parametrize("method", ["bf16", "gaussws", "diffq"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_activation_checkpointing_gives_the_same_gradients_bit_for_bit(preset, method):
    torch.manual_seed(0)
    plain = GPT(preset_config(preset, vocab_size=256, dropout=0.0))
    if method != "bf16":
        g.apply_pqt(plain, method=method, parts="all", seed=3)
    ck = copy.deepcopy(plain)
    ck.checkpoint_blocks = True
    x = torch.randint(0, 256, (2, 32))
    for _ in range(2):                                   # two steps: the noise counters advance alike
        for m in (plain, ck):
            m.zero_grad()
            m(x, x)[1].backward()
        for (n, a), b in zip(plain.named_parameters(), ck.parameters()):
            assert torch.equal(a.grad, b.grad), n
    assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), ck.buffers()))
    with torch.no_grad():                                # no recomputation outside training
        assert torch.equal(plain(x, x)[1], ck(x, x)[1])
    saved = {}
    for m in (plain, ck):                                # and ck keeps fewer activations for backward
        n = [0]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: n.__setitem__(0, n[0] + 1) or t, lambda t: t):
            m(x, x)
        saved[m is ck] = n[0]
    assert saved[True] < saved[False] / 2, saved


@pytest.mark.parametrize("preset", ["nano", "nano-llama"])
def test_model_parts_names_and_shapes(preset):
    cfg = preset_config(preset, vocab_size=256)
    model = GPT(cfg)
    block = model.blocks[0]
    expected = ["qkv", "out", "up", "down"] if preset == "nano" else ["q", "k", "v", "out", "gate", "up", "down"]
    assert cfg.parts == expected
    for part in expected:
        owner = block.attn if part in ("q", "k", "v", "qkv", "out") else block.mlp
        assert isinstance(getattr(owner, part), torch.nn.Linear)
    if preset == "nano-llama":  # GQA: k/v project to n_kv_head heads
        assert block.attn.k.out_features == cfg.n_kv_head * cfg.n_embd // cfg.n_head
        assert model.lm_head.weight is not model.wte.weight
    else:
        assert model.lm_head.weight is model.wte.weight
    logits, loss = model(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))
    assert logits.shape == (2, 16, 256)
    # at init the model is close to uniform over the vocabulary: loss ~ ln(256) = 5.545
    assert abs(loss.item() - math.log(256)) < 0.1


def test_paper_sizes():
    # the papers' model sizes (Llama2-134M, GPT-style 162M, GPT-2 124M), counted with their vocabularies
    def count(name, vocab):
        with torch.device("meta"):
            return GPT(preset_config(name, vocab_size=vocab)).num_params()
    assert round(count("llama-134m", 32000) / 1e6) == 134
    assert round(count("gpt-162m", 50304) / 1e6) == 162
    assert round(count("gpt2-124m", 50304) / 1e6) == 124


def test_causal_rope_model():
    # the output at position t must not depend on tokens after t
    torch.manual_seed(0)
    model = GPT(preset_config("nano-llama", vocab_size=256)).eval()
    x = torch.randint(0, 256, (1, 20))
    x2 = x.clone()
    x2[0, 10:] = (x2[0, 10:] + 1) % 256
    a, _ = model(x, x)
    b, _ = model(x2, x2)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-5)
    assert not torch.allclose(a[0, 10:], b[0, 10:], atol=1e-3)


@pytest.mark.parametrize("pqt", [False, True])
@pytest.mark.parametrize("preset", ["nano", "nano-llama"])
def test_meta_init_to_empty_load_state_dict_is_exact(preset, pqt):
    """GPT (and apply_pqt) on the meta device, to_empty, load_state_dict: bit for bit the normally
    built model (RoPE tables recomputed, the tied LM head tied again): the same logits, loss and
    gradients in training mode, where PQT draws its noise from the loaded counters."""
    cfg = preset_config(preset, vocab_size=256)
    torch.manual_seed(0)
    ref = GPT(cfg)
    if pqt:
        g.apply_pqt(ref, seed=3)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    ref(x, y)[1].backward()                      # counters past 0: they come from the state dict
    ref.zero_grad()
    with torch.device("meta"):
        meta = GPT(cfg)
        if pqt:
            g.apply_pqt(meta, seed=3)
    meta.to_empty(device="cpu")
    meta.load_state_dict(ref.state_dict())
    out = []
    for model in (ref, meta):
        logits, loss = model(x, y)
        loss.backward()
        out.append((logits, loss, {n: p.grad for n, p in model.named_parameters()}))
    (la, lossa, ga), (lb, lossb, gb) = out
    assert torch.isfinite(lossa) and torch.equal(lossa, lossb) and torch.equal(la, lb)
    assert ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga)


@pytest.mark.parametrize("preset", ["nano", "nano-llama"])
def test_reset_parameters_after_meta_init_is_construction(preset):
    """Without a state dict: meta init, to_empty, reset_parameters() gives GPT(cfg) of the same
    torch seed, parameters and buffers; init_buffers() alone restores the RoPE tables."""
    cfg = preset_config(preset, vocab_size=256)
    torch.manual_seed(1)
    ref = GPT(cfg)
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    model.reset_parameters()
    for (n, a), (_, b) in zip(itertools.chain(ref.named_parameters(), ref.named_buffers()),
                              itertools.chain(model.named_parameters(), model.named_buffers())):
        assert torch.equal(a, b), n
    for buf in model.buffers():
        buf.zero_()
    model.init_buffers()
    assert all(torch.equal(a, b) for a, b in zip(ref.buffers(), model.buffers()))
