"""The tokenizer role in process, against a stand-in router: no request leaks when it
cannot be sent, and a request with no first token in time ends with a typed timeout."""
from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import threading
import time

import pytest
import zmq
import zmq.asyncio

from common.config import ClusterConfig, ConfigError
from common.errors import BatonError, RequestTimeout
from common.protocol import Abort, Generate, Status, StatusRequest, Tokens, TokensBatch, decode, encode
from common.sampling_params import SamplingParams
from services.local_cluster import free_port_base
from services.tokenizer.chat import ChatTemplate
from services.tokenizer.http_server import HttpLimits
from services.tokenizer.openai_api import OpenAIGateway
from services.tokenizer.service import TokenizerService
from services.tokenizer.text_prompts import PromptTooLong, prompt_byte_limit, token_byte_bound
from tests.services.test_http_gateway import http_post, probe_health_while


class StandIn:
    """A router that records what the tokenizer sends and answers nothing, and a worker's
    PUSH socket into the tokenizer's stream."""

    def __init__(self, config: ClusterConfig):
        self.context = zmq.asyncio.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(config.router)
        self.push = self.context.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(config.stream)

    async def answer_status(self, timeout_s: float = 10.0) -> None:
        """Answer the tokenizer's first StatusRequest, so that it counts the router as up."""
        while True:
            frames = await asyncio.wait_for(self.router.recv_multipart(), timeout_s)
            if isinstance(decode(frames[1:])[0], StatusRequest):
                await self.router.send_multipart([frames[0], *encode(Status("round_robin", [], 0, 0))])
                return

    async def next_request_message(self, timeout_s: float = 10.0) -> Generate | Abort:
        """The next Generate or Abort (status requests are skipped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            frames = await asyncio.wait_for(self.router.recv_multipart(), deadline - time.monotonic())
            message, _ = decode(frames[1:])
            if isinstance(message, (Generate, Abort)):
                return message

    def close(self) -> None:
        self.router.close(0)
        self.push.close(0)
        self.context.term()


@contextlib.asynccontextmanager
async def running_tokenizer(model_dir, **config_fields):
    # One status answer keeps the stand-in router "reachable" for worker_timeout_s.
    config = ClusterConfig(port_base=free_port_base(), worker_timeout_s=30.0, **config_fields)
    stand_in = StandIn(config)
    service = TokenizerService(config, model_dir)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        await stand_in.answer_status()
        deadline = time.monotonic() + 5
        while not service.router_reachable() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        yield service, stand_in
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        stand_in.close()


def test_a_request_that_cannot_be_sent_ends_typed_and_is_forgotten(tiny_model_dir):
    async def run():
        async with running_tokenizer(tiny_model_dir) as (service, _):
            # A request id msgpack cannot encode (a lone surrogate) fails after registration.
            events = service.generate("bad-\ud800", [5, 6, 7], SamplingParams(max_tokens=1), "")
            with pytest.raises(BatonError) as failed:
                await asyncio.wait_for(anext(events), 5)
            return failed.value, service.health()["in_flight"]

    error, in_flight = asyncio.run(run())
    assert "could not be sent" in error.message
    assert in_flight == 0


def test_no_first_token_in_time_is_a_typed_timeout_and_an_abort(tiny_model_dir):
    async def run():
        async with running_tokenizer(tiny_model_dir, first_token_timeout_s=0.3) as (service, stand_in):
            events = service.generate("r-1", [5, 6, 7], SamplingParams(max_tokens=1), "", timeout_s=30)
            first = asyncio.ensure_future(anext(events))
            assert isinstance(await stand_in.next_request_message(), Generate)
            started = time.monotonic()
            with pytest.raises(RequestTimeout) as timed_out:
                await asyncio.wait_for(first, 10)
            waited = time.monotonic() - started
            abort = await stand_in.next_request_message()
            return timed_out.value, waited, abort, service.health()["in_flight"]

    error, waited, abort, in_flight = asyncio.run(run())
    assert "first_token_timeout_s" in error.message and waited < 3.0
    assert isinstance(abort, Abort) and abort.request_id == "r-1" and abort.reason == "first token timeout"
    assert in_flight == 0


def test_the_first_token_trades_the_first_token_deadline_for_the_requests(tiny_model_dir):
    async def run():
        async with running_tokenizer(tiny_model_dir, first_token_timeout_s=0.3) as (service, stand_in):
            events = service.generate("r-2", [5, 6, 7], SamplingParams(max_tokens=8), "", timeout_s=1.5)
            first = asyncio.ensure_future(anext(events))
            await stand_in.next_request_message()
            started = time.monotonic()
            await stand_in.push.send_multipart(encode(TokensBatch(items=[
                Tokens(request_id="r-2", token_ids=[9], worker_id="w-0")])))
            assert (await asyncio.wait_for(first, 5)).token_ids == [9]
            with pytest.raises(RequestTimeout) as timed_out:
                await asyncio.wait_for(anext(events), 10)
            return timed_out.value, time.monotonic() - started

    error, waited = asyncio.run(run())
    assert "no result within 1.5 s" in error.message
    assert 0.8 < waited < 5.0


def test_first_token_timeout_is_validated():
    assert ClusterConfig().first_token_timeout_s == 120.0
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match="first_token_timeout_s"):
            ClusterConfig(first_token_timeout_s=bad)


# ---- text prompts: a byte bound before tokenizing, tokenizing off the loop ------------------


def _tokenizer_spec(normalizer=None, pre_tokenizer=None, fuse_unk=False) -> str:
    return json.dumps({
        "normalizer": normalizer, "pre_tokenizer": pre_tokenizer or {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": {"a": 0, "abcd": 1, "ĠĠĠ": 2}, "fuse_unk": fuse_unk},
        "added_tokens": [{"content": "<|endoftext|>"}]})


@pytest.mark.parametrize("spec, bound", [
    (_tokenizer_spec(), 13),  # the longest token: the added one's 13 bytes
    (_tokenizer_spec(normalizer={"type": "NFC"}), 13 * 4),  # a normal form shrinks a text at most 4x
    (_tokenizer_spec(normalizer={"type": "Sequence", "normalizers": [{"type": "NFKC"}]}), 13 * 4),
    (_tokenizer_spec(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "behavior": "Isolated"}, {"type": "ByteLevel"}]}), 13),  # Llama 3's shape
    (_tokenizer_spec(normalizer={"type": "Lowercase"}), None),  # not proven to keep every byte
    (_tokenizer_spec(normalizer={"type": "Strip"}), None),  # drops whitespace: no bound
    (_tokenizer_spec(pre_tokenizer={"type": "Whitespace"}), None),
    (_tokenizer_spec(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "behavior": "Removed"}, {"type": "ByteLevel"}]}), None),
    (_tokenizer_spec(fuse_unk=True), None),  # one unknown token can stand for any run
])
def test_the_byte_bound_holds_only_for_tokenizers_that_keep_every_byte(spec, bound):
    assert token_byte_bound(spec) == bound


def test_the_prompt_byte_limit_is_the_tighter_of_the_proven_and_the_configured():
    assert prompt_byte_limit(12, 1024, 0).max_bytes == 12 * 1023
    assert prompt_byte_limit(12, 1024, 5000).max_bytes == 5000
    assert prompt_byte_limit(None, 1024, 0).max_bytes == 0  # no bound: only the body limit
    limit = prompt_byte_limit(2, 11, 0)
    limit.check("é" * 10, "prompt")  # 20 bytes: 10 tokens could hold them
    with pytest.raises(PromptTooLong, match=r"^prompt: is 21 bytes of UTF-8, over the limit of 20 bytes"):
        limit.check("é" * 10 + "x", "prompt")
    with pytest.raises(ConfigError, match="max_prompt_bytes"):
        ClusterConfig(max_prompt_bytes=-1)


def test_the_service_refuses_by_bytes_what_its_tokenizer_could_not_fit(tiny_model_dir):
    service = TokenizerService(ClusterConfig(port_base=free_port_base()), tiny_model_dir)
    try:
        limit = service.prompt_byte_limit.max_bytes
        assert limit == 12 * (service.max_model_len - 1)  # the tiny model's longest token is 12 bytes
        vocab = service.tokenizer.get_vocab()
        densest = service.decode([vocab[max(vocab, key=len)]])  # the longest token's text
        text = (densest * (limit // len(densest.encode()) + 1))[:limit + 1]
        assert len(text.encode()) > limit and len(service.tokenize(text)) >= service.max_model_len
    finally:
        service.close()


def test_long_prompts_are_tokenized_off_the_loop_while_health_answers(tiny_model_dir, tmp_path):
    """With a tokenizer whose byte bound cannot be proven (it lowercases), long prompts are
    tokenized in full, on the pool: /health, on the same loop, stays prompt meanwhile; the
    prompts are then refused for their token count."""
    model_dir = tmp_path / "lowercasing"
    shutil.copytree(tiny_model_dir, model_dir)
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    (model_dir / "tokenizer.json").write_text(json.dumps({**spec, "normalizer": {"type": "Lowercase"}}))
    prompt = "Hello World " * 125_000  # 1.5 MB, ~2 s to tokenize here

    async def run():
        async with running_tokenizer(model_dir) as (service, _), serving_gateway(service) as port:
            assert service.prompt_byte_limit.max_bytes == 0
            answers: list[tuple[int, bytes]] = []
            senders = [threading.Thread(target=lambda: answers.append(
                http_post(port, "/v1/completions", {"prompt": prompt})[::2])) for _ in range(3)]
            probes = await asyncio.to_thread(probe_health_while, port, senders, 503)  # 503: no workers here
            return answers, probes

    answers, probes = asyncio.run(run())
    assert len(answers) == 3
    for status, response in answers:
        assert status == 400 and json.loads(response)["error"]["code"] == "context_length_exceeded", response
    assert len(probes) >= 3 and sorted(probes)[len(probes) // 2] < 0.1 and max(probes) < 1.0, probes


@contextlib.asynccontextmanager
async def serving_gateway(service: TokenizerService):
    """The service's HTTP gateway on a free loopback port, as the role runs it."""
    gateway = OpenAIGateway(service, ChatTemplate(), HttpLimits(), pool=service.pool)
    stop = asyncio.Event()
    bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    serving = asyncio.create_task(gateway.serve("127.0.0.1", 0, stop, bound.set_result))
    try:
        yield await asyncio.wait_for(bound, 10)
    finally:
        stop.set()
        await asyncio.wait_for(serving, 15)
