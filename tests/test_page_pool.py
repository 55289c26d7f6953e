"""The page allocator: unit cases and random interleavings checked against its invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.cache.page_pool import OutOfPagesError, PagePool


def test_null_page_is_never_handed_out():
    pool = PagePool(5, 4)
    pages = pool.allocate(4)
    assert sorted(pages) == [1, 2, 3, 4]
    with pytest.raises(OutOfPagesError):
        pool.allocate(1)
    pool.decref(pages)
    assert pool.num_free == 4
    pool.check_invariants()


def test_tables_grow_on_demand_and_free_at_once():
    pool = PagePool(10, 4)
    assert len(pool.ensure_capacity("a", 1)) == 1
    assert pool.ensure_capacity("a", 4) == []
    assert len(pool.ensure_capacity("a", 9)) == 2
    assert pool.slot("a", 5) == pool.pages_of("a")[1] * 4 + 1
    pool.check_invariants()
    pool.free("a")
    assert pool.num_free == 9 and pool.pages_of("a") == []
    pool.check_invariants()


def test_out_of_pages_changes_nothing():
    pool = PagePool(4, 2)
    pool.ensure_capacity("a", 4)
    with pytest.raises(OutOfPagesError, match="need 2"):
        pool.ensure_capacity("b", 4)
    assert pool.pages_of("b") == [] and pool.num_free == 1
    with pytest.raises(OutOfPagesError):
        pool.ensure_capacity("a", 8)
    assert len(pool.pages_of("a")) == 2
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


ops = st.lists(st.tuples(st.sampled_from(["grow", "share", "free"]), st.integers(0, 5), st.integers(0, 40)),
               max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_keep_invariants(operations):
    pool = PagePool(17, 4)
    lengths: dict[str, int] = {}
    for op, seq, n in operations:
        sid = f"s{seq}"
        if op == "grow":
            want = max(lengths.get(sid, 0), n)
            before = (pool.num_free, list(pool.pages_of(sid)))
            try:
                pool.ensure_capacity(sid, want)
                lengths[sid] = want
            except OutOfPagesError:
                assert (pool.num_free, list(pool.pages_of(sid))) == before
        elif op == "share" and lengths:
            src = sorted(lengths)[n % len(lengths)]
            if src != sid and pool.pages_of(src) and sid not in lengths:
                pool.append_shared(sid, pool.pages_of(src)[:1])
                lengths[sid] = 4
        elif op == "free":
            pool.free(sid)
            lengths.pop(sid, None)
        pool.check_invariants()
        owned = [p for s in lengths for p in pool.pages_of(s)]
        assert 0 not in owned
    for sid in list(lengths):
        pool.free(sid)
    pool.check_invariants()
    assert pool.num_free == 16
