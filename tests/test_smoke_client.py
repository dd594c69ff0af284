"""vllm_fleet.smoke.wait_serving against a local HTTP server that plays an nginx mid-reload:
old workers refuse the key (401) for a while, then the new configuration accepts it."""

import http.server
import threading

from vllm_fleet.smoke import wait_serving


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

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
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
