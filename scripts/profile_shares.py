#!/usr/bin/env python3
"""Where a profiled loop's time went, by Baton component, from a py-spy raw profile.

Each sample whose stack passes through `--within` (a function, as py-spy names it) counts
for the innermost Baton frame of its stack: a Python frame of `services/` or `common/`
(grouped by file) or a compiled one (mypyc's `CPyDef_<module>___...`, grouped by module).
Library and interpreter frames below it count for it, so a dictionary lookup in the block
manager is the block manager's. Then, for the components named by `--free`, the bound
Amdahl's law puts on making them cost nothing: the share of the loop left.

    .venv/bin/py-spy record --native -r 100 -f raw -o /tmp/run.raw -- \\
        .venv/bin/python -m services.cli sim --trace ../shared/data/mooncake_synthetic_trace.jsonl \\
        --workers 16 --profile h100/llama-3-70b --policy e2
    .venv/bin/python scripts/profile_shares.py /tmp/run.raw
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from collections.abc import Iterable

COMPILED_FRAME = re.compile(r"CPyDef_(\w+?)___")
PYTHON_FRAME = re.compile(r"\(((?:services|common)/[^:]+):\d+\)")
DEFAULT_FREE = ("compiled:index", "common/engine/block_manager.py")


def component(frames: list[str]) -> str:
    """The innermost Baton frame's component: a compiled module, a source file, the
    cycle collector, or "other"."""
    for frame in reversed(frames):
        compiled = COMPILED_FRAME.search(frame)
        if compiled:
            return "compiled:" + compiled.group(1)
        source = PYTHON_FRAME.search(frame)
        if source:
            return source.group(1)
        if "gc_collect" in frame:
            return "gc"
    return "other"


def shares(lines: Iterable[str], within: str) -> tuple[int, dict[str, float]]:
    """Samples through `within`, and each component's share of them, largest first."""
    counts: collections.Counter[str] = collections.Counter()
    for number, line in enumerate(lines, start=1):
        line = line.rstrip("\n")
        if not line:
            continue
        stack, _, samples = line.rpartition(" ")
        if not stack or not samples.isdigit():
            raise ValueError(f"line {number}: not 'frame;frame;... count' (py-spy record -f raw)")
        frames = stack.split(";")
        if any(frame.startswith(within + " ") or frame == within for frame in frames):
            counts[component(frames)] += int(samples)
    total = sum(counts.values())
    return total, {name: count / total for name, count in counts.most_common()} if total else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", help="py-spy raw profile (record -f raw), with --native for compiled frames")
    parser.add_argument("--within", default="Simulator._run", help="count only stacks through this function")
    parser.add_argument("--free", default=",".join(DEFAULT_FREE),
                        help="components whose cost the bound sets to zero (comma-separated)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with open(args.profile, encoding="utf-8", errors="replace") as lines:
        total, by_component = shares(lines, args.within)
    if not total:
        sys.exit(f"{args.profile}: no sample passes through {args.within!r}")
    free = [name for name in args.free.split(",") if name]
    unknown = [name for name in free if name not in by_component]
    if unknown:  # a misspelt name would count as free at no cost and hide in the bound
        sys.exit(f"--free names no component of this profile: {', '.join(unknown)} "
                 f"(it has {', '.join(by_component)})")
    left = 1.0 - sum(by_component.get(name, 0.0) for name in free)
    if args.json:
        print(json.dumps({"samples": total, "shares": by_component, "free": free, "left": left}))
        return
    for name, share in by_component.items():
        print(f"{100 * share:6.1f} %  {name}")
    print(f"{total} samples through {args.within}; with {', '.join(free)} free, {100 * left:.1f} % of the "
          f"loop is left: at most {1 / left:.2f}x faster" if left > 0 else "nothing is left")


if __name__ == "__main__":
    main()
