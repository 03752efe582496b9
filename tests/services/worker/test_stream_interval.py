"""A worker holds a request's tokens for the stream interval and sends them together; the
first token and the last go at once (services/worker/service.py `_emit`)."""
import time

import pytest

from services.client import Client


@pytest.mark.parametrize("interval_ms, held", [(60_000, True), (0, False)])
def test_tokens_between_the_first_and_last_wait_for_the_interval(make_cluster, interval_ms, held):
    cluster = make_cluster(extra=["--stream-interval-ms", str(interval_ms)])
    with Client(cluster.sdk, timeout_s=120) as client:
        client.generate("warm", max_tokens=2, temperature=0, ignore_eos=True)
        sent = time.perf_counter()
        arrivals, tokens = [], []
        for chunk in client.stream("The baton passes", max_tokens=200, temperature=0, ignore_eos=True):
            arrivals.append(time.perf_counter())
            tokens += chunk.token_ids
    assert len(tokens) == 200
    first, rest = arrivals[0] - sent, arrivals[-1] - arrivals[0]
    middle = arrivals[-2] - arrivals[1]  # tokens 2..199: held with the last, or streamed
    assert first < rest, (first, rest)  # the first token did not wait for the others
    if held:
        assert middle < 0.2 * rest, (middle, rest)
    else:
        assert middle > 0.5 * rest, (middle, rest)


def test_a_turn_waits_no_longer_than_the_held_tokens_and_never_forever(make_engine):
    """`_wait_ms` bounds a turn's poll by when the held tokens are due, and an overdue flush
    means no wait, never a negative one (ZeroMQ reads -1 as: until a message comes)."""
    from common.config import load_config
    from common.protocol import Tokens
    from services.worker.kv_loads import KvLoads
    from services.worker.service import WorkerService

    service = WorkerService.__new__(WorkerService)  # the loop's timing only: no sockets
    service.config = load_config(None, env={"BATON_STREAM_INTERVAL_MS": "5"})
    service.engine, service.store, service.unsent = make_engine(), None, {}
    service.kv_loads = KvLoads(service.engine)
    idle_ms = int(service.config.heartbeat_interval_s * 500)
    service.last_flush = time.monotonic()
    assert service._wait_ms() == idle_ms  # nothing held: the idle wait
    service.unsent = {"tcp://127.0.0.1:1": [Tokens(request_id="r", token_ids=[1])]}
    assert 0 < service._wait_ms() <= 5
    service.last_flush = time.monotonic() - 10  # long overdue
    assert service._wait_ms() == 0
