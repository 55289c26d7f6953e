"""Data-parallel replicas inside one server (`--mesh 2x1`): a request goes to the replica whose
radix cache holds its longest prefix, unless that replica is more than BALANCE_SLACK requests
busier than the least loaded one. Run in a subprocess with two simulated CPU devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import small_engine_options

from jaxserve.engine.engine import BALANCE_SLACK


def _worker(model: str) -> None:
    from jaxserve import LLM, SamplingParams

    llm = LLM(model=model, **small_engine_options(mesh="2x1", num_pages=64, max_model_len=128))
    engine = llm.engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prefix = [(7 * j) % 200 + 3 for j in range(48)]  # three full pages
    other = [(11 * j) % 200 + 5 for j in range(48)]

    def run(prompts: list[list[int]], tag: str) -> list[dict]:
        reqs = [engine.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
        where = [engine._tracked[r.request_id].replica.index for r in reqs]
        while engine.has_unfinished():
            engine.step()
        return [dict(replica=w, cached=r.num_cached_tokens) for w, r in zip(where, reqs)]

    out = {"first": run([prefix], "a"), "other": run([other], "b")}
    # Both replicas idle: continuations of `prefix` go where it is cached, all of them while that
    # replica is at most BALANCE_SLACK requests busier than the other, the rest to the other one.
    out["burst"] = run([prefix + [9, i] for i in range(BALANCE_SLACK + 4)], "c")
    engine.check_invariants()
    print(json.dumps(out), flush=True)


@pytest.mark.slow
def test_requests_follow_their_prefix_across_replicas(tiny_model):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    code = f"import test_dp_routing as t; t._worker({str(tiny_model)!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    home = out["first"][0]["replica"]
    burst = out["burst"]
    expected, loads = [], {"home": 0, "away": 0}  # the rule, replayed on the burst's loads
    for _ in burst:
        side = "home" if loads["home"] <= loads["away"] + BALANCE_SLACK else "away"
        loads[side] += 1
        expected.append(side == "home")
    assert [b["replica"] == home for b in burst] == expected, burst
    assert sum(expected) > len(burst) // 2 + 1  # not what least-loaded alone would give
    on_home = [b for b in burst if b["replica"] == home]
    assert all(b["cached"] >= 48 for b in on_home), burst  # and find the prefix there
    assert all(b["cached"] == 0 for b in burst if b["replica"] != home), burst
