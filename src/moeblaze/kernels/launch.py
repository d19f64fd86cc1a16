"""Launchers of the expert kernels: validate, allocate, compute the grid, launch (DESIGN.md §5).

No launcher reads device data on the host: the M-tile schedule comes with the index
(:class:`moeblaze.dispatch.TileSchedule`, written by the dispatch build), and grids are sized by its
static length (``cdiv(N, BLOCK_M) + E`` M-tiles; programs past ``num_tiles`` exit at once).
"""

from __future__ import annotations

import torch
import triton

from .grouped_gemm import grouped_gemm_kernel
from .tuning import Launchable, block_m, gemm_configs, prune_gemm_configs, wgrad_configs
from .wgrad import grouped_wgrad_kernel

_GEMM_KEY = ["N_COLS", "K_DIM", "NUM_EXPERTS", "EPILOGUE", "GATHER_A", "SCATTER_C", "DUAL"]
_EVEN = {"EVEN_K": lambda a: a["K_DIM"] % a["BLOCK_K"] == 0, "EVEN_N": lambda a: a["N_COLS"] % a["BLOCK_N"] == 0}
_GEMM = Launchable(grouped_gemm_kernel, gemm_configs, key=_GEMM_KEY, heuristics=_EVEN, prune=prune_gemm_configs)
_WGRAD = Launchable(grouped_wgrad_kernel, wgrad_configs,
                    key=["P", "Q", "NUM_EXPERTS", "GATHER_A", "GATHER_B"])


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands use exact (IEEE) products, as torch's default fp32 matmul; 16-bit ones ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def grouped_gemm(a, b, b_strides, c, offsets, indices, sched, *, n_cols, k_dim, gather_a, up_off=0,
                 scatter_c=False, scale=None, epilogue=0, activation=0, dual=False, store_pre=False,
                 aux=None, store_aux=False):
    """Launch :func:`grouped_gemm_kernel` (see its module for the epilogues).

    ``a [rows, k_dim]`` (``gather_a``: rows are tokens), ``b`` a weight ``[E, *, *]`` read as
    ``B[e][k, n]`` through ``b_strides = (stride_e, stride_k, stride_n)``, ``c`` the main output
    (unit stride along columns). ``aux``/``scale``: see the kernel; outputs are written in place.
    ``sched``: ``(tile_expert, tile_row_start, num_tiles)`` of a tile schedule for ``block_m()``.
    """
    N = indices.numel()
    E = offsets.numel() - 1
    if N == 0 or n_cols == 0:
        return
    bm = block_m()
    max_tiles = sched[0].numel()
    aux = aux if aux is not None else c
    scale = scale if scale is not None else offsets
    _GEMM.launch(a.dtype, lambda meta: (max_tiles * triton.cdiv(n_cols, meta["BLOCK_N"]),),
        a, b, c, aux, scale, offsets, indices, *sched,
        max_tiles, n_cols, k_dim, up_off, up_off * b_strides[2],
        a.stride(0), a.stride(1), *b_strides, c.stride(0), aux.stride(0),
        E,
        GATHER_A=gather_a, SCATTER_C=scatter_c, SCALE_C=scale is not offsets, EPILOGUE=epilogue,
        ACTIVATION=activation, DUAL=dual, STORE_PRE=store_pre, STORE_AUX=store_aux,
        DOT_PREC=dot_precision(a.dtype), BLOCK_M=bm,
    )


def grouped_wgrad(a, b, offsets, indices, *, p, q, out_dtype, gather_a=False, gather_b=False):
    """Launch :func:`grouped_wgrad_kernel`; returns ``dW [E, p, q]`` in ``out_dtype``.

    ``a [rows, p]``, ``b [rows, q]``, unit stride not required.
    """
    E = offsets.numel() - 1
    if indices.numel() == 0 or p == 0 or q == 0:
        return torch.zeros(E, p, q, dtype=out_dtype, device=a.device)
    out = torch.empty(E, p, q, dtype=out_dtype, device=a.device)
    _WGRAD.launch(a.dtype, lambda meta: (E * triton.cdiv(p, meta["BLOCK_P"]) * triton.cdiv(q, meta["BLOCK_Q"]),),
        a, b, out, offsets, indices, p, q,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1), out.stride(2),
        E,
        GATHER_A=gather_a, GATHER_B=gather_b, DOT_PREC=dot_precision(a.dtype),
    )
    return out
