"""A new nginx site that fails `nginx -t` does not stay (vllm_fleet/roles/nginx): the deploy keeps
this deployment's current nginx files before putting new ones, and puts them back (or removes a
file that was not there) when the check fails, before any reload.

- the operations, from a snapshot where the site differs: keep, put, check-or-restore, reload;
  a converged proxy gets none of them (tests/roles/test_host_state.py);
- the keep and check-or-restore commands run for real (sh) on a temporary tree, with a stand-in
  `nginx` that fails while a site holds BROKEN: the files read back with Python as they were.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from pyinfra.facts.files import File, Sha256File
from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus

from vllm_fleet.roles import nginx
from vllm_fleet.host.state import HostState, Snapshot
from test_host_state import _lab, _service_and_nginx, converged_lines


def test_a_changed_site_is_kept_before_its_put_and_checked_after(harness):
    spec, h, node = _lab()
    site = next(p for p in h.files if p.startswith("/etc/nginx/conf.d/"))
    lines = converged_lines(spec, h, node, "k3y", drift=site)
    run = harness.run(
        _service_and_nginx,
        spec,
        h,
        node,
        "k3y",
        facts={
            HostState: lambda query: Snapshot.parse(lines),
            File: {"user": "root"},
            Sha256File: "x",
            SystemdStatus: {},
            SystemdEnabled: {},
        },
    )
    names = [op.name.rsplit(" | ", 1)[-1] for op in run.ops]
    keep = f"Keep the current nginx files of {spec['name']} (put back if nginx -t fails)"
    check = "nginx -t (validate before reload; a failure puts the previous site back)"
    assert (
        names.index(keep)
        < names.index(f"Put {site}")
        < names.index(check)
        < names.index("Reload nginx (config changed)")
    )


def _sh(cmds: list, path: str) -> subprocess.CompletedProcess:
    from vllm_fleet.host.programs import text

    return subprocess.run(
        ["sh", "-c", " && ".join(f"( {text(c)} )" for c in cmds)],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": path},
        timeout=60,
    )


def test_a_site_that_fails_nginx_t_is_put_back_and_a_new_one_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(nginx, "ROLLBACK_DIR", str(tmp_path / "previous"))
    conf = tmp_path / "conf.d"
    conf.mkdir()
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "nginx").write_text(
        f"#!/bin/sh\nif grep -q BROKEN {conf}/*.conf 2>/dev/null; then echo 'nginx: [emerg] a duplicate default "
        "server' >&2; exit 1; fi\necho ok\n"
    )
    (bin_ / "nginx").chmod(0o755)
    path = f"{bin_}:{os.environ['PATH']}"
    site, auth = conf / "vllm-fleet-x.conf", conf / "x-auth.inc"
    site.write_text("server { listen 80 default_server; }\n")
    site.chmod(0o644)
    keep = [str(site), str(auth)]  # the auth include did not exist before

    assert _sh(nginx._keep_commands("x", keep), path).returncode == 0
    site.write_text("server { listen 80 default_server; } # BROKEN\n")
    auth.write_text("secret\n")
    r = _sh([nginx._validate_or_restore("x", keep)], path)
    assert r.returncode == 1
    assert (
        "a duplicate default server" in r.stderr
        and "its previous nginx files are back and nginx was not reloaded" in r.stderr
    )
    assert "nginx -t passes again" in r.stderr
    assert site.read_text() == "server { listen 80 default_server; }\n" and oct(site.stat().st_mode & 0o777) == "0o644"
    assert not auth.exists() and not (tmp_path / "previous" / "x").exists()

    # a good new site: checked, kept, nothing restored
    assert _sh(nginx._keep_commands("x", keep), path).returncode == 0
    site.write_text("server { listen 8080; }\n")
    r = _sh([nginx._validate_or_restore("x", keep)], path)
    assert (
        r.returncode == 0
        and site.read_text() == "server { listen 8080; }\n"
        and not (tmp_path / "previous" / "x").exists()
    )
