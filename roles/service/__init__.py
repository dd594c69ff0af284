"""The vLLM systemd service: system user, directories, environment files (the API key in a
0600 file), the rendered unit; daemon-reload and restart only when something relevant changed;
then wait until /health answers, with a deadline and the journal tail in the error.
"""

from __future__ import annotations

import shlex
import time
from typing import Any

from pyinfra import host
from pyinfra.facts.server import Command
from pyinfra.api import deploy
from pyinfra.operations import files, python, server, systemd
from pyinfra.operations.util import any_changed

from roles.common import put_rendered, secret_file
from vllm_fleet import command, render

from .defaults import DEFAULTS

UNIT = "vllm.service"


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
    # The system user and directories come from roles.pyenv.service_dirs, which deploys/serve.py
    # runs first (the model role needs them too).
    # Cache and temp directories the unit's environment names (ReadWritePaths must exist).
    state_dir = ins["state_dir"]
    for d in sorted({v for v in command.vllm_env(spec).values() if v.startswith(state_dir + "/")}):
        files.directory(name=f"Directory {d}", path=d, user=srv["user"], group=srv["user"], mode="750")
    if spec["parallel"]["backend"] == "ray" and spec["parallel"]["nodes"] > 1:
        files.directory(name="Ray temp directory", path=render.paths(spec)["ray_tmpdir"], user=srv["user"], group=srv["user"], mode="750")
    if any(p.startswith(ins["prefix"] + "/bin/") for p in rendered):
        files.directory(name="Helper scripts directory", path=f"{ins['prefix']}/bin", user="root", group="root", mode="755")

    unit_paths = [p for p in rendered if p.startswith("/etc/systemd/system/") and p.endswith(UNIT)]
    other = [p for p in rendered if p.startswith(ins["config_dir"] + "/") and not p.endswith("/secrets.env")]
    extra = [p for p in rendered if p.startswith(ins["prefix"] + "/bin/")]
    # Everything the unit names first, the unit last (a kill in between leaves no unit that
    # points at a missing file).
    put = put_rendered(rendered, other + extra)
    secrets_op = secret_file(name="API key (0600, never shown)", path=render.paths(spec)["secrets_env"],
                             content=render.secrets_env_content(spec, api_key) if api_key else "# no API key configured\n")
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
