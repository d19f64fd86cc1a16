"""One (config, implementation) measurement in a child process with a hard wall-clock limit.

Some implementations compile their kernels on the first call (SonicMoE: CuTe-DSL GEMMs autotuned over
tens of configs), which can take minutes and cannot be interrupted in-process, so ``RunOptions.cap_s``
(checked after the first step) does not help. :func:`measure_isolated` (parent side) runs::

    python -m moeblaze.bench.worker --job '<json>' --out row.json --dump-at UNIX_TIME

in a new process group that it leads (``setsid``; a fresh interpreter: no inherited CUDA context) and waits at
most ``timeout_s``; past it the whole process group is killed (compile workers that the child spawned too) and the
row says so; 5 s before that the child prints every thread's Python stack (``faulthandler``), so the log kept under
``RunOptions.child_log_dir`` says where it was.
The child (:func:`main`) rebuilds the seeded weights and inputs of the config, runs
:func:`moeblaze.bench.runner.measure_impl` and writes the :class:`~moeblaze.bench.runner.Row` as JSON.

In the child the first step may take up to the timeout: ``cap_s`` becomes ``max(cap_s, timeout_s)`` there
(it still cuts the timed repetitions), so a compile that finishes in time is measured, not skipped.

The job holds the whole config (``BenchConfig`` fields: ``name@T`` and ``--shape`` configs are not in
``CONFIGS``), the implementation as :func:`~moeblaze.bench.baselines.resolve_impl` finds it (a registry
name or ``module:attribute``) and the :class:`~moeblaze.bench.runner.RunOptions`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import moeblaze

from .baselines import resolve_impl
from .configs import BenchConfig
from .runner import Row, RunOptions, flush_buffer, layer_inputs, measure_impl, oom_row, require_cuda

__all__ = ["measure_isolated", "run_job", "main"]


def measure_isolated(cfg: BenchConfig, spec: str, opts: RunOptions, timeout_s: float,
                     limit_flag: str = "--isolate-timeout-s", impl_name: str | None = None) -> Row:
    """Measure implementation ``spec`` on ``cfg`` in a child process; never raises for what the child does.

    Args:
        cfg: the layer shape. spec: a key of ``IMPLS`` or ``module:attribute`` (importable in the child).
        opts: the run's options (the child's ``cap_s`` is raised to ``timeout_s``). timeout_s: wall-clock limit
            in seconds, compile and timing included.
        limit_flag: the option that set ``timeout_s``, named in the note of a killed run.
        impl_name: the row's ``impl`` (default: the resolved implementation's name).

    Returns:
        The child's row (its note ends with ``isolated``); ``skipped`` with ``killed after ...`` when it ran
        past ``timeout_s``; ``error`` with the last line of its output when it died without a row.

    Raises:
        KeyError: ``impl_name`` not given and ``spec`` unknown here.
    """
    name = impl_name or resolve_impl(spec).name
    child_opts = dataclasses.replace(opts, cap_s=max(opts.cap_s, timeout_s))  # the kill is the first-step cap
    job = {"config": cfg.as_dict(), "impl": spec, "options": child_opts.as_dict()}
    with tempfile.TemporaryDirectory(prefix="moeblaze-bench-") as tmp:
        out, log = Path(tmp) / "row.json", Path(tmp) / "output.log"
        cmd = [sys.executable, "-m", "moeblaze.bench.worker", "--job", json.dumps(job), "--out", str(out),
               "--dump-at", repr(time.time() + max(0.5, timeout_s - _DUMP_LEAD_S))]
        with open(log, "wb") as log_f:  # a file, not a pipe: compile workers may keep it open
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_f, stderr=subprocess.STDOUT,
                                    env=_child_env(), start_new_session=True)
            try:
                rc: int | None = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
                _kill(proc)
            except BaseException:  # Ctrl-C: the child is in its own process group (setsid), take it down too
                _kill(proc)
                raise
        _keep_log(log, opts.child_log_dir, re.sub(r"[^\w.-]", "_", f"{cfg.name}-{name}") + ".log")
        if out.exists():  # written: a crash or hang at interpreter exit does not lose it
            row = Row(**json.loads(out.read_text()))
            row.note = f"{row.note}; isolated" if row.note else "isolated"
            return row
        if rc is None:
            return Row.for_config(cfg, name, opts.dtype, status="skipped",
                                  note=f"killed after {timeout_s:.0f} s (first step / compile did not finish; "
                                  f"{limit_flag})")
        return Row.for_config(cfg, name, opts.dtype, status="error",
                              note=f"child process exited with {rc}: {_last_line(log)}")


_DUMP_LEAD_S = 5.0  # the child prints its threads' stacks this long before the kill: why it ran so long


def _keep_log(log: Path, log_dir: str | None, file_name: str) -> None:
    """Copy the child's output to ``log_dir/file_name`` (why a child was killed or died stays readable)."""
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, Path(log_dir) / file_name)


def _child_env() -> dict[str, str]:
    """This environment, with the directory this ``moeblaze`` was imported from first on PYTHONPATH."""
    env = dict(os.environ)
    root = str(Path(moeblaze.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (it leads its own, ``setsid``), then reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:  # pragma: no cover - Windows has no process groups here
            proc.kill()
    proc.wait()


def _last_line(path: Path, limit: int = 200) -> str:
    """The last non-empty line of a log file (at most ``limit`` characters), or ``"(no output)"``."""
    with open(path, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
        lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:limit] if lines else "(no output)"


def run_job(job: dict) -> Row:
    """The child's work: rebuild the seeded weights and inputs of ``job["config"]``, measure the implementation.

    Args:
        job: ``{"config": BenchConfig fields, "impl": spec, "options": RunOptions.as_dict()}``.

    Returns:
        The row of :func:`~moeblaze.bench.runner.measure_impl` (``OOM`` when the weights do not fit).

    Raises:
        KeyError: unknown implementation. NoCudaError: ``device="cuda"`` without a GPU.
    """
    cfg = BenchConfig(**job["config"])
    impl = resolve_impl(job["impl"])
    opts = RunOptions.from_dict(job["options"])
    if opts.device != "cpu":
        require_cuda()
    inputs = layer_inputs(cfg, opts)
    if inputs is None:
        return oom_row(cfg, impl, opts)
    return measure_impl(cfg, impl, *inputs, opts, flush_buffer(opts))


def main(argv: list[str] | None = None) -> int:
    """``python -m moeblaze.bench.worker --job JSON --out PATH``: write the row of :func:`run_job` to PATH.

    Raises:
        SystemExit: bad arguments. Whatever :func:`run_job` raises propagates (the parent reports it).
    """
    p = argparse.ArgumentParser(prog="python -m moeblaze.bench.worker", description=__doc__.split("\n")[0])
    p.add_argument("--job", required=True, help="JSON: config fields, impl, RunOptions")
    p.add_argument("--out", required=True, help="file to write the Row to, as JSON")
    p.add_argument("--dump-at", type=float, default=None,
                   help="print every thread's Python stack to stderr at this Unix time (once)")
    args = p.parse_args(argv)
    if args.dump_at:  # a time, not a delay: the imports before this line take seconds on a loaded machine
        faulthandler.dump_traceback_later(max(0.1, args.dump_at - time.time()), exit=False)
    t0 = time.perf_counter()
    row = run_job(json.loads(args.job))
    part = Path(args.out + ".part")
    part.write_text(json.dumps(row.as_dict()) + "\n")
    part.replace(args.out)  # atomic: a kill in between leaves no half-written row
    print(f"moeblaze.bench.worker: {row.impl} on {row.config}: {row.status} in {time.perf_counter() - t0:.1f} s",
          flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: JIT runtimes may hang or crash there, the row is written
