"""PyTorch ops over slots that both expert backends call (DESIGN.md §3, §5): O(N) glue around the GEMMs.

``slot_weights`` scatters the router weights to slots through the pair->slot map (the scale of the F2
epilogue and of B1); ``bias_dot`` is the down bias's share of ``dtopk_weights`` (B2 with ``b_down``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .activations import acc

__all__ = ["bias_dot", "slot_weights"]


def slot_weights(topk_weights: torch.Tensor, token_index_map: torch.Tensor,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """``w_slot [N]``: the router weight of each slot (scatter through the pair->slot permutation).

    Args:
        topk_weights: ``[T, K]`` float; token_index_map: ``[T, K]`` int32 pair -> slot.
        dtype: of the result (default: ``topk_weights.dtype``).
    """
    w = torch.empty(token_index_map.numel(), dtype=dtype or topk_weights.dtype, device=topk_weights.device)
    w[token_index_map.reshape(-1).long()] = topk_weights.reshape(-1).to(w.dtype)
    return w


def bias_dot(dout: Tensor, b2: Tensor, token_expert_indices: Tensor, tokens: Tensor | None = None) -> Tensor:
    """``[T, K]`` fp32 ``<dout[t], b2[e]>`` for every pair (0 for a foreign id ``e >= E``): the down bias's
    share of ``dtopk_weights``, from one ``[T, d] x [d, E]`` product (T*E*d FLOPs, E/(6*K*h) of the layer's).
    General routing: ``token_expert_indices [P]`` with the pairs' ``tokens [P]`` -> ``[P]``."""
    E = b2.shape[0]
    scores = acc(dout) @ acc(b2).t()  # [T, E]
    ids = token_expert_indices.long()
    if tokens is not None:
        dots = scores[tokens.long(), ids.clamp(max=E - 1)]
    else:
        dots = scores.gather(1, ids.clamp(max=E - 1))
    return torch.where(ids < E, dots, 0.0)
