"""
AdamW4bit's argument checks: the constructor's arguments, the quantizer configuration (a preset
of paper B Table 2 with its overrides), each param group's hyperparameters (when added, and again
whenever they change, so a bad value is a clear error before the step rather than a NaN weight
inside it) and their parameters' dtypes, and which path (kernel or reference) a tensor can take.
Raises only, and changes nothing: the codebooks come as an argument (get_codebook, from
codebooks.py), the optimizer keeps what a check returns.
"""
import math
import numbers
from collections.abc import Sequence

import numpy as np
import torch

from lowbit.optim.launch import BIAS_ROWS_MAX, KERNEL_DTYPES
from lowbit.optim.param_write import MASTER_WEIGHT_BITS, PARAM_ROUNDINGS

ROUNDINGS = ("rtn", "sr")
COORDS = ("state", "update")
V_ROUNDINGS = ("state-rtn", "state-sr", "update-rtn", "update-sr")
IMPLS = ("auto", "torch", "triton")


def check_block_size(block_size):
    if not isinstance(block_size, int) or block_size < 2 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 2, got {block_size!r}")


def check_quant_args(x, block_size, rule, coord, T, bias_correction2=1.0):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a real floating-point tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not 0 < bias_correction2 <= 1:
        raise ValueError(f"bias_correction2 = 1 - b2^t must be in (0, 1], got {bias_correction2}")
    check_block_size(block_size)
    if x.numel() % block_size:
        raise ValueError(f"x.numel()={x.numel()} must be a multiple of block_size={block_size}")
    if rule not in ROUNDINGS:
        raise ValueError(f"rule must be one of {ROUNDINGS}, got {rule!r}")
    if coord not in COORDS:
        raise ValueError(f"coord must be one of {COORDS}, got {coord!r}")
    if coord == "update" and T[0] < 0:
        raise ValueError("coord='update' (preconditioner space) needs a nonnegative codebook, "
                         f"got min level {T[0].item()}")


def check_dequant_args(packed, scales, block_size):
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError(f"packed must be a uint8 tensor, got {getattr(packed, 'dtype', type(packed).__name__)}")
    check_block_size(block_size)
    if packed.numel() * 2 != scales.numel() * block_size:
        raise ValueError(f"packed ({packed.numel()} bytes) and scales ({scales.numel()}) do not "
                         f"describe the same tensor with block_size={block_size}")


def check_init_args(presets, lr, betas, eps, weight_decay, preset, block_size, impl, seed, param_rounding,
                    master_weight_bits, capturable, kernel_uniforms, torch_keywords):
    """AdamW4bit.__init__'s checks of its arguments (presets: its PRESETS; torch_keywords: the
    values of torch.optim.AdamW's other keywords, check_torch_keywords)."""
    _check_hparams(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), "")
    if not isinstance(capturable, bool):
        raise TypeError(f"capturable must be a bool, got {capturable!r}")
    if not isinstance(kernel_uniforms, bool):
        raise TypeError(f"kernel_uniforms must be True or False, got {kernel_uniforms!r}")
    check_torch_keywords(torch_keywords)
    if not isinstance(param_rounding, str) or param_rounding not in PARAM_ROUNDINGS:
        raise ValueError(f"param_rounding must be one of {PARAM_ROUNDINGS}, got {param_rounding!r}")
    if master_weight_bits not in MASTER_WEIGHT_BITS or not isinstance(master_weight_bits, (int, type(None))) \
            or isinstance(master_weight_bits, bool):
        raise ValueError(f"master_weight_bits must be one of {MASTER_WEIGHT_BITS}, got "
                         f"{master_weight_bits!r}")
    if master_weight_bits == 24 and param_rounding == "sr":
        raise ValueError("master_weight_bits=24 keeps the rounding residual of a round-to-"
                         "nearest write: use param_rounding='rtn' with it, not 'sr'")
    if not isinstance(preset, str) or preset not in presets:
        raise ValueError(f"preset must be one of {sorted(presets)}, got {preset!r}")
    check_block_size(block_size)
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise TypeError(f"seed must be a nonnegative int, got {seed!r}")


# torch.optim.AdamW's keywords beside its hyperparameters (capturable apart): AdamW4bit takes each
# at torch's default values and implements maximize=True; why it refuses the other values
_TORCH_KEYWORDS = dict(
    amsgrad="AdamW4bit keeps no running maximum of the second moment",
    maximize=None,
    foreach="AdamW4bit's step is fused already (one Triton launch per group of tensors on CUDA)",
    fused="AdamW4bit's step is fused already (one Triton launch per group of tensors on CUDA)",
    differentiable="autograd does not run through the 4-bit step")


def check_torch_keywords(values):
    """torch.optim.AdamW's keywords (values: name -> value): each True or False, foreach and fused
    also None; a value AdamW4bit does not implement is a one-line error naming it."""
    for key, value in values.items():
        allowed = (None, False, True) if key in ("foreach", "fused") else (False, True)
        if not any(value is a for a in allowed):
            raise TypeError(f"{key}={value!r}: must be {', '.join(map(repr, allowed))}")
        if value and _TORCH_KEYWORDS[key]:
            raise ValueError(f"{key}={value!r} is not supported: {_TORCH_KEYWORDS[key]}; leave {key} at "
                             f"torch's default")


def _real(v):
    """v as a float if it is a real number (any type but bool: NumPy scalars and 0-d arrays too) or
    a one-element real tensor (its value; a device tensor's waits for the device), else None."""
    if torch.is_tensor(v):
        return v.item() if v.numel() == 1 and v.dtype != torch.bool and not v.is_complex() else None
    if isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype.kind in "fiu":
        return float(v)
    return float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else None


def _check_hparams(h, where):
    """ValueError/TypeError naming the hyperparameter, its value and the allowed range. Each may be
    a real number of any type but bool, or a one-element tensor."""
    lr, betas, eps, wd = h["lr"], h["betas"], h["eps"], h["weight_decay"]
    for name, v in (("lr", lr), ("eps", eps), ("weight_decay", wd)):
        if torch.is_tensor(v) and v.numel() != 1:
            raise ValueError(f"{where}{name} tensor must have one element, got shape {tuple(v.shape)}")
        if _real(v) is None:
            raise TypeError(f"{where}{name} must be a number, got {v!r}")
    lr, eps, wd = _real(lr), _real(eps), _real(wd)
    if not (0 <= lr < math.inf):
        raise ValueError(f"{where}lr must be finite and >= 0, got {lr}")
    if not (0 < eps < math.inf):
        raise ValueError(f"{where}eps must be finite and > 0, got {eps}")
    if not (0 <= wd < math.inf):
        raise ValueError(f"{where}weight_decay must be finite and >= 0, got {wd}")
    # any sequence of two (a list, an OmegaConf ListConfig, a NumPy array), as torch's
    if not (isinstance(betas, (Sequence, np.ndarray)) and not isinstance(betas, str) and len(betas) == 2
            and all(_real(b) is not None and 0.0 <= _real(b) < 1.0 for b in betas)):
        raise ValueError(f"{where}betas must be two numbers in [0, 1), got {betas!r}")


def _lr_on_device(lr):
    """A one-element lr tensor off the CPU: reading its value would wait for the device."""
    return torch.is_tensor(lr) and lr.device.type != "cpu" and lr.numel() == 1


def _key_of(v):
    # a hyperparameter in hparams_key: a tensor by its identity and, on the CPU, its value
    return (id(v), None if _lr_on_device(v) or v.numel() != 1 else v.item()) if torch.is_tensor(v) else v


def hparams_key(group):
    """What `_check_hparams`, `_check_math_keys` and the maximize check look at in a group,
    comparable without waiting for the device: a CPU tensor by its value (also changed in place), a
    device one by its identity."""
    betas = group["betas"]
    pair = isinstance(betas, (Sequence, np.ndarray)) and not isinstance(betas, str)
    return (_key_of(group["lr"]), tuple(map(_key_of, betas)) if pair else betas,
            _key_of(group["eps"]), _key_of(group["weight_decay"]), group.get("maximize"),
            tuple(group.get(k) for k in _MATH_KEYS))


# Keys of torch's Adam / AdamW groups whose values change the update, and the value AdamW4bit
# implements. A group taken from a torch optimizer (AdamW4bit(torch_opt.param_groups)) carries
# them; ignoring another value would silently train something else (other unknown keys are
# ignored, as torch does).
_MATH_KEYS = dict(amsgrad=False, differentiable=False, decoupled_weight_decay=True)


def _check_math_keys(group, where):
    for key, ours in _MATH_KEYS.items():
        if key not in group or group[key] == ours:
            continue
        if key == "decoupled_weight_decay" and group["weight_decay"] == 0:
            continue   # no decay: L2 and decoupled are the same update
        raise ValueError(f"{where}{key}={group[key]!r} is not supported: AdamW4bit implements {key}={ours}"
                         + (" (AdamW's decoupled weight decay, not Adam's L2 penalty)"
                            if key == "decoupled_weight_decay" else "")
                         + f"; remove the key or set it to {ours}")


def quantizer_config(presets, get_codebook, preset, block_size, m_codebook, m_rounding, v_codebook,
                     v_rounding, eden, lm_head_sr_after):
    """The preset's components with the given overrides (None keeps the preset's; for
    lm_head_sr_after the marker "preset" does), checked: AdamW4bit.qcfg. get_codebook: a
    codebook's levels from its name or tensor (ValueError/TypeError for a bad one)."""
    if eden is not None and not isinstance(eden, bool):
        raise TypeError(f"eden must be True, False or None (the preset's), got {eden!r}")
    cfg = dict(presets[preset])
    for k, v in dict(m_codebook=m_codebook, m_rounding=m_rounding, v_codebook=v_codebook,
                     v_rounding=v_rounding, eden=eden).items():
        if v is not None:
            cfg[k] = v
    if lm_head_sr_after != "preset":
        cfg["lm_head_sr_after"] = lm_head_sr_after
    quantized = cfg["m_codebook"] is not None
    if quantized or any(x is not None for x in (m_codebook, v_codebook, m_rounding, v_rounding)):
        for k in ("m_codebook", "v_codebook"):
            if cfg[k] is None:
                raise ValueError(f"{k} must be set when the other moment is quantized "
                                 f"(preset {preset!r})")
            try:
                get_codebook(cfg[k])  # validates the name / levels
            except (ValueError, TypeError) as e:
                raise type(e)(f"{k}: {e}") from None
        if cfg["m_rounding"] not in ROUNDINGS:
            raise ValueError(f"m_rounding must be one of {ROUNDINGS}, got {cfg['m_rounding']!r}")
        if cfg["v_rounding"] not in V_ROUNDINGS:
            raise ValueError(f"v_rounding must be one of {V_ROUNDINGS}, got {cfg['v_rounding']!r}")
        if cfg["v_rounding"].startswith("update") and get_codebook(cfg["v_codebook"])[0] < 0:
            raise ValueError(f"v_rounding={cfg['v_rounding']!r} needs a nonnegative v_codebook, "
                             f"got {cfg['v_codebook']!r}")
    if not quantized and cfg["eden"]:
        raise ValueError("eden=True needs quantized moments; preset 'fp32' keeps FP32 states")
    sr_after = cfg["lm_head_sr_after"]
    if sr_after is not None and not (isinstance(sr_after, (int, float)) and 0.0 <= sr_after <= 1.0):
        raise ValueError(f"lm_head_sr_after must be None or a number in [0, 1], got {sr_after!r}")
    cfg.update(preset=preset, block_size=block_size)
    return cfg


def check_new_group(gi, group, capturable, param_rounding, master_weight_bits):
    """add_param_group's checks of group gi, just appended: check_group's, its quantize flag and
    its parameters' dtypes. Returns hparams_key(group)."""
    key = check_group(gi, group, capturable)
    if not isinstance(group["quantize"], bool):
        raise TypeError(f"param group {gi}: quantize must be True (4-bit "
                        f"states where eligible) or False (FP32 states), got {group['quantize']!r}")
    for p in group["params"]:
        if p.dtype not in KERNEL_DTYPES:
            raise TypeError(f"AdamW4bit needs float32, bfloat16 or float16 parameters, got {p.dtype} "
                            f"of shape {tuple(p.shape)}")
        if p.dtype == torch.float16 and (param_rounding == "sr" or master_weight_bits):
            what = "param_rounding='sr'" if param_rounding == "sr" else "master_weight_bits=24"
            raise TypeError(f"{what} is for bfloat16 parameters (float16 ones are written round-to-"
                            f"nearest); got float16 of shape {tuple(p.shape)}")
    return key


def check_progress(fraction):
    """set_progress's argument as a float in [0, 1]; ValueError naming it otherwise."""
    try:
        value = float(fraction)
    except (TypeError, ValueError):
        raise ValueError(f"set_progress(fraction): a number in [0, 1] (step / total steps), got {fraction!r}") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"set_progress(fraction): must be in [0, 1] (step / total steps), got {value}")
    return value


def check_group(gi, group, capturable, lr_value=True):
    """The hyperparameter checks of group gi (`_check_hparams`; with capturable=True, betas whose
    bias corrections reach 1 within the table's rows); returns hparams_key(group), what they
    looked at. lr_value=False skips the value of a one-element lr tensor on the GPU (reading it
    waits for the GPU); its shape and a CPU tensor's value are checked."""
    where = f"param group {gi}: "
    _check_hparams(dict(group, lr=0.0) if not lr_value and _lr_on_device(group["lr"]) else group, where)
    _check_math_keys(group, where)
    if not isinstance(group.get("maximize", False), bool):    # torch's key, implemented
        raise TypeError(f"{where}maximize={group['maximize']!r}: must be True or False")
    if capturable and any(0 < b < 1 and -54 * math.log(2) / math.log(b) >= BIAS_ROWS_MAX
                          for b in group["betas"]):
        raise ValueError(f"{where}capturable=True needs betas whose bias corrections reach 1 within "
                         f"{BIAS_ROWS_MAX} steps (beta < ~0.99999), got {tuple(group['betas'])}; use "
                         "capturable=False")
    return hparams_key(group)


def use_adamw_kernel(p, impl, interp):
    # adamw_step_triton for an FP32-state tensor: 16-bit parameters (FP32 ones take torch's
    # fused AdamW), contiguous, on CUDA (or CPU with TRITON_INTERPRET=1 and impl="triton")
    return p.dtype in (torch.bfloat16, torch.float16) and p.grad.dtype in KERNEL_DTYPES and \
        p.is_contiguous() and p.grad.is_contiguous() and impl != "torch" and \
        (p.is_cuda or (interp and impl == "triton"))


def use_triton(p, impl, interp, tables):
    # the 4-bit kernel for quantized p (impl, kernel tables, device, dtypes, contiguity);
    # impl='triton' where it cannot run is a ValueError saying why
    if tables is None:
        return False
    ok = (p.is_cuda or interp) and p.dtype in KERNEL_DTYPES and p.is_contiguous() and \
        p.grad.dtype in KERNEL_DTYPES and p.grad.is_contiguous()
    if impl == "triton" and not ok:
        raise ValueError("impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), "
                         "contiguous float32/bfloat16/float16 parameters and gradients; got a "
                         f"{'' if p.is_contiguous() else 'non-contiguous '}{p.device} {p.dtype} "
                         f"parameter of shape {tuple(p.shape)} with a "
                         f"{'' if p.grad.is_contiguous() else 'non-contiguous '}{p.grad.dtype} gradient "
                         "(use .contiguous() parameters or impl='auto')")
    return ok and (p.is_cuda or impl == "triton")
