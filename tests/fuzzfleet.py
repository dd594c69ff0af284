"""Fleet fuzzing (issue 21): inventories and host data, shared by tests/test_fuzz_specs.py (CI: a
fixed seed, a bounded count) and bench/fuzz_fleet.py (thousands, by hand).

A case is one or two example specs (with a port or name moved) on an inventory of one to four
hosts: TEST-NET addresses (192.0.2.0/24) only, never connected to; random groups (servers,
workers, proxy, monitoring, an unrelated one); host data for every key vllm-fleet reads, valid or
hostile: addresses with `;`, `}`, a newline, a space or a port, wrong types, out-of-range and
huge numbers (``replicas_per_host: 10**9``), allow lists that overlap or hold 0.0.0.0/0.
:func:`check` builds the layout (:func:`vllm_fleet.render.layout.build`, what every command runs
on the inventory the reader gives) under an alarm and classifies:

* ``refused``: :class:`LayoutError`, every line naming a host, a spec or the inventory;
* ``accepted``: every rendered file passes its independent reader (``nginx -t`` on each site,
  ``nft -c`` on each firewall, ``systemd-analyze verify`` on each unit, ``promtool check config``
  on Prometheus' config), every Prometheus target and blackbox probe reaches its host through the
  firewalls and nginx allow lists the same render wrote there (tests/scrapecheck.py), no token of any file holds a
  marker of the host data without the
  special character before it, and every nginx upstream server is an inventory address;
* anything else is a finding: ``traceback``, ``hang`` (past the alarm), ``bad-refusal``,
  ``broken-render``, ``injected``, ``altered``, ``unwired`` (a scrape those files refuse).
"""

from __future__ import annotations

import copy
import ipaddress
import re
import shutil
import signal
import subprocess
import traceback
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

import fuzzspecs
import scrapecheck
from vllm_fleet.render import files as render
from vllm_fleet.render import monitoring
from vllm_fleet.render.layout import LayoutError, build
from vllm_fleet.specs import load as specmod

REPO = Path(__file__).resolve().parent.parent
SPECS = [
    "lab-tiny",
    "lab-tiny-monitoring",
    "lab-tiny-replicas",
    "lab-tiny-pp2",
    "h200-qwen7b-bf16",
    "8xh100-qwen7b-tp2x4",
    "2node-ray-pp2",
    "lab-tiny-routing",
]
GROUPS = ["servers", "workers", "proxy", "monitoring", "ray_workers", "other"]
SPECIAL = [";", "}", "{", "\n", " ", "#", ":8000", "$", "'", '"', "\x00", "/24"]
TIMEOUT = 10  # s for one case: a layout that takes longer is a hang


def _resolved(stem: str) -> dict[str, Any]:
    return specmod.resolve(specmod.load(REPO / "deployments" / f"{stem}.yaml"))


RESOLVED = {s: _resolved(s) for s in SPECS}


def _addr(i: int) -> str:
    return f"192.0.2.{10 + i}"


@st.composite
def hostile_string(draw: Any, marker: str) -> str:
    base = draw(st.sampled_from(["192.0.2.5", "gpu1", "10.0.0.0/24", "", "eth1"]))
    return base + draw(st.sampled_from(SPECIAL)) + marker


VALUES: dict[str, Any] = {
    "private_address": lambda i: st.one_of(
        st.just(_addr(i)), st.just(f"10.10.0.{11 + i}"), st.sampled_from([-1, 1.5, [], "300.1.1.1", "01.2.3.4"])
    ),
    "ssh_hostname": lambda i: st.one_of(
        st.just(_addr(i)), st.sampled_from(["gpu1.example", "-bad", "1", "a_b", 7, "192.0.2.1:22"])
    ),
    "replicas_per_host": lambda i: st.one_of(
        st.integers(-3, 20),
        st.sampled_from([10**7, 10**9, "two", 2.0, True, {"lab-tiny": 2}, {"lab-tiny": 0}, {"Bad Name": 1}, []]),
    ),
    "deployments": lambda i: st.one_of(
        st.sampled_from([["lab-tiny"], ["qwen7b-tp2x4"], ["lab-tiny", "qwen7b-tp2x4"], []]),
        st.sampled_from(["lab-tiny", 1.0, [1], ["lab-tiny", "lab-tiny"]]),
    ),
    "cpu_count": lambda i: st.one_of(st.integers(-2, 70), st.sampled_from(["lots", 2.5, 10**9])),
    "vllm_api_firewall_allow": lambda i: st.one_of(
        st.lists(
            st.sampled_from(["192.0.2.0/24", "192.0.2.10", "0.0.0.0/0", "10.0.0.0/8", "10.10.0.11", "127.0.0.1"]),
            max_size=4,
        ),
        st.sampled_from([10, "10.0.0.0/8", ["10.0.0.0/33"], ["::1"], [None]]),
    ),
    "ray_firewall_allow": lambda i: st.one_of(
        st.lists(st.sampled_from(["192.0.2.0/24", "10.10.0.0/24", "0.0.0.0/0", "10.10.0.12"]), max_size=3),
        st.sampled_from(["x", [1]]),
    ),
    "ray_memory_bytes": lambda i: st.sampled_from([8 << 30, "8G", -1, 0, 2**70]),
    "ray_object_store_bytes": lambda i: st.sampled_from([2 << 30, 1, "2G", -5]),
    "socket_ifname": lambda i: st.sampled_from(["eth1", "eth1;x", "a" * 16, 3]),
    "upstream_down": lambda i: st.sampled_from([True, False, "yes", 1]),
    "vllm_api_firewall": lambda i: st.sampled_from([True, False, "no"]),
}


#: Values a careful user writes (half the hosts only have these: accepted layouts get read back).
VALID: dict[str, Any] = {
    "private_address": lambda i: st.sampled_from([f"10.10.0.{11 + i}", _addr(i)]),
    "replicas_per_host": lambda i: st.one_of(st.integers(1, 4), st.just({"lab-tiny": 2})),
    "deployments": lambda i: st.sampled_from(
        [["lab-tiny"], ["qwen7b-tp2x4"], ["lab-tiny", "qwen7b-tp2x4"], ["lab-tiny-pp2"]]
    ),
    "cpu_count": lambda i: st.integers(1, 64),
    "vllm_api_firewall_allow": lambda i: st.lists(
        st.sampled_from(["192.0.2.0/24", "192.0.2.10", "0.0.0.0/0", "10.10.0.11"]), max_size=3
    ),
    "ray_firewall_allow": lambda i: st.lists(
        st.sampled_from(["192.0.2.0/24", "10.10.0.0/24", "0.0.0.0/0", "10.10.0.12"]), max_size=3
    ),
    "socket_ifname": lambda i: st.just("eth1"),
    "upstream_down": lambda i: st.booleans(),
}


@st.composite
def fleets(draw: Any) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]], dict[str, set[str]]]:
    """(resolved specs, inventory {host: {address, groups, data}}, markers {marker: {special}})."""
    names = draw(st.lists(st.sampled_from(SPECS), min_size=1, max_size=2, unique=True))
    specs = []
    for k, stem in enumerate(names):
        r = copy.deepcopy(RESOLVED[stem])
        if k and draw(st.booleans()):  # the second deployment moved off the first's ports
            r["server"]["port"] = int(r["server"]["port"]) + 100
            r["proxy"]["listen"] = int(r["proxy"]["listen"]) + 1
        if draw(st.integers(0, 9)) == 0:
            r["server"]["port"] = draw(st.sampled_from([65535, 65530, 9090, 9100, 10001, 6380]))
        if draw(st.integers(0, 2)) == 0:  # vLLM beyond loopback (a proxy elsewhere reads it; so may Prometheus)
            r["server"]["host"] = "0.0.0.0"
        specs.append(r)
    n = draw(st.integers(1, 4))
    marks: dict[str, set[str]] = {}
    inventory = {}
    for i in range(n):
        name = f"h{i}"
        groups = draw(st.lists(st.sampled_from(GROUPS), min_size=1, max_size=3, unique=True))
        data: dict[str, Any] = {"ssh_hostname": _addr(i)}
        careful = draw(st.booleans())
        for key in draw(st.lists(st.sampled_from(sorted(VALID if careful else VALUES)), max_size=4, unique=True)):
            if careful:
                value = draw(VALID[key](i))
            elif draw(st.integers(0, 4)) == 0 and key in ("private_address", "ssh_hostname", "socket_ifname"):
                marker = f"INJ{len(marks)}Q"
                value = draw(hostile_string(marker))
                marks[marker] = {
                    value[: -len(marker)][-len(sp) :] for sp in SPECIAL if value[: -len(marker)].endswith(sp)
                }
            else:
                value = draw(VALUES[key](i))
            data[key] = value
        address = data["ssh_hostname"] if isinstance(data.get("ssh_hostname"), str) and data["ssh_hostname"] else name
        inventory[name] = {"address": address, "groups": groups, "data": data}
    # monitoring wired across hosts (tests/scrapecheck.py reads it): on for one deployment when a
    # host is in the `monitoring` group, so that the case is not refused for the lack of one
    if (
        any("monitoring" in h["groups"] for h in inventory.values())
        and not any(r["monitoring"]["enabled"] for r in specs)
        and draw(st.booleans())
    ):
        specs[0]["monitoring"]["enabled"] = True
    return specs, inventory, marks


WIRED_SPECS = ["lab-tiny-monitoring", "lab-tiny-replicas", "lab-tiny-routing", "2node-ray-pp2", "h200-qwen7b-bf16"]


@st.composite
def wired_fleets(draw: Any) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]], dict[str, set[str]]]:
    """Monitoring across hosts (round 3, class 4): one deployment with monitoring on, two to four
    hosts whose ssh and private networks differ, the proxy, servers and Prometheus on the same or
    other hosts, vLLM on loopback or beyond, TLS, routing and proxy.metrics_allow varied."""
    r = copy.deepcopy(RESOLVED[draw(st.sampled_from(WIRED_SPECS))])
    r["monitoring"]["enabled"] = True
    r["monitoring"]["health_probe"] = draw(st.booleans())
    if r["parallel"]["pipeline"] == 1 and draw(st.booleans()):
        r["server"]["host"] = draw(st.sampled_from(["0.0.0.0", "127.0.0.1"]))
    r["proxy"]["metrics_allow"] = draw(
        st.lists(
            st.sampled_from(["127.0.0.1", "10.20.0.0/24", "10.20.0.13", "192.0.2.0/24", "10.20.0.11/32"]),
            max_size=3,
            unique=True,
        )
    )
    if draw(st.integers(0, 3)) == 0:
        r["proxy"]["listen"], r["proxy"]["tls"] = 443, {**r["proxy"]["tls"], "enabled": True, "self_signed": True}
    n = draw(st.integers(2, 4))
    inventory = {}
    for i in range(n):
        groups = draw(
            st.lists(
                st.sampled_from(["servers", "workers", "proxy", "monitoring"]), min_size=1, max_size=2, unique=True
            )
        )
        data: dict[str, Any] = {"ssh_hostname": _addr(i), "private_address": f"10.20.0.{11 + i}"}
        if "2node" in r["name"] and "servers" in groups:
            r["parallel"]["head_address"] = data["private_address"]
        inventory[f"h{i}"] = {"address": _addr(i), "groups": groups, "data": data}
    return [r], inventory, {}


class _Alarm(Exception):
    pass


def _on_alarm(signum, frame):  # noqa: ARG001
    raise _Alarm()


class Readers:
    """nginx -t (the spec fuzzer's), nft -c, systemd-analyze verify, promtool check config."""

    def __init__(self, spec_readers: "fuzzspecs.Readers", tmp: Path):
        self.spec = spec_readers
        self.tmp = tmp
        self.nft = shutil.which("nft") or ("/usr/sbin/nft" if Path("/usr/sbin/nft").exists() else None)
        self.promtool = shutil.which("promtool")
        self.n = 0

    def nft_c(self, text: str) -> str | None:
        if not self.nft:
            return None
        self.n += 1
        f = self.tmp / f"fw{self.n}.nft"
        f.write_text(text)
        out = subprocess.run([self.nft, "-c", "-f", str(f)], capture_output=True, text=True, timeout=60)
        f.unlink()
        return None if out.returncode == 0 else out.stderr.strip()[-600:]

    def promtool_config(self, files: dict[str, Any]) -> str | None:
        if not self.promtool or monitoring.PROMETHEUS_CONFIG not in files:
            return None
        self.n += 1
        d = self.tmp / f"prom{self.n}"
        (d / "rules").mkdir(parents=True)
        cfg = yaml.safe_load(files[monitoring.PROMETHEUS_CONFIG].content)
        for p, f in files.items():
            if p.startswith(monitoring.RULES_DIR + "/"):
                (d / "rules" / Path(p).name).write_text(f.content)
        cfg["rule_files"] = [str(d / "rules" / "*.rules.yml")]
        (d / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        out = subprocess.run(
            [self.promtool, "check", "config", str(d / "prometheus.yml")], capture_output=True, text=True, timeout=60
        )
        shutil.rmtree(d, ignore_errors=True)
        return None if out.returncode == 0 else (out.stdout + out.stderr).strip()[-600:]


def _allowed_upstreams(inventory: dict[str, dict[str, Any]]) -> set[str]:
    out = {"127.0.0.1"}
    for h in inventory.values():
        d = h.get("data") or {}
        out.add(str(h.get("address")))
        if d.get("private_address"):
            out.add(str(d["private_address"]))
    return out


def check(
    specs: list[dict[str, Any]],
    inventory: dict[str, dict[str, Any]],
    marks: dict[str, set[str]],
    readers: Readers | None,
) -> fuzzspecs.Outcome:
    Outcome = fuzzspecs.Outcome
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(TIMEOUT)
    try:
        layout = build(copy.deepcopy(specs), copy.deepcopy(inventory))
        targets = layout.files()
    except LayoutError as exc:
        signal.alarm(0)
        names = [*inventory, *(r["name"] for r in specs), "inventory", "spec "]
        for line in exc.problems:
            if not any(re.search(rf"(^|\W){re.escape(n)}(\W|$)", line) for n in names) or len(line) < 30:
                return Outcome("bad-refusal", f"a problem naming no host or spec: {line[:300]}")
        return Outcome("refused", exc.problems[0][:200])
    except _Alarm:
        return Outcome("hang", f"past {TIMEOUT} s")
    except BaseException as exc:  # noqa: BLE001 - that is the finding
        signal.alarm(0)
        return Outcome("traceback", "".join(traceback.format_exception(exc))[-1500:])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    allowed = _allowed_upstreams(inventory)
    nfiles = 0
    for target, files in targets.items():
        for path, rf in files.items():
            nfiles += 1
            for tok in fuzzspecs.tokens_of(path, rf.content):
                for m, specials in marks.items():
                    if m in tok and not any(sp + m in tok for sp in specials):
                        return Outcome("injected", f"{target}:{path}: token {tok[:120]!r} holds {m} without {specials}")
            if path.startswith("/etc/nginx/conf.d/"):
                for addr in re.findall(r"^\s*server\s+([^\s;:]+):\d+", rf.content, re.M):
                    if addr not in allowed:
                        return Outcome("altered", f"{target}:{path}: upstream server {addr!r} is no inventory address")
    scrapes, unwired = scrapecheck.unreachable(targets, inventory)
    if unwired:
        return Outcome("unwired", "; ".join(unwired)[:800])
    if readers is None:
        return Outcome("accepted", files=nfiles, extra={"scrapes": scrapes})
    by_name = {r["name"]: r for r in specs}
    for target, files in targets.items():
        for name, r in by_name.items():
            site = render.NGINX_SITE.format(name=name)
            if site in files:
                if any(not _is_ip(a) for a in re.findall(r"^\s*server\s+([^\s;:]+):\d+", files[site].content, re.M)):
                    continue  # a DNS name upstream: nginx -t would resolve it (offline here)
                auth = f"{render.NGINX_SECRET_DIR}/{name}-auth.conf"
                auths = (
                    [files[auth].content, render.nginx_auth_content(r, "sk-fuzz_Key-123")] if auth in files else [None]
                )
                bad = readers.spec.nginx(files[site].content, auths)
                if bad:
                    return Outcome("broken-render", f"nginx -t {target}: {bad}")
        for path in (render.API_FIREWALL_FILE, render.RAY_FIREWALL_FILE):
            if path in files:
                bad = readers.nft_c(files[path].content)
                if bad:
                    return Outcome("broken-render", f"nft -c {target}:{path}: {bad}")
        units = {p: rf.content for p, rf in files.items() if p.endswith(".service")}
        if units:
            bad = readers.spec.systemd(units, {})
            if bad:
                return Outcome("broken-render", f"systemd-analyze verify {target}: {bad}")
        bad = readers.promtool_config(files)
        if bad:
            return Outcome("broken-render", f"promtool check config {target}: {bad}")
    return Outcome("accepted", files=nfiles, extra={"scrapes": scrapes})


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
