"""What one read of a host's state asks and answers: a :class:`Query` (paths to stat, hash or
read, directories, users, packages, units, envs, ...), the command that reads all of it in one
round trip (:func:`state_command`: ``vllm_fleet/host/scripts/host_state.sh``; the
:class:`HostState` fact sends it during a deploy, `vllm-fleet diff` through the one transport),
and the :class:`Snapshot` its lines parse into.

A snapshot answers "converged" only when the read completed (its ``end`` line) and the thing
was asked; what was not asked or not read is unknown. How a deploy's roles share one read per
host is vllm_fleet.roles.common.state.

Example::

    from vllm_fleet.host.state import Query, Snapshot, state_command

    query = Query(stat=("/etc/x",), sha=("/etc/x",), units=("nginx.service",))
    line = state_command(query)             # sh -c '<host_state.sh>' host-state stat /etc/x ...
    snap = Snapshot.parse(output_lines)     # the lines it printed
    snap.query = query
    snap.same_content("/etc/x", sha256)
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
from dataclasses import dataclass, fields
from typing import Any

from pyinfra.api import FactBase, StringCommand

from vllm_fleet.host import programs

_TYPES = {"regular file": "file", "regular empty file": "file", "directory": "directory", "symbolic link": "link"}


@dataclass(frozen=True)
class Query:
    """What to read: paths to stat / hash / read, directories to list (``ls``) or walk for files
    (``find``: each file's size; ``tree``: its size, mtime and ctime, listed before any ``sha``
    of the same read is hashed), users, Debian packages, systemd units, Python envs to probe
    (``{python: (dist:NAME | file:RELPATH, ...)}`` as tuples of pairs), shell globs whose
    small files to read (``globs``: e.g. every vllm-fleet unit on the host), paths whose
    filesystem's free bytes to read (``free``: the nearest existing parent's, for a path not
    made yet), the system pythons (``targets``: a command, e.g. ``python3``) for which to
    read what a host's wheels must fit (that python's X.Y, the C library, the machine), the
    GPUs nvidia-smi reports (``gpus``: its ``--query-gpu`` fields, e.g.
    ``name,memory.total``), the compute processes it lists (``gpuapps``: its
    ``--query-compute-apps`` fields) with every process that holds a GPU device open (its cgroup
    and name), and the PCI devices under a sysfs directory (``pci``: e.g.
    ``/sys/bus/pci/devices``, each device's vendor and class). ``debs`` may hold dpkg
    patterns (``nvidia-fabricmanager*``): every package dpkg knows that matches is read."""

    stat: tuple[str, ...] = ()
    sha: tuple[str, ...] = ()
    read: tuple[str, ...] = ()
    ls: tuple[str, ...] = ()
    find: tuple[str, ...] = ()
    tree: tuple[str, ...] = ()
    users: tuple[str, ...] = ()
    debs: tuple[str, ...] = ()
    units: tuple[str, ...] = ()
    ages: tuple[str, ...] = ()
    chats: tuple[str, ...] = ()
    envs: tuple[tuple[str, tuple[str, ...]], ...] = ()
    globs: tuple[str, ...] = ()
    free: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()
    gpus: tuple[str, ...] = ()
    gpuapps: tuple[str, ...] = ()
    pci: tuple[str, ...] = ()

    def __or__(self, other: "Query") -> "Query":
        merged = {}
        for f in fields(self):
            if f.name == "envs":
                envs: dict[str, list[str]] = {}
                for py, args in (*self.envs, *other.envs):
                    envs.setdefault(py, [])
                    envs[py] += [a for a in args if a not in envs[py]]
                merged["envs"] = tuple((py, tuple(a)) for py, a in envs.items())
            else:
                merged[f.name] = tuple(dict.fromkeys((*getattr(self, f.name), *getattr(other, f.name))))
        return Query(**merged)

    def __sub__(self, other: "Query") -> "Query":
        """What this query asks that ``other`` does not (envs: per python, the probes not asked)."""
        left = {}
        for f in fields(self):
            if f.name == "envs":
                have = dict(other.envs)
                left["envs"] = tuple(
                    (py, tuple(a for a in args if a not in have.get(py, ())))
                    for py, args in self.envs
                    if py not in have or any(a not in have[py] for a in args)
                )
            else:
                theirs = set(getattr(other, f.name))
                left[f.name] = tuple(v for v in getattr(self, f.name) if v not in theirs)
        return Query(**left)

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))

    def argv(self) -> list[str]:
        """host_state.sh's arguments (KIND VALUE pairs)."""
        out: list[str] = []
        # tree before sha: a listing taken before the hashing (vllm_fleet.roles.model's stamp)
        for kind, values in (
            ("stat", self.stat),
            ("tree", self.tree),
            ("sha", self.sha),
            ("read", self.read),
            ("ls", self.ls),
            ("find", self.find),
            ("user", self.users),
            ("deb", self.debs),
            ("unit", self.units),
            ("glob", self.globs),
            ("age", self.ages),
            ("chat", self.chats),
            ("free", self.free),
            ("target", self.targets),
            ("gpus", self.gpus),
            ("gpuapps", self.gpuapps),
            ("pci", self.pci),
        ):
            for v in values:
                out += [kind, v]
        code = programs.script("env_probe.py") if self.envs else ""
        for py, args in self.envs:
            out += ["py", py, "pycode", code, "pyargs", " ".join(args) or "-"]
        return out


def state_command(query: Query) -> StringCommand:
    """The one state read's command line: host_state.sh asked ``query`` (the HostState fact
    sends it; so does `vllm-fleet diff` through the one transport)."""
    return programs.shell("host_state.sh", *query.argv())


class HostState(FactBase):
    """
    Everything a :class:`Query` asks, read in one command (``vllm_fleet/host/scripts/host_state.sh``):
    ``host.get_fact(HostState, query=Query(stat=("/etc/x",), units=("nginx.service",)))`` ->
    a :class:`Snapshot` (an empty one, where nothing is known, when the script did not finish).
    """

    def command(self, query: Query) -> StringCommand:
        return state_command(query)

    @staticmethod
    def default() -> "Snapshot":
        return Snapshot()

    def process(self, output: list[str]) -> "Snapshot":
        return Snapshot.parse(output)


class Snapshot:
    """A host's state as :class:`HostState` read it. Every question answers "converged" only
    when the snapshot knows and the state matches; unknown (not asked, not read) answers no, so
    the caller creates pyinfra's own operation, which then decides from its own facts."""

    def __init__(self) -> None:
        self.known = False
        self.stats: dict[str, dict | None] = {}
        self.shas: dict[str, str | None] = {}
        self.reads: dict[str, str | None] = {}
        self.lists: dict[str, list[str]] = {}
        self.finds: dict[str, dict[str, int]] = {}
        self.trees: dict[
            str, dict[str, tuple[int, str, str]]
        ] = {}  # dir asked with ``tree`` -> {rel: (size, mtime, ctime)}
        self.users: dict[str, dict | None] = {}
        self.debs: dict[str, dict] = {}
        self.units: dict[str, dict] = {}
        self.started: dict[str, int] = {}
        self.ages: dict[str, int | None] = {}
        self.chats: dict[str, tuple[str, str]] = {}
        self.envs: dict[str, dict] = {}
        self.globbed: dict[str, dict[str, str | None]] = {}
        self.glob_units: dict[str, tuple[str, str]] = {}  # unit file path -> (is-active, is-enabled)
        self.avail: dict[str, int | None] = {}  # path asked with ``free`` -> bytes available
        self.targets: dict[str, dict[str, str]] = {}  # python asked with ``targets`` -> what wheels must fit
        self.smi: dict[
            str, list[str] | None
        ] = {}  # fields asked with ``gpus`` -> nvidia-smi's lines (None: no nvidia-smi)
        self.apps: dict[
            str, list[str] | None
        ] = {}  # fields asked with ``gpuapps`` -> nvidia-smi's lines (None: no nvidia-smi)
        self.holders: dict[
            int, dict
        ] = {}  # pid -> {"minors": [N of /dev/nvidiaN], "cgroup": path or None, "comm": name}
        self.gpu_minors: dict[str, int] = {}  # GPU UUID -> its /dev/nvidiaN minor (with ``gpuapps``)
        self.pcis: dict[str, list[str]] = {}  # sysfs directory asked with ``pci`` -> "VENDOR CLASS" per device
        self.query = Query()

    def merge(self, other: "Snapshot") -> None:
        """Add what ``other`` read (another query's answers) to this snapshot: known when both are."""
        for name, value in vars(other).items():
            if isinstance(value, dict) and name != "envs":
                getattr(self, name).update(value)
        for py, env in other.envs.items():  # the same env probed for more names: one answer
            mine = self.envs.setdefault(py, {"python": None, "dist": {}, "file": {}, "done": True})
            mine["dist"].update(env["dist"])
            mine["file"].update(env["file"])
            mine["python"] = env["python"] or mine["python"]
            mine["done"] = mine["done"] and env["done"]
        self.known = self.known and other.known
        self.query = self.query | other.query

    @classmethod
    def parse(cls, lines: list[str]) -> "Snapshot":
        """The snapshot from host_state.sh's lines, ``KIND<TAB>KEY<TAB>VALUE`` each (one reader
        per kind: _LINES); a unit's properties are ``unit<TAB>K=V`` lines, a bare ``unit`` starts
        the next unit; ``end``, the last line, says the read completed."""
        s = cls()
        unit: dict[str, str] = {}
        for line in lines:
            kind, _, rest = line.partition("\t")
            key, _, value = rest.partition("\t")
            if kind == "end":
                s.known = True
            elif kind == "unit":
                unit = _unit_line(s, unit, rest)
            elif kind in _LINES:
                _LINES[kind](s, key, value)
        return s

    # -- questions (True only when known and matching) -------------------------------------
    def _asked(self, field: str, value: str) -> bool:
        return self.known and value in getattr(self.query, field)

    def directory_ok(self, path: str, user: str | None = None, group: str | None = None, mode: Any = None) -> bool:
        st = self.stats.get(path) if self._asked("stat", path) else None
        return bool(st and st["type"] == "directory" and _owner_mode_ok(st, user, group, mode))

    def file_ok(
        self, path: str, sha256: str, user: str | None = None, group: str | None = None, mode: Any = None
    ) -> bool:
        st = self.stats.get(path) if self._asked("stat", path) else None
        return bool(
            st
            and st["type"] == "file"
            and self._asked("sha", path)
            and self.shas.get(path) == sha256
            and _owner_mode_ok(st, user, group, mode)
        )

    def regular_file(self, path: str, user: str | None = None, group: str | None = None, mode: Any = None) -> bool:
        """True when the snapshot shows PATH (asked with ``stat``) as a regular file with that
        owner and mode; its content is not compared (nothing says it was hashed)."""
        st = self.stats.get(path) if self._asked("stat", path) else None
        return bool(st and st["type"] == "file" and _owner_mode_ok(st, user, group, mode))

    def same_content(self, path: str, sha256: str) -> bool:
        """True when the snapshot shows PATH as a regular file with this content, whatever its
        owner and mode (a put that would change only those changes nothing a process reads)."""
        st = self.stats.get(path) if self._asked("stat", path) else None
        return bool(st and st["type"] == "file" and self._asked("sha", path) and self.shas.get(path) == sha256)

    def path(self, path: str) -> tuple[bool, dict | None]:
        """``(known, {"type", "user", "group", "mode", "size"} or None when absent)`` of a path asked with ``stat``."""
        if not self._asked("stat", path):
            return False, None
        return True, self.stats.get(path)

    def absent(self, path: str) -> bool:
        return self._asked("stat", path) and self.stats.get(path) is None

    def user_ok(self, name: str, home: str | None = None, shell: str | None = None) -> bool:
        u = self.users.get(name) if self._asked("users", name) else None
        return bool(u and (home is None or u["home"] == home) and (shell is None or u["shell"] == shell))

    def _deb_asked(self, name: str) -> bool:
        return self._asked("debs", name) or (
            self.known and any(fnmatch.fnmatchcase(name, p) for p in self.query.debs if any(c in p for c in "*?["))
        )

    def debs_installed(self, names: list[str] | tuple[str, ...]) -> bool:
        """True when every package (a name asked with ``debs``, or matched by a pattern asked) is
        installed (dpkg's ``ii`` or ``hi``, held: what pyinfra's DebPackages counts)."""
        return all(self._deb_asked(n) and self.debs.get(n, {}).get("installed") for n in names)

    def unit(self, name: str) -> dict | None:
        """``{"LoadState", "ActiveState", "SubState", "UnitFileState", "NRestarts"}`` of a unit, or
        None when not read."""
        return self.units.get(name) if self._asked("units", name) else None

    def started_ago(self, name: str) -> int | None:
        """Seconds since the main process of a unit asked with ``units`` started (None: never, or not read)."""
        return self.started.get(name) if self._asked("units", name) else None

    def chat(self, port: int) -> tuple[str, str] | None:
        """``(HTTP code, response body)`` of the short chat asked with ``chats`` on this port, or
        None when not asked or not read."""
        if not self.known or not any(c.split(" ", 1)[0] == str(port) for c in self.query.chats):
            return None
        return self.chats.get(str(port), ("", ""))

    def age(self, path: str) -> tuple[bool, int | None]:
        """``(known, seconds since PATH was last written, or None when absent)`` of a path asked with ``ages``."""
        if not self._asked("ages", path):
            return False, None
        return True, self.ages.get(path)

    def free(self, path: str) -> tuple[bool, int | None]:
        """``(known, bytes available to unprivileged writers on PATH's filesystem, or None when df
        gave no figure)`` of a path asked with ``free`` (a path not made yet: its nearest existing
        parent's filesystem)."""
        if not self._asked("free", path):
            return False, None
        return True, self.avail.get(path)

    def target(self, python: str = "python3") -> dict[str, str] | None:
        """``{"python": "3.11", "glibc": "2.36", "machine": "x86_64"}``: what the host's wheels must
        fit, for the system ``python`` asked with ``targets`` (a value the host did not report is
        absent: no such python, no ``python``), or None when not read."""
        return dict(self.targets.get(python, {})) if self._asked("targets", python) else None

    def nvidia_smi(self, fields: str) -> tuple[bool, list[str] | None]:
        """``(known, nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits's lines, or None
        when the host has no nvidia-smi)`` of fields asked with ``gpus``. Its message when no
        driver answers is among the lines, as nvidia-smi prints it (stdout)."""
        if not self._asked("gpus", fields):
            return False, None
        return True, self.smi.get(fields)

    def gpu_apps(self, fields: str) -> tuple[bool, list[str] | None, dict[int, dict]]:
        """``(known, nvidia-smi --query-compute-apps=FIELDS --format=csv,noheader,nounits's lines
        or None when the host has no nvidia-smi, {pid: {"minors", "cgroup", "comm"}} of every
        process holding a /dev/nvidiaN open)`` of fields asked with ``gpuapps``."""
        if not self._asked("gpuapps", fields):
            return False, None, {}
        return True, self.apps.get(fields), {p: dict(h) for p, h in self.holders.items()}

    def pci_devices(self, directory: str) -> list[str] | None:
        """``"VENDOR CLASS"`` (sysfs' words: ``0x10de 0x030200``) of every device under a sysfs
        directory asked with ``pci`` ([] when none), or None when not read."""
        return list(self.pcis.get(directory, [])) if self._asked("pci", directory) else None

    def unit_ok(self, name: str, running: bool = True, enabled: bool = True) -> bool:
        u = self.unit(name)
        return bool(
            u
            and u.get("LoadState") == "loaded"
            and (u.get("ActiveState") == "active") == running
            and (u.get("UnitFileState") == "enabled") == enabled
        )

    def content(self, path: str) -> tuple[bool, str | None]:
        """``(known, text or None when absent)`` of a file asked with ``read``."""
        if not self._asked("read", path):
            return False, None
        return True, self.reads.get(path)

    def listing(self, directory: str) -> list[str] | None:
        """Entries of a directory asked with ``ls`` ([] when absent), or None when not read."""
        return self.lists.get(directory, []) if self._asked("ls", directory) else None

    def matching(self, pattern: str) -> dict[str, str | None] | None:
        """``{path: text}`` of the files a glob asked with ``globs`` matched ({} when none), or
        None when not read; a file's text is None when it is not UTF-8 or over 1 MiB (there, but
        its text not sent: host_state.sh)."""
        return self.globbed.get(pattern, {}) if self._asked("globs", pattern) else None

    def unit_file_state(self, path: str) -> tuple[str, str] | None:
        """``(is-active, is-enabled)`` of a unit file a ``globs`` pattern matched, or None when not read."""
        return self.glob_units.get(path) if self.known else None

    def files_under(self, root: str) -> dict[str, int] | None:
        """``{relpath: size}`` of the regular files under ``root`` asked with ``find`` or ``tree``
        ({} when absent), or None."""
        if self._asked("find", root):
            return self.finds.get(root, {})
        tree = self.tree(root)
        return None if tree is None else {rel: size for rel, (size, _, _) in tree.items()}

    def tree(self, root: str) -> dict[str, tuple[int, str, str]] | None:
        """``{relpath: (size, mtime, ctime)}`` of the regular files under a directory asked with
        ``tree`` ({} when absent), or None; the times as the host's find printed them
        (``%T@``, ``%C@``: seconds.nanoseconds), compared as text, never as floats."""
        return dict(self.trees.get(root, {})) if self._asked("tree", root) else None

    def env(self, python: str) -> dict | None:
        """``{"python": "3.11.2" | None, "dist": {name: version|None}, "file": {rel: sha|None}}``
        of an env asked with ``envs``, or None when not read (the python absent: versions None)."""
        e = self.envs.get(python)
        return e if e and e["done"] and self.known else None


# -- one reader per kind of host_state.sh's lines (Snapshot.parse) ---------------------------


def _b64_text(b64: str, errors: str = "strict") -> str | None:
    try:
        return base64.b64decode(b64).decode(errors=errors)
    except (binascii.Error, UnicodeDecodeError):
        return None


def _stat_line(s: Snapshot, key: str, value: str) -> None:
    parts = value.split("\t")
    s.stats[key] = (
        None
        if value == "-" or len(parts) < 5
        else {
            "type": _TYPES.get(parts[0], parts[0]),
            "user": parts[1],
            "group": parts[2],
            "mode": int(parts[3], 8),
            "size": int(parts[4]) if parts[4].isdigit() else None,
        }
    )


def _sha_line(s: Snapshot, key: str, value: str) -> None:
    s.shas[key] = None if value == "-" else value


def _read_line(s: Snapshot, key: str, value: str) -> None:
    s.reads[key] = None if value == "-" else _b64_text(value)


def _ls_line(s: Snapshot, key: str, value: str) -> None:
    s.lists.setdefault(key, [])
    if value != ".":
        s.lists[key].append(value)


def _find_line(s: Snapshot, key: str, value: str) -> None:
    s.finds.setdefault(key, {})
    size, _, rel = value.partition(" ")
    if value != "." and size.isdigit() and rel:
        s.finds[key][rel] = int(size)


def _tree_line(s: Snapshot, key: str, value: str) -> None:
    s.trees.setdefault(key, {})
    parts = value.split(" ", 3)
    if value != "." and len(parts) == 4 and parts[0].isdigit() and parts[3]:
        s.trees[key][parts[3]] = (int(parts[0]), parts[1], parts[2])


def _glob_line(s: Snapshot, key: str, value: str) -> None:
    found = s.globbed.setdefault(key, {})
    path, _, b64 = value.partition("\t")
    if value != "." and path:
        found[path] = None if b64 == "-" else _b64_text(b64)  # `-`: over 1 MiB, there but not sent


def _globunit_line(s: Snapshot, key: str, value: str) -> None:
    active, _, enabled = value.partition("\t")
    s.glob_units[key] = (active, enabled)


def _user_line(s: Snapshot, key: str, value: str) -> None:
    f = value.split(":")
    s.users[key] = None if value == "-" or len(f) < 7 else {"uid": f[2], "gid": f[3], "home": f[5], "shell": f[6]}


def _deb_line(s: Snapshot, key: str, value: str) -> None:
    status, _, version = value.partition("\t")
    s.debs[key] = {"installed": status[:2] in ("ii", "hi"), "version": version}


def _started_line(s: Snapshot, key: str, value: str) -> None:
    if value.lstrip("-").isdigit():
        s.started[key] = int(value)


def _chat_line(s: Snapshot, key: str, value: str) -> None:
    code, _, b64 = value.partition("\t")
    s.chats[key] = (code, _b64_text(b64, errors="replace") or "")


def _age_line(s: Snapshot, key: str, value: str) -> None:
    s.ages[key] = int(value) if value.lstrip("-").isdigit() else None


def _free_line(s: Snapshot, key: str, value: str) -> None:
    s.avail[key] = int(value) if value.isdigit() else None


def _target_line(s: Snapshot, key: str, value: str) -> None:
    name, _, v = value.partition("=")
    found = s.targets.setdefault(key, {})
    if name and v:
        found[name] = v


def _gpus_line(s: Snapshot, key: str, value: str) -> None:
    if value == "-":
        s.smi[key] = None
    elif value == ".":
        s.smi[key] = []
    elif s.smi.get(key) is not None:
        s.smi[key].append(value)


def _gpuapps_line(s: Snapshot, key: str, value: str) -> None:
    if value == "-":
        s.apps[key] = None
    elif value == ".":
        s.apps[key] = []
    elif s.apps.get(key) is not None:
        s.apps[key].append(value)


def _gpupid_line(s: Snapshot, key: str, value: str) -> None:
    minor, _, rest = value.partition("\t")
    cgroup, _, comm = rest.partition("\t")
    if not key.isdigit() or not minor.isdigit():
        return
    h = s.holders.setdefault(int(key), {"minors": [], "cgroup": None if cgroup in ("", "-") else cgroup, "comm": comm})
    if int(minor) not in h["minors"]:
        h["minors"].append(int(minor))


def _gpuminor_line(s: Snapshot, key: str, value: str) -> None:
    if key and value.isdigit():
        s.gpu_minors[key] = int(value)


def _pci_line(s: Snapshot, key: str, value: str) -> None:
    found = s.pcis.setdefault(key, [])
    if value != ".":
        found.append(value)


def _py_line(s: Snapshot, key: str, value: str) -> None:
    env = s.envs.setdefault(key, {"python": None, "dist": {}, "file": {}, "done": False})
    if value == ".":
        env["done"] = True
    elif value.startswith("python "):
        env["python"] = value.split()[1]
    else:
        what, _, pair = value.partition(" ")
        name, _, v = pair.partition("=")
        if what in ("dist", "file"):
            env[what][name] = v or None


def _unit_line(s: Snapshot, unit: dict[str, str], rest: str) -> dict[str, str]:
    """One ``unit`` line: a property of the unit being read (returned), or a new unit (bare line)."""
    if not rest:
        return {}
    k, _, v = rest.partition("=")
    unit[k] = v
    if "Id" in unit:
        s.units[unit["Id"]] = unit
    return unit


_LINES = {
    "stat": _stat_line,
    "sha": _sha_line,
    "read": _read_line,
    "ls": _ls_line,
    "find": _find_line,
    "tree": _tree_line,
    "glob": _glob_line,
    "globunit": _globunit_line,
    "user": _user_line,
    "deb": _deb_line,
    "started": _started_line,
    "chat": _chat_line,
    "age": _age_line,
    "py": _py_line,
    "free": _free_line,
    "target": _target_line,
    "gpus": _gpus_line,
    "gpuapps": _gpuapps_line,
    "gpupid": _gpupid_line,
    "gpuminor": _gpuminor_line,
    "pci": _pci_line,
}


def _owner_mode_ok(st: dict, user: str | None, group: str | None, mode: Any) -> bool:
    if user and st["user"] != user:
        return False
    if group and st["group"] != group:
        return False
    if mode is not None and st["mode"] != int(str(mode).removeprefix("0o") or "0", 8):
        return False
    return True
