"""One of two localhost processes sharing a 1x4 mesh (2 CPU devices each); process 0 leads.

    python tests/multihost_worker.py PROCESS_ID PORT OUT.json

The leader generates mesh_worker.PROMPTS greedily and writes the tokens to OUT.json; the
follower runs the leader's steps until released. test_parallel.py compares with the 1x1 tokens.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
sys.path.insert(0, os.path.dirname(__file__))

from jaxserve import distributed  # noqa: E402


def main() -> None:
    process_id, port, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    from mesh_worker import PROMPTS, start

    from jaxserve import SamplingParams

    llm = start(None, "1x4")
    if not distributed.is_leader():
        steps = distributed.follow(llm.engine)
        print(f"follower ran {steps} steps", flush=True)
        return
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.engine.stop_followers()
    devices = [d.process_index for d in llm.engine.runner.mesh.devices.flat]
    with open(out_path, "w") as f:
        json.dump({"tokens": [o.outputs[0].token_ids for o in outs], "devices": devices}, f)


if __name__ == "__main__":
    main()
