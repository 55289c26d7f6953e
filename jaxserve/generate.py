"""Offline generation from the command line: python -m jaxserve.generate "The capital of France is"."""

from __future__ import annotations

import argparse
import sys

from jaxserve.config import add_engine_args, config_from_args
from jaxserve.logs import is_tty, setup_logging
from jaxserve.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompt", nargs="+", help="one or more prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    add_engine_args(parser)  # its --seed seeds the engine and, when given, each request's sampling
    args = parser.parse_args(argv)
    setup_logging()
    config = config_from_args(args)
    if args.compile_ahead is None:
        config.compile_ahead = False  # one-shot use: compile only the buckets it meets
    from jaxserve.llm import LLM

    llm = LLM.from_config(config, show_progress=is_tty())  # bars only on a terminal
    prompts = args.prompt
    if args.chat:
        tok = llm.get_tokenizer()
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                           add_generation_prompt=True) for p in prompts]
        prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    for prompt, out in zip(args.prompt, llm.generate(prompts, params, use_tqdm=is_tty())):
        print(f"{prompt!r} -> {out.outputs[0].text!r} [{out.outputs[0].finish_reason}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
