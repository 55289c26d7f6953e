"""Host-side allocator of the device KV page pool: free list, page tables, reference counts.

Page 0 is the null page: padding tokens write there and no sequence ever owns it (MaxText's paged
attention once gave garbage for any request holding page 0). A page is either free or referenced
by one or more holders: sequence page tables and the prefix cache, each holding one reference.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence

# Same value as jaxserve.attention.NULL_PAGE; not imported from there so this module stays jax-free.
NULL_PAGE = 0


class OutOfPagesError(ValueError):
    """Not enough free pages; the pool is unchanged."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError("num_pages must be at least 2 (page 0 is the reserved null page)")
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(1, num_pages))  # FIFO: allocation order is deterministic
        self._refs = [0] * num_pages
        self._tables: dict[str, list[int]] = {}

    # ---- pages ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_pages(self) -> list[int]:
        """The free list, next to be allocated first."""
        return list(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n fresh pages with one reference each; all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} KV pages, {len(self._free)} free of {self.num_pages - 1}")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def _check_held(self, counts: Counter[int], releasing: bool) -> None:
        # Validate everything before touching any count, so a bad call leaves the pool intact.
        for p, n in counts.items():
            if not NULL_PAGE < p < self.num_pages:
                raise ValueError(f"{p!r} is not a usable page (1..{self.num_pages - 1})")
            if self._refs[p] < (n if releasing else 1):
                raise ValueError(f"page {p} has {self._refs[p]} references, "
                                 f"{'cannot drop ' + str(n) if releasing else 'cannot share a free page'}")

    def incref(self, pages: Iterable[int]) -> None:
        """One more reference on each (already held) page."""
        counts = Counter(int(p) for p in pages)
        self._check_held(counts, releasing=False)
        for p, n in counts.items():
            self._refs[p] += n

    def decref(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference on each page; returns the pages that became free, in order."""
        pages = [int(p) for p in pages]
        self._check_held(Counter(pages), releasing=True)
        freed = []
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                freed.append(p)
        self._free.extend(freed)
        return freed

    def refcount(self, page: int) -> int:
        return self._refs[page]

    # ---- sequences --------------------------------------------------------------------------
    def pages_of(self, seq_id: str) -> list[int]:
        """A copy of the sequence's page table ([] if it has none)."""
        return list(self._tables.get(seq_id, ()))

    def table(self, seq_id: str) -> Sequence[int]:
        """The sequence's page table itself, not a copy (the scheduler reads it for every sequence
        every step): read it, never change it. Growing the table replaces the list, so a table
        read before keeps its old length."""
        return self._tables.get(seq_id, ())

    def num_pages_held(self, seq_id: str) -> int:
        return len(self._tables.get(seq_id, ()))

    def ensure_capacity(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow seq_id's table to hold num_tokens tokens; returns the new pages.
        Raises OutOfPagesError, changing nothing, if the pool cannot."""
        table = self._tables.get(seq_id, [])
        need = -(-num_tokens // self.page_size) - len(table)
        if need <= 0:
            return []
        new = self.allocate(need)
        self._tables[seq_id] = table + new
        return new

    def append_shared(self, seq_id: str, pages: Iterable[int]) -> None:
        """Start (or extend) seq_id's table with pages shared from the prefix cache."""
        pages = [int(p) for p in pages]
        if not pages:
            return
        table = self._tables.get(seq_id, [])
        if len(set(pages)) < len(pages) or set(pages) & set(table):
            raise ValueError(f"sequence {seq_id!r} would hold a page twice")
        self.incref(pages)
        self._tables[seq_id] = table + pages

    def free(self, seq_id: str) -> list[int]:
        """Drop seq_id's references at once; returns pages that became free."""
        table = self._tables.pop(seq_id, None)
        return self.decref(table) if table else []

    def slot(self, seq_id: str, position: int) -> int:
        """Flat KV slot (page * page_size + offset) of token `position` of the sequence."""
        table = self._tables.get(seq_id, ())
        if not 0 <= position < len(table) * self.page_size:
            raise IndexError(f"position {position} is outside the {len(table) * self.page_size} "
                             f"slots of sequence {seq_id!r}")
        return table[position // self.page_size] * self.page_size + position % self.page_size

    # ---- checks -----------------------------------------------------------------------------
    def check_invariants(self, external_refs: dict[int, int] | None = None) -> None:
        """Each usable page is free (refcount 0, once in the free list) or referenced exactly as
        many times as sequence tables plus external holders (the prefix cache) hold it."""
        usable = range(1, self.num_pages)
        free = list(self._free)
        assert len(free) == len(set(free)), "a page is twice in the free list"
        assert all(p in usable for p in free), "the free list holds the null page or a bad page"
        expected = Counter(external_refs or {})
        for seq_id, table in self._tables.items():
            assert len(set(table)) == len(table), f"sequence {seq_id} holds a page twice"
            expected.update(table)
        assert all(p in usable for p in expected), "the null page or a bad page is held"
        assert self._refs[NULL_PAGE] == 0, "the null page has references"
        free_set = set(free)
        for p in usable:
            assert self._refs[p] == expected[p], f"page {p}: refcount {self._refs[p]}, holders {expected[p]}"
            assert (p in free_set) == (self._refs[p] == 0), f"page {p} is lost or both free and owned"
