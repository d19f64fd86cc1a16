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
    import triton
    import triton.language as tl

    from moeblaze.kernels.fp8_quant import dequantize_rows_fp8, inverse, quantize_rows_fp8, quotient
    from moeblaze.kernels.grouped_gemm import _store_e4m3_tiles

    @triton.jit
    def _quotient_kernel(v_ptr,  # [n] fp32 values
                         s_ptr,  # [n] fp32 scales
                         out_ptr,  # [n] fp32 out: v / s by fp8_quant.quotient
                         n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        s = tl.load(s_ptr + offs, mask=ok, other=1.0)
        tl.store(out_ptr + offs, quotient(tl.load(v_ptr + offs, mask=ok, other=0.0), s, inverse(s)), mask=ok)

    @triton.jit
    def _tiles_kernel(v_ptr,  # [R, C] fp32 values, contiguous
                      q_ptr,  # [R, C] e4m3 out: v quantized in 1 x 64 tiles
                      s_ptr,  # [R, tiles] fp32 out: each row's scale of each 1 x 64 tile
                      R, C, tiles, BLOCK_N: tl.constexpr, POW2: tl.constexpr):
        """F1's kept-pre epilogue helper on rows 0-15 of the ``BLOCK_N`` columns of program ``program_id(0)``."""
        rows = tl.arange(0, 16)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < R
        mask = row_mask[:, None] & (cols < C)[None, :]
        v = tl.load(v_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=0.0)
        first = tl.program_id(0) * (BLOCK_N // 64)
        _store_e4m3_tiles(q_ptr + rows[:, None] * C + cols[None, :], s_ptr + rows * tiles + first, v, mask, row_mask,
                          first, tiles, BLOCK_N, POW2)


def _quotient_case(n, device):
    """``fp8_quant.quotient`` of values over scales as the recipe makes them, against IEEE fp32 division (torch's
    on the CPU): scales from the smallest normal fp32 (the recipe's floor) up to 2^100, values up to 448 times
    theirs (the extremes exactly; some subnormal), many scales near the floor, an Inf scale with Inf values and a
    NaN scale. Returns the bitwise differences, NaN equal to NaN."""
    gen = torch.Generator().manual_seed(n)
    scale = (1 + torch.rand(n, generator=gen)) * torch.exp2(torch.randint(-126, 100, (n,), generator=gen).float())
    # scales near the floor, where the remainder would underflow unscaled, and the floor itself
    low = n // 2
    near_floor = torch.exp2(torch.randint(-126, -90, (low,), generator=gen).float())
    scale[:low] = (1 + torch.rand(low, generator=gen)) * near_floor
    scale[:64] = torch.finfo(torch.float32).tiny
    v = scale * 448 * (torch.rand(n, generator=gen) * 2 - 1)
    v[64:128] = scale[64:128] * 448 * torch.sign(torch.randn(64, generator=gen))  # the row's largest magnitude
    v[:32] = torch.randn(32, generator=gen) * 2.0**-140  # subnormal values
    scale[128:136], v[128:132] = float("inf"), float("inf")
    scale[136:140] = float("nan")
    out = torch.empty(n, device=device)
    _quotient_kernel[(triton.cdiv(n, 1024),)](v.to(device), scale.to(device), out, n, BLOCK=1024)
    ref, got = (v / scale).view(torch.int32), out.cpu().view(torch.int32)
    return ((ref != got) & ~((v / scale).isnan() & out.cpu().isnan())).sum().item()


@pytest.mark.skipif(HAS_CUDA, reason="an interpreter test (CPU tensors); the gpu test runs the kernel on the device")
def test_quotient_is_the_correctly_rounded_division():
    """Markstein's correction (module docstring of ``fp8_quant.quotient``) gives IEEE division's bits, in the
    interpreter's exact fma, on every kind of row the recipe makes."""
    assert _quotient_case(1 << 16, "cpu") == 0


@pytest.mark.gpu
def test_gpu_quotient_is_the_correctly_rounded_division():
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU (run with -m gpu on the device)")
    assert _quotient_case(1 << 22, "cuda") == 0


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


def _same(t, data, scale, ref_data, ref_scale, exact):
    """Scales bitwise; e4m3 values bitwise (``exact``) or but the interpreter's known casts (module docstring)."""
    assert scale.shape == ref_scale.shape and torch.equal(scale.nan_to_num(-1.0), ref_scale.nan_to_num(-1.0))
    g, r = data.float().cpu(), ref_data.float().cpu()
    differ = ~((g == r) | (g.isnan() & r.isnan()))
    if exact:
        assert not differ.any(), int(differ.sum())
        return
    power_of_two = torch.frexp(r)[0].abs() == 0.5
    quotient = t.float().cpu() / scale.cpu()  # what the cast rounds
    tie = quotient == (g + r) / 2
    nan_row = scale.cpu().isnan().expand_as(r)  # x / NaN: the interpreter's e4m3 bits of a NaN follow its sign
    known = (r.abs() <= 2.0**-6) | (power_of_two & (g == r / 2)) | tie | r.isnan() | nan_row
    assert not (differ & ~known).any(), int((differ & ~known).sum())
    assert (~differ).float().mean() >= 0.75  # most values agree: the test is not vacuous


@pytest.mark.skipif(HAS_CUDA, reason="an interpreter test (CPU tensors); the gpu test runs the kernel on the device")
@pytest.mark.parametrize("shape, transposed", [((37, 200), False), ((3, 40, 72), False), ((3, 40, 72), True),
                                               ((2, 72, 40), True), ((1, 5), False), ((2, 1, 300), False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("pow2", [False, True])
def test_scales_bitwise_values_but_the_interpreters_casts(shape, transposed, dtype, pow2):
    """2-D and 3-D rows, a transposed view read through its strides (a weight's K-major copy), one row, rows
    longer than a column block; zeros (scale 1), NaN (its row NaN), infinity."""
    _check(_source(shape, dtype, transposed, "cpu"), pow2, exact=False)


def test_dequantize_is_the_rounded_product():
    """The Triton ops' dequantization (the rows expert parallelism receives) off the GPU: the fp32 product of each
    value and its row's scale, rounded to the target dtype."""
    from moeblaze.kernels import fp8_experts

    q = quantize_fp8(torch.randn(10, 24) * 7, (1, 24))
    for dtype in (torch.float32, torch.float16):
        assert torch.equal(fp8_experts.dequantize(q, dtype), q.dequantize().to(dtype))


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match="t must be fp32, fp16 or bf16, got torch.int32"):
        quantize_rows_fp8(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"t must be \[R, C\] or \[L, R, C\], got shape \(4,\)"):
        quantize_rows_fp8(torch.ones(4))
    dev = "cuda" if HAS_CUDA else "cpu"
    t = torch.randn(6, 8, device=dev)
    with pytest.raises(ValueError, match=r"out's scale must be torch.float32 \(6, 1\)"):
        quantize_rows_fp8(t, out=(torch.empty(6, 8, dtype=E4M3, device=dev), torch.empty(6, device=dev)))
    with pytest.raises(TypeError, match="as_dtype must be t's dtype .torch.bfloat16., or bf16 or fp16 for an fp32 t"):
        quantize_rows_fp8(t.bfloat16(), as_dtype=torch.float16)
    with pytest.raises(TypeError, match="as_dtype must be .* got torch.float64"):
        quantize_rows_fp8(t, as_dtype=torch.float64)


def _check_as_cast(shape, transposed, as_dtype, device):
    t = _source(shape, torch.float32, transposed, device)
    t[(0,) * (t.dim() - 1) + (1,)] = 7.0e4  # fp16: infinity
    got, ref = quantize_rows_fp8(t, as_dtype=as_dtype), quantize_rows_fp8(t.to(as_dtype))
    assert not torch.equal(t.to(as_dtype).float(), t)  # the rounding matters here
    _same(t, got.data, got.scale, ref.data, ref.scale, exact=device == "cuda")


@pytest.mark.skipif(HAS_CUDA, reason="an interpreter test (CPU tensors); the gpu test runs the kernel on the device")
@pytest.mark.parametrize("shape, transposed", [((37, 200), False), ((3, 40, 72), True), ((2, 1, 300), False)])
@pytest.mark.parametrize("as_dtype", [torch.bfloat16, torch.float16])
def test_fp32_quantized_as_its_16_bit_cast(shape, transposed, as_dtype):
    """``as_dtype``: an fp32 tensor (a master weight under autocast) quantized as its bf16 / fp16 cast, rounded in
    the kernel: bitwise the kernel on the cast (rows, a transposed view, rows longer than a column block; a value
    past fp16's range, zeros, NaN, infinity), but the interpreter's e4m3 bits of a NaN row (``_same``)."""
    _check_as_cast(shape, transposed, as_dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("shape, transposed", [((8, 1536, 2048), True), ((8, 2048, 768), False), ((3, 40, 72), True),
                                               ((40, 9000), False)])
@pytest.mark.parametrize("as_dtype", [torch.bfloat16, torch.float16])
def test_gpu_fp32_quantized_as_its_16_bit_cast(shape, transposed, as_dtype):
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU (run with -m gpu on the device)")
    _check_as_cast(shape, transposed, as_dtype, "cuda")


def test_into_given_storage_as_into_new():
    """``out``: the same bits written into the given tensors (B3's e4m3 dpre into the kept pre's storage)."""
    dev = "cuda" if HAS_CUDA else "cpu"
    t = _source((37, 200), torch.float32, False, dev)
    data, scale = torch.empty(37, 200, dtype=E4M3, device=dev), torch.empty(37, 1, device=dev)
    got, new = quantize_rows_fp8(t, out=(data, scale)), quantize_rows_fp8(t)
    assert got.data.data_ptr() == data.data_ptr() and got.scale.data_ptr() == scale.data_ptr()
    assert torch.equal(got.data.view(torch.uint8), new.data.view(torch.uint8)) and torch.equal(got.scale, new.scale)


def _dequantize_case(R, C, device, dtype):
    """A rowwise-quantized ``[R, C]`` over 8 binades, a row of zeros, and the recipe's ``dequantize().to(dtype)``."""
    gen = torch.Generator().manual_seed(R * C)
    t = torch.randn(R, C, generator=gen) * torch.logspace(-4, 4, R)[:, None]
    t[R // 2] = 0.0
    q = quantize_fp8(t.to(device), (1, C))
    return q, q.dequantize().to(dtype)


@pytest.mark.parametrize("R, C", [(37, 200), (1, 5), (300, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequantize_bitwise_the_recipe(R, C, dtype):
    """e4m3 times the row's scale in fp32, rounded once: the recipe's product bit for bit (the interpreter's
    e4m3 -> fp32 conversion is exact; its known differences are in the other direction)."""
    if HAS_CUDA:
        pytest.skip("an interpreter test (CPU tensors); the gpu test runs the kernel on the device")
    q, ref = _dequantize_case(R, C, "cpu", dtype)
    got = dequantize_rows_fp8(q, dtype)
    assert got.dtype == dtype and torch.equal(got, ref)


def test_dequantize_errors_name_the_argument():
    q = quantize_fp8(torch.randn(4, 8), (1, 8))
    with pytest.raises(TypeError, match="dtype must be fp32, fp16 or bf16, got torch.int32"):
        dequantize_rows_fp8(q, torch.int32)
    blocked = quantize_fp8(torch.randn(4, 8), (4, 8))
    with pytest.raises(ValueError, match=r"q must be rowwise \[R, C\] with scale \[R, 1\]"):
        dequantize_rows_fp8(blocked, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_dequantize_bitwise(dtype):
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU (run with -m gpu on the device)")
    q, ref = _dequantize_case(4096, 1536, "cuda", dtype)
    assert torch.equal(dequantize_rows_fp8(q, dtype), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, transposed", [((16384, 2048), False), ((8, 1536, 2048), True), ((300, 72), False),
                                               ((3, 40, 72), False), ((40, 9000), False), ((2, 4100, 80), True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pow2", [False, True])
def test_gpu_bitwise_the_recipe(shape, transposed, dtype, pow2):
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU (run with -m gpu on the device)")
    _check(_source(shape, dtype, transposed, "cuda"), pow2, exact=True)


def test_launcher_holds_power_of_two_rows_whole_and_sweeps_others(monkeypatch):
    """The GPU tiles of :func:`quantize_rows_fp8` (the measured ones, module docstring): a row of a power of two held
    whole, a row of another length over 256 in 4 x 1,024 tiles (whole up to 1,024), rows past 8,192 in 1,024-column
    sweeps, a transposed view in 32 x 128 sweeps."""
    from moeblaze.kernels import fp8_quant, tuning

    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    rows = lambda C: torch.empty(1, 64, C)  # noqa: E731
    assert fp8_quant._tiles(rows(2048)) == (2, 2048, 4)
    assert fp8_quant._tiles(rows(768)) == fp8_quant._tiles(rows(1536)) == (4, 1024, 4)
    assert fp8_quant._tiles(rows(200)) == (16, 256, 4)  # one masked sweep
    assert fp8_quant._tiles(rows(16384)) == (4, 1024, 4)
    assert fp8_quant._tiles(rows(2048).transpose(1, 2)) == fp8_quant._tiles(rows(768).transpose(1, 2)) == (32, 128, 4)


def _act_bwd_case(N, h, gated, device, dtype, limit=None):
    """``act_bwd_rows`` with ``quant`` on random rows (one of them NaN in ``dact``) and the stored ``dpre``, its
    e4m3 copy and scales."""
    from moeblaze.kernels.act_bwd import act_bwd_rows
    from moeblaze.kernels.act_math import ACTIVATION_CODES

    gen = torch.Generator().manual_seed(N + h)
    width = 2 * h if gated else h
    dact = (torch.randn(N, h, generator=gen) * torch.logspace(-3, 3, h)).to(dtype).to(device)
    dact[min(3, N - 1), 0] = float("nan")
    pre = torch.randn(N, width, generator=gen).to(dtype).to(device)
    scale = torch.rand(N, generator=gen).to(device)
    q = torch.full((N, width), 0.5, device=device).to(E4M3)
    s = torch.full((N,), -1.0, device=device)
    act_bwd_rows(dact, pre, pre, scale, None, h=h, activation=ACTIVATION_CODES["swiglu" if gated else "gelu"],
                 store_wact=False, local_slots=limit, quant=(q, s, False))
    return pre, q, s


@pytest.mark.parametrize("gated", [True, False])
def test_activation_backward_writes_dpre_in_e4m3_as_the_kernel_would(gated):
    """B1's activation backward with ``quant`` (B3's dpre quantized where it is produced): scales bitwise the
    recipe's over the stored dpre rows (a NaN row NaN), values but the interpreter's known casts; with
    ``local_slots`` the foreign rows past the zeroed tail are left unwritten."""
    if HAS_CUDA:
        pytest.skip("an interpreter test (CPU tensors); the gpu test runs the kernel on the device")
    from moeblaze.kernels.act_bwd import ZERO_TAIL

    dpre, q, s = _act_bwd_case(37, 40, gated, "cpu", torch.float16)
    ref = quantize_fp8(dpre, (1, dpre.shape[1]))
    _same(dpre, q, s[:, None], ref.data, ref.scale, exact=False)
    assert s[3].isnan()
    local, tail = 5, ZERO_TAIL.value
    N = local + tail + 7
    dpre, q, s = _act_bwd_case(N, 24, gated, "cpu", torch.float16, torch.tensor([local], dtype=torch.int32))
    ref = quantize_fp8(dpre[:local + tail], (1, dpre.shape[1]))
    _same(dpre[:local + tail], q[:local + tail], s[:local + tail, None], ref.data, ref.scale, exact=False)
    assert (s[local + tail:] == -1.0).all() and (q[local + tail:].float() == 0.5).all()


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("h", [768, 1500])
def test_gpu_activation_backward_dpre_bitwise_the_kernel(gated, dtype, h):
    """Rows held whole (h 768: the e4m3 dpre from the registers) and in column blocks (h 1,500: read back)."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU (run with -m gpu on the device)")
    dpre, q, s = _act_bwd_case(4099, h, gated, "cuda", dtype)
    ref = quantize_rows_fp8(dpre)
    _same(dpre, q, s[:, None], ref.data, ref.scale, exact=True)


def _kept_pre_case(N, h, gated, device, dtype, tile):
    """The activation backward on a kept e4m3 pre (its tiles' scales) and on that pre's fp32 values: ``(dpre, dtw,
    w act)`` of each."""
    from moeblaze.kernels.act_bwd import act_bwd_rows
    from moeblaze.kernels.act_math import ACTIVATION_CODES

    gen = torch.Generator().manual_seed(N + h)
    width = 2 * h if gated else h
    pre = (torch.randn(N, width, generator=gen) * 3).to(dtype)
    pre[1] = 0.0  # scale 1
    kept = quantize_fp8(pre.view(N, 2 if gated else 1, h), (1, tile))  # Float8Recipe.quantize_kept's tiles
    dact = (torch.randn(N, h, generator=gen)).to(dtype).to(device)
    weights = torch.rand(N, generator=gen).to(device)
    results = []
    for source, scale in ((kept.data.to(device).view(N, width), kept.scale.to(device)),
                          (kept.dequantize().reshape(N, width).to(device), None)):
        dpre, dtw, wact = torch.empty(N, width, dtype=dtype, device=device), torch.empty(N, device=device), dact.clone()
        act_bwd_rows(wact, source, dpre, weights, dtw, h=h, activation=ACTIVATION_CODES["swiglu" if gated else "gelu"],
                     store_wact=True, pre_scale=scale, pre_tile=tile)
        results.append((dpre, dtw, wact))
    return results


@pytest.mark.parametrize("gated, h, tile", [(True, 200, 64), (False, 40, 128), (True, 64, 32), (True, 40, 16),
                                            (True, 32, 16)])
def test_activation_backward_reads_the_kept_e4m3_pre_as_its_fp32_values(gated, h, tile):
    """The kept pre read in e4m3 with its tile scales (``pre_scale``): every output bitwise that of the same kernel on
    the pre's fp32 values (Float8Tensor.dequantize) — short last tiles, a zero row (scale 1), one tile, tiles shorter
    than the kernel's column block (16 against the interpreter's 32: two scales a block), rows held whole (h 32)."""
    if HAS_CUDA:
        pytest.skip("an interpreter test (CPU tensors); the gpu test runs the kernel on the device")
    (a, b) = _kept_pre_case(37, h, gated, "cpu", torch.float32, tile)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [True, False])
def test_gpu_activation_backward_reads_the_kept_e4m3_pre_as_its_fp32_values(gated):
    """As the interpreter test, up to FMA contraction: on the GPU the compiler may fuse the dequantizing product
    (e4m3 x scale) into the add that follows it, skipping one fp32 rounding, so the fp32 tile sums (dtw) differ in
    their last bits (1 ulp seen at h = 768, H200) and a 16-bit output by at most one rounding step."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU (run with -m gpu on the device)")
    (a, b) = _kept_pre_case(4099, 768, gated, "cuda", torch.bfloat16, 128)
    for x, y in zip(a, b):
        rtol = 2.0 ** -7 if x.dtype == torch.bfloat16 else 2.0 ** -20  # one bf16 step; a few fp32 ulps
        torch.testing.assert_close(x, y, rtol=rtol, atol=rtol * y.abs().max().item())


@pytest.mark.parametrize("block_n, cols, pow2", [(128, 130, False), (64, 40, True), (256, 300, False)])
def test_f1_epilogue_quantizes_each_kept_tile_of_its_output_tile(block_n, cols, pow2):
    """F1's epilogue helper on output tiles of 64-256 columns, each holding several 1 x 64 kept tiles: the recipe's
    quantization (scales bitwise, values but the interpreter's known casts); tiles past the row (130 columns: three
    tiles, a second 128-wide program holding the third and a fourth past the end) write no scale; a zero row gets 1."""
    if HAS_CUDA:
        pytest.skip("an interpreter test (CPU tensors); test_fp8_kernels' gpu test runs the epilogue on the device")
    R = 13
    v = torch.randn(R, cols, generator=torch.Generator().manual_seed(cols)) * torch.logspace(-3, 3, cols)
    v[2] = 0.0
    tiles = -(-cols // 64)
    q = torch.zeros(R, cols, dtype=E4M3)
    s = torch.full((R, tiles), -1.0)
    _tiles_kernel[(-(-cols // block_n),)](v, q, s, R, cols, tiles, BLOCK_N=block_n, POW2=pow2)
    ref = quantize_fp8(v, (1, 64), pow2)
    assert torch.equal(s, ref.scale)

    def per_element(scale):
        return scale.repeat_interleave(64, dim=1)[:, :cols]

    _same(v, q, per_element(s), ref.data, per_element(ref.scale), exact=False)
    assert (s[2] == 1.0).all()
