"""The scheduler's side of prefix sharing: which pages a request takes, when it waits a step, what a
prefill copies in and computes, and what a finished request leaves in the cache (prefix_cache.py).

Admission: a request takes the cached full pages its tokens start with (all but its last token, whose
logits the prefill must produce). One that shares more full pages with a request admitted in the same
step than the cache holds waits one step: that request's prefill puts them in the cache, so a group of
n samples computes its prompt once, not n times. Requests that want every prompt position's
log-probs compute every position and take nothing (they still share what they computed).

Finishing: a request's K/V up to its last fed token go into the cache before its slot is reused, so a
session's next turn (its prompt extends this one's tokens) computes only what is new. A full pool makes
room for those pages only by evicting other finished answers, never a prompt's pages.
"""

from __future__ import annotations

from typing import Protocol

from miles.engines.embedded.prefix_cache import Lease, PrefixCache


class SharingRequest(Protocol):
    lease: Lease | None
    cached_tokens: int | None
    prompt_ids: list[int]
    kv_epoch: int

    @property
    def all_ids(self) -> list[int]: ...

    @property
    def wants_input_logprobs(self) -> bool: ...


class PrefixSharing:
    def __init__(self, runner):
        self.runner = runner
        self.cache: PrefixCache | None = runner.prefix_cache  # None: sharing off (counters still count)
        self.prefill_tokens_requested = 0  # tokens whose K/V prefills needed, since the start
        self.prefill_tokens_computed = 0  # of those, the ones computed (the rest came from the cache)

    # ---- admission (event loop thread) ------------------------------------------------------------
    def take(self, req: SharingRequest) -> Lease | None:
        """The cached pages `req` starts with (None: sharing off, or it computes every position)."""
        if self.cache is None or req.wants_input_logprobs:
            return None
        return self.cache.match(req.all_ids[:-1])

    def cached_tokens(self, lease: Lease | None) -> int:
        return len(lease.pages) * self.cache.page_size if lease is not None else 0

    def waits(self, req: SharingRequest, lease: Lease | None, admitted: dict[tuple, list]) -> bool:
        """Whether a request admitted in this step (`admitted`, by first page) shares more full pages with
        `req` than the cache holds; then `req` gives its lease back and waits a step."""
        if lease is None:
            return False
        P, cached = self.cache.page_size, self.cached_tokens(lease)
        ids = req.all_ids[:-1]
        for other in admitted.get(tuple(ids[:P]), ()):
            theirs = other.all_ids
            shared = 0
            while shared + P <= min(len(ids), len(theirs)) and ids[shared : shared + P] == theirs[shared : shared + P]:
                shared += P
            if shared > cached:
                self.cache.release_lease(lease)
                return True
        return False

    def admit(self, req: SharingRequest, lease: Lease | None, admitted: dict[tuple, list]) -> None:
        req.lease = lease
        if self.cache is not None:
            admitted.setdefault(tuple(req.all_ids[: self.cache.page_size]), []).append(req)

    def release(self, lease: Lease | None) -> None:
        if lease is not None:
            self.cache.release_lease(lease)

    def drop(self, req: SharingRequest, kv_tokens: int = 0, slot: int = -1) -> None:
        """Release the request's pages; first share the full pages of its first `kv_tokens` tokens, whose
        K/V its `slot` holds (a finished turn)."""
        self.drop_many([(req, kv_tokens, slot)])

    def drop_many(self, finished: list[tuple[SharingRequest, int, int]]) -> None:
        """`drop` for each (request, kv_tokens, slot) of a step's finished requests, their new pages copied
        into the cache together, before any of their slots is reused. They are answer pages (which only a
        session's next turn reads again): a full pool makes room for them only by evicting other answers,
        never a prompt that a group's later samples or the next rounds share. Where no answer can go, a
        session's next turn computes the last answer again and caches it with its own prompt."""
        held = [(req, n, slot) for req, n, slot in finished if req.lease is not None]
        if not held:
            return
        if self.runner.kv.allocated:
            epoch = self.runner.kv_epoch
            shared = [(r.lease, r.all_ids[:n], slot) for r, n, slot in held if n > 0 and r.kv_epoch == epoch]
            self.cache.extend_many(shared, self.runner.kv, answers=True)
        for req, _, _ in held:
            self.cache.release_lease(req.lease)
            req.lease = None

    # ---- the prefill (step thread, under the runner's lock) --------------------------------------
    def load(
        self, prefill: list[SharingRequest], slot_start: int, reuse: bool = True
    ) -> tuple[list[list[int]], list[int]]:
        """Copy each request's pages into its slot; the tokens left to compute and where they start.
        reuse=False computes every token (a step that records MoE routing runs whole sequences)."""
        hits = [j for j, req in enumerate(prefill) if req.lease is not None and reuse]
        loaded = (
            self.cache.load_many([(prefill[j].lease, slot_start + j) for j in hits], self.runner.kv) if hits else []
        )
        starts = [0] * len(prefill)
        for j, n in zip(hits, loaded, strict=True):
            starts[j] = n
            if n == 0:  # a void lease (the cache was dropped since): start over with an empty one
                self.cache.release_lease(prefill[j].lease)
                prefill[j].lease = self.cache.match([])
        seqs = []
        for req, start in zip(prefill, starts, strict=True):
            ids = req.all_ids
            seqs.append(ids[start:])
            self.prefill_tokens_requested += len(ids)
            self.prefill_tokens_computed += len(ids) - start
            if req.cached_tokens is None:
                req.cached_tokens = min(start, len(req.prompt_ids))
        return seqs, starts

    def share(self, prefill: list[SharingRequest], slot_start: int) -> None:
        """Put the full pages the prefill just computed into the cache (held by their requests)."""
        items = [(req.lease, req.all_ids, slot_start + j) for j, req in enumerate(prefill) if req.lease is not None]
        if items:
            self.cache.extend_many(items, self.runner.kv)
