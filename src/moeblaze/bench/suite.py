"""The layer benchmark over configs: every implementation in process, or in a child process killed after a
timeout (:mod:`.worker`), within an overall time budget. Measuring one implementation is :mod:`.runner`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from .baselines import Impl, resolve_impl
from .configs import BenchConfig
from .runner import Row, RunOptions, _free, flush_buffer, layer_inputs, measure_impl, oom_row, require_cuda
from .worker import measure_isolated

__all__ = ["run_layers", "isolate_timeout"]


def run_layers(configs: Iterable[BenchConfig], impl_names: list[str], opts: RunOptions,
               on_row: Callable[[Row], None] | None = None, start: float | None = None) -> list[Row]:
    """Benchmark every implementation in ``impl_names`` on every config; one :class:`Row` each.

    Args:
        configs: the layer shapes. impl_names: keys of :data:`moeblaze.bench.baselines.IMPLS`, or
            ``module:attribute`` of an :class:`Impl` elsewhere (:func:`~moeblaze.bench.baselines.resolve_impl`).
        opts: :class:`RunOptions`. on_row: called with each row as soon as it is measured.
        start: ``time.perf_counter()`` origin of ``opts.budget_s`` (default: now).

    Raises:
        NoCudaError: no CUDA GPU (``opts.device="cuda"``). KeyError: an unknown implementation name.
    """
    if opts.device != "cpu":
        require_cuda()
    impls = [(n, resolve_impl(n)) for n in impl_names]
    start = time.perf_counter() if start is None else start
    flush = flush_buffer(opts)
    rows: list[Row] = []

    def emit(row: Row) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)

    broken: list[str] = []  # set once a sticky CUDA error poisons the context; the rest is skipped
    for cfg in configs:
        _run_config(cfg, impls, opts, flush, emit, start, broken)
    return rows


_STICKY = ("illegal memory access", "device-side assert", "unspecified launch failure", "misaligned address")


def _skip_reason(cfg: BenchConfig, impl: Impl, opts: RunOptions, start: float,
                 broken: list[str]) -> tuple[str, str] | None:
    """``(status, note)`` when ``impl`` is not run on ``cfg``, else ``None`` (a child process does not
    share this process's broken CUDA context)."""
    if broken and not opts.isolates(impl):
        return "skipped", f"CUDA context unusable after {broken[0]}; rerun without it (--impls)"
    if opts.budget_s is not None and time.perf_counter() - start > opts.budget_s:
        return "skipped", f"time budget of {opts.budget_s:.0f} s spent (--budget-s)"
    why = impl.unavailable()
    if why:
        return "unavailable", why
    why = impl.unsupported(cfg, opts.impl)
    return ("unsupported", why) if why else None


def isolate_timeout(opts: RunOptions, start: float) -> tuple[float, str]:
    """The wall-clock limit of an isolated run started now.

    Args:
        opts: ``isolate_timeout_s`` and ``budget_s``. start: ``time.perf_counter()`` origin of the budget.

    Returns:
        ``(seconds, flag)``: ``opts.isolate_timeout_s``, or what is left of ``opts.budget_s`` (>= 0) if less,
        and the command-line option that set it (for the row's note).
    """
    if opts.budget_s is not None:
        left = opts.budget_s - (time.perf_counter() - start)
        if left < opts.isolate_timeout_s:
            return max(left, 0.0), "--budget-s"
    return opts.isolate_timeout_s, "--isolate-timeout-s"


def _run_config(cfg: BenchConfig, impls: list[tuple[str, Impl]], opts: RunOptions, flush: torch.Tensor | None,
                emit: Callable[[Row], None], start: float, broken: list[str]) -> None:
    todo = [(spec, impl, _skip_reason(cfg, impl, opts, start, broken)) for spec, impl in impls]
    inputs = None
    if any(skip is None and not opts.isolates(impl) for _, impl, skip in todo):  # children make their own
        inputs = layer_inputs(cfg, opts)
    for spec, impl, skip in todo:
        skip = skip or _skip_reason(cfg, impl, opts, start, broken)  # the budget may run out meanwhile
        if skip is not None:
            emit(Row.for_config(cfg, impl.name, opts.dtype, status=skip[0], note=skip[1]))
        elif opts.isolates(impl):
            emit(measure_isolated(cfg, spec, opts, *isolate_timeout(opts, start), impl_name=impl.name))
        elif inputs is None:
            emit(oom_row(cfg, impl, opts))
        else:
            row = measure_impl(cfg, impl, *inputs, opts, flush)
            if row.status == "error" and any(s in row.note.lower() for s in _STICKY):
                broken.append(f"{impl.name} on {cfg.name} ({row.note[:80]})")
            emit(row)
    del inputs
    _free()
