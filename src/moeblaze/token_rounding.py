"""Token rounding (TR): top-k routing with every expert's token count a multiple of the GEMM's M tile.

SonicMoE (Guo et al., arXiv 2512.14080, §5, Alg. 4). The grouped GEMMs run each expert's slots in M-tiles
of ``tile`` rows; an expert with ``f_e`` tokens wastes the rest of its last tile (about half a tile per
expert on average). After top-k token choice, TR makes each count a multiple of the tile: expert e
either *drops* the top-k tokens of its last partial tile with the lowest top-k weights, or *pads* it
with its highest-scored tokens outside the top-k (the two orderings of Alg. 4: token choice first, then
the router's weight within each expert; as SonicMoE, top-k tokens rank by their top-k weight, the
others by their score). The target count ``r_e`` per mode, with ``f_e = q*tile + rem``:

``nr``   nearest (SonicMoE's default NR-f): ``(q+1)*tile`` when ``2*rem > tile``, else ``q*tile``
         (ties drop; SonicMoE 0.1.2's benchmark uses ``torch.round``, half to even, which pads at
         ties of odd ``q``: a tie needs ``rem == tile/2`` exactly).
``up``   ``ceil``: pad every partial tile.  ``down``: ``floor``: drop every partial tile.
``sr``   stochastic: pad with probability ``rem/tile``, else drop (unbiased in expectation; seeded).

A count never exceeds T: an expert whose padded count would pass T drops instead, so every count is
a multiple of the tile (or 0) and ``|r_e - f_e| < tile``.

Weights (documented choices, SonicMoE's reference as the model): kept top-k pairs keep the router's
top-k weights as they are (renormalised over the K chosen experts before rounding when the router
renormalises; not renormalised again after drops, as SonicMoE). Padded pairs carry the router score
``s[t, e]`` (the softmax probability or sigmoid score, times ``routed_scaling_factor``), differentiable
like the top-k weights. A token whose pairs are all dropped gets zero MoE output and zero gradient.

No host synchronisation and static shapes: the result always has ``P = T*K + J*E`` pairs with ``J``
padding candidates per expert (the most one expert may pad: ``(tile - 1) // 2`` for ``nr``); dropped
and unused pairs carry the expert id ``E`` (a foreign expert: the index puts them in its extra bucket,
no GEMM computes them, they add nothing). Pairs are in token order: per token its K top-k pairs (k
order) and its padded pairs (expert order); the unused entries follow as one tail past
``pair_offsets[T]`` (token T-1: :mod:`moeblaze.kernels.pair_list`), which the combines never visit.
Evaluation (``model.eval()``) routes with plain top-k.

Inside :class:`moeblaze.MoE`, where the fused router and the Triton selections serve, the router computes the
rounding in its own autograd node (:func:`route_rounded`): its backward reads the pair weights' gradient where it
lies, where the pair list's own backward wrote ``[T, K]`` and ``[T, E]`` gradients for the router's to read back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import settings
from .backends import BACKENDS
from .kernels import ROUNDING_MODES  # one tuple: the kernels' MODE constexpr is its index (no Triton import)
from .settings import carried_to_backward

__all__ = ["ROUNDING_MODES", "Rounding", "TokenRounding", "round_counts", "round_tokens", "round_tokens_fused",
           "route_rounded", "tile_multiple"]

_TORCH_TILE = 128  # the GPU kernels' M tile: the torch backend accepts any tile and defaults to the GPU's


def tile_multiple(backend: str = "auto", device: torch.device | str | None = None) -> int:
    """The M tile (slots per grouped-GEMM row tile) of an expert backend: what token rounding rounds to.

    ``"triton"`` (and ``"auto"`` on CUDA): the kernels' BLOCK_M (128 on the GPU, 32 under
    ``TRITON_INTERPRET=1``). ``"torch"`` (and ``"auto"`` elsewhere): any tile works; 128, the GPU's.

    Raises:
        ValueError: an unknown backend.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    cuda = device is not None and torch.device(device).type == "cuda"
    if backend == "triton" or (backend == "auto" and cuda):
        try:
            from .kernels import tuning
        except ImportError:
            return _TORCH_TILE
        return tuning.block_m()
    return _TORCH_TILE


@dataclass
class TokenRounding:
    """Rounded routing as general routing inputs (:func:`moeblaze.moe_experts_general`, ``foreign_experts=True``).

    Attributes:
        token_idx: ``[P]`` int32, ascending. expert_idx: ``[P]`` int32, E for dropped / unused pairs.
        pair_weights: ``[P]`` float combine weights (differentiable).
        counts: ``[E]`` int32 rounded token count of each expert (multiples of the tile).
        pair_offsets: ``[T+1]`` int32 first pair of each token (the CSR of :mod:`moeblaze.general_routing`;
            pass it to ``plan_pairs`` / :func:`moeblaze.build_dispatch_pairs` to skip their search);
            ``pair_offsets[T]`` is the first of the unused tail's pairs.
    """

    token_idx: torch.Tensor
    expert_idx: torch.Tensor
    pair_weights: torch.Tensor
    counts: torch.Tensor
    pair_offsets: torch.Tensor


def _draws(mode: str, E: int, generator: torch.Generator | None, device) -> torch.Tensor | None:
    """The ``[E]`` uniform draws of ``"sr"`` (as :func:`round_counts` draws them), None for the other modes."""
    return torch.rand(E, generator=generator, device=device) if mode == "sr" else None


def round_counts(counts: torch.Tensor, tile: int, mode: str = "nr", num_tokens: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Target counts ``[E]`` int32 of token rounding (rules: module docstring), on ``counts``' device.

    Args:
        counts: ``[E]`` integer top-k token counts ``f_e``. tile: M tile >= 1. mode: one of ``ROUNDING_MODES``.
        num_tokens: T, the cap (None: no cap). generator: random source of ``sr``.

    Raises:
        ValueError: unknown mode, ``tile < 1``.
    """
    _check_mode_tile(mode, tile)
    f = counts.to(torch.int32)
    rem = f % tile
    base = f - rem
    if mode == "nr":
        up = 2 * rem > tile
    elif mode == "up":
        up = rem > 0
    elif mode == "down":
        up = torch.zeros_like(rem, dtype=torch.bool)
    else:
        up = _draws(mode, f.numel(), generator, f.device) * tile < rem
    target = base + tile * up.to(torch.int32)
    if num_tokens is not None:
        target = torch.where(target > num_tokens, base, target)
    return target


def _max_pad(mode: str, tile: int, num_tokens: int) -> int:
    """Most tokens one expert may pad in ``mode``: ``nr`` pads only when ``rem > tile/2``, ``down`` never."""
    most = {"nr": (tile - 1) // 2, "down": 0}.get(mode, tile - 1)
    return min(most, num_tokens)


def _check_mode_tile(mode: str, tile: int) -> None:
    if mode not in ROUNDING_MODES:
        raise ValueError(f"token rounding mode must be one of {ROUNDING_MODES}, got {mode!r}")
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 1:
        raise ValueError(f"tile (the M tile to round to) must be a positive int, got {tile!r}")


def round_tokens(scores: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, tile: int,
                 mode: str = "nr", generator: torch.Generator | None = None,
                 scale: float = 1.0, counts: torch.Tensor | None = None) -> TokenRounding:
    """Token rounding of a top-k routing (SonicMoE §5 Alg. 4; rules and weights: module docstring).

    The selections and the pair list run as five Triton launches (:mod:`moeblaze.kernels.rounding`,
    :mod:`moeblaze.kernels.pair_list`) where the ``backend`` setting runs Triton (CUDA scores by default:
    :func:`moeblaze.settings.use_triton`) and T, K are within their limits, else as PyTorch ops; both give the
    same pairs in the same order (ties: the lower token first).

    Args:
        scores: ``[T, E]`` float router scores (softmax probabilities or sigmoid scores), differentiable.
        topk_ids: ``[T, K]`` integer top-k experts (distinct per row). topk_weights: ``[T, K]`` float.
        tile: the M tile (:func:`tile_multiple`). mode: ``"nr"``, ``"up"``, ``"down"`` or ``"sr"``.
        generator: random source of ``"sr"`` (on ``scores``' device). scale: factor of the padded pairs'
            weights (the router's ``routed_scaling_factor``). counts: ``[E]`` pairs per expert of ``topk_ids``
            (e.g. :attr:`moeblaze.RouterOutput.counts`), any numeric dtype, exact integers; None: counted here.

    Returns:
        :class:`TokenRounding` with ``P = T*K + J*E`` pairs, ``J = min(T, (tile - 1) // 2)`` for ``nr``,
        ``0`` for ``down``, ``min(T, tile - 1)`` otherwise (the most one expert pads); no host synchronisation.

    Raises:
        ValueError: unknown mode, ``tile < 1``, shapes that disagree.
    """
    _check_args(scores, topk_ids, topk_weights, tile, mode, counts)
    return _round_tokens(scores, topk_ids, topk_weights, tile, mode, generator, scale,
                         _use_kernels(scores, topk_ids, topk_weights), counts)


def _check_args(scores, topk_ids, topk_weights, tile, mode, counts=None) -> None:
    _check_mode_tile(mode, tile)
    if scores.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != scores.shape[0]:
        raise ValueError(f"scores must be [T, E] and topk_ids [T, K], got {tuple(scores.shape)} and "
                         f"{tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights must have shape {tuple(topk_ids.shape)}, got {tuple(topk_weights.shape)}")
    if counts is not None and tuple(counts.shape) != (scores.shape[1],):
        raise ValueError(f"counts must have shape ({scores.shape[1]},) (pairs per expert), got {tuple(counts.shape)}")


def _use_kernels(scores: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> bool:
    """The Triton selections serve this call (:func:`_kernels_serve`)."""
    return _kernels_serve(scores, topk_ids.shape[1], (scores.dtype, topk_weights.dtype))


def _kernels_serve(scores: torch.Tensor, K: int, dtypes: tuple[torch.dtype, ...]) -> bool:
    """The Triton selections serve ``scores [T, E]`` with K choices per token: where the ``backend`` setting runs
    Triton (:func:`moeblaze.settings.use_triton`: CUDA by default), within their limits (T, K; fp16/bf16/fp32
    scores and weights: a float64 run, the reference check, takes the PyTorch ops)."""
    if torch.float64 in dtypes or not settings.use_triton(scores):
        return False
    from .kernels import rounding  # only where the kernels could run: a CPU install needs no Triton

    return scores.shape[0] <= rounding.MAX_TOKENS and 1 <= K <= rounding.MAX_TOP_K


def _round_tokens(scores, topk_ids, topk_weights, tile, mode, generator, scale, kernels: bool,
                  counts=None) -> TokenRounding:
    (T, E), K, dev = scores.shape, topk_ids.shape[1], scores.device
    ids = topk_ids.long()
    if counts is not None:  # the router's: one histogram fewer (its contended atomics: 7-26 µs per step, T 16384)
        f = counts if kernels and counts.dtype in (torch.int32, torch.float32) else counts.to(torch.int32)
    else:
        f = torch.zeros(E, dtype=torch.int32, device=dev).scatter_add_(
            0, ids.reshape(-1), torch.ones(T * K, dtype=torch.int32, device=dev))
    J = _max_pad(mode, tile, T)
    if kernels:
        from .kernels.rounding import rounding_select

        rand = _draws(mode, E, generator, dev)
        kept, pad_mask, pad_tok, target = rounding_select(scores.detach().contiguous(), topk_ids.contiguous(),
                                                          topk_weights.detach().contiguous(), f, tile, mode, J,
                                                          tile - 1, rand)
    else:
        target = round_counts(f, tile, mode, T, generator)
        (kept, pad_mask), pad_tok = _select_torch(scores.detach(), ids, topk_weights.detach(), f, target, J), None
    token_idx, expert_idx, w, pair_offsets = _PairList.apply(topk_weights, scores, kept, pad_mask, pad_tok, J, scale,
                                                             kernels)
    return TokenRounding(token_idx, expert_idx, w, target, pair_offsets)


class _PairList(torch.autograd.Function):
    """The pair list in token order and its ``[P]`` weights (top-k pairs: their top-k weights; padded pairs:
    ``scores[t, e] * scale``; unused entries: 0), differentiable in ``topk_weights`` and ``scores``. The backward
    reads the top-k pairs' gradients at their positions ``pair_offsets[t] + k`` and writes the padded pairs' (the
    rest of each token's range) into a zero ``[T, E]``: no accumulation. Autograd's own backward of two gathers
    accumulated into one element per unused branch, serialising atomics: 71 µs per step at T 16384, E 128, K 2
    (H200, ``python3 benchmarks/bench_token_rounding.py speed --shapes 0 --variants none --breakdown
    40``). With the Triton selections the place kernels write the weights and one launch writes both gradients
    (:mod:`moeblaze.kernels.pair_list`), where the weights' gather had taken a launch of its own (1.6 µs per step
    there)."""

    @staticmethod
    @carried_to_backward
    def forward(ctx, topk_weights, scores, kept, pad_mask, pad_tok, J, scale, kernels):
        if kernels:
            from .kernels.pair_list import rounding_place

            out = rounding_place(kept, pad_mask, pad_tok, topk_weights.contiguous(), scores.contiguous(), scale)
        else:
            out = _place_torch(kept, pad_mask, J, topk_weights, scores, scale)
        token_idx, expert_idx, w, pair_offsets = out
        ctx.mark_non_differentiable(token_idx, expert_idx, pair_offsets)
        ctx.save_for_backward(pair_offsets, expert_idx)
        ctx.scale, ctx.topk_shape, ctx.scores_shape = scale, topk_weights.shape, scores.shape
        ctx.scores_dtype, ctx.kernels, ctx.pads = scores.dtype, kernels, J > 0
        return token_idx, expert_idx, w, pair_offsets

    @staticmethod
    @carried_to_backward
    def backward(ctx, _dtokens, _dexperts, dw, _doffsets):
        if dw is None:
            return (None,) * 8
        pair_offsets, expert_idx = ctx.saved_tensors
        (_, K), (_, E) = ctx.topk_shape, ctx.scores_shape
        dscores = None
        if not (ctx.needs_input_grad[1] and ctx.pads):  # "down" pads nothing: no [T, E] rows to write
            dtopk = _topk_grads(dw, pair_offsets, K)
        elif ctx.kernels:
            from .kernels.pair_list import pair_weights_backward

            dtopk, dscores = pair_weights_backward(dw, pair_offsets, expert_idx, K, E, ctx.scale, ctx.scores_dtype)
        else:
            dtopk, dscores = _pair_weights_backward_torch(dw, pair_offsets, expert_idx, K, E, ctx.scale,
                                                          ctx.scores_dtype)
        return (dtopk if ctx.needs_input_grad[0] else None), dscores, None, None, None, None, None, None


def _topk_grads(dw: torch.Tensor, pair_offsets: torch.Tensor, K: int) -> torch.Tensor:
    """``[T, K]``: the gradients of the top-k pairs, pair (t, k) at ``pair_offsets[t] + k``."""
    return dw[pair_offsets[:-1, None].long() + torch.arange(K, device=dw.device)]


def _pair_tokens(pair_offsets: torch.Tensor, P: int) -> torch.Tensor:
    """``[P]`` int64 token of each pair, the unused tail past ``pair_offsets[T]`` as a token T of its own (no host
    read of its length)."""
    T = pair_offsets.numel() - 1
    counts = torch.cat((pair_offsets.diff(), P - pair_offsets[-1:])).long()
    return torch.repeat_interleave(torch.arange(T + 1, device=pair_offsets.device), counts, output_size=P)


def _scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x * scale`` in fp32 (fp64 for float64 ``x``), rounded once to ``x``'s dtype: as the kernels compute it, and
    the same on every device (a 16-bit tensor times a Python float rounds differently on the CPU)."""
    return (x.to(torch.float64 if x.dtype == torch.float64 else torch.float32) * scale).to(x.dtype)


def _pair_weights_backward_torch(dw, pair_offsets, expert_idx, K, E, scale, scores_dtype):
    """:func:`moeblaze.kernels.pair_list.pair_weights_backward` in PyTorch ops."""
    T, dev = pair_offsets.numel() - 1, dw.device
    off = pair_offsets.long()
    tok = _pair_tokens(pair_offsets, dw.numel())  # the tail's entries (token T) scatter into the dummy
    pad = (torch.arange(dw.numel(), device=dev) - off[tok] >= K) & (tok < T)
    dscores = torch.zeros(T * E + 1, dtype=scores_dtype, device=dev)  # + 1: the others' dummy
    dscores[torch.where(pad, tok * E + expert_idx.long().clamp(max=E - 1), T * E)] = _scaled(dw.to(scores_dtype),
                                                                                           scale)
    return _topk_grads(dw, pair_offsets, K), dscores[:-1].view(T, E)


def _place_torch(kept: torch.Tensor, pad_mask: torch.Tensor, J: int, topk_weights: torch.Tensor,
                 scores: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    """:func:`moeblaze.kernels.pair_list.rounding_place` in PyTorch ops (its layout and weights, bitwise)."""
    (T, K), E, dev = kept.shape, pad_mask.shape[1], kept.device
    P = T * K + J * E
    marks = pad_mask.long()
    n = K + marks.sum(1)
    pair_offsets = torch.cat((n.new_zeros(1), n.cumsum(0)))
    off = pair_offsets[:-1]
    token_idx = _pair_tokens(pair_offsets, P).clamp_(max=max(T - 1, 0)).to(torch.int32)  # the tail: token T - 1
    expert_idx = torch.full((P + 1,), E, dtype=torch.int32, device=dev)  # unused entries: expert E, weight 0
    w = torch.zeros(P + 1, dtype=topk_weights.dtype, device=dev)
    topk_pos = (off[:, None] + torch.arange(K, device=dev)).reshape(-1)
    expert_idx[topk_pos] = kept.reshape(-1)
    w[topk_pos] = topk_weights.reshape(-1)
    pad_pos = torch.where(marks != 0, off[:, None] + K + marks.cumsum(1) - 1, P).reshape(-1)  # P: a dummy
    expert_idx.index_put_((pad_pos,), torch.arange(E, dtype=torch.int32, device=dev).repeat(T))
    w.index_put_((pad_pos,), _scaled(scores, scale).to(w.dtype).reshape(-1))
    return token_idx, expert_idx[:P], w[:P], pair_offsets.to(torch.int32)


_INELIGIBLE = -(2**31)


def _order_key(x: torch.Tensor) -> torch.Tensor:
    """int32 keys monotone in the float values (``-0.0`` as ``+0.0``; NaN above +inf), as the kernels'."""
    bits = (x.float() + 0.0).view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _select_torch(scores, ids, weights, counts, target, J) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`moeblaze.kernels.rounding.rounding_select` in PyTorch ops: ``(kept [T, K], pad_mask [T, E])``."""
    (T, E), K, dev = scores.shape, ids.shape[1], scores.device
    drop = (counts - target).clamp_min(0)
    dropped = _dropped_pairs(ids.reshape(-1), _order_key(weights).reshape(-1), counts, drop)
    kept = torch.where(dropped.view(T, K), E, ids).to(torch.int32)
    pad_mask = torch.zeros(T * E + 1, dtype=torch.uint8, device=dev)  # + 1: a dummy for the unused candidates
    if not J:
        return kept, pad_mask[:-1].view(T, E)
    # per expert its J best tokens outside its top-k by (key desc, token asc): one unique int64 per entry
    key = _order_key(scores).clamp_min(_INELIGIBLE + 1).t().contiguous()  # [E, T]: topk along the contiguous dim
    key.index_put_((ids.t().reshape(-1), torch.arange(T, device=dev).repeat(K)), key.new_full((), _INELIGIBLE))
    tokens, experts = torch.arange(T, device=dev), torch.arange(E, device=dev)
    best = (key.long() * T + (T - 1 - tokens)).topk(J, dim=1).indices  # [E, J]
    used = torch.arange(J, device=dev)[None, :] < (target - counts).clamp_min(0)[:, None]
    pad_mask[torch.where(used, best * E + experts[:, None], T * E).reshape(-1)] = 1
    return kept, pad_mask[:-1].view(T, E)


def _dropped_pairs(pair_e: torch.Tensor, pair_key: torch.Tensor, counts: torch.Tensor,
                   drop: torch.Tensor) -> torch.Tensor:
    """``[T*K]`` bool: pair p is among the ``drop[e]`` lowest-key top-k pairs of its expert ``e = pair_e[p]``
    (SonicMoE orders an expert's top-k tokens by their top-k weights; equal keys: the lower pair first).

    Two stable sorts of the T*K pairs (by key, then by expert) give each pair its rank within its expert,
    instead of a top-(tile-1) over an ``[E, T]`` matrix of weights: O(T*K) work, not O(E*T).
    """
    P = pair_e.numel()
    by_w = torch.sort(pair_key, stable=True).indices
    experts, by_e = torch.sort(pair_e[by_w], stable=True)
    order = by_w[by_e]  # by expert, then key, then pair; `experts` is pair_e[order]
    start = torch.cumsum(counts, 0) - counts  # the expert's first position in `order`
    rank = torch.empty_like(order)
    rank[order] = torch.arange(P, device=pair_e.device) - start[experts]
    return rank < drop[pair_e]


class Rounding(NamedTuple):
    """A token rounding request for :class:`moeblaze.routing.Router` (``forward(..., rounding=...)``): ``mode``
    (``ROUNDING_MODES``), the M ``tile`` and ``"sr"``'s random source. The router reaches token rounding only
    through it (:meth:`serves`, :meth:`route`), so the router module does not import this one."""

    mode: str
    tile: int
    generator: torch.Generator | None = None

    def serves(self, logits: torch.Tensor, top_k: int) -> bool:
        """:func:`route_rounded` serves a fused router's call on these ``logits``."""
        return route_rounded_serves(logits, top_k)

    def route(self, logits: torch.Tensor, top_k: int, renormalize: bool, scale: float, aux_c: float,
              z_c: float) -> tuple[tuple[torch.Tensor, ...], TokenRounding]:
        """:func:`route_rounded` with this request."""
        return route_rounded(logits, top_k, renormalize, scale, aux_c, z_c, self)


def route_rounded_serves(logits: torch.Tensor, top_k: int) -> bool:
    """:func:`route_rounded` serves a fused router's call on fp32 ``logits [T, E]``: the Triton selections do
    (:func:`_kernels_serve`)."""
    return _kernels_serve(logits, top_k, (logits.dtype,))


def route_rounded(logits: torch.Tensor, top_k: int, renormalize: bool, scale: float, aux_c: float, z_c: float,
                  rounding: Rounding) -> tuple[tuple[torch.Tensor, ...], TokenRounding]:
    """The fused softmax top-k router (:func:`moeblaze.kernels.router.router_topk`) and token rounding in one
    autograd node (:class:`_RoutedPairs`): ``((ids, weights, probs, aux, z, counts), TokenRounding)``, the first
    as :class:`moeblaze.routing._FusedTopK` returns them, the second as :func:`round_tokens` over them."""
    _check_mode_tile(rounding.mode, rounding.tile)
    rand = _draws(rounding.mode, logits.shape[1], rounding.generator, logits.device)
    out = _RoutedPairs.apply(logits, top_k, renormalize, scale, aux_c, z_c, rounding.tile, rounding.mode, rand)
    token_idx, expert_idx, w, pair_offsets, target = out[6:]
    return out[:6], TokenRounding(token_idx, expert_idx, w, target, pair_offsets)


class _RoutedPairs(torch.autograd.Function):
    """Router and rounding as one node, so that the backward reads the pair weights' gradient ``dw [P]`` where
    it lies (:func:`moeblaze.kernels.router.router_topk_backward` with ``pairs``): no ``[T, K]`` and ``[T, E]``
    gradients of the top-k weights and scores are written (:func:`moeblaze.kernels.pair_list.
    pair_weights_backward`) and read back by the router's backward: one launch of 11.1 µs against two of 14.8 at
    T 16384, E 128, K 2 (H200, ``python3 benchmarks/bench_small_kernels.py --kernels pair_grads``).
    Gradients of the router's own weights and probabilities (a caller's other use of them) take that dense
    path."""

    @staticmethod
    @carried_to_backward
    def forward(ctx, logits, top_k, renormalize, scale, aux_c, z_c, tile, mode, rand):
        from .kernels.pair_list import rounding_place
        from .kernels.rounding import rounding_select
        from .kernels.router import off_losses, router_topk

        ids, weights, probs, lse, counts, aux, z = router_topk(logits, top_k, renormalize, scale, aux_c, z_c)
        J = _max_pad(mode, tile, logits.shape[0])
        kept, pad_mask, pad_tok, target = rounding_select(probs, ids, weights, counts, tile, mode, J, tile - 1, rand)
        token_idx, expert_idx, w, pair_offsets = rounding_place(kept, pad_mask, pad_tok, weights, probs, scale)
        ctx.mark_non_differentiable(ids, counts, token_idx, expert_idx, pair_offsets, target,
                                    *off_losses(aux, z, aux_c, z_c))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(probs, ids, lse, counts, pair_offsets, expert_idx)
        ctx.options = (renormalize, scale, aux_c, z_c)
        return ids, weights, probs, aux, z, counts, token_idx, expert_idx, w, pair_offsets, target

    @staticmethod
    @carried_to_backward
    def backward(ctx, _dids, dweights, dprobs, daux, dz, _dcounts, _dtok, _dexp, dw, _doffsets, _dtarget):
        from .kernels.pair_list import pair_weights_backward
        from .kernels.router import router_topk_backward

        if all(g is None for g in (dweights, dprobs, daux, dz, dw)):
            return (None,) * 9
        probs, ids, lse, counts, pair_offsets, expert_idx = ctx.saved_tensors
        renormalize, scale, aux_c, z_c = ctx.options
        pairs = None
        if dw is not None and dweights is None:
            pairs, dweights = (pair_offsets, expert_idx), dw
        elif dw is not None:  # the top-k weights' gradients from elsewhere too: the dense gradients, summed
            dtopk, dscores = pair_weights_backward(dw, pair_offsets, expert_idx, ids.shape[1], probs.shape[1], scale,
                                                   probs.dtype)
            dweights, dprobs = dweights + dtopk, dscores if dprobs is None else dprobs + dscores
        dlogits = router_topk_backward(probs, ids, dweights, dprobs, counts, lse, daux, dz, renormalize, scale, aux_c,
                                       z_c, pairs)
        return (dlogits,) + (None,) * 8


@functools.cache
def _compiled_round_tokens():
    return torch.compile(_round_tokens, fullgraph=True, dynamic=False)


def _compiles(scores: torch.Tensor) -> bool:
    """:func:`round_tokens_fused` compiles for ``scores``: on CUDA, unless the ``backend`` setting is ``torch``
    (eager PyTorch ops there, the plainest path to compare with or debug; a CPU step is not bound by launches)."""
    return scores.is_cuda and settings.get("backend") != "torch"


def round_tokens_fused(scores: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, tile: int,
                       mode: str = "nr", generator: torch.Generator | None = None,
                       scale: float = 1.0, counts: torch.Tensor | None = None) -> TokenRounding:
    """:func:`round_tokens` through ``torch.compile`` (Inductor fuses its small element-wise, gather and
    scatter launches into a few; the selections stay Triton custom ops or ``topk`` / ``sort`` library functions)
    on CUDA scores, except under ``backend="torch"`` (:mod:`moeblaze.settings`: eager there); the same result
    bitwise (integer selections; the padded weights are one gather and one product). ``"sr"`` (a
    ``torch.Generator`` argument) and invocations already inside ``torch.compile`` run :func:`round_tokens` itself. The
    first call per shape compiles (seconds). Arguments, result and errors: :func:`round_tokens`'s.
    """
    if torch.compiler.is_compiling() or mode == "sr":  # settings.get reads a ContextVar: not traceable
        return round_tokens(scores, topk_ids, topk_weights, tile, mode, generator, scale, counts)
    if _compiles(scores):
        _check_args(scores, topk_ids, topk_weights, tile, mode, counts)
        return _compiled_round_tokens()(scores, topk_ids, topk_weights, tile, mode, None, scale,
                                        _use_kernels(scores, topk_ids, topk_weights), counts)
    return round_tokens(scores, topk_ids, topk_weights, tile, mode, generator, scale, counts)
