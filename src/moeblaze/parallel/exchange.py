"""The token exchange of expert parallelism: rows out to the ranks that hold their experts, and back.

An :class:`Exchange` moves a buffer of rows between the P ranks of an expert-parallel group and hides how (after
DeepEP's ``Buffer``): the caller packs rows into :meth:`Exchange.buffer`, invokes :meth:`Exchange.rows` and reads the
result. Three kinds (:data:`EXCHANGES`):

``nvshmem``     PyTorch's symmetric memory (``torch.ops.symm_mem.all_to_all_vdev`` on the NVSHMEM backend): the split
                sizes never leave the device. Buffers are symmetric (the same size on every rank), allocated once at
                an upper bound and reused in two alternating slots (an exchange may still be reading a peer's
                previous buffer when that peer packs the next one; one exchange of the other slot lies between).
``padded``      ``all_to_all_single`` with equal splits of a fixed capacity per destination: sync-free over any
                backend (NCCL, gloo), at the cost of sending every block at its capacity.
``all_to_all``  ``all_to_all_single`` with the exact split sizes, read to the host: one host synchronisation per
                layer forward (the fallback).

``auto`` takes ``padded`` on CUDA where the group also has a CPU backend (see below), else ``all_to_all``. Over
NVLink ``padded`` was the faster sync-free kind: the Qwen3-30B-A3B-shaped EP layer at P 2 in 13.93 ms against
``nvshmem``'s 17.72 (``torchrun --nproc-per-node 2 benchmarks/bench_ep.py --exchanges padded,nvshmem``), ``moeblaze
train --preset 1b --ep 4`` at 90,364-105,399 tokens/s per GPU against 74,423 (docs/results-train-multigpu.csv, 4 x
H200). ``nvshmem`` (P a power of two: its kernel splits each peer's bytes evenly over its CTAs) sends only the real
rows, which counts where links are slower than NVLink (docs/SCALING.md).

Layouts. A forward (``dispatch``) sends ``send_counts[r]`` rows to rank r; rank r's rows start at
``send_offsets[r]`` of the send buffer. ``nvshmem`` and ``all_to_all`` pack them (offsets: exclusive prefix sum of
the counts), ``padded`` gives every destination a block of ``T_cap`` rows (offsets ``r * T_cap``). The receive buffer
mirrors it by source rank (:meth:`Layout.recv_valid` marks its real rows). The reverse exchange (``combine``, and
the backward of a dispatch) sends the receive layout back and yields the send layout.

Capacities without the host. A sync-free exchange sizes its buffers by ``T_cap``, the largest T over the group:
a token goes at most once to each rank, so a rank sends at most ``T * min(K, P)`` rows and receives at most
``P * T_cap``. ``T_cap`` is either known to every rank beforehand (``max_tokens`` of
:func:`moeblaze.parallel.expert_parallel`: no communication at all) or agreed on in each layer forward by an
all-reduce of one host integer over the group's CPU backend (gloo; :func:`moeblaze.parallel.init_distributed`
creates ``cpu:gloo,cuda:nccl`` groups), so no device value is read. The agreement holds every rank's host at the
slowest rank's, once per layer: a 1B-parameter model trained with ``--ep 2`` on 2 H200s spent 2.4-8 ms of host time
per layer forward waiting in it (``torch.profiler`` host trace of ``moeblaze train --fsdp --preset 1b --ep 2
--profile-steps 3``), which is why the training loop gives ``max_tokens``.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["EXCHANGES", "Exchange", "Layout", "get_exchange", "resolve_exchange"]

EXCHANGES = ("auto", "nvshmem", "padded", "all_to_all")


def _has_cpu_backend(group: dist.ProcessGroup) -> bool:
    """The group runs collectives on CPU tensors (gloo alone, or ``cpu:gloo,cuda:nccl``)."""
    return "gloo" in str(dist.get_backend(group))


@functools.cache
def _nvshmem_available() -> bool:
    try:
        import torch.distributed._symmetric_memory as symm_mem

        return bool(symm_mem.is_nvshmem_available())
    except (ImportError, AttributeError, RuntimeError):
        return False


def _use_nvshmem(device: torch.device) -> str | None:
    """Make NVSHMEM PyTorch's symmetric-memory backend on ``device``; None when it is, else why it cannot be (the
    backend is chosen once per process, before the first symmetric tensor; PyTorch's default is ``CUDA``)."""
    import torch.distributed._symmetric_memory as symm_mem

    backend = symm_mem.get_backend(device)
    if backend == "NVSHMEM":
        return None
    try:
        symm_mem.set_backend("NVSHMEM")
    except RuntimeError as err:
        return f"this process allocated symmetric memory with the {backend} backend already ({err})"
    return None


def resolve_exchange(kind: str, group: dist.ProcessGroup, device: torch.device) -> str:
    """The exchange a ``kind`` of :data:`EXCHANGES` means for ``group`` on ``device`` (``auto`` resolved).

    Raises:
        ValueError: an unknown kind; ``nvshmem`` where it cannot run (names why); a sync-free kind on a group
            without a CPU backend (the capacity agreement needs one).
    """
    if kind not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {kind!r}")
    P = dist.get_world_size(group)
    cpu_ok = _has_cpu_backend(group)
    if kind == "auto":  # the measured winner where it runs (module docstring)
        return "padded" if device.type == "cuda" and cpu_ok else "all_to_all"
    if kind in ("nvshmem", "padded") and not cpu_ok:
        raise ValueError(f"exchange={kind!r} agrees on buffer sizes over the group's CPU backend, but the group runs "
                         f"{dist.get_backend(group)!r} only: initialise with backend 'cpu:gloo,cuda:nccl' "
                         "(moeblaze.parallel.init_distributed does) or use exchange='all_to_all'")
    if kind == "nvshmem":
        why = ("it needs CUDA tensors" if device.type != "cuda" else
               f"P={P} is not a power of two" if P & (P - 1) else
               "NVSHMEM is not available in this PyTorch build" if not _nvshmem_available() else
               _use_nvshmem(device))
        if why:
            raise ValueError(f"exchange='nvshmem' cannot run here: {why}; use 'padded' or 'all_to_all'")
    return kind


@dataclass
class Layout:
    """The shapes of one layer step's exchanges (fixed in the forward, reused by the backward).

    ``T_cap``: the largest T over the group, or a bound of it every rank knows (sync-free kinds), or this rank's T.
    ``send_rows`` / ``recv_rows``: the rows of the send and receive buffers. ``send_counts [P]`` (device): rows to
    each rank; ``send_offsets [P]``: where they start. ``recv_counts`` / ``recv_offsets [P]``: the same by source
    rank (padded: from the all-gathered counts; nvshmem: set by the dispatch). ``splits``: ``(send, recv)`` host
    lists of the ``all_to_all`` kind, else None.
    """

    T_cap: int
    send_rows: int
    recv_rows: int
    send_counts: torch.Tensor
    send_offsets: torch.Tensor
    recv_counts: torch.Tensor | None = None
    recv_offsets: torch.Tensor | None = None
    splits: tuple[list[int], list[int]] | None = None

    def recv_valid(self) -> torch.Tensor | None:
        """``[recv_rows]`` bool: the receive buffer's rows that hold a sent row (None: all of them)."""
        if self.splits is not None:
            return None
        q = torch.arange(self.recv_rows, device=self.recv_counts.device)
        src = torch.searchsorted(self.recv_offsets, q, right=True) - 1  # the source block of each row
        return (q - self.recv_offsets[src]) < self.recv_counts[src]


def _exclusive(counts: torch.Tensor) -> torch.Tensor:
    return counts.cumsum(0) - counts


class Exchange:
    """Rows between the ranks of ``group`` (module docstring). One object per (group, kind, device): layers on the
    same group share it (and its buffers), since their exchanges run one after the other.

    Attributes:
        kind: ``nvshmem``, ``padded`` or ``all_to_all``. group, size (P), rank. sync_free: no host synchronisation.
        symmetric: rows must be packed into :meth:`buffer` (symmetric memory); else any contiguous ``[rows, width]``
        uint8 tensor can be sent as is.
    """

    def __init__(self, group: dist.ProcessGroup, kind: str, device: torch.device) -> None:
        self.group, self.kind, self.device = group, kind, device
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.sync_free = kind != "all_to_all"
        self.symmetric = kind == "nvshmem"
        self._symm = _SymmWorkspace(group, device) if kind == "nvshmem" else None

    def layout(self, T: int, K: int, send_counts: torch.Tensor, all_counts: torch.Tensor,
               tokens_cap: int | None = None) -> Layout:
        """The step's :class:`Layout` for T local tokens of K pairs, ``send_counts [P]`` (device int64).

        ``all_counts [P, n]`` (the all-gathered count vectors, whose last P columns are every rank's send counts):
        the ``all_to_all`` kind reads its split sizes from it (its one host synchronisation), the ``padded`` kind
        its receive counts. ``tokens_cap``: ``T_cap`` as every rank of the group knows it (``T <= tokens_cap`` on
        each); None: agreed on here (:meth:`tokens_cap`).
        """
        P = self.size
        counts = send_counts.to(torch.int64)
        recv = all_counts[:, -P + self.rank].to(torch.int64)  # [P] rows each rank sends here
        if not self.sync_free:
            sizes = torch.cat((counts, recv)).tolist()  # the host synchronisation of this kind
            send, got = sizes[:P], sizes[P:]
            off = torch.tensor([0, *torch.tensor(send).cumsum(0).tolist()[:-1]], device=counts.device)
            roff = torch.tensor([0, *torch.tensor(got).cumsum(0).tolist()[:-1]], device=counts.device)
            return Layout(T, sum(send), sum(got), counts, off, torch.tensor(got, device=counts.device), roff,
                          (send, got))
        t_cap = self.tokens_cap(T) if tokens_cap is None else tokens_cap
        if self.kind == "padded":
            off = torch.arange(P, device=counts.device, dtype=torch.int64) * t_cap
            return Layout(t_cap, P * t_cap, P * t_cap, counts, off, recv, off)
        return Layout(t_cap, t_cap * min(K, P), P * t_cap, counts, _exclusive(counts))

    def tokens_cap(self, T: int) -> int:
        """The largest T over the group: an all-reduce of one host integer on the group's CPU backend."""
        t = torch.tensor([T], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t)

    def buffer(self, rows: int, width: int, reverse: bool) -> torch.Tensor:
        """A ``[rows, width]`` uint8 buffer to pack the rows of the next :meth:`rows` into (the send side of a
        dispatch, or the receive layout for ``reverse``)."""
        if self._symm is not None:
            return self._symm.next_input(rows, width)
        return torch.empty(rows, width, dtype=torch.uint8, device=self.device)

    def rows(self, buf: torch.Tensor, layout: Layout, reverse: bool = False) -> torch.Tensor:
        """Exchange ``buf`` (from :meth:`buffer`, or any contiguous uint8 rows unless :attr:`symmetric`): a
        dispatch (send layout -> receive layout; sets ``layout.recv_counts`` / ``recv_offsets`` for ``nvshmem``),
        or with ``reverse`` the way back. Returns the received
        ``[recv_rows or send_rows, width]`` uint8 rows (a buffer of the exchange's own for ``nvshmem``: copy out
        what must outlive the next exchange)."""
        out_rows = layout.send_rows if reverse else layout.recv_rows
        if self.kind == "all_to_all":
            send, recv = layout.splits
            out = buf.new_empty(out_rows, buf.shape[1])
            dist.all_to_all_single(out, buf, send if reverse else recv, recv if reverse else send, group=self.group)
            return out
        if self.kind == "padded":
            out = torch.empty_like(buf)
            dist.all_to_all_single(out, buf, group=self.group)
            return out
        counts = layout.recv_counts if reverse else layout.send_counts
        out, got = self._symm.exchange(counts)
        if not reverse:
            layout.recv_counts, layout.recv_offsets = got[0].clone(), got[1].clone()
        return out[:out_rows]


class _SymmWorkspace:
    """Two slots of symmetric buffers for ``all_to_all_vdev``: input and output ``[rows, width]`` uint8, the input
    split sizes ``[P]`` and the output sizes and offsets ``[2, P]`` (int64). Grown (collectively: every rank asks
    for the same sizes, which the group agreed on) when a step needs more; never shrunk."""

    # NVSHMEM's all_to_all_vdev splits each peer's bytes evenly over its CTAs (up to 64 per exchange once the buffer
    # passes 64 chunks of 64 KiB); rows of a multiple of 64 bytes in buffers of at least 8 MiB divide evenly for
    # P a power of two.
    ROW_ALIGN, MIN_BYTES = 64, 8 * 2**20

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.symm_mem, self.group, self.device = symm_mem, group, device
        self.name = group.group_name  # resolve_exchange made NVSHMEM the backend
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(self.name)
        self.slots: list[tuple[torch.Tensor, ...]] = []
        self.rows_cap = self.width = 0
        self.turn = 0

    def _grow(self, rows: int, width: int) -> None:
        width = -(-width // self.ROW_ALIGN) * self.ROW_ALIGN
        rows = max(rows, -(-self.MIN_BYTES // width))
        P = dist.get_world_size(self.group)
        self.slots = []
        for _ in range(2):
            tensors = (self.symm_mem.empty(rows, width, dtype=torch.uint8, device=self.device),
                       self.symm_mem.empty(rows, width, dtype=torch.uint8, device=self.device),
                       self.symm_mem.empty(P, dtype=torch.int64, device=self.device),
                       self.symm_mem.empty(2, P, dtype=torch.int64, device=self.device))
            for t in tensors:
                self.symm_mem.rendezvous(t, self.name)
            self.slots.append(tensors)
        self.rows_cap, self.width = rows, width

    def next_input(self, rows: int, width: int) -> torch.Tensor:
        if rows > self.rows_cap or width > self.width:
            self._grow(max(rows, self.rows_cap), max(width, self.width))
        self.turn ^= 1
        return self.slots[self.turn][0][:rows, :width]

    def exchange(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All-to-all of the current slot's input (``counts[r]`` rows to rank r, packed from row 0); returns its
        output buffer and the ``[2, P]`` received sizes and offsets."""
        inp, out, splits, got = self.slots[self.turn]
        splits.copy_(counts)
        torch.ops.symm_mem.all_to_all_vdev(inp, out, splits, got, self.name)
        return out, got


# Held weakly: the layers that use an exchange keep it (and its group and buffers) alive, this table only finds it.
# A strong table kept every group it had seen, and its gloo threads, to the interpreter's exit, where a thread that
# still held a collective's tensors aborted the process; keyed by group name, it handed a group made after a
# destroy_process_group the exchange of the destroyed one. The key's id cannot be reused while the exchange lives:
# the exchange holds its group.
_EXCHANGES: weakref.WeakValueDictionary[tuple, Exchange] = weakref.WeakValueDictionary()


def get_exchange(group: dist.ProcessGroup, kind: str, device: torch.device) -> Exchange:
    """The shared :class:`Exchange` of ``group`` for a resolved ``kind`` on ``device``: the one the group's live
    layers use, else a new one."""
    key = (id(group), kind, str(device))
    exchange = _EXCHANGES.get(key)
    if exchange is None:
        exchange = _EXCHANGES[key] = Exchange(group, kind, device)
    return exchange
