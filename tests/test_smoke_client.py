"""vllm_fleet.serving.smoke.wait_serving against a local HTTP server that plays an nginx mid-reload:
old workers refuse the key (401) for a while, then the new configuration accepts it."""

import http.server
import threading

import pytest

from vllm_fleet.serving.smoke import wait_serving


def _serve(handler) -> http.server.ThreadingHTTPServer:
    """A local HTTP server with ``handler`` on a free port, serving in a daemon thread."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _server(accept_after: int, key: str):
    seen = {"n": 0}

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen["n"] += 1
            ok = seen["n"] > accept_after and self.headers.get("Authorization") == f"Bearer {key}"
            self.send_response(200 if ok else 401)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    srv = _serve(H)
    return srv, seen


def test_waits_until_the_key_is_accepted():
    srv, seen = _server(accept_after=3, key="k")
    try:
        assert wait_serving(f"http://127.0.0.1:{srv.server_port}", "k", 10, interval=0.05)
        assert seen["n"] == 4
    finally:
        srv.shutdown()


def test_gives_up_at_the_deadline_with_a_wrong_key():
    srv, _ = _server(accept_after=0, key="k")
    try:
        assert not wait_serving(f"http://127.0.0.1:{srv.server_port}", "wrong", 0.5, interval=0.05)
    finally:
        srv.shutdown()


def _sse_server(buffered_attempts: int, group: int = 0, log: list | None = None):
    """A stand-in OpenAI endpoint whose streamed chats arrive all at once (as through a buffering
    proxy) for the first `buffered_attempts` streams, then one event every 5 ms; with `group`,
    every stream arrives `group` events at a time (as a proxy flushing full buffers). `log`: gets
    ``(what, max_tokens, start, end)`` of every request (monotonic seconds)."""
    import json
    import time

    streams = {"n": 0}

    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        # A request's start and end as events the client's order depends on: the start once its
        # request was read (not when the handler began to wait on a kept-alive connection), the
        # end before the response's last byte is written (the client can send its next request
        # only after reading it; timed after the write, a loaded machine let the next request's
        # start come first).
        def handle_one_request(self):
            self._what = self._end = None
            super().handle_one_request()
            if log is not None and self._what:
                log.append((*self._what, self._end))

        def _json(self, code, obj):
            body = json.dumps(obj).encode()
            self._end = time.monotonic()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):  # noqa: N802
            if self.path == "/health":
                return self._json(200, {})
            if self.headers.get("Authorization") != "Bearer k":
                return self._json(401, {"error": "unauthorized"})
            return self._json(200, {"data": [{"id": "tiny"}]})

        def do_POST(self):  # noqa: N802
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self._what = ("stream" if req.get("stream") else "chat", req.get("max_tokens"), time.monotonic())
            if self.headers.get("Authorization") != "Bearer k":
                return self._json(401, {"error": "unauthorized"})
            if not req.get("stream"):
                return self._json(
                    200,
                    {
                        "choices": [{"message": {"content": "hi"}}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
                    },
                )
            streams["n"] += 1
            buffered = streams["n"] <= buffered_attempts
            events = [b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'] * 64 + [b"data: [DONE]\n\n"]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")  # as uvicorn and nginx send SSE
            self.end_headers()

            def chunk(data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

            if buffered:
                time.sleep(0.1)
                chunk(b"".join(events))
            elif group:
                for i in range(0, len(events), group):
                    time.sleep(0.005 * group)
                    chunk(b"".join(events[i : i + group]))
            else:
                for e in events:
                    chunk(e)
                    time.sleep(0.005)
            self._end = time.monotonic()
            self.wfile.write(b"0\r\n\r\n")

        def log_message(self, *args):
            pass

    srv = _serve(H)
    return srv, streams


def _stream_check(buffered_attempts: int, group: int = 0, direct_stream=None):
    from vllm_fleet.serving.smoke import smoke_checks

    srv, streams = _sse_server(buffered_attempts, group)
    try:
        res = smoke_checks(
            f"http://127.0.0.1:{srv.server_port}", "tiny", "k", concurrency=1, direct_stream=direct_stream
        )
    finally:
        srv.shutdown()
    return next(c for c in res.checks if c["name"] == "stream-incremental"), streams["n"]


SPREAD = [0.01 + 0.003 * i for i in range(66)]  # one event every 3 ms, as vLLM streams when it can
BURST = [0.18] * 66  # the whole generation in one instant, as vLLM's CPU build sometimes sends it


def test_the_stream_runs_first_and_alone_then_the_rest_at_once_in_a_fixed_report_order():
    """The judged stream meets idle replicas (measured on the lab: after the other checks it met
    replicas still busy-polling); the concurrent chats ask one token each."""
    from vllm_fleet.serving.smoke import CONCURRENT_TOKENS, smoke_checks

    log: list = []
    srv, _ = _sse_server(buffered_attempts=0, log=log)
    try:
        res = smoke_checks(f"http://127.0.0.1:{srv.server_port}", "tiny", "k", concurrency=4, max_tokens=32)
    finally:
        srv.shutdown()
    assert res.ok, res.summary()
    assert [c["name"] for c in res.checks] == [
        "health",
        "models",
        "chat",
        "stream-incremental",
        "stream-done",
        "auth-no-key",
        "auth-wrong-key",
        "concurrent",
    ]
    streams = [e for e in log if e[0] == "stream"]
    chats = [e for e in log if e[0] == "chat"]
    assert len(streams) == 1 and len(chats) == 5, log
    assert all(c[2] >= streams[0][3] for c in chats), log  # every chat began after the stream ended
    assert sorted(c[1] for c in chats) == [CONCURRENT_TOKENS] * 4 + [32] and CONCURRENT_TOKENS == 1


def test_a_failing_check_is_named_with_its_url_and_the_others_still_run():
    from vllm_fleet.serving.smoke import SmokeError, smoke_checks

    srv, _ = _sse_server(buffered_attempts=0)
    url = f"http://127.0.0.1:{srv.server_port}"
    try:
        with pytest.raises(SmokeError) as e:
            smoke_checks(url, "not-served", "k", concurrency=2).raise_for_failures()  # /v1/models lists "tiny" only
    finally:
        srv.shutdown()
    assert str(e.value).startswith(
        f"smoke tests failed against {url}:"
    ) and "models: GET /v1/models -> 200, ids ['tiny']" in str(e.value)


def test_incremental_stream_passes_first_time():
    check, n = _stream_check(buffered_attempts=0)
    assert check["ok"] and n == 1, check


def test_one_stalled_stream_is_tried_again_and_says_so():
    check, n = _stream_check(buffered_attempts=1)
    assert check["ok"] and n == 2, check
    assert "attempt 2 of 5" in check["detail"], check


def test_a_buffering_proxy_fails_every_attempt():
    check, n = _stream_check(buffered_attempts=99)
    assert not check["ok"] and n == 5, check
    assert "attempt 5 of 5" in check["detail"], check


def test_a_buffering_proxy_in_front_of_a_streaming_vllm_fails_and_says_so():
    calls = []
    check, n = _stream_check(buffered_attempts=99, direct_stream=lambda tokens: calls.append(tokens) or SPREAD)
    assert not check["ok"] and n == 5 and len(calls) == 5, check
    assert "the proxy holds responses" in check["detail"] and "proxy_buffering off" in check["detail"], check


def test_a_vllm_that_sends_bursts_makes_the_check_inconclusive_not_failed():
    check, n = _stream_check(buffered_attempts=99, direct_stream=lambda tokens: BURST)
    assert check["ok"] and check["warn"] and n == 5, check
    assert check["detail"].startswith("inconclusive: 5 of 5 streams straight from vLLM"), check


def test_a_stream_that_arrives_spread_out_never_asks_vllm_directly():
    calls = []
    check, n = _stream_check(buffered_attempts=0, direct_stream=lambda tokens: calls.append(tokens) or BURST)
    assert check["ok"] and not check["warn"] and n == 1 and calls == [], check


def test_warn_is_shown_as_warn_in_the_summary():
    from vllm_fleet.serving.smoke import SmokeResult, _check

    res = SmokeResult("http://x")
    _check(res, "stream-incremental", True, "inconclusive: ...", warn=True)
    assert res.ok and "  WARN  stream-incremental: inconclusive" in res.summary()


def test_direct_stream_script_reads_the_key_from_the_file_and_times_each_event(tmp_path):
    """The script vllm_fleet/roles/smoke runs on a vLLM host, here against the stand-in: the key comes from
    the secrets file (the stand-in refuses a stream without it), events arrive 5 ms apart."""
    import json
    import subprocess
    import sys

    from vllm_fleet.host import programs
    from vllm_fleet.serving.smoke import is_incremental

    secrets = tmp_path / "secrets.env"
    secrets.write_text("# comment\nVLLM_API_KEY=k\n")
    srv, streams = _sse_server(buffered_attempts=0)
    try:
        argv = [
            sys.executable,
            "-c",
            programs.script("direct_stream.py"),
            str(srv.server_port),
            "tiny",
            str(secrets),
            "64",
            "30",
        ]
        out = json.loads(subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout)
        secrets.write_text("VLLM_API_KEY=wrong\n")
        refused = json.loads(subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout)
    finally:
        srv.shutdown()
    assert len(out["times"]) == 65 and is_incremental(out["times"]), out
    assert out["times"][-1] - out["times"][0] > 0.2, out  # 64 gaps of 5 ms
    assert refused == {"error": f"POST http://127.0.0.1:{srv.server_port}/v1/chat/completions -> HTTP 401"}, refused
    assert streams["n"] == 1


def test_the_host_scripts_read_the_key_as_systemd_writes_it(tmp_path):
    """api_key.py (included by every host script that needs the key) reads back each way
    render.files.env_file writes a value: bare, single-quoted, double-quoted with escapes."""
    from vllm_fleet.host import programs
    from vllm_fleet.render.files import env_file

    ns: dict = {}
    exec(programs.script("api_key.py"), ns)
    for key in ("k3y", "with space", "it's $HOME \\ `x`", "a\"b"):
        f = tmp_path / "secrets.env"
        f.write_text(env_file({"VLLM_API_KEY": key}, ["header"]))
        assert ns["api_key"](str(f)) == key, f.read_text()
    f.write_text("# no key\n")
    assert ns["api_key"](str(f)) is None
    for name in ("direct_stream.py", "replica_smoke.py"):
        text = programs.script(name)
        assert "def api_key(" in text and "include" not in text.split("def api_key(")[0].splitlines()[-1]
        compile(text, name, "exec")
