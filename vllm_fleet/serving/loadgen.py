"""A small, bounded load generator: chat completions (plain and streamed) against an endpoint.

    gen = LoadGen("http://10.10.0.11", "tiny", api_key, concurrency=4)
    gen.start(); ...; stats = gen.stop()      # or: with LoadGen(...) as gen: ...
    stats.ok, stats.failed, stats.reasons     # counts; each failure with its reason

``concurrency`` threads, each sending one request after the other (so at most ``concurrency``
requests are in flight), alternating plain and streamed chats (``stream_every``). A request
counts as ok only when it got HTTP 200 and a complete answer: a plain chat with content and
usage, a stream ending in ``data: [DONE]``. Anything else is a failure with its reason (HTTP
status and body, a connection error, a stream cut before [DONE]). One client retry only, as the
OpenAI SDKs do: a request whose connection was closed before any response byte (nginx closes
idle keep-alive connections when a reload retires its old workers) is sent once more on a new
connection and counted in ``retried`` (``retry_unanswered=False`` counts it as failed instead);
every other failure the service lets through is counted as failed. ``rate`` (requests per second over all
threads) bounds the load further; ``pause`` is a sleep between one thread's requests.

Used by the lab's rollout test and bench/rollout.py. Only ``requests`` and the standard library.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import requests


@dataclass
class Record:
    start: float  # seconds since the generator started
    seconds: float
    stream: bool
    ok: bool
    status: int | None
    reason: str = ""
    retried: str = ""  # why it was sent a second time (closed before any response), or ""


@dataclass
class Stats:
    ok: int = 0
    failed: int = 0
    plain: int = 0
    streamed: int = 0
    seconds: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)
    retried: int = 0  # requests sent twice because the first connection closed unanswered
    retry_reasons: dict[str, int] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)  # the first few, with times
    latency_ms: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.ok + self.failed

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total"] = self.total
        return d

    def summary(self) -> str:
        lat = ", ".join(f"{k} {v:.0f} ms" for k, v in self.latency_ms.items())
        out = (
            f"{self.total} requests in {self.seconds:.1f} s ({self.plain} plain, {self.streamed} streamed): "
            f"{self.ok} ok, {self.failed} failed" + (f"; latency {lat}" if lat else "")
        )
        if self.retried:
            out += f"; {self.retried} retried once (connection closed before any response)"
        if self.reasons:
            out += "; failures: " + "; ".join(f"{n}x {r}" for r, n in sorted(self.reasons.items(), key=lambda x: -x[1]))
        return out


def _unanswered(exc: BaseException) -> bool:
    """A connection the server closed (or reset) before sending any response byte: nginx does
    this to idle keep-alive connections when a reload retires the old workers, racing a request
    the client sends on one at that instant. The request was never processed, so a client may
    send it again (the OpenAI SDKs retry connection errors); anything else is not retried."""
    text = repr(exc)
    return isinstance(exc, requests.ConnectionError) and (
        "RemoteDisconnected" in text or "ConnectionResetError" in text or "closed connection without response" in text
    )


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))]


class LoadGen:
    """Bounded concurrent chat load; see the module docstring."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None,
        *,
        concurrency: int = 4,
        max_tokens: int = 16,
        stream_every: int = 2,
        rate: float | None = None,
        pause: float = 0.0,
        timeout: float = 120,
        prompt: str = "Count from one to ten.",
        verify: Any = True,
        keep_failures: int = 50,
        retry_unanswered: bool = True,
    ):
        base_url = base_url.rstrip("/")
        self.base_url = base_url[:-3] if base_url.endswith("/v1") else base_url
        self.model, self.api_key = model, api_key
        self.concurrency, self.max_tokens, self.stream_every = int(concurrency), int(max_tokens), int(stream_every)
        self.rate, self.pause, self.timeout, self.prompt, self.verify = rate, pause, timeout, prompt, verify
        self.keep_failures = keep_failures
        self.retry_unanswered = retry_unanswered
        self.records: list[Record] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._t0 = 0.0
        self._t1: float | None = None
        self._next_slot = 0.0
        self._count = 0

    # -- one request -------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _body(self, i: int, stream: bool) -> dict[str, Any]:
        # ignore_eos (a vLLM extension): every answer is max_tokens long, so the load is even and
        # a model that ends at once (the lab's tiny random model often does) still answers.
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": f"{self.prompt} ({i})"}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": stream,
            "ignore_eos": True,
        }

    def _plain(self, session: requests.Session, i: int) -> tuple[bool, int | None, str]:
        r = session.post(
            f"{self.base_url}/v1/chat/completions",
            json=self._body(i, False),
            headers=self._headers(),
            timeout=self.timeout,
            verify=self.verify,
        )
        if r.status_code != 200:
            return False, r.status_code, f"HTTP {r.status_code}: {r.text[:120].strip()}"
        try:
            body = r.json()
            content = body["choices"][0]["message"].get("content")
            usage = body.get("usage") or {}
        except (ValueError, KeyError, IndexError, TypeError):
            return False, 200, f"HTTP 200 with an unreadable body: {r.text[:120]!r}"
        if content is None or not usage.get("completion_tokens"):
            return False, 200, f"HTTP 200 without a message or usage: {r.text[:120]!r}"
        return True, 200, ""

    def _stream(self, session: requests.Session, i: int) -> tuple[bool, int | None, str]:
        with session.post(
            f"{self.base_url}/v1/chat/completions",
            json=self._body(i, True),
            headers=self._headers(),
            timeout=self.timeout,
            verify=self.verify,
            stream=True,
        ) as r:
            if r.status_code != 200:
                return False, r.status_code, f"HTTP {r.status_code}: {r.text[:120].strip()}"
            done, events, buf = False, 0, b""
            for chunk in r.iter_content(chunk_size=None):
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.decode("utf-8", "replace").splitlines():
                        if line.startswith("data:"):
                            events += 1
                            data = line[5:].strip()
                            if data == "[DONE]":
                                done = True
                            elif '"error"' in data and '"choices"' not in data:
                                return False, 200, f"error event in the stream: {data[:120]}"
            if not done:
                return False, 200, f"stream cut after {events} events (no [DONE])"
        return True, 200, ""

    def _wait_rate(self) -> None:
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            slot = max(now, self._next_slot)
            self._next_slot = slot + 1.0 / self.rate
        delay = slot - time.monotonic()
        if delay > 0:
            self._stop.wait(delay)

    def _worker(self, index: int) -> None:
        session = requests.Session()  # keep-alive to the proxy, as real clients do
        while not self._stop.is_set():
            self._wait_rate()
            if self._stop.is_set():
                break
            with self._lock:
                i = self._count
                self._count += 1
            stream = self.stream_every > 0 and i % self.stream_every == self.stream_every - 1
            t = time.monotonic()
            retried = ""
            for attempt in (1, 2):
                try:
                    ok, status, reason = (self._stream if stream else self._plain)(session, i)
                except requests.RequestException as exc:
                    ok, status, reason = False, None, f"{type(exc).__name__}: {str(exc)[:160]}"
                    session.close()
                    session = requests.Session()
                    if attempt == 1 and self.retry_unanswered and _unanswered(exc):
                        retried = reason  # closed before any response: never processed; once more
                        continue
                break
            rec = Record(round(t - self._t0, 3), round(time.monotonic() - t, 4), stream, ok, status, reason, retried)
            with self._lock:
                self.records.append(rec)
            if self.pause:
                self._stop.wait(self.pause)
        session.close()

    # -- control -----------------------------------------------------------------------------

    def start(self) -> "LoadGen":
        self._t0 = time.monotonic()
        self._next_slot = self._t0
        for n in range(self.concurrency):
            t = threading.Thread(target=self._worker, args=(n,), name=f"loadgen-{n}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self, join_timeout: float | None = None) -> Stats:
        """Stop sending; wait for the requests in flight (they count); return the stats."""
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout + 5 if join_timeout is None else join_timeout)
        self._t1 = time.monotonic()
        return self.stats()

    def stats(self, since: float = 0.0) -> Stats:
        with self._lock:
            recs = [r for r in self.records if r.start >= since]
        st = Stats()
        st.seconds = round(((self._t1 or time.monotonic()) - self._t0) - since, 1)
        lat: dict[str, list[float]] = {"plain": [], "stream": []}
        reasons: Counter[str] = Counter()
        retry_reasons: Counter[str] = Counter()
        for r in recs:
            if r.retried:
                st.retried += 1
                retry_reasons[r.retried] += 1
            if r.stream:
                st.streamed += 1
            else:
                st.plain += 1
            if r.ok:
                st.ok += 1
                lat["stream" if r.stream else "plain"].append(r.seconds * 1000)
            else:
                st.failed += 1
                reasons[r.reason] += 1
                if len(st.failures) < self.keep_failures:
                    st.failures.append(asdict(r))
        st.reasons = dict(reasons)
        st.retry_reasons = dict(retry_reasons)
        for kind, values in lat.items():
            if values:
                st.latency_ms[f"{kind} p50"] = round(_pct(values, 50), 1)
                st.latency_ms[f"{kind} p99"] = round(_pct(values, 99), 1)
        return st

    def __enter__(self) -> "LoadGen":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        if not self._stop.is_set():
            self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_fleet.serving.loadgen URL MODEL --key-file F --seconds 30``: run and print JSON."""
    import argparse
    import os

    p = argparse.ArgumentParser(prog="python -m vllm_fleet.serving.loadgen", description=__doc__.split("\n\n")[0])
    p.add_argument("url")
    p.add_argument("model")
    p.add_argument("--key-file")
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rate", type=float)
    a = p.parse_args(argv)
    key = open(os.path.expanduser(a.key_file)).read().strip() if a.key_file else None
    gen = LoadGen(a.url, a.model, key, concurrency=a.concurrency, max_tokens=a.max_tokens, rate=a.rate).start()
    time.sleep(a.seconds)
    st = gen.stop()
    print(json.dumps(st.as_dict(), indent=2))
    print(st.summary())
    return 0 if st.failed == 0 else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
