"""Spawn a function on N ranks (gloo on the CPU, NCCL on GPUs) with a join timeout, for the multi-process tests.

``run_ranks(fn, world, *args)`` starts ``world`` processes (``torch.multiprocessing``, spawn), each calling
``fn(rank, world, *args)`` inside an initialised default process group, and fails the test with the first
rank's traceback; a rank that is still running after ``timeout`` seconds fails it too (no hang in CI).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, backend: str, fn, args) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # NCCL with gloo beside it for host tensors, as moeblaze.parallel.init_distributed sets it up (the sync-free
    # expert-parallel exchanges agree on their capacity over the CPU backend)
    dist.init_process_group("cpu:gloo,cuda:nccl" if backend == "nccl" else backend,
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # A rank that passed leaves without the interpreter's finalization: there a gloo worker thread that drops the
    # last reference to a collective's tensors takes the GIL, Python ends that thread, and the C++ runtime aborts
    # the process ("terminate called without an active exception", SIGABRT; seen in CI on a loaded 2-core machine,
    # tests/test_ep_baselines.py::test_ep_baselines_reject_bad_sources). A failing rank still raises above, so
    # spawn reports its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world: int, *args, backend: str = "gloo", timeout: float = 120.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks; raise if one fails or ``timeout`` passes."""
    ctx = mp.start_processes(_entry, args=(world, free_port(), backend, fn, args), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish in {timeout} s")
