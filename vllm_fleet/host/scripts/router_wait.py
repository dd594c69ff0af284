"""Runs on the proxy host with the system's python3, from the router role: wait until vLLM's
router lists its workers on loopback (it serves once its startup wait is over); print what it
lists; exit 1 after TIMEOUT seconds (the role then prints the unit's journal).

    python3 router_wait.py PORT TIMEOUT
"""

import json, sys, time, urllib.request

port, timeout = int(sys.argv[1]), float(sys.argv[2])
deadline = time.time() + timeout
last = ""
while time.time() < deadline:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/list_workers", timeout=3) as r:
            print("router up:", json.loads(r.read()).get("urls"))
            sys.exit(0)
    except Exception as exc:
        last = str(exc)
    time.sleep(0.5)
print(f"the router did not answer on 127.0.0.1:{port} within {timeout} s:", last, file=sys.stderr)
sys.exit(1)
