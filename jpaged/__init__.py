"""jpaged: PagedAttention in JAX and Pallas."""

from jpaged.engine import EngineConfig, LLMEngine
from jpaged.llm import LLM
from jpaged.outputs import CompletionOutput, RequestOutput
from jpaged.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
