"""TF32 operands for the fp32 GEMMs at ``float32_matmul_precision("high")`` (issue 27; DESIGN.md §5).

Two facts of Hopper's TF32 tensor cores shape the fp32 path:

- they read an fp32 operand's TF32 bits by truncation, a bias toward zero that grows with the reduction
  length (the TF32 layer output of ``tests/test_autocast.py::test_gpu_fp32_follows_float32_matmul_precision``
  had 4.5x the error of torch's TF32 matmul, whose cuBLAS rounds its operands, on an H200). So
  every operand is rounded to the nearest TF32 value (10 mantissa bits, ties to even) first;
- ``wgmma`` takes 32-bit operands only K-major (the reduction dimension contiguous in memory). Operands
  stored the other way (the weights of B1 and B3, both operands of the weight gradients B2 and B4) ran at
  58-122 TF/s against 275-313 for the K-major F1 and F2 (H100, ``python3
  benchmarks/profile_kernels.py --configs qwen3-30b-a3b --dtype fp32``). So those are copied K-major; the
  weight gradients' copies also pad each expert's slot range to 32 slots (:func:`padded_slot_rows`), so that
  their loads along the slots are aligned 16-byte vectors: 305-324 TF/s against 74 unpadded (same command).

:func:`tf32_copy` does both in one pass over the tensor (a read and a write): round, and optionally
gather rows through an index and/or transpose the last two dimensions; :func:`round_tf32` rounds keeping
the layout. The five PyTorch elementwise ops of the rounding before took 39 of the 116 ms of that step.
Where a kernel produces the A operand of a K-major TF32 GEMM, it stores it rounded instead
(:func:`round_tf32_values` in its epilogue): F1's ``act`` for F2, the activation backward's ``dpre`` for
B3, which then read it as it is (``a_tf32`` of :func:`moeblaze.kernels.launch.grouped_gemm`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .direct import launch
from .tuning import cdiv

__all__ = ["padded_slot_rows", "round_tf32", "round_tf32_values", "tf32_copy"]


@triton.jit
def round_tf32_values(x):
    """fp32 -> nearest TF32 value (ties to even), as fp32 bits with the low 13 mantissa bits zero."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & -8192
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_tf32_kernel(
    src_ptr,  # [n] fp32, the storage of a dense tensor
    dst_ptr,  # [n] fp32
    n, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, round_tf32_values(tl.load(src_ptr + offs, mask=mask)), mask=mask)


@triton.jit
def tf32_copy_kernel(
    src_ptr,  # [B, R_src, C] fp32; row r of the copy is src row rows[r] (GATHER) or r
    dst_ptr,  # [B, R, C] fp32, or [B, C, R] (TRANSPOSE); contiguous
    rows_ptr,  # [R] int32/int64 source row of each copied row, -1: zeros (GATHER)
    R, C,
    stride_src_b, stride_src_r, stride_src_c,
    GATHER: tl.constexpr, TRANSPOSE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_r, pid_c, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    r_ok, c_ok = offs_r < R, offs_c < C
    src_rows = offs_r.to(tl.int64)
    mask = r_ok[:, None] & c_ok[None, :]
    load_mask = mask
    if GATHER:
        src_rows = tl.load(rows_ptr + offs_r, mask=r_ok, other=0).to(tl.int64)
        load_mask = mask & (src_rows >= 0)[:, None]  # row -1: zeros
        src_rows = tl.maximum(src_rows, 0)
    x = tl.load(src_ptr + b * stride_src_b + src_rows[:, None] * stride_src_r + offs_c[None, :] * stride_src_c,
                mask=load_mask, other=0.0)
    y = round_tf32_values(x)
    base = dst_ptr + b * R * C
    if TRANSPOSE:
        tl.store(base + offs_c[None, :].to(tl.int64) * R + offs_r[:, None], y, mask=mask)
    else:
        tl.store(base + offs_r[:, None].to(tl.int64) * C + offs_c[None, :], y, mask=mask)


def tf32_copy(src: torch.Tensor, *, rows: torch.Tensor | None = None, transpose: bool = False) -> torch.Tensor:
    """A contiguous copy of fp32 ``src`` rounded to TF32, its rows gathered and/or its last two dimensions
    swapped, in one pass.

    Args:
        src: ``[R_src, C]`` or ``[B, R_src, C]`` fp32 CUDA tensor, any strides.
        rows: ``[R]`` int32/int64 rows of ``src`` to copy, in this order, -1 for a row of zeros (default: all
            ``R_src``).
        transpose: return ``[..., C, R]`` instead of ``[..., R, C]``.

    Returns:
        A new contiguous fp32 tensor, every value the nearest TF32 value of its source (ties to even).

    Raises:
        TypeError: ``src`` not fp32. ValueError: ``src`` not rank 2 or 3, or ``rows`` not rank 1.
    """
    if src.dtype != torch.float32:
        raise TypeError(f"tf32_copy: src must be float32, got {src.dtype}")
    if src.dim() not in (2, 3) or (rows is not None and rows.dim() != 1):
        raise ValueError(f"tf32_copy: src must be [R, C] or [B, R, C] and rows [R]; got {tuple(src.shape)}, "
                         f"{None if rows is None else tuple(rows.shape)}")
    s3 = src if src.dim() == 3 else src.unsqueeze(0)
    B, R, C = s3.shape[0], (rows.numel() if rows is not None else s3.shape[1]), s3.shape[2]
    out = torch.empty((B, C, R) if transpose else (B, R, C), dtype=torch.float32, device=src.device)
    if out.numel():
        # 64x64 fp32 tiles (16 KiB): the transposed store goes through shared memory at this size without
        # spilling; a memory-bound copy needs no more.
        grid = (cdiv(R, 64), cdiv(C, 64), B)
        launch(tf32_copy_kernel, grid,
            src_ptr=s3, dst_ptr=out, rows_ptr=rows if rows is not None else s3, R=R, C=C,
            stride_src_b=s3.stride(0), stride_src_r=s3.stride(1), stride_src_c=s3.stride(2),
            GATHER=rows is not None, TRANSPOSE=transpose, BLOCK_R=64, BLOCK_C=64, num_warps=4,
        )
    return out if src.dim() == 3 else out[0]


def _round_tf32_torch(t: torch.Tensor) -> torch.Tensor:
    bits = t.view(torch.int32)
    return ((bits + 0xFFF + ((bits >> 13) & 1)) & -8192).view(torch.float32)


def round_tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 ``t`` rounded to the nearest TF32 value (ties to even), same shape and strides.

    One pass over the storage for a CUDA tensor whose elements fill it densely in some dimension order
    (contiguous, a transposed view, ...); PyTorch elementwise ops otherwise (and on the CPU).
    """
    order = sorted(range(t.dim()), key=lambda i: -t.stride(i))
    dense = t.is_cuda and t.permute(order).is_contiguous() if t.dim() else False
    if not dense:
        return _round_tf32_torch(t)
    out = torch.empty_like(t)  # preserve_format: the same strides as a dense t
    if t.numel():
        src = t.permute(order).reshape(-1)  # a view of the storage (no copy: the permuted t is contiguous)
        launch(round_tf32_kernel, (cdiv(t.numel(), 4096),), src_ptr=src, dst_ptr=out.permute(order).reshape(-1),
               n=t.numel(), BLOCK=4096, num_warps=8)
    return out


def padded_slot_rows(offsets: torch.Tensor, num_slots: int, pad: int,
                     *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each expert's slot range zero-padded to a multiple of ``pad``: ``(padded_offsets [E+1] int32,
    *rows)``, one ``rows [N + pad*E]`` per ``values`` with ``rows[j] = values[s]`` at the padded position ``j``
    of slot ``s`` and -1 in the padding (and in the unused tail: the size is the static bound, no host
    synchronisation). The positions are computed once for all ``values``.

    Args:
        offsets: ``[E+1]`` int32 offsets of the local experts (slots past ``offsets[E]`` are left out).
        num_slots: N. values: ``[N]`` tensors of what each slot maps to (its token, or its own index).
    """
    E = offsets.numel() - 1
    counts = (offsets[1:] - offsets[:-1]).long()
    padded = torch.zeros(E + 1, dtype=torch.long, device=offsets.device)
    padded[1:] = torch.cumsum((counts + pad - 1) // pad * pad, 0)
    slots = torch.arange(num_slots, device=offsets.device)
    e = torch.searchsorted(offsets[1:].long(), slots, right=True)  # the expert of each slot (E: foreign)
    local = e < E
    e = e.clamp(max=E - 1)
    size = num_slots + pad * E
    pos = torch.where(local, slots - offsets[e].long() + padded[e], size)  # foreign slots to a dropped column
    rows = [torch.full((size + 1,), -1, dtype=torch.long, device=offsets.device).scatter_(0, pos, v.long())[:size]
            for v in values]
    return padded.to(torch.int32), *rows
