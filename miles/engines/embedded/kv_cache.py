"""Preallocated per-slot KV cache.

Layout per layer: [slots, kv_heads, max_seq_len + 1, head_dim]. Running requests occupy the slots
0..R-1 contiguously (the scheduler compacts on removal), so a decode step attends to a plain view
`k[layer][:R, :, :L]`: no gather, no copy. The extra last position is a scratch row that padded
prefill tokens write to, so padding never clobbers a real entry.

Storage dtype (SGLang's `--kv-cache-dtype`): the model's dtype (`auto`), or an FP8 format, `fp8_e4m3` or
`fp8_e5m2`, which halves the bytes a decode step reads from the cache. FP8 writes clamp to the format's
finite range before the cast: past it torch's cast gives inf (e5m2) or, in builds that do not saturate,
NaN (e4m3fn), and one such entry would poison every later step of its request, where a saturated one is a
bounded error. Readers take the
slices they attend over back in the compute dtype (`read`); the cache is never converted whole.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# SGLang's --kv-cache-dtype values the embedded engine stores besides `auto` (the model's dtype)
FP8_STORAGE = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype the cache stores for SGLang's `--kv-cache-dtype` name ("auto": the model's dtype)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in FP8_STORAGE:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r}: the embedded engine stores its KV cache as auto (the model's "
            f"dtype), {' or '.join(FP8_STORAGE)}"
        )
    return FP8_STORAGE[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_STORAGE.values()


def as_codes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as its uint8 codes (the same memory): index_copy_ and index_put_ do not take every
    FP8 dtype on every device, and a copy of codes is a copy of values."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


class KVCache:
    """`dtype` is the compute dtype (what `read` returns, what `write` takes); `storage_dtype` what the
    tensors `k` and `v` hold (default: `dtype`).

    `kv_scale` is the one scale of every stored value (stored = value / kv_scale). It is fixed at 1.0, as
    SGLang's is without scales in the checkpoint: no path multiplies or divides by it (the torch reads and
    writes, the fused Triton kernels, the prefix pool's copies of codes), so a scale other than 1 would
    first have to be taught to every one of them."""

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
        storage_dtype: torch.dtype | None = None,
    ):
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.scratch_pos = max_seq_len
        # positions rounded up to 16 so attention kernels see aligned key lengths
        self._shape = (num_layers, num_slots, num_kv_heads, (max_seq_len + 1 + 15) // 16 * 16, head_dim)
        self.dtype = dtype
        self.storage_dtype = storage_dtype or dtype
        self.kv_scale = 1.0  # fixed (see the class doc)
        # FP8: the largest finite value, what a write saturates to (None: no clamp)
        self.clamp = torch.finfo(self.storage_dtype).max if is_fp8(self.storage_dtype) else None
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
        """Bytes of K and V together, in the storage dtype."""
        n = 1
        for d in self._shape:
            n *= d
        return 2 * n * self.storage_dtype.itemsize

    def allocate(self) -> None:
        if self.k is None:
            self.k = torch.zeros(self._shape, dtype=self.storage_dtype, device=self.device)
            self.v = torch.zeros(self._shape, dtype=self.storage_dtype, device=self.device)
            self.layers = list(zip(self.k.unbind(0), self.v.unbind(0), strict=True))
            self._rows = [
                (as_codes(k.view(-1, k.shape[-1])), as_codes(v.view(-1, v.shape[-1]))) for k, v in self.layers
            ]
            logger.info(
                "allocated KV cache %s of %s (%.1f MiB)",
                self._shape,
                str(self.storage_dtype).removeprefix("torch."),
                self.nbytes / 2**20,
            )

    def release(self) -> None:
        """Drop the cache storage (its contents are lost; running requests must be re-prefilled)."""
        self.k = self.v = None
        self.layers, self._rows = [], []

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x in the storage dtype; FP8 saturates at the format's largest finite value (see the module doc)."""
        if self.clamp is None:
            return x.to(self.storage_dtype)
        return x.clamp(-self.clamp, self.clamp).to(self.storage_dtype)

    def cache_rows(self, slot_start: int, positions: torch.Tensor) -> torch.Tensor:
        """Where the entries of slots slot_start.. at `positions` [B, T] live, for every kv head: rows
        [B * T, kv_heads] of a layer's cache viewed flat (see `write`). One index per step, all layers."""
        heads = self._slot_head_rows[slot_start : slot_start + positions.shape[0]]  # [B, kv_heads]
        return (heads[:, None, :] + positions[:, :, None]).view(-1, heads.shape[1])

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [B * T, kv_heads, head_dim] of `layer` at `rows` (from cache_rows)."""
        k_rows, v_rows = self._rows[layer]
        k_rows.index_put_((rows,), as_codes(self.quantize(k)))
        v_rows.index_put_((rows,), as_codes(self.quantize(v)))

    def read(self, layer: int, slot_start: int, count: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [count, kv_heads, length, head_dim] of slots slot_start.. at positions < length, in
        the compute dtype: views when the storage dtype is the compute dtype, else converted copies of
        these slices alone."""
        k_cache, v_cache = self.layers[layer]
        keys = k_cache[slot_start : slot_start + count, :, :length]
        values = v_cache[slot_start : slot_start + count, :, :length]
        return keys.to(self.dtype), values.to(self.dtype)

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (compaction after a removal)."""
        if src == dst or length <= 0:
            return
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
