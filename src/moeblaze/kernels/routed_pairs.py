"""The fused softmax top-k router and token rounding's selections and pair list as one custom op: the forward of
:func:`moeblaze.token_rounding.route_rounded` (issue 25; SonicMoE §5 Alg. 4).

Up to 256 experts (:func:`moeblaze.kernels.router.keys_fuse`) the router's top-k kernel writes token rounding's
keys from the tile it holds (``ROUND_KEYS``): the keys kernel's read of the ``[T, E]`` scores, ids and weights and
its launch are gone, for 1 MB more stores at T 16384, E 128. The select kernel writes its drops into the router's
copy of the ids in place, so the three launchers run inside one op, which torch.compile sees whole.
"""

from __future__ import annotations

import torch

from .custom_ops import call_op
from .pair_list import place_launch
from .rounding import MAX_TOKENS, MODES, select_launch
from .router import check_logits, keys_fuse, router_launch


def _routed_pairs_impl(logits: torch.Tensor, top_k: int, renormalize: bool, scale: float, aux_c: float, z_c: float,
                       tile: int, mode: str, J: int, max_n: int,
                       rand: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    fuse = keys_fuse(logits.shape[1])
    ids, weights, probs, lse, counts, aux, z, kept, bmax = router_launch(logits, top_k, renormalize, scale, aux_c,
                                                                         z_c, round_keys=fuse)
    kept, pad_mask, pad_tok, target = select_launch(probs, ids, weights, counts, rand, tile, mode, J, max_n,
                                                    (kept, bmax) if fuse else None)
    token_idx, expert_idx, w, pair_offsets = place_launch(kept, pad_mask, pad_tok, weights, probs, scale)
    return ids, weights, probs, lse, counts, aux, z, token_idx, expert_idx, w, pair_offsets, target


_routed_pairs_op = torch.library.custom_op(
    "moeblaze::routed_pairs", _routed_pairs_impl, mutates_args=(),
    schema="(Tensor logits, int top_k, bool renormalize, float scale, float aux_c, float z_c, int tile, str mode, "
           "int J, int max_n, Tensor? rand) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
           "Tensor, Tensor, Tensor, Tensor)")


@_routed_pairs_op.register_fake
def _(logits, top_k, renormalize, scale, aux_c, z_c, tile, mode, J, max_n, rand):
    T, E = logits.shape
    P = T * top_k + J * E
    i32, f32 = dict(dtype=torch.int32), dict(dtype=torch.float32)
    return (logits.new_empty(T, top_k, **i32), logits.new_empty(T, top_k, **f32), logits.new_empty(T, E, **f32),
            logits.new_empty(T, **f32), logits.new_empty(E, **f32), logits.new_empty((), **f32),
            logits.new_empty((), **f32), logits.new_empty(P, **i32), logits.new_empty(P, **i32),
            logits.new_empty(P, **f32), logits.new_empty(T + 1, **i32), logits.new_empty(E, **i32))


def routed_pairs(logits: torch.Tensor, top_k: int, renormalize: bool, scale: float, aux_c: float, z_c: float,
                 tile: int, mode: str, J: int, rand: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """:func:`moeblaze.kernels.router.router_topk` followed by token rounding's selections
    (:func:`moeblaze.kernels.rounding.rounding_select` with ``max_n = tile - 1``) and pair list
    (:func:`moeblaze.kernels.pair_list.rounding_place`), bitwise their results, in one op (module docstring).

    Args:
        logits: ``[T, E]`` fp32 router logits, unit column stride, ``T <= MAX_TOKENS``. top_k, renormalize, scale,
            aux_c, z_c: :func:`~moeblaze.kernels.router.router_topk`'s. tile: the M tile >= 1. mode: one of
            :data:`~moeblaze.kernels.rounding.MODES`. J: pad candidates per expert (the most one expert pads).
            rand: ``[E]`` fp32 uniform draws of ``"sr"``, else None.

    Returns:
        ``(ids, weights, probs, lse, counts, aux, z)`` as ``router_topk`` returns them, then ``(token_idx [P],
        expert_idx [P], w [P] fp32, pair_offsets [T+1], target [E])`` as ``rounding_place`` and
        ``rounding_select`` return them (``P = T*K + J*E``).

    Raises:
        ValueError: ``router_topk``'s errors, T above ``MAX_TOKENS``, an unknown mode, ``tile < 1``, ``J < 0``,
            ``rand`` not ``[E]`` fp32 for ``"sr"`` or given for another mode.
    """
    check_logits(logits, top_k, "routed_pairs")
    T, E = logits.shape
    if T > MAX_TOKENS or mode not in MODES or tile < 1 or J < 0:
        raise ValueError(f"routed_pairs: need T <= {MAX_TOKENS}, mode in {MODES}, tile >= 1 and J >= 0, got T={T}, "
                         f"{mode!r}, {tile} and {J}")
    if (mode == "sr") != (rand is not None) or (rand is not None and (rand.shape != (E,) or
                                                                      rand.dtype != torch.float32)):
        raise ValueError(f"routed_pairs: rand must be [E={E}] fp32 for mode 'sr' and None otherwise, got "
                         f"{None if rand is None else (tuple(rand.shape), rand.dtype)} for {mode!r}")
    return call_op(_routed_pairs_op, _routed_pairs_impl, logits, top_k, renormalize, float(scale), float(aux_c),
                   float(z_c), int(tile), mode, int(J), int(tile) - 1, rand)
