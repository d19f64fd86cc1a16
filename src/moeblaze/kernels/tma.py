"""Host-side TMA helpers of the launchers (:mod:`moeblaze.kernels.launch`, :mod:`moeblaze.kernels.fp8_ws_up`):
whether rows can be read by the copy engine, and the descriptors the Gluon kernels read through."""

from __future__ import annotations

import functools

import torch


def rows_tma_ok(t: torch.Tensor, row_stride: int) -> bool:
    """A 2-D TMA descriptor over rows ``row_stride`` elements apart starting at ``t.data_ptr()`` is legal:
    the copy engine needs a 16-byte-aligned base and row stride."""
    return t.data_ptr() % 16 == 0 and row_stride * t.element_size() % 16 == 0


def rows_aligned(t: torch.Tensor) -> bool:
    """Rows of ``t [rows, cols]`` are contiguous and 16-byte aligned: whole TMA rows, whole 16-byte cp.async."""
    return t.stride(1) == 1 and rows_tma_ok(t, t.stride(0))


@functools.cache
def nvmma_layout(box: tuple[int, ...], dtype: torch.dtype):
    """The shared-memory layout ``wgmma`` reads a ``box`` of 16-bit or e4m3 values in (the same for every launch of a
    box and dtype)."""
    from triton.experimental.gluon import language as gl

    el = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(box), el)


def tma_desc(t: torch.Tensor, box: list[int]):
    """A host TMA descriptor over the rows of 16-bit or e4m3 ``t`` (aligned: :func:`rows_aligned`), ``box`` per
    copy."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor.from_tensor(t, box, nvmma_layout(tuple(box), t.dtype))
