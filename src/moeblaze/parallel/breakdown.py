"""Where the time of a multi-GPU step goes: compute, communication, the communication nothing hides, and the
device waiting for the host — read off ``torch.profiler``'s kernel timeline.

Per profiled step, on one rank:

- ``compute_ms``: device time during which at least one compute kernel runs (union of their intervals);
- ``comm_ms``: device time during which at least one communication kernel runs (NCCL, NVSHMEM);
- ``exposed_comm_ms``: communication time with no compute kernel beside it (``|comm ∪ compute| - |compute|``):
  what overlap could still win;
- ``idle_ms``: time with no kernel at all, the device waiting for the host (launch gaps, host synchronisation);
- ``sync_ms``: host time spent blocked in CUDA synchronisation functions (``cudaStreamSynchronize`` and kin, as
  ``.item()`` / ``.tolist()`` cause);
- ``step_ms``: the profiled window over the steps.

The union/overlap arithmetic is :func:`interval_breakdown` (plain integers, tested on the CPU); :func:`profile_steps`
runs the steps under the profiler and applies it. On the CPU (no kernels) the device figures are 0.
"""

from __future__ import annotations

import csv
import datetime
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist

__all__ = ["StepBreakdown", "StepProfiler", "append_rows", "gather", "interval_breakdown", "is_comm_kernel",
           "profile_steps", "summary"]

# Kernel names of the collectives: NCCL's device kernels (ncclDevKernel_*, ncclKernel_*), NVSHMEM's and PyTorch's
# symmetric-memory exchanges (allToAllV, exchangeSplitAndOffset, nvshmem*).
_COMM_MARKS = ("nccl", "nvshmem", "alltoall", "exchangesplitandoffset", "all_to_all")
# Host API functions that block until the device catches up.
_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def is_comm_kernel(name: str) -> bool:
    """True for the device kernels of collectives (NCCL, NVSHMEM, symmetric-memory all-to-alls)."""
    low = name.lower()
    return any(mark in low for mark in _COMM_MARKS)


def _union(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[int, int]]) -> int:
    return sum(b - a for a, b in intervals)


def _clip(intervals: Iterable[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def interval_breakdown(kernels: Iterable[tuple[bool, int, int]], window: tuple[int, int]) -> dict[str, int]:
    """Device time split of ``kernels`` (``(is_comm, start, end)``, any integer unit) inside ``window``.

    Returns ``{"window", "compute", "comm", "exposed_comm", "idle"}`` in the same unit: the unions of the
    compute and the communication intervals, the communication not overlapped by any compute, and the window's
    time with no kernel at all.
    """
    lo, hi = window
    ks = list(kernels)
    compute = _union(_clip(((a, b) for c, a, b in ks if not c), lo, hi))
    comm = _union(_clip(((a, b) for c, a, b in ks if c), lo, hi))
    busy = _union(compute + comm)
    return {"window": hi - lo, "compute": _length(compute), "comm": _length(comm),
            "exposed_comm": _length(busy) - _length(compute), "idle": (hi - lo) - _length(busy)}


@dataclass
class StepBreakdown:
    """Milliseconds per step on one rank (module docstring); ``recv_rows``: rows the rank's experts received per
    step under expert parallelism (None without), to read the imbalance between ranks."""

    rank: int
    steps: int
    step_ms: float
    compute_ms: float
    comm_ms: float
    exposed_comm_ms: float
    idle_ms: float
    sync_ms: float
    recv_rows: int | None = None


def _from_profile(prof, steps: int, rank: int, wall_ns: int) -> StepBreakdown:
    events = list(prof.profiler.kineto_results.events()) if prof is not None else []
    kernels = [(is_comm_kernel(e.name()), e.start_ns(), e.end_ns()) for e in events
               if e.device_type() == torch.autograd.DeviceType.CUDA]
    lo = min((k[1] for k in kernels), default=0)
    split = interval_breakdown(kernels, (lo, max(lo + wall_ns, max((k[2] for k in kernels), default=0))))
    sync = sum(e.duration_ns() for e in events if e.name() in _SYNC_CALLS)
    per = 1e-6 / steps
    idle = split["idle"] * per if kernels else 0.0
    return StepBreakdown(rank, steps, wall_ns * per, split["compute"] * per, split["comm"] * per,
                         split["exposed_comm"] * per, idle, sync * per)


class StepProfiler:
    """Profile the steps between :meth:`start` and :meth:`stop` (module docstring): every rank of a job invokes both
    at the same steps; the device is synchronised at both ends, so the window holds the steps' own time.

    Only the device's activity is traced (kernels and the CUDA runtime's API invocations, syncs among them): tracing
    every host op as well slows the host several-fold, which would show a host-bound step where there is none. On
    the CPU nothing is traced and only ``step_ms`` is measured.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._prof, self._t0 = None, None

    def start(self) -> StepProfiler:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self._prof.__enter__()
        self._t0 = time.perf_counter_ns()
        return self

    def stop(self, steps: int, recv_rows: int | None = None) -> StepBreakdown:
        """End the window over ``steps`` steps; ``recv_rows``: rows this rank's experts received per step (EP)."""
        if self._t0 is None:
            raise RuntimeError("StepProfiler.stop without start")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter_ns() - self._t0
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
        prof, self._prof, self._t0 = self._prof, None, None
        row = _from_profile(prof, steps, dist.get_rank() if dist.is_initialized() else 0, wall)
        row.recv_rows = recv_rows
        return row


def profile_steps(step: Callable[[], object], steps: int, device: torch.device) -> StepBreakdown:
    """Run ``step()`` ``steps`` times under :class:`StepProfiler`.

    Raises:
        ValueError: ``steps < 1``.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    prof = StepProfiler(device).start()
    for _ in range(steps):
        step()
    return prof.stop(steps)


def gather(row: StepBreakdown) -> list[StepBreakdown]:
    """Every rank's breakdown, in rank order (one ``all_gather_object``; the row itself without a process group)."""
    if not dist.is_initialized():
        return [row]
    rows: list[StepBreakdown | None] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return [r for r in rows if r is not None]


def append_rows(path: str | os.PathLike, rows: list[StepBreakdown], **context: object) -> None:
    """Append ``rows`` to the CSV at ``path`` (header written once), each with ``context`` columns first (device,
    command, ...) and today's date."""
    names = ["date", *context, *(f.name for f in fields(StepBreakdown))]
    new = not os.path.exists(path)
    with open(path, "a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=names)
        if new:
            writer.writeheader()
        for r in rows:
            writer.writerow({"date": datetime.date.today().isoformat(), **context,
                             **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(r).items()}})


def summary(rows: list[StepBreakdown], traced: bool = True) -> str:
    """One line over ranks: each figure's maximum (the slowest rank sets the step), received rows min-max.
    ``traced`` False (a CPU run: :class:`StepProfiler` traces CUDA activity only): the step time alone, and why."""
    def top(name: str) -> float:
        return max(getattr(r, name) for r in rows)

    recv = [r.recv_rows for r in rows if r.recv_rows is not None]
    spread = ""
    if recv:
        imbalance = max(recv) * len(recv) / max(1, sum(recv))
        spread = f"; rows received per rank {min(recv):,}-{max(recv):,} (max/mean {imbalance:.3f})"
    if not traced:
        return (f"step {top('step_ms'):.2f} ms (max over {len(rows)} ranks); compute, communication, idle and syncs "
                f"are traced on CUDA only{spread}")
    return (f"step {top('step_ms'):.2f} ms: compute {top('compute_ms'):.2f}, communication {top('comm_ms'):.2f} "
            f"(exposed {top('exposed_comm_ms'):.2f}), device idle {top('idle_ms'):.2f}, host blocked in syncs "
            f"{top('sync_ms'):.2f} (max over {len(rows)} ranks){spread}")
