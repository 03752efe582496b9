"""What the sync and async clients share: building requests, reading replies."""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import BatonError, InvalidRequest, error_from_code
from common.protocol import (
    MAX_BODY_BYTES,
    MAX_TOKENS_PER_FRAME,
    Chunk,
    Error,
    ErrorCode,
    ProtocolError,
    Submit,
    decode,
    encode,
    sampling_from_params,
)
from common.sampling_params import MAX_TOKEN_ID, InvalidRequestError, SamplingParams

DEFAULT_ADDRESS = "tcp://127.0.0.1:7101"


@dataclass
class StreamChunk:
    """New tokens of a streaming request and the text they completed; the final chunk
    (finished) carries the request's `timings` (see Result). A request with
    `prompt_logprobs` first gets chunks with no token that carry the next prompt tokens'
    records (see Result.prompt_logprobs)."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    timings: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: list[dict | None] = field(default_factory=list)


@dataclass
class Result:
    """A finished request. ttft_s, second_token_s, tpot_s and e2e_s are measured here,
    from sending the request (second_token_s: to the arrival of the output's second token;
    0.0 with fewer than two). `timings` is the server's split of a disaggregated request,
    in seconds: queue_s (arrival to first step on the prefill worker), prefill_s (first
    step to first token), decode_wait_s (the KV handle's arrival at the decode worker to
    the start of its pull) and transfer_s (the pull); {} for a request served by one
    worker, and a key is missing where its step did not happen (no pull when the decode
    worker held every block). `prompt_logprobs` (asked with prompt_logprobs=N): one
    record per prompt token, {"token_id", "logprob", "top": [(token id, logprob), ...N]},
    the logprob of that token given those before it, and None for the first token."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_s: float
    tpot_s: float
    e2e_s: float
    logprobs: list[dict] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    second_token_s: float = 0.0
    prompt_logprobs: list[dict | None] = field(default_factory=list)


def build_submit(prompt: str | None, token_ids, api_key: str, timeout_s: float,
                 sampling: dict, slo_class: str = "") -> tuple[str, list]:
    """(request id, frames) of a Submit; invalid parameters raise InvalidRequest here
    (the server checks that `slo_class` names a configured class)."""
    if (prompt is None) == (token_ids is None):
        raise InvalidRequest("prompt: give exactly one of prompt and token_ids")
    for name, value in (("prompt", "" if prompt is None else prompt), ("api_key", api_key),
                        ("slo_class", slo_class)):
        if not isinstance(value, str):
            raise InvalidRequest(f"{name}: must be a string, got {type(value).__name__}")
    if not isinstance(timeout_s, (int, float)) or not 0 <= timeout_s < math.inf:
        raise InvalidRequest(f"timeout_s: must be a finite number >= 0, got {timeout_s!r}")
    try:
        params = SamplingParams(**_tuples(sampling))
        params.validate()
    except TypeError as error:
        raise InvalidRequest(f"sampling: {error}") from None
    except InvalidRequestError as error:
        raise InvalidRequest(str(error)) from None
    request_id = uuid.uuid4().hex
    submit = Submit(request_id=request_id, sampling=sampling_from_params(params), prompt=prompt,
                    api_key=api_key, timeout_s=timeout_s, slo_class=slo_class)
    payloads = None if token_ids is None else [_token_ids(token_ids)]
    try:
        frames = encode(submit, payloads)
    except UnicodeEncodeError:  # msgpack carries UTF-8, which has no lone surrogates
        fields = {"prompt": prompt or "", "api_key": api_key, "slo_class": slo_class,
                  **{f"stop[{index}]": stop for index, stop in enumerate(params.stop)}}
        raise _lone_surrogate(fields) from None
    if len(frames[1]) > MAX_BODY_BYTES:
        raise InvalidRequest(f"prompt: the request's message is {len(frames[1])} bytes, over the "
                             f"protocol's limit of {MAX_BODY_BYTES}")
    return request_id, frames


def _lone_surrogate(fields: dict[str, str]) -> InvalidRequest:
    """InvalidRequest naming the first field whose text UTF-8 cannot encode."""
    for name, text in fields.items():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            return InvalidRequest(f"{name}: is not valid Unicode: it holds a lone surrogate "
                                  f"(U+{ord(text[error.start]):04X} at index {error.start})")
    return InvalidRequest("the request holds text that is not valid Unicode")


def _token_ids(token_ids) -> list[int]:
    """Token ids as the uint32 payload takes them; InvalidRequest otherwise."""
    ids = list(token_ids)
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise InvalidRequest(f"token_ids: must be integers in [0, {MAX_TOKEN_ID}]")
    if len(ids) > MAX_TOKENS_PER_FRAME:
        raise InvalidRequest(f"token_ids: at most {MAX_TOKENS_PER_FRAME} tokens, got {len(ids)}")
    return ids


def _tuples(sampling: dict) -> dict:
    converted = dict(sampling)
    for key in ("stop", "stop_token_ids"):
        if key in converted:
            value = converted[key]
            converted[key] = (value,) if isinstance(value, (str, int)) else tuple(value)
    return converted


def connect_dealer(context, address: str, curve: dict | None, send_timeout_s: float = 5.0):
    """The client's DEALER socket; `curve` holds Z85 keys when the cluster uses CURVE. A
    send that finds no connection to queue on for `send_timeout_s` (the server is down, or
    refused our key) raises zmq.Again instead of waiting for ever."""
    import zmq

    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
    if curve:
        socket.curve_serverkey = curve["server_public"].encode()
        socket.curve_publickey = curve["client_public"].encode()
        socket.curve_secretkey = curve["client_secret"].encode()
    socket.connect(address)
    return socket


def curve_keys(keys_dir: str | Path) -> dict:
    """The SDK's CURVE keys from a directory `svc keys generate` wrote: the client key pair
    (client.key_secret, or a client-NAME.key_secret given as the path of that file) and
    the tokenizer's public key it pins."""
    import zmq.auth

    path = Path(keys_dir)
    secret_file = path if path.is_file() else path / "client.key_secret"
    server_public, _ = zmq.auth.load_certificate(secret_file.parent / "tokenizer.key")
    client_public, client_secret = zmq.auth.load_certificate(secret_file)
    if client_secret is None:
        raise ValueError(f"{secret_file} holds no secret key")
    return {"server_public": server_public.decode(), "client_public": client_public.decode(),
            "client_secret": client_secret.decode()}


def retry_pause(error: BatonError, deadline: float, may_retry: bool) -> float | None:
    """Seconds to wait before retrying a refused request, or None to give up: only an
    error that asks for a retry (retry_after_s > 0), while the deadline leaves time."""
    remaining = deadline - time.monotonic()
    if not may_retry or error.retry_after_s <= 0 or remaining <= error.retry_after_s:
        return None
    return error.retry_after_s


def parse_reply(frames: list[bytes]) -> Chunk | Error | object:
    try:
        message, _ = decode(frames)
    except ProtocolError as error:
        return Error(request_id="", code=ErrorCode.INTERNAL, message=f"malformed reply: {error}")
    return message


def raise_for(message: Error) -> None:
    raise error_from_code(message.code, message.message, message.retry_after_s)


class Accumulator:
    """Turns a request's chunks into a Result, with client-side timings."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.start = time.perf_counter()
        self.first_at: float | None = None
        self.second_at: float | None = None
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict] = []
        self.prompt_logprobs: list[dict | None] = []
        self.timings: dict[str, float] = {}
        self.last: Chunk | None = None

    def add(self, chunk: Chunk) -> StreamChunk:
        now = time.perf_counter()
        if self.first_at is None and chunk.token_ids:
            self.first_at = now
        self.text.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        if self.second_at is None and len(self.token_ids) >= 2:
            self.second_at = now
        self.logprobs.extend(chunk.logprobs)
        self.prompt_logprobs.extend(chunk.prompt_logprobs)
        self.timings.update(chunk.timings)
        self.last = chunk
        return StreamChunk(self.request_id, list(chunk.token_ids), chunk.text, chunk.finished, chunk.finish_reason,
                           dict(chunk.timings), list(chunk.prompt_logprobs))

    def result(self) -> Result:
        end = time.perf_counter()
        first = self.first_at or end
        count = len(self.token_ids)
        last = self.last
        return Result(self.request_id, "".join(self.text), self.token_ids,
                      last.finish_reason if last else None, last.num_prompt_tokens if last else 0,
                      last.num_cached_tokens if last else 0, first - self.start,
                      (end - first) / (count - 1) if count > 1 else 0.0, end - self.start, self.logprobs,
                      dict(self.timings), self.second_at - self.start if self.second_at is not None else 0.0,
                      self.prompt_logprobs)


__all__ = ["Accumulator", "BatonError", "DEFAULT_ADDRESS", "Result", "StreamChunk", "build_submit",
           "connect_dealer", "curve_keys", "parse_reply", "raise_for", "retry_pause"]
