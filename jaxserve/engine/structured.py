"""Structured output: grammars compiled by llguidance and the per-request matchers that mask tokens.

A request with `SamplingParams.structured_outputs` gets a `Constraint`: an llguidance matcher in the
grammar's start state. Before each step that samples for the request, the scheduler asks it for the
allowed tokens as a packed bitmask row (int32 words, bit t % 32 of word t // 32 set = token t
allowed); the sampler sets the logits of the others to -inf on the device. The sampled token is fed
back with `accept`, and a matcher that can go no further (`finished`) ends the request with "stop".

The mask of step N+1 depends on the token sampled by step N, so a constrained request is never
planned while one of its tokens is still being sampled (see Scheduler.schedule): under overlapped
scheduling it takes every other step.

Compiling a grammar (a JSON schema into llguidance's form, and the matcher's own construction)
can take from a millisecond to a second: `GrammarCompiler` keeps a matcher in the start state per
distinct grammar and hands out deep copies. Front ends call `compile` outside the engine's lock
(AsyncEngine._submit), so that the engine loop only ever copies a cached matcher.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from jaxserve.sampling_params import StructuredOutputsParams

CACHE_SIZE = 256  # distinct grammars kept compiled


def mask_words(vocab_size: int) -> int:
    """int32 words of one packed bitmask row."""
    return (vocab_size + 31) // 32


def grammar_key(so: StructuredOutputsParams) -> tuple[str, str, bool]:
    """What identifies a grammar: its kind and its text (a schema dict canonicalized)."""
    kind = so.kind
    value: Any = getattr(so, kind)
    if kind == "json" and isinstance(value, str):
        value = json.loads(value)  # the same schema as text or as a dict is one grammar
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return kind, text, so.disable_any_whitespace


def _grammar_text(kind: str, text: str, compact: bool) -> str:
    """llguidance's grammar for a key (its JSON form); raises ValueError for what cannot be read."""
    import llguidance as llg

    options = {"whitespace_flexible": False} if compact else None
    if kind == "json":
        return llg.LLMatcher.grammar_from_json_schema(text, overrides=options)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        # A Lark alternative of string literals; JSON's string escapes are Lark's.
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
    if kind == "grammar":
        return llg.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
    raise ValueError(f"unknown structured output kind {kind!r}")


class Constraint:
    """One request's matcher: the mask of its next token and the tokens it has taken."""

    def __init__(self, matcher: Any, vocab_size: int, words: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._full = words  # words of the matcher's own masks (its tokenizer's vocabulary)

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row` (int32, mask_words(vocab_size) long)."""
        if self._full == row.shape[0]:
            self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            return
        # The model's vocabulary is smaller than the tokenizer's: ids past it cannot be sampled.
        buf = np.empty(self._full, np.int32)
        self.matcher.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
        row[:] = buf[: row.shape[0]]
        if self.vocab_size % 32:
            row.view(np.uint32)[-1] &= np.uint32((1 << (self.vocab_size % 32)) - 1)

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar rejects it (the mask allowed it only
        if something upstream overrode the mask)."""
        return bool(self.matcher.consume_token(token))

    @property
    def finished(self) -> bool:
        """No token but end-of-sequence can follow: the output is complete."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""


_executor: Any = None
_executor_lock = threading.Lock()


def fill_masks(rows: list[tuple[int, Constraint]], mask: np.ndarray) -> None:
    """Fill mask[i] for each (i, constraint): several rows on llguidance's thread pool at once
    (a JSON mask costs ~1 ms of host time a row), one row directly."""
    global _executor
    if len(rows) == 1 or any(c._full != mask.shape[1] for _, c in rows):
        for i, c in rows:
            c.fill_mask(mask[i])
        return
    import llguidance as llg
    from llguidance.numpy import fill_next_token_bitmask_par

    with _executor_lock:
        if _executor is None:
            _executor = llg.LLExecutor()
    fill_next_token_bitmask_par(_executor, [(c.matcher, i) for i, c in rows], mask)


class GrammarCompiler:
    """Compiles StructuredOutputsParams against one tokenizer, caching a start-state matcher per
    grammar. Thread-safe: front-end threads compile while the engine loop copies."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._lltok: Any = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Any] = OrderedDict()

    def _llg_tokenizer(self) -> Any:
        """llguidance's view of our tokenizer, built once (~0.2 s for 49k tokens) on first use."""
        with self._lock:
            if self._lltok is None:
                import llguidance as llg

                backend = getattr(self._tokenizer, "backend_tokenizer", None)
                if backend is None:
                    raise ValueError("structured output needs a fast (Rust `tokenizers`) tokenizer")
                # llguidance needs a vocabulary at least the tokenizer's; a model's may be padded wider.
                n_vocab = max(self.vocab_size, backend.get_vocab_size(with_added_tokens=True))
                self._lltok = llg.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=self._eos or None)
            return self._lltok

    def compile(self, so: StructuredOutputsParams) -> Any:
        """The start-state matcher of this grammar (cached). ValueError, naming what is wrong,
        for a schema, regex or grammar llguidance cannot compile."""
        import llguidance as llg

        key = grammar_key(so)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        lltok = self._llg_tokenizer()
        field = f"structured_outputs.{key[0]}"
        try:
            grammar = _grammar_text(*key)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{field}: {exc}") from None
        message = llg.LLMatcher.validate_grammar(grammar, lltok)
        if message and not message.startswith("WARNING"):
            raise ValueError(f"{field} does not compile: {message.strip()}")
        matcher = llg.LLMatcher(lltok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{field} does not compile: {matcher.get_error()}")
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def constraint(self, so: StructuredOutputsParams) -> Constraint:
        """A fresh matcher for one request (a copy of the cached start state)."""
        matcher = self.compile(so).deep_copy()
        return Constraint(matcher, self.vocab_size, mask_words(self._llg_tokenizer().vocab_size))
