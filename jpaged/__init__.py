"""jpaged: PagedAttention in JAX and Pallas.

Public names load on first use (PEP 562), so the host side (allocator, block
manager, scheduler, batch builder) imports without jax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jpaged.engine.config import EngineConfig
    from jpaged.engine.llm_engine import LLMEngine
    from jpaged.entrypoints.llm import LLM
    from jpaged.inputs import TextPrompt, TokensPrompt
    from jpaged.lora.request import LoRARequest
    from jpaged.outputs import (
        BeamSearchOutput,
        BeamSearchSequence,
        CompletionOutput,
        Logprob,
        RequestOutput,
        ReservedPrefix,
    )
    from jpaged.sampling_params import (
        BeamSearchParams,
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )

_MODULE_OF = {
    "LLM": "jpaged.entrypoints.llm",
    "BeamSearchOutput": "jpaged.outputs",
    "BeamSearchParams": "jpaged.sampling_params",
    "BeamSearchSequence": "jpaged.outputs",
    "CompletionOutput": "jpaged.outputs",
    "EngineConfig": "jpaged.engine.config",
    "LLMEngine": "jpaged.engine.llm_engine",
    "LoRARequest": "jpaged.lora.request",
    "Logprob": "jpaged.outputs",
    "RequestOutput": "jpaged.outputs",
    "RequestOutputKind": "jpaged.sampling_params",
    "ReservedPrefix": "jpaged.outputs",
    "SamplingParams": "jpaged.sampling_params",
    "StructuredOutputsParams": "jpaged.sampling_params",
    "TextPrompt": "jpaged.inputs",
    "TokensPrompt": "jpaged.inputs",
}

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "LoRARequest",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "ReservedPrefix",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
]


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
