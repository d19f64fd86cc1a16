"""The Triton FP8 layer's backward (``moeblaze.kernels.fp8_experts``): B3's e4m3 ``dpre``, written by B1's activation
backward into the kept e4m3 ``pre``'s storage, that storage given back before B4, and a second backward through such
a graph refused (DESIGN.md §8); the numerics against the emulation: test_fp8.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from moeblaze import moe_experts
from moeblaze.fp8 import E4M3, Float8Recipe
from moeblaze.testing import make_expert_inputs, run_and_grad, triton_on_cpu
from test_fp8 import CASES, NAMES, one_thread  # noqa: F401  (one_thread: the autouse fixture)

TRITON_ON_CPU = triton_on_cpu()


@pytest.mark.skipif(not TRITON_ON_CPU,
                    reason="the Triton kernels on CPU tensors need TRITON_INTERPRET=1")
def test_triton_b3_writes_its_e4m3_dpre_into_the_kept_pre(monkeypatch):
    """The Triton FP8 backward writes B3's e4m3 dpre into the kept e4m3 pre, dead after the activation backward,
    and gives that storage back before B4 allocates dW_gate_up; a second backward through the graph raises."""
    from moeblaze.kernels import fp8_experts

    inputs = make_expert_inputs(40, 32, 16, 4, 2)
    for name in ("x", "w_gate_up", "w_down"):
        inputs[name].requires_grad_()
    kept, seen, real = [], [], fp8_experts.up_backward
    monkeypatch.setattr(fp8_experts, "up_backward", lambda *a, **kw: seen.append(
        (a[5], a[6], kept[0][0].untyped_storage().nbytes())) or real(*a, **kw))  # need_dx, need_dw, kept bytes

    def pack(t):
        if t.dtype == E4M3:
            kept.append((t, t.untyped_storage().nbytes()))
        return t

    def run(backend):
        return moe_experts(**inputs, backend=backend, save="preact", fp8=Float8Recipe("rowwise"))

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run("triton")
    out.sum().backward()
    ((numel, nbytes),) = [(t.numel(), n) for t, n in kept]  # ints only: a freed tensor's repr reads its storage
    assert nbytes == numel and seen == [(True, False, nbytes), (False, True, 0)]  # B3, then B4 on it freed
    for hooks in (torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), contextlib.nullcontext()):
        with hooks:  # a second backward is refused, under hooks too (autograd checks no hooked tensor's version)
            out = run("triton")
        out.sum().backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="second backward"):
            out.sum().backward()
    kept.clear()  # the emulation writes nothing into the kept pre: it is left, and a second backward runs
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run("torch")
    grads = torch.autograd.grad(out.sum(), inputs["x"], retain_graph=True)[0]
    assert kept[0][0].untyped_storage().nbytes() == kept[0][1]
    torch.testing.assert_close(torch.autograd.grad(out.sum(), inputs["x"])[0], grads, rtol=0, atol=0)


@pytest.mark.skipif(not TRITON_ON_CPU,
                    reason="the Triton kernels on CPU tensors need TRITON_INTERPRET=1")
def test_triton_b1_quantizes_b3s_dpre_where_cuda_would(monkeypatch):
    """The CUDA path (B1's activation backward writes B3's e4m3 dpre into the kept pre) run in the interpreter,
    every operand quantized by the Triton kernels as on CUDA: bitwise the results of quantizing dpre in a launch
    of its own."""
    from moeblaze.kernels import fp8_experts
    from moeblaze.kernels.fp8_quant import quantize_rows_fp8

    monkeypatch.setattr(fp8_experts, "_rows", lambda t, pow2, out=None, as_dtype=None:
                        quantize_rows_fp8(t, pow2, out, as_dtype))
    inputs = make_expert_inputs(*CASES["short last tiles"][:5])
    dout = torch.randn(inputs["x"].shape)

    def run():
        return run_and_grad(lambda **kw: moe_experts(**kw, backend="triton", fp8=Float8Recipe()), inputs, dout)

    alone = run()
    fused = []
    monkeypatch.setattr(fp8_experts, "_fuses_dpre", lambda data, t: fused.append(data is not None) or
                        data is not None)
    for name, a, b in zip(NAMES, run(), alone):
        assert torch.equal(a, b), name
    assert fused == [True, True]  # B1 wrote it, B3 took it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a Hopper GPU (sm90+)")
def test_gpu_b1_writing_b3s_dpre_is_bitwise_the_separate_launch(monkeypatch):
    """On the device, B3's e4m3 dpre written by B1's activation backward: every result bitwise that of quantizing
    dpre in a launch of its own, but ``dtopk_weights``, whose row sums the kernel variant with the quantization
    compiles in another order (a few fp32 ulps)."""
    from moeblaze.kernels import fp8_experts

    inputs = make_expert_inputs(*CASES["zipf"][:5], routing="zipf", dtype=torch.bfloat16, device="cuda")
    dout = torch.randn(inputs["x"].shape, dtype=torch.bfloat16, device="cuda")

    def run():
        return run_and_grad(lambda **kw: moe_experts(**kw, backend="triton", fp8=Float8Recipe()), inputs, dout)

    fused = run()
    monkeypatch.setattr(fp8_experts, "_fuses_dpre", lambda data, t: False)
    for name, a, b in zip(NAMES, fused, run()):
        if name == "dtopk_weights":
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
        else:
            assert torch.equal(a, b), name
