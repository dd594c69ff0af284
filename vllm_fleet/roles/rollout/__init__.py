"""The rollout role: the steps of one rolling-update batch that are not the serve deploy itself.

Deploy functions (each runs on the hosts pyinfra is limited to; ``vllm-fleet rollout`` orders
the batches and calls ``deploys/rollout.py`` once per step):

``upstream(spec, rendered, drain_timeout)`` (proxy hosts)
    Put this host's rendered nginx site (the batch being updated marked ``down``: rendered with
    ``VLLM_FLEET_UPSTREAM_DOWN``), and when it changed: ``nginx -t``, reload, then wait until
    every nginx worker that ran before the reload has exited. After a reload the old workers
    finish their in-flight requests (and may still accept new connections for a moment, until
    the master has started the new ones): once they are gone no request can reach a replica
    marked down. Bounded by ``drain_timeout``; past it the step goes on and says so.

``drain(spec, drain_timeout)`` (the batch's hosts)
    Wait until vLLM on the host reports no running and no waiting request
    (``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` from its /metrics, read on
    the host), bounded by ``drain_timeout``; past it the step goes on and says so.

``smoke_replica(spec)`` (the batch's hosts)
    The replica on its own, on the host (its port is firewalled to the proxy): /health,
    /v1/models lists the served name, a chat with content, a streamed chat ending in [DONE].
    The key is read from the 0600 secrets.env by a root process on the host: never in argv.
    Fails the host with what failed and the journal tail.

Host data: ``defaults.DEFAULTS`` (poll interval, smoke tokens and timeout, journal lines).

Example (deploys/rollout.py)::

    from vllm_fleet.roles.rollout import drain, smoke_replica, upstream

    upstream(spec=spec, rendered=rendered, drain_timeout=120)      # on the proxy
    drain(spec=spec, drain_timeout=120)                             # on the batch
    ...  # the serve deploy's server part
    smoke_replica(spec=spec)
"""

from __future__ import annotations

import json
import time
from typing import Any

from pyinfra import host, logger
from pyinfra.api import deploy
from pyinfra.operations import python

from vllm_fleet.host import programs
from vllm_fleet.roles.common import as_root, put_rendered
from vllm_fleet.render import command
from vllm_fleet.render.layout import Paths
from vllm_fleet.specs.sections import reads

from .defaults import DEFAULTS

#: The spec sections this role reads (vllm_fleet.specs.sections); its README lists them.
SECTIONS = ("name", "install", "model", "proxy", "server")

__all__ = ["upstream", "router_workers", "drain", "smoke_replica", "parse_metrics", "DEFAULTS"]


# ----------------------------------------------------------------------------------------------
# Pure helpers (tested without hosts)


def parse_metrics(
    text: str, names: tuple[str, ...] = ("vllm:num_requests_running", "vllm:num_requests_waiting")
) -> dict[str, float]:
    """Sum each named series over its labels in a Prometheus text exposition."""
    out = {n: 0.0 for n in names}
    seen = set()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        metric = line.split("{", 1)[0].split(" ", 1)[0]
        if metric in out:
            try:
                out[metric] += float(line.rsplit(" ", 1)[1])
                seen.add(metric)
            except ValueError:
                continue
    if not seen:
        raise ValueError(f"none of {', '.join(names)} in the metrics")
    return out


def _say(text: str) -> None:
    """What a step saw, in pyinfra's output (vllm-fleet rollout shows these lines per step)."""
    logger.info(f"    [{host.name}] {text}")


# ----------------------------------------------------------------------------------------------
# Execute-time functions (python.call: run on the control machine, commands on the host)


def _reload_and_wait(timeout: float, interval: float) -> None:
    t0 = time.monotonic()
    ok, out = host.run_shell_command(
        programs.shell("nginx_reload_wait.sh", float(timeout), float(interval), interpreter="bash"),
        **as_root(),
        _timeout=int(timeout) + 60,
    )
    lines = [
        line.strip() for line in (getattr(out, "stdout_lines", []) or []) + (getattr(out, "stderr_lines", []) or [])
    ]
    if not ok:
        raise RuntimeError(f"{host.name}: nginx -t / reload failed:\n" + "\n".join(lines[-20:]))
    last = next((line for line in reversed(lines) if line.startswith(("drained", "timeout"))), "")
    if last.startswith("timeout"):
        _say(f"WARNING drain: old nginx workers still running after {timeout:.0f} s ({last}); going on")
    else:
        _say(f"nginx reloaded; old workers gone after {time.monotonic() - t0:.1f} s")


def _wait_idle(port: int, timeout: float, interval: float) -> None:
    t0 = time.monotonic()
    last = "no answer"
    while True:
        ok, out = host.run_shell_command(
            programs.argv("curl", "-s", "--max-time", "5", f"http://127.0.0.1:{int(port)}/metrics"), **as_root()
        )
        text = "\n".join(getattr(out, "stdout_lines", []) or [])
        try:
            m = parse_metrics(text) if ok else None
        except ValueError:
            m = None
        if m is None:
            # vLLM is not answering (stopped, or crashed): nothing in flight there to wait for
            _say(f"drain: vLLM on port {port} does not answer /metrics: nothing to drain")
            return
        busy = sum(m.values())
        if busy == 0:
            _say(f"drain: no running or waiting request after {time.monotonic() - t0:.1f} s")
            return
        last = ", ".join(f"{k.split(':')[1]} {v:g}" for k, v in m.items())
        if time.monotonic() - t0 >= timeout:
            _say(f"WARNING drain: still {last} after {timeout:.0f} s; going on (those requests may be cut)")
            return
        time.sleep(interval)


def _smoke(
    py: str,
    port: int,
    model: str,
    secrets: str,
    max_tokens: int,
    timeout: float,
    journal_lines: int,
    unit: str = "vllm.service",
) -> None:
    smoke = programs.python(py, "replica_smoke.py", port, model, secrets, max_tokens, timeout)
    ok, out = host.run_shell_command(smoke, **as_root(), _timeout=int(timeout * 3) + 30)
    lines = [line for line in (getattr(out, "stdout_lines", []) or []) + (getattr(out, "stderr_lines", []) or [])]
    if ok:
        _say(lines[-1] if lines else "replica smoke test passed")
        return
    _, j = host.run_shell_command(
        programs.argv("journalctl", "-u", unit, "-n", int(journal_lines), "--no-pager", "-o", "cat"), **as_root()
    )
    tail = "\n".join(getattr(j, "stdout_lines", []) or [])
    raise RuntimeError(
        f"{host.name}: the replica's own smoke test failed: {' | '.join(lines[-5:])}\n"
        f"Last {journal_lines} journal lines of {unit}:\n{tail}"
    )


# ----------------------------------------------------------------------------------------------


def _sync_router(py: str, port: int, keep: list[str], remove: list[str]) -> None:
    """Make the router's worker list hold exactly ``keep`` (scripts/router_sync.py, with its own Python)."""
    sync = programs.python(py, "router_sync.py", port, json.dumps({"keep": keep, "remove": remove}))
    ok, out = host.run_shell_command(sync, **as_root(), _timeout=180)
    lines = [line for line in (getattr(out, "stdout_lines", []) or []) + (getattr(out, "stderr_lines", []) or [])]
    if not ok:
        raise RuntimeError(f"{host.name}: could not set the router's workers: {' | '.join(lines[-5:])}")
    _say(lines[-1] if lines else "router workers set")


@deploy("Rollout: router workers", data_defaults=DEFAULTS)
@reads(*SECTIONS)
def router_workers(spec: dict[str, Any], where: Paths, workers: list[tuple[str, bool]]):
    """
    ``cache_aware``: the router's worker list (its /remove_worker, /add_worker API on loopback)
    without the instances being updated (``down``) and with every other one. A replica leaves
    the router before it is drained, and comes back only after its own smoke test (the last
    step renders none down). The router's health checks are the fallback for a replica that
    dies on its own, not the rollout's means: they notice only after requests failed.

    + spec: the resolved deployment spec
    + where: where its files live (the layout's: vllm_fleet.render.parts.Paths; the router's venv)
    + workers: ``[(url as the router names it, down)]`` of every replica of the deployment

    **Example:**

    .. code:: python

        router_workers(spec=spec, where=ctx.layout.paths[spec["name"]],
                       workers=[("http://10.10.0.12:8000", True), ("http://127.0.0.1:8000", False)])
    """
    py = f"{where['router_env']}/bin/python"
    python.call(
        name="Router worker list: the batch out, the others in",
        function=_sync_router,
        py=py,
        port=int(spec["proxy"]["routing"]["router"]["port"]),
        keep=[u for u, down in workers if not down],
        remove=[u for u, down in workers if down],
    )


@deploy("Rollout: nginx upstream", data_defaults=DEFAULTS)
@reads(*SECTIONS)
def upstream(spec: dict[str, Any], where: Paths, rendered: dict[str, Any], drain_timeout: float):
    """
    Put this proxy host's nginx site (replicas being updated marked ``down``); on a change:
    ``nginx -t``, reload, wait for the old workers to exit (bounded).

    + spec: the resolved deployment spec
    + where: where its files live (the layout's: vllm_fleet.render.parts.Paths; the nginx site)
    + rendered: this host's rendered files (rendered with the batch marked down)
    + drain_timeout: seconds to wait for the old nginx workers

    **Example:**

    .. code:: python

        upstream(spec=ctx.spec, where=ctx.layout.paths[ctx.first], rendered=rendered_for_host(ctx), drain_timeout=120)
    """
    site = where["nginx_site"]
    if site not in rendered:
        host.noop("no nginx site of this deployment on this host")
        return None
    put = put_rendered(rendered, [site])[site]
    python.call(
        name=f"nginx -t, reload, wait for the old workers (at most {drain_timeout:.0f} s)",
        function=_reload_and_wait,
        timeout=float(drain_timeout),
        interval=float(host.data.get("rollout_poll_interval")),
        _if=put.did_change,
    )
    return put


@deploy("Rollout: drain the replica", data_defaults=DEFAULTS)
@reads(*SECTIONS)
def drain(spec: dict[str, Any], drain_timeout: float, port: int | None = None):
    """
    Wait until a vLLM instance on this host has no running and no waiting request (bounded).

    + spec: the resolved deployment spec
    + drain_timeout: seconds to wait at most
    + port: the instance's port (from the layout; default server.port)

    **Example:**

    .. code:: python

        drain(spec=ctx.spec, drain_timeout=120)
    """
    port = int(port or spec["server"]["port"])
    python.call(
        name=f"Wait for vLLM's running/waiting requests on port {port} to reach 0 (at most {drain_timeout:.0f} s)",
        function=_wait_idle,
        port=port,
        timeout=float(drain_timeout),
        interval=float(host.data.get("rollout_poll_interval")),
    )


@deploy("Rollout: the replica's own smoke test", data_defaults=DEFAULTS)
@reads(*SECTIONS)
def smoke_replica(spec: dict[str, Any], where: Paths, port: int | None = None, unit: str = "vllm.service"):
    """
    Smoke-test a vLLM instance on this host directly (not through the proxy): health, models, a
    chat, a streamed chat.

    + spec: the resolved deployment spec
    + where: where its files live (the layout's: vllm_fleet.render.parts.Paths; the env's Python, the key's env file)
    + port: the instance's port (from the layout; default server.port)
    + unit: its unit (for the journal tail on failure)

    **Example:**

    .. code:: python

        smoke_replica(spec=ctx.spec, where=ctx.layout.paths[ctx.first])
    """
    port = int(port or spec["server"]["port"])
    python.call(
        name=f"Smoke test of the replica itself (127.0.0.1:{port} on the host)",
        function=_smoke,
        py=where["python"],
        port=port,
        model=spec["model"]["served_name"],
        unit=unit,
        secrets=where["secrets_env"],
        max_tokens=int(host.data.get("rollout_smoke_max_tokens")),
        timeout=float(host.data.get("rollout_smoke_timeout")),
        journal_lines=int(host.data.get("rollout_journal_lines")),
    )
