"""The simulated KV store (services/eval/sim_store.py, docs/evaluation.md §3.2): write-back
of what an engine evicts, fetch only when it beats recomputing, the live index's tiers,
and `svc sim` comparing runs without and with the store."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from common.cost_model import CostModel, LatencyFit
from services.cli import main
from services.eval.sim_store import SimStore, StoreModel
from services.eval.simulator import SimConfig, simulate
from services.eval.workloads.base import WorkloadRequest

# Round numbers, so the expected times are plain arithmetic (as in test_simulator.py).
COST = CostModel("hand", prefill=LatencyFit(a=0.010, b=0.001, c=0.0001, d=0.0),
                 decode=LatencyFit(a=0.005, b=0.002, c=0.0, d=0.00001))
BLOCK_BYTES = 1_000_000  # 1 MB a block: 0.2 ms from DRAM at 5 GB/s, 1 ms from SSD at 1 GB/s
SHARED_TRACE = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


def request(request_id: str, arrival_s: float, prompt_tokens: int, seed: int) -> WorkloadRequest:
    tokens = np.random.default_rng(seed).integers(4, 500, prompt_tokens).astype(np.uint32)
    return WorkloadRequest(request_id, arrival_s, tokens, 1, "test")


def evict_then_repeat() -> list[WorkloadRequest]:
    """On one worker of 30 blocks: "a" fills 20 (320 tokens), "c" takes 20 more, which
    evicts a's last 10 blocks (a prompt's tail goes first), and "b" repeats a's prompt
    plus 8 tokens: the worker holds its first 160 tokens, the store can give the next 160."""
    a = request("a", 0.0, 320, seed=0)
    b = WorkloadRequest("b", 2.0, np.concatenate([a.token_ids, [7] * 8]).astype(np.uint32), 1, "test")
    return [a, request("c", 1.0, 320, seed=1), b]


def run(store: StoreModel):
    config = SimConfig(workers=1, policy="round_robin", cost=COST, kv_blocks=30, kv_bytes_per_block=BLOCK_BYTES,
                       store=store)
    result = simulate(evict_then_repeat(), config)
    return {r.request_id: r for r in result.records}, result.store


def ttft(record) -> float:
    return record.first_token_s - record.arrival_s


def test_a_prefix_the_engine_evicted_is_fetched_from_dram_and_lowers_ttft():
    without, none = run(StoreModel())
    with_store, report = run(StoreModel(dram_gb=0.1))
    assert none is None
    assert without["b"].num_cached_tokens == 160
    assert ttft(without["b"]) == pytest.approx(0.010 + 0.001 * 168 + 0.0001 * 160)
    # 10 blocks from DRAM: 1 ms + 10 MB at 5 GB/s; then 8 new tokens over 320 cached
    assert with_store["b"].num_cached_tokens == 320
    assert ttft(with_store["b"]) == pytest.approx(0.001 + 0.002 + 0.010 + 0.001 * 8 + 0.0001 * 320)
    assert report["tokens"] == {"engine": 160, "dram": 160, "ssd": 0, "computed": 320 + 320 + 8}
    assert report["dram_hit_rate"] == pytest.approx(160 / 968)
    assert report["fetches"] == 1 and report["fetched_blocks"] == 10 and report["fetches_skipped"] == 0
    for name in ("a", "c"):  # nothing to fetch for them: the same times
        assert ttft(with_store[name]) == pytest.approx(ttft(without[name]))


def test_blocks_demoted_to_ssd_are_fetched_from_there_and_promoted():
    records, report = run(StoreModel(dram_gb=0.01, ssd_gb=0.1))  # DRAM: 10 blocks, SSD: 100
    assert report["demoted"] > 0 and report["promoted"] > 0
    tokens = report["tokens"]
    assert tokens["ssd"] > 0 and tokens["dram"] + tokens["ssd"] == 160  # the older blocks went to SSD
    dram_blocks, ssd_blocks = tokens["dram"] // 16, tokens["ssd"] // 16
    fetch_s = (0.001 + dram_blocks * 0.0002 if dram_blocks else 0.0) + 0.002 + ssd_blocks * 0.001
    assert report["fetch_s"] == pytest.approx(fetch_s)
    assert ttft(records["b"]) == pytest.approx(fetch_s + 0.010 + 0.001 * 8 + 0.0001 * 320)


def test_a_fetch_slower_than_recomputing_is_skipped():
    without, _ = run(StoreModel())
    slow, report = run(StoreModel(dram_gb=0.1, dram_gbps=1e-3))  # 1 s a block
    assert report["fetches"] == 0 and report["fetches_skipped"] == 1
    assert report["tokens"]["dram"] == 0 and report["tokens"]["engine"] == 160
    assert slow["b"].num_cached_tokens == 160
    assert ttft(slow["b"]) == pytest.approx(ttft(without["b"]))


def test_the_fetch_stops_where_the_next_tier_costs_more_than_it_saves():
    store = SimStore(StoreModel(dram_gb=0.1, ssd_gb=0.1, ssd_gbps=1e-3), BLOCK_BYTES)
    count, fetch_s = store.plan_fetch(("dram",) * 4 + ("ssd",) * 4, 0, 16, COST)
    assert count == 4 and fetch_s == pytest.approx(0.001 + 4 * 0.0002)
    assert store.plan_fetch(("ssd",) * 4, 0, 16, COST) == (0, 0.0)


def chain(start: int, length: int) -> list[tuple[int, int | None]]:
    return [(start + i, start + i - 1 if i else None) for i in range(length)]


def test_the_store_evicts_leaves_first_lru_down_to_its_low_watermark():
    store = SimStore(StoreModel(dram_gb=0.01), BLOCK_BYTES)  # 10 blocks: evict above 9 down to 8
    old, new = chain(100, 6), chain(200, 4)
    store.put_chain(old, now=0.0)
    store.put_chain(new, now=1.0)
    # The older chain loses its two deepest blocks; nothing is left without its parent.
    assert store.lookup([key for key, _ in old]) == ("dram",) * 4
    assert store.lookup([key for key, _ in new]) == ("dram",) * 4
    assert store.stats()["evicted"] == 2
    store.index.check_integrity()


def test_eviction_demotes_to_ssd_and_a_get_promotes_what_dram_has_room_for():
    store = SimStore(StoreModel(dram_gb=0.01, ssd_gb=0.1), BLOCK_BYTES)  # DRAM 10 blocks, SSD 100
    blocks = chain(1, 12)
    store.put_chain(blocks, now=0.0)
    keys = [key for key, _ in blocks]
    tiers = store.lookup(keys)
    assert len(tiers) == 12 and tiers.count("ssd") == 4  # demoted down to the low watermark, none dropped
    stats = store.stats()
    assert stats["demoted"] == 4 and stats["evicted"] == 0
    assert stats["tiers"]["dram"]["used_blocks"] == 8 and stats["tiers"]["ssd"]["used_blocks"] == 4
    lease = store.get(keys, now=1.0)
    assert store.lookup(keys).count("dram") == 10  # two free DRAM slots: two SSD blocks promoted
    assert store.stats()["promoted"] == 2
    store.release(lease)
    store.index.check_integrity()


# ---- svc sim ---------------------------------------------------------------------------

CHAT = ["--workload", "chat", "--num-requests", "80", "--workers", "2", "--policy", "e2",
        "--profile", "a6000/mistral-7b", "--kv-blocks", "300", "--json"]


def sim_json(*args: str) -> dict:
    result = CliRunner().invoke(main, ["sim", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def without_speed(results: dict) -> dict:
    return {key: {k: v for k, v in r.items() if k != "simulation"} for key, r in results.items()}


def test_zero_sized_tiers_give_exactly_the_run_without_a_store():
    plain = sim_json(*CHAT)
    zeros = sim_json(*CHAT, "--store-dram-gb", "0", "--store-ssd-gb", "0")
    assert list(zeros) == ["e2"]
    assert without_speed(zeros) == without_speed(plain)


def test_a_store_run_prints_both_runs_side_by_side_and_its_hit_rates():
    plain = sim_json(*CHAT)
    result = CliRunner().invoke(main, ["sim", *CHAT, "--store-dram-gb", "2", "--store-ssd-gb", "8"])
    assert result.exit_code == 0, result.output
    both = json.loads(result.stdout.strip().splitlines()[-1])
    assert list(both) == ["e2", "e2+store"]
    assert without_speed({"e2": both["e2"]}) == without_speed(plain)  # the baseline is the plain run
    store = both["e2+store"]["overall"]["store"]
    rates = [store[k] for k in ("engine_hit_rate", "dram_hit_rate", "ssd_hit_rate", "computed_rate")]
    assert sum(rates) == pytest.approx(1.0)
    assert store["dram_hit_rate"] > 0  # the engines' 300 blocks overflow; the store serves some
    assert both["e2+store"]["overall"]["ttft_mean_s"] < both["e2"]["overall"]["ttft_mean_s"]
    assert "e2+store (dram 2 GB, ssd 8 GB): prompt tokens from engine cache" in result.stdout
    only = sim_json(*CHAT, "--store-dram-gb", "2", "--store-ssd-gb", "8", "--store-only")
    assert list(only) == ["e2+store"]


@pytest.mark.parametrize("args, message", [
    (["--workload", "chat", "--workers", "1", "--policy", "e2", "--store-dram-gb", "1"], "names its model"),
    (["--workload", "chat", "--workers", "1", "--policy", "e2", "--profile", "a6000/mistral-7b",
      "--store-ssd-gb", "0.0001"], "--store-ssd-gb: 0.0001 GB holds no block"),
    (["--workload", "chat", "--workers", "1", "--policy", "e2", "--store-dram-gb", "-1"], "--store-dram-gb"),
])
def test_bad_store_options_are_usage_errors_naming_them(args, message):
    result = CliRunner().invoke(main, ["sim", *args])
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason="the shared Mooncake trace is not here")
def test_the_mooncake_trace_runs_with_a_store_and_fetches_from_it():
    results = sim_json("--trace", str(SHARED_TRACE), "--num-requests", "80", "--workers", "1", "--policy", "e2",
                       "--profile", "h100/llama-3-8b", "--kv-blocks", "3600", "--store-dram-gb", "32", "--json")
    store = results["e2+store"]["overall"]["store"]
    assert store["fetches"] >= 1 and store["tiers"]["dram"]["used_blocks"] > 0
    rates = [store[k] for k in ("engine_hit_rate", "dram_hit_rate", "ssd_hit_rate", "computed_rate")]
    assert sum(rates) == pytest.approx(1.0)
