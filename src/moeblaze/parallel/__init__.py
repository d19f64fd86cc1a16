"""Multi-GPU MoE training on PyTorch's distributed stack: expert parallelism and FSDP2.

- :class:`ExpertParallel` / ``moeblaze.MoE(..., ep_group=group)``: experts spread over a process group,
  tokens exchanged with ``all_to_all_single`` (:mod:`moeblaze.parallel.expert_parallel`).
- :func:`parallelize`: ``fully_shard`` (FSDP2) a model holding :class:`moeblaze.MoE` layers over a 1-D
  data-parallel mesh or a 2-D ``(dp_shard, ep)`` mesh (:mod:`moeblaze.parallel.fsdp`).
"""

from .expert_parallel import ExpertParallel, global_load_balancing_loss, shard_experts
from .fsdp import parallelize

__all__ = ["ExpertParallel", "global_load_balancing_loss", "parallelize", "shard_experts"]
