"""``moeblaze train``: the loop that trains the byte-level MoE transformer of :mod:`moeblaze.training.model` on real
text.

Read top to bottom: the checks before anything is built, :func:`train` (the job of one process or of torchrun's
ranks) and :func:`_train` (data, model, optimizer, resume), then :func:`_loop` — AdamW, warmup + cosine learning
rate, evaluation, a metrics row per step, checkpoints — and :class:`_Run`, what it accumulates. Around it: the
configuration, device set-up and learning-rate schedule (:mod:`moeblaze.training.train_config`), one optimizer step
(:mod:`moeblaze.training.step`), the run folder and its checkpoints (:mod:`moeblaze.training.resume`), evaluation and
``moeblaze sample`` (:mod:`moeblaze.training.evaluate`); their public names are importable from here too.

Reproducibility: the batch of step ``s`` comes from a generator seeded by ``(seed, s)``
(:func:`moeblaze.training.data.get_batch`), and a checkpoint (:mod:`moeblaze.training.checkpoint`, written
atomically) holds the weights and the AdamW state (``torch.distributed.checkpoint``), the step and the RNG state
(JSON). So ``--steps 2N`` equals ``--steps 2N --stop-after N`` followed by ``--steps 2N --resume``,
bitwise on CPU, on GPUs with ``--deterministic`` (:mod:`moeblaze.training.determinism`) — also when the first run was
stopped by SIGTERM/Ctrl-C, killed, or lost a rank (from its last checkpoint).
"""

from __future__ import annotations

import math
import signal
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm import tqdm

from .. import settings
from ..backends import get_backend, triton_available
from ..fp8 import check_fp8_backend
from ..memory import SavedTensorCounter
from ..parallel.breakdown import StepBreakdown, StepProfiler, append_rows, gather, summary
from ..parallel.runtime import agree_kernels
from . import checkpoint
from .data import DataError, get_batch, load_corpus, unigram_entropy
from .determinism import deterministic_mode
from .evaluate import evaluate, sample
from .job import Job, check_same_config, start_job
from .metrics_log import MetricsLog, check_logger, val_at
from .model import ModelConfig, MoETransformer
from .resume import already_finished, layout_words, load_checkpoint, load_run_config, prepare_out_dir, save_checkpoint
from .step import NonFiniteLossError, StepOutcome, train_step
from .train_config import (
    MIXED,
    ConfigError,
    TrainConfig,
    TrainResult,
    fp8_recipe,
    gpu_peak_flops,
    lr_at,
    make_optimizer,
    resolve_device,
    resolve_precision,
    set_threads,
)

# ``sample`` and ``load_run_config`` (and ``train_step``, ``evaluate``, ``load_checkpoint``, ... used here) stay
# importable from here; the tests patch ``train_step`` and ``_loop`` on this module, where the loop looks them up
__all__ = ["ConfigError", "NonFiniteLossError", "TrainConfig", "TrainResult", "load_run_config", "sample",
           "train"]


def _unit(device: torch.device) -> str:
    return "GPU" if device.type == "cuda" else "process"


def _describe(total: int, mcfg: ModelConfig, cfg: TrainConfig, device, precision, threads, job: Job) -> str:
    where = (f"; {job.world} processes, FSDP2" + (f" + expert parallelism over {job.ep}" if job.ep > 1 else "")
             + f", {cfg.batch_size // job.world} sequences per rank") if job.distributed else ""
    warmup = (f" (--warmup-steps {cfg.warmup_steps} > --steps {cfg.steps}: never reached)"
              if cfg.warmup_steps > cfg.steps else "")
    return (f"model: {mcfg.n_layers} layers, d={mcfg.d_model}, heads={mcfg.n_heads}, E={mcfg.num_experts}, "
            f"K={mcfg.top_k}, h={mcfg.d_ff}, seq={mcfg.seq_len}; {total / 1e6:.2f}M parameters, "
            f"{mcfg.active_params_per_token() / 1e6:.2f}M active per token\n"
            f"run: {cfg.steps} steps x {cfg.batch_size * mcfg.seq_len} tokens, lr {cfg.lr:g}{warmup}, "
            f"device {device}, precision {precision}, {threads} threads{where}"
            + ("; blocks compiled (torch.compile)" if cfg.compile else "") + f"; out-dir {cfg.out_dir}")


def _check_backend(mcfg: ModelConfig, device: torch.device, precision: str) -> None:
    """The experts' backend runs on ``device``, and the FP8 recipe of ``precision`` on it (:func:`_check_fp8`)."""
    if mcfg.backend == "triton" and not triton_available():
        raise ConfigError("--backend triton needs triton, and its kernels do not import here (pip install "
                          "'moeblaze[gpu]'; CUDA builds of torch bring triton); use --backend torch or auto")
    if mcfg.backend == "triton" and device.type != "cuda" and not settings.interpreting():
        raise ConfigError(f"--backend triton needs a CUDA device (--device is {device}); use --backend torch "
                          "or auto, or set TRITON_INTERPRET=1 to run the kernels in Triton's (slow) CPU interpreter")
    _check_fp8(precision, mcfg, device)


def _check_exchange(cfg: TrainConfig, device: torch.device) -> None:
    if cfg.ep_exchange == "nvshmem" and device.type != "cuda":
        raise ConfigError(f"--ep-exchange nvshmem moves rows through CUDA symmetric memory (--device is {device}); "
                          "use padded or all_to_all")


def _check_fp8(precision: str, mcfg: ModelConfig, device: torch.device) -> None:
    """``fp8-mixed`` only where the experts' backend runs the recipe (a Hopper GPU on the Triton backend, its
    emulation on ``--backend torch``), said before anything is built rather than at the first forward."""
    recipe = fp8_recipe(precision)
    if recipe is None:
        return
    try:
        # fp32: the backend the experts' dtype would choose on this device, without the interpreter's bf16 refusal
        backend = get_backend(mcfg.backend, torch.empty(0, device=device)).name
        check_fp8_backend(backend, torch.bfloat16, device, recipe)
        get_backend(mcfg.backend, torch.empty(0, dtype=torch.bfloat16, device=device))  # bf16 autocast runs there
    except (ValueError, NotImplementedError) as err:
        raise ConfigError(f"--precision fp8-mixed with --backend {mcfg.backend}: {err}") from None


def train(cfg: TrainConfig, model_cfg: ModelConfig | None = None, log=tqdm.write) -> TrainResult:
    """Train a :class:`MoETransformer` as configured; checkpoint to ``cfg.out_dir``.

    Before anything is built, the device, backend and ``--out-dir`` are checked (created, written to, and
    refused when it holds an earlier run's checkpoint unless ``cfg.resume`` or ``cfg.overwrite``).
    Checkpoints (:mod:`moeblaze.training.checkpoint`) are written every ``checkpoint_interval`` steps, every
    ``checkpoint_minutes``, at the end, and after the step during which SIGINT/SIGTERM arrived (then the
    run stops with ``result.status`` "SIGINT"/"SIGTERM").

    Args:
        cfg: the run. With ``cfg.resume`` the newest complete checkpoint in ``cfg.out_dir`` is continued; its
            model configuration is used when ``model_cfg`` is None and must equal ``model_cfg`` otherwise.
        model_cfg: the model sizes (default :class:`ModelConfig`).
        log: where progress lines go (``tqdm.write`` by default: stdout, without breaking the bar).

    Returns:
        A :class:`TrainResult` (final validation bits per byte, throughput, bytes saved, status, ...).

    Under torchrun, ``cfg.fsdp`` (and ``cfg.ep``) make this process one rank of an FSDP2 (+ expert-parallel)
    job (:mod:`moeblaze.training.job`): every rank runs :func:`train` with the same configuration; rank 0
    logs; the process group is destroyed at the end. A lost rank ends the process (exit status 3) with one line
    (:mod:`moeblaze.training.heartbeat`). ``cfg.deterministic``: inside
    :func:`moeblaze.training.determinism.deterministic_mode`.

    Raises:
        ConfigError: bad device/precision/backend or out_dir, nothing to resume, resume with a different model, a
            ``--logger`` whose package is missing;
            ``--fsdp`` outside torchrun, several processes without it, ``--ep`` not dividing the world size, a
            batch not divisible by it, ranks started with different configurations (raised on every rank).
        moeblaze.training.data.DataError: missing or unusable data.
        moeblaze.training.checkpoint.CheckpointError: the checkpoint to resume cannot be loaded, or one cannot be
            written.
        NonFiniteLossError: a non-finite loss; nothing is written, the last checkpoint stays as it was.
    """
    device = resolve_device(cfg.device)
    if settings.get("deterministic") and not cfg.deterministic:  # MOEBLAZE_DETERMINISTIC=1: recorded as the flag
        cfg = replace(cfg, deterministic=True)
    with deterministic_mode(cfg.deterministic):  # before the process group: NCCL reads its variables there
        try:
            job = start_job(cfg.fsdp, cfg.ep, device, cfg.batch_size, cfg.dist_timeout,
                            advice=f"; continue with `moeblaze train --resume --out-dir {cfg.out_dir}` (from its "
                                   "newest complete checkpoint)")
        except ValueError as err:
            raise ConfigError(str(err)) from None
        finished = False
        try:
            try:
                check_same_config(job, train_config=asdict(cfg),
                                  model_config=asdict(model_cfg) if model_cfg is not None else {})
            except ValueError as err:
                raise ConfigError(str(err)) from None
            if cfg.batch_size // job.world % cfg.grad_accum:
                raise ConfigError(f"--grad-accum {cfg.grad_accum} must divide each rank's {cfg.batch_size // job.world}"
                                  f" sequences (--batch-size {cfg.batch_size} over {job.world} ranks)")
            result = _train(cfg, model_cfg, log if job.rank0 else (lambda *a, **k: None), job)
            finished = True
            return result
        except _RAISED_ALIKE:
            finished = True
            raise
        except Exception:
            job.check_peers()  # a collective failed: a dead peer ends this process here, named
            raise
        finally:
            job.close(finished)


# Errors every rank raises alike (checked or agreed on every rank): the others are not lost.
_RAISED_ALIKE = (ConfigError, DataError, checkpoint.CheckpointError, NonFiniteLossError)


def _train(cfg: TrainConfig, model_cfg: ModelConfig | None, log, job: Job) -> TrainResult:
    """:func:`train` inside its job (one process, or a rank of torchrun's)."""
    device = job.env.device if job.distributed else resolve_device(cfg.device)
    precision, dtype, amp_dtype = resolve_precision(cfg.precision, device)
    if job.mesh is not None and precision in MIXED:
        amp_dtype = None  # FSDP2's MixedPrecisionPolicy casts the parameters to bf16 instead of autocast
    cfg = replace(cfg, progress=cfg.progress if job.rank0 else False)  # progress None: a bar on a terminal only
    _check_exchange(cfg, device)
    if model_cfg is not None:
        _check_backend(model_cfg, device, precision)
    check_logger(cfg.logger)  # on every rank: a missing package fails them all before anything is built
    resume_from, finished = prepare_out_dir(cfg, log), False
    if resume_from is not None:
        state = checkpoint.read_state(resume_from, check=False)  # verified by prepare_out_dir
        saved_mcfg, saved_step = ModelConfig(**state["model_config"]), int(state["step"])
        model_cfg = model_cfg or saved_mcfg
        if saved_step >= cfg.steps:
            val = val_at(cfg.out_dir, saved_step)  # the final evaluation; none when a signal stopped the last step
            if val is not None:
                return already_finished(cfg, resume_from, saved_step, val, "metrics.csv", log)
            finished = True  # evaluated below, once the checkpoint is loaded
        elif 0 < cfg.stop_after <= saved_step:
            log(f"the checkpoint {resume_from.name} in {cfg.out_dir} is at step {saved_step}, at or past --stop-after "
                f"{cfg.stop_after}; nothing to do (pass a larger --stop-after, or none, to train on)")
            return TrainResult(saved_step, float("nan"), float("nan"), float("nan"), 0.0, 0, [],
                               status="done", checkpoint=str(resume_from))
    mcfg = model_cfg or ModelConfig()
    _check_backend(mcfg, device, precision)
    threads = set_threads(cfg, device)
    if job.distributed and device.type == "cpu" and not cfg.threads:  # the node's cores shared by its ranks
        threads = max(1, threads // int(settings.launcher_env().get("LOCAL_WORLD_SIZE", job.world)))
        torch.set_num_threads(threads)

    t_load = time.perf_counter()
    corpus = load_corpus(cfg.data, cfg.val_fraction, min_bytes=max(1024, mcfg.seq_len + 2))
    entropy = unigram_entropy(corpus.val)
    log(f"data: {corpus.source}; {len(corpus.train):,} train / {len(corpus.val):,} validation bytes "
        f"(loaded in {time.perf_counter() - t_load:.1f} s)")
    log(f"baseline: order-0 (unigram) entropy of the validation bytes = {entropy:.3f} bits/byte")

    torch.manual_seed(cfg.seed)  # every rank builds the same full model; sharding keeps each rank's part
    with torch.device(device):  # drawn where it trains: on CUDA the host does not draw every rank's copy first
        model = MoETransformer(mcfg).to(dtype=dtype)
    model.set_fp8(fp8_recipe(precision))
    total_params = sum(p.numel() for p in model.parameters())
    # every rank's MoE layers see at most its rows of a batch (training and evaluation): the exchanges' bound
    max_tokens = cfg.batch_size // job.world * mcfg.seq_len
    model = job.shard(model, precision, cfg.fsdp_reshard, cfg.fsdp_reduce_dtype, cfg.ep_exchange, cfg.fsdp_prefetch,
                      max_tokens, cfg.fsdp_blocks_per_unit)
    if cfg.compile:
        model.compile_blocks()
    opt = make_optimizer(model, cfg)
    start = load_checkpoint(resume_from, model, opt, device, job, log) if resume_from is not None else 0
    if finished:
        return already_finished(cfg, resume_from, start, evaluate(model, corpus.val, cfg, device, amp_dtype, job),
                                 "evaluated now", log, entropy)
    stop = min(cfg.steps, cfg.stop_after) if cfg.stop_after > 0 else cfg.steps
    log(_describe(total_params, mcfg, cfg, device, precision, threads, job)
        + (f"; resuming at step {start} from {resume_from}" if resume_from is not None else ""))
    metrics = MetricsLog(cfg.out_dir, start if resume_from is not None else None, log, enabled=job.rank0,
                         logger=cfg.logger, config=asdict(cfg) | asdict(mcfg))
    with checkpoint.StopOnSignal() as signals:
        try:
            run = _loop(model, opt, corpus, cfg, mcfg, device, precision, amp_dtype, start, stop, signals, log, job,
                        metrics)
        except _RAISED_ALIKE:
            raise
        except Exception:  # with the handlers still in place: torchrun's SIGTERM must not end this rank unheard
            job.check_peers()
            raise
        finally:
            metrics.close()
    val_bpb, losses, saved, tok_s, mfu, status, ckpt = run
    if status != "done":
        return TrainResult(start + len(losses), val_bpb, entropy, losses[-1] if losses else float("nan"), tok_s,
                           saved, losses, mfu, status, ckpt, job.world)
    _report_done(cfg, mcfg, stop, run, entropy, device, precision, job, log)
    return TrainResult(stop, val_bpb, entropy, losses[-1] if losses else float("nan"), tok_s, saved, losses, mfu,
                       status, ckpt, job.world)


def _report_done(cfg: TrainConfig, mcfg: ModelConfig, stop: int, run, entropy: float, device: torch.device,
                 precision: str, job: Job, log) -> None:
    """The finished run's last lines: validation against the unigram baseline, tokens/s, saved bytes, the final
    checkpoint, and on CUDA the MFU."""
    val_bpb, _, saved, tok_s, mfu, _, ckpt = run
    log(("done" if stop == cfg.steps else f"stopped at --stop-after {stop} of --steps {cfg.steps}")
        + f": step {stop}, val {val_bpb:.3f} bits/byte vs unigram {entropy:.3f}; "
        f"{tok_s:,.0f} tokens/s" + (f" ({tok_s / job.world:,.0f} per {_unit(device)}, {job.world} processes)"
                                    if job.distributed else "")
        + (f"; MoE saved {saved / 2**20:.2f} MiB/{'step' if cfg.grad_accum == 1 else 'micro-batch'}"
           if _counts_saved(cfg, job) else "")
        + (f"; checkpoint {ckpt}" if ckpt is not None else "; no final checkpoint"))
    if device.type == "cuda":
        peak = gpu_peak_flops(device, cfg, precision)
        log(f"MFU: {100 * mfu:.1f}% of {peak / 1e12:.0f} TFLOP/s ({mcfg.train_flops_per_token() / 1e6:.2f} "
            "MFLOP/token = 6 x active params + 12 x layers x d x seq)" if mfu is not None
            else "MFU: unknown GPU peak; pass --peak-tflops")


def _loop(model, opt, corpus, cfg: TrainConfig, mcfg: ModelConfig, device, precision: str,
          amp_dtype: torch.dtype | None, start: int, stop: int, signals: checkpoint.StopOnSignal, log, job: Job,
          metrics: MetricsLog):
    """Steps ``start..stop-1`` with evaluation, a metrics row per step, and checkpoints; returns
    ``(val_bpb, losses, saved bytes, tokens/s, mfu, status, last checkpoint folder)``.

    On CUDA the host reads a step's figures (:class:`StepOutcome`) after launching the next step, so the device
    never waits for the host between steps; a step that evaluates, checkpoints or stops is read at once. On the CPU
    a launch runs the step to its end, so each step is read at once: read a step later, a step's time would hold
    the next one's work (and an evaluated step none: it was read right after the step before it)."""
    run = _Run(cfg, mcfg, device, precision, job, metrics, log)
    overlap = device.type == "cuda"
    last_save = time.monotonic()
    prof_from, profiler = _profile_from(cfg, start, stop, log), None
    bar = tqdm(range(start, stop), initial=start, total=stop, unit="step",
               disable=None if cfg.progress is None else not cfg.progress,  # None: tqdm's, a bar on a terminal only
               dynamic_ncols=True, desc="train")
    run.bar = bar
    pending = None
    for step in bar:
        if step == prof_from:
            _recv_rows(model, 1)  # the counters restart with the window
            profiler = StepProfiler(device).start()
        t0 = time.perf_counter()
        x, y = (_to_device(job.local_rows(t), device)
                for t in get_batch(corpus.train, step, cfg.batch_size, mcfg.seq_len, cfg.seed))
        # measure once; the hooks pass tensors through, so results do not change
        counter = (SavedTensorCounter(list(model.parameters())).track(model.moe_layers())
                   if step == start and _counts_saved(cfg, job) else None)
        outcome = train_step(model, opt, x, y, lr_at(step, cfg), cfg.grad_clip, counter, amp_dtype, job,
                             cfg.grad_accum)
        if counter is not None:  # one micro-batch's: its backward frees them before the next forward
            run.saved = counter.bytes
            log(f"MoE layers saved for backward: {run.saved / 2**20:.2f} MiB per "
                f"{'step' if cfg.grad_accum == 1 else 'micro-batch'} "
                f"({run.saved * cfg.grad_accum / run.tokens_per_step:.0f} bytes/token, save={mcfg.save}; layer inputs "
                "included, parameters excluded)")
        if pending is not None:  # the previous step, read while this one runs
            run.finish(*pending)
        if step == start and job.distributed:  # after the first step, which autotuned: every rank runs rank 0's
            agree_kernels()
        if profiler is not None and step + 1 == prof_from + cfg.profile_steps:
            _report_breakdown(profiler.stop(cfg.profile_steps, _recv_rows(model, cfg.profile_steps)), cfg, device,
                              job, log)
            profiler = None
        pending = (step, outcome, t0)
        last = step + 1 == stop
        # bounded after a signal: torchrun sends SIGTERM when a peer died (moeblaze.training.heartbeat names it)
        # one all-reduce for both decisions (each aligns the ranks' hosts once)
        interrupted, timed = checkpoint.agree_all(
            signals.signum is not None,
            cfg.checkpoint_minutes > 0 and time.monotonic() - last_save >= 60 * cfg.checkpoint_minutes,
            timeout=cfg.dist_timeout if signals.signum is not None else None)
        evaluated = not interrupted and ((step + 1) % cfg.eval_interval == 0 or last)
        save = ((last and cfg.final_checkpoint) or interrupted or timed
                or (cfg.checkpoint_interval and (step + 1) % cfg.checkpoint_interval == 0))
        if overlap and not (evaluated or save or last):
            continue
        # before the checkpoint: a run killed between the two resumes from the previous one, dropping this row
        run.finish(*pending, evaluate_now=evaluated, evaluate=lambda: evaluate(model, corpus.val, cfg, device,
                                                                              amp_dtype, job))
        pending = None
        if save:
            run.ckpt = save_checkpoint(cfg.out_dir, model, opt, step + 1, cfg, job.layout(), log)
            last_save = time.monotonic()
        if interrupted:
            bar.close()
            name = signal.Signals(signals.signum).name if signals.signum else "a signal on another rank"
            log(f"stopped by {name} after step {step + 1}: checkpoint {run.ckpt} written; continue with "
                f"`moeblaze train --resume --out-dir {cfg.out_dir}`")
            return run.results(name if signals.signum else "SIGTERM")
    bar.close()
    if len(run.step_times) > 1:
        # the median step after the first: a step that compiles or autotunes is an outlier, and with sizes that
        # change from step to step (token rounding's pairs) such steps can come after the first (Triton specialises
        # integer arguments, e.g. on divisibility by 16)
        steady = run.tokens_per_step / statistics.median(run.step_times[1:])
        log(f"steady state (median step after the first): {steady:,.0f} tokens/s"
            + (f", {steady / job.world:,.0f} tokens/s per {_unit(device)} over {job.world} processes"
               if job.distributed else ""))
    return run.results("done")


def _counts_saved(cfg: TrainConfig, job: Job) -> bool:
    """Whether the run measures the MoE layers' saved bytes: not under FSDP2 (its gathered weights would count as
    saved tensors), nor under --compile (compiled blocks save outside the layers' hooks, and the hooks in the first
    graph's guards would compile every block again)."""
    return job.mesh is None and not cfg.compile


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch on ``device``: on CUDA from pinned memory without blocking the host (a copy from pageable memory
    would wait for the device's queue)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def _recv_rows(model: torch.nn.Module, steps: int) -> int | None:
    """Rows the expert-parallel layers of ``model`` received per step since their counters were last read (reset
    here), or None without expert parallelism."""
    counts = [m.ep.recv_rows for m in model.modules() if getattr(m, "ep", None) is not None]
    for m in model.modules():
        if getattr(m, "ep", None) is not None:
            m.ep.recv_rows = None
    counts = [c for c in counts if c is not None]
    return int(sum(counts)) // steps if counts else None


class _Run:
    """What :func:`_loop` accumulates: losses, step times, throughput, the last evaluation and checkpoint; and
    :meth:`finish`, which reads a step's figures and writes its metrics row."""

    def __init__(self, cfg: TrainConfig, mcfg: ModelConfig, device, precision: str, job: Job, metrics: MetricsLog,
                 log) -> None:
        self.cfg, self.job, self.metrics, self.log, self.bar = cfg, job, metrics, log, None
        peak = gpu_peak_flops(device, cfg, precision)
        self.peak = peak * job.world if peak else peak  # the job's GPUs together
        self.flops_per_token = mcfg.train_flops_per_token()
        self.tokens_per_step = cfg.batch_size * mcfg.seq_len
        self.saved, self.losses, self.val_bpb, self.train_time = 0, [], float("nan"), 0.0
        self.mfu, self.tok_s, self.ckpt, self.step_times, self._t_last = None, 0.0, None, [], None

    def finish(self, step: int, outcome: StepOutcome, t0: float, evaluate_now: bool = False, evaluate=None) -> None:
        """Read step ``step``'s figures (raising :class:`NonFiniteLossError` with the step named), time it (from its
        launch, or the previous step's read when later: the steps overlap), evaluate if asked, write its row."""
        try:
            loss, load = outcome.result()
        except NonFiniteLossError as err:
            if self.bar is not None:
                self.bar.close()
            kept = checkpoint.find_latest(self.cfg.out_dir, warn=None)
            raise NonFiniteLossError(f"step {step + 1}: {err}; the optimizer skipped that step and the run stopped, "
                                     f"nothing written (last checkpoint: {kept or 'none'})") from None
        now = time.perf_counter()
        self.step_times.append(now - max(t0, self._t_last if self._t_last is not None else t0))
        self.losses.append(loss)
        self.train_time += self.step_times[-1]
        done = len(self.losses)
        self.tok_s = done * self.tokens_per_step / self.train_time
        self.mfu = self.flops_per_token * self.tok_s / self.peak if self.peak else None
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.3f} ({loss / math.log(2):.2f} bpb), {self.tok_s:,.0f} tok/s"
                                     + (f", MFU {100 * self.mfu:.1f}%" if self.mfu is not None else ""))
        if evaluate_now:
            self.val_bpb = evaluate()
            self.log(f"step {step + 1}: train loss {loss:.3f} nats/byte, val {self.val_bpb:.3f} bits/byte, "
                     f"{self.tok_s:,.0f} tok/s"
                     + (f", expert load max/mean {load[0]:.2f} (worst layer)" if load else ""))
        self.metrics.write(step + 1, loss, lr_at(step, self.cfg), self.step_times[-1], self.tok_s,
                           self.val_bpb if evaluate_now else None, load)
        self._t_last = time.perf_counter()

    def results(self, status: str) -> tuple:
        return (self.val_bpb, self.losses, self.saved, self.tok_s, self.mfu, status,
                str(self.ckpt) if self.ckpt is not None else None)


def _profile_from(cfg: TrainConfig, start: int, stop: int, log) -> int | None:
    """The first profiled step of ``--profile-steps`` (None: off, or too few steps left, which is said). Profiled from
    the fourth step: the first ones autotune, compile and grow the allocator's pools."""
    if not cfg.profile_steps:
        return None
    if stop - start < 3 + cfg.profile_steps:
        log(f"--profile-steps {cfg.profile_steps}: not profiled, the run takes {stop - start} more steps and the "
            f"profile needs {3 + cfg.profile_steps} (3 first steps, then {cfg.profile_steps})")
        return None
    return start + 3


def _report_breakdown(row: StepBreakdown, cfg: TrainConfig, device: torch.device, job: Job, log) -> None:
    """Gather every rank's step breakdown (:mod:`moeblaze.parallel.breakdown`), log its summary, append the rows to
    ``OUT_DIR/breakdown.csv`` (rank 0)."""
    rows = gather(row)
    log(f"profiled {cfg.profile_steps} steps: {summary(rows, traced=device.type == 'cuda')}")
    if job.rank0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        append_rows(Path(cfg.out_dir) / "breakdown.csv", rows, device=f"{job.world}x {name}",
                    layout=layout_words(job.layout()), command=" ".join(sys.argv))
