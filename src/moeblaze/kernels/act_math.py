"""Triton device functions of the expert activations (DESIGN.md §2), shared by the epilogues.

Activation codes (constexpr ``ACTIVATION``, named below): the gated ones come first (codes below
``FIRST_NON_GATED``) and read ``gate`` and ``up`` from ``pre``; the non-gated ones read ``gate = pre`` only.
The definitions are those of :mod:`moeblaze.activations`: SiLU, exact (erf) GELU, tanh-approximate GELU
(``tanh(u) = 2 sigmoid(2u) - 1``: no libdevice call), ReLU, squared ReLU, and GPT-OSS's clamped SwiGLU
``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)`` (``alpha``, ``limit``
runtime floats). All math in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

SWIGLU = tl.constexpr(0)
GEGLU = tl.constexpr(1)
GEGLU_TANH = tl.constexpr(2)
SWIGLU_CLAMPED = tl.constexpr(3)
FIRST_NON_GATED = tl.constexpr(4)
SILU = tl.constexpr(4)
GELU = tl.constexpr(5)
GELU_TANH = tl.constexpr(6)
RELU = tl.constexpr(7)
RELU2 = tl.constexpr(8)

ACTIVATION_CODES = {"swiglu": SWIGLU.value, "geglu": GEGLU.value, "geglu_tanh": GEGLU_TANH.value,
                    "swiglu_clamped": SWIGLU_CLAMPED.value, "silu": SILU.value, "gelu": GELU.value,
                    "gelu_tanh": GELU_TANH.value, "relu": RELU.value, "relu2": RELU2.value}

_INV_SQRT2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_TANH_C = tl.constexpr(0.044715)


@triton.jit
def _tanh_gelu_parts(z):
    """``(tanh(u), du/dz)``, ``u = sqrt(2/pi) (z + 0.044715 z^3)``."""
    u = _SQRT_2_OVER_PI * (z + _GELU_TANH_C * z * z * z)
    t = 2.0 * tl.sigmoid(2.0 * u) - 1.0
    return t, _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_C * z * z)


@triton.jit
def act_base(z, ACTIVATION: tl.constexpr):
    """f(z) of every code but ``SWIGLU_CLAMPED``; ``z`` fp32."""
    if ACTIVATION == SWIGLU or ACTIVATION == SILU:  # noqa: SIM109 (no `in` on constexprs in @triton.jit)
        r = z * tl.sigmoid(z)
    elif ACTIVATION == GEGLU or ACTIVATION == GELU:  # noqa: SIM109 (no `in` on constexprs in @triton.jit)
        r = 0.5 * z * (1.0 + tl.erf(z * _INV_SQRT2))
    elif ACTIVATION == GEGLU_TANH or ACTIVATION == GELU_TANH:  # noqa: SIM109 (no `in` on constexprs in @triton.jit)
        t, _ = _tanh_gelu_parts(z)
        r = 0.5 * z * (1.0 + t)
    elif ACTIVATION == RELU2:
        r = tl.maximum(z, 0.0)
        r = r * r
    else:
        r = tl.maximum(z, 0.0)
    return r


@triton.jit
def act_base_grad(z, ACTIVATION: tl.constexpr):
    """f'(z) for :func:`act_base`; ``z`` fp32."""
    if ACTIVATION == SWIGLU or ACTIVATION == SILU:  # noqa: SIM109 (no `in` on constexprs in @triton.jit)
        s = tl.sigmoid(z)
        r = s * (1.0 + z * (1.0 - s))
    elif ACTIVATION == GEGLU or ACTIVATION == GELU:  # noqa: SIM109 (no `in` on constexprs in @triton.jit)
        r = 0.5 * (1.0 + tl.erf(z * _INV_SQRT2)) + z * tl.exp(-0.5 * z * z) * _INV_SQRT_2PI
    elif ACTIVATION == GEGLU_TANH or ACTIVATION == GELU_TANH:  # noqa: SIM109 (no `in` on constexprs in @triton.jit)
        t, du = _tanh_gelu_parts(z)
        r = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * du
    elif ACTIVATION == RELU2:
        r = 2.0 * tl.maximum(z, 0.0)
    else:
        r = tl.where(z > 0.0, 1.0, 0.0)
    return r


@triton.jit
def act_forward(gate, up, alpha, limit, ACTIVATION: tl.constexpr):
    """``act = f(gate) * up`` (gated codes) or ``f(gate)`` (``up`` ignored); fp32 in, fp32 out.
    ``alpha``, ``limit``: parameters of ``SWIGLU_CLAMPED`` (unused otherwise)."""
    if ACTIVATION == SWIGLU_CLAMPED:
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        r = (u + 1.0) * g * tl.sigmoid(alpha * g)
    elif ACTIVATION < FIRST_NON_GATED:
        r = act_base(gate, ACTIVATION) * up
    else:
        r = act_base(gate, ACTIVATION)
    return r


@triton.jit
def act_backward(dact, gate, up, alpha, limit, ACTIVATION: tl.constexpr):
    """``(dgate, dup)`` from ``dact``; for non-gated codes ``dup`` is a dummy (zeros). fp32.
    Clamps pass the gradient where their input lies inside the bounds (as ``torch.clamp``'s backward)."""
    if ACTIVATION == SWIGLU_CLAMPED:
        g = tl.minimum(gate, limit)
        s = tl.sigmoid(alpha * g)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        dgate = tl.where(gate <= limit, dact * (u + 1.0) * s * (1.0 + alpha * g * (1.0 - s)), 0.0)
        dup = tl.where((up >= -limit) & (up <= limit), dact * g * s, 0.0)
    elif ACTIVATION < FIRST_NON_GATED:
        dgate = dact * up * act_base_grad(gate, ACTIVATION)
        dup = dact * act_base(gate, ACTIVATION)
    else:
        dgate = dact * act_base_grad(gate, ACTIVATION)
        dup = tl.zeros_like(dact)
    return dgate, dup
