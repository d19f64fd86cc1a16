"""``moeblaze.fp8.reuse_weights``: the FP8 layer's weight copies (e4m3, of fp32 masters too) made
once per parameter update over micro-batches, results bitwise those of quantizing every call; an in-place update
or any optimizer step makes new ones; nothing is kept outside the context (issue 59, weights once per step)."""

from __future__ import annotations

import pytest
import torch

import moeblaze
from moeblaze import fp8
from moeblaze.fp8 import Float8Recipe
from moeblaze.testing import triton_on_cpu

TRITON_ON_CPU = triton_on_cpu()


def _layer(backend: str = "torch", recipe: Float8Recipe | None = None) -> moeblaze.MoE:
    torch.manual_seed(0)
    return moeblaze.MoE(32, 16, 4, 2, backend=backend, fp8=recipe or Float8Recipe())


def _batches(n: int, dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(7, 32, generator=gen).to(dtype) for _ in range(n)]


def _count_weight_quantizations(monkeypatch) -> list[bool]:
    quantized: list[bool] = []
    real = Float8Recipe.quantize_weight

    def counted(self, w, reduce_cols):
        quantized.append(reduce_cols)
        return real(self, w, reduce_cols)

    monkeypatch.setattr(Float8Recipe, "quantize_weight", counted)
    return quantized


def _accumulate(moe: moeblaze.MoE, xs: list[torch.Tensor], autocast: bool = False) -> list[torch.Tensor]:
    """Gradient accumulation over the micro-batches ``xs``: the outputs and the accumulated gradients."""
    outs = []
    for x in xs:
        x = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = moe(x)
        out.float().square().sum().backward()
        outs += [out.detach(), x.grad]
    return outs + [p.grad.clone() for p in moe.parameters()]


@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
def test_micro_batches_quantize_each_weight_once_and_match_bitwise(monkeypatch, granularity):
    """Three micro-batches: four weight quantizations (w1 and w2, each along both dimensions) instead of twelve;
    outputs and accumulated gradients bitwise those of the runs without the context."""
    recipe = Float8Recipe(granularity, 16)
    quantized = _count_weight_quantizations(monkeypatch)
    want = _accumulate(_layer(recipe=recipe), _batches(3))
    assert len(quantized) == 12
    quantized.clear()
    with fp8.reuse_weights():
        got = _accumulate(_layer(recipe=recipe), _batches(3))
    assert sorted(quantized) == [False, False, True, True]
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_fp32_master_weights_are_quantized_once_from_the_master(monkeypatch):
    """fp32 masters under bf16 autocast: each e4m3 copy made once, from the fp32 master as its bf16 values (no
    16-bit copy of the weight is made); bitwise the runs without the context."""
    want = _accumulate(_layer(), _batches(3), autocast=True)
    quantized = _count_weight_quantizations(monkeypatch)
    with fp8.reuse_weights():
        got = _accumulate(_layer(), _batches(3), autocast=True)
    assert len(quantized) == 4
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_an_update_in_place_makes_new_copies():
    """A weight changed in place (its version moves) inside the context: the next call quantizes the new values."""
    moe, fresh = _layer(), _layer()
    x = _batches(1)[0]
    with fp8.reuse_weights():
        moe(x)
        with torch.no_grad():
            moe.w_down.mul_(0.5)
            fresh.w_down.mul_(0.5)
        assert torch.equal(moe(x), fresh(x))


def test_any_optimizer_step_drops_every_copy():
    """Weights written without a version change (``.data``, as a sharded gather can) are seen after any
    optimizer's step, even one over other parameters: the step drops every copy."""
    moe, fresh = _layer(), _layer()
    x = _batches(1)[0]
    with fp8.reuse_weights():
        before = moe(x)
        moe.w_gate_up.data.mul_(0.5)
        fresh.w_gate_up.data.mul_(0.5)
        assert torch.equal(moe(x), before)  # same version: the kept copy (why the step matters)
        other = torch.nn.Parameter(torch.ones(2))
        other.grad = torch.ones(2)
        torch.optim.SGD([other], lr=0.1).step()
        assert torch.equal(moe(x), fresh(x))


def test_nothing_is_kept_outside_the_context():
    """Outside the context every call quantizes and nothing is kept; nested contexts free the copies and remove
    the optimizer hook when the outermost exits."""
    moe, x = _layer(), _batches(1)[0]
    moe(x)
    assert not fp8._COPIES
    with fp8.reuse_weights():
        with fp8.reuse_weights():
            moe(x)
        assert fp8._COPIES and fp8._SCOPES[0] == 1
    assert not fp8._COPIES and fp8._SCOPES == [0, None]


def test_only_parameters_qualify():
    """A plain tensor (not a parameter or a view of one) is quantized at every call: its storage may be reused."""
    w = torch.randn(2, 4, 8)
    made = []
    with fp8.reuse_weights():
        for _ in range(2):
            fp8.weight_copy(w, ("t",), lambda: made.append(1))
        p = torch.nn.Parameter(w.clone())
        for _ in range(2):
            fp8.weight_copy(p.transpose(1, 2), ("t",), lambda: made.append(2))
    assert made == [1, 1, 2]


@pytest.mark.skipif(not TRITON_ON_CPU, reason="the Triton FP8 ops on CPU tensors need TRITON_INTERPRET=1")
def test_triton_ops_quantize_each_weight_once(monkeypatch):
    """The Triton backend's rowwise ops: one quantization per weight layout over three micro-batches (rows for
    F1 / F2, transposed for B1 / B3), results bitwise those without the context."""
    from moeblaze.kernels import fp8_experts

    layouts = []
    real = fp8_experts._rows
    monkeypatch.setattr(fp8_experts, "_rows", lambda t, pow2, out=None, as_dtype=None: (
        layouts.append(t.stride()) if t.dim() == 3 else None) or real(t, pow2, out, as_dtype))
    want = _accumulate(_layer("triton"), _batches(3))
    assert len(layouts) == 12
    layouts.clear()
    with fp8.reuse_weights():
        got = _accumulate(_layer("triton"), _batches(3))
    assert len(layouts) == 4 and len(set(layouts)) == 4
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.skipif(not TRITON_ON_CPU, reason="the Triton FP8 ops on CPU tensors need TRITON_INTERPRET=1")
def test_chunked_b3_reads_the_one_kept_copy(monkeypatch):
    """B3 in column chunks whose widths change from one micro-batch to the next: outside the context each chunk
    quantizes only the rows of w1^T it reads; inside it every chunk reads the one kept copy in place (4
    quantizations in all, none per chunking); the results bitwise alike."""
    from moeblaze.kernels import fp8_experts

    shapes = []
    real = fp8_experts._rows
    monkeypatch.setattr(fp8_experts, "_rows", lambda t, pow2, out=None, as_dtype=None: (
        shapes.append(tuple(t.shape)) if t.dim() == 3 else None) or real(t, pow2, out, as_dtype))

    def run():
        moe, outs = _layer("triton"), []
        for x, cols in zip(_batches(2), (16, "off")):
            x = x.clone().requires_grad_()
            with moeblaze.settings.override(chunk_cols=cols):
                moe(x).square().sum().backward()
            outs.append(x.grad)
        return outs + [p.grad for p in moe.parameters()]
    want = run()
    # each micro-batch: w1 (4, 32, 32), w2 (4, 32, 16), w2^T (4, 16, 32); w1^T in 2 chunks (4, 16, 32), then whole
    assert len(shapes) == 9 and shapes.count((4, 16, 32)) == 4 and shapes.count((4, 32, 32)) == 3
    shapes.clear()
    with fp8.reuse_weights():
        got = run()
    assert sorted(shapes) == [(4, 16, 32), (4, 32, 16), (4, 32, 32), (4, 32, 32)]  # w1^T whole, once
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.skipif(not TRITON_ON_CPU, reason="the Triton FP8 ops on CPU tensors need TRITON_INTERPRET=1")
def test_compiled_layer_inside_the_context(monkeypatch):
    """``torch.compile(fullgraph=True)`` inside the context: the trace makes no copies of its own (no graph break,
    no guard on them); the custom ops, run eagerly, reuse their weight copies; the eager layer's results."""
    from moeblaze.kernels import fp8_experts

    layer, xs = _layer("triton"), _batches(2)
    eager = [layer(x) for x in xs]
    layouts = []
    real = fp8_experts._rows
    monkeypatch.setattr(fp8_experts, "_rows", lambda t, pow2, out=None, as_dtype=None: (
        layouts.append(t.stride()) if t.dim() == 3 else None) or real(t, pow2, out, as_dtype))
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with fp8.reuse_weights():
        got = [compiled(x) for x in xs]
    assert len(layouts) == 2  # w1 and w2 rows, once over both invocations
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _weight(shape, dtype):
    """A weight ``[E, n, k]`` over 6 binades along k, a NaN and an infinity (when n > 3)."""
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(*shape, generator=gen) * torch.logspace(-3, 3, shape[-1])
    if shape[1] > 3:
        w[-1, 3, 1], w[0, 2, 0] = float("nan"), float("inf")
    return w.to(dtype)


def _check_column_maxima(w, as_dtype, exact):
    """The rows of ``w`` with their column maxima, and the transposed copy from those maxima: bitwise the copies
    made without them (the transposed one read twice); in the interpreter but a NaN row's e4m3 bits, which follow
    the sign of its NaN scale (tests/test_fp8_quant.py)."""
    from moeblaze.kernels.fp8_quant import quantize_rows_col_amax, quantize_rows_fp8

    q, amax = quantize_rows_col_amax(w, as_dtype=as_dtype)
    ref = quantize_rows_fp8(w, as_dtype=as_dtype)
    assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(
        q.scale.nan_to_num(-1.0), ref.scale.nan_to_num(-1.0))
    values = w.to(as_dtype or w.dtype).float()
    want = values.abs().amax(-2) if w.shape[-2] else values.new_zeros(w.shape[0], w.shape[-1])
    assert amax.dtype == torch.float32 and torch.equal(amax.nan_to_num(-1.0), want.nan_to_num(-1.0))
    got = quantize_rows_fp8(w.transpose(1, 2), as_dtype=as_dtype, amax=amax)
    ref = quantize_rows_fp8(w.transpose(1, 2), as_dtype=as_dtype)
    assert torch.equal(got.scale.nan_to_num(-1.0), ref.scale.nan_to_num(-1.0))
    rows = torch.ones_like(ref.scale, dtype=torch.bool) if exact else ~ref.scale.isnan()
    same = got.data.view(torch.uint8) == ref.data.view(torch.uint8)
    assert same[rows.expand_as(same)].all()
    if w[:, :, 1:].isnan().any():
        assert ref.scale.isnan().any()  # the NaN column's row is there and was compared by its scale


@pytest.mark.skipif(not TRITON_ON_CPU, reason="the quantization kernel on CPU tensors needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("shape", [(2, 130, 20), (2, 80, 24), (1, 5, 7), (2, 0, 8)])
@pytest.mark.parametrize("dtype, as_dtype", [(torch.float16, None), (torch.float32, torch.bfloat16),
                                             (torch.float32, None)])
def test_transposed_copy_from_the_rows_column_maxima(shape, dtype, as_dtype):
    """The copies for B1 / B3 with one read of the weight (the column maxima of the forward's rowwise pass): the
    bytes of the two-read copy; rows of programs that span several row blocks (130 rows), a transposed view whose
    rows are read in several column blocks (the maxima given), short rows, no rows; an fp32 master as its bf16
    cast."""
    _check_column_maxima(_weight(shape, dtype), as_dtype, exact=False)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, held", [((8, 1536, 2048), True), ((8, 2048, 768), True), ((3, 130, 40), True),
                                         ((2, 40, 9000), False), ((4, 64, 1536), False)])
@pytest.mark.parametrize("dtype, as_dtype", [(torch.bfloat16, None), (torch.float32, torch.bfloat16)])
def test_gpu_transposed_copy_from_the_rows_column_maxima(shape, held, dtype, as_dtype):
    """As the interpreter test, bitwise; rows a tile does not hold whole (over 8,192 columns; 1,536, swept in
    1,024-column blocks) give no maxima, as the layer's custom ops declare: the copy reads twice."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run with -m gpu on the device)")
    from moeblaze.kernels import fp8_experts
    from moeblaze.kernels.fp8_quant import quantize_rows_col_amax

    w = _weight(shape, dtype).cuda()
    assert fp8_experts._amax_shape(w) == ((shape[0], shape[2]) if held else (0,))
    if not held:
        assert quantize_rows_col_amax(w)[1].numel() == 0
        return
    _check_column_maxima(w, as_dtype, exact=True)


def test_column_maxima_errors_name_the_argument():
    from moeblaze.kernels.fp8_quant import quantize_rows_col_amax, quantize_rows_fp8

    if not (torch.cuda.is_available() or TRITON_ON_CPU):
        pytest.skip("the quantization kernel needs CUDA or TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w = torch.randn(2, 6, 8, device=dev)
    with pytest.raises(ValueError, match=r"amax must be fp32 \(2, 8\) contiguous"):
        quantize_rows_fp8(w.transpose(1, 2), amax=torch.ones(2, 6, device=dev))
    with pytest.raises(ValueError, match="t's rows must be contiguous"):
        quantize_rows_col_amax(w.transpose(1, 2))
    q, amax = quantize_rows_col_amax(torch.randn(2, 5, 0, device=dev))  # no columns: no maxima, rows of scale 1
    assert amax.numel() == 0 and torch.equal(q.scale, torch.ones(2, 5, 1, device=dev))


@pytest.mark.gpu
def test_gpu_layer_backward_bitwise_with_the_forwards_column_maxima(monkeypatch):
    """The FP8 layer's gradients with the weights' transposed copies made from the forward's column maxima: bitwise
    those with copies that read the weights twice."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run with -m gpu on the device)")
    from moeblaze.kernels import fp8_experts

    torch.manual_seed(0)
    layer = moeblaze.MoE(256, 128, 8, 2, backend="triton", fp8=Float8Recipe()).cuda().bfloat16()
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)

    def grads():
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        layer(xi).float().square().sum().backward()
        return [xi.grad] + [p.grad.clone() for p in layer.parameters()]

    used = []
    real = fp8_experts._weight_cols
    monkeypatch.setattr(fp8_experts, "_weight_cols", lambda w, pow2, dtype, amax: (
        used.append(amax is not None and amax.numel() > 0)) or real(w, pow2, dtype, amax))
    with_maxima = grads()
    monkeypatch.setattr(fp8_experts, "_weight_cols", lambda w, pow2, dtype, amax: real(w, pow2, dtype, None))
    for a, b in zip(with_maxima, grads()):
        assert torch.equal(a, b)
    assert used == [True, True]


@pytest.mark.skipif(not TRITON_ON_CPU, reason="the Triton FP8 ops on CPU tensors need TRITON_INTERPRET=1")
def test_triton_interleaved_gate_up_is_regrouped_and_quantized_once(monkeypatch):
    """GPT-OSS's alternating gate and up rows on the Triton ops, three micro-batches: one regrouped copy of w_gate_up
    (forward and backward each regroup it without the context) and one quantization per weight layout, as for a
    gate block and an up block; results bitwise those without the context."""
    from moeblaze import experts
    from moeblaze.kernels import fp8_experts

    layouts, regrouped = [], []
    real_rows, real_blocks = fp8_experts._rows, experts._gate_up_blocks
    monkeypatch.setattr(fp8_experts, "_rows", lambda t, pow2, out=None, as_dtype=None: (
        layouts.append(t.stride()) if t.dim() == 3 else None) or real_rows(t, pow2, out, as_dtype))
    monkeypatch.setattr(experts, "_gate_up_blocks", lambda t: (
        regrouped.append(t.dim()) if t.dim() == 3 else None) or real_blocks(t))
    gen = torch.Generator().manual_seed(2)
    w1 = torch.nn.Parameter(torch.randn(4, 32, 32, generator=gen) / 32**0.5)  # E 4, 2h 32 (alternating), d 32
    w2 = torch.nn.Parameter(torch.randn(4, 32, 16, generator=gen) / 4)
    routes = [torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(7)]) for _ in range(3)]

    def accumulate():
        w1.grad = w2.grad = None
        outs = []
        for x, ids in zip(_batches(3), routes):
            x = x.clone().requires_grad_()
            out = moeblaze.moe_experts(x, ids, torch.full((7, 2), 0.5), w1, w2, activation="swiglu_clamped",
                                       gate_up_interleaved=True, backend="triton", fp8=Float8Recipe())
            out.square().sum().backward()
            outs += [out.detach(), x.grad]
        return outs + [w1.grad.clone(), w2.grad.clone()]

    want = accumulate()
    assert len(layouts) == 12 and len(regrouped) == 6
    layouts.clear()
    regrouped.clear()
    with fp8.reuse_weights():
        got = accumulate()
    assert len(layouts) == 4 and len(set(layouts)) == 4 and len(regrouped) == 1
    for a, b in zip(got, want):
        assert torch.equal(a, b)
