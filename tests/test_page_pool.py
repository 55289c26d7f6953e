"""The page allocator: unit cases and random interleavings checked against its invariants."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from jaxserve.cache.page_pool import OutOfPagesError, PagePool


def snapshot(pool: PagePool, seqs=("a", "b", "c")):
    return pool.free_pages(), [pool.refcount(p) for p in range(pool.num_pages)], [pool.pages_of(s) for s in seqs]


def test_null_page_is_never_handed_out():
    pool = PagePool(5, 4)
    pages = pool.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4]
    with pytest.raises(OutOfPagesError):
        pool.allocate(1)
    pool.decref(pages)
    assert pool.num_free == 4
    pool.check_invariants()


def test_allocation_order_is_deterministic():
    pool = PagePool(6, 2)
    assert pool.allocate(2) == [1, 2]
    assert pool.decref([1]) == [1]
    assert pool.allocate(4) == [3, 4, 5, 1]  # freed pages go to the back of the free list
    assert pool.can_allocate(0) and not pool.can_allocate(1)


def test_tables_grow_on_demand_and_free_at_once():
    pool = PagePool(10, 4)
    assert pool.ensure_capacity("a", 0) == []
    assert len(pool.ensure_capacity("a", 1)) == 1
    assert pool.ensure_capacity("a", 4) == []
    assert len(pool.ensure_capacity("a", 9)) == 2
    assert pool.slot("a", 5) == pool.pages_of("a")[1] * 4 + 1
    for bad in (-1, 12):
        with pytest.raises(IndexError):
            pool.slot("a", bad)
    pool.check_invariants()
    pool.free("a")
    assert pool.num_free == 9 and pool.pages_of("a") == []
    assert pool.free("a") == []  # freeing an unknown sequence is a no-op
    pool.check_invariants()


def test_pages_of_is_a_copy():
    pool = PagePool(6, 2)
    pool.ensure_capacity("a", 2)
    table = pool.pages_of("a")
    pool.ensure_capacity("a", 4)
    table.append(5)
    pool.pages_of("b").append(1)
    assert len(table) == 2 and len(pool.pages_of("a")) == 2 and pool.pages_of("b") == []
    pool.check_invariants()


def test_table_view_is_replaced_not_changed_by_growth():
    pool = PagePool(6, 2)
    assert pool.table("a") == () and pool.num_pages_held("a") == 0
    pool.ensure_capacity("a", 2)
    view = pool.table("a")
    pool.ensure_capacity("a", 5)  # the scheduler may hold a view from earlier in the step
    assert list(view) == [1] and list(pool.table("a")) == [1, 2, 3] == pool.pages_of("a")
    assert pool.num_pages_held("a") == 3
    pool.free("a")
    assert pool.table("a") == () and pool.num_pages_held("a") == 0
    pool.check_invariants()


def test_out_of_pages_changes_nothing():
    pool = PagePool(4, 2)
    pool.ensure_capacity("a", 4)
    before = snapshot(pool)
    with pytest.raises(OutOfPagesError, match="need 2"):
        pool.ensure_capacity("b", 4)
    with pytest.raises(OutOfPagesError):
        pool.ensure_capacity("a", 8)
    assert snapshot(pool) == before
    pool.check_invariants()


def test_shared_pages_are_counted_per_holder():
    pool = PagePool(6, 2)
    pool.ensure_capacity("a", 4)
    shared = pool.pages_of("a")[:1]
    pool.append_shared("b", shared)
    assert pool.refcount(shared[0]) == 2
    pool.free("a")
    assert pool.refcount(shared[0]) == 1 and pool.num_free == 4
    pool.check_invariants()
    pool.free("b")
    assert pool.num_free == 5
    pool.check_invariants()


def test_misuse_raises_and_changes_nothing():
    pool = PagePool(6, 2)
    pool.ensure_capacity("a", 4)
    p, q = pool.pages_of("a")
    before = snapshot(pool)
    for bad in ([p, p], [q, 5], [0], [-1], [6]):  # over-release, free page, null page, out of range
        with pytest.raises(ValueError):
            pool.decref(bad)
        assert snapshot(pool) == before
    for bad in ([5], [p, 0], [-1]):
        with pytest.raises(ValueError):
            pool.incref(bad)
        assert snapshot(pool) == before
    with pytest.raises(ValueError, match="twice"):
        pool.append_shared("a", [p])
    with pytest.raises(ValueError, match="twice"):
        pool.append_shared("b", [q, q])
    assert snapshot(pool) == before
    pool.check_invariants()


def test_check_invariants_counts_external_holders_exactly():
    pool = PagePool(6, 2)
    pool.ensure_capacity("a", 2)
    (p,) = pool.pages_of("a")
    with pytest.raises(AssertionError):
        pool.check_invariants({p: 1})  # claimed holder without a reference
    pool.incref([p])
    with pytest.raises(AssertionError):
        pool.check_invariants()  # reference without a holder
    pool.check_invariants({p: 1})
    pool._tables["b"] = [p]  # a table entry that took no reference
    with pytest.raises(AssertionError):
        pool.check_invariants({p: 1})


SEQS = st.sampled_from(["a", "b", "c"])


class PoolMachine(RuleBasedStateMachine):
    """Random grow / share / free / external hold and release, checked after every step."""

    N, PS = 13, 4

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(self.N, self.PS)
        self.external: Counter[int] = Counter()  # references held outside any table (as the radix tree does)

    @rule(seq=SEQS, num_tokens=st.integers(0, 60))
    def grow(self, seq: str, num_tokens: int) -> None:
        before = snapshot(self.pool)
        have = len(self.pool.pages_of(seq))
        try:
            new = self.pool.ensure_capacity(seq, num_tokens)
        except OutOfPagesError:
            assert -(-num_tokens // self.PS) - have > self.pool.num_free
            assert snapshot(self.pool) == before
            return
        assert all(p != 0 and self.pool.refcount(p) == 1 for p in new)
        assert self.pool.pages_of(seq) == before[2]["abc".index(seq)] + new
        assert len(self.pool.pages_of(seq)) * self.PS >= num_tokens

    @rule(src=SEQS, dst=SEQS, k=st.integers(1, 4))
    def share(self, src: str, dst: str, k: int) -> None:
        pages = self.pool.pages_of(src)[:k]
        if not pages or src == dst:
            return
        if set(pages) & set(self.pool.pages_of(dst)):
            with pytest.raises(ValueError):
                self.pool.append_shared(dst, pages)
            return
        refs = [self.pool.refcount(p) for p in pages]
        self.pool.append_shared(dst, pages)
        assert [self.pool.refcount(p) for p in pages] == [r + 1 for r in refs]

    @rule(seq=SEQS)
    def free(self, seq: str) -> None:
        held = self.pool.pages_of(seq)
        freed = self.pool.free(seq)
        assert set(freed) <= set(held) and all(self.pool.refcount(p) == 0 for p in freed)
        assert all(self.pool.refcount(p) > 0 for p in set(held) - set(freed))

    @rule(seq=SEQS, i=st.integers(0, 20))
    def hold(self, seq: str, i: int) -> None:
        pages = self.pool.pages_of(seq)
        if pages:
            self.pool.incref([pages[i % len(pages)]])
            self.external[pages[i % len(pages)]] += 1

    @rule(i=st.integers(0, 20))
    def release(self, i: int) -> None:
        held = sorted(self.external.elements())
        if held:
            p = held[i % len(held)]
            self.pool.decref([p])
            self.external[p] -= 1

    @rule(seq=SEQS, pos=st.integers(0, 60))
    def slot(self, seq: str, pos: int) -> None:
        table = self.pool.pages_of(seq)
        if pos < len(table) * self.PS:
            assert self.pool.slot(seq, pos) == table[pos // self.PS] * self.PS + pos % self.PS
        else:
            with pytest.raises(IndexError):
                self.pool.slot(seq, pos)

    @invariant()
    def consistent(self) -> None:
        self.pool.check_invariants(+self.external)

    def teardown(self) -> None:
        for seq in "abc":
            self.pool.free(seq)
        self.pool.decref(list(self.external.elements()))
        self.pool.check_invariants()
        assert self.pool.num_free == self.N - 1
        assert sorted(self.pool.allocate(self.N - 1)) == list(range(1, self.N))


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase
