"""Deterministic gather-sum combine (DESIGN.md §5: F3 and B5), fp32 accumulation, no atomics.

``out[t, :] = sum_{k < K} (w[t, k] *) src[token_index_map[t, k], :]`` with ``k`` in ascending order:
F3 combines the expert outputs ``y [N, d]`` with the router weights; B5 sums ``dx_slots [N, d]``
(``HAS_W`` off). Each program owns a ``[BLOCK_T, BLOCK_D]`` tile of ``out``; no two programs write the
same element, so the result is bitwise reproducible. ``HAS_LIMIT`` (an index with foreign experts):
slots ``>= limit[0]`` belong to other ranks' experts, were never computed, and count as zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import Launchable, cdiv, gather_sum_configs


@triton.jit
def _add_pair(acc, k,
              src_ptr,  # [N, D] slot rows (y or dx_slots)
              w_ptr,  # [T, K] router weights (HAS_W), any float dtype; CSR: [P]
              map_ptr,  # [T, K] int32 token_index_map (pair -> slot); CSR: [P]
              pair_row, local, t_mask, mask, offs_d, count,
              stride_src_m, stride_w_t, stride_w_k, stride_map_t, stride_map_k,
              HAS_W: tl.constexpr, HAS_LIMIT: tl.constexpr, CSR: tl.constexpr):
    """``acc + (w[t, k] *) src[map[t, k]]`` for the tile's tokens (pair k of each; CSR: only where k < count)."""
    k_mask = t_mask
    v_mask = mask
    if CSR:
        k_mask = t_mask & (k < count)
        v_mask = mask & k_mask[:, None]
    slot = tl.load(map_ptr + pair_row * stride_map_t + k * stride_map_k, mask=k_mask, other=0).to(tl.int64)
    if HAS_LIMIT:
        v_mask = v_mask & (slot < local)[:, None]
    v = tl.load(src_ptr + slot[:, None] * stride_src_m + offs_d[None, :], mask=v_mask, other=0.0).to(tl.float32)
    if HAS_W:
        w = tl.load(w_ptr + pair_row * stride_w_t + k * stride_w_k, mask=k_mask, other=0.0).to(tl.float32)
        v = v * w[:, None]
    return acc + v


@triton.jit
def gather_sum_kernel(
    src_ptr,  # [N, D] slot rows (y or dx_slots)
    w_ptr,  # [T, K] router weights (HAS_W), any float dtype
    map_ptr,  # [T, K] int32 token_index_map (pair -> slot)
    out_ptr,  # [T, D] result
    limit_ptr,  # [1] int32 number of local slots (HAS_LIMIT)
    pair_off_ptr,  # [T + 1] int32 first pair of each token (CSR: general routing; map and w are then [P])
    T, D,
    stride_src_m, stride_w_t, stride_w_k, stride_map_t, stride_map_k, stride_out_t,
    K: tl.constexpr,  # pairs per token (CSR: the first K pairs of each token unrolled, the rest looped)
    HAS_W: tl.constexpr, HAS_LIMIT: tl.constexpr, CSR: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_mask = offs_t < T
    mask = t_mask[:, None] & (offs_d < D)[None, :]
    rows_t = offs_t.to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    local = tl.load(limit_ptr) if HAS_LIMIT else 0
    if CSR:  # pairs first[t] + k, k < count[t]: the row (t, k) of the top-k layout, so the same sums
        first = tl.load(pair_off_ptr + rows_t, mask=t_mask, other=0)
        count = tl.load(pair_off_ptr + rows_t + 1, mask=t_mask, other=0) - first
        pair_row = first.to(tl.int64)
        # the first K pairs unrolled as below (their loads go out together), the rest one by one: token
        # rounding's pairs (T*K top-k pairs and J*E pad entries, ~K + 0.5 per token) took 92 against 72 µs
        # per layer step looped at T 16384, E 128, K 2, and 480 against 385 at E 512, K 10 (the ceiling's top-k
        # layout; H200, ``python3 benchmarks/bench_token_rounding.py speed --shapes 0,2 --breakdown 22``)
        for k in tl.static_range(K):
            acc = _add_pair(acc, k, src_ptr, w_ptr, map_ptr, pair_row, local, t_mask, mask, offs_d, count,
                            stride_src_m, stride_w_t, stride_w_k, stride_map_t, stride_map_k, HAS_W, HAS_LIMIT, CSR)
        for k in range(K, tl.max(count, axis=0)):
            acc = _add_pair(acc, k, src_ptr, w_ptr, map_ptr, pair_row, local, t_mask, mask, offs_d, count,
                            stride_src_m, stride_w_t, stride_w_k, stride_map_t, stride_map_k, HAS_W, HAS_LIMIT, CSR)
    else:
        # unrolled: the K slot-row loads of a tile are independent and go out together, where a loop waited for
        # each pair's slot id, then its row. Qwen3-30B-A3B at T 32,768, F3's three column chunks 0.442 ms
        # against 0.532 looped, B5's 0.422 against 0.475; SonicMoE's one unchunked gather-sum 0.403 (H100,
        # two runs, ``benchmarks/profile_layer.py --configs qwen3-30b-a3b --impls
        # moeblaze,sonicmoe --timeline``)
        for k in tl.static_range(K):
            acc = _add_pair(acc, k, src_ptr, w_ptr, map_ptr, rows_t, local, t_mask, mask, offs_d, 0,
                            stride_src_m, stride_w_t, stride_w_k, stride_map_t, stride_map_k, HAS_W, HAS_LIMIT, CSR)
    tl.store(out_ptr + rows_t[:, None] * stride_out_t + offs_d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


# Keyed on the output's row stride, not D: F3 and B5 write each column chunk into a slice of the whole [T, d]
# output, so every chunk width of a layer shares one tuning. Keyed on D, a chunk width first seen mid-run (the
# allocator's headroom widens F2's chunks from the second step on: kernels.chunks.column_chunks) tuned there, and
# its ~2 s of autotuning landed in a timed step: the 8-layer Qwen3-30B-A3B stack at T 16,384 and 32,768 averaged
# 152.1 and 214.8 ms per eager step against 62.4 and 119.1 replayed (H200, benchmarks/gpu_issue24.sh
# PART=sweep). One config serves the widths: one token by 1,024 columns was the best on 768- and 2,048-column rows
# (tuning.gather_sum_configs).
_GATHER_SUM = Launchable(gather_sum_kernel, gather_sum_configs, key=["stride_out_t", "K", "HAS_W", "CSR"])


def local_slots(offsets: torch.Tensor, foreign: bool) -> torch.Tensor | None:
    """``[1]`` int32 count of local slots (the last of the local experts' ``offsets``) for an index with foreign
    experts, the bound :func:`gather_sum` and the activation backward take; None without foreign experts."""
    return offsets[-1:] if foreign else None


def gather_sum(src: torch.Tensor, token_index_map: torch.Tensor, weights: torch.Tensor | None,
               out_dtype: torch.dtype, local_slots: torch.Tensor | None = None,
               pair_offsets: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_k (weights[t, k] *) src[token_index_map[t, k]]`` in fp32, returned in ``out_dtype``.

    Args:
        src: ``[N, D]`` slot rows, unit stride along D.
        token_index_map: ``[T, K]`` int32 pair -> slot (``[P]`` with ``pair_offsets``).
        weights: ``[T, K]`` (``[P]``) float router weights, or ``None`` for a plain sum.
        out_dtype: dtype of the ``[T, D]`` result.
        local_slots: ``[1]`` int32 on the device; slots at or past it count as zero (foreign experts).
        pair_offsets: ``[T+1]`` int32 CSR of general routing: token t sums pairs
            ``pair_offsets[t]:pair_offsets[t+1]`` in order (``k = p - pair_offsets[t]``).
        out: ``[T, D]`` in ``out_dtype`` with unit column stride to write into (e.g. a column slice of a wider
            result: B5 over one column chunk of ``dx``); a new tensor when None.

    Raises:
        ValueError: ``out`` of another shape, dtype or device, or without unit column stride.
    """
    csr = pair_offsets is not None
    if csr:
        T = pair_offsets.numel() - 1
        K = min(16, token_index_map.numel() // max(T, 1))  # pairs unrolled: the mean per token, rounded down
        token_index_map = token_index_map.view(-1, 1)
        weights = weights.view(-1, 1) if weights is not None else None
    else:
        T, K = token_index_map.shape
    D = src.shape[1]
    if out is None:
        out = torch.empty(T, D, dtype=out_dtype, device=src.device)
    elif out.shape != (T, D) or out.dtype != out_dtype or out.device != src.device or (D > 1 and out.stride(1) != 1):
        raise ValueError(f"gather_sum: out must be [{T}, {D}] {out_dtype} on {src.device} with unit column stride, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device} strides {out.stride()}")
    if T == 0 or D == 0:
        return out
    w = weights if weights is not None else token_index_map  # dummy pointer when HAS_W is off
    limit = local_slots if local_slots is not None else token_index_map  # dummy pointer when HAS_LIMIT is off
    offs = pair_offsets if csr else token_index_map  # dummy pointer when CSR is off
    # CSR: the pair p = first[t] + k is row p of [P, 1] tensors, read as (row first[t], column k) with the
    # column stride equal to the row stride.
    map_k = token_index_map.stride(0) if csr else token_index_map.stride(1)
    w_k = w.stride(0) if csr else w.stride(1)
    _GATHER_SUM.launch(src.dtype, lambda meta: (cdiv(T, meta["BLOCK_T"]), cdiv(D, meta["BLOCK_D"])),
        src_ptr=src, w_ptr=w, map_ptr=token_index_map, out_ptr=out, limit_ptr=limit, pair_off_ptr=offs,
        T=T, D=D, K=K,
        stride_src_m=src.stride(0), stride_w_t=w.stride(0), stride_w_k=w_k, stride_map_t=token_index_map.stride(0),
        stride_map_k=map_k, stride_out_t=out.stride(0), HAS_W=weights is not None, HAS_LIMIT=local_slots is not None, CSR=csr,
    )
    return out
