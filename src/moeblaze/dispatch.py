"""Zero-buffer token dispatch: the light index that replaces the permuted routing buffer.

MoEBlaze §4.1-4.2 (arXiv 2601.05296), DESIGN.md §3.

The index contract (every builder and every kernel relies on exactly this)
---------------------------------------------------------------------------
Routing: ``topk_ids [T, K]``, K distinct experts per token, ids in ``[0, E)``.
A *pair* is ``p = t*K + k``; there are ``N = T*K`` pairs and as many *slots*.

``expert_token_offsets  [E+1] int32``  exclusive prefix sum of per-expert pair counts;
                                        ``offsets[0] == 0``, ``offsets[E] == N``.
``expert_token_indices  [N]   int32``  slot s -> token id. The slots of expert e are
                                        ``offsets[e]:offsets[e+1]``; tokens ascend inside each range
                                        (stable, hence deterministic).
``token_expert_indices  [T, K] int32`` the routing itself (``topk_ids`` as int32).
``token_index_map       [T, K] int32`` pair (t, k) -> its slot s.

Invariants: ``expert_token_indices[token_index_map[t, k]] == t``; ``token_index_map`` is a
permutation of ``0..N-1``; ``offsets`` is non-decreasing with ``diff(offsets) == bincount(ids)``.
Experts read rows of the *unpermuted* input through ``expert_token_indices``; the combine reads expert
outputs through ``token_index_map``. No ``[N, d]`` copy of the input is ever made.

Optional grouped-GEMM tile schedule for a row-tile height ``BLOCK_M`` (``TileSchedule``), built from
the offsets alone: expert e owns ``cdiv(count_e, BLOCK_M)`` consecutive M-tiles (none when empty), in
expert order; ``tile_expert [max_tiles]``, ``tile_row_start [max_tiles]`` (first slot of the tile; the
tile covers ``[start, min(start + BLOCK_M, offsets[e+1]))``) and ``num_tiles [1]``, all int32, with
``max_tiles = cdiv(N, BLOCK_M) + E`` (a bound known on the host) and entries past ``num_tiles`` holding
``-1`` / ``offsets[E]`` (= N; the local pairs when the index has a foreign bucket). A tile never straddles
two experts, so a GEMM program reads one expert's weight.

Foreign experts (``build_dispatch(..., foreign_experts=True)``, transformers' expert-parallel sentinel):
ids ``>= E`` name experts of other ranks. They are clamped to E and built as one extra bucket, the last:
``expert_token_offsets`` is then ``[E+2]`` with ``offsets[E]`` the local pairs and ``offsets[E+1] == N``,
``token_expert_indices`` holds E for those pairs, and slots ``>= offsets[E]`` are foreign. The tile
schedule covers the E local experts only (``local_offsets``), so no GEMM ever touches a foreign slot.

General routing inputs (``moeblaze.general_routing.build_dispatch_pairs``): P pairs in any number per
token; slots are pairs, ``token_expert_indices`` and ``token_index_map`` are ``[P]`` (pair order, tokens
ascending), and ``pair_offsets [T+1]`` (a CSR) delimits each token's pairs for the combines.

The PyTorch build here is the CPU path and the reference for the Triton build (``kernels.dispatch``):
per-expert counts, an exclusive prefix sum, per-expert ranks from a running one-hot count — no
``sort``/``argsort`` and no atomics.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from . import settings
from .graphs import capturing
from .index import DispatchIndex, TileSchedule

__all__ = ["DispatchIndex", "TileSchedule", "build_dispatch", "build_dispatch_pairs", "build_dispatch_torch",
           "build_tile_schedule_torch", "check_index_matches", "check_pairs", "check_topk_ids", "with_schedule"]

# One-hot rank chunks are kept at <= 2**24 int32 elements (64 MiB) so the PyTorch build stays
# O(N) in memory at any T*E instead of materialising the paper's full [N, E] map.
_ONEHOT_CHUNK_ELEMS = 1 << 24
_INT_DTYPES = (torch.int32, torch.int64)  # general routing inputs


def check_topk_ids(topk_ids: torch.Tensor, num_experts: int, check_range: bool = True,
                   foreign_experts: bool = False) -> None:
    """Validate a routing before any kernel sees it.

    Args:
        topk_ids: ``[T, K]`` integer tensor of expert ids.
        num_experts: E >= 1.
        check_range: also check ``0 <= id < E`` and that ids are distinct within each row. This reads
            the ids back to the host once (one synchronisation); set ``MOEBLAZE_CHECK_IDS=0`` to skip
            it globally when the ids come from a trusted router. Skipped inside CUDA-graph capture.
        foreign_experts: ids ``>= E`` are allowed (experts of other ranks; may repeat in a row), and
            K may exceed E.

    Raises:
        TypeError: ``topk_ids`` is not an integer tensor.
        ValueError: wrong rank, ``num_experts < 1``, K > E, an id out of range or a repeated id in a row.
    """
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dtype not in (torch.int32, torch.int64, torch.int16, torch.uint8):
        raise TypeError("topk_ids must be an integer tensor (int32, int64, int16 or uint8), "
                        f"got dtype {topk_ids.dtype}")
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must have shape [T, K] (rank 2), got shape {tuple(topk_ids.shape)}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    T, K = topk_ids.shape
    if K < 1 or (num_experts < K and not foreign_experts):
        raise ValueError(f"topk_ids has K={K} columns; expected 1 <= K <= num_experts={num_experts}")
    if T * K >= 2**31:
        raise ValueError(f"topk_ids has N = T*K = {T * K} pairs; the int32 index holds fewer than 2^31")
    if not check_range or T == 0 or not settings.get("check_ids") or capturing(topk_ids):  # a host read
        return
    lo, hi = torch.aminmax(topk_ids)
    lo, hi = int(lo), int(hi)
    if foreign_experts and lo < 0:
        raise ValueError(f"topk_ids holds expert ids in [{lo}, {hi}]; expected ids >= 0 (ids >= "
                         f"{num_experts} are foreign experts)")
    if not foreign_experts and (lo < 0 or hi >= num_experts):
        raise ValueError(f"topk_ids holds expert ids in [{lo}, {hi}]; expected ids in [0, {num_experts})")
    if K > 1:
        s = topk_ids.sort(dim=1).values  # validation only; the build itself never sorts
        dup = s[:, 1:] == s[:, :-1]
        if foreign_experts:
            dup &= s[:, 1:] < num_experts  # foreign sentinels may repeat
        if bool(dup.any()):
            raise ValueError("topk_ids repeats an expert within a token's row; top-k ids must be distinct")


def _ranks_within_expert(flat_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair, its rank among the pairs of the same expert (pair order), and per-expert counts.

    Tile-scan of MoEBlaze §4.2 in PyTorch: each chunk of pairs forms its one-hot [chunk, E] map,
    an inclusive cumsum gives in-chunk ranks, and a running per-expert base carries across chunks.
    """
    N = flat_ids.numel()
    device = flat_ids.device
    ranks = torch.empty(N, dtype=torch.int32, device=device)
    base = torch.zeros(num_experts, dtype=torch.int32, device=device)
    chunk = max(1, _ONEHOT_CHUNK_ELEMS // num_experts)
    cols = torch.arange(num_experts, device=device, dtype=flat_ids.dtype)
    for start in range(0, N, chunk):
        ids = flat_ids[start:start + chunk]
        onehot = (ids[:, None] == cols[None, :]).to(torch.int32)  # [chunk, E]
        running = onehot.cumsum(0, dtype=torch.int32)  # inclusive count per expert
        ranks[start:start + chunk] = (running.gather(1, ids[:, None].long()).squeeze(1) - 1
                                      + base[ids.long()])
        base += running[-1]
    return ranks, base


def build_dispatch_torch(topk_ids: torch.Tensor, num_experts: int) -> DispatchIndex:
    """Build the dispatch index in plain PyTorch (no sort, no atomics). Works on any device.

    Args:
        topk_ids: ``[T, K]`` integer expert ids, validated by the caller.
        num_experts: E.

    Returns:
        The :class:`DispatchIndex` (all int32).
    """
    T, K = topk_ids.shape
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int32)
    ranks, counts = _ranks_within_expert(flat, num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=device)
    torch.cumsum(counts, 0, dtype=torch.int32, out=offsets[1:])
    slot = offsets[flat.long()] + ranks  # [N] final slot of each pair
    token_of_pair = torch.arange(T, dtype=torch.int32, device=device).repeat_interleave(K)
    indices = torch.empty(T * K, dtype=torch.int32, device=device)
    indices[slot.long()] = token_of_pair  # a permutation: every slot written exactly once
    return DispatchIndex(offsets, indices, flat.view(T, K), slot.view(T, K), num_experts)


def build_tile_schedule_torch(expert_token_offsets: torch.Tensor, num_pairs: int, block_m: int) -> TileSchedule:
    """The tile schedule (contract above) in PyTorch ops, on the offsets' device, without host sync.

    The CPU path and the reference of the Triton build.

    Args:
        expert_token_offsets: ``[E+1]`` int32.  num_pairs: N (sizes the result).  block_m: >= 1.

    Raises:
        ValueError: ``block_m < 1``.
    """
    if int(block_m) < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    off = expert_token_offsets
    E = off.numel() - 1
    max_tiles = -(-int(num_pairs) // block_m) + E
    counts = (off[1:] - off[:-1]).long()
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)  # inclusive
    i = torch.arange(max_tiles, device=off.device)
    e = torch.searchsorted(tile_end, i, right=True).clamp_(max=E - 1)
    valid = i < tile_end[-1]
    row = off[e].long() + (i - (tile_end[e] - tiles[e])) * block_m
    return TileSchedule(int(block_m), torch.where(valid, e, -1).to(torch.int32),
                        torch.where(valid, row, off[-1].long()).to(torch.int32), tile_end[-1:].to(torch.int32))


def with_schedule(index: DispatchIndex, block_m: int) -> DispatchIndex:
    """``index`` with a tile schedule for ``block_m`` (itself when it already has that one).

    One small launch where the Triton build runs (``kernels.dispatch.tile_schedule``: CUDA by default), PyTorch
    ops elsewhere.
    """
    _check_block_m(block_m)
    if index.schedule is not None and index.schedule.block_m == block_m:
        return index
    off, N = index.local_offsets, index.num_pairs  # no tiles for the foreign bucket
    if _triton_dispatch(off):
        from .kernels.schedule import tile_schedule

        sched = TileSchedule(block_m, *tile_schedule(off, block_m, N))
    else:
        sched = build_tile_schedule_torch(off, N, block_m)
    return DispatchIndex(*index.tensors(), index.num_experts, sched, index.foreign_experts,
                         built_from=index.built_from, pair_offsets=index.pair_offsets)


def build_dispatch(topk_ids: torch.Tensor, num_experts: int, validate: bool = True,
                   block_m: int | None = None, foreign_experts: bool = False) -> DispatchIndex:
    """Build the zero-buffer dispatch index of a top-k routing (MoEBlaze §4.1-4.2, DESIGN.md §3).

    On CUDA tensors the atomic-free Triton build runs (where the ``backend`` setting runs Triton:
    :func:`moeblaze.settings.use_triton`; Triton importable, E <= 1024 and K <= 16); elsewhere the PyTorch
    build. Both give bitwise the same arrays.

    Args:
        topk_ids: ``[T, K]`` int32/int64/int16/uint8 expert ids, distinct within each row, in ``[0, E)``.
        num_experts: E.
        validate: check dtype/shape always and, unless ``MOEBLAZE_CHECK_IDS=0``, the id range
            (one host synchronisation). Ids from :class:`moeblaze.Router` are in range by
            construction, so the layer passes ``validate=False``.
        block_m: also emit the grouped-GEMM tile schedule for M-tiles of ``block_m`` slots
            (``index.schedule``); the Triton build writes it in its last launch (no extra launch).
        foreign_experts: ids ``>= E`` are experts of other ranks (transformers' expert-parallel
            sentinel): they go to an extra last bucket E that the tile schedule leaves out (see the
            module docstring); without it such ids are an error.

    Returns:
        :class:`DispatchIndex` with ``expert_token_offsets [E+1]``, ``expert_token_indices [N]``,
        ``token_expert_indices [T, K]`` and ``token_index_map [T, K]``, all int32, and ``schedule``
        when ``block_m`` is given.

    Raises:
        TypeError, ValueError: see :func:`check_topk_ids`; ``block_m`` not a positive int.
    """
    check_topk_ids(topk_ids, num_experts, check_range=validate, foreign_experts=foreign_experts)
    if block_m is not None:
        _check_block_m(block_m)
    return _record_source(_build(topk_ids, num_experts, block_m, foreign_experts), topk_ids)


def check_pairs(token_idx: torch.Tensor, expert_idx: torch.Tensor, num_tokens: int, num_experts: int,
                pair_weights: torch.Tensor | None = None, check_range: bool = True,
                foreign_experts: bool = False) -> None:
    """Validate general routing inputs before any kernel sees them.

    Args:
        token_idx: ``[P]`` int32/int64 token of each pair, ascending, in ``[0, T)``.
        expert_idx: ``[P]`` int32/int64 expert of each pair, in ``[0, E)`` (``>= E`` with ``foreign_experts``).
        num_tokens: T >= 0. num_experts: E >= 1.
        pair_weights: ``[P]`` float, or None (not checked).
        check_range: also check the ranges and the order (one host synchronisation); skipped when
            ``MOEBLAZE_CHECK_IDS=0``, as :func:`moeblaze.build_dispatch`'s check.

    Raises:
        TypeError: non-integer ids, non-float weights.
        ValueError: wrong ranks or lengths, T or E out of range, ids out of range, ``token_idx`` not ascending.
    """
    for name, t in (("token_idx", token_idx), ("expert_idx", expert_idx)):
        if not isinstance(t, torch.Tensor) or t.dtype not in _INT_DTYPES:
            raise TypeError(f"{name} must be an int32/int64 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() != 1:
            raise ValueError(f"{name} must have shape [P] (rank 1), got {tuple(t.shape)}")
    P = token_idx.numel()
    if expert_idx.numel() != P:
        raise ValueError(f"expert_idx must have shape [P={P}] (the length of token_idx), got {tuple(expert_idx.shape)}")
    bad_weights = not isinstance(pair_weights, torch.Tensor) or not pair_weights.is_floating_point()
    if pair_weights is not None and bad_weights:
        raise TypeError(f"pair_weights must be a float tensor, got {getattr(pair_weights, 'dtype', pair_weights)}")
    if pair_weights is not None and tuple(pair_weights.shape) != (P,):
        raise ValueError(f"pair_weights must have shape [P={P}] (the length of token_idx), "
                         f"got {tuple(pair_weights.shape)}")
    if not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if P >= 2**31:
        raise ValueError(f"{P} pairs; the int32 index holds fewer than 2^31")
    if not check_range or P == 0 or not settings.get("check_ids"):
        return
    t_lo, t_hi = (int(v) for v in torch.aminmax(token_idx))
    if t_lo < 0 or t_hi >= num_tokens:
        raise ValueError(f"token_idx holds tokens in [{t_lo}, {t_hi}]; expected tokens in [0, {num_tokens})")
    if P > 1 and bool((token_idx[1:] < token_idx[:-1]).any()):
        raise ValueError("token_idx must be ascending (sorted by token, so each token's pairs are contiguous)")
    e_lo, e_hi = (int(v) for v in torch.aminmax(expert_idx))
    if e_lo < 0 or (e_hi >= num_experts and not foreign_experts):
        raise ValueError(f"expert_idx holds expert ids from {e_lo} to {e_hi}; expected ids in [0, {num_experts})"
                         + (f" (id {num_experts} marks a pair of no local expert, as round_tokens' dropped pairs: pass "
                            "foreign_experts=True)" if e_lo >= 0 else ""))


def build_dispatch_pairs(token_idx: torch.Tensor, expert_idx: torch.Tensor, num_tokens: int, num_experts: int,
                         validate: bool = True, block_m: int | None = None,
                         foreign_experts: bool = False, pair_offsets: torch.Tensor | None = None) -> DispatchIndex:
    """The dispatch index of general routing inputs (contract: :mod:`moeblaze.general_routing`; DESIGN.md §3).

    Same passes as :func:`moeblaze.build_dispatch` (Triton on CUDA, no sort, no atomics, no host
    synchronisation without ``validate``), plus two gathers: slot -> token and the ``[T+1]`` CSR.

    Args:
        token_idx: ``[P]`` int32/int64 ascending tokens. expert_idx: ``[P]`` int32/int64 experts.
        num_tokens: T (tokens without pairs are allowed: they get zero output).
        num_experts: E.
        validate: check ranges and order (see :func:`check_pairs`).
        block_m: also attach the grouped-GEMM tile schedule for M-tiles of ``block_m`` slots.
        foreign_experts: ids ``>= E`` are skipped (an extra last bucket, as ``build_dispatch``'s); token
            rounding marks its unused candidate pairs this way so that P stays static.
        pair_offsets: the ``[T+1]`` int32 CSR of these pairs when the caller has it (token rounding's
            :attr:`moeblaze.TokenRounding.pair_offsets`): used as given, no binary search. Pairs past
            ``pair_offsets[T]`` (a tail of foreign pairs, as token rounding's unused ones) are in no token's
            combine.

    Returns:
        :class:`DispatchIndex` with ``token_expert_indices [P]``, ``token_index_map [P]``,
        ``expert_token_indices [P]`` (slot -> token) and ``pair_offsets [T+1]``, all int32.

    Raises:
        TypeError, ValueError: see :func:`check_pairs`; ``block_m`` not a positive int; ``pair_offsets`` not
            ``[T+1]`` int32.
    """
    check_pairs(token_idx, expert_idx, num_tokens, num_experts, check_range=validate, foreign_experts=foreign_experts)
    if pair_offsets is not None and (pair_offsets.shape != (num_tokens + 1,) or pair_offsets.dtype != torch.int32):
        raise ValueError(f"pair_offsets must be [num_tokens + 1 = {num_tokens + 1}] int32, got "
                         f"{tuple(pair_offsets.shape)} {pair_offsets.dtype}")
    P = expert_idx.numel()
    tok = token_idx.to(torch.int32)
    if P == 0:  # no pairs: an index of zero slots (build_dispatch needs K >= 1 columns)
        dev = expert_idx.device
        base = DispatchIndex(torch.zeros(num_experts + 1 + foreign_experts, dtype=torch.int32, device=dev),
                             *(torch.zeros(0, dtype=torch.int32, device=dev) for _ in range(3)), num_experts,
                             foreign_experts=foreign_experts)
    else:
        base = _build(expert_idx.view(P, 1), num_experts, block_m, foreign_experts, pair_tokens=tok.contiguous())
    indices = base.expert_token_indices  # slot -> token
    if pair_offsets is None:
        bounds = torch.arange(num_tokens + 1, dtype=torch.int32, device=tok.device)
        pair_offsets = torch.searchsorted(tok, bounds, out_int32=True)  # first pair of each token (tok ascends)
    index = DispatchIndex(base.expert_token_offsets, indices, base.token_expert_indices.view(P),
                          base.token_index_map.view(P), num_experts, base.schedule, foreign_experts,
                          pair_offsets=pair_offsets)
    return index if block_m is None or index.schedule is not None else with_schedule(index, block_m)


def _build(topk_ids: torch.Tensor, num_experts: int, block_m: int | None, foreign_experts: bool = False,
           pair_tokens: torch.Tensor | None = None) -> DispatchIndex:
    """The build of a checked routing: Triton on CUDA within its limits, else PyTorch.

    ``foreign_experts``: ids ``>= E`` go to a last bucket E that the schedule (over the local offsets) leaves out.
    ``pair_tokens`` (``[T*K]`` int32, general routing inputs): ``expert_token_indices`` maps each slot to its pair's
    token. On CUDA the Triton build writes both in its write pass (a gather of the tokens and a schedule launch
    after it took 7.5 + 5 µs more at token rounding's 40,832 pairs: H200, ``python3
    benchmarks/bench_token_rounding.py speed --shapes 0 --variants none --breakdown 40``).
    """
    E = num_experts + foreign_experts
    if _triton_serves(topk_ids, E):  # foreign ids clamped into bucket E by the count pass
        from .kernels.dispatch import build_dispatch_triton

        built = build_dispatch_triton(topk_ids, E, block_m=block_m, pair_tokens=pair_tokens,
                                      schedule_experts=num_experts)
        return DispatchIndex(*built.tensors(), num_experts, built.schedule, foreign_experts)
    built = build_dispatch_torch(topk_ids.clamp(max=num_experts) if foreign_experts else topk_ids, E)
    indices = built.expert_token_indices if pair_tokens is None else pair_tokens.index_select(
        0, built.expert_token_indices)
    index = DispatchIndex(built.expert_token_offsets, indices, built.token_expert_indices, built.token_index_map,
                          num_experts, foreign_experts=foreign_experts)
    return index if block_m is None else with_schedule(index, block_m)


def _triton_serves(ids: torch.Tensor, num_buckets: int) -> bool:
    """The Triton build takes these ``[T, K]`` ids: :func:`_triton_dispatch`, the buckets and K within its register
    tiles (``benchmarks/bench_host.py --mode cpu`` replaces it to time that path's host side on the CPU)."""
    if not _triton_dispatch(ids):
        return False
    from .kernels.dispatch import MAX_EXPERTS, MAX_TOP_K

    return num_buckets <= MAX_EXPERTS and ids.shape[1] <= min(MAX_TOP_K, num_buckets)


def _check_block_m(block_m) -> None:
    if not isinstance(block_m, int) or isinstance(block_m, bool) or block_m < 1:
        raise ValueError(f"block_m must be a positive int (slots per M-tile), got {block_m!r}")


def _record_source(index: DispatchIndex, topk_ids: torch.Tensor) -> DispatchIndex:
    """``index`` remembering the ids tensor and its version (see ``DispatchIndex.built_from``); not under
    ``torch.compile``, where the check is skipped anyway."""
    if torch.compiler.is_compiling():
        return index
    return replace(index, built_from=(topk_ids, None if topk_ids.is_inference() else topk_ids._version))


def check_index_matches(index: DispatchIndex, topk_ids: torch.Tensor) -> None:
    """Raise ``ValueError`` when ``index`` was recorded as built from ids other than ``topk_ids`` [T, K].

    Free for the tensor the index was built from, unmodified (modified in place since: refused); one
    comparison (a host synchronisation) for another tensor. Skipped for unrecorded indices, under
    ``torch.compile`` and, for another tensor, inside CUDA-graph capture.
    """
    if index.built_from is None or torch.compiler.is_compiling():
        return
    ids, version = index.built_from
    if ids is topk_ids:
        if version is None or topk_ids._version == version:
            return
        # int32 ids are not copied by the build: the index may alias them, so a comparison proves nothing
        raise ValueError("topk_ids was modified in place after build_dispatch built index from it; rebuild the index")
    if capturing(topk_ids):  # the comparison reads on the host: the caller's contract under capture
        return
    ids = topk_ids.to(device=index.token_expert_indices.device, dtype=torch.int32)
    if index.foreign_experts:  # the index holds foreign ids clamped into bucket E
        ids = ids.clamp(max=index.num_experts)
    if not torch.equal(index.token_expert_indices, ids):
        raise ValueError("index was built from other topk_ids than the ones passed; build it from these topk_ids")


def _triton_dispatch(t: torch.Tensor) -> bool:
    """The Triton build and tile schedule may run on ``t``: :func:`moeblaze.settings.use_triton` (CUDA by default)
    and Triton importable."""
    if not settings.use_triton(t):
        return False
    try:
        from .kernels import dispatch  # noqa: F401
    except ImportError:
        return False
    return True
