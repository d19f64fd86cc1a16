"""``moeblaze bench``: the MoEBlaze paper's evaluation against conventional and peer MoE layers.

Modules: :mod:`.configs` (named configs, suites, FLOP and byte formulas), :mod:`.baselines`
(the implementations compared), :mod:`.runner` (CUDA-event timing, saved-for-backward bytes, peak
memory), :mod:`.peak` (what is allocated at a step's peak), :mod:`.micro` (dispatch micro-benchmark,
training throughput), :mod:`.report` (CSV, markdown, terminal), :mod:`.plots` (PNG), :mod:`.results`
(the results file, the README table and plots made from it) and :mod:`.cli`
(the ``bench`` and ``memory`` subcommands; ``memory_report`` itself is :mod:`moeblaze.memory_report`).
"""

from ..memory_report import MemoryReport, ModuleMemory, memory_report
from .configs import CONFIGS, SUITES, BenchConfig, expected_saved_bytes, get_configs, layer_flops

__all__ = ["BenchConfig", "CONFIGS", "SUITES", "MemoryReport", "ModuleMemory", "expected_saved_bytes",
           "get_configs", "layer_flops", "memory_report"]
