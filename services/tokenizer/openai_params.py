"""OpenAI request bodies as typed models, the checks types cannot say, and the error type
every failure becomes.

The models are msgspec Structs: the body is parsed and typed in one pass (msgspec is a
dependency already, and faster than json + pydantic), strictly (no "7" for an integer, no
true for a number); a value of the wrong type is a 400 whose `param` is the field's path
(`stream_options.include_usage`, `stop[0]`). Absent and null fields take the default;
unknown fields are ignored, as OpenAI does. NaN, Infinity, invalid UTF-8 and lone
surrogate escapes are not JSON and are refused as such (a lone surrogate naming the field
that holds it). A body must be sent as application/json (or a +json type, or with no
Content-Type, as vLLM takes it): anything else is a 415.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, TypeVar

import msgspec

from common.config import SLO_CLASS_NAME_MAX_CHARS
from common.errors import BatonError
from common.logs import get_logger
from common.sampling_params import MAX_LOGPROBS, InvalidRequestError, SamplingParams
from services.tokenizer.http_server import BodyRefused

log = get_logger("openai_api")

LOGPROB_FLOOR = -9999.0  # -inf is not JSON
SLO_CLASS_HEADER = "X-Baton-SLO-Class"


class ApiError(Exception):
    """A request failure in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def payload(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": error_type(self.status),
                          "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.status == 429 or (self.status == 503 and self.retry_after_s):
            seconds = max(self.retry_after_s or 0.0, 0.0)
            return {"Retry-After": str(max(1, math.ceil(seconds))), "retry-after-ms": str(int(seconds * 1000))}
        return {}


def error_type(status: int) -> str:
    """OpenAI's error `type` for a status."""
    special = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               429: "rate_limit_error", 503: "service_unavailable_error", 504: "timeout_error"}
    if status in special:
        return special[status]
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(status: int, message: str) -> bytes:
    """The JSON body of an error that has no more to say than its status and message."""
    return msgspec.json.encode(ApiError(status, message).payload())


def as_api_error(exc: BaseException) -> ApiError:
    """Map any failure to an ApiError (unexpected ones become a logged 500)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, str(exc), param=exc.param, code=getattr(exc, "code", None))
    if isinstance(exc, BodyRefused):
        return ApiError(exc.status, exc.message)
    if isinstance(exc, BatonError):
        return ApiError(exc.http_status, exc.message, code=exc.code.value,
                        retry_after_s=exc.retry_after_s)
    log.error("request_failed", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
    return ApiError(500, "internal server error", code="internal")


# ---- the request models ---------------------------------------------------------------


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class ResponseFormat(msgspec.Struct):
    type: str | None = None


class _SamplingRequest(msgspec.Struct, kw_only=True):
    """What completions and chat completions share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Baton's (and vLLM's) extensions
    top_k: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    slo_class: str | None = None


class CompletionRequest(_SamplingRequest, kw_only=True):
    """POST /v1/completions. `prompt` is a string or an array of token ids (one prompt)."""

    prompt: str | list[Any] | None = None
    logprobs: int | None = None
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None


class ChatCompletionRequest(_SamplingRequest, kw_only=True):
    """POST /v1/chat/completions. `messages` is checked by the chat template, which names
    the message and field at fault."""

    messages: list[Any] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: ResponseFormat | None = None


RequestModel = TypeVar("RequestModel", CompletionRequest, ChatCompletionRequest)
_DECODERS: dict[type, msgspec.json.Decoder] = {
    model: msgspec.json.Decoder(model) for model in (CompletionRequest, ChatCompletionRequest)}
_ERROR_PATH = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)


def parse_request(body: bytes, model: type[RequestModel]) -> RequestModel:
    """The body as `model`; ApiError 400 naming the field (or the JSON fault) otherwise."""
    try:
        return _DECODERS[model].decode(body)
    except msgspec.ValidationError as error:
        message, path = _ERROR_PATH.match(str(error)).group("message", "path")  # type: ignore[union-attr]
        if not path:
            raise ApiError(400, "the request body must be a JSON object") from None
        param = path.lstrip(".").replace("[...]", "")
        raise ApiError(400, f"{param}: {_described(message)}", param=param) from None
    except msgspec.DecodeError as error:
        raise _lone_surrogate_error(body) or ApiError(400, f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: it nests too deeply") from None


def check_content_type(header: str | None) -> None:
    """415 for a body that is not declared as JSON (see the module docstring)."""
    media_type, _, parameters = (header or "").partition(";")
    media_type = media_type.strip().lower()
    if media_type and media_type != "application/json" and not (
            media_type.startswith("application/") and media_type.endswith("+json")):
        raise ApiError(415, f"the request body must be JSON sent as Content-Type: application/json, "
                       f"not {media_type!r}")
    charset = re.search(r"charset\s*=\s*\"?([^\";\s]*)", parameters, re.IGNORECASE)
    if charset and charset.group(1).lower() not in ("utf-8", "utf8"):
        raise ApiError(415, f"the request body must be JSON in UTF-8 (Content-Type: application/json), "
                       f"not charset {charset.group(1)!r}")


# msgspec refuses a lone surrogate escape as "Input data was truncated"; the standard
# library's parser takes it, so the field that holds it can be named.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate_error(body: bytes) -> ApiError | None:
    """A 400 naming the field whose string holds a lone surrogate escape, if one does."""
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        path = _surrogate_path(json.loads(body), "")
    except (ValueError, RecursionError):
        return None
    if path is None:
        return None
    where = f"{path}:" if path else "the request body"
    return ApiError(400, f"{where} is not valid Unicode: it holds a lone surrogate (a \\uD800-\\uDFFF "
                    "escape without its pair)", param=path or None)


def _surrogate_path(value: Any, path: str) -> str | None:
    """The path (`stop[0]`, `messages[1].content`) of the first string holding a lone
    surrogate, in a key or a value; None if none does."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, list):
        items: Any = ((f"{path}[{index}]", item) for index, item in enumerate(value))
    elif isinstance(value, dict):
        items = ((f"{path}.{key}" if path else key, item) for key, item in value.items())
    else:
        return None
    for item_path, item in items:
        if _SURROGATE.search(item_path):
            return path
        found = _surrogate_path(item, item_path)
        if found is not None:
            return found
    return None


def _described(message: str) -> str:
    """msgspec's "Expected `int | null`, got `str`" in the words of OpenAI's errors."""
    expected = re.match(r"Expected `(?P<kinds>[^`]*)`, got `(?P<got>[^`]*)`", message)
    if expected is None:
        return message[:1].lower() + message[1:]
    kinds = [kind for kind in expected["kinds"].split(" | ") if kind != "null"]
    names = {"int": "an integer", "float": "a number", "bool": "a boolean", "str": "a string",
             "array": "an array", "object": "an object"}
    wanted = " or ".join(names.get(kind, kind) for kind in kinds)
    return f"must be {wanted}, got {names.get(expected['got'], expected['got'])}"


# ---- checks beyond types ---------------------------------------------------------------


def sampling_params(body: _SamplingRequest, logprobs: int | None) -> SamplingParams:
    """Validated sampling parameters; max_tokens is set once the prompt is tokenised."""
    params = SamplingParams(
        max_tokens=1,
        temperature=_number("temperature", body.temperature, 1.0),
        top_p=_number("top_p", body.top_p, 1.0),
        top_k=0 if body.top_k in (None, -1) else body.top_k,  # vLLM's -1 also means "disabled"
        seed=body.seed,
        stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs)
    params.validate()
    return params


def _number(name: str, value: float | None, default: float) -> float:
    if value is None:
        return default
    if not math.isfinite(value):
        raise InvalidRequestError(name, "is out of range")
    return value


def requested_max_tokens(name: str, requested: int | None, echo: bool = False) -> int | None:
    """The requested maximum, checked: >= 1, or 0 with `echo` (score the prompt alone)."""
    low = 0 if echo else 1
    if requested is not None and requested < low:
        hint = "" if echo else " (0 only with echo: true)"
        raise InvalidRequestError(name, f"must be >= {low}{hint}, got {requested}")
    return requested


def completion_prompt_logprobs(body: CompletionRequest) -> int | None:
    """SamplingParams.prompt_logprobs of a completion: with `echo`, the prompt's tokens
    come back with `logprobs` alternatives each, as OpenAI's legacy API and vLLM give
    them; none without echo or logprobs."""
    return body.logprobs if body.echo else None


def stream_flags(body: _SamplingRequest) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = bool(body.stream)
    include_usage = stream and body.stream_options is not None and bool(body.stream_options.include_usage)
    return stream, include_usage


def refuse_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """OpenAI parameters Baton does not implement: refused when they would change the
    result, accepted at their neutral value (clients often send those explicitly)."""
    if body.n not in (None, 1):
        raise InvalidRequestError("n", "only n=1 is supported")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0.0):
            raise InvalidRequestError(name, "is not supported (only 0)")
    if body.logit_bias:
        raise InvalidRequestError("logit_bias", "is not supported")
    if isinstance(body, ChatCompletionRequest):
        for name in ("tools", "functions"):
            if getattr(body, name):
                raise InvalidRequestError(name, "tool calling is not supported")
        if body.response_format is not None and body.response_format.type not in (None, "text"):
            raise InvalidRequestError("response_format", "only {\"type\": \"text\"} is supported")
        return
    if body.best_of not in (None, 1):
        raise InvalidRequestError("best_of", "only best_of=1 is supported")
    if body.suffix:
        raise InvalidRequestError("suffix", "is not supported")


def slo_class_param(body: _SamplingRequest, header: str | None) -> str:
    """The SLO class a request names, by the X-Baton-SLO-Class header or the body's
    `slo_class` extension (both may be given if they agree); "" when neither names one.
    Whether the class is configured is the frontend's check."""
    from_body = _slo_class_name("slo_class", body.slo_class or "")
    from_header = _slo_class_name(SLO_CLASS_HEADER, header or "")
    if from_body and from_header and from_body != from_header:
        raise InvalidRequestError("slo_class", f"{from_body!r} disagrees with the {SLO_CLASS_HEADER} "
                                  f"header's {from_header!r}")
    return from_body or from_header


def _slo_class_name(param: str, name: str) -> str:
    if len(name) > SLO_CLASS_NAME_MAX_CHARS:
        raise InvalidRequestError(param, f"must be at most {SLO_CLASS_NAME_MAX_CHARS} characters, "
                                  f"got {len(name)}")
    return name


def chat_logprobs_param(body: ChatCompletionRequest) -> int | None:
    """SamplingParams.logprobs for chat's (logprobs: bool, top_logprobs: int)."""
    top = body.top_logprobs
    if top is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs", "requires logprobs: true")
    if not body.logprobs:
        return None
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise InvalidRequestError("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {top}")
    return top or 0


def prompt_token_ids(prompt: list[Any]) -> list[int]:
    if not prompt:
        raise InvalidRequestError("prompt", "is empty")
    if any(isinstance(item, (str, list)) for item in prompt):
        raise InvalidRequestError("prompt", "batched prompts are not supported; send one prompt "
                                  "(a string or an array of token ids)")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        raise InvalidRequestError("prompt", "token ids must be non-negative integers")
    return list(prompt)


def finite_logprob(logprob: float) -> float:
    value = float(logprob)
    return value if math.isfinite(value) and value > LOGPROB_FLOOR else LOGPROB_FLOOR
