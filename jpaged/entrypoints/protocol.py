"""The OpenAI-compatible API on the wire, with vLLM's names: request bodies in,
response bodies and stream chunks out.

Request bodies are pydantic models that refuse what jpaged does not implement:
an unknown field (`functions`, `audio`, ...) is a 400 that names it, never silently
ignored (vLLM ignores unknown fields with a log line). Types are strict (no "5" for 5,
no true for 1) but for integral floats (5.0 is 5); an explicit JSON null means the
field's default. Fields that change nothing without storage (`user`, `store`,
`metadata`, `service_tier`) are accepted and not used. The fields that constrain the
output (`response_format`, `structured_outputs`, `tools` with `tool_choice`) become the
engine's StructuredOutputsParams in jpaged.entrypoints.structured_outputs. Responses
are plain dicts built from the engine's outputs: a `Job` (one HTTP request's engine
requests) renders its choices, usage and envelope.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from jpaged.entrypoints.tool_calls import ForcedCalls, ToolCallStream, response_tool_calls
from jpaged.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from jpaged.sampling_params import STRUCTURED_OUTPUT_KINDS

if TYPE_CHECKING:
    from jpaged.engine.async_engine import RequestStream

# What JSON cannot hold (-inf) is reported as this, as vLLM does.
MIN_LOGPROB = -9999.0


def _integral(value: Any) -> Any:
    """5.0 -> 5: JSON writers may spell an integer as a float. 5.5 stays a float (refused)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An int field: an int, or a float with an integral value.
Integer = Annotated[int, BeforeValidator(_integral)]


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class StreamOptions(OpenAIBaseModel):
    """include_usage: a last chunk with the request's usage (on once stream_options is
    given, as in vLLM); continuous_usage_stats: with include_usage, every chunk also
    carries its choice's usage so far."""

    include_usage: bool = True
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenAIBaseModel):
    """response_format's json_schema: the schema the output validates under. name,
    description and strict are accepted (the schema is always enforced)."""

    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's response_format: plain text, any JSON object, or JSON under a schema.
    "structural_tag" (vLLM's) is parsed to be refused with a message saying so."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsFields(OpenAIBaseModel):
    """vLLM's structured_outputs request field: StructuredOutputsParams' fields
    (jpaged.sampling_params). Alone it gives the constraint (one of json, regex, choice,
    grammar, json_object); beside response_format or a forced tool call, only its JSON
    options, as in vLLM."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | dict[str, Any] | None = None

    def constraints(self) -> dict[str, Any]:
        """The constraints given, by StructuredOutputsParams' names."""
        given = {kind: getattr(self, "json_" if kind == "json" else kind)
                 for kind in STRUCTURED_OUTPUT_KINDS}
        return {kind: value for kind, value in given.items() if value not in (None, False)}

    def options(self) -> dict[str, Any]:
        """What else it sets: the JSON options (and structural_tag, to be refused)."""
        options = {"disable_any_whitespace": self.disable_any_whitespace,
                   "disable_additional_properties": self.disable_additional_properties,
                   "whitespace_pattern": self.whitespace_pattern}
        if self.structural_tag is not None:
            options["structural_tag"] = str(self.structural_tag)  # only to be refused
        return options


class SamplingFields(OpenAIBaseModel):
    """The fields both endpoints map onto SamplingParams; vLLM's extras included."""

    model: str | None = None
    n: Integer = 1
    stop: str | list[str] | None = None
    seed: Integer | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling parameters.
    top_k: Integer = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: Integer = 0
    ignore_eos: bool = False
    stop_token_ids: list[Integer] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Integer | None = None
    cache_salt: str | None = None
    # Constraints on the output (jpaged.entrypoints.structured_outputs).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    # Accepted and not used: nothing here stores requests or sells service tiers.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: vLLM's rule, continuous_usage_stats with include_usage."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingFields):
    """POST /v1/completions. prompt: text, token ids, or a list of either (a batch).

    max_tokens 0 is allowed with echo: the response holds only the prompt (and
    with logprobs, the prompt's log-probabilities). best_of: each prompt samples
    best_of candidates and returns the n of highest cumulative log-probability
    (vLLM v0's meaning; not with a stream unless best_of == n).
    """

    prompt: str | list[Integer] | list[str] | list[list[Integer]]
    max_tokens: Integer = 16
    echo: bool = False
    logprobs: Annotated[Integer, Field(ge=0)] | None = None
    best_of: Annotated[Integer, Field(ge=1)] | None = None
    suffix: str | None = None  # refused with a 400 that names it, as vLLM does

    def prompts(self) -> list[str] | list[list[int]]:
        """The batch of prompts: a text or a token-id list is a batch of one."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return prompt


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


def _text_parts_only(content: Any) -> Any:
    """A content list's parts must be text: an image or audio part gets one clear message
    (not pydantic's every union alternative)."""
    for index, part in enumerate(content if isinstance(content, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind is not None and kind != "text":
            raise PydanticCustomError(
                "unsupported_content_part",
                f"part {index} is of type {kind!r}: jpaged serves text-only models, so a "
                "message's content is a string or a list of parts of type 'text'")
    return content


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str | list[TextContentPart], BeforeValidator(_text_parts_only)]
    name: str | None = None

    @property
    def text(self) -> str:
        """The content, text parts joined."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_template_message(self) -> dict[str, str]:
        """{"role", "content"}, for the chat template."""
        return {"role": self.role, "content": self.text}


class ChatTemplateFields(OpenAIBaseModel):
    """vLLM's chat template fields, of chat requests and of /tokenize."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def template_options(self) -> dict[str, Any]:
        """The keyword arguments of the engine's apply_chat_template."""
        return dict(add_generation_prompt=self.add_generation_prompt,
                    continue_final_message=self.continue_final_message,
                    chat_template_kwargs=self.chat_template_kwargs)


class FunctionDefinition(OpenAIBaseModel):
    """A tool's function: parameters is its arguments' JSON schema (none: an object);
    strict is accepted (a forced call's arguments always keep to the schema)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    """tool_choice naming the function the model must call."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    """POST /v1/chat/completions. max_completion_tokens wins over max_tokens; neither
    means up to max_model_len. logprobs=True reports each output token's
    log-probability and its top_logprobs alternatives.

    vLLM's template fields: add_generation_prompt opens the assistant's turn;
    continue_final_message instead continues the last message (the assistant's),
    without closing its turn; chat_template_kwargs are more variables for the template
    (the two fields above win over the same names in it). echo prepends the last
    message's content to each choice when the response continues that message's role.

    tools are given to the chat template (as `tools`, as vLLM does); tool_choice
    "required" or a named function forces calls (jpaged.entrypoints.tool_calls).
    """

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Integer | None = None
    max_completion_tokens: Integer | None = None
    logprobs: bool = False
    top_logprobs: Annotated[Integer, Field(ge=0, le=20)] | None = None
    echo: bool = False
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # False: tool_choice "required" makes exactly one call.
    parallel_tool_calls: bool | None = None

    def template_options(self) -> dict[str, Any]:
        """ChatTemplateFields' options, the tools among the template's variables."""
        options = super().template_options()
        if self.tools:
            tools = [tool.model_dump(exclude_none=True) for tool in self.tools]
            options["chat_template_kwargs"] = (self.chat_template_kwargs or {}) | {"tools": tools}
        return options

    @property
    def response_role(self) -> str:
        """The role the response speaks in: the assistant's, or the last message's when
        no generation prompt opens a new turn (as vLLM answers)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    @property
    def echoed_text(self) -> str:
        """What echo prepends: the last message's content if the response continues its role."""
        last = self.messages[-1]
        return last.text if self.echo and last.role == self.response_role else ""


# Responses.


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


def prompt_tokens_details(num_cached_tokens: int) -> dict[str, dict[str, int]]:
    """vLLM's and OpenAI's usage detail: the prompt tokens the prefix cache served."""
    return {"prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def completion_logprobs(
    token_ids: list[int], entries: list[dict[int, Logprob] | None], token_texts: list[str],
    text_offset: int,
) -> dict[str, list]:
    """The completions API's logprobs object over some tokens.

    entries: per token, token id -> Logprob (the token itself and the top
    alternatives), or None where nothing conditions it (the first prompt token);
    token_texts: each token's text; text_offset: where the first token starts. A
    token's offset is the sum of the texts of the tokens before it (which may differ
    from the choice's text where a token holds part of a character).
    """
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry, text in zip(token_ids, entries, token_texts, strict=True):
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_finite(entry[token_id].logprob))
        top_logprobs.append({lp.decoded_token: _finite(lp.logprob) for lp in entry.values()})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _chat_logprob(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}


def chat_logprobs(output: CompletionOutput, num_top: int) -> dict[str, list]:
    """The chat API's logprobs object: per output token, its log-probability and the
    num_top most likely tokens, by rank."""
    content = []
    for token_id, entry in zip(output.token_ids, output.logprobs or (), strict=True):
        chosen = entry[token_id]
        top = sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank)
        content.append(_chat_logprob(chosen.decoded_token, chosen.logprob)
                       | {"top_logprobs": [_chat_logprob(lp.decoded_token, lp.logprob)
                                           for lp in top]})
    return {"content": content}


def prompt_logprobs_entries(entries: PromptLogprobs) -> list[dict[int, dict] | None]:
    """vLLM's prompt_logprobs: per prompt token, None for the first, then token id ->
    {logprob, rank, decoded_token} for the token itself and the top alternatives."""
    return [None if entry is None else {
        token_id: {"logprob": _finite(lp.logprob), "rank": lp.rank,
                   "decoded_token": lp.decoded_token}
        for token_id, lp in entry.items()} for entry in entries]


# One HTTP request's engine requests.


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt as the engine sees it, with the texts an echo reports."""

    token_ids: list[int]
    text: str = ""
    first_token_text: str = ""


@dataclass
class PromptRun:
    """One prompt's engine request and what it produced so far, merged per sample."""

    index: int
    prompt: EncodedPrompt
    stream: RequestStream
    prompt_logprobs: PromptLogprobs | None = None
    outputs: dict[int, CompletionOutput] = field(default_factory=dict)
    num_cached_tokens: int = 0

    def add(self, delta: RequestOutput) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.num_cached_tokens is not None:
            self.num_cached_tokens = delta.num_cached_tokens
        for piece in delta.outputs:
            total = self.outputs.get(piece.index)
            if total is None:
                self.outputs[piece.index] = CompletionOutput(
                    piece.index, piece.text, list(piece.token_ids), piece.cumulative_logprob,
                    None if piece.logprobs is None else list(piece.logprobs),
                    piece.finish_reason, piece.stop_reason)
                continue
            total.text += piece.text
            total.token_ids += piece.token_ids
            if piece.logprobs is not None:
                total.logprobs = (total.logprobs or []) + piece.logprobs
            total.cumulative_logprob = piece.cumulative_logprob
            total.finish_reason, total.stop_reason = piece.finish_reason, piece.stop_reason

    @property
    def num_output_tokens(self) -> int:
        return sum(len(output.token_ids) for output in self.outputs.values())

    def sorted_outputs(self) -> list[CompletionOutput]:
        return sorted(self.outputs.values(), key=lambda output: output.index)


@dataclass
class Job:
    """One HTTP request's engine requests and the response's common fields."""

    request_id: str
    body: Any
    runs: list[PromptRun]
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    # Usage reports the prompt tokens the prefix cache served (--enable-prompt-tokens-details).
    cached_tokens_in_usage: bool = False

    def close(self) -> None:
        """Abort whatever has not finished (a disconnect, an error)."""
        for run in self.runs:
            run.stream.close()

    def envelope(self, choices: list[dict], kind: str = "text_completion") -> dict:
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.model, "choices": choices}

    def returned(self, run: PromptRun) -> list[tuple[int, CompletionOutput]]:
        """(choice index, output) of what the response reports of a run."""
        return [(output.index, output) for output in run.sorted_outputs()]

    def num_completion_tokens(self, output: CompletionOutput) -> int:
        return len(output.token_ids)

    def usage(self) -> dict:
        counts = usage(sum(len(run.prompt.token_ids) for run in self.runs),
                       sum(self.num_completion_tokens(output)
                           for run in self.runs for _, output in self.returned(run)))
        if self.cached_tokens_in_usage:
            counts |= prompt_tokens_details(sum(run.num_cached_tokens for run in self.runs))
        return counts

    def chunk(self, choices: list[dict], kind: str, run: PromptRun, index: int) -> dict:
        """A stream's chunk for sample `index` of `run`; with continuous usage it carries
        that choice's usage so far (the prompt's tokens, the choice's output tokens)."""
        chunk = self.envelope(choices, kind)
        if self.body.continuous_usage:
            output = run.outputs.get(index)
            chunk["usage"] = usage(len(run.prompt.token_ids),
                                   0 if output is None else self.num_completion_tokens(output))
        return chunk


class CompletionJob(Job):
    """A completions request: choice index = prompt index * n + its rank among the
    prompt's returned samples."""

    body: CompletionRequest

    @property
    def drops_output(self) -> bool:
        """max_tokens=0: the one token generated is not reported."""
        return self.body.max_tokens == 0

    def num_completion_tokens(self, output: CompletionOutput) -> int:
        return 0 if self.drops_output else len(output.token_ids)

    def returned(self, run: PromptRun) -> list[tuple[int, CompletionOutput]]:
        """All n samples in order; with best_of, the n candidates of highest cumulative
        log-probability, best first."""
        n, outputs = self.body.n, run.sorted_outputs()
        if self.body.best_of is not None:
            outputs = sorted(outputs, key=lambda output: -output.cumulative_logprob)[:n]
        return [(run.index * n + rank, output) for rank, output in enumerate(outputs)]

    def stream_index(self, run: PromptRun, output: CompletionOutput) -> int:
        """A streamed choice's index (a stream has best_of == n: every sample returns)."""
        return run.index * self.body.n + output.index

    def choice(self, run: PromptRun, output: CompletionOutput, index: int, first: bool = True,
               text_offset: int = 0) -> dict:
        """A choice from an output (cumulative, or a stream's delta). The first piece of a
        choice carries the echoed prompt and the prompt's log-probabilities; text_offset:
        where its first logprobs token starts (in a stream, where the previous piece's
        tokens ended)."""
        echoes = self.body.echo and first
        text = (run.prompt.text if echoes else "") + ("" if self.drops_output else output.text)
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = self._logprobs(run, output, echoes, text_offset)
        finish_reason, stop_reason = output.finish_reason, output.stop_reason
        if self.drops_output and finish_reason is not None:
            finish_reason, stop_reason = "length", None
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": finish_reason, "stop_reason": stop_reason}
        if self.body.prompt_logprobs is not None and first:
            choice["prompt_logprobs"] = prompt_logprobs_entries(run.prompt_logprobs)
        return choice

    def _logprobs(self, run: PromptRun, output: CompletionOutput, with_prompt: bool,
                  text_offset: int) -> dict:
        token_ids, entries = [], []
        if with_prompt:
            token_ids, entries = list(run.prompt.token_ids), list(run.prompt_logprobs)
        if not self.drops_output:
            token_ids += output.token_ids
            entries += output.logprobs
        # Only the first prompt token has no entry: nothing conditions it.
        token_texts = [run.prompt.first_token_text if entry is None else entry[t].decoded_token
                       for t, entry in zip(token_ids, entries, strict=True)]
        return completion_logprobs(token_ids, entries, token_texts, text_offset)


def next_text_offset(choice: dict, text_offset: int) -> int:
    """Where the tokens after a streamed completions choice start."""
    logprobs = choice["logprobs"]
    if not logprobs or not logprobs["tokens"]:
        return text_offset
    return logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])


@dataclass
class ChatJob(Job):
    """A chat request: one prompt, n choices. forced_calls: the tool calls its tool_choice
    forces, which its choices report instead of their text (None: the text)."""

    body: ChatCompletionRequest
    forced_calls: ForcedCalls | None = None
    tool_streams: dict[int, ToolCallStream] = field(default_factory=dict)

    def choice(self, output: CompletionOutput, key: str, message: dict) -> dict:
        """key: "message" in a response, "delta" in a stream's chunk."""
        logprobs = chat_logprobs(output, self.body.top_logprobs or 0) if self.body.logprobs \
            else None
        finish_reason = output.finish_reason
        if self.forced_calls is not None:
            finish_reason = self.forced_calls.finish_reason(finish_reason)
        return {"index": output.index, key: message, "logprobs": logprobs,
                "finish_reason": finish_reason, "stop_reason": output.stop_reason}

    def message(self, output: CompletionOutput) -> dict:
        """A response's message: the echoed text, then the output's (or its tool calls)."""
        role, echoed = self.body.response_role, self.body.echoed_text
        if self.forced_calls is None:
            return {"role": role, "content": echoed + output.text}
        return {"role": role, "content": echoed or None,
                "tool_calls": response_tool_calls(self.forced_calls.reader(), output.text)}

    def delta(self, piece: CompletionOutput) -> dict | None:
        """A stream's delta for a choice's new piece: its text, or the tool calls it
        advanced; None when a piece of a tool call says nothing yet (no chunk is sent
        unless it ends the choice or carries log-probabilities)."""
        if self.forced_calls is None:
            return {"content": piece.text}
        stream = self.tool_streams.setdefault(
            piece.index, ToolCallStream(self.forced_calls.reader()))
        tool_calls = stream.deltas(piece.text)
        if tool_calls:
            return {"tool_calls": tool_calls}
        return {} if piece.finish_reason is not None or self.body.logprobs else None

    def opening(self, index: int) -> dict:
        """A stream's first choice of sample `index`: its role."""
        return {"index": index, "delta": {"role": self.body.response_role, "content": ""},
                "logprobs": None, "finish_reason": None}

    def extras(self) -> dict:
        """The response's fields beside the choices: prompt_logprobs when asked for."""
        if self.body.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs_entries(self.runs[0].prompt_logprobs)}


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """POST /v1/load_lora_adapter (vLLM's body): the name requests will give as `model`,
    and the adapter's PEFT directory (inside the server's allowed directory)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """POST /v1/unload_lora_adapter (vLLM's body): the adapter's name or lora_int_id."""

    lora_name: str | None = None
    lora_int_id: Integer | None = None

    @model_validator(mode="after")
    def _names_one(self) -> UnloadLoRAAdapterRequest:
        if self.lora_name is None and self.lora_int_id is None:
            raise ValueError("give lora_name or lora_int_id")
        return self
