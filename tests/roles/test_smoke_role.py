"""vllm_fleet/roles/smoke: the smoke tests are a check, not a change. When they pass the operation
has no command (an unchanged fleet reports no change); when one fails, the operation yields a
command that fails the deploy on that host, and its message names the host, the URL and the check.
(The checks themselves run against stand-in servers in tests/test_smoke_client.py.)"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from pyinfra.api import FunctionCommand

REPO = Path(__file__).resolve().parents[2]


def _spec():
    from vllm_fleet.spec.load import load, resolve

    return resolve(load(REPO / "deployments" / "lab-tiny.yaml"))


@pytest.fixture
def role(monkeypatch):
    """The role with pyinfra executing (the checks run) and every FunctionCommand's arguments kept."""
    import vllm_fleet.roles.smoke as role

    seen: list[tuple] = []

    class Recorded(FunctionCommand):
        def __init__(self, function, args, kwargs):
            seen.append(tuple(args))
            super().__init__(function, args, kwargs)

    monkeypatch.setattr(role, "FunctionCommand", Recorded)
    monkeypatch.setattr(role, "state", SimpleNamespace(is_executing=True))
    role.seen = seen
    return role


def test_a_failing_smoke_test_fails_the_host_and_names_it(harness, role, monkeypatch):
    from vllm_fleet.serving.smoke import SmokeError

    def failing(*args, **kwargs):
        raise SmokeError("smoke tests failed against http://10.0.0.5:\n  chat: POST /v1/chat/completions -> 502: bad gateway")

    monkeypatch.setattr(role, "_run", failing)
    run = harness.run(role.run_smoke, _spec(), "k3y", host="gpu1", groups=["proxy"], data={"ssh_hostname": "10.0.0.5"})
    assert run.op("Smoke tests through http://10.0.0.5").commands == ["python:_fail"]
    (message,) = {args[0] for args in role.seen}
    assert message.startswith("gpu1: smoke tests failed against http://10.0.0.5") and "chat: POST" in message
    with pytest.raises(RuntimeError, match="^gpu1: "):  # what executing the command does: the host fails
        role._fail(message)


def test_passing_smoke_tests_are_no_change(harness, role, monkeypatch):
    calls = []
    monkeypatch.setattr(role, "_run", lambda *args, **kwargs: calls.append(args[1]))
    run = harness.run(role.run_smoke, _spec(), "k3y", host="gpu1", groups=["proxy"], data={"ssh_hostname": "10.0.0.5"})
    assert run.op("Smoke tests through http://10.0.0.5").commands == [] and not run.changed
    assert calls and set(calls) == {"http://10.0.0.5"} and role.seen == []
