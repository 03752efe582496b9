"""`svc bench`: drive a running cluster with a workload and report what its clients saw.

Only click is imported here; the load generator (services/eval/loadgen.py) and its
dependencies load when the command runs.
"""
from __future__ import annotations

import click

ARRIVAL_CHOICES = ("poisson", "bursty", "trace")


@click.command("bench")
@click.option("--workload", required=True, help="workload shape, e.g. toolbench (a wrong name lists them)")
@click.option("--rate", type=float, help="arrivals per second")
@click.option("--load", type=float, help="instead of --rate: a fraction of the no-reuse capacity of "
              "--workers workers under --profile")
@click.option("--duration", type=float, help="send the requests arriving in the first S seconds, then wait "
              "for those in flight")
@click.option("--num-requests", type=int, help="requests to generate (default: enough for --duration)")
@click.option("--arrivals", type=click.Choice(ARRIVAL_CHOICES), default="poisson", show_default=True,
              help="trace: the workload's own arrival times (mooncake)")
@click.option("--trace", "trace_path", type=click.Path(exists=True, dir_okay=False),
              help="the trace file mooncake replays")
@click.option("--address", help="the cluster's SDK address, tcp://host:port (the default: tcp://127.0.0.1:7101)")
@click.option("--url", help="instead of --address: the cluster's HTTP gateway, http://host:port")
@click.option("--api-key", default="", help="API key, when the cluster requires one")
@click.option("--workers", type=int, help="workers for --load (default: as many as the cluster has; 1 over HTTP)")
@click.option("--profile", help="cost profile for --load: a JSON file or a profile name (default: the tiny "
              "model's)")
@click.option("--scale", type=float, default=0.05, show_default=True, help="multiplies every prompt and output "
              "length")
@click.option("--vocab-size", type=int, default=512, show_default=True, help="the model's vocabulary (tiny: 512)")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--slo-class", default="", help="SLO class sent with (and labelling) every request")
@click.option("--ttft-slo", type=float, help="TTFT target in seconds, for SLO attainment")
@click.option("--tpot-slo", type=float, help="TPOT target in seconds, for SLO attainment")
@click.option("--drain-timeout", type=float, default=120.0, show_default=True,
              help="seconds to wait for requests in flight after the last is sent")
@click.option("--json", "as_json", is_flag=True, help="end with one JSON line of the results")
def bench(workload, rate, load, duration, num_requests, arrivals, trace_path, address, url, api_key, workers,
          profile, scale, vocab_size, seed, slo_class, ttft_slo, tpot_slo, drain_timeout, as_json) -> None:
    """Send a workload to a running cluster, open loop (each request at its arrival time,
    never waiting for earlier ones), and report TTFT, TPOT, end-to-end latency, SLO
    attainment, cache hit rate and fairness as the clients observed them. When requests
    were disaggregated (through the SDK), a "TTFT split" section follows: the workers'
    queue, prefill, decode wait and KV transfer times (p50, p90), and the transfer's share
    of the time to the second token, which it delays (the prefill worker streams the first
    token before the transfer)."""
    import asyncio
    import dataclasses

    from tqdm import tqdm

    from common.cost_model import ProfileError
    from common.errors import BatonError
    from services.eval.loadgen import Target, WorkloadSpec, bench as run_bench, plan_requests
    from services.eval.report import json_line, print_table, print_ttft_split

    if address and url:
        raise click.UsageError("give at most one of --address and --url")
    if drain_timeout <= 0:
        raise click.BadParameter("must be > 0", param_hint="--drain-timeout")
    target = Target(url=url, api_key=api_key) if url else Target(address=address or _default_address(),
                                                                 api_key=api_key)
    spec = WorkloadSpec(workload, rate=rate, load=load, duration_s=duration, num_requests=num_requests,
                        arrivals=arrivals, scale=scale, vocab_size=vocab_size, seed=seed, trace_path=trace_path,
                        workers=workers or 1, profile=profile)
    try:
        spec.check()
        if load is not None and workers is None and not url:
            spec = dataclasses.replace(spec, workers=_cluster_workers(target))
        requests = plan_requests(spec)
    except (ValueError, ProfileError) as error:
        raise click.UsageError(str(error)) from error
    labels = {slo_class} if slo_class else {request.slo_class for request in requests}
    slos = _slos(ttft_slo, tpot_slo, labels)
    with tqdm(total=len(requests), desc=f"bench {workload}", unit="req", disable=None) as progress:
        try:
            result = asyncio.run(run_bench(target, requests, slo_class=slo_class, slos=slos,
                                           drain_timeout_s=drain_timeout, gpus=workers or 1,
                                           on_done=progress.update))
        except BatonError as error:
            raise click.ClickException(f"{type(error).__name__}: {error}") from error
    if result.run.errors:
        click.echo("errors: " + ", ".join(f"{name} {count}" for name, count in sorted(result.run.errors.items())),
                   err=True)
    results = {result.key: result.summary}
    print_table(results)
    print_ttft_split(results)
    if as_json:
        click.echo(json_line(results))


def _default_address() -> str:
    from services.client._shared import DEFAULT_ADDRESS

    return DEFAULT_ADDRESS


def _cluster_workers(target) -> int:
    """How many healthy workers the router reports (for --load without --workers)."""
    import asyncio

    from common.errors import BatonError
    from services.client import AsyncClient

    async def ask() -> int:
        async with AsyncClient(target.address, api_key=target.api_key) as client:
            return sum(worker.healthy for worker in (await client.status()).workers)

    try:
        return asyncio.run(ask()) or 1
    except BatonError as error:
        raise click.ClickException(f"{type(error).__name__}: {error}") from error


def _slos(ttft_s: float | None, tpot_s: float | None, labels: set[str]) -> dict:
    """The same Slo for every class label when either target is given (the other is then
    unbounded), else {} (no targets: every completed request meets its SLO)."""
    from services.eval.report import Slo

    if ttft_s is None and tpot_s is None:
        return {}
    for name, value in (("--ttft-slo", ttft_s), ("--tpot-slo", tpot_s)):
        if value is not None and not value > 0:
            raise click.BadParameter("must be > 0", param_hint=name)
    slo = Slo(ttft_s if ttft_s is not None else float("inf"), tpot_s if tpot_s is not None else float("inf"))
    return dict.fromkeys(labels, slo)
