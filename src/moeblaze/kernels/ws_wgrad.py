"""Warp-specialized grouped weight gradient for Hopper (sm90), in Gluon: B2 and B4 (DESIGN.md §5).

``C[e][p, q] = sum_{s in slots(e)} A[s, p] * B[s, q]`` over each expert's slot range, where one operand is
the unpermuted ``[T, G]`` tensor read through the index (``G[token(s)]``) and the other the ``[N, R]`` slot
rows. ``GATHER_A``: A is the gathered one (B2, ``dW_down[e] = dout[token]^T (w act)``: P = d, Q = h);
otherwise B is (B4, ``dW_gate_up[e] = dpre^T x[token]``: P = 2h, Q = d). Either way the output is stored
row-major ``[E, P, Q]`` with unit stride along Q, the layout of ``w_down [E, d, h]`` and ``w_gate_up [E, 2h, d]``.

Why: at a few hundred slots per expert an output tile of :mod:`moeblaze.kernels.wgrad` is two to four
slot steps and a store, and in Triton one warp group both loads and multiplies: cuBLAS ran the same
products 1.4x faster on a contiguous copy (H200; Nsight: 37% of SM throughput, 7.4 cycles between issued
instructions). Here one persistent CTA per SM runs three partitions over the same sequence of output tiles; against
the autotuned Triton kernel this took 0.70-0.72x its time at 128 slots per expert (Qwen3-30B-A3B, T 2,048),
0.77-0.81x at 256-320 and 0.92-0.94x at 2,048 (H200, the measurement of ``python3 benchmarks/bench_ws.py``):

  mma      (8 warps, default)  two warp groups run ``wgmma`` into a ``[BLOCK_P, BLOCK_Q]`` fp32 accumulator
                               (one wgmma in flight), both operands read from shared memory with the slots
                               as the reduction (MN-major); the tile goes once, rounded to the operands'
                               dtype, into ``c_smem``;
  loader   (2 warps)           gathers ``G[token(s)]`` rows with 16-byte cp.async (masked past the expert:
                               zero-filled) and brings the slot rows with TMA, ``NUM_STAGES`` deep; the
                               next step's token ids are loaded one step ahead, across tiles;
  epilogue (2 warps)           writes ``c_smem`` to ``C`` while the mma partition runs the next tile: by TMA
                               (``TMA_STORE``: a 16-bit ``C`` whose P is a multiple of ``BLOCK_P``), else by
                               masked stores in ``C``'s dtype (the 16-bit gradient upcast for fp32 master
                               weights, as :mod:`moeblaze.kernels.wgrad` stores it). The TMA store took
                               0.964-1.005x the masked stores' time on B2 and B4 at 2k-32k tokens of
                               Qwen3-30B-A3B and the token-rounding shapes, bitwise equal (H200,
                               ``python3 benchmarks/bench_ws.py`` with and without ``--masked-store``).

Every tile takes ``max(1, cdiv(slots, BLOCK_K))`` steps: an empty expert's one step reads zeros from the
gathered side and stores a zero tile. A step's last slot rows may belong to the next expert (the TMA box is
whole); the gathered side is zero there, so they add exact zeros for finite values (the Triton kernel's
rule). Sums are fp32 in a fixed order, no atomics: bitwise reproducible, not bitwise equal to the Triton
kernel (other instruction tiling). Conditions (:func:`moeblaze.kernels.launch.ws_wgrad_ok`): triton 3.6, an
sm90 GPU, 16-bit operands, 16-byte aligned rows, slot rows whose tail is never garbage.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOADER_WARPS: gl.constexpr = gl.constexpr(2)
EPILOGUE_WARPS: gl.constexpr = gl.constexpr(2)
# 12 warps: 168 registers each at launch (65536 / 384); the two 2-warp workers give theirs down to 128 and
# the mma warp groups get 192 (a 128 x 256 fp32 accumulator is 128 per thread).
MAX_REGS = 168
WORKER_REGS: gl.constexpr = gl.constexpr(128)


@gluon.jit
def stage_barriers(NUM_STAGES: gl.constexpr, READY: gl.constexpr, EMPTY: gl.constexpr):
    """The ring's mbarriers, one ``ready`` and one ``empty`` per stage, expecting ``READY`` and ``EMPTY`` arrivals."""
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=READY)
        mbarrier.init(empty.index(i), count=EMPTY)
    return ready, empty


@gluon.jit
def tile_barriers(C_READY: gl.constexpr):
    """The output tile's hand-off: ``c_ready`` (``C_READY`` arrivals: the mma partitions), ``c_empty`` (the
    epilogue's one)."""
    c_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    c_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(c_ready.index(0), count=C_READY)
    mbarrier.init(c_empty.index(0), count=1)
    return c_ready, c_empty


@gluon.jit
def _tile(t, num_p, num_q, GROUP_M: gl.constexpr):
    """Output tile ``t`` -> (expert, p-tile, q-tile): expert-major, grouped ordering inside an expert (the
    programs of one expert run together and share its rows in L2)."""
    per_e = num_p * num_q
    e = t // per_e
    r = t % per_e
    num_in_group = GROUP_M * num_q
    first_p = (r // num_in_group) * GROUP_M
    group_size = gl.minimum(num_p - first_p, GROUP_M)
    return e, first_p + (r % num_in_group) % group_size, (r % num_in_group) // group_size


@gluon.jit
def _range(offsets_ptr,  # [E+1] int32 expert_token_offsets
           t, num_p, num_q, NUM_EXPERTS):
    """Slot range ``[start, end)`` of tile ``t``'s expert (past the last tile: the last expert's, never used)."""
    e = gl.minimum(t // (num_p * num_q), NUM_EXPERTS - 1)
    return gl.load(offsets_ptr + e), gl.load(offsets_ptr + e + 1)


@gluon.jit
def _loader(ptrs,  # tuple of pointers and TMA descriptors:
                   #   g_ptr: [T, G] 16-bit gathered operand (dout for B2, x for B4), unit column stride
                   #   r_desc: TMA descriptor over the [N, R] slot rows (w act, dpre), box [BLOCK_K, BLOCK_R]
                   #   c_ptr: [E, P, Q] dW (unit stride along Q), the operands' dtype or fp32
                   #   c_desc: TMA descriptor over C as [E*P, Q], box [BLOCK_P, 64] (TMA_STORE), else None
                   #   offsets_ptr: [E+1] int32 expert_token_offsets
                   #   indices_ptr: [N] int32 expert_token_indices (slot -> token)
            smem, bars, dims, GATHER_A: gl.constexpr, BLOCK_P: gl.constexpr, BLOCK_Q: gl.constexpr,
            BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """Fill stage ``s``: gathered rows by cp.async, slot rows by TMA; both complete on ``ready[s]``."""
    g_ptr, r_desc, c_ptr, c_desc, offsets_ptr, indices_ptr = ptrs
    g_bufs, r_bufs, c_smem = smem
    ready, empty, c_ready, c_empty = bars
    P, Q, NUM_EXPERTS, stride_g_t, stride_c_e, stride_c_p = dims
    BLOCK_G: gl.constexpr = BLOCK_P if GATHER_A else BLOCK_Q
    G = P if GATHER_A else Q
    # 2 warps, 8 contiguous 16-bit elements (one 16-byte cp.async) per thread and row, 8 rows per pass
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LOADER_WARPS, 1], [1, 0])
    ks = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BLOCK_G, layout=gl.SliceLayout(0, layout))
    num_p = gl.cdiv(P, BLOCK_P)
    num_q = gl.cdiv(Q, BLOCK_Q)
    programs = gl.num_programs(0)
    t = gl.program_id(0)
    start, end = _range(offsets_ptr, t, num_p, num_q, NUM_EXPERTS)
    tokens = gl.load(indices_ptr + start + ks, mask=start + ks < end, other=0)
    it = 0  # steps issued so far: stage it % NUM_STAGES, phase (it // NUM_STAGES) & 1
    for _ in range(gl.cdiv(NUM_EXPERTS * num_p * num_q - t, programs)):
        e, pid_p, pid_q = _tile(t, num_p, num_q, GROUP_M)
        g0 = (pid_p * BLOCK_P) if GATHER_A else (pid_q * BLOCK_Q)
        r0 = (pid_q * BLOCK_Q) if GATHER_A else (pid_p * BLOCK_P)
        g_cols = g0 + cols
        start_n, end_n = _range(offsets_ptr, t + programs, num_p, num_q, NUM_EXPERTS)
        n_k = gl.maximum(gl.cdiv(end - start, BLOCK_K), 1)
        for kk in range(n_k):
            s0 = start + kk * BLOCK_K
            # the token ids of the next step (this tile's, or the next tile's first), in flight during this one
            last = (kk == n_k - 1).to(gl.int32)
            nxt = s0 + BLOCK_K + last * (start_n - s0 - BLOCK_K)
            nxt_end = end + last * (end_n - end)
            next_tokens = gl.load(indices_ptr + nxt + ks, mask=nxt + ks < nxt_end, other=0)
            s = it % NUM_STAGES
            mbarrier.wait(empty.index(s), ((it // NUM_STAGES) & 1) ^ 1)  # passes at once on the first round
            bar = ready.index(s)
            mbarrier.expect(bar, r_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(r_desc, [s0, r0], bar, r_bufs.index(s))
            rows = g_ptr + tokens.to(gl.int64)[:, None] * stride_g_t + g_cols[None, :]
            mask = ((s0 + ks) < end)[:, None] & (g_cols < G)[None, :]
            async_copy.async_copy_global_to_shared(g_bufs.index(s), rows, mask=mask)
            async_copy.mbarrier_arrive(bar, increment_count=False)
            tokens = next_tokens
            it += 1
        t += programs
        start = start_n
        end = end_n


@gluon.jit
def hand_off(acc, prev, i_tile, empty, c_smem, c_ready, c_empty, TMA_STORE: gl.constexpr):
    """The end of an mma partition's tile (here and in :mod:`moeblaze.kernels.ws_gemm`): wait for the last
    wgmma, release its stage, and once the epilogue has stored the previous tile, round this one into
    ``c_smem`` for it (``TMA_STORE``: fenced, the epilogue's TMA store reads it through the async proxy)."""
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index(prev), count=1)
    mbarrier.wait(c_empty.index(0), (i_tile & 1) ^ 1)
    c_smem.store(acc.to(c_smem.dtype))
    if TMA_STORE:
        fence_async_shared()
    mbarrier.arrive(c_ready.index(0), count=1)


@gluon.jit
def _mma(offsets_ptr,  # [E+1] int32 expert_token_offsets
         smem, bars, P, Q, NUM_EXPERTS, GATHER_A: gl.constexpr, BLOCK_P: gl.constexpr,
         BLOCK_Q: gl.constexpr, BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr, TMA_STORE: gl.constexpr,
         num_warps: gl.constexpr):
    """``acc = sum_k A_k^T B_k`` over the stages (one wgmma in flight), then the tile into ``c_smem``."""
    g_bufs, r_bufs, c_smem = smem
    ready, empty, c_ready, c_empty = bars
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_Q, 16])
    num_p = gl.cdiv(P, BLOCK_P)
    num_q = gl.cdiv(Q, BLOCK_Q)
    programs = gl.num_programs(0)
    pid = gl.program_id(0)
    start, end = _range(offsets_ptr, pid, num_p, num_q, NUM_EXPERTS)
    it = 0  # steps consumed so far: stage it % NUM_STAGES, phase (it // NUM_STAGES) & 1
    for i_tile in range(gl.cdiv(NUM_EXPERTS * num_p * num_q - pid, programs)):
        start_n, end_n = _range(offsets_ptr, pid + (i_tile + 1) * programs, num_p, num_q, NUM_EXPERTS)  # in flight
        n_k = gl.maximum(gl.cdiv(end - start, BLOCK_K), 1)
        acc = gl.zeros((BLOCK_P, BLOCK_Q), dtype=gl.float32, layout=acc_layout)
        prev = 0
        for kk in range(n_k):
            s = it % NUM_STAGES
            # pred is always true: it makes the carried range a value of the loop's body; used only by the inner
            # loop's bound, triton 3.6 dropped it from the carried values and every tile took the first tile's step
            # count (a hang on an H200, with two or more tiles per program)
            mbarrier.wait(ready.index(s), (it // NUM_STAGES) & 1, pred=start <= end)
            fence_async_shared()  # the gathered rows came by cp.async (generic proxy); wgmma reads the async one
            if GATHER_A:
                a = g_bufs.index(s).permute((1, 0))  # [BLOCK_P, BLOCK_K], slots as the reduction
                b = r_bufs.index(s)
            else:
                a = r_bufs.index(s).permute((1, 0))
                b = g_bufs.index(s)
            acc = warpgroup_mma(a, b, acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))
            mbarrier.arrive(empty.index(prev), count=1, pred=kk > 0)  # the previous stage's wgmma retired
            prev = s
            it += 1
        hand_off(acc, prev, i_tile, empty, c_smem, c_ready, c_empty, TMA_STORE)
        start = start_n
        end = end_n


@gluon.jit
def _epilogue(ptrs,  # tuple of pointers and TMA descriptors:
                     #   g_ptr: [T, G] 16-bit gathered operand (dout for B2, x for B4), unit column stride
                     #   r_desc: TMA descriptor over the [N, R] slot rows (w act, dpre), box [BLOCK_K, BLOCK_R]
                     #   c_ptr: [E, P, Q] dW (unit stride along Q), the operands' dtype or fp32
                     #   c_desc: TMA descriptor over C as [E*P, Q], box [BLOCK_P, 64] (TMA_STORE), else None
                     #   offsets_ptr: [E+1] int32 expert_token_offsets
                     #   indices_ptr: [N] int32 expert_token_indices (slot -> token)
              smem, bars, dims, GATHER_A: gl.constexpr, BLOCK_P: gl.constexpr, BLOCK_Q: gl.constexpr,
              GROUP_M: gl.constexpr, TMA_STORE: gl.constexpr):
    """``c_smem`` -> ``C[e]``: ``TMA_STORE``, whole ``[BLOCK_P, 64]`` boxes by TMA (``C`` in the operands' dtype,
    ``P % BLOCK_P == 0``: a box never reaches the next expert's rows; columns past Q are clipped by the
    descriptor); else masked stores in ``C``'s dtype, rows past P and columns past Q masked."""
    g_ptr, r_desc, c_ptr, c_desc, offsets_ptr, indices_ptr = ptrs
    g_bufs, r_bufs, c_smem = smem
    ready, empty, c_ready, c_empty = bars
    P, Q, NUM_EXPERTS, stride_g_t, stride_c_e, stride_c_p = dims
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [EPILOGUE_WARPS, 1], [1, 0])
    ROWS: gl.constexpr = 32  # 32 x 64 pieces over 64 threads: 32 elements per thread
    COLS: gl.constexpr = 64  # also the TMA box's width: 128 bytes, the swizzle's span
    r_in = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    c_in = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    num_p = gl.cdiv(P, BLOCK_P)
    num_q = gl.cdiv(Q, BLOCK_Q)
    programs = gl.num_programs(0)
    t = gl.program_id(0)
    for i_tile in range(gl.cdiv(NUM_EXPERTS * num_p * num_q - t, programs)):
        e, pid_p, pid_q = _tile(t, num_p, num_q, GROUP_M)
        mbarrier.wait(c_ready.index(0), i_tile & 1)
        if TMA_STORE:
            for j in gl.static_range(BLOCK_Q // COLS):
                tma.async_copy_shared_to_global(c_desc, [e * P + pid_p * BLOCK_P, pid_q * BLOCK_Q + j * COLS],
                                                c_smem.slice(j * COLS, COLS, dim=1))
            tma.store_wait(0)  # c_smem read out (the writes drain on their own)
        else:
            base = c_ptr + e.to(gl.int64) * stride_c_e
            for i in gl.static_range(BLOCK_P // ROWS):
                rows = pid_p * BLOCK_P + i * ROWS + r_in
                piece = c_smem.slice(i * ROWS, ROWS, dim=0)
                for j in gl.static_range(BLOCK_Q // COLS):
                    col = pid_q * BLOCK_Q + j * COLS + c_in
                    v = piece.slice(j * COLS, COLS, dim=1).load(layout)
                    mask = (rows < P)[:, None] & (col < Q)[None, :]
                    gl.store(base + rows.to(gl.int64)[:, None] * stride_c_p + col[None, :],
                             v.to(c_ptr.dtype.element_ty), mask=mask)
        mbarrier.arrive(c_empty.index(0), count=1)
        t += programs


@gluon.jit
def ws_wgrad_kernel(
    g_ptr,  # [T, G] 16-bit, unit column stride: the gathered operand (dout for B2, x for B4), rows via indices_ptr
    r_desc,  # TMA descriptor over the [N, R] slot rows (w act for B2, dpre for B4), box [BLOCK_K, BLOCK_R]
    c_ptr,  # [E, P, Q] dW (unit stride along Q): the operands' dtype or fp32
    c_desc,  # TMA descriptor over C as [E*P, Q], box [BLOCK_P, 64] (TMA_STORE), else None
    offsets_ptr,  # [E+1] int32 expert_token_offsets
    indices_ptr,  # [N] int32 expert_token_indices (slot -> token)
    P, Q, NUM_EXPERTS,
    stride_g_t, stride_c_e, stride_c_p,
    GATHER_A: gl.constexpr,  # A (the P side) is the gathered operand; else B (the Q side) is
    BLOCK_P: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    TMA_STORE: gl.constexpr,  # whole tiles leave by TMA (launch.ws_wgrad_tma_store)
    num_warps: gl.constexpr,
):
    dtype: gl.constexpr = r_desc.dtype
    BLOCK_G: gl.constexpr = BLOCK_P if GATHER_A else BLOCK_Q
    BLOCK_R: gl.constexpr = BLOCK_Q if GATHER_A else BLOCK_P
    g_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_G], dtype)
    r_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_R], dtype)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_P, BLOCK_Q], dtype)
    g_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, BLOCK_G], g_layout)
    r_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, BLOCK_R], r_layout)
    c_smem = gl.allocate_shared_memory(dtype, [BLOCK_P, BLOCK_Q], c_layout)
    # ready: the TMA transaction (one arrival with its byte count) and each loader thread's cp.async arrival; in
    # triton 3.6 a partition's mbarrier.arrive is one thread's, after a barrier of the partition's warps
    ready, empty = stage_barriers(NUM_STAGES, 1 + LOADER_WARPS * 32, 1)
    c_ready, c_empty = tile_barriers(1)

    ptrs = (g_ptr, r_desc, c_ptr, c_desc, offsets_ptr, indices_ptr)
    smem = (g_bufs, r_bufs, c_smem)
    bars = (ready, empty, c_ready, c_empty)
    dims = (P, Q, NUM_EXPERTS, stride_g_t, stride_c_e, stride_c_p)
    # constexprs go into the partitions' argument lists directly (a tuple variable would hold them as values)
    gl.warp_specialize([
        (_mma, (offsets_ptr, smem, bars, P, Q, NUM_EXPERTS, GATHER_A, BLOCK_P, BLOCK_Q, BLOCK_K, NUM_STAGES,
                TMA_STORE, num_warps)),
        (_loader, (ptrs, smem, bars, dims, GATHER_A, BLOCK_P, BLOCK_Q, BLOCK_K, NUM_STAGES, GROUP_M)),
        (_epilogue, (ptrs, smem, bars, dims, GATHER_A, BLOCK_P, BLOCK_Q, GROUP_M, TMA_STORE)),
    ], [LOADER_WARPS, EPILOGUE_WARPS], [WORKER_REGS, WORKER_REGS])
