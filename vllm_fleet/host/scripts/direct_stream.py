"""Runs on a vLLM host with the service's own Python (standard library only), from the smoke role:
stream the same chat PAIRS times through the proxy (PROXY_URL, sent from this host, with HOST as
the Host header, '-' for none) and PAIRS times straight from vLLM on 127.0.0.1:PORT, one after
the other in turns, the key read from secrets.env (never on a command line). Both ways are
streamed by the same client from the same host at the same moments, so they differ only by the
proxy. Prints {"proxy": [STREAM...], "direct": [STREAM...]}, each STREAM {"times": [seconds from
the request to each SSE event], "sizes": [bytes of each event]}, or {"error": "..."}.

    python direct_stream.py PORT MODEL SECRETS_ENV MAX_TOKENS TIMEOUT PROXY_URL HOST PAIRS
"""

import http.client, json, ssl, sys, time, urllib.parse

# vllm-fleet: include api_key.py
port, model, secrets, max_tokens, timeout, proxy_url, host, pairs = (
    int(sys.argv[1]),
    sys.argv[2],
    sys.argv[3],
    int(sys.argv[4]),
    float(sys.argv[5]),
    sys.argv[6],
    sys.argv[7],
    int(sys.argv[8]),
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
auth = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}


def stream(url, headers):
    u = urllib.parse.urlsplit(url)
    if u.scheme == "https":  # the proxy's own certificate may be self-signed: this is its own host
        c = http.client.HTTPSConnection(
            u.hostname, u.port or 443, timeout=timeout, context=ssl._create_unverified_context()
        )
    else:
        c = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    t0 = time.monotonic()
    c.request("POST", "/v1/chat/completions", body=body, headers=headers)
    r = c.getresponse()
    if r.status != 200:
        raise OSError(f"POST {url}/v1/chat/completions -> HTTP {r.status}")
    times, sizes, buf = [], [], b""
    while True:
        chunk = r.read1(65536)
        if not chunk:
            break
        now = time.monotonic() - t0
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    times.append(now)
                    sizes.append(len(event) + 2)
    c.close()
    return {"times": times, "sizes": sizes}


out = {"proxy": [], "direct": []}
where = ""
try:
    for _ in range(pairs):
        where = proxy_url
        out["proxy"].append(stream(proxy_url, {**auth, **({"Host": host} if host != "-" else {})}))
        where = f"http://127.0.0.1:{port}"
        out["direct"].append(stream(where, auth))
    print(json.dumps(out))
except (OSError, http.client.HTTPException) as exc:
    print(json.dumps({"error": f"{where}: {type(exc).__name__}: {exc}"}))
