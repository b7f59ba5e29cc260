"""The prefix cache's page index: chains, reference counts, LRU eviction of unreferenced leaves, and the
K/V copies between the pool and a slot (checked against the slot's values)."""

import torch

from miles.engines.embedded.kv_cache import KVCache
from miles.engines.embedded.prefix_cache import PrefixCache

P = 4


def _setup(pages: int = 3, kv_heads: int = 1):
    kv = KVCache(
        num_layers=2, num_slots=2, max_seq_len=32, num_kv_heads=kv_heads, head_dim=2, dtype=torch.float32, device="cpu"
    )
    kv.k.copy_(torch.randn(kv.k.shape))
    kv.v.copy_(torch.randn(kv.v.shape))
    cache = PrefixCache(
        page_size=P,
        num_pages=pages,
        num_layers=2,
        num_kv_heads=kv_heads,
        head_dim=2,
        dtype=torch.float32,
        device="cpu",
    )
    return kv, cache


def test_pages_added_behind_a_cached_one_hold_the_slots_kv_at_their_positions():
    kv, cache = _setup(pages=6, kv_heads=2)
    ids = list(range(17))  # 4 full pages + 1 token
    first = cache.match(ids[:5])
    cache.extend(first, ids[:5], kv, slot=0)  # page 0 cached from slot 0
    kv.k[:, 1, :, :P] = kv.k[:, 0, :, :P]  # slot 1 holds the same first page, its own K/V after it
    kv.v[:, 1, :, :P] = kv.v[:, 0, :, :P]
    lease = cache.match(ids)
    assert lease.pages == first.pages
    cache.extend(lease, ids, kv, slot=1)  # pages 1-3 new, copied in one go from slot 1
    assert len(lease.pages) == 4
    assert cache.load(lease, kv, slot=0) == 4 * P
    assert torch.equal(kv.k[:, 0, :, : 4 * P], kv.k[:, 1, :, : 4 * P])
    assert torch.equal(kv.v[:, 0, :, : 4 * P], kv.v[:, 1, :, : 4 * P])


def test_a_chain_is_found_by_its_tokens_and_loads_the_slots_kv_into_another_slot():
    kv, cache = _setup()
    ids = list(range(10))  # 2 full pages + 2 tokens
    lease = cache.match(ids)
    assert lease.pages == []
    cache.extend(lease, ids, kv, slot=0)
    assert len(lease.pages) == 2 and cache.refcounts() == {lease.pages[0]: 1, lease.pages[1]: 1}
    other = cache.match(ids[:9] + [99])
    assert other.pages == lease.pages
    assert cache.match([1] + ids[1:]).pages == []  # a different first page shares nothing
    assert cache.load(other, kv, slot=1) == 2 * P
    assert torch.equal(kv.k[:, 1, :, : 2 * P], kv.k[:, 0, :, : 2 * P])
    assert torch.equal(kv.v[:, 1, :, : 2 * P], kv.v[:, 0, :, : 2 * P])
    cache.release_lease(lease)
    cache.release_lease(other)
    assert set(cache.refcounts().values()) == {0} and cache.cached_pages == 2


def test_eviction_takes_unreferenced_leaves_first_and_clear_voids_leases():
    kv, cache = _setup(pages=3)
    a = cache.match([])
    cache.extend(a, list(range(8)), kv, slot=0)  # pages a0 -> a1
    b = cache.match([])
    cache.extend(b, [7] * 8, kv, slot=1)  # one free page left: b0 only
    assert len(b.pages) == 1
    cache.release_lease(a)  # a1 is the only unreferenced leaf
    cache.extend(b, [7] * 8, kv, slot=1)
    assert len(b.pages) == 2 and cache.evicted == 1
    assert len(cache.match(list(range(8))).pages) == 1  # a0 survived, a1 went
    generation = cache.generation
    cache.clear()
    assert cache.cached_pages == 0 and cache.generation == generation + 1
    assert cache.load(b, kv, slot=0) == 0  # a lease from before the clear reads nothing
    cache.release_lease(b)  # and releasing it touches nothing
    assert cache.refcounts() == {}


def test_an_fp8_cache_and_pool_move_pages_code_for_code():
    """The pool holds the cache's storage dtype; a page copied in from one slot and loaded into another brings
    the same e4m3 codes (saturated entries included), not values rounded again."""
    kw = dict(num_layers=2, num_kv_heads=2, head_dim=4, device="cpu")
    kv = KVCache(num_slots=2, max_seq_len=32, dtype=torch.float32, storage_dtype=torch.float8_e4m3fn, **kw)
    kv.k.copy_((torch.randn(kv.k.shape) * 300).clamp(-448, 448).to(torch.float8_e4m3fn))
    kv.v.copy_((torch.randn(kv.v.shape) * 300).clamp(-448, 448).to(torch.float8_e4m3fn))
    cache = PrefixCache(page_size=P, num_pages=4, dtype=kv.storage_dtype, **kw)
    ids = list(range(2 * P + 1))
    lease = cache.match(ids)
    cache.extend(lease, ids, kv, slot=0)
    assert cache.k.dtype == torch.float8_e4m3fn and len(lease.pages) == 2
    assert cache.load(cache.match(ids), kv, slot=1) == 2 * P
    for t in (kv.k, kv.v):
        codes = t.view(torch.uint8)
        assert torch.equal(codes[:, 1, :, : 2 * P], codes[:, 0, :, : 2 * P])
        assert codes[:, 0, :, : 2 * P].any()


def test_a_batch_of_extends_and_loads_moves_each_requests_pages_as_one_at_a_time_would(monkeypatch):
    """extend_many / load_many (a prefill's or a step's finished requests together), with the copies cut into
    chunks of two pages: the pool and the slots end as the requests one by one leave them, and a chain two
    requests of the batch share is copied once (the second finds the first's pages)."""
    import miles.engines.embedded.prefix_cache as prefix_cache

    kw = dict(num_layers=2, num_kv_heads=2, head_dim=2, dtype=torch.float32, device="cpu")
    kv = KVCache(num_slots=4, max_seq_len=32, **kw)
    kv.k.copy_(torch.randn(kv.k.shape))
    kv.v.copy_(torch.randn(kv.v.shape))
    one = PrefixCache(page_size=P, num_pages=12, **kw)
    many = PrefixCache(page_size=P, num_pages=12, **kw)
    per_page = many.k[:, 0].numel() * many.k.element_size()
    monkeypatch.setattr(prefix_cache, "COPY_CHUNK_BYTES", 2 * per_page)
    ids = [list(range(3 * P + 1)), list(range(100, 100 + 2 * P)), list(range(3 * P + 1))]  # the third = the first
    kv.k[:, 2], kv.v[:, 2] = kv.k[:, 0], kv.v[:, 0]
    leases_one = [one.match(t) for t in ids]
    for slot, (lease, t) in enumerate(zip(leases_one, ids, strict=True)):
        one.extend(lease, t, kv, slot)
    leases_many = [many.match(t) for t in ids]
    many.extend_many([(lease, t, slot) for slot, (lease, t) in enumerate(zip(leases_many, ids, strict=True))], kv)
    assert [len(lease.pages) for lease in leases_many] == [3, 2, 3] and leases_many[2].pages == leases_many[0].pages
    assert many.cached_pages == 5 and [lease.pages for lease in leases_many] == [lease.pages for lease in leases_one]
    assert torch.equal(many.k, one.k) and torch.equal(many.v, one.v)
    for slot, lease in enumerate(leases_many[:2]):  # each page holds its tokens' K/V, in order
        for j, pid in enumerate(lease.pages):
            assert torch.equal(many.k[:, pid], kv.k[:, slot, :, j * P : (j + 1) * P])
            assert torch.equal(many.v[:, pid], kv.v[:, slot, :, j * P : (j + 1) * P])
    target = KVCache(num_slots=4, max_seq_len=32, **kw)
    got = many.load_many([(many.match(ids[1]), 3), (many.match(ids[0]), 1)], target)
    assert got == [2 * P, 3 * P]
    for pool_slot, src_slot, n in ((3, 1, 2 * P), (1, 0, 3 * P)):
        assert torch.equal(target.k[:, pool_slot, :, :n], kv.k[:, src_slot, :, :n])
        assert torch.equal(target.v[:, pool_slot, :, :n], kv.v[:, src_slot, :, :n])
    assert not target.k[:, 1, :, 3 * P :].any() and not target.k[:, 0].any()  # nothing past them, no other slot


def test_a_finished_answer_evicts_only_other_answers_and_a_prompt_hit_makes_its_pages_a_prompt():
    """Pages a finished request adds (answers=True) take free pages or evict answer pages, never a prompt's;
    the pages a later prompt matches are prompt pages from then on."""
    kv, cache = _setup(pages=4)
    prompt = cache.match([])
    cache.extend(prompt, list(range(8)), kv, slot=0)  # p0 -> p1, a prefill's pages
    cache.release_lease(prompt)  # both unheld; p1 an evictable leaf
    first = cache.match([])
    cache.extend_many([(first, [7] * 12, 1)], kv, answers=True)  # 3 pages wanted, 2 free, no prompt evicted
    assert len(first.pages) == 2 and cache.evicted == 0
    cache.release_lease(first)  # its leaf is an evictable answer page
    second = cache.match([])
    cache.extend_many([(second, [5] * 4, 0)], kv, answers=True)  # evicts the older answer's leaf, not p1
    assert len(second.pages) == 1 and cache.evicted == 1
    again = cache.match(list(range(8)))
    assert len(again.pages) == 2  # the prompt survived
    cache.release_lease(again)
    cache.release_lease(second)
    turn = cache.match([5] * 4 + [1])  # a session's next turn starts with the answer: a prompt page now
    cache.release_lease(turn)
    third = cache.match([])
    cache.extend_many([(third, [9] * 8, 1)], kv, answers=True)  # one answer page left to evict: first's root
    assert len(third.pages) == 1 and cache.evicted == 2
    kept = [cache.match([5] * 4), cache.match(list(range(8)))]
    assert [len(lease.pages) for lease in kept] == [1, 2]  # the promoted answer and the prompt stayed
    for lease in kept:
        cache.release_lease(lease)
    fourth = cache.match([])
    cache.extend(fourth, [3] * 4, kv, slot=0)  # a prefill's page may evict any unheld leaf
    assert len(fourth.pages) == 1 and cache.evicted == 3
