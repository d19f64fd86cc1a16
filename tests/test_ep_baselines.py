"""The EP baselines of ``benchmarks/bench_ep.py`` (issue 57): torchtitan 0.3.0's own expert-parallel MoE, built by
:func:`moeblaze.bench.ep_baselines.build_torchtitan_ep` on a moeblaze EP layer's weights, computes moeblaze's
function: same routing, and output and gradients (x, experts, router) within DESIGN.md §7's rule of a float64
reference of the whole layer over every rank's tokens.

torchtitan is optional (CI installs only the test extras): its tests skip when it does not import. Install
the wheels torchtitan==0.3.0, tyro, docstring_parser and spmd_types==0.2.3 (e.g. ``pip install --target
/tmp/site`` and ``PYTHONPATH=/tmp/site``) to run them. CPU: 2 gloo ranks, torchtitan's ``partial_dtensor``
backend (its default ``spmd_types`` exchange is ``dist.all_to_all`` over uneven chunks, which gloo cannot
run). ``multigpu``: 2 GPUs, NCCL, bf16, both backends.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import moeblaze
from dist_utils import run_ranks
from moeblaze.bench.ep_baselines import TitanStyleEP, build_torchtitan_ep
from moeblaze.parallel import expert_parallel
from moeblaze.reference import moe_experts_reference
from moeblaze.testing import assert_close_to_reference


def _titan_missing() -> str | None:
    """Why torchtitan's MoE cannot be imported here, or None."""
    try:
        import torchtitan.models.common.moe  # noqa: F401
    except ImportError as e:
        return f"torchtitan 0.3.0 is not importable ({e}); CI installs only the test extras"
    return None


def _reference(xs, douts, ids, wr, w1, w2, dt):
    """The layer over every rank's tokens in ``dt`` on the CPU, routing ``ids`` fixed: per rank
    ``softmax(x Wr^T)`` gathered at ``ids`` weights the SwiGLU experts (:func:`moe_experts_reference`).
    Returns per rank ``(out, dx, dWr)`` (each rank's router gradient from its own tokens, as each layer keeps
    it) and the global expert gradients ``dW_gate_up [E, 2h, d]``, ``dW_down [E, d, h]``."""
    P = len(xs)
    xs = [x.detach().cpu().to(dt).requires_grad_() for x in xs]
    wrs = [wr.detach().cpu().to(dt).requires_grad_() for _ in range(P)]
    w1, w2 = (w.detach().cpu().to(dt).requires_grad_() for w in (w1, w2))
    outs = []
    for r in range(P):
        probs = F.softmax(xs[r] @ wrs[r].t(), dim=-1)
        outs.append(moe_experts_reference(xs[r], ids[r].cpu(), probs.gather(1, ids[r].cpu().long()), w1, w2))
    grads = torch.autograd.grad(outs, [*xs, *wrs, w1, w2], [g.cpu().to(dt) for g in douts])
    per_rank = [(outs[r].detach(), grads[r], grads[P + r]) for r in range(P)]
    return per_rank, grads[2 * P], grads[2 * P + 1]


def _gather(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return parts


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def titan_matches_moeblaze(rank: int, world: int, spmd_backend: str, dtype: torch.dtype, seed: int) -> None:
    """torchtitan's EP layer on a moeblaze EP layer's weights: the same top-k, and output, dx and each weight's
    gradient as close to the float64 reference as plain PyTorch in bf16 (torchtitan's experts take bf16
    operands whatever the dtype); the moeblaze layer as close as plain PyTorch in its own dtype."""
    T, d, h, E, K = 40, 32, 16, 8, 2
    device = torch.device("cuda", rank) if "nccl" in str(dist.get_backend()) else torch.device("cpu")
    torch.manual_seed(seed)  # the same router on every rank
    mb = expert_parallel(moeblaze.MoE(d, h, E, K, aux_loss_coef=0.0, device=device, dtype=dtype), dist.group.WORLD)
    tt = build_torchtitan_ep(mb, spmd_backend)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1 + rank)
    x = torch.randn(T, d, generator=gen).to(device, dtype).requires_grad_()
    dout = torch.randn(T, d, generator=gen).to(device, dtype)

    out_mb = mb(x)
    ids = mb.last_topk_ids
    dx_mb, *mb_grads = torch.autograd.grad(out_mb, [x, mb.router.weight, mb.w1, mb.w_down], dout)
    out_tt = tt(x)
    tt_weights = [tt.moe.router.gate.weight, *(getattr(tt.moe.routed_experts.inner_experts, n)
                                              for n in ("w1_EFD", "w3_EFD", "w2_EDF"))]
    dx_tt, dwr_tt, dw1_tt, dw3_tt, dw2_tt = torch.autograd.grad(out_tt, [x, *tt_weights], dout)
    with torch.no_grad(), tt._context():
        _, ids_tt, _ = tt.moe.router(x.detach().reshape(1, T, d))
    assert torch.equal(ids_tt.reshape(T, K).sort(1).values.cpu(), ids.long().sort(1).values.cpu()), "routing differs"
    with pytest.raises(ValueError, match=r"x \[T, d\]"):
        tt(x.detach().reshape(1, T, d))

    xs, douts, all_ids = _gather(x.detach(), world), _gather(dout, world), _gather(ids.to(torch.int64), world)
    w1_all, w2_all = torch.cat(_gather(mb.w1.detach(), world)), torch.cat(_gather(mb.w_down.detach(), world))
    El = E // world
    local = slice(rank * El, (rank + 1) * El)

    def own(dt):
        per_rank, dw1, dw2 = _reference(xs, douts, all_ids, mb.router.weight, w1_all, w2_all, dt)
        return (*per_rank[rank], dw1[local], dw2[local])

    ref64, base_bf16, base_own = own(torch.float64), own(torch.bfloat16), own(dtype)
    names = ("out", "dx", "dWr", "dW_gate_up", "dW_down")
    titan = (out_tt, dx_tt, _local(dwr_tt), torch.cat((_local(dw1_tt), _local(dw3_tt)), 1), _local(dw2_tt))
    for name, got, ref, base in zip(names, titan, ref64, base_bf16, strict=True):
        assert_close_to_reference(f"torchtitan {spmd_backend} {name} rank {rank}", got.float(), ref, base)
    for name, got, ref, base in zip(names, (out_mb, dx_mb, *mb_grads), ref64, base_own, strict=True):
        assert_close_to_reference(f"moeblaze {name} rank {rank}", got, ref, base)


def _fresh_seed() -> int:
    seed = int(torch.randint(1 << 20, ()))
    print(f"seed={seed}")
    return seed


@pytest.mark.skipif(_titan_missing() is not None, reason=str(_titan_missing()))
def test_torchtitan_ep_matches_moeblaze_on_two_gloo_ranks():
    run_ranks(titan_matches_moeblaze, 2, "partial_dtensor", torch.float32, _fresh_seed(), timeout=240)


def _two_gpus():
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.multigpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs")
@pytest.mark.skipif(_titan_missing() is not None, reason=str(_titan_missing()))
@pytest.mark.parametrize("spmd_backend", ["spmd_types", "partial_dtensor"])
def test_torchtitan_ep_matches_moeblaze_bf16_two_gpus(spmd_backend):
    run_ranks(titan_matches_moeblaze, 2, spmd_backend, torch.bfloat16, _fresh_seed(), backend="nccl", timeout=300)


def bad_sources(rank: int, world: int, titan_missing: bool) -> None:
    """Clear errors: a layer that is not expert-parallel, an unknown backend, a configuration torchtitan does not
    compute; without torchtitan, an ImportError naming what to install."""
    plain = moeblaze.MoE(16, 8, 4, 2)
    ep = expert_parallel(moeblaze.MoE(16, 8, 4, 2), dist.group.WORLD)
    group = dist.group.WORLD
    for call, match in ((lambda: build_torchtitan_ep(plain), "expert-parallel"),
                        (lambda: TitanStyleEP(plain), "expert-parallel"),
                        (lambda: build_torchtitan_ep(ep, "full_dtensor"), "spmd_backend"),
                        (lambda: build_torchtitan_ep(expert_parallel(moeblaze.MoE(16, 8, 4, 2, activation="gelu"),
                                                                     group)), "swiglu"),
                        (lambda: build_torchtitan_ep(expert_parallel(moeblaze.MoE(12, 8, 4, 2), group)),
                         "multiples of 8")):
        with pytest.raises(ValueError, match=match):
            call()
    if titan_missing:
        with pytest.raises(ImportError, match="torchtitan==0.3.0"):
            build_torchtitan_ep(ep)


def test_ep_baselines_reject_bad_sources():
    run_ranks(bad_sources, 1, _titan_missing() is not None, timeout=120)
