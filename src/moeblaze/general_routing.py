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
the combines: ``out[t] = sum_{p of t} w_p y[slot(p)]`` in pair order. A top-k routing written as pairs
(``token_idx = arange(T).repeat_interleave(K)``, ``expert_idx = topk_ids.flatten()``) gives the same slots
and the same sums in the same order: bitwise the top-k result.
"""

from __future__ import annotations

import torch

from . import settings
from .activations import SWIGLU_ALPHA, SWIGLU_LIMIT, check_activation
from .dispatch import DispatchIndex, build_dispatch, with_schedule
from .experts import SAVE_MODES, _check_options, _check_weight_shapes, autocast_expert_operands, run_experts
from .ops_torch import ActArgs

__all__ = ["build_dispatch_pairs", "check_pairs", "moe_experts_general", "topk_to_pairs"]

_INT_DTYPES = (torch.int32, torch.int64)


def topk_to_pairs(topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A top-k routing as pairs: ``(token_idx [T*K] int32, expert_idx [T*K] int32, pair_weights [T*K])``."""
    T, K = topk_ids.shape
    token_idx = torch.arange(T, dtype=torch.int32, device=topk_ids.device).repeat_interleave(K)
    return token_idx, topk_ids.reshape(-1).to(torch.int32), topk_weights.reshape(-1)


def check_pairs(token_idx: torch.Tensor, expert_idx: torch.Tensor, num_tokens: int, num_experts: int,
                pair_weights: torch.Tensor | None = None, check_range: bool = True,
                foreign_experts: bool = False) -> None:
    """Validate general routing inputs before any kernel sees them.

    Args:
        token_idx: ``[P]`` int32/int64 token of each pair, ascending, in ``[0, T)``.
        expert_idx: ``[P]`` int32/int64 expert of each pair, in ``[0, E)`` (``>= E`` with ``foreign_experts``).
        num_tokens: T >= 0. num_experts: E >= 1.
        pair_weights: ``[P]`` float, or None (not checked).
        check_range: also check the ranges and the order (one host synchronisation); skipped when
            ``MOEBLAZE_CHECK_IDS=0``, as :func:`moeblaze.build_dispatch`'s check.

    Raises:
        TypeError: non-integer ids, non-float weights.
        ValueError: wrong ranks or lengths, T or E out of range, ids out of range, ``token_idx`` not ascending.
    """
    for name, t in (("token_idx", token_idx), ("expert_idx", expert_idx)):
        if not isinstance(t, torch.Tensor) or t.dtype not in _INT_DTYPES:
            raise TypeError(f"{name} must be an int32/int64 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() != 1:
            raise ValueError(f"{name} must have shape [P] (rank 1), got {tuple(t.shape)}")
    P = token_idx.numel()
    if expert_idx.numel() != P:
        raise ValueError(f"expert_idx must have shape [P={P}] (the length of token_idx), got {tuple(expert_idx.shape)}")
    bad_weights = not isinstance(pair_weights, torch.Tensor) or not pair_weights.is_floating_point()
    if pair_weights is not None and bad_weights:
        raise TypeError(f"pair_weights must be a float tensor, got {getattr(pair_weights, 'dtype', pair_weights)}")
    if pair_weights is not None and tuple(pair_weights.shape) != (P,):
        raise ValueError(f"pair_weights must have shape [P={P}] (the length of token_idx), "
                         f"got {tuple(pair_weights.shape)}")
    if not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if P >= 2**31:
        raise ValueError(f"{P} pairs; the int32 index holds fewer than 2^31")
    if not check_range or P == 0 or not settings.get("check_ids"):
        return
    t_lo, t_hi = (int(v) for v in torch.aminmax(token_idx))
    if t_lo < 0 or t_hi >= num_tokens:
        raise ValueError(f"token_idx holds tokens in [{t_lo}, {t_hi}]; expected tokens in [0, {num_tokens})")
    if P > 1 and bool((token_idx[1:] < token_idx[:-1]).any()):
        raise ValueError("token_idx must be ascending (sorted by token, so each token's pairs are contiguous)")
    e_lo, e_hi = (int(v) for v in torch.aminmax(expert_idx))
    if e_lo < 0 or (e_hi >= num_experts and not foreign_experts):
        raise ValueError(f"expert_idx holds expert ids in [{e_lo}, {e_hi}]; expected ids in [0, {num_experts})")


def build_dispatch_pairs(token_idx: torch.Tensor, expert_idx: torch.Tensor, num_tokens: int, num_experts: int,
                         validate: bool = True, block_m: int | None = None,
                         foreign_experts: bool = False) -> DispatchIndex:
    """The dispatch index of general routing inputs (contract: this module's docstring; DESIGN.md §3).

    Same passes as :func:`moeblaze.build_dispatch` (Triton on CUDA, no sort, no atomics, no host
    synchronisation without ``validate``), plus two gathers: slot -> token and the ``[T+1]`` CSR.

    Args:
        token_idx: ``[P]`` int32/int64 ascending tokens. expert_idx: ``[P]`` int32/int64 experts.
        num_tokens: T (tokens without pairs are allowed: they get zero output).
        num_experts: E.
        validate: check ranges and order (see :func:`check_pairs`).
        block_m: also attach the grouped-GEMM tile schedule for M-tiles of ``block_m`` slots.
        foreign_experts: ids ``>= E`` are skipped (an extra last bucket, as ``build_dispatch``'s); token
            rounding marks its unused candidate pairs this way so that P stays static.

    Returns:
        :class:`DispatchIndex` with ``token_expert_indices [P]``, ``token_index_map [P]``,
        ``expert_token_indices [P]`` (slot -> token) and ``pair_offsets [T+1]``, all int32.

    Raises:
        TypeError, ValueError: see :func:`check_pairs`; ``block_m`` not a positive int.
    """
    check_pairs(token_idx, expert_idx, num_tokens, num_experts, check_range=validate, foreign_experts=foreign_experts)
    P = expert_idx.numel()
    if P == 0:  # no pairs: an index of zero slots (build_dispatch needs K >= 1 columns)
        dev = expert_idx.device
        base = DispatchIndex(torch.zeros(num_experts + 1 + foreign_experts, dtype=torch.int32, device=dev),
                             *(torch.zeros(0, dtype=torch.int32, device=dev) for _ in range(3)), num_experts,
                             foreign_experts=foreign_experts)
    else:
        base = build_dispatch(expert_idx.view(P, 1), num_experts, validate=False, block_m=block_m,
                              foreign_experts=foreign_experts)
    tok = token_idx.to(torch.int32)
    indices = tok.index_select(0, base.expert_token_indices.long())  # slot -> pair -> token
    bounds = torch.arange(num_tokens + 1, dtype=torch.int32, device=tok.device)
    pair_offsets = torch.searchsorted(tok, bounds, out_int32=True)  # first pair of each token (tok ascends)
    index = DispatchIndex(base.expert_token_offsets, indices, base.token_expert_indices.view(P),
                          base.token_index_map.view(P), num_experts, base.schedule, foreign_experts,
                          pair_offsets=pair_offsets)
    return index if block_m is None or index.schedule is not None else with_schedule(index, block_m)


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

    Returns:
        ``[T, d]`` in ``x.dtype`` (the autocast dtype under ``torch.autocast``).

    Raises:
        TypeError, ValueError: as :func:`moeblaze.moe_experts` and :func:`check_pairs`; an index of another
            E, T or P.
    """
    x, w_gate_up, w_down, b_gate_up, b_down = autocast_expert_operands(x, w_gate_up, w_down, b_gate_up, b_down)
    check_activation(activation)
    if save not in SAVE_MODES:
        raise ValueError(f"save must be one of {SAVE_MODES}, got {save!r}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 2:
        raise ValueError(f"x must be a floating-point tensor of shape [T, d], got {getattr(x, 'shape', x)}")
    if w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"w_gate_up and w_down must be rank 3, got {tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")
    _check_weight_shapes(x, w_gate_up, w_down, activation)
    _check_options(x, w_down, activation, b_gate_up, b_down, gate_up_interleaved, swiglu_alpha, swiglu_limit,
                   foreign_experts, index)
    for name, t in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if t.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}; expected x's dtype {x.dtype}")
    for name, t in (("token_idx", token_idx), ("expert_idx", expert_idx), ("pair_weights", pair_weights),
                    ("w_gate_up", w_gate_up), ("w_down", w_down)):
        if isinstance(t, torch.Tensor) and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}; expected x's device {x.device}")
    T, E = x.shape[0], w_down.shape[0]
    check_pairs(token_idx, expert_idx, T, E, pair_weights, check_range=index is None, foreign_experts=foreign_experts)
    if index is None:
        index = build_dispatch_pairs(token_idx, expert_idx, T, E, validate=False, foreign_experts=foreign_experts)
    elif (not index.is_general or index.num_experts != E or index.num_tokens != T
          or index.num_pairs != token_idx.numel()):
        raise ValueError(f"index must be a build_dispatch_pairs index for E={E}, T={T}, P={token_idx.numel()}")
    act_args = ActArgs(float(swiglu_alpha), float(swiglu_limit), bool(gate_up_interleaved))
    return run_experts(x, pair_weights, w_gate_up, w_down, b_gate_up, b_down, index, activation, save, backend,
                       act_args)
