import pytest

from services.router.policy import LeastLoad, PlacementRequest, RoundRobin, WorkerLoad, make_policy

REQUEST = PlacementRequest("r", 100)


def load(worker_id: str, in_flight: int = 0, kv_used: int = 0) -> WorkerLoad:
    return WorkerLoad(worker_id, running=in_flight, waiting=0, in_flight=in_flight, kv_blocks_used=kv_used,
                      kv_blocks_total=100)


def test_round_robin_rotates_over_workers():
    policy = RoundRobin()
    workers = [load("b"), load("a"), load("c")]
    firsts = [policy.choose(REQUEST, workers)[0] for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert sorted(policy.choose(REQUEST, workers)) == ["a", "b", "c"]


def test_least_load_prefers_fewest_in_flight_then_kv():
    ranked = LeastLoad().choose(REQUEST, [load("a", 3), load("b", 1, kv_used=50), load("c", 1, kv_used=10)])
    assert ranked == ["c", "b", "a"]


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="psychic"):
        make_policy("psychic")
