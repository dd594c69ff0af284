"""Serve the files of one directory over HTTP under a path only this deploy knows, and nothing
else: the control machine's wheel server (vllm_fleet.fetch.wheelhouse.serve) and the hosts' peer
servers (vllm_fleet.roles.common.peers: a sandboxed transient systemd unit) run this same file.

    python3 serve_files.py DIR ADDRESS PORT [LIST]

Binds ADDRESS:PORT (PORT 0: a free one) and prints the port on stdout. Serves GET/HEAD of
``/TOKEN/NAME`` for the NAMEs fixed at start: LIST's ``files`` keys (a fetch list of
scripts/fetch_files.py: relative paths, ``{name: [size, sha256]}``), else every ``*.whl`` directly
in DIR; 404 for anything else (no listing, no other file, no path outside DIR). The token comes
from $VLLM_FLEET_SERVE_TOKEN, else LIST's ``token`` (LIST may be ``$CREDENTIALS_DIRECTORY/list``:
a root-only file systemd hands to a unit that cannot read it otherwise). Stops when its parent
process is gone (the deploy that started it) or on SIGTERM. Standard library only.
"""

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN_ENV = "VLLM_FLEET_SERVE_TOKEN"


def safe_name(name):
    """A relative path inside the directory: no absolute path, no empty, '.' or '..' part."""
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def names_and_token(directory, listing):
    token = os.environ.get(TOKEN_ENV, "")
    if listing:
        with open(listing) as f:
            want = json.load(f)
        names = {n for n in want["files"] if safe_name(n)}
        token = token or want.get("token", "")
    else:
        names = {n for n in os.listdir(directory) if n.endswith(".whl")}
    return names, token


def make_handler(directory, names, token):
    prefix = f"/{token}/"

    class Files(BaseHTTPRequestHandler):
        """GET/HEAD of ``/TOKEN/NAME`` for the names fixed at start; 404 for anything else."""

        def log_message(self, *args):  # no per-request lines on the deploy's output
            pass

        def _file(self):
            name = self.path[len(prefix) :] if self.path.startswith(prefix) else None
            path = os.path.join(directory, name) if name in names else None
            if path is None or not os.path.isfile(path):
                self.send_error(404)
                return None
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(os.path.getsize(path)))
            self.end_headers()
            return path

        def do_HEAD(self):
            self._file()

        def do_GET(self):
            path = self._file()
            if path:
                with open(path, "rb") as f:
                    # sendfile(2): page cache to socket in the kernel, no copy through Python
                    # (socket.sendfile falls back to read/send where the kernel has none)
                    self.wfile.flush()
                    self.connection.sendfile(f)

    return Files


def main(argv):
    if len(argv) not in (3, 4):
        print("usage: serve_files.py DIR ADDRESS PORT [LIST]", file=sys.stderr)
        return 2
    directory, address, port = argv[0], argv[1], int(argv[2])
    names, token = names_and_token(directory, argv[3] if len(argv) == 4 else None)
    if len(token) < 16:
        print("serve_files: no token (VLLM_FLEET_SERVE_TOKEN or the list's token): nothing served", file=sys.stderr)
        return 2
    httpd = ThreadingHTTPServer((address, port), make_handler(directory, names, token))
    httpd.daemon_threads = True
    print(httpd.server_address[1], flush=True)
    parent = os.getppid()

    def watch_parent():
        while os.getppid() == parent:
            time.sleep(1)
        httpd.shutdown()

    threading.Thread(target=watch_parent, daemon=True).start()
    httpd.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
