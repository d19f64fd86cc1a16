"""Gather-fused grouped GEMM over expert slot tiles, with constexpr epilogues (DESIGN.md §5: F1, F2, B1, B3).

One launch covers every expert. Program ``pid`` maps (grouped ordering, ``GROUP_M`` M-tiles per group
for L2 reuse of the weight tile) to an M-tile ``pid_m`` of the schedule of
:func:`moeblaze.kernels.schedule.tile_schedule` — up to ``BLOCK_M`` consecutive slots of ONE expert
``e`` — and an N-tile ``pid_n``. It computes ``C[s, n] = sum_k A[row(s), k] * B[e][k, n]`` with
``row(s) = expert_token_indices[s]`` when ``GATHER_A`` (rows of the unpermuted input are read in the
loads: no gathered copy exists) and ``row(s) = s`` otherwise. ``B[e][k, n]`` is read through strides,
so the same kernel reads ``w_gate_up [E, 2h, d]`` and ``w_down [E, d, h]`` in either orientation; on an
sm90+ GPU it reads them through a TMA descriptor instead (constexpr ``B_DESC``, one of the ``B_DESC_*``
constants below, see :func:`_mainloop`: the copy engine moves the weight tile to shared memory, no
per-element addresses in registers; for the gated F1 one box holds both the gate and the up rows of a
tile, ``B_DESC_PAIRED`` / ``B_DESC_INTERLEAVED``). The gathered A rows stay pointer loads: Hopper's TMA
has no row gather.

Epilogues (constexpr ``EPILOGUE``; ``HAS_BIAS`` adds the expert's bias row ``bias[e]`` to the fp32
accumulator first, before any rounding or scaling):
  ``EPILOGUE_PLAIN``: store ``C`` (times the slot's router weight if ``SCALE_C``) at row ``s`` or, if
     ``SCATTER_C``, at row ``token(s)`` (K = 1: out / dx written directly, no ``[N, d]`` buffer).
     F2 ``y = act W_down[e]^T`` and B3 ``dx_slots = dpre W_gate_up[e]``.
  ``EPILOGUE_ACT_FWD`` (F1): ``DUAL`` yields gate (columns ``n``) and up (columns ``UP_OFF + n``)
     tiles side by side — from one wide accumulator (``B_DESC_PAIRED`` / ``B_DESC_INTERLEAVED``) or
     two — so ``act = f(gate) * up`` is formed in registers; stores ``pre`` if
     ``STORE_PRE`` and ``act`` if ``STORE_ACT`` (act is computed from the rounded ``pre``, exactly as
     the backward recomputes it). ``pre``'s gate column of ``n`` is ``n * PRE_STEP`` and its up column
     ``n * PRE_STEP + UP_OFF``: blocks (1, h) or, for an interleaved ``w_gate_up`` (GPT-OSS), alternating
     columns (2, 1) — ``pre`` keeps the weight's row order, so B3/B4 read the interleaved view as it is.
     ``TF32_ACT`` (fp32 at TF32 precision): ``act`` is stored rounded to TF32, as F2 reads it, so F2 needs
     no rounded copy of it (:mod:`moeblaze.kernels.tf32`).
B1 uses ``EPILOGUE_PLAIN`` (``dact' = dout[token(s)] W_down[e]``); its activation backward streams the rows
afterwards (:mod:`moeblaze.kernels.act_bwd`, where the measurement that chose this is given).
``FP8``: A and B are e4m3 under the rowwise recipe (:mod:`moeblaze.fp8`: one scale per row of A and per weight
row along n, both along the reduction); the main loop is the same, and the accumulator is multiplied by the two
scales once after it, before the epilogue (bias included). B is read K-major (``B_DESC_NK`` or its pointers),
the layout the e4m3 tensor cores take. The tensor cores' e4m3 sums are promoted into the fp32 accumulator every
``BLOCK_K`` products (``max_num_imprecise_acc``; DeepSeek-V3 §3.3.2): Hopper's FP8 MMA keeps fewer accumulator bits,
and Triton lets it sum the whole K on sm90. Without it ``moeblaze train --preset 1b --precision fp8-mixed`` (1,000
steps) ended at 1.333 bits/byte against bf16-mixed's 1.277, with it at 1.277 (docs/results-fp8-train.csv); the FP8
layer step went from 0.94-1.06x bf16's speed to 0.81-0.89x (``moeblaze bench --configs qwen3-30b-a3b,olmoe-1b-7b
--impls moeblaze,moeblaze-fp8``, docs/results.csv).
Accumulation is fp32 (``tl.dot``); nothing is atomic, so results are bitwise reproducible.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..fp8 import E4M3_MAX, KEPT_TILE, SCALE_FLOOR
from .act_math import act_forward
from .fp8_quant import inverse, row_amax, scale_of, to_e4m3
from .tf32 import round_tf32_values

# EPILOGUE: what the kernel does with the accumulator (module docstring).
EPILOGUE_PLAIN = tl.constexpr(0)  # store C (bias, router-weight scale, scatter to token rows: optional)
EPILOGUE_ACT_FWD = tl.constexpr(1)  # F1: store pre and/or act = f(gate) * up
# B_DESC: how the weight B is read (see _mainloop; chosen by launch.b_desc_mode, launch.interleaved_desc_ok).
B_DESC_NONE = tl.constexpr(0)  # pointer loads through B's strides
B_DESC_NK = tl.constexpr(1)  # TMA descriptor over B stored [E*n, k] (tile transposed for the MMA)
B_DESC_KN = tl.constexpr(2)  # TMA descriptor over B stored [E*k, n]
B_DESC_PAIRED = tl.constexpr(3)  # as NK, gated F1: one [2, BLOCK_N, BLOCK_K] box holds the gate and up rows
B_DESC_INTERLEAVED = tl.constexpr(4)  # gated F1, interleaved w_gate_up stored [E*d, 2h]: alternating columns
# PRE_FP8: how F1 stores pre (EPILOGUE_ACT_FWD); the e4m3 forms are the FP8 layer's kept pre, one scale per row of
# each 1 x KEPT_TILE tile of each half (moeblaze.fp8.Float8Recipe.quantize_kept), into scale_ptr
PRE_16BIT = tl.constexpr(0)  # in pre_ptr's dtype
PRE_E4M3 = tl.constexpr(1)  # in e4m3, amax / 448 scales
PRE_E4M3_POW2 = tl.constexpr(2)  # in e4m3, scales rounded up to powers of two
_PRE_TILE = tl.constexpr(KEPT_TILE)
_TINY = tl.constexpr(SCALE_FLOOR)
_QMAX = tl.constexpr(E4M3_MAX)


@triton.jit
def tile_of(pid, max_tiles, num_n, GROUP_M: tl.constexpr):
    """Grouped ordering: ``GROUP_M`` M-tiles share a sweep over the N-tiles (L2 reuse)."""
    num_in_group = GROUP_M * num_n
    first_m = (pid // num_in_group) * GROUP_M
    group_size = tl.minimum(max_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % num_in_group) % group_size
    pid_n = (pid % num_in_group) // group_size
    return pid_m, pid_n


@triton.jit
def _descriptors(a_ptr,  # [A_ROWS, K_DIM] A: x, dout [T, K_DIM] or act, dpre [N, K_DIM]; fp16/bf16/fp32 (FP8: e4m3)
                 b_ptr,  # [E, *, *] weight B, seen as NK [E*N_EXT, K_DIM], PAIRED [2E, h, d], KN [E*K_DIM, N_EXT]
                 A_ROWS, K_DIM, N_EXT, B_ROWS, NUM_EXPERTS, stride_a_m, stride_b_k, stride_b_n,
                 A_DESC: tl.constexpr, B_DESC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """The TMA descriptors of A and B (each built once per program: building one writes 128 bytes of
    global scratch and fences); the plain pointer where an operand is read through pointers."""
    a_desc = a_ptr
    b_desc = b_ptr
    if B_DESC == B_DESC_NK:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[B_ROWS, K_DIM], strides=[stride_b_n, 1],
                                           block_shape=[BLOCK_N, BLOCK_K])
    elif B_DESC == B_DESC_KN:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[NUM_EXPERTS * K_DIM, N_EXT], strides=[stride_b_k, 1],
                                           block_shape=[BLOCK_K, BLOCK_N])
    elif B_DESC == B_DESC_PAIRED:  # w_gate_up [E, 2h, d] seen as [2E, h, d]: one box holds a gate and an up slab
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[2 * NUM_EXPERTS, N_EXT // 2, K_DIM],
                                           strides=[N_EXT // 2 * stride_b_n, stride_b_n, 1],
                                           block_shape=[2, BLOCK_N, BLOCK_K])
    elif B_DESC == B_DESC_INTERLEAVED:  # w_gate_up stored [E*d, 2h] (GPT-OSS): a box of alternating gate/up columns
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[NUM_EXPERTS * K_DIM, N_EXT], strides=[stride_b_k, 1],
                                           block_shape=[BLOCK_K, 2 * BLOCK_N])
    if A_DESC:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[A_ROWS, K_DIM], strides=[stride_a_m, 1],
                                           block_shape=[BLOCK_M, BLOCK_K])
    return a_desc, b_desc


@triton.jit
def _mainloop(a_ptr,  # [T, K_DIM] (gathered: x, dout) or [N, K_DIM] (act, dpre); fp16/bf16/fp32 (FP8: e4m3)
              b_ptr,  # [E, *, *] weight; B[e][k, n] at e*stride_b_e + k*stride_b_k + n*stride_b_n
              a_desc,  # A_DESC: TMA descriptor over A [A_ROWS, K_DIM], box [BLOCK_M, BLOCK_K]; else a_ptr
              b_desc,  # B_DESC: TMA descriptor over B (_descriptors: NK / KN / PAIRED / INTERLEAVED box); else b_ptr
              a_rows, a_row0, e, pid_n, N_COLS, K_DIM, N_EXT, UP_OFF, up_shift,
              stride_a_m, stride_a_k, stride_b_e, stride_b_k, stride_b_n,
              DUAL: tl.constexpr, A_DESC: tl.constexpr, B_DESC: tl.constexpr, EVEN_K: tl.constexpr,
              EVEN_N: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, FP8: tl.constexpr):
    """``acc[m, n] = sum_k A[a_rows[m], k] B[e][k, n]`` (and ``acc2`` with B's columns shifted by ``UP_OFF``;
    ``up_shift`` is that shift in elements). ``N_EXT``: the weight's extent along n (``2h`` for gated F1).

    ``B_DESC`` (see :func:`moeblaze.kernels.launch.b_desc_mode`): ``B_DESC_NONE`` reads B through pointers;
    ``B_DESC_NK`` and ``B_DESC_KN`` through ``b_desc``, a TMA descriptor over the weight flattened to rows,
    stored ``[E*n, k]`` (NK, tile transposed in shared memory for the MMA) or ``[E*k, n]`` (KN). Rows a tile
    reads past its expert land in columns the epilogue masks (NK), or never exist because
    ``K_DIM % BLOCK_K == 0`` (KN, launcher rule); past the last expert the TMA unit fills zeros.
    ``B_DESC_PAIRED`` (gated F1, storage as NK): one ``[2, BLOCK_N, BLOCK_K]`` box brings
    the gate rows ``n`` and the up rows ``UP_OFF + n`` together (zeros past ``h``), so a single
    ``BLOCK_N x 2`` wide MMA replaces the two of ``DUAL``; the accumulator's halves are split after the
    loop without data movement (each thread holds matching gate and up columns). ``B_DESC_INTERLEAVED``
    (gated F1 over an interleaved ``w_gate_up`` stored ``[E*d, 2h]``, GPT-OSS's ``gate_up_proj``): one
    ``[BLOCK_K, 2*BLOCK_N]`` box of alternating gate/up columns ``2*n0 ...`` feeds one wide MMA whose
    accumulator columns alternate the same way; split after the loop. Same products and
    summation order as two dots: bitwise equal results, 1.01-1.04x faster on an H200 at the same config
    and 1.06-1.08x with the persistent launch it makes worthwhile (F1 of conf4, conf7, olmoe,
    qwen3-30b replayed alone, ``python3 benchmarks/profile_kernels.py --configs conf4-swiglu,conf7-swiglu``).

    ``A_DESC`` (A not gathered): A's ``[BLOCK_M, BLOCK_K]`` tile of slot rows from ``a_row0`` comes through
    ``a_desc``; rows past the expert only reach output rows the epilogue masks.
    """
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N_COLS
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_a_m + offs_k[None, :] * stride_a_k
    b_ptrs = (b_ptr + e.to(tl.int64) * stride_b_e + offs_k[:, None] * stride_b_k
              + offs_n[None, :] * stride_b_n)
    if B_DESC == B_DESC_NK:
        b_row = e * N_EXT + n0
    elif B_DESC == B_DESC_KN or B_DESC == B_DESC_INTERLEAVED:  # noqa: SIM109 (no `in` on constexprs in @triton.jit)
        b_row = e * K_DIM
    WIDE: tl.constexpr = B_DESC == B_DESC_PAIRED or B_DESC == B_DESC_INTERLEAVED  # one MMA, gate and up
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N if WIDE else BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_DIM, BLOCK_K):
        k_ok = offs_k < K_DIM - k0
        if A_DESC:
            a = a_desc.load([a_row0, k0])
        elif EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        if B_DESC == B_DESC_NK:
            b = b_desc.load([b_row, k0]).T
            if DUAL:
                b2 = b_desc.load([b_row + UP_OFF, k0]).T
        elif B_DESC == B_DESC_KN:
            b = b_desc.load([b_row + k0, n0])
            if DUAL:
                b2 = b_desc.load([b_row + k0, n0 + UP_OFF])
        elif B_DESC == B_DESC_PAIRED:
            b = b_desc.load([2 * e, n0, k0]).reshape(2 * BLOCK_N, BLOCK_K).T
        elif B_DESC == B_DESC_INTERLEAVED:
            b = b_desc.load([b_row + k0, 2 * n0])
        elif EVEN_K and EVEN_N:
            b = tl.load(b_ptrs)
            if DUAL:
                b2 = tl.load(b_ptrs + up_shift)
        else:
            b_mask = k_ok[:, None] & n_mask[None, :]
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
            if DUAL:
                b2 = tl.load(b_ptrs + up_shift, mask=b_mask, other=0.0)
        if FP8:  # the tensor cores' sums promoted to the fp32 accumulator every BLOCK_K products (module docstring)
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
            if DUAL and not WIDE:
                acc2 = tl.dot(a, b2, acc2, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
            if DUAL and not WIDE:
                acc2 = tl.dot(a, b2, acc2, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K * stride_a_k
        b_ptrs += BLOCK_K * stride_b_k
    if B_DESC == B_DESC_PAIRED:
        acc, acc2 = acc.reshape(BLOCK_M, 2, BLOCK_N).permute(0, 2, 1).split()
    elif B_DESC == B_DESC_INTERLEAVED:
        acc, acc2 = acc.reshape(BLOCK_M, BLOCK_N, 2).split()
    return acc, acc2


@triton.jit
def _epilogue_plain(c_ptr,  # [N, N_COLS] or [T, N_COLS] (SCATTER_C) output C: y, dact', dx_slots (or out, dx)
                    scale_ptr,  # [N] fp32 router weight of each slot (SCALE_C)
                    bias_ptr,  # [E, N_COLS] expert bias (HAS_BIAS)
                    acc, e, rows, tokens, mask, offs_n, n_mask, stride_c_m,
                    stride_bias_e, SCATTER_C: tl.constexpr, SCALE_C: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``EPILOGUE_PLAIN``: ``C[row] = (acc + bias[e])`` (``* w_slot``), row = token(s) if ``SCATTER_C`` else s."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * stride_bias_e + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if SCALE_C:
        acc = acc * tl.load(scale_ptr + rows)[:, None]
    if SCATTER_C:
        c_rows = tokens
    else:
        c_rows = rows
    tl.store(c_ptr + c_rows[:, None] * stride_c_m + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_e4m3_tiles(q_ptrs,  # [BLOCK_M, BLOCK_N] pointer block into e4m3 pre [N, 2h|h] (gate or up columns)
                      s_ptrs,  # [BLOCK_M] pointer block into fp32 pre scales [N, 2|1, cdiv(h, 64)]: each row's 1st tile
                      v, mask, row_mask, first_tile, tiles, BLOCK_N: tl.constexpr,
                      POW2: tl.constexpr):
    """The output tile ``v [BLOCK_M, BLOCK_N]`` (fp32) stored in e4m3 with one scale per row of each ``1 x
    KEPT_TILE`` tile in it (``s_ptrs [BLOCK_M]``: its first tile's scales, the next ones following; tiles from
    ``first_tile`` on, of ``tiles`` in a row): :func:`moeblaze.fp8.quantize_fp8` of the valid elements, bitwise on a
    GPU (the quantization kernels' helpers); columns and rows outside ``mask`` are neither counted nor stored."""
    v = tl.where(mask, v, 0.0)
    tile_of_col = (tl.arange(0, BLOCK_N) // _PRE_TILE)[None, :]
    scales = tl.zeros_like(v)  # each element's tile scale, and its inverse
    invs = tl.zeros_like(v)
    tile_rows = row_mask.to(tl.int32) * 0 + first_tile  # per row (a scalar condition in a mask: not in the interpreter)
    for j in tl.static_range(BLOCK_N // _PRE_TILE):
        inside = tile_of_col == j
        scale = scale_of(row_amax(tl.where(inside, v, 0.0)), _TINY, _QMAX, POW2)
        tl.store(s_ptrs + j, scale, mask=row_mask & (tile_rows + j < tiles))
        scales = tl.where(inside, scale[:, None], scales)
        invs = tl.where(inside, inverse(scale)[:, None], invs)
    tl.store(q_ptrs, to_e4m3(v, scales, invs), mask=mask)


@triton.jit
def _epilogue_act_fwd(pre_ptr,  # [N, 2h|h] pre, fp16/bf16/fp32 or e4m3 (PRE_FP8)
                      act_ptr,  # [N, h] act, fp16/bf16/fp32 (pre_ptr when act is not stored)
                      bias_ptr,  # [E, 2h|h] expert bias in pre's column order (HAS_BIAS)
                      pre_s_ptr,  # PRE_FP8: out, [N, 2|1, cdiv(h, 64)] fp32 scales of pre's 1 x 64 tiles
                      acc, acc2, e, rows, row_mask, mask, offs_n, n_mask,
                      pid_n, N_COLS, UP_OFF, alpha, limit, stride_pre_m, stride_act_m, stride_bias_e,
                      ACTIVATION: tl.constexpr, DUAL: tl.constexpr, STORE_PRE: tl.constexpr,
                      STORE_ACT: tl.constexpr, HAS_BIAS: tl.constexpr, PRE_STEP: tl.constexpr,
                      TF32_ACT: tl.constexpr, PRE_FP8: tl.constexpr, BLOCK_N: tl.constexpr):
    """``EPILOGUE_ACT_FWD`` (F1): store ``pre`` (gate at ``n * PRE_STEP``, up ``UP_OFF`` further; ``PRE_FP8``: in
    e4m3, the row scales of its ``1 x KEPT_TILE`` tiles into ``pre_s_ptr [N, 2|1, cdiv(N_COLS, KEPT_TILE)]``) and
    ``act = f(pre)`` (``TF32_ACT``: rounded to TF32, see the module docstring), both from ``pre`` rounded to the
    16-bit dtype (of ``act`` with ``PRE_FP8``)."""
    cols = offs_n * PRE_STEP
    if HAS_BIAS:  # bias[e] in pre's column order
        b_ptrs = bias_ptr + e * stride_bias_e + cols
        acc += tl.load(b_ptrs, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if DUAL:
            acc2 += tl.load(b_ptrs + UP_OFF, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    # act's dtype: pre's own (act_ptr is pre_ptr when act is not stored), the 16-bit one when pre is e4m3
    gate = acc.to(act_ptr.dtype.element_ty)
    up = acc2.to(act_ptr.dtype.element_ty)
    pre_ptrs = pre_ptr + rows[:, None] * stride_pre_m + cols[None, :]
    if STORE_PRE:
        if PRE_FP8 == PRE_16BIT:
            tl.store(pre_ptrs, gate, mask=mask)
            if DUAL:
                tl.store(pre_ptrs + UP_OFF, up, mask=mask)
        else:
            tiles = tl.cdiv(N_COLS, _PRE_TILE)
            first = pid_n * (BLOCK_N // _PRE_TILE)
            s_ptrs = pre_s_ptr + rows * ((2 if DUAL else 1) * tiles) + first
            _store_e4m3_tiles(pre_ptrs, s_ptrs, gate.to(tl.float32), mask, row_mask, first, tiles, BLOCK_N,
                              PRE_FP8 == PRE_E4M3_POW2)
            if DUAL:
                _store_e4m3_tiles(pre_ptrs + UP_OFF, s_ptrs + tiles, up.to(tl.float32), mask, row_mask, first, tiles,
                                  BLOCK_N, PRE_FP8 == PRE_E4M3_POW2)
    if STORE_ACT:
        act = act_forward(gate.to(tl.float32), up.to(tl.float32), alpha, limit, ACTIVATION)
        if TF32_ACT:
            act = round_tf32_values(act)
        tl.store(act_ptr + rows[:, None] * stride_act_m + offs_n[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit
def _gemm_tile(  # grouped_gemm_kernel's pointers, descriptors and strides (shapes commented there)
    t, tiles, num_n, a_ptr, b_ptr, c_ptr, aux_ptr, scale_ptr, bias_ptr, a_scale_ptr, b_scale_ptr, offsets_ptr,
    indices_ptr, tile_expert_ptr, tile_row_ptr, a_desc, b_desc, N_COLS, K_DIM, N_EXT, UP_OFF, UP_SHIFT_B, alpha, limit,
    stride_a_m, stride_a_k, stride_b_e, stride_b_k, stride_b_n, stride_c_m, stride_aux_m, stride_bias_e, stride_bs_e,
    GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr, SCALE_C: tl.constexpr, EPILOGUE: tl.constexpr,
    ACTIVATION: tl.constexpr, DUAL: tl.constexpr, STORE_PRE: tl.constexpr, STORE_AUX: tl.constexpr,
    HAS_BIAS: tl.constexpr, PRE_STEP: tl.constexpr, TF32_ACT: tl.constexpr, FP8: tl.constexpr, PRE_FP8: tl.constexpr,
    A_DESC: tl.constexpr, B_DESC: tl.constexpr, DOT_PREC: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Output tile ``t`` of ``tiles * num_n`` (a valid M-tile of the schedule): main loop and epilogue."""
    pid_m, pid_n = tile_of(t, tiles, num_n, GROUP_M)
    e = tl.load(tile_expert_ptr + pid_m)
    row_end = tl.load(offsets_ptr + e + 1)
    row0 = tl.load(tile_row_ptr + pid_m)
    slots = row0 + tl.arange(0, BLOCK_M)
    row_mask = slots < row_end
    rows = tl.minimum(slots, row_end - 1).to(tl.int64)  # clamped: main-loop loads need no row mask
    tokens = rows
    if GATHER_A or SCATTER_C:
        tokens = tl.load(indices_ptr + rows).to(tl.int64)
    if GATHER_A:
        a_rows = tokens
    else:
        a_rows = rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N_COLS
    acc, acc2 = _mainloop(
        a_ptr=a_ptr, b_ptr=b_ptr, a_desc=a_desc, b_desc=b_desc, a_rows=a_rows, a_row0=row0, e=e, pid_n=pid_n,
        N_COLS=N_COLS, K_DIM=K_DIM, N_EXT=N_EXT, UP_OFF=UP_OFF, up_shift=UP_SHIFT_B,
        stride_a_m=stride_a_m, stride_a_k=stride_a_k, stride_b_e=stride_b_e, stride_b_k=stride_b_k,
        stride_b_n=stride_b_n,
        DUAL=DUAL, A_DESC=A_DESC, B_DESC=B_DESC, EVEN_K=EVEN_K, EVEN_N=EVEN_N, DOT_PREC=DOT_PREC,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, FP8=FP8,
    )
    if FP8:  # rowwise e4m3 operands: the sums of the whole K times A's row scale and the weight row's scale
        a_scale = tl.load(a_scale_ptr + a_rows)[:, None]
        b_scales = b_scale_ptr + e.to(tl.int64) * stride_bs_e + offs_n
        acc = acc * a_scale * tl.load(b_scales, mask=n_mask, other=0.0)[None, :]
        if DUAL:
            acc2 = acc2 * a_scale * tl.load(b_scales + UP_OFF, mask=n_mask, other=0.0)[None, :]
    mask = row_mask[:, None] & n_mask[None, :]
    if EPILOGUE == EPILOGUE_PLAIN:
        _epilogue_plain(
            c_ptr=c_ptr, scale_ptr=scale_ptr, bias_ptr=bias_ptr, acc=acc, e=e, rows=rows, tokens=tokens, mask=mask,
            offs_n=offs_n, n_mask=n_mask, stride_c_m=stride_c_m, stride_bias_e=stride_bias_e,
            SCATTER_C=SCATTER_C, SCALE_C=SCALE_C, HAS_BIAS=HAS_BIAS,
        )
    else:  # EPILOGUE_ACT_FWD: c is pre, aux is act
        _epilogue_act_fwd(
            pre_ptr=c_ptr, act_ptr=aux_ptr, bias_ptr=bias_ptr, pre_s_ptr=scale_ptr, acc=acc, acc2=acc2, e=e,
            rows=rows, row_mask=row_mask, mask=mask, offs_n=offs_n, n_mask=n_mask, pid_n=pid_n, N_COLS=N_COLS,
            UP_OFF=UP_OFF, alpha=alpha, limit=limit,
            stride_pre_m=stride_c_m, stride_act_m=stride_aux_m, stride_bias_e=stride_bias_e,
            ACTIVATION=ACTIVATION, DUAL=DUAL, STORE_PRE=STORE_PRE, STORE_ACT=STORE_AUX, HAS_BIAS=HAS_BIAS,
            PRE_STEP=PRE_STEP, TF32_ACT=TF32_ACT, PRE_FP8=PRE_FP8, BLOCK_N=BLOCK_N,
        )


@triton.jit
def grouped_gemm_kernel(
    a_ptr,  # [T, K_DIM] (GATHER_A: x, dout) or [N, K_DIM] (act, dpre); fp16/bf16/fp32
    b_ptr,  # [E, *, *] weight; B[e][k, n] at e*stride_b_e + k*stride_b_k + n*stride_b_n (B_DESC: TMA)
    c_ptr,  # EPILOGUE_PLAIN: [N, N_COLS] or [T, N_COLS] (SCATTER_C); EPILOGUE_ACT_FWD: pre [N, 2h|h] (e4m3: PRE_FP8)
    aux_ptr,  # EPILOGUE_ACT_FWD: act [N, h]; else unused
    scale_ptr,  # [N] fp32 router weight of each slot (SCALE_C); PRE_FP8: out, [N, 2|1, cdiv(h, 64)] fp32 scales of pre
    bias_ptr,  # [E, N_COLS] (EPILOGUE_PLAIN) or [E, 2h|h] (EPILOGUE_ACT_FWD, pre's column order) bias (HAS_BIAS)
    a_scale_ptr,  # FP8: [rows of A] fp32 dequantization scale of each row of A (token rows when GATHER_A)
    b_scale_ptr,  # FP8: [E, N_EXT] fp32 dequantization scale of each weight row along n, row e at e * stride_bs_e
    offsets_ptr,  # [E+1] int32 expert_token_offsets
    indices_ptr,  # [N] int32 expert_token_indices (slot -> token)
    tile_expert_ptr,  # [max_tiles] int32 expert of each M-tile (-1 past num_tiles)
    tile_row_ptr,  # [max_tiles] int32 first slot of each M-tile
    num_tiles_ptr,  # [1] int32 number of valid M-tiles
    max_tiles, N_COLS, K_DIM,
    N_EXT,  # the weight's extent along n (2h for the gated F1, else N_COLS; NK: a column chunk's whole weight,
            # KN: from b_ptr on, the descriptor's column extent)
    B_ROWS,  # rows of the B_DESC_NK descriptor from b_ptr: E * N_EXT, less a column chunk's first column
    A_ROWS,  # rows of A (A_DESC: extent of its descriptor)
    UP_OFF,  # column of the up entry of n in pre / dpre, from its gate column (h, or 1 when interleaved)
    UP_SHIFT_B,  # element offset of the up rows of w_gate_up from the gate rows (DUAL only)
    alpha, limit,  # fp32 parameters of the clamped SwiGLU (EPILOGUE_ACT_FWD)
    stride_a_m, stride_a_k, stride_b_e, stride_b_k, stride_b_n, stride_c_m, stride_aux_m, stride_bias_e,
    stride_bs_e,
    NUM_EXPERTS,  # E (autotune key; rows of the B_DESC descriptor)
    GATHER_A: tl.constexpr, SCATTER_C: tl.constexpr, SCALE_C: tl.constexpr, EPILOGUE: tl.constexpr,
    ACTIVATION: tl.constexpr, DUAL: tl.constexpr, STORE_PRE: tl.constexpr, STORE_AUX: tl.constexpr,
    HAS_BIAS: tl.constexpr, PRE_STEP: tl.constexpr, TF32_ACT: tl.constexpr, FP8: tl.constexpr, PRE_FP8: tl.constexpr,
    A_DESC: tl.constexpr, B_DESC: tl.constexpr, DOT_PREC: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    PERSISTENT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # PERSISTENT: a fixed grid (about one program per SM) walks the valid tiles; the flattened loop lets
    # the pipeliner issue the next tile's first loads during this tile's epilogue. Else one program per
    # (M-tile of the static schedule length, N-tile); programs past num_tiles exit.
    a_desc, b_desc = _descriptors(
        a_ptr=a_ptr, b_ptr=b_ptr, A_ROWS=A_ROWS, K_DIM=K_DIM, N_EXT=N_EXT, B_ROWS=B_ROWS, NUM_EXPERTS=NUM_EXPERTS,
        stride_a_m=stride_a_m, stride_b_k=stride_b_k, stride_b_n=stride_b_n,
        A_DESC=A_DESC, B_DESC=B_DESC, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    num_n = tl.cdiv(N_COLS, BLOCK_N)
    num_tiles = tl.load(num_tiles_ptr)
    if PERSISTENT:
        for t in tl.range(tl.program_id(0), num_tiles * num_n, tl.num_programs(0), flatten=True):
            _gemm_tile(
                t=t, tiles=num_tiles, num_n=num_n,
                a_ptr=a_ptr, b_ptr=b_ptr, c_ptr=c_ptr, aux_ptr=aux_ptr, scale_ptr=scale_ptr, bias_ptr=bias_ptr,
                a_scale_ptr=a_scale_ptr, b_scale_ptr=b_scale_ptr, offsets_ptr=offsets_ptr, indices_ptr=indices_ptr, tile_expert_ptr=tile_expert_ptr,
                tile_row_ptr=tile_row_ptr, a_desc=a_desc, b_desc=b_desc,
                N_COLS=N_COLS, K_DIM=K_DIM, N_EXT=N_EXT, UP_OFF=UP_OFF, UP_SHIFT_B=UP_SHIFT_B, alpha=alpha, limit=limit,
                stride_a_m=stride_a_m, stride_a_k=stride_a_k, stride_b_e=stride_b_e, stride_b_k=stride_b_k,
                stride_b_n=stride_b_n, stride_c_m=stride_c_m, stride_aux_m=stride_aux_m, stride_bias_e=stride_bias_e,
                stride_bs_e=stride_bs_e,
                GATHER_A=GATHER_A, SCATTER_C=SCATTER_C, SCALE_C=SCALE_C, EPILOGUE=EPILOGUE, ACTIVATION=ACTIVATION,
                DUAL=DUAL, STORE_PRE=STORE_PRE, STORE_AUX=STORE_AUX, HAS_BIAS=HAS_BIAS, PRE_STEP=PRE_STEP,
                TF32_ACT=TF32_ACT, FP8=FP8, PRE_FP8=PRE_FP8,
                A_DESC=A_DESC, B_DESC=B_DESC, DOT_PREC=DOT_PREC, EVEN_K=EVEN_K, EVEN_N=EVEN_N,
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M,
            )
    else:
        pid = tl.program_id(0)
        pid_m, _ = tile_of(pid, max_tiles, num_n, GROUP_M)
        if pid_m < num_tiles:
            # The persistent call's arguments but (t, tiles): one call site fed by a variable generates other
            # code for both launch shapes (their sm90 TTGIR compared), so the two call sites stay apart.
            _gemm_tile(
                t=pid, tiles=max_tiles, num_n=num_n,
                a_ptr=a_ptr, b_ptr=b_ptr, c_ptr=c_ptr, aux_ptr=aux_ptr, scale_ptr=scale_ptr, bias_ptr=bias_ptr,
                a_scale_ptr=a_scale_ptr, b_scale_ptr=b_scale_ptr, offsets_ptr=offsets_ptr, indices_ptr=indices_ptr, tile_expert_ptr=tile_expert_ptr,
                tile_row_ptr=tile_row_ptr, a_desc=a_desc, b_desc=b_desc,
                N_COLS=N_COLS, K_DIM=K_DIM, N_EXT=N_EXT, UP_OFF=UP_OFF, UP_SHIFT_B=UP_SHIFT_B, alpha=alpha, limit=limit,
                stride_a_m=stride_a_m, stride_a_k=stride_a_k, stride_b_e=stride_b_e, stride_b_k=stride_b_k,
                stride_b_n=stride_b_n, stride_c_m=stride_c_m, stride_aux_m=stride_aux_m, stride_bias_e=stride_bias_e,
                stride_bs_e=stride_bs_e,
                GATHER_A=GATHER_A, SCATTER_C=SCATTER_C, SCALE_C=SCALE_C, EPILOGUE=EPILOGUE, ACTIVATION=ACTIVATION,
                DUAL=DUAL, STORE_PRE=STORE_PRE, STORE_AUX=STORE_AUX, HAS_BIAS=HAS_BIAS, PRE_STEP=PRE_STEP,
                TF32_ACT=TF32_ACT, FP8=FP8, PRE_FP8=PRE_FP8,
                A_DESC=A_DESC, B_DESC=B_DESC, DOT_PREC=DOT_PREC, EVEN_K=EVEN_K, EVEN_N=EVEN_N,
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M,
            )
