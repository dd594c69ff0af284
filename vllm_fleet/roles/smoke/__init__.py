"""Smoke tests from the control machine through the proxy, at the end of every deploy.

The checks (vllm_fleet.serving.smoke): /health 200; /v1/models lists the served name; a chat completion
has content and usage; a streamed chat arrives incrementally and ends with [DONE]; no key or a
wrong key gets 401; a few concurrent requests succeed. Any failure fails the deploy, naming the
check and the URL. Prints TTFT and total time, and writes the client settings file.

When a streamed chat through the proxy arrives all at once and this host runs vLLM too, the same
chat is streamed straight from vLLM on the host (127.0.0.1, the key read there from secrets.env)
to tell a buffering proxy (fail) from a vLLM that sent its stream in one burst (WARN).

A smoke test is a check, not a change: it runs while pyinfra executes and, when it passes, its
operation has no command, so an unchanged fleet reports no change (with or without `-y`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pyinfra import host, logger, state
from pyinfra.api import FunctionCommand, deploy, operation

from vllm_fleet.host import programs
from vllm_fleet.render.parts import Paths
from vllm_fleet.roles.common import as_root
from vllm_fleet.specs.sections import reads

from .defaults import DEFAULTS

#: The spec sections this role reads (vllm_fleet.specs.sections); its README lists them.
SECTIONS = ("name", "install", "model", "proxy", "server", "smoke")


def endpoint(spec: dict[str, Any], address: str) -> str:
    prx, srv = spec["proxy"], spec["server"]
    if prx["enabled"]:
        scheme = "https" if prx["tls"]["enabled"] else "http"
        default = 443 if scheme == "https" else 80
        port = "" if prx["listen"] == default else f":{prx['listen']}"
        return f"{scheme}://{address}{port}"
    return f"http://{address}:{srv['port']}"


def host_header_for(spec: dict[str, Any]) -> str | None:
    """The ``Host`` the smoke tests send through the proxy: ``proxy.server_name`` when it is a
    name (not ``_``), else none (the URL's own host)."""
    prx = spec["proxy"]
    name = prx["server_name"]
    return name if prx["enabled"] and name != "_" else None


def _compare_on_host(
    python: str,
    secrets_env: str,
    spec: dict[str, Any],
    timeout: float,
    port: int,
    base_url: str,
    host_header: str | None,
):
    """A ``compare_on_host`` for vllm_fleet.serving.smoke: the same chat streamed on this host through
    its proxy (``base_url``) and straight from vLLM on ``port``, in turns (smoke.HOST_PAIRS each)."""
    from vllm_fleet.serving.smoke import HOST_PAIRS, SmokeError

    def compare(max_tokens: int) -> dict[str, list]:
        run = programs.python(
            python,
            "direct_stream.py",
            int(port),
            spec["model"]["served_name"],
            secrets_env,
            int(max_tokens),
            float(timeout),
            base_url,
            host_header or "-",
            HOST_PAIRS,
        )
        _, out = host.run_shell_command(run, **as_root(), _timeout=int(timeout) + 30)
        lines = getattr(out, "stdout_lines", []) or []
        try:
            result = json.loads(lines[-1])
        except (IndexError, ValueError):
            err = " ".join((getattr(out, "stderr_lines", []) or [])[-3:])
            raise SmokeError(f"the streams on {host.name} printed no result ({err or 'no output'})") from None
        if "error" in result:
            raise SmokeError(f"the streams on {host.name}: {result['error']}")
        return result

    return compare


def _run(
    spec: dict[str, Any],
    base_url: str,
    api_key: str | None,
    timeout: float,
    settings_path: str,
    stream_tokens: int = 64,
    direct_python: str | None = None,
    direct_port: int | None = None,
    direct_secrets: str = "",
) -> None:
    from vllm_fleet.serving.smoke import smoke_checks, wait_healthy, wait_serving

    sm = spec["smoke"]
    verify = False if spec["proxy"]["tls"]["self_signed"] else True
    # several deployments may share one nginx port, told apart by proxy.server_name: the URL
    # names the host's address, so the name goes in the Host header (else nginx answers with
    # the port's default site, another deployment's)
    host_header = host_header_for(spec)
    # nginx reloads gracefully: old workers finish with the old config for a moment. Wait until
    # the endpoint answers /health (fresh connections) before judging it.
    wait_healthy(f"{base_url}/health", deadline_s=30, verify=verify, interval=0.5, host_header=host_header)
    # /health answers on old and new nginx workers alike: wait until the key is accepted (the new
    # site is live) before judging; a real auth problem still fails the checks below.
    wait_serving(base_url, api_key, deadline_s=30, verify=verify, host_header=host_header)
    res = smoke_checks(
        base_url,
        spec["model"]["served_name"],
        api_key,
        prompt=sm["prompt"],
        max_tokens=sm["max_tokens"],
        concurrency=sm["concurrency"],
        expect_auth=bool(api_key) and spec["proxy"]["auth"] != "none",
        verify=verify,
        timeout=timeout,
        stream_tokens=stream_tokens,
        compare_on_host=_compare_on_host(
            direct_python, direct_secrets, spec, timeout, direct_port or spec["server"]["port"], base_url, host_header
        )
        if direct_python
        else None,
        host_header=host_header,
    ).raise_for_failures()
    logger.info(res.summary())
    write_client_settings(settings_path, client_document(spec), res)


def client_document(spec: dict[str, Any]) -> dict[str, Any]:
    """This deployment's ``openai.json`` as the deploy's layout renders it (base URL, model, where
    the key is, the routing policy in effect: vllm_fleet.render.files.client_settings)."""
    from vllm_fleet.roles.common import load_deploy_spec

    layout = load_deploy_spec().layout
    return json.loads(layout.client[layout.paths[spec["name"]]["client_json"]].content)


def write_client_settings(settings_path: str, document: dict[str, Any], res: Any) -> None:
    """The client settings on the control machine: the rendered ``document`` with the smoke
    tests' timings under ``smoke``, written by render's one ``openai.json`` writer."""
    from vllm_fleet.render.files import client_json

    doc = {
        **document,
        "smoke": {
            "ttft_ms": round(res.ttft_s * 1000, 1) if res.ttft_s else None,
            "chat_total_ms": round(res.chat_total_s * 1000, 1) if res.chat_total_s else None,
        },
    }
    p = Path(os.path.expanduser(settings_path))
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(client_json(doc))


def _fail(message: str) -> None:
    raise RuntimeError(message)


@operation()
def smoke_tests(
    spec: dict[str, Any],
    base_url: str,
    api_key: str | None,
    timeout: float,
    settings_path: str,
    stream_tokens: int = 64,
    direct_python: str | None = None,
    direct_port: int | None = None,
    direct_secrets: str = "",
):
    """
    Run the smoke tests against ``base_url`` from the control machine.

    A check, not a change: the tests run while pyinfra executes the operation; when they pass
    the operation has no command (pyinfra reports "No change"), when one fails it yields a
    command that fails the host with what failed and where.

    + spec: the resolved deployment spec
    + base_url: the endpoint (through the proxy), e.g. http://10.10.0.11
    + api_key: the key to use (never printed)
    + timeout: seconds per request
    + settings_path: where to write the client settings JSON on the control machine
    + stream_tokens: tokens of the streamed check (ignore_eos)
    + direct_python: vLLM's Python on this host; given, when every stream through the proxy arrives
      at once, streams through the proxy and straight from vLLM are compared here, in turns
      (buffering proxy: fail; vLLM bursts: WARN)
    + direct_port: the port of that local vLLM instance (default server.port)
    + direct_secrets: the env file on this host that holds the key of that stream (secrets.env)

    **Example:**

    .. code:: python

        smoke_tests(spec=spec, base_url="http://10.10.0.11", api_key=key, timeout=120,
                    settings_path="~/.config/vllm-fleet/lab-tiny/openai.json")
    """
    if not state.is_executing:
        host.noop(f"smoke tests against {base_url} run when the deploy executes")
        return
    try:
        _run(spec, base_url, api_key, timeout, settings_path, stream_tokens, direct_python, direct_port, direct_secrets)
    except Exception as exc:  # SmokeError names the check and URL; anything else, say so
        yield FunctionCommand(_fail, (f"{host.name}: {exc}",), {})


def replica_chat_query(spec: dict[str, Any], where: Paths, port: int) -> str:
    """The host-state ``chat`` argument of one replica's short chat (vllm_fleet.roles.common.state;
    the key is read on the host from the deployment's secrets.env, ``where``: the layout's paths)."""
    from vllm_fleet.serving.smoke import REPLICA_CHAT_TOKENS

    return f"{int(port)} {where['secrets_env']} {spec['model']['served_name']} {REPLICA_CHAT_TOKENS}"


def chat_on_host(spec: dict[str, Any], where: Paths, port: int) -> tuple[str, str]:
    """One short chat with the replica on ``port`` of this host, run there now (host_state.sh's
    ``chat``: the key from secrets.env, never in a command line): ``(HTTP code, body)``."""
    from vllm_fleet.host.state import HostState, Query, Snapshot

    q = Query(chats=(replica_chat_query(spec, where, port),))
    _, out = host.run_shell_command(HostState().command(q), **as_root(), _timeout=90)
    snap = Snapshot.parse(getattr(out, "stdout_lines", []) or [])
    snap.query = q
    return snap.chat(port) or ("", "")


def _replica_fail(message: str) -> None:
    raise RuntimeError(message)


@operation()
def replica_chat(spec: dict[str, Any], where: Paths, unit: str, port: int):
    """
    Prove one replica serves on its host: its short chat (HTTP 200, the served model, a message,
    completion tokens), straight at vLLM on 127.0.0.1. The answer comes from the host's state
    read (vllm_fleet.roles.common.state, ``chats``: no command of its own, so a no-op deploy stays
    a no-op), else it is asked now. A check, not a change: no command when it passes; a failure
    fails the host naming the replica, its port and what was wrong.

    + spec: the resolved deployment spec
    + where: where its files live (the layout's: vllm_fleet.render.parts.Paths; the key's env file)
    + unit: the replica's systemd unit (named in a failure)
    + port: the replica's port on this host

    **Example:**

    .. code:: python

        replica_chat(name="vllm-x-0.service answers a chat", spec=spec, where=where, unit="vllm-x-0.service", port=8000)
    """
    from vllm_fleet.roles.common.state import host_state
    from vllm_fleet.serving.smoke import judge_replica_chat

    seen = host_state().chat(port)
    if not state.is_executing:
        host.noop(
            f"{unit}: one short chat on port {port} "
            + ("(read with the host's state)" if seen else "when the deploy executes")
        )
        return
    code, body = seen if seen is not None else chat_on_host(spec, where, port)
    why = judge_replica_chat(code, body, spec["model"]["served_name"])
    if why:
        yield FunctionCommand(
            _replica_fail,
            (
                f"{host.name}: replica {unit} (port {port}) does not serve: its short chat on the host "
                f"-> {why}; look: journalctl -u {unit}",
            ),
            {},
        )


@deploy("Smoke tests", data_defaults=DEFAULTS)
@reads(*SECTIONS)
def run_smoke(
    spec: dict[str, Any],
    where: Paths,
    api_key: str | None,
    address: str | None = None,
    local_port: int | None = None,
):
    """
    Smoke-test the deployment through this host's proxy (or vLLM itself when the proxy is off).

    + spec: the resolved deployment spec
    + where: where its files live (the layout's: vllm_fleet.render.parts.Paths; vLLM's Python, the key's env file)
    + api_key: the API key's value
    + address: the address to reach this host at (default: its ssh_hostname or name)
    + local_port: the port of a vLLM instance of this deployment on this host (from the layout),
      for the direct-stream comparison; None: none runs here

    **Example:**

    .. code:: python

        run_smoke(spec=ctx.spec, where=ctx.layout.paths[ctx.first], api_key=ctx.secrets["api_key"])
    """
    if not spec["smoke"]["enabled"]:
        host.noop("smoke tests disabled in the spec (smoke.enabled: false)")
        return
    addr = address or host.data.get("ssh_hostname") or host.name
    smoke_tests(
        name=f"Smoke tests through {endpoint(spec, addr)}",
        spec=spec,
        base_url=endpoint(spec, addr),
        api_key=api_key,
        timeout=host.data.get("smoke_timeout"),
        settings_path=str(host.data.get("smoke_client_settings")).format(name=spec["name"]),
        # within the model's context (half of max_model_len at most)
        stream_tokens=max(16, min(int(host.data.get("smoke_stream_tokens")), int(spec["model"]["max_model_len"]) // 2)),
        # this host runs vLLM too: a stream that arrives at once is compared with one straight from it
        direct_python=where["python"] if local_port and spec["proxy"]["enabled"] else None,
        direct_port=local_port,
        direct_secrets=where["secrets_env"],
    )
