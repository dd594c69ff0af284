"""Helpers for lab tests: LabHost (what the `lab_hosts` fixture returns) and lab_cli."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class LabHost:
    name: str
    address: str
    user: str          # the lab user (passwordless sudo); root also accepts the key
    key: str           # private key path
    known_hosts: str   # the lab's known_hosts file (strict checking works with it)

    def ssh_argv(self, user: str | None = None) -> list[str]:
        return ["ssh", "-i", self.key, "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "ConnectTimeout=5",
                "-o", "LogLevel=ERROR", f"{user or self.user}@{self.address}"]

    def ssh(self, command: str, user: str | None = None, check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess:
        res = subprocess.run([*self.ssh_argv(user), command], capture_output=True, text=True,
                             timeout=timeout, stdin=subprocess.DEVNULL)
        if check and res.returncode != 0:
            raise AssertionError(f"{self.name}: ssh {command!r} -> {res.returncode}\n{res.stdout}\n{res.stderr}")
        return res

    def as_dict(self) -> dict:
        return asdict(self)


def lab_cli(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    """Run `python -m vllm_fleet.lab ARGS` (the same code as `vllm-fleet lab ARGS`)."""
    return subprocess.run([sys.executable, "-m", "vllm_fleet.lab", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def run(argv: list[str], env: dict | None = None, timeout: float = 1800) -> subprocess.CompletedProcess:
    """A command as a user runs it, from the checkout, no stdin: .elapsed (s) and .out (stdout +
    stderr: pyinfra logs its table to stderr) added."""
    t0 = time.monotonic()
    r = subprocess.run(argv, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                       timeout=timeout, stdin=subprocess.DEVNULL)
    r.elapsed = time.monotonic() - t0  # type: ignore[attr-defined]
    r.out = r.stdout + r.stderr  # type: ignore[attr-defined]
    return r


def copy_tree(src: "LabHost", dst: "LabHost", path: str) -> float:
    """``path`` (a directory, e.g. an installed env) copied from one lab host to another as root,
    streamed through tar; the seconds it took."""
    t0 = time.monotonic()
    out = subprocess.Popen([*src.ssh_argv("root"), f"tar -C / -cf - {path.lstrip('/')}"], stdout=subprocess.PIPE)
    into = subprocess.run([*dst.ssh_argv("root"), "tar -C / -xf -"], stdin=out.stdout, capture_output=True, timeout=900)
    out.stdout.close()
    assert out.wait(timeout=60) == 0 and into.returncode == 0, into.stderr
    return round(time.monotonic() - t0, 1)


#: What a deploy may change on a host, as plain readers see it (root's find, sha256sum, systemctl,
#: nft, ss): the files under the directories vllm-fleet writes (the environment's tree only to its
#: top, vLLM's caches under /var/lib/vllm-fleet not at all: both stay after `down` by design), the
#: units of the parts it runs, the nftables tables and the listening TCP sockets.
FOOTPRINT = r"""
dirs='/etc/systemd/system /etc/nginx /etc/vllm-fleet /etc/prometheus /etc/default /opt/vllm-fleet'
echo '## files'
find $dirs -maxdepth 4 -path '/opt/vllm-fleet/*/env/*' -prune -o -printf '%p %y %m %u:%g\n' 2>/dev/null | sort
find $(echo $dirs | sed 's#/opt/vllm-fleet##') -type f -exec sha256sum {} + 2>/dev/null | sort -k2
echo '## units'
systemctl list-units --all --plain --no-legend 'vllm*' 'nginx*' 'ray*' 'prometheus*' | awk '{print $1, $2, $3, $4}' | sort
systemctl list-unit-files --no-legend 'vllm*' 'nginx*' 'ray*' 'prometheus*' | awk '{print $1, $2}' | sort
echo '## nft'
nft list tables 2>/dev/null | sort
echo '## listening'
ss -ltnH | awk '{print $4}' | sort -u
"""


def footprint(h: LabHost) -> list[str]:
    """The host's :data:`FOOTPRINT` lines (compare two with :func:`footprint_diff`)."""
    return h.ssh(FOOTPRINT, user="root").stdout.splitlines()


def footprint_diff(before: list[str], after: list[str]) -> list[str]:
    """The lines only one side has, '-' before / '+' after (empty: the same host state)."""
    import difflib

    return [ln for ln in difflib.unified_diff(before, after, lineterm="", n=0) if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
