"""RadixAttention in the engine: greedy outputs identical with the cache on and off, hits counted."""

from __future__ import annotations

import pytest
from conftest import small_engine_options

from jaxserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines():
    return (LLM(**small_engine_options(enable_prefix_caching=True)),
            LLM(**small_engine_options(enable_prefix_caching=False)))


def workload(tok) -> list[list[int]]:
    system = tok("You are a careful assistant. Answer briefly and precisely, and never invent facts. "
                 "The user asks about geography, history and science.").input_ids  # > 2 pages
    questions = ["What is the capital of Italy?", "Who wrote Hamlet?", "Why is the sky blue?"]
    prompts = [system + tok(q).input_ids for q in questions]
    prompts.append(system[:21])  # a prefix of the others, ending mid-page
    prompts.append(system + tok(questions[0]).input_ids)  # identical repeat
    prompts.append(prompts[0][:40] + tok(" And of France?").input_ids)  # diverges mid-page
    return prompts


def test_cache_on_and_off_give_identical_greedy_outputs(engines):
    on, off = engines
    prompts = workload(on.get_tokenizer())
    ref = [o.outputs[0].token_ids for o in off.generate(prompts, GREEDY, use_tqdm=False)]
    for _ in range(2):  # the second round hits the cache for whole prompts
        outs = on.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
    assert max(o.num_cached_tokens for o in outs) >= 32
    assert all(o.num_cached_tokens < len(o.prompt_token_ids) for o in outs)
    on.engine.check_invariants()


def test_eviction_under_memory_pressure_keeps_outputs_identical():
    tight = LLM(**small_engine_options(num_pages=14, max_model_len=96))
    plain = LLM(**small_engine_options(num_pages=14, max_model_len=96, enable_prefix_caching=False))
    tok = tight.get_tokenizer()
    prompts = [tok(f"Story number {i}: once upon a time there was a small town by the river.").input_ids
               for i in range(8)]
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, GREEDY, use_tqdm=False)] == ref
    assert tight.engine.prefix_cache.evicted_pages > 0
    tight.engine.check_invariants()
    tight.engine.prefix_cache.reset()
    tight.engine.check_invariants()
    assert tight.engine.pool.num_free == tight.engine.num_pages - 1


def test_multi_turn_chat_hits_previous_turn(engines):
    on, _ = engines
    tok = on.get_tokenizer()
    messages = [{"role": "user", "content": "Name a colour."}]
    for turn in range(3):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)
        ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
        out = on.generate([ids], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0]
        if turn > 0:
            # Everything of the previous prompt and answer, up to whole pages, came from the cache.
            assert out.num_cached_tokens >= (prev_len // 16) * 16 - 16, (out.num_cached_tokens, prev_len)
        messages += [{"role": "assistant", "content": out.outputs[0].text},
                     {"role": "user", "content": "Another one."}]
        prev_len = len(ids) + len(out.outputs[0].token_ids)
    stats = on.engine.prefix_cache.stats
    assert stats["hit_tokens"] > 0 and 0 < stats["hit_rate"] <= 1
