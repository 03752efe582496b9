"""What the engine roles differ by (docs/architecture.md §1): one service,
services/worker/service.py, runs all three with the parts their role names."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

# A message (and its payload frames) to the router, on the service loop's own socket.
SendToRouter = Callable[[Any, list[np.ndarray]], None]


@dataclass(frozen=True)
class Role:
    """An engine role: which KV parts its worker service has besides the engine and the
    KV store's (its sources and its write-back, when the cluster runs a store)."""

    name: str
    hands_off: bool = False  # at a prompt's end the KV is exposed under a lease (services/prefill)
    imports: bool = False  # takes handed-off requests and pulls their KV (services/decode)

    @property
    def transport(self) -> bool:
        """Whether it runs a KV transport over its engine's pool (its store fetches use it too)."""
        return self.hands_off or self.imports


ROLES = {role.name: role for role in (Role("worker"), Role("prefill", hands_off=True), Role("decode", imports=True))}


def role_named(name: str) -> Role:
    try:
        return ROLES[name]
    except KeyError:
        raise ValueError(f"role: unknown engine role {name!r}; choose one of {tuple(ROLES)}") from None
