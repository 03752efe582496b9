"""`svc plan`: the prefill/decode split with the best goodput per GPU (services/eval/planner.py).

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
@click.option("--ttft-slo", type=POSITIVE, help="TTFT target in seconds")
@click.option("--tpot-slo", type=POSITIVE, help="TPOT target in seconds")
@click.option("--attainment", type=click.FloatRange(0.0, 1.0, min_open=True), default=0.9, show_default=True,
              help="fraction of requests that must meet the SLOs")
@click.option("--gpus", type=click.IntRange(min=2), default=8, show_default=True,
              help="GPU budget: splits use at most this many; the co-located alternative uses all")
@click.option("--capacities", help="per-GPU goodputs prefill=R,decode=R,colocated=R (req/s/GPU, tp 1) "
                                   "instead of simulating; replaces --profile and --workload")
@click.option("--num-requests", type=click.IntRange(min=1), default=300, show_default=True,
              help="requests in a simulation; more (up to 10x) at rates whose requests' lifetimes need "
                   "a longer run to show a backlog")
@click.option("--seed", type=int, default=0, show_default=True, help="workload and arrival seed")
@click.option("--json", "as_json", is_flag=True, help="print the plan as one JSON object")
def plan(profile, workload, ttft_slo, tpot_slo, attainment, gpus, capacities, num_requests, seed,
         as_json) -> None:
    """Search prefill/decode pool sizes (and tensor-parallel degrees) for the best goodput
    per GPU, min(g_p·Γ_p, g_d·Γ_d) / (g_p + g_d), against the best co-located deployment.

    Per-phase goodputs are simulated (prefill and decode pools approximated on the
    co-located simulator; KV transfer not modelled) unless --capacities gives them."""
    from services.eval.planner import PlanError, search

    if capacities is not None:
        goodputs = _given_goodputs(capacities, profile, workload)
    else:
        goodputs = _simulated_goodputs(profile, workload, ttft_slo, tpot_slo, attainment, gpus, num_requests,
                                       seed)
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


def _simulated_goodputs(profile, workload, ttft_slo, tpot_slo, attainment, gpus, num_requests, seed):
    from common.cost_model import ProfileError
    from services.eval.planner import MAX_REQUESTS_FACTOR, PlanError, instance_profiles, simulated_goodputs
    from services.eval.report import Slo
    from services.eval.workloads import make_workload

    missing = [flag for flag, value in (("--profile", profile), ("--workload", workload),
                                        ("--ttft-slo", ttft_slo), ("--tpot-slo", tpot_slo)) if value is None]
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)} (needed unless --capacities is given)")
    try:
        profiles = instance_profiles(profile)
    except (ProfileError, PlanError) as error:
        raise click.BadParameter(str(error), param_hint="--profile") from error
    try:
        requests = make_workload(workload, num_requests * MAX_REQUESTS_FACTOR, seed)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--workload") from error
    try:
        return simulated_goodputs(profiles, requests, Slo(ttft_slo, tpot_slo), attainment, gpus, num_requests,
                                  seed)
    except PlanError as error:
        raise click.ClickException(str(error)) from error


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
