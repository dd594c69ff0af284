"""The vLLM systemd service: system user, directories, environment files (the API key in a
0600 file), the rendered unit; daemon-reload and restart only when something relevant changed;
then wait until /health answers, with a deadline and the journal tail in the error.
"""

from __future__ import annotations

import shlex
import time
from io import StringIO
from pathlib import Path
from typing import Any

from pyinfra import host
from pyinfra.facts.server import Command
from pyinfra.api import deploy
from pyinfra.api.exceptions import DeployError
from pyinfra.operations import files, python, server, systemd
from pyinfra.operations.util import any_changed

from vllm_fleet.roles.common import inventory_hosts, put_rendered, secret_file
from vllm_fleet import command, render

from . import defaults as d
from .defaults import DEFAULTS

UNIT = "vllm.service"
TEMPLATES = Path(__file__).resolve().parent / "templates"


def _probe(url: str, unit: str) -> tuple[str, str, int]:
    ok, out = host.run_shell_command(
        f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 5 {shlex.quote(url)}; echo; "
        f"systemctl is-active {unit} || true; systemctl show -p NRestarts --value {unit}",
        _sudo=True,
    )
    lines = [line.strip() for line in getattr(out, "stdout_lines", [])] + ["", "", ""]
    restarts = int(lines[2]) if lines[2].isdigit() else 0
    return lines[0], lines[1], restarts


def _wait_healthy(port: int, deadline: int, interval: float, journal_lines: int, unit: str = UNIT) -> None:
    """Runs on the host at execute time: poll /health there until 200.

    Fails early, with the journal tail, when the unit fails or systemd restarts it (a crash
    while starting repeats on every restart: waiting out the deadline would only hide it).
    """
    t0 = time.monotonic()
    url = f"http://127.0.0.1:{port}/health"
    _, _, restarts0 = _probe(url, unit)
    last = ""
    while time.monotonic() - t0 < deadline:
        code, state, restarts = _probe(url, unit)
        if code == "200":
            host.noop(f"{unit} healthy after {time.monotonic() - t0:.0f} s")
            return
        last = f"/health -> {code or 'no answer'}, unit {state}"
        if state == "failed" or restarts > restarts0:
            last += f", the unit crashed while starting (restarts {restarts0} -> {restarts})"
            break
        time.sleep(interval)
    _, out = host.run_shell_command(f"journalctl -u {unit} -n {journal_lines} --no-pager -o cat", _sudo=True)
    tail = "\n".join(getattr(out, "stdout_lines", []))
    raise RuntimeError(f"{host.name}: {unit} not healthy after {time.monotonic() - t0:.0f} s (deadline {deadline} s; {last}).\n"
                       f"Last {journal_lines} journal lines:\n{tail}")


def api_firewall_rules(spec: dict[str, Any], allow: list[str]) -> str:
    """The nftables rules file: server.port accepted only from ``allow`` (and loopback)."""
    import ipaddress

    import jinja2

    addrs: list[str] = []
    for a in allow:
        try:
            net = ipaddress.ip_network(str(a), strict=False)
        except ValueError:
            raise DeployError(f"API firewall: {a!r} is not an IPv4 address or network (give the proxy host's "
                              "address as ssh_hostname, or list it in host data vllm_api_firewall_allow)") from None
        if net.version != 4:
            raise DeployError(f"vllm_api_firewall_allow: {a}: only IPv4 addresses/networks are supported")
        text = str(net.network_address) if net.prefixlen == 32 else str(net)
        if text not in addrs:
            addrs.append(text)
    if not addrs:
        addrs = ["127.0.0.1"]
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    return env.get_template("api-firewall.nft.j2").render(
        name=spec["name"], table=d.API_FIREWALL_TABLE, allow=addrs, port=int(spec["server"]["port"]),
        bind=spec["server"]["host"])


def api_firewall_unit(spec: dict[str, Any]) -> str:
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    return env.get_template("api-firewall.service.j2").render(name=spec["name"], table=d.API_FIREWALL_TABLE,
                                                              rules=d.API_FIREWALL_FILE)


def proxy_addresses(spec: dict[str, Any], inv: dict[str, dict[str, Any]]) -> list[str]:
    """Addresses of the hosts that run this deployment's nginx (as the renderer lays it out)."""
    roles = render.roles_of(spec, inv)
    return [str(inv[name]["address"]) for name, r in roles.items() if "proxy" in r and name in inv]


@deploy("vLLM API port firewall", data_defaults=DEFAULTS)
def api_firewall(spec: dict[str, Any], proxies: list[str] | None = None):
    """
    Close vLLM's API port to everyone but the proxy hosts, when vLLM listens beyond loopback.

    vLLM's /health and /metrics need no key, and its API checks the key itself only; replicas
    behind a proxy on another host listen on ``server.host`` (0.0.0.0): an nftables table
    (``inet vllm_fleet_api``, loaded by ``vllm-fleet-api-firewall.service`` before vLLM) accepts
    ``server.port`` from loopback, the proxy hosts and host data ``vllm_api_firewall_allow``,
    and drops it from everywhere else. Nothing is done when vLLM listens on loopback, when the
    proxy is off, or with host data ``vllm_api_firewall: false``.

    + spec: the resolved deployment spec
    + proxies: the proxy hosts' addresses (default: from the inventory, as the renderer lays it out)

    **Example:**

    .. code:: python

        api_firewall(spec=ctx["spec"])
    """
    srv = spec["server"]
    if srv["host"] in ("127.0.0.1", "::1") or not spec["proxy"]["enabled"] or not host.data.get("vllm_api_firewall"):
        return []
    if proxies is None:
        proxies = proxy_addresses(spec, inventory_hosts())
    allow = [*proxies, *(host.data.get("vllm_api_firewall_allow") or [])]
    rules = files.put(name=f"nftables rules: port {srv['port']} only from {', '.join(allow) or 'loopback'}",
                      src=StringIO(api_firewall_rules(spec, allow)), dest=d.API_FIREWALL_FILE,
                      user="root", group="root", mode="644")
    unit = files.put(name=f"Unit {d.API_FIREWALL_UNIT}", src=StringIO(api_firewall_unit(spec)),
                     dest=f"/etc/systemd/system/{d.API_FIREWALL_UNIT}", user="root", group="root", mode="644")
    systemd.daemon_reload(name="systemd daemon-reload (API firewall unit)", _if=unit.did_change)
    systemd.service(name=f"{d.API_FIREWALL_UNIT}: load the rules (they changed)", service=d.API_FIREWALL_UNIT,
                    running=True, restarted=True, enabled=True, _if=any_changed(rules, unit))
    systemd.service(name=f"{d.API_FIREWALL_UNIT} active and enabled", service=d.API_FIREWALL_UNIT, running=True, enabled=True)
    return [rules, unit]


def install_server_stack(spec: dict[str, Any], hub_token: str | None) -> tuple[list, list]:
    """
    Everything vllm.service stands on, in order: the NVIDIA driver (GPU hosts), the service user
    and directories, the Python env, vLLM's system libraries, the pinned vLLM, the model weights.
    The one place deploys/serve.py (every vLLM host) and deploys/rollout.py (a replica's update)
    get them from.

    + spec: the resolved deployment spec
    + hub_token: the model hub token's value (None when the model is local or public)

    Returns ``(vllm_changed, model_changed)``: the operations that change vLLM and the model, for
    ``install_service(restart_on=...)`` (and roles.ray's, which restarts Ray on vLLM changes only).

    **Example:**

    .. code:: python

        vllm_changed, model_changed = install_server_stack(spec=spec, hub_token=ctx["secrets"]["hub_token"])
        install_service(spec=spec, rendered=rendered, api_key=key, restart_on=[*vllm_changed, *model_changed])
    """
    from vllm_fleet.roles.model import install_model
    from vllm_fleet.roles.nvidia import nvidia
    from vllm_fleet.roles.pyenv import pyenv, service_dirs
    from vllm_fleet.roles.vllm import install_system_libraries, install_vllm

    nvidia(spec=spec)
    service_dirs(spec=spec)
    pyenv(spec=spec)
    install_system_libraries(spec=spec)
    vllm_changed = install_vllm(spec=spec)
    model_changed = install_model(spec=spec, hub_token=hub_token)
    return list(vllm_changed or []), list(model_changed or [])


@deploy("vLLM service", data_defaults=DEFAULTS)
def install_service(spec: dict[str, Any], rendered: dict[str, Any], api_key: str | None, restart_on: list | None = None):
    """
    Install and (re)start the vLLM service from the rendered files.

    + spec: the resolved deployment spec
    + rendered: this host's rendered files ({path: RenderedFile})
    + api_key: the API key's value (written only to ``{config_dir}/secrets.env``, 0600 root)
    + restart_on: operation results (vLLM install, model) whose change must restart vLLM

    **Example:**

    .. code:: python

        install_service(spec=ctx["spec"], rendered=rendered_for_host(ctx), api_key=ctx["secrets"]["api_key"],
                        restart_on=[vllm_op, model_op])
    """
    ins, srv = spec["install"], spec["server"]
    # The system user and directories come from vllm_fleet.roles.pyenv.service_dirs, which deploys/serve.py
    # runs first (the model role needs them too).
    # Cache and temp directories the unit's environment names (ReadWritePaths must exist).
    state_dir = ins["state_dir"]
    for dirpath in sorted({v for v in command.vllm_env(spec).values() if v.startswith(state_dir + "/")}):
        files.directory(name=f"Directory {dirpath}", path=dirpath, user=srv["user"], group=srv["user"], mode="750")
    if spec["parallel"]["backend"] == "ray" and spec["parallel"]["nodes"] > 1:
        files.directory(name="Ray temp directory", path=render.paths(spec)["ray_tmpdir"], user=srv["user"], group=srv["user"], mode="750")
    if any(p.startswith(ins["prefix"] + "/bin/") for p in rendered):
        files.directory(name="Helper scripts directory", path=f"{ins['prefix']}/bin", user="root", group="root", mode="755")

    # Replicas listening beyond loopback: only the proxy hosts may reach the port (before vLLM starts).
    api_firewall(spec=spec)

    unit_paths = [p for p in rendered if p.startswith("/etc/systemd/system/") and p.endswith(UNIT)]
    other = [p for p in rendered if p.startswith(ins["config_dir"] + "/") and not p.endswith("/secrets.env")]
    extra = [p for p in rendered if p.startswith(ins["prefix"] + "/bin/")]
    # Everything the unit names first, the unit last (a kill in between leaves no unit that
    # points at a missing file).
    put = put_rendered(rendered, other + extra)
    from vllm_fleet.secrets import host_secret_files

    secrets_env = render.paths(spec)["secrets_env"]
    secrets_op = secret_file(name="API key (0600, never shown)", path=secrets_env,
                             content=host_secret_files(spec, {"api_key": api_key})[secrets_env])
    put.update(put_rendered(rendered, unit_paths))
    unit_ops = [put[p] for p in unit_paths]
    relevant = [*put.values(), secrets_op, *(restart_on or [])]

    systemd.daemon_reload(name="systemd daemon-reload", _if=any_changed(*unit_ops))
    # A unit that hit its start limit (StartLimitBurst) refuses `restart` until reset.
    # A unit that is failed (e.g. it hit StartLimitBurst in an earlier crash loop) refuses to
    # start until reset: reset it when it is failed now or when it is about to restart.
    failed_now = (host.get_fact(Command, f"systemctl is-failed {UNIT} || true") or "").strip() == "failed"
    server.shell(name=f"Clear {UNIT}'s failed state before (re)starting", commands=[f"if systemctl is-failed --quiet {UNIT}; then systemctl reset-failed {UNIT}; fi"],
                 _if=(lambda: True) if failed_now else any_changed(*relevant))
    restart = systemd.service(name=f"Restart {UNIT} (its inputs changed)", service=UNIT, running=True, restarted=True,
                              enabled=True, _if=any_changed(*relevant))
    running = systemd.service(name=f"{UNIT} running and enabled", service=UNIT, running=True, enabled=True)
    python.call(
        name=f"Wait for {UNIT} /health (deadline {srv['health_timeout']} s)",
        function=_wait_healthy,
        port=srv["port"],
        deadline=srv["health_timeout"],
        interval=host.data.get("vllm_fleet_health_interval"),
        journal_lines=host.data.get("vllm_fleet_journal_lines"),
        _if=any_changed(restart, running, *relevant),
    )
    return restart
