"""Runs on a host for `vllm-fleet status` with the system's python3 (standard library only): one
JSON object with the installed vLLM version and, per instance, its unit's state as systemd keeps
it and what it answers on its port. Reads only.

    python3 status_probe.py ENV_PYTHON PACKAGE SECRETS_ENV UNIT:PORT [UNIT:PORT ...]

{"version": "0.32.0" | null, "instances": [{"unit", "port", "active", "sub", "load", "enabled",
 "restarts", "active_for_s", "health", "models"}]}: ``health`` the HTTP code of /health (null: no
answer), ``models`` the ids /v1/models lists (the key read from SECRETS_ENV, never an argument),
``active_for_s`` seconds since the unit last became active (null when it is not).
"""

import json, os, subprocess, sys, time, urllib.error, urllib.request

# vllm-fleet: include api_key.py
env_python, package, secrets = sys.argv[1], sys.argv[2], sys.argv[3]
out = {"version": None, "instances": []}
try:
    v = subprocess.run(
        [env_python, "-c", "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))", package],
        capture_output=True,
        text=True,
        timeout=30,
    )
    out["version"] = v.stdout.strip() or None if v.returncode == 0 else None
except (OSError, subprocess.TimeoutExpired):
    pass
try:
    key = api_key(secrets)
except OSError:
    key = None
now = time.monotonic()  # CLOCK_MONOTONIC, as systemd's *TimestampMonotonic
for arg in sys.argv[4:]:
    unit, _, port = arg.rpartition(":")
    props = {}
    try:
        show = subprocess.run(
            [
                "systemctl",
                "show",
                unit,
                "-p",
                "LoadState,ActiveState,SubState,UnitFileState,NRestarts,ActiveEnterTimestampMonotonic",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        show = ""
    for line in show.splitlines():
        k, _, val = line.partition("=")
        props[k] = val
    entered = int(props.get("ActiveEnterTimestampMonotonic") or 0)
    inst = {
        "unit": unit,
        "port": int(port),
        "load": props.get("LoadState"),
        "active": props.get("ActiveState"),
        "sub": props.get("SubState"),
        "enabled": props.get("UnitFileState"),
        "restarts": int(props.get("NRestarts") or 0) if (props.get("NRestarts") or "0").isdigit() else 0,
        "active_for_s": round(now - entered / 1e6, 1) if entered and props.get("ActiveState") == "active" else None,
        "health": None,
        "models": [],
    }
    hdr = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/health"), timeout=5) as r:
            inst["health"] = r.status
    except urllib.error.HTTPError as exc:
        inst["health"] = exc.code
    except OSError:
        pass
    try:
        with urllib.request.urlopen(
            urllib.request.Request(f"http://127.0.0.1:{port}/v1/models", headers=hdr), timeout=5
        ) as r:
            inst["models"] = [m["id"] for m in json.load(r).get("data", [])]
    except (OSError, ValueError):
        pass
    out["instances"].append(inst)
print(json.dumps(out))
