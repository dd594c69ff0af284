"""vllm_fleet.smoke.wait_serving against a local HTTP server that plays an nginx mid-reload:
old workers refuse the key (401) for a while, then the new configuration accepts it."""

import http.server
import threading

from vllm_fleet.smoke import wait_serving


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


def _sse_server(buffered_attempts: int, group: int = 0):
    """A stand-in OpenAI endpoint whose streamed chats arrive all at once (as through a buffering
    proxy) for the first `buffered_attempts` streams, then one event every 5 ms; with `group`,
    every stream arrives `group` events at a time (as a proxy flushing full buffers)."""
    import json
    import time

    streams = {"n": 0}

    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _json(self, code, obj):
            body = json.dumps(obj).encode()
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
            if self.headers.get("Authorization") != "Bearer k":
                return self._json(401, {"error": "unauthorized"})
            if not req.get("stream"):
                return self._json(200, {"choices": [{"message": {"content": "hi"}}],
                                        "usage": {"prompt_tokens": 3, "completion_tokens": 1}})
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
                    chunk(b"".join(events[i:i + group]))
            else:
                for e in events:
                    chunk(e)
                    time.sleep(0.005)
            self.wfile.write(b"0\r\n\r\n")

        def log_message(self, *args):
            pass

    srv = _serve(H)
    return srv, streams


def _stream_check(buffered_attempts: int, group: int = 0, direct_stream=None):
    from vllm_fleet.smoke import run_smoke

    srv, streams = _sse_server(buffered_attempts, group)
    try:
        res = run_smoke(f"http://127.0.0.1:{srv.server_port}", "tiny", "k", concurrency=1, direct_stream=direct_stream)
    finally:
        srv.shutdown()
    return next(c for c in res.checks if c["name"] == "stream-incremental"), streams["n"]


SPREAD = [0.01 + 0.003 * i for i in range(66)]  # one event every 3 ms, as vLLM streams when it can
BURST = [0.18] * 66  # the whole generation in one instant, as vLLM's CPU build sometimes sends it


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
    from vllm_fleet.smoke import SmokeResult, _check

    res = SmokeResult("http://x")
    _check(res, "stream-incremental", True, "inconclusive: ...", warn=True)
    assert res.ok and "  WARN  stream-incremental: inconclusive" in res.summary()


def test_direct_stream_script_reads_the_key_from_the_file_and_times_each_event(tmp_path):
    """The script vllm_fleet/roles/smoke runs on a vLLM host, here against the stand-in: the key comes from
    the secrets file (the stand-in refuses a stream without it), events arrive 5 ms apart."""
    import json
    import subprocess
    import sys

    from vllm_fleet.smoke import DIRECT_STREAM_PY, is_incremental

    secrets = tmp_path / "secrets.env"
    secrets.write_text("# comment\nVLLM_API_KEY=k\n")
    srv, streams = _sse_server(buffered_attempts=0)
    try:
        argv = [sys.executable, "-c", DIRECT_STREAM_PY, str(srv.server_port), "tiny", str(secrets), "64", "30"]
        out = json.loads(subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout)
        secrets.write_text("VLLM_API_KEY=wrong\n")
        refused = json.loads(subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout)
    finally:
        srv.shutdown()
    assert len(out["times"]) == 65 and is_incremental(out["times"]), out
    assert out["times"][-1] - out["times"][0] > 0.2, out  # 64 gaps of 5 ms
    assert refused == {"error": f"POST http://127.0.0.1:{srv.server_port}/v1/chat/completions -> HTTP 401"}, refused
    assert streams["n"] == 1
