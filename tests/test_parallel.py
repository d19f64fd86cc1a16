"""Expert parallelism and FSDP2 (issue 23): multi-process runs equal one process on the concatenated tokens.

CPU: gloo, 2 and 4 spawned ranks, tiny shapes, float64/float32. GPU: ``gpu`` (1-rank NCCL) and
``multigpu`` (2 GPUs, bf16) versions; ``scripts/gpu_suite.sh multigpu`` runs the latter.
"""

from __future__ import annotations

import pytest
import torch

import parallel_workers as pw
from dist_utils import free_port, run_ranks
from moeblaze.fp8 import Float8Recipe

# (tokens per rank, E, K, d, h) and options; named edge cases of issue 23 and DESIGN.md §7.
CASES_2 = [
    {"tokens": [6, 4], "E": 4, "K": 2, "d": 16, "h": 8},
    {"tokens": [0, 5], "E": 4, "K": 2, "d": 16, "h": 8},  # a rank with zero tokens
    {"tokens": [1, 7], "E": 6, "K": 3, "d": 12, "h": 6, "score_func": "sigmoid", "save": "input"},  # T = 1
    {"tokens": [5, 3], "E": 4, "K": 1, "d": 16, "h": 8, "one_remote_expert": True},  # all to one remote expert
    {"tokens": [4, 4], "E": 2, "K": 2, "d": 10, "h": 5, "activation": "gelu"},  # K = E, one expert per rank
    {"tokens": [7, 5], "E": 4, "K": 2, "d": 16, "h": 8, "dtype": torch.float32},
    {"tokens": [6, 5], "E": 8, "K": 2, "d": 16, "h": 8, "score_func": "sigmoid", "n_group": 4, "topk_group": 2,
     "score_correction_bias": True, "routed_scaling_factor": 2.5, "shared_d_ff": 12},  # DeepSeek-V3 style
    {"tokens": [5, 6], "E": 4, "K": 2, "d": 16, "h": 8, "bias": True, "activation": "swiglu_clamped"},  # GPT-OSS
    {"tokens": [4, 3], "E": 4, "K": 2, "d": 12, "h": 6, "bias": True, "activation": "relu2"},  # non-gated biases
]
CASES_4 = [
    {"tokens": [3, 0, 5, 1], "E": 8, "K": 3, "d": 16, "h": 8},
    {"tokens": [2, 6, 1, 3], "E": 4, "K": 2, "d": 16, "h": 8, "dtype": torch.float32},
]


_TRITON = {"dtype": torch.float32, "backend": "triton", "d": 16, "h": 8}
TRITON_CASES = [  # the fused kernels in the interpreter, with zero tokens / zero received rows on a rank
    {"tokens": [5, 3], "E": 4, "K": 2, **_TRITON},
    {"tokens": [0, 3], "E": 4, "K": 2, **_TRITON},
    {"tokens": [3, 2], "E": 4, "K": 1, "one_remote_expert": True, **_TRITON},
    {"tokens": [4, 5], "E": 4, "K": 2, "bias": True, **_TRITON},
]


_FP8 = {"dtype": torch.float32, "d": 16, "h": 8, "fp8": Float8Recipe("rowwise")}
FP8_CASES = [  # the recipe's emulation; the Triton FP8 ops in the interpreter over foreign rows and packed rows
    {"tokens": [5, 3], "E": 4, "K": 2, **_FP8},
    {"tokens": [0, 4], "E": 4, "K": 2, "backend": "triton", "save": "input", "exchange": "padded", **_FP8},
    {"tokens": [4, 5], "E": 4, "K": 2, "backend": "triton", "exchange": "padded", "symmetric": True, **_FP8},
]


def _padded(cases: list[dict]) -> list[dict]:
    """The cases again over the sync-free exchange, each with the seed (the data) of its first run; every other one
    with ``max_tokens`` (no agreement on T_cap), two above the largest T (blocks padded past the group's T)."""
    return [{**c, "exchange": "padded", "seed": 100 + i, **({"max_tokens": max(c["tokens"]) + 2} if i % 2 else {})}
            for i, c in enumerate(cases)]


def test_ep_layer_2_ranks():
    """EP layer = one process (edge cases, fp64/fp32, the Triton kernels in the interpreter, FP8), with the exchange
    that reads the split sizes to the host and with the sync-free one (fixed capacities, rows past what a source
    sent are foreign), and the packed rows of the symmetric-memory exchange; a mismatched configuration or
    E % P != 0 fails on every rank."""
    symmetric = [{**c, "symmetric": True} for c in _padded(CASES_2[:4] + TRITON_CASES[:2])]
    cases = CASES_2 + TRITON_CASES + _padded(CASES_2 + TRITON_CASES) + symmetric + FP8_CASES
    run_ranks(pw.run_all, 2, [("ep_cases", (cases,)), ("bad_config", ())], timeout=360)


def test_fsdp2_2_ranks():
    """FSDP2 on a 1-D mesh and FSDP2 + EP on a (1, 2) mesh = one process, each block one unit or several blocks in
    one (``blocks_per_unit``); 5 AdamW steps track one process; the experts outside FSDP2 under a mixed-precision
    policy; the runtime helpers (process group, meshes, batch split) inside a job; the ranks agree on tuned kernels; FP8
    weight copies reused over micro-batches under FSDP2."""
    run_ranks(pw.run_all, 2, [("fsdp_equal", ((2,), ("dp_shard",))),
                              ("fsdp_equal", ((1, 2), ("dp_shard", "ep"))),
                              ("fsdp_equal", ((2,), ("dp_shard",), 0, 2, 2, 3)),  # two blocks a unit, then one
                              ("fsdp_equal", ((1, 2), ("dp_shard", "ep"), 0, 2, 3, 3)), ("fsdp_train", ()),
                              ("fsdp_mixed_precision", ()), ("fsdp_fp8_reuse", ()),
                              ("runtime_checks", ()), ("kernel_agreement", ())])


def test_ep_checkpoint_with_expert_biases_loads_in_one_process(tmp_path):
    """Expert biases of an EP layer are per-expert state like its weights: saved as global ``[E, ...]`` tensors
    on 2 ranks, they load into one process's full layer."""
    import moeblaze
    from moeblaze.training import checkpoint

    run_ranks(pw.run_all, 2, [("ep_bias_checkpoint", (str(tmp_path),))], timeout=120)
    torch.manual_seed(3)
    full = moeblaze.MoE(12, 6, 4, 2, bias=True, dtype=torch.float64)
    fresh = moeblaze.MoE(12, 6, 4, 2, bias=True, dtype=torch.float64)
    checkpoint.load(checkpoint.find_latest(tmp_path), fresh, torch.optim.AdamW(fresh.parameters()))
    for (name, a), b in zip(full.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name


def test_ep_and_2d_mesh_4_ranks():
    """EP over 4 ranks; FSDP2 + EP on a (2, 2) mesh: experts sharded over dp_shard inside each EP group,
    the router and a shared expert over the whole mesh; the same with two blocks in one unit."""
    run_ranks(pw.run_all, 4, [("ep_cases", (CASES_4 + _padded(CASES_4),)),
                              ("fsdp_equal", ((2, 2), ("dp_shard", "ep"), 12)),
                              ("fsdp_equal", ((2, 2), ("dp_shard", "ep"), 12, 2, 2, 3))])  # units of 2 + 1 blocks


def test_ep_needs_initialised_distributed():
    import moeblaze
    from moeblaze.parallel import expert_parallel

    with pytest.raises(RuntimeError, match="torch.distributed initialised"):
        expert_parallel(moeblaze.MoE(8, 4, 4, 2), object())


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_parallelize_names_a_bad_blocks_per_unit(n):
    import moeblaze
    from moeblaze.parallel import parallelize

    with pytest.raises(ValueError, match=r"blocks_per_unit must be a positive int .*got " + repr(n)):
        parallelize(moeblaze.MoE(8, 4, 4, 2), object(), blocks_per_unit=n)


@pytest.mark.gpu
def test_fsdp2_bf16_one_gpu_matches_unwrapped():
    """FSDP2 with bf16 mixed precision on a 1-rank NCCL mesh; the EP layer's GPU path (functional
    all-to-alls, Triton kernels over the received rows, fused sum of each token's rows) on a group of one, bf16."""
    cases = [{"tokens": [37], "E": 8, "K": 2, "d": 64, "h": 32, "dtype": torch.bfloat16, "backend": "triton"}]
    run_ranks(pw.run_all, 1, [("fsdp_bf16_matches_unwrapped", ()), ("ep_cases", (cases,))], backend="nccl",
              timeout=300)


def _two_gpus():
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


# FP8 on the GPU: bf16 rows dispatched in e4m3, the Triton FP8 ops over received (and padded, foreign) rows
_FP8_GPU = {"E": 8, "K": 2, "d": 64, "h": 32, "dtype": torch.bfloat16, "backend": "triton",
            "fp8": Float8Recipe("rowwise")}


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm90+)")
def test_ep_fp8_one_gpu():
    cases = [{"tokens": [37], **_FP8_GPU}, {"tokens": [29], "exchange": "padded", "save": "input", **_FP8_GPU}]
    run_ranks(pw.ep_cases, 1, cases, backend="nccl", timeout=300)


@pytest.mark.multigpu
@pytest.mark.skipif(not (_two_gpus() and _hopper()), reason="needs 2 Hopper GPUs")
def test_ep_fp8_two_gpus():
    cases = [{"tokens": [37, 21], **_FP8_GPU}, {"tokens": [0, 19], "exchange": "padded", **_FP8_GPU},
             {"tokens": [23, 30], "exchange": "padded", "save": "input", **_FP8_GPU}]
    run_ranks(pw.ep_cases, 2, cases, backend="nccl", timeout=300)


@pytest.mark.multigpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs")
def test_ep_bf16_two_gpus():
    cases = [dict(c, dtype=torch.bfloat16, backend="triton") for c in CASES_2 if c.get("dtype") is None]
    run_ranks(pw.ep_cases, 2, cases, backend="nccl", timeout=300)


@pytest.mark.multigpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs")
def test_fsdp2_ep_two_gpus():
    run_ranks(pw.fsdp_bf16_matches_unwrapped, 2, backend="nccl", timeout=300)
    run_ranks(pw.fsdp_equal, 2, (1, 2), ("dp_shard", "ep"), backend="nccl", timeout=300)


def test_bench_ep_runs_on_cpu(tmp_path):
    """benchmarks/bench_ep.py under torchrun (2 gloo ranks, tiny shapes): the layers agree, CSV written; with
    torchtitan importable, its EP layer (partial_dtensor backend on gloo) too, to bf16 rounding (its experts take
    bf16 operands)."""
    import csv
    import os
    import subprocess
    import sys

    from moeblaze.bench.ep_baselines import torchtitan_available

    out = tmp_path / "ep.csv"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "benchmarks/bench_ep.py", "--tokens", "24", "--d-model", "16", "--d-ff", "8",
           "--experts", "4", "--top-k", "2", "--dtype", "float32", "--iters", "1", "--warmup", "1", "--out", str(out)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    titan = ["torchtitan-dtensor"] if torchtitan_available() else []
    assert [r["impl"] for r in rows] == ["moeblaze", *titan, "torchtitan-style", "one-gpu"]
    diffs = {r["impl"]: float(r["out_rel_diff"]) for r in rows}
    assert diffs["moeblaze"] == 0.0 and diffs["torchtitan-style"] < 1e-5 and diffs.get("torchtitan-dtensor", 0) < 2e-2
    assert diffs["one-gpu"] < 1e-5  # the same router and experts on the rank's own tokens: the same function
    assert all(float(r["fwd_bwd_ms"]) > 0 for r in rows)
    assert "torchrun --nproc-per-node 2 benchmarks/bench_ep.py --tokens 24" in rows[0]["command"]


def test_bench_ep_times_the_fp8_layer_on_cpu(tmp_path):
    """``--impls moeblaze,moeblaze-fp8``: the FP8 layer (the recipe's emulation on gloo) on the bf16 layer's weights
    and exchange, a row each; its output differs from the bf16 layer's by the recipe's rounding, not more."""
    import csv
    import os
    import subprocess
    import sys

    out = tmp_path / "ep.csv"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), "benchmarks/bench_ep.py", "--tokens", "24", "--d-model", "32", "--d-ff", "16",
           "--experts", "4", "--top-k", "2", "--dtype", "float32", "--iters", "1", "--warmup", "1",
           "--impls", "moeblaze,moeblaze-fp8", "--out", str(out)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["impl"]: r for r in csv.DictReader(out.open())}
    assert list(rows) == ["moeblaze", "moeblaze-fp8"]
    assert 1e-3 < float(rows["moeblaze-fp8"]["out_rel_diff"]) < 0.1  # e4m3 rounding: ~2^-4 relative per operand
    assert rows["moeblaze-fp8"]["sent_rows"] == rows["moeblaze"]["sent_rows"]
    assert float(rows["moeblaze-fp8"]["fwd_bwd_ms"]) > 0 and float(rows["moeblaze-fp8"]["comm_ms"]) > 0


def test_runtime_keeps_the_callers_gpu_in_a_group_it_did_not_start(monkeypatch):
    """A default group initialised by the caller (no torchrun, no LOCAL_RANK) keeps the CUDA device the caller
    set; with LOCAL_RANK that GPU is taken. (Two spawned NCCL ranks both took GPU 0 before: "Duplicate GPU".)"""
    import torch.distributed as dist

    from moeblaze.parallel import init_distributed

    chosen = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    env = init_distributed(device="cuda")
    assert (env.rank, env.local_rank, env.device, chosen) == (1, 1, torch.device("cuda", 1), [1])
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert init_distributed(device="cuda").device == torch.device("cuda", 0) and chosen == [1, 0]


def test_runtime_single_process(monkeypatch):
    """Without torchrun: rank 0 of 1, no process group, no mesh; bad torchrun variables are named."""
    from moeblaze.parallel import init_distributed, is_rank0, make_mesh, split_batch

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    env = init_distributed(device="cpu")
    assert (env.rank, env.world_size, env.backend) == (0, 1, None) and is_rank0()
    assert split_batch(torch.ones(3, 2), env).shape == (3, 2)
    with pytest.raises(ValueError, match="needs a process group"):
        make_mesh(env)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE must be an integer"):
        init_distributed(device="cpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match=r"RANK=2 must be in \[0, WORLD_SIZE=2\)"):
        init_distributed(device="cpu")
