"""Rank bodies of the expert-parallel / FSDP2 tests (run by ``dist_utils.run_ranks``; CPU gloo or GPU NCCL).

Every check compares the distributed run with a single-process ``moeblaze`` run of the same full weights
on the concatenated tokens (DESIGN.md §7): float64 runs to 1e-6; lower precisions by the tolerance rule
against a float64 reference, the baseline being the single-process layer in the same dtype. Float64 runs
agree to 1e-6, not to float64 rounding: the router computes its logits and their gradient in fp32 whatever
the input dtype (routing.py), and the ranks sum those gradients in another order than one process.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard

import moeblaze
from moeblaze import fp8
from moeblaze.fp8 import E4M3, Float8Recipe
from moeblaze.parallel import ep as ep_module
from moeblaze.parallel import (
    expert_parallel,
    init_distributed,
    is_rank0,
    make_mesh,
    parallelize,
    shard_experts,
    split_batch,
)
from moeblaze.testing import assert_close_to_reference, rel_error
from moeblaze.training.model import ModelConfig, MoETransformer


def _device() -> torch.device:
    return (torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend())
            else torch.device("cpu"))


def _check(name: str, actual: torch.Tensor, ref64: torch.Tensor, baseline: torch.Tensor | None,
           magnitude: torch.Tensor | None = None) -> None:
    """fp64: relative error <= 1e-6 (fp32 router math); otherwise the tolerance rule against ``baseline``
    (``magnitude``: the float64 sum of the absolute values of the summed terms, see
    :func:`moeblaze.testing.assert_close_to_reference`)."""
    actual = actual.detach()
    if baseline is None:
        err = rel_error(actual, ref64)
        assert err <= 1e-6, f"{name}: relative error {err:.3e} against the single-process float64 run"
    else:
        assert_close_to_reference(name, actual.detach().cpu(), ref64.detach().cpu(), baseline.detach().cpu(),
                                  magnitude=None if magnitude is None else magnitude.cpu())


_EXPERT_WEIGHTS = ("w_gate_up", "w_up", "w_down", "b_gate_up", "b_up", "b_down")


def _single_process(moe: moeblaze.MoE, x: torch.Tensor, dout: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output, aux loss and every gradient (by parameter name) of ``out . dout + aux`` of a non-parallel layer."""
    x = x.detach().clone().requires_grad_()
    out = moe(x)
    torch.autograd.backward([out, moe.aux_loss], [dout.to(out.dtype), torch.ones_like(moe.aux_loss)])
    grads = {name: p.grad for name, p in moe.named_parameters()}
    return {"out": out.detach(), "aux": moe.aux_loss.detach(), "dx": x.grad, **grads}


def ep_case(rank: int, world: int, tokens: list[int], E: int, K: int, d: int, h: int, seed: int,
            dtype: torch.dtype = torch.float64, backend: str = "torch", one_remote_expert: bool = False,
            exchange: str = "all_to_all", max_tokens: int | None = None, symmetric: bool = False,
            **options) -> None:
    """EP layer over all ranks (``tokens[r]`` tokens on rank r) against one process on all tokens.

    ``max_tokens``: :func:`expert_parallel`'s (the sync-free exchanges then agree on nothing: checked).
    ``symmetric``: the padded exchange moves the packed rows of a symmetric-memory exchange (the nvshmem kind's
    data path, which needs CUDA, emulated: one packed byte row per token, rows past what a source sent masked).
    ``options``: more :class:`moeblaze.MoE` arguments (activation, score function, save mode, router
    options, a shared expert, an FP8 recipe: then the baseline is one process under the same recipe)."""
    dev = _device()
    kw = {"aux_loss_coef": 0.05, "z_loss_coef": 0.01, **options}
    fp8 = kw.pop("fp8", None)  # the float64 reference is exact; the same-dtype baseline runs the recipe
    torch.manual_seed(seed)  # the same full weights and tokens on every rank
    ref = moeblaze.MoE(d, h, E, 1 if one_remote_expert else K, backend="torch", dtype=torch.float64, **kw)
    T = sum(tokens)
    x_all = torch.randn(T, d, dtype=torch.float64)
    if one_remote_expert:  # every token routed (K = 1) to the last expert, which rank 0 does not own
        wr = ref.router.weight.detach()[-1]
        x_all = 8 * wr / wr.norm() * d**0.5 + 0.1 * x_all
    dout_all = torch.randn(T, d, dtype=torch.float64)
    low = None
    if dtype != torch.float64:
        ref_low = copy.deepcopy(ref).to(device=dev, dtype=dtype)
        ref_low.backend, ref_low.fp8 = backend, fp8
        low = _single_process(ref_low, x_all.to(dev, dtype), dout_all.to(dev))
    r64 = _single_process(ref, x_all, dout_all)

    ep = expert_parallel(moeblaze.MoE(d, h, E, ref.top_k, backend=backend, device=dev, dtype=dtype, fp8=fp8, **kw),
                         dist.group.WORLD, exchange, max_tokens)
    ep.ep.exchange.symmetric |= symmetric  # the exchange is shared by later cases: set back below
    widths: list[int] = []  # FP8: the bytes per row of each forward exchange (the values go in e4m3)
    if fp8 is not None:
        rows = ep.ep.exchange.rows
        ep.ep.exchange.rows = lambda buf, layout, reverse=False: (
            widths.append(buf.shape[1]) if not reverse else None) or rows(buf, layout, reverse)
    agreed: list[int] = []  # the T of each host agreement on T_cap
    agree = ep.ep.exchange.tokens_cap
    ep.ep.exchange.tokens_cap = lambda t: agreed.append(t) or agree(t)
    sl = slice(ep.ep.first_expert, ep.ep.first_expert + ep.ep.num_local_experts)
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in ep.named_parameters():
            p.copy_(ref_params[name][sl] if name in _EXPERT_WEIGHTS else ref_params[name])
    first = sum(tokens[:rank])
    mine = slice(first, first + tokens[rank])
    x = x_all[mine].to(dev, dtype).requires_grad_()
    out = ep(x)
    assert out.shape == x.shape and out.dtype == dtype
    if one_remote_expert:
        assert bool((ep.last_topk_ids == E - 1).all()), "the steering of the tokens to the last expert failed"
    # Weighting rank r's aux loss by T_r / T makes the sum over ranks the single-process loss exactly.
    aux_w = tokens[rank] / T
    torch.autograd.backward([out, ep.aux_loss], [dout_all[mine].to(dev, dtype), torch.full_like(ep.aux_loss, aux_w)])
    del ep.ep.exchange.tokens_cap  # the exchange is shared by later cases
    if fp8 is not None:
        del ep.ep.exchange.rows
        # the values' exchange: d bytes a row, or the packed row of e4m3 values, pairs and one scale
        assert widths and widths[0] == (ep_module._Payload(d, ref.top_k, E4M3, torch.float32, 1).width
                             if ep.ep.exchange.symmetric else d), widths
    ep.ep.exchange.symmetric = ep.ep.exchange.kind == "nvshmem"
    assert len(agreed) == (ep.ep.exchange.sync_free and max_tokens is None), agreed
    aux = (ep.aux_loss.detach().double() * aux_w).reshape(1)
    dist.all_reduce(aux)

    def pick(res, key, s=slice(None)):
        return None if res is None else res[key][s]

    _check("out", out, r64["out"][mine], pick(low, "out", mine))
    _check("dx", x.grad, r64["dx"][mine], pick(low, "dx", mine))
    _check("aux loss (sum of T_r/T-weighted)", aux.to(ep.aux_loss.dtype), r64["aux"].reshape(1),
           None if low is None else low["aux"].reshape(1))
    for name, p in ep.named_parameters():
        if name in _EXPERT_WEIGHTS:
            _check(f"d{name}", p.grad, r64[name][sl], pick(low, name, sl))
            continue
        # Replicated parameters (router, shared expert): each rank holds its tokens' share, summed in
        # float64 and checked in the dtype the ranks computed it in. The shares can cancel in the sum:
        # the rule's floor scales with the sum of their magnitudes.
        grad, mag = p.grad.double(), p.grad.double().abs()
        dist.all_reduce(grad)
        dist.all_reduce(mag)
        if name == "router.weight" and one_remote_expert and low is not None:
            continue  # saturated softmax (p ~ 1): a router gradient of ~0, all rounding
        _check(f"d{name} (summed over ranks)", grad.to(p.grad.dtype), r64[name], pick(low, name), mag)


def ep_cases(rank: int, world: int, cases: list[dict]) -> None:
    for i, case in enumerate(cases):
        try:
            ep_case(rank, world, **{"seed": 100 + i, **case})
        except AssertionError as err:
            raise AssertionError(f"case {case}: {err}") from err


def bad_config(rank: int, world: int) -> None:
    """Mismatched configurations and E % P fail on every rank with a clear error (no hang)."""
    group = dist.group.WORLD
    with pytest.raises(ValueError, match="disagree on the MoE configuration"):
        expert_parallel(moeblaze.MoE(8 + rank, 4, 4, 2), group)
    with pytest.raises(ValueError, match="disagree on the MoE configuration"):
        expert_parallel(moeblaze.MoE(8, 4, 4, 1 + rank % 2), group)
    with pytest.raises(ValueError, match="disagree on the MoE configuration"):
        expert_parallel(moeblaze.MoE(8, 4, 4, 2, bias=rank == 0), group)
    with pytest.raises(ValueError, match="disagree on the MoE configuration"):
        expert_parallel(moeblaze.MoE(8, 4, 4, 2), group, "padded" if rank else "all_to_all")
    with pytest.raises(ValueError, match="disagree on the MoE configuration"):
        expert_parallel(moeblaze.MoE(8, 4, 4, 2), group, "padded", max_tokens=8 + rank)
    for bad in (0, -3, 2.5, True, "8"):
        with pytest.raises(ValueError, match="max_tokens must be a positive int or None"):
            expert_parallel(moeblaze.MoE(8, 4, 4, 2), group, "padded", max_tokens=bad)
    capped = expert_parallel(moeblaze.MoE(8, 4, 2 * world, 1), group, "padded", max_tokens=2)
    with pytest.raises(ValueError, match="3 tokens on rank .*more than max_tokens=2"):  # on every rank: no hang
        capped(torch.randn(3, 8))
    with pytest.raises(ValueError, match="divisible by the expert-parallel group size"):
        expert_parallel(moeblaze.MoE(8, 4, world + 1, 1), group)
    with pytest.raises(TypeError, match="group must be"):
        expert_parallel(moeblaze.MoE(8, 4, 4, 1), "world")
    with pytest.raises(ValueError, match="1-D DeviceMesh"):
        expert_parallel(moeblaze.MoE(8, 4, 4, 1), init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "ep")))
    with pytest.raises(ValueError, match="exchange must be one of"):
        expert_parallel(moeblaze.MoE(8, 4, 4, 1), group, "nccl")
    with pytest.raises(ValueError, match="cannot run here: it needs CUDA"):
        expert_parallel(moeblaze.MoE(8, 4, 4, 1), group, "nvshmem")
    with pytest.raises(ValueError, match="found no moeblaze.MoE"):
        expert_parallel(torch.nn.Linear(2, 2), group)
    with pytest.raises(ValueError, match="token_rounding with expert parallelism"):
        expert_parallel(moeblaze.MoE(8, 4, 4, 1, token_rounding="nr"), group)
    ep_layer = expert_parallel(moeblaze.MoE(8, 4, 2 * world, 1), group)
    copied = copy.deepcopy(ep_layer)
    assert copied.ep is ep_layer.ep and copied.w1 is not ep_layer.w1
    with pytest.raises(ValueError, match="already expert-parallel"):
        shard_experts(ep_layer, group)
    model = expert_parallel(torch.nn.Sequential(moeblaze.MoE(8, 4, 2 * world, 1)), group)
    with pytest.raises(ValueError, match="pass a 2-D"):
        parallelize(model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)))
    with pytest.raises(ValueError, match="covers"):
        parallelize(model, init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",)))


def _tiny_config(aux: bool, backend: str = "torch", n_layers: int = 2) -> ModelConfig:
    return ModelConfig(seq_len=8, d_model=16, n_layers=n_layers, n_heads=2, d_ff=8, num_experts=4, top_k=2,
                       backend=backend, aux_loss_coef=0.05 if aux else 0.0, z_loss_coef=0.01)


def _loss(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])
    logits = logits if logits.dtype == torch.float64 else logits.float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
    return ce + moeblaze.aux_loss(model)


def fsdp_equal(rank: int, world: int, shape: tuple[int, ...], names: tuple[str, ...], shared_d_ff: int = 0,
               seqs_per_rank: int = 2, blocks_per_unit: int = 1, n_layers: int = 2) -> None:
    """FSDP2 (1-D) or FSDP2 + EP (2-D ``(dp_shard, ep)``) on a small MoE transformer of ``n_layers`` blocks (its
    MoE layers with a shared expert of ``shared_d_ff`` when > 0), ``blocks_per_unit`` blocks per FSDP2 unit: loss
    and every gradient equal one process on the whole batch (float64)."""
    dev = _device()
    mesh = init_device_mesh(dev.type, shape, mesh_dim_names=names)
    torch.manual_seed(7)
    # The router's load-balancing loss counts over the EP group (over the rank's own tokens without EP);
    # its mean over ranks is the single-process loss only when that group is the whole world.
    cfg = _tiny_config(aux="ep" in names and mesh["ep"].size() == world, n_layers=n_layers)
    model = MoETransformer(cfg)
    if shared_d_ff:
        for block in model.blocks:
            block.moe = moeblaze.MoE(cfg.d_model, cfg.d_ff, cfg.num_experts, cfg.top_k, backend=cfg.backend,
                                     aux_loss_coef=cfg.aux_loss_coef, z_loss_coef=cfg.z_loss_coef,
                                     shared_d_ff=shared_d_ff, shared_gate=True)
    model = model.to(dev, torch.float64)
    ref = copy.deepcopy(model)
    idx_all = torch.randint(0, 256, (world * seqs_per_rank, 9), device=dev)
    idx = idx_all[rank * seqs_per_rank:(rank + 1) * seqs_per_rank]
    parallelize(model, mesh, blocks_per_unit=blocks_per_unit)
    _check_units(model, mesh, blocks_per_unit)
    loss = _loss(model, idx)
    loss.backward()
    _check_units(model, mesh, blocks_per_unit)  # the hooks gave back the parameters they swapped for the forward
    loss_ref = _loss(ref, idx_all)
    loss_ref.backward()
    mean_loss = loss.detach().reshape(1).clone()
    dist.all_reduce(mean_loss)
    _check("loss (mean over ranks)", mean_loss / world, loss_ref.detach().reshape(1), None)
    ep_rank = mesh["ep"].get_local_rank() if "ep" in names else 0
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor()
        want = ref_params[name].grad
        if name.endswith(("w_gate_up", "w_down")) and "ep" in names:
            n_local = grad.shape[0]
            want = want[ep_rank * n_local:(ep_rank + 1) * n_local]
        _check(f"grad {name}", grad, want, None)


def _check_units(model: torch.nn.Module, mesh, blocks_per_unit: int = 1) -> None:
    """FSDP2's units as ``parallelize`` documents them: one per ``blocks_per_unit`` consecutive blocks with their
    MoE layers (router and shared expert included); on a 2-D mesh the experts a DTensor ``Shard(0)`` over
    ``dp_shard``, a unit of their own only where ``dp_shard`` has more than one rank (then the router and shared
    expert too)."""
    dp = mesh["dp_shard"]
    separate = mesh.ndim == 2 and dp.size() > 1
    states = [block._get_fsdp_state() for block in model.blocks]
    for i, state in enumerate(states):  # blocks of one unit share its state, and no other block does
        first = i - i % blocks_per_unit
        assert all((s is state) == (first <= j < first + blocks_per_unit) for j, s in enumerate(states)), i
    for block in model.blocks:
        assert isinstance(block, FSDPModule), "a block is an FSDP2 unit"
        moe = block.moe
        assert isinstance(moe, FSDPModule) == separate, f"MoE layer an FSDP2 unit: {isinstance(moe, FSDPModule)}"
        assert isinstance(moe.router, FSDPModule) == separate
        for p in moe.router.parameters():
            assert isinstance(p, DTensor) and p.device_mesh.size() == mesh.size(), "router sharded over the mesh"
        if mesh.ndim == 2:
            for name in ("w_gate_up", "w_down"):
                w = getattr(moe, name)
                assert isinstance(w, torch.nn.Parameter) and isinstance(w, DTensor), f"{name}: {type(w).__name__}"
                assert w.device_mesh == dp and w.placements == (Shard(0),), f"{name}: {w.device_mesh} {w.placements}"


def fsdp_mixed_precision(rank: int, world: int) -> None:
    """FSDP2 + EP on a (1, P) mesh under ``MixedPrecisionPolicy(param_dtype=float32)`` over float64 parameters:
    the experts kept out of FSDP2 compute in float32 as the sharded units do, their gradients come back in float64
    on their DTensors, and loss and gradients stay near the float64 run (float32 rounding can move a near-tied top-k
    choice of this tiny model: 7e-4 seen on a gradient; a missing or doubled scale would be off by 50% or more)."""
    dev = _device()
    mesh = init_device_mesh(dev.type, (1, world), mesh_dim_names=("dp_shard", "ep"))
    torch.manual_seed(5)
    model = MoETransformer(_tiny_config(aux=True)).to(dev, torch.float64)
    ref = copy.deepcopy(model)
    parallelize(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64))
    parallelize(ref, mesh)
    seen = []
    model.blocks[0].moe.register_forward_pre_hook(lambda m, args: seen.append(m.w_down.dtype))  # after the swap
    model.blocks[0].moe.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    idx = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(rank)).to(dev)
    losses = []
    for m in (model, ref):
        loss = _loss(m, idx)
        loss.backward()
        losses.append(loss.detach())
    assert seen == [torch.float32, torch.float32], f"expert weights / output dtype in forward: {seen}"
    assert rel_error(losses[0], losses[1]) < 1e-5, f"loss {losses[0].item()} vs {losses[1].item()}"
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float64, f"grad {name}: {p.grad}"
        err = rel_error(p.grad.to_local(), ref_params[name].grad.to_local())
        assert err < 1e-2, f"grad {name}: relative error {err:.2e} against the float64 run"


def fsdp_train(rank: int, world: int, steps: int = 5) -> None:
    """A few AdamW steps of FSDP2 + EP (2 ranks, mesh (1, 2)) track one process on the same global batch."""
    dev = _device()
    mesh = init_device_mesh(dev.type, (1, world), mesh_dim_names=("dp_shard", "ep"))
    torch.manual_seed(3)
    model = MoETransformer(_tiny_config(aux=True)).to(dev, torch.float64)
    ref = copy.deepcopy(model)
    parallelize(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(11)
    for step in range(steps):
        idx_all = torch.randint(0, 256, (2 * world, 9), generator=gen).to(dev)
        loss = _loss(model, idx_all[2 * rank:2 * rank + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss_ref = _loss(ref, idx_all)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        mean_loss = loss.detach().reshape(1).clone()
        dist.all_reduce(mean_loss)
        err = rel_error(mean_loss / world, loss_ref.detach().reshape(1))
        assert err <= 1e-6, f"step {step}: loss {float(mean_loss) / world} vs one process {float(loss_ref)}"
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        full = p.full_tensor()
        want = ref_params[name].detach()
        if name.endswith(("w_gate_up", "w_down")):
            want = want[rank * full.shape[0]:(rank + 1) * full.shape[0]]
        assert rel_error(full, want) <= 1e-5, f"{name} after {steps} steps differs from one process"


def fsdp_fp8_reuse(rank: int, world: int, steps: int = 2, micro: int = 2) -> None:
    """FSDP2 (1-D mesh) over FP8 layers (the recipe's emulation), ``micro`` micro-batches a step, SGD: inside
    ``moeblaze.fp8.reuse_weights`` (open over every step, so the optimizer hook drops the copies of each) the
    parameters end bitwise as without it, and each expert weight is quantized once per layout and step."""
    dev = _device()
    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp_shard",))
    torch.manual_seed(3)
    base = MoETransformer(_tiny_config(aux=True)).to(dev)
    base.set_fp8(Float8Recipe())
    real, quantized, params = Float8Recipe.quantize_weight, [], []
    Float8Recipe.quantize_weight = lambda self, w, reduce_cols: quantized.append(1) or real(self, w, reduce_cols)
    try:
        for reuse in (False, True):
            quantized.clear()
            model = copy.deepcopy(base)
            parallelize(model, mesh)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(11)
            with fp8.reuse_weights() if reuse else contextlib.nullcontext():
                for _ in range(steps):
                    for _ in range(micro):
                        idx = torch.randint(0, 256, (2 * world, 9), generator=gen).to(dev)
                        _loss(model, idx[2 * rank:2 * rank + 2]).backward()
                    opt.step()
                    opt.zero_grad()
            per_step = 4 * len(base.moe_layers())  # w1, w2, each along both dimensions
            assert len(quantized) == steps * per_step * (1 if reuse else micro), (reuse, len(quantized))
            params.append([p.full_tensor() for p in model.parameters()])
    finally:
        Float8Recipe.quantize_weight = real
    for a, b in zip(*params):
        assert torch.equal(a, b)


def fsdp_bf16_matches_unwrapped(rank: int, world: int, steps: int = 3) -> None:
    """GPU: FSDP2 with bf16 mixed precision on a 1-D mesh, Triton kernels: first-step gradients by the
    tolerance rule against fp64 (baseline: the unwrapped model in bf16), then a few steps train."""
    dev = _device()
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("dp_shard",))
    torch.manual_seed(5)
    cfg = ModelConfig(seq_len=64, d_model=128, n_layers=2, n_heads=4, d_ff=64, num_experts=8, top_k=2,
                      backend="triton", aux_loss_coef=0.0, z_loss_coef=0.0)
    model = MoETransformer(cfg).to(dev)
    ref64 = copy.deepcopy(model).double()
    for m in ref64.moe_layers():
        m.backend = "torch"
    low = copy.deepcopy(model).bfloat16()
    idx = torch.randint(0, 256, (4, 65), device=dev)
    parallelize(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    for m in (model, ref64, low):
        _loss(m, idx).backward()
    ref_p, low_p = dict(ref64.named_parameters()), dict(low.named_parameters())
    for name, p in model.named_parameters():
        assert_close_to_reference(f"grad {name}", p.grad.full_tensor().cpu(), ref_p[name].grad.cpu(),
                                  low_p[name].grad.float().cpu())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        opt.step()
        opt.zero_grad()
        loss = _loss(model, idx)
        loss.backward()
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


def runtime_checks(rank: int, world: int) -> None:
    """moeblaze.parallel.runtime inside a job: env from the process group, meshes, batch split; what ``auto``
    means for the exchange (``padded`` on CUDA, the group having a CPU backend; ``all_to_all`` on the CPU)."""
    from moeblaze.parallel.exchange import resolve_exchange

    env = init_distributed(device="cpu")
    assert resolve_exchange("auto", dist.group.WORLD, torch.device("cpu")) == "all_to_all"
    assert resolve_exchange("auto", dist.group.WORLD, torch.device("cuda", 0)) == "padded"  # resolution only
    assert (env.rank, env.world_size, env.backend) == (rank, world, "gloo")
    assert is_rank0() == (rank == 0)
    mesh = make_mesh(env, ep=world)
    assert mesh.mesh_dim_names == ("dp_shard", "ep") and tuple(mesh.shape) == (1, world)
    assert make_mesh(env).mesh_dim_names == ("dp_shard",)
    with pytest.raises(ValueError, match="positive divisor"):
        make_mesh(env, ep=world + 1)
    batch = torch.arange(4 * world).view(2 * world, 2)
    assert torch.equal(split_batch(batch, env), batch[2 * rank:2 * rank + 2])
    with pytest.raises(ValueError, match="divisible by the world size"):
        split_batch(batch[:1], env)


def ep_bias_checkpoint(rank: int, world: int, out_dir: str) -> None:
    """An expert-parallel layer with expert biases, saved by every rank: the checkpoint holds the global
    ``[E, ...]`` weights and biases (the test loads it into one process's full layer)."""
    from moeblaze.training import checkpoint

    torch.manual_seed(3)
    full = moeblaze.MoE(12, 6, 4, 2, bias=True, dtype=torch.float64)
    ep = expert_parallel(moeblaze.MoE(12, 6, 4, 2, bias=True, dtype=torch.float64), dist.group.WORLD)
    sl = slice(ep.ep.first_expert, ep.ep.first_expert + ep.ep.num_local_experts)
    with torch.no_grad():
        for name, p in ep.named_parameters():
            p.copy_(dict(full.named_parameters())[name][sl] if name in _EXPERT_WEIGHTS else
                    dict(full.named_parameters())[name])
    checkpoint.save(out_dir, 1, ep, torch.optim.AdamW(ep.parameters()), {"note": "ep biases"}, keep=1)


def run_all(rank: int, world: int, bodies: list[tuple[str, tuple]]) -> None:
    """Several rank bodies in one spawn (``(name, args)`` each), to pay the process start-up once."""
    for name, args in bodies:
        globals()[name](rank, world, *args)


def kernel_agreement(rank: int, world: int) -> None:
    """Each rank 'tuned' another configuration of one kernel key (and rank 1 a key of its own): after
    agree_kernels every rank runs rank 0's choice for the shared key and rank 1's for its own."""
    from moeblaze.kernels import tuning
    from moeblaze.kernels.combine import _GATHER_SUM as lb
    from moeblaze.parallel import agree_kernels

    shared, own = ("tuned16", 4096, torch.bfloat16, None), ("tuned16", 8192, torch.bfloat16, None)
    saved = dict(lb._best)
    try:
        lb._best[shared] = tuning.triton.Config({"BLOCK_N": 64 * (rank + 1)}, num_warps=4 + 4 * rank, num_stages=3)
        if rank == 1:
            lb._best[own] = tuning.triton.Config({"BLOCK_N": 256}, num_warps=8, num_stages=4)
        changed = agree_kernels()
        assert changed == 1, f"rank {rank}: {changed} keys changed"  # rank 0 takes 1's own key, 1 takes 0's shared one
        assert lb._best[shared].kwargs == {"BLOCK_N": 64} and lb._best[shared].num_warps == 4
        assert lb._best[own].kwargs == {"BLOCK_N": 256} and lb._best[own].num_stages == 4
    finally:
        lb._best.clear()
        lb._best.update(saved)
