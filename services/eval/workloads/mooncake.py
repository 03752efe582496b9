"""Replay of a trace in Mooncake's format (FAST '25; ../shared/data/README.md).

One JSON object a line: `timestamp` (ms from the start), `input_length` and
`output_length` (tokens), `hash_ids` (ids of the prompt's 512-token blocks, chained, so
equal ids mean equal prefixes; ceil(input_length / 512) of them). The replay makes up
the tokens: block `h` is the same random tokens wherever it appears, drawn from a
generator seeded by (seed, h), and the last block is cut to the prompt's length.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from services.eval.workloads.base import FIRST_TOKEN_ID, WorkloadRequest

TRACE_BLOCK_TOKENS = 512


def generate(num_requests: int, seed: int = 0, *, vocab_size: int = 32000, scale: float = 1.0,
             trace: str | Path | None = None, copies: int = 1) -> list[WorkloadRequest]:
    """The first `num_requests` records of `trace` (all of them if it has fewer), in
    arrival order, arriving at their timestamps in seconds.

    With scale != 1 a block is max(1, round(512·scale)) tokens and each prompt keeps its
    number of full blocks (its partial last block scaled the same way), so prompts that
    share k blocks still share exactly k blocks; output lengths are scaled, at least 1.

    With copies = N > 1 the trace is replayed N times at once, a fleet's worth of the
    same sessions: copy c reads each hash id h as h + c·(the largest id + 1), so its
    prompts share prefixes among themselves as the trace's do and none with another
    copy's, and every copy arrives at the trace's times (N times its rate; a time scale
    spreads them). Copy 0 is the trace as it is; request i of copy c is
    mooncake-{c·records + i}.
    """
    if trace is None:
        raise ValueError("the mooncake workload replays a trace: pass trace=<path to a Mooncake-format .jsonl>")
    if not _is_int(copies) or copies < 1:
        raise ValueError(f"copies must be an integer >= 1, got {copies!r}")
    records = read_trace(trace, num_requests)
    block_tokens = max(1, round(TRACE_BLOCK_TOKENS * scale))
    row_of = {block: row for row, block in enumerate(dict.fromkeys(
        block for record in records for block in record["hash_ids"]))}
    stride = max(row_of, default=-1) + 1  # copy c's id for trace id h: h + c * stride
    table = np.empty((copies * len(row_of), block_tokens), dtype=np.uint32)
    for copy in range(copies):
        for block, row in row_of.items():
            table[copy * len(row_of) + row] = np.random.default_rng([seed, block + copy * stride]).integers(
                FIRST_TOKEN_ID, vocab_size, block_tokens, dtype=np.uint32)
    table.flags.writeable = False  # the prompts are views of it (_table_parts)
    requests = []
    for copy in range(copies):
        first_row, first_id = copy * len(row_of), copy * stride
        for index, record in enumerate(records, start=copy * len(records)):
            rows = [first_row + row_of[block] for block in record["hash_ids"]]
            length = _scaled_input(record["input_length"], block_tokens)
            requests.append(WorkloadRequest(
                f"mooncake-{index}", record["timestamp"] / 1000.0, _table_parts(table, rows, length),
                max(1, round(record["output_length"] * scale)), "mooncake",
                span_ids=tuple(first_id + block for block in record["hash_ids"]), span_tokens=block_tokens))
    return sorted(requests, key=lambda request: request.arrival_s)


def read_trace(path: str | Path, limit: int | None = None) -> list[dict]:
    """The first `limit` (default all) records of a Mooncake-format trace, checked; a bad
    line raises ValueError naming the file, the line and what is wrong. Blank lines are
    skipped."""
    path = Path(path)
    records: list[dict] = []
    try:
        with path.open(encoding="utf-8") as lines:
            for line_number, line in enumerate(lines, start=1):
                if limit is not None and len(records) >= limit:
                    break
                if line.strip():
                    records.append(_parse_record(line, f"{path}:{line_number}"))
    except OSError as error:
        raise ValueError(f"{path}: cannot read trace: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text: {error}") from None
    return records


def _parse_record(line: str, where: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON: {error}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for field in ("timestamp", "input_length", "output_length", "hash_ids"):
        if field not in record:
            raise ValueError(f"{where}: missing field {field!r}")
    timestamp = record["timestamp"]
    if not _is_number(timestamp) or not math.isfinite(timestamp) or timestamp < 0:
        raise ValueError(f"{where}: timestamp must be a number of ms >= 0, got {timestamp!r}")
    for field, least in (("input_length", 1), ("output_length", 0)):
        value = record[field]
        if not _is_int(value):
            raise ValueError(f"{where}: {field} must be an integer, got {value!r}")
        if value < least:
            raise ValueError(f"{where}: {field} must be >= {least}, got {value}")
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list) or not all(_is_int(block) and block >= 0 for block in hash_ids):
        raise ValueError(f"{where}: hash_ids must be a list of integers >= 0")
    needed = -(-record["input_length"] // TRACE_BLOCK_TOKENS)
    if len(hash_ids) != needed:
        raise ValueError(f"{where}: hash_ids has {len(hash_ids)} ids but input_length "
                         f"{record['input_length']} needs {needed} (one per {TRACE_BLOCK_TOKENS} tokens)")
    return record


def _table_parts(table: np.ndarray, rows: list[int], length: int) -> tuple[np.ndarray, ...]:
    """The first `length` tokens of the table's rows in order, as views of the rows (the
    last one cut where the prompt ends inside it), not a copy per request."""
    full, rest = divmod(length, table.shape[1])
    parts = tuple(table[row] for row in rows[:full])
    return parts + (table[rows[full]][:rest],) if rest else parts


def _scaled_input(input_length: int, block_tokens: int) -> int:
    full_blocks, rest = divmod(input_length, TRACE_BLOCK_TOKENS)
    partial = max(1, round(rest * block_tokens / TRACE_BLOCK_TOKENS)) if rest else 0
    return full_blocks * block_tokens + partial


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
