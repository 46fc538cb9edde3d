"""Every request field vLLM's clients send, as the server answers it: honoured (the
response proves it against the offline engine, transformers' chat template or the
tokenizer), accepted and ignored (the same output as without it), or refused with the
documented status and the field's name. Also the utility endpoints at the server root.
"""

from __future__ import annotations

import json
from importlib.metadata import version

import pytest

from jpaged.sampling_params import SamplingParams
from tests.plugins.hf_models import oracle_transformers
from tests.plugins.http_server import (
    CHATML,
    SERVED_MODEL,
    SERVER_API_KEY,
    SERVER_ENGINE,
    Reply,
    http_request,
)

MODEL = SERVED_MODEL
AUTHORIZED = {"Authorization": f"Bearer {SERVER_API_KEY}", "Content-Type": "application/json"}
PROMPT = "the theater in the"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the other"}]
COMPLETION = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return server[0]


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llama_dir):
    """transformers' tokenizer of the tiny model with the server's template: the oracle of
    the chat template fields."""
    tokenizer = oracle_transformers().AutoTokenizer.from_pretrained(tiny_llama_dir)
    tokenizer.chat_template = CHATML
    return tokenizer


def post(base_url: str, path: str, body, headers: dict | None = None) -> Reply:
    """headers: over AUTHORIZED's; a None value leaves that header out."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {k: v for k, v in (AUTHORIZED | (headers or {})).items() if v is not None}
    return http_request(base_url, "POST", path, content, headers)


def ok(reply: Reply) -> dict:
    assert reply.status == 200, reply.text
    return reply.json()


def events(reply: Reply) -> list[dict]:
    """A stream's JSON events; the stream must end with [DONE]."""
    assert reply.status == 200, reply.text
    lines = [line.removeprefix("data: ") for line in reply.text.splitlines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**({"temperature": 0.0, "max_tokens": 6} | kwargs))


def template_ids(hf_tokenizer, messages, **kwargs) -> list[int]:
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return hf_tokenizer.encode(text, add_special_tokens=False)


# Honoured.


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION),
                                       ("/v1/chat/completions", CHAT)])
def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(base_url, path, body):
    request = body | {"n": 2, "temperature": 1.0, "seed": 3, "stream": True,
                      "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = events(post(base_url, path, request))
    final = chunks.pop()
    assert final["choices"] == []
    for chunk in chunks:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == final["usage"]["prompt_tokens"]  # one prompt
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    if path == "/v1/chat/completions":  # the role chunks come first, before any token
        assert [c["usage"]["completion_tokens"] for c in chunks[:2]] == [0, 0]
    # Per choice, the count grows to its 6 tokens; the final chunk sums the choices.
    for index in (0, 1):
        mine = [c["usage"]["completion_tokens"] for c in chunks
                if c["choices"][0]["index"] == index]
        assert mine == sorted(mine) and mine[-1] == 6
    assert final["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize("options,per_chunk,final", [
    ({"continuous_usage_stats": True}, True, True),  # include_usage defaults to true
    ({"include_usage": False, "continuous_usage_stats": True}, False, False),
    ({"include_usage": True}, False, True),
    ({}, False, True),
])
def test_stream_options_follow_vllms_rule(base_url, options, per_chunk, final):
    chunks = events(post(base_url, "/v1/completions",
                         COMPLETION | {"stream": True, "stream_options": options}))
    assert all(("usage" in c) == per_chunk for c in chunks if c["choices"])
    assert (chunks[-1]["choices"] == [] and "usage" in chunks[-1]) == final


def test_prompt_logprobs_equal_offline_on_both_endpoints(base_url, offline):
    expected = offline.generate(PROMPT, greedy(prompt_logprobs=2))[0]
    choice = ok(post(base_url, "/v1/completions", COMPLETION | {"prompt_logprobs": 2}))[
        "choices"][0]
    chat_expected = offline.chat(MESSAGES, greedy(prompt_logprobs=2))[0]
    chat = ok(post(base_url, "/v1/chat/completions", CHAT | {"prompt_logprobs": 2}))
    for got, output in ((choice["prompt_logprobs"], expected),
                        (chat["prompt_logprobs"], chat_expected)):
        assert got[0] is None and len(got) == len(output.prompt_token_ids)
        for entry, want in zip(got[1:], output.prompt_logprobs[1:], strict=True):
            assert set(entry) == {str(t) for t in want}
            for token_id, logprob in want.items():
                assert entry[str(token_id)]["logprob"] == pytest.approx(logprob.logprob, abs=1e-4)
                assert entry[str(token_id)]["rank"] == logprob.rank
                assert entry[str(token_id)]["decoded_token"] == logprob.decoded_token


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION),
                                       ("/v1/chat/completions", CHAT)])
def test_a_stream_carries_the_prompt_logprobs_once(base_url, path, body):
    request = body | {"prompt_logprobs": 1}
    whole = ok(post(base_url, path, request))
    expected = whole.get("prompt_logprobs") or whole["choices"][0]["prompt_logprobs"]
    chunks = events(post(base_url, path, request | {"stream": True}))
    carried = [c.get("prompt_logprobs") or c["choices"][0].get("prompt_logprobs")
               for c in chunks if c["choices"]]
    assert [entries for entries in carried if entries] == [expected]


def test_add_generation_prompt_false_leaves_the_turn_to_the_last_role(base_url, hf_tokenizer):
    response = ok(post(base_url, "/v1/chat/completions",
                       CHAT | {"add_generation_prompt": False}))
    expected = template_ids(hf_tokenizer, MESSAGES, add_generation_prompt=False)
    assert response["usage"]["prompt_tokens"] == len(expected)
    assert response["choices"][0]["message"]["role"] == "user"  # as vLLM answers


def test_continue_final_message_and_echo_continue_the_assistant(base_url, offline, hf_tokenizer):
    messages = MESSAGES + [{"role": "assistant", "content": "the th"}]
    prompt_ids = template_ids(hf_tokenizer, messages, continue_final_message=True)
    assert hf_tokenizer.decode(prompt_ids).endswith("assistant\nthe th")  # no end of turn
    expected = offline.generate({"prompt_token_ids": prompt_ids}, greedy())[0].outputs[0].text
    body = CHAT | {"messages": messages, "add_generation_prompt": False,
                   "continue_final_message": True}
    plain = ok(post(base_url, "/v1/chat/completions", body))
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": expected}
    assert plain["usage"]["prompt_tokens"] == len(prompt_ids)
    echoed = ok(post(base_url, "/v1/chat/completions", body | {"echo": True}))
    assert echoed["choices"][0]["message"]["content"] == "the th" + expected
    streamed = events(post(base_url, "/v1/chat/completions", body | {"echo": True,
                                                                     "stream": True}))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed
                   if c["choices"])
    assert text == "the th" + expected
    # Echo prepends nothing when the response opens a new turn.
    fresh = ok(post(base_url, "/v1/chat/completions", CHAT | {"echo": True}))
    assert fresh["choices"][0]["message"]["content"] == offline.chat(
        MESSAGES, greedy())[0].outputs[0].text


def test_chat_template_kwargs_reach_the_template(base_url, hf_tokenizer):
    body = CHAT | {"chat_template_kwargs": {"enable_thinking": False}}
    expected = template_ids(hf_tokenizer, MESSAGES, add_generation_prompt=True,
                            enable_thinking=False)
    assert hf_tokenizer.decode(expected).endswith("<think>\n\n</think>\n\n")
    response = ok(post(base_url, "/v1/chat/completions", body))
    assert response["usage"]["prompt_tokens"] == len(expected)
    tokens = ok(post(base_url, "/tokenize", {"messages": MESSAGES,
                                             "chat_template_kwargs": {"enable_thinking": False}}))
    assert tokens["tokens"] == expected


def test_best_of_returns_the_candidates_of_highest_cumulative_logprob(base_url, offline):
    params = SamplingParams(n=4, seed=11, temperature=1.0, max_tokens=6, ignore_eos=True)
    candidates = offline.generate(PROMPT, params)[0].outputs
    best = sorted(candidates, key=lambda o: -o.cumulative_logprob)[:2]
    assert len({o.text for o in candidates}) > 1
    body = COMPLETION | {"n": 2, "best_of": 4, "seed": 11, "temperature": 1.0,
                         "ignore_eos": True}
    response = ok(post(base_url, "/v1/completions", body))
    assert [c["text"] for c in response["choices"]] == [o.text for o in best]
    assert [c["index"] for c in response["choices"]] == [0, 1]
    assert response["usage"]["completion_tokens"] == 12  # the returned choices' tokens


def test_logit_bias_shows_in_the_tokens(base_url, offline):
    free = offline.generate(PROMPT, greedy(ignore_eos=True))[0].outputs[0].token_ids
    favoured = next(t for t in range(100, 200) if t not in free)
    body = COMPLETION | {"logit_bias": {str(favoured): 100}, "logprobs": 0, "ignore_eos": True,
                         "prompt": [int(t) for t in offline.get_tokenizer().encode(PROMPT)]}
    choice = ok(post(base_url, "/v1/completions", body))["choices"][0]
    tokenizer = offline.get_tokenizer()
    assert choice["text"] == tokenizer.decode([favoured] * 6)
    # Log-probabilities stay the model's, as in vLLM: the biased token is not certain.
    assert all(lp < -1e-3 for lp in choice["logprobs"]["token_logprobs"])


def test_an_ending_eos_is_in_tokens_logprobs_and_usage_but_not_the_text(base_url, offline):
    """vLLM's accounting: the detokenizer leaves the stop token out of the text only."""
    tokenizer = offline.get_tokenizer()
    eos = tokenizer.eos_token_id
    body = COMPLETION | {"logit_bias": {str(eos): 100}, "logprobs": 0, "max_tokens": 4}
    response = ok(post(base_url, "/v1/completions", body))
    choice = response["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("", "stop")
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([eos])]
    assert response["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("seed", [-1, 2**40 + 3, -(2**63), 5.0])
def test_any_64_bit_seed_is_taken(base_url, offline, seed):
    body = COMPLETION | {"seed": seed, "temperature": 1.0}
    text = ok(post(base_url, "/v1/completions", body))["choices"][0]["text"]
    if seed != -1:  # -1 is unseeded, as in vLLM
        expected = offline.generate(PROMPT, SamplingParams(seed=int(seed), max_tokens=6))[0]
        assert text == expected.outputs[0].text


def test_integral_floats_are_integers(base_url, offline):
    response = ok(post(base_url, "/v1/completions", COMPLETION | {
        "max_tokens": 5.0, "n": 2.0, "ignore_eos": True, "logprobs": 1.0}))
    assert [c["text"] for c in response["choices"]] == [
        offline.generate(PROMPT, greedy(max_tokens=5, ignore_eos=True))[0].outputs[0].text] * 2
    assert response["usage"]["completion_tokens"] == 10


# Accepted and ignored.


@pytest.mark.parametrize("path,body,fields", [
    ("/v1/completions", COMPLETION, {"user": "u1", "store": True,
                                     "metadata": {"run": "7"}, "service_tier": "auto"}),
    ("/v1/chat/completions", CHAT, {"user": "u1", "store": False, "metadata": {"run": "7"},
                                    "service_tier": "default", "parallel_tool_calls": True}),
])
def test_fields_that_change_nothing_are_accepted(base_url, path, body, fields):
    plain = ok(post(base_url, path, body))
    with_fields = ok(post(base_url, path, body | fields))
    assert with_fields["choices"] == plain["choices"]
    assert with_fields["usage"] == plain["usage"]


# Refused, with the field's name.

C, CH = "/v1/completions", "/v1/chat/completions"
VOCAB = 263  # the tiny tokenizer's
REFUSED = {
    # name: (path, body (a dict, or raw bytes), headers, status, param, words in the message)
    "suffix": (C, COMPLETION | {"suffix": "end"}, {}, 400, "suffix", "suffix is not supported"),
    "best_of below n": (C, COMPLETION | {"n": 3, "best_of": 2}, {}, 400, "best_of",
                        "best_of must be >= n"),
    "best_of streamed": (C, COMPLETION | {"best_of": 2, "stream": True}, {}, 400, "best_of",
                         "cannot stream"),
    "best_of over max_num_seqs": (C, COMPLETION | {"best_of": 9}, {}, 400, "best_of",
                                  "max_num_seqs"),
    "logit_bias outside the vocabulary": (C, COMPLETION | {"logit_bias": {str(VOCAB): 1}}, {},
                                          400, "logit_bias", f"[{VOCAB}] outside the vocabulary"),
    "logit_bias over 100": (CH, CHAT | {"logit_bias": {"5": 100.5}}, {}, 400, "logit_bias",
                            "[-100, 100]"),
    "logit_bias key not an id": (C, COMPLETION | {"logit_bias": {"the": 1}}, {}, 400,
                                 "logit_bias", "must be token ids"),
    "both template switches": (CH, CHAT | {"continue_final_message": True}, {}, 400,
                               "continue_final_message", "cannot both be true"),
    "continuing a user message": (CH, CHAT | {"continue_final_message": True,
                                              "add_generation_prompt": False}, {}, 400,
                                  "continue_final_message", "must be the assistant's"),
    "a template in chat_template_kwargs": (CH, CHAT | {"chat_template_kwargs": {
        "chat_template": "{{ messages }}"}}, {}, 400, "chat_template_kwargs", "chat_template"),
    "stream_options without a stream": (C, COMPLETION | {"stream_options": {
        "include_usage": True}}, {}, 400, "stream_options", "stream=true"),
    "prompt_logprobs -1": (C, COMPLETION | {"prompt_logprobs": -1}, {}, 400, "prompt_logprobs",
                           "max_logprobs=20"),
    "prompt_logprobs over 20": (CH, CHAT | {"prompt_logprobs": 21}, {}, 400, "prompt_logprobs",
                                "max_logprobs=20"),
    "no tools": (CH, CHAT | {"tools": []}, {}, 400, "tools", "must not be empty"),
    "response_format without its schema": (CH, CHAT | {"response_format": {
        "type": "json_schema"}}, {}, 400, "response_format", "'json_schema' field"),
    "an image part": (CH, CHAT | {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, {}, 400, "messages", "text"),
    "seed over int64": (C, COMPLETION | {"seed": 2**63}, {}, 400, "seed", "seed must be <="),
    "max_tokens 5.5": (C, COMPLETION | {"max_tokens": 5.5}, {}, 400, "max_tokens", "integer"),
    "max_tokens a string": (C, COMPLETION | {"max_tokens": "5"}, {}, 400, "max_tokens",
                            "integer"),
    "n a boolean": (C, COMPLETION | {"n": True}, {}, 400, "n", "integer"),
    "a lone surrogate in a prompt": (C, COMPLETION | {"prompt": "the \ud800 end"}, {}, 400,
                                     "prompt", "cannot be encoded as UTF-8"),
    "a lone surrogate in a message": (CH, CHAT | {"messages": [{"role": "user",
                                                                "content": "a\udc00"}]}, {},
                                      400, "messages", "cannot be encoded as UTF-8"),
    "a form body": (C, b"prompt=the", {"Content-Type": "application/x-www-form-urlencoded"},
                    400, None, "got Content-Type 'application/x-www-form-urlencoded'"),
    "no Content-Type": (C, json.dumps(COMPLETION).encode(), {"Content-Type": None}, 400, None,
                        "'Content-Type: application/json'; got no Content-Type"),
    "tokenize both forms": ("/tokenize", {"prompt": "a", "messages": MESSAGES}, {}, 400,
                            "prompt", "either 'prompt' or 'messages'"),
    "detokenize outside the vocabulary": ("/detokenize", {"tokens": [1, VOCAB]}, {}, 400,
                                          "tokens", "outside the vocabulary"),
    "another model's card": ("GET /v1/models/gpt-4", None, {}, 404, "model", "gpt-4"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_fields_are_named(base_url, case):
    path, body, headers, status, param, words = REFUSED[case]
    if path.startswith("GET "):
        reply = http_request(base_url, "GET", path.removeprefix("GET "), None, AUTHORIZED)
    else:
        reply = post(base_url, path, body, headers)
    assert reply.status == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert ok(post(base_url, C, COMPLETION))["choices"]  # the server goes on serving


# The utility endpoints.


def test_tokenize_and_detokenize_round_trip_through_the_tokenizer(base_url, offline,
                                                                  hf_tokenizer):
    tokenizer = offline.get_tokenizer()
    text = "the theater, in the air"
    tokens = ok(post(base_url, "/tokenize", {"prompt": text, "return_token_strs": True}))
    assert tokens["tokens"] == tokenizer.encode(text) == hf_tokenizer.encode(text)
    assert tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == SERVER_ENGINE["max_model_len"]
    assert tokens["token_strs"] == hf_tokenizer.convert_ids_to_tokens(tokens["tokens"])
    bare = ok(post(base_url, "/tokenize", {"prompt": text, "add_special_tokens": False}))
    assert bare["tokens"] == hf_tokenizer.encode(text, add_special_tokens=False)
    chat = ok(post(base_url, "/tokenize", {"messages": MESSAGES}))
    assert chat["tokens"] == template_ids(hf_tokenizer, MESSAGES, add_generation_prompt=True)
    assert ok(post(base_url, "/detokenize", {"tokens": tokens["tokens"]}))["prompt"] == \
        hf_tokenizer.decode(tokens["tokens"])


def test_tokenizer_info_version_and_model_card(base_url, hf_tokenizer):
    info = ok(http_request(base_url, "GET", "/tokenizer_info"))
    assert (info["eos_token"], info["bos_token"]) == (hf_tokenizer.eos_token,
                                                      hf_tokenizer.bos_token)
    assert info["chat_template"] == CHATML
    assert ok(http_request(base_url, "GET", "/version")) == {"version": version("jpaged")}
    card = ok(http_request(base_url, "GET", f"/v1/models/{MODEL}", None, AUTHORIZED))
    assert (card["id"], card["max_model_len"]) == (MODEL, SERVER_ENGINE["max_model_len"])


def test_the_api_key_guards_v1_paths_only(base_url):
    assert http_request(base_url, "GET", f"/v1/models/{MODEL}").status == 401
    for method, path, body in (("POST", "/tokenize", {"prompt": "a"}),
                               ("POST", "/detokenize", {"tokens": [1]}),
                               ("GET", "/tokenizer_info", None), ("GET", "/version", None)):
        content = None if body is None else json.dumps(body).encode()
        assert http_request(base_url, method, path, content,
                            {"Content-Type": "application/json"}).status == 200, path
