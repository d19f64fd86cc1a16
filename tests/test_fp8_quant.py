"""The rowwise e4m3 quantization kernel (``moeblaze.kernels.fp8_quant``) against the recipe's PyTorch version
(``moeblaze.fp8.quantize_fp8`` with ``(1, C)`` tiles): bitwise on a GPU (``-m gpu``). In Triton's CPU interpreter the
scales are bitwise too, and the e4m3 values equal except where the interpreter's cast is known to differ
(DESIGN.md §7): values below e4m3's smallest normal, a rounding up to a power of two whose carry it drops (it
stores half the value), ties (it rounds them away from zero, not to even) and NaN (not stored as NaN)."""

from __future__ import annotations

import os

import pytest
import torch

from moeblaze.fp8 import E4M3, quantize_fp8

HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
if HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1":
    from moeblaze.kernels.fp8_quant import quantize_rows_fp8


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
    assert got.scale.shape == ref.scale.shape and torch.equal(got.scale.nan_to_num(-1.0), ref.scale.nan_to_num(-1.0))
    g, r = got.data.float().cpu(), ref.data.float().cpu()
    differ = ~((g == r) | (g.isnan() & r.isnan()))
    if exact:
        assert not differ.any(), int(differ.sum())
        return
    power_of_two = torch.frexp(r)[0].abs() == 0.5
    exact = t.float().cpu() / got.scale.cpu()  # the quotient the cast rounds (scales are equal: checked above)
    tie = exact == (g + r) / 2
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


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match="t must be fp32, fp16 or bf16, got torch.int32"):
        quantize_rows_fp8(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"t must be \[R, C\] or \[L, R, C\], got shape \(4,\)"):
        quantize_rows_fp8(torch.ones(4))


@pytest.mark.gpu
@pytest.mark.parametrize("shape, transposed", [((16384, 2048), False), ((8, 1536, 2048), True), ((300, 72), False),
                                               ((3, 40, 72), False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pow2", [False, True])
def test_gpu_bitwise_the_recipe(shape, transposed, dtype, pow2):
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU (run with -m gpu on the device)")
    _check(_source(shape, dtype, transposed, "cuda"), pow2, exact=True)
