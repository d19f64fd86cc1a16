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
           "--set", "intermediate_size=16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "experts_implementation=moeblaze" in proc.stdout
    losses = [float(m) for m in re.findall(r"step +\d+ +loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 12 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) < sum(losses[:3]) - 0.3, proc.stdout  # it learns: ln 256 = 5.55 at the start
    assert re.search(r"validation loss [0-9.]+ nats = [0-9.]+ bits/byte", proc.stdout)
