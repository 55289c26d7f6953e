"""Incremental detokenization that never emits half a UTF-8 character.

Decoding token by token breaks multi-byte characters and the tokenizer's spacing rules, so each
step decodes a short window of recent tokens and emits only the text that the newest token added,
holding it back while it ends in the replacement character (an unfinished byte sequence).
With a fast (Rust) tokenizer that window logic runs inside `tokenizers.decoders.DecodeStream`:
one call per token instead of two Python-side decodes, the engine's largest per-token cost.
"""

from __future__ import annotations

from typing import Any

_WINDOW = 6  # prompt tokens of left context for the first output token's spacing


def _decode_stream(tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool) -> Any:
    """A DecodeStream primed with the prompt's last tokens, or None (a slow tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        from tokenizers.decoders import DecodeStream

        return backend, DecodeStream(ids=list(prompt_ids[-_WINDOW:]), skip_special_tokens=skip_special_tokens)
    except (ImportError, TypeError):  # tokenizers too old to take the prompt's context
        return None


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._stream = _decode_stream(tokenizer, prompt_ids, skip_special_tokens)
        if self._stream is not None:
            self.push = self._push_stream  # type: ignore[method-assign]
            return
        self.ids: list[int] = list(prompt_ids[-_WINDOW:])
        self.prefix_offset = 0  # start of the decode window in self.ids
        self.read_offset = len(self.ids)  # tokens up to here are already in the emitted text

    def _push_stream(self, token_id: int) -> str:
        backend, stream = self._stream
        delta = stream.step(backend, token_id)
        if not delta:
            return ""
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the new text it completes (possibly empty)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset: self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing new yet, or the rest of a character is still to come
        delta = after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.prefix_offset > 256:  # drop consumed ids so the buffer stays bounded
            self.ids = self.ids[self.prefix_offset:]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        self.text += delta
        return delta
