"""vLLM's utility endpoints at the server root: the served model's tokenizer over HTTP,
so a client needs no copy of it (lm-evaluation-harness's remote tokenizer), and the
server's version.

    POST /tokenize        {"prompt"} or {"messages", ...} -> {"tokens", "count",
                          "max_model_len", "token_strs"}
    POST /detokenize      {"tokens"} -> {"prompt"}
    GET  /tokenizer_info  the special tokens, the chat template, model_max_length
    GET  /version         {"version"}

Like vLLM's, these paths are outside /v1, so an API key does not guard them.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Annotated

from pydantic import Field

from jpaged.engine.async_engine import Engine
from jpaged.entrypoints.errors import ApiError
from jpaged.entrypoints.protocol import (
    ChatMessage,
    ChatTemplateFields,
    Integer,
    OpenAIBaseModel,
)
from jpaged.entrypoints.serving import OpenAIServing
from jpaged.model.tokenizer import SPECIAL_TOKEN_NAMES


class TokenizeRequest(ChatTemplateFields):
    """A text `prompt`, or chat `messages` with the chat completions' template fields.
    add_special_tokens: BOS/EOS as the model adds them to a prompt (default: yes for a
    prompt, no for messages, whose template writes its own, as in vLLM)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[Integer]


class TokenizerEndpoints:
    """The endpoints over the engine and model name of an OpenAIServing."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def tokenize(self, body: TokenizeRequest) -> dict:
        self.serving.served_models.lora_request(body.model)  # 404 for another model
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "send either 'prompt' or 'messages'", "prompt")
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = await self.serving.on_engine(
                lambda engine: engine.tokenize(body.prompt, special), "prompt")
        else:
            messages = [message.as_template_message() for message in body.messages]
            options = body.template_options() | {
                "add_special_tokens": bool(body.add_special_tokens),
                "chat_template": self.serving.chat_template}
            tokens = await self.serving.on_engine(
                lambda engine: engine.apply_chat_template(messages, **options), "messages")
        token_strs = None
        if body.return_token_strs:
            token_strs = await self.serving.on_engine(
                lambda engine: engine.tokenizer.convert_ids_to_tokens(tokens), "tokens")
        return {"tokens": tokens, "count": len(tokens),
                "max_model_len": self.serving.max_model_len, "token_strs": token_strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self.serving.served_models.lora_request(body.model)  # 404 for another model

        def decode(engine: Engine) -> str:
            vocab_size = len(engine.tokenizer)
            bad = [t for t in body.tokens if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"token ids {bad[:5]} are outside the vocabulary "
                                 f"[0, {vocab_size})")
            return engine.tokenizer.decode(body.tokens)

        return {"prompt": await self.serving.on_engine(decode, "tokens")}

    async def tokenizer_info(self) -> dict:
        def info(engine: Engine) -> dict:
            tokenizer = engine.tokenizer
            return {**{name: tokenizer.special_tokens.get(name) for name in SPECIAL_TOKEN_NAMES},
                    "chat_template": self.serving.chat_template or tokenizer.chat_template,
                    "model_max_length": self.serving.max_model_len}

        return await self.serving.on_engine(info, "model")

    async def version(self) -> dict:
        return {"version": version("jpaged")}
