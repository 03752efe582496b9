"""Faults between hosts: each role in its own network namespace (see hosts.py).

Every case counts what it sent and how each request ended: served, a typed error (by
type), or lost (no result and no typed error within its bound; must be 0), and how long
the cluster took to notice and to recover. The figures are printed (`-s`) and listed in
the run's summary.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
import zmq

from common.protocol import PROTOCOL_VERSION, Generate, Hello, Sampling, encode
from services.client import BatonError, Client, ServerUnavailable, WorkerLost
from services.client._shared import connect_dealer
from tests.services.netns.hosts import PORT_BASE, wait_for

AT_ONCE_S = 0.5  # "at once": a refusal this quick is not a timeout in disguise
# A healed link carries traffic again at TCP's next retransmission, which backs off
# exponentially during the outage (doubling from 0.2 s: the next one comes at most about
# as long after the heal as the outage lasted).
REJOIN_BOUND_S = 15.0


@dataclass
class Outcome:
    kind: str  # "served", a typed error's class name, or "lost"
    sent_at: float
    ended_at: float
    ttft_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    late_kind: str | None = None  # for a lost request: how it ended after its bound, if it did


async def request(client, prompt: str, bound_s: float, grace_s: float = 0.0, **sampling) -> Outcome:
    """One generate call; "lost" if it neither returns nor raises a typed error in `bound_s`.
    A lost request is watched `grace_s` longer to report how it ended anyway."""
    sent = time.monotonic()
    call = asyncio.ensure_future(client.generate(prompt, temperature=0, **sampling))
    done, _ = await asyncio.wait({call}, timeout=bound_s)
    late = not done
    if late and grace_s > 0:
        done, _ = await asyncio.wait({call}, timeout=grace_s)
    ended = time.monotonic()
    if not done:
        call.cancel()
        return Outcome("lost", sent, ended, late_kind="no end" if grace_s > 0 else None)
    try:
        result = call.result()
    except BatonError as error:
        kind, ttft = type(error).__name__, None
    else:
        kind = "served" if result.finish_reason and result.token_ids else "empty result"
        ttft = result.ttft_s
    if late:
        return Outcome("lost", sent, ended, late_kind=f"{kind} after {ended - sent:.1f} s")
    return Outcome(kind, sent, ended, ttft)


async def stream(client, prompt: str, bound_s: float, started: asyncio.Event, max_tokens: int) -> Outcome:
    """A long stream, noting when each chunk came; `started` is set after a few tokens."""
    outcome = Outcome("lost", time.monotonic(), 0.0)

    async def consume() -> None:
        count = 0
        async for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
            outcome.token_times.append(time.monotonic())
            count += len(chunk.token_ids)
            if count >= 3:
                started.set()
        outcome.kind = "served" if count == max_tokens else f"short stream ({count})"

    try:
        await asyncio.wait_for(consume(), bound_s)
    except BatonError as error:
        outcome.kind = type(error).__name__
    except TimeoutError:
        outcome.kind = "lost"
    outcome.ended_at = time.monotonic()
    started.set()
    return outcome


def tally(outcomes: list[Outcome]) -> dict:
    kinds = Counter(o.kind for o in outcomes)
    figures = {"sent": len(outcomes), "served": kinds.pop("served", 0), "lost": kinds.pop("lost", 0),
               "typed_errors": dict(kinds)}
    late = Counter(o.late_kind.split(" after ")[0] for o in outcomes if o.late_kind)
    if late:
        figures["lost_then"] = dict(late)  # what the lost requests became after their bound
    return figures


def typed_only(figures: dict) -> bool:
    """Every error is one of the SDK's typed errors (not an empty or short result)."""
    return all(kind.endswith(("Unavailable", "Lost", "Timeout", "Rejected")) for kind in figures["typed_errors"])


def longest_gap(times: list[float]) -> float:
    return max(later - earlier for earlier, later in zip(times, times[1:]))


def worker_requests_ended(cluster, index: int) -> float:
    """The worker's own count of requests it ended (any outcome), from its /metrics."""
    import urllib.request

    address = f"http://{cluster.net.address(f'worker-{index}')}:{PORT_BASE + 11 + 2 * index}/metrics"
    with urllib.request.urlopen(address, timeout=2) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("baton_worker_requests_total{"))


# ---- a worker's cable is pulled, then plugged back in ------------------------------------

# The cable stays out past detection and every failover; then for longer than a worker's
# wait for the router's welcome (10 s), with TCP's retransmissions backed off further.
@pytest.mark.parametrize("outage_s", [3.5, 12.0], ids=["3.5s-outage", "12s-outage"])
def test_cut_worker_link_fails_over_within_the_timeout_and_the_worker_rejoins(netns_cluster, figures, outage_s):
    cluster = netns_cluster
    cluster.settle()
    bound = cluster.worker_timeout_s + 1.0

    async def healthy(client) -> set[str] | None:
        try:
            return {w.worker_id for w in (await client.status(timeout_s=1)).workers if w.healthy}
        except BatonError:
            return None

    async def run():
        async with cluster.client(timeout_s=60) as client:
            await client.status()
            started = [asyncio.Event() for _ in range(4)]  # round robin: two on each worker
            streams = [asyncio.create_task(stream(client, f"long stream {i}", 60, started[i], 900))
                       for i in range(4)]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 30)
            assert not any(task.done() for task in streams), "streams ended before the cut"
            cut_at = time.monotonic()
            cluster.net.cut("worker-0")
            # New requests while the router still counts worker-0 in: those placed there
            # must be re-placed (nothing streamed yet) or fail typed, not wait for the heal.
            fresh = []
            for i in range(6):
                fresh.append(asyncio.create_task(request(client, f"during the cut {i}", bound + 10, max_tokens=8)))
                await asyncio.sleep(0.1)
            detected_at = None
            while detected_at is None and time.monotonic() < cut_at + outage_s:
                workers = await healthy(client)
                if workers is not None and "worker-0" not in workers:
                    detected_at = time.monotonic()
                await asyncio.sleep(0.05)
            await asyncio.sleep(max(0.0, cut_at + outage_s - time.monotonic()))
            heal_at = time.monotonic()
            cluster.net.heal("worker-0")
            rejoined_at = None
            while rejoined_at is None and time.monotonic() < heal_at + REJOIN_BOUND_S:
                if "worker-0" in (await healthy(client) or set()):
                    rejoined_at = time.monotonic()
                await asyncio.sleep(0.1)
            fresh_outcomes = await asyncio.gather(*fresh)
            stream_outcomes = await asyncio.gather(*streams)
            return cut_at, detected_at, heal_at, rejoined_at, stream_outcomes, fresh_outcomes

    cut_at, detected_at, heal_at, rejoined_at, stream_outcomes, fresh_outcomes = asyncio.run(run())
    # The longest each in-flight stream went without news after the cut (a token or its end).
    silences = [longest_gap([cut_at, *(t for t in o.token_times if t > cut_at), o.ended_at]) for o in stream_outcomes]
    lost_streams = [o for o in stream_outcomes if o.kind == WorkerLost.__name__]
    after = serve_on_both_workers(cluster) if rejoined_at is not None else None
    everything = tally(stream_outcomes + fresh_outcomes + (after or []))
    figures(**everything, in_flight_streams=tally(stream_outcomes), during_cut=tally(fresh_outcomes),
            after_rejoin=tally(after) if after is not None else None,
            worker_lost_after_s=[round(o.ended_at - cut_at, 2) for o in lost_streams],
            longest_silence_s=round(max(silences), 2),
            detect_s=round(detected_at - cut_at, 2) if detected_at else None, outage_s=round(heal_at - cut_at, 2),
            rejoin_s=round(rejoined_at - heal_at, 2) if rejoined_at else None)
    assert everything["lost"] == 0, everything
    assert typed_only(everything), everything
    assert detected_at is not None and detected_at - cut_at <= bound, "the router did not drop worker-0 in time"
    assert lost_streams, "no stream was on the cut worker"
    assert max(silences) <= bound, f"in-flight streams silent past {bound} s: {silences}"
    assert all(o.ended_at - cut_at <= bound for o in lost_streams)
    assert all(o.kind == "served" for o in fresh_outcomes), "requests sent during the cut were not re-placed"
    cluster.check_alive()
    assert rejoined_at is not None, f"worker-0 did not rejoin within {REJOIN_BOUND_S} s of the heal"
    assert after is not None and all(o.kind == "served" for o in after)


def test_a_blip_shorter_than_the_timeout_fails_nothing(netns_cluster, figures):
    """Worker-0's cable out for 0.5 s: TCP retransmits once the link is back, well inside
    worker_timeout_s, so no stream may fail and the router must not drop the worker."""
    cluster = netns_cluster
    cluster.settle()
    blip_s = 0.5

    async def run():
        async with cluster.client(timeout_s=60) as client:
            await client.status()
            started = [asyncio.Event() for _ in range(4)]  # round robin: two on each worker
            streams = [asyncio.create_task(stream(client, f"blip stream {i}", 30, started[i], 400))
                       for i in range(4)]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 30)
            cut_at = time.monotonic()
            cluster.net.cut("worker-0")
            await asyncio.sleep(blip_s)
            cluster.net.heal("worker-0")
            dropped = False
            while not all(task.done() for task in streams):
                try:
                    workers = {w.worker_id for w in (await client.status(timeout_s=1)).workers if w.healthy}
                    dropped = dropped or "worker-0" not in workers
                except BatonError:
                    pass
                await asyncio.sleep(0.1)
            return cut_at, dropped, await asyncio.gather(*streams)

    cut_at, dropped, outcomes = asyncio.run(run())
    silences = [longest_gap([cut_at, *(t for t in o.token_times if t > cut_at), o.ended_at]) for o in outcomes]
    counts = tally(outcomes)
    figures(**counts, blip_s=blip_s, longest_silence_s=round(max(silences), 2), router_dropped_worker0=dropped)
    assert counts["served"] == counts["sent"], counts
    assert not dropped, "the router dropped worker-0 over a 0.5 s blip"


def serve_on_both_workers(cluster) -> list[Outcome]:
    """Six requests after the rejoin, all served, and worker-0 among the servers."""
    wait_for(lambda: cluster.worker_health(0)["running"] + cluster.worker_health(0)["waiting"] == 0, 10,
             "worker-0 to be idle")
    ended_before = worker_requests_ended(cluster, 0)

    async def run():
        async with cluster.client(timeout_s=60) as client:
            return await asyncio.gather(*[request(client, f"after the heal {i}", 20, max_tokens=16)
                                          for i in range(6)])

    outcomes = asyncio.run(run())
    served_by_worker0 = worker_requests_ended(cluster, 0) - ended_before
    assert served_by_worker0 >= 1, "the rejoined worker-0 was given no request"
    return outcomes


# ---- 100 ms each way and 5 % loss between the tokenizer and the router --------------------

def test_latency_and_loss_between_tokenizer_and_router(netns_cluster, figures):
    cluster = netns_cluster
    cluster.settle()
    delay_s = 0.1

    async def sequential(client, label: str, count: int) -> list[Outcome]:
        return [await request(client, f"{label} {i}", 10, max_tokens=4) for i in range(count)]

    async def run():
        async with cluster.client(timeout_s=30) as client:
            await client.status()
            baseline = await sequential(client, "near", 10)
            cluster.relay.set(delay_s=delay_s, loss=0.05, rto_s=0.2)
            before = cluster.relay.stats()
            try:
                await asyncio.sleep(0.5)
                slow = await sequential(client, "far", 20)
                burst = await asyncio.gather(*[request(client, f"far burst {i}", 15, max_tokens=8)
                                               for i in range(10)])
            finally:
                cluster.relay.set()
            after = cluster.relay.stats()
            return baseline, slow, list(burst), before, after

    baseline, slow, burst, before, after = asyncio.run(run())
    near = statistics.median(o.ttft_s for o in baseline if o.ttft_s is not None)
    far = statistics.median(o.ttft_s for o in slow if o.ttft_s is not None)
    everything = tally(baseline + slow + burst)
    figures(**everything, ttft_median_s={"no delay": round(near, 3), "100 ms + 5 % loss": round(far, 3)},
            ttft_growth_s=round(far - near, 3),
            relay={"chunks": after.chunks - before.chunks,
                   "lost_chunks_retransmitted": after.lost_chunks - before.lost_chunks})
    assert everything["lost"] == 0 and everything["served"] == everything["sent"], everything
    # The request crosses the slow link once before its first token (tokenizer -> router).
    assert 0.8 * delay_s <= far - near <= 3.5 * delay_s, (near, far)


# ---- the tokenizer cannot reach the router -----------------------------------------------

def test_tokenizer_partitioned_from_router_refuses_at_once(netns_cluster, figures):
    cluster = netns_cluster
    cluster.settle()
    detect_bound = cluster.worker_timeout_s + 1.0

    async def probe(client, i: int, cut_at: float) -> Outcome:
        sent = time.monotonic()
        deadline = max(sent + AT_ONCE_S, cut_at + detect_bound)
        return await request(client, f"partitioned {i}", deadline - sent, grace_s=10, max_tokens=4)

    async def run():
        # The SDK retries a refusal that names a retry_after_s within the caller's timeout;
        # the probes turn that off to see the cluster's own answers, one patient request keeps it.
        async with cluster.client(timeout_s=30, retry_unavailable=False) as client, \
                cluster.client(timeout_s=20) as patient_client:
            await client.status()
            await patient_client.generate("a client in use before the partition", max_tokens=2)
            started = [asyncio.Event() for _ in range(2)]
            in_flight = [asyncio.create_task(stream(client, f"before the partition {i}", 30, started[i], 400))
                         for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 30)
            cut_at = time.monotonic()
            cluster.relay.cut()
            probes, health_said_at, patient = [], None, None
            try:
                i = 0
                while time.monotonic() < cut_at + detect_bound + 1.0:
                    probes.append(asyncio.create_task(probe(client, i, cut_at)))
                    i += 1
                    if patient is None and time.monotonic() >= cut_at + detect_bound:
                        patient = asyncio.create_task(request(patient_client, "patient", 20, max_tokens=4))
                    if health_said_at is None:
                        health = await asyncio.to_thread(cluster.tokenizer_health)
                        if not health["router_reachable"]:
                            health_said_at = time.monotonic()
                    await asyncio.sleep(0.1)
            finally:
                heal_at = time.monotonic()
                cluster.relay.heal()
            recovered_at, recovery = None, []
            while time.monotonic() < heal_at + 15:
                outcome = await request(client, "after the partition", 5, max_tokens=4)
                recovery.append(outcome)
                if outcome.kind == "served":
                    recovered_at = outcome.ended_at
                    break
                await asyncio.sleep(0.1)
            probe_outcomes = await asyncio.gather(*probes)  # the lost ones are watched past the heal
            recovery.append(await patient)
            return (cut_at, heal_at, recovered_at, health_said_at, probe_outcomes, await asyncio.gather(*in_flight),
                    recovery)

    cut_at, heal_at, recovered_at, health_said_at, probes, in_flight, recovery = asyncio.run(run())
    refused = [o for o in probes if o.kind == ServerUnavailable.__name__]
    detected_at = min((o.ended_at for o in refused), default=None)
    after_detection = [o for o in probes if detected_at is not None and o.sent_at >= detected_at]
    everything = tally(probes + in_flight + recovery)
    figures(**everything, during_partition=tally(probes), in_flight_streams=tally(in_flight),
            detect_s=round(detected_at - cut_at, 2) if detected_at else None,
            health_says_unreachable_s=round(health_said_at - cut_at, 2) if health_said_at else None,
            slowest_refusal_after_detection_s=round(max((o.ended_at - o.sent_at for o in after_detection),
                                                        default=0.0), 3),
            recover_s=round(recovered_at - heal_at, 2) if recovered_at else None,
            sdk_retrying_request={"outcome": recovery[-1].kind,
                                  "sent_after_cut_s": round(recovery[-1].sent_at - cut_at, 2),
                                  "ended_after_heal_s": round(recovery[-1].ended_at - heal_at, 2)})
    assert everything["lost"] == 0, everything
    assert typed_only(everything), everything
    assert detected_at is not None and detected_at - cut_at <= detect_bound, "no ServerUnavailable in time"
    assert all(o.kind == ServerUnavailable.__name__ for o in probes), tally(probes)
    assert after_detection and all(o.ended_at - o.sent_at <= AT_ONCE_S for o in after_detection)
    assert recovered_at is not None, "not serving again within 15 s of the heal"
    assert recovery[-1].kind == "served", "a request the SDK retried through the partition was not served"


# ---- someone outside the cluster's keys ---------------------------------------------------

def test_outsider_cannot_register_or_submit(netns_cluster, figures):
    cluster = netns_cluster
    cluster.settle()
    routed_before = routed(cluster)
    attempts, answered, refusals = 0, [], Counter()
    for who, curve in cluster.keys.outsiders("tokenizer").items():
        attempts += 1
        with Client(cluster.sdk, curve=curve, connect_timeout_s=1.5, timeout_s=3, retry_unavailable=False) as client:
            try:
                client.generate("let me in", max_tokens=2)
                answered.append(f"{who}: served through the SDK")
            except BatonError as error:
                refusals[type(error).__name__] += 1
    for who, curve in cluster.keys.outsiders("router").items():
        for what, message in [("hello", impostor_hello()), ("generate", impostor_generate(cluster))]:
            attempts += 1
            reply = raw_exchange(cluster.router, curve, message)
            if reply is not None:
                answered.append(f"{who}: the router answered a {what}")
    routed_after = routed(cluster)
    workers = {w.worker_id for w in cluster.status().workers}
    # The same attempts with the cluster's keys do get answers: the checks above can fail.
    with Client(cluster.sdk, curve=cluster.keys.client(), timeout_s=20) as client:
        served = bool(client.generate("with the cluster's keys", max_tokens=2).token_ids)
    member_answered = raw_exchange(cluster.router, cluster.keys.member(), impostor_hello()) is not None
    figures(sent=attempts, served=len(answered), typed_errors=dict(refusals),
            lost=0, unanswered=attempts - len(answered) - sum(refusals.values()),
            registered=sorted(workers - {"worker-0", "worker-1"}), routed=routed_after - routed_before,
            control_with_cluster_keys={"sdk": "served" if served else "refused",
                                       "router hello": "answered" if member_answered else "unanswered"})
    assert not answered, answered
    assert refusals == {ServerUnavailable.__name__: len(cluster.keys.outsiders("tokenizer"))}, refusals
    assert workers == {"worker-0", "worker-1"}, workers
    assert routed_after == routed_before
    assert served and member_answered
    wait_for(lambda: routed(cluster) > routed_after, 5, "the control request to be counted")


def routed(cluster) -> float:
    """Requests the router handled, by any outcome, from its own /metrics (the status the
    tokenizer relays can be a heartbeat old)."""
    import urllib.request

    address = f"http://{cluster.net.address('router')}:{PORT_BASE + 3}/metrics"
    with urllib.request.urlopen(address, timeout=2) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("baton_router_requests_total{"))


def impostor_hello() -> list[bytes]:
    return encode(Hello(protocol_version=PROTOCOL_VERSION, worker_id="worker-9", role="worker",
                        model_fingerprint="", tokenizer_fingerprint="", kv_blocks=1000, block_size=16,
                        max_model_len=1024, events_address="tcp://10.0.0.1:1", metrics_address=""))


def impostor_generate(cluster) -> list[bytes]:
    return encode(Generate(request_id="outsider-1", sampling=Sampling(max_tokens=2),
                           stream_address=f"tcp://{cluster.net.client_address}:1"), [[5, 6, 7]])


def raw_exchange(address: str, curve: dict | None, frames: list[bytes], wait_s: float = 1.5):
    """Send `frames` on a DEALER presenting `curve` (or nothing); the reply, or None."""
    context = zmq.Context()
    socket = connect_dealer(context, address, curve)
    try:
        socket.send_multipart(frames)
        return socket.recv_multipart() if socket.poll(int(wait_s * 1000)) else None
    except zmq.Again:  # a refused key's connection is dropped: the send found none to queue on
        return None
    finally:
        socket.close(0)
        context.term()
