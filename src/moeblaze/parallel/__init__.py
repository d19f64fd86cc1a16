"""Multi-GPU MoE training on PyTorch's distributed stack: expert parallelism and FSDP2.

- :func:`expert_parallel` (``expert_parallel(model, group)``): every MoE layer's experts spread over a process
  group, tokens exchanged without host synchronisation where the exchange allows
  (:mod:`moeblaze.parallel.ep`, :mod:`moeblaze.parallel.exchange`).
- :func:`parallelize`: ``fully_shard`` (FSDP2) a model holding :class:`moeblaze.MoE` layers over a 1-D
  data-parallel mesh or a 2-D ``(dp_shard, ep)`` mesh (:mod:`moeblaze.parallel.fsdp`).
- :func:`init_distributed`, :func:`make_mesh`, :func:`split_batch`, :func:`print0`: the process group and
  mesh from torchrun's environment, a rank's share of the global batch, one log (:mod:`.runtime`).
"""

from .ep import ExpertParallel, expert_parallel, global_load_balancing_loss, shard_experts
from .exchange import EXCHANGES
from .fsdp import parallelize
from .runtime import DistEnv, agree_kernels, init_distributed, is_rank0, make_mesh, print0, split_batch

__all__ = ["EXCHANGES", "DistEnv", "ExpertParallel", "agree_kernels", "expert_parallel", "global_load_balancing_loss",
           "init_distributed", "is_rank0", "make_mesh", "parallelize", "print0", "shard_experts", "split_batch"]
