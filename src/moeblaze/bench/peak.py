"""What is allocated at the peak of a step: the CUDA caching allocator's event trace, replayed.

``torch.cuda.max_memory_allocated`` says how high a step's memory went, not what held it.
``torch.cuda.memory._record_memory_history`` records every block the caching allocator hands out or
takes back, with the Python stack that asked for it. :func:`live_at_peak` replays such a trace from the
bytes allocated before it, finds the moment the most bytes were allocated, and groups the blocks live
then by the line of code that allocated them (the innermost frame outside torch itself).
:func:`peak_breakdown` runs one step on a CUDA device under the recorder and replays its trace.

Used by ``benchmarks/profile_layer.py --peak`` (what makes up a step's peak memory).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .runner import MIB

__all__ = ["PeakBreakdown", "live_at_peak", "peak_breakdown"]


@dataclass
class PeakBreakdown:
    """The peak of a replayed allocator trace.

    Attributes:
        peak_bytes: most bytes allocated at any point (the trace's ``max_memory_allocated``).
        base_bytes: bytes allocated before the trace began (weights, inputs, ...).
        live: ``(where, bytes, blocks)`` of the blocks allocated during the trace and live at the peak,
            grouped by the allocating line (``file.py:line function``), largest first.
    """

    peak_bytes: int
    base_bytes: int
    live: list[tuple[str, int, int]]

    def table(self, min_bytes: int = MIB) -> str:
        """Text lines: base, each group of at least ``min_bytes``, the rest, the peak (MiB)."""
        lines = [f"  {self.base_bytes / MIB:10.1f} MiB  allocated before the step"]
        shown = [g for g in self.live if g[1] >= min_bytes]
        lines += [f"  {b / MIB:10.1f} MiB  x{n:<4} {where}" for where, b, n in shown]
        rest = sum(b for _, b, _ in self.live) - sum(b for _, b, _ in shown)
        if rest:
            lines.append(f"  {rest / MIB:10.1f} MiB  smaller blocks")
        lines.append(f"  {self.peak_bytes / MIB:10.1f} MiB  peak")
        return "\n".join(lines)


def _where(frames: Iterable[dict[str, Any]]) -> str:
    """The innermost frame outside torch's own Python files (frames are innermost first)."""
    frames = list(frames)
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" not in name and not name.startswith("<") and name != "??":
            return f"{name.rsplit('/', 1)[-1]}:{f.get('line', 0)} {f.get('name', '?')}"
    return "(no Python frame)" if not frames else f"{frames[0].get('filename', '?')}:{frames[0].get('line', 0)}"


def live_at_peak(events: Iterable[dict[str, Any]], base_bytes: int = 0) -> PeakBreakdown:
    """Replay allocator events (``torch.cuda.memory._snapshot()["device_traces"][device]``).

    Args:
        events: dicts with ``action`` (``"alloc"``, ``"free_completed"``; others are ignored), ``addr``,
            ``size`` (bytes) and optionally ``frames`` (``filename``, ``line``, ``name``; innermost first).
        base_bytes: bytes allocated when the trace began (``torch.cuda.memory_allocated()``).

    Returns:
        :class:`PeakBreakdown`. A free of a block allocated before the trace lowers the running total.

    Raises:
        ValueError: ``base_bytes`` is negative, or an event lacks ``action``, ``addr`` or ``size``.
    """
    if base_bytes < 0:
        raise ValueError(f"base_bytes must be >= 0, got {base_bytes}")
    events = list(events)
    # pass 1: the running total and the event that reaches its maximum (-1: nothing rose above the base)
    sizes: dict[int, int] = {}
    cur = best = base_bytes
    peak_at = -1
    for i, ev in enumerate(events):
        try:
            action, addr, size = ev["action"], ev["addr"], ev["size"]
        except KeyError as exc:
            raise ValueError(f"allocator event without {exc.args[0]!r}: {ev}") from None
        if action == "alloc":
            sizes[addr] = size
            cur += size
            if cur > best:
                best, peak_at = cur, i
        elif action == "free_completed":
            cur -= sizes.pop(addr, size)
    # pass 2: the blocks live at that event (rebuilt once, rather than copying the live set at every new maximum)
    live: dict[int, tuple[int, str]] = {}
    for ev in events[:peak_at + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], _where(ev.get("frames", ())))
        elif ev["action"] == "free_completed":
            live.pop(ev["addr"], None)
    groups: dict[str, list[int]] = {}
    for size, where in live.values():
        g = groups.setdefault(where, [0, 0])
        g[0] += size
        g[1] += 1
    ranked = sorted(((w, b, n) for w, (b, n) in groups.items()), key=lambda g: -g[1])
    return PeakBreakdown(best, base_bytes, ranked)


def peak_breakdown(step: Callable[[], Any], device: torch.device | str | None = None,
                   max_entries: int = 1_000_000) -> PeakBreakdown:
    """Run ``step()`` once on a CUDA device with the allocator's history recorded; what held its peak.

    Args:
        step: e.g. one forward+backward; warm it up first (autotuning allocates too).
        device: the CUDA device (default: the current one). max_entries: events kept by the recorder.

    Returns:
        :class:`PeakBreakdown` of the step (its ``peak_bytes`` equals ``max_memory_allocated`` of the step).

    Raises:
        ValueError: ``device`` is not a CUDA device, or CUDA is not available.
    """
    if not torch.cuda.is_available():
        raise ValueError("peak_breakdown needs CUDA (the allocator trace is CUDA's); none is available")
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=max_entries)
        try:
            step()
            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
    return live_at_peak(snapshot["device_traces"][index], base)
