"""Fuzzing one live cluster through every door it has: hypothesis-made frames to the SDK,
router and stream sockets, and hostile HTTP to the gateway. After each batch every role
still answers its health probe, a valid request is served and nothing is left in flight.
The attacks that once leaked or hung a request have their own regression tests here."""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from common.protocol import (
    Abort,
    ChunkBatch,
    Error,
    ErrorCode,
    Generate,
    ProtocolError,
    Sampling,
    Status,
    StatusRequest,
    Submit,
    Tokens,
    TokensBatch,
    decode,
    encode,
    peek_request_id,
)
from services.client import Client, InvalidRequest, RequestTimeout

FIRST_TOKEN_TIMEOUT_S = 5.0
# The fuzz must not lose the worker to the router's heartbeat timeout while it is stopped.
FLAGS = ["--first-token-timeout-s", str(FIRST_TOKEN_TIMEOUT_S), "--worker-timeout-s", "30"]
REPLY_TIMEOUT_S = 15.0  # only a failing run waits this long


def fuzz_settings(examples: int):
    return settings(max_examples=examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def live(make_cluster):
    cluster = make_cluster(workers=1, extra=FLAGS)
    yield cluster
    cluster.stop()


# ---- what must hold after every batch ---------------------------------------------------


def get_json(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def post(cluster, path: str, body, headers: dict | None = None, timeout_s: float = 30.0) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=timeout_s)
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def in_flight(cluster) -> int:
    return get_json(f"{cluster.http}/health")[1]["in_flight"]


def worker_idle(cluster) -> bool:
    health = cluster.worker_health(0)
    return health["running"] + health["waiting"] == 0


def assert_cluster_serves(cluster) -> None:
    """No role died, each answers its probe, a valid request is served, nothing is in flight."""
    assert not [line for line in cluster.lines if " died " in line], cluster.lines[-20:]
    assert get_json(f"http://127.0.0.1:{cluster.port_base + 3}/health")[1]["ok"]
    assert cluster.worker_health(0)["ok"]
    status, body = post(cluster, "/v1/completions", {"prompt": "hello there", "max_tokens": 3})
    assert status == 200, body
    assert json.loads(body)["choices"][0]["finish_reason"] in ("stop", "length")
    cluster.wait_for(lambda: in_flight(cluster) == 0, 10, "the tokenizer's in_flight to return to 0")
    cluster.wait_for(lambda: worker_idle(cluster), 20, "the worker to finish or drop every fuzzed request")
    assert get_json(f"{cluster.http}/health")[1]["ok"]


# ---- frames ----------------------------------------------------------------------------


@contextlib.contextmanager
def zmq_socket(kind: int, address: str):
    context = zmq.Context()
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 1000)  # what was sent last (aborts, say) still leaves, bounded
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close()
        context.term()


def frames_of(message, payloads=None) -> list[bytes]:
    return [bytes(frame) for frame in encode(message, payloads)]


@st.composite
def mutated(draw, frames: list[bytes]) -> list[bytes]:
    """A few byte-level edits: flips, inserted or deleted bytes, truncation, another type
    byte, a frame added or dropped (never all of them: a DEALER sends at least one)."""
    frames = list(frames)
    for _ in range(draw(st.integers(1, 3))):
        index = draw(st.integers(0, len(frames) - 1))
        data = bytearray(frames[index])
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        edit = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "type", "frame"]))
        if edit == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif edit == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif edit == "delete":
            del data[at:at + draw(st.integers(1, 4))]
        elif edit == "truncate":
            del data[at:]
        elif edit == "type":
            data = bytearray([draw(st.integers(0, 20))])
            index = 0
        elif len(frames) > 1 and draw(st.booleans()):
            frames.pop(index)
            continue
        else:
            frames.append(draw(st.binary(max_size=32)))
            continue
        frames[index] = bytes(data)
    return frames


any_msgpack = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=16),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
    max_leaves=8)


@st.composite
def reshaped(draw, frames: list[bytes], keep: tuple[str, ...] = ()) -> list[bytes]:
    """A valid message with fields (or its sampling's) given values of any type."""
    body = msgspec.msgpack.decode(frames[1])
    for _ in range(draw(st.integers(1, 3))):
        nested = isinstance(body.get("sampling"), dict) and draw(st.booleans())
        target = body["sampling"] if nested else body
        names = [name for name in target if name not in keep] + ["unknown"]
        target[draw(st.sampled_from(names))] = draw(any_msgpack)
    return [frames[0], msgspec.msgpack.encode(body), *frames[2:]]


garbage = st.lists(st.binary(max_size=64), min_size=1, max_size=4)


def messages(valid: list[list[bytes]], keep: tuple[str, ...] = ()):
    """Garbage, and valid messages mutated byte-wise or reshaped field-wise."""
    pick = st.sampled_from(valid)
    return st.one_of(garbage, pick.flatmap(mutated), pick.flatmap(lambda f: reshaped(f, keep)))


def receive_until(sock, matches, timeout_s: float = REPLY_TIMEOUT_S):
    """The first received message `matches` accepts (ChunkBatch items count one by one)."""
    deadline = time.monotonic() + timeout_s
    while (remaining := deadline - time.monotonic()) > 0:
        if not sock.poll(int(remaining * 1000)):
            break
        message, _ = decode(sock.recv_multipart())
        for item in message.items if isinstance(message, ChunkBatch) else [message]:
            if matches(item):
                return item
    raise AssertionError(f"no matching reply within {timeout_s} s")


def try_decode(frames: list[bytes]):
    try:
        return decode(frames)[0]
    except ProtocolError:
        return None


SUBMITS = [frames_of(Submit(request_id="c-1", sampling=Sampling(max_tokens=4), prompt="fuzz me")),
           frames_of(Submit(request_id="c-2", sampling=Sampling(max_tokens=3, stop=["a"], seed=5)),
                     [np.array([5, 6, 7, 8], dtype=np.uint32)]),
           frames_of(Abort(request_id="c-1")), frames_of(StatusRequest())]


def test_fuzzed_frames_to_the_sdk_socket_are_each_answered(live):
    with zmq_socket(zmq.DEALER, live.sdk) as sock:
        @fuzz_settings(250)
        @given(messages(SUBMITS))
        def exchange(frames):
            sock.send_multipart(frames)
            message = try_decode(frames)
            if isinstance(message, Abort):
                return  # aborts are not answered
            if isinstance(message, Submit):
                receive_until(sock, lambda m: getattr(m, "request_id", None) == message.request_id)
                sock.send_multipart(frames_of(Abort(request_id=message.request_id)))
            elif isinstance(message, StatusRequest):
                receive_until(sock, lambda m: isinstance(m, Status))
            else:  # refused, naming the request when the body names one
                expected = peek_request_id(frames) if message is None else getattr(message, "request_id", "")
                reply = receive_until(sock, lambda m: isinstance(m, Error) and m.request_id == expected)
                assert reply.code == ErrorCode.INVALID_REQUEST

        exchange()
    assert_cluster_serves(live)


def test_fuzzed_frames_to_the_router_socket(live):
    stream_address = f"tcp://127.0.0.1:{live.port_base + 2}"
    valid = [frames_of(Generate(request_id="g-1", sampling=Sampling(max_tokens=4), stream_address=stream_address),
                       [np.array([5, 6, 7], dtype=np.uint32)]),
             frames_of(Abort(request_id="g-1")), frames_of(StatusRequest())]
    generated: set[str] = set()
    with zmq_socket(zmq.DEALER, live.router) as sock:
        @fuzz_settings(250)
        @given(messages(valid, keep=("stream_address",)))
        def exchange(frames):
            message = try_decode(frames)
            if isinstance(message, Generate) and message.stream_address != stream_address:
                return  # a bad stream address wedges the worker: another fix's test
            sock.send_multipart(frames)
            if isinstance(message, Generate):
                generated.add(message.request_id)
            elif isinstance(message, StatusRequest):
                receive_until(sock, lambda m: isinstance(m, Status))
            elif message is None:
                expected = peek_request_id(frames)
                reply = receive_until(sock, lambda m: isinstance(m, Error) and m.request_id == expected)
                assert reply.code == ErrorCode.INVALID_REQUEST

        exchange()
        for request_id in generated:  # what a tokenizer does for requests it gives up
            sock.send_multipart(frames_of(Abort(request_id=request_id)))
    assert_cluster_serves(live)


def test_fuzzed_frames_pushed_to_the_tokenizer_stream_and_at_a_live_request(live):
    conn = http.client.HTTPConnection("127.0.0.1", live.http_port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"}, body=json.dumps(
            {"prompt": "a live stream", "max_tokens": 300, "ignore_eos": True, "stream": True}))
        response = conn.getresponse()
        live_id = response.getheader("X-Request-Id")
        tokens = Tokens(request_id=live_id, token_ids=[1, 2], worker_id="worker-0",
                        logprobs=[{"token_id": 1, "logprob": -1.0}])
        valid = [frames_of(TokensBatch(items=[tokens, Tokens(request_id="x-1", token_ids=[3], finished=True)])),
                 frames_of(Error(request_id="x-1", code=ErrorCode.WORKER_LOST, message="gone", worker_id="w-0")),
                 frames_of(Error(request_id="", code=ErrorCode.INTERNAL, message="peer"))]
        with zmq_socket(zmq.PUSH, f"tcp://127.0.0.1:{live.port_base + 2}") as sock:
            @fuzz_settings(250)
            @given(messages(valid))
            def push(frames):
                sock.send_multipart(frames)

            push()
        body = response.read()  # the live stream ends, finished or with an error event
    finally:
        conn.close()
    assert body.endswith(b"data: [DONE]\n\n") or b'data: {"error"' in body, body[-300:]
    assert_cluster_serves(live)


# ---- HTTP ------------------------------------------------------------------------------


json_junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.just(2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
    max_leaves=10)
# Never absent or null: a chat request without it may generate the whole context window.
max_tokens_values = st.one_of(st.integers(1, 6), st.integers(max_value=0), st.integers(min_value=2**31),
                              st.text(max_size=4), st.booleans(), st.floats(allow_nan=False), st.lists(st.integers()))
field_values = st.one_of(json_junk, st.integers(min_value=2**63, max_value=2**80),
                         st.text(min_size=1000, max_size=3000), st.lists(st.text(max_size=2000), max_size=20))
sampling_fields = {name: field_values for name in (
    "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs", "n", "best_of",
    "echo", "suffix", "ignore_eos", "presence_penalty", "logit_bias", "slo_class", "stream", "stream_options",
    "model", "user", "response_format", "tools", "max_completion_tokens")}
prompts = st.one_of(st.text(min_size=1, max_size=200), st.lists(st.integers(-5, 600), min_size=1, max_size=20),
                    json_junk)
chat_messages = st.one_of(json_junk, st.lists(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), json_junk),
     "content": st.one_of(st.text(max_size=200), json_junk)}), max_size=3))
completion_bodies = st.fixed_dictionaries({"prompt": prompts, "max_tokens": max_tokens_values},
                                          optional=sampling_fields)
chat_bodies = st.fixed_dictionaries({"messages": chat_messages, "max_tokens": max_tokens_values},
                                    optional={**sampling_fields, "max_completion_tokens": max_tokens_values})


# JSON that Python parses into what UTF-8 cannot carry, numbers too long, nesting too deep.
raw_bodies = st.one_of(st.binary(max_size=200), st.sampled_from([
    b'{"prompt": "\\ud800", "max_tokens": 2}', b'{"prompt": "hi", "max_tokens": 2, "stop": ["\\udfff"]}',
    b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
    b'{"prompt": "hi", "max_tokens": 2, "slo_class": "\\ud800"}', b'{"prompt": "hi", "model": "\\ud800"}',
    b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", b"[" * 100_000, b'{"prompt": ' * 50_000]))


def assert_answered(status: int, body: bytes, content_type: str = "application/json") -> None:
    """A success, or a client error in OpenAI's shape; never a server error."""
    assert status in (200, 400, 401, 404), (status, body[:300])
    if status != 200:
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str) and error["message"]
    elif content_type.startswith("text/event-stream"):
        assert body.endswith(b"data: [DONE]\n\n") or b'data: {"error"' in body, body[-300:]
    else:
        assert json.loads(body)["choices"]


def fuzz_post(cluster, path: str, body) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=30)
    try:
        conn.request("POST", path, body=body if isinstance(body, bytes) else json.dumps(body).encode())
        response = conn.getresponse()
        assert_answered(response.status, response.read(), response.getheader("Content-Type", ""))
    finally:
        conn.close()


def test_fuzzed_json_bodies(live):
    @fuzz_settings(250)
    @given(st.one_of(completion_bodies.map(lambda b: ("/v1/completions", b)),
                     chat_bodies.map(lambda b: ("/v1/chat/completions", b)),
                     st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
                               st.one_of(json_junk, raw_bodies))))
    def exchange(case):
        fuzz_post(live, *case)

    exchange()
    assert_cluster_serves(live)


header_names = st.one_of(
    st.sampled_from(["Authorization", "Content-Type", "Connection", "Expect", "Transfer-Encoding", "Accept",
                     "X-Baton-SLO-Class", "Host", "Accept-Encoding", "X-Request-Id"]),
    st.text(alphabet="!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
            min_size=1, max_size=20))
header_values = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
                        max_size=100).map(str.strip)


def test_fuzzed_headers(live):
    body = {"prompt": "hi", "max_tokens": 2}

    @fuzz_settings(150)
    @given(st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
           st.lists(st.tuples(header_names, header_values), max_size=6))
    def exchange(path, headers):
        conn = http.client.HTTPConnection("127.0.0.1", live.http_port, timeout=30)
        try:
            data = json.dumps(body if path.endswith("/completions") and "chat" not in path
                              else {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
            conn.putrequest("POST", path, skip_host=True, skip_accept_encoding=True)
            for name, value in headers:
                if name.lower() != "content-length":
                    conn.putheader(name, value.encode("latin-1"))
            conn.putheader("Content-Length", str(len(data)))
            conn.endheaders(data)
            response = conn.getresponse()
            status, payload = response.status, response.read()
        finally:
            conn.close()
        assert status < 500, (status, payload[:300])

    exchange()
    assert_cluster_serves(live)


VALID_BODY = b'{"prompt": "hi", "max_tokens": 2}'
VALID_HTTP = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(VALID_BODY), VALID_BODY))
http_lines = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda method, target, version, head, body: b"%s %s %s\r\n%s\r\n%s" % (method, target, version, head,
                                                                                      body),
              st.sampled_from([b"POST", b"GET", b"PO ST", b"", b"\x00", b"DELETE"]),
              st.sampled_from([b"/v1/completions", b"/v1/chat/completions", b"*", b"http://x/v1/completions",
                               b"/v1/completions?x=\x01", b"", b"/" * 3000]),
              st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/9", b"http/1.1", b""]),
              st.lists(st.sampled_from([b"Content-Length: 10\r\n", b"Content-Length: -1\r\n",
                                        b"Content-Length: 99999999999999999999\r\n", b"Content-Length: 1, 2\r\n",
                                        b"Transfer-Encoding: chunked\r\n", b" folded\r\n", b"Bad Header\r\n",
                                        b"X: \x01\r\n", b"Expect: nothing\r\n", b"Connection: close\r\n",
                                        b"Content-Length: 0\r\n"]), max_size=4).map(b"".join),
              st.binary(max_size=64)),
    mutated([VALID_HTTP]).map(b"".join))


def raw_exchange(cluster, request: bytes) -> bytes:
    """Send `request`, end the writing side, and read what comes back until the server closes."""
    with socket.create_connection(("127.0.0.1", cluster.http_port), timeout=15) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def test_malformed_http_on_raw_sockets(live):
    @fuzz_settings(250)
    @given(http_lines)
    def exchange(request):
        try:
            received = raw_exchange(live, request)
        except ConnectionResetError:
            return  # closed with unread input: a reset is a refusal too
        if received:
            assert received.startswith(b"HTTP/1.1 "), received[:200]
            status = int(received[9:12])
            assert status < 500 or status in (503, 505), received[:300]  # busy; HTTP/2 and such

    exchange()
    assert_cluster_serves(live)


# ---- regressions -----------------------------------------------------------------------


def test_out_of_range_ints_are_refused_naming_the_field_and_leave_nothing_in_flight(live):
    conn = http.client.HTTPConnection("127.0.0.1", live.http_port, timeout=10)
    fields = [("top_k", 2**70), ("stop_token_ids", [2**70]), ("seed", 2**70), ("logprobs", 2**70),
              ("stop_token_ids", [2**32]), ("top_k", 2**31)]
    try:
        for index in range(500):
            name, value = fields[index % len(fields)]
            conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "hi", name: value}),
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            body = json.loads(response.read())
            assert response.status == 400, body
            assert body["error"]["param"] == name, body
    finally:
        conn.close()
    assert in_flight(live) == 0
    assert_cluster_serves(live)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_an_oversized_stop_list_is_a_400_at_once(live, path, body):
    started = time.monotonic()
    status, payload = post(live, path, {**body, "stop": ["x" * 600_000] * 2}, timeout_s=10)
    assert status == 400, payload
    assert json.loads(payload)["error"]["param"] == "stop"
    assert time.monotonic() - started < 5
    assert in_flight(live) == 0


def test_an_oversized_stop_list_on_the_sdk_is_invalid_request_at_once(live):
    with Client(live.sdk, timeout_s=30) as client:
        with pytest.raises(InvalidRequest, match="stop"):
            client.generate("hi", stop=["x" * 600_000] * 2)
    oversized = Submit(request_id="big-1", sampling=Sampling(stop=["x" * 600_000] * 2), prompt="hi")
    within_the_body_limit = Submit(request_id="big-2", sampling=Sampling(stop=["x" * 50_000] * 16), prompt="hi")
    with zmq_socket(zmq.DEALER, live.sdk) as sock:
        for submit in (oversized, within_the_body_limit):
            sock.send_multipart(frames_of(submit))
            reply = receive_until(sock, lambda m: isinstance(m, Error), timeout_s=5)
            assert (reply.request_id, reply.code) == (submit.request_id, ErrorCode.INVALID_REQUEST), reply
    assert in_flight(live) == 0


def test_an_oversized_generate_is_refused_to_its_request_by_the_router(live):
    generate = Generate(request_id="big-3", sampling=Sampling(stop=["x" * 600_000] * 2),
                        stream_address=f"tcp://127.0.0.1:{live.port_base + 2}")
    with zmq_socket(zmq.DEALER, live.router) as sock:
        sock.send_multipart(frames_of(generate, [np.array([5, 6], dtype=np.uint32)]))
        reply = receive_until(sock, lambda m: isinstance(m, Error))
    assert (reply.request_id, reply.code) == ("big-3", ErrorCode.INVALID_REQUEST)
    assert "over the" in reply.message


def test_tokens_the_tokenizer_cannot_decode_fail_their_request_not_the_tokenizer(live):
    conn = http.client.HTTPConnection("127.0.0.1", live.http_port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"}, body=json.dumps(
            {"prompt": "hi", "max_tokens": 900, "ignore_eos": True, "stream": True}))
        response = conn.getresponse()
        request_id = response.getheader("X-Request-Id")
        with zmq_socket(zmq.PUSH, f"tcp://127.0.0.1:{live.port_base + 2}") as sock:
            sock.send_multipart(frames_of(TokensBatch(items=[Tokens(request_id=request_id, token_ids=[2**63])])))
            body = response.read()
    finally:
        conn.close()
    assert b'"code":"internal"' in body and b"outside the vocabulary" in body, body[-300:]
    assert_cluster_serves(live)


def test_no_first_token_in_time_is_a_typed_timeout(live):
    pid = live.worker_health(0)["pid"]
    outcome: dict = {}

    def over_http():
        outcome["http"] = post(live, "/v1/completions", {"prompt": "stuck", "max_tokens": 2}, timeout_s=30)

    http_request = threading.Thread(target=over_http)
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        http_request.start()
        with Client(live.sdk, timeout_s=60) as client:
            with pytest.raises(RequestTimeout, match="first_token_timeout_s"):
                client.generate("stuck too", max_tokens=2)
        http_request.join(30)
        waited = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    status, payload = outcome["http"]
    assert status == 504 and "first_token_timeout_s" in json.loads(payload)["error"]["message"], payload
    assert FIRST_TOKEN_TIMEOUT_S - 0.5 < waited < FIRST_TOKEN_TIMEOUT_S + 10
    assert in_flight(live) == 0
    assert_cluster_serves(live)
