"""Configuration of ``moeblaze train``: the run's fields (:class:`TrainConfig`, one flag each in
:mod:`moeblaze.cli`), its result (:class:`TrainResult`), and the set-up they drive — device, precision
(Lightning's names), CPU threads, the warmup + cosine learning rate, AdamW, and the data-sheet peaks behind
the MFU printout. The loop itself is :mod:`moeblaze.training.train`.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field, fields

import torch

from ..fp8 import Float8Recipe

__all__ = ["LOGGERS", "MIXED", "PRECISIONS", "ConfigError", "TrainConfig", "TrainResult", "autocast_context",
           "fp8_recipe", "gpu_peak_flops", "lr_at", "make_optimizer", "peak_tflops", "resolve_device",
           "resolve_precision", "set_threads"]


# Dense bf16 tensor-core peak (FLOP/s, no sparsity) from the vendors' data sheets, for MFU.
DENSE_BF16_PEAK_TFLOPS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
                          ("H800", 989.0), ("H20", 148.0), ("GH200", 989.0), ("B200", 2250.0), ("B300", 2250.0),
                          ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("L4", 121.0), ("A10", 125.0)]

# Data-sheet fp32 peak without tensor cores (IEEE fp32, float32 matmul precision "highest"), for MFU.
FP32_PEAK_TFLOPS = [("H100 PCIe", 51.0), ("H100 NVL", 60.0), ("H100", 67.0), ("H200", 67.0), ("GH200", 67.0),
                    ("A100", 19.5), ("L40S", 91.6), ("L4", 30.3), ("A10", 31.2)]

PRECISIONS = ("auto", "bf16-mixed", "bf16", "fp32", "fp8-mixed")
MIXED = ("bf16-mixed", "fp8-mixed")  # fp32 parameters and optimizer, the forward under bf16 autocast
LOGGERS = ("none", "tensorboard", "wandb")  # --logger (moeblaze.training.metrics_log)


def peak_tflops(device_name: str, precision: str = "bf16") -> float | None:
    """Data-sheet dense peak of a device (by name) for a ``--precision``, or ``None`` when unknown.

    ``bf16``/``bf16-mixed``: the bf16 tensor-core peak. ``fp32``: TF32 tensor cores (half the bf16 rate on
    these GPUs) when ``torch.backends.cuda.matmul.allow_tf32`` (float32 matmul precision "high"/"medium"),
    else the fp32 peak without tensor cores.
    """
    tf32 = precision == "fp32" and torch.backends.cuda.matmul.allow_tf32
    table = FP32_PEAK_TFLOPS if precision == "fp32" and not tf32 else DENSE_BF16_PEAK_TFLOPS
    for key, tf in table:
        if key in device_name:
            return tf / 2 if tf32 else tf
    return None


class ConfigError(ValueError):
    """A bad option: unknown device, missing checkpoint, mismatched resume configuration."""


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


# Checked by TrainConfig before anything runs. Integers: (min, max or None); floats: (lower bound, whether
# it is allowed, exclusive upper bound or None). The seed feeds numpy's PCG64, which takes no negatives.
_INT_RANGES = {"steps": (1, None), "batch_size": (1, None), "eval_interval": (1, None), "eval_tokens": (1, None),
               "stop_after": (0, None), "warmup_steps": (0, None), "checkpoint_interval": (0, None),
               "grad_accum": (1, None), "threads": (0, None), "keep_checkpoints": (1, None), "ep": (1, None),
               "profile_steps": (0, None), "seed": (0, 2**63 - 1), "fsdp_blocks_per_unit": (1, None)}
_FLOAT_RANGES = {"lr": (0.0, False, None), "min_lr": (0.0, True, None), "weight_decay": (0.0, True, None),
                 "beta1": (0.0, True, 1.0), "beta2": (0.0, True, 1.0), "grad_clip": (0.0, True, None),
                 "val_fraction": (0.0, False, 1.0), "peak_tflops": (0.0, True, None),
                 "checkpoint_minutes": (0.0, True, None), "dist_timeout": (10.0, True, None)}


@dataclass
class TrainConfig:
    """Everything about a run except the model's sizes (see :class:`moeblaze.training.model.ModelConfig`).

    Raises ConfigError naming the flag (``--steps``, ...) of a value out of range or outside its choices."""

    data: str | None = _f(None, "text file or directory to train on (default: the Python standard library)")
    out_dir: str = _f("moeblaze-out", "the run's folder (checkpoints, metrics.csv); not given: moeblaze train writes a "
                      "new numbered moeblaze-out/run_N and --resume continues the newest (moeblaze.training.run_dirs)")
    steps: int = _f(800, "total optimizer steps (the learning-rate schedule spans them)")
    stop_after: int = _f(0, "stop (and checkpoint) once the run reaches this step, counted from its start as "
                            "--steps and the checkpoints are (a resumed run too); 0 = run all --steps")
    batch_size: int = _f(16, "sequences per step (tokens per step = batch_size * seq_len)")
    grad_accum: int = _f(1, "micro-batches per step: each rank's sequences of a step run forward and backward in "
                         "this many equal parts, gradients summed before the optimizer step (the activation memory of "
                         "one part); FP8 layers quantize their weights once per step (moeblaze.fp8.reuse_weights)")
    lr: float = _f(3e-3, "peak learning rate")
    min_lr: float = _f(3e-4, "final learning rate of the cosine decay")
    warmup_steps: int = _f(50, "linear warmup steps")
    weight_decay: float = _f(0.1, "AdamW weight decay (matrices only)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0 = off)")
    seed: int = _f(1337, "seed of the initialisation and of the batch sampler")
    device: str = _f("auto", "auto (cuda if available, else cpu), cpu, cuda or cuda:N")
    precision: str = _f("auto", "Lightning's names: bf16-mixed = fp32 parameters and optimizer, forward under "
                        "torch.autocast(bfloat16); bf16 = bf16 parameters; fp32 = fp32 throughout (TF32 matmuls "
                        "unless torch's float32 matmul precision is 'highest'); fp8-mixed = bf16-mixed with the "
                        "expert GEMMs in FP8 (moeblaze.fp8's rowwise recipe: the Triton kernels on a Hopper GPU, its "
                        "PyTorch emulation on --backend torch, so on the CPU); auto: bf16-mixed on cuda, fp32 on cpu",
                        choices=PRECISIONS)
    threads: int = _f(0, "CPU threads for torch (0 = all available cores)")
    eval_interval: int = _f(200, "evaluate validation bits-per-byte every this many steps")
    eval_tokens: int = _f(131072, "validation tokens per evaluation (evenly spaced windows)")
    checkpoint_interval: int = _f(200, "checkpoint every this many steps (0 = off; the end of the run, "
                                  "SIGTERM and Ctrl-C always checkpoint)")
    checkpoint_minutes: float = _f(30.0, "also checkpoint when this many minutes passed since the last one (0 = off)")
    final_checkpoint: bool = _f(True, "checkpoint when the run ends (--no-final-checkpoint: not, e.g. for benchmark "
                                "runs; a stop by SIGTERM or Ctrl-C still writes one)")
    keep_checkpoints: int = _f(3, "keep the newest this many checkpoints (older ones are deleted)")
    val_fraction: float = _f(0.1, "share of files (or bytes, for a single file) held out for validation")
    resume: bool = _f(False, "continue the run checkpointed in --out-dir (from its newest complete checkpoint)")
    overwrite: bool = _f(False, "start afresh in an --out-dir that holds checkpoints (deletes them)")
    progress: bool | None = _f(None, "show a progress bar (not given: only when stderr is a terminal, so a log file "
                               "gets one line per evaluation and no bar frames)")
    logger: str = _f("none", "also log each step's metrics.csv numbers to tensorboard (torch.utils.tensorboard, "
                     "event files in --out-dir) or wandb (Weights & Biases, project moeblaze); needs that package",
                     choices=LOGGERS)
    peak_tflops: float = _f(0.0, "GPU peak TFLOP/s for MFU (0 = look up the GPU's dense peak for the precision "
                                 "that runs)")
    fsdp: bool = _f(False, "shard the model with FSDP2 over the processes torchrun started (torchrun "
                    "--nproc-per-node N -m moeblaze.cli train --fsdp); --batch-size is the global batch")
    ep: int = _f(1, "expert parallelism: spread each MoE layer's experts over groups of this many ranks (needs --fsdp)")
    ep_exchange: str = _f("auto", "the expert-parallel token exchange: nvshmem (symmetric memory, split sizes on the "
                          "device), padded (all-to-all of fixed blocks, any backend), all_to_all (exact sizes read to "
                          "the host once per layer); auto: padded on GPUs, else all_to_all",
                          choices=("auto", "nvshmem", "padded", "all_to_all"))
    fsdp_reshard: bool = _f(True, "free each block's gathered parameters after its forward (gathered again in "
                            "backward); --no-fsdp-reshard keeps them until the backward: one all-gather per step "
                            "instead of two, for models whose parameters fit unsharded")
    fsdp_prefetch: bool = _f(True, "each block all-gathers the next block's parameters as it starts (the previous "
                             "block's in backward); --no-fsdp-prefetch leaves it to FSDP2, which gathers a unit when "
                             "the host reaches it")
    fsdp_blocks_per_unit: int = _f(1, "consecutive transformer blocks sharded as one FSDP2 unit: one all-gather, "
                                   "one reduce-scatter and one set of FSDP2's host hooks for all of them (steps bound "
                                   "by the host), larger gathers that overlap less")
    fsdp_reduce_dtype: str = _f("fp32", "dtype of FSDP2's gradient reduce-scatter under bf16-mixed (bf16 halves its "
                                "bytes)", choices=("fp32", "bf16"))
    compile: bool = _f(False, "torch.compile each transformer block (torchtitan's per-block compile): attention, norms "
                       "and router fused into fewer kernels and the expert kernels called without the autograd "
                       "functions' Python, for steps bound by the host's launches; expert parallelism's exchange "
                       "stays eager; the first steps compile (a minute or more)")
    profile_steps: int = _f(0, "profile this many steps after the first three (torch.profiler): print how a step "
                               "splits into compute, communication (and the part nothing hides), device idle and host "
                               "syncs, per rank, and append the rows to OUT_DIR/breakdown.csv (0 = off)")
    deterministic: bool = _f(False, "bitwise reproducible on GPUs (fixed kernel configurations, torch's deterministic "
                             "algorithms, NCCL's ring; moeblaze.training.determinism); CPU runs are bitwise "
                             "reproducible without it")
    dist_timeout: float = _f(300.0, "seconds a collective may wait for the other ranks (the process group's timeout; "
                             "a rank silent for half of it, at most 30 s, counts as lost), >= 10")

    def __post_init__(self) -> None:
        for name, (lo, hi) in _INT_RANGES.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
                bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer {bound}, got {v!r}")
        for name, (lo, closed, hi) in _FLOAT_RANGES.items():
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not (ok and (v >= lo if closed else v > lo) and (hi is None or v < hi)):
                what = f"{'>=' if closed else '>'} {lo}" + (f" and < {hi}" if hi is not None else "")
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number {what}, got {v!r}")
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ConfigError(f"--{f.name.replace('_', '-')} must be one of {', '.join(choices)}, "
                                  f"got {getattr(self, f.name)!r}")
        if self.min_lr > self.lr:
            raise ConfigError(f"--min-lr must be <= --lr, got min-lr={self.min_lr}, lr={self.lr}")
        if self.resume and self.overwrite:
            raise ConfigError("--resume and --overwrite exclude each other")
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"--batch-size {self.batch_size} must be a multiple of --grad-accum {self.grad_accum} "
                              "(equal micro-batches)")
        if self.ep > 1 and not self.fsdp:
            raise ConfigError(f"--ep {self.ep} needs --fsdp (expert parallelism runs under FSDP2)")
        if self.ep_exchange != "auto" and self.ep == 1:
            raise ConfigError(f"--ep-exchange {self.ep_exchange} is expert parallelism's exchange; pass --ep P "
                              "(P > 1, with --fsdp) with it")


@dataclass
class TrainResult:
    """What :func:`train` measured. Bits per byte are on the validation data."""

    step: int
    val_bpb: float
    unigram_bpb: float
    train_loss: float
    tokens_per_s: float
    moe_saved_bytes: int  # 0 where not measured: under FSDP2 and --compile
    losses: list[float]
    mfu: float | None = None
    status: str = "done"
    checkpoint: str | None = None
    world_size: int = 1  # processes of the job: tokens_per_s / world_size is the throughput per GPU


# ----------------------------------------------------------------------------- set-up

def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda if available else cpu; raises :class:`ConfigError` for unknown or absent devices."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown --device {name!r} (use auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise ConfigError(f"unsupported --device {name!r} (use auto, cpu, cuda or cuda:N)")
    return dev


def resolve_precision(name: str, device: torch.device) -> tuple[str, torch.dtype, torch.dtype | None]:
    """``--precision`` -> ``(precision, parameter dtype, autocast dtype or None)``.

    ``auto`` is ``bf16-mixed`` on CUDA (fp32 master weights; the default model's step takes 1.06x ``bf16``'s on an
    H200: ``benchmarks/bench_precision.py --parts train``, docs/benchmarks.md#precision) and ``fp32`` on CPU.
    ``fp8-mixed`` is ``bf16-mixed`` here; its expert recipe is :func:`fp8_recipe`'s.

    Raises:
        ConfigError: an unknown ``name``.
    """
    if name == "auto":
        name = "bf16-mixed" if device.type == "cuda" else "fp32"
    if name not in PRECISIONS:
        raise ConfigError(f"unknown --precision {name!r} (use one of {', '.join(PRECISIONS)})")
    param = torch.bfloat16 if name == "bf16" else torch.float32
    return name, param, (torch.bfloat16 if name in MIXED else None)


def fp8_recipe(precision: str) -> Float8Recipe | None:
    """The FP8 recipe of the MoE layers' experts for a resolved ``--precision``: the rowwise one (a scale per row
    along each GEMM's reduction; :mod:`moeblaze.fp8`), which the Triton kernels run, for ``fp8-mixed``; else None."""
    return Float8Recipe("rowwise") if precision == "fp8-mixed" else None


def autocast_context(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast(device.type, dtype)`` for a mixed precision, else a no-op context."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def set_threads(cfg: TrainConfig, device: torch.device) -> int:
    """Use every core this process may run on (or ``cfg.threads``); returns the thread count."""
    if device.type == "cpu":
        n = cfg.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
        torch.set_num_threads(max(1, n or 1))
    return torch.get_num_threads()


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over ``warmup_steps``, then cosine decay from ``lr`` to ``min_lr`` at ``steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """Fused AdamW with weight decay on matrices (ndim >= 2: embeddings, projections, experts, routers) only."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # fused: one kernel per device and dtype, and its found_inf lets the training step skip a non-finite step on the
    # device instead of reading the loss on the host first (moeblaze.training.step.train_step)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=True)


def gpu_peak_flops(device: torch.device, cfg: TrainConfig, precision: str = "bf16") -> float | None:
    """The peak used for MFU: ``--peak-tflops``, else the dense peak of a known GPU for the precision that
    runs (:func:`peak_tflops`), else None."""
    if device.type != "cuda":
        return None
    if cfg.peak_tflops > 0:
        return cfg.peak_tflops * 1e12
    name = torch.cuda.get_device_name(device)
    tflops = peak_tflops(name, precision)
    return tflops * 1e12 if tflops else None


# ----------------------------------------------------------------------------- evaluation
