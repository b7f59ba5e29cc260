"""Prefix cache of the embedded engine: KV pages shared by requests whose tokens start alike.

A page holds the K/V of `page_size` consecutive tokens for every layer, in a pool apart from the
per-request slots. Pages form chains: a page is found by (its parent page, its tokens), so a chain is
a token prefix cut at page boundaries, and two requests with the same first n pages of tokens find the
same n pages (the 8 samples of a GRPO group; a session turn whose prompt extends the previous turn's
tokens). Only full pages are shared; the tokens past the last full page are recomputed.

Sharing saves compute, not slot memory: the attention kernels read each request's K/V from its own
contiguous slot (kv_cache.py), so a hit copies the pages into the slot (a device copy of a few MB)
and the prefill computes only the tokens after them.

Reference counts: a request holds a reference on every page of its chain while it runs (acquired when
it is admitted, released when it finishes or is retracted). Pages nobody references stay cached for
later turns and requests until the pool needs room; then the least recently used unreferenced page
that no other page extends is evicted first.

Pages hold what the slots hold, in the KV cache's storage dtype (FP8 too: `dtype` is the cache's
`storage_dtype`), and are copied as codes, so a page loaded into a slot is bit for bit the K/V it was
made from.

Weight versions: `clear()` drops every page (the runner calls it at each KV epoch bump: new weights,
a merged adapter, released memory). A lease taken under an older generation is void, so KV computed
under other weights is never read.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field

import torch

from miles.engines.embedded.kv_cache import KVCache, as_codes
from miles.engines.embedded.transfer import to_device

logger = logging.getLogger(__name__)

DEFAULT_PAGE_SIZE = 16


@dataclass(slots=True)
class Page:
    key: tuple  # (parent page id or -1, the page's tokens)
    parent: int
    refs: int = 0
    children: int = 0


@dataclass(slots=True)
class Lease:
    """Pages a request holds (its chain from the root, in order) under cache generation `generation`."""

    generation: int
    pages: list[int] = field(default_factory=list)


class PrefixCache:
    def __init__(
        self,
        *,
        page_size: int,
        num_pages: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        if page_size < 1 or num_pages < 1:
            raise ValueError(f"prefix cache needs page_size >= 1 and num_pages >= 1; got {page_size}, {num_pages}")
        self.page_size = page_size
        self.num_pages = num_pages
        self._shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
        self.dtype, self.device = dtype, device
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.generation = 0
        self._lock = threading.Lock()  # the index is touched from the loop thread and the step thread
        self._pages: dict[int, Page] = {}
        self._index: dict[tuple, int] = {}
        self._free: list[int] = []
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self.evicted = 0
        self.allocate()

    # ---- storage ---------------------------------------------------------------------------------
    @property
    def allocated(self) -> bool:
        return self.k is not None

    def allocate(self) -> None:
        if self.k is None:
            self.k = torch.zeros(self._shape, dtype=self.dtype, device=self.device)
            self.v = torch.zeros(self._shape, dtype=self.dtype, device=self.device)
            self._reset()

    def release(self) -> None:
        """Free the pool's memory (colocated offload); every page is dropped."""
        self.clear()
        self.k = self.v = None

    def clear(self) -> None:
        """Drop every page and void every lease (new weights: no page may be reused)."""
        with self._lock:
            self.generation += 1
            self._reset()

    def _reset(self) -> None:
        self._pages.clear()
        self._index.clear()
        self._evictable.clear()
        self._free = list(range(self.num_pages - 1, -1, -1))

    # ---- counts ----------------------------------------------------------------------------------
    @property
    def cached_pages(self) -> int:
        return len(self._pages)

    @property
    def referenced_pages(self) -> int:
        return sum(1 for p in self._pages.values() if p.refs > 0)

    def refcounts(self) -> dict[int, int]:
        return {pid: p.refs for pid, p in self._pages.items()}

    # ---- index -----------------------------------------------------------------------------------
    def match(self, ids: list[int]) -> Lease:
        """Acquire the longest chain of cached full pages that `ids` starts with."""
        with self._lock:
            lease = Lease(self.generation)
            if self.k is None:
                return lease
            parent, P = -1, self.page_size
            for start in range(0, len(ids) - P + 1, P):
                pid = self._index.get((parent, tuple(ids[start : start + P])))
                if pid is None:
                    break
                self._ref(pid)
                lease.pages.append(pid)
                parent = pid
            return lease

    def extend(self, lease: Lease, ids: list[int], kv: KVCache, slot: int) -> None:
        """Add to `lease` the full pages of `ids` past its chain, whose K/V sit in `slot` at positions
        [0, len(ids)): found in the cache or copied into free pages (the pool full, the chain stops)."""
        with self._lock:
            if lease.generation != self.generation or self.k is None:
                return
            P = self.page_size
            parent = lease.pages[-1] if lease.pages else -1
            first_new, new = None, []  # a page not in the cache has no cached child: the rest are new too
            for start in range(len(lease.pages) * P, len(ids) - P + 1, P):
                key = (parent, tuple(ids[start : start + P]))
                pid = self._index.get(key)
                if pid is None:
                    pid = self._new_page(key, parent)
                    if pid is None:
                        break
                    first_new = start if first_new is None else first_new
                    new.append(pid)
                self._ref(pid)
                lease.pages.append(pid)
                parent = pid
            if new:  # one copy of K and one of V for all of them, not two per page
                self._copy_from_slot(kv, slot, first_new, new)

    def release_lease(self, lease: Lease) -> None:
        """Drop a request's references (a lease from an older generation holds none)."""
        with self._lock:
            if lease.generation == self.generation:
                for pid in lease.pages:
                    self._unref(pid)
            lease.pages = []

    def load(self, lease: Lease, kv: KVCache, slot: int) -> int:
        """Copy the lease's pages into `slot` at positions [0, n); return n (0 for a void lease)."""
        if lease.generation != self.generation or not lease.pages:
            return 0
        n = len(lease.pages) * self.page_size
        index = to_device(lease.pages, self.device)
        for pool, cache in ((self.k, kv.k), (self.v, kv.v)):
            pages = as_codes(pool).index_select(1, index)  # [layers, m, kvh, P, hd]
            as_codes(cache)[:, slot, :, :n] = pages.transpose(1, 2).flatten(2, 3)
        return n

    # ---- pages -----------------------------------------------------------------------------------
    def _ref(self, pid: int) -> None:
        page = self._pages[pid]
        page.refs += 1
        self._evictable.pop(pid, None)

    def _unref(self, pid: int) -> None:
        page = self._pages.get(pid)
        if page is None:
            return
        page.refs -= 1
        if page.refs == 0 and page.children == 0:
            self._evictable[pid] = None

    def _new_page(self, key: tuple, parent: int) -> int | None:
        if not self._free and not self._evict_one():
            return None
        pid = self._free.pop()
        self._pages[pid] = Page(key, parent)
        self._index[key] = pid
        if parent >= 0:
            self._pages[parent].children += 1
            self._evictable.pop(parent, None)
        return pid

    def _evict_one(self) -> bool:
        if not self._evictable:
            return False
        pid, _ = self._evictable.popitem(last=False)
        page = self._pages.pop(pid)
        del self._index[page.key]
        self._free.append(pid)
        self.evicted += 1
        if page.parent >= 0:
            parent = self._pages[page.parent]
            parent.children -= 1
            if parent.children == 0 and parent.refs == 0:
                self._evictable[page.parent] = None
                self._evictable.move_to_end(page.parent, last=False)  # its only extension was the coldest
        return True

    def _copy_from_slot(self, kv: KVCache, slot: int, start: int, pids: list[int]) -> None:
        """Pages `pids` take the K/V of `slot` at positions [start, start + len(pids) x page_size), in order."""
        n, P = len(pids), self.page_size
        index = to_device(pids, self.device)
        for pool, cache in ((self.k, kv.k), (self.v, kv.v)):
            pages = (
                as_codes(cache)[:, slot, :, start : start + n * P].unflatten(2, (n, P)).transpose(1, 2)
            )  # [layers, n, kvh, P, hd]
            as_codes(pool).index_copy_(1, index, pages)
