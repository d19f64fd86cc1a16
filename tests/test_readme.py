"""The README as a user reads it: its Python snippets run as written on the CPU, its test command is CI's, and it
stays short (issue 60: <= 250 lines)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moeblaze.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, re.DOTALL)
MICRO = ["--seq-len", "32", "--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--d-ff", "16",
         "--num-experts", "4", "--top-k", "2", "--batch-size", "4", "--eval-tokens", "64", "--warmup-steps", "1",
         "--threads", "1", "--steps", "2", "--no-progress"]


def _kind(snippet: str) -> str:
    if "init_distributed" in snippet:
        return "torchrun"
    if "load_model" in snippet:
        return "export"
    return "plain"


def test_readme_is_short_and_its_test_command_is_ci_s():
    assert README.count("\n") <= 250
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"## Tests\s+```bash\n(.*?)\n```", README, re.DOTALL).group(1).strip()
    assert command in ci.splitlines()
    assert len(SNIPPETS) >= 6 and {_kind(s) for s in SNIPPETS} == {"plain", "torchrun", "export"}


def test_the_snippets_run_in_order_in_one_namespace(tmp_path, monkeypatch):
    """The snippets continue the quickstart's (one namespace, in order), as the README says; the exported model
    that ``load_model`` reads is made by the README's own ``moeblaze export`` after a short run."""
    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(re.__file__).read_text()[:20000])
    with pytest.raises(SystemExit) as exc:
        main(["train", "--data", str(corpus), *MICRO])
    assert exc.value.code == 0
    with pytest.raises(SystemExit) as exc:
        main(["export", "--out", "model.safetensors"])
    assert exc.value.code == 0
    namespace: dict = {}
    ran = 0
    for snippet in SNIPPETS:
        if _kind(snippet) != "torchrun":
            exec(compile(snippet, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
            ran += 1
    assert ran == len(SNIPPETS) - 1
    assert namespace["logits"].shape == (1, 32, 256) and namespace["out"].dtype.is_floating_point


def test_the_expert_parallel_snippet_under_torchrun_on_two_cpu_ranks(tmp_path):
    (snippet,) = [s for s in SNIPPETS if _kind(s) == "torchrun"]
    script = tmp_path / "ep.py"
    script.write_text(snippet + 'print("snippet ran", flush=True)\n')
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    # torch's gloo backend can abort a rank after its script ended: a gloo worker thread that drops the last
    # reference to a collective's tensors takes the GIL while the interpreter finalizes ("terminate called without
    # an active exception", SIGABRT; seen once in a loaded full-suite run). The snippet has then run on both ranks.
    torch_teardown = "terminate called without an active exception" in proc.stderr
    assert proc.stdout.count("snippet ran") == 2 and (proc.returncode == 0 or torch_teardown), \
        proc.stdout[-3000:] + proc.stderr[-3000:]
