"""Mixed precision (issue 27): ``moe_experts`` and ``moeblaze.MoE`` under ``torch.autocast`` with fp32
parameters, the errors of combinations the kernels cannot run, and fp32 precision following torch's setting.

CPU: the torch backend under ``torch.autocast("cpu", bfloat16)``, the Triton kernels in the interpreter under
``torch.autocast("cpu", float16)`` (``tl.dot`` on bf16 is wrong in the interpreter). GPU (``-m gpu``): the same
equalities with the Triton kernels in bf16, ``torch.compile`` under autocast, TF32 vs IEEE fp32.
"""

import bisect
import math
import os
import string
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import moeblaze
from moeblaze import moe_experts
from moeblaze.activations import ACTIVATIONS
from moeblaze.experts import SAVE_MODES
from moeblaze.kernels.launch import dot_precision
from moeblaze.testing import (
    assert_close_to_reference,
    make_expert_inputs,
    reference_outputs,
    rel_error,
    run_and_grad,
)
from moeblaze.training import checkpoint
from moeblaze.training.model import ModelConfig
from moeblaze.training.train import train
from moeblaze.training.train_config import ConfigError, TrainConfig, peak_tflops, resolve_precision

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
NAMES = ("out", "dx", "dw_gate_up", "dw_down", "dtopk_weights")
kernels_runnable = pytest.mark.skipif(not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors: the interpreter")


def autocast_equals_cast_copies(inputs, activation, save, backend, dtype):
    """``moe_experts`` on fp32 leaves under autocast == the call on ``dtype`` copies, bitwise: the output
    (in ``dtype``) and every gradient (fp32 leaves get fp32 gradients, the copies' gradients upcast)."""
    device = inputs["x"].device.type
    dout = torch.randn(inputs["x"].shape, device=inputs["x"].device).to(dtype)
    fn = lambda **kw: moe_experts(**kw, activation=activation, save=save, backend=backend)  # noqa: E731

    def under_autocast(**kw):
        with torch.autocast(device, dtype=dtype):
            return fn(**kw)

    got = run_and_grad(under_autocast, inputs, dout)
    copies = {k: (v.to(dtype) if k in ("x", "w_gate_up", "w_down") else v) for k, v in inputs.items()}
    want = run_and_grad(fn, copies, dout)
    assert got[0].dtype == dtype
    for name, g, w, leaf in zip(NAMES, got, want, ("out", "x", "w_gate_up", "w_down", "topk_weights")):
        if name != "out":
            assert g.dtype == inputs[leaf].dtype, name  # fp32 leaves, fp32 gradients
        assert torch.equal(g, w.to(g.dtype)), (name, rel_error(g, w))
    return got


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("save", ["preact", "input"])
def test_experts_under_cpu_autocast_equal_bf16_copies(activation, save):
    inputs = make_expert_inputs(37, 24, 20, 5, 2, activation)
    autocast_equals_cast_copies(inputs, activation, save, "torch", torch.bfloat16)


@kernels_runnable
@pytest.mark.parametrize("activation", ["swiglu", "relu"])
@pytest.mark.parametrize("save", ["preact", "input"])
def test_triton_experts_under_autocast_equal_fp16_copies(activation, save):
    inputs = make_expert_inputs(19, 32, 16, 4, 2, activation, device=DEVICE)
    autocast_equals_cast_copies(inputs, activation, save, "triton", torch.float16)


def test_backward_inside_the_autocast_region_is_the_same():
    """A loop that runs ``backward`` inside ``torch.autocast`` gets the gradients of one that runs it
    outside (autocast is off inside the autograd Functions, as ``torch.amp.custom_bwd`` would make it)."""
    inputs = make_expert_inputs(23, 16, 12, 4, 2)
    leaves = [inputs[k].clone().requires_grad_() for k in ("x", "w_gate_up", "w_down", "topk_weights")]
    dout = torch.randn(23, 16).bfloat16()
    grads = []
    for backward_inside in (True, False):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = moe_experts(leaves[0], inputs["topk_ids"], leaves[3], leaves[1], leaves[2])
            if backward_inside:
                grads.append(torch.autograd.grad(out, leaves, dout))
        if not backward_inside:
            grads.append(torch.autograd.grad(out, leaves, dout))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_outside_autocast_nothing_changes():
    """No autocast (or autocast off, or autocast of another device type): dtypes must match as before, and an
    fp32 call is bitwise the same with a disabled autocast region around it."""
    inputs = make_expert_inputs(17, 16, 8, 4, 2)
    dout = torch.randn(17, 16)
    plain = run_and_grad(moe_experts, inputs, dout)
    assert plain[0].dtype == torch.float32

    def disabled(**kw):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
            return moe_experts(**kw)

    for a, b in zip(plain, run_and_grad(disabled, inputs, dout)):
        assert torch.equal(a, b)
    mixed = {**inputs, "w_down": inputs["w_down"].bfloat16()}
    with pytest.raises(TypeError, match="w_down has dtype torch.bfloat16; expected x's dtype torch.float32"):
        moe_experts(**mixed)


def test_float64_under_autocast_is_a_clear_error():
    inputs = make_expert_inputs(9, 16, 8, 4, 2, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            TypeError, match=r"x torch.float64, w_gate_up torch.float64, w_down torch.float64.*never fp64"):
        moe_experts(**inputs)
    m = moeblaze.MoE(16, 8, 4, 2, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match="float64"):
        m(torch.randn(5, 16))
    with pytest.raises(TypeError, match="backend='triton' runs the dtypes fp16, bf16 and fp32; x has dtype "
                                        "torch.float64"):
        moe_experts(**inputs, backend="triton")


def _sorted_ids(m):
    return m.last_topk_ids.sort(-1).values


@pytest.mark.parametrize("save", ["preact", "input"])
def test_module_with_fp32_parameters_under_autocast_matches_within_bf16_tolerance(save):
    check_module_under_autocast("cpu", save)


def check_module_under_autocast(device, save):
    """``MoE`` with fp32 parameters under bf16 autocast against its float64 copy, with plain bf16 (the
    layer and ``x`` cast to bf16) as the baseline of DESIGN.md §7, on the tokens all three route alike."""
    torch.manual_seed(0)
    m = moeblaze.MoE(32, 24, 6, 2, save=save, aux_loss_coef=0.0, device=device)
    x = torch.randn(4, 13, 32, device=device)
    runs = {}
    for name, module, dtype, amp in (("amp", m, torch.float32, True), ("f64", _copy(m, torch.float64), torch.float64,
                                     False), ("bf16", _copy(m, torch.bfloat16), torch.bfloat16, False)):
        xi = x.to(dtype).requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
            out = module(xi)
        runs[name] = (module, xi, out)
    assert runs["amp"][2].dtype == torch.bfloat16
    ids = {k: _sorted_ids(v[0]) for k, v in runs.items()}
    alike = (ids["amp"] == ids["f64"]).all(-1) & (ids["bf16"] == ids["f64"]).all(-1)
    assert alike.sum() >= 0.8 * alike.numel()
    go = torch.randn(x.shape, dtype=torch.float64, device=device).reshape(-1, 32) * alike[:, None]
    grads = {}
    for k, (module, xi, out) in runs.items():  # only the tokens routed alike get a gradient
        loss = (out.reshape(-1, 32).double() * go).sum()
        grads[k] = (out.detach().reshape(-1, 32)[alike], *torch.autograd.grad(loss, [xi, *module.parameters()]))
    for i, name in enumerate(("out", "dx", "d router.weight", "dw_gate_up", "dw_down")):
        g = grads["amp"][i]
        if i > 0:
            assert g.dtype == torch.float32, name  # fp32 parameters and input, fp32 gradients
        assert_close_to_reference(name, g, grads["f64"][i], grads["bf16"][i])


def _copy(m, dtype):
    r = m.router
    c = moeblaze.MoE(m.d_model, m.d_ff, m.num_experts, m.top_k, score_func=r.score_func, save=m.save,
                     aux_loss_coef=r.aux_loss_coef, z_loss_coef=r.z_loss_coef)
    c.load_state_dict(m.state_dict())
    return c.to(device=m.w_down.device, dtype=dtype)


@pytest.mark.parametrize("save", ["preact", "input"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_module_under_autocast_equals_bf16_copies(save, score_func):
    check_module_equals_cast_copies("cpu", save, score_func)


def check_module_equals_cast_copies(device, save, score_func):
    """``MoE`` with fp32 parameters under bf16 autocast == its bf16 copy on a bf16 copy of ``x``, bitwise: the
    output, the routing, the auxiliary loss and every gradient (upcast to the fp32 leaves' dtype)."""
    torch.manual_seed(0)
    m = moeblaze.MoE(32, 24, 6, 2, score_func=score_func, save=save, aux_loss_coef=0.1, z_loss_coef=0.01,
                     device=device)
    x = torch.randn(3, 11, 32, device=device)
    go = torch.randn(3, 11, 32, device=device).bfloat16()
    results = []
    for module, xi, amp in ((m, x.clone(), True), (_copy(m, torch.bfloat16), x.bfloat16(), False)):
        xi.requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
            out = module(xi)
        grads = torch.autograd.grad((out.float() * go.float()).sum() + module.aux_loss, [xi, *module.parameters()])
        results.append((out, module.aux_loss, module.last_topk_ids, *grads))
    for i, (a, b) in enumerate(zip(*results)):
        if i >= 3:
            assert a.dtype == torch.float32, i
        assert torch.equal(a, b.to(a.dtype)), (i, rel_error(a, b))


def test_module_trains_under_autocast_with_fp32_master_weights():
    """Forward under autocast, backward, optimizer step: parameters and gradients stay fp32, the loss falls."""
    torch.manual_seed(0)
    m = moeblaze.MoE(8, 16, 4, 2, aux_loss_coef=0.01)
    x, y = torch.randn(64, 8), torch.randn(64, 8)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
            loss = torch.nn.functional.mse_loss(out.float(), y) + m.aux_loss
        opt.zero_grad()
        loss.backward()
        assert all(p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0 for p in m.parameters())
        opt.step()
        losses.append(loss.item())
    assert out.dtype == torch.bfloat16 and all(p.dtype == torch.float32 for p in m.parameters())
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("backend,dtype", [("torch", torch.bfloat16),
                                           pytest.param("triton", torch.float16, marks=interpreted)])
@pytest.mark.parametrize("save", SAVE_MODES)
def test_activation_checkpointing_under_autocast_equals_the_plain_step(backend, dtype, save):
    """``torch.utils.checkpoint`` (non-reentrant) around the layer with fp32 weights under autocast: the experts'
    Functions cast the master weights inside, and the recomputed forward gives bitwise the plain step's output
    and fp32 gradients."""
    torch.manual_seed(0)
    m = moeblaze.MoE(16, 8, 4, 2, save=save, backend=backend, aux_loss_coef=0.01)
    _check_checkpointed_step(m, torch.randn(24, 16), dtype)
    assert all(p.grad.dtype == torch.float32 for p in m.parameters())


def _check_checkpointed_step(m, x, dtype, autocast=True):
    """One step of ``m`` on ``x`` plain and under ``torch.utils.checkpoint`` (non-reentrant), under
    ``torch.autocast(dtype)`` when ``autocast``: the output and every gradient bitwise equal (the last step's gradients
    stay on the parameters)."""
    runs = []
    for ckpt in (False, True):
        xi = x.clone().requires_grad_(True)
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            out = torch.utils.checkpoint.checkpoint(m, xi, use_reentrant=False) if ckpt else m(xi)
            loss = out.float().square().sum() + m.aux_loss
        loss.backward()
        runs.append([out, xi.grad] + [p.grad for p in m.parameters()])
    for a, b in zip(*runs):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=interpreted)])
@pytest.mark.parametrize("save", SAVE_MODES)
def test_fp8_under_activation_checkpointing_equals_the_plain_step(backend, save):
    """The FP8 layer (rowwise recipe) under ``torch.utils.checkpoint`` (non-reentrant): the recomputed forward keeps
    ``pre`` in e4m3 again, the backward writes B3's e4m3 ``dpre`` into that recomputed copy, and the output and every
    gradient are bitwise the plain step's. ``torch`` (the emulation): fp32 weights under bf16 autocast; ``triton``
    (the interpreter): fp32."""
    torch.manual_seed(0)
    m = moeblaze.MoE(32, 16, 4, 2, save=save, backend=backend, fp8=moeblaze.Float8Recipe())
    _check_checkpointed_step(m, torch.randn(24, 32), torch.bfloat16, autocast=backend == "torch")
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())


@pytest.mark.parametrize("setting,expected", [("highest", "ieee"), ("high", "tf32"), ("medium", "tf32")])
def test_fp32_dot_precision_follows_torch(setting, expected):
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision(setting)
        assert dot_precision(torch.float32) == expected
        assert dot_precision(torch.bfloat16) == dot_precision(torch.float16) == "tf32"  # unused for 16-bit
    finally:
        torch.set_float32_matmul_precision(before)


def check_compiled_under_autocast(dtype, shape=(2, 9, 32), d_ff=16, experts=4, top_k=2):
    """``torch.compile(fullgraph=True)`` of a step that enters ``torch.autocast`` itself and invokes ``MoE``
    with fp32 parameters, against the same step in eager mode: output dtype and values, fp32 gradients."""
    torch.manual_seed(0)
    m = moeblaze.MoE(shape[-1], d_ff, experts, top_k, backend="triton", device=DEVICE)
    x = torch.randn(*shape, device=DEVICE, requires_grad=True)

    def forward(x):
        with torch.autocast(DEVICE, dtype=dtype):
            return m(x)

    def run(fn):
        out = fn(x)
        return out, torch.autograd.grad(out.float().square().sum(), [x, *m.parameters()])

    (ref, ref_grads), (out, grads) = run(forward), run(torch.compile(forward, fullgraph=True,
                                                                     backend="inductor" if HAS_CUDA else "aot_eager"))
    assert out.dtype == ref.dtype == dtype
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):  # inductor fuses the router's fp32 backward differently from eager
        assert g.dtype == torch.float32 and rel_error(g, r) <= torch.finfo(dtype).eps, rel_error(g, r)


@kernels_runnable
def test_torch_compile_fullgraph_under_autocast():
    check_compiled_under_autocast(torch.float16)


@interpreted
def test_fused_router_under_autocast_checkpointing_and_compile(monkeypatch):
    """The Triton router (the default on CUDA; forced here, in the interpreter) under autocast with fp32
    weights: activation checkpointing bitwise equals the plain step, torch.compile(fullgraph) the eager step."""
    fused = []
    apply = moeblaze.routing._FusedTopK.apply
    monkeypatch.setattr(moeblaze.routing._FusedTopK, "apply", lambda *a: fused.append(1) or apply(*a))
    with moeblaze.settings.override(backend="triton"):
        for save in SAVE_MODES:
            test_activation_checkpointing_under_autocast_equals_the_plain_step("triton", torch.float16, save)
        check_compiled_under_autocast(torch.float16)
    assert fused  # the fused path ran


# ------------------------------------------------------------------------------------------ GPU (bf16, TF32)

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


@gpu
@needs_cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("save", ["preact", "input"])
def test_gpu_triton_experts_under_autocast_equal_bf16_copies(activation, save):
    inputs = make_expert_inputs(300, 128, 96, 8, 2, activation, device="cuda")
    autocast_equals_cast_copies(inputs, activation, save, "triton", torch.bfloat16)


@gpu
@needs_cuda
@pytest.mark.parametrize("save", ["preact", "input"])
def test_gpu_module_with_fp32_parameters_under_autocast(save):
    check_module_under_autocast("cuda", save)


@gpu
@needs_cuda
@pytest.mark.parametrize("save", ["preact", "input"])
def test_gpu_module_under_autocast_equals_bf16_copies(save):
    check_module_equals_cast_copies("cuda", save, "softmax")


@gpu
@needs_cuda
def test_gpu_torch_compile_fullgraph_under_autocast():
    check_compiled_under_autocast(torch.bfloat16, shape=(4, 256, 128), d_ff=96, experts=8, top_k=2)


@gpu
@needs_cuda
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_gpu_fp32_follows_float32_matmul_precision(activation):
    """fp32 kernels at "highest" (IEEE) and "high" (TF32), each within 2x of torch's own error at that
    setting (the ``torch`` backend: cuBLAS fp32 / TF32) of the float64 reference; TF32 is really used at
    "high" (its error is far above the IEEE one: 10 vs 23 mantissa bits)."""
    inputs = make_expert_inputs(700, 256, 128, 8, 2, activation, device="cuda")
    dout = torch.randn(700, 256, device="cuda")
    ref = reference_outputs(inputs, activation, dout)
    before, errors = torch.get_float32_matmul_precision(), {}
    try:
        for setting in ("highest", "high"):
            torch.set_float32_matmul_precision(setting)
            got = run_and_grad(lambda **kw: moe_experts(**kw, activation=activation, backend="triton"), inputs, dout)
            base = run_and_grad(lambda **kw: moe_experts(**kw, activation=activation, backend="torch"), inputs, dout)
            for name, a, r, b in zip(NAMES, got, ref, base):
                if name != "dtopk_weights":  # a dot product over h, rounded like the rest
                    assert_close_to_reference(f"{setting} {name}", a, r, b)
            errors[setting] = rel_error(got[0], ref[0])
    finally:
        torch.set_float32_matmul_precision(before)
    assert errors["high"] > 30 * errors["highest"], errors

# ----------------------------------------------------------------------------- moeblaze train --precision

def test_precision_names_resolve_like_lightning():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_precision("auto", cpu) == ("fp32", torch.float32, None)
    assert resolve_precision("auto", cuda) == ("bf16-mixed", torch.float32, torch.bfloat16)
    assert resolve_precision("bf16", cuda) == ("bf16", torch.bfloat16, None)
    assert resolve_precision("fp32", cuda) == ("fp32", torch.float32, None)
    with pytest.raises(ConfigError, match="--precision 'fp8'"):
        resolve_precision("fp8", cpu)


def test_mfu_peak_follows_the_precision():
    before = torch.get_float32_matmul_precision()
    try:
        assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16-mixed") == peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
        torch.set_float32_matmul_precision("high")
        assert peak_tflops("NVIDIA H200", "fp32") == 989.0 / 2  # TF32 tensor cores
        torch.set_float32_matmul_precision("highest")
        assert peak_tflops("NVIDIA H200", "fp32") == 67.0  # IEEE fp32, no tensor cores
    finally:
        torch.set_float32_matmul_precision(before)


def test_train_bf16_mixed_keeps_fp32_weights_and_learns(tmp_path):
    """``moeblaze train --precision bf16-mixed`` on the CPU: autocast forward, fp32 parameters in the
    checkpoint, the loss falls."""
    text = tmp_path / "corpus.py"
    text.write_bytes(b"".join(Path(m.__file__).read_bytes() for m in (textwrap, string, bisect)))
    cfg = TrainConfig(data=str(text), out_dir=str(tmp_path / "out"), steps=30, batch_size=8, lr=3e-3,
                      warmup_steps=3, eval_interval=1000, eval_tokens=1024, progress=False, threads=2,
                      precision="bf16-mixed")
    mcfg = ModelConfig(seq_len=32, d_model=32, n_layers=1, n_heads=2, d_ff=32, num_experts=4, top_k=2)
    lines = []
    result = train(cfg, mcfg, log=lines.append)
    assert any("precision bf16-mixed" in line for line in lines)
    assert result.losses[-1] < result.losses[0] - 0.5 and math.isfinite(result.val_bpb)
    latest = checkpoint.find_latest(tmp_path / "out")
    meta = dcp.FileSystemReader(str(latest)).read_metadata().state_dict_metadata
    weights = {k: m.properties.dtype for k, m in meta.items() if k.startswith("model.")}
    assert weights and all(dtype == torch.float32 for dtype in weights.values())


def test_fp32_kernel_configs_are_tuned_per_precision():
    """fp32 autotunes its own lists (``tuned32``); TF32 and IEEE are tuned apart (``DOT_PREC`` in the keys) over
    their own tiles (IEEE: BLOCK_K 16); every BLOCK_K divides the launcher's K quantum."""
    from moeblaze.kernels import launch, tuning

    configs = tuning.gemm_configs("tuned32")
    assert {c.kwargs["PERSISTENT"] for c in configs} == {False, True}
    assert all(launch._K_QUANTUM % c.kwargs["BLOCK_K"] == 0 for c in configs)
    assert "DOT_PREC" in launch._GEMM.key and "DOT_PREC" in launch._WGRAD.key
    wgrad = tuning.wgrad_configs("tuned32")
    for lists, prune in ((configs, tuning.prune_gemm_configs), (wgrad, tuning.prune_fp32_tiles)):
        ieee = prune(lists, {}, DUAL=False, DOT_PREC="ieee")
        tf32 = prune(lists, {}, DUAL=False, DOT_PREC="tf32")
        assert ieee and tf32 and len(ieee) + len(tf32) == len(lists)
        assert all(c.kwargs["BLOCK_K"] == 16 for c in ieee) and all(c.kwargs["BLOCK_K"] >= 32 for c in tf32)
    sixteen = tuning.gemm_configs("tuned16")
    assert tuning.prune_gemm_configs(sixteen, {}, DUAL=False, DOT_PREC="tf32") == sixteen


@kernels_runnable
def test_fp32_ieee_tiles_compute_right(monkeypatch):
    """The BLOCK_K 16 tiles of the IEEE lists (GEMMs and weight gradients) against the float64 reference."""
    from moeblaze.kernels import launch, tuning

    gemm, wgrad = tuning.gemm_configs("fixed32")[0], tuning.wgrad_configs("fixed32")[0]
    assert gemm.kwargs["BLOCK_K"] == wgrad.kwargs["BLOCK_K"] == 16
    gemm.kwargs["PERSISTENT"] = True  # both launch shapes: persistent here, per tile in the fixed config
    for kernel, config in ((launch._GEMM, gemm), (launch._WGRAD, wgrad)):
        monkeypatch.setattr(kernel, "configs", lambda *kind, c=config: [c])
        monkeypatch.setattr(kernel, "_cache", {})
        monkeypatch.setattr(kernel, "_best", {})
    inputs = make_expert_inputs(45, 48, 40, 5, 2, device=DEVICE)
    dout = torch.randn(45, 48, device=DEVICE)
    got = run_and_grad(lambda **kw: moe_experts(**kw, backend="triton"), inputs, dout)
    ref, base = reference_outputs(inputs, "swiglu", dout), reference_outputs(inputs, "swiglu", dout, torch.float32)
    for name, a, r, b in zip(NAMES[:4], got, ref, base):
        assert_close_to_reference(name, a, r, b)


def test_precision_benchmark_smoke_run(tmp_path):
    """``benchmarks/bench_precision.py --smoke`` runs on the CPU and records every part as CSV rows."""
    import csv
    import runpy

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_precision.py"
    bench = runpy.run_path(str(script), run_name="bench_precision")
    out = tmp_path / "rows.csv"
    assert bench["main"](["--smoke", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert {r["part"] for r in rows} == {"amp", "fp32", "train"} and all(r["status"] == "ok" for r in rows)
    assert all(float(r["ms"]) > 0 for r in rows)
    assert {r["variant"] for r in rows if r["part"] == "train"} == {
        "--precision bf16-mixed", "--precision bf16", "--precision fp32"}
