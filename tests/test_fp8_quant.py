"""The rowwise e4m3 quantization kernel (``moeblaze.kernels.fp8_quant``) against the recipe's PyTorch version
(``moeblaze.fp8.quantize_fp8`` with ``(1, C)`` tiles): bitwise on a GPU (``-m gpu``). In Triton's CPU interpreter the
scales are bitwise too, and the e4m3 values equal except where the interpreter's cast is known to differ
(DESIGN.md §7): values below e4m3's smallest normal, a rounding up to a power of two whose carry it drops (it
stores half the value), ties (it rounds them away from zero, not to even) and NaN (not stored as NaN)."""

from __future__ import annotations

import os

import pytest
import torch

from moeblaze import build_dispatch
from moeblaze.fp8 import E4M3, quantize_fp8, quantize_fp8_slots

HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
if HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1":
    from moeblaze.kernels.fp8_quant import quantize_expert_columns_fp8, quantize_rows_fp8


def _source(shape, dtype, transposed, device):
    """Values over 8 binades per row (inside fp16's range), one row of zeros, one with a NaN and one with an
    infinity (3-D)."""
    gen = torch.Generator().manual_seed(sum(shape))
    t = torch.randn(*shape, generator=gen) * torch.logspace(-4, 4, shape[-1]) / 4
    if t.dim() == 3 and shape[1] >= 4:
        t[0, 1] = 0.0
        t[1, 2, 3] = float("nan")
        t[-1, 3, 0] = float("inf")
    t = t.to(dtype).to(device)
    return t.transpose(1, 2).contiguous().transpose(1, 2) if transposed else t


def _check(t, pow2, exact):
    got = quantize_rows_fp8(t, pow2)
    ref = quantize_fp8(t, (1, t.shape[-1]), pow2)
    assert got.block == ref.block and got.data.dtype == E4M3 and got.data.is_contiguous()
    _same(t, got.data, got.scale, ref.data, ref.scale, exact)


def _same(t, data, scale, ref_data, ref_scale, exact, element_scale=None):
    """Scales bitwise; e4m3 values bitwise (``exact``) or but the interpreter's known casts (module docstring).
    ``element_scale``: each element's scale, broadcastable to ``t`` (default: ``scale``, one per row)."""
    assert scale.shape == ref_scale.shape and torch.equal(scale.nan_to_num(-1.0), ref_scale.nan_to_num(-1.0))
    g, r = data.float().cpu(), ref_data.float().cpu()
    differ = ~((g == r) | (g.isnan() & r.isnan()))
    if exact:
        assert not differ.any(), int(differ.sum())
        return
    power_of_two = torch.frexp(r)[0].abs() == 0.5
    quotient = t.float().cpu() / (scale if element_scale is None else element_scale).cpu()  # what the cast rounds
    tie = quotient == (g + r) / 2
    known = (r.abs() <= 2.0**-6) | (power_of_two & (g == r / 2)) | tie | r.isnan()
    assert not (differ & ~known).any(), int((differ & ~known).sum())
    assert (~differ).float().mean() >= 0.75  # most values agree: the test is not vacuous


@pytest.mark.skipif(HAS_CUDA, reason="an interpreter test (CPU tensors); the gpu test runs the kernel on the device")
@pytest.mark.parametrize("shape, transposed", [((37, 200), False), ((3, 40, 72), False), ((3, 40, 72), True),
                                               ((1, 5), False), ((2, 1, 300), False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("pow2", [False, True])
def test_scales_bitwise_values_but_the_interpreters_casts(shape, transposed, dtype, pow2):
    """2-D and 3-D rows, a transposed view read through its strides (a weight's K-major copy), one row, rows
    longer than a column block; zeros (scale 1), NaN (its row NaN), infinity."""
    _check(_source(shape, dtype, transposed, "cpu"), pow2, exact=False)


def test_dequantize_in_row_blocks_is_the_whole_product(monkeypatch):
    """The Triton ops' dequantization of the kept ``pre``, a block of rows at a time (3 rows here, 10 in all): the
    fp32 product of the whole tensor, rounded to the target dtype."""
    from moeblaze.kernels import fp8_experts

    monkeypatch.setattr(fp8_experts, "DEQUANTIZE_ELEMENTS", 3 * 24)
    q = quantize_fp8(torch.randn(10, 24) * 7, (1, 24))
    for dtype in (torch.float32, torch.float16):
        assert torch.equal(fp8_experts.dequantize(q, dtype), q.dequantize().to(dtype))


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match="t must be fp32, fp16 or bf16, got torch.int32"):
        quantize_rows_fp8(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"t must be \[R, C\] or \[L, R, C\], got shape \(4,\)"):
        quantize_rows_fp8(torch.ones(4))


def _slots_case(T, K, E, Q, device, dtype=torch.float32):
    """Slot rows of a routing with two empty experts, values over 4 binades, a factor per token."""
    gen = torch.Generator().manual_seed(T * E + Q)
    ids = torch.stack([torch.randperm(E - 2, generator=gen)[:K] for _ in range(T)])
    index = build_dispatch(ids.to(device), E)
    t = (torch.randn(T * K, Q, generator=gen) * torch.logspace(-2, 2, Q)).to(dtype).to(device)
    factor = (torch.rand(T, generator=gen) + 0.5).to(device)
    return t, index, factor


def _check_columns(T, K, E, Q, device, dtype, with_factor, pow2, exact):
    t, index, factor = _slots_case(T, K, E, Q, device, dtype)
    f = factor if with_factor else None
    q, scale = quantize_expert_columns_fp8(t, index.local_offsets, index.expert_token_indices, f, pow2)
    src = t.float() * (factor[index.expert_token_indices.long()][:, None] if with_factor else 1.0)
    ref = quantize_fp8_slots(src, index.local_offsets, None, pow2)
    assert q.dtype == E4M3 and scale.shape == (E, Q)
    _same(src, q, scale, ref.data, ref.scale[:E], exact, element_scale=ref.scale.index_select(0, ref.tile))


@pytest.mark.skipif(HAS_CUDA, reason="an interpreter test (CPU tensors); the gpu test runs the kernel on the device")
@pytest.mark.parametrize("with_factor", [False, True])
@pytest.mark.parametrize("pow2", [False, True])
def test_expert_columns_as_the_recipes_slot_quantization(with_factor, pow2):
    """Per (expert, column) over the expert's slots, times a token factor; empty experts get scale 1."""
    _check_columns(50, 2, 6, 40, "cpu", torch.float32, with_factor, pow2, exact=False)


def test_expert_columns_errors_name_the_argument():
    t, index, factor = _slots_case(8, 2, 4, 16, "cpu")
    args = (index.local_offsets, index.expert_token_indices)
    with pytest.raises(TypeError, match="t must be fp32, fp16 or bf16"):
        quantize_expert_columns_fp8(t.int(), *args)
    with pytest.raises(ValueError, match=r"t must be \[N=16, Q\]"):
        quantize_expert_columns_fp8(t[:3], *args)
    with pytest.raises(TypeError, match="factor must be fp32"):
        quantize_expert_columns_fp8(t, *args, factor.double())


@pytest.mark.gpu
@pytest.mark.parametrize("with_factor", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_expert_columns_bitwise(with_factor, dtype):
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU (run with -m gpu on the device)")
    _check_columns(4096, 8, 64, 768, "cuda", dtype, with_factor, False, exact=True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, transposed", [((16384, 2048), False), ((8, 1536, 2048), True), ((300, 72), False),
                                               ((3, 40, 72), False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pow2", [False, True])
def test_gpu_bitwise_the_recipe(shape, transposed, dtype, pow2):
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU (run with -m gpu on the device)")
    _check(_source(shape, dtype, transposed, "cuda"), pow2, exact=True)
