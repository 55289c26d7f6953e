"""Shape buckets of the ahead-compiled step functions.

A step is padded to a token bucket T (powers of two from `min_tokens` to 64, then steps of 64, a
quarter of T past 256; `min_tokens` is EngineConfig.min_token_bucket, by default 16 on accelerators
and 1 on CPU, where XLA's dot cost grows with its rows: scripts/bench_small_batch.py) and a
page-table width P (powers of four pages up to the model length). The sequence capacity is tied to
T, S = min(T, max_num_seqs), since a step can never hold more sequences than tokens: one bucket
axis fewer to compile, at the price of sampling a few padding rows.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


def _powers(start: int, factor: int, limit: int) -> list[int]:
    out, v = [], start
    while v < limit:
        out.append(v)
        v *= factor
    out.append(limit)
    return out


@dataclass(frozen=True)
class Buckets:
    token_buckets: tuple[int, ...]
    page_buckets: tuple[int, ...]
    max_num_seqs: int

    @classmethod
    def create(cls, max_num_batched_tokens: int, max_num_seqs: int, max_pages_per_seq: int,
               min_tokens: int = 16) -> "Buckets":
        # Powers of two up to 64, then steps of 64 growing by a quarter past 256: a mixed step
        # (decodes + a prompt chunk) pads by a small fraction instead of up to half its bucket.
        tokens = _powers(min(min_tokens, max_num_batched_tokens), 2, min(64, max_num_batched_tokens))
        t = 64
        while t < max_num_batched_tokens:
            t = min(max_num_batched_tokens, t + max(64, (t // 4) // 64 * 64))
            tokens.append(t)
        tokens = sorted(set(tokens))
        pages = _powers(8, 4, max_pages_per_seq) if max_pages_per_seq > 8 else [max_pages_per_seq]
        return cls(tuple(tokens), tuple(pages), max_num_seqs)

    def seqs_for(self, num_tokens_bucket: int) -> int:
        return min(num_tokens_bucket, self.max_num_seqs)

    def pick(self, num_tokens: int, num_pages: int) -> tuple[int, int, int]:
        """(T, S, P) buckets that fit a step of num_tokens tokens and num_pages pages per sequence."""
        t = self.token_buckets[bisect.bisect_left(self.token_buckets, num_tokens)]
        p = self.page_buckets[bisect.bisect_left(self.page_buckets, max(num_pages, 1))]
        return t, self.seqs_for(t), p

    def all(self) -> list[tuple[int, int, int]]:
        return [(t, self.seqs_for(t), p) for t in self.token_buckets for p in self.page_buckets]
