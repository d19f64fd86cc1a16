"""Warp-specialized grouped GEMM over slot rows for Hopper (sm90), in Gluon: F2 and B3 (DESIGN.md §5).

``C[s, n] = sum_k A[s, k] * W[e][k, n]`` for the slots ``s`` of an M-tile of expert ``e`` (the index's tile
schedule): F2 ``y = act W_down[e]^T`` (``W_NK``: ``w_down [E, d, h]`` rows are n) and B3 ``dx_slots = dpre
W_gate_up[e]`` (``w_gate_up [E, 2h, d]`` rows are k), one column chunk ``[N_START, N_START + N_COLS)`` of the
weight's n extent at a time. Both operands come by TMA; nothing is gathered.

Why: these GEMMs are the plain ones of the layer step, where the Triton kernel (one warp group that both
loads and multiplies, the store of a tile idling the tensor cores) stayed 5-20% behind SonicMoE's CUTLASS
kernels (kernel by kernel: ``python3 benchmarks/profile_layer.py --configs C --impls moeblaze,sonicmoe --timeline``;
this kernel's gain: docs/benchmarks.md, "Kernels"). One persistent CTA per SM runs three
partitions over the same sequence of output tiles, as :mod:`moeblaze.kernels.ws_wgrad` does:

  mma      (8 warps, default)  ``wgmma`` into a 128 x ``BLOCK_N`` fp32 accumulator, one in flight; the tile goes
                               once, rounded, into ``c_smem``;
  loader   (2 warps)           the A box ``[BLOCK_M, BLOCK_K]`` of the tile's slot rows and the weight box by TMA,
                               ``NUM_STAGES`` deep;
  epilogue (2 warps)           ``c_smem`` to ``C``, rows past the expert's last slot masked (they belong to the
                               next expert's tiles), while the mma partition runs the next tile.

An M-tile's A box may run into the next expert's slot rows (read, multiplied, never stored) or past the last
row (zero-filled). Sums are fp32 in a fixed order, no atomics: bitwise reproducible, not bitwise equal to the
Triton kernel. Conditions (:func:`moeblaze.kernels.launch.ws_gemm_ok`): triton 3.6, an sm90 GPU, 16-bit
operands, the 128-row tile schedule, contiguous weights, 16-byte aligned rows, ``K_DIM % 64 == 0`` when the
weight's rows are k (a box never runs into the next expert's weight).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .ws_wgrad import EPILOGUE_WARPS, LOADER_WARPS, WORKER_REGS, hand_off, stage_barriers, tile_barriers


@gluon.jit
def _tiles(num_tiles_ptr,  # [1] int32 valid M-tiles
           N_COLS, BLOCK_N: gl.constexpr):
    """A persistent program's share of the output tiles: (M-tiles, n-tiles per M-tile, how many tiles it runs: its
    ``i_tile``-th is ``program_id + i_tile * num_programs``)."""
    num_tiles = gl.load(num_tiles_ptr)
    num_n = gl.cdiv(N_COLS, BLOCK_N)
    return num_tiles, num_n, gl.cdiv(num_tiles * num_n - gl.program_id(0), gl.num_programs(0))


@gluon.jit
def _tile(i_tile, num_tiles, num_n,
          tile_expert_ptr,  # [max_tiles] int32 expert of each M-tile
          tile_row_ptr,  # [max_tiles] int32 first slot of each M-tile
          offsets_ptr,  # [E+1] int32 expert_token_offsets
          GROUP_M: gl.constexpr):
    """This program's ``i_tile``-th output tile -> (n-tile, expert, first slot, end slot of the expert); grouped
    order for L2."""
    t = gl.program_id(0) + i_tile * gl.num_programs(0)
    num_in_group = GROUP_M * num_n
    first_m = (t // num_in_group) * GROUP_M
    group_size = gl.minimum(num_tiles - first_m, GROUP_M)
    pid_m = first_m + (t % num_in_group) % group_size
    pid_n = (t % num_in_group) // group_size
    e = gl.load(tile_expert_ptr + pid_m)
    return pid_n, e, gl.load(tile_row_ptr + pid_m), gl.load(offsets_ptr + e + 1)


@gluon.jit
def _loader(descs,  # tuple of TMA descriptors:
                    #   a_desc: over the [N, K_DIM] 16-bit slot rows (act for F2, dpre for B3), box [BLOCK_M, BLOCK_K]
                    #   w_desc: over the weight rows, W_NK [E*N_EXT, K_DIM] box [BLOCK_N, BLOCK_K];
                    #           else [E*K_DIM, n] box [BLOCK_K, BLOCK_N]
            sched,  # tuple of the tile schedule:
                    #   tile_expert_ptr: [max_tiles] int32 expert of each M-tile
                    #   tile_row_ptr: [max_tiles] int32 first slot of each M-tile
                    #   offsets_ptr: [E+1] int32 expert_token_offsets
                    #   num_tiles_ptr: [1] int32 valid M-tiles
            smem, bars, dims, W_NK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """Fill stage ``s``: the A box and the weight box by TMA, both completing ``ready[s]``."""
    a_desc, w_desc = descs
    tile_expert_ptr, tile_row_ptr, offsets_ptr, num_tiles_ptr = sched
    a_bufs, w_bufs, c_smem = smem
    ready, empty, c_ready, c_empty = bars
    K_DIM, N_COLS, N_EXT, N_START, stride_c_m = dims
    num_tiles, num_n, my_tiles = _tiles(num_tiles_ptr, N_COLS, BLOCK_N)
    it = 0  # k-steps issued so far: stage it % NUM_STAGES, phase (it // NUM_STAGES) & 1
    for i_tile in range(my_tiles):
        pid_n, e, row0, row_end = _tile(i_tile, num_tiles, num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                                        GROUP_M)
        n0 = N_START + pid_n * BLOCK_N
        for k in range(0, K_DIM, BLOCK_K):
            s = it % NUM_STAGES
            mbarrier.wait(empty.index(s), ((it // NUM_STAGES) & 1) ^ 1)  # passes at once on the first round
            bar = ready.index(s)
            mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [row0, k], bar, a_bufs.index(s))
            if W_NK:  # rows e * N_EXT + n, columns k
                tma.async_copy_global_to_shared(w_desc, [e * N_EXT + n0, k], bar, w_bufs.index(s))
            else:  # rows e * K_DIM + k, columns n
                tma.async_copy_global_to_shared(w_desc, [e * K_DIM + k, n0], bar, w_bufs.index(s))
            it += 1


@gluon.jit
def _mma(sched,  # tuple of the tile schedule:
                 #   tile_expert_ptr: [max_tiles] int32 expert of each M-tile
                 #   tile_row_ptr: [max_tiles] int32 first slot of each M-tile
                 #   offsets_ptr: [E+1] int32 expert_token_offsets
                 #   num_tiles_ptr: [1] int32 valid M-tiles
         smem, bars, dims, W_NK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
         BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr):
    """``acc = sum_k A_k W_k`` over the stages (one wgmma in flight), then the tile into ``c_smem``."""
    tile_expert_ptr, tile_row_ptr, offsets_ptr, num_tiles_ptr = sched
    a_bufs, w_bufs, c_smem = smem
    ready, empty, c_ready, c_empty = bars
    K_DIM, N_COLS, N_EXT, N_START, stride_c_m = dims
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    _, _, my_tiles = _tiles(num_tiles_ptr, N_COLS, BLOCK_N)
    it = 0  # k-steps consumed so far: stage it % NUM_STAGES, phase (it // NUM_STAGES) & 1
    for i_tile in range(my_tiles):
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        prev = 0
        for k in range(0, K_DIM, BLOCK_K):
            s = it % NUM_STAGES
            mbarrier.wait(ready.index(s), (it // NUM_STAGES) & 1)
            if W_NK:
                w = w_bufs.index(s).permute((1, 0))  # [BLOCK_N, BLOCK_K] rows n -> K-major [BLOCK_K, BLOCK_N]
            else:
                w = w_bufs.index(s)
            acc = warpgroup_mma(a_bufs.index(s), w, acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))
            mbarrier.arrive(empty.index(prev), count=1, pred=k > 0)  # the previous stage's wgmma retired
            prev = s
            it += 1
        hand_off(acc, prev, i_tile, empty, c_smem, c_ready, c_empty, False)


@gluon.jit
def _epilogue(c_ptr,  # [N, >= N_COLS] 16-bit output slot rows (y for F2, dx_slots for B3), unit column stride
              sched,  # tuple of the tile schedule:
                      #   tile_expert_ptr: [max_tiles] int32 expert of each M-tile
                      #   tile_row_ptr: [max_tiles] int32 first slot of each M-tile
                      #   offsets_ptr: [E+1] int32 expert_token_offsets
                      #   num_tiles_ptr: [1] int32 valid M-tiles
              smem, bars, dims, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """``c_smem`` -> ``C``: rows past the expert's last slot and columns past ``N_COLS`` masked."""
    tile_expert_ptr, tile_row_ptr, offsets_ptr, num_tiles_ptr = sched
    a_bufs, w_bufs, c_smem = smem
    ready, empty, c_ready, c_empty = bars
    K_DIM, N_COLS, N_EXT, N_START, stride_c_m = dims
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [EPILOGUE_WARPS, 1], [1, 0])
    ROWS: gl.constexpr = 32  # 32 x 64 pieces over 64 threads: 32 elements per thread
    COLS: gl.constexpr = 64
    num_tiles, num_n, my_tiles = _tiles(num_tiles_ptr, N_COLS, BLOCK_N)
    r_in = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    c_in = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    for i_tile in range(my_tiles):
        pid_n, e, row0, row_end = _tile(i_tile, num_tiles, num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                                        GROUP_M)
        mbarrier.wait(c_ready.index(0), i_tile & 1)
        for i in gl.static_range(BLOCK_M // ROWS):
            rows = row0 + i * ROWS + r_in
            piece = c_smem.slice(i * ROWS, ROWS, dim=0)
            for j in gl.static_range(BLOCK_N // COLS):
                col = pid_n * BLOCK_N + j * COLS + c_in
                v = piece.slice(j * COLS, COLS, dim=1).load(layout)
                mask = (rows < row_end)[:, None] & (col < N_COLS)[None, :]
                gl.store(c_ptr + rows.to(gl.int64)[:, None] * stride_c_m + col[None, :], v, mask=mask)
        mbarrier.arrive(c_empty.index(0), count=1)


@gluon.jit
def ws_gemm_kernel(
    a_desc,  # TMA descriptor over the [N, K_DIM] slot rows (act for F2, dpre for B3), box [BLOCK_M, BLOCK_K]
    w_desc,  # TMA descriptor over the weight rows: W_NK [E*N_EXT, K_DIM] box [BLOCK_N, BLOCK_K]; else [E*K_DIM, n] box [BLOCK_K, BLOCK_N]
    c_ptr,  # [N, >= N_COLS] 16-bit output slot rows (y for F2, dx_slots for B3), unit column stride
    offsets_ptr,  # [E+1] int32 expert_token_offsets
    tile_expert_ptr,  # [max_tiles] int32 expert of each M-tile
    tile_row_ptr,  # [max_tiles] int32 first slot of each M-tile
    num_tiles_ptr,  # [1] int32 valid M-tiles
    K_DIM, N_COLS, N_EXT, N_START,  # reduction length; output columns; weight rows per expert (W_NK); first column
    stride_c_m,
    W_NK: gl.constexpr,  # the weight's rows are n (F2's w_down); else k (B3's w_gate_up)
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr,
    GROUP_M: gl.constexpr, num_warps: gl.constexpr,
):
    dtype: gl.constexpr = a_desc.dtype
    w_shape: gl.constexpr = [BLOCK_N, BLOCK_K] if W_NK else [BLOCK_K, BLOCK_N]
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + w_shape, w_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype))
    ready, empty = stage_barriers(NUM_STAGES, 1, 1)  # ready: the loader's expect, one arrival with both boxes' bytes
    c_ready, c_empty = tile_barriers(1)

    descs = (a_desc, w_desc)
    sched = (tile_expert_ptr, tile_row_ptr, offsets_ptr, num_tiles_ptr)
    smem = (a_bufs, w_bufs, c_smem)
    bars = (ready, empty, c_ready, c_empty)
    dims = (K_DIM, N_COLS, N_EXT, N_START, stride_c_m)
    gl.warp_specialize([
        (_mma, (sched, smem, bars, dims, W_NK, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, num_warps)),
        (_loader, (descs, sched, smem, bars, dims, W_NK, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, GROUP_M)),
        (_epilogue, (c_ptr, sched, smem, bars, dims, BLOCK_M, BLOCK_N, GROUP_M)),
    ], [LOADER_WARPS, EPILOGUE_WARPS], [WORKER_REGS, WORKER_REGS])
