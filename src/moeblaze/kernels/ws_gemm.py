"""Warp-specialized gather-fused grouped GEMM for Hopper (sm90), in Gluon: F1 and B1 (DESIGN.md §5).

Why: F1 (``pre = x[token(s)] W_gate_up[e]^T``, ``act = f(gate) * up``) and B1 (``dact' = dout[token(s)]
W_down[e]``) reduce over K_DIM = d only (2048 for conf4, qwen3-30b, olmoe): 32 k-steps per 128 x 256
tile. In the Triton kernel (:mod:`moeblaze.kernels.grouped_gemm`, one CTA per SM) the tensor cores idle
through each tile's epilogue, which is long next to so short a main loop (F1 of conf4 ran at 563 TF/s,
B3 with the same tile shape and K_DIM 16384 at 799 TF/s; H200, run I of docs/benchmarks.md). Here one
persistent CTA per SM runs three partitions over the same sequence of output tiles, handing data over
through shared memory and mbarriers, so that tile i's epilogue runs while tile i+1's MMAs do:

  mma      (8 warps, default)  two warpgroups run ``wgmma`` on a 128 x BLOCK_N fp32 accumulator (one
                               wgmma in flight), then write it once, rounded to the output dtype, into a
                               shared tile ``c_smem`` (stmatrix: ~0.3 us of a ~23 us tile at d 2048);
  loader   (2 warps)           gathers the A rows ``a[token(s)]`` with 16-byte cp.async (Hopper's TMA has
                               no row gather) and brings the weight tile with TMA, ``NUM_STAGES`` deep;
  epilogue (2 warps)           reads ``c_smem`` in 32 x 64 pieces and stores ``pre`` and
                               ``act = f(gate) * up`` (``GATED``: F1, act formed from the rounded ``pre``,
                               as the backward recomputes it) or ``C`` (B1), rows past the expert masked.

Hand-overs: ``ready[s]`` completes when stage s's weight bytes (TMA transaction count, one arrival) and
every loader thread's cp.async (one arrival each) have landed; ``empty[s]`` when the wgmma that read
stage s has retired; ``c_ready`` / ``c_empty`` pass ``c_smem`` between mma and epilogue. In triton 3.6 a
partition's ``mbarrier.arrive`` is one thread's arrival after a barrier of the partition's warps (checked
in the PTX), hence the counts of 1. Sums are fp32 in a fixed order and nothing is atomic: results are
bitwise reproducible (not bitwise equal to the Triton kernel's: other instruction tiling).

Weights go through a TMA descriptor over their rows: ``GATED`` reads ``w_gate_up [E, 2h, d]`` as
``[E*2h, d]``, the gate rows ``n0..n0+BLOCK_N/2`` and the up rows ``h+n0..`` of a tile side by side, so
the accumulator holds gate in columns ``[0, BLOCK_N/2)`` and up in ``[BLOCK_N/2, BLOCK_N)``; otherwise
``w_down [E, d, h]`` is read as ``[E*d, h]`` (rows along k). Conditions (:func:`moeblaze.kernels.launch.ws_ok`):
triton 3.6 (Gluon's API changed after it), an sm90 GPU, 16-bit dtypes, ``K_DIM % 64 == 0``, 16-byte
aligned rows.
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

_INV_SQRT2: gl.constexpr = gl.constexpr(0.7071067811865476)
LOADER_WARPS: gl.constexpr = gl.constexpr(2)
EPILOGUE_WARPS: gl.constexpr = gl.constexpr(2)
# 12 warps: 168 registers each at launch (65536 / 384); the two 2-warp workers (one warpgroup) give theirs
# down to 128, the mma warpgroups get 184 (a 128 x 256 fp32 accumulator is 128 per thread).
MAX_REGS = 168
WORKER_REGS: gl.constexpr = gl.constexpr(128)


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
            NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr, GATED: gl.constexpr, ACTIVATION: gl.constexpr,
            STORE_PRE: gl.constexpr, STORE_ACT: gl.constexpr):
    """Fill stage ``s``: A rows ``a[token(s)]`` by cp.async, the weight tile by TMA; both complete on ready[s]."""
    a_ptr, w_desc, c_ptr, aux_ptr = ptrs
    tile_expert_ptr, tile_row_ptr, offsets_ptr, indices_ptr, num_tiles_ptr = sched
    a_bufs, b_bufs, c_smem = smem
    ready, empty, c_ready, c_empty = bars
    K_DIM, N_COLS, stride_a_m, stride_c_m, stride_aux_m = dims
    # 2 warps, 8 contiguous 16-bit elements (one 16-byte cp.async) per thread and row, 8 rows per pass
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [2, 1], [1, 0])
    TILE_N: gl.constexpr = BLOCK_N // 2 if GATED else BLOCK_N  # output columns of one tile
    num_tiles = gl.load(num_tiles_ptr)
    num_n = gl.cdiv(N_COLS, TILE_N)
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
            if GATED:  # gate rows n0.. and up rows h + n0.. of expert e, one box each
                mbarrier.expect(bar, 2 * w_desc.block_type.nbytes)
                n_row = 2 * e * N_COLS + pid_n * TILE_N
                tma.async_copy_global_to_shared(w_desc, [n_row, k], bar, b_bufs.index(s).slice(0, TILE_N))
                tma.async_copy_global_to_shared(w_desc, [n_row + N_COLS, k], bar, b_bufs.index(s).slice(TILE_N, TILE_N))
            else:
                mbarrier.expect(bar, w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(w_desc, [e * K_DIM + k, pid_n * TILE_N], bar, b_bufs.index(s))
            async_copy.async_copy_global_to_shared(a_bufs.index(s), a_rows + k)
            async_copy.mbarrier_arrive(bar, increment_count=False)
            it += 1


@gluon.jit
def _act(gate, up, ACTIVATION: gl.constexpr):
    """``f(gate) * up`` in fp32: SiLU (0, swiglu) or exact GELU (1, geglu), as :mod:`moeblaze.kernels.act_math`."""
    if ACTIVATION == 0:
        r = gate / (1.0 + gl.exp(-gate)) * up
    else:
        r = 0.5 * gate * (1.0 + gl.erf(gate * _INV_SQRT2)) * up
    return r


@gluon.jit
def _epilogue(ptrs, sched, smem, bars, dims, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
              NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr, GATED: gl.constexpr, ACTIVATION: gl.constexpr,
              STORE_PRE: gl.constexpr, STORE_ACT: gl.constexpr):
    """``c_smem`` -> global memory: ``pre`` / ``act`` (``GATED``) or ``C``; rows past the expert and columns
    past ``N_COLS`` masked."""
    a_ptr, w_desc, c_ptr, aux_ptr = ptrs
    tile_expert_ptr, tile_row_ptr, offsets_ptr, indices_ptr, num_tiles_ptr = sched
    a_bufs, b_bufs, c_smem = smem
    ready, empty, c_ready, c_empty = bars
    K_DIM, N_COLS, stride_a_m, stride_c_m, stride_aux_m = dims
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [2, 1], [1, 0])
    ROWS: gl.constexpr = 32  # 32 x 64 pieces over 64 threads: 32 elements per thread and operand
    COLS: gl.constexpr = 64
    TILE_N: gl.constexpr = BLOCK_N // 2 if GATED else BLOCK_N
    num_tiles = gl.load(num_tiles_ptr)
    num_n = gl.cdiv(N_COLS, TILE_N)
    r_in = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    c_in = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    for i_tile in range(_my_tiles(num_tiles * num_n)):
        t = gl.program_id(0) + i_tile * gl.num_programs(0)
        pid_n, e, row0, row_end = _tile(t, num_tiles, num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr, GROUP_M)
        mbarrier.wait(c_ready.index(0), i_tile & 1)
        for i in gl.static_range(BLOCK_M // ROWS):
            rows = row0 + i * ROWS + r_in
            rows64 = rows.to(gl.int64)[:, None]
            piece = c_smem.slice(i * ROWS, ROWS, dim=0)
            for j in gl.static_range(TILE_N // COLS):
                col = pid_n * TILE_N + j * COLS + c_in[None, :]
                mask = (rows < row_end)[:, None] & (col < N_COLS)
                v = piece.slice(j * COLS, COLS, dim=1).load(layout)
                c_ptrs = c_ptr + rows64 * stride_c_m + col
                if GATED:
                    up = piece.slice(TILE_N + j * COLS, COLS, dim=1).load(layout)
                    if STORE_PRE:
                        gl.store(c_ptrs, v, mask=mask)
                        gl.store(c_ptrs + N_COLS, up, mask=mask)
                    if STORE_ACT:
                        act = _act(v.to(gl.float32), up.to(gl.float32), ACTIVATION)
                        gl.store(aux_ptr + rows64 * stride_aux_m + col, act.to(v.dtype), mask=mask)
                else:
                    gl.store(c_ptrs, v, mask=mask)
        mbarrier.arrive(c_empty.index(0), count=1)


@gluon.jit
def _mma(sched, smem, bars, dims, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
         NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr, GATED: gl.constexpr, num_warps: gl.constexpr):
    """``acc = sum_k A_s @ B_s`` over the stages (one wgmma in flight), then the tile into ``c_smem``."""
    tile_expert_ptr, tile_row_ptr, offsets_ptr, indices_ptr, num_tiles_ptr = sched
    a_bufs, b_bufs, c_smem = smem
    ready, empty, c_ready, c_empty = bars
    K_DIM, N_COLS, stride_a_m, stride_c_m, stride_aux_m = dims
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    num_tiles = gl.load(num_tiles_ptr)
    num_n = gl.cdiv(N_COLS, BLOCK_N // 2 if GATED else BLOCK_N)
    it = 0  # k-steps consumed so far: stage it % NUM_STAGES, phase (it // NUM_STAGES) & 1
    for i_tile in range(_my_tiles(num_tiles * num_n)):
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        prev = 0
        for k in range(0, K_DIM, BLOCK_K):
            s = it % NUM_STAGES
            mbarrier.wait(ready.index(s), (it // NUM_STAGES) & 1)
            fence_async_shared()  # A came by cp.async (generic proxy); wgmma reads through the async proxy
            if GATED:
                b = b_bufs.index(s).permute((1, 0))  # [BLOCK_N, BLOCK_K] rows n -> K-major view
            else:
                b = b_bufs.index(s)
            acc = warpgroup_mma(a_bufs.index(s), b, acc, is_async=True)
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
def ws_gemm_kernel(
    a_ptr,  # [T, K_DIM] 16-bit, unit column stride: x (F1) or dout (B1); rows gathered through indices_ptr
    w_desc,  # TMA descriptor: w_gate_up as [E*2h, d] box [BLOCK_N/2, BLOCK_K] (GATED); w_down as [E*d, h] box [BLOCK_K, BLOCK_N]
    c_ptr,  # GATED: pre [N, 2h]; else C [N, N_COLS] (dact')
    aux_ptr,  # GATED: act [N, h]; else unused
    offsets_ptr,  # [E+1] int32 expert_token_offsets
    indices_ptr,  # [N] int32 expert_token_indices (slot -> token)
    tile_expert_ptr,  # [max_tiles] int32 expert of each M-tile
    tile_row_ptr,  # [max_tiles] int32 first slot of each M-tile
    num_tiles_ptr,  # [1] int32 valid M-tiles
    K_DIM, N_COLS,  # reduction length (d); output columns (h)
    stride_a_m, stride_c_m, stride_aux_m,
    GATED: gl.constexpr, ACTIVATION: gl.constexpr, STORE_PRE: gl.constexpr, STORE_ACT: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr,
    GROUP_M: gl.constexpr, num_warps: gl.constexpr,
):
    dtype: gl.constexpr = w_desc.dtype
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
    b_shape: gl.constexpr = [BLOCK_N, BLOCK_K] if GATED else [BLOCK_K, BLOCK_N]
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(b_shape, dtype)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_layout)
    b_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + b_shape, b_layout)
    c_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], c_layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    c_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    c_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1 + LOADER_WARPS * 32)  # TMA expect + each loader thread's cp.async
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(c_ready.index(0), count=1)
    mbarrier.init(c_empty.index(0), count=1)

    ptrs = (a_ptr, w_desc, c_ptr, aux_ptr)
    sched = (tile_expert_ptr, tile_row_ptr, offsets_ptr, indices_ptr, num_tiles_ptr)
    smem = (a_bufs, b_bufs, c_smem)
    bars = (ready, empty, c_ready, c_empty)
    dims = (K_DIM, N_COLS, stride_a_m, stride_c_m, stride_aux_m)
    # constexprs go into the partitions' argument lists directly (a tuple variable would hold them as values)
    gl.warp_specialize([
        (_mma, (sched, smem, bars, dims, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, GROUP_M, GATED, num_warps)),
        (_loader, (ptrs, sched, smem, bars, dims, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, GROUP_M, GATED, ACTIVATION,
                   STORE_PRE, STORE_ACT)),
        (_epilogue, (ptrs, sched, smem, bars, dims, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, GROUP_M, GATED, ACTIVATION,
                     STORE_PRE, STORE_ACT)),
    ], [LOADER_WARPS, EPILOGUE_WARPS], [WORKER_REGS, WORKER_REGS])
