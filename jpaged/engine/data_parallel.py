"""DataParallelEngine: several engine replicas on disjoint devices, behind one interface.

Each replica is a whole `LLMEngine` (its own scheduler, block tables, KV cache and
compiled steps) on its own mesh of tensor_parallel_size devices; a new request
goes to the replica with the fewest unfinished requests. A step steps every busy
replica, each in a thread of its own: the host work of one replica (scheduling,
batch building, detokenizing) runs while the devices of the others compute.

In a job of several processes (jpaged.launch, several hosts) every process
gets the same requests and routes them alike, but builds and steps only the
replicas on its own devices; after each step the processes exchange their
replicas' outputs, so that each returns every replica's (and agrees on which
requests remain).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import pickle
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax

from jpaged.engine.config import EngineConfig
from jpaged.engine.input_processor import EngineRequest
from jpaged.engine.llm_engine import LLMEngine
from jpaged.engine.lockstep import (
    DIGEST_BYTES,
    LockstepError,
    ProcessGroup,
    check_process_layout,
    local_devices,
    mesh_processes,
)
from jpaged.engine.protocol import EngineState
from jpaged.engine.stats import CombinedStats
from jpaged.inputs import PromptType
from jpaged.lora.request import LoRARequest
from jpaged.memory.reserved_prefixes import check_prefix_id
from jpaged.model.config import LlamaConfig
from jpaged.model.loader import load_model
from jpaged.outputs import RequestOutput, ReservedPrefix
from jpaged.sampling_params import BeamSearchParams, SamplingParams


class DataParallelEngine:
    """The engine protocol (jpaged.engine.protocol.Engine) over config.data_parallel_size
    LLMEngine replicas (see EngineConfig for the meshes they run on): requests go to
    replicas, stats and state() are all `replicas`' together: every replica's in one
    process, the replicas on this process's devices in a job of several."""

    def __init__(
        self, config: EngineConfig, *, loaded: tuple[Any, LlamaConfig, Any] | None = None
    ):
        """loaded: (model, model_config, tokenizer) already in memory, else config.model loads
        (once: each replica lays out its own copy of the parameters on its devices)."""
        self.config = config
        meshes = config.replica_meshes()
        check_process_layout(meshes)
        model, model_config, tokenizer = loaded or load_model(config.model, config.dtype)
        # A tokenizer is not thread-safe: each replica detokenizes with its own.
        self._local = {
            index: LLMEngine(
                dataclasses.replace(config, mesh=mesh, data_parallel_size=1,
                                    tensor_parallel_size=mesh.size),
                loaded=(model, model_config, copy.deepcopy(tokenizer)),
            )
            for index, mesh in enumerate(meshes) if local_devices(mesh)
        }
        self.replicas = list(self._local.values())
        self.num_replicas = len(meshes)
        # Outputs a process passes on: those of the replicas whose first process it is.
        self._leads = [index for index in self._local
                       if mesh_processes(meshes[index])[0] == jax.process_index()]
        self._processes = None
        if len(self._local) < len(meshes):
            self._processes = ProcessGroup(jax.devices())
        self.tokenizer = tokenizer
        self.max_model_len = self.replicas[0].max_model_len
        self._replica_of: dict[str, int] = {}
        self._routing = b""  # a digest of every add and abort so far
        # A reserved prefix's id (the first replica's) -> each replica's ReservedPrefix.
        self._reserved: dict[int, list[ReservedPrefix]] = {}
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
                        cache_salt: str | None = None,
                        lora_request: LoRARequest | None = None) -> EngineRequest:
        """See `LLMEngine.process_request`: every replica has the same limits."""
        return self.replicas[0].process_request(request_id, prompt, params,
                                                cache_salt=cache_salt, lora_request=lora_request)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | EngineRequest,
        params: SamplingParams | BeamSearchParams | None = None,
        *,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request on the least-loaded replica (see `LLMEngine.add_request`); one
        on another process's replica is only checked here."""
        if request_id in self._replica_of:
            raise ValueError(f"request id {request_id!r} is already in use")
        load = collections.Counter(self._replica_of.values())
        index = min(range(self.num_replicas), key=load.__getitem__)
        if index in self._local:
            self._local[index].add_request(request_id, prompt, params, cache_salt=cache_salt,
                                           lora_request=lora_request)
        else:
            self.replicas[0].check_request(self.replicas[0].request_of(
                request_id, prompt, params, cache_salt=cache_salt, lora_request=lora_request))
        self._replica_of[request_id] = index
        self._route(f"+{request_id}:{index}")

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks now; unknown ids are ignored."""
        index = self._replica_of.pop(request_id, None)
        if index is not None:
            self._route(f"-{request_id}")
        if index in self._local:
            self._local[index].abort(request_id)

    def reserve_prefix(self, prompt: str | list[int], cache_salt: str | None = None
                       ) -> ReservedPrefix:
        """`LLMEngine.reserve_prefix` in every replica (in a job of several processes,
        each process's replicas): all or none hold it; the first replica's id names it."""
        prefixes: list[ReservedPrefix] = []
        try:
            for replica in self.replicas:
                prefixes.append(replica.reserve_prefix(prompt, cache_salt))
        except BaseException:
            for replica, prefix in zip(self.replicas, prefixes, strict=False):
                replica.release_prefix(prefix)
            raise
        self._reserved[prefixes[0].prefix_id] = prefixes
        return prefixes[0]

    def lora_adapter(self, lora_request: LoRARequest):
        """See `LLMEngine.lora_adapter`: every replica reads adapters alike."""
        return self.replicas[0].lora_adapter(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        """`LLMEngine.remove_lora` in every replica."""
        return any([replica.remove_lora(lora_name) for replica in self.replicas])

    def release_prefix(self, prefix: ReservedPrefix | int) -> None:
        """`LLMEngine.release_prefix` in every replica."""
        prefix_id = check_prefix_id(prefix.prefix_id if isinstance(prefix, ReservedPrefix)
                                    else prefix)
        if prefix_id not in self._reserved:
            raise ValueError(f"no prefix {prefix_id} is reserved (reserved: "
                             f"{sorted(self._reserved)})")
        for replica, replica_prefix in zip(self.replicas, self._reserved.pop(prefix_id),
                                           strict=True):
            replica.release_prefix(replica_prefix)

    def _route(self, change: str) -> None:
        """Fold a change of the routing into its digest, which the processes compare."""
        self._routing = hashlib.blake2b(self._routing + change.encode(),
                                        digest_size=DIGEST_BYTES).digest()

    def has_unfinished_requests(self) -> bool:
        return bool(self._replica_of)

    def num_unfinished_requests(self) -> int:
        return len(self._replica_of)

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work, concurrently; their outputs together (in
        a job of several processes, every process's replicas' outputs)."""
        busy = [index for index, replica in self._local.items()
                if replica.has_unfinished_requests()]
        stepped = dict(zip(busy, self._threads.map(lambda i: self._local[i].step(), busy),
                           strict=True))
        if self._processes is None:
            outputs = [output for replica_outputs in stepped.values() for output in replica_outputs]
        else:
            outputs = self._exchange([stepped.get(index, []) for index in self._leads])
        for output in outputs:
            if output.finished:
                self._replica_of.pop(output.request_id, None)
        return outputs

    def _exchange(self, outputs: list[list[RequestOutput]]) -> list[RequestOutput]:
        """Every process's replicas' outputs, in replica order, from this process's;
        LockstepError unless every process routed the same requests the same way."""
        payloads = self._processes.allgather_bytes(pickle.dumps((self._routing, outputs)))
        routings, everyone = zip(*map(pickle.loads, payloads), strict=True)
        differing = [p for p, routing in zip(self._processes.processes, routings, strict=True)
                     if routing != routings[0]]
        if differing:
            raise LockstepError(f"processes {differing} routed other requests than process "
                                f"{self._processes.processes[0]}: their requests, or the order "
                                "they came in, differ")
        return [output for outputs in everyone for replica_outputs in outputs
                for output in replica_outputs]

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
