"""Decode steps at context lengths the process has not met yet must cost about what they
cost at lengths it has met: no kernel may build a plan per new shape (cuDNN's fused
attention did: the small model's decode steps took ~43 ms on an H200 instead of ~6). A
device check (scripts/check_cuda.sh); runs on the CPU too.

    PYTHONPATH=. python scripts/check_new_shapes.py --device cuda [--size small]

Runs `--steps` decode steps of one sequence from a fresh prompt (every step a new
context length), then the same again from another prompt of the same length (every
length met before), and prints the median step of each and their ratio; exits 1 if the
first is more than --max-ratio times the second.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from common.engine.config import EngineConfig
from common.engine.default_model import default_model_dir
from common.engine.engine import Engine
from common.logs import configure_logging
from common.sampling_params import SamplingParams

PROMPT_LEN = 64
FIRST_PLAIN_ID = 4


def decode_step_times(engine: Engine, prompt: list[int], steps: int) -> list[float]:
    """Seconds of each of `steps` decode steps after the prompt's prefill step."""
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    engine.add_request(f"shapes-{prompt[0]}-{len(prompt)}", prompt, params)
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished():
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", choices=("tiny", "small"), default="small")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--max-ratio", type=float, default=1.5)
    args = parser.parse_args(argv)
    configure_logging("warning")
    engine = Engine(EngineConfig(model_dir=default_model_dir(size=args.size), device=args.device))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    first, second = ([rng.randrange(FIRST_PLAIN_ID, vocab) for _ in range(PROMPT_LEN)] for _ in range(2))
    new = statistics.median(decode_step_times(engine, first, args.steps))
    met = statistics.median(decode_step_times(engine, second, args.steps))
    ratio = new / met
    print(f"decode step at new context lengths {new * 1e3:.2f} ms, at lengths met before "
          f"{met * 1e3:.2f} ms: ratio {ratio:.2f} (limit {args.max_ratio})")
    return 0 if ratio <= args.max_ratio else 1


if __name__ == "__main__":
    sys.exit(main())
