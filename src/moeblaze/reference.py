"""Deliberately plain reference of the routed experts (DESIGN.md §2, §7): a per-expert Python loop.

Run it in float64 (``moe_experts_reference(*[t.double() for t in ...])``) and differentiate it with
autograd to get reference gradients. It shares no code with the backends except the definition of
the activations, written out again here so that a bug in one cannot hide in the other.
"""

from __future__ import annotations

import math

import torch


def act_reference(name: str, pre: torch.Tensor) -> torch.Tensor:
    f = {
        "silu": lambda z: z * torch.sigmoid(z),
        "gelu": lambda z: 0.5 * z * (1.0 + torch.erf(z / math.sqrt(2.0))),
        "relu": torch.relu,
    }
    if name in ("swiglu", "geglu"):
        gate, up = pre.chunk(2, dim=-1)
        return f["silu" if name == "swiglu" else "gelu"](gate) * up
    return f[name](pre)


def moe_experts_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          w_gate_up: torch.Tensor, w_down: torch.Tensor,
                          activation: str = "swiglu") -> torch.Tensor:
    """``out[t] = sum_k w[t,k] * (f(x[t] W1[e]^T) W2[e]^T)``, one expert at a time.

    Args:
        x: ``[T, d]``; topk_ids: ``[T, K]`` int; topk_weights: ``[T, K]``;
        w_gate_up: ``[E, 2h, d]`` (gated) or ``[E, h, d]``; w_down: ``[E, d, h]``.
        activation: ``swiglu``, ``geglu``, ``silu``, ``gelu`` or ``relu``.

    Returns:
        ``[T, d]`` in the dtype of ``x`` (computation in that dtype: pass float64 for a reference).
    """
    out = torch.zeros_like(x)
    for e in range(w_down.shape[0]):
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        y = act_reference(activation, x[tok] @ w_gate_up[e].t()) @ w_down[e].t()
        out = out.index_add(0, tok, y * topk_weights[tok, slot].to(x.dtype)[:, None])
    return out
