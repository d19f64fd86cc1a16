"""Warp-specialized FP8 grouped GEMM over slot rows for Hopper (sm90), in Gluon: F2, B1 and B3 of the FP8 layer.

``C[s, n] = a_scale[r] * w_scale[e, n] * sum_k A[r, k] W[e][n, k]`` for the slots ``s`` of an M-tile of expert
``e``, where ``r`` is the slot itself (F2's ``act``, B3's ``dpre``) or, ``GATHER_A``, its token (B1's ``dout``
rows, ``r = indices[s]``); A and W in e4m3 under the rowwise recipe (:mod:`moeblaze.fp8`; W stored ``[E, n, k]``,
K-major as the e4m3 tensor cores read it: F2's ``w_down``, B1's and B3's transposed copies of ``w_down`` and
``w_gate_up``), C in 16 bits, one column chunk ``[N_START, N_START + N_COLS)`` of W's n extent at a time. W comes by
TMA, A by TMA or, gathered, by 16-byte cp.async of its token rows (as :mod:`moeblaze.kernels.ws_wgrad` gathers).

Why a kernel of its own: Hopper's e4m3 MMA adds its products into an accumulator of fewer bits than fp32, so the
sums are promoted into an fp32 accumulator every 128 products (DeepSeek-V3 §3.3.2; without it the 1B preset
trained to 1.333 bits/byte against bf16-mixed's 1.277, docs/results-fp8-train.csv). In the Triton kernel
(:mod:`moeblaze.kernels.grouped_gemm`, ``FP8``) that promotion is an add of the tensor cores' partial sums that
waits for them, so the tensor cores idle while a k-step's adds run: its four e4m3 GEMMs took 6.83 ms of a Qwen3-
30B-A3B layer step promoted against 4.59 unpromoted (H200, ``python3 benchmarks/profile_layer.py --configs
qwen3-30b-a3b --impls moeblaze-fp8 --kernels``, docs/results-fp8-profile.csv). Here the 128-row tile is split
between two mma partitions of one warp group each (rows 0-63 and 64-127), as DeepGEMM's two math warp groups: each
waits for its own ``wgmma`` and adds its partial sums while the other's ``wgmma`` keeps the tensor cores busy.

Why 256 columns: each k-step brings its A box and its weight box from L2 into shared memory, 32 KiB for the 4.2
MFLOP of a 128 x 128 tile (at the 750-900 TFLOP/s it reached, over 6 TB/s of L2 reads), 48 KiB for the 8.4 MFLOP
of a 128 x 256 one. A warp group's promoted sums are then two 64 x 128 accumulators and one partial sum at a time:
the tile's halves take a ``wgmma`` each, promoted in turn. Measured (H200, T 32,768, CUDA-graph replay, three
alternating rounds, bitwise alike; ``.../bench_ws.py --fp8``'s operands): F2 0.98-0.99 against 1.08-1.10 ms, B1
0.82-0.84 against 0.97-0.99, B3 1.63-1.67 against 1.83-2.19 at Qwen3-30B-A3B; 1.19-1.26 / 1.11-1.13 / 2.05-2.11
against 1.33-1.36 / 1.29-1.37 / 2.29-2.30 at OLMoE-1B-7B; the FP8 layer step 12.55 against 13.06-13.11 ms and
14.92-14.99 against 15.24-15.49 (``moeblaze bench``, alternating; rows in docs/results-ws.csv and docs/results.csv).

  mma      (4 warps, default; 4 warps, worker)  two ``wgmma`` of 64 rows x ``WGMMA_N`` over one stage into fresh
                               partial sums, each waited for and added to its fp32 accumulator; after the last
                               stage the accumulators times the row and weight-row scales, rounded into the warp
                               group's half of ``c_smem``
  loader   (2 warps)           the A box ``[BLOCK_M, BLOCK_K]`` and the weight box ``[BLOCK_N, BLOCK_K]`` by TMA,
                               ``NUM_STAGES`` deep (:func:`moeblaze.kernels.ws_gemm._loader`; a stage is free once
                               both mma partitions have used it); ``GATHER_A``: the A rows of the tile's slots by
                               cp.async (:func:`_gather_loader`), rows past the expert's last slot zero-filled
  epilogue (2 warps)           ``c_smem`` to ``C``, rows past the expert's last slot masked
                               (:func:`moeblaze.kernels.ws_gemm._epilogue`)

The sums are those of the Triton kernel's promoted main loop, in its order (each 128-product partial sum of the
tensor cores added to the accumulator in k order, then ``acc * a_scale * w_scale``), so the two agree bitwise where
the tensor cores sum a k-step alike. Conditions (:func:`moeblaze.kernels.launch.ws_gemm_ok`): an sm90 GPU,
triton 3.6, e4m3 operands with a K-major weight, a 16-bit output, the 128-row tile schedule, 16-byte aligned rows.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .ws_gemm import _epilogue, _loader, _tile, _tiles
from .ws_wgrad import EPILOGUE_WARPS, LOADER_WARPS, stage_barriers, tile_barriers

MMA_WARPS: gl.constexpr = gl.constexpr(4)  # one warp group per half of the 128-row tile
# columns of one wgmma: a warp group's 64 x 128 fp32 sums are 64 registers a thread; a tile holds two of them
WGMMA_N: gl.constexpr = gl.constexpr(128)
# 12 warps: 168 registers each at launch (65536 / 384, 64,512 in all). The loader and the epilogue give theirs down
# to 80, the worker mma warp group takes 216 and the default one the rest, 208: two 64 x 128 fp32 accumulators and
# one partial sum are 192 per thread. Built for sm_90 by scripts/gluon_sm90_compile.py (triton 3.6): stack frames of
# 8 and 0 bytes (the TMA and the gathering loader's kernel) with these; 32 / 120 with 232 / 48, 32 / 16 with 208 / 96.
MAX_REGS = 168
MMA_REGS: gl.constexpr = gl.constexpr(216)
IO_REGS: gl.constexpr = gl.constexpr(80)


@gluon.jit
def half_tile(ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
    """An mma warp group's ``[ROWS, BLOCK_N]`` half of the output tile in the e4m3 wgmma's register layout: its fp32
    zeros (the accumulator's start, the fresh partial sums' input), its row and its column offsets."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[MMA_WARPS, 1],
                                                     instr_shape=[16, BLOCK_N, 32])
    zero = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=layout)
    return zero, gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout)), gl.arange(0, BLOCK_N,
                                                                               layout=gl.SliceLayout(0, layout))


@gluon.jit
def _gather_loader(gather,  # tuple (a_ptr, indices_ptr, A_ROWS, stride_a_t, UP_OFF):
                            #   a_ptr: [T, K_DIM] e4m3 token rows (x for F1, dout for B1), row t at t * stride_a_t,
                            #          unit column stride
                            #   indices_ptr: [N] int32 expert_token_indices (slot -> token)
                   w_desc,  # TMA descriptor over the e4m3 weight rows [E * N_EXT, K_DIM], box [BLOCK_N, BLOCK_K]
                   sched,  # tuple of the tile schedule:
                           #   tile_expert_ptr: [max_tiles] int32 expert of each M-tile
                           #   tile_row_ptr: [max_tiles] int32 first slot of each M-tile
                           #   offsets_ptr: [E+1] int32 expert_token_offsets
                           #   num_tiles_ptr: [1] int32 valid M-tiles
                   smem, bars, dims, DUAL: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                   WARPS: gl.constexpr):
    """Fill stage ``s``: the weight box by TMA (``DUAL``: two, n and ``UP_OFF + n``, one after the other in the
    stage, F1's gate and up rows), the tile's token rows of A by cp.async from each of the partition's ``WARPS``
    warps; all complete ``ready[s]``."""
    a_ptr, indices_ptr, A_ROWS, stride_a_t, UP_OFF = gather
    tile_expert_ptr, tile_row_ptr, offsets_ptr, num_tiles_ptr = sched
    a_bufs, w_bufs, c_smem = smem
    ready, empty, c_ready, c_empty = bars
    K_DIM, N_COLS, N_EXT, N_START, stride_c_m = dims
    # 16 contiguous e4m3 values (one 16-byte cp.async) per thread and row, 4 rows per warp and pass
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [WARPS, 1], [1, 0])
    r_in = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    ks = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    num_tiles, num_n, my_tiles = _tiles(num_tiles_ptr, N_COLS, BLOCK_N)
    it = 0  # k-steps issued so far: stage it % NUM_STAGES, phase (it // NUM_STAGES) & 1
    for i_tile in range(my_tiles):
        pid_n, e, row0, row_end = _tile(i_tile, num_tiles, num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                                        GROUP_M)
        slots = row0 + r_in
        in_expert = slots < row_end
        tokens = gl.load(indices_ptr + slots, mask=in_expert, other=0)
        rows = a_ptr + tokens.to(gl.int64)[:, None] * stride_a_t
        for k in range(0, K_DIM, BLOCK_K):
            s = it % NUM_STAGES
            mbarrier.wait(empty.index(s), ((it // NUM_STAGES) & 1) ^ 1)  # passes at once on the first round
            bar = ready.index(s)
            w_row = e * N_EXT + N_START + pid_n * BLOCK_N
            if DUAL:
                mbarrier.expect(bar, 2 * w_desc.block_type.nbytes)
                w_stage = w_bufs.index(s)
                tma.async_copy_global_to_shared(w_desc, [w_row, k], bar, w_stage.slice(0, BLOCK_N, dim=0))
                tma.async_copy_global_to_shared(w_desc, [w_row + UP_OFF, k], bar,
                                                w_stage.slice(BLOCK_N, BLOCK_N, dim=0))
            else:
                mbarrier.expect(bar, w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(w_desc, [w_row, k], bar, w_bufs.index(s))
            mask = in_expert[:, None] & ((k + ks) < K_DIM)[None, :]
            async_copy.async_copy_global_to_shared(a_bufs.index(s), rows + (k + ks)[None, :], mask=mask)
            async_copy.mbarrier_arrive(bar, increment_count=False)
            it += 1


@gluon.jit
def _mma(scales,  # tuple of the dequantization scales:
                  #   a_scale_ptr: [A_ROWS] fp32 scale of each A row (a token's, gathered; else a slot's)
                  #   w_scale_ptr: [E, N_EXT] fp32 scale of each weight row, row e at e * stride_ws_e
                  #   indices_ptr: [N] int32 expert_token_indices (slot -> token), for the gathered A rows' scales
                  #   A_ROWS, stride_ws_e: A's rows, the weight scales' expert stride
         sched,  # tuple of the tile schedule:
                 #   tile_expert_ptr: [max_tiles] int32 expert of each M-tile
                 #   tile_row_ptr: [max_tiles] int32 first slot of each M-tile
                 #   offsets_ptr: [E+1] int32 expert_token_offsets
                 #   num_tiles_ptr: [1] int32 valid M-tiles
         smem, bars, dims, HALF: gl.constexpr, GATHER_A: gl.constexpr, BLOCK_M: gl.constexpr,
         BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """Rows ``HALF * BLOCK_M / 2 ..`` of each tile: the promoted sums over the stages, scaled, into ``c_smem``; the
    tile's two ``WGMMA_N``-column halves each summed by a wgmma of their own into an accumulator of their own."""
    a_scale_ptr, w_scale_ptr, indices_ptr, A_ROWS, stride_ws_e = scales
    tile_expert_ptr, tile_row_ptr, offsets_ptr, num_tiles_ptr = sched
    a_bufs, w_bufs, c_smem = smem
    ready, empty, c_ready, c_empty = bars
    K_DIM, N_COLS, N_EXT, N_START, stride_c_m = dims
    gl.static_assert(BLOCK_N == 2 * WGMMA_N, "the tile is two wgmma widths")
    ROWS: gl.constexpr = BLOCK_M // 2
    zero, r_in, c_in = half_tile(ROWS, WGMMA_N)
    num_tiles, num_n, my_tiles = _tiles(num_tiles_ptr, N_COLS, BLOCK_N)
    it = 0  # k-steps consumed so far: stage it % NUM_STAGES, phase (it // NUM_STAGES) & 1
    for i_tile in range(my_tiles):
        pid_n, e, row0, row_end = _tile(i_tile, num_tiles, num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                                        GROUP_M)
        acc_lo = zero
        acc_hi = zero
        for _k in range(0, K_DIM, BLOCK_K):
            s = it % NUM_STAGES
            mbarrier.wait(ready.index(s), (it // NUM_STAGES) & 1)
            if GATHER_A:
                fence_async_shared()  # the gathered rows came by cp.async (generic proxy); wgmma reads the async one
            a = a_bufs.index(s).slice(HALF * ROWS, ROWS, dim=0)
            w = w_bufs.index(s)  # [BLOCK_N, BLOCK_K] rows n; each half permuted: K-major [BLOCK_K, WGMMA_N]
            part = warpgroup_mma(a, w.slice(0, WGMMA_N, dim=0).permute((1, 0)), zero, use_acc=False, is_async=True)
            part = warpgroup_mma_wait(0, deps=(part,))
            acc_lo = acc_lo + part  # the promotion: fp32 adds while the other warp group's wgmma runs
            part = warpgroup_mma(a, w.slice(WGMMA_N, WGMMA_N, dim=0).permute((1, 0)), zero, use_acc=False,
                                 is_async=True)
            part = warpgroup_mma_wait(0, deps=(part,))
            mbarrier.arrive(empty.index(s), count=1)  # this warp group is done with the stage
            acc_hi = acc_hi + part
            it += 1
        rows = row0 + HALF * ROWS + r_in
        cols = N_START + pid_n * BLOCK_N + c_in
        if GATHER_A:  # the scale of each slot's token row
            a_rows = gl.load(indices_ptr + rows, mask=rows < A_ROWS, other=0)
        else:
            a_rows = rows
        a_scale = gl.load(a_scale_ptr + a_rows, mask=rows < A_ROWS, other=0.0)[:, None]
        w_scales = w_scale_ptr + e.to(gl.int64) * stride_ws_e
        w_lo = gl.load(w_scales + cols, mask=cols < N_START + N_COLS, other=0.0)
        w_hi = gl.load(w_scales + WGMMA_N + cols, mask=WGMMA_N + cols < N_START + N_COLS, other=0.0)
        acc_lo = acc_lo * a_scale * w_lo[None, :]
        acc_hi = acc_hi * a_scale * w_hi[None, :]
        mbarrier.wait(c_empty.index(0), (i_tile & 1) ^ 1)
        out = c_smem.slice(HALF * ROWS, ROWS, dim=0)
        out.slice(0, WGMMA_N, dim=1).store(acc_lo.to(c_smem.dtype))
        out.slice(WGMMA_N, WGMMA_N, dim=1).store(acc_hi.to(c_smem.dtype))
        mbarrier.arrive(c_ready.index(0), count=1)


@gluon.jit
def fp8_ws_gemm_kernel(
    a_desc,  # TMA descriptor over the [A_ROWS, K_DIM] e4m3 slot rows (act for F2, dpre for B3), box [BLOCK_M, BLOCK_K]; None if GATHER_A
    a_ptr,  # GATHER_A: [T, K_DIM] e4m3 token rows (dout for B1), row t at t * stride_a_t, unit column stride
    w_desc,  # TMA descriptor over the e4m3 weight rows [E * N_EXT, K_DIM], box [BLOCK_N, BLOCK_K]
    c_ptr,  # [N, >= N_COLS] 16-bit output slot rows (y for F2, dact for B1, dx_slots for B3), unit column stride
    a_scale_ptr,  # [rows of A] fp32 dequantization scale of each row of A (token rows if GATHER_A)
    w_scale_ptr,  # [E, N_EXT] fp32 dequantization scale of each weight row, row e at e * stride_ws_e
    offsets_ptr,  # [E+1] int32 expert_token_offsets
    indices_ptr,  # [N] int32 expert_token_indices (slot -> token; GATHER_A)
    tile_expert_ptr,  # [max_tiles] int32 expert of each M-tile
    tile_row_ptr,  # [max_tiles] int32 first slot of each M-tile
    num_tiles_ptr,  # [1] int32 valid M-tiles
    A_ROWS, K_DIM, N_COLS, N_EXT, N_START,  # slots N; reduction length; output columns; weight rows per expert; first
    stride_c_m, stride_ws_e, stride_a_t,
    GATHER_A: gl.constexpr,  # A's rows are the slots' tokens, gathered by cp.async; else slot rows by TMA
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
):
    dtype: gl.constexpr = w_desc.dtype
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_layout)
    w_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    c_dtype: gl.constexpr = c_ptr.dtype.element_ty
    c_smem = gl.allocate_shared_memory(c_dtype, [BLOCK_M, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], c_dtype))
    # ready: the loader's expect (one arrival with the TMA boxes' bytes) and, gathering, each loader thread's
    # cp.async arrival; empty and c_ready: both mma halves
    ready, empty = stage_barriers(NUM_STAGES, 1 + LOADER_WARPS * 32 if GATHER_A else 1, 2)
    c_ready, c_empty = tile_barriers(2)

    scales = (a_scale_ptr, w_scale_ptr, indices_ptr, A_ROWS, stride_ws_e)
    sched = (tile_expert_ptr, tile_row_ptr, offsets_ptr, num_tiles_ptr)
    smem = (a_bufs, w_bufs, c_smem)
    bars = (ready, empty, c_ready, c_empty)
    dims = (K_DIM, N_COLS, N_EXT, N_START, stride_c_m)
    # constexprs go into the partitions' argument lists directly (a tuple variable would hold them as values)
    if GATHER_A:
        gl.warp_specialize([
            (_mma, (scales, sched, smem, bars, dims, 0, True, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, GROUP_M)),
            (_mma, (scales, sched, smem, bars, dims, 1, True, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, GROUP_M)),
            (_gather_loader, ((a_ptr, indices_ptr, A_ROWS, stride_a_t, 0), w_desc, sched, smem, bars, dims, False,
                              BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, GROUP_M, LOADER_WARPS)),
            (_epilogue, (c_ptr, sched, smem, bars, dims, BLOCK_M, BLOCK_N, GROUP_M)),
        ], [MMA_WARPS, LOADER_WARPS, EPILOGUE_WARPS], [MMA_REGS, IO_REGS, IO_REGS])
    else:
        gl.warp_specialize([
            (_mma, (scales, sched, smem, bars, dims, 0, False, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, GROUP_M)),
            (_mma, (scales, sched, smem, bars, dims, 1, False, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, GROUP_M)),
            (_loader, ((a_desc, w_desc), sched, smem, bars, dims, True, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES,
                       GROUP_M)),
            (_epilogue, (c_ptr, sched, smem, bars, dims, BLOCK_M, BLOCK_N, GROUP_M)),
        ], [MMA_WARPS, LOADER_WARPS, EPILOGUE_WARPS], [MMA_REGS, IO_REGS, IO_REGS])
