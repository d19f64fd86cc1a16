"""moeblaze: memory-lean, fast Mixture-of-Experts training (MoEBlaze, arXiv 2601.05296).

Public API: :class:`MoE` (router + experts module), :func:`moe_experts` (the routed experts),
:func:`build_dispatch` / :class:`DispatchIndex` (zero-buffer dispatch), :func:`moe_experts_general`
(general routing inputs: pair lists), :func:`round_tokens` / :func:`tile_multiple` (token rounding), :class:`Router`,
:func:`aux_loss`, :func:`update_expert_biases` / :func:`expert_load` (auxiliary-loss-free balancing and the
experts' load: :mod:`moeblaze.balance`), :class:`Float8Recipe` (FP8 expert GEMMs: :mod:`moeblaze.fp8`),
:func:`memory_report` (where activation memory goes) and :func:`moe_experts_reference` (float64 reference for tests).
"""

from importlib.metadata import PackageNotFoundError, version

from . import settings
from .balance import expert_load, global_batch_load_balancing_loss, sequence_load_balancing_loss, update_expert_biases
from .dispatch import DispatchIndex, TileSchedule, build_dispatch
from .experts import moe_experts
from .fp8 import Float8Recipe
from .general_routing import build_dispatch_pairs, moe_experts_general
from .layer import MoE, aux_loss, detach_aux_losses
from .memory_report import MemoryReport, memory_report
from .reference import moe_experts_reference
from .routing import Router, RouterOutput, load_balancing_loss, router_z_loss
from .token_rounding import TokenRounding, round_tokens, tile_multiple

__all__ = [
    "settings",
    "DispatchIndex",
    "Float8Recipe",
    "MemoryReport",
    "MoE",
    "Router",
    "RouterOutput",
    "TileSchedule",
    "TokenRounding",
    "aux_loss",
    "detach_aux_losses",
    "build_dispatch",
    "build_dispatch_pairs",
    "expert_load",
    "global_batch_load_balancing_loss",
    "load_balancing_loss",
    "memory_report",
    "moe_experts",
    "moe_experts_general",
    "moe_experts_reference",
    "round_tokens",
    "router_z_loss",
    "sequence_load_balancing_loss",
    "tile_multiple",
    "update_expert_biases",
]
try:  # the installed distribution's version (pyproject.toml's); a source tree that was never installed has none
    __version__ = version("moeblaze")
except PackageNotFoundError:
    __version__ = "0+unknown"
