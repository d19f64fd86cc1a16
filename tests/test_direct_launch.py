"""Direct launches of compiled Triton kernels (``moeblaze.kernels.direct``).

CPU: the signature logic against a stand-in jitted function — the first launch of a signature goes through
``fn[grid]``, repeats call the compiled kernel's launcher with every argument in order, and anything Triton
specialises on (constexpr values, tensor dtype and alignment, integer type / 1 / % 16, launch options) makes
a new signature. GPU: a layer step's kernels are launched directly after the first step, and the results
equal Triton's own launch bitwise.
"""

from __future__ import annotations

import types

import pytest
import torch

from moeblaze.kernels import direct


class _Param:
    def __init__(self, name, constexpr):
        self.name, self.is_constexpr, self.has_default = name, constexpr, False


class _FakeJit:
    """A jitted function's interface as :func:`direct.launch` reads it; records Triton-path launches."""

    arg_names = ["x_ptr", "n", "scale", "BLOCK"]
    params = [_Param("x_ptr", False), _Param("n", False), _Param("scale", False), _Param("BLOCK", True)]

    def __init__(self):
        self.compiled, self.launched = [], []

    def __getitem__(self, grid):
        def run(**kwargs):
            kernel = types.SimpleNamespace(function=len(self.compiled), packed_metadata="meta",
                                           run=lambda *a: self.launched.append(a))
            self.compiled.append((grid, kwargs))
            return kernel
        return run


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(direct.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(direct, "driver", types.SimpleNamespace(
        active=types.SimpleNamespace(get_current_stream=lambda device: 1234)))
    direct._PLANS.clear()
    yield
    direct._PLANS.clear()


def test_repeat_launch_calls_the_compiled_launcher_with_arguments_in_order(fake_gpu):
    fn, x = _FakeJit(), torch.zeros(64)
    direct.launch(fn, lambda meta: (meta["n"] // meta["BLOCK"], 2), x_ptr=x, n=64, scale=0.5, BLOCK=16, num_warps=4)
    assert len(fn.compiled) == 1 and fn.launched == []
    direct.launch(fn, lambda meta: (meta["n"] // meta["BLOCK"], 2), n=64, x_ptr=x, scale=0.25, BLOCK=16, num_warps=4)
    assert len(fn.compiled) == 1
    (args,) = fn.launched
    assert args[:7] == (4, 2, 1, 1234, 0, "meta", None) and args[9:] == (x, 64, 0.25, 16)
    assert direct.direct_signatures() == 1


@pytest.mark.parametrize("change", [
    {"BLOCK": 32},                      # a constexpr value
    {"n": 40},                          # an int no longer divisible by 16
    {"n": 1},                           # an int equal to 1
    {"n": 2**31 + 16},                  # an int past int32
    {"num_warps": 8},                   # a launch option
    {"x_ptr": "offset"},                # a tensor no longer 16-byte aligned
    {"x_ptr": "half"},                  # another dtype
])
def test_what_triton_specialises_on_makes_a_new_signature(fake_gpu, change):
    fn, x = _FakeJit(), torch.zeros(64)
    base = dict(x_ptr=x, n=64, scale=1.0, BLOCK=16, num_warps=4)
    direct.launch(fn, (1,), **base)
    swap = {"offset": x[1:], "half": x.half()}
    changed = {k: swap.get(v, v) if isinstance(v, str) else v for k, v in change.items()}
    direct.launch(fn, (1,), **{**base, **changed})
    assert len(fn.compiled) == 2 and fn.launched == []
    direct.launch(fn, (1,), **{**base, **changed})
    assert len(fn.compiled) == 2 and len(fn.launched) == 1


class TensorDescriptor:  # the fields of a host tensor descriptor (Gluon's, triton.tools') that a launch reads
    def __init__(self, base, block_shape, layout="nvmma128", padding="zero"):
        self.base, self.block_shape, self.layout, self.padding = base, block_shape, layout, padding
        self.shape, self.strides = list(base.shape), list(base.stride())


@pytest.mark.parametrize("change", [{"block_shape": [32, 64]}, {"layout": "nvmma64"}, {"base": "half"}])
def test_host_tensor_descriptors_launch_directly_keyed_on_their_type(fake_gpu, change):
    """A descriptor argument (the warp-specialized Gluon kernels' TMA operands) launches directly; another block
    shape, shared layout or dtype is another compiled kernel; another tensor of the same type is not."""
    fn, x = _FakeJit(), torch.zeros(64, 64)
    desc = TensorDescriptor(x, [64, 64])
    direct.launch(fn, (1,), x_ptr=desc, n=64, scale=1.0, BLOCK=16)
    direct.launch(fn, (1,), x_ptr=TensorDescriptor(torch.ones(128, 64), [64, 64]), n=64, scale=1.0, BLOCK=16)
    assert len(fn.compiled) == 1 and fn.launched[0][9] is not desc  # the new descriptor reaches the launcher
    kw = {"base": x, "block_shape": [64, 64], **change}
    kw["base"] = x.half() if kw["base"] == "half" else kw["base"]
    direct.launch(fn, (1,), x_ptr=TensorDescriptor(**kw), n=64, scale=1.0, BLOCK=16)
    assert len(fn.compiled) == 2 and len(fn.launched) == 1


def test_launch_hooks_take_triton_s_launch(fake_gpu, monkeypatch):
    fn, x = _FakeJit(), torch.zeros(64)
    monkeypatch.setattr(direct.triton.knobs.runtime, "launch_enter_hook", lambda *a: None)  # Triton <= 3.6's form
    for _ in range(3):
        direct.launch(fn, (1,), x_ptr=x, n=64, scale=1.0, BLOCK=16)
    assert len(fn.compiled) == 3 and fn.launched == [] and direct.direct_signatures() == 0


def test_integers_of_one_type_share_a_signature(fake_gpu):
    fn, x = _FakeJit(), torch.zeros(64)
    for n in (2**31 + 16, 2**33 + 32, 2**40):  # all i64, divisible by 16: one signature
        direct.launch(fn, (1,), x_ptr=x, n=n, scale=1.0, BLOCK=16)
    assert len(fn.compiled) == 1 and len(fn.launched) == 2 and direct.direct_signatures() == 1


def test_repeated_integer_values_reuse_the_signature_through_a_bounded_fast_table(fake_gpu, monkeypatch):
    """Each new integer value looks up Triton's signature once (no new compile), then hits the fast table; the
    table starts afresh past MAX_FAST_KEYS (a token count that changes every step)."""
    monkeypatch.setattr(direct, "MAX_FAST_KEYS", 4)
    fn, x = _FakeJit(), torch.zeros(64)
    for n in [64, 128, 192] * 2 + [16 * i for i in range(20, 30)]:
        direct.launch(fn, (1,), x_ptr=x, n=n, scale=1.0, BLOCK=16)
    plan = direct._PLANS[fn]
    assert len(fn.compiled) == 1 and len(fn.launched) == 15 and len(plan.fast) <= 4


class _FakeGluon(_FakeJit):
    """A Gluon kernel: ``num_warps`` is one of its (constexpr) arguments as well as a launch option."""

    arg_names = [*_FakeJit.arg_names, "num_warps"]
    params = [*_FakeJit.params, _Param("num_warps", True)]


def test_a_kernel_taking_num_warps_as_an_argument_launches_directly(fake_gpu):
    fn, x = _FakeGluon(), torch.zeros(64)
    for _ in range(3):
        direct.launch(fn, (1,), x_ptr=x, n=64, scale=1.0, BLOCK=16, num_warps=8, maxnreg=168)
    assert len(fn.compiled) == 1 and len(fn.launched) == 2
    direct.launch(fn, (1,), x_ptr=x, n=64, scale=1.0, BLOCK=16, num_warps=4, maxnreg=168)
    assert len(fn.compiled) == 2


def test_an_unknown_keyword_and_interpreted_kernels_take_triton_s_launch(fake_gpu):
    fn, x = _FakeJit(), torch.zeros(64)
    for _ in range(2):
        direct.launch(fn, (1,), x_ptr=x, n=64, scale=1.0, BLOCK=16, num_wraps=4)  # Triton reports the typo
    assert len(fn.compiled) == 2 and fn.launched == []

    class _FakeInterpreted(_FakeJit, direct.InterpretedFunction):
        pass

    fn = _FakeInterpreted()
    for _ in range(2):
        direct.launch(fn, (1,), x_ptr=x, n=64, scale=1.0, BLOCK=16)
    assert len(fn.compiled) == 2 and fn.launched == [] and direct.direct_signatures() == 0


def test_debug_mode_and_pre_run_hooks_take_triton_s_launch(fake_gpu, monkeypatch):
    fn, x = _FakeJit(), torch.zeros(64)
    monkeypatch.setattr(direct.triton.knobs.runtime, "debug", True)
    for _ in range(2):
        direct.launch(fn, (1,), x_ptr=x, n=64, scale=1.0, BLOCK=16)
    monkeypatch.setattr(direct.triton.knobs.runtime, "debug", False)
    fn.pre_run_hooks = [lambda *a, **k: None]
    for _ in range(2):
        direct.launch(fn, (1,), x_ptr=x, n=64, scale=1.0, BLOCK=16)
    assert len(fn.compiled) == 4 and fn.launched == []


def test_a_hook_chain_with_hooks_takes_triton_s_launch(fake_gpu, monkeypatch):
    chain = getattr(direct.triton.knobs, "HookChain", None)
    if chain is None:
        pytest.skip("this Triton has no HookChain")
    fn, x, hooks = _FakeJit(), torch.zeros(64), chain()
    monkeypatch.setattr(direct.triton.knobs.runtime, "launch_exit_hook", hooks)
    direct.launch(fn, (1,), x_ptr=x, n=64, scale=1.0, BLOCK=16)
    direct.launch(fn, (1,), x_ptr=x, n=64, scale=1.0, BLOCK=16)
    assert len(fn.launched) == 1  # an empty chain: direct
    hooks.add(lambda *a: None)
    direct.launch(fn, (1,), x_ptr=x, n=64, scale=1.0, BLOCK=16)
    assert len(fn.compiled) == 2 and len(fn.launched) == 1


def test_a_launcher_of_another_convention_falls_back_to_triton(fake_gpu):
    fn, x = _FakeJit(), torch.zeros(64)

    def bad_run(*a):
        raise TypeError("function takes 12 arguments")

    direct.launch(fn, (1,), x_ptr=x, n=64, scale=1.0, BLOCK=16)
    plan = direct._PLANS[fn]
    (sig,) = plan.kernels
    plan.kernels[sig] = (bad_run, 0, "meta")
    for _ in range(2):
        direct.launch(fn, (1,), x_ptr=x, n=64, scale=1.0, BLOCK=16)
    assert len(fn.compiled) == 3 and direct.direct_signatures() == 0


@pytest.mark.gpu
def test_gpu_layer_steps_launch_directly_and_match_triton_launch_bitwise(monkeypatch):
    import moeblaze

    torch.manual_seed(0)
    moe = moeblaze.MoE(256, 128, 8, 2, backend="triton", device="cuda", dtype=torch.bfloat16)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        for t in (x, *moe.parameters()):
            t.grad = None
        out = moe(x)
        (out.float().square().sum() + moe.aux_loss).backward()
        return [out.detach().clone(), x.grad.clone(), *(p.grad.clone() for p in moe.parameters())]

    step()  # the first launch of every signature: Triton's launch
    got = step()
    assert direct.direct_signatures() > 0, "no kernel was launched directly (Triton launcher convention?)"
    monkeypatch.setattr(direct, "_hooked", lambda: True)  # every launch through Triton's path
    want = step()
    for g, w in zip(got, want):
        assert torch.equal(g, w)
