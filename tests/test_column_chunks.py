"""F2/F3 and B3/B5 in column chunks of d (setting ``chunk_cols``, ``moeblaze.kernels.chunks.column_chunks``).

Each chunk's GEMM reads its columns of the whole weight (``grouped_gemm(..., n_start=)``) into one ``[N, width]``
buffer whose gather-sum fills those columns of ``out`` / ``dx``. CPU: the interpreter in fp32/fp16 (both TMA
descriptor layouts, pointer loads, biases, GPT-OSS's transposed weights, foreign experts, pair lists); GPU
(``-m gpu``): bf16.
"""

import pytest
import torch

import moeblaze
from moeblaze import build_dispatch, moe_experts
from moeblaze.kernels import launch
from moeblaze.kernels.chunks import column_chunks, peak_headroom
from moeblaze.kernels.grouped_gemm import B_DESC_KN, B_DESC_NK, EPILOGUE_ACT_FWD
from moeblaze.testing import rel_error, run_and_grad
from test_experts_triton import DEVICE, NAMES, check_against_reference, gpu, inputs, kernels_runnable, needs_cuda

pytestmark = kernels_runnable


def assert_same(a, b, name):
    """Bitwise on the GPU. In the interpreter ``tl.dot`` is numpy's matmul, whose OpenBLAS kernels sum a block's
    products in an order that depends on the block's N width (OpenBLAS 0.3.31 with numpy 2.4.6: ``A @ B[:, :16]``
    is not ``(A @ B)[:, :16]`` bitwise), so chunks of other widths agree within a few roundings there."""
    if DEVICE == "cuda":
        assert torch.equal(a, b), name
    else:
        assert a.dtype == b.dtype and rel_error(b, a) < 8 * torch.finfo(a.dtype).eps, name


def chunked_vs_whole(inp, activation="swiglu", save="preact", cols=16, **options):
    """Every result with chunks of ``cols`` columns (several, the last narrower) equals one chunk's (bitwise on
    the GPU: :func:`assert_same`)."""
    dout = torch.randn(inp["x"].shape, dtype=inp["x"].dtype, device=DEVICE)
    fn = lambda **kw: moe_experts(**kw, activation=activation, save=save, backend="triton", **options)  # noqa: E731
    with moeblaze.settings.override(chunk_cols="off"):
        whole = run_and_grad(fn, inp, dout)
    with moeblaze.settings.override(chunk_cols=cols):
        chunked = run_and_grad(fn, inp, dout)
    for name, a, b in zip(NAMES, whole, chunked):
        assert_same(a, b, name)
    return chunked


def record_weight_descriptors(monkeypatch) -> list[tuple[int, int, int]]:
    """Check every grouped-GEMM launch that reads its weight through a TMA descriptor: the descriptor's base is
    16-byte aligned, it ends inside the weight's storage, and it covers the columns the launch computes.
    Returns ``(B_DESC, first element offset, N_COLS)`` per such launch."""
    seen, real = [], launch._GEMM.launch

    def checked(dtype, grid, **kw):
        b, mode = kw["b_ptr"], kw["B_DESC"]
        if mode in (B_DESC_NK.value, B_DESC_KN.value):
            E, elem = kw["NUM_EXPERTS"], b.element_size()
            if mode == B_DESC_NK.value:
                rows, cols, stride = kw["B_ROWS"], kw["K_DIM"], kw["stride_b_n"]
                assert (E - 1) * kw["N_EXT"] + kw["N_COLS"] <= rows  # every expert's chunk rows are inside
            else:
                rows, cols, stride = E * kw["K_DIM"], kw["N_EXT"], kw["stride_b_k"]
                assert kw["N_COLS"] <= cols
            storage = b.untyped_storage()
            assert b.data_ptr() % 16 == 0
            assert b.data_ptr() + ((rows - 1) * stride + cols) * elem <= storage.data_ptr() + storage.nbytes()
            seen.append((mode, b.storage_offset(), kw["N_COLS"]))
        return real(dtype, grid, **kw)

    monkeypatch.setattr(launch._GEMM, "launch", checked)
    return seen


@pytest.mark.parametrize("save", ["preact", "input"])
def test_chunks_bitwise_equal_one_chunk_both_descriptor_layouts(save, monkeypatch):
    seen = record_weight_descriptors(monkeypatch)
    # d 48 in chunks 16, 16, 16; 2h = 64: F2 reads w_down through the NK descriptor, B3 w_gate_up through KN
    chunked_vs_whole(inputs(45, 48, 32, 5, 3, routing="zipf"), save=save)
    starts = {(mode, off) for mode, off, _ in seen}
    nk, kn = B_DESC_NK.value, B_DESC_KN.value
    assert {(nk, 16 * 32), (nk, 32 * 32), (kn, 16), (kn, 32)} <= starts  # chunk starts 16 and 32 of both weights
    with moeblaze.settings.override(chunk_cols=32):  # fp16, chunks 32 and 16, against the float64 reference
        check_against_reference(inputs(33, 48, 32, 4, 2, dtype=torch.float16), "swiglu", save)


@pytest.mark.parametrize("save", ["preact", "input"])
def test_fp8_chunks_equal_one_chunk(save):
    """The FP8 layer's B3 in chunks, each on its own e4m3 copy of the rows of ``w1^T`` it reads (the whole copy is
    never live): one chunk's results (bitwise on the GPU, in bf16 there)."""
    from moeblaze.fp8 import Float8Recipe

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    chunked_vs_whole(inputs(45, 48, 32, 5, 3, routing="zipf", dtype=dtype), save=save, fp8=Float8Recipe())


def test_chunks_with_biases_transposed_weights_foreign_experts_and_pairs(monkeypatch):
    """Biases and GPT-OSS's transposed, interleaved weights (B3 through the NK descriptor), foreign slots (counted
    as zero), general routing's CSR pair lists (a token without pairs: zero output and gradient)."""
    from test_expert_features import make_inputs

    seen = record_weight_descriptors(monkeypatch)
    inp = make_inputs(30, 48, 16, 5, 2, "swiglu_clamped", torch.float32, interleaved=True, foreign=True)
    chunked_vs_whole(inp, "swiglu_clamped", gate_up_interleaved=True, foreign_experts=True)
    assert any(mode == B_DESC_NK.value and off > 0 for mode, off, _ in seen)
    inp = inputs(30, 48, 16, 6, 2)
    inp["topk_ids"][::3, 0] = 6  # an expert of another rank
    chunked_vs_whole(inp, foreign_experts=True)
    from moeblaze.general_routing import moe_experts_general

    inp = inputs(25, 48, 16, 5, 1)
    tok = torch.tensor([0, 0, 1, 3, 3, 3, 7, 20, 24, 24], dtype=torch.int32, device=DEVICE)
    exp = torch.tensor([0, 4, 2, 1, 2, 3, 0, 4, 1, 3], dtype=torch.int32, device=DEVICE)
    w = torch.rand(10, device=DEVICE)
    dout = torch.randn(25, 48, device=DEVICE)
    results = []
    for chunk in ("off", 16):
        x = inp["x"].detach().clone().requires_grad_()
        with moeblaze.settings.override(chunk_cols=chunk):
            out = moe_experts_general(x, tok, exp, w, inp["w_gate_up"], inp["w_down"], backend="triton")
            results.append((out, torch.autograd.grad(out, x, dout)[0]))
    assert_same(results[0][0], results[1][0], "out")
    assert_same(results[0][1], results[1][1], "dx")
    assert torch.count_nonzero(results[1][0][2]) == 0 and torch.count_nonzero(results[1][1][2]) == 0


def test_chunk_rule():
    """auto: one chunk below 256 MiB of [N, d] buffer; above, the fewest chunks no wider than max(512, h to 128), of
    equal widths rounded up to 128."""
    assert column_chunks(4096 * 8, 2048, 768, 2) == [(0, 2048)]  # 128 MiB in bf16 (4k tokens, K 8)
    N = 65536 * 8  # Qwen3-30B-A3B at 64k tokens: a 2 GiB buffer in bf16
    assert column_chunks(N, 2048, 768, 2) == [(0, 768), (768, 1536), (1536, 2048)]
    assert column_chunks(N, 1536, 256, 2) == [(0, 1536)]  # F2's K h 256: a short K loop, one chunk
    assert column_chunks(N, 1536, 512, 2) == [(0, 1536)]  # B3's K 2h 512: one chunk
    assert column_chunks(N, 2048, 8192, 2) == [(0, 2048)]  # h >= d: one chunk
    assert column_chunks(N, 2048, 1536, 2) == [(0, 1024), (1024, 2048)]  # B3's cap, dpre's row 2h: two equal chunks
    assert column_chunks(N, 7168, 4096, 2) == [(0, 3584), (3584, 7168)]  # DeepSeek-V3's B3 (h 2048)
    assert column_chunks(N, 2000, 1536, 2) == [(0, 1024), (1024, 2000)]  # d off the 128 grid: the last one narrower
    # FP8 B3: e4m3 dpre under a bf16 buffer, chunks of no more bytes than its rows (2h 1,536: 768 columns)
    assert column_chunks(N, 2048, 1536, 2, a_elem=1) == [(0, 768), (768, 1536), (1536, 2048)]
    assert column_chunks(N, 2048, 2048, 2, a_elem=1) == [(0, 1024), (1024, 2048)]  # OLMoE-1B-7B (2h 2,048)
    assert column_chunks(N, 2048, 768, 2, a_elem=1) == [(0, 512), (512, 1024), (1024, 1536), (1536, 2048)]
    with moeblaze.settings.override(chunk_cols="off"):
        assert column_chunks(N, 2048, 768, 2) == [(0, 2048)]
    with moeblaze.settings.override(chunk_cols=" 32 "):
        assert column_chunks(10, 40, 8, 4) == [(0, 32), (32, 40)] and column_chunks(10, 0, 8, 4) == [(0, 0)]
    for bad in (0, 24, "half", -16):
        with pytest.raises(ValueError, match="chunk_cols"):
            moeblaze.settings.configure(chunk_cols=bad)


def test_chunk_rule_headroom():
    """auto with the allocator's headroom: the fewest equal chunks whose buffer fits in it, never more than the capped
    rule's; a GPU with no peak above the current allocation gets the capped chunks, a CPU tensor no headroom. The
    headroom is read only where auto chunks."""
    N = 65536 * 8
    capped = [(0, 768), (768, 1536), (1536, 2048)]

    def room(n_bytes):
        return lambda: n_bytes

    def unread():
        raise AssertionError("the headroom was read where no auto chunking applies")

    assert column_chunks(N, 2048, 768, 2, headroom=None) == capped
    assert column_chunks(N, 2048, 768, 2, headroom=room(None)) == capped
    assert column_chunks(N, 2048, 768, 2, headroom=room(0)) == capped
    assert column_chunks(N, 2048, 768, 2, headroom=room(N * 2048 * 2)) == [(0, 2048)]  # the whole buffer fits
    assert column_chunks(N, 2048, 768, 2, headroom=room(N * 2048 * 2 - 1)) == [(0, 1024), (1024, 2048)]
    assert column_chunks(N, 2048, 768, 2, headroom=room(N * 1024 * 2 - 1)) == capped  # 3 chunks of 768 is the most
    assert column_chunks(N, 2048, 1536, 2, headroom=room(10**15)) == [(0, 2048)]
    copy = 128 * (1536 + 4)  # FP8 B3: each chunk column's e4m3 row of w1^T and its scale, E 128, 2h 1,536
    fits = (N * 2 + copy) * 2048
    assert column_chunks(N, 2048, 1536, 2, room(fits), 1, copy) == [(0, 2048)]
    assert column_chunks(N, 2048, 1536, 2, room(fits - 1), 1, copy) == [(0, 1024), (1024, 2048)]
    assert column_chunks(4096 * 8, 2048, 768, 2, headroom=unread) == [(0, 2048)]  # under 256 MiB: one chunk
    with moeblaze.settings.override(chunk_cols="512"):
        assert column_chunks(N, 2048, 768, 2, headroom=unread) == [(0, 512), (512, 1024), (1024, 1536), (1536, 2048)]
    with moeblaze.settings.override(chunk_cols="off"):
        assert column_chunks(N, 2048, 768, 2, headroom=unread) == [(0, 2048)]
    assert peak_headroom(torch.device("cpu")) is None


def test_slot_buffer_falls_back_to_capped_chunks_on_out_of_memory(monkeypatch):
    """A wide buffer, or the first chunk's weight copy beside it (FP8 B3), that fits the headroom but not the free
    memory falls back to the capped chunks; an out-of-memory error of the capped chunks' own is not swallowed."""
    from moeblaze.kernels import chunks

    N, d, h = 65536 * 8, 2048, 768
    monkeypatch.setattr(chunks, "peak_headroom", lambda device: 10**15)

    class Fake:  # a tensor stand-in whose allocations over `limit` columns fail as the CUDA allocator would
        def __init__(self, limit):
            self.limit, self.device = limit, torch.device("cpu")

        def element_size(self):
            return 2

        def new_empty(self, rows, cols):
            if cols > self.limit:
                raise torch.OutOfMemoryError("fake: out of memory")
            return (rows, cols)

    assert chunks._slot_buffer(Fake(limit=4096), N, d, h) == ([(0, 2048)], (N, 2048), None)
    capped = [(0, 768), (768, 1536), (1536, 2048)]
    assert chunks._slot_buffer(Fake(limit=1000), N, d, h) == (capped, (N, 768), None)
    with pytest.raises(torch.OutOfMemoryError):
        chunks._slot_buffer(Fake(limit=100), N, d, h)

    # FP8 B3: the buffer fits, the first chunk's weight copy does not: the capped chunks, and their first copy
    def weight_rows(limit):
        def rows(c0, c1):
            if c1 - c0 > limit:
                raise torch.OutOfMemoryError("fake: out of memory")
            return (c0, c1), "scale"
        return rows

    assert chunks._slot_buffer(Fake(limit=4096), N, d, h, 1, 8, weight_rows(4096)) == (
        [(0, 2048)], (N, 2048), ((0, 2048), "scale"))
    assert chunks._slot_buffer(Fake(limit=4096), N, d, 1536, 1, 8, weight_rows(1000)) == (
        capped, (N, 768), ((0, 768), "scale"))
    with pytest.raises(torch.OutOfMemoryError):
        chunks._slot_buffer(Fake(limit=4096), N, d, 1536, 1, 8, weight_rows(100))


def test_chunk_widths_of_one_layer_share_the_gather_sum_tuning(monkeypatch):
    """A chunk width first seen later in a run (the headroom widens the chunks from the second step on) finds the
    gather-sums' tuning of the first width: they are keyed on the output's row width d, not on the chunk's."""
    from moeblaze.kernels import combine, tuning

    tuned = []
    real = tuning.Launchable.tuner
    monkeypatch.setattr(tuning.Launchable, "tuner",
                        lambda self, dtype, bucket=None: tuned.append(self.fn) or real(self, dtype, bucket))
    monkeypatch.setattr(combine._GATHER_SUM, "_best", {})  # forget earlier tests' keys
    inp = inputs(40, 64, 24, 4, 2)
    dout = torch.randn(40, 64, device=DEVICE)
    fn = lambda **kw: moe_experts(**kw, backend="triton")  # noqa: E731
    for cols in (32, 16, "off"):  # two chunk widths, then whole rows
        with moeblaze.settings.override(chunk_cols=cols):
            run_and_grad(fn, inp, dout)
    assert tuned.count(combine.gather_sum_kernel) == 2  # F3 (weighted) and B5 (plain), once each


@pytest.mark.gpu
def test_gpu_chunks_never_raise_the_peak():
    """F2-F3 under the headroom rule (T 65,536 at the Qwen3-30B-A3B shape, bf16, a 2 GiB [N, d] buffer): the capped
    chunks where no earlier peak left room, one chunk (bitwise the same output) where one did, without raising the
    peak by more than launch scratch."""
    from moeblaze.kernels.chunks import gemm_gather_sum
    T, d, h, E, K = 65536, 2048, 768, 128, 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.rand(T, E, device="cuda", generator=gen).topk(K, dim=1).indices.to(torch.int32)
    idx = build_dispatch(ids, E, block_m=128)
    act = torch.randn(T * K, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    w2 = torch.randn(E, d, h, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.03
    weights = torch.rand(T, K, device="cuda", generator=gen).to(torch.bfloat16)
    sched = (idx.schedule.tile_expert, idx.schedule.tile_row_start, idx.schedule.num_tiles)

    def run():
        return gemm_gather_sum(act, w2, True, h, idx.expert_token_offsets, idx.expert_token_indices, sched,
                                idx.token_index_map, weights, False, None, T, d, h)

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.max_memory_allocated()
    first = run()  # no headroom yet: the capped chunks set the peak
    peak = torch.cuda.max_memory_allocated()
    assert peak - base < T * d * 2 + T * K * 1024 * 2  # out and a 768-column buffer, not a 2048-column one
    del first
    with moeblaze.settings.override(chunk_cols="off"):
        ref = run()
    torch.cuda.reset_peak_memory_stats()
    spare = torch.empty(T * K * d * 2 + T * d * 2, dtype=torch.uint8, device="cuda")  # a peak above: room for one chunk
    del spare
    high = torch.cuda.max_memory_allocated()
    assert torch.equal(run(), ref)  # one chunk now, bitwise the same
    assert torch.cuda.max_memory_allocated() <= high + 2**20  # launch scratch at most


def test_bad_chunk_arguments_are_clear_errors():
    from moeblaze.kernels.combine import gather_sum

    idx = build_dispatch(torch.zeros(4, 1, dtype=torch.int64, device=DEVICE), 1)
    x, w, c = torch.ones(4, 8, device=DEVICE), torch.ones(1, 48, 8, device=DEVICE), torch.empty(4, 16, device=DEVICE)
    args = (x, w, c, idx.expert_token_offsets, idx.expert_token_indices, (None, None, None))
    with pytest.raises(ValueError, match="plain epilogue"):
        launch.grouped_gemm(*args, b_nk=True, n_cols=16, k_dim=8, gather_a=True, epilogue=EPILOGUE_ACT_FWD.value,
                            n_start=16)
    for start, cols in ((8, 16), (40, 16), (-16, 16)):
        with pytest.raises(ValueError, match="multiple of 16 inside"):
            launch.grouped_gemm(*args, b_nk=True, n_cols=cols, k_dim=8, gather_a=True, n_start=start)
    src, tim = torch.ones(4, 8, device=DEVICE), idx.token_index_map
    for out in (torch.empty(4, 6, device=DEVICE), torch.empty(4, 8, dtype=torch.float16, device=DEVICE),
                torch.empty(8, 4, device=DEVICE).t()):
        with pytest.raises(ValueError, match="gather_sum: out must be"):
            gather_sum(src, tim, None, torch.float32, out=out)


@gpu
@needs_cuda
@pytest.mark.parametrize("save", ["preact", "input"])
def test_gpu_column_chunks_bf16(save):
    """bf16 on the GPU (TMA weight reads from a chunk's first column): bitwise the one-chunk result, and within
    the DESIGN.md §7 rule of the float64 reference."""
    inp = inputs(3000, 1024, 384, 16, 4, dtype=torch.bfloat16, routing="zipf")
    chunked_vs_whole(inp, save=save, cols=384)
    with moeblaze.settings.override(chunk_cols=384):
        check_against_reference(inp, "swiglu", save)


def test_tf32_chunks_copy_only_their_columns(monkeypatch):
    """fp32 at TF32 precision (the GPU path, forced here): the results are one chunk's (:func:`assert_same`), and
    each chunk's rounded weight copy holds its own columns only."""
    copies = []
    real_copy, real_round = launch.tf32_copy, launch.round_tf32
    monkeypatch.setattr(launch, "rounds_tf32", lambda a: a.dtype == torch.float32)
    inp = inputs(40, 48, 32, 4, 2)
    chunked_vs_whole(inp)
    monkeypatch.setattr(launch, "tf32_copy", lambda t, **kw: copies.append(tuple(t.shape)) or real_copy(t, **kw))
    monkeypatch.setattr(launch, "round_tf32", lambda t: copies.append(tuple(t.shape)) or real_round(t))
    with moeblaze.settings.override(chunk_cols=16):
        run_and_grad(lambda **kw: moe_experts(**kw, backend="triton"), inp, torch.randn(40, 48, device=DEVICE))
    # F2 rounds w_down [4, 48, 32] as three [4, 16, 32] (B1 copies it whole, once); B3 copies w_gate_up
    # [4, 64, 48] as three [4, 64, 16] (F1 rounds it whole, once)
    assert copies.count((4, 16, 32)) == 3 and copies.count((4, 64, 16)) == 3
    assert copies.count((4, 48, 32)) == 1 and copies.count((4, 64, 48)) == 1


@gpu
@needs_cuda
def test_gpu_forward_override_reaches_the_backward(monkeypatch):
    """``override(chunk_cols=64)`` around the forward reaches B3's chunks in the backward, which autograd runs on
    its CUDA device thread (``settings.carried_to_backward``); without it the backward reads the default."""
    from moeblaze.kernels import chunks

    seen = []
    real = chunks.column_chunks
    monkeypatch.setattr(chunks, "column_chunks",
                        lambda *a, **k: seen.append(moeblaze.settings.get("chunk_cols")) or real(*a, **k))
    monkeypatch.delenv("MOEBLAZE_CHUNK_COLS", raising=False)
    torch.manual_seed(0)
    moe = moeblaze.MoE(256, 192, num_experts=32, top_k=4).cuda().to(torch.bfloat16)
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with moeblaze.settings.override(chunk_cols=64):
        loss = moe(x).float().square().sum()
    loss.backward()
    assert seen == [64, 64]  # F2 in the forward, B3 in the backward
    seen.clear()
    moe(x).float().square().sum().backward()
    assert seen == ["auto", "auto"]
