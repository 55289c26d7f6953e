"""Speculative decoding: where draft tokens come from, and what verifying them yielded.

A decoding sequence with d draft tokens becomes a (1 + d)-token row of the ordinary ragged step:
its inputs are its last token and the drafts, and the sampler draws a token at each of the 1 + d
positions, keyed by (seed, output index) exactly as without speculation. Draft j is accepted when
the token drawn at the position before it equals it; the sequence gains the accepted drafts and
the token drawn after the last of them. For a draft that is a single proposed token (every source
here proposes tokens, not distributions), "draw from the target, accept if equal, else keep the
draw" is the rejection-sampling rule itself: accepted with probability p(draft), and on rejection
the draw is distributed as p without the draft, renormalized. So outputs follow the target's
distribution exactly, and a seeded request gives the same tokens with speculation on or off.

Draft rows share the step's sample rows with everything else: a step never samples more rows
than `max_num_seqs`, so drafts use only the room that fewer running sequences leave, and under
full load speculation stops by itself, with no new compiled shapes.
"""

from __future__ import annotations

import json
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from jaxserve.engine.request import Request

METHODS = ("ngram", "suffix", "draft_model", "eagle3")
# vLLM's methods not built here (EAGLE-1/2 heads, MTP layers, ...): named so that the error says so.
_NOT_BUILT = ("eagle", "mtp", "medusa", "mlp_speculator")
_NEEDS_MODEL = ("draft_model", "eagle3")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config JSON: {"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2}, or {"method": "suffix", ...} with vLLM's
    suffix_decoding_* fields. `disable_by_batch_size`: no drafts while more sequences than this
    run (vLLM's name). {"method": "draft_model", "model": PATH, ...}: drafts from a smaller
    checkpoint with the target's vocabulary (jaxserve/engine/draft_model.py). {"method": "eagle3",
    "model": PATH, ...}: drafts from an EAGLE-3 head trained for the target (jaxserve/engine/eagle3.py).
    Each request drafts only as far as its own record says a draft is likely
    accepted: position j while p**j >= `min_acceptance`, p its estimated chance that a draft is
    accepted once the ones before it were; with none worth proposing it pauses `backoff_steps`
    steps, then starts afresh."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None  # the draft model's checkpoint (method "draft_model") or the head's ("eagle3")
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = None
    # Suffix decoding: the longest context matched (tokens), finished requests whose outputs are
    # kept for other requests' drafts, drafts at most this factor times the matched length, and
    # the lowest estimated probability (product along the draft) worth proposing.
    suffix_decoding_max_tree_depth: int = 16
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    min_acceptance: float = 0.2
    backoff_steps: int = 32

    @classmethod
    def parse(cls, value: str | dict[str, Any] | None) -> "SpeculativeConfig | None":
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        method = value.get("method", "ngram")
        if method in _NOT_BUILT:
            raise ValueError(f"speculative_config: method {method!r} is not supported yet; supported: {METHODS}")
        if method not in METHODS:
            raise ValueError(f"speculative_config: unknown method {method!r}; supported: {METHODS}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        # One given: the other equals it (as in vLLM); neither: the defaults above.
        if lo is None and hi is not None:
            lo = min(hi, cls.prompt_lookup_min)
        if hi is None and lo is not None:
            hi = max(lo, cls.prompt_lookup_max)
        config = cls(**{**value, "prompt_lookup_min": lo or cls.prompt_lookup_min,
                        "prompt_lookup_max": hi or cls.prompt_lookup_max})
        config.check()
        return config

    def check(self) -> None:
        def positive_int(name: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {v!r}")

        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "suffix_decoding_max_tree_depth"):
            positive_int(name)
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("speculative_config: suffix_decoding_max_cached_requests must be >= 0")
        if not self.suffix_decoding_max_spec_factor > 0:
            raise ValueError("speculative_config: suffix_decoding_max_spec_factor must be > 0")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ValueError("speculative_config: suffix_decoding_min_token_prob must be in [0, 1]")
        if (self.method in _NEEDS_MODEL) != (self.model is not None):
            raise ValueError("speculative_config: 'model' (the draft checkpoint, or the EAGLE-3 head) is required by "
                             "methods 'draft_model' and 'eagle3', and taken by no other method")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative_config: model must be a checkpoint path, got {self.model!r}")
        if self.backoff_steps < 0:
            raise ValueError("speculative_config: backoff_steps must be >= 0")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config: prompt_lookup_min must not exceed prompt_lookup_max")
        if self.disable_by_batch_size is not None:
            positive_int("disable_by_batch_size")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError("speculative_config: min_acceptance must be in [0, 1]")


class DraftProposer(Protocol):
    """A source of draft tokens. `propose` returns at most `limit` tokens that may follow the
    request's tokens (prompt and output); `release` forgets a finished request."""

    def propose(self, req: Request, limit: int) -> list[int]: ...

    def release(self, req: Request) -> None: ...


@dataclass
class _NgramIndex:
    """Per request: for each n, the end (exclusive) of the latest occurrence of every n-gram seen,
    built incrementally: a step adds the n-grams its new tokens complete, O(1) each."""

    by_n: dict[int, dict[tuple[int, ...], int]]
    indexed: int = 0  # n-grams ending before this position are in by_n


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (longest n
    first, from prompt_lookup_max down to prompt_lookup_min) in its own prompt and output, and
    propose the tokens that followed it (a pattern that repeats is continued past the end)."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self._index: dict[str, _NgramIndex] = {}

    def propose(self, req: Request, limit: int) -> list[int]:
        length = req.num_tokens
        if limit <= 0 or length <= self.min_n:
            return []
        index = self._index.get(req.request_id)
        if index is None:
            index = self._index[req.request_id] = _NgramIndex({n: {} for n in range(self.min_n, self.max_n + 1)})
        # Index every n-gram that ends before the last position: the suffix itself must match an
        # earlier occurrence, whose continuation exists.
        start = max(0, index.indexed - self.max_n)
        window = req.token_slice(start, length)
        for end in range(max(index.indexed, self.min_n), length):
            for n, table in index.by_n.items():
                if end >= n:
                    table[tuple(window[end - n - start: end - start])] = end
        index.indexed = max(index.indexed, length)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = index.by_n[n].get(tuple(window[length - n - start:]))
            if end is not None:
                drafts = req.token_slice(end, min(end + limit, length))
                # A match that runs into the suffix itself (a repeating pattern, period
                # length - end) goes on repeating past the end.
                period = length - end
                while len(drafts) < limit:
                    drafts.append(drafts[len(drafts) - period])
                return drafts
        return []

    def release(self, req: Request) -> None:
        self._index.pop(req.request_id, None)


class _ContextCounts:
    """Next-token counts after every context of 1..depth tokens of some token sequences: the
    frequencies a suffix tree over them would hold, kept as one table per context length."""

    def __init__(self, depth: int):
        self.depth = depth
        self.table: dict[tuple[int, ...], Counter] = {}

    def update(self, tokens: list[int], start: int, sign: int = 1) -> None:
        """Count (or, sign -1, forget) the next token after each context ending at positions
        start..len-1 (each position's token follows its preceding contexts)."""
        for pos in range(max(start, 1), len(tokens)):
            nxt = tokens[pos]
            for n in range(1, min(self.depth, pos) + 1):
                key = tuple(tokens[pos - n: pos])
                counts = self.table.get(key)
                if counts is None:
                    if sign < 0:
                        break
                    counts = self.table[key] = Counter()
                counts[nxt] += sign
                if counts[nxt] <= 0:
                    del counts[nxt]
                    if not counts:
                        del self.table[key]


class SuffixProposer:
    """Suffix decoding (the idea of Arctic's SuffixDecoding, on bounded-depth context tables
    rather than suffix trees): the next-token frequencies after the sequence's longest matched
    context, from its own prompt and output and from the outputs of recent finished requests
    (agents repeat themselves across requests). A draft follows the most frequent continuation
    while the product of the estimated probabilities stays >= min_token_prob, and is at most
    max_spec_factor times the matched context length."""

    def __init__(self, config: SpeculativeConfig):
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self.shared = _ContextCounts(self.depth)  # outputs of finished requests
        self._cached: deque[list[int]] = deque()
        self._own: dict[str, tuple[_ContextCounts, list[int]]] = {}  # request -> its counts, tokens

    def propose(self, req: Request, limit: int) -> list[int]:
        if limit <= 0:
            return []
        own = self._own.get(req.request_id)
        if own is None:
            own = self._own[req.request_id] = (_ContextCounts(self.depth), [])
        counts, tokens = own
        indexed = len(tokens)
        tokens += req.token_slice(indexed, req.num_tokens)  # a copy of its tokens, grown by the new ones
        counts.update(tokens, indexed)
        context = tokens[-self.depth:]
        drafts: list[int] = []
        prob = 1.0
        matched = 0
        while len(drafts) < limit:
            best, n = self._continuation(counts, context)
            if best is None:
                break
            if not drafts:
                matched = n
                limit = min(limit, max(1, math.floor(self.spec_factor * matched)))
            token, p = best
            prob *= p
            if prob < self.min_prob:
                break
            drafts.append(token)
            context = (context + [token])[-self.depth:]
        return drafts

    def _continuation(self, own: _ContextCounts, context: list[int]) -> tuple[tuple[int, float] | None, int]:
        """((most frequent next token, its share), context length) for the longest context of
        `context` seen in the request's own tokens or in the shared outputs."""
        for n in range(min(self.depth, len(context)), 0, -1):
            key = tuple(context[-n:])
            a, b = own.table.get(key), self.shared.table.get(key)
            if a is None and b is None:
                continue
            merged = (a or Counter()) + (b or Counter())
            token, count = max(merged.items(), key=lambda kv: (kv[1], -kv[0]))
            return (token, count / sum(merged.values())), n
        return None, 0

    def release(self, req: Request) -> None:
        """A finished request: its output joins the shared counts (the oldest leave past the cap)."""
        self._own.pop(req.request_id, None)
        output = list(req.output_token_ids)
        if self.max_cached == 0 or len(output) < 2:
            return
        self.shared.update(output, 1)
        self._cached.append(output)
        while len(self._cached) > self.max_cached:
            self.shared.update(self._cached.popleft(), 1, sign=-1)


def make_proposer(config: SpeculativeConfig) -> DraftProposer:
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "suffix":
        return SuffixProposer(config)
    # (draft_model: the engine builds it, with the draft model on the target's devices.)
    raise ValueError(f"no proposer for method {config.method!r}")


@dataclass
class SpecDecodeStats:
    """Running totals, vLLM's spec_decode metrics: drafts (sequences verified with at least one
    draft token), draft tokens, accepted tokens, and accepted tokens per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos += [0] * (proposed - len(self.accepted_per_pos))
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verified sequence gains per step: the accepted drafts plus the one drawn after."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def merged(self, other: "SpecDecodeStats") -> "SpecDecodeStats":
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = lambda v: v + [0] * (n - len(v))  # noqa: E731
        return SpecDecodeStats(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                               self.num_accepted_tokens + other.num_accepted_tokens,
                               [a + b for a, b in zip(pad(self.accepted_per_pos), pad(other.accepted_per_pos))])


# Each verification's counts weigh this much less than the next one's: a request's text changes
# (an edit copies, then writes something new), so its recent drafts say more.
_DECAY = 0.9


def draft_limit(req: Request, config: SpeculativeConfig) -> int:
    """How many drafts are worth proposing for this request now: position j while p**j >=
    min_acceptance, where p = (accepted + 1) / (accepted + rejections + 2) from its decayed record
    (a draft is accepted given the ones before it were: 0.5 for a new request, so 2 drafts at
    the default threshold)."""
    p = (req.spec_accepted + 1.0) / (req.spec_accepted + req.spec_rejected + 2.0)
    limit, reach = 0, p
    while limit < config.num_speculative_tokens and reach >= config.min_acceptance:
        limit += 1
        reach *= p
    return limit


def record_verification(req: Request, proposed: int, accepted: int) -> None:
    req.spec_accepted = _DECAY * req.spec_accepted + accepted
    req.spec_rejected = _DECAY * req.spec_rejected + (1 if accepted < proposed else 0)


def accepted_length(drafts: list[int], sampled: Any) -> int:
    """Drafts accepted: the longest prefix where the token drawn at the position before each draft
    equals it (`sampled[j]` is drawn where drafts[j] is the next input)."""
    a = 0
    while a < len(drafts) and int(sampled[a]) == drafts[a]:
        a += 1
    return a
