"""scripts/sim_block_floor.py's counting: what it multiplies by the per-block costs must be
the blocks the simulation's engines and index really handled."""
from __future__ import annotations

import collections
import subprocess
import sys

import numpy as np
import pytest

from common.cost_model import load_cost_model
from common.engine.block_manager import BlockManager
from common.hashing import chain_hashes
from services.eval.simulator import SimConfig, simulate
from services.eval.workloads import make_workload
from services.eval.workloads.arrivals import poisson
from services.local_cluster import REPO, child_env
from services.router.index import PrefixIndex
from services.router.native import DISABLE_ENV, compiled
from tests.scripts import load_script


def test_counted_blocks_match_what_the_engines_report_and_the_methods_come_back():
    if compiled():  # the counting wraps methods compiled code calls directly: check it on the sources
        here = f"{__file__}::test_counted_blocks_match_what_the_engines_report_and_the_methods_come_back"
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", here],
                              capture_output=True, text=True, cwd=REPO, env=child_env(**{DISABLE_ENV: "0"}),
                              timeout=300)
        assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr
        return
    floor = load_script("sim_block_floor")
    originals = {name: getattr(owner, method) for name, (owner, method, _) in floor.COUNTED.items()}
    requests = poisson(make_workload("toolbench", 120, seed=3), rate=20.0, seed=3)
    config = SimConfig(workers=2, policy="e2", cost=load_cost_model("a6000/mistral-7b"), kv_blocks=400)
    counts: collections.Counter[str] = collections.Counter()
    chains: collections.Counter[str] = collections.Counter()
    with floor.counting_blocks(counts, chains):
        result = simulate(requests, config)
    assert result.totals.evictions > 0  # small caches: the run evicts
    # Every block an engine evicts leaves the index by a removed event; credits the engine
    # never confirmed leave it too when their requests end.
    assert counts["engine_evicted"] == result.totals.evictions
    assert counts["index_removed"] >= counts["engine_evicted"]
    # Each committed block is held once by its KV event, beside the credits' blocks.
    assert counts["index_held"] >= counts["engine_committed"] > 0
    assert counts["index_named"] > 0 and counts["engine_released"] > 0
    # A chain is at least one block. Each request's table is released as one chain when it
    # ends (and when it is preempted, which these small caches make happen).
    assert all(0 < chains[name] <= counts[name] for name in floor.COUNTED), (counts, chains)
    assert chains["engine_released"] >= len(requests)
    assert {name: getattr(owner, method) for name, (owner, method, _) in floor.COUNTED.items()} == originals
    assert PrefixIndex._hold is originals["index_held"] and BlockManager.commit is originals["engine_committed"]


def test_counting_refuses_the_compiled_modules_rather_than_count_nothing():
    if not compiled():
        pytest.skip("the router's modules run as source here (no build of these sources)")
    floor = load_script("sim_block_floor")
    with pytest.raises(RuntimeError, match=f"{DISABLE_ENV}=0"), floor.counting_blocks(collections.Counter()):
        pass


def test_each_primitive_costs_a_positive_time():
    floor = load_script("sim_block_floor")
    floor.SAMPLE_BLOCKS = 2_000
    costs = floor.primitive_ns()
    assert set(costs) == set(floor.COUNTED) and all(cost > 0 for cost in costs.values())


def test_chains_are_runs_of_blocks_each_the_parent_or_the_child_of_the_one_before():
    floor = load_script("sim_block_floor")
    root = 7
    manager = BlockManager(num_blocks=8, block_size=2)
    for tokens in ([1, 2, 3, 4, 5, 6], [9, 9, 8, 8]):  # two prompts: 3 blocks, then 2
        ids = manager.allocate(len(tokens) // 2)
        manager.commit(ids, chain_hashes(root, tokens, 2), tokens, 0, len(ids), root)
        manager.release(ids)  # cached tail first
    assert floor._evicted_chains(manager, 2) == 1  # the first prompt's last two blocks
    assert floor._evicted_chains(manager, 5) == 2  # both prompts, each whole

    index = PrefixIndex(block_size=2, ttl_s=60.0)
    first = index.block_keys(np.array([1, 2, 3, 4, 5, 6], dtype="<u4"))
    other = index.block_keys(np.array([9, 9, 8, 8], dtype="<u4"))
    assert index.walk(root, first) == []  # nothing named yet; the walk makes the chain's root
    index.placed("w", root, first, [], now=0.0)
    index.placed("w", root, other, [], now=0.0)
    chain = index.walk(root, first)
    lone = index.walk(root, other)[0]
    assert len(chain) == 3
    assert floor._node_chains(chain) == 1 and floor._node_chains(chain[::-1]) == 1
    assert floor._node_chains([chain[0], lone, chain[1], chain[2]]) == 3
    assert floor._node_chains([chain[0], None, chain[1]]) == 3  # a hash the index does not know
