"""The run folder of ``moeblaze train`` and the loop's checkpoints in it: :func:`prepare_out_dir` (``--out-dir``
proven writable; the checkpoint to resume from, or an earlier run refused or, with ``--overwrite``, deleted),
:func:`save_checkpoint` and :func:`load_checkpoint` (weights, AdamW state, RNG state and both configurations, through
:mod:`moeblaze.training.checkpoint`), :func:`load_run_config` (a run's configurations and step), and
:func:`already_finished` (resuming a run that reached ``--steps``).
"""

from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path

import torch

from . import checkpoint
from .job import Job
from .model import ModelConfig, MoETransformer
from .train_config import ConfigError, TrainConfig, TrainResult

__all__ = ["already_finished", "layout_words", "load_checkpoint", "load_run_config", "prepare_out_dir",
           "save_checkpoint"]


def save_checkpoint(out_dir: str, model: MoETransformer, opt: torch.optim.Optimizer, step: int,
                    cfg: TrainConfig, layout: dict | None = None, log=print) -> Path:
    """Write the checkpoint of ``step`` atomically (:func:`moeblaze.training.checkpoint.save`): weights and AdamW state
    through DCP, and ``state.json`` with the step, RNG state and both configurations; keeps the newest
    ``cfg.keep_checkpoints``; returns its folder. A write that finds the disk full deletes the checkpoints older than
    the newest complete one (:func:`moeblaze.training.checkpoint.make_room`, said through ``log``) and writes once more.

    Raises:
        moeblaze.training.checkpoint.CheckpointError: the filesystem refused a write (disk full, ...; the message
            names the folder, the error and the space); the earlier checkpoints are untouched. Raised on every rank
            alike.
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
        moeblaze.training.checkpoint.CheckpointError: no checkpoint, or none that verifies (naming the file).
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
    """Restore weights, optimizer state and RNG from a checkpoint folder that
    :func:`moeblaze.training.checkpoint.verify` accepted (as :func:`moeblaze.training.checkpoint.find_latest` returns
    it); returns the step to continue from.

    Raises:
        ConfigError: the checkpoint's model configuration differs from ``model.cfg``.
        moeblaze.training.checkpoint.CheckpointError: the folder cannot be loaded or holds non-finite weights.
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
        log(f"resharding the checkpoint: saved by {layout_words(saved)}, loaded by {layout_words(now)}")
    checkpoint.load(path, model, opt)
    checkpoint.set_rng_state(state["rng"], device)
    return int(state["step"])


def layout_words(layout: dict) -> str:
    """The process layout a checkpoint was written with (``state["layout"]``), in words for log lines and errors."""
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


def already_finished(cfg: TrainConfig, ckpt: Path, step: int, val_bpb: float, source: str, log,
                      unigram: float = float("nan")) -> TrainResult:
    """The result of resuming a run whose checkpoint is at ``--steps`` already: its final validation, said."""
    log(f"the run in {cfg.out_dir} already finished: its checkpoint {ckpt.name} is at step {step} of --steps "
        f"{cfg.steps}, val {val_bpb:.3f} bits/byte ({source}); nothing to do (pass a larger --steps to train on)")
    return TrainResult(step, val_bpb, unigram, float("nan"), 0.0, 0, [], status="finished", checkpoint=str(ckpt))
