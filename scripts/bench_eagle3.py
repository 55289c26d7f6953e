#!/usr/bin/env python
"""EAGLE-3 on the default model's shapes, in one run: what the head costs and what it can give.

No trained EAGLE-3 head for SmolLM2-135M exists here (no model hub, and training one is out of
this host's reach), so the script brackets the method with two heads of the default model's
size (hidden 576, 9 heads, 3 KV heads, MLP 1,536, a 32,000-token draft vocabulary, as the
published Llama heads have) in the published checkpoint format:

- floor: a random head on the real default model. Its drafts are almost never accepted: what
  drafting costs when it fails (each request's draft length then shrinks to nothing and pauses).
- ceiling: a head whose every draft is the target's next token, on the default model with its
  final norm zeroed, so that its greedy output is always token 0 (the step costs exactly what the
  real model's does: same shapes, same kernels). Every draft is accepted: what verified drafts
  give when the head is right, after the head's own cost.

Each against plain decoding of the same model in the same run (greedy, EOS ignored), at the
given concurrencies, on the chat prompts of scripts/bench_spec.py; median of --repeats. Outputs
are checked identical to plain decoding.

    python scripts/bench_eagle3.py --out docs/results/bench_eagle3_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_spec import CHATS, timed  # noqa: E402

from jaxserve import LLM, SamplingParams  # noqa: E402


def write_head(path: Path, vocab: int, exact_token: int | None, seed: int = 0) -> Path:
    """A head of the default model's size; exact_token: every draft is that token."""
    import numpy as np
    from safetensors.numpy import save_file

    E, H, KVH, D, F, V = 576, 9, 3, 64, 1536, 32000
    rng = np.random.default_rng(seed)
    r = lambda *shape, s=0.05: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    w = {"fc.weight": r(E, 3 * E), "midlayer.input_layernorm.weight": np.ones(E, np.float32),
         "midlayer.hidden_norm.weight": np.ones(E, np.float32),
         "midlayer.post_attention_layernorm.weight": np.ones(E, np.float32),
         "midlayer.self_attn.q_proj.weight": r(H * D, 2 * E), "midlayer.self_attn.k_proj.weight": r(KVH * D, 2 * E),
         "midlayer.self_attn.v_proj.weight": r(KVH * D, 2 * E), "midlayer.self_attn.o_proj.weight": r(E, H * D),
         "midlayer.mlp.gate_proj.weight": r(F, E), "midlayer.mlp.up_proj.weight": r(F, E),
         "midlayer.mlp.down_proj.weight": r(E, F), "norm.weight": np.ones(E, np.float32),
         "lm_head.weight": r(V, E, s=1.0), "d2t": np.zeros(V, np.int64), "t2d": np.zeros(vocab, bool)}
    if exact_token is not None:
        w["lm_head.weight"][:] = 0  # every row ties: draft id 0, mapped to exact_token
        w["d2t"][0] = exact_token
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": E, "intermediate_size": F,
        "num_attention_heads": H, "num_key_value_heads": KVH, "num_hidden_layers": 1, "vocab_size": vocab,
        "draft_vocab_size": V, "target_hidden_size": E, "rms_norm_eps": 1e-5, "rope_theta": 100000.0}))
    save_file(w, str(path / "model.safetensors"))
    return path


def zero_final_norm(llm: LLM) -> None:
    """The target's greedy output becomes token 0 everywhere (all logits 0), at the same cost."""
    import jax.numpy as jnp
    from flax import nnx

    for replica in llm.engine.replicas:
        runner = replica.runner
        model = nnx.merge(runner.graphdef, runner.state)
        model.final_norm[...] = jnp.zeros_like(model.final_norm[...])
        runner.graphdef, runner.state = nnx.split(model)


def run(llm: LLM, conc: int, args) -> tuple[float, list[list[int]], dict]:
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": CHATS[i % len(CHATS)]}], tokenize=False,
                                       add_generation_prompt=True) for i in range(conc)]
    return timed(llm, prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
                 args.repeats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    results: dict = {"config": vars(args), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        from jaxserve.loading import load_tokenizer

        vocab = len(load_tokenizer(None))  # the default model's vocabulary (49,152)
        heads = {"floor": write_head(Path(tmp) / "random", vocab, None),
                 "ceiling": write_head(Path(tmp) / "exact", vocab, exact_token=0)}
        for bracket in ("floor", "ceiling"):
            spec = json.dumps({"method": "eagle3", "model": str(heads[bracket]),
                               "num_speculative_tokens": args.num_speculative_tokens})
            tokens = {}
            for label, config in (("off", None), ("eagle3", spec)):
                llm = LLM(max_num_seqs=64, max_model_len=1024, speculative_config=config, show_progress=False)
                if bracket == "ceiling":
                    zero_final_norm(llm)
                for conc in concurrency:
                    rate, toks, stats = run(llm, conc, args)
                    key = f"{bracket} c{conc}"
                    entry = results["runs"].setdefault(key, {})
                    entry[label] = {"tok_s": rate, **({"spec": stats} if config else {})}
                    tokens[(label, conc)] = toks
                    mal = f", mean accepted length {stats['mean_accepted_length'] or 0:.2f}" if config else ""
                    print(f"{bracket:7s} {label:6s} c{conc:<3d}: {rate:7.1f} tok/s{mal}", flush=True)
                llm.engine.close()
                del llm
            for conc in concurrency:
                r = results["runs"][f"{bracket} c{conc}"]
                r["speedup"] = r["eagle3"]["tok_s"] / r["off"]["tok_s"]
                r["identical_outputs"] = tokens[("off", conc)] == tokens[("eagle3", conc)]
    print(f"\n{'point':12s} {'off tok/s':>10s} {'eagle3 tok/s':>13s} {'speed-up':>9s} {'accepted len':>13s}  outputs")
    for key, r in results["runs"].items():
        mal = r["eagle3"]["spec"]["mean_accepted_length"] or 0
        print(f"{key:12s} {r['off']['tok_s']:10.1f} {r['eagle3']['tok_s']:13.1f} {r['speedup']:8.2f}x {mal:13.2f}  "
              f"{'identical' if r['identical_outputs'] else 'DIFFER'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
