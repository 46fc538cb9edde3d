"""The OpenAI-compatible endpoints' logic over one AsyncLLMEngine: request bodies to
SamplingParams (their constraints through jpaged.entrypoints.structured_outputs), engine
requests and their streams, responses and server-sent events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from jpaged.engine.async_engine import AsyncLLMEngine, Engine, EngineStoppedError
from jpaged.entrypoints.errors import (
    ApiError,
    RequestFailedError,
    bad_request,
    check_context,
    stream_error,
)
from jpaged.entrypoints.lora import LoRAModule, ServedModels
from jpaged.entrypoints.metrics import ServerMetrics
from jpaged.entrypoints.protocol import (
    ChatCompletionRequest,
    ChatJob,
    CompletionJob,
    CompletionRequest,
    EncodedPrompt,
    Job,
    LoadLoRAAdapterRequest,
    PromptRun,
    SamplingFields,
    UnloadLoRAAdapterRequest,
    next_text_offset,
)
from jpaged.entrypoints.structured_outputs import Constraint, request_constraint
from jpaged.lora.request import LoRARequest
from jpaged.outputs import RequestOutput
from jpaged.sampling_params import SamplingParams

T = TypeVar("T")
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids",
                   "ignore_eos", "min_tokens", "max_tokens", "logprobs", "skip_special_tokens",
                   "include_stop_str_in_output")


# Requests to SamplingParams.


def completion_sampling_params(body: CompletionRequest, max_logprobs: int,
                               constraint: Constraint | None = None) -> SamplingParams:
    """The engine's parameters for a completions request (constraint: its output's, from
    request_constraint). max_tokens=0 (allowed with echo) generates one token, which the
    response leaves out: the engine always samples at least one token. echo with logprobs
    asks for the prompt's log-probabilities unless prompt_logprobs says otherwise; best_of
    samples best_of."""
    if body.suffix is not None:
        raise ApiError(400, "suffix is not supported: jpaged completes a prompt's end only",
                       "suffix")
    if body.max_tokens < 0 or (body.max_tokens == 0 and not body.echo):
        raise ApiError(400, f"max_tokens must be >= 1 (or 0 with echo), got {body.max_tokens}",
                       "max_tokens")
    n = _best_of(body)
    prompt_logprobs = body.prompt_logprobs
    if prompt_logprobs is None and body.echo:
        prompt_logprobs = body.logprobs
    return _sampling_params(body, {}, max_logprobs, constraint, n=n,
                            max_tokens=max(body.max_tokens, 1), logprobs=body.logprobs,
                            prompt_logprobs=prompt_logprobs)


def _best_of(body: CompletionRequest) -> int:
    """The samples per prompt: best_of candidates, of which the response keeps n."""
    if body.best_of is None:
        return body.n
    if body.best_of < body.n:
        raise ApiError(400, f"best_of must be >= n, got n={body.n} and best_of={body.best_of}",
                       "best_of")
    if body.stream and body.best_of != body.n:
        raise ApiError(400, f"best_of={body.best_of} with n={body.n} cannot stream: the best "
                            "candidates are known only when all have finished", "best_of")
    return body.best_of


def chat_max_tokens(body: ChatCompletionRequest) -> tuple[int | None, str]:
    """(the output token limit, the field that set it): max_completion_tokens first."""
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


def chat_sampling_params(body: ChatCompletionRequest, max_logprobs: int,
                         constraint: Constraint | None = None) -> SamplingParams:
    """The engine's parameters for a chat request (constraint: its output's, from
    request_constraint): logprobs=True asks for the sampled tokens' log-probabilities with
    top_logprobs alternatives each."""
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    max_tokens, param = chat_max_tokens(body)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"{param} must be >= 1, got {max_tokens}", param)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _sampling_params(body, {"max_tokens": param, "logprobs": "top_logprobs"},
                            max_logprobs, constraint, max_tokens=max_tokens, logprobs=logprobs,
                            prompt_logprobs=body.prompt_logprobs)


def _sampling_params(body: SamplingFields, renamed: dict[str, str], max_logprobs: int,
                     constraint: Constraint | None, **specific) -> SamplingParams:
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options needs stream=true", "stream_options")
    if specific.get("prompt_logprobs") == -1:  # vLLM's "the whole vocabulary"
        raise ApiError(400, "prompt_logprobs=-1 asks for every token of the vocabulary; "
                            f"this server gives at most max_logprobs={max_logprobs}",
                       "prompt_logprobs")
    common = {name: getattr(body, name) for name in SAMPLING_FIELDS if hasattr(body, name)}
    common |= {"logit_bias": _logit_bias(body),
               "structured_outputs": None if constraint is None else constraint.params}
    try:
        return SamplingParams(**(common | specific))
    except (ValueError, TypeError) as error:
        raise bad_request(error, renamed) from error


def _logit_bias(body: SamplingFields) -> dict[int, float] | None:
    """The JSON object's token-id keys as ints."""
    if body.logit_bias is None:
        return None
    keys = [key for key in body.logit_bias if not key.strip().lstrip("-").isdigit()]
    if keys:
        raise ApiError(400, f"logit_bias keys must be token ids, got {keys[:5]}", "logit_bias")
    return {int(key): bias for key, bias in body.logit_bias.items()}


# Running one HTTP request's engine requests.


def encode_prompt(engine: Engine, prompt: str | list[int]) -> EncodedPrompt:
    """On the engine thread: a completions prompt's token ids and texts."""
    token_ids = engine.tokenize(prompt)
    text = prompt if isinstance(prompt, str) else engine.tokenizer.decode(token_ids)
    return EncodedPrompt(token_ids, text, engine.tokenizer.decode(token_ids[:1]))


async def merged_deltas(runs: list[PromptRun]) -> AsyncIterator[tuple[PromptRun, RequestOutput]]:
    """Every run's deltas, as they arrive, after adding each to its run."""
    pending = {asyncio.ensure_future(anext(run.stream)): run for run in runs}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                run = pending.pop(future)
                try:
                    delta = future.result()
                except StopAsyncIteration:
                    continue
                run.add(delta)
                yield run, delta
                pending[asyncio.ensure_future(anext(run.stream))] = run
    finally:
        for future in pending:
            future.cancel()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """The result of `work`, unless the client disconnects first: then `work` is
    cancelled (aborting its engine requests) and a 499 response is returned to nobody."""
    work_task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
    if work_task in done:
        return work_task.result()
    await asyncio.wait({work_task})  # its cancellation closes the streams
    return Response(status_code=499)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


# The endpoints.


class OpenAIServing:
    """The endpoints' logic over one engine and the models it serves (the base model
    and its LoRA adapters: jpaged.entrypoints.lora); chat_template: the jinja2 template
    chat requests use instead of the model's (serve's --chat-template)."""

    def __init__(self, engine: AsyncLLMEngine, served_model_name: str,
                 enable_prompt_tokens_details: bool = False, chat_template: str | None = None,
                 *, lora_modules: Sequence[LoRAModule] = (), runtime_lora_updating: bool = False,
                 lora_allowed_dir: str | None = None):
        self.engine = engine
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.chat_template = chat_template
        self.max_model_len = engine.engine.max_model_len
        self.served_models = ServedModels(served_model_name, engine.engine.config.model,
                                          self.max_model_len, lora_modules,
                                          runtime_lora_updating, lora_allowed_dir)
        self.max_logprobs = engine.engine.config.max_logprobs
        self.metrics = ServerMetrics(engine)

    def models(self) -> dict:
        return {"object": "list", "data": self.served_models.cards()}

    def model(self, model_id: str) -> dict:
        """GET /v1/models/{model_id}: the model's or adapter's card, or 404."""
        return self.served_models.card(model_id)

    def response_model(self, model: str | None) -> str:
        """The `model` a response names: the request's, or the base model's."""
        return model or self.served_models.base_name

    # /v1/load_lora_adapter, /v1/unload_lora_adapter

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> Response:
        """Read and check the adapter, then list it: 400 naming the file and field of
        one the engine cannot serve, or a path outside the allowed directory."""
        self.served_models.check_updates_allowed()
        request = self.served_models.begin_load(body.lora_name, body.lora_path)
        await self.on_engine(lambda engine: engine.lora_adapter(request), "lora_path")
        self.served_models.finish_load(request)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 "successfully.")

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> Response:
        """Take the adapter off the list and unload it: running requests finish with it,
        and its slot is freed when the last of them ends."""
        self.served_models.check_updates_allowed()
        name = self.served_models.unload(body.lora_name, body.lora_int_id)
        await self.engine.run(lambda engine: engine.remove_lora(name))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def on_engine(self, fn: Callable[[Engine], T], param: str) -> T:
        """fn(engine) on the engine thread; its ValueError/TypeError is a 400 naming the
        parameter it carries (jpaged.errors), else `param`."""
        try:
            return await self.engine.run(fn)
        except (ValueError, TypeError) as error:
            raise ApiError(400, str(error), getattr(error, "param", None) or param) from error

    async def start(self, request_id: str, prompts: list[EncodedPrompt], params: SamplingParams,
                    cache_salt: str | None, renamed: dict[str, str],
                    constraint: Constraint | None = None,
                    lora_request: LoRARequest | None = None) -> list[PromptRun]:
        """One engine request per prompt (with the LoRA adapter `lora_request`, None: the
        base model); all or none of them. A ValueError/TypeError is a 400 naming the
        request's field: `renamed` maps the engine's names to the request's, and the
        constraint names what of it does not compile."""
        runs: list[PromptRun] = []
        try:
            for index, prompt in enumerate(prompts):
                stream = await self.engine.generate(
                    f"{request_id}-{index}", {"prompt_token_ids": prompt.token_ids}, params,
                    cache_salt=cache_salt, lora_request=lora_request)
                runs.append(PromptRun(index, prompt, stream))
        except BaseException as error:
            for run in runs:
                run.stream.close()
            if isinstance(error, ValueError | TypeError):
                api_error = None if constraint is None else constraint.api_error(error)
                raise (api_error or bad_request(error, renamed)) from error
            raise
        return runs

    async def deltas(self, runs: list[PromptRun]
                     ) -> AsyncIterator[tuple[PromptRun, RequestOutput]]:
        """merged_deltas, observing finished requests; raises RequestFailedError for a
        request the engine ended with an error."""
        async with contextlib.aclosing(merged_deltas(runs)) as merged:
            async for run, delta in merged:
                if any(o.finish_reason == "error" for o in delta.outputs):
                    raise RequestFailedError(f"request {run.stream.request_id} failed in the "
                                             "engine; see the server log")
                if delta.finished:
                    self.metrics.observe_finished(run, delta)
                yield run, delta

    async def _run_to_completion(self, job: Job) -> None:
        try:
            async with contextlib.aclosing(self.deltas(job.runs)) as deltas:
                async for _ in deltas:
                    pass
        finally:
            job.close()

    async def _events(self, job: Job, chunks: AsyncIterator[dict], kind: str
                      ) -> AsyncIterator[str]:
        """A stream's server-sent events: its chunks, the usage chunk if asked for, then
        [DONE]; a failure (the engine's, or its shutdown) sends an error event first."""
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield sse(chunk)
            if job.body.include_usage:
                yield sse(job.envelope([], kind) | {"usage": job.usage()})
        except (RequestFailedError, EngineStoppedError) as error:
            yield sse(stream_error(error))
        finally:
            job.close()
        yield "data: [DONE]\n\n"

    # /v1/completions

    async def create_completion(self, body: CompletionRequest, raw_request: Request) -> Any:
        lora_request = self.served_models.lora_request(body.model)
        constraint = request_constraint(body)
        params = completion_sampling_params(body, self.max_logprobs, constraint)
        prompt_list = body.prompts()
        if not prompt_list:
            raise ApiError(400, "prompt must not be an empty list", "prompt")
        prompts = await self.on_engine(
            lambda engine: [encode_prompt(engine, p) for p in prompt_list], "prompt")
        for prompt in prompts:
            check_context(len(prompt.token_ids), body.max_tokens, self.max_model_len,
                          "max_tokens", "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        runs = await self.start(request_id, prompts, params, body.cache_salt,
                                {"n": "best_of"} if body.best_of is not None else {}, constraint,
                                lora_request)
        job = CompletionJob(request_id, body, runs, self.response_model(body.model),
                            cached_tokens_in_usage=self.enable_prompt_tokens_details)
        if body.stream:
            return StreamingResponse(
                self._events(job, self._completion_chunks(job), "text_completion"),
                media_type="text/event-stream")
        return await until_disconnected(raw_request, self._completion_response(job))

    async def _completion_response(self, job: CompletionJob) -> dict:
        await self._run_to_completion(job)
        choices = [job.choice(run, output, index)
                   for run in job.runs for index, output in job.returned(run)]
        return job.envelope(choices) | {"usage": job.usage()}

    async def _completion_chunks(self, job: CompletionJob) -> AsyncIterator[dict]:
        """One chunk per choice's new piece."""
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token
        async with contextlib.aclosing(self.deltas(job.runs)) as deltas:
            async for run, delta in deltas:
                for piece in delta.outputs:
                    index = job.stream_index(run, piece)
                    offset = offsets.get(index, 0)
                    choice = job.choice(run, piece, index, index not in offsets, offset)
                    offsets[index] = next_text_offset(choice, offset)
                    yield job.chunk([choice], "text_completion", run, piece.index)

    # /v1/chat/completions

    async def create_chat_completion(self, body: ChatCompletionRequest,
                                     raw_request: Request) -> Any:
        lora_request = self.served_models.lora_request(body.model)
        constraint = request_constraint(body)
        params = chat_sampling_params(body, self.max_logprobs, constraint)
        messages = [message.as_template_message() for message in body.messages]
        options = body.template_options() | {"chat_template": self.chat_template}
        token_ids = await self.on_engine(
            lambda engine: engine.apply_chat_template(messages, **options), "messages")
        max_tokens, param = chat_max_tokens(body)
        check_context(len(token_ids), max_tokens, self.max_model_len,
                      param if max_tokens is not None else "messages", "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        runs = await self.start(request_id, [EncodedPrompt(token_ids)], params, body.cache_salt,
                                {"max_tokens": param, "logprobs": "top_logprobs",
                                 "prompt": "messages"}, constraint, lora_request)
        job = ChatJob(request_id, body, runs, self.response_model(body.model),
                      cached_tokens_in_usage=self.enable_prompt_tokens_details,
                      forced_calls=None if constraint is None else constraint.forced_calls)
        if body.stream:
            return StreamingResponse(
                self._events(job, self._chat_chunks(job), "chat.completion.chunk"),
                media_type="text/event-stream")
        return await until_disconnected(raw_request, self._chat_response(job))

    async def _chat_response(self, job: ChatJob) -> dict:
        await self._run_to_completion(job)
        choices = [job.choice(output, "message", job.message(output))
                   for _, output in job.returned(job.runs[0])]
        return job.envelope(choices, "chat.completion") | job.extras() | {"usage": job.usage()}

    async def _chat_chunks(self, job: ChatJob) -> AsyncIterator[dict]:
        """Each choice's role, its echoed text if any, then one chunk per new piece (for
        forced tool calls, per piece that advances them or ends the choice); the first
        piece's chunk carries prompt_logprobs when asked for."""
        kind, run = "chat.completion.chunk", job.runs[0]
        for index in range(job.body.n):
            yield job.chunk([job.opening(index)], kind, run, index)
        if job.body.echoed_text:
            for index in range(job.body.n):
                echo = {"index": index, "delta": {"content": job.body.echoed_text},
                        "logprobs": None, "finish_reason": None}
                yield job.chunk([echo], kind, run, index)
        extras = None
        async with contextlib.aclosing(self.deltas(job.runs)) as deltas:
            async for _, delta in deltas:
                for piece in delta.outputs:
                    message = job.delta(piece)
                    if message is None:
                        continue
                    choice = job.choice(piece, "delta", message)
                    chunk = job.chunk([choice], kind, run, piece.index)
                    if extras is None:
                        extras = job.extras()
                        chunk |= extras
                    yield chunk
