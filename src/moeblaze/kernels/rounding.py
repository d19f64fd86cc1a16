"""Token rounding's per-expert selections in two launches (issue 25; SonicMoE §5 Alg. 4; rules:
:mod:`moeblaze.token_rounding`).

After top-k, expert e with ``f_e`` tokens and rounded target ``r_e`` either drops its ``f_e - r_e``
lowest-weighted top-k pairs or pads ``r_e - f_e`` of its highest-scored tokens outside its top-k. Both are
"the n largest keys of a row" of one ``[E, T]`` int32 matrix:

* :func:`rounding_keys_kernel` (one program per ``BLOCK_T`` tokens, all E): for a dropping expert the
  key of a top-k token is its weight's order key, inverted (the lowest weight ranks first); for a padding
  expert the key of a token outside its top-k is its score's order key; every other entry is ``-2^31``
  (ineligible: eligible keys are clamped to ``-2^31 + 1``).
  Rows of experts with nothing to select are not written.
* :func:`rounding_select_kernel` (one program per expert, the row in registers): the n-th largest key by
  a 32-step binary search on its bits (counts of keys at or above a candidate), then the selection in token
  order: every key above it and, of the keys equal to it, the lowest tokens (ties: the lower token first, in
  both selections). Dropped pairs get the expert id E in ``kept [T, K]``; padded tokens go, ascending, into
  ``pad_tok [J, E]`` (its unused entries hold the spread filler ``(j*E + e) % T``).

No sort, no atomics, no host synchronisation. The order key of a float is its bit pattern as int32 with the
lower 31 bits flipped for negative values (monotone in the value; ``-0.0`` is made ``+0.0`` first, NaN
ranks above +inf). The PyTorch path of :func:`moeblaze.round_tokens` uses the same keys and tie rule, so
both give the same pairs. Rows up to ``MAX_TOKENS`` tokens (a row lives in the registers of one program).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .custom_ops import call_op
from .direct import launch
from .tuning import cdiv, next_pow2

MAX_TOKENS = 65536  # 16 warps x 128 keys per thread (a row in the registers of one program)
MAX_TOP_K = 16  # the top-k loop is unrolled


@triton.jit
def _order_key(x):
    """fp32 -> int32 key, monotone in x (``-0.0`` as ``+0.0``)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def rounding_keys_kernel(
    scores_ptr,   # [T, E] float router scores
    ids_ptr,      # [T, K] int top-k expert ids
    weights_ptr,  # [T, K] float top-k weights
    counts_ptr,   # [E] int32 top-k token counts f_e
    target_ptr,   # [E] int32 rounded counts r_e
    keys_ptr,     # [E, T] int32 out: selection keys (rows of experts with f_e == r_e not written)
    T, E, stride_s_t, stride_ids_t, stride_w_t,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    rmask, cmask = rows < T, cols < E
    f = tl.load(counts_ptr + cols, mask=cmask, other=0)
    r = tl.load(target_ptr + cols, mask=cmask, other=0)
    chosen = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
    w = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for k in tl.static_range(K):
        idk = tl.load(ids_ptr + rows * stride_ids_t + k, mask=rmask, other=-1).to(tl.int32)
        wk = tl.load(weights_ptr + rows * stride_w_t + k, mask=rmask, other=0.0).to(tl.float32)
        hit = idk[:, None] == cols[None, :]
        chosen = chosen | hit
        w = tl.where(hit, wk[:, None], w)
    mask = rmask[:, None] & cmask[None, :]
    s = tl.load(scores_ptr + rows[:, None] * stride_s_t + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    drop_key = tl.maximum(_order_key(w) ^ -1, -2147483647)  # ~key: the lowest weight ranks first
    pad_key = tl.maximum(_order_key(s), -2147483647)
    none = tl.full((BLOCK_T, BLOCK_E), -2147483647 - 1, tl.int32)  # ineligible
    key = tl.where((f > r)[None, :], tl.where(chosen, drop_key, none), tl.where(chosen, none, pad_key))
    tl.store(keys_ptr + cols[None, :] * T + rows[:, None], key, mask=mask & (f != r)[None, :])


@triton.jit
def rounding_select_kernel(
    keys_ptr,     # [E, T] int32 selection keys (rounding_keys_kernel)
    counts_ptr,   # [E] int32 top-k token counts f_e
    target_ptr,   # [E] int32 rounded counts r_e
    ids_ptr,      # [T, K] int top-k expert ids
    kept_ptr,     # [T, K] int32 in/out: the top-k ids; dropped pairs set to E
    pad_tok_ptr,  # [J, E] int32 out: padded tokens of each expert, ascending, then the filler
    T, E, J, stride_ids_t,
    K: tl.constexpr, BLOCK_T: tl.constexpr,
):
    e = tl.program_id(0)
    f = tl.load(counts_ptr + e)
    r = tl.load(target_ptr + e)
    n = tl.abs(f - r)
    toks = tl.arange(0, BLOCK_T)
    if n > 0:
        key = tl.load(keys_ptr + e * T + toks, mask=toks < T, other=-2147483647 - 1)
        # the n-th largest key v: the largest v with #(key >= v) >= n, bit by bit on key + 2^31 (unsigned).
        # Two bits per step (three counts packed in one int64 reduction, 16 serial reductions) measured slower:
        # 41 against 35 µs at E 128 and 261 against 242 µs at E 512 (H100, 2026-11-25, ``... rounding``)
        v = tl.zeros((), dtype=tl.int64)
        one = tl.full((), 1, tl.int64)
        for b in range(31, -1, -1):
            cand = v | (one << b)
            if tl.sum((key >= (cand - 2147483648).to(tl.int32)).to(tl.int32), axis=0) >= n:
                v = cand
        v32 = (v - 2147483648).to(tl.int32)
        above = key > v32
        ties = key == v32
        tie_rank = tl.cumsum(ties.to(tl.int32), axis=0) - 1
        sel = above | (ties & (tie_rank < n - tl.sum(above.to(tl.int32), axis=0)))
        if f > r:  # drop: the pair (t, k) of expert e of each selected token t
            for k in tl.static_range(K):
                idk = tl.load(ids_ptr + toks * stride_ids_t + k, mask=sel, other=-1).to(tl.int32)
                tl.store(kept_ptr + toks * K + k, tl.full((BLOCK_T,), E, tl.int32), mask=sel & (idk == e))
        else:  # pad: the selected tokens, ascending, at j = their rank
            j = tl.cumsum(sel.to(tl.int32), axis=0) - 1
            tl.store(pad_tok_ptr + j * E + e, toks, mask=sel)
    padded = tl.where(r > f, n, 0)
    filler = (toks * E + e) % T  # unused candidates spread over the tokens (no token gets them all)
    tl.store(pad_tok_ptr + toks * E + e, filler, mask=(toks >= padded) & (toks < J))


def _select_warps(row: int) -> int:
    """Warps of the select kernel for a row of ``row`` keys: 64 keys per thread, 4 to 16 warps. In the layer
    (H100, 2026-11-25, ``benchmarks/bench_token_rounding.py speed --breakdown 8``) the kernel took 46.5 µs per
    step with 8 warps and 69.1 µs with 4 at T 16384, E 128, and 252 against 353 µs at E 512; 32 warps timed
    slowest of 2 to 32 at E 128 (``... select --warps 2,4,8,16,32``; each serial reduction waits on every warp)."""
    return max(4, min(16, row // 2048))


def _select_impl(scores: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor,
                 target: torch.Tensor, J: int) -> tuple[torch.Tensor, torch.Tensor]:
    T, E = scores.shape
    K = ids.shape[1]
    kept = torch.empty(T, K, dtype=torch.int32, device=scores.device).copy_(ids)
    pad_tok = torch.empty(J, E, dtype=torch.int32, device=scores.device)
    if T == 0:
        return kept, pad_tok
    keys = torch.empty(E, T, dtype=torch.int32, device=scores.device)
    block_e = next_pow2(E)
    block_t = max(1, min(64, 8192 // block_e))  # ~8192 entries per program
    launch(rounding_keys_kernel, (cdiv(T, block_t),), scores_ptr=scores, ids_ptr=ids, weights_ptr=weights,
           counts_ptr=counts, target_ptr=target, keys_ptr=keys, T=T, E=E, stride_s_t=scores.stride(0),
           stride_ids_t=ids.stride(0), stride_w_t=weights.stride(0), K=K, BLOCK_T=block_t, BLOCK_E=block_e,
           num_warps=4)
    row = next_pow2(max(T, J))
    launch(rounding_select_kernel, (E,), keys_ptr=keys, counts_ptr=counts, target_ptr=target, ids_ptr=ids,
           kept_ptr=kept, pad_tok_ptr=pad_tok, T=T, E=E, J=J, stride_ids_t=ids.stride(0), K=K,
           BLOCK_T=row, num_warps=_select_warps(row))
    return kept, pad_tok


_select_op = torch.library.custom_op(
    "moeblaze::rounding_select", _select_impl, mutates_args=(),
    schema="(Tensor scores, Tensor ids, Tensor weights, Tensor counts, Tensor target, int J) -> (Tensor, Tensor)")


@_select_op.register_fake
def _(scores, ids, weights, counts, target, J):
    return ids.new_empty(ids.shape, dtype=torch.int32), ids.new_empty(J, scores.shape[1], dtype=torch.int32)


def rounding_select(scores: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor,
                    target: torch.Tensor, J: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rounding's drops and pads (module docstring) in two launches.

    Args:
        scores: ``[T, E]`` float router scores (unit column stride). ids: ``[T, K]`` int top-k ids (unit column
            stride, distinct per row). weights: ``[T, K]`` float top-k weights (unit column stride).
        counts: ``[E]`` int32 ``f_e``. target: ``[E]`` int32 ``r_e`` with ``|r_e - f_e| <= J`` where padding,
            ``r_e <= T``. J: pad candidates per expert.

    Returns:
        ``(kept [T, K] int32, pad_tok [J, E] int32)``: the ids with dropped pairs set to E; per expert its
        ``r_e - f_e`` padded tokens ascending in rows ``0..``, the filler ``(j*E + e) % T`` after them.

    Raises:
        ValueError: shapes or dtypes other than above, T above ``MAX_TOKENS``, K above ``MAX_TOP_K``.
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
    return call_op(_select_op, _select_impl, scores, ids, weights, counts, target, J)
