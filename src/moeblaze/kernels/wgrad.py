"""Grouped weight-gradient GEMM over each expert's variable-length slot range (DESIGN.md §5: B2, B4).

``dW[e][p, q] = sum_{s in slots(e)} A[token(s), p] * B[s, q]``, ``slots(e) = offsets[e]:offsets[e+1]``,
``token(s) = expert_token_indices[s]``: A is the unpermuted ``[T, P]`` operand, read through the index
(no gathered copy), B the ``[N, Q]`` slot rows.

B2: ``dW_down[e]      = sum_s dout[token(s)]^T (w act)[s]``  (P = d, Q = h; stored ``[E, d, h]``)
B4: ``dW_gate_up[e]^T = sum_s x[token(s)]^T dpre[s]``        (P = d, Q = 2h|h; stored transposed)

Why B4 is computed transposed: the gathered operand on the A side and the slot rows through TMA as B is
the faster arrangement on an H200
(``python3 benchmarks/profile_kernels.py --configs conf4-swiglu,qwen3-30b-a3b``): B2 ran at 670-735 TF/s
and the transposed B4 at 682-742, against 595-651 for B4 as ``dpre^T x`` with the gathered operand as B
(1.064x slower in a same-run A/B on conf4). The transposed store (``stride_c_p = 1``) costs one layout
conversion per output tile.

Grid: ``E * cdiv(P, BLOCK_P) * cdiv(Q, BLOCK_Q)`` programs (``PERSISTENT``: at most one per SM), expert-major
(the programs of one expert run together and share its rows in L2), grouped ordering inside an expert. The
slot loop runs in a fixed order with fp32 accumulation and no atomics; an empty expert stores zeros.

``GATHER_A=False`` (the TF32 path, :mod:`moeblaze.kernels.tf32`): A and B are copies gathered into slot order
with the slots contiguous (``stride_a_m = stride_b_m = 1``: the K-major layout Hopper's TF32 ``wgmma`` takes)
and each expert's range zero-padded to a multiple of ``SLOT_PAD`` (``offsets`` are then the padded ones): the
loads along the slots start aligned and need no slot mask, so they go as 16-byte vectors.

``PERSISTENT`` (16-bit operands, ``GATHER_A``; a config choice): one program per SM walks its output tiles
``t = pid, pid + programs, ...`` as one flat loop of (tile, slot step) pairs, each tile taking
``max(1, cdiv(slots, BLOCK_K))`` steps (an empty expert one masked step that stores zeros); a tile's
coordinates are worked out at its first step and its store is issued at its last, so the pipeliner has the next
tile's loads in flight during the store. Why: with few slots per expert a tile is two or three steps and a
store, and the per-tile launch overlaps a store only with other CTAs of the SM. On an H200
(Qwen3-30B-A3B shape, T 2,048, 128 slots per expert, ``python3 benchmarks/profile_kernels.py --configs
qwen3-30b-a3b --tokens 2048 --all-configs B2,B4``) the persistent 128x256 tile took 0.235 ms for B2 against the
per-tile best 0.296, and 0.460 for B4 against 0.586. At T 32,768 (2,048 slots per expert) the per-tile
128x256 launch was faster, 1.54 against 1.90 ms for B2 (the same H200;
``--tokens 32768`` of the command above measures it with this code), so both
launches stay in the tuned list, chosen per token bucket.
Triton's ``flatten=True`` needs inner bounds that do not change with the tile, hence the hand-flattened loop, in the
order of Triton's persistent-matmul tutorial (the tile opened at the top of the step: opening it at the end of
the previous step made the pipeliner fail, "Op used before defined", triton 3.6).

``B_DESC`` (sm90+): B's ``[BLOCK_K, BLOCK_Q]`` slab of slot rows comes through a TMA descriptor. A step's
last rows may then belong to the next expert; A is masked to zero there, so they add exact zeros for
finite values (a non-finite value of the neighbouring expert's rows would spread to this expert's
gradient — a step that already diverged).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .grouped_gemm import tile_of

# Padded slot ranges (GATHER_A=False) are multiples of every TF32 BLOCK_K of tuning.wgrad_configs.
SLOT_PAD = tl.constexpr(32)


@triton.jit
def grouped_wgrad_kernel(
    a_ptr,  # [T, P] gathered operand (dout, x); fp16/bf16/fp32; padded slot rows (stride_a_m 1) if not GATHER_A
    b_ptr,  # [N, Q] slot rows (w act, dpre)
    c_ptr,  # dW[e][p, q] at e*stride_c_e + p*stride_c_p + q*stride_c_q; the operands' dtype or fp32
    offsets_ptr,  # [E+1] int32 expert_token_offsets (not GATHER_A: of the padded ranges)
    indices_ptr,  # [N] int32 expert_token_indices (slot -> token)
    P, Q,
    ROWS,  # rows of B (N): extent of its descriptor
    stride_a_m, stride_a_p, stride_b_m, stride_b_q, stride_c_e, stride_c_p, stride_c_q,
    NUM_EXPERTS,  # E: the autotune key's, and the persistent loop's tile count
    GATHER_A: tl.constexpr, B_DESC: tl.constexpr, DOT_PREC: tl.constexpr,
    E_POW2: tl.constexpr,  # next power of 2 of NUM_EXPERTS (PERSISTENT: the step count over all experts at once)
    PERSISTENT: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    if PERSISTENT:
        tl.static_assert(GATHER_A, "the persistent weight gradient reads A through the index (16-bit operands)")
        _persistent_tiles(a_ptr, b_ptr, c_ptr, offsets_ptr, indices_ptr, P, Q, ROWS, stride_a_m, stride_a_p,
                          stride_b_m, stride_b_q, stride_c_e, stride_c_p, stride_c_q, NUM_EXPERTS,
                          B_DESC, DOT_PREC, E_POW2, BLOCK_P, BLOCK_Q, BLOCK_K, GROUP_M)
        return
    num_p = tl.cdiv(P, BLOCK_P)
    num_q = tl.cdiv(Q, BLOCK_Q)
    pid = tl.program_id(0)
    e = pid // (num_p * num_q)
    pid_p, pid_q = tile_of(pid % (num_p * num_q), num_p, num_q, GROUP_M)
    start = tl.load(offsets_ptr + e)
    end = tl.load(offsets_ptr + e + 1)
    if not GATHER_A:
        start = tl.multiple_of(start, SLOT_PAD)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    p_mask = offs_p < P
    q_mask = offs_q < Q
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    if B_DESC:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[ROWS, Q], strides=[stride_b_m, 1],
                                           block_shape=[BLOCK_K, BLOCK_Q])
    if GATHER_A:
        # Token ids are prefetched one step ahead into registers: the gathered loads of a step then depend on
        # a loop-carried value, not on a load of the same step, and the pipeliner keeps its full depth.
        next_tokens = tl.load(indices_ptr + tl.minimum(start + offs_k, end - 1), mask=start + offs_k < end, other=0)
    for s0 in range(start, end, BLOCK_K):
        s = s0 + offs_k
        s_ok = s < end
        if GATHER_A:
            tokens = next_tokens.to(tl.int64)
            next_tokens = tl.load(indices_ptr + tl.minimum(s + BLOCK_K, end - 1))
            # A is zero on slots past the expert: B's rows there (the next expert's, via TMA) add nothing
            a = tl.load(a_ptr + tokens[None, :] * stride_a_m + offs_p[:, None] * stride_a_p,
                        mask=s_ok[None, :] & p_mask[:, None], other=0.0)
        else:  # padded copies: whole BLOCK_K steps inside the expert's range, its padding zero
            a = tl.load(a_ptr + s[None, :].to(tl.int64) * stride_a_m + offs_p[:, None] * stride_a_p,
                        mask=p_mask[:, None], other=0.0)
        if not GATHER_A:
            b = tl.load(b_ptr + s[:, None].to(tl.int64) * stride_b_m + offs_q[None, :] * stride_b_q,
                        mask=q_mask[None, :], other=0.0)
        elif B_DESC:
            b = b_desc.load([s0, pid_q * BLOCK_Q])
        else:
            b = _slot_rows(b_ptr, s, end, offs_q, Q, stride_b_m, stride_b_q)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
    _store_tile(c_ptr, acc, e, offs_p, offs_q, P, Q, stride_c_e, stride_c_p, stride_c_q, b_ptr.dtype.element_ty)


@triton.jit
def _slot_rows(b_ptr,  # [N, Q] slot rows (w act, dpre); fp16/bf16/fp32
               s, end, offs_q, Q, stride_b_m, stride_b_q):
    """B's ``[BLOCK_K, BLOCK_Q]`` slot rows ``s`` through pointers, clamped into the expert's range: A's mask
    zeroes the slots past ``end`` (an empty expert's step: all of them), so the rows read there add nothing."""
    rows = tl.maximum(tl.minimum(s, end - 1), 0).to(tl.int64)
    return tl.load(b_ptr + rows[:, None] * stride_b_m + offs_q[None, :] * stride_b_q, mask=(offs_q < Q)[None, :],
                   other=0.0)


@triton.jit
def _store_tile(c_ptr,  # dW [E, P, Q] at e*stride_c_e + p*stride_c_p + q*stride_c_q; the operands' dtype or fp32
                acc, e, offs_p, offs_q, P, Q, stride_c_e, stride_c_p, stride_c_q, op_ty: tl.constexpr):
    """Store the summed ``[BLOCK_P, BLOCK_Q]`` tile of expert ``e``. Rounded to the operands' dtype ``op_ty``
    first: an fp32 gradient of 16-bit operands (the master weights of an autocast call) is the 16-bit gradient
    upcast, stored in one pass instead of a 16-bit store and a cast."""
    c_ptrs = (c_ptr + e.to(tl.int64) * stride_c_e + offs_p[:, None].to(tl.int64) * stride_c_p
              + offs_q[None, :].to(tl.int64) * stride_c_q)
    tl.store(c_ptrs, acc.to(op_ty).to(c_ptr.dtype.element_ty), mask=(offs_p < P)[:, None] & (offs_q < Q)[None, :])


@triton.jit
def _persistent_tiles(a_ptr,  # [T, P] gathered operand (dout, x); fp16/bf16
                      b_ptr,  # [N, Q] slot rows (w act, dpre); fp16/bf16
                      c_ptr,  # dW[e][p, q] at e*stride_c_e + p*stride_c_p + q*stride_c_q; the operands' dtype or fp32
                      offsets_ptr,  # [E+1] int32 expert_token_offsets
                      indices_ptr,  # [N] int32 expert_token_indices (slot -> token)
                      P, Q, ROWS, stride_a_m, stride_a_p,
                      stride_b_m, stride_b_q, stride_c_e, stride_c_p, stride_c_q, NUM_EXPERTS,
                      B_DESC: tl.constexpr, DOT_PREC: tl.constexpr, E_POW2: tl.constexpr, BLOCK_P: tl.constexpr,
                      BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """``PERSISTENT`` of :func:`grouped_wgrad_kernel`: this program's tiles as one flat loop of slot steps."""
    num_p = tl.cdiv(P, BLOCK_P)
    num_q = tl.cdiv(Q, BLOCK_Q)
    per_e = num_p * num_q
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    # steps of this program: its tiles of expert e are t = pid (mod programs) in [e * per_e, (e + 1) * per_e),
    # cdiv(max(x - pid, 0), programs) of them below x; each takes max(1, cdiv(slots of e, BLOCK_K)) steps
    es = tl.arange(0, E_POW2)
    e_ok = es < NUM_EXPERTS
    slots = tl.load(offsets_ptr + es + 1, mask=e_ok, other=0) - tl.load(offsets_ptr + es, mask=e_ok, other=0)
    below = tl.cdiv(tl.maximum(es * per_e + per_e - pid, 0), programs) - tl.cdiv(tl.maximum(es * per_e - pid, 0),
                                                                                 programs)
    total = tl.sum(tl.where(e_ok, below * tl.maximum(tl.cdiv(slots, BLOCK_K), 1), 0), axis=0)
    if B_DESC:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[ROWS, Q], strides=[stride_b_m, 1],
                                           block_shape=[BLOCK_K, BLOCK_Q])
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    tile = pid - programs  # the state of a finished tile before the first: its step opens tile pid
    e = pid * 0
    start = e
    end = e
    n_k = e + 1
    k = e
    pid_p = e
    pid_q = e
    for _ in tl.range(0, total):
        k = tl.where(k == n_k - 1, 0, k + 1)
        if k == 0:  # this program's next tile
            tile += programs
            e = tile // per_e
            pid_p, pid_q = tile_of(tile % per_e, num_p, num_q, GROUP_M)
            start = tl.load(offsets_ptr + e)
            end = tl.load(offsets_ptr + e + 1)
            n_k = tl.maximum(tl.cdiv(end - start, BLOCK_K), 1)
        offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
        p_mask = offs_p < P
        s0 = start + k * BLOCK_K
        s = s0 + offs_k
        s_ok = s < end
        tokens = tl.load(indices_ptr + s, mask=s_ok, other=0).to(tl.int64)
        # A is zero on slots past the expert (an empty expert's one step: all of them), so B's rows there add
        # nothing: the next expert's through TMA, or the expert's last row through the clamped pointers
        a = tl.load(a_ptr + tokens[None, :] * stride_a_m + offs_p[:, None] * stride_a_p,
                    mask=s_ok[None, :] & p_mask[:, None], other=0.0)
        if B_DESC:
            b = b_desc.load([s0, pid_q * BLOCK_Q])
        else:
            b = _slot_rows(b_ptr, s, end, offs_q, Q, stride_b_m, stride_b_q)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        if k == n_k - 1:  # the tile is summed
            _store_tile(c_ptr, acc, e, offs_p, offs_q, P, Q, stride_c_e, stride_c_p, stride_c_q,
                        b_ptr.dtype.element_ty)
            acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
