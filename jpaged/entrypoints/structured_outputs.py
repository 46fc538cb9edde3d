"""Structured outputs on the server: the request fields that constrain an output, as the
engine's one StructuredOutputsParams, and errors that name the field the request gave.

Three fields can constrain an output, at most one of them per request:

    response_format      OpenAI's: {"type": "json_object"}, or {"type": "json_schema",
                         "json_schema": {"name", "schema"}}; {"type": "text"} is no constraint.
    structured_outputs   vLLM's: one of json, regex, choice, grammar, json_object. Beside
                         one of the others it may set only the JSON options
                         (disable_any_whitespace, ...), which then apply to that one.
    tool_choice (chat)   "required" or a named function: the calls' JSON
                         (jpaged.entrypoints.tool_calls); "none" is no constraint, "auto"
                         is refused.

The engine compiles the grammar when the request is added and names what does not
compile `structured_outputs.<kind>`; `Constraint.api_error` renames it as the request
spelled it (`response_format.json_schema.schema`, `tools[2].function.parameters`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import llguidance

from jpaged.entrypoints.errors import ApiError
from jpaged.entrypoints.protocol import (
    ChatCompletionRequest,
    ResponseFormat,
    SamplingFields,
    StructuredOutputsFields,
)
from jpaged.entrypoints.tool_calls import ForcedCalls, parameters_schema, required_schema
from jpaged.errors import InvalidParameter, InvalidParameterType
from jpaged.sampling_params import StructuredOutputsParams
from jpaged.structured_output.compiler import grammar_definition

AUTO_TOOL_CHOICE = (
    'tool_choice "auto" lets the model call tools in its own format, which needs a parser '
    "for each model family; jpaged has none: use tool_choice \"required\" or a named function "
    '({"type": "function", "function": {"name": ...}})')


@dataclass(frozen=True)
class Source:
    """One field's constraint: kinds maps StructuredOutputsParams' names to values;
    fields maps each kind to the field it came from, as the request spells it."""

    name: str
    kinds: dict[str, Any]
    fields: dict[str, str]
    forced_calls: ForcedCalls | None = None
    # "required": each tool's (field, parameters schema), to find the one that fails.
    tools: tuple[tuple[str, dict], ...] = ()


@dataclass(frozen=True)
class Constraint:
    """A request's constraint: the engine's params, and how to read and report it."""

    params: StructuredOutputsParams
    source: Source
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def forced_calls(self) -> ForcedCalls | None:
        return self.source.forced_calls

    def api_error(self, error: Exception) -> ApiError | None:
        """The 400 for the engine's error about this constraint (None for another error):
        the message and param name the request's field."""
        param = getattr(error, "param", None)
        if not (isinstance(param, str) and param.startswith("structured_outputs.")):
            return None
        request_field = self.source.fields.get(param.removeprefix("structured_outputs."))
        if request_field is None:
            return None
        if self.source.tools:
            failing = self._failing_tool()
            if failing is not None:
                return failing
        message = str(error)
        if message.startswith(param):
            message = request_field + message[len(param):]
        return ApiError(400, message, request_field)

    def _failing_tool(self) -> ApiError | None:
        """The 400 naming the first tool whose parameters schema alone does not compile."""
        for request_field, schema in self.source.tools:
            message = compile_error(_params({"json": schema}, self.options))
            if message is not None:
                return ApiError(400, f"{request_field} does not compile: {message}",
                                request_field)
        return None


def compile_error(params: StructuredOutputsParams) -> str | None:
    """llguidance's message if a constraint does not compile, else None (checked without
    the tokenizer: the engine's compile found the error, this finds its place)."""
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar_definition(params))
    except ValueError as failure:
        return str(failure)
    return error.strip() or None


def request_constraint(body: SamplingFields) -> Constraint | None:
    """The request's constraint (None: its output is free); a 400 for a field that
    cannot be one, or for two fields that both constrain the output."""
    sources = [source for source in (_structured_outputs_source(body.structured_outputs),
                                     _response_format_source(body.response_format),
                                     _tool_choice_source(body))
               if source is not None]
    if len(sources) > 1:
        names = " and ".join(source.name for source in sources)
        raise ApiError(400, f"{names} both constrain the output: give one of them",
                       sources[1].name)
    if not sources and body.structured_outputs is None:
        return None
    # structured_outputs with options only and nothing else: the params refuse it.
    source = sources[0] if sources else Source("structured_outputs", {}, {})
    options = {} if body.structured_outputs is None else body.structured_outputs.options()
    return Constraint(_params(source.kinds, options), source, options)


def _params(kinds: dict[str, Any], options: dict[str, Any]) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kinds, **options)
    except (InvalidParameter, InvalidParameterType) as error:
        raise ApiError(400, str(error), error.param) from error


def _structured_outputs_source(fields: StructuredOutputsFields | None) -> Source | None:
    kinds = {} if fields is None else fields.constraints()
    if not kinds:
        return None
    return Source("structured_outputs", kinds, {kind: f"structured_outputs.{kind}"
                                                for kind in kinds})


def _response_format_source(response_format: ResponseFormat | None) -> Source | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return Source("response_format", {"json_object": True},
                      {"json_object": "response_format"})
    if response_format.type == "structural_tag":
        raise ApiError(400, "response_format type 'structural_tag' is not supported: "
                            "constrain the output with json_schema, or force a tool call "
                            "with tool_choice", "response_format")
    if response_format.json_schema is None:
        raise ApiError(400, "response_format type 'json_schema' needs its 'json_schema' "
                            "field: {\"name\": ..., \"schema\": {...}}", "response_format")
    return Source("response_format", {"json": response_format.json_schema.schema_},
                  {"json": "response_format.json_schema.schema"})


def _tool_choice_source(body: SamplingFields) -> Source | None:
    """The calls a chat request's tool_choice forces (None for "none" or no tools)."""
    if not isinstance(body, ChatCompletionRequest):
        return None
    choice, tools = body.tool_choice, body.tools
    if tools is None:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools to choose from", "tool_choice")
        return None
    functions = _functions(body)
    if choice is None or choice == "auto":
        given = "tools without tool_choice mean tool_choice \"auto\"; " if choice is None else ""
        raise ApiError(400, given + AUTO_TOOL_CHOICE, "tool_choice")
    if choice == "none":
        return None
    if choice == "required":
        return _required_source(functions, body.parallel_tool_calls is False)
    names = [function["name"] for function in functions]
    if choice.function.name not in names:
        raise ApiError(400, f"tool_choice names the function '{choice.function.name}', which "
                            f"is not among the tools: {names}", "tool_choice")
    index = names.index(choice.function.name)
    request_field = f"tools[{index}].function.parameters"
    return Source("tool_choice", {"json": parameters_schema(functions[index])},
                  {"json": request_field}, ForcedCalls(choice.function.name))


def _functions(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The tools' function objects; a 400 for no tools, or two of one name."""
    if not body.tools:
        raise ApiError(400, "tools must not be empty: give at least one tool, or leave the "
                            "field out", "tools")
    functions = [tool.function.model_dump(exclude_none=True) for tool in body.tools]
    names = [function["name"] for function in functions]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ApiError(400, f"tool names must be unique; repeated: {repeated}", "tools")
    return functions


def _required_source(functions: list[dict[str, Any]], one_call: bool) -> Source:
    schema, conflicts = required_schema(functions, one_call)
    if conflicts:
        index, key, name = conflicts[0]
        request_field = f"tools[{index}].function.parameters"
        raise ApiError(400, f"{request_field} defines {key}/{name} differently from an earlier "
                            "tool; under tool_choice \"required\" the tools' definitions share "
                            "one namespace", request_field)
    tools = tuple((f"tools[{index}].function.parameters", parameters_schema(function))
                  for index, function in enumerate(functions))
    return Source("tool_choice", {"json": schema}, {"json": "tools"}, ForcedCalls(), tools)
