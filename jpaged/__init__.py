"""jpaged: PagedAttention in JAX and Pallas."""

from jpaged.engine import EngineConfig, LLMEngine
from jpaged.inputs import TextPrompt, TokensPrompt
from jpaged.llm import LLM
from jpaged.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    Logprob,
    RequestOutput,
)
from jpaged.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
]
