"""LLM: the offline-inference facade, with vLLM's shape.

    llm = LLM(model="smollm2", block_size=16)
    outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0))
    outputs[0].outputs[0].text
"""

from __future__ import annotations

import itertools
from typing import Any

from tqdm import tqdm

from jpaged.engine import EngineConfig, LLMEngine, Prompt
from jpaged.outputs import RequestOutput
from jpaged.sampling_params import SamplingParams


def _as_prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    """One prompt (text, token ids, chat messages) or a list of them -> a list."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and not isinstance(prompts[0], str | list):
        return [prompts]
    return list(prompts)


class LLM:
    """Loads a model and serves batches of prompts with continuous batching.

    Keyword arguments are EngineConfig fields (block_size, num_blocks,
    kv_cache_memory, max_num_seqs, enable_prefix_caching, ...).
    """

    def __init__(self, model: str = "smollm2", *, loaded: tuple | None = None, **kwargs: Any):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs), loaded=loaded)
        self._request_ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order.

        Every prompt is checked before any is queued, so a bad one raises
        ValueError/TypeError and nothing runs.
        """
        prompt_list = _as_prompt_list(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompt_list):
                raise ValueError(
                    f"got {len(sampling_params)} sampling params for {len(prompt_list)} prompts"
                )
            params_list = sampling_params
        else:
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        for prompt in prompt_list:
            self.engine.tokenize(prompt)
        request_ids = [f"generate-{next(self._request_ids)}" for _ in prompt_list]
        for request_id, prompt, params in zip(request_ids, prompt_list, params_list, strict=True):
            self.engine.add_request(request_id, prompt, params)
        return self._run_to_completion(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """generate() for one conversation or a list of them (the model's chat template)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate(conversations, sampling_params, use_tqdm=use_tqdm)

    def _run_to_completion(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        with tqdm(total=len(request_ids), disable=not use_tqdm, desc="requests") as bar:
            while len(finished) < len(request_ids) and self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]
