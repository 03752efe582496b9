"""Admission control decisions on constructed cluster states (docs/router.md §5)."""
import numpy as np

from common.config import SloClass
from common.cost_model import TINY_CPU
from common.hashing import root_hash
from services.router.admission import AdmissionConfig, AdmissionControl
from services.router.cluster import ClusterState

ROOT = root_hash("model", "tokenizer", "", "bfloat16", 16)
INTERACTIVE = SloClass("interactive", ttft_s=0.5, tpot_s=0.05)


def cluster_of(*worker_ids: str) -> ClusterState:
    cluster = ClusterState(16, TINY_CPU)
    for worker_id in worker_ids:
        cluster.add_worker(worker_id, 10_000)
    return cluster


def prompt(seed: int, count: int = 1000) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, count).astype(np.uint32)


def admission(enabled: bool = True, **bounds) -> AdmissionControl:
    return AdmissionControl(AdmissionConfig(enabled, **bounds), {"interactive": INTERACTIVE})


def submit(control, cluster, index: int, slo_class: str = "interactive", now: float = 0.0, tokens: int = 1000):
    request = cluster.prepare(f"r{index}", ROOT, prompt(index, tokens), 16, now, slo_class)
    verdict = control.decide(request, sorted(cluster.workers), cluster, now)
    if verdict.worker_id is not None:
        cluster.place(request, verdict.worker_id, now)
    return verdict


def test_a_burst_beyond_capacity_is_refused_early_and_what_is_admitted_fits_its_slo():
    cluster = cluster_of("a", "b")
    control = admission()
    verdicts = [submit(control, cluster, index) for index in range(40)]
    admitted = [v for v in verdicts if v.worker_id is not None]
    refused = [v for v in verdicts if v.worker_id is None]
    per_prefill = TINY_CPU.prefill_s(1000)
    assert len(admitted) == 2 * int(INTERACTIVE.ttft_s // per_prefill)  # each worker's queue fills to the SLO
    assert all(v.predicted_ttft_s <= INTERACTIVE.ttft_s for v in admitted)
    assert refused and all("interactive" in v.reason and v.retry_after_s > 0 for v in refused)
    assert verdicts.index(refused[0]) == len(admitted)  # nothing is admitted after the first refusal


def test_the_retry_after_says_when_the_queue_will_have_drained_enough():
    cluster = cluster_of("a")
    control = admission()
    while submit(control, cluster, len(cluster.placements)).worker_id is not None:
        pass
    refused = submit(control, cluster, 999)
    later = submit(control, cluster, 1000, now=refused.retry_after_s + 1e-6)
    assert later.worker_id == "a"


def test_a_tpot_slo_the_decode_batch_would_break_is_refused():
    cluster = cluster_of("a")
    control = AdmissionControl(AdmissionConfig(True), {"tight": SloClass("tight", ttft_s=100.0, tpot_s=0.006)})
    verdicts = [submit(control, cluster, index, "tight", tokens=64) for index in range(30)]
    admitted = sum(v.worker_id is not None for v in verdicts)
    assert 0 < admitted < 30
    assert all(v.predicted_tpot_s <= 0.006 for v in verdicts if v.worker_id)


def test_requests_without_a_class_and_admission_off_are_never_refused_for_slo():
    cluster = cluster_of("a")
    off = admission(enabled=False)
    on = admission()
    assert all(submit(off, cluster, index).worker_id == "a" for index in range(40))
    assert all(submit(on, cluster, 100 + index, slo_class="").worker_id == "a" for index in range(10))


def test_queue_bounds_back_admission_up():
    cluster = cluster_of("a", "b")
    control = admission(enabled=False, max_queued_requests=3)
    placed = [submit(control, cluster, index).worker_id for index in range(8)]
    assert placed == ["a"] * 3 + ["b"] * 3 + [None] * 2  # none reported running: all count as queued
    refused = submit(control, cluster, 11)
    assert refused.worker_id is None and "queue" in refused.reason
    cluster.report("a", running=3, waiting=0, kv_blocks_used=0, kv_blocks_cached=0)
    assert submit(control, cluster, 12).worker_id == "a"


def test_the_token_bound_counts_only_the_requests_still_waiting():
    cluster = cluster_of("a")
    control = admission(enabled=False, max_queued_tokens=2500)
    # Nothing reported running yet: a second waiting 1,000-token prompt would pass 2,500.
    assert [submit(control, cluster, index).worker_id for index in range(3)] == ["a", "a", None]
    cluster.report("a", running=1, waiting=1, kv_blocks_used=0, kv_blocks_cached=0)  # 1,000 tokens wait
    assert submit(control, cluster, 5).worker_id == "a"
    assert submit(control, cluster, 6).worker_id is None  # 2,000 waiting + 1,000 > 2,500
