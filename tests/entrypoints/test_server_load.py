"""The OpenAI server under load: 128 concurrent streaming clients over loopback, clients
that leave mid-stream, and a full waiting queue.

The oracle is the offline engine (same model, same configuration): every greedy
request must give its `LLM.generate` tokens, however many others share its steps.
Held blocks are read on the engine thread and from /metrics; both must agree that
nothing is held once the clients are done.
"""

from __future__ import annotations

import asyncio

import numpy as np
import openai

from jpaged.entrypoints.llm import LLM
from jpaged.sampling_params import SamplingParams
from tests.plugins.http_server import (
    SERVED_MODEL,
    SERVER_API_KEY,
    SERVER_ENGINE,
    SERVER_MAX_WAITING,
    metric,
    wait_until_idle,
)

MODEL = SERVED_MODEL
NUM_CLIENTS = 128
assert SERVER_MAX_WAITING >= NUM_CLIENTS, "the load test's clients must all be admitted"


def _requests(seed: int, count: int, vocab_size: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) of mixed lengths: prompts of 1 to 48 tokens,
    1 to 24 new tokens."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(1, vocab_size, int(rng.integers(1, 49))).tolist(),
             int(rng.integers(1, 25))) for _ in range(count)]


async def _stream_tokens(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int
                         ) -> list[str]:
    """The decoded tokens of one greedy streamed completion, in order."""
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, logprobs=0, stream=True)
    return [token async for chunk in stream for choice in chunk.choices
            for token in choice.logprobs.tokens]


async def _leave_after_first_token(client: openai.AsyncOpenAI, prompt: list[int]) -> None:
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=150,
                                             stream=True, extra_body={"ignore_eos": True})
    async for _ in stream:
        break
    await stream.close()


def _client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=SERVER_API_KEY, max_retries=0,
                              timeout=120)


def _offline_tokens(offline: LLM, requests: list[tuple[list[int], int]]) -> list[list[str]]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=0) for _, n in requests]
    outputs = offline.generate([{"prompt_token_ids": p} for p, _ in requests], params)
    return [[entry[t].decoded_token for t, entry in zip(o.outputs[0].token_ids,
                                                        o.outputs[0].logprobs, strict=True)]
            for o in outputs]


def _blocks_held(async_engine) -> int:
    """Blocks held, read on the engine thread after checking every refcount."""

    def read(engine) -> int:
        engine.check_invariants()
        return engine.block_manager.physical_blocks_used

    return asyncio.run(async_engine.run(read))


def _assert_nothing_held(base_url: str, async_engine) -> None:
    wait_until_idle(async_engine)
    assert _blocks_held(async_engine) == 0
    assert metric(base_url, "jpaged:kv_cache_blocks_used") == 0
    assert metric(base_url, "jpaged:kv_cache_usage_perc") == 0
    assert metric(base_url, "jpaged:num_requests_running") == 0
    assert metric(base_url, "jpaged:num_requests_waiting") == 0


def test_concurrent_streaming_clients_equal_offline_and_free_every_block(server, offline):
    base_url, async_engine = server
    requests = _requests(0, NUM_CLIENTS, offline.engine.model_config.vocab_size)
    stats = async_engine.engine.stats
    finished_before = stats.num_finished
    tokens_before = metric(base_url, "jpaged:generation_tokens_total")
    requests_before = metric(base_url, "jpaged:e2e_request_latency_seconds_count")

    async def clients() -> list[list[str]]:
        async with _client(base_url) as client:
            return await asyncio.gather(*(_stream_tokens(client, prompt, n)
                                          for prompt, n in requests))

    streamed = asyncio.run(clients())
    assert streamed == _offline_tokens(offline, requests)
    _assert_nothing_held(base_url, async_engine)
    num_tokens = sum(len(tokens) for tokens in streamed)
    assert stats.num_finished - finished_before == NUM_CLIENTS
    assert metric(base_url, "jpaged:e2e_request_latency_seconds_count") - requests_before == (
        NUM_CLIENTS)
    assert metric(base_url, "jpaged:generation_tokens_total") - tokens_before == num_tokens
    # They were concurrent: the engine ran full batches with more clients queued behind.
    summary = stats.summary()
    assert summary["running_peak"] == SERVER_ENGINE["max_num_seqs"]
    assert summary["waiting_peak"] > SERVER_ENGINE["max_num_seqs"]


def test_clients_that_leave_mid_stream_free_their_blocks(server, offline):
    base_url, async_engine = server
    vocab_size = offline.engine.model_config.vocab_size
    leaving = [prompt for prompt, _ in _requests(1, 20, vocab_size)]
    staying = _requests(2, 20, vocab_size)
    finished_before = async_engine.engine.stats.num_finished

    async def clients() -> list:
        async with _client(base_url) as client:
            return await asyncio.gather(*(_leave_after_first_token(client, p) for p in leaving),
                                        *(_stream_tokens(client, p, n) for p, n in staying))

    streamed = asyncio.run(clients())[len(leaving):]
    assert streamed == _offline_tokens(offline, staying)
    _assert_nothing_held(base_url, async_engine)
    # The 150-token requests were aborted, not run to their end.
    assert async_engine.engine.stats.num_finished - finished_before == len(staying)


def test_a_full_waiting_queue_answers_503_and_the_server_recovers(server, offline,
                                                                   monkeypatch):
    base_url, async_engine = server
    monkeypatch.setattr(async_engine, "max_waiting", 4)
    vocab_size = offline.engine.model_config.vocab_size
    requests = _requests(3, 48, vocab_size)

    async def attempt(client: openai.AsyncOpenAI, prompt: list[int], n: int):
        try:
            return await _stream_tokens(client, prompt, n)
        except openai.APIStatusError as error:
            return error

    async def clients() -> list:
        async with _client(base_url) as client:
            return await asyncio.gather(*(attempt(client, p, n) for p, n in requests))

    answers = asyncio.run(clients())
    refused = [a for a in answers if isinstance(a, openai.APIStatusError)]
    assert refused, "no request was refused"
    for error in refused:
        assert error.status_code == 503
        assert error.response.headers["retry-after"] == "1"
        assert "max_waiting=4" in error.message
    served = [(request, a) for request, a in zip(requests, answers, strict=True)
              if not isinstance(a, openai.APIStatusError)]
    assert served, "every request was refused"
    assert [a for _, a in served] == _offline_tokens(offline, [r for r, _ in served])
    _assert_nothing_held(base_url, async_engine)
    # Recovered: under the same limit, a later request is admitted and succeeds.
    later = _requests(4, 1, vocab_size)

    async def one_client() -> list[str]:
        async with _client(base_url) as client:
            return await _stream_tokens(client, *later[0])

    assert asyncio.run(one_client()) == _offline_tokens(offline, later)[0]


def test_metrics_name_the_kv_dtype_and_its_bytes_per_token(server, tiny_chat_model):
    """float32 K and V of every layer and KV head, from the model's config."""
    base_url, _ = server
    config = tiny_chat_model[1]
    expected = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    assert metric(base_url, "jpaged:kv_cache_bytes_per_token") == expected
    assert metric(base_url, 'jpaged:kv_cache_dtype_info{dtype="float32"}') == 1
