"""``moeblaze train`` on many processes: the pieces of the training loop that know about ranks.

Under ``torchrun --nproc-per-node N -m moeblaze.cli train --fsdp [--ep P]`` every rank builds the same
full model from the same seed, then :func:`moeblaze.parallel.parallelize` shards it with FSDP2 over a
``(dp_shard,)`` mesh, or a ``(dp_shard, ep)`` mesh whose MoE layers keep rank r's experts of those
weights; so a run starts from the weights a one-process run starts from. Each step every rank draws the
same global batch (seeded by ``(seed, step)``) and keeps its rows (:func:`moeblaze.parallel.split_batch`);
FSDP2 averages the gradients over ranks, so the step is the one-process step on the global batch (up to
the load-balancing loss, which counts the experts of each rank's tokens — of the EP group's with EP, of every
rank's with ``--aux-loss-type global``).
Losses and validation sums are all-reduced; the gradient norm is summed over every rank's shards; only
rank 0 logs. Without ``--fsdp`` and without torchrun nothing here communicates (a job of one rank).

A job of several ranks runs a :class:`moeblaze.training.heartbeat.PeerMonitor`: a dead rank ends the others with
one line naming it (within about 6 s under torchrun, within half of ``--dist-timeout`` under a launcher that
starts each rank itself), instead of leaving them in a collective until the process group's timeout.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from .. import settings
from ..parallel.fsdp import parallelize
from ..parallel.runtime import DistEnv, init_distributed, make_mesh, split_batch
from .heartbeat import PeerMonitor, lost_after
from .train_config import MIXED

__all__ = ["Job", "check_same_config", "clip_grad_norm", "start_job"]


@dataclass
class Job:
    """The process's place in a training job.

    Attributes:
        env: rank, world size, device, backend (``None``: one process without a process group).
        mesh: the FSDP2 mesh (``None`` without ``--fsdp``). ep: the expert-parallel size P.
        owns_group: this job created the default process group (and destroys it in :meth:`close`).
        monitor: the heartbeat of a job of several ranks (None otherwise); peers_checked: :meth:`check_peers` ran.
    """

    env: DistEnv
    mesh: DeviceMesh | None = None
    ep: int = 1
    owns_group: bool = False
    monitor: PeerMonitor | None = None
    peers_checked: bool = False

    @property
    def distributed(self) -> bool:
        return self.env.backend is not None

    @property
    def rank0(self) -> bool:
        return self.env.rank == 0

    @property
    def world(self) -> int:
        return self.env.world_size

    def layout(self) -> dict:
        """The run's layout, stored in checkpoints: ``{"world_size", "fsdp", "ep"}``."""
        return {"world_size": self.world, "fsdp": self.mesh is not None, "ep": self.ep}

    def local_rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the global batch ``[B, ...]`` (``B % world == 0``, checked at start)."""
        return split_batch(batch, self.env) if self.distributed else batch

    def shard(self, model: torch.nn.Module, precision: str, reshard: bool = True, reduce_dtype: str = "fp32",
              exchange: str = "auto", prefetch: bool = True, max_tokens: int | None = None,
              blocks_per_unit: int = 1) -> torch.nn.Module:
        """FSDP2 (+ EP) over the mesh; ``bf16-mixed`` and ``fp8-mixed`` -> ``MixedPrecisionPolicy(
        param_dtype=bfloat16, reduce_dtype=float32)`` (``reduce_dtype="bf16"``: bfloat16; the forward then runs
        without autocast), else compute in the parameters' dtype. ``reshard``: FSDP2's ``reshard_after_forward``;
        ``exchange``: the expert-parallel layers' token exchange; ``prefetch``, ``max_tokens``, ``blocks_per_unit``:
        :func:`parallelize`'s. Returns ``model`` unchanged without ``--fsdp``."""
        if self.mesh is None:
            return model
        reduce = torch.bfloat16 if reduce_dtype == "bf16" else torch.float32
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
                  if precision in MIXED else MixedPrecisionPolicy())
        # The MoE layers return a view (a reshape of their output); the blocks add it out of place, which is
        # what FSDP2's warning about in-place ops on views asks for.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPMoE\) returned a view tensor")
        return parallelize(model, self.mesh, mp_policy=policy, reshard_after_forward=reshard, exchange=exchange,
                           prefetch=prefetch, max_tokens=max_tokens, blocks_per_unit=blocks_per_unit)

    def all_mean(self, values: torch.Tensor) -> torch.Tensor:
        """The mean over ranks of a float tensor (the tensor itself in one process)."""
        if not self.distributed:
            return values
        values = values.clone()
        dist.all_reduce(values)
        return values / self.world

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a float tensor (the tensor itself in one process)."""
        if self.distributed:
            values = values.clone()
            dist.all_reduce(values)
        return values

    def check_peers(self) -> None:
        """After a collective failed in this rank: if a peer is gone, the monitor ends the process with one line
        naming it (waiting as long as that verdict takes, once per job); else return (the failure is this rank's)."""
        if self.monitor is not None and not self.peers_checked:
            self.peers_checked = True
            self.monitor.check_after_failure()

    def close(self, finished: bool = True) -> None:
        """Stop the heartbeat and destroy the process group this job created (every rank; a no-op otherwise).
        ``finished``: the rank leaves normally — done, or with an error every rank raised alike (:meth:`check_peers`
        otherwise: its peers then see it as lost)."""
        if self.monitor is not None:
            self.monitor.close(finished)
            self.monitor = None
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False


def start_job(fsdp: bool, ep: int, device: torch.device, batch_size: int, timeout_s: float = 300.0,
              advice: str = "") -> Job:
    """The job this process is part of: torchrun's (``--fsdp``: process group, mesh) or one process.

    Args:
        fsdp: shard with FSDP2 (needs torchrun, even for one process). ep: expert-parallel size P.
        device: the resolved ``--device`` (CUDA: each rank takes GPU ``LOCAL_RANK``; CPU: gloo).
        batch_size: the global batch (sequences per step), split over the ranks.
        timeout_s: ``--dist-timeout``: the process group's collective timeout; a rank silent for
            :func:`moeblaze.training.heartbeat.lost_after` of it counts as lost.
        advice: appended to the line a survivor prints when a rank is lost (what to run next).

    Raises:
        ValueError: ``--ep`` > 1 without ``--fsdp``; several processes without ``--fsdp``; ``--fsdp``
            outside torchrun; P not dividing the world size; a batch not divisible by the world size.
    """
    launched = settings.launcher_env()
    world = int(launched.get("WORLD_SIZE", "1") or 1)
    if not fsdp:
        if ep != 1:
            raise ValueError(f"--ep {ep} needs --fsdp (expert parallelism runs under FSDP2)")
        if world > 1:
            raise ValueError(f"{world} processes (WORLD_SIZE={world}) need --fsdp: plain data parallelism "
                             "would replicate the model; pass --fsdp (and --ep P for expert parallelism)")
        return Job(DistEnv(0, 1, 0, device, None))
    if "WORLD_SIZE" not in launched and not dist.is_initialized():
        raise ValueError("--fsdp needs torchrun (torchrun --nproc-per-node N -m moeblaze.cli train --fsdp ...); "
                         "to resume a --fsdp run in one process, pass --no-fsdp --ep 1")
    owns = not dist.is_initialized()
    env = init_distributed(device.type, timeout_s)
    job = Job(env, owns_group=owns, ep=ep)
    if env.world_size > 1:
        job.monitor = PeerMonitor(env.rank, env.world_size, lost_after(timeout_s), advice).start()
    try:
        if env.world_size % ep:
            raise ValueError(f"--ep {ep} must divide the number of processes {env.world_size}")
        if batch_size % env.world_size:
            raise ValueError(f"--batch-size {batch_size} (the global batch) must be divisible by the number of "
                             f"processes {env.world_size}")
        job.mesh = make_mesh(env, ep)
    except ValueError:
        job.close()
        raise
    return job


def check_same_config(job: Job, **configs: dict) -> None:
    """Every rank must run the same configuration: one ``all_gather_object``, before any other collective
    of the run, so that a rank started with other flags fails every rank at once instead of hanging.

    Raises:
        ValueError: on every rank, naming each differing field with each rank's value.
    """
    if not job.distributed:
        return
    gathered: list[dict | None] = [None] * job.world
    dist.all_gather_object(gathered, configs)
    diffs = []
    for section, mine in configs.items():
        for key in mine:
            values = [g[section].get(key) for g in gathered]
            if any(v != values[0] for v in values):
                diffs.append(f"{key} = " + ", ".join(f"{v!r} (rank {r})" for r, v in enumerate(values)))
    if diffs:
        raise ValueError("the ranks were started with different configurations: " + "; ".join(diffs))


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, job: Job) -> torch.Tensor:
    """The global gradient norm over every rank's shards, and (``max_norm > 0``) the gradients scaled to it.

    Under FSDP2 (+ EP) each element of the model lives on exactly one rank (non-expert parameters sharded
    over the whole mesh, each EP group's experts over its ``dp_shard`` ranks), so the squared norm is the
    all-reduced sum of the local shards' squares. ``torch.nn.utils.clip_grad_norm_`` cannot do this: the
    expert and the other parameters are DTensors on different meshes. Scaling as it does:
    ``max_norm / (norm + 1e-6)``, capped at 1. Returns the norm (fp32, on the device).

    The norms and the scaling are foreach ops (a few launches for all the shards, not two or three per parameter):
    the step is bound by the host's launches (docs/benchmarks.md, Multi-GPU).
    """
    local = [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for p in params]
    acc = torch.float64 if any(g.dtype == torch.float64 for g in local) else torch.float32  # never narrowed
    sq = torch.stack(torch._foreach_norm(local, 2.0, dtype=acc)).square().sum()
    norm = job.all_sum(sq.reshape(1)).sqrt().reshape(())
    if max_norm > 0:
        torch._foreach_mul_(local, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm.float()
