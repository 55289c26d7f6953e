"""A GGUF file's tokenizer rebuilt from its metadata with `gguf` and `tokenizers` alone.

transformers' own GGUF tokenizer path imports torch (its GGUF reader does), which serving must not
need. Byte-level BPE files (``tokenizer.ggml.model == "gpt2"``: SmolLM, Llama 3, Qwen2, ...) are
built here with the same components transformers' converter chooses, so the ids are the same
(tests/test_tokenizer_loading.py checks it against transformers). Other tokenizer models fall back
to transformers, which then needs torch; the error says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CONTROL = 3  # GGUF token_type for control (special) tokens; 4 is user-defined, 1 normal


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_tokenizer_model(path: Path) -> str | None:
    """The GGUF's tokenizer.ggml.model ("gpt2", "llama", ...), None if it has none."""
    import gguf

    return _field(gguf.GGUFReader(str(path)), "tokenizer.ggml.model")


def build_bpe_tokenizer(path: Path) -> Any:
    """A transformers fast tokenizer (no torch) for a byte-level BPE GGUF."""
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    reader = gguf.GGUFReader(str(path))
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path.name}: tokenizer model {kind!r} is not byte-level BPE")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # The GPT-2 split regex and no prefix space: what transformers' GGUF converter uses for "gpt2".
    add_prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix, trim_offsets=True, use_regex=True)
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    # Control and user-defined tokens match whole in any text (a chat template's <|im_start|>).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
                            if k in (CONTROL, 4)])

    def token(key: str) -> str | None:
        i = _field(reader, key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos = token("tokenizer.ggml.bos_token_id")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False)) and bos is not None
    single = f"{bos}:0 $A:0" if add_bos else "$A:0"
    pair = f"{single} {bos}:1 $B:1" if add_bos else "$A:0 $B:1"
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(bos, vocab[bos])] if add_bos else [])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=token("tokenizer.ggml.eos_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"), pad_token=token("tokenizer.ggml.padding_token_id"),
        chat_template=_field(reader, "tokenizer.chat_template"))
