"""The OpenAI server on the tiny model, its offline oracle, and plain HTTP helpers.

The engine of the server tests and their oracle share one configuration, SERVER_ENGINE:
one padded shape for mixed steps and one for decode steps (64 tokens, 8 sequence rows,
full-width block tables), so each engine compiles only those two.
"""

from __future__ import annotations

import contextlib
import copy
import http.client
import json
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

import pytest

from jpaged.core.step_shapes import BucketSizes

# ChatML, with Qwen3's switch: enable_thinking=False opens the answer with an empty thought.
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
          "{% endif %}{% endif %}")
SERVED_MODEL = "tiny"
SERVER_API_KEY = "test-key"
SERVER_MAX_BODY_BYTES = 64 * 1024
SERVER_MAX_WAITING = 256  # above the load test's 128 concurrent clients
SERVER_ENGINE = dict(block_size=8, num_blocks=160, max_num_seqs=8, max_num_batched_tokens=64,
                     max_model_len=256, persistent_compilation_cache=False,
                     buckets=BucketSizes(min_num_tokens=64, min_num_seqs=8,
                                         min_blocks_per_seq=32))


@pytest.fixture(scope="session")
def tiny_chat_model(tiny_llama_dir):
    """The tiny Llama as jpaged loads it, with a ChatML chat template: (model, config,
    tokenizer)."""
    from jpaged.model.loader import load_model

    model, config, tokenizer = load_model(tiny_llama_dir)
    tokenizer.chat_template = CHATML
    return model, config, tokenizer


@pytest.fixture(scope="session")
def offline(tiny_chat_model):
    """The server tests' oracle: an offline LLM with the server's engine settings."""
    from jpaged.entrypoints.llm import LLM

    return LLM(SERVED_MODEL, loaded=tiny_chat_model, **SERVER_ENGINE)


@pytest.fixture(scope="session")
def server(tiny_chat_model):
    """(base_url, AsyncLLMEngine) of the OpenAI server (uvicorn in a thread, on a free
    loopback port) over a SERVER_ENGINE engine, shared by the server tests: one engine
    compiles its steps once. The engine gets its own tokenizer copy, since the offline
    oracle's runs in the test thread. Tests that change max_waiting restore it."""
    from jpaged.engine.async_engine import AsyncLLMEngine
    from jpaged.engine.llm_engine import EngineConfig, LLMEngine
    from jpaged.entrypoints.server import build_app

    model, config, tokenizer = tiny_chat_model
    engine = LLMEngine(EngineConfig(model=SERVED_MODEL, **SERVER_ENGINE),
                       loaded=(model, config, copy.deepcopy(tokenizer)))
    async_engine = AsyncLLMEngine(engine, max_waiting=SERVER_MAX_WAITING)
    app = build_app(async_engine, SERVED_MODEL, api_key=SERVER_API_KEY,
                    max_body_bytes=SERVER_MAX_BODY_BYTES)
    with running(app) as base_url:
        yield base_url, async_engine
    assert not async_engine.is_running  # the lifespan's end shut the engine down


@contextlib.contextmanager
def running(app):
    """The base URL of `app` served by uvicorn in a thread, on a free loopback port,
    until the block ends."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uvicorn_server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uvicorn_server.run, kwargs={"sockets": [sock]})
    thread.start()
    while not uvicorn_server.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uvicorn_server.should_exit = True
        thread.join(30)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # names in lower case
    text: str

    def json(self):
        return json.loads(self.text)


def http_connection(base_url: str, timeout: float = 60) -> http.client.HTTPConnection:
    host, port = base_url.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=timeout)


def http_request(base_url: str, method: str, path: str, body: bytes | None = None,
                 headers: dict | None = None) -> Reply:
    connection = http_connection(base_url)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()},
                     response.read().decode())
    finally:
        connection.close()


def wait_until_healthy(base_url: str, process: subprocess.Popen, timeout: float = 300) -> None:
    """Until the server `process` started answers /health; fails if the process ends."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read()
        try:
            if http_request(base_url, "GET", "/health").status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not start")


def metric(base_url: str, name: str) -> float:
    """One sample's value from /metrics."""
    for line in http_request(base_url, "GET", "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def wait_until_idle(engine, timeout: float = 10.0) -> None:
    """Until the AsyncLLMEngine's published state shows no request and no block held."""
    deadline = time.monotonic() + timeout
    while engine.state.kv_blocks_used or engine.state.num_running or engine.state.num_waiting:
        assert time.monotonic() < deadline, f"the engine is still busy: {engine.state}"
        time.sleep(0.01)
