"""Atomic-free Triton build of the dispatch index, and the grouped-GEMM tile schedule.

MoEBlaze §4.2 (arXiv 2601.05296), DESIGN.md §3. The arrays and their invariants are the contract at the
top of :mod:`moeblaze.dispatch`; this build is bitwise equal to ``build_dispatch_torch``.

How (three launches, no sort, no atomics, no host synchronisation)
------------------------------------------------------------------
Pairs ``p = t*K + k`` are cut into *tiles* of ``P`` consecutive pairs; ``G`` tiles form a *chunk*, one
program (``G`` warps, one tile per warp). A tile is walked in *steps* of ``S = 32`` pairs. Inside a step
the rank of each pair among the step's pairs of the same expert comes from an ``[S, S]`` equality map in
registers (the paper's dense token-expert map, made independent of E: its cost per pair is S, not E); a
per-tile running count per expert lives in the tile's own row of a small ``[tiles, E]`` table (L2).
Only the *last* pair of each expert in a step writes that row (distinct addresses), between two CTA
barriers (``tl.debug_barrier`` = ``__syncthreads``, which makes global writes visible inside the CTA;
launched with ``num_stages=1`` so no load is pipelined across them): no races, no atomics, deterministic.
Pair order equals token order inside an expert because a row's ids are distinct.

1. ``_count_kernel``   per tile: counts per expert -> ``[tiles, E]``; per chunk: in-chunk exclusive
   prefix of its tiles and the chunk sum -> ``[chunks, E]``. Also writes int32 ids when the input is not.
2. ``_scan_kernel``    per block of experts: exclusive scan of the chunk table over chunks; totals.
3. ``_write_kernel``   per chunk: offsets = exclusive scan of totals; tile base = offset + chunk base +
   in-chunk prefix; then the tiles are walked again and every pair writes ``token_index_map[p]`` and
   ``expert_token_indices[slot]`` at its final place. Asked for a grouped-GEMM tile schedule
   (``block_m``), the chunks also write it, blocks of ``BLOCK_I`` entries strided over the chunks, from
   the per-expert totals every chunk already holds: no fourth launch (each launch from Python costs
   ~60-80 µs of host time (H200), more than this whole build's device time at 8k tokens).

``schedule.tile_schedule`` builds the same schedule in one small launch from ``expert_token_offsets`` alone
(for an index that was built without one).
Interpreter: with ``TRITON_INTERPRET=1`` everything also runs on CPU tensors (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..index import DispatchIndex, TileSchedule
from .custom_ops import call_op
from .direct import launch
from .schedule import BLOCK_I, check_device, schedule_entries, schedule_length
from .tuning import cdiv, next_pow2, sm_count

__all__ = ["build_dispatch_triton", "dispatch_plan", "MAX_EXPERTS", "MAX_TOP_K"]

MAX_EXPERTS = 1024
MAX_TOP_K = 16
_STEP = 32  # S, pairs per step (one warp)
_WARPS = 4  # G, tiles per chunk = warps per program
_BLOCK_E = 64  # experts per block in dense row work
_SCAN_BE = 8  # experts per scan program
_SCAN_ELEMS = 4096  # elements per scan block
_MAX_TILE = 1 << 20  # P bound: pair indices stay below N + G*P < 2^31
_ONEHOT_MAX_E = 16  # one-hot counters / running slots in registers up to this E (cheaper than the table)
_ID_DTYPES = (torch.int32, torch.int64, torch.int16, torch.uint8)


# ----------------------------------------------------------------------------------------------------
# kernels. They produce the arrays of the index contract at the top of moeblaze/dispatch.py:
# expert_token_offsets [E+1], expert_token_indices [N], token_index_map [T, K] (pair p = t*K + k), all
# int32, slots of an expert in ascending token order. Tables: tile [tiles, E], chunk [chunks + 1, E].
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _step_ranks(ids, S: tl.constexpr):
    """ids [G, S] int32 (-1 for padding) -> (rank among equal ids before p in the step, p is the last)."""
    q = tl.arange(0, S)[:, None, None]
    p = tl.arange(0, S)[None, None, :]
    w = tl.where(q < p, 1, 0) + tl.where(q > p, 1 << 16, 0)  # [S(q), 1, S(p)]: before -> 1, after -> 2^16
    eq = tl.trans(ids)[:, :, None] == ids[None, :, :]  # [S(q), G, S(p)]
    acc = tl.sum(tl.where(eq, w, 0), axis=0)  # [G, S]
    return acc & 0xFFFF, (acc >> 16) == 0


@triton.jit
def _load_ids(ids_ptr,  # [T, K] integer expert ids (any of int32/int64/int16/uint8, any strides)
              p, n, stride_ids_t, stride_ids_k, K: tl.constexpr):
    """Ids of pairs p [G, S] (p < n) from a strided [T, K] tensor; 64-bit addressing."""
    t = p // K
    off = t.to(tl.int64) * stride_ids_t + (p - t * K).to(tl.int64) * stride_ids_k
    return tl.load(ids_ptr + off, mask=p < n, other=0)


@triton.jit(do_not_specialize=["N", "E", "P"])
def _count_kernel(
    ids_ptr,  # [T, K] integer expert ids (any of int32/int64/int16/uint8, any strides)
    ids32_ptr,  # [N] int32 contiguous copy of the ids (written only when WRITE_IDS)
    tile_ptr,  # [chunks * G, E] int32 out: per tile, exclusive prefix of counts inside its chunk
    chunk_ptr,  # [chunks + 1, E] int32 out: per chunk, counts summed over its tiles
    N, E, P,  # pairs, experts, pairs per tile (a multiple of S)
    stride_ids_t, stride_ids_k,
    K: tl.constexpr, S: tl.constexpr, G: tl.constexpr,
    BLOCK_E: tl.constexpr, WRITE_IDS: tl.constexpr, ONEHOT_E: tl.constexpr,
):
    # ONEHOT_E > 0 (a power of two >= E, small E only): count with a per-lane one-hot accumulator in
    # registers (2*ONEHOT_E ops per pair, no table traffic) instead of the equality map + running row.
    c = tl.program_id(0)
    g = tl.arange(0, G)[:, None]  # tile (warp) in chunk
    lane = tl.arange(0, S)[None, :]
    rows = tile_ptr + (c * G + g).to(tl.int64) * E  # [G, 1] running-count row of each tile
    p = (c * G + g) * P + lane  # [G, S] pairs of the current step
    raw = _load_ids(ids_ptr, p, N, stride_ids_t, stride_ids_k, K)
    cols = tl.arange(0, BLOCK_E)[None, :]
    if ONEHOT_E > 0:
        hot = tl.zeros([ONEHOT_E, G, S], tl.int32)  # expert-major: each lane keeps all its counters
        experts = tl.arange(0, ONEHOT_E)[:, None, None]
    else:
        for e0 in range(0, E, BLOCK_E):  # zero the rows
            tl.store(rows + e0 + cols, tl.zeros([G, BLOCK_E], tl.int32), mask=e0 + cols < E)
        tl.debug_barrier()
    for j in range(0, P // S):
        valid = p < N
        ids = tl.where(valid, tl.minimum(raw.to(tl.int32), E - 1), -1)  # foreign ids (>= E - 1): the last bucket
        lim = N * (j + 1 < P // S).to(tl.int32)  # no next step after the last
        raw = _load_ids(ids_ptr, p + S, lim, stride_ids_t, stride_ids_k, K)  # next step
        if WRITE_IDS:
            tl.store(ids32_ptr + p, ids, mask=valid)
        if ONEHOT_E > 0:
            hot += (ids[None, :, :] == experts).to(tl.int32)
        else:
            rank, last = _step_ranks(ids, S)
            run = tl.load(rows + ids, mask=valid, other=0)
            tl.debug_barrier()
            tl.store(rows + ids, run + rank + 1, mask=valid & last)
            tl.debug_barrier()
        p += S
    if ONEHOT_E > 0:  # counts [G, ONEHOT_E] straight from registers
        cnt = tl.trans(tl.sum(hot, axis=2))  # [G, ONEHOT_E]
        e = tl.arange(0, ONEHOT_E)
        tl.store(rows + e[None, :], tl.cumsum(cnt, axis=0) - cnt, mask=e[None, :] < E)
        tl.store(chunk_ptr + c.to(tl.int64) * E + e, tl.sum(cnt, axis=0), mask=e < E)
    else:
        for e0 in range(0, E, BLOCK_E):  # rows now hold counts: in-chunk prefix and chunk sum
            m = e0 + cols < E
            cnt = tl.load(rows + e0 + cols, mask=m, other=0)  # [G, BLOCK_E]
            tl.store(rows + e0 + cols, tl.cumsum(cnt, axis=0) - cnt, mask=m)
            e = e0 + tl.arange(0, BLOCK_E)
            tl.store(chunk_ptr + c.to(tl.int64) * E + e, tl.sum(cnt, axis=0), mask=e < E)


@triton.jit(do_not_specialize=["C", "E"])
def _scan_kernel(
    chunk_ptr,  # [chunks + 1, E] int32 in: chunk sums; out: exclusive scan over chunks, row `chunks` = totals
    C, E,
    BR: tl.constexpr, BE: tl.constexpr,
):
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    em = e < E
    carry = tl.zeros([BE], tl.int32)
    r = tl.arange(0, BR)
    first = chunk_ptr + r.to(tl.int64)[:, None] * E + e[None, :]
    nxt = tl.load(first, mask=(r[:, None] < C) & em[None, :], other=0)
    for r0 in range(0, C, BR):
        blk = nxt
        ptrs = chunk_ptr + (r0 + r).to(tl.int64)[:, None] * E + e[None, :]
        m = (r0 + r[:, None] < C) & em[None, :]
        nxt = tl.load(ptrs + BR * E, mask=(r0 + BR + r[:, None] < C) & em[None, :], other=0)  # prefetch
        tl.store(ptrs, tl.cumsum(blk, axis=0) - blk + carry[None, :], mask=m)
        carry += tl.sum(blk, axis=0)
    tl.store(chunk_ptr + C.to(tl.int64) * E + e, carry, mask=em)


@triton.jit(do_not_specialize=["N", "E", "C", "P", "max_tiles", "SCHED_E"])
def _write_kernel(
    ids32_ptr,  # [N] int32 expert id of each pair
    tile_ptr,  # [chunks * G, E] int32 in: in-chunk prefix; becomes the running slot of each tile
    chunk_ptr,  # [chunks + 1, E] int32 in: exclusive scan over chunks, last row = totals
    offsets_ptr,  # [E + 1] int32 out: expert_token_offsets
    indices_ptr,  # [N] int32 out: expert_token_indices (slot -> token)
    map_ptr,  # [N] int32 out: token_index_map (pair -> slot)
    tile_expert_ptr,  # [max_tiles] int32 out (SCHED_M > 0): tile schedule, expert of each M-tile
    tile_row_ptr,  # [max_tiles] int32 out (SCHED_M > 0): first slot of each M-tile
    num_tiles_ptr,  # [1] int32 out (SCHED_M > 0)
    tok_ptr,  # [N] int32 token of each pair (TOKEN_MAP: general routing inputs; else pair p's token is p // K)
    N, E, C, P, max_tiles,  # pairs, experts, chunks, pairs per tile, schedule length
    SCHED_E,  # experts the schedule covers: E, or E - 1 leaving out a last bucket of foreign pairs
    K: tl.constexpr, S: tl.constexpr, G: tl.constexpr, BLOCK_E: tl.constexpr, ONEHOT_E: tl.constexpr,
    SCHED_M: tl.constexpr, BLOCK_I: tl.constexpr, TOKEN_MAP: tl.constexpr,
):
    # ONEHOT_E > 0 (small E): ranks from a per-step one-hot cumsum, running slots kept in registers.
    c = tl.program_id(0)
    g = tl.arange(0, G)[:, None]
    lane = tl.arange(0, S)[None, :]
    rows = tile_ptr + (c * G + g).to(tl.int64) * E  # [G, 1]
    p = (c * G + g) * P + lane  # [G, S] pairs of the current step
    nxt = tl.load(ids32_ptr + p, mask=p < N, other=-1)
    carry = tl.sum(tl.zeros([BLOCK_E], tl.int32), axis=0)  # int32 scalar 0
    for e0 in range(0, E, BLOCK_E):  # tile base = offset + chunk base + in-chunk prefix
        e = e0 + tl.arange(0, BLOCK_E)
        em = e < E
        tot = tl.load(chunk_ptr + C.to(tl.int64) * E + e, mask=em, other=0)
        off = tl.cumsum(tot, axis=0) - tot + carry
        tl.store(offsets_ptr + e, off, mask=em & (e * 0 + c == 0))
        carry += tl.sum(tot, axis=0)
        base = off + tl.load(chunk_ptr + c.to(tl.int64) * E + e, mask=em, other=0)
        pre = tl.load(rows + e[None, :], mask=em[None, :], other=0)
        tl.store(rows + e[None, :], pre + base[None, :], mask=em[None, :])
    one = tl.arange(0, 1)
    tl.store(offsets_ptr + E + one, carry + one * 0, mask=one * 0 + c == 0)
    if SCHED_M > 0:  # schedule blocks c, c + C, ... from the totals row (the same in every chunk)
        for i0 in range(c * BLOCK_I, max_tiles, C * BLOCK_I):
            num = schedule_entries(chunk_ptr + C.to(tl.int64) * E, tile_expert_ptr, tile_row_ptr,
                                   i0 + tl.arange(0, BLOCK_I), SCHED_E, max_tiles, False, SCHED_M, BLOCK_E)
            tl.store(num_tiles_ptr + one, num + one * 0, mask=one * 0 + i0 == 0)
    tl.debug_barrier()
    if ONEHOT_E > 0:  # running slots in registers [ONEHOT_E, G, 1]: no table round trip, no barrier
        experts = tl.arange(0, ONEHOT_E)[:, None, None]
        run = tl.load(rows[None, :, :] + experts, mask=experts < E, other=0)
    for j in range(0, P // S):
        valid = p < N
        ids = nxt
        lim = N * (j + 1 < P // S).to(tl.int32)  # no next step after the last
        nxt = tl.load(ids32_ptr + p + S, mask=p + S < lim, other=-1)  # next step
        if ONEHOT_E > 0:
            hot = (ids[None, :, :] == experts).to(tl.int32)  # [ONEHOT_E, G, S]
            slot = tl.sum(hot * (run + tl.cumsum(hot, axis=2) - 1), axis=0)  # stable rank + running slot
            run += tl.sum(hot, axis=2, keep_dims=True)
        else:
            rank, last = _step_ranks(ids, S)
            slot = tl.load(rows + ids, mask=valid, other=0) + rank
        tl.store(map_ptr + p, slot, mask=valid)
        if TOKEN_MAP:
            tl.store(indices_ptr + slot, tl.load(tok_ptr + p, mask=valid, other=0), mask=valid)
        else:
            tl.store(indices_ptr + slot, p // K, mask=valid)
        if ONEHOT_E == 0:
            tl.debug_barrier()
            tl.store(rows + ids, slot + 1, mask=valid & last)
            tl.debug_barrier()
        p += S


# ----------------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------------


def _programs_per_sm(num_pairs: int, num_experts: int) -> int:
    """Chunks per SM when N is large. Measured on an H200 (CUDA-graph time, 2M tokens):
    the register path (E <= 16) is fastest with 8 (K=8: 309 µs vs 392 with 4); the table path wants
    more programs in flight only past ~8M pairs (K=8, E=256: 698 µs with 16 vs 982 with 4), and fewer,
    longer tiles below (1M pairs, E=64: 39 µs with 4 vs 46 with 16)."""
    if num_experts <= _ONEHOT_MAX_E:
        return 8
    return 16 if num_pairs >= 1 << 23 else 4


def dispatch_plan(
    num_pairs: int, num_experts: int, tile_pairs: int | None = None, num_sms: int = 132
) -> tuple[int, int, int]:
    """Tile sizes of the build: ``(P, tiles, chunks)`` — pairs per tile, tiles, chunks of ``G`` tiles.

    ``P`` is the smallest multiple of 32 that keeps the ``[tiles, E]`` table within about
    ``max(N/8, min(N, 2^20), 2^18)`` entries (half a byte per pair at large N; at small N a table that
    stays in L2, and short tiles) and at most ``_programs_per_sm(N, E) * num_sms`` chunks (more would
    only add per-program overhead). ``tile_pairs`` forces P.

    Raises:
        ValueError: ``tile_pairs`` not a multiple of 32 in ``[32, 2^20]``.
    """
    if tile_pairs is not None:
        P = int(tile_pairs)
        if P < _STEP or P > _MAX_TILE or P % _STEP:
            raise ValueError(f"tile_pairs must be a multiple of {_STEP} in [{_STEP}, {_MAX_TILE}], got {tile_pairs}")
    else:
        budget = max(num_pairs // 8, min(num_pairs, 1 << 20), 1 << 18)
        max_tiles = _programs_per_sm(num_pairs, num_experts) * max(1, num_sms) * _WARPS
        P = max(cdiv(num_pairs * num_experts, budget), cdiv(num_pairs, max_tiles), 1)
        P = min(cdiv(P, _STEP) * _STEP, _MAX_TILE)
    chunks = max(1, cdiv(cdiv(num_pairs, P), _WARPS))
    return P, chunks * _WARPS, chunks


def build_dispatch_triton(topk_ids: torch.Tensor, num_experts: int, *, tile_pairs: int | None = None,
                          block_m: int | None = None, pair_tokens: torch.Tensor | None = None,
                          schedule_experts: int | None = None) -> DispatchIndex:
    """Build the dispatch index on the GPU without sort, atomics or host sync (MoEBlaze §4.2).

    Three launches (count, scan, write); bitwise equal to :func:`moeblaze.dispatch.build_dispatch_torch`.
    Ids are not range-checked here (see :func:`moeblaze.dispatch.check_topk_ids`): an id outside
    ``[0, E)`` or a repeated id in a row gives an undefined index.

    Args:
        topk_ids: ``[T, K]`` int32/int64/int16/uint8 expert ids on CUDA (any strides); CPU tensors are
            accepted when ``TRITON_INTERPRET=1``.
        num_experts: E, ``1 <= E <= 1024``; ``1 <= K <= min(16, E)``.
        tile_pairs: pairs per tile P (a multiple of 32); None picks :func:`dispatch_plan`'s. For tests
            and tuning; the result does not depend on it.
        block_m: also write the grouped-GEMM tile schedule for M-tiles of ``block_m`` slots (in the
            write launch; equal to :func:`moeblaze.dispatch.build_tile_schedule_torch`).
        pair_tokens: ``[T*K]`` int32 (contiguous) token of each pair: ``expert_token_indices`` then maps each
            slot to it instead of to the pair's row (general routing inputs, ``[P, 1]`` ids: no gather after).
        schedule_experts: the schedule covers the first ``schedule_experts`` experts only (E - 1: a last
            bucket of foreign pairs left out, as :func:`moeblaze.dispatch.with_schedule` on its local offsets).

    Returns:
        :class:`~moeblaze.dispatch.DispatchIndex`, all int32: ``expert_token_offsets [E+1]``,
        ``expert_token_indices [N]``, ``token_expert_indices [T, K]`` (the input itself when it is
        int32), ``token_index_map [T, K]`` and, with ``block_m``, ``schedule``.

    Raises:
        TypeError: non-integer ids.  ValueError: wrong rank, device, E, K, ``block_m < 1``,
        N >= 2^31 - 2^24, ``pair_tokens`` not ``[T*K]`` int32 contiguous, ``schedule_experts`` outside ``[1, E]``.
    """
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in _ID_DTYPES:
        got = getattr(topk_ids, "dtype", type(topk_ids).__name__)
        raise TypeError(f"topk_ids must be an int32/int64/int16/uint8 tensor, got {got}")
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must have shape [T, K], got {tuple(topk_ids.shape)}")
    check_device(topk_ids, "topk_ids")
    T, K = topk_ids.shape
    E = int(num_experts)
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be in [1, {MAX_EXPERTS}], got {E}")
    if not 1 <= K <= min(MAX_TOP_K, E):
        raise ValueError(f"top-k K={K} must be in [1, min({MAX_TOP_K}, num_experts={E})]")
    if block_m is not None and int(block_m) < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    N = T * K
    if N >= 2**31 - 2**24:
        raise ValueError(f"N = T*K = {N} pairs does not fit the int32 index")
    if pair_tokens is not None and (pair_tokens.shape != (N,) or pair_tokens.dtype != torch.int32
                                    or not pair_tokens.is_contiguous()):
        raise ValueError(f"pair_tokens must be a contiguous [T*K = {N}] int32 tensor, got "
                         f"{tuple(pair_tokens.shape)} {pair_tokens.dtype}")
    sched_e = E if schedule_experts is None else int(schedule_experts)
    if not 1 <= sched_e <= E:
        raise ValueError(f"schedule_experts must be in [1, num_experts={E}], got {schedule_experts}")
    offsets, indices, index_map, ids32, *sched = call_op(_build_dispatch_op, _build_dispatch_impl, topk_ids, E,
                                                         int(tile_pairs or 0), int(block_m or 0), pair_tokens,
                                                         sched_e)
    if ids32.numel() != N:  # not written: the input is contiguous int32, the id table itself
        ids32 = topk_ids
    schedule = TileSchedule(int(block_m), *sched) if block_m else None
    return DispatchIndex(offsets, indices, ids32.view(T, K), index_map, E, schedule)


def _ids_as_is(topk_ids: torch.Tensor, foreign: bool) -> bool:
    """The write pass reads the caller's ids themselves: contiguous int32 without foreign ids. With foreign ids (the
    last bucket's, ``schedule_experts < num_experts``) the count pass writes them clamped into that bucket, where a
    clamp of its own took a launch (1.2 µs per step at token rounding's 40,832 pairs: H200, ``python3
    benchmarks/bench_token_rounding.py speed --shapes 0 --variants none --breakdown 60``)."""
    return topk_ids.dtype == torch.int32 and topk_ids.is_contiguous() and not foreign


def _build_dispatch_impl(topk_ids: torch.Tensor, num_experts: int, tile_pairs: int, block_m: int,
                         pair_tokens: torch.Tensor | None = None, sched_experts: int = 0):
    """The three launches; returns ``(offsets, indices, index_map, ids32 [N] or [0] when not written,
    tile_expert, tile_row, num_tiles)`` (the schedule empty when ``block_m == 0``; over the first
    ``sched_experts`` experts, 0: all)."""
    T, K = topk_ids.shape
    N, E, dev = T * K, num_experts, topk_ids.device
    sms = sm_count(dev) if topk_ids.is_cuda else 132
    P, tiles, chunks = dispatch_plan(N, E, tile_pairs or None, sms)
    sched_e = sched_experts or E
    as_is = _ids_as_is(topk_ids, sched_e < E)
    new = lambda *shape: torch.empty(shape, dtype=torch.int32, device=dev)  # noqa: E731
    # separate buffers: a custom op's outputs may not alias each other or its input
    offsets, indices, index_map, ids32 = new(E + 1), new(N), new(T, K), new(0 if as_is else N)
    max_tiles = schedule_length(N, sched_e, block_m)
    sched = (new(max_tiles), new(max_tiles), new(1 if block_m else 0))
    if N == 0:
        sched[0].fill_(-1)
        sched[1].zero_()
        sched[2].zero_()
        return offsets.zero_(), indices, index_map, ids32, *sched
    ids_in = topk_ids if as_is else ids32  # [N] int32 ids the write pass reads (the count pass writes ids32)
    work = torch.empty((tiles + chunks + 1) * E, dtype=torch.int32, device=dev)
    tile_tab, chunk_tab = work[: tiles * E], work[tiles * E:]
    onehot = next_pow2(E) if E <= _ONEHOT_MAX_E else 0
    common = dict(K=K, S=_STEP, G=_WARPS, BLOCK_E=_BLOCK_E, ONEHOT_E=onehot, num_warps=_WARPS, num_stages=1)
    launch(_count_kernel, (chunks,),
        ids_ptr=topk_ids, ids32_ptr=ids_in, tile_ptr=tile_tab, chunk_ptr=chunk_tab, N=N, E=E, P=P,
        stride_ids_t=topk_ids.stride(0), stride_ids_k=topk_ids.stride(1), WRITE_IDS=not as_is, **common)
    be = min(_SCAN_BE, next_pow2(E))
    launch(_scan_kernel, (cdiv(E, be),), chunk_ptr=chunk_tab, C=chunks, E=E, BR=_SCAN_ELEMS // be, BE=be, num_warps=4)
    launch(_write_kernel, (chunks,),
        ids32_ptr=ids_in, tile_ptr=tile_tab, chunk_ptr=chunk_tab, offsets_ptr=offsets, indices_ptr=indices,
        map_ptr=index_map, tile_expert_ptr=sched[0], tile_row_ptr=sched[1], num_tiles_ptr=sched[2],
        tok_ptr=ids_in if pair_tokens is None else pair_tokens, N=N, E=E, C=chunks, P=P, max_tiles=max_tiles,
        SCHED_E=sched_e, SCHED_M=block_m, BLOCK_I=BLOCK_I, TOKEN_MAP=pair_tokens is not None, **common)
    return offsets, indices, index_map, ids32, *sched


# A custom op, so torch.compile(fullgraph=True) sees one opaque node instead of tracing the launcher's
# host-side planning (device properties, tile sizes); eager invocations skip it (see custom_ops.call_op).
_build_dispatch_op = torch.library.custom_op(
    "moeblaze::build_dispatch", _build_dispatch_impl, mutates_args=(),
    schema="(Tensor topk_ids, int num_experts, int tile_pairs, int block_m, Tensor? pair_tokens, int sched_experts) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")


@_build_dispatch_op.register_fake
def _(topk_ids, num_experts, tile_pairs, block_m, pair_tokens, sched_experts):
    T, K = topk_ids.shape
    new = lambda *shape: topk_ids.new_empty(shape, dtype=torch.int32)
    as_is = _ids_as_is(topk_ids, 0 < sched_experts < num_experts)
    max_tiles = schedule_length(T * K, sched_experts or num_experts, block_m)
    return (new(num_experts + 1), new(T * K), new(T, K), new(0 if as_is else T * K),
            new(max_tiles), new(max_tiles), new(1 if block_m else 0))
