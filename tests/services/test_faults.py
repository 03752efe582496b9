"""Faults on a real cluster: dead and hung workers, departing clients, bad frames, overload."""
import asyncio
import json
import os
import signal
import time
import urllib.request

import msgspec
import pytest
import zmq

from common.protocol import (
    PROTOCOL_VERSION,
    Error,
    Generate,
    Hello,
    Sampling,
    Status,
    StatusRequest,
    Welcome,
    decode,
    encode,
)
from services.client import AsyncClient, Client, Rejected, ServerUnavailable, WorkerLost


def stream_until_error(client: AsyncClient, prompt: str, started: asyncio.Event, max_tokens: int):
    async def run():
        tokens, error = [], None
        try:
            async for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
                tokens.extend(chunk.token_ids)
                if len(tokens) >= 3:
                    started.set()
        except WorkerLost as lost:
            error = (lost, time.monotonic())
        return tokens, error

    return run()


def test_killed_worker_fails_its_streams_fast_and_is_restarted(cluster):
    victim = cluster.worker_health(0)["pid"]

    async def run():
        async with AsyncClient(cluster.sdk, timeout_s=120) as client:
            started = [asyncio.Event(), asyncio.Event()]
            tasks = [asyncio.create_task(stream_until_error(client, f"long stream {i}", started[i], 600))
                     for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            killed_at = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            return killed_at, await asyncio.gather(*tasks)

    killed_at, outcomes = asyncio.run(run())
    failed = [error for _, error in outcomes if error is not None]
    finished = [tokens for tokens, error in outcomes if error is None]
    assert len(failed) == 1 and len(finished) == 1, outcomes
    assert failed[0][1] - killed_at < 5.0
    assert len(finished[0]) == 600
    restarted = cluster.wait_for(lambda: cluster.worker_health(0)["pid"] != victim, 90, "worker-0 restart")
    assert restarted
    with Client(cluster.sdk, timeout_s=60) as client:
        cluster.wait_for(lambda: len(client.status().workers) == 2, 30, "two workers registered")
        assert client.generate("after the restart", max_tokens=4).finish_reason is not None


def test_hung_worker_requests_move_elsewhere_and_it_rejoins(cluster):
    pid = cluster.worker_health(1)["pid"]

    async def run():
        async with AsyncClient(cluster.sdk, timeout_s=60) as client:
            await client.status()
            os.kill(pid, signal.SIGSTOP)
            try:
                # Round robin puts one of these on the hung worker; nothing streamed there, so
                # the tokenizer re-places it when the router gives the worker up.
                return await asyncio.gather(*[client.generate(f"hung {i}", max_tokens=5, temperature=0)
                                              for i in range(2)])
            finally:
                os.kill(pid, signal.SIGCONT)

    results = asyncio.run(run())
    assert all(r.finish_reason is not None and r.token_ids for r in results)
    with Client(cluster.sdk, timeout_s=30) as client:
        cluster.wait_for(lambda: len(client.status().workers) == 2, 30, "the hung worker to rejoin")
    # Whatever reached the hung worker was failed over; on waking it drops it, not serves it.
    cluster.wait_for(lambda: cluster.worker_health(1)["running"] == 0, 10, "the stale request to be dropped")


def kv_in_use(cluster) -> int:
    return sum(cluster.worker_health(i)["kv_blocks_used"] for i in range(cluster.workers))


def test_client_that_stops_reading_frees_its_kv(cluster):
    async def run():
        async with AsyncClient(cluster.sdk, timeout_s=60) as client:
            stream = client.stream("walk away", max_tokens=800, temperature=0, ignore_eos=True)
            async for _chunk in stream:
                if kv_in_use(cluster) > 0:
                    break
            await stream.aclose()

    asyncio.run(run())
    cluster.wait_for(lambda: kv_in_use(cluster) == 0, 10, "KV blocks to be freed")


def test_dropped_sync_client_frees_its_kv(cluster):
    client = Client(cluster.sdk, timeout_s=60)
    for _ in client.stream("dropped", max_tokens=800, temperature=0, ignore_eos=True):
        if kv_in_use(cluster) > 0:
            break
    client.close()
    cluster.wait_for(lambda: kv_in_use(cluster) == 0, 10, "KV blocks to be freed")


def raw_dealer(address: str) -> tuple[zmq.Context, zmq.Socket]:
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    return context, socket


def answer(socket: zmq.Socket, timeout_s: float = 5.0):
    assert socket.poll(int(timeout_s * 1000)), "no answer"
    return decode(socket.recv_multipart())[0]


@pytest.mark.parametrize("frames", [
    [b"\x00", b""],
    [b"\xff", b"\x80"],
    [b"\x0b", b"not msgpack at all"],
    [b"\x0b", msgspec.msgpack.encode({"request_id": 5})],
    [b"\x0b", msgspec.msgpack.encode({"request_id": "x", "sampling": {"max_tokens": "many"}})],
    [b"too", b"long", b"type"],
    [b"\x01"],
])
def test_malformed_frames_get_errors_and_the_services_carry_on(cluster, frames):
    for address in (cluster.sdk, cluster.router):
        context, socket = raw_dealer(address)
        try:
            socket.send_multipart(frames)
            reply = answer(socket) if len(frames) > 1 else None
            if reply is not None:
                assert isinstance(reply, Error) and reply.message
        finally:
            socket.close(0)
            context.term()
    with Client(cluster.sdk, timeout_s=30) as client:
        assert client.generate("still serving", max_tokens=2).token_ids


def test_fuzzed_frames_do_not_kill_anything(cluster):
    import random

    rng = random.Random(7)
    context, socket = raw_dealer(cluster.sdk)
    try:
        for _ in range(200):
            socket.send_multipart([bytes([rng.randrange(1, 16)])] +
                                  [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(0, 4))])
        socket.send_multipart(encode(StatusRequest()))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if isinstance(answer(socket), Status):
                break
        else:
            raise AssertionError("no status after the fuzzing")
    finally:
        socket.close(0)
        context.term()


def test_router_refuses_mismatched_workers_naming_both_sides(cluster):
    context, socket = raw_dealer(cluster.router)
    try:
        hello = dict(worker_id="impostor", role="worker", tokenizer_fingerprint="t", kv_blocks=10, block_size=16,
                     max_model_len=1024, events_address="tcp://127.0.0.1:1", metrics_address="")
        socket.send_multipart(encode(Hello(protocol_version=99, model_fingerprint="m", **hello)))
        refusal = answer(socket)
        assert isinstance(refusal, Welcome) and not refusal.accepted
        assert "99" in refusal.reason and str(PROTOCOL_VERSION) in refusal.reason
        socket.send_multipart(encode(Hello(protocol_version=PROTOCOL_VERSION, model_fingerprint="other-model",
                                           **hello)))
        refusal = answer(socket)
        assert not refusal.accepted and "other-model" in refusal.reason and "cluster serves" in refusal.reason
    finally:
        socket.close(0)
        context.term()


def test_full_queues_refuse_at_once_with_retry_after(make_cluster):
    small = make_cluster(workers=1, extra=["--max-num-seqs", "1", "--max-queued-requests", "1"])
    try:
        async def run():
            async with AsyncClient(small.sdk, timeout_s=60) as client:
                await client.status()

                async def one(i):
                    started = time.monotonic()
                    try:
                        await client.generate(f"flood {i}", max_tokens=200, temperature=0, ignore_eos=True)
                        return "done", time.monotonic() - started
                    except Rejected as rejected:
                        assert rejected.retry_after_s > 0
                        return "rejected", time.monotonic() - started

                return await asyncio.gather(*[one(i) for i in range(6)])

        outcomes = asyncio.run(run())
        rejected = [t for kind, t in outcomes if kind == "rejected"]
        assert rejected and any(kind == "done" for kind, _ in outcomes)
        assert max(rejected) < 1.0
    finally:
        small.stop()


def test_a_router_killed_during_100_streams_loses_none_of_them(cluster):
    """Tokens go from workers to the tokenizer directly; the restarted router takes the
    running requests back from the workers, which rejoin with them and their caches."""
    router_pid = cluster.router_health()["pid"]
    streams, max_tokens = 100, 120

    async def run():
        async with AsyncClient(cluster.sdk, timeout_s=240) as client:
            started = [asyncio.Event() for _ in range(streams)]

            async def one(i):
                count = 0
                async for chunk in client.stream(f"survive {i}", max_tokens=max_tokens, temperature=0,
                                                 ignore_eos=True):
                    count += len(chunk.token_ids)
                    if count >= 2:
                        started[i].set()
                return count

            tasks = [asyncio.create_task(one(i)) for i in range(streams)]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 120)
            os.kill(router_pid, signal.SIGKILL)
            killed_at = time.monotonic()
            # A request sent during the outage reaches the restarted router (ZeroMQ holds it
            # meanwhile) either before the workers rejoin it (ServerUnavailable with a
            # retry-after, at once) or after (served): workers rejoin as soon as the new router
            # answers any message of theirs, which can beat the tokenizer's request. Either
            # way it ends within its 30 s; it neither hangs nor fails otherwise.
            async with AsyncClient(cluster.sdk, timeout_s=30, retry_unavailable=False) as impatient:
                try:
                    during = len((await impatient.generate("during the outage", max_tokens=2)).token_ids)
                    assert during == 2
                except ServerUnavailable as refused:
                    assert refused.retry_after_s > 0
            assert time.monotonic() - killed_at < 30
            retried = await client.generate("retried by the SDK", max_tokens=2)  # waits out the restart
            return await asyncio.gather(*tasks, return_exceptions=True), retried

    counts, retried = asyncio.run(run())
    assert counts == [max_tokens] * streams, [c for c in counts if c != max_tokens][:5]
    assert retried.token_ids
    assert cluster.router_health()["pid"] != router_pid
    with Client(cluster.sdk, timeout_s=30) as client:
        # Tokens never pass the router, so a worker may finish its streams before it rejoins
        # (or, on a loaded machine, miss a heartbeat and join again): wait for both.
        cluster.wait_for(lambda: sorted(w.worker_id for w in client.status().workers) == ["worker-0", "worker-1"],
                         10, "both workers to rejoin the restarted router")
        assert client.status().kv_events_received > 0  # the workers reported their caches again
        # The resumed requests' placements end as the workers report them finished.
        cluster.wait_for(lambda: all(w.in_flight == 0 for w in client.status().workers), 10,
                         "the resumed requests to end on the router")


def test_health_is_not_ok_while_no_worker_would_serve(make_cluster):
    lone = make_cluster(workers=1)
    try:
        assert lone.router_health()["ok"] and lone.worker_health(0)["ok"]
        pid = lone.worker_health(0)["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            lone.wait_for(lambda: not lone.router_health()["ok"], 10, "the router to report no worker")
        finally:
            os.kill(pid, signal.SIGCONT)
        lone.wait_for(lambda: lone.router_health()["ok"] and lone.worker_health(0)["joined"], 15,
                      "the worker to rejoin")
    finally:
        lone.stop()


def test_a_garbage_stream_address_is_refused_and_wedges_no_worker(cluster):
    """Such a Generate left worker-0 blocked for good in zmq_ctx_term; 503 ever after."""
    context, socket = raw_dealer(cluster.router)
    try:
        request = Generate(request_id="wedge-1", sampling=Sampling(max_tokens=2),
                           stream_address="garbage-not-an-endpoint")
        socket.send_multipart(encode(request, [[5, 6, 7]]))
        reply = answer(socket)
        assert isinstance(reply, Error) and reply.request_id == "wedge-1" and "stream_address" in reply.message
    finally:
        socket.close(0)
        context.term()
    assert all(cluster.worker_health(i)["ok"] for i in range(cluster.workers))
    with Client(cluster.sdk, timeout_s=30) as client:
        assert client.generate("not wedged", max_tokens=2).token_ids


def test_every_role_stops_promptly_mid_stream_and_is_restarted(make_cluster):
    """A role that must stop, stops: a socket left open once kept a worker in zmq_ctx_term
    for good, and the supervisor never restarted it."""
    lone = make_cluster(workers=1)
    try:
        with urllib.request.urlopen(f"{lone.http}/health", timeout=5) as response:
            pids = {"tokenizer": json.loads(response.read())["pid"], "router": lone.router_health()["pid"],
                    "worker": lone.worker_health(0)["pid"]}
        with Client(lone.sdk, timeout_s=60) as client:
            stream = client.stream("keep going", max_tokens=400, ignore_eos=True)
            next(stream)
            for role in ("worker", "router", "tokenizer"):
                os.kill(pids[role], signal.SIGTERM)
                deadline = time.monotonic() + 5.0
                while _alive(pids[role]) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert not _alive(pids[role]), f"{role} still running 5 s after SIGTERM"
            stream.close()
        lone.wait_for(lambda: lone.worker_health(0)["ok"] and lone.router_health()["ok"], 60, "the restarts")
        with Client(lone.sdk, timeout_s=60) as client:
            lone.wait_for(lambda: client.status().workers, 30, "the worker to register")
            assert client.generate("after the restarts", max_tokens=2).token_ids
    finally:
        lone.stop()


def _alive(pid: int) -> bool:
    """True while the process exists and is not a zombie awaiting its parent."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
