"""Monitoring across hosts, read from the rendered files alone (held-out fuzzing round 3, class 4).

:func:`unreachable` reads every Prometheus target and blackbox probe of every rendered
prometheus.yml and follows it to the host it names, through what the same render wrote there:

* the address must be a host's private address (host data ``private_address``, else its
  address), or loopback for the monitoring host itself;
* a port that host's nftables tables (API, Ray) drop must be accepted for the scrape's source
  (the monitoring host's private address; loopback is always accepted);
* a port of an nginx site there must be one it listens on at that address, and a path nginx
  guards with ``allow``/``deny all`` (``/metrics``, ``/metrics/N``, ``/health/N``,
  ``/metrics/router``) must allow the source.

It uses nothing of vllm_fleet but the file paths, so it checks the renderer rather than repeating
it: the fuzzers (tests/fuzzfleet.py, tests/fuzzspecs.py) run it on every accepted case.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any
from urllib.parse import urlsplit

import yaml

PROMETHEUS_CONFIG = "/etc/prometheus/prometheus.yml"
FIREWALLS = ("/etc/vllm-fleet/api-firewall.nft", "/etc/vllm-fleet/ray-firewall.nft")
NGINX_SITES = "/etc/nginx/conf.d/"


def scrapes(prometheus_yml: str) -> list[tuple[str, str, int, str, str]]:
    """``[(job, address, port, path, deployment)]`` of every target and probe of a rendered prometheus.yml."""
    cfg = yaml.safe_load(prometheus_yml)
    out = []
    for job in cfg.get("scrape_configs") or []:
        probe = job.get("metrics_path") == "/probe"
        scheme = job.get("scheme", "http")
        for group in job.get("static_configs") or []:
            for t in group.get("targets") or []:
                labels = group.get("labels") or {}
                dep = labels.get("deployment", "")
                if probe:
                    u = urlsplit(t)
                    port = u.port or (443 if u.scheme == "https" else 80)
                    out.append((job["job_name"], u.hostname, port, u.path or "/", dep))
                    continue
                path = labels.get("__metrics_path__") or job.get("metrics_path") or "/metrics"
                host, _, port = t.rpartition(":") if re.search(r":\d+$", t) else (t, "", "")
                out.append(
                    (job["job_name"], host, int(port) if port else (443 if scheme == "https" else 80), path, dep)
                )
    return out


def _in(address: str, networks: list[str]) -> bool:
    """Whether ``address`` is in one of ``networks`` (``all``, an address or a CIDR; a name: itself)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address in networks or "all" in networks
    for n in networks:
        try:
            if n == "all" or ip in ipaddress.ip_network(n, strict=False):
                return True
        except ValueError:
            continue
    return False


def _ports(text: str) -> list[tuple[int, int]]:
    out = []
    for p in re.split(r"[,\s]+", text.strip()):
        if p:
            lo, _, hi = p.partition("-")
            out.append((int(lo), int(hi or lo)))
    return out


def _hit(port: int, ranges: list[tuple[int, int]]) -> bool:
    return any(lo <= port <= hi for lo, hi in ranges)


def firewall_admits(nft: str, source: str, port: int) -> bool:
    """Whether a rendered vllm-fleet nftables table lets ``source`` reach TCP ``port``."""
    sets = {
        m.group(1): [e.strip() for e in m.group(2).split(",") if e.strip()]
        for m in re.finditer(r"set (\w+) \{.*?elements = \{([^}]*)\}", nft, re.S)
    }
    dropped = [_ports(m.group(1)) for m in re.finditer(r"^\s*tcp dport \{([^}]*)\} drop", nft, re.M)]
    if source.startswith("127.") or not any(_hit(port, d) for d in dropped):  # loopback: `iif "lo" accept`
        return True
    for m in re.finditer(r"^\s*ip saddr (@\w+|\{[^}]*\})(?: tcp dport \{([^}]*)\})? accept", nft, re.M):
        who = (
            sets.get(m.group(1)[1:], [])
            if m.group(1).startswith("@")
            else [e.strip() for e in m.group(1)[1:-1].split(",")]
        )
        if _in(source, who) and (m.group(2) is None or _hit(port, _ports(m.group(2)))):
            return True
    return False


def nginx_admits(site: str, address: str, source: str, port: int, path: str) -> bool | None:
    """None when the site does not listen on ``port``; else whether ``source`` may GET ``path``
    there at ``address`` (a guarded location's allow list)."""
    listens = re.findall(r"^\s*listen (\S+?)(?:\s[^;]*)?;", site, re.M)
    ports = {}
    for spec in listens:
        host, _, p = spec.rpartition(":")
        ports[int(p if p else spec)] = host or None
    if port not in ports:
        return None
    if ports[port] not in (None, "*", address):
        return False
    m = re.search(rf"location = {re.escape(path)} \{{(.*?)^    \}}", site, re.S | re.M)
    if not m or "deny all;" not in m.group(1):
        return True
    return _in(source, re.findall(r"allow (\S+);", m.group(1)))


def unreachable(
    targets: dict[str, dict[str, Any]], inventory: dict[str, dict[str, Any]] | None
) -> tuple[int, list[str]]:
    """(scrapes read, problems): every rendered target and probe against the firewalls and allow
    lists of the host it names. ``targets``: {host or part: {path: rendered file}}; ``inventory``
    {host: {address, data}} (None: role mode, every part is one host at 127.0.0.1)."""

    def private(h: str) -> str:
        if inventory is None:
            return "127.0.0.1"
        d = inventory[h].get("data") or {}
        return str(d.get("private_address") or inventory[h].get("address") or h)

    n, problems = 0, []
    for mon, files in targets.items():
        if PROMETHEUS_CONFIG not in files:
            continue
        source = private(mon)
        for job, address, port, path, dep in scrapes(files[PROMETHEUS_CONFIG].content):
            n += 1
            what = f"{mon}: job {job} -> {address}:{port}{path}"
            if address.startswith("127.") or inventory is None:
                hosts, src = ([mon] if inventory is not None else list(targets)), "127.0.0.1"
            else:
                hosts = [h for h in targets if h in (inventory or {}) and private(h) == address]
                src = source
                if not hosts:
                    problems.append(f"{what}: no host has that private address")
                    continue
            merged = {p: f for h in hosts for p, f in targets[h].items()}
            for fw in FIREWALLS:
                if fw in merged and not firewall_admits(merged[fw].content, src, port):
                    problems.append(f"{what}: {fw} there drops {src}")
            for p, f in merged.items():
                if (
                    p == f"{NGINX_SITES}vllm-fleet-{dep}.conf"
                ):  # the deployment's own site (another one may share the port)
                    ok = nginx_admits(f.content, address, src, port, path)
                    if ok is False:
                        problems.append(f"{what}: nginx {p} there refuses {src}")
    return n, problems
