"""``moeblaze train``: train the byte-level MoE transformer of :mod:`moeblaze.model` on real text.

Read top to bottom: configuration, device set-up, learning-rate schedule, evaluation, checkpoints,
then :func:`train` — the loop itself (AdamW, warmup + cosine learning rate, gradient clipping,
loss = cross-entropy + the routers' auxiliary losses) — and :func:`sample`.

Reproducibility: the batch of step ``s`` comes from a generator seeded by ``(seed, s)``
(:func:`moeblaze.data.get_batch`), and a checkpoint holds the weights (safetensors), the AdamW state
(``torch.save``), the step and the RNG state (JSON). So ``--steps 2N`` equals ``--steps 2N
--stop-after N`` followed by ``--steps 2N --resume``, bitwise on CPU.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_model, save_model
from tqdm import tqdm

from .data import eval_windows, get_batch, load_corpus, unigram_entropy
from .layer import aux_loss
from .memory import SavedTensorCounter
from .model import ModelConfig, MoETransformer

__all__ = ["ConfigError", "TrainConfig", "TrainResult", "load_run_config", "sample", "train"]

# Dense bf16 tensor-core peak (FLOP/s, no sparsity) from the vendors' data sheets, for MFU.


DENSE_BF16_PEAK_TFLOPS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("H800", 989.0),
          ("H20", 148.0), ("GH200", 989.0), ("B200", 2250.0), ("B300", 2250.0), ("A100", 312.0),
          ("A800", 312.0), ("L40S", 362.0), ("L4", 121.0), ("A10", 125.0)]


# Data-sheet fp32 peak without tensor cores (IEEE fp32, float32 matmul precision "highest"), for MFU.
FP32_PEAK_TFLOPS = [("H100 PCIe", 51.0), ("H100 NVL", 60.0), ("H100", 67.0), ("H200", 67.0), ("GH200", 67.0),
                    ("A100", 19.5), ("L40S", 91.6), ("L4", 30.3), ("A10", 31.2)]

PRECISIONS = ("auto", "bf16-mixed", "bf16", "fp32")


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


@dataclass
class TrainConfig:
    """Everything about a run except the model's sizes (see :class:`moeblaze.model.ModelConfig`)."""

    data: str | None = _f(None, "text file or directory to train on (default: the Python standard library)")
    out_dir: str = _f("moeblaze-out", "checkpoint directory")
    steps: int = _f(800, "total optimizer steps (the learning-rate schedule spans them)")
    stop_after: int = _f(0, "stop (and checkpoint) after this many steps; 0 = run all --steps")
    batch_size: int = _f(16, "sequences per step (tokens per step = batch_size * seq_len)")
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
                        "unless torch's float32 matmul precision is 'highest'); auto: bf16-mixed on cuda, fp32 on cpu",
                        choices=PRECISIONS)
    threads: int = _f(0, "CPU threads for torch (0 = all available cores)")
    eval_interval: int = _f(200, "evaluate validation bits-per-byte every this many steps")
    eval_tokens: int = _f(131072, "validation tokens per evaluation (evenly spaced windows)")
    checkpoint_interval: int = _f(0, "also checkpoint every this many steps (0 = only at the end)")
    val_fraction: float = _f(0.1, "share of files (or bytes, for a single file) held out for validation")
    resume: bool = _f(False, "continue the run checkpointed in --out-dir")
    progress: bool = _f(True, "show a progress bar")
    peak_tflops: float = _f(0.0, "GPU peak TFLOP/s for MFU (0 = look up the GPU's dense bf16 peak)")

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_interval", "eval_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("stop_after", "warmup_steps", "checkpoint_interval", "threads", "grad_clip",
                     "weight_decay", "peak_tflops"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not (self.lr > 0 and 0 <= self.min_lr <= self.lr):
            raise ConfigError(f"need lr > 0 and 0 <= min-lr <= lr, got lr={self.lr}, min-lr={self.min_lr}")
        if not (0 < self.val_fraction < 1):
            raise ConfigError(f"val-fraction must be in (0, 1), got {self.val_fraction}")


@dataclass
class TrainResult:
    """What :func:`train` measured. Bits per byte are on the validation data."""

    step: int
    val_bpb: float
    unigram_bpb: float
    train_loss: float
    tokens_per_s: float
    moe_saved_bytes: int
    losses: list[float]
    mfu: float | None = None


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

    ``auto`` is ``bf16-mixed`` on CUDA (not yet measured against ``bf16`` for the default preset:
    ``benchmarks/bench_precision.py --parts train`` compares them) and ``fp32`` on CPU.
    """
    if name == "auto":
        name = "bf16-mixed" if device.type == "cuda" else "fp32"
    if name not in PRECISIONS:
        raise ConfigError(f"unknown --precision {name!r} (use one of {', '.join(PRECISIONS)})")
    param = torch.bfloat16 if name == "bf16" else torch.float32
    return name, param, (torch.bfloat16 if name == "bf16-mixed" else None)


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
    """AdamW with weight decay on matrices (ndim >= 2: embeddings, projections, experts, routers) only."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=True)


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

@torch.no_grad()
def evaluate(model: MoETransformer, data, cfg: TrainConfig, device: torch.device,
             autocast: torch.dtype | None = None) -> float:
    """Validation bits per byte: mean next-byte cross-entropy (nats) / ln 2 over fixed windows
    (the forward under ``torch.autocast(autocast)`` when given, as in training)."""
    model.eval()
    total, count = 0.0, 0
    for x, y in eval_windows(data, cfg.eval_tokens, model.cfg.seq_len, cfg.batch_size):
        with autocast_context(device, autocast):
            logits = model(x.to(device))
        total += F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten(), reduction="sum").item()
        count += y.numel()
    model.train()
    return total / count / math.log(2)


# ----------------------------------------------------------------------------- checkpoints

def save_checkpoint(out_dir: str, model: MoETransformer, opt: torch.optim.Optimizer, step: int,
                    cfg: TrainConfig) -> None:
    """Write ``model.safetensors``, ``optimizer.pt`` and ``state.json`` (config, step, RNG) atomically."""
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    rng = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        rng["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    state = {"step": step, "model_config": asdict(model.cfg), "train_config": asdict(cfg), "rng": rng}
    save_model(model, str(path / "model.safetensors.tmp"))
    torch.save(opt.state_dict(), path / "optimizer.pt.tmp")
    (path / "state.json.tmp").write_text(json.dumps(state, indent=1))
    for name in ("model.safetensors", "optimizer.pt", "state.json"):  # state.json last: it marks completion
        os.replace(path / f"{name}.tmp", path / name)


def _read_state(out_dir: str) -> dict:
    state_file = Path(out_dir) / "state.json"
    if not state_file.is_file():
        raise ConfigError(f"no checkpoint in {out_dir} (missing {state_file})")
    return json.loads(state_file.read_text())


def load_run_config(out_dir: str) -> tuple[TrainConfig, ModelConfig, int]:
    """The configurations and step stored in the checkpoint at ``out_dir`` (raises :class:`ConfigError`)."""
    state = _read_state(out_dir)
    known = {f.name for f in fields(TrainConfig)}
    tcfg = TrainConfig(**{k: v for k, v in state["train_config"].items() if k in known})
    return tcfg, ModelConfig(**state["model_config"]), int(state["step"])


def load_checkpoint(out_dir: str, model: MoETransformer, opt: torch.optim.Optimizer | None,
                    device: torch.device) -> int:
    """Restore weights, optimizer state and RNG from ``out_dir``; returns the step to continue from."""
    state = _read_state(out_dir)
    if state["model_config"] != asdict(model.cfg):
        diff = {k: (v, state["model_config"].get(k)) for k, v in asdict(model.cfg).items()
                if state["model_config"].get(k) != v}
        raise ConfigError(f"model config differs from the checkpoint in {out_dir} (now, saved): {diff}")
    load_model(model, str(Path(out_dir) / "model.safetensors"), device=str(device))
    if opt is not None:
        opt.load_state_dict(torch.load(Path(out_dir) / "optimizer.pt", map_location=device, weights_only=True))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["rng"]["torch"])), dtype=torch.uint8))
    if device.type == "cuda" and "cuda" in state["rng"]:
        torch.cuda.set_rng_state_all([torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
                                      for s in state["rng"]["cuda"]])
    return int(state["step"])


# ----------------------------------------------------------------------------- training

def _describe(model: MoETransformer, mcfg: ModelConfig, cfg: TrainConfig, device, precision, threads) -> str:
    total = sum(p.numel() for p in model.parameters())
    return (f"model: {mcfg.n_layers} layers, d={mcfg.d_model}, heads={mcfg.n_heads}, E={mcfg.num_experts}, "
            f"K={mcfg.top_k}, h={mcfg.d_ff}, seq={mcfg.seq_len}; {total / 1e6:.2f}M parameters, "
            f"{mcfg.active_params_per_token() / 1e6:.2f}M active per token\n"
            f"run: {cfg.steps} steps x {cfg.batch_size * mcfg.seq_len} tokens, lr {cfg.lr:g}, "
            f"device {device}, precision {precision}, {threads} threads")


def train_step(model: MoETransformer, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, lr: float,
               grad_clip: float, counter: SavedTensorCounter | None = None,
               autocast: torch.dtype | None = None) -> float:
    """One optimizer step on a batch ``x, y [B, seq]`` (int64 bytes); returns the cross-entropy (nats).

    The loss is cross-entropy plus the MoE layers' auxiliary losses; gradients are clipped to
    ``grad_clip`` (0: off). With ``counter``, the forward runs under it (bytes saved for backward). With
    ``autocast`` (mixed precision), the forward runs under ``torch.autocast(x.device.type, autocast)``; the
    backward and the optimizer step run outside it, on the fp32 parameters.
    Reading the loss synchronises, so step timings are honest on CUDA too.
    """
    for group in opt.param_groups:
        group["lr"] = lr
    with counter if counter is not None else contextlib.nullcontext(), autocast_context(x.device, autocast):
        logits = model(x)
    ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    (ce + aux_loss(model).to(x.device)).backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return ce.item()


def train(cfg: TrainConfig, model_cfg: ModelConfig | None = None, log=tqdm.write) -> TrainResult:
    """Train a :class:`MoETransformer` as configured; checkpoint to ``cfg.out_dir``.

    Args:
        cfg: the run. With ``cfg.resume`` the checkpoint in ``cfg.out_dir`` is continued; its model
            configuration is used when ``model_cfg`` is None and must equal ``model_cfg`` otherwise.
        model_cfg: the model sizes (default :class:`ModelConfig`).
        log: where progress lines go (``tqdm.write`` by default: stdout, without breaking the bar).

    Returns:
        A :class:`TrainResult` (final validation bits per byte, throughput, bytes saved, ...).

    Raises:
        ConfigError: bad device/precision, nothing to resume, resume with a different model.
        moeblaze.data.DataError: missing or unusable data.
    """
    device = resolve_device(cfg.device)
    precision, dtype, amp_dtype = resolve_precision(cfg.precision, device)
    threads = set_threads(cfg, device)
    if cfg.resume and model_cfg is None:
        model_cfg = load_run_config(cfg.out_dir)[1]
    mcfg = model_cfg or ModelConfig()

    t_load = time.perf_counter()
    corpus = load_corpus(cfg.data, cfg.val_fraction, min_bytes=max(1024, mcfg.seq_len + 2))
    entropy = unigram_entropy(corpus.val)
    log(f"data: {corpus.source}; {len(corpus.train):,} train / {len(corpus.val):,} validation bytes "
        f"(loaded in {time.perf_counter() - t_load:.1f} s)")
    log(f"baseline: order-0 (unigram) entropy of the validation bytes = {entropy:.3f} bits/byte")

    torch.manual_seed(cfg.seed)
    model = MoETransformer(mcfg).to(device=device, dtype=dtype)
    opt = make_optimizer(model, cfg)
    start = load_checkpoint(cfg.out_dir, model, opt, device) if cfg.resume else 0
    stop = min(cfg.steps, cfg.stop_after) if cfg.stop_after > 0 else cfg.steps
    log(_describe(model, mcfg, cfg, device, precision, threads) + (f"; resuming at step {start}" if start else ""))
    peak = gpu_peak_flops(device, cfg, precision)
    flops_per_token = mcfg.train_flops_per_token()
    tokens_per_step = cfg.batch_size * mcfg.seq_len

    saved, losses, val_bpb, train_time, mfu = 0, [], float("nan"), 0.0, None
    bar = tqdm(range(start, stop), initial=start, total=stop, disable=not cfg.progress, unit="step",
               dynamic_ncols=True, desc="train")
    for step in bar:
        t0 = time.perf_counter()
        x, y = (t.to(device) for t in get_batch(corpus.train, step, cfg.batch_size, mcfg.seq_len, cfg.seed))
        # measure once; the hooks pass tensors through, so results do not change
        counter = SavedTensorCounter(list(model.parameters())).track(model.moe_layers()) if step == start else None
        losses.append(train_step(model, opt, x, y, lr_at(step, cfg), cfg.grad_clip, counter, amp_dtype))
        saved = counter.bytes if counter is not None else saved
        train_time += time.perf_counter() - t0
        tok_s = (step + 1 - start) * tokens_per_step / train_time
        mfu = flops_per_token * tok_s / peak if peak else None
        bar.set_postfix_str(f"loss {losses[-1]:.3f} ({losses[-1] / math.log(2):.2f} bpb), {tok_s:,.0f} tok/s"
                            + (f", MFU {100 * mfu:.1f}%" if mfu is not None else ""))
        if step == start:
            log(f"MoE layers saved for backward: {saved / 2**20:.2f} MiB per step "
                f"({saved / tokens_per_step:.0f} bytes/token, save={mcfg.save}; layer inputs included, "
                "parameters excluded)")
        last = step + 1 == stop
        if (step + 1) % cfg.eval_interval == 0 or last:
            val_bpb = evaluate(model, corpus.val, cfg, device, amp_dtype)
            log(f"step {step + 1}: train loss {losses[-1]:.3f}, val {val_bpb:.3f} bits/byte "
                       f"(unigram {entropy:.3f}), {tok_s:,.0f} tok/s")
        if last or (cfg.checkpoint_interval and (step + 1) % cfg.checkpoint_interval == 0):
            save_checkpoint(cfg.out_dir, model, opt, step + 1, cfg)
    bar.close()

    tok_s = (stop - start) * tokens_per_step / train_time if train_time else 0.0
    log(f"done: step {stop}, val {val_bpb:.3f} bits/byte vs unigram {entropy:.3f}; "
        f"{tok_s:,.0f} tokens/s; MoE saved {saved / 2**20:.2f} MiB/step; checkpoint in {cfg.out_dir}")
    if device.type == "cuda":
        log(f"MFU: {100 * mfu:.1f}% of {peak / 1e12:.0f} TFLOP/s ({flops_per_token / 1e6:.2f} MFLOP/token = "
            "6 x active params + 12 x layers x d x seq)" if mfu is not None
            else "MFU: unknown GPU peak; pass --peak-tflops")
    return TrainResult(stop, val_bpb, entropy, losses[-1] if losses else float("nan"), tok_s, saved, losses, mfu)


def sample(checkpoint: str, prompt: str = "\n", max_new_tokens: int = 256, temperature: float = 0.8,
           top_k: int | None = None, seed: int = 0, device: str = "auto") -> str:
    """Generate text from a checkpoint directory written by :func:`train`.

    Args:
        checkpoint: the run's ``out_dir``. prompt: UTF-8 text to continue (empty means ``"\\n"``).
        max_new_tokens: bytes to generate. temperature: ``<= 0`` for greedy. top_k: keep the k likeliest bytes.
        seed: seed of the sampler. device: as ``--device``.

    Returns:
        The prompt followed by the generated bytes, decoded as UTF-8 (invalid bytes replaced).

    Raises:
        ConfigError: no checkpoint in ``checkpoint`` or a bad device.
    """
    dev = resolve_device(device)
    _, mcfg, _ = load_run_config(checkpoint)
    model = MoETransformer(mcfg)
    load_model(model, str(Path(checkpoint) / "model.safetensors"))
    model.to(dev).eval()
    data = (prompt or "\n").encode("utf-8")
    idx = torch.tensor([list(data)], dtype=torch.long, device=dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=gen)
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")
