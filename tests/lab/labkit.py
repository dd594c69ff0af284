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
    user: str  # the lab user (passwordless sudo); root also accepts the key
    key: str  # private key path
    known_hosts: str  # the lab's known_hosts file (strict checking works with it)

    def ssh_argv(self, user: str | None = None) -> list[str]:
        return [
            "ssh",
            "-i",
            self.key,
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            f"UserKnownHostsFile={self.known_hosts}",
            "-o",
            "ConnectTimeout=5",
            "-o",
            "LogLevel=ERROR",
            f"{user or self.user}@{self.address}",
        ]

    def ssh(
        self, command: str, user: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        res = subprocess.run(
            [*self.ssh_argv(user), command], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
        if check and res.returncode != 0:
            raise AssertionError(f"{self.name}: ssh {command!r} -> {res.returncode}\n{res.stdout}\n{res.stderr}")
        return res

    def as_dict(self) -> dict:
        return asdict(self)


def lab_cli(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    """Run `python -m vllm_fleet.lab ARGS` (the same code as `vllm-fleet lab ARGS`)."""
    return subprocess.run(
        [sys.executable, "-m", "vllm_fleet.lab", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def run(argv: list[str], env: dict | None = None, timeout: float = 1800) -> subprocess.CompletedProcess:
    """A command as a user runs it, from the checkout, no stdin: .elapsed (s) and .out (stdout +
    stderr: pyinfra logs its table to stderr) added."""
    t0 = time.monotonic()
    r = subprocess.run(
        argv,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    r.elapsed = time.monotonic() - t0  # type: ignore[attr-defined]
    r.out = r.stdout + r.stderr  # type: ignore[attr-defined]
    return r


def bridge_tx(bridge: str | None = None) -> int:
    """The lab bridge's own count of the bytes it has sent (/sys/class/net/BRIDGE/statistics/tx_bytes):
    what went from the control machine (and, through NAT, from outside) to the lab hosts, read
    independently of what a deploy says it sent; traffic between two hosts is bridged port to port
    and is not in it. Read it before and after. ``bridge``: default the lab's (its LabConfig)."""
    if bridge is None:
        sys.path.insert(0, str(REPO))
        from vllm_fleet.lab import nspawn

        bridge = nspawn.LabConfig().bridge
    return int((Path("/sys/class/net") / bridge / "statistics" / "tx_bytes").read_text())


def copy_tree(src: "LabHost", dst: "LabHost", path: str) -> float:
    """``path`` (a directory, e.g. an installed env) copied from one lab host to another as root;
    the seconds it took. How: :func:`link_tree` where it can (an nspawn lab on this machine), else
    streamed through tar over ssh."""
    t0 = time.monotonic()
    if not link_tree(src, dst, path):
        out = subprocess.Popen([*src.ssh_argv("root"), f"tar -C / -cf - {path.lstrip('/')}"], stdout=subprocess.PIPE)
        into = subprocess.run(
            [*dst.ssh_argv("root"), "tar -C / -xf -"], stdin=out.stdout, capture_output=True, timeout=900
        )
        out.stdout.close()
        assert out.wait(timeout=60) == 0 and into.returncode == 0, into.stderr
    return round(time.monotonic() - t0, 1)


def _files(h: "LabHost", path: str) -> str:
    """What the host itself sees under ``path``: its files' count and total size (find, over ssh)."""
    count = "awk '{n++; s+=$1} END {printf \"%d %d\\n\", n, s}'"
    return h.ssh(f"find {path} -type f -printf '%s\\n' | {count}", user="root").stdout.strip()


def link_tree(src: "LabHost", dst: "LabHost", path: str) -> bool:
    """``path`` shared from ``src`` to ``dst`` through the lab's host roots on this machine: hard
    links from src's overlay upper dir (/var/lib/vllm-fleet-lab/hosts/SRC/upper/PATH, where a
    deploy's files live) into dst's, one filesystem, so a 3.5 GB env takes a second or two instead
    of writing 3.5 GB again (measured under load 8-9: cp -a 99.7 s, tar | tar 85.0 s; over ssh more).
    dst's overlay is told by dropping the kernel's unused dentries (it may hold a negative one for
    the path: a test checked it was missing), and dst itself must then see every file and byte src
    sees (find over ssh on both). False, nothing linked, when it cannot: not an nspawn lab here,
    ``path`` not all in src's upper dir, already (partly) on dst, or dst not seeing the links
    (they are removed again): the caller copies then.

    The files are shared: a test that changes one in place (not write-then-rename as pip, uv and
    pyinfra do) changes it on src too."""
    sys.path.insert(0, str(REPO))
    from vllm_fleet.lab import nspawn

    cfg = nspawn.LabConfig()
    rel = path.strip("/")
    s_up, d_up = cfg.host_dir(src.name) / "upper" / rel, cfg.host_dir(dst.name) / "upper" / rel
    d_root = cfg.host_dir(dst.name) / "root"
    if not (s_up.is_dir() and os.path.ismount(d_root) and os.path.ismount(cfg.host_dir(src.name) / "root")):
        return False
    want = _files(src, path)
    upper_only = subprocess.run(
        ["sh", "-c", f"find {s_up} -type f | wc -l"], capture_output=True, text=True
    ).stdout.strip()
    if (
        want.split()[0] != upper_only
        or dst.ssh(f"test -e {path}", user="root", check=False).returncode == 0
        or d_up.exists()
    ):
        return False
    (d_root / rel).parent.mkdir(parents=True, exist_ok=True)  # the parents through the overlay (its own upper dirs)
    if subprocess.run(["cp", "-al", str(s_up), str(d_up)], capture_output=True).returncode == 0:
        Path("/proc/sys/vm/drop_caches").write_text("2\n")  # unused dentries and inodes, negative ones too
        if _files(dst, path) == want:
            return True
    subprocess.run(["rm", "-rf", str(d_up)], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("2\n")
    return False


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
systemctl list-units --all --plain --no-legend 'vllm*' 'nginx*' 'ray*' 'prometheus*' |
  awk '{print $1, $2, $3, $4}' | sort
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

    return [
        ln
        for ln in difflib.unified_diff(before, after, lineterm="", n=0)
        if ln[:1] in "+-" and ln[:3] not in ("+++", "---")
    ]
