"""vllm_fleet/roles/service.install_service through the operations it would run (scripted facts):
one unit per replica from the layout, the previous release's vllm.service and surplus replicas
stopped and removed before the new ones start, and only a rollout batch's instances restarted."""

from __future__ import annotations

import base64
import copy
from pathlib import Path

from pyinfra.facts.files import File, Sha256File

from vllm_fleet.render.layout import build
from vllm_fleet.host.state import HostState, Snapshot
from vllm_fleet.roles.service import applied_token, install_service
from vllm_fleet.specs.load import load, resolve
from vllm_fleet.render.files import deployment_paths

REPO = Path(__file__).resolve().parents[2]
INV = {"testhost": {"address": "10.10.0.11", "groups": ["servers", "proxy"], "data": {"replicas_per_host": 2}}}


def state_lines(legacy: str | None = None, listed: str = "", stamps=None, failed=()) -> list[str]:
    """host_state.sh's answer to the role's state read: the older release's vllm.service
    (``legacy``: its text, None when absent), the unit directory's entries, the recorded
    configurations (``stamps``: {path: text}), the replicas' units (``failed``: failed ones)."""
    b64 = lambda text: base64.b64encode(text.encode()).decode()  # noqa: E731
    out = [
        f"read\t/etc/systemd/system/vllm.service\t{b64(legacy) if legacy is not None else '-'}",
        "ls\t/etc/systemd/system\t.",
        *(f"ls\t/etc/systemd/system\t{u}" for u in listed.split()),
    ]
    out += [f"read\t{path}\t{b64(text)}" for path, text in (stamps or {}).items()]
    for i in (0, 1):
        unit = f"vllm-lab-tiny-replicas-{i}.service"
        out += [
            f"unit\tId={unit}",
            "unit\tLoadState=loaded",
            f"unit\tActiveState={'failed' if unit in failed else 'active'}",
            "unit\tUnitFileState=enabled",
            "unit\t",
        ]
    return out + ["end"]


def _run(harness, legacy=None, listed="", stamps=None, only=None, key="k3y", failed=()):
    spec = resolve(load(REPO / "deployments" / "lab-tiny-replicas.yaml"))
    layout = build([spec], copy.deepcopy(INV))
    h = layout.hosts["testhost"]
    node = h.parts[spec["name"]]
    lines = state_lines(legacy, listed, stamps, failed)
    facts = {HostState: lambda query: Snapshot.parse(lines), File: lambda path: None, Sha256File: lambda path: None}
    run = harness.run(install_service, spec, deployment_paths(spec), node, h.files, key, facts=facts, only=only)
    # the role's own state read is all it asks of the host beyond pyinfra's operations' facts
    assert [name for name, _ in run.asked].count("HostState") == 1 and "Command" not in {
        name for name, _ in run.asked
    }, run.asked
    return spec, node, h, run


LEGACY = "[Unit]\nDescription=vLLM lab-tiny-replicas: tiny (an older release)\n"


def test_one_unit_per_replica_and_the_old_unit_removed_first(harness):
    spec, node, h, run = _run(
        harness,
        legacy=LEGACY,
        listed="vllm-lab-tiny-replicas-0.service vllm-lab-tiny-replicas-5.service vllm-other-7.service",
    )
    names = [op.name.split(" | ", 1)[-1] for op in run.ops]
    for i in (0, 1):
        assert f"/etc/systemd/system/vllm-lab-tiny-replicas-{i}.service" in run.uploads
        assert f"/etc/vllm-fleet/lab-tiny-replicas/replica-{i}.env" in run.uploads
    stop_old = names.index("Stop and disable vllm.service (not in the layout any more)")
    stop_5 = names.index("Stop and disable vllm-lab-tiny-replicas-5.service (not in the layout any more)")
    assert "Remove /etc/systemd/system/vllm.service" in names
    first_restart = min(i for i, n in enumerate(names) if n.startswith("Restart vllm-lab-tiny-replicas-"))
    assert stop_old < first_restart and stop_5 < first_restart  # port 8000 free before replica 0 starts
    assert not any("Stop and disable vllm-lab-tiny-replicas-0" in n for n in names)  # a current unit stays
    assert not any("vllm-other-7" in n for n in names)  # another deployment's
    # never started before (no record): both start, wait for /health on their own ports, are recorded
    assert "Wait for vllm-lab-tiny-replicas-1.service /health on port 8001 (deadline 300 s)" in names
    assert run.uploads["/etc/vllm-fleet/lab-tiny-replicas/replica-1.applied"].strip() == applied_token(
        spec, h.files, node.instances[1], "k3y"
    )
    assert "k3y" not in run.uploads["/etc/vllm-fleet/lab-tiny-replicas/replica-1.applied"]


def test_nothing_to_remove_and_a_rollout_batch_restarts_only_its_instance(harness):
    spec, node, h, run = _run(harness, only=[1])
    names = [op.name.split(" | ", 1)[-1] for op in run.ops]
    assert not any(n.startswith("Stop and disable") for n in names)
    assert any(n.startswith("Restart vllm-lab-tiny-replicas-1.service") for n in names)
    assert not any(n.startswith("Restart vllm-lab-tiny-replicas-0.service") for n in names)
    assert not any("vllm-lab-tiny-replicas-0.service /health" in n for n in names)


def test_a_recorded_instance_restarts_only_on_a_change(harness):
    spec = resolve(load(REPO / "deployments" / "lab-tiny-replicas.yaml"))
    layout = build([spec], copy.deepcopy(INV))
    h = layout.hosts["testhost"]
    stamps = {
        f"/etc/vllm-fleet/lab-tiny-replicas/replica-{i.index}.applied": applied_token(spec, h.files, i, "k3y")
        for i in h.parts[spec["name"]].instances
    }
    _, _, _, run = _run(harness, stamps=stamps)
    restart = [op for op in run.ops if "| Restart vllm-lab-tiny-replicas-" in op.name]
    assert len(restart) == 2 and all(op.conditional for op in restart)
    assert all("(its inputs changed)" in op.name for op in restart)


def _stamps(run) -> dict[str, str]:
    return {p: t for p, t in run.uploads.items() if p.endswith(".applied")}


def test_the_applied_stamp_is_what_a_later_run_compares_with(harness):
    """The stamps a first run uploads (not applied_token's output computed here): the same
    inputs leave every restart conditional; another API key restarts every instance; each
    replica has its own stamp and none holds the key."""
    _, _, _, first = _run(harness)
    stamps = _stamps(first)
    assert len(stamps) == 2 and len(set(stamps.values())) == 2, stamps  # replica 0 and 1 run different units
    assert all("k3y" not in t for t in stamps.values())
    _, _, _, same = _run(harness, stamps=stamps)
    restart = [op for op in same.ops if "| Restart vllm-lab-tiny-replicas-" in op.name]
    assert len(restart) == 2 and all("(its inputs changed)" in op.name for op in restart), [op.name for op in restart]
    assert not _stamps(same) or _stamps(same) == stamps
    _, _, _, rekeyed = _run(harness, stamps=stamps, key="an0ther-key")
    restart = [op for op in rekeyed.ops if "| Restart vllm-lab-tiny-replicas-" in op.name]
    assert len(restart) == 2 and all("(it runs an older configuration)" in op.name for op in restart), [
        op.name for op in restart
    ]
    new = _stamps(rekeyed)
    assert set(new) == set(stamps) and all(new[p] != stamps[p] for p in stamps)


def test_another_deployments_older_unit_stays(harness):
    """The older release's vllm.service goes only when its text (from the state read) names this deployment."""
    _, _, _, run = _run(harness, legacy=LEGACY.replace("lab-tiny-replicas:", "lab-tiny:"))
    assert not any("vllm.service" in op.name for op in run.ops), run


def test_a_state_read_that_did_not_complete_restarts_nothing(harness):
    """No ``end`` line (the read was cut: a dropped connection, a sudo that stopped answering):
    what each instance runs is not known. Restarting every replica on that guess would stop the
    service for nothing: the role stops this host with a message that names it and says how to
    retry, before any operation."""
    import pytest

    from vllm_fleet.roles.common.state import StateUnknown

    spec = resolve(load(REPO / "deployments" / "lab-tiny-replicas.yaml"))
    h = build([spec], copy.deepcopy(INV)).hosts["testhost"]
    cut = [ln for ln in state_lines(stamps={"/etc/vllm-fleet/lab-tiny-replicas/replica-0.applied": "x"}) if ln != "end"]
    facts = {HostState: lambda query: Snapshot.parse(cut), File: lambda path: None, Sha256File: lambda path: None}
    with pytest.raises(
        StateUnknown,
        match=r"host testhost: the read of this host's state did not complete, so what each "
        r"vLLM instance of lab-tiny-replicas runs is not known.*run the deploy again",
    ):
        harness.run(install_service, spec, deployment_paths(spec), h.parts[spec["name"]], h.files, "k3y", facts=facts)
