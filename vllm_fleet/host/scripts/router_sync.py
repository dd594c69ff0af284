"""Runs on the proxy host with the router's own Python, from the rollout role: makes the router's
worker list hold exactly ``keep`` (of the deployment's workers) and prints what it did; exit 1
naming what failed.

    python router_sync.py PORT '{"keep": [url], "remove": [url]}'
"""

import json, sys, urllib.parse, urllib.request

port, want = int(sys.argv[1]), json.loads(sys.argv[2])
base = f"http://127.0.0.1:{port}"


def call(method, path, **q):
    url = base + path + ("?" + urllib.parse.urlencode(q) if q else "")
    with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=60) as r:
        return r.read().decode()


try:
    listed = set(json.loads(call("GET", "/list_workers")).get("urls") or [])
    done = []
    for u in want["remove"]:
        if u in listed:
            call("POST", "/remove_worker", url=u)
            done.append(f"removed {u}")
    for u in want["keep"]:
        if u not in listed:
            call("POST", "/add_worker", url=u)
            done.append(f"added {u}")
    now = sorted(json.loads(call("GET", "/list_workers")).get("urls") or [])
    print("router workers: " + (", ".join(done) or "unchanged") + f"; now {now}")
    if set(now) & set(want["remove"]) or set(want["keep"]) - set(now):
        print(f"FAIL the router lists {now}, wanted {sorted(want['keep'])}")
        sys.exit(1)
except Exception as exc:
    print(f"FAIL router {base}: {type(exc).__name__}: {exc}")
    sys.exit(1)
