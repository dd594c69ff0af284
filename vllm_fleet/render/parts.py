"""The per-host layout's parts: resolved spec(s) + inventory -> what every host runs.

    build_parts([resolved, ...], inventory) -> Layout (without files)

:func:`vllm_fleet.render.files.build` (as :func:`vllm_fleet.render.layout.build`) adds the
files. For each host: its parts (per deployment: vLLM instances, each with its unit, port, GPU ids or
CPU cores and state dir; Ray head or worker; proxy; monitoring), every file the deploy places
there (units, env files, nginx sites, firewall rules, monitoring configs; secrets as
placeholders), and the secrets those files need, by name. ``vllm-fleet render`` writes exactly
these files; the deploys and roles branch on this layout only (they never look at group names
or render the fleet again).

Inventory groups (pyinfra: a module-level list is a group), and nothing else, give parts:

============  ==============================================================================
``servers``   vLLM API servers of every deployment given (host data ``deployments: [NAME]``
              limits a host, in any group but ``monitoring``, to some; a host or group with its
              own ``vllm_fleet_spec`` gets it set to its specs); for a multi-node spec the one
              ``servers`` host is the head
``workers``   the other nodes of a multi-node spec (``ray_workers`` is the same group), node
              ranks in inventory order; single-node specs leave them alone
``proxy``     nginx in front of every deployment with ``proxy.enabled``; with no ``proxy``
              host, nginx runs on each ``servers`` host. With ``proxy.routing`` in effect
              ``cache_aware``, the proxy host also gets part ``router`` (vLLM's router on
              loopback, ports ``proxy.routing.router.port`` / ``metrics_port``)
``monitoring`` Prometheus (with ``monitoring.enabled``)
============  ==============================================================================

Other groups (the lab's ``ray_head``, ``all``, your own) mean nothing here.

Host data read: ``ssh_hostname`` (the address vllm-fleet connects to and clients use),
``private_address`` (the cluster network: Ray, NCCL/Gloo, ``parallel.head_address``, the nginx
upstreams and firewalls; default the ssh address), ``replicas_per_host`` (an int, or
``{deployment: int}``: overrides ``replicas.per_host`` on this host), ``kv_offload_gib`` (a number
or ``{deployment: number}``: each replica's CPU tier of the KV cache on this host, for the
deployments with ``engine.kv_offload``; the deploy fills it for ``auto``), ``cpu_count`` (CPU build:
cores to split between replicas and ranks), ``deployments``, ``upstream_down``, and the keys
of :data:`HOST_DATA_DEFAULTS`. All of it is declared in ``specs/schemas/hostdata.schema.json`` and
checked (:mod:`vllm_fleet.specs.hostdata`) before :func:`build` reads any of it.

Across hosts and deployments :func:`build` checks every listening port of every part on a host
(:func:`_listen_ports`), every GPU, the Ray and monitoring parts one per host.

Pure: no host is touched, no secret read, pyinfra not imported.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

from vllm_fleet.render.command import world_size_per_node
from vllm_fleet.specs.document import ROUTER_POLICY
from vllm_fleet.specs.hostdata import host_address, inline_groups, inventory_problems, is_address_or_hostname
from vllm_fleet.specs.planner import replica_gpu_utilization, replicas_per_gpu, shares_fit_one_gpu
from vllm_fleet.specs.ports import RAY_FIXED_PORTS, RAY_WORKER_PORTS

#: The blackbox exporter's address on the monitoring host (loopback: only Prometheus probes through it).
BLACKBOX_LISTEN = "127.0.0.1:9115"

#: Inventory group -> part. Exactly these names (see the module docstring).
GROUPS = {
    "servers": "server",
    "workers": "worker",
    "ray_workers": "worker",
    "proxy": "proxy",
    "monitoring": "monitoring",
}

#: Host data keys render reads (the deploy may fill them from facts before rendering).
HOST_DATA_KEYS = (
    "socket_ifname",
    "cpu_count",
    "ray_memory_bytes",
    "ray_object_store_bytes",
    "upstream_down",
    "replicas_per_host",
    "deployments",
    "private_address",
    "kv_offload_gib",
)

#: Host data the layout reads with these defaults (the roles take them from here too).
HOST_DATA_DEFAULTS: dict[str, Any] = {
    # vLLM listening beyond loopback: an nftables table lets only the proxy hosts (and loopback,
    # and these addresses/CIDRs) reach its ports. False: leave the host's firewall alone.
    "vllm_api_firewall": True,
    "vllm_api_firewall_allow": [],
    # Ray's ports (no authentication) only from the cluster's own private addresses (+ these).
    "ray_firewall": True,
    "ray_firewall_allow": [],
}

#: proxy.routing.policy `auto` with 2+ replicas (docs/routing.md says why, with the numbers).
AUTO_POLICY = "session"

#: Where the deploy places systemd units (the one spelling), and what a unit file's name ends with.
SYSTEMD_DIR = "/etc/systemd/system"
UNIT_SUFFIXES = (".service", ".socket", ".timer", ".path", ".mount", ".target")
#: The unit of an older release (one vLLM per host): the deploy stops, disables and removes it.
LEGACY_UNIT = "vllm.service"
SERVICE_PARTS = frozenset({"server", "worker", "ray-head", "ray-worker"})


def unit_name(deployment: str, index: int) -> str:
    """``vllm-NAME-N.service``: one full unit file per replica (see docs/replicas.md)."""
    return f"vllm-{deployment}-{index}.service"


class LayoutError(ValueError):
    """The specs and the inventory do not describe a deployable layout; each line names the
    host(s), the spec(s) and the fix."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclass
class Instance:
    """One vLLM process (one systemd unit) of one deployment on one host."""

    deployment: str
    host: str
    index: int
    unit: str
    port: int
    state_dir: str
    env_file: str
    address: str  # where the proxy reaches it (the host's private address; None in role mode)
    gpu_ids: list[int] | None = None  # CUDA_VISIBLE_DEVICES (cuda)
    cpus: str | None = None  # VLLM_CPU_OMP_THREADS_BIND (cpu build)
    role: str = "server"  # "worker": a headless node of a `native` multi-node server
    node_rank: int = 0
    down: bool = False  # out of the nginx upstream (a rollout's batch)

    @property
    def id(self) -> str:
        """``HOST:N``: how a rollout and ``VLLM_FLEET_UPSTREAM_DOWN`` name an instance."""
        return f"{self.host}:{self.index}"


@dataclass
class Node:
    """One deployment's parts on one host (what the file builders take)."""

    target: str
    roles: set[str]
    address: str | None = None  # ssh / client address; None: unknown (role mode)
    node_rank: int = 0
    data: dict[str, Any] | None = None
    private: str | None = None  # cluster address
    instances: list[Instance] = field(default_factory=list)
    #: the deployment's routing policy in effect (:func:`routing_policy`, decided once for all its
    #: nodes when the parts are laid out); None without a proxy
    policy: str | None = None


@dataclass(frozen=True, eq=False)
class Paths(Mapping[str, str]):
    """Where one deployment's files live on its hosts, decided once when the layout is built
    (:attr:`Layout.paths`; vllm_fleet.render.files.deployment_paths): a mapping of every path by a
    short name (``paths["nginx_site"]``: vllm_fleet.render.files.paths; the install stack's env as
    ``env``, ``python`` and ``uv``: vllm_fleet.render.command.env_paths), with ``parts``, the fixed
    paths each part may place ({part: [path]}: vllm_fleet.render.files.part_paths), and
    ``monitoring``, the monitoring files by name (vllm_fleet.render.monitoring.paths). The roles
    read these; none of them works a path out again."""

    named: Mapping[str, str]
    parts: Mapping[str, list[str]]
    monitoring: Mapping[str, str]

    def __getitem__(self, key: str) -> str:
        return self.named[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.named)

    def __len__(self) -> int:
        return len(self.named)

    def declared(self) -> set[str]:
        """Every fixed path of every part (what a host may hold of the deployment beside the
        replicas' units and env files)."""
        return {x for xs in self.parts.values() for x in xs}

    def part_of(self, path: str) -> str | None:
        """The first part that declares ``path`` (the service before the Ray node: both name
        vllm.env and node.env), or None."""
        return next((part for part, xs in self.parts.items() if path in xs), None)


@dataclass(frozen=True)
class Secret:
    """A secret a host's files need: which deployment, which spec key, which files hold it."""

    deployment: str
    key: str  # "api_key" | "hub_token"
    paths: tuple[str, ...] = ()


def files_of(files: dict[str, Any], deployment: str, part: str | None = None) -> dict[str, Any]:
    """Of a host's rendered files ({path: RenderedFile}), those of ``deployment``'s ``part``
    (every part of it: None), by the owner each file carries (vllm_fleet.render.text.RenderedFile)."""
    return {path: f for path, f in files.items() if f.deployment == deployment and part in (None, f.part)}


@dataclass
class HostLayout:
    name: str
    address: str | None
    private_address: str | None
    data: dict[str, Any]
    parts: dict[str, Node] = field(default_factory=dict)  # {deployment: Node}
    files: dict[str, Any] = field(default_factory=dict)  # {path: RenderedFile}
    secrets: list[Secret] = field(default_factory=list)
    order: int = 0  # position in the `servers` group when known (the inventory's order otherwise)

    @property
    def instances(self) -> list[Instance]:
        return [i for n in self.parts.values() for i in n.instances]

    def files_of(self, deployment: str, part: str | None = None) -> dict[str, Any]:
        """The files of ``deployment``'s ``part`` (every part: None) on this host: exactly what
        that part's role places ({path: RenderedFile}); ``deployment`` "" gives the host-wide files."""
        return files_of(self.files, deployment, part)

    def roles(self, deployment: str | None = None) -> set[str]:
        if deployment is not None:
            n = self.parts.get(deployment)
            return set(n.roles) if n else set()
        return {r for n in self.parts.values() for r in n.roles}


@dataclass
class Layout:
    deployments: dict[str, dict[str, Any]]  # {name: resolved}
    hosts: dict[str, HostLayout]
    client: dict[str, Any] = field(default_factory=dict)  # files for the control machine
    with_inventory: bool = True
    #: Scratch space of one deploy for the roles (e.g. roles.ray: every Ray node's operations,
    #: so that one host's conditions see the others'); empty in a new layout.
    shared: dict[str, Any] = field(default_factory=dict)
    #: what is allowed but costly, with the fix (e.g. :data:`MANY_PROXIES` servers without a `proxy` group)
    warnings: list[str] = field(default_factory=list)
    #: {deployment: where its files live} (:class:`Paths`), filled with the files
    #: (vllm_fleet.render.files.fill_files): what the roles, `down` and the rollout read
    paths: dict[str, Paths] = field(default_factory=dict)

    def files(self) -> dict[str, dict[str, Any]]:
        """{target: {path: RenderedFile}}, the ``client`` target last (what ``render`` returns)."""
        out = {name: dict(h.files) for name, h in self.hosts.items() if h.files}
        out["client"] = dict(self.client)
        return out

    def instances(self, deployment: str | None = None) -> list[Instance]:
        """Every instance (of one deployment): hosts in the order of the `servers` group (else the
        inventory's), then by index."""
        hosts = sorted(self.hosts.values(), key=lambda h: h.order)
        return [i for h in hosts for i in h.instances if deployment in (None, i.deployment)]

    def hosts_with(self, role: str, deployment: str | None = None) -> list[str]:
        return [name for name, h in self.hosts.items() if role in h.roles(deployment)]

    def nodes(self, deployment: str) -> list[Node]:
        return [h.parts[deployment] for h in self.hosts.values() if deployment in h.parts]

    def policy(self, deployment: str) -> str | None:
        """The deployment's routing policy in effect (decided once: :attr:`Node.policy`)."""
        return next((n.policy for n in self.nodes(deployment)), None)


# ---------------------------------------------------------------------------------------------


def _multi(resolved: dict[str, Any]) -> bool:
    return int(resolved["parallel"]["nodes"]) > 1


def gpus_per_instance(resolved: dict[str, Any]) -> int:
    return world_size_per_node(resolved)


def replicas_on(resolved: dict[str, Any], data: dict[str, Any] | None) -> int:
    """Replicas of this deployment on a host: host data ``replicas_per_host``, else the spec's."""
    override = (data or {}).get("replicas_per_host")
    if isinstance(override, dict):
        override = override.get(resolved["name"])
    if override is not None:
        return int(override)
    return int(resolved["replicas"]["per_host"])


def kv_offload_on(resolved: dict[str, Any], data: dict[str, Any] | None) -> float | str | None:
    """Each replica's CPU tier of the KV cache on a host, in GiB: host data ``kv_offload_gib``
    (the deploy's figure for ``auto``, or the user's), else engine.kv_offload.size_gib (``auto``
    while no host figure is known); None when the deployment has no tier."""
    size = resolved["engine"]["kv_offload"]["size_gib"]
    if not size or resolved["install"]["accelerator"] == "cpu":
        return None
    override = (data or {}).get("kv_offload_gib")
    if isinstance(override, dict):
        override = override.get(resolved["name"])
    return float(override) if override is not None else size


def _gpu_pool(resolved: dict[str, Any]) -> list[int]:
    hw = resolved["hardware"]
    if hw.get("gpu_ids"):
        return [int(g) for g in hw["gpu_ids"]]
    return list(range(int(hw["gpus_per_node"])))


def _cpu_sets(cpu_count: int | None, replicas: int, ranks: int) -> list[str | None]:
    """VLLM_CPU_OMP_THREADS_BIND per replica: the host's cores split into ``replicas`` blocks,
    each block into ``ranks`` ranges joined by ``|`` (one core per rank when the count is unknown).
    One replica of one rank: None (vLLM's own binding; nothing to share)."""
    total = replicas * ranks
    if total == 1:
        return [None]
    if not cpu_count or cpu_count < total:
        per = 1
    else:
        per = cpu_count // total
    out = []
    for r in range(replicas):
        parts = []
        for k in range(ranks):
            first = (r * ranks + k) * per
            parts.append(str(first) if per == 1 else f"{first}-{first + per - 1}")
        out.append("|".join(parts))
    return out


def _instances(
    resolved: dict[str, Any],
    host: str,
    data: dict[str, Any],
    private: str | None,
    rank: int,
    problems: list[str],
    source: str,
) -> list[Instance]:
    name, srv, ins, par = resolved["name"], resolved["server"], resolved["install"], resolved["parallel"]
    n = replicas_on(resolved, data)
    multi = _multi(resolved)
    if multi and n != 1:
        problems.append(
            f"{host}: {source}: a {par['nodes']}-node server runs one instance per node, not {n}: "
            "set replicas.per_host (or host data replicas_per_host) to 1"
        )
        n = 1
    if n < 1:
        return []
    if int(srv["port"]) + n - 1 > 65535:
        problems.append(
            f"{host}: {source}: {n} replica(s) listen on server.port {srv['port']} to {int(srv['port']) + n - 1}, "
            f"past the last TCP port 65535: set server.port to at most {65536 - n} (each replica takes server.port + "
            "its index)"
        )
        return []
    worker = rank > 0
    per = gpus_per_instance(resolved)
    out: list[Instance] = []
    cuda = ins["accelerator"] == "cuda"
    pool = _gpu_pool(resolved)
    hw = resolved["hardware"]
    if cuda and hw.get("gpu_ids") and len(hw["gpu_ids"]) != int(hw["gpus_per_node"]):
        problems.append(
            f"{source}: hardware.gpu_ids lists {len(hw['gpu_ids'])} GPU(s) but hardware.gpus_per_node is "
            f"{hw.get('gpus_per_node', 1)}: make them agree (gpus_per_node: {len(hw['gpu_ids'])})"
        )
    share = replicas_per_gpu(resolved) if cuda else 1
    groups = -(-n // share)
    if cuda and groups * per > len(pool):
        problems.append(
            f"{host}: {source}: {n} replica(s) x {per} GPU(s) (tensor x pipeline per node)"
            + (f", {share} per GPU group (replicas.per_gpu)," if share > 1 else "")
            + f" need {groups * per} GPUs, "
            f"the deployment has {len(pool)} on this host "
            f"(hardware.{'gpu_ids' if resolved['hardware'].get('gpu_ids') else 'gpus_per_node'}): lower "
            f"replicas.per_host to {max(1, len(pool) // per) * share} or give it more GPUs"
        )
    cpus = _cpu_sets(int(data["cpu_count"]) if data.get("cpu_count") else None, n, per) if not cuda else [None] * n
    for i in range(n):
        g = i // share  # replicas.per_gpu replicas share one group of GPUs
        gpu_ids = pool[g * per : (g + 1) * per] if cuda else None
        if cuda and multi and not resolved["hardware"].get("gpu_ids"):
            gpu_ids = None  # the whole node is the deployment's: Ray (or torch) sees every GPU
        out.append(
            Instance(
                deployment=name,
                host=host,
                index=i,
                unit=unit_name(name, i),
                port=int(srv["port"]) + i,
                state_dir=f"{ins['state_dir']}/replica-{i}",
                env_file=f"{ins['config_dir']}/replica-{i}.env",
                address=private or "",
                gpu_ids=gpu_ids,
                cpus=cpus[i],
                role="worker" if worker else "server",
                node_rank=rank,
            )
        )
    return out


def _down_set() -> set[str]:
    return set()


def _inventory_nodes(resolved: dict[str, Any], inventory: dict[str, dict[str, Any]]) -> list[Node]:
    """A node for each inventory host with a part of this deployment, its roles from its groups
    (:data:`GROUPS`; host data `deployments` that leaves this one out keeps it off the service parts)."""
    name = resolved["name"]
    out: list[Node] = []
    for host, h in inventory.items():
        data = dict(h.get("data") or {})
        wanted = data.get("deployments")
        roles = {GROUPS[g] for g in h.get("groups", []) if g in GROUPS}
        if wanted is not None and name not in wanted:
            roles -= {"server", "worker", "proxy"}
        if roles:
            address = str(h.get("address") or host)
            out.append(Node(host, roles, address, 0, data, str(data.get("private_address") or address)))
    return out


def _multi_node_roles(
    resolved: dict[str, Any], servers: list[Node], workers: list[Node], problems: list[str], source: str
) -> None:
    """A multi-node server: one head, as many workers as parallel.nodes asks, node ranks, and (Ray) head / worker
    roles."""
    par = resolved["parallel"]
    ray_multi = par["backend"] == "ray"
    if len(servers) != 1:
        problems.append(
            f"{source}: a {par['nodes']}-node server has exactly one head host in the `servers` group, found "
            f"{len(servers)}: {', '.join(n.target for n in servers)}"
        )
    head = servers[0]
    if head.private != par.get("head_address"):
        problems.append(
            f"{source}: parallel.head_address is {par.get('head_address')} but the head host {head.target} has "
            f"private address {head.private}: make them the same (host data private_address, else ssh_hostname; "
            "VLLM_HOST_IP must be the address Ray registered)"
        )
    if 1 + len(workers) != int(par["nodes"]):
        problems.append(
            f"{source}: parallel.nodes is {par['nodes']} but the inventory has 1 server and {len(workers)} worker "
            f"host(s): list {int(par['nodes']) - 1} host(s) in the `workers` group"
        )
    if ray_multi:
        head.roles.add("ray-head")
    for rank, w in enumerate(workers, start=1):
        w.node_rank = rank
        if "server" in w.roles:
            problems.append(f"{source}: inventory: host {w.target} is both the server and a worker")
        if ray_multi:
            w.roles.discard("worker")
            w.roles.add("ray-worker")


def _add_instances(
    resolved: dict[str, Any], nodes: list[Node], down: set[str], problems: list[str], source: str
) -> None:
    """The vLLM instances of each server and worker node, marked down as the rollout (or host data upstream_down)
    asks."""
    for n in nodes:
        if "server" in n.roles or "worker" in n.roles:
            n.instances = _instances(resolved, n.target, n.data or {}, n.private, n.node_rank, problems, source)
            host_down = bool((n.data or {}).get("upstream_down")) or n.target in down
            for inst in n.instances:
                inst.down = host_down or inst.id in down


#: Server hosts of one deployment from which having no `proxy` group earns a warning: nginx then
#: runs on every server host with every replica in its upstream, and every replica's API firewall
#: lists every one of them, so what is rendered grows as the square of the servers (measured:
#: docs/rollout.md, "Many servers").
MANY_PROXIES = 8


def no_proxy_group_warning(source: str, name: str, servers: int) -> str:
    return (
        f"{source}: proxy: no host of the inventory is in the `proxy` group, so nginx runs on each of the {servers} "
        f"server hosts of {name}, each with all {servers}+ replicas in its upstream, and each replica's API firewall "
        f"lists all {servers} of them: the rendered files and every change to them grow as {servers} x {servers}. "
        "Fix: put one or two hosts in the inventory's `proxy` group (a proxy may also be a server), "
        "or set proxy.enabled: false in this spec if clients reach the replicas without nginx"
    )


def _host_parts(
    resolved: dict[str, Any],
    inventory: dict[str, dict[str, Any]],
    down: set[str],
    problems: list[str],
    source: str,
    warnings: list[str] | None = None,
) -> list[Node]:
    """One deployment's nodes on the inventory's hosts (the old renderer's rules, with groups
    fixed to :data:`GROUPS`)."""
    name = resolved["name"]
    proxy_on = resolved["proxy"]["enabled"]
    monitoring_on = bool(resolved["monitoring"]["enabled"])
    out = _inventory_nodes(resolved, inventory)
    servers = [n for n in out if "server" in n.roles]
    workers = [n for n in out if "worker" in n.roles]
    if not servers:
        problems.append(
            f"{source}: no inventory host runs deployment {name}: put a host in the `servers` group"
            + (
                " (or add it to that host's data `deployments`)"
                if any((h.get("data") or {}).get("deployments") is not None for h in inventory.values())
                else ""
            )
        )
        return []
    if not proxy_on:
        for n in out:
            n.roles.discard("proxy")
    if not monitoring_on:
        for n in out:
            n.roles.discard("monitoring")
    elif not any("monitoring" in n.roles for n in out):
        problems.append(
            f"{source}: monitoring.enabled is true but no inventory host is in the `monitoring` group: add one (it "
            "runs Prometheus)"
        )
    if _multi(resolved):
        _multi_node_roles(resolved, servers, workers, problems, source)
    else:
        for w in workers:
            w.roles.discard("worker")
    if proxy_on and not any("proxy" in n.roles for n in out):
        for s in servers:  # no proxy group: nginx runs on each server host
            s.roles.add("proxy")
        if len(servers) >= MANY_PROXIES and warnings is not None:
            warnings.append(no_proxy_group_warning(source, name, len(servers)))
    out = [n for n in out if n.roles]
    _add_instances(resolved, out, down, problems, source)
    _decide_routing(resolved, out)
    return out


def routing_policy(resolved: dict[str, Any], replicas: int) -> str:
    """The policy in effect (proxy.routing.policy; `auto`: least_conn for one replica, else
    :data:`AUTO_POLICY`) for a deployment with this many API-server replicas."""
    policy = resolved["proxy"]["routing"]["policy"]
    if policy != "auto":
        return policy
    return AUTO_POLICY if replicas >= 2 else "least_conn"


def server_replicas(nodes: Iterable[Node]) -> int:
    return sum(1 for n in nodes for i in n.instances if i.role == "server")


def _decide_routing(resolved: dict[str, Any], nodes: list[Node]) -> None:
    """The routing policy in effect, decided once for the deployment from its API-server replicas
    on all its nodes (each node carries it: ``Node.policy``); ``cache_aware``: vLLM's router runs
    beside nginx on every proxy host (part ``router``)."""
    policy = routing_policy(resolved, server_replicas(nodes)) if resolved["proxy"]["enabled"] else None
    for n in nodes:
        n.policy = policy
        if policy == ROUTER_POLICY and "proxy" in n.roles:
            n.roles.add("router")


def _role_parts(resolved: dict[str, Any], problems: list[str], source: str) -> list[Node]:
    """Without an inventory: one target per part (``server``, ``worker``, ``ray-head``, ...)."""
    par = resolved["parallel"]
    multi, backend = _multi(resolved), par["backend"]
    head = par.get("head_address") if multi else None
    out = [Node("server", {"server"}, head, 0, {}, head)]
    if multi and backend == "ray":
        out.append(Node("ray-head", {"ray-head"}, head, 0, {}, head))
        out.append(Node("ray-worker", {"ray-worker"}, None, 1, {}))
    elif multi:
        out.append(Node("worker", {"worker"}, None, 1, {}))
    if resolved["proxy"]["enabled"]:
        out.append(Node("proxy", {"proxy"}))
    if resolved["monitoring"]["enabled"]:
        out.append(Node("monitoring", {"monitoring"}))
    for n in out:
        if n.roles & {"server", "worker"}:
            n.instances = _instances(
                resolved, n.target, {}, None if n.target != "server" else head, n.node_rank, problems, source
            )
            for i in n.instances:
                i.address = "127.0.0.1"
    _decide_routing(resolved, out)
    return out


# ---------------------------------------------------------------------------------------------
# Checks across deployments and hosts (several specs on one inventory)


#: Parts that one daemon per host serves for every deployment there: the same port is no clash.
_SHARED = ("nginx", "node exporter", "dcgm-exporter", "blackbox exporter")


def vllm_ports(resolved: dict[str, Any], node: Node) -> list[tuple[int, int, str]]:
    """The service part's: each vLLM replica's port."""
    return [(i.port, i.port, f"vLLM {i.unit}") for i in node.instances]


def nginx_ports(resolved: dict[str, Any], node: Node) -> list[tuple[int, int, str]]:
    """The nginx part's: proxy.listen, on a proxy."""
    if "proxy" not in node.roles:
        return []
    listen = int(resolved["proxy"]["listen"])
    return [(listen, listen, f"nginx of {resolved['name']} (proxy.listen)")]


def router_ports(resolved: dict[str, Any], node: Node) -> list[tuple[int, int, str]]:
    """The router part's: vLLM's router beside nginx (proxy.routing, issue 23), its API and metrics ports."""
    if "router" not in node.roles:
        return []
    name, router = resolved["name"], resolved["proxy"]["routing"]["router"]
    return [
        (int(router["port"]),) * 2 + (f"vLLM router of {name} (proxy.routing.router.port)",),
        (int(router["metrics_port"]),) * 2 + (f"vLLM router metrics of {name} (proxy.routing.router.metrics_port)",),
    ]


def monitoring_ports(resolved: dict[str, Any], node: Node) -> list[tuple[int, int, str]]:
    """The monitoring part's: the node exporter on every host of the deployment, dcgm-exporter on a
    CUDA server or worker, Prometheus and the blackbox exporter on the monitoring host."""
    name, mon, out = resolved["name"], resolved["monitoring"], []
    if not (mon["enabled"] and node.roles):
        return []
    if mon["node_exporter"]:
        out.append(
            (int(mon["node_exporter_port"]),) * 2 + (f"node exporter (monitoring.node_exporter_port of {name})",)
        )
    cuda = resolved["install"]["accelerator"] == "cuda"
    if mon["dcgm_exporter"] and cuda and node.roles & SERVICE_PARTS:
        out.append(
            (int(mon["dcgm_exporter_port"]),) * 2 + (f"dcgm-exporter (monitoring.dcgm_exporter_port of {name})",)
        )
    if "monitoring" in node.roles:
        out.append((int(mon["prometheus_port"]),) * 2 + (f"Prometheus of {name} (monitoring.prometheus_port)",))
        if mon["health_probe"]:
            bb = int(BLACKBOX_LISTEN.rpartition(":")[2])
            out.append((bb, bb, "blackbox exporter (vllm-fleet's fixed port)"))
    return out


def ray_node_ports(resolved: dict[str, Any], node: Node) -> list[tuple[int, int, str]]:
    """The ray part's: the head's GCS port, the fixed ports the units pin (the dashboard and the
    client server on the head only), the worker range."""
    if not node.roles & {"ray-head", "ray-worker"}:
        return []
    name, out = resolved["name"], []
    fixed = dict(RAY_FIXED_PORTS)
    if "ray-head" in node.roles:
        gcs = int(resolved["parallel"]["ray_port"])
        out.append((gcs, gcs, f"Ray GCS of {name} (parallel.ray_port)"))
    else:
        fixed.pop("dashboard", None)
        fixed.pop("ray_client_server", None)
    out += [(p, p, f"Ray {k.replace('_', ' ')} of {name} (fixed port)") for k, p in fixed.items()]
    lo, hi = RAY_WORKER_PORTS
    out.append((lo, hi, f"Ray worker ports {lo}-{hi} of {name}"))
    return out


#: The ports each listening part declares ({part: its ports on a node}), by the part names of
#: vllm_fleet.render.files.PARTS; the registry of parts (vllm_fleet.roles.parts) names them per
#: entry. In the order the port check lists them.
PART_PORTS = {
    "service": vllm_ports,
    "nginx": nginx_ports,
    "router": router_ports,
    "monitoring": monitoring_ports,
    "ray": ray_node_ports,
}


def _listen_ports(resolved: dict[str, Any], node: Node) -> list[tuple[int, int, str]]:
    """(first port, last port, what) of every listening part of one deployment on one host
    (:data:`PART_PORTS`): vLLM replicas, nginx, the router (when the spec has one), the node
    exporter, dcgm-exporter, Prometheus, blackbox, Ray's GCS, fixed ports and worker range."""
    return [p for ports in PART_PORTS.values() for p in ports(resolved, node)]


def _role_port_problems(resolved: dict[str, Any], nodes: list[Node], source: str) -> list[str]:
    """Without an inventory, from the spec alone: on each part's target (the parts that always
    share a host: the monitoring host's Prometheus, blackbox and node exporters; a Ray node's
    ports and its exporters; a server's replicas and its exporters), a monitoring port that another
    part there (or another monitoring daemon) listens on. The spec's own rules check vLLM, nginx,
    the router and Ray against each other (vllm_fleet.specs.checks)."""
    out: list[str] = []
    for n in nodes:
        mon = monitoring_ports(resolved, n)
        seen = [p for part, ports in PART_PORTS.items() if part != "monitoring" for p in ports(resolved, n)]
        for lo, hi, what in mon:
            other = next((o for o in seen if not (lo > o[1] or o[0] > hi)), None)
            if other is not None:
                out.append(
                    f"{n.target}: port {max(lo, other[0])} is used by {other[2]} and by {what} ({source}): give one "
                    "of them another port (monitoring.*_port; the blackbox exporter keeps "
                    f"{BLACKBOX_LISTEN.rpartition(':')[2]}; Ray keeps {', '.join(map(str, _ray_fixed()))} and its "
                    "worker range)"
                )
            seen.append((lo, hi, what))
    return out


def _port_problems(
    host: str, h: "HostLayout", deployments: dict[str, dict[str, Any]], sources: dict[str, str]
) -> list[str]:
    seen: list[tuple[int, int, str, str]] = []
    out: list[str] = []
    for dep, node in h.parts.items():
        for lo, hi, what in _listen_ports(deployments[dep], node):
            for olo, ohi, other, odep in seen:
                if lo > ohi or olo > hi:
                    continue
                shared = next((k for k in _SHARED if what.startswith(k) and other.startswith(k)), None)
                if shared and (lo, hi) == (olo, ohi):
                    continue  # one daemon per host serves both
                if what.startswith("Ray") and other.startswith("Ray"):
                    continue  # one deployment's own; two Ray deployments on a host: the Ray check says so
                port = max(lo, olo)
                out.append(
                    f"{host}: port {port} is used by {other} and by {what} ({sources[dep]}): give one of them another "
                    "port (server.port: each replica takes server.port + its index; proxy.listen; monitoring.*_port; "
                    f"parallel.ray_port; Ray keeps {', '.join(map(str, _ray_fixed()))} and its worker range)"
                )
                break
            seen.append((lo, hi, what, dep))
    return out


def _ray_fixed() -> list[int]:
    return sorted(RAY_FIXED_PORTS.values())


def _same_machine(layout_hosts: dict[str, HostLayout], inventory: dict[str, dict[str, Any]]) -> list[str]:
    """The same machine listed twice (two names, one ssh_hostname)."""
    out: list[str] = []
    by_address: dict[str, list[str]] = {}
    for host, h in inventory.items():
        by_address.setdefault(str(h.get("address") or host), []).append(host)
    for address, names in by_address.items():
        if len(names) > 1:
            served = [n for n in names if n in layout_hosts and layout_hosts[n].instances]
            if served:
                out.append(
                    f"inventory: hosts {', '.join(names)} are one machine (ssh_hostname {address}): their units and "
                    "ports would collide; list it once and set replicas.per_host (or host data replicas_per_host) for "
                    "more replicas"
                )
    return out


def _gpu_shares(host: str, h: HostLayout, deployments: dict[str, dict[str, Any]], sources: dict[str, str]) -> list[str]:
    """GPUs shared on one host (replicas.per_gpu, or deployments given the same gpu_ids): each
    vLLM takes its --gpu-memory-utilization share of the whole GPU; together at most all of it."""
    out: list[str] = []
    users: dict[int, list[Instance]] = {}
    for inst in h.instances:
        for g in inst.gpu_ids or []:
            users.setdefault(g, []).append(inst)
    groups: dict[tuple[str, ...], list[int]] = {}  # GPUs with the same users: one message
    for g, insts in sorted(users.items()):
        groups.setdefault(tuple(i.unit for i in insts), []).append(g)
    for gs in groups.values():
        insts = users[gs[0]]
        shares = [(i, replica_gpu_utilization(deployments[i.deployment])) for i in insts]
        total = sum(s for _, s in shares)
        if len(shares) > 1 and not shares_fit_one_gpu([s for _, s in shares]):
            parts = " + ".join(f"{i.unit} {s:g}" for i, s in shares)
            deps = sorted({i.deployment for i in insts})
            out.append(
                f"{host}: GPU{'s' if len(gs) > 1 else ''} {', '.join(map(str, gs))} {'are' if len(gs) > 1 else 'is'} "
                f"over-subscribed: {parts} = {total:.3g} of its memory (each vLLM takes its --gpu-memory-utilization "
                "share of the whole GPU at start): lower engine.gpu_memory_utilization of "
                f"{', '.join(f'{d} ({sources[d]})' for d in deps)} so the shares sum to at most 1 (e.g. 0.9 split "
                "between them), or pin the deployments to different GPUs with hardware.gpu_ids"
            )
    return out


def _gpu_owners(host: str, h: HostLayout, deployments: dict[str, dict[str, Any]], sources: dict[str, str]) -> list[str]:
    """A multi-node deployment without hardware.gpu_ids owns every GPU of its hosts (its server,
    worker or Ray node sees them all): no other deployment may need GPUs there."""

    def _cuda(dep: str) -> bool:
        return deployments[dep]["install"]["accelerator"] == "cuda"

    out: list[str] = []
    whole = [
        dep
        for dep, n in h.parts.items()
        if n.roles & SERVICE_PARTS
        and _cuda(dep)
        and _multi(deployments[dep])
        and not deployments[dep]["hardware"].get("gpu_ids")
    ]
    gpu_deps = [dep for dep, n in h.parts.items() if n.roles & SERVICE_PARTS and _cuda(dep)]
    for w in whole[:1]:
        other = next((d for d in gpu_deps if d != w), None)
        if other:
            out.append(
                f"{host}: deployment {w} ({sources[w]}) is multi-node without hardware.gpu_ids, so it owns every GPU "
                f"of this host, and deployment {other} ({sources[other]}) needs GPUs here too: pin both with "
                "hardware.gpu_ids (e.g. [0, 1, 2, 3] and [4, 5, 6, 7]), or put them on different hosts"
            )
    return out


def _one_per_host(
    host: str, h: HostLayout, deployments: dict[str, dict[str, Any]], sources: dict[str, str]
) -> list[str]:
    """What a host has once for every deployment there: monitoring, an nginx site per port and name, a Ray cluster."""
    out: list[str] = []
    # two monitored deployments on one host: one Prometheus and one node exporter per host
    monitored = [dep for dep, n in h.parts.items() if n.roles and deployments[dep]["monitoring"]["enabled"]]
    if len(monitored) > 1:
        out.append(
            f"{host}: deployments {', '.join(monitored)} both have monitoring.enabled and this host is part of both: "
            "their monitoring files (the node exporter's and Prometheus' configuration) are one per host. "
            f"Set monitoring.enabled: true in one spec only ({sources[monitored[0]]}); its Prometheus watches its own "
            "deployment, or put the deployments on different hosts"
        )
    # ports used twice on one host (every listening part)
    out.extend(_port_problems(host, h, deployments, sources))
    seen_proxy: dict[tuple[int, str], str] = {}
    for dep, node in h.parts.items():
        resolved = deployments[dep]
        if "proxy" in node.roles:
            key = (int(resolved["proxy"]["listen"]), str(resolved["proxy"]["server_name"]))
            if key in seen_proxy:
                out.append(
                    f"{host}: deployments {seen_proxy[key]} and {dep} ({sources[dep]}) both serve nginx port {key[0]} "
                    f"with server_name {key[1]}: give each its own proxy.listen or proxy.server_name"
                )
            seen_proxy.setdefault(key, dep)
    ray = [dep for dep, n in h.parts.items() if n.roles & {"ray-head", "ray-worker"}]
    if len(ray) > 1:
        out.append(
            f"{host}: is a Ray node of {', '.join(ray)}: one Ray cluster per host; put the deployments on different "
            "hosts"
        )
    return out


def _cross_checks(
    layout_hosts: dict[str, HostLayout],
    deployments: dict[str, dict[str, Any]],
    sources: dict[str, str],
    inventory: dict[str, dict[str, Any]],
    problems: list[str],
) -> None:
    """Checks across deployments and hosts: the machine listed twice, then per host its GPUs and what it has once."""
    problems.extend(_same_machine(layout_hosts, inventory))
    for host, h in layout_hosts.items():
        problems.extend(_gpu_shares(host, h, deployments, sources))
        problems.extend(_gpu_owners(host, h, deployments, sources))
        problems.extend(_one_per_host(host, h, deployments, sources))


# ---------------------------------------------------------------------------------------------


def _inventory_hosts(
    hosts: dict[str, HostLayout],
    deployments: dict[str, dict[str, Any]],
    inventory: dict[str, dict[str, Any]],
    down: set[str],
    sources: dict[str, str],
    problems: list[str],
    warnings: list[str] | None = None,
) -> None:
    """Fill ``hosts`` with every inventory host and each deployment's parts there, then check them
    across deployments. Bad host data raises :class:`LayoutError` at once (nothing reads a value it did not check)."""
    # host data first, every host's at once: nothing below reads a value it did not check
    bad = inventory_problems(inventory)
    if bad:
        raise LayoutError([*problems, *bad])
    if "client" in inventory:
        problems.append("inventory: `client` is reserved for the control machine's files; rename that host")
    for n, (host, h) in enumerate(inventory.items()):
        data = dict(h.get("data") or {})
        address = str(h.get("address") or host)
        order = (h.get("order") or {}).get("servers")
        hosts[host] = HostLayout(
            host,
            address,
            str(data.get("private_address") or address),
            data,
            order=order if order is not None else 10000 + n,
        )
    for name, r in deployments.items():
        for node in _host_parts(r, inventory, down, problems, sources[name], warnings):
            hosts[node.target].parts[name] = node
    for host, hl in hosts.items():
        if hl.parts and not is_address_or_hostname(hl.address):
            problems.append(
                f"host {host}: its address {hl.address!r} (the host name: no ssh_hostname) is not an IPv4 address or a "
                "host name, and it would go into nginx, Prometheus and the client's URL: set ssh_hostname "
                "(e.g. ssh_hostname: 192.0.2.10) for this host"
            )
    _cross_checks(hosts, deployments, sources, inventory, problems)


def build_parts(
    specs: Sequence[dict[str, Any]] | dict[str, Any],
    inventory: dict[str, dict[str, Any]] | None = None,
    *,
    down: Iterable[str] = (),
    sources: dict[str, str] | None = None,
) -> Layout:
    """The parts of the layout of ``specs`` (resolved) on ``inventory`` ({host: {address, groups, data}}, as
    :func:`vllm_fleet.specs.inventory.load_inventory` returns; None: per part, e.g. ``server``).

    ``down``: instance ids (``HOST:N``) or host names out of the nginx upstream (a rollout).
    ``sources``: {deployment: spec file} for the messages. Raises :class:`LayoutError` with
    every problem found.
    """
    if isinstance(specs, dict):
        specs = [specs]
    deployments: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    src = dict(sources or {})
    for r in specs:
        if r["name"] in deployments:
            problems.append(
                f"{src.get(r['name'], r['name'])}: two specs are named {r['name']}: each deployment needs its own "
                "`name` (units, paths and the nginx site are named after it)"
            )
            continue
        deployments[r["name"]] = r
        src.setdefault(r["name"], f"spec {r['name']}")
    down_set = {d.strip() for d in down if d and d.strip()}
    hosts: dict[str, HostLayout] = {}
    if inventory is None:
        for name, r in deployments.items():
            nodes = _role_parts(r, problems, src[name])
            problems.extend(_role_port_problems(r, nodes, src[name]))
            for node in nodes:
                h = hosts.setdefault(node.target, HostLayout(node.target, node.address, node.private, {}))
                h.parts[name] = node
    warnings: list[str] = []
    if inventory is not None:
        _inventory_hosts(hosts, deployments, inventory, down_set, src, problems, warnings)
    if problems:
        raise LayoutError(problems)
    return Layout(deployments, hosts, with_inventory=inventory is not None, warnings=warnings)


def render_entry(name: str, groups: list[str], data: dict[str, Any], down: bool = False) -> dict[str, Any]:
    """One host as the layout reads it: {"address", "groups", "data"} (only the host data the
    layout and renderers use: :data:`HOST_DATA_KEYS` and
    :data:`HOST_DATA_DEFAULTS`). The deploy's roles (pyinfra's host objects) and the commands
    (:func:`vllm_fleet.specs.inventory.load_inventory`) both come through here.

    ``down``: the rollout marks this replica down in the nginx upstream (also host data ``upstream_down``).
    """

    out = {k: data.get(k) for k in (*HOST_DATA_KEYS, *HOST_DATA_DEFAULTS, "ssh_hostname") if data.get(k) is not None}
    out.pop("upstream_down", None)
    if down or data.get("upstream_down"):
        out["upstream_down"] = True
    # from ``out`` (a dict): pyinfra's HostData is no Mapping, and host_address read it as "no
    # ssh_hostname", so the deploy's layout gave clients the inventory name instead of the address
    return {"address": host_address(name, out), "groups": inline_groups(groups), "data": out}


def firewall_addresses(addresses: Iterable[str], what: str) -> list[str]:
    """IPv4 addresses/networks for an nftables set, deduplicated and merged, as nft writes them."""
    nets: list[ipaddress.IPv4Network] = []
    for a in addresses:
        try:
            net = ipaddress.ip_network(str(a), strict=False)
        except ValueError:
            raise LayoutError(
                [
                    f"{what}: {a!r} is not an IPv4 address or network (give the host's private_address, "
                    "or fix the host data allow list)"
                ]
            ) from None
        if net.version != 4:
            raise LayoutError([f"{what}: {a}: only IPv4 addresses/networks are supported"])
        nets.append(net)
    # nft refuses overlapping elements of an interval set ("conflicting intervals"): an allowed
    # network that holds a listed address (or 0.0.0.0/0) becomes the one network
    merged = list(ipaddress.collapse_addresses(nets))
    if len(merged) == len(set(nets)):  # nothing overlapped: keep the order given
        merged = list(dict.fromkeys(nets))
    return [str(n.network_address) if n.prefixlen == 32 else str(n) for n in merged]
