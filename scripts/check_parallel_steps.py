"""Do N engines on this host step in parallel? Each engine's step times alone, then side by side.

    PYTHONPATH=. .venv/bin/python scripts/check_parallel_steps.py [--engines 2] \\
        [--seconds 8] [--prompt-tokens 184] [--max-tokens 16] [--threads 1] [--rounds 2] [--model DIR] [--json]

The simulator and cost_aware's decode terms assume that the workers of a cluster compute
in parallel: a request moved to an idle worker runs beside the holder's batch, not in the
holder's time. On a host where `svc up --workers N` shares a few cores with the router and
the tokenizer, that is a claim about the host. This checks it with the live engine: each
engine is a process of its own (`--model`, else the default model; `--threads` torch threads, as `svc up`
gives each worker), serving one request after another (`--prompt-tokens` random tokens,
`--max-tokens` greedy tokens) for `--seconds`, first one engine alone, then all `--engines`
at once, started together. It prints each engine's median prefill step and median decode
step, and the side-by-side medians over the alone ones: about 1 means the engines do not
slow each other, about N means they take turns on one core.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from common.engine.default_model import default_model_dir

READY_TIMEOUT_S = 120.0  # every engine loaded and warmed up (Engine.warm_up), so that they start together
RESULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Trial:
    """What one `run_engine` measured: median step times in ms and requests served."""

    engines: int
    engine: int
    prefill_ms: float
    decode_ms: float
    requests: int


@dataclass(frozen=True)
class Load:
    engines: int
    seconds: float
    prompt_tokens: int
    max_tokens: int
    threads: int
    model_dir: str


def run_engine(index: int, ready, load: Load, results) -> None:
    """Once every engine passed the `ready` barrier, serve requests for `load.seconds`;
    put this engine's Trial on `results`."""
    import torch

    from common.engine.config import EngineConfig
    from common.engine.engine import Engine
    from common.sampling_params import SamplingParams

    torch.set_num_threads(load.threads)
    engine = Engine(EngineConfig(model_dir=Path(load.model_dir), dtype="bfloat16", kv_cache_gb=0.25, device="cpu"))
    rng = random.Random(index)
    params = SamplingParams(max_tokens=load.max_tokens, temperature=0.0, ignore_eos=True)

    def serve(request_id: str) -> tuple[float, list[float]]:
        engine.add_request(request_id, [rng.randrange(4, 500) for _ in range(load.prompt_tokens)], params)
        began = time.perf_counter()
        engine.step()
        prefill_s = time.perf_counter() - began
        decode_s = []
        while engine.has_unfinished():
            began = time.perf_counter()
            engine.step()
            decode_s.append(time.perf_counter() - began)
        return prefill_s, decode_s

    engine.warm_up()
    ready.wait(timeout=READY_TIMEOUT_S)
    stop_at = time.perf_counter() + load.seconds
    prefills, decodes, served = [], [], 0
    while time.perf_counter() < stop_at:
        prefill_s, decode_s = serve(f"r{served}")
        prefills.append(prefill_s)
        decodes.extend(decode_s)
        served += 1
    results.put(Trial(load.engines, index, statistics.median(prefills) * 1e3,
                      statistics.median(decodes) * 1e3, served))


def trial(load: Load) -> list[Trial]:
    """Run `load.engines` engine processes together; their Trials by engine index."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ready = context.Barrier(load.engines)
    processes = [context.Process(target=run_engine, args=(index, ready, load, results))
                 for index in range(load.engines)]
    for process in processes:
        process.start()
    try:
        trials = collect(results, processes)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return sorted(trials, key=lambda found: found.engine)


def collect(results, processes) -> list[Trial]:
    """One Trial per process, or SystemExit as soon as one died without giving its own."""
    trials: list[Trial] = []
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while len(trials) < len(processes):
        try:
            trials.append(results.get(timeout=1.0))
            continue
        except queue.Empty:
            pass
        dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
        if dead:
            raise SystemExit(f"an engine process failed (exit code {dead[0]}); its error is above")
        if time.monotonic() > deadline:
            raise SystemExit(f"the engines gave no result within {RESULT_TIMEOUT_S:.0f} s")
    return trials


def ratios(alone: list[Trial], together: list[Trial]) -> dict[str, float]:
    """Side-by-side medians over alone medians, per phase."""
    return {phase: statistics.median(getattr(t, phase) for t in together)
            / statistics.median(getattr(t, phase) for t in alone)
            for phase in ("prefill_ms", "decode_ms")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--prompt-tokens", type=int, default=184)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", help="checkpoint directory (default: the embedded default model)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.engines < 2 or args.seconds <= 0 or args.prompt_tokens < 1 or args.max_tokens < 2 \
            or args.threads < 1 or args.rounds < 1:
        parser.error("need --engines >= 2, --seconds > 0, --prompt-tokens >= 1, --max-tokens >= 2, "
                     "--threads >= 1, --rounds >= 1")
    model_dir = args.model or str(default_model_dir())
    alone: list[Trial] = []
    together: list[Trial] = []
    for _ in range(args.rounds):
        for engines, into in ((1, alone), (args.engines, together)):
            found = trial(Load(engines, args.seconds, args.prompt_tokens, args.max_tokens, args.threads,
                              model_dir))
            into.extend(found)
            if not args.json:
                for one in found:
                    print(f"{engines} engine(s), engine {one.engine}: prefill {one.prefill_ms:.2f} ms, "
                          f"decode step {one.decode_ms:.3f} ms, {one.requests} requests", flush=True)
    side_by_side = ratios(alone, together)
    if args.json:
        print(json.dumps({"trials": [asdict(t) for t in alone + together], "ratios": side_by_side}))
    else:
        print(f"side by side / alone: prefill {side_by_side['prefill_ms']:.2f}, "
              f"decode {side_by_side['decode_ms']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
