"""The warp-specialized Gluon B1 (``moeblaze.kernels.ws_b1``) against the float64 reference and the
two-launch B1 it replaces on sm90.

It runs only on an sm90 GPU with triton 3.6 (Gluon kernels have no CPU interpreter), so apart from the
gating checks these tests are ``gpu``-marked and skip elsewhere. Shapes keep d a multiple of 64, the
kernel's condition, and cover the edge cases of DESIGN.md §7; each test asserts that the
warp-specialized launcher actually ran.
"""

import pytest
import torch

from moeblaze import build_dispatch
from moeblaze.activations import ACTIVATIONS
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
    dout = torch.zeros(8, 64, dtype=torch.bfloat16)
    w2 = torch.zeros(2, 64, 128, dtype=torch.bfloat16)
    pre = torch.zeros(8, 256, dtype=torch.bfloat16)
    assert not ws_enabled(torch.device("cpu"))
    assert not launch.ws_b1_ok(dout, w2, pre, pre)
    if HAS_CUDA and ws_enabled(torch.device("cuda")):
        dout, w2, pre = dout.cuda(), w2.cuda(), pre.cuda()
        assert launch.ws_b1_ok(dout, w2, pre, pre)
        assert not launch.ws_b1_ok(dout.float(), w2.float(), pre.float(), pre.float())  # 16-bit only
        assert not launch.ws_b1_ok(dout[:, :48], w2[:, :48].contiguous(), pre, pre)  # d % 64
        assert not launch.ws_b1_ok(dout, w2.transpose(1, 2).contiguous().transpose(1, 2), pre, pre)  # not contiguous
        assert not launch.ws_b1_ok(dout, w2, pre[:, 1:], pre)  # rows not 16-byte aligned
        monkeypatch.setenv("MOEBLAZE_WS", "0")
        assert not launch.ws_b1_ok(dout, w2, pre, pre)


def _count_ws_launches(monkeypatch) -> list[int]:
    calls = []
    real = ops_triton.ws_b1
    monkeypatch.setattr(ops_triton, "ws_b1", lambda *a, **k: calls.append(k["activation"]) or real(*a, **k))
    return calls


WS_CASES = {  # T, d, h, E, K, routing
    "T=1": (1, 64, 64, 4, 2, "uniform"),
    "T<tile": (5, 128, 96, 3, 2, "uniform"),
    "h not a multiple of the tile": (300, 192, 200, 5, 2, "zipf"),
    "empty experts": (200, 64, 128, 8, 2, "empty_experts"),
    "all on one expert": (700, 128, 64, 8, 1, "one_expert"),
    "K=E": (100, 64, 64, 5, 5, "uniform"),
    "prime E, many tiles": (3000, 256, 600, 13, 3, "zipf"),
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
    assert calls  # B1 took the warp-specialized path


@gpu
@needs_ws
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gpu_ws_every_activation(activation, monkeypatch):
    calls = _count_ws_launches(monkeypatch)
    inp = make_expert_inputs(700, 128, 320, 6, 2, activation, torch.bfloat16, device="cuda", routing="zipf")
    check_against_reference(inp, activation, "preact")
    assert calls


@gpu
@needs_ws
@pytest.mark.parametrize("activation", ["swiglu", "geglu", "relu"])
@pytest.mark.parametrize("need", [(True, True), (True, False), (False, True)])
def test_gpu_ws_matches_the_two_launch_b1(activation, need, monkeypatch):
    """dpre and dW_down bitwise equal to the two-launch B1 (same rounded dact', same math), dtopk_weights
    within fp32 reordering (partials per 256-column n-tile); two runs bitwise equal."""
    need_dw, need_dtw = need
    inp = make_expert_inputs(2000, 256, 704, 16, 4, activation, torch.bfloat16, device="cuda", routing="zipf")
    index = build_dispatch(inp["topk_ids"], 16)
    pre0, _ = ops_triton.up_forward(inp["x"], inp["w_gate_up"], index, activation, True, False)
    dout = torch.randn_like(inp["x"])

    def b1():
        pre = pre0.clone()
        return ops_triton.down_backward(dout, pre, inp["w_down"], inp["topk_weights"], index, activation,
                                        need_dw, need_dtw)

    calls = _count_ws_launches(monkeypatch)
    first, second = b1(), b1()
    assert len(calls) == 2
    monkeypatch.setenv("MOEBLAZE_WS", "0")
    other = b1()
    assert len(calls) == 2
    for a, b, c, name in zip(first, second, other, ("dpre", "dw_down", "dtopk_weights")):
        assert (a is None) == (c is None), name
        if a is None:
            continue
        assert torch.equal(a, b), name
        if name == "dtopk_weights":
            assert rel_error(a, c) < 1e-5, (name, rel_error(a, c))
        else:
            assert torch.equal(a, c), name


@gpu
@needs_ws
def test_gpu_ws_two_runs_bitwise_and_close_to_the_two_launch_path(monkeypatch):
    calls = _count_ws_launches(monkeypatch)
    inp = make_expert_inputs(2000, 256, 320, 16, 4, "swiglu", torch.bfloat16, device="cuda", routing="zipf")
    dout = torch.randn_like(inp["x"])
    first = run_and_grad(triton_experts("swiglu", "preact"), inp, dout)
    second = run_and_grad(triton_experts("swiglu", "preact"), inp, dout)
    assert calls
    monkeypatch.setenv("MOEBLAZE_WS", "0")
    other = run_and_grad(triton_experts("swiglu", "preact"), inp, dout)
    for name, a, b, c in zip(NAMES, first, second, other):
        assert torch.equal(a, b), name
        assert rel_error(a, c) < 1e-5, (name, rel_error(a, c))  # only dtopk_weights' fp32 order differs
