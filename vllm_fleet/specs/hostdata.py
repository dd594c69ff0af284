"""The host data vllm-fleet reads, declared once (``schemas/hostdata.schema.json``) and checked
like the spec: before anything is rendered and before any host is contacted.

    inventory_problems(inventory) -> ["host gpu1: data replicas_per_host = 'two': ...", ...]

Every problem of every host at once; each names the host, the key, the value, what was expected
and how to write it (the schema's ``x-fix``). :func:`vllm_fleet.render.layout.build` runs this on
every inventory it is given, so validate, render, deploy, diff, down, status, rollout, bench and
tune all refuse the same host data the same way.

Addresses: ``private_address`` is an IPv4 address (``ipaddress``), ``ssh_hostname`` an IPv4
address or a DNS host name (:func:`is_address_or_hostname`); nothing else reaches nginx, nftables,
Prometheus or a URL.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import jsonschema

SCHEMA_PATH = Path(__file__).resolve().parent / "schemas" / "hostdata.schema.json"

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")


@lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())


def is_ipv4(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        return False
    return True


def is_hostname(value: Any) -> bool:
    """A DNS host name (RFC 1123 labels, at most 253 characters); not one that only looks like
    a broken IPv4 address (``300.1.2.3``, ``01.2.3.4``, ``1``)."""
    if not isinstance(value, str) or not 0 < len(value) <= 253 or not HOSTNAME.fullmatch(value):
        return False
    return not re.fullmatch(r"[0-9.]+", value)


def is_address_or_hostname(value: Any) -> bool:
    return is_ipv4(value) or is_hostname(value)


def _is_ipv4_network(value: Any) -> bool:
    if not isinstance(value, str):
        return True  # the type check says so
    try:
        ipaddress.IPv4Network(value, strict=False)
    except ValueError:
        return False
    return True


def _is_integer(checker: Any, instance: Any) -> bool:
    # 2.0 is not a replica count: nginx, systemd and Ray read "2.0" as text
    return isinstance(instance, int) and not isinstance(instance, bool)


@lru_cache(maxsize=1)
def _validator() -> Any:
    base = jsonschema.validators.validator_for(schema())
    cls = jsonschema.validators.extend(base, type_checker=base.TYPE_CHECKER.redefine("integer", _is_integer))
    formats = copy.deepcopy(base.FORMAT_CHECKER)
    formats.checks("ipv4")(lambda v: not isinstance(v, str) or is_ipv4(v))
    formats.checks("ipv4-network")(_is_ipv4_network)
    formats.checks("address-or-hostname")(lambda v: not isinstance(v, str) or is_address_or_hostname(v))
    return cls(schema(), format_checker=formats)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(value: Any) -> str:
    return {
        dict: "a mapping",
        list: "a list",
        tuple: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def host_problems(host: str, data: Mapping[str, Any]) -> list[str]:
    """The problems of one host's data (empty: fine)."""
    if not isinstance(data, Mapping):
        return [f"host {host}: its data is {_type_name(data)}, not a mapping of keys to values"]
    props = schema()["properties"]
    doc = {k: data[k] for k in props if k in data and data[k] is not None}
    by_key: dict[str, list[jsonschema.ValidationError]] = {}
    try:
        errors = list(_validator().iter_errors(doc))
    except (TypeError, ValueError, RecursionError):  # a value JSON Schema cannot even look at
        return [f"host {host}: data {k} = {_short(doc[k])}: expected {props[k]['x-fix']}" for k in doc]
    for err in errors:
        key = str(err.absolute_path[0]) if err.absolute_path else ""
        by_key.setdefault(key, []).append(err)
    out = []
    for key in [k for k in props if k in by_key]:
        value = doc[key]
        best = jsonschema.exceptions.best_match(by_key[key])
        where = key + "".join(f"[{p!r}]" for p in list(best.absolute_path)[1:])
        got = _short(best.instance) + (f" ({_type_name(best.instance)})" if best.validator in ("type", "oneOf") else "")
        out.append(
            f"host {host}: data {where} = {got}: expected {props[key]['x-fix']}"
            + ("" if where == key else f" (the whole value: {_short(value)})")
        )
    return out


def inventory_problems(inventory: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Every host's problems ({host: {"data": ...}}, as :func:`vllm_fleet.specs.inventory.load_inventory` gives)."""
    out: list[str] = []
    for host, h in inventory.items():
        out += host_problems(str(host), (h or {}).get("data") or {})
    return out


#: pyinfra's connector for the control machine itself (``pyinfra @local ...``): the workstation.
LOCAL = "@local"


def is_local(name: Any) -> bool:
    """Whether the inventory host ``name`` is this machine through pyinfra's ``@local`` connector."""
    return name == LOCAL


#: The groups a host given inline (``vllm-fleet deploy @local``, ``user@host``, ``h1,h2``) is in:
#: the one part such a host can be told to run without an inventory file (vllm_fleet.render.parts).
INLINE_GROUPS = ("servers",)


def inline_groups(groups: Any) -> list[str]:
    """A host's groups as the layout reads them: those of its inventory file, or for a host given
    inline (no group but pyinfra's connector groups, ``@local``; a file always gives its hosts at
    least the file's own group) :data:`INLINE_GROUPS` added."""
    groups = list(groups or [])
    if all(str(g).startswith("@") for g in groups):
        return [*dict.fromkeys(groups), *(g for g in INLINE_GROUPS if g not in groups)]
    return groups


def _login(name: str) -> tuple[str | None, str, int | None]:
    """``user@host:port`` (pyinfra's SSH shorthand in a host name) -> (user, host, port)."""
    if name.startswith("@") or "@" not in name:
        return None, name, None
    user, _, hostport = name.rpartition("@")
    host, port = hostport, None
    if hostport.count(":") == 1 and hostport.rsplit(":", 1)[1].isdigit():
        host, port = hostport.rsplit(":", 1)[0], int(hostport.rsplit(":", 1)[1])
    return user or None, host, port


def login_data(name: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """The host data with what a ``user@host[:port]`` name says (``ssh_user``, ``ssh_port``) where
    the data does not say it: pyinfra's SSH connector reads them from the name, vllm-fleet's
    transport (sudo or not) and checks from the data."""
    out = dict(data) if isinstance(data, Mapping) else data
    user, _, port = _login(name)
    if isinstance(out, dict):
        if user and "ssh_user" not in out:
            out["ssh_user"] = user
        if port and "ssh_port" not in out:
            out["ssh_port"] = port
    return out


def host_address(name: str, data: Mapping[str, Any]) -> str:
    """Where vllm-fleet and clients reach a host: ``ssh_hostname``, else its name (``user@host``:
    the host; pyinfra's ``@local`` connector: the control machine itself, 127.0.0.1)."""
    address = data.get("ssh_hostname") if isinstance(data, Mapping) else None
    if address:
        return str(address)
    if is_local(name):
        return "127.0.0.1"
    return _login(str(name))[1]
