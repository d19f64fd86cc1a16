"""``moeblaze.MoE``'s router features of released models (issue 22 item 3): DeepSeek-V3 / GLM-4-MoE routing
(sigmoid scores, selection-only correction bias, group-limited top-k, routed scaling), shared experts
(Qwen2-MoE's gated one included) and logits in the input's dtype, checked against transformers' own blocks."""

from __future__ import annotations

import pytest
import torch

import moeblaze

transformers = pytest.importorskip("transformers")

from hf_models import tiny_config  # noqa: E402


def _copy_experts(moe: moeblaze.MoE, block) -> None:
    with torch.no_grad():
        moe.router.weight.copy_(block.gate.weight)
        moe.w_gate_up.copy_(block.experts.gate_up_proj)
        moe.w_down.copy_(block.experts.down_proj)


def _grads(module, x, out):
    params = [p for p in module.parameters()]
    return torch.autograd.grad(out.square().sum(), [x, *params])


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_deepseek_router_and_shared_experts_match_transformers(family):
    cfg = tiny_config(family)
    mod = __import__(f"transformers.models.{family}.modeling_{family}", fromlist=["x"])
    prefix = {"deepseek_v3": "DeepseekV3", "glm4_moe": "Glm4Moe"}[family]
    torch.manual_seed(0)
    block = getattr(mod, f"{prefix}MoE")(cfg).double()
    block.experts.config._experts_implementation = "eager"
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
        block.gate.e_score_correction_bias.copy_(torch.rand(cfg.n_routed_experts) * 0.2)
    moe = moeblaze.MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
                       score_func="sigmoid", renormalize=cfg.norm_topk_prob, aux_loss_coef=0.0, backend="torch",
                       n_group=cfg.n_group, topk_group=cfg.topk_group, score_correction_bias=True,
                       routed_scaling_factor=cfg.routed_scaling_factor,
                       shared_d_ff=cfg.moe_intermediate_size * cfg.n_shared_experts).double()
    _copy_experts(moe, block)
    with torch.no_grad():
        moe.router.e_score_correction_bias.copy_(block.gate.e_score_correction_bias)
    moe.shared_experts.load_state_dict(block.shared_experts.state_dict())
    x = torch.randn(3, 11, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    ref = block(x)
    out = moe(x)
    # the group limit and the bias change the choice: the plain top-k of the scores differs somewhere
    scores = torch.sigmoid(x.detach().reshape(-1, cfg.hidden_size).float() @ moe.router.weight.float().t())
    assert not torch.equal(scores.topk(cfg.num_experts_per_tok).indices.sort(1).values,
                           moe.last_topk_ids.long().sort(1).values)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    # gradients of x, the router (through the fp32 combine weights), the experts and the shared expert
    g_ref = dict(zip(["x", *[n for n, _ in block.named_parameters()]], _grads(block, x, ref)))
    g = dict(zip(["x", *[n for n, _ in moe.named_parameters()]], _grads(moe, x, out)))
    names = {"x": "x", "gate.weight": "router.weight", "experts.gate_up_proj": "w_gate_up",
             "experts.down_proj": "w_down", **{f"shared_experts.{n}.weight": f"shared_experts.{n}.weight"
                                               for n in ("gate_proj", "up_proj", "down_proj")}}
    assert set(g_ref) == set(names) and set(g) == set(names.values())
    for hf_name, name in names.items():
        # the router weight's gradient passes through fp32 logits in both: fp32 rounding
        tol = 1e-5 if name == "router.weight" else 1e-12
        torch.testing.assert_close(g[name], g_ref[hf_name], rtol=tol, atol=tol, msg=name)


def test_qwen2_moe_block_with_gated_shared_expert():
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = tiny_config("qwen2_moe", norm_topk_prob=False)
    torch.manual_seed(1)
    block = Qwen2MoeSparseMoeBlock(cfg).double()
    block.experts.config._experts_implementation = "eager"
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    moe = moeblaze.MoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                       aux_loss_coef=0.0, backend="torch", shared_d_ff=cfg.shared_expert_intermediate_size,
                       shared_gate=True, logits_dtype="input").double()
    _copy_experts(moe, block)
    state = {**block.shared_expert.state_dict(), "shared_expert_gate.weight": block.shared_expert_gate.weight}
    moe.shared_experts.load_state_dict(state)
    x = torch.randn(2, 9, cfg.hidden_size, dtype=torch.float64)
    # logits in the input's dtype (float64 here), softmax over them cast to fp32: as transformers' Qwen2-MoE router
    torch.testing.assert_close(moe(x), block(x), rtol=1e-12, atol=1e-12)


def test_logits_in_input_dtype_route_as_transformers_bf16():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = tiny_config("qwen3_moe", num_experts=64, num_experts_per_tok=8)
    torch.manual_seed(2)
    gate = Qwen3MoeTopKRouter(cfg).bfloat16()
    with torch.no_grad():
        gate.weight.normal_(0, 0.2)
    x = torch.randn(512, cfg.hidden_size, dtype=torch.bfloat16)
    _, ref_w, ref_ids = gate(x)
    routers = {}
    for logits_dtype in ("input", "fp32"):
        r = moeblaze.Router(cfg.hidden_size, 64, 8, renormalize=True, logits_dtype=logits_dtype).bfloat16()
        with torch.no_grad():
            r.weight.copy_(gate.weight)
        routers[logits_dtype] = r(x)
    same = routers["input"]
    torch.testing.assert_close(same.topk_ids.long(), ref_ids)
    torch.testing.assert_close(same.topk_weights.to(ref_w.dtype), ref_w, rtol=0, atol=0)
    # with fp32 logits some of the 512 tokens choose differently: the option is what makes them agree
    assert not torch.equal(routers["fp32"].topk_ids.long().sort(1).values, ref_ids.sort(1).values)


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_group=3), "n_group must be a positive int dividing"),
    (dict(n_group=4, topk_group=5), "topk_group must be an int in"),
    (dict(n_group=4, topk_group=1), "topk_group must be an int in"),  # 1 group of 2 experts < K = 3
    (dict(logits_dtype="bf16"), "logits_dtype must be one of"),
])
def test_router_bad_group_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        moeblaze.Router(16, 8, 3, score_func="sigmoid", **kwargs)


def test_shared_expert_needs_gated_activation():
    with pytest.raises(ValueError, match="shared experts need activation"):
        moeblaze.MoE(16, 8, 4, 2, activation="relu", shared_d_ff=8)
