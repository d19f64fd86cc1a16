"""CUDA-graph capture: what the layer does differently while a stream is being captured.

Forward and backward of :class:`moeblaze.MoE` on the Triton backend read nothing on the host and
allocate only through PyTorch's caching allocator (the TMA descriptors' scratch included), so they can be
captured by ``torch.cuda.graph``, ``torch.cuda.make_graphed_callables`` and
``torch.compile(mode="reduce-overhead")``. Two things need a host round trip and change under
capture, and two things must be let go first:

* autotuning: Triton's autotuner times its candidates with synchronisations. A kernel key first seen
  inside a capture takes the fixed default configuration (``MOEBLAZE_AUTOTUNE=0``'s) and keeps it for the
  rest of the process (so later eager runs match the replays). Run one eager step before capturing
  (PyTorch's warm-up; ``make_graphed_callables`` and ``torch.compile`` do it themselves) to capture the
  tuned configurations.
* the last step's graph: :class:`moeblaze.MoE` keeps its ``aux_loss`` (and so that step's autograd graph)
  until its next forward; after eager steps on the default stream, call :func:`moeblaze.detach_aux_losses`
  before the warm-up that precedes a capture (its docstring says why).
* dead CUDA graphs: ``torch.cuda.graph`` no longer runs the cycle collector on entry (PyTorch's
  ``torch.compiler.config.force_cudagraph_gc``), so a graph that died in a reference cycle (the graphs of
  ``make_graphed_callables`` live in generated autograd Function classes) can be destroyed by a collection
  that starts inside a later capture, and destroying a graph invalidates the capture ("operation not
  permitted when stream is capturing (function reset)", then "operation failed due to a previous error during
  capture"). Call ``gc.collect()`` before capturing after such graphs were dropped (seen in
  ``tests/test_graphs.py`` on an H200).
* ``backend="torch"``: capturable on its ``grouped_mm`` path (CUDA, bf16, d and h multiples of 8, no expert
  biases); its per-expert loops (other dtypes, the expert-bias gradients) read the expert offsets on the
  host and under capture raise ``RuntimeError`` naming the op.
"""

from __future__ import annotations

import torch

__all__ = ["capturing"]


def capturing(t: torch.Tensor) -> bool:
    """True while ``t`` is a CUDA tensor and the current CUDA stream is being captured into a graph."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()
