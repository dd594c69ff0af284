"""The local lab: N Debian 12 hosts as systemd-nspawn containers booted with --boot on a bridge.

Each host has systemd as PID 1, sshd, a static address on a private bridge, NAT to the outside
(apt, pip), a shared pip cache bind-mounted from the control machine, and lxcfs's per-container
/proc/uptime (so pyinfra's server.reboot sees the reboot). See docs/lab.md.

Everything made lives in the state dir (default /var/lib/vllm-fleet-lab, $VLLM_FLEET_LAB_DIR)
and is recorded in its state.json; caches (rootfs tarball, pip) in /var/cache/vllm-fleet
($VLLM_FLEET_CACHE_DIR). Processes are stopped by PID (PID files, checked against their command
line), never by name.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import hashlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout, or site-packages of an installed wheel
RECIPE = Path(__file__).resolve().parent / "rootfs.sh"  # packaged (the checkout's lab/rootfs.sh links it)
HOST_PACKAGES = ["mmdebstrap", "systemd-container", "iptables", "lxcfs", "zstd", "openssh-client", "iproute2", "fuse3"]
HOST_COMMANDS = {
    "mmdebstrap": "mmdebstrap",
    "systemd-nspawn": "systemd-container",
    "iptables": "iptables",
    "lxcfs": "lxcfs",
    "zstd": "zstd",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "ip": "iproute2",
}
LAB_USER = "lab"
MAX_HOSTS = 50
NSPAWN_REBOOT_RC = 133
MIN_FREE_BUILD = 2 * 1024**3  # rootfs build + tarball
MIN_FREE_HOSTS = 1 * 1024**3  # extracted rootfs + host upper dirs (grows with what deploys install)


class LabError(Exception):
    """An error the user can act on: the message says what to do."""


@dataclass
class LabConfig:
    state_dir: Path = field(
        default_factory=lambda: Path(os.environ.get("VLLM_FLEET_LAB_DIR", "/var/lib/vllm-fleet-lab"))
    )
    cache_dir: Path = field(
        default_factory=lambda: Path(os.environ.get("VLLM_FLEET_CACHE_DIR", "/var/cache/vllm-fleet"))
    )
    bridge: str = field(default_factory=lambda: os.environ.get("VLLM_FLEET_LAB_BRIDGE", "vfleet0"))
    subnet: str = field(default_factory=lambda: os.environ.get("VLLM_FLEET_LAB_SUBNET", "10.10.0.0/24"))

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir)
        self.cache_dir = Path(self.cache_dir)
        try:
            net = ipaddress.ip_network(self.subnet)
        except ValueError as exc:
            raise LabError(f"VLLM_FLEET_LAB_SUBNET={self.subnet!r}: {exc}") from None
        if net.version != 4 or net.num_addresses < 64:
            raise LabError(f"VLLM_FLEET_LAB_SUBNET={self.subnet!r}: use an IPv4 /24 (or larger) private subnet")
        self.net = net
        if len(self.bridge) > 15:
            raise LabError(f"VLLM_FLEET_LAB_BRIDGE={self.bridge!r}: interface names are at most 15 characters")

    # --- layout ---
    def machine(self, name: str) -> str:
        """nspawn's machine name for host ``name``. nspawn names the host side of the veth pair
        `vb-<machine>` (one kernel-wide namespace), so a second lab on another bridge gets its own
        prefix (`5-lab1` on vfleet5) while the default lab keeps plain names; the hostname inside
        stays ``name``."""
        if self.bridge == "vfleet0":
            return name
        tag = self.bridge[len("vfleet") :] if self.bridge.startswith("vfleet") else self.bridge
        return f"{tag[:5]}-{name}"

    @property
    def gateway(self) -> str:
        return str(self.net.network_address + 1)

    def address(self, index: int) -> str:
        return str(self.net.network_address + 10 + index)

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    @property
    def ssh_key(self) -> Path:
        return self.state_dir / "ssh" / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.state_dir / "ssh" / "known_hosts"

    @property
    def rootfs(self) -> Path:
        return self.state_dir / "rootfs"

    @property
    def lxcfs_dir(self) -> Path:
        return self.state_dir / "lxcfs"

    @property
    def pip_cache(self) -> Path:
        return self.cache_dir / "pip"

    @property
    def rootfs_cache(self) -> Path:
        return self.cache_dir / "lab"

    def host_dir(self, name: str) -> Path:
        return self.state_dir / "hosts" / name

    def cgroup_dirs(self, name: str | None = None) -> list[Path]:
        """Where the supervisor of host `name` puts itself (and so its container)."""
        root = Path("/sys/fs/cgroup")
        if (root / "unified").is_dir() and (root / "systemd").is_dir():  # hybrid v1/v2
            bases = [root / "systemd", root / "unified"]
        elif (root / "cgroup.controllers").exists():  # pure v2
            bases = [root]
        else:
            bases = [root / "systemd"]
        tail = Path("vllm-fleet-lab") / self.bridge
        if name:
            tail = tail / name
        return [b / tail for b in bases]


def rootfs_key() -> str:
    """The cache key of the rootfs: a hash of the recipe."""
    h = hashlib.sha256()
    h.update(RECIPE.read_bytes())
    h.update(os.uname().machine.encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- small helpers


def log(msg: str) -> None:
    print(f"lab: {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], check: bool = True, capture: bool = False, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(
        cmd, text=True, stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None, **kw
    )
    if check and res.returncode != 0:
        err = (res.stderr or "").strip() if capture else ""
        raise LabError(f"command failed ({res.returncode}): {' '.join(cmd)}" + (f"\n{err}" if err else ""))
    return res


def pid_alive(pid: int | None, needle: str | None = None) -> bool:
    """True if `pid` runs and (when given) its command line contains `needle` (guards PID reuse)."""
    if not pid:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text(errors="replace")
    if stat.rsplit(")", 1)[-1].split()[0] == "Z":
        return False
    return needle is None or needle in cmdline


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def mounted(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def mounts_under(path: Path) -> list[str]:
    prefix = str(path).rstrip("/") + "/"
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4]
            if mp.startswith(prefix) or mp == str(path):
                out.append(mp)
    return sorted(out, key=len, reverse=True)


def tail(path: Path, lines: int = 30) -> str:
    try:
        data = path.read_bytes()[-20000:].decode(errors="replace")
    except OSError:
        return "(no console log)"
    # the console carries terminal escapes; keep it readable
    import re

    data = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", data).replace("\r", "")
    return "\n".join(data.splitlines()[-lines:])


@contextlib.contextmanager
def lab_lock(cfg: LabConfig):
    Path("/run/lock").mkdir(parents=True, exist_ok=True)
    with open(f"/run/lock/vllm-fleet-lab.{cfg.bridge}.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("another `lab up/down` is running for this lab; waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


# ---------------------------------------------------------------- state


def load_state(cfg: LabConfig) -> dict | None:
    try:
        return json.loads(cfg.state_file.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise LabError(f"{cfg.state_file}: unreadable ({exc}); run `vllm-fleet lab down` to clean up") from None


def save_state(cfg: LabConfig, st: dict) -> None:
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    tmp = cfg.state_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(st, indent=2) + "\n")
    os.replace(tmp, cfg.state_file)


def new_state(cfg: LabConfig) -> dict:
    return {
        "version": 1,
        "bridge": cfg.bridge,
        "subnet": cfg.subnet,
        "gateway": cfg.gateway,
        "state_dir": str(cfg.state_dir),
        "ssh_key": str(cfg.ssh_key),
        "known_hosts": str(cfg.known_hosts),
        "ssh_user": LAB_USER,
        "pip_cache_dir": str(cfg.pip_cache),
        "hosts": [],
        "made": {},
    }


# ---------------------------------------------------------------- preflight


def preflight(cfg: LabConfig) -> None:
    if os.geteuid() != 0:
        raise LabError(
            "the lab needs root (it creates a bridge, a NAT rule, mounts and containers): "
            "run it as root, e.g. `sudo -E vllm-fleet lab up`"
        )
    problems = []
    if "overlay" not in Path("/proc/filesystems").read_text():
        subprocess.run(["modprobe", "overlay"], stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        if "overlay" not in Path("/proc/filesystems").read_text():
            problems.append("overlayfs (kernel module `overlay`; `modprobe overlay`)")
    if not Path("/dev/fuse").exists():
        problems.append("FUSE (/dev/fuse, for lxcfs; `modprobe fuse`)")
    if not Path("/sys/fs/cgroup/systemd").is_dir() and not Path("/sys/fs/cgroup/cgroup.controllers").exists():
        problems.append("a systemd-usable cgroup hierarchy (/sys/fs/cgroup/systemd or cgroup v2)")
    if not Path("/proc/sys/net/ipv4/ip_forward").exists():
        problems.append("IPv4 forwarding (/proc/sys/net/ipv4/ip_forward)")
    if problems:
        raise LabError("missing kernel features: " + "; ".join(problems))


#: inotify instances the control machine's user root may hold (``fs.inotify.max_user_instances``):
#: each booted host's systemd and its services take ~4 of them, all counted against root; the
#: common default of 128 runs out near 28 hosts ("Failed to allocate manager object: Too many
#: open files" in the container's systemd, which then never boots)
INOTIFY_SYSCTL = Path("/proc/sys/fs/inotify/max_user_instances")


def inotify_instances_needed(n: int) -> int:
    """``fs.inotify.max_user_instances`` for a lab of ``n`` hosts: 8 per host (twice what a host's
    systemd takes) and 128 for the rest of the machine."""
    return 128 + 8 * n


def ensure_inotify(n: int, sysctl: Path = INOTIFY_SYSCTL) -> str | None:
    """Raise ``fs.inotify.max_user_instances`` to what ``n`` hosts need when it is lower (never
    lowers it); what was done, for the output, or None."""
    try:
        now = int(sysctl.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    need = inotify_instances_needed(n)
    if now >= need:
        return None
    try:
        sysctl.write_text(f"{need}\n")
    except OSError as exc:
        raise LabError(
            f"{n} hosts need fs.inotify.max_user_instances >= {need} (each host's systemd takes some; it is {now}) "
            f"and it could not be raised ({exc}): `sysctl -w fs.inotify.max_user_instances={need}`"
        ) from None
    return f"raised fs.inotify.max_user_instances from {now} to {need} for {n} hosts (each host's systemd takes ~4)"


def inotify_now(sysctl: Path = INOTIFY_SYSCTL) -> int | None:
    try:
        return int(sysctl.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def restore_inotify(made: dict, sysctl: Path = INOTIFY_SYSCTL) -> str | None:
    """`lab down`: put ``fs.inotify.max_user_instances`` back to what it was before `lab up`
    raised it (``made``: the lab's record), unless it was changed since; what was done, or None."""
    before, mine = made.get("inotify_before"), made.get("inotify_set")
    if before is None:
        return None
    now = inotify_now(sysctl)
    if now != mine:
        return f"left fs.inotify.max_user_instances at {now}: lab up set {mine}, something changed it since"
    try:
        sysctl.write_text(f"{before}\n")
    except OSError as exc:
        return f"could not put fs.inotify.max_user_instances back to {before} ({exc})"
    return f"put fs.inotify.max_user_instances back from {now} to {before}"


def check_disk(path: Path, need: int, what: str) -> None:
    p = path
    while not p.exists():
        p = p.parent
    free = shutil.disk_usage(p).free
    if free < need:
        raise LabError(
            f"not enough disk space for {what} in {path}: {free / 1024**3:.1f} GiB free, "
            f"need {need / 1024**3:.1f} GiB (free some, or point VLLM_FLEET_LAB_DIR / "
            f"VLLM_FLEET_CACHE_DIR at a bigger disk)"
        )


def ensure_host_packages() -> None:
    missing = sorted({pkg for cmd, pkg in HOST_COMMANDS.items() if shutil.which(cmd) is None})
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise LabError(f"missing host tools {missing} and no apt-get: install {' '.join(HOST_PACKAGES)}")
    log(f"installing host packages: {' '.join(HOST_PACKAGES)} (apt-get update first)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run(["apt-get", "update", "-q"], env=env, stdin=subprocess.DEVNULL)
    run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *HOST_PACKAGES], env=env, stdin=subprocess.DEVNULL
    )


def check_network_free(cfg: LabConfig, st: dict) -> None:
    """The bridge name and the subnet must not be in use by anything this lab did not make."""
    if st["made"].get("bridge"):
        return
    if Path(f"/sys/class/net/{cfg.bridge}").exists():
        raise LabError(
            f"interface {cfg.bridge} already exists and this lab did not make it: remove it "
            f"(`ip link del {cfg.bridge}`) if it is a leftover, or pick another name with "
            f"VLLM_FLEET_LAB_BRIDGE"
        )
    addrs = json.loads(run(["ip", "-j", "-4", "addr", "show"], capture=True).stdout or "[]")
    for iface in addrs:
        for a in iface.get("addr_info", []):
            other = ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False)
            if other.overlaps(cfg.net):
                raise LabError(
                    f"subnet {cfg.subnet} overlaps {a['local']}/{a['prefixlen']} on "
                    f"{iface['ifname']}: pick another with VLLM_FLEET_LAB_SUBNET (e.g. 10.99.0.0/24)"
                )


# ---------------------------------------------------------------- rootfs


def ensure_rootfs_tarball(cfg: LabConfig) -> Path:
    key = rootfs_key()
    tarball = cfg.rootfs_cache / f"rootfs-bookworm-{key}.tar.zst"
    if tarball.exists():
        log(f"rootfs: cached {tarball}")
        return tarball
    check_disk(cfg.rootfs_cache, MIN_FREE_BUILD, "the rootfs build")
    cfg.rootfs_cache.mkdir(parents=True, exist_ok=True)
    build = cfg.rootfs_cache / f"build-{key}"
    if build.exists():
        run(["rm", "-rf", "--one-file-system", str(build)])
    log(f"rootfs: building {tarball.name} with {RECIPE.relative_to(REPO_ROOT)} (about a minute)")
    t0 = time.monotonic()
    blog = cfg.rootfs_cache / f"build-{key}.log"
    with open(blog, "w") as out:
        rc = subprocess.run(
            ["bash", str(RECIPE), str(build)], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        ).returncode
    if rc != 0:
        run(["rm", "-rf", "--one-file-system", str(build)], check=False)
        raise LabError(f"rootfs build failed (rc {rc}); last lines of {blog}:\n{tail(blog, 25)}")
    part = tarball.with_name(tarball.name + ".part")
    run(
        [
            "tar",
            "--numeric-owner",
            "--xattrs",
            "--xattrs-include=*",
            "--acls",
            "-I",
            "zstd -T0 -6",
            "-C",
            str(build),
            "-cf",
            str(part),
            ".",
        ]
    )
    os.replace(part, tarball)
    run(["rm", "-rf", "--one-file-system", str(build)])
    log(f"rootfs: built in {time.monotonic() - t0:.0f} s, {tarball.stat().st_size / 1024**2:.0f} MiB")
    # older tarballs of this recipe file are stale now
    for old in cfg.rootfs_cache.glob("rootfs-bookworm-*.tar.zst"):
        if old != tarball:
            old.unlink(missing_ok=True)
    return tarball


def ensure_ssh_key(cfg: LabConfig) -> None:
    if cfg.ssh_key.exists():
        return
    cfg.ssh_key.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "vllm-fleet-lab", "-f", str(cfg.ssh_key)])


def prepare_rootfs(cfg: LabConfig, tarball: Path) -> None:
    """Extract the cached rootfs into the state dir and apply the per-lab settings once."""
    r = cfg.rootfs
    if r.exists():
        run(["rm", "-rf", "--one-file-system", str(r)])
    r.mkdir(parents=True)
    run(
        [
            "tar",
            "--numeric-owner",
            "--xattrs",
            "--xattrs-include=*",
            "--acls",
            "-I",
            "zstd",
            "-C",
            str(r),
            "-xpf",
            str(tarball),
        ]
    )
    pub = cfg.ssh_key.with_suffix(".pub").read_text()
    passwd = {line.split(":")[0]: line.split(":") for line in (r / "etc/passwd").read_text().splitlines()}
    uid, gid = int(passwd[LAB_USER][2]), int(passwd[LAB_USER][3])
    for home, owner in ((r / "root", (0, 0)), (r / "home" / LAB_USER, (uid, gid))):
        ak = home / ".ssh" / "authorized_keys"
        ak.parent.mkdir(mode=0o700, exist_ok=True)
        ak.write_text(pub)
        os.chmod(ak, 0o600)
        os.chown(ak, *owner)
        os.chown(ak.parent, *owner)
    # TLS through an intercepting proxy: trust the control machine's extra CA certificates.
    cas = sorted(Path("/usr/local/share/ca-certificates").glob("**/*.crt"))
    if cas:
        dst = r / "usr/local/share/ca-certificates/vllm-fleet-lab"
        dst.mkdir(parents=True, exist_ok=True)
        for ca in cas:
            shutil.copyfile(ca, dst / ca.name)
        run(["chroot", str(r), "update-ca-certificates"], capture=True)
        bundle = "/etc/ssl/certs/ca-certificates.crt"
        # tools that ship their own CA bundle (a pip upgraded in a venv, requests/certifi, uv)
        (r / "etc/pip.conf").write_text(f"[global]\ncert = {bundle}\n")
        envs = {"PIP_CERT": bundle, "REQUESTS_CA_BUNDLE": bundle, "SSL_CERT_FILE": bundle}
        (r / "etc/environment").write_text("".join(f"{k}={v}\n" for k, v in envs.items()))
        conf = r / "etc/systemd/system.conf.d"
        conf.mkdir(parents=True, exist_ok=True)
        (conf / "10-lab-ca.conf").write_text(
            "[Manager]\nDefaultEnvironment=" + " ".join(f"{k}={v}" for k, v in envs.items()) + "\n"
        )


# ---------------------------------------------------------------- network


def ipt_rules(cfg: LabConfig) -> list[tuple[str, str, list[str]]]:
    tag = ["-m", "comment", "--comment", f"vllm-fleet-lab:{cfg.bridge}"]
    return [
        ("nat", "POSTROUTING", ["-s", cfg.subnet, "!", "-o", cfg.bridge, "-j", "MASQUERADE", *tag]),
        ("filter", "FORWARD", ["-i", cfg.bridge, "-j", "ACCEPT", *tag]),
        ("filter", "FORWARD", ["-o", cfg.bridge, "-j", "ACCEPT", *tag]),
    ]


def network_up(cfg: LabConfig, st: dict) -> None:
    made = st["made"]
    if not Path(f"/sys/class/net/{cfg.bridge}").exists():
        res = run(["ip", "link", "add", cfg.bridge, "type", "bridge"], check=False, capture=True)
        if res.returncode != 0:
            raise LabError(
                f"cannot create bridge {cfg.bridge}: {res.stderr.strip()} "
                "(missing kernel feature: bridge support, `modprobe bridge`?)"
            )
        made["bridge"] = True
        save_state(cfg, st)
        run(["ip", "addr", "add", f"{cfg.gateway}/{cfg.net.prefixlen}", "dev", cfg.bridge])
    run(["ip", "link", "set", cfg.bridge, "up"])
    fwd = Path("/proc/sys/net/ipv4/ip_forward")
    if "ip_forward_before" not in made:
        made["ip_forward_before"] = fwd.read_text().strip()
        save_state(cfg, st)
    fwd.write_text("1\n")
    for table, chain, rule in ipt_rules(cfg):
        if run(["iptables", "-w", "-t", table, "-C", chain, *rule], check=False, capture=True).returncode != 0:
            res = run(["iptables", "-w", "-t", table, "-I", chain, "1", *rule], check=False, capture=True)
            if res.returncode != 0:
                raise LabError(
                    f"cannot add the lab's iptables {table} rule: {res.stderr.strip()} "
                    "(missing kernel feature: netfilter NAT / xt_comment?)"
                )
    made["nat"] = True
    save_state(cfg, st)


def network_down(cfg: LabConfig, st: dict | None) -> None:
    for table, chain, rule in ipt_rules(cfg):
        for _ in range(20):
            if run(["iptables", "-w", "-t", table, "-D", chain, *rule], check=False, capture=True).returncode != 0:
                break
    if Path(f"/sys/class/net/{cfg.bridge}").exists() and st is not None and st["made"].get("bridge"):
        run(["ip", "link", "del", cfg.bridge], check=False, capture=True)
    before = (st or {}).get("made", {}).get("ip_forward_before")
    # Another lab still up (a vfleet* bridge besides ours) needs forwarding for its NAT: leave it on.
    others = [p.name for p in Path("/sys/class/net").glob("vfleet*") if p.name != cfg.bridge]
    if before is not None and not others:
        Path("/proc/sys/net/ipv4/ip_forward").write_text(before + "\n")
    elif before is not None:
        log(f"down: ip_forward left on: another lab is up ({', '.join(sorted(others))})")


# ---------------------------------------------------------------- lxcfs


def lxcfs_up(cfg: LabConfig, st: dict) -> None:
    pidf = cfg.state_dir / "lxcfs.pid"
    if pid_alive(read_pid(pidf), "lxcfs") and mounted(cfg.lxcfs_dir):
        return
    # A mount whose lxcfs is gone (killed, or a machine restored from an image) answers every
    # stat with ENOTCONN: take it off by the mount table before touching the path.
    if mounted(cfg.lxcfs_dir):
        run(["umount", "-l", str(cfg.lxcfs_dir)], check=False, capture=True)
    cfg.lxcfs_dir.mkdir(parents=True, exist_ok=True)
    logf = open(cfg.state_dir / "lxcfs.log", "ab")
    p = subprocess.Popen(
        ["lxcfs", "-f", "-p", str(cfg.state_dir / "lxcfs.lock"), str(cfg.lxcfs_dir)],
        stdin=subprocess.DEVNULL,
        stdout=logf,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    pidf.write_text(f"{p.pid}\n")
    st["made"]["lxcfs"] = True
    save_state(cfg, st)
    deadline = time.monotonic() + 10
    while not (cfg.lxcfs_dir / "proc" / "uptime").exists():
        if p.poll() is not None or time.monotonic() > deadline:
            raise LabError(f"lxcfs did not start (needs FUSE); see {cfg.state_dir / 'lxcfs.log'}")
        time.sleep(0.1)


def lxcfs_down(cfg: LabConfig) -> None:
    pidf = cfg.state_dir / "lxcfs.pid"
    pid = read_pid(pidf)
    if pid_alive(pid, "lxcfs"):
        os.kill(pid, signal.SIGTERM)
        wait_gone(pid, "lxcfs", 5)
        if pid_alive(pid, "lxcfs"):
            os.kill(pid, signal.SIGKILL)
            wait_gone(pid, "lxcfs", 5)
    if mounted(cfg.lxcfs_dir):  # by the mount table: a stale FUSE mount fails exists() with ENOTCONN
        run(["umount", str(cfg.lxcfs_dir)], check=False, capture=True)
        if mounted(cfg.lxcfs_dir):
            run(["umount", "-l", str(cfg.lxcfs_dir)], check=False, capture=True)
    pidf.unlink(missing_ok=True)


def wait_gone(pid: int, needle: str | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while pid_alive(pid, needle):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# ---------------------------------------------------------------- hosts


def host_names(n: int) -> list[str]:
    return [f"lab{i}" for i in range(1, n + 1)]


def etc_hosts(cfg: LabConfig, names: list[str], me: str) -> str:
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    for i, n in enumerate(names, 1):
        lines.append(f"{cfg.address(i)}\t{n}")
    return "\n".join(lines) + "\n"


def nameservers() -> list[str]:
    out = []
    with contextlib.suppress(OSError):
        for line in Path("/etc/resolv.conf").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver" and not parts[1].startswith("127."):
                out.append(parts[1])
    return out


def nspawn_argv(cfg: LabConfig, name: str) -> list[str]:
    return [
        "systemd-nspawn",
        "--quiet",
        "--boot",
        f"--directory={cfg.host_dir(name) / 'root'}",
        f"--machine={cfg.machine(name)}",
        f"--hostname={name}",
        f"--network-bridge={cfg.bridge}",
        "--register=no",
        "--keep-unit",
        "--link-journal=no",
        "--resolv-conf=off",
        "--timezone=off",
        "--console=read-only",
        f"--bind={cfg.pip_cache}:{cfg.pip_cache}",
        f"--bind={cfg.lxcfs_dir}:/var/lib/lxcfs",
    ]


def supervisor_needle(cfg: LabConfig, name: str) -> str:
    return str(cfg.host_dir(name) / "supervisor.json")


def host_pids(cfg: LabConfig, name: str) -> tuple[int | None, int | None]:
    hd = cfg.host_dir(name)
    sup, ns = read_pid(hd / "supervisor.pid"), read_pid(hd / "nspawn.pid")
    return (
        sup if pid_alive(sup, supervisor_needle(cfg, name)) else None,
        ns if pid_alive(ns, f"--machine={cfg.machine(name)}") else None,
    )


def start_host(cfg: LabConfig, st: dict, index: int, names: list[str]) -> None:
    name = names[index - 1]
    hd = cfg.host_dir(name)
    root, upper, work = hd / "root", hd / "upper", hd / "work"
    for d in (root, upper, work):
        d.mkdir(parents=True, exist_ok=True)
    if not mounted(root):
        run(
            [
                "mount",
                "-t",
                "overlay",
                "overlay",
                "-o",
                f"lowerdir={cfg.rootfs},upperdir={upper},workdir={work}",
                str(root),
            ]
        )
    addr = cfg.address(index)
    # per-host files, written through the mounted overlay (they land in the host's upper dir)
    (root / "etc/hostname").write_text(name + "\n")
    (root / "etc/hosts").write_text(etc_hosts(cfg, names, name))
    resolv = root / "etc/resolv.conf"
    if resolv.is_symlink():
        resolv.unlink()
    resolv.write_text("".join(f"nameserver {ns}\n" for ns in nameservers()) or "nameserver 1.1.1.1\n")
    dns = "".join(f"DNS={ns}\n" for ns in nameservers())
    (root / "etc/systemd/network/10-host0.network").write_text(
        f"[Match]\nName=host0\n\n[Network]\nAddress={addr}/{cfg.net.prefixlen}\nGateway={cfg.gateway}\n"
        f"{dns}LinkLocalAddressing=no\nIPv6AcceptRA=no\n"
    )
    hostkey = root / "etc/ssh/ssh_host_ed25519_key"
    if not hostkey.exists():
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{name}", "-f", str(hostkey)])
    (root / str(cfg.pip_cache).lstrip("/")).mkdir(parents=True, exist_ok=True)
    (root / "var/lib/lxcfs").mkdir(parents=True, exist_ok=True)
    # the supervisor: its own cgroup, restarts nspawn when the guest reboots (exit 133)
    cgroups = [str(c) for c in cfg.cgroup_dirs(name)]
    sup_cfg = {
        "name": name,
        "argv": nspawn_argv(cfg, name),
        "cgroups": cgroups,
        "console_log": str(hd / "console.log"),
        "nspawn_pid": str(hd / "nspawn.pid"),
    }
    (hd / "supervisor.json").write_text(json.dumps(sup_cfg, indent=2))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(hd / "supervisor.log", "ab") as slog:
        p = subprocess.Popen(
            [sys.executable, "-m", "vllm_fleet.lab.supervisor", str(hd / "supervisor.json")],
            stdin=subprocess.DEVNULL,
            stdout=slog,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            cwd="/",
        )
    (hd / "supervisor.pid").write_text(f"{p.pid}\n")
    entry = {"name": name, "address": addr, "index": index}
    st["hosts"] = [h for h in st["hosts"] if h["name"] != name] + [entry]
    st["hosts"].sort(key=lambda h: h["index"])
    save_state(cfg, st)


def _cgroup_pids(cfg: LabConfig, name: str) -> set[int]:
    pids: set[int] = set()
    for base in cfg.cgroup_dirs(name):
        if not base.exists():
            continue
        for procs in base.rglob("cgroup.procs"):
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(x) for x in procs.read_text().split())
    return pids


def _rmdir_cgroups(cfg: LabConfig, name: str | None) -> None:
    for base in cfg.cgroup_dirs(name):
        if not base.exists():
            continue
        dirs = sorted((p for p in base.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
        for d in [*dirs, base]:
            with contextlib.suppress(OSError):
                d.rmdir()
    if name is None:  # the shared parent, once no lab uses it
        for base in cfg.cgroup_dirs(None):
            with contextlib.suppress(OSError):
                base.parent.rmdir()


def stop_host(cfg: LabConfig, name: str, timeout: float = 20) -> None:
    sup, ns = host_pids(cfg, name)
    if sup:
        os.kill(sup, signal.SIGTERM)  # the supervisor forwards it: nspawn powers the guest off
    elif ns:
        os.kill(ns, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while (sup and pid_alive(sup, supervisor_needle(cfg, name))) or (
        ns and pid_alive(ns, f"--machine={cfg.machine(name)}")
    ):
        if time.monotonic() > deadline:
            log(f"{name}: did not power off in {timeout:.0f} s; killing it")
            for pid, needle in ((ns, f"--machine={cfg.machine(name)}"), (sup, supervisor_needle(cfg, name))):
                if pid and pid_alive(pid, needle):
                    os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    # whatever is left in the host's cgroups (by PID; only our own cgroup tree)
    for _ in range(3):
        left = _cgroup_pids(cfg, name)
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
    hd = cfg.host_dir(name)
    root = hd / "root"
    for mp in mounts_under(root):
        if run(["umount", mp], check=False, capture=True).returncode != 0:
            run(["umount", "-l", mp], check=False, capture=True)
    _rmdir_cgroups(cfg, name)
    for f in ("supervisor.pid", "nspawn.pid"):
        (hd / f).unlink(missing_ok=True)


def host_running_state(cfg: LabConfig, name: str, address: str, timeout: int = 5, wait: bool = False) -> str:
    cmd = "systemctl is-system-running" + (" --wait" if wait else "")
    res = ssh(cfg, address, cmd, timeout=timeout, check=False)
    out = (res.stdout or "").strip()
    if res.returncode == 255 or not out:
        return "unreachable"
    return out.splitlines()[-1]


def ssh_base(cfg: LabConfig, user: str = "root", connect_timeout: int = 3) -> list[str]:
    return [
        "ssh",
        "-i",
        str(cfg.ssh_key),
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        f"UserKnownHostsFile={cfg.known_hosts}",
        "-o",
        f"ConnectTimeout={connect_timeout}",
        "-o",
        "LogLevel=ERROR",
        "-l",
        user,
    ]


def ssh(
    cfg: LabConfig, address: str, command: str, user: str = "root", timeout: float = 30, check: bool = True
) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(
            [*ssh_base(cfg, user), address, command],
            text=True,
            capture_output=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        res = subprocess.CompletedProcess([], 255, "", "timeout")
    if check and res.returncode != 0:
        raise LabError(f"ssh {user}@{address} {command!r} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def write_known_hosts(cfg: LabConfig, st: dict) -> None:
    lines = []
    for h in st["hosts"]:
        pub = cfg.host_dir(h["name"]) / "root/etc/ssh/ssh_host_ed25519_key.pub"
        with contextlib.suppress(OSError):
            kt, key = pub.read_text().split()[:2]
            lines.append(f"{h['name']},{h['address']} {kt} {key}\n")
    cfg.known_hosts.write_text("".join(lines))


def wait_ready(cfg: LabConfig, st: dict, timeout: float) -> dict[str, str]:
    """Wait until every host answers over SSH and has finished booting."""

    def one(h: dict) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "unreachable"
            state = host_running_state(cfg, h["name"], h["address"], timeout=max(1, min(left, 60)), wait=True)
            if state in ("running", "degraded"):
                return state
            sup, ns = host_pids(cfg, h["name"])
            if not sup:
                return "died"
            time.sleep(0.3)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(st["hosts"]))) as ex:
        results = dict(zip([h["name"] for h in st["hosts"]], ex.map(one, st["hosts"])))
    bad = {n: s for n, s in results.items() if s not in ("running", "degraded")}
    if bad:
        msgs = []
        for n, s in bad.items():
            what = "its supervisor exited" if s == "died" else f"no SSH answer within {timeout:g} s"
            msgs.append(
                f"host {n} never answered ({what}); console log tail "
                f"({cfg.host_dir(n) / 'console.log'}):\n{tail(cfg.host_dir(n) / 'console.log')}"
            )
        raise LabError(
            "\n\n".join(msgs) + "\n\n(the lab is left as is for inspection: "
            "`vllm-fleet lab status`; clean up with `vllm-fleet lab down`)"
        )
    for n, s in results.items():
        if s == "degraded":
            h = next(h for h in st["hosts"] if h["name"] == n)
            failed = ssh(cfg, h["address"], "systemctl --failed --no-legend --plain", check=False).stdout
            log(f"warning: {n} booted degraded; failed units:\n{failed.strip()}")
    return results


# ---------------------------------------------------------------- up / down / status


def _already_up(cfg: LabConfig, st: dict | None, names: list[str]) -> bool:
    """The lab runs exactly these hosts, each with its supervisor and container, over lxcfs and its bridge."""
    return bool(
        st
        and [h["name"] for h in st["hosts"]] == names
        and all(all(host_pids(cfg, x)) for x in names)
        and mounted(cfg.lxcfs_dir)
        and Path(f"/sys/class/net/{cfg.bridge}").exists()
    )


def _ensure_rootfs(cfg: LabConfig, st: dict, tarball: Path) -> None:
    """Restore the rootfs when its recipe changed (or it is missing), unless hosts still run on the old one."""
    key = rootfs_key()
    running = [h["name"] for h in st["hosts"] if any(host_pids(cfg, h["name"]))]
    if st.get("rootfs_key") != key or not (cfg.rootfs / "etc/os-release").exists():
        if running:
            log(
                f"warning: the rootfs recipe changed, but hosts {running} run on the old one; "
                "`lab down && lab up` to use the new one"
            )
        else:
            check_disk(cfg.state_dir, MIN_FREE_HOSTS, "the lab hosts")
            log("rootfs: restoring into the state dir")
            prepare_rootfs(cfg, tarball)
            st["rootfs_key"] = key
            save_state(cfg, st)


def _remove_extra_hosts(cfg: LabConfig, st: dict, names: list[str]) -> None:
    """Stop and delete the hosts beyond the requested ones."""
    for h in list(st["hosts"]):
        if h["name"] not in names:
            log(f"{h['name']}: stopping (not in the requested {len(names)} hosts)")
            stop_host(cfg, h["name"])
            run(["rm", "-rf", "--one-file-system", str(cfg.host_dir(h["name"]))])
            st["hosts"] = [x for x in st["hosts"] if x["name"] != h["name"]]
            save_state(cfg, st)


def _boot_hosts(cfg: LabConfig, st: dict, names: list[str]) -> None:
    """Boot each host that is not running whole (a running one only gets the new /etc/hosts)."""
    for i, name in enumerate(names, 1):
        sup, ns = host_pids(cfg, name)
        if sup and ns:
            (cfg.host_dir(name) / "root/etc/hosts").write_text(etc_hosts(cfg, names, name))
            continue
        if sup or ns:
            stop_host(cfg, name)
        log(f"{name}: booting at {cfg.address(i)}")
        start_host(cfg, st, i, names)


def up(n: int = 3, timeout: float = 180, cfg: LabConfig | None = None) -> dict:
    cfg = cfg or LabConfig()
    if not 1 <= n <= MAX_HOSTS:
        raise LabError(f"--hosts {n}: choose 1..{MAX_HOSTS}")
    preflight(cfg)
    t0 = time.monotonic()
    with lab_lock(cfg):
        st = load_state(cfg)
        names = host_names(n)
        if st and st.get("bridge") not in (None, cfg.bridge):
            raise LabError(f"the lab in {cfg.state_dir} uses bridge {st['bridge']}; run `lab down` first")
        if _already_up(cfg, st, names):
            log(f"already up with {n} host(s)")
            return st
        ensure_host_packages()
        before = inotify_now()
        raised = ensure_inotify(n)
        if raised:
            log(raised)
        st = st or new_state(cfg)
        if not st["hosts"] and not st["made"]:
            check_network_free(cfg, st)
        if raised:  # `down` puts it back
            st["made"].setdefault("inotify_before", before)
            st["made"]["inotify_set"] = inotify_now()
        save_state(cfg, st)
        ensure_ssh_key(cfg)
        _ensure_rootfs(cfg, st, ensure_rootfs_tarball(cfg))
        cfg.pip_cache.mkdir(parents=True, exist_ok=True)
        os.chmod(cfg.pip_cache, 0o1777)
        network_up(cfg, st)
        lxcfs_up(cfg, st)
        _remove_extra_hosts(cfg, st, names)
        _boot_hosts(cfg, st, names)
        write_known_hosts(cfg, st)
        wait_ready(cfg, st, timeout)
        st["up_seconds"] = round(time.monotonic() - t0, 1)
        save_state(cfg, st)
        log(f"up: {n} host(s) ready in {st['up_seconds']} s")
        return st


def down(cfg: LabConfig | None = None) -> bool:
    """Remove everything the lab made; restore ip_forward and the inotify limit. Returns False if
    there was nothing."""
    cfg = cfg or LabConfig()
    if os.geteuid() != 0:
        raise LabError("the lab needs root: run `vllm-fleet lab down` as root")
    with lab_lock(cfg):
        st = load_state(cfg)
        if st and st.get("bridge") and st["bridge"] != cfg.bridge:
            cfg = LabConfig(
                state_dir=cfg.state_dir,
                cache_dir=cfg.cache_dir,
                bridge=st["bridge"],
                subnet=st.get("subnet", cfg.subnet),
            )
        anything = st is not None or cfg.state_dir.exists()
        names = {h["name"] for h in (st or {}).get("hosts", [])}
        if (cfg.state_dir / "hosts").is_dir():
            names |= {p.name for p in (cfg.state_dir / "hosts").iterdir()}
        for name in sorted(names):
            log(f"{name}: stopping")
            stop_host(cfg, name)
        _rmdir_cgroups(cfg, None)
        lxcfs_down(cfg)
        # without a record only our tagged iptables rules go: never a bridge we cannot prove is ours
        network_down(cfg, st)
        said = restore_inotify((st or {}).get("made", {}))
        if said:
            log(said)
        if cfg.state_dir.exists():
            left = mounts_under(cfg.state_dir)
            if left:
                raise LabError(f"still mounted under {cfg.state_dir}: {left}; unmount them and run down again")
            run(["rm", "-rf", "--one-file-system", str(cfg.state_dir)])
        if anything:
            log("down: removed the lab (caches kept in " + str(cfg.cache_dir) + ")")
        else:
            log("down: nothing to do (the lab is not up)")
        return anything


def status(cfg: LabConfig | None = None, probe: bool = True) -> dict:
    cfg = cfg or LabConfig()
    st = load_state(cfg)
    if not st:
        return {"up": False, "hosts": [], "state_dir": str(cfg.state_dir)}
    hosts = []
    for h in st["hosts"]:
        sup, ns = host_pids(cfg, h["name"])
        state = "stopped"
        if sup and ns:
            state = (
                host_running_state(cfg, h["name"], h["address"], timeout=5)
                if probe and os.geteuid() == 0
                else "started"
            )
        rss = 0
        for pid in _cgroup_pids(cfg, h["name"]):
            with contextlib.suppress(OSError, ValueError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        rss += int(line.split()[1])
        hosts.append({**h, "state": state, "supervisor_pid": sup, "nspawn_pid": ns, "rss_mib": round(rss / 1024)})
    return {"up": bool(hosts) and all(h["state"] != "stopped" for h in hosts), **st, "hosts": hosts}


def format_hosts(st: dict) -> str:
    rows = [f"{'HOST':6} {'ADDRESS':12} {'STATE':12} {'RSS':>8}  SSH"]
    for h in st["hosts"]:
        state = h.get("state", "")
        rss = f"{h['rss_mib']} MiB" if "rss_mib" in h else ""
        rows.append(
            f"{h['name']:6} {h['address']:12} {state:12} {rss:>8}  ssh -i {st['ssh_key']} "
            f"-o UserKnownHostsFile={st['known_hosts']} {st['ssh_user']}@{h['address']}"
        )
    rows.append(f"inventory: pyinfra inventory/lab.py ...   pip cache: {st['pip_cache_dir']}")
    return "\n".join(rows)
