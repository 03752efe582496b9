"""The OpenAI-compatible HTTP API of the tokenizer role, over a FrontendApi.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (these take a
bearer API key, mapped to a tenant by the frontend); GET /health and GET /metrics (open).

Contract with clients (what the openai SDK relies on):
- responses and stream chunks in OpenAI's shapes; streams are SSE `data: {chunk}` events
  ending with `data: [DONE]`; chat streams open with a role delta;
- every failure is `{"error": {"message", "type", "param", "code"}}` with the status of
  its cause (400 bad parameter, naming it; 401 bad key; 404; 405; 413 body too large; 415
  a body not sent as JSON; 429 overloaded with Retry-After; 503; 504; 500). A stream's first event is awaited before
  the response head is sent, so admission failures keep their status; a failure after that
  arrives as a `data: {"error": ...}` event that ends the stream;
- a client that disconnects has its request's event iterator closed, which aborts it.

A text prompt is checked against the frontend's byte limit before it is tokenized, and
long ones are templated and tokenized on a TokenizePool, off the event loop
(services/tokenizer/text_prompts.py), so no prompt holds up other clients or /health.

Baton's extensions to the request: the sampling fields `top_k`, `ignore_eos` and
`stop_token_ids`, and an SLO class, named by the `X-Baton-SLO-Class` header or the body's
`slo_class` (an unknown class is a 400).

A completion with `echo` returns the prompt's text before the output, and with
`logprobs: N` the prompt tokens' logprobs before the output's (`null` for the first
token), as OpenAI's legacy API and vLLM do; `max_tokens: 0` with echo scores the prompt
alone (the engine generates one token, which is dropped, as vLLM does). docs/openai-api.md.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from common.errors import BatonError
from common.logs import get_logger
from common.sampling_params import InvalidRequestError, SamplingParams
from services.tokenizer import http_server
from services.tokenizer.chat import ChatTemplate
from services.tokenizer.frontend_api import FrontendApi, StreamEvent
from services.tokenizer.http_server import ClientGone, EventStream, HttpLimits, aclose, read_body, watch_disconnect
from services.tokenizer.openai_params import (
    SLO_CLASS_HEADER,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    as_api_error,
    chat_logprobs_param,
    check_content_type,
    completion_prompt_logprobs,
    error_body,
    finite_logprob,
    parse_request,
    prompt_token_ids,
    refuse_unsupported,
    requested_max_tokens,
    sampling_params,
    slo_class_param,
    stream_flags,
)
from services.tokenizer.text_prompts import INLINE_PROMPT_CHARS, TokenizePool

log = get_logger("openai_api")

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DONE_EVENT = b"data: [DONE]\n\n"
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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
    slo_class: str = ""  # as the client named it; "" = none
    echo: bool = False  # completions: the prompt's text (and logprobs) come back before the output
    prompt_text: str | None = None  # the prompt as text, when it was sent as text
    score_only: bool = False  # max_tokens 0 with echo: the one token generated is dropped
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
    prompt_logprobs: list[dict | None] = field(default_factory=list)
    echo: str | None = None  # the echoed prompt's text, which comes before `text`
    timings: dict[str, float] = field(default_factory=dict)  # the finished event's TTFT split

    def add(self, event: StreamEvent) -> None:
        self.text += event.text
        self.num_tokens += len(event.token_ids)
        self.logprobs.extend(event.logprobs)
        self.prompt_logprobs.extend(event.prompt_logprobs)
        self.num_cached_tokens = max(self.num_cached_tokens, event.num_cached_tokens)
        self.timings.update(event.timings)
        if event.finished:
            self.finish_reason = finish_reason(event.finish_reason)


def finish_reason(reason: str | None) -> str:
    """OpenAI's finish_reason for an engine's."""
    if reason is None:
        return "stop"
    return {"eos": "stop", "stop": "stop", "length": "length", "max_tokens": "length"}.get(reason, reason)


# ---- responses ----------------------------------------------------------------------------


def json_response(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(value), status, headers, "application/json")


def error_response(error: ApiError, close: bool = False) -> Response:
    headers = error.headers()
    if close:  # the request's body may be left unread: end the connection after the answer
        headers["Connection"] = "close"
    return json_response(error.payload(), error.status, headers)


def sse_json(value: Any) -> bytes:
    """One SSE event carrying a JSON value (compact JSON has no newlines to split)."""
    return b"data: " + msgspec.json.encode(value) + b"\n\n"


# ---- the gateway ------------------------------------------------------------------------


class OpenAIGateway:
    """OpenAI's HTTP API on a FrontendApi, as an ASGI app (`app`) that `serve` runs on
    uvicorn until a stop event. Long prompts are templated and tokenized on `pool` (one
    of its own, closed when `serve` ends, if none is given)."""

    def __init__(self, frontend: FrontendApi, chat_template: ChatTemplate | None = None,
                 limits: HttpLimits | None = None, pool: TokenizePool | None = None):
        self.frontend = frontend
        self.chat_template = chat_template or ChatTemplate()
        self.limits = limits or HttpLimits()
        self.pool = pool or TokenizePool()
        self._owns_pool = pool is None
        self.created = int(time.time())
        self._tokenizer_adds_bos: bool | None = None
        self.app = Starlette(routes=[
            Route("/v1/completions", self._api(self._completions), methods=["POST"]),
            Route("/v1/chat/completions", self._api(self._chat_completions), methods=["POST"]),
            Route("/v1/models", self._api(self._models), methods=["GET"]),
            Route("/health", self._api(self._health), methods=["GET"]),
            Route("/metrics", self._api(self._metrics), methods=["GET"]),
        ], exception_handlers={HTTPException: self._routing_error})

    async def serve(self, host: str, port: int, stop: asyncio.Event,
                    ready: Callable[[int], None] | None = None) -> None:
        """Listen on (host, port) until `stop` is set; `ready(bound_port)` once listening
        (port 0 picks a free port)."""
        try:
            await http_server.serve(self.app, host, port, stop, self.limits, error_body, ready)
        finally:
            if self._owns_pool:
                self.pool.close()

    @staticmethod
    def _api(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except ClientGone:  # nobody reads this answer: uvicorn drops it
                return error_response(ApiError(400, "the client closed the connection"))
            except Exception as exc:  # CancelledError passes through
                error = as_api_error(exc)
                return error_response(error, close=error.status == 408)
        return route

    @staticmethod
    async def _routing_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = {404: f"no route for {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        response = error_response(ApiError(exc.status_code, message))
        response.headers.update(exc.headers or {})
        return response

    # ---- routes ----------------------------------------------------------------------

    # Every check that does not need the prompt's tokens runs before tokenising it.

    async def _completions(self, request: Request) -> Response:
        tenant = self._tenant(request)
        check_content_type(request.headers.get("content-type"))
        body = parse_request(await read_body(request, self.limits.body_timeout_s), CompletionRequest)
        model = self._model(body.model)
        refuse_unsupported(body)
        slo_class = slo_class_param(body, request.headers.get(SLO_CLASS_HEADER))
        stream, include_usage = stream_flags(body)
        params = replace(sampling_params(body, body.logprobs), prompt_logprobs=completion_prompt_logprobs(body))
        requested_max = requested_max_tokens("max_tokens", body.max_tokens, echo=bool(body.echo))
        prompt_ids, prompt_text = await self._completion_prompt(body.prompt)
        max_tokens = self._max_tokens("max_tokens", requested_max, len(prompt_ids), COMPLETION_DEFAULT_MAX_TOKENS)
        params = replace(params, max_tokens=max(max_tokens, 1))
        return await self._run(request, Job(False, f"cmpl-{os.urandom(16).hex()}", model, prompt_ids, params,
                                            tenant, stream, include_usage, slo_class, bool(body.echo), prompt_text,
                                            max_tokens == 0))

    async def _chat_completions(self, request: Request) -> Response:
        tenant = self._tenant(request)
        check_content_type(request.headers.get("content-type"))
        raw = await read_body(request, self.limits.body_timeout_s)
        body = parse_request(raw, ChatCompletionRequest)
        model = self._model(body.model)
        refuse_unsupported(body)
        slo_class = slo_class_param(body, request.headers.get(SLO_CLASS_HEADER))
        stream, include_usage = stream_flags(body)
        params = sampling_params(body, chat_logprobs_param(body))
        requested_max_tokens("max_tokens", body.max_tokens)  # checked even when the newer name wins
        max_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        requested_max = requested_max_tokens(max_name, getattr(body, max_name))
        prompt_ids = await self._chat_prompt(body.messages, long=len(raw) > INLINE_PROMPT_CHARS)
        params = replace(params, max_tokens=self._max_tokens(max_name, requested_max,
                                                             len(prompt_ids), None))
        return await self._run(request, Job(True, f"chatcmpl-{os.urandom(16).hex()}", model, prompt_ids, params,
                                            tenant, stream, include_usage, slo_class))

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
        return Response(self.frontend.metrics_text().encode(), 200, media_type=METRICS_CONTENT_TYPE)

    # ---- request building ------------------------------------------------------------

    def _tenant(self, request: Request) -> str:
        header = request.headers.get("authorization")
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

    def _model(self, requested: str | None) -> str:
        model = requested or self.frontend.model_name
        if model != self.frontend.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                           f"{self.frontend.model_name!r}", param="model", code="model_not_found")
        return model

    async def _completion_prompt(self, prompt: Any) -> tuple[list[int], str | None]:
        """The prompt's token ids, and its text when it was given as text."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = await self._tokenize(prompt, "prompt")
        elif isinstance(prompt, list):
            prompt_ids = prompt_token_ids(prompt)
        else:
            raise InvalidRequestError("prompt", "is required")
        self._check_context(prompt_ids, "prompt")
        return prompt_ids, prompt if isinstance(prompt, str) else None

    async def _chat_prompt(self, messages: Any, long: bool) -> list[int]:
        """The rendered conversation's token ids; `long`: render it off the loop too."""
        if long:
            rendered = await self.pool.run(self.chat_template.render, messages)
        else:
            rendered = self.chat_template.render(messages)
        text = self.chat_template.text_for_tokenizer(rendered, self._adds_bos())
        prompt_ids = await self._tokenize(text, "messages")
        self._check_context(prompt_ids, "messages")
        return prompt_ids

    async def _tokenize(self, text: str, param: str) -> list[int]:
        """Token ids of a text prompt: refused by its byte length before tokenizing when
        that already rules it out; a long one tokenized on the pool."""
        self.frontend.prompt_byte_limit.check(text, param)
        if len(text) > INLINE_PROMPT_CHARS:
            return await self.pool.run(self.frontend.tokenize, text)
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

    async def _run(self, request: Request, job: Job) -> Response:
        events = self.frontend.generate(job.request_id, job.prompt_ids, job.params, job.tenant,
                                        slo_class=job.slo_class)
        if job.score_only:
            events = _without_output(events)
        headers = {"X-Request-Id": job.request_id}
        if not job.stream:
            try:
                output = await watch_disconnect(request.receive, _collect(events))
            finally:
                await aclose(events)
            output.echo = self._echo_text(job)
            return json_response(self._final_body(job, output), headers=headers)
        try:  # the first event decides the status (admission, validation by the worker)
            first = await watch_disconnect(request.receive, anext(events, None))
        except BaseException:
            await aclose(events)
            raise
        if first is None:
            raise ApiError(500, "the request ended without output", code="internal")
        return EventStream(self._stream_chunks(job, first, events), headers, self.limits.write_timeout_s)

    async def _stream_chunks(self, job: Job, first: StreamEvent,
                             events: AsyncIterator[StreamEvent]) -> AsyncIterator[bytes]:
        output = Output(echo=self._echo_text(job))
        echo_due = job.echo
        try:
            if job.chat:
                yield self._chunk(job, {"delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None})
            event: StreamEvent | None = first
            while event is not None:
                offset = len(output.echo or "") + len(output.text)
                output.add(event)
                if echo_due and (event.token_ids or event.finished or self._prompt_logprobs_done(job, output)):
                    echo_due = False
                    yield self._chunk(job, self._echo_choice(job, output))
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
            logprobs = None
            if want_logprobs:
                generated = self._completion_logprobs(output.logprobs, len(output.echo or ""))
                logprobs = _joined(self._prompt_logprobs(job, output), generated) if job.echo else generated
            choice = {"index": 0, "text": (output.echo or "") + output.text, "logprobs": logprobs,
                      "finish_reason": output.finish_reason}
            kind = "text_completion"
        return {"id": job.request_id, "object": kind, "created": job.created, "model": job.model,
                "choices": [choice], "usage": _usage(job, output)}

    # ---- logprobs --------------------------------------------------------------------

    def _completion_logprobs(self, records: list[dict], text_offset: int) -> dict[str, Any]:
        """The legacy completions shape: parallel lists per token."""
        return self._legacy_logprobs([(record["token_id"], record) for record in records], text_offset)

    def _legacy_logprobs(self, entries: list[tuple[int, dict | None]], text_offset: int) -> dict[str, Any]:
        """Parallel lists over (token id, record) pairs; a token without a record (the
        prompt's first) has null for its logprob and its alternatives, as OpenAI gives it."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for token_id, record in entries:
            token = self.frontend.decode([int(token_id)])
            tokens.append(token)
            token_logprobs.append(None if record is None else finite_logprob(record["logprob"]))
            top_logprobs.append(None if record is None else {self.frontend.decode([int(tid)]): finite_logprob(lp)
                                                              for tid, lp in record.get("top") or ()})
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    @staticmethod
    def _prompt_logprobs_done(job: Job, output: Output) -> bool:
        return job.params.prompt_logprobs is None or len(output.prompt_logprobs) >= len(job.prompt_ids)

    def _prompt_logprobs(self, job: Job, output: Output) -> dict[str, Any]:
        """The echoed prompt's tokens in the legacy logprobs shape, offsets from 0."""
        if len(output.prompt_logprobs) != len(job.prompt_ids):
            raise ApiError(500, f"the engine gave {len(output.prompt_logprobs)} prompt logprobs for "
                           f"{len(job.prompt_ids)} prompt tokens", code="internal")
        return self._legacy_logprobs(list(zip(job.prompt_ids, output.prompt_logprobs)), 0)

    def _echo_choice(self, job: Job, output: Output) -> dict[str, Any]:
        """A stream's first completion chunk with echo: the prompt's text, and its tokens'
        logprobs when asked."""
        logprobs = self._prompt_logprobs(job, output) if job.params.logprobs is not None else None
        return {"text": output.echo, "logprobs": logprobs, "finish_reason": None}

    def _echo_text(self, job: Job) -> str | None:
        """The prompt's text to echo (None: no echo): as sent, or its token ids decoded.
        Called once the frontend has taken the request, so the ids are in the vocabulary."""
        if not job.echo:
            return None
        return job.prompt_text if job.prompt_text is not None else self.frontend.decode(job.prompt_ids)

    def _chat_logprobs(self, records: list[dict]) -> list[dict[str, Any]]:
        return [{**self._chat_token(record["token_id"], record["logprob"]),
                 "top_logprobs": [self._chat_token(tid, lp) for tid, lp in record.get("top") or ()]}
                for record in records]

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.frontend.decode([int(token_id)])
        return {"token": token, "logprob": finite_logprob(logprob), "bytes": list(token.encode())}


# ---- helpers (pure) ------------------------------------------------------------------------


async def _collect(events: AsyncIterator[StreamEvent]) -> Output:
    output = Output()
    async for event in events:
        output.add(event)
        if event.finished:
            return output
    raise ApiError(500, "the request ended before it finished", code="internal")


async def _without_output(events: AsyncIterator[StreamEvent]) -> AsyncIterator[StreamEvent]:
    """A request's events less its output (max_tokens 0 with echo: the one token the
    engine had to generate is not the client's); the last one ends it at its length."""
    try:
        async for event in events:
            if event.token_ids or event.text or event.logprobs:
                event = replace(event, token_ids=[], text="", logprobs=[])
            if event.finished:
                yield replace(event, finish_reason="length")
                return
            if event.prompt_logprobs:
                yield event
    finally:
        await aclose(events)


def _joined(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two legacy logprobs objects, one after the other."""
    return {key: first[key] + second[key] for key in first}


def _usage(job: Job, output: Output) -> dict[str, Any]:
    """OpenAI's usage object, and Baton's `ttft_split` where the workers measured one (a
    disaggregated request: docs/openai-api.md)."""
    prompt_tokens = len(job.prompt_ids)
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": output.num_tokens,
                             "total_tokens": prompt_tokens + output.num_tokens,
                             "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens}}
    if output.timings:
        usage["ttft_split"] = dict(sorted(output.timings.items()))
    return usage

