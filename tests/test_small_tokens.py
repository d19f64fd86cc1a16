"""Few tokens per expert (issue 24): the grouped GEMMs' small-T bucket (half-height M-tiles).

The bucket is a function of N = T*K and E only (``kernels.tuning.block_m``); the layer builds the index's
tile schedule for it once, and the results stay within the float64-reference tolerance (DESIGN.md §7) in
both buckets. CPU: Triton's interpreter (fp32); GPU (``-m gpu``): bf16, TMA and pointer weight reads.
"""

from __future__ import annotations

import os

import pytest
import torch
import triton

import moeblaze
from moeblaze import moe_experts
from moeblaze.backends import get_backend
from moeblaze.kernels import tuning
from moeblaze.testing import (
    assert_close_to_reference,
    make_expert_inputs,
    reference_outputs,
    router_weight_grad_magnitude,
    run_and_grad,
)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
NAMES = ("out", "dx", "dw_gate_up", "dw_down", "dtopk_weights")
pytestmark = pytest.mark.skipif(not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


def test_block_m_buckets_depend_on_tokens_per_expert_only():
    base = tuning.block_m()
    half = base // 2
    assert tuning.block_m(half * 8 - 1, 8) == half  # fewer than half a tile per expert on average
    assert tuning.block_m(half * 8, 8) == base
    assert tuning.block_m(10**6, 8) == base and tuning.block_m(0, 8) == half
    x = torch.empty(2, 4, device=DEVICE)
    assert get_backend("triton", x).block_m(half * 8 - 1, 8) == half
    assert get_backend("triton", x).block_m() == base  # no N, E: the large bucket
    assert get_backend("torch", x).block_m(5, 8) is None


def test_one_function_chooses_the_m_tile(monkeypatch):
    """``kernels.tuning.block_m`` is the only source of the M tile: under another rule (16 rows here) the backend's
    plan, token rounding's tile, the ops' schedule and the launchers' ``BLOCK_M`` and check all follow it (a
    caller with a rule of its own would fail the launcher's schedule check), and the results stay the reference's."""
    from moeblaze.dispatch import build_dispatch
    from moeblaze.kernels import experts as kernel_experts

    T, E, K = 80, 2, 2  # 80 slots per expert: the large bucket's 128 (32 under the interpreter), not 16
    assert tuning.block_m(T * K, E) == tuning.block_m() != 16
    monkeypatch.setattr(tuning, "block_m", lambda num_pairs=None, num_experts=None: 16)
    ids = torch.tensor([[0, 1]] * T, dtype=torch.int32, device=DEVICE)
    assert get_backend("triton", ids.float()).plan(ids, E).schedule.block_m == 16
    assert moeblaze.tile_multiple("triton", DEVICE) == 16
    assert len(kernel_experts._schedule(build_dispatch(ids, E))[0]) == T * K // 16 + E  # cdiv(N, 16) + E entries
    _check(T, 16, 8, E, K, torch.float32)


def _check(T, d, h, E, K, dtype, activation="swiglu", save="preact", routing="uniform"):
    inputs = make_expert_inputs(T, d, h, E, K, activation, dtype, device=DEVICE, routing=routing)
    dout = torch.randn(inputs["x"].shape, dtype=dtype, device=DEVICE)
    got = run_and_grad(lambda **kw: moe_experts(**kw, activation=activation, save=save, backend="triton"),
                       inputs, dout)
    ref = reference_outputs(inputs, activation, dout)
    base = reference_outputs(inputs, activation, dout, dtype=dtype)
    torch_backend = run_and_grad(lambda **kw: moe_experts(**kw, activation=activation, save=save, backend="torch"),
                                 inputs, dout)
    for name, a, r, b, b2 in zip(NAMES, got, ref, base, torch_backend):  # the worse plain-PyTorch baseline counts
        mag = router_weight_grad_magnitude(inputs, activation, dout) if name == "dtopk_weights" else None
        assert_close_to_reference(name, a, r, (b, b2), magnitude=mag)


def test_tokens_bucket_is_a_power_of_four_of_slots_per_expert():
    assert [tuning.tokens_bucket(n * 128, 128) for n in (1, 3, 4, 63, 64, 128, 255, 256, 1024, 2048, 4096)] == \
        [1, 1, 4, 16, 64, 64, 64, 256, 1024, 1024, 4096]
    assert tuning.tokens_bucket(0, 8) == 1 and tuning.tokens_bucket(5, 0) == 4  # never a division by zero


class _Kernel:  # stands for a jitted kernel: records the launches, and whether the autotuner ran them
    arg_names = ["a_ptr", "N_COLS", "ROWS"]

    def __init__(self) -> None:
        self.launched: list[dict] = []


def test_a_new_tokens_bucket_tunes_afresh_and_a_known_one_does_not(monkeypatch):
    """Each bucket gets its own autotuner (triton's keeps one config per key): a second bucket benchmarks,
    a third launch in a known bucket takes the remembered config without the autotuner."""
    kernel, tuned = _Kernel(), []
    launchable = tuning.Launchable(kernel, lambda kind: [], key=["N_COLS"],
                                   bucket=lambda a: tuning.tokens_bucket(a["ROWS"], 4))
    monkeypatch.setattr(tuning, "autotune_enabled", lambda: True)
    monkeypatch.setattr(tuning, "interpreting", lambda: False)

    class Tuner:
        def __init__(self, bucket):
            self.bucket, self.best_config = bucket, None

        def __getitem__(self, grid):
            def run(**kwargs):
                tuned.append(self.bucket)
                self.best_config = triton.Config({"BLOCK_N": 64 * self.bucket})
            return run

    tuners = {}
    monkeypatch.setattr(launchable, "tuner", lambda dtype, bucket: tuners.setdefault(bucket, Tuner(bucket)))
    monkeypatch.setattr(launchable, "_go", lambda grid, args, kwargs, extra: kernel.launched.append(extra))
    a = torch.empty(4, dtype=torch.bfloat16)
    for rows in (4 * 64, 4 * 4, 4 * 100, 4 * 16):  # buckets 64, 4, 64, 16
        launchable.launch(torch.bfloat16, (1,), a_ptr=a, N_COLS=32, ROWS=rows)
    assert tuned == [64, 4, 16]
    assert [k["BLOCK_N"] for k in kernel.launched] == [64 * 64]  # the third launch: bucket 64's, no autotuner


@pytest.mark.parametrize("save", ["preact", "input"])
@pytest.mark.parametrize("T,E,K", [(6, 4, 2), (40, 8, 1), (3, 16, 4)])
def test_small_bucket_matches_reference(T, E, K, save):
    assert tuning.block_m(T * K, E) == tuning.block_m() // 2
    _check(T, 16, 8, E, K, torch.float32, save=save)


def _launches(monkeypatch, wgrad: str | None = None, tma: bool = True) -> None:
    """Force the weight gradients' launch mode (``"1"`` persistent, ``"0"`` per tile; None: the library's) and,
    with ``tma`` off, pointer reads where TMA descriptors would serve (:mod:`moeblaze.kernels.tuning`)."""
    if wgrad is not None:
        monkeypatch.setattr(tuning, "_wgrad_launch", lambda: wgrad)
    if not tma:
        monkeypatch.setattr(tuning, "tma_enabled", lambda device: False)


@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("T,d,h,E,K", [(3, 16, 8, 16, 4), (70, 80, 72, 3, 2), (40, 48, 40, 8, 1)])
def test_persistent_weight_gradient_matches_reference(T, d, h, E, K, tma, monkeypatch):
    """The persistent weight gradient: a program walks several tiles of several experts (4 programs under the
    interpreter), empty experts (T 3, E 16) store zeros, experts of more than one BLOCK_K step (T 70),
    several P and Q tiles per expert (d 80, 2h 144); TMA and pointer reads of the slot rows."""
    _launches(monkeypatch, "1", tma)
    assert {c.kwargs["PERSISTENT"] for c in tuning.wgrad_configs("interpret", tuning._wgrad_launch())} == {True}
    _check(T, d, h, E, K, torch.float32)
    _check(T, d, h, E, K, torch.float16)


def test_wgrad_launch_modes_pick_the_launches():
    """``auto`` (the library's) tunes both launches of the 16-bit tiles, ``1`` / ``0`` one of them; fp32 lists
    stay per tile."""
    both = {c.kwargs["PERSISTENT"] for c in tuning.wgrad_configs("tuned16", "auto")}
    assert both == {False, True}
    assert {c.kwargs["PERSISTENT"] for c in tuning.wgrad_configs("tuned16", "1")} == {True}
    assert {c.kwargs["PERSISTENT"] for c in tuning.wgrad_configs("tuned16", "0")} == {False}
    assert [c.kwargs["PERSISTENT"] for c in tuning.wgrad_configs("fixed16", "1")] == [True]
    assert [c.kwargs["PERSISTENT"] for c in tuning.wgrad_configs("fixed16", "auto")] == [False]
    for kind in ("tuned32", "fixed32"):
        assert {c.kwargs["PERSISTENT"] for c in tuning.wgrad_configs(kind, "1")} == {False}
    assert tuning._wgrad_launch() == tuning._gemm_launch() == "auto"  # no setting: the autotuner picks


def test_layer_builds_the_small_bucket_schedule_once(monkeypatch):
    """The layer asks the dispatch build for the bucket's schedule; the ops never rebuild it."""
    import moeblaze.dispatch as md
    from moeblaze.kernels import schedule as ks

    sizes = []
    for mod, name, pos in ((md, "build_tile_schedule_torch", 2), (ks, "tile_schedule", 1)):  # block_m's position
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _pos=pos, **k: sizes.append(a[_pos]) or _real(*a, **k))
    torch.manual_seed(0)
    moe = moeblaze.MoE(16, 8, 8, 2, backend="triton", device=DEVICE)
    x = torch.randn(5, 16, device=DEVICE, requires_grad=True)  # N = 10 < 8 * BLOCK_M / 2
    moe(x).sum().backward()
    assert sizes == ([] if HAS_CUDA else [tuning.block_m() // 2])
    assert x.grad is not None and moe.w_down.grad is not None


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tma", ["1", "0"])
@pytest.mark.parametrize("T,d,h,E,K,activation", [(64, 256, 128, 16, 2, "swiglu"), (512, 512, 256, 128, 8, "swiglu"),
                                                  (200, 256, 192, 64, 4, "gelu"), (96, 512, 256, 32, 1, "swiglu")])
def test_gpu_bf16_small_bucket(T, d, h, E, K, activation, tma, monkeypatch):
    _launches(monkeypatch, tma=tma == "1")
    assert tuning.block_m(T * K, E) == 64
    for save in ("preact", "input"):
        _check(T, d, h, E, K, torch.bfloat16, activation=activation, save=save)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("T,d,h,E,K", [(2048, 512, 384, 128, 8), (300, 256, 192, 64, 4), (40, 256, 128, 16, 2)])
def test_gpu_persistent_weight_gradient_bf16(T, d, h, E, K, tma, monkeypatch):
    """The persistent weight gradient on the GPU (the Triton kernel: the Gluon one off): within the float64
    reference's tolerance, and bitwise the per-tile launch's gradients under fixed configurations (the same tile,
    the same slot steps in the same order)."""
    from moeblaze.kernels import launch

    monkeypatch.setattr(launch, "ws_wgrad_ok", lambda *a: False)
    inputs = make_expert_inputs(T, d, h, E, K, "swiglu", torch.bfloat16, device=DEVICE)
    dout = torch.randn(inputs["x"].shape, dtype=torch.bfloat16, device=DEVICE)
    grads = {}
    for persistent in ("0", "1"):
        with monkeypatch.context() as m, moeblaze.settings.override(autotune=False):
            _launches(m, persistent, tma)
            grads[persistent] = run_and_grad(lambda **kw: moe_experts(**kw, backend="triton"), inputs, dout)
    for name, a, b in zip(NAMES, grads["0"], grads["1"]):
        assert torch.equal(a, b), name
    _launches(monkeypatch, "1", tma)
    _check(T, d, h, E, K, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("b_desc", [True, False])
@pytest.mark.parametrize("T,d,h,E,K", [(2048, 2048, 768, 128, 8), (300, 256, 192, 64, 4), (16384, 1536, 1024, 128, 2)])
def test_gpu_tuned_persistent_wgrad_configs_bitwise(T, d, h, E, K, b_desc):
    """Every persistent config of the tuned list (the tiles the autotuner picks, which the layer tests with fixed
    configs never run) equals the per-tile launch of the same tile bitwise, B2's layout and B4's transposed
    store, and the float64 sums within bf16 rounding."""
    from moeblaze.dispatch import build_dispatch
    from moeblaze.kernels import launch
    from moeblaze.kernels.wgrad import grouped_wgrad_kernel

    triton.set_allocator(launch._scratch)
    gen = torch.Generator(device=DEVICE).manual_seed(T)
    ids = torch.randn(T, E, device=DEVICE, generator=gen).topk(K, dim=1).indices.to(torch.int32)
    index = build_dispatch(ids, E)
    offsets, indices = index.expert_token_offsets, index.expert_token_indices
    N = indices.numel()
    for p, q, transpose in ((d, h, False), (d, 2 * h, True)):  # B2 dW_down, B4 dW_gate_up^T
        a = torch.randn(T, p, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        b = torch.randn(N, q, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        ref = torch.stack([a[indices[offsets[e]:offsets[e + 1]].long()].double().T
                           @ b[offsets[e]:offsets[e + 1]].double() for e in range(E)])
        ref = ref.transpose(1, 2) if transpose else ref
        grid = launch._tiles_grid(lambda m, p=p, q=q: E * triton.cdiv(p, m["BLOCK_P"]) * triton.cdiv(q, m["BLOCK_Q"]),
                                  a.device)
        for config in tuning.wgrad_configs("tuned16", "1"):
            outs = []
            for persistent in (False, True):
                out = torch.full(ref.shape, float("nan"), dtype=a.dtype, device=DEVICE)
                stride_c_p, stride_c_q = (out.stride(2), out.stride(1)) if transpose else out.stride()[1:]
                meta = dict(config.kwargs, PERSISTENT=persistent)
                grouped_wgrad_kernel[grid(meta)](
                    a_ptr=a, b_ptr=b, c_ptr=out, offsets_ptr=offsets, indices_ptr=indices, P=p, Q=q, ROWS=N,
                    stride_a_m=a.stride(0), stride_a_p=1, stride_b_m=b.stride(0), stride_b_q=1,
                    stride_c_e=out.stride(0), stride_c_p=stride_c_p, stride_c_q=stride_c_q, NUM_EXPERTS=E,
                    GATHER_A=True, B_DESC=b_desc, DOT_PREC="tf32", E_POW2=triton.next_power_of_2(E),
                    num_warps=config.num_warps, num_stages=config.num_stages, **meta)
                outs.append(out)
            assert torch.equal(outs[0], outs[1]), config
            # bf16 output: rounding costs up to 2^-8 of the largest sum, plus the fp32 accumulation's error
            # (this check as a script: 0.0021-0.0036 on an H200); a wrong slot or tile costs O(1)
            assert (outs[1].double() - ref).abs().max() <= 2 ** -7 * ref.abs().max(), config
