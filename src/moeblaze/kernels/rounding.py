"""Token rounding's per-expert selections in two launches (issue 25; SonicMoE §5 Alg. 4; rules:
:mod:`moeblaze.token_rounding`).

After top-k, expert e with ``f_e`` tokens and rounded target ``r_e`` either drops its ``n = f_e - r_e``
lowest-weighted top-k pairs or pads ``n = r_e - f_e`` of its highest-scored tokens outside its top-k. Both
are "the n largest keys" of expert e's keys over the tokens: for a dropping expert the key of a top-k token
is its weight's order key, inverted (the lowest weight ranks first); for a padding expert the key of a token
outside its top-k is its score's order key; every other key is ``-2^31`` (ineligible: eligible keys are
clamped to ``-2^31 + 1``). n is below the tile (``max_n``), a few dozen against T keys, so the keys are
never written out whole:

* :func:`rounding_keys_kernel` (one program per ``BLOCK_T`` tokens and ``BLOCK_E`` experts) computes the targets
  ``r_e`` from the counts (:func:`moeblaze.token_rounding.round_counts`' rules; the select kernel recomputes its
  own), the keys, and writes the largest key of each group of ``GROUP`` tokens per expert, ``bmax [ceil(T / GROUP),
  E]`` (columns of experts with ``f_e == r_e`` not written).
* :func:`rounding_select_kernel` (one program per expert) finds the n-th largest group maximum ``L`` to its top
  16 bits (a binary search on its bits, one count per bit), ``lo <= L``. Every key at or above the n-th largest
  key is at or above ``lo`` and so in a group whose maximum is; the candidate groups are those at or above ``lo``.
  Where more than half the candidate rows would pass, it searches all 32 bits: the candidates are then the groups
  above ``L`` and the first n equal to it (ties among group maxima: the first n hold every tied key that can be
  selected), at most ``2n - 1`` groups. Their tokens' keys, recomputed from the scores, ids and weights, give the n-th largest key and
  the selection in token order: every key above it and, of the keys equal to it, the lowest tokens (ties:
  the lower token first, in both selections). Dropped pairs get the expert id E in ``kept [T, K]``; padded
  pairs are marked in ``pad_mask [T, E]`` (uint8, 1 where expert e pads token t) and listed, ascending, in
  ``pad_tok [J, E]`` (-1 after the last).

The pair list in token order is then written by :mod:`moeblaze.kernels.pair_list`.

No sort, no atomics, no host synchronisation. The order key of a float is its bit pattern as int32 with the
lower 31 bits flipped for negative values (monotone in the value; ``-0.0`` is made ``+0.0`` first, NaN
ranks above +inf). The PyTorch path of :func:`moeblaze.round_tokens` uses the same keys and tie rule, so
both give the same pairs. The select kernel holds ``ceil(T / GROUP)`` group maxima and ``2 * max_n * GROUP``
candidate keys in registers, where the first version held the whole row of T keys and searched it: 47 and
264 µs per layer step at T 16384 with E 128, K 2 and E 512, K 10 against 19 and 51 µs now, the keys kernel 5
and 79 µs writing ``[E, T]`` against 6 and 39 now (H200, ``python3 benchmarks/bench_token_rounding.py
speed --shapes 0,2 --breakdown 22``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import ROUNDING_MODES as MODES  # the MODE constexpr of the kernels: the index there
from .custom_ops import call_op
from .direct import launch
from .tuning import cdiv, next_pow2

MAX_TOKENS = 65536  # T; the select kernel holds T / GROUP group maxima (4,096 at most) in registers
MAX_TOP_K = 16  # the top-k loops are unrolled
GROUP = 16  # tokens per group maximum: T / 16 maxima to search, 16 keys per candidate group
_INELIGIBLE = tl.constexpr(-2147483647 - 1)
NR, UP, DOWN, SR = (tl.constexpr(i) for i in range(4))


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
def _search_bits(key, n, v, B_HI, B_LO):
    """Bits ``B_HI..B_LO`` of the largest ``v`` with ``#(key >= v) >= n``, on the unsigned ``key + 2^31`` (int64
    ``v`` in ``[0, 2^32)``): ``v`` holds the bits above ``B_HI`` and zeros below, with ``#(key >= v) >= n``
    already; one count (a reduction) per bit. Two bits per step (three counts packed in one int64 reduction, 16
    serial reductions) measured slower on a whole row: 41 against 35 µs at E 128 and 261 against 242 µs at E 512
    (H100, ``python3 benchmarks/bench_token_rounding.py rounding``), and level on the select kernel's
    1,024-4,096 keys: 30.2 against 31.7 µs at E 128, 42.6 against 41.6 at E 256 (H200, ``... select
    --warps 4``, both launches). A radix select of four 8-bit ``tl.histogram`` rounds took the select kernel from
    17.6 to 44.4 µs at T 16384, E 128, K 2 (H200, ``... speed --shapes 0 --variants none --breakdown
    40``)."""
    one = tl.full((), 1, tl.int64)
    for b in range(B_HI, B_LO - 1, -1):
        cand = v | (one << b)
        if tl.sum((key >= (cand - 2147483648).to(tl.int32)).to(tl.int32), axis=0) >= n:
            v = cand
    return v


@triton.jit
def _top_diff_bit(a, b):
    """The highest bit where the int64 ``a`` and ``b`` (both in ``[0, 2^32)``) differ, -1 if equal (scalar work:
    no reduction)."""
    x = a ^ b
    d = tl.full((), -1, tl.int32)
    for i in range(32):
        d = tl.where(((x >> i) & 1) != 0, i, d)
    return d


@triton.jit
def _nth_largest_above(key, n, lo):
    """The n-th largest of the int32 ``key``, given ``lo <= it`` (``#(key >= lo) >= n``): the bits above the
    highest one where ``lo`` and ``max(key)`` differ are the answer's, so only the bits below are searched."""
    lo_u = lo.to(tl.int64) + 2147483648
    hi_u = tl.max(key, axis=0).to(tl.int64) + 2147483648
    d = _top_diff_bit(lo_u, hi_u)
    v = lo_u & ~((tl.full((), 1, tl.int64) << (d + 1)) - 1)  # the common prefix, zeros from bit d down
    return (_search_bits(key, n, v, d, 0) - 2147483648).to(tl.int32)


@triton.jit
def _counts(counts_ptr,  # [E] int32 or fp32 (exact integers) top-k token counts f_e
            rand_ptr,  # [E] fp32 uniform draws of the stochastic mode (MODE == SR), else unused
            e, emask, T, tile, MODE: tl.constexpr):
    """``(f_e, r_e)`` int32 of the experts ``e``: the top-k count and its rounded target, as
    :func:`moeblaze.token_rounding.round_counts` computes it: one launch fewer than its Inductor kernel, 0.8-0.9 µs
    per step at T 16384, E 128, K 2 (H200, ``python3 benchmarks/bench_token_rounding.py speed --shapes 0
    --variants none --breakdown 60``)."""
    f = tl.load(counts_ptr + e, mask=emask, other=0).to(tl.int32)
    rem = f % tile
    base = f - rem
    if MODE == NR:
        up = 2 * rem > tile
    elif MODE == UP:
        up = rem > 0
    elif MODE == DOWN:
        up = rem < 0
    else:
        up = tl.load(rand_ptr + e, mask=emask, other=1.0) * tile < rem.to(tl.float32)
    r = base + tile * up.to(tl.int32)
    return f, tl.where(r > T, base, r)


@triton.jit
def rounding_keys_kernel(
    scores_ptr,   # [T, E] float router scores
    ids_ptr,      # [T, K] int top-k expert ids
    weights_ptr,  # [T, K] float top-k weights
    counts_ptr,   # [E] int32 or fp32 (exact integers) top-k token counts f_e
    rand_ptr,     # [E] fp32 uniform draws of the stochastic mode (MODE == SR), else unused
    target_ptr,   # [E] int32 out: rounded counts r_e (written by the first row of programs)
    bmax_ptr,     # [NB, E] int32 out: largest key of each group of GROUP tokens (columns with f_e == r_e not written)
    kept_ptr,     # [T, K] int32 out: the top-k ids (written by the first column of programs; the select drops)
    T, E, NB, tile, stride_s_t, stride_ids_t, stride_w_t,
    MODE: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    rmask, cmask = rows < T, cols < E
    f, r = _counts(counts_ptr, rand_ptr, cols, cmask, T, tile, MODE)
    if tl.program_id(0) == 0:
        tl.store(target_ptr + cols, r, mask=cmask)
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
    # [NB, E]: a program's row of group maxima is one coalesced store, where [E, NB] stored each expert's value
    # alone; the select kernel's strided column reads hit L2. 5.7 against 6.3 µs per step at T 16384, E 128, K 2
    # (H200, ``python3 benchmarks/bench_token_rounding.py speed --shapes 0 --variants none --breakdown
    # 45``, two runs)
    tl.store(bmax_ptr + g[:, None] * E + cols[None, :], gmax, mask=(g < NB)[:, None] & (cmask & (f != r))[None, :])


@triton.jit
def _candidate_keys(toks, valid, e, dropping,
                    scores_ptr,  # [T, E] float router scores
                    ids_ptr,  # [T, K] int top-k expert ids
                    weights_ptr,  # [T, K] float top-k weights
                    stride_s_t, stride_ids_t,
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
def _select_candidates(e, n, lo, dropping, ncb, T, E,
                       cand_ptr,  # [E, CAND] int32 each expert's candidate groups, ascending
                       scores_ptr,  # [T, E] float router scores
                       ids_ptr,  # [T, K] int top-k expert ids
                       weights_ptr,  # [T, K] float top-k weights
                       kept_ptr,  # [T, K] int32 in/out: the top-k ids; dropped pairs set to E
                       pad_mask_ptr,  # [T, E] uint8 in/out (zeros in): 1 where expert e pads token t
                       pad_tok_ptr,  # [J, E] int32 out: the tokens expert e pads, ascending
                       stride_s_t, stride_ids_t, stride_w_t, K: tl.constexpr, GROUP: tl.constexpr,
                       CAND: tl.constexpr, BLOCKS: tl.constexpr):
    """The selection among the tokens of expert e's first ``ncb <= BLOCKS`` candidate groups (ascending in
    ``cand_ptr``'s row e, so the candidates are in token order), and its stores. ``lo``: at most their n-th
    largest key (every candidate group's maximum is at least ``lo``)."""
    i = tl.arange(0, BLOCKS * GROUP)
    c = i // GROUP
    toks = tl.load(cand_ptr + e * CAND + c, mask=c < ncb, other=0) * GROUP + i % GROUP
    valid = (c < ncb) & (toks < T)
    key, kk = _candidate_keys(toks, valid, e, dropping, scores_ptr, ids_ptr, weights_ptr, stride_s_t, stride_ids_t,
                              stride_w_t, K)
    v = _nth_largest_above(key, n, lo)
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
    bmax_ptr,     # [NB, E] int32 group maxima of the keys (rounding_keys_kernel)
    cand_ptr,     # [E, CAND] int32 scratch: each expert's candidate groups, ascending
    counts_ptr,   # [E] int32 or fp32 (exact integers) top-k token counts f_e
    rand_ptr,     # [E] fp32 uniform draws of the stochastic mode (MODE == SR), else unused
    kept_ptr,     # [T, K] int32 in/out: the top-k ids (rounding_keys_kernel's copy); dropped pairs set to E
    pad_mask_ptr, # [T, E] uint8 in/out (zeros in): 1 where expert e pads token t
    pad_tok_ptr,  # [J, E] int32 out: the tokens expert e pads, ascending, then -1
    T, E, J, NB, tile, stride_s_t, stride_ids_t, stride_w_t,
    MODE: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr, BLOCK_NB: tl.constexpr, CAND: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    e = tl.program_id(0)
    f, r = _counts(counts_ptr, rand_ptr, e, True, T, tile, MODE)
    n = tl.abs(f - r)
    if n > 0:
        b = tl.arange(0, BLOCK_NB)
        bm = tl.load(bmax_ptr + b * E + e, mask=b < NB, other=_INELIGIBLE)
        # the n-th largest group maximum to 16 bits first (16 counts, not 32): lo = its value with the low bits
        # cleared. Every selected key is in a group whose maximum is >= lo, and a few more groups pass it (those
        # within 2^-7 of it, relatively, for positive floats). With the second search from the common prefix of
        # its bounds: 15.4-16.4 against 18.7 µs per step at T 16384, E 128, K 2 (H200, ``python3
        # benchmarks/bench_token_rounding.py speed --shapes 0 --variants none --breakdown 45``, four runs)
        v = _search_bits(bm, n, tl.zeros((), tl.int64), 31, 16)
        lo = (v - 2147483648).to(tl.int32)
        cand = bm >= lo
        ncb = tl.sum(cand.to(tl.int32), axis=0)
        if ncb > CAND // 2:  # rare: the exact n-th largest and at most 2n - 1 groups (ties: the first n)
            v = _search_bits(bm, n, v, 15, 0)
            lo = (v - 2147483648).to(tl.int32)
            eq = bm == lo
            cand = (bm > lo) | (eq & (tl.cumsum(eq.to(tl.int32), axis=0) <= n))
            ncb = tl.sum(cand.to(tl.int32), axis=0)
        tl.store(cand_ptr + e * CAND + tl.cumsum(cand.to(tl.int32), axis=0) - 1, b, mask=cand)
        tl.debug_barrier()  # the row of candidates, written by all threads, read by all
        # the usual case for nr (n < tile / 2): a quarter of the candidate keys to search, where half took both
        # launches 28.1 against 27.3 µs at T 16384, E 128, K 2 and 40.3 against 36.8 at E 256, K 4 (H200,
        # ``python3 benchmarks/bench_token_rounding.py select``'s method)
        if ncb <= CAND // 4:
            _select_candidates(e, n, lo, f > r, ncb, T, E, cand_ptr, scores_ptr, ids_ptr, weights_ptr, kept_ptr,
                               pad_mask_ptr, pad_tok_ptr, stride_s_t, stride_ids_t, stride_w_t, K, GROUP, CAND, CAND // 4)
        elif ncb <= CAND // 2:
            _select_candidates(e, n, lo, f > r, ncb, T, E, cand_ptr, scores_ptr, ids_ptr, weights_ptr, kept_ptr,
                               pad_mask_ptr, pad_tok_ptr, stride_s_t, stride_ids_t, stride_w_t, K, GROUP, CAND, CAND // 2)
        else:
            _select_candidates(e, n, lo, f > r, ncb, T, E, cand_ptr, scores_ptr, ids_ptr, weights_ptr, kept_ptr,
                               pad_mask_ptr, pad_tok_ptr, stride_s_t, stride_ids_t, stride_w_t, K, GROUP, CAND, CAND)
    jj = tl.arange(0, BLOCK_J)
    tl.store(pad_tok_ptr + jj * E + e, tl.full(jj.shape, -1, tl.int32), mask=(jj >= tl.where(r > f, n, 0)) & (jj < J))


def _select_warps(nb: int) -> int:
    """Warps of the select kernel for ``nb`` group maxima: 4 to 16 warps moved ``rounding_select`` by under 10%
    at T 4096-65536 (H200, ``python3 benchmarks/bench_token_rounding.py select``'s method)."""
    return 4 if nb <= 1024 else 8


def _keys_block(E: int) -> tuple[int, int]:
    """``(BLOCK_T, BLOCK_E)`` of the keys kernel: one group of tokens by up to 128 experts (triton 3.6's ptxas for
    sm_90: 77 to 203 registers at K 2 to 16, no spills; all E in one program took 255 and spilled at E 512, K 10).
    Both launches of :func:`rounding_select` took 90.6 against 105.5 µs at T 16384, E 512, K 10 and 38.7 against 40.6
    at E 256, K 4 with 128 experts per program instead of ``384 / K`` (fewer programs reloading the ids and weights;
    H200, ``python3 benchmarks/bench_token_rounding.py select --keys-blocks 16x32,16x128``'s method)."""
    return GROUP, min(next_pow2(E), 128)


def _select_impl(scores: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor,
                 rand: torch.Tensor | None, tile: int, mode: str, J: int,
                 max_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    T, E = scores.shape
    K, dev = ids.shape[1], scores.device
    kept = torch.empty(T, K, dtype=torch.int32, device=dev)  # the keys kernel copies ids in
    # zeros from a fill (1.4 µs per step at T 16384, E 128, K 2): the keys kernel storing them took 3.7 µs longer
    # (H200, ``python3 benchmarks/bench_token_rounding.py speed --shapes 0 --variants none --breakdown 60``)
    pad_mask = torch.zeros(T, E, dtype=torch.uint8, device=dev)
    pad_tok = torch.empty(J, E, dtype=torch.int32, device=dev)
    target = torch.empty(E, dtype=torch.int32, device=dev)
    nb = cdiv(T, GROUP)
    bmax = torch.empty(max(nb, 1), E, dtype=torch.int32, device=dev)
    cand = max(2, next_pow2(2 * max(max_n, 1) - 1))  # the candidate groups of an expert: at most 2n - 1
    cand_groups = torch.empty(E, cand, dtype=torch.int32, device=dev)
    block_t, block_e = _keys_block(E)
    rand = counts if rand is None else rand  # pointer of an absent input (MODE is not SR)
    common = dict(scores_ptr=scores, ids_ptr=ids, weights_ptr=weights, counts_ptr=counts, rand_ptr=rand,
                  kept_ptr=kept, T=T, E=E, NB=nb, tile=tile, stride_s_t=scores.stride(0),
                  stride_ids_t=ids.stride(0), stride_w_t=weights.stride(0), MODE=MODES.index(mode), K=K, GROUP=GROUP)
    launch(rounding_keys_kernel, (max(cdiv(T, block_t), 1), cdiv(E, block_e)), **common, target_ptr=target,
           bmax_ptr=bmax, BLOCK_T=block_t, BLOCK_E=block_e, num_warps=4)
    if T:
        launch(rounding_select_kernel, (E,), **common, bmax_ptr=bmax, cand_ptr=cand_groups, pad_mask_ptr=pad_mask,
               pad_tok_ptr=pad_tok, J=J,
               BLOCK_NB=next_pow2(nb), CAND=cand, BLOCK_J=next_pow2(max(J, 1)), num_warps=_select_warps(nb))
    return kept, pad_mask, pad_tok, target


_select_op = torch.library.custom_op(
    "moeblaze::rounding_select", _select_impl, mutates_args=(),
    schema="(Tensor scores, Tensor ids, Tensor weights, Tensor counts, Tensor? rand, int tile, str mode, int J, "
           "int max_n) -> (Tensor, Tensor, Tensor, Tensor)")


@_select_op.register_fake
def _(scores, ids, weights, counts, rand, tile, mode, J, max_n):
    E = scores.shape[1]
    return (ids.new_empty(ids.shape, dtype=torch.int32), scores.new_empty(scores.shape, dtype=torch.uint8),
            ids.new_empty(J, E, dtype=torch.int32), ids.new_empty(E, dtype=torch.int32))


def rounding_select(scores: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor,
                    tile: int, mode: str, J: int, max_n: int,
                    rand: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token rounding's targets, drops and pads (module docstring) in two launches.

    Args:
        scores: ``[T, E]`` float router scores (unit column stride). ids: ``[T, K]`` int top-k ids (unit column
            stride, distinct per row). weights: ``[T, K]`` float top-k weights (unit column stride).
        counts: ``[E]`` int32 or fp32 ``f_e`` (exact integers). tile: the M tile >= 1. mode: one of
            :data:`MODES` (:func:`moeblaze.token_rounding.round_counts`' rules, capped at T).
        J: pad candidates per expert, ``r_e - f_e <= J`` (:func:`moeblaze.token_rounding.round_tokens`' J).
        max_n: the most tokens one expert drops or pads, ``|r_e - f_e| <= max_n`` for every e (``tile - 1``
            serves every mode); the select kernel holds ``2 * max_n * GROUP`` candidate keys.
        rand: ``[E]`` fp32 uniform draws of ``"sr"`` (expert e pads where ``rand[e] * tile < f_e % tile``), as
            ``round_counts`` draws them; None for the other modes.

    Returns:
        ``(kept [T, K] int32, pad_mask [T, E] uint8, pad_tok [J, E] int32, target [E] int32)``: the ids with
        dropped pairs set to E; 1 where expert e pads token t (``r_e - f_e`` ones in column e where that is
        positive), else 0; the tokens expert e pads in column e, ascending, then -1; the rounded counts ``r_e``.

    Raises:
        ValueError: shapes or dtypes other than above, T above ``MAX_TOKENS``, K above ``MAX_TOP_K``, ``max_n``
            below 0, an unknown mode, ``tile < 1``, ``rand`` missing for ``"sr"``.
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
    if counts.shape != (E,) or counts.dtype not in (torch.int32, torch.float32):
        raise ValueError(f"rounding_select: counts must be [E={E}] int32 or fp32, got {tuple(counts.shape)} "
                         f"{counts.dtype}")
    if mode not in MODES or tile < 1 or max_n < 0:
        raise ValueError(f"rounding_select: need mode in {MODES}, tile >= 1 and max_n >= 0 (the most tokens one "
                         f"expert drops or pads), got {mode!r}, {tile} and {max_n}")
    if (mode == "sr") != (rand is not None) or (rand is not None and (rand.shape != (E,) or
                                                                      rand.dtype != torch.float32)):
        raise ValueError(f"rounding_select: rand must be [E={E}] fp32 for mode 'sr' and None otherwise, got "
                         f"{None if rand is None else (tuple(rand.shape), rand.dtype)} for {mode!r}")
    return call_op(_select_op, _select_impl, scores, ids, weights, counts.contiguous(), rand, int(tile), mode, J,
                   max_n)
