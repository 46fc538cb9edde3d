"""What `LLM`, `AsyncLLMEngine` and the server need of an engine: one `LLMEngine`, or
several data-parallel replicas behind a `DataParallelEngine`."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from jpaged.engine.config import EngineConfig
from jpaged.engine.input_processor import EngineRequest
from jpaged.engine.stats import LoRACounts, SpecDecodeCounts
from jpaged.inputs import PromptType
from jpaged.lora.request import LoRARequest
from jpaged.memory.host_tier import HostPoolCounts
from jpaged.outputs import RequestOutput, ReservedPrefix
from jpaged.sampling_params import BeamSearchParams, SamplingParams
from jpaged.structured_output.counts import StructuredOutputCounts


@dataclass(frozen=True)
class EngineState:
    """An engine's queues and KV pool between steps (over all its replicas)."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_tier_hit_tokens: int = 0
    """Of the hit tokens, those loaded from the host tier."""
    kv_group_blocks_used: tuple[int, ...] = ()
    """Each KV cache group's logical blocks: the entries its tables hold."""
    kv_blocks_reserved: int = 0
    """Device KV blocks reserved prefixes hold (kv_blocks_used counts them too)."""
    kv_cache_dtype: str = ""
    """What the pool's pages store (KVCacheInfo.dtype); the same in every replica."""
    kv_bytes_per_token: int = 0
    """KV bytes of one token on one device, scales included (KVCacheInfo.bytes_per_token)."""
    spec_decode: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)
    """Speculative decoding's proposals and acceptances so far."""
    mode_fallbacks: dict[str, int] = field(default_factory=dict)
    """How often each fallback of the step modes' table happened (ModeFallbacks.counts)."""
    structured_outputs: StructuredOutputCounts = field(default_factory=StructuredOutputCounts)
    """Requests with a grammar, grammar compiles and token-mask fills so far."""
    host_pool: HostPoolCounts = field(default_factory=HostPoolCounts)
    """The host pool's blocks (swapped, the tier's copies) and the tier's traffic."""
    lora: LoRACounts = field(default_factory=LoRACounts)
    """The LoRA adapter slots beside the KV pool, their loads and requests per adapter."""

    @property
    def kv_usage(self) -> float:
        """Fraction of the device KV blocks held by live sequences or reserved prefixes."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of the admitted prompt tokens served from the prefix cache."""
        queried = self.prefix_cache_query_tokens
        return self.prefix_cache_hit_tokens / queried if queried else 0.0

    @classmethod
    def total(cls, states: Sequence[EngineState]) -> EngineState:
        """The sums over several engines' states (replicas of one model: their groups
        add up one by one)."""
        groups = [s.kv_group_blocks_used for s in states if s.kv_group_blocks_used]
        return cls(*(sum(values) for values in zip(*(
            (s.num_running, s.num_waiting, s.num_swapped, s.kv_blocks_used, s.kv_blocks_total,
             s.prefix_cache_query_tokens, s.prefix_cache_hit_tokens, s.num_preemptions,
             s.prefix_cache_tier_hit_tokens)
            for s in states), strict=True)),
            kv_group_blocks_used=tuple(sum(group) for group in zip(*groups, strict=True)),
            kv_blocks_reserved=sum(s.kv_blocks_reserved for s in states),
            kv_cache_dtype=states[0].kv_cache_dtype if states else "",
            kv_bytes_per_token=states[0].kv_bytes_per_token if states else 0,
            spec_decode=functools.reduce(SpecDecodeCounts.add, (s.spec_decode for s in states),
                                         SpecDecodeCounts()),
            mode_fallbacks=dict(sum((Counter(s.mode_fallbacks) for s in states), Counter())),
            structured_outputs=functools.reduce(
                StructuredOutputCounts.add, (s.structured_outputs for s in states),
                StructuredOutputCounts()),
            host_pool=functools.reduce(HostPoolCounts.add, (s.host_pool for s in states),
                                       HostPoolCounts()),
            lora=functools.reduce(LoRACounts.add, (s.lora for s in states), LoRACounts()))


class Engine(Protocol):
    """add_request / step / abort over a model, with what its callers read of it."""

    config: EngineConfig
    tokenizer: Any
    max_model_len: int
    last_step_error: BaseException | None

    @property
    def stats(self) -> Any: ...  # .summary(): jpaged.engine.stats.summarize

    def process_request(self, request_id: str, prompt: PromptType,
                        params: SamplingParams | BeamSearchParams | None = None, *,
                        cache_salt: str | None = None,
                        lora_request: LoRARequest | None = None) -> EngineRequest: ...

    def add_request(self, request_id: str, prompt: PromptType | EngineRequest,
                    params: SamplingParams | BeamSearchParams | None = None, *,
                    cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> None: ...

    def abort(self, request_id: str) -> None: ...
    def reserve_prefix(self, prompt: str | list[int], cache_salt: str | None = None
                       ) -> ReservedPrefix: ...
    def release_prefix(self, prefix: ReservedPrefix | int) -> None: ...
    def lora_adapter(self, lora_request: LoRARequest) -> Any: ...
    def remove_lora(self, lora_name: str) -> bool: ...
    def step(self) -> list[RequestOutput]: ...
    def has_unfinished_requests(self) -> bool: ...
    def num_unfinished_requests(self) -> int: ...
    def tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> list[int]: ...
    def apply_chat_template(self, messages: list[dict[str, str]], **options) -> list[int]: ...
    def warmup(self) -> int: ...
    def state(self) -> EngineState: ...
