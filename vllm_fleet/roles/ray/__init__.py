"""The ray role: one Ray cluster across the hosts of a multi-node vLLM server (parallel.backend ray).

Deploy function
    ``install_ray(spec, rendered, inventory_hosts)``: ``spec`` is the resolved spec,
    ``rendered`` this host's rendered files (``roles.common.rendered_for_host``),
    ``inventory_hosts`` the inventory as the renderer reads it (``roles.common.inventory_hosts()``).
    Host data in ``defaults.DEFAULTS`` (``socket_ifname``, ``ray_cluster_wait_timeout``,
    ``ray_firewall``, ``ray_firewall_allow``, ``ray_version_check``).
    Returns a :class:`RayResult`: ``owned`` (the rendered paths this role placed: leave them out
    of what the service role puts), ``env_ops`` (operations whose change must restart vLLM on
    this host) and ``cluster_restarted`` (an object with ``did_change()``, true at execute time
    when any Ray node of the cluster was (re)started: restart vLLM on the head after it).

Which node a host is comes from the renderer: a host with ``ray-head.service`` in its rendered
files is the head, one with ``ray-worker.service`` a worker; anything else is left alone.

In order (pyinfra runs each operation on every host before the next):
    1. node.env with this node's address (VLLM_HOST_IP = NODE_IP, what ``ray start
       --node-ip-address`` registers) and GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME: host data
       ``socket_ifname``, else ``parallel.socket_ifname``, else the one interface holding the
       node's address (a fact read from ``ip -o -4 addr show``; no such interface is an error
       before any host is changed); vllm.env; the Ray unit; the head's wait-ray-cluster.
    2. nftables: Ray's ports (``vllm_fleet.render.ray_ports``: the GCS port, the fixed ports the
       units pin, the worker port range) dropped from every address but the cluster's own
       (``ray_firewall_allow`` adds more), loaded by ``vllm-fleet-ray-firewall.service`` before Ray.
    3. Versions: when anything is about to (re)start, every node reports its Python, Ray and vLLM
       versions; a difference fails every node with the nodes and versions named.
    4. ray-head.service (re)started when its own inputs changed (unit, env files, the install);
       then each ray-worker.service when its own inputs changed or the head restarted (a worker
       left behind by a head restart would wait for a GCS that went away).
    5. On the head, when a node (re)started: wait for the whole cluster (the rendered
       wait-ray-cluster, deadline ``ray_cluster_wait_timeout``); the deploy fails naming the
       missing nodes. vLLM starts after this (vllm_fleet/roles/service; its unit waits for the cluster too).

Example (deploys/serve.py)::

    from vllm_fleet.roles.ray import install_ray

    ray = install_ray(spec=spec, rendered=rendered, inventory_hosts=inventory_hosts(),
                      restart_on=vllm_changed)
    install_service(spec=spec, rendered={p: f for p, f in rendered.items() if p not in ray.owned}, ...,
                    restart_on=[*ray.env_ops, ray.cluster_restarted])
"""

from __future__ import annotations

import copy
import ipaddress
import shlex
import time
from dataclasses import dataclass, field
from io import StringIO
from pathlib import Path
from typing import Any

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.api.exceptions import DeployError
from pyinfra.operations import files, python, systemd
from pyinfra.operations.util import any_changed

from vllm_fleet.roles.common import put_rendered
from vllm_fleet import command, render

from . import defaults as d
from .defaults import DEFAULTS
from .facts import Ipv4Interfaces, SystemdActive

__all__ = ["install_ray", "RayResult", "detect_ifname", "firewall_rules", "compare_versions", "DEFAULTS"]

TEMPLATES = Path(__file__).resolve().parent / "templates"

# Filled while the plan is built (the deploy file runs once per host), read at execute time:
# the operations of every node, so one host's conditions can see what happened on the others.
_CLUSTER: dict[str, Any] = {"inputs": [], "starts": [], "head_restart": [], "not_active": {}, "versions": {}}


def _reset_for_tests() -> None:
    for k, v in _CLUSTER.items():
        v.clear()


class _Changed:
    """``did_change()`` over operations of any host, looked up when asked (execute time)."""

    def __init__(self, key: str):
        self.key = key

    def did_change(self) -> bool:
        return any(op.did_change() for op in _CLUSTER[self.key])


@dataclass
class RayResult:
    role: str | None
    owned: list[str] = field(default_factory=list)
    env_ops: list = field(default_factory=list)
    cluster_restarted: Any = None


# ----------------------------------------------------------------------------------------------
# Pure helpers (tested without hosts)


def detect_ifname(interfaces: dict[str, list[str]], address: str) -> str | None:
    """The one interface holding ``address`` ({ifname: [ipv4 addresses]}), or None."""
    found = [name for name, addrs in interfaces.items() if address in addrs]
    return found[0] if len(found) == 1 else None


def firewall_rules(spec: dict[str, Any], cluster: list[str], allow: list[str] | None = None) -> str:
    """The nftables rules file: Ray's ports accepted only from ``cluster`` (+ ``allow``)."""
    import jinja2

    addrs = []
    for a in [*cluster, *(allow or [])]:
        net = ipaddress.ip_network(str(a), strict=False)
        if net.version != 4:
            raise DeployError(f"ray_firewall_allow: {a}: only IPv4 addresses/networks are supported")
        text = str(net.network_address) if net.prefixlen == 32 else str(net)
        if text not in addrs:
            addrs.append(text)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    return env.get_template("ray-firewall.nft.j2").render(
        name=spec["name"], table=d.FIREWALL_TABLE, allow=addrs, ports=render.ray_ports(spec))


def firewall_unit(spec: dict[str, Any]) -> str:
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    return env.get_template("ray-firewall.service.j2").render(name=spec["name"], table=d.FIREWALL_TABLE, rules=d.FIREWALL_FILE)


def compare_versions(versions: dict[str, dict[str, str | None]]) -> str | None:
    """None when every node reports the same versions; else a message naming nodes and versions."""
    if len(versions) < 2:
        return None
    keys = sorted({k for v in versions.values() for k in v})
    diffs = []
    for k in keys:
        seen = {node: v.get(k) for node, v in sorted(versions.items())}
        if len(set(seen.values())) > 1:
            diffs.append(f"{k}: " + ", ".join(f"{node} {ver or 'missing'}" for node, ver in seen.items()))
    if not diffs:
        return None
    return ("Ray nodes differ in versions (all nodes need the same Python, Ray and vLLM): " + "; ".join(diffs))


_VERSIONS_PY = """import importlib.metadata as m, platform, sys
print("python=" + platform.python_version())
for n in sys.argv[1:]:
    try:
        print(n + "=" + m.version(n))
    except m.PackageNotFoundError:
        print(n + "=")
"""


def _collect_versions(py: str, names: list[str]) -> None:
    """Execute time, on each node: record its versions for :func:`_check_versions`."""
    ok, out = host.run_shell_command(f"{shlex.quote(py)} -c {shlex.quote(_VERSIONS_PY)} {' '.join(shlex.quote(n) for n in names)}")
    lines = getattr(out, "stdout_lines", []) if ok else []
    vals: dict[str, str | None] = {}
    for line in lines:
        k, sep, v = line.strip().partition("=")
        if sep:
            vals[k] = v or None
    if not vals:
        raise RuntimeError(f"{host.name}: could not read versions with {py}")
    _CLUSTER["versions"][host.name] = vals


def _check_versions() -> None:
    problem = compare_versions(_CLUSTER["versions"])
    if problem:
        raise RuntimeError(problem)
    host.noop("same Python, Ray and vLLM on every Ray node: " + ", ".join(
        f"{k} {v}" for k, v in sorted(next(iter(_CLUSTER["versions"].values())).items())))


def _wait_cluster(py: str, script: str, user: str, env: dict[str, str], args: list[str], timeout: int) -> None:
    """Execute time, on the head: the rendered wait-ray-cluster as the service user."""
    argv = ["runuser", "-u", user, "--", "env", *[f"{k}={v}" for k, v in env.items()], py, script, *args,
            "--timeout", str(timeout), "--interval", "3"]
    t0 = time.monotonic()
    ok, out = host.run_shell_command(" ".join(shlex.quote(a) for a in argv) + " 2>&1", _sudo=True,
                                     _timeout=timeout + 120)
    text = "\n".join(getattr(out, "stdout_lines", []) or [])
    if not ok:
        raise RuntimeError(f"{host.name}: the Ray cluster is not complete after {time.monotonic() - t0:.0f} s:\n{text}")
    host.noop(text.strip().splitlines()[-1] if text.strip() else "Ray cluster complete")


# ----------------------------------------------------------------------------------------------


def _ray_role(rendered: dict[str, Any], p: dict[str, str]) -> str | None:
    if p["ray_head_unit"] in rendered:
        return "head"
    if p["ray_worker_unit"] in rendered:
        return "worker"
    return None


@deploy("Ray node", data_defaults=DEFAULTS)
def install_ray(spec: dict[str, Any], rendered: dict[str, Any], inventory_hosts: dict[str, dict[str, Any]],
                restart_on: list | None = None) -> RayResult:
    """
    Configure and (re)start this host's Ray node (head or worker) of a ``ray`` multi-node server.

    + spec: the resolved deployment spec
    + rendered: this host's rendered files ({path: RenderedFile})
    + inventory_hosts: {host: {address, groups, data}} as the renderer reads the inventory
    + restart_on: operations (the vLLM/Ray install) whose change must restart this Ray node

    **Example:**

    .. code:: python

        ray = install_ray(spec=spec, rendered=rendered, inventory_hosts=inventory_hosts(), restart_on=vllm_changed)
    """
    p = render.paths(spec)
    role = _ray_role(rendered, p)
    if role is None:
        return RayResult(None)
    par, srv, ins = spec["parallel"], spec["server"], spec["install"]
    me = inventory_hosts[host.name]
    address = str(me["address"])

    # 1. node.env with the interface of this node's address (detected unless configured)
    ifname = host.data.get("socket_ifname") or par.get("socket_ifname")
    if not ifname:
        interfaces = host.get_fact(Ipv4Interfaces)
        ifname = detect_ifname(interfaces, address)
        if not ifname:
            raise DeployError(f"{host.name}: no single interface holds the node address {address} "
                              f"(IPv4 interfaces: {interfaces or 'none read'}); set parallel.socket_ifname or host data socket_ifname")
    everyone = render.render(spec, inventory_hosts)
    ray_nodes = [name for name in inventory_hosts
                 if p["ray_head_unit"] in everyone.get(name, {}) or p["ray_worker_unit"] in everyone.get(name, {})]
    inv = copy.deepcopy(inventory_hosts)
    inv[host.name].setdefault("data", {})["socket_ifname"] = ifname
    mine = dict(rendered)
    mine[p["node_env"]] = render.render(spec, inv)[host.name][p["node_env"]]

    files.directory(name="Ray temp directory", path=p["ray_tmpdir"], user=srv["user"], group=srv["user"], mode="750")
    unit_path = p["ray_head_unit"] if role == "head" else p["ray_worker_unit"]
    owned = [p["vllm_env"], p["node_env"], unit_path]
    if role == "head" and p["wait_ray"] in mine:
        files.directory(name="Helper scripts directory", path=f"{ins['prefix']}/bin", user="root", group="root", mode="755")
        owned.append(p["wait_ray"])
    put = put_rendered(mine, owned)
    env_ops = [put[p["vllm_env"]], put[p["node_env"]]]
    unit_op = put[unit_path]

    # 2. firewall of Ray's ports
    fw_ops = []
    if host.data.get("ray_firewall"):
        cluster = [str(inventory_hosts[name]["address"]) for name in ray_nodes]
        rules = files.put(name=f"nftables rules: Ray's ports only from {', '.join(cluster)}",
                          src=StringIO(firewall_rules(spec, cluster, host.data.get("ray_firewall_allow"))),
                          dest=d.FIREWALL_FILE, user="root", group="root", mode="644")
        fw_unit = files.put(name=f"Unit {d.FIREWALL_UNIT}", src=StringIO(firewall_unit(spec)),
                            dest=f"{d.SYSTEMD_DIR}/{d.FIREWALL_UNIT}", user="root", group="root", mode="644")
        fw_ops = [rules, fw_unit]
    systemd.daemon_reload(name="systemd daemon-reload (Ray units)", _if=any_changed(unit_op, *fw_ops[1:]))
    if fw_ops:
        systemd.service(name=f"{d.FIREWALL_UNIT}: load the rules (they changed)", service=d.FIREWALL_UNIT,
                        running=True, restarted=True, enabled=True, _if=any_changed(*fw_ops))
        systemd.service(name=f"{d.FIREWALL_UNIT} active and enabled", service=d.FIREWALL_UNIT, running=True, enabled=True)

    # 3. versions equal on every node before anything (re)starts
    unit = Path(unit_path).name
    inputs = [unit_op, *env_ops, *(restart_on or [])]
    _CLUSTER["inputs"].extend(inputs)
    active = (host.get_fact(SystemdActive, unit=unit) or "") == "active"
    _CLUSTER["not_active"][host.name] = not active
    anything_starts = lambda: any(_CLUSTER["not_active"].values()) or _Changed("inputs").did_change()  # noqa: E731
    if host.data.get("ray_version_check"):
        names = ["ray", ins["vllm_package"]]
        python.call(name="Record Python, Ray and vLLM versions", function=_collect_versions,
                    py=command.env_python(spec), names=names, _if=anything_starts)
        python.call(name="Same versions on every Ray node", function=_check_versions, _if=anything_starts)

    # 4. head, then workers: restart only on their own inputs (workers also after a head restart)
    if role == "head":
        restart = systemd.service(name=f"Restart {unit} (its inputs changed)", service=unit, running=True,
                                  restarted=True, enabled=True, _if=any_changed(*inputs))
        _CLUSTER["head_restart"].append(restart)
    else:
        restart = systemd.service(name=f"Restart {unit} (its inputs changed, or the head restarted)", service=unit,
                                  running=True, restarted=True, enabled=True,
                                  _if=any_changed(*inputs, _Changed("head_restart")))
    running = systemd.service(name=f"{unit} running and enabled", service=unit, running=True, enabled=True)
    _CLUSTER["starts"].extend([restart, running])

    # 5. the head waits for the whole cluster when any node (re)started
    if role == "head":
        wait_env = {k: v for k, v in command.vllm_env(spec).items() if k.startswith("RAY_")}
        nodes = int(par["nodes"])
        gpus = nodes * int(spec["hardware"].get("gpus_per_node", 1))
        expect = []
        for name in ray_nodes:
            expect += ["--expect", str(inventory_hosts[name]["address"])]
        python.call(
            name=f"Wait for the Ray cluster: {nodes} nodes, {gpus:g} GPUs (deadline {host.data.get('ray_cluster_wait_timeout')} s)",
            function=_wait_cluster, py=command.env_python(spec), script=p["wait_ray"], user=srv["user"], env=wait_env,
            args=["--address", f"{par['head_address']}:{par['ray_port']}", "--nodes", str(nodes), "--gpus", str(gpus), *expect],
            timeout=int(host.data.get("ray_cluster_wait_timeout")),
            _if=_Changed("starts").did_change,
        )
    return RayResult(role, owned, env_ops, _Changed("starts"))
