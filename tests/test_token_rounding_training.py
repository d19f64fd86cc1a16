"""Token rounding in training: the ``--routing`` flag, the benchmark script, ``torch.compile(fullgraph=True)`` of a
rounding layer, the compiled rounding, and the benchmark's input-gradient ceiling (SonicMoE §5)."""

import pytest
import torch

import moeblaze
from moeblaze import MoE, round_tokens, settings
from test_token_rounding import routing


def test_train_routing_flag(tmp_path):
    from moeblaze.cli import main
    from moeblaze.training.model import ModelConfig, MoETransformer, token_rounding_mode

    data = tmp_path / "corpus.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 400)
    tiny = ["--seq-len", "32", "--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--d-ff", "32",
            "--num-experts", "4", "--top-k", "2", "--batch-size", "8", "--eval-tokens", "256", "--warmup-steps", "1",
            "--no-progress", "--threads", "2", "--steps", "3", "--data", str(data)]
    with pytest.raises(SystemExit) as exc:
        main(["train", *tiny, "--routing", "token-rounding:up", "--out-dir", str(tmp_path / "tr")])
    assert exc.value.code == 0
    assert token_rounding_mode("token-rounding") == "nr" and token_rounding_mode("topk") is None
    model = MoETransformer(ModelConfig(seq_len=32, d_model=32, n_layers=1, n_heads=2, routing="token-rounding:sr"))
    assert [m.token_rounding for m in model.moe_layers()] == ["sr"]
    with pytest.raises(ValueError, match="routing must be 'topk' or 'token-rounding"):
        ModelConfig(routing="token-rounding:ceil")


@pytest.mark.parametrize("stage", ["speed", "quality", "rounding"])
def test_benchmark_script_smoke(stage, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_token_rounding.py"
    extra = {"speed": ["--smoke", "--out", str(tmp_path / "speed.csv")],
             "quality": ["--smoke", "--out-dir", str(tmp_path)],
             "rounding": ["--out", str(tmp_path / "rounding.csv")]}[stage]
    tmp = tmp_path / "tmp"  # the script's temporary folders, to check that it leaves none
    tmp.mkdir()
    proc = subprocess.run([sys.executable, str(script), stage, *extra], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(tmp)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not list(tmp.glob("tr_quality_*")), "the quality runs' checkpoint folders were left behind"
    if stage == "rounding":  # the three shapes, timed on the CPU
        import csv

        with open(tmp_path / "rounding.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        assert [int(r["E"]) for r in rows] == [128, 256, 512] and all(float(r["ms"]) > 0 for r in rows)
        assert {r["path"] for r in rows} == {"torch"}
    elif stage == "speed":
        lines = (tmp_path / "speed.csv").read_text().splitlines()
        assert lines[0].startswith("date,device,T,d,h,E,K,tile") and len(lines) == 1 + 2 * 5
        assert {line.split(",")[9] for line in lines[1:]} == {"topk", "tr-nr", "tr-nr-eager", "ceiling",
                                                              "pairs-moeblaze"}
    else:
        for routing in ("topk", "token-rounding-nr"):
            lines = (tmp_path / f"curves-{routing}.csv").read_text().splitlines()
            assert lines[0] == "routing,step,train_loss,val_bpb" and len(lines) == 1 + 4
        assert "token rounding nr" in proc.stdout and (tmp_path / "token_rounding_quality.png").exists()


@pytest.mark.parametrize("router,selections", [("torch", "torch"), ("torch", "kernels"), ("triton", "torch"),
                                               ("triton", "kernels")])
def test_token_rounding_layer_compiles_fullgraph(monkeypatch, router, selections):
    """``torch.compile(fullgraph=True)`` over the layer with rounding (the general-routing custom ops' fakes; with
    the fused router and selections, the router's node: :func:`moeblaze.token_rounding.route_rounded`), each of
    the router and the selections in Triton (interpreter) or PyTorch (``backend="torch"``, or where the other's
    kernels serve, those that do not). Dynamo's cache is cleared around it: its guards do not watch the settings,
    and the cases compile the same ``forward``."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if router != selections:
        monkeypatch.setattr(*((moeblaze.routing.Router, "_fused", lambda self, logits: False) if router == "torch"
                              else (moeblaze.token_rounding, "_kernels_serve", lambda *a: False)))
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = MoE(32, 16, 4, 2, backend="triton", token_rounding="nr", rounding_tile=8)
    x = torch.randn(2, 19, 32, requires_grad=True)
    try:
        with settings.override(backend="torch" if router == selections == "torch" else "triton"):
            ref = layer(x)
            (gx_ref,) = torch.autograd.grad(ref.square().sum(), x)
            out = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
            (gx,) = torch.autograd.grad(out.square().sum(), x)
    finally:
        torch._dynamo.reset()
    assert torch.equal(out, ref) and torch.equal(gx, gx_ref)


def test_compiled_rounding_is_bitwise_eager(monkeypatch):
    """:func:`round_tokens_fused` (compiled on CUDA; forced here on the CPU): the Inductor-compiled rounding equals
    the eager one."""
    from moeblaze.token_rounding import round_tokens_fused

    scores, ids, w = routing(64, 8, 2, 4)
    eager = round_tokens(scores, ids, w, 8, "nr", scale=2.5)
    assert not moeblaze.token_rounding._compiles(scores)  # CPU scores: eager unless forced
    monkeypatch.setattr(moeblaze.token_rounding, "_compiles", lambda scores: True)
    fused = round_tokens_fused(scores, ids, w, 8, "nr", scale=2.5)
    for name in ("token_idx", "expert_idx", "pair_weights", "counts"):
        assert torch.equal(getattr(fused, name), getattr(eager, name)), name


def test_benchmark_ceiling_sums_the_input_gradient_as_the_layer_does():
    """The ceiling variant of ``bench_token_rounding.py speed`` shares x's gradient between the router and the
    experts as ``moeblaze.MoE`` does: without it autograd's ``[T, d]`` addition (34 µs per step at T 16384, d 1536
    on an H200, ``python3 benchmarks/bench_token_rounding.py speed --shapes 0 --variants none
    --breakdown 45``) made the ceiling slower than the layer it bounds, and the share of its gain too high."""
    import importlib.util
    from pathlib import Path

    from torch.utils._python_dispatch import TorchDispatchMode

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_token_rounding.py"
    spec = importlib.util.spec_from_file_location("bench_token_rounding", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    T, d = bench.SMOKE_SHAPES[0][:2]

    class Adds(TorchDispatchMode):  # out-of-place additions of two [T, d] tensors
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.n += func is torch.ops.aten.add.Tensor and tuple(out.shape) == (T, d)
            return out

    steps, _ = bench.layer_steps(bench.SMOKE_SHAPES[0], "cpu", torch.float32, "torch", tile=16, sonic=False)
    counts = {}
    for name in ("topk", "ceiling"):
        with Adds() as mode:
            steps[name]()
        counts[name] = mode.n
    assert counts["ceiling"] == counts["topk"], counts
