"""Isolated measurements of ``moeblaze bench`` (:mod:`moeblaze.bench.worker`) on the CPU: a child process per
(config, implementation), its row back as JSON, the kill at the timeout, a crashing child, the options."""

import argparse
import dataclasses
import os
import textwrap
import time

import pytest

from moeblaze.bench.baselines import IMPLS, resolve_impl
from moeblaze.bench.cli import _options, register
from moeblaze.bench.configs import BenchConfig
from moeblaze.bench.runner import RunOptions
from moeblaze.bench.suite import isolate_timeout, run_layers
from moeblaze.bench.worker import measure_isolated

TINY = BenchConfig("tiny", "t", 48, 16, 24, 4, 2, "swiglu")
CPU = dict(dtype="fp32", device="cpu", flush_l2=False, min_reps=1, max_reps=2, target_s=0.01)

# Test-only implementations, importable by the child as ``<module>:SLEEPY`` / ``<module>:CRASHY``.
PLUGIN = textwrap.dedent('''
    import os
    import subprocess
    import sys
    import time

    from moeblaze.bench.baselines import Impl

    def _sleepy(cfg, w, opts):
        def fn(x):  # a "compile" with worker processes that never ends within the test's timeout
            worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            with open(os.environ["MOEBLAZE_TEST_PIDFILE"], "w") as f:
                f.write(str(worker.pid))
            time.sleep(120)
            return x
        return fn

    def _crashy(cfg, w, opts):
        print("crashy: native compiler died (simulated)", file=sys.stderr, flush=True)
        os._exit(7)

    def _slow_start(cfg, w, opts):
        time.sleep(1.0)  # a compile longer than the test's cap_s, shorter than its timeout
        return lambda x: x * 2

    SLOW_START = Impl("slow-start", "builds for 1 s", _slow_start, isolate=True)
    SLEEPY = Impl("sleepy", "sleeps in its first step", _sleepy, isolate=True)
    CRASHY = Impl("crashy", "kills its process while building", _crashy, isolate=True)
''')


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """Write the plugin module, importable here (sys.path) and in the child (PYTHONPATH); its name."""
    name = "moeblaze_isolate_test_plugin"
    (tmp_path / f"{name}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("MOEBLAZE_TEST_PIDFILE", str(tmp_path / "worker.pid"))
    return name


def alive(pid: int) -> bool:
    """Running (a zombie left for a non-reaping init counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_isolated_row_matches_in_process_row(monkeypatch):
    import moeblaze.bench.runner as runner

    cfg = TINY.with_tokens(32)  # ``tiny@32`` is in no registry: the child gets the whole config
    [here] = run_layers([cfg], ["conventional"], RunOptions(**CPU))

    def no_weights(*args, **kwargs):
        raise AssertionError("the parent made weights that only the child needs")

    monkeypatch.setattr(runner, "make_weights", no_weights)
    [child] = run_layers([cfg], ["conventional"], RunOptions(**CPU, isolate="all"))
    assert child.status == "ok" and child.time_ms > 0 and child.reps >= 1 and child.warmup_s > 0, child
    assert child.note == "isolated"
    same = ("group", "config", "impl", "T", "d", "h", "E", "K", "activation", "dtype", "status", "saved_mib")
    assert {k: getattr(child, k) for k in same} == {k: getattr(here, k) for k in same}
    assert type(child) is type(here)


def test_timeout_kills_the_child_and_the_run_goes_on(plugin, tmp_path):
    # 12 s: the dump is armed once the child has imported torch, which takes seconds on a loaded 2-core machine
    opts = RunOptions(**CPU, isolate_timeout_s=12, child_log_dir=str(tmp_path / "children"))
    t0 = time.perf_counter()
    rows = run_layers([TINY], [f"{plugin}:SLEEPY", "conventional"], opts)
    elapsed = time.perf_counter() - t0
    assert [(r.impl, r.status) for r in rows] == [("sleepy", "skipped"), ("conventional", "ok")]
    assert "killed after 12 s" in rows[0].note and "--isolate-timeout-s" in rows[0].note
    assert elapsed < 30, elapsed
    # the kept log shows where the child was when it ran out of time (dumped 5 s before the kill)
    log = (tmp_path / "children" / f"{TINY.name}-sleepy.log").read_text()
    assert "Thread" in log and "in fn" in log, log
    pidfile = tmp_path / "worker.pid"
    if pidfile.exists() and os.path.isdir("/proc"):  # the child's own worker process went down with it
        pid = int(pidfile.read_text())
        deadline = time.perf_counter() + 5
        while alive(pid) and time.perf_counter() < deadline:
            time.sleep(0.05)
        assert not alive(pid)


def test_the_timeout_not_cap_s_bounds_an_isolated_first_step(plugin):
    opts = RunOptions(**CPU, cap_s=0.5)
    [here] = run_layers([TINY], [f"{plugin}:SLOW_START"], dataclasses.replace(opts, isolate="none"))
    assert here.status == "skipped" and "> cap" in here.note
    row = measure_isolated(TINY, f"{plugin}:SLOW_START", opts, timeout_s=60)
    assert row.status == "ok" and row.warmup_s >= 1.0 and row.time_ms > 0 and row.note == "isolated", row


def test_crashing_child_reports_its_last_line_and_keeps_its_log(plugin, tmp_path):
    opts = RunOptions(**CPU, child_log_dir=str(tmp_path / "children"))
    row = measure_isolated(TINY, f"{plugin}:CRASHY", opts, timeout_s=60)
    assert row.status == "error" and row.impl == "crashy"
    assert "exited with 7" in row.note and "native compiler died" in row.note
    assert "native compiler died" in (tmp_path / "children" / f"{TINY.name}-crashy.log").read_text()


def test_timeout_is_bounded_by_the_budget_left():
    now = time.perf_counter()
    assert isolate_timeout(RunOptions(isolate_timeout_s=30.0), now) == (30.0, "--isolate-timeout-s")
    assert isolate_timeout(RunOptions(isolate_timeout_s=30.0, budget_s=100.0), now - 10) == (
        30.0, "--isolate-timeout-s")
    t, flag = isolate_timeout(RunOptions(isolate_timeout_s=30.0, budget_s=100.0), now - 90)
    assert flag == "--budget-s" and 9.0 < t <= 10.0
    assert isolate_timeout(RunOptions(budget_s=1.0), now - 5)[0] == 0.0


def test_options_registry_and_cli_flags():
    assert IMPLS["sonicmoe"].isolate and not IMPLS["conventional"].isolate
    opts = RunOptions(isolate="auto")
    assert opts.isolates(IMPLS["sonicmoe"]) and not opts.isolates(IMPLS["conventional"])
    assert RunOptions(isolate="all").isolates(IMPLS["conventional"])
    assert not RunOptions(isolate="none").isolates(IMPLS["sonicmoe"])
    with pytest.raises(ValueError, match="isolate"):
        RunOptions(isolate="sometimes")
    full = RunOptions(**CPU, isolate="all", isolate_timeout_s=5.0, budget_s=9.0)
    assert RunOptions.from_dict(full.as_dict()) == full
    assert resolve_impl("conventional") is IMPLS["conventional"]
    for bad in ("no-such-impl", "no_such_module_xyz:IMPL", "moeblaze.bench.baselines:BASELINE_IMPL"):
        with pytest.raises(KeyError):
            resolve_impl(bad)
    p = argparse.ArgumentParser(prog="moeblaze")
    register(p.add_subparsers(dest="command"))
    args = p.parse_args(["bench", "--isolate", "all", "--isolate-timeout-s", "42"])
    got = _options(args, None)
    assert (got.isolate, got.isolate_timeout_s) == ("all", 42.0)
    defaults = _options(p.parse_args(["bench"]), None)
    assert (defaults.isolate, defaults.isolate_timeout_s, defaults.child_log_dir) == ("auto", 600.0, None)

