"""Timing and memory of one MoE layer's forward+backward, per (config, implementation) (DESIGN.md §7).

For each config the weights ``router, w1, w2``, the input ``x [T, d]`` and the output gradient are made
once and shared by every implementation. Per implementation:

1. one step timed on the wall clock (includes Triton autotuning / CuTe compilation: ``warmup_s``);
2. one step timed with CUDA events: the estimate that sets the repetitions (``target_s`` of timed
   steps, between ``min_reps`` and ``max_reps``, and never past the per-implementation cap ``cap_s``);
3. bytes saved for backward (saved-tensor hooks, unique storages, ``x`` and the weights not counted);
4. peak memory of one step (``torch.cuda.max_memory_allocated``), absolute and above what was allocated
   before the step (weights, input, output gradient);
5. the timed steps, each after an L2 flush: the median, in ms.

A step is ``out = fn(x); out.backward(dout)`` with all gradients reset to ``None`` first. Out-of-memory is
caught and reported as ``OOM``; other failures as ``error``; a global ``budget_s`` skips what is left.

Implementations with :attr:`Impl.isolate` (or all, or none: ``RunOptions.isolate``) are measured the same
way in a child process (:mod:`moeblaze.bench.worker`), killed after ``isolate_timeout_s`` or the budget left;
:mod:`moeblaze.bench.suite` runs configs x implementations either way.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

import torch

from ..fp8 import reuse_weights
from ..memory import SavedTensorCounter
from .baselines import Impl, ImplOptions, LayerWeights, make_weights, step_params
from .configs import BenchConfig

__all__ = ["Row", "RunOptions", "DTYPES", "ISOLATE_MODES", "measure_impl",
           "layer_inputs", "flush_buffer", "oom_row", "cuda_time_ms", "kernel_time_ms", "require_cuda", "NoCudaError"]

MIB = 1 << 20
ISOLATE_MODES = ("auto", "all", "none")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class NoCudaError(RuntimeError):
    """Raised when a benchmark that needs a CUDA GPU runs without one."""


def require_cuda(what: str = "moeblaze bench") -> None:
    """Raise :class:`NoCudaError` with a clear message unless a CUDA GPU is visible."""
    if not torch.cuda.is_available():
        raise NoCudaError(f"{what} needs a CUDA GPU for timing and peak memory, and torch.cuda.is_available() "
                          f"is False here (torch {torch.__version__}). Run it on a GPU machine; "
                          "`moeblaze bench --list`, `--plot FILE.csv` and `--report FILE.csv` (e.g. docs/results.csv "
                          "of a source checkout) work anywhere.")


@dataclass
class Row:
    """One result row (one config x one implementation). Times in ms, memory in MiB (2^20 bytes).

    ``status`` is ``ok``, ``OOM``, ``skipped``, ``unsupported``, ``unavailable`` or ``error``; ``note`` says why.
    ``step_mib`` is the peak above the memory allocated before the step (weights, x, dout).
    """

    group: str
    config: str
    impl: str
    T: int
    d: int
    h: int
    E: int
    K: int
    activation: str
    dtype: str
    status: str = "ok"
    time_ms: float | None = None
    tflops: float | None = None
    saved_mib: float | None = None
    peak_mib: float | None = None
    step_mib: float | None = None
    reps: int = 0
    warmup_s: float | None = None
    note: str = ""

    @classmethod
    def for_config(cls, cfg: BenchConfig, impl: str, dtype: str, **kw) -> Row:
        return cls(cfg.group, cfg.name, impl, cfg.T, cfg.d, cfg.h, cfg.E, cfg.K, cfg.activation, dtype, **kw)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class RunOptions:
    """Knobs of :func:`run_layers`.

    Attributes:
        dtype: ``bf16``, ``fp16`` or ``fp32``.
        min_reps, max_reps: bounds on timed steps; target_s: seconds of timed steps per implementation.
        cap_s: per-implementation cap (seconds): a first step slower than this is skipped, and the
            repetitions are cut to fit. budget_s: the whole run; what is left after it is skipped.
        flush_l2: zero a 256 MiB buffer before every timed step.
        seed: for weights and inputs. impl: :class:`ImplOptions`.
        device: ``cuda``; ``cpu`` exists for tests of the runner (wall-clock times, no peak memory).
        isolate: which implementations run in a child process: ``auto`` (those with ``Impl.isolate``),
            ``all`` or ``none``. isolate_timeout_s: wall-clock limit of such a child (also bounded by
            what is left of ``budget_s``); one that runs past it is killed and reported ``skipped``.
        child_log_dir: where each child's output (stdout and stderr, compile logs included) is kept as
            ``<config>-<impl>.log``, whatever its outcome; None keeps none.
        grad_accum: forward+backward passes per timed step, gradients accumulated, inside
            :func:`moeblaze.fp8.reuse_weights` (FP8 layers quantize their weights once a step, as under gradient
            accumulation); times and TFLOP/s are per pass.

    Raises:
        ValueError: an unknown ``isolate`` mode, ``grad_accum`` below 1.
    """

    dtype: str = "bf16"
    min_reps: int = 5
    max_reps: int = 50
    target_s: float = 0.5
    cap_s: float = 60.0
    budget_s: float | None = None
    flush_l2: bool = True
    seed: int = 0
    impl: ImplOptions = field(default_factory=ImplOptions)
    device: str = "cuda"
    isolate: str = "auto"
    isolate_timeout_s: float = 600.0
    child_log_dir: str | None = None
    grad_accum: int = 1

    def __post_init__(self) -> None:
        if self.isolate not in ISOLATE_MODES:
            raise ValueError(f"isolate must be one of {ISOLATE_MODES}, got {self.isolate!r}")
        if not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ValueError(f"grad_accum must be an integer >= 1, got {self.grad_accum!r}")

    def as_dict(self) -> dict:
        """JSON-ready fields (``impl`` as a nested dict); :meth:`from_dict` reads them back."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RunOptions:
        """The options :meth:`as_dict` wrote."""
        return cls(**{**d, "impl": ImplOptions(**d.get("impl", {}))})

    def isolates(self, impl: Impl) -> bool:
        """Whether ``impl`` is measured in a child process."""
        return self.isolate == "all" or (self.isolate == "auto" and impl.isolate)


def cuda_time_ms(step: Callable[[], None], reps: int, flush: torch.Tensor | None = None) -> list[float]:
    """Run ``step`` ``reps`` times, each bracketed by CUDA events (after an optional L2 flush); ms per step.

    Without CUDA (tests of the runner only) the wall clock is used.
    """
    if not torch.cuda.is_available():
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        if flush is not None:
            flush.zero_()
        s.record()
        step()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def kernel_time_ms(step: Callable[[], None], reps: int = 10, table: int = 0) -> float | None:
    """GPU time of one ``step``: the device time of every kernel (and copy) it runs, summed by torch.profiler
    over ``reps`` steps, per step in ms. Host time between launches does not count (a layer step's host path
    at a few thousand tokens is as long as its kernels, issue 24, so wall time would compare host paths).
    ``table > 0`` prints the ``table`` kernels with the most GPU time. None without CUDA."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    if table:
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=table), flush=True)
    return sum(e.self_device_time_total for e in prof.key_averages()) / reps / 1e3


def graph_replay_ms(fn: Callable[[], object]) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph (``triton.testing.do_bench``: L2 flushed before each replay),
    so host time stays out of the figure; ``fn`` runs once first, outside the capture (compiling, autotuning)."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=100)


def _make_step(fn: Callable, x: torch.Tensor, dout: torch.Tensor, params: list[torch.Tensor],
               passes: int = 1) -> tuple[Callable[[], None], Callable[[], None]]:
    """``(step, zero)``: one forward+backward with fresh gradients (``passes`` of them accumulated, inside
    :func:`moeblaze.fp8.reuse_weights`), and the gradient reset alone."""
    def zero() -> None:
        for p in (*params, x):
            p.grad = None

    def step() -> None:
        zero()
        if passes == 1:
            fn(x).backward(dout)
            return
        with reuse_weights():
            for _ in range(passes):
                fn(x).backward(dout)

    return step, zero


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        with contextlib.suppress(RuntimeError):  # a sticky CUDA error surfaces here too; rows report it
            torch.cuda.empty_cache()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure_impl(cfg: BenchConfig, impl: Impl, w: LayerWeights, x: torch.Tensor, dout: torch.Tensor,
                 opts: RunOptions, flush: torch.Tensor | None = None) -> Row:
    """Measure one implementation on one config (steps 1-5 of the module docstring); never raises for
    OOM or a failing implementation (the row says what happened)."""
    row = Row.for_config(cfg, impl.name, opts.dtype)
    try:
        _measure(row, cfg, impl, w, x, dout, opts, flush)
    except torch.OutOfMemoryError as exc:
        row.status, row.note = "OOM", str(exc).split("\n")[0][:120]
    except Exception as exc:  # a peer failing on a shape must not stop the run
        first = str(exc).splitlines()[0][:160] if str(exc) else ""
        oom = "out of memory" in str(exc).lower()  # Triton / CuTe raise their own OOM errors
        row.status, row.note = ("OOM" if oom else "error"), f"{type(exc).__name__}: {first}"
    for p in (*w.params(), x):
        p.grad = None
    _free()
    return row


def _measure(row: Row, cfg: BenchConfig, impl: Impl, w: LayerWeights, x: torch.Tensor, dout: torch.Tensor,
             opts: RunOptions, flush: torch.Tensor | None) -> None:
    t0 = time.perf_counter()
    fn = impl.build(cfg, w, opts.impl)
    params = step_params(fn, w)
    step, zero = _make_step(fn, x, dout, params, opts.grad_accum)
    step()
    _sync()
    row.warmup_s = round(time.perf_counter() - t0, 3)
    if row.warmup_s > opts.cap_s:
        row.status, row.note = "skipped", f"first step took {row.warmup_s:.0f} s > cap {opts.cap_s:.0f} s"
        return
    est_ms = cuda_time_ms(step, 1, flush)[0]  # the whole step: the repetitions below are steps
    with SavedTensorCounter(exclude=[*params, x]) as counter:
        out = fn(x)
    del out
    row.saved_mib = counter.bytes / MIB
    zero()
    if x.is_cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        flushed = flush.numel() * flush.element_size() if flush is not None else 0  # not the layer's
        row.peak_mib, row.step_mib = (peak - flushed) / MIB, (peak - base) / MIB
    left_s = opts.cap_s - (time.perf_counter() - t0)
    reps = int(min(opts.max_reps, max(opts.min_reps, opts.target_s * 1e3 / max(est_ms, 1e-3))))
    reps = max(1, min(reps, int(left_s * 1e3 / max(est_ms, 1e-3))))
    if reps < opts.min_reps:
        row.note = f"{reps} timed steps (cap {opts.cap_s:.0f} s)"
    times = cuda_time_ms(step, reps, flush)
    row.reps = reps
    row.time_ms = statistics.median(times) / opts.grad_accum
    if opts.grad_accum > 1:
        row.note = "; ".join(filter(None, (row.note, f"{opts.grad_accum} passes a step (weights quantized once), "
                                           "time per pass")))
    row.tflops = cfg.flops / (row.time_ms * 1e-3) / 1e12


def _inputs(cfg: BenchConfig, dtype: torch.dtype, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    x = torch.randn(cfg.T, cfg.d, device=device, dtype=dtype, generator=gen).requires_grad_()
    dout = torch.randn(cfg.T, cfg.d, device=device, dtype=dtype, generator=gen)
    return x, dout


def flush_buffer(opts: RunOptions) -> torch.Tensor | None:
    """The 256 MiB buffer zeroed before each timed step to flush L2 (``None`` with ``flush_l2=False``)."""
    return torch.empty(256 * MIB, dtype=torch.int8, device=opts.device) if opts.flush_l2 else None


def layer_inputs(cfg: BenchConfig, opts: RunOptions) -> tuple[LayerWeights, torch.Tensor, torch.Tensor] | None:
    """The seeded weights, input ``x`` and output gradient of ``cfg`` (``None`` when they do not fit)."""
    dtype = DTYPES[opts.dtype]
    try:
        return make_weights(cfg, opts.device, dtype, opts.seed), *_inputs(cfg, dtype, opts.seed, opts.device)
    except torch.OutOfMemoryError:
        return None


def oom_row(cfg: BenchConfig, impl: Impl, opts: RunOptions) -> Row:
    """The row of an implementation that could not run because :func:`layer_inputs` did not fit."""
    return Row.for_config(cfg, impl.name, opts.dtype, status="OOM", note="weights and inputs do not fit")
