"""Rowwise e4m3 quantization in one launch: what :meth:`moeblaze.fp8.Float8Recipe.quantize_rows` computes for
the rowwise recipe (:func:`moeblaze.fp8.quantize_fp8` with ``(1, C)`` tiles), bit for bit on a GPU.

Each program takes ``BLOCK_R`` rows. It finds each row's largest magnitude (NaN propagated), the scale follows
the recipe's rule (``amax / 448``; 1 for a row of zeros; at least the smallest normal fp32; rounded up to a power
of two with ``POW2``, from its bits: a mantissa of zeros is one already), and the row is divided by it with correct
rounding, saturated at +-448 and stored in e4m3. Rows of a power of two up to 8,192 columns are held whole in a
tile of 4,096 elements or more (one read, ``ONE_SWEEP``); other rows take two sweeps over column blocks (the second
from L2). PyTorch's version is five passes over the tensor (abs, amax, division, clamp, cast) and an fp32 copy.

The source is read through its strides, so a weight's transposed view ``w.transpose(1, 2)`` is quantized along
its rows without a transposed copy first (the K-major operand of B1 / B3): rows ``[..., R, C]`` are flattened to
``[L * R, C]`` by the strides of the last two dimensions and of one leading one; there a tile's rows lie side by
side in memory, so its loads run along them.

The tiles are the fastest measured (``benchmarks/bench_fp8_quant.py``, H200, Qwen3-30B-A3B operands; rows in
docs/results-fp8-quant.csv), counted as 3 bytes per element. A row whose length is a power of two is held whole (rows
of 2,048, ``x`` and ``w1``: 3,540-3,980 GB/s); any other length over 256 in 1,024-column tiles of 4 rows (rows of
768, ``act`` and ``w2``, held whole with a quarter of the tile masked: 0.180 ms against 0.207 in 16 x 256 sweeps;
rows of 1,536, ``pre``'s shape, in two sweeps: 0.344 against 0.475). A transposed view in two sweeps of 32 x 128
(``w1^T`` 0.662 ms against 0.813 in 32 x 64 and 0.951 held whole; ``w2^T`` 0.343 against 0.408 held whole). Before
:func:`to_e4m3` took the quotient without a division the kernel was instruction-bound and these tiles lost (the
masked quarter of the 768-column tile cost 2.3x; ``w1^T`` took 0.902 ms at best).

A weight's two copies (its rows for F1 / F2, its transposed view's rows for B1 / B3) read it three times that way:
the transposed view's rows (the weight's columns) are not held whole, so their maxima take a sweep of their own.
:func:`quantize_rows_col_amax` also keeps each column's largest magnitude while the rowwise pass holds the rows
(``COL_AMAX``: per program over ``COL_GROUP`` rows, the partials reduced by ``torch.amax``), and the transposed view
given them (``amax``, ``AMAX_GIVEN``) is read once: the same bytes, a third less read for the pair (figures:
docs/results-fp8-quant.csv, ``benchmarks/bench_fp8_quant.py``).

:func:`dequantize_rows_fp8` is the way back (the rows expert parallelism receives in e4m3): each e4m3 value
times its row's scale in fp32, rounded once to the 16-bit dtype, as :meth:`moeblaze.fp8.Float8Tensor.dequantize`
then ``.to(dtype)``; one read of 1 byte and one write of 2 per element, where PyTorch writes an fp32 copy and a
product first.

Triton's CPU interpreter rounds values below e4m3's smallest normal (2^-6 of the scale) differently from the GPU
and from torch (DESIGN.md §7): there the stored subnormals may differ by one step; scales and normal values
agree exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..fp8 import E4M3, E4M3_MAX, SCALE_FLOOR, Float8Tensor
from . import direct, tuning

__all__ = ["quantize_rows_fp8", "quantize_rows_col_amax", "gives_col_amax", "dequantize_rows_fp8",
           "launch_quantize_rows"]


@triton.jit
def quantize_rows_kernel(
    src_ptr,  # [L, R, C] fp32 / fp16 / bf16, any strides (a 2-D source is L = 1)
    q_ptr,  # [L * R, C] e4m3, contiguous
    scale_ptr,  # [L * R] fp32 dequantization scale of each row
    amax_ptr,  # [L * R] fp32 (AMAX_GIVEN): each row's largest magnitude, found by an earlier pass
    col_ptr,  # [L, cdiv(R, GROUP), C] fp32 out (COL_AMAX): each program's column maxima over its GROUP rows
    R, C, stride_l, stride_r, stride_c,
    tiny,  # the smallest normal fp32: the floor of a nonzero row's scale
    QMAX: tl.constexpr,  # e4m3's largest finite value, 448
    POW2: tl.constexpr,
    ONE_SWEEP: tl.constexpr,  # C <= BLOCK_C: the rows are held whole, read once
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ROUND: tl.constexpr = 0,  # ROUNDS code: an fp32 source read as the values of its 16-bit cast (a master weight)
    GROUP: tl.constexpr = 0,  # rows per program, a multiple of BLOCK_R (0: BLOCK_R)
    COL_AMAX: tl.constexpr = False,  # ONE_SWEEP only: also each column's largest magnitude over the program's rows
    AMAX_GIVEN: tl.constexpr = False,  # two sweeps only: the rows' maxima read from amax_ptr, one sweep left
):
    # program (row group, leading index): GROUP rows of one [R, C] slab, BLOCK_R at a time
    ROWS: tl.constexpr = GROUP if GROUP > 0 else BLOCK_R
    lead = tl.program_id(1)
    cols = tl.arange(0, BLOCK_C)
    if ONE_SWEEP:
        col_max = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)  # COL_AMAX: elementwise, reduced over rows once
        for r0 in range(0, ROWS, BLOCK_R):
            local = tl.program_id(0) * ROWS + r0 + tl.arange(0, BLOCK_R)
            row_ok = local < R
            flat = lead.to(tl.int64) * R + local
            ok = row_ok[:, None] & (cols[None, :] < C)
            v = tl.load(src_ptr + lead.to(tl.int64) * stride_l + local.to(tl.int64)[:, None] * stride_r
                        + cols[None, :] * stride_c, mask=ok, other=0.0)
            v = _as_cast(v, ROUND)
            scale = scale_of(row_amax(v), tiny, QMAX, POW2)
            tl.store(scale_ptr + flat, scale, mask=row_ok)
            tl.store(q_ptr + flat[:, None] * C + cols[None, :], to_e4m3(v, scale[:, None], inverse(scale)[:, None]),
                     mask=ok)
            if COL_AMAX:  # masked lanes hold zeros: they leave a column's maximum as it is
                col_max = nan_max(col_max, tl.abs(v))
        if COL_AMAX:
            group = lead.to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
            tl.store(col_ptr + group * C + cols, tl.reduce(col_max, 0, nan_max), mask=cols < C)
    else:
        local = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = local < R
        base = src_ptr + lead.to(tl.int64) * stride_l + local.to(tl.int64)[:, None] * stride_r
        flat = lead.to(tl.int64) * R + local
        out = q_ptr + flat[:, None] * C
        if AMAX_GIVEN:
            amax = tl.load(amax_ptr + flat, mask=row_ok, other=0.0)
        else:
            amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
            for c0 in range(0, C, BLOCK_C):
                ok = row_ok[:, None] & (cols[None, :] < C - c0)
                v = tl.load(base + (c0 + cols)[None, :] * stride_c, mask=ok, other=0.0)
                v = _as_cast(v, ROUND)
                amax = nan_max(amax, row_amax(v))
        scale = scale_of(amax, tiny, QMAX, POW2)
        tl.store(scale_ptr + flat, scale, mask=row_ok)
        inv = inverse(scale)[:, None]
        for c0 in range(0, C, BLOCK_C):
            ok = row_ok[:, None] & (cols[None, :] < C - c0)
            v = tl.load(base + (c0 + cols)[None, :] * stride_c, mask=ok, other=0.0)
            v = _as_cast(v, ROUND)
            tl.store(out + (c0 + cols)[None, :], to_e4m3(v, scale[:, None], inv), mask=ok)


ROUNDS = {None: 0, torch.bfloat16: 1, torch.float16: 2}  # quantize_rows_kernel's ROUND of a cast to that dtype


@triton.jit
def _as_cast(v, ROUND: tl.constexpr):
    """``v`` in fp32, first rounded to bf16 (``ROUND`` 1) or fp16 (2) to nearest even, as ``Tensor.to`` does: an
    fp32 master weight quantized as its autocast copy would be, without that copy (written and read again, 6 bytes
    an element). bf16 on the bits (add half an ulp of bf16, ties to even, drop 16 bits; a NaN the canonical one), as the
    interpreter's cast truncates; fp16 by the cast."""
    v = v.to(tl.float32)
    if ROUND == 1:
        u = v.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
        v = tl.where(v != v, float("nan"), u.to(tl.float32, bitcast=True))  # torch's bf16 NaN: the canonical one
    elif ROUND == 2:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def row_amax(v):
    """The largest magnitude of each row of ``v [BLOCK_R, BLOCK_C]``, NaN where the row holds one: one
    NaN-propagating ``max`` an element (``tl.max`` drops NaNs; counting them apart cost three more)."""
    return tl.reduce(tl.abs(v), 1, nan_max)


@triton.jit
def nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


ONE_SWEEP_COLS = 8192  # rows up to this long are held whole (module docstring)


def _tiles(src: Tensor) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_C, num_warps)`` of :func:`quantize_rows_kernel` for the ``[L, R, C]`` source ``src``: the
    fastest measured (module docstring); the interpreter's tiles are small."""
    C = src.shape[2]
    cols = triton.next_power_of_2(C)
    if src.stride(1) == 1 and C > 1:  # a transposed view
        if tuning.interpreting():
            return (16, cols, 4) if cols <= 64 else (16, 16, 4)
        return 32, 128, 4
    if tuning.interpreting():
        return max(1, min(16, 4096 // min(cols, 256))), min(cols, 256), 4
    if cols != C and C > 256:
        return 4, 1024, 4
    block_c = cols if cols <= ONE_SWEEP_COLS else 1024
    return max(1, 4096 // block_c), block_c, 4


def launch_quantize_rows(src: Tensor, q: Tensor, scale: Tensor, pow2: bool, tiles: tuple[int, int, int],
                         round_code: int = 0, amax: Tensor | None = None,
                         col_amax: tuple[Tensor, int] | None = None) -> None:
    """One launch of :func:`quantize_rows_kernel` on ``src [L, R, C]`` into ``q [L * R, C]`` e4m3 and ``scale
    [L * R]`` fp32 with ``tiles = (BLOCK_R, BLOCK_C, num_warps)`` (:func:`_tiles`' by default; other tiles are for
    ``benchmarks/bench_fp8_quant.py``) and ``round_code`` (:data:`ROUNDS`). ``amax``: ``[L * R]`` fp32, the rows'
    maxima (``AMAX_GIVEN``). ``col_amax``: ``(partials [L, cdiv(R, group), C] fp32, group)`` written with the
    column maxima of each ``group`` rows (``COL_AMAX``; rows held whole)."""
    L, R, C = src.shape
    block_r, block_c, warps = tiles
    group = col_amax[1] if col_amax is not None else block_r
    direct.launch(quantize_rows_kernel, (tuning.cdiv(R, group), L),
                  src_ptr=src, q_ptr=q, scale_ptr=scale, amax_ptr=amax if amax is not None else scale,
                  col_ptr=col_amax[0] if col_amax is not None else scale, R=R, C=C, stride_l=src.stride(0),
                  stride_r=src.stride(1), stride_c=src.stride(2), tiny=SCALE_FLOOR, QMAX=E4M3_MAX, POW2=pow2,
                  ONE_SWEEP=block_c >= C, BLOCK_R=block_r, BLOCK_C=block_c, ROUND=round_code, GROUP=group,
                  COL_AMAX=col_amax is not None, AMAX_GIVEN=amax is not None and block_c < C, num_warps=warps)


def quantize_rows_fp8(t: Tensor, pow2_scales: bool = False, out: tuple[Tensor, Tensor] | None = None,
                      as_dtype: torch.dtype | None = None, *, amax: Tensor | None = None) -> Float8Tensor:
    """``t [..., R, C]`` (2-D or 3-D, any strides) -> :class:`moeblaze.fp8.Float8Tensor` with ``data [..., R, C]``
    e4m3 (contiguous), ``scale [..., R, 1]`` fp32 and ``block (1, C)``: one scale per row (module docstring).
    ``out``: ``(data, scale)`` tensors of those shapes and dtypes, contiguous, to write into (a dead tensor's
    storage) instead of new ones. ``as_dtype`` (bf16 or fp16, for an fp32 ``t``): quantize ``t.to(as_dtype)``'s
    values, bitwise, without the copy; ``t``'s own dtype or None: ``t`` as it is. ``amax``: ``[..., R]`` fp32
    contiguous, each row's largest magnitude (of those values, NaN where the row holds one) as an earlier pass
    found it (:func:`quantize_rows_col_amax` of the tensor ``t`` transposes): rows not held whole are then read
    once, not twice; the result is the same bytes.

    Raises:
        TypeError: ``t`` not fp32, fp16 or bf16, or ``as_dtype`` neither ``t``'s dtype nor a 16-bit one below an
            fp32 ``t``. ValueError: ``t`` not 2-D or 3-D, ``out`` or ``amax`` not as above, or on a device the
            kernels cannot run on (a CPU tensor without ``TRITON_INTERPRET=1``).
    """
    src, round_code = _source(t, as_dtype, "quantize_rows_fp8")
    L, R, C = src.shape
    if amax is not None and (tuple(amax.shape) != tuple(t.shape[:-1]) or amax.dtype != torch.float32
                             or not amax.is_contiguous() or amax.device != t.device):
        raise ValueError(f"quantize_rows_fp8: amax must be fp32 {tuple(t.shape[:-1])} contiguous on {t.device}, got "
                         f"{amax.dtype} {tuple(amax.shape)} (contiguous: {amax.is_contiguous()}) on {amax.device}")
    if out is None:
        q = torch.empty(L * R, C, dtype=E4M3, device=t.device)
        scale = torch.empty(L * R, dtype=torch.float32, device=t.device)
    else:
        _check_out(t, *out)
        q, scale = out[0].view(L * R, C), out[1].view(L * R)
    if L * R and C:
        launch_quantize_rows(src, q, scale, pow2_scales, _tiles(src), round_code,
                             amax.view(-1) if amax is not None else None)
    elif L * R:  # rows of no values: the scale of a zero row
        scale.fill_(1.0)
    return Float8Tensor(q.view(t.shape), scale.view(*t.shape[:-1], 1), (1, C))


# rows per program whose column maxima quantize_rows_col_amax writes as one partial: fewer partials for the
# torch.amax after it (H200, Qwen3-30B-A3B weights, w1 / w2 with maxima: 0.375 / 0.266 ms at 128 against 0.380 /
# 0.296 at 64; python3 benchmarks/bench_fp8_quant.py, docs/results-fp8-quant.csv)
COL_GROUP = 128


def quantize_rows_col_amax(t: Tensor, pow2_scales: bool = False,
                           as_dtype: torch.dtype | None = None) -> tuple[Float8Tensor, Tensor]:
    """:func:`quantize_rows_fp8` of ``t [..., R, C]`` (rows contiguous) and ``[..., C]`` fp32: each column's largest
    magnitude (of the values quantized, NaN where the column holds one), taken from the values the one read holds;
    the ``amax`` that quantizes ``t``'s transposed view along its rows without a first read
    (``quantize_rows_fp8(t.transpose(-1, -2), amax=...)``: a weight's copy for B1 / B3, DESIGN.md §8). Empty
    (``[0]``) where one tile does not hold the rows whole (:func:`gives_col_amax`): then the transposed copy reads
    twice. Why: the second read of each weight was a third of the FP8 layer step's weight quantization (module
    docstring).

    Raises: as :func:`quantize_rows_fp8`; ValueError: ``t``'s columns not contiguous.
    """
    src, round_code = _source(t, as_dtype, "quantize_rows_col_amax")
    if src.stride(2) != 1:
        raise ValueError(f"quantize_rows_col_amax: t's rows must be contiguous, got strides {tuple(t.stride())}")
    if not gives_col_amax(t):
        return quantize_rows_fp8(t, pow2_scales, as_dtype=as_dtype), t.new_empty(0, dtype=torch.float32)
    L, R, C = src.shape
    tiles = _tiles(src)
    q = torch.empty(L * R, C, dtype=E4M3, device=t.device)
    scale = torch.empty(L * R, dtype=torch.float32, device=t.device)
    group = max(COL_GROUP // tiles[0], 1) * tiles[0]
    part = torch.empty(L, tuning.cdiv(R, group), C, dtype=torch.float32, device=t.device)
    if L * R and C:
        launch_quantize_rows(src, q, scale, pow2_scales, tiles, round_code, col_amax=(part, group))
    # the partials' maxima (torch's amax keeps a NaN); no rows: zeros, the amax of nothing
    col = part.amax(dim=1) if R else torch.zeros(L, C, dtype=torch.float32, device=t.device)
    return (Float8Tensor(q.view(t.shape), scale.view(*t.shape[:-1], 1), (1, C)),
            col.view(*t.shape[:-2], C))


def gives_col_amax(t: Tensor) -> bool:
    """Whether :func:`quantize_rows_col_amax` gives the column maxima of ``t [..., R, C]``: it has columns, its rows
    are contiguous and one tile holds them whole (a power of two up to 8,192 columns, or up to 1,024)."""
    src = t if t.dim() == 3 else t.unsqueeze(0)
    return src.shape[2] > 0 and src.stride(2) == 1 and _tiles(src)[1] >= src.shape[2]


def _source(t: Tensor, as_dtype: torch.dtype | None, name: str) -> tuple[Tensor, int]:
    """``t`` as ``[L, R, C]`` and the ROUND code of ``as_dtype``, both checked (:func:`quantize_rows_fp8`)."""
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{name}: t must be fp32, fp16 or bf16, got {t.dtype}")
    as_dtype = None if as_dtype == t.dtype else as_dtype
    if as_dtype is not None and (t.dtype != torch.float32 or as_dtype not in ROUNDS):
        raise TypeError(f"{name}: as_dtype must be t's dtype ({t.dtype}), or bf16 or fp16 for an fp32 t, "
                        f"got {as_dtype}")
    if t.dim() not in (2, 3):
        raise ValueError(f"{name}: t must be [R, C] or [L, R, C], got shape {tuple(t.shape)}")
    if not t.is_cuda and not tuning.interpreting():
        raise ValueError(f"{name}: t is on {t.device}; the kernel needs CUDA or TRITON_INTERPRET=1")
    return (t if t.dim() == 3 else t.unsqueeze(0)), ROUNDS[as_dtype]


@triton.jit
def inverse(scale):
    """``1 / scale`` correctly rounded, of a row's (or tile's) scale: the factor :func:`quotient` multiplies by,
    computed once a row."""
    return tl.math.div_rn(1.0, scale)


# scales below this are taken 2^64 up, with the values, in quotient's remainder, which then never underflows
_TINY_SCALE = tl.constexpr(2.0**-60)
_UP = tl.constexpr(2.0**64)
_DOWN = tl.constexpr(2.0**-64)


@triton.jit
def quotient(v, scale, inv):
    """``v / scale`` correctly rounded (fp32), from ``inv = inverse(scale)`` (broadcast as ``scale``), without a
    division.

    ``q = v * inv`` lies within an ulp of the quotient; the remainder ``v - q * scale`` is then exact (an fma), and
    ``q + remainder * inv`` is the correctly rounded quotient (Markstein's theorem: J.-M. Muller et al., *Handbook
    of Floating-Point Arithmetic*, 2nd ed., §4.9): four instructions an element where ``div_rn`` takes about ten
    and a branch, in epilogues that are instruction-bound (F1 of the FP8 layer 2.86 against 3.36 ms at Qwen3-30B-A3B,
    T 32,768, one H200 run before the rescale below; ``benchmarks/bench_fp8_kernels.py``,
    docs/results-fp8-kernels.csv). The theorem needs a remainder that does not underflow: under a scale of 2^-60
    (a row of magnitudes under 2^-51) the remainder is taken on ``v`` and the scale times 2^64, exact powers of two;
    the quotients then equal IEEE division's bit for bit (``tests/test_fp8_quant.py``: scales from the fp32 floor
    up, values up to 448 times theirs, in the interpreter and on the GPU). An Inf scale (a block holding Inf) is
    taken as 0 in the remainder, so the result is ``v * 0`` as the division gives (0, NaN for Inf); a NaN scale
    gives NaN. Valid where ``|v / scale|`` does not overflow (a block's values over its own scale: at most 448)."""
    up = tl.where(scale < _TINY_SCALE, _UP, 1.0)
    down = tl.where(scale < _TINY_SCALE, _DOWN, 1.0)
    s = tl.where(scale < float("inf"), scale * up, 0.0)
    q = v * inv
    return tl.fma(tl.fma(-q, s, v * up), inv * down, q)


@triton.jit
def to_e4m3(v, scale, inv):
    """``v / scale`` correctly rounded (:func:`quotient`), cast to e4m3. The scale is the block's own (``amax /
    448`` or above), so the quotient rounds to at most 448 and the cast needs no clamp (it saturates besides,
    ``cvt.rn.satfinite``); a NaN stays NaN."""
    return quotient(v, scale, inv).to(tl.float8e4nv)


@triton.jit
def scale_of(amax, tiny, QMAX: tl.constexpr, POW2: tl.constexpr):
    """The recipe's scale of a block of largest magnitude ``amax`` (module docstring)."""
    scale = tl.math.div_rn(amax, QMAX)
    scale = tl.where(amax == 0.0, 1.0, tl.where(scale < tiny, tiny, scale))  # a NaN stays (maximum would drop it)
    if POW2:  # round up to a power of two: keep a zero mantissa, else the next exponent (finite scales only)
        bits = scale.to(tl.int32, bitcast=True)
        up = tl.where((bits & 0x7FFFFF) == 0, bits, (bits & 0x7F800000) + 0x800000)
        finite = (bits & 0x7F800000) != 0x7F800000
        scale = tl.where(finite, up.to(tl.float32, bitcast=True), scale)
    return scale


def _check_out(t: Tensor, data: Tensor, scale: Tensor) -> None:
    want = ((tuple(t.shape), E4M3), ((*t.shape[:-1], 1), torch.float32))
    for name, o, (shape, dtype) in zip(("data", "scale"), (data, scale), want):
        if tuple(o.shape) != shape or o.dtype != dtype or not o.is_contiguous() or o.device != t.device:
            raise ValueError(f"quantize_rows_fp8: out's {name} must be {dtype} {shape} contiguous on {t.device}, "
                             f"got {o.dtype} {tuple(o.shape)} (contiguous: {o.is_contiguous()}) on {o.device}")


@triton.jit
def dequantize_rows_kernel(
    q_ptr,  # [R, C] e4m3, contiguous
    scale_ptr,  # [R] fp32 dequantization scale of each row
    out_ptr,  # [R, C] fp16 / bf16 / fp32, contiguous
    R, C,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (rows < R)[:, None] & (cols < C)[None, :]
    offs = rows.to(tl.int64)[:, None] * C + cols[None, :]
    scale = tl.load(scale_ptr + rows, mask=rows < R, other=1.0)
    v = tl.load(q_ptr + offs, mask=ok, other=0.0).to(tl.float32) * scale[:, None]
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_rows_fp8(q: Float8Tensor, dtype: torch.dtype) -> Tensor:
    """The rowwise ``q`` (``data [R, C]`` e4m3 contiguous, ``scale [R, 1]`` fp32, as :func:`quantize_rows_fp8` gives)
    as ``[R, C]`` ``dtype``: ``e4m3 * scale`` in fp32 rounded once (module docstring), bitwise
    ``q.dequantize().to(dtype)``.

    Raises:
        ValueError: ``q`` not 2-D rowwise with contiguous data, or on a device the kernel cannot run on.
        TypeError: ``dtype`` not fp32, fp16 or bf16.
    """
    data, scale = q.data, q.scale
    if data.dim() != 2 or not data.is_contiguous() or tuple(scale.shape) != (data.shape[0], 1):
        raise ValueError(f"dequantize_rows_fp8: q must be rowwise [R, C] with scale [R, 1], got data "
                         f"{tuple(data.shape)} (contiguous: {data.is_contiguous()}), scale {tuple(scale.shape)}")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"dequantize_rows_fp8: dtype must be fp32, fp16 or bf16, got {dtype}")
    if not data.is_cuda and not tuning.interpreting():
        raise ValueError(f"dequantize_rows_fp8: q is on {data.device}; the kernel needs CUDA or TRITON_INTERPRET=1")
    R, C = data.shape
    out = torch.empty(R, C, dtype=dtype, device=data.device)
    if R and C:
        block_r, block_c = (16, 32) if tuning.interpreting() else (16, 256)
        direct.launch(dequantize_rows_kernel, (tuning.cdiv(R, block_r), tuning.cdiv(C, block_c)),
                      q_ptr=data, scale_ptr=scale.contiguous(), out_ptr=out, R=R, C=C, BLOCK_R=block_r,
                      BLOCK_C=block_c)
    return out
