"""B1 on Hopper (sm90) in one warp-specialized Gluon kernel: the ``dact'`` GEMM with the activation
backward in an epilogue that runs while the next tile's MMAs do (DESIGN.md §5 B1, MoEBlaze §4.3).

Why: elsewhere B1 takes two launches (:mod:`moeblaze.kernels.act_bwd`): a plain GEMM storing
``dact' = dout[token(s)] W_down[e]`` and a row-streaming pass reading ``dact'`` and ``pre`` back, 3.30 +
7.06 ms of conf4's step (H200, run I of docs/benchmarks.md), because in a one-CTA-per-SM Triton GEMM an
epilogue that loads ``pre`` and does the activation math overlaps with nothing (fused there: 11.6 ms).
Here one persistent CTA per SM runs three partitions over the same sequence of output tiles, handing
data over through shared memory and mbarriers:

  mma      (8 warps, default)  two warpgroups run ``wgmma`` on a 128 x 256 fp32 accumulator (one wgmma in
                               flight) and write it once, rounded to the operand dtype, to ``c_smem``;
  loader   (2 warps)           gathers the A rows ``dout[token(s)]`` with 16-byte cp.async (Hopper's TMA
                               has no row gather) and the ``W_down`` tile with TMA, ``NUM_STAGES`` deep;
  epilogue (2 warps)           per 16 x 64 piece of ``c_smem`` (``dact'``), with ``pre`` brought by
                               TMA into a 4-piece ring four pieces ahead:
                                   act = f(gate) * up                      (recomputed, never stored)
                                   part[s, n-tile] = <dact'[s], act[s]>    (this tile's columns)
                                   wact[s] = w_s * act[s]                  (B operand of B2)
                                   dpre[s] = act_backward(w_s * dact'[s], pre[s])   (over pre, in place)

Bytes per element of ``[N, h]``: 10 (read gate, up; write dgate, dup, wact) instead of the two-launch
form's 14 (+ write and read ``dact'``), and the pass overlaps the MMAs. The router-weight gradient is a
row sum over all h columns, which several n-tiles share: each writes its partial ``part [N, cdiv(h, 256)]``
(fp32) and the caller sums the rows — fixed order, nothing atomic, bitwise reproducible. ``dpre`` and
``wact`` are bitwise equal to the two-launch form's (same rounded ``dact'``, same math); ``dtopk_weights``
differs by the order of its fp32 sum.

Hand-overs: ``ready[s]`` completes when stage s's weight bytes (TMA transaction count, one arrival) and
every loader thread's cp.async (one arrival each) have landed; ``empty[s]`` when the wgmma that read
stage s has retired; ``c_ready`` / ``c_empty`` pass ``c_smem`` between mma and epilogue. In triton 3.6 a
partition's ``mbarrier.arrive`` is one thread's arrival after a barrier of the partition's warps (checked
in the PTX), hence the counts of 1. In-place ``dpre``: tile (m, n) reads and writes only the gate and up
columns of its own n-range and the rows of its own expert, each element by one thread, read before written.

Conditions (:func:`moeblaze.kernels.launch.ws_b1_ok`): triton 3.6 (Gluon's API changed after it), an sm90
GPU, 16-bit dtypes, ``d % 64 == 0``, a contiguous ``W_down`` and 16-byte aligned rows.
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

from .act_math import act_backward, act_forward

LOADER_WARPS: gl.constexpr = gl.constexpr(2)
EPILOGUE_WARPS: gl.constexpr = gl.constexpr(2)
# 12 warps: 168 registers each at launch (65536 / 384); the two 2-warp workers (one warpgroup) give theirs
# down to 128, the mma warpgroups get 184 (a 128 x 256 fp32 accumulator is 128 per thread).
MAX_REGS = 168
WORKER_REGS: gl.constexpr = gl.constexpr(128)
# Epilogue pieces: 16 x 64 (two 16-byte vectors per thread and operand over 64 threads); pre's ring of
# 4 pieces x (gate, up) is 16 KB of shared memory, on top of the 208 KB of stages and dact' tile.
PRE_BOX = (16, 64)  # the launcher's TMA box over pre
ROWS: gl.constexpr = gl.constexpr(PRE_BOX[0])
COLS: gl.constexpr = gl.constexpr(PRE_BOX[1])


@gluon.jit
def _my_tiles(total):
    """Output tiles of this program in the persistent round robin: ``pid, pid + programs, ... < total``."""
    return gl.cdiv(total - gl.program_id(0), gl.num_programs(0))


@gluon.jit
def _tile(t, num_tiles, num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr, GROUP_M: gl.constexpr):
    """Output tile ``t`` -> (n-tile, expert, first slot, end slot of the expert); grouped order for L2."""
    num_in_group = GROUP_M * num_n
    first_m = (t // num_in_group) * GROUP_M
    group_size = gl.minimum(num_tiles - first_m, GROUP_M)
    pid_m = first_m + (t % num_in_group) % group_size
    pid_n = (t % num_in_group) // group_size
    e = gl.load(tile_expert_ptr + pid_m)
    row0 = gl.load(tile_row_ptr + pid_m)
    row_end = gl.load(offsets_ptr + e + 1)
    return pid_n, e, row0, row_end


@gluon.jit
def _loader(ptrs, sched, smem, bars, dims, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
            NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """Fill stage ``s``: A rows ``dout[token(s)]`` by cp.async, the weight tile by TMA; both complete on ready[s]."""
    a_ptr, w_desc = ptrs[0], ptrs[1]
    tile_expert_ptr, tile_row_ptr, offsets_ptr, indices_ptr, num_tiles_ptr = sched
    a_bufs, b_bufs = smem[0], smem[1]
    ready, empty = bars[0], bars[1]
    K_DIM, H, stride_a_m = dims[0], dims[1], dims[2]
    # 8 contiguous 16-bit elements (one 16-byte cp.async) per thread and row, BLOCK_K // 8 threads per row
    TPW_K: gl.constexpr = BLOCK_K // 8
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_K, TPW_K], [LOADER_WARPS, 1], [1, 0])
    num_tiles = gl.load(num_tiles_ptr)
    num_n = gl.cdiv(H, BLOCK_N)
    cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    it = 0  # k-steps issued so far: stage it % NUM_STAGES, phase (it // NUM_STAGES) & 1
    for i_tile in range(_my_tiles(num_tiles * num_n)):
        t = gl.program_id(0) + i_tile * gl.num_programs(0)
        pid_n, e, row0, row_end = _tile(t, num_tiles, num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr, GROUP_M)
        slots = gl.minimum(row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout)), row_end - 1)
        a_rows = a_ptr + gl.load(indices_ptr + slots).to(gl.int64)[:, None] * stride_a_m + cols[None, :]
        for k in range(0, K_DIM, BLOCK_K):
            s = it % NUM_STAGES
            mbarrier.wait(empty.index(s), ((it // NUM_STAGES) & 1) ^ 1)  # passes at once on the first round
            bar = ready.index(s)
            mbarrier.expect(bar, w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [e * K_DIM + k, pid_n * BLOCK_N], bar, b_bufs.index(s))
            async_copy.async_copy_global_to_shared(a_bufs.index(s), a_rows + k)
            async_copy.mbarrier_arrive(bar, increment_count=False)
            it += 1


@gluon.jit
def _mma(sched, smem, bars, dims, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
         NUM_STAGES: gl.constexpr, num_warps: gl.constexpr):
    """``acc = sum_k A_s @ B_s`` over the stages (one wgmma in flight), then the tile into ``c_smem``."""
    num_tiles_ptr = sched[4]
    a_bufs, b_bufs, c_smem = smem[0], smem[1], smem[2]
    ready, empty, c_ready, c_empty = bars[0], bars[1], bars[2], bars[3]
    K_DIM, H = dims[0], dims[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    num_tiles = gl.load(num_tiles_ptr)
    num_n = gl.cdiv(H, BLOCK_N)
    it = 0  # k-steps consumed so far: stage it % NUM_STAGES, phase (it // NUM_STAGES) & 1
    for i_tile in range(_my_tiles(num_tiles * num_n)):
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        prev = 0
        for k in range(0, K_DIM, BLOCK_K):
            s = it % NUM_STAGES
            mbarrier.wait(ready.index(s), (it // NUM_STAGES) & 1)
            fence_async_shared()  # A came by cp.async (generic proxy); wgmma reads through the async proxy
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))
            mbarrier.arrive(empty.index(prev), count=1, pred=k > 0)  # the previous stage's wgmma retired
            prev = s
            it += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(prev), count=1)
        mbarrier.wait(c_empty.index(0), (i_tile & 1) ^ 1)
        c_smem.store(acc.to(c_smem.dtype))
        mbarrier.arrive(c_ready.index(0), count=1)


@gluon.jit
def _fetch_pre(pre_desc, pre_bufs, bar, slot: gl.constexpr, row, col, H, GATED: gl.constexpr, pred=True):
    """TMA of one piece of ``pre`` (gate at ``col``, up at ``H + col``) into ring slot ``slot``, completing
    on ``bar`` (nothing if not ``pred``). Rows past N and columns past the tensor read as 0; rows of the next
    expert and the gate box's columns past h are read but never stored (masks of the epilogue)."""
    mbarrier.expect(bar, (2 if GATED else 1) * pre_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(pre_desc, [row, col], bar, pre_bufs.index(2 * slot), pred=pred)
    if GATED:
        tma.async_copy_global_to_shared(pre_desc, [row, H + col], bar, pre_bufs.index(2 * slot + 1), pred=pred)


@gluon.jit
def _epilogue(ptrs, sched, smem, bars, dims, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              GROUP_M: gl.constexpr, ACTIVATION: gl.constexpr, STORE_PART: gl.constexpr, STORE_WACT: gl.constexpr):
    """Activation backward of each ``dact'`` tile in ``c_smem`` (module docstring), rows past the expert and
    columns past h masked.

    A tile is BANDS row bands of ROWS rows, each in PIECES_N column pieces of COLS; band b's piece j comes
    by TMA into ring slot j while band b - 1's later pieces are processed (a band, 4 KB per piece, in flight
    per SM). The band loop stays a loop: unrolled over a whole tile (32 pieces, ~16k instructions,
    256 KB of code) the epilogue ran at 0.30x of the two-launch B1 on an H200 (run L, 2026-11-24) whatever
    its loads did — instruction fetch, not memory, was its limit."""
    pre_ptr, wact_ptr, scale_ptr, part_ptr, pre_desc = ptrs[2], ptrs[3], ptrs[4], ptrs[5], ptrs[6]
    tile_expert_ptr, tile_row_ptr, offsets_ptr, indices_ptr, num_tiles_ptr = sched
    c_smem, pre_bufs = smem[2], smem[3]
    c_ready, c_empty, pre_ready = bars[2], bars[3], bars[4]
    H, stride_pre_m, stride_wact_m, stride_part_m = dims[1], dims[3], dims[4], dims[5]
    GATED: gl.constexpr = ACTIVATION < 2
    BANDS: gl.constexpr = BLOCK_M // ROWS
    PIECES_N: gl.constexpr = BLOCK_N // COLS  # = the ring's slots: piece j of every band in slot j
    gl.static_assert(BANDS % 2 == 0)  # each slot used an even number of times per tile: phases restart
    dtype: gl.constexpr = c_smem.dtype
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [EPILOGUE_WARPS, 1], [1, 0])
    r_in = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    c_in = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    # the same bytes seen as row bands: the swizzle repeats every 8 rows, a band is 16
    c_bands = c_smem._reinterpret(dtype, [BANDS, ROWS, BLOCK_N], c_smem.layout)
    num_tiles = gl.load(num_tiles_ptr)
    num_n = gl.cdiv(H, BLOCK_N)
    for i_tile in range(_my_tiles(num_tiles * num_n)):
        t = gl.program_id(0) + i_tile * gl.num_programs(0)
        pid_n, e, row0, row_end = _tile(t, num_tiles, num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr, GROUP_M)
        n0 = pid_n * BLOCK_N
        for j in gl.static_range(PIECES_N):
            _fetch_pre(pre_desc, pre_bufs, pre_ready.index(j), j, row0, n0 + j * COLS, H, GATED)
        # slot weights one band ahead: a load used at once would stall every band for a memory round trip
        w_next = gl.load(scale_ptr + row0 + r_in, mask=row0 + r_in < row_end, other=0.0)
        mbarrier.wait(c_ready.index(0), i_tile & 1)
        for band in range(BANDS):
            rows = row0 + band * ROWS + r_in
            row_ok = rows < row_end
            rows64 = rows.to(gl.int64)[:, None]
            w = w_next[:, None]
            w_next = gl.load(scale_ptr + rows + ROWS, mask=rows + ROWS < row_end, other=0.0)
            c_band = c_bands.index(band)
            part = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, layout))
            for j in gl.static_range(PIECES_N):
                mbarrier.wait(pre_ready.index(j), band & 1)
                gate = pre_bufs.index(2 * j).load(layout).to(gl.float32)
                up = gate
                if GATED:
                    up = pre_bufs.index(2 * j + 1).load(layout).to(gl.float32)
                gl.thread_barrier()  # every thread has read slot j before the next band's TMA overwrites it
                _fetch_pre(pre_desc, pre_bufs, pre_ready.index(j), j, row0 + (band + 1) * ROWS, n0 + j * COLS, H,
                           GATED, pred=band + 1 < BANDS)
                cols = n0 + j * COLS + c_in
                mask = row_ok[:, None] & (cols < H)[None, :]
                dact = c_band.slice(j * COLS, COLS, dim=1).load(layout).to(gl.float32)
                act = act_forward(gate, up, ACTIVATION)
                if STORE_PART:
                    part += gl.sum(dact * act, axis=1)
                if STORE_WACT:  # rounded like the torch backend: (w * act.to(dtype)).to(dtype)
                    wact = act.to(dtype).to(gl.float32) * w
                    gl.store(wact_ptr + rows64 * stride_wact_m + cols[None, :], wact.to(dtype), mask=mask)
                dgate, dup = act_backward(dact * w, gate, up, ACTIVATION)
                dpre_ptrs = pre_ptr + rows64 * stride_pre_m + cols[None, :]
                gl.store(dpre_ptrs, dgate.to(dtype), mask=mask)
                if GATED:
                    gl.store(dpre_ptrs + H, dup.to(dtype), mask=mask)
            if STORE_PART:  # the band's sum over this tile's columns
                gl.store(part_ptr + rows.to(gl.int64) * stride_part_m + pid_n, part, mask=row_ok)
        mbarrier.arrive(c_empty.index(0), count=1)


@gluon.jit
def ws_b1_kernel(
    a_ptr,  # [T, d] 16-bit dout, unit column stride; rows gathered through indices_ptr
    w_desc,  # TMA descriptor over w_down [E, d, h] seen as [E*d, h], box [BLOCK_K, BLOCK_N]
    pre_ptr,  # [N, 2h|h] in: pre (gate at n, up at h + n); out: dpre, in place
    pre_desc,  # TMA descriptor over the same pre, box [ROWS, COLS]
    wact_ptr,  # [N, h] out: w * act (STORE_WACT)
    scale_ptr,  # [N] fp32 router weight of each slot
    part_ptr,  # [N, cdiv(h, BLOCK_N)] fp32 out: <dact', act> over each n-tile's columns (STORE_PART)
    offsets_ptr,  # [E+1] int32 expert_token_offsets
    indices_ptr,  # [N] int32 expert_token_indices (slot -> token)
    tile_expert_ptr,  # [max_tiles] int32 expert of each M-tile
    tile_row_ptr,  # [max_tiles] int32 first slot of each M-tile
    num_tiles_ptr,  # [1] int32 valid M-tiles
    K_DIM, H,  # reduction length (d); dact' columns (h)
    stride_a_m, stride_pre_m, stride_wact_m, stride_part_m,
    ACTIVATION: gl.constexpr, STORE_PART: gl.constexpr, STORE_WACT: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr,
    GROUP_M: gl.constexpr, num_warps: gl.constexpr,
):
    dtype: gl.constexpr = w_desc.dtype
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], dtype)
    # dact' tile as BLOCK_M // ROWS row bands (the epilogue's loop indexes them), 16-byte vectors swizzled
    # over 8 rows so that neither the wgmma-layout store nor the epilogue's row loads conflict on banks
    c_layout: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, BLOCK_N], b_layout)
    c_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], c_layout)
    PRE_SLOTS: gl.constexpr = BLOCK_N // COLS  # one band of pre: (gate, up) per slot
    pre_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, COLS], dtype)
    pre_bufs = gl.allocate_shared_memory(dtype, [2 * PRE_SLOTS, ROWS, COLS], pre_layout)
    pre_ready = gl.allocate_shared_memory(gl.int64, [PRE_SLOTS, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    c_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    c_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1 + LOADER_WARPS * 32)  # TMA expect + each loader thread's cp.async
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(PRE_SLOTS):
        mbarrier.init(pre_ready.index(i), count=1)  # the epilogue's TMA expect
    mbarrier.init(c_ready.index(0), count=1)
    mbarrier.init(c_empty.index(0), count=1)

    ptrs = (a_ptr, w_desc, pre_ptr, wact_ptr, scale_ptr, part_ptr, pre_desc)
    sched = (tile_expert_ptr, tile_row_ptr, offsets_ptr, indices_ptr, num_tiles_ptr)
    smem = (a_bufs, b_bufs, c_smem, pre_bufs)
    bars = (ready, empty, c_ready, c_empty, pre_ready)
    dims = (K_DIM, H, stride_a_m, stride_pre_m, stride_wact_m, stride_part_m)
    # constexprs go into the partitions' argument lists directly (a tuple variable would hold them as values)
    gl.warp_specialize([
        (_mma, (sched, smem, bars, dims, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, num_warps)),
        (_loader, (ptrs, sched, smem, bars, dims, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, GROUP_M)),
        (_epilogue, (ptrs, sched, smem, bars, dims, BLOCK_M, BLOCK_N, GROUP_M, ACTIVATION, STORE_PART,
                     STORE_WACT)),
    ], [LOADER_WARPS, EPILOGUE_WARPS], [WORKER_REGS, WORKER_REGS])
