"""``moeblaze train`` on several processes (issue 23, item 4): FSDP2 and FSDP2 + EP runs on 2 gloo ranks track
one process on the same global batch; DCP checkpoints written on 2 ranks resume on 2 (bitwise, same layout),
on 2 with another expert-parallel size, and on 1; mismatched flags fail every rank; the CLI under torchrun."""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import train_workers as tw
from dist_utils import free_port, run_ranks
from moeblaze.training.train import train

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text(Path(argparse.__file__).read_text()[:40000])  # the standard library's: no edit here moves it
    return str(path)


def _close(a: list[float], b: list[float], rtol: float) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rtol) for x, y in zip(a, b))


def test_two_ranks_track_one_process_and_checkpoints_reshard(text_file, tmp_path):
    cfg, mcfg = tw.tiny_configs(text_file, str(tmp_path / "one"))
    one = train(cfg, mcfg)  # the reference: one process, the same global batch
    one_no_aux = train(replace(cfg, out_dir=str(tmp_path / "one_no_aux")), replace(mcfg, aux_loss_coef=0.0))
    with multiprocessing.Manager() as manager:
        results = manager.dict()
        run_ranks(tw.runs, 2, text_file, str(tmp_path), results, timeout=240)
        r = dict(results)
    assert r["world"] == 2
    # FSDP2 without EP: each rank's load-balancing loss counts its own tokens, so it is off here; the rest of
    # the step is the one-process step on the global batch (fp32, sums in another order).
    assert _close(r["fsdp"], one_no_aux.losses, 1e-4), (r["fsdp"], one_no_aux.losses)
    assert math.isclose(r["fsdp_val"], one_no_aux.val_bpb, rel_tol=1e-4)
    # --grad-accum 2 under FSDP2 (gradients reduced after the second micro-batch only), the blocks in one unit
    # (--fsdp-blocks-per-unit): the same steps.
    assert _close(r["accum"], r["fsdp"], 1e-4), (r["accum"], r["fsdp"])
    # EP over both ranks: the load-balancing loss counts the group's (= all) tokens, as one process does.
    assert _close(r["ep"], one.losses, 1e-4), (r["ep"], one.losses)
    assert math.isclose(r["ep_val"], one.val_bpb, rel_tol=1e-4)
    # The sync-free exchange with the loop's token bound moves the same rows: the same run.
    assert _close(r["padded"], r["ep"], 1e-6) and math.isclose(r["padded_val"], r["ep_val"], rel_tol=1e-6)
    # Resume on the same 2-rank layout: bitwise the uninterrupted run.
    assert r["same"] == r["ep"][10:] and r["same_val"] == r["ep_val"]
    # Resume with P = 1 (FSDP2 only) on 2 ranks, and in one process without FSDP2: DCP reshards the experts. The
    # first resumed step is the EP run's (the resharded weights and moments); later ones drift a little, as the
    # load-balancing loss of P = 1 counts each rank's own tokens (2.5e-4 relative by step 18 on this data).
    assert _close(r["other_p"][:1], r["ep"][10:11], 1e-5), (r["other_p"], r["ep"][10:])
    assert _close(r["other_p"], r["ep"][10:], 1e-3), (r["other_p"], r["ep"][10:])
    resumed = train(replace(cfg, out_dir=str(tmp_path / "half_1proc"), resume=True, overwrite=False), mcfg)
    assert _close(resumed.losses, one.losses[10:], 1e-4), (resumed.losses, one.losses[10:])


def test_mismatched_configuration_and_a_signal_on_one_rank(text_file, tmp_path):
    run_ranks(tw.faults, 2, text_file, str(tmp_path), timeout=120)


def test_cli_under_torchrun_logs_once(text_file, tmp_path):
    """``torchrun --nproc-per-node 2 -m moeblaze.cli train --fsdp --ep 2``: exit 0, one log (rank 0)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "moeblaze.cli", "train", "--fsdp", "--ep", "2", "--data", text_file, "--out-dir", str(tmp_path / "r"),
           "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--d-model", "16", "--n-layers", "1",
           "--n-heads", "2", "--d-ff", "8", "--num-experts", "4", "--eval-tokens", "32", "--device", "cpu",
           "--backend", "torch", "--threads", "1", "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("done: step 2") == 1, proc.stdout
    assert "2 processes, FSDP2 + expert parallelism over 2" in proc.stdout


def test_launch_errors(text_file, tmp_path, monkeypatch):
    """Several processes without --fsdp, --fsdp outside torchrun: one-line errors before anything runs."""
    from moeblaze.training.train import ConfigError

    cfg, mcfg = tw.tiny_configs(text_file, str(tmp_path / "r"))
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="--fsdp needs torchrun"):
        train(replace(cfg, fsdp=True), mcfg)
    with pytest.raises(ConfigError, match="--ep 2 needs --fsdp"):
        train(replace(cfg, ep=2), mcfg)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"2 processes \(WORLD_SIZE=2\) need --fsdp"):
        train(cfg, mcfg)


def test_1b_preset(tmp_path, capsys):
    """``--preset 1b``: about 1e9 parameters (E 64, K 8), flags given still win; not with --resume."""
    from moeblaze.cli import _configs, build_parser, main
    from moeblaze.training.model import MoETransformer

    cfg, mcfg = _configs(build_parser().parse_args(["train", "--preset", "1b", "--seq-len", "512"]))
    assert (mcfg.num_experts, mcfg.top_k, mcfg.d_model, mcfg.seq_len, cfg.lr) == (64, 8, 1024, 512, 1e-3)
    with torch.device("meta"):
        total = sum(p.numel() for p in MoETransformer(mcfg).parameters())
    assert 0.9e9 < total < 1.2e9, total
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--preset", "1b", "--resume", "--out-dir", str(tmp_path)])
    assert exit_info.value.code == 2 and "--preset sets up a fresh run" in capsys.readouterr().err


@pytest.mark.gpu
def test_fsdp_train_bf16_triton_one_gpu(text_file, tmp_path):
    """``moeblaze train --fsdp`` on a 1-rank NCCL job, Triton kernels, bf16, also with ``--compile``: train like the
    plain run."""
    run_ranks(tw.fsdp_bf16_matches_plain, 1, text_file, str(tmp_path), backend="nccl", timeout=600)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port", str(free_port()),
           "-m", "moeblaze.cli", "train", "--fsdp", "--data", text_file, "--out-dir", str(tmp_path / "cli"),
           "--steps", "3", "--batch-size", "4", "--seq-len", "64", "--eval-tokens", "256", "--device", "cuda",
           "--backend", "triton", "--precision", "bf16-mixed", "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "1 processes, FSDP2" in proc.stdout, proc.stderr[-3000:]


def test_checkpoint_of_a_2d_mesh_resumes_in_one_process(text_file, tmp_path):
    """Saved on 4 ranks with --fsdp --ep 2 (experts split by ep, then by dp_shard), resumed in one process:
    the one-process run's losses (no load-balancing loss, which would count each EP group's tokens)."""
    run_ranks(tw.strided_save, 4, text_file, str(tmp_path), timeout=180)
    cfg, mcfg = tw.tiny_configs(text_file, str(tmp_path / "one"))
    cfg, mcfg = replace(cfg, steps=6), replace(mcfg, aux_loss_coef=0.0)
    one = train(cfg, mcfg)
    resumed = train(replace(cfg, out_dir=str(tmp_path / "strided"), resume=True, overwrite=False, fsdp=False, ep=1),
                    mcfg)
    assert _close(resumed.losses, one.losses[3:], 1e-4), (resumed.losses, one.losses[3:])


@pytest.mark.multigpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2), reason="needs 2 CUDA GPUs")
def test_train_two_gpus_matches_one(text_file, tmp_path):
    """2 GPUs: ``--fsdp``, ``--fsdp --ep 2`` and with ``--compile`` (NCCL, Triton, bf16) train as one GPU does."""
    cfg, mcfg = tw._gpu_configs(text_file, str(tmp_path / "plain"))
    plain = train(cfg, mcfg)
    run_ranks(tw.two_gpus_match, 2, text_file, str(tmp_path), plain.losses, plain.val_bpb, backend="nccl",
              timeout=600)
