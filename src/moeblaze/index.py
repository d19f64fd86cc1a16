"""The dispatch index types (DESIGN.md §3; MoEBlaze §4.1): what a dispatch build returns and the kernels read.

The contract itself is written once, in :mod:`moeblaze.dispatch`'s docstring. This module holds only the
two containers and imports nothing from the backends, so every backend and builder can import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["DispatchIndex", "TileSchedule"]


@dataclass(frozen=True)
class TileSchedule:
    """The grouped-GEMM M-tile schedule of an index for one ``block_m`` (contract: :mod:`moeblaze.dispatch`).

    Attributes:
        block_m: slots per M-tile.
        tile_expert: ``[max_tiles]`` int32 expert of each tile (-1 past ``num_tiles``).
        tile_row_start: ``[max_tiles]`` int32 first slot of each tile (N past ``num_tiles``).
        num_tiles: ``[1]`` int32, on the device (never read on the host).
    """

    block_m: int
    tile_expert: torch.Tensor
    tile_row_start: torch.Tensor
    num_tiles: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tile_expert, tile_row_start, num_tiles)``."""
        return self.tile_expert, self.tile_row_start, self.num_tiles


@dataclass(frozen=True)
class DispatchIndex:
    """The dispatch index of DESIGN.md §3 (contract: :mod:`moeblaze.dispatch`).

    Attributes:
        expert_token_offsets: ``[E+1]`` int32, exclusive prefix sum of per-expert counts.
        expert_token_indices: ``[N]`` int32, slot -> token id, tokens ascending per expert.
        token_expert_indices: ``[T, K]`` int32, the routing (top-k expert ids).
        token_index_map: ``[T, K]`` int32, pair (t, k) -> slot.
        num_experts: E.
        schedule: the grouped-GEMM tile schedule when the build was asked for one (``block_m``).
        pair_offsets: ``[T+1]`` int32 for an index of general routing inputs (pairs of token t are
            ``pair_offsets[t]:pair_offsets[t+1]``; then the routing arrays are ``[P]``; pairs past
            ``pair_offsets[T]`` are foreign and in no token's combine), else None.
        foreign_experts: the index has the extra bucket E of foreign pairs (offsets ``[E+2]``).
        built_from: ``(topk_ids, its version counter)`` recorded by :func:`build_dispatch` (None for an
            index built by hand or inside ``torch.compile``). :func:`moeblaze.moe_experts` accepts the index
            with that same, unmodified ``topk_ids`` tensor at no cost, refuses it when that tensor was
            modified in place since, compares the values (one host synchronisation) for any other ids
            tensor, and refuses an index whose routing differs.
            Unrecorded indices are the caller's contract: they must come from the ``topk_ids`` passed.
    """

    expert_token_offsets: torch.Tensor
    expert_token_indices: torch.Tensor
    token_expert_indices: torch.Tensor
    token_index_map: torch.Tensor
    num_experts: int
    schedule: TileSchedule | None = None
    foreign_experts: bool = False
    built_from: tuple[torch.Tensor, int | None] | None = field(default=None, repr=False, compare=False)
    pair_offsets: torch.Tensor | None = None

    @property
    def is_general(self) -> bool:
        """Built from a pair list (``moeblaze.general_routing``): ``token_expert_indices`` and
        ``token_index_map`` are ``[P]`` and ``pair_offsets [T+1]`` delimits each token's pairs."""
        return self.pair_offsets is not None

    @property
    def local_offsets(self) -> torch.Tensor:
        """``[E+1]`` offsets of the local experts (``expert_token_offsets`` without the foreign bucket)."""
        if not self.foreign_experts:  # the tensor itself: no view per call on the host-bound small-T path
            return self.expert_token_offsets
        return self.expert_token_offsets[: self.num_experts + 1]

    @property
    def num_tokens(self) -> int:
        """T, the number of tokens."""
        if self.pair_offsets is not None:
            return self.pair_offsets.numel() - 1
        return self.token_index_map.shape[0]

    @property
    def top_k(self) -> int:
        """K, experts per token.

        Raises:
            ValueError: a general-routing index (pairs per token vary; see ``pair_offsets``)."""
        if self.pair_offsets is not None:
            raise ValueError("an index of general routing inputs has no fixed K (pairs per token vary)")
        return self.token_index_map.shape[1]

    @property
    def num_pairs(self) -> int:
        """N = T*K, the number of routed pairs (slots)."""
        return self.token_index_map.numel()

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The four arrays, in the order of DESIGN.md §3."""
        return (self.expert_token_offsets, self.expert_token_indices,
                self.token_expert_indices, self.token_index_map)

    def nbytes(self) -> int:
        """Bytes held by the four arrays: 4*(E+1) + 12*N (a schedule adds 8*max_tiles + 4)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())
