"""The engine roles differ by the parts their one service gets (services/worker/role.py)."""
import pytest

from services.worker.role import ROLES, role_named


def test_each_role_names_its_parts():
    assert [(r.name, r.hands_off, r.imports, r.transport) for r in ROLES.values()] == [
        ("worker", False, False, False),  # co-located: no KV transport, nothing handed off or in
        ("prefill", True, False, True),  # a prompt's end holds its KV for a decode worker
        ("decode", False, True, True),  # handed-off requests pull their KV
    ]
    assert role_named("decode") is ROLES["decode"]


@pytest.mark.parametrize("name", ["router", "", "Prefill"])
def test_an_unknown_role_is_refused_by_name(name):
    with pytest.raises(ValueError, match=rf"^role: unknown engine role {name!r}; choose one of \('worker', "):
        role_named(name)
