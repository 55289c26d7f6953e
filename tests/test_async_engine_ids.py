"""AsyncEngine ids (issue 15, defect 1): server ids are the engine's own, a client's id is a label.

abort(x) ends the request whose label (or server id) is exactly x, all n of its completions, and
nothing else: neither a request labelled "job-1" when x is "job", nor every request whose id
happens to start with "cmpl" or "req" (the old prefix match aborted those and dropped their
streams without a final output, so their consumers waited for ever). A label in flight is
unique: a second request with it is refused. Every stream ends with a finished output. And a
check of the page pool gets in between steps rather than after all the work.

The engine loop steps only while holding ``AsyncEngine._lock``; the tests hold it while they
look at what is in flight and abort, so no request can finish in between (no timing luck).
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import make_tiny_checkpoint, small_engine_options

from jaxserve.config import EngineConfig
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.engine.engine import LLMEngine
from jaxserve.sampling_params import SamplingParams

LONG = 200  # tokens: hundreds of steps, far more than the test needs to look and abort
PROMPT = [5, 9, 11, 13, 17]


@pytest.fixture(scope="module")
def aengine(tmp_path_factory):
    path = str(make_tiny_checkpoint("llama3", tmp_path_factory.mktemp("tiny_ids")))
    opts = small_engine_options(max_num_seqs=4)  # 4 running: the rest of the requests below wait
    opts.pop("show_progress")
    engine = AsyncEngine(engine=LLMEngine(EngineConfig(model=path, **opts), show_progress=False))
    yield engine
    engine.shutdown()


def long_params(n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True, n=n)


class Consumer:
    """Drains one generate() stream into `outputs`; `error` if it raised."""

    def __init__(self, engine: AsyncEngine, label: str | None, params: SamplingParams):
        self.outputs: list = []
        self.error: BaseException | None = None
        self.n = params.n
        self.task = asyncio.ensure_future(self._run(engine, label, params))

    async def _run(self, engine, label, params) -> None:
        try:
            async for out in engine.generate(PROMPT, params, request_id=label):
                self.outputs.append(out)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            self.error = exc

    def finals(self) -> dict[int, object]:
        """The finished output of each completion index."""
        return {o.outputs[0].index: o for o in self.outputs if o.finished}


async def wait_until(cond, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def finish(consumers, timeout: float = 60.0) -> None:
    """Every stream must end by itself (a stream dropped without a final output hangs: a failure)."""
    done, pending = await asyncio.wait([c.task for c in consumers], timeout=timeout)
    for t in pending:
        t.cancel()
    assert not pending, "a stream never ended (no final output)"


def assert_idle(engine: AsyncEngine) -> None:
    counts = engine.check_invariants()
    assert counts["running"] == counts["waiting"] == counts["streams"] == 0, counts
    assert engine.num_in_flight == 0


def test_abort_ends_exactly_the_named_request(aengine):
    # Labels a gRPC client may choose, the HTTP front end's own ids, and an anonymous request
    # (labelled by its server id): 6 requests, 7 sequences, 4 running and the rest waiting.
    labels = ["job", "job-1", "cmpl-0a1b-p0", "req-7", None, "grp", "grp-1"]

    async def main():
        cs = {lab: Consumer(aengine, lab, long_params(2 if lab == "grp" else 1)) for lab in labels}
        await wait_until(lambda: aengine.num_in_flight == 8)
        # Some have tokens already (the running ones); nothing finishes while we hold the lock.
        await wait_until(lambda: sum(1 for c in cs.values() if c.outputs) >= 3)
        with aengine._lock:
            assert aengine.num_in_flight == 8 and not any(c.finals() for c in cs.values())
            for prefix in ("jo", "cmpl", "cmpl-0a1b", "req", "s", "", "grp-", "job-"):  # no request has these
                aengine.abort(prefix)
            aengine.abort("job")  # only "job"
            aengine.abort("grp")  # both completions of "grp", not "grp-1"
        await finish(cs.values())
        return cs

    cs = asyncio.run(main())
    for lab, c in cs.items():
        assert c.error is None, (lab, c.error)
        finals = c.finals()
        assert sorted(finals) == list(range(c.n)), (lab, finals)  # one final output per completion
        # Every output carries the client's label (the anonymous one its server id).
        assert {o.request_id for o in c.outputs} == {lab if lab else c.outputs[0].request_id}, lab
        for f in finals.values():
            if lab in ("job", "grp"):
                assert f.outputs[0].finish_reason == "abort" and len(f.outputs[0].token_ids) < LONG, lab
            else:
                assert f.outputs[0].finish_reason == "length" and len(f.outputs[0].token_ids) == LONG, lab
    assert cs[None].outputs[0].request_id not in labels
    assert_idle(aengine)


def test_a_label_in_flight_is_refused_until_it_finishes(aengine):
    async def main():
        first = Consumer(aengine, "dup", long_params())
        pair = Consumer(aengine, "pair", long_params(2))
        await wait_until(lambda: first.outputs and pair.outputs)
        refused = []
        for label in ("dup", "dup", "pair"):  # twice: a refusal does not free the label either
            c = Consumer(aengine, label, SamplingParams(max_tokens=2))
            await finish([c])
            refused.append(c)
        assert not first.finals() and not pair.finals()  # both were in flight for every refusal
        await finish([first, pair])
        again = Consumer(aengine, "dup", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        await finish([again])
        return first, pair, refused, again

    first, pair, refused, again = asyncio.run(main())
    for c in refused:
        assert isinstance(c.error, ValueError) and "already in use" in str(c.error) and not c.outputs
    assert first.error is None and first.finals()[0].outputs[0].finish_reason == "length"
    assert len(first.finals()[0].outputs[0].token_ids) == LONG
    assert sorted(pair.finals()) == [0, 1] and all(f.outputs[0].finish_reason == "length"
                                                    for f in pair.finals().values())
    assert again.error is None and again.finals()[0].outputs[0].finish_reason == "length"
    assert_idle(aengine)


def test_a_consumer_leaving_aborts_only_its_own_request(aengine):
    """Leaving the loop (a client gone, a cancelled RPC) aborts that request's sequences only:
    the old code did that with the prefix match too ("job" leaving took "job-1" with it)."""
    async def main():
        keep = Consumer(aengine, "job-1", long_params())
        keep_pair = Consumer(aengine, "job-2", long_params(2))
        await wait_until(lambda: keep.outputs and keep_pair.outputs)
        leaving = aengine.generate(PROMPT, long_params(2), request_id="job")
        first = await asyncio.wait_for(leaving.__anext__(), 60)
        with aengine._lock:  # no step until "job" has left: the others are surely in flight
            assert not keep.finals() and not keep_pair.finals()
            await leaving.aclose()  # what a cancelled handler does: its finally aborts the request
        await finish([keep, keep_pair])
        return keep, keep_pair, [first]

    keep, keep_pair, leaver = asyncio.run(main())
    assert len(leaver) == 1 and not leaver[0].finished
    assert keep.error is None and keep.finals()[0].outputs[0].finish_reason == "length"
    assert len(keep.finals()[0].outputs[0].token_ids) == LONG
    assert sorted(keep_pair.finals()) == [0, 1]
    assert all(len(f.outputs[0].token_ids) == LONG for f in keep_pair.finals().values())
    assert_idle(aengine)


def test_invariants_are_checked_between_steps_not_once_the_work_is_done(aengine):
    """check_invariants (the servers' /debug/pages) waits for the lock the loop holds around each
    step; the loop re-took a plain Lock at once, so a check while requests ran used to wait until
    they had all finished (seconds under load; tests polling "running" never saw it)."""
    async def main():
        c = Consumer(aengine, "busy", long_params())
        await wait_until(lambda: c.outputs)
        counts = [await asyncio.to_thread(aengine.check_invariants) for _ in range(20)]
        done_early = bool(c.finals())
        await finish([c])
        return counts, done_early, c

    counts, done_early, c = asyncio.run(main())
    assert not done_early and all(k["running"] == k["streams"] == 1 for k in counts), counts
    assert c.finals()[0].outputs[0].finish_reason == "length"
    assert_idle(aengine)
