"""Expert-parallel weights in checkpoints: every rank's experts under one global ``[E, ...]`` name.

An expert-parallel layer holds its experts as local ``w_gate_up [E/P, 2h, d]`` / ``w_down [E/P, d, h]`` (and with
expert biases ``b_gate_up [E/P, 2h]`` / ``b_down [E/P, d]``; plain tensors, or under FSDP2 DTensors sharded over
``dp_shard`` only), under the same names on every rank. Saved that way, ``torch.distributed.checkpoint`` (DCP)
would see P different tensors claiming one name and one shape: it could neither reshard them to another P or world
size nor keep the ranks from overwriting each other. So, as torchtitan does, the state dict presents each expert
weight (and the AdamW moments of the same shape) as a DTensor of the global shape ``[E, ...]`` sharded by expert
over the EP mesh dimension — and over ``dp_shard`` inside it under FSDP2 (``_StridedShard``, FSDP2's own placement
for a dimension sharded first by another mesh dimension, here ``ep``). The DTensors wrap the local storage, so DCP
saves from it and loads into it in place; the layer's kernels keep seeing plain local tensors. DCP then reshards
between any two layouts (world sizes, P, with or without FSDP2, one process).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..layer import MoE
from .ep import expert_parameter_names

__all__ = ["ep_layout", "globalize_expert_state", "restore"]


def _ep_mesh(moe: MoE) -> tuple[DeviceMesh, str | None]:
    """The EP layer's mesh: the 2-D ``(dp_shard, ep)`` mesh :func:`parallelize` recorded (and the name of
    its data-parallel dimension), else a 1-D mesh over the layer's group."""
    mesh = getattr(moe.ep, "mesh", None)
    if mesh is not None:
        return mesh
    device = moe.w1.device.type if not isinstance(moe.w1, DTensor) else moe.w1.device_mesh.device_type
    moe.ep.mesh = (DeviceMesh.from_group(moe.ep.group, device), None)
    return moe.ep.mesh


def ep_layout(moe: MoE) -> str:
    """The expert layout of a layer in words (for errors and logs): ``"E=8 over ep=2 (dp_shard=1)"``."""
    if moe.ep is None:
        return f"E={moe.num_experts} on every rank"
    mesh, dp = _ep_mesh(moe)
    dp_size = mesh[dp].size() if dp else 1
    return f"E={moe.num_experts} over ep={moe.ep.size}" + (f" (FSDP2 dp_shard={dp_size})" if dp else "")


def _wrapper(moe: MoE, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function: the layer's parameter ``name`` (or a tensor laid out as it, e.g. its AdamW moment) ->
    the global ``[E, ...]`` DTensor over its local storage.

    Raises:
        ValueError: an FSDP2 sharding of the experts other than ``Shard(0)`` over ``dp_shard`` (named).
    """
    mesh, dp = _ep_mesh(moe)
    P = moe.ep.size

    def wrap(t: torch.Tensor) -> torch.Tensor:
        shape = (moe.num_experts, *t.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        if isinstance(t, DTensor):
            if dp is None or t.placements != (Shard(0),):
                raise ValueError(f"{name}: experts sharded as {t.placements} over {t.device_mesh}; a checkpoint "
                                 f"needs {ep_layout(moe)} with FSDP2's Shard(0) over dp_shard")
            strided = _StridedShard(0, split_factor=P) if mesh[dp].size() > 1 else Replicate()
            # (dp_shard, ep): sharded by ep first, then dp_shard inside it (right to left: strided);
            # (ep, dp_shard): left to right, plain Shard(0) twice
            placements = (strided, Shard(0)) if mesh.mesh_dim_names[0] == dp else (Shard(0), Shard(0))
            return DTensor.from_local(t.to_local(), mesh, placements, run_check=False, shape=shape, stride=stride)
        return DTensor.from_local(t, mesh, (Shard(0),), run_check=False, shape=shape, stride=stride)

    return wrap


def globalize_expert_state(model: nn.Module, model_sd: dict, optim_sd: dict | None = None) -> dict:
    """Replace, in place, every expert-parallel weight in a ``get_state_dict`` result by its global DTensor.

    Args:
        model: the model the state dicts come from (its :class:`moeblaze.MoE` layers tell which entries).
        model_sd: ``{fqn: tensor}`` (``get_model_state_dict``); optim_sd: ``{"state": {fqn: {key: tensor}},
            ...}`` (``get_optimizer_state_dict``): every state tensor shaped as its parameter is wrapped.

    Returns:
        ``{(where, fqn, key): original tensor}`` — put them back (:func:`restore`) before ``set_state_dict``.

    Raises:
        ValueError: as the wrapping (an expert sharding a checkpoint cannot describe).
    """
    replaced = {}
    for prefix, moe in model.named_modules():
        if not isinstance(moe, MoE) or moe.ep is None:
            continue
        for pname in expert_parameter_names(moe):
            fqn = f"{prefix}.{pname}" if prefix else pname
            wrap = _wrapper(moe, fqn)
            if fqn in model_sd:
                replaced[("model", fqn, None)] = model_sd[fqn]
                model_sd[fqn] = wrap(model_sd[fqn])
            states = (optim_sd or {}).get("state", {}).get(fqn, {})
            pshape = getattr(moe, pname).shape
            for key, value in states.items():
                if isinstance(value, torch.Tensor) and value.shape == pshape and value.dim() > 0:
                    replaced[("optim", fqn, key)] = value
                    states[key] = wrap(value)
    return replaced


def restore(model_sd: dict, optim_sd: dict | None, replaced: dict) -> None:
    """Undo :func:`globalize_expert_state` (the wrapped tensors share storage with the originals)."""
    for (where, fqn, key), value in replaced.items():
        if where == "model":
            model_sd[fqn] = value
        else:
            optim_sd["state"][fqn][key] = value
