"""The radix prefix cache over the page pool: matching, splitting, locking, LRU eviction."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.cache.page_pool import PagePool
from jaxserve.cache.radix_cache import RadixCache

PS = 4


def fresh(num_pages: int = 33):
    pool = PagePool(num_pages, PS)
    return pool, RadixCache(pool)


def put(pool, cache, sid, tokens):
    """A request that computed `tokens` and finished: its full pages go into the tree."""
    pool.ensure_capacity(sid, len(tokens))
    full = len(tokens) // PS
    present = cache.insert(tokens[: full * PS], pool.pages_of(sid)[:full])
    pool.free(sid)
    return present


def check(pool, cache):
    cache.check_invariants()
    pool.check_invariants(cache.external_refs())


def test_match_after_insert_returns_the_same_pages():
    pool, cache = fresh()
    toks = list(range(10))
    pool.ensure_capacity("a", 10)
    pages = list(pool.pages_of("a"))
    assert cache.insert(toks[:8], pages[:2]) == 0
    pool.free("a")
    assert pool.num_free == 30  # the partial third page went back
    got, n, _ = cache.match_prefix(toks + [99])
    assert (got, n) == (pages[:2], 8)
    assert cache.match_prefix(toks, max_tokens=7)[1] == 4  # capped to whole pages
    check(pool, cache)


def test_match_ending_mid_edge_splits_and_prefixes_of_each_other():
    pool, cache = fresh()
    long = list(range(100, 116))
    put(pool, cache, "a", long)
    pages, n, node = cache.match_prefix(long[:9])
    assert n == 8 and len(node.key) == 8  # the 16-token edge was split after two pages
    check(pool, cache)
    assert put(pool, cache, "b", long[:8]) == 8  # a prefix of a cached prompt adds nothing
    assert put(pool, cache, "c", long[:8] + [7, 7, 7, 7]) == 8  # diverges after two pages
    assert cache.match_prefix(long[:8] + [7, 7, 7, 7, 1])[1] == 12
    assert cache.match_prefix(long)[1] == 16
    check(pool, cache)


def test_locked_nodes_survive_eviction_and_lru_order():
    pool, cache = fresh(9)
    put(pool, cache, "old", [1] * 8)
    put(pool, cache, "mid", [2] * 8)
    put(pool, cache, "new", [3] * 8)
    assert pool.num_free == 2
    pages, n, node = cache.match_prefix([2] * 8)
    cache.lock(node)
    pool.append_shared("user", pages)
    assert cache.evict(4) == 4  # "old" then "new": "mid" is locked
    assert cache.match_prefix([1] * 8, peek=True)[1] == 0
    assert cache.match_prefix([2] * 8, peek=True)[1] == 8
    check(pool, cache)
    cache.unlock(node)
    pool.free("user")
    cache.reset()
    check(pool, cache)
    assert pool.num_free == 8 and cache.cached_pages() == 0


def test_stats():
    pool, cache = fresh()
    put(pool, cache, "a", list(range(8)))
    cache.match_prefix(list(range(8)) + [50, 51])
    assert cache.hit_tokens == 8 and cache.query_tokens == 10 and cache.hit_rate == 0.8


op = st.tuples(st.sampled_from(["run", "finish", "evict"]), st.integers(0, 3), st.lists(st.integers(0, 2), max_size=14))


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=40))
def test_random_interleavings_keep_invariants(operations):
    pool, cache = fresh(17)
    running: dict[str, tuple[list[int], object]] = {}
    for i, (kind, slot, tokens) in enumerate(operations):
        sid = f"r{slot}"
        if kind == "run" and sid not in running and tokens:
            pages, n, node = cache.match_prefix(tokens, max_tokens=len(tokens) - 1)
            cache.lock(node)
            pool.append_shared(sid, pages)
            need = -(-len(tokens) // PS) - len(pages)
            if need > pool.num_free:
                cache.evict(need - pool.num_free)
            if need <= pool.num_free:
                pool.ensure_capacity(sid, len(tokens))
                running[sid] = (tokens, node)
            else:
                cache.unlock(node)
                pool.free(sid)
        elif kind == "finish" and sid in running:
            tokens, node = running.pop(sid)
            full = len(tokens) // PS
            cache.insert(tokens[: full * PS], pool.pages_of(sid)[:full])
            cache.unlock(node)
            pool.free(sid)
        elif kind == "evict":
            cache.evict(len(tokens))
        check(pool, cache)
        for sid2, (tokens, _) in running.items():  # eviction never freed a page a request holds
            assert all(pool.refcount(p) >= 1 for p in pool.pages_of(sid2))
    for sid, (tokens, node) in running.items():
        cache.unlock(node)
        pool.free(sid)
    cache.reset()
    check(pool, cache)
    assert pool.num_free == 16
