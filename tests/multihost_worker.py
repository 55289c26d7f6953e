"""One of two localhost processes (2 CPU devices each) sharing meshes over both; process 0 leads.

    python tests/multihost_worker.py PROCESS_ID PORT OUT_DIR MESH [MESH ...]

For each mesh the leader generates mesh_worker.PROMPTS greedily (with one keep-alive sent to the
idle followers first) and the follower runs the leader's steps until released. Each process writes
OUT_DIR/process<ID>.json; test_parallel.py compares the leader's tokens with the 1x1 tokens.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
sys.path.insert(0, os.path.dirname(__file__))

from jaxserve import distributed  # noqa: E402


def main() -> None:
    process_id, port, out_dir, meshes = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
    distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    from mesh_worker import PROMPTS, start

    from jaxserve import SamplingParams

    results = {}
    for mesh in meshes:
        llm = start(None, mesh, compile_ahead=True)  # also compiles the broadcasts ahead
        engine = llm.engine
        if not distributed.is_leader():
            steps = distributed.follow(engine)
            results[mesh] = {"steps": steps, "compiles_after_warmup": engine.compiles_after_warmup}
            continue
        engine.broadcaster.keep_alive_seconds = 0
        engine.keep_followers_alive()  # what an idle server sends
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=5)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        engine.stop_followers()
        results[mesh] = {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "replica_processes": [sorted(d.process_index for d in r.runner.mesh.devices.flat)
                                  for r in engine.replicas],
            "requests_per_replica": [r.num_requests for r in engine.replicas],
            "compiles_after_warmup": engine.compiles_after_warmup,
        }
    with open(os.path.join(out_dir, f"process{process_id}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
