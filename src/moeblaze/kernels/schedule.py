"""The grouped-GEMM tile schedule: M-tiles of ``block_m`` slots that never straddle experts.

MoEBlaze §4.2 (arXiv 2601.05296), DESIGN.md §3; the arrays' contract is at the top of :mod:`moeblaze.dispatch`.
:func:`schedule_entries` writes a block of entries from per-expert counts: inside the dispatch build's write pass,
from the totals every chunk already holds (no launch of its own), and in :func:`tile_schedule`'s one launch, from
``expert_token_offsets`` alone, for an index that was built without a schedule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import settings
from .direct import launch
from .tuning import cdiv

__all__ = ["tile_schedule", "schedule_entries", "schedule_length", "check_device", "BLOCK_I"]

BLOCK_I = 128  # schedule entries per program
_BLOCK_E = 64  # experts per block of the per-expert prefix sums


def check_device(t: torch.Tensor, name: str) -> None:
    """Raises ValueError unless ``t`` is on CUDA, or on any device under ``TRITON_INTERPRET=1``."""
    if not (t.is_cuda or settings.interpreting()):
        raise ValueError(f"{name} must be a CUDA tensor (or set TRITON_INTERPRET=1 to run on CPU), got {t.device}")


@triton.jit
def schedule_entries(
    counts_ptr,  # FROM_OFFSETS: [E + 1] int32 expert_token_offsets; else [E] int32 per-expert counts
    tile_expert_ptr,  # [max_tiles] int32 out: expert of each M-tile, -1 past the last tile
    tile_row_ptr,  # [max_tiles] int32 out: first slot of each M-tile, N past the last tile
    i,  # [BLOCK_I] int32 schedule entries to write
    E, max_tiles,
    FROM_OFFSETS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Entries ``i`` of the tile schedule (contract: moeblaze.dispatch); returns the number of tiles."""
    n_before = tl.zeros(i.shape, tl.int32)  # experts whose tiles all end at or before tile i
    tiles_before = tl.zeros(i.shape, tl.int32)
    rows_before = tl.zeros(i.shape, tl.int32)
    carry = tl.sum(tl.zeros([BLOCK_E], tl.int32), axis=0)  # tiles so far
    rows = carry  # slots so far
    for e0 in range(0, E, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        em = e < E
        if FROM_OFFSETS:
            cnt = tl.load(counts_ptr + e + 1, mask=em, other=0) - tl.load(counts_ptr + e, mask=em, other=0)
        else:
            cnt = tl.load(counts_ptr + e, mask=em, other=0)
        ntl = (cnt + BLOCK_M - 1) // BLOCK_M
        end = tl.cumsum(ntl, axis=0) + carry
        before = (end[None, :] <= i[:, None]) & em[None, :]  # [BLOCK_I, BLOCK_E]
        n_before += tl.sum(before.to(tl.int32), axis=1)
        tiles_before += tl.sum(tl.where(before, ntl[None, :], 0), axis=1)
        rows_before += tl.sum(tl.where(before, cnt[None, :], 0), axis=1)
        carry += tl.sum(ntl, axis=0)
        rows += tl.sum(cnt, axis=0)
    live = i < carry
    im = i < max_tiles
    tl.store(tile_expert_ptr + i, tl.where(live, n_before, -1), mask=im)
    tl.store(tile_row_ptr + i, tl.where(live, rows_before + (i - tiles_before) * BLOCK_M, rows), mask=im)
    return carry


@triton.jit(do_not_specialize=["E", "max_tiles"])
def _schedule_kernel(
    offsets_ptr,  # [E + 1] int32 expert_token_offsets
    tile_expert_ptr,  # [max_tiles] int32 out
    tile_row_ptr,  # [max_tiles] int32 out
    num_tiles_ptr,  # [1] int32 out
    E, max_tiles,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    i = pid * BLOCK_I + tl.arange(0, BLOCK_I)
    num = schedule_entries(offsets_ptr, tile_expert_ptr, tile_row_ptr, i, E, max_tiles, True, BLOCK_M, BLOCK_E)
    one = tl.arange(0, 1)
    tl.store(num_tiles_ptr + one, num + one * 0, mask=one * 0 + pid == 0)


def schedule_length(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Length of a tile schedule (0 when none is asked for: ``block_m == 0``)."""
    return cdiv(num_pairs, block_m) + num_experts if block_m else 0


def tile_schedule(
    expert_token_offsets: torch.Tensor, block_m: int, num_pairs: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grouped-GEMM schedule over the slots: M-tiles of ``block_m`` slots that never straddle experts.

    Expert e owns ``cdiv(count_e, block_m)`` consecutive tiles (none when empty), in expert order; a
    tile covers slots ``[tile_row_start, min(tile_row_start + block_m, offsets[e+1]))``. One launch,
    no host sync when ``num_pairs`` is given (MoEBlaze §4.2, DESIGN.md §3).

    Args:
        expert_token_offsets: ``[E+1]`` int32 (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        block_m: rows per M-tile, >= 1.
        num_pairs: N (``= offsets[E]``, e.g. ``DispatchIndex.num_pairs``); it only sizes the output.
            When None it is read from the device (one host synchronisation).

    Returns:
        ``(tile_expert [max_tiles] int32, tile_row_start [max_tiles] int32, num_tiles [1] int32)`` with
        ``max_tiles = cdiv(N, block_m) + E``, a static upper bound; entries at and past ``num_tiles``
        hold ``tile_expert = -1`` and ``tile_row_start = offsets[E]`` (= N).

    Raises:
        TypeError: offsets not int32.  ValueError: wrong rank/device, ``block_m < 1``, ``num_pairs < 0``.
    """
    off = expert_token_offsets
    if not isinstance(off, torch.Tensor) or off.dtype != torch.int32:
        raise TypeError(f"expert_token_offsets must be an int32 tensor, got {getattr(off, 'dtype', off)}")
    if off.dim() != 1 or off.numel() < 2:
        raise ValueError(f"expert_token_offsets must have shape [E+1] with E >= 1, got {tuple(off.shape)}")
    check_device(off, "expert_token_offsets")
    if int(block_m) < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    N = int(off[-1]) if num_pairs is None else int(num_pairs)
    if N < 0:
        raise ValueError(f"num_pairs must be >= 0, got {N}")
    E = off.numel() - 1
    max_tiles = schedule_length(N, E, int(block_m))
    off = off.contiguous()
    tile_expert = torch.empty(max_tiles, dtype=torch.int32, device=off.device)
    tile_row = torch.empty(max_tiles, dtype=torch.int32, device=off.device)
    num_tiles = torch.empty(1, dtype=torch.int32, device=off.device)
    launch(_schedule_kernel, (cdiv(max_tiles, BLOCK_I),),
        offsets_ptr=off, tile_expert_ptr=tile_expert, tile_row_ptr=tile_row, num_tiles_ptr=num_tiles, E=E,
        max_tiles=max_tiles, BLOCK_M=int(block_m), BLOCK_I=BLOCK_I, BLOCK_E=_BLOCK_E, num_warps=4)
    return tile_expert, tile_row, num_tiles
