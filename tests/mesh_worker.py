"""Runs in a subprocess with 8 simulated CPU devices (XLA_FLAGS must be set before jax loads).

    python tests/mesh_worker.py MODEL|default OUT.json MESH [MESH ...]

For each mesh: greedy outputs with top-5 logprobs, whether every parameter and the KV pool have
the sharding the partition rules say, and the bytes each device holds. Orbax: the first sharded
mesh's weights are saved and restored straight into a 1x4 mesh. test_parallel.py asserts on it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from jaxserve import LLM, SamplingParams, parallel  # noqa: E402
from jaxserve.loading.orbax_checkpoint import restore_params, save_params  # noqa: E402

PROMPTS = [[1, 54, 198, 214, 72, 30], list(range(5, 45)), [17, 3, 99], list(range(100, 119))]


def start(model: str | None, mesh: str, compile_ahead: bool = False) -> LLM:
    return LLM(model=model, mesh=mesh, max_num_seqs=8, max_num_batched_tokens=32, num_pages=48,
               max_model_len=128, compile_ahead=compile_ahead, show_progress=False)


def run_mesh(llm: LLM) -> dict:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    engine = llm.engine
    engine.check_invariants()
    shardings_ok, arrays = {}, []
    for replica in engine.replicas:
        m = replica.runner.mesh
        for name, a in replica.runner.model.param_arrays().items():
            ok = a.sharding.is_equivalent_to(NamedSharding(m, parallel.PARAM_SPECS[name]), a.ndim)
            shardings_ok[name] = shardings_ok.get(name, True) and bool(ok)
            arrays.append(a)
        kv = replica.runner.kv_cache
        ok = kv.sharding.is_equivalent_to(parallel.kv_pool_sharding(m), kv.ndim)
        shardings_ok["kv_pool"] = shardings_ok.get("kv_pool", True) and bool(ok)
    runner = engine.runner
    param_bytes = parallel.per_device_bytes(list(runner.model.param_arrays().values()))
    result = dict(
        tokens=[o.outputs[0].token_ids for o in outs],
        logprobs=[[{str(k): v for k, v in lp.items()} for lp in o.outputs[0].logprobs] for o in outs],
        shardings_ok=shardings_ok,
        replica_devices=[[str(d) for d in r.runner.mesh.devices.flat] for r in engine.replicas],
        requests_per_replica=[r.num_requests for r in engine.replicas],
        param_bytes_per_device=param_bytes,
        kv_bytes_per_device=parallel.per_device_bytes([runner.kv_cache]),
        total_param_bytes=int(sum(a.nbytes for a in runner.model.param_arrays().values())),
        served_heads=[engine.served_model_config.num_heads, engine.served_model_config.num_kv_heads],
        model_heads=[engine.model_config.num_heads, engine.model_config.num_kv_heads],
    )
    return result


def orbax_roundtrip(llm: LLM) -> dict:
    """Save sharded weights, restore them directly into another mesh's shardings."""
    params = llm.engine.runner.model.param_arrays()
    target_mesh = parallel.make_mesh("1x4", jax.devices()[4:8])  # other devices, another split
    with tempfile.TemporaryDirectory() as tmp:
        save_params(os.path.join(tmp, "ckpt"), params)
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=parallel.param_sharding(target_mesh, k))
                  for k, v in params.items()}
        restored = restore_params(os.path.join(tmp, "ckpt"), target)
    return dict(
        equal=all(np.array_equal(np.asarray(restored[k]), np.asarray(v)) for k, v in params.items()),
        placed=all(restored[k].sharding.is_equivalent_to(target[k].sharding, v.ndim) for k, v in params.items()),
    )


def main() -> None:
    model = None if sys.argv[1] == "default" else sys.argv[1]
    out_path, meshes = sys.argv[2], sys.argv[3:]
    results: dict = {"meshes": {}}
    for mesh in meshes:
        try:
            llm = start(model, mesh)
        except ValueError as e:  # a mesh the devices or the model cannot form
            results["meshes"][mesh] = {"error": str(e)}
            continue
        results["meshes"][mesh] = run_mesh(llm)
        if "orbax" not in results and parallel.parse_mesh(mesh)[1] > 1:
            results["orbax"] = orbax_roundtrip(llm)
        del llm
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
