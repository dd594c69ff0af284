"""The ray role: one Ray cluster across the hosts of a multi-node vLLM server (parallel.backend ray).

Deploy function
    ``install_ray(spec, where, node, layout, rendered, restart_on)``: ``spec`` is the resolved spec,
    ``where`` where its files live (the layout's, vllm_fleet.render.parts.Paths), ``node`` this
    deployment's part of the host's layout (``vllm_fleet.render.layout``), ``layout``
    the fleet's, ``rendered`` this host's rendered files (``roles.common.rendered_for_host``).
    Host data in ``defaults.DEFAULTS`` (``ray_cluster_wait_timeout``, ``ray_version_check``);
    ``socket_ifname``, ``ray_firewall``, ``ray_firewall_allow`` are read by the layout.
    Returns a :class:`RayResult`: ``owned`` (the rendered paths this role placed: the files of
    its part, ``HostLayout.files_of(deployment, "ray")``, but the firewall's), ``env_ops`` (operations whose change must
    restart vLLM on this host) and ``cluster_restarted`` (an object with ``did_change()``, true at execute time
    when any Ray node of the cluster was (re)started: restart vLLM on the head after it).
    ``state_query(spec, where, node, rendered)``: what it compares against (its files, directories and
    units), part of the deploy's one state read (deploys/serve.py; vllm_fleet.roles.common.state).

Which node a host is comes from the layout (its part's roles ``ray-head`` / ``ray-worker``);
anything else is left alone. The interface Gloo/NCCL use (``socket_ifname``) is host data, else
``parallel.socket_ifname``, else detected before the layout is built (``roles.common``: the one
interface holding the node's private address, :func:`detect_ifname`); node.env comes rendered
with it.

In order (pyinfra runs each operation on every host before the next):
    1. node.env with this node's private address (VLLM_HOST_IP = NODE_IP, what ``ray start
       --node-ip-address`` registers) and GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME; vllm.env; the
       Ray unit; the head's wait-ray-cluster (all as rendered).
    2. nftables (rendered by the layout): Ray's ports (``vllm_fleet.render.files.ray_ports``: the GCS
       port, the fixed ports the units pin, the worker port range) dropped from every address but
       the cluster's own private ones (``ray_firewall_allow`` adds more), loaded by
       ``vllm-fleet-ray-firewall.service`` before Ray.
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

    where = ctx.layout.paths[spec["name"]]
    ray = install_ray(spec=spec, where=where, node=node, layout=ctx.layout, rendered=rendered, restart_on=vllm_changed)
    install_service(spec=spec, where=where, node=node, rendered=rendered, ...,
                    restart_on=[*ray.env_ops, ray.cluster_restarted])
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.api.exceptions import DeployError
from pyinfra.operations import python, server, systemd
from pyinfra.operations.util import any_changed

from vllm_fleet.host import programs
from vllm_fleet.host.programs import argv as cmd
from vllm_fleet.host.programs import with_stderr
from vllm_fleet.roles.common import as_root, directory, put_rendered, remove, rendered_query, service_running
from vllm_fleet.host.state import Query
from vllm_fleet.roles.common.state import Converged, host_state, pending, role_state
from vllm_fleet.roles.vllm.facts import parse_probe
from vllm_fleet.render import command
from vllm_fleet.render.layout import Layout, Node, Paths, files_of
from vllm_fleet.specs.sections import reads

from . import defaults as d
from .defaults import DEFAULTS
from .facts import Ipv4Interfaces, detect_ifname

#: The spec sections this role reads (vllm_fleet.specs.sections); its README lists them.
SECTIONS = ("engine", "env", "hardware", "install", "monitoring", "name", "parallel", "proxy", "server")

__all__ = ["install_ray", "state_query", "RayResult", "detect_ifname", "compare_versions", "DEFAULTS"]


def _cluster(layout: Layout, name: str) -> dict[str, Any]:
    """The Ray cluster of deployment ``name`` in this deploy: filled while the plan is built (the
    deploy file runs once per host), read at execute time, so that one node's conditions see
    the operations of the others. It lives in the layout (``Layout.shared``), which the deploy
    builds once: a new deploy (or test) starts with an empty one."""
    return layout.shared.setdefault(
        f"ray:{name}", {"inputs": [], "starts": [], "head_restart": [], "not_active": {}, "versions": {}}
    )


class _Changed:
    """``did_change()`` over operations of any host, looked up when asked (execute time)."""

    def __init__(self, cluster: dict[str, Any], key: str):
        self.cluster, self.key = cluster, key

    def did_change(self) -> bool:
        return any(op.did_change() for op in self.cluster[self.key])


@dataclass
class RayResult:
    role: str | None
    owned: list[str] = field(default_factory=list)
    env_ops: list = field(default_factory=list)
    cluster_restarted: Any = None


# ----------------------------------------------------------------------------------------------
# Pure helpers (tested without hosts)


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
    return "Ray nodes differ in versions (all nodes need the same Python, Ray and vLLM): " + "; ".join(diffs)


def _collect_versions(py: str, names: list[str], cluster: dict[str, Any]) -> None:
    """Execute time, on each node: record its versions for :func:`_check_versions`."""
    ok, out = host.run_shell_command(programs.python(py, "env_probe.py", *(f"dist:{n}" for n in names)))
    lines = getattr(out, "stdout_lines", []) if ok else []
    vals = {**parse_probe(lines, "python"), **parse_probe(lines, "dist")} if lines else {}
    if not vals:
        raise RuntimeError(f"{host.name}: could not read versions with {py}")
    cluster["versions"][host.name] = vals


def _check_versions(cluster: dict[str, Any]) -> None:
    problem = compare_versions(cluster["versions"])
    if problem:
        raise RuntimeError(problem)
    host.noop(
        "same Python, Ray and vLLM on every Ray node: "
        + ", ".join(f"{k} {v}" for k, v in sorted(next(iter(cluster["versions"].values())).items()))
    )


def _wait_cluster(py: str, script: str, user: str, env: dict[str, str], args: list[str], timeout: int) -> None:
    """Execute time, on the head: the rendered wait-ray-cluster as the service user."""
    argv = [
        "runuser",
        "-u",
        user,
        "--",
        "env",
        *[f"{k}={v}" for k, v in env.items()],
        py,
        script,
        *args,
        "--timeout",
        str(timeout),
        "--interval",
        "3",
    ]
    t0 = time.monotonic()
    ok, out = host.run_shell_command(with_stderr(cmd(*argv)), **as_root(), _timeout=timeout + 120)
    text = "\n".join(getattr(out, "stdout_lines", []) or [])
    if not ok:
        raise RuntimeError(f"{host.name}: the Ray cluster is not complete after {time.monotonic() - t0:.0f} s:\n{text}")
    host.noop(text.strip().splitlines()[-1] if text.strip() else "Ray cluster complete")


# ----------------------------------------------------------------------------------------------


def _ray_role(node: Node) -> str | None:
    if node is None:
        return None
    if "ray-head" in node.roles:
        return "head"
    if "ray-worker" in node.roles:
        return "worker"
    return None


@deploy("Ray node", data_defaults=DEFAULTS)
@reads(*SECTIONS)
def install_ray(
    spec: dict[str, Any],
    where: Paths,
    node: Node | None = None,
    layout: Layout | None = None,
    rendered: dict[str, Any] | None = None,
    restart_on: list | None = None,
    present: bool = True,
    paths: list[str] | None = None,
) -> RayResult | dict[str, Any]:
    """
    Configure and (re)start this host's Ray node (head or worker) of a ``ray`` multi-node server,
    or (``present=False``) stop and remove it.

    + spec: the resolved deployment spec
    + where: where its files live (the layout's: ``ctx.layout.paths[name]``, vllm_fleet.render.parts.Paths)
    + node: this deployment's part of the host's layout (``vllm_fleet.render.layout.Node``; its roles say head or
      worker)
    + layout: the fleet's layout (``vllm_fleet.render.layout.Layout``: the other Ray nodes' private addresses)
    + rendered: this host's rendered files ({path: RenderedFile}: node.env with the interface, the
      Ray unit, the firewall)
    + restart_on: operations (the vLLM/Ray install) whose change must restart this Ray node
    + present: False stops, disables and removes the deployment's Ray unit, the cluster wait
      script and Ray's firewall (its nftables table deleted), when the host's copy names the
      deployment; ``node`` and ``layout`` are not needed then. Returns {path: its remove operation}
    + paths: with ``present=False``, remove only these (serve's pruning: fewer Ray nodes);
      default: every Ray file of the deployment here

    **Example:**

    .. code:: python

        h = host_layout(ctx)
        where = ctx.layout.paths[spec["name"]]
        ray = install_ray(spec=spec, where=where, node=h.parts[spec["name"]], layout=ctx.layout, rendered=h.files,
                          restart_on=vllm_changed)
        install_ray(spec=spec, where=where, rendered=h.files, present=False)
    """
    if not present:
        paths = remove.placed(spec, where, rendered or {}, "ray") if paths is None else paths
        return remove.remove_units_and_files(spec, where, paths, "ray")
    role = _ray_role(node)
    if role is None:
        return RayResult(None)
    role_state(state_query(spec, where, node, rendered))  # deploys/serve.py read it already: no command
    unit_path, owned, env_ops, unit_op = _put_node_files(spec, where, role, rendered)
    _ray_firewall(spec, where, rendered, unit_op)
    # versions equal on every node before anything (re)starts
    unit = Path(unit_path).name
    inputs = [unit_op, *env_ops, *(restart_on or [])]
    cluster = _cluster(layout, spec["name"])
    cluster["inputs"].extend(inputs)
    _version_check(spec, where, unit, cluster)
    _start_node(role, unit, inputs, cluster)
    if role == "head":
        _wait_for_cluster(spec, where, layout, cluster)
    return RayResult(role, owned, env_ops, _Changed(cluster, "starts"))


def _node_files(
    spec: dict[str, Any], where: Paths, role: str, rendered: dict[str, Any]
) -> tuple[str, list[str], list[str]]:
    """``(the node's unit path, the files this role puts, the directories it makes)``: the env
    files, the unit (head: and the cluster wait script), Ray's temp directory."""
    p = where
    unit_path = p["ray_head_unit"] if role == "head" else p["ray_worker_unit"]
    # the Ray files of this node (files_of its part) but the firewall's (step 2)
    owned = [x for x in files_of(rendered, spec["name"], "ray") if x not in _firewall_files(spec, where, rendered)]
    dirs = [p["ray_tmpdir"], *([f"{spec['install']['prefix']}/bin"] if p["wait_ray"] in owned else [])]
    return unit_path, owned, dirs


def _firewall_files(spec: dict[str, Any], where: Paths, rendered: dict[str, Any]) -> list[str]:
    """The firewall's rules and unit, when the layout rendered them (host data ray_firewall)."""
    p = where
    mine = files_of(rendered, spec["name"], "ray")
    return [p["ray_firewall_rules"], p["ray_firewall_unit"]] if p["ray_firewall_rules"] in mine else []


@reads(*SECTIONS)
def state_query(spec: dict[str, Any], where: Paths, node: Node, rendered: dict[str, Any]) -> Query:
    """What install_ray compares against (vllm_fleet.roles.common.state): its files (env files,
    unit, cluster wait script, firewall), its directories, the node's unit and the firewall's."""
    role = _ray_role(node)
    if role is None:
        return Query()
    unit_path, owned, dirs = _node_files(spec, where, role, rendered)
    fw = _firewall_files(spec, where, rendered)
    return rendered_query(rendered, [path for path in owned + fw if path in rendered]) | Query(
        stat=tuple(dirs), units=(Path(unit_path).name, *((d.FIREWALL_UNIT,) if fw else ()))
    )


def _put_node_files(
    spec: dict[str, Any], where: Paths, role: str, rendered: dict[str, Any]
) -> tuple[str, list[str], list, Any]:
    """1. Ray's temp directory, the env files, the node's unit (head: and the cluster wait
    script). Returns ``(unit path, the paths put, the env files' operations, the unit's)``."""
    p, srv = where, spec["server"]
    unit_path, owned, dirs = _node_files(spec, where, role, rendered)
    directory(name="Ray temp directory", path=dirs[0], user=srv["user"], group=srv["user"], mode="750")
    if len(dirs) > 1:
        directory(name="Helper scripts directory", path=dirs[1], user="root", group="root", mode="755")
    put = put_rendered(rendered, owned)
    return unit_path, owned, [put[p["vllm_env"]], put[p["node_env"]]], put[unit_path]


def _ray_firewall(spec: dict[str, Any], where: Paths, rendered: dict[str, Any], unit_op: Any) -> None:
    """2. The firewall of Ray's ports (rendered by the layout unless host data ray_firewall is
    false), and systemd's daemon-reload when the node's or the firewall's unit changed."""
    fw = _firewall_files(spec, where, rendered)
    put = put_rendered(rendered, fw) if fw else {}
    fw_ops = [put[path] for path in fw]
    # (operations only where something differs: a converged node gets none, vllm_fleet.roles.common.state)
    if pending(unit_op, *fw_ops[1:]):
        systemd.daemon_reload(name="systemd daemon-reload (Ray units)", _if=any_changed(unit_op, *fw_ops[1:]))
    if fw_ops:
        if pending(*fw_ops):
            systemd.service(
                name=f"{d.FIREWALL_UNIT}: load the rules (they changed)",
                service=d.FIREWALL_UNIT,
                running=True,
                restarted=True,
                enabled=True,
                _if=any_changed(*fw_ops),
            )
        service_running(
            name=f"{d.FIREWALL_UNIT} active and enabled", service=d.FIREWALL_UNIT, running=True, enabled=True
        )


def _version_check(spec: dict[str, Any], where: Paths, unit: str, cluster: dict[str, Any]) -> None:
    """3. Whether this node's unit is active (a node that is not starts), and, when anything of
    the cluster starts (host data ``ray_version_check``), every node's Python, Ray and vLLM
    versions recorded and compared before anything (re)starts. Active or not comes from the
    host's state read (not read: not active)."""
    seen = host_state().unit(unit) or {}
    active = seen.get("ActiveState") == "active"
    cluster["not_active"][host.name] = not active
    anything_starts = lambda: any(cluster["not_active"].values()) or _Changed(cluster, "inputs").did_change()  # noqa: E731
    if host.data.get("ray_version_check"):
        names = ["ray", spec["install"]["vllm_package"]]
        python.call(
            name="Record Python, Ray and vLLM versions",
            function=_collect_versions,
            py=where["python"],
            names=names,
            cluster=cluster,
            _if=anything_starts,
        )
        python.call(
            name="Same versions on every Ray node", function=_check_versions, cluster=cluster, _if=anything_starts
        )


def _start_node(role: str, unit: str, inputs: list, cluster: dict[str, Any]) -> None:
    """4. Head, then workers: restart only on their own inputs (workers also after a head
    restart); running and enabled. The head's restart exists only where one of its inputs may
    change; a worker's always (conditional): whether the head restarts is another host's plan,
    which may not be built yet when this one is."""
    if role == "head":
        restart = (
            systemd.service(
                name=f"Restart {unit} (its inputs changed)",
                service=unit,
                running=True,
                restarted=True,
                enabled=True,
                _if=any_changed(*inputs),
            )
            if pending(*inputs)
            else Converged(f"restart {unit}")
        )
        cluster["head_restart"].append(restart)
    else:
        # a command, not systemd.service: pyinfra's operation would read the unit's facts while
        # planning, on every converged worker, for a restart that happens only at execute time;
        # `systemctl restart` starts a stopped unit too, and "running and enabled" follows
        restart = server.shell(
            name=f"Restart {unit} (its inputs changed, or the head restarted)",
            commands=[cmd("systemctl", "restart", unit)],
            _if=any_changed(*inputs, _Changed(cluster, "head_restart")),
        )
    running = service_running(name=f"{unit} running and enabled", service=unit, running=True, enabled=True)
    cluster["starts"].extend([restart, running])


def _wait_for_cluster(spec: dict[str, Any], where: Paths, layout: Layout, cluster: dict[str, Any]) -> None:
    """5. On the head: wait for the whole cluster (every node, every GPU) when any node (re)started."""
    p, par, srv = where, spec["parallel"], spec["server"]
    ray_nodes = [n for n in layout.nodes(spec["name"]) if n.roles & {"ray-head", "ray-worker"}]
    wait_env = {k: v for k, v in command.vllm_env(spec).items() if k.startswith("RAY_")}
    nodes = int(par["nodes"])
    gpus = nodes * int(spec["hardware"]["gpus_per_node"])
    expect = []
    for n in ray_nodes:
        expect += ["--expect", str(n.private)]
    python.call(
        name=(
            f"Wait for the Ray cluster: {nodes} nodes, {gpus:g} GPUs (deadline "
            f"{host.data.get('ray_cluster_wait_timeout')} s)"
        ),
        function=_wait_cluster,
        py=p["python"],
        script=p["wait_ray"],
        user=srv["user"],
        env=wait_env,
        args=[
            "--address",
            f"{par['head_address']}:{par['ray_port']}",
            "--nodes",
            str(nodes),
            "--gpus",
            str(gpus),
            *expect,
        ],
        timeout=int(host.data.get("ray_cluster_wait_timeout")),
        _if=_Changed(cluster, "starts").did_change,
    )
