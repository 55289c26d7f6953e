"""Prompt logprobs (OpenAI's echo + logprobs, what lm-eval's log-likelihood tasks need): computed on
device inside the step, chunk by chunk, equal to HF's log_softmax of its logits."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import hf_logits, make_tiny_checkpoint, small_engine_options

from jaxserve import LLM, SamplingParams

PROMPT = [3 + (i * 11) % 240 for i in range(150)]  # three chunks at a 64-token budget
TOP = 5


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(make_tiny_checkpoint("llama3", tmp_path_factory.mktemp("tiny_plp")))


@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(model=tiny_path, **small_engine_options())


@pytest.fixture(scope="module")
def reference(tiny_path):
    """HF's log_softmax over its logits: row j-1 scores prompt token j."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    return torch.log_softmax(torch.tensor(hf_logits(hf, PROMPT)), -1).numpy()


def check_against(entries, ref: np.ndarray, prompt=PROMPT, top=TOP) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for j in range(1, len(prompt)):
        entry, row = entries[j], ref[j - 1]
        assert next(iter(entry)) == prompt[j]  # the prompt token first, as vLLM
        assert len(entry) in (top, top + 1)  # and the top-n, which may include it
        for t, lp in entry.items():
            assert lp == pytest.approx(float(row[t]), abs=1e-4)
        kth = np.sort(row)[-top]
        assert all(row[t] >= kth - 1e-4 for t in entry if t != prompt[j])


def test_prompt_logprobs_match_hf_across_chunks(llm, reference):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP),
                       use_tqdm=False)[0]
    check_against(out.prompt_logprobs, reference)
    assert out.num_cached_tokens == 0
    # A second run: the prompt is in the prefix cache now, but rows it skips would have no logprobs.
    again = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP),
                         use_tqdm=False)[0]
    assert again.prompt_logprobs == out.prompt_logprobs and again.num_cached_tokens == 0
    llm.engine.check_invariants()


def test_prompt_logprobs_beside_ordinary_requests_change_nothing_else(llm, reference):
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    others = [PROMPT[:30], PROMPT[40:120]]
    alone = [o.outputs[0].token_ids for o in llm.generate(others, greedy, use_tqdm=False)]
    want = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([others[0], PROMPT, others[1]], [greedy, want, greedy], use_tqdm=False)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone
    assert outs[0].prompt_logprobs is None and outs[2].prompt_logprobs is None
    entries = outs[1].prompt_logprobs
    assert all(len(e) == 1 for e in entries[1:])  # prompt_logprobs=0: the prompt token alone
    for j in range(1, len(PROMPT)):
        assert entries[j][PROMPT[j]] == pytest.approx(float(reference[j - 1][PROMPT[j]]), abs=1e-4)
    llm.engine.check_invariants()


def test_prompt_logprobs_with_n_siblings_and_under_preemption(tiny_path, reference):
    tight = LLM(model=tiny_path, **small_engine_options(num_pages=15))
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True, prompt_logprobs=TOP, n=3)
    out = tight.generate([PROMPT], params, use_tqdm=False)[0]
    check_against(out.prompt_logprobs, reference)
    assert tight.engine.scheduler.num_preemptions > 0
    # Each sibling reports the same prompt logprobs (forked ones take the shared rows' entries).
    engine = tight.engine
    for i in range(3):
        engine.add_request(f"s-{i}", PROMPT, params, seed_offset=i, group_id="s")
    firsts = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.prompt_logprobs is not None:
                assert o.request_id not in firsts  # carried by the first output only
                firsts[o.request_id] = o.prompt_logprobs
    assert sorted(firsts) == ["s-0", "s-1", "s-2"]
    assert firsts["s-1"] == firsts["s-0"] == firsts["s-2"]
    check_against(firsts["s-0"], reference)
    engine.check_invariants()


def test_no_compilation_after_warmup_with_prompt_logprobs(tiny_path):
    llm = LLM(model=tiny_path, **small_engine_options(compile_ahead=True))
    rng = np.random.default_rng(0)
    for batch in (1, 4, 9):
        prompts = [PROMPT[: int(n)] for n in rng.integers(2, 150, batch)]
        params = [SamplingParams(max_tokens=int(rng.integers(1, 6)), temperature=0.0,
                                 prompt_logprobs=[None, 0, 3][int(rng.integers(3))]) for _ in prompts]
        outs = llm.generate(prompts, params, use_tqdm=False)
        for o, p in zip(outs, params):
            assert (o.prompt_logprobs is None) == (p.prompt_logprobs is None)
    assert llm.engine.compiles_after_warmup == 0
