"""Model-shaped step times and host overhead of MoE layers (issue 24): L layers of RMSNorm + MoE + residual.

Per (shape, T, L, implementation, eager | graph): the step time (forward + backward, CUDA events, median),
the host time (``perf_counter`` around the step with no synchronisation: the Python + launch work that
queues it), the peak memory of a step, and the time per token. ``graph`` captures the whole step with
``torch.cuda.graph`` after two eager warm-up steps and times its replay.

``--mode cpu`` (no GPU): the Triton backend runs under ``TRITON_INTERPRET=1`` with every kernel launch
stubbed to a no-op (the dispatch build's outputs zeroed so later indexing stays in range), so what is timed
is the Python host path itself — validation, index plumbing, launch metadata, autograd and the router's
PyTorch ops (on CPU tensors: use a small T so their arithmetic stays negligible). ``--profile N`` prints
cProfile's top N functions of the timed steps.

Commands::

    # host path on the CPU (no GPU): µs per layer step at E 8 and 128
    python3 benchmarks/bench_host.py --mode cpu --shapes qwen3-30b-a3b,olmoe-1b-7b --tokens 64 --profile 25
    # the sweep of issue 24 on a GPU, appended to docs/results-stack.csv, plot in docs/plots/
    python3 benchmarks/bench_host.py --shapes qwen3-30b-a3b,olmoe-1b-7b --stack 8 \\
        --tokens 2048,4096,8192,16384,32768 --impls moeblaze,conventional,sonicmoe --graph \\
        --csv docs/results-stack.csv --plot docs/plots/stack-time-per-token.png
    # host µs per call of the parts of a layer step (a queued launch, an ATen op, the router, the dispatch
    # build, the forward, the step) on the GPU: where the host time goes without a profiler's overhead
    python3 benchmarks/bench_host.py --parts --shapes qwen3-30b-a3b --tokens 512
    # the plot again from the file (per shape, the rows of its latest run: one device, one code version)
    python3 benchmarks/bench_host.py --plot-from docs/results-stack.csv --plot docs/plots/stack-time-per-token.png
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

COLUMNS = ["date", "time_utc", "device", "commit", "torch", "triton", "command", "shape", "T", "d", "h", "E", "K",
           "layers", "impl", "mode", "status", "step_ms", "host_ms", "host_us_per_layer", "us_per_token",
           "peak_mib", "note"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--shapes", default="qwen3-30b-a3b", help="bench config names (moeblaze.bench.configs)")
    p.add_argument("--tokens", default="4096", help="T values, comma-separated")
    p.add_argument("--stack", default="1", help="layer counts L, comma-separated (deepseek-v3: 1 is used)")
    p.add_argument("--impls", default="moeblaze", help="implementations (moeblaze.bench.baselines.IMPLS)")
    p.add_argument("--aux", type=float, default=0.01, help="moeblaze's aux_loss_coef (z-loss: a tenth of it)")
    p.add_argument("--graph", action="store_true", help="also time the CUDA-graph replay of the step")
    p.add_argument("--launch", default="direct",
                   help="Triton launch paths, comma-separated: direct (moeblaze.kernels.direct, the default path), "
                        "triton (kernel[grid] every launch); rows of the second have mode eager-triton-launch")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--parts", action="store_true",
                   help="host µs per call of the parts of one layer step (with --mode cpu: the stubbed path; "
                        "CUDA-only GEMMs print nan)")
    p.add_argument("--profile", type=int, default=0, help="print cProfile's top N functions of the steps")
    p.add_argument("--cpu-dims", type=int, default=64,
                   help="--mode cpu: d and h of every shape (the host path does not depend on them; E and K kept)")
    p.add_argument("--sort", default="tottime", help="cProfile sort key (tottime, cumulative)")
    p.add_argument("--csv", help="append rows to this CSV")
    p.add_argument("--commit", help="code version recorded in the rows (default: git's HEAD here, +dirty; a copy of "
                                    "the checkout may hold an older HEAD than its files)")
    p.add_argument("--plot", help="draw time per token against T into this PNG")
    p.add_argument("--plot-from", help="only draw --plot from the rows of this CSV (no measurement)")
    return p.parse_args(argv)


ARGS = parse_args(sys.argv[1:])
if ARGS.mode == "cpu":  # Triton reads it when the kernels are decorated: before moeblaze imports them
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from moeblaze import MoE, aux_loss, detach_aux_losses, settings  # noqa: E402
from moeblaze.bench.baselines import ImplOptions, make_weights, resolve_impl, step_params  # noqa: E402
from moeblaze.bench.configs import get_configs, parse_list  # noqa: E402
from moeblaze.bench.results import git_commit  # noqa: E402
from moeblaze.kernels import direct  # noqa: E402

TRITON_LAUNCH_ONLY = direct._hooked


def stub_launches() -> None:
    """Make every interpreted Triton launch a no-op (``--mode cpu``); the dispatch build's outputs are zeroed."""
    from triton.runtime.interpreter import InterpretedFunction

    def run(self, *args, **kwargs):
        if self.fn.__name__ == "_write_kernel":  # offsets, indices, index map: slot 0 everywhere, in range
            for name in ("offsets_ptr", "indices_ptr", "map_ptr"):  # launched by keyword
                kwargs[name].zero_()

    InterpretedFunction.run = run
    from moeblaze import dispatch

    # the CUDA path of the build (the Triton launcher), which a CPU tensor would not take
    dispatch._triton_serves = lambda ids, num_buckets: True


class Stack(nn.Module):
    """``L`` blocks ``x = x + layer_i(RMSNorm_i(x))`` of one MoE implementation."""

    def __init__(self, layers: list, d: int, device, dtype) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.RMSNorm(d, device=device, dtype=dtype) for _ in layers)
        self.layers = layers
        self.mods = nn.ModuleList(m for m in layers if isinstance(m, nn.Module))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, layer in zip(self.norms, self.layers):
            x = x + layer(norm(x))
        return x


def build_stack(impl_name: str, cfg, layers: int, device, dtype) -> tuple[Stack, list[torch.Tensor]]:
    impl = resolve_impl(impl_name)
    fns, params = [], []
    for i in range(layers):
        w = make_weights(cfg, device=device, dtype=dtype, seed=i)
        fn = impl.build(cfg, w, ImplOptions())
        if isinstance(fn, MoE):
            fn.router.aux_loss_coef, fn.router.z_loss_coef = ARGS.aux, ARGS.aux / 10
        fns.append(fn)
        params += step_params(fn, w)
    stack = Stack(fns, cfg.d, device, dtype)
    return stack, params + list(stack.norms.parameters())


def make_step(stack: Stack, params: list[torch.Tensor], x: torch.Tensor, dout: torch.Tensor):
    moe_layers = any(isinstance(m, MoE) for m in stack.layers)

    def step() -> None:
        for p in (*params, x):
            p.grad = None
        out = stack(x)
        if moe_layers and ARGS.aux:
            torch.autograd.backward([out, aux_loss(stack)], [dout, None])
        else:
            out.backward(dout)

    return step


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def host_ms(step, steps: int, device) -> list[float]:
    """``perf_counter`` per step, no synchronisation inside: the time to queue the step's work (the queue is
    drained before each step, so a GPU-bound step does not block the launches on a full queue). On the CPU
    (stubbed launches, one intra-op thread) the thread's CPU time instead: a shared machine's other load does
    not count."""
    clock = time.perf_counter if device.type == "cuda" else time.thread_time
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = clock()
        step()
        times.append((clock() - t0) * 1e3)
    _sync(device)
    return times


def device_ms(run, steps: int, device) -> float:
    if device.type != "cuda":
        return statistics.median(host_ms(run, steps, device))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def capture(step, stack: Stack):
    detach_aux_losses(stack)  # the eager steps' graph, whose accumulators are bound to the default stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def measure(impl_name: str, cfg, layers: int, device, dtype) -> list[dict]:
    base = {"shape": cfg.name, "T": cfg.T, "d": cfg.d, "h": cfg.h, "E": cfg.E, "K": cfg.K, "layers": layers,
            "impl": impl_name}
    torch.manual_seed(0)
    x = torch.randn(cfg.T, cfg.d, device=device, dtype=dtype, requires_grad=True)
    dout = torch.randn(cfg.T, cfg.d, device=device, dtype=dtype)
    stack, params = build_stack(impl_name, cfg, layers, device, dtype)
    step = make_step(stack, params, x, dout)
    step()
    step()
    _sync(device)
    if ARGS.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(lambda: [step() for _ in range(ARGS.steps)])
        pstats.Stats(prof).sort_stats(ARGS.sort).print_stats(ARGS.profile)
    host = statistics.median(host_ms(step, ARGS.steps, device))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ms = device_ms(step, ARGS.steps, device)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    rows = [{**base, "mode": "eager", "status": "ok", "step_ms": ms, "host_ms": host,
             "host_us_per_layer": host * 1e3 / layers, "us_per_token": ms * 1e3 / cfg.T, "peak_mib": peak,
             "note": f"{direct.direct_signatures()} direct launch signatures"}]
    if ARGS.graph and device.type == "cuda":
        try:
            replay = capture(step, stack)
            gms = device_ms(replay, ARGS.steps, device)
            rows.append({**base, "mode": "graph", "status": "ok", "step_ms": gms,
                         "host_ms": statistics.median(host_ms(replay, ARGS.steps, device)),
                         "us_per_token": gms * 1e3 / cfg.T, "note": f"eager/graph {ms / gms:.3f}"})
        except Exception as exc:  # a peer that cannot be captured: the row says why
            note = " ".join(f"{type(exc).__name__}: {exc}".split())[:160]  # one line: a CSV cell
            rows.append({**base, "mode": "graph", "status": "error", "note": note})
    return rows


def parts(cfg, device, dtype) -> list[tuple[str, float]]:
    """Host µs per call of each part of an eager ``moeblaze.MoE`` step (``--parts``): 100 invocations queued back to
    back, then one synchronisation, median of 5 such runs. At a small T the GPU keeps up with every part but the
    whole step's weight reads, so the figure is the host's: Python, autograd and the kernel launches."""
    import triton
    import triton.language as tl

    from moeblaze import build_dispatch
    from moeblaze.kernels.router import split16

    @triton.jit
    def _one(x_ptr):  # a kernel of one store: the cost of a queued Triton launch
        tl.store(x_ptr, 1.0)

    moe = build_stack("moeblaze", cfg, 1, device, dtype)[0].layers[0]
    x = torch.randn(cfg.T, cfg.d, device=device, dtype=dtype, requires_grad=True)
    dout = torch.randn_like(x)
    small = torch.zeros(16, device=device)
    with torch.no_grad():
        ids = moe.router(x).topk_ids
    xd, wt = x.detach(), moe.router.weight.detach().t()
    logits = xd.float() @ wt.float()  # [T, E] fp32, as the router's dlogits
    hl = split16(logits, dtype)  # [T, 2E]
    from moeblaze.kernels.grouped_gemm import grouped_gemm_kernel as gemm  # a 51-argument launch's key

    plan = direct._Plan(gemm)
    gemm_args = [] if plan.interpreted else [1 if p.is_constexpr else small if p.name.endswith("_ptr") else 1234
                                             for p in gemm.params]
    gemm_kw = {**dict(zip(plan.names, gemm_args)), "num_warps": 8, "num_stages": 3}

    def router_step():
        r = moe.router(x)
        torch.autograd.backward([r.topk_weights, r.loss], [torch.ones_like(r.topk_weights), None])

    def layer_step():
        torch.autograd.backward([moe(x), moe.aux_loss], [dout, None])

    def single_thread(fn):  # the backward on this thread instead of autograd's CUDA device thread
        def run():
            with torch.autograd.set_multithreading_enabled(False):
                fn()
        return run

    def no_grad(fn=moe):
        with torch.no_grad():
            fn(x)

    cases = [("triton launch (direct, one store)", lambda: direct.launch(_one, (1,), x_ptr=small)),
             ("moeblaze.settings.get (an environment variable's look-up)", lambda: settings.get("check_ids")),
             ("aten add_ (16 floats)", lambda: small.add_(1.0)),
             ("torch.empty (1 MiB)", lambda: torch.empty(2**18, device=device)),
             ("mm [T, d] x [d, E] bf16 -> fp32 (out_dtype=)", lambda: torch.mm(xd, wt, out_dtype=torch.float32)),
             ("mm [T, d] x [d, E] bf16 -> bf16", lambda: torch.mm(xd, wt)),
             ("mm fp32 of the casts (x.float() @ w.float().t())", lambda: xd.float() @ wt.float()),
             ("mm [2E, T] x [T, d] bf16 -> fp32, A transposed (the router's dW)",
              lambda: torch.mm(hl.t(), xd, out_dtype=torch.float32)),
             ("mm [2E, T] x [T, d] bf16 -> fp32, A made contiguous first",
              lambda: torch.mm(hl.t().contiguous(), xd, out_dtype=torch.float32)),
             ("split of fp32 dlogits into [hi | lo] bf16 (the router's backward, one launch)",
              lambda: split16(logits, dtype)),
             ("router forward (no grad)", lambda: no_grad(moe.router)),
             ("router forward + backward", router_step),
             ("dispatch build (validate=False)", lambda: build_dispatch(ids, cfg.E, validate=False)),
             ("layer forward (no grad)", no_grad),
             ("layer forward + backward", layer_step),
             ("router forward + backward, autograd multithreading off", single_thread(router_step)),
             ("layer forward + backward, autograd multithreading off", single_thread(layer_step))]
    if gemm_args:  # a jitted kernel (the interpreter's has no parameter list)
        cases.insert(1, ("direct launch's key of the grouped GEMM's 51 arguments (no launch)",
                         lambda: direct._fast_key(plan, gemm_args, gemm_kw, 0, len(gemm_args))))
    out = []
    for name, fn in cases:
        try:
            fn(), fn()
        except (RuntimeError, NotImplementedError) as exc:  # e.g. out_dtype= on the CPU
            out.append((f"{name}: {type(exc).__name__}", float("nan")))
            continue
        out.append((name, _host_us(fn, device)))
        x.grad = None
    return out


def _host_us(fn, device) -> float:
    """µs per invocation of ``fn``: 100 invocations queued back to back, then one synchronisation, median of 5 such
    runs."""
    _sync(device)
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(100):
            fn()
        _sync(device)
        runs.append((time.perf_counter() - t0) * 1e4)  # µs per call: 1e6 / 100
    return statistics.median(runs)


def environment(device) -> dict:
    import triton

    now = time.gmtime()
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, launches stubbed ({os.cpu_count()} cores)"
    return {"date": time.strftime("%Y-%m-%d", now), "time_utc": time.strftime("%H:%M", now), "device": name,
            "commit": ARGS.commit or git_commit(Path(__file__).parent), "torch": torch.__version__,
            "triton": triton.__version__,
            "command": " ".join([*(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MOEBLAZE_")),
                                 "python3", *sys.argv])}


def append_csv(path: str, rows: list[dict]) -> None:
    new = not Path(path).exists() or Path(path).stat().st_size == 0
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerows({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows)


def latest_run(rows: list[dict]) -> list[dict]:
    """The rows of one run in ``rows`` (one ``date``, ``time_utc``, ``device`` and ``commit``): a file that several
    runs appended to holds other devices and code versions, whose points must not share a line. The latest of the
    runs with the most token counts: an A/B at two token counts appended after a sweep does not replace it."""
    runs: dict[tuple, list[dict]] = {}
    for r in rows:
        runs.setdefault(tuple(r.get(k, "") for k in ("date", "time_utc", "device", "commit")), []).append(r)
    return runs[max(runs, key=lambda run: (len({r["T"] for r in runs[run]}), run))]


def plot(path: str, rows: list[dict]) -> None:
    """µs per token against T, one panel per shape drawn from that shape's latest sweep (:func:`latest_run`; titled
    with its device, date and code version)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        run = latest_run([r for r in rows if r["shape"] == shape])
        for impl, mode, layers in sorted({(r["impl"], r["mode"], r["layers"]) for r in run}):
            pts = sorted((r["T"], r["us_per_token"]) for r in run
                         if (r["impl"], r["mode"], r["layers"]) == (impl, mode, layers) and r["status"] == "ok")
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{impl} {mode} L={layers}")
        first = run[0]
        fixed = " (moeblaze: fixed configs)" if "MOEBLAZE_AUTOTUNE=0" in first.get("command", "") else ""
        ax.set(xscale="log", xlabel="tokens per GPU (T)", ylabel="µs per token (step)")
        ax.set_title(f"{shape}\n{first.get('device', '')}, {first.get('date', '')} {first.get('time_utc', '')}, "
                     f"code {first.get('commit', '')}{fixed}", fontsize=8)
        ticks = sorted({r["T"] for r in run})
        ax.set_xticks(ticks, [f"{t / 1024:g}k" for t in ticks])
        ax.minorticks_off()
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def read_rows(path: str) -> list[dict]:
    """Rows of a CSV this script appended to, with the numbers the plot needs parsed."""
    with open(path, newline="") as f:
        return [dict(r, T=int(r["T"]), layers=int(r["layers"]), us_per_token=float(r["us_per_token"] or "nan"))
                for r in csv.DictReader(f)]


def shape_at(cfg, T: int):
    """``cfg`` at ``T`` tokens; under ``--mode cpu`` with d = h = ``--cpu-dims`` (E and K kept)."""
    cfg = replace(cfg, T=T)
    return replace(cfg, d=ARGS.cpu_dims, h=ARGS.cpu_dims) if ARGS.mode == "cpu" else cfg


def main() -> None:
    if ARGS.plot_from:
        plot(ARGS.plot, read_rows(ARGS.plot_from))
        return
    device = torch.device(ARGS.mode)
    if ARGS.mode == "cpu":
        stub_launches()
        settings.configure(autotune=False)
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        sys.exit("bench_host: --mode cuda needs a GPU (use --mode cpu for the host path alone)")
    dtype = torch.bfloat16 if ARGS.mode == "cuda" else torch.float16
    env, rows = environment(device), []
    if ARGS.parts:
        for cfg0 in get_configs(None, parse_list(ARGS.shapes)):
            for T in (int(t) for t in ARGS.tokens.split(",")):
                print(f"{cfg0.name} T {T}: host µs per call ({env['device']})")
                for name, us in parts(shape_at(cfg0, T), device, dtype):
                    print(f"  {us:9.1f}  {name}", flush=True)
        return
    for cfg0 in get_configs(None, parse_list(ARGS.shapes)):
        for T in (int(t) for t in ARGS.tokens.split(",")):
            stacks = [1] if cfg0.name.startswith("deepseek") else sorted({int(s) for s in ARGS.stack.split(",")})
            for layers in stacks:
                for impl, launch in [(i, a) for i in parse_list(ARGS.impls) for a in parse_list(ARGS.launch)
                                     if a == "direct" or i.startswith("moeblaze")]:
                    try:
                        cfg = shape_at(cfg0, T)
                        direct._hooked = TRITON_LAUNCH_ONLY if launch == "direct" else lambda: True
                        got = measure(impl, cfg, layers, device, dtype)
                    except Exception as exc:  # OOM or an implementation failing on a shape: keep going
                        got = [{"shape": cfg0.name, "T": T, "layers": layers, "impl": impl, "mode": "eager",
                                "status": "error", "note": f"{type(exc).__name__}: {exc}"[:160]}]
                    if launch != "direct":
                        for r in got:
                            r["mode"] = f"{r['mode']}-triton-launch"
                            if r["mode"] == "eager-triton-launch" and r["status"] == "ok":
                                r["note"] = "every Triton kernel launched through kernel[grid]"
                    for r in got:
                        r.update(env)
                        print(" ".join(f"{k}={r[k]:.4g}" if isinstance(r.get(k), float) else f"{k}={r.get(k)}"
                                       for k in COLUMNS[7:] if r.get(k) is not None), flush=True)
                    rows += got
                    if ARGS.csv:  # row by row: a run cut short by a time limit keeps what it measured
                        append_csv(ARGS.csv, got)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    if ARGS.plot:
        plot(ARGS.plot, rows)


if __name__ == "__main__":
    main()
