"""Structured outputs through the server, driven by the official `openai` client: OpenAI's
response_format, vLLM's structured_outputs, and tool calls forced by tool_choice.

The oracles are validators nobody here wrote: `jsonschema` for JSON schemas, `re.fullmatch`
for regular expressions, the `openai` client's own parsing of tool calls, and the same
request alone for a request in a mixed batch. The tiny model is random, so the schemas
keep outputs short (enums, booleans, bounded integers, short arrays and strings) and the
requests ask for JSON without free whitespace or extra properties, so that their outputs
complete within max_tokens. Where nothing bounds the model (a JSON object's strings,
"required"'s number of calls), the tests hold the outputs that complete to the oracle,
and the rest to what they can show: a call cut short, a stream equal to the response.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest

from jpaged.entrypoints.protocol import ChatCompletionRequest
from jpaged.model.tokenizer import Tokenizer
from tests.plugins.hf_models import oracle_transformers
from tests.plugins.http_server import SERVED_MODEL, SERVER_API_KEY

MODEL = SERVED_MODEL
MESSAGES = [{"role": "user", "content": "the other"}]
PROMPT = "the theater in the"
# JSON without whitespace between tokens, objects without properties beyond their own.
COMPACT = {"disable_any_whitespace": True, "disable_additional_properties": True}
ITEM = {
    "type": "object",
    "properties": {
        "mood": {"enum": ["calm", "busy", "away"]},
        "ready": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "note": {"type": "string", "maxLength": 3},
    },
    "required": ["mood", "ready", "count", "tags", "note"],
}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "set_alarm",
        "parameters": {"type": "object", "properties": {
            "hour": {"type": "integer", "minimum": 0, "maximum": 23},
            "on": {"type": "boolean"}}, "required": ["hour", "on"]}}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: an object
]
SCHEMAS = {tool["function"]["name"]: tool["function"].get("parameters", {"type": "object"})
           for tool in TOOLS}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=SERVER_API_KEY, max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def free_text(client) -> str:
    """The greedy output without constraints."""
    return _chat(client, temperature=0, max_tokens=12).choices[0].message.content


def _chat(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)


def _streamed_texts(chunks, n: int) -> tuple[list[str], list[str | None]]:
    """Each choice's text and finish reason, from a chat or completions stream."""
    texts, reasons = [""] * n, [None] * n
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else choice.delta.content
            texts[choice.index] += piece or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    return texts, reasons


def _assert_valid_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


# response_format


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_response_format_json_schema_outputs_validate_and_stream_alike(client, endpoint):
    response_format = {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM}}
    extra_body = {"structured_outputs": COMPACT}
    if endpoint == "chat":
        create = client.chat.completions.create
        kwargs = dict(messages=MESSAGES, response_format=response_format)
    else:  # the client's completions take response_format as an extra field, as vLLM's
        create = client.completions.create
        kwargs = dict(prompt=PROMPT)
        extra_body["response_format"] = response_format
    kwargs |= dict(max_tokens=120, extra_body=extra_body)
    sampled = create(model=MODEL, n=3, seed=7, temperature=1.0, **kwargs)
    greedy = create(model=MODEL, temperature=0, **kwargs)
    streamed, reasons = _streamed_texts(create(model=MODEL, temperature=0, stream=True,
                                               **kwargs), 1)
    choices = sampled.choices + greedy.choices
    texts = [c.message.content if endpoint == "chat" else c.text for c in choices]
    assert [c.finish_reason for c in choices] == ["stop"] * 4
    for text in texts:
        _assert_valid_json(text, ITEM)
    assert (streamed, reasons) == ([texts[-1]], ["stop"])


def test_response_format_json_object_gives_json_objects(client):
    """Any JSON object: a sample that completes parses as one (the others hit max_tokens
    inside a string the random model does not close); a stream gives the response's text."""
    kwargs = dict(max_tokens=48, response_format={"type": "json_object"},
                  extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    reply = _chat(client, n=6, seed=0, temperature=1.0, **kwargs)
    finished = [c.message.content for c in reply.choices if c.finish_reason == "stop"]
    assert finished, [c.message.content for c in reply.choices]
    for text in finished:
        assert isinstance(json.loads(text), dict)
    greedy = _chat(client, temperature=0, **kwargs).choices[0]
    assert _streamed_texts(_chat(client, temperature=0, stream=True, **kwargs), 1) == (
        [greedy.message.content], [greedy.finish_reason])


def test_response_format_text_constrains_nothing(client, free_text):
    text = _chat(client, temperature=0, max_tokens=12, response_format={"type": "text"})
    assert text.choices[0].message.content == free_text


# structured_outputs


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_structured_outputs_regex_and_choice(client, endpoint):
    regex, choice = r"(yes|no)-[0-9]{1,3}", ["red", "green", "blue violet"]
    for constraint, holds in (({"regex": regex}, lambda text: re.fullmatch(regex, text)),
                              ({"choice": choice}, lambda text: text in choice)):
        kwargs = dict(model=MODEL, n=4, seed=1, temperature=1.0, max_tokens=32,
                      extra_body={"structured_outputs": constraint})
        if endpoint == "chat":
            reply = client.chat.completions.create(messages=MESSAGES, **kwargs)
            texts = [c.message.content for c in reply.choices]
        else:
            reply = client.completions.create(prompt=PROMPT, **kwargs)
            texts = [c.text for c in reply.choices]
        assert [c.finish_reason for c in reply.choices] == ["stop"] * 4
        assert all(holds(text) for text in texts), texts


def test_a_mixed_batch_gives_each_request_its_output_alone(client, server):
    """Constrained and free requests at once: each greedy output equals the one it got
    alone."""
    requests = [
        dict(messages=MESSAGES, max_tokens=16),
        dict(messages=MESSAGES, max_tokens=40, extra_body={"structured_outputs": {
            "regex": "[a-z ]{4,12}"}}),
        dict(messages=MESSAGES, max_tokens=120, response_format={
            "type": "json_schema", "json_schema": {"name": "item", "schema": ITEM}},
            extra_body={"structured_outputs": COMPACT}),
        dict(messages=[{"role": "user", "content": "a thin"}], max_tokens=16),
        dict(messages=MESSAGES, max_tokens=16, extra_body={"structured_outputs": {
            "choice": ["air", "theme", "other"]}}),
    ]
    alone = [client.chat.completions.create(model=MODEL, temperature=0, **r)
             .choices[0].message.content for r in requests]

    async def together() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server[0]}/v1", api_key=SERVER_API_KEY,
                                      max_retries=0, timeout=60) as async_client:
            replies = await asyncio.gather(*(async_client.chat.completions.create(
                model=MODEL, temperature=0, **r) for r in requests))
        return [reply.choices[0].message.content for reply in replies]

    assert asyncio.run(together()) == alone
    assert re.fullmatch("[a-z ]{4,12}", alone[1]) and alone[4] in ("air", "theme", "other")
    _assert_valid_json(alone[2], ITEM)


# Tool calls


def _streamed_tool_calls(chunks) -> tuple[list[tuple[str, str]], str | None, str]:
    """The (name, arguments) of one choice's streamed tool calls, its finish reason and
    its streamed content; each call's first entry must carry its id, type and name."""
    calls, reason, content = [], None, ""
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
            for call in choice.delta.tool_calls or []:
                if call.index == len(calls):
                    assert call.id and call.type == "function" and call.function.name
                    calls.append([call.function.name, ""])
                assert call.index < len(calls)
                calls[call.index][1] += call.function.arguments or ""
    return [tuple(call) for call in calls], reason, content


@pytest.mark.parametrize("tool", [0, 1])
def test_a_named_function_is_called_with_arguments_under_its_schema(client, tool):
    name = TOOLS[tool]["function"]["name"]
    kwargs = dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}},
                  temperature=0, max_tokens=60, extra_body={"structured_outputs": COMPACT})
    message = _chat(client, **kwargs).choices[0]
    (call,) = message.message.tool_calls
    assert (message.finish_reason, message.message.content) == ("stop", None)
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == name
    _assert_valid_json(call.function.arguments, SCHEMAS[name])
    streamed = _streamed_tool_calls(_chat(client, stream=True, **kwargs))
    assert streamed == ([(name, call.function.arguments)], "stop", "")


def test_tool_choice_required_calls_tools_with_valid_arguments(client):
    """Each call names a tool and its arguments validate under that tool's schema; the
    random model may go on calling until max_tokens cuts the last call short."""
    reply = _chat(client, n=4, seed=5, temperature=1.0, max_tokens=200, tools=TOOLS,
                  tool_choice="required", extra_body={"structured_outputs": COMPACT})
    assert "tool_calls" in [choice.finish_reason for choice in reply.choices]
    for choice in reply.choices:
        assert choice.finish_reason in ("tool_calls", "length")
        assert choice.message.content is None and choice.message.tool_calls
        calls = choice.message.tool_calls
        assert all(call.function.name in SCHEMAS for call in calls)
        complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]
        for call in complete:
            _assert_valid_json(call.function.arguments, SCHEMAS[call.function.name])


def test_streamed_required_calls_join_into_the_response(client):
    """Greedy, the calls go on past max_tokens: the stream and the response agree on
    every call, the one cut short too."""
    kwargs = dict(tools=TOOLS, tool_choice="required", temperature=0, max_tokens=150,
                  extra_body={"structured_outputs": COMPACT})
    choice = _chat(client, **kwargs).choices[0]
    calls = [(call.function.name, call.function.arguments)
             for call in choice.message.tool_calls]
    assert len(calls) > 1
    assert _streamed_tool_calls(_chat(client, stream=True, **kwargs)) == (
        calls, choice.finish_reason, "")


def test_parallel_tool_calls_false_makes_one_call(client):
    reply = _chat(client, n=3, seed=2, temperature=1.0, max_tokens=200, tools=TOOLS,
                  tool_choice="required", parallel_tool_calls=False,
                  extra_body={"structured_outputs": COMPACT})
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        _assert_valid_json(call.function.arguments, SCHEMAS[call.function.name])


def test_tool_choice_none_is_free_text(client, free_text):
    none = _chat(client, temperature=0, max_tokens=12, tools=TOOLS, tool_choice="none")
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == free_text


def test_tools_reach_the_chat_template_as_transformers_gives_them(tiny_llama_dir):
    template = ("{% for tool in tools %}{{ tool.function.name }}({{ tool.function.parameters "
                "| tojson }});{% endfor %}{{ messages[0].content }}")
    hf_tokenizer = oracle_transformers().AutoTokenizer.from_pretrained(tiny_llama_dir)
    hf_tokenizer.chat_template = template
    tokenizer = Tokenizer.from_directory(tiny_llama_dir)
    tokenizer.chat_template = template
    body = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "tools": TOOLS[:2], "tool_choice": "required"})
    options = body.template_options()
    rendered = tokenizer.apply_chat_template(
        [message.as_template_message() for message in body.messages], tokenize=False,
        add_generation_prompt=options["add_generation_prompt"],
        **options["chat_template_kwargs"])
    assert rendered == hf_tokenizer.apply_chat_template(MESSAGES, tools=TOOLS[:2],
                                                        tokenize=False)


# Refusals


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "strin"}}}
REFUSED = {
    # name: (request fields, the param the 400 names, words in its message)
    "a bad response_format schema": (
        {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": BAD_SCHEMA}}},
        "response_format.json_schema.schema", "does not compile"),
    "a bad structured_outputs.json": (
        {"extra_body": {"structured_outputs": {"json": BAD_SCHEMA}}},
        "structured_outputs.json", "structured_outputs.json does not compile"),
    "an unsatisfiable schema": (
        {"extra_body": {"structured_outputs": {"json": {
            "type": "integer", "minimum": 5, "maximum": 2}}}},
        "structured_outputs.json", "does not compile"),
    "a bad regex": ({"extra_body": {"structured_outputs": {"regex": "(ab"}}},
                    "structured_outputs.regex", "does not compile"),
    "a named tool's bad parameters": (
        {"tools": TOOLS[:1] + [{"type": "function", "function": {
            "name": "bad", "parameters": BAD_SCHEMA}}],
         "tool_choice": {"type": "function", "function": {"name": "bad"}}},
        "tools[1].function.parameters", "tools[1].function.parameters does not compile"),
    "a required tool's bad parameters": (
        {"tools": TOOLS[:1] + [{"type": "function", "function": {
            "name": "bad", "parameters": BAD_SCHEMA}}], "tool_choice": "required"},
        "tools[1].function.parameters", "tools[1].function.parameters does not compile"),
    "guided_json": ({"extra_body": {"guided_json": ITEM}}, "guided_json",
                    "structured_outputs.json"),
    "guided_decoding_backend": ({"extra_body": {"guided_decoding_backend": "xgrammar"}},
                                "guided_decoding_backend", "llguidance"),
    "tool_choice auto": ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice",
                         'use tool_choice "required" or a named function'),
    "tools without tool_choice": ({"tools": TOOLS}, "tool_choice", 'tool_choice "auto"'),
    "an unknown function": ({"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "fly"}}}, "tool_choice", "'fly'"),
    "tool_choice without tools": ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    "response_format and structured_outputs": (
        {"response_format": {"type": "json_object"},
         "extra_body": {"structured_outputs": {"regex": "a+"}}}, "response_format",
        "structured_outputs and response_format both constrain the output"),
    "a forced call and response_format": (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice", "response_format and tool_choice both constrain the output"),
    "structural_tag": ({"extra_body": {"structured_outputs": {"structural_tag": "{}"}}},
                       "structured_outputs.structural_tag", "not supported"),
    "structured_outputs without a constraint": (
        {"extra_body": {"structured_outputs": COMPACT}}, "structured_outputs", "exactly one"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_constraints_name_their_field(client, free_text, case):
    fields, param, words = REFUSED[case]
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(client, max_tokens=4, **fields)
    error = refused.value.body
    assert error["param"] == param and words in error["message"], error
    # The engine goes on serving, as before.
    assert _chat(client, temperature=0, max_tokens=12).choices[0].message.content == free_text
