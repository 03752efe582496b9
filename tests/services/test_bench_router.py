"""scripts/bench_router.py end to end at toy sizes: every policy measured, JSON last, a
progress bar only on a terminal."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from services.local_cluster import REPO, child_env
from services.router.policies import POLICIES
from tests.scripts import load_script
from tests.terminal import run_with_stderr_on_terminal

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_router.py"
TINY = ["--workers", "4", "--prompt-tokens", "512", "--families", "4", "--warmup", "50",
        "--decisions", "200", "--min-index-blocks", "100", "--kv-blocks", "200", "--in-flight", "4"]
# The decisions of each policy at TINY sizes as commit f2ba184 made them (bench_router's
# decisions_digest), cost_aware's as the commit that charged the queue ahead of a new prefix
# did: a change of speed must not change where a request goes.
DIGESTS = {"round_robin": "36ac9c595ea38605", "least_load": "7f442be0904bda2f", "lpm": "c9e115a9111a909d",
           "cache_aware": "d13d4c7a98789923", "dynamo": "144c36358debec3a", "e2": "c9e115a9111a909d",
           "cost_aware": "feb317d221a14e23"}




def test_every_policy_reports_a_rate_and_ordered_percentiles(capsys):
    assert load_script("bench_router").main(TINY + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result) == set(POLICIES)
    for row in result.values():
        assert row["decisions_per_s"] > 0
        assert 0 < row["p50_ms"] <= row["p99_ms"]
        assert row["decisions"] == 200
        assert row["index_blocks_start"] >= 100
        assert row["finished"] > 0 and row["events_ms"] > 0
        assert row["cpu_ms"] > 0 and row["cpu_p99_ms"] > 0
        assert row["unconfirmed_blocks"] == 0  # each placement's stored events confirmed its credit
    assert any(row["removed_blocks"] for row in result.values())  # the caches overflowed
    assert {name: row["decisions_digest"] for name, row in result.items()} == DIGESTS


def test_progress_is_drawn_on_a_terminal_and_json_stays_the_last_stdout_line():
    argv = [sys.executable, str(SCRIPT), *TINY, "--policies", "round_robin,e2", "--json"]
    piped = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, env=child_env(), timeout=120)
    assert piped.returncode == 0, piped.stderr
    assert "bench_router:" not in piped.stderr  # not a terminal: no bar
    assert set(json.loads(piped.stdout.strip().splitlines()[-1])) == {"round_robin", "e2"}
    done, drawn = run_with_stderr_on_terminal(argv, cwd=REPO, env=child_env(), timeout=120)
    assert done.returncode == 0, drawn.decode(errors="replace")
    assert b"bench_router: 100%" in drawn and b"2/2" in drawn
    assert set(json.loads(done.stdout.strip().splitlines()[-1])) == {"round_robin", "e2"}


def test_with_the_store_its_blocks_are_counted_and_priced(capsys):
    assert load_script("bench_router").main(TINY + ["--policies", "e2,cache_aware", "--store", "--store-blocks", "300",
                                      "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for name, row in result.items():
        assert row["decisions"] == 200
        assert 0 < row["store_blocks"] <= 300  # evicted blocks written back, the oldest dropped
        assert row["decisions_digest"] == DIGESTS[name]  # as f2ba184 placed them with the store
