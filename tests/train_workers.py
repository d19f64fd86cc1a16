"""Rank bodies of the multi-process ``moeblaze train`` tests (run by ``dist_utils.run_ranks``, gloo on the CPU,
or NCCL on GPUs): :func:`moeblaze.training.train.train` with ``--fsdp`` / ``--ep`` inside an initialised process
group."""

from __future__ import annotations

import math
import os
import shutil
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch.distributed as dist

import moeblaze.training.train as train_module
from moeblaze.parallel import exchange
from moeblaze.training.model import ModelConfig
from moeblaze.training.train import ConfigError, TrainConfig, TrainResult, train


def tiny_configs(data: str, out_dir: str, **train_kw) -> tuple[TrainConfig, ModelConfig]:
    """A run small enough for 2 gloo ranks on 2 shared CPU cores: 20 steps of 4 x 16 bytes."""
    cfg = TrainConfig(data=data, out_dir=out_dir, steps=20, batch_size=4, warmup_steps=2, eval_interval=10,
                      eval_tokens=96, checkpoint_interval=0, checkpoint_minutes=0.0, progress=False, threads=1,
                      device="cpu", overwrite=True, **train_kw)
    mcfg = ModelConfig(seq_len=16, d_model=16, n_layers=2, n_heads=2, d_ff=8, num_experts=4, top_k=2,
                       backend="torch")
    return cfg, mcfg


def _same_on_all_ranks(value) -> None:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    assert all(v == values[0] for v in values), f"ranks disagree: {values}"


def runs(rank: int, world: int, data: str, tmp: str, results: dict) -> None:
    """FSDP2 (also in 2 micro-batches a step, all blocks one unit) and FSDP2 + EP runs of 20 steps (EP: a checkpoint
    every 5); the EP run also stopped at step 10, resumed on the same layout and on FSDP2 without EP (another P).
    Results land in ``results`` (a manager dict) from rank 0."""
    tmp = Path(tmp)
    fsdp_cfg, mcfg = tiny_configs(data, str(tmp / "fsdp"), fsdp=True)
    fsdp = train(fsdp_cfg, replace(mcfg, aux_loss_coef=0.0))
    # two micro-batches a step, and the model's blocks in one FSDP2 unit (--fsdp-blocks-per-unit): the same steps
    accum = train(replace(fsdp_cfg, out_dir=str(tmp / "accum"), grad_accum=2, fsdp_blocks_per_unit=mcfg.n_layers),
                  replace(mcfg, aux_loss_coef=0.0))
    # checkpoints every 5 steps: training goes on after each save (a save once left global-shape expert moments
    # in the live optimizer, and the next step failed)
    ep_cfg = replace(fsdp_cfg, out_dir=str(tmp / "ep"), ep=world, checkpoint_interval=5)
    ep = train(ep_cfg, mcfg)
    half = train(replace(ep_cfg, out_dir=str(tmp / "half"), stop_after=10), mcfg)
    assert half.status == "done" and half.step == 10
    if rank == 0:  # copies for the other resumes (here: the same layout, and P = 1; the test: one process)
        for name in ("half_p1", "half_1proc"):
            shutil.copytree(tmp / "half", tmp / name)
    dist.barrier()
    same = train(replace(ep_cfg, out_dir=str(tmp / "half"), resume=True, overwrite=False), mcfg)
    other_p = train(replace(ep_cfg, out_dir=str(tmp / "half_p1"), resume=True, overwrite=False, ep=1), mcfg)
    # the sync-free exchange, whose T_cap the loop gives (rows per rank x seq_len): no host agreement on it
    agree = exchange.Exchange.tokens_cap
    exchange.Exchange.tokens_cap = lambda self, T: pytest.fail(f"the ranks agreed on T_cap (T={T})")
    try:
        padded = train(replace(ep_cfg, out_dir=str(tmp / "padded"), ep_exchange="padded"), mcfg)
    finally:
        exchange.Exchange.tokens_cap = agree
    _same_on_all_ranks((ep.losses, ep.val_bpb))
    if rank == 0:
        results.update(fsdp=fsdp.losses, fsdp_val=fsdp.val_bpb, ep=ep.losses, ep_val=ep.val_bpb,
                       same=same.losses, same_val=same.val_bpb, other_p=other_p.losses, world=ep.world_size,
                       padded=padded.losses, padded_val=padded.val_bpb, accum=accum.losses)


def faults(rank: int, world: int, data: str, tmp: str) -> None:
    """Ranks started with different flags: every rank raises a ConfigError naming the field (no hang).
    SIGTERM to rank 1 alone during step 3: both ranks stop after step 3 with one checkpoint."""
    cfg, mcfg = tiny_configs(data, str(Path(tmp) / "mismatch"), fsdp=True)
    with pytest.raises(ConfigError, match=r"different configurations: .*lr = 0.003 \(rank 0\), 0.004 \(rank 1\)"):
        train(replace(cfg, lr=(0.003, 0.004)[rank]), mcfg)
    with pytest.raises(ConfigError, match=r"num_experts = 4 \(rank 0\), 8 \(rank 1\)"):
        train(cfg, replace(mcfg, num_experts=4 * (rank + 1)))
    with pytest.raises(ConfigError, match="--ep 3 must divide the number of processes 2"):
        train(replace(cfg, ep=3), mcfg)
    with pytest.raises(ConfigError, match="--batch-size 3 .* divisible by the number of processes 2"):
        train(replace(cfg, batch_size=3), mcfg)

    step_fn, steps_run = train_module.train_step, []

    def signalled_step(*args, **kwargs):
        steps_run.append(1)
        if rank == 1 and len(steps_run) == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # handled by the loop: finish the step, checkpoint, stop
        return step_fn(*args, **kwargs)

    train_module.train_step = signalled_step
    try:
        result = train(replace(cfg, out_dir=str(Path(tmp) / "signal")), mcfg)
    finally:
        train_module.train_step = step_fn
    assert (result.status, result.step) == ("SIGTERM", 3), (result.status, result.step)
    assert Path(result.checkpoint).name == "step-000003"


def _gpu_configs(data: str, out_dir: str) -> tuple[TrainConfig, ModelConfig]:
    cfg = TrainConfig(data=data, out_dir=out_dir, steps=8, batch_size=8, warmup_steps=2, eval_interval=8,
                      eval_tokens=2048, checkpoint_interval=0, checkpoint_minutes=0.0, progress=False, device="cuda",
                      precision="bf16-mixed", overwrite=True)
    mcfg = ModelConfig(seq_len=128, d_model=128, n_layers=2, n_heads=4, d_ff=64, num_experts=8, top_k=2,
                       backend="triton")
    return cfg, mcfg


def _bf16_close(a: TrainResult, b: TrainResult, what: str) -> None:
    """bf16 runs of the same steps agree to 2% (autocast runs the norms, softmax and losses in fp32 where
    FSDP2's bf16 parameters run them in bf16; bf16 rounds to 2^-8 = 0.4% per operation): not bitwise."""
    assert a.losses[-1] < a.losses[0], a.losses
    for step, (x, y) in enumerate(zip(a.losses, b.losses)):
        assert abs(x - y) <= 0.02 * abs(y), f"step {step + 1}: loss {x} {what}, {y} without"
    assert abs(a.val_bpb - b.val_bpb) <= 0.02 * b.val_bpb, (a.val_bpb, b.val_bpb)


def fsdp_bf16_matches_plain(rank: int, world: int, data: str, tmp: str) -> None:
    """GPU, one NCCL rank: ``--fsdp`` with the Triton kernels in bf16 (``bf16-mixed``: FSDP2's bf16
    parameters, fp32 reductions) and ``--compile`` (inductor) train as the plain run does (``bf16-mixed``:
    autocast)."""
    cfg, mcfg = _gpu_configs(data, str(Path(tmp) / "plain"))
    plain = train(cfg, mcfg)
    fsdp = train(replace(cfg, out_dir=str(Path(tmp) / "fsdp"), fsdp=True), mcfg)
    assert fsdp.world_size == world
    _bf16_close(fsdp, plain, "under FSDP2")
    compiled = train(replace(cfg, out_dir=str(Path(tmp) / "compiled"), fsdp=True, compile=True), mcfg)
    _bf16_close(compiled, plain, "compiled under FSDP2")


def two_gpus_match(rank: int, world: int, data: str, tmp: str, plain_losses: list, plain_val: float) -> None:
    """2 GPUs (NCCL, Triton, bf16): --fsdp, --fsdp --ep 2 and --fsdp --ep 2 --compile train as one GPU does on the
    same global batch (``plain_*``: the test process's one-GPU run); the --ep 2 checkpoint resumes on the 2 GPUs
    with --ep 1."""
    cfg, mcfg = _gpu_configs(data, str(Path(tmp) / "fsdp"))
    plain = TrainResult(8, plain_val, 0.0, plain_losses[-1], 0.0, 0, plain_losses)
    _bf16_close(train(replace(cfg, fsdp=True), mcfg), plain, "under FSDP2 on 2 GPUs")
    ep_cfg = replace(cfg, out_dir=str(Path(tmp) / "ep"), fsdp=True, ep=2)
    _bf16_close(train(ep_cfg, mcfg), plain, "under FSDP2 + EP on 2 GPUs")
    compiled = replace(ep_cfg, out_dir=str(Path(tmp) / "compiled"), compile=True)  # attention compiled, EP eager
    _bf16_close(train(compiled, mcfg), plain, "compiled under FSDP2 + EP on 2 GPUs")
    resumed = train(replace(ep_cfg, steps=10, ep=1, resume=True, overwrite=False), mcfg)
    assert resumed.step == 10 and len(resumed.losses) == 2 and all(map(math.isfinite, resumed.losses))


def strided_save(rank: int, world: int, data: str, tmp: str) -> None:
    """4 ranks, mesh (dp_shard 2, ep 2): each expert weight split by ep, then by dp_shard inside it (FSDP2's
    _StridedShard in the checkpoint); 3 of 6 steps, then a checkpoint (the test resumes it in one process)."""
    cfg, mcfg = tiny_configs(data, str(Path(tmp) / "strided"), fsdp=True, ep=2)
    result = train(replace(cfg, steps=6, stop_after=3), replace(mcfg, aux_loss_coef=0.0))
    assert result.step == 3 and result.world_size == world
