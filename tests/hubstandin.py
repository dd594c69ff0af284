"""A stand-in for the model hub's HTTP API, just enough for the real ``huggingface_hub``
(``snapshot_download``, ``model_info(files_metadata=True)``) to download a repo from it.

No model hub is reachable from the test machines; this lets the hub download script run with
the library vLLM brings (the same version the hosts get) against an endpoint whose answers
the test controls: a revision that does not exist, a connection cut mid-file, a corrupted file.

    hub = StandInHub("org/tiny", "main", {"config.json": b"{}", "model.safetensors": data})
    env HF_ENDPOINT=hub.url ...; hub.requests -> [(method, path, authorization header)]
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading


class StandInHub:
    def __init__(self, repo: str, revision: str, files: dict[str, bytes], *, cut: dict[str, int] | None = None,
                 corrupt: dict[str, int] | None = None):
        """``cut``: {file: n} the first n GETs of that file close the connection half-way;
        ``corrupt``: {file: n} the first n GETs serve that file with its first byte flipped."""
        self.repo, self.revision, self.files = repo, revision, files
        self.commit = hashlib.sha1(revision.encode()).hexdigest()
        self.cut, self.corrupt = dict(cut or {}), dict(corrupt or {})
        self.requests: list[tuple[str, str, str | None]] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, code, body=b"", headers=None, cut=False):
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
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def _siblings(self):
                return [{"rfilename": f, "size": len(d),
                         "lfs": {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d), "pointerSize": 134}}
                        for f, d in hub.files.items()]

            def _any(self):
                hub.requests.append((self.command, self.path, self.headers.get("Authorization")))
                path = self.path.split("?")[0]
                not_rev = {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id",
                           "Content-Type": "application/json"}
                api = f"/api/models/{hub.repo}/"
                if path.startswith(api + "revision/"):
                    if path[len(api + "revision/"):] not in (hub.revision, hub.commit):
                        return self._send(404, b'{"error":"Invalid rev id"}', not_rev)
                    body = {"id": hub.repo, "sha": hub.commit, "siblings": self._siblings()}
                    return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})
                if path.startswith(api + "tree/"):
                    body = [{"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest(),
                             "lfs": {"oid": hashlib.sha256(d).hexdigest(), "size": len(d), "pointerSize": 134}}
                            for f, d in hub.files.items()]
                    return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})
                pre = f"/{hub.repo}/resolve/"
                if path.startswith(pre):
                    rev, _, name = path[len(pre):].partition("/")
                    if rev not in (hub.revision, hub.commit):
                        return self._send(404, b"", not_rev)
                    if name not in hub.files:
                        return self._send(404, b"", {"X-Error-Code": "EntryNotFound"})
                    data = hub.files[name]
                    headers = {"ETag": '"' + hashlib.sha256(data).hexdigest() + '"', "X-Repo-Commit": hub.commit,
                               "Content-Type": "application/octet-stream"}
                    cut = False
                    if self.command == "GET" and hub.cut.get(name, 0) > 0:
                        hub.cut[name] -= 1
                        cut = True
                    if self.command == "GET" and hub.corrupt.get(name, 0) > 0:
                        hub.corrupt[name] -= 1
                        data = bytes([data[0] ^ 0xFF]) + data[1:]
                    return self._send(200, data, headers, cut=cut)
                return self._send(404, b"", {"X-Error-Code": "RepoNotFound"})

            do_GET = do_HEAD = _any

        self._srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._srv.server_port}"

    def close(self) -> None:
        self._srv.shutdown()
        self._srv.server_close()
