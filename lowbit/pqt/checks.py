"""Argument checks of the GaussWS API (gaussws.py), the safe range [B_MIN, B_MAX] of the bitwidths,
and the seed argument's conversion to an int64 tensor [key, counter]. Each check raises TypeError /
ValueError with a message naming the argument; none of them touches a weight's values (that would
wait for the GPU).
"""
import numbers
import os
import warnings

import torch
import torch.nn as nn

from lowbit.pqt.tiles import tile_grid

METHODS = ("gaussws", "diffq")
GEN_METHODS = ("gaussws", "diffq", "bm")
IMPLS = ("auto", "torch", "triton")
MEMORY_MODES = ("save", "recompute")
W_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # weight dtypes the kernels read

# Safe range of b_t. Sampling uses clamp(b_t, B_MIN, B_MAX); eq. 11 is exact inside the range and
# b_init, b_target must lie in it. Below 1 bit the PQN step max_32|w|·2^(1−b_t) exceeds the tile
# max (the noise swamps the weight), and far below it 2^(1−b_t) overflows to inf and 0·inf gives
# NaN. Above 24 bits the step is below one float32 ulp of the tile max, far past any format of
# Table C (FP16 e5m10 holds b_t <= 12) and of BF16 (§3.3: b_t < 9): more bits change nothing.
# A clamped tile gets no ∂L/∂b_t (clamp's gradient is 0 outside the range, 1 inside and at the
# ends), so the loss cannot push it further out; weight decay on b_i and `bitwidth_penalty`
# (which see the unclamped eq. 11 value) still pull it back toward b_target, inside the range.
B_MIN, B_MAX = 1.0, 24.0


def check_choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed: {', '.join(map(repr, allowed))}")


def check_dtype(dtype, name):
    if dtype not in W_DTYPES:
        raise TypeError(f"{name} has dtype {dtype}; allowed: float32, bfloat16, float16")


def check_weight(w, name="w"):
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"{name} must be 2-D (out_features, in_features), got shape {tuple(w.shape)}")
    if w.numel() == 0:
        raise ValueError(f"{name} has shape {tuple(w.shape)}: it must have at least one element")
    check_dtype(w.dtype, name)
    if w.numel() >= 2 ** 31:
        raise ValueError(f"{name} has {w.numel()} elements; at most 2**31 - 1 are supported")


def check_out_dtype(out_dtype):
    if out_dtype not in W_DTYPES:
        raise TypeError(f"out_dtype={out_dtype!r}; allowed: torch.float32, torch.bfloat16, torch.float16")


def check_tiles(t, w, name):
    want = tile_grid(*w.shape)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {want}, got {type(t).__name__}")
    if tuple(t.shape) != want:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; for a weight of shape {tuple(w.shape)} "
                         f"it must be the 32x32 tile grid {want}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype {t.dtype}")
    if t.device != w.device:
        raise ValueError(f"{name} is on {t.device} and the weight on {w.device}: they must be on the same device")


def check_bits(b_init, b_target):
    """b_init, b_target: numbers (not bool) in [B_MIN, B_MAX] with b_target <= b_init (eq. 11:
    b_t starts at b_init, b_i = 1, and weight decay on b_i moves it to b_target). Equal values are
    allowed: b_t = b_target for every b_i (fixed-bitwidth PQT, b_i gets zero gradient)."""
    for name, v in (("b_init", b_init), ("b_target", b_target)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not B_MIN <= v <= B_MAX:
            raise ValueError(f"{name}={v!r} must be a number of bits in [{B_MIN:g}, {B_MAX:g}]")
    if b_target > b_init:
        raise ValueError(f"b_target={b_target!r} > b_init={b_init!r}: need b_target <= b_init (eq. 11: "
                         "b_t = b_target + b_i·(b_init − b_target) starts at b_init, decays to b_target)")


def check_fused(fused, fn=""):
    if not isinstance(fused, bool):
        raise TypeError(f"{fn + ': ' if fn else ''}fused={fused!r} must be True or False")


def check_seed(seed, also=""):
    """The one seed rule of every API: an int (not bool) in [0, 2**63) (an int64 Philox key)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int in [0, 2**63){also}, got {type(seed).__name__} {seed!r}")
    if not 0 <= seed < 2 ** 63:
        raise ValueError(f"seed={seed} must be an int in [0, 2**63)")
    return seed


_SEED_CACHE = {}        # (device, seed) -> int64 tensor [seed, 0] on that device
_SEED_CACHE_SIZE = 256


def seed_tensor(seed, device):
    """int seed s -> int64 tensor [s, 0] (key s, call counter 0); an int64 tensor [key, counter]
    passes through (moved to `device`). On a GPU the int's tensor is made by two fill kernels (the
    value travels as a kernel argument) and cached: torch.tensor([s, 0], device=...) would be a
    blocking host-to-device copy at every call. Not cached while a CUDA graph is being captured
    (the tensor would live in the graph's memory pool)."""
    if not isinstance(seed, torch.Tensor):
        check_seed(seed, also=" or an int64 tensor [key, counter]")
        device = torch.device(device)
        if device.type == "cpu" or torch.compiler.is_compiling():   # compiled: a graph constant
            return torch.tensor([seed, 0], dtype=torch.int64, device=device)
        t = _SEED_CACHE.get((device, seed))
        if t is None:
            t = torch.zeros(2, dtype=torch.int64, device=device)
            t[:1].fill_(seed)
            capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            if not capturing:
                if len(_SEED_CACHE) >= _SEED_CACHE_SIZE:
                    _SEED_CACHE.pop(next(iter(_SEED_CACHE)))        # the oldest entry
                _SEED_CACHE[(device, seed)] = t
        return t
    if seed.dtype != torch.int64 or tuple(seed.shape) != (2,):
        raise ValueError(f"seed tensor must be int64 of shape (2,) = [key, counter], "
                         f"got dtype {seed.dtype} shape {tuple(seed.shape)}")
    if seed.is_meta and torch.device(device).type != "meta":
        raise ValueError(f"seed tensor is on the meta device (no values) and the weight on {device}; "
                         "pass an int or a real int64 tensor [key, counter]")
    return seed.to(device)


def resolve_impl(impl, t):
    check_choice("impl", impl, IMPLS)
    if impl == "auto":
        return "triton" if t.is_cuda else "torch"
    if impl == "triton" and t.device.type not in ("cuda", "cpu"):   # meta: Triton reads the data
        raise ValueError(f"impl='triton' needs CUDA tensors (or CPU ones under TRITON_INTERPRET=1), got "
                         f"device {t.device.type}; use impl='torch' or 'auto'")
    if impl == "triton" and not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("impl='triton' on CPU tensors needs the Triton interpreter "
                           "(set TRITON_INTERPRET=1 before importing triton); use impl='torch' on CPU")
    return impl


def check_module(model, fn):
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: model must be a torch.nn.Module, got {type(model).__name__}")


def check_sample_args(w, b_t, method, impl, fused, name="b_t"):
    check_choice("method", method, METHODS)
    check_fused(fused)
    check_weight(w)
    check_tiles(b_t, w, name)
    return resolve_impl(impl, w)


def check_input(x, w, bias):
    """x (..., n) and bias (m,) or None for a weight w (m, n): floating tensors on w's device."""
    for name, t in (("x", x), ("bias", bias)):
        if name == "bias" and t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor{' or None' if name == 'bias' else ''}, "
                            f"got {type(t).__name__}")
        check_dtype(t.dtype, name)
        if t.device != w.device:
            raise ValueError(f"{name} is on {t.device} and the weight on {w.device}: they must be on the same device")
    if x.dim() == 0 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x has shape {tuple(x.shape)}; w {tuple(w.shape)} needs (..., {w.shape[1]})")
    if bias is not None and tuple(bias.shape) != (w.shape[0],):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; w {tuple(w.shape)} needs ({w.shape[0]},)")


def check_shape(shape):
    """`generate_noise`'s shape: (m, n), two ints >= 1, m·n < 2**31. Returns (m, n) as ints."""
    if (not isinstance(shape, (tuple, list, torch.Size)) or len(shape) != 2
            or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1 for v in shape)):
        raise ValueError(f"shape must be (m, n), two ints >= 1, got {shape!r}")
    m, n = int(shape[0]), int(shape[1])
    if m * n >= 2 ** 31:
        raise ValueError(f"shape {shape} has {m * n} elements; at most 2**31 - 1 are supported")
    return m, n


def check_noise(noise, w, method):
    """`apply_noise`'s noise for a weight w (m, n): int32 (m, ceil(n/8)) for "gaussws", floating
    (m, n) for "diffq", on w's device."""
    m, n = w.shape
    want = (m, -(-n // 8)) if method == "gaussws" else (m, n)
    if not isinstance(noise, torch.Tensor):
        raise TypeError(f"noise must be a torch.Tensor from generate_noise, got {type(noise).__name__}")
    if tuple(noise.shape) != want:
        raise ValueError(f"noise has shape {tuple(noise.shape)}; method={method!r} and w {tuple(w.shape)} need {want}")
    if not (noise.dtype == torch.int32 if method == "gaussws" else noise.is_floating_point()):
        need = "int32 (packed, from generate_noise)" if method == "gaussws" else "floating (BF16 from generate_noise)"
        raise TypeError(f"noise has dtype {noise.dtype}; method={method!r} needs {need}")
    if noise.device != w.device:
        raise ValueError(f"noise is on {noise.device} and w on {w.device}: they must be on the same device")


def check_layer_args(in_features, out_features, method, memory, impl, fused, dtype):
    """GaussWSLinear's constructor arguments (b_init, b_target and seed have their own checks)."""
    check_choice("method", method, METHODS)
    check_choice("memory", memory, MEMORY_MODES)
    check_choice("impl", impl, IMPLS)
    check_fused(fused, "GaussWSLinear")
    for name, v in (("in_features", in_features), ("out_features", out_features)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1 (an empty weight has no tiles to sample)")
    check_dtype(dtype if dtype is not None else torch.get_default_dtype(), "GaussWSLinear weight")


def check_layer_dtypes(layer, w):
    """A layer's weight w and b_i at a training forward: TypeError if w was cast to a dtype the
    kernels do not read; a warning (once per layer) if b_i was cast to 16 bits."""
    if w.dtype not in W_DTYPES:
        raise TypeError(f"GaussWSLinear {layer._name}: its weight is {w.dtype} (the model was cast after "
                        "apply_pqt or construction?); allowed: float32, bfloat16, float16")
    if layer.b_i.dtype in (torch.bfloat16, torch.float16) and not layer._warned_b_i:
        layer._warned_b_i = True
        warnings.warn(f"GaussWSLinear {layer._name}: b_i is {layer.b_i.dtype} (the model was cast "
                      "after apply_pqt); optimizer steps of ~1e-3 round away near 1.0 in it, so "
                      "b_t will not learn: keep b_i float32 (cast the model before apply_pqt, or "
                      "set layer.b_i.data = layer.b_i.data.float())", stacklevel=3)
