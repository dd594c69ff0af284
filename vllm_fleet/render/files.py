"""Render every file a deploy places on the hosts, from the resolved spec (and an inventory).

    render(resolved, inventory=None) -> {target: {absolute path: RenderedFile}}
    render_many([resolved, ...], inventory) -> the same for several deployments on one fleet

The files view of the per-host layout (:mod:`vllm_fleet.render.layout`, which says which host plays
which part): without an inventory a target is a part (``server``, ``worker``, ``ray-head``,
``ray-worker``, ``proxy``, ``monitoring``, ``client``); with one (``{host: {"address": ...,
"groups": [...], "data": {...}}}``, as :func:`vllm_fleet.specs.inventory.load_inventory` returns) a
target is a host name and gets every file the deploy places there (units, env files, nginx
sites, firewall rules). The roles put these files as they are (content, mode, owner, group);
no role builds a unit, an env file, an nginx config or a firewall rule itself.

Secrets are never rendered: ``secrets.env`` and the nginx auth include come out as placeholders
naming the secret reference; the deploy writes the real ones with :func:`secrets_env_content`
and :func:`nginx_auth_content` (same format, one place).

Pure functions: no host is touched, no secret read, pyinfra not imported.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shlex
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

import jinja2

from vllm_fleet.render import monitoring
from vllm_fleet.render.command import (
    RAY_TMPDIR,
    env_bin,
    env_paths,
    env_python,
    state_env,
    vllm_argv,
    vllm_env,
    world_size_per_node,
)
from vllm_fleet.render.parts import (
    HOST_DATA_DEFAULTS,
    SERVICE_PARTS,
    HostLayout,
    Instance,
    Layout,
    LayoutError,  # noqa: F401
    Node,
    Paths,
    Secret,
    build_parts,
    _cpu_sets,
    _multi,
    firewall_addresses,
    kv_offload_on,
    SYSTEMD_DIR,
    UNIT_SUFFIXES,
)
from vllm_fleet.render.text import (
    HEADER,
    EnvRef,
    RenderedFile,
    RenderError,
    comment_text,
    describe_secret,
    env_file,
    nginx_quote,
    systemd_command,
    systemd_quote,
    systemd_text,
)
from vllm_fleet.specs.document import ROUTER_POLICY
from vllm_fleet.specs.hostdata import is_local
from vllm_fleet.specs.ports import RAY_FIXED_PORTS, RAY_WORKER_PORTS  # noqa: F401  (the renderer's names too)

TEMPLATES = Path(__file__).resolve().parent / "templates"

# ---------------------------------------------------------------------------------------------
# Defaults of the rendered files (documented in docs/rendered-files.md)

NGINX_SITE = "/etc/nginx/conf.d/vllm-fleet-{name}.conf"
ROUTER_UNIT = "vllm-router-{name}.service"
LIVENESS_UNIT = "vllm-fleet-liveness-{name}"  # .service and .timer (server.liveness)
#: The router waits this long at start for every replica to answer /health, then serves with
#: those that do (its own default, 600 s, would keep the API down behind one dead replica).
ROUTER_STARTUP_TIMEOUT = 30
NGINX_SECRET_DIR = "/etc/nginx/vllm-fleet"  # auth include, TLS certificate and key (0700 root)
CLIENT_DIR = "~/.config/vllm-fleet/{name}"  # on the control machine

RESTART_SEC = 10
START_LIMIT_INTERVAL = 900  # s: window for START_LIMIT_BURST failed starts
START_LIMIT_BURST = 5
TIMEOUT_START = 900  # big models take 5-10 minutes; also bounds the Ray cluster wait
STOP_MARGIN = 90  # s: TimeoutStopSec= above server.shutdown_timeout (vLLM's engine exit, GPU memory freed)
RAY_TIMEOUT_START = 120
RAY_TIMEOUT_STOP = 60
LIMIT_NOFILE = 1048576
RAY_WAIT_TIMEOUT = 600  # s wait-ray-cluster waits for all nodes (< TIMEOUT_START)
NGINX_KEEPALIVE = 32
#: Idle upstream connections are closed after this many seconds: below uvicorn's (vLLM's) 5 s
#: keep-alive, so nginx never sends a request on a connection vLLM is closing (a POST that hits
#: that race gets a 502 nginx may not retry).
NGINX_UPSTREAM_KEEPALIVE_TIMEOUT = 4
#: Ray's logical memory and object store per node (bytes). Containers see the host's memory, so
#: both are explicit; host data `ray_memory_bytes` / `ray_object_store_bytes` override them.
RAY_MEMORY_BYTES = {"cuda": 16 * 2**30, "cpu": 2 * 2**30}
RAY_OBJECT_STORE_BYTES = {"cuda": 4 * 2**30, "cpu": 512 * 2**20}

#: nftables tables (one per host, over every deployment there), their rules files and the units
#: that load them at boot, before vLLM / Ray.
API_FIREWALL_TABLE = "vllm_fleet_api"
API_FIREWALL_FILE = "/etc/vllm-fleet/api-firewall.nft"
API_FIREWALL_UNIT = "vllm-fleet-api-firewall.service"
RAY_FIREWALL_TABLE = "vllm_fleet_ray"
RAY_FIREWALL_FILE = "/etc/vllm-fleet/ray-firewall.nft"
RAY_FIREWALL_UNIT = "vllm-fleet-ray-firewall.service"


# ---------------------------------------------------------------------------------------------
# Templates


@lru_cache(maxsize=1)
def _jinja() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters.update(comment=comment_text, systemd_text=systemd_text, nginx=nginx_quote)
    return env


def _template(template: str, **ctx: Any) -> str:
    return _jinja().get_template(template).render(**ctx)


def _safe_ident(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


# ---------------------------------------------------------------------------------------------
# Paths (shared with the roles)


def paths(resolved: dict[str, Any]) -> dict[str, str]:
    """Every path the rendered files live at (or refer to), by a short name."""
    name = resolved["name"]
    ins = resolved["install"]
    cfg = ins["config_dir"]
    return {
        **env_paths(resolved),  # env, python, uv
        "legacy_unit": f"{SYSTEMD_DIR}/vllm.service",  # an older release's one unit per host
        "ray_head_unit": f"{SYSTEMD_DIR}/ray-head.service",
        "ray_worker_unit": f"{SYSTEMD_DIR}/ray-worker.service",
        "vllm_env": f"{cfg}/vllm.env",
        "secrets_env": f"{cfg}/secrets.env",
        "node_env": f"{cfg}/node.env",
        "wait_ray": f"{ins['prefix']}/bin/wait-ray-cluster",
        "wait_health": f"{ins['prefix']}/bin/wait-replica-health",
        "liveness_probe": f"{ins['prefix']}/bin/vllm-liveness",
        "liveness_unit": f"{SYSTEMD_DIR}/{LIVENESS_UNIT.format(name=name)}.service",
        "liveness_timer": f"{SYSTEMD_DIR}/{LIVENESS_UNIT.format(name=name)}.timer",
        "nginx_site": NGINX_SITE.format(name=name),
        "router_unit": f"{SYSTEMD_DIR}/{ROUTER_UNIT.format(name=name)}",
        "router_env": f"{ins['prefix']}/router",
        "nginx_auth": f"{NGINX_SECRET_DIR}/{name}-auth.conf",
        "tls_certificate": f"{NGINX_SECRET_DIR}/{name}.crt",
        "tls_certificate_key": f"{NGINX_SECRET_DIR}/{name}.key",
        "client_json": f"{CLIENT_DIR.format(name=name)}/openai.json",
        "client_env": f"{CLIENT_DIR.format(name=name)}/openai.env",
        "ray_tmpdir": RAY_TMPDIR,
        "api_firewall_rules": API_FIREWALL_FILE,
        "api_firewall_unit": f"{SYSTEMD_DIR}/{API_FIREWALL_UNIT}",
        "ray_firewall_rules": RAY_FIREWALL_FILE,
        "ray_firewall_unit": f"{SYSTEMD_DIR}/{RAY_FIREWALL_UNIT}",
    }


#: The parts whose roles place a deployment's files on a host, in the order serve installs them
#: (every rendered file names one: RenderedFile.part), and ``client``, the control machine's files.
PARTS = ("service", "liveness", "ray", "router", "nginx", "monitoring")


def part_paths(resolved: dict[str, Any]) -> dict[str, list[str]]:
    """Every fixed path each part may place on a host for this deployment ({part: [path]}): its
    rendered files of fixed name, and what its role puts beside them (the TLS certificate and key
    of the nginx site). A file the layout renders names its own part (RenderedFile.part); this is
    where a path the layout no longer renders is looked up: which part's ``present=False`` removes
    it (serve's pruning; `down`). vllm.env and node.env are the Ray node's (Ray starts with them)
    or the service's: both parts name them; the service's comes first. The replicas' units and
    env files (``vllm-NAME-N.service``, ``replica-N.env``) are the service's, found by their globs
    (vllm_fleet.roles.common.remove)."""
    p = paths(resolved)
    return {
        "service": [
            p["vllm_env"],
            p["node_env"],
            p["secrets_env"],
            p["wait_health"],
            p["api_firewall_rules"],
            p["api_firewall_unit"],
        ],
        "ray": [
            p["vllm_env"],
            p["node_env"],
            p["ray_head_unit"],
            p["ray_worker_unit"],
            p["wait_ray"],
            p["ray_firewall_rules"],
            p["ray_firewall_unit"],
        ],
        "liveness": [p["liveness_timer"], p["liveness_unit"], p["liveness_probe"]],
        "router": [p["router_unit"]],
        "nginx": [p["nginx_site"], p["nginx_auth"], p["tls_certificate"], p["tls_certificate_key"]],
        "monitoring": list(monitoring.paths(resolved).values()),
    }


def deployment_paths(resolved: dict[str, Any]) -> Paths:
    """Where the deployment's files live (:class:`vllm_fleet.render.parts.Paths`): what the layout
    holds for it (Layout.paths), worked out once per deployment when the layout is built."""
    return Paths(paths(resolved), part_paths(resolved), monitoring.paths(resolved))


def _owned(files: dict[str, RenderedFile], deployment: str, part: str) -> dict[str, RenderedFile]:
    """``files`` as ``deployment``'s ``part``'s (RenderedFile.deployment, .part)."""
    return {path: dataclasses.replace(f, deployment=deployment, part=part) for path, f in files.items()}


#: The longest nginx name (variable, upstream, shared zone) this module derives from a user's
#: value. nginx's stock variables_hash_bucket_size (64) holds a variable name of at most 46
#: characters; a longer one fails ``nginx -t`` ("could not build variables_hash"), and raising
#: the bucket size is an http-wide directive two sites cannot both set.
NGINX_NAME_MAX = 46


def nginx_name(prefix: str, value: str, suffix: str = "") -> str:
    """``PREFIX + VALUE + SUFFIX`` as an nginx identifier (``[A-Za-z0-9_]``), at most
    :data:`NGINX_NAME_MAX` characters by construction: up to 45 as is, else cut and ended by 8 hex
    characters of the value's sha256 (exactly 46, so a cut name never equals an uncut one)."""
    ident = _safe_ident(value)
    whole = f"{prefix}{ident}{suffix}"
    if len(whole) < NGINX_NAME_MAX:
        return whole
    digest = hashlib.sha256(value.encode()).hexdigest()[:8]
    keep = NGINX_NAME_MAX - len(prefix) - len(suffix) - len(digest) - 1
    if keep < 1:
        raise ValueError(f"nginx_name: prefix {prefix!r} and suffix {suffix!r} leave no room")
    return f"{prefix}{ident[:keep]}_{digest}{suffix}"


def _auth_var(resolved: dict[str, Any]) -> str:
    """``vfa_NAME`` (1 when the request's key is right): see :func:`nginx_name`."""
    return nginx_name("vfa_", resolved["name"])


def _upstream_name(resolved: dict[str, Any], suffix: str = "") -> str:
    """The deployment's nginx upstream (``_session``: the hashed one) and zone names."""
    return nginx_name("vllm_fleet_", resolved["name"], suffix)


# ---------------------------------------------------------------------------------------------
# Secret files: placeholders here, real content only through these two functions (the deploy)

_TOKEN68 = re.compile(r"[A-Za-z0-9._~+/-]+=*")


def _check_key(api_key: str) -> str:
    key = api_key.strip()
    if not _TOKEN68.fullmatch(key):
        raise RenderError(
            "server.api_key: the key must be a bearer token (letters, digits and -._~+/, optional trailing =); "
            "regenerate it"
        )
    return key


def secrets_env_content(resolved: dict[str, Any], api_key: str | None) -> str:
    """``secrets.env`` (0600 root:root). ``api_key=None`` gives the placeholder :func:`render` emits."""
    ref = describe_secret(resolved["server"].get("api_key"))
    header = [
        HEADER.format(name=resolved["name"]),
        "Secret environment of the vLLM units of this deployment (mode 0600 root:root). vLLM reads VLLM_API_KEY.",
    ]
    if api_key is None:
        return env_file(
            {},
            header
            + [
                f"VLLM_API_KEY=<secret: {ref}>",
                "PLACEHOLDER: the deploy writes the value here; it is never rendered.",
            ],
        )
    return env_file(
        {"VLLM_API_KEY": _check_key(api_key)}, header + [f"Written by the deploy from server.api_key ({ref})."]
    )


def nginx_auth_content(resolved: dict[str, Any], api_key: str | None) -> str:
    """The nginx auth include (0600 root:root). ``api_key=None`` gives the refuse-all placeholder."""
    return _template(
        "nginx-auth.conf.j2",
        header=HEADER.format(name=resolved["name"]),
        name=resolved["name"],
        auth_var=_auth_var(resolved),
        key=None if api_key is None else _check_key(api_key),
        key_regex=None if api_key is None else re.escape(_check_key(api_key)),
        secret_ref=_secret_kind(resolved["server"].get("api_key")),
    )


def _secret_kind(ref: dict[str, Any] | None) -> str:
    """What kind of reference a secret is, for the nginx auth include's comment: never the path or
    the variable's name (a user's value of any length; nginx's parser refuses a line over 4 KiB)."""
    if not ref:
        return "none configured"
    return "a file on the control machine" if "file" in ref else "an environment variable on the control machine"


def _backend(resolved: dict[str, Any]) -> str:
    return resolved["parallel"]["backend"]


# ---------------------------------------------------------------------------------------------
# File builders


def _common(resolved: dict[str, Any]) -> dict[str, Any]:
    """Template values every unit of the deployment shares."""
    ins, srv = resolved["install"], resolved["server"]
    return {
        "header": HEADER.format(name=resolved["name"]),
        "name": resolved["name"],
        "user": srv["user"],
        "group": srv["user"],
        "state_dir": ins["state_dir"],
        "gpu": ins["accelerator"] == "cuda",
        "restart_sec": RESTART_SEC,
        "start_limit_interval": START_LIMIT_INTERVAL,
        "start_limit_burst": START_LIMIT_BURST,
        "limit_nofile": LIMIT_NOFILE,
    }


def _liveness_files(resolved: dict[str, Any], p: Paths, node: Node) -> dict[str, RenderedFile]:
    """server.liveness: the probe (vllm-liveness.py), its oneshot unit over this host's API
    replicas of the deployment and the timer that starts it every ``period`` seconds; none when
    it is off or the host serves no API of it (a headless node, a proxy alone)."""
    live = resolved["server"]["liveness"]
    replicas = [i for i in node.instances if i.role == "server"]
    if not live["enabled"] or not replicas:
        return {}
    name = resolved["name"]
    unit = p["liveness_unit"].rsplit("/", 1)[1]
    values = dict(
        header=HEADER.format(name=name),
        name=name,
        unit=unit,
        period=live["period"],
        timeout=live["timeout"],
        failures=live["failures"],
    )
    argv = [env_python(resolved), p["liveness_probe"], EnvRef("RUNTIME_DIRECTORY")]  # its RuntimeDirectory=
    argv += [str(live["timeout"]), str(live["failures"]), *(f"{i.unit}={i.port}" for i in replicas)]
    service = _template(
        "vllm-liveness.service.j2",
        **values,
        replicas=[i.unit for i in replicas],
        probe=p["liveness_probe"],
        # each replica's probe is bounded by its timeout (and systemctl): the run by their sum
        exec_start=systemd_command(argv),
        timeout_start=len(replicas) * (live["timeout"] + 10),
        syslog_identifier=unit.removesuffix(".service"),
        runtime_directory=f"vllm-fleet-liveness/{name}",
    )
    return {
        p["liveness_probe"]: RenderedFile((TEMPLATES / "vllm-liveness.py").read_text(), 0o755),
        p["liveness_unit"]: RenderedFile(service, 0o644),
        p["liveness_timer"]: RenderedFile(_template("vllm-liveness.timer.j2", **values), 0o644),
    }


def _read_write_paths(resolved: dict[str, Any]) -> list[str]:
    rw = [resolved["install"]["state_dir"]]
    if _backend(resolved) == "ray":
        rw.append(RAY_TMPDIR)
    return rw


def _vllm_env_file(resolved: dict[str, Any]) -> RenderedFile:
    content = env_file(
        vllm_env(resolved),
        [
            HEADER.format(name=resolved["name"]),
            "Non-secret environment of the vLLM (and Ray) services. The API key is in secrets.env.",
        ],
    )
    return RenderedFile(content, 0o640, "root", resolved["server"]["user"])


def _node_env_file(resolved: dict[str, Any], node: Node) -> RenderedFile:
    par, data = resolved["parallel"], node.data or {}
    # No host name here: the same machine read through another inventory (`@local` on the host
    # itself, `lab1` from the control machine) must render the same file (issue 38: diff exit 0).
    comments = [HEADER.format(name=resolved["name"]), "Per-host environment."]
    values: dict[str, str] = {}
    if _multi(resolved):
        if node.private:
            values["NODE_IP"] = node.private
            values["VLLM_HOST_IP"] = node.private
        else:
            comments += [
                "NODE_IP=<this node's private address: written by the deploy from inventory host data "
                "`private_address`>",
                "VLLM_HOST_IP=<the same address: unique per node, equal to what Ray registers>",
            ]
        ifname = data.get("socket_ifname") or par.get("socket_ifname")
        if ifname:
            values["GLOO_SOCKET_IFNAME"] = str(ifname)
            values["NCCL_SOCKET_IFNAME"] = str(ifname)
        else:
            comments += [
                "GLOO_SOCKET_IFNAME=<detected by the deploy: the one interface holding NODE_IP (or set "
                "parallel.socket_ifname)>",
                "NCCL_SOCKET_IFNAME=<the same interface>",
            ]
        # Multi-node: one instance per node, and every node's processes (Ray workers too) need
        # the binding when the node starts, so it is per host here, not per instance.
        inst = node.instances[0] if node.instances else None
        ranks = world_size_per_node(resolved)
        if resolved["install"]["accelerator"] == "cpu" and ranks > 1 and node.roles & SERVICE_PARTS:
            cpus = data.get("cpu_count")
            values["VLLM_CPU_OMP_THREADS_BIND"] = (
                inst.cpus if inst and inst.cpus else _cpu_sets(int(cpus) if cpus else None, 1, ranks)[0]
            )
            if not cpus:
                comments.append(
                    "VLLM_CPU_OMP_THREADS_BIND: one core per rank (host data `cpu_count` gives an even split)"
                )
        if inst and inst.gpu_ids:
            values["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in inst.gpu_ids)
    if not values and len(comments) == 2:
        comments.append("Single node: nothing host-specific (each replica's own settings are in its replica-N.env).")
    return RenderedFile(env_file(values, comments), 0o640, "root", resolved["server"]["user"])


def _instance_env_file(resolved: dict[str, Any], inst: Instance) -> RenderedFile:
    """``replica-N.env``: what one instance has to itself: its GPUs or cores and state dirs."""
    values: dict[str, str] = {}
    if not _multi(resolved):
        if inst.gpu_ids is not None:
            values["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in inst.gpu_ids)
        if inst.cpus is not None and resolved["install"]["accelerator"] == "cpu":
            values["VLLM_CPU_OMP_THREADS_BIND"] = inst.cpus
    values.update(state_env(inst.state_dir))
    # The spec's own env wins, as in vllm.env, except over the layout's split of the host's cores
    # between replicas and ranks (sharing cores is what the split is there to prevent).
    user = {k: v for k, v in (resolved.get("env") or {}).items() if k in values and k != "VLLM_CPU_OMP_THREADS_BIND"}
    values.update(user)
    comments = [
        HEADER.format(name=resolved["name"]),
        f"Replica {inst.index} ({inst.unit}, port {inst.port}): its own devices or cores and state directories; read "
        "after vllm.env and node.env.",
    ]
    return RenderedFile(env_file(values, comments), 0o640, "root", resolved["server"]["user"])


def _expected_addresses(nodes: list[Node]) -> list[str]:
    out: list[str] = []
    for n in nodes:
        if n.private and n.roles & {"ray-head", "ray-worker"} and n.private not in out:
            out.append(n.private)
    return out


def _earlier_on_same_gpus(node: Node, inst: Instance) -> Instance | None:
    """The replica of this host started just before ``inst`` on the same GPUs (replicas.per_gpu)."""
    if not inst.gpu_ids:
        return None
    same = [i for i in node.instances if i.gpu_ids == inst.gpu_ids and i.index < inst.index]
    return same[-1] if same else None


def _vllm_unit(
    resolved: dict[str, Any], node: Node, inst: Instance, all_nodes: list[Node]
) -> tuple[RenderedFile, RenderedFile | None]:
    p = paths(resolved)
    par = resolved["parallel"]
    worker = inst.role == "worker"
    mine = {**resolved, "server": {**resolved["server"], "port": inst.port}}
    tier = kv_offload_on(resolved, node.data)
    if tier is not None:  # this host's figure (host data: the deploy's for `auto`); `auto` unknown: no tier yet
        mine["engine"] = {**resolved["engine"], "kv_offload": {**resolved["engine"]["kv_offload"], "size_gib": tier}}
    argv = vllm_argv(mine, role="worker" if worker else "server", node_rank=inst.node_rank)
    ray_head = _multi(resolved) and _backend(resolved) == "ray" and not worker
    env_files = [p["vllm_env"], p["node_env"], inst.env_file]
    if not worker:
        env_files.append(p["secrets_env"])
    after, requires, pre, environment = [], [], [], []
    wait = None
    earlier = _earlier_on_same_gpus(node, inst)
    if earlier is not None:
        # replicas.per_gpu: start after the previous replica of these GPUs is healthy, so that this
        # vLLM's start-up memory check (free memory >= its share) sees the memory that one took.
        after.append(earlier.unit)
        pre.append(
            systemd_command([env_python(resolved), p["wait_health"], str(earlier.port), str(TIMEOUT_START - 60)])
        )
    if ray_head:
        head = f"{par['head_address']}:{par['ray_port']}"
        after.append("ray-head.service")
        requires.append("ray-head.service")
        environment.append(systemd_quote(f"RAY_ADDRESS={head}"))
        nodes = int(par["nodes"])
        gpus = nodes * int(resolved["hardware"]["gpus_per_node"])
        cmd = [
            env_python(resolved),
            p["wait_ray"],
            "--address",
            head,
            "--nodes",
            str(nodes),
            "--gpus",
            str(gpus),
            "--timeout",
            str(RAY_WAIT_TIMEOUT),
        ]
        for a in _expected_addresses(all_nodes):
            cmd += ["--expect", a]
        pre.append(systemd_command(cmd))
        wait = RenderedFile((TEMPLATES / "wait-ray-cluster.py").read_text(), 0o755)
    if worker:
        role_text = f"headless node rank {inst.node_rank} of {par['nodes']}"
    elif _multi(resolved):
        role_text = f"API server, node rank 0 of {par['nodes']} ({_backend(resolved)})"
    else:
        role_text = f"API server, replica {inst.index} on port {inst.port}"
    content = _template(
        "vllm.service.j2",
        **_common(resolved),
        working_directory=inst.state_dir,
        served_name=resolved["model"]["served_name"],
        role_text=role_text,
        after=after,
        requires=requires,
        environment_files=env_files,
        environment=environment,
        exec_start_pre=pre,
        exec_start=systemd_command(argv),
        restart_always=ray_head,
        timeout_start=TIMEOUT_START,
        timeout_stop=resolved["server"]["shutdown_timeout"] + STOP_MARGIN,
        syslog_identifier=inst.unit.removesuffix(".service"),
        read_write_paths=_read_write_paths(resolved),
        cuda_ipc=_local_gpus(resolved),
    )
    return RenderedFile(content, 0o644), wait


def _local_gpus(resolved: dict[str, Any]) -> int:
    """The GPUs one instance's ranks use on its host when more than one (TP, or PP stages on the
    same host: they exchange GPU memory through CUDA IPC), else 0 (CPU, or one GPU)."""
    n = world_size_per_node(resolved) if resolved["install"]["accelerator"] == "cuda" else 0
    return n if n > 1 else 0


def ray_ports(resolved: dict[str, Any]) -> list[str]:
    """Every TCP port (or ``lo-hi`` range) a Ray node of this deployment listens on, for a
    firewall: the GCS port, the fixed ports and the worker range."""
    lo, hi = RAY_WORKER_PORTS
    ports = sorted({int(resolved["parallel"]["ray_port"]), *RAY_FIXED_PORTS.values()})
    return [str(p) for p in ports] + [f"{lo}-{hi}"]


def _ray_unit(resolved: dict[str, Any], node: Node) -> RenderedFile:
    p = paths(resolved)
    par, acc = resolved["parallel"], resolved["install"]["accelerator"]
    data = node.data or {}
    head = "ray-head" in node.roles
    argv = [env_bin(resolved, "ray"), "start"]
    fp = RAY_FIXED_PORTS
    if head:
        argv += [
            "--head",
            "--port",
            str(par["ray_port"]),
            "--dashboard-host",
            "127.0.0.1",
            "--dashboard-port",
            str(fp["dashboard"]),
            "--ray-client-server-port",
            str(fp["ray_client_server"]),
        ]
    else:
        argv += ["--address", f"{par['head_address']}:{par['ray_port']}"]
    # Fixed ports (Ray picks random ones otherwise), so the firewall can name them.
    argv += [
        "--node-manager-port",
        str(fp["node_manager"]),
        "--object-manager-port",
        str(fp["object_manager"]),
        "--runtime-env-agent-port",
        str(fp["runtime_env_agent"]),
        "--dashboard-agent-grpc-port",
        str(fp["dashboard_agent_grpc"]),
        "--dashboard-agent-listen-port",
        str(fp["dashboard_agent_listen"]),
        "--metrics-export-port",
        str(fp["metrics_export"]),
        "--min-worker-port",
        str(RAY_WORKER_PORTS[0]),
        "--max-worker-port",
        str(RAY_WORKER_PORTS[1]),
    ]
    argv += [
        "--block",
        "--node-ip-address",
        EnvRef("NODE_IP"),
        "--num-gpus",
        str(resolved["hardware"]["gpus_per_node"]),
        "--memory",
        str(int(data.get("ray_memory_bytes") or RAY_MEMORY_BYTES[acc])),
        "--object-store-memory",
        str(int(data.get("ray_object_store_bytes") or RAY_OBJECT_STORE_BYTES[acc])),
    ]
    content = _template(
        "ray.service.j2",
        **_common(resolved),
        ray_role="head" if head else "worker",
        environment_files=[p["vllm_env"], p["node_env"]],
        exec_start=systemd_command(argv),
        before=[i.unit for i in node.instances],
        timeout_start=RAY_TIMEOUT_START,
        timeout_stop=RAY_TIMEOUT_STOP,
        syslog_identifier=f"ray-{'head' if head else 'worker'}-{resolved['name']}",
        read_write_paths=_read_write_paths(resolved),
    )
    return RenderedFile(content, 0o644)


def _upstream_params(resolved: dict[str, Any], down: bool = False) -> str:
    """nginx `server` parameters of one replica: the passive health check, and `down` while a
    rollout has it out of the upstream (host data ``upstream_down``)."""
    prx = resolved["proxy"]
    out = f" max_fails={prx['max_fails']} fail_timeout={prx['fail_timeout']}s"
    return out + (" down" if down else "")


def _upstreams(resolved: dict[str, Any], node: Node, all_nodes: list[Node], with_inventory: bool) -> list[str]:
    """Every instance of the deployment on every host: local ones at 127.0.0.1, the others at
    their host's private address."""
    out = []
    loopback = resolved["server"]["host"] in ("127.0.0.1", "localhost", "::1")
    for s in all_nodes:
        for inst in s.instances:
            if inst.role != "server":
                continue
            params = _upstream_params(resolved, inst.down)
            if not with_inventory or s.target == node.target:
                out.append(f"127.0.0.1:{inst.port}{params}")
                continue
            if loopback:
                raise RenderError(
                    f"the proxy on {node.target} must reach vLLM on {s.target}, but server.host is "
                    f"{resolved['server']['host']} (vLLM listens only locally): set server.host: 0.0.0.0 (the "
                    f"deploy's own nftables rules then let only the proxy hosts reach port {inst.port}: host data "
                    "vllm_api_firewall), or put the proxy on the server host"
                )
            out.append(f"{inst.address}:{inst.port}{params}")
    if out and all(u.endswith(" down") for u in out):
        raise RenderError(
            f"the proxy on {node.target} would have every replica marked down (upstream_down; deployment "
            f"{resolved['name']}): keep at least one in"
        )
    return out


def worker_urls(
    resolved: dict[str, Any], node: Node, all_nodes: list[Node], with_inventory: bool
) -> list[tuple[str, Instance]]:
    """The router's workers as it names them (``http://ADDR:PORT``), with their instances:
    the same addresses nginx would use (local replicas on loopback)."""
    out = []
    for s in all_nodes:
        for inst in s.instances:
            if inst.role != "server":
                continue
            local = not with_inventory or s.target == node.target
            out.append((f"http://{'127.0.0.1' if local else inst.address}:{inst.port}", inst))
    return out


def router_argv(resolved: dict[str, Any], workers: list[str], policy: str = ROUTER_POLICY) -> list[str]:
    """The vllm-router command line (flags of vllm-router 0.1.17, checked in tests/test_routing.py);
    ``policy``: the layout's (:attr:`Node.policy`)."""
    rt = resolved["proxy"]["routing"]["router"]
    return [
        f"{paths(resolved)['router_env']}/bin/vllm-router",
        "--host",
        "127.0.0.1",
        "--port",
        str(rt["port"]),
        "--worker-urls",
        *workers,
        "--policy",
        policy,
        "--cache-threshold",
        str(rt["cache_threshold"]),
        "--balance-abs-threshold",
        str(rt["balance_abs_threshold"]),
        "--balance-rel-threshold",
        str(rt["balance_rel_threshold"]),
        "--health-check-interval-secs",
        str(rt["health_check_interval"]),
        "--health-failure-threshold",
        str(rt["health_failure_threshold"]),
        "--health-success-threshold",
        "1",
        "--worker-startup-timeout-secs",
        str(ROUTER_STARTUP_TIMEOUT),
        "--worker-startup-check-interval",
        "1",
        "--request-timeout-secs",
        str(resolved["proxy"]["read_timeout"]),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(rt["metrics_port"]),
        "--log-level",
        "warning",
    ]


def _router_unit(resolved: dict[str, Any], node: Node, all_nodes: list[Node], with_inventory: bool) -> RenderedFile:
    workers = worker_urls(resolved, node, all_nodes, with_inventory)
    rt = resolved["proxy"]["routing"]["router"]
    content = _template(
        "vllm-router.service.j2",
        header=HEADER.format(name=resolved["name"]),
        name=resolved["name"],
        version=rt["version"],
        policy=node.policy,
        workers=workers,
        # replicas on this host first (ordering only; remote ones are waited for by the router)
        after=[i.unit for i in node.instances if i.role == "server"],
        exec_start=systemd_command(router_argv(resolved, [u for u, _ in workers], node.policy)),
        syslog_identifier=ROUTER_UNIT.format(name=resolved["name"]).removesuffix(".service"),
        start_limit_interval=START_LIMIT_INTERVAL,
        start_limit_burst=START_LIMIT_BURST,
    )
    return RenderedFile(content, 0o644)


def nginx_listen(prx: dict[str, Any], host: str) -> str:
    """nginx's ``listen``: ``proxy.bind``:``proxy.listen``; without a bind, every address (the
    port alone), but on pyinfra's ``@local`` host loopback: the workstation the user sits at
    serves its own user unless the spec says otherwise (docs/own-servers.md)."""
    bind = prx.get("bind") or ("127.0.0.1" if is_local(host) else None)
    # 0.0.0.0 is every address: nginx's "listen PORT", the same socket and text as a server's
    return f"{bind}:{prx['listen']}" if bind and bind != "0.0.0.0" else str(prx["listen"])


def _nginx_site(resolved: dict[str, Any], node: Node, all_nodes: list[Node], with_inventory: bool) -> RenderedFile:
    prx, p = resolved["proxy"], paths(resolved)
    tls = bool((prx.get("tls") or {}).get("enabled"))
    policy = node.policy
    header_var = "$http_" + prx["routing"]["session_header"].lower().replace("-", "_")
    content = _template(
        "nginx-site.conf.j2",
        header=HEADER.format(name=resolved["name"]),
        name=resolved["name"],
        auth=prx["auth"] == "api_key",
        auth_include=p["nginx_auth"],
        auth_var=_auth_var(resolved),
        upstream_name=_upstream_name(resolved),
        session_upstream=_upstream_name(resolved, "_session"),
        tls_zone=_upstream_name(resolved, "_tls"),
        upstream_servers=_upstreams(resolved, node, all_nodes, with_inventory),
        policy=policy,
        session_header=prx["routing"]["session_header"],
        session_var=header_var,
        pool_var="$" + nginx_name("vllm_fleet_", resolved["name"], "_pool"),
        router=f"127.0.0.1:{prx['routing']['router']['port']}",
        router_metrics=f"127.0.0.1:{prx['routing']['router']['metrics_port']}" if "router" in node.roles else None,
        keepalive=NGINX_KEEPALIVE,
        keepalive_timeout=NGINX_UPSTREAM_KEEPALIVE_TIMEOUT,
        next_upstream_tries=prx["next_upstream_tries"],
        next_upstream_timeout=prx["next_upstream_timeout"],
        tls=tls,
        tls_certificate=p["tls_certificate"],
        tls_certificate_key=p["tls_certificate_key"],
        listen=nginx_listen(prx, node.target),
        default_server=prx["server_name"] == "_",
        server_name=prx["server_name"],
        client_max_body_size=prx["client_max_body_size"],
        connect_timeout=prx["connect_timeout"],
        read_timeout=prx["read_timeout"],
        send_timeout=prx["send_timeout"],
        metrics_allow=prx.get("metrics_allow") or [],
        # /metrics of THIS host's vLLM when it runs one (the upstream may balance over several
        # replicas, whose counters must not be mixed in one scrape target)
        metrics_upstream=f"127.0.0.1:{node.instances[0].port}"
        if "server" in node.roles and node.instances
        else _upstream_name(resolved),
        # /metrics/N and /health/N: replica N of THIS host alone, for a monitoring host elsewhere
        # (vLLM listens on loopback; /metrics is replica 0's, /health the upstream's)
        replica_upstreams=[(i.index, f"127.0.0.1:{i.port}") for i in node.instances if i.role == "server"]
        if "server" in node.roles and node.instances
        else [],
    )
    return RenderedFile(content, 0o644)


def client_settings(
    resolved: dict[str, Any], nodes: list[Node] | None = None, policy: str | None = None
) -> dict[str, Any]:
    """OpenAI-compatible client settings (base_url, model, where the key is, the routing
    ``policy`` the layout decided), as a dict."""
    prx, srv = resolved["proxy"], resolved["server"]
    nodes = nodes or []
    proxies = [n for n in nodes if "proxy" in n.roles and n.address]
    servers = [n for n in nodes if "server" in n.roles and n.address]
    if prx["enabled"]:
        tls = bool((prx.get("tls") or {}).get("enabled"))
        scheme, port = ("https", prx["listen"]) if tls else ("http", prx["listen"])
        if prx["server_name"] != "_":
            host = prx["server_name"]
        elif proxies:
            host = proxies[0].address
        else:  # no inventory: nginx on the server host (the head of a multi-node server)
            host = resolved["parallel"].get("head_address") if _multi(resolved) else "127.0.0.1"
        default_port = 443 if tls else 80
    else:
        scheme, port, default_port = "http", srv["port"], None
        host = servers[0].address if servers else (resolved["parallel"].get("head_address") or "127.0.0.1")
    netloc = host if port == default_port else f"{host}:{port}"
    ref = srv.get("api_key")
    out = {
        "base_url": f"{scheme}://{netloc}/v1",
        "model": resolved["model"]["served_name"],
        "api_key": {"secret": dict(ref) if ref else None, "where": describe_secret(ref)},
    }
    if prx["enabled"]:
        out["routing"] = {"policy": policy}
        if policy == "session":
            out["routing"]["session_header"] = prx["routing"]["session_header"]
            out["routing"]["how"] = (
                f"send the header {prx['routing']['session_header']}: <conversation id> with every request of a "
                "conversation (the same value each turn): its turns then reach the replica that holds its prefix cache"
            )
    return out


def client_json(doc: dict[str, Any]) -> str:
    """The text of ``openai.json``: the one writer of it (the rendered client file, and the smoke
    role's copy on the control machine, which adds its measurements under ``smoke``)."""
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def _client_files(resolved: dict[str, Any], nodes: list[Node] | None, policy: str | None) -> dict[str, RenderedFile]:
    p = paths(resolved)
    s = client_settings(resolved, nodes, policy)
    ref = resolved["server"].get("api_key") or {}
    if "file" in ref:
        f = ref["file"]
        f = "~/" + shlex.quote(f[2:]) if f.startswith("~/") else shlex.quote(f)
        how = f'export OPENAI_API_KEY="$(cat {f})"'
    elif "env" in ref:
        how = f'export OPENAI_API_KEY="${ref["env"]}"'
    else:
        how = "no API key configured (server.api_key)"
    values = {"OPENAI_BASE_URL": s["base_url"], "OPENAI_MODEL": s["model"]}
    comments = [
        HEADER.format(name=resolved["name"]),
        "OpenAI-compatible client settings for this deployment.",
        f"OPENAI_API_KEY=<secret: {s['api_key']['where']}>: {how}",
    ]
    if (s.get("routing") or {}).get("session_header"):
        values["VLLM_FLEET_SESSION_HEADER"] = s["routing"]["session_header"]
        comments.append(
            f"Routing `session`: {s['routing']['how']}, with the OpenAI SDK: "
            f"default_headers={{\"{s['routing']['session_header']}\": conversation_id}}."
        )
    env = env_file(values, comments)
    doc = {"name": resolved["name"], **s}
    return _owned(
        {
            p["client_json"]: RenderedFile(client_json(doc), 0o644, "", ""),
            p["client_env"]: RenderedFile(env, 0o644, "", ""),
        },
        resolved["name"],
        "client",
    )


def _add(files: dict[str, RenderedFile], path: str, f: RenderedFile, target: str) -> None:
    old = files.get(path)
    if old is not None and old != f:
        raise RenderError(f"{target}: two roles render {path} differently (a bug in vllm-fleet's renderer)")
    files[path] = f


def _node_files(
    resolved: dict[str, Any], p: Paths, node: Node, all_nodes: list[Node], with_inventory: bool
) -> dict[str, RenderedFile]:
    """The files of one deployment's node (``p``: its :func:`paths`), each naming its deployment and part."""
    files: dict[str, RenderedFile] = {}
    name = resolved["name"]

    def add(part: str, path: str, f: RenderedFile) -> None:
        _add(files, path, dataclasses.replace(f, deployment=name, part=part), node.target)

    ray_node = bool(node.roles & {"ray-head", "ray-worker"})
    if node.roles & SERVICE_PARTS:  # a Ray node's role places them: Ray starts with them
        add("ray" if ray_node else "service", p["vllm_env"], _vllm_env_file(resolved))
        add("ray" if ray_node else "service", p["node_env"], _node_env_file(resolved, node))
    for inst in node.instances:
        unit, wait = _vllm_unit(resolved, node, inst, all_nodes)
        add("service", f"{SYSTEMD_DIR}/{inst.unit}", unit)
        add("service", inst.env_file, _instance_env_file(resolved, inst))
        if wait:
            add("ray", p["wait_ray"], wait)
        if _earlier_on_same_gpus(node, inst) is not None:
            add("service", p["wait_health"], RenderedFile((TEMPLATES / "wait-replica-health.py").read_text(), 0o755))
    if "server" in node.roles:
        add("service", p["secrets_env"], RenderedFile(secrets_env_content(resolved, None), 0o600))
    for path, f in _liveness_files(resolved, p, node).items():
        add("liveness", path, f)
    if "ray-head" in node.roles:
        add("ray", p["ray_head_unit"], _ray_unit(resolved, node))
    if "ray-worker" in node.roles:
        add("ray", p["ray_worker_unit"], _ray_unit(resolved, node))
    for path, f in monitoring.node_files(resolved, node, all_nodes, with_inventory).items():
        add("monitoring", path, f)
    if "proxy" in node.roles:
        add("nginx", p["nginx_site"], _nginx_site(resolved, node, all_nodes, with_inventory))
        if resolved["proxy"]["auth"] == "api_key":
            add("nginx", p["nginx_auth"], RenderedFile(nginx_auth_content(resolved, None), 0o600))
    if "router" in node.roles:
        add("router", p["router_unit"], _router_unit(resolved, node, all_nodes, with_inventory))
    return files


# ---------------------------------------------------------------------------------------------
# Per-host files over every deployment there: the firewalls


def _data(h: HostLayout, key: str) -> Any:
    return h.data.get(key, HOST_DATA_DEFAULTS[key])


def api_firewall_files(layout: Layout, h: HostLayout) -> dict[str, RenderedFile]:
    """vLLM listening beyond loopback behind a proxy: its ports only from the proxy hosts (their
    private addresses), loopback and host data ``vllm_api_firewall_allow``; one nftables table."""
    ports: list[int] = []
    allow: list[str] = []
    monitors: list[str] = []
    names: list[str] = []
    for dep, node in h.parts.items():
        r = layout.deployments[dep]
        srv = r["server"]
        if not node.instances or srv["host"] in ("127.0.0.1", "::1", "localhost") or not r["proxy"]["enabled"]:
            continue
        names.append(dep)
        ports += [i.port for i in node.instances if i.role == "server"]
        allow += [str(layout.hosts[name].private_address) for name in layout.hosts_with("proxy", dep)]
        # its Prometheus and blackbox probe read these ports directly (monitoring.vllm_targets)
        monitors += monitoring.scrapers(r, layout.nodes(dep))
    if not ports or not layout.with_inventory or not _data(h, "vllm_api_firewall"):
        return {}
    addrs = firewall_addresses(
        [*allow, *monitors, *(_data(h, "vllm_api_firewall_allow") or [])], f"{h.name}: API firewall"
    ) or ["127.0.0.1"]
    header = HEADER.format(name=", ".join(names))
    ports = sorted(set(ports))
    whom = "the proxy hosts" + (" and the monitoring hosts" if monitors else "")
    rules, unit = _firewall(
        header,
        API_FIREWALL_TABLE,
        API_FIREWALL_FILE,
        addrs,
        ports,
        peers="api_peers_v4",
        peer_ports_only=True,
        about=[
            f"vLLM listens beyond loopback (ports {', '.join(map(str, ports))}) so that the proxy on another host can",
            f"reach these replicas; only {whom} ({', '.join(addrs)}) and loopback may connect to",
            "those ports, every other address is dropped. Other ports are not touched (this table only drops).",
        ],
        unit_text=dict(what="vLLM's API port", whom="the proxy", before_what="vLLM", ports_name="vLLM's API ports"),
        before=[i.unit for i in h.instances],
    )
    # over every deployment here (deployment ""): the service role places it once per host
    return _owned(
        {
            API_FIREWALL_FILE: RenderedFile(rules, 0o644),
            f"{SYSTEMD_DIR}/{API_FIREWALL_UNIT}": RenderedFile(unit, 0o644),
        },
        "",
        "service",
    )


def _firewall(
    header: str,
    table: str,
    rules_path: str,
    allow: list[str],
    ports: list,
    *,
    peers: str,
    peer_ports_only: bool,
    about: list[str],
    unit_text: dict[str, str],
    before: list[str],
    monitors: Sequence[str] = (),
    monitor_ports: Sequence[int] = (),
) -> tuple[str, str]:
    """One nftables table that drops ``ports`` from every address but ``allow`` and loopback
    (``peer_ports_only``: the peers may reach only those ports through it; ``monitors`` reach
    ``monitor_ports`` alone), and the oneshot unit
    that loads it before ``before`` (firewall.nft.j2, firewall.service.j2: the API and Ray
    firewalls differ only in these parameters)."""
    rules = _template(
        "firewall.nft.j2",
        header=header,
        table=table,
        allow=allow,
        ports=ports,
        peers=peers,
        peer_ports_only=peer_ports_only,
        about=about,
        monitors=list(monitors),
        monitor_ports=list(monitor_ports),
    )
    unit = _template("firewall.service.j2", header=header, table=table, rules=rules_path, before=before, **unit_text)
    return rules, unit


def ray_firewall_files(layout: Layout, h: HostLayout) -> dict[str, RenderedFile]:
    """Ray's ports (no authentication) only from the cluster's own private addresses (+ host
    data ``ray_firewall_allow``)."""
    deps = [dep for dep, n in h.parts.items() if n.roles & {"ray-head", "ray-worker"}]
    if not deps or not layout.with_inventory or not _data(h, "ray_firewall"):
        return {}
    r = layout.deployments[deps[0]]
    cluster = [str(n.private) for n in layout.nodes(deps[0]) if n.roles & {"ray-head", "ray-worker"}]
    addrs = firewall_addresses([*cluster, *(_data(h, "ray_firewall_allow") or [])], f"{h.name}: Ray firewall")
    # Prometheus reads Ray's metrics port of every node (monitoring.ray): that port alone for the
    # monitoring hosts outside the cluster
    scrape = [a for a in monitoring.scrapers(r, layout.nodes(deps[0])) if r["monitoring"]["ray"] and a not in cluster]
    monitors = firewall_addresses(scrape, f"{h.name}: Ray firewall (monitoring)") if scrape else []
    header = HEADER.format(name=r["name"])
    rules, unit = _firewall(
        header,
        RAY_FIREWALL_TABLE,
        RAY_FIREWALL_FILE,
        addrs,
        ray_ports(r),
        peers="ray_peers_v4",
        peer_ports_only=False,
        monitors=monitors,
        monitor_ports=[RAY_FIXED_PORTS["metrics_export"]],
        about=[
            "Ray's ports have no authentication: accept them only from the cluster's own addresses",
            f"({', '.join(addrs)}) and loopback; drop them from everywhere else. Other ports are not",
            "touched (this table only drops; the host's own rules still apply).",
        ],
        unit_text=dict(what="Ray's ports", whom="the cluster", before_what="Ray starts", ports_name="Ray's ports"),
        before=["ray-head.service", "ray-worker.service"],
    )
    return _owned(
        {
            RAY_FIREWALL_FILE: RenderedFile(rules, 0o644),
            f"{SYSTEMD_DIR}/{RAY_FIREWALL_UNIT}": RenderedFile(unit, 0o644),
        },
        r["name"],
        "ray",
    )


def fill_files(layout: Layout) -> None:
    """Every host's files and secrets, and the control machine's (called by layout.build)."""
    layout.paths = {dep: deployment_paths(r) for dep, r in layout.deployments.items()}  # once per deployment
    for h in layout.hosts.values():
        files: dict[str, RenderedFile] = {}
        for dep, node in h.parts.items():
            r, p = layout.deployments[dep], layout.paths[dep]
            nodes = layout.nodes(dep)
            for path, f in _node_files(r, p, node, nodes, layout.with_inventory).items():
                _add(files, path, f, h.name)
            if "server" in node.roles and r["server"].get("api_key"):
                h.secrets.append(Secret(dep, "api_key", (p["secrets_env"],)))
            if "proxy" in node.roles and r["proxy"]["auth"] == "api_key":
                h.secrets.append(Secret(dep, "api_key", (p["nginx_auth"],)))
            if node.roles & SERVICE_PARTS and r["model"].get("hub_token"):
                h.secrets.append(Secret(dep, "hub_token"))
        for path, f in {**api_firewall_files(layout, h), **ray_firewall_files(layout, h)}.items():
            _add(files, path, f, h.name)
        h.files = files
    for dep, r in layout.deployments.items():
        for path, f in _client_files(
            r, layout.nodes(dep) if layout.with_inventory else None, layout.policy(dep)
        ).items():
            _add(layout.client, path, f, "client")


def build(
    specs: Sequence[dict[str, Any]] | dict[str, Any],
    inventory: dict[str, dict[str, Any]] | None = None,
    *,
    down: Iterable[str] = (),
    sources: dict[str, str] | None = None,
) -> Layout:
    """The layout of ``specs`` (resolved) on ``inventory`` ({host: {address, groups, data}}, as
    :func:`vllm_fleet.specs.inventory.load_inventory` returns; None: per part, e.g. ``server``):
    the parts (:func:`vllm_fleet.render.parts.build_parts`), then every file of every host.

    ``down``: instance ids (``HOST:N``) or host names out of the nginx upstream (a rollout).
    ``sources``: {deployment: spec file} for the messages. Raises :class:`LayoutError` with
    every problem found.
    """
    layout = build_parts(specs, inventory, down=down, sources=sources)
    try:
        fill_files(layout)
    except RenderError as exc:
        raise LayoutError([str(exc)]) from None
    layout.hosts = {k: v for k, v in layout.hosts.items() if v.parts or v.files}
    return layout


def render_many(
    specs: list[dict[str, Any]], inventory_hosts: dict[str, dict[str, Any]] | None = None, **kw: Any
) -> dict[str, dict[str, RenderedFile]]:
    """:func:`render` of several deployments on one fleet (checked against each other)."""
    try:
        return build(specs, inventory_hosts, **kw).files()
    except LayoutError as exc:
        raise RenderError(str(exc)) from None


def render(
    resolved: dict[str, Any], inventory_hosts: dict[str, dict[str, Any]] | None = None
) -> dict[str, dict[str, RenderedFile]]:
    """Every file of the deployment, per part (no inventory) or per host (with one).

    The ``client`` target (files for the control machine) is always present.
    """
    return render_many([resolved], inventory_hosts)
