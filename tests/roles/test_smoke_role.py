"""vllm_fleet/roles/smoke: the smoke tests are a check, not a change. When they pass the operation
has no command (an unchanged fleet reports no change); when one fails, the operation yields a
command that fails the deploy on that host, and its message names the host, the URL and the check.
(The checks themselves run against stand-in servers in tests/test_smoke_client.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from pyinfra.api import FunctionCommand
from vllm_fleet.render.files import deployment_paths

REPO = Path(__file__).resolve().parents[2]


def _spec():
    from vllm_fleet.specs.load import load, resolve

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
        raise SmokeError(
            "smoke tests failed against http://10.0.0.5:\n  chat: POST /v1/chat/completions -> 502: bad gateway"
        )

    monkeypatch.setattr(role, "_run", failing)
    run = harness.run(
        role.run_smoke,
        _spec(),
        deployment_paths(_spec()),
        "k3y",
        host="gpu1",
        groups=["proxy"],
        data={"ssh_hostname": "10.0.0.5"},
    )
    assert run.op("Smoke tests through http://10.0.0.5").commands == ["python:_fail"]
    (message,) = {args[0] for args in role.seen}
    assert message.startswith("gpu1: smoke tests failed against http://10.0.0.5") and "chat: POST" in message
    with pytest.raises(RuntimeError, match="^gpu1: "):  # what executing the command does: the host fails
        role._fail(message)


def test_passing_smoke_tests_are_no_change(harness, role, monkeypatch):
    calls = []
    monkeypatch.setattr(role, "_run", lambda *args, **kwargs: calls.append(args[1]))
    run = harness.run(
        role.run_smoke,
        _spec(),
        deployment_paths(_spec()),
        "k3y",
        host="gpu1",
        groups=["proxy"],
        data={"ssh_hostname": "10.0.0.5"},
    )
    assert run.op("Smoke tests through http://10.0.0.5").commands == [] and not run.changed
    assert calls and set(calls) == {"http://10.0.0.5"} and role.seen == []


def test_the_smoke_role_writes_openai_json_in_the_rendered_shape(tmp_path):
    """One shape of openai.json: the smoke role's copy is the layout's document (render.files) with
    the smoke timings added, never a second set of keys."""
    from vllm_fleet.render import layout as lay
    from vllm_fleet.render.files import paths
    from vllm_fleet.roles.smoke import write_client_settings

    spec = _spec()
    rendered = lay.build(spec, {"gpu1": {"address": "10.0.0.5", "groups": ["servers", "proxy"], "data": {}}})
    text = rendered.client[paths(spec)["client_json"]].content
    out = tmp_path / "openai.json"
    write_client_settings(str(out), json.loads(text), SimpleNamespace(ttft_s=0.0123, chat_total_s=0.5))
    got = json.loads(out.read_text())
    assert {k: v for k, v in got.items() if k != "smoke"} == json.loads(text)
    assert got["smoke"] == {"ttft_ms": 12.3, "chat_total_ms": 500.0}
    assert got["base_url"] == "http://10.0.0.5/v1" and "routing" in got and "api_key_file" not in got
