"""LLM: the offline-inference facade, with vLLM's shape.

    llm = LLM(model="smollm2", block_size=16)
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0))
    outputs[0].outputs[0].text
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm

from jpaged.engine.config import EngineConfig
from jpaged.engine.data_parallel import DataParallelEngine
from jpaged.engine.llm_engine import LLMEngine
from jpaged.engine.lockstep import check_process_layout
from jpaged.inputs import PromptType, as_prompt_list
from jpaged.lora.request import LoRARequest
from jpaged.outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput, ReservedPrefix
from jpaged.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

Conversation = list[dict[str, str]]


class LLM:
    """Loads a model and serves batches of prompts with continuous batching.

    Keyword arguments are EngineConfig fields, vLLM's names among them (block_size,
    kv_cache_memory_bytes, gpu_memory_utilization, num_gpu_blocks_override,
    swap_space, max_num_seqs, enable_prefix_caching, preemption_mode,
    tensor_parallel_size, data_parallel_size, mesh, ...); an unknown one raises a
    TypeError naming the closest. With more than one data-parallel replica the engine
    is a DataParallelEngine. Tensor parallelism on a CPU needs simulated devices:
    JAX_NUM_CPU_DEVICES=N in the environment, or
    jax.config.update("jax_num_cpu_devices", N) before JAX first runs anything.
    """

    def __init__(self, model: str = "smollm2", *, loaded: tuple | None = None, **kwargs: Any):
        config = EngineConfig(model=model, **kwargs)
        meshes = config.replica_meshes()
        check_process_layout(meshes)
        engine_type = DataParallelEngine if len(meshes) > 1 else LLMEngine
        self.engine = engine_type(config, loaded=loaded)
        self._request_ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; one finished output per prompt, in order.

        lora_request: the LoRA adapter of every prompt, or a list of one per prompt (None
        in it: the base model); needs an engine with enable_lora=True.

        prompts: a prompt (str, token ids, {"prompt": ...}, {"prompt_token_ids": ...})
        or a list of them. Every prompt is processed (and tokenized, once) before
        any is queued, and all are queued before any runs, so a bad one raises
        ValueError/TypeError and nothing runs. As in vLLM, outputs are collected
        when final whatever each request's output_kind (use `stream` for deltas).
        """
        prompt_list = as_prompt_list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        final = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                 for p in params_list]
        return self._run(prompt_list, final, use_tqdm,
                         _per_prompt("lora_request", lora_request, len(prompt_list)))

    def chat(
        self,
        messages: Conversation | list[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """generate() for one conversation or a list of them, through the model's chat
        template (each message a {"role": ..., "content": ...} dict).

        add_generation_prompt opens the assistant's turn; continue_final_message instead
        continues the last message (the assistant's); chat_template: a jinja2 template
        used instead of the model's (a model without one needs it); chat_template_kwargs
        are more variables for the template; lora_request: as generate's (vLLM's
        `LLM.chat` arguments)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        options = dict(add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message,
                       chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
        prompts = [{"prompt_token_ids": self.engine.apply_chat_template(c, **options)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt, inside the engine: each prompt's beams run as
        one sequence group and share the KV blocks of their common prefix."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        prompt_list = as_prompt_list(prompts)
        outputs = self._run(prompt_list, [params] * len(prompt_list), use_tqdm)
        return [
            BeamSearchOutput([
                BeamSearchSequence(
                    tokens=output.prompt_token_ids + beam.token_ids, logprobs=beam.logprobs,
                    cum_logprob=beam.cumulative_logprob, text=beam.text,
                    finish_reason=beam.finish_reason, stop_reason=beam.stop_reason,
                )
                for beam in output.outputs
            ])
            for output in outputs
        ]

    def stream(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Run one prompt, yielding its deltas as they come (output_kind DELTA): each
        holds, per sample, the tokens, text and logprobs new since the last one.
        Other requests queued in the engine run alongside."""
        params = dataclasses.replace(sampling_params or SamplingParams(),
                                     output_kind=RequestOutputKind.DELTA)
        request_id = f"stream-{next(self._request_ids)}"
        self.engine.add_request(request_id, prompt, params)
        try:
            while True:
                for output in self.engine.step():
                    if output.request_id == request_id:
                        yield output
                        if output.finished:
                            return
        finally:
            self.engine.abort(request_id)  # a no-op once finished

    def reserve_prefix(self, prompt: str | list[int], cache_salt: str | None = None
                       ) -> ReservedPrefix:
        """Compute a shared prefix's KV now and keep its full blocks in the pool until
        `release_prefix` (the paper's Section 4.4): every later prompt that extends it
        (with the same cache_salt) maps its first blocks onto them and computes only the
        rest, however full the pool gets. With several data-parallel replicas each holds
        it. See LLMEngine.reserve_prefix for what it refuses."""
        return self.engine.reserve_prefix(prompt, cache_salt)

    def release_prefix(self, prefix: ReservedPrefix | int) -> None:
        """Return a reserved prefix's blocks to the pool's LRU order (still cached until
        evicted); ValueError for a prefix not reserved."""
        self.engine.release_prefix(prefix)

    def _params_per_prompt(self, sampling_params, num_prompts: int) -> list[SamplingParams]:
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams | list | tuple):
            raise TypeError(
                f"sampling_params must be SamplingParams, got {type(params).__name__}"
            )
        return _per_prompt("sampling_params", params, num_prompts)

    def _run(self, prompts: list[PromptType], params: list, use_tqdm: bool,
             lora_requests: list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Process every prompt, queue them all, then step until each is done."""
        for request_params in params:
            if not isinstance(request_params, SamplingParams | BeamSearchParams):
                raise TypeError(
                    f"sampling_params must be SamplingParams, got {type(request_params).__name__}"
                )
        lora_requests = lora_requests or [None] * len(prompts)
        requests = [self.engine.process_request(f"generate-{next(self._request_ids)}", prompt,
                                                request_params, lora_request=lora)
                    for prompt, request_params, lora in zip(prompts, params, lora_requests,
                                                            strict=True)]
        request_ids = [request.request_id for request in requests]
        # All or nothing: a rejected prompt, a failed step or an interrupt withdraws
        # every request of this call (aborting a finished one is a no-op).
        try:
            for request in requests:
                self.engine.add_request(request.request_id, request)
            return self._run_to_completion(request_ids, use_tqdm)
        except BaseException:
            for request_id in request_ids:
                self.engine.abort(request_id)
            raise

    def _run_to_completion(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request is done; raises the error of a step that failed."""
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        self.engine.last_step_error = None
        with tqdm(total=len(request_ids), disable=not use_tqdm, desc="requests") as bar:
            while len(finished) < len(request_ids) and self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
                if self.engine.last_step_error is not None:
                    raise self.engine.last_step_error
        return [finished[request_id] for request_id in request_ids]


def _per_prompt(name: str, value, num_prompts: int) -> list:
    """One value per prompt: `value` for all, or its entries (ValueError naming `name` if
    they are not num_prompts)."""
    if not isinstance(value, list | tuple):
        return [value] * num_prompts
    if len(value) != num_prompts:
        raise ValueError(f"got {len(value)} entries of {name} for {num_prompts} prompts")
    return list(value)
