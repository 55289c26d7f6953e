"""Incremental detokenization that never emits half a UTF-8 character.

Decoding token by token breaks multi-byte characters and the tokenizer's spacing rules, so each
step decodes a short window of recent tokens and emits only the text that the newest token added,
holding it back while it ends in the replacement character (an unfinished byte sequence).
"""

from __future__ import annotations

from typing import Any

_WINDOW = 6  # prompt tokens of left context for the first output token's spacing


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_WINDOW:])
        self.prefix_offset = 0  # start of the decode window in self.ids
        self.read_offset = len(self.ids)  # tokens up to here are already in the emitted text
        self.text = ""

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
