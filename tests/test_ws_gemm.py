"""The warp-specialized Gluon GEMM of F1 and B1 (``moeblaze.kernels.ws_gemm``) against the float64 reference.

It runs only on an sm90 GPU with triton 3.6 (Gluon kernels have no CPU interpreter), so apart from the
gating checks these tests are ``gpu``-marked and skip elsewhere. Shapes keep d a multiple of 64, the
kernel's condition, and cover the edge cases of DESIGN.md §7; each test asserts that the warp-specialized
launcher actually ran.
"""

import pytest
import torch

from moeblaze import build_dispatch, ops_torch
from moeblaze.kernels import experts as ops_triton
from moeblaze.kernels import launch
from moeblaze.kernels.tuning import ws_enabled
from moeblaze.testing import make_expert_inputs, rel_error, run_and_grad
from test_experts_triton import NAMES, check_against_reference, triton_experts

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_ws = pytest.mark.skipif(not (HAS_CUDA and ws_enabled(torch.device("cuda"))),
                              reason="needs an sm90 GPU and triton 3.6")


def test_ws_gating_on_cpu_and_by_env(monkeypatch):
    """Never on the CPU or in the interpreter; ``MOEBLAZE_WS=0`` switches it off; wrong shapes fall back."""
    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    w = torch.zeros(2, 128, 64, dtype=torch.bfloat16)
    assert not ws_enabled(torch.device("cpu"))
    assert not launch.ws_ok(x, w, (x,), 64)
    if HAS_CUDA and ws_enabled(torch.device("cuda")):
        xc, wc = x.cuda(), w.cuda()
        assert launch.ws_ok(xc, wc, (xc,), 64)
        assert not launch.ws_ok(xc.float(), wc.float(), (xc,), 64)  # 16-bit only
        assert not launch.ws_ok(xc[:, :48], wc[..., :48], (xc,), 48)  # k_dim % 64
        assert not launch.ws_ok(xc, wc.transpose(1, 2), (xc,), 64)  # weight not contiguous
        monkeypatch.setenv("MOEBLAZE_WS", "0")
        assert not launch.ws_ok(xc, wc, (xc,), 64)


def _count_ws_launches(monkeypatch) -> list[bool]:
    calls = []
    real = ops_triton.grouped_gemm_ws
    monkeypatch.setattr(ops_triton, "grouped_gemm_ws", lambda *a, **k: calls.append(k["gated"]) or real(*a, **k))
    return calls


WS_CASES = {  # T, d, h, E, K, routing
    "T=1": (1, 64, 64, 4, 2, "uniform"),
    "T<tile": (5, 128, 96, 3, 2, "uniform"),
    "h not a multiple of the tile": (300, 192, 200, 5, 2, "zipf"),
    "empty experts": (200, 64, 128, 8, 2, "empty_experts"),
    "all on one expert": (700, 128, 64, 8, 1, "one_expert"),
    "K=E": (100, 64, 64, 5, 5, "uniform"),
    "prime E, many tiles": (3000, 256, 384, 13, 3, "zipf"),
}


@gpu
@needs_ws
@pytest.mark.parametrize("save", ["preact", "input"])
@pytest.mark.parametrize("case", WS_CASES)
def test_gpu_ws_edge_cases(case, save, monkeypatch):
    calls = _count_ws_launches(monkeypatch)
    T, d, h, E, K, routing = WS_CASES[case]
    inp = make_expert_inputs(T, d, h, E, K, "swiglu", torch.bfloat16, device="cuda", routing=routing)
    check_against_reference(inp, "swiglu", save)
    assert True in calls and False in calls  # F1 and B1 took the warp-specialized path


@gpu
@needs_ws
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_gpu_ws_two_runs_bitwise_and_close_to_the_triton_path(activation, monkeypatch):
    calls = _count_ws_launches(monkeypatch)
    inp = make_expert_inputs(2000, 256, 320, 16, 4, activation, torch.bfloat16, device="cuda", routing="zipf")
    dout = torch.randn_like(inp["x"])
    first = run_and_grad(triton_experts(activation, "preact"), inp, dout)
    second = run_and_grad(triton_experts(activation, "preact"), inp, dout)
    assert calls
    monkeypatch.setenv("MOEBLAZE_WS", "0")
    other = run_and_grad(triton_experts(activation, "preact"), inp, dout)
    for name, a, b, c in zip(NAMES, first, second, other):
        assert torch.equal(a, b), name
        assert rel_error(a, c) < 1e-2, (name, rel_error(a, c))  # bf16 roundings of two summation orders


@gpu
@needs_ws
@pytest.mark.parametrize("flags", [(True, True), (True, False), (False, True)])
def test_gpu_ws_up_forward_store_flags(flags, monkeypatch):
    """F1's ``pre``/``act`` outputs one by one against the torch backend computed in fp32."""
    calls = _count_ws_launches(monkeypatch)
    inp = make_expert_inputs(900, 128, 192, 6, 2, "swiglu", torch.bfloat16, device="cuda", routing="zipf")
    index = build_dispatch(inp["topk_ids"], 6)
    got = ops_triton.up_forward(inp["x"], inp["w_gate_up"], index, "swiglu", *flags)
    want = ops_torch.up_forward(inp["x"].float(), inp["w_gate_up"].float(), index, "swiglu", *flags)
    assert calls == [True]
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            assert g.dtype == torch.bfloat16 and rel_error(g, w) < 8e-3
