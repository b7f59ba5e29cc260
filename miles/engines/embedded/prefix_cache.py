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
that no other page extends is evicted first. Pages a finished request adds (answers) make room only by
evicting other answer pages, never a prompt's (`extend_many(..., answers=True)`).

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
COPY_CHUNK_BYTES = 64 << 20  # the most one batched page copy gathers at once (K or V)


@dataclass(slots=True)
class Page:
    key: tuple  # (parent page id or -1, the page's tokens)
    parent: int
    refs: int = 0
    children: int = 0
    answer: bool = False  # added by a finished request, never yet part of a prompt (see extend_many)


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
        self._evictable_answers: collections.OrderedDict[int, None] = collections.OrderedDict()  # its answer pages
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
        self._evictable_answers.clear()
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
                self._pages[pid].answer = False  # a prompt now (a session's next turn)
                lease.pages.append(pid)
                parent = pid
            return lease

    def extend(self, lease: Lease, ids: list[int], kv: KVCache, slot: int) -> None:
        """Add to `lease` the full pages of `ids` past its chain, whose K/V sit in `slot` at positions
        [0, len(ids)): found in the cache or copied into free pages (the pool full, the chain stops)."""
        self.extend_many([(lease, ids, slot)], kv)

    def extend_many(self, items: list[tuple[Lease, list[int], int]], kv: KVCache, *, answers: bool = False) -> None:
        """`extend` for each (lease, ids, slot), in order, with the new pages of all of them copied in a few
        launches (a batch's prefill, a step's finished requests) instead of two per request. answers=True (a
        finished request's pages): the new pages are answer pages, which a full pool evicts only for other
        answer pages, so answers never push out a prompt; otherwise the pages found become prompt pages and
        new ones may evict any unheld leaf."""
        copies: list[tuple[int, int, int]] = []  # (page, slot, first position) of every new page
        with self._lock:
            if self.k is None:
                return
            P = self.page_size
            for lease, ids, slot in items:
                if lease.generation != self.generation:
                    continue
                parent = lease.pages[-1] if lease.pages else -1
                for start in range(len(lease.pages) * P, len(ids) - P + 1, P):
                    key = (parent, tuple(ids[start : start + P]))
                    pid = self._index.get(key)
                    if pid is None:
                        pid = self._new_page(key, parent, answers)
                        if pid is None:
                            break
                        copies.append((pid, slot, start))
                    elif not answers:
                        self._pages[pid].answer = False
                    self._ref(pid)
                    lease.pages.append(pid)
                    parent = pid
            if copies:  # inside the lock: a page is never evicted and reused before its K/V is queued
                self._copy_pages(kv, copies, into_pool=True)

    def release_lease(self, lease: Lease) -> None:
        """Drop a request's references (a lease from an older generation holds none)."""
        with self._lock:
            if lease.generation == self.generation:
                for pid in lease.pages:
                    self._unref(pid)
            lease.pages = []

    def load(self, lease: Lease, kv: KVCache, slot: int) -> int:
        """Copy the lease's pages into `slot` at positions [0, n); return n (0 for a void lease)."""
        return self.load_many([(lease, slot)], kv)[0]

    def load_many(self, items: list[tuple[Lease, int]], kv: KVCache) -> list[int]:
        """`load` for each (lease, slot), the pages of all of them copied in a few launches."""
        copies, counts = [], []
        for lease, slot in items:
            pages = lease.pages if lease.generation == self.generation else []
            copies.extend((pid, slot, j * self.page_size) for j, pid in enumerate(pages))
            counts.append(len(pages) * self.page_size)
        if copies:
            self._copy_pages(kv, copies, into_pool=False)
        return counts

    # ---- pages -----------------------------------------------------------------------------------
    def _ref(self, pid: int) -> None:
        page = self._pages[pid]
        page.refs += 1
        self._held(pid)

    def _unref(self, pid: int) -> None:
        page = self._pages.get(pid)
        if page is None:
            return
        page.refs -= 1
        if page.refs == 0 and page.children == 0:
            self._evictable_now(pid)

    def _evictable_now(self, pid: int, coldest: bool = False) -> None:
        """`pid` may be evicted: the most recently used, or (coldest) the next to go."""
        for order in (self._evictable, self._evictable_answers) if self._pages[pid].answer else (self._evictable,):
            order[pid] = None
            if coldest:
                order.move_to_end(pid, last=False)

    def _held(self, pid: int) -> None:
        self._evictable.pop(pid, None)
        self._evictable_answers.pop(pid, None)

    def _new_page(self, key: tuple, parent: int, answer: bool = False) -> int | None:
        if not self._free and not self._evict_one(answers_only=answer):
            return None
        pid = self._free.pop()
        self._pages[pid] = Page(key, parent, answer=answer)
        self._index[key] = pid
        if parent >= 0:
            self._pages[parent].children += 1
            self._held(parent)
        return pid

    def _evict_one(self, answers_only: bool = False) -> bool:
        """Evict the least recently used unheld leaf (answers_only: the least recently used answer page)."""
        order = self._evictable_answers if answers_only else self._evictable
        if not order:
            return False
        pid = next(iter(order))
        self._held(pid)
        page = self._pages.pop(pid)
        del self._index[page.key]
        self._free.append(pid)
        self.evicted += 1
        if page.parent >= 0:
            parent = self._pages[page.parent]
            parent.children -= 1
            if parent.children == 0 and parent.refs == 0:
                self._evictable_now(page.parent, coldest=True)  # its only extension was the coldest
        return True

    def _copy_pages(self, kv: KVCache, copies: list[tuple[int, int, int]], *, into_pool: bool) -> None:
        """For each (page, slot, start): the slot's K/V at positions [start, start + page_size) into the pool's
        page (into_pool) or back. One gather and one scatter of K and of V per chunk of pages; chunks bound
        the gathered copy's memory (COPY_CHUNK_BYTES)."""
        P = self.page_size
        per_page = self.k[:, 0].numel() * self.k.element_size()
        chunk = max(1, COPY_CHUNK_BYTES // per_page)
        for c in range(0, len(copies), chunk):
            pids, slots, starts = to_device(list(zip(*copies[c : c + chunk], strict=True)), self.device)
            positions = starts[:, None] + torch.arange(P, device=self.device)  # [n, P]
            for pool, cache in ((self.k, kv.k), (self.v, kv.v)):
                pool_pages = as_codes(pool).transpose(0, 1)  # [pages, layers, kvh, P, hd]
                slot_tokens = as_codes(cache).permute(1, 3, 0, 2, 4)  # [slots, positions, layers, kvh, hd]
                if into_pool:
                    pages = slot_tokens[slots[:, None], positions]  # [n, P, layers, kvh, hd]
                    pool_pages.index_copy_(0, pids, pages.permute(0, 2, 3, 1, 4))
                else:
                    pages = pool_pages.index_select(0, pids).permute(0, 3, 1, 2, 4)  # [n, P, layers, kvh, hd]
                    slot_tokens.index_put_((slots[:, None], positions), pages)
