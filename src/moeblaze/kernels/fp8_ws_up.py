"""Warp-specialized FP8 F1 for Hopper (sm90), in Gluon: the gated up-projection of the FP8 layer with its epilogue.

For the slots ``s`` of an M-tile of expert ``e`` and 64 columns ``n`` of ``h``: ``gate = x_scale[t] w_scale[e, n]
sum_k x[t, k] W[e][n, k]`` and ``up`` likewise on W's row ``UP_OFF + n`` (``t`` the slot's token, ``x`` and
``w_gate_up`` in e4m3 under the rowwise recipe, :mod:`moeblaze.fp8`), rounded to 16 bits; then ``pre`` kept for
backward in e4m3 with one scale per row of each 1 x 64 tile of each half (:meth:`moeblaze.fp8.Float8Recipe.
quantize_kept`, the tile of the output tile, ``BLOCK_N = KEPT_TILE``) and ``act = f(gate) * up`` in 16 bits.

Why: as :mod:`moeblaze.kernels.fp8_ws_gemm` (F2, B1, B3), the e4m3 sums are promoted into fp32 every 128 products;
two mma warp groups of 64 rows each add their partial sums while the other's ``wgmma`` keeps the tensor cores busy,
where the Triton kernel's promotion waits for them at every k-step. The epilogue (a kept tile's row maxima, its
quotients, ``act``) runs in a partition of its own, on the previous tile while the mma warp groups sum the next: run
by the mma warp groups themselves, both stopped the tensor cores for it at every tile, and F1 took 1.20x / 1.16x the
time (Qwen3-30B-A3B 2.93-2.95 against 2.46-2.47 ms, OLMoE-1B-7B 3.55 against 3.04-3.05, T 32,768, H200, one run;
``python3 benchmarks/bench_fp8_kernels.py --recipes rowwise --tokens 32768``, docs/results-fp8-kernels.csv). The
partitions:

  mma      (4 warps, default; 4 warps, worker)  one ``wgmma`` of 64 rows x 128 columns (gate, then up: the
                               stage's weight rows) per stage into fresh partial sums, waited for, added to the fp32
                               accumulator; after the last stage the sums times the row and weight-row scales, rounded
                               to 16 bits into their half of one of two ``c_smem`` buffers (tiles alternate)
  loader   (4 warps)           the tile's token rows of ``x`` by 16-byte cp.async and the gate and up boxes of
                               ``w_gate_up`` by TMA, ``NUM_STAGES`` deep
                               (:func:`moeblaze.kernels.fp8_ws_gemm._gather_loader`)
  epilogue (4 warps)           a ``c_smem`` buffer, 32 rows at a time, to the kept ``pre`` and ``act`` above, rows
                               past the expert's last slot masked; 16 columns a thread (16-byte e4m3 stores: 0.98x
                               the time of 8)

The loader issues the gathered rows: with 2 warps (16 cp.async a thread per k-step) it held F1 back; with 4 F1 took
0.95x the time (3.40 against 3.59 ms, 4.12 against 4.32, in the same benchmark; one ``wgmma`` over gate and up
against two of 64 columns: 0.99x / 1.00x). Each warp group alone on whole tiles (ping-pong, the epilogue of one
beside the other's sums) took 1.05x / 1.04x the time (3.03 against 2.90 ms, 3.68 against 3.54): a lone warp group's
promotion stops its own ``wgmma`` chain.

The sums, scaling, rounding and quantization are the Triton kernel's (``grouped_gemm_kernel`` with ``FP8``,
``EPILOGUE_ACT_FWD``, ``PRE_FP8``), in its order and with its device functions (the recipe's scale and cast,
``act_forward``), so the two agree bitwise. Conditions (``launch._up_ws_launched``, :func:`ws_up_ok`): an sm90 GPU,
triton 3.6, a gated activation, ``w_gate_up`` gate rows then up rows (not interleaved), no bias, ``pre`` kept in
e4m3 and ``act`` stored, 16-byte aligned rows.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..fp8 import KEPT_TILE
from . import direct
from .act_math import act_forward
from .fp8_quant import inverse, row_amax, scale_of, to_e4m3
from .fp8_ws_gemm import MMA_WARPS, _gather_loader, half_tile
from .grouped_gemm import _QMAX, _TINY
from .tma import rows_aligned, tma_desc
from .tuning import cdiv, num_programs
from .ws_gemm import _tile, _tiles
from .ws_wgrad import stage_barriers

# 16 warps, four warp groups: 128 registers each at launch (65536 / 512). The loader gives its down to 40, the epilogue
# to 136, both mma warp groups get 168 (the default partition the rest, 512 - 168 - 40 - 136): a 64 x 128 fp32
# accumulator and its partial sums are 128 per thread. No stack frame but 8 bytes of the loader's; 160 for the mma
# warp groups and 152 for the epilogue: as fast (scripts/gluon_sm90_compile.py, bench_fp8_kernels.py).
MAX_REGS = 128
MMA_REGS: gl.constexpr = gl.constexpr(168)
# the loader a whole warp group: 8 cp.async a thread per k-step (module docstring)
UP_LOADER_WARPS: gl.constexpr = gl.constexpr(4)
# the loader needs few registers (cp.async addresses); the epilogue a 32 x 64 piece of gate and of up, 16 each a thread
UP_LOADER_REGS: gl.constexpr = gl.constexpr(40)
UP_EPILOGUE_WARPS: gl.constexpr = gl.constexpr(4)
UP_EPILOGUE_REGS: gl.constexpr = gl.constexpr(136)
# 64 columns of gate and of up, the kept pre's tile (moeblaze.fp8.KEPT_TILE), per output tile; 128-column steps, the
# promotion interval; 4 stages of 32 KiB (x rows, gate and up boxes) and two 32 KiB c_smem buffers.
CONFIG = {"BLOCK_M": 128, "BLOCK_N": KEPT_TILE, "BLOCK_K": 128, "NUM_STAGES": 4, "GROUP_M": 8}


@gluon.jit
def _store_kept(q_ptrs,  # [ROWS, KEPT_TILE] pointer block into the kept e4m3 pre [N, 2h] (one gate or up tile)
                s_ptrs,  # [ROWS] pointer block into pre's fp32 tile scales [N, 2, cdiv(h, KEPT_TILE)] (this tile's)
                v, mask, row_mask, POW2: gl.constexpr):
    """``v [rows, KEPT_TILE]`` (fp32, one kept tile) in e4m3 with one scale per row: the recipe's, as
    ``grouped_gemm._store_e4m3_tiles`` computes it (elements outside ``mask`` neither counted nor stored)."""
    v = gl.where(mask, v, 0.0)
    scale = scale_of(row_amax(v), _TINY, _QMAX, POW2)
    gl.store(s_ptrs, scale, mask=row_mask)
    gl.store(q_ptrs, to_e4m3(v, scale[:, None], inverse(scale)[:, None]), mask=mask)


@gluon.jit
def _mma_up(scales,  # tuple of the dequantization scales:
                     #   a_scale_ptr: [A_ROWS] fp32 scale of each A row (a token's, gathered; else a slot's)
                     #   w_scale_ptr: [E, N_EXT] fp32 scale of each weight row, row e at e * stride_ws_e
                     #   indices_ptr: [N] int32 expert_token_indices (slot -> token), for the gathered A rows' scales
                     #   A_ROWS, stride_ws_e: A's rows, the weight scales' expert stride
            sched,  # tuple of the tile schedule:
                    #   tile_expert_ptr: [max_tiles] int32 expert of each M-tile
                    #   tile_row_ptr: [max_tiles] int32 first slot of each M-tile
                    #   offsets_ptr: [E+1] int32 expert_token_offsets
                    #   num_tiles_ptr: [1] int32 valid M-tiles
            smem, bars, dims, HALF: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """Rows ``HALF * BLOCK_M / 2 ..`` of each tile: gate and up summed over the stages, scaled and rounded to 16 bits
    into their half of the tile's ``c_smem`` buffer."""
    a_scale_ptr, w_scale_ptr, indices_ptr, A_ROWS, stride_ws_e = scales
    tile_expert_ptr, tile_row_ptr, offsets_ptr, num_tiles_ptr = sched
    a_bufs, w_bufs, c_smem = smem
    ready, empty, c_ready, c_empty = bars
    K_DIM, N_COLS, UP_OFF = dims
    ROWS: gl.constexpr = BLOCK_M // 2
    zero2, r_in, c_in = half_tile(ROWS, 2 * BLOCK_N)  # gate | up, as the stage holds their weight rows
    num_tiles, num_n, my_tiles = _tiles(num_tiles_ptr, N_COLS, BLOCK_N)
    # column c of the sum is gate (c < BLOCK_N) or up (c >= BLOCK_N) of n = c % BLOCK_N: its weight row's offset
    col = c_in % BLOCK_N
    w_off = col + (c_in // BLOCK_N) * UP_OFF
    it = 0  # k-steps consumed so far: stage it % NUM_STAGES, phase (it // NUM_STAGES) & 1
    for i_tile in range(my_tiles):
        pid_n, e, row0, row_end = _tile(i_tile, num_tiles, num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                                        GROUP_M)
        acc = zero2
        for _k in range(0, K_DIM, BLOCK_K):
            s = it % NUM_STAGES
            mbarrier.wait(ready.index(s), (it // NUM_STAGES) & 1)
            fence_async_shared()  # the gathered rows came by cp.async (generic proxy); wgmma reads the async one
            a = a_bufs.index(s).slice(HALF * ROWS, ROWS, dim=0)
            # one wgmma over the stage's [2 * BLOCK_N, BLOCK_K] gate and up rows: the A rows are read from shared
            # memory once for both halves
            part = warpgroup_mma(a, w_bufs.index(s).permute((1, 0)), zero2, use_acc=False, is_async=True)
            part = warpgroup_mma_wait(0, deps=(part,))
            mbarrier.arrive(empty.index(s), count=1)  # this half is done with the stage
            acc = acc + part  # the promotion, while the other half's wgmma runs
            it += 1
        rows = row0 + HALF * ROWS + r_in
        tokens = gl.load(indices_ptr + rows, mask=rows < A_ROWS, other=0)
        a_scale = gl.load(a_scale_ptr + tokens, mask=rows < A_ROWS, other=0.0)
        n = pid_n * BLOCK_N + col
        w_scale = gl.load(w_scale_ptr + e.to(gl.int64) * stride_ws_e + pid_n * BLOCK_N + w_off, mask=n < N_COLS,
                          other=0.0)
        acc = acc * a_scale[:, None] * w_scale[None, :]
        buf = i_tile % 2
        mbarrier.wait(c_empty.index(buf), ((i_tile // 2) & 1) ^ 1)  # passes at once on each buffer's first use
        c_smem.index(buf).slice(HALF * ROWS, ROWS, dim=0).store(acc.to(c_smem.dtype))
        mbarrier.arrive(c_ready.index(buf), count=1)


@gluon.jit
def _epilogue_up(outs,  # tuple of the outputs:
                 #   pre_ptr: [N, 2 * N_COLS] e4m3 the kept pre, gate at n, up at UP_OFF + n
                 #   pre_s_ptr: [N, 2, cdiv(N_COLS, BLOCK_N)] fp32 the scales of pre's 1 x BLOCK_N tiles per half
                 #   act_ptr: [N, N_COLS] 16-bit act
                 #   stride_pre_m, stride_act_m, alpha, limit: the row strides, the activation's parameters
                 sched,  # tuple of the tile schedule:
                         #   tile_expert_ptr: [max_tiles] int32 expert of each M-tile
                         #   tile_row_ptr: [max_tiles] int32 first slot of each M-tile
                         #   offsets_ptr: [E+1] int32 expert_token_offsets
                         #   num_tiles_ptr: [1] int32 valid M-tiles
                 smem, bars, dims, ACTIVATION: gl.constexpr, POW2: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """A tile's 16-bit gate and up from ``c_smem`` to the kept ``pre`` (e4m3 tiles and their scales) and ``act``, in
    pieces of ``ROWS`` rows; rows past the expert's last slot masked."""
    pre_ptr, pre_s_ptr, act_ptr, stride_pre_m, stride_act_m, alpha, limit = outs
    tile_expert_ptr, tile_row_ptr, offsets_ptr, num_tiles_ptr = sched
    a_bufs, w_bufs, c_smem = smem
    ready, empty, c_ready, c_empty = bars
    K_DIM, N_COLS, UP_OFF = dims
    layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [UP_EPILOGUE_WARPS, 1], [1, 0])
    ROWS: gl.constexpr = 32
    num_tiles, num_n, my_tiles = _tiles(num_tiles_ptr, N_COLS, BLOCK_N)
    kept = gl.cdiv(N_COLS, BLOCK_N)  # kept tiles per half and row (BLOCK_N is the kept tile)
    r_in = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    c_in = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    for i_tile in range(my_tiles):
        pid_n, e, row0, row_end = _tile(i_tile, num_tiles, num_n, tile_expert_ptr, tile_row_ptr, offsets_ptr,
                                        GROUP_M)
        buf = i_tile % 2
        mbarrier.wait(c_ready.index(buf), (i_tile // 2) & 1)
        n = pid_n * BLOCK_N + c_in
        n_mask = n < N_COLS
        for i in gl.static_range(BLOCK_M // ROWS):
            piece = c_smem.index(buf).slice(i * ROWS, ROWS, dim=0)
            gate = piece.slice(0, BLOCK_N, dim=1).load(layout).to(gl.float32)
            up = piece.slice(BLOCK_N, BLOCK_N, dim=1).load(layout).to(gl.float32)
            rows = row0 + i * ROWS + r_in
            row_mask = rows < row_end
            mask = row_mask[:, None] & n_mask[None, :]
            pre_ptrs = pre_ptr + rows.to(gl.int64)[:, None] * stride_pre_m + n[None, :]
            s_ptrs = pre_s_ptr + rows.to(gl.int64) * (2 * kept) + pid_n
            _store_kept(pre_ptrs, s_ptrs, gate, mask, row_mask, POW2)
            _store_kept(pre_ptrs + UP_OFF, s_ptrs + kept, up, mask, row_mask, POW2)
            act = act_forward(gate, up, alpha, limit, ACTIVATION)
            gl.store(act_ptr + rows.to(gl.int64)[:, None] * stride_act_m + n[None, :],
                     act.to(act_ptr.dtype.element_ty), mask=mask)
        mbarrier.arrive(c_empty.index(buf), count=1)


@gluon.jit
def fp8_ws_up_kernel(
    a_ptr,  # [T, K_DIM] e4m3 token rows (x), row t at t * stride_a_t, unit column stride
    w_desc,  # TMA descriptor over the e4m3 w_gate_up rows [E * N_EXT, K_DIM] (gate rows, then up rows), box [BLOCK_N, BLOCK_K]
    pre_ptr,  # [N, 2 * N_COLS] e4m3 out: the kept pre, gate at n, up at UP_OFF + n
    pre_s_ptr,  # [N, 2, cdiv(N_COLS, BLOCK_N)] fp32 out: the scales of pre's 1 x BLOCK_N tiles per half
    act_ptr,  # [N, N_COLS] 16-bit out: act
    a_scale_ptr,  # [T] fp32 dequantization scale of each token row of x
    w_scale_ptr,  # [E, N_EXT] fp32 dequantization scale of each weight row, row e at e * stride_ws_e
    offsets_ptr,  # [E+1] int32 expert_token_offsets
    indices_ptr,  # [N] int32 expert_token_indices (slot -> token)
    tile_expert_ptr,  # [max_tiles] int32 expert of each M-tile
    tile_row_ptr,  # [max_tiles] int32 first slot of each M-tile
    num_tiles_ptr,  # [1] int32 valid M-tiles
    A_ROWS, K_DIM, N_COLS, N_EXT, UP_OFF,  # slots N; d; h; weight rows per expert (2h); up's offset (h)
    stride_a_t, stride_pre_m, stride_act_m, stride_ws_e,
    alpha, limit,  # the clamped SwiGLU's parameters
    ACTIVATION: gl.constexpr,  # a gated activation code of kernels/act_math.py
    POW2: gl.constexpr,  # the kept tiles' scales are powers of two
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
):
    dtype: gl.constexpr = w_desc.dtype
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_layout)
    w_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, 2 * BLOCK_N, BLOCK_K], w_desc.layout)
    c_dtype: gl.constexpr = act_ptr.dtype.element_ty
    c_smem = gl.allocate_shared_memory(c_dtype, [2, BLOCK_M, 2 * BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, 2 * BLOCK_N], c_dtype))
    # ready: the loader's expect (one arrival with both weight boxes' bytes) and each loader thread's cp.async arrival;
    # empty: both mma halves. The two c_smem buffers: c_ready both mma halves, c_empty the epilogue.
    ready, empty = stage_barriers(NUM_STAGES, 1 + UP_LOADER_WARPS * 32, 2)
    c_ready, c_empty = stage_barriers(2, 2, 1)

    outs = (pre_ptr, pre_s_ptr, act_ptr, stride_pre_m, stride_act_m, alpha, limit)
    scales = (a_scale_ptr, w_scale_ptr, indices_ptr, A_ROWS, stride_ws_e)
    sched = (tile_expert_ptr, tile_row_ptr, offsets_ptr, num_tiles_ptr)
    smem = (a_bufs, w_bufs, c_smem)
    bars = (ready, empty, c_ready, c_empty)
    dims = (K_DIM, N_COLS, UP_OFF)
    # constexprs go into the partitions' argument lists directly (a tuple variable would hold them as values)
    gl.warp_specialize([
        (_mma_up, (scales, sched, smem, bars, dims, 0, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, GROUP_M)),
        (_mma_up, (scales, sched, smem, bars, dims, 1, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, GROUP_M)),
        (_gather_loader, ((a_ptr, indices_ptr, A_ROWS, stride_a_t, UP_OFF), w_desc, sched, smem, bars,
                          (K_DIM, N_COLS, N_EXT, 0, 0), True, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, GROUP_M,
                          UP_LOADER_WARPS)),
        (_epilogue_up, (outs, sched, smem, bars, dims, ACTIVATION, POW2, BLOCK_M, BLOCK_N, GROUP_M)),
    ], [MMA_WARPS, UP_LOADER_WARPS, UP_EPILOGUE_WARPS], [MMA_REGS, UP_LOADER_REGS, UP_EPILOGUE_REGS])


def ws_up_ok(x: torch.Tensor, w: torch.Tensor, pre: torch.Tensor, act: torch.Tensor) -> bool:
    """F1 of the FP8 layer (``pre`` kept in e4m3: ``launch._check_pre_fp8``) can run on :func:`fp8_ws_up_kernel`
    where :func:`.tuning.ws_enabled` (checked by the launcher before it imports this module): a contiguous
    ``w_gate_up``, aligned rows of ``x`` and of the weight, unit column strides of ``pre`` and ``act``."""
    return (w.is_contiguous() and rows_aligned(x) and rows_aligned(w[0]) and pre.stride(1) == 1
            and act.stride(1) == 1)


def launch_ws_up(x, w, pre, act, pre_scale, x_scale, w_scale, offsets, indices, sched, h, d, activation, alpha, limit,
                 pow2) -> None:
    """Launch :func:`fp8_ws_up_kernel` (check :func:`ws_up_ok` first): F1 with the kept e4m3 ``pre [N, 2h]`` and its
    tile scales ``pre_scale [N, 2, h / 64]``, and ``act [N, h]``, from e4m3 ``x [T, d]`` rows and ``w [E, 2h, d]``
    with their rowwise scales ``x_scale [T]``, ``w_scale [E, 2h]``; ``sched`` the 128-row tile schedule."""
    E = w.shape[0]
    w_desc = tma_desc(w.reshape(E * w.shape[1], d), [CONFIG["BLOCK_N"], CONFIG["BLOCK_K"]])
    tiles = sched[0].numel() * cdiv(h, CONFIG["BLOCK_N"])
    direct.launch(fp8_ws_up_kernel, (min(tiles, num_programs(x.device)),),
        a_ptr=x, w_desc=w_desc, pre_ptr=pre, pre_s_ptr=pre_scale, act_ptr=act, a_scale_ptr=x_scale, w_scale_ptr=w_scale,
        offsets_ptr=offsets, indices_ptr=indices, tile_expert_ptr=sched[0], tile_row_ptr=sched[1],
        num_tiles_ptr=sched[2], A_ROWS=indices.numel(), K_DIM=d, N_COLS=h, N_EXT=w.shape[1], UP_OFF=h,
        stride_a_t=x.stride(0), stride_pre_m=pre.stride(0), stride_act_m=act.stride(0), stride_ws_e=w_scale.stride(0),
        alpha=float(alpha), limit=float(limit), ACTIVATION=activation, POW2=pow2, **CONFIG, num_warps=4,
        maxnreg=MAX_REGS,
    )
