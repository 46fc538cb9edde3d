"""LLMEngine: continuous batching of requests over a paged KV cache.

A facade over three parts, each of which a request passes through once:

    InputProcessor    prompt forms parsed, tokenized once, parameters checked
    EngineCore        schedule -> block ops -> inputs -> execute -> sample
                      -> scheduler.update_from_output (the one call back)
    OutputProcessor   detokenization, stop strings, logprob entries, RequestOutput

`step()` runs the core once, hands its output to the output processor, ends
the sequences a stop string ended (through the scheduler) and returns the
outputs, less those of the internal requests that compute reserved prefixes
(jpaged.engine.prefix_requests). Start-up decides what the config left to the engine
against the machine and the model (the step modes' table: jpaged.core.step_modes), sizes
the KV pool (jpaged.engine.kv_cache_sizing), picks the KV cache manager for `allocation`
and starts the runner on its backend.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from typing import Any

import jax
import numpy as np

from jpaged._deprecation import moved_names
from jpaged.config import SchedulerConfig
from jpaged.core.async_scheduler import AsyncScheduler
from jpaged.core.scheduler import Scheduler
from jpaged.core.step_modes import ModeFallbacks, StepMode, step_mode
from jpaged.core.step_shapes import StepShapes
from jpaged.core.stop_rule import StopRule
from jpaged.engine import compilation, lockstep, machine
from jpaged.engine.backend_choice import start_runner
from jpaged.engine.beam_search import BeamSearch
from jpaged.engine.config import EngineConfig
from jpaged.engine.engine_core import CoreOutput, EngineCore, is_fatal
from jpaged.engine.input_processor import EngineRequest, InputProcessor, RequestLimits
from jpaged.engine.kv_cache_sizing import size_kv_cache
from jpaged.engine.kv_managers import KVManager, kv_cache_groups, make_kv_manager
from jpaged.engine.output_processor import OutputProcessor
from jpaged.engine.prefix_requests import PrefixRequests
from jpaged.engine.protocol import EngineState
from jpaged.engine.stats import EngineStats, LoRACounts, SpecDecodeCounts
from jpaged.inputs import PromptType
from jpaged.lora.peft import read_adapter
from jpaged.lora.request import LoRARequest
from jpaged.lora.slots import AdapterSlotTable, prefix_salt
from jpaged.memory.reserved_prefixes import check_token_ids
from jpaged.model.config import AdapterSlots, LlamaConfig
from jpaged.model.loader import load_model, read_model_config
from jpaged.model.lora import with_adapter_slots
from jpaged.model.sharding import regroup_adapter, shard_model
from jpaged.outputs import RequestOutput, ReservedPrefix
from jpaged.sampling_params import BeamSearchParams, SamplingParams
from jpaged.sequence import Sequence, SequenceGroup
from jpaged.speculative.draft_model import DraftModelProposer, check_draft_model
from jpaged.speculative.ngram import NgramProposer
from jpaged.speculative.proposer import Proposer
from jpaged.structured_output.compiler import GrammarCompiler
from jpaged.structured_output.counts import StructuredOutputCounts
from jpaged.structured_output.token_masks import TokenMasks
from jpaged.worker import warmup
from jpaged.worker.decode_loop_runner import DecodeLoopRunner
from jpaged.worker.model_runner import ModelRunner
from jpaged.worker.step_runner import SingleStepRunner

logger = logging.getLogger("jpaged")

# Names this module held before the engine was split into its parts.
__getattr__ = moved_names(__name__, {
    **{name: "jpaged.engine.machine" for name in (
        "MachineDefaults", "CPU_DEFAULTS", "ACCELERATOR_DEFAULTS", "available_host_memory")},
    "kv_cache_budget": "jpaged.engine.kv_cache_sizing",
    "use_persistent_compilation_cache": "jpaged.engine.compilation",
    "default_buckets": "jpaged.core.step_shapes",
    "step_shapes": "jpaged.core.step_shapes",
})


class LLMEngine:
    """add_request / step / abort / has_unfinished_requests over a loaded model."""

    def __init__(
        self, config: EngineConfig, *, loaded: tuple[Any, LlamaConfig, Any] | None = None
    ):
        """loaded: (model, model_config, tokenizer) already in memory, else config.model loads."""
        # Fallbacks of the step modes (jpaged.core.step_modes): the defaults that gave
        # way as the config was resolved, and the steps that ran another way.
        self.mode_fallbacks = ModeFallbacks()
        # The model's config before its weights: a setting that conflicts with its layer
        # windows raises before anything loads.
        model_config = loaded[1] if loaded else read_model_config(config.model)
        config = self.config = config.with_machine_defaults(
            machine.machine_defaults(), model_config.layer_windows, self.mode_fallbacks)
        meshes = config.replica_meshes()
        if len(meshes) > 1:
            raise ValueError(f"an LLMEngine is one replica, got {len(meshes)} data-parallel "
                             "replicas; run them with LLM or DataParallelEngine")
        mesh = meshes[0]
        if mesh is not None and not lockstep.local_devices(mesh):
            raise ValueError(f"process {jax.process_index()} drives none of the mesh's "
                             f"devices {mesh.devices.flatten().tolist()}")
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            check_draft_model(spec, model_config)
        model, self.model_config, self.tokenizer = loaded or load_model(config.model, config.dtype)
        self.adapters = None
        if config.enable_lora:
            self.adapters = self._adapter_table(config, self.model_config, mesh)
            model, self.model_config = with_adapter_slots(
                model, self.model_config, AdapterSlots(config.max_loras, config.max_lora_rank))
        if mesh is not None:
            model, self.model_config = shard_model(model, self.model_config, mesh)
        # Only once the model loaded: a failed LLM(...) leaves the process-wide setting alone.
        if config.persistent_compilation_cache:
            compilation.use_persistent_compilation_cache()
        model_max = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or min(model_max, 2048), model_max)
        groups = kv_cache_groups(config, self.model_config.layer_windows)
        draft = None
        if spec is not None and spec.method == "draft_model":
            draft = load_model(spec.model, config.dtype)[:2]
        device = None if mesh is None else lockstep.local_devices(mesh)[0]
        self.kv_cache_info = size_kv_cache(config, self.model_config, model, self.max_model_len,
                                           device, groups, draft)
        logger.info("%s", self.kv_cache_info)
        num_blocks, num_host_blocks = (self.kv_cache_info.num_blocks,
                                       self.kv_cache_info.num_host_blocks)
        kv_manager = make_kv_manager(config, num_blocks, num_host_blocks, self.max_model_len,
                                     groups)
        mode = step_mode(config)
        scheduler_class = AsyncScheduler if mode is StepMode.ASYNC_SCHEDULING else Scheduler
        scheduler = scheduler_class(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            preemption_mode=config.preemption_mode,
        ), kv_manager, self.adapters)
        runner, shapes = start_runner(config, model, self.model_config, num_blocks=num_blocks,
                                      num_host_blocks=num_host_blocks,
                                      max_model_len=self.max_model_len, mesh=mesh,
                                      groups=groups)
        vocab_size = self.model_config.vocab_size
        proposer = _proposer(config, draft, runner, kv_manager, shapes, vocab_size,
                             self.mode_fallbacks)
        structured_outputs = StructuredOutputCounts()
        step_runner = SingleStepRunner(runner, kv_manager, shapes, proposer,
                                       TokenMasks(vocab_size, structured_outputs),
                                       vocab_size=vocab_size, max_logprobs=config.max_logprobs)
        if mode is StepMode.DECODE_LOOP:
            step_runner = DecodeLoopRunner(step_runner, kv_manager, config.num_decode_steps,
                                           self.mode_fallbacks)
        self.core = EngineCore(scheduler, kv_manager, step_runner, proposer,
                               fallbacks=self.mode_fallbacks,
                               lockstep=lockstep.Lockstep(mesh) if lockstep.spans_processes(mesh)
                               else None)
        eos, tokenizer_eos = self.model_config.eos_token_ids, self.tokenizer.eos_token_id
        self.eos_token_ids = eos if tokenizer_eos in (None, *eos) else (*eos, tokenizer_eos)
        limits = RequestLimits(vocab_size, min(config.max_num_seqs, config.max_num_batched_tokens),
                               config.max_logprobs)
        grammars = GrammarCompiler(self.tokenizer, vocab_size, self.eos_token_ids,
                                   structured_outputs)
        self.input_processor = InputProcessor(self.tokenizer, limits, self.eos_token_ids,
                                              grammars)
        self.stats = EngineStats(kv_cache_dtype=self.kv_cache_info.dtype,
                                 kv_bytes_per_token=self.kv_cache_info.bytes_per_token,
                                 lora_slot_bytes=self.kv_cache_info.adapter_bytes,
                                 step_mode=mode,
                                 mode_fallbacks=self.mode_fallbacks,
                                 structured_outputs=structured_outputs)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.prefix_requests = PrefixRequests(self)
        self._seeds = np.random.default_rng(config.seed)
        self.last_step_error: BaseException | None = None

    @staticmethod
    def _adapter_table(config: EngineConfig, model_config: LlamaConfig, mesh
                       ) -> AdapterSlotTable:
        """The adapter slots the scheduler hands out, reading adapters for this model (laid
        out for its mesh)."""
        size = 1 if mesh is None else mesh.size

        def read(request: LoRARequest):
            adapter = read_adapter(request, model_config, config.max_lora_rank)
            if size == 1:
                return adapter
            return dataclasses.replace(adapter, factors=regroup_adapter(adapter.factors,
                                                                        model_config, size))

        return AdapterSlotTable(config.max_loras, config.max_cpu_loras or config.max_loras, read)

    # The core's parts, as researchers and tests read them.

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def block_manager(self) -> KVManager:
        return self.core.kv_manager

    @property
    def runner(self) -> ModelRunner:
        return self.core.step_runner.model_runner

    @property
    def shapes(self) -> StepShapes:
        return self.core.step_runner.shapes

    @property
    def buckets(self):
        """Deprecated: `shapes.buckets`."""
        warnings.warn("LLMEngine.buckets is deprecated: use LLMEngine.shapes.buckets",
                      DeprecationWarning, stacklevel=2)
        return self.shapes.buckets

    # Requests.

    def process_request(self, request_id: str, prompt: PromptType,
                        params: SamplingParams | BeamSearchParams | None = None, *,
                        cache_salt: str | None = None,
                        lora_request: LoRARequest | None = None) -> EngineRequest:
        """The request parsed, tokenized and checked (`InputProcessor.process`), its LoRA
        adapter read, ready for `add_request`; raises ValueError/TypeError naming the bad
        parameter."""
        request = self.input_processor.process(request_id, prompt, params, cache_salt)
        if lora_request is None:
            return request
        return dataclasses.replace(request, adapter=self.lora_adapter(lora_request))

    def lora_adapter(self, lora_request: LoRARequest):
        """The adapter of `lora_request`, read (or from the host cache) and checked:
        ValueError/TypeError naming the field, changing nothing, if it cannot serve."""
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got "
                            f"{type(lora_request).__name__}")
        if self.adapters is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r}: LoRA is off; start "
                             "the engine with enable_lora=True")
        return self.adapters.adapter(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        """Unload the adapters named `lora_name` (vLLM's remove_lora, by name): the host
        cache drops them and their slots are freed, at once if idle, else when the last
        running request using one ends. Whether one was loaded."""
        return self.adapters is not None and self.adapters.forget(lora_name)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | EngineRequest,
        params: SamplingParams | BeamSearchParams | None = None,
        *,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request. Raises ValueError/TypeError, changing nothing, on bad input.

        prompt: text, token ids, a vLLM prompt dict (jpaged.inputs; a "cache_salt"
        in it counts as the cache_salt argument), or what `process_request` made.
        lora_request: the LoRA adapter it runs with (enable_lora), None the base model.
        """
        request = self.request_of(request_id, prompt, params, cache_salt=cache_salt,
                                  lora_request=lora_request)
        if request_id in self.output_processor:
            raise ValueError(f"request id {request_id!r} is already in use")
        group, search = self._new_group(request)
        self.core.add_request(group, search)
        # An unseeded request draws its seed once accepted: rejected requests do not shift
        # the seeds of the ones after them.
        params = request.params
        seeded = isinstance(params, SamplingParams) and params.seed is not None
        group.seed = params.seed if seeded else int(self._seeds.integers(2**32))
        self.output_processor.add_request(request, group)

    def request_of(self, request_id: str, prompt: PromptType | EngineRequest,
                   params: SamplingParams | BeamSearchParams | None = None, *,
                   cache_salt: str | None = None,
                   lora_request: LoRARequest | None = None) -> EngineRequest:
        """`prompt` as the processed request `request_id` (`process_request`, unless it is
        one already); ValueError if it is one of another id."""
        request = prompt if isinstance(prompt, EngineRequest) else self.process_request(
            request_id, prompt, params, cache_salt=cache_salt, lora_request=lora_request)
        if request.request_id != request_id:
            raise ValueError(f"request id {request_id!r} names a processed request "
                             f"{request.request_id!r}")
        return request

    def check_request(self, request: EngineRequest) -> None:
        """ValueError, changing nothing, unless `request` (from `process_request`) could be
        added: it can run in this engine's limits and pool."""
        self.core.scheduler.check_request(self._new_group(request)[0])

    def _new_group(self, request: EngineRequest) -> tuple[SequenceGroup, BeamSearch | None]:
        """The request's sequence group, and its beam search if it is one."""
        params, prompt_len = request.params, len(request.prompt_token_ids)
        grammar = request.grammar and request.grammar.fork()
        group = SequenceGroup(request.request_id,
                              [Sequence(0, list(request.prompt_token_ids), grammar=grammar)],
                              params, arrival_time=request.arrival_time,
                              cache_salt=prefix_salt(request.cache_salt, request.adapter),
                              eos_token_ids=self.eos_token_ids, adapter=request.adapter)
        search = None
        if isinstance(params, BeamSearchParams):
            max_tokens = StopRule.of(group, self.max_model_len).max_output
            search = BeamSearch(params, prompt_len, self.eos_token_ids, max_tokens)
        return group, search

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks now; unknown ids are ignored."""
        self.core.abort(request_id)
        self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.scheduler.has_unfinished_requests

    def num_unfinished_requests(self) -> int:
        """Requests queued or running (a data-parallel replica's load)."""
        return len(self.output_processor)

    def tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> list[int]:
        """A prompt (text, token ids or a prompt dict) as token ids in the vocabulary."""
        return self.input_processor.tokenize(prompt, add_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], **options) -> list[int]:
        """Chat messages through the model's chat template, as token ids; options:
        InputProcessor.apply_chat_template's."""
        return self.input_processor.apply_chat_template(messages, **options)

    # Reserved prefixes.

    def reserve_prefix(self, prompt: str | list[int], cache_salt: str | None = None
                       ) -> ReservedPrefix:
        """Compute a prefix's KV now and keep its full blocks in the pool until
        `release_prefix`: every later request whose prompt extends the prefix (with the
        same cache_salt) finds them cached, however full the pool gets (the paper's
        Section 4.4: a shared prefix stored in advance).

        prompt: text (tokenized as a prompt, BOS included) or token ids. The prefix runs
        as a prompt of its own through the engine's steps (jpaged.engine.prefix_requests),
        so call this between requests. A prefix shorter than a block holds no block
        (num_blocks 0). Raises, reserving nothing: TypeError for another prompt type or
        non-int token ids; ValueError for an empty prefix, token ids outside the
        vocabulary, prefix caching off or an Orca allocation, a prefix of max_model_len
        tokens or more, one that would leave too few blocks (BlockManager.
        reservable_blocks), and while requests are in flight; the error of a step that
        failed the prefix. After a step that loses the KV cache the prefix is computed
        again and held under the same id.
        """
        if isinstance(prompt, list):
            check_token_ids(prompt)  # an error naming the token, not the prompt forms
        elif not isinstance(prompt, str):
            raise TypeError(f"a prefix is text or a list of token ids, got "
                            f"{type(prompt).__name__}")
        return self.prefix_requests.reserve(self.tokenize(prompt), cache_salt)

    def release_prefix(self, prefix: ReservedPrefix | int) -> None:
        """Return a reserved prefix's blocks to the pool's LRU order, still cached.
        ValueError, changing nothing, for a prefix not reserved (or released already)."""
        prefix_id = prefix.prefix_id if isinstance(prefix, ReservedPrefix) else prefix
        self.prefix_requests.release(prefix_id)

    # One iteration.

    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample once; the outputs of the requests that made progress
        (as each request's output_kind says).

        If the step raises, its requests finish with finish_reason "error" (the
        exception is kept in `last_step_error`) and every other request goes on;
        an interrupt (KeyboardInterrupt) is raised again once the engine is
        consistent, and so is a block id outside the KV pool (BlockIdOutOfRange, an
        IndexError: the engine's block tables are corrupt, so it must not go on).
        """
        started = time.perf_counter()
        outputs = []
        for core in self.core.step():  # one, or with async scheduling those that arrived
            outputs += self._process(core, started)
            started = time.perf_counter()
        return outputs

    def _process(self, core: CoreOutput, started: float) -> list[RequestOutput]:
        """A step's outputs; the sequences its stop strings ended end; its statistics."""
        outputs, stops = self.output_processor.process(core, self.stats)
        queues = core.stats
        if stops:
            for group, seq, num_output_tokens in stops:
                self.core.scheduler.finish_seq(group, seq, num_output_tokens=num_output_tokens)
            queues = self.core.scheduler.stats()
        self.stats.record_blocks(core.kv_blocks)
        self.stats.spec_decode.record(core.proposals)
        manager = self.core.kv_manager
        self.stats.record_step(core.plan, queues, manager.prefix_cache_stats,
                               manager.host_pool_counts(self.kv_cache_info.host_block_bytes),
                               started, time.perf_counter())
        outputs = self.prefix_requests.users_outputs(outputs)
        if core.kv_lost:
            self.prefix_requests.recompute_lost()
        if core.error is not None:
            self.last_step_error = core.error
            if is_fatal(core.error):
                raise core.error
        return outputs

    def warmup(self) -> int:
        """Compile every step shape the limits allow, and what follows a step, for the
        step runner and the proposer's runners (jpaged.worker.warmup); returns the number
        of step shapes run."""
        feeds_tokens = isinstance(self.scheduler, AsyncScheduler)
        warmup.run(self.core.step_runner.warmup_calls(feeds_tokens))
        return len(self.shapes.warmup_shapes())

    def check_invariants(self) -> None:
        """Check the KV blocks against the live sequences; RuntimeError on a violation.

        Every device and host block's reference count equals the number of live
        block tables (or reservations) holding it (so a block is free exactly
        when none does), the free counts agree, and the logical block count is
        the tables' total.
        """
        self.core.check_invariants()

    def state(self) -> EngineState:
        """The queues and the KV pool, for a server's metrics."""
        scheduler, manager = self.core.scheduler, self.core.kv_manager
        stats = manager.prefix_cache_stats
        return EngineState(
            num_running=scheduler.num_running, num_waiting=scheduler.num_waiting,
            num_swapped=scheduler.num_swapped, kv_blocks_used=manager.physical_blocks_used,
            kv_blocks_total=manager.num_device_blocks, prefix_cache_query_tokens=stats.query_tokens,
            prefix_cache_hit_tokens=stats.hit_tokens, num_preemptions=scheduler.num_preemptions,
            prefix_cache_tier_hit_tokens=stats.tier_hit_tokens,
            host_pool=manager.host_pool_counts(self.kv_cache_info.host_block_bytes),
            kv_group_blocks_used=manager.group_blocks_used,
            kv_blocks_reserved=manager.num_reserved_blocks,
            kv_cache_dtype=self.kv_cache_info.dtype,
            kv_bytes_per_token=self.kv_cache_info.bytes_per_token,
            spec_decode=SpecDecodeCounts().add(self.stats.spec_decode),
            structured_outputs=StructuredOutputCounts().add(self.stats.structured_outputs),
            mode_fallbacks=dict(self.mode_fallbacks.counts),
            lora=LoRACounts() if self.adapters is None else LoRACounts.of(
                self.adapters, self.kv_cache_info.adapter_bytes,
                (*scheduler.running, *scheduler.swapped), scheduler.waiting))


def _proposer(config: EngineConfig, draft, runner: ModelRunner, kv_manager: KVManager,
              shapes: StepShapes, vocab_size: int, fallbacks: ModeFallbacks) -> Proposer:
    """The speculative_config's proposer (one that proposes nothing without one); a
    draft model runs on a runner of its own, laid out as the target's."""
    spec = config.speculative_config
    if spec is None:
        return Proposer()
    if draft is None:
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                             spec.prompt_lookup_max, fallbacks=fallbacks)
    draft_runner = ModelRunner(
        *draft, num_blocks=runner.num_blocks, block_size=config.block_size,
        num_host_blocks=runner.num_host_blocks, kv_dtype=config.kv_dtype,
        attention_backend=runner.attention_backend, interpret=config.interpret,
        logit_rows_per_seq=runner.logit_rows_per_seq)
    return DraftModelProposer(draft_runner, kv_manager, shapes, vocab_size,
                              fallbacks=fallbacks)
