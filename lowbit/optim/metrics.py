"""
Quantization-error diagnostics of paper B (Sec. 4 and Appendix C): how far a decoded moment or an
update lies from the exact one. Pure functions of tensors, returning Python floats; used by the
experiments and tests, not by the optimizer.
"""


def radial_bias(m, m_q):
    """Radial bias b_rad = <Q(m) - m, m> / ||m||² (paper B, Sec. 4); negative = inward.
    m, m_q: float tensors of one shape (a moment and its decoded quantization). Returns a float."""
    m, m_q = m.double().flatten(), m_q.double().flatten()
    return ((m_q - m) @ m / (m @ m)).item()


def relative_rms_error(x, x_q):
    """Relative RMS quantization error ||Q(x) - x|| / ||x|| (paper B, Appendix C.4).
    x, x_q: float tensors of one shape. Returns a float."""
    x, x_q = x.double().flatten(), x_q.double().flatten()
    return ((x_q - x).norm() / x.norm()).item()


def nonzero_to_zero_fraction(x, x_q):
    """Fraction of nonzero entries of x written as zero by Q (paper B, Appendix C.4).
    x, x_q: tensors of one shape. Returns a float in [0, 1] (0 if x has no nonzero entry)."""
    nz = x != 0
    return ((x_q == 0) & nz).sum().item() / max(nz.sum().item(), 1)


def update_relative_error(u_q, u_32):
    """One-step relative update error ||u_4bit - u_32|| / ||u_32|| (paper B, Appendix C.3).
    u_q, u_32: float tensors of one shape (4-bit and FP32 updates). Returns a float."""
    return relative_rms_error(u_32, u_q)
