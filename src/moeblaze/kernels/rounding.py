"""Token rounding's per-expert selections in two launches and its pair list in three more (issue 25; SonicMoE §5
Alg. 4; rules: :mod:`moeblaze.token_rounding`).

After top-k, expert e with ``f_e`` tokens and rounded target ``r_e`` either drops its ``n = f_e - r_e``
lowest-weighted top-k pairs or pads ``n = r_e - f_e`` of its highest-scored tokens outside its top-k. Both
are "the n largest keys" of expert e's keys over the tokens: for a dropping expert the key of a top-k token
is its weight's order key, inverted (the lowest weight ranks first); for a padding expert the key of a token
outside its top-k is its score's order key; every other key is ``-2^31`` (ineligible: eligible keys are
clamped to ``-2^31 + 1``). n is below the tile (``max_n``), a few dozen against T keys, so the keys are
never written out whole:

* :func:`rounding_keys_kernel` (one program per ``BLOCK_T`` tokens and ``BLOCK_E`` experts) computes the keys and writes the
  largest key of each group of ``GROUP`` tokens per expert, ``bmax [E, ceil(T / GROUP)]`` (rows of experts
  with ``f_e == r_e`` not written).
* :func:`rounding_select_kernel` (one program per expert) finds the n-th largest group maximum ``L`` (a
  32-step binary search on its bits). Every key at or above the n-th largest key is at or above ``L`` and
  so in a group whose maximum is; the candidate groups are those above ``L`` and the first n equal to it
  (ties among group maxima: the first n hold every tied key that can be selected), at most ``2n - 1``
  groups. Their tokens' keys, recomputed from the scores, ids and weights, give the n-th largest key and
  the selection in token order: every key above it and, of the keys equal to it, the lowest tokens (ties:
  the lower token first, in both selections). Dropped pairs get the expert id E in ``kept [T, K]``; padded
  pairs are marked in ``pad_mask [T, E]`` (uint8, 1 where expert e pads token t) and listed, ascending, in
  ``pad_tok [J, E]`` (-1 after the last).

Then the pair list, in token order without a sort (:func:`rounding_place`): token t's pairs are its K top-k
pairs, its padded pairs in expert order and ``fill_t`` unused entries, ``fill_t = floor(U (t+1) / T) - floor(U t
/ T)`` spreading the ``U = J*E - sum(pad_mask)`` unused pad candidates over the tokens (a static ``P = T*K +
J*E``; no token gets them all). :func:`rounding_pad_count_kernel` counts each token's padded pairs (row sums of
the mask) and each block's; :func:`rounding_place_kernel` adds the sums of the blocks before its own (at most
``T / 16`` of them), scans its tokens' pair counts and writes the top-k pairs, the unused entries and the pair CSR
``pair_offsets [T+1]``; :func:`rounding_pad_place_kernel` (one program per expert) puts each padded pair at its
token's offset plus K plus the token's padded pairs of lower experts. This replaces a stable radix sort of the
``J*E`` pad entries by token, a binary search per token and three scatters: 6.3 µs per step for the three launches
against 17.1 + 4.6 µs for the sort and the search plus Inductor's scatters at T 16384, E 128, K 2; a first form
scanning ``[BLOCK_T, E]`` mask tiles for the pads' ranks in one launch took 9.5-10.4 µs (H200, 2026-11-26,
``python3 benchmarks/bench_token_rounding.py speed --shapes 0 --variants none --breakdown 40``).

No sort, no atomics, no host synchronisation. The order key of a float is its bit pattern as int32 with the
lower 31 bits flipped for negative values (monotone in the value; ``-0.0`` is made ``+0.0`` first, NaN
ranks above +inf). The PyTorch path of :func:`moeblaze.round_tokens` uses the same keys and tie rule, so
both give the same pairs. The select kernel holds ``ceil(T / GROUP)`` group maxima and ``2 * max_n * GROUP``
candidate keys in registers, where the first version held the whole row of T keys and searched it: 47 and
264 µs per layer step at T 16384 with E 128, K 2 and E 512, K 10 against 19 and 51 µs now, the keys kernel 5
and 79 µs writing ``[E, T]`` against 6 and 39 now (H200, 2026-11-26, ``python3 benchmarks/bench_token_rounding.py
speed --shapes 0,2 --breakdown 22``, same-day calls).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .custom_ops import call_op
from .direct import launch
from .tuning import cdiv, next_pow2

MAX_TOKENS = 65536  # T; the select kernel holds T / GROUP group maxima (4,096 at most) in registers
MAX_TOP_K = 16  # the top-k loops are unrolled
GROUP = 16  # tokens per group maximum: T / 16 maxima to search, 16 keys per candidate group
_INELIGIBLE = tl.constexpr(-2147483647 - 1)


@triton.jit
def _order_key(x):
    """fp32 -> int32 key, monotone in x (``-0.0`` as ``+0.0``)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _drop_key(w):
    """Key of a top-k pair of a dropping expert from its fp32 weight: ~key, the lowest weight ranks first."""
    return tl.maximum(_order_key(w) ^ -1, -2147483647)


@triton.jit
def _pad_key(s):
    """Key of a token outside a padding expert's top-k from its fp32 score."""
    return tl.maximum(_order_key(s), -2147483647)


@triton.jit
def _nth_largest(key, n):
    """The n-th largest of the int32 ``key`` (1 <= n <= key's size): the largest v with ``#(key >= v) >= n``,
    bit by bit on key + 2^31 (unsigned), 32 counts. Two bits per step (three counts packed in one int64
    reduction, 16 serial reductions) measured slower on a whole row: 41 against 35 µs at E 128 and 261 against
    242 µs at E 512 (H100, 2026-11-25, ``python3 benchmarks/bench_token_rounding.py rounding``), and level on the
    select kernel's 1,024-4,096 keys: 30.2 against 31.7 µs at E 128, 42.6 against 41.6 at E 256 (H200, 2026-11-26,
    ``... select --warps 4``, both launches). A radix select of four 8-bit ``tl.histogram`` rounds took the select
    kernel from 17.6 to 44.4 µs at T 16384, E 128, K 2 (H200, 2026-11-26, ``... speed --shapes 0 --variants none
    --breakdown 40``)."""
    v = tl.zeros((), dtype=tl.int64)
    one = tl.full((), 1, tl.int64)
    for b in range(31, -1, -1):
        cand = v | (one << b)
        if tl.sum((key >= (cand - 2147483648).to(tl.int32)).to(tl.int32), axis=0) >= n:
            v = cand
    return (v - 2147483648).to(tl.int32)


@triton.jit
def rounding_keys_kernel(
    scores_ptr,   # [T, E] float router scores
    ids_ptr,      # [T, K] int top-k expert ids
    weights_ptr,  # [T, K] float top-k weights
    counts_ptr,   # [E] int32 top-k token counts f_e
    target_ptr,   # [E] int32 rounded counts r_e
    bmax_ptr,     # [E, NB] int32 out: largest key of each group of GROUP tokens (rows with f_e == r_e not written)
    kept_ptr,     # [T, K] int32 out: the top-k ids (written by the first column of programs; the select drops)
    T, E, NB, stride_s_t, stride_ids_t, stride_w_t,
    K: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    rmask, cmask = rows < T, cols < E
    f = tl.load(counts_ptr + cols, mask=cmask, other=0)
    r = tl.load(target_ptr + cols, mask=cmask, other=0)
    chosen = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
    w = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for k in tl.static_range(K):
        idk = tl.load(ids_ptr + rows * stride_ids_t + k, mask=rmask, other=-1).to(tl.int32)
        if tl.program_id(1) == 0:
            tl.store(kept_ptr + rows * K + k, idk, mask=rmask)
        wk = tl.load(weights_ptr + rows * stride_w_t + k, mask=rmask, other=0.0).to(tl.float32)
        hit = idk[:, None] == cols[None, :]
        chosen = chosen | hit
        w = tl.where(hit, wk[:, None], w)
    mask = rmask[:, None] & cmask[None, :]
    s = tl.load(scores_ptr + rows[:, None] * stride_s_t + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    key = tl.where((f > r)[None, :], tl.where(chosen, _drop_key(w), _INELIGIBLE),
                   tl.where(chosen, _INELIGIBLE, _pad_key(s)))
    key = tl.where(mask, key, _INELIGIBLE)
    gmax = tl.max(tl.reshape(key, (BLOCK_T // GROUP, GROUP, BLOCK_E)), axis=1)  # [BLOCK_T // GROUP, BLOCK_E]
    g = tl.program_id(0) * (BLOCK_T // GROUP) + tl.arange(0, BLOCK_T // GROUP)
    tl.store(bmax_ptr + cols[None, :] * NB + g[:, None], gmax, mask=(g < NB)[:, None] & (cmask & (f != r))[None, :])


@triton.jit
def _candidate_keys(toks, valid, e, dropping, scores_ptr, ids_ptr, weights_ptr, stride_s_t, stride_ids_t,
                    stride_w_t, K: tl.constexpr):
    """Expert e's keys of the tokens ``toks`` (as :func:`rounding_keys_kernel`'s) and, of a top-k token, the k
    of its pair (``(key, kk)``, both int32, ``toks``' shape)."""
    kk = tl.zeros_like(toks)
    chosen = kk != 0
    w = tl.zeros_like(toks).to(tl.float32)
    for k in tl.static_range(K):
        hit = tl.load(ids_ptr + toks * stride_ids_t + k, mask=valid, other=-1).to(tl.int32) == e
        chosen = chosen | hit
        kk = tl.where(hit, k, kk)
        w = tl.where(hit, tl.load(weights_ptr + toks * stride_w_t + k, mask=hit, other=0.0).to(tl.float32), w)
    if dropping:
        key = tl.where(chosen, _drop_key(w), _INELIGIBLE)
    else:
        free = valid & ~chosen
        s = tl.load(scores_ptr + toks * stride_s_t + e, mask=free, other=0.0).to(tl.float32)
        key = tl.where(free, _pad_key(s), _INELIGIBLE)
    return key, kk


@triton.jit
def _select_candidates(e, n, dropping, ncb, T, E, cand_ptr, scores_ptr, ids_ptr, weights_ptr, kept_ptr, pad_mask_ptr,
                       pad_tok_ptr,
                       stride_s_t, stride_ids_t, stride_w_t, K: tl.constexpr, GROUP: tl.constexpr,
                       CAND: tl.constexpr, BLOCKS: tl.constexpr):
    """The selection among the tokens of expert e's first ``ncb <= BLOCKS`` candidate groups (ascending in
    ``cand_ptr``'s row e, so the candidates are in token order), and its stores."""
    i = tl.arange(0, BLOCKS * GROUP)
    c = i // GROUP
    toks = tl.load(cand_ptr + e * CAND + c, mask=c < ncb, other=0) * GROUP + i % GROUP
    valid = (c < ncb) & (toks < T)
    key, kk = _candidate_keys(toks, valid, e, dropping, scores_ptr, ids_ptr, weights_ptr, stride_s_t, stride_ids_t,
                              stride_w_t, K)
    v = _nth_largest(key, n)
    above = key > v
    ties = key == v
    need = n - tl.sum(above.to(tl.int32), axis=0)
    sel = valid & (above | (ties & (tl.cumsum(ties.to(tl.int32), axis=0) <= need)))
    if dropping:  # the pair (t, kk) of each selected token t
        tl.store(kept_ptr + toks * K + kk, tl.full(toks.shape, E, tl.int32), mask=sel)
    else:
        tl.store(pad_mask_ptr + toks * E + e, tl.full(toks.shape, 1, tl.uint8), mask=sel)
        tl.store(pad_tok_ptr + (tl.cumsum(sel.to(tl.int32), axis=0) - 1) * E + e, toks, mask=sel)  # ascending


@triton.jit
def rounding_select_kernel(
    scores_ptr,   # [T, E] float router scores
    ids_ptr,      # [T, K] int top-k expert ids
    weights_ptr,  # [T, K] float top-k weights
    bmax_ptr,     # [E, NB] int32 group maxima of the keys (rounding_keys_kernel)
    cand_ptr,     # [E, CAND] int32 scratch: each expert's candidate groups, ascending
    counts_ptr,   # [E] int32 top-k token counts f_e
    target_ptr,   # [E] int32 rounded counts r_e
    kept_ptr,     # [T, K] int32 in/out: the top-k ids (rounding_keys_kernel's copy); dropped pairs set to E
    pad_mask_ptr, # [T, E] uint8 in/out (zeros in): 1 where expert e pads token t
    pad_tok_ptr,  # [J, E] int32 out: the tokens expert e pads, ascending, then -1
    T, E, J, NB, stride_s_t, stride_ids_t, stride_w_t,
    K: tl.constexpr, GROUP: tl.constexpr, BLOCK_NB: tl.constexpr, CAND: tl.constexpr, BLOCK_J: tl.constexpr,
):
    e = tl.program_id(0)
    f = tl.load(counts_ptr + e)
    r = tl.load(target_ptr + e)
    n = tl.abs(f - r)
    if n > 0:
        b = tl.arange(0, BLOCK_NB)
        bm = tl.load(bmax_ptr + e * NB + b, mask=b < NB, other=_INELIGIBLE)
        lo = _nth_largest(bm, n)
        eq = bm == lo
        cand = (bm > lo) | (eq & (tl.cumsum(eq.to(tl.int32), axis=0) <= n))  # at most 2n - 1 groups
        ncb = tl.sum(cand.to(tl.int32), axis=0)
        tl.store(cand_ptr + e * CAND + tl.cumsum(cand.to(tl.int32), axis=0) - 1, b, mask=cand)
        tl.debug_barrier()  # the row of candidates, written by all threads, read by all
        if ncb <= CAND // 2:  # the usual case for nr (n < tile / 2): half the candidate keys to search
            _select_candidates(e, n, f > r, ncb, T, E, cand_ptr, scores_ptr, ids_ptr, weights_ptr, kept_ptr,
                               pad_mask_ptr, pad_tok_ptr, stride_s_t, stride_ids_t, stride_w_t, K, GROUP, CAND, CAND // 2)
        else:
            _select_candidates(e, n, f > r, ncb, T, E, cand_ptr, scores_ptr, ids_ptr, weights_ptr, kept_ptr,
                               pad_mask_ptr, pad_tok_ptr, stride_s_t, stride_ids_t, stride_w_t, K, GROUP, CAND, CAND)
    jj = tl.arange(0, BLOCK_J)
    tl.store(pad_tok_ptr + jj * E + e, tl.full(jj.shape, -1, tl.int32), mask=(jj >= tl.where(r > f, n, 0)) & (jj < J))


def _select_warps(nb: int) -> int:
    """Warps of the select kernel for ``nb`` group maxima: 4 to 16 warps moved ``rounding_select`` by under 10%
    at T 4096-65536 (H200, 2026-11-26, ``python3 benchmarks/bench_token_rounding.py select``'s method)."""
    return 4 if nb <= 1024 else 8


def _keys_block(E: int, K: int) -> tuple[int, int]:
    """``(BLOCK_T, BLOCK_E)`` of the keys kernel: one group of tokens by at most ``384 / K`` experts (triton 3.6's
    ptxas for sm_90: 96 to 126 registers at K 2 to 10, where all E in one program took 255 and spilled, and took 80 µs
    per layer step at T 16384, E 512, K 10 on an H200, 2026-11-26, ``python3
    benchmarks/bench_token_rounding.py speed --shapes 0,2 --breakdown 22``: too few warps per SM to hide the
    score loads)."""
    cap = 1 << max(4, (384 // K).bit_length() - 1)
    return GROUP, min(next_pow2(E), 128, cap)


def _select_impl(scores: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor,
                 target: torch.Tensor, J: int, max_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T, E = scores.shape
    K = ids.shape[1]
    kept = torch.empty(T, K, dtype=torch.int32, device=scores.device)  # the keys kernel copies ids in
    pad_mask = torch.zeros(T, E, dtype=torch.uint8, device=scores.device)
    pad_tok = torch.empty(J, E, dtype=torch.int32, device=scores.device)
    if T == 0:
        return kept, pad_mask, pad_tok
    nb = cdiv(T, GROUP)
    bmax = torch.empty(E, nb, dtype=torch.int32, device=scores.device)
    cand = max(2, next_pow2(2 * max(max_n, 1) - 1))  # the candidate groups of an expert: at most 2n - 1
    cand_groups = torch.empty(E, cand, dtype=torch.int32, device=scores.device)
    block_t, block_e = _keys_block(E, K)
    launch(rounding_keys_kernel, (cdiv(T, block_t), cdiv(E, block_e)), scores_ptr=scores, ids_ptr=ids, weights_ptr=weights,
           counts_ptr=counts, target_ptr=target, bmax_ptr=bmax, kept_ptr=kept, T=T, E=E, NB=nb, stride_s_t=scores.stride(0),
           stride_ids_t=ids.stride(0), stride_w_t=weights.stride(0), K=K, GROUP=GROUP, BLOCK_T=block_t,
           BLOCK_E=block_e, num_warps=4)
    launch(rounding_select_kernel, (E,), scores_ptr=scores, ids_ptr=ids, weights_ptr=weights, bmax_ptr=bmax,
           cand_ptr=cand_groups, counts_ptr=counts, target_ptr=target, kept_ptr=kept, pad_mask_ptr=pad_mask,
           pad_tok_ptr=pad_tok, T=T, E=E, J=J, NB=nb, stride_s_t=scores.stride(0), stride_ids_t=ids.stride(0),
           stride_w_t=weights.stride(0), K=K, GROUP=GROUP, BLOCK_NB=next_pow2(nb), CAND=cand,
           BLOCK_J=next_pow2(max(J, 1)), num_warps=_select_warps(nb))
    return kept, pad_mask, pad_tok


_select_op = torch.library.custom_op(
    "moeblaze::rounding_select", _select_impl, mutates_args=(),
    schema="(Tensor scores, Tensor ids, Tensor weights, Tensor counts, Tensor target, int J, int max_n) -> "
           "(Tensor, Tensor, Tensor)")


@_select_op.register_fake
def _(scores, ids, weights, counts, target, J, max_n):
    return (ids.new_empty(ids.shape, dtype=torch.int32), scores.new_empty(scores.shape, dtype=torch.uint8),
            ids.new_empty(J, scores.shape[1], dtype=torch.int32))


def rounding_select(scores: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor,
                    target: torch.Tensor, J: int, max_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token rounding's drops and pads (module docstring) in two launches.

    Args:
        scores: ``[T, E]`` float router scores (unit column stride). ids: ``[T, K]`` int top-k ids (unit column
            stride, distinct per row). weights: ``[T, K]`` float top-k weights (unit column stride).
        counts: ``[E]`` int32 ``f_e``. target: ``[E]`` int32 ``r_e`` with ``r_e - f_e <= J``, ``r_e <= T``.
        J: pad candidates per expert. max_n: the most tokens one expert drops or pads, ``|r_e - f_e| <= max_n``
            for every e (``tile - 1`` serves every mode); the select kernel holds ``2 * max_n * GROUP``
            candidate keys.

    Returns:
        ``(kept [T, K] int32, pad_mask [T, E] uint8, pad_tok [J, E] int32)``: the ids with dropped pairs set to
        E; 1 where expert e pads token t (``r_e - f_e`` ones in column e where that is positive), else 0; the
        tokens expert e pads in column e, ascending, then -1.

    Raises:
        ValueError: shapes or dtypes other than above, T above ``MAX_TOKENS``, K above ``MAX_TOP_K``, ``max_n``
            below 0.
    """
    T, E = scores.shape if scores.dim() == 2 else (-1, -1)
    if scores.dim() != 2 or ids.dim() != 2 or ids.shape[0] != T or tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"rounding_select: scores must be [T, E], ids and weights [T, K], got "
                         f"{tuple(scores.shape)}, {tuple(ids.shape)}, {tuple(weights.shape)}")
    if T > MAX_TOKENS or not 1 <= ids.shape[1] <= MAX_TOP_K:
        raise ValueError(f"rounding_select: need T <= {MAX_TOKENS} and 1 <= K <= {MAX_TOP_K}, got T={T}, "
                         f"K={ids.shape[1]}")
    if any(t.numel() and t.stride(-1) != 1 for t in (scores, ids, weights)):
        raise ValueError("rounding_select: scores, ids and weights need unit column stride")
    if counts.shape != (E,) or target.shape != (E,) or counts.dtype != torch.int32 or target.dtype != torch.int32:
        raise ValueError(f"rounding_select: counts and target must be [E={E}] int32, got {tuple(counts.shape)} "
                         f"{counts.dtype} and {tuple(target.shape)} {target.dtype}")
    if max_n < 0:
        raise ValueError(f"rounding_select: max_n (the most tokens one expert drops or pads) must be >= 0, got {max_n}")
    return call_op(_select_op, _select_impl, scores, ids, weights, counts, target, J, max_n)


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
    pads_ptr,          # [T] int32: padded pairs of each token
    block_pads_ptr,    # [NBT] int32: padded pairs per block of BLOCK_T tokens
    token_idx_ptr,     # [P] int32 out: each pair's token, ascending (padded pairs: rounding_pad_place_kernel)
    expert_idx_ptr,    # [P] int32 out: each pair's expert, E for dropped and unused pairs
    src_ptr,           # [P] int64 out: t*K + k for top-k pairs, T*K + t*E + e for padded ones, 0 for unused
    pair_offsets_ptr,  # [T+1] int32 out: first pair of each token; P at T
    T, NBT, UNUSED_MAX, MAX_FILL, UNUSED_E,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_NBT: tl.constexpr,
):
    b = tl.program_id(0)
    nbt = tl.arange(0, BLOCK_NBT)
    block_pads = tl.load(block_pads_ptr + nbt, mask=nbt < NBT, other=0)
    unused = (UNUSED_MAX - tl.sum(block_pads, axis=0)).to(tl.int64)  # U = J*E - padded pairs
    rows = b * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    pads = tl.load(pads_ptr + rows, mask=rmask, other=0)
    fill_before = (unused * rows) // T  # unused entries of the tokens before t (spread evenly)
    fill = ((unused * (rows + 1)) // T - fill_before).to(tl.int32)
    n = tl.where(rmask, K + pads + fill, 0)
    first = b * BLOCK_T * K + tl.sum(tl.where(nbt < b, block_pads, 0), axis=0) + (unused * b * BLOCK_T) // T
    off = (first + tl.cumsum(n, axis=0) - n).to(tl.int32)  # pair_offsets of this block's tokens
    tl.store(pair_offsets_ptr + rows, off, mask=rmask)
    tl.store(pair_offsets_ptr + rows + 1, off + n, mask=rows == T - 1)
    for k in tl.static_range(K):  # the top-k pairs, in k order
        tl.store(token_idx_ptr + off + k, rows, mask=rmask)
        tl.store(expert_idx_ptr + off + k, tl.load(kept_ptr + rows * K + k, mask=rmask, other=0), mask=rmask)
        tl.store(src_ptr + off + k, rows.to(tl.int64) * K + k, mask=rmask)
    for i in range(MAX_FILL):  # after the padded pairs, the unused entries: expert E, weight index 0
        q = off + K + pads + i
        use = rmask & (i < fill)
        tl.store(token_idx_ptr + q, rows, mask=use)
        tl.store(expert_idx_ptr + q, tl.full(q.shape, 0, tl.int32) + UNUSED_E, mask=use)
        tl.store(src_ptr + q, tl.zeros(q.shape, tl.int64), mask=use)


@triton.jit
def rounding_pad_place_kernel(
    pad_mask_ptr,      # [T, E] uint8: 1 where expert e pads token t
    pad_tok_ptr,       # [J, E] int32: the tokens expert e pads, ascending, then -1
    pair_offsets_ptr,  # [T+1] int32: first pair of each token (rounding_place_kernel)
    token_idx_ptr,     # [P] int32 out: the padded pairs' tokens
    expert_idx_ptr,    # [P] int32 out: the padded pairs' experts
    src_ptr,           # [P] int64 out: T*K + t*E + e
    T, E, J, K,
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
    tl.store(src_ptr + pos, T * K + t.to(tl.int64) * E + e, mask=valid)


def _place_block_t(E: int) -> int:
    """Tokens per program of the count kernel (``[BLOCK_T, E]`` tiles of 8,192 mask bytes, 16 to 128 tokens) and of
    the place kernel, whose every program adds the block sums before its own (T / BLOCK_T loads)."""
    return max(16, min(128, 8192 // next_pow2(E)))


def _place_impl(kept: torch.Tensor, pad_mask: torch.Tensor, pad_tok: torch.Tensor) -> tuple[torch.Tensor, ...]:
    (T, K), (J, E) = kept.shape, pad_tok.shape
    P, dev = T * K + J * E, kept.device
    token_idx = torch.empty(P, dtype=torch.int32, device=dev)
    expert_idx = torch.empty(P, dtype=torch.int32, device=dev)
    src = torch.empty(P, dtype=torch.int64, device=dev)
    if T == 0:
        return token_idx, expert_idx, src, torch.zeros(1, dtype=torch.int32, device=dev)
    pair_offsets = torch.empty(T + 1, dtype=torch.int32, device=dev)  # every entry written by the place kernel
    block_t, block_e = _place_block_t(E), next_pow2(E)
    nbt = cdiv(T, block_t)
    pads = torch.empty(T, dtype=torch.int32, device=dev)
    block_pads = torch.empty(nbt, dtype=torch.int32, device=dev)
    launch(rounding_pad_count_kernel, (nbt,), pad_mask_ptr=pad_mask, pads_ptr=pads, block_pads_ptr=block_pads, T=T,
           E=E, BLOCK_T=block_t, BLOCK_E=block_e, num_warps=4)
    launch(rounding_place_kernel, (nbt,), kept_ptr=kept, pads_ptr=pads, block_pads_ptr=block_pads,
           token_idx_ptr=token_idx, expert_idx_ptr=expert_idx, src_ptr=src, pair_offsets_ptr=pair_offsets, T=T,
           NBT=nbt, UNUSED_MAX=J * E, MAX_FILL=cdiv(J * E, T), UNUSED_E=E, K=K, BLOCK_T=block_t,
           BLOCK_NBT=next_pow2(nbt), num_warps=4)
    if J:
        launch(rounding_pad_place_kernel, (E,), pad_mask_ptr=pad_mask, pad_tok_ptr=pad_tok,
               pair_offsets_ptr=pair_offsets, token_idx_ptr=token_idx, expert_idx_ptr=expert_idx, src_ptr=src, T=T,
               E=E, J=J, K=K, BLOCK_J=next_pow2(J), CHUNK_E=min(block_e, 32), num_warps=4)
    return token_idx, expert_idx, src, pair_offsets


_place_op = torch.library.custom_op(
    "moeblaze::rounding_place", _place_impl, mutates_args=(),
    schema="(Tensor kept, Tensor pad_mask, Tensor pad_tok) -> (Tensor, Tensor, Tensor, Tensor)")


@_place_op.register_fake
def _(kept, pad_mask, pad_tok):
    P = kept.numel() + pad_tok.numel()
    return (kept.new_empty(P), kept.new_empty(P), kept.new_empty(P, dtype=torch.int64),
            kept.new_empty(kept.shape[0] + 1))


def rounding_place(kept: torch.Tensor, pad_mask: torch.Tensor, pad_tok: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Token rounding's pair list in token order (module docstring), in three launches, no host synchronisation.

    Args:
        kept: ``[T, K]`` int32 top-k ids with dropped pairs set to E. pad_mask: ``[T, E]`` uint8, 1 where expert e
            pads token t. pad_tok: ``[J, E]`` int32, the tokens of column e's ones, ascending, then -1 (J: pad
            candidates per expert). All contiguous (:func:`rounding_select`'s outputs).

    Returns:
        ``(token_idx [P] int32, expert_idx [P] int32, src [P] int64, pair_offsets [T+1] int32)``, ``P = T*K +
        J*E``: per token its K top-k pairs, its padded pairs in expert order, then its share of the unused
        entries (expert E); ``src`` indexes each pair's weight in ``cat(topk_weights.flatten(),
        scores.flatten())`` (0 for unused entries); ``pair_offsets`` is the CSR of :mod:`moeblaze.general_routing`.

    Raises:
        ValueError: shapes or dtypes other than above.
    """
    if kept.dim() != 2 or pad_mask.dim() != 2 or pad_tok.dim() != 2 or pad_mask.shape[0] != kept.shape[0] or \
            pad_tok.shape[1] != pad_mask.shape[1]:
        raise ValueError(f"rounding_place: kept must be [T, K], pad_mask [T, E] and pad_tok [J, E], got "
                         f"{tuple(kept.shape)}, {tuple(pad_mask.shape)} and {tuple(pad_tok.shape)}")
    if kept.dtype != torch.int32 or pad_mask.dtype != torch.uint8 or pad_tok.dtype != torch.int32 or not all(
            t.is_contiguous() for t in (kept, pad_mask, pad_tok)):
        raise ValueError(f"rounding_place: kept and pad_tok must be contiguous int32 and pad_mask contiguous uint8, "
                         f"got {kept.dtype}, {pad_tok.dtype} and {pad_mask.dtype}")
    return call_op(_place_op, _place_impl, kept, pad_mask, pad_tok)
