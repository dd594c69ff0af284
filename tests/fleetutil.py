import os
import shutil
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
DEPLOYMENTS = sorted((REPO / "deployments").glob("*.yaml"))


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the installed `vllm-fleet` console script as a user would (a separate process)."""
    exe = shutil.which("vllm-fleet", path=os.path.dirname(sys.executable)) or shutil.which("vllm-fleet")
    cmd = [exe, *args] if exe else [sys.executable, "-m", "vllm_fleet", *args]
    return subprocess.run(
        cmd, cwd=cwd or REPO, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=120
    )


def require_vllm_venv():
    """The vLLM CPU venv's python; skip (or fail under VLLM_FLEET_REQUIRE_VLLM) when not built."""
    import pytest

    from vllm_fleet.lab import vllmcpu

    if not vllmcpu.is_built():
        msg = f"vLLM CPU venv not built at {vllmcpu.venv_dir()} (python -m vllm_fleet.lab.vllmcpu ensure)"
        if os.environ.get("VLLM_FLEET_REQUIRE_VLLM"):
            pytest.fail(msg + " and VLLM_FLEET_REQUIRE_VLLM is set")
        pytest.skip(msg)
    return vllmcpu.venv_python()


_MODEL_DEPLOY = """
import json, sys
sys.path.insert(0, {repo!r})
from vllm_fleet.render.files import deployment_paths
from vllm_fleet.roles.model import install_model
spec = json.load(open({spec!r}))
install_model(spec=spec, where=deployment_paths(spec))
"""


def write_model_deploy(tmp_path: Path, spec: dict) -> None:
    """A pyinfra deploy file in ``tmp_path`` that runs the model role with ``spec`` (tests of the
    model role through pyinfra's @local connector, for real)."""
    import json

    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "deploy.py").write_text(_MODEL_DEPLOY.format(repo=str(REPO), spec=str(tmp_path / "spec.json")))


def pyinfra_local(tmp_path: Path, *extra: str, yes: bool = True) -> subprocess.CompletedProcess:
    """``pyinfra [-y] EXTRA @local tmp_path/deploy.py``. -y also turns pyinfra's change detection
    off (a --dry --json plan then shows no change whatever the state), so a plan is asked for
    with ``yes=False``."""
    exe = Path(sys.executable).parent / "pyinfra"
    return subprocess.run(
        [str(exe), *(["-y"] if yes else []), *extra, "@local", str(tmp_path / "deploy.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )


def wait_listening(proc: subprocess.Popen, port: int, timeout: float = 10) -> None:
    """Until something accepts on 127.0.0.1:``port``; fails when ``proc`` (the server) exits first."""
    import socket
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else f"exit {proc.returncode}"
            assert time.monotonic() < deadline, f"nothing listens on 127.0.0.1:{port} after {timeout} s"
            time.sleep(0.05)


def health_server():
    """Start a /health stand-in on 127.0.0.1: ``(server, port)``; ``server.shutdown()`` and
    ``server.server_close()`` stop it."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, srv.server_address[1]


def env_state(
    dists: dict | None = None, files: dict | None = None, python: str | None = "3.11.2", target: dict | None = None
) -> dict:
    """Scripted facts: the HostState fact (vllm_fleet.roles.common.state) answering every env probe
    a query asks as host_state.sh prints it: ``dists`` ``{name: version}`` installed (the others,
    and None, absent), ``files`` ``{site-packages relpath: sha256}``; ``python=None``: no python
    in the env (the probe prints nothing but its ``.``); ``target``: what the host's wheels must
    fit (``{"python": "3.11", "glibc": "2.36", "machine": "x86_64"}``), for every python the
    query asks with ``targets`` (None: the host printed none of it)."""
    from vllm_fleet.host.state import HostState, Snapshot

    def answer(query):
        lines = [f"target\t{py}\t{k}={v}" for py in query.targets for k, v in (target or {}).items()]
        for py, args in query.envs:
            if python:
                lines.append(f"py\t{py}\tpython {python}")
                for arg in args:
                    kind, _, name = arg.partition(":")
                    lines.append(
                        f"py\t{py}\t{kind} {name}={(dists if kind == 'dist' else files or {}).get(name) or ''}"
                    )
            lines.append(f"py\t{py}\t.")
        return Snapshot.parse([*lines, "end"])

    return {HostState: answer}


def free_lines(query, free) -> list[str]:
    """host_state.sh's ``free`` lines for every path ``query`` asks with ``free``: ``free`` is the
    bytes available there, an int or ``f(path)`` (None: df gave no figure, the script's ``-``)."""
    out = []
    for path in query.free:
        n = free(path) if callable(free) else free
        out.append(f"free\t{path}\t{'-' if n is None else n}")
    return out


def host_state(
    files: dict | None = None,
    dirs: dict | None = None,
    units: dict | None = None,
    debs: tuple = (),
    complete: bool = True,
) -> dict:
    """Scripted facts: the HostState fact (vllm_fleet.roles.common.state) answering a query's
    stat, sha, read, glob, deb and unit entries as host_state.sh prints them on a host holding
    ``files`` ``{path: text}`` or ``{path: (text, user, group, mode)}`` (root:root 644 when text
    alone), the directories ``dirs`` ``{path: (user, group, mode)}``, the units ``units``
    ``{name: {"ActiveState": ..., "UnitFileState": ...}}`` (loaded; any other unit asked:
    not-found) and the packages ``debs`` installed. ``complete=False``: the read stopped before
    its ``end`` (nothing is known)."""
    import base64
    import hashlib
    from pathlib import PurePosixPath

    from vllm_fleet.host.state import HostState, Snapshot

    def norm(v):
        return (v, "root", "root", 0o644) if isinstance(v, str) else v

    have = {p: norm(v) for p, v in (files or {}).items()}
    b64 = lambda text: base64.b64encode(text.encode()).decode()  # noqa: E731

    def answer(query):
        lines = []
        for p in query.stat:
            if p in have:
                text, user, group, mode = have[p]
                lines.append(f"stat\t{p}\tregular file\t{user}\t{group}\t{mode:o}\t{len(text.encode())}")
            elif p in (dirs or {}):
                user, group, mode = dirs[p]
                lines.append(f"stat\t{p}\tdirectory\t{user}\t{group}\t{mode:o}\t4096")
            else:
                lines.append(f"stat\t{p}\t-")
        lines += [
            f"sha\t{p}\t" + (hashlib.sha256(have[p][0].encode()).hexdigest() if p in have else "-") for p in query.sha
        ]
        lines += [f"read\t{p}\t" + (b64(have[p][0]) if p in have else "-") for p in query.read]
        for g in query.globs:
            lines.append(f"glob\t{g}\t.")
            lines += [f"glob\t{g}\t{p}\t{b64(have[p][0])}" for p in sorted(have) if PurePosixPath(p).match(g)]
        lines += [f"deb\t{d}\tii \t1" for d in query.debs if d in debs]
        for u in query.units:
            props = (
                {"LoadState": "loaded", **units[u]}
                if u in (units or {})
                else {"LoadState": "not-found", "ActiveState": "inactive"}
            )
            lines += [f"unit\tId={u}", *(f"unit\t{k}={v}" for k, v in props.items()), "unit"]
        snap = Snapshot.parse([*lines, *(["end"] if complete else [])])
        snap.query = query  # what was asked, as the roles' read (state._read) and diff's read_host record it
        return snap

    return {HostState: answer}
