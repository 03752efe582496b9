"""The OpenAI-compatible gateway end to end: the unmodified openai client (and raw sockets)
against OpenAIGateway over a FrontendApi that runs a real Engine on the tiny model."""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import openai
import pytest

from common.detokenizer import IncrementalDetokenizer
from common.errors import BatonError, Rejected, Unauthorized
from common.sampling_params import InvalidRequestError, SamplingParams
from services.tokenizer.chat import ChatTemplate
from services.tokenizer.frontend_api import StreamEvent
from services.tokenizer.http_server import EventStream, HttpLimits, client_key
from services.tokenizer.openai_api import OpenAIGateway
from services.tokenizer.text_prompts import prompt_byte_limit, token_byte_bound

API_KEY = "sk-test"
MODEL = "baton-tiny"
LIMITS = HttpLimits(max_body_bytes=256 * 1024, idle_timeout_s=5.0, header_timeout_s=1.0,
                    body_timeout_s=1.0, write_timeout_s=5.0, shutdown_grace_s=2.0)


class EngineFrontend:
    """A FrontendApi over a real Engine: a thread steps the engine, each request reads its
    outputs from an asyncio queue and detokenises them incrementally. Records aborts and
    the SLO class each request named."""

    model_name = MODEL

    def __init__(self, engine, api_keys: dict[str, str]):
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self.prompt_byte_limit = prompt_byte_limit(token_byte_bound(engine.tokenizer.to_str()),
                                                   self.max_model_len, 0)
        self.api_keys = api_keys
        self.reject: BatonError | None = None  # raised by generate() when set
        self.healthy = True
        self.aborted: list[str] = []
        self.slo_classes: dict[str, str] = {}  # request id -> the SLO class it named
        self._wake = threading.Condition()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._step_loop, name="engine-steps", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(10)

    def _step_loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and not self.engine.has_unfinished():
                    self._wake.wait()
                if self._stopped:
                    return
                outputs = self.engine.step()
                targets = [(self._streams.get(out.request_id), out) for out in outputs]
            for target, output in targets:
                if target is not None:
                    loop, queue = target
                    try:
                        loop.call_soon_threadsafe(queue.put_nowait, output)
                    except RuntimeError:
                        pass  # that loop is closed: the gateway has stopped

    def reference(self, prompt_ids: list[int], params: SamplingParams):
        """What the engine itself generates for a prompt (run while no request is live)."""
        with self._wake:
            [result] = self.engine.generate([prompt_ids], params)
        return result

    # ---- FrontendApi -----------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.engine.decode(token_ids)

    def tenant_for(self, api_key: str | None) -> str:
        if api_key not in self.api_keys:
            raise Unauthorized("invalid API key")
        return self.api_keys[api_key]

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       tenant: str, *, slo_class: str = "") -> AsyncIterator[StreamEvent]:
        if self.reject is not None:
            raise self.reject
        self.slo_classes[request_id] = slo_class
        queue: asyncio.Queue = asyncio.Queue()
        with self._wake:
            self.engine.add_request(request_id, prompt_ids, params, tenant_salt=tenant)
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
            self._wake.notify()
        detokenizer = IncrementalDetokenizer(self.engine.tokenizer, prompt_ids)
        emitted, finished = "", False
        try:
            while not finished:
                output = await queue.get()
                delta = "".join(detokenizer.push(t) for t in output.new_token_ids)
                finished = output.finished
                if finished and output.text.startswith(emitted):
                    delta = output.text[len(emitted):]  # the engine's final text is exact
                emitted += delta
                yield StreamEvent(list(output.new_token_ids), delta, finished, output.finish_reason,
                                  len(prompt_ids), 0, list(output.logprobs), list(output.prompt_logprobs))
        finally:
            with self._wake:
                self._streams.pop(request_id, None)
                if not finished:
                    self.engine.abort(request_id)
                    self.aborted.append(request_id)

    async def abort(self, request_id: str) -> None:
        with self._wake:
            if self.engine.abort(request_id):
                self.aborted.append(request_id)

    def health(self) -> dict:
        return {"ok": self.healthy, "workers": 1 if self.healthy else 0}

    def metrics_text(self) -> str:
        return "# TYPE baton_requests_total counter\nbaton_requests_total 0\n"


class GatewayThread:
    """An OpenAIGateway serving on 127.0.0.1:<free port> from its own thread and loop."""

    def __init__(self, frontend, chat_template: ChatTemplate | None = None,
                 limits: HttpLimits = LIMITS, loop_factory=asyncio.new_event_loop):
        self.gateway = OpenAIGateway(frontend, chat_template, limits)
        self.port = 0
        self._loop = loop_factory()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gateway", daemon=True)

    def __enter__(self) -> GatewayThread:
        self._thread.start()
        assert self._ready.wait(10), "the gateway did not start"
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout: float = 10.0) -> float:
        """Stop serving; returns how long the gateway took to shut down."""
        began = time.monotonic()
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the gateway did not stop"
        return time.monotonic() - began

    def _run(self) -> None:
        async def main() -> None:
            self._stop = asyncio.Event()
            await self.gateway.serve("127.0.0.1", 0, self._stop, self._on_ready)

        try:
            self._loop.run_until_complete(main())
        finally:
            self._loop.close()

    def _on_ready(self, port: int) -> None:
        self.port = port
        self._ready.set()


@pytest.fixture(scope="module")
def frontend(make_engine) -> Iterator[EngineFrontend]:
    # No prefix caching: the reference run and the served run compute exactly alike.
    engine = make_engine(enable_prefix_caching=False)
    front = EngineFrontend(engine, {API_KEY: "tenant-a"})
    yield front
    front.close()


@pytest.fixture(scope="module")
def server(frontend) -> Iterator[GatewayThread]:
    with GatewayThread(frontend) as running:
        yield running


@pytest.fixture(autouse=True)
def fresh_frontend(request) -> Iterator[None]:
    """Undo what a test set on the shared frontend (rejections, health)."""
    yield
    if "frontend" in request.fixturenames:
        front = request.getfixturevalue("frontend")
        front.reject, front.healthy = None, True


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=API_KEY,
                         max_retries=0, timeout=30)


GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
GREEDY_PARAMS = {"temperature": 0.0, "ignore_eos": True}


# ---- happy paths through the openai client ----------------------------------------------


def test_completion_equals_the_engine_greedy_output(client, frontend):
    prompt = "The quick brown fox"
    expected = frontend.reference(frontend.tokenize(prompt),
                                  SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    assert response.model == MODEL
    [choice] = response.choices
    assert choice.text == expected.text
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == len(expected.token_ids) == 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12


def test_completion_from_token_ids_streams_the_engine_output(client, frontend):
    prompt_ids = [5, 6, 7, 8, 300, 301]
    expected = frontend.reference(prompt_ids, SamplingParams(max_tokens=10, temperature=0,
                                                             ignore_eos=True))
    stream = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=10, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == 10
    assert usage.prompt_tokens == len(prompt_ids)
    assert len({c.id for c in chunks}) == 1


def test_chat_equals_the_engine_greedy_output(client, frontend):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                             {"type": "text", "text": "there"}]}]
    prompt_ids = frontend.tokenize(ChatTemplate().render(messages))
    expected = frontend.reference(prompt_ids, SamplingParams(max_tokens=8, temperature=0,
                                                             ignore_eos=True))
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **GREEDY)
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected.text
    assert response.usage.prompt_tokens == len(prompt_ids)

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8,
                                            stream=True, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logprobs_in_both_shapes(client):
    completion = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, logprobs=2,
                                           **GREEDY)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert "".join(logprobs.tokens) == completion.choices[0].text
    for top, chosen in zip(logprobs.top_logprobs, logprobs.token_logprobs):
        assert len(top) <= 2 and chosen <= 0
        assert abs(max(top.values()) - chosen) < 1e-4  # greedy: the chosen token is the likeliest

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=3, logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(item.top_logprobs) == 3 for item in content)


def test_echo_with_max_tokens_0_scores_the_prompt(server, frontend):
    prompt_ids = [5, 6, 7, 8, 300, 301, 42]
    expected = frontend.reference(prompt_ids, SamplingParams(max_tokens=1, prompt_logprobs=2, **GREEDY_PARAMS))
    status, _, body = http_post(server.port, "/v1/completions", {
        "model": MODEL, "prompt": prompt_ids, "max_tokens": 0, "echo": True, "logprobs": 2, "temperature": 0})
    assert status == 200, body
    completion = json.loads(body)
    [choice] = completion["choices"]
    assert choice["text"] == frontend.decode(prompt_ids) and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [frontend.decode([t]) for t in prompt_ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(
        [record["logprob"] for record in expected.prompt_logprobs[1:]], abs=1e-5)
    assert all(len(top) == 2 for top in logprobs["top_logprobs"][1:])
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert completion["usage"] == {"prompt_tokens": 7, "completion_tokens": 0, "total_tokens": 7,
                                   "prompt_tokens_details": {"cached_tokens": 0}}


def test_echo_returns_the_prompt_then_the_output(client, frontend):
    prompt = "The quick brown fox"
    prompt_ids = frontend.tokenize(prompt)
    expected = frontend.reference(prompt_ids, SamplingParams(max_tokens=5, logprobs=1, prompt_logprobs=1,
                                                             **GREEDY_PARAMS))
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, echo=True, logprobs=1,
                                           **GREEDY)
    [choice] = completion.choices
    assert choice.text == prompt + expected.text
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt_ids) + 5
    assert logprobs.token_logprobs[0] is None
    assert logprobs.token_logprobs[len(prompt_ids):] == pytest.approx(
        [record["logprob"] for record in expected.logprobs], abs=1e-5)
    assert logprobs.text_offset[len(prompt_ids)] == len(prompt)  # the output's offsets follow the prompt
    assert completion.usage.completion_tokens == 5
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, echo=True, **GREEDY)
    assert plain.choices[0].text == prompt + expected.text and plain.choices[0].logprobs is None


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_a_streamed_echo_comes_first_with_its_logprobs(client, frontend, max_tokens):
    prompt_ids = [9, 10, 11, 12, 13]
    expected = frontend.reference(prompt_ids, SamplingParams(max_tokens=max(max_tokens, 1), **GREEDY_PARAMS))
    chunks = [chunk for chunk in client.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=max_tokens, echo=True, logprobs=0, stream=True,
        stream_options={"include_usage": True}, **GREEDY) if chunk.choices]
    echo = chunks[0].choices[0]
    assert echo.text == frontend.decode(prompt_ids) and echo.finish_reason is None
    assert len(echo.logprobs.tokens) == 5 and echo.logprobs.token_logprobs[0] is None
    generated = "".join(chunk.choices[0].text for chunk in chunks[1:])
    assert generated == (expected.text if max_tokens else "")
    assert chunks[-1].choices[0].finish_reason == "length"


def test_models_health_metrics(client, server, frontend):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, headers, body = http_get(server.port, "/health")
    assert status == 200 and json.loads(body)["ok"] is True
    frontend.healthy = False
    assert http_get(server.port, "/health")[0] == 503
    frontend.healthy = True
    status, headers, body = http_get(server.port, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    assert b"baton_requests_total" in body


# ---- errors through the openai client ---------------------------------------------------


@pytest.mark.parametrize("temperature", ["hot", -1.0])
def test_an_invalid_temperature_is_a_400_naming_it(client, temperature):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=temperature)
    assert "temperature" in str(caught.value)
    assert caught.value.body["param"] == "temperature"


@pytest.mark.parametrize("extra, param", [
    ({"n": 2}, "n"), ({"echo": "yes"}, "echo"), ({"max_tokens": "7"}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"echo": True, "max_tokens": -1}, "max_tokens"), ({"echo": True, "logprobs": 21}, "logprobs"),
    ({"echo": True, "logprobs": -1}, "logprobs"), ({"suffix": "end"}, "suffix"),
    ({"echo": True, "prompt": [5, 2**40]}, "prompt"), ({"echo": True, "prompt": [5, 99999], "stream": True}, "prompt"),
    ({"stop": [1, 2]}, "stop[0]"), ({"stop": 5}, "stop"), ({"seed": 1.5}, "seed"), ({"top_k": "no"}, "top_k"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"), ({"temperature": True}, "temperature"),
    ({"logprobs": 99}, "logprobs"), ({"stream": "yes"}, "stream"), ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": []}, "prompt"), ({"top_p": 0}, "top_p"),
])
def test_bad_completion_fields_are_400s_naming_the_field(server, extra, param):
    status, _, body = http_post(server.port, "/v1/completions",
                                {"model": MODEL, "prompt": "x", "max_tokens": 2, **extra})
    assert status == 400, body
    assert json.loads(body)["error"]["param"] == param


@pytest.mark.parametrize("messages, param", [
    ("hello", "messages"), ([], "messages"), ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image_url"}]}],
     "messages[1].content[0]"),
])
def test_bad_chat_messages_are_400s_naming_the_field(server, messages, param):
    status, _, body = http_post(server.port, "/v1/chat/completions",
                                {"model": MODEL, "messages": messages})
    assert status == 400
    assert json.loads(body)["error"]["param"] == param


def test_a_bad_or_missing_key_is_a_401(server):
    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="sk-wrong",
                        max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=2)
    status, _, body = http_post(server.port, "/v1/completions", {"prompt": "x"}, api_key=None)
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert http_get(server.port, "/health")[0] == 200  # no key needed


def test_a_prompt_over_the_context_window_is_refused(client, frontend):
    too_long = [10] * frontend.max_model_len
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=too_long, max_tokens=1)
    assert caught.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=[10] * 1000, max_tokens=100)
    assert caught.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):  # the engine's own check (vocabulary) maps too
        client.completions.create(model=MODEL, prompt=[10**6], max_tokens=1)


def test_overload_is_a_429_with_retry_after(client, frontend):
    frontend.reject = Rejected("the cluster is overloaded", retry_after_s=2.5)
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert caught.value.response.headers["retry-after"] == "3"
    with pytest.raises(openai.RateLimitError):  # a stream's admission failure keeps its status
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       stream=True)


def test_an_error_after_the_stream_started_is_an_sse_error_event(server, frontend, monkeypatch):
    original = frontend.generate

    async def failing(*args, **kwargs):
        async with contextlib.aclosing(original(*args, **kwargs)) as events:
            async for event in events:
                yield event
                raise BatonError("worker lost")

    monkeypatch.setattr(frontend, "generate", failing)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=API_KEY,
                           max_retries=0)
    with pytest.raises(openai.APIError, match="worker lost"):
        list(client.completions.create(model=MODEL, prompt="x", max_tokens=5, stream=True, **GREEDY))
    wait_for(lambda: not frontend.engine.has_unfinished())


def test_the_slo_class_comes_from_the_header_or_the_body(server, frontend):
    cases = [({}, {}, ""), ({"X-Baton-SLO-Class": "interactive"}, {}, "interactive"),
             ({}, {"slo_class": "batch"}, "batch"), ({}, {"slo_class": None}, ""),
             ({"x-baton-slo-class": "batch"}, {"slo_class": "batch"}, "batch")]
    for headers, extra, expected in cases:
        for path, body in [("/v1/completions", {"prompt": "x"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})]:
            status, response_headers, response = http_post(
                server.port, path, {"model": MODEL, "max_tokens": 1, **body, **extra}, headers=headers)
            assert status == 200, response
            assert frontend.slo_classes[response_headers["x-request-id"]] == expected, (headers, extra)


@pytest.mark.parametrize("headers, extra, param", [
    ({}, {"slo_class": 3}, "slo_class"),
    ({}, {"slo_class": ["interactive"]}, "slo_class"),
    ({}, {"slo_class": "x" * 65}, "slo_class"),
    ({"X-Baton-SLO-Class": "x" * 65}, {}, "X-Baton-SLO-Class"),
    ({"X-Baton-SLO-Class": "interactive"}, {"slo_class": "batch"}, "slo_class"),
])
def test_a_bad_slo_class_is_a_400_naming_the_field(server, headers, extra, param):
    for path, body in [("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})]:
        status, _, response = http_post(server.port, path, {"model": MODEL, **body, **extra},
                                        headers=headers)
        assert status == 400, response
        assert json.loads(response)["error"]["param"] == param


# ---- raw HTTP: malformed input, limits, disconnects ----------------------------------------


@pytest.mark.parametrize("raw, status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"\x00\xff\xfe binary \x01\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\nBad Header\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\n folded: x\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 300000\r\n\r\n", 413),
    (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\nAuthorization: Bearer sk-test\r\n\r\n"
     b"40001\r\n" + b"x" * 0x40001 + b"\r\n0\r\n\r\n", 413),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 1, 2\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n", 431),
    (b"GET /health HTTP/1.1\r\n" + b"X: a\r\n" * 101 + b"\r\n", 431),
    (b"GET /nowhere HTTP/1.1\r\n\r\n", 404),
    (b"GET /v1/completions HTTP/1.1\r\n\r\n", 405),
])
def test_malformed_requests_get_an_error_and_the_server_survives(server, raw, status):
    response = raw_exchange(server.port, raw)
    got, headers, body = parse_response(response)
    assert got == status, response[:300]
    assert "error" in json.loads(body)
    if status == 405:
        assert headers["allow"] == "POST"
    assert http_get(server.port, "/health")[0] == 200


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"", b"\xff\xfe", b'{"prompt": NaN}',
                                  b"[" * 100000])
def test_invalid_json_is_a_400(server, body):
    status, _, response = http_post(server.port, "/v1/completions", body)
    assert status == 400 and "JSON" in json.loads(response)["error"]["message"]


@pytest.mark.parametrize("content_type, status", [
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415), ("application/json; charset=latin-1", 415),
    ("application/json; charset=utf-8", 200), ("application/vnd.baton+json", 200), (None, 200),
])
def test_a_body_not_sent_as_json_is_a_415_naming_the_type(server, content_type, status):
    """No Content-Type is taken as JSON (as vLLM does; http.client sends none); `curl -d`
    without -H sends form-urlencoded and is refused, naming application/json."""
    for path, body in [("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]:
        data = json.dumps({"model": MODEL, "max_tokens": 1, **body}).encode()
        request = request_bytes("POST", path, data, content_type=content_type)
        got, _, response = parse_response(raw_exchange(server.port, request, shutdown=False))
        assert got == status, response
        if status == 415:
            assert "application/json" in json.loads(response)["error"]["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"]}', "stop[0]"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["ok", "a\\udc00b"]}', "stop[1]"),
    ("/v1/completions", b'{"prompt": "\\ud83d", "max_tokens": 1}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, path, body, param):
    status, _, response = http_post(server.port, path, body)
    error = json.loads(response)["error"]
    assert status == 400 and error["param"] == param, error
    assert "lone surrogate" in error["message"] and "truncated" not in error["message"]


def test_an_empty_text_prompt_is_served_as_the_tokenizer_encodes_it(client, frontend):
    """As vLLM does: "" becomes the tokenizer's BOS token here (the SDK does the same,
    test_tokenizer_service.py); a tokenizer that adds nothing would make it a 400."""
    assert frontend.tokenize("") == [0]
    completion = client.completions.create(model=MODEL, prompt="", max_tokens=2, **GREEDY)
    assert completion.usage.prompt_tokens == 1 and completion.usage.completion_tokens == 2


def test_huge_text_prompts_are_refused_by_bytes_while_health_answers(frontend):
    """The issue's case: 3 prompts of 7.9 MB at once (within the default 8 MiB body limit)
    are refused (400 naming the field and the limit) without being tokenized, and /health
    answers promptly meanwhile."""
    with GatewayThread(frontend, limits=HttpLimits()) as gateway:
        check_huge_prompts_refused(gateway.port, frontend.prompt_byte_limit.max_bytes)


def check_huge_prompts_refused(port: int, limit: int) -> None:
    huge = "x" * 7_900_000
    assert 0 < limit < 100_000
    requests = [("/v1/completions", {"model": MODEL, "prompt": huge}),
                ("/v1/completions", {"model": MODEL, "prompt": [huge]}),
                ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": huge}]})]
    answers: list[tuple[str, int, bytes]] = []

    def send(path: str, body: dict) -> None:
        status, _, response = http_post(port, path, body)
        answers.append((path, status, response))

    senders = [threading.Thread(target=send, args=request) for request in requests]
    probes = probe_health_while(port, senders)
    assert len(answers) == 3
    for path, status, response in answers:
        error = json.loads(response)["error"]
        assert status == 400 and error["param"] == ("prompt" if path == "/v1/completions" else "messages")
        assert f"limit of {limit} bytes" in error["message"] and error["code"] == "context_length_exceeded"
    assert len(probes) >= 3 and sorted(probes)[len(probes) // 2] < 0.1 and max(probes) < 1.0, probes


def probe_health_while(port: int, workers: list[threading.Thread], expected_status: int = 200) -> list[float]:
    """Start `workers` and probe /health until they end: each probe's seconds."""
    for worker in workers:
        worker.start()
    probes: list[float] = []
    while any(worker.is_alive() for worker in workers) or len(probes) < 3:
        began = time.perf_counter()
        status = http_get(port, "/health")[0]
        probes.append(time.perf_counter() - began)
        assert status == expected_status
        time.sleep(0.005)
    for worker in workers:
        worker.join(60)
    return probes


def test_a_chunked_body_is_read(server):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    head = request_bytes("POST", "/v1/completions").replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
    chunked = head + b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:7], body[7:])) + b"0\r\n\r\n"
    status, _, response = parse_response(raw_exchange(server.port, chunked, shutdown=False))
    assert status == 200 and json.loads(response)["usage"]["completion_tokens"] == 2


def test_truncated_body_and_slow_clients_are_cut_off(server):
    truncated = request_bytes("POST", "/v1/completions").replace(b"Content-Length: 0", b"Content-Length: 100") \
        + b"{\"prompt\""
    assert parse_response(raw_exchange(server.port, truncated))[0] == 400
    began = time.monotonic()  # head never finished: the header timeout (1 s) answers 408
    response = raw_exchange(server.port, b"GET /health HTTP/1.1\r\nHost: x\r\n", shutdown=False)
    assert parse_response(response)[0] == 408 and time.monotonic() - began < 5
    began = time.monotonic()  # body never finished
    response = raw_exchange(server.port, truncated, shutdown=False)
    assert parse_response(response)[0] == 408 and time.monotonic() - began < 5


def test_keep_alive_serves_several_requests_on_one_connection(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        responses = ResponseReader(sock)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = responses.next()
        sock.sendall(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")
        head_status, head_headers, _ = parse_response(sock.recv(4096))  # a head, no body
        assert head_status == 200 and int(head_headers["content-length"]) > 0
        sock.sendall(b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n")
        second = responses.next()
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        third = responses.next()
        assert sock.recv(1) == b""  # closed as asked
    assert [first[0], second[0], third[0]] == [200, 404, 200]


def test_pipelined_requests_are_all_answered_in_order(server):
    completion = request_bytes("POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "hi", "max_tokens": 3, "temperature": 0}).encode(), close=False)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(completion + b"\r\nGET /nowhere HTTP/1.1\r\n\r\n"
                     + request_bytes("GET", "/health"))
        responses = ResponseReader(sock)
        statuses = [responses.next()[0] for _ in range(3)]
        assert sock.recv(1) == b""
    assert statuses == [200, 404, 200]


def test_an_http10_client_gets_the_stream_without_chunked_framing(server):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}).encode()
    request = request_bytes("POST", "/v1/completions", body).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
    status, headers, payload = parse_response(raw_exchange(server.port, request, shutdown=False))
    assert status == 200 and headers["connection"] == "close" and "transfer-encoding" not in headers
    assert int(headers["content-length"]) == len(payload)
    events = [line for line in payload.split(b"\n\n") if line]
    assert events[-1] == b"data: [DONE]" and len(events) >= 2


def test_connections_over_the_limit_are_refused_with_503_when_none_is_idle(frontend):
    limits = HttpLimits(max_connections=1, idle_timeout_s=5.0)
    with GatewayThread(frontend, limits=limits) as gateway:
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=5) as busy:
            start_request_without_body(busy)
            status, _, body = parse_response(raw_exchange(gateway.port, b"", shutdown=False))
            assert status == 503 and "limit of 1 connections" in json.loads(body)["error"]["message"]


def test_at_the_total_cap_the_longest_idle_connection_makes_room(frontend):
    limits = HttpLimits(max_connections=4, max_connections_per_client=0, idle_timeout_s=30.0)
    with GatewayThread(frontend, limits=limits) as gateway, contextlib.ExitStack() as stack:
        idle = [stack.enter_context(connect_from("127.0.0.2", gateway.port)) for _ in range(4)]
        for sock in idle:  # idle in order: a served request each, kept alive
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert ResponseReader(sock).next()[0] == 200
            time.sleep(0.01)
        with connect_from("127.0.0.3", gateway.port) as newcomer:
            newcomer.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert ResponseReader(newcomer).next()[0] == 200
        assert idle[0].recv(1) == b""  # the longest idle was closed for the newcomer
        for sock in idle[1:]:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert ResponseReader(sock).next()[0] == 200


def test_one_address_holding_idle_connections_locks_no_one_out(frontend):
    """The issue's case, scaled down: one address opens connections up to the total cap
    and sends nothing; other clients are still served, and that address cannot take more
    than its share while its connections are busy."""
    limits = HttpLimits(max_connections=8, max_connections_per_client=4, idle_timeout_s=30.0)
    with GatewayThread(frontend, limits=limits) as gateway, contextlib.ExitStack() as stack:
        hoard = [stack.enter_context(connect_from("127.0.0.2", gateway.port)) for _ in range(12)]
        for client in ("127.0.0.3", "127.0.0.4", "127.0.0.5"):
            with connect_from(client, gateway.port) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert ResponseReader(sock).next()[0] == 200, client
        open_hoard = [sock for sock in hoard if not closed_by_server(sock)]
        assert len(open_hoard) <= 4  # the others were closed, the oldest first
        assert all(closed_by_server(sock) for sock in hoard[:8])
        for sock in open_hoard:  # now busy: a request under way each
            start_request_without_body(sock)
        status, _, body = parse_response(raw_exchange_from("127.0.0.2", gateway.port))
        assert status == 429 and "per client" in json.loads(body)["error"]["message"]
        with connect_from("127.0.0.3", gateway.port) as other:
            other.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert ResponseReader(other).next()[0] == 200


@pytest.mark.parametrize("address, key", [
    (("127.0.0.2", 5), "127.0.0.2"), (("::ffff:10.1.2.3", 5), "10.1.2.3"),
    (("2001:db8::1", 5), "2001:db8::/64"), (("2001:db8::ffff:1", 5), "2001:db8::/64"),
    (("2001:db8:0:1::1", 5), "2001:db8:0:1::/64"), (None, ""),
])
def test_the_per_client_cap_counts_an_ipv6_client_by_its_64(address, key):
    assert client_key(address) == key


def test_fuzzed_requests_never_break_the_server(server):
    rng = random.Random(1234)
    valid = request_bytes("POST", "/v1/completions",
                          json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode())
    for _ in range(60):
        kind = rng.randrange(3)
        if kind == 0:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
        elif kind == 1:
            data = valid[:rng.randrange(len(valid))]
        else:
            mutated = bytearray(valid)
            for _ in range(rng.randrange(1, 6)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            data = bytes(mutated)
        response = raw_exchange(server.port, data, timeout=5)
        if response:
            assert response.startswith(b"HTTP/1.1 "), response[:100]
            assert parse_response(response)[0] != 500, response[:300]
    assert http_get(server.port, "/health")[0] == 200


def test_a_client_leaving_mid_stream_aborts_its_request(server, frontend):
    request_id = start_stream_and_leave(server.port)
    wait_for(lambda: request_id in frontend.aborted)
    wait_for(lambda: not frontend.engine.has_unfinished())
    frontend.engine.check_integrity()


def test_streams_and_disconnects_on_uvloop(frontend):
    uvloop = pytest.importorskip("uvloop")  # what the tokenizer role runs on
    with GatewayThread(frontend, loop_factory=uvloop.new_event_loop) as gateway:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key=API_KEY,
                               max_retries=0)
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
            **GREEDY))
        assert chunks[-1].choices[0].finish_reason == "length"
        request_id = start_stream_and_leave(gateway.port)
        wait_for(lambda: request_id in frontend.aborted)


def test_stop_closes_idle_connections_promptly(frontend):
    gateway = GatewayThread(frontend).__enter__()
    idle = socket.create_connection(("127.0.0.1", gateway.port), timeout=5)
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert ResponseReader(idle).next()[0] == 200
    assert gateway.stop() < 2.0
    assert idle.recv(1) == b""  # the idle keep-alive connection was closed
    idle.close()


# ---- chat templates ---------------------------------------------------------------------


LLAMA_LIKE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if loop.index0 % 2 == 0 and m['role'] == 'assistant' %}"
    "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] | trim }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}")


def test_a_checkpoint_template_renders_like_transformers(tmp_path, tiny_model_dir, frontend):
    model_dir = copy_tokenizer_files(tiny_model_dir, tmp_path, LLAMA_LIKE_TEMPLATE)
    template = ChatTemplate.from_model_dir(model_dir)
    messages = [{"role": "user", "content": "Hello "}, {"role": "assistant", "content": "Hi"},
                {"role": "user", "content": "Tell me"}]
    text = template.render(messages)
    assert text == "<s>[user] Hello</s>[assistant] Hi</s>[user] Tell me</s>[assistant] "

    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_dir)
    hf_ids = list(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"])
    ours = frontend.tokenize(template.text_for_tokenizer(text, tokenizer_adds_bos=True))
    assert ours == hf_ids and ours.count(0) == 1  # one BOS, as HF's
    assert frontend.tokenize(text).count(0) == 2  # what tokenising the raw text would give

    with pytest.raises(InvalidRequestError, match="alternate") as caught:
        template.render([{"role": "assistant", "content": "x"}])
    assert caught.value.param == "messages"


def test_template_sources_in_a_checkpoint(tmp_path):
    assert ChatTemplate.from_model_dir(tmp_path).source is None  # no files: the default
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<B>"}, "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "{{ bos_token }}D"}]}))
    assert ChatTemplate.from_model_dir(tmp_path).render([{"role": "user", "content": "x"}]) == "<B>D"
    (tmp_path / "chat_template.jinja").write_text("{{ messages | tojson }}")
    assert json.loads(ChatTemplate.from_model_dir(tmp_path).render(
        [{"role": "user", "content": "<é>"}])) == [{"role": "user", "content": "<é>"}]


def test_the_default_template_and_message_validation():
    template = ChatTemplate()
    assert template.render([{"role": "user", "content": "a"}, {"role": "assistant", "content": None}]) \
        == "user: a\nassistant: \nassistant:"
    for messages, param in [(None, "messages"), ([{"content": "x"}], "messages[0].role"),
                            ([{"role": "user"}], "messages[0].content"),
                            ([{"role": "user", "content": [{"type": "text", "text": 1}]}],
                             "messages[0].content[0].text"),
                            ([{"role": "user", "content": "x", "name": 5}], "messages[0].name")]:
        with pytest.raises(InvalidRequestError) as caught:
            template.render(messages)
        assert caught.value.param == param


def test_a_chat_request_over_the_checkpoint_template_has_one_bos(tmp_path, tiny_model_dir, frontend):
    model_dir = copy_tokenizer_files(tiny_model_dir, tmp_path, LLAMA_LIKE_TEMPLATE)
    template = ChatTemplate.from_model_dir(model_dir)
    messages = [{"role": "user", "content": "Hello"}]
    prompt_ids = frontend.tokenize(template.render(messages)[len("<s>"):])
    expected = frontend.reference(prompt_ids,
                                  SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    with GatewayThread(frontend, template) as gateway:
        status, _, body = http_post(gateway.port, "/v1/chat/completions",
                                    {"model": MODEL, "messages": messages, "max_tokens": 5,
                                     "temperature": 0, "ignore_eos": True})
    response = json.loads(body)
    assert status == 200, body
    assert response["usage"]["prompt_tokens"] == len(prompt_ids) and prompt_ids.count(0) == 1
    assert response["choices"][0]["message"]["content"] == expected.text


# ---- helpers ------------------------------------------------------------------------------


def copy_tokenizer_files(model_dir: Path, out: Path, template: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "special_tokens_map.json"):
        (out / name).write_bytes((model_dir / name).read_bytes())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return out


def start_stream_and_leave(port: int) -> str:
    """Start a long streamed completion, read a few events, disconnect; its request id."""
    body = json.dumps({"model": MODEL, "prompt": "stream me", "max_tokens": 900, "stream": True,
                       "temperature": 0, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request_bytes("POST", "/v1/completions", body))
        received = b""
        while received.count(b"data: ") < 3:
            data = sock.recv(4096)
            assert data, "the stream ended early"
            received += data
    return received.lower().split(b"x-request-id: ", 1)[1].split(b"\r\n", 1)[0].decode()


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def request_bytes(method: str, path: str, body: bytes = b"", api_key: str | None = API_KEY,
                  close: bool = True, extra_headers: dict[str, str] | None = None,
                  content_type: str | None = "application/json") -> bytes:
    headers = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}"]
    if content_type is not None:
        headers.append(f"Content-Type: {content_type}")
    if api_key is not None:
        headers.append(f"Authorization: Bearer {api_key}")
    if close:
        headers.append("Connection: close")
    headers += [f"{name}: {value}" for name, value in (extra_headers or {}).items()]
    return ("\r\n".join(headers) + "\r\n\r\n").encode() + body


def connect_from(address: str, port: int, timeout: float = 5.0) -> socket.socket:
    """A connection to the gateway from `address` (any of 127/8 is loopback on Linux)."""
    return socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(address, 0))


def raw_exchange_from(address: str, port: int, data: bytes = b"") -> bytes:
    """What the server sends a connection from `address` until it closes it."""
    with connect_from(address, port) as sock:
        sock.sendall(data)
        return b"".join(iter(lambda: sock.recv(65536), b""))


def start_request_without_body(sock: socket.socket) -> None:
    """Make a connection busy: a request whose body the server waits for (it has asked
    for it, 100 Continue, so it has the head)."""
    sock.sendall(request_bytes("POST", "/v1/completions", close=False,
                               extra_headers={"Expect": "100-continue"}).replace(b"Content-Length: 0",
                                                                                  b"Content-Length: 10"))
    assert sock.recv(4096).startswith(b"HTTP/1.1 100 Continue")


def closed_by_server(sock: socket.socket, wait_s: float = 1.0) -> bool:
    """Whether the server has closed `sock` (read EOF within `wait_s`); it sent nothing."""
    sock.settimeout(wait_s)
    try:
        data = sock.recv(1)
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    assert data == b"", data
    return True


def raw_exchange(port: int, data: bytes, shutdown: bool = True, timeout: float = 10.0) -> bytes:
    """Send bytes, optionally half-close, and read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
            if shutdown:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may answer and close before reading everything
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass
        return b"".join(chunks)


def parse_response(response: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body


class ResponseReader:
    """Reads responses one by one off a keep-alive socket (several may arrive at once)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buffer = b""

    def next(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buffer:
            self._recv()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        status, headers, _ = parse_response(head + b"\r\n\r\n")
        length = int(headers["content-length"])
        while len(self.buffer) < length:
            self._recv()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return status, headers, body

    def _recv(self) -> None:
        data = self.sock.recv(65536)
        assert data, "the server closed the connection early"
        self.buffer += data


def http_get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    return parse_response(raw_exchange(port, request_bytes("GET", path), shutdown=False))


def http_post(port: int, path: str, body, api_key: str | None = API_KEY,
              headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = request_bytes("POST", path, data, api_key, extra_headers=headers)
    return parse_response(raw_exchange(port, request, shutdown=False))


# ---- the event stream's own deadlines (ASGI level) ------------------------------------------


def test_a_client_that_stops_reading_loses_its_stream_after_the_write_timeout():
    closed = asyncio.Event()

    async def events():
        try:
            for n in range(1000):
                yield b"data: %d\n\n" % n
        finally:
            closed.set()

    sent: list[dict] = []

    async def send(message):  # the client reads the head and one event, then nothing
        if len(sent) == 2:
            await asyncio.Event().wait()
        sent.append(message)

    async def receive():  # the client never leaves
        await asyncio.Event().wait()

    async def run() -> float:
        stream = EventStream(events(), {}, write_timeout_s=0.2)
        began = time.monotonic()
        await asyncio.wait_for(stream({"http_version": "1.1", "path": "/x"}, receive, send), 5)
        return time.monotonic() - began

    took = asyncio.run(run())
    assert 0.2 <= took < 1.0 and closed.is_set() and len(sent) == 2
