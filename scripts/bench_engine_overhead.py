#!/usr/bin/env python
"""Host work per engine step, with a model so small that the device side is negligible.

A 1-layer random Llama (hidden 64, SmolLM2's vocabulary of 49,152 so that the LM head and the
sampler cost what they cost in serving), written as an HF checkpoint with numpy alone. N sequences
of 16 prompt tokens each decode M tokens; the engine is driven step by step and every step is
split into
  prepare  schedule + encode inputs + dispatch (until the launch returns),
  device   waiting for the sampled ids,
  collect  stop checks, detokenization and output objects (until the next step may start).
Each variant runs twice on the same engine: synchronously (the split above is exact there: the
device idles during prepare and collect, idle = (prepare + collect) / step), then with overlapped
scheduling (step N+1 launched before step N's results are read), where the host's work runs
while the device computes and only what exceeds the device time shows:
  exposed host = max(0, overlapped step - device), idle = exposed / overlapped step,
with `device` the synchronous run's median for the same part. Early = the first 10% of decode
steps, late = the last 10% (context ~16 + M/10 against ~16 + M). Variants: greedy, sampled
(temperature 0.8, top_p 0.95), penalties, logprobs, stop strings.

    python scripts/bench_engine_overhead.py                       # 128 sequences x 1,000 tokens
    python scripts/bench_engine_overhead.py --seqs 256 --variants greedy,sampled --out o.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from device_check import write_tiny_checkpoint  # noqa: E402  (numpy-only random checkpoint)

VARIANTS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.8, top_p=0.95, seed=1),
    "penalties": dict(temperature=0.0, repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.2),
    "logprobs": dict(temperature=0.0, logprobs=5),
    "stop_strings": dict(temperature=0.0, stop=["t999 t998", "never appears"]),
}


def run_variant(llm, name: str, seqs: int, max_tokens: int, overlap: bool) -> dict:
    from jaxserve import SamplingParams

    engine = llm.engine
    assert not engine.has_unfinished()
    engine.overlap = overlap  # safe to switch with nothing in flight
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **VARIANTS[name])
    for i in range(seqs):
        # As the servers' streams and LLM.generate ask: deltas until the final output.
        engine.add_request(f"{name}-{i}", [1] + [(37 * i + 11 * j) % 4000 + 3 for j in range(15)], params,
                           cumulative=False)
    engine.step_timings.clear()
    rows = []  # (seqs in step, tokens in step, prepare, device, collect)
    t_start = time.perf_counter()
    generated = 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        t_end = time.perf_counter()
        generated += sum(len(o.delta_token_ids) for o in outs)
        if engine.step_timings and len(rows) < len(engine.step_timings):
            n_seqs, n_tok, prepare, to_fetch = engine.step_timings[-1]
            rows.append((n_seqs, n_tok, prepare, to_fetch - prepare, (t_end - t0) - to_fetch))
    wall = time.perf_counter() - t_start
    # Full pure-decode steps (with overlap the step timing of a call is the launch it made,
    # its wall time the reading of the previous one: both decodes in steady state).
    decode = [r for r in rows if r[0] == r[1] == seqs]
    k = max(1, len(decode) // 10)

    def summary(part: list[tuple]) -> dict:
        med = {key: statistics.median(r[i] for r in part) * 1e3 for i, key in
               ((2, "prepare_ms"), (3, "device_ms"), (4, "collect_ms"))}
        host = [(r[2] + r[4]) for r in part]
        step = [(r[2] + r[3] + r[4]) for r in part]
        med.update(host_ms=statistics.median(host) * 1e3, step_ms=statistics.median(step) * 1e3,
                   idle_frac=statistics.median(h / s for h, s in zip(host, step)))
        return med

    early, late = summary(decode[:k]), summary(decode[-k:])
    return dict(variant=name, overlap=overlap, seqs=seqs, max_tokens=max_tokens, steps=len(rows),
                decode_steps=len(decode),
                early=early, late=late, late_over_early=late["host_ms"] / early["host_ms"],
                output_tok_s=generated / wall, wall_s=wall)


def launch_floor(llm, seqs: int, max_tokens: int, repeats: int = 50) -> dict:
    """One steady-state decode plan launched `repeats` times in a row with no scheduling or output
    work between (the engine is left unusable: run last), split into its parts:
      launch   wall time per launch until the last result is ready (the floor of a step),
      dispatch time until the launch calls return (host side of a launch),
      pack     packing the inputs and starting their transfer,
      model / sampler   each compiled function alone on device-resident inputs."""
    import jax
    from jaxserve import SamplingParams
    from jaxserve.engine.runner import pack_step
    from jaxserve.engine.sampler import pack_sampling

    engine = llm.engine
    engine.overlap = True
    for i in range(seqs):
        engine.add_request(f"floor-{i}", [1] + [(37 * i + 11 * j) % 4000 + 3 for j in range(15)],
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while True:  # until the step in flight is a full pure decode (the prompts are prefilled)
        engine.step()
        launched = engine._in_flight[0]
        if launched.plan.num_tokens == len(launched.plan.seqs) == seqs:
            break
    runner, plan, prev = launched.replica.runner, launched.plan, launched.sampled_ids

    def per_call(fn) -> float:
        jax.block_until_ready(fn())
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = fn()
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / repeats * 1e3

    result = dict(repeats=repeats, launch_ms=per_call(lambda: runner.launch(plan, prev)))
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = runner.launch(plan, prev)
    result["dispatch_ms"] = (time.perf_counter() - t0) / repeats * 1e3
    jax.block_until_ready(out)
    tokens, md, logits_idx, samp, targets, token_src = runner.step_inputs(plan, host_history=False)
    result["pack_ms"] = per_call(lambda: jax.device_put((pack_step(tokens, md, logits_idx, targets, token_src),
                                                         pack_sampling(samp))))
    step_fn, sample_fn = runner.compile_bucket(plan.bucket)
    step_buf, samp_buf = jax.device_put((pack_step(tokens, md, logits_idx, targets, token_src),
                                         pack_sampling(samp)))

    def model_only():
        runner.kv_cache, logits, _ = step_fn(runner.state, runner.kv_cache, step_buf, prev)
        return logits

    result["model_ms"] = per_call(model_only)
    logits = model_only()
    history = runner._empty_history(plan.bucket[1])

    def sampler_only():
        out, ids, runner.penalty_state = sample_fn(logits, samp_buf, history, runner._no_logit_bias(plan.bucket[1]),
                                                   prev, runner._no_mask(plan.bucket[1]), runner.penalty_state)
        return out

    result["sampler_ms"] = per_call(sampler_only)
    result["bucket"] = list(plan.bucket)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=1000)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    import jax

    from jaxserve import LLM

    tmp = Path(tempfile.mkdtemp(prefix="jaxserve-overhead-"))
    model = write_tiny_checkpoint(tmp / "tiny", vocab=a.vocab, hidden=64, layers=1, heads=1, kv_heads=1, head_dim=64)
    t0 = time.perf_counter()
    llm = LLM(model=str(model), dtype="float32", max_num_seqs=a.seqs, max_num_batched_tokens=max(512, a.seqs),
              max_model_len=16 + a.max_tokens + 16, page_size=16, enable_prefix_caching=False,
              attention_backend=a.attention_backend, show_progress=False)
    startup = time.perf_counter() - t0
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {a.seqs} sequences x {a.max_tokens} tokens; "
          f"start-up {startup:.1f} s", flush=True)
    print("ms per decode step (medians); sync: prepare + device + collect = step; overlap: step wall, "
          "exposed host = step - sync device")
    print(f"{'variant':<13} {'part':<5} {'prepare':>8} {'device':>8} {'collect':>8} {'host':>8} {'step':>8} "
          f"{'idle':>6} {'tok/s':>8} | {'ovl step':>8} {'exposed':>8} {'idle':>6} {'late/early':>10} {'tok/s':>8}")
    results = []
    for name in a.variants.split(","):
        sync = run_variant(llm, name, a.seqs, a.max_tokens, overlap=False)
        ovl = run_variant(llm, name, a.seqs, a.max_tokens, overlap=True)
        for part in ("early", "late"):
            o = ovl[part]
            o["exposed_host_ms"] = max(0.0, o["step_ms"] - sync[part]["device_ms"])
            o["idle_frac"] = o["exposed_host_ms"] / o["step_ms"]
        ovl["late_over_early"] = ovl["late"]["exposed_host_ms"] / max(ovl["early"]["exposed_host_ms"], 1e-3)
        results += [sync, ovl]
        for part in ("early", "late"):
            p, o = sync[part], ovl[part]
            print(f"{name:<13} {part:<5} {p['prepare_ms']:8.2f} {p['device_ms']:8.2f} {p['collect_ms']:8.2f} "
                  f"{p['host_ms']:8.2f} {p['step_ms']:8.2f} {100 * p['idle_frac']:5.1f}% "
                  + (f"{sync['output_tok_s']:8.0f}" if part == "late" else " " * 8)
                  + f" | {o['step_ms']:8.2f} {o['exposed_host_ms']:8.2f} {100 * o['idle_frac']:5.1f}% "
                  + (f"{ovl['late_over_early']:10.2f} {ovl['output_tok_s']:8.0f}" if part == "late" else ""),
                  flush=True)
    floor = launch_floor(llm, a.seqs, a.max_tokens)
    print(f"one decode step (bucket {floor['bucket']}) launched {floor['repeats']} times back to back, no host work "
          f"between, ms per launch: until ready {floor['launch_ms']:.2f} (the floor of a step), until the calls "
          f"return {floor['dispatch_ms']:.2f}; packing + transfer {floor['pack_ms']:.2f}, model step alone "
          f"{floor['model_ms']:.2f}, sampler alone {floor['sampler_ms']:.2f}", flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, startup_s=startup,
                                         results=results, launch_floor=floor), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
