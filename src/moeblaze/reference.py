"""Deliberately plain reference of the routed experts (DESIGN.md §2, §7): a per-expert Python loop.

Run it in float64 (``moe_experts_reference(*[t.double() for t in ...])``) and differentiate it with
autograd to get reference gradients. It shares no code with the backends: the activations are
written out again here (through ``torch.nn.functional`` where torch has them, GPT-OSS's clamped
SwiGLU as transformers writes it) so that a bug in one cannot hide in the other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .activations import ACTIVATIONS


def act_reference(name: str, pre: torch.Tensor, alpha: float = 1.702, limit: float = 7.0,
                  interleaved: bool = False) -> torch.Tensor:
    """The activation ``name`` of ``pre`` (``[..., 2h]`` gated, gate/up blocks or alternating columns)."""
    f = {
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
        "relu": torch.relu,
        "relu2": lambda z: torch.relu(z) ** 2,
    }
    gated = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh"}
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {name!r}")
    if name not in gated and name != "swiglu_clamped":
        return f[name](pre)
    gate, up = (pre[..., 0::2], pre[..., 1::2]) if interleaved else pre.chunk(2, dim=-1)
    if name == "swiglu_clamped":  # GPT-OSS (transformers' GptOssExperts._apply_gate)
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return f[gated[name]](gate) * up


def moe_experts_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          w_gate_up: torch.Tensor, w_down: torch.Tensor,
                          activation: str = "swiglu", *, b_gate_up: torch.Tensor | None = None,
                          b_down: torch.Tensor | None = None, gate_up_interleaved: bool = False,
                          swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> torch.Tensor:
    """``out[t] = sum_k w[t,k] * (f(x[t] W1[e]^T + b1[e]) W2[e]^T + b2[e])``, one expert at a time.

    Ids ``>= E`` (experts of other ranks) are skipped: they add nothing.

    Args:
        x: ``[T, d]``; topk_ids: ``[T, K]`` int; topk_weights: ``[T, K]``;
        w_gate_up: ``[E, 2h, d]`` (gated) or ``[E, h, d]``; w_down: ``[E, d, h]``.
        activation: a name of :data:`moeblaze.activations.ACTIVATIONS`.
        b_gate_up: ``[E, 2h | h]`` or None; b_down: ``[E, d]`` or None.
        gate_up_interleaved: rows of ``w_gate_up`` alternate gate, up.
        swiglu_alpha, swiglu_limit: parameters of ``swiglu_clamped``.

    Returns:
        ``[T, d]`` in the dtype of ``x`` (computation in that dtype: pass float64 for a reference).

    Raises:
        TypeError: ``topk_ids`` not an integer tensor. ValueError: shapes not as above, a negative id, an unknown
            ``activation``.
    """
    _check_reference_args(x, topk_ids, topk_weights, w_gate_up, w_down, activation)
    out = torch.zeros_like(x)
    for e in range(w_down.shape[0]):
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        pre = x[tok] @ w_gate_up[e].t()
        if b_gate_up is not None:
            pre = pre + b_gate_up[e]
        y = act_reference(activation, pre, swiglu_alpha, swiglu_limit, gate_up_interleaved) @ w_down[e].t()
        if b_down is not None:
            y = y + b_down[e]
        out = out.index_add(0, tok, y * topk_weights[tok, slot].to(x.dtype)[:, None])
    return out


def _check_reference_args(x, topk_ids, topk_weights, w_gate_up, w_down, activation: str) -> None:
    """The argument checks of :func:`moe_experts_reference` (its docstring's Raises)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
        raise TypeError(f"topk_ids must be an integer tensor of expert ids, got {topk_ids.dtype}")
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [T, d] and topk_ids [T, K], got {tuple(x.shape)} and {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, "
                         f"got {tuple(topk_weights.shape)}")
    E, d = w_down.shape[0], x.shape[1]
    if w_gate_up.dim() != 3 or w_down.dim() != 3 or w_gate_up.shape[0] != E or w_gate_up.shape[2] != d \
            or w_down.shape[1] != d or w_gate_up.shape[1] not in (w_down.shape[2], 2 * w_down.shape[2]):
        raise ValueError(f"w_gate_up must be [E, 2h|h, d] and w_down [E, d, h] with d = {d}, got "
                         f"{tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")
    if topk_ids.numel() and int(topk_ids.min()) < 0:
        raise ValueError(f"topk_ids must hold expert ids >= 0 (ids >= E = {E}, other ranks' experts, add nothing), "
                         f"got {int(topk_ids.min())}")
