"""Which cores each process of a node runs on (the `cpus` setting).

An engine's torch threads stall at every op's barrier when another process takes one of
their cores; on a small machine the tokenizer's detokenising, the router and the clients
did exactly that to the served worker. So `svc up` gives each engine cores of its own and
the light roles (router, tokenizer, KV store) the rest, and each process pins itself at
start. Where the cores do not go round (more engine threads than cores less one), no one
is pinned: the operating system's scheduler shares them better than a bad plan would.
An engine's ZeroMQ I/O threads go to the other roles' cores too (`io_cpus`,
common/sockets.py `engine_context`): each send wakes one, and woken on the engine's core
it ran before the engine's next step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


def parse_cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a Linux CPU list ("0-3,6", "5"); ValueError naming what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list such as 0-3,6")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"{text!r}: the range {part.strip()} runs backwards")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: frozenset[int] | list[int]) -> str:
    """The shortest CPU list naming `cpus` (ranges where they run on)."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in ranges)


def is_cpu_list(text: str) -> bool:
    """"" (no pinning) or a CPU list parse_cpu_list reads."""
    try:
        return text == "" or bool(parse_cpu_list(text))
    except ValueError:
        return False


@dataclass(frozen=True)
class CpuPlan:
    """The cores of each engine (in engine order) and of the other roles; all empty when
    the node has too few cores to give each engine its own."""

    engines: tuple[str, ...]
    others: str


def plan_cpus(available: frozenset[int], engines: int, threads: int) -> CpuPlan:
    """Give engine i `threads` cores of its own, the lowest-numbered core and whatever is
    left to the other roles; no plan where that does not fit."""
    ordered = sorted(available)
    if engines <= 0 or threads <= 0 or 1 + engines * threads > len(ordered):
        return CpuPlan(("",) * max(engines, 0), "")
    engine_cores = [ordered[1 + i * threads: 1 + (i + 1) * threads] for i in range(engines)]
    others = [ordered[0], *ordered[1 + engines * threads:]]
    return CpuPlan(tuple(format_cpu_list(cores) for cores in engine_cores), format_cpu_list(others))


def pin(cpus: str) -> frozenset[int] | None:
    """Run this process on `cpus`: every thread it has (an affinity is a thread's own) and
    so every thread it starts from now on; None for ""."""
    if not cpus:
        return None
    chosen = parse_cpu_list(cpus)
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), chosen)
        except ProcessLookupError:  # it ended meanwhile
            pass
    return chosen
