"""Expert parallelism on 4 simulated CPU devices (XLA_FLAGS must be set before jax loads).

    python tests/moe_mesh_worker.py MODEL_DIR OUT.json MESH [MESH ...]

For each mesh: greedy tokens with top-5 logprobs, which experts each device holds of every expert
weight, whether every parameter has the rule's sharding, and bytes per device. test_moe.py asserts.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from jaxserve import LLM, SamplingParams, parallel  # noqa: E402

PROMPTS = [[1, 54, 198, 214, 72, 30], list(range(5, 45)), [17, 3, 99]]
EXPERT_WEIGHTS = ("we_gate", "we_up", "we_down")


def run_mesh(model: str, mesh: str) -> dict:
    llm = LLM(model=model, mesh=mesh, max_num_seqs=4, max_num_batched_tokens=32, num_pages=32,
              max_model_len=128, compile_ahead=False, show_progress=False)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=5),
                        use_tqdm=False)
    engine = llm.engine
    runner = engine.runner
    arrays = runner.model.param_arrays()
    shardings_ok = {name: bool(a.sharding.is_equivalent_to(NamedSharding(runner.mesh, parallel.PARAM_SPECS[name]),
                                                             a.ndim)) for name, a in arrays.items()}
    # device -> [first expert, end) of each expert weight it holds
    experts_held = {name: {str(s.device): [s.index[1].start or 0, s.index[1].stop or arrays[name].shape[1]]
                           for s in arrays[name].addressable_shards} for name in EXPERT_WEIGHTS}
    mesh_devices = [str(d) for d in runner.mesh.devices.flat]
    return dict(
        tokens=[o.outputs[0].token_ids for o in outs],
        logprobs=[[{str(k): v for k, v in lp.items()} for lp in o.outputs[0].logprobs] for o in outs],
        shardings_ok=shardings_ok,
        experts_held=experts_held,
        mesh_devices=mesh_devices,
        expert_mesh=runner.model.expert_mesh is not None,
        expert_bytes_per_device=parallel.per_device_bytes([arrays[n] for n in EXPERT_WEIGHTS]),
        expert_bytes_total=int(sum(arrays[n].nbytes for n in EXPERT_WEIGHTS)),
        param_bytes_per_device=parallel.per_device_bytes(list(arrays.values())),
        param_bytes_total=int(sum(a.nbytes for a in arrays.values())),
    )


def main() -> None:
    model, out, *meshes = sys.argv[1:]
    assert len(jax.devices()) == 4, jax.devices()
    results = {}
    for mesh in meshes:
        try:
            results[mesh] = run_mesh(model, mesh)
        except Exception as e:  # reported, asserted on by the test
            results[mesh] = {"error": f"{type(e).__name__}: {e}"}
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
