"""The router's registrations (services/router/members.py): which connection may speak for
which engine, as plain bookkeeping; tests/services/test_identity.py drives the same rules
through a real router."""
from hypothesis import given, settings, strategies as st

from common.protocol import PROTOCOL_VERSION, Hello
from services.router.members import Members

A, B, C = b"\x00conn-a", b"\x00conn-b", b"\x00conn-c"


def hello(worker_id: str = "decode-1", instance: str = "i-1", session: str = "", role: str = "decode") -> Hello:
    return Hello(protocol_version=PROTOCOL_VERSION, worker_id=worker_id, role=role, model_fingerprint="m",
                 tokenizer_fingerprint="t", kv_blocks=8, block_size=16, max_model_len=64, events_address="",
                 metrics_address="", instance_id=instance, session=session)


def test_a_live_engine_is_claimed_only_from_its_own_connection_or_with_its_session():
    members = Members()
    member, same = members.join(A, hello(), None, 0.0)
    assert not same and len(member.session) == 32
    assert "registered on another connection that is still live" in members.claim_refusal(B, hello(), 3.0)
    assert "registered on another connection" in members.claim_refusal(B, hello(session="f" * 32), 3.0)
    assert members.claim_refusal(A, hello(), 3.0) == ""  # its own rejoin
    assert members.claim_refusal(B, hello(session=member.session), 3.0) == ""  # reconnected, proves it
    members.check()


def test_a_reconnect_moves_the_registration_and_keeps_the_session():
    members = Members()
    first, _ = members.join(A, hello(), None, 0.0)
    moved, same = members.join(B, hello(session=first.session), None, 1.0)
    assert same and moved.session == first.session and moved.identity == B
    assert members.on(A) is None and members.on(B) is moved
    members.check()


def test_a_new_process_gets_a_new_session_and_one_connection_serves_one_engine():
    members = Members()
    first, _ = members.join(A, hello(), None, 0.0)
    members.drop("decode-1")
    assert members.on(A) is None and "decode-1" not in members
    again, same = members.join(B, hello(instance="i-2"), None, 5.0)
    assert not same and again.session != first.session
    assert "registered as decode-1" in members.claim_refusal(B, hello("decode-2"), 3.0)
    assert "is registered as a decode engine, not prefill" in members.claim_refusal(B, hello(role="prefill"), 3.0)
    members.check()


def test_a_heartbeat_session_must_match_exactly():
    members = Members()
    member, _ = members.join(A, hello(), None, 0.0)
    assert members.shows_session(member, member.session)
    assert not members.shows_session(member, "")
    assert not members.shows_session(member, member.session[:-1] + ("0" if member.session[-1] != "0" else "1"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["join", "drop"]), st.sampled_from([A, B, C]),
                          st.sampled_from(["w-0", "w-1"]), st.booleans()), max_size=30))
def test_joins_and_drops_keep_connections_and_members_in_step(steps):
    """Whatever the order, a join the rules allow leaves each member bound to exactly one
    connection and each connection to at most one member."""
    members = Members()
    for action, identity, worker_id, with_session in steps:
        if action == "drop":
            if worker_id in members:
                members.drop(worker_id)
        else:
            session = members[worker_id].session if with_session and worker_id in members else ""
            request = hello(worker_id, session=session)
            if not members.claim_refusal(identity, request, 3.0):
                members.join(identity, request, None, 0.0)
        members.check()
