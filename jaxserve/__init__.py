"""jaxserve: LLM inference serving on JAX/XLA."""

from jaxserve.config import EngineConfig
from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig", "AsyncEngine"]


def __getattr__(name: str):
    # Lazy: importing jaxserve for SamplingParams should not load jax and the model stack.
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    if name == "AsyncEngine":
        from jaxserve.engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
