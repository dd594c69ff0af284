"""Which vLLM instances of a deployment are replicas, which hosts are its proxies, the instances'
units, ports and files: read from the per-host layout
(:func:`vllm_fleet.render.layout.build`), never from group names or fixed names.

    view = fleet_view(resolved, inventory)      # inventory: vllm_fleet.specs.inventory.load_inventory()
    rep = view.replicas[0]; rep.id ("lab1:0"), rep.unit, rep.port, rep.env_file, rep.host
    view.replica("lab1") (its first instance) / view.replica("lab1:1"); view.proxies

A replica is one vLLM instance (one ``vllm-NAME-N.service``, port ``server.port + N``); a host may
run several. A proxy is a host where the layout places this deployment's nginx site. A tune takes
one instance out of the upstream by its id (``VLLM_FLEET_UPSTREAM_DOWN=HOST:N``, the rollout's
own step) and restarts that instance's unit only.

Core module: no pyinfra.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_fleet.render import files as render
from vllm_fleet.render import layout


@dataclass(frozen=True)
class Replica:
    host: str
    index: int
    address: str
    unit: str  # the systemd unit name, e.g. vllm-lab-tiny-0.service
    unit_path: str
    port: int  # where this instance listens on the host
    env_file: str  # its replica-N.env
    files: tuple[str, ...]  # rendered paths a restart with other engine settings may change
    #: of ``files``, those other instances of the deployment on this host read too (vllm.env,
    #: node.env): a point may not change them (the siblings would start with it)
    shared: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        """``HOST:N``, as the rollout and ``VLLM_FLEET_UPSTREAM_DOWN`` name an instance."""
        return f"{self.host}:{self.index}"


@dataclass
class FleetView:
    replicas: list[Replica]
    proxies: list[str]
    proxy_listen: int | None
    hosts: dict[str, dict[str, Any]] = field(default_factory=dict)
    policy: str | None = None  # the routing policy in effect, as the layout decided it

    def replica(self, name: str) -> Replica | None:
        """The instance ``HOST:N``, or a host's first instance for a plain host name."""
        if ":" in name:
            return next((r for r in self.replicas if r.id == name), None)
        return next((r for r in self.replicas if r.host == name), None)


def instance_files(resolved: dict[str, Any], inventory: dict[str, dict[str, Any]], replica: Replica) -> dict[str, Any]:
    """{path: RenderedFile} of ``replica``'s ``files`` as the layout renders ``resolved`` (e.g. a
    tune point's settings) on ``inventory``. Raises :class:`vllm_fleet.render.layout.LayoutError`."""
    files = layout.build(resolved, inventory).hosts[replica.host].files
    return {p: files[p] for p in replica.files if p in files}


def fleet_view(resolved: dict[str, Any], inventory: dict[str, dict[str, Any]]) -> FleetView:
    """Raises :class:`vllm_fleet.render.layout.LayoutError` when the spec and inventory do not lay out."""
    lay = layout.build(resolved, inventory)
    name = resolved["name"]
    p = render.paths(resolved)
    replicas = []
    for inst in lay.instances(name):
        if inst.role != "server":
            continue  # a headless worker node of a multi-node server is not a replica
        h = lay.hosts[inst.host]
        unit_path = f"{layout.SYSTEMD_DIR}/{inst.unit}"
        siblings = [i for i in h.instances if i.deployment == name and i.unit != inst.unit]
        shared = tuple(sorted(path for path in (p["vllm_env"], p["node_env"]) if path in h.files))
        changeable = tuple(sorted(path for path in (unit_path, inst.env_file, *shared) if path in h.files))
        replicas.append(
            Replica(
                inst.host,
                inst.index,
                str(h.address or inst.host),
                inst.unit,
                unit_path,
                inst.port,
                inst.env_file,
                changeable,
                shared if siblings else (),
            )
        )
    proxies = [host for host, h in lay.hosts.items() if "proxy" in h.roles(name)]
    listen = int(resolved["proxy"]["listen"]) if resolved["proxy"]["enabled"] else None
    return FleetView(replicas, proxies, listen, inventory, lay.policy(name))
