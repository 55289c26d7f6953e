"""Host-side allocator of the device KV page pool: free list, page tables, reference counts.

Page 0 is the null page: padding tokens write there and no sequence ever owns it (MaxText's paged
attention once gave garbage for any request holding page 0). A page is either free or referenced
by one or more holders: sequence page tables and the prefix cache, each holding one reference.
"""

from __future__ import annotations

from collections import deque

from jaxserve.attention import NULL_PAGE


class OutOfPagesError(ValueError):
    """Not enough free pages; the pool is unchanged."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError("num_pages must be at least 2 (page 0 is the reserved null page)")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(1, num_pages))
        self._refs = [0] * num_pages
        self._tables: dict[str, list[int]] = {}

    # ---- pages ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} KV pages, {len(self._free)} free of {self.num_pages - 1}")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            assert self._refs[p] > 0, f"incref of free page {p}"
            self._refs[p] += 1

    def decref(self, pages: list[int]) -> list[int]:
        freed = []
        for p in pages:
            assert self._refs[p] > 0, f"decref of free page {p}"
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
                freed.append(p)
        return freed

    def refcount(self, page: int) -> int:
        return self._refs[page]

    # ---- sequences --------------------------------------------------------------------------
    def pages_of(self, seq_id: str) -> list[int]:
        """The sequence's page table (the internal list: do not modify)."""
        return self._tables.get(seq_id, _EMPTY)

    def ensure_capacity(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow seq_id's table to hold num_tokens tokens; returns the new pages."""
        table = self._tables.setdefault(seq_id, [])
        need = -(-num_tokens // self.page_size) - len(table)
        if need <= 0:
            return []
        try:
            new = self.allocate(need)
        except OutOfPagesError:
            if not table:
                del self._tables[seq_id]
            raise
        table.extend(new)
        return new

    def append_shared(self, seq_id: str, pages: list[int]) -> None:
        """Start (or extend) seq_id's table with pages shared from the prefix cache."""
        self.incref(pages)
        self._tables.setdefault(seq_id, []).extend(pages)

    def free(self, seq_id: str) -> list[int]:
        """Drop seq_id's references at once; returns pages that became free."""
        table = self._tables.pop(seq_id, None)
        return self.decref(table) if table else []

    def slot(self, seq_id: str, position: int) -> int:
        return self._tables[seq_id][position // self.page_size] * self.page_size + position % self.page_size

    # ---- checks -----------------------------------------------------------------------------
    def check_invariants(self, external_refs: dict[int, int] | None = None) -> None:
        """Each usable page is free (refcount 0, once in the free list) or referenced exactly as
        many times as sequence tables plus external holders (the prefix cache) hold it."""
        external_refs = external_refs or {}
        free = list(self._free)
        assert len(free) == len(set(free)), "a page is twice in the free list"
        assert NULL_PAGE not in free, "the null page is in the free list"
        expected = [0] * self.num_pages
        for seq_id, table in self._tables.items():
            assert NULL_PAGE not in table, f"sequence {seq_id} owns the null page"
            for p in table:
                expected[p] += 1
        for p, n in external_refs.items():
            assert p != NULL_PAGE, "the prefix cache holds the null page"
            expected[p] += n
        free_set = set(free)
        for p in range(1, self.num_pages):
            assert self._refs[p] == expected[p], f"page {p}: refcount {self._refs[p]}, holders {expected[p]}"
            assert (p in free_set) == (self._refs[p] == 0), f"page {p} is lost or both free and owned"
        assert self._refs[NULL_PAGE] == 0


_EMPTY: list[int] = []
