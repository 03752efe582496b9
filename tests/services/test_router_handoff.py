"""The router's side of the prefill/decode hand-off (services/router/handoff.py,
docs/router.md §6, docs/disaggregation.md §2), as plain bookkeeping: real pools,
members, policy and metrics, caller-given times, and a send function that collects what
the router would put on its socket."""
import numpy as np
import pytest
from msgspec.structs import replace

from common.config import ClusterConfig
from common.cost_model import TINY_CPU
from common.hashing import root_hash
from common.metrics import Registry
from common.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Generate,
    Hello,
    KvLeaseUpdate,
    KvMore,
    KvPart,
    KvPullFailed,
    KvPullVerdict,
    KvReady,
    Sampling,
)
from services.router.cluster import ClusterState
from services.router.handoff import ADOPTION_WAIT_BEATS, PARKED_LEASE_SHARE, HandoffDesk
from services.router.members import Members
from services.router.policies import make_policy
from services.router.service import RouterMetrics

BLOCK = 16
ROOT = root_hash("model", "tokenizer", "", "bfloat16", BLOCK)
LEASE_TTL_S = 10.0
BLOCKS = 80  # 1280 tokens: more than max_local_prefill_tokens (1000), so a decode worker does not compute it
PROMPT = np.random.default_rng(1).integers(0, 30000, BLOCKS * BLOCK).astype(np.uint32)


class Desk:
    """A HandoffDesk with what the router lends it: the pools, the members, a send that
    records (connection, message, payloads), the tokenizers still waiting (`origins`) and
    the requests failed to them (`failed`)."""

    def __init__(self) -> None:
        self.cluster = ClusterState(BLOCK, TINY_CPU)
        self.decode_pool = ClusterState(BLOCK, TINY_CPU)
        self.members = Members()
        self.sent: list[tuple[bytes, object, list | None]] = []
        self.unreachable: set[bytes] = set()  # connections whose sends fail
        self.origins: set[str] = set()
        self.failed: list[tuple[str, str]] = []
        self.registry = Registry()
        self.metrics = RouterMetrics(self.registry)
        self.desk = HandoffDesk(ClusterConfig(kv_lease_ttl_s=LEASE_TTL_S), self.cluster, self.decode_pool,
                                self.members, make_policy("least_load"), self.send, lambda tenant: ROOT,
                                self.origins.__contains__, self.fail, self.metrics.handoffs_parked,
                                self.metrics.failed_pulls, lambda request: self.origins.add(request.request_id))

    def send(self, identity: bytes, message, payloads=None) -> bool:
        if identity in self.unreachable:
            return False
        self.sent.append((identity, message, payloads))
        return True

    def fail(self, request_id: str, why: str) -> None:
        self.origins.discard(request_id)
        self.failed.append((request_id, why))

    def join(self, worker_id: str, role: str) -> bytes:
        identity = f"conn-{worker_id}".encode()
        hello = Hello(protocol_version=PROTOCOL_VERSION, worker_id=worker_id, role=role, model_fingerprint="model",
                      tokenizer_fingerprint="tokenizer", kv_blocks=1000, block_size=BLOCK, max_model_len=4096,
                      events_address="tcp://127.0.0.1:7001", metrics_address="", instance_id=f"{worker_id}-1",
                      kv_dtype="bfloat16", kv_address="tcp://127.0.0.1:7040" if role == "prefill" else "")
        self.members.join(identity, hello, None, 0.0)
        (self.decode_pool if role == "decode" else self.cluster).add_worker(worker_id, hello.kv_blocks)
        return identity

    def prefill(self, request_id: str, prefill_worker: str, now: float = 0.0) -> Generate:
        """Place the request's prefill on `prefill_worker` and hold its hand-off, as the
        router does for a Generate the policy puts on a prefill worker."""
        request = Generate(request_id=request_id, sampling=Sampling(max_tokens=16),
                           stream_address="tcp://127.0.0.1:7002")
        self.cluster.place(self.cluster.prepare(request_id, ROOT, PROMPT, 16, now), prefill_worker, now)
        self.desk.hold(request, PROMPT, prefill_worker)
        self.origins.add(request_id)
        return request

    def parked_total(self, outcome: str) -> float:
        return self.registry.collectors.get_sample_value("baton_router_handoffs_parked_total",
                                                         {"outcome": outcome}) or 0.0


def ready(request_id: str) -> KvReady:
    return KvReady(request_id=request_id, lease_id="ab" * 16, block_ids=list(range(BLOCKS)),
                   block_hashes=list(range(100, 100 + BLOCKS)), num_tokens=len(PROMPT), first_token_id=7, queue_s=0.01,
                   prefill_s=0.2)


def releases(sent) -> list[tuple[bytes, KvLeaseUpdate]]:
    return [(identity, message) for identity, message, _ in sent
            if isinstance(message, KvLeaseUpdate) and message.action == "release"]


def test_a_prefilled_request_goes_to_a_decode_worker_with_its_handle():
    d = Desk()
    prefill = d.join("p0", "prefill")
    decode = d.join("d0", "decode")
    d.prefill("r-1", "p0")
    d.desk.kv_ready(prefill, d.members["p0"].hello, ready("r-1"), 1.0)
    assert "r-1" not in d.cluster.placements  # the prefill placement ended
    assert d.decode_pool.placements["r-1"].worker_id == "d0"
    [(identity, request, payloads)] = d.sent
    assert identity == decode and isinstance(request, Generate) and payloads is not None
    assert payloads[0] is PROMPT
    handle = request.kv_handle
    assert handle is not None
    assert (handle.prefill_worker_id, handle.kv_address, handle.prefill_instance_id) == \
        ("p0", "tcp://127.0.0.1:7040", "p0-1")
    assert (handle.lease_id, handle.num_tokens, handle.first_token_id) == ("ab" * 16, len(PROMPT), 7)
    assert not d.desk.pending and not d.desk.parked and not d.failed


def test_with_no_decode_worker_a_hand_off_is_parked_and_expires_within_the_lease():
    d = Desk()
    prefill = d.join("p0", "prefill")
    d.prefill("r-1", "p0")
    d.desk.kv_ready(prefill, d.members["p0"].hello, ready("r-1"), 1.0)
    assert d.sent == [] and list(d.desk.parked) == ["r-1"]
    deadline = 1.0 + LEASE_TTL_S * PARKED_LEASE_SHARE
    assert d.desk.parked["r-1"].deadline == pytest.approx(deadline)

    d.desk.retry_parked(deadline - 0.01)  # still waiting
    assert d.sent == [] and list(d.desk.parked) == ["r-1"]

    d.desk.retry_parked(deadline)
    assert not d.desk.parked
    [(identity, release)] = releases(d.sent)
    assert identity == prefill
    assert (release.request_id, release.lease_id, release.prefill_worker_id) == ("r-1", "ab" * 16, "p0")
    assert d.failed == [("r-1", "no decode worker could take the prefilled request within its lease")]
    assert d.parked_total("expired") == 1 and d.parked_total("placed") == 0

    d.desk.retry_parked(deadline + 1.0)  # gone: nothing more
    assert len(d.sent) == 1 and len(d.failed) == 1


def test_a_parked_hand_off_goes_to_the_first_decode_worker_that_can_take_it():
    d = Desk()
    prefill = d.join("p0", "prefill")
    d.prefill("r-1", "p0")
    d.desk.kv_ready(prefill, d.members["p0"].hello, ready("r-1"), 1.0)
    assert list(d.desk.parked) == ["r-1"]

    d.unreachable.add(d.join("d0", "decode"))  # joins, but its send fails
    d.desk.retry_parked(2.0)
    assert d.sent == [] and list(d.desk.parked) == ["r-1"]

    decode = d.join("d1", "decode")
    d.desk.retry_parked(3.0)
    [(identity, request, payloads)] = d.sent
    assert identity == decode and isinstance(request, Generate) and request.kv_handle is not None
    assert request.kv_handle.lease_id == "ab" * 16 and payloads is not None and payloads[0] is PROMPT
    assert d.decode_pool.placements["r-1"].worker_id == "d1"
    assert not d.desk.parked and not d.failed and releases(d.sent) == []
    assert d.parked_total("placed") == 1 and d.parked_total("expired") == 0


def test_an_aborted_parked_hand_off_releases_its_lease_once():
    d = Desk()
    prefill = d.join("p0", "prefill")
    d.prefill("r-1", "p0")
    d.desk.kv_ready(prefill, d.members["p0"].hello, ready("r-1"), 1.0)
    assert d.desk.abort("r-1")
    assert [identity for identity, _ in releases(d.sent)] == [prefill]
    assert not d.desk.abort("r-1")  # not parked any more
    d.desk.retry_parked(100.0)
    assert len(d.sent) == 1 and not d.failed


def test_a_parked_hand_off_whose_request_ended_meanwhile_releases_its_lease_once():
    d = Desk()
    prefill = d.join("p0", "prefill")
    d.prefill("r-1", "p0")
    d.desk.kv_ready(prefill, d.members["p0"].hello, ready("r-1"), 1.0)
    d.origins.discard("r-1")  # its tokenizer is no longer waiting (the request ended elsewhere)
    d.join("d0", "decode")
    d.desk.retry_parked(2.0)
    [(identity, release)] = releases(d.sent)
    assert identity == prefill and release.request_id == "r-1"
    assert len(d.sent) == 1  # not sent on to the decode worker
    d.desk.retry_parked(100.0)
    assert len(d.sent) == 1 and not d.failed and not d.desk.parked
    assert d.parked_total("placed") == 0 and d.parked_total("expired") == 0


def test_kv_ready_for_a_hand_off_the_router_does_not_hold_ends_the_request():
    d = Desk()
    prefill = d.join("p0", "prefill")
    other = d.join("p1", "prefill")
    d.join("d0", "decode")
    d.prefill("r-1", "p0")
    d.desk.kv_ready(other, d.members["p1"].hello, ready("r-1"), 1.0)  # not the worker it was placed on
    [(identity, release)] = releases(d.sent)
    assert identity == other and release.prefill_worker_id == "p1"
    assert d.failed == []  # r-1 is placed on p0, which goes on with it
    assert "r-1" in d.desk.pending and d.cluster.placements["r-1"].worker_id == "p0"

    d.sent.clear()
    d.origins.add("r-2")  # a request this router never placed (it restarted since, say)
    d.desk.kv_ready(prefill, d.members["p0"].hello, ready("r-2"), 1.0)
    assert [identity for identity, _ in releases(d.sent)] == [prefill] and len(d.sent) == 1
    assert [request_id for request_id, _ in d.failed] == ["r-2"]


def test_a_forgotten_hand_off_is_not_sent_on():
    d = Desk()
    prefill = d.join("p0", "prefill")
    d.join("d0", "decode")
    d.prefill("r-1", "p0")
    d.desk.forget("r-1")  # the prefill worker was lost, say
    d.cluster.finish("r-1")
    d.desk.kv_ready(prefill, d.members["p0"].hello, ready("r-1"), 1.0)
    assert [message for _, message, _ in d.sent if isinstance(message, Generate)] == []
    assert len(releases(d.sent)) == 1 and [request_id for request_id, _ in d.failed] == ["r-1"]


def test_lease_updates_pass_from_the_decode_worker_holding_the_request_to_its_prefill_worker():
    d = Desk()
    prefill = d.join("p0", "prefill")
    d.join("d0", "decode")
    d.join("d1", "decode")
    d.prefill("r-1", "p0")
    d.desk.kv_ready(prefill, d.members["p0"].hello, ready("r-1"), 1.0)
    d.sent.clear()
    holder = d.decode_pool.placements["r-1"].worker_id
    bystander = "d1" if holder == "d0" else "d0"
    renew = KvLeaseUpdate(request_id="r-1", lease_id="ab" * 16, prefill_worker_id="p0", action="renew")

    assert d.desk.lease_update(d.members[holder].hello, renew) == ""
    assert d.sent == [(prefill, renew, None)]
    assert d.desk.lease_update(d.members[bystander].hello, renew) == "request r-1 is not placed on it"
    assert d.desk.lease_update(d.members["p0"].hello, renew) == "request r-1 is not placed on it"
    unknown = KvLeaseUpdate(request_id="r-1", lease_id="ab" * 16, prefill_worker_id="p9", action="renew")
    assert d.desk.lease_update(d.members[holder].hello, unknown) == ""  # dropped, logged
    assert len(d.sent) == 1


def test_a_short_prompt_goes_straight_to_a_decode_worker_and_a_long_one_is_prefilled():
    d = Desk()
    d.join("p0", "prefill")
    decode = d.join("d0", "decode")
    short = Generate(request_id="r-short", sampling=Sampling(max_tokens=16), stream_address="tcp://127.0.0.1:7002")
    assert d.desk.place_on_decode(short, [PROMPT[:4 * BLOCK]], 0.0) == "d0"
    assert [(identity, message) for identity, message, _ in d.sent] == [(decode, short)]
    assert d.decode_pool.placements["r-short"].worker_id == "d0"
    long = Generate(request_id="r-long", sampling=Sampling(max_tokens=16), stream_address="tcp://127.0.0.1:7002")
    assert d.desk.place_on_decode(long, [PROMPT], 0.0) is None
    assert len(d.sent) == 1 and "r-long" not in d.decode_pool.placements


# ---- a failed pull handed back by its decode worker ------------------------------------

def handed_off(d: Desk, decode_workers: list[str]) -> tuple[str, Generate]:
    """Join p0 and `decode_workers`, prefill r-1 on p0 and hand it off: its decode worker
    and the Generate it was sent."""
    prefill = d.join("p0", "prefill")
    for worker_id in decode_workers:
        d.join(worker_id, "decode")
    d.prefill("r-1", "p0")
    d.desk.kv_ready(prefill, d.members["p0"].hello, ready("r-1"), 1.0)
    [(_, request, _)] = d.sent
    d.sent.clear()
    return d.decode_pool.placements["r-1"].worker_id, request


def failed(request: Generate, reply_by: float = 100.0) -> KvPullFailed:
    return KvPullFailed(request=request, code="timeout", reason="deadline passed", reply_by=reply_by)


def failed_pulls(d: Desk, outcome: str) -> float:
    return d.registry.collectors.get_sample_value("baton_router_failed_pulls_total", {"outcome": outcome}) or 0.0


def test_a_failed_pull_is_re_placed_on_another_decode_worker_with_the_same_lease():
    d = Desk()
    holder, request = handed_off(d, ["d0", "d1"])
    other = "d1" if holder == "d0" else "d0"
    forged = replace(request, kv_handle=replace(request.kv_handle, kv_address="tcp://10.0.0.9:1"))
    verdict = d.desk.pull_failed(d.members[holder].hello, failed(forged), PROMPT, 2.0, 50.0)
    assert verdict == KvPullVerdict(request_id="r-1", lease_id="ab" * 16, action="moved", worker_id=other)
    [(identity, moved, payloads)] = d.sent
    assert identity == d.members[other].identity and isinstance(moved, Generate) and payloads == [PROMPT]
    assert moved.kv_handle is not None and request.kv_handle is not None
    assert moved.kv_handle == replace(request.kv_handle, failed_on=[holder])  # the prefill worker's own address
    assert d.decode_pool.placements["r-1"].worker_id == other
    assert "r-1" not in d.decode_pool.workers[holder].in_flight
    assert failed_pulls(d, "moved") == 1 and failed_pulls(d, "local") == 0

    renew = KvLeaseUpdate(request_id="r-1", lease_id="ab" * 16, prefill_worker_id="p0", action="renew")
    assert d.desk.lease_update(d.members[holder].hello, renew) == "request r-1 is not placed on it"
    assert d.desk.lease_update(d.members[other].hello, renew) == ""
    for worker_id in (holder, other):  # the index keeps no node the failed placement's settling dropped
        d.decode_pool.remove_worker(worker_id)


def test_a_failed_pull_stays_local_without_another_decode_worker_with_room():
    d = Desk()
    holder, request = handed_off(d, ["d0"])
    verdict = d.desk.pull_failed(d.members[holder].hello, failed(request), PROMPT, 2.0, 50.0)
    assert isinstance(verdict, KvPullVerdict) and (verdict.action, verdict.reason) == \
        ("local", "no other decode worker has room")
    assert d.sent == [] and d.decode_pool.placements["r-1"].worker_id == holder

    d.join("d1", "decode")
    d.decode_pool.report("d1", 0, 0, 1000 - BLOCKS + 1, 0)  # one block short of the prompt
    verdict = d.desk.pull_failed(d.members[holder].hello, failed(request), PROMPT, 2.0, 50.0)
    assert isinstance(verdict, KvPullVerdict) and verdict.action == "local"
    assert d.sent == [] and d.decode_pool.placements["r-1"].worker_id == holder
    assert failed_pulls(d, "local") == 2 and failed_pulls(d, "moved") == 0


def test_a_failed_pull_is_re_placed_at_most_kv_pull_replacements_times():
    d = Desk()
    holder, request = handed_off(d, ["d0", "d1", "d2"])
    once = replace(request, kv_handle=replace(request.kv_handle, failed_on=["d9"]))
    verdict = d.desk.pull_failed(d.members[holder].hello, failed(once), PROMPT, 2.0, 50.0)
    assert isinstance(verdict, KvPullVerdict) and (verdict.action, verdict.reason) == \
        ("local", "re-placed 1 time(s) already")
    assert d.sent == []


def test_a_failed_pull_stays_local_when_its_prefill_worker_is_gone_or_the_report_is_late():
    d = Desk()
    holder, request = handed_off(d, ["d0", "d1"])
    late = d.desk.pull_failed(d.members[holder].hello, failed(request, reply_by=50.0), PROMPT, 2.0, 50.0)
    assert isinstance(late, KvPullVerdict) and (late.action, late.reason) == \
        ("local", "reported too late to be re-placed")
    restarted = replace(request, kv_handle=replace(request.kv_handle, prefill_instance_id="p0-0"))
    gone = d.desk.pull_failed(d.members[holder].hello, failed(restarted), PROMPT, 2.0, 50.0)
    assert isinstance(gone, KvPullVerdict) and gone.action == "local" and "p0" in gone.reason
    d.members.drop("p0")
    gone = d.desk.pull_failed(d.members[holder].hello, failed(request), PROMPT, 2.0, 50.0)
    assert isinstance(gone, KvPullVerdict) and gone.action == "local" and "is gone" in gone.reason
    assert d.sent == [] and d.decode_pool.placements["r-1"].worker_id == holder


def test_a_failed_pull_is_refused_from_a_decode_worker_the_request_is_not_placed_on():
    d = Desk()
    holder, request = handed_off(d, ["d0", "d1"])
    other = "d1" if holder == "d0" else "d0"
    assert d.desk.pull_failed(d.members[other].hello, failed(request), PROMPT, 2.0, 50.0) == \
        "request r-1 is not handed off to it"
    unhandled = replace(request, kv_handle=None)
    assert d.desk.pull_failed(d.members[holder].hello, failed(unhandled), PROMPT, 2.0, 50.0) == \
        "request r-1 is not handed off to it"
    assert d.sent == [] and failed_pulls(d, "moved") == failed_pulls(d, "local") == 0


# ---- a router that restarted during the prefill ---------------------------------------------

def carried(request_id: str) -> KvReady:
    """A KvReady that carries its request: the prefill worker rejoined a restarted router."""
    request = Generate(request_id=request_id, sampling=Sampling(max_tokens=16), stream_address="tcp://127.0.0.1:7002",
                       origin="tokenizer-0")
    return replace(ready(request_id), request=request)


def test_a_hand_off_the_router_never_held_is_adopted_once_decode_workers_could_rejoin():
    d = Desk()
    prefill = d.join("p0", "prefill")
    decode = d.join("d0", "decode")
    d.desk.kv_ready(prefill, d.members["p0"].hello, carried("r-1"), 1.0, PROMPT)
    assert d.sent == [] and d.desk.parked["r-1"].adopted and "r-1" in d.origins
    earliest = 1.0 + ADOPTION_WAIT_BEATS * ClusterConfig().heartbeat_interval_s
    d.desk.retry_parked(earliest - 0.01)
    assert d.sent == []
    d.desk.retry_parked(earliest)
    [(identity, request, payloads)] = d.sent
    assert identity == decode and payloads == [PROMPT] and request.kv_handle.lease_id == "ab" * 16
    assert d.decode_pool.placements["r-1"].worker_id == "d0" and d.parked_total("placed") == 1


def test_an_adopted_hand_off_that_a_rejoined_decode_worker_holds_stays_there():
    """The old router had handed the request off: the decode worker rejoins with it
    running, and its pull keeps the lease (nothing released, the request not placed
    again). The lease goes to it as KvMore, which it needs if it was importing the
    prompt's parts and ignores if it had the lease already."""
    d = Desk()
    prefill = d.join("p0", "prefill")
    decode = d.join("d0", "decode")
    d.desk.kv_ready(prefill, d.members["p0"].hello, carried("r-1"), 1.0, PROMPT)
    d.decode_pool.resume("r-1", "d0", len(PROMPT), 16, 1.1)  # as the router does for a rejoin's running requests
    d.desk.retry_parked(10.0)
    assert not d.desk.parked
    d.desk.kv_ready(prefill, d.members["p0"].hello, carried("r-1"), 11.0, PROMPT)  # sent again: still left there
    assert not d.desk.parked and len(d.sent) == 2
    for identity, message, _ in d.sent:
        assert identity == decode and isinstance(message, KvMore) and message.kv_handle.lease_id == "ab" * 16
        assert not message.kv_handle.part and message.kv_handle.first_token_id == 7


def test_a_carried_request_that_does_not_match_its_kv_ready_is_refused_and_its_lease_released():
    d = Desk()
    prefill = d.join("p0", "prefill")
    d.join("d0", "decode")
    d.desk.kv_ready(prefill, d.members["p0"].hello, carried("r-1"), 1.0, PROMPT[:-1])  # a token short
    other = replace(carried("r-2"), request_id="r-3")
    d.desk.kv_ready(prefill, d.members["p0"].hello, other, 1.0, PROMPT)
    bad_stream = replace(carried("r-4"), request=replace(carried("r-4").request, stream_address="tcp://nowhere"))
    d.desk.kv_ready(prefill, d.members["p0"].hello, bad_stream, 1.0, PROMPT)
    assert [message.request_id for _, message in releases(d.sent)] == ["r-1", "r-3", "r-4"]
    assert not d.desk.parked and not d.origins


# ---- a prompt still being prefilled: its parts (docs/disaggregation.md §2.1) ----------------

def part(request_id: str, first_block: int, count: int, lease: str) -> KvPart:
    return KvPart(request_id=request_id, lease_id=lease * 32, first_block=first_block,
                  block_ids=list(range(first_block, first_block + count)),
                  block_hashes=list(range(100 + first_block, 100 + first_block + count)), num_tokens=len(PROMPT))


def test_a_first_part_places_the_request_on_a_decode_worker_and_the_rest_follows_it_there():
    """The first part sends the request, with the part's handle, to the decode worker
    pairing picks; later parts and the whole prompt's lease go to that worker as KvMore,
    even with another decode worker free, and the prefill placement ends with the last."""
    d = Desk()
    prefill = d.join("p0", "prefill")
    decode = d.join("d0", "decode")
    d.prefill("r-1", "p0")
    d.desk.kv_part(prefill, d.members["p0"].hello, part("r-1", 0, 32, "a"), 0.5)
    [(identity, request, payloads)] = d.sent
    assert identity == decode and isinstance(request, Generate) and payloads is not None and payloads[0] is PROMPT
    handle = request.kv_handle
    assert handle is not None and handle.part and (handle.first_block, handle.lease_id) == (0, "a" * 32)
    assert handle.block_ids == list(range(32)) and handle.kv_address == "tcp://127.0.0.1:7040"
    assert "r-1" in d.cluster.placements and d.decode_pool.placements["r-1"].worker_id == "d0"
    d.join("d1", "decode")  # emptier than d0 now: the rest must still go to d0
    d.desk.kv_part(prefill, d.members["p0"].hello, part("r-1", 32, 32, "b"), 0.6)
    d.desk.kv_ready(prefill, d.members["p0"].hello, ready("r-1"), 0.7)
    assert [identity for identity, _, _ in d.sent[1:]] == [decode, decode]
    more = [message for _, message, _ in d.sent[1:]]
    assert all(isinstance(message, KvMore) for message in more)
    assert more[0].kv_handle.part and more[0].kv_handle.first_block == 32
    assert not more[1].kv_handle.part and more[1].kv_handle.first_token_id == 7
    assert "r-1" not in d.cluster.placements and d.decode_pool.placements["r-1"].worker_id == "d0"
    assert not d.desk.pending and not d.desk.parked and not releases(d.sent)


def test_a_prefill_that_ends_without_a_hand_off_stops_the_import_of_its_parts():
    """The first token ended the request (or its prefill worker was lost): the decode
    worker importing its parts is told to abort, and its placement ends."""
    d = Desk()
    prefill = d.join("p0", "prefill")
    decode = d.join("d0", "decode")
    d.prefill("r-1", "p0")
    d.desk.kv_part(prefill, d.members["p0"].hello, part("r-1", 0, 32, "a"), 0.5)
    assert d.desk.importing_on("r-1") == "d0"
    d.desk.forget("r-1")
    identity, abort, _ = d.sent[-1]
    assert identity == decode and isinstance(abort, Abort) and abort.request_id == "r-1"
    assert "r-1" not in d.decode_pool.placements and d.desk.importing_on("r-1") is None


def test_an_import_its_decode_worker_ended_leaves_the_whole_lease_to_pairing():
    """The importing decode worker dropped the request (or was lost) while the prefill
    ran: the whole prompt's lease is placed as if no part had been sent."""
    d = Desk()
    prefill = d.join("p0", "prefill")
    d.join("d0", "decode")
    d.prefill("r-1", "p0")
    d.desk.kv_part(prefill, d.members["p0"].hello, part("r-1", 0, 32, "a"), 0.5)
    assert not d.desk.import_ended("r-1", "d1")  # not the importing worker
    assert d.desk.import_ended("r-1", "d0") and "r-1" not in d.decode_pool.placements
    d.sent.clear()
    d.desk.kv_ready(prefill, d.members["p0"].hello, ready("r-1"), 1.0)
    [(_, request, _)] = d.sent
    assert isinstance(request, Generate) and request.kv_handle is not None and not request.kv_handle.part


def test_a_part_nobody_takes_is_released():
    """A part for a hand-off this router does not hold, from another prefill worker, or
    with no decode worker to send it to, is released at once (the whole lease brings its
    blocks later)."""
    d = Desk()
    prefill = d.join("p0", "prefill")
    other = d.join("p1", "prefill")
    d.desk.kv_part(prefill, d.members["p0"].hello, part("r-unknown", 0, 4, "a"), 0.1)
    d.prefill("r-1", "p0")
    d.desk.kv_part(other, d.members["p1"].hello, part("r-1", 0, 4, "b"), 0.2)
    d.desk.kv_part(prefill, d.members["p0"].hello, part("r-1", 0, 4, "c"), 0.3)  # no decode worker yet
    assert [(identity, update.lease_id) for identity, update in releases(d.sent)] == \
        [(prefill, "a" * 32), (other, "b" * 32), (prefill, "c" * 32)]
    assert len(d.sent) == 3 and d.desk.importing_on("r-1") is None
