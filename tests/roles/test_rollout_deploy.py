"""deploys/rollout.py's update step reads the host once (vllm_fleet.roles.common.state), as the
serve deploy does: a batch whose host already runs what the spec says gets only the drain and
the replica's own smoke test; a file that differs gets its put, the restart and the health wait.

The install stack (pyenv, vLLM, model) is left out here (stubbed as converged: its snapshot
questions are tested with its roles); what is checked is the step's own wiring: the snapshot is
loaded before the service role decides, and it covers what the service role compares against.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pyinfra.api import deploy

from test_host_state import converged_lines  # noqa: E402  (tests/roles is on sys.path under pytest)
from vllm_fleet.host.state import HostState, Snapshot

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    from vllm_fleet.roles import common, service

    monkeypatch.setattr(common, "_CACHE", {})
    monkeypatch.setattr(common, "_GENERATED", {})
    monkeypatch.setattr(service, "install_server_stack", lambda spec, where, hub_token: ([], []))
    data = yaml.safe_load((REPO / "deployments" / "lab-tiny.yaml").read_text())
    (tmp_path / "model").mkdir()
    data["model"]["source"] = str(tmp_path / "model")
    key = tmp_path / "api.key"
    key.write_text("sk-existing\n")
    key.chmod(0o600)
    data["server"]["api_key"] = {"file": str(key)}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.setenv("VLLM_FLEET_SPEC", str(tmp_path / "spec.yaml"))
    monkeypatch.setenv("VLLM_FLEET_ROLLOUT_STEP", "update")
    monkeypatch.setenv("VLLM_FLEET_UPDATE", "gpu1")


@deploy("rollout update step")
def _update():
    from vllm_fleet.deploys.rollout import rollout_step

    rollout_step()


def _run(harness, drift_suffix: str | None = None):
    from vllm_fleet.roles.common import _CACHE

    def host_state(query):
        (ctx,) = _CACHE.values()  # planned before the step reads the host
        spec, h = ctx.spec, ctx.layout.hosts["gpu1"]
        node = h.parts[spec["name"]]
        drift = next(p for p in h.files if p.endswith(drift_suffix)) if drift_suffix else None
        return Snapshot.parse(converged_lines(spec, h, node, ctx.secrets["api_key"], drift=drift))

    from pyinfra.facts.files import File, Sha256File
    from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus

    return harness.run(
        _update,
        host="gpu1",
        groups=["servers"],
        data={"private_address": "10.0.0.5", "ssh_hostname": "192.0.2.5"},
        facts={HostState: host_state, File: {"user": "root"}, Sha256File: "x", SystemdStatus: {}, SystemdEnabled: {}},
    )


def _names(run):
    return [op.name.rsplit(" | ", 1)[-1] for op in run.ops]


def test_a_converged_batch_gets_only_the_drain_and_its_smoke_test(harness):
    run = _run(harness)
    names = _names(run)
    assert [n for n, _ in run.asked].count("HostState") == 1
    assert names == [
        "Wait for vLLM's running/waiting requests on port 8000 to reach 0 (at most 120 s)",
        "Smoke test of the replica itself (127.0.0.1:8000 on the host)",
    ], names


def test_a_batch_whose_env_file_differs_is_put_restarted_and_waited_for(harness):
    run = _run(harness, drift_suffix="/vllm.env")
    names = _names(run)
    env = next(n for n in names if n.startswith("Put ") and n.endswith("/vllm.env"))
    restart = next(n for n in names if n.startswith("Restart ") and "(its inputs changed)" in n)
    wait = next(n for n in names if n.startswith("Wait for ") and "/health" in n)
    assert names.index(env) < names.index(restart) < names.index(wait)
    assert not any(n.startswith("Directory ") or n.startswith("Put /etc/systemd") for n in names), names
