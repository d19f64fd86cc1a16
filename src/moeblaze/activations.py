"""Expert activations and their derivatives, in PyTorch (DESIGN.md §2).

Gated activations read the pre-activation ``pre [N, 2h]`` as ``gate = pre[:, :h]``, ``up = pre[:, h:]``
and give ``act = f(gate) * up``; non-gated ones read ``pre [N, h]`` and give ``act = f(pre)``.
The derivative functions are what the recompute backward uses: it keeps ``pre`` (or recomputes it)
and never stores ``act``.
"""

from __future__ import annotations

import math

import torch

GATED = ("swiglu", "geglu")
NON_GATED = ("silu", "gelu", "relu")
ACTIVATIONS = GATED + NON_GATED

_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def check_activation(activation: str) -> None:
    """Raise ``ValueError`` unless ``activation`` is one of :data:`ACTIVATIONS`."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def is_gated(activation: str) -> bool:
    """True for activations whose up-projection is ``[2h, d]`` (gate rows, then up rows)."""
    check_activation(activation)
    return activation in GATED


def acc(t: torch.Tensor) -> torch.Tensor:
    """Upcast to at least fp32 (fp64 stays fp64, so the float64 reference path stays exact)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _base(name: str, z: torch.Tensor) -> torch.Tensor:
    if name in ("swiglu", "silu"):
        return z * torch.sigmoid(z)
    if name in ("geglu", "gelu"):
        return 0.5 * z * (1.0 + torch.erf(z * _INV_SQRT2))  # exact (erf) GELU, as torch's default
    return torch.relu(z)


def _base_grad(name: str, z: torch.Tensor) -> torch.Tensor:
    if name in ("swiglu", "silu"):
        s = torch.sigmoid(z)
        return s * (1.0 + z * (1.0 - s))
    if name in ("geglu", "gelu"):
        return 0.5 * (1.0 + torch.erf(z * _INV_SQRT2)) + z * torch.exp(-0.5 * z * z) * _INV_SQRT_2PI
    return (z > 0).to(z.dtype)


def activation_forward(pre: torch.Tensor, activation: str) -> torch.Tensor:
    """``act [N, h]`` from ``pre [N, 2h]`` (gated) or ``[N, h]``; math in fp32, result in ``pre.dtype``."""
    p = acc(pre)
    if activation in GATED:
        h = pre.shape[-1] // 2
        out = _base(activation, p[..., :h]) * p[..., h:]
    else:
        out = _base(activation, p)
    return out.to(pre.dtype)


def activation_backward(dact: torch.Tensor, pre: torch.Tensor, activation: str) -> torch.Tensor:
    """``dpre`` (shape and dtype of ``pre``) from ``dact [N, h]``; math in fp32."""
    p, g = acc(pre), acc(dact)
    if activation in GATED:
        h = pre.shape[-1] // 2
        gate, up = p[..., :h], p[..., h:]
        dpre = torch.cat([g * up * _base_grad(activation, gate), g * _base(activation, gate)], dim=-1)
    else:
        dpre = g * _base_grad(activation, p)
    return dpre.to(pre.dtype)
