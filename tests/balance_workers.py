"""Rank bodies of tests/test_balance.py (run by ``dist_utils.run_ranks`` on gloo): the global-batch loss, and the
expert-bias update under expert parallelism and FSDP2, each against one process on the concatenated batch.

The one-process reference runs in every rank's process, so its collectives get a group of that rank alone
(``solo``): the default group of :func:`moeblaze.update_expert_biases` and of the global loss is the world.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import moeblaze
from moeblaze.parallel import expert_parallel, parallelize
from moeblaze.testing import rel_error
from moeblaze.training.model import ModelConfig, MoETransformer
from moeblaze.training.train import train
from train_workers import tiny_configs

_EXPERT_WEIGHTS = ("w_gate_up", "w_down")


def _solo_group(rank: int, world: int) -> dist.ProcessGroup:
    """A group of this rank alone (every rank creates every group, as ``new_group`` requires)."""
    return [dist.new_group([r]) for r in range(world)][rank]


def global_loss(rank: int, world: int) -> None:
    """``aux_loss_type="global"``: the mean over 2 ranks of the loss (equal tokens) and of the router gradient is
    the one-process loss on the concatenated batch (= the Switch loss there); a rank with no token still takes
    part in the all-reduce (no hang) and the other's loss is then its own Switch loss."""
    solo = _solo_group(rank, world)
    for tokens, score_func in (([7, 7], "softmax"), ([6, 6], "sigmoid"), ([0, 9], "softmax")):
        torch.manual_seed(5)
        kw = {"aux_loss_coef": 0.3, "z_loss_coef": 0.0, "score_func": score_func, "aux_loss_type": "global"}
        layer = moeblaze.Router(12, 6, 2, **kw)
        ref = copy.deepcopy(layer)
        ref.aux_loss_group = solo
        x_all = torch.randn(sum(tokens), 12, dtype=torch.float64)
        first = sum(tokens[:rank])
        out = layer(x_all[first:first + tokens[rank]])
        (out.aux_loss / world).backward()
        loss, grad = out.aux_loss.detach().reshape(1).double(), layer.weight.grad.double()
        dist.all_reduce(loss)
        dist.all_reduce(grad)
        if tokens[0] == tokens[1]:
            want = ref(x_all)
            want.aux_loss.backward()
            assert rel_error(loss / world, want.aux_loss.detach().reshape(1).double()) <= 1e-6, (tokens, loss, want)
            assert rel_error(grad, ref.weight.grad.double()) <= 1e-5, tokens
        elif rank == 1:  # all tokens here: the global counts are this rank's
            probs = out.scores if score_func == "softmax" else out.scores / out.scores.sum(-1, keepdim=True)
            want = moeblaze.load_balancing_loss(probs.detach(), out.topk_ids, 0.3)
            assert rel_error(out.aux_loss.detach(), want) <= 1e-6
        else:
            assert float(out.aux_loss) == 0.0


def ep_bias(rank: int, world: int, steps: int = 3) -> None:
    """An expert-parallel layer (over the world) with the expert-bias update and each loss type, a few
    SGD steps: loads, biases (bitwise), outputs, losses and parameters equal one process on all sequences."""
    solo = _solo_group(rank, world)
    E, K, d, h, B, S = 4, 2, 12, 6, 4, 3  # B sequences of S tokens, B / world per rank
    for case, (aux_type, score_func) in enumerate((("switch", "softmax"), ("seq", "sigmoid"), ("global", "sigmoid"))):
        torch.manual_seed(11 + case)
        kw = {"aux_loss_coef": 0.05, "z_loss_coef": 0.01, "score_func": score_func, "aux_loss_type": aux_type,
              "expert_bias_update_rate": 0.01, "backend": "torch", "dtype": torch.float64}
        ref = moeblaze.MoE(d, h, E, K, aux_loss_group=solo, **kw)
        ep = expert_parallel(moeblaze.MoE(d, h, E, K, **kw), dist.group.WORLD)
        local = slice(ep.ep.first_expert, ep.ep.first_expert + ep.ep.num_local_experts)
        ref_params = dict(ref.named_parameters())
        with torch.no_grad():
            for name, p in ep.named_parameters():
                p.copy_(ref_params[name][local] if name in _EXPERT_WEIGHTS else ref_params[name])
        opt, opt_ref = torch.optim.SGD(ep.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
        mine = slice(rank * B // world, (rank + 1) * B // world)
        for step in range(steps):
            x_all, dout_all = torch.randn(B, S, d, dtype=torch.float64), torch.randn(B, S, d, dtype=torch.float64)
            out = ep(x_all[mine])
            # the sum over ranks of out . dout + (B_r / B) aux is the one-process objective
            torch.autograd.backward([out, ep.aux_loss], [dout_all[mine], torch.full_like(ep.aux_loss, 1 / world)])
            aux = ep.aux_loss.detach().reshape(1) / world
            dist.all_reduce(aux)
            dist.all_reduce(ep.router.weight.grad)  # replicated: the sum of the ranks' shares
            opt.step()
            opt.zero_grad()
            load = moeblaze.update_expert_biases(ep)
            out_ref = ref(x_all)
            torch.autograd.backward([out_ref, ref.aux_loss], [dout_all, torch.ones_like(ref.aux_loss)])
            opt_ref.step()
            opt_ref.zero_grad()
            load_ref = moeblaze.update_expert_biases(ref, group=solo)
            where = f"{aux_type}/{score_func} step {step}"
            assert torch.equal(load[0], load_ref[0]), (where, load, load_ref)
            assert torch.equal(ep.router.e_score_correction_bias, ref.router.e_score_correction_bias), where
            assert int(ep.router.tokens_per_expert.abs().sum()) == 0, "the counts were not reset"
            assert rel_error(out.detach(), out_ref.detach()[mine]) <= 1e-6, where
            assert rel_error(aux, ref.aux_loss.detach().reshape(1)) <= 1e-6, (where, aux, ref.aux_loss)
        assert ep.router.e_score_correction_bias.abs().sum() > 0
        for name, p in ep.named_parameters():
            want = ref_params[name][local] if name in _EXPERT_WEIGHTS else ref_params[name]
            assert rel_error(p.detach(), want.detach()) <= 1e-5, (aux_type, name)  # fp32 router math, 3 steps


def _ce(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)) + moeblaze.aux_loss(model)


def fsdp_bias(rank: int, world: int, steps: int = 3) -> None:
    """FSDP2 on a 1-D mesh leaves the correction biases plain replicated tensors (fully_shard shards parameters,
    not buffers); with the update after each SGD step they stay bitwise equal to one process on the whole batch."""
    solo = _solo_group(rank, world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    cfg = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=2, d_ff=8, num_experts=4, top_k=2, backend="torch",
                      score_func="sigmoid", aux_loss_coef=0.0, z_loss_coef=0.0, expert_bias_rate=0.01)
    torch.manual_seed(7)
    model = MoETransformer(cfg).double()
    ref = copy.deepcopy(model)
    parallelize(model, mesh)
    biases = {n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    assert len(biases) == 2 and not any(isinstance(b, DTensor) for b in biases.values()), biases
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(3)
    for step in range(steps):
        idx_all = torch.randint(0, 256, (2 * world, 9), generator=gen)
        _ce(model, idx_all[2 * rank:2 * rank + 2]).backward()
        opt.step()
        opt.zero_grad()
        load = moeblaze.update_expert_biases(model)
        _ce(ref, idx_all).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        load_ref = moeblaze.update_expert_biases(ref, group=solo)
        assert all(torch.equal(a, b) for a, b in zip(load, load_ref)), (step, load, load_ref)
    ref_bufs = dict(ref.named_buffers())
    for name, b in biases.items():
        assert torch.equal(b, ref_bufs[name]) and b.abs().sum() > 0, name


def train_global(rank: int, world: int, data: str, tmp: str, results: dict) -> None:
    """``moeblaze train --fsdp`` on 2 ranks with ``--aux-loss-type global --expert-bias-rate 0.01``: 8 steps,
    and the same stopped at step 4 and resumed. Results land in ``results`` (a manager dict) from rank 0."""
    cfg, mcfg = tiny_configs(data, str(Path(tmp) / "fsdp"), fsdp=True)
    cfg = replace(cfg, steps=8, eval_interval=4)
    mcfg = replace(mcfg, aux_loss_type="global", expert_bias_rate=0.01)
    full = train(cfg, mcfg)
    half = replace(cfg, out_dir=str(Path(tmp) / "half"))
    assert train(replace(half, stop_after=4), mcfg).step == 4
    resumed = train(replace(half, resume=True, overwrite=False), mcfg)
    if rank == 0:
        results.update(full=full.losses, full_val=full.val_bpb, resumed=resumed.losses, resumed_val=resumed.val_bpb)


def run_all(rank: int, world: int, bodies: list[str]) -> None:
    """Several rank bodies in one spawn, to pay the process start-up once."""
    for name in bodies:
        globals()[name](rank, world)
