"""moeblaze as a transformers experts implementation (issue 22 item 1): tiny models of every supported
family give the logits, the loss (aux loss included) and every parameter gradient of transformers'
``eager`` experts within the DESIGN.md §7 rule, in float64 and float32 (PyTorch backend on the CPU)."""

from __future__ import annotations

import copy
import zlib

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")

import moeblaze.integrations.transformers as mhf  # noqa: E402
from hf_models import FAMILIES, NO_ROUTER_LOGITS, tiny_config, tiny_model  # noqa: E402
from moeblaze.testing import assert_close_to_reference, rel_error  # noqa: E402


@pytest.fixture(autouse=True)
def _seed(request):
    """Each test draws its random model and ids from a seed of its own name, not from whatever the tests run
    before it left in the global generator: a tolerance failure then reproduces alone (``pytest -k``)."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def run(model: nn.Module, impl: str, ids: torch.Tensor, family: str) -> dict[str, torch.Tensor]:
    """Logits, loss, aux loss and every parameter gradient of one forward + backward with ``impl``."""
    model.set_experts_implementation(impl)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, output_router_logits=family not in NO_ROUTER_LOGITS)
    out.loss.backward()
    res = {"logits": out.logits.detach(), "loss": out.loss.detach().reshape(1)}
    aux = getattr(out, "aux_loss", None)  # families without a load-balancing loss (DeepSeek-V3, GLM-4-MoE): None
    if isinstance(aux, torch.Tensor):
        res["aux_loss"] = aux.detach().reshape(1)
    for name, p in model.named_parameters():
        res["grad " + name] = p.grad.detach().clone() if p.grad is not None else None
    return res


# In float64, batched_mm can sum in eager's order and come out exactly equal to the reference, while any other
# order pays eps times the sum's condition number: GPT-OSS's router.weight gradient (through the top-k softmax,
# with cancellation) came out 4.6e-16 from eager, over the 2-eps floor (CPU, torch 2.13). 64 eps
# still fails any real error by orders of magnitude.
FP64_FLOOR = 64 * torch.finfo(torch.float64).eps
# Results of a few elements (the losses; GPT-OSS's per-head attention sinks, 4 numbers whose gradient sums the
# softmax's terms with cancellation) hold too few roundings for a ratio to one baseline's error to mean anything:
# the sinks' fp32 gradient came out 1.81e-6 from float64 against eager's 0.73e-6 (CPU, torch 2.13),
# with the logits and every expert gradient within the rule. They get a floor of 16 eps of their dtype.
SMALL = 16


def check(actual: dict, ref64: dict, baseline: dict, scalar_floor: float = 0.0) -> None:
    """DESIGN.md §7 on every output and gradient. ``scalar_floor``: the relative floor for one-element results
    (the losses; at least the ``SMALL`` floor) — one number's error against a baseline's is a lottery (the bf16
    baseline's loss came out within 4e-5 of float64 by luck while ours was 2e-4 on an H200, with
    logits and every gradient within the rule), so they are held to the model dtype's rounding instead."""
    assert actual.keys() == ref64.keys()
    for key, ref in ref64.items():
        if ref is None:  # a parameter without gradient (e.g. unused) must stay without one
            assert actual[key] is None and baseline[key] is None, key
            continue
        if ref.numel() <= SMALL:
            err, floor = rel_error(actual[key], ref), max(scalar_floor, 16 * torch.finfo(actual[key].dtype).eps)
            assert err <= 2 * rel_error(baseline[key], ref) + floor, f"{key}: relative error {err:.3e}"
            continue
        if actual[key].dtype == torch.float64:  # the baseline may share the reference's summation order
            err = rel_error(actual[key], ref)
            assert err <= 2 * rel_error(baseline[key], ref) + FP64_FLOOR, f"{key}: relative error {err:.3e}"
            continue
        assert_close_to_reference(key, actual[key], ref, baseline[key])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_eager(family, dtype):
    model = tiny_model(family, dtype)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    ref64 = run(copy.deepcopy(model).double(), "eager", ids, family)
    # Plain PyTorch's error in this dtype: transformers' eager loop, and for float64 (where eager is the
    # reference itself) its batched_mm implementation, a different summation order of the same maths.
    baseline = run(model, "eager" if dtype != torch.float64 else "batched_mm", ids, family)
    actual = run(model, "moeblaze", ids, family)
    experts = [m for m in model.modules() if hasattr(m, "has_gate")]
    assert experts and all("_moeblaze_plan" in m.__dict__ for m in experts), "moeblaze was not called"
    check(actual, ref64, baseline)


def test_from_config_uses_moeblaze(monkeypatch):
    seen = []
    real = mhf.moe_experts
    monkeypatch.setattr(mhf, "moe_experts", lambda *a, **k: seen.append((a, k)) or real(*a, **k))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"), experts_implementation="moeblaze")
    assert model.config._experts_implementation == "moeblaze"
    ids = torch.randint(0, 128, (1, 7))
    logits = model(input_ids=ids).logits
    assert len(seen) == 2  # one per MoE layer
    experts = model.model.layers[0].mlp.experts
    (x, topk_ids, topk_w, w1, w2), kw = seen[0]
    # zero-copy: the kernels get the parameters themselves; the index is prebuilt (no host-syncing check)
    assert w1 is experts.gate_up_proj and w2 is experts.down_proj
    assert kw["activation"] == "swiglu" and kw["index"] is not None and topk_ids.shape == (7, 2)
    model.set_experts_implementation("eager")
    torch.testing.assert_close(model(input_ids=ids).logits, logits)


def _experts_api_stand_in(x, topk_ids, topk_weights, w_gate_up, w_down, activation="swiglu", save="preact",
                          backend="auto", index=None, *, b_gate_up=None, b_down=None, gate_up_interleaved=False,
                          swiglu_alpha=1.702, swiglu_limit=7.0, foreign_experts=False, fp8=None):
    """The documented maths of ``moe_experts`` with the GPT-OSS arguments (biases, interleaved gate/up, clamped
    SwiGLU, foreign ids), dense in PyTorch: checks what the integration passes, apart from the kernels."""
    assert fp8 is None
    E = w_down.shape[0]
    valid = topk_ids < E
    assert foreign_experts or bool(valid.all())
    ids = topk_ids.clamp(max=E - 1).long()
    pre = torch.einsum("td,tkhd->tkh", x, w_gate_up[ids]) + (0 if b_gate_up is None else b_gate_up[ids])
    g, u = (pre[..., ::2], pre[..., 1::2]) if gate_up_interleaved else pre.chunk(2, -1)
    assert activation == "swiglu_clamped"
    g, u = g.clamp(max=swiglu_limit), u.clamp(-swiglu_limit, swiglu_limit)
    act = (u + 1) * g * torch.sigmoid(swiglu_alpha * g)
    y = torch.einsum("tkh,tkdh->tkd", act, w_down[ids]) + (0 if b_down is None else b_down[ids])
    return (y * (topk_weights * valid)[..., None].to(y.dtype)).sum(1)


def test_gpt_oss_arguments_against_the_documented_maths(monkeypatch):
    """GPT-OSS's weights, biases, layout and clamp reach ``moe_experts`` as its signature defines them."""
    monkeypatch.setattr(mhf, "moe_experts", _experts_api_stand_in)
    model = tiny_model("gpt_oss", torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.5)  # pre-activations beyond the clamp limit 7
    ids = torch.randint(0, 128, (2, 12))
    ref = run(model, "eager", ids, "gpt_oss")
    got = run(model, "moeblaze", ids, "gpt_oss")
    for key, r in ref.items():
        torch.testing.assert_close(got[key], r, rtol=1e-10, atol=1e-12, msg=key)


def test_expert_parallel_sentinels(monkeypatch):
    """In transformers' expert-parallel mode ids >= E (experts of other ranks) go to moe_experts unbuilt, with
    foreign_experts=True (no index: the core builds it without them)."""
    monkeypatch.setattr(mhf, "moe_experts", _experts_api_stand_in)
    experts = tiny_model("gpt_oss", torch.float64).model.layers[0].mlp.experts
    experts._is_expert_parallel = True
    x = torch.randn(5, 64, dtype=torch.float64)
    ids = torch.tensor([[0, 8], [3, 1], [9, 8], [7, 2], [8, 5]])
    w = torch.rand(5, 2, dtype=torch.float64)
    out = mhf.moeblaze_experts_forward(experts, x, ids, w)
    assert mhf.experts_plan(experts).foreign_experts
    keep = ids < 8
    ref = mhf.moeblaze_experts_forward(experts, x, ids.clamp(max=7), w * keep)
    torch.testing.assert_close(out, ref)
    assert out[2].abs().max() == 0


def test_expert_parallel_from_the_distributed_config():
    """transformers' other expert-parallel switch, ``config.distributed_config.enable_expert_parallel``, also
    makes ids >= E foreign."""
    from types import SimpleNamespace

    experts = tiny_model("gpt_oss", torch.float64).model.layers[0].mlp.experts
    assert not mhf.experts_plan(experts).foreign_experts
    experts.__dict__.pop("_moeblaze_plan", None)  # the plan is cached per module
    experts.config = SimpleNamespace(**vars(experts.config), distributed_config=SimpleNamespace(
        enable_expert_parallel=True))
    assert mhf.experts_plan(experts).foreign_experts


def test_plan_of_gpt_oss():
    """GPT-OSS: clamped SwiGLU on interleaved gate/up columns of transposed weights, with biases."""
    experts = tiny_model("gpt_oss").model.layers[0].mlp.experts
    plan = mhf.experts_plan(experts)
    assert plan == mhf.ExpertsPlan("swiglu_clamped", gated=True, interleaved=True, transposed=True, has_bias=True,
                                   alpha=1.702, limit=7.0, foreign_experts=False)
    w1, w2 = mhf._weights(experts, plan)  # strided views of [E, d, 2h] / [E, h, d], not copies
    assert w1.shape == (8, 64, 64) and w1.data_ptr() == experts.gate_up_proj.data_ptr()
    assert w2.shape == (8, 64, 32) and w2.data_ptr() == experts.down_proj.data_ptr()


@pytest.mark.parametrize("hidden_act, expected", [("silu", "swiglu"), ("gelu", "geglu"),
                                                  ("gelu_pytorch_tanh", "geglu_tanh"), ("gelu_new", "geglu_tanh")])
def test_activation_identified(hidden_act, expected):
    experts = tiny_model("qwen3_moe", hidden_act=hidden_act).model.layers[0].mlp.experts
    assert mhf.experts_plan(experts).activation == expected


@pytest.mark.parametrize("hidden_act", ["quick_gelu", "relu", "tanh"])
def test_unknown_activation_is_refused(hidden_act):
    model = tiny_model("qwen3_moe", hidden_act=hidden_act)
    model.set_experts_implementation("moeblaze")
    with pytest.raises(mhf.UnsupportedExpertsError, match="Qwen3MoeExperts: its gating"):
        model(input_ids=torch.randint(0, 128, (1, 5)))


def _non_gated_experts(act: nn.Module):
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(has_gate=False)
    class NonGatedExperts(nn.Module):  # the layout of Nemotron-H's experts: up_proj [E, h, d], act(up)
        def __init__(self, config):
            super().__init__()
            self.num_experts = 5
            self.up_proj = nn.Parameter(torch.randn(5, 24, 16, dtype=torch.float64) / 4)
            self.down_proj = nn.Parameter(torch.randn(5, 16, 24, dtype=torch.float64) / 5)
            self.act_fn = act

        def forward(self, x, top_k_index, top_k_weights):  # the eager loop, one (token, slot) at a time
            out = torch.zeros_like(x)
            for t in range(x.shape[0]):
                for k in range(top_k_index.shape[1]):
                    e = top_k_index[t, k]
                    out[t] += top_k_weights[t, k] * (self.down_proj[e] @ self.act_fn(self.up_proj[e] @ x[t]))
            return out

    return NonGatedExperts(transformers.PretrainedConfig())


def test_non_gated_experts_match_eager():
    experts = _non_gated_experts(nn.GELU())
    x = torch.randn(9, 16, dtype=torch.float64, requires_grad=True)
    ids = torch.rand(9, 5).argsort(1)[:, :2]
    w = torch.rand(9, 2, dtype=torch.float64, requires_grad=True)
    ref = experts(x, ids, w)
    (dx, dw, dup, ddown) = torch.autograd.grad(ref.square().sum(), (x, w, experts.up_proj, experts.down_proj))
    out = mhf.moeblaze_experts_forward(experts, x, ids, w)
    assert mhf.experts_plan(experts).activation == "gelu"
    grads = torch.autograd.grad(out.square().sum(), (x, w, experts.up_proj, experts.down_proj))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(grads, (dx, dw, dup, ddown)):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_relu2_identified_and_unknown_non_gated_refused():
    from transformers.activations import ACT2FN

    assert mhf.experts_plan(_non_gated_experts(ACT2FN["relu2"])).activation == "relu2"
    with pytest.raises(mhf.UnsupportedExpertsError, match="act_fn=Tanh"):
        mhf.experts_plan(_non_gated_experts(nn.Tanh()))


def test_prepare_plans_every_experts_module():
    plans = mhf.prepare(tiny_model("mixtral"))
    assert list(plans) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert {p.activation for p in plans.values()} == {"swiglu"}
    with pytest.raises(mhf.UnsupportedExpertsError, match="MixtralExperts"):
        mhf.prepare(tiny_model("mixtral", hidden_act="quick_gelu"))


def test_input_takes_the_weights_dtype():
    """As transformers' grouped_mm: fp32 hidden states before bf16 experts run in bf16, come back in fp32."""
    experts = tiny_model("qwen3_moe", torch.bfloat16).model.layers[0].mlp.experts
    x = torch.randn(6, 64)
    topk = torch.rand(6, 8).topk(2)
    out = mhf.moeblaze_experts_forward(experts, x, topk.indices, topk.values)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, mhf.moeblaze_experts_forward(experts, x.bfloat16(), topk.indices,
                                                                 topk.values).float())


def test_unsupported_flag_is_refused():
    experts = tiny_model("qwen3_moe").model.layers[0].mlp.experts
    experts.has_post_expert_norm = True
    with pytest.raises(mhf.UnsupportedExpertsError, match="has_post_expert_norm"):
        mhf.moeblaze_experts_forward(experts, torch.randn(3, 64), torch.zeros(3, 2, dtype=torch.long),
                                     torch.rand(3, 2))


def test_bad_options():
    with pytest.raises(ValueError, match="save must be one of"):
        mhf.make_experts_forward(save="all")
    with pytest.raises(ValueError, match="backend must be one of"):
        mhf.make_experts_forward(backend="cuda")
    with pytest.raises(TypeError, match="fp8 must be None or a moeblaze.fp8.Float8Recipe"):
        mhf.make_experts_forward(fp8="e4m3")


@pytest.mark.parametrize("granularity", ["blockwise", "rowwise"])
def test_fp8_experts(granularity):
    """``make_experts_forward(fp8=recipe)`` runs the experts as :func:`moeblaze.moe_experts` with that recipe does
    (bitwise, output and gradients), and a model step with it lands at FP8's error against float64 eager: well
    above fp32's rounding (the recipe is applied), well below a wrong result's."""
    import moeblaze
    from moeblaze.fp8 import Float8Recipe

    recipe = Float8Recipe(granularity, block_size=16)
    fn = mhf.make_experts_forward(backend="torch", fp8=recipe)
    assert fn.__name__ == f"moeblaze_experts_forward_preact_torch_fp8_{granularity}"
    model = tiny_model("qwen3_moe", torch.float32)
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(10, model.config.hidden_size, requires_grad=True)
    topk = torch.rand(10, experts.num_experts).topk(model.config.num_experts_per_tok)
    weights = topk.values.requires_grad_()
    plan = mhf.experts_plan(experts)
    w1 = experts.gate_up_proj
    direct = moeblaze.moe_experts(x, topk.indices, weights, w1, experts.down_proj, activation=plan.activation,
                                  backend="torch", fp8=recipe)
    dout = torch.randn_like(direct)
    want = torch.autograd.grad(direct, (x, weights, w1), dout)
    out = fn(experts, x, topk.indices, weights)
    assert torch.equal(out, direct)
    for a, b in zip(torch.autograd.grad(out, (x, weights, w1), dout), want):
        assert torch.equal(a, b)

    mhf.register("moeblaze-fp8-test", fn)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    ref = copy.deepcopy(model).double()
    ref.set_experts_implementation("eager")
    model.set_experts_implementation("moeblaze-fp8-test")
    with torch.no_grad():
        err = rel_error(model(input_ids=ids).logits.double(), ref(input_ids=ids).logits)
    assert 1e-5 < err < 5e-2, f"logits relative error {err:.2e} against float64 eager"


def test_register_under_another_name():
    mhf.register("moeblaze-recompute", mhf.make_experts_forward(save="input", backend="torch"))
    model = tiny_model("olmoe", torch.float64)
    ids = torch.randint(0, 128, (1, 6))
    model.set_experts_implementation("eager")
    ref = model(input_ids=ids).logits
    model.set_experts_implementation("moeblaze-recompute")
    torch.testing.assert_close(model(input_ids=ids).logits, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_eager_bf16_triton(family):
    """The same check in bf16 with the Triton kernels (backend "auto" on CUDA), on one decoder layer: with two,
    the second router sees the first layer's bf16 rounding, and a near-tie in its top-k flips experts between
    the implementations (seen for OLMoE, Mixtral and Ernie-4.5 on an H200), which would compare
    two routings rather than two experts implementations."""
    one_layer = {"num_hidden_layers": 1}
    if "layer_types" in FAMILIES[family]:
        one_layer["layer_types"] = FAMILIES[family]["layer_types"][-1:]
    if "layers_block_type" in FAMILIES[family]:
        # Nemotron-H has one MoE block already; alone (no attention block) transformers' cache has no
        # attention layer to ask the sequence length (ValueError, transformers 5.17, H100)
        one_layer = {}
    model = tiny_model(family, torch.bfloat16, **one_layer).cuda()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), device="cuda")
    ref64 = run(copy.deepcopy(model).double(), "eager", ids, family)
    baseline = run(model, "eager", ids, family)
    actual = run(model, "moeblaze", ids, family)
    check(actual, ref64, baseline, scalar_floor=torch.finfo(torch.bfloat16).eps)


@pytest.mark.gpu
def test_no_host_sync_bf16():
    """Forward and backward of the experts function never wait for the GPU (after a first, autotuning call)."""
    experts = tiny_model("qwen3_moe", torch.bfloat16).cuda().model.layers[0].mlp.experts
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    topk = torch.rand(32, 8, device="cuda").topk(2)
    for check_sync in (False, True):
        torch.cuda.set_sync_debug_mode("error" if check_sync else "default")
        try:
            mhf.moeblaze_experts_forward(experts, x, topk.indices, topk.values).float().sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
