"""Multi-GPU MoE training on PyTorch's distributed stack: expert parallelism and FSDP2.

- :class:`ExpertParallel` / ``moeblaze.MoE(..., ep_group=group)``: experts spread over a process group,
  tokens exchanged with ``all_to_all_single`` (:mod:`moeblaze.parallel.expert_parallel`).
- :func:`parallelize`: ``fully_shard`` (FSDP2) a model holding :class:`moeblaze.MoE` layers over a 1-D
  data-parallel mesh or a 2-D ``(dp_shard, ep)`` mesh (:mod:`moeblaze.parallel.fsdp`).
- :func:`init_distributed`, :func:`make_mesh`, :func:`split_batch`, :func:`print0`: the process group and
  mesh from torchrun's environment, a rank's share of the global batch, one log (:mod:`.runtime`).
"""

from .expert_parallel import ExpertParallel, global_load_balancing_loss, shard_experts
from .fsdp import parallelize
from .runtime import DistEnv, init_distributed, is_rank0, make_mesh, print0, split_batch

__all__ = ["DistEnv", "ExpertParallel", "global_load_balancing_loss", "init_distributed", "is_rank0", "make_mesh",
           "parallelize", "print0", "shard_experts", "split_batch"]
