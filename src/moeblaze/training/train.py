"""``moeblaze train``: train the byte-level MoE transformer of :mod:`moeblaze.model` on real text.

Read top to bottom (configuration, device set-up and learning-rate schedule: :mod:`moeblaze.train_config`):
evaluation, checkpoints, then :func:`train` — the loop itself (AdamW, warmup + cosine learning rate,
gradient clipping, loss = cross-entropy + the routers' auxiliary losses) — and :func:`sample`.

Reproducibility: the batch of step ``s`` comes from a generator seeded by ``(seed, s)``
(:func:`moeblaze.data.get_batch`), and a checkpoint (:mod:`moeblaze.checkpoint`, written atomically)
holds the weights and the AdamW state (``torch.distributed.checkpoint``), the step and the RNG state
(JSON). So ``--steps 2N`` equals ``--steps 2N --stop-after N`` followed by ``--steps 2N --resume``,
bitwise on CPU, on GPUs with ``--deterministic`` (:mod:`moeblaze.training.determinism`) — also when the first run was
stopped by SIGTERM/Ctrl-C, killed, or lost a rank (from its last checkpoint).
"""

from __future__ import annotations

import contextlib
import math
import signal
import statistics
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .. import settings
from ..backends import get_backend
from ..balance import expert_load, load_summary, update_expert_biases
from ..fp8 import check_fp8_backend
from ..layer import aux_loss
from ..memory import SavedTensorCounter
from ..parallel.breakdown import StepBreakdown, StepProfiler, append_rows, gather, summary
from ..parallel.runtime import agree_kernels
from . import checkpoint
from .data import DataError, eval_windows, get_batch, load_corpus, unigram_entropy
from .determinism import deterministic_mode
from .export import load_model
from .job import Job, check_same_config, clip_grad_norm, start_job
from .metrics_log import MetricsLog, check_logger, val_at
from .model import ModelConfig, MoETransformer
from .train_config import (
    MIXED,
    ConfigError,
    TrainConfig,
    TrainResult,
    autocast_context,
    fp8_recipe,
    gpu_peak_flops,
    lr_at,
    make_optimizer,
    resolve_device,
    resolve_precision,
    set_threads,
)

__all__ = ["ConfigError", "NonFiniteLossError", "TrainConfig", "TrainResult", "load_run_config", "sample",
           "train"]

@torch.no_grad()
def evaluate(model: MoETransformer, data, cfg: TrainConfig, device: torch.device,
             autocast: torch.dtype | None = None, job: Job | None = None) -> float:
    """Validation bits per byte: mean next-byte cross-entropy (nats) / ln 2 over fixed windows
    (the forward under ``torch.autocast(autocast)`` when given, as in training).

    In a job of several ranks (``job``) each rank runs its rows of every batch and the sums are all-reduced;
    a rank left without rows runs the batch's first row with weight 0, as every rank must take part in
    each sharded forward."""
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    world, rank = (job.world, job.env.rank) if job is not None and job.distributed else (1, 0)
    for x, y in eval_windows(data, cfg.eval_tokens, model.cfg.seq_len, cfg.batch_size):
        rows = torch.tensor_split(torch.arange(x.shape[0]), world)[rank]
        weight = 1.0 if len(rows) else 0.0
        rows = rows if len(rows) else torch.zeros(1, dtype=torch.long)
        with autocast_context(device, autocast):
            logits = model(x[rows].to(device))
        ce = F.cross_entropy(logits.float().flatten(0, 1), y[rows].to(device).flatten(), reduction="sum")
        total += weight * ce.double()
        count += y.numel()
    total = job.all_sum(total) if job is not None else total
    model.train()
    return total.item() / count / math.log(2)


# ----------------------------------------------------------------------------- checkpoints

def save_checkpoint(out_dir: str, model: MoETransformer, opt: torch.optim.Optimizer, step: int,
                    cfg: TrainConfig, layout: dict | None = None, log=print) -> Path:
    """Write the checkpoint of ``step`` atomically (:func:`moeblaze.checkpoint.save`): weights and AdamW state through
    DCP, and ``state.json`` with the step, RNG state and both configurations; keeps the newest
    ``cfg.keep_checkpoints``; returns its folder. A write that finds the disk full deletes the checkpoints older than
    the newest complete one (:func:`moeblaze.checkpoint.make_room`, said through ``log``) and writes once more.

    Raises:
        moeblaze.checkpoint.CheckpointError: the filesystem refused a write (disk full, ...; the message names the
            folder, the error and the space); the earlier checkpoints are untouched. Raised on every rank alike.
    """
    state = {"model_config": asdict(model.cfg), "train_config": asdict(cfg), "rng": checkpoint.rng_state(),
             "layout": layout or {"world_size": 1, "fsdp": False, "ep": 1}}
    try:
        return checkpoint.save(out_dir, step, model, opt, state, keep=cfg.keep_checkpoints)
    except checkpoint.CheckpointError as err:
        if not getattr(err, "no_space", False):
            raise
        freed = checkpoint.make_room(out_dir)
        if not freed:
            raise
        log(f"disk full at the checkpoint of step {step}: deleted {', '.join(freed)} (older than the newest "
            "complete checkpoint) and wrote it again")
        return checkpoint.save(out_dir, step, model, opt, state, keep=cfg.keep_checkpoints)


def load_run_config(out_dir: str) -> tuple[TrainConfig, ModelConfig, int]:
    """Configurations and step of the newest complete checkpoint in ``out_dir`` (or of the checkpoint folder
    ``out_dir``).

    Raises:
        moeblaze.checkpoint.CheckpointError: no checkpoint, or none that verifies (naming the file).
        ConfigError: its ``state.json`` lacks a configuration field.
    """
    state = checkpoint.read_state(checkpoint.resolve(out_dir), check=False)  # resolve() verified it
    known = {f.name for f in fields(TrainConfig)}
    try:
        tcfg = TrainConfig(**{k: v for k, v in state["train_config"].items() if k in known})
        return tcfg, ModelConfig(**state["model_config"]), int(state["step"])
    except (KeyError, TypeError) as err:
        raise ConfigError(f"{out_dir}: state.json lacks or mangles a field ({err})") from None


def load_checkpoint(path: str | Path, model: MoETransformer, opt: torch.optim.Optimizer | None,
                    device: torch.device, job: Job | None = None, log=None) -> int:
    """Restore weights, optimizer state and RNG from a checkpoint folder that :func:`moeblaze.checkpoint.verify`
    accepted (as :func:`moeblaze.checkpoint.find_latest` returns it); returns the step to continue from.

    Raises:
        ConfigError: the checkpoint's model configuration differs from ``model.cfg``.
        moeblaze.checkpoint.CheckpointError: the folder cannot be loaded or holds non-finite weights.
    """
    state = checkpoint.read_state(path, check=False)
    # a field added since the checkpoint was written takes its default (the behaviour of the older version)
    saved = {f.name: f.default for f in fields(ModelConfig)} | state.get("model_config", {})
    if saved != asdict(model.cfg):
        diff = {k: (v, saved.get(k)) for k, v in asdict(model.cfg).items() if saved.get(k) != v}
        raise ConfigError(f"model config differs from the checkpoint in {path} (now, saved): {diff}")
    now = job.layout() if job is not None else {"world_size": 1, "fsdp": False, "ep": 1}
    saved = state.get("layout", {"world_size": 1, "fsdp": False, "ep": 1})
    if saved != now and log is not None:
        log(f"resharding the checkpoint: saved by {_layout_words(saved)}, loaded by {_layout_words(now)}")
    checkpoint.load(path, model, opt)
    checkpoint.set_rng_state(state["rng"], device)
    return int(state["step"])


def _unit(device: torch.device) -> str:
    return "GPU" if device.type == "cuda" else "process"


def _layout_words(layout: dict) -> str:
    return (f"{layout.get('world_size')} process(es)" + (", FSDP2" if layout.get("fsdp") else "")
            + (f", expert parallelism over {layout.get('ep')}" if layout.get("ep", 1) > 1 else ""))


def prepare_out_dir(cfg: TrainConfig, log=print) -> Path | None:
    """Create ``--out-dir`` and prove it writable (a file written, fsynced, removed) before anything is built.

    Returns:
        The checkpoint folder to resume from (``cfg.resume``; newer ones that do not verify are named
        through ``log`` and skipped), else None.

    Raises:
        ConfigError: not a directory or not writable; ``--resume`` with no complete checkpoint; a fresh run
            into a directory holding checkpoints without ``--overwrite`` (with it, they are deleted).
    """
    out = Path(cfg.out_dir).expanduser()
    problem = checkpoint.check_writable(out)
    if problem:
        raise ConfigError(f"--out-dir {cfg.out_dir} {problem}")
    legacy = out / "state.json"
    if cfg.resume:
        found = checkpoint.find_latest(out, warn=lambda m: log(f"warning: {m}; trying the previous one"))
        if found is None:
            checkpoint.resolve(out)  # raises, naming what is wrong
        checkpoint.tidy(out, found)
        return found
    if checkpoint.checkpoint_dirs(out) or legacy.is_file():
        if not cfg.overwrite:
            raise ConfigError(f"--out-dir {cfg.out_dir} holds a checkpoint of an earlier run; pass --resume to "
                              "continue it, or --overwrite to delete it and start afresh")
        checkpoint.clear(out)
        for name in ("model.safetensors", "optimizer.pt", "state.json"):
            (out / name).unlink(missing_ok=True)
    return None


# ----------------------------------------------------------------------------- training

def _describe(total: int, mcfg: ModelConfig, cfg: TrainConfig, device, precision, threads, job: Job) -> str:
    where = (f"; {job.world} processes, FSDP2" + (f" + expert parallelism over {job.ep}" if job.ep > 1 else "")
             + f", {cfg.batch_size // job.world} sequences per rank") if job.distributed else ""
    return (f"model: {mcfg.n_layers} layers, d={mcfg.d_model}, heads={mcfg.n_heads}, E={mcfg.num_experts}, "
            f"K={mcfg.top_k}, h={mcfg.d_ff}, seq={mcfg.seq_len}; {total / 1e6:.2f}M parameters, "
            f"{mcfg.active_params_per_token() / 1e6:.2f}M active per token\n"
            f"run: {cfg.steps} steps x {cfg.batch_size * mcfg.seq_len} tokens, lr {cfg.lr:g}, "
            f"device {device}, precision {precision}, {threads} threads{where}; out-dir {cfg.out_dir}")


class NonFiniteLossError(RuntimeError):
    """Training stopped at a non-finite loss or gradient norm; the optimizer did not step on it."""


_VALUE_NAMES = ("LM loss (cross-entropy)", "auxiliary loss (router load-balancing + z-loss)", "gradient norm")


class StepOutcome:
    """A launched optimizer step whose figures travel to the host without stopping the device.

    :func:`train_step` ends with a non-blocking copy of the step's losses, gradient norm and expert load into
    pinned host memory and an event behind it; :meth:`result` waits for that event only (the copy, queued right
    after the step's work), so the host can launch the next step first and keep the device fed.
    """

    def __init__(self, values: torch.Tensor, has_load: bool) -> None:
        self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=values.is_cuda)
        self._host.copy_(values, non_blocking=True)
        self._event = torch.cuda.Event() if values.is_cuda else None
        if self._event is not None:
            self._event.record()
        self.has_load = has_load

    def result(self) -> tuple[float, tuple | None]:
        """``(cross-entropy in nats, expert load or None)``, the load as :func:`train_step` describes it.

        Raises:
            NonFiniteLossError: the LM loss, the auxiliary loss or the gradient norm is NaN or inf (the optimizer
                skipped the step: :func:`train_step`).
        """
        if self._event is not None:
            self._event.synchronize()
        values = self._host.tolist()
        for name, v in zip(_VALUE_NAMES, values):
            if not math.isfinite(v):
                raise NonFiniteLossError(f"{name} is {v}")
        return values[0], (values[3], values[4], int(values[5])) if self.has_load else None


def train_step(model: MoETransformer, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, lr: float,
               grad_clip: float, counter: SavedTensorCounter | None = None,
               autocast: torch.dtype | None = None, job: Job | None = None) -> StepOutcome:
    """One optimizer step on a batch ``x, y [B, seq]`` (int64 bytes), launched without a host synchronisation;
    :meth:`StepOutcome.result` gives the cross-entropy (nats) and the step's expert load
    (:func:`moeblaze.balance.load_summary` as floats: the worst and the mean over the MoE layers of max / mean
    tokens per expert, and the experts that received no token), or None without counts.

    The loss is cross-entropy plus the MoE layers' auxiliary losses; gradients are clipped to
    ``grad_clip`` (0: off). With ``counter``, the forward runs under it (bytes saved for backward). With
    ``autocast`` (mixed precision), the forward runs under ``torch.autocast(x.device.type, autocast)``; the
    backward and the optimizer step run outside it, on the fp32 parameters. After ``opt.step()``,
    :func:`moeblaze.update_expert_biases` moves the routers' biases (``expert_bias_rate`` > 0) and resets
    the counts, from the same all-reduced counts as the load (one all-reduce of ``[layers * E]`` int64).
    With a ``job`` of several ranks (FSDP2), the losses are means over the ranks and the gradient norm is the
    global one (:func:`moeblaze.training.job.clip_grad_norm`), so every rank decides alike; the load is over
    every rank's tokens.

    A non-finite loss or gradient norm is found on the device: a fused optimizer (:func:`make_optimizer`'s AdamW)
    skips the step there (its ``found_inf``), so the weights and the optimizer state stay those of the previous
    step, and :meth:`StepOutcome.result` raises :class:`NonFiniteLossError` when the host reads it. Another
    optimizer has no such skip: the figures are then read before ``opt.step()`` (one synchronisation), which
    raises before stepping.
    """
    for group in opt.param_groups:
        group["lr"] = lr
    with counter if counter is not None else contextlib.nullcontext(), autocast_context(x.device, autocast):
        logits = model(x)
    ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    aux = aux_loss(model).to(x.device)
    (ce + aux).backward()
    load = expert_load(model)  # over the world's tokens where distributed (the routers are replicated)
    params = [p for p in model.parameters() if p.grad is not None]
    if job is not None and job.mesh is not None:
        norm = clip_grad_norm(params, grad_clip, job)
        ce, aux = job.all_mean(torch.stack([ce.detach(), aux.detach().float()]))
    elif grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    summary = [load_summary(load).to(ce.device)] if load else []
    values = torch.cat([torch.stack([ce.detach(), aux.detach().float(), norm.float().to(ce.device)]), *summary])
    outcome = StepOutcome(values, bool(load))
    if opt.defaults.get("fused"):
        opt.found_inf = (~torch.isfinite(values[:3]).all()).float()  # read by the fused kernel: skip the step
    else:
        try:
            outcome.result()
        except NonFiniteLossError:
            opt.zero_grad(set_to_none=True)
            raise
    opt.step()
    opt.zero_grad(set_to_none=True)
    update_expert_biases(model, load=load)  # the auxiliary-loss-free step (expert_bias_rate 0: only the reset)
    return outcome


def _check_backend(mcfg: ModelConfig, device: torch.device) -> None:
    if mcfg.backend == "triton" and device.type != "cuda" and not settings.interpreting():
        raise ConfigError(f"--backend triton needs a CUDA device (--device is {device}); use --backend torch "
                          "or auto, or set TRITON_INTERPRET=1 to run the kernels in Triton's (slow) CPU interpreter")


def _check_fp8(precision: str, mcfg: ModelConfig, device: torch.device) -> None:
    """``fp8-mixed`` only where the experts' backend runs the recipe (its emulation: ``--backend torch``), said
    before anything is built rather than at the first forward."""
    if fp8_recipe(precision) is None:
        return
    try:
        # fp32: the backend the experts' dtype would choose on this device, without the interpreter's bf16 refusal
        backend = get_backend(mcfg.backend, torch.empty(0, device=device)).name
        check_fp8_backend(backend, torch.bfloat16, device)
    except (ValueError, NotImplementedError) as err:
        raise ConfigError(f"--precision fp8-mixed with --backend {mcfg.backend}: {err}") from None


def train(cfg: TrainConfig, model_cfg: ModelConfig | None = None, log=tqdm.write) -> TrainResult:
    """Train a :class:`MoETransformer` as configured; checkpoint to ``cfg.out_dir``.

    Before anything is built, the device, backend and ``--out-dir`` are checked (created, written to, and
    refused when it holds an earlier run's checkpoint unless ``cfg.resume`` or ``cfg.overwrite``).
    Checkpoints (:mod:`moeblaze.checkpoint`) are written every ``checkpoint_interval`` steps, every
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
    job (:mod:`moeblaze.training.job`): every rank calls :func:`train` with the same configuration; rank 0
    logs; the process group is destroyed at the end. A lost rank ends the process (exit status 3) with one line
    (:mod:`moeblaze.training.heartbeat`). ``cfg.deterministic``: inside
    :func:`moeblaze.training.determinism.deterministic_mode`.

    Raises:
        ConfigError: bad device/precision/backend or out_dir, nothing to resume, resume with a different model, a
            ``--logger`` whose package is missing;
            ``--fsdp`` outside torchrun, several processes without it, ``--ep`` not dividing the world size, a
            batch not divisible by it, ranks started with different configurations (raised on every rank).
        moeblaze.data.DataError: missing or unusable data.
        moeblaze.checkpoint.CheckpointError: the checkpoint to resume cannot be loaded, or one cannot be written.
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
    if model_cfg is not None:
        _check_backend(model_cfg, device)
        _check_fp8(precision, model_cfg, device)
    check_logger(cfg.logger)  # on every rank: a missing package fails them all before anything is built
    resume_from, finished = prepare_out_dir(cfg, log), False
    if resume_from is not None:
        state = checkpoint.read_state(resume_from, check=False)  # verified by prepare_out_dir
        saved_mcfg, saved_step = ModelConfig(**state["model_config"]), int(state["step"])
        model_cfg = model_cfg or saved_mcfg
        if saved_step >= cfg.steps:
            val = val_at(cfg.out_dir, saved_step)  # the final evaluation; none when a signal stopped the last step
            if val is not None:
                return _already_finished(cfg, resume_from, saved_step, val, "metrics.csv", log)
            finished = True  # evaluated below, once the checkpoint is loaded
        elif 0 < cfg.stop_after <= saved_step:
            log(f"the checkpoint {resume_from.name} in {cfg.out_dir} is at step {saved_step}, at or past --stop-after "
                f"{cfg.stop_after}; nothing to do (pass a larger --stop-after, or none, to train on)")
            return TrainResult(saved_step, float("nan"), float("nan"), float("nan"), 0.0, 0, [],
                               status="done", checkpoint=str(resume_from))
    mcfg = model_cfg or ModelConfig()
    _check_backend(mcfg, device)
    _check_fp8(precision, mcfg, device)
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
    for moe in model.moe_layers():
        moe.fp8 = fp8_recipe(precision)
    total_params = sum(p.numel() for p in model.parameters())
    model = job.shard(model, precision, cfg.fsdp_reshard, cfg.fsdp_reduce_dtype, cfg.ep_exchange, cfg.fsdp_prefetch)
    opt = make_optimizer(model, cfg)
    start = load_checkpoint(resume_from, model, opt, device, job, log) if resume_from is not None else 0
    if finished:
        return _already_finished(cfg, resume_from, start, evaluate(model, corpus.val, cfg, device, amp_dtype, job),
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
    log(("done" if stop == cfg.steps else f"stopped at --stop-after {stop} of --steps {cfg.steps}")
        + f": step {stop}, val {val_bpb:.3f} bits/byte vs unigram {entropy:.3f}; "
        f"{tok_s:,.0f} tokens/s" + (f" ({tok_s / job.world:,.0f} per {_unit(device)}, {job.world} processes)"
                                    if job.distributed else "")
        + (f"; MoE saved {saved / 2**20:.2f} MiB/step" if job.mesh is None else "")
        + (f"; checkpoint {ckpt}" if ckpt is not None else "; no final checkpoint"))
    if device.type == "cuda":
        peak = gpu_peak_flops(device, cfg, precision)
        log(f"MFU: {100 * mfu:.1f}% of {peak / 1e12:.0f} TFLOP/s ({mcfg.train_flops_per_token() / 1e6:.2f} "
            "MFLOP/token = 6 x active params + 12 x layers x d x seq)" if mfu is not None
            else "MFU: unknown GPU peak; pass --peak-tflops")
    return TrainResult(stop, val_bpb, entropy, losses[-1] if losses else float("nan"), tok_s, saved, losses, mfu,
                       status, ckpt, job.world)


def _already_finished(cfg: TrainConfig, ckpt: Path, step: int, val_bpb: float, source: str, log,
                      unigram: float = float("nan")) -> TrainResult:
    """The result of resuming a run whose checkpoint is at ``--steps`` already: its final validation, said."""
    log(f"the run in {cfg.out_dir} already finished: its checkpoint {ckpt.name} is at step {step} of --steps "
        f"{cfg.steps}, val {val_bpb:.3f} bits/byte ({source}); nothing to do (pass a larger --steps to train on)")
    return TrainResult(step, val_bpb, unigram, float("nan"), 0.0, 0, [], status="finished", checkpoint=str(ckpt))


def _loop(model, opt, corpus, cfg: TrainConfig, mcfg: ModelConfig, device, precision: str,
          amp_dtype: torch.dtype | None, start: int, stop: int, signals: checkpoint.StopOnSignal, log, job: Job,
          metrics: MetricsLog):
    """Steps ``start..stop-1`` with evaluation, a metrics row per step, and checkpoints; returns
    ``(val_bpb, losses, saved bytes, tokens/s, mfu, status, last checkpoint folder)``.

    The host reads a step's figures (:class:`StepOutcome`) after launching the next step, so the device never
    waits for the host between steps; a step that evaluates, checkpoints or stops is read at once."""
    run = _Run(cfg, mcfg, device, precision, job, metrics, log)
    last_save = time.monotonic()
    # profiled from the fourth step: the first ones autotune, compile and grow the allocator's pools
    prof_from, profiler = (start + 3, None) if cfg.profile_steps else (None, None)
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
        # (not under FSDP2: its gathered weights would count as saved tensors)
        counter = (SavedTensorCounter(list(model.parameters())).track(model.moe_layers())
                   if step == start and job.mesh is None else None)
        outcome = train_step(model, opt, x, y, lr_at(step, cfg), cfg.grad_clip, counter, amp_dtype, job)
        if counter is not None:
            run.saved = counter.bytes
            log(f"MoE layers saved for backward: {run.saved / 2**20:.2f} MiB per step "
                f"({run.saved / run.tokens_per_step:.0f} bytes/token, save={mcfg.save}; layer inputs included, "
                "parameters excluded)")
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
        interrupted = checkpoint.agree(signals.signum is not None,
                                       timeout=cfg.dist_timeout if signals.signum is not None else None)
        evaluated = not interrupted and ((step + 1) % cfg.eval_interval == 0 or last)
        timed = checkpoint.agree(cfg.checkpoint_minutes > 0
                                 and time.monotonic() - last_save >= 60 * cfg.checkpoint_minutes)
        save = ((last and cfg.final_checkpoint) or interrupted or timed
                or (cfg.checkpoint_interval and (step + 1) % cfg.checkpoint_interval == 0))
        if not (evaluated or save or last):
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


def _report_breakdown(row: StepBreakdown, cfg: TrainConfig, device: torch.device, job: Job, log) -> None:
    """Gather every rank's step breakdown (:mod:`moeblaze.parallel.breakdown`), log its summary, append the rows to
    ``OUT_DIR/breakdown.csv`` (rank 0)."""
    rows = gather(row)
    log(f"profiled {cfg.profile_steps} steps: {summary(rows)}")
    if job.rank0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        append_rows(Path(cfg.out_dir) / "breakdown.csv", rows, device=f"{job.world}x {name}",
                    layout=_layout_words(job.layout()), command=" ".join(sys.argv))


def sample(checkpoint: str, prompt: str = "\n", max_new_tokens: int = 256, temperature: float = 0.8,
           top_k: int | None = None, seed: int = 0, device: str = "auto") -> str:
    """Generate text from a checkpoint directory written by :func:`train`, or from its exported weights.

    Args:
        checkpoint: the run's ``out_dir`` (its newest complete checkpoint is used), one ``step-*`` folder, or a
            ``.safetensors`` file (or index) written by ``moeblaze export`` (:func:`moeblaze.export.load_model`).
        prompt: UTF-8 text to continue (empty means ``"\\n"``).
        max_new_tokens: bytes to generate. temperature: ``<= 0`` for greedy. top_k: keep the k likeliest bytes.
        seed: seed of the sampler. device: as ``--device``.

    Returns:
        The prompt followed by the generated bytes, decoded as UTF-8 (invalid bytes replaced).

    Raises:
        ConfigError: a bad device, ``max_new_tokens < 0`` or ``top_k < 1``. moeblaze.checkpoint.CheckpointError: no
            usable checkpoint.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens must be an integer >= 0, got {max_new_tokens!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ConfigError(f"--top-k must be a positive integer (or None / 0 on the command line for all bytes), "
                          f"got {top_k!r}")
    dev = resolve_device(device)
    model = load_model(checkpoint, dev)
    data = (prompt or "\n").encode("utf-8")
    idx = torch.tensor([list(data)], dtype=torch.long, device=dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=gen)
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")
