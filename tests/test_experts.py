"""moe_experts (torch backend) against the float64 reference, saved bytes, and input errors."""

import pytest
import torch

from moeblaze import build_dispatch, moe_experts
from moeblaze.activations import ACTIVATIONS
from moeblaze.memory import SavedTensorCounter
from moeblaze.testing import (
    EDGE_CASES,
    assert_close_to_reference,
    make_expert_inputs,
    reference_outputs,
    router_weight_grad_alternative,
    router_weight_grad_magnitude,
    run_and_grad,
)

NAMES = ("out", "dx", "dw_gate_up", "dw_down", "dtopk_weights")


def check_against_reference(inputs, activation, save, backend="torch"):
    dt = inputs["x"].dtype
    dout = torch.randn(inputs["x"].shape, dtype=dt)
    got = run_and_grad(lambda **kw: moe_experts(**kw, activation=activation, save=save, backend=backend),
                       inputs, dout)
    ref = reference_outputs(inputs, activation, dout)
    base = reference_outputs(inputs, activation, dout, dtype=dt)
    alt = router_weight_grad_alternative(inputs, activation, dout, dt)
    for name, a, r, b in zip(NAMES, got, ref, base):
        assert a.dtype == (inputs["topk_weights"].dtype if name == "dtopk_weights" else dt), name
        if name == "dtopk_weights":
            mag = router_weight_grad_magnitude(inputs, activation, dout)
            assert_close_to_reference(name, a, r, (b, alt), magnitude=mag)
        else:
            assert_close_to_reference(name, a, r, b)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("save", ["preact", "input"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_activation_and_save_mode(activation, save, dtype):
    check_against_reference(make_expert_inputs(40, 24, 20, 6, 2, activation, dtype), activation, save)


@pytest.mark.parametrize("case", EDGE_CASES)
def test_edge_cases(case):
    T, d, h, E, K, routing = EDGE_CASES[case]
    check_against_reference(make_expert_inputs(T, d, h, E, K, "swiglu", torch.float32, routing=routing),
                            "swiglu", "preact")


def test_non_contiguous_inputs():
    inp = make_expert_inputs(30, 16, 12, 5, 2, "swiglu", torch.float32)
    inp["x"] = torch.randn(16, 30).t()  # column-major view
    inp["w_gate_up"] = inp["w_gate_up"].transpose(1, 2).contiguous().transpose(1, 2)
    inp["w_down"] = torch.randn(5, 12, 16).transpose(1, 2) / 4
    inp["topk_weights"] = inp["topk_weights"].t().contiguous().t()
    assert not inp["x"].is_contiguous() and not inp["w_down"].is_contiguous()
    check_against_reference(inp, "swiglu", "input")


def test_prebuilt_index_and_int64_ids():
    inp = make_expert_inputs(30, 16, 12, 5, 2, "geglu", torch.float32)
    inp["topk_ids"] = inp["topk_ids"].long()
    index = build_dispatch(inp["topk_ids"], 5)
    out = moe_experts(**inp, activation="geglu", index=index)
    assert torch.equal(out, moe_experts(**inp, activation="geglu"))


@pytest.mark.parametrize("save", ["preact", "input"])
@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_saved_bytes_match_design_formula(save, activation):
    """DESIGN.md §4: preact keeps x, pre [N, 2h] and the index; input keeps x and the index only."""
    T, d, h, E, K = 64, 32, 24, 8, 4
    inp = make_expert_inputs(T, d, h, E, K, activation, torch.bfloat16)
    x = inp.pop("x").requires_grad_()
    w1 = torch.nn.Parameter(inp.pop("w_gate_up"))
    w2 = torch.nn.Parameter(inp.pop("w_down"))
    tw = inp["topk_weights"].requires_grad_()
    with SavedTensorCounter(exclude=[w1, w2]) as counter:
        out = moe_experts(x, inp["topk_ids"], tw, w1, w2, activation, save,
                          backend="torch")
    saved = counter.bytes
    N, elt = T * K, x.element_size()
    index_bytes = 4 * (E + 1) + 12 * N  # offsets, slot->token, routing, pair->slot (int32)
    pre_bytes = N * w1.shape[1] * elt if save == "preact" else 0
    assert saved == T * d * elt + pre_bytes + tw.numel() * tw.element_size() + index_bytes
    out.sum().backward()  # the saved set is sufficient for backward
    assert x.grad is not None and w1.grad is not None and tw.grad is not None


def test_bad_inputs_give_clear_errors():
    inp = make_expert_inputs(10, 16, 8, 4, 2, "swiglu", torch.float32)

    def call(**over):
        return moe_experts(**{**inp, **over})

    with pytest.raises(ValueError, match="activation"):
        call(activation="tanh")
    with pytest.raises(ValueError, match="save"):
        call(save="everything")
    with pytest.raises(ValueError, match="backend"):
        call(backend="cuda")
    with pytest.raises(ValueError, match=r"x must be .* \[T, d\]"):
        call(x=inp["x"][None])
    with pytest.raises(ValueError, match="w_gate_up"):
        call(w_gate_up=inp["w_gate_up"][:, :8])  # non-gated shape for a gated activation
    with pytest.raises(ValueError, match="w_down"):
        call(w_down=inp["w_down"][:, :15])
    with pytest.raises(ValueError, match="topk_ids"):
        call(topk_ids=inp["topk_ids"][:5])
    with pytest.raises(ValueError, match="topk_weights"):
        call(topk_weights=inp["topk_weights"][:, :1])
    with pytest.raises(TypeError, match="dtype"):
        call(w_down=inp["w_down"].double())
    with pytest.raises(TypeError, match="integer"):
        call(topk_ids=inp["topk_ids"].float())
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        call(topk_ids=inp["topk_ids"] + 3)
    with pytest.raises(ValueError, match="device"):
        call(w_down=inp["w_down"].to("meta"))


def test_backend_selection_errors(monkeypatch):
    inp = make_expert_inputs(6, 16, 8, 4, 2, "swiglu", torch.float32)
    monkeypatch.setenv("MOEBLAZE_BACKEND", "cuda")
    with pytest.raises(ValueError, match="MOEBLAZE_BACKEND"):
        moe_experts(**inp)
    monkeypatch.delenv("MOEBLAZE_BACKEND")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        moe_experts(**inp, backend="triton")


def test_auto_backend_keeps_float64_on_torch():
    inp = make_expert_inputs(6, 16, 8, 4, 2, "swiglu", torch.float64)
    assert moe_experts(**inp).dtype == torch.float64
