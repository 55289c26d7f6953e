"""RadixAttention prefix cache: a radix tree over token ids whose edges hold KV pages.

Page-granular: every edge is a whole number of pages, so a partial last page (still being
written) is never shared. The tree holds one pool reference per page it stores; requests using a
node lock it (and its ancestors), and only unlocked leaves are evicted, least recently used first.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Sequence

from jaxserve.cache.page_pool import PagePool

if TYPE_CHECKING:
    from jaxserve.cache.kv_events import KVEventRecorder, RawEvent


class _Node:
    __slots__ = ("key", "pages", "hashes", "children", "parent", "lock", "last_access")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: "_Node | None"):
        self.key = key  # tokens on the edge from the parent
        self.pages = pages
        self.hashes: list | None = None  # block hash of each page (KV events only); replaced, never mutated
        self.children: dict[tuple[int, ...], _Node] = {}  # keyed by the first page of tokens
        self.parent = parent
        self.lock = 0
        self.last_access = 0


class RadixCache:
    def __init__(self, pool: PagePool, events: "KVEventRecorder | None" = None):
        self.pool = pool
        self.events = events
        if events is not None:
            events.snapshot = self.snapshot_events
        self.page_size = pool.page_size
        self.root = _Node((), [], None)
        self._clock = itertools.count(1)
        self.queries = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evicted_pages = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def stats(self) -> dict[str, float]:
        return dict(queries=self.queries, query_tokens=self.query_tokens, hit_tokens=self.hit_tokens,
                    hit_rate=self.hit_rate, evicted_pages=self.evicted_pages, cached_pages=self.cached_pages())

    # ---- lookup -----------------------------------------------------------------------------
    def _common_pages(self, key: tuple[int, ...], tokens: Sequence[int], start: int, limit: int) -> int:
        """Tokens (a multiple of page_size) that key shares with tokens[start:limit]."""
        ps, n = self.page_size, 0
        while n < len(key) and start + n + ps <= limit and tuple(tokens[start + n: start + n + ps]) == key[n: n + ps]:
            n += ps
        return n

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut child's edge after n tokens; returns the new middle node."""
        parent = child.parent
        k = n // self.page_size
        mid = _Node(child.key[:n], child.pages[:k], parent)
        mid.lock, mid.last_access = child.lock, child.last_access
        child.key, child.pages, child.parent = child.key[n:], child.pages[k:], mid
        if child.hashes is not None:
            mid.hashes, child.hashes = child.hashes[:k], child.hashes[k:]
        mid.children[child.key[: self.page_size]] = child
        parent.children[mid.key[: self.page_size]] = mid
        return mid

    def _walk(self, tokens: Sequence[int], limit: int, split: bool) -> tuple[_Node, int, list[int]]:
        node, i, pages = self.root, 0, []
        ps = self.page_size
        while i + ps <= limit:
            child = node.children.get(tuple(tokens[i: i + ps]))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, i, limit)
            if n < len(child.key):
                if not split:
                    pages += child.pages[: n // ps]
                    i += n
                    break
                child = self._split(child, n)
            pages += child.pages
            i += n
            node = child
        return node, i, pages

    def match_prefix(self, token_ids: Sequence[int], max_tokens: int | None = None,
                     peek: bool = False) -> tuple[list[int], int, _Node]:
        """Longest cached page-aligned prefix (of at most max_tokens tokens): (pages, tokens, node).
        peek: no stats, no LRU touch, no split; the node is then only approximate."""
        limit = len(token_ids) if max_tokens is None else min(len(token_ids), max_tokens)
        limit -= limit % self.page_size
        node, n, pages = self._walk(token_ids, limit, split=not peek)
        if not peek:
            self.queries += 1
            self.query_tokens += len(token_ids)
            self.hit_tokens += n
            now = next(self._clock)
            walk = node
            while walk is not None:
                walk.last_access = now
                walk = walk.parent
        return pages, n, node

    # ---- locking ----------------------------------------------------------------------------
    def lock(self, node: _Node) -> None:
        while node is not None:
            node.lock += 1
            node = node.parent

    def unlock(self, node: _Node) -> None:
        # Ancestors are locked at least as often as node, so checking node alone keeps counts >= 0.
        if node.lock <= 0:
            raise ValueError("unlock of an unlocked node")
        while node is not None:
            node.lock -= 1
            node = node.parent

    # ---- insertion and eviction -------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], pages: list[int]) -> int:
        """Insert a page-aligned prefix; returns how many leading tokens were already cached (the
        tree keeps its own pages there and adopts, with a reference, only the caller's rest)."""
        if len(token_ids) != len(pages) * self.page_size:
            raise ValueError(f"insert needs whole pages: {len(token_ids)} tokens for {len(pages)} pages")
        node, n, _ = self._walk(token_ids, len(token_ids), split=True)
        now = next(self._clock)
        if n < len(token_ids):
            rest = pages[n // self.page_size:]
            self.pool.incref(rest)
            leaf = _Node(tuple(token_ids[n:]), list(rest), node)
            node.children[leaf.key[: self.page_size]] = leaf
            if self.events is not None:
                # ~5 us a page (sha256_cbor), only with KV events on; the publisher thread encodes.
                parent = node.hashes[-1] if node is not self.root else None
                leaf.hashes = self.events.hasher.chain(parent, leaf.key, self.page_size)
                self.events.stored(leaf.hashes, parent, leaf.key, self.page_size)
            node = leaf
        while node is not None:
            node.last_access = now
            node = node.parent
        return n

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and node is not self.root:
                out.append(node)
        return out

    def evict(self, num_pages: int, record: bool = True) -> int:
        """Evict unlocked leaves, LRU first, until num_pages pages returned to the pool's free list
        (pages that running sequences still hold leave the tree without becoming free).
        record=False: no BlockRemoved events (reset sends AllBlocksCleared instead)."""
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, node = heapq.heappop(heap)
            freed += len(self.pool.decref(node.pages))
            self.evicted_pages += len(node.pages)
            if record and self.events is not None:
                self.events.removed(node.hashes)
            parent = node.parent
            del parent.children[node.key[: self.page_size]]
            if parent is not self.root and not parent.children and parent.lock == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> int:
        """Evict everything that is not locked; returns pages freed."""
        # Nothing locked (the root counts every lock): the whole tree goes, one AllBlocksCleared says
        # so. Otherwise the locked paths stay and each evicted node is reported as removed.
        clear_all = self.events is not None and self.root.lock == 0 and bool(self.root.children)
        freed = self.evict(self.pool.num_pages, record=not clear_all)
        if clear_all:
            self.events.cleared()
        return freed

    # ---- introspection ----------------------------------------------------------------------
    def snapshot_events(self) -> "list[RawEvent]":
        """The whole tree as BlockStored events, parents first (a KV-event resync)."""
        out, queue = [], list(self.root.children.values())
        for node in queue:  # breadth first: the list grows as it is read
            parent = node.parent.hashes[-1] if node.parent is not self.root else None
            out.append(("stored", node.hashes, parent, node.key, self.page_size))
            queue.extend(node.children.values())
        return out

    def block_hashes(self) -> set[int]:
        """Every page's block hash as events carry it (KV events on): what a subscriber rebuilds."""
        external = self.events.hasher.external
        return {external(h) for n in self._nodes() for h in n.hashes}

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def cached_pages(self) -> int:
        return sum(len(n.pages) for n in self._nodes())

    def evictable_pages(self) -> int:
        """Pages in subtrees that no request locks."""
        return sum(len(n.pages) for n in self._nodes() if n.lock == 0)

    def external_refs(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for n in self._nodes():
            for p in n.pages:
                refs[p] = refs.get(p, 0) + 1
        return refs

    def check_invariants(self) -> None:
        """Locks consistent along paths, edges whole pages, each tree page held in the pool once."""
        assert self.root.key == () and not self.root.pages, "the root holds tokens"
        free = set(self.pool.free_pages())
        seen: set[int] = set()
        for n in [self.root, *self._nodes()]:
            assert n.lock >= 0, "negative lock count"
            # Each lock of a node also locks every ancestor: a node counts at least its children's.
            assert n.lock >= sum(c.lock for c in n.children.values()), "a parent is locked less than its children"
            for first, c in n.children.items():
                assert c.parent is n and c.key[: self.page_size] == first, "child linked or keyed wrongly"
            if n is self.root:
                continue
            assert len(n.key) == len(n.pages) * self.page_size and n.pages, "edge is not whole pages"
            if self.events is not None:
                parent = n.parent.hashes[-1] if n.parent is not self.root else None
                assert n.hashes == self.events.hasher.chain(parent, n.key, self.page_size), "stale block hashes"
            for p in n.pages:
                assert p not in seen, f"page {p} twice in the tree"
                seen.add(p)
                assert self.pool.refcount(p) >= 1 and p not in free, f"tree page {p} is free in the pool"
