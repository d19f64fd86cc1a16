"""``moeblaze.fp8.reuse_weights``: the FP8 layer's weight copies (e4m3, of fp32 masters too) made
once per parameter update over micro-batches, results bitwise those of quantizing every call; an in-place update
or any optimizer step makes new ones; nothing is kept outside the context (issue 59, weights once per step)."""

from __future__ import annotations

import pytest
import torch

import moeblaze
from moeblaze import fp8
from moeblaze.fp8 import Float8Recipe

TRITON_ON_CPU = not torch.cuda.is_available() and moeblaze.backends.triton_available()


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
