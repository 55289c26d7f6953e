"""Per-device memory of weights and KV pool on meshes 1x1, 1x4, 1x8 (simulated CPU devices).

    python scripts/bench_mesh_memory.py [--model M] [--meshes 1x1,1x4,1x8] [--num-pages 2048] [--out F.json]

The pool has the same number of pages (the same token capacity) on every mesh, so the KV column
shows what splitting the KV heads saves per device. Bytes are read from each array's shards.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--meshes", default="1x1,1x4,1x8")
    ap.add_argument("--num-pages", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from jaxserve import LLM, parallel

    rows = []
    for mesh in args.meshes.split(","):
        llm = LLM(model=args.model, mesh=mesh, num_pages=args.num_pages, page_size=args.page_size,
                  compile_ahead=False, show_progress=False)
        e = llm.engine
        params = list(e.runner.model.param_arrays().values())
        weights = parallel.per_device_bytes(params)
        kv = parallel.per_device_bytes([e.runner.kv_cache])
        rows.append(dict(mesh=mesh, devices=len(weights), weights_per_device=max(weights.values()),
                         kv_per_device=max(kv.values()), weights_total=sum(weights.values()),
                         served_heads=[e.served_model_config.num_heads, e.served_model_config.num_kv_heads],
                         model_heads=[e.model_config.num_heads, e.model_config.num_kv_heads]))
        del llm, e, params
    base = rows[0]
    mib = 2**20
    print(f"model {args.model or 'default SmolLM2-135M-Instruct'}, float32, KV pool {args.num_pages} pages x "
          f"{args.page_size} tokens on every mesh")
    print(f"{'mesh':>5} {'q/kv heads served':>18} {'weights/device':>15} {'vs 1x1':>7} {'KV/device':>11} {'vs 1x1':>7}")
    for r in rows:
        heads = f"{r['served_heads'][0]}/{r['served_heads'][1]}"
        print(f"{r['mesh']:>5} {heads:>18} {r['weights_per_device'] / mib:>11.1f} MiB "
              f"{r['weights_per_device'] / base['weights_per_device']:>7.3f} {r['kv_per_device'] / mib:>7.1f} MiB "
              f"{r['kv_per_device'] / base['kv_per_device']:>7.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
