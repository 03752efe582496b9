"""A worker holds a request's tokens for the stream interval and sends them together, the
steps' tokens of one request as one message; the first token and the last go at once
(services/worker/service.py `_emit`)."""
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
        assert len(arrivals) == 2, len(arrivals)  # the first token, then the 199 held as one
    else:
        assert middle > 0.5 * rest, (middle, rest)
        assert len(arrivals) > 100, len(arrivals)


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


def test_held_steps_of_a_request_join_into_one_message_unless_they_must_stay_apart():
    """`_hold_tokens`: plain tokens of one request append to its held item (logprobs
    with them, the last step's finish), while tokens with an output position, prompt
    logprobs, or after a finished item are items of their own; a flush starts afresh."""
    from common.protocol import Tokens
    from services.worker.service import WorkerService

    service = WorkerService.__new__(WorkerService)  # the holding only: no sockets
    service.unsent, service.unsent_tails = {}, {}
    sent: list[tuple[str, object]] = []
    service._send_to = lambda address, message: sent.append((address, message))
    address = "tcp://127.0.0.1:1"

    def hold(request_id, token_ids, **fields):
        service._hold_tokens(address, Tokens(request_id=request_id, token_ids=token_ids, worker_id="w", **fields))

    hold("a", [1], logprobs=[{"1": -0.1}])
    hold("b", [7])
    hold("a", [2], logprobs=[{"2": -0.2}])
    hold("b", [8], position=1)  # a repeated position: its own item
    hold("a", [3], logprobs=[{"3": -0.3}], finished=True, finish_reason="length")
    hold("a", [4], logprobs=[{"4": -0.4}])  # after a finished item (a late duplicate): apart, for the tokenizer
    items = service.unsent[address]
    assert [(item.request_id, item.token_ids) for item in items] == [
        ("a", [1, 2, 3]), ("b", [7]), ("b", [8]), ("a", [4])]
    assert items[0].logprobs == [{"1": -0.1}, {"2": -0.2}, {"3": -0.3}]
    assert items[0].finished and items[0].finish_reason == "length"

    hold("c", [5], logprobs=[{"5": -0.5}])
    hold("c", [6])  # logprobs for some tokens only would misalign them: apart
    hold("d", [9], prompt_logprobs=[None, {"9": -0.9}])
    hold("d", [10])
    assert [(item.request_id, item.token_ids) for item in items[4:]] == [
        ("c", [5]), ("c", [6]), ("d", [9]), ("d", [10])]

    service._flush()
    assert [item.token_ids for _, batch in sent for item in batch.items][:4] == [[1, 2, 3], [7], [8], [4]]
    hold("d", [11])  # held afresh, not joined to what was sent
    assert [item.token_ids for item in service.unsent[address]] == [[11]]
