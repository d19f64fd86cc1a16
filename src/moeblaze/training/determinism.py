"""Deterministic training on request (``moeblaze train --deterministic``; :func:`deterministic_mode`).

On the CPU a run is bitwise reproducible as it is (fixed kernels, gloo's fixed reduction order). On GPUs
four things choose by timing or sum in an order that changes from run to run; inside
:func:`deterministic_mode` each is fixed:

* **moeblaze's kernels**: the autotuner picks block sizes by timing them, and the block sizes set the fp32
  summation order. The setting ``deterministic`` (:mod:`moeblaze.settings`) turns autotuning off: one fixed
  configuration per kernel, whose sums run in a fixed order (no kernel of moeblaze uses atomics).
* **torch's own ops** (embedding backward, ``index_add``, attention): ``torch.use_deterministic_algorithms(True)``,
  strict (``warn_only=False``: with ``warn_only`` flash and memory-efficient attention keep their atomic
  backward); an op without a deterministic implementation then raises instead of varying.
  ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, as torch requires for cuBLAS under that mode (read when the process
  makes its first cuBLAS handle: enter the mode before the first CUDA matmul). ``torch.backends.cudnn.benchmark``
  off (it times cuDNN's algorithms).
* **attention**: :data:`ATTENTION_BACKENDS` (see there).
* **collectives**: NCCL's reductions (FSDP2's gradient reduce-scatter, the loss and norm all-reduces) add the
  ranks' chunks in an order fixed by the algorithm, the protocol and the channel count. NCCL picks the first
  two per call from the message size and the topology with a static model (no timing), so a run on the same
  machine repeats its choices; :data:`NCCL_ENV` pins them anyway (``NCCL_ALGO=Ring``, ``NCCL_PROTO=Simple``),
  so that they depend neither on NCCL's tuning tables nor on its topology detection, and so that NVLS (sums
  inside the NVSwitch, in an order NCCL does not document) is never chosen. NCCL reads them when a
  communicator is made: enter the mode before ``init_process_group``. Values set in the environment win.
  Expert parallelism's all-to-all moves rows and sums nothing.

What stays outside: a different GPU model, driver, CUDA, torch, triton or NCCL version, world size or
``--ep`` gives other (equally valid) roundings; bitwise equality holds run to run on the same machine and
software.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import settings

__all__ = ["ATTENTION_BACKENDS", "CUBLAS_WORKSPACE", "NCCL_ENV", "deterministic_mode"]

CUBLAS_WORKSPACE = ":4096:8"
NCCL_ENV = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}

# scaled_dot_product_attention's backends allowed in deterministic mode. cuDNN's is left out: torch deems it
# non-deterministic and refuses it under strict deterministic algorithms (sdp_utils.cpp, check_cudnn_deterministic,
# torch 2.13); listing the others keeps that so whatever torch's priority order becomes. Flash attention (bf16/fp16)
# comes first: under strict mode torch runs FA2's deterministic backward (dQ summed per key split into its own
# buffer, the splits then added in a fixed order, instead of fp32 atomics). Memory-efficient attention serves fp32
# (flash takes 16-bit only): under strict mode torch sets its num_splits_key to 1 (one program walks all keys of a
# query block, no atomics across splits). The math backend (matmuls and a softmax) takes the shapes both refuse.
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextlib.contextmanager
def deterministic_mode(enabled: bool = True) -> Iterator[None]:
    """Make training in this process bitwise reproducible run to run (module docstring), inside a ``with`` block.

    Sets the environment variables :data:`CUBLAS_WORKSPACE` and :data:`NCCL_ENV` (where unset; they stay set: cuBLAS
    and NCCL read them once), switches the setting ``deterministic`` on (process-wide, through
    :func:`moeblaze.settings.configure`), ``torch.use_deterministic_algorithms(True)``, cuDNN benchmarking off
    and the attention backends :data:`ATTENTION_BACKENDS`; restores the previous torch flags and setting on exit.
    ``enabled=False``: changes nothing.

    Enter it before the first CUDA matmul and before ``init_process_group`` (``moeblaze train`` does). Ops of
    torch without a deterministic implementation raise ``RuntimeError`` inside it (torch's rule).
    """
    if not enabled:
        yield
        return
    settings.library_env_defaults({"CUBLAS_WORKSPACE_CONFIG": CUBLAS_WORKSPACE, **NCCL_ENV})
    before = settings.configured()
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.benchmark)
    settings.configure(deterministic=True)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        with sdpa_kernel(ATTENTION_BACKENDS):
            yield
    finally:
        torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
        torch.backends.cudnn.benchmark = flags[2]
        settings.reset("deterministic")
        if "deterministic" in before:
            settings.configure(deterministic=before["deterministic"])
