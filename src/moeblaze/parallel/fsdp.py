"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for models holding :class:`moeblaze.MoE` layers.

The fused kernels need plain tensors: under FSDP2 a module's parameters are sharded DTensors between
steps, and ``fully_shard``'s pre-forward / pre-backward hooks swap in the all-gathered local tensors while
the module runs, so the kernels see ordinary ``[E, 2h, d]`` / ``[E, d, h]`` weights and the gradients they
produce are reduce-scattered back to shards. No code path of the layer knows about FSDP.

Meshes (after torchtitan's layout for expert parallelism):

- 1-D data-parallel mesh (any dimension name but ``ep``): every parameter sharded over it.
- 2-D ``(dp_shard, ep)`` mesh: the MoE layers are expert-parallel over ``ep`` (made so here with
  :func:`moeblaze.parallel.expert_parallel`, or before over ``mesh["ep"]``). Non-expert parameters (router
  included) are sharded over the whole mesh; a layer's expert weights over ``dp_shard`` only, i.e. among the
  ranks that hold the same experts. Expert gradients are divided by the whole mesh size, as the others are
  (FSDP's mean over ``dp_shard`` and ``ExpertParallel.grad_divide = P``), so every gradient is the mean over all
  ranks' losses. With a 1-rank ``dp_shard`` (``--ep N`` on N GPUs) the experts have nothing to shard or reduce:
  they stay out of FSDP2 (DTensors on ``dp_shard`` all the same, so checkpoints, the optimizer and the gradient
  norm see the layout FSDP2 would give them), cast to the compute dtype once per forward by a hook.

Units (one all-gather / reduce-scatter and four host hooks each per step): a block of the model (an element of an
``nn.ModuleList``) is one unit with its MoE layer's router, shared expert and, except on a 2-D mesh with
``dp_shard`` > 1, its experts. The training step is bound by the host's launches, and fewer units gave 10% (FSDP2) to
16-23% (``--ep 4`` / ``--ep 2``) more tokens/s per GPU than three units per block on 4 H200s
(``RUNS="1 ep4 fsdp4" bash benchmarks/multigpu.sh train`` with both layouts; docs/results-train-multigpu.csv).
``blocks_per_unit`` shards consecutive blocks together (``moeblaze train --fsdp-blocks-per-unit``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from ..layer import MoE
from ..routing import RouterOutput
from .ep import expert_parameter_names, shard_experts

__all__ = ["parallelize"]


def _register_router_output() -> None:
    """Make :class:`moeblaze.RouterOutput` a pytree node, so that FSDP2 finds the tensors a separately
    sharded router returns and hooks its pre-backward all-gather on them."""
    if RouterOutput not in pytree.SUPPORTED_NODES:
        pytree.register_dataclass(RouterOutput)


def _split_mesh(mesh: DeviceMesh, ep_dim: str) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh | None]:
    """``(flat, dp, ep)`` meshes: the whole mesh as 1-D, the expert-sharding dimension, the EP dimension."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    names = mesh.mesh_dim_names
    if dist.get_world_size() != mesh.size():
        raise ValueError(f"mesh {names} of shape {tuple(mesh.shape)} covers {mesh.size()} ranks, but the "
                         f"world size is {dist.get_world_size()}")
    if names is None or ep_dim not in names:
        if mesh.ndim != 1:
            raise ValueError(f"mesh must be 1-D (data parallel) or 2-D with dimensions (dp_shard, {ep_dim!r}), "
                             f"got dimensions {names}")
        return mesh, mesh, None
    if mesh.ndim != 2:
        raise ValueError(f"an expert-parallel mesh must be 2-D (dp_shard, {ep_dim!r}), got dimensions {names}")
    dp_dim = names[0] if names[1] == ep_dim else names[1]
    return mesh._flatten(f"{dp_dim}_{ep_dim}"), mesh[dp_dim], mesh[ep_dim]


def parallelize(model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None,
                reshard_after_forward: bool = True, ep_dim: str = "ep", exchange: str = "auto",
                prefetch: bool = True, max_tokens: int | None = None, blocks_per_unit: int = 1) -> nn.Module:
    """Shard ``model`` with FSDP2 over ``mesh``, expert-parallel over its ``ep_dim`` dimension if it has one.

    Units of sharding (each one all-gather / reduce-scatter): every element of every ``nn.ModuleList`` (the
    transformer blocks of the usual layout) with the MoE layers in it, then the root with what is left. On a 2-D
    mesh with ``dp_shard`` > 1 each MoE layer's experts are a unit over ``dp_shard``, and its router and shared
    expert units over the whole mesh; with a 1-rank ``dp_shard`` the experts stay out of FSDP2 (module docstring).
    Modifies ``model`` in place and returns it; its parameters become DTensors.

    Args:
        model: a module holding :class:`moeblaze.MoE` layers (any of them may be expert-parallel already,
            over a group with the ranks of ``mesh[ep_dim]``; the others are converted with
            :func:`moeblaze.parallel.shard_experts`, which keeps rank r's experts of the current weights).
        mesh: a 1-D data-parallel ``DeviceMesh`` or a 2-D one with dimensions ``(dp_shard, ep_dim)``
            (``dp_shard`` may have size 1), covering the whole world.
        mp_policy: FSDP2 mixed precision, e.g. ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32)`` on GPU; default: compute in the parameters' dtype.
        reshard_after_forward: free the gathered parameters after forward (re-gathered in backward); False keeps
            them from forward to backward (one all-gather per unit and step instead of two, as ZeRO-2; the root
            and the last block are kept either way, their backward follows at once).
        ep_dim: the name of the expert-parallel mesh dimension.
        exchange: the token exchange of the expert-parallel layers (:data:`moeblaze.parallel.EXCHANGES`).
        max_tokens: the most tokens a rank passes to an MoE layer in one forward, the same on every rank
            (:func:`moeblaze.parallel.shard_experts`: the exchanges then need no agreement between the hosts).
        prefetch: each block's units all-gather the next block's parameters in forward (the previous block's in
            backward) as they start, so the gathers run under the current block's compute even when the host
            launches just in time (FSDP2's own prefetch issues a gather only when the host reaches its unit).
        blocks_per_unit: consecutive blocks of an ``nn.ModuleList`` sharded as one unit (``fully_shard`` of the
            list of them): one all-gather, one reduce-scatter and one set of FSDP2's host hooks for all of them,
            for steps bound by the host; larger gathers, and each overlaps less of its neighbours' compute. The
            default model's 3 blocks in one unit: 1.10-1.20x the tokens/s on 2 gloo processes of a 2-core CPU
            (alternated runs of ``torchrun --nproc-per-node 2 -m moeblaze.cli train --fsdp --fsdp-blocks-per-unit
            3``, docs/results-train-multigpu.csv).

    Raises:
        TypeError: ``mesh`` is not a ``DeviceMesh``.
        ValueError: a mesh of another shape or size than the world; an expert-parallel layer on a mesh
            without ``ep_dim`` or over another group than ``mesh[ep_dim]``; ``blocks_per_unit`` not a positive
            int; as :class:`ExpertParallel`.
    """
    if not isinstance(blocks_per_unit, int) or isinstance(blocks_per_unit, bool) or blocks_per_unit < 1:
        raise ValueError(f"blocks_per_unit must be a positive int (blocks of a ModuleList per FSDP2 unit), "
                         f"got {blocks_per_unit!r}")
    flat, dp_mesh, ep_mesh = _split_mesh(mesh, ep_dim)
    policy = mp_policy or MixedPrecisionPolicy()
    kept: set[nn.Parameter] = set()  # expert weights left out of FSDP2 (a 1-rank dp_shard)
    for name, moe in ((n, m) for n, m in model.named_modules() if isinstance(m, MoE)):
        if ep_mesh is None:
            if moe.ep is not None:
                raise ValueError(f"MoE layer {name!r} is expert-parallel ({moe.ep}); pass a 2-D (dp_shard, "
                                 f"{ep_dim!r}) mesh")
            continue  # sharded with its block
        if moe.ep is None:
            shard_experts(moe, ep_mesh, exchange, max_tokens)
        elif dist.get_process_group_ranks(moe.ep.group) != dist.get_process_group_ranks(ep_mesh.get_group()):
            raise ValueError(f"MoE layer {name!r} is expert-parallel over ranks "
                             f"{dist.get_process_group_ranks(moe.ep.group)}, but mesh[{ep_dim!r}] here is ranks "
                             f"{dist.get_process_group_ranks(ep_mesh.get_group())}")
        moe.ep.mesh = (mesh, dp_mesh.mesh_dim_names[0])  # the experts' layout in checkpoints (state_dict.py)
        # FSDP averages the expert gradients over dp_shard only; dividing them by P in the layer makes them
        # means over the whole mesh, as every other gradient. (FSDP2's set_gradient_divide_factor does this
        # too, but divides twice for a 1-rank dp_shard with an fp64/fp16 reduce dtype, torch 2.13.)
        moe.ep.grad_divide = ep_mesh.size()
        if dp_mesh.size() == 1:
            kept |= _keep_experts(moe, dp_mesh, policy.param_dtype)
            continue
        _register_router_output()
        for replicated in (moe.router, moe.shared_experts):  # the same on every EP rank: sharded over all
            if replicated is not None:
                fully_shard(replicated, mesh=flat, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        fully_shard(moe, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    kw = {"mesh": flat, "mp_policy": policy, "ignored_params": kept or None}
    units = []  # each a list of blocks sharded together
    for mlist in [m for m in model.modules() if isinstance(m, nn.ModuleList)]:
        blocks = [c for c in mlist if not isinstance(c, FSDPModule) and any(True for _ in c.parameters())]
        for i in range(0, len(blocks), blocks_per_unit):
            group = blocks[i:i + blocks_per_unit]
            last = group[-1] is mlist[-1]
            fully_shard(group if len(group) > 1 else group[0],
                        reshard_after_forward=reshard_after_forward and not last, **kw)
            units.append(group)
    fully_shard(model, reshard_after_forward=False, **kw)
    if prefetch:
        _set_prefetch(units)
    return model


def _keep_experts(moe: MoE, dp_mesh: DeviceMesh, param_dtype: torch.dtype | None) -> set[nn.Parameter]:
    """Leave an expert-parallel layer's expert weights out of FSDP2 (a 1-rank ``dp_shard``): each becomes a DTensor
    ``Shard(0)`` over ``dp_mesh`` (FSDP2's layout, the same storage), and a forward pre-hook hands the layer its
    local tensor in ``param_dtype`` (the cast's backward brings the gradient back in the parameter's dtype).
    Returns the parameters, for ``fully_shard``'s ``ignored_params``."""
    names = expert_parameter_names(moe)
    for name in names:
        p = getattr(moe, name)
        setattr(moe, name, nn.Parameter(DTensor.from_local(p.detach(), dp_mesh, [Shard(0)], run_check=False),
                                        requires_grad=p.requires_grad))

    def to_local(module: MoE, args):
        # the parameters are stashed on the module, not in this closure, so that a deep copy restores its own
        module._kept_experts = {n: module._parameters[n] for n in names}
        for n, p in module._kept_experts.items():
            local = p.to_local()
            module._parameters[n] = local.to(param_dtype) if param_dtype is not None else local

    def restore(module: MoE, args, out):
        module._parameters.update(module.__dict__.pop("_kept_experts", {}))

    moe.register_forward_pre_hook(to_local)
    moe.register_forward_hook(restore, always_call=True)
    return {getattr(moe, n) for n in names}


def _units(group: list[nn.Module]) -> list[FSDPModule]:
    """The FSDP2 units of a group of blocks sharded together, in forward order: the group's own (its first block
    stands for it: the blocks share one FSDP2 state), then the units nested in its blocks."""
    return [group[0], *(m for b in group for m in b.modules() if m is not b and isinstance(m, FSDPModule))]


def _set_prefetch(groups: list[list[nn.Module]]) -> None:
    """Explicit prefetch between consecutive units of blocks (``parallelize``'s ``prefetch``)."""
    for prev, nxt in zip(groups, groups[1:]):
        prev[0].set_modules_to_forward_prefetch(_units(nxt))
        # in backward a unit's own state starts first (its outputs' gradients arrive before its MoE layers')
        nxt[0].set_modules_to_backward_prefetch(_units(prev))
