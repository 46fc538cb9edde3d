"""Tool calls that a request forces, read back from the output a grammar kept to.

OpenAI's `tool_choice` can force the model to call a tool. jpaged, as vLLM, constrains
the output to the calls' JSON and reads the calls out of the text:

    a named function f   the output is f's arguments: JSON under f's parameters schema.
    "required"           the output is a JSON array of one or more
                         {"name": <a tool's name>, "parameters": <its arguments>} objects.

"auto" (the model decides whether to call a tool, in its own syntax) needs a parser of
each model family's tool-call format, which jpaged does not have.

A call's `arguments` are the JSON text as generated, in a response and in a stream alike:
a stream sends each call's id and name once its name is complete, then its arguments as
they grow, so the pieces of a stream join into the response's calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

# A tool without a parameters schema takes an object (vLLM's stand-in; closed, so empty,
# under disable_additional_properties).
NO_PARAMETERS = {"type": "object", "properties": {}}
# The key of a call's arguments in "required"'s array (vLLM's name).
ARGUMENTS_KEY = "parameters"
# Sub-schemas that a tool's "$ref"s point at ("#/$defs/X", "#/definitions/X").
DEFINITION_KEYS = ("$defs", "definitions")


@dataclass(frozen=True)
class ToolCall:
    """name: the called tool's; arguments: JSON text, unfinished if the output was cut."""

    name: str
    arguments: str


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex}"


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema (an OpenAI tool's `function` object)."""
    return function.get("parameters") or NO_PARAMETERS


def required_schema(functions: list[dict[str, Any]], one_call: bool = False
                    ) -> tuple[dict[str, Any], list[tuple[int, str, str]]]:
    """The JSON schema of "required"'s output: an array of calls, each one tool's name and
    arguments (at most one call with one_call: parallel_tool_calls=false).

    Each tool's `$defs` move to the array's root, where its `$ref`s point once the tool's
    schema is nested. Returns the schema and the conflicts (tool index, definitions key,
    name) where two tools define one name differently.
    """
    calls, definitions, conflicts = [], {}, []
    for index, function in enumerate(functions):
        parameters = dict(parameters_schema(function))
        for key in DEFINITION_KEYS:
            for name, schema in parameters.pop(key, {}).items():
                if definitions.setdefault(key, {}).setdefault(name, schema) != schema:
                    conflicts.append((index, key, name))
        calls.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                     ARGUMENTS_KEY: parameters},
                      "required": ["name", ARGUMENTS_KEY]})
    # Each alternative a whole object schema, its type beside its properties (none
    # around them): disable_additional_properties closes exactly the schemas that list
    # properties.
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}} | definitions
    if one_call:
        schema["maxItems"] = 1
    return schema, conflicts


@dataclass(frozen=True)
class ForcedCalls:
    """How a request forces calls: `function`, the named function's name; None for
    "required" (any of its tools, one or more calls)."""

    function: str | None = None

    def reader(self) -> NamedCall | CallArray:
        """A reader of one output's calls."""
        return CallArray() if self.function is None else NamedCall(self.function)

    def finish_reason(self, reason: str | None) -> str | None:
        """An output's finish reason as OpenAI and vLLM report it: "tool_calls" once
        "required"'s calls are complete; a named function's stays "stop"."""
        return "tool_calls" if self.function is None and reason == "stop" else reason


class NamedCall:
    """The calls of a named function's output: one, whose arguments are the whole text."""

    def __init__(self, name: str):
        self.name, self.text = name, ""

    def feed(self, piece: str) -> None:
        self.text += piece

    @property
    def calls(self) -> list[ToolCall]:
        return [ToolCall(self.name, self.text)]


@dataclass
class _Call:
    """One call object of the array: its name once read, its arguments' span [start, end)
    in the text (end None while they are still being generated)."""

    name: str | None = None
    start: int | None = None
    end: int | None = None


class CallArray:
    """The calls of "required"'s output, read as the text grows.

    The text is a prefix of a JSON array of call objects (the grammar sees to it), so one
    pass over its characters finds each call's members: a string closed inside a call
    object (depth 2) is a key until a ':' makes the next value its member's. A member's
    value starts at its first character and ends where a container returns to depth 2,
    where its string closes, or (a number, true, false, null) at the character after it.
    Calls are reported in order up to the first whose name is not complete; a call's
    arguments only ever grow.
    """

    def __init__(self):
        self.text = ""
        self._calls: list[_Call] = []
        self._depth = 0  # open arrays and objects: 1 inside the array, 2 inside a call
        self._in_string = False
        self._escaped = False
        self._string_start = 0
        self._key: str | None = None  # the last key read in the current call object
        self._member: str | None = None  # whose value is being read (None between members)
        self._value_start: int | None = None

    def feed(self, piece: str) -> None:
        start = len(self.text)
        self.text += piece
        for position in range(start, len(self.text)):
            self._step(position, self.text[position])

    @property
    def calls(self) -> list[ToolCall]:
        calls = []
        for call in self._calls:
            if call.name is None:
                break
            arguments = "" if call.start is None else self.text[call.start:call.end]
            calls.append(ToolCall(call.name, arguments))
        return calls

    def _step(self, position: int, char: str) -> None:
        if self._in_string:
            self._string_step(position, char)
            return
        in_member = self._depth == 2 and self._member is not None
        if in_member and self._value_start is not None and char in " \t\n\r,}":
            self._end_value(position)  # a number or literal ends before this character
        elif in_member and self._value_start is None and char not in " \t\n\r":
            self._start_value(position)
        if char == '"':
            self._in_string, self._string_start = True, position
        elif char in "[{":
            self._depth += 1
            if self._depth == 2:
                self._calls.append(_Call())
        elif char in "]}":
            self._depth -= 1
            if self._depth == 2 and self._member is not None:
                self._end_value(position + 1)
        elif char == ":" and self._depth == 2:
            self._member, self._value_start = self._key, None

    def _string_step(self, position: int, char: str) -> None:
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        elif char == '"':
            self._in_string = False
            if self._depth != 2:
                return
            if self._member is not None and self._value_start == self._string_start:
                self._end_value(position + 1)
            elif self._member is None:
                self._key = json.loads(self.text[self._string_start:position + 1])

    def _start_value(self, start: int) -> None:
        self._value_start = start
        if self._member == ARGUMENTS_KEY:
            self._calls[-1].start = start

    def _end_value(self, end: int) -> None:
        call = self._calls[-1]
        if self._member == "name":
            call.name = json.loads(self.text[self._value_start:end])
        elif self._member == ARGUMENTS_KEY:
            call.end = end
        self._member = None


class ToolCallStream:
    """One choice's tool calls in a stream: from each new piece of the output, the entries
    of OpenAI's `delta.tool_calls`. A call's first entry carries its index, id, type and
    name (and its arguments so far), the later ones the arguments it gained."""

    def __init__(self, reader: NamedCall | CallArray):
        self.reader = reader
        self.sent: list[int] = []  # per call reported: the length of its arguments sent

    def deltas(self, piece: str) -> list[dict[str, Any]]:
        self.reader.feed(piece)
        deltas = []
        for index, call in enumerate(self.reader.calls):
            if index == len(self.sent):
                self.sent.append(len(call.arguments))
                deltas.append({"index": index, "id": tool_call_id(), "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > self.sent[index]:
                deltas.append({"index": index,
                               "function": {"arguments": call.arguments[self.sent[index]:]}})
                self.sent[index] = len(call.arguments)
        return deltas


def response_tool_calls(reader: NamedCall | CallArray, text: str) -> list[dict[str, Any]]:
    """A response's `message.tool_calls` for an output's whole text."""
    reader.feed(text)
    return [{"id": tool_call_id(), "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for call in reader.calls]
