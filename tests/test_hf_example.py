"""examples/finetune_transformers.py (issue 22 item 4) trains a transformers MoE model on moeblaze's experts."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "finetune_transformers.py"


def test_finetune_example_trains(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))
    cmd = [sys.executable, str(EXAMPLE), "--model-type", "mixtral", "--data", str(text), "--steps", "12",
           "--batch-size", "4", "--seq-len", "32", "--lr", "1e-2", "--log-every", "1", "--eval-tokens", "256",
           "--device", "cpu", "--set", "hidden_size=32", "--set", "head_dim=8", "--set", "moe_intermediate_size=16",
           "--set", "intermediate_size=16", "--set", "hidden_act=silu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "experts_implementation=moeblaze" in proc.stdout
    losses = [float(m) for m in re.findall(r"step +\d+ +loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 12 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.3, proc.stdout  # it learns: ln 256 = 5.55 at the start
    assert re.search(r"validation loss [0-9.]+ nats = [0-9.]+ bits/byte", proc.stdout)


@pytest.mark.parametrize("model_type, ok", [("deepseek_v3", True), ("llama", False)])
def test_finetune_example_families(model_type, ok, tmp_path):
    """DeepSeek-V3 builds small (its own MoE and attention fields) and trains; a model without experts modules
    is refused with a message instead of training without moeblaze."""
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"x{i} = {i}\n" for i in range(500)))
    cmd = [sys.executable, str(EXAMPLE), "--model-type", model_type, "--data", str(text), "--steps", "2",
           "--batch-size", "2", "--seq-len", "16", "--log-every", "1", "--eval-tokens", "64", "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if ok:
        assert proc.returncode == 0 and "experts_implementation=moeblaze" in proc.stdout, proc.stderr[-3000:]
    else:
        assert proc.returncode != 0 and "has no transformers experts module" in proc.stderr, proc.stderr[-3000:]


def test_finetune_example_model_path_without_tokenizer(tmp_path):
    """``--model-path`` to a folder of weights without tokenizer files: transformers loads an empty tokenizer, and the
    example says so instead of failing later on an empty token array."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, num_experts=4,
                               num_experts_per_tok=2, vocab_size=256)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "model")
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"x{i} = {i}\n" for i in range(500)))
    cmd = [sys.executable, str(EXAMPLE), "--model-path", str(tmp_path / "model"), "--data", str(text), "--steps", "1",
           "--batch-size", "2", "--seq-len", "16", "--device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0 and "does the folder hold the tokenizer's files?" in proc.stderr, proc.stderr[-3000:]


def test_bench_hf_smoke(tmp_path):
    """benchmarks/bench_hf.py --smoke: the CPU run of the GPU benchmark writes a CSV row per step and impl."""
    import csv

    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"class C{i}:\n    pass\n" for i in range(300)))
    out = tmp_path / "bench.csv"
    cmd = [sys.executable, str(EXAMPLE.parents[1] / "benchmarks" / "bench_hf.py"), "--smoke", "--data", str(text),
           "--impls", "grouped_mm,sonicmoe-local,moeblaze", "--out", str(out), "--plot", str(tmp_path / "run.png")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    by_impl = {impl: [r for r in rows if r["impl"] == impl] for impl in ("grouped_mm", "sonicmoe-local", "moeblaze")}
    assert [r["step"] for r in by_impl["moeblaze"]] == ["0", "1", "2"] and len(by_impl["grouped_mm"]) == 3
    assert by_impl["sonicmoe-local"][0]["note"].startswith("skipped")  # no CUDA here
    assert all(math.isnan(float(r["energy_j"])) for r in by_impl["moeblaze"])  # no NVML on the CPU: nan, not 0
    # same initial weights and batches: the first losses agree within bf16 rounding
    assert abs(float(by_impl["moeblaze"][0]["loss"]) - float(by_impl["grouped_mm"][0]["loss"])) < 0.02
    assert "tokens/s" in proc.stdout and "moeblaze" in proc.stdout
    assert re.search(r"moeblaze bf16: loss gap to grouped_mm over the last 3 steps [-+][0-9.]+", proc.stdout)
    assert (tmp_path / "run.png").stat().st_size > 0 and rows[0]["command"].startswith("python3 benchmarks/bench_hf.py")
    # the plot again from the file: each implementation's latest run at 2 x 32 tokens per step
    plot = [sys.executable, cmd[1], "--plot-from", str(out), "--batch-size", "2", "--seq-len", "32", "--plot",
            str(tmp_path / "again.png")]
    proc = subprocess.run(plot, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and (tmp_path / "again.png").stat().st_size > 0, proc.stderr[-2000:]


def test_bench_hf_rounds_alternate_order(tmp_path):
    """``--rounds 2``: every implementation trains twice, the second round in reverse order (neither runs first on
    the card every time); the rows say their round and the loss curve is round 0's."""
    import csv

    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x\n" for i in range(300)))
    out = tmp_path / "bench.csv"
    cmd = [sys.executable, str(EXAMPLE.parents[1] / "benchmarks" / "bench_hf.py"), "--smoke", "--data", str(text),
           "--impls", "grouped_mm,moeblaze", "--rounds", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    runs = [(r["round"], r["impl"]) for r in rows if r["step"] == "0"]
    assert runs == [("0", "grouped_mm"), ("0", "moeblaze"), ("1", "moeblaze"), ("1", "grouped_mm")]
    assert all(sum(1 for r in rows if (r["round"], r["impl"]) == run) == 3 for run in runs)
    # the gap over the last steps compares round 0's curves (3 steps), not the two rounds run together (6)
    assert re.search(r"moeblaze bf16: loss gap to grouped_mm over the last 3 steps", proc.stdout), proc.stdout
