"""Every moeblaze switch in one place: settable from code, scoped by a context manager, the environment as default.

Precedence, highest first: :func:`override` (a ``with`` block, this thread/task only) > :func:`configure`
(process-wide) > the environment variable > the built-in default. The environment is read at each look-up,
so a variable set after import still counts (a :func:`get` takes 0.18 µs on a 2-core CPU, about 0.5 µs on an
H200's host CPU: ``python3 benchmarks/bench_host.py --parts``).

| setting | environment | values (default first) | what it does |
|---|---|---|---|
| ``backend`` | ``MOEBLAZE_BACKEND`` | ``auto``, ``torch``, ``triton`` | Triton kernels or PyTorch ops (see below) |
| ``autotune`` | ``MOEBLAZE_AUTOTUNE`` | on, off | Triton autotuning (off: one fixed config per kernel) |
| ``deterministic`` | ``MOEBLAZE_DETERMINISTIC`` | off, on | nothing chosen by timing (autotuning off) |
| ``check_ids`` | ``MOEBLAZE_CHECK_IDS`` | on, off | ``build_dispatch``'s host-syncing id range check |
| ``chunk_cols`` | ``MOEBLAZE_CHUNK_COLS`` | ``auto``, ``off``, columns | F2's / B3's ``[N, d]`` in column chunks |

``backend`` picks what ``backend="auto"`` expert invocations run and, by the same rule, whether the router, token
rounding's selections and the dispatch build run their Triton kernels (:func:`use_triton`): ``torch`` runs
PyTorch ops everywhere, to compare with or debug the kernels. Kernel variants are no settings: the device and
the shapes choose them (:mod:`moeblaze.kernels.tuning`: TMA reads on sm90+, the warp-specialized Gluon kernels
on sm90 with triton 3.6, per-tile or persistent launches by the autotuner, the M tile by its ``block_m``).

``deterministic`` covers moeblaze's own kernels (their sums run in a fixed order once the configuration is fixed);
the rest of a training process (torch's deterministic algorithms, cuBLAS's workspace, NCCL's algorithm, the
attention backend) is :func:`moeblaze.training.determinism.deterministic_mode`, which also switches this setting on.

``TRITON_INTERPRET`` is Triton's own variable (read by Triton when it compiles); :func:`interpreting` reports it.
torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``: :func:`launcher_env`; variables of cuBLAS and NCCL that
``--deterministic`` sets: :func:`library_env_defaults`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["SETTINGS", "carried_to_backward", "check_environment", "configure", "configured", "get", "interpreting",
           "launcher_env", "library_env_defaults", "override", "reset", "use_triton"]


def _bool(name: str, raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "on", "yes"):
        return True
    if low in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{name} must be a boolean (1/0, true/false, on/off, yes/no), got {raw!r}")


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        low = raw.strip().lower()  # as the boolean and column-count settings read theirs
        if low not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {raw!r}")
        return low
    return parse


def _chunk(name: str, raw: str) -> int | str:
    """``auto``, ``off`` or a positive column count that is a multiple of 16 (16-byte aligned chunk starts)."""
    raw = raw.strip().lower()
    if raw in ("auto", "off"):
        return raw
    try:
        cols = int(raw)
    except ValueError:
        cols = 0
    if cols <= 0 or cols % 16:
        raise ValueError(f"{name} must be auto, off or a positive multiple of 16 (columns), got {raw!r}")
    return cols


# name -> (environment variable, parser of a string, default value)
SETTINGS: dict[str, tuple[str, Callable[[str, str], Any], Any]] = {
    "backend": ("MOEBLAZE_BACKEND", _choice("auto", "torch", "triton"), "auto"),
    "autotune": ("MOEBLAZE_AUTOTUNE", _bool, True),
    "check_ids": ("MOEBLAZE_CHECK_IDS", _bool, True),
    "chunk_cols": ("MOEBLAZE_CHUNK_COLS", _chunk, "auto"),
    "deterministic": ("MOEBLAZE_DETERMINISTIC", _bool, False),
}

# os.environ's own store (_getenv): CPython's os._Environ keeps the process environment in ``_data`` (bytes keys on
# POSIX) and updates it on every os.environ write (monkeypatch.setenv included). A look-up through os.environ
# encodes the key and decodes the value: 1.26 µs on an H200's host CPU against 0.04 µs for
# the store's own dict read on a 2-core CPU, and a layer step makes ~70 look-ups (``python3
# benchmarks/bench_host.py --profile 60``); elsewhere (Windows) os.environ is read.
_POSIX = os.name == "posix"


def _getenv(name: str) -> str | None:
    """``os.environ.get(name)``, read from os.environ's store on POSIX (looked up at each call: an ``os.environ``
    replaced by a plain mapping, as some test harnesses do, is read through its ``get``)."""
    data = getattr(os.environ, "_data", None) if _POSIX else None
    if not isinstance(data, dict):
        return os.environ.get(name)
    raw = data.get(name.encode())
    return None if raw is None else os.fsdecode(raw)


def check_environment() -> None:
    """Parse every moeblaze variable set in the environment now: a look-up reads one only when its setting is used,
    which can be far into a run (a command line checks them before it starts).

    Raises:
        ValueError: the first malformed variable, named with the values it takes.
    """
    for env, parse, _ in SETTINGS.values():
        raw = _getenv(env)
        if raw is not None:
            parse(env, raw)


_configured: dict[str, Any] = {}
_scoped: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("moeblaze_settings", default=None)


def _validate(values: dict[str, Any]) -> dict[str, Any]:
    """Check names and values given from code (strings are parsed as the environment's would be)."""
    out = {}
    for name, value in values.items():
        if name not in SETTINGS:
            raise ValueError(f"unknown moeblaze setting {name!r}; known: {sorted(SETTINGS)}")
        env, parse, _ = SETTINGS[name]
        raw = str(int(value) if isinstance(value, bool) else value)
        out[name] = parse(f"setting {name!r}", raw)
    return out


@torch.compiler.assume_constant_result
def get(name: str) -> Any:
    """The current value of setting ``name`` (see the module table).

    Under ``torch.compile`` the value is read once, when the graph is traced, and is a constant of that graph
    (dynamo cannot trace ``ContextVar.get``: torch 2.11, ``tests/test_experts_triton.py::
    test_gpu_torch_compile_fullgraph_bf16``); change a setting before compiling, not between runs.

    Raises:
        ValueError: an unknown name, or the environment variable holds a value the setting does not take.
    """
    scoped = _scoped.get()
    if scoped and name in scoped:
        return scoped[name]
    if name in _configured:
        return _configured[name]
    try:
        env, parse, default = SETTINGS[name]
    except KeyError:
        raise ValueError(f"unknown moeblaze setting {name!r}; known: {sorted(SETTINGS)}") from None
    raw = _getenv(env)
    return default if raw is None else parse(env, raw)


def configure(**values: Any) -> None:
    """Set switches process-wide, above the environment (e.g. ``configure(autotune=False)``).

    Raises:
        ValueError: an unknown setting or a value it does not take.
    """
    _configured.update(_validate(values))


def configured() -> dict[str, Any]:
    """A copy of the values :func:`configure` set (not the environment's, not the overrides)."""
    return dict(_configured)


def reset(*names: str) -> None:
    """Forget :func:`configure`'s values of ``names`` (all when none are given): the environment applies again."""
    for name in names or list(_configured):
        _configured.pop(name, None)


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Set switches inside a ``with`` block only (this thread / asyncio task), above everything else.

    Example: ``with moeblaze.settings.override(backend="torch", autotune=False): out = moe(x)``.

    An override in effect during a forward also governs that graph's backward (:func:`carried_to_backward`); one
    around the ``backward()`` call alone does not reach autograd's device thread, where CUDA backwards run (use
    :func:`configure` or the environment for those).

    Raises:
        ValueError: an unknown setting or a value it does not take.
    """
    token = _scoped.set({**(_scoped.get() or {}), **_validate(values)})
    try:
        yield
    finally:
        _scoped.reset(token)


def carried_to_backward(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate an autograd Function's ``forward`` and ``backward`` (moeblaze's own): the :func:`override` values in
    effect in the forward govern its backward too, below the backward thread's own overrides.

    Why: on CUDA, ``loss.backward()`` runs the backward on autograd's device thread, which the calling thread's
    overrides (a context variable) do not reach: on an H200 a backward inside ``override(...)`` still took
    the kernel the override switched off. Without an override in the forward this adds one stored attribute and
    enters nothing; under ``torch.compile`` it does nothing (the settings are those of the trace, as :func:`get` says).
    """
    forward = method.__name__ == "forward"

    @functools.wraps(method)
    def run(ctx, *args):
        if forward:  # dynamo cannot trace ContextVar.get (see get): under compile the trace's settings hold
            ctx.settings_scope = None if torch.compiler.is_compiling() else _scoped.get()
            return method(ctx, *args)
        saved = getattr(ctx, "settings_scope", None)
        if not saved or torch.compiler.is_compiling():
            return method(ctx, *args)
        own = _scoped.get()
        if own is saved:  # the forward's scope is still on (the same thread, the same block): nothing to enter
            return method(ctx, *args)
        token = _scoped.set({**saved, **(own or {})})
        try:
            return method(ctx, *args)
        finally:
            _scoped.reset(token)

    return run


def interpreting() -> bool:
    """True when Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return _getenv("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Whether moeblaze's Triton router, token-rounding selections and dispatch build may run on ``t`` (each
    caller adds its kernels' own limits: shapes, dtypes, Triton importable), by the ``backend`` setting: ``auto``
    on CUDA tensors; ``triton`` on CUDA tensors and, under ``TRITON_INTERPRET=1``, on CPU tensors; ``torch`` never
    (PyTorch ops everywhere: to compare with or debug the kernels). The one rule of the three (why: one switch
    that turns every kernel outside the experts on or off, rather than a switch per kernel).

    Raises:
        ValueError: ``MOEBLAZE_BACKEND`` holds a value the setting does not take.
    """
    backend = get("backend")
    if backend == "torch":
        return False
    return t.is_cuda or (backend == "triton" and interpreting())


def launcher_env() -> dict[str, str]:
    """The launcher's variables that are set in this process (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_USE_AGENT_STORE``: torchrun's own, not moeblaze switches; read by
    :func:`moeblaze.parallel.init_distributed`, :mod:`moeblaze.training.heartbeat` and ``moeblaze train``)."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE")
    return {k: os.environ[k] for k in names if k in os.environ}


def library_env_defaults(values: dict[str, str]) -> None:
    """Set environment variables that libraries below moeblaze read once (cuBLAS's ``CUBLAS_WORKSPACE_CONFIG``,
    NCCL's ``NCCL_ALGO``, ...) where the process has not set them: values set before win
    (:func:`moeblaze.training.determinism.deterministic_mode`)."""
    for name, value in values.items():
        os.environ.setdefault(name, value)
