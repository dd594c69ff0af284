"""Runs on a vLLM host with the service's own Python (standard library only), from the smoke role:
stream one chat straight from 127.0.0.1:PORT, the key read from secrets.env (never on a command
line), and print {"times": [seconds from the request to each SSE event]} or {"error": "..."}.

    python direct_stream.py PORT MODEL SECRETS_ENV MAX_TOKENS TIMEOUT
"""

import http.client, json, sys, time

# vllm-fleet: include api_key.py
port, model, secrets, max_tokens, timeout = (
    int(sys.argv[1]),
    sys.argv[2],
    sys.argv[3],
    int(sys.argv[4]),
    float(sys.argv[5]),
)
try:
    key = api_key(secrets)
except OSError as exc:
    print(json.dumps({"error": f"cannot read {secrets}: {exc}"}))
    sys.exit(0)
body = json.dumps(
    {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello in one short sentence."}],
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
)
hdr = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
try:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.monotonic()
    c.request("POST", "/v1/chat/completions", body=body, headers=hdr)
    r = c.getresponse()
    if r.status != 200:
        print(json.dumps({"error": f"POST http://127.0.0.1:{port}/v1/chat/completions -> HTTP {r.status}"}))
        sys.exit(0)
    times, buf = [], b""
    while True:
        chunk = r.read1(65536)
        if not chunk:
            break
        now = time.monotonic() - t0
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            times += [now for line in event.split(b"\n") if line.startswith(b"data:")]
    print(json.dumps({"times": times}))
except (OSError, http.client.HTTPException) as exc:
    print(json.dumps({"error": f"http://127.0.0.1:{port}: {type(exc).__name__}: {exc}"}))
