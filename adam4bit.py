"""
AdamW with 4-bit optimizer states: ZIP-SR and ZE-EDEN (paper B), plus the TorchAO-style
baseline and plain FP32 AdamW, in one torch.optim.Optimizer.

Storage (paper B, Def. 3): each moment is flattened into blocks of `block_size` (128)
consecutive elements; a block keeps one FP32 scale s = max(absmax, 1e-12) and one 4-bit code per
element, two codes per byte. Per moment 0.5 + 4/128 = 0.53125 B/param, both 1.0625 B/param
instead of FP32 AdamW's 8.

Update-before-storage (paper B, Sec. 2.1): the step decodes the stored moments, forms the working
moments m~ = b1 Q(m~) + (1-b1) g and v~ = b2 Q(v~) + (1-b2) g², updates the parameter with the
working (unquantized) moments, and only then quantizes them for storage.

Rounding (Appendix A.2): a rounding coordinate phi picks between the two adjacent levels a < b
around x; p = (phi(b) - phi(x)) / (phi(b) - phi(a)) is the probability of writing a. RTN writes a
iff p > 1/2 (a tie writes b), SR writes a iff u < p with u ~ U[0, 1). phi(v) = v is state space
(State-RTN/SR); phi = h_t(v) = 1 / (sqrt(v)/sqrt(1-b2^t) + eps) is preconditioner space
(Update-RTN/SR). Inputs outside [min C, max C] saturate: p > 1 or p < 0 does it without a branch.

This file holds the plain-PyTorch reference (the specification, used on CPU and with
impl="torch"); the fused Triton step lives beside it.
"""
import math
import os

import torch
import triton
import triton.language as tl

from codebooks import get_codebook

# --------------------------------------------------------------------------------------------
# block quantizer (reference)

ROUNDINGS = ("rtn", "sr")
COORDS = ("state", "update")


def sqrt_rn(x):
    """Correctly rounded float32 sqrt (torch's vectorized CPU sqrt may be off by one ulp); the
    float64 detour rounds correctly, so the reference and the kernel's sqrt_rn agree bit for bit."""
    return x.double().sqrt().float()


def _denominator(v, bias_correction2, eps, sqrt_v=None):
    # r_t(v) = sqrt(v) / sqrt(1 - b2^t) + eps, the AdamW denominator, and h_t = 1 / r_t; written
    # with the float32 reciprocal of sqrt(bc2) (a multiply, not a division). The 4-bit step and
    # the quantizer's preconditioner coordinate share this one expression, so the kernel
    # computes r_t(v~) once for both.
    sqrt_v = sqrt_rn(v) if sqrt_v is None else sqrt_v
    return sqrt_v * _f32(1 / math.sqrt(bias_correction2)) + eps


def _f32(x):
    return torch.tensor(x, dtype=torch.float32).item()


def preconditioner(v, bias_correction2, eps):
    """h_t(v) = 1 / (sqrt(v / (1 - b2^t)) + eps) (paper B, Sec. 3.1), elementwise, float32."""
    return 1.0 / _denominator(v, bias_correction2, eps)


def round_to_levels(x, levels, rule="rtn", coord="state", bias_correction2=1.0, eps=1e-8, u=None,
                    sqrt_levels=None):
    """Round each x to one of its two adjacent decoded levels; return int64 codes (level indices).

    x:      float32 tensor (..., n).
    levels: float32 tensor (..., K) of decoded levels sorted ascending, K >= 2; its leading dims
            match x's (one level set per block: x (nblocks, B), levels (nblocks, K)), or levels
            is 1-D (K,) and shared by all of x.
    rule:   "rtn" or "sr" (paper B, Appendix A.2); coord: "state" (phi(v) = v) or "update"
            (phi = h_t, nonnegative levels only).
    u:      float32 uniforms in [0, 1) shaped like x, required for rule="sr".
    sqrt_levels: optional sqrt of the levels (same shape) used for h_t(level); quantize_blockwise
            passes sqrt(s) * sqrt(T) so the kernel reads a table instead of taking two roots.
    Saturation outside [levels[0], levels[-1]] falls out of p > 1 / p < 0 (module docstring).
    """
    K = levels.shape[-1]
    levels = levels.expand(*x.shape[:-1], K)
    count = sum((levels[..., k:k + 1] <= x).long() for k in range(K))   # levels <= x
    lo = (count - 1).clamp(0, K - 2)
    a, b = levels.gather(-1, lo), levels.gather(-1, lo + 1)
    # p = (phi(b) - phi(x)) / (phi(b) - phi(a)) = num / den, den > 0 inside the cell; decided
    # without a division: RTN takes a iff 2 num > den, SR iff u den < num. For phi = h = 1/r:
    # p = (1/rb - 1/rx) / (1/rb - 1/ra) = (rb - rx) ra / ((rb - ra) rx).
    if coord == "update":
        if sqrt_levels is None:
            sqrt_levels = sqrt_rn(levels)
        sqrt_levels = sqrt_levels.expand(*x.shape[:-1], K)
        ra = _denominator(a, bias_correction2, eps, sqrt_levels.gather(-1, lo))
        rb = _denominator(b, bias_correction2, eps, sqrt_levels.gather(-1, lo + 1))
        rx = _denominator(x, bias_correction2, eps)
        num, den = (rb - rx) * ra, (rb - ra) * rx
    else:
        num, den = b - x, b - a
    take_a = 2 * num > den if rule == "rtn" else u * den < num
    return torch.where(take_a, lo, lo + 1)


def pack_nibbles(codes):
    """(N,) integer codes in [0, 16) -> (N/2,) uint8; element 2i in the low nibble, 2i+1 high."""
    c = codes.to(torch.uint8).view(-1, 2)
    return c[:, 0] | (c[:, 1] << 4)


def unpack_nibbles(packed):
    """(N/2,) uint8 -> (N,) int64 codes; inverse of pack_nibbles."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(-1).long()


def _check_block_size(block_size):
    if not isinstance(block_size, int) or block_size < 2 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 2, got {block_size!r}")


def _check_quant_args(x, block_size, rule, coord, T, bias_correction2=1.0):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a real floating-point tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not 0 < bias_correction2 <= 1:
        raise ValueError(f"bias_correction2 = 1 - b2^t must be in (0, 1], got {bias_correction2}")
    _check_block_size(block_size)
    if x.numel() % block_size:
        raise ValueError(f"x.numel()={x.numel()} must be a multiple of block_size={block_size}")
    if rule not in ROUNDINGS:
        raise ValueError(f"rule must be one of {ROUNDINGS}, got {rule!r}")
    if coord not in COORDS:
        raise ValueError(f"coord must be one of {COORDS}, got {coord!r}")
    if coord == "update" and T[0] < 0:
        raise ValueError("coord='update' (preconditioner space) needs a nonnegative codebook, "
                         f"got min level {T[0].item()}")


def quantize_blockwise(x, codebook, block_size=128, rule="rtn", coord="state",
                       bias_correction2=1.0, eps=1e-8, eden=False, u=None, generator=None):
    """Block-quantize a tensor to packed 4-bit codes and FP32 scales (paper B, Def. 3, App. A.2).

    x:        float tensor, any shape, numel a multiple of block_size; read as flat float32.
    codebook: name in codebooks.CODEBOOKS or a 1-D level tensor (normalized, sorted).
    rule/coord: "rtn"|"sr" and "state"|"update"; coord="update" rounds in h_t space with
              bias_correction2 = 1 - b2^t of the step being stored, and eps of AdamW.
    eden:     EDEN calibration (paper B, Sec. 3.2): stored scale = c_tau * s with
              c_tau = ||y||² / max(<y, T[code]>, tau), y = x/s, tau = 1e-12 (the normalized form,
              sums in float64); an all-zero block gets c_tau = 0 and decodes to zero.
    u:        optional float32 uniforms in [0, 1) shaped like x for rule="sr" (else drawn with
              torch.rand(generator=generator)).
    Returns (packed uint8 (numel/2,), scales float32 (numel/block_size,)).
    Raises ValueError on a bad block_size, rule, coord, codebook or a non-divisible numel.
    """
    T = get_codebook(codebook).to(x.device)
    _check_quant_args(x, block_size, rule, coord, T, bias_correction2)
    xb = x.detach().reshape(-1, block_size).float()
    if coord == "update" and bool((xb < 0).any()):
        raise ValueError("coord='update' rounds second moments: x must be nonnegative")
    s = xb.abs().amax(dim=1).clamp_min(1e-12)
    levels = s[:, None] * T[None, :]                            # decoded levels, (nb, K)
    if rule == "sr" and u is None:
        u = torch.rand(xb.shape, device=xb.device, generator=generator)
    if rule == "sr":
        if u.numel() != xb.numel():
            raise ValueError(f"u must have one uniform per element of x ({xb.numel()}), got {u.numel()}")
        u = u.reshape(xb.shape)
    sqrt_levels = sqrt_rn(s)[:, None] * sqrt_rn(T)[None, :] if coord == "update" else None
    codes = round_to_levels(xb, levels, rule, coord, bias_correction2, eps, u, sqrt_levels)
    if eden:
        y = xb / s[:, None]
        q = T[codes]
        # float64 sums: the Triton kernel reduces in another order, and in float64 both round to
        # the same float32 c (the products y*y, y*q are float32 in both).
        c = (y * y).double().sum(1) / (y * q).double().sum(1).clamp(min=1e-12)
        s = c.float() * s
    return pack_nibbles(codes.view(-1)), s


def dequantize_blockwise(packed, scales, codebook, block_size=128):
    """Decode packed 4-bit codes: x[i] = scales[i // block_size] * T[code[i]]. Returns flat float32.

    packed: uint8 (N/2,); scales: float32 (N/block_size,). Raises ValueError on mismatched sizes.
    """
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError(f"packed must be a uint8 tensor, got {getattr(packed, 'dtype', type(packed).__name__)}")
    _check_block_size(block_size)
    T = get_codebook(codebook).to(packed.device)
    if packed.numel() * 2 != scales.numel() * block_size:
        raise ValueError(f"packed ({packed.numel()} bytes) and scales ({scales.numel()}) do not "
                         f"describe the same tensor with block_size={block_size}")
    codes = unpack_nibbles(packed.reshape(-1))
    return (scales[:, None] * T[codes].view(-1, block_size)).view(-1)


# --------------------------------------------------------------------------------------------
# the optimizer

# Paper B, Table 2. m is always rounded in state space; v's rounding names "coord-rule".
PRESETS = {
    "fp32":    dict(m_codebook=None, m_rounding=None, v_codebook=None, v_rounding=None,
                    eden=False, lm_head_sr_after=None),
    "torchao": dict(m_codebook="sdyn4", m_rounding="rtn", v_codebook="lin4_nz",
                    v_rounding="state-rtn", eden=False, lm_head_sr_after=None),
    "zeeden":  dict(m_codebook="nf4", m_rounding="rtn", v_codebook="dyn4_nz",
                    v_rounding="state-rtn", eden=True, lm_head_sr_after=0.9),
    "zipsr":   dict(m_codebook="nf4", m_rounding="rtn", v_codebook="dyn4",
                    v_rounding="update-sr", eden=False, lm_head_sr_after=0.9),
}
V_ROUNDINGS = ("state-rtn", "state-sr", "update-rtn", "update-sr")
IMPLS = ("auto", "torch", "triton")
MIN_QUANT_NUMEL = 4096  # paper B eligibility: numel >= 4096 and numel % block_size == 0
KERNEL_ELEMS, KERNEL_WARPS = 128, 1    # elements per Triton program, warps (best of a sweep on H200)
LUT_BUCKETS = 1024                     # buckets of y = x / s over [-1, 1] in the kernel's level search
_LUT_N = tl.constexpr(LUT_BUCKETS)     # the same, as Triton kernels may read it


def _level_lut(T, n=LUT_BUCKETS, margin=2.0 ** -12):
    """Start of the Triton kernel's level search for a sorted codebook T (K values in [-1, 1]).

    Bucket j of y = x / s covers [e_j, e_j+1), e_j = -1 + 2j/n. lut[j] = #{k in 1..K-2 :
    T[k] <= e_j - margin} counts the inner levels surely below any y of the bucket, and at most
    one more inner level can lie in [e_j - margin, e_j+1 + margin), so the exact index
    max{k <= K-2 : s T[k] <= x} is lut[j] or lut[j] + 1 (the margin, 2^-12, covers the float32
    error of computing y as x * (1/s), ~1e-7). Returns int32 (n,). Raises ValueError if two
    levels are closer than one bucket plus margins (every paper codebook is >= 0.0032 apart;
    a bucket is 0.002)."""
    K = T.numel()
    edges = -1 + 2 * torch.arange(n + 1, dtype=torch.float64) / n
    inner = T[1:K - 1].double()
    lut = (inner[None, :] <= edges[:-1, None] - margin).sum(1)
    most = (inner[None, :] < edges[1:, None] + margin).sum(1)
    if K > 2 and ((most - lut).max() > 1 or T.abs().max() > 1):
        raise ValueError(f"codebook levels {T.tolist()} are closer than the kernel's level "
                         f"buckets (2/{n} plus margins) or outside [-1, 1]")
    return lut.to(torch.int32)


def _check_hparams(h, where):
    """ValueError/TypeError naming the hyperparameter, its value and the allowed range."""
    lr, betas, eps, wd = h["lr"], h["betas"], h["eps"], h["weight_decay"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{where}lr tensor must have one element, got shape {tuple(lr.shape)}")
        lr = lr.item()
    for name, v in (("lr", lr), ("eps", eps), ("weight_decay", wd)):
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise TypeError(f"{where}{name} must be a number, got {v!r}")
    if not (0 <= lr < math.inf):
        raise ValueError(f"{where}lr must be finite and >= 0, got {lr}")
    if not (0 < eps < math.inf):
        raise ValueError(f"{where}eps must be finite and > 0, got {eps}")
    if not (0 <= wd < math.inf):
        raise ValueError(f"{where}weight_decay must be finite and >= 0, got {wd}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2
            and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"{where}betas must be two numbers in [0, 1), got {betas!r}")


def radial_bias(m, m_q):
    """Radial bias b_rad = <Q(m) - m, m> / ||m||² (paper B, Sec. 4); negative = inward. Float."""
    m, m_q = m.double().flatten(), m_q.double().flatten()
    return ((m_q - m) @ m / (m @ m)).item()


def relative_rms_error(x, x_q):
    """Relative RMS quantization error ||Q(x) - x|| / ||x|| (paper B, Appendix C.4). Float."""
    x, x_q = x.double().flatten(), x_q.double().flatten()
    return ((x_q - x).norm() / x.norm()).item()


def nonzero_to_zero_fraction(x, x_q):
    """Fraction of nonzero entries of x written as zero by Q (paper B, Appendix C.4). Float."""
    nz = x != 0
    return ((x_q == 0) & nz).sum().item() / max(nz.sum().item(), 1)


def update_relative_error(u_q, u_32):
    """One-step relative update error ||u_4bit - u_32|| / ||u_32|| (paper B, Appendix C.3). Float."""
    return relative_rms_error(u_32, u_q)


class AdamW4bit(torch.optim.Optimizer):
    """AdamW with block-quantized 4-bit moments (paper B, Sec. 2.1, Def. 3, Table 2).

    params:       iterable of tensors or param-group dicts (per-group lr, betas, eps,
                  weight_decay). Parameters are the FP32 master weights (bf16/fp16 also work:
                  the math runs in FP32 and the result is cast back).
    lr:           float or 0-d tensor (works with torch.optim.lr_scheduler).
    betas, eps, weight_decay: AdamW's; weight decay is decoupled: w <- (1 - lr wd) w.
    preset:       "fp32" (plain AdamW, FP32 states), "torchao" (SDyn4 State-RTN m, Lin4-NZ
                  State-RTN v), "zeeden" (NF4 RTN m, Dyn4-NZ State-RTN v + EDEN), "zipsr"
                  (NF4 RTN m, Dyn4 Update-SR v) -- paper B Table 2.
    Component overrides (each row of paper B Table 3 is one call), None keeps the preset's:
      m_codebook, v_codebook: codebook names (codebooks.CODEBOOKS);
      m_rounding: "rtn"|"sr"; v_rounding: "state-rtn"|"state-sr"|"update-rtn"|"update-sr";
      eden: EDEN calibration of v blocks (Sec. 3.2);
      lm_head_sr_after: progress fraction after which the parameters passed to mark_lm_head()
        store their first moment with SR instead of RTN (0.9 for zipsr/zeeden; None = never).
    block_size:   elements per scale block (power of two, default 128). A moment is quantized
                  iff numel >= 4096 and numel % block_size == 0; others keep FP32 states.
    impl:         "torch" (reference), "triton" (fused kernel, CUDA or TRITON_INTERPRET=1), or
                  "auto" (triton on CUDA tensors, torch otherwise).
    seed:         seeds the SR random bits; bits of step t depend only on (seed, t, parameter
                  index), so a resumed run draws the same bits.

    State per quantized parameter: exp_avg / exp_avg_sq as packed uint8 (numel/2,) and
    exp_avg_scale / exp_avg_sq_scale as float32 (numel/block_size,); FP32 tensors otherwise.
    Raises ValueError/TypeError for bad hyperparameters (also in param groups), unknown names,
    non-float parameters and mismatched state dicts; RuntimeError (as torch's AdamW) for sparse
    gradients.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 preset="zipsr", block_size=128, impl="auto", seed=0, *, m_codebook=None,
                 m_rounding=None, v_codebook=None, v_rounding=None, eden=None,
                 lm_head_sr_after="preset"):
        _check_hparams(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), "")
        if not isinstance(preset, str) or preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
        _check_block_size(block_size)
        if not isinstance(impl, str) or impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise TypeError(f"seed must be a nonnegative int, got {seed!r}")
        if eden is not None and not isinstance(eden, bool):
            raise TypeError(f"eden must be True, False or None (the preset's), got {eden!r}")
        cfg = dict(PRESETS[preset])
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
        self.qcfg = cfg
        self.impl = impl
        self.seed = int(seed)
        self.progress = 0.0
        self._lm_head = set()
        self._codebooks, self._prog_tables = {}, {}     # per-device caches of the Triton path
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        """torch's add_param_group, then checks the group's hyperparameters (every group, also
        those given to the constructor) and that its parameters are real floating tensors."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hparams(group, f"param group {len(self.param_groups) - 1}: ")
        for p in group["params"]:
            if not p.is_floating_point():
                raise TypeError(f"AdamW4bit needs real floating-point parameters, got {p.dtype} "
                                f"of shape {tuple(p.shape)}")

    # ---- trainer hooks ----------------------------------------------------------------------
    def mark_lm_head(self, param):
        """Mark `param` (a tensor in this optimizer) as the LM head: its first moment switches
        from RTN to SR once progress >= lm_head_sr_after (paper B, Sec. 4). ValueError if absent."""
        if not any(param is p for g in self.param_groups for p in g["params"]):
            raise ValueError("mark_lm_head: the tensor is not a parameter of this optimizer")
        self._lm_head.add(id(param))

    def set_progress(self, fraction):
        """Tell the optimizer the training progress, a float in [0, 1] (step / total_steps)."""
        fraction = float(fraction)
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"progress fraction must be in [0, 1], got {fraction}")
        self.progress = fraction

    def m_rounding_for(self, param):
        """The first-moment rounding ("rtn"|"sr") that the next step uses for `param`."""
        after = self.qcfg["lm_head_sr_after"]
        if id(param) in self._lm_head and after is not None and self.progress >= after:
            return "sr"
        return self.qcfg["m_rounding"]

    # ---- state --------------------------------------------------------------------------------
    def is_quantized(self, p):
        """True if p's moments are stored in 4 bits (quantized preset and eligible size)."""
        B = self.qcfg["block_size"]
        return (self.qcfg["m_codebook"] is not None and p.numel() >= MIN_QUANT_NUMEL
                and p.numel() % B == 0)

    def _init_state(self, p):
        st = self.state[p]
        st["step"] = torch.tensor(0.0)
        if self.is_quantized(p):
            n, B = p.numel(), self.qcfg["block_size"]
            for k in ("exp_avg", "exp_avg_sq"):
                # scale 0 decodes every code to 0: the zero initial moments of AdamW
                st[k] = torch.zeros(n // 2, dtype=torch.uint8, device=p.device)
                st[k + "_scale"] = torch.zeros(n // B, dtype=torch.float32, device=p.device)
        else:
            st["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        return st

    def state_nbytes(self):
        """Persistent optimizer-state bytes: codes, scales and FP32 moments (the scalar step
        counters are not counted). 1.0625 B/param on quantized tensors, 8 on FP32 ones."""
        return sum(t.numel() * t.element_size() for st in self.state.values()
                   for k, t in st.items() if k != "step" and torch.is_tensor(t))

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self):
        """torch's state dict plus the quantizer configuration, seed, progress and LM-head marks."""
        sd = super().state_dict()
        sd["adam4bit"] = {k: self.qcfg[k] for k in sorted(self.qcfg)}
        sd["adam4bit_extra"] = dict(seed=self.seed, progress=self.progress, lm_head=[
            i for i, p in enumerate(self._params()) if id(p) in self._lm_head])
        return sd

    def load_state_dict(self, state_dict):
        """Load a state_dict() of an AdamW4bit with the same preset, components and block_size;
        packed codes and scales are restored exactly (and moved to each parameter's device).
        Raises ValueError for a state dict of another configuration or of another optimizer."""
        if "adam4bit" not in state_dict:
            raise ValueError("not an AdamW4bit state dict (no 'adam4bit' entry); refusing to load")
        saved = state_dict["adam4bit"]
        mine = {k: self.qcfg[k] for k in sorted(self.qcfg)}
        def same(a, b):   # codebooks may be tensors (custom levels)
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
            return a == b
        diff = {k: (saved.get(k), mine[k]) for k in mine if not same(saved.get(k), mine[k])}
        if diff:
            raise ValueError("optimizer state was written with another configuration "
                             f"(saved, current): {diff}")
        params = self._params()
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for pid, p in zip(saved_ids, params):
            st = state_dict["state"].get(pid, {})
            if "exp_avg" in st and st["exp_avg"].numel() != (p.numel() // 2 if self.is_quantized(p) else p.numel()):
                raise ValueError(f"optimizer state of parameter {pid} ({st['exp_avg'].numel()} exp_avg "
                                 f"entries) does not fit the parameter of shape {tuple(p.shape)}")
        super().load_state_dict({k: state_dict[k] for k in ("state", "param_groups")})
        # torch casts every state tensor to the parameter's dtype (uint8 codes too): put back the
        # saved tensors with their own dtypes, on the parameter's device.
        for pid, p in zip(saved_ids, params):
            for k, t in state_dict["state"].get(pid, {}).items():
                if k != "step" and torch.is_tensor(t):
                    self.state[p][k] = t.detach().to(device=p.device).clone()
        extra = state_dict.get("adam4bit_extra", {})
        self.seed = int(extra.get("seed", self.seed))
        self.progress = float(extra.get("progress", self.progress))
        self._lm_head |= {id(params[i]) for i in extra.get("lm_head", [])}

    # ---- step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over all parameters with a gradient (update-before-storage).

        Quantized tensors go through the fused Triton kernel (one launch per group of tensors
        sharing step, gradient dtype and first-moment rule) or the torch reference; FP32-state
        tensors through torch's fused AdamW on CUDA, the reference loop elsewhere.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            lr = group["lr"]
            lr = float(lr.item()) if torch.is_tensor(lr) else float(lr)
            hp = (lr, *group["betas"], group["eps"], group["weight_decay"])
            fp32, quant = [], {}
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW4bit does not support sparse gradients; "
                                       "use dense gradients (e.g. nn.Embedding(sparse=False))")
                st = self.state[p] if self.state[p] else self._init_state(p)
                st["step"] += 1
                t = int(st["step"].item())
                if not self.is_quantized(p):
                    fp32.append((p, st, t))
                    continue
                m_rule, seed = self.m_rounding_for(p), self._step_seed(t, index)
                if self._use_triton(p):
                    quant.setdefault((t, p.grad.dtype, m_rule), []).append((p, st, seed))
                else:
                    self._step_quantized_torch(p, p.grad, st, *hp, t, m_rule, seed)
            _adamw_fp32_steps(fp32, *hp)
            for (t, _, m_rule), items in quant.items():
                self._step_quantized_triton(items, *hp, t, m_rule)
        return loss

    def _use_triton(self, p):
        if self.impl == "torch":
            return False
        interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
        ok = (p.is_cuda or interp) and p.dtype == torch.float32 and p.is_contiguous() and \
            p.grad.dtype in (torch.float32, torch.bfloat16) and p.grad.is_contiguous()
        if self.impl == "triton" and not ok:
            raise ValueError("impl='triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), "
                             "contiguous float32 parameters and float32/bfloat16 gradients; got "
                             f"{p.device} {p.dtype} param, {p.grad.dtype} grad")
        return ok and (p.is_cuda or self.impl == "triton")

    def _step_seed(self, t, index):
        # Independent SR bits per (seed, step, parameter); 31 bits so both torch and Triton take it.
        return (self.seed * 1_000_003 + t * 65_537 + index * 257) % (2 ** 31 - 1)

    def _step_quantized_torch(self, p, grad, st, lr, b1, b2, eps, wd, t, m_rule, seed, u=None):
        """Reference step of one quantized tensor (paper B, Sec. 2.1). `u`: optional pair of
        uniform tensors (for m, for v) replacing the generator's SR bits, for kernel tests."""
        c, B = self.qcfg, self.qcfg["block_size"]
        g = grad.reshape(-1).float()
        m_prev = dequantize_blockwise(st["exp_avg"], st["exp_avg_scale"], c["m_codebook"], B)
        v_prev = dequantize_blockwise(st["exp_avg_sq"], st["exp_avg_sq_scale"], c["v_codebook"], B)
        m = m_prev * b1 + g * (1 - b1)
        v = v_prev * b2 + g * g * (1 - b2)
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        w = p.detach().reshape(-1).float()
        w = w * (1 - lr * wd) - (lr / bc1) * m / _denominator(v, bc2, eps)
        p.copy_(w.view_as(p))
        gen = torch.Generator(device=p.device).manual_seed(seed)
        u_m, u_v = u if u is not None else (None, None)
        v_coord, v_rule = c["v_rounding"].split("-")
        st["exp_avg"], st["exp_avg_scale"] = quantize_blockwise(
            m, c["m_codebook"], B, m_rule, "state", u=u_m, generator=gen)
        st["exp_avg_sq"], st["exp_avg_sq_scale"] = quantize_blockwise(
            v, c["v_codebook"], B, v_rule, v_coord, bc2, eps, c["eden"], u=u_v, generator=gen)

    def _step_quantized_triton(self, items, lr, b1, b2, eps, wd, t, m_rule, u=None):
        """Fused step of many quantized tensors in one kernel launch (items: (param, state, seed))."""
        c, B = self.qcfg, self.qcfg["block_size"]
        dev = items[0][0].device
        cbs = self._codebooks.get(dev)
        if cbs is None:
            T_m, T_v = (get_codebook(c[k]) for k in ("m_codebook", "v_codebook"))
            cbs = self._codebooks[dev] = tuple(t.to(dev) for t in (
                T_m, T_v, sqrt_rn(T_v), _level_lut(T_m), _level_lut(T_v)))
        numels = tuple(p.numel() for p, _, _ in items)
        nb = max(1, KERNEL_ELEMS // B)                 # scale blocks per program
        progs = self._prog_tables.get((dev, B, numels))
        if progs is None:
            counts = torch.tensor([triton.cdiv(n // B, nb) for n in numels])
            starts = torch.cumsum(counts, 0) - counts
            prog_tensor = torch.repeat_interleave(torch.arange(len(numels)), counts)
            progs = self._prog_tables[(dev, B, numels)] = (
                prog_tensor.to(torch.int32).to(dev), starts.to(torch.int32).to(dev), int(counts.sum()))
        grads = _kernel_grads([p for p, _, _ in items])
        rows = [[p.data_ptr() for p, _, _ in items], [g.data_ptr() for g in grads]]
        rows += [[st[k].data_ptr() for _, st, _ in items]
                 for k in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale")]
        rows += [list(numels), [sd for _, _, sd in items]]
        if u is not None:
            rows += [[x.data_ptr() for x, _ in u], [x.data_ptr() for _, x in u]]
        tab = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
        v_coord, v_rule = c["v_rounding"].split("-")
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        extra = {} if os.environ.get("TRITON_INTERPRET", "0") == "1" else {"enable_fp_fusion": False}
        _adamw4bit_kernel[(progs[2],)](
            progs[0], progs[1], tab, len(items), *cbs,
            1 - lr * wd, lr / bc1, b1, 1 - b1, b2, 1 - b2, 1 / math.sqrt(bc2), eps,
            M_K=cbs[0].numel(), V_K=cbs[1].numel(), M_SR=m_rule == "sr", V_SR=v_rule == "sr",
            V_UPDATE=v_coord == "update", EDEN=bool(c["eden"]),
            GRAD_BF16=items[0][0].grad.dtype == torch.bfloat16, HAS_U=u is not None,
            BS=B, NB=nb, num_warps=KERNEL_WARPS, **extra)


def _kernel_grads(params):
    """The gradients the kernel reads. BF16 ones are read as aligned 32-bit words (two elements
    each; the GPU faults on a misaligned word), so a grad view starting at an odd 2-byte offset,
    as in a flat gradient buffer, is replaced by an aligned copy."""
    return [p.grad if p.grad.dtype != torch.bfloat16 or p.grad.data_ptr() % 4 == 0 else p.grad.clone()
            for p in params]


def _adamw_fp32_steps(items, lr, b1, b2, eps, wd):
    """AdamW on FP32 states (paper B's 32-bit baseline; also tensors too small to quantize).
    CUDA: torch's fused AdamW kernel, one launch per step value. Elsewhere: the reference loop, in
    torch.optim.AdamW's single-tensor operation order (matches it to rounding)."""
    if not items:
        return
    if items[0][0].is_cuda and all(p.dtype == torch.float32 for p, _, _ in items):
        by_t = {}
        for p, st, t in items:
            by_t.setdefault(t, []).append((p, st))
        for t, its in by_t.items():
            ps = [p for p, _ in its]
            step = torch.full((), float(t), device=ps[0].device)
            torch._fused_adamw_(ps, [p.grad.float() for p in ps], [st["exp_avg"] for _, st in its],
                                [st["exp_avg_sq"] for _, st in its], [], [step] * len(ps),
                                lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=eps,
                                amsgrad=False, maximize=False)
        return
    for p, st, t in items:
        m, v = st["exp_avg"], st["exp_avg_sq"]
        g = p.grad.float()
        w = p.detach().float()
        w.mul_(1 - lr * wd)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
        w.addcdiv_(m, denom, value=-lr / bc1)
        p.copy_(w)


# --------------------------------------------------------------------------------------------
# the fused Triton step: one pass over param, grad and both packed moments

@triton.jit
def _quantize(x, s, cb_ptr, lut_ptr, u, rx, sq_cb_ptr, inv_sqrt_bc2, eps, K: tl.constexpr,
              SR: tl.constexpr, UPDATE: tl.constexpr):
    # round_to_levels with levels s * T, the same float32 operations; x (R, C), s (R,).
    # lo = max{k <= K-2 : s T[k] <= x} (0 if none), the reference's count of levels <= x: the
    # bucket of y ~ x/s in the level table (see _level_lut) gives lo or lo - 1, and one exact
    # comparison decides. 3 table reads instead of a 4-step binary search (the search was 37 %
    # of the step on the H200).
    j = ((x * (1.0 / s)[:, None] + 1.0) * (_LUT_N // 2)).to(tl.int32)
    c = tl.load(lut_ptr + tl.minimum(tl.maximum(j, 0), _LUT_N - 1))
    lo = c + ((c < K - 2) & (s[:, None] * tl.load(cb_ptr + c + 1) <= x)).to(tl.int32)
    a = s[:, None] * tl.load(cb_ptr + lo)
    b = s[:, None] * tl.load(cb_ptr + lo + 1)
    if UPDATE:
        sq_s = tl.sqrt_rn(s)[:, None]
        ra = sq_s * tl.load(sq_cb_ptr + lo) * inv_sqrt_bc2 + eps
        rb = sq_s * tl.load(sq_cb_ptr + lo + 1) * inv_sqrt_bc2 + eps
        num = (rb - rx) * ra
        den = (rb - ra) * rx
    else:
        num = b - x
        den = b - a
    if SR:
        take_a = u * den < num
    else:
        take_a = 2 * num > den
    return tl.where(take_a, lo, lo + 1)


@triton.jit
def _eden_scale(x0, x1, c0, c1, s, cb_ptr):
    # EDEN: s * float32(sum y² / max(sum y q, 1e-12)), y = x / s, sums in float64
    y0 = tl.div_rn(x0, s[:, None])
    y1 = tl.div_rn(x1, s[:, None])
    q0 = tl.load(cb_ptr + c0)
    q1 = tl.load(cb_ptr + c1)
    yy = tl.sum((y0 * y0).to(tl.float64), axis=1) + tl.sum((y1 * y1).to(tl.float64), axis=1)
    yq = tl.sum((y0 * q0).to(tl.float64), axis=1) + tl.sum((y1 * q1).to(tl.float64), axis=1)
    return (yy / tl.maximum(yq, 1e-12)).to(tl.float32) * s


@triton.jit
def _uniform(r):
    # 24 random bits -> float32 in [0, 1), exact
    return (r >> 8).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _adamw4bit_kernel(prog_tensor, prog_start, tab, n_tensors, m_cb, v_cb, v_sq_cb, m_lut, v_lut,
                      decay, step_size, b1, one_minus_b1, b2, one_minus_b2,
                      inv_sqrt_bc2, eps, M_K: tl.constexpr, V_K: tl.constexpr,
                      M_SR: tl.constexpr, V_SR: tl.constexpr, V_UPDATE: tl.constexpr,
                      EDEN: tl.constexpr, GRAD_BF16: tl.constexpr, HAS_U: tl.constexpr,
                      BS: tl.constexpr, NB: tl.constexpr):
    # tab rows (int64, n_tensors each): param, grad, m codes, m scales, v codes, v scales
    # pointers; numel; SR seed; [u_m, u_v pointers if HAS_U]. A program does NB blocks of BS.
    # Even and odd elements are held as two (NB, BS/2) halves: they are the low and high
    # nibbles of one byte, so packing needs no data exchange between threads.
    pid = tl.program_id(0)
    ti = tl.load(prog_tensor + pid)
    first = (pid - tl.load(prog_start + ti)).to(tl.int64) * NB
    numel = tl.load(tab + 6 * n_tensors + ti)
    # int64 only in the per-program base pointers (tensors may exceed 2^31 elements); int32
    # offsets within the program's NB * BS elements.
    rows = tl.arange(0, NB)
    rmask = rows < numel // BS - first
    pairs = rows[:, None] * (BS // 2) + tl.arange(0, BS // 2)[None, :]  # byte index
    mask = rmask[:, None]
    e0 = 2 * pairs                                                    # even element index
    p_ptr = tl.load(tab + ti).to(tl.pointer_type(tl.float32)) + first * BS
    mq = tl.load(tab + 2 * n_tensors + ti).to(tl.pointer_type(tl.uint8)) + first * (BS // 2)
    ms = tl.load(tab + 3 * n_tensors + ti).to(tl.pointer_type(tl.float32)) + first
    vq = tl.load(tab + 4 * n_tensors + ti).to(tl.pointer_type(tl.uint8)) + first * (BS // 2)
    vs = tl.load(tab + 5 * n_tensors + ti).to(tl.pointer_type(tl.float32)) + first

    # decode (dequantize_blockwise) and the working moments, m~ = b1 Q(m) + (1-b1) g, ...
    mbyte = tl.load(mq + pairs, mask=mask, other=0).to(tl.int32)
    vbyte = tl.load(vq + pairs, mask=mask, other=0).to(tl.int32)
    msc = tl.load(ms + rows, mask=rmask, other=0.0)[:, None]
    vsc = tl.load(vs + rows, mask=rmask, other=0.0)[:, None]
    if GRAD_BF16:
        # a byte's two BF16 gradients are one aligned 32-bit word (little-endian: the even
        # element in the low half): one load per byte, and BF16 -> FP32 is a 16-bit shift (exact)
        g_ptr = tl.load(tab + n_tensors + ti).to(tl.pointer_type(tl.int32)) + first * (BS // 2)
        gw = tl.load(g_ptr + pairs, mask=mask, other=0)
        g0 = (gw << 16).to(tl.float32, bitcast=True)
        g1 = (gw & -65536).to(tl.float32, bitcast=True)
    else:
        g_ptr = tl.load(tab + n_tensors + ti).to(tl.pointer_type(tl.float32)) + first * BS
        g0 = tl.load(g_ptr + e0, mask=mask, other=0.0)
        g1 = tl.load(g_ptr + e0 + 1, mask=mask, other=0.0)
    m0 = msc * tl.load(m_cb + (mbyte & 15)) * b1 + g0 * one_minus_b1
    m1 = msc * tl.load(m_cb + (mbyte >> 4)) * b1 + g1 * one_minus_b1
    v0 = vsc * tl.load(v_cb + (vbyte & 15)) * b2 + g0 * g0 * one_minus_b2
    v1 = vsc * tl.load(v_cb + (vbyte >> 4)) * b2 + g1 * g1 * one_minus_b2

    # AdamW update with the working moments (update-before-storage)
    w0 = tl.load(p_ptr + e0, mask=mask, other=0.0)
    w1 = tl.load(p_ptr + e0 + 1, mask=mask, other=0.0)
    r0 = tl.sqrt_rn(v0) * inv_sqrt_bc2 + eps                          # r_t(v~), reused below
    r1 = tl.sqrt_rn(v1) * inv_sqrt_bc2 + eps
    w0 = w0 * decay - tl.div_rn(step_size * m0, r0)
    w1 = w1 * decay - tl.div_rn(step_size * m1, r1)
    tl.store(p_ptr + e0, w0, mask=mask)
    tl.store(p_ptr + e0 + 1, w1, mask=mask)

    # SR uniforms: one Philox call per byte gives 4 words (m even/odd, v even/odd)
    um0 = 0.0
    um1 = 0.0
    uv0 = 0.0
    uv1 = 0.0
    if M_SR or V_SR:
        if HAS_U:
            u_m = tl.load(tab + 8 * n_tensors + ti).to(tl.pointer_type(tl.float32)) + first * BS
            u_v = tl.load(tab + 9 * n_tensors + ti).to(tl.pointer_type(tl.float32)) + first * BS
            um0 = tl.load(u_m + e0, mask=mask, other=0.0)
            um1 = tl.load(u_m + e0 + 1, mask=mask, other=0.0)
            uv0 = tl.load(u_v + e0, mask=mask, other=0.0)
            uv1 = tl.load(u_v + e0 + 1, mask=mask, other=0.0)
        else:
            seed = tl.load(tab + 7 * n_tensors + ti).to(tl.int32)
            # Philox4x32 with 7 rounds (Random123's crush-resistant minimum; default is 10)
            q0, q1, q2, q3 = tl.randint4x(seed, pairs + first * (BS // 2), n_rounds=7)
            um0, um1, uv0, uv1 = _uniform(q0), _uniform(q1), _uniform(q2), _uniform(q3)

    # quantize both moments (blocks of BS = the two halves of each row) and pack
    s = tl.maximum(tl.maximum(tl.max(tl.abs(m0), axis=1), tl.max(tl.abs(m1), axis=1)), 1e-12)
    c0 = _quantize(m0, s, m_cb, m_lut, um0, r0, v_sq_cb, inv_sqrt_bc2, eps, M_K, M_SR, False)
    c1 = _quantize(m1, s, m_cb, m_lut, um1, r1, v_sq_cb, inv_sqrt_bc2, eps, M_K, M_SR, False)
    tl.store(mq + pairs, (c0 | (c1 << 4)).to(tl.uint8), mask=mask)
    tl.store(ms + rows, s, mask=rmask)
    s = tl.maximum(tl.maximum(tl.max(tl.abs(v0), axis=1), tl.max(tl.abs(v1), axis=1)), 1e-12)
    c0 = _quantize(v0, s, v_cb, v_lut, uv0, r0, v_sq_cb, inv_sqrt_bc2, eps, V_K, V_SR, V_UPDATE)
    c1 = _quantize(v1, s, v_cb, v_lut, uv1, r1, v_sq_cb, inv_sqrt_bc2, eps, V_K, V_SR, V_UPDATE)
    if EDEN:
        s = _eden_scale(v0, v1, c0, c1, s, v_cb)
    tl.store(vq + pairs, (c0 | (c1 << 4)).to(tl.uint8), mask=mask)
    tl.store(vs + rows, s, mask=rmask)
