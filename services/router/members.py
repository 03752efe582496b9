"""Who speaks for which engine (docs/architecture.md §3): the router's registrations, plain
bookkeeping with no sockets or clocks of its own, driven by services/router/service.py.

An engine is the connection it joined on. A registration binds a worker id to the routing
id of the connection its accepted Hello came on (the router assigns routing ids, and no
connection can take another's) and to a secret `session` that its heartbeats, sent on a
second connection, must carry. A Hello naming a registered engine from another connection
is refused unless it shows that session (the same engine, reconnected); one connection
serves one engine.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from common.protocol import Heartbeat, Hello


@dataclass
class Member:
    """A registered worker: the connection it joined on (its routing id: the only one
    believed to speak for it), the secret its heartbeats carry, its KV events subscriber,
    and when it last spoke."""

    hello: Hello
    identity: bytes
    session: str
    events: Any  # the router's SUB socket on this engine's events_address
    last_seen: float
    heartbeat: Heartbeat | None = None


class Members(dict[str, Member]):
    """worker id -> Member, and the connection each is bound to."""

    def __init__(self) -> None:
        super().__init__()
        self.by_connection: dict[bytes, str] = {}  # routing id -> worker id

    def on(self, identity: bytes) -> Member | None:
        """The member registered on this connection, if any."""
        worker_id = self.by_connection.get(identity)
        return None if worker_id is None else self[worker_id]

    def claim_refusal(self, identity: bytes, hello: Hello, silence_s: float) -> str:
        """Why this Hello may not register (or re-register) its worker id from this
        connection; "" if it may. `silence_s` is how long a registration must be silent
        before the router drops it, which is when its id becomes free."""
        bound = self.by_connection.get(identity)
        if bound is not None and bound != hello.worker_id:
            return f"this connection is registered as {bound}; one connection serves one engine"
        member = self.get(hello.worker_id)
        if member is None or member.identity == identity or self.shows_session(member, hello.session):
            if member is not None and member.hello.role != hello.role:
                return f"{hello.worker_id} is registered as a {member.hello.role} engine, not {hello.role}"
            return ""
        return (f"{hello.worker_id} is registered on another connection that is still live; a worker id is "
                f"taken over only once its connection has been silent for {silence_s} s")

    @staticmethod
    def shows_session(member: Member, session: str) -> bool:
        return bool(session) and secrets.compare_digest(session, member.session)

    def join(self, identity: bytes, hello: Hello, events: Any, now: float) -> tuple[Member, bool]:
        """Register `hello` on this connection (claim_refusal said it may): (the member,
        whether it is the same process as the registration it replaces). The session
        stays with a process that rejoins, so its heartbeats in flight stay good; a new
        registration gets a new 128-bit secret."""
        previous = self.get(hello.worker_id)
        same_process = previous is not None and previous.hello.instance_id == hello.instance_id
        if previous is not None:
            self.by_connection.pop(previous.identity, None)
        session = previous.session if previous is not None and same_process else secrets.token_hex(16)
        member = self[hello.worker_id] = Member(hello, identity, session, events, now)
        self.by_connection[identity] = hello.worker_id
        return member, same_process

    def drop(self, worker_id: str) -> Member:
        member = self.pop(worker_id)
        self.by_connection.pop(member.identity, None)
        return member

    def check(self) -> None:
        """Integrity: every connection names a member bound to it, every member its own."""
        assert all(worker_id == m.hello.worker_id for worker_id, m in self.items()), "a member under another id"
        assert {m.identity: worker_id for worker_id, m in self.items()} == self.by_connection, \
            "connections and members disagree"
