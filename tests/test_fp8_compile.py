"""``torch.compile(fullgraph=True)`` over the FP8 layer (issue 59's custom ops): the compiled layer's output and
gradients are the eager ones, on the CPU (Triton's interpreter) and on the GPU (``-m gpu``), where torch 2.11's dynamo
once gave the backward zeros (the forward's output was a same-dtype ``.to()`` of a tensor the trace also returned)."""

from __future__ import annotations

import pytest
import torch

from moeblaze import MoE, moe_experts
from moeblaze.backends import get_backend
from moeblaze.experts import SAVE_MODES
from moeblaze.fp8 import Float8Recipe
from moeblaze.testing import make_expert_inputs, run_and_grad, triton_on_cpu

HAS_CUDA = torch.cuda.is_available()
TRITON_ON_CPU = triton_on_cpu()


def _layer(d=32, h=16, save="preact", device="cpu", dtype=torch.float32) -> MoE:
    torch.manual_seed(0)
    return MoE(d, h, 4, 2, backend="triton", save=save, fp8=Float8Recipe("rowwise")).to(device, dtype)


def _run(layer, fn, x):
    """The output and the gradients of x, w_gate_up and w_down."""
    xi = x.clone().requires_grad_()
    out = fn(xi)
    return out, *torch.autograd.grad(out.float().square().sum(), (xi, layer.w1, layer.w_down))


@pytest.mark.skipif(not TRITON_ON_CPU, reason="the Triton kernels on CPU tensors need TRITON_INTERPRET=1")
@pytest.mark.parametrize("save", SAVE_MODES)
def test_triton_fp8_layer_compiles_fullgraph(save):
    """``torch.compile(fullgraph=True)`` over ``MoE(fp8=...)`` on the Triton backend (the FP8 ops are custom ops):
    the eager layer's output and gradients."""
    layer, x = _layer(save=save), torch.randn(2, 9, 32)
    eager = _run(layer, layer, x)
    compiled = _run(layer, torch.compile(layer, fullgraph=True, backend="aot_eager"), x)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("save", SAVE_MODES)
@pytest.mark.parametrize("d, h", [(256, 128), (256, 1536)])
def test_gpu_compiled_fp8_layer_matches_eager(save, d, h):
    """On the GPU, ``fullgraph=True`` (aot_eager: the same kernels) gives the eager output and gradients bitwise, in
    two compiled steps, and under ``no_grad`` the eager output (the custom ops' fake outputs hold: the weights' column
    maxima, none for rows of 1,536 that no tile holds whole)."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU (run with -m gpu on the device)")
    layer = _layer(d, h, save=save, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 40, d, device="cuda", dtype=torch.bfloat16)
    eager = _run(layer, layer, x)
    assert all(g.abs().max() > 0 for g in eager[1:])
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for _ in range(2):
        for a, b in zip(_run(layer, compiled, x), eager):
            assert torch.equal(a, b)
    with torch.no_grad():
        assert torch.equal(compiled(x), eager[0])


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(not TRITON_ON_CPU, reason="the Triton kernels on CPU tensors need "
                                                                           "TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])])
def test_fp8_interleaved_gate_up_compiles_fullgraph(device):
    """GPT-OSS's alternating gate and up rows (regrouped for the Triton FP8 kernels, the gradients regrouped back)
    under ``fullgraph=True``: the eager output and gradients bitwise, biases included (the index planned outside:
    the range check of ``topk_ids`` reads the host)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    inputs = make_expert_inputs(40, 64, 32, 4, 2, activation="swiglu_clamped", bias=True, dtype=dtype, device=device)
    dout = torch.randn(40, 64).to(device=device, dtype=dtype)
    index = get_backend("triton", inputs["x"]).plan(inputs["topk_ids"], 4)

    def experts(**kw):
        return moe_experts(**kw, activation="swiglu_clamped", backend="triton", fp8=Float8Recipe("rowwise"),
                           gate_up_interleaved=True, index=index)
    eager = run_and_grad(experts, inputs, dout)
    compiled = run_and_grad(torch.compile(experts, fullgraph=True, backend="aot_eager"), inputs, dout)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_inductor_fp8_layer_under_autocast_matches_eager():
    """Inductor over a step under bf16 autocast with fp32 master weights (``--precision fp8-mixed``'s): the eager
    output and gradients within bf16 rounding (inductor fuses the router's and the loss's own ops)."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU (run with -m gpu on the device)")
    layer = _layer(256, 128, device="cuda")
    x = torch.randn(2, 40, 256, device="cuda")

    def step(xi):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return layer(xi)
    eager = _run(layer, step, x)
    for a, b in zip(_run(layer, torch.compile(step, fullgraph=True), x), eager):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())
