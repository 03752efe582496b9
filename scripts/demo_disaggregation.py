"""Where prefill/decode disaggregation wins and where it loses, in simulation on an
analytic GPU profile (docs/evaluation.md §4).

    PYTHONPATH=. python scripts/demo_disaggregation.py [--gpus 4] [--num-requests 100] [--json]

For each case, the planner (services/eval/planner.py: search_layouts) simulates every
layout of the GPUs, all co-located or P prefill + D decode instances, with the KV
transfer over the case's link, and finds each one's goodput: the highest Poisson rate at
which 90 % of the requests meet both their TTFT and TPOT targets (DistServe's metric).
It prints co-located goodput per GPU beside the best P:D ratio's and says which wins.
The cases: long prompts with a tight TPOT target over RDMA and the same over 25 Gb/s TCP
(where each pull takes long enough to spend the TPOT budget), and short prompts with
long replies.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

from common.cost_model import load_cost_model
from services.eval.planner import PoolPlan, base_config, search_layouts
from services.eval.report import Slo
from services.eval.workloads import make_workload

PROFILE = "a6000/mistral-7b/tp1"


@dataclass(frozen=True)
class Case:
    title: str
    workload: str
    scale: float
    options: tuple[tuple[str, int], ...]
    slo: Slo
    link: str


CASES = (
    # programming: ~3.7k-token prompts (x2 here), 84-token replies (x2), 8 samples per problem.
    Case("long prompts, tight TPOT", "programming", 2.0, (), Slo(ttft_s=4.0, tpot_s=0.06), "rdma-400g"),
    Case("long prompts, tight TPOT, slow link", "programming", 2.0, (), Slo(ttft_s=4.0, tpot_s=0.06), "tcp-25g"),
    # chat: ~1.6k-token prompts, mostly the conversation so far (cached), ~260-token replies.
    Case("short new prompts, long replies", "chat", 1.0, (), Slo(ttft_s=1.0, tpot_s=0.1), "rdma-400g"),
)


def plan_case(case: Case, gpus: int, num_requests: int, seed: int) -> tuple[PoolPlan, dict]:
    """The case's plan, and the shape of its sample (mean prompt and reply tokens)."""
    requests = make_workload(case.workload, num_requests * 10, seed, scale=case.scale, **dict(case.options))
    shape = {"prompt_tokens": sum(r.num_tokens for r in requests) / len(requests),
             "output_tokens": sum(r.output_tokens for r in requests) / len(requests)}
    base = base_config(load_cost_model(PROFILE), case.link)
    return search_layouts(base, 1, gpus, requests, case.slo, 0.9, num_requests, seed), shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--num-requests", type=int, default=100, help="the shortest run of a rate search")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="end with one JSON line of every plan")
    args = parser.parse_args()
    print(f"{PROFILE}, {args.gpus} GPUs; goodput = the highest rate with 90% of requests within both SLOs")
    results = []
    for case in CASES:
        started = time.perf_counter()
        plan, shape = plan_case(case, args.gpus, args.num_requests, args.seed)
        split, colocated = plan.best_split, plan.colocated
        gain = split.goodput_per_gpu / colocated.goodput_per_gpu if colocated.goodput_per_gpu else float("inf")
        print(f"\n{case.title}: {case.workload} x{case.scale:g} ({shape['prompt_tokens']:,.0f} prompt / "
              f"{shape['output_tokens']:,.0f} output tokens), TTFT {case.slo.ttft_s:g} s, TPOT "
              f"{case.slo.tpot_s:g} s, KV over {case.link}")
        for candidate in plan.candidates:
            print(f"  {candidate.layout.label:<14} {candidate.goodput_per_gpu:7.3f} req/s/GPU")
        print(f"  => co-located {colocated.goodput_per_gpu:.3f}, best P:D {split.layout.label} "
              f"{split.goodput_per_gpu:.3f} req/s/GPU ({gain:.2f}x): {plan.winner} wins "
              f"[{time.perf_counter() - started:.0f} s]")
        results.append({"case": case.title, "workload": case.workload, "scale": case.scale, **shape,
                        "ttft_slo_s": case.slo.ttft_s, "tpot_slo_s": case.slo.tpot_s, **plan.to_json()})
    if args.json:
        print(json.dumps(results, separators=(",", ":")))


if __name__ == "__main__":
    main()
