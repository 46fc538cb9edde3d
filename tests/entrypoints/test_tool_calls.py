"""Reading forced tool calls out of an output as it grows (jpaged.entrypoints.tool_calls).

The oracle is Python's json module: the calls read from any JSON text of a call array,
fed in any pieces, are the array's names and (parsed back) parameters, and a call's
arguments read from a prefix of the text only ever grow. The schema of "required" is
held to jsonschema: the calls it accepts are those of the tools.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged.entrypoints.tool_calls import CallArray, ToolCallStream, required_schema

SCALARS = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(
    allow_nan=False, allow_infinity=False) | st.text('ab"\\{}[],: \n\u00e9', max_size=6)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text('ka"{:', max_size=3), inner, max_size=3), max_leaves=8)
NAMES = st.sampled_from(["f", "g\u00e9", 'h"q', "parameters", "name"])
CALLS = st.lists(st.tuples(NAMES, VALUES, st.booleans()), min_size=1, max_size=3)
LAYOUTS = st.sampled_from([dict(separators=(",", ":")), dict(separators=(", ", ": ")),
                           dict(indent=2), dict(indent="\t", ensure_ascii=False)])


def _call_array_text(calls: list[tuple[str, object, bool]], layout: dict) -> str:
    """calls: (name, parameters, whether parameters come first)."""
    return json.dumps([{"parameters": value, "name": name} if first else
                       {"name": name, "parameters": value} for name, value, first in calls],
                      **layout)


@settings(max_examples=200, deadline=None)
@given(calls=CALLS, layout=LAYOUTS, cuts=st.lists(st.integers(1, 6), max_size=200))
def test_call_array_reads_every_call_from_any_pieces(calls, layout, cuts):
    text = _call_array_text(calls, layout)
    reader, read, start = CallArray(), [], 0
    for size in [*cuts, len(text)]:
        reader.feed(text[start:start + size])
        start += size
        now = reader.calls
        assert len(now) >= len(read)
        for before, after in zip(read, now, strict=False):
            assert after.name == before.name and after.arguments.startswith(before.arguments)
        read = now
    assert [call.name for call in read] == [name for name, _, _ in calls]
    assert [json.loads(call.arguments) for call in read] == [value for _, value, _ in calls]


@settings(max_examples=100, deadline=None)
@given(calls=CALLS, layout=LAYOUTS, cuts=st.lists(st.integers(1, 6), max_size=200))
def test_stream_deltas_join_into_the_calls(calls, layout, cuts):
    text = _call_array_text(calls, layout)
    stream, joined, start = ToolCallStream(CallArray()), [], 0
    for size in [*cuts, len(text)]:
        for delta in stream.deltas(text[start:start + size]):
            if delta["index"] == len(joined):
                assert delta["id"].startswith("call_") and delta["type"] == "function"
                joined.append([delta["function"]["name"], ""])
            joined[delta["index"]][1] += delta["function"]["arguments"]
        start += size
    assert [(name, json.loads(arguments)) for name, arguments in joined] == [
        (name, value) for name, value, _ in calls]


TOOLS = [{"name": "f", "parameters": {"type": "object", "properties": {
             "x": {"$ref": "#/$defs/Small"}}, "required": ["x"],
             "$defs": {"Small": {"type": "integer", "maximum": 3}}}},
         {"name": "g"}]


@pytest.mark.parametrize(("calls", "valid"), [
    ([{"name": "f", "parameters": {"x": 2}}], True),
    ([{"name": "f", "parameters": {"x": 2}}, {"name": "g", "parameters": {}}], True),
    ([], False),
    ([{"name": "f", "parameters": {"x": 9}}], False),  # over its $defs' maximum
    ([{"name": "g", "parameters": {"x": 9}}], True),  # g takes any object, as OpenAI says
    ([{"name": "h", "parameters": {}}], False),
    ([{"name": "g"}], False),
])
def test_required_schema_accepts_the_tools_calls(calls, valid):
    schema, conflicts = required_schema(TOOLS)
    assert conflicts == []
    assert jsonschema.Draft202012Validator(schema).is_valid(calls) == valid
    one_call, _ = required_schema(TOOLS, one_call=True)
    assert jsonschema.Draft202012Validator(one_call).is_valid(calls) == (valid and len(calls) == 1)


def test_required_schema_reports_two_tools_defining_a_name_differently():
    other = {"name": "h", "parameters": {"$defs": {"Small": {"type": "string"}}}}
    _, conflicts = required_schema([*TOOLS, other])
    assert conflicts == [(2, "$defs", "Small")]
