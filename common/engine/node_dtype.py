"""`dtype = "auto"` resolved in a process that loads no torch (`svc up`, the KV store),
which must agree with the engines of its node before any engine exists: `svc up` keys
the node's cost profile by the dtype, the store sizes its blocks by it.

Whether oneDNN computes bf16 natively is torch's to say, so a child Python asks it
through kernels.linear, the very check the engines make (docs/architecture.md §9).
"""
from __future__ import annotations

import subprocess
import sys

from common.engine.config import AUTO_DTYPE, dtype_choice, resolve_dtype

PROBE = "from kernels.linear import onednn_bf16_native as native; print(int(native()))"
PROBE_TIMEOUT_S = 120.0  # importing torch takes ~2 s, longer on a loaded machine


class DtypeProbeError(RuntimeError):
    """The child Python could not tell whether this CPU computes bf16 natively."""


def node_dtype(setting: str, device: str) -> str:
    """`resolve_dtype` for this node's CPU; probes the CPU (a child Python importing
    torch) only where the answer depends on it: `auto` on cpu."""
    return node_dtype_choice(setting, device)[0]


def node_dtype_choice(setting: str, device: str) -> tuple[str, str]:
    """`node_dtype` and why (`dtype_choice`'s line)."""
    native = setting == AUTO_DTYPE and not device.startswith("cuda") and cpu_bf16_native()
    return resolve_dtype(setting, device, native), dtype_choice(setting, device, native)


def cpu_bf16_native() -> bool:
    """Whether oneDNN computes bf16 natively on this CPU, asked of torch in a child Python."""
    try:
        done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise DtypeProbeError(f"dtype: resolving auto, torch did not answer within {PROBE_TIMEOUT_S:.0f} s; "
                              f"set dtype explicitly") from None
    if done.returncode != 0 or done.stdout.strip() not in ("0", "1"):
        raise DtypeProbeError(f"dtype: resolving auto needs torch to tell whether this CPU computes bf16 "
                              f"natively, and it failed; set dtype explicitly:\n{done.stderr.strip()[-1000:]}")
    return done.stdout.strip() == "1"
