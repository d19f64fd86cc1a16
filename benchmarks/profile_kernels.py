"""Each expert kernel of one moeblaze layer step, timed alone: which launch holds the time, at what TFLOP/s.

For each bench config (weights and inputs as ``moeblaze bench``), after warm-up and autotuning, one
forward+backward is run with every ``Launchable`` launch recorded (kernel, grid, arguments, the config
the autotuner chose). Each launch is then replayed on its own with ``triton.testing.do_bench`` (L2
flushed, median): milliseconds, TFLOP/s of the GEMMs (2·rows·K·cols, twice for the dual-accumulator F1)
and the chosen block sizes. ``--set NAME=VALUE`` replays every launch that takes the constexpr ``NAME``
as a launch flag (not a block size of the config) once more with it overridden (e.g. ``B_DESC=0``: the
weights and wgrad slot rows read through pointers instead of TMA), for same-run A/B comparisons.
In-place kernels (the activation backward) are replayed on their own outputs: the timing holds, the
values do not matter.

``--all-configs B2,B4`` replays the launches of those steps (prefixes of the step names) with every config
of the tuned list as well, one line each: what the autotuner chose from, and by how much. ``--tokens T`` runs
the configs at T tokens. The weight gradients' lines give the GB/s at which their ``[E, P, Q]`` output is
written (at few slots per expert a tile is mostly its store).

Usage (GPU): ``python3 benchmarks/profile_kernels.py --configs conf4-swiglu,olmoe-1b-7b --set B_DESC=0``;
``--dtype fp32`` (TF32 at the default ``--fp32-precision high``) for the fp32 path;
``--configs qwen3-30b-a3b --tokens 2048 --all-configs B2,B4`` for the weight gradients at few slots per expert.
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.testing

from moeblaze.bench.baselines import ImplOptions, make_weights, resolve_impl
from moeblaze.bench.configs import config_named, parse_list
from moeblaze.kernels import tuning
from moeblaze.kernels.grouped_gemm import EPILOGUE_ACT_FWD

STEP_NAMES = {  # kernel -> (its arguments -> DESIGN.md §5 step); of the two slot-row GEMMs F2 comes first
    "grouped_gemm_kernel": lambda a: ("F1 up-proj + act" if a["EPILOGUE"] == EPILOGUE_ACT_FWD.value else
                                      "B1 dact'" if a["GATHER_A"] else "F2 down-proj" if not a["seen_f2"]
                                      else "B3 dx slots"),
    "grouped_wgrad_kernel": lambda a: "B4 dW_gate_up^T" if a["stride_c_p"] == 1 else "B2 dW_down",
    "act_bwd_rows_kernel": lambda a: "B1 act backward",
    "gather_sum_kernel": lambda a: "combine / dx gather-sum",
}


def record_launches(step) -> list[tuple]:
    """Run ``step`` once with :meth:`Launchable.launch` wrapped; returns (launchable, grid, args, kwargs, config)."""
    seen = []
    orig = tuning.Launchable.launch

    def spy(self, dtype, grid, *args, **kwargs):
        orig(self, dtype, grid, *args, **kwargs)
        seen.append((self, grid, args, kwargs, self._best[self.tune_key(dtype, args, kwargs)]))

    tuning.Launchable.launch = spy
    try:
        step()
        torch.cuda.synchronize()
    finally:
        tuning.Launchable.launch = orig
    return seen


def replay_ms(launchable, grid, args, kwargs, config, overrides=None) -> float:
    """Median ms of the launch alone with ``config`` (and constexpr ``overrides``)."""
    kwargs = {**kwargs, **(overrides or {})}

    def go():
        launchable.run(config, grid, *args, **kwargs)

    go()
    return triton.testing.do_bench(go, warmup=10, rep=100, return_mode="median")


def named_args(launchable, args, kwargs) -> dict:
    """A recorded launch's arguments by name (positional ones through the kernel's argument names)."""
    return {**dict(zip(launchable.fn.arg_names, args)), **kwargs}


def describe(launchable, args, kwargs, seen_f2: bool = False) -> tuple[str, float | None]:
    """(step name, FLOPs of the launch or None for the memory-bound kernels); ``seen_f2``: F2 was among the
    launches before (the next GEMM over slot rows is B3: with TF32 both read their weight K-major)."""
    a = {**named_args(launchable, args, kwargs), "seen_f2": seen_f2}
    name = launchable.fn.__name__
    label = STEP_NAMES.get(name, lambda _: name)(a)
    n = a["indices_ptr"].numel() if "indices_ptr" in a else 0
    if name == "grouped_gemm_kernel":
        return label, 2.0 * n * a["K_DIM"] * a["N_COLS"] * (2 if a["DUAL"] else 1)
    if name == "grouped_wgrad_kernel":
        return label, 2.0 * n * a["P"] * a["Q"]
    return label, None


def config_str(c: triton.Config) -> str:
    k = c.kwargs
    dims = "x".join(str(k[n]) for n in ("BLOCK_N", "BLOCK_P", "BLOCK_Q", "BLOCK_K", "BLOCK_R", "BLOCK_H", "BLOCK_T",
                                        "BLOCK_D") if n in k)
    return f"{dims} w{c.num_warps} s{c.num_stages}{' persistent' if k.get('PERSISTENT') else ''}"


def out_rate(launchable, args, kwargs, ms: float) -> str:
    """GB/s at which a weight gradient's ``[E, P, Q]`` output is written; empty for the other kernels."""
    if launchable.fn.__name__ != "grouped_wgrad_kernel":
        return ""
    c = named_args(launchable, args, kwargs)["c_ptr"]
    return f" {c.numel() * c.element_size() / ms / 1e6:5.0f} GB/s out"


def replay_all(launchable, grid, args, kwargs, dtype: torch.dtype, chosen: float) -> None:
    """One line per tuned config: ms alone and against the chosen config's ``chosen`` ms."""
    for c in launchable.pruned(launchable.kind(dtype), args, kwargs):
        try:
            ms = replay_ms(launchable, grid, args, kwargs, c)
        except Exception as exc:  # e.g. a tile that exceeds shared memory at this shape: say so, keep going
            print(f"      {config_str(c):<28} failed: {type(exc).__name__}")
            continue
        print(f"      {config_str(c):<28} {ms:8.3f} ms ({ms / chosen:.3f}x){out_rate(launchable, args, kwargs, ms)}")


def profile_config(name: str, overrides: list[tuple[str, int]], dtype: torch.dtype = torch.bfloat16,
                   tokens: int = 0, sweep: tuple[str, ...] = ()) -> None:
    """Print the per-launch table of one bench config (at ``tokens`` if given; the steps named by a prefix in
    ``sweep`` with every tuned config too), then the whole step's time (the launches' sum falls short of it by
    what runs outside the kernels: router, index build, casts, allocations)."""
    cfg = config_named(name, tokens)
    w = make_weights(cfg, "cuda", dtype)
    x = torch.randn(cfg.T, cfg.d, device="cuda", dtype=dtype, requires_grad=True)
    dout = torch.randn_like(x)
    fn = resolve_impl("moeblaze").build(cfg, w, ImplOptions())

    def step():
        fn(x).backward(dout)

    for _ in range(3):  # compilation and autotuning
        step()
    launches = record_launches(step)
    print(f"\n{name} (T {cfg.T}, d {cfg.d}, h {cfg.h}, E {cfg.E}, K {cfg.K}): {len(launches)} launches")
    total = 0.0
    seen_f2 = False
    for launchable, grid, a, kw, config in launches:
        label, flops = describe(launchable, a, kw, seen_f2)
        seen_f2 = seen_f2 or label == "F2 down-proj"
        ms = replay_ms(launchable, grid, a, kw, config)
        total += ms
        rate = f"{flops / ms / 1e9:6.0f} TF/s" if flops else " " * 11
        line = f"  {label:<24} {ms:8.3f} ms {rate}  {config_str(config)}{out_rate(launchable, a, kw, ms)}"
        for key, value in overrides:
            if key in kw:
                other = replay_ms(launchable, grid, a, kw, config, {key: value})
                line += f" | {key}={value}: {other:.3f} ms ({other / ms:.3f}x)"
        print(line, flush=True)
        if any(label.startswith(p) for p in sweep):
            replay_all(launchable, grid, a, kw, dtype, ms)
    print(f"  sum of the launches      {total:8.3f} ms")
    whole = triton.testing.do_bench(step, warmup=3, rep=200, return_mode="median")
    print(f"  whole step (do_bench)    {whole:8.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="conf4-swiglu", help="comma-separated bench config names or d:h:E:K shapes")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="also replay launches taking constexpr NAME with this integer value (repeatable)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                    help="operand dtype; fp32 runs at --fp32-precision")
    ap.add_argument("--fp32-precision", choices=("highest", "high"), default="high",
                    help="torch.set_float32_matmul_precision for fp32 (high: TF32 tensor cores)")
    ap.add_argument("--tokens", type=int, default=0, help="T of every config (0: the config's own)")
    ap.add_argument("--all-configs", default="", metavar="STEPS",
                    help="comma-separated step-name prefixes (e.g. B2,B4) replayed with every tuned config too")
    args = ap.parse_args()
    torch.set_float32_matmul_precision(args.fp32_precision)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    overrides = [(k, int(v)) for k, v in (s.split("=", 1) for s in args.set)]
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for name in parse_list(args.configs):
        profile_config(name, overrides, dtype, args.tokens, tuple(parse_list(args.all_configs)))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
