"""The OpenAI-compatible server, driven over loopback by the official `openai` client.

The oracle is the offline engine: the same model and configuration through
`LLM.generate` / `LLM.chat` must give the same text, tokens and
log-probabilities as the server. Errors are checked against OpenAI's error
shape and the documented status codes. One server (`server` of tests/plugins/http_server.py:
uvicorn in a thread, on a free loopback port) serves every server test.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import openai
import pytest

from jpaged.engine.async_engine import AsyncLLMEngine, EngineStoppedError
from jpaged.sampling_params import SamplingParams
from tests.plugins.http_server import (
    SERVED_MODEL,
    SERVER_API_KEY,
    SERVER_ENGINE,
    SERVER_MAX_BODY_BYTES,
    Reply,
    http_connection,
    http_request,
    metric,
    wait_until_idle,
)

MODEL = SERVED_MODEL
API_KEY = SERVER_API_KEY
MAX_BODY_BYTES = SERVER_MAX_BODY_BYTES
PROMPTS = ["the theater in the", "a thin"]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the other"}]


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return server[0]


@pytest.fixture(scope="module")
def engine(server) -> AsyncLLMEngine:
    return server[1]


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**({"temperature": 0.0, "max_tokens": 8} | kwargs))


# Outputs against the offline engine.


def test_models_lists_the_served_model(client):
    assert [model.id for model in client.models.list().data] == [MODEL]


def test_greedy_completions_equal_offline(client, offline):
    expected = offline.generate(PROMPTS, _greedy(logprobs=2))
    response = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8,
                                         temperature=0, logprobs=2)
    assert [c.index for c in response.choices] == [0, 1]
    for choice, output in zip(response.choices, expected, strict=True):
        sample = output.outputs[0]
        assert choice.text == sample.text
        assert choice.finish_reason == sample.finish_reason
        assert choice.logprobs.token_logprobs == pytest.approx(
            [entry[t].logprob for t, entry in zip(sample.token_ids, sample.logprobs,
                                                  strict=True)], abs=1e-4)
        assert len(choice.logprobs.top_logprobs) == len(sample.token_ids)
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert response.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in expected)


def test_token_id_prompts_give_offline_tokens(client, offline):
    prompt = [5, 80, 200, 7, 7, 31]
    expected = offline.generate([prompt], _greedy(logprobs=0))[0].outputs[0]
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                         temperature=0, logprobs=0)
    tokens = response.choices[0].logprobs.tokens
    assert tokens == [entry[t].decoded_token
                      for t, entry in zip(expected.token_ids, expected.logprobs, strict=True)]
    assert response.usage.prompt_tokens == len(prompt)


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_completion_equals_the_response(client, echo):
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=1,
                  echo=echo)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    pieces = [chunk.choices[0] for chunk in chunks if chunk.choices]
    assert "".join(piece.text for piece in pieces) == whole.choices[0].text
    for name in ("tokens", "token_logprobs", "text_offset"):
        streamed = [value for piece in pieces for value in getattr(piece.logprobs, name)]
        assert streamed == getattr(whole.choices[0].logprobs, name)
    assert pieces[-1].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_seeded_samples_equal_offline(client, offline):
    params = SamplingParams(n=2, seed=7, temperature=1.0, top_p=0.9, max_tokens=8,
                            presence_penalty=0.5, frequency_penalty=0.3)
    expected = offline.generate(PROMPTS[0], params)[0].outputs
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], n=2, seed=7,
                                         temperature=1.0, top_p=0.9, max_tokens=8,
                                         presence_penalty=0.5, frequency_penalty=0.3)
    assert [c.text for c in response.choices] == [o.text for o in expected]
    assert expected[0].text != expected[1].text  # two samples, not one copied


def test_stop_strings_equal_offline(client, offline):
    free = offline.generate(PROMPTS[1], _greedy(max_tokens=12, ignore_eos=True))[0]
    free = free.outputs[0].text
    stop = free[4:6]
    expected = offline.generate(PROMPTS[1], _greedy(max_tokens=12, ignore_eos=True,
                                                    stop=[stop]))[0].outputs[0]
    response = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12,
                                         temperature=0, stop=[stop],
                                         extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason) == (expected.text, "stop")
    assert stop not in choice.text and len(choice.text) < len(free)
    assert choice.model_extra["stop_reason"] == stop


def test_echo_with_zero_max_tokens_gives_prompt_logprobs(client, offline):
    """What lm-evaluation-harness's loglikelihood requests."""
    expected = offline.generate(PROMPTS[0], _greedy(max_tokens=1, prompt_logprobs=1))[0]
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=0,
                                         echo=True, logprobs=1, temperature=0)
    choice = response.choices[0]
    assert choice.text == PROMPTS[0] and choice.finish_reason == "length"
    logprobs = choice.logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    prompt_ids = expected.prompt_token_ids
    assert logprobs.token_logprobs[1:] == pytest.approx(
        [expected.prompt_logprobs[i][prompt_ids[i]].logprob for i in range(1, len(prompt_ids))],
        abs=1e-4)
    assert logprobs.tokens[1:] == [expected.prompt_logprobs[i][prompt_ids[i]].decoded_token
                                   for i in range(1, len(prompt_ids))]
    assert response.usage.completion_tokens == 0
    assert response.usage.prompt_tokens == len(prompt_ids)


def test_echo_prepends_the_prompt(client, offline):
    expected = offline.generate(PROMPTS[1], _greedy())[0].outputs[0].text
    response = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8,
                                         echo=True, temperature=0)
    assert response.choices[0].text == PROMPTS[1] + expected


def test_chat_equals_offline(client, offline):
    expected = offline.chat(MESSAGES, _greedy(max_tokens=10, logprobs=2))[0].outputs[0]
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                              max_completion_tokens=10, logprobs=True,
                                              top_logprobs=2)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    content = choice.logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [entry[t].logprob for t, entry in zip(expected.token_ids, expected.logprobs,
                                              strict=True)], abs=1e-4)
    assert all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert response.usage.completion_tokens == len(expected.token_ids)


def test_streamed_chat_equals_the_response(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=10, n=2)
    whole = client.chat.completions.create(**kwargs)
    texts = {0: "", 1: ""}
    roles = set()
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            roles.add(choice.delta.role)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert "assistant" in roles


def test_cache_salt_isolates_the_prefix_cache(client, engine):
    stats = engine.engine.block_manager.prefix_cache_stats  # read while the engine is idle
    prompt = "the " * 40
    hits = []
    for salt in ("tenant-a", "tenant-b", "tenant-a"):
        before = stats.hit_tokens
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                  extra_body={"cache_salt": salt})
        hits.append(stats.hit_tokens - before)
    assert hits[0] == hits[1] == 0 and hits[2] > 0


# Bad input over HTTP.

GOOD_COMPLETION = {"model": MODEL, "prompt": "the", "max_tokens": 2}
GOOD_CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
LONG_PROMPT = [i % 250 + 1 for i in range(300)]

BAD_REQUESTS = {
    # name: (path, body (a dict, or raw bytes), status, param, words in the message)
    "malformed JSON": ("completions", b'{"model": "tiny", "prompt": ', 400, None, "malformed JSON"),
    "not an object": ("completions", b"[1, 2]", 400, None, "dictionary"),
    "unknown field": ("completions", GOOD_COMPLETION | {"frobnicate": 1}, 400, "frobnicate",
                      "unsupported parameter 'frobnicate'"),
    "temperature a string": ("chat/completions", GOOD_CHAT | {"temperature": "hot"}, 400,
                             "temperature", "number"),
    "prompt a number": ("completions", GOOD_COMPLETION | {"prompt": 3}, 400, "prompt", "prompt"),
    "missing prompt": ("completions", {"model": MODEL}, 400, "prompt", "missing"),
    "unknown model": ("completions", GOOD_COMPLETION | {"model": "gpt-4"}, 404, "model", "gpt-4"),
    "negative max_tokens": ("completions", GOOD_COMPLETION | {"max_tokens": -1}, 400,
                            "max_tokens", ">= 1"),
    "zero max_tokens without echo": ("completions", GOOD_COMPLETION | {"max_tokens": 0}, 400,
                                     "max_tokens", "echo"),
    "huge max_tokens": ("completions", GOOD_COMPLETION | {"max_tokens": 10**9}, 400,
                        "max_tokens", "maximum context length is 256"),
    "huge max_completion_tokens": ("chat/completions", GOOD_CHAT | {
        "max_completion_tokens": 10**9}, 400, "max_completion_tokens", "256"),
    "n = 0": ("completions", GOOD_COMPLETION | {"n": 0}, 400, "n", "n must be >= 1"),
    "n over max_num_seqs": ("completions", GOOD_COMPLETION | {"n": 9}, 400, "n", "max_num_seqs"),
    "top_p = 2": ("chat/completions", GOOD_CHAT | {"top_p": 2}, 400, "top_p", "(0, 1]"),
    "logprobs over 20": ("completions", GOOD_COMPLETION | {"logprobs": 21}, 400, "logprobs",
                         "max_logprobs=20"),
    "top_logprobs over 20": ("chat/completions", GOOD_CHAT | {"logprobs": True,
                                                             "top_logprobs": 21},
                             400, "top_logprobs", "20"),
    "empty messages": ("chat/completions", GOOD_CHAT | {"messages": []}, 400, "messages",
                       "at least 1"),
    "unknown role": ("chat/completions", GOOD_CHAT | {"messages": [{"role": "robot",
                                                                   "content": "hi"}]},
                     400, "messages", "role"),
    "image part": ("chat/completions", GOOD_CHAT | {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
        400, "messages", "part 1 is of type 'image_url': jpaged serves text-only models"),
    "empty prompt": ("completions", GOOD_COMPLETION | {"prompt": []}, 400, "prompt", "empty"),
    "token id outside the vocabulary": ("completions", GOOD_COMPLETION | {"prompt": [10**6]},
                                        400, "prompt", "vocabulary"),
    "prompt over max_model_len": ("completions", GOOD_COMPLETION | {"prompt": LONG_PROMPT},
                                  400, "prompt", "max_model_len=256"),
    "body over the limit": ("completions", GOOD_COMPLETION | {"prompt": "x" * MAX_BODY_BYTES},
                            413, None, f"limit of {MAX_BODY_BYTES} bytes"),
}


AUTHORIZED = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


def _post(base_url: str, path: str, body, headers: dict | None = None) -> Reply:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http_request(base_url, "POST", f"/v1/{path}", content, AUTHORIZED | (headers or {}))


def _assert_error(response: Reply, status: int, param: str | None, words: str) -> None:
    assert response.status == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param
    assert words in error["message"], error["message"]


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_refused_and_the_next_succeeds(base_url, client, case):
    path, body, status, param, words = BAD_REQUESTS[case]
    _assert_error(_post(base_url, path, body), status, param, words)
    response = client.completions.create(**GOOD_COMPLETION)
    assert response.choices[0].finish_reason in ("length", "stop")


def test_missing_or_wrong_api_key_is_401(base_url, client):
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
        _assert_error(_post(base_url, "completions", GOOD_COMPLETION, headers), 401, None,
                      "API key")
    assert http_request(base_url, "GET", "/health").status == 200  # open without a key
    assert client.completions.create(**GOOD_COMPLETION).choices


# Disconnects, failures, a full queue.


def test_disconnect_mid_stream_frees_the_blocks(base_url, engine):
    finished_before = engine.engine.stats.num_finished
    body = GOOD_COMPLETION | {"max_tokens": 200, "stream": True, "ignore_eos": True}
    connection = http_connection(base_url)
    connection.request("POST", "/v1/completions", json.dumps(body), AUTHORIZED)
    response = connection.getresponse()
    while not response.readline().startswith(b"data: "):
        pass
    assert engine.state.kv_blocks_used > 0
    connection.close()
    wait_until_idle(engine)
    assert engine.engine.stats.num_finished == finished_before  # aborted, not run to the end
    assert metric(base_url, "jpaged:kv_cache_blocks_used") == 0
    assert metric(base_url, "jpaged:num_requests_running") == 0


def _slow_steps(engine: AsyncLLMEngine, monkeypatch, seconds: float) -> None:
    runner = engine.engine.runner
    execute = runner.execute

    def slow_execute(*args, **kwargs):
        time.sleep(seconds)
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", slow_execute)


def test_disconnect_while_waiting_for_a_response_frees_the_blocks(base_url, engine,
                                                                   monkeypatch):
    _slow_steps(engine, monkeypatch, 0.01)  # 200 tokens take over 2 s
    finished_before = engine.engine.stats.num_finished
    body = GOOD_COMPLETION | {"max_tokens": 200, "ignore_eos": True}
    connection = http_connection(base_url, timeout=0.5)
    connection.request("POST", "/v1/completions", json.dumps(body), AUTHORIZED)
    with pytest.raises(TimeoutError):
        connection.getresponse()
    connection.close()
    wait_until_idle(engine)
    assert engine.engine.stats.num_finished == finished_before


def test_metrics_count_finished_requests(base_url, client, engine):
    before = metric(base_url, "jpaged:generation_tokens_total")
    requests_before = metric(base_url, "jpaged:e2e_request_latency_seconds_count")
    client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=5, n=2,
                              extra_body={"ignore_eos": True})
    assert metric(base_url, "jpaged:generation_tokens_total") == before + 2 * 2 * 5
    assert metric(base_url, "jpaged:e2e_request_latency_seconds_count") == requests_before + 2
    assert metric(base_url, "jpaged:kv_cache_blocks_total") == SERVER_ENGINE["num_blocks"] - 1


@pytest.mark.parametrize("stream", [True, False])
def test_a_failed_step_ends_the_request_with_an_error(client, engine, monkeypatch, stream):
    runner = engine.engine.runner
    execute = runner.execute
    calls = []

    def fail_on_third_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected device failure")
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", fail_on_third_step)
    kwargs = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=20, extra_body={"ignore_eos": True})
    with pytest.raises(openai.APIError, match="failed in the engine"):
        if stream:
            for _ in client.completions.create(**kwargs, stream=True):
                pass
        else:
            client.completions.create(**kwargs)
    wait_until_idle(engine)
    monkeypatch.undo()
    assert client.completions.create(**GOOD_COMPLETION).choices[0].text is not None


def test_full_waiting_queue_answers_503_and_recovers(base_url, client, engine, monkeypatch):
    # Slow steps and a prompt that prefills in four 64-token chunks keep the first request
    # waiting for its first token for about a second.
    _slow_steps(engine, monkeypatch, 0.2)
    monkeypatch.setattr(engine, "max_waiting", 1)
    prompt = [(7 * i) % 250 + 1 for i in range(250)]
    first: list[Reply] = []
    waiting = threading.Thread(target=lambda: first.append(_post(
        base_url, "completions", GOOD_COMPLETION | {"prompt": prompt, "max_tokens": 1})))
    waiting.start()
    try:
        deadline = time.monotonic() + 10
        while engine.num_waiting < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        refused = _post(base_url, "completions", GOOD_COMPLETION)
        _assert_error(refused, 503, None, "max_waiting=1")
        assert refused.headers["retry-after"] == "1"
    finally:
        waiting.join(30)
    assert first[0].status == 200
    monkeypatch.undo()
    assert client.completions.create(**GOOD_COMPLETION).choices


def test_idle_engine_thread_does_not_spin(engine):
    wait_until_idle(engine)
    started = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - started < 0.2


# The async engine without HTTP.


def test_async_engine_errors_arrive_before_output_and_shutdown_aborts(offline):
    """On the offline engine (idle between tests): a bad request raises from generate;
    shutdown ends a running stream with EngineStoppedError and frees its blocks."""

    async def scenario(async_engine: AsyncLLMEngine) -> list:
        with pytest.raises(ValueError, match="max_logprobs"):
            await async_engine.generate("bad", "the", SamplingParams(logprobs=50))
        stream = await async_engine.generate(
            "long", "the", SamplingParams(max_tokens=200, ignore_eos=True))
        deltas = [await anext(stream)]
        await asyncio.to_thread(async_engine.shutdown)
        with pytest.raises(EngineStoppedError):
            async for delta in stream:
                deltas.append(delta)
        with pytest.raises(EngineStoppedError):
            await async_engine.generate("late", "the", SamplingParams())
        return deltas

    async_engine = AsyncLLMEngine(offline.engine)
    deltas = asyncio.run(scenario(async_engine))
    assert not async_engine.is_running
    assert all(not d.finished for d in deltas)
    assert not offline.engine.has_unfinished_requests()
    assert offline.engine.block_manager.physical_blocks_used == 0


def test_async_engine_cancelled_reader_aborts(offline):
    async def scenario(async_engine: AsyncLLMEngine) -> None:
        stream = await async_engine.generate(
            "cancelled", "the", SamplingParams(max_tokens=200, ignore_eos=True))

        async def read() -> None:
            async for _ in stream:
                pass

        reader = asyncio.ensure_future(read())
        while async_engine.num_waiting:  # until its first delta arrives
            await asyncio.sleep(0.01)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await async_engine.run(lambda _: None)  # runs after the abort command

    async_engine = AsyncLLMEngine(offline.engine)
    try:
        asyncio.run(scenario(async_engine))
        assert not offline.engine.has_unfinished_requests()
        assert offline.engine.block_manager.physical_blocks_used == 0
    finally:
        async_engine.shutdown()
