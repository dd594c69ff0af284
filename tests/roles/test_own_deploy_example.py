"""The own-deploy example in docs/own-servers.md ("Your own pyinfra deploy with vllm-fleet's
roles") runs as written: its @deploy, given a spec through host data, adds the user's own step
and the roles' operations in order (no host: facts are those of a bare Debian 12 host, whose
state read finds nothing: no file, no package, no python in the env)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleetutil import env_state  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _example() -> str:
    text = (REPO / "docs" / "own-servers.md").read_text()
    (code,) = [c for c in re.findall(r"```python\n(.*?)```", text, re.S) if "@deploy(" in c]
    return code


def test_the_documented_own_deploy_runs(harness, tmp_path, monkeypatch):
    from vllm_fleet.roles import common

    monkeypatch.setattr(common, "_CACHE", {})
    monkeypatch.setattr(common, "_GENERATED", {})
    code = _example()
    assert code.rstrip().endswith("my_inference_host()")
    ns: dict = {}
    exec(
        compile(code.rstrip()[: -len("my_inference_host()")], "own-servers.md", "exec"), ns
    )  # without the call pyinfra makes
    data = yaml.safe_load((REPO / "deployments" / "lab-tiny.yaml").read_text())
    (tmp_path / "model").mkdir()
    data["model"]["source"] = str(tmp_path / "model")
    data["server"]["api_key"] = {"file": str(tmp_path / "api.key"), "generate": True}
    data["install"]["wheels"] = "host"  # no fleet wheelhouse download while testing (test_vllm_fleet_wheels.py)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    run = harness.run(
        ns["my_inference_host"],
        host="gpu1",
        groups=["servers", "proxy"],
        data={"vllm_fleet_spec": str(spec), "ssh_hostname": "192.0.2.10"},
        facts={
            "LinuxDistribution": harness.distro("debian-12"),
            "Os": "Linux",
            "Arch": "x86_64",
            "Which": lambda command=None: f"/usr/bin/{command}",
            **env_state(python=None),
        },
    )
    names = [op.name for op in run.ops]
    first = lambda text: next(i for i, n in enumerate(names) if text in n)  # noqa: E731
    assert (
        first("Write generated secret files")
        < first("Our own tools")
        < first("Put /etc/systemd/system/vllm-lab-tiny-0.service")
        < first("nginx")
        < first("Smoke tests")
    )
    assert not (tmp_path / "api.key").exists()  # planning wrote nothing
