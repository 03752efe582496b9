"""The live load generator behind `svc bench`: send a workload to a running cluster at
its arrival times and record what the clients observed (docs/evaluation.md §6).

Open loop: each request is sent at its own arrival time, in its own asyncio task, whether
or not earlier requests have answered, so a slow cluster builds a queue instead of slowing
the offered load down. Each finished request becomes a report.RequestRecord: arrival = when
it was actually sent (run-relative), first token = arrival + TTFT, finish = arrival +
end-to-end latency, as the client measured them; a Rejected error (overloaded) marks it
rejected, any other request failure (timeout, worker lost, unavailable...) failed. The
client does not learn which worker served a request, nor the simulator's breakdown, so
those fields stay empty; through the SDK a record also gets its second token's time and
the split the workers report for a disaggregated request (Result.timings), which the
report's "ttft_split" section summarises.

Two ways in: the ZeroMQ SDK (AsyncClient, `tcp://` addresses) and the OpenAI HTTP API
(`http://` URLs, /v1/completions with the prompt as token ids, streamed).
"""
from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from common.cost_model import load_cost_model
from common.errors import BatonError, Rejected, RequestTimeout, ServerUnavailable, error_from_code
from common.protocol import ErrorCode
from services.eval.report import RequestRecord, RunTotals, Slo, summarize
from services.eval.workloads import make_workload
from services.eval.workloads.arrivals import bursty, poisson, rate_for_load, trace
from services.eval.workloads.base import WorkloadRequest

ARRIVALS = ("poisson", "bursty", "trace")
LOAD_SAMPLE = 200  # requests drawn to turn --load into a rate
DEFAULT_KEY = "live"  # the result's key when the cluster's policy is unknown (HTTP)


@dataclass(frozen=True)
class Outcome:
    """What a client saw of one completed request (seconds from sending it)."""

    ttft_s: float
    e2e_s: float
    output_tokens: int
    num_cached_tokens: int
    second_token_s: float | None = None  # None: fewer than two tokens, or not measured (HTTP)
    timings: Mapping[str, float] = field(default_factory=dict)  # Result.timings ({} when co-located)


Sender = Callable[[WorkloadRequest], Awaitable[Outcome]]  # raises BatonError when the request fails


@dataclass
class LiveRun:
    records: list[RequestRecord]
    duration_s: float  # from the run's start until the last request ended (or was given up)
    errors: Counter = field(default_factory=Counter)  # error type name -> count


# ---- the workload --------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadSpec:
    """Which requests to send and when. Give `rate` or `load` (requests/s, or a fraction
    of the no-reuse capacity of `workers` workers under `profile`) unless the arrivals are
    the trace's own; give `duration_s` (send what arrives before it), `num_requests`, or
    both."""

    workload: str
    rate: float | None = None
    load: float | None = None
    duration_s: float | None = None
    num_requests: int | None = None
    arrivals: str = "poisson"
    scale: float = 0.05
    vocab_size: int = 512
    seed: int = 0
    trace_path: str | None = None
    workers: int = 1
    profile: str | None = None

    def check(self) -> None:
        """Raise ValueError naming the first inconsistent or out-of-range field."""
        if self.arrivals not in ARRIVALS:
            raise ValueError(f"arrivals must be one of {', '.join(ARRIVALS)}, got {self.arrivals!r}")
        if self.arrivals == "trace":
            if self.rate is not None or self.load is not None:
                raise ValueError("trace arrivals take no rate or load")
            if self.num_requests is None:
                raise ValueError("trace arrivals need num_requests")
        elif (self.rate is None) == (self.load is None):
            raise ValueError("give exactly one of rate and load")
        for name in ("rate", "load", "duration_s"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if self.duration_s is None and self.num_requests is None:
            raise ValueError("give duration_s, num_requests or both")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")


def plan_requests(spec: WorkloadSpec) -> list[WorkloadRequest]:
    """The requests to send, sorted by arrival; with a duration, only those arriving
    before it. Raises ValueError on a bad spec (and ProfileError on a bad profile)."""
    spec.check()
    rate = spec.rate if spec.load is None else _rate_for_load(spec, spec.load)  # None: trace arrivals
    count = spec.num_requests
    if count is None:  # enough arrivals to fill the duration, with room for chance
        # check(): without a count, a duration; and only trace arrivals (which need a count) have no rate
        assert rate is not None and spec.duration_s is not None
        expected = rate * spec.duration_s
        count = math.ceil(1.5 * expected + 6 * math.sqrt(expected) + 10)
    requests = _generate(spec, count)
    if spec.arrivals == "trace":
        requests = trace(requests)
    else:
        assert rate is not None  # check(): poisson and bursty arrivals have a rate or a load
        arrive = poisson if spec.arrivals == "poisson" else bursty
        requests = arrive(requests, rate, spec.seed)
    if spec.duration_s is not None:
        requests = [request for request in requests if request.arrival_s < spec.duration_s]
    return requests


def _generate(spec: WorkloadSpec, count: int) -> list[WorkloadRequest]:
    return make_workload(spec.workload, count, spec.seed, vocab_size=spec.vocab_size, scale=spec.scale,
                         trace=spec.trace_path)


def _rate_for_load(spec: WorkloadSpec, load: float) -> float:
    sample = _generate(spec, spec.num_requests or LOAD_SAMPLE)
    return rate_for_load(sample, load, spec.workers, load_cost_model(spec.profile))


# ---- the open loop -------------------------------------------------------------------


async def open_loop(requests: Sequence[WorkloadRequest], send: Sender, *, drain_timeout_s: float,
                    on_done: Callable[[], object] | None = None) -> LiveRun:
    """Send each request at its arrival_s (seconds from now) in a task of its own, never
    waiting for earlier ones; after the last is sent, wait up to `drain_timeout_s` for
    those in flight, then cancel them and count them failed ("Abandoned"). `on_done` is
    called as each request ends. Errors other than BatonError propagate (they are bugs)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    run = LiveRun([_pending_record(request) for request in requests], 0.0)

    async def one(request: WorkloadRequest, record: RequestRecord) -> None:
        record.arrival_s = loop.time() - start
        try:
            outcome = await send(request)
        except BatonError as error:
            record.rejected = isinstance(error, Rejected)
            record.failed = not record.rejected
            run.errors[type(error).__name__] += 1
        else:
            _complete(record, outcome)
        if on_done is not None:
            on_done()

    tasks = []
    for request, record in zip(requests, run.records):
        delay = start + request.arrival_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request, record)))
    if tasks:
        await _drain(tasks, run, drain_timeout_s)
    run.duration_s = loop.time() - start
    return run


async def _drain(tasks: list[asyncio.Task], run: LiveRun, timeout_s: float) -> None:
    """Wait for the tasks; those still running after `timeout_s` are cancelled and
    their records marked failed. Re-raises a task's unexpected exception."""
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task, record in zip(tasks, run.records):
        if task in pending:
            record.failed = True
            run.errors["Abandoned"] += 1
        else:
            task.result()


def _pending_record(request: WorkloadRequest) -> RequestRecord:
    return RequestRecord(request.request_id, request.slo_class, request.arrival_s, request.num_tokens)


def _complete(record: RequestRecord, outcome: Outcome) -> None:
    record.first_token_s = record.arrival_s + outcome.ttft_s
    record.finish_s = record.arrival_s + outcome.e2e_s
    record.output_tokens = outcome.output_tokens
    record.num_cached_tokens = outcome.num_cached_tokens
    if outcome.second_token_s is not None:
        record.second_token_s = record.arrival_s + outcome.second_token_s
    record.timings = dict(outcome.timings)


# ---- senders -------------------------------------------------------------------------


def sdk_sender(client, slo_class: str = "") -> Sender:
    """Send through an AsyncClient: the request's tokens, max_tokens = its output
    length, EOS ignored, greedy. The outcome keeps the result's second token time and
    worker timings."""

    async def send(request: WorkloadRequest) -> Outcome:
        result = await client.generate(token_ids=request.token_ids.tolist(), max_tokens=request.output_tokens,
                                       temperature=0.0, ignore_eos=True, slo_class=slo_class)
        second = result.second_token_s if len(result.token_ids) >= 2 else None
        return Outcome(result.ttft_s, result.e2e_s, len(result.token_ids), result.num_cached_tokens, second,
                       result.timings)

    return send


def http_sender(client, model: str, slo_class: str = "") -> Sender:
    """Send through an openai.AsyncOpenAI client to /v1/completions, streamed. logprobs=0
    makes the server send a chunk for every token (a byte-level token that does not
    complete a character has no text of its own), so the first chunk's time is the
    first token's; the token counts come from the final usage chunk."""
    import openai

    extra = {"ignore_eos": True, **({"slo_class": slo_class} if slo_class else {})}

    async def send(request: WorkloadRequest) -> Outcome:
        loop = asyncio.get_running_loop()
        started = loop.time()
        first = None
        usage = None
        try:
            stream = await client.completions.create(
                model=model, prompt=request.token_ids.tolist(), max_tokens=request.output_tokens,
                temperature=0.0, logprobs=0, stream=True, stream_options={"include_usage": True},
                extra_body=extra)
            async for chunk in stream:
                if first is None and chunk.choices:
                    first = loop.time()
                if chunk.usage is not None:
                    usage = chunk.usage
        except openai.APIError as error:
            raise baton_error(error) from None
        end = loop.time()
        if usage is None:
            raise BatonError("the stream ended without a usage chunk")
        details = usage.prompt_tokens_details
        cached = details.cached_tokens if details is not None and details.cached_tokens else 0
        return Outcome((first or end) - started, end - started, usage.completion_tokens, cached)

    return send


def baton_error(error) -> BatonError:
    """The typed Baton error of an openai.APIError: by the body's `code` when it names a
    Baton error code, else by the HTTP status, else by the kind of failure."""
    import openai

    if isinstance(error, openai.APITimeoutError):
        return RequestTimeout(str(error))
    if isinstance(error, openai.APIConnectionError):
        return ServerUnavailable(str(error))
    body = error.body.get("error", error.body) if isinstance(error.body, dict) else {}
    codes = {code.value for code in ErrorCode}
    code = body.get("code") if isinstance(body, dict) else None
    if code not in codes:
        code = {429: "overloaded", 503: "unavailable", 504: "timeout"}.get(getattr(error, "status_code", 0),
                                                                          "internal")
    return error_from_code(ErrorCode(code), getattr(error, "message", str(error)))


# ---- one benchmark run ---------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Where the cluster is: an SDK address (tcp://...) or an HTTP gateway (http://...)."""

    address: str | None = None
    url: str | None = None
    api_key: str = ""

    def __post_init__(self) -> None:
        if (self.address is None) == (self.url is None):
            raise ValueError("give exactly one of address and url")


@dataclass(frozen=True)
class BenchResult:
    key: str  # the router policy, or DEFAULT_KEY when the cluster does not say
    summary: dict  # report.summarize's result
    run: LiveRun
    workers: int | None  # as the router reported them; None over HTTP


async def bench(target: Target, requests: Sequence[WorkloadRequest], *, slo_class: str = "",
                slos: Mapping[str, Slo] | None = None, drain_timeout_s: float = 120.0, gpus: int = 1,
                on_done: Callable[[], object] | None = None) -> BenchResult:
    """Run `requests` against the cluster at `target` and summarise what the clients saw.
    `slo_class` is sent with every request and labels every record (when given); `gpus`
    counts the workers when the cluster cannot be asked (HTTP). Raises BatonError
    (ServerUnavailable, Unauthorized...) when the cluster cannot be reached at all."""
    last_arrival = max((request.arrival_s for request in requests), default=0.0)
    request_timeout_s = last_arrival + drain_timeout_s
    if target.address is not None:
        key, workers, run = await _bench_sdk(target, requests, slo_class, request_timeout_s, drain_timeout_s,
                                             on_done)
    else:
        key, workers, run = await _bench_http(target, requests, slo_class, request_timeout_s, drain_timeout_s,
                                              on_done)
    if slo_class:
        for record in run.records:
            record.slo_class = slo_class
    totals = RunTotals(duration_s=run.duration_s, gpus=workers or gpus)
    return BenchResult(key, summarize(run.records, slos or {}, totals), run, workers)


async def _bench_sdk(target, requests, slo_class, request_timeout_s, drain_timeout_s, on_done):
    from services.client import AsyncClient

    async with AsyncClient(target.address, api_key=target.api_key, timeout_s=request_timeout_s) as client:
        status = await client.status()
        client.checked = True  # the status check generate() would make first is done
        run = await open_loop(requests, sdk_sender(client, slo_class), drain_timeout_s=drain_timeout_s,
                              on_done=on_done)
    return status.policy or DEFAULT_KEY, sum(w.healthy for w in status.workers), run


async def _bench_http(target, requests, slo_class, request_timeout_s, drain_timeout_s, on_done):
    import openai

    client = openai.AsyncOpenAI(base_url=target.url.rstrip("/") + "/v1", api_key=target.api_key or "bench",
                                timeout=request_timeout_s, max_retries=0)
    try:
        try:
            model = (await client.models.list()).data[0].id
        except openai.APIError as error:
            raise baton_error(error) from None
        run = await open_loop(requests, http_sender(client, model, slo_class), drain_timeout_s=drain_timeout_s,
                              on_done=on_done)
    finally:
        await client.close()
    return DEFAULT_KEY, None, run
