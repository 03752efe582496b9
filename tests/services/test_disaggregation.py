"""Prefill/decode disaggregation on real processes: `svc up --prefill 1 --decode 1` on
loopback, the KV moved over real UCX or ZeroMQ, driven through the SDK and compared with
the in-process engine (float32, greedy: token for token). Faults are real too: SIGKILLed
workers (the supervisor restarts them), pulls slowed by `--kv-send-pause-s` past their
deadline, aborts mid-pull, forged lease updates sent to the router by a test that poses
as a decode worker (CURVE is off), a `ucxx` that does not import.

Engines are numbered workers first, then prefill, then decode: here prefill-0 is engine 0
and decode-1 engine 1.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from common.errors import KvTransferFailed
from common.kv_transfer import ucx_available
from common.protocol import PROTOCOL_VERSION, Generate, Heartbeat, Hello, KvLeaseUpdate, Welcome, decode, encode
from common.sampling_params import SamplingParams
from services.client import AsyncClient, BatonError, Client, WorkerLost

PREFILL, DECODE = 0, 1
UCX_MISSING = ucx_available()
TRANSPORTS = ["zmq", pytest.param("ucx", marks=pytest.mark.skipif(
    UCX_MISSING is not None, reason=f"ucxx does not import: {UCX_MISSING}"))]
PD_FLAGS = ["--dtype", "float32"]
ALL_REMOTE = ["--max-local-prefill-tokens", "0"]  # every prefill runs on the prefill worker
GREEDY = {"temperature": 0, "ignore_eos": True}
RESTART_S = 90  # a SIGKILLed engine's restart: supervisor backoff plus loading the model


# ---- fixtures ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(make_engine):
    """The co-located reference: one in-process engine, float32."""
    return make_engine()


def start_pd(make_cluster, transport: str, *flags: str):
    """One prefill worker and one decode worker, float32; every prompt is prefilled on the
    prefill worker and its KV moved over `transport`."""
    return make_cluster(workers=0, prefill=1, decode=1, extra=[*PD_FLAGS, *ALL_REMOTE, "--kv-transport", transport,
                                                               *flags])


SLOW_PULLS = ["--kv-send-pause-s", "0.2", "--kv-transfer-timeout-s", "6"]  # 8+ pieces: 1.6 s or more


@pytest.fixture(scope="module", params=TRANSPORTS)
def pd(request, make_cluster):
    cluster = start_pd(make_cluster, request.param)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module", params=TRANSPORTS)
def slow(request, make_cluster):
    """Slow pulls that complete (0.2 s before each KV piece; a pull is at least 8 pieces:
    4 layers, K and V; 6 s deadline), leases of 2 s, and pools of 9 blocks, so that freed
    blocks are taken again soon."""
    cluster = start_pd(make_cluster, request.param, *SLOW_PULLS, "--kv-lease-ttl-s", "2",
                       "--kv-cache-gb", "0.0006", "--max-model-len", "128")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module", params=TRANSPORTS)
def hung(request, make_cluster):
    """Every pull outlives its deadline: 1 s before each of 8+ pieces, 2 s to pull."""
    cluster = start_pd(make_cluster, request.param, "--kv-send-pause-s", "1.0", "--kv-transfer-timeout-s", "2",
                       "--kv-lease-ttl-s", "2")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module", params=TRANSPORTS)
def parted(request, make_cluster):
    """Prefill chunks of 64 tokens (4 blocks) and a part at each chunk's end: a prompt of
    900 tokens is handed off in 14 parts while it is prefilled, then its whole lease."""
    cluster = start_pd(make_cluster, request.param, "--max-num-batched-tokens", "64", "--kv-part-blocks", "4")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def strict(make_cluster):
    """Slow pulls that complete, and a failed pull fails its request."""
    cluster = start_pd(make_cluster, "zmq", *SLOW_PULLS, "--kv-load-failure-policy", "fail")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def no_ucx(make_cluster, tmp_path_factory):
    """Default settings (`--kv-transport auto`, max_local_prefill_tokens 1000) where ucxx
    cannot import: a package of that name, first on the children's path, raises ImportError."""
    shadow = tmp_path_factory.mktemp("no_ucx")
    (shadow / "ucxx").mkdir()
    (shadow / "ucxx" / "__init__.py").write_text('raise ImportError("ucxx is hidden by the test")\n')
    path = os.pathsep.join(filter(None, [str(shadow), os.environ.get("PYTHONPATH")]))
    cluster = make_cluster(workers=0, prefill=1, decode=1, extra=PD_FLAGS, env={"PYTHONPATH": path})
    yield cluster
    cluster.stop()


# ---- helpers -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def queued(make_cluster):
    """Engines that run one request at a time and leases of 0.6 s: a request that waits on
    the decode worker for room longer than that keeps its KV only by renewing."""
    cluster = start_pd(make_cluster, "zmq", "--max-num-seqs", "1", "--kv-lease-ttl-s", "0.6")
    yield cluster
    cluster.stop()


def expected(engine, prompt: list[int] | str, max_tokens: int) -> list[int]:
    [result] = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, **GREEDY))
    return result.token_ids


def metric(cluster, index: int | None, name: str, **labels: str) -> float:
    """The sum of engine `index`'s (None: the router's) samples called `name` whose labels
    include `labels`."""
    port = cluster.port_base + (3 if index is None else 11 + 2 * index)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def leased(cluster) -> int:
    return cluster.worker_health(PREFILL)["kv_blocks_leased"]


def wait_leases_freed(cluster, timeout_s: float) -> None:
    cluster.wait_for(lambda: leased(cluster) == 0, timeout_s, "the prefill worker's leased blocks to be freed")


def wait_idle(cluster, timeout_s: float = 20) -> None:
    """Nothing leased, nothing referenced, nothing running on either engine."""
    def idle():
        prefill, decode = cluster.worker_health(PREFILL), cluster.worker_health(DECODE)
        return prefill["kv_blocks_leased"] == 0 and all(
            h["kv_blocks_used"] == 0 and h["running"] == 0 and h["waiting"] == 0 for h in (prefill, decode))

    cluster.wait_for(idle, timeout_s, "both engines to hold no KV and run nothing")


def kill(cluster, index: int) -> int:
    """SIGKILL engine `index` (a child of `svc up`, which restarts it); its pid."""
    pid = cluster.worker_health(index)["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def wait_restarted(cluster, index: int, old_pid: int) -> None:
    """The engine runs again as a new process and the router has both engines back."""
    cluster.wait_for(lambda: (h := cluster.worker_health(index))["pid"] != old_pid and h["ok"], RESTART_S,
                     f"engine {index} to be restarted and rejoin")
    with Client(cluster.sdk, timeout_s=30) as client:
        cluster.wait_for(lambda: len(client.status().workers) == 2, 30, "the router to list both engines")


def first_chunk_then(cluster, prompt: list[int], max_tokens: int, action) -> tuple[list[int], BatonError | None]:
    """Stream `prompt`; once the prefill worker's first token is out (its KV is exposed and
    the handle on its way), run `action()`; then read the rest. The tokens, and the typed
    error that ended the stream, if one did."""
    tokens: list[int] = []
    with Client(cluster.sdk, timeout_s=60) as client:
        stream = client.stream(token_ids=prompt, max_tokens=max_tokens, **GREEDY)
        try:
            tokens.extend(next(stream).token_ids)
            action()
            for chunk in stream:
                tokens.extend(chunk.token_ids)
        except BatonError as error:
            return tokens, error
    return tokens, None


def pull_in_flight(cluster, timeout_s: float = 10) -> None:
    """Wait until the decode worker has started its pull: it holds the import's blocks
    (taken just before the pull is sent)."""
    cluster.wait_for(lambda: cluster.worker_health(DECODE)["kv_blocks_used"] > 0, timeout_s,
                     "the decode worker to take blocks for the pull")


# ---- 1. outputs --------------------------------------------------------------------------

def test_greedy_outputs_equal_colocated_serving_and_a_shared_prefix_is_not_pulled(pd, engine, random_prompts):
    """Prompts prefilled on one process and decoded on another, the KV moved over the
    transport, give the in-process engine's tokens; a prompt sharing 4 full blocks with
    an earlier one pulls only its other 2 blocks (the decode worker holds the 4 by hash)."""
    base, other, tail = random_prompts([100, 70, 30], seed=101)
    shared = base[:64] + tail  # 94 tokens: 4 full blocks shared, 6 blocks in all
    pulled: dict[int, tuple[float, float]] = {}
    with Client(pd.sdk, timeout_s=60) as client:
        for prompt in (base, other, shared):
            before = (metric(pd, DECODE, "baton_kv_transfer_bytes_total"),
                      metric(pd, DECODE, "baton_kv_import_blocks_reused_total"))
            result = client.generate(token_ids=prompt, max_tokens=12, **GREEDY)
            assert result.token_ids == expected(engine, prompt, 12), len(prompt)
            assert result.num_prompt_tokens == len(prompt) and result.finish_reason == "length"
            pulled[len(prompt)] = (metric(pd, DECODE, "baton_kv_transfer_bytes_total") - before[0],
                                   metric(pd, DECODE, "baton_kv_import_blocks_reused_total") - before[1])
    block_bytes = pulled[100][0] / 7  # 100 tokens: 7 blocks, all pulled
    assert block_bytes > 0 and pulled[100][1] == 0 and pulled[70] == (5 * block_bytes, 0)
    assert pulled[94] == (2 * block_bytes, 4)
    pd.wait_for(lambda: metric(pd, PREFILL, "baton_kv_exposures_total", outcome="done") >= 3, 10,
                "the prefill worker to see its three exposures pulled")
    wait_idle(pd)


def test_a_long_prompt_moves_in_parts_while_it_is_prefilled_each_block_once(parted, engine, random_prompts):
    """A prompt longer than a prefill chunk is handed off in parts (docs/disaggregation.md §2.1):
    the decode worker gets the request at the first part and pulls parts while the
    prefill goes on, then only what the parts did not bring from the whole lease. Greedy
    tokens equal the in-process engine's; every block moves exactly once; every part's
    lease ends on the prefill worker."""
    short, long = random_prompts([48, 900], seed=131)
    with Client(parted.sdk, timeout_s=60) as client:
        result = client.generate(token_ids=short, max_tokens=4, **GREEDY)  # one chunk: no part
        assert result.token_ids == expected(engine, short, 4)
        block_bytes = metric(parted, DECODE, "baton_kv_transfer_bytes_total") / 3
        assert block_bytes > 0 and metric(parted, DECODE, "baton_kv_part_blocks_total") == 0
        result = client.generate(token_ids=long, max_tokens=12, **GREEDY)
        assert result.token_ids == expected(engine, long, 12)
    moved = metric(parted, DECODE, "baton_kv_transfer_bytes_total") / block_bytes - 3
    assert moved == -(-len(long) // 16)  # 57 blocks, each once
    assert 0 < metric(parted, DECODE, "baton_kv_part_blocks_total") < moved
    parted.wait_for(lambda: metric(parted, PREFILL, "baton_kv_part_exposures_total") == 900 // 64, 10,
                    "every part's lease to end on the prefill worker")
    assert metric(parted, PREFILL, "baton_kv_exposures_total", outcome="done") == 2
    wait_idle(parted)


def test_a_prompt_whose_first_token_ends_it_stops_the_import_of_its_parts(parted, engine, random_prompts):
    """max_tokens = 1 on a prompt longer than a chunk: its parts went to a decode worker
    while it was prefilled, then its first token ended it on the prefill worker. The router
    aborts the import; the client has the one token, and both engines let every block go."""
    [prompt] = random_prompts([900], seed=132)
    requests = metric(parted, DECODE, "baton_worker_requests_total", outcome="aborted")
    with Client(parted.sdk, timeout_s=60) as client:
        result = client.generate(token_ids=prompt, max_tokens=1, **GREEDY)
    assert result.token_ids == expected(engine, prompt, 1) and result.finish_reason == "length"
    parted.wait_for(lambda: metric(parted, DECODE, "baton_worker_requests_total", outcome="aborted") == requests + 1,
                    10, "the decode worker to abort the import")
    wait_idle(parted)


def test_prompt_logprobs_come_from_the_prefill_worker_once_each(pd, engine, random_prompts):
    """The prefill worker computes the prompt logprobs (in chunks of its token budget) and
    streams them before the first token; the decode worker computes none."""
    prompt = random_prompts([140], seed=102)[0]
    params = SamplingParams(max_tokens=6, prompt_logprobs=2, **GREEDY)
    [reference] = engine.generate([prompt], params)
    with Client(pd.sdk, timeout_s=60) as client:
        result = client.generate(token_ids=prompt, max_tokens=6, prompt_logprobs=2, **GREEDY)
    assert result.token_ids == reference.token_ids
    assert len(result.prompt_logprobs) == len(prompt) and result.prompt_logprobs[0] is None
    for got, want in zip(result.prompt_logprobs[1:], reference.prompt_logprobs[1:]):
        assert got["token_id"] == want["token_id"] and abs(got["logprob"] - want["logprob"]) < 1e-4
        assert [t for t, _ in got["top"]] == [t for t, _ in want["top"]]
    wait_idle(pd)


def test_200_concurrent_requests_are_all_answered_and_every_block_comes_back(pd, engine):
    """A burst of 200 disaggregated requests: each gets the engine's tokens, and afterwards
    no block is leased on the prefill worker or used on the decode worker."""
    prompts = [f"burst {i} of two hundred" for i in range(200)]
    want = [r.token_ids for r in engine.generate(prompts, SamplingParams(max_tokens=4, **GREEDY))]

    async def run():
        async with AsyncClient(pd.sdk, timeout_s=120) as client:
            return await asyncio.gather(*[client.generate(p, max_tokens=4, **GREEDY) for p in prompts])

    results = asyncio.run(asyncio.wait_for(run(), 180))
    assert [r.token_ids for r in results] == want
    assert all(r.finish_reason == "length" for r in results)
    wait_idle(pd, 30)
    pd.wait_for(lambda: metric(pd, PREFILL, "baton_kv_leased_blocks") == 0, 5,  # refreshed each heartbeat
                "the leased-blocks gauge to read 0")


# ---- 2 and 6. defaults: conditional disaggregation, UCX missing ----------------------------

def test_a_short_prompt_is_served_by_the_decode_worker_alone(no_ucx, engine):
    """Below max_local_prefill_tokens (1000 by default) nothing moves: the decode worker
    computes the prompt itself and the prefill worker never sees the request."""
    counters = [(PREFILL, "baton_worker_generated_tokens_total"), (PREFILL, "baton_kv_exposures_total"),
                (DECODE, "baton_worker_generated_tokens_total"), (DECODE, "baton_kv_transfer_bytes_total")]
    before = [metric(no_ucx, index, name) for index, name in counters]
    with Client(no_ucx.sdk, timeout_s=60) as client:
        result = client.generate("A short prompt stays on one worker", max_tokens=8, **GREEDY)
    assert result.token_ids == expected(engine, "A short prompt stays on one worker", 8)
    after = [metric(no_ucx, index, name) for index, name in counters]
    assert [a - b for a, b in zip(after, before)] == [0, 0, 8, 0]


def test_without_ucxx_auto_falls_back_to_zeromq_and_serves_the_same_tokens(no_ucx, engine, random_prompts):
    """`--kv-transport auto` where ucxx cannot import: both engines log the fallback, and a
    prompt over the 1000-token threshold is moved over ZeroMQ with the engine's tokens."""
    fallbacks = [json.loads(line) for line in no_ucx.lines if '"kv_transport_fallback"' in line]
    chosen = [json.loads(line) for line in no_ucx.lines if '"kv_transport_chosen"' in line]
    assert len(fallbacks) == 2 and all("ucxx" in f["reason"] and f["chosen"] == "zmq" for f in fallbacks)
    assert [c["chosen"] for c in chosen] == ["zmq", "zmq"]
    [prompt] = random_prompts([1010], seed=606)
    pulled_before = metric(no_ucx, DECODE, "baton_kv_transfer_bytes_total")
    with Client(no_ucx.sdk, timeout_s=60) as client:
        result = client.generate(token_ids=prompt, max_tokens=8, **GREEDY)
    assert result.token_ids == expected(engine, prompt, 8)
    assert metric(no_ucx, DECODE, "baton_kv_transfer_bytes_total") > pulled_before
    no_ucx.wait_for(lambda: metric(no_ucx, PREFILL, "baton_kv_exposures_total", outcome="done") == 1, 10,
                    "the prefill worker to see its exposure pulled")


# ---- 7. forged and stale lease updates -----------------------------------------------------

class FakeDecodeWorker:
    """The test posing as a decode worker on the router socket (CURVE off: the router takes
    a peer's word for its role, bound to the connection it joins on). It joins with a pool
    far larger than decode-1's, which wins pairing's ties (equal load); it heartbeats with
    its session, keeps the Generates (with their KV handles) it is sent, and pulls nothing."""

    def __init__(self, cluster, engine, worker_id: str):
        self.worker_id = worker_id
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(cluster.router)
        self.events = self.context.socket(zmq.PUB)  # the router subscribes to a worker's KV events
        self.events.setsockopt(zmq.LINGER, 0)
        port = self.events.bind_to_random_port("tcp://127.0.0.1")
        self.received: list[Generate] = []
        self.last_beat = 0.0
        config = engine.config
        self.send(Hello(protocol_version=PROTOCOL_VERSION, worker_id=worker_id, role="decode",
                        model_fingerprint=engine.model_fingerprint, tokenizer_fingerprint=engine.tokenizer_fingerprint,
                        kv_blocks=1_000_000, block_size=config.block_size, max_model_len=engine.max_model_len,
                        events_address=f"tcp://127.0.0.1:{port}", metrics_address="", instance_id=uuid.uuid4().hex,
                        kv_dtype=config.dtype, adapter_id=config.adapter_id))
        assert self.socket.poll(5000), "the router did not answer the Hello"
        welcome, _ = decode(self.socket.recv_multipart())
        assert isinstance(welcome, Welcome) and welcome.accepted, welcome
        self.session = welcome.session

    def send(self, message) -> None:
        self.socket.send_multipart(encode(message))

    def serve(self) -> None:
        """Heartbeat when due; keep any Generate that came."""
        if time.monotonic() - self.last_beat >= 0.2:
            self.send(Heartbeat(worker_id=self.worker_id, running=len(self.received), waiting=0,
                                kv_blocks_used=0, kv_blocks_cached=0, kv_blocks_total=1_000_000,
                                session=self.session))
            self.last_beat = time.monotonic()
        while self.socket.poll(0):
            message, _ = decode(self.socket.recv_multipart())
            if isinstance(message, Generate):
                self.received.append(message)

    def close(self) -> None:
        self.context.destroy(linger=0)


def serve_until(fakes: list[FakeDecodeWorker], done, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        for fake in fakes:
            fake.serve()
        time.sleep(0.02)


def release(request_id: str, lease_id: str) -> KvLeaseUpdate:
    return KvLeaseUpdate(request_id=request_id, lease_id=lease_id, prefill_worker_id="prefill-0", action="release")


def test_forged_and_stale_lease_releases_free_nothing(pd, engine, random_prompts):
    """Two handed-off requests hold leases on the prefill worker. A release naming one
    request with the other's lease, one naming an unknown lease, and a replay of a release
    already done are each refused and counted, and free no block; the genuine releases
    free exactly their own request's blocks; a release from a decode worker the request is
    not placed on is refused by the router itself. (Two fake decode workers: pairing sends
    each request to an idle one.)"""
    prompts = random_prompts([40, 70], seed=707)
    withdrawn = metric(pd, PREFILL, "baton_kv_exposures_total", outcome="withdrawn")

    def ask(prompt):
        with Client(pd.sdk, timeout_s=60) as client:
            return client.generate(token_ids=prompt, max_tokens=4, **GREEDY)

    fakes = [FakeDecodeWorker(pd, engine, "decode-8"), FakeDecodeWorker(pd, engine, "decode-9")]
    pool = ThreadPoolExecutor(2)
    outcomes = [pool.submit(ask, prompt) for prompt in prompts]
    try:
        serve_until(fakes, lambda: sum(len(f.received) for f in fakes) == 2, 30,
                    "both requests to reach the fake decode workers")
        a, b = sorted([g for f in fakes for g in f.received], key=lambda g: g.kv_handle.num_tokens)
        sender, other = fakes if a in fakes[0].received else fakes[::-1]  # a's decode worker, b's
        blocks_a, blocks_b = len(a.kv_handle.block_ids), len(b.kv_handle.block_ids)
        assert (blocks_a, blocks_b) == (3, 5) and leased(pd) == 8
        refused = metric(pd, PREFILL, "baton_kv_lease_updates_refused_total")

        def refused_now(expect: int, blocks: int, what: str) -> None:
            serve_until(fakes, lambda: metric(pd, PREFILL, "baton_kv_lease_updates_refused_total") ==
                        refused + expect, 10, what)
            assert leased(pd) == blocks, what

        router_refused = metric(pd, None, "baton_router_identity_refused_total", message="KvLeaseUpdate")
        other.send(release(a.request_id, a.kv_handle.lease_id))  # a's own lease, from b's decode worker
        serve_until(fakes, lambda: metric(pd, None, "baton_router_identity_refused_total",
                                          message="KvLeaseUpdate") == router_refused + 1, 10,
                    "the router to refuse a release from a decode worker a is not placed on")
        assert leased(pd) == 8
        sender.send(release(a.request_id, b.kv_handle.lease_id))  # b's lease under a's name
        refused_now(1, 8, "a release of another request's lease to be refused")
        sender.send(release(a.request_id, uuid.uuid4().hex))  # a lease that never was
        refused_now(2, 8, "a release of an unknown lease to be refused")
        sender.send(release(a.request_id, a.kv_handle.lease_id))  # genuine: a's 3 blocks
        serve_until(fakes, lambda: leased(pd) == 5, 10, "a's blocks to be freed")
        sender.send(release(a.request_id, a.kv_handle.lease_id))  # replayed: stale now
        refused_now(3, 5, "a replayed release to be refused")
        other.send(release(b.request_id, b.kv_handle.lease_id))
        serve_until(fakes, lambda: leased(pd) == 0, 10, "b's blocks to be freed")
        assert metric(pd, PREFILL, "baton_kv_exposures_total", outcome="withdrawn") == withdrawn + 2
    finally:
        for fake in fakes:
            fake.close()  # the router drops them once silent and fails what they held
        pool.shutdown(wait=False)
    for outcome in outcomes:  # each had its first token from the prefill worker: WorkerLost
        with pytest.raises(WorkerLost):
            outcome.result(timeout=30)
    with Client(pd.sdk, timeout_s=30) as client:
        pd.wait_for(lambda: sorted(w.worker_id for w in client.status().workers) == ["decode-1", "prefill-0"],
                    15, "the router to drop the fake decode workers")
    wait_idle(pd)


# ---- 8, 3 and 4. aborts and dead workers mid-pull ------------------------------------------
# Tests of one cluster run in the order written; those that kill the prefill worker come
# last (see test_pulls_from_a_restarted_prefill_worker_succeed).

def test_blocks_of_a_pull_aborted_midway_serve_the_next_request_cleanly(slow, engine, random_prompts):
    """Abort a request while its KV is being pulled, then at once send one that takes the
    same decode blocks: its pull lands in them and it gets the engine's tokens (no late
    byte of the aborted pull lands), and the aborted prompt, sent again, is pulled anew
    rather than taken from blocks that never landed."""
    total = slow.worker_health(DECODE)["kv_blocks_total"]
    filler, aborted, reuser = random_prompts([(total - 3) * 16, 40, 40], seed=808)
    with Client(slow.sdk, timeout_s=60) as client:
        assert client.generate(token_ids=filler, max_tokens=2, **GREEDY).token_ids == expected(engine, filler, 2)
        wait_idle(slow)
        # The filler's full blocks stay cached: the 3 free blocks are what the next import takes.
        slow.wait_for(lambda: metric(slow, DECODE, "baton_worker_kv_blocks_cached") == total - 3, 5,
                      f"{total - 3} cached blocks on the decode worker")
        cancelled = metric(slow, PREFILL, "baton_kv_exposures_total", outcome="cancelled")
        stream = client.stream(token_ids=aborted, max_tokens=8, **GREEDY)
        next(stream)
        pull_in_flight(slow)
        stream.close()  # aborts it
        result = client.generate(token_ids=reuser, max_tokens=8, **GREEDY)
        assert result.token_ids == expected(engine, reuser, 8)
        assert metric(slow, PREFILL, "baton_kv_exposures_total", outcome="cancelled") == cancelled + 1
        reused = metric(slow, DECODE, "baton_kv_import_blocks_reused_total")
        again = client.generate(token_ids=aborted, max_tokens=8, **GREEDY)
        assert again.token_ids == expected(engine, aborted, 8)
        assert metric(slow, DECODE, "baton_kv_import_blocks_reused_total") == reused
    wait_idle(slow)


def test_a_decode_worker_killed_mid_pull_costs_the_prefill_worker_at_most_a_lease(slow, random_prompts):
    """SIGKILL the decode worker while it pulls: the prefill worker frees the leased blocks
    by the pull's deadline (6 s) or the lease's end (2 s), and the client, which had its
    first token, gets a typed error (or its answer) instead of waiting on a dead worker."""
    [prompt] = random_prompts([40], seed=303)
    killed: dict[str, float] = {}

    def kill_decode():
        pull_in_flight(slow)
        killed["pid"], killed["at"] = kill(slow, DECODE), time.monotonic()

    tokens, error = first_chunk_then(slow, prompt, 8, kill_decode)
    ended_after_s = time.monotonic() - killed["at"]
    assert isinstance(error, WorkerLost) or (error is None and len(tokens) == 8), (tokens, error)
    assert ended_after_s < 20, "the client waited on a dead decode worker"
    wait_leases_freed(slow, 6 + 5 + 9)  # the deadline, then up to 5 s for sends to settle
    assert slow.worker_health(PREFILL)["kv_blocks_used"] == 0
    wait_restarted(slow, DECODE, int(killed["pid"]))


def test_a_prefill_worker_killed_mid_pull_is_recomputed_by_the_decode_worker(slow, engine, random_prompts):
    """SIGKILL the prefill worker while its blocks are pulled (pulls here complete
    otherwise: the tests above): the decode worker's pull fails, it counts the failure,
    and by the default policy computes the prompt itself: the engine's tokens."""
    [prompt] = random_prompts([40], seed=404)
    failures = metric(slow, DECODE, "baton_kv_transfer_failures_total")
    recomputed = metric(slow, DECODE, "baton_kv_imports_recomputed_total")
    killed: dict[str, int] = {}

    def kill_prefill():
        pull_in_flight(slow)
        killed["pid"] = kill(slow, PREFILL)

    tokens, error = first_chunk_then(slow, prompt, 8, kill_prefill)
    assert error is None and tokens == expected(engine, prompt, 8), (tokens, error)
    assert metric(slow, DECODE, "baton_kv_transfer_failures_total") == failures + 1
    assert metric(slow, DECODE, "baton_kv_imports_recomputed_total") == recomputed + 1
    slow.wait_for(lambda: slow.worker_health(DECODE)["kv_blocks_used"] == 0, 10, "the decode worker's blocks freed")


def test_with_the_fail_policy_a_dead_prefill_worker_fails_the_request_typed(strict, engine, random_prompts):
    """Under `fail`, a slow pull completes, but one from a prefill worker SIGKILLed
    mid-transfer ends its request with KvTransferFailed."""
    first, second = random_prompts([40, 40], seed=909)
    with Client(strict.sdk, timeout_s=60) as client:
        assert client.generate(token_ids=first, max_tokens=8, **GREEDY).token_ids == expected(engine, first, 8)
    killed: dict[str, int] = {}

    def kill_prefill():
        pull_in_flight(strict)
        killed["pid"] = kill(strict, PREFILL)

    tokens, error = first_chunk_then(strict, second, 8, kill_prefill)
    assert isinstance(error, KvTransferFailed) and len(tokens) == 1, (tokens, error)
    wait_restarted(strict, PREFILL, killed["pid"])
    wait_idle(strict)


def test_pulls_from_a_restarted_prefill_worker_succeed(strict, engine, random_prompts):
    """Once the supervisor has restarted a SIGKILLed prefill worker, a request's KV is
    pulled from the new process (under `fail`, a refused pull would fail the request)."""
    [prompt] = random_prompts([40], seed=410)
    wait_restarted(strict, PREFILL, kill(strict, PREFILL))
    with Client(strict.sdk, timeout_s=60) as client:
        assert client.generate(token_ids=prompt, max_tokens=8, **GREEDY).token_ids == expected(engine, prompt, 8)
    wait_idle(strict)


def test_a_lease_renewed_while_its_request_waits_for_room_is_pulled_when_room_comes(queued, engine,
                                                                                    random_prompts):
    """The decode worker's one batch slot is taken by a long request, so the next one waits
    there, its lease renewed through the router every 0.2 s; when the slot frees, its KV is
    pulled from the prefill worker (not expired, not recomputed)."""
    long_prompt, waiting_prompt = random_prompts([16, 40], seed=620)
    renewals = metric(queued, DECODE, "baton_kv_lease_renewals_total")
    recomputed = metric(queued, DECODE, "baton_kv_imports_recomputed_total")
    pulled = metric(queued, PREFILL, "baton_kv_exposures_total", outcome="done")
    with ThreadPoolExecutor(2) as pool, Client(queued.sdk, timeout_s=120) as first, \
            Client(queued.sdk, timeout_s=120) as second:
        long_run = pool.submit(first.generate, token_ids=long_prompt, max_tokens=1000, **GREEDY)
        queued.wait_for(lambda: queued.worker_health(DECODE)["running"] == 1, 30, "the long request to decode")
        waiting = pool.submit(second.generate, token_ids=waiting_prompt, max_tokens=8, **GREEDY)
        assert waiting.result(120).token_ids == expected(engine, waiting_prompt, 8)
        assert len(long_run.result(120).token_ids) == 1000
    assert metric(queued, DECODE, "baton_kv_lease_renewals_total") > renewals
    assert metric(queued, DECODE, "baton_kv_imports_recomputed_total") == recomputed
    # The prefill worker hears that a pull ended in a message of its own, which can come
    # after the reply (a loaded CI run read 1 of the 2 at once).
    queued.wait_for(lambda: metric(queued, PREFILL, "baton_kv_exposures_total", outcome="done") >= pulled + 2,
                    10, "the prefill worker to count both pulls done")
    assert metric(queued, PREFILL, "baton_kv_exposures_total", outcome="done") == pulled + 2
    wait_idle(queued)


# ---- a prefill that ends while its decode worker restarts -----------------------------------

@pytest.fixture(scope="module")
def restarting(make_cluster):
    """Leases long enough to outlast a decode worker's restart (the router waits half of one)."""
    cluster = start_pd(make_cluster, "zmq", "--kv-lease-ttl-s", str(2 * RESTART_S))
    yield cluster
    cluster.stop()


def test_a_prefill_that_ends_while_its_decode_worker_restarts_waits_for_it(restarting, engine, random_prompts):
    """Stop the prefill worker (SIGSTOP), SIGKILL the only decode worker and send a
    request: the router, which still lists the decode worker, places it on the prefill
    worker. Once the router has seen the decode worker's connection close, the prefill
    worker goes on: it computes the prompt and streams its first token while the decode
    worker is dead, and the router holds the hand-off (within the lease) until the
    restarted decode worker joins, which pulls the KV and finishes it: the engine's
    tokens, no ServerUnavailable. (Were the prefill quicker than the close reaching the
    router, the hand-off would go to the dead worker's connection: that request is the
    lost worker's, failed with worker_lost, docs/disaggregation.md §3.)"""
    [prompt] = random_prompts([40], seed=909)
    prefill_pid = restarting.worker_health(PREFILL)["pid"]
    with ThreadPoolExecutor(1) as pool, Client(restarting.sdk, timeout_s=RESTART_S + 30) as client:
        os.kill(prefill_pid, signal.SIGSTOP)
        try:
            pid = kill(restarting, DECODE)
            answer = pool.submit(client.generate, token_ids=prompt, max_tokens=8, **GREEDY)
            time.sleep(0.4)  # placed; the close seen; well within worker_timeout_s for both
        finally:
            os.kill(prefill_pid, signal.SIGCONT)
        result = answer.result(RESTART_S + 30)
    assert result.token_ids == expected(engine, prompt, 8)
    assert metric(restarting, None, "baton_router_handoffs_parked_total", outcome="placed") == 1
    assert metric(restarting, DECODE, "baton_kv_transfer_bytes_total") > 0  # pulled, not recomputed
    wait_restarted(restarting, DECODE, pid)
    wait_idle(restarting)


def test_a_router_restarted_during_a_prefill_loses_no_hand_off(restarting, engine, random_prompts):
    """Stop the prefill worker (SIGSTOP), send a request (the router places it there), kill
    the router (`svc up` restarts it), then let the prefill worker go on: it computes the
    prompt and streams the first token, and its KvReady reaches a router that never held
    the hand-off. Once rejoined, it sends the KvReady again with the request and its
    prompt; the new router adopts the hand-off and the decode worker pulls the KV: the
    engine's tokens, not `unavailable` (the client does not retry)."""
    [prompt] = random_prompts([40], seed=910)
    prefill_pid, router_pid = restarting.worker_health(PREFILL)["pid"], restarting.router_health()["pid"]
    pulled = metric(restarting, DECODE, "baton_kv_transfer_bytes_total")
    with ThreadPoolExecutor(1) as pool, Client(restarting.sdk, timeout_s=120, retry_unavailable=False) as client:
        os.kill(prefill_pid, signal.SIGSTOP)
        try:
            answer = pool.submit(client.generate, token_ids=prompt, max_tokens=8, **GREEDY)
            time.sleep(0.5)  # placed on the stopped prefill worker, well within worker_timeout_s
            os.kill(router_pid, signal.SIGKILL)
            restarting.wait_for(lambda: router_restarted(restarting, router_pid), 60, "the router to restart")
        finally:
            os.kill(prefill_pid, signal.SIGCONT)
        result = answer.result(120)
    assert result.token_ids == expected(engine, prompt, 8)
    assert metric(restarting, None, "baton_router_handoffs_parked_total", outcome="placed") == 1  # adopted
    assert metric(restarting, DECODE, "baton_kv_transfer_bytes_total") > pulled  # pulled, not recomputed
    wait_idle(restarting)


def test_a_lease_being_pulled_is_not_handed_off_again_after_a_router_restart(make_cluster, engine,
                                                                            random_prompts):
    """Two decode workers, slow pulls. While one decode worker pulls a request's KV it is
    stopped (SIGSTOP) and the router is killed. The prefill worker rejoins the restarted
    router but does not send that KvReady again, since its transport is serving the
    lease, so the router places nothing on the other decode worker. Once the stopped one
    goes on, it finishes the pull and the request: the engine's tokens."""
    cluster = make_cluster(workers=0, prefill=1, decode=2,
                           extra=[*PD_FLAGS, *ALL_REMOTE, "--kv-transport", "zmq", "--kv-send-pause-s", "0.2",
                                  "--kv-transfer-timeout-s", "30", "--worker-timeout-s", "10"])
    try:
        [prompt] = random_prompts([40], seed=911)
        router_pid = cluster.router_health()["pid"]
        with ThreadPoolExecutor(1) as pool, Client(cluster.sdk, timeout_s=120, retry_unavailable=False) as client:
            answer = pool.submit(client.generate, token_ids=prompt, max_tokens=8, **GREEDY)
            puller = cluster.wait_for(lambda: next((i for i in (1, 2) if cluster.worker_health(i)["kv_blocks_used"]),
                                                   None), 10, "a decode worker to start its pull")
            puller_pid = cluster.worker_health(puller)["pid"]
            os.kill(puller_pid, signal.SIGSTOP)
            try:
                os.kill(router_pid, signal.SIGKILL)
                cluster.wait_for(lambda: router_restarted(cluster, router_pid), 60, "the router to restart")
                with Client(cluster.sdk, timeout_s=10) as watcher:
                    cluster.wait_for(lambda: len(watcher.status().workers) == 2, 30,
                                     "the prefill worker and the other decode worker to rejoin")
                time.sleep(4 * 0.5)  # past the adoption wait (two heartbeats) of any KvReady sent again
                assert metric(cluster, None, "baton_router_handoffs_parked_total") == 0
            finally:
                os.kill(puller_pid, signal.SIGCONT)
            assert answer.result(120).token_ids == expected(engine, prompt, 8)
        assert metric(cluster, None, "baton_router_handoffs_parked_total") == 0
        assert metric(cluster, 3 - puller, "baton_kv_transfer_bytes_total") == 0  # the other one pulled nothing
        wait_idle(cluster)
    finally:
        cluster.stop()


def router_restarted(cluster, old_pid: int) -> bool:
    try:
        return cluster.router_health()["pid"] != old_pid
    except OSError:  # not answering yet
        return False


# ---- 5. a pull past its deadline ---------------------------------------------------------

def test_a_pull_past_its_deadline_is_recomputed_and_both_sides_let_go(hung, engine, random_prompts):
    """A pull slower than kv_transfer_timeout_s fails loudly on both sides: the decode
    worker counts a timeout and recomputes (the engine's tokens), the prefill worker ends
    the exposure unpulled and frees the leased blocks."""
    [prompt] = random_prompts([40], seed=505)
    timeouts = metric(hung, DECODE, "baton_kv_transfer_failures_total", cause="timeout")
    recomputed = metric(hung, DECODE, "baton_kv_imports_recomputed_total")
    pulled = metric(hung, PREFILL, "baton_kv_exposures_total", outcome="done")
    ended = metric(hung, PREFILL, "baton_kv_exposures_total")
    with Client(hung.sdk, timeout_s=60) as client:
        result = client.generate(token_ids=prompt, max_tokens=8, **GREEDY)
    assert result.token_ids == expected(engine, prompt, 8)
    assert metric(hung, DECODE, "baton_kv_transfer_failures_total", cause="timeout") == timeouts + 1
    assert metric(hung, DECODE, "baton_kv_imports_recomputed_total") == recomputed + 1
    hung.wait_for(lambda: metric(hung, PREFILL, "baton_kv_exposures_total") == ended + 1, 10,
                  "the prefill worker to end the exposure")
    assert metric(hung, PREFILL, "baton_kv_exposures_total", outcome="done") == pulled
    wait_leases_freed(hung, 5)
    wait_idle(hung)
