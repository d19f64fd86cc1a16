"""Launchers of the expert kernels: validate, allocate, compute the grid, launch (DESIGN.md §5).

No launcher reads device data on the host: the M-tile schedule comes with the index
(:class:`moeblaze.dispatch.TileSchedule`, written by the dispatch build), and grids are sized by its
static length (``cdiv(N, BLOCK_M) + E`` M-tiles; programs past ``num_tiles`` exit at once).
"""

from __future__ import annotations

import torch
import triton

from ..fp8 import KEPT_TILE
from . import direct, tuning
from .act_bwd import ZERO_TAIL
from .grouped_gemm import (
    B_DESC_KN,
    B_DESC_NK,
    B_DESC_NONE,
    B_DESC_PAIRED,
    EPILOGUE_ACT_FWD,
    EPILOGUE_PLAIN,
    PRE_16BIT,
    PRE_E4M3,
    PRE_E4M3_POW2,
    grouped_gemm_kernel,
)
from .tf32 import padded_slot_rows, round_tf32, tf32_copy
from .tma import rows_aligned, rows_tma_ok, tma_desc
from .tuning import (
    Launchable,
    cdiv,
    gemm_configs,
    next_pow2,
    num_programs,
    prune_fp32_tiles,
    prune_gemm_configs,
    tokens_bucket,
    wgrad_configs,
)
from .wgrad import SLOT_PAD, grouped_wgrad_kernel

# DOT_PREC in the keys: fp32 at TF32 and at IEEE precision are tuned apart (different best tiles).
_GEMM_KEY = ["N_COLS", "K_DIM", "NUM_EXPERTS", "EPILOGUE", "GATHER_A", "SCATTER_C", "DUAL", "A_DESC", "B_DESC",
             "DOT_PREC", "PRE_FP8", "BLOCK_M"]  # BLOCK_M: the token-count bucket (tuning.block_m)
_EVEN = {"EVEN_K": lambda a: a["K_DIM"] % a["BLOCK_K"] == 0, "EVEN_N": lambda a: a["N_COLS"] % a["BLOCK_N"] == 0}
# the token-count bucket of the tuning key: max_tiles = cdiv(N, BLOCK_M) + E bounds N from above by a tile per expert
_GEMM = Launchable(grouped_gemm_kernel, gemm_configs, key=_GEMM_KEY, heuristics=_EVEN, prune=prune_gemm_configs,
                   variant=lambda: tuning._gemm_launch(),
                   bucket=lambda a: tokens_bucket((a["max_tiles"] - a["NUM_EXPERTS"]) * a["BLOCK_M"], a["NUM_EXPERTS"]))
_WGRAD = Launchable(grouped_wgrad_kernel, wgrad_configs, prune=prune_fp32_tiles,
                    key=["P", "Q", "NUM_EXPERTS", "stride_c_p", "GATHER_A", "B_DESC", "DOT_PREC"],
                    variant=lambda: tuning._wgrad_launch(), bucket=lambda a: tokens_bucket(a["ROWS"], a["NUM_EXPERTS"]))
# Every BLOCK_K of gemm_configs divides this: a K_DIM multiple of it never reads past an expert (B_DESC_KN).
_K_QUANTUM = 64


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision``: fp32 operands follow ``torch.get_float32_matmul_precision()`` as
    ``torch.matmul`` does on CUDA — ``"highest"``: IEEE fp32 products; ``"high"``/``"medium"`` (that is,
    ``torch.backends.cuda.matmul.allow_tf32``): TF32 tensor cores. 16-bit operands ignore it ("tf32").
    Read at each launch; the value is a constexpr of the kernels and part of their autotune key, so each
    precision compiles and tunes its own variant."""
    if dtype != torch.float32:
        return "tf32"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def rounds_tf32(a: torch.Tensor) -> bool:
    """fp32 operands of a TF32 GEMM on the GPU (the interpreter's dot is exact fp32: nothing to round)."""
    return a.dtype == torch.float32 and a.is_cuda and dot_precision(a.dtype) == "tf32"


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for the TMA descriptors a kernel builds on the device (128 bytes per program)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _slot_rows_desc(t: torch.Tensor, gathered: bool) -> bool:
    """An activation operand ``t [rows, cols]`` is read through a TMA descriptor: not gathered (its rows are
    slots, in order), unit column stride, TMA enabled and aligned rows."""
    return not gathered and tuning.tma_enabled(t.device) and rows_aligned(t)


def b_desc_mode(b: torch.Tensor, b_nk: bool, k_dim: int, paired: bool = False) -> int:
    """How :func:`grouped_gemm_kernel` reads the weight ``b [E, *, *]`` (the ``.value`` of a ``B_DESC_*``
    constant of :mod:`moeblaze.kernels.grouped_gemm`): ``B_DESC_NONE`` pointers, ``B_DESC_NK`` a TMA
    descriptor over rows stored ``[E*n, k]``, ``B_DESC_KN`` over rows stored ``[E*k, n]``, ``B_DESC_PAIRED``
    as NK with the gate and up rows of a tile in one box (``paired``: the gated F1, up rows starting at half
    of ``b``'s n extent).

    TMA needs an sm90+ GPU or the interpreter (:func:`moeblaze.kernels.tuning.tma_enabled`), a unit-stride last
    storage dimension with experts packed back to back (``stride_e = rows * row_stride``), 16-byte alignment,
    and for ``B_DESC_KN`` a ``k_dim`` multiple of 64 (tiles never run into the next expert's rows along k).
    """
    if not tuning.tma_enabled(b.device):
        return B_DESC_NONE.value
    for dim in (2, 1):  # the unit-stride dimension is the descriptor's column
        other = 3 - dim
        if b.stride(dim) == 1 and b.stride(0) == b.shape[other] * b.stride(other) and rows_tma_ok(b, b.stride(other)):
            rows_are_n = b_nk == (other == 1)  # b[e] is [n, k] when b_nk
            if rows_are_n:
                return B_DESC_PAIRED.value if paired else B_DESC_NK.value
            return B_DESC_KN.value if k_dim % _K_QUANTUM == 0 else B_DESC_NONE.value
    return B_DESC_NONE.value


def interleaved_desc_ok(w1: torch.Tensor, k_dim: int) -> bool:
    """An interleaved ``w_gate_up [E, 2h, d]`` view can be read through a ``B_DESC_INTERLEAVED`` descriptor: its storage
    is ``[E, d, 2h]`` packed (GPT-OSS's ``gate_up_proj``), 16-byte aligned, ``d`` a multiple of 64 (k tiles
    never run into the next expert's rows), TMA enabled."""
    return (tuning.tma_enabled(w1.device) and w1.stride(1) == 1 and w1.stride(0) == w1.shape[2] * w1.stride(2)
            and rows_tma_ok(w1, w1.stride(2)) and k_dim % _K_QUANTUM == 0)


def _tiles_grid(tiles, device: torch.device):
    """The grid of a launch of ``tiles(meta)`` output tiles: one program per tile, or for a ``PERSISTENT`` config
    (a config choice) at most one per SM, each walking its tiles."""
    programs = num_programs(device)

    def grid(meta):
        n = tiles(meta)
        return (min(n, programs) if meta["PERSISTENT"] else n,)

    return grid


def _check_chunk(b, b_nk: bool, n_start: int, n_cols: int, epilogue: int, other_weights: bool) -> None:
    n_ext = b.shape[1 if b_nk else 2]
    if epilogue != EPILOGUE_PLAIN.value or other_weights:
        raise ValueError("grouped_gemm: n_start serves the plain epilogue of a single weight only")
    if n_start < 0 or n_start % 16 or n_start + n_cols > n_ext:  # 16 columns: a 16-byte aligned base in any dtype
        raise ValueError(f"grouped_gemm: columns {n_start}..{n_start + n_cols} of a weight with n extent {n_ext}; "
                         "n_start must be a multiple of 16 inside it")


def _from_column(b, b_nk: bool, b_mode: int, n_ext: int, E: int, n_start: int):
    """``(b, N_EXT, B_ROWS)`` of a launch whose output column 0 is the weight's column ``n_start``: ``b`` from that
    column on; NK: rows ``e * n_ext + n`` from the new base, so the extent stays and the descriptor's rows end
    ``n_start`` sooner (where the weight ends); KN: the descriptor's column extent from the new base."""
    b_rows = E * n_ext
    if n_start:
        b = b[:, n_start:] if b_nk else b[:, :, n_start:]
        if b_mode == B_DESC_NK.value:
            b_rows -= n_start
        else:
            n_ext -= n_start
    return b, n_ext, b_rows


def _check_fp8(a, b, b_nk: bool, a_scale, b_scale, E: int) -> None:
    """e4m3 operands of :func:`grouped_gemm`: the weight e4m3 too, stored K-major, with rowwise fp32 scales."""
    if b.dtype != a.dtype or not b_nk or b.stride(2) != 1:
        raise ValueError(f"grouped_gemm: an e4m3 a needs an e4m3 weight stored [E, n, k] with unit stride along k "
                         f"(b_nk), got {b.dtype} strides {b.stride()} b_nk={b_nk}")
    shapes = (("a_scale", a_scale, (a.shape[0],)), ("b_scale", b_scale, (E, b.shape[1])))
    for name, t, shape in shapes:
        if t is None or t.dtype != torch.float32 or tuple(t.shape) != shape or t.stride(-1) != 1:
            raise ValueError(f"grouped_gemm: e4m3 operands need {name} fp32 {shape} with unit last stride, got "
                             f"{None if t is None else (t.dtype, tuple(t.shape), t.stride())}")


def _check_pre_fp8(c, aux, pre_scale, n_cols, dual, pre_step, epilogue, store_pre, store_aux) -> None:
    """F1 writing ``pre`` in e4m3 tiles: ``c`` e4m3 ``[N, 2h|h]``, ``act`` in 16 bits beside it, ``pre_scale`` as
    :func:`grouped_gemm` says."""
    shape = (c.shape[0], 2 if dual else 1, cdiv(n_cols, KEPT_TILE))
    if (epilogue != EPILOGUE_ACT_FWD.value or not (store_pre and store_aux) or pre_step != 1
            or c.dtype != torch.float8_e4m3fn or aux is None or aux.dtype == c.dtype):
        raise ValueError("grouped_gemm: pre_scale is F1's e4m3 pre (EPILOGUE_ACT_FWD, pre and act stored, gate and up "
                         f"in blocks): got epilogue {epilogue}, pre {c.dtype}, act {None if aux is None else aux.dtype}, "
                         f"pre_step {pre_step}")
    if pre_scale.dtype != torch.float32 or tuple(pre_scale.shape) != shape or not pre_scale.is_contiguous():
        raise ValueError(f"grouped_gemm: pre_scale must be fp32 {shape} contiguous, got {pre_scale.dtype} "
                         f"{tuple(pre_scale.shape)} (contiguous: {pre_scale.is_contiguous()})")


def _tf32_operands(a, b, b_nk: bool, n_start: int | None, n_cols: int, a_tf32: bool, b_kept: bool):
    """The TF32 operands of a launch (kernels/tf32.py): ``a`` rounded (a copy unless ``a_tf32``: its producer
    rounded it), a weight read along n copied K-major (B1, B3: ``[E, k, n]`` -> ``[E, n, k]``) unless ``b_kept``
    (paired, shifted or forced layouts), else rounded; a column chunk's weight cut to its columns first, so the
    copy is of them alone. Returns ``(a, b, b_nk, n_start)`` (``n_start`` None after a cut)."""
    if n_start is not None:
        b = b[:, n_start:n_start + n_cols] if b_nk else b[:, :, n_start:n_start + n_cols]
        n_start = None
    a = a if a_tf32 else tf32_copy(a)
    if not b_nk and not b_kept:
        return a, tf32_copy(b, transpose=True), True, n_start
    return a, round_tf32(b), b_nk, n_start


def _up_ws_launched(a, b, c, aux, pre_scale, a_scale, b_scale, offsets, indices, sched, *, n_cols: int, k_dim: int,
                    activation: int, alpha: float, limit: float, pre_pow2: bool) -> bool:
    """Launch F1 of the FP8 layer (a launch of that shape: gathered, paired weight halves, one chunk) on the
    warp-specialized Gluon kernel (:mod:`.fp8_ws_up`) where it runs and pays; False where it does not."""
    if not tuning.ws_enabled(a.device):
        return False
    from .fp8_ws_up import launch_ws_up, ws_up_ok  # the module imports Gluon: only where it can run

    # fp8_ws_up.CONFIG's 64-column tiles
    if not ws_up_ok(a, b, c, aux) or not _ws_gemm_pays(sched[0].numel(), n_cols, a.device, KEPT_TILE):
        return False
    launch_ws_up(a, b, c, aux, pre_scale, a_scale, b_scale, offsets, indices, sched, n_cols, k_dim,
                 activation, alpha, limit, pre_pow2)
    return True


def grouped_gemm(a, b, c, offsets, indices, sched, *, b_nk, n_cols, k_dim, gather_a, up_off=0,
                 scatter_c=False, scale=None, epilogue=EPILOGUE_PLAIN.value, activation=0, dual=False, store_pre=False,
                 aux=None, store_aux=False, bias=None, pre_step=1, up_shift_b=None, alpha=0.0, limit=0.0,
                 weight_desc=True, b_mode=None, a_tf32=False, n_start=None, a_scale=None, b_scale=None,
                 pre_scale=None, pre_pow2=False):
    """Launch :func:`grouped_gemm_kernel` (see its module for the epilogues).

    ``epilogue``: the ``.value`` of ``EPILOGUE_PLAIN`` or ``EPILOGUE_ACT_FWD`` (:mod:`.grouped_gemm`).

    ``bias``: ``[E, cols]`` expert bias with unit column stride, added in the epilogue (None: off).
    ``pre_step``/``up_off``: F1's column layout of ``pre`` (1, h: blocks; 2, 1: interleaved gate/up).
    ``up_shift_b``: element offset of the up rows from the gate rows of ``b`` (default ``up_off`` rows).
    ``alpha``/``limit``: the clamped SwiGLU's parameters. ``weight_desc=False`` forces pointer loads of ``b``
    (a strided view whose gate and up rows a descriptor cannot pair); ``b_mode`` forces a ``B_DESC`` mode
    (``B_DESC_INTERLEAVED.value``: an interleaved ``w_gate_up``, see :func:`interleaved_desc_ok`).
    ``a_tf32``: ``a`` already holds TF32 values (its producer rounded them): a TF32 GEMM reads it as it is,
    no rounded copy (F2 on F1's ``act``, B3 on the activation backward's ``dpre``). The act epilogue stores
    ``act`` rounded whenever its GEMM runs TF32 (``TF32_ACT`` of the kernel).

    ``n_start`` (a column chunk; None: not one): compute output columns ``n_start .. n_start + n_cols`` of ``b``'s
    n extent into ``c``'s columns ``0 .. n_cols``; the whole weight is passed and read in place, through its TMA
    descriptor where it has one (plain epilogue of one weight only; ``bias`` is then the chunk's columns).

    ``a [rows, k_dim]`` (``gather_a``: rows are tokens; else slots, read through a TMA descriptor where
    :func:`.tuning.tma_enabled` and its rows are 16-byte aligned), ``b`` a weight ``[E, n, k]`` (``b_nk``) or
    ``[E, k, n]`` read as ``B[e][k, n]``, ``c`` the main output (unit stride along columns).
    ``aux``/``scale``: see the kernel; outputs are written in place.
    ``a_scale``/``b_scale`` (e4m3 ``a`` and ``b``, the rowwise FP8 recipe): ``[rows of a]`` and ``[E, n]`` fp32
    dequantization scales, ``b`` stored ``[E, n, k]`` (``b_nk``, K-major as the e4m3 tensor cores read it).
    ``pre_scale`` (F1 of the FP8 layer: ``c`` is ``pre`` in e4m3, ``aux`` ``act`` in 16 bits): ``[N, 2|1,
    cdiv(n_cols, KEPT_TILE)]`` fp32, contiguous, the scales of ``pre``'s ``1 x KEPT_TILE`` tiles per half
    (:meth:`moeblaze.fp8.Float8Recipe.quantize_kept`), written by the epilogue (``PRE_FP8``; ``pre_pow2``: powers of
    two).
    ``sched``: ``(tile_expert, tile_row_start, num_tiles)`` of a tile schedule for ``block_m(N, E)`` (N slots,
    E local experts: ``indices``, ``offsets``).

    Raises:
        ValueError: a tile schedule of another BLOCK_M; ``n_start`` out of the weight's n extent, not a multiple of
            16, or with another epilogue than the plain one of a single weight; e4m3 operands without their scales
            or with a weight not stored K-major.
    """
    N = indices.numel()
    E = offsets.numel() - 1
    fp8 = a.dtype == torch.float8_e4m3fn
    if fp8:
        _check_fp8(a, b, b_nk, a_scale, b_scale, E)
    if pre_scale is not None:
        _check_pre_fp8(c, aux, pre_scale, n_cols, dual, pre_step, epilogue, store_pre, store_aux)
    if N == 0 or n_cols == 0:
        return
    tf32 = rounds_tf32(a)
    if n_start is not None:
        _check_chunk(b, b_nk, n_start, n_cols, epilogue, dual or up_shift_b is not None or b_mode is not None)
    if tf32:
        a, b, b_nk, n_start = _tf32_operands(a, b, b_nk, n_start, n_cols, a_tf32, b_kept=dual or up_shift_b is not None
                                             or b_mode is not None or not weight_desc)
    bm = tuning.block_m(N, E)  # the plan's M tile (the schedule was built for it): checked, not chosen anew
    max_tiles = sched[0].numel()
    if max_tiles != cdiv(N, bm) + E:
        raise ValueError(f"grouped_gemm: the tile schedule has {max_tiles} entries; expected one for BLOCK_M={bm}")
    plain = (epilogue == EPILOGUE_PLAIN.value and not (scatter_c or dual or tf32) and scale is None and bias is None
             and aux is None and up_shift_b is None and b_mode is None and weight_desc)
    ws = plain and bm == WS_GEMM_CONFIG["BLOCK_M"] and ws_gemm_ok(a, b, c, b_nk, k_dim, gather_a)
    if ws and (fp8 or _ws_gemm_pays(max_tiles, n_cols, a.device, WS_GEMM_CONFIG["BLOCK_N"])):
        grouped_gemm_ws(a, b, c, offsets, sched, b_nk=b_nk, n_cols=n_cols, k_dim=k_dim, n_start=n_start or 0,
                        a_scale=a_scale, b_scale=b_scale, indices=indices if gather_a else None)
        return
    up_ws = (pre_scale is not None and gather_a and dual and n_start is None and bias is None and up_shift_b is None
             and b_mode is None and weight_desc and 2 * up_off == b.shape[1] and bm == WS_GEMM_CONFIG["BLOCK_M"])
    if up_ws and _up_ws_launched(a, b, c, aux, pre_scale, a_scale, b_scale, offsets, indices, sched, n_cols=n_cols,
                                 k_dim=k_dim, activation=activation, alpha=alpha, limit=limit, pre_pow2=pre_pow2):
        return
    aux = aux if aux is not None else c
    scale_c = scale is not None
    scale = scale if scale is not None else (pre_scale if pre_scale is not None else offsets)
    n_dim, k_dim_b = (1, 2) if b_nk else (2, 1)
    n_ext = b.shape[n_dim]
    b_strides = (b.stride(0), b.stride(k_dim_b), b.stride(n_dim))
    if b_mode is None:
        b_mode = b_desc_mode(b, b_nk, k_dim, paired=dual and 2 * up_off == n_ext) if weight_desc else B_DESC_NONE.value
    b, n_ext, b_rows = _from_column(b, b_nk, b_mode, n_ext, E, n_start or 0)
    if fp8:
        b_scale = b_scale[:, n_start or 0:]
    else:  # dummy pointers while FP8 is off
        a_scale = b_scale = offsets
    up_shift_b = up_off * b_strides[2] if up_shift_b is None else up_shift_b
    bias_t = bias if bias is not None else offsets  # dummy pointer when HAS_BIAS is off
    a_desc = _slot_rows_desc(a, gather_a)
    if b_mode != B_DESC_NONE.value or a_desc:
        triton.set_allocator(_scratch)
    grid = _tiles_grid(lambda meta: max_tiles * cdiv(n_cols, meta["BLOCK_N"]), a.device)
    _GEMM.launch(a.dtype, grid,
        a_ptr=a, b_ptr=b, c_ptr=c, aux_ptr=aux, scale_ptr=scale, bias_ptr=bias_t, a_scale_ptr=a_scale,
        b_scale_ptr=b_scale, offsets_ptr=offsets,
        indices_ptr=indices, tile_expert_ptr=sched[0], tile_row_ptr=sched[1], num_tiles_ptr=sched[2],
        max_tiles=max_tiles, N_COLS=n_cols, K_DIM=k_dim, N_EXT=n_ext, B_ROWS=b_rows, A_ROWS=a.shape[0], UP_OFF=up_off,
        UP_SHIFT_B=up_shift_b, alpha=float(alpha), limit=float(limit),
        stride_a_m=a.stride(0), stride_a_k=a.stride(1), stride_b_e=b_strides[0], stride_b_k=b_strides[1],
        stride_b_n=b_strides[2], stride_c_m=c.stride(0), stride_aux_m=aux.stride(0), stride_bias_e=bias_t.stride(0),
        stride_bs_e=b_scale.stride(0), NUM_EXPERTS=E,
        GATHER_A=gather_a, SCATTER_C=scatter_c, SCALE_C=scale_c, EPILOGUE=epilogue,
        ACTIVATION=activation, DUAL=dual, STORE_PRE=store_pre, STORE_AUX=store_aux, HAS_BIAS=bias is not None,
        PRE_STEP=pre_step, TF32_ACT=tf32 and epilogue != EPILOGUE_PLAIN.value, FP8=fp8,
        PRE_FP8=(PRE_16BIT if pre_scale is None else PRE_E4M3_POW2 if pre_pow2 else PRE_E4M3).value,
        A_DESC=a_desc, B_DESC=b_mode,
        DOT_PREC=dot_precision(a.dtype), BLOCK_M=bm,
    )


def grouped_wgrad(a, b, offsets, indices, *, p, q, out_dtype, transpose=False, slot_desc=True, zero_tail=False,
                  k_major=None):
    """Launch :func:`grouped_wgrad_kernel`: ``dW[e] = sum_s a[token(s)]^T b[s]`` in ``out_dtype``.

    ``a [T, p]`` (rows read through ``indices``), ``b [N, q]`` slot rows (through a TMA descriptor where
    :func:`.tuning.tma_enabled` and its rows are 16-byte aligned), both with unit column stride. Returns
    ``[E, p, q]``, or ``[E, q, p]`` (the transposed products, stored through swapped strides) if ``transpose``.
    ``slot_desc=False`` reads ``b`` through clamped pointers: its rows past the last expert are never read
    (they hold foreign slots, never computed, whose garbage times A's zeros could be NaN). ``zero_tail``: those
    rows are foreign but the first ``act_bwd.ZERO_TAIL`` of them hold zeros (the activation backward wrote them),
    which is all the warp-specialized kernel's whole TMA boxes read of them.
    ``k_major`` (default: fp32 operands of a TF32 GEMM on the GPU): read TF32-rounded copies of both operands,
    gathered into per-expert padded slot order with the slots contiguous (``GATHER_A=False`` of the kernel).
    """
    E = offsets.numel() - 1
    shape = (E, q, p) if transpose else (E, p, q)
    if indices.numel() == 0 or p == 0 or q == 0:
        return torch.zeros(shape, dtype=out_dtype, device=a.device)
    out = torch.empty(shape, dtype=out_dtype, device=a.device)
    if k_major is None and (slot_desc or zero_tail) and ws_wgrad_ok(a, b, out_dtype):
        grouped_wgrad_ws(a, b, out, offsets, indices, gather_a=not transpose)
        return out
    stride_c_p, stride_c_q = (out.stride(2), out.stride(1)) if transpose else (out.stride(1), out.stride(2))
    gather_a = not (rounds_tf32(a) if k_major is None else k_major)
    if gather_a:
        a_strides, b_strides = (a.stride(0), a.stride(1)), (b.stride(0), b.stride(1))
    else:  # TF32: both operands gathered into padded slot order, rounded, stored slots-contiguous (K-major)
        N = indices.numel()
        offsets, rows_a, rows_b = padded_slot_rows(offsets, N, SLOT_PAD.value, indices,
                                                   torch.arange(N, device=a.device))
        a, b = tf32_copy(a, rows=rows_a, transpose=True), tf32_copy(b, rows=rows_b, transpose=True)  # [p|q, Npad]
        a_strides, b_strides = (1, a.stride(0)), (1, b.stride(0))
    b_desc = gather_a and slot_desc and _slot_rows_desc(b, False)
    if b_desc:
        triton.set_allocator(_scratch)
    grid = _tiles_grid(lambda meta: E * cdiv(p, meta["BLOCK_P"]) * cdiv(q, meta["BLOCK_Q"]), a.device)
    _WGRAD.launch(a.dtype, grid,
        a_ptr=a, b_ptr=b, c_ptr=out, offsets_ptr=offsets, indices_ptr=indices, P=p, Q=q, ROWS=indices.numel(),
        stride_a_m=a_strides[0], stride_a_p=a_strides[1], stride_b_m=b_strides[0], stride_b_q=b_strides[1],
        stride_c_e=out.stride(0), stride_c_p=stride_c_p, stride_c_q=stride_c_q,
        NUM_EXPERTS=E,
        GATHER_A=gather_a, B_DESC=b_desc, DOT_PREC=dot_precision(a.dtype), E_POW2=next_pow2(E),
    )
    return out


# The warp-specialized weight gradient's configuration: a 128 x 256 output tile (the wgmma shape of the Triton
# kernels' best tiles), 64 slots per step in 3 stages (3 x 48 KiB) plus the 64 KiB output tile: 208 KiB of
# shared memory, one CTA per SM.
# TMA_STORE: whole 16-bit tiles leave by TMA where ws_wgrad_tma_store allows (masked stores ran at 0.96-1.005x
# its speed on an H200: docs/benchmarks.md, ``benchmarks/bench_ws.py --masked-store``).
WS_WGRAD_CONFIG = {"BLOCK_P": 128, "BLOCK_Q": 256, "BLOCK_K": 64, "NUM_STAGES": 3, "GROUP_M": 8, "TMA_STORE": True}
assert WS_WGRAD_CONFIG["BLOCK_K"] <= ZERO_TAIL.value  # a box reads at most BLOCK_K - 1 rows past its expert


def ws_wgrad_ok(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """:func:`grouped_wgrad_ws` can serve ``grouped_wgrad(a, b, ...)``: :func:`.tuning.ws_enabled`, 16-bit operands of
    one dtype, an output in that dtype or fp32, aligned contiguous rows and ``a``'s width a multiple of 16
    (its masked columns then go as whole 16-byte copies)."""
    if a.dtype not in (torch.float16, torch.bfloat16) or b.dtype != a.dtype or out_dtype not in (a.dtype, torch.float32):
        return False
    return tuning.ws_enabled(a.device) and a.shape[1] % 16 == 0 and rows_aligned(a) and rows_aligned(b)


def ws_wgrad_tma_store(out: torch.Tensor, operand_dtype: torch.dtype, block_p: int) -> bool:
    """The warp-specialized weight gradient stores whole tiles of ``out [E, P, Q]`` by TMA: ``out`` in the operands'
    dtype (the tile leaves shared memory as it is), contiguous and 16-byte aligned, ``P % block_p == 0`` (a tile's
    box never reaches the next expert's rows)."""
    E, P, Q = out.shape
    return out.dtype == operand_dtype and out.is_contiguous() and P % block_p == 0 and rows_aligned(out.view(E * P, Q))


def grouped_wgrad_ws(a, b, out, offsets, indices, *, gather_a: bool, config: dict | None = None) -> None:
    """Launch :func:`moeblaze.kernels.ws_wgrad.ws_wgrad_kernel` into ``out`` (check :func:`ws_wgrad_ok` first):
    ``out[e] = sum_s a[token(s)]^T b[s]`` (``[E, p, q]``, ``gather_a``) or its transpose ``sum_s b[s]^T a[token(s)]``
    (``[E, q, p]``), contiguous. ``config``: overrides of :data:`WS_WGRAD_CONFIG` (block-size sweeps;
    ``TMA_STORE=False``: masked stores). Whole tiles leave by TMA where :func:`ws_wgrad_tma_store` allows."""
    from .ws_wgrad import MAX_REGS, ws_wgrad_kernel

    cfg = {**WS_WGRAD_CONFIG, **(config or {})}
    E, P, Q = out.shape
    desc = tma_desc(b, [cfg["BLOCK_K"], cfg["BLOCK_Q"] if gather_a else cfg["BLOCK_P"]])
    cfg["TMA_STORE"] = cfg["TMA_STORE"] and ws_wgrad_tma_store(out, a.dtype, cfg["BLOCK_P"])
    c_desc = tma_desc(out.view(E * P, Q), [cfg["BLOCK_P"], 64]) if cfg["TMA_STORE"] else None
    tiles = E * cdiv(P, cfg["BLOCK_P"]) * cdiv(Q, cfg["BLOCK_Q"])
    direct.launch(ws_wgrad_kernel, (min(tiles, num_programs(a.device)),),
        g_ptr=a, r_desc=desc, c_ptr=out, c_desc=c_desc, offsets_ptr=offsets, indices_ptr=indices, P=P, Q=Q,
        NUM_EXPERTS=E, stride_g_t=a.stride(0), stride_c_e=out.stride(0), stride_c_p=out.stride(1),
        GATHER_A=gather_a, **cfg, num_warps=8, maxnreg=MAX_REGS,
    )


# The warp-specialized GEMM's configuration: the 128 x 256 tile and 64-column steps of the Triton kernels' best
# configs, 3 stages (3 x 48 KiB) plus the 64 KiB output tile. BLOCK_M: it runs schedules of the large M tile only.
WS_GEMM_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "NUM_STAGES": 3, "GROUP_M": 8}
# Its FP8 form (kernels/fp8_ws_gemm.py): a 128 x 256 tile, two warp groups of 64 rows each holding two 64 x 128 fp32
# accumulators and one partial sum (192 registers per thread); 128-column steps, the promotion interval of the
# e4m3 sums (DeepSeek-V3 §3.3.2); 3 stages (3 x 48 KiB) plus the 64 KiB output tile.
WS_GEMM_FP8_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "NUM_STAGES": 3, "GROUP_M": 8}


def _ws_gemm_pays(max_tiles: int, n_cols: int, device: torch.device, block_n: int = WS_GEMM_CONFIG["BLOCK_N"]) -> bool:
    """The 16-bit warp-specialized GEMM gets at least 12 output tiles per SM (the FP8 one runs at any count: against
    the Triton FP8 kernel its F2, B1 and B3 took 0.73-0.80x the time at 2k-8k tokens of Qwen3-30B-A3B and
    OLMoE-1B-7B, 1-5 of its tiles per SM; H200, ``python3 benchmarks/bench_ws.py --fp8 --shapes
    2048:2048:768:128:8,...``, rows in docs/results-ws.csv).

    Why: persistent, it needs several tiles per CTA to overlap a tile's store with the next one's MMAs, and each of
    its launches builds two host TMA descriptors (more host time than a Triton launch). Against the Triton kernel
    (H200, CUDA-graph replay, ``python3 benchmarks/bench_ws.py``, rows in docs/results-ws.csv) F2 and B3
    took 0.94-0.98x its time at 8k-32k tokens of Qwen3-30B-A3B (14-50 tiles per SM), 0.96-0.99x at 2k (6 per SM)
    and, timed the same way in an earlier run, 1.14-1.15x at 1,500 tokens of (d 512, h 320, E 16, K 2) (0.3 per
    SM). At 2k-4k tokens the eager layer step is bound by host time (2.3-3.7 ms per layer step on H200s,
    ``benchmarks/bench_host.py``), where a GPU gain of 1-4% of F2 and B3 is worth less than the launches' host time.
    """
    return max_tiles * cdiv(n_cols, block_n) >= 12 * num_programs(device)


def ws_gemm_ok(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, b_nk: bool, k_dim: int,
               gather_a: bool = False) -> bool:
    """:func:`grouped_gemm_ws` can serve a plain slot-row GEMM ``c = a @ b[e]``: :func:`.tuning.ws_enabled`,
    16-bit operands and output of one dtype (or e4m3 operands, a weight ``[E, n, k]`` and a 16-bit output; only
    these with ``gather_a``, rows of ``a`` gathered by token), a contiguous weight ``[E, n, k]`` (``b_nk``) or
    ``[E, k, n]``, ``k_dim`` a multiple of 64 (whole TMA boxes along k, never into the next expert's weight) and
    aligned rows."""
    if gather_a and a.dtype != torch.float8_e4m3fn:
        return False
    if a.dtype == torch.float8_e4m3fn:
        if not b_nk or b.dtype != a.dtype or c.dtype not in (torch.float16, torch.bfloat16):
            return False
    elif a.dtype not in (torch.float16, torch.bfloat16) or not (b.dtype == c.dtype == a.dtype):
        return False
    if not tuning.ws_enabled(a.device) or k_dim % 64 or a.shape[1] != k_dim or not b.is_contiguous():
        return False
    return b.shape[2 if b_nk else 1] == k_dim and rows_aligned(a) and rows_aligned(b[0]) and c.stride(1) == 1


def grouped_gemm_ws(a, b, c, offsets, sched, *, b_nk: bool, n_cols: int, k_dim: int, n_start: int = 0,
                    config: dict | None = None, a_scale=None, b_scale=None, indices=None) -> None:
    """Launch :func:`moeblaze.kernels.ws_gemm.ws_gemm_kernel` (check :func:`ws_gemm_ok` first): ``c[s, :n_cols] =
    a[s] @ W[e][:, n_start:n_start + n_cols]`` over the tile schedule ``sched`` of ``BLOCK_M`` (128) rows; e4m3
    ``a`` and ``b`` with their rowwise scales ``a_scale [rows]`` and ``b_scale [E, n]`` (:func:`_check_fp8`) on
    :func:`moeblaze.kernels.fp8_ws_gemm.fp8_ws_gemm_kernel`, there with ``indices`` (the slots' tokens) rows
    ``a[indices[s]]`` gathered. ``config``: overrides of :data:`WS_GEMM_CONFIG` or :data:`WS_GEMM_FP8_CONFIG`
    (block-size sweeps; the FP8 kernel's tile is 256 columns wide, two wgmma widths)."""
    fp8 = a.dtype == torch.float8_e4m3fn
    cfg = {**(WS_GEMM_FP8_CONFIG if fp8 else WS_GEMM_CONFIG), **(config or {})}
    E, n_ext = b.shape[0], b.shape[1 if b_nk else 2]
    a_desc = None if indices is not None else tma_desc(a, [cfg["BLOCK_M"], cfg["BLOCK_K"]])
    w_box = [cfg["BLOCK_N"], cfg["BLOCK_K"]] if b_nk else [cfg["BLOCK_K"], cfg["BLOCK_N"]]
    w_desc = tma_desc(b.reshape(E * b.shape[1], b.shape[2]), w_box)
    tiles = sched[0].numel() * cdiv(n_cols, cfg["BLOCK_N"])
    if fp8:
        from .fp8_ws_gemm import MAX_REGS as FP8_REGS
        from .fp8_ws_gemm import fp8_ws_gemm_kernel

        gather = indices is not None
        direct.launch(fp8_ws_gemm_kernel, (min(tiles, num_programs(a.device)),),
            a_desc=a_desc, a_ptr=a, w_desc=w_desc, c_ptr=c, a_scale_ptr=a_scale, w_scale_ptr=b_scale,
            offsets_ptr=offsets, indices_ptr=indices if gather else offsets, tile_expert_ptr=sched[0],
            tile_row_ptr=sched[1], num_tiles_ptr=sched[2], A_ROWS=indices.numel() if gather else a.shape[0],
            K_DIM=k_dim, N_COLS=n_cols, N_EXT=n_ext, N_START=n_start, stride_c_m=c.stride(0),
            stride_ws_e=b_scale.stride(0), stride_a_t=a.stride(0), GATHER_A=gather, **cfg, num_warps=4,
            maxnreg=FP8_REGS,
        )
        return
    from .ws_gemm import ws_gemm_kernel
    from .ws_wgrad import MAX_REGS

    direct.launch(ws_gemm_kernel, (min(tiles, num_programs(a.device)),),
        a_desc=a_desc, w_desc=w_desc, c_ptr=c, offsets_ptr=offsets, tile_expert_ptr=sched[0], tile_row_ptr=sched[1],
        num_tiles_ptr=sched[2], K_DIM=k_dim, N_COLS=n_cols, N_EXT=n_ext, N_START=n_start, stride_c_m=c.stride(0),
        W_NK=b_nk, **cfg, num_warps=8, maxnreg=MAX_REGS,
    )
