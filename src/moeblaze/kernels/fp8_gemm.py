"""FP8 grouped GEMMs of the forward, F1 and F2, under the blockwise and the rowwise recipe (DESIGN.md §8, issue 59).

``pre[s] = x[token(s)] W1[e(s)]^T`` over the dispatch index's slots and ``act = f(pre)`` in the epilogue, as
:func:`moeblaze.kernels.grouped_gemm.grouped_gemm_kernel` computes F1 in 16 bits, but from e4m3 operands:

- ``x [T, d]`` e4m3 with fp32 scales ``[T, ceil(d/B)]``, one per 1 x B tile along d (the reduction dimension);
- ``W1 [E, 2h|h, d]`` e4m3 with fp32 scales ``[E, ceil(2h/B), ceil(d/B)]``, one per B x B block.

The K step is one scale block (``BLOCK_K = B``, 128 by default): each step's partial product comes from a fresh
``tl.dot`` on the e4m3 tiles (fp32 sums) and is added to the fp32 accumulator times
``x_scale[row, kb] * w_scale[e, n // B, kb]`` — DeepSeek-V3's promotion (arXiv 2412.19437 §3.3.2, DeepGEMM):
scales are constant over every sum the tensor cores form, and the cross-block sum is in full fp32. The weight
scale is loaded as a vector over the tile's columns, so a tile of up rows that straddles two weight blocks (``h``
not a multiple of B) is right, and ``BLOCK_N`` need not divide B. Gather fused into the A loads (rows of ``x``
read through ``expert_token_indices``; no gathered copy), as in the 16-bit kernel. A short last K block reads
zeros past ``d`` (masked loads): its scale is the padded block's, the one :func:`moeblaze.fp8.quantize_fp8` gives.

F2 (:func:`fp8_down_kernel`) is the same main loop on ``act [N, h]`` e4m3 in slot order (no gather) and
``W2 [E, d, h]``, with the 16-bit kernel's plain epilogue (bias, router weight, scatter to ``out[token]`` when
K = 1); for K > 1 the fp32 slot rows go through the fp32 combine (:func:`moeblaze.kernels.combine.gather_sum`).

The rowwise recipe (a scale per row of ``x`` / ``act`` and per weight row, each along the reduction) needs no
kernel of its own: its scales are constant over the whole K sum, so the 16-bit path's grouped GEMM runs it on the
e4m3 operands (its TMA reads, persistent launch and tuned tiles; ``FP8`` of
:func:`moeblaze.kernels.grouped_gemm.grouped_gemm_kernel`) and multiplies the accumulator by the two scales
once after its main loop. Blockwise promotes each K step's product with its own scales, which on Hopper makes
every step wait for its tensor-core result; ``benchmarks/bench_fp8_kernels.py`` measures both recipes.

The layer's FP8 path (:mod:`moeblaze.kernels.fp8_experts`) runs the rowwise functions here; the blockwise kernels
serve the comparison of recipes and are not wired into autograd. The rowwise F1 writes the kept ``pre`` in e4m3
tiles from its epilogue (``keep`` of :func:`up_rowwise`). Not yet here: ``act`` quantized in F1's epilogue (F2 reads it
with one scale per row, which needs the whole row: a tile has ``BLOCK_N`` columns), an interleaved ``w_gate_up``; for
blockwise also general routing, column chunks of F2's ``[N, d]`` buffer, TMA reads of the weight, autotuned tiles
and a persistent launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..activations import DEFAULT_ACT, GATED, ActArgs, check_activation
from ..dispatch import DispatchIndex, with_schedule
from ..fp8 import E4M3, Float8Tensor
from ..shared_ops import slot_weights
from . import direct, tuning
from . import experts as kx
from .act_math import ACTIVATION_CODES
from .combine import gather_sum, local_slots
from .grouped_gemm import EPILOGUE_ACT_FWD, PRE_16BIT, _epilogue_act_fwd, _epilogue_plain, tile_of
from .launch import grouped_gemm
from .tuning import cdiv

__all__ = ["fp8_up_forward", "up_forward_fp8", "fp8_down_slots", "down_forward_fp8", "FP8_GEMM_CONFIG"]

# Fixed launch configuration (not tuned yet: GPU work). The interpreter's is small so the tests stay fast; the
# GPU's is DeepGEMM's usual FP8 tile (128-wide N, one 128-deep scale block per K step).
FP8_GEMM_CONFIG = {"BLOCK_N": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}
FP8_GEMM_CONFIG_INTERPRET = {"BLOCK_N": 32, "GROUP_M": 4, "num_warps": 4, "num_stages": 1}


@triton.jit
def _fp8_mainloop(a_ptr,  # [T, K_DIM] e4m3 x (rows gathered) or [N, K_DIM] e4m3 act (slot rows), unit column stride
                  a_scale_ptr,  # [rows of A, cdiv(K_DIM, BLOCK_K)] fp32 scales of A's 1 x BLOCK_K tiles
                  b_ptr,  # [E, n, K_DIM] e4m3 weight (w_gate_up [E, 2h|h, d] or w_down [E, d, h]), unit stride on K_DIM
                  b_scale_ptr,  # [E, cdiv(n, BLOCK_K), cdiv(K_DIM, BLOCK_K)] fp32 scales of B's BLOCK_K^2 blocks
                  a_rows, e, offs_n, n_mask, UP_OFF, K_DIM,
                  stride_a_m, stride_a_scale_m, stride_b_e, stride_b_n, stride_b_scale_e, stride_b_scale_n,
                  DUAL: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """``acc[m, n] = sum_kb sa[m, kb] sb[e, n // BLOCK_K, kb] (a[m, kb block] . b[e][n, kb block])`` with ``a``'s
    rows ``a_rows`` [BLOCK_M] (tokens: the gather; or slots) and, if ``DUAL``, ``acc2`` for the up columns
    ``UP_OFF + n`` (F1). ``a [rows, K_DIM]``, ``b [E, n, K_DIM]`` e4m3; ``sa``, ``sb`` their fp32 scales."""
    offs_k = tl.arange(0, BLOCK_K)
    e64 = e.to(tl.int64)
    n_up = offs_n + UP_OFF
    a_ptrs = a_ptr + a_rows[:, None] * stride_a_m + offs_k[None, :]
    b_ptrs = b_ptr + e64 * stride_b_e + offs_k[:, None] + offs_n[None, :].to(tl.int64) * stride_b_n
    b2_ptrs = b_ptr + e64 * stride_b_e + offs_k[:, None] + n_up[None, :].to(tl.int64) * stride_b_n
    a_scale_ptrs = a_scale_ptr + a_rows * stride_a_scale_m
    # the weight block of each column: the gate and up columns of a tile may lie in different blocks
    b_scale_ptrs = b_scale_ptr + e64 * stride_b_scale_e + (offs_n // BLOCK_K) * stride_b_scale_n
    bs2_ptrs = b_scale_ptr + e64 * stride_b_scale_e + (n_up // BLOCK_K) * stride_b_scale_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K_DIM, BLOCK_K)):
        k_ok = offs_k < K_DIM - kb * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:  # the short last block: zeros past d, as the quantizer's zero padding
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & n_mask[None, :]
        b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        a_scale = tl.load(a_scale_ptrs + kb)  # [BLOCK_M]
        b_scale = tl.load(b_scale_ptrs + kb, mask=n_mask, other=0.0)  # [BLOCK_N]
        # a fresh dot per scale block, promoted into the fp32 accumulator with its two scales
        acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        if DUAL:
            b2 = tl.load(b2_ptrs, mask=b_mask, other=0.0)
            b2_scale = tl.load(bs2_ptrs + kb, mask=n_mask, other=0.0)
            acc2 += tl.dot(a, b2) * a_scale[:, None] * b2_scale[None, :]
            b2_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc, acc2


@triton.jit
def _tile_rows(pid_m,
               tile_expert_ptr,  # [max_tiles] int32 expert of each M-tile
               tile_row_ptr,  # [max_tiles] int32 first slot of each M-tile
               offsets_ptr,  # [E+1] int32 expert_token_offsets
               BLOCK_M: tl.constexpr):
    """The M-tile ``pid_m`` of the schedule: its expert ``e``, ``row_mask`` [BLOCK_M] (slots inside the expert)
    and ``rows`` [BLOCK_M] int64, clamped to the expert's last slot so the main loop's loads need no row mask."""
    e = tl.load(tile_expert_ptr + pid_m)
    row_end = tl.load(offsets_ptr + e + 1)
    slots = tl.load(tile_row_ptr + pid_m) + tl.arange(0, BLOCK_M)
    return e, slots < row_end, tl.minimum(slots, row_end - 1).to(tl.int64)


@triton.jit
def fp8_up_kernel(
    x_ptr,  # [T, K_DIM] e4m3, unit column stride (rows read through indices: the gather)
    xs_ptr,  # [T, cdiv(K_DIM, BLOCK_K)] fp32 scales of x's 1 x BLOCK_K tiles, unit column stride
    w_ptr,  # [E, 2h|h, K_DIM] e4m3 w_gate_up, unit stride along K_DIM
    ws_ptr,  # [E, cdiv(2h|h, BLOCK_K), cdiv(K_DIM, BLOCK_K)] fp32 scales of its BLOCK_K x BLOCK_K blocks
    pre_ptr,  # [N, 2h|h] pre (STORE_PRE), unit column stride; gate columns then up columns
    act_ptr,  # [N, h] act = f(pre) (STORE_ACT), unit column stride
    bias_ptr,  # [E, 2h|h] bias in w_gate_up's row order (HAS_BIAS); else a dummy
    offsets_ptr,  # [E+1] int32 expert_token_offsets
    indices_ptr,  # [N] int32 expert_token_indices (slot -> token)
    tile_expert_ptr,  # [max_tiles] int32 expert of each M-tile
    tile_row_ptr,  # [max_tiles] int32 first slot of each M-tile
    num_tiles_ptr,  # [1] int32 valid M-tiles
    max_tiles, N_COLS, K_DIM,  # N_COLS: h (the columns of act; pre has 2h when DUAL)
    UP_OFF,  # column of the up entry of n from its gate column: h (DUAL)
    alpha, limit,  # fp32 parameters of the clamped SwiGLU
    stride_x_m, stride_xs_m, stride_w_e, stride_w_n, stride_ws_e, stride_ws_n, stride_pre_m, stride_act_m,
    stride_bias_e,
    ACTIVATION: tl.constexpr, DUAL: tl.constexpr, STORE_PRE: tl.constexpr, STORE_ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # One program per (M-tile of the static schedule length, N-tile); programs past num_tiles exit.
    num_n = tl.cdiv(N_COLS, BLOCK_N)
    pid_m, pid_n = tile_of(tl.program_id(0), max_tiles, num_n, GROUP_M)
    if pid_m < tl.load(num_tiles_ptr):
        e, row_mask, rows = _tile_rows(pid_m, tile_expert_ptr, tile_row_ptr, offsets_ptr, BLOCK_M)
        tokens = tl.load(indices_ptr + rows).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N_COLS
        acc, acc2 = _fp8_mainloop(
            a_ptr=x_ptr, a_scale_ptr=xs_ptr, b_ptr=w_ptr, b_scale_ptr=ws_ptr, a_rows=tokens, e=e, offs_n=offs_n,
            n_mask=n_mask, UP_OFF=UP_OFF, K_DIM=K_DIM, stride_a_m=stride_x_m, stride_a_scale_m=stride_xs_m,
            stride_b_e=stride_w_e, stride_b_n=stride_w_n, stride_b_scale_e=stride_ws_e, stride_b_scale_n=stride_ws_n,
            DUAL=DUAL, EVEN_K=EVEN_K, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        )
        # the 16-bit kernel's epilogue: bias in fp32, pre rounded to its dtype, act from the rounded pre
        _epilogue_act_fwd(
            pre_ptr=pre_ptr, act_ptr=act_ptr, bias_ptr=bias_ptr, pre_s_ptr=xs_ptr, acc=acc, acc2=acc2, e=e, rows=rows,
            row_mask=row_mask, mask=row_mask[:, None] & n_mask[None, :], offs_n=offs_n, n_mask=n_mask, pid_n=pid_n,
            N_COLS=N_COLS, UP_OFF=UP_OFF, alpha=alpha, limit=limit, stride_pre_m=stride_pre_m,
            stride_act_m=stride_act_m, stride_bias_e=stride_bias_e, ACTIVATION=ACTIVATION, DUAL=DUAL,
            STORE_PRE=STORE_PRE, STORE_ACT=STORE_ACT, HAS_BIAS=HAS_BIAS, PRE_STEP=1, TF32_ACT=False,
            PRE_FP8=PRE_16BIT, BLOCK_N=BLOCK_N,
        )


@triton.jit
def fp8_down_kernel(
    a_ptr,  # [N, K_DIM] e4m3 act in slot order, unit column stride
    as_ptr,  # [N, cdiv(K_DIM, BLOCK_K)] fp32 scales of act's 1 x BLOCK_K tiles
    w_ptr,  # [E, N_COLS, K_DIM] e4m3 w_down [E, d, h], unit stride along K_DIM = h
    ws_ptr,  # [E, cdiv(N_COLS, BLOCK_K), cdiv(K_DIM, BLOCK_K)] fp32 scales of its BLOCK_K x BLOCK_K blocks
    c_ptr,  # [N, N_COLS] y (slot rows) or [T, N_COLS] out (SCATTER_C: K = 1), unit column stride
    scale_ptr,  # [N] fp32 router weight of each slot (SCALE_C)
    bias_ptr,  # [E, N_COLS] bias (HAS_BIAS); else a dummy
    offsets_ptr,  # [E+1] int32 expert_token_offsets
    indices_ptr,  # [N] int32 expert_token_indices (slot -> token: SCATTER_C)
    tile_expert_ptr,  # [max_tiles] int32 expert of each M-tile
    tile_row_ptr,  # [max_tiles] int32 first slot of each M-tile
    num_tiles_ptr,  # [1] int32 valid M-tiles
    max_tiles, N_COLS, K_DIM,  # N_COLS: d, K_DIM: h
    stride_a_m, stride_as_m, stride_w_e, stride_w_n, stride_ws_e, stride_ws_n, stride_c_m, stride_bias_e,
    SCATTER_C: tl.constexpr, SCALE_C: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # F2 y = act W_down[e]^T: as fp8_up_kernel without the gather; the 16-bit kernel's plain epilogue (bias,
    # router weight, scatter to out[token] when K = 1).
    num_n = tl.cdiv(N_COLS, BLOCK_N)
    pid_m, pid_n = tile_of(tl.program_id(0), max_tiles, num_n, GROUP_M)
    if pid_m < tl.load(num_tiles_ptr):
        e, row_mask, rows = _tile_rows(pid_m, tile_expert_ptr, tile_row_ptr, offsets_ptr, BLOCK_M)
        tokens = rows
        if SCATTER_C:
            tokens = tl.load(indices_ptr + rows).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N_COLS
        acc, _ = _fp8_mainloop(
            a_ptr=a_ptr, a_scale_ptr=as_ptr, b_ptr=w_ptr, b_scale_ptr=ws_ptr, a_rows=rows, e=e, offs_n=offs_n,
            n_mask=n_mask, UP_OFF=0, K_DIM=K_DIM, stride_a_m=stride_a_m, stride_a_scale_m=stride_as_m,
            stride_b_e=stride_w_e, stride_b_n=stride_w_n, stride_b_scale_e=stride_ws_e, stride_b_scale_n=stride_ws_n,
            DUAL=False, EVEN_K=EVEN_K, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        )
        _epilogue_plain(
            c_ptr=c_ptr, scale_ptr=scale_ptr, bias_ptr=bias_ptr, acc=acc, e=e, rows=rows, tokens=tokens,
            mask=row_mask[:, None] & n_mask[None, :], offs_n=offs_n, n_mask=n_mask, stride_c_m=stride_c_m,
            stride_bias_e=stride_bias_e, SCATTER_C=SCATTER_C, SCALE_C=SCALE_C, HAS_BIAS=HAS_BIAS,
        )


def _unit_last(t: Tensor) -> bool:
    """The kernel steps along ``t``'s last dimension by 1 (a dimension of one element has any stride)."""
    return t.shape[-1] <= 1 or t.stride(-1) == 1


def _check_operands(op: str, names: tuple[str, str], a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor,
                    block: int) -> None:
    """The e4m3 operands ``a [rows, k]``, ``b [E, n, k]`` (called ``names``) and their fp32 scales agree with the
    blockwise recipe: TypeError/ValueError naming the argument (``op``: the launcher)."""
    for name, t, dims in ((names[0], a, 2), (names[1], b, 3)):
        if t.dtype != E4M3:
            raise TypeError(f"{op}: {name} must be float8_e4m3fn (quantize with moeblaze.fp8), got {t.dtype}")
        if t.dim() != dims or not _unit_last(t):
            raise ValueError(f"{op}: {name} must be {dims}-D with unit stride along its last dimension, got shape "
                             f"{tuple(t.shape)} strides {t.stride()}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"{op}: block must be a power of two >= 16 (a tl.dot depth), got {block}")
    (rows, k), (E, n, k_b) = a.shape, b.shape
    if k_b != k:
        raise ValueError(f"{op}: {names[1]} {tuple(b.shape)} reduces over {k_b}, {names[0]} {tuple(a.shape)} over {k}")
    for name, s, shape in ((f"{names[0]}_scale", a_scale, (rows, cdiv(k, block))),
                           (f"{names[1]}_scale", b_scale, (E, cdiv(n, block), cdiv(k, block)))):
        if s.dtype != torch.float32:
            raise TypeError(f"{op}: {name} must be fp32, got {s.dtype}")
        if tuple(s.shape) != shape or not _unit_last(s):
            raise ValueError(f"{op}: {name} must be {shape} with unit last stride (tiles of {block} along the "
                             f"reduction), got shape {tuple(s.shape)} strides {s.stride()}")
    for name, t in ((f"{names[0]}_scale", a_scale), (names[1], b), (f"{names[1]}_scale", b_scale)):
        if t.device != a.device:
            raise ValueError(f"{op}: {name} is on {t.device}; {names[0]} on {a.device}")


def _launch_checks(op: str, out_dtype: torch.dtype, offsets: Tensor, E: int, N: int, sched, bias: Tensor | None,
                   bias_cols: int) -> int:
    """Checks shared by the launchers; returns the schedule's BLOCK_M (:func:`.tuning.block_m`, checked, not chosen)."""
    if out_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{op}: out_dtype must be fp16, bf16 or fp32, got {out_dtype}")
    if offsets.numel() != E + 1:
        raise ValueError(f"{op}: offsets has {offsets.numel()} entries; the weight has {E} experts (E + 1 expected)")
    if bias is not None and (tuple(bias.shape) != (E, bias_cols) or not _unit_last(bias)
                             or not bias.is_floating_point()):
        raise ValueError(f"{op}: bias must be a float {(E, bias_cols)} with unit column stride, "
                         f"got {tuple(bias.shape)} {bias.dtype}")
    bm = tuning.block_m(N, E)
    if sched[0].numel() != cdiv(N, bm) + E:
        raise ValueError(f"{op}: the tile schedule has {sched[0].numel()} entries; expected one for BLOCK_M={bm}")
    return bm


def _config() -> dict:
    return dict(FP8_GEMM_CONFIG_INTERPRET if tuning.interpreting() else FP8_GEMM_CONFIG)


def fp8_up_forward(xq: Tensor, x_scale: Tensor, wq: Tensor, w_scale: Tensor, offsets: Tensor, indices: Tensor,
                   sched: tuple[Tensor, Tensor, Tensor], *, activation: str, store_pre: bool, store_act: bool,
                   out_dtype: torch.dtype, bias: Tensor | None = None, alpha: float = 0.0, limit: float = 0.0,
                   block: int = 128) -> tuple[Tensor, Tensor]:
    """Launch :func:`fp8_up_kernel`: F1 from e4m3 ``xq [T, d]`` (scales ``x_scale [T, ceil(d/block)]``) and
    ``wq [E, 2h|h, d]`` (scales ``w_scale [E, ceil(2h/block), ceil(d/block)]``) over the slots of
    ``offsets [E+1]`` / ``indices [N]`` (int32) and the tile schedule ``sched`` of :func:`.tuning.block_m` rows.

    Returns ``(pre [N, 2h|h], act [N, h])`` in ``out_dtype`` (fp16, bf16 or fp32); an output not asked for is an
    empty tensor. Rows of slots the schedule does not cover (foreign experts) are left unwritten.

    Raises:
        TypeError: operands not e4m3, scales not fp32, an unsupported ``out_dtype`` or bias dtype.
        ValueError: shapes that disagree (naming the argument), an unknown activation, a tile schedule of
            another BLOCK_M, tensors on different devices.
    """
    check_activation(activation)
    gated = activation in GATED
    op = "fp8_up_forward"
    _check_operands(op, ("x", "w1"), xq, x_scale, wq, w_scale, block)
    E, rows, d = wq.shape
    if gated and rows % 2:
        raise ValueError(f"{op}: a gated activation needs an even number of w1 rows, got {rows}")
    N, h = indices.numel(), rows // 2 if gated else rows
    bm = _launch_checks(op, out_dtype, offsets, E, N, sched, bias, rows)
    pre = xq.new_empty((N, rows) if store_pre else (0,), dtype=out_dtype)
    act = xq.new_empty((N, h) if store_act else (0,), dtype=out_dtype)
    if N == 0 or h == 0 or not (store_pre or store_act):
        return pre, act
    max_tiles, cfg = sched[0].numel(), _config()
    c = pre if store_pre else act  # the epilogue rounds pre to c's dtype even when it stores act only
    bias_t = bias if bias is not None else offsets  # a dummy pointer when HAS_BIAS is off
    direct.launch(fp8_up_kernel, (max_tiles * cdiv(h, cfg["BLOCK_N"]),),
        x_ptr=xq, xs_ptr=x_scale, w_ptr=wq, ws_ptr=w_scale, pre_ptr=c, act_ptr=act if store_act else c,
        bias_ptr=bias_t, offsets_ptr=offsets, indices_ptr=indices, tile_expert_ptr=sched[0], tile_row_ptr=sched[1],
        num_tiles_ptr=sched[2], max_tiles=max_tiles, N_COLS=h, K_DIM=d, UP_OFF=h, alpha=float(alpha),
        limit=float(limit), stride_x_m=xq.stride(0), stride_xs_m=x_scale.stride(0), stride_w_e=wq.stride(0),
        stride_w_n=wq.stride(1), stride_ws_e=w_scale.stride(0), stride_ws_n=w_scale.stride(1),
        stride_pre_m=c.stride(0), stride_act_m=(act if store_act else c).stride(0), stride_bias_e=bias_t.stride(0),
        ACTIVATION=ACTIVATION_CODES[activation], DUAL=gated, STORE_PRE=store_pre, STORE_ACT=store_act,
        HAS_BIAS=bias is not None, EVEN_K=d % block == 0, BLOCK_M=bm, BLOCK_K=block, **cfg,
    )
    return pre, act


def _rowwise(op: str, names: tuple[str, str], aq: Float8Tensor, wq: Float8Tensor) -> bool:
    """Whether the quantized operands are the rowwise recipe's (a row of each along the reduction ``k``: the main
    grouped GEMM runs them) or the blockwise one's (``(1, B)`` tiles and ``(B, B)`` blocks: this module's kernels).

    Raises:
        ValueError: tiles of neither recipe, naming both operands.
    """
    k = aq.data.shape[-1]
    if aq.block == (1, k) and wq.block == (1, k):
        return True
    B = aq.block[1]
    if aq.block == (1, B) and wq.block == (B, B):
        return False
    raise ValueError(f"{op}: {names[0]} in (1, B) tiles and {names[1]} in (B, B) blocks (blockwise), or each in rows "
                     f"along the reduction (rowwise) expected; got {aq.block} and {wq.block}")


def _row_scales(q: Float8Tensor) -> Tensor:
    """The rowwise scales ``[..., R, 1]`` of ``q`` as ``[..., R]`` (a view)."""
    return q.scale[..., 0]


def up_forward_fp8(xq: Float8Tensor, w1q: Float8Tensor, index: DispatchIndex, activation: str, *,
                   store_pre: bool = True, store_act: bool = True, out_dtype: torch.dtype = torch.bfloat16,
                   b1: Tensor | None = None, act_args: ActArgs = DEFAULT_ACT) -> tuple[Tensor | None, Tensor | None]:
    """F1 of the FP8 path: ``pre = x[token(s)] w1[e]^T (+ b1[e])`` and ``act = f(pre)`` in ``out_dtype`` from the
    quantized ``xq`` (``recipe.quantize_rows(x)``) and ``w1q`` (``recipe.quantize_weight(w1, reduce_cols=True)``)
    — what :func:`moeblaze.ops_fp8.up_forward` emulates, up to the order of fp32 sums. Blockwise runs
    :func:`fp8_up_kernel`; rowwise the 16-bit path's grouped GEMM (:func:`moeblaze.kernels.launch.grouped_gemm`,
    its TMA reads and tuned tiles) on the e4m3 operands, scaled once after the main loop. Returns
    ``(pre | None, act | None)`` as asked.

    Raises:
        ValueError: tiles of neither recipe (:func:`_rowwise`), an interleaved ``w_gate_up`` (not supported yet),
            or the launcher's errors (:func:`fp8_up_forward`).
    """
    rowwise = _rowwise("up_forward_fp8", ("x", "w1"), xq, w1q)
    if act_args.interleaved:
        raise ValueError("up_forward_fp8: an interleaved w_gate_up has no FP8 kernel yet")
    sched = with_schedule(index, tuning.block_m(index.num_pairs, index.num_experts)).schedule.tensors()
    if not rowwise:
        pre, act = fp8_up_forward(xq.data, xq.scale, w1q.data, w1q.scale, index.local_offsets,
                                  index.expert_token_indices, sched, activation=activation, store_pre=store_pre,
                                  store_act=store_act, out_dtype=out_dtype, bias=b1, alpha=act_args.alpha,
                                  limit=act_args.limit, block=xq.block[1])
        return (pre if store_pre else None), (act if store_act else None)
    pre, act = up_rowwise(xq, w1q, index.local_offsets, index.expert_token_indices, sched, activation, store_pre,
                          store_act, out_dtype, b1, act_args.alpha, act_args.limit)
    return (pre if store_pre else None), (act if store_act else None)


def up_rowwise(xq: Float8Tensor, w1q: Float8Tensor, offsets: Tensor, indices: Tensor,
               sched: tuple[Tensor, Tensor, Tensor], activation: str, store_pre: bool, store_act: bool,
               out_dtype: torch.dtype, b1: Tensor | None, alpha: float, limit: float,
               keep: tuple[Tensor, bool] | None = None) -> tuple[Tensor, Tensor]:
    """F1 of the rowwise recipe on the grouped GEMM (:func:`up_forward_fp8`, from the index's tensors): ``(pre,
    act)`` in ``out_dtype``, an output not asked for an empty tensor. ``keep = (scale, pow2)``: ``pre`` comes in e4m3,
    quantized by the epilogue in ``1 x KEPT_TILE`` tiles per half (:meth:`moeblaze.fp8.Float8Recipe.quantize_kept` of
    the ``out_dtype`` values; ``pow2``: its power-of-two scales), their scales written into ``scale [N, 2|1,
    cdiv(h, KEPT_TILE)]`` fp32."""
    check_activation(activation)
    rows, h = kx.up_widths(w1q.data, activation)
    N = indices.numel()
    pre = xq.data.new_empty((N, rows) if store_pre else (0,), dtype=out_dtype if keep is None else E4M3)
    act = xq.data.new_empty((N, h) if store_act else (0,), dtype=out_dtype)
    if store_pre or store_act:
        grouped_gemm(xq.data, w1q.data, pre if store_pre else act, offsets, indices, sched, b_nk=True, n_cols=h,
                     k_dim=w1q.data.shape[2], gather_a=True, up_off=h, epilogue=EPILOGUE_ACT_FWD.value,
                     activation=ACTIVATION_CODES[activation], dual=activation in GATED, store_pre=store_pre,
                     aux=act if store_act else None, store_aux=store_act, bias=b1, alpha=alpha, limit=limit,
                     a_scale=_row_scales(xq), b_scale=_row_scales(w1q), pre_scale=None if keep is None else keep[0],
                     pre_pow2=keep is not None and keep[1])
    return pre, act


def fp8_down_slots(aq: Tensor, a_scale: Tensor, wq: Tensor, w_scale: Tensor, offsets: Tensor, indices: Tensor,
                   sched: tuple[Tensor, Tensor, Tensor], c: Tensor, *, scatter: bool = False,
                   scale: Tensor | None = None, bias: Tensor | None = None, block: int = 128) -> None:
    """Launch :func:`fp8_down_kernel` into ``c``: F2 ``c[s] = (act[s] W2[e]^T + bias[e]) (* scale[s])`` from e4m3
    ``aq [N, h]`` (scales ``a_scale [N, ceil(h/block)]``) and ``wq [E, d, h]`` (scales
    ``w_scale [E, ceil(d/block), ceil(h/block)]``); ``c [N, d]``, or ``[T, d]`` at rows ``token(s)`` with
    ``scatter`` (K = 1), unit column stride, fp16/bf16/fp32. Raises as :func:`fp8_up_forward`."""
    op = "fp8_down_slots"
    _check_operands(op, ("act", "w2"), aq, a_scale, wq, w_scale, block)
    E, d, h = wq.shape
    N = indices.numel()
    if aq.shape[0] != N:
        raise ValueError(f"{op}: act has {aq.shape[0]} rows; the index has {N} slots")
    if c.dim() != 2 or c.shape[1] != d or not _unit_last(c) or (not scatter and c.shape[0] != N):
        raise ValueError(f"{op}: c must be [{'T' if scatter else N}, {d}] with unit column stride, got "
                         f"{tuple(c.shape)} strides {c.stride()}")
    if scale is not None and (scale.dtype != torch.float32 or tuple(scale.shape) != (N,)):
        raise ValueError(f"{op}: scale must be fp32 [{N}], got {scale.dtype} {tuple(scale.shape)}")
    bm = _launch_checks(op, c.dtype, offsets, E, N, sched, bias, d)
    if N == 0 or d == 0:
        return
    max_tiles, cfg = sched[0].numel(), _config()
    bias_t = bias if bias is not None else offsets  # dummy pointers for the flags that are off
    direct.launch(fp8_down_kernel, (max_tiles * cdiv(d, cfg["BLOCK_N"]),),
        a_ptr=aq, as_ptr=a_scale, w_ptr=wq, ws_ptr=w_scale, c_ptr=c, scale_ptr=scale if scale is not None else offsets,
        bias_ptr=bias_t, offsets_ptr=offsets, indices_ptr=indices, tile_expert_ptr=sched[0], tile_row_ptr=sched[1],
        num_tiles_ptr=sched[2], max_tiles=max_tiles, N_COLS=d, K_DIM=h, stride_a_m=aq.stride(0),
        stride_as_m=a_scale.stride(0), stride_w_e=wq.stride(0), stride_w_n=wq.stride(1), stride_ws_e=w_scale.stride(0),
        stride_ws_n=w_scale.stride(1), stride_c_m=c.stride(0), stride_bias_e=bias_t.stride(0),
        SCATTER_C=scatter, SCALE_C=scale is not None, HAS_BIAS=bias is not None, EVEN_K=h % block == 0,
        BLOCK_M=bm, BLOCK_K=block, **cfg,
    )


def down_forward_fp8(actq: Float8Tensor, w2q: Float8Tensor, topk_weights: Tensor, index: DispatchIndex, *,
                     b2: Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """F2-F3 of the FP8 path: ``out[t] = sum_k topk_weights[t, k] (act W2[e]^T + b2[e])[map[t, k]]`` in
    ``out_dtype``, from the quantized ``actq`` (``recipe.quantize_rows(act)``, ``[N, h]``) and ``w2q``
    (``recipe.quantize_weight(w2, reduce_cols=True)``, ``[E, d, h]``) — what :func:`moeblaze.ops_fp8.down_forward`
    emulates. K = 1 writes ``w * y`` straight into ``out[token]``. Rowwise: the 16-bit path's grouped GEMM and its
    combine over column chunks of an ``[N, d]`` buffer in ``out_dtype`` (:mod:`moeblaze.kernels.chunks`; general
    routing's CSR pairs too). Blockwise: :func:`fp8_down_kernel` into fp32 slot rows ``y`` and the fp32 combine;
    top-k indices only.

    Raises:
        ValueError: tiles of neither recipe, a general-routing index under blockwise, or the launcher's errors.
    """
    rowwise = _rowwise("down_forward_fp8", ("act", "w2"), actq, w2q)
    if index.pair_offsets is not None and not rowwise:
        raise ValueError("down_forward_fp8: a general-routing index (pair_offsets) has no blockwise FP8 kernel")
    sched = with_schedule(index, tuning.block_m(index.num_pairs, index.num_experts)).schedule.tensors()
    offsets, indices = index.local_offsets, index.expert_token_indices
    if rowwise:
        return down_rowwise(actq, w2q, topk_weights, offsets, indices, sched, index.token_index_map,
                            index.foreign_experts, index.pair_offsets, b2, out_dtype)
    T, K = index.token_index_map.shape
    d = w2q.data.shape[1]
    if K == 1:  # no [N, d] buffer and no combine; tokens of foreign experts are never written: zeros
        new = actq.data.new_zeros if index.foreign_experts else actq.data.new_empty
        out = new(T, d, dtype=out_dtype)
        w = slot_weights(topk_weights, index.token_index_map, torch.float32)
        fp8_down_slots(actq.data, actq.scale, w2q.data, w2q.scale, offsets, indices, sched, out, scatter=True,
                       scale=w, bias=b2, block=actq.block[1])
        return out
    y = actq.data.new_empty(index.num_pairs, d, dtype=torch.float32)
    fp8_down_slots(actq.data, actq.scale, w2q.data, w2q.scale, offsets, indices, sched, y, bias=b2,
                   block=actq.block[1])
    return gather_sum(y, index.token_index_map, topk_weights, out_dtype,
                      local_slots(index.local_offsets, index.foreign_experts))


def down_rowwise(actq: Float8Tensor, w2q: Float8Tensor, topk_weights: Tensor, offsets: Tensor, indices: Tensor,
                 sched: tuple[Tensor, Tensor, Tensor], token_index_map: Tensor, foreign: bool,
                 pair_offsets: Tensor | None, b2: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """F2-F3 of the rowwise recipe (:func:`down_forward_fp8`, from the index's tensors): the 16-bit path's
    :func:`moeblaze.kernels.experts.slots_to_tokens` on the e4m3 operands and their row scales."""
    return kx.slots_to_tokens(actq.data, w2q.data, True, offsets, indices, sched, token_index_map, topk_weights,
                              foreign, pair_offsets, bias=b2, out_dtype=out_dtype, a_scale=_row_scales(actq),
                              b_scale=_row_scales(w2q))
