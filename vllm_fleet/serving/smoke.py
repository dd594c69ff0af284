"""Smoke tests against a deployed endpoint, from the control machine (the 000/004 articles'
verification order): health, models, one chat completion, a streamed chat that must arrive
incrementally (a buffering proxy fails it; compared, on the proxy host where the caller can run
there, with streams straight from vLLM), auth refusals, and a few concurrent requests.

Used by the smoke role at the end of a deploy, by `vllm-fleet smoke`, and by the tests.
Only `requests` and the standard library: no pyinfra.
"""

from __future__ import annotations

import functools
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import requests


#: Tokens of each of the concurrent chats (the check proves they are all served, not their text).
CONCURRENT_TOKENS = 1


class SmokeError(Exception):
    """A failed check: says which check, against which URL, and what came back."""


@dataclass
class SmokeResult:
    base_url: str
    checks: list[dict[str, Any]] = field(default_factory=list)
    ttft_s: float | None = None
    stream_total_s: float | None = None
    stream_events: int = 0
    chat_total_s: float | None = None

    @property
    def ok(self) -> bool:
        return all(c["ok"] for c in self.checks)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d

    def raise_for_failures(self) -> "SmokeResult":
        """Itself when every check passed, else :class:`SmokeError` naming every failed check."""
        if not self.ok:
            failed = [f"{c['name']}: {c['detail']}" for c in self.checks if not c["ok"]]
            raise SmokeError(f"smoke tests failed against {self.base_url}:\n  " + "\n  ".join(failed))
        return self

    def summary(self) -> str:
        lines = [f"smoke {self.base_url}:"]
        for c in self.checks:
            status = "FAIL" if not c["ok"] else "WARN" if c.get("warn") else "PASS"
            lines.append(f"  {status}  {c['name']}: {c['detail']}")
        if self.ttft_s is not None:
            lines.append(
                f"  TTFT {self.ttft_s * 1000:.0f} ms, streamed {self.stream_events} events in "
                f"{self.stream_total_s * 1000:.0f} ms; plain chat {self.chat_total_s * 1000:.0f} ms"
            )
        return "\n".join(lines)


def _check(result: SmokeResult, name: str, ok: bool, detail: str, *, warn: bool = False) -> None:
    """Record a check; ``warn``: passed but inconclusive (shown as WARN, does not fail the deploy)."""
    result.checks.append({"name": name, "ok": bool(ok), "warn": bool(warn), "detail": detail})


def stream_chat(
    base_url: str,
    model: str,
    api_key: str | None,
    prompt: str,
    max_tokens: int,
    *,
    verify: Any = True,
    timeout: float = 120,
    host_header: str | None = None,
) -> dict[str, Any]:
    """POST a streamed chat completion; return the arrival time and size (bytes) of every SSE event.

    The response is read as it arrives (chunk by chunk), so a proxy that buffers the whole
    stream shows up as all events arriving at once. ``host_header``: the ``Host`` sent (a proxy
    whose site is chosen by ``server_name``; the URL names the host's address).
    """
    headers = {
        **({"Authorization": f"Bearer {api_key}"} if api_key else {}),
        **({"Host": host_header} if host_header else {}),
    }
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    t0 = time.monotonic()
    times: list[float] = []
    sizes: list[int] = []
    text: list[str] = []
    done = False
    with requests.post(
        f"{base_url}/v1/chat/completions", json=body, headers=headers, stream=True, timeout=timeout, verify=verify
    ) as r:
        if r.status_code != 200:
            raise SmokeError(f"stream: POST {base_url}/v1/chat/completions -> HTTP {r.status_code}: {r.text[:300]}")
        ctype = r.headers.get("content-type", "")
        buf = b""
        for chunk in r.iter_content(chunk_size=None):
            now = time.monotonic() - t0
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.decode("utf-8", "replace").splitlines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    times.append(now)
                    sizes.append(len(event) + 2)
                    if data == "[DONE]":
                        done = True
                        continue
                    try:
                        delta = json.loads(data)["choices"][0]["delta"].get("content") or ""
                    except (ValueError, KeyError, IndexError):
                        delta = ""
                    text.append(delta)
    return {
        "times": times,
        "sizes": sizes,
        "done": done,
        "text": "".join(text),
        "content_type": ctype,
        "total": time.monotonic() - t0,
    }


#: A proxy that buffers passes nothing on before a response ends but full buffers: nginx's
#: proxy_buffer_size and each of its proxy_buffers are one memory page, 4 KiB, at the least. An
#: arrival of whole events under half of that (a buffer's complete events are more than half of it:
#: an event is ~200 bytes), with more of the stream after it, was passed on without filling a buffer.
SMALL_ARRIVAL_BYTES = 2048

#: Streams of the same chat the proxy host sends through its proxy and straight to vLLM, in turns,
#: when every stream from here arrived at once (see :func:`judge_stream`).
HOST_PAIRS = 16

#: Events closer than this came in one arrival (one read of what the proxy wrote at once).
ARRIVAL_GAP_S = 0.001


def arrivals(times: list[float], sizes: list[int] | None = None, gap: float = ARRIVAL_GAP_S) -> list[tuple[int, int]]:
    """The stream's arrivals, in order: ``(events, bytes)`` of each run of events that came
    together (less than ``gap`` apart: one read of what was written at once). Sizes unknown: 0."""
    out: list[tuple[int, int]] = []
    for i, t in enumerate(times):
        size = sizes[i] if sizes and i < len(sizes) else 0
        if out and t - times[i - 1] <= gap:
            out[-1] = (out[-1][0] + 1, out[-1][1] + size)
        else:
            out.append((1, size))
    return out


def is_incremental(times: list[float], sizes: list[int] | None = None) -> bool:
    """Whether the stream was passed on as it came, judged by what arrived, not by how fast: some
    arrival before the last was smaller than a proxy's buffer (SMALL_ARRIVAL_BYTES; without sizes,
    any arrival before the last). A proxy that holds the response until it ends delivers it in one
    arrival; one that holds each buffer until it is full delivers only full buffers before the end.

    The machine's speed does not enter: how soon the first event came, or how long the stream took,
    says nothing here (a loaded host's late first token failed healthy streams when it did).
    """
    if len(times) < 3:
        return False
    parts = arrivals(times, sizes)
    return len(parts) >= 2 and any((b < SMALL_ARRIVAL_BYTES) if sizes else True for _, b in parts[:-1])


def _arrivals(times: list[float], gap: float = ARRIVAL_GAP_S) -> int:
    return len(arrivals(times, gap=gap))


def describe_stream(times: list[float]) -> str:
    """One stream's arrival pattern, e.g. "66 events in 1 arrivals, first at 181 ms, last at 181 ms"."""
    if not times:
        return "0 events"
    return (
        f"{len(times)} events in {_arrivals(times)} arrivals, first at {times[0] * 1000:.0f} ms, "
        f"last at {times[-1] * 1000:.0f} ms"
    )


def _tally(streams: list[dict[str, list]]) -> str:
    """e.g. "3 of 16 (66 events in 12 arrivals, ...; 66 events in 2 arrivals, ...)": the incremental ones."""
    inc = [s for s in streams if is_incremental(s["times"], s.get("sizes"))]
    shown = "; ".join(describe_stream(s["times"]) for s in (inc or streams)[:3])
    return f"{len(inc)} of {len(streams)} ({'e.g. ' if inc else 'none, e.g. '}{shown})"


def judge_stream(
    seen: list[str], passed: bool, host: dict[str, list] | None, host_errors: list[str], attempts: int
) -> tuple[bool, bool, str]:
    """The stream-incremental verdict: ``(ok, warn, detail)``.

    - A stream from here through the proxy arrived incrementally (is_incremental): pass.
    - Every one arrived at once. vLLM's CPU build sends a whole generation in one burst now and
      then, so that alone says nothing about the proxy. ``host`` compares like with like: the proxy
      host streamed the same chat through its proxy and straight from vLLM, in turns (HOST_PAIRS
      each), from one client, so the two ways differ by the proxy alone:
      - one through the proxy arrived incrementally: pass, the proxy passes events on;
      - none did, while at least half of those straight from vLLM did: fail, the proxy holds them;
      - both ways mostly at once: inconclusive, a warning (vLLM sent them in bursts).
    - No comparison (no vLLM on the proxy host, or its streams failed): fail, as a proxy that
      buffers would.
    """
    detail = seen[-1] if seen else "no stream"
    if len(seen) > 1:
        detail += f"; attempt {len(seen)} of {attempts} (earlier: {'; '.join(seen[:-1])})"
    if passed:
        return True, False, detail
    if not host or not host.get("direct"):
        why = f"; could not stream on the proxy host to compare: {host_errors[-1]}" if host_errors else ""
        return False, False, detail + why
    proxied, direct = host["proxy"], host["direct"]
    through = sum(1 for s in proxied if is_incremental(s["times"], s.get("sizes")))
    straight = sum(1 for s in direct if is_incremental(s["times"], s.get("sizes")))
    on_host = f"; on the proxy host, in turns: through the proxy {_tally(proxied)}, straight from vLLM {_tally(direct)}"
    if through:
        return (
            True,
            False,
            f"no stream from here arrived incrementally, but {through} of {len(proxied)} through the proxy from its "
            f"own host arrived incrementally (the proxy passes events on; vLLM sent the others in bursts): "
            f"{detail}{on_host}",
        )
    if 2 * straight >= len(direct):
        return (
            False,
            False,
            f"no stream through the proxy arrived incrementally (each at once or a full buffer at a time), while "
            f"{straight} of {len(direct)} straight from vLLM, streamed in turns with them, did: the proxy holds "
            f"responses "
            f"(nginx: proxy_buffering off in the API location): {detail}{on_host}",
        )
    return (
        True,
        True,
        f"inconclusive: {len(direct) - straight} of {len(direct)} streams straight from vLLM on its host arrived "
        f"at once too (vLLM sent them in bursts), so the proxy cannot be judged: {detail}{on_host}",
    )


#: Tokens of the one short chat each replica answers on its own host (every deploy proves every replica).
REPLICA_CHAT_TOKENS = 4


def judge_replica_chat(code: str, body: str, served_name: str) -> str | None:
    """Why one replica's short chat (``POST /v1/chat/completions`` on its host, straight at vLLM)
    does not prove it serves, or None when it does: HTTP 200, the served model's name, a choice
    with a message and a finish reason, and usage with completion tokens."""
    import json

    if code != "200":
        return f"HTTP {code or 'no answer'}" + (f": {body.strip()[:200]}" if body.strip() else "")
    try:
        doc = json.loads(body)
    except ValueError:
        return f"HTTP 200 but not JSON: {body.strip()[:200]!r}"
    if doc.get("model") != served_name:
        return f"answered for model {doc.get('model')!r}, not {served_name!r} (another deployment on this port?)"
    choice = (doc.get("choices") or [{}])[0]
    if not isinstance(choice.get("message"), dict) or not choice.get("finish_reason"):
        return f"no message or finish_reason in the answer: {body.strip()[:200]}"
    if not (doc.get("usage") or {}).get("completion_tokens"):
        return f"no completion tokens in usage: {doc.get('usage')}"
    return None


def _guarded(out: SmokeResult, name: str, fn: Callable[[SmokeResult], None]) -> SmokeResult:
    """Run one check into ``out``; a refusal or a failed request is that check failing, not an exception."""
    try:
        fn(out)
    except SmokeError as exc:
        _check(out, name, False, str(exc))
    except requests.RequestException as exc:
        _check(out, name, False, f"{type(exc).__name__}: {exc}")
    return out


class _Smoke:
    """The smoke checks against one endpoint (the settings :func:`smoke_checks` takes), one method a check."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None,
        *,
        prompt: str,
        max_tokens: int,
        concurrency: int,
        verify: Any,
        timeout: float,
        stream_attempts: int,
        stream_tokens: int,
        compare_on_host: Callable[[int], dict[str, list]] | None,
        host_header: str | None,
    ) -> None:
        self.base_url, self.model, self.api_key = base_url, model, api_key
        self.prompt, self.max_tokens, self.concurrency = prompt, max_tokens, concurrency
        self.verify, self.timeout, self.host_header = verify, timeout, host_header
        self.stream_attempts, self.stream_tokens = stream_attempts, stream_tokens
        self.compare_on_host = compare_on_host
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        s = requests.Session()
        s.verify = verify
        if host_header:
            s.headers["Host"] = host_header
        # requests lets REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE override a Session's verify=False (only a
        # request's own verify wins): pass it with every request, or self-signed TLS fails the smoke tests.
        s.request = functools.partial(s.request, verify=verify)  # type: ignore[method-assign]
        self.s = s

    def health(self, out: SmokeResult) -> None:
        r = self.s.get(f"{self.base_url}/health", timeout=self.timeout)
        _check(out, "health", r.status_code == 200, f"GET /health -> {r.status_code}")

    def models(self, out: SmokeResult) -> None:
        r = self.s.get(f"{self.base_url}/v1/models", headers=self.auth, timeout=self.timeout)
        ids = [m.get("id") for m in r.json().get("data", [])] if r.status_code == 200 else []
        _check(out, "models", self.model in ids, f"GET /v1/models -> {r.status_code}, ids {ids}")

    def chat(self, out: SmokeResult) -> None:
        t0 = time.monotonic()
        r = self.s.post(
            f"{self.base_url}/v1/chat/completions",
            headers=self.auth,
            timeout=self.timeout,
            json={
                "model": self.model,
                "messages": [{"role": "user", "content": self.prompt}],
                "max_tokens": self.max_tokens,
                "temperature": 0,
            },
        )
        out.chat_total_s = time.monotonic() - t0
        if r.status_code != 200:
            raise SmokeError(f"POST /v1/chat/completions -> {r.status_code}: {r.text[:300]}")
        body = r.json()
        content = body["choices"][0]["message"].get("content") or ""
        usage = body.get("usage") or {}
        ok = bool(content) and usage.get("completion_tokens", 0) > 0 and usage.get("prompt_tokens", 0) > 0
        _check(out, "chat", ok, f"{len(content)} chars, usage {usage}")

    def stream(self, out: SmokeResult) -> None:
        """A proxy that holds whole responses hands every event over at once, on every attempt
        (is_incremental). vLLM's CPU build also sends a whole generation in one burst now and then
        (its API server starved by the engine's busy loop on shared cores: measured in the lab
        straight from 127.0.0.1:8000, 10 of 10 streams pinned there, ~30-50% unpinned on 2 cores).
        So a stream that arrived at once is tried again, and when every attempt did, the proxy host
        (where the caller can run one there) streams through the proxy and straight from vLLM in
        turns, the like-for-like comparison judge_stream decides with."""
        seen: list[str] = []
        host: dict[str, list] | None = None
        host_errors: list[str] = []
        tokens = max(self.max_tokens, self.stream_tokens)
        for attempt in range(1, self.stream_attempts + 1):
            st = stream_chat(
                self.base_url,
                self.model,
                self.api_key,
                self.prompt,
                tokens,
                verify=self.verify,
                timeout=self.timeout,
                host_header=self.host_header,
            )
            times = st["times"]
            out.stream_events = len(times)
            out.ttft_s = times[0] if times else None
            out.stream_total_s = times[-1] if times else None
            if len(times) < 3:
                raise SmokeError(f"only {len(times)} SSE events")
            seen.append(describe_stream(times))
            if is_incremental(times, st["sizes"]):
                break
        passed = is_incremental(times, st["sizes"])
        if not passed and self.compare_on_host is not None:
            try:
                host = self.compare_on_host(tokens)
            except SmokeError as exc:
                host_errors.append(str(exc))
        ok, warn, detail = judge_stream(seen, passed, host, host_errors, self.stream_attempts)
        _check(out, "stream-incremental", ok, f"{detail} ({st['content_type']})", warn=warn)
        _check(out, "stream-done", st["done"], "ended with data: [DONE]" if st["done"] else "no [DONE] event")

    def refused(self, out: SmokeResult) -> None:
        for label, hdrs in (("no key", {}), ("wrong key", {"Authorization": "Bearer wrong-key-for-smoke"})):
            r = self.s.get(f"{self.base_url}/v1/models", headers=hdrs, timeout=self.timeout)
            _check(
                out,
                f"auth-{label.replace(' ', '-')}",
                r.status_code == 401,
                f"GET /v1/models with {label} -> {r.status_code}",
            )

    def concurrent(self, out: SmokeResult) -> None:
        """What is proven is that the endpoint serves several requests at once: one token each
        (several replicas generating at once on shared cores was most of a lab smoke test)."""
        headers = {**self.auth, **({"Host": self.host_header} if self.host_header else {})}

        def one(i: int) -> int:
            r = requests.post(
                f"{self.base_url}/v1/chat/completions",
                headers=headers,
                timeout=self.timeout,
                verify=self.verify,
                json={
                    "model": self.model,
                    "messages": [{"role": "user", "content": f"{self.prompt} ({i})"}],
                    "max_tokens": CONCURRENT_TOKENS,
                },
            )
            return r.status_code

        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            codes = list(pool.map(one, range(self.concurrency)))
        _check(out, "concurrent", all(c == 200 for c in codes), f"{self.concurrency} concurrent chats -> {codes}")


def smoke_checks(
    base_url: str,
    model: str,
    api_key: str | None,
    *,
    prompt: str = "Say hello in one short sentence.",
    max_tokens: int = 32,
    concurrency: int = 4,
    expect_auth: bool = True,
    verify: Any = True,
    timeout: float = 120,
    stream_attempts: int = 5,
    stream_tokens: int = 64,
    compare_on_host: Callable[[int], dict[str, list]] | None = None,
    host_header: str | None = None,
) -> SmokeResult:
    """Run every check against one endpoint: the one smoke entry point (the smoke role's deploy,
    ``run_smoke``, calls it). Never raises for a failed check: :meth:`SmokeResult.raise_for_failures`.

    ``compare_on_host(max_tokens)``, when given, streams the same chat on the proxy host, through
    the proxy and straight from vLLM in turns, and returns ``{"proxy": [...], "direct": [...]}``
    (each stream's ``times`` and ``sizes``): it tells a proxy that holds responses from a vLLM
    that sent its streams in bursts (see :func:`judge_stream`).
    ``host_header``: the ``Host`` every request sends (``proxy.server_name``: several sites on
    one nginx port are told apart by it, and the URL names the host's address, not the name).

    The stream, whose arrival times are judged, runs first and alone (its retries too), while
    the replicas behind the proxy are idle; then the checks that time nothing run at once (one
    keep-alive session, plus the concurrent chats' own connections). Measured on the lab (3
    CPU replicas behind one nginx, docs/benchmarks.md): the other way round the stream ran
    while the replicas that had just answered still busy-polled (vLLM's workers spin for a
    second after each step) and took 3-6x as long. Results are reported in this fixed order.
    """
    base_url = base_url.rstrip("/")
    if base_url.endswith("/v1"):
        base_url = base_url[:-3]
    res = SmokeResult(base_url)
    smoke = _Smoke(
        base_url,
        model,
        api_key,
        prompt=prompt,
        max_tokens=max_tokens,
        concurrency=concurrency,
        verify=verify,
        timeout=timeout,
        stream_attempts=stream_attempts,
        stream_tokens=stream_tokens,
        compare_on_host=compare_on_host,
        host_header=host_header,
    )
    streamed = _guarded(SmokeResult(base_url), "stream", smoke.stream)
    checks: list[tuple[str, Callable[[SmokeResult], None]]] = [
        ("health", smoke.health),
        ("models", smoke.models),
        ("chat", smoke.chat),
    ]
    if expect_auth:
        checks.append(("auth", smoke.refused))
    checks.append(("concurrent", smoke.concurrent))
    with ThreadPoolExecutor(max_workers=len(checks)) as pool:
        done = dict(zip([n for n, _ in checks], pool.map(lambda c: _guarded(SmokeResult(base_url), *c), checks)))
    done["stream"] = streamed
    for name in ("health", "models", "chat", "stream", "auth", "concurrent"):
        if name in done:
            res.checks += done[name].checks
    res.chat_total_s = done["chat"].chat_total_s
    res.ttft_s, res.stream_total_s, res.stream_events = streamed.ttft_s, streamed.stream_total_s, streamed.stream_events
    return res


def wait_healthy(
    url: str, deadline_s: float, *, verify: Any = True, interval: float = 2.0, host_header: str | None = None
) -> float:
    """Poll ``url`` until it answers 200; return seconds waited; raise TimeoutError.
    ``host_header``: the ``Host`` sent (see :func:`smoke_checks`)."""
    t0 = time.monotonic()
    last = "no answer"
    while time.monotonic() - t0 < deadline_s:
        try:
            r = requests.get(url, timeout=5, verify=verify, headers={"Host": host_header} if host_header else None)
            if r.status_code == 200:
                return time.monotonic() - t0
            last = f"HTTP {r.status_code}"
        except requests.RequestException as exc:
            last = type(exc).__name__
        time.sleep(interval)
    raise TimeoutError(f"{url} not healthy after {deadline_s:.0f} s (last: {last})")


def wait_serving(
    base_url: str,
    api_key: str | None,
    deadline_s: float,
    *,
    verify: Any = True,
    interval: float = 0.5,
    host_header: str | None = None,
) -> bool:
    """Poll an authenticated ``GET /v1/models`` on fresh connections until it answers 200.

    After ``nginx -s reload`` the master starts new workers asynchronously; until they run, the
    old workers (old site, old key) still take new connections. /health answers on both, so
    only an authenticated request shows that the new configuration is live. Returns whether it
    got there; the checks that follow report what is wrong when it did not.
    """
    headers = {
        **({"Authorization": f"Bearer {api_key}"} if api_key else {}),
        **({"Host": host_header} if host_header else {}),
    }
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        try:
            with requests.Session() as s:
                if (
                    s.get(f"{base_url.rstrip('/')}/v1/models", headers=headers, timeout=5, verify=verify).status_code
                    == 200
                ):
                    return True
        except requests.RequestException:
            pass
        time.sleep(interval)
    return False
