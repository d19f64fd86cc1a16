"""General routing inputs: the routed experts over any list of (token, expert, weight) pairs.

Token choice gives every token K experts (``topk_ids [T, K]``). Other routings do not: token rounding
(:mod:`moeblaze.token_rounding`) drops and adds pairs, expert choice gives a token 0 to E experts, and
expert parallelism receives a varying number of tokens per expert. As SonicMoE's
``moe_general_routing_inputs`` (arXiv 2512.14080), they are passed as a flat list of P pairs:
``token_idx [P]`` (ascending), ``expert_idx [P]`` and ``pair_weights [P]``.

The index contract of :mod:`moeblaze.dispatch` generalises with pairs as slots: the build runs the same
count / scan / write passes over ``expert_idx`` viewed as a ``[P, 1]`` routing (no sort, no atomics), so
``expert_token_offsets [E+1]`` and ``token_index_map [P]`` (pair -> slot) are those of that routing, and
``expert_token_indices [P]`` maps each slot to ``token_idx`` of its pair. ``pair_offsets [T+1]`` (a CSR:
pairs of token t are ``pair_offsets[t]:pair_offsets[t+1]``, contiguous since ``token_idx`` ascends) drives
the combines: ``out[t] = sum_{p of t} w_p y[slot(p)]`` in pair order (a tail of foreign pairs past
``pair_offsets[T]``, as token rounding's unused ones, is in no token's sum). A top-k routing written as pairs
(``token_idx = arange(T).repeat_interleave(K)``, ``expert_idx = topk_ids.flatten()``) gives the same slots
and the same sums in the same order: bitwise the top-k result.
"""

from __future__ import annotations

import torch

from .activations import SWIGLU_ALPHA, SWIGLU_LIMIT, ActArgs, check_activation
from .backends import get_backend
from .dispatch import DispatchIndex, build_dispatch_pairs, check_pairs
from .expert_checks import SAVE_MODES, check_devices, check_options, check_weight_dtypes, check_weight_shapes
from .experts import autocast_expert_operands, run_experts
from .fp8 import Float8Recipe, check_fp8_recipe
from .input_grad import SharedInputGrad

__all__ = ["build_dispatch_pairs", "check_pairs", "moe_experts_general", "topk_to_pairs"]


def topk_to_pairs(topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A top-k routing as pairs: ``(token_idx [T*K] int32, expert_idx [T*K] int32, pair_weights [T*K])``."""
    T, K = topk_ids.shape
    token_idx = torch.arange(T, dtype=torch.int32, device=topk_ids.device).repeat_interleave(K)
    return token_idx, topk_ids.reshape(-1).to(torch.int32), topk_weights.reshape(-1)


def moe_experts_general(
    x: torch.Tensor,
    token_idx: torch.Tensor,
    expert_idx: torch.Tensor,
    pair_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str = "swiglu",
    save: str = "preact",
    backend: str = "auto",
    index: DispatchIndex | None = None,
    *,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    gate_up_interleaved: bool = False,
    swiglu_alpha: float = SWIGLU_ALPHA,
    swiglu_limit: float = SWIGLU_LIMIT,
    foreign_experts: bool = False,
    input_grad: SharedInputGrad | None = None,
    fp8: Float8Recipe | None = None,
) -> torch.Tensor:
    """Routed experts over general routing inputs: ``out[t] = sum_{p: token_idx[p] = t} w_p FFN_{e_p}(x[t])``.

    The fused kernels and autograd of :func:`moeblaze.moe_experts` (MoEBlaze §4) over the pair index
    (this module's docstring). A token with no pairs gets a zero output and a zero gradient.

    Args:
        x: ``[T, d]``. token_idx: ``[P]`` int32/int64, ascending, in ``[0, T)``; any number of pairs per token
            (0 to E; repeated (token, expert) pairs each count). expert_idx: ``[P]`` int32/int64 in ``[0, E)``.
        pair_weights: ``[P]`` float combine weights (gets a gradient ``[P]``).
        w_gate_up, w_down, activation, save, backend, b_gate_up, b_down, gate_up_interleaved, swiglu_alpha,
            swiglu_limit: as :func:`moeblaze.moe_experts`.
        index: a prebuilt :func:`build_dispatch_pairs` index of these pairs (built here when None).
        foreign_experts: ids ``>= E`` contribute nothing and get zero weight gradients.
        input_grad, fp8: as :func:`moeblaze.moe_experts`.

    Returns:
        ``[T, d]`` in ``x.dtype`` (the autocast dtype under ``torch.autocast``).

    Raises:
        TypeError, ValueError: as :func:`moeblaze.moe_experts` and :func:`check_pairs`; an index of another
            E, T or P.
    """
    check_fp8_recipe(fp8)
    x, w_gate_up, w_down, b_gate_up, b_down, autocast = autocast_expert_operands(x, w_gate_up, w_down, b_gate_up,
                                                                                  b_down)
    check_activation(activation)
    if save not in SAVE_MODES:
        raise ValueError(f"save must be one of {SAVE_MODES}, got {save!r}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2:
        raise ValueError(f"x must be a floating-point tensor of shape [T, d], got {getattr(x, 'shape', x)}")
    if w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"w_gate_up and w_down must be rank 3, got {tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")
    check_weight_shapes(x, w_gate_up, w_down, activation)
    check_options(x, w_down, activation, b_gate_up, b_down, gate_up_interleaved, swiglu_alpha, swiglu_limit,
                   foreign_experts, index)
    check_weight_dtypes(x, w_gate_up, w_down, autocast)
    check_devices(x, ("token_idx", token_idx), ("expert_idx", expert_idx), ("pair_weights", pair_weights),
                  ("w_gate_up", w_gate_up), ("w_down", w_down))
    T, E = x.shape[0], w_down.shape[0]
    check_pairs(token_idx, expert_idx, T, E, pair_weights, check_range=index is None, foreign_experts=foreign_experts)
    if index is not None and (not index.is_general or index.num_experts != E or index.num_tokens != T
                              or index.num_pairs != token_idx.numel()):
        raise ValueError(f"index must be a build_dispatch_pairs index for E={E}, T={T}, P={token_idx.numel()}")
    chosen = get_backend(backend, x)  # resolved once: it plans the index and runs the ops
    if index is None:
        index = chosen.plan_pairs(token_idx, expert_idx, T, E, validate=False, foreign_experts=foreign_experts)
    act_args = ActArgs(float(swiglu_alpha), float(swiglu_limit), bool(gate_up_interleaved))
    return run_experts(x, pair_weights, w_gate_up, w_down, b_gate_up, b_down, index, activation, save, chosen,
                       act_args, input_grad, fp8)
