#!/usr/bin/env python3
"""Perplexity of a served model on a public-domain text, and the same with transformers.

    scripts/eval_quality.py [--model DIR|FILE.gguf] [--url http://…:8000] [--compare-hf]
                            [--window 512] [--stride 512] [--max-tokens N] [--dtype float32]
                            [--text FILE] [--json]

Without --url it starts its own `svc up` cluster (one worker, the checkpoint of --model,
default the tiny default model, --dtype) and always stops it; with --url it scores on that
running cluster, whose checkpoint --model must name (its tokenizer makes the windows).

The text (default scripts/data/pride_and_prejudice_ch1-3.txt, see the README there) is
tokenized once with the checkpoint's tokenizer, as the served tokenizer does it (a BOS
first where it adds one), and cut to --max-tokens. Windows of --window tokens start every
--stride tokens (default window - 1: consecutive windows share one token, the last of one
being the first of the next, so the windows are disjoint in what they score); each window
scores the tokens the previous one did not reach (the first window: all but its first
token, which nothing predicts), so every token after the first is scored exactly once, with
at least window - stride tokens of context (Hugging Face's strided perplexity, without its
gap of one token a window). Each window goes to
/v1/completions as token ids with echo, logprobs 0 and max_tokens 0, which returns each
prompt token's log-probability given those before it; perplexity is exp of the mean
negative log-likelihood over the scored tokens. With --compare-hf the same token windows
go through transformers' AutoModelForCausalLM on the same checkpoint and dtype (a GGUF
file loads with `gguf_file=`), log_softmax in fp32, and both perplexities are printed with
their relative difference; the exit status is 1 when it exceeds --tolerance (1 %).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "pride_and_prejudice_ch1-3.txt"


@dataclass(frozen=True)
class Window:
    """Tokens [begin, end) of the text; the last `scored` of them are scored here."""

    begin: int
    end: int
    scored: int


def windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """Windows of `window` tokens starting every `stride` (< window, so that consecutive
    windows overlap): each scores the tokens past the previous one's end, the first all
    but token 0, which nothing predicts. Every token after the first is scored once."""
    if window < 2 or not 0 < stride < window:
        raise ValueError(f"need window >= 2 and 0 < stride < window, got window={window}, stride={stride}")
    result, scored_until, begin = [], 1, 0
    while scored_until < num_tokens:
        end = min(begin + window, num_tokens)
        result.append(Window(begin, end, end - scored_until))
        scored_until, begin = end, begin + stride
    return result


def perplexity(nlls: list[float]) -> float:
    return math.exp(sum(nlls) / len(nlls))


# ---- the served side ---------------------------------------------------------------


def post_json(url: str, body: dict, api_key: str, timeout_s: float) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.load(response)
    except urllib.error.HTTPError as error:
        raise RuntimeError(f"HTTP {error.code} from {url}: {error.read()[:500]!r}") from None


def served_model(url: str, api_key: str) -> str:
    request = urllib.request.Request(url.rstrip("/") + "/v1/models", headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def served_nlls(url: str, api_key: str, ids: list[int], spans: list[Window], concurrency: int,
                timeout_s: float) -> list[float]:
    """The negative log-likelihood of every scored token, window by window, from the
    gateway's echoed prompt logprobs."""
    model = served_model(url, api_key)

    def score(span: Window) -> list[float]:
        body = {"model": model, "prompt": ids[span.begin:span.end], "max_tokens": 0, "echo": True,
                "logprobs": 0, "temperature": 0}
        logprobs = post_json(url.rstrip("/") + "/v1/completions", body, api_key, timeout_s)["choices"][0]["logprobs"]
        values = logprobs["token_logprobs"]
        if len(values) != span.end - span.begin or values[0] is not None:
            raise RuntimeError(f"window [{span.begin}, {span.end}): {len(values)} prompt logprobs came back")
        return [-value for value in values[len(values) - span.scored:]]

    with ThreadPoolExecutor(concurrency) as pool:
        return [nll for window_nlls in pool.map(score, spans) for nll in window_nlls]


# ---- transformers -------------------------------------------------------------------


def hf_nlls(model_path: Path, dtype: str, ids: list[int], spans: list[Window]) -> list[float]:
    """The same with transformers: each window's logits, log_softmax in fp32, gathered."""
    import torch
    import transformers

    torch_dtype = getattr(torch, dtype if dtype != "auto" else "float32")
    if model_path.is_file():  # a GGUF file: transformers dequantizes it itself
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name,
                                                                  dtype=torch_dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
    model.eval()
    nlls: list[float] = []
    with torch.inference_mode():
        for span in spans:
            window = torch.tensor([ids[span.begin:span.end]])
            logprobs = model(window).logits[0, :-1].float().log_softmax(dim=-1)
            chosen = logprobs.gather(1, window[0, 1:, None])[:, 0]
            nlls.extend((-chosen[len(chosen) - span.scored:]).tolist())
    return nlls


# ---- the run ------------------------------------------------------------------------


def checkpoint_tokens(model_path: Path, text: str) -> list[int]:
    """The text's token ids with the checkpoint's tokenizer, as the served tokenizer
    encodes a text prompt (a GGUF file's through Baton's conversion of it)."""
    from common.engine.checkpoint import load_tokenizer

    directory = model_path
    if model_path.is_file():
        from common.engine.gguf import checkpoint_dir  # the conversion `svc up --model FILE.gguf` serves

        directory = checkpoint_dir(model_path)
    return load_tokenizer(directory).encode(text).ids


def evaluate(args: argparse.Namespace) -> dict:
    from common.engine.default_model import default_model_dir

    model_path = Path(args.model) if args.model else default_model_dir()
    text = args.text.read_text(encoding="utf-8")
    ids = checkpoint_tokens(model_path, text)[:args.max_tokens or None]
    spans = windows(len(ids), args.window, args.stride)
    report: dict = {"model": str(model_path), "text": args.text.name, "text_tokens": len(ids),
                    "window": args.window, "stride": args.stride, "windows": len(spans),
                    "scored_tokens": sum(span.scored for span in spans), "dtype": args.dtype}
    cluster = None
    url = args.url
    if url is None:
        from services.local_cluster import start_cluster

        extra = ["--dtype", args.dtype, *(["--profile", args.profile] if args.profile else [])]
        started = time.perf_counter()
        cluster = start_cluster(model_path, workers=1, extra=extra, timeout_s=args.start_timeout_s)
        report["cluster_start_s"] = round(time.perf_counter() - started, 2)
        url = cluster.http
    try:
        started = time.perf_counter()
        served = served_nlls(url, args.api_key, ids, spans, args.concurrency, args.timeout_s)
        report["baton_s"] = round(time.perf_counter() - started, 2)
    finally:
        if cluster is not None:
            cluster.stop()
    report["baton_ppl"] = perplexity(served)
    if args.compare_hf:
        started = time.perf_counter()
        reference = hf_nlls(model_path, args.dtype, ids, spans)
        report["hf_s"] = round(time.perf_counter() - started, 2)
        report["hf_ppl"] = perplexity(reference)
        report["relative_difference"] = abs(report["baton_ppl"] - report["hf_ppl"]) / report["hf_ppl"]
        report["max_token_nll_difference"] = max(abs(a - b) for a, b in zip(served, reference))
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory or .gguf file (default: the tiny default model)")
    parser.add_argument("--url", help="a running cluster's HTTP gateway (serving --model)")
    parser.add_argument("--api-key", default="eval", help="the gateway's API key, when it needs one")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--window", type=int, default=512, help="tokens per window (below the context)")
    parser.add_argument("--stride", type=int, default=None,
                        help="tokens between window starts, below --window (default: window - 1)")
    parser.add_argument("--max-tokens", type=int, default=0, help="score only the text's first N tokens (0: all)")
    parser.add_argument("--dtype", default="float32", help="the started cluster's and transformers' dtype")
    parser.add_argument("--profile", default="tiny-cpu",
                        help="`svc up --profile` for the started cluster: one worker's placement needs no "
                             "measured profile ('' measures this node's, minutes on a real model)")
    parser.add_argument("--compare-hf", action="store_true", help="score the same windows with transformers")
    parser.add_argument("--tolerance", type=float, default=0.01, help="largest relative difference that passes")
    parser.add_argument("--concurrency", type=int, default=4, help="windows in flight")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per window")
    parser.add_argument("--start-timeout-s", type=float, default=300.0, help="for the started cluster")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON line too")
    args = parser.parse_args(argv)
    args.stride = args.stride or args.window - 1
    if args.url and not args.model:
        parser.error("--url needs --model: the served checkpoint, whose tokenizer makes the windows")
    if args.window < 2 or not 0 < args.stride < args.window:
        parser.error("need --window >= 2 and 0 < --stride < --window")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = evaluate(args)
    print(f"model {report['model']} ({report['dtype']}), {report['text']}: {report['text_tokens']} tokens, "
          f"{report['windows']} windows of {report['window']} (stride {report['stride']}), "
          f"{report['scored_tokens']} scored")
    print(f"baton perplexity {report['baton_ppl']:.4f}  ({report['baton_s']} s)")
    failed = False
    if "hf_ppl" in report:
        failed = not report["relative_difference"] <= args.tolerance
        print(f"hf    perplexity {report['hf_ppl']:.4f}  ({report['hf_s']} s)")
        print(f"relative difference {report['relative_difference']:.3%} (tolerance {args.tolerance:.1%}), "
              f"largest per-token NLL difference {report['max_token_nll_difference']:.2e}"
              + ("  FAIL" if failed else ""))
    if args.json:
        print(json.dumps(report))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
