"""moeblaze: memory-lean, fast Mixture-of-Experts training (MoEBlaze, arXiv 2601.05296).

Public API: :class:`MoE` (router + experts module), :func:`moe_experts` (the routed experts),
:func:`build_dispatch` / :class:`DispatchIndex` (zero-buffer dispatch), :class:`Router`,
:func:`aux_loss`, :func:`memory_report` (where activation memory goes) and
:func:`moe_experts_reference` (float64 reference for tests).
"""

from . import settings
from .dispatch import DispatchIndex, TileSchedule, build_dispatch
from .experts import moe_experts
from .layer import MoE, aux_loss
from .memory_report import MemoryReport, memory_report
from .reference import moe_experts_reference
from .routing import Router, RouterOutput, load_balancing_loss, router_z_loss

__all__ = [
    "settings",
    "DispatchIndex",
    "MemoryReport",
    "MoE",
    "Router",
    "RouterOutput",
    "TileSchedule",
    "aux_loss",
    "build_dispatch",
    "load_balancing_loss",
    "memory_report",
    "moe_experts",
    "moe_experts_reference",
    "router_z_loss",
]
__version__ = "0.1.0"
