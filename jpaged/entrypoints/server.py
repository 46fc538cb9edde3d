"""An OpenAI-compatible HTTP server over AsyncLLMEngine, on FastAPI and uvicorn.

    GET  /v1/models             the served model and its LoRA adapters
    GET  /v1/models/{id}        a card (404 for another id)
    POST /v1/completions        text or token-id prompts (a batch too), echo, logprobs
    POST /v1/chat/completions   messages through the model's chat template
    POST /tokenize, /detokenize, GET /tokenizer_info, /version
                                the tokenizer over HTTP (jpaged.entrypoints.tokenization)
    GET  /health                200 while the engine runs, else 503
    GET  /metrics               Prometheus text format
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter
                                LoRA adapters at run time, where the server allows it
                                (jpaged.entrypoints.lora; else 404)

Streams are server-sent events ending with `data: [DONE]`; a request that fails
mid-stream, or that the server's shutdown ends, sends `data: {"error": ...}` before
it. Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}, and
vLLM's status codes: 400 for bad parameters, malformed JSON, a body that is not
JSON, wrong types, unsupported fields and prompts over max_model_len; 401 without
the API key (when one is set, for /v1 paths only, as in vLLM); 404 for an unknown
model; 413 for a body over max_body_bytes; 503 with Retry-After when max_waiting
requests wait.

A client that disconnects aborts its requests: their KV blocks are freed before
the engine's next step. System prompts reserved at start-up (`reserve_system_prompts`)
keep their KV blocks for every chat request that opens with them. The endpoints' logic
is jpaged.entrypoints.serving; this module is the app around it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Sequence

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from jpaged.engine.async_engine import (
    AsyncLLMEngine,
    Engine,
    EngineStoppedError,
    QueueFullError,
)
from jpaged.engine.mirror import HEARTBEAT_S, RequestMirror
from jpaged.entrypoints.errors import ApiError, RequestFailedError, validation_error
from jpaged.entrypoints.lora import LoRAModule, module_requests
from jpaged.entrypoints.serving import OpenAIServing
from jpaged.entrypoints.tokenization import TokenizerEndpoints
from jpaged.outputs import ReservedPrefix

logger = logging.getLogger("jpaged")

# Request bodies larger than this get 413 (8 MiB: a few thousand long token-id prompts).
MAX_BODY_BYTES = 8 * 2**20
# On SIGINT/SIGTERM running requests get this long to finish before they are aborted.
SHUTDOWN_TIMEOUT_S = 10.0
# After that, what the aborted requests' streams get to send their last events.
FINAL_EVENTS_S = 5.0
RETRY_AFTER_S = 1


# A user turn after a system message: what a chat request's conversation goes on with.
_NEXT_TURN = {"role": "user", "content": "?"}


def system_prompt_tokens(engine: Engine, text: str, chat_template: str | None = None
                        ) -> list[int]:
    """The token ids that every chat request opening with system message `text` starts
    with: the chat template's rendering (`chat_template`, else the model's) of a
    conversation holding only that message, cut to what it shares with one that goes on
    (a template may close the message otherwise when nothing follows, and tokens may
    merge across its end); the text as a prompt where there is no chat template."""
    if chat_template is None and getattr(engine.tokenizer, "chat_template", None) is None:
        return engine.tokenize(text)
    system = [{"role": "system", "content": text}]
    alone = engine.apply_chat_template(system, add_generation_prompt=False,
                                       chat_template=chat_template)
    followed = engine.apply_chat_template([*system, _NEXT_TURN], chat_template=chat_template)
    return alone[:len(os.path.commonprefix([alone, followed]))]


def reserve_system_prompts(engine: Engine, system_prompts: Sequence[str],
                           chat_template: str | None = None) -> list[ReservedPrefix]:
    """Reserve each system prompt's KV blocks in `engine` (LLMEngine.reserve_prefix of
    `system_prompt_tokens`), logging what each holds; call it before serving."""
    reserved = []
    for text in system_prompts:
        prefix = engine.reserve_prefix(system_prompt_tokens(engine, text, chat_template))
        logger.info("reserved system prompt %d: %d tokens, %d of them in full blocks, held "
                    "in %d KV blocks", prefix.prefix_id, prefix.num_tokens,
                    prefix.num_cached_tokens, prefix.num_blocks)
        reserved.append(prefix)
    return reserved


def check_lora_modules(engine: Engine, modules: Sequence[LoRAModule]) -> None:
    """Read and check each LoRA module's adapter, as its requests would: a ValueError
    naming the module, its file and field for one the engine cannot serve."""
    for module, request in zip(modules, module_requests(modules), strict=True):
        try:
            engine.lora_adapter(request)
        except (ValueError, TypeError) as error:
            raise ValueError(f"--lora-modules {module.name}={module.path}: {error}") from None


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


async def require_json(request: Request) -> None:
    """400 for a body not declared as JSON (FastAPI would not parse it)."""
    content_type = request.headers.get("content-type")
    if content_type is None or content_type.split(";")[0].strip() != "application/json":
        got = "no Content-Type" if content_type is None else f"Content-Type '{content_type}'"
        raise ApiError(400, "the request body must be JSON, sent with the header "
                            f"'Content-Type: application/json'; got {got}")


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
              max_body_bytes: int = MAX_BODY_BYTES,
              enable_prompt_tokens_details: bool = False, chat_template: str | None = None,
              *, lora_modules: Sequence[LoRAModule] = (), runtime_lora_updating: bool = False,
              lora_allowed_dir: str | None = None) -> FastAPI:
    """The server's FastAPI app; its lifespan's end shuts the engine down.
    enable_prompt_tokens_details: usage reports the prompt tokens the prefix cache served
    (`usage.prompt_tokens_details.cached_tokens`, vLLM's option); chat_template: the
    jinja2 template chat requests use instead of the model's (vLLM's --chat-template).
    lora_modules: the LoRA adapters served from the start (`check_lora_modules` checks
    them); runtime_lora_updating: the load and unload endpoints answer, for adapters
    inside lora_allowed_dir."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        engine.shutdown()

    app = FastAPI(title="jpaged", lifespan=lifespan)
    serving = OpenAIServing(engine, served_model_name, enable_prompt_tokens_details,
                            chat_template, lora_modules=lora_modules,
                            runtime_lora_updating=runtime_lora_updating,
                            lora_allowed_dir=lora_allowed_dir)
    app.state.serving = serving
    tokenizer = TokenizerEndpoints(serving)
    json_body = [Depends(require_json)]
    app.get("/v1/models")(serving.models)
    app.get("/v1/models/{model_id:path}")(serving.model)
    app.post("/v1/completions", dependencies=json_body)(serving.create_completion)
    app.post("/v1/chat/completions", dependencies=json_body)(serving.create_chat_completion)
    app.post("/v1/load_lora_adapter", dependencies=json_body)(serving.load_lora_adapter)
    app.post("/v1/unload_lora_adapter", dependencies=json_body)(serving.unload_lora_adapter)
    app.post("/tokenize", dependencies=json_body)(tokenizer.tokenize)
    app.post("/detokenize", dependencies=json_body)(tokenizer.detokenize)
    app.get("/tokenizer_info")(tokenizer.tokenizer_info)
    app.get("/version")(tokenizer.version)

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


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose SIGINT/SIGTERM gives running requests shutdown_timeout
    seconds and then shuts the engine down: every request still running ends, each
    open stream with an error event and `data: [DONE]`, before its connection closes.
    (uvicorn alone would cut those connections mid-stream.)"""

    def __init__(self, app: FastAPI, engine: AsyncLLMEngine, shutdown_timeout: float,
                 **config):
        super().__init__(uvicorn.Config(
            app, timeout_graceful_shutdown=shutdown_timeout + FINAL_EVENTS_S, **config))
        self.engine, self.shutdown_timeout = engine, shutdown_timeout
        self.drain: threading.Timer | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.drain is None:
            logger.info("shutting down: running requests get %g s", self.shutdown_timeout)
            self.drain = threading.Timer(self.shutdown_timeout, self.engine.shutdown)
            self.drain.daemon = True
            self.drain.start()
        super().handle_exit(sig, frame)

    def run(self, sockets=None) -> None:
        try:
            super().run(sockets)
        finally:
            if self.drain is not None:
                self.drain.cancel()


def serve(engine: Engine, *, served_model_name: str, host: str = "127.0.0.1",
          port: int = 8000, api_key: str | None = None, max_waiting: int = 1024,
          max_body_bytes: int = MAX_BODY_BYTES, warmup: bool = False,
          shutdown_timeout: float = SHUTDOWN_TIMEOUT_S,
          enable_prompt_tokens_details: bool = False, chat_template: str | None = None,
          lora_modules: Sequence[LoRAModule] = (), runtime_lora_updating: bool = False,
          lora_allowed_dir: str | None = None) -> None:
    """Serve `engine` until SIGINT/SIGTERM: then no new connection is accepted, running
    requests get shutdown_timeout seconds to finish, the rest are aborted (their streams
    end with an error event and [DONE]), and the engine thread is joined. warmup=True
    compiles every step shape first (`LLMEngine.warmup`, every replica's for a
    DataParallelEngine), so no request waits for a compile. enable_prompt_tokens_details,
    chat_template and the LoRA arguments: as build_app's (a LoRA module the engine cannot
    serve raises ValueError before anything starts).

    In a job of several processes `engine` is process 0's RequestMirror (the others
    run `jpaged.engine.mirror.follow`): while idle it beats every HEARTBEAT_S
    seconds, and once the server ended the others stop."""
    check_lora_modules(engine, lora_modules)
    if warmup:
        started = time.perf_counter()
        num_shapes = engine.warmup()
        logger.info("compiled %d step shapes in %.1f s", num_shapes,
                    time.perf_counter() - started)
    mirror = engine if isinstance(engine, RequestMirror) else None
    async_engine = AsyncLLMEngine(engine, max_waiting=max_waiting,
                                  on_idle=None if mirror is None else mirror.sync,
                                  idle_s=HEARTBEAT_S)
    try:
        app = build_app(async_engine, served_model_name, api_key, max_body_bytes,
                        enable_prompt_tokens_details, chat_template, lora_modules=lora_modules,
                        runtime_lora_updating=runtime_lora_updating,
                        lora_allowed_dir=lora_allowed_dir)
        DrainingServer(app, async_engine, shutdown_timeout, host=host, port=port,
                       log_level="info").run()
    finally:
        async_engine.shutdown()
        if mirror is not None and not async_engine.is_running:
            mirror.stop()
