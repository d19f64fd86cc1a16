"""Where one layer step's time goes: host (Python + launch) time against device time, kernel by kernel.

For each config and implementation of ``moeblaze bench`` (weights and inputs as there), after warm-up:

- *host ms*: wall time of one forward+backward call from Python, the GPU idle at the start
  (``synchronize`` before, none after): what the CPU spends submitting the step;
- *step ms*: wall time per step of 20 back-to-back steps (``synchronize`` at the end);
- *device ms*: sum of the step's kernel times (torch.profiler, three steps averaged; ``--profiled-steps N``:
  N back-to-back steps averaged), and the number of kernels per step; ``--gaps N``: the GPU's idle time
  between kernels per step and the N longest gaps.

Three steps are a burst: the card is still below its power limit and its clock high. Sustained, the kernels
run longer (H200, Qwen3-30B-A3B shape, T 32,768: moeblaze's kernels summed to 13.38-13.53 ms per
step over three steps against 14.97 over 30, which matched its 14.5-14.7 ms per back-to-back step; SonicMoE's
13.38-13.59 against 13.55): compare implementations with ``--profiled-steps 30`` when the steps are long.

A step is host-bound when *host ms* is close to *step ms* and above *device ms*. ``--kernels`` prints the profiler's
kernel table, ``--cprofile N`` the N most expensive Python functions (cumulative), ``--timeline`` every kernel of
one step in launch order with its time inside the step (three steps averaged; compare with ``profile_kernels.py``,
which times each launch alone), ``--energy N`` the GPU's joules per step, mean power and SM clock over N
back-to-back steps (NVML, :mod:`moeblaze.bench.power`), ``--cold`` the step time after the GPU idled 1.5 s against
the time per step of 30 back-to-back steps, with the SM clock, power draw and clock-limit reasons that
``nvidia-smi`` reads during the back-to-back steps (a step slower when sustained than cold is a step the card's
power limit slows down), ``--peak`` what was allocated at the step's memory peak, by allocating line
(:mod:`moeblaze.bench.peak`), ``--api N`` the N host-side operations (ATen ops and CUDA runtime / driver functions:
launches, copies, synchronisations) with the most CPU time of their own, ``--busy`` the host time of a step queued
behind 100 ms of GPU work (``torch.cuda._sleep``): a step that only queues work returns in its usual host time, one
that waits for the GPU anywhere inside (a synchronising call, a pageable copy) takes the 100 ms.

Usage (GPU): ``python3 benchmarks/profile_layer.py --configs sweep-8k,smoke-olmoe --impls moeblaze,conventional``
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import subprocess
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from moeblaze.bench.baselines import ImplOptions, make_weights, resolve_impl
from moeblaze.bench.configs import config_named, parse_list
from moeblaze.bench.peak import peak_breakdown
from moeblaze.bench.power import EnergyMeter


def make_step(fn, x: torch.Tensor, dout: torch.Tensor, params: list[torch.Tensor]):
    def step() -> None:
        for p in (*params, x):
            p.grad = None
        fn(x).backward(dout)

    return step


def host_and_step_ms(step, reps: int = 20) -> tuple[float, float]:
    """(median host submit time, back-to-back time per step), ms."""
    host = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
    return sorted(host)[reps // 2] * 1e3, (time.perf_counter() - t0) / reps * 1e3


def device_profile(step, steps: int = 3):
    """(device ms per step, kernels per step, the profiler's averages)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    ev = prof.key_averages()
    kernels = [e for e in ev if e.device_type == DeviceType.CUDA]
    dev_us = sum(e.self_device_time_total for e in kernels) / steps
    return dev_us / 1e3, sum(e.count for e in kernels) / steps, ev


def traced_kernels(step, steps: int = 3) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every kernel of ``steps`` back-to-back steps, in launch order. One more
    step runs first under the profiler and its kernels are dropped: the first kernels under a fresh
    profiler start late (on an H200: gaps of 0.3-2.9 ms that no later step shows)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(1 + steps):
            step()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == DeviceType.CUDA)
    return kernels[len(kernels) // (1 + steps):]  # every step launches the same kernels


def idle_gaps(step, top: int, steps: int = 3) -> tuple[float, list[tuple[float, str, str]]]:
    """GPU idle time between consecutive kernels of ``steps`` back-to-back steps (torch.profiler trace):
    (idle ms per step, the ``top`` longest gaps as (µs, kernel before, kernel after))."""
    kernels = traced_kernels(step, steps)
    gaps = [(b[0] - a[1], a[2][:50], b[2][:50]) for a, b in zip(kernels, kernels[1:]) if b[0] > a[1]]
    return sum(g for g, _, _ in gaps) / steps / 1e3, sorted(gaps, reverse=True)[:top]


def timeline(step, steps: int = 3) -> list[tuple[str, float]]:
    """(kernel name, ms inside the step) of each launch of one step, in order, averaged over ``steps``."""
    kernels = traced_kernels(step, steps)
    per = len(kernels) // steps
    return [(kernels[i][2], sum(kernels[s * per + i][1] - kernels[s * per + i][0] for s in range(steps)) / steps / 1e3)
            for i in range(per)]


def host_ms_behind_busy_gpu(step, busy_ms: float = 100.0, reps: int = 5) -> tuple[float, float]:
    """(median host ms of a step queued behind ``busy_ms`` of GPU work, the GPU work's measured ms)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    cycles = int(cycles * busy_ms / start.elapsed_time(end))
    host = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return sorted(host)[reps // 2], start.elapsed_time(end)


def gpu_state() -> str:
    """SM clock, power draw and active clock-limit reasons as ``nvidia-smi`` reads them (read only)."""
    query = "clocks.sm,power.draw,clocks_throttle_reasons.active"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, check=False)
    except FileNotFoundError:
        return "nvidia-smi not found"
    return out.stdout.strip() or out.stderr.strip()


def cold_and_sustained_ms(step, cold_reps: int = 4, reps: int = 30) -> tuple[float, float, str]:
    """(median step ms after 1.5 s of GPU idle, ms per step of ``reps`` back-to-back steps, the GPU state
    read half way through them)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cold = []
    for _ in range(cold_reps):
        torch.cuda.synchronize()
        time.sleep(1.5)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        cold.append(start.elapsed_time(end))
    t0 = time.perf_counter()
    state = ""
    for i in range(reps):
        step()
        if i == reps // 2:
            state = gpu_state()  # the earlier steps are still queued: the GPU is busy while this reads
    torch.cuda.synchronize()
    return sorted(cold)[cold_reps // 2], (time.perf_counter() - t0) / reps * 1e3, state


def energy_per_step(step, reps: int) -> tuple[float, object]:
    """(ms per step, :class:`moeblaze.bench.power.EnergyReading` or None where NVML failed) of ``reps`` back-to-back
    steps, synchronised only at both ends (the GPU never waits for the host in between)."""
    meter = EnergyMeter(torch.cuda.current_device())
    torch.cuda.synchronize()
    with meter:
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / reps * 1e3
    return ms, meter.reading


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="sweep-8k,smoke-olmoe",
                    help="comma-separated bench config names or d:h:E:K shapes")
    ap.add_argument("--impls", default="moeblaze,conventional", help="comma-separated implementations")
    ap.add_argument("--kernels", action="store_true", help="print the kernel table of each row")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the N top Python functions")
    ap.add_argument("--gaps", type=int, default=0, metavar="N",
                    help="print the GPU idle time per step and the N longest gaps between kernels")
    ap.add_argument("--timeline", action="store_true", help="print each kernel of a step in order, ms in the step")
    ap.add_argument("--cold", action="store_true",
                    help="print the step time after the GPU idled against back-to-back, with clock and power")
    ap.add_argument("--peak", action="store_true", help="print what was allocated at the step's memory peak")
    ap.add_argument("--api", type=int, default=0, metavar="N",
                    help="print the N host-side ops and CUDA API functions with the most CPU time of their own")
    ap.add_argument("--busy", action="store_true",
                    help="print the host time of a step queued behind 100 ms of GPU work")
    ap.add_argument("--energy", type=int, default=0, metavar="N",
                    help="time N back-to-back steps; print the GPU's joules per step, mean power, SM clock (NVML)")
    ap.add_argument("--tokens", type=int, default=0, help="T of every config (0: the config's own)")
    ap.add_argument("--profiled-steps", type=int, default=3, metavar="N",
                    help="back-to-back steps averaged by the profiles (device ms, --timeline, --gaps; default 3)")
    args = ap.parse_args()
    if args.profiled_steps < 1:
        ap.error(f"--profiled-steps must be >= 1, got {args.profiled_steps}")
    if args.energy and not EnergyMeter.available():
        ap.error("--energy reads NVML: install nvidia-ml-py (pynvml) on a machine with an NVIDIA driver")
    torch.manual_seed(0)
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {now}")
    print(f"{'config':<14} {'impl':<13} {'host ms':>8} {'step ms':>8} {'device ms':>9} {'kernels':>7}")
    for name in parse_list(args.configs):
        cfg = config_named(name, args.tokens)
        w = make_weights(cfg, "cuda", torch.bfloat16)
        x = torch.randn(cfg.T, cfg.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn_like(x)
        for impl_name in parse_list(args.impls):
            fn = resolve_impl(impl_name).build(cfg, w, ImplOptions())
            step = make_step(fn, x, dout, [w.router, w.w1, w.w2])
            for _ in range(5):  # warm-up: compilation and autotuning
                step()
            host, wall = host_and_step_ms(step)
            dev, nk, ev = device_profile(step, args.profiled_steps)
            print(f"{name:<14} {impl_name:<13} {host:8.3f} {wall:8.3f} {dev:9.3f} {nk:7.0f}", flush=True)
            if args.kernels:
                print(ev.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
            if args.api:
                print(ev.table(sort_by="self_cpu_time_total", row_limit=args.api, max_name_column_width=60))
            if args.busy:
                busy_host, busy = host_ms_behind_busy_gpu(step)
                print(f"  host ms behind {busy:.1f} ms of queued GPU work: {busy_host:.3f} (idle GPU: {host:.3f})")
            if args.timeline:
                for kernel, ms in timeline(step, args.profiled_steps):
                    print(f"    {ms:9.3f} ms  {kernel[:120]}")
            if args.cold:
                cold, sustained, state = cold_and_sustained_ms(step)
                print(f"  cold step {cold:.2f} ms, back to back {sustained:.2f} ms per step "
                      f"({sustained / cold:.3f}x); nvidia-smi then (SM clock, power, limit reasons): {state}")
            if args.energy:
                ms, e = energy_per_step(step, args.energy)
                power = ("no energy reading (NVML failed; warned above)" if e is None else
                         f"{e.joules / args.energy:.3f} J per step, {e.watts:.0f} W of a {e.power_limit_w:.0f} W "
                         f"limit, SM clock {e.sm_clock_mhz:.0f} MHz")
                print(f"  {args.energy} back-to-back steps: {ms:.3f} ms per step, {power}")
            if args.peak:
                print(peak_breakdown(step).table())
            if args.gaps:
                idle, longest = idle_gaps(step, args.gaps, args.profiled_steps)
                print(f"  GPU idle between kernels: {idle:.3f} ms per step; longest gaps (us, before -> after):")
                for us, before, after in longest:
                    print(f"    {us:9.1f}  {before} -> {after}")
            if args.cprofile:
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(10):
                    step()
                torch.cuda.synchronize()
                pr.disable()
                out = io.StringIO()
                pstats.Stats(pr, stream=out).sort_stats("cumulative").print_stats(args.cprofile)
                print(out.getvalue())


if __name__ == "__main__":
    main()
