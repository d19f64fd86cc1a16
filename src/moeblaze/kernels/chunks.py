"""``[N, d]`` slot buffers in column chunks of ``d``: F2-F3 and B3-B5 compute their slot rows a chunk of columns at a
time through one ``[N, width]`` buffer and combine each chunk into ``out`` (:func:`column_chunks` says why and
how wide; setting ``chunk_cols``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .. import settings
from . import tuning
from .combine import gather_sum, local_slots
from .launch import grouped_gemm

__all__ = ["column_chunks", "gemm_gather_sum", "peak_headroom"]

# Chunking pays only where an [N, d] buffer is a real share of a step's memory. Below 256 MiB the step is short
# and host-bound (2.6-4.2 ms of host time per layer step at 4,096 tokens on an H100, benchmarks/bench_host.py),
# where the two launches each extra chunk adds cost host time; at 256 MiB F2 alone is ~0.35 ms of GPU work
# (2Ndh FLOPs at 600 TF/s, d 2048, h 768).
_CHUNK_MIN_BYTES = 256 * 2**20
# Narrower chunks make the GEMM re-read its A operand (act, dpre) from memory once per chunk: at W columns a
# 650 TF/s GEMM asks 650e12 / W bytes/s of it, 1.3 TB/s at W = 512, under half the H100's bandwidth.
_CHUNK_MIN_COLS = 512
# Below 768 the GEMM's K (F2's h, B3's dpre row) is a short loop: the GEMM's time is its output write and the chunks'
# A re-reads and launches are a large share of it. sonicmoe-7b (d 1536, h 256, T 24,576, H200, `moeblaze bench
# --configs sonicmoe-7b --impls moeblaze` with MOEBLAZE_CHUNK_COLS=auto / off): 5.19 / 3.35 ms autotuned, 4.20 / 3.60
# fixed; at h 768-1024 (Qwen3-30B-A3B, OLMoE-1B-7B) the chunks cost 1-2%.
_CHUNK_MIN_K = 768


def peak_headroom(device: torch.device) -> int | None:
    """Bytes the caching allocator can hand out now without raising its peak since the last
    ``torch.cuda.reset_peak_memory_stats``: ``max_memory_allocated - memory_allocated`` on CUDA, None elsewhere."""
    if device.type != "cuda":
        return None
    allocated = torch.cuda.memory_stats_as_nested_dict(device)["allocated_bytes"]["all"]
    return allocated["peak"] - allocated["current"]


def column_chunks(num_slots: int, d: int, h: int, elem: int,
                  headroom: Callable[[], int | None] | None = None, a_elem: int | None = None,
                  col_extra: int = 0) -> list[tuple[int, int]]:
    """Column ranges ``[(c0, c1), ...]`` of ``d`` in which F2 computes ``y`` (and F3 combines it) and B3 computes
    ``dx_slots`` (and B5 sums it), through one ``[N, width]`` buffer instead of ``[N, d]``.

    ``h`` is the width the chunks may reach: F2 passes the expert dimension h (``act``'s row), B3 ``dpre``'s row
    (2h for gated activations, h otherwise). ``headroom``: called, only where ``auto`` chunks, for the bytes that
    may be allocated without raising the step's memory peak (e.g. :func:`peak_headroom`; None, or it returning
    None: unknown). ``a_elem``: bytes of an A element where they are not the buffer's ``elem`` (FP8 B3: e4m3 ``dpre``
    under a 16-bit buffer): the capped rule's chunks then hold no more bytes than A's rows (``h a_elem / elem``
    columns; d 2048, 2h 1,536: 3 chunks of at most 768 against 2 of 1,024). ``col_extra``: bytes allocated beside
    the buffer for each column of a chunk (FP8 B3: the chunk's e4m3 copy of ``w1^T``'s rows), fitted into the
    headroom with it.

    Setting ``chunk_cols``: ``off`` one chunk; a column count, chunks that wide; ``auto`` (default), once the whole
    ``[N, d]`` buffer would reach 256 MiB and ``h`` is at least 768, chunks of equal widths rounded up to 128: the
    fewest whose buffer fits in ``headroom``, and never more than the fewest no wider than ``max(512, h)`` (``h``
    scaled by ``a_elem / elem``; rounded down to 128) (d 2048 with no headroom: F2 at h 768 in 768 + 768 + 512
    columns, B3 in 2 x 1024).
    Why chunks: for d > h these buffers (``2Nd`` bytes in 16-bit) are the largest transients of the layer: ``y``
    sits beside ``act [N, h]`` and ``pre [N, 2h]`` in the forward, where a model's last layer holds every earlier
    layer's activations (the peak of a 4-layer transformers Qwen3-MoE, d 2048, h 768); a chunk no wider than the
    GEMM's A operand (``act``, ``dpre``) is no larger than a buffer the layer holds at that moment anyway.
    Why the headroom: each chunk more re-reads A and adds two launches, and the layers a step runs away from its
    memory peak have room for wider ones; within the headroom a wider buffer cannot raise the peak
    (``max_memory_allocated``), whose reference is the last ``torch.cuda.reset_peak_memory_stats``: a loop that
    resets it every step gets the capped chunks in its forward. Measured (H200): F2 and B3 alone at T 32,768-65,536
    (Qwen3-30B-A3B) in one chunk took 0.977-0.987x the capped chunks' time, B3 with 8-11% less energy per FLOP;
    the transformers Qwen3-MoE of issue 22 (``benchmarks/bench_hf.py --peak step``: the peak reset every step; rows
    in docs/results-hf.csv) stepped in 285.8 / 286.3 ms with the headroom against 286.0 / 288.7 capped, peak
    unchanged (38,234 MiB), and in 291.4 ms with ``off`` against 297.9 capped on another card (peak 39,001 MiB).
    Chunk starts are multiples of 16 columns (16-byte aligned TMA bases). Each output column is reduced as in one
    chunk: bitwise the one-chunk result with fixed configs (``MOEBLAZE_AUTOTUNE=0``; tested in fp32 and bf16).
    Tuned, the Triton GEMM (off the warp-specialized path) picks a config per chunk width (``N_COLS`` is in its
    autotune key): the same k order in 16-bit (every tuned 16-bit config has BLOCK_K 64), possibly another BLOCK_K
    in fp32, so equal within rounding there; a width first seen tunes once. The gather-sums tune once per row width
    d (:mod:`.combine`).
    """
    mode = settings.get("chunk_cols")
    if mode == "off":
        return [(0, d)]
    if mode == "auto":
        if num_slots * d * elem < _CHUNK_MIN_BYTES or h < _CHUNK_MIN_K:
            return [(0, d)]
        reach = h * (a_elem or elem) // elem  # the columns of a buffer of A's bytes
        most = tuning.cdiv(d, max(_CHUNK_MIN_COLS, reach // 128 * 128))  # the capped rule's count
        room = headroom() if headroom is not None else None  # the allocator read (host time) only here
        n = 1
        while n < most and (room is None or (num_slots * elem + col_extra) * _equal_width(d, n) > room):
            n += 1
        width = _equal_width(d, n)
    else:
        width = mode
    return [(c, min(c + width, d)) for c in range(0, d, width)] or [(0, d)]  # d = 0: one empty chunk


def _equal_width(d: int, n: int) -> int:
    """The width of ``n`` equal chunks of ``d`` columns, rounded up to 128."""
    return tuning.cdiv(tuning.cdiv(d, n), 128) * 128


def _slot_buffer(a: Tensor, N: int, d: int, h: int, a_elem: int | None = None, col_extra: int = 0,
                 weight_rows: Callable[[int, int], tuple[Tensor, Tensor]] | None = None,
                 ) -> tuple[list[tuple[int, int]], Tensor, tuple[Tensor, Tensor] | None]:
    """The column chunks of :func:`column_chunks` for an ``[N, d]`` slot buffer in ``a``'s dtype, that buffer, and
    ``weight_rows`` of the first chunk (None without it): the allocations the headroom was asked for.

    Chunks that fit the headroom but find no free block (fragmented memory) for the buffer or for the first chunk's
    weight copy fall back to the capped chunks, so the headroom never costs an out-of-memory error that the capped
    chunks would have avoided. The later chunks' copies are no wider than the first's and are made after the one
    before is freed."""
    elem = a.element_size()
    chunks = column_chunks(N, d, h, elem, lambda: peak_headroom(a.device), a_elem, col_extra)
    try:
        buf = a.new_empty(N, max(c1 - c0 for c0, c1 in chunks))
        return chunks, buf, (weight_rows(*chunks[0]) if weight_rows is not None else None)
    except torch.OutOfMemoryError:
        capped = column_chunks(N, d, h, elem, a_elem=a_elem)
        if capped == chunks:
            raise
    # out of the handler: its traceback held the failed call's frames and what they had allocated
    buf = None  # the wide buffer goes back before the capped one is asked for
    buf = a.new_empty(N, max(c1 - c0 for c0, c1 in capped))
    return capped, buf, (weight_rows(*capped[0]) if weight_rows is not None else None)


def gemm_gather_sum(a, w, b_nk, k_dim, offsets, indices, sched, token_index_map, weights, foreign, pair_offsets,
                     T, d, h, bias=None, out_dtype=None, weight_rows=None, a_elem=None, col_extra=0, **fp8_scales):
    """``out[t] = sum_k (w[t,k] *) (a[s] @ W[e] (+ bias[e]))[map[t,k]]`` over column chunks of d
    (:func:`column_chunks`): F2-F3 (``a = act``, weights and bias) and B3-B5 (``a = dpre``). ``out_dtype``: of
    ``out`` and the slot buffer (default ``a.dtype``; given for e4m3 ``a`` with its ``a_scale`` / ``b_scale``).
    ``weight_rows(c0, c1)``: ``(W [E, c1 - c0, k], b_scale [E, c1 - c0])``, the e4m3 rows of a ``b_nk`` weight that
    a chunk reads, made for it in place of ``w`` (FP8 B3: one chunk's copy of ``w1^T`` is live, not the whole).
    ``a_elem``, ``col_extra``: :func:`column_chunks`' (FP8 B3: 1, and the bytes of a chunk column's copy)."""
    N = indices.numel()
    dtype = out_dtype or a.dtype
    out = a.new_empty(T, d, dtype=dtype)
    chunks, buf, first = _slot_buffer(out, N, d, h, a_elem, col_extra, weight_rows)
    for i, (c0, c1) in enumerate(chunks):
        slots, w_c, start, scales = buf[:, :c1 - c0], w, c0, fp8_scales
        if weight_rows is not None:
            w_c, b_scale = first if i == 0 else weight_rows(c0, c1)
            first = None
            start, scales = None, {**fp8_scales, "b_scale": b_scale}
        grouped_gemm(a, w_c, slots, offsets, indices, sched, b_nk=b_nk, n_cols=c1 - c0, k_dim=k_dim, gather_a=False,
                     bias=None if bias is None else bias[:, c0:c1], a_tf32=True, n_start=start, **scales)
        del w_c  # before the next chunk's copy is made
        gather_sum(slots, token_index_map, weights, dtype, local_slots(offsets, foreign), pair_offsets,
                   out=out[:, c0:c1])
    return out  # the buffer is freed on return (B3: before dW1 is allocated, off the backward's peak)
