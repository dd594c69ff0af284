"""A stand-in for the model hub's HTTP API, just enough for the real ``huggingface_hub``
(``snapshot_download``, ``model_info(files_metadata=True)``) to download a repo from it.

No model hub is reachable from the test machines; this lets the hub download script run with
the library vLLM brings (the same version the hosts get) against an endpoint whose answers
the test controls: a revision that does not exist, a connection cut mid-file, a corrupted file,
a gated repo. The control machine's fleet hub cache (vllm_fleet/fetch/hubcache.py) is tested against it
too, both with huggingface_hub and with its plain-HTTP path: it answers single byte ranges (a
resumed file) and counts what it served.

    hub = StandInHub("org/tiny", "main", {"config.json": b"{}", "model.safetensors": data})
    env HF_ENDPOINT=hub.url ...; hub.requests -> [(method, path, authorization header)]
    hub.served_bytes -> bytes of the files' bodies it sent (the weights crossing the "slow link")
"""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading


class StandInHub:
    def __init__(
        self,
        repo: str,
        revision: str,
        files: dict[str, bytes],
        *,
        cut: dict[str, int] | None = None,
        corrupt: dict[str, int] | None = None,
        gated: bool = False,
        plain: tuple[str, ...] = (),
        address: str = "127.0.0.1",
    ):
        """``cut``: {file: n} the first n GETs of that file close the connection half-way;
        ``corrupt``: {file: n} the first n GETs serve that file with its first byte flipped;
        ``gated``: every request without an Authorization header is refused as the hub refuses
        a gated repo; ``plain``: files kept in git, not LFS (no sha256 in the metadata, only the
        git blob id, as the hub lists small text files); ``address``: where to listen."""
        self.repo, self.revision, self.files = repo, revision, files
        self.commit = (
            revision if re.fullmatch(r"[0-9a-f]{40}", revision) else hashlib.sha1(revision.encode()).hexdigest()
        )
        self.cut, self.corrupt = dict(cut or {}), dict(corrupt or {})
        self.gated, self.plain = gated, set(plain)
        self.requests: list[tuple[str, str, str | None]] = []
        self.served_bytes = 0
        self.ranges: list[tuple[str, str]] = []  # (file, Range header) of every ranged GET
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, code, body=b"", headers=None, cut=False, count=False):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command == "HEAD":
                    return
                if cut:  # half the body, then the connection drops
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    hub.served_bytes += len(body) // 2 if count else 0
                    self.close_connection = True
                    return
                self.wfile.write(body)
                hub.served_bytes += len(body) if count else 0

            def _siblings(self):
                return [
                    {"rfilename": f, "size": len(d), "blobId": _blob(d)}
                    if f in hub.plain
                    else {
                        "rfilename": f,
                        "size": len(d),
                        "blobId": _blob(d),
                        "lfs": {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d), "pointerSize": 134},
                    }
                    for f, d in hub.files.items()
                ]

            def _any(self):
                hub.requests.append((self.command, self.path, self.headers.get("Authorization")))
                path = self.path.split("?")[0]
                not_rev = {
                    "X-Error-Code": "RevisionNotFound",
                    "X-Error-Message": "Invalid rev id",
                    "Content-Type": "application/json",
                }
                api = f"/api/models/{hub.repo}/"
                if hub.gated and not self.headers.get("Authorization"):
                    return self._send(
                        401,
                        b'{"error":"gated"}',
                        {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to model is restricted"},
                    )
                if path.startswith(api + "revision/"):
                    if path[len(api + "revision/") :] not in (hub.revision, hub.commit):
                        return self._send(404, b'{"error":"Invalid rev id"}', not_rev)
                    body = {"id": hub.repo, "sha": hub.commit, "siblings": self._siblings()}
                    return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})
                if path.startswith(api + "tree/"):
                    body = [
                        {"type": "file", "path": f, "size": len(d), "oid": _blob(d)}
                        if f in hub.plain
                        else {
                            "type": "file",
                            "path": f,
                            "size": len(d),
                            "oid": _blob(d),
                            "lfs": {"oid": hashlib.sha256(d).hexdigest(), "size": len(d), "pointerSize": 134},
                        }
                        for f, d in hub.files.items()
                    ]
                    return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})
                pre = f"/{hub.repo}/resolve/"
                if path.startswith(pre):
                    rev, _, name = path[len(pre) :].partition("/")
                    if rev not in (hub.revision, hub.commit):
                        return self._send(404, b"", not_rev)
                    if name not in hub.files:
                        return self._send(404, b"", {"X-Error-Code": "EntryNotFound"})
                    data = hub.files[name]
                    etag = _blob(data) if name in hub.plain else hashlib.sha256(data).hexdigest()
                    headers = {
                        "ETag": f'"{etag}"',
                        "X-Repo-Commit": hub.commit,
                        "Content-Type": "application/octet-stream",
                        "Accept-Ranges": "bytes",
                    }
                    cut = False
                    if self.command == "GET" and hub.cut.get(name, 0) > 0:
                        hub.cut[name] -= 1
                        cut = True
                    if self.command == "GET" and hub.corrupt.get(name, 0) > 0:
                        hub.corrupt[name] -= 1
                        data = bytes([data[0] ^ 0xFF]) + data[1:]
                    if self.command == "GET" and self.headers.get("Range"):
                        hub.ranges.append((name, self.headers["Range"]))
                    m = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
                    if m and int(m.group(1)) < len(data):  # a resumed download: the rest of the file
                        start = int(m.group(1))
                        headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                        return self._send(206, data[start:], headers, cut=cut, count=True)
                    return self._send(200, data, headers, cut=cut, count=True)
                return self._send(404, b"", {"X-Error-Code": "RepoNotFound"})

            do_GET = do_HEAD = _any

        self._srv = http.server.ThreadingHTTPServer((address, 0), Handler)
        threading.Thread(target=self._srv.serve_forever, daemon=True).start()
        self.url = f"http://{address}:{self._srv.server_port}"

    def file_requests(self) -> list[str]:
        """The files fetched with GET (each request once, in order)."""
        pre = f"/{self.repo}/resolve/"
        return [
            p.split("?")[0][len(pre) :].partition("/")[2]
            for m, p, _ in self.requests
            if m == "GET" and p.startswith(pre)
        ]

    def close(self) -> None:
        self._srv.shutdown()
        self._srv.server_close()


def _blob(data: bytes) -> str:
    """The git blob id (what the hub lists as blobId / oid): sha1 of ``blob <size>\\0`` + bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
