"""vllm_fleet/roles/parts: the one ordered list of parts. serve installs the entries that apply on a
host in its order, the host's one state read is the union of their queries, `down` removes in its
reverse, and adding a part is one entry (shown with a stand-in part)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

from pyinfra.api import deploy

from vllm_fleet.host.state import HostState, Query
from vllm_fleet.render import files as render
from vllm_fleet.render.layout import build
from vllm_fleet.roles import parts
from vllm_fleet.roles.common import DeployContext, remove
from vllm_fleet.specs.load import load_and_check

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleetutil import host_state  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
INV = {
    "lab1": {"address": "10.10.0.11", "groups": ["servers", "proxy"], "data": {}},
    "lab2": {"address": "10.10.0.12", "groups": ["servers"], "data": {}},
}


def _ctx(name: str = "lab-tiny-routing", inv=INV):
    spec, _ = load_and_check(REPO / "deployments" / f"{name}.yaml", hardware=False)
    layout = build([spec], copy.deepcopy(inv))
    return spec, DeployContext(layout, {spec["name"]: spec}, {spec["name"]: {}}, {}, "")


def test_the_parts_of_a_host_come_from_the_layout_in_the_registrys_order():
    spec, ctx = _ctx()
    assert [p.name for p, _ in parts.host_steps(ctx, ctx.layout.hosts["lab1"])] == [
        "stack",
        "service",
        "router",
        "nginx",
        "smoke",
    ]
    assert [p.name for p, _ in parts.host_steps(ctx, ctx.layout.hosts["lab2"])] == ["stack", "service"]
    # down: the parts that place files, in the reverse order (nginx stops pointing at vLLM before vLLM stops)
    assert [name for name, _ in parts.removals()] == ["monitoring", "nginx", "router", "liveness", "service", "ray"]
    # each part places the files the layout renders under its name, and listens where it declares
    h = ctx.layout.hosts["lab1"]
    for p, step in parts.host_steps(ctx, h):
        if p.ports is not None:
            for lo, hi, what in p.ports(spec, step.node):
                assert lo <= hi and what
    assert set(h.files_of(spec["name"], "router")) == {render.paths(spec)["router_unit"]}


def test_a_new_part_is_one_entry_its_query_joins_the_one_read_and_its_install_runs(harness, monkeypatch):
    """A stand-in part appended to the registry: serve's state read holds its query on the hosts it
    applies to (and only there), host_steps runs its install there, `down` has its removal first."""
    from vllm_fleet.deploys.serve import state_query

    spec, ctx = _ctx()
    ran = []
    extra = parts.Part(
        "kv-tier",
        applies=lambda s: "proxy" in s.node.roles,
        query=lambda s: Query(stat=("/etc/kv-tier.conf",)),
        install=lambda s: ran.append((s.h.name, s.name)),
        remove=lambda **kw: {},
    )
    monkeypatch.setattr(parts, "PARTS", (*parts.PARTS, extra))
    got = {}

    @deploy("serve's query")
    def queries():
        got["lab1"], got["lab2"] = (state_query(ctx, ctx.layout.hosts[h]) for h in ("lab1", "lab2"))

    harness.run(queries)
    assert "/etc/kv-tier.conf" in got["lab1"].stat and "/etc/kv-tier.conf" not in got["lab2"].stat
    for h in ("lab1", "lab2"):
        for p, step in parts.host_steps(ctx, ctx.layout.hosts[h], ("kv-tier",)):
            p.install(step)
    assert ran == [("lab1", spec["name"])]
    assert parts.removals()[0][0] == "kv-tier"


def test_the_router_unit_of_a_proxy_no_longer_cache_aware_is_a_leftover_serve_prunes():
    """The router is an entry like any other: when the layout stops rendering its unit on a proxy
    (routing no longer cache_aware), serve's pruning removes it through the router entry's removal,
    found by the one rule for what the layout no longer renders (the old serve removed it in a step
    of its own, and the pruning skipped it on a proxy)."""
    spec, _ = load_and_check(REPO / "deployments" / "lab-tiny-routing.yaml", hardware=False)
    plain = {**spec, "proxy": {**spec["proxy"], "routing": {**spec["proxy"]["routing"], "policy": "round_robin"}}}
    layout = build([plain], copy.deepcopy(INV))
    h = layout.hosts["lab1"]
    unit = render.paths(spec)["router_unit"]
    assert unit not in h.files and "proxy" in h.parts[spec["name"]].roles
    ours = {unit: f"# Rendered by vllm-fleet for deployment {spec['name']}: edit the spec\n"}
    where = layout.paths[plain["name"]]
    query = remove.leftover_query(plain, where, h.parts[spec["name"]], h.files)
    assert unit in query.read or any(Path(unit).match(g) for g in query.globs)
    snap = host_state(ours)[HostState](query)
    found = remove.leftovers(plain, where, h.parts[spec["name"]], h.files, snap)
    assert found == [unit]
    assert remove.by_part(plain, where, h.files, found) == {"router": [unit]}
