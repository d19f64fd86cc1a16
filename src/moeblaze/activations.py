"""Expert activations and their derivatives, in PyTorch (DESIGN.md §2).

Gated activations read the pre-activation ``pre [N, 2h]`` as ``gate = pre[:, :h]``, ``up = pre[:, h:]``
(or, with ``interleaved=True``, ``gate = pre[:, 0::2]``, ``up = pre[:, 1::2]``: GPT-OSS's layout) and
give ``act = f(gate) * up``; non-gated ones read ``pre [N, h]`` and give ``act = f(pre)``.
The derivative functions are what the recompute backward uses: it keeps ``pre`` (or recomputes it)
and never stores ``act``.

Gated: ``swiglu`` (SiLU), ``geglu`` (exact erf GELU), ``geglu_tanh`` (tanh-approximate GELU, transformers'
``gelu_pytorch_tanh``), ``swiglu_clamped`` (GPT-OSS: ``g = min(gate, limit)``, ``u = clamp(up, -limit,
limit)``, ``act = (u + 1) * g * sigmoid(alpha * g)``). Non-gated: ``silu``, ``gelu``, ``gelu_tanh``,
``relu``, ``relu2`` (squared ReLU, Nemotron-H).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

GATED = ("swiglu", "geglu", "geglu_tanh", "swiglu_clamped")
NON_GATED = ("silu", "gelu", "gelu_tanh", "relu", "relu2")
ACTIVATIONS = GATED + NON_GATED
SWIGLU_ALPHA = 1.702  # GPT-OSS's defaults of swiglu_clamped
SWIGLU_LIMIT = 7.0

_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_C = 0.044715


def check_activation(activation: str) -> None:
    """Raise ``ValueError`` unless ``activation`` is one of :data:`ACTIVATIONS`."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def is_gated(activation: str) -> bool:
    """True for activations whose up-projection is ``[2h, d]`` (gate rows, then up rows)."""
    check_activation(activation)
    return activation in GATED


class ActArgs(NamedTuple):
    """Parameters of an activation beyond its name: ``swiglu_clamped``'s ``alpha`` and ``limit`` (runtime
    floats) and whether a gated ``pre`` alternates gate and up columns (``interleaved``)."""

    alpha: float = SWIGLU_ALPHA
    limit: float = SWIGLU_LIMIT
    interleaved: bool = False


DEFAULT_ACT = ActArgs()


def acc(t: torch.Tensor) -> torch.Tensor:
    """Upcast to at least fp32 (fp64 stays fp64, so the float64 reference path stays exact)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _gelu_tanh_parts(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tanh(u), du/dz)`` with ``u = sqrt(2/pi) (z + 0.044715 z^3)``."""
    t = torch.tanh(_SQRT_2_OVER_PI * (z + _GELU_TANH_C * z * z * z))
    return t, _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_C * z * z)


def _base(name: str, z: torch.Tensor) -> torch.Tensor:
    if name in ("swiglu", "silu"):
        return z * torch.sigmoid(z)
    if name in ("geglu", "gelu"):
        return 0.5 * z * (1.0 + torch.erf(z * _INV_SQRT2))  # exact (erf) GELU, as torch's default
    if name in ("geglu_tanh", "gelu_tanh"):
        return 0.5 * z * (1.0 + _gelu_tanh_parts(z)[0])
    if name == "relu2":
        return torch.relu(z).square()
    return torch.relu(z)


def _base_grad(name: str, z: torch.Tensor) -> torch.Tensor:
    if name in ("swiglu", "silu"):
        s = torch.sigmoid(z)
        return s * (1.0 + z * (1.0 - s))
    if name in ("geglu", "gelu"):
        return 0.5 * (1.0 + torch.erf(z * _INV_SQRT2)) + z * torch.exp(-0.5 * z * z) * _INV_SQRT_2PI
    if name in ("geglu_tanh", "gelu_tanh"):
        t, du = _gelu_tanh_parts(z)
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * du
    if name == "relu2":
        return 2.0 * torch.relu(z)
    return (z > 0).to(z.dtype)


def _split(p: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate, up)`` views of a gated pre-activation (blocks, or alternating columns)."""
    if interleaved:
        return p[..., 0::2], p[..., 1::2]
    h = p.shape[-1] // 2
    return p[..., :h], p[..., h:]


def _join(dgate: torch.Tensor, dup: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Inverse of :func:`_split`."""
    if interleaved:
        return torch.stack([dgate, dup], dim=-1).flatten(-2)
    return torch.cat([dgate, dup], dim=-1)


def activation_forward(pre: torch.Tensor, activation: str, *, alpha: float = SWIGLU_ALPHA,
                       limit: float = SWIGLU_LIMIT, interleaved: bool = False) -> torch.Tensor:
    """``act [N, h]`` from ``pre [N, 2h]`` (gated) or ``[N, h]``; math in fp32, result in ``pre.dtype``.

    ``alpha``/``limit``: parameters of ``swiglu_clamped``; ``interleaved``: gated ``pre`` alternates
    gate and up columns.
    """
    p = acc(pre)
    if activation == "swiglu_clamped":
        gate, up = _split(p, interleaved)
        g = gate.clamp(max=limit)
        out = (up.clamp(-limit, limit) + 1.0) * g * torch.sigmoid(alpha * g)
    elif activation in GATED:
        gate, up = _split(p, interleaved)
        out = _base(activation, gate) * up
    else:
        out = _base(activation, p)
    return out.to(pre.dtype)


def activation_backward(dact: torch.Tensor, pre: torch.Tensor, activation: str, *, alpha: float = SWIGLU_ALPHA,
                        limit: float = SWIGLU_LIMIT, interleaved: bool = False) -> torch.Tensor:
    """``dpre`` (shape, layout and dtype of ``pre``) from ``dact [N, h]``; math in fp32."""
    p, g = acc(pre), acc(dact)
    if activation == "swiglu_clamped":
        gate, up = _split(p, interleaved)
        c = gate.clamp(max=limit)
        s = torch.sigmoid(alpha * c)
        # clamp passes the gradient where the input is inside the bounds, as torch.clamp's backward
        dgate = g * (up.clamp(-limit, limit) + 1.0) * s * (1.0 + alpha * c * (1.0 - s)) * (gate <= limit)
        dup = g * c * s * ((up >= -limit) & (up <= limit))
        dpre = _join(dgate, dup, interleaved)
    elif activation in GATED:
        gate, up = _split(p, interleaved)
        dpre = _join(g * up * _base_grad(activation, gate), g * _base(activation, gate), interleaved)
    else:
        dpre = g * _base_grad(activation, p)
    return dpre.to(pre.dtype)
