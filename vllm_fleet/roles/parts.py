"""The parts a host runs, in order: the one list serve walks forward, `down` in reverse, whose
queries are the deploy's one state read, and whose entries the rollout's update step takes.

Each :class:`Part` names

- ``name``: the part (the files it places are ``HostLayout.files_of(deployment, name)``:
  vllm_fleet.render.files.PARTS);
- ``applies``: whether it runs for a deployment on a host, from the layout alone;
- ``query``: what its role compares against (vllm_fleet.roles.common.state): the union of the
  entries that apply is the host's one state read;
- ``install``: its role, converging the host;
- ``remove``: its role with ``present=False`` over paths (its files: `down`, and serve's pruning of
  what the layout no longer renders), or None when it places no file of its own;
- ``uninstall``: what only `down` removes (the install stack's directories; purge);

Every role is given where the deployment's files live (``where``: the layout's
vllm_fleet.render.parts.Paths, :attr:`Step.paths`); none works a path out again.
- ``ports``: the ports it listens on (vllm_fleet.render.parts.PART_PORTS: the layout's port
  checks read them there, from the spec alone where parts always share a host);
- ``stages``: whether `vllm-fleet stage` runs it (vllm_fleet.deploys.stage): a part that puts
  what a later deploy would otherwise transfer (env, wheels, weights) and writes no unit, no
  service config and restarts nothing. serve and the rollout run it as usual and then find it
  in place.

Adding a part: its role (vllm_fleet/roles/NAME), its files rendered with ``part=NAME`` and its
fixed paths in vllm_fleet.render.files.part_paths (the layout's Paths.parts), its ports in
PART_PORTS, and one entry here.

The entries take a :class:`Step`: the deploy's context, the host's layout, the deployment and
what earlier parts of that deployment returned on this host (the install stack's and the Ray
node's changes, which restart vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from vllm_fleet.host.state import Query
from vllm_fleet.render.layout import SERVICE_PARTS, HostLayout, Node, Paths
from vllm_fleet.render.parts import PART_PORTS
from vllm_fleet.roles import liveness, monitoring, nginx, ray, router, service
from vllm_fleet.roles.common import DeployContext
from vllm_fleet.roles.smoke import run_smoke


@dataclass
class Step:
    """One part's turn for one deployment on one host."""

    ctx: DeployContext
    h: HostLayout
    name: str  # the deployment
    results: dict[str, Any] = field(default_factory=dict)  # what earlier parts of it returned here

    @property
    def spec(self) -> dict[str, Any]:
        return self.ctx.specs[self.name]

    @property
    def node(self) -> Node:
        return self.h.parts[self.name]

    @property
    def paths(self) -> Paths:
        """Where the deployment's files live (the layout's, decided once: Layout.paths)."""
        return self.ctx.layout.paths[self.name]

    @property
    def secrets(self) -> dict[str, Any]:
        return self.ctx.all_secrets[self.name]

    @property
    def rendered(self) -> dict[str, Any]:
        return self.h.files


@dataclass(frozen=True)
class Part:
    name: str
    applies: Callable[[Step], bool]
    query: Callable[[Step], Query]
    install: Callable[[Step], Any]
    remove: Callable[..., dict[str, Any]] | None = None  # (spec=, where=, rendered=, present=False, paths=)
    uninstall: Callable[[dict[str, Any], Paths, bool], Any] | None = None  # (spec, where, purge): `down` only
    ports: Callable[..., list] | None = None  # (resolved, node) -> [(first, last, what)]
    stages: bool = False  # `vllm-fleet stage` runs it (no unit, no service config, no restart)


def monitors(spec: dict[str, Any], where: Paths, rendered: dict[str, Any]) -> bool:
    """Whether the monitoring part runs for this deployment here (monitoring.enabled, and the layout
    gives the host monitoring files)."""
    return bool(spec["monitoring"]["enabled"] and set(rendered) & set(where.monitoring.values()))


def _stack(s: Step) -> None:
    vllm_changed, model_changed = service.install_server_stack(
        spec=s.spec, where=s.paths, hub_token=s.secrets["hub_token"]
    )
    s.results["vllm_changed"] = vllm_changed
    s.results["restart_on"] = [*vllm_changed, *model_changed]


def _ray(s: Step) -> None:
    node = ray.install_ray(
        spec=s.spec,
        where=s.paths,
        node=s.node,
        layout=s.ctx.layout,
        rendered=s.rendered,
        restart_on=s.results.get("vllm_changed", []),
    )
    s.results["restart_on"] = [*s.results.get("restart_on", []), *node.env_ops, node.cluster_restarted]


def _service(s: Step) -> None:
    service.install_service(
        spec=s.spec,
        where=s.paths,
        node=s.node,
        rendered=s.rendered,
        api_key=s.secrets["api_key"],
        restart_on=s.results.get("restart_on", []),
    )


def _nginx(s: Step) -> None:
    sec = s.secrets
    nginx.install_nginx(
        spec=s.spec,
        where=s.paths,
        rendered=s.rendered,
        api_key=sec["api_key"],
        tls_key=sec["tls_key"],
        tls_certificate=sec["tls_certificate"],
    )


def _smoke(s: Step) -> None:
    local = [i.port for i in s.node.instances if i.role == "server"]
    run_smoke(spec=s.spec, where=s.paths, api_key=s.secrets["api_key"], local_port=local[0] if local else None)


def _uninstall_stack(spec: dict[str, Any], where: Paths, purge: bool) -> None:
    service.install_server_stack(spec=spec, present=False, purge=purge, where=where)


#: Every part, in the order serve installs them on a host (for each part, every deployment of the
#: host in spec order); `down` removes them in the reverse order, so nginx stops pointing at vLLM
#: before vLLM stops. The router serves before nginx points at it (cache_aware); the smoke tests
#: run once every site is in; monitoring last.
PARTS: tuple[Part, ...] = (
    # everything vLLM stands on: driver, service user and dirs, env, vLLM, model
    Part(
        "stack",
        applies=lambda s: bool(s.node.roles & SERVICE_PARTS),
        query=lambda s: service.server_stack_query(s.spec, s.paths),
        install=_stack,
        uninstall=_uninstall_stack,
        stages=True,
    ),
    Part(
        "ray",
        applies=lambda s: bool(s.node.roles & {"ray-head", "ray-worker"}),
        query=lambda s: ray.state_query(s.spec, s.paths, s.node, s.rendered),
        install=_ray,
        remove=ray.install_ray,
        ports=PART_PORTS["ray"],
    ),
    Part(
        "service",
        applies=lambda s: bool(s.node.instances),
        query=lambda s: service.state_query(s.spec, s.paths, s.node, s.rendered),
        install=_service,
        remove=service.install_service,
        ports=PART_PORTS["service"],
    ),
    # after the replicas it probes; `down` stops it before them
    Part(
        "liveness",
        applies=lambda s: bool(s.h.files_of(s.name, "liveness")),
        query=lambda s: liveness.state_query(s.spec, s.paths, s.rendered),
        install=lambda s: liveness.install_liveness(spec=s.spec, where=s.paths, rendered=s.rendered),
        remove=liveness.install_liveness,
    ),
    Part(
        "router",
        applies=lambda s: "router" in s.node.roles,
        query=lambda s: router.state_query(s.spec, s.paths, s.rendered),
        install=lambda s: router.install_router(spec=s.spec, where=s.paths, rendered=s.rendered),
        remove=router.install_router,
        ports=PART_PORTS["router"],
    ),
    Part(
        "nginx",
        applies=lambda s: "proxy" in s.node.roles,
        query=lambda s: nginx.state_query(s.spec, s.paths, s.rendered),
        install=_nginx,
        remove=nginx.install_nginx,
        ports=PART_PORTS["nginx"],
    ),
    Part("smoke", applies=lambda s: "proxy" in s.node.roles, query=lambda s: Query(), install=_smoke),
    Part(
        "monitoring",
        applies=lambda s: monitors(s.spec, s.paths, s.rendered),
        query=lambda s: monitoring.state_query(s.spec, s.paths, s.rendered),
        install=lambda s: monitoring.install_monitoring(spec=s.spec, where=s.paths, rendered=s.rendered),
        remove=monitoring.install_monitoring,
        ports=PART_PORTS["monitoring"],
    ),
)


def part(name: str) -> Part:
    """The entry of part ``name``."""
    return next(p for p in PARTS if p.name == name)


def host_steps(ctx: DeployContext, h: HostLayout, names: tuple[str, ...] | None = None) -> list[tuple[Part, Step]]:
    """The parts (of ``names``; all: None) that apply on this host, in :data:`PARTS` order, each
    with its deployment's step (one per deployment, shared by its parts: their results)."""
    steps = {name: Step(ctx, h, name) for name in h.parts}
    return [(p, s) for p in PARTS if names is None or p.name in names for s in steps.values() if p.applies(s)]


def host_query(ctx: DeployContext, h: HostLayout, names: tuple[str, ...] | None = None) -> Query:
    """The union of the queries of the parts that apply on this host: its one state read (with
    the API firewall's, host-wide, when it runs vLLM instances)."""
    q = service.api_firewall_query(h.files) if any(n.instances for n in h.parts.values()) else Query()
    for p, s in host_steps(ctx, h, names):
        q = q | p.query(s)
    return q


def staged() -> tuple[str, ...]:
    """The parts `vllm-fleet stage` runs (``stages=True``), in :data:`PARTS` order."""
    return tuple(p.name for p in PARTS if p.stages)


def removals() -> list[tuple[str, Callable[..., dict[str, Any]]]]:
    """``(part, its role with present=False)`` of every part that places files, in the reverse
    of :data:`PARTS`: `down`'s order."""
    return [(p.name, p.remove) for p in reversed(PARTS) if p.remove is not None]
