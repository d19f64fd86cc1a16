"""One ``MoE.forward`` goes down once: the backend resolved once, the experts' input checks and the autocast casts
made once per step (the layer's own; the public ``moe_experts`` / ``moe_experts_general`` still check fully)."""

import collections
import functools
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moeblaze
from moeblaze import (
    MoE,
    amp,
    backends,
    dispatch,
    expert_checks,
    experts,
    general_routing,
    moe_experts,
    moe_experts_general,
)
from moeblaze.testing import make_expert_inputs

# What a layer step could repeat: backend resolution, the experts' input checks, the autocast casts
_COUNTED = {
    backends: ("get_backend",),
    expert_checks: ("check_inputs", "check_options", "check_weight_shapes", "check_tokens", "check_weight_dtypes"),
    experts: ("autocast_expert_operands",),
    dispatch: ("check_pairs", "check_index_matches"),
    general_routing: ("moe_experts_general",),
    amp: ("autocast_target",),
}


@pytest.fixture
def counted(monkeypatch) -> collections.Counter:
    """Invocations of the functions of ``_COUNTED``, under every name a moeblaze module imported them by."""
    counts = collections.Counter()

    def counting(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    modules = [m for n, m in list(sys.modules.items()) if n.startswith("moeblaze") and m is not None]
    for home, names in _COUNTED.items():
        for name in names:
            fn = getattr(home, name)
            wrapped = counting(name, fn)
            for mod in modules:
                if getattr(mod, name, None) is fn:
                    monkeypatch.setattr(mod, name, wrapped)
    return counts


class _Casts(TorchDispatchMode):
    """Counts the dtype casts (``aten._to_copy``) of each given tensor's storage."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.names = {t.untyped_storage().data_ptr(): n for n, t in tensors.items()}
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
            name = self.names.get(args[0].untyped_storage().data_ptr())
            if name is not None and (kwargs or {}).get("dtype", args[0].dtype) != args[0].dtype:
                self.counts[name] += 1
        return func(*args, **(kwargs or {}))


STEPS = {  # (backend, autocast, token_rounding, bias)
    "torch": ("torch", False, None, False),
    "torch bias autocast": ("torch", True, None, True),
    "torch rounding": ("torch", False, "nr", False),
    "torch rounding bias autocast": ("torch", True, "up", True),
    "triton": ("triton", False, None, True),
}


@pytest.mark.parametrize("step", list(STEPS))
def test_one_forward_resolves_checks_and_casts_once(step, counted):
    backend, autocast, rounding, bias = STEPS[step]
    torch.manual_seed(0)
    m = MoE(16, 8, 4, 2, backend=backend, token_rounding=rounding, rounding_tile=4, bias=bias).train()
    x = torch.randn(2, 12, 16, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = m(x)
    assert out.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert counted["get_backend"] == 1  # resolved by the layer, passed down as the Backend object
    # the layer's checks of what the router does not guarantee (x floating point, in the weights' dtype) ...
    assert counted["check_tokens"] == counted["check_weight_dtypes"] == 1
    # ... and none of the public functions' full checks, nor the experts' own autocast step
    for name in ("check_inputs", "check_options", "check_weight_shapes", "check_index_matches",
                 "moe_experts_general", "autocast_expert_operands"):
        assert counted[name] == 0, name
    assert counted["check_pairs"] == (rounding is not None)  # the pair index's build checks its shapes, once
    assert counted["autocast_target"] == 2  # the layer's (x and the expert parameters) and the router's (its weight)
    out.float().sum().backward()
    assert x.grad is not None and m.w_down.grad is not None


def test_expert_parallel_forward_resolves_and_checks_once(counted):
    """An expert-parallel layer (one gloo rank in this process) runs its received rows with the layer's backend:
    one resolution, the layer's checks only, and the biases cast once under autocast."""
    import torch.distributed as dist

    from dist_utils import free_port
    from moeblaze.parallel import expert_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        m = expert_parallel(MoE(16, 8, 4, 2, backend="torch", bias=True), dist.group.WORLD, exchange="padded")
        x = torch.randn(24, 16, requires_grad=True)
        counted.clear()
        with torch.autocast("cpu", torch.bfloat16):
            out = m(x)
        assert out.dtype == torch.bfloat16 and counted["get_backend"] == 1
        assert counted["check_tokens"] == counted["check_weight_dtypes"] == 1
        assert counted["check_inputs"] == counted["check_options"] == counted["autocast_expert_operands"] == 0
        out.float().sum().backward()
        assert x.grad is not None and m.b_down.grad is not None
    finally:
        dist.destroy_process_group()


def test_autocast_casts_each_operand_once():
    """Under autocast with fp32 parameters, each fp32 operand is cast to bf16 once per forward: ``x`` for the router
    and the experts, the router weight, the expert weights (inside the experts' Functions) and the biases."""
    torch.manual_seed(0)
    m = MoE(16, 8, 4, 2, backend="torch", bias=True).train()
    x = torch.randn(24, 16, requires_grad=True)
    named = {"x": x, **dict(m.named_parameters())}
    with torch.autocast("cpu", torch.bfloat16), _Casts(named) as casts:
        m(x)
    assert casts.counts == dict.fromkeys(named, 1), casts.counts


def test_public_functions_still_check_and_resolve_once(counted):
    inputs = make_expert_inputs(9, 16, 8, 4, 2, seed=0)
    moe_experts(**inputs, backend="torch")
    assert counted["get_backend"] == 1 and counted["check_inputs"] == counted["check_options"] == 1
    counted.clear()
    pairs = general_routing.topk_to_pairs(inputs["topk_ids"], inputs["topk_weights"])
    moe_experts_general(inputs["x"], *pairs, inputs["w_gate_up"], inputs["w_down"], backend="torch")
    assert counted["get_backend"] == 1 and counted["check_weight_shapes"] == counted["check_options"] == 1


def test_public_moe_experts_still_raises_clear_errors():
    inputs = make_expert_inputs(9, 16, 8, 4, 2, seed=0)
    with pytest.raises(ValueError, match=r"w_down \[E, d, h\] must have d=16"):
        moe_experts(**{**inputs, "w_down": torch.randn(4, 15, 8)}, backend="torch")
    with pytest.raises(TypeError, match="x has dtype torch.float64; expected the weights' dtype torch.float32"):
        moe_experts(**{**inputs, "x": inputs["x"].double()}, backend="torch")
    with pytest.raises(ValueError, match="x must be a floating-point tensor of shape"):
        moe_experts(**{**inputs, "x": inputs["x"].long()}, backend="torch")
    with pytest.raises(ValueError, match="index was built for E=4"):
        moe_experts(**inputs, backend="torch", index=moeblaze.build_dispatch(inputs["topk_ids"][:3], 4))
    with torch.autocast("cpu", torch.bfloat16), pytest.raises(TypeError, match="x torch.float64, w_gate_up"):
        moe_experts(**{k: v.double() if k != "topk_ids" else v for k, v in inputs.items()}, backend="torch")
    with pytest.raises(ValueError, match="expert_idx must have shape"):
        moe_experts_general(inputs["x"], torch.arange(9), torch.zeros(8, dtype=torch.long), torch.ones(9),
                            inputs["w_gate_up"], inputs["w_down"], backend="torch")


def test_layer_errors_name_the_input():
    m = MoE(16, 8, 4, 2)
    with pytest.raises(TypeError, match="x has dtype torch.float64; expected the weights' dtype torch.float32"):
        m(torch.randn(3, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="MoE input x must be a floating-point tensor, got torch.int64"):
        m(torch.ones(3, 16, dtype=torch.long))  # before the router reads it
    m.fp8 = "blockwise"  # an attribute: checked at each forward
    with pytest.raises(TypeError, match="fp8 must be None or a moeblaze.fp8.Float8Recipe"):
        m(torch.randn(3, 16))


def test_layer_checks_its_expert_parameters_once_too():
    """What the public functions checked and the layer must still catch: fp64 expert parameters under autocast
    (autocast never casts fp64; with logits_dtype="input" the router does not look at them) and, outside
    autocast, a bias in another dtype (a checkpoint loaded with assign=True, say)."""
    m = MoE(16, 32, 4, 2, dtype=torch.float64, logits_dtype="input", backend="torch")
    with torch.autocast("cpu", torch.bfloat16), pytest.raises(TypeError, match=r"w_gate_up torch.float64.*never fp64"):
        m(torch.randn(6, 16))
    m = MoE(16, 32, 4, 2, bias=True, backend="torch")
    m.b_down.data = m.b_down.data.double()
    with pytest.raises(TypeError, match="b_down has dtype torch.float64; expected x's dtype torch.float32"):
        m(torch.randn(6, 16))
