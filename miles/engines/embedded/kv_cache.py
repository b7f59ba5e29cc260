"""Preallocated per-slot KV cache.

Layout per layer: [slots, kv_heads, max_seq_len + 1, head_dim]. Running requests occupy the slots
0..R-1 contiguously (the scheduler compacts on removal), so a decode step attends to a plain view
`k[layer][:R, :, :L]`: no gather, no copy. The extra last position is a scratch row that padded
prefill tokens write to, so padding never clobbers a real entry.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.scratch_pos = max_seq_len
        # positions rounded up to 16 so attention kernels see aligned key lengths
        self._shape = (num_layers, num_slots, num_kv_heads, (max_seq_len + 1 + 15) // 16 * 16, head_dim)
        self.dtype = dtype
        self.device = device
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        # per layer: k, v [slots, kv_heads, capacity, head_dim], and the same viewed as rows
        # [slots * kv_heads * capacity, head_dim] (views built once: indexing a layer is an op per use)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        # row of (slot, kv head, position 0) in that flat view
        heads = torch.arange(num_kv_heads, device=device)
        self._slot_head_rows = (torch.arange(num_slots, device=device)[:, None] * num_kv_heads + heads) * self.capacity
        self.allocate()

    @property
    def capacity(self) -> int:
        """Positions per slot in storage (max_seq_len + scratch, rounded up to 16)."""
        return self._shape[3]

    @property
    def allocated(self) -> bool:
        return self.k is not None

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self._shape:
            n *= d
        return 2 * n * torch.empty((), dtype=self.dtype).element_size()

    def allocate(self) -> None:
        if self.k is None:
            self.k = torch.zeros(self._shape, dtype=self.dtype, device=self.device)
            self.v = torch.zeros(self._shape, dtype=self.dtype, device=self.device)
            self.layers = list(zip(self.k.unbind(0), self.v.unbind(0), strict=True))
            self._rows = [(k.view(-1, k.shape[-1]), v.view(-1, v.shape[-1])) for k, v in self.layers]
            logger.info("allocated KV cache %s (%.1f MiB)", self._shape, self.nbytes / 2**20)

    def release(self) -> None:
        """Drop the cache storage (its contents are lost; running requests must be re-prefilled)."""
        self.k = self.v = None
        self.layers, self._rows = [], []

    def cache_rows(self, slot_start: int, positions: torch.Tensor) -> torch.Tensor:
        """Where the entries of slots slot_start.. at `positions` [B, T] live, for every kv head: rows
        [B * T, kv_heads] of a layer's cache viewed flat (see `write`). One index per step, all layers."""
        heads = self._slot_head_rows[slot_start : slot_start + positions.shape[0]]  # [B, kv_heads]
        return (heads[:, None, :] + positions[:, :, None]).view(-1, heads.shape[1])

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [B * T, kv_heads, head_dim] of `layer` at `rows` (from cache_rows)."""
        k_rows, v_rows = self._rows[layer]
        k_rows.index_put_((rows,), k)
        v_rows.index_put_((rows,), v)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (compaction after a removal)."""
        if src == dst or length <= 0:
            return
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
