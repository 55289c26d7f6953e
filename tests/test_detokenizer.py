"""Incremental detokenization: deltas add up to the full decode and never split a character."""

from __future__ import annotations

import pytest

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.loading import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


class SlowTokenizer:
    """The tokenizer without its Rust backend: the Python window path."""

    def __init__(self, tok):
        self.decode = tok.decode


@pytest.mark.parametrize("fast", [True, False], ids=["decode-stream", "python-window"])

@pytest.mark.parametrize("text", [
    "Hello, world! This is a plain sentence.",
    "Emoji 🙂🚀 and accents: café, naïve, Zürich.",
    "中文字符和日本語のテキスト、한국어도 있습니다。",
    "  leading spaces,\ttabs\nand new lines\n\n",
])
def test_deltas_concatenate_to_the_full_text(tok, text, fast):
    prompt = tok("Prompt:").input_ids
    ids = tok(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok if fast else SlowTokenizer(tok), prompt)
    assert (detok._stream is not None) == fast
    deltas = [detok.push(t) for t in ids]
    assert "".join(deltas) == tok.decode(ids) == detok.text
    assert all("\ufffd" not in d for d in deltas)
    # After each token the text so far is a prefix of the full decode up to it; all of it once no
    # character is unfinished. A character split over byte tokens is held back (an empty delta) until
    # its last byte, then shows up whole.
    held = 0
    for i in range(len(ids)):
        full, so_far = tok.decode(ids[: i + 1]), "".join(deltas[: i + 1])
        if full.endswith("\ufffd"):
            held += 1
            assert deltas[i] == "" and full.startswith(so_far), (i, deltas[: i + 1], full)
        else:
            assert so_far == full, (i, deltas[: i + 1], full)
    if any(ord(c) > 0x7FF for c in text):  # emoji and CJK here take several byte-level tokens each
        assert held > 0, "no character was split over tokens: the hold-back path went untested"
