"""Every rendered unit passes `systemd-analyze verify`, every nginx site passes `nginx -t`, and the
nginx site does what it promises when a real nginx serves it in front of a fake vLLM.

systemd-analyze (systemd 252 on Debian 12) runs against a temporary root (``--root``) holding a copy
of the distribution's unit directory and stub executables at the ExecStart paths: it checks that
the commands exist, and it warns about unknown keys (e.g. RestartSteps=, new in 254) with exit
code 0, so the tests require empty output too. nginx runs with a minimal nginx.conf wrapper in a
temporary prefix. Packages: systemd (systemd-analyze), nginx-light (or nginx), openssl.
"""

from __future__ import annotations

import copy
import http.server
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from vllm_fleet.render import files as render

from vllm_fleet.specs import load as spec
from fleetutil import wait_listening

REPO = Path(__file__).resolve().parent.parent
DEPLOYMENTS = sorted((REPO / "deployments").glob("*.yaml"))
INVENTORY_2NODE = {
    "gpu-a": {"address": "10.10.0.11", "groups": ["servers"], "data": {}},
    "gpu-b": {"address": "10.10.0.12", "groups": ["workers"], "data": {}},
    "edge": {"address": "10.10.0.5", "groups": ["proxy"], "data": {}},
}
SYSTEM_UNITS = Path("/usr/lib/systemd/system")


def resolved_of(stem: str) -> dict:
    return spec.resolve(spec.load(REPO / "deployments" / f"{stem}.yaml"))


def _variants():
    """(id, resolved, inventory): every example, the 2-node one on an inventory, and variants
    that switch on what the examples leave off (native multi-node, TLS, auth off, CPU TP 2)."""
    out = [(p.stem, resolved_of(p.stem), None) for p in DEPLOYMENTS]
    out.append(("2node+inventory", resolved_of("2node-ray-pp2"), INVENTORY_2NODE))
    native = resolved_of("2node-ray-pp2")
    native["parallel"]["backend"] = "native"
    out.append(("2node-native+inventory", native, INVENTORY_2NODE))
    tls = resolved_of("lab-tiny")
    tls["proxy"].update(listen=443, server_name="llm.lab.example", tls={"enabled": True, "self_signed": True})
    out.append(("lab-tiny-tls", tls, None))
    noauth = resolved_of("rtx3090-qwen7b-awq-batch")
    noauth["proxy"]["auth"] = "none"
    out.append(("noauth", noauth, None))
    routing_inv = {
        f"lab{i}": {"address": f"10.10.0.1{i}", "groups": ["servers"] + (["proxy"] if i == 1 else []), "data": {}}
        for i in (1, 2, 3)
    }
    out.append(("lab-tiny-routing+inventory", resolved_of("lab-tiny-routing"), routing_inv))
    session = resolved_of("lab-tiny-routing")
    session["proxy"]["routing"].update(policy="session", session_header="X-Conversation")
    out.append(("lab-tiny-session+inventory", session, routing_inv))
    tp2 = resolved_of("lab-tiny")
    tp2["parallel"]["tensor"] = 2
    out.append(("lab-tiny-tp2", tp2, None))
    return out


VARIANTS = _variants()


def _files(suffix: str):
    """(variant, target, files of the target, units of the other targets) per target with files
    ending in suffix. In role mode the server's units require units of another role (ray-head)
    that sits on the same host, so those travel along."""
    for vid, r, inv in VARIANTS:
        rendered = render.render(r, copy.deepcopy(inv))
        for target, files in rendered.items():
            group = {p: f for p, f in files.items() if p.endswith(suffix)}
            if group:
                others = {
                    p: f for t, fs in rendered.items() if t != target for p, f in fs.items() if p.endswith(".service")
                }
                yield pytest.param(vid, target, files, others, id=f"{vid}:{target}")


# ---------------------------------------------------------------------------------------------
# systemd


def systemd_root(root: Path, executables: list[str]) -> Path:
    """A temporary root with the distribution's units and stub executables at these paths."""
    (root / "usr/lib/systemd").mkdir(parents=True, exist_ok=True)
    if not (root / "usr/lib/systemd/system").exists():
        shutil.copytree(SYSTEM_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True, exist_ok=True)
    for exe in executables:
        stub = root / exe.lstrip("/")
        stub.parent.mkdir(parents=True, exist_ok=True)
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)
    return root


def _commands(unit_text: str) -> list[str]:
    return [
        line.split("=", 1)[1].split()[0].lstrip("-@+!:")
        for line in unit_text.splitlines()
        if re.match(r"Exec\w+=", line)
    ]


needs_systemd = pytest.mark.skipif(
    not shutil.which("systemd-analyze") or not SYSTEM_UNITS.is_dir(),
    reason="systemd-analyze not installed (apt-get install systemd)",
)


@needs_systemd
@pytest.mark.parametrize("vid,target,files,others", list(_files(".service")))
def test_systemd_analyze_verify(tmp_path, vid, target, files, others):
    units = {p: f for p, f in files.items() if p.endswith(".service")}
    present = {**{p: f for p, f in others.items() if p not in units}, **units}
    exes = [c for f in present.values() for c in _commands(f.content)]
    root = systemd_root(tmp_path, exes)
    for path, f in present.items():
        (root / path.lstrip("/")).write_text(f.content)
    for path in units:
        out = subprocess.run(
            ["systemd-analyze", f"--root={root}", "verify", path], capture_output=True, text=True, timeout=60
        )
        text = (out.stdout + out.stderr).strip()
        assert out.returncode == 0 and text == "", f"{vid}:{target}:{path}:\n{text}"


@needs_systemd
def test_verify_catches_a_broken_unit(tmp_path):
    """The check above can fail: an unknown key (RestartSteps= is systemd >= 254) and a missing binary."""
    r = resolved_of("lab-tiny")
    unit = render.render(r)["server"]["/etc/systemd/system/vllm-lab-tiny-0.service"].content
    root = systemd_root(tmp_path, [])
    (root / "etc/systemd/system/vllm.service").write_text(
        unit.replace("Restart=on-failure", "Restart=on-failure\nRestartSteps=5")
    )
    out = subprocess.run(
        ["systemd-analyze", f"--root={root}", "verify", "/etc/systemd/system/vllm.service"],
        capture_output=True,
        text=True,
    )
    text = out.stdout + out.stderr
    assert "RestartSteps" in text and "is not executable" in text


# ---------------------------------------------------------------------------------------------
# nginx


def _nginx() -> str | None:
    exe = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if exe is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "nginx-light"],
            capture_output=True,
            timeout=600,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
        exe = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    return exe


NGINX = _nginx()
needs_nginx = pytest.mark.skipif(
    NGINX is None, reason="nginx is not installed and could not be installed (apt-get install nginx-light)"
)


def _nginx_prefix(tmp: Path, site: str, auth: str | None, port: int | None = None) -> Path:
    """Write the site into a temporary prefix (absolute /etc/nginx paths moved there)."""
    tmp.mkdir(parents=True, exist_ok=True)
    secret_dir = tmp / "vllm-fleet"
    secret_dir.mkdir(exist_ok=True)
    site = site.replace(render.NGINX_SECRET_DIR + "/", f"{secret_dir}/")
    if port is not None:
        site = re.sub(r"listen \d+", f"listen 127.0.0.1:{port}", site)
    for m in re.finditer(r"include (\S+);", site):
        Path(m.group(1)).write_text(auth or "")
    if "ssl_certificate " in site:
        crt = re.search(r"ssl_certificate (\S+);", site).group(1)
        key = re.search(r"ssl_certificate_key (\S+);", site).group(1)
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=test",
                "-keyout",
                key,
                "-out",
                crt,
            ],
            check=True,
            capture_output=True,
        )
    (tmp / "site.conf").write_text(site)
    (tmp / "logs").mkdir(exist_ok=True)
    (tmp / "nginx.conf").write_text(
        f"pid {tmp}/nginx.pid;\nerror_log {tmp}/logs/error.log;\ndaemon off;\nevents {{}}\n"
        f"http {{\n  access_log {tmp}/logs/access.log;\n  client_body_temp_path {tmp}/body;\n"
        f"  proxy_temp_path {tmp}/proxy;\n"
        f"  include {tmp}/site.conf;\n}}\n"
    )
    return tmp


def _nginx_t(prefix: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [NGINX, "-t", "-q", "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e", str(prefix / "logs/error.log")],
        capture_output=True,
        text=True,
        timeout=60,
    )


@needs_nginx
@pytest.mark.parametrize("vid,target,files,others", list(_files(".conf")))
def test_nginx_t(tmp_path, vid, target, files, others):
    r = next(v[1] for v in VARIANTS if v[0] == vid)
    site_path = render.NGINX_SITE.format(name=r["name"])
    if site_path not in files:
        pytest.skip("no nginx site on this target")
    placeholder = files.get(f"{render.NGINX_SECRET_DIR}/{r['name']}-auth.conf")
    for auth in (
        placeholder.content if placeholder else None,
        render.nginx_auth_content(r, "sk-test_Key-123") if placeholder else None,
    ):
        prefix = _nginx_prefix(
            tmp_path / ("real" if auth and "Bearer" in auth else "placeholder"), files[site_path].content, auth
        )
        out = _nginx_t(prefix)
        assert out.returncode == 0, f"{vid}:{target}: nginx -t failed:\n{out.stderr}"


@needs_nginx
def test_nginx_t_catches_a_broken_site(tmp_path):
    site = render.render(resolved_of("lab-tiny"))["proxy"]["/etc/nginx/conf.d/vllm-fleet-lab-tiny.conf"].content
    out = _nginx_t(_nginx_prefix(tmp_path, site.replace("proxy_buffering off;", "proxy_buffering of;"), None))
    assert out.returncode != 0 and "proxy_buffering" in out.stderr


# ---------------------------------------------------------------------------------------------
# nginx in front of a fake vLLM: what a client sees


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _FakeVllm(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _send(self, code: int, body: bytes, ctype: str = "application/json"):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/health":
            self._send(200, b"")
        elif self.path == "/metrics":
            self._send(200, b"vllm:num_requests_running 0\n", "text/plain")
        elif self.path == "/v1/models":
            self._send(
                200, json.dumps({"data": [{"id": "tiny"}], "seen_auth": self.headers.get("Authorization")}).encode()
            )
        else:
            self._send(404, b'{"detail":"Not Found"}')

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(3):  # SSE events 0.6 s apart: a buffering proxy would deliver them together
            data = f"data: {{\"i\": {i}}}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
            time.sleep(0.6)
        data = b"data: [DONE]\n\n"
        self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
        self.wfile.flush()


@needs_nginx
def test_nginx_site_behaviour(tmp_path):
    r = resolved_of("lab-tiny")
    upstream_port, listen = _free_port(), _free_port()
    r["server"]["port"] = upstream_port
    r["proxy"]["metrics_allow"] = ["10.99.0.0/24"]  # not the test client (127.0.0.1)
    files = render.render(r)["proxy"]
    # As long as a generated key (sk- + 43 chars): a hashed map entry this long overflowed
    # nginx's default map_hash_bucket_size on a real host.
    key = "sk-" + secrets.token_urlsafe(32)
    site = files["/etc/nginx/conf.d/vllm-fleet-lab-tiny.conf"].content
    prefix = _nginx_prefix(tmp_path, site, render.nginx_auth_content(r, key), port=listen)

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", upstream_port), _FakeVllm)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    proc = subprocess.Popen(
        [NGINX, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e", str(prefix / "logs/error.log")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        base = f"http://127.0.0.1:{listen}"
        wait_listening(proc, listen)

        def get(path, headers=None, data=None):
            req = urllib.request.Request(base + path, headers=headers or {}, data=data)
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return resp.status, resp.headers, resp.read()
            except urllib.error.HTTPError as e:
                return e.code, e.headers, e.read()

        code, headers, body = get("/v1/models")
        assert code == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        assert headers["Content-Type"].startswith("application/json")
        assert get("/v1/models", {"Authorization": "Bearer wrong"})[0] == 401
        code, _, body = get("/v1/models", {"Authorization": f"Bearer {key}"})
        assert code == 200 and json.loads(body)["data"][0]["id"] == "tiny"
        assert get("/health")[0] == 200
        assert get("/metrics")[0] == 403  # only the monitoring network may read /metrics
        assert get("/tokenize")[0] == 404 and get("/")[0] == 404 and get("/v2/models")[0] == 404

        # streaming: the first event arrives well before the last (nothing buffers it)
        req = urllib.request.Request(
            base + "/v1/chat/completions",
            data=b'{"stream": true}',
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        t0 = time.monotonic()
        arrivals = []
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.headers.get("Content-Encoding") is None
            for line in resp:
                if line.startswith(b"data:"):
                    arrivals.append((time.monotonic() - t0, line.strip()))
        assert arrivals[-1][1] == b"data: [DONE]"
        assert arrivals[-1][0] - arrivals[0][0] > 1.0, arrivals
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        upstream.shutdown()


class _UnframedStream(_FakeVllm):
    """SSE events 0.6 s apart in a response delimited by the connection's close (no chunks, no
    length): nginx with proxy_buffering on holds such a body until the end (chunked bodies it
    happens to pass on per chunk), so only `proxy_buffering off` delivers each event on time."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for i in range(3):
            self.wfile.write(f"data: {{\"i\": {i}}}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.6)
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True


@needs_nginx
def test_each_streamed_event_arrives_when_it_is_sent(tmp_path):
    """Through a real nginx: event i (sent at 0.6 i s) arrives within 0.35 s of that; with
    `proxy_buffering off` removed from the site, all four arrive together at the end."""
    r = resolved_of("lab-tiny")
    upstream_port, listen = _free_port(), _free_port()
    r["server"]["port"] = upstream_port
    key = "sk-" + secrets.token_urlsafe(32)
    site = render.render(r)["proxy"]["/etc/nginx/conf.d/vllm-fleet-lab-tiny.conf"].content
    prefix = _nginx_prefix(tmp_path, site, render.nginx_auth_content(r, key), port=listen)
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", upstream_port), _UnframedStream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    proc = subprocess.Popen(
        [NGINX, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e", str(prefix / "logs/error.log")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", listen), timeout=0.2).close()
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()
                assert time.monotonic() < deadline, "nginx did not start listening"
                time.sleep(0.05)
        req = urllib.request.Request(
            f"http://127.0.0.1:{listen}/v1/chat/completions",
            data=b'{"stream": true}',
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        t0 = time.monotonic()
        arrivals = []
        with urllib.request.urlopen(req, timeout=15) as resp:
            for line in resp:
                if line.startswith(b"data:"):
                    arrivals.append(time.monotonic() - t0)
        assert len(arrivals) == 4, arrivals
        for i, t in enumerate(arrivals):
            assert abs(t - 0.6 * i) < 0.35, (i, arrivals)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        upstream.shutdown()


class _PacedVllm(_FakeVllm):
    """vLLM as it streams when it can: 64 events of its size (~200 bytes) 3 ms apart, then [DONE],
    in a body delimited by the connection's close (nginx with proxy_buffering on holds such a body
    a full 4 KiB buffer at a time; chunked bodies it happens to pass on per chunk); the response
    headers first and alone, as vLLM sends them. A plain chat is answered whole."""

    EVENT = (
        b'data: {"id":"chatcmpl-0123456789abcdef0123456789abcdef","object":"chat.completion.chunk",'
        b'"created":1,"model":"tiny","choices":[{"index":0,"delta":{"content":" x"},"logprobs":null,'
        b'"finish_reason":null}]}\n\n'
    )

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if not req.get("stream"):
            usage = {"prompt_tokens": 3, "completion_tokens": 1}
            return self._send(200, json.dumps({"choices": [{"message": {"content": "hi"}}], "usage": usage}).encode())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.flush()
        time.sleep(0.03)
        for _ in range(64):
            self.wfile.write(self.EVENT)
            self.wfile.flush()
            time.sleep(0.003)
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True


@needs_nginx
@pytest.mark.parametrize("buffering", ["off", "on"])
def test_the_smoke_stream_check_fails_behind_a_buffering_nginx(tmp_path, buffering):
    """The smoke's stream-incremental check through a real nginx with the rendered site, its
    comparison on the proxy host made by the host script itself (here: through nginx and straight
    at the stand-in vLLM, in turns). As rendered (proxy_buffering off): PASS at the first attempt.
    With proxy_buffering on: every stream through nginx arrives a full buffer at a time, while
    those straight from vLLM arrive event by event: FAIL, naming the proxy."""
    from vllm_fleet.host import programs
    from vllm_fleet.serving.smoke import smoke_checks

    r = resolved_of("lab-tiny")
    upstream_port, listen = _free_port(), _free_port()
    r["server"]["port"] = upstream_port
    key = "sk-" + secrets.token_urlsafe(32)
    site = render.render(r)["proxy"]["/etc/nginx/conf.d/vllm-fleet-lab-tiny.conf"].content
    assert site.count("proxy_buffering off;") == 1
    site = site.replace("proxy_buffering off;", f"proxy_buffering {buffering};")
    prefix = _nginx_prefix(tmp_path, site, render.nginx_auth_content(r, key), port=listen)
    (tmp_path / "secrets.env").write_text(f"VLLM_API_KEY={key}\n")
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", upstream_port), _PacedVllm)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    proc = subprocess.Popen(
        [NGINX, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e", str(prefix / "logs/error.log")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{listen}"
    compared = []

    def on_host(tokens: int) -> dict:
        argv = [sys.executable, "-c", programs.script("direct_stream.py")]
        argv += [str(upstream_port), "tiny", str(tmp_path / "secrets.env"), str(tokens), "30", base, "-", "2"]
        out = json.loads(subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout)
        compared.append(out)
        return out

    try:
        wait_listening(proc, listen)
        res = smoke_checks(base, "tiny", key, concurrency=1, stream_attempts=2, compare_on_host=on_host)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        upstream.shutdown()
    check = next(c for c in res.checks if c["name"] == "stream-incremental")
    if buffering == "off":
        assert check["ok"] and not check["warn"] and not compared, check
        assert "attempt" not in check["detail"], check  # the first stream came event by event
    else:
        assert not check["ok"] and len(compared) == 1, check
        assert "the proxy holds responses" in check["detail"], check
        assert "through the proxy 0 of 2" in check["detail"] and "straight from vLLM 2 of 2" in check["detail"], check


@needs_nginx
def test_smoke_tests_reach_their_own_site_on_a_shared_port(tmp_path):
    """Two deployments on one nginx port, told apart by proxy.server_name (allowed by the
    layout): the smoke tests go to the host's address, so they must send the site's name as
    Host, or nginx answers with the port's default site (the other deployment's model)."""
    from vllm_fleet.serving import smoke
    from vllm_fleet.roles.smoke import host_header_for

    listen = _free_port()
    sites, upstreams = [], []
    for name, server_name in (("dep-a", "_"), ("dep-b", "b.example")):
        r = resolved_of("lab-tiny")
        r["name"], r["model"]["served_name"] = name, f"model-{name}"
        r["server"]["port"] = _free_port()
        r["proxy"].update(auth="none", server_name=server_name)
        sites.append(render.render(r)["proxy"][f"/etc/nginx/conf.d/vllm-fleet-{name}.conf"].content)

        class Fake(_FakeVllm):
            served = f"model-{name}"

            def do_GET(self):  # noqa: N802
                if self.path == "/v1/models":
                    self._send(200, json.dumps({"data": [{"id": self.served}]}).encode())
                else:
                    super().do_GET()

        up = http.server.ThreadingHTTPServer(("127.0.0.1", r["server"]["port"]), Fake)
        threading.Thread(target=up.serve_forever, daemon=True).start()
        upstreams.append(up)
        if name == "dep-b":
            spec_b = r
    prefix = _nginx_prefix(tmp_path, "\n".join(sites), None, port=listen)
    proc = subprocess.Popen(
        [NGINX, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e", str(prefix / "logs/error.log")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        base = f"http://127.0.0.1:{listen}"
        smoke.wait_healthy(f"{base}/health", deadline_s=10, interval=0.1)
        assert host_header_for(spec_b) == "b.example"
        with_name = smoke.smoke_checks(
            base,
            "model-dep-b",
            None,
            expect_auth=False,
            host_header=host_header_for(spec_b),
            timeout=10,
            stream_attempts=1,
        )
        without = smoke.smoke_checks(base, "model-dep-b", None, expect_auth=False, timeout=10, stream_attempts=1)
        got, other = (next(c for c in res.checks if c["name"] == "models") for res in (with_name, without))
        assert got["ok"], got
        assert not other["ok"] and "model-dep-a" in other["detail"], other  # the default site answered
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for up in upstreams:
            up.shutdown()
            up.server_close()
