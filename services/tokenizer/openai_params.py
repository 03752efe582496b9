"""Parsing and checking OpenAI request bodies: typed field access, sampling parameters,
unsupported features, and the error type every failure becomes."""
from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from common.config import SLO_CLASS_NAME_MAX_CHARS
from common.errors import BatonError
from common.logs import get_logger
from common.sampling_params import MAX_LOGPROBS, InvalidRequestError, SamplingParams
from services.tokenizer.http_server import HttpError, Response, json_bytes, json_response

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

    def response(self) -> Response:
        return json_response(self.payload(), self.status, self.headers())

    def headers(self) -> list[tuple[str, str]]:
        if self.status == 429 or (self.status == 503 and self.retry_after_s):
            seconds = max(self.retry_after_s or 0.0, 0.0)
            return [("Retry-After", str(max(1, math.ceil(seconds)))),
                    ("retry-after-ms", str(int(seconds * 1000)))]
        return []


def error_type(status: int) -> str:
    """OpenAI's error `type` for a status."""
    special = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               429: "rate_limit_error", 503: "service_unavailable_error", 504: "timeout_error"}
    if status in special:
        return special[status]
    return "invalid_request_error" if status < 500 else "server_error"


def as_api_error(exc: BaseException) -> ApiError:
    """Map any failure to an ApiError (unexpected ones become a logged 500)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, str(exc), param=exc.param)
    if isinstance(exc, HttpError):
        return ApiError(exc.status, exc.message)
    if isinstance(exc, BatonError):
        return ApiError(exc.http_status, exc.message, code=exc.code.value,
                        retry_after_s=exc.retry_after_s)
    log.error("request_failed", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
    return ApiError(500, "internal server error", code="internal")


# ---- request bodies ---------------------------------------------------------------------


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; ApiError 400 otherwise (NaN and Infinity refused)."""
    def refuse_constant(name: str) -> None:
        raise ValueError(f"{name} is not valid JSON")

    try:
        value = json.loads(body, parse_constant=refuse_constant)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if _LONE_SURROGATE_ESCAPE.search(body) and not _is_unicode_text(value):
        raise ApiError(400, "the request body is not valid JSON: a \\u escape names a lone surrogate, "
                       "which is not a character")
    return value


# json.loads joins escaped surrogate pairs but lets a lone one through, and a str holding it
# cannot be tokenised, encoded to UTF-8 or sent on the wire.
_LONE_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _is_unicode_text(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "integer": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "boolean": (lambda v: isinstance(v, bool), "a boolean"),
    "string": (lambda v: isinstance(v, str), "a string"),
    "object": (lambda v: isinstance(v, dict), "an object"),
    "array": (lambda v: isinstance(v, list), "an array"),
}


class Fields:
    """Typed access to a request body: a value of the wrong type is a 400 naming the field;
    absent and null fields take the default; unknown fields are ignored (as OpenAI does)."""

    def __init__(self, body: dict[str, Any]):
        self.body = body

    def raw(self, name: str) -> Any:
        return self.body.get(name)

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def get(self, name: str, kind: str, default: Any = None) -> Any:
        value = self.body.get(name)
        if value is None:
            return default
        accepts, described = _KINDS[kind]
        if not accepts(value):
            raise InvalidRequestError(name, f"must be {described}, got {json_type(value)}")
        if kind == "number":
            try:
                return float(value)
            except OverflowError:
                raise InvalidRequestError(name, "is out of range") from None
        return value


def sse_json(value: Any) -> bytes:
    """One SSE event carrying a JSON value (compact JSON has no newlines to split)."""
    return b"data: " + json_bytes(value) + b"\n\n"


def json_type(value: Any) -> str:
    for name, kind in (("null", type(None)), ("a boolean", bool), ("an integer", int),
                       ("a number", float), ("a string", str), ("an array", list),
                       ("an object", dict)):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def sampling_params(body: Fields, logprobs: int | None) -> SamplingParams:
    """Validated sampling parameters; max_tokens is set once the prompt is tokenised."""
    params = SamplingParams(
        max_tokens=1,
        temperature=body.get("temperature", "number", 1.0),
        top_p=body.get("top_p", "number", 1.0),
        top_k=_top_k(body),
        seed=body.get("seed", "integer"),
        stop=_stop_strings(body),
        stop_token_ids=tuple(_int_list(body, "stop_token_ids")),
        ignore_eos=body.get("ignore_eos", "boolean", False),
        logprobs=logprobs)
    params.validate()
    return params


def requested_max_tokens(body: Fields, name: str) -> int | None:
    requested = body.get(name, "integer")
    if requested is not None and requested < 1:
        raise InvalidRequestError(name, f"must be >= 1, got {requested}")
    return requested


def stream_flags(body: Fields) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = body.get("stream", "boolean", False)
    options = Fields(body.get("stream_options", "object", {}))
    include_usage = options.get("include_usage", "boolean", False) if stream else False
    return stream, include_usage


def refuse_unsupported(body: Fields, chat: bool) -> None:
    """OpenAI parameters Baton does not implement: refused when they would change the
    result, accepted at their neutral value (clients often send those explicitly)."""
    if body.get("n", "integer", 1) != 1:
        raise InvalidRequestError("n", "only n=1 is supported")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name, "number", 0.0) != 0.0:
            raise InvalidRequestError(name, "is not supported (only 0)")
    if body.get("logit_bias", "object", {}):
        raise InvalidRequestError("logit_bias", "is not supported")
    if chat:
        for name in ("tools", "functions"):
            if body.get(name, "array", []):
                raise InvalidRequestError(name, "tool calling is not supported")
        response_format = Fields(body.get("response_format", "object", {}))
        if response_format.get("type", "string", "text") != "text":
            raise InvalidRequestError("response_format", "only {\"type\": \"text\"} is supported")
        return
    if body.get("best_of", "integer", 1) != 1:
        raise InvalidRequestError("best_of", "only best_of=1 is supported")
    if body.get("echo", "boolean", False):
        raise InvalidRequestError("echo", "is not supported")
    if body.get("suffix", "string", ""):
        raise InvalidRequestError("suffix", "is not supported")


def slo_class_param(body: Fields, header: str | None) -> str:
    """The SLO class a request names, by the X-Baton-SLO-Class header or the body's
    `slo_class` extension (both may be given if they agree); "" when neither names one.
    Whether the class is configured is the frontend's check."""
    from_body = _slo_class_name("slo_class", body.get("slo_class", "string", ""))
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


def chat_logprobs_param(body: Fields) -> int | None:
    """SamplingParams.logprobs for chat's (logprobs: bool, top_logprobs: int)."""
    wanted = body.get("logprobs", "boolean", False)
    top = body.get("top_logprobs", "integer")
    if top is not None and not wanted:
        raise InvalidRequestError("top_logprobs", "requires logprobs: true")
    if not wanted:
        return None
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise InvalidRequestError("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {top}")
    return top or 0


def _top_k(body: Fields) -> int:
    top_k = body.get("top_k", "integer", 0)
    return 0 if top_k == -1 else top_k  # vLLM's -1 also means "disabled"


def _stop_strings(body: Fields) -> tuple[str, ...]:
    stop = body.raw("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequestError("stop", "must be a string or an array of strings")
    return tuple(stop)  # counts and lengths: SamplingParams.validate


def _int_list(body: Fields, name: str) -> list[int]:
    values = body.get(name, "array", [])
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise InvalidRequestError(name, "must be an array of integers")
    return values


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
