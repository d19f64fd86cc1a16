"""Triton device functions of the expert activations (DESIGN.md §2), shared by the epilogues.

Activation codes (constexpr ``ACTIVATION``): 0 swiglu, 1 geglu, 2 silu, 3 gelu, 4 relu. Gated codes
(< 2) read ``gate = pre[:, :h]`` and ``up = pre[:, h:]``; the base function is SiLU for 0/2, exact
(erf) GELU for 1/3 and ReLU for 4 — the definitions of :mod:`moeblaze.activations`. All math in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

ACTIVATION_CODES = {"swiglu": 0, "geglu": 1, "silu": 2, "gelu": 3, "relu": 4}

_INV_SQRT2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def act_base(z, ACTIVATION: tl.constexpr):
    """f(z): SiLU (codes 0, 2), exact GELU (1, 3) or ReLU (4); ``z`` fp32."""
    if ACTIVATION == 0 or ACTIVATION == 2:
        r = z * tl.sigmoid(z)
    elif ACTIVATION == 1 or ACTIVATION == 3:
        r = 0.5 * z * (1.0 + tl.erf(z * _INV_SQRT2))
    else:
        r = tl.maximum(z, 0.0)
    return r


@triton.jit
def act_base_grad(z, ACTIVATION: tl.constexpr):
    """f'(z) for :func:`act_base`; ``z`` fp32."""
    if ACTIVATION == 0 or ACTIVATION == 2:
        s = tl.sigmoid(z)
        r = s * (1.0 + z * (1.0 - s))
    elif ACTIVATION == 1 or ACTIVATION == 3:
        r = 0.5 * (1.0 + tl.erf(z * _INV_SQRT2)) + z * tl.exp(-0.5 * z * z) * _INV_SQRT_2PI
    else:
        r = tl.where(z > 0.0, 1.0, 0.0)
    return r


@triton.jit
def act_forward(gate, up, ACTIVATION: tl.constexpr):
    """``act = f(gate) * up`` (gated codes) or ``f(gate)`` (``up`` ignored); fp32 in, fp32 out."""
    if ACTIVATION < 2:
        r = act_base(gate, ACTIVATION) * up
    else:
        r = act_base(gate, ACTIVATION)
    return r


@triton.jit
def act_backward(dact, gate, up, ACTIVATION: tl.constexpr):
    """``(dgate, dup)`` from ``dact``; for non-gated codes ``dup`` is a dummy (zeros). fp32."""
    if ACTIVATION < 2:
        dgate = dact * up * act_base_grad(gate, ACTIVATION)
        dup = dact * act_base(gate, ACTIVATION)
    else:
        dgate = dact * act_base_grad(gate, ACTIVATION)
        dup = tl.zeros_like(dact)
    return dgate, dup
