#!/usr/bin/env python3
"""The liveness probe of a deployment's vLLM replicas on this host (server.liveness), run by its
timer every `period` seconds (vllm-fleet-liveness-NAME.timer -> .service, Type=oneshot, root).

    vllm-liveness STATE_DIR TIMEOUT FAILURES UNIT=PORT [UNIT=PORT ...]

For each replica: its unit's ActiveState and InvocationID (systemctl show), then
http://127.0.0.1:PORT/health with TIMEOUT seconds. A unit that is not active is left alone
(systemd restarts a vLLM that exits; a stopped one was stopped on purpose: a rollout, `down`).
A replica not yet healthy since its unit started (its InvocationID) is still loading: not
counted. One that was healthy and then fails FAILURES probes in a row (no answer in time, or
not 200) is restarted (`systemctl restart --no-block`) and said so on stdout (the journal of
this unit). Counts live in STATE_DIR (the unit's RuntimeDirectory: one JSON file per replica).
Rendered by vllm-fleet; standard library only.
"""

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request


def unit_state(unit):
    """(ActiveState, InvocationID) of ``unit``, as systemd says."""
    out = subprocess.run(
        ["systemctl", "show", "--property=ActiveState", "--property=InvocationID", unit],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return props.get("ActiveState", ""), props.get("InvocationID", "")


def health(port, timeout):
    """None when /health answers 200 within ``timeout`` seconds, else why not."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout) as r:
            return None if r.status == 200 else f"HTTP {r.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except OSError as exc:  # refused, reset, timed out (socket.timeout is an OSError)
        reason = getattr(exc, "reason", exc)
        return f"no answer within {timeout:g} s ({reason})"


def probe(state_dir, timeout, failures, unit, port):
    path = os.path.join(state_dir, unit + ".json")
    try:
        with open(path) as f:
            seen = json.load(f)
    except (OSError, ValueError):
        seen = {}
    active, invocation = unit_state(unit)
    if active != "active":
        seen = {}  # stopped, failed or (re)starting: systemd's business
    else:
        if seen.get("invocation") != invocation:
            seen = {"invocation": invocation, "healthy": False, "failed": 0}
        why = health(port, timeout)
        if why is None:
            seen["healthy"], seen["failed"] = True, 0
        elif seen["healthy"]:
            seen["failed"] += 1
            print(f"{unit}: /health on port {port}: {why} ({seen['failed']} of {failures} in a row)", flush=True)
            if seen["failed"] >= failures:
                print(f"{unit}: restarting it: {failures} failed liveness probes in a row", flush=True)
                subprocess.run(["systemctl", "restart", "--no-block", unit], check=False)
                seen = {}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(seen, f)
    os.replace(tmp, path)


def main(argv):
    state_dir, timeout, failures = argv[0], float(argv[1]), int(argv[2])
    for arg in argv[3:]:
        unit, port = arg.rsplit("=", 1)
        probe(state_dir, timeout, failures, unit, int(port))


if __name__ == "__main__":
    main(sys.argv[1:])
