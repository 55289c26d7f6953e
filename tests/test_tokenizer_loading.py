"""The default model's tokenizer, rebuilt from GGUF metadata without torch, gives transformers' ids."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from jaxserve.loading import default_model_path
from jaxserve.loading.gguf_tokenizer import build_bpe_tokenizer

TEXTS = [
    "The capital of France is",
    " leading space and  double  spaces",
    "Emoji 🙂🚀, accents café naïve, CJK 中文字符 日本語 한국어",
    "code: def f(x):\n\treturn x**2  # comment\r\n",
    "numbers 3.14159 1234567 -42 1e-9, and don't we'll they're",
    "<|im_start|>user\nhello<|im_end|>\n<|endoftext|><repo_name>x<file_sep>",  # special tokens in text
    "<|im_start|", "\n\n\n", "", "   ",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? 🙂"}]


@pytest.fixture(scope="module")
def both():
    """(transformers' GGUF tokenizer, which imports torch; ours)."""
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name), build_bpe_tokenizer(path)


@pytest.mark.parametrize("text", TEXTS)
def test_same_ids_and_text(both, text):
    ref, ours = both
    ids = ref(text).input_ids
    assert ours(text).input_ids == ids
    assert ours(text, add_special_tokens=False).input_ids == ref(text, add_special_tokens=False).input_ids
    assert ours.decode(ids) == ref.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_same_chat_template_and_special_tokens(both):
    ref, ours = both
    for messages in (CHAT, CHAT[1:2]):  # with a system message, and the template's default one
        for gen in (True, False):
            a = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
            b = ours.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
            assert list(b["input_ids"]) == list(a["input_ids"])
            assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == \
                ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id",
                 "pad_token_id", "all_special_ids"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    assert len(ours) == len(ref) == 49152
    assert ours.convert_ids_to_tokens(list(range(20))) == ref.convert_ids_to_tokens(list(range(20)))


def test_builds_with_torch_blocked(tmp_path):
    """load_tokenizer on a fresh cache with `import torch` made to fail, as in a venv without torch."""
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # any import of torch now raises ImportError
        from jaxserve.loading import load_tokenizer
        tok = load_tokenizer(None)
        print(tok("Hello <|im_end|>").input_ids)
        tok2 = load_tokenizer(None)  # the cached copy
        assert tok2("Hello <|im_end|>").input_ids == tok("Hello <|im_end|>").input_ids
    """)
    env = {"JAXSERVE_CACHE_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[19556, 216, 2]"
    assert list((tmp_path / "tokenizers").iterdir()), "the tokenizer was not cached"
