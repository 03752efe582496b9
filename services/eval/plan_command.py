"""`svc plan`: the prefill/decode ratio with the best goodput per GPU (services/eval/planner.py).

Only click is imported here; the planner, the simulator and the workloads are imported
when the command runs.
"""
from __future__ import annotations

import json

import click

POSITIVE = click.FloatRange(min=0.0, min_open=True)


@click.command("plan")
@click.option("--profile", help="cost profile file or built-in name, e.g. a100/opt-13b (an analytic name "
                                "without /tp<N> searches every tensor-parallel degree that fits)")
@click.option("--workload", help="workload shape to simulate, e.g. chat, toolbench")
@click.option("--scale", type=POSITIVE, default=1.0, show_default=True,
              help="multiplies every prompt and output length of the workload")
@click.option("--option", "option_pairs", multiple=True, metavar="KEY=VALUE",
              help="a workload shape option, e.g. questions_per_document=1 (repeatable)")
@click.option("--ttft-slo", type=POSITIVE, help="TTFT target in seconds")
@click.option("--tpot-slo", type=POSITIVE, help="TPOT target in seconds")
@click.option("--attainment", type=click.FloatRange(0.0, 1.0, min_open=True), default=0.9, show_default=True,
              help="fraction of requests that must meet the SLOs")
@click.option("--gpus", type=click.IntRange(min=2), default=8, show_default=True,
              help="GPU budget: every layout of the instances it holds (at each tp degree) is simulated")
@click.option("--link", default="rdma-400g", show_default=True,
              help="the link KV moves over between pools: nvlink, rdma-400g, tcp-25g... (a wrong name lists them)")
@click.option("--max-local-prefill-tokens", type=click.IntRange(min=0), default=1000, show_default=True,
              help="a decode worker prefills a request itself when it lacks at most this many prompt tokens")
@click.option("--policy", default="e2", show_default=True, help="the router's placement policy")
@click.option("--capacities", help="per-GPU goodputs prefill=R,decode=R,colocated=R (req/s/GPU, tp 1) "
                                   "instead of simulating: DistServe's formula; replaces --profile and --workload")
@click.option("--num-requests", type=click.IntRange(min=1), default=300, show_default=True,
              help="requests in a simulation; more (up to 10x) at rates whose requests' lifetimes need "
                   "a longer run to show a backlog")
@click.option("--seed", type=int, default=0, show_default=True, help="workload and arrival seed")
@click.option("--json", "as_json", is_flag=True, help="print the plan as one JSON object")
def plan(profile, workload, scale, option_pairs, ttft_slo, tpot_slo, attainment, gpus, link,
         max_local_prefill_tokens, policy, capacities, num_requests, seed, as_json) -> None:
    """Find the prefill/decode ratio with the best goodput per GPU, against co-located.

    Simulated (--profile, --workload and both SLOs): every layout of the budget's
    instances, all co-located or P prefill + D decode instances, runs whole on the
    disaggregated simulator (KV transfer over --link included), and its goodput is the
    highest Poisson rate at which --attainment of the requests meet both SLOs
    (DistServe's metric). With --capacities, DistServe's formula
    min(g_p·Γ_p, g_d·Γ_d) / (g_p + g_d) over given per-phase goodputs instead."""
    if capacities is not None:
        _plan_from_capacities(capacities, profile, workload, gpus, as_json)
        return
    from services.eval.planner import PlanError

    try:
        plans = _simulated_plans(profile, workload, scale, option_pairs, ttft_slo, tpot_slo, attainment, gpus,
                                 link, max_local_prefill_tokens, policy, num_requests, seed)
    except PlanError as error:
        raise click.ClickException(str(error)) from error
    best = max(plans, key=lambda p: max(p.best_split.goodput_per_gpu, p.colocated.goodput_per_gpu))
    if as_json:
        click.echo(json.dumps({"plan": best.to_json(), "by_tp": [p.to_json() for p in plans]},
                              separators=(",", ":")))
    else:
        for pool_plan in plans:
            _echo_pool_plan(pool_plan)


def _plan_from_capacities(capacities: str, profile, workload, gpus: int, as_json: bool) -> None:
    from services.eval.planner import PlanError, search

    goodputs = _given_goodputs(capacities, profile, workload)
    try:
        result = search(goodputs, gpus)
    except PlanError as error:
        raise click.ClickException(str(error)) from error
    if as_json:
        click.echo(json.dumps(result.to_json(), separators=(",", ":")))
    else:
        _echo_plan(result)


def _given_goodputs(capacities: str, profile: str | None, workload: str | None):
    from services.eval.planner import PlanError, parse_capacities

    if profile is not None or workload is not None:
        raise click.UsageError("--capacities replaces the simulation: give it without --profile and --workload")
    try:
        return parse_capacities(capacities)
    except PlanError as error:
        raise click.BadParameter(str(error), param_hint="--capacities") from error


def _simulated_plans(profile, workload, scale, option_pairs, ttft_slo, tpot_slo, attainment, gpus, link,
                     max_local_prefill_tokens, policy, num_requests, seed):
    """A PoolPlan per tensor-parallel degree of the profile that leaves at least two
    instances in the budget."""
    from typing import Any

    from common.cost_model import ProfileError
    from services.eval import sim_runner
    from services.eval.disagg import LINKS
    from services.eval.planner import (
        MAX_REQUESTS_FACTOR,
        PlanError,
        base_config,
        instance_profiles,
        search_layouts,
    )
    from services.eval.report import Slo
    from services.eval.workloads import make_workload
    from services.router.policies import POLICIES

    missing = [flag for flag, value in (("--profile", profile), ("--workload", workload),
                                        ("--ttft-slo", ttft_slo), ("--tpot-slo", tpot_slo)) if value is None]
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)} (needed unless --capacities is given)")
    if link.strip().lower() not in LINKS:
        raise click.BadParameter(f"unknown {link!r}; known: {', '.join(LINKS)}", param_hint="--link")
    if policy not in POLICIES:
        raise click.BadParameter(f"unknown {policy!r}; known: {', '.join(POLICIES)}", param_hint="--policy")
    try:
        profiles = instance_profiles(profile)
    except (ProfileError, PlanError) as error:
        raise click.BadParameter(str(error), param_hint="--profile") from error
    try:
        options: dict[str, Any] = dict(sim_runner.parse_options(option_pairs, None))  # make_workload checks them
        requests = make_workload(workload, num_requests * MAX_REQUESTS_FACTOR, seed, scale=scale, **options)
    except (ValueError, TypeError) as error:
        raise click.BadParameter(str(error), param_hint="--workload") from error
    plans = []
    for tp, cost in sorted(profiles.items()):
        if gpus // tp < 2:
            continue
        try:
            base = base_config(cost, link, policy, max_local_prefill_tokens)
        except PlanError as error:
            raise click.BadParameter(str(error), param_hint="--profile") from error
        plans.append(search_layouts(base, tp, gpus // tp, requests, Slo(ttft_slo, tpot_slo), attainment,
                                    num_requests, seed))
    if not plans:
        raise PlanError(f"no tensor-parallel degree of {profile} leaves two instances in {gpus} GPUs")
    return plans


def _echo_pool_plan(pool_plan) -> None:
    click.echo(f"tp{pool_plan.colocated.tp}, KV over {pool_plan.link}; goodput at "
               f"{pool_plan.target:.0%} SLO attainment:")
    for candidate in pool_plan.candidates:
        click.echo(f"  {candidate.layout.label:<14} {candidate.goodput_rps:8.2f} req/s "
                   f"{candidate.goodput_per_gpu:8.3f} req/s/GPU")
    split, colocated = pool_plan.best_split, pool_plan.colocated
    ratio = f" ({split.goodput_per_gpu / colocated.goodput_per_gpu:.2f}x co-located)" \
        if colocated.goodput_per_gpu > 0 else ""
    click.echo(f"  best split {split.layout.label}: {split.goodput_per_gpu:.3f} req/s/GPU{ratio}; "
               f"{pool_plan.winner} wins")


def _echo_plan(result) -> None:
    prefill, decode, colocated = result.prefill, result.decode, result.colocated
    click.echo(f"prefill:    {_pool(prefill)} at {prefill.goodput_per_gpu:.2f} req/s/GPU")
    click.echo(f"decode:     {_pool(decode)} at {decode.goodput_per_gpu:.2f} req/s/GPU")
    click.echo(f"plan:       {prefill.instances}P:{decode.instances}D on {result.gpus} of {result.budget} GPUs: "
               f"{result.goodput_per_gpu:.2f} req/s/GPU")
    gain = f" (the plan serves {result.goodput_per_gpu / colocated.goodput_per_gpu:.2f}x)" \
        if colocated.goodput_per_gpu > 0 else ""
    click.echo(f"co-located: {_pool(colocated)}: {colocated.goodput_per_gpu:.2f} req/s/GPU of {result.budget}{gain}")
    if result.goodput_per_gpu == 0:
        click.echo("no split meets the SLOs at any simulated rate", err=True)


def _pool(pool) -> str:
    return f"{pool.instances} x tp{pool.tp} = {pool.gpus} GPU{'s' if pool.gpus != 1 else ''}"
