"""Incremental detokenization: deltas add up to the full decode and never split a character."""

from __future__ import annotations

import pytest

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.loading import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.mark.parametrize("text", [
    "Hello, world! This is a plain sentence.",
    "Emoji 🙂🚀 and accents: café, naïve, Zürich.",
    "中文字符和日本語のテキスト、한국어도 있습니다。",
    "  leading spaces,\ttabs\nand new lines\n\n",
])
def test_deltas_concatenate_to_the_full_text(tok, text):
    prompt = tok("Prompt:").input_ids
    ids = tok(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.push(t) for t in ids]
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)
    # Multi-byte characters split over several byte tokens show up whole, once complete.
    if any(ord(c) > 0x7FF for c in text):
        assert any(d == "" for d in deltas) or len(deltas) == len(text)
