"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with vLLM's
status codes."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from jpaged.engine.async_engine import EngineStoppedError

# vLLM's request fields that its 0.12 removed, and what replaced them.
REMOVED_FIELDS = {
    "guided_json": "structured_outputs.json (or response_format)",
    "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar",
    "guided_whitespace_pattern": "structured_outputs.whitespace_pattern",
    "guided_decoding_backend": "nothing: jpaged has one backend, llguidance",
}
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 413: "RequestTooLargeError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


class ApiError(Exception):
    """An error the client caused or must wait out, answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"),
                      "param": param, "code": status}}


def bad_request(error: Exception, renamed: dict[str, str]) -> ApiError:
    """400 for a ValueError/TypeError from SamplingParams or the engine, naming the
    parameter it carries (jpaged.errors) under the request's name for it."""
    param = getattr(error, "param", None)
    return ApiError(400, str(error), renamed.get(param, param))


def validation_error(error: RequestValidationError) -> ApiError:
    """400 naming the first bad top-level field (its union alternatives' messages joined)."""
    errors = error.errors()
    removed = [e for e in errors if e["type"] == "extra_forbidden" and len(e["loc"]) == 2
               and e["loc"][1] in REMOVED_FIELDS]
    if removed:
        name = removed[0]["loc"][1]
        return ApiError(400, f"'{name}' was removed in vLLM 0.12; use {REMOVED_FIELDS[name]}",
                        name)
    first = errors[0]
    location = [str(part) for part in first["loc"] if part != "body"]
    if first["type"] == "json_invalid":
        return ApiError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', '')}")
    if not location:
        return ApiError(400, f"the request body: {first['msg']}")
    param = location[0]
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"unsupported parameter '{'.'.join(location)}': jpaged does not "
                             "implement it", param)
    if first["type"] == "missing":
        return ApiError(400, f"missing required parameter '{'.'.join(location)}'", param)
    messages = dict.fromkeys(
        f"{'.'.join(str(p) for p in e['loc'] if p != 'body')}: {e['msg']}"
        for e in errors if e["loc"][1:2] == (param,)
    )
    return ApiError(400, f"invalid '{param}': " + "; ".join(list(messages)[:4]), param)


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int,
                  param: str, prompt_param: str) -> None:
    """400 unless the prompt (the request's `prompt_param`) and `max_tokens` new tokens
    (its `param`) fit in max_model_len."""
    if prompt_len > max_model_len:
        raise ApiError(400, f"the prompt has {prompt_len} tokens, more than this model's "
                            f"max_model_len={max_model_len}", prompt_param)
    if max_tokens is None and prompt_len >= max_model_len:
        raise ApiError(400, f"the prompt has {prompt_len} tokens, leaving no room for output "
                            f"within this model's maximum context length of {max_model_len} "
                            "tokens", param)
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise ApiError(400, f"this model's maximum context length is {max_model_len} tokens, "
                            f"but the prompt has {prompt_len} tokens and {param}={max_tokens} "
                            f"asks for {max_tokens} more", param)


class RequestFailedError(RuntimeError):
    """The engine ended a request with finish_reason "error" (its step failed)."""


def stream_error(error: Exception) -> dict:
    status = 503 if isinstance(error, EngineStoppedError) else 500
    return error_body(status, str(error))
