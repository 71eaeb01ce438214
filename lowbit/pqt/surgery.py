"""Model surgery for paper A, the machinery of gaussws.py's `apply_pqt` and `remove_pqt`:
`replace_linears` puts GaussWS layers in place of a model's linear layers ("method[part]" of the
paper's experiments; this repository's GPT and Hugging Face models), `restore_linears` puts plain
ones back (optionally cast to Table C formats), `Conv1DLayout` gives a layer Hugging Face GPT-2's
Conv1D layout, and `OptimizerCheck` warns about an optimizer that steps a layer's weight while no
optimizer steps its b_i. Changes the model's modules in place; the layer classes come in as
arguments (gaussws.py's GaussWSLinear, GaussWSConv1D), the sampling itself is theirs.
"""
import fnmatch
import random
import re
import warnings
import weakref

import torch
import torch.nn as nn

from lowbit.pqt.checks import (IMPLS, MEMORY_MODES, METHODS, check_bits, check_choice, check_dtype, check_fused,
                               check_module, check_seed)
from lowbit.pqt.export import cast_fp, cast_tiles, cast_to_tiers

GPT2_PARTS = ("qkv", "out", "up", "down")
LLAMA_PARTS = ("q", "k", "v", "out", "gate", "up", "down")
ALL_PARTS = tuple(dict.fromkeys(GPT2_PARTS + LLAMA_PARTS))


class Conv1DLayout:
    """Mixin before GaussWSLinear (gaussws.GaussWSConv1D): the layer in the layout of Hugging Face's
    GPT-2 `Conv1D` (y = x @ weight + bias, weight of shape (in, out), the transpose of nn.Linear's);
    `apply_pqt` puts it in place of a Conv1D.

    It keeps Conv1D's weight Parameter as it is, so the state dict keeps Conv1D's keys and shapes
    (a Hugging Face checkpoint loads into it and `remove_pqt` gives the Conv1D back), and samples
    weight.t(), the (out, in) weight of the equivalent nn.Linear, with that linear's 32x32 tiles:
    b_i has shape (ceil(out/32), ceil(in/32)) as in GaussWSLinear(in, out). Square tiles anchored
    at (0, 0) are the same tiles in both layouts, so every tile holds the same weights; only the
    order in which R is drawn over them differs. Arguments and errors as GaussWSLinear; made
    directly, its weight is initialised as Conv1D does (N(0, 0.02²), bias 0).
    """

    def __init__(self, in_features, out_features, *args, **kwargs):
        super().__init__(in_features, out_features, *args, **kwargs)
        self.weight = nn.Parameter(self.weight.new_empty(in_features, out_features))
        self.reset_parameters()

    def reset_parameters(self):
        """As GaussWSLinear's (b_i = 1, noise_state = [key, 0]), with Conv1D's weight and bias."""
        super().reset_parameters()
        with torch.no_grad():
            nn.init.normal_(self.weight, std=0.02)
            if self.bias is not None:
                self.bias.zero_()

    def linear_weight(self):
        return self.weight.t()    # the (out, in) view; pqt_linear copies it to a contiguous w

    def extra_repr(self):
        return super().extra_repr() + ", Conv1D layout (weight is (in, out))"


# ==============================================================================================
# apply_pqt: where PQT is applied ("method[part]" of paper A's experiments)

# Hugging Face names of the papers' parts: Llama-style models (Llama, Mistral, Qwen, ...) and GPT-2
# (Conv1D layers; c_proj is the attention's out projection or the MLP's down projection)
HF_PARTS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "out", "gate_proj": "gate",
            "up_proj": "up", "down_proj": "down", "c_attn": "qkv", "c_fc": "up",
            "attn.c_proj": "out", "mlp.c_proj": "down"}


def parse_parts(parts):
    """-> list of part names; "all" -> ALL_PARTS (every part this model kind has), "od" -> out, down;
    a Hugging Face name (HF_PARTS) stands for its part."""
    if not isinstance(parts, str):
        raise TypeError(f"parts must be a string, got {type(parts).__name__}")
    if parts == "all":
        return list(ALL_PARTS)
    if parts == "od":
        return ["out", "down"]
    given = [p.strip() for p in parts.split(",") if p.strip()]
    bad = [p for p in given if p not in ALL_PARTS and p not in HF_PARTS]
    if not given or bad:
        aliases = ", ".join(f"{k}={v}" for k, v in HF_PARTS.items())
        raise ValueError(f"parts={parts!r}: unknown part(s) {bad or [parts]}; allowed: 'all', 'od' "
                         f"or a comma list of {', '.join(ALL_PARTS)} or their Hugging Face names "
                         f"({aliases})")
    return list(dict.fromkeys(HF_PARTS.get(p, p) for p in given))


def _part_of(name):
    """The paper's part name of a module called `name` (its own name here, its Hugging Face name
    mapped by HF_PARTS), else None."""
    path = name.split(".")
    if path[-1] in ALL_PARTS:
        return path[-1]
    return HF_PARTS.get(path[-1]) or HF_PARTS.get(".".join(path[-2:]))


def _is_conv1d(m):
    # Hugging Face's transformers.pytorch_utils.Conv1D, recognised without importing transformers
    return (type(m).__name__ == "Conv1D" and hasattr(m, "nf") and hasattr(m, "nx")
            and isinstance(getattr(m, "weight", None), nn.Parameter)
            and tuple(m.weight.shape) == (m.nx, m.nf))


def _linears(model):
    """(name, parent, attribute, module) of every nn.Linear (exactly: subclasses may not call their
    own forward, e.g. nn.MultiheadAttention's out_proj) and Conv1D in `model`, each place a module
    sits (a module shared by two parents is listed under both names), in module order (depth
    first, as named_modules lists them)."""
    found = []
    for name, child in model.named_modules(remove_duplicate=False):
        if name and (type(child) is nn.Linear or _is_conv1d(child)):
            pname, _, cname = name.rpartition(".")
            found.append((name, model.get_submodule(pname) if pname else model, cname, child))
    return found


# last names of a module that apply_pqt takes for an LM head: nanoGPT / Hugging Face, minGPT-style
# `head`, Meta's Llama `output`, GPT-NeoX `embed_out`
HEAD_NAMES = ("lm_head", "head", "output", "embed_out")


def _lm_head_ids(model):
    """ids of the modules apply_pqt treats as the LM head: a linear whose weight is an nn.Embedding's
    weight (tied, e.g. Hugging Face tie_word_embeddings), the module of Hugging Face's
    get_output_embeddings(), and any linear whose last name is in HEAD_NAMES."""
    emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    ids = {id(child) for name, _, _, child in _linears(model)
           if id(child.weight) in emb or name.rsplit(".", 1)[-1] in HEAD_NAMES}
    out = getattr(model, "get_output_embeddings", None)
    head = out() if callable(out) else None
    if isinstance(head, nn.Module):
        ids.add(id(head))
    return ids


def _module_filter(modules):
    """modules (a glob, a list of globs, or a callable (name, module) -> bool) -> (the callable,
    the globs or None). The callable's errors name the module it was asked about."""
    if callable(modules):
        def keep(name, module):
            try:
                r = modules(name, module)
            except Exception as err:
                raise ValueError(f"apply_pqt: modules={modules!r} raised {type(err).__name__} on "
                                 f"module {name!r}: {err}") from err
            if not isinstance(r, bool):
                raise TypeError(f"apply_pqt: modules={modules!r} returned {r!r} "
                                f"({type(r).__name__}) for module {name!r}; it must return True or False")
            return r
        return keep, None
    globs = [modules] if isinstance(modules, str) else modules
    if not (isinstance(globs, (list, tuple)) and globs and all(isinstance(p, str) and p for p in globs)):
        raise TypeError(f"modules={modules!r}: allowed: a glob on module names (e.g. "
                        "'model.layers.*.mlp.*'), a non-empty list of globs, or a callable "
                        "(name, module) -> bool")
    return (lambda name, _: any(fnmatch.fnmatchcase(name, p) for p in globs)), list(globs)


def _few(names, k=8, quote=True):
    # names quoted: a layer named "0" must not read as a count
    shown = [repr(n) if quote else n for n in names[:k]]
    return ", ".join(shown) + (f", ... ({len(names)} in all)" if len(names) > k else "") or "none"


def replace_linears(model, layer_types, method, parts, b_init, b_target, seed, memory, impl, fused, modules,
                    lm_head):
    """`gaussws.apply_pqt` (arguments, result and errors are documented there) with its layer classes
    handed in: layer_types = (the GaussWS linear class, its Conv1D-layout subclass)."""
    linear_cls, conv1d_cls = layer_types
    check_module(model, "apply_pqt")
    if isinstance(model, nn.Linear) or _is_conv1d(model):
        raise ValueError(f"apply_pqt: the model is itself a linear layer ({type(model).__name__}); apply_pqt "
                         "replaces the layers inside a model: wrap it and name it (apply_pqt(nn.Sequential(layer), "
                         "modules='*')) or build a GaussWSLinear")
    sharded = [n for n, m in model.named_modules()
               if any(c.__name__ == "FSDPModule" for c in type(m).__mro__)]
    if sharded:   # fully_shard made their parameters DTensors and their classes FSDP subclasses
        what = "the model" if "" in sharded else _few(sharded)
        raise ValueError(f"apply_pqt: {what} already went through fully_shard; call apply_pqt "
                         "first, then fully_shard (FSDP2 then gathers w and b_i for each layer's forward)")
    check_choice("method", method, METHODS)
    check_choice("memory", memory, MEMORY_MODES)
    check_choice("impl", impl, IMPLS)
    check_fused(fused, "apply_pqt")
    check_bits(b_init, b_target)
    check_seed(seed)
    if parts is not None and modules is not None:
        raise ValueError(f"apply_pqt: give parts={parts!r} or modules={modules!r}, not both")
    if not isinstance(lm_head, bool):
        raise TypeError(f"apply_pqt: lm_head={lm_head!r} must be True or False")
    heads = _lm_head_ids(model)
    cands = [c for c in _linears(model) if lm_head or id(c[3]) not in heads]
    done = [n for n, _ in _layers_of(model, linear_cls)]
    already = f" (already GaussWSLinear: {_few(done)})" if done else ""
    # nn.Linear subclasses are not replaced (their forward may not be nn.Linear's): say so when
    # they are all a filter could have found
    subs = [f"{n!r} ({type(m).__name__})" for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and type(m) is not nn.Linear and not isinstance(m, linear_cls)]
    subs = (f"; not replaced, being nn.Linear subclasses whose forward may differ: {_few(subs, quote=False)}"
            if subs else "")
    if modules is None:
        parts = "all" if parts is None else parts
        wanted = parse_parts(parts)
        have = list(dict.fromkeys(p for p in map(_part_of, (c[0] for c in cands)) if p))
        missing = [p for p in wanted if p not in have] if parts != "all" else ([] if have else wanted)
        if missing:
            other = [c[0] for c in cands if not _part_of(c[0])]
            raise ValueError(f"apply_pqt(parts={parts!r}): no nn.Linear named {', '.join(missing)} "
                             f"inside the model; the parts it has: {', '.join(have) or 'none'}{already}"
                             + (f"; linears without a part name: {_few(other)}" if other else "") + subs
                             + ("" if have else "; select other layers by name with modules="))
        # lm_head=True adds the LM head, which has no part name, to the parts
        found = [c for c in cands if _part_of(c[0]) in wanted or (lm_head and id(c[3]) in heads)]
    else:
        keep, globs = _module_filter(modules)
        found = [c for c in cands if keep(c[0], c[3])]

        def head_note():      # only for an error: the filter is asked about the head only then
            skipped = [n for n, _, _, m in _linears(model) if id(m) in heads and not lm_head and keep(n, m)]
            return f" but the LM head {_few(skipped)} (lm_head=True samples it)" if skipped else ""
        if not found:
            raise ValueError(f"apply_pqt(modules={modules!r}) selects no nn.Linear (only nn.Linear and "
                             "Conv1D layers are sampled, never embeddings or norms)" + head_note()
                             + f"; the model's linears: {_few([c[0] for c in cands])}{already}{subs}")
        unmatched = [p for p in globs or () if not any(fnmatch.fnmatchcase(c[0], p) for c in cands)]
        if unmatched:
            raise ValueError(f"apply_pqt(modules={modules!r}): {', '.join(map(repr, unmatched))} "
                             f"matches no linear{head_note()}; the model's linears: "
                             f"{_few([c[0] for c in cands])}{already}{subs}")
        # a module selected at one of its places is replaced at all of them (one layer, shared)
        chosen = {id(c[3]) for c in found}
        found = [c for c in cands if id(c[3]) in chosen]
    for name, _, _, child in found:
        check_dtype(child.weight.dtype, f"{name}.weight")
    rng = random.Random(seed)
    # keys continue after the GaussWS layers already in the model (an earlier apply_pqt): a second
    # call must not give its layers the keys of the first call's
    for _ in {id(m) for _, m in _layers_of(model, linear_cls)}:
        rng.getrandbits(62)
    new, replaced = {}, []
    for name, parent, cname, child in found:
        if id(child) not in new:
            conv = _is_conv1d(child)
            n_in, n_out = (child.nx, child.nf) if conv else (child.in_features, child.out_features)
            layer = (conv1d_cls if conv else linear_cls)(
                n_in, n_out, bias=child.bias is not None, method=method, b_init=b_init,
                b_target=b_target, seed=rng.getrandbits(62), memory=memory, impl=impl, fused=fused,
                device=child.weight.device, dtype=child.weight.dtype)
            layer.weight = child.weight
            if child.bias is not None:
                layer.bias = child.bias
            layer.train(child.training)
            layer._name, layer.plain_type = name, type(child)
            new[id(child)] = layer
            replaced.append(name)
        setattr(parent, cname, new[id(child)])
    OptimizerCheck.watch(model, linear_cls)
    return replaced


def _layers_of(model, linear_cls):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, linear_cls)]


class OptimizerCheck:
    """An optimizer built before apply_pqt holds the weights but not the new b_i, which then never
    train. Each optimizer that steps is checked once: where it steps a layer's weight and no
    optimizer seen stepping holds the layer's b_i, the check waits for its next step (the other
    optimizers of the loop, one of which may hold the b_i, step in between) and then warns, naming
    the layers. One check per model (`watch`), a global optimizer step pre-hook that goes with the
    model or at `remove_pqt`; it looks parameters up by id and keeps no tensor and no model alive."""

    _of_model = weakref.WeakKeyDictionary()    # model -> its OptimizerCheck

    def __init__(self, model, linear_cls):
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        self.model, self.linear_cls = weakref.ref(model), linear_cls
        self.reset()
        self.handle = register_optimizer_step_pre_hook(self.check)
        weakref.finalize(model, self.handle.remove)

    @classmethod
    def watch(cls, model, linear_cls):
        """Checks the optimizers of `model` from now on: every one again, after an apply_pqt that
        made new b_i (a second training phase)."""
        if model in cls._of_model:
            cls._of_model[model].reset()
        else:
            cls._of_model[model] = cls(model, linear_cls)

    @classmethod
    def stop(cls, model):
        check = cls._of_model.pop(model, None)
        if check is not None:
            check.handle.remove()

    def reset(self):
        self.stepped = weakref.WeakSet()   # optimizers seen stepping
        self.waiting = weakref.WeakSet()   # ... that step a weight whose b_i none of them held
        self.done = weakref.WeakSet()      # ... checked

    def check(self, opt, args, kwargs):
        model = self.model()
        if model is None or opt in self.done:
            return
        self.stepped.add(opt)
        mine = {id(p) for g in opt.param_groups for p in g["params"]}
        held = {id(p) for o in self.stepped for g in o.param_groups for p in g["params"]}
        missing = [name for name, layer in _layers_of(model, self.linear_cls)
                   if id(layer.weight) in mine and id(layer.b_i) not in held]
        if missing and opt not in self.waiting:
            self.waiting.add(opt)
            return
        self.done.add(opt)
        if missing:
            warnings.warn(f"{type(opt).__name__} steps the weights of GaussWSLinear {_few(missing)} but no "
                          f"optimizer steps their b_i: it was built before apply_pqt, so the bitwidths never "
                          f"train. Build the optimizer after apply_pqt (or add the b_i parameters with "
                          f"add_param_group)", stacklevel=3)


# ==============================================================================================
# remove_pqt: back to plain layers

def format_of(cast):
    """remove_pqt's cast -> None, "tiers" or (exp_bits, man_bits); ValueError otherwise."""
    if cast is None or cast == "tiers":
        return cast
    m = re.fullmatch(r"e(\d)m(\d+)", cast) if isinstance(cast, str) else None
    if m is None:
        raise ValueError(f"cast={cast!r}: allowed: None (weights as they are), 'tiers' (each tile "
                         "to its Table C format) or an FP format 'e<exponent bits>m<mantissa bits>' "
                         "such as 'e3m4' or 'e2m3'")
    fmt = int(m.group(1)), int(m.group(2))
    try:
        cast_fp(torch.zeros(1), *fmt)      # the formats cast_fp (and so cast_tiles) takes
    except ValueError as e:
        raise ValueError(f"cast={cast!r}: {e}") from None
    return fmt


def _hf_conv1d():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        raise ImportError("remove_pqt: turning a GaussWSConv1D back into a Conv1D needs Hugging Face "
                          "transformers (pip install transformers)") from None
    return Conv1D


@torch.no_grad()
def restore_linears(model, cast, linear_cls):
    """`gaussws.remove_pqt` (arguments, result and errors are documented there) with the GaussWS
    linear class handed in."""
    check_module(model, "remove_pqt")
    fmt = format_of(cast)
    layers = _layers_of(model, linear_cls)
    if not layers or isinstance(model, linear_cls):
        raise ValueError(f"remove_pqt: model {type(model).__name__} has no GaussWSLinear layer"
                         + (" inside it (it is one: put it in a module)" if layers else ""))
    if fmt == "tiers":
        cast_to_tiers(layers)
    elif fmt is not None:
        for _, layer in layers:
            w = layer.linear_weight()
            w.copy_(cast_tiles(w, *fmt))
    plain, removed = {}, []
    for pname, parent in list(model.named_modules()):
        for cname, child in list(parent._modules.items()):
            if not isinstance(child, linear_cls):
                continue
            if id(child) not in plain:
                cls = getattr(child, "plain_type", None) or (_hf_conv1d() if isinstance(child, Conv1DLayout)
                                                             else nn.Linear)
                with torch.device("meta"):       # no weights allocated: the layer's own go in
                    p = (cls(child.out_features, child.in_features) if isinstance(child, Conv1DLayout)
                         else cls(child.in_features, child.out_features, bias=child.bias is not None))
                p.weight = child.weight
                p.bias = child.bias
                p.train(child.training)
                plain[id(child)] = p
                removed.append(f"{pname}.{cname}" if pname else cname)
            setattr(parent, cname, plain[id(child)])
    OptimizerCheck.stop(model)
    return removed
