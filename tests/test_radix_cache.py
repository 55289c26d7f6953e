"""The radix prefix cache over the page pool: matching, splitting, locking, LRU eviction."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from jaxserve.cache.page_pool import OutOfPagesError, PagePool
from jaxserve.cache.radix_cache import RadixCache

PS = 4


def fresh(num_pages: int = 33, page_size: int = PS):
    pool = PagePool(num_pages, page_size)
    return pool, RadixCache(pool)


def put(pool, cache, sid, tokens):
    """A request that computed `tokens` and finished: its full pages go into the tree."""
    pool.ensure_capacity(sid, len(tokens))
    full = len(tokens) // pool.page_size
    present = cache.insert(tokens[: full * pool.page_size], pool.pages_of(sid)[:full])
    pool.free(sid)
    return present


def check(pool, cache):
    cache.check_invariants()
    pool.check_invariants(cache.external_refs())


def test_match_after_insert_returns_the_same_pages():
    pool, cache = fresh()
    toks = list(range(10))
    pool.ensure_capacity("a", 10)
    pages = pool.pages_of("a")
    assert cache.insert(toks[:8], pages[:2]) == 0
    pool.free("a")
    assert pool.num_free == 30  # the partial third page went back
    got, n, _ = cache.match_prefix(toks + [99])
    assert (got, n) == (pages[:2], 8)
    assert cache.match_prefix(np.array(toks))[:2] == (pages[:2], 8)  # numpy token ids too
    assert cache.match_prefix(toks, max_tokens=7)[1] == 4  # capped to whole pages
    assert cache.match_prefix(toks, max_tokens=0)[:2] == ([], 0)
    assert cache.match_prefix(toks[:3])[:2] == ([], 0)  # less than a page never matches
    with pytest.raises(ValueError, match="whole pages"):
        cache.insert(toks, pages[:2])
    check(pool, cache)


def test_match_ending_mid_edge_splits_and_prefixes_of_each_other():
    pool, cache = fresh()
    long = list(range(100, 116))
    put(pool, cache, "a", long)
    pages, n, node = cache.match_prefix(long[:9])
    assert n == 8 and len(node.key) == 8 and node.pages == pages  # the 16-token edge was split after two pages
    assert [len(c.key) for c in node.children.values()] == [8]
    check(pool, cache)
    assert put(pool, cache, "b", long[:8]) == 8  # a prefix of a cached prompt adds nothing
    assert put(pool, cache, "c", long[:8] + [7, 7, 7, 7]) == 8  # diverges after two pages
    assert cache.match_prefix(long[:8] + [7, 7, 7, 7, 1])[1] == 12
    assert cache.match_prefix(long)[1] == 16
    assert cache.match_prefix(long, max_tokens=12)[1] == 12  # a cap inside an edge splits there too
    assert cache.cached_pages() == 5
    check(pool, cache)


def test_shorter_prompt_first_then_longer_extends_it():
    pool, cache = fresh()
    short, long = list(range(8)), list(range(16))
    assert put(pool, cache, "a", short) == 0
    first = cache.match_prefix(short)[0]
    assert put(pool, cache, "b", long) == 8
    pages, n, _ = cache.match_prefix(long)
    assert n == 16 and pages[:2] == first
    check(pool, cache)


def test_insert_keeps_the_trees_pages_and_leaves_the_callers_duplicates():
    pool, cache = fresh(9)
    toks = list(range(8))
    pool.ensure_capacity("a", 8)
    pool.ensure_capacity("b", 8)
    a, b = pool.pages_of("a"), pool.pages_of("b")
    assert cache.insert(toks, a) == 0  # the tree adopts a's pages with a reference of its own
    assert cache.insert(toks, b) == 8  # b computed the same prompt: the tree keeps a's pages
    assert [pool.refcount(p) for p in a + b] == [2, 2, 1, 1]
    check(pool, cache)
    assert pool.free("b") == b and sorted(pool.free("a")) == []
    assert cache.match_prefix(toks)[0] == a
    check(pool, cache)


def test_lock_survives_a_split_above_the_locked_node():
    pool, cache = fresh()
    toks = list(range(16))
    put(pool, cache, "a", toks)
    _, _, node = cache.match_prefix(toks)
    cache.lock(node)
    _, _, mid = cache.match_prefix(toks[:4])  # splits the locked node's edge
    assert node.parent is mid and mid.lock == node.lock == 1 and cache.root.lock == 1
    assert cache.evictable_pages() == 0 and cache.evict(10) == 0
    check(pool, cache)
    cache.unlock(node)
    assert mid.lock == 0 and cache.evictable_pages() == 4
    with pytest.raises(ValueError):
        cache.unlock(node)
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


def test_lru_follows_matches_and_eviction_stops_when_enough_is_free():
    pool, cache = fresh(9)
    put(pool, cache, "x", [1] * 8)
    put(pool, cache, "y", [2] * 8)
    cache.match_prefix([1] * 8)  # touches x: y is now the least recently used
    cache.match_prefix([2] * 8, peek=True)  # a peek touches nothing
    assert cache.evict(1) == 2  # a whole leaf goes
    assert cache.match_prefix([2] * 8, peek=True)[1] == 0 and cache.match_prefix([1] * 8, peek=True)[1] == 8
    assert cache.evict(0) == 0 and cache.cached_pages() == 2
    check(pool, cache)


def test_evicting_a_page_a_sequence_still_holds_does_not_free_it():
    pool, cache = fresh(5)
    put(pool, cache, "a", list(range(8)))
    pages = cache.match_prefix(list(range(8)))[0]
    pool.append_shared("s", pages)  # shared without a lock: the tree may drop it, the pool may not
    assert cache.evict(2) == 0 and cache.cached_pages() == 0
    assert all(pool.refcount(p) == 1 for p in pages) and pool.num_free == 2
    pool.check_invariants(cache.external_refs())
    assert pool.free("s") == pages


def test_stats():
    pool, cache = fresh()
    put(pool, cache, "a", list(range(8)))
    cache.match_prefix(list(range(8)) + [50, 51])
    cache.match_prefix(list(range(8)), peek=True)  # peeks are not queries
    assert (cache.queries, cache.hit_tokens, cache.query_tokens, cache.hit_rate) == (1, 8, 10, 0.8)
    cache.evict(5)
    assert cache.evicted_pages == 2 and cache.stats["cached_pages"] == 0


# Prompts built from three page values so prompts often share prefixes, diverge and nest.
MPS = 2
PAGE = st.sampled_from([(0, 0), (0, 1), (1, 1)])
PROMPT = st.builds(lambda pages, tail: [t for p in pages for t in p] + tail,
                   st.lists(PAGE, max_size=6), st.lists(st.integers(0, 1), max_size=1)).filter(bool)
SEQS = st.sampled_from(["a", "b", "c"])


class CacheMachine(RuleBasedStateMachine):
    """Requests start (match, lock, share, grow), decode, finish (insert, unlock, free) and the
    cache evicts, in random interleavings; the tree is checked against a dict of cached prefixes."""

    N = 13

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(self.N, MPS)
        self.cache = RadixCache(self.pool)
        self.model: dict[tuple[int, ...], int] = {}  # page-aligned cached prefix -> its last page
        self.running: dict[str, tuple[list[int], object, list[int]]] = {}  # tokens, locked node, shared pages

    def expected(self, tokens: list[int], limit: int) -> list[int]:
        pages = []
        for end in range(MPS, limit - limit % MPS + 1, MPS):
            if (p := self.model.get(tuple(tokens[:end]))) is None:
                break
            pages.append(p)
        return pages

    def make_room(self, seq: str, num_tokens: int) -> bool:
        """What the scheduler does: evict for the missing pages, then grow (or change nothing)."""
        need = -(-num_tokens // MPS) - len(self.pool.pages_of(seq))
        if need > self.pool.num_free:
            self.evict(need - self.pool.num_free)
        before = (self.pool.free_pages(), self.pool.pages_of(seq), self.cache.external_refs())
        try:
            self.pool.ensure_capacity(seq, num_tokens)
            return True
        except OutOfPagesError:
            assert (self.pool.free_pages(), self.pool.pages_of(seq), self.cache.external_refs()) == before
            return False

    @rule(seq=SEQS, tokens=PROMPT)
    def start(self, seq: str, tokens: list[int]) -> None:
        if seq in self.running:
            return
        pages, n, node = self.cache.match_prefix(tokens, max_tokens=len(tokens) - 1)
        assert pages == self.expected(tokens, len(tokens) - 1) and n == len(pages) * MPS
        self.cache.lock(node)
        self.pool.append_shared(seq, pages)
        self.running[seq] = (list(tokens), node, pages)
        if not self.make_room(seq, len(tokens)):
            self.release(seq)

    @rule(seq=SEQS, new=st.lists(st.integers(0, 1), min_size=1, max_size=3))
    def decode(self, seq: str, new: list[int]) -> None:
        if seq in self.running:
            tokens = self.running[seq][0]
            if self.make_room(seq, len(tokens) + len(new)):
                tokens += new

    @rule(seq=SEQS)
    def finish(self, seq: str) -> None:
        if seq not in self.running:
            return
        tokens, _, _ = self.running[seq]
        full = len(tokens) // MPS
        key, pages = tokens[: full * MPS], self.pool.pages_of(seq)[:full]
        present = len(self.expected(key, len(key)))
        assert self.cache.insert(key, pages) == present * MPS
        for i in range(present, full):
            self.model[tuple(key[: (i + 1) * MPS])] = pages[i]
        assert self.cache.match_prefix(key, peek=True)[0] == self.expected(key, len(key))
        self.release(seq)

    def release(self, seq: str) -> None:
        _, node, _ = self.running.pop(seq)
        self.cache.unlock(node)
        self.pool.free(seq)

    @rule(n=st.integers(0, 8))
    def evict(self, n: int) -> None:
        free = self.pool.num_free
        freed = self.cache.evict(n)
        assert self.pool.num_free == free + freed
        # Every running request locks what it shares, so unlocked tree pages are the tree's alone.
        assert freed >= n or self.cache.evictable_pages() == 0
        tree = self.cache.external_refs()
        self.model = {k: p for k, p in self.model.items() if p in tree}
        for _, _, shared in self.running.values():
            assert all(p in tree for p in shared), "a locked page was evicted"

    @rule(tokens=PROMPT)
    def peek(self, tokens: list[int]) -> None:
        queries = self.cache.queries
        pages, n, _ = self.cache.match_prefix(tokens, peek=True)
        assert pages == self.expected(tokens, len(tokens)) and n == len(pages) * MPS
        assert self.cache.queries == queries

    @invariant()
    def consistent(self) -> None:
        self.cache.check_invariants()
        self.pool.check_invariants(self.cache.external_refs())
        assert len(self.model) == self.cache.cached_pages()
        assert all(len(k) == MPS or k[:-MPS] in self.model for k in self.model), "a cached prefix lost its parent"
        assert self.cache.root.lock == len(self.running)

    def teardown(self) -> None:
        for seq in list(self.running):
            self.release(seq)
        self.evict(self.N)
        self.consistent()
        assert self.pool.num_free == self.N - 1 and self.cache.cached_pages() == 0


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCacheMachine = CacheMachine.TestCase
