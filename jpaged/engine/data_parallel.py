"""DataParallelEngine: several engine replicas on disjoint devices, behind one interface.

Each replica is a whole `LLMEngine` (its own scheduler, block tables, KV cache and
compiled steps) on its own mesh of tensor_parallel_size devices; a new request
goes to the replica with the fewest unfinished requests. A step steps every busy
replica, each in a thread of its own: the host work of one replica (scheduling,
batch building, detokenizing) runs while the devices of the others compute.
"""

from __future__ import annotations

import copy
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jpaged.engine.config import EngineConfig
from jpaged.engine.input_processor import EngineRequest
from jpaged.engine.llm_engine import LLMEngine
from jpaged.engine.protocol import EngineState
from jpaged.engine.stats import CombinedStats
from jpaged.inputs import PromptType
from jpaged.model.config import LlamaConfig
from jpaged.model.loader import load_model
from jpaged.outputs import RequestOutput
from jpaged.sampling_params import BeamSearchParams, SamplingParams


class DataParallelEngine:
    """The engine protocol (jpaged.engine.protocol.Engine) over config.data_parallel_size
    LLMEngine replicas (see EngineConfig for the meshes they run on): requests go to
    replicas, stats and state() are all replicas' together."""

    def __init__(
        self, config: EngineConfig, *, loaded: tuple[Any, LlamaConfig, Any] | None = None
    ):
        """loaded: (model, model_config, tokenizer) already in memory, else config.model loads
        (once: each replica lays out its own copy of the parameters on its devices)."""
        self.config = config
        meshes = config.replica_meshes()
        model, model_config, tokenizer = loaded or load_model(config.model, config.dtype)
        # A tokenizer is not thread-safe: each replica detokenizes with its own.
        self.replicas = [
            LLMEngine(
                dataclasses.replace(config, mesh=mesh, data_parallel_size=1,
                                    tensor_parallel_size=mesh.size),
                loaded=(model, model_config, copy.deepcopy(tokenizer)),
            )
            for mesh in meshes
        ]
        self.tokenizer = tokenizer
        self.max_model_len = self.replicas[0].max_model_len
        self._replica_of: dict[str, LLMEngine] = {}
        self._threads = ThreadPoolExecutor(len(self.replicas), thread_name_prefix="jpaged-dp")

    @property
    def stats(self) -> CombinedStats:
        """Every replica's statistics; `.summary()` combines them (see `stats.summarize`)."""
        return CombinedStats(tuple(replica.stats for replica in self.replicas))

    @property
    def last_step_error(self) -> BaseException | None:
        """The error of the last step's first failed replica, if any."""
        errors = [r.last_step_error for r in self.replicas if r.last_step_error is not None]
        return errors[0] if errors else None

    @last_step_error.setter
    def last_step_error(self, error: BaseException | None) -> None:
        for replica in self.replicas:
            replica.last_step_error = error

    def process_request(self, request_id: str, prompt: PromptType,
                        params: SamplingParams | BeamSearchParams | None = None, *,
                        cache_salt: str | None = None) -> EngineRequest:
        """See `LLMEngine.process_request`: every replica has the same limits."""
        return self.replicas[0].process_request(request_id, prompt, params,
                                                cache_salt=cache_salt)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | EngineRequest,
        params: SamplingParams | BeamSearchParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request on the least-loaded replica (see `LLMEngine.add_request`)."""
        if request_id in self._replica_of:
            raise ValueError(f"request id {request_id!r} is already in use")
        replica = min(self.replicas, key=LLMEngine.num_unfinished_requests)
        replica.add_request(request_id, prompt, params, cache_salt=cache_salt)
        self._replica_of[request_id] = replica

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks now; unknown ids are ignored."""
        replica = self._replica_of.pop(request_id, None)
        if replica is not None:
            replica.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(replica.has_unfinished_requests() for replica in self.replicas)

    def num_unfinished_requests(self) -> int:
        return sum(replica.num_unfinished_requests() for replica in self.replicas)

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work, concurrently; their outputs together."""
        busy = [replica for replica in self.replicas if replica.has_unfinished_requests()]
        outputs = [output for replica_outputs in self._threads.map(LLMEngine.step, busy)
                   for output in replica_outputs]
        for output in outputs:
            if output.finished:
                self._replica_of.pop(output.request_id, None)
        return outputs

    def warmup(self) -> int:
        """`LLMEngine.warmup` of every replica, concurrently (each compiles for its own
        devices); returns the number of step shapes each replica ran."""
        return max(self._threads.map(LLMEngine.warmup, self.replicas))

    def state(self) -> EngineState:
        return EngineState.total([replica.state() for replica in self.replicas])

    def tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> list[int]:
        return self.replicas[0].tokenize(prompt, add_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], **options) -> list[int]:
        return self.replicas[0].apply_chat_template(messages, **options)
