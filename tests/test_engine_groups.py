"""n > 1: the siblings of a group prefill the prompt once and fork, sharing its full pages, and
never hold up other users' requests."""

from __future__ import annotations

import pytest
from conftest import make_tiny_checkpoint, small_engine_options

from jaxserve.config import EngineConfig
from jaxserve.engine.engine import LLMEngine
from jaxserve.sampling_params import SamplingParams

PROMPT = [3 + (i * 7) % 250 for i in range(100)]  # 6 full pages and a 4-token tail at page_size 16
SAMPLED = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(make_tiny_checkpoint("llama3", tmp_path_factory.mktemp("tiny_groups")))


def make_engine(path: str, **kw) -> LLMEngine:
    # Synchronous: these tests count the steps a request takes, and with overlapped scheduling
    # a step's results come back from the next call (test_engine_overlap covers that engine).
    kw.setdefault("async_scheduling", False)
    opts = small_engine_options(max_num_seqs=32, **kw)
    opts.pop("show_progress")
    return LLMEngine(EngineConfig(model=path, **opts), show_progress=False)


def run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams, int, str | None]]):
    """Add (id, prompt, params, seed offset, group) requests, step to the end; returns the final
    outputs by id, the step each finished at, and the number of steps that ran."""
    for rid, prompt, params, offset, group in requests:
        engine.add_request(rid, prompt, params, seed_offset=offset, group_id=group)
    start, final, done_at = len(engine.step_timings), {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
                done_at[out.request_id] = len(engine.step_timings) - start
    engine.check_invariants()
    # Idle: every page is free or held once by the prefix cache.
    cached = engine.prefix_cache.cached_pages() if engine.prefix_cache is not None else 0
    assert engine.pool.num_free + cached == engine.num_pages - 1
    return final, done_at, len(engine.step_timings) - start


def group(name: str, n: int, prompt=PROMPT, params=SAMPLED):
    return [(f"{name}-{i}", prompt, params, i, name) for i in range(n)]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n16_takes_about_the_steps_of_n1_and_matches_each_seed_alone(tiny_llama, prefix_caching):
    engine = make_engine(tiny_llama, enable_prefix_caching=prefix_caching)
    alone = {}
    for i in range(16):
        final, _, steps_one = run(engine, [(f"alone-{i}", PROMPT, SAMPLED, i, None)])
        alone[i] = final[f"alone-{i}"].outputs[0].token_ids
        if engine.prefix_cache is not None:
            engine.prefix_cache.reset()  # each reference run computes the whole prompt
    final, _, steps_group = run(engine, group("g", 16))
    # n = 1: 2 prefill steps (64 + 36 tokens) and 7 decodes. The group adds one step: the
    # siblings' 4-token tails run beside the first sibling's first decode.
    assert steps_group <= steps_one + 1, (steps_group, steps_one)
    for i in range(16):
        assert final[f"g-{i}"].outputs[0].token_ids == alone[i], i
    assert len({tuple(final[f"g-{i}"].outputs[0].token_ids) for i in range(16)}) > 1


def test_other_users_requests_are_not_held_behind_a_group(tiny_llama):
    engine = make_engine(tiny_llama)
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    others = [(f"user-{k}", [5 + k, 9, 11], short, 0, None) for k in range(4)]
    _, alone_at, _ = run(engine, others[:1])
    _, done_at, _ = run(engine, group("big", 16) + others)
    # Alone a 2-token request takes 2 steps. Queued behind 16 siblings it starts in step 2, once
    # the first sibling's 64-token chunk no longer takes the whole budget: the other siblings
    # wait for their group's prompt without blocking the queue.
    assert alone_at["user-0"] == 2
    assert all(done_at[f"user-{k}"] <= 3 for k in range(4)), done_at


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_siblings_under_preemption_keep_their_outputs(tiny_llama, prefix_caching):
    # 14 usable pages: the 7-page prompt plus four siblings' tails and growth do not all fit.
    engine = make_engine(tiny_llama, enable_prefix_caching=prefix_caching, num_pages=15)
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=11, ignore_eos=True)
    alone = {}
    for i in range(4):
        final, _, _ = run(engine, [(f"a{i}", PROMPT, params, i, None)])
        alone[i] = final[f"a{i}"].outputs[0].token_ids
    final, _, _ = run(engine, group("p", 4, params=params))
    assert engine.scheduler.num_preemptions > 0
    for i in range(4):
        assert final[f"p-{i}"].outputs[0].token_ids == alone[i], i


def test_short_prompt_groups_and_aborts_leave_the_pool_clean(tiny_llama):
    engine = make_engine(tiny_llama)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    # A prompt shorter than a page has nothing to share: siblings compute it side by side.
    final, _, _ = run(engine, group("s", 3, prompt=[7, 8, 9], params=greedy))
    assert len({tuple(o.outputs[0].token_ids) for o in final.values()}) == 1
    # Aborting the sibling that computes the prompt hands the work to another one.
    for rid, prompt, params, offset, gid in group("x", 4, params=greedy):
        engine.add_request(rid, prompt, params, seed_offset=offset, group_id=gid)
    engine.step()
    engine.abort("x-0")
    final, _, _ = run(engine, [])
    assert sorted(final) == ["x-1", "x-2", "x-3"]
    assert len({tuple(o.outputs[0].token_ids) for o in final.values()}) == 1


def test_siblings_share_full_prompt_pages_and_recompute_only_the_tail():
    """Scheduler alone (no model): the fork's page references and what each sibling computes."""
    import numpy as np

    from jaxserve.cache.page_pool import PagePool
    from jaxserve.engine.buckets import Buckets
    from jaxserve.engine.request import Request
    from jaxserve.engine.scheduler import Scheduler

    ps = 16
    pool = PagePool(64, ps)
    sched = Scheduler(pool, Buckets.create(64, 8, 16), max_num_seqs=8, max_num_batched_tokens=64,
                      history_len=256, prefix_cache=None)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    sibs = [Request(f"g-{i}", PROMPT, params, 4, seed=i, group_id="g") for i in range(4)]
    other = Request("other", [1, 2, 3], params, 4, seed=0)
    for r in sibs + [other]:
        sched.add(r)

    def step():
        plan = sched.schedule()
        sched.update(plan, np.ones(len(plan.seqs), np.int32))
        return {s.request.request_id: (s.start, s.num_tokens) for s in plan.seqs}

    assert step() == {"g-0": (0, 64)}  # the budget goes to the first sibling's first chunk
    assert step() == {"g-0": (64, 36), "other": (0, 3)}  # the others wait; "other" does not
    shared = pool.pages_of("g-0")[:6]
    got = step()
    assert got["g-0"] == (100, 1) and all(got[f"g-{i}"] == (96, 4) for i in (1, 2, 3))
    for i in (1, 2, 3):
        assert pool.pages_of(f"g-{i}")[:6] == shared and pool.pages_of(f"g-{i}")[6] not in pool.pages_of("g-0")
    assert all(pool.refcount(p) == 4 for p in shared)
    pool.check_invariants()
    while sched.has_work():
        step()
    pool.check_invariants()
    assert pool.num_free == pool.num_pages - 1
