"""`svc sim`: simulate a workload on a cluster of N workers under each placement policy.

Only click is imported here; the simulator and its dependencies load when the command
runs (services/eval/sim_runner.py does the work).
"""
from __future__ import annotations

from pathlib import Path

import click

ARRIVAL_CHOICES = ("poisson", "bursty", "trace")
POSITIVE = click.FloatRange(min=0, min_open=True)


@click.command("sim")
@click.option("--workload", help="workload shape, e.g. toolbench (a wrong name lists them)")
@click.option("--trace", "trace_path", type=click.Path(exists=True, dir_okay=False),
              help="replay this Mooncake-format trace (the mooncake workload)")
@click.option("--workers", type=click.IntRange(min=0), help="co-located workers in the simulated cluster")
@click.option("--prefill-workers", type=click.IntRange(min=0), default=0, show_default=True,
              help="prefill pool: workers that prefill and hand the KV to the decode pool")
@click.option("--decode-workers", type=click.IntRange(min=0), default=0, show_default=True,
              help="decode pool: workers that pull a prompt's KV and decode")
@click.option("--link", default="rdma-400g", show_default=True,
              help="the link KV moves over between pools: nvlink, rdma-400g, tcp-25g... (a wrong name lists them)")
@click.option("--max-local-prefill-tokens", type=click.IntRange(min=0), default=1000, show_default=True,
              help="a decode worker prefills a request itself when it lacks at most this many prompt tokens")
@click.option("--policy", "policy_list", required=True,
              help="placement policies to compare, comma separated (a wrong name lists them)")
@click.option("--profile", default="", help="cost profile: a JSON file or a name such as h100/llama-3-70b "
              "(default: the tiny model on CPU)")
@click.option("--sweep", "sweep_text", metavar="VAR=a,b,c",
              help="run each value of VAR: load, rate, workers, zipf or scale")
@click.option("--json", "as_json", is_flag=True, help="end with one JSON line of the results (see below)")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False, path_type=Path),
              help="with --sweep: write PNG plots of the sweep to this directory")
@click.option("--num-requests", type=click.IntRange(min=1),
              help="requests to simulate [default: 1000; a trace's every record]")
@click.option("--seed", type=int, default=0, show_default=True, help="seeds the workload and its arrivals")
@click.option("--rate", type=POSITIVE, help="arrivals per second")
@click.option("--load", type=POSITIVE,
              help="instead of --rate: a fraction of the workers' no-reuse capacity [default: 0.8]")
@click.option("--arrival", type=click.Choice(ARRIVAL_CHOICES),
              help="arrival process [default: trace for a trace, poisson otherwise]")
@click.option("--time-scale", type=POSITIVE, help="trace arrivals: multiplies the trace's times")
@click.option("--scale", type=POSITIVE, default=1.0, show_default=True,
              help="multiplies every prompt and output length")
@click.option("--zipf", type=click.FloatRange(min=0), help="toolbench's tool popularity exponent zipf_a")
@click.option("--option", "option_pairs", multiple=True, metavar="KEY=VALUE",
              help="a workload shape option, e.g. num_tools=40 (repeatable)")
@click.option("--queue-policy", default="fcfs", show_default=True,
              help="workers' waiting queue: fcfs, lpm or priority")
@click.option("--kv-blocks", type=click.IntRange(min=1),
              help="KV blocks (16 tokens) per worker [default: what a GPU profile's memory holds, else 32768]")
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1),
              help="per-step token budget [default: 8192 for a GPU profile, else 2048]")
@click.option("--ttft-slo", type=POSITIVE, help="TTFT target in seconds, for every request class")
@click.option("--tpot-slo", type=POSITIVE, help="TPOT target in seconds, for every request class")
@click.option("--admission", is_flag=True, help="refuse requests predicted to miss their SLO")
@click.option("--index-mode", default="events", show_default=True,
              help="router's prefix index: events (KV events) or approximate (from placements)")
@click.option("--store-dram-gb", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="the cluster's KV store: its DRAM tier, GB (0: none; with --store-ssd-gb 0 too: no store)")
@click.option("--store-ssd-gb", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="the KV store's SSD tier, GB (0: none)")
@click.option("--store-dram-gbps", type=POSITIVE, default=5.0, show_default=True,
              help="GB/s a fetch from the store's DRAM moves (plus 1 ms per fetch)")
@click.option("--store-ssd-gbps", type=POSITIVE, default=1.0, show_default=True,
              help="GB/s a fetch from the store's SSD moves (plus 2 ms per fetch)")
@click.option("--store-only", is_flag=True,
              help="with a store: skip the runs without it (by default each policy runs without and with it)")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True,
              help="simulations run at once, each in a process of its own (a policy at a swept value is one); "
                   "the results are the same")
def sim(workload, trace_path, workers, prefill_workers, decode_workers, link, max_local_prefill_tokens, policy_list,
        profile, sweep_text, as_json, plot_dir, num_requests, seed, rate, load, arrival, time_scale, scale, zipf,
        option_pairs, queue_policy, kv_blocks, max_num_batched_tokens, ttft_slo, tpot_slo, admission,
        index_mode, store_dram_gb, store_ssd_gb, store_dram_gbps, store_ssd_gbps, store_only, jobs) -> None:
    """Simulate a workload on WORKERS workers under each policy in discrete virtual time
    (the live router's policies and the engine's scheduler, with step times from the
    cost profile) and print the metrics table: TTFT, TPOT, end-to-end latency, SLO
    attainment, cache hit rate, fairness and refusals, per policy and request class.
    With --prefill-workers and --decode-workers the cluster has disaggregated pools
    (beside any co-located --workers), and each handed-off request's KV moves over
    --link: latency + the bytes the decode worker lacks / bandwidth, one transfer at a
    time per worker link.
    With --store-dram-gb or --store-ssd-gb the cluster has a tiered KV store: engines
    write back the blocks they evict and fetch a stored prefix when that beats
    recomputing it; each policy then runs without the store (POLICY) and with it
    (POLICY+store), and a line per run with it says where prompt tokens came from.

    \b
    With --json the last line of output is one JSON object:
      {POLICY: {"overall": {...}, "classes": {CLASS: {...}}, "simulation": {...}}, ...}
    (with a store, also POLICY+store keys, whose "overall" has a "store" object:
    engine_hit_rate, dram_hit_rate, ssd_hit_rate, computed_rate, tokens, fetches...)
    and with --sweep VAR=a,b,c
      {"sweep": VAR, "values": {VALUE: {POLICY: {"overall": ..., "classes": ..., "simulation": ...}}}}
    with each VALUE as written in --sweep. "simulation" is the simulator's own speed:
    requests, wall_s, requests_per_wall_s, the router's index_blocks at the end, and the
    engines' engine_named_blocks and engine_runs (their blocks' runs) at the end. A
    swept load or rate replaces --load and --rate; workers, zipf and scale replace
    --workers, --zipf and --scale.
    """
    from tqdm import tqdm

    from common.cost_model import ProfileError, load_cost_model
    from services.eval import sim_runner as runner
    from services.eval.sim_store import StoreModel

    try:
        sweep = runner.parse_sweep(sweep_text) if sweep_text else None
        if plot_dir is not None and sweep is None:
            raise runner.SimUsageError("--plot draws a sweep: give --sweep too")
        name, trace = runner.workload_source(workload, trace_path)
        spec = runner.SimSpec(
            workload=name, policies=runner.parse_policies(policy_list),
            workers=_workers(workers, sweep, prefill_workers + decode_workers > 0),
            prefill_workers=prefill_workers, decode_workers=decode_workers, link=link.strip().lower(),
            max_local_prefill_tokens=max_local_prefill_tokens,
            cost=load_cost_model(profile), trace=trace, num_requests=num_requests, seed=seed, arrival=arrival,
            rate=rate, load=load, time_scale=time_scale, scale=scale,
            options=runner.parse_options(option_pairs, zipf), queue_policy=queue_policy, kv_blocks=kv_blocks,
            max_num_batched_tokens=max_num_batched_tokens, ttft_slo_s=ttft_slo, tpot_slo_s=tpot_slo,
            admission=admission, index_mode=index_mode,
            store=StoreModel(dram_gb=store_dram_gb, ssd_gb=store_ssd_gb, dram_gbps=store_dram_gbps,
                             ssd_gbps=store_ssd_gbps),
            store_baseline=not store_only)
        points = runner.prepare(spec, sweep)
    except (runner.SimUsageError, ProfileError) as error:
        raise click.UsageError(str(error)) from error
    except ValueError as error:
        raise click.ClickException(str(error)) from error
    # disable=None: a bar on a terminal, nothing in logs and pipes.
    with tqdm(total=runner.total_requests(points), desc="sim", unit="req", disable=None) as progress:
        # No bar (not a terminal): no progress callback, which a run would call per event.
        results = runner.run_points(points, None if progress.disable else progress.update, jobs)
    variable = sweep.variable if sweep is not None else None
    runner.print_results(points, results, variable)
    if plot_dir is not None:
        assert variable is not None  # --plot needs --sweep (refused above otherwise)
        for path in runner.write_plots(points, results, variable, plot_dir):
            click.echo(f"wrote {path}", err=True)
    if as_json:
        click.echo(runner.results_json(results, variable))
    from services.cli import end_program

    end_program(click.get_current_context())  # the runs' heap dies with the process


def _workers(workers: int | None, sweep, pools: bool) -> int:
    """--workers, or the first swept value when sweeping workers (each value replaces it);
    0 by default beside pools."""
    if sweep is not None and sweep.variable == "workers":
        return int(sweep.values[0][1])
    if workers is None and pools:
        return 0
    if workers is None:
        raise click.UsageError("give --workers N (or --sweep workers=a,b,c)")
    return workers
