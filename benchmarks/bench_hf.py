"""Train a transformers Qwen3-MoE model with three experts implementations: grouped_mm, SonicMoE, moeblaze.

Issue 22's GPU benchmark (and issue 27's benchmark (b) with ``--modes bf16,amp``): a Qwen3-MoE of
4 layers, d 2048, E 128, K 8, h 768 (byte-level vocabulary 256, so the routed experts hold nearly all
parameters) trains for ``--steps`` AdamW steps on the text of ``moeblaze train`` (``moeblaze.training.data``, the
same batches for every implementation, from the same initial weights). Per implementation and mode it
records each step's loss (aux loss included), time (CUDA-synchronised wall clock), peak memory (``--peak``),
the memory resident at its start (weights and optimizer state, no gradients) and, with ``--energy`` where NVML
can be read (``moeblaze.bench.power``), the GPU's energy in the step and its mean SM clock, as CSV rows, and prints a
table: median step time over the steps after ``--warmup``, tokens/s, peak memory, the most a step added
above the resident memory (gradients and activations), the mean loss of the last 10 steps beside
grouped_mm's, and the median joules per step and SM clock.

``moeblaze-input`` is moeblaze with ``save="input"`` (x and the index saved; the pre-activation
recomputed in backward); ``moeblaze-fp8`` moeblaze with its expert GEMMs under the rowwise FP8 recipe
(``moeblaze.fp8``; Hopper).

Modes: ``bf16`` (bf16 weights, AdamW on them) and ``amp`` (fp32 weights under ``torch.autocast(bf16)``).
SonicMoE: transformers' own ``"sonicmoe"`` loads its kernel from the hub; here SonicMoE 0.1.2 installed as
a package (``.peers/install.sh``) is registered as ``"sonicmoe-local"``; skipped when not importable. Its
first step compiles its GEMMs (minutes on an empty QuACK cache: keep QUACK_CACHE_DIR from run to run, as
scripts/quack_cache.sh does).

    python benchmarks/bench_hf.py --out hf_train.csv                       # GPU, the default comparison
    python benchmarks/bench_hf.py --impls sonicmoe-local,moeblaze --rounds 2 --batch-size 32 --out hf.csv  # both orders
    python benchmarks/bench_hf.py --impls grouped_mm,moeblaze --modes bf16,amp --set num_hidden_layers=2 \
        --vocab-size 32000 --batch-size 2 --seq-len 4096 --out hf_amp.csv    # issue 27's model (b)
    python benchmarks/bench_hf.py --smoke --out /tmp/hf_smoke.csv           # CPU, tiny model, 3 steps
    python benchmarks/bench_hf.py --plot-from docs/results-hf.csv --batch-size 32 --plot docs/plots/hf-loss.png

``--peak run`` (default) resets the allocator's peak statistics before each warm-up step and before the first
timed step, then never again, as a training loop that does not reset them: a row's ``peak_mib`` is the peak
since then, and the layers of a step that run away from that peak may use the room below it (moeblaze's
column chunks, ``moeblaze.kernels.chunks.column_chunks``) without raising it. ``--peak step`` resets them
before every step (each row's peak is its own step's; moeblaze's forward then has no room and runs F2 in the
capped chunks). The reported peak, the largest row's, is the same in both for an implementation that never
exceeds an earlier peak.

``--plot`` draws the loss curves (a 10-step moving mean over the raw losses) of this run's implementations, or with
``--plot-from`` those of each implementation's latest run in a CSV at ``--batch-size`` x ``--seq-len`` tokens per
step (the rows of runs made separately, side by side).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import importlib.util
import math
import os
import shlex
import statistics
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations.moe import ExpertsInterface

import moeblaze.integrations.transformers  # noqa: F401  (registers "moeblaze")
from moeblaze.bench.power import EnergyMeter
from moeblaze.bench.results import git_commit
from moeblaze.training.data import get_batch, load_corpus

FULL = dict(hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
            moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
SMOKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
COLUMNS = ["date", "device", "impl", "mode", "step", "tokens", "loss", "step_ms", "peak_mib", "params", "note",
           "resident_mib", "commit", "command", "round", "energy_j", "sm_clock_mhz"]
TAIL = 50  # steps over which the loss gap to grouped_mm is compared with grouped_mm's own step-to-step spread


def sonicmoe_local_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """SonicMoE 0.1.2's ``moe_general_routing_inputs`` as a transformers experts function (SwiGLU, no bias)."""
    from sonicmoe import moe_general_routing_inputs
    from sonicmoe.enums import ActivationType

    if not self.has_gate or self.has_bias or self.is_transposed:
        raise ValueError("sonicmoe-local serves gated, bias-free, non-transposed experts only")
    T, K = top_k_index.shape
    token_idx = torch.arange(T, device=hidden_states.device, dtype=torch.int32).repeat_interleave(K)  # ascending
    x = hidden_states.to(self.gate_up_proj.dtype)
    # [E, 2h, d] -> [2h, d, E] and [E, d, h] -> [d, h, E]: SonicMoE's layout as strided views (no copy);
    # concat_layout: gate rows then up rows, as transformers stores them.
    out, _ = moe_general_routing_inputs(x, top_k_weights.reshape(-1).float(), token_idx,
                                        top_k_index.reshape(-1).int(), self.gate_up_proj.permute(1, 2, 0), None,
                                        self.down_proj.permute(1, 2, 0), None, self.num_experts,
                                        torch.cuda.current_stream().cuda_stream, ActivationType.SWIGLU,
                                        is_inference_mode_enabled=not torch.is_grad_enabled(), concat_layout=True)
    return out.to(hidden_states.dtype)


def sonic_unavailable() -> str | None:
    """Why SonicMoE cannot run here (None: it can)."""
    if not torch.cuda.is_available():
        return "needs CUDA"
    try:
        import sonicmoe  # noqa: F401
    except ImportError as e:
        return f"sonicmoe not importable ({e})"
    return None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--impls", default="grouped_mm,sonicmoe-local,moeblaze")
    p.add_argument("--modes", default="bf16", help="comma list of bf16 (bf16 weights) and amp (fp32 weights "
                   "under bf16 autocast)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the median step time (in each round)")
    p.add_argument("--rounds", type=int, default=1,
                   help="train every implementation this many times, the order of --impls reversed in every other "
                        "round (A B, B A, ...): at its power limit the card's clock drifts with what ran before, so "
                        "step times are compared over rounds that put each implementation first as often")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--optimizer", choices=("fused", "foreach"), default="fused",
                   help="AdamW implementation: fused (one kernel; HF Trainer's default adamw_torch_fused since "
                   "torch 2.8) or foreach")
    p.add_argument("--vocab-size", type=int, default=256, help="embedding rows (the byte data uses 256 of them)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=INT", help="override a config field")
    p.add_argument("--data", help="text file or folder (default: the standard library's .py files)")
    p.add_argument("--out", help="CSV path (rows appended; header written when new)")
    p.add_argument("--commit", help="code version recorded in the rows (default: git's HEAD here, +dirty)")
    p.add_argument("--plot", help="PNG of the loss curves")
    p.add_argument("--plot-from", help="only draw --plot from this CSV (each implementation's latest run at "
                   "--batch-size x --seq-len tokens per step); no training")
    p.add_argument("--smoke", action="store_true", help="tiny model, 3 steps, on the CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--energy", action="store_true",
                   help="record each step's joules and mean SM clock (NVML); its clock-sampling thread lengthens "
                   "the step (277.1 -> 283.8 ms for SonicMoE and moeblaze alike, H200)")
    p.add_argument("--peak", choices=("run", "step"), default="run",
                   help="reset the peak memory statistics once, before the first timed step (run), or every step")
    args = p.parse_args(argv)
    if not args.out and not args.plot_from:
        p.error("--out is required (unless --plot-from)")
    if args.plot_from and not args.plot:
        p.error("--plot-from needs --plot")
    if args.plot:  # before any training: a run's rows must not wait for a plot that cannot be drawn
        if importlib.util.find_spec("matplotlib") is None:
            p.error("--plot needs matplotlib (pip install matplotlib)")
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
            p.error(f"--plot: no folder {os.path.dirname(os.path.abspath(args.plot))}")
    if args.smoke:
        args.steps, args.warmup, args.batch_size, args.seq_len = 3, 1, 2, 32
    return args


def build(args, mode: str, impl: str) -> torch.nn.Module:
    """The model in the mode's weight dtype, identical initial weights for every implementation."""
    fields = {**(SMOKE if args.smoke else FULL), **{k: int(v) for k, v in (s.split("=", 1) for s in args.set)}}
    config = AutoConfig.for_model("qwen3_moe", vocab_size=args.vocab_size,
                                  max_position_embeddings=max(4096, args.seq_len), tie_word_embeddings=False,
                                  output_router_logits=True, **fields)
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    # built and initialised on the GPU: the 2.46B-parameter model's CPU initialisation took ~1 min per implementation
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation=impl)
    return model.train()


def train(args, mode: str, impl: str, train_bytes) -> list[dict]:
    """Rows of one (implementation, mode) run: loss, step time and peak memory per step."""
    model = build(args, mode, impl)
    device = next(model.parameters()).device
    fused = {"fused": True} if args.optimizer == "fused" and device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, **fused)
    params = sum(p.numel() for p in model.parameters())
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    meter = EnergyMeter(torch.cuda.current_device()) if cuda and args.energy and EnergyMeter.available() else None
    rows = []
    for step in range(args.steps):
        x, _ = get_batch(train_bytes, step, args.batch_size, args.seq_len, args.seed)
        x = x.to(device)
        resident = float("nan")
        if cuda:
            torch.cuda.synchronize()
            resident = torch.cuda.memory_allocated() / 2**20  # weights + optimizer state (no gradients)
            if args.peak == "step" or step <= args.warmup:  # --peak run: the running peak from the first timed step
                torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with meter or contextlib.nullcontext():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mode == "amp"):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")
        power = meter.reading if meter else None  # joules and mean SM clock of the step (NVML), nan without
        rows.append(dict(impl=impl, mode=mode, step=step, tokens=x.numel(), loss=loss.item(), step_ms=ms,
                         peak_mib=peak, params=params, note="", resident_mib=resident,
                         energy_j=power.joules if power else math.nan,
                         sm_clock_mhz=power.sm_clock_mhz if power else math.nan))
    del model, opt
    return rows


def _runs(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    runs: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        runs.setdefault((r["impl"], r["mode"]), []).append(r)
    return runs


def _timed(rs: list[dict], warmup: int) -> list[dict]:
    """The rows past each round's first ``warmup`` steps (all of them if none is)."""
    return [r for r in rs if r["step"] >= warmup] or rs


def _first_round(rs: list[dict]) -> list[dict]:
    """The rows of the first round among ``rs``: the loss curve (later rounds repeat it from the same seed)."""
    first = min((r.get("round", 0) for r in rs), default=0)
    return [r for r in rs if r.get("round", 0) == first]


def summary(rows: list[dict], warmup: int) -> list[str]:
    """One printed line per (implementation, mode)."""
    runs = _runs(rows)
    ref = {mode: statistics.mean(r["loss"] for r in _first_round(rs)[-10:] if r["note"] == "")
           for (impl, mode), rs in runs.items() if impl == "grouped_mm" and rs[0]["note"] == ""}
    lines = [f"{'impl':<16}{'mode':<6}{'step ms':>10}{'tokens/s':>12}{'peak MiB':>11}{'above resident':>16}"
             f"{'loss(last10)':>14}{'vs grouped_mm':>15}{'J/step':>9}{'SM MHz':>8}"]
    for (impl, mode), rs in runs.items():
        if rs[0]["note"]:
            lines.append(f"{impl:<16}{mode:<6}  {rs[0]['note']}")
            continue
        timed = _timed(rs, warmup)
        ms = statistics.median(r["step_ms"] for r in timed)
        loss = statistics.mean(r["loss"] for r in _first_round(rs)[-10:])
        gap = f"{loss - ref[mode]:+.4f}" if mode in ref else "-"
        above = max(r["peak_mib"] - r["resident_mib"] for r in _timed(rs, 1))  # past the optimizer state's creation
        joules, clock = (statistics.median(float(r.get("energy_j", math.nan)) for r in timed),
                         statistics.median(float(r.get("sm_clock_mhz", math.nan)) for r in timed))
        lines.append(f"{impl:<16}{mode:<6}{ms:>10.1f}{rs[0]['tokens'] / ms * 1e3:>12,.0f}"
                     f"{max(r['peak_mib'] for r in rs):>11,.0f}{above:>16,.0f}{loss:>14.4f}{gap:>15}"
                     f"{joules:>9.1f}{clock:>8.0f}")
    return lines + comparisons(runs, warmup)


def comparisons(runs: dict[tuple[str, str], list[dict]], warmup: int) -> list[str]:
    """Issue 22's three targets per mode, for the implementations measured: moeblaze's peak as a share of
    grouped_mm's, its step time against SonicMoE's (same run only: the rows passed in), and the mean loss gap
    to grouped_mm over the last ``TAIL`` steps beside grouped_mm's own step-to-step standard deviation there."""
    lines = []
    ok = {k: rs for k, rs in runs.items() if rs[0]["note"] == ""}
    for (impl, mode), rs in ok.items():
        if not impl.startswith("moeblaze"):
            continue
        ref, sonic = ok.get(("grouped_mm", mode)), ok.get(("sonicmoe-local", mode))
        peak = max(r["peak_mib"] for r in rs)
        if ref and math.isfinite(peak):
            lines.append(f"{impl} {mode}: peak {100 * peak / max(r['peak_mib'] for r in ref):.1f}% of grouped_mm's")
        if sonic:
            med = [statistics.median(r["step_ms"] for r in _timed(x, warmup)) for x in (rs, sonic)]
            lines.append(f"{impl} {mode}: step {med[0]:.1f} ms vs SonicMoE {med[1]:.1f} ms ({med[1] / med[0]:.3f}x)")
        rs, ref = _first_round(rs), _first_round(ref) if ref else ref
        n = min(TAIL, len(rs), len(ref)) if ref else 0
        if n >= 2:
            gaps = [a["loss"] - b["loss"] for a, b in zip(rs[-n:], ref[-n:])]
            noise = statistics.stdev(r["loss"] for r in ref[-n:])
            lines.append(f"{impl} {mode}: loss gap to grouped_mm over the last {n} steps {statistics.mean(gaps):+.4f} "
                         f"(grouped_mm's step-to-step std {noise:.4f})")
    return lines


def plot_losses(rows: list[dict], path: str, args: argparse.Namespace) -> None:
    """Loss against step per (implementation, mode): raw losses faint, their 10-step moving mean drawn over them;
    the title names the tokens per step and the rows' devices and dates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (impl, mode), rs in _runs(rows).items():
        rs = _first_round(rs)
        if not rs or rs[0]["note"]:
            continue
        steps, losses = [r["step"] for r in rs], [r["loss"] for r in rs]
        mean = [statistics.mean(losses[max(0, i - 9):i + 1]) for i in range(len(losses))]
        (line,) = ax.plot(steps, mean, label=f"{impl} ({mode})")
        ax.plot(steps, losses, color=line.get_color(), alpha=0.2, linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (LM + aux), nats")
    dates, devices = sorted({r["date"] for r in rows}), ", ".join(sorted({r["device"] for r in rows}))
    ax.set_title(f"transformers Qwen3-MoE, {args.batch_size} x {args.seq_len} tokens per step\n{devices}, "
                 f"{dates[0]}{' to ' + dates[-1] if len(dates) > 1 else ''}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def latest_runs(path: str, tokens: int) -> list[dict]:
    """From a CSV of this script, each (implementation, mode)'s latest run (by date) at ``tokens`` per step, of
    the model (parameter count) of the newest such run: runs of another model at the same tokens never mix in."""
    try:
        with open(path, newline="") as f:
            rows = [r for r in csv.DictReader(f)
                    if r["step"] != "-1" and int(r["tokens"]) == tokens and r.get("round") in ("", "0", None)]
    except OSError as e:
        raise SystemExit(f"--plot-from: cannot read {path}: {e.strerror}") from None
    if not rows:
        raise SystemExit(f"{path}: no rows at {tokens} tokens per step")
    params = max(rows, key=lambda r: r["date"])["params"]
    rows = [r for r in rows if r["params"] == params]
    newest: dict[tuple[str, str], str] = {}
    for r in rows:
        key = (r["impl"], r["mode"])
        newest[key] = max(newest.get(key, ""), r["date"])
    return [dict(r, step=int(r["step"]), loss=float(r["loss"]))
            for r in rows if r["date"] == newest[(r["impl"], r["mode"])]]


def csv_is_new(path: str) -> bool:
    """Whether ``path`` has no rows yet (absent or empty).

    Raises:
        SystemExit: ``path`` holds rows of other columns (an older version of this script's file).
    """
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return True
    with open(path, newline="") as f:
        header = next(csv.reader(f), [])
    if header != COLUMNS:
        raise SystemExit(f"{path}: its columns {header} are not this script's {COLUMNS}; append to another file")
    return False


def append_rows(path: str, rows: list[dict]) -> None:
    """Append ``rows`` to the CSV at ``path`` (the header first when the file is new; see :func:`csv_is_new`)."""
    new = csv_is_new(path)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            w.writeheader()
        w.writerows(rows)


def run_one(args, mode: str, impl: str, rnd: int, train_bytes) -> list[dict]:
    """The rows of one training run (round ``rnd``), or one row saying why it was skipped."""
    why = sonic_unavailable() if impl == "sonicmoe-local" else None
    rows = []
    if why is None:
        try:
            rows = train(args, mode, impl, train_bytes)
        except torch.OutOfMemoryError:
            why = "out of memory"
        except Exception as e:  # recorded, so that one implementation's failure leaves the others' rows
            why = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    if why is not None:
        rows = [dict(impl=impl, mode=mode, step=-1, tokens=0, loss=math.nan, step_ms=math.nan, peak_mib=math.nan,
                     params=0, note=f"skipped: {why}", resident_mib=math.nan)]
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [dict(r, round=rnd) for r in rows]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.plot_from:
        plot_losses(latest_runs(args.plot_from, args.batch_size * args.seq_len), args.plot, args)
        print(f"wrote {args.plot}")
        return
    csv_is_new(args.out)  # an older file's columns stop the run before any training
    ExpertsInterface.register("sonicmoe-local", sonicmoe_local_forward)
    # moeblaze saving only x and the index (the up-projection recomputed in backward): less memory, more compute
    ExpertsInterface.register("moeblaze-input", moeblaze.integrations.transformers.make_experts_forward(save="input"))
    ExpertsInterface.register("moeblaze-fp8", moeblaze.integrations.transformers.make_experts_forward(
        fp8=moeblaze.Float8Recipe("rowwise")))
    corpus = load_corpus(args.data, min_bytes=args.seq_len + 2)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    given = sys.argv[1:] if argv is None else argv
    scope = [] if any(a.startswith("--peak") for a in given) else ["--peak", args.peak]  # rows name the peak's scope
    command = shlex.join(["python3", "benchmarks/bench_hf.py", *given, *scope])
    stamp = {"date": date, "device": device, "commit": args.commit or git_commit(), "command": command}
    print(f"{device}, torch {torch.__version__}, {args.batch_size} x {args.seq_len} tokens per step, {args.steps} "
          f"steps, {' '.join(sys.argv[1:])}")
    rows = []
    for mode in args.modes.split(","):
        for rnd in range(args.rounds):
            impls = args.impls.split(",")
            for impl in impls[::-1] if rnd % 2 else impls:
                run = run_one(args, mode, impl, rnd, corpus.train)
                rows += run
                print(summary(run, args.warmup)[1], flush=True)
                append_rows(args.out, [{**stamp, **r} for r in run])  # a cut run keeps these
    print("\n".join(summary(rows, args.warmup)))
    if args.plot:
        plot_losses([{**stamp, **r} for r in rows], args.plot, args)
    print(f"rows appended to {args.out}")


if __name__ == "__main__":
    main()
