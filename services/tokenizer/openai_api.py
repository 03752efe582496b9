"""The OpenAI-compatible HTTP API of the tokenizer role, over a FrontendApi.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (these take a
bearer API key, mapped to a tenant by the frontend); GET /health and GET /metrics (open).

Contract with clients (what the openai SDK relies on):
- responses and stream chunks in OpenAI's shapes; streams are SSE `data: {chunk}` events
  ending with `data: [DONE]`; chat streams open with a role delta;
- every failure is `{"error": {"message", "type", "param", "code"}}` with the status of
  its cause (400 bad parameter, naming it; 401 bad key; 404; 405; 413 body too large; 429
  overloaded with Retry-After; 503; 504; 500). A stream's first event is awaited before
  the response head is sent, so admission failures keep their status; a failure after that
  arrives as a `data: {"error": ...}` event that ends the stream;
- a client that disconnects has its request's event iterator closed, which aborts it.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from common.errors import BatonError
from common.logs import get_logger
from common.sampling_params import MAX_LOGPROBS, InvalidRequestError, SamplingParams
from services.tokenizer.chat import ChatTemplate
from services.tokenizer.frontend_api import FrontendApi, StreamEvent
from services.tokenizer.http_server import (
    HttpError, HttpLimits, HttpServer, Request, Response, Router, StreamResponse, aclose,
    json_bytes, json_response,
)

log = get_logger("openai_api")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 16  # every stop string is searched after every token
LONG_PROMPT_CHARS = 32 * 1024  # longer prompts are tokenised off the event loop
LOGPROB_FLOOR = -9999.0  # -inf is not JSON
DONE_EVENT = b"data: [DONE]\n\n"
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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
    return value


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
            raise InvalidRequestError(name, f"must be {described}, got {_json_type(value)}")
        if kind == "number":
            try:
                return float(value)
            except OverflowError:
                raise InvalidRequestError(name, "is out of range") from None
        return value


def sse_json(value: Any) -> bytes:
    """One SSE event carrying a JSON value (compact JSON has no newlines to split)."""
    return b"data: " + json_bytes(value) + b"\n\n"


def _json_type(value: Any) -> str:
    for name, kind in (("null", type(None)), ("a boolean", bool), ("an integer", int),
                       ("a number", float), ("a string", str), ("an array", list),
                       ("an object", dict)):
        if isinstance(value, kind):
            return name
    return type(value).__name__


@dataclass(frozen=True)
class Job:
    """One accepted request, ready to run."""

    chat: bool
    request_id: str
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    tenant: str
    stream: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


@dataclass
class Output:
    """What a request produced so far."""

    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[dict] = field(default_factory=list)

    def add(self, event: StreamEvent) -> None:
        self.text += event.text
        self.num_tokens += len(event.token_ids)
        self.logprobs.extend(event.logprobs)
        self.num_cached_tokens = max(self.num_cached_tokens, event.num_cached_tokens)
        if event.finished:
            self.finish_reason = finish_reason(event.finish_reason)


def finish_reason(reason: str | None) -> str:
    """OpenAI's finish_reason for an engine's."""
    return {"eos": "stop", "stop": "stop", "length": "length", "max_tokens": "length",
            None: "stop"}.get(reason, reason)


# ---- the gateway ------------------------------------------------------------------------


class OpenAIGateway:
    """OpenAI's HTTP API on a FrontendApi. `serve` runs it until a stop event."""

    def __init__(self, frontend: FrontendApi, chat_template: ChatTemplate | None = None,
                 limits: HttpLimits = HttpLimits()):
        self.frontend = frontend
        self.chat_template = chat_template or ChatTemplate()
        self.limits = limits
        self.created = int(time.time())
        self._tokenizer_adds_bos: bool | None = None

    async def serve(self, host: str, port: int, stop: asyncio.Event,
                    ready: Callable[[int], None] | None = None) -> None:
        """Listen on (host, port) until `stop` is set; `ready(bound_port)` once listening
        (port 0 picks a free port)."""
        server = HttpServer(self.router(), self.limits, render_error=self._render_http_error)
        await server.serve(host, port, stop, ready)

    def router(self) -> Router:
        router = Router()
        router.add("POST", "/v1/completions", self._api(self._completions))
        router.add("POST", "/v1/chat/completions", self._api(self._chat_completions))
        router.add("GET", "/v1/models", self._api(self._models))
        router.add("GET", "/health", self._api(self._health))
        router.add("GET", "/metrics", self._api(self._metrics))
        return router

    @staticmethod
    def _api(handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def route(request: Request) -> Response | StreamResponse:
            try:
                return await handler(request)
            except Exception as exc:  # CancelledError (client gone) passes through
                return as_api_error(exc).response()
        return route

    @staticmethod
    def _render_http_error(error: HttpError) -> Response:
        return ApiError(error.status, error.message).response()

    # ---- routes ----------------------------------------------------------------------

    # Every check that does not need the prompt's tokens runs before tokenising it.

    async def _completions(self, request: Request) -> Response | StreamResponse:
        tenant = self._tenant(request)
        body = Fields(parse_json_object(request.body))
        model = self._model(body)
        _refuse_unsupported(body, chat=False)
        stream, include_usage = _stream_flags(body)
        params = _sampling_params(body, body.get("logprobs", "integer"))
        requested_max = _requested_max_tokens(body, "max_tokens")
        prompt_ids = await self._completion_prompt(body.raw("prompt"))
        params = replace(params, max_tokens=self._max_tokens(
            "max_tokens", requested_max, len(prompt_ids), COMPLETION_DEFAULT_MAX_TOKENS))
        return await self._run(Job(False, f"cmpl-{uuid.uuid4().hex}", model, prompt_ids, params,
                                   tenant, stream, include_usage))

    async def _chat_completions(self, request: Request) -> Response | StreamResponse:
        tenant = self._tenant(request)
        body = Fields(parse_json_object(request.body))
        model = self._model(body)
        _refuse_unsupported(body, chat=True)
        stream, include_usage = _stream_flags(body)
        params = _sampling_params(body, _chat_logprobs_param(body))
        _requested_max_tokens(body, "max_tokens")  # checked even when the newer name wins
        max_name = "max_completion_tokens" if body.has("max_completion_tokens") else "max_tokens"
        requested_max = _requested_max_tokens(body, max_name)
        rendered = self.chat_template.render(body.raw("messages"))
        text = self.chat_template.text_for_tokenizer(rendered, self._adds_bos())
        prompt_ids = await self._tokenize(text)
        self._check_context(prompt_ids, "messages")
        params = replace(params, max_tokens=self._max_tokens(max_name, requested_max,
                                                             len(prompt_ids), None))
        return await self._run(Job(True, f"chatcmpl-{uuid.uuid4().hex}", model, prompt_ids, params,
                                   tenant, stream, include_usage))

    async def _models(self, request: Request) -> Response:
        self._tenant(request)
        return json_response({"object": "list", "data": [{
            "id": self.frontend.model_name, "object": "model", "created": self.created,
            "owned_by": "baton", "max_model_len": self.frontend.max_model_len}]})

    async def _health(self, request: Request) -> Response:
        try:
            health = dict(self.frontend.health())
        except Exception as exc:  # an unhealthy frontend must still answer the probe
            health = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return json_response(health, 200 if health.get("ok") else 503)

    async def _metrics(self, request: Request) -> Response:
        return Response(200, self.frontend.metrics_text().encode(), METRICS_CONTENT_TYPE)

    # ---- request building ------------------------------------------------------------

    def _tenant(self, request: Request) -> str:
        header = request.header("authorization")
        key = None
        if header is not None:
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise ApiError(401, "malformed Authorization header; expected 'Bearer <api key>'",
                               code="invalid_api_key")
            key = token.strip()
        try:
            return self.frontend.tenant_for(key)
        except BatonError as exc:
            if exc.http_status == 401:
                raise ApiError(401, exc.message or "invalid API key",
                               code="invalid_api_key") from None
            raise

    def _model(self, body: Fields) -> str:
        model = body.get("model", "string", self.frontend.model_name)
        if model != self.frontend.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                           f"{self.frontend.model_name!r}", param="model", code="model_not_found")
        return model

    async def _completion_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = await self._tokenize(prompt)
        elif isinstance(prompt, list):
            prompt_ids = _token_ids(prompt)
        elif prompt is None:
            raise InvalidRequestError("prompt", "is required")
        else:
            raise InvalidRequestError("prompt", f"must be a string or an array of token ids, got "
                                      f"{_json_type(prompt)}")
        self._check_context(prompt_ids, "prompt")
        return prompt_ids

    async def _tokenize(self, text: str) -> list[int]:
        if len(text) > LONG_PROMPT_CHARS:
            return await asyncio.to_thread(self.frontend.tokenize, text)
        return self.frontend.tokenize(text)

    def _adds_bos(self) -> bool:
        if self._tokenizer_adds_bos is None:
            self._tokenizer_adds_bos = bool(self.frontend.tokenize(""))
        return self._tokenizer_adds_bos

    def _check_context(self, prompt_ids: list[int], param: str) -> None:
        limit = self.frontend.max_model_len
        if not prompt_ids:
            raise InvalidRequestError(param, "is empty")
        if len(prompt_ids) >= limit:
            raise ApiError(400, f"this model's maximum context length is {limit} tokens, but the "
                           f"{param} has {len(prompt_ids)} tokens (at least one token must be left "
                           "to generate)", param=param, code="context_length_exceeded")

    def _max_tokens(self, name: str, requested: int | None, prompt_len: int,
                    default: int | None) -> int:
        """The requested maximum, which must fit the context window with the prompt; when
        absent, the default (capped to what fits) or all the room left."""
        room = self.frontend.max_model_len - prompt_len
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise ApiError(400, f"this model's maximum context length is "
                           f"{self.frontend.max_model_len} tokens; the prompt has {prompt_len} "
                           f"tokens and {name} is {requested}", param=name,
                           code="context_length_exceeded")
        return requested

    # ---- running ---------------------------------------------------------------------

    async def _run(self, job: Job) -> Response | StreamResponse:
        events = self.frontend.generate(job.request_id, job.prompt_ids, job.params, job.tenant)
        headers = [("X-Request-Id", job.request_id)]
        if not job.stream:
            try:
                output = await _collect(events)
            finally:
                await aclose(events)
            return json_response(self._final_body(job, output), headers=headers)
        try:  # the first event decides the status (admission, validation by the worker)
            first = await anext(events, None)
        except BaseException:
            await aclose(events)
            raise
        if first is None:
            raise ApiError(500, "the request ended without output", code="internal")
        return StreamResponse(self._stream_chunks(job, first, events), headers=headers)

    async def _stream_chunks(self, job: Job, first: StreamEvent,
                             events: AsyncIterator[StreamEvent]) -> AsyncIterator[bytes]:
        output = Output()
        try:
            if job.chat:
                yield self._chunk(job, {"delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None})
            event: StreamEvent | None = first
            while event is not None:
                offset = len(output.text)
                output.add(event)
                choice = self._choice_delta(job, event, offset, output)
                if choice is not None:
                    yield self._chunk(job, choice)
                if event.finished:
                    break
                event = await anext(events, None)
            if event is None:
                raise ApiError(500, "the request's stream ended before it finished",
                               code="internal")
            if job.include_usage:
                yield self._chunk(job, None, usage=_usage(job, output))
            yield DONE_EVENT
        except Exception as exc:
            yield sse_json(as_api_error(exc).payload())
        finally:
            await aclose(events)

    def _choice_delta(self, job: Job, event: StreamEvent, offset: int,
                      output: Output) -> dict[str, Any] | None:
        """One chunk's choice for an event, None when it has nothing to say (a token
        whose text is not complete yet, without logprobs)."""
        if not (event.text or event.logprobs or event.finished):
            return None
        reason = output.finish_reason if event.finished else None
        if job.chat:
            logprobs = {"content": self._chat_logprobs(event.logprobs)} if event.logprobs else None
            delta = {"content": event.text} if event.text or not event.finished else {}
            return {"delta": delta, "logprobs": logprobs, "finish_reason": reason}
        logprobs = self._completion_logprobs(event.logprobs, offset) if event.logprobs else None
        return {"text": event.text, "logprobs": logprobs, "finish_reason": reason}

    def _chunk(self, job: Job, choice: dict[str, Any] | None,
               usage: dict[str, Any] | None = None) -> bytes:
        body: dict[str, Any] = {"id": job.request_id, "object": job.chunk_object,
                                "created": job.created, "model": job.model,
                                "choices": [] if choice is None else [{"index": 0, **choice}]}
        if job.include_usage:
            body["usage"] = usage
        return sse_json(body)

    def _final_body(self, job: Job, output: Output) -> dict[str, Any]:
        want_logprobs = job.params.logprobs is not None
        if job.chat:
            logprobs = {"content": self._chat_logprobs(output.logprobs), "refusal": None} \
                if want_logprobs else None
            choice = {"index": 0, "message": {"role": "assistant", "content": output.text},
                      "logprobs": logprobs, "finish_reason": output.finish_reason}
            kind = "chat.completion"
        else:
            logprobs = self._completion_logprobs(output.logprobs, 0) if want_logprobs else None
            choice = {"index": 0, "text": output.text, "logprobs": logprobs,
                      "finish_reason": output.finish_reason}
            kind = "text_completion"
        return {"id": job.request_id, "object": kind, "created": job.created, "model": job.model,
                "choices": [choice], "usage": _usage(job, output)}

    # ---- logprobs --------------------------------------------------------------------

    def _completion_logprobs(self, records: list[dict], text_offset: int) -> dict[str, Any]:
        """The legacy completions shape: parallel lists per token."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for record in records:
            token = self.frontend.decode([record["token_id"]])
            tokens.append(token)
            token_logprobs.append(_finite(record["logprob"]))
            top_logprobs.append({self.frontend.decode([int(tid)]): _finite(lp)
                                 for tid, lp in record.get("top") or ()})
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def _chat_logprobs(self, records: list[dict]) -> list[dict[str, Any]]:
        return [{**self._chat_token(record["token_id"], record["logprob"]),
                 "top_logprobs": [self._chat_token(tid, lp) for tid, lp in record.get("top") or ()]}
                for record in records]

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.frontend.decode([int(token_id)])
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode())}


# ---- helpers (pure) ------------------------------------------------------------------------


async def _collect(events: AsyncIterator[StreamEvent]) -> Output:
    output = Output()
    async for event in events:
        output.add(event)
        if event.finished:
            return output
    raise ApiError(500, "the request ended before it finished", code="internal")


def _usage(job: Job, output: Output) -> dict[str, Any]:
    prompt_tokens = len(job.prompt_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": output.num_tokens,
            "total_tokens": prompt_tokens + output.num_tokens,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens}}


def _sampling_params(body: Fields, logprobs: int | None) -> SamplingParams:
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


def _requested_max_tokens(body: Fields, name: str) -> int | None:
    requested = body.get(name, "integer")
    if requested is not None and requested < 1:
        raise InvalidRequestError(name, f"must be >= 1, got {requested}")
    return requested


def _stream_flags(body: Fields) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = body.get("stream", "boolean", False)
    options = Fields(body.get("stream_options", "object", {}))
    include_usage = options.get("include_usage", "boolean", False) if stream else False
    return stream, include_usage


def _refuse_unsupported(body: Fields, chat: bool) -> None:
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


def _chat_logprobs_param(body: Fields) -> int | None:
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
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings are accepted")
    return tuple(stop)


def _int_list(body: Fields, name: str) -> list[int]:
    values = body.get(name, "array", [])
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise InvalidRequestError(name, "must be an array of integers")
    return values


def _token_ids(prompt: list[Any]) -> list[int]:
    if not prompt:
        raise InvalidRequestError("prompt", "is empty")
    if any(isinstance(item, (str, list)) for item in prompt):
        raise InvalidRequestError("prompt", "batched prompts are not supported; send one prompt "
                                  "(a string or an array of token ids)")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        raise InvalidRequestError("prompt", "token ids must be non-negative integers")
    return list(prompt)


def _finite(logprob: float) -> float:
    value = float(logprob)
    return value if math.isfinite(value) and value > LOGPROB_FLOOR else LOGPROB_FLOOR
