"""The dispatch micro-benchmark and the end-to-end training throughput benchmark (CUDA only).

Dispatch: time to build the index of DESIGN.md §3 from ``topk_ids`` — :func:`moeblaze.build_dispatch`
(the Triton build on CUDA when present), the PyTorch build :func:`moeblaze.dispatch.build_dispatch_torch`,
and the conventional stable ``argsort`` build (:func:`moeblaze.bench.baselines.sort_dispatch`). Each
result is checked bitwise against the sort build.

Train: steps of ``MoETransformer`` (the model of ``moeblaze train``, at a GPU-sized config) with AdamW,
random bytes, bf16 weights: tokens/s and model FLOP utilisation (``ModelConfig.train_flops_per_token`` x
tokens/s over the device's dense bf16 peak), per expert backend.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..dispatch import _triton_dispatch, build_dispatch, build_dispatch_torch
from ..training.model import ModelConfig
from ..training.train_config import peak_tflops
from .baselines import sort_dispatch
from .runner import MIB, cuda_time_ms, require_cuda

__all__ = ["DISPATCH_SHAPES", "DISPATCH_COLUMNS", "TRAIN_COLUMNS", "run_dispatch", "run_train", "peak_tflops",
           "TrainSpec"]

# (T, E, K): the routings of the layer configs (DESIGN.md §6 and Table 1) plus two large ones.
DISPATCH_SHAPES = [(8192, 4, 1), (65536, 4, 1), (2097152, 4, 1), (65536, 16, 4), (32768, 64, 8),
                   (32768, 128, 8), (32768, 256, 8), (262144, 128, 8)]
DISPATCH_COLUMNS = ["T", "E", "K", "builder", "time_ms", "speedup_vs_sort", "status", "note"]
TRAIN_COLUMNS = ["backend", "d_model", "n_layers", "d_ff", "num_experts", "top_k", "batch", "seq_len",
                 "step_ms", "tokens_per_s", "tflops", "mfu", "peak_mib", "status", "note"]

# Dense bf16 tensor-core peak (TFLOP/s, no sparsity) from the vendor data sheets, by device-name substring;
# first match wins.
def _routing(T: int, E: int, K: int, device: str = "cuda") -> torch.Tensor:
    return torch.rand(T, E, device=device).topk(K, dim=1).indices.to(torch.int32)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))


def run_dispatch(shapes: list[tuple[int, int, int]] | None = None, reps: int = 50,
                 on_row: Callable[[dict], None] | None = None, device: str = "cuda") -> list[dict]:
    """Median build time (ms) of each dispatch builder at each ``(T, E, K)``; rows of :data:`DISPATCH_COLUMNS`.

    ``device="cpu"`` exists for tests (wall-clock times).

    Raises:
        NoCudaError: no CUDA GPU (``device="cuda"``).
    """
    if device != "cpu":
        require_cuda("moeblaze bench --suite dispatch")
    triton_build = _triton_dispatch(torch.empty(0, device=device))  # what build_dispatch runs on this device
    builders = {"sort (argsort)": sort_dispatch,
                "moeblaze" + (" (triton)" if triton_build else " (torch: no triton build)"):
                    lambda ids, E: build_dispatch(ids, E, validate=False),
                "moeblaze torch build": build_dispatch_torch}
    rows = []
    for T, E, K in shapes or DISPATCH_SHAPES:
        ids = _routing(T, E, K, device)
        ref = sort_dispatch(ids, E)
        base = None
        for name, fn in builders.items():
            row = {"T": T, "E": E, "K": K, "builder": name, "status": "ok", "note": ""}
            try:
                same = _same(fn(ids, E), ref)
                for _ in range(3):
                    fn(ids, E)
                row["time_ms"] = statistics.median(cuda_time_ms(lambda f=fn, i=ids, e=E: f(i, e), reps))
                base = row["time_ms"] if name.startswith("sort") else base
                row["speedup_vs_sort"] = round(base / row["time_ms"], 2) if base else None
                row["note"] = "" if same else "MISMATCH vs sort build"
            except torch.OutOfMemoryError:
                row["status"] = "OOM"
            except Exception as exc:
                row["status"], row["note"] = "error", f"{type(exc).__name__}: {str(exc)[:120]}"
            rows.append(row)
            if on_row:
                on_row(row)
        del ids, ref
        _free()
    return rows


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class TrainSpec:
    """The model and batch of the training benchmark (see ``run_train``).

    Attributes:
        model: a GPU-sized :class:`moeblaze.training.model.ModelConfig` (its ``backend`` is set per run).
        batch: sequences of ``model.seq_len`` tokens per step. steps: timed steps. warmup: untimed steps.
    """

    model: ModelConfig = field(default_factory=lambda: ModelConfig(
        seq_len=2048, d_model=1024, n_layers=4, n_heads=8, d_ff=1024, num_experts=32, top_k=4))
    batch: int = 16
    steps: int = 10
    warmup: int = 3


def _train_row(spec: TrainSpec, backend: str, peak: float | None, device: str) -> dict:
    from ..layer import aux_loss
    from ..training.model import MoETransformer

    cfg = dataclasses.replace(spec.model, backend=backend)
    cuda = device.startswith("cuda")
    model = MoETransformer(cfg).to(device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    gen = torch.Generator(device=device).manual_seed(0)
    data = torch.randint(0, 256, (spec.batch, cfg.seq_len + 1), device=device, generator=gen)

    def step() -> None:
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, cfg.vocab_size), data[:, 1:].reshape(-1)) + aux_loss(model)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(spec.warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    ms = statistics.median(cuda_time_ms(step, spec.steps))
    tokens = spec.batch * cfg.seq_len
    tflops = cfg.train_flops_per_token(cfg.seq_len) * tokens / (ms * 1e-3) / 1e12
    return {"step_ms": ms, "tokens_per_s": tokens / (ms * 1e-3), "tflops": tflops,
            "mfu": tflops / peak if peak else None,
            "peak_mib": torch.cuda.max_memory_allocated() / MIB if cuda else None}


def run_train(spec: TrainSpec | None = None, backends: tuple[str, ...] = ("triton", "torch"),
              peak: float | None = None, on_row: Callable[[dict], None] | None = None,
              device: str = "cuda") -> list[dict]:
    """Training throughput of ``MoETransformer`` per expert backend; rows of :data:`TRAIN_COLUMNS`.

    Args:
        spec: sizes (default :class:`TrainSpec`). backends: ``moeblaze.MoE`` backends to compare.
        peak: dense bf16 TFLOP/s of the device for MFU (default: :func:`peak_tflops` of its name).
        device: ``cuda``; ``cpu`` exists for tests (fp32, wall clock, no peak memory).

    Raises:
        NoCudaError: no CUDA GPU (``device="cuda"``).
    """
    if device != "cpu":
        require_cuda("moeblaze bench --suite train")
    from ..backends import triton_available

    spec = spec or TrainSpec()
    peak = peak or (peak_tflops(torch.cuda.get_device_name()) if device != "cpu" else None)
    rows = []
    for backend in backends:
        row = {k: getattr(spec.model, k) for k in ("d_model", "n_layers", "d_ff", "num_experts", "top_k", "seq_len")}
        row["batch"] = spec.batch
        row.update(backend=backend, status="ok", note="" if peak else "MFU: unknown device peak (--peak-tflops)")
        if backend == "triton" and (device == "cpu" or not triton_available()):
            row.update(status="unavailable", note="moeblaze.kernels.experts not in this build")
        else:
            try:
                row.update(_train_row(spec, backend, peak, device))
            except torch.OutOfMemoryError:
                row["status"] = "OOM"
            except Exception as exc:
                row.update(status="error", note=f"{type(exc).__name__}: {str(exc)[:120]}")
        _free()
        rows.append(row)
        if on_row:
            on_row(row)
    return rows
