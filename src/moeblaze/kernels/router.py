"""Fused softmax top-k router: softmax, top-K, weights and both auxiliary losses in two launches (and a sum of
a few per-block values), and their backward in one (DESIGN.md §2; issue 24: fewer launches on the host path).

The PyTorch router (:class:`moeblaze.routing.Router`) takes about 14 operations forward and 20 backward
for this (softmax, topk, renormalisation, the load-balancing loss's counts and sums, logsumexp for the
z-loss, their scalar products, and the autograd nodes of each): each a launch and, for a few thousand
tokens per GPU, host time the GPU waits for. Here, from the fp32 logits ``[T, E]``:

* :func:`router_topk_kernel` (one program per ``BLOCK_T`` tokens): softmax probabilities, their
  logsumexp, the top-K ids (largest probability first, lowest id on ties, NaN never chosen over a
  number, where ``torch.topk`` ranks NaN first; a NaN logit makes its whole row NaN either way) and weights (renormalised to sum 1 and scaled when asked), and per-block partial sums for the
  losses: pairs per expert, summed probabilities per expert, summed squared logsumexp;
* :func:`router_loss_kernel` (one program per 32 experts and one for the z-loss; fixed summation orders, so
  the losses are bitwise reproducible): the totals, ``aux = c_aux * <counts, sum_t probs_t>`` (Switch eq. 4
  with ``c_aux = coef * E / (T*K * T)``; its per-block terms summed by one ``sum``) and
  ``z = c_z * sum_t lse_t^2`` (ST-MoE eq. 5, ``c_z = coef / T``);
* :func:`router_topk_bwd_kernel`: ``dlogits`` from the gradients of the weights, the probabilities
  (used by token rounding), the aux loss and the z-loss: the top-K scatter, the renormalisation's
  Jacobian, ``daux * c_aux * counts_e`` on every probability, then the softmax backward
  ``p * (g - <g, p>)`` plus ``dz * 2 c_z lse_t * p``. With ``PAIRS`` the weights' gradients are those of token
  rounding's pair list (:mod:`moeblaze.kernels.pair_list`'s layout), read where they lie: each token's top-k pairs
  and its padded pairs (``scale * p[t, e]`` each), the first ``PADS_UNROLLED`` of them in the tile, any further
  ones as ``[BLOCK_T, 1]`` terms of ``<g, p>`` and a rewrite of their columns after the tile's store, so no loop
  carries the tile. 11.1 against 14.8 µs for the pair weights' dense backward and this kernel reading its
  ``[T, K]`` and ``[T, E]`` at T 16384, E 128, K 2; 45.5 against 53.4 at E 512, K 10 (H200,
  ``python3 benchmarks/bench_small_kernels.py --kernels pair_grads``); a loop over the pads carrying the tile
  took 13.0-14.0 and 52.2-57.3 in runs timed the same way (64-128 registers against 48 at E 128).
* :func:`split16_kernel`: the router's backward GEMMs take ``dlogits`` as two 16-bit halves ``[hi | lo]``
  (:func:`split16`, one launch);

Up to ``MAX_EXPERTS`` experts (a token's E probabilities stay in registers), ``MAX_TOP_K`` and fewer than
``MAX_ELEMENTS`` logits; :class:`moeblaze.routing.Router` takes its PyTorch path beyond.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .custom_ops import call_op
from .direct import launch
from .tuning import cdiv, next_pow2

MAX_EXPERTS = 1024
MAX_TOP_K = 16  # the top-K loop is unrolled: compile time grows with K (the dispatch index takes K <= 16 too)
MAX_ELEMENTS = 2**31  # T * E: the kernels' offsets are int32
# a NaN probability ranks below every number (as this negative float's key)
_NEG_MAX = tl.constexpr(-3.4028234663852886e38)
_NO_KEY = tl.constexpr(-(2**63))  # the key of a padding column: below every real one


def _topk_warps(E: int) -> int:
    """Warps of the top-k kernel: 4, or 8 from E 256 on (its bitonic top-K over ``[BLOCK_T, E]`` 64-bit keys). At
    T 32768, E 128, K 8 16 tokens by 4 warps took 0.074 ms (top-k and loss kernels) against 0.092 by 8; at T 16384,
    E 512, K 10 8 tokens by 8 warps 0.166 against 0.252 by 4 (H200, CUDA-graph replay, ``python3
    benchmarks/bench_small_kernels.py --kernels router``)."""
    return 8 if E >= 256 else 4


def _block_t(E: int) -> int:
    """Tokens per program of the top-k kernel: about 2048 probabilities up to E 128 (16 tokens), 4096 beyond (16 at
    E 256, 8 at E 512). The K argmax reductions of the first kernel took 0.100 ms at T 32768, E 128, K 8 with 32
    tokens per program and 0.199 at T 16384, E 512, K 10 with 16; the bitonic top-K takes 0.074 and 0.166 at
    these launch shapes, 0.022 against 0.025 at T 4096 (same command, same run). At T 16384, E 256, K 4 (8 warps)
    16 tokens took 0.064 ms against 0.071 for 8 (H200, same command)."""
    return max(1, min(64, (2048 if E <= 128 else 4096) // next_pow2(E)))


def _bwd_block_t(E: int) -> int:
    """Tokens per program of the backward kernel: about 1024 probabilities (8 tokens at E 128), at least 4 (4 at
    E 512). Its 4 warps stream ``probs`` once; more programs hide the loads: 0.021 against 0.028 ms with 64 tokens
    at T 32768, E 128, K 8, 0.038 against 0.052 with 16 at T 16384, E 512, K 10 (H200, same command)."""
    return max(4, min(64, 1024 // next_pow2(E)))


@triton.jit
def router_topk_kernel(
    logits_ptr,   # [T, E] fp32 router logits
    ids_ptr,      # [T, K] int32 out: top-K expert ids
    weights_ptr,  # [T, K] fp32 out: combine weights
    probs_ptr,    # [T, E] fp32 out: softmax probabilities (the router's scores)
    lse_ptr,      # [T] fp32 out: logsumexp of the logits
    part_ptr,     # [num_blocks, 2E + 1] fp32 out: per block, pairs per expert | probabilities per expert | sum lse^2
    T, E, stride_l_t, scale,
    K: tl.constexpr, KP: tl.constexpr, RENORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    rmask, cmask = rows < T, cols < E
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(logits_ptr + rows[:, None] * stride_l_t + cols[None, :], mask=mask, other=-float("inf"))
    m = tl.where(rmask, tl.max(x, axis=1), 0.0)  # rows past T: all -inf; keep them finite (no NaN)
    p = tl.exp(x - m[:, None])
    s = tl.where(rmask, tl.sum(p, axis=1), 1.0)
    probs = p / s[:, None]
    lse = m + tl.log(s)
    tl.store(probs_ptr + rows[:, None] * E + cols[None, :], probs, mask=mask)
    tl.store(lse_ptr + rows, lse, mask=rmask)
    # One bitonic top-K (tl.topk) over 64-bit keys, the probability's bits above its inverted column: distinct
    # keys, ordered by probability (non-negative floats order as their bits), ties to the lowest column, NaN (as
    # _NEG_MAX, a negative float: a negative key) below every number, padding columns below all. K serial
    # argmax reductions with their indices took 71 µs at T 32768, E 128, K 8 against SonicMoE's 10 (H200,
    # ``python3 benchmarks/profile_layer.py --configs qwen3-30b-a3b --tokens 32768 --impls
    # moeblaze,sonicmoe --timeline``).
    pbits = tl.where(probs == probs, probs, _NEG_MAX).to(tl.int32, bitcast=True).to(tl.int64)
    key = tl.where(cmask[None, :], (pbits << 32) | (BLOCK_E - 1 - cols)[None, :].to(tl.int64), _NO_KEY)
    top = tl.topk(key, KP, dim=1)  # [BLOCK_T, KP], descending
    kk = tl.arange(0, KP)
    ids = (BLOCK_E - 1 - (top & 0xFFFFFFFF)).to(tl.int32)
    best = (top >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    w = tl.where(best == _NEG_MAX, float("nan"), best)  # a NaN row: every probability NaN, as torch gives
    w = tl.where(kk[None, :] < K, w, 0.0)
    # the chosen entries: keys at or above the K-th largest (keys are distinct), counted across the rows once
    kth = tl.min(tl.where(kk[None, :] < K, top, 0x7FFFFFFFFFFFFFFF), axis=1)
    counts = tl.sum(tl.where((key >= kth[:, None]) & mask, 1.0, 0.0), axis=0)
    if RENORM:
        w = w / tl.maximum(tl.sum(w, axis=1), 1e-20)[:, None]
    kmask = rmask[:, None] & (kk[None, :] < K)
    tl.store(ids_ptr + rows[:, None] * K + kk[None, :], ids, mask=kmask)
    tl.store(weights_ptr + rows[:, None] * K + kk[None, :], w * scale, mask=kmask)
    part = part_ptr + pid * (2 * E + 1)
    tl.store(part + cols, counts, mask=cmask)
    tl.store(part + E + cols, tl.sum(probs, axis=0), mask=cmask)  # rows past T hold zeros
    tl.store(part + 2 * E, tl.sum(tl.where(rmask, lse * lse, 0.0), axis=0))


@triton.jit
def router_loss_kernel(
    part_ptr,    # [num_blocks, 2E + 1] fp32 per-block sums (router_topk_kernel)
    counts_ptr,  # [E] fp32 out: pairs per expert
    dot_ptr,     # [cdiv(E, BLOCK_E)] fp32 out: per column block, aux_c * sum_e counts_e * (summed probabilities)_e
    aux_ptr,     # [] fp32 out: 0 where aux_c is 0 (else unused: the caller sums dot)
    z_ptr,       # [] fp32 out: z-loss, 0 where z_c is 0
    num_blocks, E, aux_c, z_c,
    BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    bb = tl.arange(0, BLOCK_B)
    width = 2 * E + 1
    if pid * BLOCK_E < E:  # one column block of the partial sums
        e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
        emask = e < E
        c = tl.zeros([BLOCK_E], dtype=tl.float32)
        ps = tl.zeros([BLOCK_E], dtype=tl.float32)
        for b0 in range(0, num_blocks, BLOCK_B):
            mask = (b0 + bb < num_blocks)[:, None] & emask[None, :]
            tile = part_ptr + (b0 + bb)[:, None] * width + e[None, :]
            c += tl.sum(tl.load(tile, mask=mask, other=0.0), axis=0)
            ps += tl.sum(tl.load(tile + E, mask=mask, other=0.0), axis=0)
        tl.store(counts_ptr + e, c, mask=emask)
        tl.store(dot_ptr + pid, aux_c * tl.sum(c * ps, axis=0))
    else:  # the last program: the z-loss column
        zs = tl.zeros([BLOCK_B], dtype=tl.float32)
        for b0 in range(0, num_blocks, BLOCK_B):
            zs += tl.load(part_ptr + (b0 + bb) * width + 2 * E, mask=b0 + bb < num_blocks, other=0.0)
        # a loss that is off is an exact 0 here: the router needs no zero tensors of its own (a fill launch each)
        tl.store(z_ptr, tl.where(z_c != 0.0, z_c * tl.sum(zs, axis=0), 0.0))
        if aux_c == 0.0:
            tl.store(aux_ptr, 0.0)


@triton.jit
def _pad_grad(j, off, pads, rmask,
              dw_ptr,  # [P] fp32 or 16-bit gradient of token rounding's pair weights
              expert_idx_ptr,  # [P] int32 each pair's expert
              scale, K: tl.constexpr):
    """The j-th padded pair of each token, ``[BLOCK_T, 1]`` each (``off``, ``pads``, ``rmask`` in that shape):
    ``(has, e, v)``, its expert (-1 where the token has none) and its gradient times ``scale`` (0 there)."""
    has = rmask & (j < pads)
    q = off + K + j
    e = tl.load(expert_idx_ptr + q, mask=has, other=-1)
    v = tl.load(dw_ptr + q, mask=has, other=0.0).to(tl.float32) * scale
    return has, e, v


@triton.jit
def router_topk_bwd_kernel(
    probs_ptr,    # [T, E] fp32 softmax probabilities
    ids_ptr,      # [T, K] int32 top-K ids
    dw_ptr,       # [T, K] fp32 gradient of the combine weights (HAS_DW); PAIRS: [P], a pair list's weights'
    pair_offsets_ptr,  # [T+1] int32 (PAIRS): token rounding's pair list, per token K top-k pairs, then its pads
    expert_idx_ptr,    # [P] int32 (PAIRS): each pair's expert
    dprobs_ptr,   # [T, E] fp32 gradient of the probabilities (HAS_DPROBS)
    counts_ptr,   # [E] fp32 pairs per expert
    lse_ptr,      # [T] fp32 logsumexp
    daux_ptr,     # [] fp32 gradient of the aux loss (HAS_DAUX)
    dz_ptr,       # [] fp32 gradient of the z-loss (HAS_DZ)
    dlogits_ptr,  # [T, E] fp32 out
    T, E, scale, aux_c, z_c,
    K: tl.constexpr, KP: tl.constexpr, RENORM: tl.constexpr, HAS_DW: tl.constexpr, PAIRS: tl.constexpr,
    PADS_UNROLLED: tl.constexpr, HAS_DPROBS: tl.constexpr, HAS_DAUX: tl.constexpr, HAS_DZ: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    rmask, cmask = rows < T, cols < E
    mask = rmask[:, None] & cmask[None, :]
    tile = rows[:, None] * E + cols[None, :]
    p = tl.load(probs_ptr + tile, mask=mask, other=0.0)
    g = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    if HAS_DPROBS:
        g += tl.load(dprobs_ptr + tile, mask=mask, other=0.0)
    if PAIRS:  # the padded pairs' weights are scale * probs[t, e]: their gradients, read where they lie
        rmask1 = rmask[:, None]  # [BLOCK_T, 1]: g's layout
        off = tl.load(pair_offsets_ptr + rows[:, None], mask=rmask1, other=0)
        pads = tl.load(pair_offsets_ptr + rows[:, None] + 1, mask=rmask1, other=0) - off - K
        for j in tl.static_range(PADS_UNROLLED):  # unrolled: the loads go out together, not a round trip per pad
            _, e, v = _pad_grad(j, off, pads, rmask1, dw_ptr, expert_idx_ptr, scale, K)
            g += tl.where(cols[None, :] == e, v, 0.0)
        more = tl.max(tl.max(pads, axis=1), axis=0)  # pads past the unrolled ones: below
    if HAS_DAUX:
        counts = tl.load(counts_ptr + cols, mask=cmask, other=0.0)
        g += (tl.load(daux_ptr) * aux_c) * counts[None, :]
    if HAS_DW or PAIRS:
        kk = tl.arange(0, KP)
        kmask = rmask[:, None] & (kk[None, :] < K)
        ids = tl.load(ids_ptr + rows[:, None] * K + kk[None, :], mask=kmask, other=0)
        if PAIRS:  # pair pair_offsets[t] + k is top-k pair (t, k), dropped or not
            dw = tl.load(dw_ptr + off + kk[None, :], mask=kmask, other=0.0).to(tl.float32)
        else:
            dw = tl.load(dw_ptr + rows[:, None] * K + kk[None, :], mask=kmask, other=0.0)
        dsel = dw * scale
        if RENORM:  # w_k = scale * sel_k / max(S, 1e-20), S = sum_k sel_k
            sel = tl.load(probs_ptr + rows[:, None] * E + ids, mask=kmask, other=0.0)
            S = tl.sum(sel, axis=1)
            Sc = tl.maximum(S, 1e-20)
            gsel = tl.sum(dw * sel, axis=1)
            dsel = scale * (dw / Sc[:, None] - tl.where(S > 1e-20, gsel / (Sc * Sc), 0.0)[:, None])
        for k in tl.static_range(K):
            idk = tl.sum(tl.where(kk[None, :] == k, ids, 0), axis=1)
            dk = tl.sum(tl.where(kk[None, :] == k, dsel, 0.0), axis=1)
            g += tl.where(cols[None, :] == idk[:, None], dk[:, None], 0.0)
    gp = tl.sum(g * p, axis=1)[:, None]  # [BLOCK_T, 1]
    if PAIRS:  # the pads past the unrolled ones add to <g, p> per token (a [BLOCK_T, 1] loop, not the tile's)
        for j in range(PADS_UNROLLED, more):
            has, e, v = _pad_grad(j, off, pads, rmask1, dw_ptr, expert_idx_ptr, scale, K)
            gp += v * tl.load(probs_ptr + rows[:, None] * E + e, mask=has, other=0.0)
    dl = p * (g - gp)
    zc = tl.zeros([BLOCK_T, 1], dtype=tl.float32)
    if HAS_DZ:
        zc = (tl.load(dz_ptr) * 2.0 * z_c) * tl.load(lse_ptr + rows[:, None], mask=rmask[:, None], other=0.0)
        dl += zc * p
    tl.store(dlogits_ptr + tile, dl, mask=mask)
    if PAIRS:  # noqa: SIM102 (``more`` exists only where the constexpr PAIRS is on: not one ``and``)
        if more > PADS_UNROLLED:  # rare at issue 25's shapes: those pads' columns, over the tile's stores
            tl.debug_barrier()
            for j in range(PADS_UNROLLED, more):
                _store_pad_column(j, off, pads, rows, rmask1, gp, zc, dw_ptr, expert_idx_ptr, probs_ptr, dprobs_ptr,
                                  counts_ptr, daux_ptr, dlogits_ptr, E, scale, aux_c, K, HAS_DPROBS, HAS_DAUX)


@triton.jit
def _store_pad_column(j, off, pads, rows, rmask1, gp, zc,
                      dw_ptr,  # [P] fp32 or 16-bit gradient of token rounding's pair weights
                      expert_idx_ptr,  # [P] int32 each pair's expert
                      probs_ptr,  # [T, E] fp32 softmax probabilities
                      dprobs_ptr,  # [T, E] fp32 gradient of the probabilities (HAS_DPROBS)
                      counts_ptr,  # [E] fp32 pairs per expert
                      daux_ptr,  # [] fp32 gradient of the aux loss (HAS_DAUX)
                      dlogits_ptr,  # [T, E] fp32 out
                      E, scale, aux_c, K: tl.constexpr, HAS_DPROBS: tl.constexpr,
                      HAS_DAUX: tl.constexpr):
    """``dlogits[t, e]`` of each token's j-th padded pair, its g summed as the tile's is (the top-k adds nothing
    there: a padded expert is outside the token's top-k)."""
    has, e, v = _pad_grad(j, off, pads, rmask1, dw_ptr, expert_idx_ptr, scale, K)
    pe = tl.load(probs_ptr + rows[:, None] * E + e, mask=has, other=0.0)
    ge = tl.zeros_like(v)
    if HAS_DPROBS:
        ge += tl.load(dprobs_ptr + rows[:, None] * E + e, mask=has, other=0.0)
    ge += v
    if HAS_DAUX:
        ge += (tl.load(daux_ptr) * aux_c) * tl.load(counts_ptr + e, mask=has, other=0.0)
    tl.store(dlogits_ptr + rows[:, None] * E + e, pe * (ge - gp) + zc * pe, mask=has)


def _check_rows(t: torch.Tensor, what: str) -> None:
    """``t`` is ``[T, E]`` fp32 with unit column stride (the kernels' row addressing), else a ValueError naming it."""
    if t.dim() != 2 or t.dtype != torch.float32 or (t.numel() and t.stride(1) != 1):
        raise ValueError(f"{what} must be [T, E] fp32 with unit column stride, got {tuple(t.shape)} {t.dtype}")


def _router_topk_impl(logits: torch.Tensor, top_k: int, renormalize: bool, scale: float, aux_c: float,
                      z_c: float) -> tuple[torch.Tensor, ...]:
    T, E = logits.shape
    dev, f32 = logits.device, torch.float32
    ids = torch.empty(T, top_k, dtype=torch.int32, device=dev)
    weights = torch.empty(T, top_k, dtype=f32, device=dev)
    probs, lse = torch.empty(T, E, dtype=f32, device=dev), torch.empty(T, dtype=f32, device=dev)
    counts, z = torch.empty(E, dtype=f32, device=dev), torch.empty((), dtype=f32, device=dev)
    bt = _block_t(E)
    blocks = cdiv(T, bt)
    part = torch.empty(max(blocks, 1), 2 * E + 1, dtype=f32, device=dev)
    if T == 0:
        part.zero_()
    else:
        launch(router_topk_kernel, (blocks,), logits_ptr=logits, ids_ptr=ids, weights_ptr=weights, probs_ptr=probs,
               lse_ptr=lse, part_ptr=part, T=T, E=E, stride_l_t=logits.stride(0), scale=float(scale), K=top_k,
               KP=next_pow2(top_k), RENORM=renormalize, BLOCK_T=bt,
               BLOCK_E=next_pow2(E), num_warps=_topk_warps(E))
    # one program per 32 experts and one for the z-loss: a single program summing the [num_blocks, 2E+1]
    # partials took 271 µs per step at T 16384, E 512 (H100, ``benchmarks/bench_token_rounding.py
    # speed --breakdown 8``); the sum over column blocks is one fixed-order reduction (bitwise reproducible);
    # each program reads 256 block rows per step: with 32 it took 33 µs at T 32768, E 128
    # (1,024 blocks, 32 dependent steps; H200, ``benchmarks/profile_layer.py ... --timeline``)
    be = min(32, next_pow2(E))
    dot = torch.empty(cdiv(E, be), dtype=f32, device=dev)
    zero = None if aux_c else torch.empty((), dtype=f32, device=dev)  # the kernel's 0 where the aux loss is off
    launch(router_loss_kernel, (dot.numel() + 1,), part_ptr=part, counts_ptr=counts, dot_ptr=dot,
           aux_ptr=dot if zero is None else zero, z_ptr=z, num_blocks=part.shape[0], E=E, aux_c=float(aux_c),
           z_c=float(z_c), BLOCK_B=min(256, next_pow2(part.shape[0])), BLOCK_E=be, num_warps=8)
    # the coefficient is in dot's terms: one launch, where a product after the sum took a second
    aux = dot.sum() if zero is None else zero
    return ids, weights, probs, lse, counts, aux, z


_router_topk_op = torch.library.custom_op(
    "moeblaze::router_topk", _router_topk_impl, mutates_args=(),
    schema="(Tensor logits, int top_k, bool renormalize, float scale, float aux_c, float z_c) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


@_router_topk_op.register_fake
def _(logits, top_k, renormalize, scale, aux_c, z_c):
    T, E = logits.shape
    f32 = dict(dtype=torch.float32)
    return (logits.new_empty(T, top_k, dtype=torch.int32), logits.new_empty(T, top_k, **f32),
            logits.new_empty(T, E, **f32), logits.new_empty(T, **f32), logits.new_empty(E, **f32),
            logits.new_empty((), **f32), logits.new_empty((), **f32))


def router_topk(logits: torch.Tensor, top_k: int, renormalize: bool = False, scale: float = 1.0,
                aux_c: float = 0.0, z_c: float = 0.0) -> tuple[torch.Tensor, ...]:
    """Softmax top-k routing of fp32 ``logits [T, E]`` (contiguous rows, E <= ``MAX_EXPERTS``) in two launches.

    Returns ``(ids [T, K] int32, weights [T, K] fp32, probs [T, E] fp32, lse [T] fp32, counts [E] fp32,
    aux [] fp32, z [] fp32)``: weights are the top-K probabilities, divided by their sum if ``renormalize``,
    times ``scale``; ``counts[e]`` the pairs routed to e; ``aux = aux_c * <counts, sum_t probs_t>``
    (exactly 0 where ``aux_c`` is 0),
    ``z = z_c * sum_t lse_t^2`` (the module docstring gives the coefficients of the usual losses).

    Raises:
        ValueError: ``logits`` not a 2-D fp32 tensor with unit column stride and fewer than ``MAX_ELEMENTS``
            elements, E above ``MAX_EXPERTS``, or ``top_k`` outside ``[1, min(E, MAX_TOP_K)]``.
    """
    _check_rows(logits, "router_topk: logits")
    E = logits.shape[1]
    if not 1 <= E <= MAX_EXPERTS or not 1 <= top_k <= min(E, MAX_TOP_K):
        raise ValueError(f"router_topk: need 1 <= top_k <= E <= {MAX_EXPERTS} and top_k <= {MAX_TOP_K}, got "
                         f"top_k={top_k}, E={E}")
    if logits.numel() >= MAX_ELEMENTS:
        raise ValueError(f"router_topk: logits must have fewer than {MAX_ELEMENTS} elements (int32 offsets), "
                         f"got {tuple(logits.shape)}")
    return call_op(_router_topk_op, _router_topk_impl, logits, top_k, renormalize, scale, aux_c, z_c)


def off_losses(aux: torch.Tensor, z: torch.Tensor, aux_c: float, z_c: float) -> tuple[torch.Tensor, ...]:
    """Of :func:`router_topk`'s losses, those that are off (coefficient 0: exact zeros), for an autograd function to
    mark non-differentiable: a loss that is off asks no backward of the router."""
    return tuple(t for t, c in ((aux, aux_c), (z, z_c)) if not c)


def _router_topk_bwd_impl(probs: torch.Tensor, ids: torch.Tensor, dw: torch.Tensor | None,
                          dprobs: torch.Tensor | None, counts: torch.Tensor, lse: torch.Tensor,
                          daux: torch.Tensor | None, dz: torch.Tensor | None, renormalize: bool, scale: float,
                          aux_c: float, z_c: float, pair_offsets: torch.Tensor | None = None,
                          expert_idx: torch.Tensor | None = None) -> torch.Tensor:
    T, E = probs.shape
    K = ids.shape[1]
    dlogits = torch.empty_like(probs)
    if T == 0:
        return dlogits
    bt = _bwd_block_t(E)
    dummy = probs  # pointer of an absent input (its HAS_* flag is off)
    pairs = pair_offsets is not None
    dw = None if dw is None else dw.contiguous() if pairs else dw.float().contiguous()
    # pads read unrolled per token: 2, or 4 where the pad candidates average over one per token (P - T*K <= J*E)
    unrolled = 4 if pairs and dw.numel() - T * K > T else 2
    launch(router_topk_bwd_kernel, (cdiv(T, bt),), probs_ptr=probs, ids_ptr=ids,
           dw_ptr=dw if dw is not None else dummy, pair_offsets_ptr=pair_offsets if pairs else dummy,
           expert_idx_ptr=expert_idx if pairs else dummy,
           dprobs_ptr=dprobs.float().contiguous() if dprobs is not None else dummy, counts_ptr=counts, lse_ptr=lse,
           daux_ptr=daux.float() if daux is not None else dummy, dz_ptr=dz.float() if dz is not None else dummy,
           dlogits_ptr=dlogits, T=T, E=E, scale=float(scale), aux_c=float(aux_c), z_c=float(z_c), K=K,
           KP=next_pow2(K), RENORM=renormalize, HAS_DW=dw is not None and not pairs, PAIRS=pairs,
           PADS_UNROLLED=unrolled, HAS_DPROBS=dprobs is not None, HAS_DAUX=daux is not None, HAS_DZ=dz is not None,
           BLOCK_T=bt, BLOCK_E=next_pow2(E), num_warps=4)
    return dlogits


_router_topk_bwd_op = torch.library.custom_op(
    "moeblaze::router_topk_backward", _router_topk_bwd_impl, mutates_args=(),
    schema="(Tensor probs, Tensor ids, Tensor? dw, Tensor? dprobs, Tensor counts, Tensor lse, Tensor? daux, "
           "Tensor? dz, bool renormalize, float scale, float aux_c, float z_c, Tensor? pair_offsets=None, "
           "Tensor? expert_idx=None) -> Tensor")


@_router_topk_bwd_op.register_fake
def _(probs, ids, dw, dprobs, counts, lse, daux, dz, renormalize, scale, aux_c, z_c, pair_offsets=None,
      expert_idx=None):
    return torch.empty_like(probs)


def router_topk_backward(probs: torch.Tensor, ids: torch.Tensor, dw: torch.Tensor | None,
                         dprobs: torch.Tensor | None, counts: torch.Tensor, lse: torch.Tensor,
                         daux: torch.Tensor | None, dz: torch.Tensor | None, renormalize: bool, scale: float,
                         aux_c: float, z_c: float, pairs: tuple[torch.Tensor, torch.Tensor] | None = None
                         ) -> torch.Tensor:
    """``dlogits [T, E]`` fp32 of :func:`router_topk` from the gradients of its weights ``dw [T, K]``,
    probabilities ``dprobs [T, E]``, losses ``daux`` and ``dz`` (0-dim; each may be None: no gradient),
    given its saved ``probs``, ``ids``, ``counts``, ``lse`` and the same options. One launch.

    ``pairs = (pair_offsets [T+1] int32, expert_idx [P] int32)``: ``dw [P]`` (fp32 or 16-bit) is instead the
    gradient of token rounding's pair weights (:func:`moeblaze.kernels.pair_list.rounding_place`'s layout: top-k
    pair (t, k) at ``pair_offsets[t] + k``, then t's padded pairs, each weighing ``scale * probs[t, e]``), read
    where it lies: no ``[T, K]`` and ``[T, E]`` gradients written and read back."""
    if pairs is not None and (dw is None or dw.dim() != 1 or pairs[0].shape != (probs.shape[0] + 1,)
                              or pairs[1].shape != dw.shape):
        raise ValueError("router_topk_backward: with pairs, dw and expert_idx must be [P] and pair_offsets [T+1]")
    pair_offsets, expert_idx = pairs if pairs is not None else (None, None)
    return call_op(_router_topk_bwd_op, _router_topk_bwd_impl, probs, ids, dw, dprobs, counts, lse, daux, dz,
                   renormalize, scale, aux_c, z_c, pair_offsets, expert_idx)


@triton.jit
def split16_kernel(
    t_ptr,   # [T, E] fp32, unit column stride
    hl_ptr,  # [T, 2E] 16-bit out: hi | lo
    T, E, stride_t_t,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    mask = (rows < T)[:, None] & (cols < E)[None, :]
    rows = rows.to(tl.int64)  # [T, 2E] may pass 2^31 elements where the router's [T, E] does not
    x = tl.load(t_ptr + rows[:, None] * stride_t_t + cols[None, :], mask=mask, other=0.0)
    hi = x.to(hl_ptr.dtype.element_ty)
    lo = (x - hi.to(tl.float32)).to(hl_ptr.dtype.element_ty)  # exact in fp32: hi is t rounded
    out = hl_ptr + rows[:, None] * (2 * E) + cols[None, :]
    tl.store(out, hi, mask=mask)
    tl.store(out + E, lo, mask=mask)


def _split16_impl(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    T, E = t.shape
    hl = torch.empty(T, 2 * E, dtype=dtype, device=t.device)
    if T:
        be = next_pow2(E)
        bt = max(1, 4096 // be)
        launch(split16_kernel, (cdiv(T, bt),), t_ptr=t, hl_ptr=hl, T=T, E=E, stride_t_t=t.stride(0),
               BLOCK_T=bt, BLOCK_E=be, num_warps=4)
    return hl


_split16_op = torch.library.custom_op("moeblaze::split16", _split16_impl, mutates_args=(),
                                      schema="(Tensor t, ScalarType dtype) -> Tensor")


@_split16_op.register_fake
def _(t, dtype):
    return t.new_empty(t.shape[0], 2 * t.shape[1], dtype=dtype)


def split16(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``t [T, E]`` as ``[hi | lo] [T, 2E]`` in the 16-bit ``dtype``: ``hi = t`` rounded (to nearest even),
    ``lo = t - hi`` rounded, so ``hi + lo`` keeps 16 of fp32's 24 mantissa bits in bf16 (relative error ~2^-16).
    One launch for what took four operations (the router's backward GEMMs sum both terms over K = 2E:
    :class:`moeblaze.routing._RouterLogits`); bitwise the result of ``hl[:, :E] = t; hl[:, E:] = t - hl[:, :E]``.

    Raises:
        ValueError: ``t`` not a 2-D fp32 tensor with unit column stride, or ``dtype`` not bf16 / fp16.
    """
    _check_rows(t, "split16: t")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"split16: dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    return call_op(_split16_op, _split16_impl, t, dtype)
