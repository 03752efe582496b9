"""The tokenizer role in process, against a stand-in router: no request leaks when it
cannot be sent, and a request with no first token in time ends with a typed timeout."""
from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import zmq
import zmq.asyncio

from common.config import ClusterConfig, ConfigError
from common.errors import BatonError, RequestTimeout
from common.protocol import Abort, Generate, Status, StatusRequest, Tokens, TokensBatch, decode, encode
from common.sampling_params import SamplingParams
from services.local_cluster import free_port_base
from services.tokenizer.service import TokenizerService


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
