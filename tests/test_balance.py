"""Load balancing (issue 61, :mod:`moeblaze.balance`): DeepSeek-V3's auxiliary-loss-free expert biases, the
sequence-wise and global-batch balance losses, and the expert counts behind them and behind metrics.csv."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import balance_workers as bw
import moeblaze
from dist_utils import run_ranks
from moeblaze import settings
from moeblaze.balance import expert_counts, load_summary
from moeblaze.training.model import ModelConfig


def _layer(E: int = 8, K: int = 2, d: int = 16, **kw) -> moeblaze.MoE:
    kw = {"aux_loss_coef": 0.0, "z_loss_coef": 0.0, "backend": "torch", **kw}
    return moeblaze.MoE(d, 8, E, K, **kw)


# ----------------------------------------------------------------------------- the bias update and the counts

def test_bias_update_equals_the_rule():
    """Random counts (ties with the mean included) and biases: ``b_e += u * sign(mean - load_e)`` in fp32, as a
    plain loop computes it; the counts are reset; a counting router without a rate keeps no bias."""
    torch.manual_seed(0)
    model = torch.nn.ModuleList([_layer(8, expert_bias_update_rate=1e-3), _layer(5, 1, expert_bias_update_rate=0.25),
                                 _layer(6, track_expert_load=True)])
    counts = [torch.randint(0, 9, (8,)),  # random (a load at the mean is possible)
              torch.tensor([3, 3, 3, 3, 3]),  # all at the mean: sign 0
              torch.tensor([0, 2, 9, 1, 1, 4])]
    biases = []
    for m, c in zip(model, counts):
        m.router.tokens_per_expert.copy_(c)
        if m.router.e_score_correction_bias is not None:
            m.router.e_score_correction_bias.copy_(torch.randn(c.numel()))
            biases.append(m.router.e_score_correction_bias.clone().numpy())
    load = moeblaze.update_expert_biases(model)
    assert [torch.equal(a, b) for a, b in zip(load, counts)] == [True] * 3
    for m, b0, c, u in zip(model, biases, counts, (1e-3, 0.25)):
        mean = c.sum().item() / c.numel()
        want = np.array([np.float32(b) + np.float32(u) * np.float32((mean > n) - (mean < n))
                         for b, n in zip(b0, c.tolist())], dtype=np.float32)
        assert np.array_equal(m.router.e_score_correction_bias.numpy(), want)
    assert model[2].router.e_score_correction_bias is None
    assert all(int(m.router.tokens_per_expert.abs().sum()) == 0 for m in model)


def test_exact_tie_with_the_mean_leaves_the_bias():
    m = _layer(4, expert_bias_update_rate=0.5)
    m.router.tokens_per_expert.copy_(torch.tensor([2, 6, 4, 4]))  # mean 4
    moeblaze.update_expert_biases(m)
    assert m.router.e_score_correction_bias.tolist() == [0.5, -0.5, 0.0, 0.0]


@pytest.mark.parametrize("kw", [
    {"score_func": "softmax"},
    {"score_func": "sigmoid", "n_group": 4, "topk_group": 2},
    {"score_func": "softmax", "token_rounding": "nr", "rounding_tile": 4},
])
def test_counts_are_the_routers_choice_over_training_forwards(kw):
    """Two training forwards add their top-k choice (token rounding: before its drops and pads); eval adds none."""
    torch.manual_seed(1)
    m = _layer(8, expert_bias_update_rate=1e-3, **kw)
    ids = []
    for T in (13, 8):
        m(torch.randn(T, 16)).sum().backward()
        ids.append(m.last_topk_ids.flatten().long())
    m.eval()
    m(torch.randn(5, 16))
    want = torch.bincount(torch.cat(ids), minlength=8)
    assert m.router.tokens_per_expert.dtype == torch.int64 and torch.equal(m.router.tokens_per_expert, want)
    assert torch.equal(moeblaze.expert_load(m, reset=True)[0], want) and int(m.router.tokens_per_expert.sum()) == 0


def test_bias_is_kept_fp32_saved_and_counts_are_not():
    m = _layer(4, expert_bias_update_rate=1e-3)
    assert m.router.e_score_correction_bias.dtype == torch.float32
    m = m.to(torch.bfloat16)
    assert m.router.weight.dtype == torch.bfloat16 and m.router.e_score_correction_bias.dtype == torch.float32
    assert "router.e_score_correction_bias" in m.state_dict() and "router.tokens_per_expert" not in m.state_dict()
    assert m.double().router.e_score_correction_bias.dtype == torch.float64  # only 16-bit casts are refused


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_bias_balances_a_skewed_router_and_weights_stay_unbiased(score_func):
    """A router sending nearly every token to 2 of 8 experts, no auxiliary loss, a regression loss: u = 1e-3
    brings max / mean load below 1.5 within 300 steps (u = 0 does not, sigmoid); afterwards the choice is the
    top-k of scores + bias, while the combine weights are the unbiased scores."""
    E, K, d, T = 8, 2, 16, 256

    def run(u: float) -> tuple[moeblaze.MoE, list[float]]:
        torch.manual_seed(0)
        m = _layer(E, K, d, score_func=score_func, expert_bias_update_rate=u, track_expert_load=True)
        with torch.no_grad():  # x[:, 0] == 1 below: experts 0 and 1 get +2 on every logit
            m.router.weight[:, 0] = 0.0
            m.router.weight[:2, 0] = 2.0
        teacher = torch.randn(d, d) / d**0.5
        opt = torch.optim.Adam(m.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1)
        ratios = []
        for _ in range(300):
            x = torch.randn(T, d, generator=gen)
            x[:, 0] = 1.0
            (m(x) - x @ teacher).square().mean().backward()
            opt.step()
            opt.zero_grad()
            load = moeblaze.update_expert_biases(m)[0]
            ratios.append(float(load.max()) * E / float(load.sum()))
        return m, ratios

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only contend (4x slower on a loaded 2-core machine)
    try:
        m, ratios = run(1e-3)
        control = run(0.0)[1] if score_func == "sigmoid" else None
    finally:
        torch.set_num_threads(threads)
    assert ratios[0] > 3.5, ratios[:3]
    assert max(ratios[-10:]) < 1.5, ratios[-10:]
    assert control is None or control[-1] > 2.5, control[-10:]
    x = torch.randn(64, d)
    x[:, 0] = 1.0
    out = m.router(x)
    scores = torch.sigmoid(out.logits) if score_func == "sigmoid" else torch.softmax(out.logits, -1)
    bias = m.router.e_score_correction_bias
    assert torch.equal(out.topk_ids.long(), (scores + bias).topk(K).indices)
    assert not torch.equal(out.topk_ids.long().sort(1).values, scores.topk(K).indices.sort(1).values)
    w = scores.gather(1, out.topk_ids.long())
    w = w / w.sum(-1, keepdim=True) if m.router.renormalize else w
    torch.testing.assert_close(out.topk_weights, w, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- the losses

def _probs64(router: moeblaze.Router, x: torch.Tensor, w64: torch.Tensor) -> torch.Tensor:
    logits = x.reshape(-1, x.shape[-1]).double() @ w64.t()
    s = torch.softmax(logits, -1) if router.score_func == "softmax" else torch.sigmoid(logits)
    return s / s.sum(-1, keepdim=True)


def _seq_reference(p: torch.Tensor, ids: torch.Tensor, S: int, coef: float) -> torch.Tensor:
    """DeepSeek-V3 eq. 17-20 written out per sequence, averaged over the sequences (float64)."""
    T, E = p.shape
    K, B = ids.shape[1], T // S
    total = p.new_zeros(())
    for b in range(B):
        rows = range(b * S, (b + 1) * S)
        for e in range(E):
            f = E / (K * S) * sum(e in ids[t].tolist() for t in rows)
            total = total + f * sum(p[t, e] for t in rows) / S
    return coef * total / B


def _switch_reference(p: torch.Tensor, ids: torch.Tensor, coef: float) -> torch.Tensor:
    T, E = p.shape
    f = torch.tensor([sum(e in row for row in ids.tolist()) for e in range(E)], dtype=torch.float64) / ids.numel()
    return coef * E * (f * p.mean(0)).sum()


@pytest.mark.parametrize("kw,shape", [
    ({"score_func": "softmax"}, (3, 5)),
    ({"score_func": "sigmoid", "n_group": 3, "topk_group": 2, "expert_bias_update_rate": 0.1}, (4, 3)),
    ({"score_func": "softmax"}, (2, 2, 4)),  # [A, B, S, d]: A * B sequences
    ({"score_func": "sigmoid"}, (7,)),  # 2-D input: one sequence
])
def test_sequence_loss_equals_the_float64_reference(kw, shape):
    torch.manual_seed(2)
    E, K, d, coef = 6, 2, 12, 0.7
    m = _layer(E, K, d, aux_loss_coef=coef, aux_loss_type="seq", **kw)
    if m.router.e_score_correction_bias is not None:
        m.router.e_score_correction_bias.copy_(torch.rand(E) * 0.3)  # the choice is biased, the loss is not
    x = torch.randn(*shape, d)
    m(x)
    m.aux_loss.backward()
    w64 = m.router.weight.detach().double().requires_grad_()
    want = _seq_reference(_probs64(m.router, x, w64), m.last_topk_ids, x.shape[-2] if x.dim() > 2 else x.shape[0],
                          coef)
    want.backward()
    assert float(m.aux_loss.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    torch.testing.assert_close(m.router.weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_global_loss_in_one_process_is_the_switch_loss(score_func):
    torch.manual_seed(3)
    m = _layer(5, 2, 12, aux_loss_coef=0.2, aux_loss_type="global", score_func=score_func)
    x = torch.randn(2, 6, 12)
    m(x)
    m.aux_loss.backward()
    w64 = m.router.weight.detach().double().requires_grad_()
    want = _switch_reference(_probs64(m.router, x, w64), m.last_topk_ids, 0.2)
    want.backward()
    assert float(m.aux_loss.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    torch.testing.assert_close(m.router.weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("kind", ["seq", "global"])
def test_fused_router_losses_equal_the_pytorch_router(kind):
    """The Triton router (interpreter) computes the Switch loss in its kernel; the other two come from its
    probabilities: values and gradients as the PyTorch router's, counts too."""
    torch.manual_seed(4)
    r = moeblaze.Router(16, 8, 2, aux_loss_coef=0.3, z_loss_coef=0.01, aux_loss_type=kind, track_expert_load=True)
    x = torch.randn(12, 16)
    outs = []
    for fused in (True, False):
        r.weight.grad = None
        with settings.override(backend="triton" if fused else "torch"):
            assert r._fused(x @ r.weight.t()) == fused
            out = r(x, seq_len=4)
        out.loss.backward()
        outs.append((out.loss.detach(), r.weight.grad.clone(), out.topk_ids))
    (a, ga, ia), (b, gb, ib) = outs
    assert torch.equal(ia, ib)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-7)
    assert torch.equal(r.tokens_per_expert, 2 * expert_counts(ia, 8))


def test_global_loss_over_two_ranks_equals_one_process():
    run_ranks(bw.run_all, 2, ["global_loss"], timeout=120)


def test_expert_parallel_and_fsdp2_bias_update_equal_one_process():
    """EP over the world with each loss type, and FSDP2 on a 1-D mesh: the all-reduced counts, the
    biases (bitwise), outputs, losses and weights after a few steps equal one process on all sequences."""
    run_ranks(bw.run_all, 2, ["ep_bias", "fsdp_bias"], timeout=240)


def test_load_summary():
    load = [torch.tensor([4, 0, 2, 2]), torch.tensor([3, 3, 3]), torch.tensor([0, 0])]
    assert load_summary(load).tolist() == pytest.approx([2.0, 1.0, 3.0])  # ratios 2, 1, 0 (no token)


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("kw,match", [
    ({"expert_bias_update_rate": -1e-3}, "expert_bias_update_rate must be a finite number >= 0"),
    ({"expert_bias_update_rate": "1e-3"}, "expert_bias_update_rate must be a finite number >= 0"),
    ({"expert_bias_update_rate": float("nan")}, "expert_bias_update_rate must be"),
    ({"expert_bias_update_rate": True}, "expert_bias_update_rate must be"),
    ({"aux_loss_type": "deepseek"}, r"aux_loss_type must be one of \('switch', 'seq', 'global'\)"),
])
def test_bad_arguments_are_one_line_value_errors(kw, match):
    with pytest.raises(ValueError, match=match) as err:
        _layer(4, **kw)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=match):
        moeblaze.Router(8, 4, 2, **kw)


def test_other_bad_inputs():
    with pytest.raises(TypeError, match="aux_loss_group must be None"):
        _layer(4, aux_loss_group="world")
    with pytest.raises(ValueError, match="seq_len must be a positive divisor"):
        moeblaze.Router(8, 4, 2)(torch.randn(6, 8), seq_len=4)
    with pytest.raises(ValueError, match="expert_bias_rate must be a finite number >= 0"):
        ModelConfig(expert_bias_rate=-1.0)
    with pytest.raises(ValueError, match="aux_loss_type must be one of"):
        ModelConfig(aux_loss_type="z")
    with pytest.raises(ValueError, match="one \\[E\\] tensor per counting router"):
        moeblaze.update_expert_biases(_layer(4, expert_bias_update_rate=1e-3), load=[])


# ----------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_gpu_bias_update_adds_no_host_sync(score_func):
    """A bf16 layer step with the counts, the sequence-wise loss, the bias update and the load summary runs
    under ``torch.cuda.set_sync_debug_mode("error")``."""
    torch.manual_seed(0)
    m = moeblaze.MoE(256, 128, 32, 4, score_func=score_func, aux_loss_type="seq", expert_bias_update_rate=1e-3,
                     device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 512, 256, device="cuda", dtype=torch.bfloat16)

    def step():
        out = m(x)
        (out.float().square().mean() + m.aux_loss).backward()
        load = moeblaze.update_expert_biases(m)
        return load_summary(load)

    step()  # first call: autotuning and compilation may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        summary = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert summary[0] >= 1.0 and m.router.e_score_correction_bias.abs().sum() > 0
    assert int(m.router.tokens_per_expert.sum()) == 0
