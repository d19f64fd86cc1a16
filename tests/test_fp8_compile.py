"""``torch.compile`` over the FP8 layer (issue 59's custom ops): on the CPU (Triton's interpreter) the compiled layer's
output and gradients are the eager ones; on the GPU the compiled backward's gradients are not (a known bug: dx and
the weight gradients differ, the output agrees), so a traced backward there raises, ``fullgraph=False`` runs the FP8
expert block eagerly (a graph break) and inference compiles."""

from __future__ import annotations

import pytest
import torch

from moeblaze import MoE, experts
from moeblaze.experts import SAVE_MODES
from moeblaze.fp8 import Float8Recipe
from moeblaze.testing import triton_on_cpu

HAS_CUDA = torch.cuda.is_available()
TRITON_ON_CPU = triton_on_cpu()
REFUSED = "FP8 expert block's backward on a GPU"


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


@pytest.mark.skipif(not TRITON_ON_CPU, reason="the Triton kernels on CPU tensors need TRITON_INTERPRET=1")
def test_a_refused_compiled_backward_raises_or_runs_eagerly(monkeypatch):
    """Where the traced backward is refused (the GPU's case, here forced): ``fullgraph=True`` raises naming the
    bug and the way around it; without it the FP8 expert block runs eagerly, the eager gradients bitwise."""
    monkeypatch.setattr(experts, "compiled_backward_unsupported", lambda dout: True)
    layer, x = _layer(), torch.randn(2, 9, 32)
    with pytest.raises(Exception, match=REFUSED):
        _run(layer, torch.compile(layer, fullgraph=True, backend="aot_eager"), x)
    torch._dynamo.reset()
    for a, b in zip(_run(layer, torch.compile(layer, backend="aot_eager"), x), _run(layer, layer, x)):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("d, h", [(256, 128), (256, 1536)])
def test_gpu_compiled_fp8_layer_refuses_its_backward_and_compiles_without_it(d, h):
    """On the GPU: ``fullgraph=True`` raises; without it the gradients are the eager ones; under ``no_grad`` the
    compiled forward (its custom ops' fake outputs: the weights' column maxima, none for rows of 1,536 that no tile
    holds whole) gives the eager output."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU (run with -m gpu on the device)")
    layer = _layer(d, h, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 40, d, device="cuda", dtype=torch.bfloat16)
    eager = _run(layer, layer, x)
    with pytest.raises(Exception, match=REFUSED):
        _run(layer, torch.compile(layer, fullgraph=True, backend="aot_eager"), x)
    torch._dynamo.reset()
    for a, b in zip(_run(layer, torch.compile(layer, backend="aot_eager"), x), eager):
        assert torch.equal(a, b)
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(torch.compile(layer, fullgraph=True, backend="aot_eager")(x), eager[0])


@pytest.mark.gpu
@pytest.mark.xfail(strict=True, reason="the compiled FP8 backward on the GPU gives other dx and weight gradients "
                                       "than the eager one (9405443 too): open; when this passes, drop the refusal")
def test_gpu_compiled_fp8_backward_matches_eager(monkeypatch):
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU (run with -m gpu on the device)")
    monkeypatch.setattr(experts, "compiled_backward_unsupported", lambda dout: False)
    layer = _layer(256, 128, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 40, 256, device="cuda", dtype=torch.bfloat16)
    eager = _run(layer, layer, x)
    for a, b in zip(_run(layer, torch.compile(layer, fullgraph=True, backend="aot_eager"), x), eager):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2 * b.abs().max().item())
