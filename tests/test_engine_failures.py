"""A request whose inputs cannot be prepared fails alone; cached_tokens is what the first admission
got from the prefix cache, preemptions or not."""

from __future__ import annotations

import pytest
from conftest import make_tiny_checkpoint, small_engine_options

from jaxserve import LLM, SamplingParams
from jaxserve.cache.page_pool import PagePool
from jaxserve.cache.radix_cache import RadixCache
from jaxserve.engine.buckets import Buckets
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[3 + (i * k) % 200 for i in range(n)] for k, n in ((3, 40), (5, 90), (7, 12))]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(model=str(make_tiny_checkpoint("llama3", tmp_path_factory.mktemp("tiny_fail"))),
               **small_engine_options())


@pytest.fixture(scope="module")
def reference(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("fail_after", [0, 3])  # at admission, or mid-decode with tokens out already
def test_a_request_whose_inputs_fail_is_aborted_alone(llm, reference, monkeypatch, fail_after):
    poison = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, seed=123456)
    original = Scheduler._fill_sampling

    def fill(self, samp, i, req):
        if req.params is poison and len(req.output_token_ids) >= fail_after:
            raise OverflowError("Python int too large to convert to C int")
        return original(self, samp, i, req)

    monkeypatch.setattr(Scheduler, "_fill_sampling", fill)
    outs = llm.generate(PROMPTS[:2] + [PROMPTS[1]] + PROMPTS[2:], [GREEDY, GREEDY, poison, GREEDY], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:2] + outs[3:]] == reference
    bad = outs[2]
    assert bad.outputs[0].finish_reason == "abort" and "OverflowError" in bad.error
    assert len(bad.outputs[0].token_ids) == fail_after
    assert all(o.error is None for o in outs[:2] + outs[3:])
    llm.engine.check_invariants()
    assert not llm.engine.has_unfinished() and not llm.engine._tracked


def test_values_past_int32_do_not_reach_the_device_arrays(llm):
    """The issue's poison values: top_k past the vocabulary is no top-k; a stop id no vocabulary
    holds bans nothing. They used to raise OverflowError in the step, failing the whole batch.
    SamplingParams refuses them now; set afterwards, they still reach the engine."""
    base = dict(max_tokens=6, temperature=1.0, seed=9, ignore_eos=True)
    plain = llm.generate([PROMPTS[0]], SamplingParams(**base), use_tqdm=False)[0].outputs[0].token_ids
    big_k, big_stop = SamplingParams(**base), SamplingParams(**base, min_tokens=2)
    big_k.top_k, big_stop.stop_token_ids = 1099511627776, [1099511627776]
    outs = llm.generate([PROMPTS[0]] * 2, [big_k, big_stop], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [plain, plain]
    assert all(o.error is None for o in outs)
    llm.engine.check_invariants()


def test_async_engine_delivers_the_failure_and_keeps_serving(llm, monkeypatch):
    import asyncio

    from jaxserve.engine.async_engine import AsyncEngine

    poison = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, seed=77)
    original = Scheduler._fill_sampling

    def fill(self, samp, i, req):
        if req.params is poison:
            raise OverflowError("boom")
        return original(self, samp, i, req)

    monkeypatch.setattr(Scheduler, "_fill_sampling", fill)
    engine = AsyncEngine(engine=llm.engine)

    async def last(prompt, params):
        out = None
        async for out in engine.generate(prompt, params):
            pass
        return out

    async def main():
        return await asyncio.gather(last(PROMPTS[0], GREEDY), last(PROMPTS[1], poison), last(PROMPTS[2], GREEDY))

    try:
        good1, bad, good2 = asyncio.run(main())
    finally:
        engine.shutdown()
    assert bad.finished and bad.outputs[0].finish_reason == "abort" and "boom" in bad.error
    assert good1.error is None and len(good1.outputs[0].token_ids) == 12 and len(good2.outputs[0].token_ids) == 12
    llm.engine.check_invariants()


# ---- cached_tokens ----------------------------------------------------------------------------

def fake_step(sched: Scheduler) -> list[Request]:
    """Schedule one step and feed it token 1 for every sampling row (no model needed)."""
    import numpy as np

    plan = sched.schedule()
    if plan is None:
        return []
    sched.update(plan, np.ones(len(plan.seqs), np.int32))
    return [s.request for s in plan.seqs]


def test_cached_tokens_are_those_of_the_first_admission_despite_preemption():
    ps = 4
    pool = PagePool(1 + 2 + 4, ps)  # the cached 2-page prefix and 4 pages to share out
    cache = RadixCache(pool)
    sched = Scheduler(pool, Buckets.create(64, 4, 16), max_num_seqs=4, max_num_batched_tokens=64,
                      history_len=64, prefix_cache=cache)
    prefix = list(range(10, 18))
    pages = pool.allocate(2)
    cache.insert(prefix, pages)
    pool.decref(pages)  # the cache alone holds them now

    def request(rid: str, prompt: list[int], max_tokens: int) -> Request:
        return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                       max_tokens, seed=0)

    hog = request("hog", list(range(50, 58)), 8)  # admitted first, so the other one is the preemption victim
    user = request("user", prefix + [30, 31, 32], 6)
    sched.add(hog)
    sched.add(user)
    for _ in range(60):
        fake_step(sched)
        assert user.num_cached_tokens == 8  # from the first admission on, whatever happens since
        pool.check_invariants(cache.external_refs())
        if not sched.has_work():
            break
    assert user.num_preemptions >= 1 and user.is_finished and hog.is_finished
    assert user.status == RequestStatus.FINISHED and len(user.output_token_ids) == 6
