"""``moeblaze bench`` and ``moeblaze.memory_report`` on the CPU: configs, formulas, baselines' numerics,
the runner (CPU mode), CSV / markdown / plots from a synthetic CSV, the memory report, the no-GPU error."""

import argparse
import functools

import pytest
import torch

from moeblaze import build_dispatch, moe_experts
from moeblaze.bench import CONFIGS, SUITES, expected_saved_bytes, get_configs, layer_flops, memory_report
from moeblaze.bench.baselines import (
    IMPLS,
    conventional_experts,
    hf_loop_experts,
    make_weights,
    sort_dispatch,
    step_params,
)
from moeblaze.bench.cli import register
from moeblaze.bench.configs import BenchConfig, config_named, index_bytes, parse_tokens
from moeblaze.bench.plots import plot_all
from moeblaze.bench.report import markdown, read_csv, write_csv
from moeblaze.bench.runner import Row, RunOptions
from moeblaze.bench.suite import run_layers
from moeblaze.memory import SavedTensorCounter, saved_bytes
from moeblaze.testing import assert_close_to_reference, make_expert_inputs, reference_outputs, run_and_grad

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops on a busy 2-core machine are ~1000x slower with a thread pool; restore afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def parser():
    p = argparse.ArgumentParser(prog="moeblaze")
    register(p.add_subparsers(dest="command"))
    return p


# ---------------------------------------------------------------------------------------------- configs


def test_paper_table1_configs():
    table = {1: (512, 4, 1, 65536), 2: (1024, 8, 2, 65536), 3: (1024, 16, 4, 65536), 4: (2048, 16, 4, 32768),
             5: (512, 16, 4, 32768), 6: (1024, 16, 4, 16384), 7: (2048, 8, 4, 8192)}
    for i, (d, E, K, T) in table.items():
        for act in ("swiglu", "silu"):
            c = CONFIGS[f"conf{i}-{act}"]
            assert (c.d, c.h, c.E, c.K, c.T, c.activation, c.group) == (d, 4 * d, E, K, T, act, "paper")
    assert len(SUITES["paper"]["layers"]) == 14


def test_sweep_and_model_configs():
    sweep = [CONFIGS[n] for n in SUITES["sweep"]["layers"]]
    assert [c.T for c in sweep] == [8192, 32768, 131072, 524288, 2097152]
    assert {(c.d, c.h, c.E, c.K) for c in sweep} == {(512, 2048, 4, 1)}
    shapes = {c.name: (c.d, c.h, c.E, c.K) for c in get_configs("models")}
    assert shapes["olmoe-1b-7b"] == (2048, 1024, 64, 8) and shapes["deepseek-v3"] == (7168, 2048, 256, 8)
    assert shapes["mixtral-8x7b"] == (4096, 14336, 8, 2) and shapes["gpt-oss-20b"] == (2880, 2880, 32, 4)
    assert CONFIGS["sonicmoe-7b"].T == 24576 and CONFIGS["qwen3-235b-a22b"].T == 32768
    assert set(SUITES["all"]["layers"]) == set(SUITES["paper"]["layers"] + SUITES["sweep"]["layers"]
                                               + SUITES["models"]["layers"])
    assert SUITES["all"]["dispatch"] and SUITES["all"]["train"] and SUITES["smoke"]["layers"]
    # the README table's configs: DESIGN.md §6's seven, each one that `--suite all` runs
    assert len(SUITES["readme"]["layers"]) == 7 and set(SUITES["readme"]["layers"]) <= set(SUITES["all"]["layers"])


def test_config_filters_and_tokens():
    assert [c.name for c in get_configs("paper", ["conf3-*"])] == ["conf3-swiglu", "conf3-silu"]
    assert {c.activation for c in get_configs("paper", activation="silu")} == {"silu"}
    assert {c.group for c in get_configs(None, ["sweep"])} == {"sweep"}
    assert [c.T for c in get_configs(None, ["olmoe-1b-7b"], tokens=[8192, 1 << 20])] == [8192, 1 << 20]
    assert parse_tokens("8k, 32768,2M") == [8192, 32768, 2097152] and parse_tokens(None) == []
    for bad in ("0", "12x", "-5", "k"):
        with pytest.raises(ValueError, match="token count"):
            parse_tokens(bad)
    with pytest.raises(ValueError, match="unknown suite"):
        get_configs("nope")
    with pytest.raises(ValueError, match="no config matches"):
        get_configs(None, ["no-such-*"])
    with pytest.raises(ValueError):
        BenchConfig("bad", "x", 8, 8, 8, 2, 3)  # K > E


def test_config_named_takes_a_name_or_a_shape():
    def dims(c):
        return c.T, c.d, c.h, c.E, c.K, c.activation
    assert dims(config_named("qwen3-30b-a3b", 2048)) == (2048, 2048, 768, 128, 8, "swiglu")
    assert config_named("olmoe-1b-7b") == CONFIGS["olmoe-1b-7b"]
    assert dims(config_named("1536:1024:128:2", 16384)) == (16384, 1536, 1024, 128, 2, "swiglu")
    with pytest.raises(ValueError, match="unknown config 'nope'.*d:h:E:K"):
        config_named("nope")


def test_flop_formulas():
    assert layer_flops(10, 3, 5, 2, "swiglu") == 18 * 20 * 3 * 5
    assert layer_flops(10, 3, 5, 2, "silu") == 12 * 20 * 3 * 5
    c = CONFIGS["olmoe-1b-7b"]
    assert c.flops == 18 * 32768 * 8 * 2048 * 1024
    # DESIGN.md §6: OLMoE conventional 29.5 ms <-> 335 TFLOP/s
    assert c.flops / 29.5e-3 / 1e12 == pytest.approx(335, rel=0.01)


@pytest.mark.parametrize("activation", ["swiglu", "relu"])
@pytest.mark.parametrize("save", ["preact", "input"])
def test_saved_byte_formula_matches_hooks(activation, save):
    T, d, h, E, K = 24, 8, 12, 5, 2
    inp = make_expert_inputs(T, d, h, E, K, activation, seed=1)
    leaves = {k: v.requires_grad_() if v.is_floating_point() else v for k, v in inp.items()}
    exclude = [leaves[k] for k in ("x", "w_gate_up", "w_down", "topk_weights")]
    got = saved_bytes(moe_experts, **leaves, activation=activation, save=save, backend="torch", exclude=exclude)
    assert got == expected_saved_bytes(T, d, h, E, K, activation, save, elt=4)
    assert index_bytes(T, E, K) == 4 * (E + 1) + 12 * T * K
    with pytest.raises(ValueError):
        expected_saved_bytes(T, d, h, E, K, save="nothing")


# -------------------------------------------------------------------------------------------- baselines


@pytest.mark.parametrize("activation", ["swiglu", "silu", "geglu"])
@pytest.mark.parametrize("name", ["conventional", "scatter_add", "hf-loop"])
def test_baselines_match_reference(name, activation):
    T, d, h, E, K = 37, 16, 24, 6, 3
    fn = {"conventional": conventional_experts, "hf-loop": hf_loop_experts,
          "scatter_add": functools.partial(conventional_experts, combine="scatter_add")}[name]
    inputs = make_expert_inputs(T, d, h, E, K, activation, routing="zipf", seed=2)
    dout = torch.randn(T, d)
    got = run_and_grad(functools.partial(fn, activation=activation), inputs, dout)
    ref64 = reference_outputs(inputs, activation, dout)
    base = reference_outputs(inputs, activation, dout, dtype=torch.float32)
    for what, a, r, b in zip(("out", "dx", "dw_gate_up", "dw_down", "dtopk_weights"), got, ref64, base):
        assert_close_to_reference(f"{name} {what}", a, r, b)


def test_sort_dispatch_matches_build_dispatch():
    routing = torch.tensor([[2, 3], [0, 1], [0, 3], [1, 2], [0, 3]])  # paper Fig. 2
    assert sort_dispatch(routing, 4).expert_token_indices.tolist() == [1, 2, 4, 1, 3, 0, 3, 0, 2, 4]
    for T, E, K in ((1, 3, 1), (100, 7, 3), (257, 16, 16)):
        ids = torch.rand(T, E).topk(K, dim=1).indices.to(torch.int32)
        a, b = sort_dispatch(ids, E), build_dispatch(ids, E)
        assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))


# ------------------------------------------------------------------------------------ runner and output


def test_runner_on_cpu_measures_and_reports_skips():
    cfgs = [BenchConfig("tiny", "t", 48, 16, 24, 4, 2, "swiglu"), BenchConfig("tiny-silu", "t", 48, 16, 24, 4, 2,
                                                                               "silu")]
    opts = RunOptions(dtype="fp32", device="cpu", flush_l2=False, min_reps=1, max_reps=2, target_s=0.01)
    rows = run_layers(cfgs, ["moeblaze-torch", "conventional", "hf-loop", "liger"], opts)
    by = {(r.config, r.impl): r for r in rows}
    assert len(rows) == 8
    for c in ("tiny", "tiny-silu"):
        for i in ("moeblaze-torch", "conventional", "hf-loop"):
            r = by[(c, i)]
            assert r.status == "ok" and r.time_ms > 0 and r.reps >= 1, r
            assert r.tflops == pytest.approx(layer_flops(48, 16, 24, 2, r.activation) / r.time_ms / 1e9)
        # moeblaze keeps no gathered copy and no expert outputs
        assert by[(c, "moeblaze-torch")].saved_mib < by[(c, "conventional")].saved_mib
    if not HAS_CUDA:
        assert by[("tiny", "liger")].status == "unavailable"
    assert by[("tiny-silu", "liger")].status in ("unsupported", "unavailable")
    skipped = run_layers(cfgs[:1], ["conventional"], RunOptions(dtype="fp32", device="cpu", budget_s=0.0),
                         start=0.0)
    assert skipped[0].status == "skipped" and "budget" in skipped[0].note
    assert IMPLS["hf-loop"].unsupported(BenchConfig("big", "t", 1 << 20, 8, 8, 2, 1), opts.impl)


def test_dense_reference_trains_its_own_weights_and_saves_only_activations():
    """``dense`` (a dense gated MLP of width K*h, not an MoE) owns its weights: a step resets and fills their
    gradients, and the bytes saved for backward leave them out as they leave out the shared weights."""
    T, d, h, K = 48, 16, 24, 2
    cfg = BenchConfig("tiny", "t", T, d, h, 4, K, "swiglu")
    opts = RunOptions(dtype="fp32", device="cpu", flush_l2=False, min_reps=1, max_reps=2, target_s=0.01)
    (row,) = run_layers([cfg], ["dense"], opts)
    assert row.status == "ok" and row.time_ms > 0, row
    # saved: the gate and up projections, SiLU(gate) and the product, each [T, K*h] fp32 (x and weights excluded)
    assert row.saved_mib == pytest.approx(4 * T * K * h * 4 / 2**20)
    w = make_weights(cfg, dtype=torch.float32)
    fn = IMPLS["dense"].build(cfg, w, opts.impl)
    params = step_params(fn, w)
    assert params[:3] == w.params() and len(params) == 6  # the shared three, then gate_proj, up_proj, down_proj
    fn(torch.randn(T, d)).sum().backward()
    assert all(p.grad is not None for p in params[3:]) and all(p.grad is None for p in params[:3])
    assert IMPLS["dense"].unsupported(BenchConfig("s", "t", T, d, h, 4, K, "silu"), opts.impl)


def synthetic_rows():
    rows = []
    for T in (8192, 32768, 131072):
        for impl, ms, mib in (("moeblaze", 1.0, 100.0), ("conventional", 2.0, 400.0), ("sonicmoe", 1.2, 120.0)):
            s = T / 8192
            rows.append(Row("sweep", f"sweep-{T}", impl, T, 512, 2048, 4, 1, "swiglu", "bf16", "ok", ms * s,
                            layer_flops(T, 512, 2048, 1) / (ms * s * 1e-3) / 1e12, mib * s, 2 * mib * s,
                            1.5 * mib * s, 10, 1.0, ""))
    rows.append(Row("models", "olmoe-1b-7b", "moeblaze", 32768, 2048, 1024, 64, 8, "swiglu", "bf16", "ok", 15.0,
                    535.0, 800.0, 9000.0, 5000.0, 10, 3.0, ""))
    rows.append(Row("models", "olmoe-1b-7b", "conventional", 32768, 2048, 1024, 64, 8, "swiglu", "bf16", "ok",
                    29.5, 335.0, 3920.0, 20000.0, 16000.0, 10, 1.0, ""))
    rows.append(Row("models", "olmoe-1b-7b", "liger", 32768, 2048, 1024, 64, 8, "swiglu", "bf16", "OOM",
                    note="CUDA out of memory"))
    rows.append(Row("models", "olmoe-1b-7b", "sonicmoe", 32768, 2048, 1024, 64, 8, "swiglu", "bf16", "unavailable",
                    note="sonicmoe not importable"))
    return rows


def test_csv_markdown_and_plots(tmp_path):
    rows = synthetic_rows()
    path = write_csv(rows, tmp_path / "results.csv")
    assert read_csv(path) == rows
    meta = {"command": "moeblaze bench --suite all --out results/", "date": "2026-11-22 10:00 UTC",
            "device": "NVIDIA H200", "torch": "2.11.0", "cuda": "13.0", "triton": "3.6.0", "peers": {}}
    plots = plot_all(rows, tmp_path, meta)
    names = {p.name for p in plots}
    assert {"speedup_sweep.png", "memory_sweep.png", "tokens_sweep.png", "speedup_models.png"} <= names
    for p in plots:
        assert p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG"
    md = markdown(rows, meta, plots)
    for text in ("`moeblaze bench --suite all --out results/`", "NVIDIA H200", "2.11.0", "3.6.0",
                 "2026-11-22", "| olmoe-1b-7b |", "1.97x", "OOM", "![tokens_sweep](tokens_sweep.png)",
                 "sonicmoe not importable"):
        assert text in md, text


def test_cli_plot_redraws_from_csv(tmp_path, capsys):
    from moeblaze.bench.micro import DISPATCH_COLUMNS
    from moeblaze.bench.report import write_dicts, write_meta

    write_csv(synthetic_rows(), tmp_path / "results.csv")
    write_dicts(tmp_path / "dispatch.csv", [{"T": 8192, "E": 4, "K": 1, "builder": "sort (argsort)",
                                             "time_ms": 0.0417, "speedup_vs_sort": 1.0, "status": "ok"}],
                DISPATCH_COLUMNS)
    write_meta({"device": "NVIDIA H100 80GB HBM3", "command": "moeblaze bench --suite all"}, tmp_path)
    args = parser().parse_args(["bench", "--plot", str(tmp_path / "results.csv"), "--image-prefix", "img/"])
    assert args.func(args) == 0
    assert (tmp_path / "speedup_models.png").stat().st_size > 0
    assert "wrote" in capsys.readouterr().out
    md = (tmp_path / "results.md").read_text()
    assert "](img/speedup_models.png)" in md and "NVIDIA H100 80GB HBM3" in md
    assert "| 8192 | 4 | 1 | sort (argsort) | 0.0417 | 1.00 | ok |" in md
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    args = parser().parse_args(["bench", "--plot", str(bad)])
    with pytest.raises(SystemExit, match="not a `moeblaze bench` results CSV"):
        args.func(args)


def test_cli_list_and_errors(capsys):
    p = parser()
    args = p.parse_args(["bench", "--list"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "olmoe-1b-7b" in out and "suite all" in out
    args = p.parse_args(["bench", "--impls", "moeblaze,nope"])
    with pytest.raises(SystemExit, match="unknown implementation"):
        args.func(args)
    args = p.parse_args(["bench", "--configs", "zzz*"])
    with pytest.raises(SystemExit, match="no config matches"):
        args.func(args)


def test_the_command_line_ends_a_usage_error_with_exit_2(capsys):
    from moeblaze.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["memory", "--config", "nope"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err == "moeblaze memory: unknown config 'nope'; see `moeblaze bench --list`\n"


@pytest.mark.skipif(HAS_CUDA, reason="checks the message given without a GPU")
@pytest.mark.parametrize("argv", [["bench"], ["bench", "--suite", "all", "--out", "x"], ["bench", "--suite", "train"],
                                  ["memory", "--device", "cuda"]])
def test_clear_error_without_gpu(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = parser().parse_args(argv)
    with pytest.raises(SystemExit) as exc:
        args.func(args)
    assert exc.value.code not in (0, None) and "CUDA" in str(exc.value.code)
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------------------- memory report


def tiny_model():
    from moeblaze.training.model import ModelConfig, MoETransformer

    torch.manual_seed(0)
    cfg = ModelConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2, d_ff=48, num_experts=4, top_k=2)
    return MoETransformer(cfg), torch.randint(0, 256, (2, 16))


def test_memory_report_matches_saved_tensor_hooks():
    model, idx = tiny_model()
    grads_before = [p.grad for p in model.parameters()]
    report = memory_report(model, idx)
    assert [p.grad for p in model.parameters()] == grads_before  # the step's gradients are discarded
    excluded = [*model.parameters(), *model.buffers()]
    with SavedTensorCounter(excluded) as total:
        model(idx).float().square().mean()
    assert report.saved_bytes == total.bytes > 0
    by = report.by_name()
    assert by[""].total_bytes + report.unattributed_bytes == report.saved_bytes
    assert sum(m.self_bytes for m in report.modules) + report.unattributed_bytes == report.saved_bytes
    for i, block in enumerate(model.blocks):
        with SavedTensorCounter(excluded).track([block.moe]) as moe_only:
            model(idx)
        assert by[f"blocks.{i}.moe"].total_bytes == moe_only.bytes > 0
        assert by[f"blocks.{i}"].total_bytes >= by[f"blocks.{i}.moe"].total_bytes + by[f"blocks.{i}.attn"].total_bytes
    assert report.peak_bytes is None or HAS_CUDA
    table = report.table(max_depth=2)
    assert "blocks" in table and "saved for backward" in table and "norm1" not in table
    assert str(report) == report.table()  # print(report) shows the whole table


def test_memory_report_inputs_and_loss():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(5, 8)
    r = memory_report(lin, {"input": x})
    assert r.saved_bytes == saved_bytes(lambda: lin(x).square().mean(), exclude=list(lin.parameters()))
    r2 = memory_report(lin, (x,), loss_fn=lambda out, batch: out.sum())
    assert r2.by_name()[""].self_bytes == x.numel() * 4 and r2.unattributed_bytes == 0
    with pytest.raises(TypeError, match="loss_fn"):
        memory_report(torch.nn.Identity(), "text")


def test_cli_memory_on_cpu(capsys):
    args = parser().parse_args(["memory", "--shape", "32:48:4:2:silu", "--impl", "conventional", "--tokens", "64",
                                "--device", "cpu"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "conventional on custom-d32-h48-E4-K2-silu@64" in out and "saved for backward" in out
    args = parser().parse_args(["memory", "--device", "cpu", "--batch-size", "1", "--seq-len", "32", "--depth", "1"])
    assert args.func(args) == 0
    assert "MoETransformer" in capsys.readouterr().out
    args = parser().parse_args(["memory", "--config", "nope"])
    with pytest.raises(SystemExit, match="unknown config"):
        args.func(args)


def test_dispatch_and_train_benchmarks_on_cpu():
    from moeblaze.bench.micro import DISPATCH_COLUMNS, TRAIN_COLUMNS, TrainSpec, run_dispatch, run_train
    from moeblaze.bench.report import dict_table
    from moeblaze.training.train_config import peak_tflops

    rows = run_dispatch([(50, 6, 2)], reps=2, device="cpu")
    assert len(rows) == 3 and all(r["status"] == "ok" and r["note"] == "" for r in rows), rows
    assert rows[0]["speedup_vs_sort"] == 1.0
    from moeblaze.training.model import ModelConfig

    small = ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=16, num_experts=4, top_k=2, seq_len=8)
    spec = TrainSpec(model=small, batch=2, steps=1, warmup=1)
    train = run_train(spec, device="cpu", peak=1.0)
    assert train[0]["status"] == "unavailable" and train[1]["status"] == "ok" and train[1]["tokens_per_s"] > 0
    assert train[1]["mfu"] == pytest.approx(train[1]["tflops"])
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("Quadro X") is None
    md = "\n".join(dict_table("Dispatch", rows, DISPATCH_COLUMNS) + dict_table("Train", train, TRAIN_COLUMNS))
    assert "| T | E | K | builder |" in md and "| torch |" in md


def test_cli_bench_end_to_end_on_cpu(tmp_path, capsys):
    """The whole pipeline (runner, CSV, markdown, plots) through the CLI; ``--device cpu`` is for tests only."""
    out = tmp_path / "res"
    args = parser().parse_args(["bench", "--device", "cpu", "--shape", "32:48:4:2", "--tokens", "16,32",
                                "--impls", "moeblaze-torch,conventional,liger", "--dtype", "fp32", "--no-flush",
                                "--min-reps", "1", "--max-reps", "1", "--out", str(out)])
    assert args.func(args) == 0
    rows = read_csv(out / "results.csv")
    name = "custom-d32-h48-E4-K2-swiglu"
    assert [(r.config, r.impl, r.status) for r in rows if r.impl != "liger"] == [
        (f"{name}@16", "moeblaze-torch", "ok"), (f"{name}@16", "conventional", "ok"),
        (f"{name}@32", "moeblaze-torch", "ok"), (f"{name}@32", "conventional", "ok")]
    md = (out / "results.md").read_text()
    assert "`moeblaze bench --tokens 16,32 --shape 32:48:4:2" in md and "--device cpu" in md
    assert "moeblaze-torch vs conventional" in md
    assert (out / "tokens_custom.png").stat().st_size > 0 and (out / "meta.json").exists()
    assert f"{name}@32" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="bad shape"):
        args = parser().parse_args(["bench", "--shape", "1:2:3"])
        args.func(args)


def test_outputs_without_matplotlib(tmp_path, monkeypatch):
    """A GPU host may lack matplotlib: the run still writes its tables and says how to plot later."""
    import sys

    from moeblaze.bench.report import write_outputs

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    md, plots = write_outputs(tmp_path, synthetic_rows(), {"device": "NVIDIA H200"})
    assert plots == [] and "moeblaze bench --plot results.csv" in md.read_text()
    assert not list(tmp_path.glob("*.png"))


# ------------------------------------------------------------------------------------- peak breakdown

def _ev(action, addr, size, where=None):
    frames = [{"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "f"}]
    if where:
        frames.append({"filename": f"/src/moeblaze/{where}", "line": 7, "name": "g"})
    return {"action": action, "addr": addr, "size": size, "frames": frames}


def test_live_at_peak_replays_allocations_and_frees():
    from moeblaze.bench.peak import live_at_peak
    events = [_ev("alloc", 1, 100, "a.py"), _ev("alloc", 2, 50, "b.py"), _ev("free_requested", 1, 100),
              _ev("free_completed", 1, 100), _ev("alloc", 3, 30, "a.py"), _ev("alloc", 4, 80, "a.py"),
              _ev("segment_alloc", 9, 1 << 20), _ev("free_completed", 77, 40),  # a block from before the trace
              _ev("alloc", 5, 35, "b.py")]
    got = live_at_peak(events, base_bytes=1000)
    # running totals: 1100, 1150, 1050, 1080, 1160 (peak), 1120, 1155
    assert got.peak_bytes == 1160 and got.base_bytes == 1000
    assert got.live == [("a.py:7 g", 110, 2), ("b.py:7 g", 50, 1)]
    table = got.table(min_bytes=60)
    assert "a.py:7 g" in table and "b.py" not in table and "smaller blocks" in table


def test_live_at_peak_errors():
    from moeblaze.bench.peak import live_at_peak, peak_breakdown
    with pytest.raises(ValueError, match="base_bytes"):
        live_at_peak([], base_bytes=-1)
    with pytest.raises(ValueError, match="without 'size'"):
        live_at_peak([{"action": "alloc", "addr": 1}])
    assert live_at_peak([], base_bytes=5).peak_bytes == 5
    with pytest.raises(ValueError, match="CUDA"):
        peak_breakdown(lambda: None, device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_peak_breakdown_matches_max_memory_allocated():
    from moeblaze.bench.peak import peak_breakdown
    x = torch.randn(1024, 1024, device="cuda")

    def step():
        y = x @ x  # 4 MiB
        z = torch.relu(y)  # another 4 MiB while y is live
        del y
        return z.sum()

    step()
    torch.cuda.reset_peak_memory_stats()
    got = peak_breakdown(step)
    assert got.peak_bytes == torch.cuda.max_memory_allocated()
    ours = sum(b for where, b, _ in got.live if where.startswith("test_bench.py:"))
    assert ours >= 8 << 20  # y and z, both live at the peak


def test_grad_accum_passes_share_the_fp8_weight_copies(capsys):
    """``--grad-accum N``: a timed step is N forward+backward passes inside moeblaze.fp8.reuse_weights (gradients
    accumulated), the row's time is per pass and its note says so; N below 1 is an error."""
    from moeblaze import fp8
    from moeblaze.bench import runner

    scopes = []
    fn = lambda x: scopes.append(fp8._SCOPES[0]) or x.sum() * 1.0  # noqa: E731
    x = torch.randn(3, 2, requires_grad=True)
    step, _ = runner._make_step(fn, x, torch.tensor(1.0), [], passes=3)
    step()
    assert scopes == [1, 1, 1] and torch.equal(x.grad, torch.full((3, 2), 3.0)) and fp8._SCOPES[0] == 0
    cfg = BenchConfig("tiny", "t", 48, 16, 24, 4, 2, "swiglu")
    opts = RunOptions(dtype="fp32", device="cpu", flush_l2=False, min_reps=1, max_reps=2, target_s=0.01,
                      grad_accum=2)
    (row,) = run_layers([cfg], ["moeblaze-torch"], opts)
    assert row.status == "ok" and row.time_ms > 0 and "2 passes a step" in row.note
    with pytest.raises(ValueError, match="grad_accum"):
        RunOptions(grad_accum=0)
    from moeblaze.bench.cli import _options

    with pytest.raises(SystemExit):
        _options(parser().parse_args(["bench", "--grad-accum", "0"]), None)
    assert "--grad-accum must be an integer >= 1, got 0" in capsys.readouterr().err


def test_append_dicts_writes_the_header_once(tmp_path):
    """The benchmark scripts' ``--out``: rows appended, the header only into an absent or empty file."""
    from moeblaze.bench.report import append_dicts, read_dicts

    path = tmp_path / "sub" / "rows.csv"
    append_dicts(path, [{"a": 1, "b": "x"}])
    append_dicts(path, [{"a": 2, "b": "y"}, {"a": 3, "b": ""}])
    assert read_dicts(path) == [{"a": "1", "b": "x"}, {"a": "2", "b": "y"}, {"a": "3", "b": ""}]
    empty = tmp_path / "empty.csv"
    empty.touch()
    append_dicts(empty, [{"a": 4}])
    assert read_dicts(empty) == [{"a": "4"}]
