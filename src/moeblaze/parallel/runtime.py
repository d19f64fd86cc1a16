"""What a training loop needs around FSDP2 / expert parallelism: process group and mesh from torchrun's
environment, the rank's share of a global batch, and output on rank 0 only.

Single-process runs (no ``WORLD_SIZE`` in the environment, no process group) go through the same code
with rank 0 of 1, so a loop written against these helpers runs unchanged with or without torchrun.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .. import settings

__all__ = ["DistEnv", "agree_kernels", "init_distributed", "make_mesh", "split_batch", "is_rank0", "print0"]


@dataclass(frozen=True)
class DistEnv:
    """The process's place in the job: ``rank`` of ``world_size``, ``local_rank`` on its node, its
    ``device`` and the ``backend`` (``None`` when running as a single process without a process group)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None


def _env_int(env: dict[str, str], name: str, default: int) -> int:
    value = env.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def init_distributed(device: str | None = None, timeout_s: float = 600.0) -> DistEnv:
    """Join the job torchrun started (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR/PORT``).

    NCCL on CUDA (the process takes GPU ``LOCAL_RANK`` with ``torch.cuda.set_device``) with gloo beside it for
    host tensors (``cpu:gloo,cuda:nccl``), gloo on the CPU.
    Without ``WORLD_SIZE`` (a plain ``python`` run) no process group is made: rank 0 of 1. An already
    initialised default group is used as it is; without ``LOCAL_RANK`` the process then keeps its current
    CUDA device (the one the caller set), not GPU 0.

    Args:
        device: ``"cuda"`` or ``"cpu"``; default CUDA when available.
        timeout_s: collective timeout in seconds.

    Raises:
        ValueError: a malformed torchrun variable, a rank outside ``[0, WORLD_SIZE)``, or ``LOCAL_RANK``
            past the visible GPUs.
    """
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    env = settings.launcher_env()
    # A group the caller initialised without torchrun's LOCAL_RANK (torch.multiprocessing, a scheduler's own
    # launcher) keeps the GPU the caller chose: taking GPU 0 there put every rank on one device, which NCCL
    # refuses ("Duplicate GPU detected"; 2 H200s,
    # tests/test_train_dist.py::test_train_two_gpus_matches_one).
    keep_current = kind == "cuda" and "LOCAL_RANK" not in env and dist.is_initialized()
    local_rank = torch.cuda.current_device() if keep_current else _env_int(env, "LOCAL_RANK", 0)
    if kind == "cuda":
        if not 0 <= local_rank < torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK={local_rank} but {torch.cuda.device_count()} CUDA devices are visible")
        torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank) if kind == "cuda" else torch.device("cpu")
    if dist.is_initialized():  # the device's backend ("nccl" for "cpu:gloo,cuda:nccl")
        backend = "nccl" if "nccl" in str(dist.get_backend()) else str(dist.get_backend())
        return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, dev, backend)
    world, rank = _env_int(env, "WORLD_SIZE", 1), _env_int(env, "RANK", 0)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} must be in [0, WORLD_SIZE={world})")
    if "WORLD_SIZE" not in env:
        return DistEnv(0, 1, local_rank, dev, None)
    backend = "nccl" if kind == "cuda" else "gloo"
    # CUDA: gloo beside NCCL, so that host integers (the expert-parallel exchange's capacity, a stop flag) are
    # agreed on without a device round trip and its synchronisation
    dist.init_process_group("cpu:gloo,cuda:nccl" if kind == "cuda" else backend, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s), device_id=dev if kind == "cuda" else None)
    return DistEnv(rank, world, local_rank, dev, backend)


def make_mesh(env: DistEnv, ep: int = 1) -> DeviceMesh:
    """The mesh for :func:`moeblaze.parallel.parallelize`: 1-D ``("dp_shard",)`` of all ranks when
    ``ep == 1``, else 2-D ``("dp_shard", "ep")`` of shape ``(world_size // ep, ep)`` (an EP group is ``ep``
    consecutive ranks, e.g. the GPUs of one node).

    Raises:
        ValueError: ``ep < 1``, ``ep`` not dividing the world size, or no process group (single process).
    """
    if not isinstance(ep, int) or ep < 1 or env.world_size % ep:
        raise ValueError(f"ep must be a positive divisor of the world size {env.world_size}, got {ep!r}")
    if env.backend is None:
        raise ValueError("make_mesh needs a process group: launch with torchrun (init_distributed found none)")
    if ep == 1:
        return init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(env.device.type, (env.world_size // ep, ep), mesh_dim_names=("dp_shard", "ep"))


def split_batch(batch: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """This rank's rows of a global batch: ``batch [B, ...]`` -> ``batch[r*B/W:(r+1)*B/W]`` (a view).

    Every rank draws the same global batch (same seed) and keeps its slice, so W ranks see exactly the
    batch one process would, and mean losses averaged over ranks equal the one-process loss.

    Raises:
        ValueError: B not divisible by the world size W.
    """
    B = batch.shape[0]
    if B % env.world_size:
        raise ValueError(f"global batch size {B} must be divisible by the world size {env.world_size}")
    per = B // env.world_size
    return batch[env.rank * per:(env.rank + 1) * per]


def is_rank0() -> bool:
    """True on global rank 0, and in a run without a process group."""
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args, **kwargs) -> None:
    """``print`` on rank 0 only (one log for the job)."""
    if is_rank0():
        print(*args, **kwargs)


def agree_kernels(group: dist.ProcessGroup | None = None) -> int:
    """Make every rank of ``group`` (default: the world) run the kernel configurations one rank chose.

    Autotuning picks each kernel's configuration by timing it, in each process on its own, so ranks can pick
    different ones and the slowest sets the pace of every collective. This all-gathers every rank's choices
    (:func:`moeblaze.kernels.tuning.tuned_choices`, a few kB) and each rank adopts, for every tuned key, the choice
    of the lowest rank that tuned it. Call it on every rank at the same point, after the steps that tuned (``moeblaze
    train`` does after its first step); keys tuned later are each rank's own. Without Triton, or with autotuning off
    (fixed configurations, the same everywhere), there is nothing to agree on.

    Returns:
        How many keys changed on this rank (0 in a single process).
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return 0
    try:
        from ..kernels import tuning
    except ImportError:  # no Triton: no kernel was tuned, but every rank must still take part
        tuning = None
    mine = tuning.tuned_choices() if tuning is not None else {}
    gathered: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    merged: dict = {}
    for table in reversed(gathered):  # lower ranks last: their choices win
        merged.update(table or {})
    return tuning.adopt_choices(merged) if tuning is not None else 0
