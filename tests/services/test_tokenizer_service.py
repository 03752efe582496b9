"""The tokenizer role in process, against a stand-in router socket: what it sends the router,
and what a real SDK client streams when a stand-in worker pushes tokens to it."""
from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable

import msgspec
import pytest
import zmq
import zmq.asyncio

from common.config import ClusterConfig, SloClass
from common.errors import InvalidRequest, ServerUnavailable
from common.protocol import Abort, Generate, Placed, Status, StatusRequest, Tokens, TokensBatch, decode, encode
from common.sampling_params import SamplingParams
from services.client import AsyncClient, StreamChunk
from services.local_cluster import free_port_base
from services.tokenizer.service import TokenizerService
from services.tokenizer.text_prompts import INLINE_PROMPT_CHARS

SLO_CLASSES = (SloClass("interactive", 1.0, 0.1), SloClass("tenant-a", 2.0, 0.2), SloClass("batch", 30.0, 1.0))


@pytest.mark.parametrize("named, tenant, default, expected", [
    ("interactive", "tenant-a", "batch", "interactive"),  # the class the request names
    ("", "tenant-a", "batch", "tenant-a"),  # else the tenant's
    ("", "tenant-b", "batch", "batch"),  # else the default
    ("", "tenant-b", "", ""),  # else none
])
def test_generate_carries_the_resolved_slo_class(tiny_model_dir, named, tenant, default, expected):
    config = ClusterConfig(port_base=free_port_base(), slo_classes=SLO_CLASSES, default_slo_class=default)
    assert asyncio.run(_routed_slo_class(config, tiny_model_dir, named, tenant)) == expected


def test_an_unknown_slo_class_is_an_invalid_request_naming_the_known_ones(tiny_model_dir):
    config = ClusterConfig(port_base=free_port_base(), slo_classes=SLO_CLASSES)
    with pytest.raises(InvalidRequest, match="'bulk'; configured: interactive, tenant-a, batch"):
        asyncio.run(_routed_slo_class(config, tiny_model_dir, "bulk", ""))


def _stand_in_router(config: ClusterConfig) -> tuple[zmq.asyncio.Context, zmq.asyncio.Socket]:
    """A ROUTER socket bound where the tokenizer expects the router."""
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(config.router)
    return context, router


async def _answering_router(router: zmq.asyncio.Socket, status: Callable[[], Status | None]) -> None:
    """Serve as the router: answer each status request with status() (not at all while it
    gives None), and acknowledge the request named "placed" as Placed on worker "w"."""
    while True:
        identity, *frames = await router.recv_multipart()
        message, _ = decode(frames)
        if isinstance(message, StatusRequest):
            answer = status()
            if answer is not None:
                await router.send_multipart([identity, *encode(answer)])
        elif isinstance(message, Generate) and message.request_id == "placed":
            await router.send_multipart([identity, *encode(Placed(request_id="placed", worker_id="w"))])


async def _routed_slo_class(config: ClusterConfig, model_dir, named: str, tenant: str) -> str:
    """The slo_class of the Generate the tokenizer sends for one request."""
    context, router = _stand_in_router(config)
    service = TokenizerService(config, model_dir)
    service.last_status_at = time.monotonic()  # as if the router had just answered a status request
    events = service.generate("r-1", [5, 6, 7], SamplingParams(max_tokens=1), tenant, slo_class=named)
    first = asyncio.ensure_future(anext(events))  # admits the request (or raises why not)
    receiving = asyncio.ensure_future(router.recv_multipart())
    try:
        await asyncio.wait({first, receiving}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        if first.done():
            first.result()
        message, _ = decode((await asyncio.wait_for(receiving, 10))[1:])
        assert isinstance(message, Generate)
        return message.slo_class
    finally:
        for task in (first, receiving):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        service.close()
        router.close(0)
        context.term()


def test_while_the_router_is_unreachable_requests_are_refused_at_once_and_leave_nothing(tiny_model_dir):
    async def run():
        service = TokenizerService(ClusterConfig(port_base=free_port_base()), tiny_model_dir)
        try:  # no router ever answered a status request
            events = service.generate("r-1", [5, 6, 7], SamplingParams(max_tokens=1), "")
            started = time.monotonic()
            with pytest.raises(ServerUnavailable) as refused:
                await asyncio.wait_for(anext(events), 5)
            return refused.value, time.monotonic() - started, len(service.requests)
        finally:
            service.close()

    error, elapsed, in_flight = asyncio.run(run())
    assert error.retry_after_s > 0 and elapsed < 1.0 and in_flight == 0


def test_tokens_for_a_request_it_does_not_know_are_aborted_upstream_once(tiny_model_dir):
    """A worker streaming to a tokenizer that restarted (or already ended the request)
    would otherwise compute for nobody."""
    config = ClusterConfig(port_base=free_port_base())

    async def run():
        context, router = _stand_in_router(config)
        service = TokenizerService(config, tiny_model_dir)
        try:
            for _ in range(3):
                service._on_tokens(Tokens(request_id="orphan", token_ids=[9], worker_id="worker-0"))
            service._on_tokens(Tokens(request_id="ended", token_ids=[9], finished=True, worker_id="worker-0"))
            message, _ = decode((await asyncio.wait_for(router.recv_multipart(), 10))[1:])
            extra = await router.poll(500)
            return message, extra
        finally:
            service.close()
            context.destroy(linger=0)

    message, extra = asyncio.run(run())
    assert isinstance(message, Abort) and message.request_id == "orphan"
    assert not extra  # once, and nothing for a stream that had finished anyway


def test_when_the_router_is_lost_what_it_never_placed_fails_as_unavailable(tiny_model_dir):
    """A partition between tokenizer and router: requests sent into it hung until their own
    timeout; those the router acknowledged are on a worker and keep their streams."""
    config = ClusterConfig(port_base=free_port_base(), heartbeat_interval_s=0.1, worker_timeout_s=0.5)
    status = Status(policy="round_robin", workers=[], requests_routed=0, kv_events_received=0)

    async def run():
        context, router = _stand_in_router(config)
        service = TokenizerService(config, tiny_model_dir)
        answering = asyncio.Event()
        answering.set()
        answered = _answering_router(router, lambda: status if answering.is_set() else None)
        tasks = [asyncio.ensure_future(job) for job in (answered, service._router_loop(), service._status_loop())]
        try:
            while not service.router_reachable():
                await asyncio.sleep(0.02)
            placed = asyncio.ensure_future(anext(service.generate("placed", [5, 6], SamplingParams(), "")))
            unplaced = asyncio.ensure_future(anext(service.generate("unplaced", [5, 6], SamplingParams(), "")))
            await asyncio.sleep(0.3)
            answering.clear()  # the partition
            lost_at = time.monotonic()
            with pytest.raises(ServerUnavailable) as refused:
                await asyncio.wait_for(unplaced, 5)
            return time.monotonic() - lost_at, refused.value, placed.done()
        finally:
            for task in [*tasks, placed, unplaced]:
                task.cancel()
            await asyncio.gather(*tasks, placed, unplaced, return_exceptions=True)
            service.close()
            context.destroy(linger=0)

    elapsed, error, placed_ended = asyncio.run(run())
    assert elapsed < config.worker_timeout_s + 0.5 and error.retry_after_s > 0
    assert not placed_ended  # the placed request is on its worker: it waits for its tokens


def test_a_router_that_restarts_as_another_instance_fails_what_the_old_one_never_placed(tiny_model_dir):
    """A router killed and restarted within worker_timeout_s never goes unanswered that
    long: what was sent to the dead one fails when a status names another instance, at
    once, not at the request's own timeout; what was placed keeps its stream, and what
    is sent to the new instance is kept."""
    config = ClusterConfig(port_base=free_port_base(), heartbeat_interval_s=0.1, worker_timeout_s=30.0)
    instance = {"id": "old"}

    def status() -> Status:
        return Status(policy="round_robin", workers=[], requests_routed=0, kv_events_received=0,
                      instance_id=instance["id"])

    async def run():
        context, router = _stand_in_router(config)
        service = TokenizerService(config, tiny_model_dir)
        answered = _answering_router(router, status)
        tasks = [asyncio.ensure_future(job) for job in (answered, service._router_loop(), service._status_loop())]
        requests = []
        try:
            while not service.router_reachable():
                await asyncio.sleep(0.02)
            requests += [asyncio.ensure_future(anext(service.generate(request_id, [5, 6], SamplingParams(), "")))
                         for request_id in ("placed", "lost")]
            await asyncio.sleep(0.3)
            assert not any(request.done() for request in requests)  # a silent router: both wait
            instance["id"] = "new"  # the restart
            restarted_at = time.monotonic()
            with pytest.raises(ServerUnavailable) as refused:
                await asyncio.wait_for(requests[1], 5)
            elapsed = time.monotonic() - restarted_at
            requests.append(asyncio.ensure_future(anext(service.generate("after", [5, 6], SamplingParams(), ""))))
            await asyncio.sleep(0.3)  # three more statuses from the new instance
            return elapsed, refused.value, requests[0].done(), requests[2].done()
        finally:
            for task in [*tasks, *requests]:
                task.cancel()
            await asyncio.gather(*tasks, *requests, return_exceptions=True)
            service.close()
            context.destroy(linger=0)

    elapsed, error, placed_ended, after_ended = asyncio.run(run())
    assert elapsed < 2.0 and error.retry_after_s > 0
    assert not placed_ended and not after_ended  # on its worker / sent to the new instance: they wait


def test_the_final_chunk_carries_the_valid_timings_merged_over_the_stream(tiny_model_dir):
    """A disaggregated request's first tokens come from its prefill worker, its last from
    its decode worker, each with part of the split; what is not a known key with a finite,
    non-negative number is dropped (a worker's message is outside input), and the tokens
    and their text flow as they would without timings."""
    config = ClusterConfig(port_base=free_port_base())
    stream = [
        Tokens(request_id="", token_ids=[9], worker_id="prefill-0",
               timings={"queue_s": 0.01, "prefill_s": 0.02, "bogus_s": 1.0}),
        Tokens(request_id="", token_ids=[10], worker_id="decode-1"),
        Tokens(request_id="", token_ids=[11], finished=True, finish_reason="length", worker_id="decode-1",
               timings={"decode_wait_s": 0.003, "transfer_s": 4, "queue_s": math.nan, "prefill_s": -1.0,
                        "extra_s": math.inf}),
    ]
    chunks = asyncio.run(_streamed_through(config, tiny_model_dir, stream))
    assert [chunk.token_ids for chunk in chunks] == [[9], [10], [11]]
    assert [chunk.timings for chunk in chunks[:-1]] == [{}, {}]
    assert chunks[-1].finished and chunks[-1].timings == {"queue_s": 0.01, "prefill_s": 0.02,
                                                          "decode_wait_s": 0.003, "transfer_s": 4.0}


def test_a_stop_string_inside_a_message_of_several_steps_ends_the_output_at_its_token(tiny_model_dir):
    """A worker that held several steps sends their tokens as one item: where a stop
    string ends at one of them, the tokens after it are not output (nor counted)."""
    config = ClusterConfig(port_base=free_port_base())
    stream = [Tokens(request_id="", token_ids=[300, 301, 302, 400], worker_id="w",
                     logprobs=[record(300), record(301), record(302), record(400)])]
    # The tiny tokenizer reads 300, 301, 302, 400 as "9wg", "{}z", "KT", "zM".
    chunks = asyncio.run(_streamed_through(config, tiny_model_dir, stream, max_tokens=8, stop=["}z"]))
    assert [token for chunk in chunks for token in chunk.token_ids] == [300, 301]
    assert "".join(chunk.text for chunk in chunks) == "9wg{"
    assert chunks[-1].finished and chunks[-1].finish_reason == "stop"


@pytest.mark.parametrize("prefill_first", [True, False])
def test_a_token_sent_by_both_workers_of_a_handoff_is_delivered_once(tiny_model_dir, prefill_first):
    """The first token comes from the prefill worker and again, at position 0, from the
    decode worker; the two connections may deliver in either order."""
    config = ClusterConfig(port_base=free_port_base())
    from_prefill = [Tokens(request_id="", token_ids=[9], worker_id="prefill-0", position=0)]
    from_decode = [Tokens(request_id="", token_ids=[9, 10], worker_id="decode-1", position=0),
                   Tokens(request_id="", token_ids=[11], finished=True, finish_reason="length",
                          worker_id="decode-1")]
    stream = from_prefill + from_decode if prefill_first else from_decode + from_prefill
    chunks = asyncio.run(_streamed_through(config, tiny_model_dir, stream, max_tokens=3))
    assert [token for chunk in chunks for token in chunk.token_ids] == [9, 10, 11]
    assert chunks[-1].finished


def record(token_id: int) -> dict:
    return {"token_id": token_id, "logprob": -float(token_id), "top": [[token_id, -float(token_id)]]}


def test_prompt_logprobs_come_once_each_and_before_any_token(tiny_model_dir):
    """A disaggregated request: the decode worker's tokens arrive before the prefill
    worker's last prompt logprobs; they wait for them, and the first token, sent by both,
    comes once."""
    config = ClusterConfig(port_base=free_port_base())
    stream = [
        Tokens(request_id="", token_ids=[9, 10], worker_id="decode-1", position=0),
        Tokens(request_id="", token_ids=[], worker_id="prefill-0", prompt_logprobs=[None, record(6)]),
        Tokens(request_id="", token_ids=[9], worker_id="prefill-0", position=0, prompt_logprobs=[record(7)],
               prompt_logprobs_start=2),
        Tokens(request_id="", token_ids=[11], finished=True, finish_reason="length", worker_id="decode-1"),
    ]
    chunks = asyncio.run(_streamed_through(config, tiny_model_dir, stream, max_tokens=3, prompt_logprobs=1))
    first_token = next(index for index, chunk in enumerate(chunks) if chunk.token_ids)
    assert [r for chunk in chunks[:first_token] for r in chunk.prompt_logprobs] == [None, record(6), record(7)]
    assert not any(chunk.prompt_logprobs for chunk in chunks[first_token:])
    assert [token for chunk in chunks for token in chunk.token_ids] == [9, 10, 11]


def test_prompt_logprobs_sent_again_from_the_start_are_delivered_once(tiny_model_dir):
    """A worker that computes the prompt again (a retry elsewhere) sends its records from
    token 0: those the client has are dropped, by their position in the prompt."""
    config = ClusterConfig(port_base=free_port_base())
    stream = [
        Tokens(request_id="", token_ids=[], worker_id="worker-0", prompt_logprobs=[None, record(6)]),
        Tokens(request_id="", token_ids=[], worker_id="worker-1", prompt_logprobs=[None]),
        Tokens(request_id="", token_ids=[9], finished=True, finish_reason="length", worker_id="worker-1",
               prompt_logprobs=[record(6), record(7)], prompt_logprobs_start=1),
    ]
    chunks = asyncio.run(_streamed_through(config, tiny_model_dir, stream, max_tokens=1, prompt_logprobs=1))
    assert [r for chunk in chunks for r in chunk.prompt_logprobs] == [None, record(6), record(7)]
    assert [token for chunk in chunks for token in chunk.token_ids] == [9] and chunks[-1].finished


def test_a_request_served_by_one_worker_ends_with_no_timings(tiny_model_dir):
    config = ClusterConfig(port_base=free_port_base())
    stream = [Tokens(request_id="", token_ids=[9], worker_id="worker-0"),
              Tokens(request_id="", token_ids=[10], finished=True, finish_reason="length", worker_id="worker-0")]
    chunks = asyncio.run(_streamed_through(config, tiny_model_dir, stream))
    assert [chunk.token_ids for chunk in chunks] == [[9], [10]] and chunks[-1].timings == {}


async def _streamed_through(config: ClusterConfig, model_dir, stream: list[Tokens],
                            max_tokens: int | None = None, **sampling) -> list[StreamChunk]:
    """The chunks a real SDK client streams for one request when its worker pushes
    `stream` (request ids filled in) to the tokenizer's stream socket."""
    context, router = _stand_in_router(config)
    worker = context.socket(zmq.PUSH)
    worker.setsockopt(zmq.LINGER, 0)
    service = TokenizerService(config, model_dir)
    # As if the router had just answered a status request (the client asks for it first).
    service.last_status = Status(policy="round_robin", workers=[], requests_routed=0, kv_events_received=0)
    service.last_status_at = time.monotonic()
    loops = [asyncio.ensure_future(loop()) for loop in (service._sdk_loop, service._stream_loop)]
    client = AsyncClient(config.advertised(config.sdk), timeout_s=10)
    chunks: list[StreamChunk] = []

    async def read() -> None:
        async for chunk in client.stream(token_ids=[5, 6, 7], max_tokens=max_tokens or len(stream), **sampling):
            chunks.append(chunk)

    reading = asyncio.ensure_future(read())
    try:
        generate, _ = decode((await asyncio.wait_for(router.recv_multipart(), 10))[1:])
        assert isinstance(generate, Generate)
        worker.connect(generate.stream_address)
        items = [msgspec.structs.replace(tokens, request_id=generate.request_id) for tokens in stream]
        await worker.send_multipart(encode(TokensBatch(items=items)))
        await asyncio.wait_for(reading, 10)
        return chunks
    finally:
        for task in [reading, *loops]:
            task.cancel()
        await asyncio.gather(reading, *loops, return_exceptions=True)
        await client.close()
        service.close()
        context.destroy(linger=0)


# ---- text prompts on the SDK socket: as over HTTP ------------------------------------------


def test_an_empty_text_prompt_is_tokenized_as_over_http(tiny_model_dir):
    """"" is served as the tokenizer encodes it (its BOS token here), as the HTTP gateway
    and vLLM do (test_http_gateway.py); only an empty token list is refused."""
    config = ClusterConfig(port_base=free_port_base())
    assert asyncio.run(_routed_prompt_ids(config, tiny_model_dir, "")) == [0]


def test_a_long_text_prompt_is_tokenized_on_the_pool_and_sent(tiny_model_dir):
    config = ClusterConfig(port_base=free_port_base())
    service = TokenizerService(config, tiny_model_dir)
    vocab = service.tokenizer.get_vocab()
    prompt = service.decode([vocab[max(vocab, key=len)]]) * 375  # past the inline size, fewer tokens
    expected = service.tokenizer.encode(prompt).ids
    service.close()
    assert len(prompt) > INLINE_PROMPT_CHARS and len(expected) < service.max_model_len
    assert asyncio.run(_routed_prompt_ids(config, tiny_model_dir, prompt)) == expected


def test_a_text_prompt_over_the_byte_limit_is_refused_naming_it(tiny_model_dir):
    config = ClusterConfig(port_base=free_port_base(), max_prompt_bytes=1000)
    with pytest.raises(InvalidRequest, match=r"^prompt: is 1001 bytes of UTF-8, over the limit of 1000 bytes "
                                             r"\(the server's max_prompt_bytes\)"):
        asyncio.run(_routed_prompt_ids(config, tiny_model_dir, "x" * 1001))


async def _routed_prompt_ids(config: ClusterConfig, model_dir, prompt: str) -> list[int]:
    """The prompt token ids of the Generate the tokenizer sends for an SDK client's text
    prompt (or the error the client gets)."""
    context, router = _stand_in_router(config)
    service = TokenizerService(config, model_dir)
    service.last_status = Status(policy="round_robin", workers=[], requests_routed=0, kv_events_received=0)
    service.last_status_at = time.monotonic()
    sdk_loop = asyncio.ensure_future(service._sdk_loop())
    client = AsyncClient(config.advertised(config.sdk), timeout_s=10)
    generating = asyncio.ensure_future(client.generate(prompt, max_tokens=1))
    receiving = asyncio.ensure_future(router.recv_multipart())
    try:
        await asyncio.wait({generating, receiving}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        if generating.done():
            generating.result()  # the client's error
        generate, payloads = decode((await asyncio.wait_for(receiving, 10))[1:])
        assert isinstance(generate, Generate)
        return payloads[0].tolist()
    finally:
        for task in (generating, receiving, sdk_loop):
            task.cancel()
        await asyncio.gather(generating, receiving, sdk_loop, return_exceptions=True)
        await client.close()
        service.close()
        context.destroy(linger=0)
