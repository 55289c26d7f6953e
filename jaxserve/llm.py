"""The offline API, shaped like vLLM's: LLM(...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

from typing import Any, Sequence

from tqdm.auto import tqdm

from jaxserve.config import EngineConfig
from jaxserve.engine.engine import CompletionOutput, LLMEngine, RequestOutput
from jaxserve.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | None = None, show_progress: bool = True, **options: Any):
        self.engine = LLMEngine(EngineConfig(model=model, **options), show_progress=show_progress)

    @classmethod
    def from_config(cls, config: EngineConfig, show_progress: bool = True) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config, show_progress=show_progress)
        return llm

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); one SamplingParams or one per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        engine = self.engine
        groups: list[list[str]] = []
        try:
            for prompt, p in zip(prompts, params):
                rid = engine.new_request_id()
                ids = [rid] if p.n == 1 else [f"{rid}-{i}" for i in range(p.n)]
                for i, sub in enumerate(ids):
                    # Only final outputs are kept: the others need not copy what grew so far.
                    engine.add_request(sub, prompt, p, seed_offset=i, group_id=rid if p.n > 1 else None,
                                       cumulative=False)
                groups.append(ids)
        except Exception:
            for ids in groups:
                for sub in ids:
                    engine.abort(sub)
            raise
        final: dict[str, RequestOutput] = {}
        prompt_lps: dict[str, list] = {}  # only the first output of a request carries them
        total = sum(len(g) for g in groups)
        with tqdm(total=total, desc="generating", unit="req", disable=not use_tqdm, leave=False) as bar:
            while len(final) < total and engine.has_unfinished():
                for out in engine.step():
                    if out.prompt_logprobs is not None:
                        prompt_lps[out.request_id] = out.prompt_logprobs
                    if out.finished:
                        final[out.request_id] = out
                        bar.update()
        results = []
        for ids in groups:
            outs = [final[i] for i in ids]
            completions = [CompletionOutput(k, o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason,
                                            o.outputs[0].stop_reason, o.outputs[0].logprobs) for k, o in enumerate(outs)]
            first = outs[0]
            # A request the engine failed alone reports why (its finish_reason is "abort").
            error = next((o.error for o in outs if o.error is not None), None)
            results.append(RequestOutput(ids[0] if len(ids) == 1 else ids[0].rsplit("-", 1)[0], first.prompt,
                                         first.prompt_token_ids, completions, True, first.num_cached_tokens,
                                         prompt_logprobs=next((prompt_lps[i] for i in ids if i in prompt_lps), None),
                                         error=error))
        return results
