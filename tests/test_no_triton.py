"""A CPU install without Triton (pyproject's core dependencies leave it out): the package, the layer's forward and
backward, ``moeblaze train --device cpu``, ``sample``, ``export``, ``plot``, ``--version`` and
``moeblaze.parallel`` run in a process where ``import triton`` fails."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

# Runs in a fresh interpreter: ``sys.modules["triton"] = None`` makes every ``import triton`` raise ImportError,
# as on an install without the package. Each command must exit 0, and no Triton kernel module may load.
_SCRIPT = """
import sys
sys.modules["triton"] = None
import torch
import moeblaze
import moeblaze.parallel
from moeblaze.cli import main

torch.manual_seed(0)
layer = moeblaze.MoE(16, 32, 4, 2)
x = torch.randn(10, 16, requires_grad=True)
y = layer(x)
(y.square().sum() + layer.aux_loss).backward()
assert y.shape == (10, 16) and torch.isfinite(x.grad).all() and layer.w_down.grad.abs().sum() > 0

def run(*args):
    try:
        main(list(args))
    except SystemExit as exit:
        assert exit.code in (0, None), (args, exit.code)

out, data = sys.argv[1], sys.argv[2]
tiny = ["--seq-len", "32", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--d-ff", "32",
        "--num-experts", "4", "--top-k", "2", "--batch-size", "4", "--eval-tokens", "256", "--warmup-steps", "1",
        "--no-progress", "--threads", "1"]
run("--version")
run("train", "--device", "cpu", "--steps", "2", "--data", data, "--out-dir", out, *tiny)
run("sample", "--checkpoint", out, "--max-new-tokens", "8", "--device", "cpu")
run("export", "--checkpoint", out, "--out", out + "/model.safetensors")
run("plot", out)
loaded = sorted(m for m in sys.modules if m.startswith("moeblaze.kernels.") or m.startswith("triton."))
assert not loaded, loaded
print("no-triton: all ran")
"""


def test_entry_points_run_without_triton(tmp_path):
    pytest.importorskip("matplotlib")  # moeblaze plot's
    data = tmp_path / "corpus.py"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data.write_bytes((stdlib / "textwrap.py").read_bytes() + (stdlib / "string.py").read_bytes())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a CPU user's environment
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "out"), str(data)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no-triton: all ran" in proc.stdout
    assert proc.stdout.startswith("moeblaze "), proc.stdout[:200]  # --version's line
    assert (tmp_path / "out" / "model.safetensors").is_file() and (tmp_path / "out" / "loss.png").is_file()
