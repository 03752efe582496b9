#!/usr/bin/env python3
"""The in-process engine's decode step, timed alone: the figure kernel changes move.

    scripts/time_decode_step.py [--model DIR|FILE.gguf|tiny|small] [--batch 32] [--threads 2]
                                [--prompt-len 32] [--steps 150] [--dtype bfloat16]
                                [--no-weight-blocks] [--profile]

Starts --batch greedy requests of --prompt-len random token ids on a --dtype engine with
--threads torch threads, prefills them in one step, then times --steps decode steps
(`Engine.step()`, each at one token per sequence, contexts growing from --prompt-len)
and prints the median and the 10th percentile of all but the first 20. --profile adds
torch.profiler's table of 30 more steps, by self CPU time. --no-weight-blocks runs a
GGUF model's AMX linears on bf16 copies instead of its quantized blocks (the
`weight_blocks` setting). The default model is the packaged default (SmolLM2); `tiny`
and `small` are the random test models.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.engine.config import EngineConfig  # noqa: E402
from common.engine.default_model import default_model_dir  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.engine.gguf import checkpoint_dir  # noqa: E402
from common.engine.packaged_model import packaged_model_file  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402

WARM_STEPS = 20


def model_dir(name: str | None) -> Path:
    if name is None:
        return checkpoint_dir(packaged_model_file())
    if name in ("tiny", "small"):
        return default_model_dir(size=name)
    return checkpoint_dir(Path(name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory, GGUF file, tiny or small (default: SmolLM2)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--dtype", default="bfloat16", help="the engine's dtype (auto, float32, ...)")
    parser.add_argument("--no-weight-blocks", action="store_true")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if min(args.batch, args.threads, args.prompt_len) < 1 or args.steps <= WARM_STEPS:
        parser.error(f"--batch, --threads, --prompt-len must be >= 1 and --steps > {WARM_STEPS}")
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig(model_dir=model_dir(args.model), dtype=args.dtype,
                                 weight_blocks=not args.no_weight_blocks))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.steps + 64, temperature=0.0, ignore_eos=True)
    for index in range(args.batch):
        engine.add_request(f"r{index}", [rng.randrange(vocab) for _ in range(args.prompt_len)], params)
    engine.step()  # every prompt in one prefill
    seconds = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - start)
    timed = sorted(seconds[WARM_STEPS:])
    print(f"model {engine.config.model_dir.name}, {engine.model.dtype}, linears {engine.model.linear_kernels()}, "
          f"batch {args.batch}, "
          f"{args.threads} threads: decode step median {statistics.median(timed) * 1e3:.2f} ms, "
          f"p10 {timed[len(timed) // 10] * 1e3:.2f} ms")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(30):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
