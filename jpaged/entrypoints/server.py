"""An OpenAI-compatible HTTP server over AsyncLLMEngine, on FastAPI and uvicorn.

    GET  /v1/models             the served model
    POST /v1/completions        text or token-id prompts (a batch too), echo, logprobs
    POST /v1/chat/completions   messages through the model's chat template
    GET  /health                200 while the engine runs, else 503
    GET  /metrics               Prometheus text format

Streams are server-sent events ending with `data: [DONE]`; a request that fails
mid-stream sends `data: {"error": ...}` before it. Errors have OpenAI's shape,
{"error": {"message", "type", "param", "code"}}, and vLLM's status codes: 400
for bad parameters, malformed JSON, wrong types, unsupported fields and prompts
over max_model_len; 401 without the API key (when one is set, for /v1 paths);
404 for an unknown model; 413 for a body over max_body_bytes; 503 with
Retry-After when max_waiting requests wait.

A client that disconnects aborts its requests: their KV blocks are freed before
the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from jpaged.engine.async_engine import (
    AsyncLLMEngine,
    Engine,
    EngineStoppedError,
    QueueFullError,
)
from jpaged.entrypoints.protocol import (
    ChatCompletionRequest,
    ChatJob,
    CompletionJob,
    CompletionRequest,
    EncodedPrompt,
    Job,
    PromptRun,
    SamplingFields,
    next_text_offset,
)
from jpaged.outputs import RequestOutput
from jpaged.sampling_params import SamplingParams

T = TypeVar("T")
logger = logging.getLogger("jpaged")

# Request bodies larger than this get 413 (8 MiB: a few thousand long token-id prompts).
MAX_BODY_BYTES = 8 * 2**20
# On SIGINT/SIGTERM running requests get this long to finish before they are aborted.
SHUTDOWN_GRACE_S = 10
RETRY_AFTER_S = 1
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 413: "RequestTooLargeError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids",
                   "ignore_eos", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs",
                   "skip_special_tokens", "include_stop_str_in_output")


# Errors.


class ApiError(Exception):
    """An error the client caused or must wait out, answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"),
                      "param": param, "code": status}}


def bad_request(error: Exception, names: tuple[str, ...], renamed: dict[str, str]) -> ApiError:
    """400 for a ValueError/TypeError from SamplingParams or add_request; its message
    starts with the parameter's name, reported under the request's name for it."""
    message = str(error)
    param = next((name for name in names
                  if re.match(rf"(every entry of )?{name}\b", message)), None)
    return ApiError(400, message, renamed.get(param, param))


def validation_error(error: RequestValidationError) -> ApiError:
    """400 naming the first bad top-level field (its union alternatives' messages joined)."""
    errors = error.errors()
    first = errors[0]
    location = [str(part) for part in first["loc"] if part != "body"]
    if first["type"] == "json_invalid":
        return ApiError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', '')}")
    if not location:
        return ApiError(400, f"the request body: {first['msg']}")
    param = location[0]
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"unsupported parameter '{'.'.join(location)}': jpaged does not "
                             "implement it", param)
    if first["type"] == "missing":
        return ApiError(400, f"missing required parameter '{'.'.join(location)}'", param)
    messages = dict.fromkeys(
        f"{'.'.join(str(p) for p in e['loc'] if p != 'body')}: {e['msg']}"
        for e in errors if e["loc"][1:2] == (param,)
    )
    return ApiError(400, f"invalid '{param}': " + "; ".join(list(messages)[:4]), param)


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int,
                  param: str) -> None:
    """400 unless the prompt and `max_tokens` new tokens fit in max_model_len."""
    if max_tokens is None and prompt_len >= max_model_len:
        raise ApiError(400, f"the prompt has {prompt_len} tokens, leaving no room for output "
                            f"within this model's maximum context length of {max_model_len} "
                            "tokens", param)
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise ApiError(400, f"this model's maximum context length is {max_model_len} tokens, "
                            f"but the prompt has {prompt_len} tokens and {param}={max_tokens} "
                            f"asks for {max_tokens} more", param)


# Requests to SamplingParams.


def completion_sampling_params(body: CompletionRequest) -> SamplingParams:
    """The engine's parameters for a completions request. max_tokens=0 (allowed with
    echo) generates one token, which the response leaves out: the engine always
    samples at least one token."""
    if body.max_tokens < 0 or (body.max_tokens == 0 and not body.echo):
        raise ApiError(400, f"max_tokens must be >= 1 (or 0 with echo), got {body.max_tokens}",
                       "max_tokens")
    return _sampling_params(body, {}, max_tokens=max(body.max_tokens, 1), logprobs=body.logprobs,
                            prompt_logprobs=body.logprobs if body.echo else None)


def chat_max_tokens(body: ChatCompletionRequest) -> tuple[int | None, str]:
    """(the output token limit, the field that set it): max_completion_tokens first."""
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


def chat_sampling_params(body: ChatCompletionRequest) -> SamplingParams:
    """The engine's parameters for a chat request: logprobs=True asks for the sampled
    tokens' log-probabilities with top_logprobs alternatives each."""
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    max_tokens, param = chat_max_tokens(body)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"{param} must be >= 1, got {max_tokens}", param)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _sampling_params(body, {"max_tokens": param, "logprobs": "top_logprobs"},
                            max_tokens=max_tokens, logprobs=logprobs)


def _sampling_params(body: SamplingFields, renamed: dict[str, str], **specific) -> SamplingParams:
    common = {name: getattr(body, name) for name in SAMPLING_FIELDS if hasattr(body, name)}
    try:
        return SamplingParams(**(common | specific))
    except (ValueError, TypeError) as error:
        raise bad_request(error, SAMPLING_FIELDS, renamed) from error


# Running one HTTP request's engine requests.


def encode_prompt(engine: Engine, prompt: str | list[int]) -> EncodedPrompt:
    """On the engine thread: a completions prompt's token ids and texts."""
    token_ids = engine.tokenize(prompt)
    text = prompt if isinstance(prompt, str) else engine.tokenizer.decode(token_ids)
    return EncodedPrompt(token_ids, text, engine.tokenizer.decode(token_ids[:1]))


class RequestFailedError(RuntimeError):
    """The engine ended a request with finish_reason "error" (its step failed)."""


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


# Metrics.


class EngineCollector:
    """Prometheus gauges and counters read from the engine's published state."""

    def __init__(self, engine: AsyncLLMEngine):
        self.engine = engine

    def collect(self):
        state = self.engine.state
        gauges = (
            ("num_requests_running", "Requests whose sequences run on the device.",
             state.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", state.num_waiting),
            ("num_requests_swapped", "Requests swapped out to host memory.", state.num_swapped),
            ("kv_cache_blocks_used", "Device KV blocks held by live sequences.",
             state.kv_blocks_used),
            ("kv_cache_blocks_total", "Device KV blocks in the pool.", state.kv_blocks_total),
            ("kv_cache_usage_perc", "Fraction of device KV blocks in use (0 to 1).",
             state.kv_usage),
            ("prefix_cache_hit_rate", "Fraction of admitted prompt tokens found in the "
             "prefix cache.", state.prefix_cache_hit_rate),
        )
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(f"jpaged:{name}", documentation, value=value)
        yield CounterMetricFamily("jpaged:num_preemptions", "Sequence groups preempted.",
                                  value=state.num_preemptions)


class ServerMetrics:
    """A Prometheus registry for one app: engine state plus per-request latencies and
    token counts, observed when each request finishes."""

    LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                       60.0, 120.0)

    def __init__(self, engine: AsyncLLMEngine):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.ttft = self._histogram("time_to_first_token_seconds",
                                    "Time from arrival to the first output token.")
        self.tpot = self._histogram("time_per_output_token_seconds",
                                    "Mean time per output token after the first.")
        self.e2e = self._histogram("e2e_request_latency_seconds",
                                   "Time from arrival to the last output token.")
        self.prompt_tokens = Counter("jpaged:prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=self.registry)
        self.generation_tokens = Counter("jpaged:generation_tokens",
                                         "Output tokens of finished requests.",
                                         registry=self.registry)

    def _histogram(self, name: str, documentation: str) -> Histogram:
        return Histogram(f"jpaged:{name}", documentation, buckets=self.LATENCY_BUCKETS,
                         registry=self.registry)

    def observe_finished(self, run: PromptRun, output: RequestOutput) -> None:
        metrics = output.metrics
        self.prompt_tokens.inc(len(run.prompt.token_ids))
        self.generation_tokens.inc(run.num_output_tokens)
        if metrics.ttft is not None:
            self.ttft.observe(metrics.ttft)
        tpot = metrics.tpot(max((len(o.token_ids) for o in run.outputs.values()), default=0))
        if tpot is not None:
            self.tpot.observe(tpot)
        if metrics.finished_time is not None:
            self.e2e.observe(metrics.finished_time - metrics.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# The endpoints.


class OpenAIServing:
    """The endpoints' logic over one engine and one served model name."""

    def __init__(self, engine: AsyncLLMEngine, served_model_name: str):
        self.engine = engine
        self.served_model_name = served_model_name
        self.max_model_len = engine.engine.max_model_len
        self.metrics = ServerMetrics(engine)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves "
                                f"'{self.served_model_name}'", "model")

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "jpaged", "root": self.engine.engine.config.model,
            "max_model_len": self.max_model_len,
        }]}

    async def on_engine(self, fn: Callable[[Engine], T], param: str) -> T:
        """fn(engine) on the engine thread; its ValueError/TypeError is a 400 for `param`."""
        try:
            return await self.engine.run(fn)
        except (ValueError, TypeError) as error:
            raise ApiError(400, str(error), param) from error

    async def start(self, request_id: str, prompts: list[EncodedPrompt], params: SamplingParams,
                    cache_salt: str | None, renamed: dict[str, str]) -> list[PromptRun]:
        """One engine request per prompt; all or none of them."""
        runs: list[PromptRun] = []
        try:
            for index, prompt in enumerate(prompts):
                stream = await self.engine.generate(
                    f"{request_id}-{index}", {"prompt_token_ids": prompt.token_ids}, params,
                    cache_salt=cache_salt)
                runs.append(PromptRun(index, prompt, stream))
        except BaseException as error:
            for run in runs:
                run.stream.close()
            if isinstance(error, ValueError | TypeError):
                raise bad_request(error, SAMPLING_FIELDS, renamed) from error
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

    # /v1/completions

    async def create_completion(self, body: CompletionRequest, raw_request: Request) -> Any:
        self.check_model(body.model)
        params = completion_sampling_params(body)
        prompt_list = body.prompts()
        if not prompt_list:
            raise ApiError(400, "prompt must not be an empty list", "prompt")
        prompts = await self.on_engine(
            lambda engine: [encode_prompt(engine, p) for p in prompt_list], "prompt")
        for prompt in prompts:
            check_context(len(prompt.token_ids), body.max_tokens, self.max_model_len,
                          "max_tokens")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        runs = await self.start(request_id, prompts, params, body.cache_salt, {})
        job = CompletionJob(request_id, body, runs, self.served_model_name)
        if body.stream:
            return StreamingResponse(self._completion_events(job),
                                     media_type="text/event-stream")
        return await until_disconnected(raw_request, self._completion_response(job))

    async def _completion_response(self, job: CompletionJob) -> dict:
        await self._run_to_completion(job)
        choices = [job.choice(run, output)
                   for run in job.runs for output in sorted(run.outputs.values(),
                                                            key=lambda o: o.index)]
        return job.envelope(choices) | {"usage": job.usage()}

    async def _run_to_completion(self, job: Job) -> None:
        try:
            async with contextlib.aclosing(self.deltas(job.runs)) as deltas:
                async for _ in deltas:
                    pass
        finally:
            job.close()

    async def _completion_events(self, job: CompletionJob) -> AsyncIterator[str]:
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token
        try:
            async with contextlib.aclosing(self.deltas(job.runs)) as deltas:
                async for run, delta in deltas:
                    choices = []
                    for piece in delta.outputs:
                        index = job.choice_index(run, piece)
                        offset = offsets.get(index, 0)
                        choices.append(job.choice(run, piece, index not in offsets, offset))
                        offsets[index] = next_text_offset(choices[-1], offset)
                    yield sse(job.envelope(choices))
            if job.body.include_usage:
                yield sse(job.envelope([]) | {"usage": job.usage()})
        except (RequestFailedError, EngineStoppedError) as error:
            yield sse(stream_error(error))
        finally:
            job.close()
        yield "data: [DONE]\n\n"

    # /v1/chat/completions

    async def create_chat_completion(self, body: ChatCompletionRequest,
                                     raw_request: Request) -> Any:
        self.check_model(body.model)
        params = chat_sampling_params(body)
        messages = [message.as_template_message() for message in body.messages]
        token_ids = await self.on_engine(lambda engine: engine.apply_chat_template(messages),
                                         "messages")
        max_tokens, param = chat_max_tokens(body)
        check_context(len(token_ids), max_tokens, self.max_model_len,
                      param if max_tokens is not None else "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        runs = await self.start(request_id, [EncodedPrompt(token_ids)], params, body.cache_salt,
                                {"max_tokens": param, "logprobs": "top_logprobs"})
        job = ChatJob(request_id, body, runs, self.served_model_name)
        if body.stream:
            return StreamingResponse(self._chat_events(job), media_type="text/event-stream")
        return await until_disconnected(raw_request, self._chat_response(job))

    async def _chat_response(self, job: ChatJob) -> dict:
        await self._run_to_completion(job)
        outputs = sorted(job.runs[0].outputs.values(), key=lambda o: o.index)
        choices = [job.choice(output, "message", {"role": "assistant", "content": output.text})
                   for output in outputs]
        return job.envelope(choices, "chat.completion") | {"usage": job.usage()}

    async def _chat_events(self, job: ChatJob) -> AsyncIterator[str]:
        try:
            roles = [{"index": i, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None} for i in range(job.body.n)]
            yield sse(job.envelope(roles, "chat.completion.chunk"))
            async with contextlib.aclosing(self.deltas(job.runs)) as deltas:
                async for _, delta in deltas:
                    choices = [job.choice(piece, "delta", {"content": piece.text})
                               for piece in delta.outputs]
                    yield sse(job.envelope(choices, "chat.completion.chunk"))
            if job.body.include_usage:
                yield sse(job.envelope([], "chat.completion.chunk") | {"usage": job.usage()})
        except (RequestFailedError, EngineStoppedError) as error:
            yield sse(stream_error(error))
        finally:
            job.close()
        yield "data: [DONE]\n\n"


def stream_error(error: Exception) -> dict:
    status = 503 if isinstance(error, EngineStoppedError) else 500
    return error_body(status, str(error))


# The app.


class BodySizeLimit:
    """ASGI middleware: 413 for a request body over max_body_bytes. The body is read
    (and past the limit discarded) to its end first, so the client reads the answer."""

    def __init__(self, app, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            size += len(message.get("body", b""))
            if size <= self.max_body_bytes:
                chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        if size > self.max_body_bytes:
            error = ApiError(413, f"the request body has {size} bytes, more than the limit of "
                                  f"{self.max_body_bytes} bytes")
            return await error.response()(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)


class RequireApiKey:
    """ASGI middleware: 401 for a /v1 request without `Authorization: Bearer <key>`."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = ApiError(401, "missing or wrong API key: send the header "
                                      "'Authorization: Bearer <key>'")
                return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


def _add_error_handlers(app: FastAPI) -> None:
    async def api_error(_, error: ApiError) -> JSONResponse:
        return error.response()

    async def invalid_request(_, error: RequestValidationError) -> JSONResponse:
        return validation_error(error).response()

    async def http_error(_, error: StarletteHTTPException) -> JSONResponse:
        return ApiError(error.status_code, str(error.detail)).response()

    async def queue_full(_, error: QueueFullError) -> JSONResponse:
        return ApiError(503, str(error), headers={"Retry-After": str(RETRY_AFTER_S)}).response()

    async def engine_stopped(_, error: EngineStoppedError) -> JSONResponse:
        return ApiError(503, str(error)).response()

    async def request_failed(_, error: RequestFailedError) -> JSONResponse:
        return ApiError(500, str(error)).response()

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(QueueFullError, queue_full)
    app.add_exception_handler(EngineStoppedError, engine_stopped)
    app.add_exception_handler(RequestFailedError, request_failed)


def build_app(engine: AsyncLLMEngine, served_model_name: str, api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The server's FastAPI app; its lifespan's end shuts the engine down."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        engine.shutdown()

    app = FastAPI(title="jpaged", lifespan=lifespan)
    serving = OpenAIServing(engine, served_model_name)
    app.state.serving = serving
    app.get("/v1/models")(serving.models)
    app.post("/v1/completions")(serving.create_completion)
    app.post("/v1/chat/completions")(serving.create_chat_completion)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    _add_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_body_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(RequireApiKey, api_key=api_key)  # outermost: before the body
    return app


def serve(engine: Engine, *, served_model_name: str, host: str = "127.0.0.1",
          port: int = 8000, api_key: str | None = None, max_waiting: int = 1024,
          max_body_bytes: int = MAX_BODY_BYTES, warmup: bool = False) -> None:
    """Serve `engine` until SIGINT/SIGTERM: then no new connection is accepted, running
    requests get SHUTDOWN_GRACE_S seconds to finish, the rest are aborted, and the
    engine thread is joined. warmup=True compiles every step shape first
    (`LLMEngine.warmup`, every replica's for a DataParallelEngine), so no request waits
    for a compile."""
    import uvicorn

    if warmup:
        started = time.perf_counter()
        num_shapes = engine.warmup()
        logger.info("compiled %d step shapes in %.1f s", num_shapes,
                    time.perf_counter() - started)
    async_engine = AsyncLLMEngine(engine, max_waiting=max_waiting)
    try:
        app = build_app(async_engine, served_model_name, api_key, max_body_bytes)
        uvicorn.run(app, host=host, port=port, timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
                    log_level="info")
    finally:
        async_engine.shutdown()
