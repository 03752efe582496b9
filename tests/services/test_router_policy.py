"""Placement decisions on constructed cluster states, one test per rule (docs/router.md §4)."""
import numpy as np
import pytest

from common.cost_model import TINY_CPU
from common.hashing import chain_hashes, root_hash
from services.router.cluster import ClusterState
from services.router.policies import POLICIES, make_policy
from services.router.policies.cache_aware import CacheAware
from services.router.policies.dynamo import Dynamo, DynamoConfig
from services.router.policies.e2 import E2, E2Config

BLOCK = 16
ROOT = root_hash("model", "tokenizer", "", "bfloat16", BLOCK)


def tokens(seed: int, count: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, count).astype(np.uint32)


def cluster_of(*worker_ids: str, kv_blocks: int = 10_000, window_s: float = 180.0) -> ClusterState:
    cluster = ClusterState(BLOCK, TINY_CPU, window_s)
    for worker_id in worker_ids:
        cluster.add_worker(worker_id, kv_blocks)
    return cluster


def cache(cluster: ClusterState, worker_id: str, prompt: np.ndarray, now: float = 0.0) -> None:
    """The worker reports (as KV events) that it holds every full block of `prompt`."""
    cluster.kv_stored(worker_id, chain_hashes(ROOT, prompt, BLOCK), now)


def busy(cluster: ClusterState, worker_id: str, requests: int, now: float = 0.0, prompt_len: int = 2000) -> None:
    """Queue `requests` unshared prompts on the worker (placed, not finished)."""
    for index in range(requests):
        request = cluster.prepare(f"{worker_id}-busy-{index}", ROOT, tokens(10_000 + index, prompt_len), 64, now)
        cluster.place(request, worker_id, now)


def request_for(cluster: ClusterState, prompt: np.ndarray, now: float = 0.0, request_id: str = "r"):
    return cluster.prepare(request_id, ROOT, prompt, 64, now)


def test_every_policy_is_selectable_by_name_and_ranks_every_worker():
    cluster = cluster_of("a", "b", "c")
    for name in POLICIES:
        policy = make_policy(name)
        assert policy.name == name
        assert sorted(policy.choose(request_for(cluster, tokens(1, 100)), cluster, 0.0)) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="psychic"):
        make_policy("psychic")


def test_round_robin_rotates_over_workers():
    cluster = cluster_of("b", "a", "c")
    policy = make_policy("round_robin")
    firsts = [policy.choose(request_for(cluster, tokens(1, 100)), cluster, 0.0)[0] for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]


def test_least_load_is_cache_blind_and_prefers_the_least_windowed_work():
    cluster = cluster_of("a", "b")
    shared = tokens(1, 1024)
    cache(cluster, "a", shared)
    busy(cluster, "a", 2)
    busy(cluster, "b", 1)
    assert make_policy("least_load").choose(request_for(cluster, shared), cluster, 0.0)[0] == "b"


def test_the_seed_counter_example_e2_explores_to_an_idle_worker_where_lpm_piles_on():
    """A hot holder with a long queue: its cached prefix is under half the prompt, so E2
    weighs its queue against recomputing the prefix on an idle worker."""
    cluster = cluster_of("hot", "idle")
    shared = tokens(1, 800)
    cache(cluster, "hot", shared)
    busy(cluster, "hot", 20)
    prompt = np.concatenate([shared, tokens(2, 1200)])
    request = request_for(cluster, prompt)
    assert request.matched == {"hot": 50}
    assert make_policy("lpm").choose(request, cluster, 0.0)[0] == "hot"
    assert make_policy("e2").choose(request, cluster, 0.0)[0] == "idle"


def test_e2_explores_to_the_holder_when_its_queue_is_short():
    cluster = cluster_of("holder", "other")
    shared = tokens(1, 800)
    cache(cluster, "holder", shared)
    busy(cluster, "other", 1)
    request = request_for(cluster, np.concatenate([shared, tokens(2, 1200)]))
    assert make_policy("e2").choose(request, cluster, 0.0)[0] == "holder"


def test_e2_exploits_a_long_prefix_on_the_least_loaded_of_its_holders():
    cluster = cluster_of("a", "b", "c")
    shared = tokens(1, 1600)
    for worker_id in ("a", "b"):
        cache(cluster, worker_id, shared)
    busy(cluster, "a", 3)
    busy(cluster, "b", 2)
    request = request_for(cluster, np.concatenate([shared, tokens(2, 100)]))
    assert make_policy("e2").choose(request, cluster, 0.0)[0] == "b"  # c is idler but holds nothing


def test_e2_m_term_steers_away_from_evicting_a_hot_prefix():
    """Both workers are full; on `a` the blocks next in line for eviction are a prefix hit
    many times, on `b` they were never hit: placing on `a` would cost their recompute."""
    cluster = cluster_of("a", "b", kv_blocks=200)
    hot, cold = tokens(1, 1600), tokens(2, 1600)
    cache(cluster, "a", hot)
    cache(cluster, "b", cold)
    for index in range(30):  # earlier requests reused the hot prefix on a
        reuse = request_for(cluster, np.concatenate([hot, tokens(100 + index, 32)]), request_id=f"h{index}")
        cluster.index.record_hits(reuse.path, "a", 0.0)
    for worker_id in ("a", "b"):
        cluster.report(worker_id, running=0, waiting=0, kv_blocks_used=100, kv_blocks_cached=100)
    request = request_for(cluster, tokens(3, 1600), request_id="new")
    policy = make_policy("e2")
    assert cluster.eviction_cost_s(request, "a", 0.0) > 0 == cluster.eviction_cost_s(request, "b", 0.0)
    assert policy.choose(request, cluster, 0.0)[0] == "b"


def test_e2_rebalances_the_heavy_workers_prefixes_to_the_light_one_cheapest_first():
    cluster = cluster_of("heavy", "light")
    families = {name: tokens(seed, length) for name, seed, length in
                (("short", 1, 800), ("long", 2, 1600))}
    for prompt in families.values():
        cache(cluster, "heavy", prompt)
    now = 0.0
    for index in range(6):  # both families went to their only holder
        for name, prompt in families.items():
            request = request_for(cluster, np.concatenate([prompt, tokens(50 + index, 16)]), now,
                                  f"{name}{index}")
            cluster.place(request, "heavy", now)
    policy = E2()  # heavy's load ≥ 1.5 × light's (zero): half the gap moves, shortest prefix first
    short = request_for(cluster, np.concatenate([families["short"], tokens(90, 16)]), now, "s")
    assert policy.choose(short, cluster, now)[0] == "light"
    long = request_for(cluster, np.concatenate([families["long"], tokens(91, 16)]), now, "l")
    assert policy.choose(long, cluster, now)[0] == "heavy"
    assert not policy.redirects  # the one move is made; light holds the short prefix from now on


def test_e2_does_not_rebalance_below_the_threshold():
    cluster = cluster_of("a", "b")
    shared = tokens(1, 1600)
    cache(cluster, "a", shared)
    busy(cluster, "a", 3, prompt_len=1000)
    busy(cluster, "b", 3, prompt_len=800)  # a's load is under 1.5 × b's
    policy = E2()
    request = request_for(cluster, np.concatenate([shared, tokens(2, 64)]), 10.0)
    assert policy.choose(request, cluster, 10.0)[0] == "a"
    assert not policy.redirects


def test_e2_replicates_a_prefix_whose_ttft_doubled_and_splits_its_traffic():
    cluster = cluster_of("holder", "spare", window_s=60.0)
    shared = tokens(1, 1600)
    cache(cluster, "holder", shared)
    policy = E2(E2Config(rebalance=False))  # this rule alone
    prompt = lambda index: np.concatenate([shared, tokens(100 + index, 16)])  # noqa: E731
    for index, (now, ttft) in enumerate([(1.0, 0.1), (2.0, 0.1), (3.0, 0.1), (40.0, 0.3), (41.0, 0.3)]):
        request = request_for(cluster, prompt(index), now, f"r{index}")
        assert policy.choose(request, cluster, now)[0] == "holder"
        policy.finished(cluster.place(request, "holder", now), ttft, now)
    request = request_for(cluster, prompt(10), 42.0, "still")
    assert policy.choose(request, cluster, 42.0)[0] == "holder"  # two recent samples: not yet
    policy.finished(cluster.place(request, "holder", 42.0), 0.3, 42.0)
    request = request_for(cluster, prompt(11), 43.0, "split")
    assert policy.choose(request, cluster, 43.0)[0] == "spare"  # replica, and less loaded
    assert policy.replicas[request.prefix_key].worker_id == "spare"


def test_cache_aware_follows_the_match_above_the_threshold_and_balances_otherwise():
    cluster = cluster_of("a", "b")
    shared = tokens(1, 640)
    cache(cluster, "a", shared)
    busy(cluster, "a", 3)
    policy = CacheAware()
    hit = request_for(cluster, np.concatenate([shared, tokens(2, 960)]))  # 40% cached > 0.3
    assert policy.choose(hit, cluster, 0.0)[0] == "a"
    weak = request_for(cluster, np.concatenate([shared, tokens(2, 2000)]))  # 24% cached
    assert policy.choose(weak, cluster, 0.0)[0] == "b"


def test_cache_aware_balances_when_loads_differ_by_more_than_64_and_1_5x():
    cluster = cluster_of("a", "b")
    shared = tokens(1, 1600)
    cache(cluster, "a", shared)
    busy(cluster, "a", 65, prompt_len=32)
    request = request_for(cluster, np.concatenate([shared, tokens(2, 16)]))
    assert CacheAware().choose(request, cluster, 0.0)[0] == "b"
    busy(cluster, "b", 10, prompt_len=32)  # 65 vs 10: the gap is under 64 now
    assert CacheAware().choose(request, cluster, 0.0)[0] == "a"


def test_dynamo_weighs_prefill_blocks_against_blocks_in_use():
    cluster = cluster_of("a", "b")
    shared = tokens(1, 1600)  # 100 blocks cached on a
    cache(cluster, "a", shared)
    request = request_for(cluster, np.concatenate([shared, tokens(2, 160)]))
    cluster.report("a", running=4, waiting=0, kv_blocks_used=150, kv_blocks_cached=0)
    assert Dynamo().choose(request, cluster, 0.0)[0] == "b"  # 10 + 150 > 110 + 0
    cluster.report("a", running=1, waiting=0, kv_blocks_used=50, kv_blocks_cached=0)
    assert Dynamo().choose(request, cluster, 0.0)[0] == "a"  # 10 + 50 < 110
    sampled = Dynamo(DynamoConfig(temperature=1.0, seed=3))
    firsts = {sampled.choose(request, cluster, 0.0)[0] for _ in range(50)}
    assert firsts == {"a", "b"}


def test_two_tenants_with_the_same_tokens_never_match_each_others_blocks():
    cluster = cluster_of("a", "b")
    prompt = tokens(1, 1600)
    cache(cluster, "a", prompt)
    other_root = root_hash("model", "tokenizer", "", "bfloat16", BLOCK, tenant_salt="tenant-b")
    same_tenant = cluster.prepare("x", ROOT, prompt, 16, 0.0)
    other_tenant = cluster.prepare("y", other_root, prompt, 16, 0.0)
    assert same_tenant.matched == {"a": 100}
    assert other_tenant.matched == {} and other_tenant.path == []
