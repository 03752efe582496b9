"""Placement by prefix and early rejection, observed through the SDK on real processes:
`svc up --workers 3 --policy e2` with admission on, and a pair of `lpm` workers."""
import asyncio
import json
import random
import subprocess
import sys
import time

import pytest

from common.protocol import Status, StatusRequest, encode
from services.client import AsyncClient, Client, Rejected
from services.local_cluster import REPO, child_env
from tests.services.test_faults import answer, raw_dealer
from tests.services.test_router_store_live import metric

PREFIX_TOKENS = 512  # 32 blocks: well over half of each prompt, so e2 exploits the holder
SLO = {"ttft_s": 3.0, "tpot_s": 1.0}
# The router's profile is this machine's, measured first (`svc profile --quick`, one thread as
# each worker has, float32 as the workers run: CPUs without AVX-512 run bf16 ~40x slower),
# then slowed down: three workers, the tokenizer, the router and the test share two cores,
# and in a burst prefill chunks of several requests share each step.
SAFETY = 6.0


@pytest.fixture(scope="module")
def e2_cluster(make_cluster, tmp_path_factory, tiny_model_dir):
    folder = tmp_path_factory.mktemp("e2")
    profile = folder / "profile.json"
    measured = subprocess.run([sys.executable, "-m", "services.cli", "profile", "--quick", "--threads", "1",
                               "--dtype", "float32", "--model", str(tiny_model_dir), "--out", str(profile)],
                              capture_output=True, text=True, cwd=REPO, timeout=300, env=child_env())
    assert measured.returncode == 0, measured.stderr
    slow = json.loads(profile.read_text(encoding="utf-8"))
    for phase in ("prefill", "decode"):
        slow[phase] = {key: value * SAFETY for key, value in slow[phase].items()}
    profile.write_text(json.dumps(slow), encoding="utf-8")
    config = folder / "cluster.toml"
    config.write_text(f"[slo_classes.interactive]\nttft_s = {SLO['ttft_s']}\ntpot_s = {SLO['tpot_s']}\n",
                      encoding="utf-8")
    running = make_cluster(workers=3, extra=["--policy", "e2", "--admission", "true", "--config", str(config),
                                             "--profile", str(profile), "--dtype", "float32"])
    yield running
    running.stop()


def family_prompt(family: int, request: int, suffix_tokens: int = 64) -> list[int]:
    prefix = random.Random(family).choices(range(1, 250), k=PREFIX_TOKENS)
    return prefix + random.Random(1000 * family + request).choices(range(1, 250), k=suffix_tokens)


def wait_for_events(client: Client, at_least: int) -> None:
    """The router learns of cached blocks from KV events; let them arrive."""
    deadline = time.monotonic() + 10
    while client.status().kv_events_received < at_least and time.monotonic() < deadline:
        time.sleep(0.05)


def test_repeats_land_where_their_prefix_is_cached(e2_cluster):
    with Client(e2_cluster.sdk, timeout_s=60) as client:
        for family in range(3):
            first = client.generate(token_ids=family_prompt(family, 0), max_tokens=4, ignore_eos=True)
            assert first.num_cached_tokens == 0
        wait_for_events(client, 3 * PREFIX_TOKENS // 16)
        for request in range(1, 4):
            for family in range(3):
                repeat = client.generate(token_ids=family_prompt(family, request), max_tokens=4, ignore_eos=True)
                # Each worker caches only what it computed: a hit proves the placement.
                assert repeat.num_cached_tokens >= PREFIX_TOKENS, (family, request)
        routed = {w.worker_id: w for w in client.status().workers}
    assert len(routed) == 3
    # Each placement's time in the router is on its /metrics (port_base + 3, as /health).
    placed = metric(e2_cluster.port_base + 3, "baton_router_requests_total", outcome="placed")
    assert placed >= 12  # this test's, and any of the module's tests before it
    assert metric(e2_cluster.port_base + 3, "baton_router_placement_seconds_count") == placed
    assert 0 < metric(e2_cluster.port_base + 3, "baton_router_placement_seconds_sum") < placed * 0.05


def test_with_one_family_flooding_the_others_still_land_and_complete(e2_cluster):
    async def run():
        async with AsyncClient(e2_cluster.sdk, timeout_s=120) as client:
            for family in (10, 11, 12):  # warm each family's prefix somewhere
                await client.generate(token_ids=family_prompt(family, 0), max_tokens=2, ignore_eos=True)
            await asyncio.sleep(0.5)
            flood = [client.generate(token_ids=family_prompt(10, index), max_tokens=8, ignore_eos=True)
                     for index in range(1, 41)]
            others = [client.generate(token_ids=family_prompt(family, index), max_tokens=8, ignore_eos=True)
                      for index in range(1, 6) for family in (11, 12)]
            return await asyncio.gather(*flood), await asyncio.gather(*others)

    flooded, others = asyncio.run(run())
    assert all(result.finish_reason == "length" for result in flooded + others)
    hits = [result.num_cached_tokens >= PREFIX_TOKENS for result in others]
    assert sum(hits) >= len(others) - 2, hits  # at most a rebalanced request or two recompute


@pytest.fixture(scope="module")
def lpm_pair(make_cluster):
    running = make_cluster(workers=2, extra=["--policy", "lpm"])
    yield running
    running.stop()


def test_a_burst_of_one_prompt_lands_on_one_worker_before_any_kv_event(lpm_pair):
    """The router counts a placed prompt as cached on its worker at once. Otherwise the
    burst's later requests, arriving before the first prefill's KV events, would find
    nothing cached and lpm's tie-break (fewest in flight) would spread them."""
    prompt = random.Random(7).choices(range(1, 250), k=800)

    async def burst():
        async with AsyncClient(lpm_pair.sdk, timeout_s=60) as client:
            return await asyncio.gather(*(client.generate(token_ids=prompt, max_tokens=2, ignore_eos=True)
                                          for _ in range(6)))

    assert all(result.finish_reason == "length" for result in asyncio.run(burst()))
    blocks = len(prompt) // 16
    with Client(lpm_pair.sdk, timeout_s=30) as client:
        deadline = time.monotonic() + 10
        while sum(w.kv_blocks_cached for w in client.status().workers) < blocks and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # five heartbeats (0.2 s in tests): every worker has reported since the burst
        cached = sorted(worker.kv_blocks_cached for worker in client.status().workers)
    assert cached[0] == 0 and cached[1] >= blocks, cached


def test_a_burst_beyond_capacity_is_refused_early_and_the_admitted_meet_their_slo(e2_cluster):
    async def one(client, index):
        prompt = random.Random(5000 + index).choices(range(1, 250), k=900)
        started = time.monotonic()
        try:
            result = await client.generate(token_ids=prompt, max_tokens=4, ignore_eos=True,
                                           slo_class="interactive")
            return "admitted", result.ttft_s, time.monotonic() - started
        except Rejected as error:
            return "rejected", error.retry_after_s, time.monotonic() - started

    async def burst():
        async with AsyncClient(e2_cluster.sdk, timeout_s=120) as client:
            return await asyncio.gather(*(one(client, index) for index in range(60)))

    outcomes = asyncio.run(burst())
    admitted = [o for o in outcomes if o[0] == "admitted"]
    rejected = [o for o in outcomes if o[0] == "rejected"]
    assert admitted and rejected, outcomes
    assert all(ttft <= SLO["ttft_s"] for _, ttft, _ in admitted), admitted
    assert all(retry_after > 0 for _, retry_after, _ in rejected)
    # Early: a refusal comes back well before the SLO would have run out.
    assert max(elapsed for _, _, elapsed in rejected) < SLO["ttft_s"], rejected


def router_in_flight(socket) -> int:
    """Requests in flight on the one worker, as the router counts them now (the SDK's
    status is the tokenizer's copy, refreshed once a heartbeat interval)."""
    socket.send_multipart(encode(StatusRequest()))
    status = answer(socket)
    assert isinstance(status, Status)
    return status.workers[0].in_flight


def test_the_router_learns_a_request_ended_before_the_next_heartbeat(make_cluster):
    """A worker reports the requests a step ended when the step ends (RequestsFinished),
    not with its heartbeat: with heartbeats 10 s apart, the router's count of requests in
    flight is back to zero within a second of the last token."""
    slow_beats = make_cluster(workers=1, extra=["--heartbeat-interval-s", "10", "--worker-timeout-s", "30"])
    context, socket = raw_dealer(slow_beats.router)
    try:
        with Client(slow_beats.sdk, timeout_s=60) as client:
            for attempt in range(3):
                result = client.generate(token_ids=list(range(1, 40)), max_tokens=3, ignore_eos=True)
                assert result.finish_reason == "length"
                ended = time.monotonic()
                while (in_flight := router_in_flight(socket)) and time.monotonic() < ended + 1.0:
                    time.sleep(0.02)
                assert in_flight == 0, f"request {attempt}: the router still counts it in flight"
    finally:
        socket.close(0)
        context.term()
        slow_beats.stop()
