"""Token rounding's pair list in token order, without a sort, and its weights' gradients (issue 25; rules:
:mod:`moeblaze.token_rounding`; the selections: :mod:`moeblaze.kernels.rounding`).

Layout of the ``P = T*K + J*E`` pairs: token t's K top-k pairs (dropped ones with expert E), then its padded
pairs in expert order; ``pair_offsets [T+1]`` delimits them, so ``pair_offsets[T] = T*K + (padded pairs)``. The
``U = J*E - (padded pairs)`` unused pad candidates follow as one tail (token T-1, expert E, weight 0): a
static P without a host synchronisation. The tail lies past ``pair_offsets[T]``, so the combines never loop over
it; spread over the tokens as one or two entries each, it had cost the gather-sums (F3, B5) an iteration per
token that held one: their time above the ceiling's went from 6.7 to 3.8-5.8 µs per step at T 16384, E 128, K 2
(H200, ``python3 benchmarks/bench_token_rounding.py speed --shapes 0 --variants none --breakdown 45``,
three runs; rows in docs/results-token-rounding.csv).

* :func:`rounding_pad_count_kernel` counts each token's padded pairs (row sums of the ``[T, E]`` mask) and each
  block's.
* :func:`rounding_place_kernel` adds the sums of the blocks before its own (at most ``T / 16`` of them), scans
  its tokens' pair counts and writes the top-k pairs with their weights, ``pair_offsets`` and its share of the tail.
* :func:`rounding_pad_place_kernel` (one program per expert) puts each padded pair at its token's offset plus K
  plus the token's padded pairs of lower experts, with its weight ``scores[t, e] * scale``.

This replaced a stable radix sort of the ``J*E`` pad entries by token, a binary search per token and three
scatters: 6.3 µs per step for the three launches against 17.1 + 4.6 µs for the sort and the search plus
Inductor's scatters at T 16384, E 128, K 2; a first form scanning ``[BLOCK_T, E]`` mask tiles for the pads'
ranks in one launch took 9.5-10.4 µs (H200, the command above).

:func:`pair_weights_backward` writes the gradients of the pair weights' two sources in one pass: the top-k
pairs' at ``pair_offsets[t] + k`` into ``[T, K]``, and the padded pairs' into whole ``[T, E]`` rows (zeros
elsewhere), where a zero fill, a scatter and a gather had taken three launches: 4.7 against 3.5 + 1.9 + 2.1 µs
per step at T 16384, E 128, K 2 (H200, the command above). Its first form kept the rows in registers
and set each padded pair with a compare over the row: 6.1 µs (102 registers at E 128); the zeros now go out
first and the values over them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .custom_ops import call_op
from .direct import launch
from .tuning import cdiv, next_pow2


@triton.jit
def rounding_pad_count_kernel(
    pad_mask_ptr,    # [T, E] uint8: 1 where expert e pads token t
    pads_ptr,        # [T] int32 out: padded pairs of each token
    block_pads_ptr,  # [NBT] int32 out: padded pairs of each block of BLOCK_T tokens
    T, E,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    m = tl.load(pad_mask_ptr + rows[:, None] * E + cols[None, :], mask=(rows < T)[:, None] & (cols < E)[None, :],
                other=0).to(tl.int32)
    pads = tl.sum(m, axis=1)
    tl.store(pads_ptr + rows, pads, mask=rows < T)
    tl.store(block_pads_ptr + tl.program_id(0), tl.sum(pads, axis=0))


@triton.jit
def rounding_place_kernel(
    kept_ptr,          # [T, K] int32: top-k ids, E where dropped
    topk_w_ptr,        # [T, K] float: top-k weights
    pads_ptr,          # [T] int32: padded pairs of each token
    block_pads_ptr,    # [NBT] int32: padded pairs per block of BLOCK_T tokens
    token_idx_ptr,     # [P] int32 out: each pair's token, ascending (padded pairs: rounding_pad_place_kernel)
    expert_idx_ptr,    # [P] int32 out: each pair's expert, E for dropped and unused pairs
    w_ptr,             # [P] out, topk_w's dtype: each pair's weight (top-k pairs: theirs; unused: 0)
    pair_offsets_ptr,  # [T+1] int32 out: first pair of each token; the pairs before the unused tail at T
    T, NBT, P, TAIL_PER_BLOCK, UNUSED_E, stride_w_t,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_NBT: tl.constexpr, BLOCK_TAIL: tl.constexpr,
):
    b = tl.program_id(0)
    nbt = tl.arange(0, BLOCK_NBT)
    block_pads = tl.load(block_pads_ptr + nbt, mask=nbt < NBT, other=0)
    rows = b * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    pads = tl.load(pads_ptr + rows, mask=rmask, other=0)
    n = tl.where(rmask, K + pads, 0)
    first = b * BLOCK_T * K + tl.sum(tl.where(nbt < b, block_pads, 0), axis=0)
    off = first + tl.cumsum(n, axis=0) - n  # pair_offsets of this block's tokens
    tl.store(pair_offsets_ptr + rows, off, mask=rmask)
    tl.store(pair_offsets_ptr + rows + 1, off + n, mask=rows == T - 1)
    for k in tl.static_range(K):  # the top-k pairs, in k order
        tl.store(token_idx_ptr + off + k, rows, mask=rmask)
        tl.store(expert_idx_ptr + off + k, tl.load(kept_ptr + rows * K + k, mask=rmask, other=0), mask=rmask)
        tl.store(w_ptr + off + k, tl.load(topk_w_ptr + rows * stride_w_t + k, mask=rmask, other=0.0), mask=rmask)
    tail0 = T * K + tl.sum(block_pads, axis=0) + b * TAIL_PER_BLOCK  # this block's share of the unused tail
    for i in range(0, TAIL_PER_BLOCK, BLOCK_TAIL):
        j = i + tl.arange(0, BLOCK_TAIL)
        q = tail0 + j
        use = (j < TAIL_PER_BLOCK) & (q < P)
        tl.store(token_idx_ptr + q, tl.full(q.shape, 0, tl.int32) + (T - 1), mask=use)
        tl.store(expert_idx_ptr + q, tl.full(q.shape, 0, tl.int32) + UNUSED_E, mask=use)
        tl.store(w_ptr + q, tl.zeros(q.shape, w_ptr.dtype.element_ty), mask=use)


@triton.jit
def rounding_pad_place_kernel(
    pad_mask_ptr,      # [T, E] uint8: 1 where expert e pads token t
    pad_tok_ptr,       # [J, E] int32: the tokens expert e pads, ascending, then -1
    pair_offsets_ptr,  # [T+1] int32: first pair of each token (rounding_place_kernel)
    scores_ptr,        # [T, E] float router scores
    token_idx_ptr,     # [P] int32 out: the padded pairs' tokens
    expert_idx_ptr,    # [P] int32 out: the padded pairs' experts
    w_ptr,             # [P] out: the padded pairs' weights, scores[t, e] * scale
    T, E, J, K, stride_s_t, scale,
    BLOCK_J: tl.constexpr, CHUNK_E: tl.constexpr,
):
    e = tl.program_id(0)
    jj = tl.arange(0, BLOCK_J)
    t = tl.load(pad_tok_ptr + jj * E + e, mask=jj < J, other=-1)
    valid = t >= 0
    rank = tl.zeros([BLOCK_J], tl.int32)  # the token's padded pairs of the experts before e
    for c0 in range(0, e, CHUNK_E):  # 32-column chunks: 29 registers; a [64, E] tile spilled at E 512 (triton 3.6)
        cols = c0 + tl.arange(0, CHUNK_E)
        before = tl.load(pad_mask_ptr + t[:, None] * E + cols[None, :], mask=valid[:, None] & (cols < e)[None, :],
                         other=0)
        rank += tl.sum(before.to(tl.int32), axis=1)
    pos = tl.load(pair_offsets_ptr + t, mask=valid, other=0) + K + rank
    tl.store(token_idx_ptr + pos, t, mask=valid)
    tl.store(expert_idx_ptr + pos, tl.full(pos.shape, 0, tl.int32) + e, mask=valid)
    s = tl.load(scores_ptr + t * stride_s_t + e, mask=valid, other=0.0)
    # times scale in fp32 and rounded to the scores' dtype once, then to the weights': as the PyTorch path
    w = (s.to(tl.float32) * scale).to(scores_ptr.dtype.element_ty).to(w_ptr.dtype.element_ty)
    tl.store(w_ptr + pos, w, mask=valid)


def _place_block_t(E: int) -> int:
    """Tokens per program of the count kernel (``[BLOCK_T, E]`` tiles of 8,192 mask bytes, 16 to 128 tokens) and of
    the place kernel, whose every program adds the block sums before its own (T / BLOCK_T loads)."""
    return max(16, min(128, 8192 // next_pow2(E)))


def _place_impl(kept: torch.Tensor, pad_mask: torch.Tensor, pad_tok: torch.Tensor, topk_weights: torch.Tensor,
                scores: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    (T, K), (J, E) = kept.shape, pad_tok.shape
    P, dev = T * K + J * E, kept.device
    token_idx = torch.empty(P, dtype=torch.int32, device=dev)
    expert_idx = torch.empty(P, dtype=torch.int32, device=dev)
    w = torch.empty(P, dtype=topk_weights.dtype, device=dev)
    if T == 0:
        return token_idx, expert_idx, w, torch.zeros(1, dtype=torch.int32, device=dev)
    pair_offsets = torch.empty(T + 1, dtype=torch.int32, device=dev)  # every entry written by the place kernel
    block_t, block_e = _place_block_t(E), next_pow2(E)
    nbt = cdiv(T, block_t)
    pads = torch.empty(T, dtype=torch.int32, device=dev)
    block_pads = torch.empty(nbt, dtype=torch.int32, device=dev)
    launch(rounding_pad_count_kernel, (nbt,), pad_mask_ptr=pad_mask, pads_ptr=pads, block_pads_ptr=block_pads, T=T,
           E=E, BLOCK_T=block_t, BLOCK_E=block_e, num_warps=4)
    tail = cdiv(J * E, nbt)  # the unused tail's entries per block, at most (U <= J*E)
    launch(rounding_place_kernel, (nbt,), kept_ptr=kept, topk_w_ptr=topk_weights, pads_ptr=pads,
           block_pads_ptr=block_pads, token_idx_ptr=token_idx, expert_idx_ptr=expert_idx, w_ptr=w,
           pair_offsets_ptr=pair_offsets, T=T, NBT=nbt, P=P, TAIL_PER_BLOCK=tail, UNUSED_E=E,
           stride_w_t=topk_weights.stride(0), K=K, BLOCK_T=block_t, BLOCK_NBT=next_pow2(nbt),
           BLOCK_TAIL=min(128, next_pow2(max(tail, 1))), num_warps=4)
    if J:
        launch(rounding_pad_place_kernel, (E,), pad_mask_ptr=pad_mask, pad_tok_ptr=pad_tok,
               pair_offsets_ptr=pair_offsets, scores_ptr=scores, token_idx_ptr=token_idx, expert_idx_ptr=expert_idx,
               w_ptr=w, T=T, E=E, J=J, K=K, stride_s_t=scores.stride(0), scale=float(scale),
               BLOCK_J=next_pow2(J), CHUNK_E=min(block_e, 32), num_warps=4)
    return token_idx, expert_idx, w, pair_offsets


_place_op = torch.library.custom_op(
    "moeblaze::rounding_place", _place_impl, mutates_args=(),
    schema="(Tensor kept, Tensor pad_mask, Tensor pad_tok, Tensor topk_weights, Tensor scores, float scale) -> "
           "(Tensor, Tensor, Tensor, Tensor)")


@_place_op.register_fake
def _(kept, pad_mask, pad_tok, topk_weights, scores, scale):
    P = kept.numel() + pad_tok.numel()
    return (kept.new_empty(P), kept.new_empty(P), topk_weights.new_empty(P), kept.new_empty(kept.shape[0] + 1))


def rounding_place(kept: torch.Tensor, pad_mask: torch.Tensor, pad_tok: torch.Tensor, topk_weights: torch.Tensor,
                   scores: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, ...]:
    """Token rounding's pair list in token order and its weights (module docstring), in three launches, no host
    synchronisation.

    Args:
        kept: ``[T, K]`` int32 top-k ids with dropped pairs set to E. pad_mask: ``[T, E]`` uint8, 1 where expert e
            pads token t. pad_tok: ``[J, E]`` int32, the tokens of column e's ones, ascending, then -1 (J: pad
            candidates per expert). All contiguous (:func:`moeblaze.kernels.rounding.rounding_select`'s outputs).
        topk_weights: ``[T, K]`` fp16/bf16/fp32 top-k weights, unit column stride. scores: ``[T, E]`` fp16/bf16/fp32
            router scores, unit column stride. scale: the padded pairs' weight factor.

    Returns:
        ``(token_idx [P] int32, expert_idx [P] int32, w [P], pair_offsets [T+1] int32)``, ``P = T*K + J*E``: per
        token its K top-k pairs and its padded pairs in expert order, then the unused entries as one tail (token
        T-1, expert E); ``w`` in topk_weights' dtype: a top-k pair's weight, a padded pair's ``scores[t, e] *
        scale`` (in fp32, rounded to the scores' dtype once), 0 for unused entries; ``pair_offsets`` is the CSR of
        :mod:`moeblaze.general_routing`, ``pair_offsets[T]`` the tail's first pair.

    Raises:
        ValueError: shapes, dtypes or strides other than above.
    """
    if kept.dim() != 2 or pad_mask.dim() != 2 or pad_tok.dim() != 2 or pad_mask.shape[0] != kept.shape[0] or \
            pad_tok.shape[1] != pad_mask.shape[1]:
        raise ValueError(f"rounding_place: kept must be [T, K], pad_mask [T, E] and pad_tok [J, E], got "
                         f"{tuple(kept.shape)}, {tuple(pad_mask.shape)} and {tuple(pad_tok.shape)}")
    if kept.dtype != torch.int32 or pad_mask.dtype != torch.uint8 or pad_tok.dtype != torch.int32 or not all(
            t.is_contiguous() for t in (kept, pad_mask, pad_tok)):
        raise ValueError(f"rounding_place: kept and pad_tok must be contiguous int32 and pad_mask contiguous uint8, "
                         f"got {kept.dtype}, {pad_tok.dtype} and {pad_mask.dtype}")
    floats = (torch.float16, torch.bfloat16, torch.float32)
    if topk_weights.shape != kept.shape or scores.shape != pad_mask.shape or topk_weights.dtype not in floats or \
            scores.dtype not in floats or any(t.numel() and t.stride(-1) != 1 for t in (topk_weights, scores)):
        raise ValueError(f"rounding_place: topk_weights must be [T, K] and scores [T, E], fp16/bf16/fp32 with unit "
                         f"column stride, got {tuple(topk_weights.shape)} {topk_weights.dtype} and "
                         f"{tuple(scores.shape)} {scores.dtype}")
    return call_op(_place_op, _place_impl, kept, pad_mask, pad_tok, topk_weights, scores, float(scale))


@triton.jit
def pair_weights_bwd_kernel(
    dw_ptr,            # [P] gradient of the pair weights
    pair_offsets_ptr,  # [T+1] int32: first pair of each token (rounding_place_kernel's layout)
    expert_idx_ptr,    # [P] int32: each pair's expert
    dtopk_ptr,         # [T, K] out, dw's dtype: the gradient of pair pair_offsets[t] + k
    dscores_ptr,       # [T, E] out: the gradient of (t, e)'s padded pair times scale, else 0
    T, E, scale,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    off = tl.load(pair_offsets_ptr + rows, mask=rmask, other=0)
    pads = tl.load(pair_offsets_ptr + rows + 1, mask=rmask, other=0) - off - K  # the padded pairs follow the top-k
    for k in tl.static_range(K):
        tl.store(dtopk_ptr + rows * K + k, tl.load(dw_ptr + off + k, mask=rmask, other=0.0), mask=rmask)
    # the rows' zeros first, then the padded pairs' values over them: the zeros wait for no load
    cols = tl.arange(0, BLOCK_E)
    tl.store(dscores_ptr + rows[:, None] * E + cols[None, :],
             tl.zeros((BLOCK_T, BLOCK_E), dtype=dscores_ptr.dtype.element_ty),
             mask=rmask[:, None] & (cols < E)[None, :])
    tl.debug_barrier()  # every zero of the block stored before any value lands on it
    for j in range(0, tl.max(pads, axis=0)):  # a token's padded pairs: 0-3 at the shapes
        has = rmask & (j < pads)
        p = off + K + j
        e = tl.load(expert_idx_ptr + p, mask=has, other=0)
        # as the PyTorch path: dw in the scores' dtype, times scale in fp32, rounded once
        g = tl.load(dw_ptr + p, mask=has, other=0.0).to(dscores_ptr.dtype.element_ty).to(tl.float32) * scale
        tl.store(dscores_ptr + rows * E + e, g.to(dscores_ptr.dtype.element_ty), mask=has)


def _weights_bwd_impl(dw: torch.Tensor, pair_offsets: torch.Tensor, expert_idx: torch.Tensor, K: int, E: int,
                      scale: float, scores_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    T = pair_offsets.numel() - 1
    dtopk = torch.empty(T, K, dtype=dw.dtype, device=dw.device)
    dscores = torch.empty(T, E, dtype=scores_dtype, device=dw.device)
    if T == 0:
        return dtopk, dscores
    block_t = max(1, min(128, 8192 // next_pow2(E)))  # [BLOCK_T, E] row tiles of 8,192 elements
    launch(pair_weights_bwd_kernel, (cdiv(T, block_t),), dw_ptr=dw, pair_offsets_ptr=pair_offsets,
           expert_idx_ptr=expert_idx, dtopk_ptr=dtopk, dscores_ptr=dscores, T=T, E=E, scale=float(scale), K=K,
           BLOCK_T=block_t, BLOCK_E=next_pow2(E), num_warps=4)
    return dtopk, dscores


_weights_bwd_op = torch.library.custom_op(
    "moeblaze::pair_weights_backward", _weights_bwd_impl, mutates_args=(),
    schema="(Tensor dw, Tensor pair_offsets, Tensor expert_idx, int K, int E, float scale, ScalarType scores_dtype) "
           "-> (Tensor, Tensor)")


@_weights_bwd_op.register_fake
def _(dw, pair_offsets, expert_idx, K, E, scale, scores_dtype):
    T = pair_offsets.shape[0] - 1
    return dw.new_empty(T, K), dw.new_empty(T, E, dtype=scores_dtype)


def pair_weights_backward(dw: torch.Tensor, pair_offsets: torch.Tensor, expert_idx: torch.Tensor, K: int, E: int,
                          scale: float, scores_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of token rounding's pair weights' sources, one launch (module docstring).

    Args:
        dw: ``[P]`` gradient of the pair weights (fp16/bf16/fp32). pair_offsets: ``[T+1]`` int32 and expert_idx:
            ``[P]`` int32 of :func:`rounding_place`'s layout (top-k pairs first in each token's range, then its
            padded pairs). K: top-k pairs per token. E: experts. scale: the padded pairs' weight factor.
        scores_dtype: dtype of the router scores (fp16/bf16/fp32).

    Returns:
        ``(dtopk [T, K] in dw's dtype, dscores [T, E] in scores_dtype)``: ``dtopk[t, k] = dw[pair_offsets[t] + k]``;
        ``dscores[t, e] = dw[p] * scale`` for the padded pair p of (t, e) (rounded once to scores_dtype), else 0.

    Raises:
        ValueError: shapes or dtypes other than above.
    """
    if dw.dim() != 1 or expert_idx.shape != dw.shape or pair_offsets.dim() != 1 or pair_offsets.dtype != torch.int32 \
            or expert_idx.dtype != torch.int32:
        raise ValueError(f"pair_weights_backward: dw and expert_idx must be [P] (expert_idx int32), pair_offsets "
                         f"[T+1] int32, got {tuple(dw.shape)}, {tuple(expert_idx.shape)} {expert_idx.dtype}, "
                         f"{tuple(pair_offsets.shape)} {pair_offsets.dtype}")
    if scores_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"pair_weights_backward: scores_dtype must be fp16, bf16 or fp32, got {scores_dtype}")
    return call_op(_weights_bwd_op, _weights_bwd_impl, dw.contiguous(), pair_offsets, expert_idx, K, E, scale,
                   scores_dtype)
