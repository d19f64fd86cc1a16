"""B1 activation backward as a row-streaming kernel, after a plain-epilogue ``dact'`` GEMM (DESIGN.md §5).

Why not in the GEMM's epilogue: loading ``pre`` and doing the activation math after the main loop, with
one CTA per SM, overlaps with nothing. Measured on an H200 (both forms in one run, olmoe shape
T 32768, d 2048, h 1024, E 64, K 8, bf16; ``python3 benchmarks/profile_layer.py --configs olmoe-1b-7b --impls
moeblaze --kernels`` times the two launches kept): the fused epilogue took 4.33 ms (2.3x F2's 1.87 ms for the same FLOPs,
also with ``pre`` prefetched before the main loop); the plain GEMM 1.69 ms plus this kernel 1.08 ms, and
the whole layer step 22.3 ms instead of 23.4 (qwen3-30b 19.2 vs 19.4, mixtral 136.7 vs 141.1, conf4
81.8 vs 85.2). The GEMM stores ``dact' = dout[token(s)] W_down[e]`` (2 bytes per element, into the
``[N, h]`` buffer that B2 needs anyway for ``w * act``: no extra memory) and this kernel streams the
rows at memory bandwidth, reading ``dact'``, ``pre`` and writing ``dpre``, ``w * act`` (12 bytes per
element in 16-bit dtypes). A warp-specialized Gluon kernel whose 2-warp epilogue did this pass while the
next tile's MMAs ran (H200, B1 alone by ``triton.testing.do_bench`` on conf4, conf7 and qwen3-30b;
docs/benchmarks.md, "Tried and dropped") was correct but only 0.94-1.02x of these two launches: its gathered operand's loads, slowed by the epilogue's own traffic, then
held the MMAs back.

Per slot row ``s`` (one program owns ``BLOCK_R`` whole rows, so the router-weight gradient is a plain row
sum, no partials and no second pass):
    act = f(gate) * up                (recomputed from pre; MoEBlaze §4.3 smart checkpointing)
    dtw[s]  = <dact'[s], act[s]>      (router-weight gradient, DESIGN.md eq. for dtopk_weights)
    wact[s] = w_s * act[s]            (B operand of dW_down; written over dact')
    dpre[s] = act_backward(w_s * dact'[s], pre[s])   (written over pre when dpre is pre)
Every element is read before it is overwritten, by the same program: in-place is safe, and nothing is
atomic (bitwise reproducible). ``pre``'s layout is F1's (``PRE_STEP``/``UP_OFF``: gate/up blocks, or the
alternating columns of an interleaved ``w_gate_up``), and ``dpre`` is written in the same layout.
``HAS_LIMIT`` (an index with foreign experts): rows ``>= limit[0]`` (foreign slots, never computed by F1)
are skipped, except the first ``ZERO_TAIL`` of them, whose ``w * act`` and ``dpre`` are written as zeros: the
weight gradients read whole 64-slot TMA boxes of these two, so the last local expert's box reaches that far into
the foreign rows, where uninitialised values (a NaN times the gathered side's zeros) would spread
(:mod:`moeblaze.kernels.ws_wgrad`); their ``dtw`` is written as 0 (the router-weight gradient of a pair of no
local expert, gathered as it is). ``TF32_DPRE`` (fp32 at TF32 precision): ``dpre`` is stored rounded to TF32, the A operand of
B3, which then reads it without a rounded copy (:mod:`moeblaze.kernels.tf32`; the expert-bias gradient
``db_gate_up``, a sum of ``dpre`` rows, sums the rounded values).

``QUANT`` (the FP8 layer's B3 operand, issue 59's dpre quantized where it is produced): the program also keeps each
row's largest stored magnitude and writes the rows in e4m3 with the rowwise recipe's scale
(:mod:`moeblaze.kernels.fp8_quant`'s helpers, so the bytes are that kernel's): B3's quantization without a separate
pass that reads ``dpre`` from HBM again. ``ROW_WHOLE`` (h <= BLOCK_H, the tuned list's 1,024-column configs): the
rows' values are still in registers when their maxima are known, so they are written from there; else, after the
rows are written, they are read back (from L2: they were just written). Held whole, the FP8 layer's launch took
0.728 ms against 0.828 for the best column-block config at h 768, 0.817 against 1.075 at h 1,024 (H200, N 262,144;
``python3 benchmarks/bench_small_kernels.py --kernels act_bwd``, docs/results-small-kernels.csv). ``PRE_E4M3`` (the
FP8 layer's kept ``pre``, written in e4m3 by F1's epilogue): ``pre`` is read as e4m3 times its ``1 x PRE_TILE`` tile's
scale, in fp32 (no 16-bit copy of it is made), and ``dpre`` goes to another tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..fp8 import E4M3_MAX, SCALE_FLOOR
from .act_math import FIRST_NON_GATED, act_backward, act_forward
from .fp8_quant import inverse, nan_max, row_amax, scale_of, to_e4m3
from .tf32 import round_tf32_values
from .tuning import Launchable, act_bwd_configs, cdiv

# foreign rows after the last local slot whose w * act and dpre are zeroed (>= the weight gradients' slot step)
ZERO_TAIL = tl.constexpr(64)


@triton.jit
def act_bwd_rows_kernel(
    dact_ptr,  # [N, h] dact' (fp16/bf16/fp32); overwritten with w * act when STORE_WACT
    pre_ptr,  # [N, 2h|h] pre-activation (gate at n, up at UP_OFF + n); e4m3 if PRE_E4M3
    pre_s_ptr,  # [N, 2|1, cdiv(h, PRE_TILE)] fp32 scales of pre's 1 x PRE_TILE tiles per half (PRE_E4M3)
    dpre_ptr,  # [N, 2h|h] out: dpre (may be pre itself, unless PRE_E4M3)
    scale_ptr,  # [N] fp32 router weight of each slot
    dtw_ptr,  # [N] fp32 out: <dact', act> per slot (STORE_PART)
    limit_ptr,  # [1] int32 number of local slots (HAS_LIMIT)
    dpre_q_ptr,  # [N, 2h|h] e4m3 out (QUANT): dpre as stored, quantized with one scale per row, dpre's layout
    dpre_s_ptr,  # [N] fp32 out (QUANT): that row's dequantization scale
    N, H, UP_OFF, alpha, limit,
    stride_dact_m, stride_pre_m, stride_dpre_m, stride_q_m,
    tiny,  # the smallest normal fp32 (QUANT: the floor of a nonzero row's scale)
    ACTIVATION: tl.constexpr, STORE_PART: tl.constexpr, STORE_WACT: tl.constexpr, PRE_STEP: tl.constexpr,
    HAS_LIMIT: tl.constexpr, TF32_DPRE: tl.constexpr, QUANT: tl.constexpr, POW2: tl.constexpr,
    PRE_E4M3: tl.constexpr, PRE_TILE: tl.constexpr, QMAX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    ROW_WHOLE: tl.constexpr,  # H <= BLOCK_H: one block holds the rows (a heuristic of the launch)
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < N
    store_mask = row_mask  # rows written: the computed ones and the zeroed tail
    if HAS_LIMIT:
        local = tl.load(limit_ptr)
        # a block of foreign slots only (token rounding's dropped and unused pairs: a fifth of the rows at
        # (16384, 4096, 1024, 256, 4)) returns at once instead of looping over h with every lane masked
        if tl.program_id(0) * BLOCK_R >= local + ZERO_TAIL:
            if STORE_PART:  # foreign slots' dtw is 0: the combine's gather needs no mask after it
                tl.store(dtw_ptr + rows, tl.zeros([BLOCK_R], tl.float32), mask=rows < N)
            return
        store_mask &= rows < local + ZERO_TAIL
        row_mask &= rows < local  # the tail's loads are masked to zeros, so every value stored there is 0
    rows64 = rows.to(tl.int64)[:, None]
    w = tl.load(scale_ptr + rows, mask=row_mask, other=0.0)[:, None]
    GATED: tl.constexpr = ACTIVATION < FIRST_NON_GATED
    ptrs = (dact_ptr, pre_ptr, pre_s_ptr, dpre_ptr)
    strides = (stride_dact_m, stride_pre_m, stride_dpre_m)
    if ROW_WHOLE:  # one block holds the rows: B3's e4m3 dpre from the registers, no read-back
        part, dgate, dup = _chunk(ptrs, rows64, row_mask, store_mask, w, 0, H, UP_OFF, alpha, limit, strides,
                                  ACTIVATION, STORE_PART, STORE_WACT, PRE_STEP, TF32_DPRE, PRE_E4M3, PRE_TILE,
                                  BLOCK_R, BLOCK_H)
        if QUANT:
            scale, inv = _row_scales(_pair_amax(dgate, dup, GATED), dpre_s_ptr, rows, store_mask, tiny, QMAX, POW2)
            cols = tl.arange(0, BLOCK_H)[None, :]
            _store_e4m3(dpre_q_ptr + rows64 * stride_q_m + cols * PRE_STEP, store_mask[:, None] & (cols < H), dgate,
                        dup, scale, inv, UP_OFF, GATED)
    else:
        part = tl.zeros([BLOCK_R], tl.float32)
        amax = tl.zeros([BLOCK_R], tl.float32)  # QUANT: the stored dpre row's largest magnitude
        for h0 in range(0, H, BLOCK_H):
            p, dgate, dup = _chunk(ptrs, rows64, row_mask, store_mask, w, h0, H, UP_OFF, alpha, limit, strides,
                                   ACTIVATION, STORE_PART, STORE_WACT, PRE_STEP, TF32_DPRE, PRE_E4M3, PRE_TILE,
                                   BLOCK_R, BLOCK_H)
            part += p
            if QUANT:
                amax = nan_max(amax, _pair_amax(dgate, dup, GATED))
        if QUANT:
            _quantize_stored_rows(dpre_ptr, dpre_q_ptr, dpre_s_ptr, rows, store_mask, amax, H, UP_OFF,
                                  stride_dpre_m, stride_q_m, tiny, PRE_STEP, GATED, POW2, QMAX, BLOCK_H)
    if STORE_PART:  # 0 for the foreign rows (HAS_LIMIT)
        tl.store(dtw_ptr + rows, tl.where(row_mask, part, 0.0), mask=rows < N)


@triton.jit
def _chunk(ptrs,  # tuple of pointers:
                 #   dact_ptr: [N, h] dact' (fp16/bf16/fp32); overwritten with w * act when STORE_WACT
                 #   pre_ptr: [N, 2h|h] pre-activation (gate at n, up at UP_OFF + n); e4m3 if PRE_E4M3
                 #   pre_s_ptr: [N, 2|1, cdiv(h, PRE_TILE)] fp32 scales of pre's 1 x PRE_TILE tiles (PRE_E4M3)
                 #   dpre_ptr: [N, 2h|h] out: dpre (may be pre itself, unless PRE_E4M3)
           rows64, row_mask, store_mask, w, h0, H, UP_OFF, alpha, limit, strides, ACTIVATION: tl.constexpr,
           STORE_PART: tl.constexpr, STORE_WACT: tl.constexpr, PRE_STEP: tl.constexpr, TF32_DPRE: tl.constexpr,
           PRE_E4M3: tl.constexpr, PRE_TILE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """Columns ``h0 .. h0 + BLOCK_H`` of the rows: ``w * act`` and ``dpre`` stored; returns this block's part of
    ``dtw`` and ``dpre``'s gate and up halves as stored, in fp32, zeros where masked (up: gate's, ungated)."""
    dact_ptr, pre_ptr, pre_s_ptr, dpre_ptr = ptrs
    stride_dact_m, stride_pre_m, stride_dpre_m = strides
    GATED: tl.constexpr = ACTIVATION < FIRST_NON_GATED
    cols = h0 + tl.arange(0, BLOCK_H)[None, :]
    mask = row_mask[:, None] & (cols < H)
    dact_ptrs = dact_ptr + rows64 * stride_dact_m + cols
    pre_ptrs = pre_ptr + rows64 * stride_pre_m + cols * PRE_STEP
    dact = tl.load(dact_ptrs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(pre_ptrs, mask=mask, other=0.0).to(tl.float32)
    if PRE_E4M3:  # each e4m3 value times its tile's scale, in fp32 (Float8Tensor.dequantize)
        tiles = tl.cdiv(H, PRE_TILE)
        s_ptrs = pre_s_ptr + rows64 * (tiles * (2 if GATED else 1))
        gate = _times_tile_scales(gate, s_ptrs, h0, row_mask, tiles, PRE_TILE, BLOCK_R, BLOCK_H)
    if GATED:
        up = tl.load(pre_ptrs + UP_OFF, mask=mask, other=0.0).to(tl.float32)
        if PRE_E4M3:
            up = _times_tile_scales(up, s_ptrs + tiles, h0, row_mask, tiles, PRE_TILE, BLOCK_R, BLOCK_H)
    else:
        up = gate
    part = tl.zeros([BLOCK_R], tl.float32)
    if STORE_PART or STORE_WACT:
        act = act_forward(gate, up, alpha, limit, ACTIVATION)
    if STORE_PART:
        part = tl.sum(dact * act, axis=1)
    out_mask = store_mask[:, None] & (cols < H)
    if STORE_WACT:  # rounded like the torch backend: (w * act.to(dtype)).to(dtype)
        wact = act.to(dact_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(dact_ptrs, wact.to(dact_ptr.dtype.element_ty), mask=out_mask)
    dgate, dup = act_backward(dact * w, gate, up, alpha, limit, ACTIVATION)
    if TF32_DPRE:  # dpre is B3's A operand, read as it is (no rounded copy)
        dgate, dup = round_tf32_values(dgate), round_tf32_values(dup)
    dgate, dup = dgate.to(dpre_ptr.dtype.element_ty), dup.to(dpre_ptr.dtype.element_ty)
    dpre_ptrs = dpre_ptr + rows64 * stride_dpre_m + cols * PRE_STEP
    tl.store(dpre_ptrs, dgate, mask=out_mask)
    if GATED:
        tl.store(dpre_ptrs + UP_OFF, dup, mask=out_mask)
    else:
        dup = dgate
    # the values as stored (the masked lanes' zeros leave a row's amax as it is)
    return part, tl.where(out_mask, dgate.to(tl.float32), 0.0), tl.where(out_mask, dup.to(tl.float32), 0.0)


@triton.jit
def _times_tile_scales(v,
                       s_ptrs,  # [BLOCK_R, 1] pointer block: each row's first tile scale of this half in pre_s (fp32)
                       h0, row_mask, tiles, PRE_TILE: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_H: tl.constexpr):
    """``v [BLOCK_R, BLOCK_H]`` (columns ``h0 ..``) times the scale of each value's ``1 x PRE_TILE`` tile, the row's
    scales at ``s_ptrs [BLOCK_R, 1]``: one load per tile, broadcast over its values. Why: a load per value (the same
    address for all of a tile's) made the FP8 layer's activation backward 1.87 ms a step against the bf16 layer's 0.60
    (H200, Qwen3-30B-A3B shape, T 32,768; ``python3 benchmarks/profile_layer.py --configs qwen3-30b-a3b --impls
    moeblaze,moeblaze-fp8 --kernels --profiled-steps 10``, docs/results-fp8-profile.csv)."""
    SUB: tl.constexpr = min(BLOCK_H, PRE_TILE)  # values of one tile in a group (all of the block's if it is shorter)
    GROUPS: tl.constexpr = BLOCK_H // SUB
    t = (h0 + tl.arange(0, GROUPS) * SUB) // PRE_TILE
    s = tl.load(s_ptrs + t[None, :], mask=row_mask[:, None] & (t < tiles)[None, :], other=1.0)
    return tl.reshape(tl.reshape(v, [BLOCK_R, GROUPS, SUB]) * s[:, :, None], [BLOCK_R, BLOCK_H])


@triton.jit
def _pair_amax(dgate, dup, GATED: tl.constexpr):
    """The rows' largest magnitude over ``dpre``'s halves, NaN-propagating (``[BLOCK_R]`` fp32)."""
    amax = row_amax(dgate)
    if GATED:
        amax = nan_max(amax, row_amax(dup))
    return amax


@triton.jit
def _row_scales(amax,
                s_ptr,  # [N] fp32 out: each dpre row's dequantization scale (dpre_s)
                rows, store_mask, tiny, QMAX: tl.constexpr, POW2: tl.constexpr):
    """The rowwise recipe's scales of ``amax [BLOCK_R]``, stored at ``s_ptr + rows``; ``(scale, 1 / scale)`` as
    ``[BLOCK_R, 1]`` for :func:`_store_e4m3`."""
    scale = scale_of(amax, tiny, QMAX, POW2)
    tl.store(s_ptr + rows, scale, mask=store_mask)
    return scale[:, None], inverse(scale)[:, None]


@triton.jit
def _store_e4m3(dst,  # [BLOCK_R, BLOCK_H] pointer block into e4m3 dpre's gate columns (up at UP_OFF further)
                mask, gate, up, scale, inv, UP_OFF, GATED: tl.constexpr):
    """``gate`` (and ``up`` at ``UP_OFF`` further, gated) ``[BLOCK_R, BLOCK_H]`` fp32 written at ``dst`` in e4m3 with
    their row's ``scale`` and ``inv``."""
    tl.store(dst, to_e4m3(gate, scale, inv), mask=mask)
    if GATED:
        tl.store(dst + UP_OFF, to_e4m3(up, scale, inv), mask=mask)


@triton.jit
def _quantize_stored_rows(dpre_ptr,  # [N, 2h|h] dpre as stored (fp16/bf16/fp32), read back
                          q_ptr,  # [N, 2h|h] e4m3 out: dpre quantized with one scale per row, dpre's layout
                          s_ptr,  # [N] fp32 out: each row's dequantization scale
                          rows, store_mask, amax, H, UP_OFF, stride_dpre_m, stride_q_m, tiny,
                          PRE_STEP: tl.constexpr, GATED: tl.constexpr, POW2: tl.constexpr, QMAX: tl.constexpr,
                          BLOCK_H: tl.constexpr):
    """The program's ``dpre`` rows, just stored, read back (from L2) and written in e4m3 with the scale of
    ``amax``: bitwise :func:`moeblaze.kernels.fp8_quant.quantize_rows_fp8` of the stored rows."""
    scale, inv = _row_scales(amax, s_ptr, rows, store_mask, tiny, QMAX, POW2)
    tl.debug_barrier()  # the stores above reach every thread of the program before the read-back
    rows64 = rows.to(tl.int64)[:, None]
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)[None, :]
        mask = store_mask[:, None] & (cols < H)
        src = dpre_ptr + rows64 * stride_dpre_m + cols * PRE_STEP
        gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        up = gate
        if GATED:
            up = tl.load(src + UP_OFF, mask=mask, other=0.0).to(tl.float32)
        _store_e4m3(q_ptr + rows64 * stride_q_m + cols * PRE_STEP, mask, gate, up, scale, inv, UP_OFF, GATED)


_ACT_BWD = Launchable(act_bwd_rows_kernel, act_bwd_configs, key=["H", "ACTIVATION", "STORE_WACT", "QUANT", "PRE_E4M3"],
                      heuristics={"ROW_WHOLE": lambda a: a["H"] <= a["BLOCK_H"]},
                      restore=["dact_ptr", "pre_ptr", "dpre_ptr"])  # in place: each trial starts afresh


def act_bwd_rows(dact: torch.Tensor, pre: torch.Tensor, dpre: torch.Tensor, scale: torch.Tensor,
                 dtw: torch.Tensor | None, *, h: int, activation: int, store_wact: bool, alpha: float = 0.0,
                 limit: float = 0.0, interleaved: bool = False, local_slots: torch.Tensor | None = None,
                 tf32_dpre: bool = False, quant: tuple[torch.Tensor, torch.Tensor, bool] | None = None,
                 pre_scale: torch.Tensor | None = None, pre_tile: int = 1) -> None:
    """Launch :func:`act_bwd_rows_kernel` (all outputs in place; see the module docstring).

    Args:
        dact: ``[N, h]`` dact' (overwritten with ``w * act`` if ``store_wact``); pre, dpre: ``[N, 2h|h]``
            (may be one tensor); scale: ``[N]`` fp32 slot weights; dtw: ``[N]`` fp32 or None.
        pre_scale: ``pre`` is e4m3 in ``1 x pre_tile`` tiles per half (:meth:`moeblaze.fp8.Float8Recipe.
            quantize_kept`; ``pre_tile`` a power of two), these their ``[N, 2|1, cdiv(h, pre_tile)]`` fp32 scales,
            contiguous; ``dpre`` is then another tensor (its dtype); or None.
        All with unit column stride (checked by the callers).
        alpha, limit: the clamped SwiGLU's parameters. interleaved: gated ``pre`` alternates gate, up.
        local_slots: ``[1]`` int32 on the device, rows at or past it are skipped (foreign slots; the first
            ``ZERO_TAIL`` of them get zeros), or None.
        tf32_dpre: store ``dpre`` rounded to TF32 (fp32 ``dpre`` only).
        quant: ``(data [N, 2h|h] e4m3 contiguous, scale [N] fp32, pow2)``: also write ``dpre`` quantized with one
            scale per row (the rowwise FP8 recipe, bitwise :func:`moeblaze.kernels.fp8_quant.quantize_rows_fp8` of
            the stored rows; module docstring), or None. Rows skipped as foreign are not written.
    """
    N = dact.shape[0]
    if N == 0 or h == 0:
        return
    out = dtw if dtw is not None else scale
    limit_t = local_slots if local_slots is not None else scale  # dummy pointer when HAS_LIMIT is off
    q_data, q_scale, pow2 = quant if quant is not None else (dpre, scale, False)  # dummies when QUANT is off
    _ACT_BWD.launch(dact.dtype, lambda meta: (cdiv(N, meta["BLOCK_R"]),),
        dact_ptr=dact, pre_ptr=pre, pre_s_ptr=pre_scale if pre_scale is not None else scale, dpre_ptr=dpre,
        scale_ptr=scale, dtw_ptr=out, limit_ptr=limit_t,
        dpre_q_ptr=q_data, dpre_s_ptr=q_scale, N=N, H=h, UP_OFF=1 if interleaved else h, alpha=float(alpha),
        limit=float(limit), stride_dact_m=dact.stride(0), stride_pre_m=pre.stride(0), stride_dpre_m=dpre.stride(0),
        stride_q_m=q_data.stride(0), tiny=SCALE_FLOOR, ACTIVATION=activation, STORE_PART=dtw is not None,
        STORE_WACT=store_wact, PRE_STEP=2 if interleaved else 1, HAS_LIMIT=local_slots is not None,
        TF32_DPRE=tf32_dpre, QUANT=quant is not None, POW2=pow2, PRE_E4M3=pre_scale is not None, PRE_TILE=pre_tile,
        QMAX=E4M3_MAX,
    )
