"""Runs on a replica's host as root with the deployment's Python (stdlib only), from the rollout
role: /health, /v1/models and one chat straight from 127.0.0.1:PORT; prints what it checked;
exit 1 naming the failure.

    python replica_smoke.py PORT MODEL SECRETS_ENV MAX_TOKENS TIMEOUT
"""

import json, sys, time, urllib.request

# vllm-fleet: include api_key.py
port, model, secrets, max_tokens, timeout = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
key = api_key(secrets)
base = f"http://127.0.0.1:{port}"
hdr = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}


def req(path, body=None):
    r = urllib.request.Request(base + path, data=json.dumps(body).encode() if body else None, headers=hdr)
    return urllib.request.urlopen(r, timeout=timeout)


def fail(msg):
    print("FAIL " + msg)
    sys.exit(1)


try:
    with req("/health") as r:
        if r.status != 200:
            fail(f"GET /health -> {r.status}")
    with req("/v1/models") as r:
        ids = [m["id"] for m in json.load(r)["data"]]
    if model not in ids:
        fail(f"GET /v1/models: {model} not in {ids}")
    msg = [{"role": "user", "content": "Say hello."}]
    t0 = time.monotonic()
    with req("/v1/chat/completions", {"model": model, "messages": msg, "max_tokens": max_tokens}) as r:
        body = json.load(r)
    if not body["choices"][0]["message"].get("content") or not body["usage"]["completion_tokens"]:
        fail(f"chat: no content: {json.dumps(body)[:300]}")
    chat_ms = (time.monotonic() - t0) * 1000
    events, done = 0, False
    with req("/v1/chat/completions", {"model": model, "messages": msg, "max_tokens": max_tokens, "stream": True}) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data:"):
                events += 1
                done = done or line[5:].strip() == "[DONE]"
    if not done:
        fail(f"stream: {events} events, no [DONE]")
    print(
        f"PASS replica {base}: health 200, models {ids}, chat {chat_ms:.0f} ms, stream {events} events ending in [DONE]"
    )
except Exception as exc:
    fail(f"{type(exc).__name__}: {exc}")
